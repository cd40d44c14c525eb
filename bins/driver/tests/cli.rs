//! The `driver` binary end to end against the scripted local server.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use driver::testserver::{Reply, ScriptedServer, StreamScript};

const BIN: &str = env!("CARGO_BIN_EXE_driver");

/// A fresh temp dir for one test, removed when it drops.
fn dir(name: &str) -> test_support::TempDir {
    test_support::temp_dir(&format!("driver-cli-{name}"))
}

fn plan(path: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "plan",
        "--out",
        path.to_str().unwrap(),
        "--conversations",
        "3",
        "--prefix-tokens",
        "64",
        "--user-tokens",
        "16",
        "--output-tokens",
        "4",
    ];
    args.extend_from_slice(extra);
    let out = Command::new(BIN).args(&args).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Runs the binary with the runtime free to serve the test server meanwhile; the child is
/// killed if the test fails first.
async fn run(args: Vec<String>) -> std::process::Output {
    tokio::process::Command::new(BIN)
        .args(args)
        .kill_on_drop(true)
        .output()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_then_closed_and_open_runs_write_rows() {
    let server = ScriptedServer::start(|_| {
        Reply::Stream(StreamScript::uniform(
            Duration::from_millis(2),
            Duration::from_millis(1),
            4,
            30,
        ))
    })
    .await
    .unwrap();
    let d = dir("runs");

    let closed = d.path().join("closed.bin");
    let desc = plan(
        &closed,
        &[
            "--users",
            "2",
            "--think-mean-s",
            "0.01",
            "--requests-per-user",
            "5",
        ],
    );
    assert_eq!(desc["requests"], 10);
    assert_eq!(
        desc["name"],
        "chat-n3-s0-t6-p64-u16-o4-seed7-closed-u2-th0.01-r5"
    );
    assert_eq!(desc["fingerprint"].as_str().unwrap().len(), 16);
    // Same flags, same bytes.
    let again = plan(
        &d.path().join("again.bin"),
        &[
            "--users",
            "2",
            "--think-mean-s",
            "0.01",
            "--requests-per-user",
            "5",
        ],
    );
    assert_eq!(again["fingerprint"], desc["fingerprint"]);

    let csv = d.path().join("closed.csv");
    let out = run(vec![
        "closed".into(),
        "--url".into(),
        server.url(),
        "--plan".into(),
        closed.display().to_string(),
        "--out".into(),
        csv.display().to_string(),
        "--progress".into(),
        "off".into(),
    ])
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("10 sent, 10 ok, 0 errors"), "{stdout}");
    assert_eq!(driver::read_rows(&csv).unwrap().len(), 10);

    let open = d.path().join("open.bin");
    let desc = plan(
        &open,
        &["--arrival", "open", "--rate", "40", "--duration-s", "0.5"],
    );
    let csv = d.path().join("open.csv");
    let out = run(vec![
        "open".into(),
        "--url".into(),
        server.url(),
        "--plan".into(),
        open.display().to_string(),
        "--out".into(),
        csv.display().to_string(),
        "--warmup-s".into(),
        "0.1".into(),
    ])
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = driver::read_rows(&csv).unwrap();
    assert_eq!(rows.len() as u64, desc["requests"].as_u64().unwrap());
    assert!(rows.iter().all(|r| r.is_ok()));
    // Not a terminal: no progress line on stderr.
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn bad_inputs_fail_with_a_message() {
    let d = dir("bad");
    let garbage = d.path().join("garbage.bin");
    std::fs::write(&garbage, b"not a plan").unwrap();
    let out = run(vec![
        "closed".into(),
        "--url".into(),
        "http://127.0.0.1:9".into(),
        "--plan".into(),
        garbage.display().to_string(),
        "--out".into(),
        d.path().join("c.csv").display().to_string(),
    ])
    .await;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a valid plan"));

    let p = d.path().join("closed.bin");
    plan(&p, &[]);
    let out = run(vec![
        "open".into(),
        "--url".into(),
        "http://127.0.0.1:9".into(),
        "--plan".into(),
        p.display().to_string(),
        "--out".into(),
        d.path().join("c.csv").display().to_string(),
    ])
    .await;
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("driver closed") || err.contains("cannot reach"),
        "{err}"
    );
}

#[test]
fn plan_flags_choose_prefix_groups_and_sharing() {
    let d = dir("groups");
    let grouped = plan(
        &d.path().join("grouped.bin"),
        &[
            "--prefix-groups",
            "4",
            "--group-prefix-tokens",
            "32",
            "--group-skew",
            "0.5",
            "--conversation-sharing",
            "shared",
        ],
    );
    assert_eq!(
        grouped["workload_name"],
        "chat-n3-s0-t6-p64-u16-o4-g4-gp32-gs0.5-shared-seed7"
    );
    assert_eq!(grouped["prefix_groups"]["count"], 4);
    assert_eq!(grouped["conversation_sharing"], "shared");
    // Groups off: the name measurements recorded before groups existed.
    let plain = plan(&d.path().join("plain.bin"), &["--prefix-groups", "0"]);
    assert_eq!(plain["workload_name"], "chat-n3-s0-t6-p64-u16-o4-seed7");
    assert_eq!(plain["prefix_groups"], serde_json::Value::Null);
    assert_eq!(plain["conversation_sharing"], "exclusive");
}
