//! `driver trace-plan` and `driver replay` end to end: the plan's description, a replay's rows,
//! and a malformed trace refused with `path:line`.

use std::process::Command;
use std::time::Duration;

use driver::testserver::{Reply, ScriptedServer, StreamScript};

const BIN: &str = env!("CARGO_BIN_EXE_driver");

/// A fresh temp dir for one test, removed when it drops.
fn dir(name: &str) -> test_support::TempDir {
    test_support::temp_dir(&format!("driver-replay-cli-{name}"))
}

const TRACE: &str = concat!(
    r#"{"timestamp": 0, "input_length": 700, "output_length": 3, "hash_ids": [0, 1]}"#,
    "\n",
    r#"{"timestamp": 200, "input_length": 1100, "output_length": 2, "hash_ids": [0, 1, 2]}"#,
    "\n",
    r#"{"timestamp": 300, "input_length": 600, "output_length": 4, "hash_ids": [0, 5]}"#,
    "\n",
);

#[test]
fn trace_plan_describes_the_replay_and_refuses_a_malformed_line() {
    let d = dir("describe");
    let path = d.path().join("t.jsonl");
    std::fs::write(&path, TRACE).unwrap();
    let out = Command::new(BIN)
        .args(["trace-plan", "--trace", path.to_str().unwrap()])
        .args(["--trace-block-tokens", "64", "--time-scale", "2"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["requests"], 3);
    assert_eq!(v["sessions"], 2);
    assert_eq!(v["system_prefix_blocks"], 1);
    assert_eq!(v["spec"]["block_tokens"], 64);
    assert_eq!(v["replay_span_s"], 0.6);
    assert!(
        v["name"]
            .as_str()
            .unwrap()
            .ends_with("-b64-seed7-replay-x2"),
        "{v}"
    );
    std::fs::write(&path, format!("{TRACE}{{\"timestamp\": 400}}\n")).unwrap();
    let out = Command::new(BIN)
        .args(["trace-plan", "--trace", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "{}:4: not a trace record: missing field",
            path.display()
        )),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_writes_one_row_per_trace_request() {
    let server = ScriptedServer::start(|_| {
        Reply::Stream(StreamScript::uniform(
            Duration::from_millis(2),
            Duration::from_millis(1),
            2,
            30,
        ))
    })
    .await
    .unwrap();
    let d = dir("run");
    let path = d.path().join("t.jsonl");
    std::fs::write(&path, TRACE).unwrap();
    let csv = d.path().join("client.csv");
    let out = tokio::process::Command::new(BIN)
        .args(["replay", "--trace", path.to_str().unwrap()])
        .args(["--trace-block-tokens", "32", "--time-scale", "0.5"])
        .args(["--url", &server.url(), "--out", csv.to_str().unwrap()])
        .args(["--progress", "off"])
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("mode      replay"), "{stdout}");
    let rows = driver::read_rows(&csv).unwrap();
    let mut ids: Vec<&str> = rows.iter().map(|r| r.request_id.as_str()).collect();
    ids.sort();
    assert_eq!(ids, ["t1", "t2", "t3"]);
    let sessions: Vec<(&str, &str, u32)> = {
        let mut v: Vec<_> = rows
            .iter()
            .map(|r| {
                (
                    r.request_id.as_str(),
                    r.session_id.as_deref().unwrap_or_default(),
                    r.turn,
                )
            })
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        sessions,
        [("t1", "s1", 1), ("t2", "s1", 2), ("t3", "s5", 1)]
    );
    assert_eq!(server.seen().len(), 3);
}
