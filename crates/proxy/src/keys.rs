//! API keys and per-key limits on the serving port (`router --api-keys FILE`, issue #38).
//!
//! The key file holds one key per line as `<name> sha256:<hex>` — the SHA-256 of the key, never
//! the key itself — with optional limits on the same line (`rps=`, `burst=`, `tokens_per_min=`);
//! the format is in crates/proxy/README.md, "Keys and limits". [`ApiKeys::parse`] refuses a
//! malformed file with `path:line: reason`.
//!
//! A client sends `Authorization: Bearer <key>`. [`ApiKeys::admit`] hashes the key, compares the
//! digest with every entry's in constant time ([`constant_time_eq`], also the admin token's
//! compare), then takes one request from the key's request bucket and checks that its token
//! bucket is positive — both under the key's one lock, so the limits hold under any concurrency.
//! The tokens a response used (`usage.prompt_tokens + usage.completion_tokens`) are charged
//! when it ends ([`ApiKeys::charge`]), which may drive the token bucket negative: the next
//! request then waits until it refills.
//!
//! [`TokenBucket`] is a pure struct: every method takes the time (`now_ns`, nanoseconds on any
//! monotonic clock) explicitly. The router passes its [`crate::upstream::Clock`]; a test freezes
//! or steps time with a [`ManualClock`] ([`ApiKeys::with_manual_clock`]).
//!
//! Per-key counters (`kvroute_router_key_*`) are labelled with the key's name from the file, or
//! `unknown` for every request without a known key, so their cardinality is bounded by the file.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use parking_lot::Mutex;
use sha2::{Digest, Sha256};

/// Longest `Authorization` value accepted (bytes); longer is refused with 400.
pub const MAX_AUTHORIZATION_BYTES: usize = 1024;

/// The metrics label of requests without a known key (reserved: no key may be named so).
pub const UNKNOWN_LABEL: &str = "unknown";

/// Longest key name.
const MAX_NAME_CHARS: usize = 64;

/// Byte equality whose time does not depend on where the inputs differ (only on their lengths),
/// so a token cannot be guessed byte by byte from response times. Hand-written rather than a
/// crate: it is one loop, and `black_box` keeps the compiler from short-circuiting it.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a
        .iter()
        .zip(b)
        .fold(0u8, |acc, (x, y)| std::hint::black_box(acc | (x ^ y)));
    diff == 0
}

/// A token bucket: `capacity` tokens, refilled continuously at `rate_per_s`. Pure: every method
/// takes the time explicitly (ns on one monotonic clock); a time earlier than the last one seen
/// (two requests stamped in one order and served in the other) refills nothing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenBucket {
    capacity: f64,
    rate_per_s: f64,
    level: f64,
    at_ns: u64,
}

impl TokenBucket {
    /// A full bucket at `now_ns`. `capacity` and `rate_per_s` must be positive.
    pub fn new(capacity: f64, rate_per_s: f64, now_ns: u64) -> Self {
        TokenBucket {
            capacity,
            rate_per_s,
            level: capacity,
            at_ns: now_ns,
        }
    }

    /// The bucket's size.
    pub fn capacity(&self) -> f64 {
        self.capacity
    }

    fn refill(&mut self, now_ns: u64) {
        if now_ns > self.at_ns {
            // Multiplied before dividing: whole seconds at a whole rate add exactly.
            let added = (now_ns - self.at_ns) as f64 * self.rate_per_s / 1e9;
            self.level = (self.level + added).min(self.capacity);
            self.at_ns = now_ns;
        }
    }

    /// The level at `now_ns` (negative after a charge beyond it).
    pub fn level(&mut self, now_ns: u64) -> f64 {
        self.refill(now_ns);
        self.level
    }

    /// Takes `n` tokens if the bucket holds them; else how long until it does, ns.
    pub fn try_take(&mut self, n: f64, now_ns: u64) -> Result<(), u64> {
        self.refill(now_ns);
        if self.level >= n {
            self.level -= n;
            Ok(())
        } else {
            Err(self.ns_to_reach(n))
        }
    }

    /// Removes `n` tokens whatever the level (usage known only afterwards): the level may go
    /// negative.
    pub fn charge(&mut self, n: f64, now_ns: u64) {
        self.refill(now_ns);
        self.level -= n;
    }

    /// How long until the level is positive, ns (0 when it is).
    pub fn ns_until_positive(&mut self, now_ns: u64) -> u64 {
        self.refill(now_ns);
        if self.level > 0.0 {
            0
        } else {
            // Strictly above zero: one nanosecond past the time it reaches zero.
            (-self.level * 1e9 / self.rate_per_s).floor() as u64 + 1
        }
    }

