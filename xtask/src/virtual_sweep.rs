//! `cargo xtask sweep <name> --virtual`: the same sweep in virtual time. The settings are the
//! live sweep's (`SweepArgs::settings`); `experiment::virtual_sweep` checks them, prepares the
//! directory (the simulated fleet and its calibration, `sweep.json`, the live sweep's plans, one
//! job per unfinished repetition) and simulates each cell. This module runs the jobs on every
//! core and writes the report, as for a live sweep.

use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, bail};

use analysis::DriftClass;
use experiment::virtual_sweep;

use crate::sweep::SweepArgs;
use crate::{interrupt, report};

/// The sweep directory: `--out/<sweep>[-quick]-virtual`, or `--sweep-dir-name`.
fn sweep_dir(args: &SweepArgs) -> PathBuf {
    let name = args.sweep_dir_name.clone().unwrap_or_else(|| {
        let quick = if args.quick { "-quick" } else { "" };
        format!("{}{quick}-virtual", args.name.as_str())
    });
    args.out.join(name)
}

/// Runs the sweep in virtual time; returns its directory.
pub fn sweep(args: &SweepArgs) -> Result<PathBuf> {
    let settings = args.settings()?;
    virtual_sweep::check(&settings)?;
    let started = Instant::now();
    let dir = sweep_dir(args);
    if args.fresh && dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    if args.policy_capacity && experiment::trace_sweep::settings_of(&settings)?.is_some() {
        let report = experiment::trace_capacity::run_virtual(&settings, &dir, args.seeds, &|| {
            interrupt::requested()
        })?;
        println!("{}", analysis::capacity::markdown(&report));
        return Ok(dir);
    }
    if args.policy_capacity {
        let report = experiment::policy_capacity::run_virtual(
            &settings,
            &dir,
            args.seeds,
            &args.variants(),
            &|| interrupt::requested(),
        )?;
        println!("{}", analysis::capacity::markdown(&report));
        return Ok(dir);
    }
    let prepared = virtual_sweep::prepare(&settings, &dir)?;
    let (jobs, cal) = (&prepared.jobs, &prepared.calibration);
    let total = jobs.len();
    eprintln!(
        "xtask sweep {} --virtual: {} points × {} policies × {} reps into {} ({total} to run, {} already done; SLO TTFT < {:.1} ms, ITL p50 < {:.2} ms; capacity {} tokens)",
        args.name.as_str(),
        prepared.points.len(),
        prepared.policies.len(),
        args.reps,
        dir.display(),
        prepared.skipped,
        cal.slo.ttft_ms,
        cal.slo.itl_ms,
        cal.capacity_tokens
    );
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let next = AtomicUsize::new(0);
    let errors: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let set_aside = AtomicUsize::new(0);
    let overloaded = AtomicUsize::new(0);
    let worsening = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads.min(total.max(1)) {
            s.spawn(|| {
                loop {
                    if interrupt::requested() {
                        return;
                    }
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(job) = jobs.get(i) else { return };
                    match virtual_sweep::run_cell(&prepared.cells, job) {
                        Ok(DriftClass::Warming) => {
                            set_aside.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(DriftClass::Overloaded) => {
                            overloaded.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(DriftClass::Worsening) => {
                            worsening.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(_) => {}
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
        "xtask sweep {} --virtual: {total} cells in {:.1} s on {threads} threads ({} set aside by the drift check as warming; {} overloaded: a growing backlog, and {} worsening: a trend for the worse with no queue growing, both counted and marked)",
        args.name.as_str(),
        started.elapsed().as_secs_f64(),
        set_aside.load(Ordering::Relaxed),
        overloaded.load(Ordering::Relaxed),
        worsening.load(Ordering::Relaxed)
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

    use experiment::virtual_sweep::EmulatedFleet;

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
        let settings = t.s.settings().unwrap();
        virtual_sweep::check(&settings).unwrap();
        let fleet = EmulatedFleet::of(&settings.fleet).unwrap();
        assert_eq!(fleet.replicas, 4);
        assert_eq!(fleet.slowdowns, [1.0, 1.0, 1.0, 1.5]);
        assert_eq!(fleet.num_gpu_blocks, 8192);
        assert_eq!(fleet.used_replicas(), vec![0, 1, 2]);
        assert_eq!((settings.warmup_s, settings.measure_s), (20.0, 40.0));
        assert_eq!(
            sweep_dir(&t.s),
            Path::new("measurements/pressure-grid-virtual")
        );
    }
}
