//! Lateness benchmark: how far behind its modelled schedule an emulated replica emits.
//!
//! `cargo run --release -p engine --example lateness -- streams [SECS]` — one replica at
//! `--speed 1`, N closed-loop decode-heavy streaming clients (16-token prompts, 256 tokens out,
//! max_num_seqs = N), lateness p50/p99 per N.
//! `cargo run --release -p engine --example lateness -- fleet [SECS]` — five replicas, 32
//! closed-loop conversation users spread over them, lateness p99 (worst replica) per speed.
//! `cargo run --release -p engine --example lateness -- fleet-procs PATH/TO/engine [SECS]` — the
//! same with five `engine` processes; p99 is read from `/metrics` (the smallest
//! `kvroute_engine_lateness_seconds` bucket holding 99% of the window's steps), as the sweep does.
//! `cargo run --release -p engine --example lateness -- sched PATH/TO/engine [SECS] [ROUNDS]` —
//! the quick fleet (3 processes at speed 6) under SCHED_OTHER and SCHED_FIFO 1
//! (`--sched-fifo-priority`), interleaved per round; worst replica's p99 bucket and share of steps
//! within the sweep's bound, then the median per policy.
//! Clients run in the same process and compete for the same cores, as they do on a small box.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use engine::server::{self, Server, ServerConfig};
use engine::{EngineConfig, StepModel};
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpStream;

const WORDS: [&str; 16] = [
    "cache", "router", "replica", "prefix", "session", "token", "measure", "latency", "queue",
    "block", "engine", "policy", "window", "spread", "median", "budget",
];

/// About `tokens` tokens of text (two-token words), distinct per `tag`.
fn text(tag: u64, tokens: usize) -> String {
    let mut s = format!("Context {tag}.");
    for i in 0..tokens / 2 {
        s.push(' ');
        s.push_str(WORDS[(i as u64 * 7 + tag * 13) as usize % WORDS.len()]);
        if i % 10 == 9 {
            s.push('.');
        }
    }
    s
}

async fn connect(
    addr: SocketAddr,
) -> hyper::client::conn::http1::SendRequest<http_body_util::Full<Bytes>> {
    let stream = TcpStream::connect(addr).await.expect("connect");
    stream.set_nodelay(true).expect("nodelay");
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    sender
}

/// Streams one completion to the end; returns the generated text.
async fn stream_once(
    sender: &mut hyper::client::conn::http1::SendRequest<http_body_util::Full<Bytes>>,
    body: String,
) -> String {
    sender.ready().await.expect("connection ready");
    let req = hyper::Request::builder()
        .method("POST")
        .uri("/v1/completions")
        .header("host", "127.0.0.1")
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(Bytes::from(body)))
        .expect("request");
    let mut resp = sender
        .send_request(req)
        .await
        .expect("response")
        .into_body();
    let mut out = String::new();
    let mut buf = Vec::new();
    while let Some(f) = resp.frame().await {
        if let Ok(d) = f.expect("frame").into_data() {
            buf.extend_from_slice(&d);
        }
    }
    for ev in String::from_utf8_lossy(&buf).split("\n\n") {
        if let Some(d) = ev.strip_prefix("data: ")
            && let Ok(v) = serde_json::from_str::<Value>(d)
            && let Some(t) = v["choices"][0]["text"].as_str()
        {
            out.push_str(t);
        }
    }
    out
}

/// Shape of one closed-loop user's requests.
#[derive(Clone, Copy)]
struct Shape {
    context_tokens: usize,
    turn_tokens: usize,
    max_tokens: u32,
    turns: u64,
}

/// The reference workload: ~1,100-token context, then 8 turns of ~150 + 128 tokens.
const CONVERSATION: Shape = Shape {
    context_tokens: 1100,
    turn_tokens: 150,
    max_tokens: 128,
    turns: 8,
};

/// Decode-heavy streams (short prompts, long answers): stresses token emission.
const STREAMS: Shape = Shape {
    context_tokens: 16,
    turn_tokens: 0,
    max_tokens: 256,
    turns: 1,
};

