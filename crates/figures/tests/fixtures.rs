//! Every figure renders from the fixture measurements (`fixtures/figures/`), its CSV matches the
//! golden file, and missing or mismatched data fails with a message naming what is missing.
//!
//! Regenerate the goldens deliberately with `UPDATE_GOLDEN=1 cargo test -p figures --test
//! fixtures`, then review the diff. The same variable rewrites the fixture capacity report
//! (`fixtures/figures/pressure-grid-virtual-policy-capacity/policy-capacity.json`) from
//! [`capacity_fixture`] through `analysis::capacity::report`.

use std::path::{Path, PathBuf};

use analysis::capacity::{CapacityReport, SeedCapacity};
use figures::{FigureId, Sources, render, render_all};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/figures")
}

/// A fresh scratch directory per test (tests run in parallel; names keep them apart).
fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("figures-{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}

/// A private copy of the fixture measurements to break.
fn measurements_copy(name: &str) -> PathBuf {
    let root = scratch(name).join("measurements");
    for sweep in [
        "pressure-grid",
        "fault-kill",
        "load",
        "routers",
        "trace-quick",
        CAPACITY_SWEEP,
    ] {
        copy_tree(&fixtures().join(sweep), &root.join(sweep));
    }
    root
}

fn render_err(measurements: &Path, which: &[FigureId], name: &str) -> String {
    let out = scratch(&format!("{name}-out"));
    let err = render(&Sources::discover(measurements), &out, which).unwrap_err();
    format!("{err:#}")
}

fn png_size(bytes: &[u8]) -> (u32, u32) {
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
    let be = |o: usize| u32::from_be_bytes(bytes[o..o + 4].try_into().unwrap());
    (be(16), be(20))
}

/// The fixture's per-policy capacity report, under the name [`Sources::discover`] looks for first.
const CAPACITY_SWEEP: &str = "pressure-grid-virtual-policy-capacity";

/// The fixture capacity searches: the fixture grid's four points, four policies, seeds 7, 8, 9,
/// each failing rate 4% above its capacity. Designed so that every verdict the figures mark
/// appears:
///
/// | point | what it shows |
/// |---|---|
/// | ws1-s0 | prefix-affinity separates below session-affinity (×0.879); exact-residency best, within spread of session-affinity (runner-up) |
/// | ws1-s1.4 | all four tied at 1.25 |
/// | ws3-s0 | exact-residency best, separating from session-affinity and from the runner-up prefix-affinity |
/// | ws3-s1.4 | prefix-affinity within resolution of session-affinity (ranges apart, medians 2.9% apart); round-robin's seed 8 unbracketed, so no best |
fn capacity_fixture() -> CapacityReport {
    let seeds = |caps: [f64; 3]| -> Vec<SeedCapacity> {
        caps.iter()
            .zip(7..)
            .map(|(&c, seed)| SeedCapacity {
                seed,
                capacity_rps: Some(c),
                failing_rps: Some((c * 1.04 * 1000.0).round() / 1000.0),
                steps: 7,
                unbracketed: None,
            })
            .collect()
    };
    let mut rr_unbracketed = seeds([1.3, 0.0, 1.35]);
    rr_unbracketed[1] = SeedCapacity {
        seed: 8,
        capacity_rps: None,
        failing_rps: Some(0.5),
        steps: 6,
        unbracketed: Some("met the SLO at no rate tried, down to 0.5 req/s".into()),
    };
    let point = |name: &str, rr, sa, pa, er| {
        (
            name.to_string(),
            vec![
                ("round-robin".to_string(), rr),
                ("session-affinity".to_string(), seeds(sa)),
                ("prefix-affinity".to_string(), seeds(pa)),
                ("exact-residency".to_string(), seeds(er)),
            ],
        )
    };
    analysis::capacity::report(
        "pressure-grid-virtual",
        "virtual time (fixture: the simulator; one fleet, 3 replicas), each step an open-loop cell",
        "session-affinity",
        0.05,
        &[7, 8, 9],
        vec![
            point(
                "ws1-s0",
                seeds([4.5, 4.6, 4.4]),
                [9.0, 9.3, 9.1],
                [8.0, 8.2, 7.8],
                [9.2, 9.0, 9.4],
            ),
            point(
                "ws1-s1.4",
                seeds([1.25, 1.1, 1.3]),
                [1.2, 1.25, 1.3],
                [1.25, 1.2, 1.3],
                [1.25, 1.2, 1.28],
            ),
            point(
                "ws3-s0",
                seeds([4.1, 4.0, 4.2]),
                [2.7, 2.2, 3.0],
                [4.3, 4.4, 4.2],
                [5.0, 5.2, 5.1],
            ),
            point(
                "ws3-s1.4",
                rr_unbracketed,
                [1.36, 1.37, 1.38],
                [1.40, 1.42, 1.41],
                [1.5, 1.6, 1.55],
            ),
        ],
    )
}

#[test]
fn the_capacity_fixture_is_what_the_analysis_crate_writes() {
    let path = fixtures()
        .join(CAPACITY_SWEEP)
        .join(figures::input::CAPACITY_FILE);
    let mut want = capacity_fixture();
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, serde_json::to_string_pretty(&want).unwrap()).unwrap();
    }
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (UPDATE_GOLDEN=1 writes it)", path.display()));
    let got: CapacityReport = serde_json::from_str(&text).unwrap();
    // The rules version moves with the analysis crate; the searches and verdicts must not.
    want.rules = got.rules.clone();
    assert_eq!(
        got,
        want,
        "{} is not what analysis::capacity::report makes of the fixture searches (UPDATE_GOLDEN=1 rewrites it)",
        path.display()
    );
    let p = |name: &str| got.points.iter().find(|p| p.point == name).unwrap();
    let verdict = |point: &str, policy: &str| {
        p(point)
            .margins
            .iter()
            .find(|m| m.policy == policy)
            .unwrap()
            .verdict
            .as_str()
    };
    // the design in `capacity_fixture`'s table
    assert_eq!(verdict("ws1-s0", "prefix-affinity"), "separates");
    assert_eq!(verdict("ws1-s0", "exact-residency"), "within spread");
    assert_eq!(p("ws1-s0").best, ["exact-residency"]);
    assert_eq!(p("ws1-s1.4").best.len(), 4);
    assert_eq!(p("ws3-s0").best, ["exact-residency"]);
    assert_eq!(verdict("ws3-s1.4", "prefix-affinity"), "within resolution");
    assert!(p("ws3-s1.4").best.is_empty());
}

