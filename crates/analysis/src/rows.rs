//! Strict readers for `client.csv` (driver) and `router.csv` (router): the rows are
//! `schema::rows::{ClientRow, RouterRow}` (re-exported here), read through the `csv` crate and
//! typed by their serde definitions, columns as pinned in docs/CONTRACTS.md. Columns are found by
//! header name, so added columns at the end are ignored; a missing column, a short or long row,
//! an unparsable value, a duplicate `request_id` or a file cut off mid-line is an error naming the
//! file and the 1-based line (header = line 1), and a bad value names its column too.

use std::cell::Cell;
use std::path::Path;

use ahash::AHashMap;
use serde::Deserialize;
use serde::de::value::{Error as ValueError, MapDeserializer, SeqDeserializer};

pub use schema::rows::{CLIENT_COLUMNS, ClientRow, ROUTER_COLUMNS, RouterRow};

use crate::error::{AnalysisError, Result};

/// Checks that a file's header carries every column of the schema's list (in any order, extra
/// columns allowed).
fn check_header(path: &Path, header: &csv::StringRecord, columns: &[&str]) -> Result<()> {
    match columns.iter().find(|c| !header.iter().any(|h| h == **c)) {
        Some(name) => Err(AnalysisError::rows(
            path,
            1,
            format!("header lacks the column `{name}`"),
        )),
        None => Ok(()),
    }
}

/// Types one record by its row's serde definition; a bad cell is an error naming its line and
/// column. `in_order`: the header is exactly the row's columns, in order (every file the writers
/// write), so the cells are handed over by position; otherwise keyed by the header's names.
fn typed<T: for<'de> Deserialize<'de>>(
    path: &Path,
    line: u64,
    header: &csv::StringRecord,
    in_order: bool,
    record: &csv::StringRecord,
) -> Result<T> {
    // The deserializer is handed one cell at a time, in header order; the last one handed over
    // is the one a failure is about.
    let at = Cell::new(None::<usize>);
    let seen = |i: usize| at.set(Some(i));
    let typed = if in_order {
        let cells = record.iter().enumerate().map(|(i, cell)| {
            seen(i);
            cell
        });
        T::deserialize(SeqDeserializer::<_, ValueError>::new(cells))
    } else {
        let cells = header.iter().zip(record.iter()).enumerate();
        let cells = cells.map(|(i, pair)| {
            seen(i);
            pair
        });
        T::deserialize(MapDeserializer::<_, ValueError>::new(cells))
    };
    typed.map_err(|e| {
        let column = at.get().and_then(|i| header.get(i));
        let message = match column {
            Some(name) => format!("column `{name}`: {e}"),
            None => e.to_string(),
        };
        AnalysisError::rows(path, line, message)
    })
}

/// Reads a file's bytes, decompressing it when its name ends in `.gz` (published rows in
/// `docs/measurements` are stored compressed to keep the repository small).
fn read_maybe_gzip(path: &Path) -> Result<Vec<u8>> {
    let raw = std::fs::read(path).map_err(|e| AnalysisError::io(path, e))?;
    if path.extension().is_some_and(|e| e == "gz") {
        let mut out = Vec::with_capacity(raw.len() * 4);
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(raw.as_slice()), &mut out)
            .map_err(|e| AnalysisError::io(path, e))?;
        Ok(out)
    } else {
        Ok(raw)
    }
}

/// Finds a rows file in a repetition directory: `<name>` as written by a sweep, else
/// `<name>.gz` as published.
pub fn rows_file(dir: &Path, name: &str) -> Option<std::path::PathBuf> {
    let plain = dir.join(name);
    if plain.exists() {
        return Some(plain);
    }
    let gz = dir.join(format!("{name}.gz"));
    gz.exists().then_some(gz)
}

