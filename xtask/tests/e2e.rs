//! End to end: a tiny sweep (2 policies × 1 point × 2 repetitions, a few seconds each) on 3
//! emulated replicas through the router, then the report; and a resumed run that skips it all.
//!
//! It builds the release binaries with cargo first (a no-op when they are fresh), then runs the
//! xtask binary exactly as a user would, with `--no-build`.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::{
    assert_every_value_names_its_rule, build_bins, json, temp_dir, workspace_root, xtask,
};

#[test]
#[ignore = "needs the release binaries: cargo build --release"]
fn tiny_sweep_then_report_then_resume() {
    build_bins();
    let scratch = temp_dir("xtask-e2e");
    let root = scratch.path().to_path_buf();
    let out = scratch.path().to_string_lossy().into_owned();
    let calibration = scratch.path().join("calibration.json");
    let calibration = calibration.to_string_lossy().into_owned();
    let args = [
        "sweep",
        "pressure-grid",
        "--quick",
        "--no-build",
        "--out",
        out.as_str(),
        "--calibration",
        calibration.as_str(),
        "--sweep-dir-name",
        "tiny",
        "--points",
        "ws1-s0",
        "--policies",
        "round-robin,prefix-affinity",
        "--reps",
        "2",
        "--replicas",
        "3",
        "--users",
        "8",
        "--warmup-s",
        "1",
        "--measure-s",
        "3",
        // The test machine is shared and noisy: evidence is recorded, not used to reject here.
        "--lateness-share-of-itl-floor",
        "10000",
        "--evidence-retries",
        "0",
    ];
    let (ok, stdout, stderr) = xtask(&args);
    assert!(ok, "sweep failed:\n{stderr}");

    let sweep = root.join("tiny");
    let cal = json(&sweep.join("calibration.json"));
    assert_eq!(cal["used_replicas"].as_array().unwrap().len(), 3);
    assert!(cal["slo"]["ttft_ms"].as_f64().unwrap() > 0.0);
    assert_eq!(cal["capacity_tokens"].as_u64(), Some(3 * 4096 * 16));
    // Every derived value names its rule; the floors ran on reference-length prompts.
    assert_every_value_names_its_rule(&sweep.join("calibration.json"));
    assert_eq!(cal["floor_prompts"]["prompt_tokens"], 1100);
    assert!(cal["bytes_per_token"]["value"].as_f64().unwrap() > 0.0);

    let mut plan_fingerprints = Vec::new();
    for policy in ["round-robin", "prefix-affinity"] {
        for rep in 1..=2 {
            let dir = sweep.join("ws1-s0").join(policy).join(format!("rep-{rep}"));
            let meta = json(&dir.join("meta.json"));
            assert_eq!(meta["complete"], true, "{}", dir.display());
            assert_eq!(meta["policy"], policy);
            assert_eq!(meta["fleet"]["replicas"], 3);
            let router = &meta["run"]["router"];
            assert_eq!(router["bytes_per_token"], cal["bytes_per_token"]["value"]);
            if policy == "prefix-affinity" {
                assert_eq!(router["index_ttl_s"], cal["index"]["ttl_s"]);
            }
            assert!(meta["run"]["evidence_bounds"]["lateness"]["p99_wall_ms"].is_number());
            // The worker count the router reported when it came up (its default, 2).
            assert_eq!(meta["run"]["router_workers"], 2, "{}", dir.display());
            // In front of real-time emulated engines the router asks for their level: granted,
            // or refused with the reason (no CAP_SYS_NICE), never silently absent.
            let sched = meta["run"]["router_scheduling"]
                .as_str()
                .unwrap_or_default();
            assert!(
                sched == "fifo:1" || sched.starts_with("other (fifo:1 refused: "),
                "{sched}"
            );
            let window = &meta["window"];
            assert!(window["measured_end_s"].as_f64() > window["measured_start_s"].as_f64());
            plan_fingerprints.push(meta["plan_fingerprint"].as_str().unwrap().to_string());
            let client = std::fs::read_to_string(dir.join("client.csv")).unwrap();
            assert!(
                client.lines().count() > 5,
                "client rows in {}",
                dir.display()
            );
            let router = std::fs::read_to_string(dir.join("router.csv")).unwrap();
            assert!(
                router.lines().count() > 5,
                "router rows in {}",
                dir.display()
            );
            assert!(router.contains(policy), "the router ran {policy}");
            let evidence = std::fs::read_to_string(dir.join("evidence.jsonl")).unwrap();
            let last: serde_json::Value =
                serde_json::from_str(evidence.lines().last().unwrap()).unwrap();
            assert_eq!(last["kind"], "summary");
            assert_eq!(
                last["lateness"].as_array().unwrap().len(),
                3,
                "lateness per replica"
            );
        }
    }
    plan_fingerprints.dedup();
    assert_eq!(
        plan_fingerprints.len(),
        1,
        "every cell replayed the identical plan"
    );

    let report = std::fs::read_to_string(sweep.join("report.md")).unwrap();
    assert!(
        report.contains("ws1-s0")
            && report.contains("prefix-affinity")
            && report.contains("round-robin")
    );
    assert!(stdout.contains("ws1-s0"), "the report is printed");
    let report_json = json(&sweep.join("report.json"));
    assert!(report_json.is_object());

    // Resume: every cell is complete, so nothing runs and nothing changes.
    let meta_before = std::fs::read(sweep.join("ws1-s0/round-robin/rep-1/meta.json")).unwrap();
    let (ok, _, stderr) = xtask(&args);
    assert!(ok, "resumed sweep failed:\n{stderr}");
    assert!(
        !stderr.contains("rep-1:"),
        "a resumed sweep re-ran a finished cell:\n{stderr}"
    );
    let meta_after = std::fs::read(sweep.join("ws1-s0/round-robin/rep-1/meta.json")).unwrap();
    assert_eq!(meta_before, meta_after);

    interrupt_leaves_no_half_cell(&root, &calibration);
}

