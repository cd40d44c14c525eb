//! The request handler: OpenAI-compatible endpoints, health, metrics and the admin API.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use policies::{Keying, ReplicaId, RouteRequest};

use crate::body::{Finish, ProxyBody, RouterBody};
use crate::config::ReplicaSpec;
use crate::request::{Endpoint, ParsedRequest, parse, parse_tokenize_reply};
use crate::rows::Row;
use crate::state::{Replica, Shared, start_replica_tasks};
use crate::upstream::{TimedBody, join_uri};
use crate::usage::BodyKind;

/// Header carrying the session id.
pub const SESSION_HEADER: &str = "x-session-id";
/// Header carrying the request id (generated when absent, always returned).
pub const REQUEST_ID_HEADER: &str = "x-request-id";
/// Response header naming the replica that served the request.
pub const REPLICA_HEADER: &str = "x-kvroute-replica";

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
        StatusCode::NOT_FOUND => "NotFoundError",
        StatusCode::METHOD_NOT_ALLOWED => "MethodNotAllowedError",
        StatusCode::PAYLOAD_TOO_LARGE => "RequestTooLargeError",
        StatusCode::BAD_GATEWAY => "BadGatewayError",
        StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
        _ => "Error",
    };
    let body = serde_json::json!({
        "error": {"message": message, "type": kind, "param": param, "code": status.as_u16()}
    });
    json_response(status, body.to_string())
}

