//! `cargo xtask fault kill|drain` (DESIGN.md §3.12): steady open-loop load at the frozen point
//! (working set 1, skew 0) through the router, one replica faulted mid-run and restarted, then
//! the loss bounds checked against the rows and the timeline of figure 6 written.
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
//! Clocks: the driver's rows count from its own start, the router's from its own. The fault is
//! timed on this process's clock; a few deliberately malformed requests (`x-request-id:
//! fault-clock-probe-*`, answered 400 by the router before any routing) put the router clock
//! beside it with the round trip as the error bar, and the smallest router-arrival − driver-send
//! gap over all requests maps the router clock onto the driver's.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

use analysis::metrics::{GoodputBucket, goodput_series};
use analysis::{ClientRow, RouterRow};
use fleet::evidence::{EvidenceConfig, EvidenceSampler};
use fleet::{DriverSettings, Fleet, RouterSettings, http};
use workload::{ArrivalSpec, Sizing, WorkloadSpec};

use crate::calibration::{self, CalibrateArgs, Calibration};
use crate::cell::{self, CellState, Meta, Slo, Window};
use crate::env::Bins;
use crate::fleetargs::{FleetArgs, FleetKind};
use crate::grid;
use crate::interrupt;
use crate::run::{self, PlanFile};

/// Request ids of the clock probes; their router rows are not requests of the experiment.
pub const PROBE_PREFIX: &str = "fault-clock-probe-";

/// The policies faulted by default: the hashing baseline and the cache-aware router with its
/// spill branch on and off (the branch that decides where a dead replica's sessions go).
pub const DEFAULT_POLICIES: &[&str] = &[
    "session-affinity",
    "prefix-affinity",
    "prefix-affinity-spill-off",
];

/// Slack added to the clock uncertainty when deciding whether a request arrived before the
/// fault: the time the kill itself takes to land (signal delivery, socket teardown).
const FAULT_SLACK_S: f64 = 0.005;

/// Buckets (s) over which SLO attainment after the restart is compared with before the fault.
const RECOVERY_BUCKETS: usize = 3;

/// Share of the attainment before the fault that counts as recovered.
const RECOVERED_SHARE: f64 = 0.95;

/// Which fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FaultKind {
    /// SIGKILL mid-request, no warning.
    Kill,
    /// Drain through the router's admin API, then stop.
    Drain,
}

impl FaultKind {
    /// `kill` or `drain`.
    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::Kill => "kill",
            FaultKind::Drain => "drain",
        }
    }
}

/// Flags of `cargo xtask fault`.
#[derive(Debug, Clone, Args)]
pub struct FaultArgs {
    /// Which fault.
    #[arg(value_enum)]
    pub kind: FaultKind,
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
            let base = format!("fault-{}", self.kind.as_str());
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

/// The fault's instants on the three clocks, and what was seen at the fault; `fault.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaultEvents {
    /// Which fault.
    pub kind: FaultKind,
    /// Router id (= fleet index) of the faulted replica.
    pub victim: u32,
    /// Its URL (the same before and after the restart).
    pub victim_url: String,
    /// Replicas in the fleet.
    pub replicas: usize,
    /// Router clock − this process's clock, s (from the best clock probe).
    pub router_minus_xtask_s: f64,
    /// Half the best probe's round trip: the error bar of `router_minus_xtask_s`, s.
    pub clock_uncertainty_s: f64,
    /// Router clock − driver clock, s: the smallest arrival − send gap over all requests.
    pub router_minus_driver_s: f64,
    /// Instants on this process's clock (s since the rep began).
    pub xtask: Instants,
    /// The victim's outstanding count as the router reported it just before the fault.
    pub outstanding_at_fault: Option<u32>,
    /// How long the harness waited for the victim to have a request in flight, s.
    pub waited_for_inflight_s: f64,
    /// Planned end of the load on the driver's clock, s.
    pub run_end_s: f64,
    /// Warm-up on the driver's clock, s.
    pub warmup_s: f64,
}

/// Instants of one fault, all on one clock.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Instants {
    /// Kill: SIGKILL about to be sent. Drain: the router has acknowledged the drain.
    pub fault_s: f64,
    /// Drain: the victim's outstanding count reached 0.
    pub drained_s: Option<f64>,
    /// The process is gone (kill: reaped; drain: stopped).
    pub down_s: f64,
    /// Restart begun.
    pub restart_s: f64,
    /// Healthy again.
    pub up_s: f64,
    /// Drain: undrained.
    pub undrain_s: Option<f64>,
}

impl Instants {
    fn shifted(&self, by: f64) -> Instants {
        Instants {
            fault_s: self.fault_s + by,
            drained_s: self.drained_s.map(|t| t + by),
            down_s: self.down_s + by,
            restart_s: self.restart_s + by,
            up_s: self.up_s + by,
            undrain_s: self.undrain_s.map(|t| t + by),
        }
    }
}

impl FaultEvents {
    /// The instants on the router's clock (`router.csv` `arrival_s`).
    pub fn router(&self) -> Instants {
        self.xtask.shifted(self.router_minus_xtask_s)
    }
    /// The instants on the driver's clock (`client.csv` `_s` columns, the timeline's `t_s`).
    pub fn driver(&self) -> Instants {
        self.xtask
            .shifted(self.router_minus_xtask_s - self.router_minus_driver_s)
    }
}

