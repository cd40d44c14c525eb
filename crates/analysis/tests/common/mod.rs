//! Shared helpers of the integration tests.

#![allow(dead_code)]

use std::path::PathBuf;

/// `fixtures/analysis/` at the workspace root.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/analysis")
}

/// Compares `actual` with the golden file, or rewrites it when `UPDATE_GOLDEN=1`.
pub fn assert_golden(name: &str, actual: &str) {
    let path = fixtures().join("golden").join(name);
    if std::env::var("UPDATE_GOLDEN").as_deref() == Ok("1") {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run with UPDATE_GOLDEN=1 to create it",
            path.display()
        )
    });
    if let Some((line, e, a)) = first_difference(&expected, actual) {
        panic!(
            "{} differs from the output at line {line}:\n  golden: {e:?}\n  actual: {a:?}\n(regenerate deliberately with UPDATE_GOLDEN=1)",
            path.display(),
        );
    }
}

/// The first differing line (1-based) with both versions of it.
fn first_difference<'a>(expected: &'a str, actual: &'a str) -> Option<(usize, &'a str, &'a str)> {
    if expected == actual {
        return None;
    }
    let mut e = expected.lines();
    let mut a = actual.lines();
    let mut line = 1;
    loop {
        match (e.next(), a.next()) {
            (Some(x), Some(y)) if x == y => line += 1,
            (x, y) => return Some((line, x.unwrap_or("<end>"), y.unwrap_or("<end>"))),
        }
    }
}

/// Panics at the first line where two texts differ.
pub fn assert_same_text(expected: &str, actual: &str) {
    if let Some((line, e, a)) = first_difference(expected, actual) {
        panic!("texts differ at line {line}:\n  expected: {e:?}\n  actual:   {a:?}");
    }
}