/// Reads a rows file strictly: every record typed as `T`, its header checked against `columns`.
fn read_rows<T: for<'de> Deserialize<'de>>(
    path: &Path,
    columns: &[&str],
    id_of: impl Fn(&T) -> &str,
) -> Result<Vec<T>> {
    let bytes = read_maybe_gzip(path)?;
    if bytes.is_empty() {
        return Err(AnalysisError::rows(path, 1, "empty file: no header"));
    }
    // Writers end every record with a newline; a last line without one was cut off mid-write
    // (a killed process, a full disk), and its last value may look valid while being short.
    if !bytes.ends_with(b"\n") {
        let line = bytes.iter().filter(|&&b| b == b'\n').count() as u64 + 1;
        return Err(AnalysisError::rows(
            path,
            line,
            "truncated: the last line has no line terminator",
        ));
    }
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(true)
        .flexible(false)
        .from_reader(bytes.as_slice());
    let header = reader
        .headers()
        .map_err(|e| AnalysisError::rows(path, 1, format!("bad header: {e}")))?
        .clone();
    check_header(path, &header, columns)?;
    let in_order = header.iter().eq(columns.iter().copied());
    let mut out: Vec<T> = Vec::new();
    let mut lines: Vec<u64> = Vec::new();
    let mut record = csv::StringRecord::new();
    loop {
        let line = reader.position().line();
        match reader.read_record(&mut record) {
            Ok(false) => break,
            Ok(true) => {}
            Err(e) => {
                let line = e.position().map(|p| p.line()).unwrap_or(line);
                let message = match e.kind() {
                    csv::ErrorKind::UnequalLengths {
                        expected_len, len, ..
                    } => format!(
                        "row has {len} fields, the header has {expected_len} (short, long or truncated row)"
                    ),
                    _ => e.to_string(),
                };
                return Err(AnalysisError::rows(path, line, message));
            }
        }
        let line = record.position().map(|p| p.line()).unwrap_or(line);
        out.push(typed(path, line, &header, in_order, &record)?);
        lines.push(line);
    }
    let mut seen: AHashMap<&str, u64> = AHashMap::with_capacity(out.len());
    for (row, &line) in out.iter().zip(&lines) {
        if let Some(first) = seen.insert(id_of(row), line) {
            return Err(AnalysisError::rows(
                path,
                line,
                format!(
                    "duplicate request_id `{}` (first on line {first})",
                    id_of(row)
                ),
            ));
        }
    }
    Ok(out)
}

/// Reads a driver's `client.csv`.
pub fn read_client_csv(path: &Path) -> Result<Vec<ClientRow>> {
    read_rows(path, &CLIENT_COLUMNS, |r: &ClientRow| &r.request_id)
}

/// Reads a router's `router.csv`.
pub fn read_router_csv(path: &Path) -> Result<Vec<RouterRow>> {
    read_rows(path, &ROUTER_COLUMNS, |r: &RouterRow| &r.request_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_are_found_by_name_in_any_order_and_a_bad_cell_names_its_column() {
        let dir = test_support::temp_dir("analysis-rows");
        let path = dir.path().join("router.csv");
        // The writers' order, reversed, with a column added at the end.
        let mut header: Vec<&str> = ROUTER_COLUMNS.iter().rev().copied().collect();
        header.push("later");
        let cells = |replica: &str| {
            let mut r: Vec<String> = ROUTER_COLUMNS
                .iter()
                .rev()
                .map(|c| match *c {
                    "request_id" => "r1".to_string(),
                    "arrival_s" => "1.500000".to_string(),
                    "policy" => "round-robin".to_string(),
                    "replica" => replica.to_string(),
                    "attempts" => "1".to_string(),
                    _ => String::new(),
                })
                .collect();
            r.push("x".into());
            r.join(",")
        };
        std::fs::write(&path, format!("{}\n{}\n", header.join(","), cells("2"))).unwrap();
        let rows = read_router_csv(&path).unwrap();
        assert_eq!((rows[0].replica, rows[0].attempts), (Some(2), 1));
        assert_eq!(rows[0].arrival_s, 1.5);
        std::fs::write(&path, format!("{}\n{}\n", header.join(","), cells("two"))).unwrap();
        match read_router_csv(&path).unwrap_err() {
            AnalysisError::Rows { line, message, .. } => {
                assert_eq!(line, 2);
                assert!(
                    message.contains("column `replica`") && message.contains("`two`"),
                    "{message}"
                );
            }
            other => panic!("{other}"),
        }
    }
}