fn json_response(status: StatusCode, body: String) -> Response<RouterBody> {
    let mut r = Response::new(RouterBody::full(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// Entry point for every request on a router connection.
///
/// Not an `async fn`: an LLM request's row is created here, when hyper hands the request over,
/// because hyper may drop the returned future before ever polling it (a client whose hang-up
/// arrives in the same read as its request).
pub fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> impl Future<Output = Result<Response<RouterBody>, Infallible>> + Send + 'static {
    let endpoint = match (req.method(), req.uri().path()) {
        (&Method::POST, "/v1/completions") => Some(Endpoint::Completions),
        (&Method::POST, "/v1/chat/completions") => Some(Endpoint::Chat),
        _ => None,
    };
    let pending = endpoint.map(|e| (e, PendingRow::new(&shared, req.headers())));
    async move {
        Ok(match pending {
            Some((endpoint, row)) => llm(&shared, req, endpoint, row).await,
            None => not_llm(&shared, req).await,
        })
    }
}

/// Every request but the two LLM endpoints: models, health, metrics, admin, and errors.
async fn not_llm(shared: &Arc<Shared>, req: Request<Incoming>) -> Response<RouterBody> {
    let path = req.uri().path();
    match (req.method(), path) {
        (&Method::GET, "/v1/models") => models(shared).await,
        (&Method::GET, "/health") => health(shared),
        (&Method::GET, "/metrics") => metrics(shared),
        (_, "/v1/completions" | "/v1/chat/completions" | "/v1/models" | "/health" | "/metrics") => {
            error_response(
                StatusCode::METHOD_NOT_ALLOWED,
                &format!("method {} not allowed on {path}", req.method()),
                None,
            )
        }
        (_, p) if p == "/admin/replicas" || p.starts_with("/admin/replicas/") => {
            admin(shared, req).await
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
    row: Row,
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
            row: Row {
                request_id,
                session_id: header_str(headers, SESSION_HEADER).map(str::to_string),
                arrival_s: arrival_ns as f64 / 1e9,
                policy: shared.policy_name.clone(),
                ..Row::default()
            },
            arrival_ns,
            armed: true,
        }
    }

    /// The row, for whoever writes it now; this guard writes nothing more.
    fn take(&mut self) -> Row {
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

/// Hop-by-hop headers are the connection's, not the message's: never forwarded.
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

struct Refusal {
    /// The router's answer; `None` when the client is gone and the answer reaches nobody.
    status: Option<StatusCode>,
    message: String,
    param: Option<&'static str>,
    kind: &'static str,
}

async fn llm(
    shared: &Arc<Shared>,
    req: Request<Incoming>,
    endpoint: Endpoint,
    mut pending: PendingRow,
) -> Response<RouterBody> {
    let (parts, body) = req.into_parts();
    let arrival_ns = pending.arrival_ns;
    match proxy_llm(shared, parts, body, endpoint, arrival_ns, &mut pending).await {
        Ok(resp) => resp,
        Err(r) => {
            let mut row = pending.take();
            let counter = match r.status {
                None => Some(&shared.metrics.client_disconnects),
                Some(StatusCode::BAD_REQUEST) => Some(&shared.metrics.bad_requests),
                Some(StatusCode::PAYLOAD_TOO_LARGE) => Some(&shared.metrics.too_large),
                Some(StatusCode::SERVICE_UNAVAILABLE) => Some(&shared.metrics.no_replica),
                _ => None,
            };
            if let Some(c) = counter {
                c.fetch_add(1, Ordering::Relaxed);
            }
            row.upstream_status = r.status.map(|s| s.as_u16());
            row.error = Some(format!("{}: {}", r.kind, r.message));
            let status = r.status.unwrap_or(StatusCode::BAD_REQUEST);
            let mut resp = error_response(status, &r.message, r.param);
            if let Ok(v) = HeaderValue::from_str(&row.request_id) {
                resp.headers_mut().insert(REQUEST_ID_HEADER, v);
            }
            shared.rows.send(row);
            resp
        }
    }
}

async fn read_body(
    shared: &Shared,
    parts: &http::request::Parts,
    body: Incoming,
) -> Result<Bytes, Refusal> {
    let limit = shared.settings.max_body_bytes;
    let too_large = || Refusal {
        status: Some(StatusCode::PAYLOAD_TOO_LARGE),
        message: format!("request body exceeds {limit} bytes"),
        param: None,
        kind: "too_large",
    };
    let declared = header_str(&parts.headers, header::CONTENT_LENGTH.as_str())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    // The request body must be whole to be routed; only responses are streamed.
    match Limited::new(body, limit).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(too_large()),
        Err(e) if client_went_away(e.as_ref()) => Err(Refusal {
            status: None,
            message: "disconnected while sending the request body".into(),
            param: None,
            kind: "client",
        }),
        Err(e) => Err(Refusal {
            status: Some(StatusCode::BAD_REQUEST),
            message: format!("failed to read request body: {e}"),
            param: None,
            kind: "bad_request",
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

async fn proxy_llm(
    shared: &Arc<Shared>,
    parts: http::request::Parts,
    body: Incoming,
    endpoint: Endpoint,
    arrival_ns: u64,
    pending: &mut PendingRow,
) -> Result<Response<RouterBody>, Refusal> {
    let row = &mut pending.row;
    let body = read_body(shared, &parts, body).await?;
    let parsed = parse(endpoint, &body).map_err(|e| Refusal {
        status: Some(StatusCode::BAD_REQUEST),
        message: e.to_string(),
        param: e.param(),
        kind: "bad_request",
    })?;
    if row.session_id.is_none() {
        row.session_id = parsed.user.as_deref().map(str::to_string);
    }
    let model = shared
        .settings
        .model
        .as_deref()
        .or(parsed.model.as_deref())
        .unwrap_or("");

    let mut keys = Vec::new();
    let mut tokenize_ns = 0;
    let tokens_per_block = match shared.keying {
        Keying::None => f64::from(shared.settings.block_tokens),
        Keying::BeliefBytes => {
            let mut rendered = Vec::with_capacity(body.len());
            parsed.render_into(&mut rendered);
            kv_index::hash::byte_block_keys_into(
                model.as_bytes(),
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
                Some(t) => Some(t.to_vec()),
                None => {
                    let t0 = shared.clock.now_ns();
                    let r = tokenize(shared, &parsed, model).await;
                    tokenize_ns = shared.clock.now_ns() - t0;
                    row.tokenize_ms = Some(tokenize_ns as f64 / 1e6);
                    match r {
                        Ok(t) => Some(t),
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
                kv_index::hash::token_block_keys_into(
                    shared.settings.exact_salt.as_bytes(),
                    &t,
                    block_tokens as usize,
                    &mut keys,
                );
            }
            f64::from(block_tokens)
        }
    };
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
    loop {
        route_req.now_us = shared.clock.now_us();
        let routed = shared
            .route_excluding(&route_req, &excluded)
            .map_err(|e| Refusal {
                status: Some(StatusCode::SERVICE_UNAVAILABLE),
                message: format!("no replica available: {e:?}"),
                param: None,
                kind: "no_replica",
            })?;
        row.attempts += 1;
        let replica = routed.guard.replica().clone();
        let d = &routed.decision;
        row.replica = Some(d.replica);
        row.branch = Some(d.branch.as_str());
        row.predicted_match_tokens = Some(d.predicted_match_tokens);
        row.outstanding_chosen = Some(d.outstanding_chosen);
        row.outstanding_min = Some(d.outstanding_min);
        row.decide_ns = Some(routed.decide_ns);

        let written = Arc::new(AtomicU64::new(0));
        let up_req = build_upstream_request(
            &parts,
            &replica,
            &path_and_query,
            &row.request_id,
            body.clone(),
            written.clone(),
            shared,
        )
        .map_err(|e| Refusal {
            status: Some(StatusCode::BAD_GATEWAY),
            message: format!("cannot build upstream request: {e}"),
            param: None,
            kind: "upstream",
        })?;
        match shared.client.request(up_req).await {
            Ok(resp) => {
                let upstream_first_ns = shared.clock.now_ns();
                replica.served.fetch_add(1, Ordering::Relaxed);
                shared
                    .metrics
                    .record_decision(d.branch.as_str(), routed.decide_ns);
                shared.served(&route_req, d.replica);
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
                    pre_us,
                    upstream_first_ns,
                ));
            }
            Err(e) => {
                replica.upstream_errors.fetch_add(1, Ordering::Relaxed);
                if e.is_connect() {
                    // Refused or unreachable: out of rotation until a health check passes.
                    replica.healthy.store(false, Ordering::Relaxed);
                }
                excluded.push(replica.id);
                drop(routed);
                if row.attempts as usize >= MAX_ATTEMPTS {
                    return Err(Refusal {
                        status: Some(StatusCode::BAD_GATEWAY),
                        message: format!("upstream failed after {} attempts: {e}", row.attempts),
                        param: None,
                        kind: "upstream",
                    });
                }
                shared.metrics.retries.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

fn build_upstream_request(
    parts: &http::request::Parts,
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
    headers.reserve(parts.headers.len() + 2);
    for (k, v) in &parts.headers {
        // The body is already whole, so `expect: 100-continue` has nothing left to negotiate.
        if is_hop_by_hop(k)
            || *k == header::HOST
            || *k == header::CONTENT_LENGTH
            || *k == header::EXPECT
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
    Ok(req)
}

fn response(
    shared: &Arc<Shared>,
    resp: Response<Incoming>,
    row: Row,
    guard: crate::state::LoadGuard,
    pre_us: u64,
    upstream_first_ns: u64,
) -> Response<RouterBody> {
    let (mut parts, incoming) = resp.into_parts();
    let kind = BodyKind::from_content_type(
        parts
            .headers
            .get(header::CONTENT_TYPE)
            .map(HeaderValue::as_bytes),
    );
    parts.headers.retain_headers(|k, _| !is_hop_by_hop(k));
    if let Ok(v) = HeaderValue::from_str(&row.request_id) {
        parts.headers.insert(REQUEST_ID_HEADER, v);
    }
    parts
        .headers
        .insert(REPLICA_HEADER, HeaderValue::from(guard.replica().id));
    let finish = Finish {
        shared: shared.clone(),
        row,
        guard,
        pre_us,
        upstream_first_ns,
        client_first_ns: None,
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

/// Reads a small upstream reply whole (bounded), for `/tokenize`, `/v1/models`, `/metrics`.
pub(crate) async fn small_request(
    shared: &Shared,
    replica: &Replica,
    method: Method,
    path: &str,
    body: Option<Vec<u8>>,
) -> Result<(StatusCode, HeaderMap, Bytes), String> {
    let uri = join_uri(&replica.scheme, &replica.authority, path).map_err(|e| e.to_string())?;
    let mut b = Request::builder().method(method).uri(uri);
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
            small_request(shared, r, Method::GET, "/v1/models", None).await
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

fn health(shared: &Shared) -> Response<RouterBody> {
    if shared.replicas().iter().any(|r| r.eligible()) {
        Response::new(RouterBody::full(Bytes::new()))
    } else {
        error_response(StatusCode::SERVICE_UNAVAILABLE, "no healthy replica", None)
    }
}

fn metrics(shared: &Shared) -> Response<RouterBody> {
    let mut out = String::with_capacity(4096);
    shared.metrics.render_into(&mut out, &shared.policy_name);
    let reps = shared.replicas();
    let gauge =
        |out: &mut String, name: &str, help: &str, kind: &str, f: &dyn Fn(&Replica) -> u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for r in &reps {
                let _ = writeln!(out, "{name}{{replica=\"{}\"}} {}", r.id, f(r));
            }
        };
    gauge(
        &mut out,
        "kvroute_router_outstanding",
        "Requests in flight per replica.",
        "gauge",
        &|r| u64::from(r.outstanding.load(Ordering::Relaxed)),
    );
    gauge(
        &mut out,
        "kvroute_router_replica_healthy",
        "1 when the replica passes health checks.",
        "gauge",
        &|r| u64::from(r.healthy.load(Ordering::Relaxed)),
    );
    gauge(
        &mut out,
        "kvroute_router_replica_draining",
        "1 while the replica is draining.",
        "gauge",
        &|r| u64::from(r.draining.load(Ordering::Relaxed)),
    );
    gauge(
        &mut out,
        "kvroute_router_served_total",
        "Requests served per replica.",
        "counter",
        &|r| r.served.load(Ordering::Relaxed),
    );
    gauge(
        &mut out,
        "kvroute_router_upstream_errors_total",
        "Failed upstream attempts and mid-stream failures.",
        "counter",
        &|r| r.upstream_errors.load(Ordering::Relaxed),
    );
    gauge(
        &mut out,
        "kvroute_router_kv_event_batches_total",
        "KV event batches applied.",
        "counter",
        &|r| r.events.batches.load(Ordering::Relaxed),
    );
    gauge(
        &mut out,
        "kvroute_router_kv_event_gaps_total",
        "KV event sequence gaps detected.",
        "counter",
        &|r| r.events.gaps.load(Ordering::Relaxed),
    );
    gauge(
        &mut out,
        "kvroute_router_kv_event_gaps_unrepaired_total",
        "Gaps not repaired by replay (replica treated as cleared).",
        "counter",
        &|r| r.events.gaps_unrepaired.load(Ordering::Relaxed),
    );
    gauge(
        &mut out,
        "kvroute_router_kv_event_decode_errors_total",
        "KV event batches that failed to decode.",
        "counter",
        &|r| r.events.decode_errors.load(Ordering::Relaxed),
    );
    let st = shared.rows.stats();
    let _ = writeln!(
        out,
        "# HELP kvroute_router_rows_written_total Router rows written.\n# TYPE kvroute_router_rows_written_total counter\nkvroute_router_rows_written_total {}\n# HELP kvroute_router_rows_dropped_total Router rows that could not be queued or written.\n# TYPE kvroute_router_rows_dropped_total counter\nkvroute_router_rows_dropped_total {}\n# HELP kvroute_router_rows_io_errors_total Failed flushes of router.csv.\n# TYPE kvroute_router_rows_io_errors_total counter\nkvroute_router_rows_io_errors_total {}",
        st.written.load(Ordering::Relaxed),
        st.dropped.load(Ordering::Relaxed),
        st.io_errors.load(Ordering::Relaxed)
    );
    let mut r = Response::new(RouterBody::full(out));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    r
}

/// One replica as the admin API lists it.
pub fn replica_json(r: &Replica) -> serde_json::Value {
    serde_json::json!({
        "id": r.id,
        "url": r.url,
        "kv_events": r.kv_events,
        "kv_replay": r.kv_replay,
        "healthy": r.healthy.load(Ordering::Relaxed),
        "draining": r.draining.load(Ordering::Relaxed),
        "outstanding": r.outstanding.load(Ordering::Relaxed),
        "served": r.served.load(Ordering::Relaxed),
        "upstream_errors": r.upstream_errors.load(Ordering::Relaxed),
        "kv_event_gaps": r.events.gaps.load(Ordering::Relaxed),
    })
}

async fn admin(shared: &Arc<Shared>, req: Request<Incoming>) -> Response<RouterBody> {
    let path = req.uri().path().to_string();
    let rest = path.strip_prefix("/admin/replicas").unwrap_or("");
    let segs: Vec<&str> = rest.split('/').filter(|s| !s.is_empty()).collect();
    let method = req.method().clone();
    match (&method, segs.as_slice()) {
        (&Method::GET, []) => {
            let list: Vec<serde_json::Value> =
                shared.replicas().iter().map(|r| replica_json(r)).collect();
            json_response(StatusCode::OK, serde_json::Value::Array(list).to_string())
        }
        (&Method::POST, []) => {
            let body = match Limited::new(req.into_body(), 64 << 10).collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) => {
                    return error_response(
                        StatusCode::BAD_REQUEST,
                        &format!("failed to read body: {e}"),
                        None,
                    );
                }
            };
            let spec: ReplicaSpec = match serde_json::from_slice(&body) {
                Ok(s) => s,
                Err(e) => {
                    return error_response(
                        StatusCode::BAD_REQUEST,
                        &format!("invalid replica: {e}"),
                        None,
                    );
                }
            };
            match shared.add_replica(&spec) {
                Ok(r) => {
                    start_replica_tasks(shared, &r).await;
                    json_response(StatusCode::CREATED, replica_json(&r).to_string())
                }
                Err(e) => error_response(StatusCode::BAD_REQUEST, &e, Some("url")),
            }
        }
        (&Method::DELETE, [id]) => match id
            .parse::<ReplicaId>()
            .ok()
            .and_then(|id| shared.remove_replica(id))
        {
            Some(r) => json_response(StatusCode::OK, replica_json(&r).to_string()),
            None => error_response(StatusCode::NOT_FOUND, &format!("no replica {id}"), None),
        },
        (&Method::POST, [id, action @ ("drain" | "undrain")]) => {
            match id
                .parse::<ReplicaId>()
                .ok()
                .and_then(|id| shared.replica(id))
            {
                Some(r) => {
                    r.draining.store(*action == "drain", Ordering::Relaxed);
                    json_response(StatusCode::OK, replica_json(&r).to_string())
                }
                None => error_response(StatusCode::NOT_FOUND, &format!("no replica {id}"), None),
            }
        }
        (_, [] | [_] | [_, "drain" | "undrain"]) => error_response(
            StatusCode::METHOD_NOT_ALLOWED,
            &format!("method {method} not allowed on {path}"),
            None,
        ),
        _ => error_response(StatusCode::NOT_FOUND, &format!("no route for {path}"), None),
    }
}