#[test]
fn all_ten_render_from_fixtures_and_their_data_match_the_goldens() {
    let out = scratch("all").join("out");
    let files = render_all(&fixtures(), &out).unwrap();
    assert_eq!(files.len(), 30, "{files:?}");
    let update = std::env::var_os("UPDATE_GOLDEN").is_some();
    let golden_dir = fixtures().join("golden");
    let titles = [
        "Pressure map",
        "Winners map",
        "Mechanism",
        "Knowledge ladder",
        "Belief",
        "Fault timeline",
        "Load curve",
        "N routers",
        "Trace replay",
        "Policy capacity",
    ];
    for (fig, title) in FigureId::ALL.iter().zip(titles) {
        let base = out.join(fig.stem());
        let png = std::fs::read(base.with_extension("png")).unwrap();
        let (w, h) = png_size(&png);
        assert!(w >= 1000 && h >= 800, "{fig}: {w}×{h}");
        // a blank canvas compresses to almost nothing; a drawn figure does not
        assert!(png.len() > 20_000, "{fig}: PNG only {} bytes", png.len());
        let svg = std::fs::read_to_string(base.with_extension("svg")).unwrap();
        assert!(svg.contains(title), "{fig}: SVG lacks its title `{title}`");
        for context in [
            "pressure-grid",
            "emulated fleet, 3 replicas",
            "TTFT &lt; 990 ms",
        ] {
            let own_sweep = matches!(
                fig,
                FigureId::FaultTimeline
                    | FigureId::LoadCurve
                    | FigureId::Routers
                    | FigureId::TraceReplay
            );
            if *fig == FigureId::PolicyCapacity {
                // drawn from the capacity report alone: its sweep, seeds and resolution
                continue;
            }
            if !own_sweep || context != "pressure-grid" {
                assert!(svg.contains(context), "{fig}: SVG lacks `{context}`");
            }
        }
        if fig.needs_capacity() {
            for context in [
                "sweep pressure-grid-virtual",
                "3 plan seeds (7, 8, 9)",
                "resolution 5%",
                "Held equal",
            ] {
                assert!(svg.contains(context), "{fig}: SVG lacks `{context}`");
            }
        }
        let csv = std::fs::read_to_string(base.with_extension("csv")).unwrap();
        let golden = golden_dir.join(format!("{}.csv", fig.stem()));
        if update {
            std::fs::create_dir_all(&golden_dir).unwrap();
            std::fs::write(&golden, &csv).unwrap();
        }
        let want = std::fs::read_to_string(&golden)
            .unwrap_or_else(|e| panic!("{}: {e} (UPDATE_GOLDEN=1 writes it)", golden.display()));
        assert_eq!(csv, want, "{fig}: data differs from {}", golden.display());
    }
}

#[test]
fn pressure_map_names_the_point_without_session_affinity() {
    let m = measurements_copy("no-sa");
    std::fs::remove_dir_all(m.join("pressure-grid/ws1-s1.4/session-affinity")).unwrap();
    let err = render_err(&m, &[FigureId::PressureMap, FigureId::WinnersMap], "no-sa");
    assert!(
        err.contains("2 of 2 figures not drawn"),
        "both need the cell: {err}"
    );
    assert!(
        err.contains("point `ws1-s1.4` has no session-affinity goodput"),
        "{err}"
    );
    assert!(
        err.contains("point `ws1-s1.4` has fewer than two policies"),
        "{err}"
    );
}

/// Marks every repetition of `<point>/<policy>` as set aside by the drift check.
fn set_aside(m: &Path, point: &str, policy: &str) {
    let dir = m.join("pressure-grid").join(point).join(policy);
    for rep in std::fs::read_dir(&dir).unwrap() {
        let meta = rep.unwrap().path().join("meta.json");
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&meta).unwrap()).unwrap();
        v["accepted"] = false.into();
        v["set_aside_reason"] = "drifted twice: warming: TTFT trends up by 50%".into();
        std::fs::write(&meta, v.to_string()).unwrap();
    }
}