/// A closed-loop user sending `shape` requests until `stop`, with no think time.
async fn user(addr: SocketAddr, id: u64, stop: Instant, shape: Shape) {
    let mut sender = connect(addr).await;
    let mut conv = 0u64;
    while Instant::now() < stop {
        let mut history = text(id * 1000 + conv, shape.context_tokens);
        for turn in 0..shape.turns {
            if Instant::now() >= stop {
                return;
            }
            history.push_str("\nUser: ");
            history.push_str(&text(id * 100_000 + conv * 100 + turn, shape.turn_tokens));
            history.push_str("\nAssistant:");
            let body =
                json!({"prompt": history, "max_tokens": shape.max_tokens, "ignore_eos": true,
                              "stream": true, "stream_options": {"include_usage": true}})
                .to_string();
            let reply = stream_once(&mut sender, body).await;
            history.push_str(&reply);
        }
        conv += 1;
    }
}

fn replica(speed: f64, num_gpu_blocks: u32, max_num_seqs: u32) -> ServerConfig {
    ServerConfig {
        engine: EngineConfig {
            num_gpu_blocks,
            max_num_seqs,
            model: StepModel {
                speed,
                ..StepModel::default()
            },
            ..EngineConfig::default()
        },
        ..ServerConfig::default()
    }
}

/// Lateness (µs) recorded between two snapshots: p50, p99, max, steps.
fn window(before: &Server, snap: &hdrhistogram::Histogram<u64>) -> (u64, u64, u64, u64) {
    let mut h = before.metrics().lateness_us;
    h.subtract(snap).expect("same histogram config");
    (
        h.value_at_quantile(0.5),
        h.value_at_quantile(0.99),
        h.max(),
        h.len(),
    )
}

async fn streams(secs: u64) {
    println!("| streams | steps | tokens/s | lateness p50 µs | p99 µs | max µs | p99 < 1 ms |");
    println!("|---:|---:|---:|---:|---:|---:|:---:|");
    for n in [16u64, 64, 256, 512, 1024] {
        // Room for every stream, so the cell measures the emitter, not preemption.
        let blocks = (n as u32 * 24).max(2048);
        let srv = server::start(replica(1.0, blocks, n as u32))
            .await
            .expect("start");
        let stop = Instant::now() + Duration::from_secs(2 + secs);
        let tasks: Vec<_> = (0..n)
            .map(|u| tokio::spawn(user(srv.addr(), u, stop, STREAMS)))
            .collect();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let snap = srv.metrics();
        tokio::time::sleep(Duration::from_secs(secs)).await;
        let (p50, p99, max, steps) = window(&srv, &snap.lateness_us);
        let toks = srv.metrics().counters.generation_tokens - snap.counters.generation_tokens;
        println!(
            "| {n} | {steps} | {:.0} | {p50} | {p99} | {max} | {} |",
            toks as f64 / secs as f64,
            if p99 < 1000 { "yes" } else { "no" }
        );
        for t in tasks {
            t.abort();
        }
        srv.shutdown().await;
    }
}

async fn fleet(secs: u64) {
    println!(
        "| speed | steps (5 replicas) | tokens/s | worst-replica lateness p50 µs | p99 µs | max µs | p99 < 1 ms |"
    );
    println!("|---:|---:|---:|---:|---:|---:|:---:|");
    for speed in [1.0, 2.0, 4.0, 8.0, 16.0, 32.0] {
        let mut srvs = Vec::new();
        for _ in 0..5 {
            srvs.push(
                server::start(replica(speed, engine::DEFAULT_NUM_GPU_BLOCKS, 256))
                    .await
                    .expect("start"),
            );
        }
        let warm = Duration::from_secs_f64((4.0 / speed).max(1.0));
        let stop = Instant::now() + warm + Duration::from_secs(secs);
        let tasks: Vec<_> = (0..32u64)
            .map(|u| tokio::spawn(user(srvs[(u % 5) as usize].addr(), u, stop, CONVERSATION)))
            .collect();
        tokio::time::sleep(warm).await;
        let snaps: Vec<_> = srvs.iter().map(|s| s.metrics()).collect();
        tokio::time::sleep(Duration::from_secs(secs)).await;
        let mut worst = (0, 0, 0);
        let mut steps = 0;
        let mut toks = 0;
        for (s, snap) in srvs.iter().zip(&snaps) {
            let (p50, p99, max, n) = window(s, &snap.lateness_us);
            steps += n;
            toks += s.metrics().counters.generation_tokens - snap.counters.generation_tokens;
            if p99 > worst.1 {
                worst = (p50, p99, max);
            }
        }
        println!(
            "| {speed} | {steps} | {:.0} | {} | {} | {} | {} |",
            toks as f64 / secs as f64,
            worst.0,
            worst.1,
            worst.2,
            if worst.1 < 1000 { "yes" } else { "no" }
        );
        for t in tasks {
            t.abort();
        }
        for s in srvs {
            s.shutdown().await;
        }
    }
}

