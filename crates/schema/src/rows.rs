//! The rows are the system of record: one `client.csv` row per request (the driver, or the
//! simulator on its virtual clock) and one `router.csv` row per routing decision (the router, the
//! endpoint picker, or the simulator). [`ClientRow`] and [`RouterRow`] are those rows, defined
//! once: every writer serializes them and every reader deserializes them (through the `csv`
//! crate, with serde), so a column's type, unit and formatting are decided here and nowhere else.
//! [`CLIENT_COLUMNS`] and [`ROUTER_COLUMNS`] are their headers, in contract order
//! (docs/CONTRACTS.md, "Rows"): the struct fields are declared in that order (a test holds them
//! equal). Columns stay stable; additions go at the end.
//!
//! Units are in the names: `_s` seconds since the writer's own monotonic start (6 decimals),
//! `_ms` milliseconds (3 decimals), `_us`, `_ns` as named (whole numbers). An empty cell is not
//! applicable or unknown (`None`). `warmup` is `0` or `1`.
//!
//! Reading is strict where the analysis depends on a value and lenient where writers have
//! differed: a required cell (`request_id`, `turn`, `status`, `warmup`, `chunks`, `arrival_s`,
//! `policy`, `attempts`) must hold a value; every other cell may be empty; numbers must be finite;
//! an `overhead_us` written with a decimal point (`300.0`, as hand-made fixtures write it) reads
//! when it is whole; extra columns are ignored (by name, so their order is free). A bad cell is an
//! error whose message names the value (`` `abc` is not a finite number ``); the reader adds the
//! file, line and column.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

/// The `error` kind of a client row the driver wrote for a turn it abandoned instead of sending
/// (`driver --abandon-after-ms`): `abandoned: …`. The driver writes it, the analysis counts such a
/// row as a TTFT miss.
pub const ABANDONED_ERROR_KIND: &str = "abandoned";

/// What the router's `upstream` error says when the failed attempt had handed its request to the
/// replica (the body was written to the connection), so it was not retried on another: the
/// replica may have been running it. The router writes it; the fault analysis reads a router
/// answer carrying it, on the killed replica, as a request in flight there.
pub const SENT_NOT_RETRIED: &str = "after the request was sent (not retried";

/// `client.csv` columns, in contract order: [`ClientRow`]'s fields.
pub const CLIENT_COLUMNS: [&str; 19] = [
    "request_id",
    "session_id",
    "turn",
    "scheduled_s",
    "sent_s",
    "first_token_s",
    "last_s",
    "ttft_ms",
    "itl_p50_ms",
    "tpot_ms",
    "e2el_ms",
    "prompt_tokens",
    "output_tokens",
    "cached_tokens",
    "status",
    "error",
    "warmup",
    "send_lag_ms",
    "chunks",
];

/// `router.csv` columns, in contract order: [`RouterRow`]'s fields.
pub const ROUTER_COLUMNS: [&str; 17] = [
    "request_id",
    "session_id",
    "arrival_s",
    "policy",
    "replica",
    "branch",
    "predicted_match_tokens",
    "outstanding_chosen",
    "outstanding_min",
    "decide_ns",
    "overhead_us",
    "tokenize_ms",
    "upstream_status",
    "cached_tokens",
    "prompt_tokens",
    "error",
    "attempts",
];