#[test]
fn cells_whose_reps_were_all_set_aside_are_drawn_as_such_not_refused() {
    let m = measurements_copy("set-aside");
    set_aside(&m, "ws1-s0", "session-affinity");
    set_aside(&m, "ws1-s0", "prefix-affinity-spill-off");
    set_aside(&m, "ws3-s1.4", "exact-residency");
    let out = scratch("set-aside-out");
    let which = [
        FigureId::PressureMap,
        FigureId::WinnersMap,
        FigureId::Mechanism,
        FigureId::KnowledgeLadder,
    ];
    render(&Sources::discover(&m), &out, &which).unwrap();
    let csv =
        |f: FigureId| std::fs::read_to_string(out.join(f.stem()).with_extension("csv")).unwrap();
    let svg =
        |f: FigureId| std::fs::read_to_string(out.join(f.stem()).with_extension("svg")).unwrap();
    let fig1 = csv(FigureId::PressureMap);
    assert!(
        fig1.lines()
            .any(|l| l == "fixed-rate,ws1-s0,1,0,,,,,,,,no accepted reps,,,,,"),
        "the set-aside point is a row saying so: {fig1}"
    );
    assert!(
        fig1.lines()
            .any(|l| l.starts_with("fixed-rate,ws3-s1.4,3,1.4,")),
        "{fig1}"
    );
    assert!(svg(FigureId::PressureMap).contains("all reps set aside:"));
    let fig3 = csv(FigureId::Mechanism);
    assert!(
        !fig3.contains("ws1-s0,prefix-affinity-spill-off")
            && !fig3.contains("ws1-s0,session-affinity"),
        "{fig3}"
    );
    assert!(fig3.contains("ws1-s0,prefix-affinity,"), "{fig3}");
    assert!(svg(FigureId::Mechanism).contains("ws1-s0 prefix-affinity-spill-off"));
    let fig4 = csv(FigureId::KnowledgeLadder);
    assert!(!fig4.contains("ws3-s1.4,exact-residency,"), "{fig4}");
    assert!(svg(FigureId::KnowledgeLadder).contains("ws3-s1.4 exact-residency"));
}

#[test]
fn the_heatmaps_state_both_sides_attainment_and_flag_points_below_pressure() {
    let mut grid = figures::input::load_grid(&fixtures().join("pressure-grid")).unwrap();
    let capacity = figures::load_capacity(&fixtures().join(CAPACITY_SWEEP)).unwrap();
    // ws1-s0 as a point where every policy met its SLO: the report's flag, set by hand
    let p = grid
        .report
        .points
        .iter_mut()
        .find(|p| p.point == "ws1-s0")
        .unwrap();
    p.below_pressure = true;
    let out = scratch("below-pressure-out");
    for fig in [FigureId::PressureMap, FigureId::WinnersMap] {
        figures::render_one(fig, figures::Input::Maps(&grid, &capacity), &out).unwrap();
        let err = figures::render_one(fig, figures::Input::Grid(&grid), &out).unwrap_err();
        assert!(
            err.to_string().contains("a per-policy capacity report"),
            "{err}"
        );
    }
    let read = |f: FigureId, ext: &str| {
        std::fs::read_to_string(out.join(f.stem()).with_extension(ext)).unwrap()
    };
    let fig1 = read(FigureId::PressureMap, "csv");
    // prefix-affinity 19 of 24 measured requests within the SLO, session-affinity 13 of 24
    assert!(
        fig1.lines().any(|l| l.starts_with("fixed-rate,ws1-s0,")
            && l.ends_with(",0.7916666666666667,0.5416666666666667,true")),
        "{fig1}"
    );
    assert!(
        fig1.lines()
            .filter(|l| !l.starts_with("panel,"))
            .filter(|l| l.ends_with(",true"))
            .count()
            == 1,
        "only the flagged point is below pressure: {fig1}"
    );
    let svg1 = read(FigureId::PressureMap, "svg");
    assert!(svg1.contains("SLO met: PA 79% · SA 54%"), "{svg1}");
    assert_eq!(svg1.matches("\nbelow pressure\n").count(), 1, "{svg1}");
    let fig2 = read(FigureId::WinnersMap, "csv");
    assert!(
        fig2.lines().any(
            |l| l.starts_with("fixed-rate,ws1-s0,1,0,exact-residency-spec,")
                && l.ends_with(",0.9583333333333333,0.7916666666666667,true")
        ),
        "{fig2}"
    );
    let svg2 = read(FigureId::WinnersMap, "svg");
    assert!(svg2.contains("2.88 req/s, SLO met 96%"), "{svg2}");
    assert!(
        svg2.contains("runner-up: prefix-affinity 2.38 (79%)"),
        "{svg2}"
    );
    assert_eq!(svg2.matches("\nbelow pressure\n").count(), 1, "{svg2}");
}

#[test]
fn mechanism_needs_the_spill_off_arm() {
    let m = measurements_copy("no-spill-off");
    for p in ["ws1-s0", "ws3-s1.4"] {
        std::fs::remove_dir_all(
            m.join("pressure-grid")
                .join(p)
                .join("prefix-affinity-spill-off"),
        )
        .unwrap();
    }
    let err = render_err(&m, &[FigureId::Mechanism], "no-spill-off");
    assert!(
        err.contains("figure 3 (mechanism): missing data")
            && err.contains("`prefix-affinity-spill-off`"),
        "{err}"
    );
}

#[test]
fn knowledge_ladder_names_the_missing_rung() {
    let m = measurements_copy("no-exact");
    std::fs::remove_dir_all(m.join("pressure-grid/ws3-s1.4/exact-residency")).unwrap();
    let err = render_err(&m, &[FigureId::KnowledgeLadder], "no-exact");
    assert!(
        err.contains("point `ws3-s1.4` has no exact-residency goodput"),
        "{err}"
    );
    assert!(!err.contains("ws1-s0"), "ws1-s0 is complete: {err}");
}

