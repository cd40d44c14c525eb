//! A point's plan on disk: `<point>/plan.bin` (what the driver replays) and `plan.json` (its
//! names and fingerprints), written once and replayed byte-identical by every policy and
//! repetition.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use serde::{Deserialize, Serialize};

use workload::{ArrivalSpec, Plan, WorkloadSpec};

use crate::cell::write_atomic;

/// A plan written once per point and replayed for every policy and repetition.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanFile {
    /// The plan the driver reads ([`Plan::to_bytes`]: format byte, then MessagePack).
    pub path: PathBuf,
    /// Plan name (content + arrival).
    pub name: String,
    /// Workload (content) name.
    pub workload_name: String,
    /// Content fingerprint.
    pub workload_fingerprint: String,
    /// Whole-plan fingerprint (what the comparison checks).
    pub plan_fingerprint: String,
    /// Requests in the plan.
    pub requests: usize,
}

/// Writes `dir/plan.bin` (+ `plan.json`) for `spec`/`arrival`, or reuses the one already there.
///
/// A plan already on disk must be the same plan (same bytes); otherwise the sweep's parameters
/// changed under a resumed sweep, which would mix workloads, and that is an error.
pub fn ensure_plan(dir: &Path, spec: &WorkloadSpec, arrival: &ArrivalSpec) -> Result<PlanFile> {
    ensure_labelled_plan(dir, spec, arrival, "")
}

/// [`ensure_plan`], with `label` appended to the workload name (and the plan name before its
/// arrival part): what the sweep knows about a point that the plan's parameters do not say, such
/// as the `-load<f>` fraction of the capacity its rate is.
pub fn ensure_labelled_plan(
    dir: &Path,
    spec: &WorkloadSpec,
    arrival: &ArrivalSpec,
    label: &str,
) -> Result<PlanFile> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join("plan.bin");
    let plan = Plan::build(spec, arrival).map_err(|e| anyhow!("building the plan: {e}"))?;
    let bytes = plan
        .to_bytes()
        .map_err(|e| anyhow!("encoding the plan: {e}"))?;
    if path.exists() {
        let old = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        if old != bytes {
            let old_name = Plan::from_bytes(&old)
                .map(|p| p.name())
                .unwrap_or_else(|e| format!("unreadable ({e})"));
            bail!(
                "{} holds plan `{old_name}` but this sweep now asks for `{}`; the sweep's parameters (or its calibration) changed since it started — resume with the same flags, or start a new sweep with --out or --fresh",
                path.display(),
                plan.name()
            );
        }
    } else {
        write_atomic(&path, &bytes)?;
    }
    let file = PlanFile {
        path,
        name: format!("{}{label}-{}", plan.spec.name(), plan.arrival.name()),
        workload_name: format!("{}{label}", plan.spec.name()),
        workload_fingerprint: plan
            .workload_fingerprint_hex()
            .map_err(|e| anyhow!("{e}"))?,
        plan_fingerprint: plan.fingerprint_hex().map_err(|e| anyhow!("{e}"))?,
        requests: plan.request_count(),
    };
    write_atomic(
        &dir.join("plan.json"),
        serde_json::to_string_pretty(&file)?.as_bytes(),
    )?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::scratch::Scratch;

    #[test]
    fn a_plan_is_written_once_and_a_changed_one_refused() {
        let s = Scratch::new("plan-file");
        let spec = WorkloadSpec {
            seed: 3,
            sizing: workload::Sizing::Conversations(8),
            turns: 1,
            ..WorkloadSpec::default()
        };
        let arrival = ArrivalSpec::Closed {
            users: 1,
            think_mean_s: 0.0,
            requests_per_user: 4,
        };
        let first = ensure_plan(&s.0, &spec, &arrival).unwrap();
        assert_eq!(first.requests, 4);
        let bytes = std::fs::read(&first.path).unwrap();
        let again = ensure_plan(&s.0, &spec, &arrival).unwrap();
        assert_eq!(again, first);
        assert_eq!(std::fs::read(&first.path).unwrap(), bytes);
        let recorded: PlanFile =
            serde_json::from_slice(&std::fs::read(s.0.join("plan.json")).unwrap()).unwrap();
        assert_eq!(recorded, first);
        let other = WorkloadSpec { seed: 4, ..spec };
        let err = ensure_plan(&s.0, &other, &arrival).unwrap_err().to_string();
        assert!(err.contains("changed since it started"), "{err}");
    }
}
