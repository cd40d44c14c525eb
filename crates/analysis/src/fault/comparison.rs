//! The fault summary's comparisons between policies: per figure, each policy's median with its
//! [min–max] over the accepted repetitions, and every pair judged by
//! [`Verdict::judge`](crate::compare::Verdict::judge) — the sweep report's verdict function —
//! never by hand.

use serde::{Deserialize, Serialize};

use super::RepOutcome;
use crate::compare::{Basis, Verdict};
use crate::stats::Spread;

/// A figure of a repetition that policies are compared on.
struct Figure {
    key: &'static str,
    label: &'static str,
    unit: &'static str,
    get: fn(&RepOutcome) -> Option<f64>,
}

/// The figures compared, in the order `summary.md` lists them.
const FIGURES: [Figure; 4] = [
    Figure {
        key: "goodput_before_rps",
        label: "goodput before the fault",
        unit: "req/s",
        get: |r| r.goodput_before_rps,
    },
    Figure {
        key: "goodput_outage_rps",
        label: "goodput during the outage",
        unit: "req/s",
        get: |r| r.goodput_outage_rps,
    },
    Figure {
        key: "goodput_after_rps",
        label: "goodput after the restart",
        unit: "req/s",
        get: |r| r.goodput_after_rps,
    },
    Figure {
        key: "recovery_s",
        label: "recovery after the restart",
        unit: "s",
        get: |r| r.recovery_s,
    },
];

/// One policy's figure over its accepted repetitions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyFigure {
    /// Policy.
    pub policy: String,
    /// The accepted repetitions it rests on.
    pub reps: Vec<u32>,
    /// Median with range; `None` when any of those repetitions lacks the figure (a recovery not
    /// within the run has no value, and no bound stands in for one).
    pub spread: Option<Spread>,
    /// Repetitions without the figure.
    pub missing: Vec<u32>,
}

/// A policy's figure against an earlier-listed policy's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Difference {
    /// The policy.
    pub policy: String,
    /// The policy it is compared against (listed before it in the run).
    pub baseline: String,
    /// median(policy) − median(baseline), in the figure's unit.
    pub difference: f64,
    /// difference ÷ median(baseline); `None` when that median is zero.
    pub relative: Option<f64>,
    /// [`Verdict::judge`] of the two spreads.
    pub verdict: Verdict,
}

/// One figure compared across the policies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    /// The `RepOutcome` field compared (`goodput_outage_rps`, `recovery_s`, …).
    pub figure: String,
    /// In words.
    pub label: String,
    /// Unit.
    pub unit: String,
    /// Each policy, in the run's order.
    pub policies: Vec<PolicyFigure>,
    /// Each pair of policies that both have the figure: later-listed over earlier-listed.
    pub differences: Vec<Difference>,
}

/// Compares the policies on every figure over `accepted` (the accepted repetitions), policies
/// in the order they first appear there; `basis` says whether the spread is measured.
pub fn compare(accepted: &[&RepOutcome], basis: Basis) -> Vec<Comparison> {
    let mut order: Vec<&str> = Vec::new();
    for r in accepted {
        if !order.contains(&r.policy.as_str()) {
            order.push(&r.policy);
        }
    }
    FIGURES
        .iter()
        .map(|f| {
            let policies: Vec<PolicyFigure> = order
                .iter()
                .map(|&policy| {
                    let mine: Vec<&&RepOutcome> =
                        accepted.iter().filter(|r| r.policy == policy).collect();
                    let values: Vec<f64> = mine.iter().filter_map(|r| (f.get)(r)).collect();
                    let missing: Vec<u32> = mine
                        .iter()
                        .filter(|r| (f.get)(r).is_none())
                        .map(|r| r.rep)
                        .collect();
                    PolicyFigure {
                        policy: policy.to_string(),
                        reps: mine.iter().map(|r| r.rep).collect(),
                        spread: if missing.is_empty() {
                            Spread::of(&values)
                        } else {
                            None
                        },
                        missing,
                    }
                })
                .collect();
            let mut differences = Vec::new();
            for (j, a) in policies.iter().enumerate() {
                for b in &policies[..j] {
                    let (Some(sa), Some(sb)) = (a.spread, b.spread) else {
                        continue;
                    };
                    let difference = sa.median - sb.median;
                    differences.push(Difference {
                        policy: a.policy.clone(),
                        baseline: b.policy.clone(),
                        difference,
                        relative: (sb.median != 0.0).then(|| difference / sb.median),
                        verdict: Verdict::judge(&sa, &sb, basis),
                    });
                }
            }
            Comparison {
                figure: f.key.to_string(),
                label: f.label.to_string(),
                unit: f.unit.to_string(),
                policies,
                differences,
            }
        })
        .collect()
}
