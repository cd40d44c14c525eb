//! The live/virtual cross-check on the recorded sweep-basic fixture: a report agrees with itself,
//! and every way the two sides can part — a cell's goodput, its attainment, an effect's size or
//! direction, the SLO they are judged by — is caught at the effect-sized bounds.

use analysis::crosscheck::{Tolerance, crosscheck, render_markdown};
use analysis::{Report, ReportConfig, analyze_dir};

mod common;

fn live() -> Report {
    analyze_dir(
        &common::fixtures().join("sweep-basic"),
        &ReportConfig::default(),
    )
    .unwrap()
}

fn as_virtual(r: &Report) -> Report {
    let mut v = r.clone();
    for p in &mut v.points {
        p.virtual_time = true;
    }
    v
}

/// Multiplies one cell's goodput (median, min, max) by `f`.
fn scale_goodput(r: &mut Report, point: &str, policy: &str, f: f64) {
    let p = r.points.iter_mut().find(|p| p.point == point).unwrap();
    let c = p.cells.iter_mut().find(|c| c.policy == policy).unwrap();
    let g = c.goodput_rps.as_mut().unwrap();
    g.median *= f;
    g.min *= f;
    g.max *= f;
}

#[test]
fn a_report_agrees_with_itself() {
    let l = live();
    let c = crosscheck(
        &l,
        &as_virtual(&l),
        "session-affinity",
        Tolerance::EFFECT_SIZED,
    );
    assert!(c.passes(), "{}", render_markdown(&c));
    assert!(c.refused.is_empty());
    // Both fixture points hold session-affinity and prefix-affinity: cells and effects exist.
    assert!(c.cells.len() >= 4, "{:?}", c.cells);
    assert!(c.effects.iter().any(|e| e.policy == "prefix-affinity"));
    assert_eq!(c.worst_goodput_rel_diff(), Some(0.0));
}

#[test]
fn a_goodput_gap_larger_than_the_effects_fails_the_cell_and_the_effect() {
    let l = live();
    let mut v = as_virtual(&l);
    // 5% more virtual goodput for prefix-affinity: inside the old 10% bound, outside 3%.
    scale_goodput(&mut v, "ws1-s0", "prefix-affinity", 1.05);
    let c = crosscheck(&l, &v, "session-affinity", Tolerance::EFFECT_SIZED);
    assert!(!c.passes());
    let cell = c
        .cells
        .iter()
        .find(|x| x.point == "ws1-s0" && x.policy == "prefix-affinity")
        .unwrap();
    assert!(!cell.agrees);
    let rel = cell.goodput_rel_diff.unwrap();
    assert!((rel - (1.0 / 1.05 - 1.0)).abs() < 1e-9, "{rel}");
    let effect = c
        .effects
        .iter()
        .find(|e| e.point == "ws1-s0" && e.policy == "prefix-affinity")
        .unwrap();
    assert!(!effect.agrees, "{effect:?}");
    // The other point is untouched.
    assert!(
        c.cells
            .iter()
            .filter(|x| x.point == "ws3-s1")
            .all(|x| x.agrees)
    );
    assert!(render_markdown(&c).contains("does not agree"));
}

#[test]
fn a_small_shift_of_both_policies_keeps_the_effect() {
    let l = live();
    let mut v = as_virtual(&l);
    // Both policies 2% faster virtually: every cell within 3%, every margin unchanged.
    for policy in ["session-affinity", "prefix-affinity", "round-robin"] {
        scale_goodput(&mut v, "ws1-s0", policy, 1.02);
    }
    let c = crosscheck(&l, &v, "session-affinity", Tolerance::EFFECT_SIZED);
    assert!(c.passes(), "{}", render_markdown(&c));
    for e in c.effects.iter().filter(|e| e.point == "ws1-s0") {
        assert!((e.live_rel - e.virtual_rel).abs() < 1e-9, "{e:?}");
    }
}

#[test]
fn attainment_apart_fails_the_cell() {
    let l = live();
    let mut v = as_virtual(&l);
    let p = v.points.iter_mut().find(|p| p.point == "ws1-s0").unwrap();
    let c = p
        .cells
        .iter_mut()
        .find(|c| c.policy == "session-affinity")
        .unwrap();
    let a = c.slo_attainment.as_mut().unwrap();
    a.median = (a.median - 0.05).max(0.0);
    let x = crosscheck(&l, &v, "session-affinity", Tolerance::EFFECT_SIZED);
    let cell = x
        .cells
        .iter()
        .find(|c| c.point == "ws1-s0" && c.policy == "session-affinity")
        .unwrap();
    assert!(!cell.agrees);
    assert!(!x.passes());
}

#[test]
fn unlike_points_are_refused_not_compared() {
    let l = live();
    let mut v = as_virtual(&l);
    v.points[0].slo.ttft_ms *= 2.0;
    v.points[1].plan_fingerprint = "0000000000000000".into();
    let c = crosscheck(&l, &v, "session-affinity", Tolerance::EFFECT_SIZED);
    assert_eq!(c.refused.len(), 2, "{:?}", c.refused);
    assert!(c.refused[0].reason.contains("SLO differs"));
    assert!(c.refused[1].reason.contains("plan_fingerprint differs"));
    assert!(c.cells.is_empty());
    assert!(!c.passes());
    // A live report on the virtual side is refused too.
    let c = crosscheck(&l, &l, "session-affinity", Tolerance::EFFECT_SIZED);
    assert!(c.refused.iter().all(|r| r.reason.contains("live")));
}

#[test]
fn opposite_directions_are_named() {
    let l = live();
    let mut v = as_virtual(&l);
    let p = l.points.iter().find(|p| p.point == "ws1-s0").unwrap();
    let g = |policy: &str| {
        p.cells
            .iter()
            .find(|c| c.policy == policy)
            .unwrap()
            .goodput_rps
            .as_ref()
            .unwrap()
            .median
    };
    // Make virtual prefix-affinity beat session-affinity by as much as live trails it (or the
    // reverse), plus 10%.
    let live_rel = (g("prefix-affinity") - g("session-affinity")) / g("session-affinity");
    let target = if live_rel >= 0.0 {
        -0.1 - live_rel
    } else {
        0.1 - live_rel
    };
    scale_goodput(
        &mut v,
        "ws1-s0",
        "prefix-affinity",
        (1.0 + target) * g("session-affinity") / g("prefix-affinity"),
    );
    let c = crosscheck(&l, &v, "session-affinity", Tolerance::EFFECT_SIZED);
    let e = c
        .effects
        .iter()
        .find(|e| e.point == "ws1-s0" && e.policy == "prefix-affinity")
        .unwrap();
    assert!(!e.same_direction, "{e:?}");
    assert!(!e.agrees);
}

#[test]
fn a_point_measured_by_another_clock_is_refused() {
    let l = live();
    let mut v = as_virtual(&l);
    v.points[0].window_clock = schema::WindowClock::Scheduled;
    let c = crosscheck(&l, &v, "session-affinity", Tolerance::EFFECT_SIZED);
    assert_eq!(c.refused.len(), 1, "{:?}", c.refused);
    assert!(c.refused[0].reason.contains("window clock differs"));
}
