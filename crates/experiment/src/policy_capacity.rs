//! Each policy's own capacity at the SLO, at every point, over several plan seeds, in virtual
//! time: what a user choosing a policy needs, where a fixed-rate comparison at one policy's
//! knee caps every margin near 1/0.9 − 1 and signs it by whichever policy set the rate.
//!
//! For each point, policy and plan seed, [`capacity::search`] runs with that policy alone
//! (`virtual_sweep::find_capacity_of` with one policy), each step a simulated open-loop cell of
//! the point's workload drawn with that seed, starting at the point's own capacity (the best of
//! session- and prefix-affinity, searched by `prepare`), to [`RESOLUTION`]. Each search is
//! recorded in `<dir>/policy-capacity/<point>/<policy>/seed-<k>/capacity.json` (reused on a
//! resume when it searched the same workload under the same SLO); its steps' rows are deleted
//! once it is recorded (a full grid would keep a gigabyte of them). `analysis::capacity` judges
//! the seeds, and the report goes to `<dir>/policy-capacity.{md,json}`.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{Context, Result, anyhow, bail};

use analysis::capacity::{CapacityReport, SeedCapacity};

use crate::cell;
use crate::sweep::SweepSettings;
use crate::virtual_sweep::{self, PointCapacity, SearchTarget};

/// Resolution of every per-policy search: each seed's failing rate is within 5% above its
/// capacity, the resolution the verdicts state.
pub const RESOLUTION: f64 = 0.05;

/// Each step's measured window is sized for at least this many requests, and so holds
/// [`crate::capacity::WINDOW_REQUEST_MARGIN`] (2) × as many: near the 90% target an attainment
/// measured over n requests has a binomial standard deviation of √(0.09/n), 2.1 points at 200
/// (4.7 at the 40 the drift check's minimum gives every other step), so a step's pass or fail
/// is not a coin flip of the window's draw.
pub const MIN_WINDOW_REQUESTS: usize = 100;

/// The baseline the margins are taken over.
pub const BASELINE: &str = "session-affinity";

/// One search to run.
#[derive(Debug, Clone)]
struct Job {
    point: String,
    policy: String,
    seed: u64,
    spec: workload::WorkloadSpec,
    start_rps: f64,
    work: PathBuf,
}

/// The plan seeds: `count` consecutive seeds from the sweep's own.
pub fn seeds(s: &SweepSettings, count: u32) -> Vec<u64> {
    (0..u64::from(count)).map(|k| s.seed + k).collect()
}

/// Prepares the virtual sweep in `dir` (calibration and each point's own capacity), then
/// searches every policy's capacity at every point for each of `seed_count` plan seeds on all
/// cores, stopping early when `should_stop` says so; writes and returns the report.
pub fn run_virtual(
    s: &SweepSettings,
    dir: &Path,
    seed_count: u32,
    should_stop: &(dyn Fn() -> bool + Sync),
) -> Result<CapacityReport> {
    if seed_count == 0 {
        bail!("--seeds must be at least 1");
    }
    let prepared = virtual_sweep::prepare(s, dir)?;
    let cal = &prepared.calibration;
    let base = virtual_sweep::EmulatedFleet::of(&s.fleet)?.base_config(&cal.used_replicas)?;
    let reference = cal.capacity.as_ref().ok_or_else(|| {
        anyhow!("a per-policy capacity search starts from a point's capacity, and the calibration has none (give --load)")
    })?;
    let seeds = seeds(s, seed_count);
    let mut jobs = Vec::new();
    let mut point_names: Vec<String> = Vec::new();
    for p in &prepared.points {
        // One search per workload: points that differ only in their load fraction share it.
        let name = p.name.split("-load").next().unwrap_or(&p.name).to_string();
        if point_names.contains(&name) {
            continue;
        }
        point_names.push(name.clone());
        let start_rps = PointCapacity::read(&dir.join(&p.name).join("capacity.json"))
            .map_or(reference.rate_rps, |c| c.capacity.rate_rps);
        for policy in &prepared.policies {
            for &seed in &seeds {
                let with_seed = SweepSettings { seed, ..s.clone() };
                jobs.push(Job {
                    point: name.clone(),
                    policy: policy.clone(),
                    seed,
                    spec: with_seed.spec_for(p, cal),
                    start_rps,
                    work: dir
                        .join("policy-capacity")
                        .join(&name)
                        .join(policy)
                        .join(format!("seed-{seed}")),
                });
            }
        }
    }
    let total = jobs.len();
    eprintln!(
        "policy capacity: {} points × {} policies × {} seeds = {total} searches to {:.0}% (SLO TTFT < {:.1} ms, ITL p50 < {:.2} ms)",
        point_names.len(),
        prepared.policies.len(),
        seeds.len(),
        RESOLUTION * 100.0,
        cal.slo.ttft_ms,
        cal.slo.itl_ms
    );
    let started = std::time::Instant::now();
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let found: Mutex<Vec<(usize, SeedCapacity)>> = Mutex::new(Vec::new());
    let failures: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::thread::scope(|scope| {
        for _ in 0..threads.min(total.max(1)) {
            scope.spawn(|| {
                loop {
                    if should_stop() {
                        return;
                    }
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(job) = jobs.get(i) else { return };
                    match search_one(s, &base, cal, job) {
                        Ok(c) => found.lock().unwrap_or_else(|p| p.into_inner()).push((i, c)),
                        Err(e) => failures
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(format!(
                                "{} {} seed {}: {e:#}",
                                job.point, job.policy, job.seed
                            )),
                    }
                    let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                    if n.is_multiple_of(10) || n == total {
                        eprintln!(
                            "policy capacity: {n}/{total} searches, {:.0} s",
                            started.elapsed().as_secs_f64()
                        );
                    }
                }
            });
        }
    });
    if should_stop() {
        bail!("interrupted; finished searches are kept, rerun the same command to resume");
    }
    let failures = failures.into_inner().unwrap_or_else(|p| p.into_inner());
    if !failures.is_empty() {
        bail!(
            "{} of {total} per-policy capacity searches failed:\n  {}",
            failures.len(),
            failures.join("\n  ")
        );
    }
    let mut found = found.into_inner().unwrap_or_else(|p| p.into_inner());
    found.sort_by_key(|(i, _)| *i);
    let mut points: Vec<analysis::capacity::PointSearches> = point_names
        .iter()
        .map(|p| {
            (
                p.clone(),
                prepared
                    .policies
                    .iter()
                    .map(|pol| (pol.clone(), Vec::new()))
                    .collect(),
            )
        })
        .collect();
    for (i, c) in found {
        let job = &jobs[i];
        if let Some((_, by_policy)) = points.iter_mut().find(|(p, _)| *p == job.point)
            && let Some((_, v)) = by_policy.iter_mut().find(|(p, _)| *p == job.policy)
        {
            v.push(c);
        }
    }
    let sweep = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let report = analysis::capacity::report(
        &sweep,
        &format!(
            "virtual time (the simulator: the emulator's engine core, no step-time jitter; one fleet, {} replicas), each step an open-loop cell with the sweep's windows, judged by the sweep's calibration",
            cal.used_replicas.len()
        ),
        BASELINE,
        RESOLUTION,
        &seeds,
        points,
    );
    cell::write_atomic(
        &dir.join("policy-capacity.json"),
        serde_json::to_string_pretty(&report)?.as_bytes(),
    )?;
    cell::write_atomic(
        &dir.join("policy-capacity.md"),
        analysis::capacity::markdown(&report).as_bytes(),
    )?;
    eprintln!(
        "policy capacity: {total} searches in {:.0} s; report in {}",
        started.elapsed().as_secs_f64(),
        dir.join("policy-capacity.md").display()
    );
    Ok(report)
}

