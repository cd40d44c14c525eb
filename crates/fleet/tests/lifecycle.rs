//! Fleet lifecycle against `fake-replica` processes: spawn, readiness, health, cycle, kill,
//! restart, kill on drop, and errors that name the replica and its log file.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use fleet::evidence::{CheckStatus, EvidenceBounds, EvidenceConfig, EvidenceSampler};
use fleet::fleet::never;
use fleet::gpu::{FleetGpus, ScriptedGpus, ThrottleReasons};
use fleet::{
    ChildGuard, CommandSpec, EmulatedCache, EmulatedSpec, Fleet, FleetOptions, Source, StaticSpec,
    http,
};

const FAKE: &str = env!("CARGO_BIN_EXE_fake-replica");

/// A scratch directory removed when the test ends (pass or fail).
fn temp_dir(name: &str) -> test_support::TempDir {
    test_support::temp_dir(&format!("fleet-test-{name}"))
}

fn emulated(replicas: usize, extra: &[&str]) -> EmulatedSpec {
    EmulatedSpec {
        engine_bin: FAKE.into(),
        replicas,
        speed: 4.0,
        slowdowns: vec![1.0, 2.0],
        num_gpu_blocks: Some(512),
        model: "kvroute/emulated-8b".into(),
        seed: 7,
        kv_events: true,
        extra_args: extra.iter().map(|s| s.to_string()).collect(),
        cache: EmulatedCache::Paged,
    }
}

fn options(dir: &Path, ready_s: u64) -> FleetOptions {
    FleetOptions {
        ready_timeout: Duration::from_secs(ready_s),
        ..FleetOptions::new(dir.join("logs"))
    }
}

