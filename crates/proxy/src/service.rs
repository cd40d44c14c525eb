//! The serving port's handler: the OpenAI-compatible endpoints, `/v1/models` and `/health`.
//! (The admin API and `/metrics` are on the admin listener, [`crate::admin`].)

use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use policies::{Keying, ReplicaId, RouteRequest};

use crate::body::{Finish, ProxyBody, RouterBody};
use crate::keys::{Admission, KeyRefusal, Need, RejectReason};
use crate::request::{Endpoint, ParsedRequest, parse, parse_tokenize_reply};
use crate::rows::RouterRow;
use crate::state::{NoRoute, Replica, Shared};
use crate::upstream::{TimedBody, join_uri};
use crate::usage::BodyKind;

/// Header carrying the session id.
pub const SESSION_HEADER: &str = "x-session-id";
/// Header carrying the request id (generated when absent, always returned).
pub const REQUEST_ID_HEADER: &str = "x-request-id";
/// Response header naming the replica that served the request.
pub const REPLICA_HEADER: &str = "x-kvroute-replica";
/// What the router adds to `Via` (RFC 9110 §7.6.3) in both directions.
pub const VIA: &str = "1.1 kvroute";
/// `Retry-After` (seconds) of a 429 when every replica is at its in-flight ceiling: streams end
/// within seconds under load, so one second is the shortest useful wait.
pub const OVERLOAD_RETRY_AFTER_S: u32 = 1;

/// Most upstream attempts for one request (each replica at most once).
const MAX_ATTEMPTS: usize = 8;
/// Limit on small upstream replies the router reads whole (`/tokenize`, `/v1/models`).
const SMALL_REPLY_BYTES: usize = 16 << 20;
/// Deadline for the tokenize round trip.
const TOKENIZE_TIMEOUT: Duration = Duration::from_secs(10);

/// An OpenAI-style error response: `{"error":{"message","type","param","code"}}`.
pub fn error_response(
    status: StatusCode,
    message: &str,
    param: Option<&str>,
) -> Response<RouterBody> {
    let kind = match status {
        StatusCode::BAD_REQUEST => "BadRequestError",
        StatusCode::UNAUTHORIZED => "AuthenticationError",
        StatusCode::NOT_FOUND => "NotFoundError",
        StatusCode::METHOD_NOT_ALLOWED => "MethodNotAllowedError",
        StatusCode::REQUEST_TIMEOUT => "RequestTimeoutError",
        StatusCode::PAYLOAD_TOO_LARGE => "RequestTooLargeError",
        StatusCode::TOO_MANY_REQUESTS => "RateLimitError",
        StatusCode::BAD_GATEWAY => "BadGatewayError",
        StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
        StatusCode::GATEWAY_TIMEOUT => "GatewayTimeoutError",
        _ => "Error",
    };
    let body = serde_json::json!({
        "error": {"message": message, "type": kind, "param": param, "code": status.as_u16()}
    });
    json_response(status, body.to_string())
}

/// An OpenAI error with OpenAI's own `type` and `code` strings (what its API answers for a bad
/// key, `invalid_request_error` / `invalid_api_key`, or a rate limit, `requests` or `tokens` /
/// `rate_limit_exceeded`), for clients that branch on them.
pub fn openai_error(
    status: StatusCode,
    message: &str,
    kind: &str,
    code: &str,
) -> Response<RouterBody> {
    let body = serde_json::json!({
        "error": {"message": message, "type": kind, "param": null, "code": code}
    });
    json_response(status, body.to_string())
}