#[test]
fn belief_needs_predicted_tokens() {
    let m = measurements_copy("no-predicted");
    // router rows without a predicted match: nothing to compare, no decay
    for e in walk(&m.join("pressure-grid")) {
        if e.file_name().is_some_and(|n| n == "router.csv") {
            let text = std::fs::read_to_string(&e).unwrap();
            let blanked: Vec<String> = text
                .lines()
                .enumerate()
                .map(|(i, l)| {
                    if i == 0 {
                        return l.to_string();
                    }
                    let mut f: Vec<&str> = l.split(',').collect();
                    f[6] = "";
                    f.join(",")
                })
                .collect();
            std::fs::write(&e, blanked.join("\n") + "\n").unwrap();
        }
    }
    let err = render_err(&m, &[FigureId::Belief], "no-predicted");
    assert!(err.contains("figure 5"), "{err}");
    assert!(err.contains("predicted_match_tokens"), "{err}");
    assert!(err.contains("decay band"), "{err}");
}

fn walk(d: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(d).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[test]
fn mismatched_plans_are_refused_with_the_cells_named() {
    let m = measurements_copy("mismatch");
    let meta = m.join("pressure-grid/ws3-s0/prefix-affinity/rep-2/meta.json");
    let text = std::fs::read_to_string(&meta)
        .unwrap()
        .replace("pf-ws3-s0", "pf-other");
    std::fs::write(&meta, text).unwrap();
    let err = render_err(&m, &[FigureId::PressureMap], "mismatch");
    assert!(err.contains("mismatched data"), "{err}");
    assert!(
        err.contains("plan_fingerprint") && err.contains("prefix-affinity/rep-2"),
        "{err}"
    );
}

#[test]
fn mismatched_fleets_are_refused() {
    let m = measurements_copy("fleet");
    let meta = m.join("pressure-grid/ws1-s0/prefix-hash/rep-1/meta.json");
    let text = std::fs::read_to_string(&meta)
        .unwrap()
        .replace("\"replicas\": 3", "\"replicas\": 4");
    std::fs::write(&meta, text).unwrap();
    let err = render_err(&m, &[FigureId::WinnersMap], "fleet");
    assert!(
        err.contains("mismatched fleets") && err.contains("ws1-s0/prefix-hash/rep-1"),
        "{err}"
    );
}

#[test]
fn the_cpu_spinners_field_is_not_a_different_fleet() {
    // Repetitions measured before meta.json recorded `keep_awake_threads` sit beside ones that
    // record it; the same fleet either way.
    let m = measurements_copy("spinners");
    let meta = m.join("pressure-grid/ws1-s0/prefix-hash/rep-1/meta.json");
    let text = std::fs::read_to_string(&meta).unwrap();
    assert!(
        text.contains("\"replicas\": 3"),
        "fixture changed: {meta:?}"
    );
    std::fs::write(
        &meta,
        text.replace(
            "\"replicas\": 3",
            "\"keep_awake_threads\": 2, \"replicas\": 3",
        ),
    )
    .unwrap();
    let out = scratch("spinners-out");
    let files = render(&Sources::discover(&m), &out, &[FigureId::WinnersMap]).unwrap();
    assert_eq!(files.len(), 3, "{files:?}");
    // A real difference beside it is still refused.
    let text = std::fs::read_to_string(&meta)
        .unwrap()
        .replace("\"replicas\": 3", "\"replicas\": 4");
    std::fs::write(&meta, text).unwrap();
    let err = render_err(&m, &[FigureId::WinnersMap], "spinners-fleet");
    assert!(err.contains("mismatched fleets"), "{err}");
}

#[test]
fn missing_sweeps_are_named() {
    let empty = scratch("empty").join("measurements");
    std::fs::create_dir_all(&empty).unwrap();
    let out = scratch("empty-out");
    let err = format!("{:#}", render_all(&empty, &out).unwrap_err());
    assert!(err.contains("10 of 10 figures not drawn"), "{err}");
    assert!(
        err.contains(
            "fig10-policy-capacity: figures 1, 2 and 10 need a per-policy capacity report"
        ) && err
            .contains("pressure-grid-virtual-policy-capacity/policy-capacity.json does not exist")
            && err.contains("cargo xtask sweep pressure-grid --virtual --policy-capacity"),
        "{err}"
    );
    assert!(
        err.contains("figure 9 needs a trace replay") && err.contains("trace-quick"),
        "{err}"
    );
    assert!(
        err.contains("figure 8 needs an N-router sweep") && err.contains("routers-quick"),
        "{err}"
    );
    assert!(
        err.contains("figure 7 needs a load sweep") && err.contains("load-quick"),
        "{err}"
    );
    assert!(err.contains("pressure-grid"), "{err}");
    assert!(
        err.contains("fault-kill") && err.contains("timeline.csv"),
        "{err}"
    );
}

#[test]
fn timeline_defects_name_file_line_and_policy() {
    let m = measurements_copy("timeline");
    let tl = m.join("fault-kill/timeline.csv");
    let good = std::fs::read_to_string(&tl).unwrap();

    std::fs::write(
        &tl,
        good.replacen("session-affinity,3,3.5,1", "session-affinity,3,fast,1", 1),
    )
    .unwrap();
    let err = render_err(&m, &[FigureId::FaultTimeline], "timeline-1");
    assert!(
        err.contains("timeline.csv:5") && err.contains("`goodput_rps` is `fast`"),
        "{err}"
    );

    std::fs::write(
        &tl,
        good.replace("prefix-affinity-spill-off,", "round-robin,"),
    )
    .unwrap();
    let err = render_err(&m, &[FigureId::FaultTimeline], "timeline-2");
    assert!(
        err.contains("mismatched data") && err.contains("`round-robin`"),
        "{err}"
    );

    let no_spill: String = good
        .lines()
        .filter(|l| !l.starts_with("prefix-affinity-spill-off,"))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&tl, no_spill).unwrap();
    let err = render_err(&m, &[FigureId::FaultTimeline], "timeline-3");
    assert!(
        err.contains("no series for `prefix-affinity-spill-off`"),
        "{err}"
    );

    std::fs::write(&tl, good.replace(",0\n", ",1\n")).unwrap();
    let err = render_err(&m, &[FigureId::FaultTimeline], "timeline-4");
    assert!(err.contains("never has replica_alive = 0"), "{err}");

    std::fs::write(&tl, good.replacen("policy,t_s", "policy,time_s", 1)).unwrap();
    let err = render_err(&m, &[FigureId::FaultTimeline], "timeline-5");
    assert!(
        err.contains("timeline.csv:1") && err.contains("`time_s`"),
        "{err}"
    );
}

