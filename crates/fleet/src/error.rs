//! The crate's one error type. Every variant names what failed — the replica, the process and
//! its log, the file, the URL — as the messages always have (the README's "Errors name the
//! replica and its log"); the variant says what kind of failure it was.
//!
//! Not here: what the GPU backend could not read (`gpu::GpuReading`'s `Err(String)`s, a device
//! list that failed). Those are readings, kept and cloned as data and written into
//! `evidence.jsonl` as reasons, not failures of a call.

use std::path::PathBuf;

/// Why a fleet, ingress, driver or evidence operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file or directory could not be created, opened, read or written.
    #[error("{action} {}", path.display())]
    Io {
        /// What was being done: "creating", "opening log file", "reading", …
        action: &'static str,
        /// The path.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// A process or thread could not be started or waited on; `what` names it (and its log).
    #[error("{what}")]
    Spawn {
        /// What was being started ("replica 0: cannot start `engine` (log …)").
        what: String,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// A local socket operation failed (picking a free port, HAProxy's stats socket).
    #[error("{what}")]
    Socket {
        /// What was being done.
        what: String,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// The CPU spinners of `FleetOptions::keep_cpus_awake` could not be started.
    #[error("keeping the CPUs awake (SCHED_IDLE)")]
    KeepAwake {
        /// The underlying error.
        source: std::io::Error,
    },
    /// An HTTP request got no answer (connection refused, timeout, a broken body).
    #[error("{request}")]
    Http {
        /// The request: `GET http://…`, or `reading GET http://…` for a broken body.
        request: String,
        /// The client's error.
        source: Box<ureq::Error>,
    },
    /// A JSON record could not be written.
    #[error("{what}")]
    Json {
        /// What was being written.
        what: String,
        /// The serializer's error.
        source: serde_json::Error,
    },
    /// A line of `evidence.jsonl` could not be written.
    #[error("writing evidence.jsonl")]
    Evidence {
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// A CSV file could not be read or written.
    #[error("{what}")]
    Csv {
        /// The file and what was being done with it.
        what: String,
        /// The CSV error.
        source: csv::Error,
    },
    /// A malformed or unsupported URL.
    #[error("{0}")]
    Url(String),
    /// A wait was interrupted by the caller's `should_stop` (Ctrl-C); the message says what
    /// was being waited for.
    #[error("{0}")]
    Interrupted(String),
    /// A process did not become ready, healthy or finished within its time limit; the message
    /// names it, the limit and its log.
    #[error("{0}")]
    Timeout(String),
    /// A process exited (or closed its stdout) when it should have run on; the message names
    /// it, its exit status and its log.
    #[error("{0}")]
    Exited(String),
    /// A process or endpoint answered something other than what the contract says (a status, a
    /// body without a field, a readiness line without a listener, a rejected config).
    #[error("{0}")]
    Answer(String),
    /// A program or file the harness runs is not installed; the message says how to get it.
    #[error("{0}")]
    NotInstalled(String),
    /// The fleet, a guard or a sampler is not in the state the call needs (already running, no
    /// process, already finished).
    #[error("{0}")]
    State(String),
    /// Invalid settings or input: a fleet or ingress configuration, a policy the fleet cannot
    /// serve, malformed rows.
    #[error("{0}")]
    Invalid(String),
    /// One of this crate's errors with what was being done when it happened ("cycling replica 1
    /// (http://…)").
    #[error("{context}")]
    Context {
        /// What was being done.
        context: String,
        /// The error.
        source: Box<Error>,
    },
}

/// Shorthand for results of this crate.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// The error and its causes, `: `-separated (what `anyhow`'s `{:#}` prints).
    pub fn chain(&self) -> String {
        schema::error_chain(self)
    }

    /// This error with `context` (what was being done) in front of it.
    pub fn context(self, context: impl Into<String>) -> Error {
        Error::Context {
            context: context.into(),
            source: Box::new(self),
        }
    }

    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io {
            action,
            path,
            source,
        }
    }
}

/// `return Err(Error::<variant>(format!(…)))`.
macro_rules! fail {
    ($variant:ident, $($arg:tt)*) => {
        return Err($crate::Error::$variant(format!($($arg)*)))
    };
}
/// `Error::<variant>(format!(…))`.
macro_rules! err {
    ($variant:ident, $($arg:tt)*) => {
        $crate::Error::$variant(format!($($arg)*))
    };
}
pub(crate) use {err, fail};