pub(crate) fn json_response(status: StatusCode, body: String) -> Response<RouterBody> {
    let mut r = Response::new(RouterBody::full(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// What the handler knows about the connection a request came on.
#[derive(Debug)]
pub struct ConnCtx {
    /// The peer's IP, as the element the router appends to `X-Forwarded-For`.
    peer_ip: Option<HeaderValue>,
    /// Set when the router answered before reading the whole request body: the connection
    /// then closes with a lingering drain (so the client can finish sending and read the
    /// answer) instead of a reset.
    pub linger: AtomicBool,
    /// `Some(cap)` on a connection accepted past `--max-connections`: every request on it is
    /// answered 503 and the connection closed.
    pub over_cap: Option<usize>,
    /// Requests received on the connection (tells an idle keep-alive connection from a fresh one
    /// when the header-read timer closes it).
    requests: std::sync::atomic::AtomicU32,
}

impl ConnCtx {
    /// A connection from `peer`; `over_cap` as in [`ConnCtx::over_cap`].
    pub fn new(peer: Option<IpAddr>, over_cap: Option<usize>) -> Self {
        ConnCtx {
            peer_ip: peer.and_then(|ip| HeaderValue::from_str(&ip.to_string()).ok()),
            linger: AtomicBool::new(false),
            over_cap,
            requests: std::sync::atomic::AtomicU32::new(0),
        }
    }

    /// Requests received on the connection so far.
    pub fn requests(&self) -> u32 {
        self.requests.load(Ordering::Relaxed)
    }
}

/// Entry point for every request on a serving connection.
///
/// Not an `async fn`: an LLM request's row is created here, when hyper hands the request over,
/// because hyper may drop the returned future before ever polling it (a client whose hang-up
/// arrives in the same read as its request).
pub fn handle(
    shared: Arc<Shared>,
    conn: Arc<ConnCtx>,
    req: Request<Incoming>,
) -> impl Future<Output = Result<Response<RouterBody>, Infallible>> + Send + 'static {
    let endpoint = match (req.method(), req.uri().path()) {
        (&Method::POST, "/v1/completions") => Some(Endpoint::Completions),
        (&Method::POST, "/v1/chat/completions") => Some(Endpoint::Chat),
        _ => None,
    };
    conn.requests.fetch_add(1, Ordering::Relaxed);
    let pending = endpoint.map(|e| (e, PendingRow::new(&shared, req.headers())));
    async move {
        if let Some(cap) = conn.over_cap {
            return Ok(refuse_over_cap(
                &shared,
                &conn,
                cap,
                pending.map(|(_, row)| row),
            ));
        }
        Ok(match pending {
            Some((endpoint, row)) => llm(&shared, &conn, req, endpoint, row).await,
            None => not_llm(&shared, req).await,
        })
    }
}

/// The answer on a connection past `--max-connections`: 503, `Connection: close`, and the row
/// of an LLM request.
fn refuse_over_cap(
    shared: &Arc<Shared>,
    conn: &ConnCtx,
    cap: usize,
    pending: Option<PendingRow>,
) -> Response<RouterBody> {
    let r = Refusal {
        unread_body: true,
        ..Refusal::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "overload",
            format!("the router is at its connection limit ({cap}); retry later"),
        )
    };
    match pending {
        Some(row) => refuse(shared, conn, row, r),
        None => {
            conn.linger.store(true, Ordering::Relaxed);
            let mut resp = error_response(StatusCode::SERVICE_UNAVAILABLE, &r.message, None);
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            resp
        }
    }
}

/// Every request but the two LLM endpoints on the serving port: models, health, and errors.
/// The admin API and `/metrics` are not here (404): they are on the admin listener.
async fn not_llm(shared: &Arc<Shared>, req: Request<Incoming>) -> Response<RouterBody> {
    let path = req.uri().path();
    match (req.method(), path) {
        (&Method::GET, "/v1/models") => match admit(
            shared,
            req.headers(),
            shared.clock.now_ns(),
            Need::RequestOnly,
        ) {
            Err(r) => key_refusal_response(r),
            Ok(_) => models(shared).await,
        },
        (&Method::GET, "/health") => health(shared),
        (_, "/v1/completions" | "/v1/chat/completions" | "/v1/models" | "/health") => {
            error_response(
                StatusCode::METHOD_NOT_ALLOWED,
                &format!("method {} not allowed on {path}", req.method()),
                None,
            )
        }
        (_, p) => error_response(StatusCode::NOT_FOUND, &format!("no route for {p}"), None),
    }
}

/// An LLM request's row, from the moment hyper hands the request over until it is written —
/// exactly once: by the handler (taken for a refusal's row, or for the response body, which
/// writes it when it ends or is dropped), or here on drop, with what is known so far, when hyper
/// drops the handler before the response head (the client went away, or shutdown cut it).
struct PendingRow {
    shared: Arc<Shared>,
    row: RouterRow,
    arrival_ns: u64,
    armed: bool,
}

impl PendingRow {
    /// Stamps the arrival and names the request (`x-request-id`, else a generated id).
    fn new(shared: &Arc<Shared>, headers: &HeaderMap) -> Self {
        let arrival_ns = shared.clock.now_ns();
        shared.metrics.requests.fetch_add(1, Ordering::Relaxed);
        let request_id = match header_str(headers, REQUEST_ID_HEADER) {
            Some(id) => id.to_string(),
            None => shared.new_request_id(),
        };
        PendingRow {
            shared: shared.clone(),
            row: RouterRow {
                request_id,
                session_id: header_str(headers, SESSION_HEADER).map(str::to_string),
                arrival_s: arrival_ns as f64 / 1e9,
                policy: shared.policy_name.clone(),
                ..RouterRow::default()
            },
            arrival_ns,
            armed: true,
        }
    }

    /// The row, for whoever writes it now; this guard writes nothing more.
    fn take(&mut self) -> RouterRow {
        self.armed = false;
        std::mem::take(&mut self.row)
    }
}

impl Drop for PendingRow {
    fn drop(&mut self) {
        if self.armed {
            // Whatever the router did so far (replica, branch, decide_ns, attempts) stays: the
            // request was dispatched there even though no answer will be relayed.
            let mut row = std::mem::take(&mut self.row);
            row.error = Some(self.shared.dropped_error("before the response head"));
            self.shared.rows.send(row);
        }
    }
}

fn header_str<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty())
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) are the connection's, not the message's: never
/// forwarded, in either direction. `proxy-connection` and `keep-alive` are the pre-RFC forms.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
    )
}

