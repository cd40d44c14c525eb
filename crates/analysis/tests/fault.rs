//! The fault summary on `fixtures/analysis/fault-kill` (a small kill run, see the fixtures
//! README): the files match the goldens the pre-move xtask code wrote, and `report_dir` tells a
//! fault run from a sweep.

mod common;

use std::path::{Path, PathBuf};

use analysis::fault::{self, FaultKind};
use analysis::{AnalysisError, DirReport, ReportConfig, report_dir, write_report_dir};

fn fixture() -> PathBuf {
    common::fixtures().join("fault-kill")
}

/// A scratch directory removed on drop, even when the test fails.
struct Scratch(PathBuf);

impl Scratch {
    /// A copy of `from` under the temp dir.
    fn copy_of(from: &Path, name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!(
            "kvroute-analysis-fault-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        copy_dir(from, &dir);
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
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
    let tmp = Scratch::copy_of(&common::fixtures().join("sweep-incomparable"), "point");
    let sweep_json = tmp.0.join("sweep.json");
    std::fs::write(&sweep_json, r#"{"sweep": "pressure-grid", "point": "p0"}"#).unwrap();
    assert_eq!(fault::fault_point(&tmp.0), None);
    std::fs::write(&sweep_json, r#"{"sweep": "fault-kill"}"#).unwrap();
    assert_eq!(fault::fault_point(&tmp.0), None);
}

#[test]
fn summary_matches_the_goldens() {
    let s = fault::summarize(&fixture(), "ws1-s0-rate4").unwrap();
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
    let tmp = Scratch::copy_of(&fixture(), "write");
    let written = write_report_dir(&tmp.0, &ReportConfig::default()).unwrap();
    assert!(matches!(written, DirReport::Fault(_)));
    for name in ["timeline.csv", "summary.json", "summary.md"] {
        assert_eq!(
            std::fs::read_to_string(tmp.0.join(name)).unwrap(),
            golden(&format!("fault-kill.{name}")),
            "{name}"
        );
    }
    let leftovers: Vec<_> = std::fs::read_dir(&tmp.0)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn a_rep_without_router_rows_or_a_missing_point_is_an_error() {
    let tmp = Scratch::copy_of(&fixture(), "norouter");
    let rep = tmp.0.join("ws1-s0-rate4/session-affinity/rep-2");
    std::fs::remove_file(rep.join("router.csv")).unwrap();
    match fault::summarize(&tmp.0, "ws1-s0-rate4").unwrap_err() {
        AnalysisError::Fault { path, message } => {
            assert_eq!(path, rep);
            assert_eq!(message, "has no router.csv");
        }
        other => panic!("expected a fault error, got {other}"),
    }
    let err = fault::summarize(&tmp.0, "ws9-s0").unwrap_err().to_string();
    assert!(err.ends_with("holds no point `ws9-s0`"), "{err}");
}
