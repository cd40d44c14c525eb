//! Several kvroute routers behind HAProxy ([`Ingress::Routers`]) in front of three emulated
//! replicas, through [`IngressProcess`] as a sweep cell runs them: streamed chat requests succeed
//! through the front, both routers serve some behind round robin, every turn of a session goes
//! through one router behind session hashing, routers sharing their decisions publish, receive and
//! apply each other's, and the cell keeps one merged `router.csv` (one row per request) beside
//! `router-<K>.csv`, and a `routers.json` that parses.
//!
//! Needs `haproxy` (fails saying how to install it: a skip would pass silently) and the release
//! `engine` and `router`, which it builds first (a no-op when fresh). A few seconds once built;
//! ignored by default: `cargo test -p fleet --test routers -- --include-ignored`.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::Duration;

use fleet::fleet::never;
use fleet::http;
use fleet::ingress::haproxy::{INSTALL_HINT, haproxy_bin};
use fleet::ingress::{Front, HaproxySettings, RoutersRecord, RoutersSettings};
use fleet::{
    EmulatedCache, EmulatedSpec, Fleet, FleetOptions, Ingress, IngressProcess, RouterSettings,
    Source,
};

use test_support::release_bin;

const MODEL: &str = "kvroute/emulated-8b";

/// One streamed chat completion through `url`; panics unless it is a 200 that ends with
/// `data: [DONE]`.
fn chat(url: &str, session: &str, request_id: &str, content: &str) {
    let (authority, _) = http::split_url(url).unwrap();
    let body = serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
    .to_string();
    let mut s = TcpStream::connect(&authority).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {authority}\r\nx-session-id: {session}\r\nx-request-id: {request_id}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("HTTP/1.1 200"), "{request_id}: {text}");
    assert!(
        text.contains("text/event-stream") && text.contains("data: [DONE]"),
        "{request_id} streams whole: {text}"
    );
}

/// Runs `sessions` × `turns` streamed requests (turn by turn, every session in each turn)
/// through `routers` routers behind `front` on three emulated replicas, finishes the ingress and
/// returns the cell directory (kept by the returned guard) and the (session, request id) pairs.
/// The settings the sweep's flags `--routers count --front front [--share-decisions]
/// [--share-loads]` give (through `Ingress::with_routers`, as the sweep gets them).
fn routers(count: u32, front: Front, share: bool, share_loads: bool) -> RoutersSettings {
    match Ingress::with_routers(Ingress::Router, count, Some(front), share, share_loads).unwrap() {
        Ingress::Routers(r) => r,
        other => panic!("{count} routers behind a front are routers, got {other:?}"),
    }
}

fn cell(
    name: &str,
    settings: RoutersSettings,
    sessions: usize,
    turns: usize,
) -> (test_support::TempDir, Vec<(String, String)>) {
    if let Err(e) = haproxy_bin() {
        panic!("this test needs HAProxy: {e:#}; {INSTALL_HINT}");
    }
    let (engine_bin, router_bin) = (release_bin("engine"), release_bin("router"));
    let dir = test_support::temp_dir(&format!("fleet-test-routers-{name}"));
    let source = Source::Emulated(EmulatedSpec {
        engine_bin,
        replicas: 3,
        speed: 10.0,
        slowdowns: vec![1.0; 3],
        num_gpu_blocks: Some(256),
        model: MODEL.into(),
        seed: 1,
        kv_events: false,
        extra_args: Vec::new(),
        cache: EmulatedCache::Paged,
    });
    let options = FleetOptions {
        ready_timeout: Duration::from_secs(60),
        ..FleetOptions::new(dir.path().join("logs"))
    };
    let mut fleet = Fleet::new(source, options).unwrap();
    fleet.start(&never).unwrap();
    let cell = dir.path().join("cell");
    std::fs::create_dir_all(&cell).unwrap();
    let router = RouterSettings {
        policy: "prefix-affinity".into(),
        model: MODEL.into(),
        seed: 1,
        ..RouterSettings::default()
    };
    let (process, url) = IngressProcess::start(
        Ingress::Routers(settings),
        &router_bin,
        &fleet,
        &router,
        &HaproxySettings::default(),
        &cell,
        &never,
    )
    .unwrap();
    let mut sent = Vec::new();
    for turn in 0..turns {
        for s in 0..sessions {
            let (session, id) = (format!("conv-{s}"), format!("q-{s}-{turn}"));
            // Long enough for several of the router's 64-byte belief blocks: a prompt shorter
            // than one block has no keys, and its decision is not shared.
            let context =
                format!("Session {s} keeps a long shared context about the sea. ").repeat(12);
            chat(
                &url,
                &session,
                &id,
                &format!("{context}Turn {turn}: go on."),
            );
            sent.push((session, id));
        }
    }
    let warning = process.finish(&cell, Duration::from_secs(10)).unwrap();
    assert_eq!(warning, None, "every process stops within its grace period");
    fleet.stop();
    (dir, sent)
}

