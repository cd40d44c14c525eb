//! Every `meta.json` the project has published (docs/measurements) or keeps as a fixture
//! (fixtures/) parses as a [`Meta`], and every one written since `attempts` was added (today's
//! writer; the older ones lack `attempts`, `evidence`, `drift`, `run`) serializes back to the same
//! bytes: the one type is both the writer's and the reader's.

use std::path::{Path, PathBuf};

use schema::Meta;

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

#[test]
fn every_published_meta_parses_and_round_trips() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = Vec::new();
    metas(&root.join("docs/measurements"), &mut files);
    metas(&root.join("fixtures"), &mut files);
    files.sort();
    assert!(files.len() > 500, "found only {} meta.json", files.len());
    let mut not_identical = Vec::new();
    let mut current = 0;
    for f in &files {
        let text = std::fs::read(f).unwrap();
        let meta: Meta =
            serde_json::from_slice(&text).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        assert!(!meta.plan_fingerprint.is_empty(), "{}", f.display());
        let value: serde_json::Value = serde_json::from_slice(&text).unwrap();
        if value.get("attempts").is_none() {
            continue;
        }
        current += 1;
        if serde_json::to_vec_pretty(&meta).unwrap() != text {
            not_identical.push(f.display().to_string());
        }
    }
    assert!(current > 400, "only {current} current meta.json");
    assert!(
        not_identical.is_empty(),
        "{} of {} do not serialize back to their bytes: {:?}",
        not_identical.len(),
        current,
        &not_identical[..not_identical.len().min(5)]
    );
}
