//! `cargo xtask sweep <name> --virtual`: the same sweep in virtual time through the `sim` crate.
//!
//! The points, policies and plans are the live sweep's (`sweep::sweep_points`, `grid::policies`,
//! `sweep::plan_for`, so `plan.bin` is byte-identical to what a live sweep of the same flags
//! writes); the simulated fleet is the emulated fleet those flags describe (replicas, blocks,
//! `--speed`, slowdowns), so the plan's wall-scaled think times and rates mean the same thing. The
//! SLO comes from `sim::calibrate` (3× the virtual floors). Every repetition gets its own policy
//! and engine seed and a small step-time jitter, so repetitions differ the way live ones do,
//! while the same seed still gives byte-identical rows. Each repetition's rows pass the live
//! drift check before its `meta.json` (`"virtual": true`) is written; a drifting repetition is
//! set aside at once, since re-running a deterministic cell would only repeat it. Then the
//! report, as for a live sweep.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};

use workload::{Plan, WorkloadSpec};

use crate::calibration::{Calibration, IndexCalibration, SLO_FACTOR};
use crate::cell::{self, CellState, Slo};
use crate::fleetargs::FleetKind;
use crate::grid;
use crate::interrupt;
use crate::report;
use crate::sweep::{self, SweepArgs};

/// Step-time jitter of every virtual engine: enough that repetitions differ.
pub const JITTER: f64 = 0.02;

/// Unseen single-turn prompts the virtual calibration measures.
const CALIBRATION_REQUESTS: u32 = 64;

/// A replica whose slowdown exceeds the fleet's median by this factor is left out, as the live
/// calibration leaves out a throttling outlier (its floors scale with the slowdown).
const OUTLIER_FACTOR: f64 = 1.3;

/// The sweep directory: `--out/<sweep>[-quick]-virtual`, or `--sweep-dir-name`.
fn sweep_dir(args: &SweepArgs) -> PathBuf {
    let name = args.sweep_dir_name.clone().unwrap_or_else(|| {
        let quick = if args.quick { "-quick" } else { "" };
        format!("{}{quick}-virtual", args.name.as_str())
    });
    args.out.join(name)
}

/// The simulated fleet's base config (no policy yet): the emulated fleet the flags describe,
/// keeping only the replicas in `used`.
fn base_config(args: &SweepArgs, used: &[usize]) -> Result<sim::SimConfig> {
    let f = &args.fleet;
    let blocks = u32::try_from(f.blocks(args.quick))
        .map_err(|_| anyhow!("--num-gpu-blocks {} is too large", f.blocks(args.quick)))?;
    let mut cfg = sim::SimConfig::new(used.len() as u32, "round-robin");
    cfg.engine.num_gpu_blocks = blocks;
    cfg.engine.model.speed = f.speed;
    cfg.engine.model.jitter = JITTER;
    cfg.slowdowns = used
        .iter()
        .map(|&i| f.slowdowns.get(i).copied().unwrap_or(1.0))
        .collect();
    cfg.model = f.model.clone();
    cfg.validate().map_err(|e| anyhow!("{e}"))?;
    Ok(cfg)
}

/// Replicas in use: all but those slowed beyond `OUTLIER_FACTOR` × the median slowdown.
fn used_replicas(args: &SweepArgs, n: usize) -> Vec<usize> {
    let slow: Vec<f64> = (0..n)
        .map(|i| args.fleet.slowdowns.get(i).copied().unwrap_or(1.0))
        .collect();
    let median = analysis::stats::median(&slow).unwrap_or(1.0);
    let used: Vec<usize> = (0..n)
        .filter(|&i| slow[i] <= median * OUTLIER_FACTOR)
        .collect();
    if used.is_empty() {
        (0..n).collect()
    } else {
        used
    }
}

/// The virtual calibration in the live calibration's shape, so the live plan builder reads it.
fn calibrate(args: &SweepArgs, base: &sim::SimConfig, used: Vec<usize>) -> Result<Calibration> {
    let shape = WorkloadSpec {
        seed: args.seed,
        ..WorkloadSpec::default()
    };
    let c = sim::calibrate(base, &shape, CALIBRATION_REQUESTS)
        .map_err(|e| anyhow!("virtual calibration: {e}"))?;
    let floors = Slo {
        ttft_ms: c.ttft_p50_ms,
        itl_ms: c.itl_p50_ms,
    };
    let mut fleet = args.fleet.key(args.quick);
    fleet.source = "virtual".into();
    Ok(Calibration {
        fleet,
        replicas: Vec::new(),
        used_replicas: used,
        floors,
        slo_factor: SLO_FACTOR,
        slo: Slo {
            ttft_ms: floors.ttft_ms * SLO_FACTOR,
            itl_ms: floors.itl_ms * SLO_FACTOR,
        },
        capacity_tokens: c.capacity_tokens,
        // No virtual reference run: belief policies keep the policies crate's default TTL and
        // node cap (recorded per cell in meta.run).
        index: IndexCalibration {
            ttl_s: None,
            ttl_is_lower_bound: false,
            node_cap: None,
            honoured_share: None,
            detail: serde_json::json!({"source": "virtual: policy defaults"}),
        },
        gpus: Vec::new(),
        gpu_status: "virtual".into(),
        reference_run: None,
        git_rev: crate::env::git_rev(),
        versions: crate::env::versions(),
    })
}

