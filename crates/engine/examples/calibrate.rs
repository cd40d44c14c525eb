//! End-to-end calibration check over HTTP: one replica at `--speed 1`, concurrency 1.
//!
//! `cargo run --release -p engine --example calibrate` prints TTFT p50 of unseen ~1,100-token
//! prompts, TTFT p50 of the same prompts re-sent, and the inter-token p50, against the targets
//! 329 ms / 46 ms / 7.8 ms of the reference fleet (crates/engine-core/README.md, "Defaults and
//! calibration").

use std::time::Instant;

use bytes::Bytes;
use engine::server::{self, ServerConfig};
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::net::TcpStream;

/// Token ids of an unseen prompt: exactly `n` tokens, distinct per `tag`.
fn prompt(tag: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| (tag * 7919 + i * 31) % 120_000).collect()
}

/// Streams one completion; returns (TTFT, gaps between content chunks), in ms.
async fn measure(addr: std::net::SocketAddr, ids: &[u32]) -> (f64, Vec<f64>) {
    let stream = TcpStream::connect(addr).await.expect("connect");
    stream.set_nodelay(true).expect("nodelay");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let body = json!({"prompt": ids, "max_tokens": 64, "ignore_eos": true, "stream": true});
    let req = hyper::Request::builder()
        .method("POST")
        .uri("/v1/completions")
        .header("host", "127.0.0.1")
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(Bytes::from(body.to_string())))
        .expect("request");
    let t0 = Instant::now();
    let mut resp = sender
        .send_request(req)
        .await
        .expect("response")
        .into_body();
    let mut times = Vec::new();
    while let Some(f) = resp.frame().await {
        if let Ok(d) = f.expect("frame").into_data()
            && d.starts_with(b"data: {")
        {
            times.push(t0.elapsed().as_secs_f64() * 1000.0);
        }
    }
    let gaps = times.windows(2).map(|w| w[1] - w[0]).collect();
    (times[0], gaps)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let srv = server::start(ServerConfig::default()).await.expect("start");
        let (mut unseen, mut cached, mut gaps) = (Vec::new(), Vec::new(), Vec::new());
        for tag in 0..9 {
            let ids = prompt(tag, 1100);
            let (t, g) = measure(srv.addr(), &ids).await;
            unseen.push(t);
            gaps.extend(g);
            cached.push(measure(srv.addr(), &ids).await.0);
        }
        let rows = [
            ("TTFT p50, unseen 1,100-token prompt", median(unseen), 329.0),
            ("TTFT p50, same prompt re-sent", median(cached), 46.0),
            ("inter-token p50", median(gaps), 7.8),
        ];
        println!("| quantity | emulator, ms | target, ms | error |");
        println!("|---|---:|---:|---:|");
        for (name, got, want) in rows {
            println!(
                "| {name} | {got:.1} | {want} | {:+.1}% |",
                (got - want) / want * 100.0
            );
        }
        srv.shutdown().await;
    });
}
