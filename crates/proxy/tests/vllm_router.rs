//! The router in front of a real vLLM replica (`fleet::vllm`, docs/vllm.md): token parity against
//! the engine, exact residency fed by its live KV events, and an engine restarted at the same
//! URL and event endpoint.
//!
//! 1. Parity: a router keying 16-token blocks is refused (the engine's `/metrics` says 32); one
//!    keying 32 starts, its three probes agreeing with the engine's `return_token_ids`.
//! 2. Exact residency: 4 conversations × 4 turns of chat (each turn the previous messages, the
//!    engine's own reply and a new question; streamed with `include_usage` on odd turns), one
//!    request at a time through an `exact-residency` router. Each request's predicted match (the
//!    row's `predicted_match_tokens`) is compared with the engine's `cached_tokens`: the share
//!    of predicted tokens the engine had must be ≥ 98%, the bar (the index learns a turn's
//!    blocks from events that race the next turn), and every prompt's token count must equal the
//!    engine's (`kvroute_router_prompt_token_mismatches_total` 0).
//! 3. Restart: the replica is killed and a new one started on the same ports. The router must
//!    count the restart and drop the old residency: the first conversation's last prompt, sent
//!    again, is predicted 0 — what the new engine has.
//!
//! Ignored by default (`cargo test -p proxy --test vllm_router -- --include-ignored`), never
//! skipped: without vLLM the test fails with `bash scripts/vllm-server.sh`.

mod common;

use std::time::Duration;

use common::*;
use proxy::{ReplicaSpec, Router, RouterConfig};
use serde_json::{Value, json};

const MODEL: &str = fleet::vllm::SERVED_MODEL;

fn router_config(url: &str, kv_events: &str, block_tokens: u32) -> RouterConfig {
    let mut p = policies::PolicySpec::named("exact-residency");
    p.tokens_per_block = block_tokens;
    p.salt = MODEL.into();
    let mut spec = ReplicaSpec::new(url.to_string());
    spec.kv_events = Some(kv_events.to_string());
    let mut cfg = RouterConfig::new(vec![spec], p);
    cfg.model = Some(MODEL.into());
    cfg.health_interval_ms = 200;
    cfg
}

