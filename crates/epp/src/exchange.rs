//! One HTTP request's `ext_proc` exchange with the proxy, in the endpoint-picker protocol's
//! full-duplex streamed mode (gateway-api-inference-extension, proposal 004).
//!
//! Request side: the headers are held unanswered; body chunks are buffered until end of stream
//! (or the trailers); then the decision — the router's own: `proxy::service::route_keys`, then
//! `Shared::route` under the one lock — and the answers in the protocol's order: the request
//! headers' answer (`x-gateway-destination-endpoint: picked,fallback,…`, the same list under the
//! `envoy.lb` dynamic-metadata namespace, `content-length`), then the buffered body streamed back
//! chunk by chunk, unchanged. No eligible endpoint is an immediate 503; every eligible one at the
//! in-flight ceiling (shedding) an immediate 429 with `retry-after`; a malformed LLM body a 400,
//! an oversized one a 413 — each with an OpenAI-style error body.
//!
//! Response side: the headers' `:status` and the endpoint the proxy actually used
//! (`envoy.lb` / `x-gateway-destination-endpoint-served` in the metadata context — Envoy's
//! `override_host` policy writes it there with `selected_host_key`) are read; the policy is told
//! which replica served (`on_served`) and the request's load moves there if it was a fallback.
//! Body chunks are echoed at once (the usage scanner reads them in passing) and the row is
//! written when the response ends, or — with what is known — when the exchange ends first.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpBody,
    HttpHeaders, ImmediateResponse, ProcessingRequest, ProcessingResponse, StreamedBodyResponse,
    TrailersResponse, body_mutation, processing_request, processing_response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use policies::RouteRequest;
use proxy::request::{Endpoint, parse};
use proxy::rows::RouterRow;
use proxy::service::{REPLICA_HEADER, RouteKeys, key_model, route_keys};
use proxy::state::{LoadGuard, NoRoute, Shared};
use proxy::usage::{BodyKind, UsageScanner};

use crate::endpoints::{endpoint_of, replica_at};

/// The header (and `envoy.lb` metadata key) carrying the picked endpoint list.
pub const DESTINATION_ENDPOINT: &str = "x-gateway-destination-endpoint";
/// The metadata key under which the proxy reports the endpoint that served the request.
pub const DESTINATION_ENDPOINT_SERVED: &str = "x-gateway-destination-endpoint-served";
/// The dynamic-metadata namespace of both keys.
pub const METADATA_NAMESPACE: &str = "envoy.lb";
/// The namespace of the optional subset the proxy may restrict the pick to.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The key of that subset.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// Session id header (the router's).
pub const SESSION_HEADER: &str = "x-session-id";
/// Request id header (Envoy generates one per request unless the client sent it).
pub const REQUEST_ID_HEADER: &str = "x-request-id";
/// `Retry-After` of the shedding 429, seconds (the router's).
pub const OVERLOAD_RETRY_AFTER_S: u64 = 1;

/// What every exchange shares: the router state and the picker's settings.
pub struct Picker {
    /// The router's request-path state (replicas, policy, rows, metrics).
    pub shared: Arc<Shared>,
    /// Eligible endpoints listed after the picked one.
    pub fallbacks: usize,
}

/// A message for the proxy, or the end of the exchange (the proxy hung up).
pub type Outbound = Result<ProcessingResponse, tonic::Status>;

/// The decision of one request, with its load held.
struct Picked {
    guard: LoadGuard,
    keys: Vec<u64>,
    tokens_per_block: f64,
    session: Option<String>,
    branch: &'static str,
    decide_ns: u64,
    picked: u32,
}

/// One request's exchange.
struct Exchange {
    picker: Arc<Picker>,
    arrival_ns: u64,
    endpoint: Option<Endpoint>,
    request_id: Option<String>,
    session: Option<String>,
    subset: Option<Vec<SocketAddr>>,
    body: Vec<Vec<u8>>,
    body_len: usize,
    decided: bool,
    /// An immediate response was sent: the exchange is over.
    refused: bool,
    /// The LLM request's row, until written (exactly once: at the response's end, by a refusal,
    /// or on drop).
    row: Option<RouterRow>,
    picked: Option<Picked>,
    scanner: Option<UsageScanner>,
    /// The picker's own time on the request side (body complete → answers sent, minus any
    /// tokenize round trip), ns.
    pre_ns: u64,
    response_head_seen: bool,
}

