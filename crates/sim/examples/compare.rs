//! Runs one grid point for several policies and prints their summaries.
//!
//! `cargo run --release -p sim --example compare -- [ratio] [zipf_s] [users] [requests_per_user] [replicas]`

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
            let mut ttft: Vec<u64> = out
                .outcomes
                .iter()
                .filter_map(|o| o.first_us.map(|f| f - o.sent_us))
                .collect();
            ttft.sort_unstable();
            let q = |p: f64| ttft[((ttft.len() as f64 * p) as usize).min(ttft.len() - 1)];
            let mut oc: Vec<u32> = out
                .outcomes
                .iter()
                .filter_map(|o| o.decision.map(|d| d.outstanding_chosen))
                .collect();
            oc.sort_unstable();
            let pr = &out.per_replica_requests;
            eprintln!(
                "  ttft p10 {} p50 {} p90 {}; outstanding_chosen p50 {} p90 {} max {}; per-replica min {} max {}",
                q(0.1),
                q(0.5),
                q(0.9),
                oc[oc.len() / 2],
                oc[oc.len() * 9 / 10],
                oc[oc.len() - 1],
                pr.iter().min().unwrap_or(&0),
                pr.iter().max().unwrap_or(&0)
            );
            let mut e2e: Vec<u64> = out.outcomes.iter().map(|o| o.end_us - o.sent_us).collect();
            let mut lag: Vec<u64> = out
                .outcomes
                .iter()
                .map(|o| o.sent_us - o.scheduled_us)
                .collect();
            e2e.sort();
            lag.sort();
            let errs = out.outcomes.iter().filter(|o| !o.is_ok()).count();
            let think: Vec<u64> = match &plan.schedule {
                workload::Schedule::Closed { users } => {
                    users[0].iter().map(|s| s.think_us).collect()
                }
                _ => vec![],
            };
            eprintln!(
                "  user0 think sum {} last end {} max sent {}",
                think.iter().sum::<u64>(),
                out.end_us,
                out.outcomes.iter().map(|o| o.sent_us).max().unwrap_or(0)
            );
            eprintln!(
                "  e2e p50 {} p99 {} lag p50 {} p99 {} errors {errs} {:?}",
                e2e[e2e.len() / 2],
                e2e[e2e.len() * 99 / 100],
                lag[lag.len() / 2],
                lag[lag.len() * 99 / 100],
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
