//! The one mock replica: a scripted OpenAI-compatible SSE upstream (hyper on `127.0.0.1:0`).
//!
//! It answers `/health` (with scripted failures and stalls), `/v1/models`, `/tokenize` (one
//! token per byte) and `/v1/completions` / `/v1/chat/completions`, streamed (vLLM's chunk shapes,
//! the usage chunk when asked for, `[DONE]`) or not, as its [`Script`] says: events, gaps,
//! padding, error statuses, extra headers, and gates that hold a stream after its first event or
//! a response before its head until the test releases them. [`MockReplica::start`] runs it in
//! the caller's runtime; [`MockReplica::spawn`] on a runtime of its own, for tests without one.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, channel::Channel};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore};
use tokio::task::JoinSet;

use crate::WAIT;

/// What a replica answers.
#[derive(Debug, Clone)]
pub struct Script {
    /// Content events per streamed response.
    pub events: usize,
    /// Pause between content events.
    pub gap: Duration,
    /// `cached_tokens` to report; `None` omits `prompt_tokens_details`.
    pub cached_tokens: Option<u64>,
    /// After the first event, wait for a permit from [`MockState::release`] before the rest.
    pub hold: bool,
    /// Before the response head of an LLM request (whose body was read whole and counted in
    /// [`MockState::wait_requests`]), wait for a permit from [`MockState::release_heads`].
    pub hold_head: bool,
    /// Extra bytes of text per event (to exercise backpressure).
    pub pad_bytes: usize,
    /// Answer LLM requests with this error status instead (vLLM-style error body).
    pub fail_status: Option<u16>,
    /// Extra headers on every LLM response.
    pub response_headers: Vec<(String, String)>,
    /// What `usage.prompt_tokens` says: `None` (the default), the request body's length in
    /// bytes; `Some(d)`, the mock tokenizer's count of the prompt (what `/tokenize` answers for
    /// it) plus `d` — 0 agrees with a router that tokenized through `/tokenize`, anything else
    /// is a tokenization drift.
    pub prompt_tokens_offset: Option<i64>,
    /// Answer `return_token_ids` with the prompt's ids (vLLM ≥ 0.10.2: chat at the top level,
    /// completions in the choice). Off: the field is ignored, as an older engine does.
    pub return_token_ids: bool,
    /// A planted "missing BOS": generation prefills this token before the prompt, `/tokenize`
    /// does not.
    pub engine_bos: Option<u32>,
    /// A planted "other chat template": this replica renders each chat message as
    /// `role: content\n`, in `/tokenize` and in generation alike (replicas started with
    /// different templates).
    pub role_template: bool,
    /// Serve `/metrics` with vLLM's `vllm:cache_config_info{block_size=…}`; `None`: no
    /// `/metrics` (404).
    pub metrics_block_size: Option<u32>,
}

impl Default for Script {
    fn default() -> Self {
        Script {
            events: 4,
            gap: Duration::ZERO,
            cached_tokens: Some(16),
            hold: false,
            hold_head: false,
            pad_bytes: 0,
            fail_status: None,
            response_headers: Vec::new(),
            prompt_tokens_offset: None,
            return_token_ids: true,
            engine_bos: None,
            role_template: false,
            metrics_block_size: None,
        }
    }
}

/// One request a replica saw.
#[derive(Debug, Clone)]
pub struct Seen {
    /// Path.
    pub path: String,
    /// Headers.
    pub headers: HeaderMap,
    /// Body bytes.
    pub body: Bytes,
}

/// Shared state of a mock replica.
pub struct MockState {
    /// Requests seen, in arrival order (LLM endpoints only).
    pub seen: Mutex<Vec<Seen>>,
    /// Usage reported per request id: (prompt_tokens, cached_tokens).
    pub reported: Mutex<HashMap<String, (u64, Option<u64>)>>,
    /// The script.
    pub script: Mutex<Script>,
    /// Health verdict.
    pub unhealthy: AtomicBool,
    /// Tokenize calls.
    pub tokenize_calls: AtomicU64,
    /// Requests marked as the router's token-parity probes (header `x-kvroute-probe`): answered
    /// at once and unscripted, and not counted in `seen`, `reported` or `tokenize_calls`, so
    /// a test's counts and scripts see only its own traffic.
    pub probe_calls: AtomicU64,
    /// Health checks answered.
    pub health_calls: AtomicU64,
    /// The next this many health checks get 503.
    pub fail_health_next: AtomicU64,
    /// The next this many health checks are never answered (the router's probe times out).
    pub stall_health_next: AtomicU64,
    gate: Semaphore,
    head_gate: Semaphore,
    arrived: Notify,
    /// Streams whose first event was sent.
    pub first_sent: AtomicU64,
    first_notify: Notify,
}

