//! Test harness: the scripted upstream replicas, the deadline-bound wait and temp dirs (from
//! `test-support`, shared with the other crates' tests), a ZMQ KV-event publisher, an in-process
//! router, and an SSE client that parses streams the way OpenAI clients do.
#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use proxy::{ReplicaSpec, Router, RouterConfig};

#[allow(unused_imports)] // each test binary uses its own subset
pub use test_support::{
    MockReplica, MockState, Script, Seen, WAIT, eventually, mock_tokens, temp_dir,
};

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

    /// Binds on `endpoint` (a restarted engine publishing where its predecessor did), retrying
    /// for up to [`WAIT`] while the old socket's port is still being released.
    pub async fn bind_at(endpoint: &str) -> MockPublisher {
        use zeromq::Socket;
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            let mut sock = zeromq::PubSocket::new();
            match sock.bind(endpoint).await {
                Ok(ep) => {
                    return MockPublisher {
                        sock,
                        endpoint: ep.to_string(),
                        replay: None,
                        buffer: Arc::default(),
                        replay_task: None,
                    };
                }
                Err(e) => assert!(
                    std::time::Instant::now() < deadline,
                    "cannot bind {endpoint} again: {e}"
                ),
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
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

/// One real vLLM replica (`fleet::vllm`: the install of `scripts/vllm-server.sh`, the tiny
/// model, 32-token blocks, 80 blocks, both cores), started by the harness's own fleet (a
/// missing install fails saying how to install it), logs in `log_dir`. Blocking.
pub fn vllm_replica(log_dir: &std::path::Path) -> fleet::Fleet {
    let spec = fleet::VllmFleetSpec {
        spec: fleet::vllm::VllmSpec::new(&fleet::vllm::default_dir()),
        replicas: 1,
        cores: vec!["0-1".into()],
    };
    let options = fleet::FleetOptions {
        ready_timeout: std::time::Duration::from_secs(240),
        ..fleet::FleetOptions::new(log_dir)
    };
    let mut f =
        fleet::Fleet::new(fleet::Source::Vllm(spec), options).unwrap_or_else(|e| panic!("{e}"));
    f.start(&fleet::fleet::never)
        .unwrap_or_else(|e| panic!("{e}"));
    f
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
