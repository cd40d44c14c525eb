//! The load generator: K streams, each on its own keep-alive hyper HTTP/1.1 connection, draw
//! request numbers from a shared counter until the cell's count is reached. For every response
//! it records the time to the first event and, for every event, the delivery time (arrival minus
//! the upstream's send stamp, both on the bench clock).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE, HOST};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::now_ns;

/// Sessions the requests cycle through (`x-session-id`).
const SESSIONS: usize = 997;

/// What one cell measured.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct CellSamples {
    /// Request sent → first event received, µs (one per successful response).
    pub(crate) ttfb_us: Vec<f64>,
    /// Event sent upstream → received here, µs (one per event).
    pub(crate) delivery_us: Vec<f64>,
    /// Requests that failed (connect, non-200, broken stream).
    pub(crate) errors: usize,
}

impl CellSamples {
    fn absorb(&mut self, other: CellSamples) {
        self.ttfb_us.extend(other.ttfb_us);
        self.delivery_us.extend(other.delivery_us);
        self.errors += other.errors;
    }
}

/// Runs `requests` requests against `addr` over `streams` concurrent connections. Request ids
/// are `{tag}-{i}`, which is how the router's rows are matched back to the cell.
pub(crate) async fn run_cell(
    addr: &str,
    streams: usize,
    requests: usize,
    tag: &str,
) -> CellSamples {
    let next = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..streams)
        .map(|_| {
            let next = next.clone();
            let addr = addr.to_string();
            let tag = tag.to_string();
            tokio::spawn(async move { stream(&addr, &next, requests, &tag).await })
        })
        .collect();
    let mut all = CellSamples::default();
    for t in tasks {
        if let Ok(s) = t.await {
            all.absorb(s);
        }
    }
    all
}

/// One stream: a connection reused for request after request, reopened after a failure.
async fn stream(addr: &str, next: &AtomicUsize, requests: usize, tag: &str) -> CellSamples {
    let mut out = CellSamples::default();
    let mut conn: Option<SendRequest<Full<Bytes>>> = None;
    loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= requests {
            return out;
        }
        let sender = match conn.as_mut() {
            Some(s) => s,
            None => match connect(addr).await {
                Ok(s) => conn.insert(s),
                Err(_) => {
                    out.errors += 1;
                    continue;
                }
            },
        };
        if !one_request(sender, request(i, tag), &mut out).await {
            out.errors += 1;
            conn = None;
        }
    }
}

async fn connect(addr: &str) -> Result<SendRequest<Full<Bytes>>, Box<dyn std::error::Error>> {
    let tcp = TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(sender)
}

/// The `i`-th request: a streamed completion with a ~1 KB prompt, its own session and id.
fn request(i: usize, tag: &str) -> Request<Full<Bytes>> {
    let session = i % SESSIONS;
    let prompt = format!(
        "Session {session}: {}",
        "the quick brown fox jumps over the lazy dog. ".repeat(20)
    );
    let body = serde_json::json!({"model":"bench","prompt":prompt,"max_tokens":16,"stream":true,"stream_options":{"include_usage":true}}).to_string();
    Request::post("/v1/completions")
        .header(HOST, "bench")
        .header(CONTENT_TYPE, "application/json")
        .header("x-session-id", format!("s{session}"))
        .header("x-request-id", format!("{tag}-{i}"))
        .header(CONTENT_LENGTH, body.len())
        .body(Full::new(Bytes::from(body)))
        .expect("static request parts are valid")
}

