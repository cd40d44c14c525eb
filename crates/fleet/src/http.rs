//! A minimal blocking HTTP/1.1 client for control-plane calls.
//!
//! The orchestrator only needs a handful of small requests (`/health`, `/metrics`,
//! `/reset_prefix_cache`, admin calls) against plain-HTTP replicas; one request per connection
//! with `Connection: close` keeps this free of an async runtime. Streaming traffic never goes
//! through here — that is the driver's job.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};

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

/// Splits `http://host:port/path` into (`host:port`, `/path`).
pub fn split_url(url: &str) -> Result<(String, String)> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| anyhow!("unsupported URL `{url}`: only http:// is supported"))?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    if authority.is_empty() {
        bail!("URL `{url}` has no host");
    }
    let authority = if authority.contains(':') {
        authority.to_string()
    } else {
        format!("{authority}:80")
    };
    Ok((authority, path.to_string()))
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

/// `POST url` with an optional JSON body.
pub fn post(url: &str, json_body: Option<&str>, timeout: Duration) -> Result<Response> {
    request("POST", url, json_body, timeout)
}

/// One request on a fresh connection.
pub fn request(
    method: &str,
    url: &str,
    json_body: Option<&str>,
    timeout: Duration,
) -> Result<Response> {
    let (authority, path) = split_url(url)?;
    let addr = authority
        .to_socket_addrs()
        .with_context(|| format!("resolving {authority}"))?
        .next()
        .ok_or_else(|| anyhow!("{authority} resolves to no address"))?;
    let mut stream = TcpStream::connect_timeout(&addr, timeout)
        .with_context(|| format!("connecting to {url}"))?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let body = json_body.unwrap_or("");
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\nAccept: */*\r\n"
    );
    if json_body.is_some() || method == "POST" {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    head.push_str("\r\n");
    stream
        .write_all(head.as_bytes())
        .and_then(|()| stream.write_all(body.as_bytes()))
        .with_context(|| format!("sending {method} {url}"))?;
    read_response(BufReader::new(stream)).with_context(|| format!("reading {method} {url}"))
}

fn read_response(mut reader: impl BufRead) -> Result<Response> {
    let mut status_line = String::new();
    reader.read_line(&mut status_line)?;
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("malformed status line `{}`", status_line.trim()))?;
    let mut content_length: Option<usize> = None;
    let mut chunked = false;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            bail!("connection closed inside the headers");
        }
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                content_length = value.parse().ok();
            } else if name.eq_ignore_ascii_case("transfer-encoding")
                && value.to_ascii_lowercase().contains("chunked")
            {
                chunked = true;
            }
        }
    }
    let mut body = Vec::new();
    if chunked {
        loop {
            let mut size_line = String::new();
            reader.read_line(&mut size_line)?;
            let size_hex = size_line.trim().split(';').next().unwrap_or("");
            let size = usize::from_str_radix(size_hex, 16)
                .map_err(|_| anyhow!("malformed chunk size `{}`", size_line.trim()))?;
            if size == 0 {
                break;
            }
            let start = body.len();
            body.resize(start + size, 0);
            reader.read_exact(&mut body[start..])?;
            let mut crlf = [0u8; 2];
            reader.read_exact(&mut crlf)?;
        }
    } else if let Some(len) = content_length {
        body.resize(len, 0);
        reader.read_exact(&mut body)?;
    } else {
        reader.read_to_end(&mut body)?;
    }
    Ok(Response { status, body })
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(split_url("https://x").is_err());
        assert!(split_url("http:///x").is_err());
        assert_eq!(join("http://a:1/", "/health"), "http://a:1/health");
    }

    #[test]
    fn reads_plain_and_chunked_bodies() {
        let plain = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello";
        let r = read_response(&plain[..]).unwrap();
        assert_eq!((r.status, r.text().as_str()), (200, "hello"));
        let chunked = b"HTTP/1.1 503 Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        let r = read_response(&chunked[..]).unwrap();
        assert_eq!((r.status, r.text().as_str()), (503, "abcde"));
        let until_close = b"HTTP/1.0 200 OK\r\n\r\nrest";
        assert_eq!(read_response(&until_close[..]).unwrap().text(), "rest");
        assert!(read_response(&b"garbage\r\n"[..]).is_err());
    }
}
