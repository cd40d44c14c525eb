//! The hand-made sweep under fixtures/analysis/sweep-basic (designed in gen_fixtures.py, expected
//! values worked out by hand in fixtures/analysis/README.md): goodput, medians, verdicts,
//! divergence never netted, incomplete and set-aside reps, optional router rows, and the golden
//! report.json / report.md.

mod common;

use analysis::metrics::{measured_requests, rep_metrics};
use analysis::report::{Point, Report};
use analysis::{ReportConfig, Verdict, analyze_dir, load_sweep, markdown};

fn report() -> Report {
    analyze_dir(
        &common::fixtures().join("sweep-basic"),
        &ReportConfig::default(),
    )
    .unwrap()
}

fn point<'a>(r: &'a Report, name: &str) -> &'a Point {
    r.points.iter().find(|p| p.point == name).unwrap()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn goodput_medians_and_ranges() {
    let r = report();
    let p = point(&r, "ws1-s0");
    let order: Vec<&str> = p.cells.iter().map(|c| c.policy.as_str()).collect();
    assert_eq!(
        order,
        ["round-robin", "session-affinity", "prefix-affinity"]
    );
    let g = |policy: &str| {
        let c = p.cells.iter().find(|c| c.policy == policy).unwrap();
        let s = c.goodput_rps.unwrap();
        (s.median, s.min, s.max, s.n)
    };
    // good requests in a 4 s window: SA 4/5/6, PA 7/8/8, RR 3/4/6
    assert_eq!(g("session-affinity"), (1.25, 1.0, 1.5, 3));
    assert_eq!(g("prefix-affinity"), (2.0, 1.75, 2.0, 3));
    assert_eq!(g("round-robin"), (1.0, 0.75, 1.5, 3));
}

#[test]
fn verdicts_winner_and_runner_up() {
    let r = report();
    let p = point(&r, "ws1-s0");
    let pa_sa = p.margin("prefix-affinity", "session-affinity").unwrap();
    assert!(close(pa_sa.margin_rps, 0.75));
    assert!(close(pa_sa.relative.unwrap(), 0.6));
    assert_eq!(pa_sa.verdict, Verdict::Separates);
    let rr_sa = p.margin("round-robin", "session-affinity").unwrap();
    assert!(close(rr_sa.margin_rps, -0.25));
    assert_eq!(rr_sa.verdict, Verdict::WithinSpread);
    assert_eq!(
        p.margin("prefix-affinity", "round-robin").unwrap().verdict,
        Verdict::Separates
    );
    assert_eq!(p.winner.as_ref().unwrap().policy, "prefix-affinity");
    assert_eq!(p.runner_up.as_ref().unwrap().policy, "session-affinity");
    assert_eq!(p.winner_verdict, Some(Verdict::Separates));
}

#[test]
fn set_aside_and_incomplete_reps_are_not_analysed() {
    let r = report();
    let p = point(&r, "ws1-s0");
    let pa = p
        .cells
        .iter()
        .find(|c| c.policy == "prefix-affinity")
        .unwrap();
    assert_eq!(pa.reps_used, [1, 2, 3]);
    assert_eq!(pa.set_aside.len(), 1);
    assert_eq!(pa.set_aside[0].rep, 4);
    assert!(pa.set_aside[0].reason.starts_with("warming"));
    // What it measured is shown beside the reason, and kept out of the cell's figures: the
    // fixture's rep-4 met the SLO on 2 of its 4 measured requests in a 4-s window.
    assert_eq!(pa.set_aside[0].goodput_rps, Some(0.5));
    assert_eq!(pa.set_aside[0].slo_attainment, Some(0.5));
    assert!(pa.reps.iter().all(|m| m.rep != 4));
    let rr = p.cells.iter().find(|c| c.policy == "round-robin").unwrap();
    assert_eq!(rr.reps_used, [1, 2, 3]);
    let inc: Vec<(u32, &str)> = r
        .incomplete
        .iter()
        .map(|i| (i.rep, i.reason.as_str()))
        .collect();
    assert_eq!(
        inc,
        [
            (4, "meta.json does not say \"complete\": true"),
            (5, "no meta.json")
        ]
    );
    // Both incomplete reps hold rows that would not parse: they were never read.
    assert!(r.incomplete.iter().all(|i| i.policy == "round-robin"));
}

