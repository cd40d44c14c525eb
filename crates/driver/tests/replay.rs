//! `driver replay` against the scripted local server: exactly the plan's requests, at the plan's
//! times, with the plan's bytes; open loop (a session's next turn does not wait for the previous).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use driver::testserver::{Reply, ScriptedServer, StreamScript};
use driver::{ProgressMode, RunConfig, load_replay, load_replay_file, read_rows, run_replay};
use trace::{ReplayFile, ReplayPlan, ReplaySpec, Trace};

fn out_dir(name: &str) -> test_support::TempDir {
    test_support::temp_dir(&format!("driver-{name}"))
}

/// A Mooncake-format trace: system block 0, sessions keyed 1, 10 and 20 (session 1 has three
/// turns, the second only 100 ms after the first), 12 requests over 1.2 s of trace time.
fn trace_text() -> String {
    let lines: [(u64, u32, u32, &[u64]); 12] = [
        (0, 900, 4, &[0, 1]),
        (100, 1800, 3, &[0, 1, 2, 3]),
        (150, 600, 5, &[0, 10]),
        (300, 700, 2, &[0, 20]),
        (420, 2300, 6, &[0, 1, 2, 3, 4]),
        (500, 800, 1, &[0, 30]),
        (640, 1700, 3, &[0, 10, 11, 12]),
        (700, 520, 0, &[0, 40]),
        (820, 1200, 2, &[0, 20, 21]),
        (950, 1000, 4, &[0, 50]),
        (1100, 1900, 3, &[0, 30, 31, 32]),
        (1200, 700, 2, &[0, 60]),
    ];
    lines
        .iter()
        .map(|(ts, input, output, ids)| {
            format!(
                "{{\"timestamp\": {ts}, \"input_length\": {input}, \"output_length\": {output}, \"hash_ids\": {ids:?}, \"note\": \"extra fields are ignored\"}}\n"
            )
        })
        .collect()
}

fn config(url: String, out: PathBuf) -> RunConfig {
    RunConfig {
        progress: ProgressMode::Off,
        timeout_s: 10.0,
        ..RunConfig::new(url, out)
    }
}

fn spec() -> ReplaySpec {
    ReplaySpec {
        block_tokens: 16,
        time_scale: 0.5,
        ..ReplaySpec::default()
    }
}

