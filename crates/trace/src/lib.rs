//! Mooncake-format request traces for kvroute: parse one, derive its sessions, and map it to a
//! replay plan whose prompt texts are generated on demand from the trace's block hash ids.
//!
//! A Mooncake trace (kvcache-ai/Mooncake, `FAST25-release/traces/*.jsonl` and the earlier
//! `mooncake_trace.jsonl`) has one JSON object per line: `timestamp` (ms from the trace start),
//! `input_length` and `output_length` (tokens) and `hash_ids`, the prompt as a chain of 512-token
//! blocks; two requests that share a leading run of ids share that prefix. Other fields are
//! ignored.
//!
//! - [`parse`]: [`Trace`] from bytes or a reader; a malformed line is reported as `source:line:
//!   why` and the whole trace is refused.
//! - [`session`]: the session rule ([`Sessions`]) — which requests belong to one conversation.
//! - [`replay`]: [`ReplaySpec`] (block size B, time scale, slice) → [`ReplayPlan`] (arrival
//!   times, sessions, turns, prompt lengths, `max_tokens`, names and fingerprints).
//! - [`text`]: each hash id's deterministic block of English-like text, and a request's prompt
//!   assembled from its blocks.
//! - [`stats`]: what a trace's sharing structure looks like ([`TraceStats`]).
//! - [`generate`]: [`SharedPrefix`], the single-turn shared-prefix workload as a Mooncake-format
//!   trace, sent as a staged load ladder ([`Stage`]).
//! - [`file`]: [`ReplayFile`], the replay's parameters on disk (what a sweep hands the driver).
//!
//! Pure: no I/O, no clock, no async. Reading the file is the caller's job.

pub mod file;
pub mod generate;
pub mod parse;
pub mod replay;
pub mod session;
pub mod stats;
pub mod text;

pub use file::ReplayFile;
pub use generate::{SharedPrefix, Stage};
pub use parse::{LineError, Record, TRACE_BLOCK_TOKENS, Trace};
pub use replay::{ReplayPlan, ReplayRequest, ReplaySpec, StageRun};
pub use session::{SessionKey, Sessions};
pub use stats::TraceStats;

/// Why a trace could not be read or mapped.
#[derive(Debug, Clone, PartialEq)]
pub enum TraceError {
    /// Lines that are not valid trace records; the trace is refused as a whole.
    Malformed {
        /// The trace's name (its path, as the caller gave it).
        source: String,
        /// The first few malformed lines, in file order.
        errors: Vec<LineError>,
        /// How many lines were malformed in all.
        total: usize,
    },
    /// Reading the input failed.
    Read {
        /// The trace's name.
        source: String,
        /// What failed.
        why: String,
    },
    /// The trace holds no request.
    Empty {
        /// The trace's name.
        source: String,
    },
    /// A replay parameter is out of range, or the slice selects no request.
    Spec(String),
}

impl std::fmt::Display for TraceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TraceError::Malformed {
                source,
                errors,
                total,
            } => {
                for (i, e) in errors.iter().enumerate() {
                    if i > 0 {
                        writeln!(f)?;
                    }
                    write!(f, "{source}:{}: {}", e.line, e.why)?;
                }
                if *total > errors.len() {
                    write!(
                        f,
                        "\n{source}: … and {} more malformed lines ({total} in all)",
                        total - errors.len()
                    )?;
                }
                Ok(())
            }
            TraceError::Read { source, why } => write!(f, "{source}: cannot read the trace: {why}"),
            TraceError::Empty { source } => write!(f, "{source}: the trace holds no request"),
            TraceError::Spec(m) => write!(f, "trace replay: {m}"),
        }
    }
}

impl std::error::Error for TraceError {}