/// One request the fault lost, with what the router knew of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LostRequest {
    /// Request id.
    pub request_id: String,
    /// Sent (driver clock), s.
    pub sent_s: Option<f64>,
    /// The client's error.
    pub error: String,
    /// Replica the router dispatched it to, if any.
    pub replica: Option<u32>,
    /// Arrival at the router (router clock), s.
    pub arrival_s: Option<f64>,
    /// Whether it is within the bound: dispatched to the victim and in flight at the kill.
    pub allowed: bool,
    /// Why not, when not.
    pub why: Option<String>,
}

/// Requests per replica in one window of router arrivals.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShareWindow {
    /// `before`, `draining`, `outage`, `after`.
    pub window: String,
    /// Window start (router clock), s.
    pub start_s: f64,
    /// Window end (router clock), s.
    pub end_s: f64,
    /// Requests dispatched in the window.
    pub requests: u64,
    /// Share of those per replica, in router id order.
    pub share: Vec<f64>,
    /// Share of the window's decisions that declined their match (`spill-load`,
    /// `spill-residency`); `None` when no row has a branch.
    #[serde(default)]
    pub spill_rate: Option<f64>,
    /// Engine-reported cached ÷ prompt tokens over the window's requests that report both (the
    /// router parses them from the usage chunk in passing); `None` when none does.
    #[serde(default)]
    pub prefix_hit_rate: Option<f64>,
}

/// TTFT of the successful requests sent in one window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TtftWindow {
    /// `before`, `outage`, `after-early`, `after-late`, `victim-after-early`.
    pub window: String,
    /// Requests with a TTFT.
    pub requests: u64,
    /// Median, ms.
    pub p50_ms: Option<f64>,
    /// 90th percentile, ms.
    pub p90_ms: Option<f64>,
}

/// What one repetition shows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RepOutcome {
    /// Policy.
    pub policy: String,
    /// Repetition.
    pub rep: u32,
    /// Requests sent.
    pub sent: u64,
    /// Requests that failed (error or non-2xx).
    pub lost: Vec<LostRequest>,
    /// Broken bounds, in words (empty: the bounds hold).
    pub violations: Vec<String>,
    /// Victim's outstanding count just before the fault.
    pub outstanding_at_fault: Option<u32>,
    /// Per-replica load in each window.
    pub shares: Vec<ShareWindow>,
    /// TTFT around the restart.
    pub ttft: Vec<TtftWindow>,
    /// Goodput per 1 s of send time from the start of the load (driver clock).
    pub goodput: Vec<GoodputBucket>,
    /// Mean goodput before the fault, during the outage, after the restart, req/s.
    pub goodput_before_rps: Option<f64>,
    /// During the outage.
    pub goodput_outage_rps: Option<f64>,
    /// After the restart.
    pub goodput_after_rps: Option<f64>,
    /// SLO attainment (good ÷ sent) before the fault, during the outage, after the restart.
    pub attainment: [Option<f64>; 3],
    /// Seconds from the restart to the start of the first 3-s span whose SLO attainment (good ÷
    /// sent) is back to 95% of its level before the fault; `None`: not within the run. Counted
    /// in whole buckets, so it is at least the gap to the next bucket start.
    pub recovery_s: Option<f64>,
    /// The fault's instants on the driver's clock.
    pub driver: Instants,
}

