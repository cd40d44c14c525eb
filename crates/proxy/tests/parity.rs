//! Token parity (`proxy::parity`): each known cause of a router whose exact keys differ from the
//! engine's blocks is planted in a mock replica, and the router refuses to start (or to admit the
//! replica), naming the replica, the probe and the first differing token. A fleet that agrees
//! starts and serves; a replica that cannot be probed is reported, not refused; the emulator
//! passes its own probes.

mod common;

use common::*;
use proxy::Router;

/// Starts an exact-residency router over `replicas` (block size `block_tokens`), returning the
/// refusal's message when it refuses.
async fn start_exact(replicas: &[&MockReplica], block_tokens: u32) -> Result<Router, String> {
    let mut cfg = router_config(replicas, "exact-residency");
    cfg.policy.tokens_per_block = block_tokens;
    cfg.model = Some("mock-model".into());
    Router::start(cfg).await.map_err(|e| e.to_string())
}

fn refusal(r: Result<Router, String>) -> String {
    match r {
        Ok(_) => panic!("the router started on a fleet whose tokens disagree"),
        Err(e) => e,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_that_agrees_starts_and_its_probes_stay_out_of_the_traffic() {
    let a = MockReplica::start(Script {
        metrics_block_size: Some(16),
        ..Script::default()
    })
    .await;
    let b = MockReplica::start(Script::default()).await;
    let router = start_exact(&[&a, &b], 16).await.expect("starts");
    // 3 probes × (tokenize + generation) + /metrics + … per replica, none counted as traffic.
    for m in [&a, &b] {
        assert!(
            m.state
                .probe_calls
                .load(std::sync::atomic::Ordering::SeqCst)
                >= 6
        );
        assert_eq!(m.state.count(), 0);
        assert_eq!(
            m.state
                .tokenize_calls
                .load(std::sync::atomic::Ordering::SeqCst),
            0
        );
    }
    let (_, text) = get(&format!("http://{}/metrics", router.admin_addr())).await;
    assert_eq!(
        metric(&text, "kvroute_router_token_parity_agreed_total"),
        Some(2.0)
    );
    assert_eq!(
        metric(&text, "kvroute_router_token_parity_unchecked_total"),
        Some(0.0)
    );
    let url = format!("http://{}", router.local_addr());
    let (status, _) = read_json(
        post(
            &url,
            "/v1/chat/completions",
            chat(&[("user", "hello there")]),
            &[],
        )
        .await,
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(a.state.count() + b.state.count(), 1);
    router.shutdown(std::time::Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_bos_is_caught_at_token_zero() {
    let a = MockReplica::start(Script {
        engine_bos: Some(1),
        ..Script::default()
    })
    .await;
    let e = refusal(start_exact(&[&a], 16).await);
    assert!(e.contains(&format!("replica 0 ({})", a.url)), "{e}");
    assert!(e.contains("probe `chat-one-turn`"), "{e}");
    // The mock's tokens are the prompt's bytes: 'T' (84) against the engine's BOS (1).
    assert!(
        e.contains("first differ at token 0: router 84 (\"T\") vs engine 1"),
        "{e}"
    );
    assert!(e.contains("--no-token-parity-check"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_block_size_is_caught_from_the_engines_metrics() {
    let a = MockReplica::start(Script {
        metrics_block_size: Some(32),
        ..Script::default()
    })
    .await;
    let e = refusal(start_exact(&[&a], 16).await);
    assert!(
        e.contains("caches in blocks of 32 tokens (vllm:cache_config_info on /metrics) but the router keys blocks of 16 tokens"),
        "{e}"
    );
    assert!(e.contains("--block-tokens 32"), "{e}");
    // With the engine's size, the same replica passes.
    let r = start_exact(&[&a], 32).await.expect("starts at 32");
    r.shutdown(std::time::Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_with_another_chat_template_is_caught_against_the_others() {
    let a = MockReplica::start(Script::default()).await;
    let b = MockReplica::start(Script {
        role_template: true,
        ..Script::default()
    })
    .await;
    let e = refusal(start_exact(&[&a, &b], 16).await);
    assert!(
        e.contains(&format!(
            "replica 1 ({}) tokenizes probe `chat-one-turn` unlike replica 0 ({})",
            b.url, a.url
        )),
        "{e}"
    );
    // 'T' of the content against 'u' of "user: ".
    assert!(e.contains("first differ at token 0"), "{e}");
    assert!(e.contains("one tokenizer and chat template"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_without_token_ids_is_checked_by_its_count() {
    let a = MockReplica::start(Script {
        return_token_ids: false,
        engine_bos: Some(1),
        ..Script::default()
    })
    .await;
    let e = refusal(start_exact(&[&a], 16).await);
    assert!(
        e.contains(
            "the router keys 76 tokens (/tokenize with its body) but the engine prefilled 77"
        ),
        "{e}"
    );
    let ok = MockReplica::start(Script {
        return_token_ids: false,
        ..Script::default()
    })
    .await;
    let r = start_exact(&[&ok], 16).await.expect("counts agree");
    r.shutdown(std::time::Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_replica_is_reported_not_refused_and_the_check_can_be_skipped() {
    let a = MockReplica::start(Script::default()).await;
    let mut down = MockReplica::start(Script::default()).await;
    down.kill().await;
    let router = start_exact(&[&a, &down], 16).await.expect("starts");
    let (_, text) = get(&format!("http://{}/metrics", router.admin_addr())).await;
    assert_eq!(
        metric(&text, "kvroute_router_token_parity_unchecked_total"),
        Some(1.0)
    );
    router.shutdown(std::time::Duration::from_secs(5)).await;

    // Off: a disagreeing replica is not probed at all.
    let bad = MockReplica::start(Script {
        engine_bos: Some(1),
        ..Script::default()
    })
    .await;
    let mut cfg = router_config(&[&bad], "exact-residency");
    cfg.token_parity_check = false;
    let r = Router::start(cfg).await.expect("starts unchecked");
    assert_eq!(
        bad.state
            .probe_calls
            .load(std::sync::atomic::Ordering::SeqCst),
        0
    );
    r.shutdown(std::time::Duration::from_secs(5)).await;
    // Other policies never probe.
    let r = start_router(router_config(&[&bad], "prefix-affinity")).await;
    assert_eq!(
        bad.state
            .probe_calls
            .load(std::sync::atomic::Ordering::SeqCst),
        0
    );
    r.shutdown(std::time::Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_refuses_a_replica_that_disagrees() {
    let a = MockReplica::start(Script::default()).await;
    let other_template = MockReplica::start(Script {
        role_template: true,
        ..Script::default()
    })
    .await;
    let good = MockReplica::start(Script::default()).await;
    let router = start_exact(&[&a], 16).await.expect("starts");
    let admin_url = format!("http://{}", router.admin_addr());
    let (status, text) = send(
        "POST",
        &format!("{admin_url}/admin/replicas"),
        &format!("{{\"url\":\"{}\"}}", other_template.url),
    )
    .await;
    assert_eq!(status, 422, "{text}");
    assert!(text.contains("unlike replica 0"), "{text}");
    let (_, list) = send("GET", &format!("{admin_url}/admin/replicas"), "").await;
    let list: serde_json::Value = serde_json::from_str(&list).unwrap();
    assert_eq!(
        list.as_array().unwrap().len(),
        1,
        "the refused replica is gone"
    );
    let (status, text) = send(
        "POST",
        &format!("{admin_url}/admin/replicas"),
        &format!("{{\"url\":\"{}\"}}", good.url),
    )
    .await;
    assert_eq!(status, 201, "{text}");
    router.shutdown(std::time::Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_emulator_passes_its_own_probes() {
    let cfg = engine::server::ServerConfig::default();
    let block = cfg.engine.block_size;
    let server = engine::server::start(cfg).await.expect("emulator");
    let url = format!("http://{}", server.addr());
    let mut rc = proxy::RouterConfig::new(
        vec![proxy::ReplicaSpec::new(url)],
        policies::PolicySpec::named("exact-residency"),
    );
    rc.policy.tokens_per_block = block;
    let router = Router::start(rc).await.expect("the emulator agrees");
    let (_, text) = get(&format!("http://{}/metrics", router.admin_addr())).await;
    assert_eq!(
        metric(&text, "kvroute_router_token_parity_agreed_total"),
        Some(1.0)
    );
    router.shutdown(std::time::Duration::from_secs(5)).await;
}
