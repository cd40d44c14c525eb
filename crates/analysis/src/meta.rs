//! `meta.json`: what the sweep records about one repetition (CONTRACTS.md, "Measurements
//! layout"). Parsed leniently where writers may reasonably differ (fingerprints as strings or
//! numbers, unknown extra fields) and strictly where the analysis depends on a value (SLO, window).

use std::path::Path;

use serde::{Deserialize, Deserializer, Serialize};

use crate::error::{AnalysisError, Result};

/// The SLO a request must meet to count towards goodput.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    /// TTFT bound, ms (strict: TTFT must be below it).
    pub ttft_ms: f64,
    /// Per-request ITL p50 bound, ms (strict).
    pub itl_ms: f64,
}

/// The measured window of a repetition, on the driver's clock (the clock of `client.csv`'s `_s`
/// columns).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Window {
    /// Length of the discarded warm-up, s.
    pub warmup_s: f64,
    /// Start of the measured window, s.
    pub measured_start_s: f64,
    /// End of the measured window, s.
    pub measured_end_s: f64,
}

impl Window {
    /// Length of the measured window, s.
    pub fn measured_s(&self) -> f64 {
        self.measured_end_s - self.measured_start_s
    }

    /// Whether a send time falls in the measured window (start inclusive, end exclusive).
    pub fn contains(&self, t_s: f64) -> bool {
        t_s >= self.measured_start_s && t_s < self.measured_end_s
    }
}

/// One repetition's `meta.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    /// Sweep name.
    #[serde(default, deserialize_with = "opt_text")]
    pub sweep: Option<String>,
    /// Grid point name (the directory name is authoritative).
    #[serde(default, deserialize_with = "opt_text")]
    pub point: Option<String>,
    /// Policy name (the directory name is authoritative).
    #[serde(default, deserialize_with = "opt_text")]
    pub policy: Option<String>,
    /// Repetition number.
    #[serde(default, deserialize_with = "opt_text")]
    pub rep: Option<String>,
    /// Workload name (derived from its parameters).
    #[serde(deserialize_with = "text")]
    pub workload_name: String,
    /// Hash of the workload's parameters/bytes.
    #[serde(default, deserialize_with = "opt_text")]
    pub workload_fingerprint: Option<String>,
    /// Hash of the arrival plan's bytes.
    #[serde(deserialize_with = "text")]
    pub plan_fingerprint: String,
    /// Fleet description (`source, replicas, speed, slowdowns, capacity_tokens`), kept as JSON.
    #[serde(default)]
    pub fleet: serde_json::Value,
    /// The SLO goodput is measured against.
    pub slo: Slo,
    /// The measured window.
    pub window: Window,
    /// Git revision of the code that measured.
    #[serde(default, deserialize_with = "opt_text")]
    pub git_rev: Option<String>,
    /// Tool versions, kept as JSON.
    #[serde(default)]
    pub versions: serde_json::Value,
    /// Measured under the virtual clock (`sim`).
    #[serde(default, rename = "virtual")]
    pub virtual_time: Option<bool>,
    /// The repetition finished and all its files are written.
    #[serde(default)]
    pub complete: bool,
    /// `false` when the sweep set it aside (drift, evidence); absent means accepted.
    #[serde(default)]
    pub accepted: Option<bool>,
    /// Why it was set aside.
    #[serde(default, deserialize_with = "opt_text")]
    pub set_aside_reason: Option<String>,
}

impl Meta {
    /// Fleet KV capacity in tokens, when the sweep recorded it.
    pub fn capacity_tokens(&self) -> Option<u64> {
        self.fleet.get("capacity_tokens").and_then(|v| v.as_u64())
    }
}

/// Reads and checks a `meta.json`.
pub fn read_meta(path: &Path) -> Result<Meta> {
    let text = std::fs::read_to_string(path).map_err(|e| AnalysisError::io(path, e))?;
    let meta: Meta = serde_json::from_str(&text)
        .map_err(|e| AnalysisError::meta(path, format!("not a valid meta.json: {e}")))?;
    let w = &meta.window;
    if !(w.measured_start_s.is_finite() && w.measured_end_s.is_finite())
        || w.measured_end_s <= w.measured_start_s
    {
        return Err(AnalysisError::meta(
            path,
            format!(
                "window is empty or inverted: measured_start_s {} ≥ measured_end_s {}",
                w.measured_start_s, w.measured_end_s
            ),
        ));
    }
    if !(meta.slo.ttft_ms > 0.0 && meta.slo.itl_ms > 0.0) {
        return Err(AnalysisError::meta(
            path,
            format!(
                "slo bounds must be positive: ttft_ms {}, itl_ms {}",
                meta.slo.ttft_ms, meta.slo.itl_ms
            ),
        ));
    }
    Ok(meta)
}

/// Writers may record names and fingerprints as strings or numbers; both compare as text.
fn value_text(v: serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::Null => None,
        serde_json::Value::String(s) => Some(s),
        other => Some(other.to_string()),
    }
}

fn opt_text<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<String>, D::Error> {
    Ok(value_text(serde_json::Value::deserialize(d)?))
}

fn text<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<String, D::Error> {
    value_text(serde_json::Value::deserialize(d)?)
        .ok_or_else(|| serde::de::Error::custom("must not be null"))
}
