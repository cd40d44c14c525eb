//! A real Envoy (ext_proc in full-duplex streamed mode + the `override_host` policy) in front of
//! three emulated replicas, with the endpoint picker deciding: streamed chat completions go
//! where the picker said (checked against the engines' own counters, not the picker's word), the
//! picker reads the served endpoint back and writes its rows; shedding is a 429 and an empty
//! fleet a 503 from the picker; gRPC health answers. Envoy comes from `scripts/envoy.sh`; the tests
//! are ignored by default (`cargo test -p epp --test envoy -- --include-ignored`), and without
//! Envoy they fail saying so. The endpoint file's watch needs no Envoy and always runs.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use engine::server::{DEFAULT_MODEL, Server, ServerConfig};
use epp::envoy::{Bootstrap, EnvoyProcess};
use epp::{Epp, EppConfig};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use test_support::{eventually, temp_dir};

const WAIT: Duration = Duration::from_secs(20);

async fn start_engine(speed: f64) -> Server {
    let mut cfg = ServerConfig {
        enable_prompt_tokens_details: true,
        ..ServerConfig::default()
    };
    cfg.engine.model.speed = speed;
    engine::server::start(cfg).await.expect("engine starts")
}

fn finished(e: &Server) -> u64 {
    let m = e.metrics();
    m.finished_stop + m.finished_length + m.aborted
}

fn envoy_bin() -> std::path::PathBuf {
    let bin = epp::envoy::default_bin();
    if let Err(e) = epp::envoy::check_installed(&bin) {
        panic!("{e}");
    }
    bin
}

fn convo(c: usize, turns: usize, max_tokens: u32) -> serde_json::Value {
    let mut msgs = vec![serde_json::json!({"role":"system","content":format!(
        "Conversation {c}. You are a meticulous assistant for a logistics company; answer with \
         numbered steps and cite the relevant policy section. {}",
        "Never invent shipment identifiers. ".repeat(8)
    )})];
    for t in 0..turns {
        msgs.push(serde_json::json!({"role":"user","content":format!("Question {t} of conversation {c}: where is my parcel?")}));
        if t + 1 < turns {
            msgs.push(
                serde_json::json!({"role":"assistant","content":format!("Scripted reply {t}.")}),
            );
        }
    }
    serde_json::json!({"model":DEFAULT_MODEL,"messages":msgs,"max_tokens":max_tokens,"ignore_eos":true,
        "stream":true,"stream_options":{"include_usage":true}})
}

struct Reply {
    status: u16,
    headers: http::HeaderMap,
    body: Incoming,
}

