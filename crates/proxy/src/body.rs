//! Response bodies: the frame-by-frame proxied stream and the router's own small bodies.
//!
//! [`ProxyBody`] hands each upstream frame to hyper as soon as it arrives (no buffering, no
//! `collect()`), scans it for the usage chunk in passing, and finishes the request's row when the
//! body ends or is dropped. A mid-stream upstream failure on an SSE response — the replica's
//! connection failing, or no frame for the idle-stream timeout — becomes an OpenAI-style error
//! event followed by `data: [DONE]`, as vLLM itself ends a failed stream.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::Full;
use hyper::body::{Body, Frame, Incoming, SizeHint};

use crate::rows::RouterRow;
use crate::state::{LoadGuard, Shared};
use crate::usage::{BodyKind, UsageScanner};

/// Error type of response bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Everything needed to finish a proxied request's row; taken exactly once.
pub(crate) struct Finish {
    pub shared: Arc<Shared>,
    pub row: RouterRow,
    pub guard: LoadGuard,
    /// Router work before the upstream write (arrival → written, minus tokenize), µs.
    pub pre_us: u64,
    /// When the upstream response head arrived, clock ns.
    pub upstream_first_ns: u64,
    /// When hyper first asked for body bytes (client head being written), clock ns.
    pub client_first_ns: Option<u64>,
    /// The prompt's length as the router tokenized it (`service::RouteKeys::prompt_tokens`),
    /// compared with the engine's `usage.prompt_tokens` when both are known. Kept here, not in
    /// the row: published `router.csv` files must rebuild byte for byte.
    pub router_prompt_tokens: Option<u32>,
    /// The API key the request was admitted with ([`crate::keys::Admission::key`]): the
    /// response's prompt + completion tokens are charged to it when it ends.
    pub api_key: Option<usize>,
}

/// Largest write the router assembles from upstream frames that are already waiting.
const COALESCE_MAX_BYTES: usize = 64 << 10;

/// An upstream poll result held over to the next `poll_frame` (after coalescing stopped at it).
enum Stashed {
    Frame(Frame<Bytes>),
    End,
    Err(hyper::Error),
}

/// The idle-stream deadline: one timer per response, re-armed only when it fires (from the
/// last frame's time), never per frame.
struct IdleTimer {
    limit: Duration,
    /// When the last upstream frame (or the head) arrived, router clock ns.
    last_frame_ns: u64,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl IdleTimer {
    /// Polled when the upstream has nothing: ready (with the silence so far, ms) once no frame
    /// came for `limit`. The timer keeps the deadline it was armed with; frames only move
    /// `last_frame_ns`, and a timer that fires early is re-armed from it. The clock is read only
    /// when the timer is unarmed or has fired, not on every idle poll.
    fn poll_expired(&mut self, now_ns: impl Fn() -> u64, cx: &mut Context<'_>) -> Poll<u64> {
        if let Some(sleep) = &mut self.sleep
            && sleep.as_mut().poll(cx).is_pending()
        {
            return Poll::Pending;
        }
        let now_ns = now_ns();
        let deadline_ns = self
            .last_frame_ns
            .saturating_add(self.limit.as_nanos() as u64);
        if now_ns >= deadline_ns {
            return Poll::Ready((now_ns - self.last_frame_ns) / 1_000_000);
        }
        // Unarmed, or armed for an earlier frame: (re-)arm for the latest one and register the
        // waker.
        let at = tokio::time::Instant::now() + Duration::from_nanos(deadline_ns - now_ns);
        let sleep = match &mut self.sleep {
            Some(sleep) => {
                sleep.as_mut().reset(at);
                sleep
            }
            None => self.sleep.insert(Box::pin(tokio::time::sleep_until(at))),
        };
        if sleep.as_mut().poll(cx).is_ready() {
            cx.waker().wake_by_ref();
        }
        Poll::Pending
    }
}

/// A proxied upstream response body.
pub struct ProxyBody {
    inner: Incoming,
    stash: Option<Stashed>,
    scanner: UsageScanner,
    finish: Option<Finish>,
    injected: Option<Bytes>,
    done: bool,
    idle: IdleTimer,
}

impl ProxyBody {
    pub(crate) fn new(inner: Incoming, kind: BodyKind, finish: Finish) -> Self {
        let idle = IdleTimer {
            limit: finish.shared.settings.upstream_idle_timeout,
            last_frame_ns: finish.upstream_first_ns,
            sleep: None,
        };
        ProxyBody {
            inner,
            stash: None,
            scanner: UsageScanner::new(kind),
            finish: Some(finish),
            injected: None,
            done: false,
            idle,
        }
    }

