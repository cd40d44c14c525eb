//! The workspace's release binaries, built on demand.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("crates/test-support sits in crates/");
    crates
        .parent()
        .expect("crates/ sits in the root")
        .to_path_buf()
}

/// The cargo target directory: `CARGO_TARGET_DIR` (relative to the workspace root when
/// relative), else `target/`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from) {
        Some(dir) if dir.is_absolute() => dir,
        Some(dir) => workspace_root().join(dir),
        None => workspace_root().join("target"),
    }
}

/// The release binary `name` (`engine`, `router`, `driver`, `epp`, `report`), built first with
/// `cargo build --release -p <name>-bin` (a no-op when it is fresh); panics when the build fails.
///
/// Tests that call it are `#[ignore = "needs the release binaries: cargo build --release"]`:
/// a release build takes minutes, so the default `cargo test` never waits for one.
pub fn release_bin(name: &str) -> PathBuf {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let package = format!("{name}-bin");
    let status = Command::new(cargo)
        .current_dir(workspace_root())
        .args(["build", "--release", "-p", &package])
        .status()
        .expect("cargo runs");
    assert!(
        status.success(),
        "`cargo build --release -p {package}` failed"
    );
    let bin = target_dir().join("release").join(name);
    assert!(
        bin.is_file(),
        "{} is missing after the build",
        bin.display()
    );
    bin
}
