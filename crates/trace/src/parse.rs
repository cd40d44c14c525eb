//! Parsing a Mooncake-format JSONL trace.
//!
//! Every line must be one JSON object with `timestamp` (a number of milliseconds ≥ 0),
//! `input_length` (tokens ≥ 1), `output_length` (tokens ≥ 0) and `hash_ids` (a non-empty array of
//! non-negative integers) whose length agrees with `input_length` at 512 tokens a block:
//! `(n − 1) × 512 < input_length ≤ n × 512`. An optional `stage` (an integer ≥ 0, the ladder
//! stage of a generated trace) is kept. Other fields are ignored, so every Mooncake release
//! with these four fields parses. A line that breaks any rule — including an empty line — is
//! reported as `source:line: why` and the trace is refused; nothing is skipped. Requests are kept
//! in arrival order (a stable sort by timestamp, so equal timestamps keep file order).

use std::io::BufRead;

use serde::Deserialize;
use xxhash_rust::xxh3::{Xxh3Default, xxh3_64};

use crate::TraceError;

/// Tokens per hash block in Mooncake traces.
pub const TRACE_BLOCK_TOKENS: u64 = 512;

/// Malformed lines named in the error; the rest are counted.
const REPORTED_ERRORS: usize = 20;

/// One malformed line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LineError {
    /// 1-based line number.
    pub line: u32,
    /// What is wrong with it.
    pub why: String,
}

/// One request of the trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// 1-based line number in the file.
    pub line: u32,
    /// Arrival, µs from the trace start (the file's milliseconds × 1000).
    pub timestamp_us: u64,
    /// Prompt length, tokens.
    pub input_tokens: u32,
    /// Completion length, tokens.
    pub output_tokens: u32,
    /// The load-ladder stage the line says it belongs to (`"stage"`, a kvroute extension that
    /// generated traces carry: [`crate::generate`]); `None` in Mooncake's own traces.
    pub stage: Option<u32>,
    /// Whether the line's stage starts only when everything before it has ended (`"drain":
    /// true`, the same kvroute extension); false in Mooncake's own traces.
    pub drain: bool,
    ids_start: u32,
    ids_len: u32,
}

/// A parsed trace: its requests in arrival order, their hash ids, and the hash of the file's
/// bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    source: String,
    content_hash: u64,
    records: Vec<Record>,
    ids: Vec<u64>,
}

#[derive(Deserialize)]
struct RawLine {
    timestamp: f64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
    #[serde(default)]
    stage: Option<u32>,
    #[serde(default)]
    drain: bool,
}

/// Line-by-line accumulation shared by the byte and the reader entry points.
struct Parser<'a> {
    source: &'a str,
    line: u32,
    records: Vec<Record>,
    ids: Vec<u64>,
    errors: Vec<LineError>,
    total_errors: usize,
}

impl<'a> Parser<'a> {
    fn new(source: &'a str) -> Self {
        Self {
            source,
            line: 0,
            records: Vec::new(),
            ids: Vec::new(),
            errors: Vec::new(),
            total_errors: 0,
        }
    }

    fn fail(&mut self, why: String) {
        self.total_errors += 1;
        if self.errors.len() < REPORTED_ERRORS {
            self.errors.push(LineError {
                line: self.line,
                why,
            });
        }
    }

    /// One line, with or without its `\n`.
    fn line(&mut self, raw: &[u8]) {
        self.line += 1;
        let raw = raw.strip_suffix(b"\n").unwrap_or(raw);
        let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
        let text = match std::str::from_utf8(raw) {
            Ok(t) => t,
            Err(e) => return self.fail(format!("not UTF-8 text ({e})")),
        };
        if text.trim().is_empty() {
            return self.fail("empty line (a trace has one JSON object per line)".into());
        }
        let r: RawLine = match serde_json::from_str(text) {
            Ok(r) => r,
            Err(e) => return self.fail(format!("not a trace record: {e}")),
        };
        if let Err(why) = self.check(&r) {
            return self.fail(why);
        }
        let (Ok(ids_start), Ok(ids_len)) = (
            u32::try_from(self.ids.len()),
            u32::try_from(r.hash_ids.len()),
        ) else {
            return self.fail("the trace holds more than 2^32 hash ids".into());
        };
        self.records.push(Record {
            line: self.line,
            timestamp_us: (r.timestamp * 1000.0).round() as u64,
            input_tokens: r.input_length as u32,
            output_tokens: r.output_length as u32,
            stage: r.stage,
            drain: r.drain,
            ids_start,
            ids_len,
        });
        self.ids.extend_from_slice(&r.hash_ids);
    }

