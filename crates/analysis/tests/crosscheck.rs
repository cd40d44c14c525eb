//! The live/virtual cross-check on the recorded sweep-basic fixture: a report agrees with itself,
//! and every way the two sides can part — a cell's goodput, its attainment, an effect's size or
//! direction, the SLO they are judged by — is caught at the effect-sized bounds; a difference
//! inside the cells' own repetition spread is judged at that spread and says so.

use analysis::crosscheck::{
    CellCheck, Crosscheck, EffectCheck, Tolerance, crosscheck, render_markdown,
};
use analysis::{Report, ReportConfig, analyze_dir};

mod common;

fn recorded() -> Report {
    analyze_dir(
        &common::fixtures().join("sweep-basic"),
        &ReportConfig::default(),
    )
    .unwrap()
}

/// The recorded report with every goodput and attainment spread collapsed to its median, as
/// one repetition a side reports it: the tolerance alone judges.
fn live() -> Report {
    let mut r = recorded();
    for p in &mut r.points {
        for c in &mut p.cells {
            for s in [c.goodput_rps.as_mut(), c.slo_attainment.as_mut()]
                .into_iter()
                .flatten()
            {
                s.min = s.median;
                s.max = s.median;
            }
        }
    }
    r
}

fn as_virtual(r: &Report) -> Report {
    let mut v = r.clone();
    for p in &mut v.points {
        p.virtual_time = true;
    }
    v
}

/// Cross-checks at the effect-sized tolerance against session-affinity.
fn check(live: &Report, virt: &Report) -> Crosscheck {
    crosscheck(live, virt, "session-affinity", Tolerance::EFFECT_SIZED)
}

/// The compared cell at `point` for `policy`.
fn cell_of<'a>(c: &'a Crosscheck, point: &str, policy: &str) -> &'a CellCheck {
    c.cells
        .iter()
        .find(|x| x.point == point && x.policy == policy)
        .unwrap()
}

/// The compared effect of `policy` at `point`.
fn effect_of<'a>(c: &'a Crosscheck, point: &str, policy: &str) -> &'a EffectCheck {
    c.effects
        .iter()
        .find(|e| e.point == point && e.policy == policy)
        .unwrap()
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
    let c = check(&l, &as_virtual(&l));
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
    let c = check(&l, &v);
    assert!(!c.passes());
    let cell = cell_of(&c, "ws1-s0", "prefix-affinity");
    assert!(!cell.agrees);
    let rel = cell.goodput_rel_diff.unwrap();
    assert!((rel - (1.0 / 1.05 - 1.0)).abs() < 1e-9, "{rel}");
    let effect = effect_of(&c, "ws1-s0", "prefix-affinity");
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
    let c = check(&l, &v);
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
    let x = check(&l, &v);
    let cell = cell_of(&x, "ws1-s0", "session-affinity");
    assert!(!cell.agrees);
    assert!(!x.passes());
}

#[test]
fn unlike_points_are_refused_not_compared() {
    let l = live();
    let mut v = as_virtual(&l);
    v.points[0].slo.ttft_ms *= 2.0;
    v.points[1].plan_fingerprint = "0000000000000000".into();
    let c = check(&l, &v);
    assert_eq!(c.refused.len(), 2, "{:?}", c.refused);
    assert!(c.refused[0].reason.contains("SLO differs"));
    assert!(c.refused[1].reason.contains("plan_fingerprint differs"));
    assert!(c.cells.is_empty());
    assert!(!c.passes());
    // A live report on the virtual side is refused too.
    let c = check(&l, &l);
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
    let c = check(&l, &v);
    let e = effect_of(&c, "ws1-s0", "prefix-affinity");
    assert!(!e.same_direction, "{e:?}");
    assert!(!e.agrees);
}

#[test]
fn a_point_measured_by_another_clock_is_refused() {
    let l = live();
    let mut v = as_virtual(&l);
    v.points[0].window_clock = schema::WindowClock::Scheduled;
    let c = check(&l, &v);
    assert_eq!(c.refused.len(), 1, "{:?}", c.refused);
    assert!(c.refused[0].reason.contains("window clock differs"));
}

#[test]
fn a_difference_inside_the_repetitions_spread_is_judged_at_that_spread() {
    let mut l = live();
    let mut v = as_virtual(&l);
    // Live prefix-affinity 4% below virtual, each side's repetitions spreading 5% of the
    // virtual median (the size measured for prefix-affinity near capacity): not a disagreement
    // at this resolution, and the report says which resolution judged it.
    let spread = |r: &mut Report, f: f64, half: f64| {
        let p = r.points.iter_mut().find(|p| p.point == "ws1-s0").unwrap();
        let c = p
            .cells
            .iter_mut()
            .find(|c| c.policy == "prefix-affinity")
            .unwrap();
        let g = c.goodput_rps.as_mut().unwrap();
        let m = g.median;
        g.median = m * f;
        g.min = m * (f - half);
        g.max = m * (f + half);
    };
    spread(&mut l, 0.96, 0.025);
    spread(&mut v, 1.0, 0.025);
    let c = check(&l, &v);
    let cell = cell_of(&c, "ws1-s0", "prefix-affinity");
    assert!(
        (cell.goodput_resolution_rel - 0.05).abs() < 1e-9,
        "{cell:?}"
    );
    assert!(cell.agrees, "{cell:?}");
    let effect = effect_of(&c, "ws1-s0", "prefix-affinity");
    // The 5% resolution carried into a margin of +60%: 1.6 × 5% = 8 points.
    assert!(
        (effect.bound_abs - (1.0 + effect.virtual_rel) * 0.05).abs() < 1e-9,
        "{effect:?}"
    );
    assert!(effect.agrees, "{effect:?}");
    assert!(c.passes(), "{}", render_markdown(&c));
    assert!(render_markdown(&c).contains("widest cell resolution 5.0%"));

    // 7% apart at the same spread: beyond the resolution, a disagreement.
    let mut l = live();
    spread(&mut l, 0.93, 0.025);
    let c = check(&l, &v);
    assert!(!c.passes(), "{}", render_markdown(&c));
}

#[test]
fn an_effect_no_larger_than_its_bound_is_not_called_resolved() {
    let l = live();
    let c = check(&l, &as_virtual(&l));
    for e in &c.effects {
        assert_eq!(e.resolved, e.virtual_rel.abs() > e.bound_abs, "{e:?}");
    }
}
