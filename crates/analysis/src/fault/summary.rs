//! A fault run's directory: every complete repetition analysed, the loss bounds checked over all
//! of them, each repetition's gates, the comparisons and the timeline of figure 6 over the
//! accepted ones, and the files `summary.md`, `summary.json`, `timeline.csv`.

use std::path::{Path, PathBuf};

use serde::Serialize;

use super::comparison::{Comparison, compare};
use super::gates::{DRIFT_WINDOW_RULE, RepGates, rep_gates};
use super::{FaultEvents, FaultKind, RepOutcome, analyse_rep, markdown};
use crate::compare::{Basis, Refusal, check_comparable};
use crate::drift::DriftConfig;
use crate::error::{AnalysisError, Result};
use crate::load::{RepData, RepLoad, load_rep, rep_number};
use crate::output::{OutputFile, write_files};
use crate::stats::median;

/// Every repetition of a fault directory.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// The analysis rules this summary was built with ([`crate::RULES_VERSION`]); empty in a
    /// summary written before summaries named them.
    #[serde(default)]
    pub rules: String,
    /// `kill` or `drain`.
    pub kind: FaultKind,
    /// Point directory the reps live in.
    pub point: String,
    /// Per complete repetition, accepted or set aside, in policy order.
    pub reps: Vec<RepOutcome>,
    /// All broken bounds, prefixed with policy and rep (over every complete repetition: a loss
    /// is a loss whether or not the repetition's measurements count).
    pub violations: Vec<String>,
    /// Each repetition's gates, in the order of `reps`.
    pub gates: Vec<RepGates>,
    /// Where a fault repetition's drift test runs ([`DRIFT_WINDOW_RULE`]).
    pub drift_rule: String,
    /// The policies compared over the accepted repetitions (empty when `refused`).
    pub comparisons: Vec<Comparison>,
    /// Why the repetitions were not compared: they sent different workloads or plans.
    pub refused: Option<Refusal>,
}

impl Summary {
    /// The repetitions the run accepted: the ones the comparisons and the timeline rest on.
    pub fn accepted(&self) -> impl Iterator<Item = &RepOutcome> {
        self.reps
            .iter()
            .zip(&self.gates)
            .filter(|(_, g)| g.accepted)
            .map(|(r, _)| r)
    }

    /// The files of a fault run's directory, in the order they are written: `timeline.csv`,
    /// `summary.json`, `summary.md`.
    pub fn files(&self) -> Vec<OutputFile> {
        vec![
            OutputFile {
                name: "timeline.csv",
                bytes: timeline_csv(&timeline(self.accepted())).into_bytes(),
            },
            OutputFile {
                name: "summary.json",
                // Plain structs and vectors only: serialising cannot fail.
                bytes: serde_json::to_string_pretty(self)
                    .expect("a fault summary serialises")
                    .into_bytes(),
            },
            OutputFile {
                name: "summary.md",
                bytes: markdown(self).into_bytes(),
            },
        ]
    }
}

/// Width of figure 6's rolling window, in 1-s buckets: each repetition's per-second goodput is
/// replaced by its centred mean over this many buckets (fewer at the two ends) before the median
/// and the range over repetitions are taken. Why 5: at a quick fleet's capacity a second holds
/// about 25 requests, whose Poisson count varies by ±√25/25 = ±20% from second to second, which
/// hides a one-replica-in-three outage (−33%); over 5 s it is ±9%, while the kill's edge is spread
/// over only ±2 s.
pub const TIMELINE_ROLLING_BUCKETS: usize = 5;

/// One `timeline.csv` row.
#[derive(Debug, Clone, PartialEq)]
pub struct TimelineRow {
    /// Policy.
    pub policy: String,
    /// Bucket start, s since the policy's load started.
    pub t_s: f64,
    /// Median over repetitions of the rolling goodput ([`TIMELINE_ROLLING_BUCKETS`]), req/s.
    pub goodput_rps: f64,
    /// Whether the faulted replica was up at the bucket start in every repetition.
    pub replica_alive: bool,
    /// Smallest repetition's rolling goodput, req/s.
    pub goodput_min_rps: f64,
    /// Largest repetition's rolling goodput, req/s.
    pub goodput_max_rps: f64,
    /// The rolling window's width, s.
    pub rolling_s: f64,
}

