//! Plan build time at the full pressure grid's largest cell (working set 8 on the full fleet,
//! 5 replicas × 8,192 blocks × 16 tokens = 655,360 tokens), for the grouped default workload and
//! the workload before prefix groups, each skew of the grid, closed and open loop.
//!
//! `cargo run --release -p workload --example plan_build [-- REPEATS]` prints one row per plan:
//! the fastest of REPEATS (default 3) builds, the encoding (`Plan::to_bytes`), and the plan's size.

use std::time::Instant;

use workload::spec::DEFAULT_PRIVATE_CONTEXT_TOKENS;
use workload::{ArrivalSpec, Plan, PrefixGroups, Sizing, WorkloadSpec};

/// The full fleet's KV capacity in tokens (`experiment::fleet_spec`: 5 replicas, 8,192 blocks).
const FULL_CAPACITY_TOKENS: u64 = 5 * 8_192 * 16;

fn main() {
    let repeats: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse().expect("REPEATS must be a number"))
        .unwrap_or(3)
        .max(1);
    let arrivals = [
        // 32 users; 600 requests each is more than a full cell's 60 s window at speed 6 asks
        // for (`experiment::calibration::requests_per_user`).
        ArrivalSpec::Closed {
            users: 32,
            think_mean_s: 1.0 / 6.0,
            requests_per_user: 600,
        },
        // 10 req/s of model time at speed 6 for a 60 s cell.
        ArrivalSpec::Open {
            rate_rps: 60.0,
            duration_s: 60.0,
            start: workload::OpenStart::Fresh,
        },
    ];
    println!(
        "{:>6} {:>9} {:>9} {:>10} {:>6}  plan",
        "convs", "requests", "build_ms", "encode_ms", "MiB"
    );
    for groups in [Some(PrefixGroups::DEFAULT), None] {
        for zipf_s in [0.0, 1.0, 1.4] {
            for arrival in &arrivals {
                let spec = WorkloadSpec {
                    sizing: Sizing::WorkingSet {
                        capacity_tokens: FULL_CAPACITY_TOKENS,
                        ratio: 8.0,
                    },
                    zipf_s,
                    prefix_groups: groups,
                    prefix_tokens: if groups.is_some() {
                        DEFAULT_PRIVATE_CONTEXT_TOKENS
                    } else {
                        WorkloadSpec::default().prefix_tokens
                    },
                    ..WorkloadSpec::default()
                };
                let mut best_build_s = f64::INFINITY;
                let mut best_encode_s = f64::INFINITY;
                let mut last = None;
                for _ in 0..repeats {
                    let t0 = Instant::now();
                    let plan = Plan::build(&spec, arrival).expect("plan");
                    best_build_s = best_build_s.min(t0.elapsed().as_secs_f64());
                    let t1 = Instant::now();
                    let bytes = plan.to_bytes().expect("encode");
                    best_encode_s = best_encode_s.min(t1.elapsed().as_secs_f64());
                    last = Some((plan, bytes.len()));
                }
                let (plan, len) = last.expect("at least one repeat");
                println!(
                    "{:>6} {:>9} {:>9.0} {:>10.0} {:>6.1}  {}",
                    plan.conversations.len(),
                    plan.request_count(),
                    best_build_s * 1e3,
                    best_encode_s * 1e3,
                    len as f64 / (1 << 20) as f64,
                    plan.name()
                );
            }
        }
    }
}
