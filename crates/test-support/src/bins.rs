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

/// The packages the experiment's binaries come from, built together in one cargo invocation both
/// by the main job (`experiment::bins::BIN_PACKAGES`, which a test there holds equal to this) and by
/// [`release_bin`]. Why together: cargo unifies the features of shared dependencies (tokio, hyper)
/// over the packages of one invocation, so `-p engine-bin` alone and the four together compile
/// those dependencies twice; measured on this 2-core machine (6 Dec 2026), building engine-bin,
/// router-bin and driver-bin one by one after the four together recompiled 29, 10 and 8 crates
/// (65 s, 44 s and 58 s), where one invocation of the four is a no-op.
pub const EXPERIMENT_BIN_PACKAGES: &[&str] =
    &["engine-bin", "router-bin", "driver-bin", "report-bin"];

/// The release binary `name` (`engine`, `router`, `driver`, `epp`, `report`), built first with
/// cargo (a no-op when it is fresh); panics when the build fails. The experiment's binaries are
/// built as the set [`EXPERIMENT_BIN_PACKAGES`]; any other as `cargo build --release -p <name>-bin`.
///
/// Tests that call it are `#[ignore = "needs the release binaries: cargo build --release"]`:
/// a release build takes minutes, so the default `cargo test` never waits for one.
pub fn release_bin(name: &str) -> PathBuf {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let package = format!("{name}-bin");
    let packages: Vec<&str> = if EXPERIMENT_BIN_PACKAGES.contains(&package.as_str()) {
        EXPERIMENT_BIN_PACKAGES.to_vec()
    } else {
        vec![package.as_str()]
    };
    let mut args = vec!["build", "--release"];
    for p in &packages {
        args.extend(["-p", p]);
    }
    let status = Command::new(cargo)
        .current_dir(workspace_root())
        .args(&args)
        .status()
        .expect("cargo runs");
    assert!(status.success(), "`cargo {}` failed", args.join(" "));
    let bin = target_dir().join("release").join(name);
    assert!(
        bin.is_file(),
        "{} is missing after the build",
        bin.display()
    );
    bin
}