/// One search, or its record from an earlier run of the same workload under the same SLO.
/// A search that finds no bracket (the policy fails at every rate tried, or meets the SLO at
/// every one) is a result, recorded with the search's own reason; only an error of the machinery
/// (a plan, a file) is an error.
fn search_one(
    s: &SweepSettings,
    base: &sim::SimConfig,
    cal: &crate::calibration::Calibration,
    job: &Job,
) -> Result<SeedCapacity> {
    let record = job.work.join("capacity.json");
    let unbracketed = job.work.join("unbracketed.json");
    let workload = job.spec.name();
    if let Some(c) = PointCapacity::reusable(&record, &workload, cal.slo) {
        return Ok(seed_capacity(job.seed, &c.capacity));
    }
    if let Some(c) = std::fs::read_to_string(&unbracketed)
        .ok()
        .and_then(|t| serde_json::from_str::<(String, SeedCapacity)>(&t).ok())
        .filter(|(w, _)| *w == workload)
    {
        return Ok(c.1);
    }
    let result = virtual_sweep::find_capacity_of(
        s,
        base,
        cal,
        &job.work,
        SearchTarget {
            spec: &job.spec,
            point: &job.point,
            start: (
                job.start_rps,
                format!(
                    "the point's own capacity ({} req/s, the best of the calibration's policies)",
                    job.start_rps
                ),
            ),
            resolution: Some(RESOLUTION),
            policies: Some(vec![job.policy.clone()]),
            min_window_requests: Some(MIN_WINDOW_REQUESTS),
        },
    );
    // The steps' rows are evidence only while the search runs; its record keeps every step.
    let steps = job.work.join("capacity");
    if steps.exists() {
        std::fs::remove_dir_all(&steps).with_context(|| format!("removing {}", steps.display()))?;
    }
    match result {
        Ok(c) => {
            PointCapacity {
                slo: cal.slo,
                capacity: c.clone(),
                simulated: None,
            }
            .write(&record)?;
            Ok(seed_capacity(job.seed, &c))
        }
        Err(e) if e.downcast_ref::<crate::capacity::Unbracketed>().is_some() => {
            let summary = e
                .downcast_ref::<crate::capacity::Unbracketed>()
                .map(|u| u.summary.clone());
            let c = SeedCapacity {
                seed: job.seed,
                capacity_rps: None,
                failing_rps: None,
                steps: 0,
                unbracketed: summary,
            };
            cell::write_atomic(
                &unbracketed,
                serde_json::to_string_pretty(&(workload, c.clone()))?.as_bytes(),
            )?;
            Ok(c)
        }
        Err(e) => Err(e),
    }
}

fn seed_capacity(seed: u64, c: &crate::capacity::Capacity) -> SeedCapacity {
    SeedCapacity {
        seed,
        capacity_rps: Some(c.rate_rps),
        failing_rps: Some(c.failing_rps),
        steps: c.curve.len(),
        unbracketed: None,
    }
}
