//! The `router` binary: readiness line (serving and admin listeners), one proxied stream, rows
//! flushed on SIGTERM, the admin API on its own port (and behind a token), flag errors.
//! Std-only on purpose (a blocking mock replica and a raw HTTP/1.1 client).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Kills the router if a test fails before it exits on its own.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

const SSE: &str = "data: {\"choices\":[{\"index\":0,\"text\":\"hi\",\"finish_reason\":null}],\"usage\":null}\n\n\
data: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":1,\"total_tokens\":13,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\n\
data: [DONE]\n\n";

/// Serves `n` connections: one request each, answered with a fixed SSE body and closed.
fn mock_replica(n: usize) -> (String, std::thread::JoinHandle<Vec<String>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let h = std::thread::spawn(move || {
        let mut seen = Vec::new();
        for _ in 0..n {
            let (mut s, _) = l.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let req = read_request(&mut s);
            let head = req.lines().next().unwrap_or("").to_string();
            if head.starts_with("GET /health") {
                let _ = s.write_all(
                    b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                );
            } else {
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n{SSE}"
                );
                let _ = s.write_all(resp.as_bytes());
            }
            seen.push(req);
        }
        seen
    });
    (url, h)
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

fn read_request(s: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if s.read(&mut byte).unwrap_or(0) == 0 {
            break;
        }
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).to_string();
    let len = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().parse::<usize>().unwrap_or(0))
        })
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    let _ = s.read_exact(&mut body);
    head + &String::from_utf8_lossy(&body)
}

#[test]
fn serves_a_stream_and_flushes_rows_on_sigterm() {
    // The health loop also connects, so serve generously and stop counting at shutdown.
    let (url, _replica) = mock_replica(64);
    let dir = std::env::temp_dir().join(format!("router-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rows = dir.join("router.csv");
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
    assert_eq!(row[13], "0");
    assert_eq!(row[14], "12");
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
    let dir = std::env::temp_dir().join(format!("router-cli-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("replicas.json");
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
    let dir = std::env::temp_dir().join(format!("router-cli-token-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let token = dir.join("admin.token");
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
