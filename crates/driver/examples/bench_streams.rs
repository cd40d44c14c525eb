//! Driver throughput and timestamp-lag benchmark (prints a table; see the crate README).
//!
//! A scripted SSE server runs on its own runtime thread(s); the driver runs on one
//! current-thread runtime (one thread, so at most one core), as the `driver` binary does.
//!
//! Phase A (lag): `--streams` concurrent streams through [`driver::client::Requester`], the
//! code path every run uses; the server writes its own send time into each chunk, so
//! `driver timestamp − server write time` is the delivery-plus-timestamp lag per chunk.
//! Phase B (full driver): `run_closed` with as many users, writing `client.csv`.
//!
//! `cargo run --release -p driver --example bench_streams -- [--streams 500] [--gap-ms 20]
//!  [--chunks 64] [--seconds 10] [--server-threads 1]`

use std::time::{Duration, Instant};

use bytes::Bytes;
use driver::client::{ChatRequest, Requester, chat_body};
use driver::testserver::{Reply, ScriptedServer, StreamScript};
use driver::{ProgressMode, RunConfig};
use hdrhistogram::Histogram;
use workload::{ArrivalSpec, Message, Plan, Role, Sizing, WorkloadSpec};

struct Opts {
    streams: usize,
    gap_ms: u64,
    chunks: usize,
    seconds: f64,
    server_threads: usize,
    hyper_server: bool,
}

fn parse_opts() -> Result<Opts, String> {
    let mut o = Opts {
        streams: 500,
        gap_ms: 20,
        chunks: 64,
        seconds: 10.0,
        server_threads: 1,
        hyper_server: false,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        if args[i] == "--hyper-server" {
            o.hyper_server = true;
            i += 1;
            continue;
        }
        let v = args
            .get(i + 1)
            .ok_or_else(|| format!("{} needs a value", args[i]))?;
        let bad = |_| format!("bad value for {}: {v}", args[i]);
        let badf = |_| format!("bad value for {}: {v}", args[i]);
        match args[i].as_str() {
            "--streams" => o.streams = v.parse().map_err(bad)?,
            "--gap-ms" => o.gap_ms = v.parse().map_err(bad)?,
            "--chunks" => o.chunks = v.parse().map_err(bad)?,
            "--seconds" => o.seconds = v.parse().map_err(badf)?,
            "--server-threads" => o.server_threads = v.parse().map_err(bad)?,
            other => return Err(format!("unknown flag {other}")),
        }
        i += 2;
    }
    Ok(o)
}

/// CPU time of the calling thread, from the kernel's scheduler statistics.
fn thread_cpu() -> Option<Duration> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: u64 = s.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}

