//! Harness shared by the xtask integration tests: the workspace and its release binaries
//! (located by xtask's own `env` module, so tests and the CLI agree on paths), scratch
//! directories removed on drop, and JSON reading with the path in the panic.

// Each test file uses its own subset of these helpers.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "../../src/env.rs"]
mod env;

pub use env::workspace_root;

/// A directory under the system temp dir, removed when dropped (even when a test fails).
pub struct Scratch(pub PathBuf);

impl Scratch {
    /// `xtask-<name>-<pid>` under the temp dir, emptied of any earlier run and created.
    pub fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("xtask-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The release binary `name` under the target dir (honours `CARGO_TARGET_DIR`).
pub fn release_bin(name: &str) -> PathBuf {
    env::target_dir().join("release").join(name)
}

/// Builds the engine, router and driver release binaries (a no-op when they are fresh).
pub fn build_bins() {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(workspace_root())
        .args([
            "build",
            "--release",
            "-p",
            "engine-bin",
            "-p",
            "router-bin",
            "-p",
            "driver-bin",
        ])
        .status()
        .expect("cargo runs");
    assert!(status.success(), "building the experiment binaries failed");
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