    /// How long until the bucket is full again, ns (`x-ratelimit-reset-*`).
    pub fn ns_until_full(&mut self, now_ns: u64) -> u64 {
        self.refill(now_ns);
        self.ns_to_reach(self.capacity)
    }

    fn ns_to_reach(&self, n: f64) -> u64 {
        if self.level >= n {
            0
        } else {
            ((n - self.level) * 1e9 / self.rate_per_s).ceil() as u64
        }
    }
}

/// A key's limits as the file gives them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Limits {
    /// Requests per second (`rps=`).
    pub rps: Option<f64>,
    /// Request bucket size (`burst=`; default max(1, ⌊rps⌋)).
    pub burst: Option<u32>,
    /// Prompt + completion tokens per minute (`tokens_per_min=`); the bucket holds a minute's
    /// worth.
    pub tokens_per_min: Option<u64>,
}

impl Limits {
    /// The request bucket's size: `burst`, else max(1, ⌊rps⌋).
    pub fn request_burst(&self) -> Option<u32> {
        let rps = self.rps?;
        Some(self.burst.unwrap_or((rps.floor() as u32).max(1)))
    }
}

/// A time source for the limits that a test sets by hand (nanoseconds).
#[derive(Debug, Clone, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock at 0.
    pub fn new() -> Self {
        ManualClock::default()
    }

    /// Sets the time.
    pub fn set_ns(&self, ns: u64) {
        self.0.store(ns, Ordering::SeqCst);
    }

    /// Moves the time forward.
    pub fn advance_ns(&self, ns: u64) {
        self.0.fetch_add(ns, Ordering::SeqCst);
    }

    /// The time.
    pub fn now_ns(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

#[derive(Debug)]
struct Buckets {
    requests: Option<TokenBucket>,
    tokens: Option<TokenBucket>,
}

/// One key of the file, with its buckets and counters.
struct KeyEntry {
    name: String,
    hash: [u8; 32],
    limits: Limits,
    buckets: Mutex<Option<Buckets>>,
    requests: AtomicU64,
    rejected_requests: AtomicU64,
    rejected_tokens: AtomicU64,
    tokens: AtomicU64,
}

impl KeyEntry {
    /// The buckets at `now_ns`, created full on first use (so a router started long ago and a
    /// test clock at 0 both start with full buckets).
    fn buckets<'a>(&self, slot: &'a mut Option<Buckets>, now_ns: u64) -> &'a mut Buckets {
        slot.get_or_insert_with(|| Buckets {
            requests: self.limits.rps.map(|rps| {
                let burst = self.limits.request_burst().unwrap_or(1);
                TokenBucket::new(f64::from(burst), rps, now_ns)
            }),
            tokens: self
                .limits
                .tokens_per_min
                .map(|t| TokenBucket::new(t as f64, t as f64 / 60.0, now_ns)),
        })
    }
}

/// Why a request was refused (the `reason` label of `kvroute_router_key_rejected_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectReason {
    /// No key, an unknown key, or a malformed `Authorization`.
    Auth,
    /// The key's request bucket is empty.
    Requests,
    /// The key's token bucket is not positive.
    Tokens,
}

impl RejectReason {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::Auth => "auth",
            RejectReason::Requests => "requests",
            RejectReason::Tokens => "tokens",
        }
    }
}

/// What an endpoint needs from the limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// A completion: one request, and a positive token bucket.
    Generate,
    /// A request that uses no tokens (`/v1/models`): one request.
    RequestOnly,
}

/// A refused request: what the client is told.
#[derive(Debug, Clone)]
pub struct KeyRefusal {
    /// 400 (several or oversized `Authorization` headers), 401 or 429.
    pub status: http::StatusCode,
    /// Why (the metrics label).
    pub reason: RejectReason,
    /// The message (names the key, never the key itself).
    pub message: String,
    /// OpenAI's error `type`: `invalid_request_error`, `requests` or `tokens`.
    pub error_type: &'static str,
    /// OpenAI's error `code`: `invalid_api_key` or `rate_limit_exceeded`.
    pub error_code: &'static str,
    /// Headers of the answer: `WWW-Authenticate` on a 401; `Retry-After`, `retry-after-ms` and
    /// the `x-ratelimit-*` headers on a 429.
    pub headers: Vec<(HeaderName, HeaderValue)>,
}

/// An admitted request.
#[derive(Debug, Clone)]
pub struct Admission {
    /// The key's index, for [`ApiKeys::charge`].
    pub key: usize,
    /// The `x-ratelimit-*` headers of the key's limits after this request (empty without
    /// limits).
    pub headers: Vec<(HeaderName, HeaderValue)>,
}