fn main() {
    let o = match parse_opts() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("bench_streams: {e}");
            std::process::exit(2);
        }
    };
    let base = Instant::now();
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(o.server_threads.max(1))
        .enable_all()
        .build()
        .expect("server runtime");
    let gap = Duration::from_millis(o.gap_ms);
    let script = StreamScript {
        stamp_content: Some(base),
        ..StreamScript::uniform(gap, gap, o.chunks, 32)
    };
    // Either server stamps each chunk with `base.elapsed()` just before handing it on; the raw
    // one stamps immediately before the write(2), so its lag is kernel + driver only.
    let (url, _hyper_server) = if o.hyper_server {
        let server = server_rt
            .block_on(ScriptedServer::start(move |_| {
                Reply::Stream(script.clone())
            }))
            .expect("server");
        (server.url(), Some(server))
    } else {
        let listener = server_rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        server_rt.spawn(raw::serve(listener, base, gap, o.chunks));
        (url, None)
    };
    let wall0 = Instant::now();
    let cpu_all0 = process_cpu().zip(thread_cpu());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("driver runtime");
    let offered = o.streams as f64 * 1000.0 / o.gap_ms.max(1) as f64;
    println!(
        "driver: current-thread runtime; {} server: {} thread(s); {} streams × 1 chunk / {} ms = {:.0} chunks/s offered",
        if o.hyper_server { "hyper" } else { "raw" },
        o.server_threads,
        o.streams,
        o.gap_ms,
        offered
    );

    // Phase A.
    let (hist, chunks, window_s, cpu, errors) = rt.block_on(async {
        let requester = Requester::new(&url, base, Duration::from_secs(60))
            .expect("requester")
            .keep_content(true);
        let msgs = [Message {
            role: Role::User,
            content: "benchmark".into(),
        }];
        let body: Bytes = chat_body("m", &msgs, o.chunks as u32);
        let warm = Duration::from_secs(1);
        let start = base.elapsed();
        let measure_from = start + warm;
        let end = start + warm + Duration::from_secs_f64(o.seconds);
        let cpu0 = thread_cpu();
        let mut tasks = Vec::new();
        for s in 0..o.streams {
            let requester = requester.clone();
            let body = body.clone();
            tasks.push(tokio::spawn(async move {
                let mut h =
                    Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("histogram");
                let (mut n, mut errors) = (0u64, 0u64);
                let id = format!("bench-{s}");
                while base.elapsed() < end {
                    let req = ChatRequest {
                        request_id: &id,
                        session_id: &id,
                        body: body.clone(),
                    };
                    let out = requester.send(&req).await;
                    errors += u64::from(out.error.is_some());
                    for (mark, content) in out.chunks.iter().zip(&out.contents) {
                        if mark.at < measure_from || mark.at >= end {
                            continue;
                        }
                        if let Ok(server_ns) = content.parse::<u64>() {
                            let lag = (mark.at.as_nanos() as u64).saturating_sub(server_ns);
                            h.saturating_record(lag);
                            n += 1;
                        }
                    }
                }
                (h, n, errors)
            }));
        }
        let mut all = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("histogram");
        let (mut chunks, mut errors) = (0u64, 0u64);
        for t in tasks {
            let (h, n, e) = t.await.expect("stream task");
            all.add(&h).expect("merge");
            chunks += n;
            errors += e;
        }
        let cpu = match (cpu0, thread_cpu()) {
            (Some(a), Some(b)) => Some(b - a),
            _ => None,
        };
        let wall = base.elapsed() - start;
        (
            all,
            chunks,
            o.seconds,
            cpu.map(|c| c.as_secs_f64() / wall.as_secs_f64()),
            errors,
        )
    });
    let us = |q: f64| hist.value_at_quantile(q) as f64 / 1e3;
    println!(
        "\nphase A: Requester, {} concurrent streams, {:.0} s window",
        o.streams, window_s
    );
    println!(
        "| chunks/s | lag p50 µs | lag p90 µs | lag p99 µs | lag max µs | driver thread CPU | errors |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} |",
        chunks as f64 / window_s,
        us(0.5),
        us(0.9),
        us(0.99),
        hist.max() as f64 / 1e3,
        cpu.map_or("-".to_owned(), |c| format!("{:.0}%", c * 100.0)),
        errors
    );

    // Phase B.
    let spec = WorkloadSpec {
        sizing: Sizing::Conversations((o.streams * 20) as u32),
        prefix_tokens: 32,
        user_tokens: 8,
        output_tokens: o.chunks as u32,
        turns: 1,
        ..WorkloadSpec::default()
    };
    let plan = Plan::build(
        &spec,
        &ArrivalSpec::Closed {
            users: o.streams as u32,
            think_mean_s: 0.0,
            requests_per_user: 10_000,
        },
    )
    .expect("plan");
    let out = std::env::temp_dir().join(format!("bench-streams-{}.csv", std::process::id()));
    let cfg = RunConfig {
        duration_s: Some(o.seconds),
        progress: ProgressMode::Off,
        ..RunConfig::new(url.clone(), out.clone())
    };
    let (summary, cpu) = rt.block_on(async {
        let cpu0 = thread_cpu();
        let t0 = Instant::now();
        let s = driver::run_closed(&plan, &cfg).await.expect("run");
        let cpu = match (cpu0, thread_cpu()) {
            (Some(a), Some(b)) => Some((b - a).as_secs_f64() / t0.elapsed().as_secs_f64()),
            _ => None,
        };
        (s, cpu)
    });
    let rows = driver::read_rows(&out).expect("rows");
    let _ = std::fs::remove_file(&out);
    // Steady window: after a 1 s ramp, until the duration cap stops new sends.
    let (w0, w1) = (1.0f64.min(o.seconds / 2.0), o.seconds);
    let mut busy_s = 0.0;
    let mut window_chunks = 0.0;
    for r in &rows {
        let (Some(sent), Some(e2el)) = (r.sent_s, r.e2el_ms) else {
            continue;
        };
        busy_s += ((sent + e2el / 1e3).min(w1) - sent.max(w0)).max(0.0);
        if let (Some(f), Some(l)) = (r.first_token_s, r.last_s)
            && r.chunks > 1
            && l > f
        {
            let overlap = (l.min(w1) - f.max(w0)).max(0.0);
            window_chunks += overlap / (l - f) * f64::from(r.chunks - 1);
        }
    }
    let steady = w1 - w0;
    println!(
        "\nphase B: run_closed, {} users, think 0, sends stop at {:.0} s; steady window {w0:.0}–{w1:.0} s",
        o.streams, o.seconds
    );
    println!(
        "| requests | chunks/s (steady) | mean concurrent streams (steady) | TTFT p50 ms | ITL p50 ms | send lag p50 ms | driver thread CPU | errors |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {} | {:.0} | {:.0} | {:.2} | {:.2} | {:.2} | {} | {} |",
        summary.requests,
        window_chunks / steady,
        busy_s / steady,
        summary.ttft_ms.map_or(f64::NAN, |q| q.p50),
        summary.itl_p50_ms.map_or(f64::NAN, |q| q.p50),
        summary.send_lag_ms.map_or(f64::NAN, |q| q.p50),
        cpu.map_or("-".to_owned(), |c| format!("{:.0}%", c * 100.0)),
        summary.errors
    );
    if std::env::var_os("BENCH_DEBUG").is_some() {
        println!("{summary}");
    }
    if let Some(c) = server_cpu_share(cpu_all0, &wall0) {
        println!(
            "\nserver threads CPU over both phases: {:.0}% of one core",
            c * 100.0
        );
    }
}