/// The centred rolling mean of `values` over `width` entries (fewer at the ends, where the
/// window is cut).
pub fn rolling_mean(values: &[f64], width: usize) -> Vec<f64> {
    let half = width / 2;
    (0..values.len())
        .map(|i| {
            let lo = i.saturating_sub(half);
            let hi = (i + half + 1).min(values.len());
            values[lo..hi].iter().sum::<f64>() / (hi - lo) as f64
        })
        .collect()
}

/// The timeline of figure 6 from the outcomes, in the order given (policies keep their first
/// appearance's order): per policy and 1-s bucket, the median and range over repetitions of each
/// repetition's rolling goodput ([`TIMELINE_ROLLING_BUCKETS`]).
pub fn timeline<'a>(reps: impl IntoIterator<Item = &'a RepOutcome>) -> Vec<TimelineRow> {
    let reps: Vec<&RepOutcome> = reps.into_iter().collect();
    let mut order: Vec<&str> = Vec::new();
    for r in &reps {
        if !order.contains(&r.policy.as_str()) {
            order.push(&r.policy);
        }
    }
    let mut out = Vec::new();
    for policy in order {
        let mine: Vec<&RepOutcome> = reps
            .iter()
            .copied()
            .filter(|r| r.policy == policy)
            .collect();
        let buckets = mine.iter().map(|r| r.goodput.len()).min().unwrap_or(0);
        let rolled: Vec<Vec<f64>> = mine
            .iter()
            .map(|r| {
                let raw: Vec<f64> = r.goodput[..buckets].iter().map(|b| b.goodput_rps).collect();
                rolling_mean(&raw, TIMELINE_ROLLING_BUCKETS)
            })
            .collect();
        for b in 0..buckets {
            let t_s = mine[0].goodput[b].start_s;
            let values: Vec<f64> = rolled.iter().map(|r| r[b]).collect();
            let alive = mine
                .iter()
                .all(|r| !(t_s >= r.driver.down_s && t_s < r.driver.up_s));
            out.push(TimelineRow {
                policy: policy.to_string(),
                t_s,
                goodput_rps: median(&values).unwrap_or(0.0),
                replica_alive: alive,
                goodput_min_rps: values.iter().copied().fold(f64::INFINITY, f64::min),
                goodput_max_rps: values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                rolling_s: TIMELINE_ROLLING_BUCKETS as f64,
            });
        }
    }
    out
}

/// `timeline.csv` text (header
/// `policy,t_s,goodput_rps,replica_alive,goodput_min_rps,goodput_max_rps,rolling_s`).
pub fn timeline_csv(rows: &[TimelineRow]) -> String {
    let mut s = String::from(
        "policy,t_s,goodput_rps,replica_alive,goodput_min_rps,goodput_max_rps,rolling_s\n",
    );
    for r in rows {
        s.push_str(&format!(
            "{},{:.3},{:.3},{},{:.3},{:.3},{}\n",
            r.policy,
            r.t_s,
            r.goodput_rps,
            u8::from(r.replica_alive),
            r.goodput_min_rps,
            r.goodput_max_rps,
            r.rolling_s
        ));
    }
    s
}