/// A key file's entries, their buckets and their counters.
pub struct ApiKeys {
    entries: Vec<KeyEntry>,
    unknown_requests: AtomicU64,
    unknown_rejected: AtomicU64,
    clock: Option<ManualClock>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Names and limits only: the hashes stay out of logs.
        f.debug_map()
            .entries(self.entries.iter().map(|e| (&e.name, &e.limits)))
            .finish()
    }
}

/// A malformed key file: `path:line: reason` (or `path: reason` for the whole file).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}{}: {reason}", line.map(|l| format!(":{l}")).unwrap_or_default())]
pub struct KeysError {
    /// The file.
    pub path: String,
    /// The 1-based line, when one line is at fault.
    pub line: Option<usize>,
    /// What is wrong.
    pub reason: String,
}

impl ApiKeys {
    /// Reads and parses a key file ([`ApiKeys::parse`]).
    pub fn load(path: &std::path::Path) -> Result<ApiKeys, KeysError> {
        let text = std::fs::read_to_string(path).map_err(|e| KeysError {
            path: path.display().to_string(),
            line: None,
            reason: e.to_string(),
        })?;
        ApiKeys::parse(&text, &path.display().to_string())
    }

    /// Parses a key file's text; `path` names it in errors. One key per line:
    /// `<name> sha256:<64 hex digits> [rps=<n>] [burst=<n>] [tokens_per_min=<n>]`; `#` starts a
    /// comment; blank lines are skipped. Names (letters, digits, `_`, `-`, `.`; at most 64) and
    /// hashes are unique; `unknown` is reserved; a file without keys is refused.
    pub fn parse(text: &str, path: &str) -> Result<ApiKeys, KeysError> {
        let mut entries: Vec<KeyEntry> = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let err = |reason: String| KeysError {
                path: path.to_string(),
                line: Some(i + 1),
                reason,
            };
            let line = raw.split('#').next().unwrap_or("");
            let mut fields = line.split_whitespace();
            let Some(name) = fields.next() else {
                continue;
            };
            check_name(name).map_err(err)?;
            if entries.iter().any(|e| e.name == name) {
                return Err(err(format!("key name `{name}` appears twice")));
            }
            let hash = match fields.next() {
                Some(h) => parse_hash(h).map_err(err)?,
                None => {
                    return Err(err(format!(
                        "key `{name}` has no hash: expected `{name} sha256:<64 hex digits>`"
                    )));
                }
            };
            if let Some(other) = entries.iter().find(|e| e.hash == hash) {
                return Err(err(format!(
                    "key `{name}` has the same hash as `{}` (one key, two names)",
                    other.name
                )));
            }
            let mut limits = Limits::default();
            for f in fields {
                parse_limit(f, &mut limits).map_err(err)?;
            }
            if limits.burst.is_some() && limits.rps.is_none() {
                return Err(err("`burst=` needs `rps=`".into()));
            }
            entries.push(KeyEntry {
                name: name.to_string(),
                hash,
                limits,
                buckets: Mutex::new(None),
                requests: AtomicU64::new(0),
                rejected_requests: AtomicU64::new(0),
                rejected_tokens: AtomicU64::new(0),
                tokens: AtomicU64::new(0),
            });
        }
        if entries.is_empty() {
            return Err(KeysError {
                path: path.to_string(),
                line: None,
                reason: "no keys (every request would be refused)".into(),
            });
        }
        Ok(ApiKeys {
            entries,
            unknown_requests: AtomicU64::new(0),
            unknown_rejected: AtomicU64::new(0),
            clock: None,
        })
    }

    /// Times the limits with `clock` instead of the router's clock (tests).
    pub fn with_manual_clock(mut self, clock: &ManualClock) -> Self {
        self.clock = Some(clock.clone());
        self
    }

    /// The limits' time: the manual clock's when one is set, else `router_now_ns`.
    pub fn now_ns(&self, router_now_ns: u64) -> u64 {
        self.clock
            .as_ref()
            .map_or(router_now_ns, ManualClock::now_ns)
    }

    /// Key names in file order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|e| e.name.as_str())
    }

    /// A key's name.
    pub fn name(&self, key: usize) -> &str {
        &self.entries[key].name
    }

    /// Authenticates a request by its `Authorization` header and applies its key's limits at
    /// `router_now_ns` (the router clock; replaced by the manual clock when one is set).
    pub fn admit(
        &self,
        headers: &HeaderMap,
        router_now_ns: u64,
        need: Need,
    ) -> Result<Admission, KeyRefusal> {
        let key = match self.authenticate(headers) {
            Ok(k) => k,
            Err(r) => {
                self.unknown_requests.fetch_add(1, Ordering::Relaxed);
                self.unknown_rejected.fetch_add(1, Ordering::Relaxed);
                return Err(r);
            }
        };
        let e = &self.entries[key];
        e.requests.fetch_add(1, Ordering::Relaxed);
        if e.limits.rps.is_none() && e.limits.tokens_per_min.is_none() {
            return Ok(Admission {
                key,
                headers: Vec::new(),
            });
        }
        let now = self.now_ns(router_now_ns);
        let mut slot = e.buckets.lock();
        let b = e.buckets(&mut slot, now);
        // Tokens first: a request refused for tokens takes no request from the bucket.
        let token_wait = match (&mut b.tokens, need) {
            (Some(t), Need::Generate) => t.ns_until_positive(now),
            _ => 0,
        };
        let request_wait = match (token_wait, &mut b.requests) {
            (0, Some(r)) => r.try_take(1.0, now).err().unwrap_or(0),
            _ => 0,
        };
        let mut headers = rate_headers(b, now);
        drop(slot);
        let (reason, wait_ns, what) = if token_wait > 0 {
            e.rejected_tokens.fetch_add(1, Ordering::Relaxed);
            let t = e.limits.tokens_per_min.unwrap_or(0);
            (
                RejectReason::Tokens,
                token_wait,
                format!("tokens per minute (limit {t})"),
            )
        } else if request_wait > 0 {
            e.rejected_requests.fetch_add(1, Ordering::Relaxed);
            (
                RejectReason::Requests,
                request_wait,
                format!(
                    "requests per second (limit {}, burst {})",
                    e.limits.rps.unwrap_or(0.0),
                    e.limits.request_burst().unwrap_or(0)
                ),
            )
        } else {
            return Ok(Admission { key, headers });
        };
        let retry_s = wait_ns.div_ceil(1_000_000_000).max(1);
        headers.push((header::RETRY_AFTER, HeaderValue::from(retry_s)));
        headers.push((
            HeaderName::from_static("retry-after-ms"),
            HeaderValue::from(wait_ns.div_ceil(1_000_000).max(1)),
        ));
        Err(KeyRefusal {
            status: http::StatusCode::TOO_MANY_REQUESTS,
            reason,
            message: format!(
                "rate limit reached for key `{}` on {what}; retry after {retry_s} s",
                e.name
            ),
            error_type: reason.as_str(),
            error_code: "rate_limit_exceeded",
            headers,
        })
    }

    /// Charges a finished response's tokens to `key` at `router_now_ns`.
    pub fn charge(&self, key: usize, tokens: u64, router_now_ns: u64) {
        let Some(e) = self.entries.get(key) else {
            return;
        };
        e.tokens.fetch_add(tokens, Ordering::Relaxed);
        if e.limits.tokens_per_min.is_none() || tokens == 0 {
            return;
        }
        let now = self.now_ns(router_now_ns);
        let mut slot = e.buckets.lock();
        if let Some(t) = &mut e.buckets(&mut slot, now).tokens {
            t.charge(tokens as f64, now);
        }
    }

    /// The key the `Authorization` header names, or the refusal.
    fn authenticate(&self, headers: &HeaderMap) -> Result<usize, KeyRefusal> {
        let auth = |status, message: &str| KeyRefusal {
            status,
            reason: RejectReason::Auth,
            message: message.to_string(),
            error_type: "invalid_request_error",
            error_code: "invalid_api_key",
            headers: vec![(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"kvroute\""),
            )],
        };
        // hyper lower-cases header names, so `Authorization` and `authorization` are one name
        // here, and every copy of it is seen.
        let mut values = headers.get_all(header::AUTHORIZATION).iter();
        let Some(value) = values.next() else {
            return Err(auth(
                http::StatusCode::UNAUTHORIZED,
                "missing API key: send `Authorization: Bearer <key>`",
            ));
        };
        if values.next().is_some() {
            return Err(auth(
                http::StatusCode::BAD_REQUEST,
                "several Authorization headers: send exactly one `Authorization: Bearer <key>`",
            ));
        }
        let value = value.as_bytes();
        if value.len() > MAX_AUTHORIZATION_BYTES {
            return Err(auth(
                http::StatusCode::BAD_REQUEST,
                &format!("the Authorization header is longer than {MAX_AUTHORIZATION_BYTES} bytes"),
            ));
        }
        let Some(key) = bearer(value) else {
            return Err(auth(
                http::StatusCode::UNAUTHORIZED,
                "malformed Authorization header: expected `Bearer <key>` (one key)",
            ));
        };
        let digest: [u8; 32] = Sha256::digest(key).into();
        // Every entry is compared, whatever matched, so the time does not say which one did.
        let mut found = None;
        for (i, e) in self.entries.iter().enumerate() {
            if constant_time_eq(&digest, &e.hash) {
                found = Some(i);
            }
        }
        found.ok_or_else(|| auth(http::StatusCode::UNAUTHORIZED, "invalid API key"))
    }

    /// Renders the per-key counters (Prometheus text).
    pub fn render_into(&self, out: &mut String) {
        out.push_str("# HELP kvroute_router_key_requests_total Requests on the API endpoints by API key (`unknown`: no key, an unknown key, or a malformed Authorization).\n# TYPE kvroute_router_key_requests_total counter\n");
        for e in &self.entries {
            let _ = writeln!(
                out,
                "kvroute_router_key_requests_total{{key=\"{}\"}} {}",
                e.name,
                e.requests.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "kvroute_router_key_requests_total{{key=\"{UNKNOWN_LABEL}\"}} {}",
            self.unknown_requests.load(Ordering::Relaxed)
        );
        out.push_str("# HELP kvroute_router_key_rejected_total Requests refused by API key and reason (auth: 400/401; requests, tokens: 429 past the key's limit).\n# TYPE kvroute_router_key_rejected_total counter\n");
        for e in &self.entries {
            for (reason, v) in [
                (RejectReason::Requests, &e.rejected_requests),
                (RejectReason::Tokens, &e.rejected_tokens),
            ] {
                let _ = writeln!(
                    out,
                    "kvroute_router_key_rejected_total{{key=\"{}\",reason=\"{}\"}} {}",
                    e.name,
                    reason.as_str(),
                    v.load(Ordering::Relaxed)
                );
            }
        }
        let _ = writeln!(
            out,
            "kvroute_router_key_rejected_total{{key=\"{UNKNOWN_LABEL}\",reason=\"auth\"}} {}",
            self.unknown_rejected.load(Ordering::Relaxed)
        );
        out.push_str("# HELP kvroute_router_key_tokens_total Prompt + completion tokens charged to each API key (from the responses' usage).\n# TYPE kvroute_router_key_tokens_total counter\n");
        for e in &self.entries {
            let _ = writeln!(
                out,
                "kvroute_router_key_tokens_total{{key=\"{}\"}} {}",
                e.name,
                e.tokens.load(Ordering::Relaxed)
            );
        }
    }
}

