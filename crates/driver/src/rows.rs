//! `client.csv`: one row per request (docs/CONTRACTS.md; the columns are `schema::CLIENT_COLUMNS`).
//!
//! Rows are appended to `<out>.partial` as requests finish (flushed per row, so a crashed or
//! running experiment can be inspected) and the file is renamed to `<out>` when the run ends:
//! a reader that sees `client.csv` sees a complete run.

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};

use schema::CLIENT_COLUMNS;
use serde::Deserialize;

use crate::DriverError;

/// One request's outcome. Times in `_s` are seconds since the driver's clock start.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
pub struct ClientRow {
    /// `x-request-id` sent.
    pub request_id: String,
    /// `x-session-id` sent (one per conversation).
    pub session_id: String,
    /// Turn within the conversation, 1-based.
    pub turn: u32,
    /// When the plan said to send (open loop: the arrival; closed loop: end of think time).
    pub scheduled_s: Option<f64>,
    /// When the request was handed to the connection.
    pub sent_s: Option<f64>,
    /// Arrival of the first content token.
    pub first_token_s: Option<f64>,
    /// Arrival of the last content token.
    pub last_s: Option<f64>,
    /// Time to first token.
    pub ttft_ms: Option<f64>,
    /// Median per-token inter-chunk gap.
    pub itl_p50_ms: Option<f64>,
    /// Time per output token after the first.
    pub tpot_ms: Option<f64>,
    /// Send to end of response (or to the failure).
    pub e2el_ms: Option<f64>,
    /// From the usage chunk.
    pub prompt_tokens: Option<u64>,
    /// From the usage chunk, else counted from chunks.
    pub output_tokens: Option<u64>,
    /// Engine-reported cached prompt tokens; empty when the server did not report them.
    pub cached_tokens: Option<u64>,
    /// HTTP status; 0 when no response arrived.
    pub status: u16,
    /// Empty on success, else `kind: message`.
    pub error: String,
    /// 1 when sent inside the warm-up window.
    pub warmup: u8,
    /// `sent_s − scheduled_s`, in milliseconds.
    pub send_lag_ms: Option<f64>,
    /// Content chunks received.
    pub chunks: u32,
}

impl ClientRow {
    /// True when the request succeeded.
    pub fn is_ok(&self) -> bool {
        self.error.is_empty()
    }

    /// The error kind (`connect`, `timeout`, …), empty on success.
    pub fn error_kind(&self) -> &str {
        self.error.split(':').next().unwrap_or("").trim()
    }

    /// The row's fields, in [`CLIENT_COLUMNS`] order.
    fn record(&self) -> [String; CLIENT_COLUMNS.len()] {
        fn f(v: Option<f64>, decimals: usize) -> String {
            v.map(|x| format!("{x:.decimals$}")).unwrap_or_default()
        }
        fn u(v: Option<u64>) -> String {
            v.map(|x| x.to_string()).unwrap_or_default()
        }
        [
            self.request_id.clone(),
            self.session_id.clone(),
            self.turn.to_string(),
            f(self.scheduled_s, 6),
            f(self.sent_s, 6),
            f(self.first_token_s, 6),
            f(self.last_s, 6),
            f(self.ttft_ms, 3),
            f(self.itl_p50_ms, 3),
            f(self.tpot_ms, 3),
            f(self.e2el_ms, 3),
            u(self.prompt_tokens),
            u(self.output_tokens),
            u(self.cached_tokens),
            self.status.to_string(),
            self.error.replace(['\n', '\r'], " "),
            self.warmup.to_string(),
            f(self.send_lag_ms, 3),
            self.chunks.to_string(),
        ]
    }
}

/// Writes rows incrementally to `<out>.partial`, renamed to `<out>` by [`RowWriter::finish`].
pub struct RowWriter {
    csv: csv::Writer<BufWriter<File>>,
    partial: PathBuf,
    out: PathBuf,
}

/// The incremental file's path for a final path.
pub fn partial_path(out: &Path) -> PathBuf {
    let mut name = out.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    out.with_file_name(name)
}

impl RowWriter {
    /// Creates `<out>.partial` and writes the header.
    pub fn create(out: &Path) -> Result<Self, DriverError> {
        let io = |e: std::io::Error| DriverError::Io(format!("{}: {e}", out.display()));
        if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let partial = partial_path(out);
        let file = File::create(&partial).map_err(io)?;
        let mut csv = csv::Writer::from_writer(BufWriter::new(file));
        csv.write_record(CLIENT_COLUMNS)
            .map_err(|e| DriverError::Io(e.to_string()))?;
        csv.flush().map_err(io)?;
        Ok(Self {
            csv,
            partial,
            out: out.to_path_buf(),
        })
    }

    /// Appends one row and flushes it to the file.
    pub fn write(&mut self, row: &ClientRow) -> Result<(), DriverError> {
        self.csv
            .write_record(row.record())
            .map_err(|e| DriverError::Io(e.to_string()))?;
        self.csv
            .flush()
            .map_err(|e| DriverError::Io(format!("{}: {e}", self.partial.display())))
    }

    /// Syncs the file and renames it to its final name.
    pub fn finish(self) -> Result<PathBuf, DriverError> {
        let io = |e: std::io::Error| DriverError::Io(e.to_string());
        let file = self
            .csv
            .into_inner()
            .map_err(|e| DriverError::Io(e.to_string()))?
            .into_inner()
            .map_err(|e| DriverError::Io(e.to_string()))?;
        file.sync_all().map_err(io)?;
        drop(file);
        std::fs::rename(&self.partial, &self.out).map_err(io)?;
        Ok(self.out)
    }
}

/// Reads a `client.csv` (or its `.partial`).
pub fn read_rows(path: &Path) -> Result<Vec<ClientRow>, DriverError> {
    let mut reader = csv::Reader::from_path(path)
        .map_err(|e| DriverError::Io(format!("{}: {e}", path.display())))?;
    let header = reader
        .headers()
        .map_err(|e| DriverError::Io(e.to_string()))?
        .clone();
    if header
        .iter()
        .take(CLIENT_COLUMNS.len())
        .ne(CLIENT_COLUMNS.iter().copied())
    {
        return Err(DriverError::Io(format!(
            "{}: header is not client.csv's",
            path.display()
        )));
    }
    reader
        .deserialize()
        .map(|r| r.map_err(|e| DriverError::Io(format!("{}: {e}", path.display()))))
        .collect()
}
