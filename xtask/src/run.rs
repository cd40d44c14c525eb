//! Running things: plans on disk, `--ingress`, one measured attempt. The router, HAProxy and
//! the driver are started and stopped through `fleet` (`fleet::ingress`,
//! `fleet::driver_process`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use clap::ValueEnum;
use serde::{Deserialize, Serialize};

use fleet::evidence::{EvidenceBounds, EvidenceConfig, EvidenceSampler, EvidenceSummary};
use fleet::ingress::HaproxySettings;
use fleet::{
    DriverSettings, Fleet, Ingress, IngressProcess, RouterSettings, start_driver, wait_driver,
};
use workload::{ArrivalSpec, Plan, WorkloadSpec};

use crate::cell::{Slo, Window, measured_window};
use crate::env::Bins;
use crate::interrupt;

/// A plan written once per point and replayed for every policy and repetition.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanFile {
    /// The bincode plan the driver reads.
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
        crate::cell::write_atomic(&path, &bytes)?;
    }
    let file = PlanFile {
        path,
        name: plan.name(),
        workload_name: plan.spec.name(),
        workload_fingerprint: plan
            .workload_fingerprint_hex()
            .map_err(|e| anyhow!("{e}"))?,
        plan_fingerprint: plan.fingerprint_hex().map_err(|e| anyhow!("{e}"))?,
        requests: plan.request_count(),
    };
    crate::cell::write_atomic(
        &dir.join("plan.json"),
        serde_json::to_string_pretty(&file)?.as_bytes(),
    )?;
    Ok(file)
}

/// `--ingress`: what sits in front of the replicas (the command-line face of
/// [`fleet::Ingress`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum IngressArg {
    /// kvroute's router (policy from `--policies`).
    Router,
    /// HAProxy with bounded-load consistent hashing on `x-session-id`.
    Haproxy,
}

impl From<IngressArg> for Ingress {
    fn from(arg: IngressArg) -> Ingress {
        match arg {
            IngressArg::Router => Ingress::Router,
            IngressArg::Haproxy => Ingress::Haproxy,
        }
    }
}

/// Everything one measured attempt needs.
pub struct Attempt<'a> {
    /// Binaries.
    pub bins: &'a Bins,
    /// The rep directory (empty, created).
    pub dir: &'a Path,
    /// The plan.
    pub plan: &'a PlanFile,
    /// Router settings.
    pub router: RouterSettings,
    /// Driver settings.
    pub driver: DriverSettings,
    /// Closed-loop users (window rule), `None` for open loop.
    pub closed_users: Option<usize>,
    /// Where the measured window ends at the latest (driver clock), s.
    pub planned_end_s: f64,
    /// SLO for the drift check.
    pub slo: Slo,
    /// Evidence sampling; its URLs and process groups are filled in after the fleet cycles.
    pub evidence: EvidenceConfig,
    /// Scrape each replica's lateness histogram (emulated fleets).
    pub sample_lateness: bool,
    /// What sits in front of the fleet: the router (with `router`) or HAProxy.
    pub ingress: Ingress,
    /// HAProxy's settings, when it is the ingress.
    pub haproxy: HaproxySettings,
    /// Hard limit on the driver's run.
    pub limit: Duration,
}

/// What a finished attempt measured.
#[derive(Debug, Clone)]
pub struct AttemptResult {
    /// The measured window.
    pub window: Window,
    /// Evidence over the measured window.
    pub evidence: EvidenceSummary,
    /// Rows written by the driver.
    pub requests: usize,
    /// Requests inside the window that met the SLO ÷ window length (req/s, for progress only;
    /// the report recomputes everything from rows).
    pub goodput_rps: f64,
}

/// Cycle the fleet, start the ingress (the router or HAProxy), drive the plan, sample evidence
/// after the warm-up, stop the ingress (the router flushes its rows on SIGTERM) and compute the
/// measured window.
pub fn run_attempt(fleet: &mut Fleet, a: Attempt<'_>) -> Result<AttemptResult> {
    fleet.cycle(&interrupt::requested)?;
    // Cycling restarts processes on new ports: evidence must follow the fleet as it is now.
    let mut evidence_base = a.evidence.clone();
    if a.sample_lateness {
        evidence_base.lateness_urls = fleet.urls();
    }
    evidence_base.fleet_process_groups = fleet.process_groups();
    evidence_base.fleet_gpus = fleet.gpus();
    let (mut ingress, url) = IngressProcess::start(
        a.ingress,
        &a.bins.router,
        fleet,
        &a.router,
        &a.haproxy,
        a.dir,
        &interrupt::requested,
    )?;
    let client_csv = a.dir.join("client.csv");
    let mut driver = start_driver(
        &a.bins.driver,
        &url,
        &a.plan.path,
        &client_csv,
        &a.driver,
        &a.dir.join("driver.log"),
    )?;
    let warmup = Duration::from_secs_f64(a.driver.warmup_s);
    let evidence_path = a.dir.join("evidence.jsonl");
    let mut sampler: Option<EvidenceSampler> = None;
    let mut evidence_cfg = Some(evidence_base.clone());
    wait_driver(
        &mut driver,
        fleet,
        a.limit,
        &interrupt::requested,
        |elapsed| {
            if elapsed >= warmup
                && let Some(cfg) = evidence_cfg.take()
            {
                sampler = Some(EvidenceSampler::start(cfg, &evidence_path)?);
            }
            Ok(())
        },
    )?;
    let sampler = match sampler {
        Some(s) => s,
        // The driver ended before the warm-up did; sample once so the cell still has evidence.
        None => EvidenceSampler::start(evidence_base, &evidence_path)?,
    };
    let evidence = sampler.finish()?;
    if let IngressProcess::Router(router) = &mut ingress
        && let Some(status) = router.try_wait()?
    {
        bail!(
            "the router exited during the run ({status}); see its log {}",
            router.log_path().display()
        );
    }
    // The router flushes its rows on SIGTERM; HAProxy writes its per-server counts first.
    if let Some(warning) = ingress.finish(a.dir, Duration::from_secs(15))? {
        eprintln!("xtask: {warning}");
    }
    drop(driver);
    let rows = analysis::read_client_csv(&client_csv)
        .map_err(|e| anyhow!("reading the driver's rows: {e}"))?;
    let sent: Vec<f64> = rows.iter().filter_map(|r| r.sent_s).collect();
    let window = measured_window(&sent, a.driver.warmup_s, a.planned_end_s, a.closed_users)?;
    let slo = analysis::Slo {
        ttft_ms: a.slo.ttft_ms,
        itl_ms: a.slo.itl_ms,
    };
    let good = rows
        .iter()
        .filter(|r| {
            !r.warmup
                && r.sent_s
                    .is_some_and(|t| t >= window.measured_start_s && t < window.measured_end_s)
        })
        .filter(|r| analysis::is_good(r, &slo))
        .count();
    Ok(AttemptResult {
        window,
        evidence,
        requests: rows.len(),
        goodput_rps: good as f64 / (window.measured_end_s - window.measured_start_s),
    })
}

/// Bounds for the evidence check.
pub fn bounds(max_lateness_p99_ms: f64) -> EvidenceBounds {
    EvidenceBounds {
        max_lateness_p99_ms,
        max_throttle_share: None,
    }
}
