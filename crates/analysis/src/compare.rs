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
}

impl Verdict {
    /// The verdict as the report writes it.
    pub fn as_str(&self) -> &'static str {
        match self {
            Verdict::Separates => "separates",
            Verdict::WithinSpread => "within spread",
            Verdict::TooFewReps => "too few reps",
        }
    }

    /// The verdict between two spreads.
    pub fn between(a: &Spread, b: &Spread) -> Verdict {
        if a.n < 2 || b.n < 2 {
            Verdict::TooFewReps
        } else if a.overlaps(b) {
            Verdict::WithinSpread
        } else {
            Verdict::Separates
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
    /// Separates or within spread.
    pub verdict: Verdict,
}

/// The margin of `a` over `b`.
pub fn margin(policy: &str, a: &Spread, baseline: &str, b: &Spread) -> Margin {
    let margin_rps = a.median - b.median;
    Margin {
        policy: policy.to_string(),
        baseline: baseline.to_string(),
        margin_rps,
        relative: (b.median != 0.0).then(|| margin_rps / b.median),
        verdict: Verdict::between(a, b),
    }
}
