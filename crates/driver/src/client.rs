//! One streaming chat request over the public OpenAI-compatible API, timed chunk by chunk.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Uri, header};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::Serialize;
use tokio::net::TcpStream;
use tokio::time::timeout_at;

use crate::DriverError;
use crate::chunk::{Usage, error_message, parse_chunk};
use crate::metrics::ChunkMark;
use crate::sse::{SseEvent, SseParser};
use workload::Message;

/// How long a `GET /v1/models` may take before the server counts as unreachable.
const MODELS_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes of an error body kept for the row's message.
const ERROR_BODY_BYTES: usize = 64 * 1024;

/// What happened to one request.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// When the request was handed to the connection, since the clock start.
    pub sent: Duration,
    /// HTTP status; 0 when no response arrived.
    pub status: u16,
    /// Every content chunk, in arrival order.
    pub chunks: Vec<ChunkMark>,
    /// Each content chunk's text, only when the requester keeps content.
    pub contents: Vec<String>,
    /// Token counts from the usage chunk(s).
    pub usage: Usage,
    /// When the response ended (`data: [DONE]`) or failed.
    pub end: Option<Duration>,
    /// `kind: message` when the request failed.
    pub error: Option<String>,
}

impl Outcome {
    /// Output tokens: the server's count when given, else the chunk tokens summed.
    pub fn output_tokens(&self) -> Option<u64> {
        self.usage.completion_tokens.or_else(|| {
            (!self.chunks.is_empty()).then(|| self.chunks.iter().map(|c| u64::from(c.tokens)).sum())
        })
    }
}

/// One request to send.
#[derive(Debug, Clone)]
pub struct ChatRequest<'a> {
    /// `x-request-id`.
    pub request_id: &'a str,
    /// `x-session-id`.
    pub session_id: &'a str,
    /// The JSON body (see [`chat_body`]).
    pub body: Bytes,
}

#[derive(Serialize)]
struct WireMessage<'a> {
    role: &'a str,
    content: &'a str,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

#[derive(Serialize)]
struct ChatBody<'a> {
    model: &'a str,
    messages: Vec<WireMessage<'a>>,
    max_tokens: u32,
    ignore_eos: bool,
    stream: bool,
    stream_options: StreamOptions,
}

/// The `/v1/chat/completions` body: streaming, usage included, exactly `max_tokens` tokens
/// (`ignore_eos`), so every policy is asked for the same work.
pub fn chat_body(model: &str, messages: &[Message<'_>], max_tokens: u32) -> Bytes {
    let body = ChatBody {
        model,
        messages: messages
            .iter()
            .map(|m| WireMessage {
                role: m.role.as_str(),
                content: &m.content,
            })
            .collect(),
        max_tokens,
        ignore_eos: true,
        stream: true,
        stream_options: StreamOptions {
            include_usage: true,
        },
    };
    // Serializing plain strings and numbers cannot fail.
    Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
}

/// Normalizes a server URL to its base (`http://host:port[/prefix]`, no trailing `/` or `/v1`).
pub fn normalize_base_url(url: &str) -> Result<String, DriverError> {
    let bad = |why: &str| DriverError::BadUrl(format!("{url:?}: {why}"));
    let uri: Uri = url.trim().parse().map_err(|_| bad("not a URL"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => return Err(bad("https is not supported; use http://")),
        _ => return Err(bad("expected http://HOST:PORT")),
    }
    let authority = uri.authority().ok_or_else(|| bad("no host"))?;
    let mut path = uri.path().trim_end_matches('/');
    path = path.strip_suffix("/v1").unwrap_or(path);
    Ok(format!("http://{authority}{path}"))
}

/// Joins the chain of `source()`s into one line, so a connect error says "connection refused".
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut msg = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        let part = s.to_string();
        if !msg.contains(&part) {
            msg.push_str(": ");
            msg.push_str(&part);
        }
        cur = s.source();
    }
    msg
}

/// Process-wide anchor for read stamps (an `Instant` cannot live in an atomic).
fn anchor() -> Instant {
    static ANCHOR: OnceLock<Instant> = OnceLock::new();
    *ANCHOR.get_or_init(Instant::now)
}

/// When a connection last read bytes from its socket, as nanoseconds after [`anchor`]
/// (0 = never). Shared between the connection's I/O and the responses it carries.
#[derive(Clone, Debug)]
struct ReadStamp(Arc<AtomicU64>);

impl ReadStamp {
    fn instant(&self) -> Option<Instant> {
        match self.0.load(Ordering::Relaxed) {
            0 => None,
            ns => Some(anchor() + Duration::from_nanos(ns)),
        }
    }
}

