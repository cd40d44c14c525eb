//! Strict readers for `client.csv` (driver) and `router.csv` (router), columns as pinned in
//! docs/CONTRACTS.md and defined once in `schema::rows` (re-exported here). Columns are found by
//! header name, so added columns at the end are ignored; a missing column, a short or long row,
//! an unparsable value, a duplicate `request_id` or a file cut off mid-line is an error naming the
//! file and the 1-based line (header = line 1).

use std::path::Path;

use ahash::AHashMap;

pub use schema::rows::{CLIENT_COLUMNS, ROUTER_COLUMNS};

use crate::error::{AnalysisError, Result};

/// One request as the driver saw it (`client.csv`).
#[derive(Debug, Clone, PartialEq)]
pub struct ClientRow {
    /// Request id (joins with the router row).
    pub request_id: String,
    /// Conversation id sent as `x-session-id`.
    pub session_id: Option<String>,
    /// Turn index within its conversation, as the driver numbers it.
    pub turn: u32,
    /// When the plan wanted the request sent (driver clock, s).
    pub scheduled_s: Option<f64>,
    /// When it was sent (driver clock, s).
    pub sent_s: Option<f64>,
    /// First content token (driver clock, s).
    pub first_token_s: Option<f64>,
    /// Last byte of the response (driver clock, s).
    pub last_s: Option<f64>,
    /// Time to first content token, ms.
    pub ttft_ms: Option<f64>,
    /// Median inter-token gap of this request, ms per token.
    pub itl_p50_ms: Option<f64>,
    /// (last − first) / (tokens − 1), ms.
    pub tpot_ms: Option<f64>,
    /// End-to-end latency, ms.
    pub e2el_ms: Option<f64>,
    /// Prompt tokens from the final usage chunk.
    pub prompt_tokens: Option<u64>,
    /// Generated tokens.
    pub output_tokens: Option<u64>,
    /// Engine-reported cached prompt tokens.
    pub cached_tokens: Option<u64>,
    /// HTTP status, 0 when no response arrived.
    pub status: u16,
    /// `kind: message` on failure, `None` on success.
    pub error: Option<String>,
    /// Sent inside the warm-up window.
    pub warmup: bool,
    /// How late the send was against the plan, ms.
    pub send_lag_ms: Option<f64>,
    /// SSE content chunks received.
    pub chunks: Option<u64>,
}

/// One routing decision as the router recorded it (`router.csv`).
#[derive(Debug, Clone, PartialEq)]
pub struct RouterRow {
    /// Request id (joins with the client row).
    pub request_id: String,
    /// Conversation id from `x-session-id`.
    pub session_id: Option<String>,
    /// Arrival at the router (router clock, s).
    pub arrival_s: f64,
    /// Policy name.
    pub policy: String,
    /// Replica that served the request; `None` when none was eligible.
    pub replica: Option<u32>,
    /// Decision branch (`match`, `spill-load`, …).
    pub branch: Option<String>,
    /// Tokens the policy believed cached on the chosen replica.
    pub predicted_match_tokens: Option<u64>,
    /// Outstanding requests on the chosen replica at decision time.
    pub outstanding_chosen: Option<u32>,
    /// Lowest outstanding count across eligible replicas at decision time.
    pub outstanding_min: Option<u32>,
    /// Time inside `Policy::decide`, ns.
    pub decide_ns: Option<u64>,
    /// Router overhead (arrival → upstream write, plus upstream first byte → client first byte), µs.
    pub overhead_us: Option<f64>,
    /// Tokenize round trip before routing (exact residency), ms.
    pub tokenize_ms: Option<f64>,
    /// Upstream HTTP status.
    pub upstream_status: Option<u16>,
    /// Engine-reported cached tokens parsed from the usage chunk in passing.
    pub cached_tokens: Option<u64>,
    /// Engine-reported prompt tokens parsed from the usage chunk in passing.
    pub prompt_tokens: Option<u64>,
    /// Router-side error, `None` on success.
    pub error: Option<String>,
    /// Upstream attempts (retries + 1).
    pub attempts: Option<u32>,
}

/// A column's position in the file's header, with its name for messages.
#[derive(Debug, Clone, Copy)]
struct Col {
    pos: usize,
    name: &'static str,
}

/// Declares the columns a rows file must carry: a struct of resolved positions (looked up once
/// per file, so reading a row is indexing, not hashing names). The fields are named after the
/// columns, and a compile-time check holds them to the schema's list, in order.
macro_rules! columns {
    ($schema:path, $cols:ident { $($field:ident),* $(,)? }) => {
        const _: () = assert!(
            schema::rows::same_columns(&[$(stringify!($field)),*], &$schema),
            concat!(stringify!($cols), " must name the columns of ", stringify!($schema), ", in order")
        );

        struct $cols {
            $($field: Col,)*
        }

        impl $cols {
            fn resolve(path: &Path, header: &csv::StringRecord) -> Result<Self> {
                Ok($cols {
                    $($field: find(path, header, stringify!($field))?,)*
                })
            }
        }
    };
}