    fn check(&self, r: &RawLine) -> Result<(), String> {
        // 2^53 ms is far beyond any trace and keeps the µs conversion exact.
        if !(r.timestamp.is_finite() && r.timestamp >= 0.0 && r.timestamp < 9.0e15) {
            return Err(format!(
                "timestamp {} is not a number of milliseconds ≥ 0",
                r.timestamp
            ));
        }
        if r.input_length == 0 || r.input_length > u64::from(u32::MAX) {
            return Err(format!(
                "input_length {} is not a prompt length in 1..=2^32-1 tokens",
                r.input_length
            ));
        }
        if r.output_length > u64::from(u32::MAX) {
            return Err(format!("output_length {} is too large", r.output_length));
        }
        let n = r.hash_ids.len() as u64;
        if n == 0 {
            return Err("hash_ids is empty".into());
        }
        if !((n - 1) * TRACE_BLOCK_TOKENS < r.input_length
            && r.input_length <= n * TRACE_BLOCK_TOKENS)
        {
            return Err(format!(
                "{n} hash_ids do not cover input_length {} at {TRACE_BLOCK_TOKENS} tokens a block \
                 (expected {} to {} tokens)",
                r.input_length,
                (n - 1) * TRACE_BLOCK_TOKENS + 1,
                n * TRACE_BLOCK_TOKENS
            ));
        }
        Ok(())
    }

    fn finish(mut self, content_hash: u64) -> Result<Trace, TraceError> {
        if self.total_errors > 0 {
            return Err(TraceError::Malformed {
                source: self.source.to_string(),
                errors: self.errors,
                total: self.total_errors,
            });
        }
        if self.records.is_empty() {
            return Err(TraceError::Empty {
                source: self.source.to_string(),
            });
        }
        // Stable: equal timestamps keep file order.
        self.records.sort_by_key(|r| r.timestamp_us);
        Ok(Trace {
            source: self.source.to_string(),
            content_hash,
            records: self.records,
            ids: self.ids,
        })
    }
}

impl Trace {
    /// Parses a whole trace held in memory. `source` names it in errors (its path).
    pub fn parse_bytes(source: &str, bytes: &[u8]) -> Result<Trace, TraceError> {
        let mut p = Parser::new(source);
        for line in bytes.split_inclusive(|&b| b == b'\n') {
            p.line(line);
        }
        p.finish(xxh3_64(bytes))
    }

    /// Parses a trace line by line from `reader`, hashing the bytes as they pass (the same hash
    /// as [`Trace::parse_bytes`] of the whole input).
    pub fn parse_reader<R: BufRead>(source: &str, mut reader: R) -> Result<Trace, TraceError> {
        let mut p = Parser::new(source);
        let mut hasher = Xxh3Default::new();
        let mut buf = Vec::new();
        loop {
            buf.clear();
            let n = reader
                .read_until(b'\n', &mut buf)
                .map_err(|e| TraceError::Read {
                    source: source.to_string(),
                    why: e.to_string(),
                })?;
            if n == 0 {
                break;
            }
            hasher.update(&buf);
            p.line(&buf);
        }
        p.finish(hasher.digest())
    }

    /// The name the trace was parsed under.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// xxh3-64 of the file's bytes.
    pub fn content_hash(&self) -> u64 {
        self.content_hash
    }

    /// [`Trace::content_hash`] as 16 lowercase hex digits.
    pub fn content_hash_hex(&self) -> String {
        format!("{:016x}", self.content_hash)
    }

    /// The requests, in arrival order.
    pub fn records(&self) -> &[Record] {
        &self.records
    }

    /// Number of requests.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether the trace holds no request (never true for a parsed trace).
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The hash ids of `record`'s prompt blocks.
    pub fn hash_ids(&self, record: &Record) -> &[u64] {
        let start = record.ids_start as usize;
        &self.ids[start..start + record.ids_len as usize]
    }