/// Serves one exchange: reads the proxy's messages, answers on `out`; returns when either side
/// ends. The row is written whatever happens.
pub async fn run(
    picker: Arc<Picker>,
    mut inbound: tonic::Streaming<ProcessingRequest>,
    out: tokio::sync::mpsc::Sender<Outbound>,
) {
    let mut x = Exchange::new(picker);
    loop {
        let msg = match inbound.message().await {
            Ok(Some(m)) => m,
            Ok(None) | Err(_) => return,
        };
        let answers = x.on_message(msg).await;
        for a in answers {
            if out.send(Ok(a)).await.is_err() {
                return;
            }
        }
    }
}

fn header<'h>(h: &'h HttpHeaders, name: &str) -> Option<&'h [u8]> {
    h.headers.as_ref()?.headers.iter().find_map(|v| {
        v.key
            .eq_ignore_ascii_case(name)
            .then_some(if v.raw_value.is_empty() {
                v.value.as_bytes()
            } else {
                v.raw_value.as_slice()
            })
    })
}

fn header_string(h: &HttpHeaders, name: &str) -> Option<String> {
    header(h, name)
        .and_then(|v| std::str::from_utf8(v).ok())
        .map(str::to_string)
}

fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            raw_value: value.as_bytes().to_vec(),
            ..HeaderValue::default()
        }),
        // OVERWRITE_IF_EXISTS_OR_ADD: a client's own header never survives next to the pick.
        append_action: 2,
        ..HeaderValueOption::default()
    }
}

fn string_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_string())),
    }
}

/// The string under `namespace` / `key` in a message's metadata context.
fn metadata_string(req: &ProcessingRequest, namespace: &str, key: &str) -> Option<String> {
    let v = req
        .metadata_context
        .as_ref()?
        .filter_metadata
        .get(namespace)?
        .fields
        .get(key)?;
    match &v.kind {
        Some(Kind::StringValue(s)) => Some(s.clone()),
        Some(Kind::ListValue(l)) => {
            let parts: Vec<&str> = l
                .values
                .iter()
                .filter_map(|v| match &v.kind {
                    Some(Kind::StringValue(s)) => Some(s.as_str()),
                    _ => None,
                })
                .collect();
            Some(parts.join(","))
        }
        _ => None,
    }
}

/// Parses an `ip:port[,ip:port…]` list, skipping what does not parse.
pub fn parse_endpoint_list(s: &str) -> Vec<SocketAddr> {
    s.split(',').filter_map(|e| e.trim().parse().ok()).collect()
}

fn continue_headers(mutation: Option<HeaderMutation>) -> CommonResponse {
    CommonResponse {
        header_mutation: mutation,
        ..CommonResponse::default()
    }
}

fn streamed(body: Vec<u8>, end_of_stream: bool) -> CommonResponse {
    CommonResponse {
        body_mutation: Some(BodyMutation {
            mutation: Some(body_mutation::Mutation::StreamedResponse(
                StreamedBodyResponse {
                    body,
                    end_of_stream,
                    ..StreamedBodyResponse::default()
                },
            )),
        }),
        ..CommonResponse::default()
    }
}

fn response(r: processing_response::Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(r),
        ..ProcessingResponse::default()
    }
}

/// An immediate response with an OpenAI-style error body.
pub fn immediate(status: u16, kind: &str, message: &str) -> ProcessingResponse {
    let body = serde_json::json!({
        "error": {"message": message, "type": kind, "param": null, "code": status}
    })
    .to_string();
    let mut set_headers = vec![set_header("content-type", "application/json")];
    if status == 429 {
        set_headers.push(set_header(
            "retry-after",
            &OVERLOAD_RETRY_AFTER_S.to_string(),
        ));
    }
    response(processing_response::Response::ImmediateResponse(
        ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(status),
            }),
            headers: Some(HeaderMutation {
                set_headers,
                ..HeaderMutation::default()
            }),
            body: body.into_bytes(),
            details: format!("kvroute_epp_{kind}"),
            ..ImmediateResponse::default()
        },
    ))
}