/// The field names a message's `Connection` header lists (lower-cased by the comparison, not
/// copied): they are hop-by-hop for that message too (RFC 9110 §7.6.1).
struct ConnectionListed<'h> {
    values: Vec<&'h str>,
}

impl<'h> ConnectionListed<'h> {
    fn of(headers: &'h HeaderMap) -> Self {
        let mut values = Vec::new();
        for v in headers.get_all(header::CONNECTION) {
            if let Ok(v) = v.to_str() {
                values.extend(v.split(',').map(str::trim).filter(|t| {
                    !t.is_empty()
                        && !t.eq_ignore_ascii_case("close")
                        && !t.eq_ignore_ascii_case("keep-alive")
                }));
            }
        }
        ConnectionListed { values }
    }

    /// Whether `name` (already lower case, as `HeaderName`s are) is listed.
    fn contains(&self, name: &HeaderName) -> bool {
        self.values
            .iter()
            .any(|t| t.eq_ignore_ascii_case(name.as_str()))
    }
}

/// `existing` values of a list header joined with `, `, then `last` appended.
fn append_list(
    existing: http::header::GetAll<'_, HeaderValue>,
    last: &[u8],
) -> Option<HeaderValue> {
    let mut out: Vec<u8> = Vec::new();
    for v in existing {
        if !out.is_empty() {
            out.extend_from_slice(b", ");
        }
        out.extend_from_slice(v.as_bytes());
    }
    if out.is_empty() {
        return None;
    }
    out.extend_from_slice(b", ");
    out.extend_from_slice(last);
    HeaderValue::from_bytes(&out).ok()
}

/// A router refusal: the status it answers (or none), the message, and how it ends the
/// connection.
struct Refusal {
    /// The router's answer; `None` when the client is gone and the answer reaches nobody.
    status: Option<StatusCode>,
    message: String,
    param: Option<&'static str>,
    kind: &'static str,
    /// The request body was not read to its end: answer with `Connection: close` and linger.
    unread_body: bool,
    /// OpenAI's own error `type` and `code` for the body, instead of the router's defaults
    /// (the status's name and number).
    openai: Option<(&'static str, &'static str)>,
    /// Headers of the answer (replacing the router's own `Retry-After`).
    headers: Vec<(HeaderName, HeaderValue)>,
}

impl Refusal {
    fn new(status: StatusCode, kind: &'static str, message: String) -> Self {
        Refusal {
            status: Some(status),
            message,
            param: None,
            kind,
            unread_body: false,
            openai: None,
            headers: Vec::new(),
        }
    }

    /// An API-key refusal (401, 400 or 429), made before the body was read.
    fn key(r: KeyRefusal) -> Self {
        let kind = match r.reason {
            RejectReason::Auth => "auth",
            RejectReason::Requests | RejectReason::Tokens => "rate_limit",
        };
        Refusal {
            unread_body: true,
            openai: Some((r.error_type, r.error_code)),
            headers: r.headers,
            ..Refusal::new(r.status, kind, r.message)
        }
    }
}

/// Applies the API keys (when the router has them) to a request on an API endpoint, at
/// `now_ns` on the router's clock.
fn admit(
    shared: &Shared,
    headers: &HeaderMap,
    now_ns: u64,
    need: Need,
) -> Result<Option<Admission>, KeyRefusal> {
    match shared.keys() {
        None => Ok(None),
        Some(keys) => keys.admit(headers, now_ns, need).map(Some),
    }
}

/// The answer to a refused request that has no row (`/v1/models`).
fn key_refusal_response(r: KeyRefusal) -> Response<RouterBody> {
    let mut resp = openai_error(r.status, &r.message, r.error_type, r.error_code);
    for (k, v) in r.headers {
        resp.headers_mut().insert(k, v);
    }
    resp
}

