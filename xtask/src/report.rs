//! The report over a sweep directory, through the analysis crate.

use std::path::Path;

use anyhow::{Result, anyhow};

/// Analyses `sweep_dir`, writes `report.md` and `report.json` into it and prints the Markdown.
pub fn write(sweep_dir: &Path) -> Result<()> {
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
