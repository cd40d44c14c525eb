//! `cargo xtask fault kill|drain` (DESIGN.md §3.12): steady open-loop load at the frozen point
//! (working set 1, skew 0) through the router, one replica faulted mid-run and restarted, then
//! the loss bounds checked against the rows and the timeline of figure 6 written. This module is
//! the procedure (fleet, router admin API, clock probes, repetitions, files); what the rows show
//! (loss bounds, clock alignment, windows, summary, timeline) is `analysis::fault`.
//!
//! - `kill`: SIGKILL the victim, with no warning, at a moment the router counts requests in
//!   flight on it; restart it after 60 s of model time (÷ speed). Only requests in flight on the
//!   victim at the kill may be lost; none that were not yet dispatched.
//! - `drain`: `POST /admin/replicas/{id}/drain`, wait for its outstanding count to reach 0, stop
//!   it, restart it after the same outage, `…/undrain`. Nothing may be lost.
//!
//! Layout: `measurements/fault-<kind>[-quick]/<point>/<policy>/rep-<k>/` holds the rows of every
//! sweep (`client.csv`, `router.csv`, `evidence.jsonl`, `meta.json`) plus `fault.json` (the
//! fault's instants on every clock); beside them `timeline.csv` (docs/CONTRACTS.md, "Fault
//! timeline"), `summary.md` and `summary.json`.
//!
//! Clocks: the fault is timed on this process's clock; a few deliberately malformed requests
//! (`x-request-id: fault-clock-probe-*`, answered 400 by the router before any routing) let
//! `analysis::fault` place it on the router's and the driver's clocks.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

use analysis::fault::{
    ClockProbe, FaultEvents, FaultKind, Instants, PROBE_PREFIX, analyse_rep, probe_offset,
    router_minus_driver,
};
use fleet::evidence::{EvidenceConfig, EvidenceSampler};
use fleet::{DriverSettings, Fleet, RouterSettings, http};
use workload::{ArrivalSpec, Sizing, WorkloadSpec};

use crate::calibration::{self, CalibrateArgs, Calibration};
use crate::cell::{self, CellState, Meta, Slo, Window};
use crate::env::Bins;
use crate::fleetargs::{FleetArgs, FleetKind};
use crate::grid;
use crate::interrupt;
use crate::progress::Progress;
use crate::run::{self, PlanFile};

/// The policies faulted by default: the hashing baseline and the cache-aware router with its
/// spill branch on and off (the branch that decides where a dead replica's sessions go).
pub const DEFAULT_POLICIES: &[&str] = &[
    "session-affinity",
    "prefix-affinity",
    "prefix-affinity-spill-off",
];

/// Which fault, as the command line names it (`analysis::fault::FaultKind` for the rest; clap's
/// derive needs a type of this crate).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KindArg {
    /// SIGKILL mid-request, no warning.
    Kill,
    /// Drain through the router's admin API, then stop.
    Drain,
}

impl From<KindArg> for FaultKind {
    fn from(k: KindArg) -> FaultKind {
        match k {
            KindArg::Kill => FaultKind::Kill,
            KindArg::Drain => FaultKind::Drain,
        }
    }
}

