//! End to end: `cargo xtask fault kill` and `fault drain` on 3 emulated replicas at high speed (a
//! 2-s outage, a few seconds of load around it), asserting the loss bounds of docs/ARCHITECTURE.md,
//! "Faults", from what the run wrote: only requests in flight on the killed replica lost, none not
//! yet dispatched, none at all under drain; the sweep's evidence and drift gates applied to every
//! repetition and recorded (drift on the pre-fault window); and the timeline of figure 6 over the
//! accepted repetitions.
//!
//! It builds the release binaries first (a no-op when fresh), then runs the xtask binary as a
//! user would. The xtask child is stopped on any failure (Ctrl-C twice: the second interrupt
//! makes xtask SIGKILL every process it started), so no engine outlives the test.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{build_bins, json, temp_dir, workspace_root};

/// The running xtask; interrupted (twice), then killed, if the test fails while it runs.
struct XtaskChild(Option<Child>);

impl Drop for XtaskChild {
    fn drop(&mut self) {
        let Some(mut child) = self.0.take() else {
            return;
        };
        if matches!(child.try_wait(), Ok(None)) {
            let pid = child.id().to_string();
            for _ in 0..2 {
                let _ = Command::new("kill").args(["-INT", &pid]).status();
                std::thread::sleep(Duration::from_millis(500));
            }
            let _ = child.kill();
        }
        let _ = child.wait();
    }
}

