//! One measured attempt at a cell: cycle the fleet, start the ingress (the router or HAProxy),
//! drive the plan, sample evidence after the warm-up, stop the ingress and compute the measured
//! window. The processes are started and stopped through `fleet` (`fleet::ingress`,
//! `fleet::driver_process`); what counts as a good request is `analysis`'s. Also the evidence
//! bounds a cell is checked against, from its calibration ([`bounds`]).

use std::path::Path;
use std::time::Duration;

use anyhow::{Result, anyhow};

use serde::Serialize;

use fleet::evidence::{EvidenceBounds, EvidenceConfig, EvidenceSampler, EvidenceSummary};
use fleet::ingress::HaproxySettings;
use fleet::{
    DriverSettings, Fleet, Ingress, IngressProcess, RouterSettings, start_driver, wait_driver,
};
use schema::{Slo, Window};

use crate::bins::Bins;
use crate::calibration::{Calibration, LatenessBound, ThrottleBound, lateness_bound};
use crate::cell::measured_window;
use crate::fleet_spec::FleetKind;
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
    /// What sits in front of the fleet: the router (with `router`), HAProxy, Envoy with the
    /// endpoint picker, or several routers behind HAProxy.
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
    /// The router's worker threads, from its readiness line (`None` behind HAProxy).
    pub router_workers: Option<u64>,
    /// How the router's threads were scheduled, from its readiness line (`None` behind
    /// HAProxy).
    pub router_scheduling: Option<String>,
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
    ingress.check_running()?;
    let router_workers = ingress.router_workers();
    let router_scheduling = ingress.router_scheduling();
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
                && analysis::metrics::window_time_s(r, window.clock)
                    .is_some_and(|t| window.contains(t))
        })
        .filter(|r| analysis::is_good(r, &a.slo, window.clock))
        .count();
    Ok(AttemptResult {
        window,
        evidence,
        requests: rows.len(),
        goodput_rps: good as f64 / (window.measured_end_s - window.measured_start_s),
        router_workers,
        router_scheduling,
    })
}

/// The evidence bounds of a cell and the rules that set them (`meta.run.evidence_bounds`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CellBounds {
    /// Engine lateness p99, in model time and in wall time at the fleet's speed.
    pub lateness: LatenessBound,
    /// The calibrated throttle bound: command fleets whose cards NVML read; never on an emulated
    /// fleet, which runs no GPU checks.
    pub throttle: Option<ThrottleBound>,
}

impl CellBounds {
    /// What the evidence check compares.
    pub fn evidence(&self) -> EvidenceBounds {
        EvidenceBounds {
            max_lateness_p99_ms: self.lateness.p99_wall_ms,
            max_throttle_share: self.throttle.as_ref().map(|t| t.max_share),
        }
    }
}

/// The bounds of a cell on a `kind` fleet at `speed` under `cal`: lateness p99 ≤
/// `lateness_share` × the ITL floor in model time ([`crate::calibration::lateness_bound`]), and
/// the calibration's throttle bound on command fleets only.
pub fn bounds(cal: &Calibration, kind: FleetKind, speed: f64, lateness_share: f64) -> CellBounds {
    bounds_from(
        &cal.floors,
        cal.gpu_throttle_bound.as_ref(),
        kind,
        speed,
        lateness_share,
    )
}

/// [`bounds`] from the floors and throttle bound themselves (a fault run given its SLO outright
/// has floors but no calibration).
pub fn bounds_from(
    floors: &Slo,
    throttle: Option<&ThrottleBound>,
    kind: FleetKind,
    speed: f64,
    lateness_share: f64,
) -> CellBounds {
    CellBounds {
        lateness: lateness_bound(floors, speed, lateness_share),
        throttle: match kind {
            FleetKind::Command => throttle.cloned(),
            FleetKind::Emulated | FleetKind::Static | FleetKind::Llama | FleetKind::Vllm => None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::calibration::THROTTLE_SHARE_MARGIN;

    fn calibration(itl_floor_ms: f64, throttle: Option<ThrottleBound>) -> Calibration {
        let mut cal: Calibration = serde_json::from_value(serde_json::json!({
            "fleet": {"source": "emulated", "replicas": 3, "speed": 6.0, "slowdowns": [],
                      "num_gpu_blocks": 4096, "model": "m", "detail": null},
            "replicas": [], "used_replicas": [0, 1, 2],
            "floors": {"ttft_ms": 60.0, "itl_ms": itl_floor_ms}, "slo_factor": 3.0,
            "slo": {"ttft_ms": 180.0, "itl_ms": 3.0 * itl_floor_ms}, "capacity_tokens": 196608,
            "index": {"ttl_s": null, "node_cap": null, "honoured_share": null, "detail": null},
            "gpus": [], "gpu_status": "no GPU", "reference_run": null, "git_rev": null,
            "versions": null
        }))
        .unwrap();
        cal.gpu_throttle_bound = throttle;
        cal
    }

    /// At speed 6 an ITL floor of 1.311 ms wall is 7.866 ms of model time; the bound is a
    /// quarter of that in model time and a sixth of it in wall time — not the 5 ms wall (30 ms
    /// model, more than the 23.6 ms ITL SLO) of a fixed wall bound.
    #[test]
    fn the_lateness_bound_is_a_share_of_the_itl_floor_in_model_time() {
        let cal = calibration(1.311, None);
        let b = bounds(&cal, FleetKind::Emulated, 6.0, 0.25);
        assert!((b.lateness.itl_floor_model_ms - 7.866).abs() < 1e-9);
        assert!((b.lateness.p99_model_ms - 1.9665).abs() < 1e-9);
        assert!((b.lateness.p99_wall_ms - 1.9665 / 6.0).abs() < 1e-9);
        assert_eq!(b.evidence().max_lateness_p99_ms, b.lateness.p99_wall_ms);
        assert!(b.lateness.p99_model_ms < cal.slo.itl_ms * 6.0 / 3.0);
        // The same fleet twice as fast: the same model-time bound, half the wall bound.
        let fast = calibration(1.311 / 2.0, None);
        let b2 = bounds(&fast, FleetKind::Emulated, 12.0, 0.25);
        assert!((b2.lateness.p99_model_ms - b.lateness.p99_model_ms).abs() < 1e-9);
        assert!((b2.lateness.p99_wall_ms - b.lateness.p99_wall_ms / 2.0).abs() < 1e-9);
    }

    #[test]
    fn the_throttle_bound_comes_from_the_calibration_on_command_fleets_only() {
        let bound = ThrottleBound {
            max_share: 0.1 + THROTTLE_SHARE_MARGIN,
            peers_median_share: 0.1,
            margin: THROTTLE_SHARE_MARGIN,
            rule: "r".into(),
        };
        let cal = calibration(7.8, Some(bound.clone()));
        let command = bounds(&cal, FleetKind::Command, 1.0, 0.25);
        assert_eq!(command.evidence().max_throttle_share, Some(bound.max_share));
        assert_eq!(command.throttle, Some(bound));
        // An emulated fleet runs no GPU checks, whatever the calibration holds.
        for kind in [FleetKind::Emulated, FleetKind::Static] {
            let b = bounds(&cal, kind, 6.0, 0.25);
            assert_eq!(b.evidence().max_throttle_share, None, "{kind:?}");
        }
    }
}
