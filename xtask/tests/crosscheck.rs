//! Live vs virtual, small: one plan (ws 1, skew 0, 8 closed-loop users × 12 requests) through 2
//! emulated engines and the router (prefix-affinity) at `--speed 3`, and through the simulator
//! with the same engine config. Goodput over the sweep's closed-loop window rule agrees within
//! `TOLERANCE` (crates/sim/README.md measured < 1% at speed 1; a faster clock makes live HTTP
//! and scheduling noise on a shared machine relatively larger, hence the margin).
//!
//! It builds the release binaries with cargo first (a no-op when they are fresh).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use fleet::ChildGuard;
use workload::{ArrivalSpec, Plan, Sizing, WorkloadSpec};

mod common;
use common::{Scratch, build_bins, release_bin};

/// Largest relative goodput difference accepted (the cross-check bound).
const TOLERANCE: f64 = 0.10;
const SPEED: f64 = 3.0;
const BLOCKS: u32 = 1024;
const USERS: u32 = 8;
const POLICY: &str = "prefix-affinity";

fn start(name: &str, cmd: Command, logs: &Path) -> (ChildGuard, String) {
    let mut g = ChildGuard::spawn(name, cmd, &logs.join(format!("{name}.log"))).expect(name);
    let ready = g
        .wait_ready(Duration::from_secs(30), &|| false)
        .unwrap_or_else(|e| panic!("{name} not ready: {e:#}"));
    (g, ready.url())
}

/// Goodput (req/s) of a cell directory: requests sent inside the closed-loop measured window
/// that meet the SLO, over the window's length.
fn goodput(dir: &Path, slo: &analysis::Slo) -> (f64, usize) {
    let client = analysis::read_client_csv(&dir.join("client.csv")).expect("client.csv");
    let sent: Vec<f64> = client.iter().filter_map(|r| r.sent_s).collect();
    let w = sim::measured_window(&sent, 0.0, f64::INFINITY, Some(USERS as usize)).expect("window");
    let good = client
        .iter()
        .filter(|r| {
            r.sent_s
                .is_some_and(|s| s >= w.measured_start_s && s < w.measured_end_s)
        })
        .filter(|r| analysis::is_good(r, slo, w.clock))
        .count();
    (
        good as f64 / (w.measured_end_s - w.measured_start_s),
        client.len(),
    )
}

#[test]
fn live_and_virtual_goodput_agree() {
    build_bins();
    let root = Scratch::new("xc");
    let (live, virt) = (root.0.join("live"), root.0.join("virtual"));
    std::fs::create_dir_all(&live).unwrap();

    let spec = WorkloadSpec {
        seed: 7,
        sizing: Sizing::WorkingSet {
            capacity_tokens: 2 * u64::from(BLOCKS) * 16,
            ratio: 1.0,
        },
        ..WorkloadSpec::default()
    };
    let arrival = ArrivalSpec::Closed {
        users: USERS,
        think_mean_s: 1.0 / SPEED,
        requests_per_user: 12,
    };
    let plan = Plan::build(&spec, &arrival).expect("plan");
    let plan_path = root.0.join("plan.bin");
    std::fs::write(&plan_path, plan.to_bytes().expect("plan bytes")).unwrap();

    // Live: 2 engines, the router, the closed-loop driver.
    let mut engines = Vec::new();
    let mut urls = Vec::new();
    for i in 0..2 {
        let mut cmd = Command::new(release_bin("engine"));
        cmd.args(["--port", "0", "--enable-prompt-tokens-details"])
            .args(["--num-gpu-blocks", &BLOCKS.to_string()])
            .args(["--speed", &SPEED.to_string(), "--seed", &i.to_string()]);
        let (g, url) = start(&format!("engine{i}"), cmd, &live);
        engines.push(g);
        urls.push(url);
    }
    let mut cmd = Command::new(release_bin("router"));
    cmd.args(["--port", "0", "--replicas", &urls.join(",")])
        .args(["--policy", POLICY, "--model", sim::DEFAULT_MODEL])
        .arg("--rows")
        .arg(live.join("router.csv"));
    let (mut router, router_url) = start("router", cmd, &live);
    let mut cmd = Command::new(release_bin("driver"));
    cmd.args(["closed", "--url", &router_url, "--progress", "off"])
        .arg("--plan")
        .arg(&plan_path)
        .arg("--out")
        .arg(live.join("client.csv"));
    let mut driver =
        ChildGuard::spawn("driver", cmd, &live.join("driver.log")).expect("driver starts");
    let status = driver
        .wait_timeout(Duration::from_secs(120))
        .expect("driver waits")
        .expect("the driver finishes within 120 s");
    assert!(status.success(), "driver failed: {status}");
    router.terminate(Duration::from_secs(10));
    drop(engines);

    // Virtual: the same plan and engine config.
    let mut cfg = sim::SimConfig::new(2, POLICY);
    cfg.engine.num_gpu_blocks = BLOCKS;
    cfg.engine.model.speed = SPEED;
    let meta = sim::CellMeta::default();
    sim::run_cell(&cfg, &plan, &virt, &meta).expect("virtual cell");

    // The reference SLO (990 / 24 ms at speed 1), on this clock.
    let slo = analysis::Slo {
        ttft_ms: 990.0 / SPEED,
        itl_ms: 24.0 / SPEED,
    };
    let (g_live, n_live) = goodput(&live, &slo);
    let (g_virt, n_virt) = goodput(&virt, &slo);
    eprintln!(
        "cross-check {POLICY}: live {g_live:.3} req/s ({n_live} rows), virtual {g_virt:.3} req/s ({n_virt} rows)"
    );
    assert_eq!(n_live, n_virt, "both runs send the whole plan");
    assert!(g_virt > 0.0, "the virtual run has goodput");
    let diff = (g_live - g_virt).abs() / g_virt;
    assert!(
        diff <= TOLERANCE,
        "goodput live {g_live:.3} vs virtual {g_virt:.3} req/s differ by {:.1}% (> {:.0}%)",
        diff * 100.0,
        TOLERANCE * 100.0
    );
}