/// One repetition to simulate.
struct Job {
    point: String,
    policy: String,
    rep: u32,
    plan: Arc<Plan>,
    book: Arc<sim::PromptBook>,
    dir: PathBuf,
    run: serde_json::Value,
}

/// Runs the sweep in virtual time; returns its directory.
pub fn sweep(args: &SweepArgs) -> Result<PathBuf> {
    if !matches!(args.fleet.fleet, FleetKind::Emulated) {
        bail!(
            "--virtual simulates the emulated fleet its flags describe; --fleet command/static cannot be simulated"
        );
    }
    if !matches!(args.ingress, crate::run::IngressArg::Router) {
        bail!("--virtual models kvroute's router only; HAProxy ingress is live-only");
    }
    if args.reps == 0 {
        bail!("--reps must be at least 1");
    }
    let started = Instant::now();
    let dir = sweep_dir(args);
    if args.fresh && dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let n = args.fleet.replica_count(args.quick);
    if n == 0 {
        bail!("the fleet has no replicas");
    }
    if !args.fleet.slowdowns.is_empty() && args.fleet.slowdowns.len() != n {
        bail!(
            "--slowdowns gives {} factors for {n} replicas",
            args.fleet.slowdowns.len()
        );
    }
    let used = used_replicas(args, n);
    let base = base_config(args, &used)?;
    let cal = calibrate(args, &base, used)?;
    cal.write(&dir.join("calibration.json"))?;
    let policies = grid::policies(&args.policies, args.quick)?;
    let points = sweep::sweep_points(args, cal.used_replicas.len())?;
    let (warmup_s, measure_s) = (args.warmup(), args.measure());
    let run_s = warmup_s + measure_s;
    cell::write_atomic(
        &dir.join("sweep.json"),
        serde_json::to_string_pretty(&serde_json::json!({
            "sweep": args.name.as_str(),
            "virtual": true,
            "quick": args.quick,
            "points": points,
            "policies": policies,
            "reps": args.reps,
            "warmup_s": warmup_s,
            "measure_s": measure_s,
            "think_model_s": args.think_s,
            "speed": args.fleet.speed,
            "jitter": JITTER,
            "calibration": cal,
        }))?
        .as_bytes(),
    )?;

    let mut jobs = Vec::new();
    let mut skipped = 0usize;
    for point in &points {
        let plan_file = sweep::plan_for(args, point, &cal, &dir)?;
        let bytes = std::fs::read(&plan_file.path)
            .with_context(|| format!("reading {}", plan_file.path.display()))?;
        let plan = Arc::new(Plan::from_bytes(&bytes).map_err(|e| anyhow!("{e}"))?);
        let book = Arc::new(
            sim::PromptBook::new(&plan, &base.model, base.router.block_bytes, true)
                .map_err(|e| anyhow!("prompts of {}: {e}", point.name))?,
        );
        for rep in 1..=args.reps {
            for policy in &policies {
                let rep_dir = dir
                    .join(&point.name)
                    .join(policy)
                    .join(format!("rep-{rep}"));
                if CellState::of(&rep_dir).is_done() {
                    skipped += 1;
                    continue;
                }
                jobs.push(Job {
                    point: point.name.clone(),
                    policy: policy.clone(),
                    rep,
                    plan: plan.clone(),
                    book: book.clone(),
                    dir: rep_dir,
                    run: serde_json::json!({
                        "plan": plan_file.name,
                        "think_model_s": args.think_s,
                        "arrival": point.arrival,
                    }),
                });
            }
        }
    }
    let total = jobs.len();
    eprintln!(
        "xtask sweep {} --virtual: {} points × {} policies × {} reps into {} ({total} to run, {skipped} already done; SLO TTFT < {:.1} ms, ITL p50 < {:.2} ms; capacity {} tokens)",
        args.name.as_str(),
        points.len(),
        policies.len(),
        args.reps,
        dir.display(),
        cal.slo.ttft_ms,
        cal.slo.itl_ms,
        cal.capacity_tokens
    );
    let ctx = Ctx {
        args,
        base: &base,
        slo: cal.slo,
        run_s,
        git_rev: crate::env::git_rev(),
        versions: crate::env::versions(),
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let next = AtomicUsize::new(0);
    let errors: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let set_aside = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads.min(total.max(1)) {
            s.spawn(|| {
                loop {
                    if interrupt::requested() {
                        return;
                    }
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(job) = jobs.get(i) else { return };
                    match run_job(&ctx, job) {
                        Ok(true) => {}
                        Ok(false) => {
                            set_aside.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => errors
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(format!(
                                "{} {} rep-{}: {e:#}",
                                job.point, job.policy, job.rep
                            )),
                    }
                }
            });
        }
    });
    if interrupt::requested() {
        bail!("interrupted; completed cells are kept, rerun the same command to resume");
    }
    let errors = errors.into_inner().unwrap_or_else(|p| p.into_inner());
    if !errors.is_empty() {
        bail!(
            "{} of {total} virtual cells failed:\n  {}",
            errors.len(),
            errors.join("\n  ")
        );
    }
    eprintln!(
        "xtask sweep {} --virtual: {total} cells in {:.1} s on {threads} threads ({} set aside by the drift check)",
        args.name.as_str(),
        started.elapsed().as_secs_f64(),
        set_aside.load(Ordering::Relaxed)
    );
    if !args.no_report {
        report::write(&dir)?;
    }
    Ok(dir)
}