#[test]
fn figure_ids_parse_from_numbers_and_names() {
    assert_eq!(FigureId::parse("3"), Some(FigureId::Mechanism));
    assert_eq!(FigureId::parse("fig5-belief"), Some(FigureId::Belief));
    assert_eq!(
        FigureId::parse("fault-timeline"),
        Some(FigureId::FaultTimeline)
    );
    assert_eq!(FigureId::parse("7"), Some(FigureId::LoadCurve));
    assert_eq!(FigureId::parse("load-curve"), Some(FigureId::LoadCurve));
    assert_eq!(FigureId::parse("8"), Some(FigureId::Routers));
    assert_eq!(FigureId::parse("9"), Some(FigureId::TraceReplay));
    assert_eq!(FigureId::parse("10"), Some(FigureId::PolicyCapacity));
    assert_eq!(
        FigureId::parse("policy-capacity"),
        Some(FigureId::PolicyCapacity)
    );
    assert_eq!(FigureId::parse("11"), None);
}

#[test]
fn the_load_curve_marks_each_policys_knee_and_says_how() {
    let out = scratch("load-curve");
    let files = render(
        &Sources::discover(&fixtures()),
        &out,
        &[FigureId::LoadCurve],
    )
    .unwrap();
    assert_eq!(files.len(), 3);
    let csv = std::fs::read_to_string(out.join("fig7-load-curve.csv")).unwrap();
    // session-affinity: 100% at 0.5×, median 87.5% at 1.0× → knee at 1.5 req/s wall (0.5×);
    // prefix-affinity: 95.8% at 1.0×, 72% at 1.5× → knee at 3 req/s wall (1.0×).
    let knees: Vec<(String, String)> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').collect::<Vec<_>>())
        .filter(|f| f[12] == "1")
        .map(|f| (f[0].to_string(), f[1].to_string()))
        .collect();
    assert_eq!(
        knees,
        [
            ("session-affinity".to_string(), "ws1-s0-load0.5".to_string()),
            ("prefix-affinity".to_string(), "ws1-s0-load1.0".to_string())
        ]
    );
    let svg = std::fs::read_to_string(out.join("fig7-load-curve.svg")).unwrap();
    assert!(svg.contains("Load curve"), "title");
    assert!(
        svg.contains("the highest offered load up to which"),
        "the caption states the knee rule"
    );
    assert!(
        svg.contains("0.15 req/s of model time"),
        "the capacity is named"
    );
    // A point whose repetitions record no offered load (a closed loop) is refused, named.
    let m = measurements_copy("load-closed");
    let meta = m.join("load/ws1-s0-load1.0/prefix-affinity/rep-2/meta.json");
    let text = std::fs::read_to_string(&meta).unwrap();
    std::fs::write(&meta, text.replace("offered_wall_rps", "offered_elsewhere")).unwrap();
    let err = render_err(&m, &[FigureId::LoadCurve], "load-closed");
    assert!(
        err.contains("ws1-s0-load1.0/prefix-affinity/rep-2") && err.contains("run.offered_rps"),
        "{err}"
    );
}

