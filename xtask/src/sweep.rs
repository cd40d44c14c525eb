//! `cargo xtask sweep <name>`: for each point, repetition and policy — cycle the fleet, start the
//! router, warm up, measure, check drift and evidence, write meta last; then the report.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;

use fleet::evidence::EvidenceConfig;
use fleet::{DriverSettings, Fleet, RouterSettings};
use workload::{ArrivalSpec, Sizing, WorkloadSpec};

use crate::calibration::{self, CalibrateArgs, Calibration};
use crate::cell::{self, CellState, Meta};
use crate::env::Bins;
use crate::fleetargs::{FleetArgs, FleetKind};
use crate::grid::{self, Arrival, GridParams, Point, SweepName};
use crate::interrupt;
use crate::report;
use crate::run::{self, Attempt, IngressArg, PlanFile};

/// Flags of `cargo xtask sweep`.
#[derive(Debug, Clone, Args)]
pub struct SweepArgs {
    /// Which sweep.
    #[arg(value_enum)]
    pub name: SweepName,
    /// Reduced grid, 3 replicas, short cells: the main job on a small machine.
    #[arg(long)]
    pub quick: bool,
    /// Repetitions per point and policy.
    #[arg(long, default_value_t = 3)]
    pub reps: u32,
    /// Policies to compare, comma-separated (default: all nine; three with --quick).
    #[arg(long, value_delimiter = ',')]
    pub policies: Vec<String>,
    /// What sits in front of the replicas: kvroute's router (policies from `--policies`) or
    /// HAProxy with bounded-load consistent hashing on `x-session-id` (one policy,
    /// `haproxy-session-bounded`).
    #[arg(long, value_enum, default_value_t = IngressArg::Router)]
    pub ingress: IngressArg,
    /// HAProxy's load bound c (`hash-balance-factor` = c × 100), with `--ingress haproxy`
    /// (alias `--load-factor`, the router's name for session-bounded's bound).
    #[arg(long, visible_alias = "load-factor", default_value_t = 1.25)]
    pub balance_factor: f64,
    /// Closed-loop users (the reference load).
    #[arg(long, default_value_t = 32)]
    pub users: u32,
    /// Open loop instead of closed loop (pressure-grid, turns, prompt-length).
    #[arg(long, requires = "rate")]
    pub open_loop: bool,
    /// Open-loop rate, requests per second of model time (wall rate = rate × speed).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Only these points (names as in the sweep directory, e.g. `ws1-s0`), comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub points: Vec<String>,
    /// Model-time rates of the `load` sweep, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub rates: Vec<f64>,
    /// Mean think time of closed-loop users, s of model time (wall = think ÷ speed).
    #[arg(long, default_value_t = 1.0)]
    pub think_s: f64,
    /// Warm-up per cell, wall s (discarded; default 20, or 5 with --quick).
    #[arg(long)]
    pub warmup_s: Option<f64>,
    /// Measured window per cell, wall s (default 40, or 8 with --quick).
    #[arg(long)]
    pub measure_s: Option<f64>,
    /// Root of the measurements.
    #[arg(long, default_value = "measurements")]
    pub out: PathBuf,
    /// Sweep directory name (default: the sweep's name, `-quick` appended with --quick).
    #[arg(long)]
    pub sweep_dir_name: Option<String>,
    /// Calibration to use (run first when missing or made for another fleet).
    #[arg(long, default_value = "measurements/calibration.json")]
    pub calibration: PathBuf,
    /// Recalibrate even when the calibration matches.
    #[arg(long)]
    pub recalibrate: bool,
    /// Delete the sweep directory first instead of resuming it.
    #[arg(long)]
    pub fresh: bool,
    /// Largest engine lateness p99 (wall ms) a cell may show before it is discarded and re-run.
    #[arg(long, default_value_t = 5.0)]
    pub max_lateness_p99_ms: f64,
    /// Re-runs of a cell whose evidence fails before it is set aside.
    #[arg(long, default_value_t = 2)]
    pub evidence_retries: u32,
    /// Seconds between evidence samples.
    #[arg(long, default_value_t = 1.0)]
    pub evidence_interval_s: f64,
    /// Per-request timeout, wall s.
    #[arg(long, default_value_t = 60.0)]
    pub request_timeout_s: f64,
    /// Workload seed.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Use the binaries already in target/release.
    #[arg(long)]
    pub no_build: bool,
    /// Skip the report at the end.
    #[arg(long)]
    pub no_report: bool,
    /// Run in virtual time through the simulator (`sim` crate) instead of live processes;
    /// default directory `<sweep>[-quick]-virtual`.
    #[arg(long = "virtual")]
    pub virtual_time: bool,
    /// The fleet.
    #[command(flatten)]
    pub fleet: FleetArgs,
}

