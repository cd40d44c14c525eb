//! What several of fleet's integration tests share: where the workspace's release binaries are,
//! and building them with cargo (a no-op when they are fresh).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `target/release` of the workspace, honouring `CARGO_TARGET_DIR`.
pub fn release_dir() -> PathBuf {
    let root = workspace_root();
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map_or_else(|| root.join("target"), |d| root.join(d))
        .join("release")
}

/// `cargo build --release -p <package>…`; panics saying that building `what` failed.
#[allow(dead_code)] // each test binary compiles `common` on its own
pub fn build_release(packages: &[&str], what: &str) {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(workspace_root())
        .args(["build", "--release"]);
    for p in packages {
        cmd.args(["-p", p]);
    }
    let status = cmd.status().expect("cargo runs");
    assert!(status.success(), "building {what} failed");
}

/// The release `engine`, built first (a no-op when fresh).
#[allow(dead_code)]
pub fn engine_bin() -> PathBuf {
    build_release(&["engine-bin"], "the engine");
    release_dir().join("engine")
}