/// Flags of `cargo xtask fault`.
#[derive(Debug, Clone, Args)]
pub struct FaultArgs {
    /// Which fault.
    #[arg(value_enum)]
    pub kind: KindArg,
    /// Small fleet and short phases (3 replicas by default).
    #[arg(long)]
    pub quick: bool,
    /// Repetitions per policy (the timeline takes the median per second).
    #[arg(long, default_value_t = 1)]
    pub reps: u32,
    /// Policies to fault, comma-separated (default: session-affinity, prefix-affinity,
    /// prefix-affinity-spill-off).
    #[arg(long, value_delimiter = ',')]
    pub policies: Vec<String>,
    /// Open-loop rate, requests per second of model time (wall rate = rate × speed). Default:
    /// 0.8 × replicas, the middle of the `load` sweep.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Fleet index of the replica to fault (= its router id).
    #[arg(long, default_value_t = 0)]
    pub victim: usize,
    /// Warm-up, wall s (default 10, or 3 with --quick).
    #[arg(long)]
    pub warmup_s: Option<f64>,
    /// Steady load after the warm-up and before the fault, wall s (default 30, or 10 with --quick).
    #[arg(long)]
    pub before_s: Option<f64>,
    /// How long the replica stays down, s of model time (wall = ÷ speed).
    #[arg(long, default_value_t = 60.0)]
    pub outage_model_s: f64,
    /// Load kept running after the planned restart, wall s (default 60, or 20 with --quick).
    #[arg(long)]
    pub after_s: Option<f64>,
    /// How long to wait for the victim to have a request in flight before faulting it, wall s.
    #[arg(long, default_value_t = 10.0)]
    pub inflight_wait_s: f64,
    /// Root of the measurements.
    #[arg(long, default_value = "measurements")]
    pub out: PathBuf,
    /// Directory name (default `fault-<kind>`, `-quick` appended with --quick).
    #[arg(long)]
    pub sweep_dir_name: Option<String>,
    /// Calibration to use (run first when missing or made for another fleet), unless the SLO is
    /// given with --slo-ttft-ms/--slo-itl-ms.
    #[arg(long, default_value = "measurements/calibration.json")]
    pub calibration: PathBuf,
    /// Recalibrate even when the calibration matches.
    #[arg(long)]
    pub recalibrate: bool,
    /// Skip calibration: TTFT bound of the SLO, ms (the KV capacity is read from the replicas).
    #[arg(long, requires = "slo_itl_ms")]
    pub slo_ttft_ms: Option<f64>,
    /// Skip calibration: per-request ITL p50 bound of the SLO, ms.
    #[arg(long, requires = "slo_ttft_ms")]
    pub slo_itl_ms: Option<f64>,
    /// Delete the directory first instead of resuming it.
    #[arg(long)]
    pub fresh: bool,
    /// Per-request timeout, wall s.
    #[arg(long, default_value_t = 60.0)]
    pub request_timeout_s: f64,
    /// Seconds between evidence samples.
    #[arg(long, default_value_t = 1.0)]
    pub evidence_interval_s: f64,
    /// Workload seed.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Use the binaries already in target/release.
    #[arg(long)]
    pub no_build: bool,
    /// The fleet.
    #[command(flatten)]
    pub fleet: FleetArgs,
}

impl FaultArgs {
    fn kind(&self) -> FaultKind {
        self.kind.into()
    }
    fn warmup(&self) -> f64 {
        self.warmup_s.unwrap_or(if self.quick { 3.0 } else { 10.0 })
    }
    fn before(&self) -> f64 {
        self.before_s
            .unwrap_or(if self.quick { 10.0 } else { 30.0 })
    }
    fn after(&self) -> f64 {
        self.after_s.unwrap_or(if self.quick { 20.0 } else { 60.0 })
    }
    fn outage_wall_s(&self) -> f64 {
        self.outage_model_s / self.fleet.effective_speed()
    }
    fn run_s(&self) -> f64 {
        self.warmup() + self.before() + self.outage_wall_s() + self.after()
    }
    /// The sweep directory.
    pub fn dir(&self) -> PathBuf {
        let name = self.sweep_dir_name.clone().unwrap_or_else(|| {
            let base = format!("fault-{}", self.kind().as_str());
            if self.quick {
                format!("{base}-quick")
            } else {
                base
            }
        });
        self.out.join(name)
    }
    fn check(&self) -> Result<()> {
        if self.reps == 0 {
            bail!("--reps must be at least 1");
        }
        for (name, v) in [
            ("--warmup-s", self.warmup()),
            ("--before-s", self.before()),
            ("--after-s", self.after()),
            ("--outage-model-s", self.outage_model_s),
            ("--inflight-wait-s", self.inflight_wait_s),
            ("--request-timeout-s", self.request_timeout_s),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                bail!("{name} must be a non-negative number of seconds, got {v}");
            }
        }
        if self.before() <= 0.0 || self.after() <= 0.0 {
            bail!("--before-s and --after-s must be positive: the fault needs load around it");
        }
        if self.outage_wall_s() < 1.0 {
            bail!(
                "the outage is {:.2} s of wall time (--outage-model-s {} ÷ speed {}); it must last at least 1 s so that the timeline's 1-s buckets see the replica down",
                self.outage_wall_s(),
                self.outage_model_s,
                self.fleet.effective_speed()
            );
        }
        if self.fleet.fleet == FleetKind::Static {
            bail!(
                "a fault needs replicas this harness starts and stops: use --fleet emulated or --fleet command"
            );
        }
        if let (Some(t), Some(i)) = (self.slo_ttft_ms, self.slo_itl_ms)
            && !(t > 0.0 && i > 0.0 && t.is_finite() && i.is_finite())
        {
            bail!("--slo-ttft-ms and --slo-itl-ms must be positive");
        }
        Ok(())
    }
}

