//! Each policy's own capacity on a trace (`cargo xtask sweep trace --virtual --policy-capacity`,
//! issue #35): the fastest the trace can be replayed while the policy alone meets the SLO on
//! ≥ 90% of its measured requests, in virtual time, over several slices of the trace.
//!
//! A trace's load is its own arrival times, so what is searched is a **rate multiplier** `m` of
//! the trace (the `trace` sweep's time scale is `1 ÷ m`: ×2 replays the trace twice as fast).
//! Each step replays the same slice of the trace under the sweep's mapping (its block size):
//! the trace seconds the sweep's window covers at ×1 (warm-up + measured window, wall s ×
//! speed), compressed in time by the multiplier, as one simulated cell starting from cold caches
//! as every trace cell does. So every step of a search measures the same requests, only closer
//! together, and attainment falls with the multiplier as load, not as a different stretch of the
//! trace (a first version sized the window in wall time, and its windows at different
//! multipliers held different stretches: brackets such as ×0.403 on one draw beside ×4.2 on the
//! others); [`crate::capacity::search`] brackets the multiplier to [`RESOLUTION`]. The workload draws a
//! grid point gets from plan seeds, a trace gets from where its slice starts: draw `k` of `n`
//! starts `k × span ÷ n` trace seconds after the sweep's `--trace-start-s` (span: the rest of the
//! trace), so the draws are disjoint stretches of the day the trace recorded. The report
//! (`analysis::capacity`, with the multiplier as its unit and each draw's start as its "seed")
//! judges the policies as the grid's per-policy report does.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};

use analysis::capacity::{CapacityReport, SeedCapacity};

use crate::capacity::{self, SearchConfig, StepMeasurement, StepRequest};
use crate::cell;
use crate::policy_capacity::{self, BASELINE, RESOLUTION};
use crate::sweep::SweepSettings;
use crate::trace_sweep::{self, TraceSettings};
use crate::virtual_sweep::{self, PointCapacity};

/// The unit of a trace's capacity: a rate multiplier of the trace's own arrivals.
pub const UNIT: &str = "× the trace's rate";

/// One search: a policy on one draw (slice) of the trace.
#[derive(Debug, Clone)]
struct Job {
    policy: String,
    /// Where the draw's slice starts, trace s (its "seed" in the report).
    start_s: f64,
    /// Trace s from `start_s` to the next draw's start (or the trace's end): no step's slice
    /// may run past it, so the draws stay disjoint.
    stretch_s: f64,
    /// What the record's `workload` must say to be reused.
    workload: String,
    work: PathBuf,
}

/// The draws' starts, trace s: `count` evenly spaced over `[from_s, end_s)`.
pub fn draw_starts(from_s: f64, end_s: f64, count: u32) -> Result<Vec<f64>> {
    if count == 0 {
        bail!("--seeds (the trace's draws) must be at least 1");
    }
    if end_s <= from_s {
        bail!("the trace ends at {end_s} s, before the slices' start {from_s} s");
    }
    let spacing = (end_s - from_s) / f64::from(count);
    Ok((0..count)
        .map(|k| (from_s + f64::from(k) * spacing).floor())
        .collect())
}

