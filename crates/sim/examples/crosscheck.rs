//! Runs a plan file in virtual time and compares it with a live run of the same plan.
//!
//! ```text
//! cargo run --release -p sim --example crosscheck -- PLAN.bin POLICY REPLICAS NUM_GPU_BLOCKS SPEED OUT_DIR [LIVE_DIR]
//! ```
//!
//! Writes the virtual cell into `OUT_DIR`; with `LIVE_DIR` (holding the live `client.csv` and
//! `router.csv`) prints both side by side: requests, TTFT p50/p90, ITL p50, e2e p50, engine hit
//! rate, and goodput over the same window rule.

use std::path::{Path, PathBuf};

use sim::{CellMeta, SimConfig, Slo, run_cell};
use workload::{Plan, Schedule};

struct Stats {
    requests: usize,
    errors: usize,
    ttft_p50: f64,
    ttft_p90: f64,
    itl_p50: f64,
    e2e_p50: f64,
    hit: f64,
    goodput: f64,
    replicas_used: usize,
}

/// Quantile `p` of `v` (`schema::stats`, as the report computes it); NaN when empty.
fn q(v: &mut [f64], p: f64) -> f64 {
    schema::stats::quantile_in_place(v, p).unwrap_or(f64::NAN)
}

fn stats(dir: &Path, slo: &Slo, users: Option<usize>) -> Stats {
    let client = analysis::read_client_csv(&dir.join("client.csv")).expect("client.csv");
    let router = analysis::read_router_csv(&dir.join("router.csv")).unwrap_or_default();
    let sent: Vec<f64> = client.iter().filter_map(|r| r.sent_s).collect();
    let window = sim::measured_window(&sent, 0.0, f64::INFINITY, users).expect("window");
    let ok: Vec<_> = client.iter().filter(|r| r.error.is_none()).collect();
    let mut ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
    let mut itl: Vec<f64> = ok.iter().filter_map(|r| r.itl_p50_ms).collect();
    let mut e2e: Vec<f64> = ok.iter().filter_map(|r| r.e2el_ms).collect();
    let cached: u64 = ok.iter().filter_map(|r| r.cached_tokens).sum();
    let prompt: u64 = ok.iter().filter_map(|r| r.prompt_tokens).sum();
    let good = client
        .iter()
        .filter(|r| {
            analysis::metrics::window_time_s(r, window.clock).is_some_and(|t| window.contains(t))
        })
        .filter(|r| analysis::is_good(r, slo, window.clock))
        .count();
    let mut replicas: Vec<u32> = router.iter().filter_map(|r| r.replica).collect();
    replicas.sort_unstable();
    replicas.dedup();
    Stats {
        requests: client.len(),
        errors: client.len() - ok.len(),
        ttft_p50: q(&mut ttft, 0.5),
        ttft_p90: q(&mut ttft, 0.9),
        itl_p50: q(&mut itl, 0.5),
        e2e_p50: q(&mut e2e, 0.5),
        hit: cached as f64 / prompt.max(1) as f64,
        goodput: good as f64 / (window.measured_end_s - window.measured_start_s),
        replicas_used: replicas.len(),
    }
}

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    if a.len() < 6 {
        eprintln!("usage: crosscheck PLAN POLICY REPLICAS NUM_GPU_BLOCKS SPEED OUT_DIR [LIVE_DIR]");
        std::process::exit(2);
    }
    let plan = Plan::from_bytes(&std::fs::read(&a[0]).expect("plan file")).expect("plan");
    let mut cfg = SimConfig::new(a[2].parse().expect("replicas"), &a[1]);
    cfg.engine.num_gpu_blocks = a[3].parse().expect("blocks");
    cfg.engine.model.speed = a[4].parse().expect("speed");
    let out = PathBuf::from(&a[5]);
    let slo = Slo::default();
    let meta = CellMeta {
        slo,
        ..CellMeta::default()
    };
    let s = run_cell(&cfg, &plan, &out, &meta).expect("virtual cell");
    eprintln!("virtual: {} requests in {:.3} s wall", s.requests, s.wall_s);
    let users = match &plan.schedule {
        Schedule::Closed { users, .. } => Some(users.len()),
        Schedule::Open { .. } => None,
    };
    let v = stats(&out, &slo, users);
    let rows = [("virtual", v)].into_iter().chain(
        a.get(6)
            .map(|live| ("live", stats(Path::new(live), &slo, users))),
    );
    println!(
        "| run | requests | errors | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | e2e p50 ms | hit rate | goodput req/s | replicas used |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (name, s) in rows {
        println!(
            "| {name} | {} | {} | {:.1} | {:.1} | {:.2} | {:.0} | {:.3} | {:.2} | {} |",
            s.requests,
            s.errors,
            s.ttft_p50,
            s.ttft_p90,
            s.itl_p50,
            s.e2e_p50,
            s.hit,
            s.goodput,
            s.replicas_used
        );
    }
}