/// What the run needs from a calibration (or from the SLO flags).
#[derive(Debug, Clone, Serialize)]
struct Setup {
    slo: Slo,
    capacity_tokens: u64,
    index_ttl_s: Option<f64>,
    index_node_cap: Option<u64>,
    used_replicas: Vec<usize>,
    calibrated: bool,
}

/// Runs the fault experiment, writes the timeline and summary; fails when a loss bound broke.
/// Returns the directory.
pub fn fault(args: &FaultArgs, bins: &Bins) -> Result<PathBuf> {
    args.check()?;
    let dir = args.dir();
    if args.fresh && dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir)?;
    let policies = if args.policies.is_empty() {
        DEFAULT_POLICIES.iter().map(|s| s.to_string()).collect()
    } else {
        grid::policies(&args.policies, args.quick)?
    };
    let kv_events = policies.iter().any(|p| grid::needs_kv_events(p));
    let setup = setup(args, bins, &dir, kv_events)?;
    let n = setup.used_replicas.len();
    if args.victim >= n {
        bail!(
            "--victim {} is outside a fleet of {n} replicas",
            args.victim
        );
    }
    if n < 2 {
        bail!("a fault needs at least 2 replicas: the others carry the load during the outage");
    }
    let speed = args.fleet.effective_speed();
    let rate = model_rate(args, n)?;
    let point = point_name(rate);
    let plan = run::ensure_plan(
        &dir.join(&point),
        &WorkloadSpec {
            seed: args.seed,
            sizing: Sizing::WorkingSet {
                capacity_tokens: setup.capacity_tokens,
                ratio: 1.0,
            },
            zipf_s: 0.0,
            ..WorkloadSpec::default()
        },
        &ArrivalSpec::Open {
            rate_rps: rate * speed,
            duration_s: args.run_s(),
        },
    )?;
    let source = args.fleet.source(
        &bins.engine,
        args.quick,
        kv_events,
        Some(&setup.used_replicas),
    )?;
    let mut fleet = Fleet::new(source, args.fleet.options(&dir.join("logs").join("fleet")))?;
    cell::write_atomic(
        &dir.join("sweep.json"),
        serde_json::to_string_pretty(&serde_json::json!({
            "sweep": format!("fault-{}", args.kind().as_str()),
            "kind": args.kind(),
            "quick": args.quick,
            "point": point,
            "policies": policies,
            "reps": args.reps,
            "rate_model_rps": rate,
            "speed": speed,
            "victim": args.victim,
            "warmup_s": args.warmup(),
            "before_s": args.before(),
            "outage_model_s": args.outage_model_s,
            "outage_wall_s": args.outage_wall_s(),
            "after_s": args.after(),
            "setup": setup,
        }))?
        .as_bytes(),
    )?;
    eprintln!(
        "xtask fault {}: {} policies × {} reps into {} ({n} replicas, victim {}, {rate} req/s model = {:.1} req/s wall, outage {:.1} s wall, SLO TTFT < {:.1} ms, ITL p50 < {:.2} ms)",
        args.kind().as_str(),
        policies.len(),
        args.reps,
        dir.display(),
        args.victim,
        rate * speed,
        args.outage_wall_s(),
        setup.slo.ttft_ms,
        setup.slo.itl_ms,
    );
    let git_rev = crate::env::git_rev();
    let versions = crate::env::versions();
    // Each repetition also cycles the fleet, starts the router and waits out the driver.
    let mut progress = Progress::new(
        policies.len() * args.reps as usize,
        Duration::from_secs_f64(args.run_s() + 5.0),
    );
    for rep in 1..=args.reps {
        for policy in &policies {
            if interrupt::requested() {
                bail!(
                    "interrupted; completed repetitions are kept, rerun the same command to resume"
                );
            }
            let rep_dir = dir.join(&point).join(policy).join(format!("rep-{rep}"));
            if CellState::of(&rep_dir).is_done() {
                progress.skipped();
                continue;
            }
            cell::clear(&rep_dir)?;
            let ctx = RepContext {
                args,
                bins,
                setup: &setup,
                plan: &plan,
                point: &point,
                policy,
                rep,
                dir: &rep_dir,
                git_rev: &git_rev,
                versions: &versions,
            };
            let started = Instant::now();
            match run_rep(&mut fleet, &ctx) {
                Ok(line) => {
                    progress.ran(started.elapsed());
                    eprintln!("{}", progress.line(&format!("{policy} rep-{rep}: {line}")));
                }
                Err(e) => {
                    // No half repetition may look whole: it has no meta, and it goes.
                    let _ = std::fs::remove_dir_all(&rep_dir);
                    fleet.stop();
                    return Err(e.context(format!("fault {policy} rep-{rep}")));
                }
            }
        }
    }
    fleet.stop();
    let summary = analysis::fault::write_summary(&dir, &point)?;
    println!("{}", analysis::fault::markdown(&summary));
    if !summary.violations.is_empty() {
        bail!(
            "the loss bounds broke ({} violations; see {}):\n  {}",
            summary.violations.len(),
            dir.join("summary.md").display(),
            summary.violations.join("\n  ")
        );
    }
    Ok(dir)
}