/// An `engine` child process, killed on drop.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_engine(bin: &str, speed: f64, fifo_priority: u8) -> (Child, SocketAddr) {
    use std::io::BufRead;
    let mut c = std::process::Command::new(bin)
        .args(["--port", "0", "--speed", &speed.to_string()])
        .args(["--sched-fifo-priority", &fifo_priority.to_string()])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("engine binary starts");
    let out = c.stdout.take().expect("stdout");
    let child = Child(c);
    let mut line = String::new();
    std::io::BufReader::new(out)
        .read_line(&mut line)
        .expect("readiness line");
    let v: Value = serde_json::from_str(&line).expect("readiness JSON");
    let addr = v["listening"]
        .as_str()
        .expect("listening")
        .parse()
        .expect("addr");
    (child, addr)
}

/// Cumulative lateness bucket counts `(le seconds, count)` and token count from `/metrics`.
async fn scrape(addr: SocketAddr) -> (Vec<(f64, u64)>, u64) {
    let mut sender = connect(addr).await;
    let req = hyper::Request::builder()
        .uri("/metrics")
        .header("host", "127.0.0.1")
        .body(http_body_util::Full::new(Bytes::new()))
        .expect("request");
    let body = sender
        .send_request(req)
        .await
        .expect("response")
        .into_body();
    let text =
        String::from_utf8(body.collect().await.expect("body").to_bytes().to_vec()).expect("utf-8");
    let mut buckets = Vec::new();
    let mut tokens = 0;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("kvroute_engine_lateness_seconds_bucket{")
            && let Some(le) = rest.split("le=\"").nth(1).and_then(|x| x.split('"').next())
            && let Some(n) = line.rsplit(' ').next().and_then(|x| x.parse().ok())
        {
            buckets.push((le.parse().unwrap_or(f64::INFINITY), n));
        }
        if line.starts_with("vllm:generation_tokens_total{") {
            tokens = line
                .rsplit(' ')
                .next()
                .and_then(|x| x.parse().ok())
                .unwrap_or(0);
        }
    }
    (buckets, tokens)
}

async fn fleet_procs(bin: &str, secs: u64) {
    println!(
        "| speed | steps (5 replicas) | tokens/s | worst replica: share of steps ≤ 1 ms | p99 bucket | p99 < 1 ms |"
    );
    println!("|---:|---:|---:|---:|---:|:---:|");
    for speed in [1.0, 2.0, 4.0, 8.0, 16.0, 32.0] {
        let w = procs_window(bin, 5, speed, 0, secs, 0.001).await;
        println!(
            "| {speed} | {} | {:.0} | {:.4} | ≤ {} ms | {} |",
            w.steps,
            w.tokens as f64 / secs as f64,
            w.worst_share,
            w.worst_p99_s * 1000.0,
            if w.worst_share >= 0.99 { "yes" } else { "no" }
        );
    }
}

/// What [`procs_window`] measured over its window.
struct ProcsWindow {
    /// Steps of all replicas.
    steps: u64,
    /// Tokens generated by all replicas.
    tokens: u64,
    /// The worst replica's p99 bucket, s.
    worst_p99_s: f64,
    /// The worst replica's share of steps within the bound.
    worst_share: f64,
}

