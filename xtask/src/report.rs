//! `cargo xtask report <dir>`: the analysis crate's report of a sweep or a fault run's
//! directory, written into it exactly as the `report` binary writes it.

use std::path::Path;

use anyhow::{Result, anyhow};

/// Analyses `dir` and writes its files (`report.md` and `report.json` for a sweep; `summary.md`,
/// `summary.json` and `timeline.csv` for a fault run) through `analysis::write_report_dir`, then
/// prints the Markdown.
pub fn write(dir: &Path) -> Result<()> {
    let written = analysis::write_report_dir(dir, &analysis::ReportConfig::default())
        .map_err(|e| anyhow!("analysing {}: {e}", dir.display()))?;
    println!("{}", written.markdown());
    match &written {
        analysis::DirReport::Sweep(_) => eprintln!(
            "xtask: report written to {} and {}",
            dir.join("report.md").display(),
            dir.join("report.json").display()
        ),
        analysis::DirReport::Fault(summary) => eprintln!(
            "xtask: fault summary written to {} ({} repetitions, {} loss-bound violations)",
            dir.join("summary.md").display(),
            summary.reps.len(),
            summary.violations.len()
        ),
    }
    Ok(())
}

/// `cargo xtask crosscheck LIVE VIRTUAL`: prints the cross-check, writes it into `live`, and
/// fails when the two do not agree at the effect-sized bounds.
pub fn crosscheck(live: &Path, virt: &Path, baseline: &str) -> Result<()> {
    use analysis::crosscheck::{Tolerance, crosscheck_dirs, render_markdown};
    let c = crosscheck_dirs(live, virt, baseline, Tolerance::EFFECT_SIZED, live).map_err(|e| {
        anyhow!(
            "cross-checking {} against {}: {e}",
            live.display(),
            virt.display()
        )
    })?;
    println!("{}", render_markdown(&c));
    eprintln!(
        "xtask: cross-check written to {}",
        live.join("crosscheck.md").display()
    );
    if c.passes() {
        Ok(())
    } else {
        Err(anyhow!(
            "live and virtual do not agree (see {})",
            live.join("crosscheck.md").display()
        ))
    }
}
