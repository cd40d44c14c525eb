//! A per-test scratch directory under the system temp dir, removed when dropped (also when the
//! test fails), so tests that write files leave nothing behind.

use std::path::PathBuf;

/// `<tmp>/experiment-<name>-<pid>`, created empty; removed on drop.
pub(crate) struct Scratch(pub(crate) PathBuf);

impl Scratch {
    /// A fresh, empty directory; `name` keeps parallel tests apart.
    pub(crate) fn new(name: &str) -> Scratch {
        let p = std::env::temp_dir().join(format!("experiment-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