impl SweepArgs {
    pub(crate) fn warmup(&self) -> f64 {
        self.warmup_s
            .unwrap_or_else(|| crate::fleetargs::default_warmup_s(self.quick))
    }
    pub(crate) fn measure(&self) -> f64 {
        self.measure_s
            .unwrap_or_else(|| crate::fleetargs::default_measure_s(self.quick))
    }
    fn dir(&self) -> PathBuf {
        let name = self.sweep_dir_name.clone().unwrap_or_else(|| {
            if self.quick {
                format!("{}-quick", self.name.as_str())
            } else {
                self.name.as_str().to_string()
            }
        });
        self.out.join(name)
    }
}

/// Progress over the cells of a sweep, with an ETA from the cells run so far.
struct Progress {
    total: usize,
    done: usize,
    ran: usize,
    ran_time: Duration,
    started: Instant,
    estimate_per_cell: Duration,
}

impl Progress {
    fn eta(&self) -> Duration {
        let per = if self.ran > 0 {
            self.ran_time / self.ran as u32
        } else {
            self.estimate_per_cell
        };
        per * (self.total - self.done) as u32
    }
}

fn fmt_duration(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else {
        format!("{}m{:02}s", s / 60, s % 60)
    }
}

/// The calibration for this sweep: the sweep directory's own (a resumed sweep keeps its SLO),
/// else `--calibration` when made for this fleet, else a fresh one.
fn calibration_for(args: &SweepArgs, bins: &Bins, sweep_dir: &Path) -> Result<Calibration> {
    let key = args.fleet.key(args.quick);
    let own = sweep_dir.join("calibration.json");
    if own.exists() {
        let c = Calibration::read(&own)?;
        if c.fleet != key {
            bail!(
                "{} was calibrated for another fleet ({:?}); resume it with the same fleet flags or start a new sweep (--fresh or --sweep-dir-name)",
                sweep_dir.display(),
                c.fleet
            );
        }
        return Ok(c);
    }
    if !args.recalibrate && args.calibration.exists() {
        match Calibration::read(&args.calibration) {
            Ok(c) if c.fleet == key => {
                eprintln!("xtask: using {}", args.calibration.display());
                return Ok(c);
            }
            Ok(_) => eprintln!(
                "xtask: {} is for another fleet; recalibrating",
                args.calibration.display()
            ),
            Err(e) => eprintln!("xtask: {e:#}; recalibrating"),
        }
    }
    calibration::calibrate(
        &CalibrateArgs {
            fleet: args.fleet.clone(),
            out: args.calibration.clone(),
            quick: args.quick,
            include_outliers: false,
            outlier_factor: 1.3,
            requests: None,
            users: args.users,
            think_s: args.think_s,
            warmup_s: args.warmup_s,
            measure_s: args.measure_s,
            no_build: true,
            seed: args.seed,
        },
        bins,
    )
}