/// One measured window of `replicas` engine processes at `speed`: the worst replica's p99 bucket
/// (s) and the share of its steps within `bound_s`.
async fn procs_window(
    bin: &str,
    replicas: usize,
    speed: f64,
    fifo: u8,
    secs: u64,
    bound_s: f64,
) -> ProcsWindow {
    let procs: Vec<_> = (0..replicas)
        .map(|_| spawn_engine(bin, speed, fifo))
        .collect();
    let warm = Duration::from_secs_f64((4.0 / speed).max(1.0));
    let stop = Instant::now() + warm + Duration::from_secs(secs);
    let tasks: Vec<_> = (0..32u64)
        .map(|u| tokio::spawn(user(procs[u as usize % replicas].1, u, stop, CONVERSATION)))
        .collect();
    tokio::time::sleep(warm).await;
    let mut before = Vec::new();
    for (_, a) in &procs {
        before.push(scrape(*a).await);
    }
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let (mut worst_share, mut worst_p99) = (1.0f64, 0.0f64);
    let (mut steps, mut tokens) = (0, 0);
    for ((_, a), (b0, t0)) in procs.iter().zip(&before) {
        let (b1, t1) = scrape(*a).await;
        tokens += t1 - t0;
        let total = b1.last().map_or(0, |x| x.1) - b0.last().map_or(0, |x| x.1);
        steps += total;
        let within = |le: f64| {
            let get = |b: &Vec<(f64, u64)>| b.iter().find(|x| x.0 >= le).map_or(0, |x| x.1);
            get(&b1) - get(b0)
        };
        worst_share = worst_share.min(within(bound_s) as f64 / total.max(1) as f64);
        let p99 = b1
            .iter()
            .map(|x| x.0)
            .find(|&le| within(le) as f64 >= 0.99 * total as f64)
            .unwrap_or(f64::INFINITY);
        worst_p99 = worst_p99.max(p99);
    }
    for t in tasks {
        t.abort();
    }
    drop(procs);
    ProcsWindow {
        steps,
        tokens,
        worst_p99_s: worst_p99,
        worst_share,
    }
}

/// SCHED_OTHER vs SCHED_FIFO, interleaved round by round so both see the same background load.
async fn sched(bin: &str, secs: u64, rounds: usize) {
    // The quick fleet: 3 replicas at speed 6; the sweep's bound there is 0.326 ms, which the
    // buckets resolve to 0.35 ms.
    let (replicas, speed, bound_s) = (3, 6.0, 0.000_35);
    println!(
        "| round | scheduling | worst replica p99 bucket | worst replica: share of steps ≤ 0.35 ms |"
    );
    println!("|---:|---|---:|---:|");
    let mut p99s: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for round in 1..=rounds {
        for (i, fifo) in [0u8, 1].into_iter().enumerate() {
            let w = procs_window(bin, replicas, speed, fifo, secs, bound_s).await;
            let (p99, share) = (w.worst_p99_s, w.worst_share);
            p99s[i].push(p99);
            let name = if fifo == 0 { "other" } else { "fifo:1" };
            println!("| {round} | {name} | ≤ {} ms | {share:.4} |", p99 * 1000.0);
        }
    }
    for (i, name) in ["other", "fifo:1"].iter().enumerate() {
        let v = &mut p99s[i];
        v.sort_by(f64::total_cmp);
        println!(
            "{name}: median of {} worst-replica p99 buckets ≤ {} ms (min {} ms, max {} ms)",
            v.len(),
            v[v.len() / 2] * 1000.0,
            v[0] * 1000.0,
            v[v.len() - 1] * 1000.0
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let secs: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(5);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    match args.get(1).map(String::as_str) {
        Some("streams") => rt.block_on(streams(secs)),
        Some("fleet") => rt.block_on(fleet(secs)),
        Some("fleet-procs") => {
            let bin = args
                .get(2)
                .cloned()
                .unwrap_or_else(|| "target/release/engine".into());
            let secs = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(5);
            rt.block_on(fleet_procs(&bin, secs));
        }
        Some("sched") => {
            let bin = args
                .get(2)
                .cloned()
                .unwrap_or_else(|| "target/release/engine".into());
            let secs = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(10);
            let rounds = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(5);
            rt.block_on(sched(&bin, secs, rounds));
        }
        _ => eprintln!(
            "usage: lateness streams|fleet [SECS] | fleet-procs ENGINE_BIN [SECS] | sched ENGINE_BIN [SECS] [ROUNDS]"
        ),
    }
}
