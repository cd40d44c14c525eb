//! Blocking HTTP/1.1 for control-plane calls, on [`ureq`].
//!
//! The orchestrator only needs a handful of small requests (`/health`, `/metrics`,
//! `/reset_prefix_cache`, admin calls) against plain-HTTP replicas, without an async runtime.
//! Every status is a [`Response`] (a 503 from `/health` is an answer, not an error); no
//! connection is kept between calls (a replica killed by a cycle leaves no stale connection
//! behind); no redirect is followed and no proxy from the environment is used (the replicas
//! are on loopback or the LAN). Streaming traffic never goes through here — that is the
//! driver's job.

use std::time::Duration;

use crate::error::{err, fail};
use crate::{Error, Result};
use ureq::http::Uri;

/// A response: status code and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// HTTP status code.
    pub status: u16,
    /// The whole body, de-chunked.
    pub body: Vec<u8>,
}

impl Response {
    /// The body as UTF-8 (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Splits `http://host:port/path` into (`host:port`, `/path`); port 80 when none is given.
pub fn split_url(url: &str) -> Result<(String, String)> {
    let uri: Uri = url
        .parse()
        .map_err(|e| err!(Url, "malformed URL `{url}`: {e}"))?;
    if uri.scheme_str() != Some("http") {
        fail!(Url, "unsupported URL `{url}`: only http:// is supported");
    }
    let host = uri
        .host()
        .filter(|h| !h.is_empty())
        .ok_or_else(|| err!(Url, "URL `{url}` has no host"))?;
    let port = uri.port_u16().unwrap_or(80);
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let path = if path.is_empty() { "/" } else { path };
    Ok((format!("{host}:{port}"), path.to_string()))
}

/// Joins a base URL (`http://host:port`, with or without a trailing slash) and a path.
pub fn join(base: &str, path: &str) -> String {
    format!(
        "{}/{}",
        base.trim_end_matches('/'),
        path.trim_start_matches('/')
    )
}

/// `GET url`.
pub fn get(url: &str, timeout: Duration) -> Result<Response> {
    request("GET", url, None, timeout)
}

/// `POST url` with an optional JSON body (`Content-Type: application/json` either way).
pub fn post(url: &str, json_body: Option<&str>, timeout: Duration) -> Result<Response> {
    request("POST", url, json_body, timeout)
}

/// One request on a fresh connection; `timeout` bounds the connect and each read and write.
pub fn request(
    method: &str,
    url: &str,
    json_body: Option<&str>,
    timeout: Duration,
) -> Result<Response> {
    split_url(url)?;
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .max_redirects(0)
        .max_idle_connections(0)
        .proxy(None)
        .timeout_connect(Some(timeout))
        .timeout_per_read(Some(timeout))
        .timeout_per_write(Some(timeout))
        .build()
        .into();
    let sent = match (method, json_body) {
        ("GET", None) => agent.get(url).call(),
        ("POST", body) => agent
            .post(url)
            .content_type("application/json")
            .send(body.unwrap_or("")),
        _ => fail!(
            Invalid,
            "unsupported request {method} {url} (GET without a body, or POST)"
        ),
    };
    let mut response = sent.map_err(|e| Error::Http {
        request: format!("{method} {url}"),
        source: Box::new(e),
    })?;
    let body = response
        .body_mut()
        .with_config()
        .limit(u64::MAX)
        .read_to_vec()
        .map_err(|e| Error::Http {
            request: format!("reading {method} {url}"),
            source: Box::new(e),
        })?;
    Ok(Response {
        status: response.status().as_u16(),
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    #[test]
    fn splits_urls() {
        assert_eq!(
            split_url("http://127.0.0.1:8000/metrics").unwrap(),
            ("127.0.0.1:8000".to_string(), "/metrics".to_string())
        );
        assert_eq!(
            split_url("http://example").unwrap(),
            ("example:80".to_string(), "/".to_string())
        );
        assert_eq!(
            split_url("http://h:1/a?b=c").unwrap(),
            ("h:1".to_string(), "/a?b=c".to_string())
        );
        assert!(split_url("https://x").is_err());
        assert!(split_url("http:///x").is_err());
        assert!(split_url("127.0.0.1:80").is_err());
        assert_eq!(join("http://a:1/", "/health"), "http://a:1/health");
    }

    /// Serves `answers` (raw HTTP responses) one per connection; returns the base URL and a
    /// channel with each raw request received.
    fn server(answers: Vec<&'static [u8]>) -> (String, std::sync::mpsc::Receiver<String>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for answer in answers {
                let (mut s, _) = l.accept().unwrap();
                let mut seen = Vec::new();
                let mut buf = [0u8; 1024];
                // The requests here are small: headers, and a body of at most a few bytes.
                while !String::from_utf8_lossy(&seen).contains("\r\n\r\n") {
                    let n = s.read(&mut buf).unwrap();
                    seen.extend_from_slice(&buf[..n]);
                }
                let text = String::from_utf8_lossy(&seen).into_owned();
                let length: usize = text
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length:")
                            .map(|v| v.trim().parse().unwrap())
                    })
                    .unwrap_or(0);
                let head_len = text.find("\r\n\r\n").unwrap() + 4;
                while seen.len() < head_len + length {
                    let n = s.read(&mut buf).unwrap();
                    seen.extend_from_slice(&buf[..n]);
                }
                s.write_all(answer).unwrap();
                tx.send(String::from_utf8_lossy(&seen).into_owned())
                    .unwrap();
            }
        });
        (url, rx)
    }

    #[test]
    fn reads_plain_chunked_and_until_close_bodies_with_any_status() {
        let (url, rx) = server(vec![
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
            b"HTTP/1.1 503 Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
            b"HTTP/1.0 200 OK\r\n\r\nrest",
            b"HTTP/1.1 302 Found\r\nLocation: /elsewhere\r\nContent-Length: 0\r\n\r\n",
        ]);
        let t = Duration::from_secs(5);
        let r = get(&join(&url, "/metrics"), t).unwrap();
        assert_eq!((r.status, r.text().as_str()), (200, "hello"));
        assert!(rx.recv().unwrap().starts_with("GET /metrics HTTP/1.1\r\n"));
        let r = post(&join(&url, "/reset_prefix_cache"), None, t).unwrap();
        assert_eq!((r.status, r.text().as_str()), (503, "abcde"));
        let req = rx.recv().unwrap().to_ascii_lowercase();
        assert!(
            req.starts_with("post /reset_prefix_cache http/1.1\r\n"),
            "{req}"
        );
        assert!(req.contains("content-type: application/json\r\n"), "{req}");
        assert!(req.contains("content-length: 0\r\n"), "{req}");
        let r = post(&url, Some("{}"), t).unwrap();
        assert_eq!(r.text(), "rest");
        assert!(rx.recv().unwrap().ends_with("\r\n\r\n{}"));
        assert_eq!(
            get(&url, t).unwrap().status,
            302,
            "redirects are not followed"
        );
    }

    #[test]
    fn a_closed_port_is_an_error_naming_the_url() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = format!("http://127.0.0.1:{port}/health");
        let e = get(&url, Duration::from_secs(2)).unwrap_err();
        assert!(e.chain().contains(&url), "{}", e.chain());
    }
}