async fn post(url: &str, body: &serde_json::Value, session: &str) -> Reply {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let req = http::Request::post(format!("{url}/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-session-id", session)
        // The driver names every request; Envoy must pass the name on for rows to join.
        .header(
            "x-request-id",
            format!(
                "req-{session}-{}",
                body["messages"].as_array().map_or(0, Vec::len)
            ),
        )
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = tokio::time::timeout(WAIT, client.request(req))
        .await
        .expect("response head in time")
        .expect("response");
    let (parts, body) = resp.into_parts();
    Reply {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body,
    }
}

/// Reads the rest of a body; returns its SSE `data:` payloads (or the whole body as one entry
/// when it is not SSE) and the number of body frames received.
async fn read_all(mut body: Incoming) -> (Vec<String>, usize) {
    let mut buf = Vec::new();
    let mut frames = 0;
    while let Some(f) = tokio::time::timeout(WAIT, body.frame())
        .await
        .expect("stream stalled")
    {
        if let Some(d) = f.expect("body frame").data_ref() {
            frames += 1;
            buf.extend_from_slice(d);
        }
    }
    let text = String::from_utf8_lossy(&buf).into_owned();
    let events: Vec<String> = text
        .split("\n\n")
        .filter_map(|ev| ev.strip_prefix("data: ").map(str::to_string))
        .collect();
    if events.is_empty() {
        return (vec![text], frames);
    }
    (events, frames)
}

fn read_rows(path: &Path) -> Vec<HashMap<String, String>> {
    let mut rd = csv::Reader::from_path(path).expect("router.csv");
    let cols: Vec<String> = rd.headers().unwrap().iter().map(str::to_string).collect();
    rd.records()
        .map(|r| {
            let r = r.unwrap();
            cols.iter()
                .cloned()
                .zip(r.iter().map(str::to_string))
                .collect()
        })
        .collect()
}

/// A bodiless admin request; the status and the body.
async fn send(method: &str, url: &str) -> (u16, String) {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let req = http::Request::builder()
        .method(method)
        .uri(url)
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = tokio::time::timeout(WAIT, client.request(req))
        .await
        .expect("admin answers in time")
        .expect("admin response");
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

struct Setup {
    engines: Vec<Server>,
    epp: Epp,
    envoy: EnvoyProcess,
    url: String,
}

async fn setup(
    dir: &Path,
    policy: &str,
    speed: f64,
    max_in_flight: Option<u32>,
    health_interval_ms: u64,
    dead_first: bool,
) -> Setup {
    let bin = envoy_bin();
    let mut engines = Vec::new();
    for _ in 0..3 {
        engines.push(start_engine(speed).await);
    }
    let mut replicas: Vec<SocketAddr> = engines.iter().map(Server::addr).collect();
    if dead_first {
        // A port nobody listens on (bound, then closed), as replica 0.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        replicas.insert(0, l.local_addr().unwrap());
    }
    let mut p = policies::PolicySpec::named(policy);
    p.seed = 7;
    let mut rc = proxy::RouterConfig::new(
        replicas
            .iter()
            .map(|a| proxy::ReplicaSpec::new(format!("http://{a}")))
            .collect(),
        p,
    );
    rc.rows = Some(dir.join("router.csv"));
    rc.health_interval_ms = health_interval_ms;
    rc.max_in_flight_per_replica = max_in_flight;
    let epp = Epp::start(EppConfig::new(rc)).await.expect("epp starts");
    let envoy = EnvoyProcess::start(&bin, &Bootstrap::new(epp.local_addr(), replicas), dir, WAIT)
        .await
        .expect("envoy starts");
    let url = format!("http://{}", envoy.listen_addr());
    Setup {
        engines,
        epp,
        envoy,
        url,
    }
}

impl Setup {
    async fn stop(self) {
        self.envoy.kill().await;
        self.epp.shutdown(Duration::from_secs(1)).await;
        for e in self.engines {
            e.shutdown().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Envoy: bash scripts/envoy.sh"]
async fn envoy_streams_where_the_picker_decides() {
    let dir = temp_dir("affinity");
    let s = setup(dir.path(), "prefix-affinity", 200.0, None, 100, false).await;

    // Five conversations, three turns each, one request at a time.
    let mut homes: Vec<usize> = Vec::new();
    let mut sent = 0;
    for c in 0..5 {
        let mut home = None;
        for t in 1..=3 {
            let before: Vec<u64> = s.engines.iter().map(finished).collect();
            let r = post(&s.url, &convo(c, t, 6), &format!("c{c}")).await;
            assert_eq!(r.status, 200, "conversation {c} turn {t}");
            let ct = r.headers.get("content-type").unwrap().to_str().unwrap();
            assert!(ct.starts_with("text/event-stream"), "{ct}");
            let header_replica: usize = r.headers["x-kvroute-replica"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            let (events, frames) = read_all(r.body).await;
            assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
            assert!(events.len() >= 7 && frames >= 1, "{events:?}");
            let usage: serde_json::Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
            assert!(usage["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
            sent += 1;
            // Which engine ran it, by the engines' own counters.
            let mut ran = None;
            eventually("an engine finished the request", WAIT, || {
                std::future::ready({
                    let now: Vec<u64> = s.engines.iter().map(finished).collect();
                    ran = (0..3).find(|&i| now[i] > before[i]);
                    ran.is_some()
                })
            })
            .await;
            let ran = ran.unwrap();
            assert_eq!(
                header_replica, ran,
                "the picker's served replica is the engine that ran it"
            );
            match home {
                None => home = Some(ran),
                Some(h) => assert_eq!(ran, h, "conversation {c} turn {t} left its prefix"),
            }
        }
        homes.push(home.unwrap());
    }
    let distinct: std::collections::BTreeSet<_> = homes.iter().collect();
    assert!(distinct.len() >= 2, "conversations spread: {homes:?}");

    // Rows: one per request, served where picked, affinity branches on later turns, usage joined.
    let rows_path = dir.path().join("router.csv");
    let shared = s.epp.shared().clone();
    eventually("every row written", WAIT, || {
        std::future::ready(shared.rows.stats().written.load(Ordering::Relaxed) >= sent)
    })
    .await;
    s.stop().await;
    let rows = read_rows(&rows_path);
    assert_eq!(rows.len() as u64, sent, "{rows:?}");
    let mut by_session: HashMap<String, Vec<&HashMap<String, String>>> = HashMap::new();
    for r in &rows {
        assert_eq!(r["upstream_status"], "200", "{r:?}");
        assert_eq!(r["error"], "", "{r:?}");
        assert_eq!(r["policy"], "prefix-affinity");
        assert_eq!(r["attempts"], "1", "served where picked: {r:?}");
        assert!(
            r["request_id"].starts_with(&format!("req-{}-", r["session_id"])),
            "the client's x-request-id: {r:?}"
        );
        assert!(!r["decide_ns"].is_empty() && !r["overhead_us"].is_empty());
        assert!(r["prompt_tokens"].parse::<u64>().unwrap() > 0);
        by_session
            .entry(r["session_id"].clone())
            .or_default()
            .push(r);
    }
    for (c, home) in homes.iter().enumerate() {
        let mut rs = by_session.remove(&format!("c{c}")).expect("session rows");
        rs.sort_by(|a, b| {
            a["arrival_s"]
                .parse::<f64>()
                .unwrap()
                .total_cmp(&b["arrival_s"].parse().unwrap())
        });
        assert_eq!(rs.len(), 3);
        for (t, r) in rs.iter().enumerate() {
            assert_eq!(r["replica"], home.to_string(), "turn {t}: {r:?}");
            if t > 0 {
                assert_eq!(r["branch"], "match", "turn {t}: {r:?}");
                assert!(
                    r["cached_tokens"].parse::<u64>().unwrap() > 0,
                    "turn {t} hit the engine's cache: {r:?}"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Envoy: bash scripts/envoy.sh"]
async fn shedding_is_429_and_an_empty_fleet_503() {
    let dir = temp_dir("refusals");
    // Engines at modelled speed: a 100-token stream lasts seconds, so three of them hold every
    // replica at the ceiling of 1 while the fourth request is decided.
    let s = setup(dir.path(), "session-affinity", 1.0, Some(1), 100, false).await;
    let mut held = Vec::new();
    for c in 0..3 {
        let mut r = post(&s.url, &convo(c, 1, 100), &format!("hold{c}")).await;
        assert_eq!(r.status, 200);
        // Streamed through Envoy and the picker: the first event arrives while the engine is
        // still generating (the rest is read after the refusals below).
        let first = tokio::time::timeout(WAIT, r.body.frame())
            .await
            .expect("first event in time")
            .expect("a frame")
            .expect("frame ok");
        assert!(first.data_ref().is_some_and(|d| d.starts_with(b"data: ")));
        held.push(r);
    }
    let r = post(&s.url, &convo(9, 1, 4), "shed").await;
    assert_eq!(r.status, 429);
    assert_eq!(r.headers["retry-after"], "1");
    let (body, _) = read_all(r.body).await;
    let err: serde_json::Value = serde_json::from_str(&body[0]).unwrap();
    assert_eq!(err["error"]["type"], "overload", "{err}");
    for r in held {
        let (events, frames) = read_all(r.body).await;
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        assert!(frames > 10, "streamed frame by frame: {frames} frames");
    }

    // Every replica drained through the picker's admin API (the router's): no ready endpoint.
    let admin = format!("http://{}", s.epp.admin_addr());
    for r in s.epp.shared().replicas() {
        let (status, _) = send("POST", &format!("{admin}/admin/replicas/{}/drain", r.id)).await;
        assert_eq!(status, 200);
        assert!(r.draining.load(Ordering::Relaxed));
    }
    let r = post(&s.url, &convo(10, 1, 4), "none").await;
    assert_eq!(r.status, 503);
    let (body, _) = read_all(r.body).await;
    let err: serde_json::Value = serde_json::from_str(&body[0]).unwrap();
    assert_eq!(err["error"]["type"], "no_replica", "{err}");

    // The router's metrics, from the picker: three served, one shed, one without a replica.
    let (status, metrics) = send("GET", &format!("{admin}/metrics")).await;
    assert_eq!(status, 200);
    for line in [
        "kvroute_router_requests_total 5",
        "kvroute_router_overloaded_total 1",
        "kvroute_router_no_replica_total 1",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    }
    let served: u64 = metrics
        .lines()
        .filter(|l| l.starts_with("kvroute_router_served_total{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(served, 3);

    // gRPC health: the protocol's three service names and the server.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", s.epp.local_addr()))
        .unwrap()
        .connect()
        .await
        .expect("grpc connect");
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    for name in [
        "",
        "liveness",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        let st = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: name.into(),
            })
            .await
            .expect("health check")
            .into_inner()
            .status;
        assert_eq!(
            st,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );
    }

    let rows_path = dir.path().join("router.csv");
    let shared = s.epp.shared().clone();
    eventually("every row written", WAIT, || {
        std::future::ready(shared.rows.stats().written.load(Ordering::Relaxed) >= 5)
    })
    .await;
    s.stop().await;
    let rows = read_rows(&rows_path);
    let status: Vec<&str> = rows.iter().map(|r| r["upstream_status"].as_str()).collect();
    assert_eq!(
        status.iter().filter(|s| **s == "200").count(),
        3,
        "{rows:?}"
    );
    let shed = rows.iter().find(|r| r["session_id"] == "shed").unwrap();
    assert_eq!(shed["upstream_status"], "429");
    assert!(shed["error"].starts_with("overload: "), "{shed:?}");
    let none = rows.iter().find(|r| r["session_id"] == "none").unwrap();
    assert_eq!(none["upstream_status"], "503");
    assert!(none["error"].starts_with("no_replica: "), "{none:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Envoy: bash scripts/envoy.sh"]
async fn a_dead_pick_is_served_by_the_fallback_and_read_back() {
    let dir = temp_dir("fallback");
    // Replica 0 listens nowhere; health probes far apart, so the picker still believes in it.
    let s = setup(dir.path(), "session-affinity", 200.0, None, 60_000, true).await;
    let dead = s.epp.shared().replica(0).unwrap();
    // Sessions until one's home is the dead replica: Envoy cannot connect and retries down the
    // picker's list; the picker reads the fallback back.
    let mut found = None;
    for c in 0..20 {
        let before: Vec<u64> = s.engines.iter().map(finished).collect();
        let r = post(&s.url, &convo(c, 1, 4), &format!("s{c}")).await;
        let status = r.status;
        let served: u32 = r.headers["x-kvroute-replica"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        let (events, _) = read_all(r.body).await;
        assert_eq!(status, 200, "{events:?}");
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        let mut ran = None;
        eventually("an engine finished the request", WAIT, || {
            std::future::ready({
                let now: Vec<u64> = s.engines.iter().map(finished).collect();
                ran = (0..3).find(|&i| now[i] > before[i]);
                ran.is_some()
            })
        })
        .await;
        // Engine i is replica i + 1.
        assert_eq!(
            served,
            ran.unwrap() as u32 + 1,
            "served read back = engine that ran it"
        );
        if dead.upstream_errors.load(Ordering::Relaxed) == 1 {
            found = Some(c);
            break;
        }
    }
    let c = found.expect("some session's home is replica 0");
    assert_eq!(
        dead.outstanding.load(Ordering::Relaxed),
        0,
        "load moved, then released"
    );
    assert!(
        dead.healthy.load(Ordering::Relaxed),
        "one failure does not mark it down"
    );

    let rows_path = dir.path().join("router.csv");
    let shared = s.epp.shared().clone();
    eventually("every row written", WAIT, || {
        std::future::ready(shared.rows.stats().written.load(Ordering::Relaxed) > c as u64)
    })
    .await;
    s.stop().await;
    let rows = read_rows(&rows_path);
    let row = rows
        .iter()
        .find(|r| r["session_id"] == format!("s{c}"))
        .unwrap();
    assert_ne!(
        row["replica"], "0",
        "the row names the endpoint Envoy used: {row:?}"
    );
    assert_eq!(row["attempts"], "2", "{row:?}");
    assert_eq!(row["upstream_status"], "200");
    for r in rows.iter().filter(|r| r["session_id"] != format!("s{c}")) {
        assert_eq!(r["attempts"], "1", "{r:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoint_file_is_watched() {
    let dir = temp_dir("watch");
    let file = dir.path().join("replicas.json");
    std::fs::write(&file, r#"["http://127.0.0.1:1", "http://127.0.0.1:2"]"#).unwrap();
    let mut p = policies::PolicySpec::named("round-robin");
    p.seed = 7;
    let mut cfg = EppConfig::new(proxy::RouterConfig::new(Vec::new(), p));
    cfg.replicas_file = Some(file.clone());
    cfg.watch_interval_ms = 20;
    let epp = Epp::start(cfg).await.expect("epp starts");
    let urls = |e: &Epp| -> Vec<String> {
        e.shared()
            .replicas()
            .iter()
            .map(|r| r.url.clone())
            .collect()
    };
    assert_eq!(urls(&epp), ["http://127.0.0.1:1", "http://127.0.0.1:2"]);
    std::fs::write(
        &file,
        r#"[{"url": "http://127.0.0.1:2"}, "http://127.0.0.1:3"]"#,
    )
    .unwrap();
    eventually("the new list applied", WAIT, || {
        std::future::ready(urls(&epp) == ["http://127.0.0.1:2", "http://127.0.0.1:3"])
    })
    .await;
    // A list with a host name is refused whole: the table stays as it was.
    std::fs::write(&file, r#"["http://localhost:4"]"#).unwrap();
    eventually("the list refused", WAIT, || {
        std::future::ready(epp.watch_stats().refused.load(Ordering::Relaxed) == 1)
    })
    .await;
    assert_eq!(epp.watch_stats().applied.load(Ordering::Relaxed), 1);
    assert_eq!(urls(&epp), ["http://127.0.0.1:2", "http://127.0.0.1:3"]);
    epp.shutdown(Duration::from_secs(1)).await;
}
