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
//!
//! [`Variants`] add routing variants of the chosen policies (issue #35, item 6): the
//! calibration's index TTL scaled, or other spill margins, one at a time around the defaults,
//! each searched as one more "policy" under its label (`prefix-affinity ttl×0.5`) in its own
//! directory (`policy-capacity/<point>/<slug>/seed-<k>/`). A variant is pure configuration: a
//! [`Tuning`] the search applies to the step's `PolicySpec` after the calibration's routing.

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

/// The routing variants to search beside each chosen policy's defaults: each value is one
/// variant, varied alone (the other constants at their defaults), for the policies it applies
/// to. A value equal to the default (TTL ×1, [`DEFAULT_SPILL_ABS`], [`DEFAULT_SPILL_RATIO`]) is
/// the default itself and adds nothing. Empty: each policy once, as it always runs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Variants {
    /// Factors on the calibration's index TTL (policies with a believed index).
    pub ttl_scales: Vec<f64>,
    /// Absolute spill margins, outstanding requests (policies that spill).
    pub spill_abs: Vec<u32>,
    /// Ratio spill margins (policies that spill).
    pub spill_ratios: Vec<f64>,
    /// Also search each belief-index policy with the index TTL derived at each point's own
    /// rate (`<policy> ttl@point`): the calibration's TTL rule applied to a run of the point's
    /// workload at the point's capacity ([`crate::virtual_sweep::point_index_ttl`]).
    pub ttl_at_point: bool,
}

/// The absolute spill margin every policy runs with (`PolicySpec::default().spill_abs`).
pub const DEFAULT_SPILL_ABS: u32 = 4;
/// The ratio spill margin every policy runs with (`PolicySpec::default().spill_ratio`).
pub const DEFAULT_SPILL_RATIO: f64 = 1.5;

/// What a variant changes in the policy's spec, after the calibration's routing has set it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Tuning {
    /// The index TTL is this × the calibration's.
    pub ttl_scale: Option<f64>,
    /// Spill needs `matched − least > spill_abs`.
    pub spill_abs: Option<u32>,
    /// … and `matched > spill_ratio × least`.
    pub spill_ratio: Option<f64>,
    /// The TTL is derived at the point's own rate (set per point and seed in `ttl_s`).
    pub ttl_at_point: bool,
    /// The index TTL, wall s, replacing the calibration's (what `ttl_at_point` derived).
    pub ttl_s: Option<f64>,
}

impl Tuning {
    /// Applies the variant to `spec`, whose TTL is already the calibration's.
    pub fn apply(&self, spec: &mut policies::PolicySpec) {
        if let Some(f) = self.ttl_scale {
            spec.index_ttl_us = (spec.index_ttl_us as f64 * f).round() as u64;
        }
        if let Some(t) = self.ttl_s {
            spec.index_ttl_us = (t * 1e6).round() as u64;
        }
        if let Some(a) = self.spill_abs {
            spec.spill_abs = a;
        }
        if let Some(r) = self.spill_ratio {
            spec.spill_ratio = r;
        }
    }
}

/// One policy as searched: the policy, what it changes, and its names.
#[derive(Debug, Clone, PartialEq)]
pub struct Variant {
    /// The policy (one of `policies::POLICY_NAMES`).
    pub policy: String,
    /// What it changes (default: nothing).
    pub tuning: Tuning,
    /// Its name in the report: the policy's, or e.g. `prefix-affinity ttl×0.5`.
    pub label: String,
    /// Its directory under `policy-capacity/<point>/`: the policy's, or e.g.
    /// `prefix-affinity-ttl0.5`.
    pub slug: String,
}

/// Whether a policy keeps the spill (load) branch: the spec's `spill` defaults on, and only
/// `prefix-affinity-spill-off` forces it off; the ring and simple policies have none.
fn spills(policy: &str) -> bool {
    matches!(
        policy,
        "prefix-affinity" | "exact-residency" | "exact-residency-spec"
    )
}

impl Variants {
    /// Refuses values no policy can run with.
    pub fn check(&self) -> Result<()> {
        if let Some(f) = self
            .ttl_scales
            .iter()
            .find(|f| !(f.is_finite() && **f > 0.0))
        {
            bail!("--ttl-scale takes positive factors, got {f}");
        }
        if let Some(r) = self
            .spill_ratios
            .iter()
            .find(|r| !(r.is_finite() && **r >= 0.0))
        {
            bail!("--spill-ratio takes ratios ≥ 0, got {r}");
        }
        Ok(())
    }

