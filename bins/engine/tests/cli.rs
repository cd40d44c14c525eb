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

/// The thread's scheduling policy, from /proc (field 41 of `stat`: 0 other, 1 fifo).
fn policy_of(pid: u32, tid: &str) -> u32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).expect("stat");
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    rest.split(' ')
        .nth(38)
        .expect("policy")
        .parse()
        .expect("number")
}

#[test]
fn scheduling_is_reported_and_in_effect() {
    let (_g, v) = spawn(&["--port", "0"]);
    assert_eq!(v["scheduling"], "other");

    let (g, v) = spawn(&["--port", "0", "--sched-fifo-priority", "1"]);
    let addr = v["listening"].as_str().expect("listening").to_owned();
    let scheduling = v["scheduling"].as_str().expect("scheduling");
    let metrics = get(&addr, "/metrics");
    if scheduling == "fifo:1" {
        assert!(
            metrics.contains("kvroute_engine_sched_fifo_priority{"),
            "{metrics}"
        );
        assert!(
            metrics
                .lines()
                .any(|l| l.starts_with("kvroute_engine_sched_fifo_priority{") && l.ends_with(" 1")),
            "{metrics}"
        );
        // Every thread of the process runs under SCHED_FIFO (the engine thread included).
        let pid = g.0.id();
        let tasks: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
            .expect("tasks")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert!(tasks.len() >= 2, "{tasks:?}");
        for tid in &tasks {
            assert_eq!(policy_of(pid, tid), 1, "thread {tid} of {tasks:?}");
        }
    } else {
        // No CAP_SYS_NICE: the refusal is reported, never hidden, and the engine serves.
        assert!(
            scheduling.starts_with("other (fifo:1 refused: "),
            "{scheduling}"
        );
        assert!(get(&addr, "/health").starts_with("HTTP/1.1 200"));
    }

    let out = Command::new(env!("CARGO_BIN_EXE_engine"))
        .args(["--port", "0", "--sched-fifo-priority", "100"])
        .output()
        .expect("runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("sched-fifo-priority"));
}

#[test]
fn cache_model_flags_reach_the_readiness_line_and_metrics() {
    let (_g, v) = spawn(&["--port", "0"]);
    assert_eq!(v["cache_model"], "paged");
    let addr = v["listening"].as_str().expect("listening").to_owned();
    assert!(
        get(&addr, "/metrics").contains("kvroute_engine_cache_model_info{cache_model=\"paged\"} 1")
    );

    let (_g, v) = spawn(&[
        "--port",
        "0",
        "--cache-model",
        "llama-slots",
        "--parallel-slots",
        "2",
        "--slot-prompt-similarity",
        "0.25",
        "--ctx-tokens",
        "4096",
        "--step-model",
        "llama-tiny",
    ]);
    assert_eq!(v["cache_model"], "llama-slots");
    assert_eq!(v["kv_events"], serde_json::Value::Null);
    let addr = v["listening"].as_str().expect("listening").to_owned();
    let m = get(&addr, "/metrics");
    assert!(
        m.contains("kvroute_engine_cache_model_info{cache_model=\"llama-slots\",ctx_tokens=\"4096\",parallel_slots=\"2\",slot_prompt_similarity=\"0.25\"} 1"),
        "{m}"
    );
    // The capacity a fleet reads: 4,096 cells of one token.
    assert!(
        m.contains("block_size=\"1\"") && m.contains("num_gpu_blocks=\"4096\""),
        "{m}"
    );

    // llama.cpp publishes no KV events: asking for them is refused.
    let out = Command::new(env!("CARGO_BIN_EXE_engine"))
        .args([
            "--port",
            "0",
            "--cache-model",
            "llama-slots",
            "--kv-events-port",
            "0",
        ])
        .output()
        .expect("runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no KV events"));
    let out = Command::new(env!("CARGO_BIN_EXE_engine"))
        .args(["--port", "0", "--step-model", "gpt-5"])
        .output()
        .expect("runs");
    assert!(!out.status.success());
}
