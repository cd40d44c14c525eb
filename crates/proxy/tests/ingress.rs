//! The router as a production ingress (issue #18): slow and abusive clients, upstream timeouts
//! and safe retries, health hysteresis, hop-by-hop headers, the admin listener, overload.
//! Loopback only; short configured timeouts, and every wait is on a socket's answer or end, or
//! on the router's own counters — never a sleep.

mod common;

use std::time::Duration;

use common::*;
use tokio::io::AsyncWriteExt;

fn admin_url(router: &proxy::Router) -> String {
    format!("http://{}", router.admin_addr())
}

async fn metrics_of(router: &proxy::Router) -> String {
    get(&format!("{}/metrics", admin_url(router))).await.1
}

/// Waits until the router's `/metrics` series reaches `at_least`.
async fn wait_metric(router: &proxy::Router, series: &str, at_least: f64) {
    let url = format!("{}/metrics", admin_url(router));
    eventually(&format!("{series} ≥ {at_least}"), WAIT, || {
        let url = url.clone();
        async move { metric(&get(&url).await.1, series).unwrap_or(-1.0) >= at_least }
    })
    .await;
}

fn with_rows(
    mut cfg: proxy::RouterConfig,
    name: &str,
) -> (proxy::RouterConfig, test_support::TempDir) {
    let dir = temp_dir(name);
    cfg.rows = Some(dir.path().join("router.csv"));
    (cfg, dir)
}

fn body_json(response: &str) -> serde_json::Value {
    let body = response.split("\r\n\r\n").nth(1).unwrap_or("");
    serde_json::from_str(body).unwrap_or(serde_json::Value::Null)
}