/// The merged rows, the per-router rows (by router index) and `routers.json` of a cell.
fn read_cell(
    cell: &Path,
    routers: usize,
) -> (
    Vec<analysis::RouterRow>,
    Vec<Vec<analysis::RouterRow>>,
    RoutersRecord,
) {
    let merged = analysis::read_router_csv(&cell.join("router.csv")).unwrap();
    let per: Vec<_> = (0..routers)
        .map(|k| {
            assert!(cell.join(format!("router-{k}.log")).is_file());
            analysis::read_router_csv(&cell.join(format!("router-{k}.csv"))).unwrap()
        })
        .collect();
    let record: RoutersRecord =
        serde_json::from_str(&std::fs::read_to_string(cell.join("routers.json")).unwrap()).unwrap();
    (merged, per, record)
}

/// What every cell of several routers must show, whatever the front.
fn check_common(
    sent: &[(String, String)],
    merged: &[analysis::RouterRow],
    per: &[Vec<analysis::RouterRow>],
    record: &RoutersRecord,
) {
    // One merged row per request, each once; and the per-router files hold the same rows.
    let mut ids: Vec<&str> = merged.iter().map(|r| r.request_id.as_str()).collect();
    ids.sort_unstable();
    let mut want: Vec<&str> = sent.iter().map(|(_, id)| id.as_str()).collect();
    want.sort_unstable();
    assert_eq!(ids, want);
    assert_eq!(per.iter().map(Vec::len).sum::<usize>(), sent.len());
    assert!(
        merged
            .iter()
            .all(|r| r.policy == "prefix-affinity" && r.upstream_status == Some(200)),
        "{merged:?}"
    );
    // routers.json: one entry per router, its rows, its CPU, a clean stop; r0's clock is the
    // merged file's.
    assert_eq!(record.per_router.len(), per.len());
    for (k, (r, rows)) in record.per_router.iter().zip(per).enumerate() {
        assert_eq!(r.id, format!("r{k}"));
        assert_eq!(r.requests, rows.len() as u64);
        assert!(r.cpu_s.is_some_and(|s| s >= 0.0), "{r:?}");
        assert!(r.exited, "{r:?}");
        assert_eq!(
            r.shared_decisions.is_some(),
            record.share_decisions,
            "{r:?}"
        );
        assert!(r.clock_offset_s >= 0.0);
    }
    assert_eq!(record.per_router[0].clock_offset_s, 0.0);
    assert!(record.clock_ticks_per_s > 0);
    // HAProxy's per-server counts: server r<K> passed router r<K>'s requests.
    let by_server: BTreeMap<&str, u64> = record
        .front_servers
        .iter()
        .map(|s| (s.name.as_str(), s.stot))
        .collect();
    for r in &record.per_router {
        assert_eq!(
            by_server.get(r.id.as_str()),
            Some(&r.requests),
            "{by_server:?}"
        );
    }
}

#[test]
#[ignore = "needs HAProxy and the release binaries: bash .ci/setup-packages.sh && cargo build --release"]
fn two_routers_behind_round_robin_both_serve_and_merge_their_rows() {
    let settings = routers(2, Front::RoundRobin, false, false);
    let (dir, sent) = cell("rr", settings, 4, 2);
    let cell = dir.path().join("cell");
    let cfg = std::fs::read_to_string(cell.join("haproxy.cfg")).unwrap();
    assert!(
        cfg.contains("backend routers\n    balance roundrobin\n"),
        "{cfg}"
    );
    let (merged, per, record) = read_cell(&cell, 2);
    check_common(&sent, &merged, &per, &record);
    assert_eq!((record.routers, record.front), (2, Front::RoundRobin));
    assert!(
        per.iter().all(|rows| !rows.is_empty()),
        "both routers served some: {:?}",
        record.per_router
    );
    eprintln!(
        "2 routers behind round robin: {:?}",
        record
            .per_router
            .iter()
            .map(|r| (r.id.as_str(), r.requests, r.cpu_s))
            .collect::<Vec<_>>()
    );
}

