//! A trace replay end to end in virtual time: a small Mooncake-format trace sliced and mapped by
//! the `trace` crate, simulated under several policies, rows and meta in the live schema.

mod common;

use std::collections::BTreeMap;

use sim::{CellMeta, SimConfig, context_tokens, run_trace_cell};
use test_support::temp_dir;
use trace::{ReplayPlan, ReplaySpec, Trace};

/// 30 sessions behind system block 0, one to four turns each, a turn re-sending its session's
/// earlier blocks and adding two; sessions start 0.4 s apart, turns 3 s apart.
fn trace_text() -> String {
    let mut lines: Vec<(u64, String)> = Vec::new();
    let mut next_id = 1u64;
    for s in 0..30u64 {
        let turns = 1 + s % 4;
        let mut ids = vec![0u64];
        for k in 0..turns {
            ids.push(next_id);
            ids.push(next_id + 1);
            next_id += 2;
            let input = (ids.len() as u64 - 1) * 512 + 100 + 7 * s;
            let output = 4 + (s + k) % 9;
            let ts = s * 400 + k * 3000;
            lines.push((
                ts,
                format!(
                    "{{\"timestamp\": {ts}, \"input_length\": {input}, \"output_length\": {output}, \"hash_ids\": {ids:?}}}"
                ),
            ));
        }
    }
    lines.sort_by_key(|(ts, _)| *ts);
    lines.into_iter().map(|(_, l)| l + "\n").collect()
}

fn plan(spec: &ReplaySpec) -> ReplayPlan {
    let t = Trace::parse_bytes("t.jsonl", trace_text().as_bytes()).expect("trace");
    ReplayPlan::build(&t, spec).expect("plan")
}

fn config(policy: &str, plan: &ReplayPlan) -> SimConfig {
    let mut cfg = SimConfig::new(3, policy);
    cfg.engine.num_gpu_blocks = 1024;
    cfg.engine.max_model_len = cfg.engine.max_model_len.max(context_tokens(plan));
    cfg.driver.warmup_s = 2.0;
    cfg
}

#[test]
fn a_trace_slice_replays_end_to_end_in_the_simulator() {
    let scratch = temp_dir("sim-test-trace-replay");
    let spec = ReplaySpec {
        block_tokens: 64,
        time_scale: 0.5,
        start_s: 1.0,
        duration_s: Some(20.0),
        ..ReplaySpec::default()
    };
    let plan = plan(&spec);
    let by_id: BTreeMap<String, &trace::ReplayRequest> = plan
        .requests()
        .iter()
        .map(|r| (ReplayPlan::request_id(r), r))
        .collect();
    assert!(plan.len() > 30, "{}", plan.len());
    let meta = CellMeta {
        sweep: "trace".into(),
        point: "slice".into(),
        rep: 1,
        ..CellMeta::default()
    };
    let mut hits = BTreeMap::new();
    for policy in [
        "round-robin",
        "session-affinity",
        "prefix-affinity",
        "exact-residency",
    ] {
        let dir = scratch.path().join(policy);
        let cfg = config(policy, &plan);
        let summary = run_trace_cell(&cfg, &plan, &dir, &meta).expect("cell");
        assert_eq!(summary.requests, plan.len());
        assert_eq!(summary.ok, plan.len(), "{policy}");
        let rows = analysis::read_client_csv(&dir.join("client.csv")).expect("client rows");
        let router = analysis::read_router_csv(&dir.join("router.csv")).expect("router rows");
        assert_eq!((rows.len(), router.len()), (plan.len(), plan.len()));
        let mut replica_of_session: BTreeMap<&str, std::collections::BTreeSet<u32>> =
            BTreeMap::new();
        for row in &rows {
            let r = by_id[&row.request_id];
            assert_eq!(row.session_id.as_deref(), Some(plan.session_id(r.session)));
            assert_eq!(row.turn, r.turn);
            // Open loop, no turn order: every request leaves at its plan time.
            let at = r.at_us as f64 / 1e6;
            assert!((row.scheduled_s.unwrap() - at).abs() < 1e-6, "{row:?}");
            assert!((row.sent_s.unwrap() - at).abs() < 1e-6, "{row:?}");
            assert_eq!(row.output_tokens, Some(u64::from(r.max_tokens)));
            // The engine saw the prompt the live driver would send, tokenized as the live
            // engine tokenizes it.
            let mut tokens = Vec::new();
            sim::trace::request_into(&plan, r, &cfg.model, 64, &mut tokens, None);
            assert_eq!(row.prompt_tokens, Some(tokens.len() as u64));
        }
        for row in &router {
            replica_of_session
                .entry(row.session_id.as_deref().expect("session id"))
                .or_default()
                .insert(row.replica.expect("routed"));
        }
        if policy == "session-affinity" {
            assert!(replica_of_session.values().all(|r| r.len() == 1));
        }
        let meta_json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("meta.json")).unwrap()).unwrap();
        assert_eq!(meta_json["plan_fingerprint"], plan.fingerprint_hex());
        assert_eq!(meta_json["workload_name"], plan.workload_name());
        assert_eq!(
            meta_json["workload_fingerprint"],
            plan.workload_fingerprint_hex()
        );
        assert_eq!(meta_json["virtual"], true);
        // The window ends where the slice does: 20 trace s × 0.5.
        assert_eq!(summary.window.measured_end_s, 10.0);
        hits.insert(policy, summary.hit_rate);
        // Deterministic: the same cell again writes the same bytes.
        let again = scratch.path().join(format!("{policy}-again"));
        run_trace_cell(&cfg, &plan, &again, &meta).expect("cell");
        for f in ["client.csv", "router.csv"] {
            assert_eq!(
                std::fs::read(dir.join(f)).unwrap(),
                std::fs::read(again.join(f)).unwrap(),
                "{policy} {f}"
            );
        }
    }
    // Later turns re-send their session's blocks: affinity finds them cached, spraying less so.
    assert!(hits["session-affinity"] > hits["round-robin"], "{hits:?}");
    assert!(hits["prefix-affinity"] > hits["round-robin"], "{hits:?}");
}

