//! The `report` binary on the analysis fixtures: output matches the analysis crate's goldens for
//! a sweep and for a fault run, refusals and malformed rows give their documented exit statuses
//! and messages.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/analysis")
}

fn report(sweep: &Path, out: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_report"))
        .arg(sweep)
        .arg("--json")
        .arg(out.join("report.json"))
        .arg("--markdown")
        .arg(out.join("report.md"))
        .output()
        .unwrap()
}

#[test]
fn prints_markdown_and_writes_json() {
    let tmp = test_support::temp_dir("report-cli-basic");
    let out = report(&fixtures().join("sweep-basic"), tmp.path());
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let golden_md =
        std::fs::read_to_string(fixtures().join("golden/sweep-basic.report.md")).unwrap();
    assert_eq!(String::from_utf8(out.stdout).unwrap(), golden_md);
    assert_eq!(
        std::fs::read_to_string(tmp.path().join("report.md")).unwrap(),
        golden_md
    );
    // The golden ends with a newline; report.json, like the published reports, does not.
    let golden_json =
        std::fs::read_to_string(fixtures().join("golden/sweep-basic.report.json")).unwrap();
    assert_eq!(
        std::fs::read_to_string(tmp.path().join("report.json")).unwrap() + "\n",
        golden_json
    );
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

#[test]
fn a_fault_run_gets_its_summary_rebuilt() {
    let tmp = test_support::temp_dir("report-cli-fault");
    let dir = tmp.path().join("fault-kill");
    copy_dir(&fixtures().join("fault-kill"), &dir);
    let out = Command::new(env!("CARGO_BIN_EXE_report"))
        .arg(&dir)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let golden = |name: &str| {
        std::fs::read_to_string(fixtures().join("golden").join(format!("fault-kill.{name}")))
            .unwrap()
    };
    assert_eq!(String::from_utf8(out.stdout).unwrap(), golden("summary.md"));
    for name in ["summary.md", "summary.json", "timeline.csv"] {
        assert_eq!(
            std::fs::read_to_string(dir.join(name)).unwrap(),
            golden(name),
            "{name}"
        );
    }
    assert!(!dir.join("report.json").exists());
}

#[test]
fn refused_points_exit_3_and_are_named() {
    let tmp = test_support::temp_dir("report-cli-incomparable");
    let out = report(&fixtures().join("sweep-incomparable"), tmp.path());
    assert_eq!(out.status.code(), Some(3));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("`pf-1111`") && err.contains("`pf-2222`"),
        "{err}"
    );
    // the comparable point is still reported
    assert!(String::from_utf8_lossy(&out.stdout).contains("## Point `p0`"));
    assert!(tmp.path().join("report.json").exists());
}

#[test]
fn malformed_rows_exit_1_with_path_and_line() {
    let tmp = test_support::temp_dir("report-cli-malformed");
    let out = report(&fixtures().join("sweep-malformed"), tmp.path());
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rep-1/client.csv:3: truncated"), "{err}");
    assert!(!tmp.path().join("report.json").exists());
}