/// The open-loop rate in requests per second of model time: `--rate`, else 0.8 per replica
/// (the middle of the `load` sweep), rounded to 1/1000.
fn model_rate(args: &FaultArgs, replicas: usize) -> Result<f64> {
    let rate = args.rate.unwrap_or(0.8 * replicas as f64);
    if !(rate.is_finite() && rate > 0.0) {
        bail!("--rate must be positive, got {rate}");
    }
    Ok((rate * 1000.0).round() / 1000.0)
}

/// The point directory: the frozen point (working set 1, skew 0) at `rate`, named like the
/// `load` sweep's points.
pub fn point_name(model_rate_rps: f64) -> String {
    format!("ws1-s0-rate{model_rate_rps}")
}

/// The SLO, capacity and index settings: from the SLO flags (capacity read from the replicas),
/// else the directory's own calibration, else `--calibration` when it is for this fleet, else a
/// fresh calibration.
fn setup(args: &FaultArgs, bins: &Bins, dir: &Path, kv_events: bool) -> Result<Setup> {
    if let (Some(ttft_ms), Some(itl_ms)) = (args.slo_ttft_ms, args.slo_itl_ms) {
        let n = args.fleet.replica_count(args.quick);
        let source = args
            .fleet
            .source(&bins.engine, args.quick, kv_events, None)?;
        let mut fleet = Fleet::new(source, args.fleet.options(&dir.join("logs").join("fleet")))?;
        fleet.start(&interrupt::requested)?;
        let mut capacity_tokens = 0;
        for r in fleet.replicas() {
            let text = http::get(&http::join(&r.url, "/metrics"), Duration::from_secs(5))?.text();
            let cache = fleet::metrics::cache_config(&text).ok_or_else(|| {
                anyhow!(
                    "replica {} reports no vllm:cache_config_info; its KV capacity is unknown",
                    r.index
                )
            })?;
            capacity_tokens += cache.capacity_tokens();
        }
        fleet.stop();
        return Ok(Setup {
            slo: Slo { ttft_ms, itl_ms },
            capacity_tokens,
            index_ttl_s: None,
            index_node_cap: None,
            used_replicas: (0..n).collect(),
            calibrated: false,
        });
    }
    let key = args.fleet.key(args.quick);
    let own = dir.join("calibration.json");
    let cal = if own.exists() {
        let c = Calibration::read(&own)?;
        if c.fleet != key {
            bail!(
                "{} was calibrated for another fleet; resume it with the same fleet flags or use --fresh / --sweep-dir-name",
                dir.display()
            );
        }
        c
    } else {
        let reuse = (!args.recalibrate && args.calibration.exists())
            .then(|| Calibration::read(&args.calibration).ok())
            .flatten()
            .filter(|c| c.fleet == key);
        match reuse {
            Some(c) => c,
            None => calibration::calibrate(
                &CalibrateArgs {
                    fleet: args.fleet.clone(),
                    out: args.calibration.clone(),
                    quick: args.quick,
                    include_outliers: false,
                    outlier_factor: 1.3,
                    requests: None,
                    users: 32,
                    think_s: 1.0,
                    warmup_s: None,
                    measure_s: None,
                    no_build: true,
                    seed: args.seed,
                },
                bins,
            )?,
        }
    };
    cal.write(&own)?;
    Ok(Setup {
        slo: Slo {
            ttft_ms: cal.slo.ttft_ms,
            itl_ms: cal.slo.itl_ms,
        },
        capacity_tokens: cal.capacity_tokens,
        index_ttl_s: cal.index.ttl_s,
        index_node_cap: cal.index.node_cap,
        used_replicas: cal.used_replicas.clone(),
        calibrated: true,
    })
}