/// A TCP connection that stamps every completed socket read.
///
/// Chunks are timestamped with the read that brought their bytes into the process, not with
/// the moment the request's task got around to them: on one thread serving hundreds of streams,
/// the connection task, the body channel and the parsing of earlier chunks would otherwise add
/// their queueing to every timestamp.
struct StampedIo {
    inner: TokioIo<TcpStream>,
    stamp: ReadStamp,
}

impl hyper::rt::Read for StampedIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = r {
            let ns = anchor().elapsed().as_nanos().max(1);
            self.stamp
                .0
                .store(u64::try_from(ns).unwrap_or(u64::MAX), Ordering::Relaxed);
        }
        r
    }
}

impl hyper::rt::Write for StampedIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
}

impl Connection for StampedIo {
    fn connected(&self) -> Connected {
        // The stamp travels to every response of this connection as an extension.
        self.inner.connected().extra(self.stamp.clone())
    }
}

/// [`HttpConnector`] whose connections stamp their reads.
#[derive(Clone)]
struct StampingConnector {
    http: HttpConnector,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl tower_service::Service<Uri> for StampingConnector {
    type Response = StampedIo;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<StampedIo, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.http.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.http.call(uri);
        Box::pin(async move {
            let inner = connecting.await?;
            Ok(StampedIo {
                inner,
                stamp: ReadStamp(Arc::new(AtomicU64::new(0))),
            })
        })
    }
}

/// Sends requests and times their chunks against one clock.
#[derive(Clone)]
pub struct Requester {
    client: Client<StampingConnector, Full<Bytes>>,
    base: String,
    chat_uri: Uri,
    clock_start: Instant,
    timeout: Duration,
    keep_content: bool,
}

/// The HTTP/1 client: `TCP_NODELAY`, connect timeout, and a keep-alive pool unless
/// `keep_alive` is false (then no idle connection is kept).
fn build_client(timeout: Duration, keep_alive: bool) -> Client<StampingConnector, Full<Bytes>> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(timeout.min(Duration::from_secs(10))));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(if keep_alive { usize::MAX } else { 0 })
        .build(StampingConnector { http: connector })
}

impl Requester {
    /// A requester for the server at `url` (base URL; a trailing `/v1` is accepted), timing
    /// against `clock_start`, failing each request that is not finished `timeout` after it was
    /// sent. Must be called inside a tokio runtime.
    pub fn new(url: &str, clock_start: Instant, timeout: Duration) -> Result<Self, DriverError> {
        let base = normalize_base_url(url)?;
        let chat_uri: Uri = format!("{base}/v1/chat/completions")
            .parse()
            .map_err(|_| DriverError::BadUrl(url.to_owned()))?;
        Ok(Self {
            client: build_client(timeout, true),
            base,
            chat_uri,
            clock_start,
            timeout,
            keep_content: false,
        })
    }

    /// With `keep_alive` false no connection is kept between requests: each opens its own (for
    /// llama.cpp's `llama-server`, which closes a connection after a streamed response while
    /// announcing keep-alive, so a pooled reuse fails). On by default.
    pub fn keep_alive(mut self, keep_alive: bool) -> Self {
        self.client = build_client(self.timeout, keep_alive);
        self
    }

    /// Keeps each content chunk's text in [`Outcome::contents`] (benchmarks read server
    /// timestamps from it); off by default.
    pub fn keep_content(mut self, keep: bool) -> Self {
        self.keep_content = keep;
        self
    }

    /// The normalized base URL.
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// The clock every timestamp is measured from.
    pub fn clock_start(&self) -> Instant {
        self.clock_start
    }

    fn since_start(&self) -> Duration {
        self.clock_start.elapsed()
    }