async fn llm(
    shared: &Arc<Shared>,
    conn: &ConnCtx,
    req: Request<Incoming>,
    endpoint: Endpoint,
    mut pending: PendingRow,
) -> Response<RouterBody> {
    let (parts, body) = req.into_parts();
    let arrival_ns = pending.arrival_ns;
    // Keys and limits before the body is read: a request without a key, or past its key's
    // limit, costs no body read (its connection closes with a lingering drain).
    let admission = match admit(shared, &parts.headers, arrival_ns, Need::Generate) {
        Ok(a) => a,
        Err(r) => return refuse(shared, conn, pending, Refusal::key(r)),
    };
    match proxy_llm(
        shared,
        conn,
        parts,
        body,
        endpoint,
        arrival_ns,
        &mut pending,
        admission,
    )
    .await
    {
        Ok(resp) => resp,
        Err(r) => refuse(shared, conn, pending, r),
    }
}

/// The router's own answer to an LLM request, with its row (exactly once, from `pending`).
fn refuse(
    shared: &Arc<Shared>,
    conn: &ConnCtx,
    mut pending: PendingRow,
    r: Refusal,
) -> Response<RouterBody> {
    let mut row = pending.take();
    let m = &shared.metrics;
    let counter = match r.status {
        // Counted per key (`kvroute_router_key_rejected_total`).
        _ if matches!(r.kind, "auth" | "rate_limit") => None,
        None => Some(&m.client_disconnects),
        Some(StatusCode::BAD_REQUEST) => Some(&m.bad_requests),
        Some(StatusCode::REQUEST_TIMEOUT) => Some(&m.body_timeouts),
        Some(StatusCode::PAYLOAD_TOO_LARGE) => Some(&m.too_large),
        Some(StatusCode::TOO_MANY_REQUESTS) => Some(&m.overloaded),
        Some(StatusCode::SERVICE_UNAVAILABLE) if r.kind == "no_replica" => Some(&m.no_replica),
        _ => None,
    };
    if let Some(c) = counter {
        c.fetch_add(1, Ordering::Relaxed);
    }
    row.upstream_status = r.status.map(|s| s.as_u16());
    row.error = Some(format!("{}: {}", r.kind, r.message));
    let status = r.status.unwrap_or(StatusCode::BAD_REQUEST);
    let mut resp = match r.openai {
        Some((kind, code)) => openai_error(status, &r.message, kind, code),
        None => error_response(status, &r.message, r.param),
    };
    let headers = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&row.request_id) {
        headers.insert(REQUEST_ID_HEADER, v);
    }
    if status == StatusCode::TOO_MANY_REQUESTS {
        headers.insert(
            header::RETRY_AFTER,
            HeaderValue::from(OVERLOAD_RETRY_AFTER_S),
        );
    }
    for (k, v) in r.headers {
        headers.insert(k, v);
    }
    if r.unread_body {
        // The rest of the body will not be read: say so, and drain it after the answer.
        headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        conn.linger.store(true, Ordering::Relaxed);
    }
    shared.rows.send(row);
    resp
}

async fn read_body(
    shared: &Shared,
    parts: &http::request::Parts,
    body: Incoming,
) -> Result<Bytes, Refusal> {
    let limit = shared.settings.max_body_bytes;
    let too_large = || Refusal {
        unread_body: true,
        ..Refusal::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            format!("request body exceeds {limit} bytes"),
        )
    };
    let declared = header_str(&parts.headers, header::CONTENT_LENGTH.as_str())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    // The request body must be whole to be routed; only responses are streamed. A body that is
    // already in the read buffer completes on the first poll, before the deadline's timer is
    // even registered.
    let deadline = shared.settings.body_read_timeout;
    let collected = tokio::time::timeout(deadline, Limited::new(body, limit).collect()).await;
    match collected {
        Ok(Ok(c)) => Ok(c.to_bytes()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => Err(too_large()),
        Ok(Err(e)) if client_went_away(e.as_ref()) => Err(Refusal {
            status: None,
            ..Refusal::new(
                StatusCode::BAD_REQUEST,
                "client",
                "disconnected while sending the request body".into(),
            )
        }),
        Ok(Err(e)) => Err(Refusal {
            unread_body: true,
            ..Refusal::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("failed to read request body: {e}"),
            )
        }),
        Err(_) => Err(Refusal {
            unread_body: true,
            ..Refusal::new(
                StatusCode::REQUEST_TIMEOUT,
                "client",
                format!(
                    "request body not received within {} ms",
                    deadline.as_millis()
                ),
            )
        }),
    }
}

/// Whether reading a request body failed because its client went away (the connection ended or
/// was reset mid-body), not because the body was malformed.
fn client_went_away(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(err) = cause {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                std::io::ErrorKind::UnexpectedEof
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
            );
        }
        if err
            .downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_incomplete_message)
        {
            return true;
        }
        cause = err.source();
    }
    false
}

