//! A per-test scratch directory (from `test-support`, on the `tempfile` crate), removed when
//! dropped (also when the test fails), so tests that write files leave nothing behind.

use std::path::PathBuf;

/// `<tmp>/kvroute-experiment-<name>-<random>`, created empty; removed on drop.
pub(crate) struct Scratch(
    pub(crate) PathBuf,
    #[allow(dead_code)] test_support::TempDir,
);

impl Scratch {
    /// A fresh, empty directory; `name` says which test it is for.
    pub(crate) fn new(name: &str) -> Scratch {
        let dir = test_support::temp_dir(&format!("experiment-{name}"));
        Scratch(dir.path().to_path_buf(), dir)
    }
}
