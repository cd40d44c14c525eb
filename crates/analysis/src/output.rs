//! Writing the analysis's own files into the analysed directory: atomically, so a reader never
//! sees half a report.

use std::io::Write;
use std::path::Path;

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

/// Writes via a hidden temporary name in the same directory, synced, then a rename, so a reader
/// never sees half a file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let written = std::fs::File::create(&tmp).and_then(|mut f| {
        f.write_all(bytes)?;
        f.sync_all()
    });
    if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, path)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(AnalysisError::io(path, e));
    }
    // The rename is durable once the directory entry is.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}
