//! Each policy's own capacity at the SLO, over several workload draws (plan seeds), and the
//! verdict between two policies' capacities.
//!
//! A policy's capacity at a point, for one plan seed, is the highest offered open-loop rate at
//! which that policy alone met the SLO on ≥ [`schema::ATTAINMENT_TARGET`] of its measured
//! requests, bracketed by the lowest rate above it at which it did not (the search that finds it
//! lives in `experiment`; this module only judges what it found). Over seeds, a policy's
//! capacity is the median with its [min–max] range. Two policies *separate* when their seed
//! ranges do not overlap **and** their medians differ by more than the search's resolution
//! (each seed's capacity is only known to within its bracket); otherwise the difference is
//! *within spread* (ranges overlap) or *within resolution* (ranges apart by less than the
//! resolution). A policy with fewer than two bracketed seeds is *too few seeds*; one whose search
//! found no bracket on some seed (it failed at every rate tried, or met the SLO at every rate
//! tried) is *not bracketed* and never judged.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::stats::Spread;

/// The rule, in words, as every capacity report states it.
pub const CAPACITY_VERDICT_RULE: &str = "capacity = the highest offered open-loop rate at which the policy alone met the SLO on ≥ 90% of its measured requests (requests counted by scheduled time, so a backlog is a miss), bracketed by the lowest failing rate above it; per policy the median over plan seeds (different conversations, prefixes and arrivals) with [min–max]; two policies separate when their seed ranges do not overlap and their medians differ by more than the search's resolution, are within resolution when the ranges are apart by less, and within spread when the ranges overlap; a policy with fewer than two bracketed seeds has too few seeds, and one whose search found no bracket on a seed is not bracketed";

/// One plan seed's search for one policy at one point.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SeedCapacity {
    /// The plan seed.
    pub seed: u64,
    /// The highest rate at which the policy met the target (model req/s); `None` when it met it
    /// at no rate tried.
    pub capacity_rps: Option<f64>,
    /// The lowest rate above it at which it did not (model req/s); `None` when it met it at every
    /// rate tried.
    pub failing_rps: Option<f64>,
    /// Steps the search measured.
    pub steps: usize,
    /// Why the search found no bracket, when it did not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unbracketed: Option<String>,
}

impl SeedCapacity {
    /// Both ends of the bracket were measured.
    pub fn bracketed(&self) -> bool {
        self.capacity_rps.is_some() && self.failing_rps.is_some()
    }
}

/// One policy's capacity at one point over its seeds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyCapacity {
    /// The policy.
    pub policy: String,
    /// Each seed's search, in seed order.
    pub seeds: Vec<SeedCapacity>,
    /// Median and [min–max] of the bracketed seeds' capacities; `None` when no seed is
    /// bracketed.
    pub spread: Option<Spread>,
}

impl PolicyCapacity {
    /// `seeds` summarised (sorted by seed).
    pub fn of(policy: &str, mut seeds: Vec<SeedCapacity>) -> PolicyCapacity {
        seeds.sort_by_key(|s| s.seed);
        let values: Vec<f64> = seeds
            .iter()
            .filter(|s| s.bracketed())
            .filter_map(|s| s.capacity_rps)
            .collect();
        PolicyCapacity {
            policy: policy.to_string(),
            spread: Spread::of(&values),
            seeds,
        }
    }

    /// Every seed's search found a bracket.
    pub fn bracketed(&self) -> bool {
        !self.seeds.is_empty() && self.seeds.iter().all(SeedCapacity::bracketed)
    }
}

/// How two policies' capacities compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CapacityVerdict {
    /// Seed ranges apart and medians apart by more than the resolution.
    Separates,
    /// Seed ranges apart by less than the resolution.
    WithinResolution,
    /// Seed ranges overlap.
    WithinSpread,
    /// A side has fewer than two bracketed seeds.
    TooFewSeeds,
    /// A side's search found no bracket on some seed.
    NotBracketed,
}

