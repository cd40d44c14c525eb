//! Every figure renders from the fixture measurements (`fixtures/figures/`), its CSV matches the
//! golden file, and missing or mismatched data fails with a message naming what is missing.
//!
//! Regenerate the goldens deliberately with `UPDATE_GOLDEN=1 cargo test -p figures --test
//! fixtures`, then review the diff.

use std::path::{Path, PathBuf};

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

#[test]
fn all_nine_render_from_fixtures_and_their_data_match_the_goldens() {
    let out = scratch("all").join("out");
    let files = render_all(&fixtures(), &out).unwrap();
    assert_eq!(files.len(), 27, "{files:?}");
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
            if !own_sweep || context != "pressure-grid" {
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
            .any(|l| l == "ws1-s0,1,0,,,no accepted reps,,,"),
        "the set-aside point is a row saying so: {fig1}"
    );
    assert!(
        fig1.lines().any(|l| l.starts_with("ws3-s1.4,3,1.4,")),
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
        figures::render_one(fig, figures::Input::Grid(&grid), &out).unwrap();
    }
    let read = |f: FigureId, ext: &str| {
        std::fs::read_to_string(out.join(f.stem()).with_extension(ext)).unwrap()
    };
    let fig1 = read(FigureId::PressureMap, "csv");
    // prefix-affinity 19 of 24 measured requests within the SLO, session-affinity 13 of 24
    assert!(
        fig1.lines().any(|l| l.starts_with("ws1-s0,")
            && l.ends_with(",0.7916666666666667,0.5416666666666667,true")),
        "{fig1}"
    );
    assert!(
        fig1.lines()
            .filter(|l| !l.starts_with("point,"))
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
        fig2.lines()
            .any(|l| l.starts_with("ws1-s0,1,0,exact-residency-spec,")
                && l.ends_with(",0.9583333333333333,0.7916666666666667,true")),
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
    assert!(err.contains("9 of 9 figures not drawn"), "{err}");
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
    assert_eq!(FigureId::parse("10"), None);
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