#[test]
fn rep_metrics_by_hand() {
    let sweep = load_sweep(&common::fixtures().join("sweep-basic")).unwrap();
    let rep = sweep
        .reps
        .iter()
        .find(|r| r.point == "ws1-s0" && r.policy == "prefix-affinity" && r.rep == 1)
        .unwrap();
    let reqs = measured_requests(rep, &rep.meta.slo);
    // one warm-up row and one row sent after the window are left out
    assert_eq!(reqs.len(), 9);
    let m = rep_metrics(rep, &reqs, &Default::default());
    assert!(close(m.goodput_rps, 1.75));
    assert_eq!((m.latency.good, m.latency.errors), (7, 0));
    let all = &m.mechanism.all;
    // Σcached = 992 + 5·1024, Σprompt = 3·1100 + 4·1400 + 2·1700
    assert!(close(all.prefix_hit_rate.unwrap(), 6112.0 / 12300.0));
    assert!(close(
        all.new_tokens_per_request.unwrap(),
        (12300.0 - 6112.0) / 9.0
    ));
    // replicas 0, 1, 2 serve 3 requests each: the tie goes to the lowest id
    assert_eq!(all.busiest_replica, Some(0));
    assert!(close(all.busiest_share.unwrap(), 1.0 / 3.0));
    assert!(close(all.spill_rate.unwrap(), 1.0 / 9.0));
    // first turns: nothing cached; later turns: 6112 of 9000
    assert_eq!(m.mechanism.first_turn.prefix_hit_rate, Some(0.0));
    assert!(close(
        m.mechanism.later_turns.prefix_hit_rate.unwrap(),
        6112.0 / 9000.0
    ));
    assert_eq!(m.mechanism.first_turn.requests, 3);
    // s4 was spilled once: its two requests went to two replicas
    assert_eq!(m.mechanism.all.hot_conversations, 4);
    assert!(close(
        m.mechanism.all.replicas_per_hot_conversation.unwrap(),
        1.25
    ));
}

#[test]
fn slo_misses_by_bound_and_the_busiest_replicas_attainment() {
    let sweep = load_sweep(&common::fixtures().join("sweep-basic")).unwrap();
    let rep = sweep
        .reps
        .iter()
        .find(|r| r.point == "ws1-s0" && r.policy == "prefix-affinity" && r.rep == 1)
        .unwrap();
    let reqs = measured_requests(rep, &rep.meta.slo);
    let m = rep_metrics(rep, &reqs, &Default::default());
    // pr-r1-04 misses on TTFT (1,500 ms), pr-r1-06 on ITL (40 ms); nothing failed.
    let l = &m.latency;
    assert_eq!((l.missed_ttft, l.missed_itl, l.errors), (1, 1, 0));
    // TTFT of the 9 measured requests, type-7 p90: 8 × 0.9 = 7.2 → 390 + 0.2 × (1500 − 390).
    assert!(close(l.ttft_p90_ms.unwrap(), 612.0), "{:?}", l.ttft_p90_ms);
    // ITL p50s 8.1 … 8.9 and 40: p99 at 7.92 → 8.9 + 0.92 × (40 − 8.9).
    assert!(close(l.itl_p99_ms.unwrap(), 37.512), "{:?}", l.itl_p99_ms);
    // The busiest replica (tie of three → replica 0) served pr-r1-03, -04 and -08; -04 missed.
    assert!(close(m.busiest_replica_attainment.unwrap(), 2.0 / 3.0));
}

#[test]
fn a_point_where_every_policy_meets_its_slo_is_below_pressure() {
    let r = report();
    let p = point(&r, "ws1-s0");
    // Attainments at ws1-s0 are below 90% for every policy (SA's best rep: 6 of 9).
    assert!(!p.below_pressure);
    let mut cells = p.cells.clone();
    for c in &mut cells {
        let a = c.slo_attainment.as_mut().unwrap();
        (a.median, a.min, a.max) = (0.95, 0.9, 1.0);
    }
    assert!(analysis::report::below_pressure(&cells));
    // One policy under the target is pressure enough.
    cells[0].slo_attainment.as_mut().unwrap().median = 0.89;
    assert!(!analysis::report::below_pressure(&cells));
    // Nothing to judge is not "below pressure".
    assert!(!analysis::report::below_pressure(&[]));
}

