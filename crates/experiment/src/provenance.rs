//! What a result records of the code and machine that measured it: the git revision and the
//! tool versions (`meta.json`'s `git_rev` and `versions`, `calibration.json`'s too).

use std::path::Path;
use std::process::Command;

/// `git rev-parse HEAD` of the checkout at `root`, with `-dirty` when its tree has changes;
/// `None` outside git.
pub fn git_rev(root: &Path) -> Option<String> {
    let out = Command::new("git")
        .current_dir(root)
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let rev = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let dirty = Command::new("git")
        .current_dir(root)
        .args(["status", "--porcelain", "--untracked-files=no"])
        .output()
        .ok()
        .is_some_and(|o| !o.stdout.is_empty());
    Some(if dirty { format!("{rev}-dirty") } else { rev })
}

/// Versions worth recording beside results: rustc, the workspace version, the host.
pub fn versions() -> serde_json::Value {
    let rustc = Command::new(std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into()))
        .arg("-V")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    serde_json::json!({
        "kvroute": env!("CARGO_PKG_VERSION"),
        "rustc": rustc,
        "os": std::env::consts::OS,
        "arch": std::env::consts::ARCH,
        "cpus": std::thread::available_parallelism().map_or(1, |n| n.get()),
    })
}