struct RepContext<'a> {
    args: &'a FaultArgs,
    bins: &'a Bins,
    setup: &'a Setup,
    plan: &'a PlanFile,
    point: &'a str,
    policy: &'a str,
    rep: u32,
    dir: &'a Path,
    git_rev: &'a Option<String>,
    versions: &'a serde_json::Value,
}

/// The router's view of one replica (`GET /admin/replicas`).
#[derive(Debug, Clone, Deserialize)]
struct AdminReplica {
    id: u32,
    outstanding: u32,
    #[serde(default)]
    draining: bool,
}

fn admin_replica(router: &str, id: u32) -> Result<AdminReplica> {
    let r = http::get(
        &http::join(router, "/admin/replicas"),
        Duration::from_secs(5),
    )?;
    if r.status != 200 {
        bail!("GET /admin/replicas answered {}: {}", r.status, r.text());
    }
    let list: Vec<AdminReplica> =
        serde_json::from_slice(&r.body).context("parsing GET /admin/replicas")?;
    list.into_iter()
        .find(|x| x.id == id)
        .ok_or_else(|| anyhow!("the router lists no replica {id}"))
}

fn admin_post(router: &str, id: u32, action: &str) -> Result<AdminReplica> {
    let url = http::join(router, &format!("/admin/replicas/{id}/{action}"));
    let r = http::post(&url, None, Duration::from_secs(5))?;
    if r.status != 200 {
        bail!("POST {url} answered {}: {}", r.status, r.text());
    }
    serde_json::from_slice(&r.body).with_context(|| format!("parsing the answer to POST {url}"))
}