    /// Last arrival, µs from the trace start.
    pub fn span_us(&self) -> u64 {
        self.records.last().map_or(0, |r| r.timestamp_us)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = concat!(
        r#"{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [0, 1]}"#,
        "\n",
        r#"{"timestamp": 1500, "input_length": 1024, "output_length": 3, "hash_ids": [0, 1], "extra": {"a": 1}}"#,
        "\r\n",
        r#"{"hash_ids": [0, 2], "output_length": 0, "input_length": 513, "timestamp": 750.5}"#,
        "\n",
    );

    #[test]
    fn good_lines_parse_in_arrival_order_and_extra_fields_are_ignored() {
        let t = Trace::parse_bytes("t.jsonl", GOOD.as_bytes()).unwrap();
        assert_eq!(t.len(), 3);
        let lines: Vec<u32> = t.records().iter().map(|r| r.line).collect();
        assert_eq!(lines, [1, 3, 2], "sorted by timestamp, stable");
        let r = t.records()[1];
        assert_eq!(
            (r.timestamp_us, r.input_tokens, r.output_tokens),
            (750_500, 513, 0)
        );
        assert_eq!(t.hash_ids(&r), [0, 2]);
        assert_eq!(t.span_us(), 1_500_000);
        assert_eq!(t.content_hash(), xxh3_64(GOOD.as_bytes()));
        // The reader path reads the same trace and hashes the same bytes.
        let via_reader = Trace::parse_reader("t.jsonl", GOOD.as_bytes()).unwrap();
        assert_eq!(via_reader, t);
    }

    #[test]
    fn a_last_line_without_newline_is_a_line() {
        let text = GOOD.trim_end();
        let t = Trace::parse_reader("t", text.as_bytes()).unwrap();
        assert_eq!(t.len(), 3);
        assert_eq!(t.content_hash(), xxh3_64(text.as_bytes()));
    }

    #[test]
    fn malformed_lines_are_named_by_source_and_line_and_refuse_the_trace() {
        let bad = [
            (
                r#"{"timestamp": 0, "input_length": 600, "output_length": 1}"#,
                "missing field `hash_ids`",
            ),
            (
                r#"{"timestamp": -1, "input_length": 600, "output_length": 1, "hash_ids": [0, 1]}"#,
                "timestamp -1",
            ),
            (
                r#"{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [0]}"#,
                "input_length 0",
            ),
            (
                r#"{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": []}"#,
                "hash_ids is empty",
            ),
            (
                r#"{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1]}"#,
                "2 hash_ids do not cover input_length 1100",
            ),
            (
                r#"{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [0, 1]}"#,
                "expected 513 to 1024 tokens",
            ),
            (
                r#"{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0, -1]}"#,
                "not a trace record",
            ),
            (r#"[1, 2, 3]"#, "not a trace record"),
            ("", "empty line"),
            (
                r#"{"timestamp": 0, "input_length": 600"#,
                "not a trace record",
            ),
        ];
        for (line, why) in bad {
            let text = format!("{}\n{line}\n", GOOD.lines().next().unwrap());
            let err = Trace::parse_bytes("dir/t.jsonl", text.as_bytes()).unwrap_err();
            let msg = err.to_string();
            assert!(msg.starts_with("dir/t.jsonl:2: "), "{line:?} → {msg}");
            assert!(msg.contains(why), "{line:?} → {msg}");
            assert_eq!(
                Trace::parse_reader("dir/t.jsonl", text.as_bytes()).unwrap_err(),
                err
            );
        }
        let err = Trace::parse_bytes("t", b"\xff\xfe\n").unwrap_err();
        assert!(err.to_string().starts_with("t:1: not UTF-8"), "{err}");
    }

    #[test]
    fn every_malformed_line_is_counted_and_the_first_ones_named() {
        let mut text = String::new();
        for i in 0..30 {
            if i % 2 == 0 {
                text.push_str(GOOD.lines().next().unwrap());
            } else {
                text.push_str("{}");
            }
            text.push('\n');
        }
        let TraceError::Malformed { errors, total, .. } =
            Trace::parse_bytes("t", text.as_bytes()).unwrap_err()
        else {
            panic!("not a malformed-line error")
        };
        assert_eq!(total, 15);
        assert_eq!(errors.len(), 15);
        assert_eq!(errors[0].line, 2);
        assert_eq!(errors[14].line, 30);
        let mut many = String::new();
        for _ in 0..25 {
            many.push_str("{}\n");
        }
        let err = Trace::parse_bytes("t", many.as_bytes()).unwrap_err();
        let msg = err.to_string();
        assert_eq!(msg.lines().count(), REPORTED_ERRORS + 1, "{msg}");
        assert!(
            msg.ends_with("t: … and 5 more malformed lines (25 in all)"),
            "{msg}"
        );
    }

    #[test]
    fn an_empty_trace_is_refused() {
        assert_eq!(
            Trace::parse_bytes("t", b"").unwrap_err(),
            TraceError::Empty { source: "t".into() }
        );
    }
}