/// Every repetition of a fault directory.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// `kill` or `drain`.
    pub kind: FaultKind,
    /// Point directory the reps live in.
    pub point: String,
    /// Per repetition, in policy order.
    pub reps: Vec<RepOutcome>,
    /// All broken bounds, prefixed with policy and rep.
    pub violations: Vec<String>,
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
            "sweep": format!("fault-{}", args.kind.as_str()),
            "kind": args.kind,
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
        args.kind.as_str(),
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
    for rep in 1..=args.reps {
        for policy in &policies {
            if interrupt::requested() {
                bail!(
                    "interrupted; completed repetitions are kept, rerun the same command to resume"
                );
            }
            let rep_dir = dir.join(&point).join(policy).join(format!("rep-{rep}"));
            if CellState::of(&rep_dir).is_done() {
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
            match run_rep(&mut fleet, &ctx) {
                Ok(line) => eprintln!("xtask fault {policy} rep-{rep}: {line}"),
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
    let summary = summarize(&dir, &point)?;
    println!("{}", std::fs::read_to_string(dir.join("summary.md"))?);
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
        slo: cal.slo,
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

/// One clock probe: a request the router answers 400 before routing, timed on `t0`'s clock.
/// Returns (sent, answered) in seconds since `t0`.
fn clock_probe(router: &str, id: &str, t0: Instant) -> Result<(f64, f64)> {
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
    Ok((sent, answered))
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
        let (sent, answered) = clock_probe(&url, &id, t0)?;
        probes.push((id, sent, answered));
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
    let (fault_s, drained_s, down_s) = match args.kind {
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
    let undrain_s = match args.kind {
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
    let (router_minus_xtask_s, clock_uncertainty_s) = probe_offset(&probes, &router_rows)?;
    let router_minus_driver_s = router_minus_driver(&client, &router_rows)
        .ok_or_else(|| anyhow!("no request appears in both the driver's and the router's rows"))?;
    let events = FaultEvents {
        kind: args.kind,
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
        sweep: format!("fault-{}", args.kind.as_str()),
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
    let allowed = outcome.lost.iter().filter(|l| l.allowed).count();
    Ok(format!(
        "{} sent, {} lost ({allowed} in flight on the victim, outstanding {} at the fault), {} violations; goodput {} before, {} during, {} after; recovered {}",
        outcome.sent,
        outcome.lost.len(),
        outstanding_at_fault.map_or_else(|| "?".into(), |o| o.to_string()),
        outcome.violations.len(),
        fmt_opt(outcome.goodput_before_rps, 1),
        fmt_opt(outcome.goodput_outage_rps, 1),
        fmt_opt(outcome.goodput_after_rps, 1),
        outcome.recovery_s.map_or_else(
            || "not within the run".to_string(),
            |s| format!("{s:.1} s after the restart")
        ),
    ))
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

/// Router − xtask clock offset from the probe with the shortest round trip, and its error bar.
fn probe_offset(probes: &[(String, f64, f64)], router: &[RouterRow]) -> Result<(f64, f64)> {
    let mut best: Option<(f64, f64)> = None;
    for (id, sent, answered) in probes {
        let Some(row) = router.iter().find(|r| &r.request_id == id) else {
            continue;
        };
        let half = (answered - sent) / 2.0;
        let offset = row.arrival_s - (sent + half);
        if best.is_none_or(|(_, h)| half < h) {
            best = Some((offset, half));
        }
    }
    best.ok_or_else(|| {
        anyhow!("router.csv has no row for any clock probe ({PROBE_PREFIX}*), so the fault cannot be placed on its clock")
    })
}

/// Router − driver clock offset: the smallest arrival − send gap (network time is never
/// negative, so the smallest gap is the closest to the offset).
pub fn router_minus_driver(client: &[ClientRow], router: &[RouterRow]) -> Option<f64> {
    let sent: BTreeMap<&str, f64> = client
        .iter()
        .filter_map(|c| c.sent_s.map(|s| (c.request_id.as_str(), s)))
        .collect();
    router
        .iter()
        .filter_map(|r| sent.get(r.request_id.as_str()).map(|s| r.arrival_s - s))
        .min_by(f64::total_cmp)
}

fn ok(c: &ClientRow) -> bool {
    c.error.is_none() && (200..300).contains(&c.status)
}

/// Classifies every failed request against the loss bounds and measures the timeline.
pub fn analyse_rep(
    policy: &str,
    rep: u32,
    events: &FaultEvents,
    client: &[ClientRow],
    router: &[RouterRow],
    slo: &analysis::Slo,
) -> RepOutcome {
    let r_ev = events.router();
    let d_ev = events.driver();
    let router: Vec<&RouterRow> = router
        .iter()
        .filter(|r| !r.request_id.starts_with(PROBE_PREFIX))
        .collect();
    let by_id: BTreeMap<&str, &RouterRow> =
        router.iter().map(|r| (r.request_id.as_str(), *r)).collect();
    let tol = events.clock_uncertainty_s + FAULT_SLACK_S;
    let sent_rows: Vec<&ClientRow> = client.iter().filter(|c| c.sent_s.is_some()).collect();
    let mut lost = Vec::new();
    let mut violations = Vec::new();
    for c in sent_rows.iter().filter(|c| !ok(c)) {
        let row = by_id.get(c.request_id.as_str()).copied();
        let error = c
            .error
            .clone()
            .unwrap_or_else(|| format!("status {}", c.status));
        let why = match (events.kind, row) {
            (FaultKind::Drain, _) => Some("a drain may lose nothing".to_string()),
            (FaultKind::Kill, None) => {
                Some("the router never recorded it: it was not dispatched".to_string())
            }
            // A stream cut by the kill keeps the 200 its headers carried; an error status is
            // the router's own answer, so the request never streamed from the victim.
            (FaultKind::Kill, Some(_)) if c.status >= 300 => Some(format!(
                "the router answered {} itself: it was not in flight on the killed replica",
                c.status
            )),
            (FaultKind::Kill, Some(r)) => match r.replica {
                None => Some("the router dispatched it nowhere".to_string()),
                Some(id) if id != events.victim => {
                    Some(format!("dispatched to replica {id}, not the killed one"))
                }
                Some(_) if r.arrival_s > r_ev.down_s + tol => Some(format!(
                    "arrived {:.3} s after the kill: not in flight at it",
                    r.arrival_s - r_ev.down_s
                )),
                Some(_) => match (c.sent_s, c.e2el_ms) {
                    (Some(s), Some(e)) if s + e / 1e3 < d_ev.fault_s - tol => Some(format!(
                        "it ended {:.3} s before the kill",
                        d_ev.fault_s - (s + e / 1e3)
                    )),
                    _ => None,
                },
            },
        };
        if let Some(w) = &why {
            violations.push(format!("{}: {error} — {w}", c.request_id));
        }
        lost.push(LostRequest {
            request_id: c.request_id.clone(),
            sent_s: c.sent_s,
            error,
            replica: row.and_then(|r| r.replica),
            arrival_s: row.map(|r| r.arrival_s),
            allowed: why.is_none(),
            why,
        });
    }
    let end_r = events.run_end_s + events.router_minus_driver_s;
    let warm_r = events.warmup_s + events.router_minus_driver_s;
    let mut windows = vec![("before", warm_r, r_ev.fault_s)];
    if events.kind == FaultKind::Drain {
        windows.push(("draining", r_ev.fault_s, r_ev.down_s));
    }
    windows.push(("outage", r_ev.down_s, r_ev.up_s));
    windows.push(("after", r_ev.up_s, end_r));
    let shares = windows
        .into_iter()
        .map(|(name, start, end)| share_window(name, start, end, &router, events.replicas))
        .collect();

    let end_d = events.run_end_s;
    let early = ((end_d - d_ev.up_s) / 3.0).clamp(0.5, 10.0);
    let before_start = events.warmup_s.max(d_ev.fault_s - (end_d - d_ev.up_s));
    let victim_rows: Vec<&ClientRow> = client
        .iter()
        .filter(|c| {
            by_id
                .get(c.request_id.as_str())
                .is_some_and(|r| r.replica == Some(events.victim))
        })
        .collect();
    let all: Vec<&ClientRow> = client.iter().collect();
    let ttft = vec![
        ttft_window("before", &all, before_start, d_ev.fault_s),
        ttft_window("outage", &all, d_ev.down_s, d_ev.up_s),
        ttft_window("after-early", &all, d_ev.up_s, d_ev.up_s + early),
        ttft_window("after-late", &all, d_ev.up_s + early, end_d),
        ttft_window(
            "victim-after-early",
            &victim_rows,
            d_ev.up_s,
            d_ev.up_s + early,
        ),
    ];

    let goodput = goodput_series(client, slo, 0.0, end_d, 1.0);
    let mean_in = |a: f64, b: f64| {
        let v: Vec<f64> = goodput
            .iter()
            .filter(|g| g.start_s >= a && g.start_s + 1.0 <= b)
            .map(|g| g.goodput_rps)
            .collect();
        analysis::stats::mean(&v)
    };
    let goodput_before_rps = mean_in(before_start, d_ev.fault_s);
    let goodput_outage_rps = mean_in(d_ev.down_s, d_ev.up_s);
    let goodput_after_rps = mean_in(d_ev.up_s, end_d);
    // Recovery is judged on SLO attainment (good ÷ sent), not on goodput itself: the open-loop
    // plan's arrivals per second are Poisson, and their noise alone would move goodput by more
    // than any threshold worth setting.
    let attainment = |buckets: &[&GoodputBucket]| {
        let sent: u64 = buckets.iter().map(|g| g.requests).sum();
        let good: u64 = buckets.iter().map(|g| g.good).sum();
        (sent > 0).then(|| good as f64 / sent as f64)
    };
    let before_buckets: Vec<&GoodputBucket> = goodput
        .iter()
        .filter(|g| g.start_s >= before_start && g.start_s + 1.0 <= d_ev.fault_s)
        .collect();
    let within = |a: f64, b: f64| -> Vec<&GoodputBucket> {
        goodput
            .iter()
            .filter(|g| g.start_s >= a && g.start_s + 1.0 <= b)
            .collect()
    };
    let attainments = [
        attainment(&before_buckets),
        attainment(&within(d_ev.down_s, d_ev.up_s)),
        attainment(&within(d_ev.up_s, end_d)),
    ];
    let recovery_s = attainment(&before_buckets).and_then(|level| {
        let after: Vec<&GoodputBucket> =
            goodput.iter().filter(|g| g.start_s >= d_ev.up_s).collect();
        (0..after.len()).find_map(|i| {
            let w = &after[i..(i + RECOVERY_BUCKETS).min(after.len())];
            attainment(w)
                .is_some_and(|a| a >= RECOVERED_SHARE * level)
                .then(|| (w[0].start_s - d_ev.up_s).max(0.0))
        })
    });
    RepOutcome {
        policy: policy.to_string(),
        rep,
        sent: sent_rows.len() as u64,
        lost,
        violations,
        outstanding_at_fault: events.outstanding_at_fault,
        shares,
        ttft,
        goodput,
        goodput_before_rps,
        goodput_outage_rps,
        goodput_after_rps,
        attainment: attainments,
        recovery_s,
        driver: d_ev,
    }
}

fn share_window(name: &str, start: f64, end: f64, router: &[&RouterRow], n: usize) -> ShareWindow {
    let mut counts = vec![0u64; n];
    let (mut branches, mut spills, mut cached, mut prompt) = (0u64, 0u64, 0u64, 0u64);
    for r in router
        .iter()
        .filter(|r| r.arrival_s >= start && r.arrival_s < end)
    {
        if let Some(id) = r.replica
            && let Some(c) = counts.get_mut(id as usize)
        {
            *c += 1;
        }
        if let Some(b) = r.branch.as_deref() {
            branches += 1;
            spills += u64::from(analysis::metrics::SPILL_BRANCHES.contains(&b));
        }
        if let (Some(c), Some(p)) = (r.cached_tokens, r.prompt_tokens) {
            cached += c.min(p);
            prompt += p;
        }
    }
    let total: u64 = counts.iter().sum();
    ShareWindow {
        window: name.to_string(),
        start_s: start,
        end_s: end,
        requests: total,
        share: counts
            .iter()
            .map(|&c| {
                if total == 0 {
                    0.0
                } else {
                    c as f64 / total as f64
                }
            })
            .collect(),
        spill_rate: (branches > 0).then(|| spills as f64 / branches as f64),
        prefix_hit_rate: (prompt > 0).then(|| cached as f64 / prompt as f64),
    }
}

fn ttft_window(name: &str, rows: &[&ClientRow], start: f64, end: f64) -> TtftWindow {
    let v: Vec<f64> = rows
        .iter()
        .filter(|c| ok(c) && c.sent_s.is_some_and(|s| s >= start && s < end))
        .filter_map(|c| c.ttft_ms)
        .collect();
    TtftWindow {
        window: name.to_string(),
        requests: v.len() as u64,
        p50_ms: analysis::stats::quantile(&v, 0.5),
        p90_ms: analysis::stats::quantile(&v, 0.9),
    }
}

/// One `timeline.csv` row.
#[derive(Debug, Clone, PartialEq)]
pub struct TimelineRow {
    /// Policy.
    pub policy: String,
    /// Bucket start, s since the policy's load started.
    pub t_s: f64,
    /// Median goodput over repetitions, req/s.
    pub goodput_rps: f64,
    /// Whether the faulted replica was up at the bucket start in every repetition.
    pub replica_alive: bool,
}

/// The timeline of figure 6 from the outcomes, in the order given (policies keep their first
/// appearance's order).
pub fn timeline(reps: &[RepOutcome]) -> Vec<TimelineRow> {
    let mut order: Vec<&str> = Vec::new();
    for r in reps {
        if !order.contains(&r.policy.as_str()) {
            order.push(&r.policy);
        }
    }
    let mut out = Vec::new();
    for policy in order {
        let mine: Vec<&RepOutcome> = reps.iter().filter(|r| r.policy == policy).collect();
        let buckets = mine.iter().map(|r| r.goodput.len()).min().unwrap_or(0);
        for b in 0..buckets {
            let t_s = mine[0].goodput[b].start_s;
            let values: Vec<f64> = mine.iter().map(|r| r.goodput[b].goodput_rps).collect();
            let alive = mine
                .iter()
                .all(|r| !(t_s >= r.driver.down_s && t_s < r.driver.up_s));
            out.push(TimelineRow {
                policy: policy.to_string(),
                t_s,
                goodput_rps: analysis::stats::median(&values).unwrap_or(0.0),
                replica_alive: alive,
            });
        }
    }
    out
}

/// `timeline.csv` text (header `policy,t_s,goodput_rps,replica_alive`).
pub fn timeline_csv(rows: &[TimelineRow]) -> String {
    let mut s = String::from("policy,t_s,goodput_rps,replica_alive\n");
    for r in rows {
        s.push_str(&format!(
            "{},{:.3},{:.3},{}\n",
            r.policy,
            r.t_s,
            r.goodput_rps,
            u8::from(r.replica_alive)
        ));
    }
    s
}

/// Reads every complete repetition of `point` in a fault directory, checks the loss bounds and
/// writes `timeline.csv`, `summary.json` and `summary.md` into the directory.
pub fn summarize(dir: &Path, point: &str) -> Result<Summary> {
    let point_dir = dir.join(point);
    if !point_dir.is_dir() {
        bail!("{} holds no point `{point}`", dir.display());
    }
    let mut reps = Vec::new();
    let mut kind = None;
    for policy_dir in sorted_dirs(&point_dir)? {
        for rep_dir in sorted_dirs(&policy_dir)? {
            let Some(rep) = analysis::load::rep_number(&file_name(&rep_dir)) else {
                continue;
            };
            if !CellState::of(&rep_dir).is_done() || !rep_dir.join("fault.json").exists() {
                continue;
            }
            let events: FaultEvents =
                serde_json::from_str(&std::fs::read_to_string(rep_dir.join("fault.json"))?)
                    .with_context(|| format!("parsing {}", rep_dir.join("fault.json").display()))?;
            let policy = file_name(&policy_dir);
            // The analysis crate's loader: meta, then rows plain as the run wrote them or
            // `.csv.gz` as `xtask publish` copied them.
            let analysis::load::RepLoad::Complete(data) =
                analysis::load_rep(&rep_dir, point, &policy, rep).map_err(|e| anyhow!("{e}"))?
            else {
                continue;
            };
            let router = data
                .router
                .as_deref()
                .with_context(|| format!("{} has no router.csv", rep_dir.display()))?;
            reps.push(analyse_rep(
                &policy,
                rep,
                &events,
                &data.client,
                router,
                &data.meta.slo,
            ));
            kind = Some(events.kind);
        }
    }
    let Some(kind) = kind else {
        bail!("{} holds no complete fault repetition", point_dir.display());
    };
    // Policy order as the run listed them, when known.
    if let Ok(text) = std::fs::read_to_string(dir.join("sweep.json"))
        && let Ok(v) = serde_json::from_str::<serde_json::Value>(&text)
        && let Some(list) = v["policies"].as_array()
    {
        let order: Vec<&str> = list.iter().filter_map(|p| p.as_str()).collect();
        reps.sort_by_key(|r| {
            (
                order
                    .iter()
                    .position(|p| *p == r.policy)
                    .unwrap_or(usize::MAX),
                r.rep,
            )
        });
    }
    let violations = reps
        .iter()
        .flat_map(|r| {
            r.violations
                .iter()
                .map(move |v| format!("{} rep-{}: {v}", r.policy, r.rep))
        })
        .collect();
    let summary = Summary {
        kind,
        point: point.to_string(),
        reps,
        violations,
    };
    cell::write_atomic(
        &dir.join("timeline.csv"),
        timeline_csv(&timeline(&summary.reps)).as_bytes(),
    )?;
    cell::write_atomic(
        &dir.join("summary.json"),
        serde_json::to_string_pretty(&summary)?.as_bytes(),
    )?;
    cell::write_atomic(&dir.join("summary.md"), markdown(&summary).as_bytes())?;
    Ok(summary)
}

fn sorted_dirs(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    out.sort();
    Ok(out)
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "–".to_string(), |x| format!("{x:.digits$}"))
}

fn with_attainment(goodput: Option<f64>, attainment: Option<f64>) -> String {
    match attainment {
        Some(a) => format!("{} ({:.0}%)", fmt_opt(goodput, 2), a * 100.0),
        None => fmt_opt(goodput, 2),
    }
}

/// The human summary.
pub fn markdown(s: &Summary) -> String {
    let mut md = format!("# Fault `{}` at {}\n\n", s.kind.as_str(), s.point);
    let rule = match s.kind {
        FaultKind::Kill => {
            "only requests in flight on the killed replica may be lost; none that were not yet dispatched"
        }
        FaultKind::Drain => "a drain loses nothing",
    };
    if s.violations.is_empty() {
        md.push_str(&format!("**Loss bounds hold** ({rule}).\n\n"));
    } else {
        md.push_str(&format!(
            "**Loss bounds BROKEN** ({rule}): {} violations.\n\n",
            s.violations.len()
        ));
        for v in &s.violations {
            md.push_str(&format!("- {v}\n"));
        }
        md.push('\n');
    }
    md.push_str("## Requests lost\n\n| policy | rep | sent | lost | in flight on the victim | outside the bound | victim outstanding at the fault |\n|---|---|---|---|---|---|---|\n");
    for r in &s.reps {
        let allowed = r.lost.iter().filter(|l| l.allowed).count();
        md.push_str(&format!(
            "| {} | {} | {} | {} | {allowed} | {} | {} |\n",
            r.policy,
            r.rep,
            r.sent,
            r.lost.len(),
            r.lost.len() - allowed,
            r.outstanding_at_fault
                .map_or_else(|| "–".into(), |o| o.to_string()),
        ));
    }
    md.push_str("\n## Goodput (req/s, mean of 1-s buckets; SLO attainment = good ÷ sent)\n\n| policy | rep | before | outage | after restart | recovered (s after restart) |\n|---|---|---|---|---|---|\n");
    for r in &s.reps {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            r.policy,
            r.rep,
            with_attainment(r.goodput_before_rps, r.attainment[0]),
            with_attainment(r.goodput_outage_rps, r.attainment[1]),
            with_attainment(r.goodput_after_rps, r.attainment[2]),
            r.recovery_s
                .map_or_else(|| "not within the run".into(), |x| format!("{x:.1}")),
        ));
    }
    md.push_str("\n## Share of requests per replica\n\n| policy | rep | window | requests | shares (replica 0, 1, …) | spill rate | engine prefix-hit rate |\n|---|---|---|---|---|---|---|\n");
    let pct = |v: Option<f64>| v.map_or_else(|| "–".to_string(), |x| format!("{:.1}%", x * 100.0));
    for r in &s.reps {
        for w in &r.shares {
            let shares: Vec<String> = w
                .share
                .iter()
                .map(|x| format!("{:.0}%", x * 100.0))
                .collect();
            md.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} |\n",
                r.policy,
                r.rep,
                w.window,
                w.requests,
                shares.join(" · "),
                pct(w.spill_rate),
                pct(w.prefix_hit_rate)
            ));
        }
    }
    md.push_str("\n## TTFT around the restart (ms, p50 / p90)\n\n| policy | rep | before | outage | after, early | after, late | victim, early after restart |\n|---|---|---|---|---|---|---|\n");
    for r in &s.reps {
        let cell = |name: &str| {
            r.ttft.iter().find(|t| t.window == name).map_or_else(
                || "–".to_string(),
                |t| {
                    format!(
                        "{} / {} (n={})",
                        fmt_opt(t.p50_ms, 1),
                        fmt_opt(t.p90_ms, 1),
                        t.requests
                    )
                },
            )
        };
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} |\n",
            r.policy,
            r.rep,
            cell("before"),
            cell("outage"),
            cell("after-early"),
            cell("after-late"),
            cell("victim-after-early"),
        ));
    }
    md.push_str("\nWindows are on the driver's clock: *before* is the steady load ahead of the fault, *outage* from the replica going down to it being healthy again, *after, early* the first third of the rest (0.5–10 s). The timeline of goodput per second is `timeline.csv` (figure 6).\n");
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(id: &str, sent: f64, ttft: Option<f64>, error: Option<&str>) -> ClientRow {
        ClientRow {
            request_id: id.into(),
            session_id: Some("s".into()),
            turn: 0,
            scheduled_s: Some(sent),
            sent_s: Some(sent),
            first_token_s: ttft.map(|t| sent + t / 1e3),
            last_s: Some(sent + 0.2),
            ttft_ms: ttft,
            itl_p50_ms: Some(1.0),
            tpot_ms: Some(1.0),
            e2el_ms: Some(200.0),
            prompt_tokens: Some(100),
            output_tokens: Some(32),
            cached_tokens: None,
            status: if error.is_some() { 0 } else { 200 },
            error: error.map(str::to_string),
            warmup: false,
            send_lag_ms: Some(0.0),
            chunks: Some(32),
        }
    }

    fn routed(id: &str, arrival: f64, replica: Option<u32>) -> RouterRow {
        RouterRow {
            request_id: id.into(),
            session_id: Some("s".into()),
            arrival_s: arrival,
            policy: "p".into(),
            replica,
            branch: Some("ring".into()),
            predicted_match_tokens: None,
            outstanding_chosen: Some(0),
            outstanding_min: Some(0),
            decide_ns: Some(100),
            overhead_us: Some(50.0),
            tokenize_ms: None,
            upstream_status: Some(200),
            cached_tokens: None,
            prompt_tokens: None,
            error: None,
            attempts: Some(1),
        }
    }

    /// Router clock = driver clock + 100 s; xtask clock = router clock − 50 s. Kill at driver
    /// 10 s, up again at driver 13 s, the load ends at 20 s.
    fn events(kind: FaultKind) -> FaultEvents {
        FaultEvents {
            kind,
            victim: 1,
            victim_url: "http://127.0.0.1:1".into(),
            replicas: 3,
            router_minus_xtask_s: 50.0,
            clock_uncertainty_s: 0.001,
            router_minus_driver_s: 100.0,
            xtask: Instants {
                fault_s: 60.0,
                drained_s: None,
                down_s: 60.0,
                restart_s: 62.9,
                up_s: 63.0,
                undrain_s: None,
            },
            outstanding_at_fault: Some(2),
            waited_for_inflight_s: 0.0,
            run_end_s: 20.0,
            warmup_s: 1.0,
        }
    }

    fn slo() -> analysis::Slo {
        analysis::Slo {
            ttft_ms: 100.0,
            itl_ms: 5.0,
        }
    }

    #[test]
    fn clocks_map_between_the_three() {
        let e = events(FaultKind::Kill);
        assert!((e.driver().fault_s - 10.0).abs() < 1e-9);
        assert!((e.router().fault_s - 110.0).abs() < 1e-9);
        assert!((e.driver().up_s - 13.0).abs() < 1e-9);
        let c = vec![
            client("a", 1.0, Some(10.0), None),
            client("b", 2.0, Some(10.0), None),
        ];
        let r = vec![
            routed("a", 101.0004, Some(0)),
            routed("b", 102.0002, Some(0)),
        ];
        let off = router_minus_driver(&c, &r).unwrap();
        assert!(
            (off - 100.0002).abs() < 1e-9,
            "the smallest gap wins: {off}"
        );
        let probes = vec![
            ("fault-clock-probe-0".to_string(), 1.0, 1.01),
            ("fault-clock-probe-1".to_string(), 2.0, 2.002),
        ];
        let rows = vec![
            routed("fault-clock-probe-0", 51.004, None),
            routed("fault-clock-probe-1", 52.0008, None),
        ];
        let (offset, half) = probe_offset(&probes, &rows).unwrap();
        assert!((half - 0.001).abs() < 1e-9, "the shortest round trip wins");
        assert!((offset - 49.9998).abs() < 1e-9);
        assert!(probe_offset(&probes, &[]).is_err());
    }

    #[test]
    fn kill_loses_only_what_was_in_flight_on_the_victim() {
        let e = events(FaultKind::Kill);
        let mut c: Vec<ClientRow> = (0..20)
            .map(|i| client(&format!("ok{i}"), f64::from(i), Some(20.0), None))
            .collect();
        let mut r: Vec<RouterRow> = (0..20)
            .map(|i| routed(&format!("ok{i}"), 100.0 + f64::from(i), Some(i % 3)))
            .collect();
        // In flight on the victim at the kill: sent 9.9, arrived 109.9.
        c.push(client("inflight", 9.9, None, Some("stream: reset")));
        r.push(routed("inflight", 109.9, Some(1)));
        let out = analyse_rep("p", 1, &e, &c, &r, &slo());
        assert!(out.violations.is_empty(), "{:?}", out.violations);
        assert_eq!(out.lost.len(), 1);
        assert!(out.lost[0].allowed);

        // Sent after the kill and lost: a request not in flight at it.
        let mut c2 = c.clone();
        let mut r2 = r.clone();
        c2.push(client("late", 11.0, None, Some("upstream: refused")));
        r2.push(routed("late", 111.0, Some(1)));
        // Lost on a replica that was never killed.
        c2.push(client("other", 9.95, None, Some("stream: reset")));
        r2.push(routed("other", 109.95, Some(2)));
        // Never dispatched.
        c2.push(client("nowhere", 10.5, None, Some("http: 503")));
        r2.push(routed("nowhere", 110.5, None));
        // The router gave up on it (502) after trying the dead victim: never in flight.
        let mut gave_up = client("gave-up", 9.8, None, Some("http: 502"));
        gave_up.status = 502;
        c2.push(gave_up);
        r2.push(routed("gave-up", 109.8, Some(1)));
        // No router row at all.
        c2.push(client("unseen", 12.0, None, Some("connect: refused")));
        // A probe row is not a request.
        r2.push(routed("fault-clock-probe-0", 99.0, None));
        let out = analyse_rep("p", 1, &e, &c2, &r2, &slo());
        assert_eq!(out.lost.len(), 6);
        assert_eq!(out.violations.len(), 5, "{:?}", out.violations);
        assert!(
            out.violations
                .iter()
                .any(|v| v.starts_with("gave-up:") && v.contains("502"))
        );
        assert!(
            out.violations
                .iter()
                .any(|v| v.starts_with("late:") && v.contains("after the kill"))
        );
        assert!(
            out.violations
                .iter()
                .any(|v| v.starts_with("other:") && v.contains("replica 2"))
        );
        assert!(out.violations.iter().any(|v| v.starts_with("nowhere:")));
        assert!(
            out.violations
                .iter()
                .any(|v| v.starts_with("unseen:") && v.contains("not dispatched"))
        );
    }

    #[test]
    fn a_drain_may_lose_nothing() {
        let mut e = events(FaultKind::Drain);
        e.xtask.drained_s = Some(60.5);
        e.xtask.down_s = 60.6;
        let c = vec![
            client("a", 5.0, Some(10.0), None),
            client("b", 9.0, None, Some("stream: reset")),
        ];
        let r = vec![routed("a", 105.0, Some(0)), routed("b", 109.0, Some(1))];
        let out = analyse_rep("p", 1, &e, &c, &r, &slo());
        assert_eq!(out.violations.len(), 1);
        assert!(out.violations[0].contains("drain"));
        assert!(out.shares.iter().any(|w| w.window == "draining"));
    }

    #[test]
    fn shares_ttft_goodput_and_recovery() {
        let e = events(FaultKind::Kill);
        let mut c = Vec::new();
        let mut r = Vec::new();
        // Four requests a second for 20 s; during the outage (10..13) TTFT breaks the SLO, and
        // the victim gets nothing.
        for i in 0..80 {
            let t = f64::from(i) * 0.25;
            let id = format!("q{i}");
            let ttft = if (10.0..13.0).contains(&t) {
                500.0
            } else {
                20.0
            };
            c.push(client(&id, t, Some(ttft), None));
            let replica = if (10.0..13.0).contains(&t) {
                2 * (i % 2)
            } else {
                i % 3
            };
            // During the outage every other decision spills to a cold replica (nothing cached);
            // otherwise every decision matches with 80 of 100 prompt tokens cached.
            let spill = (10.0..13.0).contains(&t) && i % 2 == 0;
            let mut row = routed(&id, 100.0 + t, Some(replica));
            row.branch = Some(if spill { "spill-load" } else { "match" }.into());
            row.prompt_tokens = Some(100);
            row.cached_tokens = Some(if spill { 0 } else { 80 });
            r.push(row);
        }
        let out = analyse_rep("p", 1, &e, &c, &r, &slo());
        assert!(out.violations.is_empty());
        let outage = out.shares.iter().find(|w| w.window == "outage").unwrap();
        assert_eq!(outage.share[1], 0.0, "the victim served nothing while down");
        assert_eq!(outage.requests, 12);
        assert_eq!(outage.spill_rate, Some(0.5));
        assert_eq!(outage.prefix_hit_rate, Some(0.4));
        let steady = out.shares.iter().find(|w| w.window == "before").unwrap();
        assert_eq!(
            (steady.spill_rate, steady.prefix_hit_rate),
            (Some(0.0), Some(0.8))
        );
        let before = out.ttft.iter().find(|w| w.window == "before").unwrap();
        assert_eq!(before.p50_ms, Some(20.0));
        let during = out.ttft.iter().find(|w| w.window == "outage").unwrap();
        assert_eq!(during.p50_ms, Some(500.0));
        assert_eq!(out.goodput.len(), 20);
        assert_eq!(out.goodput_before_rps, Some(4.0));
        assert_eq!(out.goodput_outage_rps, Some(0.0));
        assert_eq!(out.recovery_s, Some(0.0));
        assert_eq!(out.attainment, [Some(1.0), Some(0.0), Some(1.0)]);

        let tl = timeline(&[
            out.clone(),
            RepOutcome {
                rep: 2,
                ..out.clone()
            },
        ]);
        assert_eq!(tl.len(), 20);
        assert!(tl[9].replica_alive && !tl[10].replica_alive && !tl[12].replica_alive);
        assert!(tl[13].replica_alive);
        let csv = timeline_csv(&tl);
        assert!(csv.starts_with("policy,t_s,goodput_rps,replica_alive\np,0.000,4.000,1\n"));
        assert!(csv.contains("p,10.000,0.000,0\n"));
    }

    /// The scenario of `tests/fault.rs`, in process rather than through the CLI (a debugger can
    /// follow it). Needs the release binaries: `cargo build --release -p engine-bin -p
    /// router-bin -p driver-bin`, then `cargo test -p xtask --bin xtask -- --ignored fault::`.
    #[test]
    fn summary_markdown_names_the_verdict() {
        let e = events(FaultKind::Kill);
        let c = vec![client("a", 5.0, Some(10.0), None)];
        let r = vec![routed("a", 105.0, Some(0))];
        let out = analyse_rep("session-affinity", 1, &e, &c, &r, &slo());
        let s = Summary {
            kind: FaultKind::Kill,
            point: "ws1-s0-rate2.4".into(),
            reps: vec![out],
            violations: vec![],
        };
        let md = markdown(&s);
        assert!(md.contains("Loss bounds hold"));
        assert!(md.contains("| session-affinity | 1 | 1 | 0 |"));
    }
}
