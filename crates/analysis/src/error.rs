//! The one error type of the crate: every variant names the file (and line, where there is one)
//! so that a reader can open the offending input directly.

use std::path::PathBuf;

/// Why loading or analysing a sweep failed.
#[derive(Debug, thiserror::Error)]
pub enum AnalysisError {
    /// A file or directory could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The path that failed.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// A rows file is malformed: a bad header, a bad value, a short or truncated row.
    #[error("{path}:{line}: {message}")]
    Rows {
        /// The rows file.
        path: PathBuf,
        /// 1-based line number (the header is line 1).
        line: u64,
        /// What is wrong on that line.
        message: String,
    },
    /// A `meta.json` could not be parsed or holds an impossible value.
    #[error("{path}: {message}")]
    Meta {
        /// The meta file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// A fault run's directory lacks what its summary needs (a point, a complete repetition,
    /// router rows), or its `fault.json` is malformed.
    #[error("{path} {message}")]
    Fault {
        /// The directory or file at fault.
        path: PathBuf,
        /// What is wrong, as a predicate of the path ("has no router.csv").
        message: String,
    },
    /// The sweep directory holds no repetition directories at all.
    #[error("{path}: no `<point>/<policy>/rep-<k>/` directories found")]
    EmptySweep {
        /// The sweep directory.
        path: PathBuf,
    },
}

/// Shorthand for results of this crate.
pub type Result<T> = std::result::Result<T, AnalysisError>;

impl AnalysisError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        AnalysisError::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn rows(path: impl Into<PathBuf>, line: u64, message: impl Into<String>) -> Self {
        AnalysisError::Rows {
            path: path.into(),
            line,
            message: message.into(),
        }
    }

    pub(crate) fn meta(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        AnalysisError::Meta {
            path: path.into(),
            message: message.into(),
        }
    }
}