/// One clock probe: a request the router answers 400 before routing, timed on `t0`'s clock
/// (seconds since `t0`).
fn clock_probe(router: &str, id: &str, t0: Instant) -> Result<ClockProbe> {
    let (authority, _) = http::split_url(router)?;
    let mut stream =
        TcpStream::connect(&authority).with_context(|| format!("connecting to {router}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.set_nodelay(true)?;
    // One write, so the router's arrival stamp falls between the two readings.
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\nContent-Type: application/json\r\nx-request-id: {id}\r\nContent-Length: 1\r\n\r\n{{"
    );
    let sent = t0.elapsed().as_secs_f64();
    stream.write_all(req.as_bytes())?;
    let mut first = [0u8; 12];
    stream.read_exact(&mut first)?;
    let answered = t0.elapsed().as_secs_f64();
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest);
    let status = String::from_utf8_lossy(&first[9..12]).into_owned();
    if status != "400" {
        bail!("the clock probe expected 400 from the router, got `{status}`");
    }
    Ok(ClockProbe {
        request_id: id.to_string(),
        sent_s: sent,
        answered_s: answered,
    })
}

/// Sleeps until `deadline` (s since `t0`) while the driver runs; fails when the driver exits
/// first, a replica other than a downed one dies, or Ctrl-C.
fn wait_until(
    deadline: f64,
    t0: Instant,
    driver: &mut fleet::ChildGuard,
    fleet: &mut Fleet,
    tick: &mut dyn FnMut(f64) -> Result<()>,
) -> Result<()> {
    loop {
        if interrupt::requested() {
            bail!("interrupted");
        }
        if let Some(status) = driver.try_wait()? {
            bail!(
                "the driver exited ({status}) before the fault was over; see its log {}",
                driver.log_path().display()
            );
        }
        fleet.check_alive()?;
        let now = t0.elapsed().as_secs_f64();
        tick(now)?;
        if now >= deadline {
            return Ok(());
        }
        std::thread::sleep(Duration::from_secs_f64((deadline - now).min(0.02)));
    }
}

fn run_rep(fleet: &mut Fleet, c: &RepContext<'_>) -> Result<String> {
    let args = c.args;
    let victim = args.victim;
    let victim_id = victim as u32;
    fleet.cycle(&interrupt::requested)?;
    let victim_info = fleet
        .replicas()
        .get(victim)
        .cloned()
        .ok_or_else(|| anyhow!("no replica {victim} in the fleet"))?;
    let belief = grid::uses_belief_index(c.policy);
    let router_settings = RouterSettings {
        policy: c.policy.to_string(),
        model: args.fleet.model.clone(),
        seed: args.seed + u64::from(c.rep),
        index_ttl_s: if belief { c.setup.index_ttl_s } else { None },
        index_node_cap: if belief { c.setup.index_node_cap } else { None },
        kv_events: grid::needs_kv_events(c.policy),
    };
    let (mut router, url) = fleet::ingress::start_router(
        &c.bins.router,
        fleet,
        &router_settings,
        &c.dir.join("router.csv"),
        &c.dir.join("router.log"),
        &interrupt::requested,
    )?;
    let t0 = Instant::now();
    // The probe with the shortest round trip pins the router clock tightest.
    let mut probes = Vec::new();
    for i in 0..5 {
        let id = format!("{PROBE_PREFIX}{i}");
        probes.push(clock_probe(&url, &id, t0)?);
    }
    let driver_settings = DriverSettings {
        mode: "open",
        warmup_s: args.warmup(),
        duration_s: Some(args.run_s()),
        timeout_s: args.request_timeout_s,
        model: args.fleet.model.clone(),
    };
    let client_csv = c.dir.join("client.csv");
    let mut driver = fleet::start_driver(
        &c.bins.driver,
        &url,
        &c.plan.path,
        &client_csv,
        &driver_settings,
        &c.dir.join("driver.log"),
    )?;
    let spawned = t0.elapsed().as_secs_f64();
    let evidence_path = c.dir.join("evidence.jsonl");
    let evidence_cfg = EvidenceConfig {
        lateness_urls: fleet.urls(),
        fleet_process_groups: fleet.process_groups(),
        // The restarted replica is a new process group mid-run; it is ours, not a foreigner.
        check_foreign: false,
        gpu: true,
        interval: Duration::from_secs_f64(args.evidence_interval_s.max(0.05)),
        fleet_gpus: fleet.gpus(),
    };
    let mut sampler: Option<EvidenceSampler> = None;
    let warm_at = spawned + args.warmup();
    let mut tick = |now: f64| -> Result<()> {
        if sampler.is_none() && now >= warm_at {
            sampler = Some(EvidenceSampler::start(
                evidence_cfg.clone(),
                &evidence_path,
            )?);
        }
        Ok(())
    };
    let outage = args.outage_wall_s();
    wait_until(
        spawned + args.warmup() + args.before(),
        t0,
        &mut driver,
        fleet,
        &mut tick,
    )?;

    // Fault mid-request: wait (briefly) for the router to count work on the victim, so that a
    // kill has something to lose and a drain something to finish.
    let wait_from = t0.elapsed().as_secs_f64();
    let outstanding = loop {
        let r = admin_replica(&url, victim_id)?;
        let now = t0.elapsed().as_secs_f64();
        if r.outstanding > 0 || now - wait_from >= args.inflight_wait_s {
            break r.outstanding;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let waited = t0.elapsed().as_secs_f64() - wait_from;
    if outstanding == 0 {
        eprintln!(
            "xtask fault: replica {victim} had nothing in flight for {:.1} s; faulting it anyway",
            args.inflight_wait_s
        );
    }
    let outstanding_at_fault = Some(outstanding);
    let (fault_s, drained_s, down_s) = match args.kind() {
        FaultKind::Kill => {
            let fault_s = t0.elapsed().as_secs_f64();
            fleet.kill_one(victim)?;
            (fault_s, None, t0.elapsed().as_secs_f64())
        }
        FaultKind::Drain => {
            let answer = admin_post(&url, victim_id, "drain")?;
            // The drain is in force once the router has answered; a request arriving before
            // that may still be routed to the victim (and is then one to finish, not to lose).
            let fault_s = t0.elapsed().as_secs_f64();
            if !answer.draining {
                bail!("the router did not mark replica {victim} draining");
            }
            let limit = fault_s + args.request_timeout_s + 10.0;
            let drained_s = loop {
                let r = admin_replica(&url, victim_id)?;
                let now = t0.elapsed().as_secs_f64();
                if r.outstanding == 0 {
                    break now;
                }
                if now > limit {
                    bail!(
                        "replica {victim} still had {} requests outstanding {:.0} s after the drain",
                        r.outstanding,
                        now - fault_s
                    );
                }
                if let Some(status) = driver.try_wait()? {
                    bail!("the driver exited ({status}) during the drain");
                }
                std::thread::sleep(Duration::from_millis(2));
            };
            stop_gracefully(fleet, victim, &victim_info)?;
            (fault_s, Some(drained_s), t0.elapsed().as_secs_f64())
        }
    };
    wait_until(down_s + outage, t0, &mut driver, fleet, &mut tick)?;
    let restart_s = t0.elapsed().as_secs_f64();
    fleet.restart_one(victim, &interrupt::requested)?;
    let up_s = t0.elapsed().as_secs_f64();
    let undrain_s = match args.kind() {
        FaultKind::Drain => {
            admin_post(&url, victim_id, "undrain")?;
            Some(t0.elapsed().as_secs_f64())
        }
        FaultKind::Kill => None,
    };
    let limit = spawned + args.run_s() * 2.0 + args.request_timeout_s + 30.0;
    loop {
        if interrupt::requested() {
            bail!("interrupted");
        }
        if let Some(status) = driver.try_wait()? {
            if !status.success() {
                bail!(
                    "the driver failed ({status}); see its log {}",
                    driver.log_path().display()
                );
            }
            break;
        }
        fleet.check_alive()?;
        let now = t0.elapsed().as_secs_f64();
        tick(now)?;
        if now > limit {
            bail!(
                "the driver did not finish in time; see its log {}",
                driver.log_path().display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let sampler = match sampler {
        Some(s) => s,
        None => EvidenceSampler::start(evidence_cfg, &evidence_path)?,
    };
    let evidence = sampler.finish()?;
    if router.terminate(Duration::from_secs(15)).is_none() {
        eprintln!(
            "xtask: the router did not exit on SIGTERM within 15 s and was killed; its rows may be cut (log {})",
            router.log_path().display()
        );
    }
    drop(driver);

    let client = analysis::read_client_csv(&client_csv).map_err(|e| anyhow!("{e}"))?;
    let router_rows =
        analysis::read_router_csv(&c.dir.join("router.csv")).map_err(|e| anyhow!("{e}"))?;
    let (router_minus_xtask_s, clock_uncertainty_s) = probe_offset(&probes, &router_rows)
        .ok_or_else(|| {
            anyhow!("router.csv has no row for any clock probe ({PROBE_PREFIX}*), so the fault cannot be placed on its clock")
        })?;
    let router_minus_driver_s = router_minus_driver(&client, &router_rows)
        .ok_or_else(|| anyhow!("no request appears in both the driver's and the router's rows"))?;
    let events = FaultEvents {
        kind: args.kind(),
        victim: victim_id,
        victim_url: victim_info.url.clone(),
        replicas: fleet.replicas().len(),
        router_minus_xtask_s,
        clock_uncertainty_s,
        router_minus_driver_s,
        xtask: Instants {
            fault_s,
            drained_s,
            down_s,
            restart_s,
            up_s,
            undrain_s,
        },
        outstanding_at_fault,
        waited_for_inflight_s: waited,
        run_end_s: args.run_s(),
        warmup_s: args.warmup(),
    };
    cell::write_atomic(
        &c.dir.join("fault.json"),
        serde_json::to_string_pretty(&events)?.as_bytes(),
    )?;
    let slo = analysis::Slo {
        ttft_ms: c.setup.slo.ttft_ms,
        itl_ms: c.setup.slo.itl_ms,
    };
    let outcome = analyse_rep(c.policy, c.rep, &events, &client, &router_rows, &slo);
    let window = Window {
        warmup_s: args.warmup(),
        measured_start_s: args.warmup(),
        measured_end_s: args.run_s(),
    };
    let meta = Meta {
        sweep: format!("fault-{}", args.kind().as_str()),
        point: c.point.to_string(),
        policy: c.policy.to_string(),
        rep: c.rep,
        workload_name: c.plan.workload_name.clone(),
        workload_fingerprint: c.plan.workload_fingerprint.clone(),
        plan_fingerprint: c.plan.plan_fingerprint.clone(),
        fleet: serde_json::json!({
            "source": args.fleet.key(args.quick).source,
            "replicas": fleet.replicas().len(),
            "speed": args.fleet.effective_speed(),
            "slowdowns": fleet.replicas().iter().map(|r| r.slowdown).collect::<Vec<_>>(),
            "capacity_tokens": c.setup.capacity_tokens,
            "model": args.fleet.model,
            "used_replicas": c.setup.used_replicas,
        }),
        slo: c.setup.slo,
        window,
        git_rev: c.git_rev.clone(),
        versions: c.versions.clone(),
        virtual_time: false,
        complete: true,
        accepted: true,
        set_aside_reason: None,
        attempts: 1,
        evidence: serde_json::to_value(&evidence)?,
        drift: serde_json::Value::Null,
        run: serde_json::json!({
            "plan": c.plan.name,
            "router": router_settings,
            "driver": driver_settings,
            "fault": events,
            "calibrated": c.setup.calibrated,
            "requests": client.len(),
        }),
    };
    if interrupt::requested() {
        bail!("interrupted before the repetition was recorded");
    }
    cell::write_meta(c.dir, &meta)?;
    Ok(outcome.one_line())
}

/// SIGTERM to a drained replica, wait until it stops answering, then reap it.
fn stop_gracefully(fleet: &mut Fleet, index: usize, info: &fleet::ReplicaInfo) -> Result<()> {
    if let Some(pid) = info.pid {
        fleet::process::signal_group(pid, libc::SIGTERM);
        let health = http::join(&info.url, "/health");
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && http::get(&health, Duration::from_millis(200)).is_ok() {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    // Reaps it (and SIGKILLs it if the grace ran out).
    fleet.kill_one(index)
}
