//! `client.csv` and `router.csv` rows in the live schema: the simulator fills the very row types
//! the driver and the router write (`schema::rows::{ClientRow, RouterRow}`, docs/CONTRACTS.md), so
//! its rows are formatted as theirs are (`_s` with 6 decimals, `_ms` with 3, empty = none).

use schema::{CLIENT_COLUMNS, ClientRow, ROUTER_COLUMNS, RouterRow};
use serde::Serialize;

/// Who sent a request: closed-loop user `u`'s `k`-th request, open-loop arrival `i`, or request
/// `i` of a trace replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// `u{user}-{index}`.
    Closed {
        /// User.
        user: u32,
        /// 0-based request index in the user's script.
        index: u32,
    },
    /// `a{index}`.
    Open {
        /// 0-based arrival index.
        index: u32,
    },
    /// `t{line}`, as `driver replay` names it (`trace::ReplayPlan::request_id`).
    Trace {
        /// 0-based index in the replay plan.
        index: u32,
        /// The trace line it comes from.
        line: u32,
    },
}

impl Origin {
    /// The `x-request-id` the live driver sends for this request.
    pub fn request_id(&self) -> String {
        match *self {
            Origin::Closed { user, index } => {
                workload::closed_request_id(user as usize, index as usize)
            }
            Origin::Open { index } => workload::open_request_id(index as usize),
            Origin::Trace { line, .. } => format!("t{line}"),
        }
    }
}

/// One request's outcome on the virtual clock (µs since the run started). Both rows are
/// rendered from it.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Who sent it.
    pub origin: Origin,
    /// Conversation index.
    pub conversation: u32,
    /// Turn, 1-based.
    pub turn: u32,
    /// When the plan said to send.
    pub scheduled_us: u64,
    /// When it was sent (after waiting for the conversation's previous turn).
    pub sent_us: u64,
    /// First and last token arrival.
    pub first_us: Option<u64>,
    /// Last token arrival.
    pub last_us: Option<u64>,
    /// End of the response or failure.
    pub end_us: u64,
    /// Median inter-token gap, µs (`schema::stats`: an even count takes the mean of the middle
    /// two, a whole or half µs, exact in an f64).
    pub itl_p50_us: Option<f64>,
    /// Engine prompt tokens (known once the engine accepted the request).
    pub prompt_tokens: Option<u32>,
    /// Tokens generated.
    pub output_tokens: u32,
    /// Engine-reported cached prompt tokens.
    pub cached_tokens: u32,
    /// HTTP status seen by the client (0 = none).
    pub status: u16,
    /// Empty on success, else `kind: message`.
    pub error: String,
    /// Sent inside the warm-up window.
    pub warmup: bool,
    /// The router's decision, when one was made.
    pub decision: Option<RouterDecision>,
}

/// What the router recorded about its decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterDecision {
    /// Chosen replica.
    pub replica: u32,
    /// `Branch::as_str()`.
    pub branch: &'static str,
    /// Predicted cached tokens on the chosen replica.
    pub predicted_match_tokens: u32,
    /// Outstanding of the chosen replica before this request.
    pub outstanding_chosen: u32,
    /// Least outstanding at decision time.
    pub outstanding_min: u32,
    /// Modelled decision time, ns.
    pub decide_ns: u64,
    /// Modelled router overhead, µs.
    pub overhead_us: u64,
    /// Modelled tokenize round trip, µs (exact residency).
    pub tokenize_us: Option<u64>,
}

impl Outcome {
    /// Whether the request succeeded.
    pub fn is_ok(&self) -> bool {
        self.error.is_empty()
    }

    /// TTFT in ms, when a token arrived.
    pub fn ttft_ms(&self) -> Option<f64> {
        self.first_us.map(|f| (f - self.sent_us) as f64 / 1e3)
    }

    /// Per-request ITL p50 in ms.
    pub fn itl_p50_ms(&self) -> Option<f64> {
        self.itl_p50_us.map(|us| us / 1e3)
    }