    /// `GET /v1/models`: the served model ids, in the server's order. Errors say whether the
    /// server was unreachable or answered with something that is not an OpenAI model list.
    pub async fn models(&self) -> Result<Vec<String>, DriverError> {
        let uri: Uri = format!("{}/v1/models", self.base)
            .parse()
            .map_err(|_| DriverError::BadUrl(self.base.clone()))?;
        let req = Request::get(uri)
            .body(Full::new(Bytes::new()))
            .map_err(|e| DriverError::BadUrl(e.to_string()))?;
        let deadline = tokio::time::Instant::now() + MODELS_TIMEOUT;
        let unreachable = |why: String| DriverError::Unreachable {
            url: self.base.clone(),
            why,
        };
        let resp = match timeout_at(deadline, self.client.request(req)).await {
            Err(_) => return Err(unreachable(format!("no answer within {MODELS_TIMEOUT:?}"))),
            Ok(Err(e)) => return Err(unreachable(error_chain(&e))),
            Ok(Ok(r)) => r,
        };
        let status = resp.status();
        let body = match timeout_at(deadline, resp.into_body().collect()).await {
            Ok(Ok(b)) => b.to_bytes(),
            Ok(Err(e)) => return Err(unreachable(error_chain(&e))),
            Err(_) => return Err(unreachable("model list did not finish".into())),
        };
        let not_openai = |why: String| DriverError::NotOpenAi {
            url: format!("{}/v1/models", self.base),
            why,
        };
        if !status.is_success() {
            return Err(not_openai(format!(
                "HTTP {status}: {}",
                String::from_utf8_lossy(&body[..body.len().min(200)])
            )));
        }
        let json: serde_json::Value = serde_json::from_slice(&body)
            .map_err(|e| not_openai(format!("body is not JSON ({e})")))?;
        let data = json
            .get("data")
            .and_then(|d| d.as_array())
            .ok_or_else(|| not_openai("no \"data\" array".into()))?;
        let ids: Vec<String> = data
            .iter()
            .filter_map(|m| m.get("id").and_then(|i| i.as_str()).map(str::to_owned))
            .collect();
        if ids.is_empty() {
            return Err(not_openai("the model list is empty".into()));
        }
        Ok(ids)
    }

    /// Sends one streaming chat request and reads it to the end. Never fails: every failure
    /// becomes [`Outcome::error`].
    pub async fn send(&self, req: &ChatRequest<'_>) -> Outcome {
        let mut out = Outcome::default();
        let http_req = match Request::builder()
            .method(Method::POST)
            .uri(self.chat_uri.clone())
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::ACCEPT, "text/event-stream")
            .header("x-request-id", req.request_id)
            .header("x-session-id", req.session_id)
            .body(Full::new(req.body.clone()))
        {
            Ok(r) => r,
            Err(e) => {
                out.error = Some(format!("http: cannot build request: {e}"));
                return out;
            }
        };
        let sent_at = Instant::now();
        out.sent = sent_at.saturating_duration_since(self.clock_start);
        let deadline = tokio::time::Instant::from_std(sent_at + self.timeout);
        let timeout_s = self.timeout.as_secs_f64();
        let resp = match timeout_at(deadline, self.client.request(http_req)).await {
            Err(_) => {
                out.end = Some(self.since_start());
                out.error = Some(format!("timeout: no response within {timeout_s}s"));
                return out;
            }
            Ok(Err(e)) => {
                out.end = Some(self.since_start());
                let kind = if e.is_connect() { "connect" } else { "http" };
                out.error = Some(format!("{kind}: {}", error_chain(&e)));
                return out;
            }
            Ok(Ok(r)) => r,
        };
        out.status = resp.status().as_u16();
        let content_type = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        let stamp = resp.extensions().get::<ReadStamp>().cloned();
        let mut body = resp.into_body();
        if !(200..300).contains(&out.status) || !content_type.starts_with("text/event-stream") {
            let head = read_head(&mut body, deadline).await;
            out.end = Some(self.since_start());
            let detail = serde_json::from_slice::<serde_json::Value>(&head)
                .ok()
                .and_then(|v| v.get("error").map(error_message))
                .unwrap_or_else(|| String::from_utf8_lossy(&head[..head.len().min(200)]).into());
            out.error = Some(if (200..300).contains(&out.status) {
                format!(
                    "http: not an SSE stream (content-type {content_type:?}): {}",
                    detail.trim()
                )
            } else {
                format!("http: {} {}", out.status, detail.trim())
            });
            return out;
        }
        self.read_stream(&mut body, stamp, deadline, &mut out).await;
        out
    }

    async fn read_stream(
        &self,
        body: &mut hyper::body::Incoming,
        stamp: Option<ReadStamp>,
        deadline: tokio::time::Instant,
        out: &mut Outcome,
    ) {
        let mut parser = SseParser::new();
        let mut events: Vec<SseEvent> = Vec::new();
        let mut done = false;
        let mut completion_seen = 0u64;
        loop {
            let frame = match timeout_at(deadline, body.frame()).await {
                Err(_) => {
                    out.end.get_or_insert(self.since_start());
                    if !done {
                        out.error.get_or_insert(format!(
                            "timeout: stream unfinished after {}s",
                            self.timeout.as_secs_f64()
                        ));
                    }
                    return;
                }
                Ok(None) => {
                    out.end.get_or_insert(self.since_start());
                    if !done {
                        let why = if parser.has_pending() {
                            "stream: ended inside an event, before data: [DONE]"
                        } else {
                            "stream: ended before data: [DONE]"
                        };
                        out.error.get_or_insert_with(|| why.to_owned());
                    }
                    return;
                }
                Ok(Some(Err(e))) => {
                    out.end.get_or_insert(self.since_start());
                    if !done {
                        out.error
                            .get_or_insert_with(|| format!("stream: {}", error_chain(&e)));
                    }
                    return;
                }
                Ok(Some(Ok(frame))) => frame,
            };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            // One timestamp per frame: every event completed by these bytes arrived with the
            // latest socket read (never later than now; falls back to now without a stamp).
            let now = stamp.as_ref().and_then(ReadStamp::instant).map_or_else(
                || self.since_start(),
                |t| t.saturating_duration_since(self.clock_start),
            );
            if done {
                continue;
            }
            if let Err(e) = parser.push(&data, &mut events) {
                out.end = Some(now);
                out.error.get_or_insert_with(|| format!("sse: {e}"));
                return;
            }
            for ev in events.drain(..) {
                if done {
                    break;
                }
                if ev.data == "[DONE]" {
                    done = true;
                    out.end = Some(now);
                    continue;
                }
                if ev.event == "error" {
                    let msg = serde_json::from_str::<serde_json::Value>(&ev.data)
                        .map(|v| error_message(v.get("error").unwrap_or(&v)))
                        .unwrap_or(ev.data);
                    out.error.get_or_insert_with(|| format!("upstream: {msg}"));
                    continue;
                }
                let chunk = match parse_chunk(&ev.data) {
                    Ok(c) => c,
                    Err(why) => {
                        out.end = Some(now);
                        out.error.get_or_insert_with(|| format!("sse: {why}"));
                        return;
                    }
                };
                let mut tokens = 1u32;
                if let Some(u) = chunk.usage {
                    // With per-chunk usage (vLLM's continuous_usage_stats) the growth of
                    // completion_tokens says how many tokens this chunk carried.
                    if let Some(ct) = u.completion_tokens {
                        if chunk.content.is_some() && ct > completion_seen {
                            tokens = u32::try_from(ct - completion_seen).unwrap_or(u32::MAX);
                        }
                        completion_seen = completion_seen.max(ct);
                    }
                    merge_usage(&mut out.usage, u);
                }
                if let Some(content) = chunk.content {
                    out.chunks.push(ChunkMark { at: now, tokens });
                    if self.keep_content {
                        out.contents.push(content);
                    }
                }
                if let Some(msg) = chunk.error {
                    out.error.get_or_insert_with(|| format!("upstream: {msg}"));
                }
            }
        }
    }
}