/// One request as the driver saw it: a `client.csv` row. `_s` times are on the driver's clock.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ClientRow {
    /// `x-request-id` sent (joins with the router row).
    #[serde(deserialize_with = "cell::text")]
    pub request_id: String,
    /// `x-session-id` sent (one per conversation).
    #[serde(deserialize_with = "cell::opt_text")]
    pub session_id: Option<String>,
    /// Turn within its conversation, as the driver numbers it.
    #[serde(deserialize_with = "cell::uint")]
    pub turn: u32,
    /// When the plan said to send (open loop: the arrival; closed loop: end of think time), s.
    #[serde(
        serialize_with = "cell::opt_secs",
        deserialize_with = "cell::opt_float"
    )]
    pub scheduled_s: Option<f64>,
    /// When the request was handed to the connection, s.
    #[serde(
        serialize_with = "cell::opt_secs",
        deserialize_with = "cell::opt_float"
    )]
    pub sent_s: Option<f64>,
    /// Arrival of the first content token, s.
    #[serde(
        serialize_with = "cell::opt_secs",
        deserialize_with = "cell::opt_float"
    )]
    pub first_token_s: Option<f64>,
    /// Arrival of the last content token, s.
    #[serde(
        serialize_with = "cell::opt_secs",
        deserialize_with = "cell::opt_float"
    )]
    pub last_s: Option<f64>,
    /// Time to first content token, ms.
    #[serde(
        serialize_with = "cell::opt_millis",
        deserialize_with = "cell::opt_float"
    )]
    pub ttft_ms: Option<f64>,
    /// Median inter-token gap of this request, ms per token.
    #[serde(
        serialize_with = "cell::opt_millis",
        deserialize_with = "cell::opt_float"
    )]
    pub itl_p50_ms: Option<f64>,
    /// (last − first) ÷ (tokens − 1), ms.
    #[serde(
        serialize_with = "cell::opt_millis",
        deserialize_with = "cell::opt_float"
    )]
    pub tpot_ms: Option<f64>,
    /// Send to the end of the response (or to the failure), ms.
    #[serde(
        serialize_with = "cell::opt_millis",
        deserialize_with = "cell::opt_float"
    )]
    pub e2el_ms: Option<f64>,
    /// Prompt tokens, from the usage chunk.
    #[serde(deserialize_with = "cell::opt_uint")]
    pub prompt_tokens: Option<u64>,
    /// Generated tokens, from the usage chunk (else counted from chunks).
    #[serde(deserialize_with = "cell::opt_uint")]
    pub output_tokens: Option<u64>,
    /// Engine-reported cached prompt tokens; empty when the server did not report them.
    #[serde(deserialize_with = "cell::opt_uint")]
    pub cached_tokens: Option<u64>,
    /// HTTP status; 0 when no response arrived.
    #[serde(deserialize_with = "cell::uint")]
    pub status: u16,
    /// `kind: message` on failure (written on one line), `None` on success.
    #[serde(
        serialize_with = "cell::opt_one_line",
        deserialize_with = "cell::opt_text"
    )]
    pub error: Option<String>,
    /// Sent inside the warm-up window (`1`), else `0`.
    #[serde(serialize_with = "cell::flag", deserialize_with = "cell::read_flag")]
    pub warmup: bool,
    /// How late the send was against the plan (`sent_s − scheduled_s`), ms.
    #[serde(
        serialize_with = "cell::opt_millis",
        deserialize_with = "cell::opt_float"
    )]
    pub send_lag_ms: Option<f64>,
    /// SSE content chunks received.
    #[serde(deserialize_with = "cell::uint")]
    pub chunks: u32,
}

impl ClientRow {
    /// Whether the request succeeded (no `error`).
    pub fn is_ok(&self) -> bool {
        self.error.is_none()
    }

    /// The error kind (`connect`, `timeout`, …: the text before the first `:`), empty on success.
    pub fn error_kind(&self) -> &str {
        self.error
            .as_deref()
            .and_then(|e| e.split(':').next())
            .unwrap_or("")
            .trim()
    }
}