/// The key of a `Bearer` authorization value (scheme case-insensitive, RFC 6750): one word of
/// visible ASCII, without commas (two keys in one header are refused, not tried one by one).
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at_checked(7)?;
    if !scheme.eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    let key = rest.trim_ascii();
    let ok = !key.is_empty() && key.iter().all(|&b| b.is_ascii_graphic() && b != b',');
    ok.then_some(key)
}

/// The `x-ratelimit-*` headers OpenAI clients read: the bucket's size, what is left, and how
/// long until it is full again.
fn rate_headers(b: &mut Buckets, now: u64) -> Vec<(HeaderName, HeaderValue)> {
    let mut out = Vec::new();
    for (bucket, kind) in [(&mut b.requests, "requests"), (&mut b.tokens, "tokens")] {
        let Some(bucket) = bucket else {
            continue;
        };
        let level = bucket.level(now);
        let reset = bucket.ns_until_full(now);
        for (what, v) in [
            ("limit", (bucket.capacity() as u64).to_string()),
            ("remaining", (level.max(0.0).floor() as u64).to_string()),
            ("reset", duration_text(reset)),
        ] {
            if let (Ok(n), Ok(v)) = (
                HeaderName::from_bytes(format!("x-ratelimit-{what}-{kind}").as_bytes()),
                HeaderValue::from_str(&v),
            ) {
                out.push((n, v));
            }
        }
    }
    out
}

