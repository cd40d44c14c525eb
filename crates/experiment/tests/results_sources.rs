//! Every number in `docs/results.md` has a source in a published report that its paragraph or
//! section links, or an `unsourced` comment that says why not (`experiment::results_sources`,
//! whose module docs give the rules); and the check itself catches what it should on planted
//! inputs.
//!
//! `cargo test -p experiment --test results_sources -- --nocapture` prints the counts;
//! `RESULTS_SOURCES_SKIPPED=1` also lists every number not checked, with its rule.

use std::path::{Path, PathBuf};

use experiment::results_sources::{Report, Skip, check, check_repo};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn every_number_in_results_md_has_a_source() {
    let report = check_repo(&repo_root()).expect("the check runs");
    // The counts, for `cargo test -- --nocapture`.
    println!("{}", report.summary());
    if std::env::var_os("RESULTS_SOURCES_SKIPPED").is_some() {
        for (line, n, rule) in &report.skipped_numbers {
            println!("skipped\t{line}\t{rule:?}\t{n}");
        }
    }
    let failures = report.failures();
    assert!(
        report.is_ok(),
        "{} failures; a number must be found in a source its paragraph (or, when that links \
         nothing, its section) links — rules in crates/experiment/src/results_sources.rs — or \
         be exempted with `<!-- unsourced: <numbers> — <reason> -->` in its paragraph:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // Guard against a check that silently checks nothing.
    assert!(report.checked > 1000, "{}", report.summary());
}

/// A scratch docs directory with one report, removed on drop.
struct Docs(PathBuf);

impl Docs {
    fn new(name: &str) -> Docs {
        let dir = std::env::temp_dir().join(format!(
            "kvroute-results-sources-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("measurements/run-a")).unwrap();
        std::fs::create_dir_all(dir.join("measurements/run-b")).unwrap();
        std::fs::write(
            dir.join("measurements/run-a/report.md"),
            "| policy | goodput |\n|---|---|\n| prefix-affinity | 1.619 (91.27%) |\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("measurements/run-a/report.json"),
            r#"{"capacity_rps": 8.575, "share": 0.2071, "cells": 324}"#,
        )
        .unwrap();
        std::fs::write(
            dir.join("measurements/run-b/summary.md"),
            "recovery 4 s, lost 17 requests\n",
        )
        .unwrap();
        Docs(dir)
    }

    fn check(&self, results: &str) -> Report {
        check(results, &self.0, "results.md").expect("the check runs")
    }
}

impl Drop for Docs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn an_unsourced_number_fails_with_its_line_and_sources() {
    let docs = Docs::new("unsourced");
    let r = docs.check(
        "# R\n\n## A run\n\n[report](measurements/run-a/report.md): goodput 1.619.\n\nIt gained +14.7% on that day.\n",
    );
    assert!(!r.is_ok());
    assert_eq!(r.unsourced.len(), 1, "{:?}", r.failures());
    assert_eq!(
        r.failures()[0],
        "results.md:7: \"+14.7%\" has no source in measurements/run-a/report.md (section \"A run\")"
    );
}

#[test]
fn a_rounded_number_and_a_percentage_of_a_fraction_pass() {
    let docs = Docs::new("rounded");
    let r = docs.check(
        "## A run\n\n[report](measurements/run-a/report.md) and its \
         [record](measurements/run-a/report.json): 1.62 req/s and ×1.6 (91.3%, or 91%); \
         capacity 8.58, busiest share 20.7%, 324 cells.\n",
    );
    assert!(r.is_ok(), "{:?}", r.failures());
    assert_eq!(r.checked, 7);
    // 20.7% is the record's fraction 0.2071.
    assert_eq!(r.matched_as_fraction, 1);
    // Rounding is to the decimals written, no looser: 1.63 is not 1.619.
    let r = docs.check("## A run\n\n[report](measurements/run-a/report.md): 1.63 req/s.\n");
    assert_eq!(r.unsourced.len(), 1);
    // A count must be written as that integer: 1.619 does not source "2 policies".
    let r = docs.check("## A run\n\n[report](measurements/run-a/report.md): 2 policies.\n");
    assert_eq!(r.unsourced.len(), 1);
    // A report does not bring its JSON record: the record is cited by linking it.
    let r = docs.check("## A run\n\n[report](measurements/run-a/report.md): 8.575 req/s.\n");
    assert_eq!(r.unsourced.len(), 1);
}

#[test]
fn numbers_in_code_dates_references_and_names_are_not_checked() {
    let docs = Docs::new("skipped");
    let r = docs.check(
        "## 3. A run (figure 7, issue #35; 3 December 2026, 14:54 UTC)\n\n\
         [report](measurements/run-a/report.md) ran `cargo xtask sweep --rate 4.077` at ws8-s1.4, \
         p99 of rep-2, on 1–3 Dec, in 11 min 43 s.\n\n```\ncargo xtask calibrate --warmup-s 6\n```\n",
    );
    assert!(r.is_ok(), "{:?}", r.failures());
    assert_eq!(r.checked, 0);
    let n = |s| r.skipped.get(&s).copied().unwrap_or(0);
    assert_eq!(n(Skip::Code), 2);
    assert_eq!(n(Skip::Reference), 3);
    assert_eq!(n(Skip::Date), 6);
    assert_eq!(n(Skip::Name), 4);
    assert_eq!(n(Skip::WallTime), 2);
}

#[test]
fn an_exemption_comment_exempts_its_numbers_in_its_paragraph_only() {
    let docs = Docs::new("exempt");
    let r = docs.check(
        "## A run\n\n[report](measurements/run-a/report.md) took 57 s.\n\
         <!-- unsourced: 57 — wall time of the run, recorded by no report -->\n\n\
         Again 57 s.\n",
    );
    assert_eq!(r.exempted, 1);
    assert_eq!(r.exemption_comments, 1);
    assert_eq!(r.unsourced.len(), 1, "the second paragraph is not exempted");
    assert_eq!(r.unsourced[0].line, 6);
    // `all` exempts every number of its paragraph.
    let r = docs.check(
        "## A run\n\nA table from no report: 3.5, 7 and 12.25.\n\
         <!-- unsourced: all — computed by hand -->\n",
    );
    assert!(r.is_ok(), "{:?}", r.failures());
    assert_eq!(r.exempted, 3);
    // An exemption naming a number its paragraph does not hold fails, so none go stale.
    let r = docs.check(
        "## A run\n\n[report](measurements/run-a/report.md): 1.619.\n\
         <!-- unsourced: 2.5 — stale -->\n",
    );
    assert!(!r.is_ok());
    assert!(
        r.problems[0].contains("names no number of its paragraph"),
        "{:?}",
        r.problems
    );
    // One without a reason fails.
    let r = docs.check("## A run\n\nTook 57 s. <!-- unsourced: 57 -->\n");
    assert!(r.problems[0].contains("no reason"), "{:?}", r.problems);
}

#[test]
fn a_paragraph_without_links_inherits_its_sections_and_parents_links() {
    let docs = Docs::new("inherit");
    let text = "## Runs\n\n[run-b](measurements/run-b/summary.md).\n\n\
                ### Run A\n\n[report](measurements/run-a/report.md): 1.619.\n\n\
                Recovered in 4 s, 17 lost, at 1.619.\n\n\
                ### Run A again\n\nStill 1.619.\n\n\
                [run-b](measurements/run-b/summary.md) says 1.619 too.\n";
    let r = docs.check(text);
    assert_eq!(r.checked, 6);
    // Line 9 takes run-a (its section) and run-b (its parent); the sibling's line 13 takes only
    // run-b; line 15 cites run-b and is checked against it alone.
    let lines: Vec<usize> = r.unsourced.iter().map(|u| u.line).collect();
    assert_eq!(lines, vec![13, 15], "{:?}", r.failures());
    assert_eq!(
        r.unsourced[0].sources,
        vec!["measurements/run-b/summary.md"]
    );
}

#[test]
fn links_that_lead_nowhere_fail_and_the_measurements_root_brings_its_index_only() {
    let docs = Docs::new("links");
    // An in-file anchor is no source, but must exist.
    let r = docs.check(
        "## Run A\n\n[report](measurements/run-a/report.md).\n\n\
         ## In short\n\nSee [Run A](#run-a) and [nothing](#no-such-section).\n",
    );
    assert_eq!(r.problems.len(), 1, "{:?}", r.problems);
    assert!(r.problems[0].contains("#no-such-section"));
    let r = docs.check("## Run C\n\n[report](measurements/run-c/report.md): 2.5.\n");
    assert_eq!(r.unsourced.len(), 1);
    assert!(r.problems[0].contains("no such file"), "{:?}", r.problems);
    // The measurements root brings its index only, not every run's numbers.
    std::fs::write(docs.0.join("measurements/README.md"), "layout\n").unwrap();
    let r = docs.check("## All\n\n[all](measurements/): 1.619.\n");
    assert_eq!(r.unsourced.len(), 1);
    // A directory below it brings every text file under it.
    let r = docs.check("## A\n\n[run-a](measurements/run-a/): 1.619 and 8.575.\n");
    assert!(r.is_ok(), "{:?}", r.failures());
    // ... in its own paragraph only: the next paragraph does not inherit it.
    let r = docs.check("## A\n\n[run-a](measurements/run-a/): 1.619.\n\nThen 8.575.\n");
    assert_eq!(r.unsourced.len(), 1, "{:?}", r.failures());
    assert_eq!(r.unsourced[0].number, "8.575");
}