#[test]
fn the_router_figure_draws_each_arm_from_its_single_router_cell() {
    let out = scratch("routers");
    let files = render(&Sources::discover(&fixtures()), &out, &[FigureId::Routers]).unwrap();
    assert_eq!(files.len(), 3);
    let csv = std::fs::read_to_string(out.join("fig8-routers.csv")).unwrap();
    let rows: Vec<Vec<String>> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').map(str::to_string).collect())
        .collect();
    // (policy, arm, routers, cell) of every drawn point: each arm starts at one router behind
    // the same front where that ran (`r1-rr-…`), else at the router without a front; the
    // one-router cells are never an arm of their own.
    let keys: Vec<(&str, &str, &str, &str)> = rows
        .iter()
        .map(|r| (r[0].as_str(), r[1].as_str(), r[2].as_str(), r[3].as_str()))
        .collect();
    let rr = "round-robin front";
    let share = "round-robin front + shared decisions";
    let hash = "session-hash front";
    assert_eq!(
        keys,
        [
            ("prefix-affinity", rr, "1", "r1-rr-prefix-affinity"),
            ("prefix-affinity", rr, "2", "r2-rr-prefix-affinity"),
            ("prefix-affinity", rr, "4", "r4-rr-prefix-affinity"),
            ("session-affinity", rr, "1", "session-affinity"),
            ("session-affinity", rr, "2", "r2-rr-session-affinity"),
            ("session-affinity", rr, "4", "r4-rr-session-affinity"),
            ("prefix-affinity", share, "1", "r1-rr-prefix-affinity"),
            ("prefix-affinity", share, "2", "r2-rr-share-prefix-affinity"),
            ("prefix-affinity", share, "4", "r4-rr-share-prefix-affinity"),
            ("prefix-affinity", hash, "1", "prefix-affinity"),
            ("prefix-affinity", hash, "4", "r4-hash-prefix-affinity"),
        ]
    );
    // The hit rate falls with N for prefix-affinity behind round-robin and holds with sharing.
    let hit = |cell: &str| -> f64 {
        rows.iter().find(|r| r[3] == cell).unwrap()[4]
            .parse()
            .unwrap()
    };
    assert!(hit("r4-rr-prefix-affinity") < hit("r2-rr-prefix-affinity"));
    assert!(hit("r2-rr-prefix-affinity") < hit("prefix-affinity"));
    assert!(hit("r4-rr-share-prefix-affinity") > hit("r4-rr-prefix-affinity"));
    let svg = std::fs::read_to_string(out.join("fig8-routers.svg")).unwrap();
    assert!(svg.contains("N routers"), "title");
    assert!(svg.contains("shared decisions"), "the sharing arm is named");
    // A sweep without any cell of more than one router is refused, named.
    let m = measurements_copy("routers-single");
    for cell in std::fs::read_dir(m.join("routers/ws1-s0-load1.0")).unwrap() {
        let cell = cell.unwrap();
        if cell.file_name().to_string_lossy().starts_with('r') {
            std::fs::remove_dir_all(cell.path()).unwrap();
        }
    }
    let err = render_err(&m, &[FigureId::Routers], "routers-single");
    assert!(err.contains("no cell with more than one router"), "{err}");
}

#[test]
fn the_fault_timeline_draws_the_range_of_repetitions_and_states_its_window() {
    // The fixture's timeline predates the band columns; give it the analysis crate's current
    // columns: each value ± 0.5 req/s as the range over repetitions, a 5-s rolling window.
    let m = measurements_copy("fault-band");
    let path = m.join("fault-kill/timeline.csv");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut lines = text.lines();
    let mut out = format!(
        "{},goodput_min_rps,goodput_max_rps,rolling_s\n",
        lines.next().unwrap()
    );
    for l in lines {
        let g: f64 = l.split(',').nth(2).unwrap().parse().unwrap();
        out.push_str(&format!("{l},{},{},5\n", (g - 0.5).max(0.0), g + 0.5));
    }
    std::fs::write(&path, out).unwrap();
    // and a second repetition per policy, so that there is a range to draw
    for cell in std::fs::read_dir(m.join("fault-kill/ws1-s0-rate4")).unwrap() {
        let cell = cell.unwrap().path();
        copy_tree(&cell.join("rep-1"), &cell.join("rep-2"));
        let meta = cell.join("rep-2/meta.json");
        let text = std::fs::read_to_string(&meta).unwrap();
        std::fs::write(&meta, text.replace("\"rep\": 1", "\"rep\": 2")).unwrap();
    }
    let dir = scratch("fault-band-out");
    let files = render(&Sources::discover(&m), &dir, &[FigureId::FaultTimeline]).unwrap();
    assert_eq!(files.len(), 3);
    let svg = std::fs::read_to_string(dir.join("fig6-fault-timeline.svg")).unwrap();
    assert!(
        svg.contains("centred rolling mean over 5 s"),
        "window stated"
    );
    assert!(svg.contains("band: min–max over repetitions"), "band named");
    let csv = std::fs::read_to_string(dir.join("fig6-fault-timeline.csv")).unwrap();
    assert!(csv.starts_with(
        "policy,t_s,goodput_rps,replica_alive,goodput_min_rps,goodput_max_rps,rolling_s\n"
    ));
    assert!(csv.lines().skip(1).all(|l| l.ends_with(",5")), "{csv}");
    // A band value that is not a number is refused with its line.
    std::fs::write(
        &path,
        std::fs::read_to_string(&path)
            .unwrap()
            .replacen(",5\n", ",five\n", 1),
    )
    .unwrap();
    let err = render_err(&m, &[FigureId::FaultTimeline], "fault-band-bad");
    assert!(
        err.contains("timeline.csv:2") && err.contains("`rolling_s` is `five`"),
        "{err}"
    );
}

#[test]
fn the_trace_figure_draws_every_policy_of_the_replay() {
    let out = scratch("trace");
    let files = render(
        &Sources::discover(&fixtures()),
        &out,
        &[FigureId::TraceReplay],
    )
    .unwrap();
    assert_eq!(files.len(), 3);
    let csv = std::fs::read_to_string(out.join("fig9-trace-replay.csv")).unwrap();
    let rows: Vec<Vec<&str>> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').collect())
        .collect();
    let policies: Vec<&str> = rows.iter().map(|r| r[0]).collect();
    assert_eq!(
        policies,
        ["round-robin", "session-affinity", "prefix-affinity"]
    );
    // prefix-affinity: 10 and 11 good of 12 in 4 s → 2.5 and 2.75 req/s, median 2.625
    let pa = rows.iter().find(|r| r[0] == "prefix-affinity").unwrap();
    assert_eq!((pa[1], pa[2], pa[3]), ("2.625", "2.5", "2.75"));
    let svg = std::fs::read_to_string(out.join("fig9-trace-replay.svg")).unwrap();
    assert!(
        svg.contains("Trace replay") && svg.contains("b32-x1"),
        "title and point"
    );
    // A second point is refused: a trace sweep replays one slice.
    let m = measurements_copy("trace-two");
    copy_tree(&m.join("trace-quick/b32-x1"), &m.join("trace-quick/b64-x1"));
    let err = render_err(&m, &[FigureId::TraceReplay], "trace-two");
    assert!(err.contains("figure 9") && err.contains("points"), "{err}");
}