/// A live per-policy capacity search on the quick fleet: the simulator's prediction first, then
/// the live search starting at it, recorded and reported beside it; a rerun reuses the records.
#[test]
#[ignore = "needs the release binaries: cargo build --release"]
fn a_live_per_policy_search_starts_at_the_simulators_prediction_and_resumes() {
    build_bins();
    let scratch = temp_dir("xtask-live-policy-capacity");
    let out = scratch.path().to_string_lossy().into_owned();
    let calibration = scratch.path().join("calibration.json");
    let calibration = calibration.to_string_lossy().into_owned();
    // Either form of the point's name chooses it. The test machine is shared and noisy:
    // evidence is recorded, not used to reject here.
    let line = format!(
        "sweep pressure-grid --quick --no-build --out {out} --calibration {calibration} \
         --sweep-dir-name live-capacity --policy-capacity --seeds 1 --points ws1-s0-load1.0 \
         --policies session-affinity --replicas 3 --users 8 --warmup-s 1 --measure-s 3 \
         --lateness-share-of-itl-floor 10000"
    );
    let args: Vec<&str> = line.split_whitespace().collect();
    let (ok, stdout, stderr) = xtask(&args);
    assert!(ok, "live per-policy capacity failed:\n{stderr}");
    let dir = scratch.path().join("live-capacity");
    let search = dir.join("policy-capacity/ws1-s0/session-affinity/seed-7");
    // The prediction, searched in the simulator under the same calibration.
    let predicted = json(&search.join("predicted/capacity.json"));
    let predicted_rps = predicted["capacity"]["rate_rps"].as_f64().unwrap();
    // The live search, from the prediction, its steps' rows kept.
    let live = json(&search.join("capacity.json"));
    let curve = live["capacity"]["curve"].as_array().unwrap();
    assert_eq!(curve[0]["rate_rps"].as_f64(), Some(predicted_rps));
    assert!(
        live["capacity"]["search"]["start_rule"]
            .as_str()
            .unwrap()
            .contains("the simulator's prediction"),
        "{live:#}"
    );
    assert_eq!(live["capacity"]["policies"][0], "session-affinity");
    let first_step = curve[0]["dir"].as_str().unwrap();
    let meta = json(&Path::new(first_step).join("meta.json"));
    assert_ne!(meta["virtual_time"], true);
    assert_eq!(meta["fleet"]["replicas"], 3);
    assert!(
        std::fs::read_to_string(Path::new(first_step).join("client.csv"))
            .unwrap()
            .lines()
            .count()
            > 5
    );
    // Both reports and the comparison, one check for the one search.
    let report = json(&dir.join("policy-capacity.json"));
    assert_eq!(report["points"][0]["point"], "ws1-s0");
    assert!(report["basis"].as_str().unwrap().starts_with("live"));
    let checks = json(&dir.join("predicted-vs-live.json"));
    assert_eq!(checks.as_array().unwrap().len(), 1);
    assert!(checks[0]["verdict"].is_string());
    assert!(dir.join("predicted-capacity.md").exists());
    let md = std::fs::read_to_string(dir.join("policy-capacity.md")).unwrap();
    assert!(md.contains("## Live vs the simulator's prediction"), "{md}");
    assert!(stdout.contains("Live vs the simulator's prediction"));
    // A rerun reuses both records: no step runs again.
    let before = std::fs::read(search.join("capacity.json")).unwrap();
    let (ok, _, stderr) = xtask(&args);
    assert!(ok, "rerun failed:\n{stderr}");
    assert!(
        !stderr.contains("capacity step"),
        "a rerun measured again:\n{stderr}"
    );
    assert_eq!(before, std::fs::read(search.join("capacity.json")).unwrap());
}

