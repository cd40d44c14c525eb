//! A scripted OpenAI-compatible streaming server for tests and benchmarks.
//!
//! It answers `GET /v1/models` and, for `POST /v1/chat/completions` or `/v1/completions`, asks
//! a script what to send: a vLLM-shaped SSE stream with chosen chunk timings, an HTTP error, a
//! non-SSE body, raw (possibly malformed) bytes, or nothing at all. Loopback, ephemeral port;
//! dropping the server stops it and every connection.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body_util::BodyExt;
use http_body_util::channel::{Channel, Sender};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

/// The model id the server lists.
pub const MODEL: &str = "kvroute/scripted";

type Body = Channel<Bytes, std::io::Error>;

/// What the server saw of one completion request.
#[derive(Debug, Clone)]
pub struct Seen {
    /// Arrival of the request head.
    pub at: Instant,
    /// Request path.
    pub path: String,
    /// `x-request-id`, if sent.
    pub request_id: Option<String>,
    /// `x-session-id`, if sent.
    pub session_id: Option<String>,
    /// The JSON body (`Null` when it was not JSON).
    pub body: serde_json::Value,
}

/// Final usage chunk contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScriptUsage {
    /// `prompt_tokens`.
    pub prompt_tokens: u64,
    /// `completion_tokens`.
    pub completion_tokens: u64,
    /// `prompt_tokens_details.cached_tokens`; `None` omits `prompt_tokens_details`.
    pub cached_tokens: Option<u64>,
}

/// A vLLM-shaped chat stream: role chunk with the first token, content chunks, usage chunk
/// (`choices: []`), `data: [DONE]`.
#[derive(Debug, Clone)]
pub struct StreamScript {
    /// Delay from request arrival to the first content chunk.
    pub first_token_delay: Duration,
    /// `gaps[i]` = delay between content chunk `i` and `i + 1`; there are `gaps.len() + 1`
    /// content chunks.
    pub gaps: Vec<Duration>,
    /// When set, chunk `i` carries `chunk_tokens[i]` tokens and a per-chunk usage object
    /// (cumulative `completion_tokens`), as vLLM's `continuous_usage_stats` does.
    pub chunk_tokens: Option<Vec<u32>>,
    /// The final usage chunk; `None` sends none.
    pub usage: Option<ScriptUsage>,
    /// Send an error event (`{"error":{…}}`) with this message after the last content chunk.
    pub error_event: Option<String>,
    /// End with `data: [DONE]`.
    pub done: bool,
    /// When set, each chunk's content is the nanoseconds since this instant at the moment it
    /// was written (benchmarks compute delivery lag from it).
    pub stamp_content: Option<Instant>,
}

impl StreamScript {
    /// `chunks` one-token chunks: the first after `first_token_delay`, then every `gap`; usage
    /// reports `prompt_tokens` and `chunks` completion tokens; ends with `[DONE]`.
    pub fn uniform(
        first_token_delay: Duration,
        gap: Duration,
        chunks: usize,
        prompt_tokens: u64,
    ) -> Self {
        Self {
            first_token_delay,
            gaps: vec![gap; chunks.saturating_sub(1)],
            chunk_tokens: None,
            usage: Some(ScriptUsage {
                prompt_tokens,
                completion_tokens: chunks as u64,
                cached_tokens: None,
            }),
            error_event: None,
            done: true,
            stamp_content: None,
        }
    }
}

/// One reply.
#[derive(Debug, Clone)]
pub enum Reply {
    /// A streamed completion.
    Stream(StreamScript),
    /// An HTTP error with an OpenAI error body.
    Status {
        /// The status code.
        status: u16,
        /// The error message.
        message: String,
    },
    /// Raw frames: `(delay before, bytes)`; `abort` breaks the connection after the last one
    /// instead of ending the body cleanly.
    Raw {
        /// Response status.
        status: u16,
        /// `content-type` header.
        content_type: String,
        /// Frames and the delay before each.
        frames: Vec<(Duration, Bytes)>,
        /// Reset instead of finishing.
        abort: bool,
    },
    /// Never answer.
    Hang,
}

type Script = dyn Fn(&Seen) -> Reply + Send + Sync;