/// The plan of one point.
pub(crate) fn plan_for(
    args: &SweepArgs,
    point: &Point,
    cal: &Calibration,
    sweep_dir: &Path,
) -> Result<PlanFile> {
    let speed = args.fleet.effective_speed();
    let spec = WorkloadSpec {
        seed: args.seed,
        sizing: Sizing::WorkingSet {
            capacity_tokens: cal.capacity_tokens,
            ratio: point.ratio,
        },
        zipf_s: point.zipf_s,
        turns: point.turns,
        prefix_tokens: point.prefix_tokens,
        ..WorkloadSpec::default()
    };
    let run_s = args.warmup() + args.measure();
    let arrival = match point.arrival {
        Arrival::Closed { users } => {
            let think_wall_s = args.think_s / speed;
            ArrivalSpec::Closed {
                users,
                think_mean_s: think_wall_s,
                requests_per_user: experiment::calibration::requests_per_user(
                    run_s,
                    think_wall_s,
                    cal.floors,
                    spec.output_tokens,
                ),
            }
        }
        Arrival::Open { rate_rps } => ArrivalSpec::Open {
            rate_rps: rate_rps * speed,
            duration_s: run_s,
        },
    };
    run::ensure_plan(&sweep_dir.join(&point.name), &spec, &arrival)
}

/// Keeps the points named in `only` (all when empty); an unknown name is an error.
fn select_points(points: Vec<Point>, only: &[String]) -> Result<Vec<Point>> {
    if only.is_empty() {
        return Ok(points);
    }
    if let Some(unknown) = only.iter().find(|n| !points.iter().any(|p| &p.name == *n)) {
        let names: Vec<&str> = points.iter().map(|p| p.name.as_str()).collect();
        bail!(
            "no point `{unknown}` in this sweep; its points are {}",
            names.join(", ")
        );
    }
    Ok(points
        .into_iter()
        .filter(|p| only.contains(&p.name))
        .collect())
}

/// The sweep's grid points for a fleet of `replicas`, narrowed to `--points`; the live and the
/// virtual sweep share it so both run the same grid.
pub(crate) fn sweep_points(args: &SweepArgs, replicas: usize) -> Result<Vec<Point>> {
    let points = grid::points(
        args.name,
        &GridParams {
            quick: args.quick,
            users: args.users,
            open_rate_rps: if args.open_loop { args.rate } else { None },
            rates_rps: args.rates.clone(),
            replicas,
        },
    )?;
    select_points(points, &args.points)
}

/// The file that records a sweep run's settings: `sweep.json` for the router, `sweep-haproxy.json`
/// for HAProxy cells run into the same directory, so that adding them does not overwrite the
/// record of the router grid.
fn record_file_name(ingress: IngressArg) -> &'static str {
    match ingress {
        IngressArg::Router => "sweep.json",
        IngressArg::Haproxy => "sweep-haproxy.json",
    }
}

/// Settings that must agree for two runs into one directory to be one sweep.
const RECORD_SETTINGS: [&str; 7] = [
    "sweep",
    "quick",
    "reps",
    "warmup_s",
    "measure_s",
    "think_model_s",
    "speed",
];

/// The record to write when `earlier` is already on disk: a run restricted with `--points` or
/// `--policies` (a resume, or arms added later) with the same settings adds its points and
/// policies to the earlier record instead of shrinking it to its own; a run with other settings
/// replaces it (each repetition's `meta.json` keeps its own settings either way).
fn merged_record(
    earlier: Option<serde_json::Value>,
    mut record: serde_json::Value,
) -> serde_json::Value {
    let Some(earlier) = earlier else {
        return record;
    };
    if RECORD_SETTINGS
        .iter()
        .any(|k| earlier.get(k) != record.get(k))
    {
        return record;
    }
    for (key, id) in [("points", Some("name")), ("policies", None)] {
        let key_of = |v: &serde_json::Value| match id {
            Some(id) => v.get(id).cloned(),
            None => Some(v.clone()),
        };
        let mut union: Vec<serde_json::Value> = earlier
            .get(key)
            .and_then(|v| v.as_array())
            .cloned()
            .unwrap_or_default();
        let new = record
            .get(key)
            .and_then(|v| v.as_array())
            .cloned()
            .unwrap_or_default();
        for item in new {
            let k = key_of(&item);
            if let Some(slot) = union.iter_mut().find(|u| key_of(u) == k) {
                *slot = item;
            } else {
                union.push(item);
            }
        }
        record[key] = serde_json::Value::Array(union);
    }
    record
}

