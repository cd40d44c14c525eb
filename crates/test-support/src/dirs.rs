//! Temp dirs, from the `tempfile` crate.

/// A fresh directory under the system temp dir named `kvroute-<name>-<random>`, removed when
/// the returned guard drops (also when the test panics). Tests running in parallel never share
/// one, and a crashed earlier run cannot leave anything in it.
pub fn temp_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("kvroute-{name}-"))
        .tempdir()
        .unwrap_or_else(|e| panic!("a temp dir for {name}: {e}"))
}