    /// Engine cached tokens as the usage chunk reports them: vLLM omits `prompt_tokens_details`
    /// when zero, and the driver then records an empty cell.
    fn reported_cached(&self) -> Option<u32> {
        (self.prompt_tokens.is_some() && self.cached_tokens > 0).then_some(self.cached_tokens)
    }
}

/// Seconds from µs on the virtual clock (exact in an `f64`, so 6 decimals give the µs back).
fn secs(us: u64) -> f64 {
    us as f64 / 1e6
}

/// Milliseconds from µs.
fn millis(us: u64) -> f64 {
    us as f64 / 1e3
}

/// The error text as a row holds it: `None` on success.
fn error(o: &Outcome) -> Option<String> {
    (!o.error.is_empty()).then(|| o.error.clone())
}

/// The `client.csv` row of `o`.
pub fn client_row(o: &Outcome, session_id: &str) -> ClientRow {
    let tpot_ms = match (o.first_us, o.last_us) {
        (Some(a), Some(b)) if o.output_tokens > 1 => {
            Some(millis(b - a) / f64::from(o.output_tokens - 1))
        }
        _ => None,
    };
    ClientRow {
        request_id: o.origin.request_id(),
        session_id: Some(session_id.to_string()),
        turn: o.turn,
        scheduled_s: Some(secs(o.scheduled_us)),
        sent_s: Some(secs(o.sent_us)),
        first_token_s: o.first_us.map(secs),
        last_s: o.last_us.map(secs),
        ttft_ms: o.ttft_ms(),
        itl_p50_ms: o.itl_p50_ms(),
        tpot_ms,
        e2el_ms: Some(millis(o.end_us - o.sent_us)),
        prompt_tokens: o.prompt_tokens.map(u64::from),
        output_tokens: o.prompt_tokens.map(|_| u64::from(o.output_tokens)),
        cached_tokens: o.reported_cached().map(u64::from),
        status: o.status,
        error: error(o),
        warmup: o.warmup,
        send_lag_ms: Some(millis(o.sent_us - o.scheduled_us)),
        chunks: o.output_tokens,
    }
}

/// The `router.csv` row of `o`.
pub fn router_row(o: &Outcome, session_id: &str, policy: &str) -> RouterRow {
    let d = o.decision.as_ref();
    RouterRow {
        request_id: o.origin.request_id(),
        session_id: Some(session_id.to_string()),
        arrival_s: secs(o.sent_us),
        policy: policy.to_string(),
        replica: d.map(|d| d.replica),
        branch: d.map(|d| d.branch.into()),
        predicted_match_tokens: d.map(|d| u64::from(d.predicted_match_tokens)),
        outstanding_chosen: d.map(|d| d.outstanding_chosen),
        outstanding_min: d.map(|d| d.outstanding_min),
        decide_ns: d.map(|d| d.decide_ns),
        overhead_us: d.map(|d| d.overhead_us),
        tokenize_ms: d.and_then(|d| d.tokenize_us).map(millis),
        upstream_status: (o.status != 0).then_some(o.status),
        cached_tokens: o.reported_cached().map(u64::from),
        prompt_tokens: o.prompt_tokens.map(u64::from),
        error: error(o),
        attempts: u32::from(d.is_some()),
    }
}

/// Writes a whole rows file into memory: `header` (the schema's column list), then the rows.
fn to_csv<T: Serialize>(
    header: &[&str],
    rows: impl IntoIterator<Item = T>,
) -> Result<Vec<u8>, csv::Error> {
    let mut w = csv::WriterBuilder::new()
        .has_headers(false)
        .from_writer(Vec::new());
    w.write_record(header)?;
    for r in rows {
        w.serialize(r)?;
    }
    w.into_inner().map_err(|e| e.into_error().into())
}

/// `client.csv` bytes of `rows`.
pub fn client_csv(rows: impl IntoIterator<Item = ClientRow>) -> Result<Vec<u8>, csv::Error> {
    to_csv(&CLIENT_COLUMNS, rows)
}

/// `router.csv` bytes of `rows`.
pub fn router_csv(rows: impl IntoIterator<Item = RouterRow>) -> Result<Vec<u8>, csv::Error> {
    to_csv(&ROUTER_COLUMNS, rows)
}
