//! A stand-in replica for the fleet's tests: no model, just the control surface.
//!
//! It accepts (and ignores) the `engine` flags the fleet passes, prints the contract's readiness
//! line, and answers `/health`, `/metrics` (cache shape, a lateness histogram, a reset counter,
//! the `CUDA_VISIBLE_DEVICES` it saw) and `/reset_prefix_cache`. `--mode` makes it misbehave:
//! `silent` never announces readiness, `unhealthy` answers 503 on `/health`, `exit` dies at once.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

struct State {
    resets: AtomicU64,
    scrapes: AtomicU64,
    lateness_s: f64,
    unhealthy: bool,
    num_gpu_blocks: u64,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let port: u16 = flag("--port").and_then(|p| p.parse().ok()).unwrap_or(0);
    let mode = flag("--mode").unwrap_or_else(|| "ok".to_string());
    let readiness = !args.iter().any(|a| a == "--no-readiness");
    let state = Arc::new(State {
        resets: AtomicU64::new(0),
        scrapes: AtomicU64::new(0),
        lateness_s: flag("--lateness-ms")
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.1)
            / 1e3,
        unhealthy: mode == "unhealthy",
        num_gpu_blocks: flag("--num-gpu-blocks")
            .and_then(|v| v.parse().ok())
            .unwrap_or(1024),
    });
    println!("fake-replica starting (a banner line the readiness parser must skip)");
    if mode == "exit" {
        eprintln!("boom: asked to fail at startup");
        std::process::exit(3);
    }
    let listener = match TcpListener::bind(("127.0.0.1", port)) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("cannot bind 127.0.0.1:{port}: {e}");
            std::process::exit(2);
        }
    };
    let addr = listener
        .local_addr()
        .expect("bound listener has an address");
    if mode == "silent" {
        loop {
            std::thread::park();
        }
    }
    if readiness {
        println!(r#"{{"listening":"{addr}","kv_events":null,"kv_replay":null}}"#);
    }
    let _ = std::io::stdout().flush();
    for stream in listener.incoming().flatten() {
        let state = Arc::clone(&state);
        std::thread::spawn(move || serve(stream, &state));
    }
}

fn serve(mut stream: TcpStream, state: &State) {
    let mut reader = BufReader::new(match stream.try_clone() {
        Ok(s) => s,
        Err(_) => return,
    });
    let mut request_line = String::new();
    if reader.read_line(&mut request_line).is_err() {
        return;
    }
    let mut content_length = 0usize;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 || line.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':')
            && k.eq_ignore_ascii_case("content-length")
        {
            content_length = v.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0u8; content_length];
    let _ = std::io::Read::read_exact(&mut reader, &mut body);
    let mut parts = request_line.split_whitespace();
    let method = parts.next().unwrap_or("");
    let path = parts.next().unwrap_or("");
    let (status, text) = match (method, path) {
        ("GET", "/health") if state.unhealthy => (503, String::new()),
        ("GET", "/health") => (200, String::new()),
        ("POST", "/reset_prefix_cache") => {
            state.resets.fetch_add(1, Ordering::Relaxed);
            (200, String::new())
        }
        ("GET", "/metrics") => (200, metrics(state)),
        _ => (404, "not found".to_string()),
    };
    let _ = write!(
        stream,
        "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
        text.len()
    );
}

fn metrics(state: &State) -> String {
    // Every scrape adds ten observations at the configured lateness, so a window always has steps.
    let scrapes = state.scrapes.fetch_add(1, Ordering::Relaxed) + 1;
    let steps = scrapes * 10;
    let bounds = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1];
    let mut out = String::new();
    out.push_str(&format!(
        "vllm:cache_config_info{{block_size=\"16\",num_gpu_blocks=\"{}\"}} 1\n",
        state.num_gpu_blocks
    ));
    out.push_str(&format!(
        "fake_resets_total {}\n",
        state.resets.load(Ordering::Relaxed)
    ));
    out.push_str(&format!(
        "fake_info{{cuda_visible_devices=\"{}\"}} 1\n",
        std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default()
    ));
    for le in bounds {
        let count = if state.lateness_s <= le { steps } else { 0 };
        out.push_str(&format!(
            "kvroute_engine_lateness_seconds_bucket{{le=\"{le}\"}} {count}\n"
        ));
    }
    out.push_str(&format!(
        "kvroute_engine_lateness_seconds_bucket{{le=\"+Inf\"}} {steps}\n"
    ));
    out.push_str(&format!("kvroute_engine_lateness_seconds_count {steps}\n"));
    out.push_str(&format!(
        "kvroute_engine_lateness_seconds_sum {}\n",
        steps as f64 * state.lateness_s
    ));
    out
}
