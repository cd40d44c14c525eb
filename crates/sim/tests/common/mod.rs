//! Shared helpers: small plans (temp dirs come from `test-support`).

#![allow(dead_code)]

use workload::{ArrivalSpec, Plan, Sizing, WorkloadSpec};

/// A closed-loop plan sized against `capacity_tokens`.
pub fn closed_plan(
    capacity_tokens: u64,
    ratio: f64,
    zipf_s: f64,
    users: u32,
    per_user: u32,
    seed: u64,
) -> Plan {
    closed_plan_think(capacity_tokens, ratio, zipf_s, users, per_user, seed, 1.0)
}

/// [`closed_plan`] with a mean think time.
pub fn closed_plan_think(
    capacity_tokens: u64,
    ratio: f64,
    zipf_s: f64,
    users: u32,
    per_user: u32,
    seed: u64,
    think_mean_s: f64,
) -> Plan {
    let spec = WorkloadSpec {
        seed,
        sizing: Sizing::WorkingSet {
            capacity_tokens,
            ratio,
        },
        zipf_s,
        ..WorkloadSpec::default()
    };
    let arrival = ArrivalSpec::Closed {
        users,
        think_mean_s,
        requests_per_user: per_user,
    };
    Plan::build(&spec, &arrival).expect("plan")
}

/// A small open-loop plan with a fixed number of conversations.
pub fn open_plan(conversations: u32, rate_rps: f64, duration_s: f64, seed: u64) -> Plan {
    let spec = WorkloadSpec {
        seed,
        sizing: Sizing::Conversations(conversations),
        turns: 4,
        prefix_tokens: 300,
        user_tokens: 60,
        output_tokens: 24,
        ..WorkloadSpec::default()
    };
    let arrival = ArrivalSpec::Open {
        rate_rps,
        duration_s,
        start: workload::OpenStart::Fresh,
    };
    Plan::build(&spec, &arrival).expect("plan")
}