// ----- slow and abusive clients ----------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_sent_head_gets_408_and_a_silent_connection_is_closed() {
    let a = MockReplica::start(Script::default()).await;
    let mut cfg = router_config(&[&a], "round-robin");
    cfg.header_read_timeout_ms = 300;
    let router = start_router(cfg).await;
    let addr = router.local_addr();

    let mut half = tokio::net::TcpStream::connect(addr).await.unwrap();
    half.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-")
        .await
        .unwrap();
    let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();

    let answer = read_to_eof(&mut half).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert_eq!(body_json(&answer)["error"]["code"], 408, "{answer}");
    assert!(answer.to_ascii_lowercase().contains("connection: close"));
    assert_eq!(read_to_eof(&mut silent).await, "", "closed without a word");
    wait_metric(&router, "kvroute_router_header_timeouts_total", 2.0).await;
    assert_eq!(a.state.count(), 0);
    router.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_body_gets_408_with_a_row() {
    let a = MockReplica::start(Script::default()).await;
    let mut cfg = router_config(&[&a], "round-robin");
    cfg.body_read_timeout_ms = 300;
    let (cfg, dir) = with_rows(cfg, "body-timeout");
    let router = start_router(cfg).await;
    let mut conn = raw_post(
        router.local_addr(),
        "/v1/completions",
        1000,
        b"{\"prompt\":\"slow",
        &[("x-request-id", "trickle")],
    )
    .await;
    let answer = read_to_eof(&mut conn).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    let v = body_json(&answer);
    assert_eq!(v["error"]["code"], 408);
    assert_eq!(v["error"]["type"], "RequestTimeoutError");
    router.shutdown(Duration::from_secs(5)).await;
    let rows = read_rows(&dir.path().join("router.csv"));
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["request_id"], "trickle");
    assert_eq!(rows[0]["upstream_status"], "408");
    assert_eq!(rows[0]["attempts"], "0");
    assert!(
        rows[0]["error"].starts_with("client: request body not received within 300 ms"),
        "{:?}",
        rows[0]
    );
    assert_eq!(a.state.count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_connection_cap_requests_get_503_and_a_row() {
    let a = MockReplica::start(Script::default()).await;
    let mut cfg = router_config(&[&a], "round-robin");
    cfg.max_connections = 2;
    let (cfg, dir) = with_rows(cfg, "cap");
    let router = start_router(cfg).await;
    let url = format!("http://{}", router.local_addr());
    let first = tokio::net::TcpStream::connect(router.local_addr())
        .await
        .unwrap();
    let _second = tokio::net::TcpStream::connect(router.local_addr())
        .await
        .unwrap();
    wait_metric(&router, "kvroute_router_connections_open", 2.0).await;

    let refused = post(
        &url,
        "/v1/completions",
        completion("over"),
        &[("x-request-id", "over-cap")],
    )
    .await;
    assert_eq!(refused.status, 503);
    assert_eq!(refused.headers["connection"], "close");
    let (_, v) = read_json(refused).await;
    assert_eq!(v["error"]["code"], 503);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("connection limit (2)")
    );
    // A non-LLM request past the cap is refused too (no row).
    assert_eq!(get(&format!("{url}/health")).await.0, 503);

    drop(first);
    eventually("one open connection", WAIT, || async {
        metric(
            &metrics_of(&router).await,
            "kvroute_router_connections_open",
        ) == Some(1.0)
    })
    .await;
    let ok = post(
        &url,
        "/v1/completions",
        completion("under"),
        &[("x-request-id", "under-cap")],
    )
    .await
    .finish()
    .await;
    assert_eq!(ok.status, 200);
    assert!(ok.done);
    let m = metrics_of(&router).await;
    assert_eq!(
        metric(&m, "kvroute_router_connections_refused_total"),
        Some(2.0)
    );
    router.shutdown(Duration::from_secs(5)).await;
    let rows = read_rows(&dir.path().join("router.csv"));
    let by_id: std::collections::HashMap<_, _> =
        rows.iter().map(|r| (r["request_id"].as_str(), r)).collect();
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(by_id["over-cap"]["upstream_status"], "503");
    assert!(
        by_id["over-cap"]["error"].starts_with("overload: the router is at its connection limit")
    );
    assert_eq!(by_id["over-cap"]["attempts"], "0");
    assert_eq!(by_id["under-cap"]["error"], "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_413_is_readable_by_a_client_that_writes_everything_first() {
    let a = MockReplica::start(Script::default()).await;
    let mut cfg = router_config(&[&a], "round-robin");
    cfg.max_body_bytes = 1 << 20;
    let (cfg, dir) = with_rows(cfg, "linger");
    let router = start_router(cfg).await;
    let addr = router.local_addr();
    // An ordinary blocking client (like Python's http.client): the whole 64 MiB body first,
    // then the answer.
    let answer = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let body_len = 64usize << 20;
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        s.set_write_timeout(Some(WAIT)).unwrap();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-request-id: huge\r\ncontent-length: {body_len}\r\n\r\n"
        )
        .unwrap();
        let chunk = vec![b' '; 1 << 20];
        for _ in 0..64 {
            s.write_all(&chunk).expect("the router keeps reading until the body is sent");
        }
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    })
    .await
    .unwrap();
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert_eq!(body_json(&answer)["error"]["code"], 413);
    assert!(answer.to_ascii_lowercase().contains("connection: close"));
    router.shutdown(Duration::from_secs(5)).await;
    let rows = read_rows(&dir.path().join("router.csv"));
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["upstream_status"], "413");
    assert!(rows[0]["error"].starts_with("too_large:"));
}