/// Searches every chosen policy's rate multiplier on `draws` slices of the sweep's trace, on all
/// cores, after the virtual sweep's preparation (its calibration, or the live one given); writes
/// `<dir>/policy-capacity.{md,json}` and returns the report.
pub fn run_virtual(
    s: &SweepSettings,
    dir: &Path,
    draws: u32,
    should_stop: &(dyn Fn() -> bool + Sync),
) -> Result<CapacityReport> {
    let t = trace_sweep::settings_of(s)?
        .ok_or_else(|| anyhow!("a trace's per-policy capacity needs `sweep trace --trace FILE`"))?
        .clone();
    // A replay's load is the trace's own: no capacity sizes it, so none is searched or needed.
    let s = &SweepSettings {
        load_fractions: None,
        ..s.clone()
    };
    let prepared = virtual_sweep::prepare(s, dir)?;
    let cal = &prepared.calibration;
    let speed = s.fleet.effective_speed();
    let (trace, _) = trace_sweep::read_trace(&t)?;
    let end_s = trace
        .records()
        .iter()
        .map(|r| r.timestamp_us)
        .max()
        .map_or(0.0, |us| us as f64 / 1e6);
    let starts = draw_starts(t.start_s, end_s, draws)?;
    let point = format!("b{}", t.block_tokens);
    let hash = trace.content_hash();
    let mut jobs: Vec<Job> = Vec::new();
    for p in &prepared.policies {
        for (k, &start_s) in starts.iter().enumerate() {
            jobs.push(Job {
                policy: p.clone(),
                start_s,
                stretch_s: starts.get(k + 1).copied().unwrap_or(end_s) - start_s,
                workload: format!("trace {hash:016x} b{} from{start_s}", t.block_tokens),
                work: dir
                    .join("policy-capacity")
                    .join(&point)
                    .join(p)
                    .join(format!("from-{start_s}")),
            });
        }
    }
    let total = jobs.len();
    eprintln!(
        "policy capacity (trace): {} policies × {} draws (slices from {}) = {total} searches of the rate multiplier to {:.0}% (SLO TTFT < {:.1} ms, ITL p50 < {:.2} ms)",
        prepared.policies.len(),
        starts.len(),
        starts
            .iter()
            .map(|s| format!("{s} s"))
            .collect::<Vec<_>>()
            .join(", "),
        RESOLUTION * 100.0,
        cal.slo.ttft_ms,
        cal.slo.itl_ms
    );
    let started = std::time::Instant::now();
    let found = policy_capacity::on_all_cores(&jobs, should_stop, |job| {
        search_one(s, &prepared.cells, cal, &t, &trace, speed, job)
    });
    if should_stop() {
        bail!("interrupted; finished searches are kept, rerun the same command to resume");
    }
    let mut failures = Vec::new();
    let mut by_policy: Vec<(String, Vec<SeedCapacity>)> = prepared
        .policies
        .iter()
        .map(|p| (p.clone(), Vec::new()))
        .collect();
    for (i, r) in found {
        let job = &jobs[i];
        match r {
            Ok(c) => {
                if let Some((_, v)) = by_policy.iter_mut().find(|(p, _)| *p == job.policy) {
                    v.push(c);
                }
            }
            Err(e) => failures.push(format!("{} from {} s: {e:#}", job.policy, job.start_s)),
        }
    }
    if !failures.is_empty() {
        bail!(
            "{} of {total} trace capacity searches failed:\n  {}",
            failures.len(),
            failures.join("\n  ")
        );
    }
    let sweep = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let basis = format!(
        "virtual time (the simulator; {} replicas, speed {speed}), the trace {} (hash {:016x}) mapped at {} tokens per hash id, each step a replay of the draw's first {} + {} s of trace (the sweep's window at ×1: warm-up + measured) from cold caches, at every multiplier the same requests compressed in time; capacities are rate multipliers of the trace's own arrivals (the trace sweep's time scale = 1 ÷ multiplier), and the \"seeds\" are the slices' starts in trace seconds (disjoint draws spaced evenly over the trace after {} s)",
        cal.used_replicas.len(),
        t.trace.display(),
        trace.content_hash(),
        t.block_tokens,
        s.warmup_s * speed,
        s.measure_s * speed,
        t.start_s
    );
    let basis = format!(
        "{basis}; {}",
        what_no_multiplier_changes(&trace, t.start_s, t.block_tokens, cal)
    );
    let seeds: Vec<u64> = starts.iter().map(|&s| s as u64).collect();
    let report = analysis::capacity::report(
        &sweep,
        &basis,
        BASELINE,
        RESOLUTION,
        &seeds,
        vec![(point, by_policy)],
    )
    .with_unit(UNIT);
    policy_capacity::write_report(dir, &report)?;
    eprintln!(
        "policy capacity (trace): {total} searches in {:.0} s; report in {}",
        started.elapsed().as_secs_f64(),
        dir.join("policy-capacity.md").display()
    );
    Ok(report)
}

