//! `report <sweep-dir>`: analyses a sweep's rows and prints Markdown tables; writes
//! `report.json` (schema in crates/analysis/README.md). Exit status: 0 on success, 1 on an error
//! (for example a malformed rows file, named with its line), 3 when some point was refused as
//! not comparable (the other points are still reported).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use analysis::{ReportConfig, analyze_dir, markdown};
use anyhow::Context;
use clap::Parser;

/// Analyse a sweep directory (`<sweep>/<point>/<policy>/rep-<k>/`).
#[derive(Parser, Debug)]
#[command(name = "report", version, about)]
struct Args {
    /// The sweep directory, e.g. measurements/pressure-grid.
    sweep_dir: PathBuf,
    /// Where to write the JSON report [default: SWEEP_DIR/report.json].
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also write the Markdown to this file (it is always printed to stdout).
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

/// Writes via a temporary name and a rename, so a reader never sees half a file.
fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))
}

fn run(args: Args) -> anyhow::Result<bool> {
    let mut cfg = ReportConfig::default();
    cfg.metrics.hot_conversations = args.hot_conversations;
    cfg.metrics.honour_threshold = args.honour_threshold;
    cfg.drift.t_threshold = args.drift_t;
    cfg.drift.min_relative_change = args.drift_min_change;
    let report = analyze_dir(&args.sweep_dir, &cfg)?;
    let md = markdown::render(&report);
    let json_path = args
        .json
        .unwrap_or_else(|| args.sweep_dir.join("report.json"));
    let mut json = serde_json::to_vec_pretty(&report)?;
    json.push(b'\n');
    write_atomic(&json_path, &json)?;
    if let Some(p) = &args.markdown {
        write_atomic(p, md.as_bytes())?;
    }
    std::io::stdout().write_all(md.as_bytes())?;
    for r in &report.refused {
        eprintln!("report: {r}");
    }
    eprintln!("report: wrote {}", json_path.display());
    Ok(report.refused.is_empty())
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
