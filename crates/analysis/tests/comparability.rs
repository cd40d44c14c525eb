//! The comparison refuses cells of one point whose workload or arrival plan differ, naming both
//! values and the cells; other points are still tabulated.

mod common;

use analysis::{ReportConfig, analyze_dir, markdown};

#[test]
fn differing_plan_fingerprints_are_refused_by_name() {
    let r = analyze_dir(
        &common::fixtures().join("sweep-incomparable"),
        &ReportConfig::default(),
    )
    .unwrap();
    let tabulated: Vec<&str> = r.points.iter().map(|p| p.point.as_str()).collect();
    assert_eq!(tabulated, ["p0"]);
    assert_eq!(r.refused.len(), 1);
    let refusal = &r.refused[0];
    assert_eq!(refusal.point, "p1");
    assert_eq!(refusal.field, "plan_fingerprint");
    let groups: Vec<(&str, Vec<&str>)> = refusal
        .groups
        .iter()
        .map(|g| {
            (
                g.value.as_str(),
                g.cells.iter().map(String::as_str).collect(),
            )
        })
        .collect();
    assert_eq!(
        groups,
        [
            (
                "pf-1111",
                vec![
                    "prefix-affinity/rep-1",
                    "session-affinity/rep-1",
                    "session-affinity/rep-2"
                ]
            ),
            ("pf-2222", vec!["prefix-affinity/rep-2"]),
        ]
    );
    let text = refusal.to_string();
    assert!(
        text.contains("`pf-1111`")
            && text.contains("`pf-2222`")
            && text.contains("prefix-affinity/rep-2"),
        "{text}"
    );
    let md = markdown::render(&r);
    assert!(md.contains("## Refused points"), "{md}");
    assert!(!md.contains("## Point `p1`"));
}

#[test]
fn differing_workload_names_are_refused_first() {
    let sweep = analysis::load_sweep(&common::fixtures().join("sweep-basic")).unwrap();
    let mut reps: Vec<analysis::RepData> = sweep
        .reps
        .into_iter()
        .filter(|r| r.point == "ws1-s0")
        .collect();
    reps[0].meta.workload_name = "mt-other".into();
    let refs: Vec<&analysis::RepData> = reps.iter().collect();
    let refusal = analysis::check_comparable("ws1-s0", &refs).unwrap_err();
    assert_eq!(refusal.field, "workload_name");
    let values: Vec<&str> = refusal.groups.iter().map(|g| g.value.as_str()).collect();
    assert_eq!(values, ["mt-other", "mt-ws1-s0"]);
    assert_eq!(refusal.groups[0].cells, ["prefix-affinity/rep-1"]);
}

#[test]
fn adaptive_router_test_states_the_null_result() {
    // p0: both policies have identical rows, so nothing beats prefix-affinity; p1 is refused and
    // therefore not tested.
    let r = analyze_dir(
        &common::fixtures().join("sweep-incomparable"),
        &ReportConfig::default(),
    )
    .unwrap();
    let t = &r.adaptive_router_test;
    assert_eq!(t.points_tested, ["p0"]);
    assert!(t.beats.is_empty());
    assert!(
        t.statement
            .starts_with("Null result: at none of the 1 points tested"),
        "{}",
        t.statement
    );
    let p0 = &r.points[0];
    let m = p0.margin("session-affinity", "prefix-affinity").unwrap();
    assert_eq!(m.margin_rps, 0.0);
    assert_eq!(m.verdict, analysis::Verdict::WithinSpread);
    assert!(markdown::render(&r).contains(&t.statement));
}