/// What every job shares.
struct Ctx<'a> {
    args: &'a SweepArgs,
    base: &'a sim::SimConfig,
    slo: Slo,
    run_s: f64,
    git_rev: Option<String>,
    versions: serde_json::Value,
}

/// Simulates one repetition, checks drift on its rows, writes meta last. Returns whether the
/// repetition was accepted.
fn run_job(ctx: &Ctx<'_>, job: &Job) -> Result<bool> {
    let args = ctx.args;
    let mut cfg = ctx.base.clone();
    cfg.policy = policies::PolicySpec::named(&job.policy);
    // Per repetition seeds, as the live router gets `--seed seed + rep`.
    cfg.policy.seed = args.seed.wrapping_add(u64::from(job.rep));
    cfg.engine.seed = args
        .fleet
        .engine_seed
        .wrapping_mul(1_000_003)
        .wrapping_add(u64::from(job.rep));
    cfg.driver = sim::DriverModel {
        warmup_s: args.warmup(),
        duration_s: Some(ctx.run_s),
        timeout_s: args.request_timeout_s,
    };
    cell::clear(&job.dir)?;
    let meta = sim::CellMeta {
        sweep: args.name.as_str().to_string(),
        point: job.point.clone(),
        rep: job.rep,
        slo: sim::Slo {
            ttft_ms: ctx.slo.ttft_ms,
            itl_ms: ctx.slo.itl_ms,
        },
        planned_end_s: Some(ctx.run_s),
        git_rev: ctx.git_rev.clone(),
        versions: ctx.versions.clone(),
        run: job.run.clone(),
    };
    let (summary, mut meta_json) =
        sim::write_cell_rows(&cfg, &job.plan, &job.book, &job.dir, &meta)
            .map_err(|e| anyhow!("{e}"))?;
    let w = summary.window;
    let drift = analysis::check_rep_dir(
        &job.dir,
        &analysis::Slo {
            ttft_ms: ctx.slo.ttft_ms,
            itl_ms: ctx.slo.itl_ms,
        },
        &analysis::Window {
            warmup_s: w.warmup_s,
            measured_start_s: w.measured_start_s,
            measured_end_s: w.measured_end_s,
        },
        &analysis::DriftConfig::default(),
    )
    .map_err(|e| anyhow!("drift check of {}: {e}", job.dir.display()))?;
    let accepted = !drift.warming;
    meta_json["accepted"] = serde_json::Value::Bool(accepted);
    meta_json["set_aside_reason"] = if accepted {
        serde_json::Value::Null
    } else {
        let why = drift.reason.clone().unwrap_or_else(|| "warming".into());
        serde_json::Value::String(format!(
            "drifted (virtual, deterministic: not re-run): {why}"
        ))
    };
    meta_json["drift"] = serde_json::to_value(&drift)?;
    sim::write_meta(&job.dir, &meta_json).map_err(|e| anyhow!("{e}"))?;
    Ok(accepted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn outlier_replicas_are_left_out() {
        use clap::Parser;
        #[derive(Parser)]
        struct T {
            #[command(flatten)]
            s: SweepArgs,
        }
        let t = T::try_parse_from([
            "t",
            "pressure-grid",
            "--virtual",
            "--replicas",
            "4",
            "--slowdowns",
            "1,1,1,1.5",
        ])
        .unwrap();
        assert!(t.s.virtual_time);
        assert_eq!(used_replicas(&t.s, 4), vec![0, 1, 2]);
        assert_eq!(
            sweep_dir(&t.s),
            Path::new("measurements/pressure-grid-virtual")
        );
    }
}