#[allow(clippy::too_many_arguments)]
async fn proxy_llm(
    shared: &Arc<Shared>,
    conn: &ConnCtx,
    parts: http::request::Parts,
    body: Incoming,
    endpoint: Endpoint,
    arrival_ns: u64,
    pending: &mut PendingRow,
    admission: Option<Admission>,
) -> Result<Response<RouterBody>, Refusal> {
    let row = &mut pending.row;
    let body = read_body(shared, &parts, body).await?;
    let parsed = parse(endpoint, &body).map_err(|e| Refusal {
        param: e.param(),
        ..Refusal::new(StatusCode::BAD_REQUEST, "bad_request", e.to_string())
    })?;
    if row.session_id.is_none() {
        row.session_id = parsed.user.as_deref().map(str::to_string);
    }
    let model = key_model(shared, &parsed);

    let RouteKeys {
        keys,
        tokens_per_block,
        tokenize_ns,
        prompt_tokens: router_prompt_tokens,
    } = route_keys(shared, &parsed, model, body.len()).await;
    if let Some(ns) = tokenize_ns {
        row.tokenize_ms = Some(ns as f64 / 1e6);
    }
    let tokenize_ns = tokenize_ns.unwrap_or(0);
    let session = row.session_id.as_deref();
    let mut route_req = RouteRequest {
        session_id: session,
        block_keys: &keys,
        tokens_per_block,
        now_us: arrival_ns / 1000,
    };

    let path_and_query = parts
        .uri
        .path_and_query()
        .map_or(endpoint.path(), |p| p.as_str())
        .to_string();
    let mut excluded: Vec<ReplicaId> = Vec::new();
    // Why the last attempt failed, when it is safe to try another replica.
    let mut last_failure: Option<String> = None;
    let fails_to_down = shared.settings.health_fails_to_down;
    loop {
        route_req.now_us = shared.clock.now_us();
        let routed = match shared.route_excluding(&route_req, &excluded) {
            Ok(r) => r,
            Err(NoRoute::AtCeiling(ceiling)) => {
                return Err(Refusal::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "overload",
                    format!(
                        "every eligible replica has {ceiling} requests in flight (--max-in-flight-per-replica); retry after {OVERLOAD_RETRY_AFTER_S} s"
                    ),
                ));
            }
            Err(NoRoute::Policy(e)) => {
                return Err(match last_failure {
                    Some(why) => Refusal::new(
                        StatusCode::BAD_GATEWAY,
                        "upstream",
                        format!(
                            "no replica left to try after {} attempts: {why}",
                            row.attempts
                        ),
                    ),
                    None => Refusal::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "no_replica",
                        format!("no replica available: {e:?}"),
                    ),
                });
            }
        };
        row.attempts += 1;
        let replica = routed.guard.replica().clone();
        let d = &routed.decision;
        row.replica = Some(d.replica);
        row.branch = Some(d.branch.as_str().into());
        row.predicted_match_tokens = Some(u64::from(d.predicted_match_tokens));
        row.outstanding_chosen = Some(d.outstanding_chosen);
        row.outstanding_min = Some(d.outstanding_min);
        row.decide_ns = Some(routed.decide_ns);

        let written = Arc::new(AtomicU64::new(0));
        let up_req = build_upstream_request(
            &parts,
            conn,
            &replica,
            &path_and_query,
            &row.request_id,
            body.clone(),
            written.clone(),
            shared,
        )
        .map_err(|e| {
            Refusal::new(
                StatusCode::BAD_GATEWAY,
                "upstream",
                format!("cannot build upstream request: {e}"),
            )
        })?;
        let head_timeout = shared.settings.upstream_head_timeout;
        let failure = match tokio::time::timeout(head_timeout, shared.client.request(up_req)).await
        {
            Ok(Ok(resp)) => {
                let upstream_first_ns = shared.clock.now_ns();
                replica.record_request_ok();
                replica.served.fetch_add(1, Ordering::Relaxed);
                shared
                    .metrics
                    .record_decision(d.branch.as_str(), routed.decide_ns);
                shared.served(&route_req, d.replica, &replica);
                let written_ns = match written.load(Ordering::Acquire) {
                    0 => upstream_first_ns,
                    w => w,
                };
                let pre_us = written_ns
                    .saturating_sub(arrival_ns)
                    .saturating_sub(tokenize_ns)
                    / 1000;
                row.upstream_status = Some(resp.status().as_u16());
                return Ok(response(
                    shared,
                    resp,
                    pending.take(),
                    routed.guard,
                    Timing {
                        pre_us,
                        upstream_first_ns,
                    },
                    router_prompt_tokens,
                    admission,
                ));
            }
            Ok(Err(e)) => AttemptFailure {
                // Refused or unreachable: the request never left; else the body stamp tells.
                reached: !e.is_connect() && written.load(Ordering::Acquire) != 0,
                status: StatusCode::BAD_GATEWAY,
                message: format!("replica {} failed: {e}", replica.id),
            },
            Err(_) => {
                shared
                    .metrics
                    .upstream_timeouts
                    .fetch_add(1, Ordering::Relaxed);
                AttemptFailure {
                    reached: written.load(Ordering::Acquire) != 0,
                    status: StatusCode::GATEWAY_TIMEOUT,
                    message: format!(
                        "replica {} sent no response head within {} ms",
                        replica.id,
                        head_timeout.as_millis()
                    ),
                }
            }
        };
        replica.upstream_errors.fetch_add(1, Ordering::Relaxed);
        // Passive health: a failed attempt counts like a failed probe.
        replica.record_failure(fails_to_down);
        drop(routed);
        if failure.reached {
            // The replica may be running it: another attempt could run a POST twice.
            return Err(Refusal::new(
                failure.status,
                "upstream",
                format!(
                    "{} {}; attempt {})",
                    failure.message,
                    schema::rows::SENT_NOT_RETRIED,
                    row.attempts
                ),
            ));
        }
        if row.attempts as usize >= MAX_ATTEMPTS {
            return Err(Refusal::new(
                failure.status,
                "upstream",
                format!(
                    "upstream failed after {} attempts: {}",
                    row.attempts, failure.message
                ),
            ));
        }
        excluded.push(replica.id);
        last_failure = Some(failure.message);
        shared.metrics.retries.fetch_add(1, Ordering::Relaxed);
    }
}

