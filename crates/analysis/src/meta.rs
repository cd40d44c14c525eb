//! `meta.json`: what the sweep records about one repetition (CONTRACTS.md, "Measurements
//! layout"). The type is the writers' and readers' one ([`schema::Meta`]: lenient where writers
//! may reasonably differ, strict on SLO and window); this module reads a file and checks the values
//! the analysis depends on.

use std::path::Path;

pub use schema::{Meta, Slo, Window, WindowClock};

use crate::error::{AnalysisError, Result};

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
