//! The simulator's speed and scale benchmarks; prints markdown tables (see the crate README).
//!
//! ```text
//! cargo run --release -p sim --example bench -- throughput [policy]  # simulated requests/min, one core
//! cargo run --release -p sim --example bench -- grid [threads] # the full pressure grid, wall time
//! cargo run --release -p sim --example bench -- scale [requests_per_user]  # 8 / 64 / 512 replicas
//! cargo run --release -p sim --example bench -- calibrate    # virtual TTFT/ITL floors and SLO
//! ```

use std::sync::Arc;
use std::time::Instant;

use sim::{CellMeta, GridJob, SimConfig, simulate, summarize};
use workload::{ArrivalSpec, Plan, Sizing, WorkloadSpec};

/// The policy arms of a full sweep.
const ARMS: [&str; 9] = [
    "round-robin",
    "least-outstanding",
    "session-affinity",
    "session-bounded",
    "prefix-hash",
    "prefix-affinity",
    "prefix-affinity-spill-off",
    "exact-residency",
    "exact-residency-spec",
];

fn plan(capacity_tokens: u64, ratio: f64, zipf_s: f64, users: u32, per_user: u32) -> Plan {
    let spec = WorkloadSpec {
        sizing: Sizing::WorkingSet {
            capacity_tokens,
            ratio,
        },
        zipf_s,
        ..WorkloadSpec::default()
    };
    let arrival = ArrivalSpec::Closed {
        users,
        think_mean_s: 1.0,
        requests_per_user: per_user,
    };
    Plan::build(&spec, &arrival).unwrap_or_else(|e| {
        eprintln!("cannot build the plan: {e}");
        std::process::exit(2)
    })
}