/// Runs xtask with `args`, output into `log`, within `limit`; returns (success, log text).
fn xtask(args: &[&str], log: &Path, limit: Duration) -> (bool, String) {
    let out = std::fs::File::create(log).expect("log file");
    let child = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .current_dir(workspace_root())
        .args(args)
        .stdout(out.try_clone().expect("log handle"))
        .stderr(out)
        .stdin(Stdio::null())
        .spawn()
        .expect("xtask runs");
    let mut guard = XtaskChild(Some(child));
    let started = Instant::now();
    let status = loop {
        let child = guard.0.as_mut().expect("child");
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            started.elapsed() < limit,
            "xtask {} ran past {:.0} s:\n{}",
            args.join(" "),
            limit.as_secs_f64(),
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    guard.0 = None;
    (
        status.success(),
        std::fs::read_to_string(log).unwrap_or_default(),
    )
}

/// The fleet both runs and their calibration share: 3 replicas at speed 30 (60 s of model outage
/// = 2 s of wall time) with small KV pools.
const FLEET: [&str; 6] = [
    "--replicas",
    "3",
    "--speed",
    "30",
    "--num-gpu-blocks",
    "256",
];

/// The flags both runs share: the fleet, its calibration (the router's TTL, node cap and bytes
/// per token come from it, as in a sweep), a light load (15 req/s wall), a generous SLO given
/// outright (the SLO is not what is tested here), and 3.5 s after the restart: time for the
/// router's 1-s health check to take the replica back.
fn args<'a>(kind: &'a str, out: &'a str, policies: &'a str, calibration: &'a str) -> Vec<&'a str> {
    let mut args = vec![
        "fault",
        kind,
        "--no-build",
        "--out",
        out,
        "--sweep-dir-name",
        kind,
        "--calibration",
        calibration,
    ];
    args.extend(FLEET);
    args.extend([
        "--slo-ttft-ms",
        "10000",
        "--slo-itl-ms",
        "1000",
        "--policies",
        policies,
        "--rate",
        "0.5",
        "--warmup-s",
        "0.5",
        "--before-s",
        "2",
        // Long enough for the router's health hysteresis (2 passing probes, 1 s apart) to bring
        // the restarted replica back and for it to serve again.
        "--after-s",
        "6",
        "--request-timeout-s",
        "20",
    ]);
    args
}

/// The gates one repetition's run recorded; returns whether it was accepted.
fn check_gates(dir: &Path, point: &str, policy: &str, meta: &serde_json::Value) -> bool {
    let gates = &meta["run"]["gates"];
    let status = |g: &serde_json::Value| g["status"].as_str().unwrap_or("").to_string();
    assert!(
        ["passed", "failed"].contains(&status(&gates["evidence"]).as_str()),
        "{policy}: the evidence gate ran: {gates}"
    );
    assert!(
        ["passed", "failed", "not-run"].contains(&status(&gates["drift"]).as_str()),
        "{policy}: the drift gate ran: {gates}"
    );
    assert!(
        gates["drift_rule"]
            .as_str()
            .is_some_and(|r| r.starts_with("pre-fault")),
        "{gates}"
    );
    // Drift on the steady load before the fault: it ends where the fault is, before the run does.
    let end = gates["drift_window"]["measured_end_s"].as_f64().unwrap();
    assert!(
        end < meta["window"]["measured_end_s"].as_f64().unwrap(),
        "{gates}"
    );
    assert!(
        meta["drift"]["warming"].is_boolean(),
        "the drift verdict is recorded: {meta}"
    );
    assert!(meta["evidence"]["lateness"].is_array());
    let accepted = meta["accepted"].as_bool().expect("accepted is recorded");
    let attempts = meta["attempts"].as_u64().unwrap();
    // Every attempt re-run is under _discarded/ with its reason.
    let discarded = dir.join("_discarded").join(point).join(policy);
    let reruns = std::fs::read_dir(&discarded)
        .map(|d| d.filter_map(|e| e.ok()).count())
        .unwrap_or(0);
    assert_eq!(attempts, 1 + reruns as u64, "{policy}: {meta}");
    if accepted {
        assert!(meta["set_aside_reason"].is_null());
        assert_eq!(status(&gates["evidence"]), "passed", "{gates}");
        assert_ne!(status(&gates["drift"]), "failed", "{gates}");
    } else {
        let why = meta["set_aside_reason"].as_str().unwrap();
        assert!(
            why.starts_with("evidence failed on") || why.starts_with("drifted twice"),
            "{why}"
        );
        eprintln!("{policy} rep-1 set aside: {why}");
    }
    accepted
}

/// Checks the files, bounds and gates of one finished fault directory; returns its summary.
fn check_dir(dir: &Path, policies: &[&str]) -> serde_json::Value {
    let summary = json(&dir.join("summary.json"));
    assert_eq!(
        summary["violations"].as_array().unwrap().len(),
        0,
        "{summary:#}"
    );
    let point = summary["point"].as_str().unwrap().to_string();
    let mut accepted = Vec::new();
    for policy in policies {
        let rep = dir.join(&point).join(policy).join("rep-1");
        for file in ["client.csv", "router.csv", "evidence.jsonl", "fault.json"] {
            assert!(rep.join(file).is_file(), "{} lacks {file}", rep.display());
        }
        let meta = json(&rep.join("meta.json"));
        assert_eq!(meta["complete"], true);
        assert_eq!(meta["policy"], *policy);
        assert_eq!(meta["fleet"]["replicas"], 3);
        if check_gates(dir, &point, policy, &meta) {
            accepted.push(*policy);
        }
    }
    // The summary reads the gates back and compares the accepted repetitions only.
    let gates = summary["gates"].as_array().unwrap();
    assert_eq!(gates.len(), policies.len());
    for g in gates {
        assert_ne!(g["evidence"]["status"], "not-recorded", "{g}");
        assert_eq!(
            g["accepted"].as_bool().unwrap(),
            accepted.contains(&g["policy"].as_str().unwrap())
        );
    }
    for c in summary["comparisons"].as_array().unwrap() {
        let compared: Vec<&str> = c["policies"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["policy"].as_str().unwrap())
            .collect();
        assert_eq!(compared, accepted, "{c}");
        for d in c["differences"].as_array().unwrap() {
            assert_eq!(d["verdict"], "too few reps", "one repetition a side: {d}");
        }
    }
    let timeline = std::fs::read_to_string(dir.join("timeline.csv")).unwrap();
    let mut lines = timeline.lines();
    let header = "policy,t_s,goodput_rps,replica_alive,goodput_min_rps,goodput_max_rps,rolling_s";
    assert_eq!(lines.next(), Some(header));
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    for policy in policies {
        let mine: Vec<&Vec<&str>> = rows.iter().filter(|r| r[0] == *policy).collect();
        if !accepted.contains(policy) {
            assert!(
                mine.is_empty(),
                "a set-aside repetition stays out of the timeline"
            );
            continue;
        }
        assert!(mine.len() >= 6, "{policy} has a series: {timeline}");
        assert_eq!(mine[0][3], "1", "the replica is up when the load starts");
        assert!(
            mine.iter().any(|r| r[3] == "0"),
            "{policy}'s series shows the replica down"
        );
        assert!(
            mine.iter().any(|r| r[2].parse::<f64>().unwrap() > 0.0),
            "goodput somewhere"
        );
    }
    assert!(
        std::fs::read_to_string(dir.join("summary.md"))
            .unwrap()
            .contains("Loss bounds hold")
    );
    summary
}

fn share(rep: &serde_json::Value, window: &str, replica: usize) -> (u64, f64) {
    let w = rep["shares"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["window"] == window)
        .unwrap_or_else(|| panic!("no {window} window"));
    (
        w["requests"].as_u64().unwrap(),
        w["share"][replica].as_f64().unwrap(),
    )
}

#[test]
#[ignore = "needs the release binaries: cargo build --release"]
fn kill_and_drain_keep_the_loss_bounds() {
    build_bins();
    let scratch = temp_dir("xtask-fault");
    let root = scratch.path().to_path_buf();
    let out = scratch.path().to_string_lossy().into_owned();
    // A repetition the gates re-run (drift once, evidence up to twice) takes another ~10 s.
    let limit = Duration::from_secs(180);
    let calibration = root.join("calibration.json").to_string_lossy().into_owned();
    // The fault runs need the calibration's routing, not its capacity (they set their own rate).
    let mut calibrate = vec![
        "calibrate",
        "--quick",
        "--no-build",
        "--no-capacity",
        "--out",
        &calibration,
    ];
    calibrate.extend(FLEET);
    let (ok, log) = xtask(&calibrate, &root.join("calibrate.log"), limit);
    assert!(ok, "calibrate failed:\n{log}");

    let (ok, log) = xtask(
        &args(
            "kill",
            &out,
            "session-affinity,prefix-affinity",
            &calibration,
        ),
        &root.join("kill.log"),
        limit,
    );
    assert!(ok, "fault kill failed:\n{log}");
    // Progress as the sweep prints it: a count and an ETA after every repetition.
    for (i, policy) in ["session-affinity", "prefix-affinity"].iter().enumerate() {
        let head = format!("[{}/2] {policy} rep-1: ", i + 1);
        assert!(
            log.lines()
                .any(|l| l.starts_with(&head) && l.contains(" elapsed, ETA ")),
            "no progress line `{head}…`:\n{log}"
        );
    }
    let summary = check_dir(&root.join("kill"), &["session-affinity", "prefix-affinity"]);
    // The faulted router ran with the calibration's TTL and bytes per token, as a sweep cell.
    let cal = json(Path::new(&calibration));
    let point = summary["point"].as_str().unwrap();
    let meta = json(
        &root
            .join("kill")
            .join(point)
            .join("prefix-affinity/rep-1/meta.json"),
    );
    assert_eq!(meta["run"]["router"]["index_ttl_s"], cal["index"]["ttl_s"]);
    assert_eq!(
        meta["run"]["router"]["bytes_per_token"],
        cal["bytes_per_token"]["value"]
    );
    for rep in summary["reps"].as_array().unwrap() {
        let policy = rep["policy"].as_str().unwrap();
        assert!(
            rep["outstanding_at_fault"].as_u64().unwrap() >= 1,
            "{policy}: the kill came mid-request"
        );
        for lost in rep["lost"].as_array().unwrap() {
            assert_eq!(lost["allowed"], true, "{policy}: {lost}");
            assert_eq!(
                lost["replica"], 0,
                "{policy}: only the victim's requests are lost"
            );
        }
        let (n, victim) = share(rep, "outage", 0);
        assert!(n > 0, "{policy}: load continued during the outage");
        assert_eq!(
            victim, 0.0,
            "{policy}: nothing was served by the dead replica"
        );
        let (_, victim_after) = share(rep, "after", 0);
        // Session affinity's ring takes the restarted replica's sessions back. Prefix affinity
        // owes it nothing here: this tiny cell's few conversations all started before the
        // fault, and each stays where its prefix is believed (a `match` decision).
        if policy == "session-affinity" {
            assert!(
                victim_after > 0.0,
                "{policy}: the restarted replica serves again"
            );
        }
        let outage = &rep["shares"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["window"] == "outage")
            .unwrap();
        let spill = outage["spill_rate"]
            .as_f64()
            .expect("every decision has a branch");
        assert!((0.0..=1.0).contains(&spill), "{policy}: {outage}");
        if policy == "session-affinity" {
            assert_eq!(spill, 0.0, "the session ring never spills");
        }
    }

    // Published (compressed rows, no logs) and summarised again from the copy alone: the same
    // summary, so figure 6 and the fault findings rebuild from docs/measurements/.
    let (ok, log) = xtask(
        &[
            "publish",
            &root.join("kill").to_string_lossy(),
            "--to",
            &root.join("pub").to_string_lossy(),
        ],
        &root.join("publish.log"),
        limit,
    );
    assert!(ok, "publish failed:\n{log}");
    assert!(
        !root
            .join("pub/kill")
            .join(summary["point"].as_str().unwrap())
            .join("session-affinity/rep-1/client.csv")
            .exists()
    );
    std::fs::remove_file(root.join("pub/kill/summary.json")).unwrap();
    let (ok, log) = xtask(
        &["report", &root.join("pub/kill").to_string_lossy()],
        &root.join("report.log"),
        limit,
    );
    assert!(ok, "report of the published fault run failed:\n{log}");
    assert_eq!(json(&root.join("pub/kill/summary.json")), summary);

    let (ok, log) = xtask(
        &args("drain", &out, "prefix-affinity", &calibration),
        &root.join("drain.log"),
        limit,
    );
    assert!(ok, "fault drain failed:\n{log}");
    let summary = check_dir(&root.join("drain"), &["prefix-affinity"]);
    let rep = &summary["reps"][0];
    assert_eq!(
        rep["lost"].as_array().unwrap().len(),
        0,
        "a drain loses nothing: {rep:#}"
    );
    assert!(
        rep["outstanding_at_fault"].as_u64().unwrap() >= 1,
        "the drain began with requests in flight on the victim, which finished"
    );
    let (_, draining) = share(rep, "draining", 0);
    assert_eq!(draining, 0.0, "a draining replica gets no new requests");
    assert!(rep["driver"]["drained_s"].as_f64().is_some());
    assert!(rep["driver"]["undrain_s"].as_f64().is_some());
}
