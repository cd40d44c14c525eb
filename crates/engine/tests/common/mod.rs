//! Shared helpers of the HTTP and event tests: an in-process replica and a tiny HTTP client.

#![allow(dead_code)]

use std::net::SocketAddr;

use bytes::Bytes;
use engine::server::{self, Server, ServerConfig};
use engine::{EngineConfig, StepModel};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::TcpStream;

/// A replica at `speed` with a small pool, prompt token details on.
pub fn config(speed: f64, num_gpu_blocks: u32) -> ServerConfig {
    ServerConfig {
        enable_prompt_tokens_details: true,
        engine: EngineConfig {
            num_gpu_blocks,
            model: StepModel {
                speed,
                ..StepModel::default()
            },
            ..EngineConfig::default()
        },
        ..ServerConfig::default()
    }
}

/// Starts an in-process replica.
pub async fn start(cfg: ServerConfig) -> Server {
    server::start(cfg).await.expect("server starts")
}

/// Sends one request on a fresh connection and returns the status and the open body.
pub async fn send(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, Incoming) {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "127.0.0.1")
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(Bytes::from(body.to_owned())))
        .expect("request");
    let resp = sender.send_request(req).await.expect("response");
    (resp.status().as_u16(), resp.into_body())
}

/// Sends a request and reads the whole body.
pub async fn call(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let (status, body) = send(addr, method, path, body).await;
    let bytes = body.collect().await.expect("body").to_bytes();
    (status, String::from_utf8(bytes.to_vec()).expect("utf-8"))
}

/// Sends a request and parses the JSON answer.
pub async fn call_json(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, Value) {
    let (status, text) = call(addr, method, path, body).await;
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// Splits an SSE body into its `data:` payloads, checking the framing exactly.
pub fn sse_events(text: &str) -> Vec<String> {
    assert!(
        text.ends_with("data: [DONE]\n\n"),
        "stream must end with [DONE]: {text:?}"
    );
    let parts: Vec<&str> = text.split("\n\n").collect();
    assert_eq!(
        parts.last(),
        Some(&""),
        "every event ends with a blank line"
    );
    parts[..parts.len() - 1]
        .iter()
        .map(|p| {
            let d = p
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("event without `data: `: {p:?}"));
            assert!(!d.contains('\n'), "one line per event");
            d.to_owned()
        })
        .collect()
}

/// Keys of a JSON object, sorted.
pub fn keys(v: &Value) -> Vec<String> {
    let mut k: Vec<String> = v.as_object().expect("object").keys().cloned().collect();
    k.sort();
    k
}

/// English-like prompt of about `words` words, distinct per `tag`.
pub fn prose(tag: u32, words: usize) -> String {
    const W: [&str; 12] = [
        "cache", "router", "replica", "prefix", "session", "token", "measure", "latency", "queue",
        "block", "engine", "policy",
    ];
    let mut s = format!("Conversation {tag}:");
    for i in 0..words {
        s.push(' ');
        s.push_str(W[(i * 7 + tag as usize) % W.len()]);
    }
    s
}