#[test]
fn the_load_curve_draws_the_same_bytes_whatever_order_the_report_lists_its_cells_in() {
    // Series are drawn in the tables' policy order and each keeps its policy's marker, so a
    // report listing its cells in another order (an older report, another sweep) draws the same.
    let input = figures::input::load_load_sweep(&fixtures().join("load")).unwrap();
    let mut reversed = input.clone();
    for p in &mut reversed.report.points {
        p.cells.reverse();
    }
    assert!(
        input.report.points.iter().any(|p| p.cells.len() > 1),
        "the fixture compares more than one policy"
    );
    let (a, b) = (scratch("load-order-a"), scratch("load-order-b"));
    figures::render_one(FigureId::LoadCurve, figures::Input::Load(&input), &a).unwrap();
    figures::render_one(FigureId::LoadCurve, figures::Input::Load(&reversed), &b).unwrap();
    for ext in ["csv", "svg", "png"] {
        let name = format!("fig7-load-curve.{ext}");
        assert!(
            std::fs::read(a.join(&name)).unwrap() == std::fs::read(b.join(&name)).unwrap(),
            "{name} depends on the report's cell order"
        );
    }
}

/// Figure 10's rows, by (point, policy): every field as written.
fn fig10_rows(csv: &str) -> Vec<std::collections::BTreeMap<String, String>> {
    let mut r = csv::Reader::from_reader(csv.as_bytes());
    let header: Vec<String> = r.headers().unwrap().iter().map(str::to_string).collect();
    r.records()
        .map(|rec| {
            header
                .iter()
                .cloned()
                .zip(rec.unwrap().iter().map(str::to_string))
                .collect()
        })
        .collect()
}

/// Every row of figure 10's table is the report's: one per point and policy, in the report's
/// order, with the policy's median, min, max and seed count, and its margin's ratio and verdict
/// (the baseline `reference`).
fn assert_fig10_rows_are_the_reports(csv: &str, report: &CapacityReport) {
    let rows = fig10_rows(csv);
    let want: Vec<(&str, &str)> = report
        .points
        .iter()
        .flat_map(|p| {
            p.policies
                .iter()
                .map(move |c| (p.point.as_str(), c.policy.as_str()))
        })
        .collect();
    let got: Vec<(&str, &str)> = rows
        .iter()
        .map(|r| (r["point"].as_str(), r["policy"].as_str()))
        .collect();
    assert_eq!(
        got, want,
        "one row per point and policy, in the report's order"
    );
    let f = |s: &str| -> Option<f64> { (!s.is_empty()).then(|| s.parse().unwrap()) };
    for r in &rows {
        let p = report
            .points
            .iter()
            .find(|p| p.point == r["point"])
            .unwrap();
        let c = p.policies.iter().find(|c| c.policy == r["policy"]).unwrap();
        let at = format!("{} {}", r["point"], r["policy"]);
        assert_eq!(
            f(&r["capacity_median_rps"]),
            c.spread.map(|s| s.median),
            "{at}"
        );
        assert_eq!(f(&r["capacity_min_rps"]), c.spread.map(|s| s.min), "{at}");
        assert_eq!(f(&r["capacity_max_rps"]), c.spread.map(|s| s.max), "{at}");
        assert_eq!(
            r["seeds"],
            c.spread.map(|s| s.n.to_string()).unwrap_or_default(),
            "{at}"
        );
        assert_eq!(r["best"], p.best.contains(&c.policy).to_string(), "{at}");
        match p.margins.iter().find(|m| m.policy == c.policy) {
            None => {
                assert_eq!(
                    c.policy, report.baseline,
                    "{at}: only the baseline has no margin"
                );
                assert_eq!(r["verdict"], "reference", "{at}");
                assert_eq!(r["ratio_to_session_affinity"], "", "{at}");
            }
            Some(m) => {
                assert_eq!(r["verdict"], m.verdict.as_str(), "{at}");
                assert_eq!(f(&r["ratio_to_session_affinity"]), m.ratio, "{at}");
            }
        }
    }
}

