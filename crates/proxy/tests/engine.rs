//! End to end against the engine emulator (in-process servers on loopback): the router fronts an
//! emulated fleet unchanged, exact residency follows the engines' own KV events (both encodings),
//! and router rows join with the cached tokens the engines report.

mod common;

use std::time::Duration;

use common::*;
use engine::kv_events::Encoding;
use engine::server::{DEFAULT_MODEL, KvEventsConfig, Server, ServerConfig};

/// An emulated replica, fast (speed 50) and reporting `cached_tokens`.
async fn start_engine(events: Option<Encoding>) -> Server {
    let mut cfg = ServerConfig {
        enable_prompt_tokens_details: true,
        ..ServerConfig::default()
    };
    cfg.engine.model.speed = 50.0;
    cfg.kv_events = events.map(|encoding| KvEventsConfig {
        endpoint: "tcp://127.0.0.1:0".into(),
        bind: true,
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        topic: "kv@test".into(),
        buffer_steps: 10_000,
        encoding,
    });
    engine::server::start(cfg).await.expect("engine starts")
}

fn system_prompt() -> String {
    "You are a meticulous assistant for a logistics company. Answer with numbered steps, cite the \
     relevant policy section, and never invent shipment identifiers. "
        .repeat(6)
}

fn convo_body(turns: &[String]) -> serde_json::Value {
    let mut msgs = vec![serde_json::json!({"role":"system","content":system_prompt()})];
    for (i, t) in turns.iter().enumerate() {
        msgs.push(serde_json::json!({"role":"user","content":t}));
        if i + 1 < turns.len() {
            msgs.push(serde_json::json!({"role":"assistant","content":format!("Reply number {i}, scripted.")}));
        }
    }
    serde_json::json!({"model":DEFAULT_MODEL,"messages":msgs,"max_tokens":8,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}})
}