impl Exchange {
    fn new(picker: Arc<Picker>) -> Self {
        let arrival_ns = picker.shared.clock.now_ns();
        Exchange {
            picker,
            arrival_ns,
            endpoint: None,
            request_id: None,
            session: None,
            subset: None,
            body: Vec::new(),
            body_len: 0,
            decided: false,
            refused: false,
            row: None,
            picked: None,
            scanner: None,
            pre_ns: 0,
            response_head_seen: false,
        }
    }

    fn shared(&self) -> &Shared {
        &self.picker.shared
    }

    async fn on_message(&mut self, msg: ProcessingRequest) -> Vec<ProcessingResponse> {
        use processing_request::Request as R;
        if self.refused {
            // An immediate response ended the exchange: nothing more is answered.
            return Vec::new();
        }
        if self.subset.is_none()
            && let Some(list) = metadata_string(&msg, SUBSET_NAMESPACE, SUBSET_KEY)
        {
            self.subset = Some(parse_endpoint_list(&list));
        }
        match msg.request {
            Some(R::RequestHeaders(ref h)) => {
                self.on_request_headers(h);
                if h.end_of_stream {
                    return self.decide(false, false).await;
                }
                Vec::new()
            }
            Some(R::RequestBody(b)) => self.on_request_body(b).await,
            Some(R::RequestTrailers(_)) => {
                let mut out = Vec::new();
                if !self.decided {
                    // Trailers follow the body: its last chunk does not end the stream.
                    out = self.decide(true, false).await;
                }
                if !self.refused {
                    out.push(response(processing_response::Response::RequestTrailers(
                        TrailersResponse::default(),
                    )));
                }
                out
            }
            Some(R::ResponseHeaders(ref h)) => {
                let served = metadata_string(&msg, METADATA_NAMESPACE, DESTINATION_ENDPOINT_SERVED);
                self.on_response_headers(h, served.as_deref())
            }
            Some(R::ResponseBody(b)) => self.on_response_body(b),
            Some(R::ResponseTrailers(_)) => {
                self.complete(None);
                vec![response(processing_response::Response::ResponseTrailers(
                    TrailersResponse::default(),
                ))]
            }
            None => Vec::new(),
        }
    }

    fn on_request_headers(&mut self, h: &HttpHeaders) {
        self.arrival_ns = self.shared().clock.now_ns();
        let method = header(h, ":method").unwrap_or(b"");
        let path = header(h, ":path").unwrap_or(b"");
        let path = path.split(|b| *b == b'?').next().unwrap_or(b"");
        self.endpoint = match (method, path) {
            (b"POST", b"/v1/completions") => Some(Endpoint::Completions),
            (b"POST", b"/v1/chat/completions") => Some(Endpoint::Chat),
            _ => None,
        };
        self.request_id = header_string(h, REQUEST_ID_HEADER);
        self.session = header_string(h, SESSION_HEADER);
        if self.endpoint.is_some() {
            let s = &self.picker.shared;
            s.metrics.requests.fetch_add(1, Ordering::Relaxed);
            self.row = Some(RouterRow {
                request_id: self
                    .request_id
                    .clone()
                    .unwrap_or_else(|| s.new_request_id()),
                session_id: self.session.clone(),
                arrival_s: self.arrival_ns as f64 / 1e9,
                policy: s.policy_name.clone(),
                ..RouterRow::default()
            });
        }
    }

    async fn on_request_body(&mut self, b: HttpBody) -> Vec<ProcessingResponse> {
        if self.decided {
            // Past the decision (a body after trailers cannot happen): pass it on unchanged.
            return vec![response(processing_response::Response::RequestBody(
                BodyResponse {
                    response: Some(streamed(b.body, b.end_of_stream)),
                },
            ))];
        }
        self.body_len += b.body.len();
        let max = self.shared().settings.max_body_bytes;
        if self.body_len > max {
            self.shared()
                .metrics
                .too_large
                .fetch_add(1, Ordering::Relaxed);
            return vec![self.refuse(
                413,
                "too_large",
                format!("request body exceeds {max} bytes"),
            )];
        }
        if !b.body.is_empty() {
            self.body.push(b.body);
        }
        if b.end_of_stream {
            return self.decide(true, true).await;
        }
        Vec::new()
    }