/// Runs the sweep; returns its directory.
pub fn sweep(args: &SweepArgs, bins: &Bins) -> Result<PathBuf> {
    let sweep_dir = args.dir();
    if args.fresh && sweep_dir.exists() {
        std::fs::remove_dir_all(&sweep_dir)
            .with_context(|| format!("removing {}", sweep_dir.display()))?;
    }
    std::fs::create_dir_all(&sweep_dir)?;
    if args.reps == 0 {
        bail!("--reps must be at least 1");
    }
    let cal = calibration_for(args, bins, &sweep_dir)?;
    cal.write(&sweep_dir.join("calibration.json"))?;
    let policies = match args.ingress {
        IngressArg::Router => grid::policies(&args.policies, args.quick)?,
        IngressArg::Haproxy => {
            if !args.policies.is_empty() {
                bail!(
                    "--policies chooses the router's policies; with --ingress haproxy the only policy is {}",
                    fleet::ingress::haproxy::POLICY
                );
            }
            vec![fleet::ingress::haproxy::POLICY.to_string()]
        }
    };
    let points = sweep_points(args, cal.used_replicas.len())?;
    let kv_events = policies.iter().any(|p| grid::needs_kv_events(p));
    let source = args.fleet.source(
        &bins.engine,
        args.quick,
        kv_events,
        Some(&cal.used_replicas),
    )?;
    let emulated = matches!(args.fleet.fleet, FleetKind::Emulated);
    let mut fleet = Fleet::new(
        source,
        args.fleet.options(&sweep_dir.join("logs").join("fleet")),
    )?;
    let git_rev = crate::env::git_rev();
    let versions = crate::env::versions();
    let speed = args.fleet.effective_speed();
    let record = serde_json::json!({
        "sweep": args.name.as_str(),
        "quick": args.quick,
        "points": points,
        "policies": policies,
        "reps": args.reps,
        "warmup_s": args.warmup(),
        "measure_s": args.measure(),
        "think_model_s": args.think_s,
        "speed": speed,
        "max_lateness_p99_ms": args.max_lateness_p99_ms,
        "calibration": cal,
    });
    let record_path = sweep_dir.join(record_file_name(args.ingress));
    let earlier = std::fs::read_to_string(&record_path)
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok());
    cell::write_atomic(
        &record_path,
        serde_json::to_string_pretty(&merged_record(earlier, record))?.as_bytes(),
    )?;

    let total = points.len() * policies.len() * args.reps as usize;
    let mut progress = Progress {
        total,
        done: 0,
        ran: 0,
        ran_time: Duration::ZERO,
        started: Instant::now(),
        estimate_per_cell: Duration::from_secs_f64(args.warmup() + args.measure() + 4.0),
    };
    eprintln!(
        "xtask sweep {}: {} points × {} policies × {} reps = {total} cells into {} (SLO TTFT < {:.1} ms, ITL p50 < {:.2} ms; capacity {} tokens)",
        args.name.as_str(),
        points.len(),
        policies.len(),
        args.reps,
        sweep_dir.display(),
        cal.slo.ttft_ms,
        cal.slo.itl_ms,
        cal.capacity_tokens
    );
    for point in &points {
        let plan = plan_for(args, point, &cal, &sweep_dir)?;
        for rep in 1..=args.reps {
            for policy in &policies {
                if interrupt::requested() {
                    bail!(
                        "interrupted; completed cells are kept, rerun the same command to resume"
                    );
                }
                let dir = sweep_dir
                    .join(&point.name)
                    .join(policy)
                    .join(format!("rep-{rep}"));
                let state = CellState::of(&dir);
                if state.is_done() {
                    progress.done += 1;
                    continue;
                }
                let t0 = Instant::now();
                let outcome = run_cell(
                    args, bins, &mut fleet, &cal, &sweep_dir, point, policy, rep, &plan, emulated,
                    &git_rev, &versions,
                )?;
                progress.done += 1;
                progress.ran += 1;
                progress.ran_time += t0.elapsed();
                eprintln!(
                    "[{}/{}] {} {} rep-{rep}: {outcome} — {} elapsed, ETA {}",
                    progress.done,
                    progress.total,
                    point.name,
                    policy,
                    fmt_duration(progress.started.elapsed()),
                    fmt_duration(progress.eta()),
                );
            }
        }
    }
    fleet.stop();
    if !args.no_report {
        report::write(&sweep_dir)?;
    }
    Ok(sweep_dir)
}