/// The running server. Dropping it stops it.
pub struct ScriptedServer {
    addr: SocketAddr,
    accept: tokio::task::JoinHandle<()>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Drop for ScriptedServer {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl ScriptedServer {
    /// Binds `127.0.0.1:0` and serves `script` on the current tokio runtime.
    pub async fn start(
        script: impl Fn(&Seen) -> Reply + Send + Sync + 'static,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let script: Arc<Script> = Arc::new(script);
        let seen2 = seen.clone();
        let accept = tokio::spawn(async move {
            // Owning the connections here means aborting this task closes them all.
            let mut conns = JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let script = script.clone();
                let seen = seen2.clone();
                conns.spawn(async move {
                    let svc = service_fn(move |req| handle(req, script.clone(), seen.clone()));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
                while conns.try_join_next().is_some() {}
            }
        });
        Ok(Self { addr, accept, seen })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Every completion request seen so far, in arrival order.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

fn full(status: StatusCode, content_type: &str, body: String) -> Response<Body> {
    let (mut tx, rx) = Channel::new(1);
    // A fresh channel with capacity 1 always accepts the first frame.
    let _ = tx.try_send(hyper::body::Frame::data(Bytes::from(body)));
    let mut resp = Response::new(rx);
    *resp.status_mut() = status;
    if let Ok(v) = content_type.parse() {
        resp.headers_mut().insert(header::CONTENT_TYPE, v);
    }
    resp
}

async fn handle(
    req: Request<Incoming>,
    script: Arc<Script>,
    seen: Arc<Mutex<Vec<Seen>>>,
) -> Result<Response<Body>, Infallible> {
    let at = Instant::now();
    let path = req.uri().path().to_owned();
    if req.method() == http::Method::GET && path == "/v1/models" {
        let body = serde_json::json!({
            "object": "list",
            "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "vllm",
                      "root": MODEL, "parent": null, "max_model_len": 8192}]
        });
        return Ok(full(StatusCode::OK, "application/json", body.to_string()));
    }
    if req.method() != http::Method::POST
        || !(path == "/v1/chat/completions" || path == "/v1/completions")
    {
        return Ok(full(
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found".into(),
        ));
    }
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let request_id = header("x-request-id");
    let session_id = header("x-session-id");
    let bytes = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => Bytes::new(),
    };
    let s = Seen {
        at,
        path,
        request_id,
        session_id,
        body: serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
    };
    let reply = script(&s);
    if let Ok(mut v) = seen.lock() {
        v.push(s);
    }
    Ok(match reply {
        Reply::Status { status, message } => {
            let body = serde_json::json!({"error": {"message": message, "type": "BadRequestError",
                                                    "param": null, "code": status}});
            full(
                StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                "application/json",
                body.to_string(),
            )
        }
        Reply::Hang => {
            std::future::pending::<()>().await;
            full(StatusCode::OK, "text/plain", String::new())
        }
        Reply::Raw {
            status,
            content_type,
            frames,
            abort,
        } => {
            let (tx, rx) = Channel::new(16);
            tokio::spawn(write_raw(tx, at, frames, abort));
            let mut resp = Response::new(rx);
            *resp.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
            if let Ok(v) = content_type.parse() {
                resp.headers_mut().insert(header::CONTENT_TYPE, v);
            }
            resp
        }
        Reply::Stream(script) => {
            let (tx, rx) = Channel::new(16);
            tokio::spawn(write_stream(tx, at, script));
            let mut resp = Response::new(rx);
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static("text/event-stream"),
            );
            resp
        }
    })
}

async fn write_raw(
    mut tx: Sender<Bytes, std::io::Error>,
    start: Instant,
    frames: Vec<(Duration, Bytes)>,
    abort: bool,
) {
    let mut at = start;
    for (delay, bytes) in frames {
        at += delay;
        tokio::time::sleep_until(at.into()).await;
        if tx.send_data(bytes).await.is_err() {
            return;
        }
    }
    if abort {
        tx.abort(std::io::Error::other("scripted abort"));
    }
}

fn content_chunk(content: &str, usage: Option<(u64, u64)>) -> String {
    let usage = match usage {
        Some((p, c)) => format!(
            "{{\"prompt_tokens\":{p},\"total_tokens\":{},\"completion_tokens\":{c}}}",
            p + c
        ),
        None => "null".to_owned(),
    };
    format!(
        "data: {{\"id\":\"chatcmpl-s\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"{MODEL}\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":{}}},\"logprobs\":null,\"finish_reason\":null}}],\"usage\":{usage}}}\n\n",
        serde_json::Value::String(content.to_owned())
    )
}

async fn write_stream(mut tx: Sender<Bytes, std::io::Error>, start: Instant, s: StreamScript) {
    let prompt = s.usage.map_or(0, |u| u.prompt_tokens);
    let mut at = start + s.first_token_delay;
    let mut completion = 0u64;
    for i in 0..=s.gaps.len() {
        if i > 0 {
            at += s.gaps[i - 1];
        }
        tokio::time::sleep_until(at.into()).await;
        let mut frame = String::with_capacity(600);
        if i == 0 {
            frame.push_str(&format!(
                "data: {{\"id\":\"chatcmpl-s\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"{MODEL}\",\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"\",\"reasoning_content\":null,\"tool_calls\":null}},\"logprobs\":null,\"finish_reason\":null}}],\"usage\":null}}\n\n"
            ));
        }
        let per_chunk = s.chunk_tokens.as_ref().map(|t| {
            completion += u64::from(t.get(i).copied().unwrap_or(1));
            (prompt, completion)
        });
        let content = match s.stamp_content {
            Some(base) => base.elapsed().as_nanos().to_string(),
            None => format!(" t{i}"),
        };
        frame.push_str(&content_chunk(&content, per_chunk));
        if tx.send_data(Bytes::from(frame)).await.is_err() {
            return;
        }
    }
    let mut tail = String::new();
    if let Some(msg) = &s.error_event {
        tail.push_str(&format!(
            "data: {}\n\n",
            serde_json::json!({"error": {"message": msg, "type": "InternalServerError", "param": null, "code": 500}})
        ));
    }
    if let Some(u) = s.usage {
        let details = match u.cached_tokens {
            Some(c) => format!(",\"prompt_tokens_details\":{{\"cached_tokens\":{c}}}"),
            None => String::new(),
        };
        tail.push_str(&format!(
            "data: {{\"id\":\"chatcmpl-s\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"{MODEL}\",\"choices\":[],\"usage\":{{\"prompt_tokens\":{},\"total_tokens\":{},\"completion_tokens\":{}{details}}}}}\n\n",
            u.prompt_tokens,
            u.prompt_tokens + u.completion_tokens,
            u.completion_tokens
        ));
    }
    if s.done {
        tail.push_str("data: [DONE]\n\n");
    }
    if !tail.is_empty() {
        let _ = tx.send_data(Bytes::from(tail)).await;
    }
}
