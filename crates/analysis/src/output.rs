//! Writing the analysis's own files into the analysed directory: atomically, so a reader never
//! sees half a report.

use std::io::Write;
use std::path::Path;

use atomic_write_file::AtomicWriteFile;

use crate::error::{AnalysisError, Result};

/// One file of the output: its name in the analysed directory and its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputFile {
    /// File name inside the directory.
    pub name: &'static str,
    /// Its contents.
    pub bytes: Vec<u8>,
}

/// Writes each file into `dir`, in order, atomically.
pub fn write_files(dir: &Path, files: &[OutputFile]) -> Result<()> {
    for f in files {
        write_atomic(&dir.join(f.name), &f.bytes)?;
    }
    Ok(())
}

/// Writes through a temporary file in the same directory, synced, then renamed over `path` (the
/// `atomic-write-file` crate, which also syncs the directory), so a reader never sees half a file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = AtomicWriteFile::open(path).map_err(|e| AnalysisError::io(path, e))?;
    f.write_all(bytes)
        .and_then(|()| f.commit())
        .map_err(|e| AnalysisError::io(path, e))
}
