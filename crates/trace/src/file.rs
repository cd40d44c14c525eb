//! The replay's parameters on disk: a sweep writes one per point (`trace-plan.json`) and every
//! cell's driver replays it (`driver replay --plan FILE`). It names the trace file and the hash
//! of its bytes, the mapping, and the plan it must produce; the driver refuses a trace whose
//! bytes, or a plan whose fingerprint, differ from what the sweep recorded.

use serde::{Deserialize, Serialize};

use crate::TraceError;
use crate::replay::{ReplayPlan, ReplaySpec, StageRun};

/// A replay written once and replayed by every policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplayFile {
    /// The trace file to open (a path, as the writer resolved it).
    pub trace: String,
    /// xxh3-64 of the trace's bytes, 16 hex digits.
    pub trace_hash: String,
    /// The mapping.
    pub spec: ReplaySpec,
    /// The plan's name ([`ReplayPlan::name`]).
    pub name: String,
    /// Its content name ([`ReplayPlan::workload_name`]).
    pub workload_name: String,
    /// Its content fingerprint.
    pub workload_fingerprint: String,
    /// Its arrival-plan fingerprint.
    pub plan_fingerprint: String,
    /// Requests in the plan.
    pub requests: usize,
    /// The load-ladder stages of a generated trace, as runs of lines; absent for a trace without
    /// stages (every file written before they existed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<StageRun>,
}

impl ReplayFile {
    /// The record of `plan`, built from the trace at `trace_path`.
    pub fn new(trace_path: &str, plan: &ReplayPlan) -> ReplayFile {
        ReplayFile {
            trace: trace_path.to_string(),
            trace_hash: plan.trace_hash_hex(),
            spec: *plan.spec(),
            name: plan.name(),
            workload_name: plan.workload_name(),
            workload_fingerprint: plan.workload_fingerprint_hex(),
            plan_fingerprint: plan.fingerprint_hex(),
            requests: plan.len(),
            stages: plan.stage_runs().to_vec(),
        }
    }

    /// Checks that `plan` (built from the file's trace and spec) is the plan recorded.
    pub fn check(&self, plan: &ReplayPlan) -> Result<(), TraceError> {
        if plan.trace_hash_hex() != self.trace_hash {
            return Err(TraceError::Spec(format!(
                "{} now hashes to {}, but the replay was recorded for {}: the trace changed",
                self.trace,
                plan.trace_hash_hex(),
                self.trace_hash
            )));
        }
        if plan.fingerprint_hex() != self.plan_fingerprint {
            return Err(TraceError::Spec(format!(
                "the replay of {} builds plan {} ({}), not the recorded {} ({})",
                self.trace,
                plan.name(),
                plan.fingerprint_hex(),
                self.name,
                self.plan_fingerprint
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse::Trace;

    #[test]
    fn a_changed_trace_or_plan_is_refused() {
        let text =
            r#"{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}"#;
        let t = Trace::parse_bytes("t", text.as_bytes()).unwrap();
        let plan = ReplayPlan::build(&t, &ReplaySpec::default()).unwrap();
        let file = ReplayFile::new("t", &plan);
        file.check(&plan).unwrap();
        let json = serde_json::to_string(&file).unwrap();
        assert_eq!(serde_json::from_str::<ReplayFile>(&json).unwrap(), file);
        let changed = Trace::parse_bytes("t", format!("{text}\n").as_bytes()).unwrap();
        let err = file
            .check(&ReplayPlan::build(&changed, &ReplaySpec::default()).unwrap())
            .unwrap_err();
        assert!(err.to_string().contains("the trace changed"), "{err}");
        let other = ReplayPlan::build(
            &t,
            &ReplaySpec {
                time_scale: 2.0,
                ..ReplaySpec::default()
            },
        )
        .unwrap();
        let err = file.check(&other).unwrap_err();
        assert!(err.to_string().contains("not the recorded"), "{err}");
    }
}