    /// Appends upstream frames that are already waiting to `first`, so a backlog goes out in one
    /// write instead of one syscall per frame; never waits for more (frames still go out as they
    /// arrive). Whatever stopped the merge (end, error, trailers) is stashed for the next poll.
    ///
    /// Kept, although hyper's writer also gathers the frames that are ready into one vectored
    /// write: with the merge removed, the live-against-virtual cross-check failed at ws3-s0
    /// (prefix-affinity's live goodput 6.1% below virtual, 3 December 2026), where proxy-bench,
    /// whose upstream events come 8 ms apart and never queue, could not tell the two apart.
    fn coalesce(&mut self, first: Bytes, cx: &mut Context<'_>) -> Bytes {
        let mut merged: Option<BytesMut> = None;
        while merged.as_ref().map_or(first.len(), BytesMut::len) < COALESCE_MAX_BYTES {
            match Pin::new(&mut self.inner).poll_frame(cx) {
                Poll::Pending => break,
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(more) => merged
                        .get_or_insert_with(|| BytesMut::from(&first[..]))
                        .extend_from_slice(&more),
                    Err(trailers) => {
                        self.stash = Some(Stashed::Frame(trailers));
                        break;
                    }
                },
                Poll::Ready(None) => {
                    self.stash = Some(Stashed::End);
                    break;
                }
                Poll::Ready(Some(Err(e))) => {
                    self.stash = Some(Stashed::Err(e));
                    break;
                }
            }
        }
        merged.map_or(first, BytesMut::freeze)
    }

    fn clock_ns(&self) -> u64 {
        match &self.finish {
            Some(f) => f.shared.clock.now_ns(),
            None => self.idle.last_frame_ns,
        }
    }

    /// Ends the response on an upstream failure: counted (stream error, the replica's upstream
    /// errors, passive health), the row completed, and the client told — an error event and
    /// `[DONE]` on an SSE stream, else the body's error (hyper cuts the response).
    fn fail(
        &mut self,
        msg: String,
        code: u16,
        err: Option<BoxError>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.done = true;
        if let Some(f) = &self.finish {
            f.shared
                .metrics
                .stream_errors
                .fetch_add(1, Ordering::Relaxed);
            let replica = f.guard.replica();
            replica.upstream_errors.fetch_add(1, Ordering::Relaxed);
            replica.record_failure(f.shared.settings.health_fails_to_down);
        }
        let sse = self.scanner.kind() == BodyKind::Sse;
        let ev = sse.then(|| error_event(&msg, code, self.scanner.mid_event()));
        self.complete(Some(format!("stream: {msg}")));
        match ev {
            Some(ev) => Poll::Ready(Some(Ok(Frame::data(ev)))),
            None => Poll::Ready(Some(Err(err.unwrap_or_else(|| msg.into())))),
        }
    }

    fn complete(&mut self, error: Option<String>) {
        let Some(mut f) = self.finish.take() else {
            return;
        };
        let now = f.shared.clock.now_ns();
        let client_first = f.client_first_ns.unwrap_or(now);
        let post_us = client_first.saturating_sub(f.upstream_first_ns) / 1000;
        let overhead_us = f.pre_us + post_us;
        f.shared.metrics.record_overhead(overhead_us);
        f.row.overhead_us = Some(overhead_us);
        if let Some(u) = self.scanner.finish() {
            if let (Some(key), Some(keys)) = (f.api_key, f.shared.keys()) {
                let used = u.prompt_tokens.unwrap_or(0) + u.completion_tokens.unwrap_or(0);
                keys.charge(key, used, now);
            }
            f.row.prompt_tokens = u.prompt_tokens;
            if let (Some(router), Some(engine)) = (f.router_prompt_tokens, u.prompt_tokens) {
                f.shared
                    .metrics
                    .record_prompt_tokens(&f.row.request_id, u64::from(router), engine);
            }
            let reports = &f.guard.replica().reports_cached_tokens;
            f.row.cached_tokens = match u.cached_tokens {
                Some(c) => {
                    reports.store(true, Ordering::Relaxed);
                    Some(c)
                }
                None if reports.load(Ordering::Relaxed) => Some(0),
                None => None,
            };
        }
        f.row.error = error.or_else(|| {
            f.row
                .upstream_status
                .filter(|s| *s >= 400)
                .map(|s| format!("http: upstream status {s}"))
        });
        // Release the load before queueing the row, so the replica is free as early as possible.
        drop(f.guard);
        f.shared.rows.send(f.row);
    }
}

