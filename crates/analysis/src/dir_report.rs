//! The one entry point that decides what a directory is: a sweep gets `report.md` and
//! `report.json`, a fault run (its `sweep.json` names a `fault-…` sweep and its point)
//! `timeline.csv`, `summary.json` and `summary.md`. The `report` binary and `cargo xtask report`
//! both call [`write_report_dir`], so the two write the same bytes.

use std::path::Path;

use crate::error::Result;
use crate::fault::{self, Summary};
use crate::output::{OutputFile, write_files};
use crate::report::{Report, ReportConfig, analyze_dir};

/// A directory's analysis, by what the directory holds.
#[derive(Debug, Clone)]
pub enum DirReport {
    /// A sweep: `<point>/<policy>/rep-<k>/` compared point by point.
    Sweep(Box<Report>),
    /// A fault run: one point, the fault's repetitions.
    Fault(Box<Summary>),
}

impl DirReport {
    /// The Markdown: the report's tables, or the fault summary.
    pub fn markdown(&self) -> String {
        match self {
            DirReport::Sweep(r) => crate::markdown::render(r),
            DirReport::Fault(s) => fault::markdown(s),
        }
    }

    /// The files, in the order they are written: `report.md`, `report.json` for a sweep;
    /// `timeline.csv`, `summary.json`, `summary.md` for a fault run. JSON is pretty-printed
    /// without a final newline, as the published reports are.
    pub fn files(&self) -> Vec<OutputFile> {
        match self {
            DirReport::Sweep(r) => vec![
                OutputFile {
                    name: "report.md",
                    bytes: crate::markdown::render(r).into_bytes(),
                },
                OutputFile {
                    name: "report.json",
                    // Plain structs, vectors and string-keyed maps: serialising cannot fail.
                    bytes: serde_json::to_string_pretty(r)
                        .expect("a report serialises")
                        .into_bytes(),
                },
            ],
            DirReport::Fault(s) => s.files(),
        }
    }
}

/// Analyses `dir`: a fault run's summary when [`fault::fault_point`] finds one, else the sweep
/// report under `cfg`. Writes nothing.
pub fn report_dir(dir: &Path, cfg: &ReportConfig) -> Result<DirReport> {
    match fault::fault_point(dir) {
        Some(point) => Ok(DirReport::Fault(Box::new(fault::summarize(
            dir, &point, &cfg.drift,
        )?))),
        None => Ok(DirReport::Sweep(Box::new(analyze_dir(dir, cfg)?))),
    }
}

/// [`report_dir`], then writes its [`DirReport::files`] into `dir`.
pub fn write_report_dir(dir: &Path, cfg: &ReportConfig) -> Result<DirReport> {
    let report = report_dir(dir, cfg)?;
    write_files(dir, &report.files())?;
    Ok(report)
}
