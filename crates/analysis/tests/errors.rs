//! Bad input is a clear error naming the file and line, never a panic and never a silent skip;
//! an unfinished repetition is listed, not analysed.

mod common;

use analysis::{AnalysisError, ReportConfig, analyze_dir, read_client_csv, read_router_csv};

fn rows_error(err: AnalysisError) -> (String, u64, String) {
    match err {
        AnalysisError::Rows {
            path,
            line,
            message,
        } => (path.display().to_string(), line, message),
        other => panic!("expected a rows error, got {other}"),
    }
}

fn client_err(name: &str) -> (String, u64, String) {
    let path = common::fixtures().join("malformed").join(name);
    let err = read_client_csv(&path).unwrap_err();
    let text = err.to_string();
    let (p, line, message) = rows_error(err);
    assert!(p.ends_with(name), "{p}");
    // the displayed error starts with path:line, the form editors jump to
    assert!(text.starts_with(&format!("{p}:{line}: ")), "{text}");
    (p, line, message)
}

#[test]
fn short_row_names_its_line() {
    let (_, line, msg) = client_err("client-short-row.csv");
    assert_eq!(line, 3);
    assert!(msg.contains("12 fields, the header has 19"), "{msg}");
}

#[test]
fn truncated_file_names_its_last_line() {
    let (_, line, msg) = client_err("client-truncated.csv");
    assert_eq!(line, 3);
    assert!(msg.contains("truncated"), "{msg}");
}

#[test]
fn bad_value_names_line_and_column() {
    let (_, line, msg) = client_err("client-bad-number.csv");
    assert_eq!(line, 2);
    assert!(msg.contains("`ttft_ms`") && msg.contains("`abc`"), "{msg}");
}

#[test]
fn missing_column_names_the_header() {
    let (_, line, msg) = client_err("client-missing-column.csv");
    assert_eq!(line, 1);
    assert!(msg.contains("`warmup`"), "{msg}");
}

#[test]
fn duplicate_request_id_names_both_lines() {
    let (_, line, msg) = client_err("client-duplicate-id.csv");
    assert_eq!(line, 4);
    assert!(msg.contains("se-r1-00") && msg.contains("line 2"), "{msg}");
}

#[test]
fn router_rows_are_as_strict() {
    let path = common::fixtures().join("malformed/router-bad-replica.csv");
    let (p, line, msg) = rows_error(read_router_csv(&path).unwrap_err());
    assert!(p.ends_with("router-bad-replica.csv"));
    assert_eq!(line, 3);
    assert!(msg.contains("`replica`") && msg.contains("`-1`"), "{msg}");
}

#[test]
fn a_complete_rep_with_truncated_rows_fails_the_report() {
    let err = analyze_dir(
        &common::fixtures().join("sweep-malformed"),
        &ReportConfig::default(),
    )
    .unwrap_err();
    let (p, line, msg) = rows_error(err);
    assert!(
        p.ends_with("sweep-malformed/p0/session-affinity/rep-1/client.csv"),
        "{p}"
    );
    assert_eq!(line, 3);
    assert!(msg.contains("truncated"));
}

#[test]
fn missing_files_and_empty_sweeps_are_errors() {
    let missing = common::fixtures().join("malformed/no-such-file.csv");
    assert!(matches!(
        read_client_csv(&missing),
        Err(AnalysisError::Io { .. })
    ));
    // a directory with no rep-<k> directories under it is not a sweep
    let err = analyze_dir(
        &common::fixtures().join("malformed"),
        &ReportConfig::default(),
    )
    .unwrap_err();
    assert!(matches!(err, AnalysisError::EmptySweep { .. }), "{err}");
}