/// One search of `job`'s policy on its draw, or its record from an earlier run of the same
/// draw under the same SLO; the steps' rows are deleted once it is recorded.
fn search_one(
    s: &SweepSettings,
    cells: &virtual_sweep::CellSettings,
    cal: &crate::calibration::Calibration,
    t: &TraceSettings,
    trace: &trace::Trace,
    speed: f64,
    job: &Job,
) -> Result<SeedCapacity> {
    let seed = job.start_s as u64;
    let record = job.work.join("capacity.json");
    let unbracketed = job.work.join("unbracketed.json");
    // Reused when it searched the same draw under the same SLO (a replay has no open start to
    // go stale).
    if let Some(c) = PointCapacity::read(&record)
        .filter(|c| c.capacity.workload == job.workload && c.slo == cal.slo)
    {
        return Ok(policy_capacity::seed_capacity(seed, &c.capacity));
    }
    if let Some(c) = std::fs::read_to_string(&unbracketed)
        .ok()
        .and_then(|text| serde_json::from_str::<(String, SeedCapacity)>(&text).ok())
        .filter(|(w, _)| *w == job.workload)
    {
        return Ok(c.1);
    }
    let defaults = capacity::CapacitySettings::defaults(s.quick);
    let cfg = SearchConfig {
        start_rps: 1.0,
        start_rule: "the trace's own arrival rate (×1)".into(),
        step_factor: defaults.step_factor,
        resolution: RESOLUTION,
        max_coarse_steps: defaults.max_coarse_steps,
        widen_after: None,
        max_lengthenings: defaults.max_lengthenings,
        policies: vec![job.policy.clone()],
        // A replay starts from the slice's first request with cold caches.
        open_start: workload::OpenStart::Fresh,
    };
    let steps_dir = job.work.join("capacity");
    cell::clear(&steps_dir)?;
    let mut steps_run = 0usize;
    let mut measure = |step: &StepRequest| -> Result<StepMeasurement> {
        // The same stretch of the trace at every multiplier: the sweep's windows at ×1 (trace
        // s = wall s × speed), compressed by the multiplier (wall = trace ÷ multiplier ÷
        // speed), so a step measures the same requests, only closer together. Its warm-up
        // doubles per re-run as every step's does.
        let warmup_s = capacity::step_warmup_s(s.warmup_s, step.lengthening) / step.rate_rps;
        let measure_s = s.measure_s / step.rate_rps;
        let run_s = warmup_s + measure_s;
        let mapping = TraceSettings {
            time_scale: 1.0 / step.rate_rps,
            start_s: job.start_s,
            duration_s: None,
            ..t.clone()
        };
        let spec = mapping.spec(speed, run_s, s.seed);
        let needed_s = spec.duration_s.unwrap_or(0.0);
        if needed_s > job.stretch_s {
            return Err(TooShort(format!(
                "the draw from {} s holds {:.0} s of trace before the next draw (or the trace's end), and a step at ×{} for {run_s:.1} s (wall) needs {needed_s:.0} s",
                job.start_s, job.stretch_s, step.rate_rps
            ))
            .into());
        }
        let plan = trace::ReplayPlan::build(trace, &spec)?;
        let mut cfg = virtual_sweep::cell_config(cells, &step.policy, 1, warmup_s, run_s);
        if let Some(n) = trace_sweep::max_model_len(&plan) {
            cfg.engine.max_model_len = cfg.engine.max_model_len.max(n);
        }
        let step_point = capacity::step_point_of(
            &format!("b{}-from{}", t.block_tokens, job.start_s),
            step.rate_rps,
            step.lengthening,
        );
        let dir = cell::rep_dir(&steps_dir, &step_point, &step.policy, 1);
        cell::clear(&dir)?;
        let meta = sim::CellMeta {
            sweep: "trace-capacity".into(),
            point: step_point,
            rep: 1,
            slo: cal.slo,
            planned_end_s: Some(run_s),
            git_rev: s.git_rev.clone(),
            versions: s.versions.clone(),
            run: serde_json::json!({"rate_multiplier": step.rate_rps, "time_scale": 1.0 / step.rate_rps, "trace_start_s": job.start_s, "lengthening": step.lengthening}),
        };
        let (_, meta_json) =
            sim::write_trace_cell_rows(&cfg, &plan, &dir, &meta).map_err(|e| anyhow!("{e}"))?;
        sim::write_meta(&dir, &meta_json).map_err(|e| anyhow!("{e}"))?;
        steps_run += 1;
        capacity::step_from_rep(&dir, speed, warmup_s, measure_s, None)
    };
    let result = capacity::search(&cfg, &mut measure);
    if steps_dir.exists() {
        std::fs::remove_dir_all(&steps_dir)
            .with_context(|| format!("removing {}", steps_dir.display()))?;
    }
    match result {
        Ok(mut c) => {
            c.workload = job.workload.clone();
            PointCapacity {
                slo: cal.slo,
                capacity: c.clone(),
                simulated: None,
            }
            .write(&record)?;
            Ok(policy_capacity::seed_capacity(seed, &c))
        }
        // Only a search still stepping up asks for more trace than the draw holds (a bisection
        // step lies below a failing rate that fitted): every rate it tried met the SLO.
        Err(e) if e.downcast_ref::<TooShort>().is_some() => {
            let why = e
                .downcast_ref::<TooShort>()
                .map(|t| t.0.clone())
                .unwrap_or_default();
            let c = SeedCapacity {
                seed,
                capacity_rps: None,
                failing_rps: None,
                steps: 0,
                unbracketed: Some(if steps_run == 0 {
                    format!(
                        "no step fits the draw: {why}; use fewer draws (--seeds) or a shorter window (--warmup-s, --measure-s)"
                    )
                } else {
                    format!(
                        "met the SLO at every multiplier tried until the trace ran out: {why}; fewer draws (--seeds) or a shorter window (--warmup-s, --measure-s) reach further"
                    )
                }),
            };
            cell::write_atomic(
                &unbracketed,
                serde_json::to_string_pretty(&(&job.workload, &c))?.as_bytes(),
            )?;
            Ok(c)
        }
        Err(e) if e.downcast_ref::<capacity::Unbracketed>().is_some() => {
            let c = SeedCapacity {
                seed,
                capacity_rps: None,
                failing_rps: None,
                steps: 0,
                // The search speaks of rates in req/s; here a rate is a multiplier.
                unbracketed: e
                    .downcast_ref::<capacity::Unbracketed>()
                    .map(|u| u.summary.replace(" req/s", " × the trace's rate")),
            };
            cell::write_atomic(
                &unbracketed,
                serde_json::to_string_pretty(&(&job.workload, &c))?.as_bytes(),
            )?;
            Ok(c)
        }
        Err(e) => Err(e),
    }
}