impl MockState {
    fn new(script: Script) -> Self {
        MockState {
            seen: Mutex::new(Vec::new()),
            reported: Mutex::new(HashMap::new()),
            script: Mutex::new(script),
            unhealthy: AtomicBool::new(false),
            tokenize_calls: AtomicU64::new(0),
            probe_calls: AtomicU64::new(0),
            health_calls: AtomicU64::new(0),
            fail_health_next: AtomicU64::new(0),
            stall_health_next: AtomicU64::new(0),
            gate: Semaphore::new(0),
            head_gate: Semaphore::new(0),
            arrived: Notify::new(),
            first_sent: AtomicU64::new(0),
            first_notify: Notify::new(),
        }
    }

    /// Lets `n` held streams finish.
    pub fn release(&self, n: usize) {
        self.gate.add_permits(n);
    }

    /// Lets `n` held response heads go.
    pub fn release_heads(&self, n: usize) {
        self.head_gate.add_permits(n);
    }

    /// LLM requests seen so far.
    pub fn count(&self) -> usize {
        self.seen.lock().len()
    }

    /// Waits until at least `n` LLM requests arrived.
    pub async fn wait_requests(&self, n: usize) {
        wait_until(&self.arrived, || self.count() >= n).await;
    }

    /// Waits until at least `n` streams have sent their first event.
    pub async fn wait_first_sent(&self, n: u64) {
        wait_until(&self.first_notify, || {
            self.first_sent.load(Ordering::SeqCst) >= n
        })
        .await;
    }
}

async fn wait_until(notify: &Notify, cond: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let n = notify.notified();
        if cond() {
            return;
        }
        if tokio::time::timeout_at(deadline, n).await.is_err() {
            assert!(cond(), "condition not reached within {WAIT:?}");
            return;
        }
    }
}

/// A scripted OpenAI-compatible replica.
pub struct MockReplica {
    /// Bound address.
    pub addr: SocketAddr,
    /// `http://addr`.
    pub url: String,
    /// Shared state.
    pub state: Arc<MockState>,
    server: Option<tokio::task::JoinHandle<()>>,
    /// The runtime of a replica [`MockReplica::spawn`]ed outside any runtime.
    runtime: Option<tokio::runtime::Runtime>,
}