/// A request's block keys as the router's policy asks for them ([`Shared::keying`]).
#[derive(Debug, Clone, Default)]
pub struct RouteKeys {
    /// The block keys (empty for [`Keying::None`], or when tokenizing failed).
    pub keys: Vec<u64>,
    /// Engine tokens one matched block stands for.
    pub tokens_per_block: f64,
    /// The `/tokenize` round trip, nanoseconds, when one was made.
    pub tokenize_ns: Option<u64>,
    /// The prompt's whole length in tokens, when exact keys were made (from `/tokenize` or a
    /// pre-tokenised prompt): every token, not only the cacheable ones that were keyed. Compared
    /// with the engine's `usage.prompt_tokens` when the response ends
    /// ([`crate::metrics::Metrics::record_prompt_tokens`]).
    pub prompt_tokens: Option<u32>,
}

/// The model name that salts a request's belief keys: the router's `--model`, else the body's
/// `model`, else empty. Shared by the router's request path and the endpoint picker (`epp`).
pub fn key_model<'a>(shared: &'a Shared, parsed: &'a ParsedRequest<'_>) -> &'a str {
    shared
        .settings
        .model
        .as_deref()
        .or(parsed.model.as_deref())
        .unwrap_or("")
}

/// Computes a parsed request's block keys as the policy's keying asks (docs/ARCHITECTURE.md,
/// "Prompt → blocks"): none;
/// belief keys from the canonical rendering; or exact keys from a replica's `/tokenize` (a
/// pre-tokenised prompt skips the round trip; a failed one is counted in `tokenize_errors` and
/// leaves no keys). `model` salts belief keys; `body_len` sizes the rendering buffer. Shared by
/// the router's request path and the endpoint picker (`epp`).
pub async fn route_keys(
    shared: &Shared,
    parsed: &ParsedRequest<'_>,
    model: &str,
    body_len: usize,
) -> RouteKeys {
    let mut keys = Vec::new();
    let mut tokenize_ns = None;
    let mut prompt_tokens = None;
    let tokens_per_block = match shared.keying {
        Keying::None => f64::from(shared.settings.block_tokens),
        Keying::BeliefBytes => {
            // Rendered into a buffer, then hashed: hashing the rendered pieces in passing saved
            // no time (`examples/decide_cost.rs`, docs/proxy-bench.md), the copy being far
            // cheaper than the hash.
            let mut rendered = Vec::with_capacity(body_len);
            parsed.render_into(&mut rendered);
            kv_index::hash::byte_block_keys_into(
                &parsed.key_salt(model.as_bytes()),
                &rendered,
                shared.settings.block_bytes,
                &mut keys,
            );
            // The router never sees engine tokens: matched bytes become predicted tokens through
            // the bytes-per-token estimate (a fixed 4 under-predicted ~2.5–10% of every hit).
            shared.settings.belief_tokens_per_block
        }
        Keying::ExactTokens => {
            let block_tokens = shared.settings.block_tokens;
            let tokens = match parsed.given_tokens() {
                Some(t) => Some(std::borrow::Cow::Borrowed(t)),
                None => {
                    let t0 = shared.clock.now_ns();
                    let r = tokenize(shared, parsed, model).await;
                    tokenize_ns = Some(shared.clock.now_ns() - t0);
                    match r {
                        Ok(t) => Some(std::borrow::Cow::Owned(t)),
                        Err(_) => {
                            shared
                                .metrics
                                .tokenize_errors
                                .fetch_add(1, Ordering::Relaxed);
                            None
                        }
                    }
                }
            };
            if let Some(t) = tokens {
                prompt_tokens = Some(u32::try_from(t.len()).unwrap_or(u32::MAX));
                // Only the blocks the engine can serve from cache: it always computes the last
                // prompt token, so a prompt of whole blocks never has its last block hit.
                kv_index::hash::token_block_keys_into(
                    &parsed.key_salt(shared.settings.exact_salt.as_bytes()),
                    kv_index::hash::cacheable_prompt_tokens(&t),
                    block_tokens as usize,
                    &mut keys,
                );
            }
            f64::from(block_tokens)
        }
    };
    RouteKeys {
        keys,
        tokens_per_block,
        tokenize_ns,
        prompt_tokens,
    }
}