/// Sends one request and reads its stream to the end, recording samples; false when the
/// request failed and the connection must be reopened.
async fn one_request(
    sender: &mut SendRequest<Full<Bytes>>,
    req: Request<Full<Bytes>>,
    out: &mut CellSamples,
) -> bool {
    if sender.ready().await.is_err() {
        return false;
    }
    let t0 = now_ns();
    let Ok(resp) = sender.send_request(req).await else {
        return false;
    };
    if resp.status() != StatusCode::OK {
        return false;
    }
    let mut body = resp.into_body();
    let mut sse = SseStamps::default();
    let mut first_event = true;
    loop {
        match body.frame().await {
            None => return true,
            Some(Err(_)) => return false,
            Some(Ok(frame)) => {
                let Some(data) = frame.data_ref() else {
                    continue;
                };
                let now = now_ns();
                for sent in sse.push(data) {
                    if first_event {
                        out.ttfb_us.push(now.saturating_sub(t0) as f64 / 1e3);
                        first_event = false;
                    }
                    out.delivery_us.push(now.saturating_sub(sent) as f64 / 1e3);
                }
            }
        }
    }
}

/// Splits a byte stream into SSE events (`\n\n`-terminated) and yields each event's send stamp
/// (`"t":<ns>`); events without one (`[DONE]`) are skipped. Chunks may cut events anywhere.
#[derive(Debug, Default)]
pub(crate) struct SseStamps {
    pending: Vec<u8>,
}

impl SseStamps {
    /// Takes the next chunk; returns the stamps of the events it completed, in order.
    pub(crate) fn push(&mut self, chunk: &[u8]) -> Vec<u64> {
        self.pending.extend_from_slice(chunk);
        let mut stamps = Vec::new();
        let mut start = 0;
        while let Some(end) = self.pending[start..]
            .windows(2)
            .position(|w| w == b"\n\n")
            .map(|i| start + i + 2)
        {
            if let Some(t) = stamp(&self.pending[start..end]) {
                stamps.push(t);
            }
            start = end;
        }
        self.pending.drain(..start);
        stamps
    }
}

/// The digits after the first `"t":` of an event.
fn stamp(event: &[u8]) -> Option<u64> {
    let at = event.windows(4).position(|w| w == b"\"t\":")? + 4;
    let digits = event[at..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .count();
    std::str::from_utf8(&event[at..at + digits])
        .ok()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_survive_any_chunking() {
        let stream =
            b"data: {\"t\":17,\"x\":1}\n\ndata: {\"t\":2500,\"usage\":{}}\n\ndata: [DONE]\n\n";
        for cut in 1..stream.len() {
            for cut2 in cut..stream.len() {
                let mut s = SseStamps::default();
                let mut got = s.push(&stream[..cut]);
                got.extend(s.push(&stream[cut..cut2]));
                got.extend(s.push(&stream[cut2..]));
                assert_eq!(got, [17, 2500], "cut at {cut}, {cut2}");
            }
        }
        let mut s = SseStamps::default();
        assert_eq!(
            s.push(b"data: {\"t\":\"x\"}\n\ndata: {\"t\":5"),
            Vec::<u64>::new()
        );
        assert_eq!(s.push(b"}\n\n"), [5]);
    }

    #[test]
    fn requests_carry_session_and_id() {
        let r = request(998, "r0-k50");
        assert_eq!(r.headers()["x-session-id"], "s1");
        assert_eq!(r.headers()["x-request-id"], "r0-k50-998");
        assert_eq!(r.headers()[HOST], "bench");
        assert_eq!(r.uri(), "/v1/completions");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_cell_against_an_upstream_counts_every_event() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(crate::upstream::serve(
            listener,
            3,
            std::time::Duration::from_millis(1),
        ));
        let s = run_cell(&addr, 2, 5, "r0-k2").await;
        assert_eq!(s.errors, 0);
        assert_eq!(s.ttfb_us.len(), 5);
        // 3 events and the stamped usage tail per response.
        assert_eq!(s.delivery_us.len(), 5 * 4);
        assert!(s.ttfb_us.iter().chain(&s.delivery_us).all(|&v| v >= 0.0));
    }

    #[tokio::test]
    async fn a_refused_connection_is_an_error_per_request() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let s = run_cell(&format!("127.0.0.1:{port}"), 2, 3, "r0-k2").await;
        assert_eq!(s.errors, 3);
        assert!(s.ttfb_us.is_empty());
    }
}
