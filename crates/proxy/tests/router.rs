//! End-to-end router tests on loopback against scripted replicas.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;

fn chosen_replicas(results: &[StreamResult]) -> Vec<u32> {
    results.iter().map(StreamResult::replica).collect()
}

/// Waits until the router counts no request in flight (a client can read `[DONE]` just before
/// the router sees the upstream's end of body and releases the load).
async fn wait_idle(admin_url: &str) {
    eventually("no request in flight", WAIT, || {
        let admin_url = admin_url.to_string();
        async move {
            let (_, text) = send("GET", &format!("{admin_url}/admin/replicas"), "").await;
            let list: serde_json::Value = serde_json::from_str(&text).unwrap();
            list.as_array()
                .unwrap()
                .iter()
                .all(|r| r["outstanding"] == 0)
        }
    })
    .await;
}

async fn run(url: &str, body: serde_json::Value, headers: &[(&str, &str)]) -> StreamResult {
    post(url, "/v1/completions", body, headers)
        .await
        .finish()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_alternates_and_streams_complete() {
    let a = MockReplica::start(Script::default()).await;
    let b = MockReplica::start(Script::default()).await;
    let router = start_router(router_config(&[&a, &b], "round-robin")).await;
    let url = format!("http://{}", router.local_addr());
    let mut got = Vec::new();
    for i in 0..4 {
        let r = run(&url, completion(&format!("p{i}")), &[]).await;
        assert_eq!(r.status, 200);
        assert!(r.done, "stream ends with [DONE]");
        assert_eq!(r.events.len(), 5, "4 content events + usage");
        got.push(r);
    }
    let reps = chosen_replicas(&got);
    assert_eq!(reps.iter().filter(|&&r| r == 0).count(), 2);
    assert_ne!(reps[0], reps[1]);
    assert_ne!(reps[1], reps[2]);
    assert_eq!(a.state.count() + b.state.count(), 4);
    router.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_outstanding_avoids_the_busy_replica() {
    let held = Script {
        hold: true,
        ..Script::default()
    };
    let a = MockReplica::start(held.clone()).await;
    let b = MockReplica::start(held).await;
    let router = start_router(router_config(&[&a, &b], "least-outstanding")).await;
    let url = format!("http://{}", router.local_addr());
    let admin_url = format!("http://{}", router.admin_addr());
    // Two held streams: one on each replica, whichever order.
    let s1 = post(&url, "/v1/completions", completion("x"), &[]).await;
    let s2 = post(&url, "/v1/completions", completion("y"), &[]).await;
    let r1: u32 = s1.headers["x-kvroute-replica"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let r2: u32 = s2.headers["x-kvroute-replica"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_ne!(
        r1, r2,
        "the second request avoids the replica holding the first"
    );
    // Finish the one on replica 0: the next request goes there (replica 1 still busy).
    let (s_on_a, s_on_b) = if r1 == 0 { (s1, s2) } else { (s2, s1) };
    a.state.release(1);
    let done = s_on_a.finish().await;
    assert!(done.done);
    eventually("replica 0 idle", WAIT, || {
        let admin_url = admin_url.clone();
        async move { admin(&admin_url, "GET", "/admin/replicas", "").await.1[0]["outstanding"] == 0 }
    })
    .await;
    let s3 = post(&url, "/v1/completions", completion("z"), &[]).await;
    assert_eq!(s3.headers["x-kvroute-replica"], "0");
    a.state.release(1);
    b.state.release(1);
    assert!(s3.finish().await.done);
    assert!(s_on_b.finish().await.done);
    router.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_affinity_is_sticky_and_spreads_sessions() {
    let reps = [
        MockReplica::start(Script::default()).await,
        MockReplica::start(Script::default()).await,
        MockReplica::start(Script::default()).await,
    ];
    let router = start_router(router_config(
        &[&reps[0], &reps[1], &reps[2]],
        "session-affinity",
    ))
    .await;
    let url = format!("http://{}", router.local_addr());
    let mut owners = std::collections::HashSet::new();
    for s in 0..12 {
        let sid = format!("session-{s}");
        let mut seen = Vec::new();
        for turn in 0..3 {
            let r = run(
                &url,
                completion(&format!("{sid} turn {turn}")),
                &[("x-session-id", &sid)],
            )
            .await;
            assert_eq!(r.status, 200);
            seen.push(r.replica());
        }
        assert!(
            seen.iter().all(|&r| r == seen[0]),
            "session {sid} moved: {seen:?}"
        );
        owners.insert(seen[0]);
        // The `user` field is the fallback session id.
        let mut body = completion("via user");
        body["user"] = serde_json::json!(sid);
        assert_eq!(run(&url, body, &[]).await.replica(), seen[0]);
    }
    assert!(
        owners.len() >= 2,
        "12 sessions all on one replica: {owners:?}"
    );
    router.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_bounded_walks_the_ring_under_load() {
    let held = Script {
        hold: true,
        ..Script::default()
    };
    let a = MockReplica::start(held.clone()).await;
    let b = MockReplica::start(held).await;
    let dir = temp_dir("bounded");
    let mut cfg = router_config(&[&a, &b], "session-bounded");
    cfg.rows = Some(dir.path().join("router.csv"));
    let router = start_router(cfg).await;
    let url = format!("http://{}", router.local_addr());
    let mut streams = Vec::new();
    for _ in 0..4 {
        streams.push(
            post(
                &url,
                "/v1/completions",
                completion("same"),
                &[("x-session-id", "hot")],
            )
            .await,
        );
    }
    let reps: Vec<String> = streams
        .iter()
        .map(|s| s.headers["x-kvroute-replica"].to_str().unwrap().to_string())
        .collect();
    // Bound ⌈1.25·(total+1)/2⌉: the owner takes the first ones, then the bound pushes one away.
    assert!(
        reps.iter().any(|r| r != &reps[0]),
        "bounded loads never left the owner: {reps:?}"
    );
    a.state.release(10);
    b.state.release(10);
    for s in streams {
        assert!(s.finish().await.done);
    }
    router.shutdown(Duration::from_secs(5)).await;
    let rows = read_rows(&dir.path().join("router.csv"));
    let branches: Vec<&str> = rows.iter().map(|r| r["branch"].as_str()).collect();
    assert!(branches.contains(&"ring"), "{branches:?}");
    assert!(branches.contains(&"ring-walk"), "{branches:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_hash_keeps_a_prompt_on_one_replica() {
    let reps = [
        MockReplica::start(Script::default()).await,
        MockReplica::start(Script::default()).await,
        MockReplica::start(Script::default()).await,
    ];
    let router = start_router(router_config(
        &[&reps[0], &reps[1], &reps[2]],
        "prefix-hash",
    ))
    .await;
    let url = format!("http://{}", router.local_addr());
    let prefix =
        "a shared system prompt that is long enough to fill several 64-byte blocks, ".repeat(4);
    let first = run(&url, completion(&format!("{prefix} question one")), &[])
        .await
        .replica();
    for q in 0..5 {
        let r = run(&url, completion(&format!("{prefix} question {q}")), &[]).await;
        assert_eq!(r.replica(), first);
    }
    router.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_affinity_follows_belief_and_spills_under_load() {
    let a = MockReplica::start(Script::default()).await;
    let b = MockReplica::start(Script::default()).await;
    let dir = temp_dir("affinity");
    let mut cfg = router_config(&[&a, &b], "prefix-affinity");
    cfg.rows = Some(dir.path().join("router.csv"));
    cfg.model = Some("mock-model".into());
    let router = start_router(cfg).await;
    let url = format!("http://{}", router.local_addr());
    let admin_url = format!("http://{}", router.admin_addr());
    let system = "You are a careful assistant. Answer briefly and cite your sources. ".repeat(3);
    // Turn 1: a miss lands somewhere; turns 2..4 extend the conversation and must follow it.
    let mut convo = vec![("system", system.as_str()), ("user", "first question")];
    let first = post(&url, "/v1/chat/completions", chat(&convo), &[])
        .await
        .finish()
        .await;
    let home = first.replica();
    for turn in 0..3 {
        convo.push(("assistant", "an answer"));
        convo.push(("user", "a follow-up question"));
        let r = post(&url, "/v1/chat/completions", chat(&convo), &[])
            .await
            .finish()
            .await;
        assert_eq!(r.replica(), home, "turn {turn} left its believed replica");
    }

    // Spill: hold 5 streams of the same conversation on its home replica; the next turn's
    // match is declined for the idle replica (5 − 0 > spill_abs 4, and 5 > 1.5 × 0).
    let home_state = if home == 0 { &a.state } else { &b.state };
    wait_idle(&admin_url).await;
    home_state.script.lock().hold = true;
    let mut held = Vec::new();
    for _ in 0..5 {
        let s = post(&url, "/v1/chat/completions", chat(&convo), &[]).await;
        assert_eq!(
            s.headers["x-kvroute-replica"].to_str().unwrap(),
            home.to_string()
        );
        held.push(s);
    }
    convo.push(("user", "one more"));
    let spilled = post(&url, "/v1/chat/completions", chat(&convo), &[]).await;
    assert_ne!(
        spilled.headers["x-kvroute-replica"].to_str().unwrap(),
        home.to_string()
    );
    home_state.release(100);
    assert!(spilled.finish().await.done);
    for s in held {
        assert!(s.finish().await.done);
    }
    router.shutdown(Duration::from_secs(5)).await;

    let mut rows = read_rows(&dir.path().join("router.csv"));
    // Rows are written as requests finish; arrival order is the decision order.
    rows.sort_by(|x, y| {
        x["arrival_s"]
            .parse::<f64>()
            .unwrap()
            .total_cmp(&y["arrival_s"].parse::<f64>().unwrap())
    });
    assert_eq!(rows.len(), 10);
    assert_eq!(rows[0]["branch"], "miss");
    assert_eq!(rows[0]["predicted_match_tokens"], "0");
    for r in &rows[1..4] {
        assert_eq!(r["branch"], "match");
        assert!(r["predicted_match_tokens"].parse::<u32>().unwrap() > 0);
    }
    let last = rows.last().unwrap();
    assert_eq!(last["branch"], "spill-load");
    assert_eq!(last["outstanding_chosen"], "0");
    assert_eq!(last["outstanding_min"], "0");
    for r in &rows {
        assert_eq!(r["policy"], "prefix-affinity");
        assert_eq!(r["error"], "");
        assert!(r["decide_ns"].parse::<u64>().is_ok());
        assert!(r["overhead_us"].parse::<u64>().is_ok());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_residency_follows_kv_events_and_distrusts_gaps() {
    use kv_index::KvEvent;
    use proxy::events::encode::{Encoding, batch};
    let a = MockReplica::start(Script::default()).await;
    let b = MockReplica::start(Script::default()).await;
    let pub_a = MockPublisher::bind().await;
    let mut pub_b = MockPublisher::bind().await;
    let dir = temp_dir("exact");
    let mut cfg = router_config(&[&a, &b], "exact-residency");
    cfg.replicas[0].kv_events = Some(pub_a.endpoint.clone());
    cfg.replicas[1].kv_events = Some(pub_b.endpoint.clone());
    cfg.rows = Some(dir.path().join("router.csv"));
    cfg.model = Some("mock-model".into());
    cfg.policy.salt = "mock-model".into();
    let router = start_router(cfg).await;
    let url = format!("http://{}", router.local_addr());
    let admin_url = format!("http://{}", router.admin_addr());
    let metrics_url = format!("{admin_url}/metrics");

    // Probe until replica 1's subscription is live (PUB drops messages sent before it is).
    let mut seq_b = wait_subscribed(&mut pub_b, &metrics_url, 1).await;
    // Replica 1 reports it stored the first 4 blocks (64 tokens) of the prompt.
    let prompt =
        "The quick brown fox jumps over the lazy dog; then it rests a while. And again, and again.";
    let tokens: Vec<u32> = prompt.bytes().map(u32::from).collect();
    let stored = KvEvent::Stored {
        block_hashes: vec![11, 12, 13, 14],
        parent_block_hash: None,
        token_ids: tokens[..64].to_vec(),
        block_size: 16,
        cache_salt: None,
    };
    let before = get(&metrics_url).await.1;
    let applied = metric(
        &before,
        "kvroute_router_kv_event_batches_total{replica=\"1\"}",
    )
    .unwrap();
    pub_b
        .publish(seq_b, batch(1.0, &[stored], Encoding::Array))
        .await;
    seq_b += 1;
    eventually("replica 1's stored batch applied", WAIT, || {
        let u = metrics_url.clone();
        async move {
            metric(
                &get(&u).await.1,
                "kvroute_router_kv_event_batches_total{replica=\"1\"}",
            )
            .unwrap()
                > applied
        }
    })
    .await;
    for _ in 0..3 {
        let r = run(&url, completion(prompt), &[]).await;
        assert_eq!(r.replica(), 1, "exact residency follows the stored event");
    }
    assert_eq!(
        a.state.tokenize_calls.load(Ordering::SeqCst)
            + b.state.tokenize_calls.load(Ordering::SeqCst),
        3
    );

    // A sequence gap with no replay socket: counted, and the replica is treated as cleared.
    let gaps_before = metric(
        &get(&metrics_url).await.1,
        "kvroute_router_kv_event_gaps_total{replica=\"1\"}",
    )
    .unwrap();
    pub_b
        .publish(seq_b + 5, batch(2.0, &[], Encoding::Map))
        .await;
    eventually("the gap counted", WAIT, || {
        let u = metrics_url.clone();
        async move {
            metric(
                &get(&u).await.1,
                "kvroute_router_kv_event_gaps_total{replica=\"1\"}",
            )
            .unwrap()
                > gaps_before
        }
    })
    .await;
    let m = get(&metrics_url).await.1;
    assert!(
        metric(
            &m,
            "kvroute_router_kv_event_gaps_unrepaired_total{replica=\"1\"}"
        )
        .unwrap()
            >= 1.0
    );
    // With the belief cleared, the same prompt is a miss again.
    let r = run(&url, completion(prompt), &[]).await;
    assert_eq!(r.status, 200);
    router.shutdown(Duration::from_secs(5)).await;
    let rows = read_rows(&dir.path().join("router.csv"));
    assert_eq!(rows.len(), 4);
    for r in &rows[..3] {
        assert_eq!(r["branch"], "match");
        assert_eq!(r["replica"], "1");
        assert_eq!(r["predicted_match_tokens"], "64");
        assert!(r["tokenize_ms"].parse::<f64>().unwrap() >= 0.0);
    }
    assert_eq!(rows[3]["branch"], "miss");
    assert_eq!(rows[3]["predicted_match_tokens"], "0");
}

/// Publishes empty batches from `seq` on until replica `replica`'s applied batches pass
/// `applied` (PUB drops what it sends before a subscription reaches it); returns the next seq.
async fn probe_until_applied(
    publisher: &mut MockPublisher,
    metrics_url: &str,
    replica: u32,
    applied: f64,
    mut seq: u64,
) -> u64 {
    use proxy::events::encode::{Encoding, batch};
    let series = format!("kvroute_router_kv_event_batches_total{{replica=\"{replica}\"}}");
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        publisher.publish(seq, batch(0.0, &[], Encoding::Map)).await;
        seq += 1;
        if metric(&get(metrics_url).await.1, &series).unwrap_or(0.0) > applied {
            return seq;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "replica {replica}'s KV-event subscription not live within {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restarted_at_the_same_endpoint_loses_its_residency() {
    use kv_index::KvEvent;
    use proxy::events::encode::{Encoding, batch};
    let a = MockReplica::start(Script::default()).await;
    let b = MockReplica::start(Script::default()).await;
    let mut pub_b = MockPublisher::bind().await;
    let endpoint = pub_b.endpoint.clone();
    let dir = temp_dir("restart");
    let mut cfg = router_config(&[&a, &b], "exact-residency");
    cfg.replicas[1].kv_events = Some(endpoint.clone());
    cfg.rows = Some(dir.path().join("router.csv"));
    cfg.model = Some("mock-model".into());
    cfg.policy.salt = "mock-model".into();
    let router = start_router(cfg).await;
    let url = format!("http://{}", router.local_addr());
    let admin_url = format!("http://{}", router.admin_addr());
    let metrics_url = format!("{admin_url}/metrics");
    let batches = "kvroute_router_kv_event_batches_total{replica=\"1\"}";
    let restarts = "kvroute_router_kv_event_restarts_total{replica=\"1\"}";
    let stored = |prompt: &str, first_hash: u64| KvEvent::Stored {
        block_hashes: vec![first_hash, first_hash + 1],
        parent_block_hash: None,
        token_ids: prompt.bytes().map(u32::from).take(32).collect(),
        block_size: 16,
        cache_salt: None,
    };
    let old = "The first engine's prompt, long enough for two blocks and a bit more of it.";
    let new = "After the restart another prompt arrives, also long enough for two blocks.";

    // The first engine stores two blocks of `old`; the router follows them.
    let mut seq = wait_subscribed(&mut pub_b, &metrics_url, 1).await;
    let applied = metric(&get(&metrics_url).await.1, batches).unwrap();
    pub_b
        .publish(seq, batch(1.0, &[stored(old, 10)], Encoding::Map))
        .await;
    seq += 1;
    assert!(seq > 1);
    eventually("the first engine's blocks applied", WAIT, || {
        let u = metrics_url.clone();
        async move { metric(&get(&u).await.1, batches).unwrap() > applied }
    })
    .await;
    assert_eq!(run(&url, completion(old), &[]).await.replica(), 1);
    assert_eq!(metric(&get(&metrics_url).await.1, restarts), Some(0.0));

    // The engine restarts at the same endpoint: its connection closes, and the new one
    // publishes from sequence 0 with an empty cache.
    drop(pub_b);
    let mut pub_b = MockPublisher::bind_at(&endpoint).await;
    eventually("the restart counted", WAIT, || {
        let u = metrics_url.clone();
        async move { metric(&get(&u).await.1, restarts).unwrap() >= 1.0 }
    })
    .await;
    let r = run(&url, completion(old), &[]).await;
    assert_eq!(r.status, 200);
    let applied = metric(&get(&metrics_url).await.1, batches).unwrap();
    let seq = probe_until_applied(&mut pub_b, &metrics_url, 1, applied, 0).await;
    let applied = metric(&get(&metrics_url).await.1, batches).unwrap();
    pub_b
        .publish(seq, batch(2.0, &[stored(new, 20)], Encoding::Map))
        .await;
    eventually("the new engine's blocks applied", WAIT, || {
        let u = metrics_url.clone();
        async move { metric(&get(&u).await.1, batches).unwrap() > applied }
    })
    .await;
    assert_eq!(run(&url, completion(new), &[]).await.replica(), 1);
    let r = run(&url, completion(old), &[]).await;
    assert_eq!(r.status, 200);
    assert_eq!(metric(&get(&metrics_url).await.1, restarts), Some(1.0));
    router.shutdown(Duration::from_secs(5)).await;
    let rows = read_rows(&dir.path().join("router.csv"));
    let branches: Vec<(&str, &str)> = rows
        .iter()
        .map(|r| (r["branch"].as_str(), r["predicted_match_tokens"].as_str()))
        .collect();
    assert_eq!(
        branches,
        [
            ("match", "32"),
            ("miss", "0"),
            ("match", "32"),
            ("miss", "0")
        ],
        "old blocks predicted before the restart only; the new engine's after it"
    );
}

/// Runs four requests through an exact-residency router over one replica whose
/// `usage.prompt_tokens` is its tokenizer's count plus `offset`: a streamed completion, a
/// streamed chat, a non-streamed completion (all with usage) and a stream without usage.
/// Returns (compared, mismatches) from `/metrics` and the rows.
async fn prompt_token_parity(
    offset: i64,
) -> (f64, f64, Vec<std::collections::HashMap<String, String>>) {
    let a = MockReplica::start(Script {
        prompt_tokens_offset: Some(offset),
        ..Script::default()
    })
    .await;
    let dir = temp_dir("parity");
    let mut cfg = router_config(&[&a], "exact-residency");
    cfg.rows = Some(dir.path().join("router.csv"));
    cfg.model = Some("mock-model".into());
    cfg.policy.salt = "mock-model".into();
    let router = start_router(cfg).await;
    let url = format!("http://{}", router.local_addr());
    let admin_url = format!("http://{}", router.admin_addr());
    let prompt = "Twenty-nine bytes of a prompt";
    assert_eq!(run(&url, completion(prompt), &[]).await.status, 200);
    let r = post(&url, "/v1/chat/completions", chat(&[("user", prompt)]), &[])
        .await
        .finish()
        .await;
    assert_eq!(r.status, 200);
    let mut plain = completion(prompt);
    plain["stream"] = serde_json::json!(false);
    plain.as_object_mut().unwrap().remove("stream_options");
    let (status, v) = read_json(post(&url, "/v1/completions", plain, &[]).await).await;
    assert_eq!(status, 200);
    assert!(v["usage"]["prompt_tokens"].as_u64().is_some());
    let mut no_usage = completion(prompt);
    no_usage.as_object_mut().unwrap().remove("stream_options");
    assert_eq!(run(&url, no_usage, &[]).await.status, 200);
    wait_idle(&admin_url).await;
    assert_eq!(a.state.tokenize_calls.load(Ordering::SeqCst), 4);
    let m = get(&format!("{admin_url}/metrics")).await.1;
    let compared = metric(&m, "kvroute_router_prompt_tokens_compared_total").unwrap();
    let mismatches = metric(&m, "kvroute_router_prompt_token_mismatches_total").unwrap();
    router.shutdown(Duration::from_secs(5)).await;
    (
        compared,
        mismatches,
        read_rows(&dir.path().join("router.csv")),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_tokens_that_agree_with_the_engine_are_compared_and_not_flagged() {
    let (compared, mismatches, rows) = prompt_token_parity(0).await;
    assert_eq!((compared, mismatches), (3.0, 0.0));
    let with_usage: Vec<&str> = rows.iter().map(|r| r["prompt_tokens"].as_str()).collect();
    assert_eq!(with_usage.iter().filter(|p| **p == "29").count(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_tokens_that_differ_from_the_engine_are_counted_as_mismatches() {
    let (compared, mismatches, rows) = prompt_token_parity(2).await;
    assert_eq!((compared, mismatches), (3.0, 3.0));
    assert_eq!(
        rows.iter().filter(|r| r["prompt_tokens"] == "31").count(),
        3
    );
}

async fn admin(url: &str, method: &str, path: &str, body: &str) -> (u16, serde_json::Value) {
    let (status, text) = send(method, &format!("{url}{path}"), body).await;
    (
        status,
        serde_json::from_str(&text).unwrap_or(serde_json::Value::Null),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_loses_nothing() {
    let held = Script {
        hold: true,
        ..Script::default()
    };
    let a = MockReplica::start(held.clone()).await;
    let b = MockReplica::start(held).await;
    let dir = temp_dir("drain");
    let mut cfg = router_config(&[&a, &b], "least-outstanding");
    cfg.rows = Some(dir.path().join("router.csv"));
    let router = start_router(cfg).await;
    let url = format!("http://{}", router.local_addr());
    let admin_url = format!("http://{}", router.admin_addr());
    let mut streams = Vec::new();
    for i in 0..4 {
        streams.push(
            post(
                &url,
                "/v1/completions",
                completion(&format!("before {i}")),
                &[],
            )
            .await,
        );
    }
    assert_eq!(a.state.count(), 2);
    let (status, r0) = admin(&admin_url, "POST", "/admin/replicas/0/drain", "").await;
    assert_eq!(status, 200);
    assert_eq!(r0["draining"], true);
    assert_eq!(r0["outstanding"], 2);
    for i in 0..4 {
        let s = post(
            &url,
            "/v1/completions",
            completion(&format!("during {i}")),
            &[],
        )
        .await;
        assert_eq!(
            s.headers["x-kvroute-replica"], "1",
            "a draining replica gets nothing new"
        );
        streams.push(s);
    }
    a.state.release(100);
    b.state.release(100);
    for s in streams {
        let r = s.finish().await;
        assert!(
            r.done && r.errors().is_empty(),
            "drained stream lost: {r:?}"
        );
        assert_eq!(r.events.len(), 5);
    }
    eventually("the drained replica idle", WAIT, || {
        let admin_url = admin_url.clone();
        async move { admin(&admin_url, "GET", "/admin/replicas", "").await.1[0]["outstanding"] == 0 }
    })
    .await;
    let (_, list) = admin(&admin_url, "GET", "/admin/replicas", "").await;
    assert_eq!(list[0]["draining"], true);
    let (status, _) = admin(&admin_url, "POST", "/admin/replicas/0/undrain", "").await;
    assert_eq!(status, 200);
    let (status, _) = admin(&admin_url, "POST", "/admin/replicas/9/drain", "").await;
    assert_eq!(status, 404);
    router.shutdown(Duration::from_secs(5)).await;
    let rows = read_rows(&dir.path().join("router.csv"));
    assert_eq!(rows.len(), 8);
    assert!(
        rows.iter()
            .all(|r| r["error"].is_empty() && r["upstream_status"] == "200")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_replica_loses_only_in_flight() {
    let held = Script {
        hold: true,
        ..Script::default()
    };
    let mut a = MockReplica::start(held.clone()).await;
    let b = MockReplica::start(held).await;
    let dir = temp_dir("kill");
    let mut cfg = router_config(&[&a, &b], "round-robin");
    cfg.rows = Some(dir.path().join("router.csv"));
    let router = start_router(cfg).await;
    let url = format!("http://{}", router.local_addr());
    let mut on_a = Vec::new();
    let mut on_b = Vec::new();
    for i in 0..4 {
        let mut s = post(
            &url,
            "/v1/completions",
            completion(&format!("k{i}")),
            &[("x-request-id", &format!("k{i}"))],
        )
        .await;
        let first = s.next_event().await.expect("first event");
        assert!(first.contains("t0"));
        if s.headers["x-kvroute-replica"] == "0" {
            on_a.push(s)
        } else {
            on_b.push(s)
        }
    }
    assert_eq!((on_a.len(), on_b.len()), (2, 2));
    a.kill().await;
    for s in on_a {
        let r = s.finish().await;
        assert!(r.done, "a failed stream still ends with [DONE]");
        let errs = r.errors();
        assert_eq!(errs.len(), 1, "{r:?}");
        assert_eq!(errs[0]["error"]["code"], 502);
    }
    // Requests not yet dispatched are never lost: they go to the survivor (after a refused
    // connection at most).
    b.state.script.lock().hold = false;
    for i in 0..4 {
        let r = run(
            &url,
            completion(&format!("after {i}")),
            &[("x-request-id", &format!("after{i}"))],
        )
        .await;
        assert_eq!(r.status, 200);
        assert!(r.done && r.errors().is_empty());
        assert_eq!(r.replica(), 1);
    }
    b.state.release(100);
    for s in on_b {
        let r = s.finish().await;
        assert!(r.done && r.errors().is_empty());
    }
    router.shutdown(Duration::from_secs(5)).await;
    let rows = read_rows(&dir.path().join("router.csv"));
    assert_eq!(rows.len(), 8);
    for r in &rows {
        let in_flight_on_a = r["request_id"].starts_with('k') && r["replica"] == "0";
        if in_flight_on_a {
            assert!(r["error"].starts_with("stream:"), "{r:?}");
        } else {
            assert_eq!(r["error"], "", "{r:?}");
            assert_eq!(
                r["replica"],
                if r["request_id"].starts_with("after") {
                    "1"
                } else {
                    r["replica"].as_str()
                }
            );
        }
    }
    assert!(
        rows.iter()
            .filter(|r| r["request_id"].starts_with("after"))
            .all(|r| r["attempts"] != "0")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_status_and_body() {
    let a = MockReplica::start(Script::default()).await;
    let dir = temp_dir("bad");
    let mut cfg = router_config(&[&a], "round-robin");
    cfg.rows = Some(dir.path().join("router.csv"));
    cfg.max_body_bytes = 1024;
    let router = start_router(cfg).await;
    let url = format!("http://{}", router.local_addr());
    let admin_url = format!("http://{}", router.admin_addr());

    let cases: Vec<(&str, bytes::Bytes, u16, Option<&str>, &str)> = vec![
        (
            "/v1/completions",
            bytes::Bytes::from_static(b"{not json"),
            400,
            None,
            "invalid JSON",
        ),
        (
            "/v1/completions",
            bytes::Bytes::from_static(b"{}"),
            400,
            Some("prompt"),
            "'prompt' is required",
        ),
        (
            "/v1/chat/completions",
            bytes::Bytes::from_static(br#"{"messages":[]}"#),
            400,
            Some("messages"),
            "'messages'",
        ),
        (
            "/v1/chat/completions",
            bytes::Bytes::from_static(br#"{"messages":"hi"}"#),
            400,
            None,
            "invalid JSON",
        ),
        (
            "/v1/completions",
            bytes::Bytes::from(format!("{{\"prompt\":\"{}\"}}", "x".repeat(2000))),
            413,
            None,
            "exceeds 1024 bytes",
        ),
    ];
    for (path, body, status, param, msg) in cases {
        let (got, v) = read_json(post_raw(&url, path, body, &[]).await).await;
        assert_eq!(got, status, "{path} {v}");
        assert_eq!(v["error"]["code"], status);
        assert!(v["error"]["message"].as_str().unwrap().contains(msg), "{v}");
        assert!(v["error"]["type"].as_str().unwrap().ends_with("Error"));
        assert_eq!(v["error"]["param"].as_str(), param);
    }
    // A chunked body without content-length is cut at the limit too.
    {
        use http_body_util::BodyExt;
        let (mut tx, body) =
            http_body_util::channel::Channel::<bytes::Bytes, std::convert::Infallible>::new(4);
        let c = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
        let req = http::Request::post(format!("{url}/v1/completions"))
            .body(body)
            .unwrap();
        let send = tokio::spawn(async move {
            for _ in 0..4 {
                if tx
                    .send_data(bytes::Bytes::from(vec![b' '; 512]))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        });
        let resp = c.request(req).await.unwrap();
        assert_eq!(resp.status(), 413);
        let v: serde_json::Value =
            serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
        assert_eq!(v["error"]["code"], 413);
        let _ = send.await;
    }
    let (status, text) = get(&format!("{url}/nope")).await;
    assert_eq!(status, 404);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&text).unwrap()["error"]["code"],
        404
    );
    let (status, _) = get(&format!("{url}/v1/completions")).await;
    assert_eq!(status, 405);
    let (status, _) = send("PUT", &format!("{admin_url}/admin/replicas"), "").await;
    assert_eq!(status, 405);
    let (status, _) = admin(
        &admin_url,
        "POST",
        "/admin/replicas",
        "{\"url\":\"not a url\"}",
    )
    .await;
    assert_eq!(status, 400);
    // No eligible replica: 503.
    admin(&admin_url, "POST", "/admin/replicas/0/drain", "").await;
    let (status, v) = read_json(post(&url, "/v1/completions", completion("x"), &[]).await).await;
    assert_eq!(status, 503);
    assert_eq!(v["error"]["code"], 503);
    assert_eq!(a.state.count(), 0, "nothing bad reached the replica");
    router.shutdown(Duration::from_secs(5)).await;
    let rows = read_rows(&dir.path().join("router.csv"));
    assert_eq!(rows.len(), 7, "every LLM request gets a row");
    assert!(
        rows.iter()
            .all(|r| !r["error"].is_empty() && r["attempts"] == "0")
    );
    assert_eq!(
        rows.iter()
            .filter(|r| r["upstream_status"] == "413")
            .count(),
        2
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_join_with_engine_usage() {
    let a = MockReplica::start(Script {
        cached_tokens: Some(32),
        ..Script::default()
    })
    .await;
    let b = MockReplica::start(Script {
        cached_tokens: None,
        ..Script::default()
    })
    .await;
    let dir = temp_dir("join");
    let mut cfg = router_config(&[&a, &b], "round-robin");
    cfg.rows = Some(dir.path().join("router.csv"));
    let router = start_router(cfg).await;
    let url = format!("http://{}", router.local_addr());
    for i in 0..4 {
        let rid = format!("req-{i}");
        let r = post(
            &url,
            "/v1/chat/completions",
            chat(&[("user", "hello")]),
            &[("x-request-id", &rid), ("x-session-id", "s1")],
        )
        .await;
        assert_eq!(r.headers["x-request-id"], rid.as_str());
        assert!(r.finish().await.done);
    }
    // Non-streamed responses carry usage in the JSON body.
    let mut body = completion("plain");
    body["stream"] = serde_json::json!(false);
    let (status, v) = read_json(
        post(
            &url,
            "/v1/completions",
            body.clone(),
            &[("x-request-id", "plain-0")],
        )
        .await,
    )
    .await;
    assert_eq!(status, 200);
    assert!(v["usage"]["prompt_tokens"].as_u64().is_some());
    // Without x-request-id the router generates one and returns it.
    let s = post(&url, "/v1/completions", body, &[]).await;
    let generated = s.headers["x-request-id"].to_str().unwrap().to_string();
    assert!(generated.starts_with("kvr-"));
    let _ = read_json(s).await;
    router.shutdown(Duration::from_secs(5)).await;

    let rows = read_rows(&dir.path().join("router.csv"));
    assert_eq!(rows.len(), 6);
    let header: Vec<String> = csv::Reader::from_path(dir.path().join("router.csv"))
        .unwrap()
        .headers()
        .unwrap()
        .iter()
        .map(str::to_string)
        .collect();
    assert_eq!(header, schema::ROUTER_COLUMNS.to_vec());
    let mut reported = a.state.reported.lock().clone();
    reported.extend(b.state.reported.lock().clone());
    assert!(
        reported.contains_key(&generated),
        "the generated id was forwarded upstream"
    );
    for r in &rows {
        let (prompt, cached) = reported[&r["request_id"]];
        assert_eq!(r["prompt_tokens"], prompt.to_string());
        assert_eq!(
            r["cached_tokens"],
            cached.map(|c| c.to_string()).unwrap_or_default()
        );
        assert_eq!(r["upstream_status"], "200");
        assert_eq!(r["attempts"], "1");
        assert_eq!(r["branch"], "rr");
        assert_eq!(r["tokenize_ms"], "");
        assert!(r["arrival_s"].parse::<f64>().unwrap() >= 0.0);
    }
    assert_eq!(rows.iter().filter(|r| r["session_id"] == "s1").count(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_are_forwarded_as_they_arrive() {
    // Lockstep: the replica sends its first event and then waits until the client has read that
    // event through the router. A router that buffered would deadlock here (and time out).
    let a = MockReplica::start(Script {
        hold: true,
        events: 3,
        ..Script::default()
    })
    .await;
    let router = start_router(router_config(&[&a], "round-robin")).await;
    let url = format!("http://{}", router.local_addr());
    let mut s = post(&url, "/v1/completions", completion("lockstep"), &[]).await;
    let first = tokio::time::timeout(WAIT, s.next_event())
        .await
        .expect("first event arrives before the rest is sent")
        .unwrap();
    assert!(first.contains("t0"));
    assert_eq!(a.state.count(), 1);
    a.state.release(1);
    let r = s.finish().await;
    assert!(r.done);
    assert_eq!(r.events.len(), 3);
    router.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunk_timing_through_the_router_matches_direct() {
    let gap = Duration::from_millis(25);
    let a = MockReplica::start(Script {
        events: 8,
        gap,
        ..Script::default()
    })
    .await;
    let router = start_router(router_config(&[&a], "prefix-affinity")).await;
    let via = format!("http://{}", router.local_addr());
    let gaps = |r: &StreamResult| -> Vec<f64> {
        r.times
            .windows(2)
            .map(|w| (w[1] - w[0]).as_secs_f64() * 1e3)
            .collect()
    };
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut direct = Vec::new();
    let mut routed = Vec::new();
    for round in 0..2 {
        let d = run(&a.url, completion(&format!("d{round}")), &[]).await;
        let r = run(&via, completion(&format!("r{round}")), &[]).await;
        // Content gaps only (the usage chunk follows the last token immediately).
        direct.extend(gaps(&d)[..6].to_vec());
        routed.extend(gaps(&r)[..6].to_vec());
    }
    let (md, mr) = (median(direct), median(routed.clone()));
    assert!(
        (mr - md).abs() < 10.0,
        "median gap direct {md:.1} ms vs routed {mr:.1} ms"
    );
    // No coalescing: every routed gap keeps most of the upstream's pacing.
    assert!(
        routed.iter().all(|&g| g > gap.as_secs_f64() * 1e3 * 0.5),
        "{routed:?}"
    );
    router.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_client_does_not_stall_other_streams() {
    // 200 events of 64 KiB: far more than socket buffers hold, so a client that never reads
    // pushes back on its own upstream connection only.
    let a = MockReplica::start(Script {
        events: 200,
        pad_bytes: 64 << 10,
        ..Script::default()
    })
    .await;
    let b = MockReplica::start(Script::default()).await;
    let router = start_router(router_config(&[&a, &b], "round-robin")).await;
    let url = format!("http://{}", router.local_addr());
    let stalled = post(&url, "/v1/completions", completion("slow"), &[]).await;
    assert_eq!(stalled.headers["x-kvroute-replica"], "0");
    a.state.wait_first_sent(1).await;
    // Other streams, on either replica, complete while the slow one sits unread.
    a.state.script.lock().pad_bytes = 0;
    a.state.script.lock().events = 4;
    for i in 0..4 {
        let r = tokio::time::timeout(WAIT, run(&url, completion(&format!("fast {i}")), &[]))
            .await
            .expect("not stalled");
        assert!(r.done);
    }
    drop(stalled);
    router.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_finishes_in_flight_and_flushes_rows() {
    let a = MockReplica::start(Script {
        hold: true,
        ..Script::default()
    })
    .await;
    let dir = temp_dir("shutdown");
    let mut cfg = router_config(&[&a], "round-robin");
    cfg.rows = Some(dir.path().join("router.csv"));
    let router = start_router(cfg).await;
    let url = format!("http://{}", router.local_addr());
    let mut s = post(
        &url,
        "/v1/completions",
        completion("long"),
        &[("x-request-id", "inflight")],
    )
    .await;
    assert!(s.next_event().await.is_some());
    let shutdown = tokio::spawn(router.shutdown(Duration::from_secs(10)));
    // The listener closes; the stream in flight still completes.
    eventually("the serving port closed", WAIT, || {
        let url = url.clone();
        async move {
            tokio::net::TcpStream::connect(url.trim_start_matches("http://"))
                .await
                .is_err()
        }
    })
    .await;
    a.state.release(1);
    let r = s.finish().await;
    assert!(r.done && r.errors().is_empty());
    shutdown.await.unwrap();
    let rows = read_rows(&dir.path().join("router.csv"));
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["request_id"], "inflight");
    assert_eq!(rows[0]["error"], "");
    assert_eq!(rows[0]["cached_tokens"], "16");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_add_remove_models_health_metrics() {
    let a = MockReplica::start(Script::default()).await;
    let b = MockReplica::start(Script::default()).await;
    let router = start_router(router_config(&[&a], "round-robin")).await;
    let url = format!("http://{}", router.local_addr());
    let admin_url = format!("http://{}", router.admin_addr());
    let (status, added) = admin(
        &admin_url,
        "POST",
        "/admin/replicas",
        &format!("{{\"url\":\"{}\"}}", b.url),
    )
    .await;
    assert_eq!(status, 201);
    assert_eq!(added["id"], 1);
    let reps: Vec<u32> = {
        let mut v = Vec::new();
        for i in 0..4 {
            v.push(run(&url, completion(&format!("{i}")), &[]).await.replica());
        }
        v
    };
    assert_eq!(reps.iter().filter(|&&r| r == 1).count(), 2);
    let (status, _) = admin(&admin_url, "DELETE", "/admin/replicas/0", "").await;
    assert_eq!(status, 200);
    let (status, _) = admin(&admin_url, "DELETE", "/admin/replicas/0", "").await;
    assert_eq!(status, 404);
    for i in 0..3 {
        assert_eq!(
            run(&url, completion(&format!("after {i}")), &[])
                .await
                .replica(),
            1
        );
    }
    let (_, list) = admin(&admin_url, "GET", "/admin/replicas", "").await;
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert_eq!(list[0]["id"], 1);
    assert_eq!(list[0]["url"], b.url.as_str());
    // Ids are never reused.
    let (_, again) = admin(
        &admin_url,
        "POST",
        "/admin/replicas",
        &format!("{{\"url\":\"{}\"}}", a.url),
    )
    .await;
    assert_eq!(again["id"], 2);

    let (status, models) = get(&format!("{url}/v1/models")).await;
    assert_eq!(status, 200);
    assert!(models.contains("mock-model"));
    assert_eq!(get(&format!("{url}/health")).await.0, 200);
    // Health checks take a failing replica out of rotation and bring it back.
    b.state.unhealthy.store(true, Ordering::SeqCst);
    a.state.unhealthy.store(true, Ordering::SeqCst);
    eventually("/health 503 with no healthy replica", WAIT, || {
        let u = url.clone();
        async move { get(&format!("{u}/health")).await.0 == 503 }
    })
    .await;
    b.state.unhealthy.store(false, Ordering::SeqCst);
    eventually("/health 200 again", WAIT, || {
        let u = url.clone();
        async move { get(&format!("{u}/health")).await.0 == 200 }
    })
    .await;
    assert_eq!(
        run(&url, completion("healthy again"), &[]).await.replica(),
        1
    );

    // Rows and the overhead histogram are recorded when the router sees each body end, which
    // can trail the client's [DONE] slightly.
    eventually("8 overhead samples", WAIT, || {
        let u = admin_url.clone();
        async move {
            metric(
                &get(&format!("{u}/metrics")).await.1,
                "kvroute_router_overhead_us_count",
            ) == Some(8.0)
        }
    })
    .await;
    let (status, m) = get(&format!("{admin_url}/metrics")).await;
    assert_eq!(status, 200);
    assert_eq!(metric(&m, "kvroute_router_requests_total"), Some(8.0));
    assert_eq!(
        metric(
            &m,
            "kvroute_router_decisions_total{policy=\"round-robin\",branch=\"rr\"}"
        ),
        Some(8.0)
    );
    assert_eq!(metric(&m, "kvroute_router_overhead_us_count"), Some(8.0));
    assert_eq!(
        metric(&m, "kvroute_router_outstanding{replica=\"1\"}"),
        Some(0.0)
    );
    assert!(m.contains("kvroute_router_kv_event_gaps_total{replica=\"1\"} 0"));
    assert_eq!(metric(&m, "kvroute_router_rows_dropped_total"), Some(0.0));
    router.shutdown(Duration::from_secs(5)).await;
}

/// Probes until the router's subscriber to `replica` applies a batch (each probe an empty batch
/// at the next seq); returns the next free seq. Fails when the subscription is not live within
/// [`WAIT`].
async fn wait_subscribed(publisher: &mut MockPublisher, metrics_url: &str, replica: u32) -> u64 {
    probe_until_applied(publisher, metrics_url, replica, 0.0, 0).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequence_gaps_are_repaired_by_replay() {
    use kv_index::KvEvent;
    use proxy::events::encode::{Encoding, batch};
    let a = MockReplica::start(Script::default()).await;
    let b = MockReplica::start(Script::default()).await;
    let mut pub_b = MockPublisher::bind_with_replay().await;
    let mut cfg = router_config(&[&a, &b], "exact-residency");
    cfg.replicas[1].kv_events = Some(pub_b.endpoint.clone());
    cfg.replicas[1].kv_replay = pub_b.replay.clone();
    let router = start_router(cfg).await;
    let url = format!("http://{}", router.local_addr());
    let admin_url = format!("http://{}", router.admin_addr());
    let metrics_url = format!("{admin_url}/metrics");
    let mut seq = wait_subscribed(&mut pub_b, &metrics_url, 1).await;
    let m = get(&metrics_url).await.1;
    let gaps0 = metric(&m, "kvroute_router_kv_event_gaps_total{replica=\"1\"}").unwrap();
    assert_eq!(
        metric(
            &m,
            "kvroute_router_kv_event_gaps_unrepaired_total{replica=\"1\"}"
        ),
        Some(0.0),
        "late join repaired by replay"
    );

    // The Stored batch is lost on the wire; the next batch reveals the gap and replay fills it.
    let prompt =
        "Replay must recover what the wire lost, block by block, before routing on it again!!";
    let tokens: Vec<u32> = prompt.bytes().map(u32::from).collect();
    let stored = KvEvent::Stored {
        block_hashes: vec![1, 2, 3, 4, 5],
        parent_block_hash: None,
        token_ids: tokens[..80].to_vec(),
        block_size: 16,
        cache_salt: None,
    };
    pub_b.lose(seq, batch(1.0, &[stored], Encoding::Map));
    pub_b
        .publish(seq + 1, batch(1.1, &[], Encoding::Array))
        .await;
    seq += 2;
    eventually("the gap counted", WAIT, || {
        let u = metrics_url.clone();
        async move {
            metric(
                &get(&u).await.1,
                "kvroute_router_kv_event_gaps_total{replica=\"1\"}",
            )
            .unwrap()
                > gaps0
        }
    })
    .await;
    let m = get(&metrics_url).await.1;
    assert_eq!(
        metric(
            &m,
            "kvroute_router_kv_event_gaps_unrepaired_total{replica=\"1\"}"
        ),
        Some(0.0)
    );
    let r = run(&url, completion(prompt), &[]).await;
    assert_eq!(r.replica(), 1, "the replayed Stored event was applied");

    // An engine restart (sequence back to 0) clears what the router knew.
    pub_b.publish(0, batch(2.0, &[], Encoding::Map)).await;
    let _ = seq;
    eventually("the gap counted", WAIT, || {
        let u = metrics_url.clone();
        async move {
            metric(
                &get(&u).await.1,
                "kvroute_router_kv_event_gaps_total{replica=\"1\"}",
            )
            .unwrap()
                > gaps0 + 1.0
        }
    })
    .await;
    let miss = "kvroute_router_decisions_total{policy=\"exact-residency\",branch=\"miss\"}";
    let misses = metric(&get(&metrics_url).await.1, miss).unwrap();
    assert_eq!(run(&url, completion(prompt), &[]).await.status, 200);
    assert_eq!(
        metric(&get(&metrics_url).await.1, miss).unwrap(),
        misses + 1.0,
        "restart cleared the residency"
    );
    let dir_rows = router.shared().rows.stats().written.load(Ordering::Relaxed);
    assert_eq!(dir_rows, 0, "no rows file configured, nothing written");
    router.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_errors_pass_through_and_are_recorded() {
    let a = MockReplica::start(Script {
        fail_status: Some(400),
        ..Script::default()
    })
    .await;
    let dir = temp_dir("upstream-error");
    let mut cfg = router_config(&[&a], "round-robin");
    cfg.rows = Some(dir.path().join("router.csv"));
    let router = start_router(cfg).await;
    let url = format!("http://{}", router.local_addr());
    let (status, v) = read_json(
        post(
            &url,
            "/v1/completions",
            completion("too long"),
            &[("x-request-id", "e1")],
        )
        .await,
    )
    .await;
    assert_eq!(
        status, 400,
        "the replica's status reaches the client unchanged"
    );
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("maximum context length")
    );
    router.shutdown(Duration::from_secs(5)).await;
    let rows = read_rows(&dir.path().join("router.csv"));
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["upstream_status"], "400");
    assert_eq!(rows[0]["error"], "http: upstream status 400");
    assert_eq!(rows[0]["attempts"], "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_and_load_are_atomic_under_concurrency() {
    // 40 requests race into least-outstanding over 4 held replicas. Only if every decision sees
    // every earlier increment does each replica end up with exactly 10.
    let held = Script {
        hold: true,
        ..Script::default()
    };
    let reps = [
        MockReplica::start(held.clone()).await,
        MockReplica::start(held.clone()).await,
        MockReplica::start(held.clone()).await,
        MockReplica::start(held).await,
    ];
    let router = start_router(router_config(
        &[&reps[0], &reps[1], &reps[2], &reps[3]],
        "least-outstanding",
    ))
    .await;
    let url = format!("http://{}", router.local_addr());
    let admin_url = format!("http://{}", router.admin_addr());
    let mut tasks = Vec::new();
    for i in 0..40 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            post(&url, "/v1/completions", completion(&format!("c{i}")), &[])
                .await
                .finish()
                .await
        }));
    }
    for r in &reps {
        r.state.wait_requests(10).await;
    }
    let (_, list) = admin(&admin_url, "GET", "/admin/replicas", "").await;
    for r in list.as_array().unwrap() {
        assert_eq!(r["outstanding"], 10, "{list}");
    }
    for r in &reps {
        assert_eq!(r.state.count(), 10);
        r.state.release(100);
    }
    for t in tasks {
        assert!(t.await.unwrap().done);
    }
    // The client may read [DONE] just before the router sees the upstream's end of body.
    eventually("no request in flight", WAIT, || {
        let admin_url = admin_url.clone();
        async move {
            let list = admin(&admin_url, "GET", "/admin/replicas", "").await.1;
            list.as_array()
                .unwrap()
                .iter()
                .all(|r| r["outstanding"] == 0)
        }
    })
    .await;
    router.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_hanging_up_releases_its_load() {
    let a = MockReplica::start(Script {
        hold: true,
        ..Script::default()
    })
    .await;
    let dir = temp_dir("hangup");
    let mut cfg = router_config(&[&a], "least-outstanding");
    cfg.rows = Some(dir.path().join("router.csv"));
    let router = start_router(cfg).await;
    let url = format!("http://{}", router.local_addr());
    let admin_url = format!("http://{}", router.admin_addr());
    let mut s = post(
        &url,
        "/v1/completions",
        completion("bye"),
        &[("x-request-id", "gone")],
    )
    .await;
    assert!(s.next_event().await.is_some());
    let (_, list) = admin(&admin_url, "GET", "/admin/replicas", "").await;
    assert_eq!(list[0]["outstanding"], 1);
    drop(s);
    // The router notices the closed client connection and drops the response body.
    eventually("replica 0 idle", WAIT, || {
        let admin_url = admin_url.clone();
        async move { admin(&admin_url, "GET", "/admin/replicas", "").await.1[0]["outstanding"] == 0 }
    })
    .await;
    a.state.release(10);
    router.shutdown(Duration::from_secs(5)).await;
    let rows = read_rows(&dir.path().join("router.csv"));
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["request_id"], "gone");
    assert!(rows[0]["error"].starts_with("client:"), "{:?}", rows[0]);
}

/// Waits until hyper has handed `n` LLM requests to the router (a connection still in the
/// listener's backlog at shutdown never reaches it).
async fn handed_over(shared: &std::sync::Arc<proxy::state::Shared>, n: u64) {
    eventually("the requests counted", WAIT, || {
        let shared = shared.clone();
        async move { shared.metrics.requests.load(Ordering::Relaxed) >= n }
    })
    .await;
}

/// The one router row of `request_id`, after checking it is the only row.
fn only_row(dir: &std::path::Path, request_id: &str) -> std::collections::HashMap<String, String> {
    let rows = read_rows(&dir.join("router.csv"));
    assert_eq!(rows.len(), 1, "exactly one row per request: {rows:?}");
    assert_eq!(rows[0]["request_id"], request_id);
    rows.into_iter().next().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_before_the_head_leaves_its_row() {
    let a = MockReplica::start(Script::default()).await;
    let b = MockReplica::start(Script {
        hold_head: true,
        ..Script::default()
    })
    .await;
    let dir = temp_dir("gone-before-head");
    let mut cfg = router_config(&[&a, &b], "least-outstanding");
    cfg.rows = Some(dir.path().join("router.csv"));
    let router = start_router(cfg).await;
    let shared = router.shared().clone();
    // Replica 0 drained, so the choice (replica 1) is not the column's first value.
    shared
        .replica(0)
        .unwrap()
        .draining
        .store(true, Ordering::Relaxed);
    let body = completion("bye").to_string();
    let conn = raw_post(
        router.local_addr(),
        "/v1/completions",
        body.len(),
        body.as_bytes(),
        &[("x-request-id", "gone-early"), ("x-session-id", "s-gone")],
    )
    .await;
    // The replica holds the whole request and has not answered: the router waits for the head.
    b.state.wait_requests(1).await;
    let chosen = shared.replica(1).unwrap();
    assert_eq!(chosen.outstanding.load(Ordering::Acquire), 1);
    drop(conn);
    // The router notices the closed connection and drops the request: its load is released.
    eventually("the chosen replica's load released", WAIT, || {
        let chosen = chosen.clone();
        async move { chosen.outstanding.load(Ordering::Acquire) == 0 }
    })
    .await;
    b.state.release_heads(1);
    router.shutdown(Duration::from_secs(5)).await;
    let row = only_row(dir.path(), "gone-early");
    assert_eq!(row["session_id"], "s-gone");
    assert_eq!(row["replica"], "1", "{row:?}");
    assert_eq!(row["branch"], "least", "{row:?}");
    assert_eq!(row["attempts"], "1");
    assert!(!row["decide_ns"].is_empty() && !row["arrival_s"].is_empty());
    assert_eq!(row["upstream_status"], "", "no head came back");
    assert_eq!(row["overhead_us"], "");
    assert_eq!(
        row["error"], "client: disconnected before the response head",
        "{row:?}"
    );
    assert_eq!(a.state.count(), 0);
    assert_eq!(shared.metrics.client_disconnects.load(Ordering::Relaxed), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_as_soon_as_it_sent_leaves_its_row() {
    // The hang-up can reach the router in the same read as the request: hyper may then drop
    // the handler before ever polling it. The row must exist from the moment hyper calls it.
    let a = MockReplica::start(Script {
        hold_head: true,
        ..Script::default()
    })
    .await;
    let dir = temp_dir("gone-at-once");
    let mut cfg = router_config(&[&a], "round-robin");
    cfg.rows = Some(dir.path().join("router.csv"));
    let router = start_router(cfg).await;
    let shared = router.shared().clone();
    let body = completion("hit and run").to_string();
    let conn = raw_post(
        router.local_addr(),
        "/v1/completions",
        body.len(),
        body.as_bytes(),
        &[("x-request-id", "gone-at-once")],
    )
    .await;
    drop(conn);
    handed_over(&shared, 1).await;
    // Shutdown waits for the connection, which ends on its own once the hang-up is read.
    router.shutdown(Duration::from_secs(5)).await;
    a.state.release_heads(1);
    let row = only_row(dir.path(), "gone-at-once");
    assert!(
        row["error"].starts_with("client: disconnected before the response head"),
        "{row:?}"
    );
    assert_eq!(row["upstream_status"], "");
    // Dispatched or not, the row says what the router did: a replica exactly when it tried one.
    assert_eq!(row["replica"].is_empty(), row["attempts"] == "0", "{row:?}");
    assert_eq!(shared.metrics.client_disconnects.load(Ordering::Relaxed), 1);
    assert_eq!(
        shared
            .replica(0)
            .unwrap()
            .outstanding
            .load(Ordering::Acquire),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_while_sending_its_body_leaves_its_row() {
    let a = MockReplica::start(Script::default()).await;
    let dir = temp_dir("gone-in-body");
    let mut cfg = router_config(&[&a], "round-robin");
    cfg.rows = Some(dir.path().join("router.csv"));
    let router = start_router(cfg).await;
    let shared = router.shared().clone();
    let conn = raw_post(
        router.local_addr(),
        "/v1/completions",
        1000,
        b"{\"prompt\":\"cut sh",
        &[("x-request-id", "gone-in-body")],
    )
    .await;
    drop(conn);
    handed_over(&shared, 1).await;
    router.shutdown(Duration::from_secs(5)).await;
    let row = only_row(dir.path(), "gone-in-body");
    assert!(
        row["error"].starts_with("client: disconnected while sending the request body"),
        "{row:?}"
    );
    assert_eq!(row["replica"], "");
    assert_eq!(row["attempts"], "0");
    assert_eq!(row["upstream_status"], "", "nobody got the router's answer");
    assert_eq!(shared.metrics.client_disconnects.load(Ordering::Relaxed), 1);
    assert_eq!(shared.metrics.bad_requests.load(Ordering::Relaxed), 0);
    assert_eq!(a.state.count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_past_its_grace_cuts_with_rows_that_say_so() {
    let a = MockReplica::start(Script {
        hold: true,
        ..Script::default()
    })
    .await;
    let dir = temp_dir("cut");
    let mut cfg = router_config(&[&a], "round-robin");
    cfg.rows = Some(dir.path().join("router.csv"));
    let router = start_router(cfg).await;
    let shared = router.shared().clone();
    let url = format!("http://{}", router.local_addr());
    // One request streaming (held after its first event), one waiting for its head.
    let mut streaming = post(
        &url,
        "/v1/completions",
        completion("long"),
        &[("x-request-id", "cut-streaming")],
    )
    .await;
    assert!(streaming.next_event().await.is_some());
    a.state.script.lock().hold_head = true;
    let waiting = tokio::spawn({
        let url = url.clone();
        async move {
            let req = http::Request::post(format!("{url}/v1/completions"))
                .header("x-request-id", "cut-waiting")
                .body(http_body_util::Full::new(bytes::Bytes::from(
                    completion("short").to_string(),
                )))
                .unwrap();
            client().request(req).await.is_err()
        }
    });
    a.state.wait_requests(2).await;
    router.shutdown(Duration::ZERO).await;
    assert!(waiting.await.unwrap(), "the waiting client got no answer");
    let _ = streaming.finish().await;
    let mut rows = read_rows(&dir.path().join("router.csv"));
    rows.sort_by(|x, y| x["request_id"].cmp(&y["request_id"]));
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(rows[0]["request_id"], "cut-streaming");
    assert_eq!(
        rows[0]["error"], "shutdown: cut before the response ended",
        "{:?}",
        rows[0]
    );
    assert_eq!(rows[0]["upstream_status"], "200");
    assert_eq!(rows[1]["request_id"], "cut-waiting");
    assert_eq!(
        rows[1]["error"], "shutdown: cut before the response head",
        "{:?}",
        rows[1]
    );
    assert_eq!(rows[1]["replica"], "0");
    assert_eq!(
        shared.metrics.client_disconnects.load(Ordering::Relaxed),
        0,
        "the router cut them; no client left"
    );
    a.state.release(1);
    a.state.release_heads(1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_residency_spec_trusts_what_it_just_routed() {
    // No KV events at all: only the speculative layer (fed by on_served with exact keys) can
    // make the second identical request follow the first.
    let reps = [
        MockReplica::start(Script::default()).await,
        MockReplica::start(Script::default()).await,
        MockReplica::start(Script::default()).await,
    ];
    let dir = temp_dir("spec");
    let mut cfg = router_config(&[&reps[0], &reps[1], &reps[2]], "exact-residency-spec");
    cfg.rows = Some(dir.path().join("router.csv"));
    cfg.model = Some("mock-model".into());
    cfg.policy.salt = "mock-model".into();
    let router = start_router(cfg).await;
    let url = format!("http://{}", router.local_addr());
    let prompt =
        "A prompt long enough for a few sixteen-token blocks of the mock tokenizer, one byte each.";
    let first = run(&url, completion(prompt), &[("x-request-id", "s1")])
        .await
        .replica();
    let second = run(&url, completion(prompt), &[("x-request-id", "s2")])
        .await
        .replica();
    assert_eq!(first, second);
    router.shutdown(Duration::from_secs(5)).await;
    let rows = read_rows(&dir.path().join("router.csv"));
    let by_id: std::collections::HashMap<_, _> =
        rows.iter().map(|r| (r["request_id"].clone(), r)).collect();
    assert_eq!(by_id["s1"]["branch"], "miss");
    assert_eq!(by_id["s2"]["branch"], "match");
    assert!(
        by_id["s2"]["predicted_match_tokens"]
            .parse::<u32>()
            .unwrap()
            >= 64
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_added_at_run_time_gets_its_events() {
    use kv_index::KvEvent;
    use proxy::events::encode::{Encoding, batch};
    let a = MockReplica::start(Script::default()).await;
    let b = MockReplica::start(Script::default()).await;
    let mut pub_b = MockPublisher::bind().await;
    let mut cfg = router_config(&[&a], "exact-residency");
    cfg.model = Some("mock-model".into());
    cfg.policy.salt = "mock-model".into();
    let router = start_router(cfg).await;
    let url = format!("http://{}", router.local_addr());
    let admin_url = format!("http://{}", router.admin_addr());
    let body = serde_json::json!({"url": b.url, "kv_events": pub_b.endpoint});
    let (status, added) = admin(&admin_url, "POST", "/admin/replicas", &body.to_string()).await;
    assert_eq!(status, 201);
    assert_eq!(added["kv_events"], pub_b.endpoint.as_str());
    let metrics_url = format!("{admin_url}/metrics");
    let seq = wait_subscribed(&mut pub_b, &metrics_url, 1).await;
    let prompt =
        "Events from a replica that joined later still steer requests towards its warm cache.";
    let tokens: Vec<u32> = prompt.bytes().map(u32::from).collect();
    let stored = KvEvent::Stored {
        block_hashes: vec![7, 8, 9],
        parent_block_hash: None,
        token_ids: tokens[..48].to_vec(),
        block_size: 16,
        cache_salt: None,
    };
    pub_b
        .publish(seq, batch(1.0, &[stored], Encoding::Array))
        .await;
    eventually("replica 1's batch applied", WAIT, || {
        let u = metrics_url.clone();
        async move {
            metric(
                &get(&u).await.1,
                "kvroute_router_kv_event_batches_total{replica=\"1\"}",
            )
            .unwrap()
                >= 2.0
        }
    })
    .await;
    for _ in 0..3 {
        assert_eq!(run(&url, completion(prompt), &[]).await.replica(), 1);
    }
    router.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_retried_on_the_next_choice() {
    let a = MockReplica::start(Script::default()).await;
    // A port that refuses connections: bound, then closed.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let dir = temp_dir("refused");
    let mut cfg = router_config(&[&a], "round-robin");
    cfg.rows = Some(dir.path().join("router.csv"));
    // Health checks far apart, so only the request path can discover the dead replica.
    cfg.health_interval_ms = 600_000;
    let router = start_router(cfg).await;
    let url = format!("http://{}", router.local_addr());
    let admin_url = format!("http://{}", router.admin_addr());
    // Let the health loop's first round finish; the next one is ten minutes away.
    let st = a.state.clone();
    eventually("a health check", WAIT, || {
        let st = st.clone();
        async move { st.health_calls.load(Ordering::SeqCst) >= 1 }
    })
    .await;
    let (status, _) = admin(
        &admin_url,
        "POST",
        "/admin/replicas",
        &format!("{{\"url\":\"{dead}\"}}"),
    )
    .await;
    assert_eq!(status, 201);
    // Passive health: each refused connection counts one failure; the third in a row takes the
    // replica out (hysteresis), and every request is still answered by the live replica.
    for i in 0..12 {
        let r = run(
            &url,
            completion(&format!("r{i}")),
            &[("x-request-id", &format!("r{i}"))],
        )
        .await;
        assert_eq!(r.status, 200);
        assert!(r.done && r.errors().is_empty());
        assert_eq!(r.replica(), 0);
    }
    let (_, list) = admin(&admin_url, "GET", "/admin/replicas", "").await;
    assert_eq!(
        list[1]["healthy"], false,
        "three refused connections take the replica out"
    );
    assert_eq!(list[1]["upstream_errors"], 3);
    assert_eq!(list[1]["marked_down"], 1);
    router.shutdown(Duration::from_secs(5)).await;
    let rows = read_rows(&dir.path().join("router.csv"));
    assert_eq!(rows.len(), 12);
    assert_eq!(
        rows.iter().filter(|r| r["attempts"] == "2").count(),
        3,
        "{rows:?}"
    );
    assert!(
        rows.iter()
            .all(|r| r["error"].is_empty() && r["replica"] == "0")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_bytes_per_token_estimate_is_a_config_error() {
    let a = MockReplica::start(Script::default()).await;
    for bad in [0.0, -3.9, f64::NAN, f64::INFINITY] {
        let mut cfg = router_config(&[&a], "prefix-affinity");
        cfg.bytes_per_token = bad;
        match proxy::Router::start(cfg).await {
            Err(proxy::RouterError::Config(m)) => assert!(m.contains("bytes per token"), "{m}"),
            Err(e) => panic!("{bad}: wrong error {e}"),
            Ok(_) => panic!("{bad}: router started"),
        }
    }
}