/// A duration as OpenAI writes `x-ratelimit-reset-*` (Go's format, ms precision): `0s`,
/// `250ms`, `1.5s`, `6m0s`, `1h2m3s`.
pub fn duration_text(ns: u64) -> String {
    let ms = ns.div_ceil(1_000_000);
    if ms == 0 {
        return "0s".into();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (h, rest) = (ms / 3_600_000, ms % 3_600_000);
    let (m, rest) = (rest / 60_000, rest % 60_000);
    let secs = if rest % 1000 == 0 {
        format!("{}s", rest / 1000)
    } else {
        let s = format!("{}.{:03}", rest / 1000, rest % 1000);
        format!("{}s", s.trim_end_matches('0'))
    };
    match (h, m) {
        (0, 0) => secs,
        (0, m) => format!("{m}m{secs}"),
        (h, m) => format!("{h}h{m}m{secs}"),
    }
}

fn check_name(name: &str) -> Result<(), String> {
    if name == UNKNOWN_LABEL {
        return Err(format!(
            "the key name `{UNKNOWN_LABEL}` is reserved (it labels requests without a known key)"
        ));
    }
    if name.chars().count() > MAX_NAME_CHARS
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    {
        return Err(format!(
            "bad key name `{name}`: letters, digits, `_`, `-` and `.` only, at most {MAX_NAME_CHARS}"
        ));
    }
    if name.starts_with("sha256:") || name.contains('=') {
        return Err(format!("bad key name `{name}`"));
    }
    Ok(())
}

fn parse_hash(field: &str) -> Result<[u8; 32], String> {
    let Some(hex) = field.strip_prefix("sha256:") else {
        // The field is not echoed: it may be a key pasted in place of its hash.
        return Err(
            "expected `sha256:<64 hex digits>` (the SHA-256 of the key, never the key itself)"
                .into(),
        );
    };
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!(
            "`sha256:` must be followed by 64 hex digits, got {} characters",
            hex.len()
        ));
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|e| e.to_string())?;
    }
    Ok(out)
}