#[allow(clippy::too_many_arguments)]
fn run_cell(
    args: &SweepArgs,
    bins: &Bins,
    fleet: &mut Fleet,
    cal: &Calibration,
    sweep_dir: &Path,
    point: &Point,
    policy: &str,
    rep: u32,
    plan: &PlanFile,
    emulated: bool,
    git_rev: &Option<String>,
    versions: &serde_json::Value,
) -> Result<String> {
    let dir = sweep_dir
        .join(&point.name)
        .join(policy)
        .join(format!("rep-{rep}"));
    let run_s = args.warmup() + args.measure();
    let (mode, closed_users) = match point.arrival {
        Arrival::Closed { users } => ("closed", Some(users as usize)),
        Arrival::Open { .. } => ("open", None),
    };
    let belief = grid::uses_belief_index(policy);
    let router = RouterSettings {
        policy: policy.to_string(),
        model: args.fleet.model.clone(),
        seed: args.seed + u64::from(rep),
        index_ttl_s: if belief { cal.index.ttl_s } else { None },
        index_node_cap: if belief { cal.index.node_cap } else { None },
        kv_events: grid::needs_kv_events(policy),
    };
    let driver = DriverSettings {
        mode,
        warmup_s: args.warmup(),
        duration_s: Some(run_s),
        timeout_s: args.request_timeout_s,
        model: args.fleet.model.clone(),
    };
    let mut drift_reruns = 0u32;
    let mut evidence_reruns = 0u32;
    let mut failures = 0u32;
    let mut attempt = 0u32;
    let mut set_aside: Option<String> = None;
    loop {
        attempt += 1;
        cell::clear(&dir)?;
        let result = run::run_attempt(
            fleet,
            Attempt {
                bins,
                dir: &dir,
                plan,
                router: router.clone(),
                driver: driver.clone(),
                closed_users,
                planned_end_s: run_s,
                slo: crate::cell::Slo {
                    ttft_ms: cal.slo.ttft_ms,
                    itl_ms: cal.slo.itl_ms,
                },
                evidence: EvidenceConfig {
                    lateness_urls: vec![],
                    fleet_process_groups: vec![],
                    check_foreign: !matches!(args.fleet.fleet, FleetKind::Static),
                    gpu: true,
                    interval: Duration::from_secs_f64(args.evidence_interval_s.max(0.05)),
                    fleet_gpus: Default::default(),
                },
                sample_lateness: emulated,
                ingress: args.ingress.into(),
                haproxy: fleet::ingress::HaproxySettings {
                    balance_factor: args.balance_factor,
                    ..fleet::ingress::HaproxySettings::default()
                },
                limit: Duration::from_secs_f64(run_s * 3.0 + args.request_timeout_s + 30.0),
            },
        );
        let result = match result {
            Ok(r) => r,
            Err(e) if interrupt::requested() => {
                // Leave no half cell that could look whole: it has no meta, and we clear it.
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e.context("interrupted"));
            }
            Err(e) => {
                failures += 1;
                let reason = format!("attempt {attempt} failed: {e:#}");
                eprintln!("xtask: {} {policy} rep-{rep}: {reason}", point.name);
                if failures >= 2 {
                    return Err(anyhow!(
                        "{} {policy} rep-{rep} failed twice; last: {e:#}",
                        point.name
                    ));
                }
                if dir.exists() {
                    cell::discard(sweep_dir, &point.name, policy, rep, attempt, &reason)?;
                }
                continue;
            }
        };
        // Evidence first: a dirty window says nothing about warming.
        if let Err(why) = result
            .evidence
            .check(&run::bounds(args.max_lateness_p99_ms))
        {
            if evidence_reruns < args.evidence_retries {
                evidence_reruns += 1;
                eprintln!(
                    "xtask: {} {policy} rep-{rep}: evidence failed ({why}); discarded, re-running",
                    point.name
                );
                cell::discard(
                    sweep_dir,
                    &point.name,
                    policy,
                    rep,
                    attempt,
                    &format!("evidence: {why}"),
                )?;
                continue;
            }
            set_aside = Some(format!(
                "evidence failed on {} attempts: {why}",
                evidence_reruns + 1
            ));
        }
        let drift = analysis::check_rep_dir(
            &dir,
            &analysis::Slo {
                ttft_ms: cal.slo.ttft_ms,
                itl_ms: cal.slo.itl_ms,
            },
            &analysis::Window {
                warmup_s: result.window.warmup_s,
                measured_start_s: result.window.measured_start_s,
                measured_end_s: result.window.measured_end_s,
            },
            &analysis::DriftConfig::default(),
        )
        .map_err(|e| anyhow!("drift check of {}: {e}", dir.display()))?;
        if set_aside.is_none() && drift.warming {
            let why = drift.reason.clone().unwrap_or_else(|| "warming".into());
            if drift_reruns == 0 {
                drift_reruns += 1;
                eprintln!(
                    "xtask: {} {policy} rep-{rep}: drift ({why}); re-running once",
                    point.name
                );
                cell::discard(
                    sweep_dir,
                    &point.name,
                    policy,
                    rep,
                    attempt,
                    &format!("drift: {why}"),
                )?;
                continue;
            }
            set_aside = Some(format!("drifted twice: {why}"));
        }
        let meta = Meta {
            sweep: args.name.as_str().to_string(),
            point: point.name.clone(),
            policy: policy.to_string(),
            rep,
            workload_name: plan.workload_name.clone(),
            workload_fingerprint: plan.workload_fingerprint.clone(),
            plan_fingerprint: plan.plan_fingerprint.clone(),
            fleet: serde_json::json!({
                "source": args.fleet.key(args.quick).source,
                "replicas": fleet.replicas().len(),
                "speed": args.fleet.effective_speed(),
                "slowdowns": fleet.replicas().iter().map(|r| r.slowdown).collect::<Vec<_>>(),
                "capacity_tokens": cal.capacity_tokens,
                "num_gpu_blocks": cal.fleet.num_gpu_blocks,
                "model": args.fleet.model,
                "used_replicas": cal.used_replicas,
            }),
            slo: crate::cell::Slo {
                ttft_ms: cal.slo.ttft_ms,
                itl_ms: cal.slo.itl_ms,
            },
            window: result.window,
            git_rev: git_rev.clone(),
            versions: versions.clone(),
            virtual_time: false,
            complete: true,
            accepted: set_aside.is_none(),
            set_aside_reason: set_aside.clone(),
            attempts: attempt,
            evidence: serde_json::to_value(&result.evidence)?,
            drift: serde_json::to_value(&drift)?,
            run: serde_json::json!({
                "plan": plan.name,
                "router": router,
                "driver": driver,
                "think_model_s": args.think_s,
                "arrival": point.arrival,
                "requests": result.requests,
            }),
        };
        if interrupt::requested() {
            let _ = std::fs::remove_dir_all(&dir);
            bail!("interrupted before the cell was recorded");
        }
        cell::write_meta(&dir, &meta)?;
        return Ok(match set_aside {
            None => format!(
                "accepted, goodput {:.2} req/s over {:.1} s{}",
                result.goodput_rps,
                result.window.measured_end_s - result.window.measured_start_s,
                if attempt > 1 {
                    format!(" (attempt {attempt})")
                } else {
                    String::new()
                }
            ),
            Some(why) => format!("set aside: {why}"),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid() -> Vec<Point> {
        grid::points(
            SweepName::PressureGrid,
            &GridParams {
                quick: true,
                users: 32,
                open_rate_rps: None,
                rates_rps: vec![],
                replicas: 3,
            },
        )
        .unwrap()
    }

    #[test]
    fn a_restricted_run_adds_to_the_sweep_record_instead_of_shrinking_it() {
        let rec = |points: &[&str], policies: &[&str], warmup_s: f64| {
            serde_json::json!({
                "sweep": "pressure-grid", "quick": false, "reps": 3, "warmup_s": warmup_s,
                "measure_s": 10.0, "think_model_s": 1.0, "speed": 6.0,
                "points": points.iter().map(|p| serde_json::json!({"name": p})).collect::<Vec<_>>(),
                "policies": policies,
            })
        };
        let names = |v: &serde_json::Value| -> Vec<String> {
            v["points"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p["name"].as_str().unwrap().to_string())
                .collect()
        };
        let full = rec(
            &["ws1-s0", "ws3-s0"],
            &["round-robin", "session-affinity"],
            15.0,
        );
        let resumed = rec(
            &["ws3-s0", "ws8-s0"],
            &["session-affinity", "prefix-affinity"],
            15.0,
        );
        let merged = merged_record(Some(full.clone()), resumed);
        assert_eq!(names(&merged), ["ws1-s0", "ws3-s0", "ws8-s0"]);
        assert_eq!(
            merged["policies"],
            serde_json::json!(["round-robin", "session-affinity", "prefix-affinity"])
        );
        // Other windows make another sweep: its record replaces the earlier one.
        let other = rec(&["ws8-s0"], &["round-robin"], 20.0);
        assert_eq!(names(&merged_record(Some(full), other.clone())), ["ws8-s0"]);
        assert_eq!(merged_record(None, other.clone()), other);
        // HAProxy cells keep their own record beside the router grid's.
        assert_eq!(record_file_name(IngressArg::Router), "sweep.json");
        assert_eq!(record_file_name(IngressArg::Haproxy), "sweep-haproxy.json");
    }

    #[test]
    fn points_are_selected_by_name() {
        assert_eq!(select_points(grid(), &[]).unwrap().len(), 4);
        let one = select_points(grid(), &["ws3-s0".to_string()]).unwrap();
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].ratio, 3.0);
        let err = select_points(grid(), &["ws9-s0".to_string()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("ws9-s0") && err.contains("ws1-s0"), "{err}");
    }

    #[test]
    fn eta_uses_cells_run_so_far() {
        let mut p = Progress {
            total: 10,
            done: 0,
            ran: 0,
            ran_time: Duration::ZERO,
            started: Instant::now(),
            estimate_per_cell: Duration::from_secs(20),
        };
        assert_eq!(p.eta(), Duration::from_secs(200));
        // Two cells skipped on resume, two run at 15 s each.
        p.done = 4;
        p.ran = 2;
        p.ran_time = Duration::from_secs(30);
        assert_eq!(p.eta(), Duration::from_secs(90));
        assert_eq!(fmt_duration(Duration::from_secs(3725)), "1h02m");
        assert_eq!(fmt_duration(Duration::from_secs(75)), "1m15s");
    }
}
