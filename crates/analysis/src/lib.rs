//! kvroute analysis: rows + meta → goodput, medians with ranges, spread verdicts, mechanism,
//! belief divergence and decay, drift check, comparability guard, the sweep report, and the
//! fault experiment's analysis and summary.
//!
//! It reads files and computes, and writes only its own outputs into the analysed directory
//! (`output`, `dir_report`); no network, no clock. See the crate README for the module map and the
//! `report.json` schema.

pub mod capacity;
pub mod compare;
pub mod crosscheck;
pub mod dir_report;
pub mod drift;
pub mod error;
pub mod fault;
pub mod load;
pub mod markdown;
pub mod meta;
pub mod metrics;
pub mod output;
pub mod report;
pub mod rows;
pub mod stages;
pub mod stats;

pub use compare::{Margin, Refusal, Verdict, check_comparable};
pub use dir_report::{DirReport, report_dir, write_report_dir};
pub use drift::{DriftClass, DriftConfig, DriftVerdict, check_rep_dir, check_rows};
pub use error::{AnalysisError, Result};
pub use load::{RepData, SweepData, load_rep, load_sweep};
pub use meta::{Meta, Slo, Window, WindowClock, read_meta};
pub use metrics::{MetricsConfig, is_good};
pub use output::{OutputFile, write_atomic};
pub use report::{Report, ReportConfig, analyze, analyze_dir};
/// The version of the analysis rules (window, SLO verdicts, drift and overload classes, gates,
/// verdict wording) that every report and fault summary names in its `rules` field and first
/// lines. Bump it whenever a change makes any published report, summary or timeline read
/// differently; `cargo xtask rebuild` then shows which published files must be rebuilt and
/// refuses to overwrite a published file whose bytes change under an unchanged version.
pub const RULES_VERSION: &str = "2026-12-04.1";

pub use rows::{ClientRow, RouterRow, read_client_csv, read_router_csv, rows_file};
