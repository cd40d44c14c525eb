//! Runs one grid point for several policies and prints their summaries.
//!
//! `cargo run --release -p sim --example compare -- [ratio] [zipf_s] [users] [requests_per_user] [replicas]`
//! (`SIM_DEBUG=1` adds distributions per policy).

use sim::{CellMeta, SimConfig, simulate, summarize};
use workload::{ArrivalSpec, Plan, Sizing, WorkloadSpec};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize, d: f64| args.get(i).and_then(|a| a.parse().ok()).unwrap_or(d);
    let ratio = num(0, 1.0);
    let zipf_s = num(1, 0.0);
    let users = num(2, 32.0) as u32;
    let per_user = num(3, 64.0) as u32;
    let replicas = num(4, 5.0) as u32;
    let base = SimConfig::new(replicas, "round-robin");
    let spec = WorkloadSpec {
        sizing: Sizing::WorkingSet {
            capacity_tokens: base.capacity_tokens(),
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
    let plan = match Plan::build(&spec, &arrival) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    println!(
        "{} — {} conversations, {} requests",
        plan.name(),
        plan.conversations.len(),
        plan.request_count()
    );
    println!(
        "{:<28}{:>9}{:>9}{:>9}{:>10}{:>9}{:>8}{:>8}{:>9}{:>8}",
        "policy",
        "goodput",
        "ttft50",
        "itl50",
        "hit",
        "busiest",
        "spill",
        "preempt",
        "wall_s",
        "virt_s"
    );
    for name in policies::POLICY_NAMES {
        let mut cfg = base.clone();
        cfg.policy = policies::PolicySpec::named(name);
        cfg.driver.warmup_s = 30.0;
        let t = std::time::Instant::now();
        let out = match simulate(&cfg, &plan) {
            Ok(o) => o,
            Err(e) => {
                eprintln!("{name}: {e}");
                continue;
            }
        };
        let wall = t.elapsed().as_secs_f64();
        if std::env::var("SIM_DEBUG").is_ok() {
            // Distributions behind the medians: TTFT quantiles (µs), load at decision, spread of
            // requests over replicas, and the engine totals.
            let mut ttft: Vec<f64> = out
                .outcomes
                .iter()
                .filter_map(|o| o.first_us.map(|f| (f - o.sent_us) as f64))
                .collect();
            let mut q = |p: f64| schema::stats::quantile_in_place(&mut ttft, p).unwrap_or(0.0);
            let mut oc: Vec<u32> = out
                .outcomes
                .iter()
                .filter_map(|o| o.decision.map(|d| d.outstanding_chosen))
                .collect();
            oc.sort_unstable();
            let pr = &out.per_replica_requests;
            eprintln!(
                "  ttft_us p10 {:.0} p50 {:.0} p90 {:.0}; outstanding_chosen max {}; requests per replica {}..{}; {:?}",
                q(0.1),
                q(0.5),
                q(0.9),
                oc.last().copied().unwrap_or(0),
                pr.iter().min().unwrap_or(&0),
                pr.iter().max().unwrap_or(&0),
                out.engine
            );
        }
        match summarize(&cfg, &plan, &out, &CellMeta::default(), wall) {
            Ok(s) => println!(
                "{:<28}{:>9.2}{:>9.0}{:>9.2}{:>10.3}{:>9.3}{:>8.3}{:>8}{:>9.3}{:>8.0}",
                s.policy,
                s.goodput_rps,
                s.ttft_p50_ms.unwrap_or(f64::NAN),
                s.itl_p50_ms.unwrap_or(f64::NAN),
                s.hit_rate,
                s.busiest_share,
                s.spill_rate,
                s.preemptions,
                s.wall_s,
                s.virtual_s
            ),
            Err(e) => eprintln!("{name}: {e}"),
        }
    }
}
