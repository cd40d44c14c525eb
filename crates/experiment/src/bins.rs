//! Where the experiment's release binaries are: the procedures run `engine`, `router` and
//! `driver` as processes through their command lines (docs/CONTRACTS.md). Building them is the
//! caller's job (xtask runs cargo).

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

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