    /// Each policy's default, then its variants (TTL factors, absolute margins, ratio
    /// margins, each in the order given, those equal to the default and repeats left out).
    pub fn expand(&self, policies: &[String]) -> Vec<Variant> {
        let mut out: Vec<Variant> = Vec::new();
        for p in policies {
            let mut push = |tuning: Tuning, label: String, slug: String| {
                if !out.iter().any(|v| v.label == label) {
                    out.push(Variant {
                        policy: p.clone(),
                        tuning,
                        label,
                        slug,
                    });
                }
            };
            push(Tuning::default(), p.clone(), p.clone());
            if crate::grid::uses_belief_index(p) {
                for &f in self.ttl_scales.iter().filter(|&&f| f != 1.0) {
                    let tuning = Tuning {
                        ttl_scale: Some(f),
                        ..Tuning::default()
                    };
                    push(tuning, format!("{p} ttl×{f}"), format!("{p}-ttl{f}"));
                }
                if self.ttl_at_point {
                    let tuning = Tuning {
                        ttl_at_point: true,
                        ..Tuning::default()
                    };
                    push(
                        tuning,
                        format!("{p} ttl@point"),
                        format!("{p}-ttl-at-point"),
                    );
                }
            }
            if spills(p) {
                for &a in self.spill_abs.iter().filter(|&&a| a != DEFAULT_SPILL_ABS) {
                    let tuning = Tuning {
                        spill_abs: Some(a),
                        ..Tuning::default()
                    };
                    push(
                        tuning,
                        format!("{p} spill-abs {a}"),
                        format!("{p}-spill-abs{a}"),
                    );
                }
                for &r in self
                    .spill_ratios
                    .iter()
                    .filter(|&&r| r != DEFAULT_SPILL_RATIO)
                {
                    let tuning = Tuning {
                        spill_ratio: Some(r),
                        ..Tuning::default()
                    };
                    push(
                        tuning,
                        format!("{p} spill-ratio {r}"),
                        format!("{p}-spill-ratio{r}"),
                    );
                }
            }
        }
        out
    }

    /// The report's baseline: [`BASELINE`] without variants; with them, the first varied
    /// policy's defaults (each variant's ratio is then to the policy it varies).
    pub fn baseline(&self, variants: &[Variant]) -> String {
        variants
            .iter()
            .find(|v| v.tuning != Tuning::default())
            .map_or_else(|| BASELINE.to_string(), |v| v.policy.clone())
    }

    /// The variants in words for the report's basis: each label with the values it runs, a
    /// scaled TTL naming the calibration's TTL, its rule and the factor.
    fn describe(variants: &[Variant], routing: &crate::calibration::Routing) -> String {
        let tuned: Vec<String> = variants
            .iter()
            .filter(|v| v.tuning != Tuning::default())
            .map(|v| {
                let t = &v.tuning;
                let mut what = Vec::new();
                if let Some(f) = t.ttl_scale {
                    what.push(format!(
                        "index TTL {:.3} s = {f} × the calibration's {:.3} s (rule `{}`)",
                        routing.index_ttl_s * f,
                        routing.index_ttl_s,
                        routing.index_ttl_rule.as_str()
                    ));
                }
                if t.ttl_at_point {
                    what.push(format!(
                        "index TTL by the calibration's rule (`{}` there) applied at each point and seed to a prefix-affinity run of the point's workload at the point's own capacity whose index outlives the run (each in `policy-capacity/<point>/{}/seed-<k>/point-ttl.json`)",
                        routing.index_ttl_rule.as_str(),
                        v.slug
                    ));
                }
                if let Some(a) = t.spill_abs {
                    what.push(format!(
                        "spill needs matched − least > {a} outstanding (default {DEFAULT_SPILL_ABS})"
                    ));
                }
                if let Some(r) = t.spill_ratio {
                    what.push(format!(
                        "spill needs matched > {r} × least (default {DEFAULT_SPILL_RATIO})"
                    ));
                }
                format!("`{}`: {}", v.label, what.join(", "))
            })
            .collect();
        format!(
            "routing variants, each varied alone with every other constant at its default (index TTL {:.3} s by rule `{}`, spill margins {DEFAULT_SPILL_ABS} and {DEFAULT_SPILL_RATIO}×): {}",
            routing.index_ttl_s,
            routing.index_ttl_rule.as_str(),
            tuned.join("; ")
        )
    }
}

/// One search to run.
#[derive(Debug, Clone)]
struct Job {
    point: String,
    /// The policy and what its variant changes; reported under its label.
    variant: Variant,
    seed: u64,
    spec: workload::WorkloadSpec,
    start_rps: f64,
    /// Why the search starts there.
    start_rule: String,
    work: PathBuf,
}

/// The plan seeds: `count` consecutive seeds from the sweep's own.
pub fn seeds(s: &SweepSettings, count: u32) -> Vec<u64> {
    (0..u64::from(count)).map(|k| s.seed + k).collect()
}

