//! `report <dir>`: the analysis of a sweep or a fault run's directory, through
//! `analysis::write_report_dir`, the function `cargo xtask report` calls, so both write the same
//! bytes. A sweep gets `report.md` and `report.json` (schema in crates/analysis/README.md); a
//! fault run (its `sweep.json` names a `fault-…` sweep) `timeline.csv`, `summary.json` and
//! `summary.md`. The Markdown is printed. Exit status: 0 on success, 1 on an error (for example
//! a malformed rows file, named with its line), 3 when some point of a sweep was refused as not
//! comparable (the other points are still reported).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use analysis::{DirReport, ReportConfig, report_dir, write_atomic, write_report_dir};
use clap::Parser;

/// Analyse a sweep directory (`<sweep>/<point>/<policy>/rep-<k>/`) or a fault run's directory.
#[derive(Parser, Debug)]
#[command(name = "report", version, about)]
struct Args {
    /// The directory, e.g. measurements/pressure-grid or measurements/fault-kill.
    sweep_dir: PathBuf,
    /// Write the JSON (report.json, or a fault run's summary.json) here instead of into the
    /// directory.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the Markdown (report.md, or a fault run's summary.md) here instead of into the
    /// directory (it is always printed to stdout).
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// Conversations (most requests first) counted as hot.
    #[arg(long, default_value_t = 10)]
    hot_conversations: usize,
    /// Drift check: |t| above which a trend is real.
    #[arg(long, default_value_t = 3.0)]
    drift_t: f64,
    /// Drift check: relative change across the window above which a real trend matters.
    #[arg(long, default_value_t = 0.10)]
    drift_min_change: f64,
    /// Honoured share below which belief counts as stale (implied TTL).
    #[arg(long, default_value_t = 0.5)]
    honour_threshold: f64,
}

fn run(args: Args) -> anyhow::Result<bool> {
    let mut cfg = ReportConfig::default();
    cfg.metrics.hot_conversations = args.hot_conversations;
    cfg.metrics.honour_threshold = args.honour_threshold;
    cfg.drift.t_threshold = args.drift_t;
    cfg.drift.min_relative_change = args.drift_min_change;
    let dir = &args.sweep_dir;
    let (written, paths) = if args.json.is_none() && args.markdown.is_none() {
        let written = write_report_dir(dir, &cfg)?;
        let paths = written.files().iter().map(|f| dir.join(f.name)).collect();
        (written, paths)
    } else {
        // The same files, the JSON and the Markdown where the flags say.
        let written = report_dir(dir, &cfg)?;
        let mut paths = Vec::new();
        for f in written.files() {
            let path = match Path::new(f.name).extension().and_then(|e| e.to_str()) {
                Some("json") => args.json.clone(),
                Some("md") => args.markdown.clone(),
                _ => None,
            }
            .unwrap_or_else(|| dir.join(f.name));
            write_atomic(&path, &f.bytes)?;
            paths.push(path);
        }
        (written, paths)
    };
    std::io::stdout().write_all(written.markdown().as_bytes())?;
    let comparable = match &written {
        DirReport::Sweep(report) => {
            for r in &report.refused {
                eprintln!("report: {r}");
            }
            report.refused.is_empty()
        }
        DirReport::Fault(summary) => {
            eprintln!(
                "report: fault run, {} repetitions, {} loss-bound violations",
                summary.reps.len(),
                summary.violations.len()
            );
            true
        }
    };
    for p in paths {
        eprintln!("report: wrote {}", p.display());
    }
    Ok(comparable)
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(3),
        Err(e) => {
            eprintln!("report: {e:#}");
            ExitCode::FAILURE
        }
    }
}