fn parse_limit(field: &str, limits: &mut Limits) -> Result<(), String> {
    let Some((k, v)) = field.split_once('=') else {
        return Err(format!(
            "expected a limit `rps=<n>`, `burst=<n>` or `tokens_per_min=<n>`, got `{field}`"
        ));
    };
    let twice = || format!("`{k}=` given twice");
    match k {
        "rps" => {
            let n: f64 = v
                .parse()
                .ok()
                .filter(|n: &f64| n.is_finite() && *n > 0.0)
                .ok_or_else(|| format!("`rps=` must be a positive number, got `{v}`"))?;
            if limits.rps.replace(n).is_some() {
                return Err(twice());
            }
        }
        "burst" => {
            let n: u32 = v
                .parse()
                .ok()
                .filter(|n| *n >= 1)
                .ok_or_else(|| format!("`burst=` must be a whole number ≥ 1, got `{v}`"))?;
            if limits.burst.replace(n).is_some() {
                return Err(twice());
            }
        }
        "tokens_per_min" => {
            let n: u64 = v.parse().ok().filter(|n| *n >= 1).ok_or_else(|| {
                format!("`tokens_per_min=` must be a whole number ≥ 1, got `{v}`")
            })?;
            if limits.tokens_per_min.replace(n).is_some() {
                return Err(twice());
            }
        }
        _ => {
            return Err(format!(
                "unknown limit `{k}` (known: rps, burst, tokens_per_min)"
            ));
        }
    }
    Ok(())
}