#[tokio::test]
async fn replay_sends_exactly_the_plans_requests_at_their_times() {
    // Every reply takes 150 ms to its first token, longer than the 50 ms (scaled) between the
    // first two turns of session s1: an open loop sends the second turn anyway.
    let server = ScriptedServer::start(|seen| {
        let max = seen.body["max_tokens"].as_u64().unwrap_or(1) as usize;
        Reply::Stream(StreamScript::uniform(
            Duration::from_millis(150),
            Duration::from_millis(2),
            max,
            100,
        ))
    })
    .await
    .unwrap();
    let trace = Trace::parse_bytes("t.jsonl", trace_text().as_bytes()).unwrap();
    let plan = ReplayPlan::build(&trace, &spec()).unwrap();
    assert_eq!(plan.len(), 12);
    let tmp = out_dir("times");
    let out = tmp.path().join("client.csv");
    let cfg = RunConfig {
        warmup_s: 0.2,
        ..config(server.url(), out.clone())
    };
    let summary = run_replay(&plan, &cfg).await.unwrap();
    assert_eq!(summary.mode, "replay");
    assert_eq!(summary.plan_name, plan.name());
    assert_eq!(summary.plan_fingerprint, plan.fingerprint_hex());
    assert_eq!(
        (summary.requests, summary.errors, summary.not_sent),
        (12, 0, 0)
    );

    let by_id: BTreeMap<String, &trace::ReplayRequest> = plan
        .requests()
        .iter()
        .map(|r| (ReplayPlan::request_id(r), r))
        .collect();
    let rows = read_rows(&out).unwrap();
    assert_eq!(rows.len(), 12);
    let mut lags = Vec::new();
    for row in &rows {
        let r = by_id[&row.request_id];
        assert_eq!(row.session_id.as_deref(), Some(plan.session_id(r.session)));
        assert_eq!(row.turn, r.turn);
        // On the plan's (scaled) schedule, never early; lateness recorded.
        assert!(
            (row.scheduled_s.unwrap() - r.at_us as f64 / 1e6).abs() < 1e-6,
            "{row:?}"
        );
        assert!(row.sent_s.unwrap() >= row.scheduled_s.unwrap());
        assert_eq!(row.warmup, row.sent_s.unwrap() < 0.2);
        assert_eq!(row.output_tokens, Some(u64::from(r.max_tokens)));
        lags.push(row.send_lag_ms.unwrap());
    }
    lags.sort_by(f64::total_cmp);
    assert!(lags[lags.len() / 2] < 50.0, "median send lag {lags:?}");
    // Scaled times: the trace's 1.2 s in 0.6 s.
    assert_eq!(plan.end_us(), 600_000);
    // Open loop: s1's turn 2 (t2, 50 ms after t1) went out before t1's reply began.
    let row = |id: &str| rows.iter().find(|r| r.request_id == id).unwrap();
    assert_eq!(row("t2").session_id, row("t1").session_id);
    assert!(row("t2").sent_s.unwrap() < row("t1").first_token_s.unwrap());

    // The server saw each request once, with the plan's headers and bytes.
    let seen = server.seen();
    assert_eq!(seen.len(), 12);
    let mut ids: Vec<String> = seen.iter().filter_map(|s| s.request_id.clone()).collect();
    ids.sort();
    let mut want: Vec<String> = by_id.keys().cloned().collect();
    want.sort();
    assert_eq!(ids, want);
    for s in &seen {
        let r = by_id[s.request_id.as_deref().unwrap()];
        assert_eq!(s.path, "/v1/chat/completions");
        assert_eq!(s.session_id.as_deref(), Some(plan.session_id(r.session)));
        let messages = s.body["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 1);
        assert_eq!(messages[0]["role"], "user");
        let content = messages[0]["content"].as_str().unwrap();
        assert_eq!(content, plan.prompt(r));
        assert_eq!(content.len(), r.prompt_tokens as usize * 4);
        assert_eq!(s.body["max_tokens"], r.max_tokens);
        assert_eq!(s.body["stream"], true);
        assert_eq!(s.body["ignore_eos"], true);
    }
    // Requests sharing leading blocks sent the same leading bytes: t1 ([0, 1], block 1 cut) is
    // a prefix of t2 ([0, 1, 2, 3]); t1 and t3 ([0, 10]) share block 0 only.
    let content = |id: &str| {
        seen.iter()
            .find(|s| s.request_id.as_deref() == Some(id))
            .unwrap()
            .body["messages"][0]["content"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let block = spec().block_bytes();
    assert!(content("t2").starts_with(&content("t1")));
    assert_eq!(content("t1")[..block], content("t3")[..block]);
    let n = content("t1").len().min(content("t3").len());
    assert_ne!(content("t1")[block..n], content("t3")[block..n]);
}

#[tokio::test]
async fn the_duration_cap_stops_new_sends() {
    let server = ScriptedServer::start(|_| {
        Reply::Stream(StreamScript::uniform(
            Duration::from_millis(1),
            Duration::from_millis(1),
            1,
            10,
        ))
    })
    .await
    .unwrap();
    let trace = Trace::parse_bytes("t.jsonl", trace_text().as_bytes()).unwrap();
    let plan = ReplayPlan::build(&trace, &spec()).unwrap();
    let tmp = out_dir("cap");
    let out = tmp.path().join("client.csv");
    // Plan times (scaled): 0, 50, 75, 150, 210, 250, … ms; the cap at 0.2 s sends four.
    let cfg = RunConfig {
        duration_s: Some(0.2),
        ..config(server.url(), out.clone())
    };
    let summary = run_replay(&plan, &cfg).await.unwrap();
    assert_eq!((summary.requests, summary.not_sent), (4, 8));
    assert_eq!(read_rows(&out).unwrap().len(), 4);
}

#[test]
fn a_replay_file_reloads_its_plan_and_refuses_a_changed_trace() {
    let dir = out_dir("file");
    let trace_path = dir.path().join("t.jsonl");
    std::fs::write(&trace_path, trace_text()).unwrap();
    let plan = load_replay(&trace_path, &spec()).unwrap();
    let file = ReplayFile::new(&trace_path.display().to_string(), &plan);
    let file_path = dir.path().join("trace-plan.json");
    std::fs::write(&file_path, serde_json::to_vec(&file).unwrap()).unwrap();
    let again = load_replay_file(&file_path).unwrap();
    assert_eq!(again.encode(), plan.encode());
    // One more request in the trace: other bytes, refused.
    std::fs::write(
        &trace_path,
        format!(
            "{}{}\n",
            trace_text(),
            r#"{"timestamp": 2000, "input_length": 600, "output_length": 2, "hash_ids": [0, 70]}"#
        ),
    )
    .unwrap();
    let err = load_replay_file(&file_path).unwrap_err().to_string();
    assert!(err.contains("the trace changed"), "{err}");
    // A malformed line is named by path and line.
    std::fs::write(
        &trace_path,
        format!("{}{{\"timestamp\": 1}}\n", trace_text()),
    )
    .unwrap();
    let err = load_replay(&trace_path, &spec()).unwrap_err().to_string();
    assert!(
        err.contains(&format!("{}:13: not a trace record", trace_path.display())),
        "{err}"
    );
}