fn merge_usage(into: &mut Usage, u: Usage) {
    into.prompt_tokens = u.prompt_tokens.or(into.prompt_tokens);
    into.completion_tokens = u.completion_tokens.or(into.completion_tokens);
    into.cached_tokens = u.cached_tokens.or(into.cached_tokens);
}

/// Reads up to [`ERROR_BODY_BYTES`] of a body that is not a stream, for the error message.
async fn read_head(body: &mut hyper::body::Incoming, deadline: tokio::time::Instant) -> Vec<u8> {
    let mut head = Vec::new();
    while head.len() < ERROR_BODY_BYTES {
        match timeout_at(deadline, body.frame()).await {
            Ok(Some(Ok(frame))) => {
                if let Ok(d) = frame.into_data() {
                    head.extend_from_slice(&d);
                }
            }
            _ => break,
        }
    }
    head
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls() {
        assert_eq!(
            normalize_base_url("http://127.0.0.1:8000/").unwrap(),
            "http://127.0.0.1:8000"
        );
        assert_eq!(normalize_base_url("http://h:1/v1").unwrap(), "http://h:1");
        assert_eq!(
            normalize_base_url("http://h:1/proxy/v1/").unwrap(),
            "http://h:1/proxy"
        );
        assert!(normalize_base_url("https://h").is_err());
        assert!(normalize_base_url("localhost:8000").is_err());
        assert!(normalize_base_url("").is_err());
    }

    #[test]
    fn body_has_the_required_fields() {
        let msgs = [Message {
            role: workload::Role::User,
            content: "hi \"there\"".into(),
        }];
        let v: serde_json::Value = serde_json::from_slice(&chat_body("m", &msgs, 128)).unwrap();
        assert_eq!(v["stream"], true);
        assert_eq!(v["ignore_eos"], true);
        assert_eq!(v["max_tokens"], 128);
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["messages"][0]["content"], "hi \"there\"");
    }
}