/// `sha256:<hex>` of a key, as the key file holds it (tests and tooling).
pub fn hash_line(key: &str) -> String {
    let d: [u8; 32] = Sha256::digest(key.as_bytes()).into();
    let mut s = String::from("sha256:");
    for b in d {
        let _ = write!(s, "{b:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn auth(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
        h
    }

    #[test]
    fn constant_time_equality() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(constant_time_eq(b"", b""));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(!constant_time_eq(b"xbc", b"abc"));
    }

    #[test]
    fn bucket_takes_refills_and_waits() {
        let mut b = TokenBucket::new(10.0, 10.0, 0);
        for _ in 0..10 {
            b.try_take(1.0, 0).unwrap();
        }
        // Empty: one token takes 0.1 s.
        assert_eq!(b.try_take(1.0, 0), Err(S / 10));
        assert_eq!(b.try_take(1.0, S / 20), Err(S / 20));
        b.try_take(1.0, S / 10).unwrap();
        // Refill stops at the capacity.
        assert_eq!(b.level(100 * S), 10.0);
        // A time earlier than the last one refills nothing (and takes nothing back).
        b.try_take(10.0, 100 * S).unwrap();
        assert_eq!(b.level(50 * S), 0.0);
        assert_eq!(b.ns_until_full(100 * S), S);
    }

    #[test]
    fn charge_drives_the_bucket_negative() {
        // 60 tokens per minute: one per second.
        let mut b = TokenBucket::new(60.0, 1.0, 0);
        assert_eq!(b.ns_until_positive(0), 0);
        b.charge(70.0, 0);
        assert_eq!(b.level(0), -10.0);
        assert_eq!(b.ns_until_positive(0), 10 * S + 1);
        assert_eq!(b.ns_until_positive(4 * S), 6 * S + 1);
        assert_eq!(b.ns_until_full(4 * S), 66 * S);
        assert_eq!(b.ns_until_positive(10 * S + 1), 0);
    }

    #[test]
    fn request_burst_defaults() {
        let l = |rps, burst| Limits {
            rps: Some(rps),
            burst,
            tokens_per_min: None,
        };
        assert_eq!(l(10.0, None).request_burst(), Some(10));
        assert_eq!(l(0.5, None).request_burst(), Some(1));
        assert_eq!(l(2.5, None).request_burst(), Some(2));
        assert_eq!(l(2.0, Some(7)).request_burst(), Some(7));
        assert_eq!(Limits::default().request_burst(), None);
    }

    fn file() -> String {
        format!(
            "# team keys\n\nalice {} rps=2 tokens_per_min=60 # the CI\nbob {}\n",
            hash_line("sk-alice"),
            hash_line("sk-bob")
                .to_uppercase()
                .replace("SHA256:", "sha256:")
        )
    }

    #[test]
    fn file_format_and_lookup() {
        let k = ApiKeys::parse(&file(), "keys.txt").unwrap();
        assert_eq!(k.names().collect::<Vec<_>>(), ["alice", "bob"]);
        let a = k.admit(&auth("Bearer sk-bob"), 0, Need::Generate).unwrap();
        assert_eq!(k.name(a.key), "bob");
        assert!(a.headers.is_empty(), "bob has no limits");
        let a = k
            .admit(&auth("bearer  sk-alice "), 0, Need::Generate)
            .unwrap();
        assert_eq!(k.name(a.key), "alice");
        let h: HashMapOf = a.headers.into();
        assert_eq!(h.get("x-ratelimit-limit-requests"), "2");
        assert_eq!(h.get("x-ratelimit-remaining-requests"), "1");
        assert_eq!(h.get("x-ratelimit-reset-requests"), "500ms");
        assert_eq!(h.get("x-ratelimit-limit-tokens"), "60");
        assert_eq!(h.get("x-ratelimit-remaining-tokens"), "60");
        assert_eq!(h.get("x-ratelimit-reset-tokens"), "0s");
    }

    struct HashMapOf(Vec<(HeaderName, HeaderValue)>);
    impl From<Vec<(HeaderName, HeaderValue)>> for HashMapOf {
        fn from(v: Vec<(HeaderName, HeaderValue)>) -> Self {
            HashMapOf(v)
        }
    }
    impl HashMapOf {
        fn get(&self, name: &str) -> &str {
            self.0
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.to_str().unwrap())
                .unwrap_or_else(|| panic!("no {name}"))
        }
    }

    #[test]
    fn refusals_say_why() {
        let k = ApiKeys::parse(&file(), "keys.txt").unwrap();
        let r = k.admit(&HeaderMap::new(), 0, Need::Generate).unwrap_err();
        assert_eq!((r.status.as_u16(), r.reason), (401, RejectReason::Auth));
        assert!(r.message.contains("missing"));
        let r = k
            .admit(&auth("Bearer sk-carol"), 0, Need::Generate)
            .unwrap_err();
        assert_eq!(r.status.as_u16(), 401);
        assert_eq!(r.error_code, "invalid_api_key");
        for bad in [
            "sk-alice",
            "Basic sk-alice",
            "Bearer ",
            "Bearer sk-alice, sk-bob",
            "Bearer sk-alice sk-bob",
        ] {
            let r = k.admit(&auth(bad), 0, Need::Generate).unwrap_err();
            assert_eq!(r.status.as_u16(), 401, "{bad}");
        }
        let long = format!("Bearer {}", "x".repeat(MAX_AUTHORIZATION_BYTES));
        let r = k.admit(&auth(&long), 0, Need::Generate).unwrap_err();
        assert_eq!(r.status.as_u16(), 400);
        let mut two = auth("Bearer sk-alice");
        two.append(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer sk-bob"),
        );
        let r = k.admit(&two, 0, Need::Generate).unwrap_err();
        assert_eq!(r.status.as_u16(), 400);
        assert!(r.message.contains("several"));
        // The key is never in a message.
        assert!(!r.message.contains("sk-"));
        let mut out = String::new();
        k.render_into(&mut out);
        assert!(out.contains("kvroute_router_key_requests_total{key=\"unknown\"} 9\n"));
        assert!(
            out.contains("kvroute_router_key_rejected_total{key=\"unknown\",reason=\"auth\"} 9\n")
        );
    }

    #[test]
    fn limits_refuse_with_retry_after_and_charge_tokens() {
        let clock = ManualClock::new();
        let k = ApiKeys::parse(&file(), "keys.txt")
            .unwrap()
            .with_manual_clock(&clock);
        let alice = auth("Bearer sk-alice");
        // rps=2: a burst of 2, then 0.5 s per request.
        k.admit(&alice, 0, Need::Generate).unwrap();
        k.admit(&alice, 0, Need::Generate).unwrap();
        let r = k.admit(&alice, 0, Need::Generate).unwrap_err();
        assert_eq!(
            (r.status.as_u16(), r.reason, r.error_type),
            (429, RejectReason::Requests, "requests")
        );
        let h = HashMapOf(r.headers);
        assert_eq!(h.get("retry-after"), "1");
        assert_eq!(h.get("retry-after-ms"), "500");
        assert_eq!(h.get("x-ratelimit-remaining-requests"), "0");
        assert_eq!(h.get("x-ratelimit-reset-requests"), "1s");
        clock.set_ns(S / 2);
        let a = k.admit(&alice, 0, Need::Generate).unwrap();
        // 90 tokens used against 60 a minute: 30 in debt, 30 s to become positive.
        k.charge(a.key, 90, 0);
        clock.set_ns(10 * S);
        let r = k.admit(&alice, 0, Need::Generate).unwrap_err();
        assert_eq!(r.reason, RejectReason::Tokens);
        let h = HashMapOf(r.headers);
        assert_eq!(h.get("retry-after"), "21");
        assert_eq!(h.get("x-ratelimit-remaining-tokens"), "0");
        assert_eq!(h.get("x-ratelimit-reset-tokens"), "1m20.5s");
        // A refusal for tokens took no request: the request bucket is full again by now.
        assert_eq!(h.get("x-ratelimit-remaining-requests"), "2");
        // A request that needs no tokens still passes.
        k.admit(&alice, 0, Need::RequestOnly).unwrap();
        clock.set_ns(31 * S);
        k.admit(&alice, 0, Need::Generate).unwrap();
        let mut out = String::new();
        k.render_into(&mut out);
        for line in [
            "kvroute_router_key_requests_total{key=\"alice\"} 7\n",
            "kvroute_router_key_rejected_total{key=\"alice\",reason=\"requests\"} 1\n",
            "kvroute_router_key_rejected_total{key=\"alice\",reason=\"tokens\"} 1\n",
            "kvroute_router_key_tokens_total{key=\"alice\"} 90\n",
            "kvroute_router_key_requests_total{key=\"unknown\"} 0\n",
        ] {
            assert!(out.contains(line), "{line} not in\n{out}");
        }
        for l in out.lines() {
            assert!(prom_text::parse_line(l).is_ok(), "{l}");
        }
    }

    #[test]
    fn malformed_files_name_the_line() {
        let h = hash_line("k");
        let cases = [
            ("a\n", 1, "no hash"),
            ("# c\na sha256:12\n", 2, "64 hex digits"),
            ("a sk-live-secret\n", 1, "sha256:"),
            (&format!("a {h}\na {}\n", hash_line("j")), 2, "twice"),
            (&format!("a {h}\nb {h}\n"), 2, "same hash"),
            (&format!("unknown {h}\n"), 1, "reserved"),
            (&format!("a/b {h}\n"), 1, "bad key name"),
            (&format!("a {h} rps=0\n"), 1, "positive"),
            (&format!("a {h} rps=x\n"), 1, "positive"),
            (&format!("a {h} burst=2\n"), 1, "needs `rps=`"),
            (&format!("a {h} rps=1 rps=2\n"), 1, "twice"),
            (&format!("a {h} tokens_per_min=0\n"), 1, "≥ 1"),
            (&format!("a {h} rpm=3\n"), 1, "unknown limit `rpm`"),
            (&format!("a {h} 5\n"), 1, "expected a limit"),
        ];
        for (text, line, why) in cases {
            let e = ApiKeys::parse(text, "/etc/keys").unwrap_err();
            assert_eq!(e.line, Some(line), "{text}: {e}");
            let s = e.to_string();
            assert!(s.starts_with(&format!("/etc/keys:{line}: ")), "{s}");
            assert!(s.contains(why), "{s} (wanted {why})");
            // A key given in place of a hash is never echoed.
            assert!(!s.contains("sk-live-secret"), "{s}");
        }
        let e = ApiKeys::parse("# only comments\n\n", "/etc/keys").unwrap_err();
        assert_eq!(
            e.to_string(),
            "/etc/keys: no keys (every request would be refused)"
        );
    }

    #[test]
    fn the_readme_example_parses() {
        let readme = include_str!("../README.md");
        let section = &readme[readme.find("## Keys and limits").unwrap()..];
        let start = section.find("```text\n").unwrap() + "```text\n".len();
        let example = &section[start..start + section[start..].find("```").unwrap()];
        let k = ApiKeys::parse(example, "README.md").unwrap();
        assert_eq!(k.names().collect::<Vec<_>>(), ["alice", "batch-jobs", "ci"]);
        assert_eq!(k.entries[1].limits.request_burst(), Some(4));
        // `ci`'s hash is the SHA-256 of `test`.
        assert_eq!(
            k.admit(&auth("Bearer test"), 0, Need::Generate)
                .unwrap()
                .key,
            2
        );
    }

    #[test]
    fn reset_durations_read_like_openai() {
        assert_eq!(duration_text(0), "0s");
        assert_eq!(duration_text(1), "1ms");
        assert_eq!(duration_text(250_000_000), "250ms");
        assert_eq!(duration_text(S), "1s");
        assert_eq!(duration_text(1_500_000_000), "1.5s");
        assert_eq!(duration_text(360 * S), "6m0s");
        assert_eq!(duration_text(3723 * S), "1h2m3s");
    }
}