fn throughput(only: Option<&str>) {
    let base = SimConfig::new(5, "round-robin");
    let p = plan(base.capacity_tokens(), 1.0, 0.0, 32, 512);
    println!(
        "plan `{}`: {} requests, {} conversations; one thread\n",
        p.name(),
        p.request_count(),
        p.conversations.len()
    );
    println!(
        "| policy | simulate s | rows s | events | requests/min (simulate) | requests/min (with rows) |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    let mut total_req = 0usize;
    let mut total_s = 0.0;
    for name in ARMS.into_iter().filter(|a| only.is_none_or(|o| o == *a)) {
        let mut cfg = base.clone();
        cfg.policy = policies::PolicySpec::named(name);
        let t = Instant::now();
        let out = simulate(&cfg, &p).expect("simulate");
        let sim_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let (c, r) = sim::cell::render_rows(&out).expect("rows");
        let rows_s = t.elapsed().as_secs_f64();
        std::hint::black_box((c, r));
        let n = out.outcomes.len();
        total_req += n;
        total_s += sim_s + rows_s;
        println!(
            "| {name} | {sim_s:.3} | {rows_s:.3} | {} | {:.2} M | {:.2} M |",
            out.events,
            n as f64 / sim_s * 60.0 / 1e6,
            n as f64 / (sim_s + rows_s) * 60.0 / 1e6
        );
    }
    println!(
        "| **all arms** | | | | | **{:.2} M** |",
        total_req as f64 / total_s * 60.0 / 1e6
    );
}

fn grid(threads: usize) {
    let base = SimConfig::new(5, "round-robin");
    let ratios = [0.25, 1.0, 3.0, 8.0];
    let skews = [0.0, 1.0, 1.4];
    let dir = std::env::temp_dir().join(format!("sim-grid-bench-{}", std::process::id()));
    let t_all = Instant::now();
    let mut jobs = Vec::new();
    for &r in &ratios {
        for &s in &skews {
            let p = Arc::new(plan(base.capacity_tokens(), r, s, 32, 64));
            let point = format!("ws{r}-s{s}");
            for name in ARMS {
                for rep in 1..=3u32 {
                    let mut cfg = base.clone();
                    cfg.policy = policies::PolicySpec::named(name);
                    cfg.policy.seed = u64::from(rep);
                    cfg.engine.seed = u64::from(rep);
                    cfg.engine.model.jitter = 0.02;
                    cfg.driver.warmup_s = 30.0;
                    jobs.push(GridJob {
                        cfg,
                        plan: p.clone(),
                        book: None,
                        out_dir: dir.join(&point).join(name).join(format!("rep-{rep}")),
                        meta: CellMeta {
                            sweep: "pressure-grid-bench".into(),
                            point: point.clone(),
                            rep,
                            ..CellMeta::default()
                        },
                    });
                }
            }
        }
    }
    let plans_s = t_all.elapsed().as_secs_f64();
    let cells = jobs.len();
    let t = Instant::now();
    let results = sim::run_grid(jobs, threads);
    let run_s = t.elapsed().as_secs_f64();
    let mut requests = 0usize;
    let mut failed = 0usize;
    let mut min_req = usize::MAX;
    for r in &results {
        match r {
            Ok(s) => {
                requests += s.requests;
                min_req = min_req.min(s.requests);
            }
            Err(e) => {
                failed += 1;
                eprintln!("cell failed: {e}");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "| cells | threads | requests | min requests/cell | plans s | cells s (sim + rows + meta) | total s | failed |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {cells} | {threads} | {requests} | {min_req} | {plans_s:.1} | {run_s:.1} | {:.1} | {failed} |",
        t_all.elapsed().as_secs_f64()
    );
}

fn scale(per_user: u32) {
    let policies = [
        "session-affinity",
        "round-robin",
        "least-outstanding",
        "prefix-hash",
        "prefix-affinity",
        "exact-residency",
    ];
    println!(
        "| replicas | users | conversations | policy | goodput req/s | margin vs session-affinity | hit rate | busiest share | index nodes | index MiB | decide p50 ns | decide p99 ns | wall s |"
    );
    println!("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for replicas in [8u32, 64, 512] {
        let base = SimConfig::new(replicas, "session-affinity");
        // The reference load (32 users on 5 replicas) and working set (ws 1) scaled with the fleet.
        let users = (32 * replicas).div_ceil(5);
        let p = plan(base.capacity_tokens(), 1.0, 0.0, users, per_user);
        let book = sim::PromptBook::new(&p, &base.model, base.router.block_bytes, true)
            .expect("prompt book");
        let mut reference = None;
        for name in policies {
            let mut cfg = base.clone();
            cfg.policy = policies::PolicySpec::named(name);
            cfg.driver.warmup_s = 60.0;
            let t = Instant::now();
            let out = sim::simulate_with(&cfg, &p, &book).expect("simulate");
            let wall = t.elapsed().as_secs_f64();
            let s = summarize(&cfg, &p, &out, &CellMeta::default(), wall).expect("summary");
            let reference = *reference.get_or_insert(s.goodput_rps);
            let margin = if reference > 0.0 {
                format!("{:+.1}%", (s.goodput_rps / reference - 1.0) * 100.0)
            } else {
                "-".into()
            };
            let opt = |v: Option<u64>| v.map_or("-".into(), |v| v.to_string());
            println!(
                "| {replicas} | {users} | {} | {name} | {:.2} | {margin} | {:.3} | {:.3} | {} | {} | {} | {} | {wall:.1} |",
                p.conversations.len(),
                s.goodput_rps,
                s.hit_rate,
                s.busiest_share,
                s.index_nodes.map_or("-".into(), |n| n.to_string()),
                s.index_bytes.map_or("-".into(), |b| format!(
                    "{:.1}",
                    b as f64 / (1 << 20) as f64
                )),
                opt(s.decide_wall_ns_p50),
                opt(s.decide_wall_ns_p99),
            );
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| args.get(i).and_then(|a| a.parse::<usize>().ok());
    match args.first().map(String::as_str) {
        Some("throughput") => throughput(args.get(1).map(String::as_str)),
        Some("grid") => grid(arg(1).unwrap_or(2)),
        Some("scale") => scale(arg(1).unwrap_or(24) as u32),
        Some("calibrate") => {
            let cfg = SimConfig::new(5, "round-robin");
            let c = sim::calibrate(&cfg, &WorkloadSpec::default(), 50).expect("calibrate");
            println!("{}", serde_json::to_string_pretty(&c).unwrap_or_default());
        }
        _ => {
            eprintln!(
                "usage: bench throughput [policy] | grid [threads] | scale [requests_per_user] | calibrate"
            );
            std::process::exit(2);
        }
    }
}