fn find(path: &Path, header: &csv::StringRecord, name: &'static str) -> Result<Col> {
    header
        .iter()
        .position(|h| h == name)
        .map(|pos| Col { pos, name })
        .ok_or_else(|| AnalysisError::rows(path, 1, format!("header lacks the column `{name}`")))
}

columns!(
    CLIENT_COLUMNS,
    ClientCols {
        request_id,
        session_id,
        turn,
        scheduled_s,
        sent_s,
        first_token_s,
        last_s,
        ttft_ms,
        itl_p50_ms,
        tpot_ms,
        e2el_ms,
        prompt_tokens,
        output_tokens,
        cached_tokens,
        status,
        error,
        warmup,
        send_lag_ms,
        chunks,
    }
);

columns!(
    ROUTER_COLUMNS,
    RouterCols {
        request_id,
        session_id,
        arrival_s,
        policy,
        replica,
        branch,
        predicted_match_tokens,
        outstanding_chosen,
        outstanding_min,
        decide_ns,
        overhead_us,
        tokenize_ms,
        upstream_status,
        cached_tokens,
        prompt_tokens,
        error,
        attempts,
    }
);

/// A parsed record with its file and line, and typed accessors that turn a bad value into an
/// error naming both.
struct Fields<'a> {
    path: &'a Path,
    line: u64,
    record: &'a csv::StringRecord,
}

impl Fields<'_> {
    fn raw(&self, col: Col) -> &str {
        // The record has as many fields as the header (the reader is not flexible).
        self.record.get(col.pos).unwrap_or("")
    }

    fn err(&self, col: Col, msg: impl std::fmt::Display) -> AnalysisError {
        AnalysisError::rows(
            self.path,
            self.line,
            format!("column `{}`: {msg}", col.name),
        )
    }

    fn string(&self, col: Col) -> Result<String> {
        let v = self.raw(col);
        if v.is_empty() {
            return Err(self.err(col, "empty, but a value is required"));
        }
        Ok(v.to_string())
    }

    fn opt_string(&self, col: Col) -> Option<String> {
        let v = self.raw(col);
        (!v.is_empty()).then(|| v.to_string())
    }

    fn opt_f64(&self, col: Col) -> Result<Option<f64>> {
        let v = self.raw(col);
        if v.is_empty() {
            return Ok(None);
        }
        match v.parse::<f64>() {
            Ok(x) if x.is_finite() => Ok(Some(x)),
            _ => Err(self.err(col, format!("`{v}` is not a finite number"))),
        }
    }

    fn f64(&self, col: Col) -> Result<f64> {
        self.opt_f64(col)?
            .ok_or_else(|| self.err(col, "empty, but a value is required"))
    }

    fn opt_uint<T: std::str::FromStr>(&self, col: Col) -> Result<Option<T>> {
        let v = self.raw(col);
        if v.is_empty() {
            return Ok(None);
        }
        v.parse::<T>()
            .map(Some)
            .map_err(|_| self.err(col, format!("`{v}` is not a non-negative integer")))
    }

    fn uint<T: std::str::FromStr>(&self, col: Col) -> Result<T> {
        self.opt_uint(col)?
            .ok_or_else(|| self.err(col, "empty, but a value is required"))
    }

    fn flag(&self, col: Col) -> Result<bool> {
        match self.raw(col) {
            "0" => Ok(false),
            "1" => Ok(true),
            v => Err(self.err(col, format!("`{v}` is not 0 or 1"))),
        }
    }
}

/// Reads a file's bytes, decompressing it when its name ends in `.gz` (published rows in
/// `docs/measurements` are stored compressed to keep the repository small).
fn read_maybe_gzip(path: &Path) -> Result<Vec<u8>> {
    let raw = std::fs::read(path).map_err(|e| AnalysisError::io(path, e))?;
    if path.extension().is_some_and(|e| e == "gz") {
        let mut out = Vec::with_capacity(raw.len() * 4);
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(raw.as_slice()), &mut out)
            .map_err(|e| AnalysisError::io(path, e))?;
        Ok(out)
    } else {
        Ok(raw)
    }
}

/// Finds a rows file in a repetition directory: `<name>` as written by a sweep, else
/// `<name>.gz` as published.
pub fn rows_file(dir: &Path, name: &str) -> Option<std::path::PathBuf> {
    let plain = dir.join(name);
    if plain.exists() {
        return Some(plain);
    }
    let gz = dir.join(format!("{name}.gz"));
    gz.exists().then_some(gz)
}

