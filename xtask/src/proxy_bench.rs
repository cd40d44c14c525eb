//! `proxy-bench`: what the router's own cost is, next to plain reverse proxies.
//!
//! Fast in-process SSE upstreams (each event stamped with its send time) sit behind: nothing
//! (direct), the `router` binary with each policy, HAProxy (`mode http`, `option http-no-delay`,
//! consistent hashing on `x-session-id` with `hash-balance-factor 125`) and nginx (`hash …
//! consistent`, `proxy_buffering off`). A load generator in the same process keeps K streams
//! open on keep-alive connections. Cells run interleaved in rounds (every target at every K, then
//! again), and each figure is the median over rounds of that round's p50 / p99:
//! added time to first event vs direct, added per-event delivery time vs direct, CPU seconds per
//! 1,000 requests of the proxy process(es), and the router's own `overhead_us` from its rows.
//!
//! Everything here shares the machine's cores on purpose: that is how the router is deployed in
//! the experiments. Compare ratios within one run, never absolute numbers across runs.
//!
//! Module only: wire it as `Cmd::ProxyBench(proxy_bench::ProxyBenchArgs)` →
//! `proxy_bench::run(&args)`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Flags of `cargo xtask proxy-bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct ProxyBenchArgs {
    /// The router binary (build it with `cargo build --release -p router-bin`).
    #[arg(long, default_value = "target/release/router")]
    pub router_bin: PathBuf,
    /// Concurrent streams per cell.
    #[arg(long, value_delimiter = ',', default_value = "1,50,200")]
    pub streams: Vec<usize>,
    /// Interleaved rounds (medians are taken across them).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Requests per cell = streams × waves (at least `min_requests`).
    #[arg(long, default_value_t = 3)]
    pub waves: usize,
    /// Lower bound on requests per cell.
    #[arg(long, default_value_t = 30)]
    pub min_requests: usize,
    /// SSE events per response.
    #[arg(long, default_value_t = 16)]
    pub events: usize,
    /// Gap between events, milliseconds.
    #[arg(long, default_value_t = 8)]
    pub gap_ms: u64,
    /// Upstream servers.
    #[arg(long, default_value_t = 4)]
    pub upstreams: usize,
    /// Router policies to measure.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "session-affinity,prefix-affinity,round-robin,least-outstanding,session-bounded,prefix-hash,exact-residency"
    )]
    pub policies: Vec<String>,
    /// Router worker threads.
    #[arg(long, default_value_t = 1)]
    pub router_workers: usize,
    /// HAProxy threads (`nbthread`).
    #[arg(long, default_value_t = 1)]
    pub haproxy_threads: usize,
    /// Skip HAProxy even when installed.
    #[arg(long)]
    pub no_haproxy: bool,
    /// Skip nginx even when installed.
    #[arg(long)]
    pub no_nginx: bool,
    /// Working directory (configs, router rows).
    #[arg(long, default_value = "target/proxy-bench")]
    pub dir: PathBuf,
    /// Also write the markdown table here.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Nanoseconds on the process-wide bench clock (shared by upstreams and load generator).
fn now_ns() -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    BASE.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

// ---------------------------------------------------------------------------------------------
// Upstreams: minimal HTTP/1.1 keep-alive servers streaming stamped SSE events.

async fn upstream(listener: TcpListener, events: usize, gap: Duration) {
    loop {
        let Ok((s, _)) = listener.accept().await else {
            continue;
        };
        let _ = s.set_nodelay(true);
        tokio::spawn(async move {
            let _ = serve_upstream_conn(s, events, gap).await;
        });
    }
}

struct Head {
    path: String,
    content_length: usize,
    chunked: bool,
}

/// Reads one request or response head (through `\r\n\r\n`) from `buf`+`s`; leftovers stay in buf.
async fn read_head(
    s: &mut TcpStream,
    buf: &mut Vec<u8>,
) -> std::io::Result<Option<(String, Vec<(String, String)>)>> {
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..i]).to_string();
            buf.drain(..i + 4);
            let mut lines = head.split("\r\n");
            let first = lines.next().unwrap_or("").to_string();
            let headers = lines
                .filter_map(|l| {
                    l.split_once(':')
                        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
                })
                .collect();
            return Ok(Some((first, headers)));
        }
        let mut tmp = [0u8; 16 << 10];
        let n = s.read(&mut tmp).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&tmp[..n]);
    }
}