/// Reads every complete repetition of `point` in a fault run's directory (rows through
/// [`load_rep`], so plain as the run wrote them or `.csv.gz` as `xtask publish` copied them),
/// checks the loss bounds, reads each repetition's gates and runs the drift test (`drift`) on
/// its pre-fault window, and compares the policies over the accepted repetitions. Writes
/// nothing; [`write_summary`] does.
pub fn summarize(dir: &Path, point: &str, drift: &DriftConfig) -> Result<Summary> {
    let point_dir = dir.join(point);
    if !point_dir.is_dir() {
        return Err(fault_error(dir, format!("holds no point `{point}`")));
    }
    let mut found: Vec<(RepOutcome, RepGates, RepData)> = Vec::new();
    let mut kind = None;
    for policy_dir in sorted_dirs(&point_dir)? {
        for rep_dir in sorted_dirs(&policy_dir)? {
            let Some(rep) = rep_number(&file_name(&rep_dir)) else {
                continue;
            };
            let fault_json = rep_dir.join("fault.json");
            if !fault_json.exists() {
                continue;
            }
            let policy = file_name(&policy_dir);
            // An unfinished repetition (no meta, or not `complete`) is left out.
            let RepLoad::Complete(data) = load_rep(&rep_dir, point, &policy, rep)? else {
                continue;
            };
            let text = std::fs::read_to_string(&fault_json)
                .map_err(|e| AnalysisError::io(&fault_json, e))?;
            let events: FaultEvents = serde_json::from_str(&text)
                .map_err(|e| fault_error(&fault_json, format!("is not a valid fault.json: {e}")))?;
            let router = data
                .router
                .as_deref()
                .ok_or_else(|| fault_error(&rep_dir, "has no router.csv"))?;
            let outcome = analyse_rep(&policy, rep, &events, &data.client, router, &data.meta.slo);
            let gates = rep_gates(&data, &events, drift);
            kind = Some(events.kind);
            found.push((outcome, gates, *data));
        }
    }
    let Some(kind) = kind else {
        return Err(fault_error(
            &point_dir,
            "holds no complete fault repetition",
        ));
    };
    // Policy order as the run listed them, when known.
    if let Ok(text) = std::fs::read_to_string(dir.join("sweep.json"))
        && let Ok(v) = serde_json::from_str::<serde_json::Value>(&text)
        && let Some(list) = v["policies"].as_array()
    {
        let order: Vec<&str> = list.iter().filter_map(|p| p.as_str()).collect();
        found.sort_by_key(|(r, _, _)| {
            (
                order
                    .iter()
                    .position(|p| *p == r.policy)
                    .unwrap_or(usize::MAX),
                r.rep,
            )
        });
    }
    let violations = found
        .iter()
        .flat_map(|(r, _, _)| {
            r.violations
                .iter()
                .map(move |v| format!("{} rep-{}: {v}", r.policy, r.rep))
        })
        .collect();
    let accepted: Vec<&(RepOutcome, RepGates, RepData)> =
        found.iter().filter(|(_, g, _)| g.accepted).collect();
    let data: Vec<&RepData> = accepted.iter().map(|(_, _, d)| d).collect();
    let (comparisons, refused) = match check_comparable(point, &data) {
        Ok(()) => {
            let outcomes: Vec<&RepOutcome> = accepted.iter().map(|(r, _, _)| r).collect();
            let basis = Basis::of(data.iter().map(|d| d.meta.virtual_time));
            (compare(&outcomes, basis), None)
        }
        Err(refusal) => (Vec::new(), Some(refusal)),
    };
    let (reps, gates) = found.into_iter().map(|(r, g, _)| (r, g)).unzip();
    Ok(Summary {
        rules: crate::RULES_VERSION.to_string(),
        kind,
        point: point.to_string(),
        reps,
        violations,
        gates,
        drift_rule: DRIFT_WINDOW_RULE.to_string(),
        comparisons,
        refused,
    })
}

/// [`summarize`], then writes `timeline.csv`, `summary.json` and `summary.md` into `dir`.
pub fn write_summary(dir: &Path, point: &str, drift: &DriftConfig) -> Result<Summary> {
    let summary = summarize(dir, point, drift)?;
    write_files(dir, &summary.files())?;
    Ok(summary)
}

fn fault_error(path: &Path, message: impl Into<String>) -> AnalysisError {
    AnalysisError::Fault {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

fn sorted_dirs(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| AnalysisError::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    out.sort();
    Ok(out)
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}
