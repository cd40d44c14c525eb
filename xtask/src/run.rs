//! Running things: plans on disk, the router and the driver as processes, one measured attempt.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use serde::{Deserialize, Serialize};

use fleet::evidence::{EvidenceBounds, EvidenceConfig, EvidenceSampler, EvidenceSummary};
use fleet::{ChildGuard, Fleet};
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

/// Router settings of one cell.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RouterSettings {
    /// `--policy`.
    pub policy: String,
    /// `--model` (the block-key salt).
    pub model: String,
    /// `--seed`.
    pub seed: u64,
    /// `--index-ttl-s`, for belief-index policies.
    pub index_ttl_s: Option<f64>,
    /// `--index-node-cap`, for belief-index policies.
    pub index_node_cap: Option<u64>,
    /// Pass the replicas' KV event endpoints (`--kv-events`).
    pub kv_events: bool,
}

/// Starts the router in front of `fleet`, rows into `rows`, log into `log`.
pub fn start_router(
    bins: &Bins,
    fleet: &Fleet,
    settings: &RouterSettings,
    rows: &Path,
    log: &Path,
) -> Result<(ChildGuard, String)> {
    let mut cmd = Command::new(&bins.router);
    cmd.args(["--host", "127.0.0.1", "--port", "0"])
        .args(["--replicas", &fleet.urls().join(",")])
        .args(["--policy", &settings.policy])
        .arg("--rows")
        .arg(rows)
        .args(["--model", &settings.model])
        .args(["--seed", &settings.seed.to_string()]);
    if settings.kv_events {
        let endpoints: Vec<String> = fleet
            .kv_event_endpoints()
            .into_iter()
            .enumerate()
            .map(|(i, e)| {
                e.ok_or_else(|| {
                    anyhow!(
                        "replica {i} publishes no KV events, which policy {} needs",
                        settings.policy
                    )
                })
            })
            .collect::<Result<_>>()?;
        cmd.args(["--kv-events", &endpoints.join(",")]);
        // Replay endpoints let the router repair sequence gaps; pass them only when all are known.
        let replay: Option<Vec<String>> =
            fleet.replicas().into_iter().map(|r| r.kv_replay).collect();
        if let Some(replay) = replay {
            cmd.args(["--kv-replay", &replay.join(",")]);
        }
    }
    if let Some(ttl) = settings.index_ttl_s {
        cmd.args(["--index-ttl-s", &format!("{ttl}")]);
    }
    if let Some(cap) = settings.index_node_cap {
        cmd.args(["--index-node-cap", &cap.to_string()]);
    }
    let mut guard = ChildGuard::spawn("router", cmd, log)?;
    let ready = guard.wait_ready(Duration::from_secs(30), &interrupt::requested)?;
    Ok((guard, ready.url()))
}

/// Driver settings of one run.
#[derive(Debug, Clone, Serialize)]
pub struct DriverSettings {
    /// `closed` or `open`.
    pub mode: &'static str,
    /// `--warmup-s`.
    pub warmup_s: f64,
    /// `--duration-s`: no new requests after it.
    pub duration_s: Option<f64>,
    /// `--timeout-s` per request.
    pub timeout_s: f64,
    /// `--model`.
    pub model: String,
}

/// Starts `driver closed|open` against `url`.
pub fn start_driver(
    bins: &Bins,
    url: &str,
    plan: &Path,
    out: &Path,
    settings: &DriverSettings,
    log: &Path,
) -> Result<ChildGuard> {
    let mut cmd = Command::new(&bins.driver);
    cmd.arg(settings.mode)
        .args(["--url", url])
        .arg("--plan")
        .arg(plan)
        .arg("--out")
        .arg(out)
        .args(["--model", &settings.model])
        .args(["--warmup-s", &format!("{}", settings.warmup_s)])
        .args(["--timeout-s", &format!("{}", settings.timeout_s)]);
    if let Some(d) = settings.duration_s {
        cmd.args(["--duration-s", &format!("{d}")]);
    }
    ChildGuard::spawn("driver", cmd, log)
}

/// Waits for the driver to exit successfully within `limit`, checking the fleet and Ctrl-C.
/// `on_tick` runs about every 100 ms with the elapsed time (used to start evidence sampling
/// once the warm-up is over).
pub fn wait_driver(
    driver: &mut ChildGuard,
    fleet: &mut Fleet,
    limit: Duration,
    mut on_tick: impl FnMut(Duration) -> Result<()>,
) -> Result<()> {
    let started = Instant::now();
    loop {
        if interrupt::requested() {
            bail!("interrupted");
        }
        if let Some(status) = driver.try_wait()? {
            if status.success() {
                return Ok(());
            }
            bail!(
                "the driver failed ({status}); see its log {}",
                driver.log_path().display()
            );
        }
        fleet.check_alive()?;
        let elapsed = started.elapsed();
        if elapsed > limit {
            bail!(
                "the driver did not finish within {:.0} s; see its log {}",
                limit.as_secs_f64(),
                driver.log_path().display()
            );
        }
        on_tick(elapsed)?;
        std::thread::sleep(Duration::from_millis(100));
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
    pub ingress: crate::haproxy::Ingress,
    /// HAProxy's settings, when it is the ingress.
    pub haproxy: crate::haproxy::HaproxySettings,
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

/// Cycle the fleet, start the router, drive the plan, sample evidence after the warm-up, stop
/// the router (it flushes its rows on SIGTERM) and compute the measured window.
pub fn run_attempt(fleet: &mut Fleet, a: Attempt<'_>) -> Result<AttemptResult> {
    fleet.cycle(&interrupt::requested)?;
    // Cycling restarts processes on new ports: evidence must follow the fleet as it is now.
    let mut evidence_base = a.evidence.clone();
    if a.sample_lateness {
        evidence_base.lateness_urls = fleet.urls();
    }
    evidence_base.fleet_process_groups = fleet.process_groups();
    let (mut ingress, url) = crate::haproxy::IngressProcess::start(
        a.ingress, a.bins, fleet, &a.router, &a.haproxy, a.dir,
    )?;
    let client_csv = a.dir.join("client.csv");
    let mut driver = start_driver(
        a.bins,
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
    wait_driver(&mut driver, fleet, a.limit, |elapsed| {
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
    if let crate::haproxy::IngressProcess::Router(router) = &mut ingress
        && let Some(status) = router.try_wait()?
    {
        bail!(
            "the router exited during the run ({status}); see its log {}",
            router.log_path().display()
        );
    }
    // The router flushes its rows on SIGTERM; HAProxy writes its per-server counts first.
    ingress.finish(a.dir, Duration::from_secs(15))?;
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
    }
}
