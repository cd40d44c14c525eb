//! Test harness: scripted upstream replicas (hyper on 127.0.0.1:0), a ZMQ KV-event publisher,
//! an in-process router, and an SSE client that parses streams the way OpenAI clients do.
#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, channel::Channel};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use parking_lot::Mutex;
use proxy::{ReplicaSpec, Router, RouterConfig};
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore};
use tokio::task::JoinSet;

/// Generous bound for anything a test waits on; reaching it is a failure, not a synchronisation.
pub const WAIT: Duration = Duration::from_secs(10);

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
        }
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
    }
}

/// The mock tokenizer: one token per byte of the prompt text (chat: the contents, concatenated).
pub fn mock_tokens(v: &serde_json::Value) -> Vec<u32> {
    let mut text = String::new();
    if let Some(p) = v.get("prompt").and_then(|p| p.as_str()) {
        text.push_str(p);
    }
    if let Some(ms) = v.get("messages").and_then(|m| m.as_array()) {
        for m in ms {
            text.push_str(m.get("content").and_then(|c| c.as_str()).unwrap_or(""));
        }
    }
    text.bytes().map(u32::from).collect()
}

fn json(status: StatusCode, v: serde_json::Value) -> Response<proxy::body::RouterBody> {
    let mut r = Response::new(proxy::body::RouterBody::full(v.to_string()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        "application/json".parse().unwrap(),
    );
    r
}

type MockBody =
    http_body_util::Either<Channel<Bytes, std::convert::Infallible>, proxy::body::RouterBody>;

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
    let plain = |r: Response<proxy::body::RouterBody>| Ok(r.map(http_body_util::Either::Right));
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
                    .body(proxy::body::RouterBody::full(Bytes::new()))
                    .unwrap(),
            )
        }
        "/v1/models" => plain(json(
            StatusCode::OK,
            serde_json::json!({"object":"list","data":[{"id":"mock-model","object":"model","owned_by":"vllm"}]}),
        )),
        "/tokenize" => {
            st.tokenize_calls.fetch_add(1, Ordering::SeqCst);
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            let toks = mock_tokens(&v);
            plain(json(
                StatusCode::OK,
                serde_json::json!({"count": toks.len(), "max_model_len": 8192, "tokens": toks, "token_strs": null}),
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
            let prompt_tokens = body.len() as u64;
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

/// A KV event publisher speaking vLLM's three-frame format, with an optional replay socket that
/// answers from everything published so far (vLLM's ROUTER protocol).
pub struct MockPublisher {
    sock: zeromq::PubSocket,
    /// Endpoint to give the router.
    pub endpoint: String,
    /// Replay endpoint, when started with one.
    pub replay: Option<String>,
    buffer: Arc<Mutex<Vec<(u64, Bytes)>>>,
    replay_task: Option<tokio::task::JoinHandle<()>>,
}

impl MockPublisher {
    /// Binds on an ephemeral loopback port.
    pub async fn bind() -> MockPublisher {
        use zeromq::Socket;
        let mut sock = zeromq::PubSocket::new();
        let ep = sock.bind("tcp://127.0.0.1:0").await.unwrap();
        MockPublisher {
            sock,
            endpoint: ep.to_string(),
            replay: None,
            buffer: Arc::default(),
            replay_task: None,
        }
    }

    /// Binds a publisher and a replay socket.
    pub async fn bind_with_replay() -> MockPublisher {
        use zeromq::{Socket, SocketRecv, SocketSend};
        let mut p = MockPublisher::bind().await;
        let mut router = zeromq::RouterSocket::new();
        let ep = router.bind("tcp://127.0.0.1:0").await.unwrap();
        p.replay = Some(ep.to_string());
        let buffer = p.buffer.clone();
        p.replay_task = Some(tokio::spawn(async move {
            while let Ok(msg) = router.recv().await {
                let frames = msg.into_vec();
                let (id, start) = match frames.as_slice() {
                    [id, empty, start] if empty.is_empty() => (id.clone(), start.clone()),
                    _ => continue,
                };
                let start = u64::from_be_bytes(start.as_ref().try_into().unwrap());
                let batches: Vec<(u64, Bytes)> = buffer
                    .lock()
                    .iter()
                    .filter(|(s, _)| *s >= start)
                    .cloned()
                    .collect();
                for (seq, payload) in batches
                    .into_iter()
                    .chain(std::iter::once((u64::MAX, Bytes::new())))
                {
                    let reply = vec![
                        id.clone(),
                        Bytes::new(),
                        Bytes::copy_from_slice(&seq.to_be_bytes()),
                        payload,
                    ];
                    let _ = router
                        .send(zeromq::ZmqMessage::try_from(reply).unwrap())
                        .await;
                }
            }
        }));
        p
    }

    /// Publishes one batch with sequence `seq` (and keeps it for replay).
    pub async fn publish(&mut self, seq: u64, payload: Vec<u8>) {
        let payload = Bytes::from(payload);
        self.buffer.lock().push((seq, payload.clone()));
        self.send_only(seq, payload).await;
    }

    /// Keeps a batch for replay without publishing it (a message lost on the wire).
    pub fn lose(&mut self, seq: u64, payload: Vec<u8>) {
        self.buffer.lock().push((seq, Bytes::from(payload)));
    }

    async fn send_only(&mut self, seq: u64, payload: Bytes) {
        use zeromq::SocketSend;
        let frames = vec![
            Bytes::from_static(b"kv@mock"),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ];
        self.sock
            .send(zeromq::ZmqMessage::try_from(frames).unwrap())
            .await
            .unwrap();
    }
}

impl Drop for MockPublisher {
    fn drop(&mut self) {
        if let Some(t) = self.replay_task.take() {
            t.abort();
        }
    }
}

/// An HTTP client for tests.
pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// A router config over `replicas` with `policy`.
pub fn router_config(replicas: &[&MockReplica], policy: &str) -> RouterConfig {
    let mut p = policies::PolicySpec::named(policy);
    p.seed = 7;
    let mut cfg = RouterConfig::new(
        replicas
            .iter()
            .map(|r| ReplicaSpec::new(r.url.clone()))
            .collect(),
        p,
    );
    cfg.health_interval_ms = 50;
    cfg
}

/// Starts a router in this runtime.
pub async fn start_router(cfg: RouterConfig) -> Router {
    Router::start(cfg).await.expect("router starts")
}

/// A streamed response, read incrementally.
pub struct SseStream {
    /// Status.
    pub status: StatusCode,
    /// Headers.
    pub headers: HeaderMap,
    body: Incoming,
    buf: Vec<u8>,
}

/// A fully read stream.
#[derive(Debug, Default)]
pub struct StreamResult {
    /// Status.
    pub status: u16,
    /// `data:` payloads before `[DONE]`.
    pub events: Vec<String>,
    /// Saw `[DONE]`.
    pub done: bool,
    /// Arrival instant of each event.
    pub times: Vec<Instant>,
    /// Response headers.
    pub headers: HeaderMap,
}

/// The replica id a response names in its `x-kvroute-replica` header.
fn replica_header(headers: &HeaderMap) -> u32 {
    headers
        .get("x-kvroute-replica")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

impl StreamResult {
    /// The `x-kvroute-replica` header.
    pub fn replica(&self) -> u32 {
        replica_header(&self.headers)
    }

    /// Error events (JSON with an `error` key).
    pub fn errors(&self) -> Vec<serde_json::Value> {
        self.events
            .iter()
            .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
            .filter(|v| v.get("error").is_some())
            .collect()
    }
}

impl SseStream {
    /// The `x-kvroute-replica` header (the replica serving this stream, while it is open).
    pub fn replica(&self) -> u32 {
        replica_header(&self.headers)
    }

    /// Next `data:` payload as OpenAI clients parse SSE (`None` at end of body).
    pub async fn next_event(&mut self) -> Option<String> {
        loop {
            if let Some(i) = self.buf.windows(2).position(|w| w == b"\n\n") {
                let ev: Vec<u8> = self.buf.drain(..i + 2).collect();
                let text = String::from_utf8_lossy(&ev[..i]).to_string();
                let data: Vec<&str> = text
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(str::trim_start)
                    .collect();
                if data.is_empty() {
                    continue;
                }
                return Some(data.join("\n"));
            }
            match self.body.frame().await {
                Some(Ok(f)) => {
                    if let Some(d) = f.data_ref() {
                        self.buf.extend_from_slice(d);
                    }
                }
                _ => return None,
            }
        }
    }

    /// Reads to `[DONE]` or the end.
    pub async fn finish(mut self) -> StreamResult {
        let mut r = StreamResult {
            status: self.status.as_u16(),
            headers: self.headers.clone(),
            ..StreamResult::default()
        };
        while let Some(ev) = tokio::time::timeout(WAIT, self.next_event())
            .await
            .expect("stream stalled")
        {
            if ev == "[DONE]" {
                r.done = true;
                break;
            }
            r.events.push(ev);
            r.times.push(Instant::now());
        }
        r
    }
}

/// Sends a JSON POST and returns the (unread) response as an SSE stream.
pub async fn post(
    url: &str,
    path: &str,
    body: serde_json::Value,
    headers: &[(&str, &str)],
) -> SseStream {
    post_raw(url, path, Bytes::from(body.to_string()), headers).await
}

/// Sends raw bytes as a POST.
pub async fn post_raw(url: &str, path: &str, body: Bytes, headers: &[(&str, &str)]) -> SseStream {
    let mut b = Request::post(format!("{url}{path}")).header("content-type", "application/json");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let resp = tokio::time::timeout(WAIT, client().request(b.body(Full::new(body)).unwrap()))
        .await
        .expect("response head")
        .expect("request");
    let (parts, body) = resp.into_parts();
    SseStream {
        status: parts.status,
        headers: parts.headers,
        body,
        buf: Vec::new(),
    }
}

/// Writes a raw HTTP/1.1 POST to `addr`: the head (with `content-length` as given) and `body`,
/// which may be shorter than declared. The connection is returned open; dropping it hangs up.
pub async fn raw_post(
    addr: SocketAddr,
    path: &str,
    content_length: usize,
    body: &[u8],
    headers: &[(&str, &str)],
) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {content_length}\r\n"
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(body).await.unwrap();
    conn.flush().await.unwrap();
    conn
}

/// Reads a whole (small) response body as JSON.
pub async fn read_json(s: SseStream) -> (u16, serde_json::Value) {
    let status = s.status.as_u16();
    let bytes = s.body.collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
    )
}

/// GET returning (status, body text).
pub async fn get(url: &str) -> (u16, String) {
    let resp = client()
        .request(Request::get(url).body(Full::new(Bytes::new())).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let b = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&b).to_string())
}

/// Sends a request with an arbitrary method and body; (status, body text).
pub async fn send(method: &str, url: &str, body: &str) -> (u16, String) {
    let (status, _, text) = send_with(method, url, body, &[]).await;
    (status, text)
}

/// Like [`send`], with extra request headers; (status, response headers, body text).
pub async fn send_with(
    method: &str,
    url: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> (u16, HeaderMap, String) {
    let mut b = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let req = b.body(Full::new(Bytes::from(body.to_string()))).unwrap();
    let resp = client().request(req).await.unwrap();
    let status = resp.status().as_u16();
    let (parts, body) = resp.into_parts();
    let b = body.collect().await.unwrap().to_bytes();
    (
        status,
        parts.headers,
        String::from_utf8_lossy(&b).to_string(),
    )
}

/// Reads from `conn` until the peer closes it (bounded by [`WAIT`]: reaching it fails the
/// test); what was read.
pub async fn read_to_eof(conn: &mut tokio::net::TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let mut out = Vec::new();
    tokio::time::timeout(WAIT, conn.read_to_end(&mut out))
        .await
        .expect("the router did not close the connection")
        .ok();
    String::from_utf8_lossy(&out).to_string()
}

/// A streamed completions body.
pub fn completion(prompt: &str) -> serde_json::Value {
    serde_json::json!({"model":"mock-model","prompt":prompt,"max_tokens":4,"stream":true,"stream_options":{"include_usage":true}})
}

/// A streamed chat body.
pub fn chat(messages: &[(&str, &str)]) -> serde_json::Value {
    let msgs: Vec<serde_json::Value> = messages
        .iter()
        .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
        .collect();
    serde_json::json!({"model":"mock-model","messages":msgs,"max_tokens":4,"stream":true,"stream_options":{"include_usage":true}})
}

/// The value of a Prometheus sample line `name{labels} value` (exact name+labels match).
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)
            .and_then(|rest| rest.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    })
}

/// Waits until `f()` holds, polling the router's own state (not a sleep-based rendezvous: the
/// condition is what is awaited; the pause only yields the core).
pub async fn eventually<F, Fut>(mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + WAIT;
    while !f().await {
        assert!(
            Instant::now() < deadline,
            "condition not reached within {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Reads router.csv into header-keyed maps.
pub fn read_rows(path: &std::path::Path) -> Vec<HashMap<String, String>> {
    let mut rd = csv::Reader::from_path(path).unwrap();
    let headers: Vec<String> = rd.headers().unwrap().iter().map(str::to_string).collect();
    rd.records()
        .map(|r| {
            let r = r.unwrap();
            headers
                .iter()
                .cloned()
                .zip(r.iter().map(str::to_string))
                .collect()
        })
        .collect()
}

/// A fresh temp directory for one test.
pub fn temp_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("proxy-it-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}