impl CapacityVerdict {
    /// The verdict as reports write it.
    pub fn as_str(self) -> &'static str {
        match self {
            CapacityVerdict::Separates => "separates",
            CapacityVerdict::WithinResolution => "within resolution",
            CapacityVerdict::WithinSpread => "within spread",
            CapacityVerdict::TooFewSeeds => "too few seeds",
            CapacityVerdict::NotBracketed => "not bracketed",
        }
    }
}

/// The verdict between `a` and `b` at relative `resolution` (see the module doc).
pub fn verdict(a: &PolicyCapacity, b: &PolicyCapacity, resolution: f64) -> CapacityVerdict {
    if !a.bracketed() || !b.bracketed() {
        return CapacityVerdict::NotBracketed;
    }
    let (Some(sa), Some(sb)) = (a.spread, b.spread) else {
        return CapacityVerdict::NotBracketed;
    };
    if sa.n < 2 || sb.n < 2 {
        return CapacityVerdict::TooFewSeeds;
    }
    if sa.overlaps(&sb) {
        return CapacityVerdict::WithinSpread;
    }
    let (lo, hi) = if sa.median < sb.median {
        (sa.median, sb.median)
    } else {
        (sb.median, sa.median)
    };
    if hi > lo * (1.0 + resolution) {
        CapacityVerdict::Separates
    } else {
        CapacityVerdict::WithinResolution
    }
}

/// One policy against the baseline at one point.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CapacityMargin {
    /// The policy.
    pub policy: String,
    /// The baseline.
    pub baseline: String,
    /// Median capacity ÷ the baseline's median capacity; `None` when either has no median.
    pub ratio: Option<f64>,
    /// The verdict.
    pub verdict: CapacityVerdict,
}

/// Every policy's capacity at one point.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PointCapacities {
    /// The point (its workload without the seed).
    pub point: String,
    /// The policies, in the tables' order.
    pub policies: Vec<PolicyCapacity>,
    /// Each policy against the baseline.
    pub margins: Vec<CapacityMargin>,
    /// The policies with the highest median capacity (several when tied), in table order;
    /// empty unless every policy is bracketed.
    pub best: Vec<String>,
}

/// A per-policy capacity report over a grid.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CapacityReport {
    /// The analysis rules it was built with ([`crate::RULES_VERSION`]).
    pub rules: String,
    /// The sweep it belongs to.
    pub sweep: String,
    /// Share of measured requests that must meet the SLO.
    pub target: f64,
    /// The searches' relative resolution: each seed's failing rate is within this share above
    /// its capacity.
    pub resolution: f64,
    /// The baseline the margins are taken over.
    pub baseline: String,
    /// The plan seeds.
    pub seeds: Vec<u64>,
    /// Where the numbers come from (virtual time, live), in words.
    pub basis: String,
    /// [`CAPACITY_VERDICT_RULE`].
    pub rule: String,
    /// The points, in order.
    pub points: Vec<PointCapacities>,
    /// The unit of every capacity: model req/s ([`REQ_PER_S`]), or for a trace a rate
    /// multiplier of its own arrivals.
    #[serde(default = "req_per_s", skip_serializing_if = "is_req_per_s")]
    pub unit: String,
}

/// The unit of a workload's capacities: requests per second of model time.
pub const REQ_PER_S: &str = "req/s";

fn req_per_s() -> String {
    REQ_PER_S.to_string()
}

fn is_req_per_s(unit: &str) -> bool {
    unit == REQ_PER_S
}

impl CapacityReport {
    /// The report with its capacities in `unit` instead of model req/s.
    pub fn with_unit(mut self, unit: &str) -> CapacityReport {
        self.unit = unit.to_string();
        self
    }
}

/// One point's searches: its name, and per policy its seeds' results.
pub type PointSearches = (String, Vec<(String, Vec<SeedCapacity>)>);

