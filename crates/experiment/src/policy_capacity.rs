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
}

impl Tuning {
    /// Applies the variant to `spec`, whose TTL is already the calibration's.
    pub fn apply(&self, spec: &mut policies::PolicySpec) {
        if let Some(f) = self.ttl_scale {
            spec.index_ttl_us = (spec.index_ttl_us as f64 * f).round() as u64;
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
                                job.point, job.variant.label, job.seed
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
    let report = analysis::capacity::report(&sweep, &basis, &baseline, RESOLUTION, &seeds, points);
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
            policies: Some(vec![job.variant.policy.clone()]),
            min_window_requests: Some(MIN_WINDOW_REQUESTS),
            tuning: Some(job.variant.tuning),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calibration::{Routing, TtlRule};

    fn issue_35_variants() -> Variants {
        Variants {
            ttl_scales: vec![0.5, 1.0, 2.0],
            spill_abs: vec![2, 4, 8],
            spill_ratios: vec![1.25, 1.5, 2.0],
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
        // The basis names the base TTL, its rule and the factor.
        let words = Variants::describe(&searched, &routing);
        assert!(words.contains(
            "index TTL 11.250 s = 0.5 × the calibration's 22.500 s (rule `lru-cycle-model`)"
        ));
    }
}
