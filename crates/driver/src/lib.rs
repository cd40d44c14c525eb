//! Load drivers for kvroute: replay a [`workload::Plan`] against any OpenAI-compatible server
//! (the router, one replica, or real vLLM) and write one `client.csv` row per request.
//!
//! - [`run_closed`] / [`run_open`] / [`run`] / [`run_blocking`]: the library API the sweep calls.
//! - [`run_replay`]: a Mooncake-format trace replayed open loop ([`replay`]).
//! - [`client::Requester`]: one streaming request, timed per chunk on a monotonic clock.
//! - [`sse`], [`chunk`], [`metrics`]: incremental SSE parsing, chunk interpretation and the
//!   TTFT / ITL / TPOT definitions (pure, unit-tested).
//! - [`rows`]: the `client.csv` row (columns: `schema::CLIENT_COLUMNS`), incremental writer with
//!   atomic finish, reader.

pub mod chunk;
pub mod client;
pub mod metrics;
pub mod replay;
pub mod rows;
pub mod run;
pub mod sse;
pub mod testserver;

pub use replay::{load_replay, load_replay_file, run_replay, run_replay_blocking};
pub use rows::{ClientRow, read_rows};
pub use run::{
    ProgressMode, Quantiles, RunConfig, RunSummary, run, run_blocking, run_closed, run_open,
};

/// Why a run could not start or finish. Failures of single requests are rows, not errors.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// The URL is not a usable `http://HOST:PORT` base.
    #[error("bad server URL {0}")]
    BadUrl(String),
    /// Nothing answered at the URL.
    #[error(
        "cannot reach {url}: {why} (is the server running, and is the URL its base, e.g. http://127.0.0.1:8000?)"
    )]
    Unreachable {
        /// The base URL tried.
        url: String,
        /// The underlying failure.
        why: String,
    },
    /// Something answered, but not like an OpenAI-compatible server.
    #[error("{url} does not look like an OpenAI-compatible server: {why}")]
    NotOpenAi {
        /// The URL that answered.
        url: String,
        /// What was wrong with the answer.
        why: String,
    },
    /// The plan cannot be run.
    #[error("plan: {0}")]
    Plan(String),
    /// A run parameter is out of range.
    #[error("config: {0}")]
    Config(String),
    /// Files or runtime.
    #[error("i/o: {0}")]
    Io(String),
}
