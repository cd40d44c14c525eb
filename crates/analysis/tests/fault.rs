//! The fault summary on `fixtures/analysis/fault-kill` (a small kill run, see the fixtures
//! README): the files match the goldens, the gates each repetition's run recorded (or did not)
//! decide what is compared, and `report_dir` tells a fault run from a sweep.

mod common;

use std::path::{Path, PathBuf};

use analysis::fault::{self, FaultKind, GateStatus};
use analysis::{AnalysisError, DirReport, DriftConfig, ReportConfig, report_dir, write_report_dir};

fn fixture() -> PathBuf {
    common::fixtures().join("fault-kill")
}

/// A copy of `from` in a fresh temp dir, removed on drop (even when the test fails).
fn copy_of(from: &Path, name: &str) -> test_support::TempDir {
    let dir = test_support::temp_dir(&format!("analysis-fault-{name}"));
    copy_dir(from, dir.path());
    dir
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

fn golden(name: &str) -> String {
    std::fs::read_to_string(common::fixtures().join("golden").join(name)).unwrap()
}

#[test]
fn fault_point_comes_from_sweep_json() {
    assert_eq!(
        fault::fault_point(&fixture()).as_deref(),
        Some("ws1-s0-rate4")
    );
    // A sweep without sweep.json, a sweep.json of another sweep, a fault run's without a point.
    assert_eq!(
        fault::fault_point(&common::fixtures().join("sweep-basic")),
        None
    );
    let tmp = copy_of(&common::fixtures().join("sweep-incomparable"), "point");
    let sweep_json = tmp.path().join("sweep.json");
    std::fs::write(&sweep_json, r#"{"sweep": "pressure-grid", "point": "p0"}"#).unwrap();
    assert_eq!(fault::fault_point(tmp.path()), None);
    std::fs::write(&sweep_json, r#"{"sweep": "fault-kill"}"#).unwrap();
    assert_eq!(fault::fault_point(tmp.path()), None);
}

#[test]
fn summary_matches_the_goldens() {
    let s = fault::summarize(&fixture(), "ws1-s0-rate4", &DriftConfig::default()).unwrap();
    assert_eq!(s.kind, FaultKind::Kill);
    // Run order from sweep.json, then rep; prefix-affinity rep-2 is unfinished and left out.
    let reps: Vec<(&str, u32)> = s.reps.iter().map(|r| (r.policy.as_str(), r.rep)).collect();
    assert_eq!(
        reps,
        [
            ("session-affinity", 1),
            ("session-affinity", 2),
            ("prefix-affinity", 1)
        ]
    );
    assert_eq!(s.violations.len(), 1, "{:?}", s.violations);
    assert!(
        s.violations[0].starts_with("prefix-affinity rep-1: lost-other:"),
        "{}",
        s.violations[0]
    );
    assert_eq!(s.reps[0].recovery_s, Some(0.0));
    assert_eq!(s.reps[1].recovery_s, Some(2.0));
    let files = s.files();
    let names: Vec<&str> = files.iter().map(|f| f.name).collect();
    assert_eq!(names, ["timeline.csv", "summary.json", "summary.md"]);
    for f in &files {
        common::assert_golden(
            &format!("fault-kill.{}", f.name),
            std::str::from_utf8(&f.bytes).unwrap(),
        );
    }
}

#[test]
fn report_dir_tells_a_fault_run_from_a_sweep() {
    let DirReport::Fault(s) = report_dir(&fixture(), &ReportConfig::default()).unwrap() else {
        panic!("fault-kill is a fault run");
    };
    assert_eq!(s.point, "ws1-s0-rate4");

    let sweep = report_dir(
        &common::fixtures().join("sweep-basic"),
        &ReportConfig::default(),
    )
    .unwrap();
    assert!(matches!(sweep, DirReport::Sweep(_)));
    let files = sweep.files();
    assert_eq!(files[0].name, "report.md");
    common::assert_same_text(
        &golden("sweep-basic.report.md"),
        std::str::from_utf8(&files[0].bytes).unwrap(),
    );
    assert_eq!(sweep.markdown().as_bytes(), files[0].bytes);
    // The golden ends with a newline; the written report.json, like the published ones, not.
    assert_eq!(files[1].name, "report.json");
    common::assert_same_text(
        &golden("sweep-basic.report.json"),
        &(String::from_utf8(files[1].bytes.clone()).unwrap() + "\n"),
    );
}

#[test]
fn write_report_dir_writes_the_summary_files() {
    let tmp = copy_of(&fixture(), "write");
    let written = write_report_dir(tmp.path(), &ReportConfig::default()).unwrap();
    assert!(matches!(written, DirReport::Fault(_)));
    for name in ["timeline.csv", "summary.json", "summary.md"] {
        assert_eq!(
            std::fs::read_to_string(tmp.path().join(name)).unwrap(),
            golden(&format!("fault-kill.{name}")),
            "{name}"
        );
    }
    let leftovers: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn a_rep_without_router_rows_or_a_missing_point_is_an_error() {
    let tmp = copy_of(&fixture(), "norouter");
    let rep = tmp.path().join("ws1-s0-rate4/session-affinity/rep-2");
    std::fs::remove_file(rep.join("router.csv")).unwrap();
    match fault::summarize(tmp.path(), "ws1-s0-rate4", &DriftConfig::default()).unwrap_err() {
        AnalysisError::Fault { path, message } => {
            assert_eq!(path, rep);
            assert_eq!(message, "has no router.csv");
        }
        other => panic!("expected a fault error, got {other}"),
    }
    let err = fault::summarize(tmp.path(), "ws9-s0", &DriftConfig::default())
        .unwrap_err()
        .to_string();
    assert!(err.ends_with("holds no point `ws9-s0`"), "{err}");
}

/// Rewrites `meta.json` of `rep` (under the fixture copy) through `edit`.
fn edit_meta(dir: &Path, rep: &str, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("ws1-s0-rate4").join(rep).join("meta.json");
    let mut meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut meta);
    std::fs::write(&path, serde_json::to_string_pretty(&meta).unwrap()).unwrap();
}

#[test]
fn gates_decide_what_is_compared_and_unrecorded_ones_never_read_as_passed() {
    let tmp = copy_of(&fixture(), "gates");
    let gates = |evidence: serde_json::Value| {
        serde_json::json!({
            "evidence": evidence,
            "drift": {"status": "passed"},
            "drift_window": {"warmup_s": 1.0, "measured_start_s": 1.0, "measured_end_s": 10.0},
            "drift_rule": fault::DRIFT_WINDOW_RULE,
        })
    };
    edit_meta(tmp.path(), "session-affinity/rep-1", |m| {
        m["run"] = serde_json::json!({"gates": gates(serde_json::json!({"status": "passed"}))});
        m["attempts"] = 1.into();
    });
    edit_meta(tmp.path(), "session-affinity/rep-2", |m| {
        let failed = serde_json::json!({"status": "failed", "reason": "replica 0 lateness p99 9 ms exceeds the bound 5 ms"});
        m["run"] = serde_json::json!({"gates": gates(failed)});
        m["accepted"] = false.into();
        m["set_aside_reason"] =
            "evidence failed on 3 attempts: replica 0 lateness p99 9 ms exceeds the bound 5 ms"
                .into();
        m["attempts"] = 3.into();
    });
    let s = fault::summarize(tmp.path(), "ws1-s0-rate4", &DriftConfig::default()).unwrap();
    // Every complete repetition keeps its loss-bound check, set aside or not.
    assert_eq!(s.reps.len(), 3);
    assert_eq!(s.gates.len(), 3);
    let by = |policy: &str, rep: u32| {
        s.gates
            .iter()
            .find(|g| g.policy == policy && g.rep == rep)
            .unwrap()
    };
    assert_eq!(by("session-affinity", 1).evidence, GateStatus::Passed);
    assert!(by("session-affinity", 1).accepted);
    let set_aside = by("session-affinity", 2);
    assert!(!set_aside.accepted);
    assert!(matches!(&set_aside.evidence, GateStatus::Failed(why) if why.contains("lateness")));
    // A repetition whose run recorded no gates: not recorded, never passed.
    let old = by("prefix-affinity", 1);
    assert_eq!(
        (&old.evidence, &old.drift),
        (&GateStatus::NotRecorded, &GateStatus::NotRecorded)
    );
    assert!(old.accepted && !old.recorded());
    // The summary's own drift test ran on the pre-fault window, 1–10 s.
    assert_eq!(old.drift_window.measured_end_s, 10.0);
    assert!(old.drift_check.skipped.is_none() && !old.drift_check.warming);
    // The set-aside repetition is in neither the comparisons nor the timeline.
    for c in &s.comparisons {
        let sa = c
            .policies
            .iter()
            .find(|p| p.policy == "session-affinity")
            .unwrap();
        assert_eq!(sa.reps, [1], "{}", c.figure);
        for d in &c.differences {
            assert_eq!(d.verdict, analysis::Verdict::TooFewReps, "{d:?}");
        }
    }
    let accepted: Vec<(&str, u32)> = s.accepted().map(|r| (r.policy.as_str(), r.rep)).collect();
    assert_eq!(accepted, [("session-affinity", 1), ("prefix-affinity", 1)]);
    let timeline = fault::timeline(s.accepted());
    // rep-2 is left out: session-affinity's row is rep-1's rolling goodput alone
    let sa_rep1 = &s.reps[0];
    let raw: Vec<f64> = sa_rep1.goodput.iter().map(|b| b.goodput_rps).collect();
    let rolled = fault::rolling_mean(&raw, fault::TIMELINE_ROLLING_BUCKETS);
    let rows: Vec<_> = timeline
        .iter()
        .filter(|r| r.policy == "session-affinity")
        .collect();
    assert_eq!(rows.len(), raw.len());
    for (row, want) in rows.iter().zip(&rolled) {
        assert_eq!(row.goodput_rps, *want, "rep-2 left out");
        assert_eq!((row.goodput_min_rps, row.goodput_max_rps), (*want, *want));
    }
    let md = fault::markdown(&s);
    assert!(
        md.contains("**Gates not recorded for 1 of 3 repetitions**"),
        "{md}"
    );
    assert!(md.contains("flags 0 of them as still trending"), "{md}");
    assert!(
        md.contains("- session-affinity rep-2: evidence failed on 3 attempts"),
        "{md}"
    );
    assert!(
        md.contains(
            "| prefix-affinity | 1 | yes | – | not recorded | not recorded | settled (1.0–10.0 s) |"
        ),
        "{md}"
    );
}