impl MockReplica {
    /// Starts a replica with `script`.
    pub async fn start(script: Script) -> MockReplica {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(MockState::new(script));
        let st = state.clone();
        let server = tokio::spawn(async move {
            // Connection tasks live in this set: aborting the server aborts them all, which is
            // how a test kills the replica mid-stream.
            let mut conns = JoinSet::new();
            loop {
                let (stream, _) = match listener.accept().await {
                    Ok(s) => s,
                    Err(_) => continue,
                };
                let _ = stream.set_nodelay(true);
                let st = st.clone();
                conns.spawn(async move {
                    let svc = service_fn(move |req| handle(st.clone(), req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
                while conns.try_join_next().is_some() {}
            }
        });
        MockReplica {
            addr,
            url: format!("http://{addr}"),
            state,
            server: Some(server),
            runtime: None,
        }
    }

    /// Starts a replica with `script` on a runtime of its own (one worker thread), for tests
    /// that have none; the runtime stops when the replica drops.
    pub fn spawn(script: Script) -> MockReplica {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a runtime for the mock replica");
        let mut replica = runtime.block_on(MockReplica::start(script));
        replica.runtime = Some(runtime);
        replica
    }

    /// Kills the replica: listener closed (new connections refused), open connections cut.
    pub async fn kill(&mut self) {
        if let Some(s) = self.server.take() {
            s.abort();
            let _ = s.await;
        }
    }
}

impl Drop for MockReplica {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            s.abort();
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// The mock tokenizer: one token per byte of the prompt text (chat: the contents, concatenated).
pub fn mock_tokens(v: &serde_json::Value) -> Vec<u32> {
    mock_tokens_with(v, false)
}

/// [`mock_tokens`], or with `role_template` each chat message rendered `role: content\n`.
fn mock_tokens_with(v: &serde_json::Value, role_template: bool) -> Vec<u32> {
    let mut text = String::new();
    if let Some(p) = v.get("prompt").and_then(|p| p.as_str()) {
        text.push_str(p);
    }
    if let Some(ms) = v.get("messages").and_then(|m| m.as_array()) {
        for m in ms {
            let content = m.get("content").and_then(|c| c.as_str()).unwrap_or("");
            if role_template {
                let role = m.get("role").and_then(|r| r.as_str()).unwrap_or("");
                text.push_str(&format!("{role}: {content}\n"));
            } else {
                text.push_str(content);
            }
        }
    }
    text.bytes().map(u32::from).collect()
}

/// The answer to a token-parity probe: the prompt's ids as the script's engine prefills them.
fn probe_answer(script: &Script, chat: bool, v: &serde_json::Value) -> serde_json::Value {
    let mut ids: Vec<u32> = script.engine_bos.into_iter().collect();
    ids.extend(mock_tokens_with(v, script.role_template));
    let usage = serde_json::json!({"prompt_tokens": ids.len(), "completion_tokens": 1, "total_tokens": ids.len() + 1});
    let mut out = if chat {
        serde_json::json!({"id":"p","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"t"},"finish_reason":"length"}],"usage":usage})
    } else {
        serde_json::json!({"id":"p","object":"text_completion","choices":[{"index":0,"text":"t","finish_reason":"length"}],"usage":usage})
    };
    if script.return_token_ids && v.get("return_token_ids") == Some(&serde_json::Value::Bool(true))
    {
        if chat {
            out["prompt_token_ids"] = serde_json::json!(ids);
        } else {
            out["choices"][0]["prompt_token_ids"] = serde_json::json!(ids);
        }
    }
    out
}

fn json(status: StatusCode, v: serde_json::Value) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(v.to_string())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        "application/json".parse().unwrap(),
    );
    r
}

type MockBody = http_body_util::Either<Channel<Bytes, std::convert::Infallible>, Full<Bytes>>;

async fn handle(
    st: Arc<MockState>,
    req: Request<Incoming>,
) -> Result<Response<MockBody>, std::convert::Infallible> {
    let path = req.uri().path().to_string();
    let headers = req.headers().clone();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let plain = |r: Response<Full<Bytes>>| Ok(r.map(http_body_util::Either::Right));
    let probe = headers.contains_key("x-kvroute-probe");
    if probe {
        st.probe_calls.fetch_add(1, Ordering::SeqCst);
    }
    match path.as_str() {
        "/health" => {
            let take = |n: &AtomicU64| {
                n.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1))
                    .is_ok()
            };
            if take(&st.stall_health_next) {
                // Never answered: the router's probe times out and drops the connection.
                std::future::pending::<()>().await;
            }
            st.health_calls.fetch_add(1, Ordering::SeqCst);
            let code = if st.unhealthy.load(Ordering::SeqCst) || take(&st.fail_health_next) {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                StatusCode::OK
            };
            plain(
                Response::builder()
                    .status(code)
                    .body(Full::new(Bytes::new()))
                    .unwrap(),
            )
        }
        "/v1/models" => plain(json(
            StatusCode::OK,
            serde_json::json!({"object":"list","data":[{"id":"mock-model","object":"model","owned_by":"vllm"}]}),
        )),
        "/metrics" if st.script.lock().metrics_block_size.is_some() => {
            let b = st.script.lock().metrics_block_size.unwrap_or_default();
            let text = format!(
                "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{b}\",enable_prefix_caching=\"True\",num_gpu_blocks=\"512\"}} 1.0\n"
            );
            plain(Response::new(Full::new(Bytes::from(text))))
        }
        "/tokenize" => {
            if !probe {
                st.tokenize_calls.fetch_add(1, Ordering::SeqCst);
            }
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            let role_template = st.script.lock().role_template;
            let toks = mock_tokens_with(&v, role_template);
            // One piece per byte, as vLLM's `return_token_strs` gives one per token.
            let strs =
                (v.get("return_token_strs") == Some(&serde_json::Value::Bool(true))).then(|| {
                    toks.iter()
                        .map(|&b| char::from(b as u8).to_string())
                        .collect::<Vec<_>>()
                });
            plain(json(
                StatusCode::OK,
                serde_json::json!({"count": toks.len(), "max_model_len": 8192, "tokens": toks, "token_strs": strs}),
            ))
        }
        "/v1/completions" | "/v1/chat/completions" => {
            let chat = path == "/v1/chat/completions";
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            let rid = headers
                .get("x-request-id")
                .and_then(|h| h.to_str().ok())
                .unwrap_or("")
                .to_string();
            let script = st.script.lock().clone();
            if probe {
                return plain(json(StatusCode::OK, probe_answer(&script, chat, &v)));
            }
            let prompt_tokens = match script.prompt_tokens_offset {
                None => body.len() as u64,
                Some(d) => (mock_tokens(&v).len() as i64 + d).max(0) as u64,
            };
            st.reported
                .lock()
                .insert(rid, (prompt_tokens, script.cached_tokens));
            st.seen.lock().push(Seen {
                path: path.clone(),
                headers,
                body: body.clone(),
            });
            st.arrived.notify_waiters();
            if script.hold_head {
                // Dropped here when the router abandons the request: the permit is never taken.
                if let Ok(p) = st.head_gate.acquire().await {
                    p.forget();
                }
            }
            let mut usage = serde_json::json!({"prompt_tokens": prompt_tokens, "completion_tokens": script.events, "total_tokens": prompt_tokens + script.events as u64});
            if let Some(c) = script.cached_tokens {
                usage["prompt_tokens_details"] = serde_json::json!({"cached_tokens": c});
            }
            let pad = script.pad_bytes;
            if let Some(code) = script.fail_status {
                let status = StatusCode::from_u16(code).unwrap();
                return plain(json(
                    status,
                    serde_json::json!({"error":{"message":"This model's maximum context length is 8192 tokens","type":"BadRequestError","param":null,"code":code}}),
                ));
            }
            let text = move |i: usize| format!("t{i}{}", "x".repeat(pad));
            if !v.get("stream").and_then(|s| s.as_bool()).unwrap_or(false) {
                let choice = if chat {
                    serde_json::json!({"index":0,"message":{"role":"assistant","content":"done"},"finish_reason":"length"})
                } else {
                    serde_json::json!({"index":0,"text":"done","finish_reason":"length"})
                };
                return plain(json(
                    StatusCode::OK,
                    serde_json::json!({"id":"x","choices":[choice],"usage":usage}),
                ));
            }
            let include_usage = v
                .pointer("/stream_options/include_usage")
                .and_then(|u| u.as_bool())
                .unwrap_or(false);
            let (mut tx, rx) = Channel::<Bytes, std::convert::Infallible>::new(4);
            let st2 = st.clone();
            tokio::spawn(async move {
                for i in 0..script.events {
                    if i > 0 && !script.gap.is_zero() {
                        tokio::time::sleep(script.gap).await;
                    }
                    if i == 1 && script.hold {
                        match st2.gate.acquire().await {
                            Ok(p) => p.forget(),
                            Err(_) => return,
                        }
                    }
                    let chunk = if chat {
                        serde_json::json!({"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":text(i)},"finish_reason":null}],"usage":null})
                    } else {
                        serde_json::json!({"id":"c","object":"text_completion","choices":[{"index":0,"text":text(i),"logprobs":null,"finish_reason":null,"stop_reason":null}],"usage":null})
                    };
                    if tx
                        .send(Frame::data(Bytes::from(format!("data: {chunk}\n\n"))))
                        .await
                        .is_err()
                    {
                        return;
                    }
                    if i == 0 {
                        st2.first_sent.fetch_add(1, Ordering::SeqCst);
                        st2.first_notify.notify_waiters();
                    }
                }
                if include_usage {
                    let u = serde_json::json!({"id":"c","choices":[],"usage":usage});
                    if tx
                        .send(Frame::data(Bytes::from(format!("data: {u}\n\n"))))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                let _ = tx
                    .send(Frame::data(Bytes::from_static(b"data: [DONE]\n\n")))
                    .await;
            });
            let mut r = Response::new(http_body_util::Either::Left(rx));
            r.headers_mut().insert(
                http::header::CONTENT_TYPE,
                "text/event-stream".parse().unwrap(),
            );
            for (k, v) in &script.response_headers {
                r.headers_mut().append(
                    http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                    v.parse().unwrap(),
                );
            }
            Ok(r)
        }
        _ => plain(json(
            StatusCode::NOT_FOUND,
            serde_json::json!({"error":{"message":"nope"}}),
        )),
    }
}