// ----- upstream --------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_replica_gets_504_and_the_request_is_not_retried() {
    let stalled = Script {
        hold_head: true,
        ..Script::default()
    };
    let a = MockReplica::start(stalled.clone()).await;
    let b = MockReplica::start(stalled).await;
    let mut cfg = router_config(&[&a, &b], "round-robin");
    cfg.upstream_head_timeout_ms = 300;
    let (cfg, dir) = with_rows(cfg, "head-timeout");
    let router = start_router(cfg).await;
    let url = format!("http://{}", router.local_addr());
    let (status, v) = read_json(
        post(
            &url,
            "/v1/completions",
            completion("stall"),
            &[("x-request-id", "stall")],
        )
        .await,
    )
    .await;
    assert_eq!(status, 504);
    assert_eq!(v["error"]["code"], 504);
    assert_eq!(v["error"]["type"], "GatewayTimeoutError");
    assert_eq!(
        a.state.count() + b.state.count(),
        1,
        "the request reached a replica: never sent to a second one"
    );
    let m = metrics_of(&router).await;
    assert_eq!(
        metric(&m, "kvroute_router_upstream_timeouts_total"),
        Some(1.0)
    );
    assert_eq!(metric(&m, "kvroute_router_retries_total"), Some(0.0));
    router.shutdown(Duration::from_secs(5)).await;
    a.state.release_heads(1);
    b.state.release_heads(1);
    let rows = read_rows(&dir.path().join("router.csv"));
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["upstream_status"], "504");
    assert_eq!(rows[0]["attempts"], "1");
    assert!(
        rows[0]["error"].contains("sent no response head within 300 ms")
            && rows[0]["error"].contains("not retried"),
        "{:?}",
        rows[0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_stream_ends_with_an_error_event_and_a_row() {
    let a = MockReplica::start(Script {
        hold: true,
        ..Script::default()
    })
    .await;
    let mut cfg = router_config(&[&a], "round-robin");
    cfg.upstream_idle_timeout_ms = 300;
    let (cfg, dir) = with_rows(cfg, "idle-timeout");
    let router = start_router(cfg).await;
    let url = format!("http://{}", router.local_addr());
    let r = post(
        &url,
        "/v1/completions",
        completion("silent"),
        &[("x-request-id", "silent")],
    )
    .await
    .finish()
    .await;
    assert_eq!(r.status, 200);
    assert!(r.done, "the stream still ends with [DONE]");
    assert_eq!(r.events.len(), 2, "the first event, then the error: {r:?}");
    let errs = r.errors();
    assert_eq!(errs.len(), 1);
    assert_eq!(errs[0]["error"]["code"], 504);
    a.state.release(1);
    router.shutdown(Duration::from_secs(5)).await;
    let rows = read_rows(&dir.path().join("router.csv"));
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["upstream_status"], "200");
    assert!(
        rows[0]["error"].starts_with("stream: replica sent nothing for"),
        "{:?}",
        rows[0]
    );
}

/// A replica that reads each request whole and then closes the connection without answering.
async fn cut_replica() -> (
    String,
    tokio::task::JoinHandle<()>,
    std::sync::Arc<std::sync::atomic::AtomicU64>,
) {
    use std::sync::atomic::{AtomicU64, Ordering};
    use tokio::io::AsyncReadExt;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let seen = std::sync::Arc::new(AtomicU64::new(0));
    let counter = seen.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            let counter = counter.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    let Ok(n) = s.read(&mut chunk).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    let text = String::from_utf8_lossy(&buf).to_string();
                    if let Some(end) = text.find("\r\n\r\n") {
                        let len = text[..end]
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length:")
                                    .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                            })
                            .unwrap_or(0);
                        if buf.len() >= end + 4 + len {
                            if text.starts_with("POST") {
                                counter.fetch_add(1, Ordering::SeqCst);
                            }
                            return; // dropped: closed with the request read, no answer
                        }
                    }
                }
            });
        }
    });
    (url, task, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_cut_after_it_was_sent_is_not_retried() {
    use std::sync::atomic::Ordering;
    let (cut_url, cut_task, cut_seen) = cut_replica().await;
    let good = MockReplica::start(Script::default()).await;
    let mut cfg = router_config(&[&good], "round-robin");
    cfg.replicas.push(proxy::ReplicaSpec::new(cut_url));
    cfg.health_interval_ms = 600_000;
    let (cfg, dir) = with_rows(cfg, "cut-after-send");
    let router = start_router(cfg).await;
    let url = format!("http://{}", router.local_addr());
    let mut statuses = Vec::new();
    for i in 0..2 {
        let (status, v) = read_json(
            post(
                &url,
                "/v1/completions",
                completion(&format!("c{i}")),
                &[("x-request-id", &format!("c{i}"))],
            )
            .await,
        )
        .await;
        if status == 502 {
            assert_eq!(v["error"]["code"], 502);
        }
        statuses.push(status);
    }
    statuses.sort();
    assert_eq!(
        statuses,
        [200, 502],
        "one request went to the cutting replica"
    );
    assert_eq!(cut_seen.load(Ordering::SeqCst), 1);
    assert_eq!(good.state.count(), 1, "the cut request was not sent again");
    router.shutdown(Duration::from_secs(5)).await;
    cut_task.abort();
    let rows = read_rows(&dir.path().join("router.csv"));
    let cut: Vec<_> = rows
        .iter()
        .filter(|r| r["upstream_status"] == "502")
        .collect();
    assert_eq!(cut.len(), 1, "{rows:?}");
    assert_eq!(cut[0]["replica"], "1");
    assert_eq!(cut[0]["attempts"], "1");
    assert!(cut[0]["error"].contains("not retried"), "{:?}", cut[0]);
}

// ----- health ----------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_failed_probe_under_load_neither_marks_down_nor_remaps() {
    let held = Script {
        hold: true,
        ..Script::default()
    };
    let a = MockReplica::start(held.clone()).await;
    let b = MockReplica::start(held).await;
    let mut cfg = router_config(&[&a, &b], "session-affinity");
    cfg.health_interval_ms = 20;
    cfg.health_timeout_ms = 100;
    let router = start_router(cfg).await;
    let url = format!("http://{}", router.local_addr());
    // Load: two held streams per replica, on sessions each replica owns.
    let mut owned: [Vec<String>; 2] = [Vec::new(), Vec::new()];
    let mut streams = Vec::new();
    for i in 0.. {
        if owned.iter().all(|o| o.len() >= 2) {
            break;
        }
        let sid = format!("s{i}");
        let s = post(
            &url,
            "/v1/completions",
            completion("load"),
            &[("x-session-id", &sid)],
        )
        .await;
        let r: usize = s.headers["x-kvroute-replica"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        owned[r].push(sid);
        streams.push(s);
    }
    let series = |name: &str| format!("{name}{{replica=\"1\"}}");
    let before = metrics_of(&router).await;
    let ok_before = metric(&before, &series("kvroute_router_health_probes_ok_total")).unwrap();
    // One slow probe (past its timeout) and then one failed probe on replica 1, under load.
    b.state
        .stall_health_next
        .store(1, std::sync::atomic::Ordering::SeqCst);
    wait_metric(
        &router,
        &series("kvroute_router_health_probes_failed_total"),
        1.0,
    )
    .await;
    b.state
        .fail_health_next
        .store(1, std::sync::atomic::Ordering::SeqCst);
    wait_metric(
        &router,
        &series("kvroute_router_health_probes_failed_total"),
        2.0,
    )
    .await;
    // Passing probes after the failures: the streak is over.
    wait_metric(
        &router,
        &series("kvroute_router_health_probes_ok_total"),
        ok_before + 2.0,
    )
    .await;
    let m = metrics_of(&router).await;
    assert_eq!(
        metric(&m, &series("kvroute_router_replica_marked_down_total")),
        Some(0.0)
    );
    assert_eq!(
        metric(&m, &series("kvroute_router_replica_healthy")),
        Some(1.0)
    );
    // Session affinity kept its ring: replica 1's sessions still go there.
    b.state.script.lock().hold = false;
    for sid in &owned[1] {
        let r = post(
            &url,
            "/v1/completions",
            completion("again"),
            &[("x-session-id", sid)],
        )
        .await
        .finish()
        .await;
        assert_eq!(r.replica(), 1, "session {sid} was remapped");
    }
    a.state.release(100);
    b.state.release(100);
    for s in streams {
        assert!(s.finish().await.done);
    }
    router.shutdown(Duration::from_secs(5)).await;
}

// ----- headers ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_by_hop_headers_are_dropped_and_forwarding_headers_added() {
    let a = MockReplica::start(Script {
        response_headers: vec![
            ("connection".into(), "x-upstream-hop".into()),
            ("x-upstream-hop".into(), "secret".into()),
            ("keep-alive".into(), "timeout=5".into()),
            ("x-upstream-end".into(), "kept".into()),
        ],
        ..Script::default()
    })
    .await;
    let router = start_router(router_config(&[&a], "round-robin")).await;
    let url = format!("http://{}", router.local_addr());
    let r = post(
        &url,
        "/v1/completions",
        completion("headers"),
        &[
            ("connection", "keep-alive, X-Client-Hop"),
            ("x-client-hop", "secret"),
            ("keep-alive", "timeout=5"),
            ("te", "trailers"),
            ("x-forwarded-for", "203.0.113.7"),
            ("via", "1.0 edge"),
            ("x-end-to-end", "kept"),
        ],
    )
    .await;
    // Response direction.
    assert!(r.headers.get("x-upstream-hop").is_none(), "{:?}", r.headers);
    assert!(r.headers.get("keep-alive").is_none());
    assert_eq!(r.headers["x-upstream-end"], "kept");
    assert_eq!(r.headers["via"], "1.1 kvroute");
    assert!(r.finish().await.done);
    // Request direction.
    let seen = a.state.seen.lock()[0].headers.clone();
    for hop in ["x-client-hop", "keep-alive", "te"] {
        assert!(seen.get(hop).is_none(), "{hop} forwarded: {seen:?}");
    }
    assert_eq!(seen["x-end-to-end"], "kept");
    assert_eq!(seen["x-forwarded-for"], "203.0.113.7, 127.0.0.1");
    assert_eq!(seen["via"], "1.0 edge, 1.1 kvroute");
    // Without incoming forwarding headers, the router starts them.
    let _ = post(&url, "/v1/completions", completion("plain"), &[])
        .await
        .finish()
        .await;
    let seen = a.state.seen.lock()[1].headers.clone();
    assert_eq!(seen["x-forwarded-for"], "127.0.0.1");
    assert_eq!(seen["via"], "1.1 kvroute");
    router.shutdown(Duration::from_secs(5)).await;
}