fn error_event(message: &str, code: u16, terminate_partial: bool) -> Bytes {
    let body = serde_json::json!({
        "error": {"message": message, "type": "upstream_error", "param": null, "code": code}
    });
    let mut out = String::with_capacity(160);
    if terminate_partial {
        out.push_str("\n\n");
    }
    out.push_str("data: ");
    out.push_str(&body.to_string());
    out.push_str("\n\ndata: [DONE]\n\n");
    Bytes::from(out)
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if let Some(f) = this.finish.as_mut()
            && f.client_first_ns.is_none()
        {
            f.client_first_ns = Some(f.shared.clock.now_ns());
        }
        if let Some(ev) = this.injected.take() {
            return Poll::Ready(Some(Ok(Frame::data(ev))));
        }
        if this.done {
            return Poll::Ready(None);
        }
        let next = match this.stash.take() {
            Some(s) => s,
            None => match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => {
                    let clock = this.finish.as_ref().map(|f| f.shared.clock);
                    let last = this.idle.last_frame_ns;
                    let now = || clock.map_or(last, |c| c.now_ns());
                    return match this.idle.poll_expired(now, cx) {
                        Poll::Pending => Poll::Pending,
                        Poll::Ready(silent_ms) => {
                            let msg = format!(
                                "replica sent nothing for {silent_ms} ms (idle-stream timeout {} ms)",
                                this.idle.limit.as_millis()
                            );
                            if let Some(f) = &this.finish {
                                f.shared
                                    .metrics
                                    .upstream_timeouts
                                    .fetch_add(1, Ordering::Relaxed);
                            }
                            this.fail(msg, 504, None)
                        }
                    };
                }
                Poll::Ready(Some(Ok(frame))) => Stashed::Frame(frame),
                Poll::Ready(None) => Stashed::End,
                Poll::Ready(Some(Err(e))) => Stashed::Err(e),
            },
        };
        match next {
            Stashed::Frame(frame) => match frame.into_data() {
                Ok(data) => {
                    let data = this.coalesce(data, cx);
                    this.idle.last_frame_ns = this.clock_ns();
                    this.scanner.feed(&data);
                    Poll::Ready(Some(Ok(Frame::data(data))))
                }
                Err(trailers) => Poll::Ready(Some(Ok(trailers))),
            },
            Stashed::End => {
                this.done = true;
                this.complete(None);
                Poll::Ready(None)
            }
            Stashed::Err(e) => {
                let msg = format!("replica failed mid-stream: {e}");
                this.fail(msg, 502, Some(e.into()))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.injected.is_none() && self.stash.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        if self.done {
            SizeHint::with_exact(0)
        } else {
            self.inner.size_hint()
        }
    }
}

impl Drop for ProxyBody {
    fn drop(&mut self) {
        if self.finish.is_some() {
            // Everything the client needed went through: a hang-up now is not a failure.
            if self.scanner.saw_done() || self.inner.is_end_stream() {
                self.complete(None);
                return;
            }
            let error = self
                .finish
                .as_ref()
                .map(|f| f.shared.dropped_error("before the response ended"));
            self.complete(error);
        }
    }
}

/// Every response body the router produces.
// The proxied variant is the common one; boxing it would add an allocation per request to save
// moving a few hundred bytes on the rare small-body path.
#[allow(clippy::large_enum_variant)]
pub enum RouterBody {
    /// A proxied upstream body.
    Proxy(ProxyBody),
    /// A body the router wrote itself (errors, admin, metrics, small upstream replies).
    Full(Full<Bytes>),
}

impl RouterBody {
    /// A complete body.
    pub fn full(b: impl Into<Bytes>) -> Self {
        RouterBody::Full(Full::new(b.into()))
    }
}

impl Body for RouterBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            RouterBody::Proxy(p) => Pin::new(p).poll_frame(cx),
            RouterBody::Full(f) => Pin::new(f).poll_frame(cx).map_err(|never| match never {}),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RouterBody::Proxy(p) => p.is_end_stream(),
            RouterBody::Full(f) => f.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RouterBody::Proxy(p) => p.size_hint(),
            RouterBody::Full(f) => f.size_hint(),
        }
    }
}