/// Reads a rows file strictly: `cols` resolves the header, `parse` turns each record (with its
/// line) into a row.
fn read_rows<T, C>(
    path: &Path,
    cols: impl Fn(&Path, &csv::StringRecord) -> Result<C>,
    id_of: impl Fn(&T) -> &str,
    parse: impl Fn(&C, &Fields<'_>) -> Result<T>,
) -> Result<Vec<T>> {
    let bytes = read_maybe_gzip(path)?;
    if bytes.is_empty() {
        return Err(AnalysisError::rows(path, 1, "empty file: no header"));
    }
    // Writers end every record with a newline; a last line without one was cut off mid-write
    // (a killed process, a full disk), and its last value may look valid while being short.
    if !bytes.ends_with(b"\n") {
        let line = bytes.iter().filter(|&&b| b == b'\n').count() as u64 + 1;
        return Err(AnalysisError::rows(
            path,
            line,
            "truncated: the last line has no line terminator",
        ));
    }
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(true)
        .flexible(false)
        .from_reader(bytes.as_slice());
    let header = reader
        .headers()
        .map_err(|e| AnalysisError::rows(path, 1, format!("bad header: {e}")))?
        .clone();
    let c = cols(path, &header)?;
    let mut out: Vec<T> = Vec::new();
    let mut lines: Vec<u64> = Vec::new();
    let mut record = csv::StringRecord::new();
    loop {
        let line = reader.position().line();
        match reader.read_record(&mut record) {
            Ok(false) => break,
            Ok(true) => {}
            Err(e) => {
                let line = e.position().map(|p| p.line()).unwrap_or(line);
                let message = match e.kind() {
                    csv::ErrorKind::UnequalLengths {
                        expected_len, len, ..
                    } => format!(
                        "row has {len} fields, the header has {expected_len} (short, long or truncated row)"
                    ),
                    _ => e.to_string(),
                };
                return Err(AnalysisError::rows(path, line, message));
            }
        }
        let line = record.position().map(|p| p.line()).unwrap_or(line);
        let fields = Fields {
            path,
            line,
            record: &record,
        };
        out.push(parse(&c, &fields)?);
        lines.push(line);
    }
    let mut seen: AHashMap<&str, u64> = AHashMap::with_capacity(out.len());
    for (row, &line) in out.iter().zip(&lines) {
        if let Some(first) = seen.insert(id_of(row), line) {
            return Err(AnalysisError::rows(
                path,
                line,
                format!(
                    "duplicate request_id `{}` (first on line {first})",
                    id_of(row)
                ),
            ));
        }
    }
    Ok(out)
}

/// Reads a driver's `client.csv`.
pub fn read_client_csv(path: &Path) -> Result<Vec<ClientRow>> {
    read_rows(
        path,
        ClientCols::resolve,
        |r: &ClientRow| &r.request_id,
        |c, f| {
            Ok(ClientRow {
                request_id: f.string(c.request_id)?,
                session_id: f.opt_string(c.session_id),
                turn: f.uint(c.turn)?,
                scheduled_s: f.opt_f64(c.scheduled_s)?,
                sent_s: f.opt_f64(c.sent_s)?,
                first_token_s: f.opt_f64(c.first_token_s)?,
                last_s: f.opt_f64(c.last_s)?,
                ttft_ms: f.opt_f64(c.ttft_ms)?,
                itl_p50_ms: f.opt_f64(c.itl_p50_ms)?,
                tpot_ms: f.opt_f64(c.tpot_ms)?,
                e2el_ms: f.opt_f64(c.e2el_ms)?,
                prompt_tokens: f.opt_uint(c.prompt_tokens)?,
                output_tokens: f.opt_uint(c.output_tokens)?,
                cached_tokens: f.opt_uint(c.cached_tokens)?,
                status: f.uint(c.status)?,
                error: f.opt_string(c.error),
                warmup: f.flag(c.warmup)?,
                send_lag_ms: f.opt_f64(c.send_lag_ms)?,
                chunks: f.opt_uint(c.chunks)?,
            })
        },
    )
}

/// Reads a router's `router.csv`.
pub fn read_router_csv(path: &Path) -> Result<Vec<RouterRow>> {
    read_rows(
        path,
        RouterCols::resolve,
        |r: &RouterRow| &r.request_id,
        |c, f| {
            Ok(RouterRow {
                request_id: f.string(c.request_id)?,
                session_id: f.opt_string(c.session_id),
                arrival_s: f.f64(c.arrival_s)?,
                policy: f.string(c.policy)?,
                replica: f.opt_uint(c.replica)?,
                branch: f.opt_string(c.branch),
                predicted_match_tokens: f.opt_uint(c.predicted_match_tokens)?,
                outstanding_chosen: f.opt_uint(c.outstanding_chosen)?,
                outstanding_min: f.opt_uint(c.outstanding_min)?,
                decide_ns: f.opt_uint(c.decide_ns)?,
                overhead_us: f.opt_f64(c.overhead_us)?,
                tokenize_ms: f.opt_f64(c.tokenize_ms)?,
                upstream_status: f.opt_uint(c.upstream_status)?,
                cached_tokens: f.opt_uint(c.cached_tokens)?,
                prompt_tokens: f.opt_uint(c.prompt_tokens)?,
                error: f.opt_string(c.error),
                attempts: f.opt_uint(c.attempts)?,
            })
        },
    )
}
