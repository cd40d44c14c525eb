//! The binary announces readiness with one JSON line, serves, and exits cleanly on SIGTERM.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};

/// Kills the child even when an assertion fails.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(args: &[&str]) -> (Guard, serde_json::Value) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_engine"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("engine starts");
    let stdout = child.stdout.take().expect("stdout");
    let guard = Guard(child);
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("readiness line");
    let v: serde_json::Value = serde_json::from_str(&line).expect("one JSON line");
    (guard, v)
}

fn get(addr: &str, path: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    out
}

#[test]
fn readiness_line_then_clean_exit_on_sigterm() {
    let (mut g, v) = spawn(&[
        "--port",
        "0",
        "--kv-events-port",
        "0",
        "--num-gpu-blocks",
        "300",
    ]);
    let addr = v["listening"].as_str().expect("listening").to_owned();
    assert!(addr.starts_with("127.0.0.1:"));
    assert!(
        v["kv_events"]
            .as_str()
            .expect("events")
            .starts_with("tcp://127.0.0.1:")
    );
    assert!(
        v["kv_replay"]
            .as_str()
            .expect("replay")
            .starts_with("tcp://127.0.0.1:")
    );
    assert!(get(&addr, "/health").starts_with("HTTP/1.1 200"));
    assert!(get(&addr, "/metrics").contains("num_gpu_blocks=\"300\""));
    let rc = Command::new("kill")
        .args(["-TERM", &g.0.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(rc.success());
    let status = g.0.wait().expect("exits");
    assert!(status.success(), "{status:?}");
}

#[test]
fn events_off_prints_nulls_and_bad_flags_fail() {
    let (_g, v) = spawn(&["--port", "0"]);
    assert!(v["kv_events"].is_null());
    assert!(v["kv_replay"].is_null());
    let out = Command::new(env!("CARGO_BIN_EXE_engine"))
        .args(["--port", "0", "--speed", "0"])
        .output()
        .expect("runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("speed"));
}