    /// Writes the row of a refused request and answers the proxy at once.
    fn refuse(&mut self, status: u16, kind: &'static str, message: String) -> ProcessingResponse {
        self.decided = true;
        self.refused = true;
        if let Some(mut row) = self.row.take() {
            row.upstream_status = Some(status);
            row.error = Some(format!("{kind}: {message}"));
            self.shared().rows.send(row);
        }
        immediate(status, kind, &message)
    }

    /// Up to `count` eligible endpoints (inside the subset, if any), least outstanding first
    /// (ties by id), without replica `first`.
    fn fallback_list(&self, first: u32, count: usize) -> Vec<SocketAddr> {
        let mut reps: Vec<_> = self
            .shared()
            .replicas()
            .into_iter()
            .filter(|r| r.id != first && r.eligible())
            .filter_map(|r| {
                let ep = endpoint_of(&r.url).ok()?;
                let allowed = self.subset.as_ref().is_none_or(|s| s.contains(&ep));
                allowed.then(|| (r.outstanding.load(Ordering::Relaxed), r.id, ep))
            })
            .collect();
        reps.sort_unstable_by_key(|(o, id, _)| (*o, *id));
        reps.into_iter().take(count).map(|(_, _, ep)| ep).collect()
    }

    /// The answers that send the request to `list` (picked first): the request headers' answer
    /// (the list as `x-gateway-destination-endpoint` and under `envoy.lb`, `content-length` when
    /// there is a body), then the buffered body chunk by chunk (`body_ends`: the last chunk ends
    /// the stream, i.e. no trailers follow).
    fn answers(
        &mut self,
        list: &[SocketAddr],
        has_body: bool,
        body_ends: bool,
    ) -> Vec<ProcessingResponse> {
        let value = list
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let mut set_headers = vec![set_header(DESTINATION_ENDPOINT, &value)];
        if has_body {
            set_headers.push(set_header("content-length", &self.body_len.to_string()));
        }
        let mut lb = Struct::default();
        lb.fields
            .insert(DESTINATION_ENDPOINT.to_string(), string_value(&value));
        let mut metadata = Struct::default();
        metadata.fields.insert(
            METADATA_NAMESPACE.to_string(),
            Value {
                kind: Some(Kind::StructValue(lb)),
            },
        );
        let mut out = vec![ProcessingResponse {
            response: Some(processing_response::Response::RequestHeaders(
                HeadersResponse {
                    response: Some(CommonResponse {
                        header_mutation: Some(HeaderMutation {
                            set_headers,
                            ..HeaderMutation::default()
                        }),
                        clear_route_cache: true,
                        ..CommonResponse::default()
                    }),
                },
            )),
            dynamic_metadata: Some(metadata),
            ..ProcessingResponse::default()
        }];
        if has_body {
            let n = self.body.len();
            if n == 0 {
                out.push(response(processing_response::Response::RequestBody(
                    BodyResponse {
                        response: Some(streamed(Vec::new(), body_ends)),
                    },
                )));
            }
            for (i, chunk) in std::mem::take(&mut self.body).into_iter().enumerate() {
                out.push(response(processing_response::Response::RequestBody(
                    BodyResponse {
                        response: Some(streamed(chunk, body_ends && i + 1 == n)),
                    },
                )));
            }
        }
        out
    }