#[test]
#[ignore = "needs HAProxy and the release binaries: bash .ci/setup-packages.sh && cargo build --release"]
fn behind_session_hashing_every_turn_of_a_session_goes_through_one_router() {
    let settings = routers(2, Front::SessionHash, false, false);
    let (dir, sent) = cell("hash", settings, 6, 3);
    let cell = dir.path().join("cell");
    let cfg = std::fs::read_to_string(cell.join("haproxy.cfg")).unwrap();
    assert!(
        cfg.contains("    balance hdr(x-session-id)\n    hash-type consistent\n")
            && !cfg.contains("hash-balance-factor"),
        "{cfg}"
    );
    let (merged, per, record) = read_cell(&cell, 2);
    check_common(&sent, &merged, &per, &record);
    assert_eq!(record.front, Front::SessionHash);
    let mut router_of: BTreeMap<String, usize> = BTreeMap::new();
    for (k, rows) in per.iter().enumerate() {
        for r in rows {
            let session = r
                .session_id
                .clone()
                .expect("x-session-id reaches the router");
            let first = *router_of.entry(session.clone()).or_insert(k);
            assert_eq!(first, k, "session {session} went through r{first} and r{k}");
        }
    }
    assert_eq!(router_of.len(), 6, "{router_of:?}");
    eprintln!("sessions by router behind session hashing: {router_of:?}");
}

#[test]
#[ignore = "needs HAProxy and the release binaries: bash .ci/setup-packages.sh && cargo build --release"]
fn routers_sharing_decisions_publish_receive_and_apply_each_others() {
    let settings = routers(2, Front::RoundRobin, true, false);
    let (dir, sent) = cell("share", settings, 4, 3);
    let (merged, per, record) = read_cell(&dir.path().join("cell"), 2);
    check_common(&sent, &merged, &per, &record);
    assert!(record.share_decisions);
    let counters: Vec<&BTreeMap<String, f64>> = record
        .per_router
        .iter()
        .map(|r| {
            r.shared_decisions
                .as_ref()
                .expect("scraped before the stop")
        })
        .collect();
    for (r, c) in record.per_router.iter().zip(&counters) {
        // One message per request served (prefix-affinity keys every prompt), none lost.
        assert!(
            c["published"] >= 1.0 && c["published_bytes"] > 0.0,
            "{}: {c:?}",
            r.id
        );
        assert!(
            c["received"] >= 1.0 && c["applied"] >= 1.0,
            "{}: {c:?}",
            r.id
        );
        for zero in [
            "dropped",
            "gaps",
            "missed",
            "unknown_replica",
            "decode_errors",
        ] {
            assert_eq!(c[zero], 0.0, "{} {zero}: {c:?}", r.id);
        }
    }
    // What one router received, the other published.
    assert!(counters[0]["received"] <= counters[1]["published"]);
    assert!(counters[1]["received"] <= counters[0]["published"]);
    eprintln!(
        "2 routers sharing decisions: {:?}",
        record
            .per_router
            .iter()
            .map(|r| (r.id.as_str(), r.requests, r.shared_decisions.clone()))
            .collect::<Vec<_>>()
    );
}

#[test]
#[ignore = "needs HAProxy and the release binaries: bash .ci/setup-packages.sh && cargo build --release"]
fn routers_sharing_loads_publish_and_apply_each_others_views() {
    let settings = routers(2, Front::RoundRobin, true, true);
    let (dir, sent) = cell("share-loads", settings, 4, 3);
    let (merged, per, record) = read_cell(&dir.path().join("cell"), 2);
    check_common(&sent, &merged, &per, &record);
    assert!(record.share_decisions && record.share_loads);
    for r in &record.per_router {
        let c = r
            .shared_decisions
            .as_ref()
            .expect("scraped before the stop");
        // Every change of its in-flight counts (and a heartbeat) is a message, and the peer
        // applies what it hears; nobody falls silent while the routers run.
        assert!(c["loads_published"] >= 2.0, "{}: {c:?}", r.id);
        assert!(c["loads_received"] >= 1.0, "{}: {c:?}", r.id);
        assert_eq!(
            (c["loads_expired"], c["loads_unknown_replica"]),
            (0.0, 0.0),
            "{}: {c:?}",
            r.id
        );
        assert!(
            c["applied"] >= 1.0,
            "decisions still shared: {}: {c:?}",
            r.id
        );
    }
}

#[test]
#[ignore = "needs HAProxy and the release binaries: bash .ci/setup-packages.sh && cargo build --release"]
fn one_router_behind_the_front_is_the_control_arm() {
    let settings = routers(1, Front::RoundRobin, false, false);
    let (dir, sent) = cell("one", settings, 2, 2);
    let (merged, per, record) = read_cell(&dir.path().join("cell"), 1);
    check_common(&sent, &merged, &per, &record);
    assert_eq!(record.per_router[0].requests, 4);
}
