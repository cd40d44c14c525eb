//! A fault run's directory: every complete repetition analysed, the loss bounds checked over all
//! of them, the timeline of figure 6, and the files `summary.md`, `summary.json`, `timeline.csv`.

use std::path::{Path, PathBuf};

use serde::Serialize;

use super::{FaultEvents, FaultKind, RepOutcome, analyse_rep, markdown};
use crate::error::{AnalysisError, Result};
use crate::load::{RepLoad, load_rep, rep_number};
use crate::output::{OutputFile, write_files};
use crate::stats::median;

/// Every repetition of a fault directory.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// `kill` or `drain`.
    pub kind: FaultKind,
    /// Point directory the reps live in.
    pub point: String,
    /// Per repetition, in policy order.
    pub reps: Vec<RepOutcome>,
    /// All broken bounds, prefixed with policy and rep.
    pub violations: Vec<String>,
}

impl Summary {
    /// The files of a fault run's directory, in the order they are written: `timeline.csv`,
    /// `summary.json`, `summary.md`.
    pub fn files(&self) -> Vec<OutputFile> {
        vec![
            OutputFile {
                name: "timeline.csv",
                bytes: timeline_csv(&timeline(&self.reps)).into_bytes(),
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

/// One `timeline.csv` row.
#[derive(Debug, Clone, PartialEq)]
pub struct TimelineRow {
    /// Policy.
    pub policy: String,
    /// Bucket start, s since the policy's load started.
    pub t_s: f64,
    /// Median goodput over repetitions, req/s.
    pub goodput_rps: f64,
    /// Whether the faulted replica was up at the bucket start in every repetition.
    pub replica_alive: bool,
}

/// The timeline of figure 6 from the outcomes, in the order given (policies keep their first
/// appearance's order).
pub fn timeline(reps: &[RepOutcome]) -> Vec<TimelineRow> {
    let mut order: Vec<&str> = Vec::new();
    for r in reps {
        if !order.contains(&r.policy.as_str()) {
            order.push(&r.policy);
        }
    }
    let mut out = Vec::new();
    for policy in order {
        let mine: Vec<&RepOutcome> = reps.iter().filter(|r| r.policy == policy).collect();
        let buckets = mine.iter().map(|r| r.goodput.len()).min().unwrap_or(0);
        for b in 0..buckets {
            let t_s = mine[0].goodput[b].start_s;
            let values: Vec<f64> = mine.iter().map(|r| r.goodput[b].goodput_rps).collect();
            let alive = mine
                .iter()
                .all(|r| !(t_s >= r.driver.down_s && t_s < r.driver.up_s));
            out.push(TimelineRow {
                policy: policy.to_string(),
                t_s,
                goodput_rps: median(&values).unwrap_or(0.0),
                replica_alive: alive,
            });
        }
    }
    out
}

/// `timeline.csv` text (header `policy,t_s,goodput_rps,replica_alive`).
pub fn timeline_csv(rows: &[TimelineRow]) -> String {
    let mut s = String::from("policy,t_s,goodput_rps,replica_alive\n");
    for r in rows {
        s.push_str(&format!(
            "{},{:.3},{:.3},{}\n",
            r.policy,
            r.t_s,
            r.goodput_rps,
            u8::from(r.replica_alive)
        ));
    }
    s
}

/// Reads every complete repetition of `point` in a fault run's directory (rows through
/// [`load_rep`], so plain as the run wrote them or `.csv.gz` as `xtask publish` copied them) and
/// checks the loss bounds. Writes nothing; [`write_summary`] does.
pub fn summarize(dir: &Path, point: &str) -> Result<Summary> {
    let point_dir = dir.join(point);
    if !point_dir.is_dir() {
        return Err(fault_error(dir, format!("holds no point `{point}`")));
    }
    let mut reps = Vec::new();
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
            reps.push(analyse_rep(
                &policy,
                rep,
                &events,
                &data.client,
                router,
                &data.meta.slo,
            ));
            kind = Some(events.kind);
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
        reps.sort_by_key(|r| {
            (
                order
                    .iter()
                    .position(|p| *p == r.policy)
                    .unwrap_or(usize::MAX),
                r.rep,
            )
        });
    }
    let violations = reps
        .iter()
        .flat_map(|r| {
            r.violations
                .iter()
                .map(move |v| format!("{} rep-{}: {v}", r.policy, r.rep))
        })
        .collect();
    let summary = Summary {
        kind,
        point: point.to_string(),
        reps,
        violations,
    };
    Ok(summary)
}

/// [`summarize`], then writes `timeline.csv`, `summary.json` and `summary.md` into `dir`.
pub fn write_summary(dir: &Path, point: &str) -> Result<Summary> {
    let summary = summarize(dir, point)?;
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