    /// Decides and answers: the request headers' answer, then the buffered body.
    async fn decide(&mut self, has_body: bool, body_ends: bool) -> Vec<ProcessingResponse> {
        let t_body = self.shared().clock.now_ns();
        self.decided = true;
        let Some(endpoint) = self.endpoint else {
            // Not an LLM request (`GET /v1/models`, …): the policy is not asked, as the router
            // does not ask it; the least-loaded eligible replica, no row.
            let list = self.fallback_list(u32::MAX, self.picker.fallbacks + 1);
            if list.is_empty() {
                self.shared()
                    .metrics
                    .no_replica
                    .fetch_add(1, Ordering::Relaxed);
                return vec![self.refuse(503, "no_replica", "no replica available".into())];
            }
            return self.answers(&list, has_body, body_ends);
        };
        let body: Vec<u8> = self.body.concat();
        let picker = self.picker.clone();
        let shared = &picker.shared;
        // Replicas outside the proxy's subset are shown to the policy as already tried.
        let excluded: Vec<u32> = match &self.subset {
            Some(subset) => shared
                .replicas()
                .iter()
                .filter(|r| endpoint_of(&r.url).is_ok_and(|ep| !subset.contains(&ep)))
                .map(|r| r.id)
                .collect(),
            None => Vec::new(),
        };
        let mut tokenize_ns = 0;
        // The parsed body borrows it: keys and session outlive the parse.
        let (keys, tokens_per_block, session) = {
            let parsed = match parse(endpoint, &body) {
                Ok(p) => p,
                Err(e) => {
                    shared.metrics.bad_requests.fetch_add(1, Ordering::Relaxed);
                    return vec![self.refuse(400, "bad_request", e.to_string())];
                }
            };
            if self.session.is_none() {
                self.session = parsed.user.as_deref().map(str::to_string);
            }
            let model = key_model(shared, &parsed);
            let RouteKeys {
                keys,
                tokens_per_block,
                tokenize_ns: t,
                ..
            } = route_keys(shared, &parsed, model, body.len()).await;
            if let (Some(ns), Some(row)) = (t, self.row.as_mut()) {
                row.tokenize_ms = Some(ns as f64 / 1e6);
                tokenize_ns = ns;
            }
            (keys, tokens_per_block, self.session.clone())
        };
        if let Some(row) = self.row.as_mut() {
            row.session_id = session.clone();
        }
        let route_req = RouteRequest {
            session_id: session.as_deref(),
            block_keys: &keys,
            tokens_per_block,
            now_us: shared.clock.now_us(),
        };
        let routed = match shared.route_excluding(&route_req, &excluded) {
            Ok(r) => r,
            Err(NoRoute::AtCeiling(ceiling)) => {
                shared.metrics.overloaded.fetch_add(1, Ordering::Relaxed);
                return vec![self.refuse(
                    429,
                    "overload",
                    format!(
                        "every eligible replica has {ceiling} requests in flight (--max-in-flight-per-replica); retry after {OVERLOAD_RETRY_AFTER_S} s"
                    ),
                )];
            }
            Err(NoRoute::Policy(e)) => {
                shared.metrics.no_replica.fetch_add(1, Ordering::Relaxed);
                return vec![self.refuse(
                    503,
                    "no_replica",
                    format!("no replica available: {e:?}"),
                )];
            }
        };
        let d = &routed.decision;
        let Ok(primary) = endpoint_of(&routed.guard.replica().url) else {
            return vec![self.refuse(
                503,
                "no_replica",
                "the picked replica has no ip:port endpoint".into(),
            )];
        };
        let mut list = vec![primary];
        list.extend(self.fallback_list(d.replica, picker.fallbacks));
        if let Some(row) = self.row.as_mut() {
            row.attempts = 1;
            row.replica = Some(d.replica);
            row.branch = Some(d.branch.as_str().into());
            row.predicted_match_tokens = Some(u64::from(d.predicted_match_tokens));
            row.outstanding_chosen = Some(d.outstanding_chosen);
            row.outstanding_min = Some(d.outstanding_min);
            row.decide_ns = Some(routed.decide_ns);
        }
        let out = self.answers(&list, has_body, body_ends);
        self.picked = Some(Picked {
            branch: d.branch.as_str(),
            decide_ns: routed.decide_ns,
            picked: d.replica,
            guard: routed.guard,
            keys,
            tokens_per_block,
            session,
        });
        self.pre_ns = shared
            .clock
            .now_ns()
            .saturating_sub(t_body)
            .saturating_sub(tokenize_ns);
        out
    }