/// Prepares the virtual sweep in `dir` (calibration and each point's own capacity), then
/// searches every policy's capacity at every point for each of `seed_count` plan seeds on all
/// cores, stopping early when `should_stop` says so; writes and returns the report.
///
/// With `variants`, each chosen policy is searched at its defaults and at each variant it
/// takes ([`Variants::expand`]), and the margins are taken over [`Variants::baseline`].
pub fn run_virtual(
    s: &SweepSettings,
    dir: &Path,
    seed_count: u32,
    variants: &Variants,
    should_stop: &(dyn Fn() -> bool + Sync),
) -> Result<CapacityReport> {
    if seed_count == 0 {
        bail!("--seeds must be at least 1");
    }
    variants.check()?;
    let prepared = virtual_sweep::prepare(s, dir)?;
    let cal = &prepared.calibration;
    let base = virtual_sweep::EmulatedFleet::of(&s.fleet)?.base_config(&cal.used_replicas)?;
    let reference = cal.capacity.as_ref().ok_or_else(|| {
        anyhow!("a per-policy capacity search starts from a point's capacity, and the calibration has none (give --load)")
    })?;
    let seeds = seeds(s, seed_count);
    let searched = variants.expand(&prepared.policies);
    let baseline = variants.baseline(&searched);
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
        for variant in &searched {
            for &seed in &seeds {
                let with_seed = SweepSettings { seed, ..s.clone() };
                jobs.push(Job {
                    point: name.clone(),
                    variant: variant.clone(),
                    seed,
                    spec: with_seed.spec_for(p, cal),
                    start_rps,
                    start_rule: format!(
                        "the point's own capacity ({start_rps} req/s, the best of the calibration's policies)"
                    ),
                    work: dir
                        .join("policy-capacity")
                        .join(&name)
                        .join(&variant.slug)
                        .join(format!("seed-{seed}")),
                });
            }
        }
    }
    let total = jobs.len();
    eprintln!(
        "policy capacity: {} points × {} policies and variants × {} seeds = {total} searches to {:.0}% (SLO TTFT < {:.1} ms, ITL p50 < {:.2} ms)",
        point_names.len(),
        searched.len(),
        seeds.len(),
        RESOLUTION * 100.0,
        cal.slo.ttft_ms,
        cal.slo.itl_ms
    );
    let started = std::time::Instant::now();
    let done = AtomicUsize::new(0);
    let results = on_all_cores(&jobs, should_stop, |job| {
        let r = search_one(s, &base, cal, job);
        let n = done.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_multiple_of(10) || n == total {
            eprintln!(
                "policy capacity: {n}/{total} searches, {:.0} s",
                started.elapsed().as_secs_f64()
            );
        }
        r
    });
    if should_stop() {
        bail!("interrupted; finished searches are kept, rerun the same command to resume");
    }
    let mut found = Vec::new();
    let mut failures = Vec::new();
    for (i, r) in results {
        let job = &jobs[i];
        match r {
            Ok(c) => found.push((i, c)),
            Err(e) => failures.push(format!(
                "{} {} seed {}: {e:#}",
                job.point, job.variant.label, job.seed
            )),
        }
    }
    if !failures.is_empty() {
        bail!(
            "{} of {total} per-policy capacity searches failed:\n  {}",
            failures.len(),
            failures.join("\n  ")
        );
    }
    let mut points: Vec<analysis::capacity::PointSearches> = point_names
        .iter()
        .map(|p| {
            (
                p.clone(),
                searched
                    .iter()
                    .map(|v| (v.label.clone(), Vec::new()))
                    .collect(),
            )
        })
        .collect();
    for (i, c) in found {
        let job = &jobs[i];
        if let Some((_, by_policy)) = points.iter_mut().find(|(p, _)| *p == job.point)
            && let Some((_, v)) = by_policy.iter_mut().find(|(p, _)| *p == job.variant.label)
        {
            v.push(c);
        }
    }
    let sweep = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut basis = format!(
        "virtual time (the simulator: the emulator's engine core, no step-time jitter; one fleet, {} replicas), each step an open-loop cell with the sweep's windows, judged by the sweep's calibration",
        cal.used_replicas.len()
    );
    if searched.iter().any(|v| v.tuning != Tuning::default()) {
        basis.push_str("; ");
        basis.push_str(&Variants::describe(&searched, &cal.routing()?));
    }
    let ttls = point_ttls_text(&jobs);
    if !ttls.is_empty() {
        basis.push_str("; the TTLs derived at each point's rate: ");
        basis.push_str(&ttls);
    }
    let report = analysis::capacity::report(&sweep, &basis, &baseline, RESOLUTION, &seeds, points);
    write_report(dir, &report)?;
    eprintln!(
        "policy capacity: {total} searches in {:.0} s; report in {}",
        started.elapsed().as_secs_f64(),
        dir.join("policy-capacity.md").display()
    );
    Ok(report)
}

/// The coarse step of a live search that starts at the simulator's prediction: twice the
/// resolution. From a start near the answer the search brackets in one or two coarse steps and
/// then bisects once or twice; a start far off costs more coarse steps, never a wrong bracket.
/// A live step costs a minute or more, a simulated one a second.
pub const LIVE_STEP_FACTOR: f64 = 1.0 + 2.0 * RESOLUTION;

/// Coarse steps of [`LIVE_STEP_FACTOR`] before a live search widens them
/// (`capacity::SearchConfig::widen_after`): six steps of ×1.1 reach only 1.77× from the start,
/// and a seed-8 search at ws8-s0 (session-affinity, 5 Dec 2026) stepped down from its prediction
/// to 4.84 req/s without meeting the SLO, where seed 7's capacity was 1.349. Widening after
/// three reaches 5.05× in the same six steps, and the bisection that follows narrows the
/// wider bracket to the resolution.
pub const LIVE_WIDEN_AFTER: u32 = 3;