#[test]
fn divergence_is_never_netted() {
    let r = report();
    let pa = point(&r, "ws1-s0")
        .cells
        .iter()
        .find(|c| c.policy == "prefix-affinity")
        .unwrap();
    let d = &pa.divergence;
    // rep-1 over-predicts one request by 32 tokens and under-predicts another by 32: the net is
    // zero, and both are still reported, each with its own count and size.
    assert_eq!((d.over.count, d.over.tokens_total), (1, 32));
    assert_eq!((d.under.count, d.under.tokens_total), (1, 32));
    assert_eq!(d.over.tokens_mean, Some(32.0));
    assert_eq!(d.under.tokens_mean, Some(32.0));
    // 9 + 10 + 10 successful measured requests (rep-2 has one error)
    assert_eq!(d.compared, 29);
    assert_eq!(d.exact, 27);
    // policies without belief have nothing to compare
    let sa = point(&r, "ws1-s0")
        .cells
        .iter()
        .find(|c| c.policy == "session-affinity")
        .unwrap();
    assert_eq!(sa.divergence.compared, 0);
}

#[test]
fn router_rows_are_optional() {
    let r = report();
    let p = point(&r, "ws3-s1");
    let rr = p.cells.iter().find(|c| c.policy == "round-robin").unwrap();
    assert!(rr.reps.iter().all(|m| !m.has_router_rows));
    assert_eq!(rr.mechanism.all.busiest_share, None);
    assert_eq!(rr.overhead_p50_us, None);
    // the hit rate comes from the client rows alone
    assert_eq!(rr.mechanism.all.prefix_hit_rate.unwrap().median, 0.0);
    assert!(r.overhead_by_policy.iter().all(|o| o.overhead.requests > 0));
}

#[test]
fn adaptive_router_test_names_the_beating_point() {
    let r = report();
    let t = &r.adaptive_router_test;
    assert_eq!(t.points_tested, ["ws1-s0", "ws3-s1"]);
    assert_eq!(t.beats.len(), 1);
    assert_eq!(t.beats[0].point, "ws3-s1");
    assert_eq!(t.beats[0].margin.policy, "round-robin");
    assert!(close(t.beats[0].margin.margin_rps, 0.75));
}

#[test]
fn golden_report() {
    let r = report();
    let json = serde_json::to_string_pretty(&r).unwrap() + "\n";
    common::assert_golden("sweep-basic.report.json", &json);
    common::assert_golden("sweep-basic.report.md", &markdown::render(&r));
    // the JSON reads back into the same report: field names are what the figures crate reads
    let back: Report = serde_json::from_str(&json).unwrap();
    common::assert_same_text(
        &json,
        &(serde_json::to_string_pretty(&back).unwrap() + "\n"),
    );
}

/// Copies a directory tree, gzip-compressing every `client.csv` / `router.csv` on the way (the
/// form rows are published in under docs/measurements).
fn copy_compressing(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().into_string().unwrap();
        let src = entry.path();
        if entry.file_type().unwrap().is_dir() {
            copy_compressing(&src, &to.join(&name));
        } else if name == "client.csv" || name == "router.csv" {
            let out = std::fs::File::create(to.join(format!("{name}.gz"))).unwrap();
            let mut gz = flate2::write::GzEncoder::new(out, flate2::Compression::default());
            std::io::Write::write_all(&mut gz, &std::fs::read(&src).unwrap()).unwrap();
            gz.finish().unwrap();
        } else {
            std::fs::copy(&src, to.join(&name)).unwrap();
        }
    }
}

#[test]
fn compressed_rows_give_the_same_report() {
    let dir = test_support::temp_dir("analysis-gz");
    copy_compressing(&common::fixtures().join("sweep-basic"), dir.path());
    let gz = analyze_dir(dir.path(), &ReportConfig::default());
    let (gz, plain) = (gz.unwrap(), report());
    assert!(!gz.points.is_empty());
    // The title names the directory; every number and verdict after it must be the same.
    let body = |r: &Report| {
        let text = markdown::render(r);
        text.split_once('\n')
            .map(|(_, rest)| rest.to_string())
            .unwrap_or_default()
    };
    assert_eq!(body(&gz), body(&plain));
}
