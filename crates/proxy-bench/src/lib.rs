//! `proxy-bench`: what the router's own cost is, next to plain reverse proxies.
//!
//! Fast in-process SSE upstreams (each event stamped with its send time) sit behind: nothing
//! (direct), the `router` binary with each policy, HAProxy (`mode http`, `option http-no-delay`,
//! consistent hashing on `x-session-id` with `hash-balance-factor 125`) and nginx (`hash …
//! consistent`, `proxy_buffering off`). A load generator in the same process keeps K streams
//! open on keep-alive connections. Both sides speak HTTP/1.1 through hyper. Cells run
//! interleaved in rounds (every target at every K, then again), and each figure is the median
//! over rounds of that round's p50 / p99: added time to first event vs direct, added per-event
//! delivery time vs direct, CPU seconds per 1,000 requests of the proxy process(es) with the
//! resolution of the CPU reading beside it, and the router's own `overhead_us` from its rows.
//!
//! Everything here shares the machine's cores on purpose: that is how the router is deployed in
//! the experiments. Compare ratios within one run, never absolute numbers across runs.
//!
//! Entry point: `cargo xtask proxy-bench` parses [`ProxyBenchArgs`] and calls [`run`].

mod cpu;
mod load;
mod stats;
mod table;
mod targets;
mod upstream;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use tokio::net::TcpListener;

use crate::stats::{Figures, requests_per_cell};
use crate::table::{TableRow, TableSpec};
use crate::targets::Target;

/// Flags of `cargo xtask proxy-bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct ProxyBenchArgs {
    /// The router binary (build it with `cargo build --release -p router-bin`).
    #[arg(long, default_value = "target/release/router")]
    pub router_bin: PathBuf,
    /// A second router binary measured in the same rounds (e.g. main's build before a change),
    /// each target named `… (baseline)`: a before/after comparison under one machine's conditions.
    #[arg(long)]
    pub baseline_router_bin: Option<PathBuf>,
    /// Concurrent streams per cell.
    #[arg(long, value_delimiter = ',', default_value = "1,50,200")]
    pub streams: Vec<usize>,
    /// Interleaved rounds (medians are taken across them).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Requests per cell = streams × waves (at least `min_requests`); the default gives 3,000
    /// requests at 200 streams, enough for the CPU per request to rest on a long window.
    #[arg(long, default_value_t = 15)]
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
    /// Router worker threads; several (`1,2`) start one router per count and policy, measured
    /// side by side in the same rounds (named `router <policy> w<N>`).
    #[arg(long, value_delimiter = ',', default_value = "2")]
    pub router_workers: Vec<usize>,
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

/// Nanoseconds on the process-wide bench clock, shared by the upstreams (which stamp every event
/// with it) and the load generator (which subtracts the stamp on arrival).
fn now_ns() -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    BASE.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// A multi-thread tokio runtime with one worker: the upstreams and the load generator each get
/// one, like the proxies under test.
fn one_worker_runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?)
}

