//! Live vs virtual at the size of the effects: one small open-loop sweep (2 points × session-
//! affinity and prefix-affinity, 3 emulated replicas through the router, 3 repetitions) run live
//! and then in virtual time with the live calibration, compared by `cargo xtask crosscheck`: each
//! cell within 3% of goodput and 3 points of attainment, each margin within 3 points, or within
//! the cell's own repetition spread where wider. Prefix-affinity at ws3-s0-rate3 runs near
//! capacity and spreads 4.4–8.1% live, 4.8% in virtual by seed alone (2 Dec 2026): the test
//! needs that point's large effect (+32–36%) resolved: larger than the bound it is judged at.
//!
//! It builds the release binaries with cargo first (a no-op when they are fresh).

mod common;
use common::{build_bins, json, temp_dir, xtask};

#[test]
#[ignore = "needs the release binaries: cargo build --release"]
fn live_and_virtual_agree_at_the_size_of_the_effects() {
    build_bins();
    let scratch = temp_dir("xtask-xc");
    let out = scratch.path().to_string_lossy().into_owned();
    let cal = scratch.path().join("calibration.json");
    let cal = cal.to_string_lossy().into_owned();
    let sweep = |extra: &[&str]| {
        let mut args = vec![
            "sweep",
            "pressure-grid",
            "--quick",
            "--no-build",
            "--out",
            out.as_str(),
            "--points",
            "ws1-s0-rate3,ws3-s0-rate3",
            "--policies",
            "session-affinity,prefix-affinity",
            "--reps",
            "3",
            "--replicas",
            "3",
            // Open loop at a fixed model-time rate: the same arrivals on both sides, and a
            // load at which TTFT queueing (what routing changes) shows in attainment.
            "--open-loop",
            "--rate",
            "3",
            // 12 s: open loops start at the steady state's turn mix, whose first prompts carry
            // whole histories into cold caches; at 6 s prefix-affinity's ws1-s0 cell still warmed
            // on both sides (attainment trending down 21%, 1 Dec 2026), at 12 s all four settle.
            "--warmup-s",
            "12",
            // 16 s (about 290 requests a cell): at 8 s one repetition's goodput moved 2.5–4.2%.
            "--measure-s",
            "16",
            // The test machine is shared: evidence is recorded, not used to reject here.
            "--lateness-share-of-itl-floor",
            "10000",
            "--evidence-retries",
            "0",
        ];
        args.extend_from_slice(extra);
        let (ok, _stdout, stderr) = xtask(&args);
        assert!(ok, "sweep {extra:?} failed:\n{stderr}");
    };
    sweep(&["--calibration", &cal, "--sweep-dir-name", "live"]);
    let live = scratch.path().join("live");
    let live_cal = live.join("calibration.json").to_string_lossy().into_owned();
    sweep(&[
        "--virtual",
        "--live-calibration",
        &live_cal,
        "--sweep-dir-name",
        "virtual",
    ]);
    let virt = scratch.path().join("virtual");
    assert_eq!(
        json(&virt.join("sweep.json"))["calibration_source"],
        format!("live: {live_cal}")
    );
    assert_eq!(
        json(&virt.join("calibration.json"))["slo"],
        json(&live.join("calibration.json"))["slo"],
        "both sides judged by one SLO"
    );

    let (ok, stdout, stderr) = xtask(&[
        "crosscheck",
        &live.to_string_lossy(),
        &virt.to_string_lossy(),
    ]);
    eprintln!("{stdout}");
    let result = json(&live.join("crosscheck.json"));
    let len = |k: &str| result[k].as_array().map(Vec::len);
    let counts = (len("refused"), len("cells"), len("effects"));
    assert_eq!(counts, (Some(0), Some(4), Some(2)), "{result}");
    assert!(ok, "live and virtual disagree:\n{stdout}\n{stderr}");
    // The resolution must stay below the effect the check vouches for: a cell's spread is noisy
    // itself (prefix-affinity at ws3-s0 spanned 4.4% live in one run, 8.1% in the next).
    let large = result["effects"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["point"] == "ws3-s0-rate3")
        .expect("the ws3-s0 effect");
    assert_eq!(large["resolved"], true, "{large}");
}