/// Builds the report: per point, each policy's seeds summarised in the tables' policy order, and
/// its margin over `baseline`.
pub fn report(
    sweep: &str,
    basis: &str,
    baseline: &str,
    resolution: f64,
    seeds: &[u64],
    points: Vec<PointSearches>,
) -> CapacityReport {
    let points = points
        .into_iter()
        .map(|(point, by_policy)| {
            let mut policies: Vec<PolicyCapacity> = by_policy
                .into_iter()
                .map(|(p, s)| PolicyCapacity::of(&p, s))
                .collect();
            policies.sort_by_key(|p| crate::report::policy_rank(&p.policy));
            let base = policies.iter().find(|p| p.policy == baseline).cloned();
            let margins = match &base {
                None => Vec::new(),
                Some(b) => policies
                    .iter()
                    .filter(|p| p.policy != baseline)
                    .map(|p| CapacityMargin {
                        policy: p.policy.clone(),
                        baseline: baseline.to_string(),
                        ratio: match (p.spread, b.spread) {
                            (Some(a), Some(b)) if b.median > 0.0 => Some(a.median / b.median),
                            _ => None,
                        },
                        verdict: verdict(p, b, resolution),
                    })
                    .collect(),
            };
            let top = policies
                .iter()
                .filter_map(|p| p.spread.map(|s| s.median))
                .fold(f64::NEG_INFINITY, f64::max);
            let best = if policies.iter().all(PolicyCapacity::bracketed) {
                policies
                    .iter()
                    .filter(|p| p.spread.is_some_and(|s| s.median == top))
                    .map(|p| p.policy.clone())
                    .collect()
            } else {
                Vec::new()
            };
            PointCapacities {
                point,
                policies,
                margins,
                best,
            }
        })
        .collect();
    CapacityReport {
        rules: crate::RULES_VERSION.to_string(),
        sweep: sweep.to_string(),
        target: schema::ATTAINMENT_TARGET,
        resolution,
        baseline: baseline.to_string(),
        seeds: seeds.to_vec(),
        basis: basis.to_string(),
        rule: CAPACITY_VERDICT_RULE.to_string(),
        points,
        unit: req_per_s(),
    }
}

fn rate(r: Option<f64>) -> String {
    r.map_or_else(|| "—".to_string(), |r| format!("{r:.3}"))
}

/// The report as Markdown: per point, each policy's capacity (median [min–max] over seeds), its
/// ratio to the baseline with the verdict, and each seed's bracket.
pub fn markdown(r: &CapacityReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# Per-policy capacity, sweep `{}`\n", r.sweep);
    out.push_str(&crate::markdown::rules_line(&r.rules));
    let _ = writeln!(
        out,
        "{}. Seeds: {}. Resolution: each seed's failing rate is within {:.0}% above its capacity, so no margin under {:.0}% is a verdict. Basis: {}.\n",
        capitalise(&r.rule),
        r.seeds
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        r.resolution * 100.0,
        r.resolution * 100.0,
        r.basis
    );
    let _ = writeln!(out, "## Summary\n");
    let _ = writeln!(
        out,
        "| point | best | {} capacity {} | best vs {} |\n|---|---|---|---|",
        r.baseline, r.unit, r.baseline
    );
    for p in &r.points {
        let base = p.policies.iter().find(|x| x.policy == r.baseline);
        let best_margin = p
            .best
            .iter()
            .find_map(|b| p.margins.iter().find(|m| &m.policy == b));
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} |",
            p.point,
            match p.best.len() {
                0 => "— (not every policy bracketed)".to_string(),
                1 => p.best[0].clone(),
                _ => format!("{} (tied)", p.best.join(", ")),
            },
            base.map_or_else(|| "—".into(), spread_text),
            match best_margin {
                _ if p.best.contains(&r.baseline) => {
                    "— (the baseline is among the best)".to_string()
                }
                Some(m) => margin_text(m, r.resolution),
                None => "—".to_string(),
            }
        );
    }
    for p in &r.points {
        let _ = writeln!(out, "\n## `{}`\n", p.point);
        let _ = writeln!(
            out,
            "| policy | capacity {} median [min–max] | vs {} | per seed: capacity / failing |\n|---|---|---|---|",
            r.unit, r.baseline
        );
        for pc in &p.policies {
            let margin = p.margins.iter().find(|m| m.policy == pc.policy);
            let seeds = pc
                .seeds
                .iter()
                .map(|s| match &s.unbracketed {
                    Some(why) => format!("seed {}: {why}", s.seed),
                    None => format!(
                        "seed {}: {} / {}",
                        s.seed,
                        rate(s.capacity_rps),
                        rate(s.failing_rps)
                    ),
                })
                .collect::<Vec<_>>()
                .join("; ");
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} |",
                pc.policy,
                spread_text(pc),
                margin.map_or_else(|| "—".to_string(), |m| margin_text(m, r.resolution)),
                seeds
            );
        }
    }
    out
}

