//! `client.csv` and `router.csv` records in the live schema (`schema::rows`, docs/CONTRACTS.md),
//! formatted exactly as the driver and the router format them (`_s` with 6 decimals, `_ms` with 3,
//! empty = none).

use std::fmt::Write as _;

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

fn secs(out: &mut String, us: Option<u64>) {
    if let Some(us) = us {
        let _ = write!(out, "{}.{:06}", us / 1_000_000, us % 1_000_000);
    }
}

fn millis(out: &mut String, v: Option<f64>) {
    if let Some(v) = v {
        let _ = write!(out, "{v:.3}");
    }
}

fn opt<T: std::fmt::Display>(out: &mut String, v: Option<T>) {
    if let Some(v) = v {
        let _ = write!(out, "{v}");
    }
}

/// Renders the `client.csv` record of `o` into `fields` (cleared first).
pub fn client_record(o: &Outcome, session_id: &str, fields: &mut Vec<String>) {
    fields.clear();
    let mut f = |fill: &dyn Fn(&mut String)| {
        let mut s = String::new();
        fill(&mut s);
        fields.push(s);
    };
    f(&|s| s.push_str(&o.origin.request_id()));
    f(&|s| s.push_str(session_id));
    f(&|s| opt(s, Some(o.turn)));
    f(&|s| secs(s, Some(o.scheduled_us)));
    f(&|s| secs(s, Some(o.sent_us)));
    f(&|s| secs(s, o.first_us));
    f(&|s| secs(s, o.last_us));
    f(&|s| millis(s, o.ttft_ms()));
    f(&|s| millis(s, o.itl_p50_ms()));
    f(&|s| {
        let tpot = match (o.first_us, o.last_us) {
            (Some(a), Some(b)) if o.output_tokens > 1 => {
                Some((b - a) as f64 / 1e3 / f64::from(o.output_tokens - 1))
            }
            _ => None,
        };
        millis(s, tpot)
    });
    f(&|s| millis(s, Some((o.end_us - o.sent_us) as f64 / 1e3)));
    f(&|s| opt(s, o.prompt_tokens));
    f(&|s| opt(s, o.prompt_tokens.map(|_| o.output_tokens)));
    f(&|s| opt(s, o.reported_cached()));
    f(&|s| opt(s, Some(o.status)));
    f(&|s| s.push_str(&o.error.replace(['\n', '\r'], " ")));
    f(&|s| opt(s, Some(u8::from(o.warmup))));
    f(&|s| millis(s, Some((o.sent_us - o.scheduled_us) as f64 / 1e3)));
    f(&|s| opt(s, Some(o.output_tokens)));
}

/// Renders the `router.csv` record of `o` into `fields` (cleared first).
pub fn router_record(o: &Outcome, session_id: &str, policy: &str, fields: &mut Vec<String>) {
    fields.clear();
    let d = o.decision.as_ref();
    let mut f = |fill: &dyn Fn(&mut String)| {
        let mut s = String::new();
        fill(&mut s);
        fields.push(s);
    };
    f(&|s| s.push_str(&o.origin.request_id()));
    f(&|s| s.push_str(session_id));
    f(&|s| secs(s, Some(o.sent_us)));
    f(&|s| s.push_str(policy));
    f(&|s| opt(s, d.map(|d| d.replica)));
    f(&|s| s.push_str(d.map_or("", |d| d.branch)));
    f(&|s| opt(s, d.map(|d| d.predicted_match_tokens)));
    f(&|s| opt(s, d.map(|d| d.outstanding_chosen)));
    f(&|s| opt(s, d.map(|d| d.outstanding_min)));
    f(&|s| opt(s, d.map(|d| d.decide_ns)));
    f(&|s| opt(s, d.map(|d| d.overhead_us)));
    f(&|s| millis(s, d.and_then(|d| d.tokenize_us).map(|t| t as f64 / 1e3)));
    f(&|s| opt(s, (o.status != 0).then_some(o.status)));
    f(&|s| opt(s, o.reported_cached()));
    f(&|s| opt(s, o.prompt_tokens));
    f(&|s| s.push_str(&o.error.replace(['\n', '\r'], " ")));
    f(&|s| opt(s, Some(u32::from(d.is_some()))));
}

/// Writes a whole CSV (header + records) into memory.
pub fn to_csv<I>(header: &[&str], records: I) -> Result<Vec<u8>, csv::Error>
where
    I: IntoIterator<Item = Vec<String>>,
{
    let mut w = csv::Writer::from_writer(Vec::new());
    w.write_record(header)?;
    for r in records {
        w.write_record(&r)?;
    }
    w.into_inner().map_err(|e| e.into_error().into())
}