/// One routing decision as the router recorded it: a `router.csv` row. `arrival_s` is on the
/// router's clock.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RouterRow {
    /// `x-request-id` (received or generated; joins with the client row).
    #[serde(deserialize_with = "cell::text")]
    pub request_id: String,
    /// Session id (`x-session-id`, else the body's `user`).
    #[serde(deserialize_with = "cell::opt_text")]
    pub session_id: Option<String>,
    /// Arrival at the router, s.
    #[serde(serialize_with = "cell::secs", deserialize_with = "cell::float")]
    pub arrival_s: f64,
    /// Policy name.
    #[serde(deserialize_with = "cell::text")]
    pub policy: String,
    /// The replica that served the request (after retries); `None` when none was chosen.
    #[serde(deserialize_with = "cell::opt_uint")]
    pub replica: Option<u32>,
    /// Decision branch (`match`, `spill-load`, …: `policies::Branch::as_str`). A `Cow` so that
    /// the router records its static names without allocating.
    #[serde(deserialize_with = "cell::opt_name")]
    pub branch: Option<Cow<'static, str>>,
    /// Tokens the policy predicted were cached on the chosen replica.
    #[serde(deserialize_with = "cell::opt_uint")]
    pub predicted_match_tokens: Option<u64>,
    /// Outstanding requests of the chosen replica at decision time (before the increment).
    #[serde(deserialize_with = "cell::opt_uint")]
    pub outstanding_chosen: Option<u32>,
    /// Outstanding requests of the least-loaded eligible replica at decision time.
    #[serde(deserialize_with = "cell::opt_uint")]
    pub outstanding_min: Option<u32>,
    /// Time inside `Policy::decide`, ns (last attempt).
    #[serde(deserialize_with = "cell::opt_uint")]
    pub decide_ns: Option<u64>,
    /// Router overhead, whole µs: arrival → upstream request written, plus upstream first byte →
    /// client first byte, minus any tokenize round trip.
    #[serde(deserialize_with = "cell::opt_whole")]
    pub overhead_us: Option<u64>,
    /// Tokenize round trip before routing (exact residency), ms.
    #[serde(
        serialize_with = "cell::opt_millis",
        deserialize_with = "cell::opt_float"
    )]
    pub tokenize_ms: Option<f64>,
    /// Upstream HTTP status (the router's own status when it answered itself; `None` when no
    /// head came back and nobody got an answer: the client went away or shutdown cut it).
    #[serde(deserialize_with = "cell::opt_uint")]
    pub upstream_status: Option<u16>,
    /// Engine-reported cached prompt tokens, from the usage chunk in passing.
    #[serde(deserialize_with = "cell::opt_uint")]
    pub cached_tokens: Option<u64>,
    /// Engine-reported prompt tokens, from the usage chunk in passing.
    #[serde(deserialize_with = "cell::opt_uint")]
    pub prompt_tokens: Option<u64>,
    /// `kind: message` on failure (kinds in docs/CONTRACTS.md, "Rows"; written on one line),
    /// `None` on success.
    #[serde(
        serialize_with = "cell::opt_one_line",
        deserialize_with = "cell::opt_text"
    )]
    pub error: Option<String>,
    /// Upstream attempts made (0 when no replica was tried; retries + 1 otherwise).
    #[serde(deserialize_with = "cell::uint")]
    pub attempts: u32,
}

/// How one cell is written and read. Every reader parses text (a CSV cell): the `csv` crate's
/// deserializer and a map of `(column, cell)` strings (the analysis's reader, which names the
/// column of a bad cell) both hand it over as a string.
mod cell {
    use std::borrow::Cow;
    use std::fmt;
    use std::str::FromStr;

    use serde::de::{self, Deserializer, Visitor};
    use serde::ser::Serializer;

