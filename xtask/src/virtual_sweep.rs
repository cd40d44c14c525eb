//! `cargo xtask sweep <name> --virtual`: the same sweep in virtual time, through
//! `experiment::virtual_sweep` (the simulated fleet, the virtual calibration, one cell) and the
//! `sim` crate.
//!
//! The points, policies and plans are the live sweep's (`sweep::sweep_points`, `grid::policies`,
//! `sweep::plan_for`, so `plan.bin` is byte-identical to what a live sweep of the same flags
//! writes); the simulated fleet is the emulated fleet those flags describe. This module checks the
//! flags, skips finished cells, runs the rest on every core, and writes the report, as for a live
//! sweep.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};

use experiment::grid;
use experiment::virtual_sweep::{self, CellSettings, EmulatedFleet, JITTER, Job};
use workload::Plan;

use crate::cell::{self, CellState};
use crate::fleetargs::FleetKind;
use crate::interrupt;
use crate::report;
use crate::sweep::{self, SweepArgs};

/// The sweep directory: `--out/<sweep>[-quick]-virtual`, or `--sweep-dir-name`.
fn sweep_dir(args: &SweepArgs) -> PathBuf {
    let name = args.sweep_dir_name.clone().unwrap_or_else(|| {
        let quick = if args.quick { "-quick" } else { "" };
        format!("{}{quick}-virtual", args.name.as_str())
    });
    args.out.join(name)
}

/// The emulated fleet the flags describe.
fn emulated_fleet(args: &SweepArgs, replicas: usize) -> Result<EmulatedFleet> {
    let f = &args.fleet;
    let blocks = u32::try_from(f.blocks(args.quick))
        .map_err(|_| anyhow!("--num-gpu-blocks {} is too large", f.blocks(args.quick)))?;
    Ok(EmulatedFleet {
        replicas,
        num_gpu_blocks: blocks,
        speed: f.speed,
        slowdowns: f.slowdowns.clone(),
        model: f.model.clone(),
    })
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
    let fleet = emulated_fleet(args, n)?;
    let used = fleet.used_replicas();
    let base = fleet.base_config(&used)?;
    let cal = virtual_sweep::calibrate(
        &base,
        args.seed,
        used,
        args.fleet.key(args.quick),
        crate::env::git_rev(),
        crate::env::versions(),
    )?;
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
    let settings = CellSettings {
        base,
        sweep: args.name.as_str().to_string(),
        seed: args.seed,
        engine_seed: args.fleet.engine_seed,
        warmup_s,
        run_s,
        timeout_s: args.request_timeout_s,
        slo: cal.slo,
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
                    match virtual_sweep::run_cell(&settings, job) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn the_flags_describe_the_fleet_and_the_directory() {
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
        let fleet = emulated_fleet(&t.s, 4).unwrap();
        assert_eq!(fleet.slowdowns, [1.0, 1.0, 1.0, 1.5]);
        assert_eq!(fleet.num_gpu_blocks, 8192);
        assert_eq!(fleet.used_replicas(), vec![0, 1, 2]);
        assert_eq!(
            sweep_dir(&t.s),
            Path::new("measurements/pressure-grid-virtual")
        );
    }
}