fn spread_text(p: &PolicyCapacity) -> String {
    match p.spread {
        None => "—".to_string(),
        Some(s) if s.n == 1 => format!("{:.3} (1 seed)", s.median),
        Some(s) => format!("{:.3} [{:.3}–{:.3}]", s.median, s.min, s.max),
    }
}

fn margin_text(m: &CapacityMargin, resolution: f64) -> String {
    match m.ratio {
        None => m.verdict.as_str().to_string(),
        Some(ratio) => format!(
            "×{ratio:.3} ({:+.1}%) {} (resolution {:.0}%)",
            (ratio - 1.0) * 100.0,
            m.verdict.as_str(),
            resolution * 100.0
        ),
    }
}

fn capitalise(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_uppercase().collect::<String>() + c.as_str(),
        None => String::new(),
    }
}

/// The rule by which a live search's capacity is judged against the simulator's prediction of
/// the same search, as every prediction check states it.
pub const PREDICTION_RULE: &str = "each live search started at the simulator's prediction of the same policy, point and plan seed under the same calibration; the prediction agrees when its bracket [capacity, failing rate] overlaps the live bracket (both are known only to their resolution), else the live capacity is above or below it; ratio = live capacity ÷ predicted capacity";

/// How a live capacity compares with the simulator's prediction of it ([`PREDICTION_RULE`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PredictionVerdict {
    /// The brackets overlap.
    Agrees,
    /// The live bracket lies wholly above the predicted one.
    LiveAbove,
    /// The live bracket lies wholly below the predicted one.
    LiveBelow,
    /// One side found no bracket.
    NotBracketed,
}

impl PredictionVerdict {
    /// The words the reports use.
    pub fn as_str(self) -> &'static str {
        match self {
            PredictionVerdict::Agrees => "agrees",
            PredictionVerdict::LiveAbove => "live above",
            PredictionVerdict::LiveBelow => "live below",
            PredictionVerdict::NotBracketed => "not bracketed",
        }
    }
}

/// One search: the simulator's prediction beside the live result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PredictionCheck {
    /// The point.
    pub point: String,
    /// The policy.
    pub policy: String,
    /// The simulator's search.
    pub predicted: SeedCapacity,
    /// The live search (same seed).
    pub live: SeedCapacity,
    /// Live capacity ÷ predicted capacity, when both are bracketed.
    pub ratio: Option<f64>,
    /// [`PREDICTION_RULE`]'s verdict.
    pub verdict: PredictionVerdict,
}