/// One failed upstream attempt.
struct AttemptFailure {
    /// Whether the request may have reached the replica (its body was handed to the
    /// connection): such a request is never retried.
    reached: bool,
    /// The status the client gets if this is the last attempt.
    status: StatusCode,
    message: String,
}

#[allow(clippy::too_many_arguments)]
fn build_upstream_request(
    parts: &http::request::Parts,
    conn: &ConnCtx,
    replica: &Replica,
    path_and_query: &str,
    request_id: &str,
    body: Bytes,
    written: Arc<AtomicU64>,
    shared: &Shared,
) -> Result<Request<TimedBody>, http::Error> {
    let uri = join_uri(&replica.scheme, &replica.authority, path_and_query)?;
    let len = body.len();
    let mut req = Request::new(TimedBody::timed(body, written, shared.clock));
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = uri;
    let headers = req.headers_mut();
    headers.reserve(parts.headers.len() + 4);
    let listed = ConnectionListed::of(&parts.headers);
    for (k, v) in &parts.headers {
        // The body is already whole, so `expect: 100-continue` has nothing left to negotiate.
        // `x-forwarded-for` and `via` are rewritten below.
        if is_hop_by_hop(k)
            || *k == header::HOST
            || *k == header::CONTENT_LENGTH
            || *k == header::EXPECT
            || *k == X_FORWARDED_FOR
            || *k == header::VIA
            || listed.contains(k)
        {
            continue;
        }
        headers.append(k.clone(), v.clone());
    }
    if let Ok(h) = HeaderValue::from_str(replica.authority.as_str()) {
        headers.insert(header::HOST, h);
    }
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    if !headers.contains_key(REQUEST_ID_HEADER)
        && let Ok(v) = HeaderValue::from_str(request_id)
    {
        headers.insert(REQUEST_ID_HEADER, v);
    }
    // X-Forwarded-For: the client's list with this hop's peer appended (de-facto standard).
    if let Some(peer) = &conn.peer_ip {
        let xff = append_list(parts.headers.get_all(&X_FORWARDED_FOR), peer.as_bytes())
            .unwrap_or_else(|| peer.clone());
        headers.insert(X_FORWARDED_FOR.clone(), xff);
    }
    headers.insert(header::VIA, via(&parts.headers));
    Ok(req)
}

/// `X-Forwarded-For`.
static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// The message's `Via` with this hop appended.
fn via(headers: &HeaderMap) -> HeaderValue {
    append_list(headers.get_all(header::VIA), VIA.as_bytes())
        .unwrap_or_else(|| HeaderValue::from_static(VIA))
}

/// A proxied response's timing so far (see [`Finish`]).
struct Timing {
    pre_us: u64,
    upstream_first_ns: u64,
}