/// What [`run_live`] found: the live report, the simulator's report of the same searches, and
/// each live search beside its prediction.
#[derive(Debug, Clone)]
pub struct LiveOutcome {
    /// Each policy's live capacity (`<dir>/policy-capacity.{md,json}`).
    pub live: CapacityReport,
    /// The simulator's predictions (`<dir>/predicted-capacity.{md,json}`).
    pub predicted: CapacityReport,
    /// Each live search against its prediction (`<dir>/predicted-vs-live.json`, and a section of
    /// `policy-capacity.md`).
    pub checks: Vec<analysis::capacity::PredictionCheck>,
}

/// Each chosen policy's own capacity at each chosen point, **live** on the sweep's fleet, over
/// `seed_count` plan seeds (issue #35): for each search, first the simulator's prediction (the
/// same search in virtual time under the same calibration, recorded as
/// `policy-capacity/<point>/<policy>/seed-<k>/predicted/capacity.json`), then the live search
/// starting there with [`LIVE_STEP_FACTOR`] steps to [`RESOLUTION`], on a fleet started afresh
/// for every step, recorded as `…/seed-<k>/capacity.json` with its steps' rows kept in
/// `…/seed-<k>/capacity/`. Searches run one at a time (a live step is the whole machine's
/// work), seed by seed, point by point, so an interrupted run holds whole comparisons; the
/// report is rewritten after each search, and a rerun resumes from the records.
///
/// The calibration is the sweep's (`<dir>/calibration.json`, else `--calibration` when it is for
/// this fleet, else a fresh one without the capacity search): its SLO, routing values and floors
/// judge every step. Its reference capacity, when it has one, is only the predictions' first
/// rate, never a value.
pub fn run_live(
    s: &SweepSettings,
    bins: &crate::bins::Bins,
    dir: &Path,
    seed_count: u32,
    should_stop: &(dyn Fn() -> bool + Sync),
) -> Result<LiveOutcome> {
    if seed_count == 0 {
        bail!("--seeds must be at least 1");
    }
    virtual_sweep::check(s).context("the live per-policy searches start from the simulator's predictions, so the fleet must be one it models")?;
    // Closed-loop point names (`ws1-s0`): a search needs the workload, not a rate.
    let closed = SweepSettings {
        load_fractions: None,
        points: s
            .points
            .iter()
            .map(|p| p.split("-load").next().unwrap_or(p).to_string())
            .collect(),
        ..s.clone()
    };
    let chosen = crate::grid::policies(&s.policies, s.quick)?;
    s.fleet.check_policies(&chosen)?;
    let cal = closed.calibration_for(bins, dir, should_stop)?;
    cal.routing()?;
    cal.write(&dir.join("calibration.json"))?;
    let points = closed.sweep_points(&cal)?;
    let base = virtual_sweep::EmulatedFleet::of(&s.fleet)?.base_config(&cal.used_replicas)?;
    let seeds = seeds(s, seed_count);
    let speed = s.fleet.effective_speed();
    let searched = Variants::default().expand(&chosen);
    let mut jobs = Vec::new();
    for &seed in &seeds {
        for p in &points {
            let with_seed = SweepSettings {
                seed,
                ..closed.clone()
            };
            let spec = with_seed.spec_for(p, &cal);
            let (start_rps, start_rule) = match &cal.capacity {
                Some(c) => (
                    c.rate_rps,
                    format!(
                        "the calibration's reference capacity ({} req/s; a start only)",
                        c.rate_rps
                    ),
                ),
                None => crate::capacity::start_estimate(&cal, speed, spec.output_tokens)?,
            };
            for variant in &searched {
                jobs.push(Job {
                    point: p.name.clone(),
                    variant: variant.clone(),
                    seed,
                    spec,
                    start_rps,
                    start_rule: start_rule.clone(),
                    work: dir
                        .join("policy-capacity")
                        .join(&p.name)
                        .join(&variant.slug)
                        .join(format!("seed-{seed}")),
                });
            }
        }
    }
    let total = jobs.len();
    eprintln!(
        "policy capacity (live): {} points × {} policies × {} seeds = {total} searches to {:.0}%, each from the simulator's prediction (SLO TTFT < {:.1} ms, ITL p50 < {:.2} ms)",
        points.len(),
        searched.len(),
        seeds.len(),
        RESOLUTION * 100.0,
        cal.slo.ttft_ms,
        cal.slo.itl_ms
    );
    // The predictions first, on all cores: seconds each, and every live search needs its own.
    let started = std::time::Instant::now();
    let predicted_jobs: Vec<Job> = jobs
        .iter()
        .map(|j| Job {
            work: j.work.join("predicted"),
            ..j.clone()
        })
        .collect();
    let predictions: Vec<Result<SeedCapacity>> =
        on_all_cores(&predicted_jobs, should_stop, |job| {
            search_one(s, &base, &cal, job)
        })
        .into_iter()
        .map(|(_, r)| r)
        .collect();
    if should_stop() {
        bail!("interrupted; finished searches are kept, rerun the same command to resume");
    }
    let predictions: Vec<SeedCapacity> = predictions
        .into_iter()
        .zip(&jobs)
        .map(|(r, j)| {
            r.with_context(|| {
                format!(
                    "the simulator's prediction for {} {} seed {}",
                    j.point, j.variant.label, j.seed
                )
            })
        })
        .collect::<Result<_>>()?;
    eprintln!(
        "policy capacity (live): {total} predictions in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    let sweep = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let point_names: Vec<String> = points.iter().map(|p| p.name.clone()).collect();
    let mut live: Vec<Option<SeedCapacity>> = vec![None; total];
    let write = |live: &[Option<SeedCapacity>]| -> Result<LiveOutcome> {
        let searches =
            |of: &dyn Fn(usize) -> Option<SeedCapacity>| -> Vec<analysis::capacity::PointSearches> {
                point_names
                    .iter()
                    .map(|p| {
                        let by_policy = searched
                            .iter()
                            .map(|v| {
                                let found = jobs
                                    .iter()
                                    .enumerate()
                                    .filter(|(_, j)| j.point == *p && j.variant.label == v.label)
                                    .filter_map(|(i, _)| of(i))
                                    .collect();
                                (v.label.clone(), found)
                            })
                            .collect();
                        (p.clone(), by_policy)
                    })
                    .collect()
            };
        let ran = live.iter().filter(|l| l.is_some()).count();
        let live_basis = format!(
            "live: the {} fleet ({} replicas, speed {speed}) through the router, each step an open-loop cell primed and warmed up as the virtual searches' steps, on a fleet started afresh, with the evidence gate (engine lateness within {} × the ITL floor); each search started at the simulator's prediction of it and stepped ×{LIVE_STEP_FACTOR:.2}; {ran} of {total} searches run",
            s.fleet.key().source,
            cal.used_replicas.len(),
            s.lateness_share_of_itl_floor,
        );
        let live_report = analysis::capacity::report(
            &sweep,
            &live_basis,
            BASELINE,
            RESOLUTION,
            &seeds,
            searches(&|i| live[i].clone()),
        );
        let predicted_report = analysis::capacity::report(
            &sweep,
            &format!(
                "virtual time (the simulator, the same fleet's engine core, no step-time jitter), judged by the live calibration, each search from {}; the predictions the live searches started at",
                match &cal.capacity {
                    Some(c) => format!(
                        "the calibration's reference capacity {} req/s (a start only)",
                        c.rate_rps
                    ),
                    None => "the reference run's throughput".to_string(),
                }
            ),
            BASELINE,
            RESOLUTION,
            &seeds,
            searches(&|i| Some(predictions[i].clone())),
        );
        let checks: Vec<_> = jobs
            .iter()
            .enumerate()
            .filter_map(|(i, j)| {
                live[i].clone().map(|l| {
                    analysis::capacity::prediction_check(
                        &j.point,
                        &j.variant.label,
                        predictions[i].clone(),
                        l,
                    )
                })
            })
            .collect();
        let mut md = analysis::capacity::markdown(&live_report);
        md.push('\n');
        md.push_str(&analysis::capacity::prediction_markdown(&checks));
        cell::write_atomic(
            &dir.join("policy-capacity.json"),
            serde_json::to_string_pretty(&live_report)?.as_bytes(),
        )?;
        cell::write_atomic(&dir.join("policy-capacity.md"), md.as_bytes())?;
        cell::write_atomic(
            &dir.join("predicted-capacity.json"),
            serde_json::to_string_pretty(&predicted_report)?.as_bytes(),
        )?;
        cell::write_atomic(
            &dir.join("predicted-capacity.md"),
            analysis::capacity::markdown(&predicted_report).as_bytes(),
        )?;
        cell::write_atomic(
            &dir.join("predicted-vs-live.json"),
            serde_json::to_string_pretty(&checks)?.as_bytes(),
        )?;
        Ok(LiveOutcome {
            live: live_report,
            predicted: predicted_report,
            checks,
        })
    };
    let mut outcome = write(&live)?;
    for (i, job) in jobs.iter().enumerate() {
        if should_stop() {
            bail!("interrupted; finished searches are kept, rerun the same command to resume");
        }
        let predicted = &predictions[i];
        let (start_rps, start_rule) = match predicted.capacity_rps {
            Some(r) => (
                r,
                format!(
                    "the simulator's prediction of this search ({r} req/s met, {} did not)",
                    rate_text(predicted.failing_rps)
                ),
            ),
            None => (
                job.start_rps,
                format!(
                    "the simulator found no bracket ({}); from the predictions' own start",
                    predicted
                        .unbracketed
                        .as_deref()
                        .unwrap_or("no reason recorded")
                ),
            ),
        };
        let defaults = crate::capacity::CapacitySettings::defaults(s.quick);
        let search = crate::capacity::SearchConfig {
            start_rps,
            start_rule,
            step_factor: LIVE_STEP_FACTOR,
            resolution: RESOLUTION,
            max_coarse_steps: defaults.max_coarse_steps,
            widen_after: Some(LIVE_WIDEN_AFTER),
            max_lengthenings: defaults.max_lengthenings,
            policies: vec![job.variant.policy.clone()],
            open_start: cal.open_start(),
        };
        let t0 = std::time::Instant::now();
        let found = record_search(
            job,
            &cal,
            |work| {
                crate::capacity::search_live(
                    &crate::capacity::LiveSearch {
                        fleet: &s.fleet,
                        bins,
                        cal: &cal,
                        spec: &job.spec,
                        search: search.clone(),
                        warmup_s: s.warmup_s,
                        measure_s: s.measure_s,
                        min_window_requests: MIN_WINDOW_REQUESTS,
                        lateness_share_of_itl_floor: s.lateness_share_of_itl_floor,
                        seed: s.seed,
                        point: &job.point,
                        sweep: &sweep,
                        git_rev: s.git_rev.clone(),
                        versions: s.versions.clone(),
                        work,
                    },
                    should_stop,
                )
            },
            false,
        )?;
        live[i] = Some(found);
        outcome = write(&live)?;
        eprintln!(
            "policy capacity (live): {}/{total} {} {} seed {}: {} (predicted {}) in {:.0} s",
            i + 1,
            job.point,
            job.variant.label,
            job.seed,
            live[i]
                .as_ref()
                .map_or_else(String::new, |c| match &c.unbracketed {
                    Some(why) => why.clone(),
                    None => format!(
                        "{} / {} req/s",
                        rate_text(c.capacity_rps),
                        rate_text(c.failing_rps)
                    ),
                }),
            rate_text(predicted.capacity_rps),
            t0.elapsed().as_secs_f64()
        );
    }
    eprintln!(
        "policy capacity (live): {total} searches in {:.0} s; report in {}",
        started.elapsed().as_secs_f64(),
        dir.join("policy-capacity.md").display()
    );
    Ok(outcome)
}

fn rate_text(r: Option<f64>) -> String {
    r.map_or_else(|| "—".to_string(), |r| format!("{r:.3}"))
}

/// Runs `search` for `job` unless its record (`capacity.json`, or `unbracketed.json` for a
/// search that found no bracket) is reusable, and records what it found. A search that finds no
/// bracket (the policy fails at every rate tried, or meets the SLO at every one) is a result,
/// recorded with the search's own reason; only an error of the machinery is an error. With
/// `delete_steps`, the steps' rows are deleted once the search is recorded.
fn record_search(
    job: &Job,
    cal: &crate::calibration::Calibration,
    search: impl FnOnce(&Path) -> Result<crate::capacity::Capacity>,
    delete_steps: bool,
) -> Result<SeedCapacity> {
    let record = job.work.join("capacity.json");
    let unbracketed = job.work.join("unbracketed.json");
    let workload = job.spec.name();
    if let Some(c) = PointCapacity::reusable(&record, &workload, cal) {
        return Ok(seed_capacity(job.seed, &c.capacity));
    }
    if let Some(c) = std::fs::read_to_string(&unbracketed)
        .ok()
        .and_then(|t| serde_json::from_str::<(String, SeedCapacity)>(&t).ok())
        .filter(|(w, _)| *w == workload)
    {
        return Ok(c.1);
    }
    let result = search(&job.work);
    if delete_steps {
        // The steps' rows are evidence only while the search runs; its record keeps every step.
        let steps = job.work.join("capacity");
        if steps.exists() {
            std::fs::remove_dir_all(&steps)
                .with_context(|| format!("removing {}", steps.display()))?;
        }
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

/// One simulated search, or its record from an earlier run of the same workload under the same
/// SLO ([`record_search`]; its steps' rows deleted once recorded).
fn search_one(
    s: &SweepSettings,
    base: &sim::SimConfig,
    cal: &crate::calibration::Calibration,
    job: &Job,
) -> Result<SeedCapacity> {
    let mut job = job.clone();
    if job.variant.tuning.ttl_at_point {
        let derived = point_ttl(s, base, cal, &job)?;
        job.variant.tuning.ttl_s = Some(derived.ttl_s);
    }
    let job = &job;
    record_search(
        job,
        cal,
        |work| {
            virtual_sweep::find_capacity_of(
                s,
                base,
                cal,
                work,
                SearchTarget {
                    spec: &job.spec,
                    point: &job.point,
                    start: (job.start_rps, job.start_rule.clone()),
                    resolution: Some(RESOLUTION),
                    policies: Some(vec![job.variant.policy.clone()]),
                    min_window_requests: Some(MIN_WINDOW_REQUESTS),
                    tuning: Some(job.variant.tuning),
                },
            )
        },
        true,
    )
}

/// The index TTL derived at a point's own rate for one plan seed (`point-ttl.json`): what a
/// `ttl@point` variant searches with, and the rule and evidence behind it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PointTtl {
    /// The point's workload (`WorkloadSpec::name`); a record of another workload is re-derived.
    pub workload: String,
    /// The rate the deriving run offered, model req/s: the point's own capacity.
    pub rate_rps: f64,
    /// The TTL, wall s.
    pub ttl_s: f64,
    /// The rule that set it (`observed-decay` or `lru-cycle-model`).
    pub rule: String,
    /// The calibration's TTL, wall s, for comparison.
    pub calibration_ttl_s: f64,
    /// The rule's inputs (`calibration::TtlEvidence`) and the honoured share of the run.
    pub evidence: serde_json::Value,
}

/// The TTL at `job`'s point and seed: its `point-ttl.json` when it holds the same workload,
/// else derived by [`virtual_sweep::point_index_ttl`] at the job's start rate (the point's own
/// capacity) and recorded (the run's rows are deleted once the TTL is derived).
fn point_ttl(
    s: &SweepSettings,
    base: &sim::SimConfig,
    cal: &crate::calibration::Calibration,
    job: &Job,
) -> Result<PointTtl> {
    let record = job.work.join("point-ttl.json");
    let workload = job.spec.name();
    if let Some(t) = std::fs::read_to_string(&record)
        .ok()
        .and_then(|t| serde_json::from_str::<PointTtl>(&t).ok())
        .filter(|t| t.workload == workload && t.rate_rps == job.start_rps)
    {
        return Ok(t);
    }
    let with_seed = SweepSettings {
        seed: job.seed,
        ..s.clone()
    };
    let rows = job.work.join("point-ttl");
    let index = virtual_sweep::point_index_ttl(
        &with_seed,
        base,
        cal,
        &job.spec,
        &job.point,
        job.start_rps,
        &rows,
    );
    if rows.exists() {
        std::fs::remove_dir_all(&rows).with_context(|| format!("removing {}", rows.display()))?;
    }
    let index = index.with_context(|| format!("the TTL at {} (seed {})", job.point, job.seed))?;
    let t = PointTtl {
        workload,
        rate_rps: job.start_rps,
        ttl_s: index
            .ttl_s
            .ok_or_else(|| anyhow!("the TTL rule set no TTL at {}", job.point))?,
        rule: index
            .ttl_rule
            .map_or_else(|| "none".to_string(), |r| r.as_str().to_string()),
        calibration_ttl_s: cal.routing()?.index_ttl_s,
        evidence: serde_json::json!({
            "ttl_evidence": index.ttl_evidence,
            "honoured_share": index.honoured_share,
        }),
    };
    std::fs::create_dir_all(&job.work)?;
    cell::write_atomic(&record, serde_json::to_string_pretty(&t)?.as_bytes())?;
    Ok(t)
}

/// The TTLs the `ttl@point` searches ran with, per point: `seed s: t s (rule)`, for the basis.
fn point_ttls_text(jobs: &[Job]) -> String {
    let mut by_point: Vec<(String, Vec<String>)> = Vec::new();
    for job in jobs.iter().filter(|j| j.variant.tuning.ttl_at_point) {
        let Some(t) = std::fs::read_to_string(job.work.join("point-ttl.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<PointTtl>(&t).ok())
        else {
            continue;
        };
        let line = format!("seed {} {:.3} s ({})", job.seed, t.ttl_s, t.rule);
        match by_point.iter_mut().find(|(p, _)| *p == job.point) {
            Some((_, v)) => {
                if !v.contains(&line) {
                    v.push(line)
                }
            }
            None => by_point.push((job.point.clone(), vec![line])),
        }
    }
    by_point
        .iter()
        .map(|(p, v)| format!("{p}: {}", v.join(", ")))
        .collect::<Vec<_>>()
        .join("; ")
}

/// One seed's bracketed search as the report counts it.
pub(crate) fn seed_capacity(seed: u64, c: &crate::capacity::Capacity) -> SeedCapacity {
    SeedCapacity {
        seed,
        capacity_rps: Some(c.rate_rps),
        failing_rps: Some(c.failing_rps),
        steps: c.curve.len(),
        unbracketed: None,
    }
}

/// Runs `f` on each of `jobs` on every core, taking the next job as a core frees, until all
/// are done or `should_stop` says so; returns `(index, result)` of the jobs run, in the jobs'
/// order (a stop leaves out those never started).
pub(crate) fn on_all_cores<J: Sync, R: Send>(
    jobs: &[J],
    should_stop: &(dyn Fn() -> bool + Sync),
    f: impl Fn(&J) -> R + Sync,
) -> Vec<(usize, R)> {
    let next = AtomicUsize::new(0);
    let out: Mutex<Vec<(usize, R)>> = Mutex::new(Vec::new());
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::thread::scope(|scope| {
        for _ in 0..threads.min(jobs.len().max(1)) {
            scope.spawn(|| {
                while !should_stop() {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(job) = jobs.get(i) else { return };
                    let r = f(job);
                    out.lock().unwrap_or_else(|p| p.into_inner()).push((i, r));
                }
            });
        }
    });
    let mut out = out.into_inner().unwrap_or_else(|p| p.into_inner());
    out.sort_by_key(|(i, _)| *i);
    out
}

/// Writes a per-policy capacity report as `<dir>/policy-capacity.{json,md}`, each atomically.
pub(crate) fn write_report(dir: &Path, report: &CapacityReport) -> Result<()> {
    cell::write_atomic(
        &dir.join("policy-capacity.json"),
        serde_json::to_string_pretty(report)?.as_bytes(),
    )?;
    cell::write_atomic(
        &dir.join("policy-capacity.md"),
        analysis::capacity::markdown(report).as_bytes(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calibration::{Routing, TtlRule};

    fn issue_35_variants() -> Variants {
        Variants {
            ttl_scales: vec![0.5, 1.0, 2.0],
            spill_abs: vec![2, 4, 8],
            spill_ratios: vec![1.25, 1.5, 2.0],
            ttl_at_point: true,
        }
    }

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_default_spill_margins_are_the_policies_own() {
        let d = policies::PolicySpec::default();
        assert_eq!(d.spill_abs, DEFAULT_SPILL_ABS);
        assert_eq!(d.spill_ratio, DEFAULT_SPILL_RATIO);
    }

    #[test]
    fn variants_are_labelled_distinctly_and_only_where_they_apply() {
        let v = issue_35_variants();
        let searched = v.expand(&names(&[
            "prefix-affinity",
            "session-affinity",
            "exact-residency",
        ]));
        let labels: Vec<&str> = searched.iter().map(|v| v.label.as_str()).collect();
        assert_eq!(
            labels,
            [
                "prefix-affinity",
                "prefix-affinity ttl×0.5",
                "prefix-affinity ttl×2",
                "prefix-affinity ttl@point",
                "prefix-affinity spill-abs 2",
                "prefix-affinity spill-abs 8",
                "prefix-affinity spill-ratio 1.25",
                "prefix-affinity spill-ratio 2",
                "session-affinity",
                "exact-residency",
                "exact-residency spill-abs 2",
                "exact-residency spill-abs 8",
                "exact-residency spill-ratio 1.25",
                "exact-residency spill-ratio 2",
            ]
        );
        let mut slugs: Vec<&str> = searched.iter().map(|v| v.slug.as_str()).collect();
        slugs.sort_unstable();
        slugs.dedup();
        assert_eq!(slugs.len(), searched.len(), "one directory per variant");
        assert!(slugs.iter().all(|s| {
            s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-.".contains(c))
        }));
        assert_eq!(v.baseline(&searched), "prefix-affinity");
        // Without variants: each policy once, margins over session-affinity, as before.
        let plain = Variants::default().expand(&names(&["prefix-affinity", "session-affinity"]));
        assert!(plain.iter().all(|v| v.tuning == Tuning::default()));
        assert_eq!(plain.len(), 2);
        assert_eq!(Variants::default().baseline(&plain), BASELINE);
        assert!(
            Variants {
                ttl_scales: vec![0.0],
                ..Variants::default()
            }
            .check()
            .is_err()
        );
    }

    #[test]
    fn a_variant_reaches_the_spec_the_search_steps_run() {
        let routing = Routing {
            index_ttl_s: 22.5,
            index_ttl_rule: TtlRule::LruCycleModel,
            index_node_cap: Some(40_000),
            bytes_per_token: 3.9,
        };
        let searched = issue_35_variants().expand(&names(&["prefix-affinity"]));
        let spec_of = |label: &str| {
            let v = searched.iter().find(|v| v.label == label).unwrap();
            let mut cfg = sim::SimConfig::new(3, "round-robin");
            crate::virtual_sweep::step_policy(&mut cfg, &v.policy, 7, &routing, Some(&v.tuning));
            assert!(policies::build(&cfg.policy).is_ok(), "{label} builds");
            cfg.policy
        };
        let default = spec_of("prefix-affinity");
        assert_eq!(default.index_ttl_us, 22_500_000);
        assert_eq!(default.index_node_cap, 40_000);
        assert_eq!((default.spill_abs, default.spill_ratio), (4, 1.5));
        assert_eq!(spec_of("prefix-affinity ttl×0.5").index_ttl_us, 11_250_000);
        assert_eq!(spec_of("prefix-affinity ttl×2").index_ttl_us, 45_000_000);
        let abs = spec_of("prefix-affinity spill-abs 8");
        assert_eq!(
            (abs.spill_abs, abs.spill_ratio, abs.index_ttl_us),
            (8, 1.5, 22_500_000)
        );
        let ratio = spec_of("prefix-affinity spill-ratio 1.25");
        assert_eq!((ratio.spill_abs, ratio.spill_ratio), (4, 1.25));
        // The TTL at a point's rate: the calibration's until the point's is derived, then that.
        let at_point = searched
            .iter()
            .find(|v| v.label == "prefix-affinity ttl@point")
            .unwrap();
        assert!(at_point.tuning.ttl_at_point && at_point.tuning.ttl_s.is_none());
        let mut derived = at_point.tuning;
        derived.ttl_s = Some(7.25);
        let mut cfg = sim::SimConfig::new(3, "round-robin");
        crate::virtual_sweep::step_policy(&mut cfg, "prefix-affinity", 7, &routing, Some(&derived));
        assert_eq!(cfg.policy.index_ttl_us, 7_250_000);
        assert_eq!((cfg.policy.spill_abs, cfg.policy.spill_ratio), (4, 1.5));
        // The basis names the base TTL, its rule and the factor.
        let words = Variants::describe(&searched, &routing);
        assert!(words.contains(
            "index TTL 11.250 s = 0.5 × the calibration's 22.500 s (rule `lru-cycle-model`)"
        ));
    }
}
