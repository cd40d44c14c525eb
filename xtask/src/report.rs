//! The report over a sweep directory, through the analysis crate.

use std::path::Path;

use anyhow::{Result, anyhow};

/// Analyses `sweep_dir`, writes `report.md` and `report.json` into it and prints the Markdown.
/// A fault run's directory (its `sweep.json` names a `fault-…` sweep and its point) gets its
/// summary rebuilt instead: `summary.md`, `summary.json` and `timeline.csv`.
pub fn write(sweep_dir: &Path) -> Result<()> {
    if let Some(point) = fault_point(sweep_dir) {
        let summary = crate::fault::summarize(sweep_dir, &point)?;
        println!("{}", std::fs::read_to_string(sweep_dir.join("summary.md"))?);
        eprintln!(
            "xtask: fault summary written to {} ({} repetitions, {} loss-bound violations)",
            sweep_dir.join("summary.md").display(),
            summary.reps.len(),
            summary.violations.len()
        );
        return Ok(());
    }
    let report = analysis::analyze_dir(sweep_dir, &analysis::ReportConfig::default())
        .map_err(|e| anyhow!("analysing {}: {e}", sweep_dir.display()))?;
    let markdown = analysis::markdown::render(&report);
    crate::cell::write_atomic(&sweep_dir.join("report.md"), markdown.as_bytes())?;
    crate::cell::write_atomic(
        &sweep_dir.join("report.json"),
        serde_json::to_string_pretty(&report)?.as_bytes(),
    )?;
    println!("{markdown}");
    eprintln!(
        "xtask: report written to {} and {}",
        sweep_dir.join("report.md").display(),
        sweep_dir.join("report.json").display()
    );
    Ok(())
}

/// The point of a fault run's directory, from the `sweep.json` the fault command writes
/// (`"sweep": "fault-kill"`, `"point": "ws1-s0-rate4"`); `None` for any other directory.
fn fault_point(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("sweep.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v["sweep"]
        .as_str()
        .is_some_and(|s| s.starts_with("fault-"))
        .then(|| v["point"].as_str().map(str::to_string))
        .flatten()
}
