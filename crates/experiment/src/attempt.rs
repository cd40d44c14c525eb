//! One measured attempt at a cell: cycle the fleet, start the ingress (the router or HAProxy),
//! drive the plan, sample evidence after the warm-up, stop the ingress and compute the measured
//! window. The processes are started and stopped through `fleet` (`fleet::ingress`,
//! `fleet::driver_process`); what counts as a good request is `analysis`'s.

use std::path::Path;
use std::time::Duration;

use anyhow::{Result, anyhow, bail};

use fleet::evidence::{EvidenceBounds, EvidenceConfig, EvidenceSampler, EvidenceSummary};
use fleet::ingress::HaproxySettings;
use fleet::{
    DriverSettings, Fleet, Ingress, IngressProcess, RouterSettings, start_driver, wait_driver,
};
use schema::{Slo, Window};

use crate::bins::Bins;
use crate::cell::measured_window;
use crate::plan_file::PlanFile;

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
    /// SLO for the goodput on the progress line.
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
/// measured window. Every wait gives up with "interrupted" once `should_stop` says so.
pub fn run_attempt(
    fleet: &mut Fleet,
    a: Attempt<'_>,
    should_stop: &dyn Fn() -> bool,
) -> Result<AttemptResult> {
    fleet.cycle(should_stop)?;
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
        should_stop,
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
    wait_driver(&mut driver, fleet, a.limit, should_stop, |elapsed| {
        if elapsed >= warmup
            && let Some(cfg) = evidence_cfg.take()
        {
            sampler = Some(EvidenceSampler::start(cfg, &evidence_path)?);
        }
        Ok(())
    })?;
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
    let good = rows
        .iter()
        .filter(|r| {
            !r.warmup
                && r.sent_s
                    .is_some_and(|t| t >= window.measured_start_s && t < window.measured_end_s)
        })
        .filter(|r| analysis::is_good(r, &a.slo))
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
