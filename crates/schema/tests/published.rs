//! Every `meta.json` the project has published (docs/measurements) or keeps as a fixture
//! (fixtures/) parses as a [`Meta`], reading loses nothing, and every one written by today's
//! writers serializes back to the same bytes: the one type is both the writer's and the reader's.
//!
//! "Loses nothing": every value the file holds, at every depth, is in the re-serialized [`Meta`],
//! unchanged (its typed sections — evidence, drift, run — included). A file written before some
//! typed field existed reads that field's default, which serializing then adds; a file to which
//! nothing is added (today's writers', which carry `attempts` and every field) must come back
//! byte for byte.

use std::path::{Path, PathBuf};

use schema::Meta;
use serde_json::Value;

fn metas(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            metas(&p, out);
        } else if p.file_name().is_some_and(|n| n == "meta.json") {
            out.push(p);
        }
    }
}

/// The first place where `read` lacks or changes a value of `file` (`None`: it holds all of them
/// unchanged; it may hold more).
fn lost(file: &Value, read: &Value, path: &str) -> Option<String> {
    match (file, read) {
        (Value::Object(f), Value::Object(r)) => f.iter().find_map(|(k, v)| match r.get(k) {
            Some(rv) => lost(v, rv, &format!("{path}.{k}")),
            None => Some(format!("{path}.{k}: dropped")),
        }),
        (Value::Array(f), Value::Array(r)) if f.len() == r.len() => (f.iter().zip(r))
            .enumerate()
            .find_map(|(i, (v, rv))| lost(v, rv, &format!("{path}[{i}]"))),
        (f, r) if f == r => None,
        (f, r) => Some(format!("{path}: {f} read back as {r}")),
    }
}

#[test]
fn every_published_meta_parses_and_round_trips() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = Vec::new();
    metas(&root.join("docs/measurements"), &mut files);
    metas(&root.join("fixtures"), &mut files);
    files.sort();
    assert!(files.len() > 500, "found only {} meta.json", files.len());
    let mut not_identical = Vec::new();
    let (mut current, mut complete) = (0, 0);
    for f in &files {
        let text = std::fs::read(f).unwrap();
        let meta: Meta =
            serde_json::from_slice(&text).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        assert!(!meta.plan_fingerprint.is_empty(), "{}", f.display());
        let file: Value = serde_json::from_slice(&text).unwrap();
        let read = serde_json::to_value(&meta).unwrap();
        if let Some(what) = lost(&file, &read, "") {
            panic!("{}: reading loses {what}", f.display());
        }
        if file.get("attempts").is_none() {
            continue;
        }
        current += 1;
        if read != file {
            continue; // written before some typed field existed: its default was added
        }
        complete += 1;
        if serde_json::to_vec_pretty(&meta).unwrap() != text {
            not_identical.push(f.display().to_string());
        }
    }
    eprintln!(
        "{} meta.json, {current} current, {complete} complete",
        files.len()
    );
    assert!(current > 400, "only {current} current meta.json");
    assert!(
        complete > 300,
        "only {complete} of {current} carry every typed field"
    );
    assert!(
        not_identical.is_empty(),
        "{} of {} do not serialize back to their bytes: {:?}",
        not_identical.len(),
        complete,
        &not_identical[..not_identical.len().min(5)]
    );
}
