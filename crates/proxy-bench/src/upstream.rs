//! The in-process upstreams: hyper HTTP/1.1 keep-alive servers that stream SSE events, each
//! stamped with its send time on the bench clock, and answer `/health` and `/tokenize` (for the
//! exact-residency policy).

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderValue};
use http::{Request, Response};
use http_body_util::{BodyExt, Either, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::time::{Instant, Sleep};

use crate::now_ns;

/// A response body: whole (`/health`, `/tokenize`) or an SSE stream.
type UpstreamBody = Either<Full<Bytes>, SseBody>;

/// Serves `listener` forever: every completion request streams `events` SSE events `gap`
/// apart, then the usage chunk and `[DONE]`.
pub(crate) async fn serve(listener: TcpListener, events: usize, gap: Duration) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let svc = service_fn(move |req| respond(req, events, gap));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

async fn respond(
    req: Request<Incoming>,
    events: usize,
    gap: Duration,
) -> Result<Response<UpstreamBody>, hyper::Error> {
    let path = req.uri().path().to_owned();
    let body = req.into_body().collect().await?.to_bytes();
    let resp = match path.as_str() {
        "/health" => Response::new(Either::Left(Full::new(Bytes::new()))),
        "/tokenize" => {
            let mut r = Response::new(Either::Left(Full::new(Bytes::from(tokenize_reply(&body)))));
            r.headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            r
        }
        _ => {
            // No length: hyper sends it chunked, one chunk per event.
            let mut r = Response::new(Either::Right(SseBody::new(events, gap, body.len())));
            let h = r.headers_mut();
            h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
            h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            r
        }
    };
    Ok(resp)
}

/// `/tokenize`: one token per prompt byte, in the shape vLLM answers.
fn tokenize_reply(request: &[u8]) -> String {
    let v: serde_json::Value = serde_json::from_slice(request).unwrap_or_default();
    let tokens: Vec<u32> = v["prompt"]
        .as_str()
        .unwrap_or("")
        .bytes()
        .map(u32::from)
        .collect();
    serde_json::json!({"count": tokens.len(), "max_model_len": 8192, "tokens": tokens}).to_string()
}

/// An SSE completion stream: `events` events `gap` apart, then (at once) the usage chunk and
/// `[DONE]`. Every frame is stamped (`"t"`) when hyper polls for it, i.e. just before it is
/// written.
pub(crate) struct SseBody {
    events: usize,
    gap: Duration,
    prompt_bytes: usize,
    /// Frames produced so far (events, then the tail).
    produced: usize,
    /// Until the next event may go.
    next: Pin<Box<Sleep>>,
}

impl SseBody {
    /// A stream answering a request body of `prompt_bytes`. Needs a tokio runtime with time.
    pub(crate) fn new(events: usize, gap: Duration, prompt_bytes: usize) -> Self {
        SseBody {
            events,
            gap,
            prompt_bytes,
            produced: 0,
            next: Box::pin(tokio::time::sleep(gap)),
        }
    }
}

/// One event's text, stamped `t_ns`.
fn event(t_ns: u64) -> String {
    format!(
        "data: {{\"t\":{t_ns},\"choices\":[{{\"index\":0,\"text\":\"tok\"}}],\"usage\":null}}\n\n"
    )
}

/// The final usage chunk (also stamped) and the terminator.
fn tail(t_ns: u64, prompt_bytes: usize, events: usize) -> String {
    format!(
        "data: {{\"t\":{t_ns},\"choices\":[],\"usage\":{{\"prompt_tokens\":{prompt_bytes},\"completion_tokens\":{events},\"prompt_tokens_details\":{{\"cached_tokens\":0}}}}}}\n\ndata: [DONE]\n\n"
    )
}

impl Body for SseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        let i = this.produced;
        if i > this.events {
            return Poll::Ready(None);
        }
        // Events after the first wait out the gap; the tail follows the last event at once.
        if i > 0 && i < this.events {
            ready!(this.next.as_mut().poll(cx));
        }
        let text = if i < this.events {
            event(now_ns())
        } else {
            tail(now_ns(), this.prompt_bytes, this.events)
        };
        this.produced += 1;
        if this.produced < this.events {
            let gap = this.gap;
            this.next.as_mut().reset(Instant::now() + gap);
        }
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(text)))))
    }

    fn is_end_stream(&self) -> bool {
        self.produced > self.events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn sse_body_streams_events_then_the_usage_tail() {
        let mut body = SseBody::new(3, Duration::from_millis(1), 42);
        let mut frames = Vec::new();
        while let Some(f) = body.frame().await {
            frames.push(f.unwrap().into_data().unwrap());
        }
        assert!(body.is_end_stream());
        assert_eq!(frames.len(), 4);
        for f in &frames[..3] {
            let s = std::str::from_utf8(f).unwrap();
            assert!(
                s.starts_with("data: {\"t\":") && s.ends_with("\"usage\":null}\n\n"),
                "{s}"
            );
        }
        let t = std::str::from_utf8(&frames[3]).unwrap();
        assert!(
            t.contains("\"prompt_tokens\":42,\"completion_tokens\":3"),
            "{t}"
        );
        assert!(t.ends_with("data: [DONE]\n\n"), "{t}");
    }

    #[test]
    fn tokenize_counts_prompt_bytes() {
        let v: serde_json::Value =
            serde_json::from_str(&tokenize_reply(br#"{"prompt":"ab"}"#)).unwrap();
        assert_eq!(v["count"], 2);
        assert_eq!(v["tokens"], serde_json::json!([97, 98]));
        let v: serde_json::Value = serde_json::from_str(&tokenize_reply(b"not json")).unwrap();
        assert_eq!(v["count"], 0);
    }
}
