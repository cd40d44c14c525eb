//! Comparing policies at one point: the comparability guard (identical bytes or no comparison),
//! the spread verdict, and margins.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::load::RepData;
use crate::stats::Spread;

/// Cells sharing one value of the field that differs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RefusalGroup {
    /// The value these cells recorded.
    pub value: String,
    /// The cells, as `policy/rep-k`.
    pub cells: Vec<String>,
}

/// Why the cells of a point were not compared: they recorded different workloads or arrival
/// plans, so they did not send identical bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Refusal {
    /// The point.
    pub point: String,
    /// `workload_name` or `plan_fingerprint`.
    pub field: String,
    /// Each distinct value with the cells that recorded it (at least two groups).
    pub groups: Vec<RefusalGroup>,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "point `{}`: refusing to compare cells whose {} differs: ",
            self.point, self.field
        )?;
        let parts: Vec<String> = self
            .groups
            .iter()
            .map(|g| format!("`{}` ({})", g.value, g.cells.join(", ")))
            .collect();
        write!(f, "{}", parts.join(" vs "))
    }
}

/// The guard: every repetition of one point must record the same `workload_name` and the same
/// `plan_fingerprint`. The first field that differs is reported with every value and its cells.
pub fn check_comparable(point: &str, reps: &[&RepData]) -> Result<(), Refusal> {
    type Field = fn(&RepData) -> &str;
    let fields: [(&str, Field); 2] = [
        ("workload_name", |r| r.meta.workload_name.as_str()),
        ("plan_fingerprint", |r| r.meta.plan_fingerprint.as_str()),
    ];
    for (field, get) in fields {
        let mut groups: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        for r in reps {
            groups
                .entry(get(r))
                .or_default()
                .push(format!("{}/rep-{}", r.policy, r.rep));
        }
        if groups.len() > 1 {
            return Err(Refusal {
                point: point.to_string(),
                field: field.to_string(),
                groups: groups
                    .into_iter()
                    .map(|(value, cells)| RefusalGroup {
                        value: value.to_string(),
                        cells,
                    })
                    .collect(),
            });
        }
    }
    Ok(())
}

/// What the repetitions' min–max ranges are: measured noise, or seed variation of a
/// deterministic model. Only a measured spread can say whether a difference is real.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Basis {
    /// Live repetitions: the range is what the same cell measured on separate runs.
    Measured,
    /// Virtual repetitions: the simulator is deterministic given its seeds, so the range is the
    /// spread of seeds, not of measurement, and no verdict is drawn from it.
    Deterministic,
}

impl Basis {
    /// [`Basis::Deterministic`] when any of the repetitions behind a comparison ran in virtual
    /// time (`meta.json` `"virtual": true`), else [`Basis::Measured`].
    pub fn of(virtual_time: impl IntoIterator<Item = bool>) -> Basis {
        if virtual_time.into_iter().any(|v| v) {
            Basis::Deterministic
        } else {
            Basis::Measured
        }
    }
}

/// Whether a difference between two policies is larger than their repetitions' spread.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Verdict {
    /// The min–max ranges do not overlap.
    #[serde(rename = "separates")]
    Separates,
    /// The ranges overlap: the difference is within the spread of repetitions.
    #[serde(rename = "within spread")]
    WithinSpread,
    /// One side rests on fewer than two repetitions, so it has no spread to compare.
    #[serde(rename = "too few reps")]
    TooFewReps,
    /// Virtual repetitions: the difference is deterministic, and there is no measured spread to
    /// judge it against (docs/ARCHITECTURE.md, "Analysis", needs one).
    #[serde(rename = "deterministic (virtual)")]
    Deterministic,
}

impl Verdict {
    /// The verdict as the report writes it.
    pub fn as_str(&self) -> &'static str {
        match self {
            Verdict::Separates => "separates",
            Verdict::WithinSpread => "within spread",
            Verdict::TooFewReps => "too few reps",
            Verdict::Deterministic => "deterministic (virtual)",
        }
    }

    /// The verdict between two measured spreads (docs/ARCHITECTURE.md, "Analysis").
    pub fn between(a: &Spread, b: &Spread) -> Verdict {
        if a.n < 2 || b.n < 2 {
            Verdict::TooFewReps
        } else if a.overlaps(b) {
            Verdict::WithinSpread
        } else {
            Verdict::Separates
        }
    }

    /// The verdict between two spreads on `basis`: [`Verdict::between`] for measured ones,
    /// [`Verdict::Deterministic`] for virtual ones. The one verdict function of the sweep report
    /// and the fault summary.
    pub fn judge(a: &Spread, b: &Spread, basis: Basis) -> Verdict {
        match basis {
            Basis::Measured => Verdict::between(a, b),
            Basis::Deterministic => Verdict::Deterministic,
        }
    }
}

/// A policy's goodput against a baseline policy's at the same point.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Margin {
    /// The policy.
    pub policy: String,
    /// The policy it is compared against.
    pub baseline: String,
    /// median(policy) − median(baseline), req/s.
    pub margin_rps: f64,
    /// margin ÷ median(baseline); `None` when the baseline's median is zero.
    pub relative: Option<f64>,
    /// Separates, within spread, too few reps, or deterministic (virtual).
    pub verdict: Verdict,
    /// Either side rests on an overloaded repetition (its backlog grew through the window): the
    /// comparison stands, marked. Absent when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub overloaded: bool,
}

/// The margin of `a` over `b`, judged on `basis` ([`Verdict::judge`]).
pub fn margin(policy: &str, a: &Spread, baseline: &str, b: &Spread, basis: Basis) -> Margin {
    let margin_rps = a.median - b.median;
    Margin {
        policy: policy.to_string(),
        baseline: baseline.to_string(),
        margin_rps,
        relative: (b.median != 0.0).then(|| margin_rps / b.median),
        verdict: Verdict::judge(a, b, basis),
        overloaded: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spread(values: &[f64]) -> Spread {
        Spread::of(values).unwrap()
    }

    #[test]
    fn virtual_repetitions_get_no_spread_verdict() {
        // Ranges that do not overlap: measured, they separate; virtual, the same numbers are a
        // deterministic difference, whatever their seeds spread them by.
        let a = spread(&[10.0, 10.1, 10.2]);
        let b = spread(&[11.0, 11.1, 11.2]);
        assert_eq!(Verdict::judge(&a, &b, Basis::Measured), Verdict::Separates);
        assert_eq!(
            Verdict::judge(&a, &b, Basis::Deterministic),
            Verdict::Deterministic
        );
        let m = margin("x", &b, "y", &a, Basis::of([false, true]));
        assert_eq!(m.verdict, Verdict::Deterministic);
        assert!((m.margin_rps - 1.0).abs() < 1e-12);
        assert_eq!(Basis::of([false, false]), Basis::Measured);
        assert_eq!(
            serde_json::to_value(Verdict::Deterministic).unwrap(),
            "deterministic (virtual)"
        );
        assert_eq!(Verdict::Deterministic.as_str(), "deterministic (virtual)");
    }
}