#[test]
fn the_policy_capacity_figure_draws_each_policys_capacity_as_the_report_gives_it() {
    let out = scratch("policy-capacity");
    let files = render(
        &Sources::discover(&fixtures()),
        &out,
        &[FigureId::PolicyCapacity],
    )
    .unwrap();
    assert_eq!(files.len(), 3);
    let report = figures::load_capacity(&fixtures().join(CAPACITY_SWEEP))
        .unwrap()
        .report;
    let csv = std::fs::read_to_string(out.join("fig10-policy-capacity.csv")).unwrap();
    assert_fig10_rows_are_the_reports(&csv, &report);
    // the design of the fixture, as drawn
    assert!(
        csv.contains(
            "\nws1-s0,1,0,prefix-affinity,8,7.8,8.2,3,0.8791208791208791,separates,false\n"
        ),
        "{csv}"
    );
    assert!(
        csv.contains("\nws1-s0,1,0,session-affinity,9.1,9,9.3,3,,reference,false\n"),
        "{csv}"
    );
    assert!(
        csv.lines()
            .any(|l| l.starts_with("ws3-s1.4,3,1.4,round-robin,1.32") && l.contains(",1.3,1.35,2,")),
        "only the bracketed seeds count: {csv}"
    );
    let svg = std::fs::read_to_string(out.join("fig10-policy-capacity.svg")).unwrap();
    for text in [
        "Policy capacity",
        "ws3-s0 · working set 3× · skew 0",
        "×0.879 separates",
        "×1.029 within resolution",
        "reference",
        "· best",
        "Held equal per seed: the same plans",
    ] {
        assert!(svg.contains(text), "SVG lacks `{text}`");
    }
    // The published report, when this checkout has it: its table is the report's too.
    let published = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../docs/measurements")
        .join(CAPACITY_SWEEP);
    if published.join(figures::input::CAPACITY_FILE).is_file() {
        let report = figures::load_capacity(&published).unwrap().report;
        let table = figures::data::policy_capacity(&report).unwrap().table();
        assert_fig10_rows_are_the_reports(&table.to_csv().unwrap(), &report);
    }
}

#[test]
fn the_maps_lead_with_capacity_and_keep_the_fixed_rate_view_second() {
    let out = scratch("maps-capacity");
    render(
        &Sources::discover(&fixtures()),
        &out,
        &[FigureId::PressureMap, FigureId::WinnersMap],
    )
    .unwrap();
    let read = |f: FigureId, ext: &str| {
        std::fs::read_to_string(out.join(f.stem()).with_extension(ext)).unwrap()
    };
    let fig1 = read(FigureId::PressureMap, "csv");
    let rows = fig10_rows(&fig1);
    let panels: Vec<&str> = rows.iter().map(|r| r["panel"].as_str()).collect();
    assert_eq!(
        panels,
        [
            "capacity",
            "capacity",
            "capacity",
            "capacity",
            "fixed-rate",
            "fixed-rate",
            "fixed-rate",
            "fixed-rate"
        ],
        "capacity rows first: {fig1}"
    );
    let ws1 = &rows[0];
    assert_eq!(
        (
            ws1["point"].as_str(),
            ws1["prefix_affinity_capacity_median_rps"].as_str(),
            ws1["session_affinity_capacity_min_rps"].as_str(),
            ws1["capacity_ratio"].as_str(),
            ws1["verdict"].as_str(),
            ws1["margin_rps"].as_str(),
        ),
        ("ws1-s0", "8", "9", "0.8791208791208791", "separates", "")
    );
    assert_eq!(rows[3]["verdict"], "within resolution", "{fig1}");
    let svg1 = read(FigureId::PressureMap, "svg");
    let a = svg1.find("(a) Capacity").expect("capacity panel");
    let b = svg1.find("(b) Secondary").expect("fixed-rate panel");
    assert!(a < b, "the capacity panel is drawn first");
    assert!(svg1.contains("PA 8.000 [7.800–8.200]"), "{svg1}");
    assert!(
        svg1.contains("at one load per point"),
        "the fixed-rate panel says what set its load: {svg1}"
    );
    let fig2 = fig10_rows(&read(FigureId::WinnersMap, "csv"));
    let cap = |point: &str| {
        fig2.iter()
            .find(|r| r["panel"] == "capacity" && r["point"] == point)
            .unwrap()
    };
    let ws3 = cap("ws3-s0");
    assert_eq!(
        (
            ws3["winner"].as_str(),
            ws3["winner_capacity_median_rps"].as_str(),
            ws3["winner_vs_session_affinity_verdict"].as_str(),
            ws3["runner_up"].as_str(),
            ws3["verdict"].as_str(),
        ),
        (
            "exact-residency",
            "5.1",
            "separates",
            "prefix-affinity",
            "separates"
        )
    );
    let ws1 = cap("ws1-s0");
    assert_eq!(
        (ws1["runner_up"].as_str(), ws1["verdict"].as_str()),
        ("session-affinity", "within spread")
    );
    let tied = cap("ws1-s1.4");
    assert_eq!(
        (
            tied["winner"].as_str(),
            tied["verdict"].as_str(),
            tied["winner_vs_session_affinity_verdict"].as_str()
        ),
        (
            "round-robin;session-affinity;prefix-affinity;exact-residency",
            "tied",
            "baseline among the best"
        )
    );
    assert_eq!(cap("ws3-s1.4")["verdict"], "not bracketed");
    let svg2 = read(FigureId::WinnersMap, "svg");
    for text in [
        "(a) Capacity",
        "(b) Secondary",
        "4 tied",
        "RR, SA, PA, ER",
        "runner-up: prefix-affinity 4.300",
        "not every policy bracketed",
    ] {
        assert!(svg2.contains(text), "SVG lacks `{text}`");
    }
    // Without the capacity report neither map is drawn, and the error says how to make one.
    let m = measurements_copy("maps-no-capacity");
    std::fs::remove_dir_all(m.join(CAPACITY_SWEEP)).unwrap();
    let err = render_err(
        &m,
        &[FigureId::PressureMap, FigureId::WinnersMap],
        "maps-no-capacity",
    );
    assert!(err.contains("2 of 2 figures not drawn"), "{err}");
    assert!(err.contains("--policy-capacity"), "{err}");
}
