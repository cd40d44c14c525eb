//! `cargo xtask sweep … --virtual`: a tiny virtual sweep (1 point × 2 policies × 2 repetitions)
//! run twice gives byte-identical rows, the live layout with `"virtual": true`, the live sweep's
//! plan, and a report whose differences are deterministic, with no spread verdict (no invented
//! noise makes repetitions differ); another seed changes the rows.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::{assert_every_value_names_its_rule, json, temp_dir};

fn scratch(tag: &str) -> test_support::TempDir {
    temp_dir(&format!("xtask-virtual-{tag}"))
}

fn xtask(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(args)
        .output()
        .expect("xtask runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Both settle within the tiny cell (round-robin drifts there and is set aside), so the report
/// compares them.
const POLICIES: [&str; 2] = ["session-affinity", "prefix-affinity"];

/// Runs the tiny sweep into `out/<name>` with `seed`; returns the sweep directory.
fn tiny(out: &Path, name: &str, seed: &str) -> PathBuf {
    let out_s = out.to_string_lossy().into_owned();
    let (ok, stderr) = xtask(&[
        "sweep",
        "pressure-grid",
        "--quick",
        "--virtual",
        "--out",
        &out_s,
        "--sweep-dir-name",
        name,
        "--points",
        "ws1-s0",
        "--policies",
        &POLICIES.join(","),
        "--reps",
        "2",
        "--replicas",
        "2",
        "--num-gpu-blocks",
        "1024",
        "--users",
        "8",
        // The private-context workload: this tiny cell (2 replicas × 1,024 blocks) is sized for
        // it; 16 group prefixes of 2,048 tokens would fill its caches on their own.
        "--prefix-groups",
        "0",
        "--warmup-s",
        "2",
        "--measure-s",
        "6",
        "--seed",
        seed,
    ]);
    assert!(ok, "virtual sweep failed:\n{stderr}");
    out.join(name)
}

fn rows(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut all = Vec::new();
    for policy in POLICIES {
        for rep in 1..=2 {
            for file in ["client.csv", "router.csv"] {
                let p = dir
                    .join("ws1-s0")
                    .join(policy)
                    .join(format!("rep-{rep}"))
                    .join(file);
                let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                all.push((format!("{policy}/rep-{rep}/{file}"), bytes));
            }
        }
    }
    all
}

#[test]
fn same_seed_same_bytes_and_the_live_layout() {
    let s = scratch("det");
    let a = tiny(s.path(), "a", "7");
    let b = tiny(s.path(), "b", "7");
    let (ra, rb) = (rows(&a), rows(&b));
    for ((name, x), (_, y)) in ra.iter().zip(&rb) {
        assert!(x == y, "{name} differs between two runs with the same seed");
    }
    // No step-time jitter: session-affinity, whose hash ring no seed moves here, repeats itself
    // byte for byte; a few hundred requests were run.
    let rep1 = &ra[0].1;
    let rep2 = &ra[2].1;
    assert!(
        rep1 == rep2,
        "session-affinity rep-1 and rep-2 differ: something other than a seed moves virtual repetitions"
    );
    let requests = String::from_utf8_lossy(rep1).lines().count() - 1;
    assert!(
        (100..5_000).contains(&requests),
        "{requests} requests in a tiny cell"
    );

    let plan = json(&a.join("ws1-s0").join("plan.json"));
    for policy in POLICIES {
        for rep in 1..=2 {
            let meta = json(
                &a.join("ws1-s0")
                    .join(policy)
                    .join(format!("rep-{rep}"))
                    .join("meta.json"),
            );
            assert_eq!(meta["virtual"], true);
            assert_eq!(meta["complete"], true);
            assert_eq!(meta["policy"], policy);
            assert_eq!(meta["plan_fingerprint"], plan["plan_fingerprint"]);
            assert!(meta["accepted"].is_boolean());
            assert!(meta["drift"]["warming"].is_boolean());
            assert_eq!(meta["fleet"]["replicas"], 2);
        }
    }
    let cal = json(&a.join("calibration.json"));
    let slo = cal["slo"]["ttft_ms"].as_f64().unwrap();
    let floor = cal["floors"]["ttft_ms"].as_f64().unwrap();
    assert!((slo - 3.0 * floor).abs() < 1e-9 && floor > 0.0);
    assert_every_value_names_its_rule(&a.join("calibration.json"));
    let record = json(&a.join("sweep.json"));
    assert_eq!(record["virtual"], true);
    assert!(record.get("jitter").is_none(), "{record:#}");
    assert!(
        record["repetitions"]
            .as_str()
            .is_some_and(|r| r.starts_with("deterministic")),
        "{record:#}"
    );
    // Every comparison is a deterministic difference, never a spread verdict.
    let report = json(&a.join("report.json"));
    let point = &report["points"][0];
    assert_eq!(point["virtual_time"], true, "{point:#}");
    let margins = point["margins"].as_array().unwrap();
    assert_eq!(margins.len(), 2, "{point:#}");
    for m in margins {
        assert_eq!(m["verdict"], "deterministic (virtual)", "{m}");
    }
    assert_eq!(point["winner_verdict"], "deterministic (virtual)");
    assert!(
        report["adaptive_router_test"]["statement"]
            .as_str()
            .unwrap()
            .starts_with("Not tested: every point with prefix-affinity (1) ran in virtual time"),
        "{report:#}"
    );
    let md = std::fs::read_to_string(a.join("report.md")).unwrap();
    assert!(md.contains("deterministic (virtual)"), "{md}");
    for verdict in ["| separates", "within spread |", "too few reps |"] {
        assert!(
            !md.lines()
                .any(|l| l.starts_with('|') && l.contains(verdict)),
            "a virtual table row carries `{verdict}`:\n{md}"
        );
    }

    // Another seed: another plan and other rows.
    let c = tiny(s.path(), "c", "8");
    assert_ne!(rows(&c)[0].1, ra[0].1);
}

#[test]
fn virtual_refuses_what_it_cannot_simulate() {
    let s = scratch("bad");
    let out = s.path().to_string_lossy().into_owned();
    let (ok, stderr) = xtask(&[
        "sweep",
        "pressure-grid",
        "--virtual",
        "--out",
        &out,
        "--fleet",
        "static",
        "--urls",
        "http://127.0.0.1:1",
    ]);
    assert!(!ok);
    assert!(stderr.contains("--virtual"), "{stderr}");
    let (ok, stderr) = xtask(&[
        "sweep",
        "pressure-grid",
        "--virtual",
        "--out",
        &out,
        "--policies",
        "no-such-policy",
    ]);
    assert!(!ok);
    assert!(stderr.contains("no-such-policy"), "{stderr}");
}

/// The `load` sweep by default: the simulated fleet's capacity found first (in
/// `calibration.json`), then one point per fraction of it, each named and recorded with its
/// fraction, its absolute rate and the warm-up derived from the search.
#[test]
fn the_load_sweep_runs_at_fractions_of_the_capacity() {
    let s = scratch("load");
    let out = s.path().to_string_lossy().into_owned();
    let (ok, stderr) = xtask(&[
        "sweep",
        "load",
        "--quick",
        "--virtual",
        "--out",
        &out,
        "--sweep-dir-name",
        "load",
        "--policies",
        "prefix-affinity",
        "--reps",
        "1",
        "--replicas",
        "2",
        "--num-gpu-blocks",
        "1024",
        "--measure-s",
        "6",
        "--no-report",
    ]);
    assert!(ok, "virtual load sweep failed:\n{stderr}");
    let dir = s.path().join("load");
    let cap = &json(&dir.join("calibration.json"))["capacity"];
    let capacity = cap["rate_rps"].as_f64().expect("a capacity");
    assert!(capacity > 0.0 && cap["failing_rps"].as_f64().unwrap() > capacity);
    assert!(cap["rule"].as_str().unwrap().contains("90%"));
    let curve = cap["curve"].as_array().unwrap();
    assert!(
        curve
            .iter()
            .any(|p| p["rate_rps"] == capacity && p["meets_target"] == true)
    );
    assert_eq!(json(&dir.join("sweep.json"))["capacity_rps"], capacity);
    for f in [0.5, 1.0, 1.5] {
        let point = format!("ws1-s0-load{f:.1}");
        let meta = json(&dir.join(&point).join("prefix-affinity/rep-1/meta.json"));
        let run = &meta["run"];
        let rate = (f * capacity * 1000.0).round() / 1000.0;
        assert_eq!(run["load_fraction"], f, "{point}");
        assert_eq!(run["offered_rps"], rate, "{point}");
        assert_eq!(run["capacity_rps"], capacity, "{point}");
        let wall = run["offered_wall_rps"].as_f64().unwrap();
        assert!((wall - rate * 6.0).abs() < 1e-6, "{point}: {wall}");
        assert!(
            meta["workload_name"]
                .as_str()
                .unwrap()
                .ends_with(&format!("-load{f:.1}")),
            "{point}"
        );
        let rule = run["window"]["rule"].as_str().unwrap();
        assert!(rule.contains("settled with at"), "{point}: {rule}");
        assert_eq!(meta["window"]["warmup_s"], run["window"]["warmup_s"]);
        // An open loop: measured by scheduled time, its drift verdict classified.
        assert_eq!(meta["window"]["clock"], "scheduled", "{point}");
        let class = meta["drift"]["class"].as_str().unwrap();
        assert!(
            ["settled", "warming", "worsening", "overloaded", "skipped"].contains(&class),
            "{point}: {class}"
        );
        assert_eq!(meta["accepted"], class != "warming", "{point}");
    }
}

/// `--capacity per-point` (the virtual default): a point whose workload is not the reference
/// point's runs at its own capacity, searched on its workload and recorded beside it; the
/// reference point keeps the calibration's. `--capacity reference` runs both at the calibration's.
#[test]
fn each_point_runs_at_its_own_capacity() {
    let s = scratch("per-point");
    let out = s.path().to_string_lossy().into_owned();
    let run = |name: &str, scope: &str| {
        let fixed = "sweep pressure-grid --quick --virtual --points ws1-s0-load1.0,ws1-s1.4-load1.0 \
                     --policies session-affinity --reps 1 --replicas 2 --num-gpu-blocks 1024 \
                     --measure-s 6 --no-report";
        let mut args: Vec<&str> = fixed.split_whitespace().collect();
        args.extend(["--out", &out, "--sweep-dir-name", name, "--capacity", scope]);
        let (ok, stderr) = xtask(&args);
        assert!(ok, "virtual sweep ({scope}) failed:\n{stderr}");
        s.path().join(name)
    };
    let rate_of = |dir: &Path, point: &str| {
        let meta = json(&dir.join(point).join("session-affinity/rep-1/meta.json"));
        let r = &meta["run"];
        (
            r["offered_rps"].as_f64().unwrap(),
            r["capacity_rps"].as_f64().unwrap(),
            r["capacity_scope"].as_str().unwrap().to_string(),
        )
    };
    let per = run("per-point", "per-point");
    let reference = json(&per.join("calibration.json"))["capacity"]["rate_rps"]
        .as_f64()
        .unwrap();
    assert_eq!(json(&per.join("sweep.json"))["capacity_scope"], "per-point");
    let (r0, c0, scope0) = rate_of(&per, "ws1-s0-load1.0");
    assert_eq!(
        (r0, c0, scope0.as_str()),
        (reference, reference, "per-point")
    );
    let (r1, c1, _) = rate_of(&per, "ws1-s1.4-load1.0");
    let own = json(&per.join("ws1-s1.4-load1.0/capacity.json"));
    assert_eq!(own["capacity"]["rate_rps"].as_f64().unwrap(), c1);
    assert_eq!(r1, c1, "load 1.0 × the point's own capacity");
    assert!(
        own["capacity"]["workload"]
            .as_str()
            .unwrap()
            .contains("-s1.4-"),
        "searched on the point's own workload: {own}"
    );
    // Skew 1.4 sends a hot conversation more turns than it serves one at a time: its own
    // capacity is below the reference point's, which would overload it.
    assert!(c1 < reference, "{c1} vs {reference}");
    let refd = run("reference", "reference");
    let (r1, c1, scope1) = rate_of(&refd, "ws1-s1.4-load1.0");
    assert_eq!(
        (r1, c1, scope1.as_str()),
        (reference, reference, "reference")
    );
    assert!(!refd.join("ws1-s1.4-load1.0/capacity.json").exists());
}

/// `--policy-capacity` (what the main job runs after its cells, judged by its live calibration):
/// each policy's own capacity per plan seed, bracketed to 5%, the verdict stating its resolution,
/// and a seed that meets at no rate said so in workload terms ("not load"), not counted.
#[test]
fn each_policy_gets_its_own_capacity_per_plan_seed() {
    let s = scratch("policy-capacity");
    let out = s.path().to_string_lossy().into_owned();
    let fixed = "sweep pressure-grid --quick --virtual --policy-capacity --seeds 2 \
                 --points ws1-s0-load1.0 --policies session-affinity,prefix-affinity \
                 --replicas 2 --num-gpu-blocks 1024 --measure-s 6";
    let mut args: Vec<&str> = fixed.split_whitespace().collect();
    args.extend(["--out", &out, "--sweep-dir-name", "pc"]);
    let (ok, stderr) = xtask(&args);
    assert!(ok, "per-policy capacity failed:\n{stderr}");
    let dir = s.path().join("pc");
    let md = std::fs::read_to_string(dir.join("policy-capacity.md")).unwrap();
    assert!(md.contains("(resolution 5%)"), "{md}");
    // Every bracketed search keeps its record (its steps and their attainment).
    for (policy, seed) in [
        ("prefix-affinity", 7),
        ("prefix-affinity", 8),
        ("session-affinity", 7),
    ] {
        let record = dir
            .join("policy-capacity/ws1-s0")
            .join(policy)
            .join(format!("seed-{seed}/capacity.json"));
        assert!(record.exists(), "{}", record.display());
    }
    for seed in [7, 8] {
        assert!(md.contains(&format!("seed {seed}: ")), "{md}");
    }
    // Each bracketed seed's failing rate is within 5% above its capacity.
    let report = json(&dir.join("policy-capacity.json"));
    let text = report.to_string();
    assert!(text.contains("prefix-affinity"), "{text}");
    let mut bracketed = 0;
    for line in md.lines().filter(|l| l.starts_with("| prefix-affinity")) {
        for part in line.split("seed ").skip(1) {
            let rates: Vec<f64> = part
                .split(|c: char| !(c.is_ascii_digit() || c == '.'))
                .filter_map(|t| t.parse().ok())
                .collect();
            if let [_, cap, fail, ..] = rates[..] {
                assert!(fail > cap && fail <= cap * 1.05 + 0.001, "{part}");
                bracketed += 1;
            }
        }
    }
    assert_eq!(bracketed, 2, "{md}");
    // A seed at which session-affinity met the SLO at no rate says why, and is left out.
    assert!(
        md.contains("met the SLO at no rate tried") && md.contains("not load"),
        "{md}"
    );
}