#[test]
fn a_request_longer_than_the_engines_admit_is_a_row_not_a_panic() {
    let scratch = temp_dir("sim-test-trace-too-long");
    let plan = plan(&ReplaySpec {
        block_tokens: 64,
        max_requests: Some(12),
        ..ReplaySpec::default()
    });
    let mut cfg = config("round-robin", &plan);
    cfg.driver.warmup_s = 0.0;
    cfg.engine.max_model_len = 200;
    let summary = run_trace_cell(&cfg, &plan, scratch.path(), &CellMeta::default()).expect("cell");
    assert_eq!(summary.requests, 12);
    let rows = analysis::read_client_csv(&scratch.path().join("client.csv")).unwrap();
    let refused = rows.iter().filter(|r| r.status == 400).count();
    assert!(refused > 0 && refused < 12, "{refused}");
    assert!(rows.iter().filter(|r| r.status == 400).all(|r| {
        r.error
            .as_deref()
            .is_some_and(|e| e.contains("maximum context length"))
    }));
    assert!(context_tokens(&plan) > 200);
}

/// A ladder whose second stage waits for the first to drain: in virtual time no request of the
/// second stage is sent before every request of the first has ended, the second stage keeps its
/// own gaps (every arrival after the wait moves by the same amount), and without the flag the
/// stages overlap.
#[test]
fn a_stage_that_waits_for_the_drain_starts_when_the_fleet_is_empty() {
    use sim::rows::Origin;
    use trace::{SharedPrefix, Stage};
    let ladder = |wait| SharedPrefix {
        groups: 2,
        prompts_per_group: 4,
        prefix_tokens: 512,
        question_tokens: 64,
        output_tokens: 32,
        seed: 1,
        stages: vec![
            Stage {
                rate_rps: Some(400.0),
                requests: 16,
                wait_for_drain: false,
            },
            Stage {
                rate_rps: Some(50.0),
                requests: 16,
                wait_for_drain: wait,
            },
        ],
    };
    let run = |wait| {
        let text = ladder(wait).to_jsonl().unwrap();
        let t = Trace::parse_bytes("ladder.jsonl", text.as_bytes()).unwrap();
        let plan = ReplayPlan::build(&t, &ReplaySpec::default()).unwrap();
        let out = sim::simulate_trace(&config("round-robin", &plan), &plan).unwrap();
        assert_eq!(out.outcomes.len(), 32);
        let mut by_line: Vec<_> = out
            .outcomes
            .iter()
            .map(|o| match o.origin {
                Origin::Trace { line, .. } => (line, o.scheduled_us, o.sent_us, o.end_us),
                _ => panic!("a trace request"),
            })
            .collect();
        by_line.sort();
        let (first, second) = by_line.split_at(16);
        let first_end = first.iter().map(|r| r.3).max().unwrap();
        let second_start = second.iter().map(|r| r.2).min().unwrap();
        let planned: Vec<u64> = t.records()[16..].iter().map(|r| r.timestamp_us).collect();
        let shifts: Vec<u64> = second.iter().zip(&planned).map(|(r, p)| r.1 - p).collect();
        (first_end, second_start, shifts)
    };
    let (first_end, second_start, shifts) = run(true);
    assert!(second_start >= first_end, "{second_start} < {first_end}");
    assert!(
        shifts.iter().all(|s| *s == shifts[0]) && shifts[0] > 0,
        "{shifts:?}"
    );
    let (first_end, second_start, shifts) = run(false);
    assert!(
        second_start < first_end,
        "without the wait the stages overlap"
    );
    assert!(shifts.iter().all(|s| *s == 0));
}