// ----- admin -----------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_serving_port_cannot_drain_or_add_replicas() {
    let a = MockReplica::start(Script::default()).await;
    let b = MockReplica::start(Script::default()).await;
    let router = start_router(router_config(&[&a], "round-robin")).await;
    let url = format!("http://{}", router.local_addr());
    let add = format!("{{\"url\":\"{}\"}}", b.url);
    for (method, path, body) in [
        ("POST", "/admin/replicas/0/drain", ""),
        ("POST", "/admin/replicas", add.as_str()),
        ("DELETE", "/admin/replicas/0", ""),
        ("GET", "/admin/replicas", ""),
        ("GET", "/metrics", ""),
    ] {
        let (status, text) = send(method, &format!("{url}{path}"), body).await;
        assert_eq!(status, 404, "{method} {path} on the serving port: {text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["code"], 404);
    }
    let (_, list) = send("GET", &format!("{}/admin/replicas", admin_url(&router)), "").await;
    let list: serde_json::Value = serde_json::from_str(&list).unwrap();
    assert_eq!(list.as_array().unwrap().len(), 1, "nothing added: {list}");
    assert_eq!(list[0]["draining"], false, "nothing drained: {list}");
    assert!(router.admin_addr().ip().is_loopback());
    assert_ne!(router.admin_addr(), router.local_addr());
    router.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_requires_its_token() {
    let a = MockReplica::start(Script::default()).await;
    let mut cfg = router_config(&[&a], "round-robin");
    cfg.admin_token = Some("t0ken-xyz".into());
    let router = start_router(cfg).await;
    let admin = admin_url(&router);
    let drain = format!("{admin}/admin/replicas/0/drain");
    let (status, headers, text) = send_with("POST", &drain, "", &[]).await;
    assert_eq!(status, 401);
    assert!(
        headers["www-authenticate"]
            .to_str()
            .unwrap()
            .starts_with("Bearer")
    );
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&text).unwrap()["error"]["code"],
        401
    );
    for wrong in [
        "Bearer t0ken-xy",
        "Bearer t0ken-xyzz",
        "Basic t0ken-xyz",
        "t0ken-xyz",
    ] {
        let (status, _, _) = send_with("POST", &drain, "", &[("authorization", wrong)]).await;
        assert_eq!(status, 401, "{wrong}");
    }
    let (status, _, _) = send_with("GET", &format!("{admin}/metrics"), "", &[]).await;
    assert_eq!(status, 401, "metrics need the token too");
    let auth = [("authorization", "Bearer t0ken-xyz")];
    let (status, _, text) = send_with("POST", &drain, "", &auth).await;
    assert_eq!(status, 200, "{text}");
    let (status, _, m) = send_with("GET", &format!("{admin}/metrics"), "", &auth).await;
    assert_eq!(status, 200);
    assert_eq!(
        metric(&m, "kvroute_router_admin_unauthorized_total"),
        Some(6.0)
    );
    assert_eq!(
        metric(&m, "kvroute_router_replica_draining{replica=\"0\"}"),
        Some(1.0)
    );
    router.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exposed_admin_listener_without_a_token_is_refused() {
    let a = MockReplica::start(Script::default()).await;
    for host in ["0.0.0.0", "::", "192.0.2.1", "router.example"] {
        let mut cfg = router_config(&[&a], "round-robin");
        cfg.admin_host = host.into();
        match proxy::Router::start(cfg).await {
            Err(proxy::RouterError::Config(m)) => assert!(m.contains("admin-token-file"), "{m}"),
            Err(e) => panic!("{host}: wrong error {e}"),
            Ok(_) => panic!("{host}: the router started with an open admin API"),
        }
    }
}

