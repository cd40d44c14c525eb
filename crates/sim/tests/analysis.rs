//! A virtual sweep read by the analysis crate unchanged: it loads, passes the comparability
//! guard, and its goodput is the simulator's own.

mod common;
use test_support::temp_dir;

use common::closed_plan;
use sim::{CellMeta, SimConfig, run_cell};

#[test]
fn analysis_reads_a_virtual_sweep_unchanged() {
    let sweep = temp_dir("sim-test-analysis-sweep");
    let base = {
        let mut c = SimConfig::new(2, "session-affinity");
        c.engine.num_gpu_blocks = 1024;
        c.driver.warmup_s = 10.0;
        c
    };
    let plan = closed_plan(base.capacity_tokens(), 1.0, 0.0, 8, 12, 4);
    let point = "ws1-s0";
    let mut ours = Vec::new();
    for policy in ["session-affinity", "prefix-affinity"] {
        let mut goodputs = Vec::new();
        for rep in 1..=3u32 {
            let mut cfg = base.clone();
            cfg.policy = policies::PolicySpec::named(policy);
            cfg.policy.seed = u64::from(rep);
            cfg.engine.seed = u64::from(rep);
            cfg.engine.model.jitter = 0.02;
            let dir = sweep
                .path()
                .join(point)
                .join(policy)
                .join(format!("rep-{rep}"));
            let meta = CellMeta {
                sweep: "virtual-test".into(),
                point: point.into(),
                rep,
                ..CellMeta::default()
            };
            let s = run_cell(&cfg, &plan, &dir, &meta).expect("cell");
            let a_meta = analysis::read_meta(&dir.join("meta.json")).expect("meta");
            assert!(a_meta.virtual_time);
            assert!(a_meta.complete);
            // One `Slo` and one `Window` type (crates/schema): the simulator's are the analysis's.
            analysis::check_rep_dir(
                &dir,
                &meta.slo,
                &s.window,
                &analysis::DriftConfig::default(),
            )
            .expect("drift check reads the rows");
            goodputs.push(s.goodput_rps);
        }
        goodputs.sort_by(f64::total_cmp);
        ours.push((policy, goodputs[1]));
    }
    let report =
        analysis::analyze_dir(sweep.path(), &analysis::ReportConfig::default()).expect("analysis");
    assert!(report.incomplete.is_empty(), "{:?}", report.incomplete);
    assert!(report.refused.is_empty(), "{:?}", report.refused);
    assert_eq!(report.points.len(), 1);
    let p = &report.points[0];
    assert_eq!(p.plan_fingerprint, plan.fingerprint_hex().expect("fp"));
    for (policy, median) in ours {
        let cell = p.cells.iter().find(|c| c.policy == policy).expect("cell");
        assert_eq!(cell.reps_used.len(), 3);
        let g = cell.goodput_rps.as_ref().expect("goodput").median;
        assert!(
            (g - median).abs() <= 1e-6 * median.max(1.0),
            "{policy}: analysis {g} vs simulator {median}"
        );
    }
}
