//! Rows recorded from the real binaries (two emulated engines behind the router, the closed-loop
//! driver; see fixtures/analysis/README.md): the readers accept what the writers write, every
//! measured request joins its router row, and the figures are of the right kind.

mod common;

use analysis::{ReportConfig, Verdict, analyze_dir};

#[test]
fn real_rows_load_join_and_analyse() {
    let r = analyze_dir(
        &common::fixtures().join("recorded-live"),
        &ReportConfig::default(),
    )
    .unwrap();
    assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    assert!(r.refused.is_empty() && r.incomplete.is_empty());
    let p = &r.points[0];
    assert_eq!(p.workload_name, "chat-n8-s0-t5-p1100-u150-o128-seed7");
    assert_eq!(p.cells.len(), 2);
    for c in &p.cells {
        assert_eq!(c.reps_used, [1, 2]);
        for m in &c.reps {
            assert!(m.has_router_rows);
            assert_eq!(m.unjoined_requests, 0);
            // 56 requests sent after the 1 s warm-up, all inside the window
            assert_eq!(m.latency.requests, 56);
            assert_eq!(m.latency.errors, 0);
            let (first, later) = (
                m.mechanism.first_turn.prefix_hit_rate.unwrap(),
                m.mechanism.later_turns.prefix_hit_rate.unwrap(),
            );
            // a conversation's later turns reuse its own history
            assert!(later > first && later > 0.9, "{first} {later}");
            assert_eq!(m.mechanism.all.spill_rate, Some(0.0));
            assert!(m.overhead.overhead_p50_us.unwrap() > 0.0);
        }
    }
    let sa = p
        .cells
        .iter()
        .find(|c| c.policy == "session-affinity")
        .unwrap();
    // session-affinity writes a predicted match of 0: no belief, nothing to compare
    assert_eq!(sa.divergence.compared, 0);
    assert_eq!(sa.implied.honoured_share, None);
    let pa = p
        .cells
        .iter()
        .find(|c| c.policy == "prefix-affinity")
        .unwrap();
    let d = &pa.divergence;
    assert!(d.compared > 100);
    assert_eq!(d.over.count + d.under.count + d.exact, d.compared);
    assert!(pa.decay.overall.honoured_share.unwrap() > 0.9);
    let m = p.margin("prefix-affinity", "session-affinity").unwrap();
    assert_ne!(m.verdict, Verdict::TooFewReps);
}