// ----- overload --------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_in_flight_ceiling_requests_get_429() {
    let held = Script {
        hold: true,
        ..Script::default()
    };
    let a = MockReplica::start(held.clone()).await;
    let b = MockReplica::start(held).await;
    let mut cfg = router_config(&[&a, &b], "session-affinity");
    cfg.max_in_flight_per_replica = Some(1);
    let (cfg, dir) = with_rows(cfg, "ceiling");
    let router = start_router(cfg).await;
    let url = format!("http://{}", router.local_addr());
    // Same session: its owner takes the first; the ceiling sends the second to the other.
    let s1 = post(
        &url,
        "/v1/completions",
        completion("1"),
        &[("x-session-id", "hot")],
    )
    .await;
    let s2 = post(
        &url,
        "/v1/completions",
        completion("2"),
        &[("x-session-id", "hot")],
    )
    .await;
    assert_ne!(
        s1.headers["x-kvroute-replica"],
        s2.headers["x-kvroute-replica"]
    );
    let refused = post(
        &url,
        "/v1/completions",
        completion("3"),
        &[("x-session-id", "hot"), ("x-request-id", "over")],
    )
    .await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.headers["retry-after"], "1");
    let (_, v) = read_json(refused).await;
    assert_eq!(v["error"]["code"], 429);
    assert_eq!(v["error"]["type"], "RateLimitError");
    assert_eq!(
        metric(
            &metrics_of(&router).await,
            "kvroute_router_overloaded_total"
        ),
        Some(1.0)
    );
    a.state.release(10);
    b.state.release(10);
    assert!(s1.finish().await.done);
    assert!(s2.finish().await.done);
    router.shutdown(Duration::from_secs(5)).await;
    let rows = read_rows(&dir.path().join("router.csv"));
    let over: Vec<_> = rows.iter().filter(|r| r["request_id"] == "over").collect();
    assert_eq!(over.len(), 1);
    assert_eq!(over[0]["upstream_status"], "429");
    assert_eq!(over[0]["attempts"], "0");
    assert!(
        over[0]["error"].starts_with("overload: every eligible replica"),
        "{:?}",
        over[0]
    );
}