/// Judges one live search against its prediction ([`PREDICTION_RULE`]).
pub fn prediction_check(
    point: &str,
    policy: &str,
    predicted: SeedCapacity,
    live: SeedCapacity,
) -> PredictionCheck {
    let bracket = |s: &SeedCapacity| s.capacity_rps.zip(s.failing_rps);
    let (verdict, ratio) = match (bracket(&predicted), bracket(&live)) {
        (Some((p_lo, p_hi)), Some((l_lo, l_hi))) => {
            let verdict = if l_lo >= p_hi {
                PredictionVerdict::LiveAbove
            } else if l_hi <= p_lo {
                PredictionVerdict::LiveBelow
            } else {
                PredictionVerdict::Agrees
            };
            (verdict, (p_lo > 0.0).then(|| l_lo / p_lo))
        }
        _ => (PredictionVerdict::NotBracketed, None),
    };
    PredictionCheck {
        point: point.to_string(),
        policy: policy.to_string(),
        predicted,
        live,
        ratio,
        verdict,
    }
}

/// The prediction checks as Markdown: one row per search, then how many agree.
pub fn prediction_markdown(checks: &[PredictionCheck]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "## Live vs the simulator's prediction
"
    );
    let _ = writeln!(
        out,
        "{}.
",
        capitalise(PREDICTION_RULE)
    );
    let _ = writeln!(
        out,
        "| point | policy | seed | predicted capacity / failing | live capacity / failing | live ÷ predicted | verdict |\n|---|---|---|---|---|---|---|"
    );
    let bracket = |s: &SeedCapacity| match &s.unbracketed {
        Some(why) => why.clone(),
        None => format!("{} / {}", rate(s.capacity_rps), rate(s.failing_rps)),
    };
    for c in checks {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} |",
            c.point,
            c.policy,
            c.live.seed,
            bracket(&c.predicted),
            bracket(&c.live),
            c.ratio
                .map_or_else(|| "—".to_string(), |r| format!("×{r:.3}")),
            c.verdict.as_str()
        );
    }
    let agree = checks
        .iter()
        .filter(|c| c.verdict == PredictionVerdict::Agrees)
        .count();
    let judged = checks
        .iter()
        .filter(|c| c.verdict != PredictionVerdict::NotBracketed)
        .count();
    let _ = writeln!(
        out,
        "\n{agree} of {judged} bracketed searches agree with their prediction ({} searches in all).",
        checks.len()
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seed(seed: u64, cap: f64, fail: f64) -> SeedCapacity {
        SeedCapacity {
            seed,
            capacity_rps: Some(cap),
            failing_rps: Some(fail),
            steps: 8,
            unbracketed: None,
        }
    }

    fn policy(name: &str, caps: &[f64]) -> PolicyCapacity {
        PolicyCapacity::of(
            name,
            caps.iter()
                .enumerate()
                .map(|(i, &c)| seed(i as u64, c, c * 1.05))
                .collect(),
        )
    }

    #[test]
    fn ranges_apart_by_more_than_the_resolution_separate() {
        let a = policy("a", &[10.0, 10.4, 10.2]);
        let b = policy("b", &[12.0, 12.5, 12.2]);
        assert_eq!(verdict(&a, &b, 0.05), CapacityVerdict::Separates);
        assert_eq!(verdict(&b, &a, 0.05), CapacityVerdict::Separates);
    }

    #[test]
    fn ranges_apart_by_less_than_the_resolution_do_not_separate() {
        // Apart (10.4 < 10.5) but the medians differ by 3%, under the 5% resolution.
        let a = policy("a", &[10.0, 10.4, 10.2]);
        let b = policy("b", &[10.5, 10.6, 10.5]);
        assert_eq!(verdict(&a, &b, 0.05), CapacityVerdict::WithinResolution);
        // The same capacities searched to 1% separate.
        assert_eq!(verdict(&a, &b, 0.01), CapacityVerdict::Separates);
    }

    #[test]
    fn overlapping_seed_ranges_are_within_spread_however_far_the_medians() {
        let a = policy("a", &[10.0, 10.2, 14.0]);
        let b = policy("b", &[13.0, 13.5, 14.5]);
        assert_eq!(verdict(&a, &b, 0.05), CapacityVerdict::WithinSpread);
    }

    #[test]
    fn one_seed_is_too_few_and_an_unbracketed_seed_is_never_judged() {
        let a = policy("a", &[10.0]);
        let b = policy("b", &[20.0, 21.0]);
        assert_eq!(verdict(&a, &b, 0.05), CapacityVerdict::TooFewSeeds);
        let mut c = policy("c", &[10.0, 10.1, 10.2]);
        c.seeds[1].failing_rps = None;
        c.seeds[1].unbracketed = Some("met the SLO at every rate tried".into());
        let c = PolicyCapacity::of("c", c.seeds);
        assert_eq!(c.spread.map(|s| s.n), Some(2), "only bracketed seeds count");
        assert_eq!(verdict(&c, &b, 0.05), CapacityVerdict::NotBracketed);
    }

    #[test]
    fn the_report_orders_policies_and_names_the_best_with_its_ratio() {
        let r = report(
            "grid",
            "virtual time",
            "session-affinity",
            0.05,
            &[7, 8, 9],
            vec![(
                "ws1-s0".into(),
                vec![
                    (
                        "prefix-affinity".into(),
                        vec![
                            seed(7, 12.0, 12.5),
                            seed(8, 12.4, 13.0),
                            seed(9, 12.2, 12.8),
                        ],
                    ),
                    (
                        "session-affinity".into(),
                        vec![
                            seed(7, 10.0, 10.5),
                            seed(8, 10.4, 10.9),
                            seed(9, 10.2, 10.7),
                        ],
                    ),
                ],
            )],
        );
        let p = &r.points[0];
        assert_eq!(p.policies[0].policy, "session-affinity", "table order");
        assert_eq!(p.best, ["prefix-affinity"]);
        let m = &p.margins[0];
        assert_eq!(m.verdict, CapacityVerdict::Separates);
        assert!((m.ratio.unwrap() - 12.2 / 10.2).abs() < 1e-12);
        let md = markdown(&r);
        assert!(md.contains("| ws1-s0 | prefix-affinity | 10.200 [10.000–10.400] | ×1.196 (+19.6%) separates (resolution 5%) |"), "{md}");
        assert!(md.contains("seed 8: 12.400 / 13.000"), "{md}");
    }

    fn bracket(capacity: f64, failing: f64) -> SeedCapacity {
        SeedCapacity {
            seed: 7,
            capacity_rps: Some(capacity),
            failing_rps: Some(failing),
            steps: 4,
            unbracketed: None,
        }
    }

    #[test]
    fn a_prediction_agrees_when_the_brackets_overlap_and_is_judged_by_side_otherwise() {
        let check = |p: SeedCapacity, l: SeedCapacity| prediction_check("ws1-s0", "a", p, l);
        let c = check(bracket(10.0, 10.5), bracket(10.3, 10.8));
        assert_eq!(c.verdict, PredictionVerdict::Agrees);
        assert!((c.ratio.unwrap() - 1.03).abs() < 1e-12);
        assert_eq!(
            check(bracket(10.0, 10.5), bracket(10.5, 11.0)).verdict,
            PredictionVerdict::LiveAbove
        );
        assert_eq!(
            check(bracket(10.0, 10.5), bracket(9.0, 9.5)).verdict,
            PredictionVerdict::LiveBelow
        );
        let none = SeedCapacity {
            capacity_rps: None,
            unbracketed: Some("fails at every rate tried".into()),
            ..bracket(0.0, 1.0)
        };
        let c = check(bracket(10.0, 10.5), none);
        assert_eq!(
            (c.verdict, c.ratio),
            (PredictionVerdict::NotBracketed, None)
        );
        let text = prediction_markdown(&[c, check(bracket(10.0, 10.5), bracket(10.3, 10.8))]);
        assert!(
            text.contains(
                "| ws1-s0 | a | 7 | 10.000 / 10.500 | 10.300 / 10.800 | ×1.030 | agrees |"
            )
        );
        assert!(text.contains("fails at every rate tried"));
        assert!(text.contains(
            "1 of 1 bracketed searches agree with their prediction (2 searches in all)."
        ));
    }
}