fn parse_head(first: &str, headers: &[(String, String)]) -> Head {
    let path = first.split(' ').nth(1).unwrap_or("/").to_string();
    let content_length = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.to_ascii_lowercase().contains("chunked"));
    Head {
        path,
        content_length,
        chunked,
    }
}

async fn read_exact_buffered(
    s: &mut TcpStream,
    buf: &mut Vec<u8>,
    n: usize,
) -> std::io::Result<Vec<u8>> {
    while buf.len() < n {
        let mut tmp = [0u8; 16 << 10];
        let k = s.read(&mut tmp).await?;
        if k == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&tmp[..k]);
    }
    Ok(buf.drain(..n).collect())
}

async fn serve_upstream_conn(
    mut s: TcpStream,
    events: usize,
    gap: Duration,
) -> std::io::Result<()> {
    let mut buf = Vec::new();
    while let Some((first, headers)) = read_head(&mut s, &mut buf).await? {
        let head = parse_head(&first, &headers);
        let body = read_exact_buffered(&mut s, &mut buf, head.content_length).await?;
        match head.path.as_str() {
            "/health" => {
                s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    .await?
            }
            "/tokenize" => {
                let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                let toks: Vec<u32> = v["prompt"]
                    .as_str()
                    .unwrap_or("")
                    .bytes()
                    .map(u32::from)
                    .collect();
                let out =
                    serde_json::json!({"count": toks.len(), "max_model_len": 8192, "tokens": toks})
                        .to_string();
                s.write_all(format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{out}", out.len()).as_bytes()).await?;
            }
            _ => {
                s.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n").await?;
                for i in 0..events {
                    if i > 0 {
                        tokio::time::sleep(gap).await;
                    }
                    let ev = format!(
                        "data: {{\"t\":{},\"choices\":[{{\"index\":0,\"text\":\"tok\"}}],\"usage\":null}}\n\n",
                        now_ns()
                    );
                    s.write_all(format!("{:x}\r\n{ev}\r\n", ev.len()).as_bytes())
                        .await?;
                }
                let tail = format!(
                    "data: {{\"t\":{},\"choices\":[],\"usage\":{{\"prompt_tokens\":{},\"completion_tokens\":{events},\"prompt_tokens_details\":{{\"cached_tokens\":0}}}}}}\n\ndata: [DONE]\n\n",
                    now_ns(),
                    body.len()
                );
                s.write_all(format!("{:x}\r\n{tail}\r\n0\r\n\r\n", tail.len()).as_bytes())
                    .await?;
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Load generator.

#[derive(Default)]
struct CellSamples {
    ttfb_us: Vec<f64>,
    delivery_us: Vec<f64>,
    errors: usize,
}

/// One streamed request on a keep-alive connection; pushes its samples. Returns false when the
/// connection must be reopened.
async fn one_request(
    s: &mut TcpStream,
    buf: &mut Vec<u8>,
    req: &[u8],
    out: &mut CellSamples,
) -> bool {
    buf.clear();
    let t0 = now_ns();
    if s.write_all(req).await.is_err() {
        return false;
    }
    let Ok(Some((first, headers))) = read_head(s, buf).await else {
        return false;
    };
    if !first.contains(" 200") {
        out.errors += 1;
        return false;
    }
    let head = parse_head(&first, &headers);
    let mut sse = Vec::new();
    let mut first_event = true;
    let mut on_data = |data: &[u8], out: &mut CellSamples| {
        sse.extend_from_slice(data);
        let now = now_ns();
        while let Some(i) = sse.windows(2).position(|w| w == b"\n\n") {
            let ev: Vec<u8> = sse.drain(..i + 2).collect();
            let text = String::from_utf8_lossy(&ev);
            if let Some(t) = text
                .split("\"t\":")
                .nth(1)
                .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
                .and_then(|d| d.parse::<u64>().ok())
            {
                if first_event {
                    out.ttfb_us.push(now.saturating_sub(t0) as f64 / 1e3);
                    first_event = false;
                }
                out.delivery_us.push(now.saturating_sub(t) as f64 / 1e3);
            }
        }
    };
    if head.chunked {
        loop {
            // Chunk size line.
            let line = loop {
                if let Some(i) = buf.windows(2).position(|w| w == b"\r\n") {
                    let l = String::from_utf8_lossy(&buf[..i]).to_string();
                    buf.drain(..i + 2);
                    break l;
                }
                let mut tmp = [0u8; 16 << 10];
                match s.read(&mut tmp).await {
                    Ok(0) | Err(_) => return false,
                    Ok(n) => buf.extend_from_slice(&tmp[..n]),
                }
            };
            let Ok(size) = usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16)
            else {
                return false;
            };
            let Ok(data) = read_exact_buffered(s, buf, size + 2).await else {
                return false;
            };
            if size == 0 {
                return true;
            }
            on_data(&data[..size], out);
        }
    } else {
        // content-length (or close-delimited) bodies: read what is declared.
        let mut left = head.content_length;
        while left > 0 {
            if buf.is_empty() {
                let mut tmp = [0u8; 16 << 10];
                match s.read(&mut tmp).await {
                    Ok(0) | Err(_) => return false,
                    Ok(n) => buf.extend_from_slice(&tmp[..n]),
                }
            }
            let take = left.min(buf.len());
            let data: Vec<u8> = buf.drain(..take).collect();
            on_data(&data, out);
            left -= take;
        }
        true
    }
}

fn request_bytes(idx: usize, tag: &str) -> Vec<u8> {
    let session = idx % 997;
    let prompt = format!(
        "Session {session}: {}",
        "the quick brown fox jumps over the lazy dog. ".repeat(20)
    );
    let body = serde_json::json!({"model":"bench","prompt":prompt,"max_tokens":16,"stream":true,"stream_options":{"include_usage":true}}).to_string();
    format!(
        "POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\nx-session-id: s{session}\r\nx-request-id: {tag}-{idx}\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

async fn run_cell(addr: &str, streams: usize, requests: usize, tag: &str) -> CellSamples {
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..streams {
        let next = next.clone();
        let addr = addr.to_string();
        let tag = tag.to_string();
        tasks.push(tokio::spawn(async move {
            let mut out = CellSamples::default();
            let mut conn: Option<TcpStream> = None;
            let mut buf = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= requests {
                    break;
                }
                if conn.is_none() {
                    match TcpStream::connect(&addr).await {
                        Ok(s) => {
                            let _ = s.set_nodelay(true);
                            conn = Some(s);
                        }
                        Err(_) => {
                            out.errors += 1;
                            continue;
                        }
                    }
                }
                let req = request_bytes(i, &tag);
                let ok =
                    one_request(conn.as_mut().expect("connected"), &mut buf, &req, &mut out).await;
                if !ok {
                    out.errors += 1;
                    conn = None;
                }
            }
            out
        }));
    }
    let mut all = CellSamples::default();
    for t in tasks {
        if let Ok(o) = t.await {
            all.ttfb_us.extend(o.ttfb_us);
            all.delivery_us.extend(o.delivery_us);
            all.errors += o.errors;
        }
    }
    all
}

// ---------------------------------------------------------------------------------------------
// Targets.

struct Target {
    name: String,
    addr: String,
    /// Processes whose CPU time is the proxy's (empty for direct).
    pids: Vec<u32>,
    child: Option<Child>,
    rows: Option<PathBuf>,
}

impl Drop for Target {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn wait_listening(addr: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(addr).is_err() {
        if Instant::now() > deadline {
            bail!("nothing listening on {addr}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

fn start_router(a: &ProxyBenchArgs, policy: &str, upstreams: &[String]) -> Result<Target> {
    let rows = a.dir.join(format!("router-{policy}.csv"));
    let mut child = Command::new(&a.router_bin)
        .args([
            "--port",
            "0",
            "--policy",
            policy,
            "--workers",
            &a.router_workers.to_string(),
            "--model",
            "bench",
        ])
        .arg("--replicas")
        .arg(
            upstreams
                .iter()
                .map(|u| format!("http://{u}"))
                .collect::<Vec<_>>()
                .join(","),
        )
        .arg("--rows")
        .arg(&rows)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| {
            format!(
                "spawning {} (build it: cargo build --release -p router-bin)",
                a.router_bin.display()
            )
        })?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("router stdout")?).read_line(&mut line)?;
    let v: serde_json::Value =
        serde_json::from_str(&line).with_context(|| format!("router readiness line: {line:?}"))?;
    let addr = v["listening"].as_str().context("listening")?.to_string();
    Ok(Target {
        name: format!("router {policy}"),
        addr,
        pids: vec![child.id()],
        child: Some(child),
        rows: Some(rows),
    })
}

fn installed(bin: &str) -> bool {
    Command::new(bin)
        .arg("-v")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

fn start_haproxy(a: &ProxyBenchArgs, upstreams: &[String]) -> Result<Target> {
    let port = free_port()?;
    let mut cfg = format!(
        "global\n  maxconn 4000\n  nbthread {}\ndefaults\n  mode http\n  option http-no-delay\n  option http-keep-alive\n  timeout connect 5s\n  timeout client 120s\n  timeout server 120s\nfrontend fe\n  bind 127.0.0.1:{port}\n  default_backend be\nbackend be\n  balance hdr(x-session-id)\n  hash-type consistent\n  hash-balance-factor 125\n",
        a.haproxy_threads
    );
    for (i, u) in upstreams.iter().enumerate() {
        let _ = writeln!(cfg, "  server s{i} {u} maxconn 2000");
    }
    let path = a.dir.join("haproxy.cfg");
    std::fs::write(&path, cfg)?;
    let child = Command::new("haproxy")
        .arg("-db")
        .arg("-f")
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()?;
    let addr = format!("127.0.0.1:{port}");
    wait_listening(&addr)?;
    Ok(Target {
        name: "haproxy".into(),
        addr,
        pids: vec![child.id()],
        child: Some(child),
        rows: None,
    })
}

fn start_nginx(a: &ProxyBenchArgs, upstreams: &[String]) -> Result<Target> {
    let port = free_port()?;
    let dir = std::fs::canonicalize(&a.dir)?;
    let d = dir.display();
    let servers: String = upstreams
        .iter()
        .map(|u| format!("    server {u};\n"))
        .collect();
    let cfg = format!(
        "worker_processes 1;\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/nginx-error.log;\nevents {{ worker_connections 20000; }}\nhttp {{\n  access_log off;\n  client_body_temp_path {d}/nginx-body;\n  proxy_temp_path {d}/nginx-proxy;\n  fastcgi_temp_path {d}/nginx-fcgi;\n  uwsgi_temp_path {d}/nginx-uwsgi;\n  scgi_temp_path {d}/nginx-scgi;\n  upstream be {{\n    hash $http_x_session_id consistent;\n{servers}    keepalive 1024;\n  }}\n  server {{\n    listen 127.0.0.1:{port};\n    location / {{\n      proxy_pass http://be;\n      proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n      proxy_buffering off;\n    }}\n  }}\n}}\n"
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, cfg)?;
    let child = Command::new("nginx")
        .arg("-p")
        .arg(&dir)
        .arg("-c")
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()?;
    let addr = format!("127.0.0.1:{port}");
    wait_listening(&addr)?;
    // The master only supervises; the worker(s) do the proxying. Count both.
    let master = child.id();
    let mut pids = vec![master];
    pids.extend(children_of(master));
    Ok(Target {
        name: "nginx".into(),
        addr,
        pids,
        child: Some(child),
        rows: None,
    })
}

fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            if let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat"))
                && let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r.to_string())
                && rest
                    .split_whitespace()
                    .nth(1)
                    .and_then(|pp| pp.parse::<u32>().ok())
                    == Some(pid)
            {
                out.push(p);
            }
        }
    }
    out
}

/// User+system CPU seconds of `pid` (from /proc, in USER_HZ = 100 ticks per second).
fn cpu_s(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // After the command name: state(0) ppid(1) … utime(11) stime(12).
    (ticks(11) + ticks(12)) as f64 / 100.0
}

// ---------------------------------------------------------------------------------------------
// Statistics and the table.

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i]
}

fn median(mut v: Vec<f64>) -> f64 {
    pct(&mut v, 0.5)
}

#[derive(Default, Clone)]
struct RoundFigures {
    ttfb_p50: f64,
    ttfb_p99: f64,
    ev_p50: f64,
    ev_p99: f64,
    cpu_per_1k: f64,
    errors: usize,
}

/// Runs the benchmark and prints (and optionally writes) the markdown table.
pub fn run(a: &ProxyBenchArgs) -> Result<()> {
    std::fs::create_dir_all(&a.dir)?;
    // Upstreams and load generator: one thread each, like the proxies under test.
    let up_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let gen_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let mut upstreams = Vec::new();
    for _ in 0..a.upstreams {
        let l = up_rt.block_on(TcpListener::bind("127.0.0.1:0"))?;
        upstreams.push(l.local_addr()?.to_string());
        up_rt.spawn(upstream(l, a.events, Duration::from_millis(a.gap_ms)));
    }

    let mut targets = vec![Target {
        name: "direct".into(),
        addr: upstreams[0].clone(),
        pids: vec![],
        child: None,
        rows: None,
    }];
    for p in &a.policies {
        targets.push(start_router(a, p, &upstreams)?);
    }
    let mut skipped = Vec::new();
    if !a.no_haproxy {
        if installed("haproxy") {
            targets.push(start_haproxy(a, &upstreams)?)
        } else {
            skipped.push("haproxy (not installed: apt-get install haproxy)")
        }
    }
    if !a.no_nginx {
        if installed("nginx") {
            targets.push(start_nginx(a, &upstreams)?)
        } else {
            skipped.push("nginx (not installed: apt-get install nginx-light)")
        }
    }

    // results[(target, streams)] = one RoundFigures per round.
    let mut results: HashMap<(usize, usize), Vec<RoundFigures>> = HashMap::new();
    let total_requests = AtomicU64::new(0);
    for round in 0..a.rounds {
        for (ti, t) in targets.iter().enumerate() {
            for &k in &a.streams {
                let n = (k * a.waves).max(a.min_requests);
                let cpu0: f64 = t.pids.iter().map(|&p| cpu_s(p)).sum();
                let tag = format!("r{round}-k{k}");
                let mut s = gen_rt.block_on(run_cell(&t.addr, k, n, &tag));
                let cpu1: f64 = t.pids.iter().map(|&p| cpu_s(p)).sum();
                total_requests.fetch_add(n as u64, Ordering::Relaxed);
                let fig = RoundFigures {
                    ttfb_p50: pct(&mut s.ttfb_us, 0.5),
                    ttfb_p99: pct(&mut s.ttfb_us, 0.99),
                    ev_p50: pct(&mut s.delivery_us, 0.5),
                    ev_p99: pct(&mut s.delivery_us, 0.99),
                    cpu_per_1k: if t.pids.is_empty() {
                        f64::NAN
                    } else {
                        (cpu1 - cpu0) / n as f64 * 1000.0
                    },
                    errors: s.errors,
                };
                eprintln!(
                    "round {round} {:<28} streams {k:>3}: ttfb p50 {:>8.0} µs p99 {:>8.0} µs, event p50 {:>6.0} µs, errors {}",
                    t.name, fig.ttfb_p50, fig.ttfb_p99, fig.ev_p50, fig.errors
                );
                results.entry((ti, k)).or_default().push(fig);
            }
        }
    }

    // Stop the routers (SIGTERM flushes rows), then read their overhead.
    for t in &mut targets {
        if let (Some(c), Some(_)) = (&mut t.child, &t.rows) {
            let _ = Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status();
            let _ = c.wait();
            t.child = None;
        }
    }

    let table = render_table(a, &targets, &results, &skipped)?;
    println!("{table}");
    if let Some(out) = &a.out {
        std::fs::write(out, &table)?;
    }
    drop(targets);
    up_rt.shutdown_background();
    gen_rt.shutdown_background();
    Ok(())
}

/// `overhead_us` p50/p99 per stream count, from a router's rows (request ids `r{round}-k{K}-i`).
fn router_overhead(rows: &Path) -> HashMap<usize, (f64, f64)> {
    let mut by_k: HashMap<usize, Vec<f64>> = HashMap::new();
    let Ok(text) = std::fs::read_to_string(rows) else {
        return HashMap::new();
    };
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap_or("").split(',').collect();
    let (Some(id_col), Some(ov_col)) = (
        header.iter().position(|h| *h == "request_id"),
        header.iter().position(|h| *h == "overhead_us"),
    ) else {
        return HashMap::new();
    };
    for l in lines {
        let f: Vec<&str> = l.split(',').collect();
        let (Some(id), Some(ov)) = (
            f.get(id_col),
            f.get(ov_col).and_then(|v| v.parse::<f64>().ok()),
        ) else {
            continue;
        };
        if let Some(k) = id
            .split('-')
            .nth(1)
            .and_then(|k| k.strip_prefix('k'))
            .and_then(|k| k.parse::<usize>().ok())
        {
            by_k.entry(k).or_default().push(ov);
        }
    }
    by_k.into_iter()
        .map(|(k, mut v)| (k, (pct(&mut v, 0.5), pct(&mut v, 0.99))))
        .collect()
}

fn render_table(
    a: &ProxyBenchArgs,
    targets: &[Target],
    results: &HashMap<(usize, usize), Vec<RoundFigures>>,
    skipped: &[&str],
) -> Result<String> {
    let mut out = String::new();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let _ = writeln!(
        out,
        "Proxy cost: {} upstreams, SSE {} events {} ms apart, {} rounds interleaved (medians of per-round p50/p99), {cores} cores shared by upstreams, load generator and proxy; router workers {}, HAProxy threads {}.\n",
        a.upstreams, a.events, a.gap_ms, a.rounds, a.router_workers, a.haproxy_threads
    );
    let _ = writeln!(
        out,
        "| target | streams | first event p50 / p99 (µs; added vs direct) | per-event delivery p50 / p99 (µs; added) | CPU s / 1k req | router overhead_us p50 / p99 | errors |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|");
    for &k in &a.streams {
        let med = |ti: usize, f: fn(&RoundFigures) -> f64| {
            median(
                results
                    .get(&(ti, k))
                    .map_or(vec![], |v| v.iter().map(f).collect()),
            )
        };
        let base = (
            med(0, |r| r.ttfb_p50),
            med(0, |r| r.ttfb_p99),
            med(0, |r| r.ev_p50),
            med(0, |r| r.ev_p99),
        );
        for (ti, t) in targets.iter().enumerate() {
            let errors: usize = results
                .get(&(ti, k))
                .map_or(0, |v| v.iter().map(|r| r.errors).sum());
            let (tp50, tp99, ep50, ep99) = (
                med(ti, |r| r.ttfb_p50),
                med(ti, |r| r.ttfb_p99),
                med(ti, |r| r.ev_p50),
                med(ti, |r| r.ev_p99),
            );
            let cpu = med(ti, |r| r.cpu_per_1k);
            let ov = t
                .rows
                .as_ref()
                .and_then(|p| router_overhead(p).get(&k).copied());
            if ti == 0 {
                let _ = writeln!(
                    out,
                    "| direct | {k} | {tp50:.0} / {tp99:.0} (absolute) | {ep50:.0} / {ep99:.0} (absolute) | — | — | {errors} |"
                );
            } else {
                let _ = writeln!(
                    out,
                    "| {} | {k} | {:+.0} / {:+.0} | {:+.0} / {:+.0} | {} | {} | {errors} |",
                    t.name,
                    tp50 - base.0,
                    tp99 - base.1,
                    ep50 - base.2,
                    ep99 - base.3,
                    if cpu.is_nan() {
                        "—".to_string()
                    } else {
                        format!("{cpu:.3}")
                    },
                    ov.map_or("—".to_string(), |(p50, p99)| format!(
                        "{p50:.0} / {p99:.0}"
                    )),
                );
            }
        }
    }
    for s in skipped {
        let _ = writeln!(out, "\nSkipped: {s}.");
    }
    Ok(out)
}
