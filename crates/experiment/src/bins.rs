//! Where the experiment's release binaries are: the procedures run `engine`, `router` and
//! `driver` as processes through their command lines (docs/CONTRACTS.md). Building them is the
//! caller's job (xtask runs cargo).

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

/// The packages whose binaries the experiment drives, built in one cargo invocation (xtask's
/// `env::build_release_bins`) so their shared dependencies compile once; the tests'
/// `test_support::release_bin` and `.ci/run` build the same set (a test below holds them equal).
pub const BIN_PACKAGES: &[&str] = &["engine-bin", "router-bin", "driver-bin", "report-bin"];

/// Paths of the release binaries.
#[derive(Debug, Clone)]
pub struct Bins {
    /// `engine`.
    pub engine: PathBuf,
    /// `router`.
    pub router: PathBuf,
    /// `driver`.
    pub driver: PathBuf,
}

impl Bins {
    /// The binaries in `dir`, a cargo profile directory such as `target/release` (not checked).
    pub fn in_dir(dir: &Path) -> Bins {
        Bins {
            engine: dir.join("engine"),
            router: dir.join("router"),
            driver: dir.join("driver"),
        }
    }

    /// Fails naming the first binary that does not exist.
    pub fn check(&self) -> Result<()> {
        for bin in [&self.engine, &self.router, &self.driver] {
            if !bin.is_file() {
                bail!(
                    "{} is missing; build it with `cargo build --release -p engine-bin -p router-bin -p driver-bin` (or drop --no-build)",
                    bin.display()
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_binary_is_named() {
        let bins = Bins::in_dir(Path::new("/nonexistent/release"));
        assert_eq!(bins.router, Path::new("/nonexistent/release/router"));
        let err = bins.check().unwrap_err().to_string();
        assert!(
            err.starts_with("/nonexistent/release/engine is missing"),
            "{err}"
        );
    }
}

#[cfg(test)]
mod package_set {
    #[test]
    fn the_tests_build_the_same_package_set_as_the_main_job() {
        // Another set would unify features differently and compile shared dependencies again.
        assert_eq!(super::BIN_PACKAGES, test_support::EXPERIMENT_BIN_PACKAGES);
        // .ci/run builds the set before the tests: the same invocation, or they build it again.
        let flags: Vec<String> = super::BIN_PACKAGES
            .iter()
            .map(|p| format!("-p {p}"))
            .collect();
        let ci = include_str!("../../../.ci/run");
        assert!(ci.contains(&flags.join(" ")), ".ci/run builds another set");
    }
}
