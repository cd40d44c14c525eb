//! The `router` binary: readiness line (serving and admin listeners), one proxied stream, rows
//! flushed on SIGTERM, the admin API on its own port (and behind a token), flag errors.
//! Blocking on purpose: the workspace's mock replica on a runtime of its own
//! (`MockReplica::spawn`) and a raw HTTP/1.1 client.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use test_support::{MockReplica, Script, temp_dir};

/// Kills the router if a test fails before it exits on its own.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A GET on a fresh connection (`authorization` when given); the whole raw response.
fn get(addr: &str, path: &str, authorization: Option<&str>) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let auth = authorization.map_or(String::new(), |a| format!("authorization: {a}\r\n"));
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: x\r\n{auth}connection: close\r\n\r\n"
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    resp
}

#[test]
fn serves_a_stream_and_flushes_rows_on_sigterm() {
    let replica = MockReplica::spawn(Script {
        events: 1,
        cached_tokens: Some(0),
        ..Script::default()
    });
    let url = replica.url.clone();
    let dir = temp_dir("router-cli");
    let rows = dir.path().join("router.csv");
    let child = Command::new(env!("CARGO_BIN_EXE_router"))
        .args([
            "--port",
            "0",
            "--replicas",
            &url,
            "--policy",
            "session-affinity",
            "--health-interval-ms",
            "60000",
            "--router-id",
            "cli-r0",
            "--share-decisions-bind",
            "tcp://127.0.0.1:0",
        ])
        .arg("--rows")
        .arg(&rows)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut guard = Guard(child);
    let mut line = String::new();
    BufReader::new(guard.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let ready: serde_json::Value = serde_json::from_str(&line).expect("readiness line is JSON");
    let addr = ready["listening"].as_str().unwrap().to_string();
    assert!(addr.starts_with("127.0.0.1:"));
    let admin = ready["admin"]
        .as_str()
        .expect("the admin listener is announced");
    assert!(admin.starts_with("127.0.0.1:") && admin != addr, "{ready}");
    assert_eq!(ready["router_id"], "cli-r0", "{ready}");
    let share = ready["share_endpoint"]
        .as_str()
        .expect("the decision publisher is announced");
    let share_port: u16 = share
        .strip_prefix("tcp://127.0.0.1:")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("{ready}"));
    assert_ne!(share_port, 0, "port 0 is resolved: {ready}");

    let body =
        r#"{"model":"m","prompt":"hello","stream":true,"stream_options":{"include_usage":true}}"#;
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-request-id: cli-1\r\nx-session-id: s\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.to_ascii_lowercase().contains("x-request-id: cli-1"));
    assert!(resp.contains("data: [DONE]"));

    let status = Command::new("kill")
        .args(["-TERM", &guard.0.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = guard.0.wait().unwrap();
    assert!(exit.success(), "router exits cleanly on SIGTERM: {exit:?}");
    let text = std::fs::read_to_string(&rows).unwrap();
    let mut lines = text.lines();
    assert!(
        lines
            .next()
            .unwrap()
            .starts_with("request_id,session_id,arrival_s,policy,replica,branch")
    );
    let row: Vec<&str> = lines.next().expect("one row").split(',').collect();
    assert_eq!(row[0], "cli-1");
    assert_eq!(row[1], "s");
    assert_eq!(row[3], "session-affinity");
    assert_eq!(row[5], "ring");
    assert_eq!(row[12], "200");
    let (prompt_tokens, cached) = replica.state.reported.lock()["cli-1"];
    assert_eq!((row[13], cached), ("0", Some(0)));
    assert_eq!(
        row[14],
        prompt_tokens.to_string(),
        "the replica's usage, read in passing"
    );
}

#[test]
fn bad_flags_are_refused_with_a_message() {
    for args in [
        vec!["--replicas", "http://127.0.0.1:1", "--policy", "nope"],
        vec![
            "--replicas",
            "http://127.0.0.1:1,http://127.0.0.1:2",
            "--kv-events",
            "tcp://127.0.0.1:3",
        ],
        vec!["--replicas", "ftp://x"],
        vec!["--replicas", "http://127.0.0.1:1", "--spill-ratio", "-1"],
        vec![
            "--replicas",
            "http://127.0.0.1:1",
            "--kv-events-format",
            "trtllm",
        ],
        vec![
            "--replicas",
            "http://127.0.0.1:1",
            "--admin-host",
            "0.0.0.0",
        ],
        vec![
            "--replicas",
            "http://127.0.0.1:1",
            "--admin-token-file",
            "/nonexistent/token",
        ],
        vec!["--replicas", "http://127.0.0.1:1", "--router-id", ""],
        vec![
            "--replicas",
            "http://127.0.0.1:1",
            "--port",
            "0",
            "--share-decisions-bind",
            "not-an-endpoint",
        ],
        vec![],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_router"))
            .args(&args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} accepted");
        assert!(!out.stderr.is_empty(), "{args:?}: no message");
    }
}

#[test]
fn replicas_come_from_a_config_file() {
    let dir = temp_dir("router-cli-cfg");
    let cfg = dir.path().join("replicas.json");
    std::fs::write(&cfg, r#"{"replicas":[{"url":"http://127.0.0.1:9"},{"url":"http://127.0.0.1:10","kv_events":null}]}"#).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_router"))
        .args([
            "--port",
            "0",
            "--policy",
            "round-robin",
            // An SGLang fleet's events format is accepted (no replica publishes here).
            "--kv-events-format",
            "sglang",
            "--health-interval-ms",
            "60000",
        ])
        .arg("--config")
        .arg(&cfg)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut guard = Guard(child);
    let mut line = String::new();
    BufReader::new(guard.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let ready: serde_json::Value = serde_json::from_str(&line).unwrap();
    // Not sharing: no publisher; the default router id names the serving port.
    assert!(ready["share_endpoint"].is_null(), "{ready}");
    let port = ready["listening"]
        .as_str()
        .unwrap()
        .rsplit(':')
        .next()
        .unwrap();
    let id = ready["router_id"].as_str().unwrap();
    assert!(
        id == "router" || id.ends_with(&format!(":{port}")),
        "{ready}"
    );
    // The serving port has no admin API; the admin listener does.
    let resp = get(
        ready["listening"].as_str().unwrap(),
        "/admin/replicas",
        None,
    );
    assert!(resp.starts_with("HTTP/1.1 404"), "{resp}");
    let resp = get(ready["admin"].as_str().unwrap(), "/admin/replicas", None);
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    let body = resp.split("\r\n\r\n").nth(1).unwrap();
    let list: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(list[0]["url"], "http://127.0.0.1:9");
    assert_eq!(list[1]["id"], 1);
    let status = Command::new("kill")
        .args(["-INT", &guard.0.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    assert!(guard.0.wait().unwrap().success(), "SIGINT exits cleanly");
}

#[test]
fn the_admin_token_file_locks_the_admin_listener() {
    let dir = temp_dir("router-cli-token");
    let token = dir.path().join("admin.token");
    std::fs::write(&token, "cli-s3cret\n").unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_router"))
        .args([
            "--port",
            "0",
            "--replicas",
            "http://127.0.0.1:9",
            "--health-interval-ms",
            "60000",
        ])
        .arg("--admin-token-file")
        .arg(&token)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut guard = Guard(child);
    let mut line = String::new();
    BufReader::new(guard.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let ready: serde_json::Value = serde_json::from_str(&line).unwrap();
    let admin = ready["admin"].as_str().unwrap();
    let resp = get(admin, "/admin/replicas", None);
    assert!(resp.starts_with("HTTP/1.1 401"), "{resp}");
    let resp = get(admin, "/admin/replicas", Some("Bearer cli-s3cret"));
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    let status = Command::new("kill")
        .args(["-TERM", &guard.0.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    assert!(guard.0.wait().unwrap().success());
}

#[test]
fn a_malformed_api_keys_file_is_refused_with_its_line() {
    let dir = temp_dir("router-keys");
    let keys = dir.path().join("keys.txt");
    std::fs::write(
        &keys,
        format!(
            "# keys\n{} {}\nbob sha256:1234 rps=1\n",
            "alice",
            proxy::keys::hash_line("sk-alice")
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_router"))
        .args([
            "--replicas",
            "http://127.0.0.1:1",
            "--port",
            "0",
            "--api-keys",
        ])
        .arg(&keys)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("{}:3: ", keys.display())) && err.contains("64 hex digits"),
        "{err}"
    );
}