fn healthy(url: &str) -> bool {
    http::get(&http::join(url, "/health"), Duration::from_secs(2)).is_ok_and(|r| r.status == 200)
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

fn metrics(url: &str) -> String {
    http::get(&http::join(url, "/metrics"), Duration::from_secs(2))
        .unwrap()
        .text()
}

#[test]
fn emulated_fleet_starts_cycles_kills_and_restarts() {
    let dir = temp_dir("emulated");
    let mut fleet =
        Fleet::new(Source::Emulated(emulated(2, &[])), options(dir.path(), 20)).unwrap();
    fleet.start(&never).unwrap();
    let first = fleet.replicas();
    assert_eq!(first.len(), 2);
    for r in &first {
        assert!(healthy(&r.url), "replica {} healthy", r.index);
        let cfg = fleet::metrics::cache_config(&metrics(&r.url)).unwrap();
        assert_eq!(
            cfg.num_gpu_blocks, 512,
            "--num-gpu-blocks reached the replica"
        );
    }
    assert_eq!(first[1].slowdown, 2.0);
    let log = std::fs::read_to_string(first[1].log_path.as_ref().unwrap()).unwrap();
    assert!(
        log.contains("--slowdown 2") && log.contains("--kv-events-port 0"),
        "{log}"
    );
    assert!(
        log.contains("banner line"),
        "stdout is captured in the log: {log}"
    );

    fleet.cycle(&never).unwrap();
    let cycled = fleet.replicas();
    for (a, b) in first.iter().zip(&cycled) {
        assert_ne!(a.pid, b.pid, "cycling restarts the process");
        assert!(!alive(a.pid.unwrap()), "the old process is gone");
        assert!(healthy(&b.url));
    }

    fleet.kill_one(0).unwrap();
    assert!(!alive(cycled[0].pid.unwrap()));
    assert!(!healthy(&cycled[0].url));
    assert!(
        fleet.kill_one(0).is_err(),
        "a dead replica cannot be killed twice"
    );
    fleet.restart_one(0, &never).unwrap();
    let restarted = fleet.replicas();
    assert_eq!(restarted[0].url, cycled[0].url, "restart keeps the port");
    assert!(healthy(&restarted[0].url));
    fleet.check_alive().unwrap();

    let pids: Vec<u32> = restarted.iter().filter_map(|r| r.pid).collect();
    drop(fleet);
    for pid in pids {
        assert!(!alive(pid), "drop killed {pid}");
    }
}

#[test]
fn child_is_killed_on_drop_even_when_panicking() {
    let dir = temp_dir("panic");
    let log = dir.path().join("child.log");
    let (tx, rx) = std::sync::mpsc::channel();
    let result = std::panic::catch_unwind(move || {
        let mut guard = ChildGuard::spawn("fake", Command::new(FAKE), &log).unwrap();
        guard.wait_ready(Duration::from_secs(20), &never).unwrap();
        tx.send(guard.pid().unwrap()).unwrap();
        panic!("the test panics with a live child");
    });
    assert!(result.is_err());
    let pid = rx.recv().unwrap();
    assert!(!alive(pid), "child {pid} was killed while unwinding");
}

#[test]
fn readiness_timeout_names_replica_and_log() {
    let dir = temp_dir("silent");
    let mut fleet = Fleet::new(
        Source::Emulated(emulated(1, &["--mode", "silent"])),
        options(dir.path(), 1),
    )
    .unwrap();
    let err = format!("{:#}", fleet.start(&never).unwrap_err());
    assert!(err.contains("replica 0"), "{err}");
    assert!(err.contains("replica-0.log"), "{err}");
    assert!(err.contains("no readiness line"), "{err}");
}

#[test]
fn health_timeout_names_replica_and_log() {
    let dir = temp_dir("unhealthy");
    let mut fleet = Fleet::new(
        Source::Emulated(emulated(1, &["--mode", "unhealthy"])),
        options(dir.path(), 1),
    )
    .unwrap();
    let err = format!("{:#}", fleet.start(&never).unwrap_err());
    assert!(
        err.contains("replica 0") && err.contains("not healthy"),
        "{err}"
    );
    assert!(
        err.contains("503") && err.contains("replica-0.log"),
        "{err}"
    );
}

#[test]
fn early_exit_is_reported_with_its_log() {
    let dir = temp_dir("exit");
    let mut fleet = Fleet::new(
        Source::Emulated(emulated(1, &["--mode", "exit"])),
        options(dir.path(), 20),
    )
    .unwrap();
    let err = format!("{:#}", fleet.start(&never).unwrap_err());
    assert!(
        err.contains("replica 0") && err.contains("replica-0.log"),
        "{err}"
    );
    let log = std::fs::read_to_string(dir.path().join("logs/replica-0.log")).unwrap();
    assert!(log.contains("boom"), "stderr is captured in the log: {log}");
}

#[test]
fn interrupt_stops_the_wait() {
    let dir = temp_dir("interrupt");
    let mut fleet = Fleet::new(
        Source::Emulated(emulated(1, &["--mode", "silent"])),
        options(dir.path(), 60),
    )
    .unwrap();
    let err = format!("{:#}", fleet.start(&|| true).unwrap_err());
    assert!(err.contains("interrupted"), "{err}");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn command_source_substitutes_port_and_gpu() {
    let dir = temp_dir("command");
    let spec = CommandSpec {
        template: format!("{FAKE} --port {{port}} --no-readiness --served {{model}}"),
        model: "m".into(),
        replicas: 1,
        host: "127.0.0.1".into(),
        base_port: free_port(),
        kv_base_port: None,
        gpus: vec!["3".into()],
    };
    let mut fleet = Fleet::new(Source::Command(spec), options(dir.path(), 20)).unwrap();
    fleet.start(&never).unwrap();
    let r = &fleet.replicas()[0];
    assert!(metrics(&r.url).contains("cuda_visible_devices=\"3\""));
    let pid = r.pid.unwrap();
    fleet.stop();
    assert!(!alive(pid));
}

#[test]
fn static_source_cycles_by_resetting_the_prefix_cache() {
    let dir = temp_dir("static");
    let mut replica =
        ChildGuard::spawn("external", Command::new(FAKE), &dir.path().join("ext.log")).unwrap();
    let url = replica
        .wait_ready(Duration::from_secs(20), &never)
        .unwrap()
        .url();
    let mut fleet = Fleet::new(
        Source::Static(StaticSpec {
            urls: vec![url.clone()],
            kv_events: vec![],
        }),
        options(dir.path(), 20),
    )
    .unwrap();
    fleet.start(&never).unwrap();
    assert!(
        fleet.kill_one(0).is_err(),
        "static replicas are not ours to kill"
    );
    fleet.cycle(&never).unwrap();
    fleet.cycle(&never).unwrap();
    assert!(metrics(&url).contains("fake_resets_total 2"));
    drop(fleet);
    assert!(
        healthy(&url),
        "dropping a static fleet leaves its replicas alone"
    );
}

#[test]
fn evidence_reads_lateness_and_discards_a_late_cell() {
    let dir = temp_dir("evidence");
    let gpus = Arc::new(ScriptedGpus::new(1));
    let mut fleet = Fleet::new(
        Source::Emulated(emulated(2, &["--lateness-ms", "20"])),
        options(dir.path(), 20),
    )
    .unwrap()
    .with_gpu_backend(gpus.clone());
    fleet.start(&never).unwrap();
    let out = dir.path().join("evidence.jsonl");
    let sampler = EvidenceSampler::start(
        EvidenceConfig {
            lateness_urls: fleet.urls(),
            fleet_process_groups: fleet.process_groups(),
            check_foreign: true,
            gpu: true,
            interval: Duration::from_millis(20),
            fleet_gpus: fleet.gpus(),
        },
        &out,
    )
    .unwrap();
    let summary = sampler.finish().unwrap();
    assert_eq!(summary.lateness.len(), 2);
    for l in &summary.lateness {
        assert!(l.steps >= 10.0);
        assert_eq!(l.p99_ms, Some(25.0), "20 ms lands in the 25 ms bucket");
    }
    let bounds = |max_lateness_p99_ms| EvidenceBounds {
        max_lateness_p99_ms,
        max_throttle_share: Some(0.0),
    };
    let err = summary.check(&bounds(5.0)).unwrap_err();
    assert!(err.contains("lateness p99 25.000 ms"), "{err}");
    assert!(summary.check(&bounds(30.0)).is_ok());
    // An emulated fleet reads no GPU, whatever the caller asks: the backend was never called.
    assert_eq!(gpus.calls(), 0);
    assert_eq!(summary.gpu_status, "no GPU");
    assert!(matches!(summary.foreign_check, CheckStatus::Off(_)));
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(text.lines().any(|l| l.contains("\"kind\":\"engine\"")));
}

/// A pid above Linux's largest `pid_max`: never in /proc, like a host pid seen from a container.
const HOST_PID: u32 = 5_000_000;

#[test]
fn command_fleet_knows_its_processes_from_the_start_even_without_proc() {
    let dir = temp_dir("command-gpu");
    let gpus = Arc::new(ScriptedGpus::new(4));
    gpus.push_throttle(3, ThrottleReasons::GPU_IDLE);
    // Card 3 before the spawn: pid 1 (not ours); once the replica is ready: also its worker,
    // whose host pid /proc cannot show.
    gpus.push_processes(3, &[1], &[])
        .push_processes(3, &[1, HOST_PID], &[]);
    let spec = CommandSpec {
        template: format!("{FAKE} --port {{port}} --no-readiness"),
        model: "m".into(),
        replicas: 1,
        host: "127.0.0.1".into(),
        base_port: free_port(),
        kv_base_port: None,
        gpus: vec!["3".into()],
    };
    let mut fleet = Fleet::new(Source::Command(spec), options(dir.path(), 20))
        .unwrap()
        .with_gpu_backend(gpus.clone());
    fleet.start(&never).unwrap();
    let FleetGpus::Started(started) = fleet.gpus() else {
        panic!("a command fleet knows its cards");
    };
    assert_eq!(started.replica_devices, vec![Ok(vec![3])]);
    assert_eq!(
        started.started_pids.get(&3),
        Some(&Ok(BTreeSet::from([HOST_PID])))
    );

    let sampler = EvidenceSampler::start(
        EvidenceConfig {
            lateness_urls: vec![],
            fleet_process_groups: fleet.process_groups(),
            check_foreign: true,
            gpu: true,
            interval: Duration::from_millis(20),
            fleet_gpus: fleet.gpus(),
        },
        &dir.path().join("evidence.jsonl"),
    )
    .unwrap();
    let summary = sampler.finish().unwrap();
    assert_eq!(summary.foreign_check, CheckStatus::Done);
    assert_eq!(summary.throttle_check, CheckStatus::Done);
    let foreign: Vec<u32> = summary.foreign_processes.iter().map(|f| f.1).collect();
    assert_eq!(
        foreign,
        vec![1],
        "there before the fleet: foreign; {HOST_PID}: ours"
    );

    // A restarted replica's new processes are the fleet's too.
    gpus.push_processes(3, &[1, HOST_PID, HOST_PID + 1], &[]);
    fleet.restart_one(0, &never).unwrap();
    let FleetGpus::Started(started) = fleet.gpus() else {
        unreachable!()
    };
    assert_eq!(
        started.started_pids.get(&3),
        Some(&Ok(BTreeSet::from([HOST_PID, HOST_PID + 1])))
    );
}