/// The sum of a per-replica counter's samples on the router's `/metrics`.
async fn counter(router: &Router, name: &str) -> f64 {
    let (_, text) = get(&format!("http://{}/metrics", router.admin_addr())).await;
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// One chat turn through the router; the assistant's reply text.
async fn turn(url: &str, messages: &[Value], stream: bool) -> String {
    let mut body = json!({"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0});
    if stream {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let s = post(url, "/v1/chat/completions", body, &[]).await;
        assert_eq!(s.status, 200);
        let r = s.finish().await;
        assert!(r.done, "the stream ended with [DONE]");
        r.events
            .iter()
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .filter_map(|v| {
                v.pointer("/choices/0/delta/content")?
                    .as_str()
                    .map(str::to_owned)
            })
            .collect()
    } else {
        let (status, v) = read_json(post(url, "/v1/chat/completions", body, &[]).await).await;
        assert_eq!(status, 200, "{v}");
        v.pointer("/choices/0/message/content")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs vLLM: bash scripts/vllm-server.sh"]
async fn exact_residency_matches_a_real_vllm_and_survives_its_restart() {
    let tmp = temp_dir("vllm-router");
    let logs = tmp.path().to_path_buf();
    let mut replica = tokio::task::spawn_blocking(move || vllm_replica(&logs))
        .await
        .unwrap();
    let replica_url = replica.urls()[0].clone();
    let kv_events = replica.kv_event_endpoints()[0]
        .clone()
        .expect("KV events on");

    // 1. Parity.
    let refused = Router::start(router_config(&replica_url, &kv_events, 16))
        .await
        .err()
        .expect("16-token keys are refused")
        .to_string();
    assert!(
        refused.contains("caches in blocks of 32 tokens") && refused.contains("--block-tokens 32"),
        "{refused}"
    );
    let rows = tmp.path().join("router.csv");
    let mut cfg = router_config(&replica_url, &kv_events, 32);
    cfg.rows = Some(rows.clone());
    let router = Router::start(cfg).await.expect("32-token keys agree");
    assert_eq!(
        counter(&router, "kvroute_router_token_parity_agreed_total").await,
        1.0
    );
    let url = format!("http://{}", router.local_addr());

    // 2. Exact residency from live events.
    let topics = [
        "harbour cranes",
        "glacier ice",
        "river deltas",
        "desert winds",
    ];
    let mut convs: Vec<Vec<Value>> = topics
        .iter()
        .map(|t| {
            vec![json!({"role": "system", "content": format!("You explain {t} to students in plain words, with one example each time. Keep every answer short and concrete.")})]
        })
        .collect();
    let mut sent = 0;
    for round in 0..4 {
        for (c, topic) in topics.iter().enumerate() {
            convs[c].push(json!({"role": "user", "content": format!("Question {round} about {topic}: what happens next, and why does it matter for the people living nearby? Give numbers where you can.")}));
            let reply = turn(&url, &convs[c], round % 2 == 1).await;
            convs[c].push(json!({"role": "assistant", "content": reply}));
            sent += 1;
        }
    }
    assert_eq!(
        counter(&router, "kvroute_router_prompt_token_mismatches_total").await,
        0.0
    );
    assert_eq!(
        counter(&router, "kvroute_router_prompt_tokens_compared_total").await,
        f64::from(sent)
    );

    // 3. A restart at the same URL and event endpoint.
    // SIGKILL, then a new process on the same ports (the fleet's fault restart).
    replica = tokio::task::spawn_blocking(move || {
        replica.kill_one(0).unwrap_or_else(|e| panic!("{e}"));
        replica
            .restart_one(0, &fleet::fleet::never)
            .unwrap_or_else(|e| panic!("{e}"));
        replica
    })
    .await
    .unwrap();
    // The old publisher's connection closing, or the new one's sequence starting again at 0.
    eventually("the router counts the engine restart", WAIT, || {
        let router = &router;
        async move { counter(router, "kvroute_router_kv_event_restarts_total").await >= 1.0 }
    })
    .await;
    // The health checks may have marked the replica down during the restart: wait until it
    // is eligible again before the repeat.
    let health = format!("http://{}/health", router.local_addr());
    eventually("the restarted replica is eligible", WAIT, || {
        let h = health.clone();
        async move { get(&h).await.0 == 200 }
    })
    .await;
    let last = convs[0][..convs[0].len() - 1].to_vec();
    turn(&url, &last, false).await;
    router.shutdown(Duration::from_secs(10)).await;
    drop(replica);

    let rows = read_rows(&rows);
    assert_eq!(rows.len(), sent as usize + 1, "one row per request");
    let num = |r: &std::collections::HashMap<String, String>, k: &str| -> u64 {
        r.get(k).and_then(|v| v.parse().ok()).unwrap_or(0)
    };
    let (mut predicted, mut had, mut exact) = (0u64, 0u64, 0usize);
    for r in &rows[..sent as usize] {
        let (p, c) = (num(r, "predicted_match_tokens"), num(r, "cached_tokens"));
        predicted += p;
        had += p.min(c);
        exact += usize::from(p == c);
    }
    let share = had as f64 / predicted.max(1) as f64;
    println!(
        "{sent} requests through the router: predicted {predicted} cached tokens, the engine had {had} of them ({:.2}%); {exact} of {sent} requests predicted exactly",
        100.0 * share
    );
    assert!(predicted > 0, "later turns must be predicted to hit");
    assert!(
        share >= 0.98,
        "only {:.2}% of predicted tokens were cached",
        100.0 * share
    );
    let repeat = &rows[sent as usize];
    assert_eq!(
        (
            num(repeat, "predicted_match_tokens"),
            num(repeat, "cached_tokens")
        ),
        (0, 0),
        "after the restart, stale residency predicted a hit: {repeat:?}"
    );
}