fn response(
    shared: &Arc<Shared>,
    resp: Response<Incoming>,
    row: RouterRow,
    guard: crate::state::LoadGuard,
    Timing {
        pre_us,
        upstream_first_ns,
    }: Timing,
    router_prompt_tokens: Option<u32>,
    admission: Option<Admission>,
) -> Response<RouterBody> {
    let (mut parts, incoming) = resp.into_parts();
    let kind = BodyKind::from_content_type(
        parts
            .headers
            .get(header::CONTENT_TYPE)
            .map(HeaderValue::as_bytes),
    );
    let via = via(&parts.headers);
    let listed: Vec<HeaderName> = ConnectionListed::of(&parts.headers)
        .values
        .iter()
        .filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok())
        .collect();
    parts
        .headers
        .retain_headers(|k, _| !is_hop_by_hop(k) && !listed.contains(k));
    parts.headers.insert(header::VIA, via);
    if let Ok(v) = HeaderValue::from_str(&row.request_id) {
        parts.headers.insert(REQUEST_ID_HEADER, v);
    }
    parts
        .headers
        .insert(REPLICA_HEADER, HeaderValue::from(guard.replica().id));
    // The key's `x-ratelimit-*` headers, as OpenAI sends them on every response.
    let api_key = admission.map(|a| {
        for (k, v) in a.headers {
            parts.headers.insert(k, v);
        }
        a.key
    });
    let finish = Finish {
        shared: shared.clone(),
        row,
        guard,
        pre_us,
        upstream_first_ns,
        client_first_ns: None,
        router_prompt_tokens,
        api_key,
    };
    Response::from_parts(
        parts,
        RouterBody::Proxy(ProxyBody::new(incoming, kind, finish)),
    )
}

trait HeaderRetain {
    fn retain_headers(&mut self, keep: impl FnMut(&HeaderName, &HeaderValue) -> bool);
}

impl HeaderRetain for HeaderMap {
    fn retain_headers(&mut self, mut keep: impl FnMut(&HeaderName, &HeaderValue) -> bool) {
        let drop: Vec<HeaderName> = self
            .iter()
            .filter(|(k, v)| !keep(k, v))
            .map(|(k, _)| k.clone())
            .collect();
        for k in drop {
            self.remove(k);
        }
    }
}

/// Reads a small upstream reply whole (bounded), for `/tokenize`, `/v1/models`, `/metrics` and
/// the token-parity probes, with `headers` added.
pub(crate) async fn small_request(
    shared: &Shared,
    replica: &Replica,
    method: Method,
    path: &str,
    body: Option<Vec<u8>>,
    headers: &[(&'static str, &'static str)],
) -> Result<(StatusCode, HeaderMap, Bytes), String> {
    let uri = join_uri(&replica.scheme, &replica.authority, path).map_err(|e| e.to_string())?;
    let mut b = Request::builder().method(method).uri(uri);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let body = match body {
        Some(bytes) => {
            b = b.header(header::CONTENT_TYPE, "application/json");
            TimedBody::plain(Bytes::from(bytes))
        }
        None => TimedBody::empty(),
    };
    let req = b.body(body).map_err(|e| e.to_string())?;
    let resp = shared
        .client
        .request(req)
        .await
        .map_err(|e| e.to_string())?;
    let (parts, body) = resp.into_parts();
    let bytes = Limited::new(body, SMALL_REPLY_BYTES)
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((parts.status, parts.headers, bytes))
}

async fn tokenize(
    shared: &Shared,
    parsed: &ParsedRequest<'_>,
    model: &str,
) -> Result<Vec<u32>, String> {
    let replica = shared
        .tokenizer_replica()
        .ok_or("no eligible replica to tokenize on")?;
    let fut = small_request(
        shared,
        &replica,
        Method::POST,
        "/tokenize",
        Some(parsed.tokenize_body(model)),
        &[],
    );
    let (status, _, body) = tokio::time::timeout(TOKENIZE_TIMEOUT, fut)
        .await
        .map_err(|_| "tokenize timed out".to_string())??;
    if !status.is_success() {
        return Err(format!("tokenize returned {status}"));
    }
    parse_tokenize_reply(&body)
}

async fn models(shared: &Shared) -> Response<RouterBody> {
    let reps = shared.replicas();
    for r in reps.iter().filter(|r| r.eligible()) {
        if let Ok((status, headers, body)) =
            small_request(shared, r, Method::GET, "/v1/models", None, &[]).await
        {
            let mut resp = Response::new(RouterBody::full(body));
            *resp.status_mut() = status;
            if let Some(ct) = headers.get(header::CONTENT_TYPE) {
                resp.headers_mut().insert(header::CONTENT_TYPE, ct.clone());
            }
            return resp;
        }
    }
    error_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "no replica answered /v1/models",
        None,
    )
}

/// `/health`: 200 while any replica is eligible, else 503.
pub(crate) fn health(shared: &Shared) -> Response<RouterBody> {
    if shared.replicas().iter().any(|r| r.eligible()) {
        Response::new(RouterBody::full(Bytes::new()))
    } else {
        error_response(StatusCode::SERVICE_UNAVAILABLE, "no healthy replica", None)
    }
}
