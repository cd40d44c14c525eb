//! The crate's one error type. Every variant names what it was reading, writing or drawing (the
//! figure, the sweep directory, the file and line), so a failure can be acted on from its text.

use std::path::PathBuf;

use crate::FigureId;

/// Why a figure could not be loaded, drawn or written.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The output directory could not be created.
    #[error("figures: cannot create {}", path.display())]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// A data file (`<stem>.csv`) could not be written.
    #[error("cannot write {}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// A figure's numbers could not be formatted as CSV.
    #[error("cannot format the figure's data as CSV")]
    Table {
        /// The CSV writer's error.
        source: csv::Error,
    },
    /// The `analysis` crate could not load a sweep.
    #[error("figures: cannot load the {what} at {}", dir.display())]
    Load {
        /// "sweep" or "fault sweep".
        what: &'static str,
        /// The sweep directory.
        dir: PathBuf,
        /// Why.
        source: analysis::AnalysisError,
    },
    /// The sweep directory a figure is drawn from does not exist.
    #[error("{figure}: {} does not exist (looked for {} beside it{also})", dir.display(), looked_for.join(", "))]
    NoSweep {
        /// The figure and what it needs ("figure 7 needs a load sweep").
        figure: &'static str,
        /// The directory looked for.
        dir: PathBuf,
        /// The sweep names looked for beside it.
        looked_for: Vec<&'static str>,
        /// How to make one (may be empty).
        also: &'static str,
    },
    /// A fault timeline (`timeline.csv`) could not be opened.
    #[error("figures: cannot read the fault timeline {}", path.display())]
    TimelineOpen {
        /// The file.
        path: PathBuf,
        /// The CSV reader's error.
        source: csv::Error,
    },
    /// A fault timeline's header could not be read.
    #[error("{}: cannot read the header", path.display())]
    TimelineHeader {
        /// The file.
        path: PathBuf,
        /// The CSV reader's error.
        source: csv::Error,
    },
    /// A fault timeline's row could not be parsed as CSV.
    #[error("{}:{line}: malformed row", path.display())]
    TimelineRow {
        /// The file.
        path: PathBuf,
        /// 1-based line number (the header is line 1).
        line: usize,
        /// The CSV reader's error.
        source: csv::Error,
    },
    /// A fault timeline holds an impossible value (a bad header, a value that is not a number,
    /// duplicate times, no rows).
    #[error("{}{}: {message}", path.display(), line.map(|l| format!(":{l}")).unwrap_or_default())]
    Timeline {
        /// The file.
        path: PathBuf,
        /// 1-based line number, where the defect is on one line.
        line: Option<usize>,
        /// What is wrong.
        message: String,
    },
    /// A per-policy capacity report (`policy-capacity.json`) could not be read.
    #[error("figures: cannot read the per-policy capacity report {}", path.display())]
    CapacityRead {
        /// The file.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// A per-policy capacity report is not what `analysis::capacity` writes.
    #[error("figures: {} is not a per-policy capacity report (`analysis::capacity::CapacityReport`)", path.display())]
    CapacityParse {
        /// The file.
        path: PathBuf,
        /// The JSON reader's error.
        source: serde_json::Error,
    },
    /// A field a figure's title needs is absent from meta.json's `fleet`.
    #[error("`{0}` is missing")]
    MissingField(&'static str),
    /// The fleet the sweep's repetitions recorded cannot be described for a title.
    #[error("figures: {}: meta.json `fleet` is missing what a title names", dir.display())]
    FleetTitle {
        /// The sweep directory.
        dir: PathBuf,
        /// What is missing.
        source: Box<Error>,
    },
    /// The input cannot be drawn: mismatched cells, SLOs or fleets, a point without its offered
    /// load, a sweep with nothing accepted. The message names the sweep and what is wrong.
    #[error("{0}")]
    Invalid(String),
    /// A number a figure needs is not in the report (a policy cell, an arm, a field); the
    /// message names the figure, the point, the policy and what is missing.
    #[error("{0}")]
    Missing(String),
    /// A figure was asked to draw from the wrong kind of input.
    #[error("{fig} is drawn from {needs}")]
    WrongInput {
        /// The figure.
        fig: FigureId,
        /// The kind of sweep it needs ("a grid sweep").
        needs: &'static str,
    },
    /// Plotters failed while drawing.
    #[error("drawing failed: {0}")]
    Draw(String),
    /// Plotters could not write a PNG or SVG file.
    #[error("{}: {message}", path.display())]
    Save {
        /// The file.
        path: PathBuf,
        /// Plotters' error, as text (its type is generic over the backend).
        message: String,
    },
    /// The embedded font could not be registered.
    #[error("figures: the embedded DejaVuSans.ttf is not a valid font")]
    Font,
    /// Some figures of a [`crate::render`] call were not drawn (those that could be were
    /// written).
    #[error(
        "{} of {total} figures not drawn:\n  {}\n(written: {})",
        failures.len(),
        failures.join("\n  "),
        if written.is_empty() {
            "nothing".to_string()
        } else {
            written.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", ")
        }
    )]
    NotDrawn {
        /// Each failure, `<figure>: <error with its causes>`.
        failures: Vec<String>,
        /// How many figures were asked for.
        total: usize,
        /// The files that were written.
        written: Vec<PathBuf>,
    },
}

/// Shorthand for results of this crate.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// The error and its causes, `: `-separated (what `anyhow`'s `{:#}` prints).
    pub fn chain(&self) -> String {
        schema::error_chain(self)
    }
}

/// `return Err(Error::<variant>(format!(…)))`.
macro_rules! fail {
    ($variant:ident, $($arg:tt)*) => {
        return Err($crate::Error::$variant(format!($($arg)*)))
    };
}
pub(crate) use fail;