/// Every file under `dir`, recursively.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = entry.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}

/// Processes whose command line mentions `needle` (the router's `--rows` path does).
fn processes_mentioning(needle: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Ok(cmdline) = std::fs::read(entry.path().join("cmdline"))
            && String::from_utf8_lossy(&cmdline).contains(needle)
        {
            out.push(pid);
        }
    }
    out
}

/// Ctrl-C in the middle of a cell: exit 130, no meta.json anywhere, no child left running.
fn interrupt_leaves_no_half_cell(root: &Path, calibration: &str) {
    let out = root.to_string_lossy().into_owned();
    let mut child = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .current_dir(workspace_root())
        .args([
            "sweep",
            "pressure-grid",
            "--quick",
            "--no-build",
            "--no-report",
            "--out",
            out.as_str(),
            "--calibration",
            calibration,
            "--sweep-dir-name",
            "interrupted",
            "--points",
            "ws1-s0",
            "--policies",
            "round-robin",
            "--reps",
            "1",
            "--replicas",
            "3",
            "--users",
            "8",
            "--warmup-s",
            "1",
            "--measure-s",
            "30",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("xtask starts");
    let sweep = root.join("interrupted");
    // Wait (bounded) until the cell is running: the driver has started writing rows.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let running = loop {
        let partial = files(&sweep)
            .iter()
            .any(|p| p.to_string_lossy().ends_with("client.csv.partial"));
        if partial {
            break true;
        }
        if std::time::Instant::now() > deadline || child.try_wait().unwrap().is_some() {
            break false;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    if !running {
        let _ = child.kill();
        let out = child.wait_with_output().unwrap();
        panic!(
            "the cell never started:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(130),
        "exit code after Ctrl-C:\n{stderr}"
    );
    let metas: Vec<PathBuf> = files(&sweep)
        .into_iter()
        .filter(|p| p.ends_with("meta.json"))
        .collect();
    assert!(metas.is_empty(), "an interrupted cell left {metas:?}");
    assert!(
        !sweep.join("ws1-s0/round-robin/rep-1").exists(),
        "the half cell was removed"
    );
    let left = processes_mentioning(&sweep.to_string_lossy());
    assert!(left.is_empty(), "processes left running: {left:?}");
}
