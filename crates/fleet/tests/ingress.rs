//! The ingress against real processes: SSE streams through HAProxy whole and sessions stick
//! (needs `haproxy`), and three cells through [`IngressProcess`] — HAProxy, the router and Envoy
//! with the endpoint picker — on emulated engines with the driver (needs HAProxy, Envoy and the
//! release binaries). Both are ignored by default; a missing dependency fails them, saying how to
//! install it: `cargo test -p fleet --test ingress -- --include-ignored`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use fleet::fleet::never;
use fleet::http;
use fleet::ingress::haproxy::{INSTALL_HINT, haproxy_bin};
use fleet::ingress::{
    Haproxy, HaproxySettings, Ingress, IngressProcess, RouterSettings, ServerStat,
};
use fleet::{DriverSettings, EmulatedCache, EmulatedSpec, Fleet, FleetOptions, Source};

use test_support::{MockReplica, Script, release_bin};

/// A scratch directory removed when the test ends (pass or fail).
fn temp_dir(name: &str) -> test_support::TempDir {
    test_support::temp_dir(&format!("fleet-test-{name}"))
}

/// Three mock replicas (they answer `/health`) whose streams send one SSE event and then hold
/// the second until the test releases it, once it has read the first through HAProxy (so
/// buffering would time out); each names itself in an `x-backend` header.
fn sse_backends() -> Vec<MockReplica> {
    (0..3)
        .map(|i| {
            MockReplica::spawn(Script {
                events: 2,
                hold: true,
                response_headers: vec![("x-backend".into(), i.to_string())],
                ..Script::default()
            })
        })
        .collect()
}

/// Sends one streamed request for `session`; returns the backend that served it.
fn stream_once(url: &str, session: &str, backends: &[MockReplica]) -> usize {
    let (authority, _) = http::split_url(url).unwrap();
    let mut s = TcpStream::connect(&authority).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let body = r#"{"stream":true}"#;
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {authority}\r\nx-session-id: {session}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let backend = loop {
        let n = s
            .read(&mut buf)
            .expect("the first SSE event must pass through HAProxy before the stream ends");
        assert!(n > 0, "the stream ended before its first event");
        seen.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&seen).to_ascii_lowercase();
        let Some((head, body)) = text.split_once("\r\n\r\n") else {
            continue;
        };
        if body.contains("data: {") {
            let backend = head
                .lines()
                .find_map(|l| l.strip_prefix("x-backend: "))
                .unwrap_or_else(|| panic!("no x-backend header: {head}"));
            break backend.trim().parse::<usize>().unwrap();
        }
    };
    assert!(
        !String::from_utf8_lossy(&seen).contains("[DONE]"),
        "the second event may only be sent after the first was read"
    );
    backends[backend].state.release(1);
    let _ = s.read_to_end(&mut seen);
    let text = String::from_utf8_lossy(&seen);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(
        text.contains("data: [DONE]"),
        "the stream ends whole: {text}"
    );
    backend
}

#[test]
#[ignore = "needs HAProxy: bash .ci/setup-packages.sh"]
fn sse_streams_through_haproxy_and_sessions_stick() {
    // A missing HAProxy fails the test, saying how to install it: a skip would pass silently.
    if let Err(e) = haproxy_bin() {
        panic!("this test needs HAProxy: {e:#}; {INSTALL_HINT}");
    }
    let backends = sse_backends();
    let urls: Vec<String> = backends.iter().map(|b| b.url.clone()).collect();
    let dir = temp_dir("haproxy");
    let mut h = Haproxy::start(&urls, &HaproxySettings::default(), dir.path(), &never).unwrap();
    let sticky: Vec<usize> = (0..4)
        .map(|_| stream_once(h.url(), "conv-7", &backends))
        .collect();
    assert!(
        sticky.iter().all(|&b| b == sticky[0]),
        "one session, one backend: {sticky:?}"
    );
    let mut used: Vec<usize> = (0..12)
        .map(|i| stream_once(h.url(), &format!("conv-{i}"), &backends))
        .collect();
    used.sort_unstable();
    used.dedup();
    assert!(
        used.len() > 1,
        "sessions spread over the backends: {used:?}"
    );
    let stats = h
        .write_stats(&dir.path().join("haproxy-stats.json"))
        .unwrap();
    assert_eq!(stats.len(), 3);
    assert!(dir.path().join("haproxy-stats.json").is_file());
    assert_eq!(stats.iter().map(|s| s.stot).sum::<u64>(), 16, "{stats:?}");
    assert!(
        h.terminate(Duration::from_secs(5)).is_some(),
        "HAProxy stops on SIGUSR1"
    );
}

