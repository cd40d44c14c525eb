//! Plans a whole trace and prints how long each step took, the trace's sharing structure, and how
//! fast the prompt texts are generated on demand.
//!
//! `cargo run --release -p trace --example plan_trace -- ../shared/traces/mooncake-conversation.jsonl [B…]`
//!
//! Steps: read the file, parse it, derive the sessions, build the replay plan (for each block size
//! B, default 512 and 64), and generate every request's prompt text once, one at a time into a
//! reused buffer — the driver and the simulator generate each text when they send it, never all
//! at once.

use std::time::Instant;

use trace::{ReplayPlan, ReplaySpec, Sessions, Trace, TraceStats};

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(path) = args.next() else {
        eprintln!("usage: plan_trace TRACE.jsonl [BLOCK_TOKENS…]");
        std::process::exit(2);
    };
    let mut sizes: Vec<u32> = args.map(|a| a.parse().expect("block tokens")).collect();
    if sizes.is_empty() {
        sizes = vec![512, 64];
    }
    let t0 = Instant::now();
    let bytes = std::fs::read(&path).expect("read the trace");
    let read_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let trace = Trace::parse_bytes(&path, &bytes).unwrap_or_else(|e| panic!("{e}"));
    let parse_s = t1.elapsed().as_secs_f64();
    let t2 = Instant::now();
    let sessions = Sessions::derive(&trace);
    let sessions_s = t2.elapsed().as_secs_f64();
    let stats = TraceStats::of(&trace, &sessions);
    println!(
        "trace {path}: {} bytes, hash {}",
        bytes.len(),
        trace.content_hash_hex()
    );
    println!(
        "{}",
        serde_json::to_string_pretty(&stats).expect("stats serialize")
    );
    println!();
    println!(
        "| step | B | requests | s |\n|---|---:|---:|---:|\n| read file | | | {read_s:.3} |\n| parse | | {} | {parse_s:.3} |\n| sessions | | {} | {sessions_s:.3} |",
        trace.len(),
        sessions.len()
    );
    for b in sizes {
        let spec = ReplaySpec {
            block_tokens: b,
            ..ReplaySpec::default()
        };
        let t3 = Instant::now();
        let plan = ReplayPlan::build(&trace, &spec).unwrap_or_else(|e| panic!("{e}"));
        let plan_s = t3.elapsed().as_secs_f64();
        let t4 = Instant::now();
        let fingerprint = plan.fingerprint_hex();
        let fp_s = t4.elapsed().as_secs_f64();
        println!(
            "| plan (parse + sessions + plan: {:.3} s in all) | {b} | {} | {plan_s:.3} |",
            parse_s + sessions_s + plan_s,
            plan.len()
        );
        println!(
            "| fingerprint {fingerprint} | {b} | {} | {fp_s:.3} |",
            plan.len()
        );
        let t5 = Instant::now();
        let mut buf = String::new();
        let mut total = 0usize;
        for r in plan.requests() {
            buf.clear();
            plan.prompt_into(r, &mut buf);
            total += buf.len();
        }
        let gen_s = t5.elapsed().as_secs_f64();
        println!(
            "| every prompt's text, on demand ({:.0} MB, {:.0} MB/s, largest {} kB) | {b} | {} | {gen_s:.3} |",
            total as f64 / 1e6,
            total as f64 / 1e6 / gen_s,
            plan.requests()
                .iter()
                .map(|r| plan.prompt_bytes(r))
                .max()
                .unwrap_or(0)
                / 1000,
            plan.len()
        );
    }
}
