//! `client.csv`: one row per request (docs/CONTRACTS.md, "Rows"): `schema::ClientRow`, written
//! through its serde definition (columns `schema::CLIENT_COLUMNS`).
//!
//! Rows are appended to `<out>.partial` as requests finish (flushed per row, so a crashed or
//! running experiment can be inspected) and the file is renamed to `<out>` when the run ends:
//! a reader that sees `client.csv` sees a complete run.

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};

use schema::CLIENT_COLUMNS;
pub use schema::ClientRow;

use crate::DriverError;

/// Writes rows incrementally to `<out>.partial`, renamed to `<out>` by [`RowWriter::finish`].
pub struct RowWriter {
    csv: csv::Writer<BufWriter<File>>,
    partial: PathBuf,
    out: PathBuf,
}

/// The incremental file's path for a final path.
pub fn partial_path(out: &Path) -> PathBuf {
    let mut name = out.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    out.with_file_name(name)
}

impl RowWriter {
    /// Creates `<out>.partial` and writes the header.
    pub fn create(out: &Path) -> Result<Self, DriverError> {
        let io = |e: std::io::Error| DriverError::Io(format!("{}: {e}", out.display()));
        if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let partial = partial_path(out);
        let file = File::create(&partial).map_err(io)?;
        // The header is the schema's list, written once; rows follow it (`ClientRow`'s fields are
        // those columns, in order).
        let mut csv = csv::WriterBuilder::new()
            .has_headers(false)
            .from_writer(BufWriter::new(file));
        csv.write_record(CLIENT_COLUMNS)
            .map_err(|e| DriverError::Io(e.to_string()))?;
        csv.flush().map_err(io)?;
        Ok(Self {
            csv,
            partial,
            out: out.to_path_buf(),
        })
    }

    /// Appends one row and flushes it to the file.
    pub fn write(&mut self, row: &ClientRow) -> Result<(), DriverError> {
        self.csv
            .serialize(row)
            .map_err(|e| DriverError::Io(e.to_string()))?;
        self.csv
            .flush()
            .map_err(|e| DriverError::Io(format!("{}: {e}", self.partial.display())))
    }

    /// Syncs the file and renames it to its final name.
    pub fn finish(self) -> Result<PathBuf, DriverError> {
        let io = |e: std::io::Error| DriverError::Io(e.to_string());
        let file = self
            .csv
            .into_inner()
            .map_err(|e| DriverError::Io(e.to_string()))?
            .into_inner()
            .map_err(|e| DriverError::Io(e.to_string()))?;
        file.sync_all().map_err(io)?;
        drop(file);
        std::fs::rename(&self.partial, &self.out).map_err(io)?;
        Ok(self.out)
    }
}

/// Reads a `client.csv` (or its `.partial`).
pub fn read_rows(path: &Path) -> Result<Vec<ClientRow>, DriverError> {
    let mut reader = csv::Reader::from_path(path)
        .map_err(|e| DriverError::Io(format!("{}: {e}", path.display())))?;
    let header = reader
        .headers()
        .map_err(|e| DriverError::Io(e.to_string()))?
        .clone();
    if header
        .iter()
        .take(CLIENT_COLUMNS.len())
        .ne(CLIENT_COLUMNS.iter().copied())
    {
        return Err(DriverError::Io(format!(
            "{}: header is not client.csv's",
            path.display()
        )));
    }
    reader
        .deserialize()
        .map(|r| r.map_err(|e| DriverError::Io(format!("{}: {e}", path.display()))))
        .collect()
}