    /// Reads a cell's text and applies `parse` to it.
    fn with_text<'de, D, T>(
        d: D,
        parse: impl FnOnce(&str) -> Result<T, String>,
    ) -> Result<T, D::Error>
    where
        D: Deserializer<'de>,
    {
        struct Text<F>(F);
        impl<'de, T, F: FnOnce(&str) -> Result<T, String>> Visitor<'de> for Text<F> {
            type Value = T;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a CSV cell")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
                (self.0)(v).map_err(E::custom)
            }
        }
        d.deserialize_str(Text(parse))
    }

    const REQUIRED: &str = "empty, but a value is required";

    fn required<T>(v: &str, parse: impl FnOnce(&str) -> Result<T, String>) -> Result<T, String> {
        if v.is_empty() {
            Err(REQUIRED.to_string())
        } else {
            parse(v)
        }
    }

    fn optional<T>(
        v: &str,
        parse: impl FnOnce(&str) -> Result<T, String>,
    ) -> Result<Option<T>, String> {
        if v.is_empty() {
            Ok(None)
        } else {
            parse(v).map(Some)
        }
    }

    fn parse_uint<T: FromStr>(v: &str) -> Result<T, String> {
        v.parse()
            .map_err(|_| format!("`{v}` is not a non-negative integer"))
    }

    fn parse_float(v: &str) -> Result<f64, String> {
        match v.parse::<f64>() {
            Ok(x) if x.is_finite() => Ok(x),
            _ => Err(format!("`{v}` is not a finite number")),
        }
    }

    /// A whole number, also when written with a decimal point and a zero fraction (`300.0`).
    fn parse_whole(v: &str) -> Result<u64, String> {
        if let Ok(n) = v.parse::<u64>() {
            return Ok(n);
        }
        match v.split_once('.') {
            Some((int, frac)) if !frac.is_empty() && frac.bytes().all(|b| b == b'0') => int
                .parse()
                .map_err(|_| format!("`{v}` is not a whole number")),
            _ => Err(format!("`{v}` is not a whole number")),
        }
    }

    pub(super) fn text<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
        with_text(d, |v| required(v, |v| Ok(v.to_string())))
    }

    pub(super) fn opt_text<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
        with_text(d, |v| optional(v, |v| Ok(v.to_string())))
    }

    pub(super) fn opt_name<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Cow<'static, str>>, D::Error> {
        with_text(d, |v| optional(v, |v| Ok(Cow::Owned(v.to_string()))))
    }

    pub(super) fn uint<'de, D: Deserializer<'de>, T: FromStr>(d: D) -> Result<T, D::Error> {
        with_text(d, |v| required(v, parse_uint))
    }

    pub(super) fn opt_uint<'de, D: Deserializer<'de>, T: FromStr>(
        d: D,
    ) -> Result<Option<T>, D::Error> {
        with_text(d, |v| optional(v, parse_uint))
    }

    pub(super) fn opt_whole<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        with_text(d, |v| optional(v, parse_whole))
    }

    pub(super) fn float<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        with_text(d, |v| required(v, parse_float))
    }

    pub(super) fn opt_float<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
        with_text(d, |v| optional(v, parse_float))
    }

    pub(super) fn read_flag<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
        with_text(d, |v| match v {
            "0" => Ok(false),
            "1" => Ok(true),
            v => Err(format!("`{v}` is not 0 or 1")),
        })
    }

    /// Seconds, 6 decimals.
    pub(super) fn secs<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&format_args!("{v:.6}"))
    }

    /// Seconds, 6 decimals; empty when `None`.
    pub(super) fn opt_secs<S: Serializer>(v: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => secs(v, s),
            None => s.serialize_none(),
        }
    }

    /// Milliseconds, 3 decimals; empty when `None`.
    pub(super) fn opt_millis<S: Serializer>(v: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => s.collect_str(&format_args!("{v:.3}")),
            None => s.serialize_none(),
        }
    }

    /// `1` or `0`.
    pub(super) fn flag<S: Serializer>(v: &bool, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u8(u8::from(*v))
    }

    /// Text on one line (line breaks become spaces, so a row stays one line); empty when `None`.
    pub(super) fn opt_one_line<S: Serializer>(v: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) if v.contains(['\n', '\r']) => s.serialize_str(&v.replace(['\n', '\r'], " ")),
            Some(v) => s.serialize_str(v),
            None => s.serialize_none(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The header the `csv` crate writes for a row type: its field names, in declaration order.
    fn csv_header<T: Serialize>(row: &T) -> Vec<String> {
        let mut w = csv::Writer::from_writer(Vec::new());
        w.serialize(row).unwrap();
        let text = String::from_utf8(w.into_inner().unwrap()).unwrap();
        let mut r = csv::Reader::from_reader(text.as_bytes());
        r.headers().unwrap().iter().map(str::to_string).collect()
    }

    #[test]
    fn the_fields_are_the_columns_in_contract_order() {
        assert_eq!(csv_header(&ClientRow::default()), CLIENT_COLUMNS);
        assert_eq!(csv_header(&RouterRow::default()), ROUTER_COLUMNS);
    }

    #[test]
    fn names_are_unique() {
        for cols in [&CLIENT_COLUMNS[..], &ROUTER_COLUMNS[..]] {
            let mut sorted = cols.to_vec();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), cols.len());
        }
    }

    fn write<T: Serialize>(rows: &[T]) -> String {
        let mut w = csv::WriterBuilder::new()
            .has_headers(false)
            .from_writer(Vec::new());
        for r in rows {
            w.serialize(r).unwrap();
        }
        String::from_utf8(w.into_inner().unwrap()).unwrap()
    }

    fn read<T: serde::de::DeserializeOwned>(header: &[&str], body: &str) -> csv::Result<Vec<T>> {
        let text = format!("{}\n{body}", header.join(","));
        csv::Reader::from_reader(text.as_bytes())
            .deserialize()
            .collect()
    }

    fn client() -> ClientRow {
        ClientRow {
            request_id: "u0-0".into(),
            session_id: Some("c0".into()),
            turn: 1,
            scheduled_s: Some(1.0),
            sent_s: Some(1.0000004),
            first_token_s: Some(1.25),
            last_s: None,
            ttft_ms: Some(249.9994),
            itl_p50_ms: Some(8.0),
            tpot_ms: None,
            e2el_ms: Some(1316.0),
            prompt_tokens: Some(1100),
            output_tokens: Some(128),
            cached_tokens: None,
            status: 200,
            error: Some("stream: cut\nshort".into()),
            warmup: true,
            send_lag_ms: Some(0.0004),
            chunks: 128,
        }
    }

    #[test]
    fn client_rows_are_written_as_the_driver_writes_them_and_read_back() {
        let text = write(&[client()]);
        assert_eq!(
            text,
            "u0-0,c0,1,1.000000,1.000000,1.250000,,249.999,8.000,,1316.000,1100,128,,200,stream: cut short,1,0.000,128\n"
        );
        let back: Vec<ClientRow> = read(&CLIENT_COLUMNS, &text).unwrap();
        assert_eq!(back.len(), 1);
        assert_eq!(back[0].sent_s, Some(1.0));
        assert_eq!(back[0].error.as_deref(), Some("stream: cut short"));
        assert!(back[0].warmup && !back[0].is_ok());
        assert_eq!(back[0].error_kind(), "stream");
        // What the writer rounded is all that differs.
        let mut rounded = client();
        rounded.sent_s = Some(1.0);
        rounded.ttft_ms = Some(249.999);
        rounded.send_lag_ms = Some(0.0);
        rounded.error = Some("stream: cut short".into());
        assert_eq!(back[0], rounded);
    }

    #[test]
    fn router_rows_are_written_as_the_router_writes_them_and_read_back() {
        let row = RouterRow {
            request_id: "r1".into(),
            session_id: Some("s,1".into()),
            arrival_s: 1.5,
            policy: "round-robin".into(),
            replica: Some(2),
            branch: Some("rr".into()),
            overhead_us: Some(80),
            tokenize_ms: Some(4.3),
            upstream_status: Some(200),
            cached_tokens: Some(16),
            prompt_tokens: Some(20),
            attempts: 1,
            ..RouterRow::default()
        };
        let text = write(std::slice::from_ref(&row));
        assert_eq!(
            text,
            "r1,\"s,1\",1.500000,round-robin,2,rr,,,,,80,4.300,200,16,20,,1\n"
        );
        let back: Vec<RouterRow> = read(&ROUTER_COLUMNS, &text).unwrap();
        assert_eq!(back, [row]);
    }

    #[test]
    fn reading_is_strict_where_it_must_be_and_lenient_where_writers_differed() {
        let line = "r1,,1.000000,p,,,,,,,300.0,,,,,,0\n";
        let rows: Vec<RouterRow> = read(&ROUTER_COLUMNS, line).unwrap();
        assert_eq!(
            rows[0].overhead_us,
            Some(300),
            "a whole number with a point"
        );
        assert_eq!((rows[0].session_id.as_ref(), rows[0].replica), (None, None));
        // Extra columns are ignored, by name.
        let mut wider = ROUTER_COLUMNS.to_vec();
        wider.push("later");
        let rows: Vec<RouterRow> = read(&wider, &line.replace('\n', ",x\n")).unwrap();
        assert_eq!(rows[0].attempts, 0);
        for (bad, why) in [
            (
                "r1,,1.000000,p,,,,,,,300.5,,,,,,0\n",
                "`300.5` is not a whole number",
            ),
            (
                "r1,,1.000000,p,-1,,,,,,,,,,,,0\n",
                "`-1` is not a non-negative integer",
            ),
            ("r1,,NaN,p,,,,,,,,,,,,,0\n", "`NaN` is not a finite number"),
            (
                ",,1.000000,p,,,,,,,,,,,,,0\n",
                "empty, but a value is required",
            ),
            (
                "r1,,1.000000,p,,,,,,,,,,,,,\n",
                "empty, but a value is required",
            ),
        ] {
            let err = read::<RouterRow>(&ROUTER_COLUMNS, bad).unwrap_err();
            assert!(err.to_string().contains(why), "{bad}: {err}");
        }
        let text = write(&[client()]).replace(",1,0.000,", ",2,0.000,");
        let err = read::<ClientRow>(&CLIENT_COLUMNS, &text).unwrap_err();
        assert!(err.to_string().contains("`2` is not 0 or 1"), "{err}");
    }
}
