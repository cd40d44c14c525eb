//! The pooled upstream HTTP/1 client and the request body that timestamps its own write.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::uri::{Authority, Scheme};
use hyper::body::{Body, Frame, SizeHint};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// The router's monotonic clock: nanoseconds since router start.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    base: Instant,
}

impl Clock {
    /// A clock starting now.
    pub fn new() -> Self {
        Clock {
            base: Instant::now(),
        }
    }

    /// Nanoseconds since the clock's start.
    pub fn now_ns(&self) -> u64 {
        self.base.elapsed().as_nanos() as u64
    }

    /// Microseconds since the clock's start.
    pub fn now_us(&self) -> u64 {
        self.base.elapsed().as_micros() as u64
    }
}

impl Default for Clock {
    fn default() -> Self {
        Clock::new()
    }
}

/// A complete request body sent in one frame; records (into `stamp`, as [`Clock`] ns) the moment
/// hyper polls it, i.e. when the request head has been written and the body is being written.
#[derive(Debug)]
pub struct TimedBody {
    data: Option<Bytes>,
    stamp: Option<(Arc<AtomicU64>, Clock)>,
}

impl TimedBody {
    /// A body that records when it is written.
    pub fn timed(data: Bytes, stamp: Arc<AtomicU64>, clock: Clock) -> Self {
        TimedBody {
            data: Some(data),
            stamp: Some((stamp, clock)),
        }
    }

    /// A plain body.
    pub fn plain(data: Bytes) -> Self {
        TimedBody {
            data: Some(data),
            stamp: None,
        }
    }

    /// No body.
    pub fn empty() -> Self {
        TimedBody {
            data: None,
            stamp: None,
        }
    }
}

impl Body for TimedBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some((stamp, clock)) = self.stamp.take() {
            stamp.store(clock.now_ns(), Ordering::Release);
        }
        Poll::Ready(
            self.data
                .take()
                .filter(|d| !d.is_empty())
                .map(|d| Ok(Frame::data(d))),
        )
    }

    fn is_end_stream(&self) -> bool {
        self.data.as_ref().is_none_or(Bytes::is_empty) && self.stamp.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.data.as_ref().map_or(0, |d| d.len() as u64))
    }
}

/// The upstream client type.
pub type UpstreamClient = Client<HttpConnector, TimedBody>;

/// The upstream client with `TCP_NODELAY` (SSE chunks must not wait for Nagle): pooled
/// keep-alive connections, or with `keep_alive` false none kept idle, so every request opens its
/// own connection (`--no-upstream-keep-alive`).
pub fn client(keep_alive: bool) -> UpstreamClient {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    conn.set_connect_timeout(Some(Duration::from_secs(5)));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(if keep_alive { 1024 } else { 0 })
        .build(conn)
}

/// Scheme and authority of a replica base URL (`http://host:port`, optional trailing slash;
/// paths are not supported because the router forwards the client's path unchanged).
pub fn parse_base_url(url: &str) -> Result<(Scheme, Authority), String> {
    let uri: http::Uri = url
        .parse()
        .map_err(|e| format!("bad replica URL {url:?}: {e}"))?;
    let scheme = uri
        .scheme()
        .cloned()
        .ok_or_else(|| format!("replica URL {url:?} has no scheme"))?;
    if scheme != Scheme::HTTP {
        return Err(format!("replica URL {url:?}: only http:// is supported"));
    }
    let authority = uri
        .authority()
        .cloned()
        .ok_or_else(|| format!("replica URL {url:?} has no host"))?;
    if !matches!(uri.path(), "" | "/") {
        return Err(format!("replica URL {url:?} must not have a path"));
    }
    Ok((scheme, authority))
}

/// `scheme://authority` + `path_and_query`.
pub fn join_uri(
    scheme: &Scheme,
    authority: &Authority,
    path_and_query: &str,
) -> Result<http::Uri, http::Error> {
    http::Uri::builder()
        .scheme(scheme.clone())
        .authority(authority.clone())
        .path_and_query(path_and_query)
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls() {
        assert!(parse_base_url("http://127.0.0.1:8000").is_ok());
        assert!(parse_base_url("http://127.0.0.1:8000/").is_ok());
        assert!(parse_base_url("https://x").is_err());
        assert!(parse_base_url("http://x/v1").is_err());
        assert!(parse_base_url("x").is_err());
        let (s, a) = parse_base_url("http://h:1").unwrap();
        assert_eq!(
            join_uri(&s, &a, "/v1/models?x=1").unwrap().to_string(),
            "http://h:1/v1/models?x=1"
        );
    }
}
