//! Atomic file writes for what the harness leaves in a cell directory.

use std::io::Write;
use std::path::Path;

use crate::{Error, Result};
use atomic_write_file::AtomicWriteFile;

/// Writes `bytes` to `path` through a temp file in the same directory, synced, and a rename (the
/// `atomic-write-file` crate), so a reader (or a crash) never sees half a file.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = AtomicWriteFile::open(path).map_err(Error::io("creating", path))?;
    f.write_all(bytes)
        .and_then(|()| f.commit())
        .map_err(Error::io("writing", path))
}
