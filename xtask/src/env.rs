//! The workspace around xtask: where it is, building the binaries (`experiment::Bins`), git
//! revision, versions.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use experiment::Bins;
use experiment::bins::BIN_PACKAGES;

/// The workspace root (xtask lives one level below it).
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// The cargo target directory (honours `CARGO_TARGET_DIR`, relative to the workspace root; an
/// absolute one replaces the root in `join`).
pub fn target_dir() -> PathBuf {
    let dir = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| "target".into(), PathBuf::from);
    workspace_root().join(dir)
}

/// The release binaries under the target dir (not checked).
pub fn release_bins() -> Bins {
    Bins::in_dir(&target_dir().join("release"))
}

/// `cargo build --release -p engine-bin -p router-bin -p driver-bin -p report-bin`.
pub fn build_release_bins() -> Result<Bins> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(workspace_root())
        .args(["build", "--release"]);
    for p in BIN_PACKAGES {
        cmd.args(["-p", p]);
    }
    eprintln!("xtask: building {} (release)", BIN_PACKAGES.join(", "));
    let status = cmd.status().context("running cargo build")?;
    if !status.success() {
        bail!("cargo build --release of the experiment binaries failed ({status})");
    }
    let bins = release_bins();
    bins.check()?;
    Ok(bins)
}

/// `git rev-parse HEAD` of the workspace, with `-dirty` when its tree has changes.
pub fn git_rev() -> Option<String> {
    experiment::provenance::git_rev(&workspace_root())
}

/// Versions worth recording beside results (`experiment::provenance::versions`).
pub fn versions() -> serde_json::Value {
    experiment::provenance::versions()
}
