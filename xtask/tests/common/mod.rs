//! Harness shared by the xtask integration tests: the workspace and its release binaries (from
//! `test-support`, as every crate's tests get them), temp dirs removed on drop, and JSON reading
//! with the path in the panic.

// Each test file uses its own subset of these helpers.
#![allow(dead_code)]

use std::path::Path;
use std::process::Command;

pub use test_support::{temp_dir, workspace_root};

/// Builds the engine, router and driver release binaries (a no-op when they are fresh), which
/// the xtask binary then runs with `--no-build`.
pub fn build_bins() {
    for name in ["engine", "router", "driver"] {
        test_support::release_bin(name);
    }
}

/// The JSON document at `path`; panics naming the file when it is missing or malformed.
pub fn json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Runs the xtask binary from the workspace root as a user would: (success, stdout, stderr).
pub fn xtask(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .current_dir(workspace_root())
        .args(args)
        .output()
        .expect("xtask runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Asserts that every value the calibration at `path` derived names its rule.
#[allow(dead_code)] // each test binary compiles `common` on its own
pub fn assert_every_value_names_its_rule(path: &Path) {
    let cal = experiment::calibration::Calibration::read(path).unwrap();
    assert_eq!(
        cal.values_without_rule(),
        Vec::<&str>::new(),
        "{}",
        path.display()
    );
}