/// A step that would replay more of the trace than its draw holds.
#[derive(Debug)]
struct TooShort(String);

impl std::fmt::Display for TooShort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TooShort {}

/// What no multiplier changes, in the trace's terms (from `from_s` on): how its requests group
/// at shared arrival instants (a group's prefills queue together at any multiplier), and the
/// share whose prompt, at `block_tokens` per hash id, is longer than the fleet prefills within
/// the TTFT bound at its floor's pace (the floor prompt × the bound ÷ the TTFT floor: a linear
/// prefill model, no queue, no cache). Where a search meets the SLO at no multiplier, these are
/// where to look.
pub fn what_no_multiplier_changes(
    trace: &trace::Trace,
    from_s: f64,
    block_tokens: u32,
    cal: &crate::calibration::Calibration,
) -> String {
    let floor_prompt = cal
        .floor_prompts
        .as_ref()
        .map_or(crate::calibration::REFERENCE_PROMPT_TOKENS, |f| {
            f.prompt_tokens
        });
    let longest =
        (floor_prompt as f64 * cal.slo.ttft_ms / cal.floors.ttft_ms.max(1e-9)).floor() as u64;
    let from_us = (from_s * 1e6) as u64;
    let prompts: Vec<u64> = trace
        .records()
        .iter()
        .filter(|r| r.timestamp_us >= from_us)
        .map(|r| {
            (u64::from(r.input_tokens) * u64::from(block_tokens))
                .div_ceil(trace::TRACE_BLOCK_TOKENS)
        })
        .collect();
    let over = prompts.iter().filter(|&&p| p > longest).count();
    // Requests that share an arrival instant: a multiplier compresses the gaps between
    // instants, never a group.
    let mut at: std::collections::BTreeMap<u64, usize> = std::collections::BTreeMap::new();
    for r in trace.records().iter().filter(|r| r.timestamp_us >= from_us) {
        *at.entry(r.timestamp_us).or_default() += 1;
    }
    let mut per_request: Vec<usize> = at
        .values()
        .flat_map(|&n| std::iter::repeat_n(n, n))
        .collect();
    per_request.sort_unstable();
    let instants: Vec<u64> = at.keys().copied().collect();
    let mut gaps_ms: Vec<f64> = instants
        .windows(2)
        .map(|w| (w[1] - w[0]) as f64 / 1e3)
        .collect();
    gaps_ms.sort_by(f64::total_cmp);
    let nth = |v: &[usize], q: f64| {
        v.get(((v.len().max(1) - 1) as f64 * q) as usize)
            .copied()
            .unwrap_or(0)
    };
    format!(
        "its {} requests arrive at {} instants (median gap {:.0} ms of trace), a request sharing its instant with a median {} others (p90 {}, most {}): a multiplier compresses the gaps, not the groups; ",
        prompts.len(),
        instants.len(),
        gaps_ms.get(gaps_ms.len() / 2).copied().unwrap_or(0.0),
        nth(&per_request, 0.5).saturating_sub(1),
        nth(&per_request, 0.9).saturating_sub(1),
        per_request.last().copied().unwrap_or(0).saturating_sub(1),
    ) + &format!(
        "at this mapping {over} of them ({:.1}%) have prompts longer than {longest} tokens, the most the fleet prefills within the TTFT bound {:.1} ms at its floor's pace ({floor_prompt} tokens in {:.1} ms, linear, no queue, no cache)",
        100.0 * over as f64 / prompts.len().max(1) as f64,
        cal.slo.ttft_ms,
        cal.floors.ttft_ms
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_are_disjoint_slices_spaced_evenly_after_the_start() {
        assert_eq!(draw_starts(0.0, 3600.0, 3).unwrap(), [0.0, 1200.0, 2400.0]);
        assert_eq!(draw_starts(100.0, 3600.0, 1).unwrap(), [100.0]);
        assert!(draw_starts(0.0, 3600.0, 0).is_err());
        assert!(draw_starts(3600.0, 3600.0, 2).is_err());
    }

    /// A synthetic Mooncake-format trace: `sessions` conversations, one request each every
    /// `sessions` × 100 ms of trace time in turn (10 req/s in all), each turn's prompt its
    /// conversation's history (one more 512-token hash block per turn, at most 8).
    fn synthetic_trace(path: &Path, seconds: u32, sessions: u64) {
        let mut lines = String::new();
        for i in 0..u64::from(seconds) * 10 {
            let (session, turn) = (i % sessions, (i / sessions) % 8 + 1);
            let ids: Vec<String> = (0..turn).map(|b| (session * 100 + b).to_string()).collect();
            lines.push_str(&format!(
                "{{\"timestamp\": {}, \"input_length\": {}, \"output_length\": 16, \"hash_ids\": [{}]}}\n",
                i * 100,
                turn * 512,
                ids.join(", ")
            ));
        }
        std::fs::write(path, lines).unwrap();
    }

    fn settings(trace: &Path, policies: &[&str]) -> SweepSettings {
        SweepSettings {
            name: crate::grid::SweepName::Trace,
            policies: policies.iter().map(|p| p.to_string()).collect(),
            warmup_s: 1.0,
            measure_s: 3.0,
            trace: Some(TraceSettings::new(
                trace.to_path_buf(),
                true,
                Some(512),
                None,
            )),
            ..SweepSettings::test_quick()
        }
    }

    /// Each policy's multiplier is bracketed on each draw (or says why not), recorded per draw,
    /// reported in the trace's unit with the draws' starts as seeds, and reused on a rerun; a
    /// draw too short for a step is an error that says so.
    #[test]
    fn each_policy_gets_the_fastest_replay_that_meets_the_slo_on_each_slice() {
        let dir = crate::scratch::Scratch::new("trace-capacity");
        let trace = dir.0.join("trace.jsonl");
        synthetic_trace(&trace, 600, 40);
        let s = settings(&trace, &["session-affinity", "round-robin"]);
        let out = dir.0.join("sweep");
        std::fs::create_dir_all(&out).unwrap();
        let report = run_virtual(&s, &out, 2, &|| false).unwrap();
        assert_eq!(report.unit, UNIT);
        assert_eq!(report.seeds, [0, 299]);
        assert_eq!(report.points.len(), 1);
        let point = &report.points[0];
        assert_eq!(point.point, "b512");
        for pc in &point.policies {
            assert_eq!(pc.seeds.len(), 2, "{pc:?}");
            for seed in &pc.seeds {
                match (seed.capacity_rps, seed.failing_rps) {
                    (Some(c), Some(f)) => {
                        assert!(f > c && f <= c * (1.0 + RESOLUTION) + 1e-9, "{seed:?}")
                    }
                    _ => assert!(seed.unbracketed.is_some(), "{seed:?}"),
                }
            }
        }
        let md = std::fs::read_to_string(out.join("policy-capacity.md")).unwrap();
        assert!(
            md.contains("capacity × the trace's rate median [min–max]"),
            "{md}"
        );
        let record = out.join("policy-capacity/b512/round-robin/from-0/capacity.json");
        assert!(record.exists() || record.with_file_name("unbracketed.json").exists());
        // A rerun reuses every record: the same report, nothing searched again.
        let again = run_virtual(&s, &out, 2, &|| false).unwrap();
        assert_eq!(again.points, report.points);
        // Four draws of a trace that ends at 59.9 s hold 14 s each; the first step, at ×1 for
        // 4 s (wall) at speed 6, needs 24 s.
        let short = dir.0.join("short.jsonl");
        synthetic_trace(&short, 60, 40);
        let out = dir.0.join("short-sweep");
        std::fs::create_dir_all(&out).unwrap();
        let report = run_virtual(&settings(&short, &["round-robin"]), &out, 4, &|| false).unwrap();
        let seed = &report.points[0].policies[0].seeds[0];
        let why = seed.unbracketed.as_deref().unwrap_or_default();
        assert!(
            why.starts_with(
                "no step fits the draw: the draw from 0 s holds 14 s of trace before the next draw"
            ),
            "{seed:?}"
        );
    }
}