/// Three cells through [`IngressProcess`] on three emulated engines — HAProxy, the router
/// (session-bounded) and Envoy with the endpoint picker (session-bounded) — the same open-loop
/// plan for a few seconds: every request streams through HAProxy whole, its cell has HAProxy's
/// counts and no router rows; every request streams through Envoy whole with one picker row
/// each; the TTFTs are printed side by side. About 15 s once the release binaries are built.
#[test]
#[ignore = "needs HAProxy, Envoy and the release binaries: bash .ci/setup-packages.sh && bash scripts/envoy.sh && cargo build --release"]
fn the_driver_streams_through_haproxy_to_emulated_engines() {
    let (engine_bin, router_bin, driver_bin) = (
        release_bin("engine"),
        release_bin("router"),
        release_bin("driver"),
    );
    release_bin("epp"); // beside the router's, where the Envoy cell finds it
    let dir = temp_dir("haproxy-fleet");
    let model = "kvroute/emulated-8b";
    let source = Source::Emulated(EmulatedSpec {
        engine_bin,
        replicas: 3,
        speed: 10.0,
        slowdowns: vec![1.0; 3],
        num_gpu_blocks: Some(256),
        model: model.into(),
        seed: 1,
        kv_events: false,
        extra_args: Vec::new(),
        cache: EmulatedCache::Paged,
    });
    let options = FleetOptions {
        ready_timeout: Duration::from_secs(120),
        ..FleetOptions::new(dir.path().join("logs"))
    };
    let mut fleet = Fleet::new(source, options).unwrap();
    let plan = workload::Plan::build(
        &workload::WorkloadSpec {
            seed: 3,
            sizing: workload::Sizing::Conversations(24),
            ..workload::WorkloadSpec::default()
        },
        &workload::ArrivalSpec::Open {
            rate_rps: 20.0,
            duration_s: 4.0,
            start: workload::OpenStart::Fresh,
        },
    )
    .unwrap();
    let plan_path = dir.path().join("plan.bin");
    std::fs::write(&plan_path, plan.to_bytes().unwrap()).unwrap();
    let router_settings = RouterSettings {
        policy: "session-bounded".into(),
        model: model.into(),
        seed: 1,
        ..RouterSettings::default()
    };
    let mut rows_by_ingress = Vec::new();
    for ingress in [Ingress::Haproxy, Ingress::Router, Ingress::EnvoyEpp] {
        // Each pass on a fresh fleet, as a sweep cycles it per cell.
        fleet.cycle(&never).unwrap();
        let cell = dir.path().join(format!("{ingress:?}"));
        std::fs::create_dir_all(&cell).unwrap();
        let (process, url) = IngressProcess::start(
            ingress,
            &router_bin,
            &fleet,
            &router_settings,
            &HaproxySettings::default(),
            &cell,
            &never,
        )
        .unwrap();
        let client_csv = cell.join("client.csv");
        let mut driver = fleet::start_driver(
            &driver_bin,
            &url,
            &plan_path,
            &client_csv,
            &DriverSettings {
                mode: "open",
                warmup_s: 0.5,
                duration_s: Some(4.0),
                timeout_s: 20.0,
                model: model.into(),
                abandon_after_ms: None,
                keep_alive: true,
            },
            &cell.join("driver.log"),
        )
        .unwrap();
        fleet::wait_driver(
            &mut driver,
            &mut fleet,
            Duration::from_secs(60),
            &never,
            |_| Ok(()),
        )
        .unwrap();
        let warning = process.finish(&cell, Duration::from_secs(5)).unwrap();
        assert_eq!(warning, None, "{ingress:?} stops within its grace period");
        rows_by_ingress.push(analysis::read_client_csv(&client_csv).unwrap());
    }
    fleet.stop();
    let haproxy_cell = dir.path().join("Haproxy");
    assert!(haproxy_cell.join("haproxy.cfg").is_file());
    assert!(
        !haproxy_cell.join("router.csv").exists(),
        "an HAProxy cell has no router rows"
    );
    assert!(dir.path().join("Router").join("router.csv").is_file());
    let stats: Vec<ServerStat> = serde_json::from_str(
        &std::fs::read_to_string(haproxy_cell.join("haproxy-stats.json")).unwrap(),
    )
    .unwrap();
    let via_envoy = rows_by_ingress.pop().unwrap();
    let via_router = rows_by_ingress.pop().unwrap();
    let rows = rows_by_ingress.pop().unwrap();
    // Envoy + the endpoint picker: every request streamed whole, one picker row each.
    let envoy_cell = dir.path().join("EnvoyEpp");
    assert!(envoy_cell.join("envoy.json").is_file());
    let picker_rows = analysis::read_router_csv(&envoy_cell.join("router.csv")).unwrap();
    assert!(via_envoy.len() > 40, "{} rows", via_envoy.len());
    assert_eq!(picker_rows.len(), via_envoy.len());
    let ids: std::collections::HashSet<&str> =
        picker_rows.iter().map(|r| r.request_id.as_str()).collect();
    assert!(
        via_envoy
            .iter()
            .all(|c| ids.contains(c.request_id.as_str())),
        "every client row joins its picker row by x-request-id"
    );
    let failed: Vec<_> = via_envoy
        .iter()
        .filter(|r| r.error.is_some() || r.status != 200)
        .collect();
    assert!(failed.is_empty(), "{failed:?}");
    assert!(
        picker_rows
            .iter()
            .all(|r| r.policy == "session-bounded" && r.upstream_status == Some(200)),
        "{picker_rows:?}"
    );
    let ttft_envoy: Vec<f64> = via_envoy.iter().filter_map(|r| r.ttft_ms).collect();
    let overhead: Vec<f64> = picker_rows
        .iter()
        .filter_map(|r| r.overhead_us.map(|us| us as f64))
        .collect();
    let decide: Vec<f64> = picker_rows
        .iter()
        .filter_map(|r| r.decide_ns.map(|d| d as f64))
        .collect();
    eprintln!(
        "through Envoy + the endpoint picker (session-bounded): {} requests, TTFT p50 {:.2} ms; picker overhead_us p50 {:.0} p99 {:.0}, decide_ns p50 {:.0}",
        via_envoy.len(),
        analysis::stats::median(&ttft_envoy).unwrap_or(f64::NAN),
        analysis::stats::quantile(&overhead, 0.5).unwrap_or(f64::NAN),
        analysis::stats::quantile(&overhead, 0.99).unwrap_or(f64::NAN),
        analysis::stats::quantile(&decide, 0.5).unwrap_or(f64::NAN),
    );
    let ttft_router: Vec<f64> = via_router.iter().filter_map(|r| r.ttft_ms).collect();
    eprintln!(
        "through the router (session-bounded): {} requests, TTFT p50 {:.2} ms",
        via_router.len(),
        analysis::stats::median(&ttft_router).unwrap_or(f64::NAN)
    );
    assert!(rows.len() > 40, "{} rows", rows.len());
    let failed: Vec<_> = rows
        .iter()
        .filter(|r| r.error.is_some() || r.status != 200)
        .collect();
    assert!(failed.is_empty(), "{failed:?}");
    assert!(
        rows.iter()
            .all(|r| r.ttft_ms.is_some() && r.itl_p50_ms.is_some())
    );
    // Every request, plus the driver's preflight `GET /v1/models`.
    assert_eq!(
        stats.iter().map(|s| s.stot).sum::<u64>(),
        rows.len() as u64 + 1,
        "{stats:?}"
    );
    let ttft: Vec<f64> = rows.iter().filter_map(|r| r.ttft_ms).collect();
    let itl: Vec<f64> = rows.iter().filter_map(|r| r.itl_p50_ms).collect();
    eprintln!(
        "through HAProxy: {} requests, TTFT p50 {:.2} ms, ITL p50 {:.3} ms, per server {:?}",
        rows.len(),
        analysis::stats::median(&ttft).unwrap(),
        analysis::stats::median(&itl).unwrap(),
        stats
            .iter()
            .map(|s| (s.name.as_str(), s.stot))
            .collect::<Vec<_>>()
    );
}