fn sorted_rows(path: &std::path::Path) -> Vec<std::collections::HashMap<String, String>> {
    let mut rows = read_rows(path);
    rows.sort_by(|x, y| {
        x["arrival_s"]
            .parse::<f64>()
            .unwrap()
            .total_cmp(&y["arrival_s"].parse::<f64>().unwrap())
    });
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_residency_follows_engine_events_and_rows_join() {
    let e0 = start_engine(Some(Encoding::Array)).await;
    let e1 = start_engine(Some(Encoding::Map)).await;
    let dir = temp_dir("engine-exact");
    let mut p = policies::PolicySpec::named("exact-residency");
    p.salt = DEFAULT_MODEL.into();
    let mut cfg = proxy::RouterConfig::new(
        [&e0, &e1]
            .iter()
            .map(|e| proxy::ReplicaSpec {
                url: format!("http://{}", e.addr()),
                kv_events: e.kv_events_endpoint().map(str::to_string),
                kv_replay: e.kv_replay_endpoint().map(str::to_string),
            })
            .collect(),
        p,
    );
    cfg.rows = Some(dir.path().join("router.csv"));
    cfg.model = Some(DEFAULT_MODEL.into());
    let router = start_router(cfg).await;
    let url = format!("http://{}", router.local_addr());
    let metrics_url = format!("http://{}/metrics", router.admin_addr());

    // Two conversations, three turns each, one turn at a time (as the driver sends them).
    let mut homes = Vec::new();
    for c in 0..2 {
        let mut turns = Vec::new();
        let mut home = None;
        for t in 0..3 {
            let before = get(&metrics_url).await.1;
            let applied_before = |r: u32| {
                metric(
                    &before,
                    &format!("kvroute_router_kv_event_batches_total{{replica=\"{r}\"}}"),
                )
                .unwrap_or(0.0)
            };
            turns.push(format!(
                "Conversation {c}, question {t}: where is my parcel?"
            ));
            let r = post(
                &url,
                "/v1/chat/completions",
                convo_body(&turns),
                &[("x-session-id", &format!("c{c}"))],
            )
            .await
            .finish()
            .await;
            assert_eq!(r.status, 200);
            assert!(r.done && r.errors().is_empty());
            let usage: serde_json::Value = serde_json::from_str(r.events.last().unwrap()).unwrap();
            assert!(usage["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
            match home {
                None => home = Some(r.replica()),
                Some(h) => assert_eq!(r.replica(), h, "conversation {c} turn {t} left its cache"),
            }
            // The engine publishes a prompt's stores as it schedules the prefill; wait until the
            // router has applied this turn's batch before the next turn routes on it.
            let replica = r.replica();
            let floor = applied_before(replica);
            eventually(
                &format!("replica {replica}'s KV-event subscription live"),
                WAIT,
                || {
                    let u = metrics_url.clone();
                    async move {
                        metric(
                            &get(&u).await.1,
                            &format!(
                                "kvroute_router_kv_event_batches_total{{replica=\"{replica}\"}}"
                            ),
                        )
                        .unwrap_or(0.0)
                            > floor
                    }
                },
            )
            .await;
        }
        homes.push(home.unwrap());
    }
    let m = get(&metrics_url).await.1;
    for r in 0..2 {
        assert_eq!(
            metric(
                &m,
                &format!("kvroute_router_kv_event_gaps_unrepaired_total{{replica=\"{r}\"}}")
            ),
            Some(0.0)
        );
        assert_eq!(
            metric(
                &m,
                &format!("kvroute_router_kv_event_decode_errors_total{{replica=\"{r}\"}}")
            ),
            Some(0.0)
        );
    }
    router.shutdown(Duration::from_secs(5)).await;

    let rows = sorted_rows(&dir.path().join("router.csv"));
    assert_eq!(rows.len(), 6);
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r["error"], "");
        assert!(
            r["tokenize_ms"].parse::<f64>().unwrap() > 0.0,
            "tokenize round trip timed"
        );
        // Empty = not reported (vLLM omits zero until the replica has shown it reports at all).
        let cached: u64 = r["cached_tokens"].parse().unwrap_or(0);
        let prompt: u64 = r["prompt_tokens"].parse().unwrap();
        let predicted: u64 = r["predicted_match_tokens"].parse().unwrap();
        assert!(cached < prompt);
        if i % 3 == 0 {
            // A later conversation shares the system prompt: it may match it, but never more.
            assert!(
                predicted <= cached + 16,
                "row {i}: predicted {predicted} > cached {cached}"
            );
        } else {
            assert_eq!(r["branch"], "match", "row {i}");
            // Exact residency predicts what the engine then reports (block-aligned; the engine
            // caps a full hit at prompt − 1).
            assert!(cached > 0, "row {i}");
            assert!(
                predicted >= cached,
                "row {i}: predicted {predicted} < cached {cached}"
            );
            assert!(
                predicted <= cached + 16,
                "row {i}: predicted {predicted} ≫ cached {cached}"
            );
        }
    }
    e0.shutdown().await;
    e1.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_affinity_fronts_an_emulated_fleet() {
    let engines = [
        start_engine(None).await,
        start_engine(None).await,
        start_engine(None).await,
    ];
    let dir = temp_dir("engine-affinity");
    let mut cfg = proxy::RouterConfig::new(
        engines
            .iter()
            .map(|e| proxy::ReplicaSpec::new(format!("http://{}", e.addr())))
            .collect(),
        policies::PolicySpec::named("prefix-affinity"),
    );
    cfg.rows = Some(dir.path().join("router.csv"));
    cfg.model = Some(DEFAULT_MODEL.into());
    let router = start_router(cfg).await;
    let url = format!("http://{}", router.local_addr());
    let (status, models) = get(&format!("{url}/v1/models")).await;
    assert_eq!(status, 200);
    assert!(models.contains(DEFAULT_MODEL));
    for c in 0..3 {
        let mut turns = Vec::new();
        for t in 0..3 {
            turns.push(format!(
                "Conversation {c}, question {t}: please summarise the policy."
            ));
            let r = post(
                &url,
                "/v1/chat/completions",
                convo_body(&turns),
                &[("x-request-id", &format!("c{c}-t{t}"))],
            )
            .await
            .finish()
            .await;
            assert!(r.done && r.errors().is_empty());
        }
    }
    // A non-streamed completions request passes through too.
    let body =
        serde_json::json!({"model":DEFAULT_MODEL,"prompt":"Hello there, emulator.","max_tokens":4});
    let (status, v) = read_json(post(&url, "/v1/completions", body, &[]).await).await;
    assert_eq!(status, 200);
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    router.shutdown(Duration::from_secs(5)).await;

    let rows = read_rows(&dir.path().join("router.csv"));
    assert_eq!(rows.len(), 10);
    let later_turns: Vec<_> = rows
        .iter()
        .filter(|r| r["request_id"].ends_with("-t1") || r["request_id"].ends_with("-t2"))
        .collect();
    assert_eq!(later_turns.len(), 6);
    for r in later_turns {
        assert_eq!(r["branch"], "match", "{r:?}");
        // The belief came true: the engine reports cache hits on the replica the router chose.
        assert!(r["cached_tokens"].parse::<u64>().unwrap() > 0, "{r:?}");
        let predicted = r["predicted_match_tokens"].parse::<u64>().unwrap();
        assert!(predicted > 0);
        // …and the belief's size came true too: matched bytes converted at the bytes-per-token
        // estimate land within one engine block of the engine's block-aligned hit (a fixed
        // 4 bytes/token under-predicted every later turn, by more as the conversation grew).
        let cached = r["cached_tokens"].parse::<u64>().unwrap();
        assert!(predicted.abs_diff(cached) <= 16, "{r:?}");
    }
    for e in engines {
        e.shutdown().await;
    }
}
