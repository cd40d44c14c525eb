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

/// Flags of `cargo xtask rebuild`.
#[derive(Debug, Clone, clap::Args)]
pub struct RebuildArgs {
    /// The published measurements.
    #[arg(long, default_value = "docs/measurements")]
    pub measurements: std::path::PathBuf,
    /// The published figures.
    #[arg(long, default_value = "docs/figures")]
    pub figures: std::path::PathBuf,
    /// Where the figures are drawn for comparison (emptied first).
    #[arg(long, default_value = "target/rebuild-check")]
    pub scratch: std::path::PathBuf,
    /// Replace every differing published file with the rebuilt one.
    #[arg(long)]
    pub write: bool,
}

/// `cargo xtask rebuild`: prints each differing file with its first difference and what was
/// exempt, and fails when anything differs (unless `--write` replaced it).
pub fn rebuild(args: &RebuildArgs) -> Result<()> {
    let started = std::time::Instant::now();
    let r = experiment::rebuild::rebuild(&experiment::rebuild::RebuildSettings {
        measurements: args.measurements.clone(),
        figures: args.figures.clone(),
        scratch: args.scratch.clone(),
        write: args.write,
    })?;
    for (what, why) in &r.exempt {
        println!("exempt: {what}: {why}");
    }
    for d in &r.differences {
        println!("differs: {}: {}", d.path.display(), d.first);
    }
    eprintln!(
        "xtask rebuild: {} files rebuilt with analysis rules {}, {} differ{}, {} exempt; {:.1} s",
        r.checked.len(),
        analysis::RULES_VERSION,
        r.differences.len(),
        if args.write {
            format!(" ({} replaced)", r.written.len())
        } else {
            String::new()
        },
        r.exempt.len(),
        started.elapsed().as_secs_f64()
    );
    if r.differences.is_empty() || args.write {
        Ok(())
    } else {
        Err(anyhow!(
            "{} published file(s) are not what today's code makes of their rows; rebuild them with `cargo xtask rebuild --write` (bumping `analysis::RULES_VERSION` if a rule changed) and say in the commit what changed",
            r.differences.len()
        ))
    }
}