/// Runs the benchmark and prints (and with `--out` writes) the markdown table.
pub fn run(a: &ProxyBenchArgs) -> Result<()> {
    ensure!(a.upstreams > 0, "--upstreams must be at least 1");
    std::fs::create_dir_all(&a.dir)?;
    let up_rt = one_worker_runtime()?;
    let gen_rt = one_worker_runtime()?;
    let mut upstreams = Vec::new();
    for _ in 0..a.upstreams {
        let listener = up_rt.block_on(TcpListener::bind("127.0.0.1:0"))?;
        upstreams.push(listener.local_addr()?.to_string());
        up_rt.spawn(upstream::serve(
            listener,
            a.events,
            Duration::from_millis(a.gap_ms),
        ));
    }

    let mut targets = vec![Target::direct(&upstreams[0])];
    ensure!(
        !a.router_workers.is_empty() && a.router_workers.iter().all(|&w| w > 0),
        "--router-workers needs counts ≥ 1"
    );
    for p in &a.policies {
        for &w in &a.router_workers {
            let named = a.router_workers.len() > 1;
            targets.push(targets::start_router(
                a,
                &a.router_bin,
                p,
                w,
                named,
                &upstreams,
            )?);
            if let Some(baseline) = &a.baseline_router_bin {
                targets.push(targets::start_router(a, baseline, p, w, named, &upstreams)?);
            }
        }
    }
    let mut skipped = Vec::new();
    if !a.no_haproxy {
        if targets::installed("haproxy") {
            targets.push(targets::start_haproxy(a, &upstreams)?)
        } else {
            skipped.push("haproxy (not installed: apt-get install haproxy)")
        }
    }
    if !a.no_nginx {
        if targets::installed("nginx") {
            targets.push(targets::start_nginx(a, &upstreams)?)
        } else {
            skipped.push("nginx (not installed: apt-get install nginx-light)")
        }
    }

    let clock_ticks_per_s = cpu::clock_ticks_per_s();
    // rounds_of[(target, streams)] = one Figures per round.
    let mut rounds_of: HashMap<(usize, usize), Vec<Figures>> = HashMap::new();
    let mut cpu_sources = Vec::new();
    for round in 0..a.rounds {
        for (ti, t) in targets.iter().enumerate() {
            for &k in &a.streams {
                let n = requests_per_cell(k, a.waves, a.min_requests);
                let before = cpu::read_all(&t.pids);
                let tag = format!("r{round}-k{k}");
                let samples = gen_rt.block_on(load::run_cell(&t.addr, k, n, &tag));
                let after = cpu::read_all(&t.pids);
                let cpu = if t.pids.is_empty() {
                    None
                } else {
                    cpu::elapsed_all(&before, &after, clock_ticks_per_s)
                };
                if let Some(c) = &cpu
                    && !cpu_sources.contains(&c.source)
                {
                    cpu_sources.push(c.source);
                }
                let fig = Figures::new(&samples, cpu.as_ref(), n);
                eprintln!(
                    "round {round} {:<28} streams {k:>3}: ttfb p50 {:>8.0} µs p99 {:>8.0} µs, event p50 {:>6.0} µs, errors {}",
                    t.name, fig.ttfb_p50_us, fig.ttfb_p99_us, fig.event_p50_us, fig.errors
                );
                rounds_of.entry((ti, k)).or_default().push(fig);
            }
        }
    }

    // Stop the routers (SIGTERM flushes rows), then read their overhead.
    for t in &mut targets {
        t.stop_router();
    }
    let mut rows = Vec::new();
    for &k in &a.streams {
        for (ti, t) in targets.iter().enumerate() {
            let figures = Figures::over_rounds(rounds_of.get(&(ti, k)).map_or(&[], |v| v));
            rows.push(TableRow {
                target: t.name.clone(),
                streams: k,
                figures,
                overhead_us: t.router_overhead(k),
            });
        }
    }
    let spec = TableSpec {
        upstreams: a.upstreams,
        events: a.events,
        gap_ms: a.gap_ms,
        rounds: a.rounds,
        cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
        router_workers: a
            .router_workers
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        haproxy_threads: a.haproxy_threads,
    };
    let notes: Vec<String> = cpu_sources
        .iter()
        .map(|s| s.describe(clock_ticks_per_s))
        .chain(skipped.iter().map(|s| format!("Skipped: {s}.")))
        .collect();
    let table = table::render(&spec, &rows, &notes);
    println!("{table}");
    if let Some(out) = &a.out {
        std::fs::write(out, &table)?;
    }
    drop(targets);
    up_rt.shutdown_background();
    gen_rt.shutdown_background();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: ProxyBenchArgs,
    }

    #[test]
    fn defaults_give_3000_requests_at_200_streams() {
        let a = Cli::parse_from(["proxy-bench"]).args;
        assert_eq!(a.streams, [1, 50, 200]);
        let per_cell: Vec<usize> = a
            .streams
            .iter()
            .map(|&k| requests_per_cell(k, a.waves, a.min_requests))
            .collect();
        assert_eq!(per_cell, [30, 750, 3000]);
    }

    #[test]
    fn direct_only_run_prints_the_table() {
        let tmp = test_support::temp_dir("proxy-bench-run");
        let dir = tmp.path().to_path_buf();
        let out = dir.join("table.md");
        let mut a = Cli::parse_from([
            "proxy-bench",
            "--streams",
            "1,3",
            "--rounds",
            "2",
            "--waves",
            "2",
            "--min-requests",
            "2",
            "--events",
            "3",
            "--gap-ms",
            "1",
            "--upstreams",
            "2",
            "--no-haproxy",
            "--no-nginx",
        ])
        .args;
        a.policies.clear();
        a.dir = dir.clone();
        a.out = Some(out.clone());
        run(&a).unwrap();
        let table = std::fs::read_to_string(&out).unwrap();
        let direct: Vec<&str> = table
            .lines()
            .filter(|l| l.starts_with("| direct |"))
            .collect();
        assert_eq!(direct.len(), 2, "{table}");
        assert!(direct[0].starts_with("| direct | 1 | "), "{table}");
        assert!(direct[1].starts_with("| direct | 3 | "), "{table}");
        assert!(
            direct.iter().all(|l| l.ends_with("| — | — | 0 |")),
            "{table}"
        );
    }
}