    fn on_response_headers(
        &mut self,
        h: &HttpHeaders,
        served: Option<&str>,
    ) -> Vec<ProcessingResponse> {
        let t0 = self.shared().clock.now_ns();
        self.response_head_seen = true;
        let status = header(h, ":status")
            .and_then(|s| std::str::from_utf8(s).ok())
            .and_then(|s| s.parse::<u16>().ok());
        let kind = BodyKind::from_content_type(header(h, "content-type"));
        self.scanner = Some(UsageScanner::new(kind));
        let picker = self.picker.clone();
        let shared = &picker.shared;
        if let Some(p) = self.picked.as_mut() {
            // The endpoint the proxy used: its report, else (a proxy that does not report) the
            // pick itself.
            let served_replica = served
                .and_then(|s| parse_endpoint_list(s).first().copied())
                .and_then(|ep| replica_at(shared, &ep.to_string()));
            let replica = match served_replica {
                Some(r) if r.id != p.guard.replica().id => {
                    // A fallback served it: the picked replica failed the proxy's attempt (passive
                    // health, as the router counts a refused connection), and the load moves.
                    let picked = p.guard.replica();
                    picked.upstream_errors.fetch_add(1, Ordering::Relaxed);
                    picked.record_failure(shared.settings.health_fails_to_down);
                    p.guard = shared.take_load(&r);
                    r
                }
                _ => p.guard.replica().clone(),
            };
            if status.is_some_and(|s| s < 500) {
                replica.record_request_ok();
                replica.served.fetch_add(1, Ordering::Relaxed);
                shared.metrics.record_decision(p.branch, p.decide_ns);
                let req = RouteRequest {
                    session_id: p.session.as_deref(),
                    block_keys: &p.keys,
                    tokens_per_block: p.tokens_per_block,
                    now_us: shared.clock.now_us(),
                };
                shared.served(&req, p.picked, &replica);
            } else {
                replica.upstream_errors.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(row) = self.row.as_mut() {
                row.replica = Some(replica.id);
                if replica.id != p.picked {
                    row.attempts = row.attempts.max(2);
                }
            }
        }
        if let Some(row) = self.row.as_mut() {
            row.upstream_status = status;
        }
        self.pre_ns += self.shared().clock.now_ns().saturating_sub(t0);
        // The served replica's id, as the router's responses carry it.
        let mutation = self
            .row
            .as_ref()
            .and_then(|r| r.replica)
            .map(|id| HeaderMutation {
                set_headers: vec![set_header(REPLICA_HEADER, &id.to_string())],
                ..HeaderMutation::default()
            });
        let out = vec![response(processing_response::Response::ResponseHeaders(
            HeadersResponse {
                response: Some(continue_headers(mutation)),
            },
        ))];
        if h.end_of_stream {
            self.complete(None);
        }
        out
    }

    fn on_response_body(&mut self, b: HttpBody) -> Vec<ProcessingResponse> {
        if let Some(s) = self.scanner.as_mut() {
            s.feed(&b.body);
        }
        let eos = b.end_of_stream;
        let out = vec![response(processing_response::Response::ResponseBody(
            BodyResponse {
                response: Some(streamed(b.body, eos)),
            },
        ))];
        if eos {
            self.complete(None);
        }
        out
    }

    /// Writes the row (once) and releases the load.
    fn complete(&mut self, error: Option<String>) {
        let picked = self.picked.take();
        let Some(mut row) = self.row.take() else {
            return;
        };
        if let Some(u) = self.scanner.as_mut().and_then(UsageScanner::finish) {
            row.prompt_tokens = u.prompt_tokens;
            let reports = picked
                .as_ref()
                .map(|p| &p.guard.replica().reports_cached_tokens);
            row.cached_tokens = match (u.cached_tokens, reports) {
                (Some(c), Some(r)) => {
                    r.store(true, Ordering::Relaxed);
                    Some(c)
                }
                (Some(c), None) => Some(c),
                (None, Some(r)) if r.load(Ordering::Relaxed) => Some(0),
                (None, _) => None,
            };
        }
        if picked.is_some() {
            let overhead_us = self.pre_ns / 1000;
            self.shared().metrics.record_overhead(overhead_us);
            row.overhead_us = Some(overhead_us);
        }
        row.error = error.or_else(|| {
            row.upstream_status
                .filter(|s| *s >= 400)
                .map(|s| format!("http: upstream status {s}"))
        });
        drop(picked);
        self.shared().rows.send(row);
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        if self.row.is_some() {
            let stage = if self.response_head_seen {
                "before the response ended"
            } else if self.decided {
                "before the response head"
            } else {
                "while sending the request body"
            };
            self.shared()
                .metrics
                .client_disconnects
                .fetch_add(1, Ordering::Relaxed);
            self.complete(Some(format!("client: disconnected {stage}")));
        }
    }
}