/// CPU time of every thread of the process, from the kernel's scheduler statistics.
fn process_cpu() -> Option<Duration> {
    let mut total = 0u64;
    for entry in std::fs::read_dir("/proc/self/task").ok()? {
        let path = entry.ok()?.path().join("schedstat");
        let s = std::fs::read_to_string(path).ok()?;
        total += s.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(Duration::from_nanos(total))
}

fn server_cpu_share(all0: Option<(Duration, Duration)>, wall0: &Instant) -> Option<f64> {
    let (all0, main0) = all0?;
    let all = process_cpu()? - all0;
    let main = thread_cpu()? - main0;
    Some(all.saturating_sub(main).as_secs_f64() / wall0.elapsed().as_secs_f64())
}

/// A minimal HTTP/1.1 SSE server: no framework between the timestamp and the socket.
mod raw {
    use std::time::{Duration, Instant};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    pub async fn serve(listener: TcpListener, base: Instant, gap: Duration, chunks: usize) {
        while let Ok((stream, _)) = listener.accept().await {
            let _ = stream.set_nodelay(true);
            tokio::spawn(connection(stream, base, gap, chunks));
        }
    }

    fn chunked(payload: &str) -> Vec<u8> {
        format!("{:x}\r\n{payload}\r\n", payload.len()).into_bytes()
    }

    async fn connection(mut s: TcpStream, base: Instant, gap: Duration, chunks: usize) {
        let mut buf: Vec<u8> = Vec::with_capacity(4096);
        loop {
            // Request head, then a content-length body.
            let head_end = loop {
                if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    break p + 4;
                }
                let mut tmp = [0u8; 4096];
                match s.read(&mut tmp).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => buf.extend_from_slice(&tmp[..n]),
                }
            };
            let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            while buf.len() < head_end + len {
                let mut tmp = [0u8; 4096];
                match s.read(&mut tmp).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => buf.extend_from_slice(&tmp[..n]),
                }
            }
            let at = Instant::now();
            buf.drain(..head_end + len);
            if head.starts_with("get /v1/models") {
                let body = r#"{"object":"list","data":[{"id":"raw","object":"model"}]}"#;
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                if s.write_all(resp.as_bytes()).await.is_err() {
                    return;
                }
                continue;
            }
            let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
            if s.write_all(head.as_bytes()).await.is_err() {
                return;
            }
            for i in 0..chunks {
                tokio::time::sleep_until((at + gap * (i as u32 + 1)).into()).await;
                let ns = base.elapsed().as_nanos();
                let event = format!(
                    "data: {{\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{ns}\"}},\"finish_reason\":null}}],\"usage\":null}}\n\n"
                );
                if s.write_all(&chunked(&event)).await.is_err() {
                    return;
                }
            }
            let tail = format!(
                "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":32,\"completion_tokens\":{chunks}}}}}\n\ndata: [DONE]\n\n"
            );
            let mut out = chunked(&tail);
            out.extend_from_slice(b"0\r\n\r\n");
            if s.write_all(&out).await.is_err() {
                return;
            }
        }
    }
}
