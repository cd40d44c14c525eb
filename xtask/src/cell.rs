//! One repetition directory: `meta.json` (written last, atomically) and the resume rule.

use anyhow::Result;
use serde::{Deserialize, Serialize};

/// The SLO a request must meet (ms).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    /// TTFT bound.
    pub ttft_ms: f64,
    /// Per-request ITL p50 bound.
    pub itl_ms: f64,
}

/// The measured window on the driver's clock (client.csv `_s` columns).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Window {
    /// Discarded warm-up, s.
    pub warmup_s: f64,
    /// Start of the measured window, s.
    pub measured_start_s: f64,
    /// End of the measured window, s.
    pub measured_end_s: f64,
}

/// `meta.json` (docs/CONTRACTS.md, "Measurements layout"), plus evidence and drift detail.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    /// Sweep name.
    pub sweep: String,
    /// Point name.
    pub point: String,
    /// Policy name.
    pub policy: String,
    /// Repetition number (1-based).
    pub rep: u32,
    /// Workload name.
    pub workload_name: String,
    /// Workload fingerprint.
    pub workload_fingerprint: String,
    /// Arrival-plan fingerprint.
    pub plan_fingerprint: String,
    /// Fleet description.
    pub fleet: serde_json::Value,
    /// SLO.
    pub slo: Slo,
    /// Measured window.
    pub window: Window,
    /// Git revision.
    pub git_rev: Option<String>,
    /// Tool versions.
    pub versions: serde_json::Value,
    /// Virtual time (always false here: these are live runs).
    #[serde(rename = "virtual")]
    pub virtual_time: bool,
    /// The repetition finished and all its files are written.
    pub complete: bool,
    /// Counted in the comparison (false: set aside).
    pub accepted: bool,
    /// Why it was set aside.
    pub set_aside_reason: Option<String>,
    /// Attempts this repetition took (discarded attempts live under `_discarded/`).
    #[serde(default)]
    pub attempts: u32,
    /// The evidence summary of the accepted attempt.
    #[serde(default)]
    pub evidence: serde_json::Value,
    /// The drift verdict of the accepted attempt.
    #[serde(default)]
    pub drift: serde_json::Value,
    /// Run settings (users, rate, durations, policy flags).
    #[serde(default)]
    pub run: serde_json::Value,
}

pub use experiment::cell::{CellState, clear, discard, write_atomic, write_meta};

/// The measured window from the driver's send times, by the sweep's rule
/// (`experiment::cell::measured_window`), as this crate's `Window`.
pub fn measured_window(
    sent_s: &[f64],
    warmup_s: f64,
    planned_end_s: f64,
    closed_users: Option<usize>,
) -> Result<Window> {
    let w = experiment::cell::measured_window(sent_s, warmup_s, planned_end_s, closed_users)?;
    Ok(Window {
        warmup_s: w.warmup_s,
        measured_start_s: w.measured_start_s,
        measured_end_s: w.measured_end_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::scratch::Scratch;

    fn meta(complete: bool, accepted: bool) -> Meta {
        Meta {
            sweep: "s".into(),
            point: "ws1-s0".into(),
            policy: "round-robin".into(),
            rep: 1,
            workload_name: "w".into(),
            workload_fingerprint: "f".into(),
            plan_fingerprint: "p".into(),
            fleet: serde_json::json!({"source": "emulated", "capacity_tokens": 1000}),
            slo: Slo {
                ttft_ms: 100.0,
                itl_ms: 3.0,
            },
            window: Window {
                warmup_s: 1.0,
                measured_start_s: 1.0,
                measured_end_s: 5.0,
            },
            git_rev: None,
            versions: serde_json::Value::Null,
            virtual_time: false,
            complete,
            accepted,
            set_aside_reason: (!accepted).then(|| "drift".to_string()),
            attempts: 1,
            evidence: serde_json::Value::Null,
            drift: serde_json::Value::Null,
            run: serde_json::Value::Null,
        }
    }

    #[test]
    fn meta_has_the_contract_fields_and_analysis_reads_it() {
        let s = Scratch::new("meta");
        write_meta(&s.0, &meta(true, false)).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(s.0.join("meta.json")).unwrap()).unwrap();
        for field in [
            "sweep",
            "point",
            "policy",
            "rep",
            "workload_name",
            "workload_fingerprint",
            "plan_fingerprint",
            "fleet",
            "slo",
            "window",
            "git_rev",
            "versions",
            "virtual",
            "complete",
            "accepted",
            "set_aside_reason",
        ] {
            assert!(v.get(field).is_some(), "meta.json lacks {field}");
        }
        let parsed = analysis::read_meta(&s.0.join("meta.json")).unwrap();
        assert_eq!(parsed.accepted, Some(false));
        assert_eq!(parsed.capacity_tokens(), Some(1000));
        assert_eq!(parsed.window.measured_s(), 4.0);
    }
}
