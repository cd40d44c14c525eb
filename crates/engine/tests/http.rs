//! HTTP tests against an in-process replica over loopback, with a real HTTP/1.1 client.

mod common;

use common::*;
use http_body_util::BodyExt;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| (*x).to_owned()).collect()
}

#[tokio::test]
async fn completions_stream_shapes_and_cached_tokens_on_repeat() {
    let srv = start(config(20.0, 2048)).await;
    let prompt = prose(1, 300);
    let body = json!({"model": "kvroute/emulated-8b", "prompt": prompt, "max_tokens": 5,
                      "ignore_eos": true, "stream": true,
                      "stream_options": {"include_usage": true}})
    .to_string();
    let (st, text) = call(srv.addr(), "POST", "/v1/completions", &body).await;
    assert_eq!(st, 200);
    let events = sse_events(&text);
    assert_eq!(events.len(), 5 + 1 + 1, "5 tokens, usage, [DONE]");
    let mut id = None;
    for (i, e) in events[..5].iter().enumerate() {
        let v: Value = serde_json::from_str(e).expect("json");
        assert_eq!(
            keys(&v),
            s(&["choices", "created", "id", "model", "object", "usage"])
        );
        assert_eq!(v["object"], "text_completion");
        assert!(v["usage"].is_null());
        assert!(v["id"].as_str().expect("id").starts_with("cmpl-"));
        id.get_or_insert(v["id"].clone());
        assert_eq!(&v["id"], id.as_ref().expect("set"));
        let c = &v["choices"][0];
        assert_eq!(
            keys(c),
            s(&["finish_reason", "index", "logprobs", "stop_reason", "text"])
        );
        assert!(!c["text"].as_str().expect("text").is_empty());
        assert_eq!(
            c["finish_reason"],
            if i == 4 { json!("length") } else { Value::Null }
        );
    }
    let usage: Value = serde_json::from_str(&events[5]).expect("json");
    assert_eq!(usage["choices"], json!([]));
    let prompt_tokens = usage["usage"]["prompt_tokens"].as_u64().expect("n");
    assert_eq!(usage["usage"]["completion_tokens"], 5);
    assert_eq!(usage["usage"]["total_tokens"], prompt_tokens + 5);
    assert!(
        usage["usage"]["prompt_tokens_details"].is_null(),
        "unseen prompt: no cached tokens"
    );
    assert_eq!(events[6], "[DONE]");

    // Same prompt again: block-aligned hit capped at n − 1.
    let (_, text) = call(srv.addr(), "POST", "/v1/completions", &body).await;
    let events = sse_events(&text);
    let usage: Value = serde_json::from_str(&events[5]).expect("json");
    assert_eq!(
        usage["usage"]["prompt_tokens_details"]["cached_tokens"],
        (prompt_tokens - 1) / 16 * 16
    );
    srv.shutdown().await;
}

#[tokio::test]
async fn chat_stream_sends_role_after_prefill_then_content_then_usage() {
    let srv = start(config(1.0, 2048)).await;
    let body = json!({"model": "kvroute/emulated-8b",
                      "messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": prose(2, 50)}],
                      "max_tokens": 4, "ignore_eos": true, "stream": true,
                      "stream_options": {"include_usage": true}})
    .to_string();
    let t0 = Instant::now();
    let (st, mut resp) = send(srv.addr(), "POST", "/v1/chat/completions", &body).await;
    assert_eq!(st, 200);
    let first = resp
        .frame()
        .await
        .expect("frame")
        .expect("ok")
        .into_data()
        .expect("data");
    // The role chunk is not sent on arrival: it waits for frontend + prefill (≥ 38 ms modelled).
    assert!(
        t0.elapsed() >= Duration::from_millis(38),
        "role chunk after {:?}",
        t0.elapsed()
    );
    let mut text = String::from_utf8(first.to_vec()).expect("utf-8");
    text.push_str(
        std::str::from_utf8(&resp.collect().await.expect("body").to_bytes()).expect("utf-8"),
    );
    let events = sse_events(&text);
    assert_eq!(events.len(), 1 + 4 + 1 + 1);
    let role: Value = serde_json::from_str(&events[0]).expect("json");
    assert_eq!(
        keys(&role),
        s(&["choices", "created", "id", "model", "object"])
    );
    assert_eq!(role["object"], "chat.completion.chunk");
    assert!(role["id"].as_str().expect("id").starts_with("chatcmpl-"));
    assert_eq!(
        role["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    for (i, e) in events[1..5].iter().enumerate() {
        let v: Value = serde_json::from_str(e).expect("json");
        let c = &v["choices"][0];
        assert_eq!(keys(&c["delta"]), s(&["content"]));
        assert!(c["logprobs"].is_null());
        if i == 3 {
            assert_eq!(c["finish_reason"], "length");
        } else {
            assert!(c["finish_reason"].is_null());
        }
    }
    let usage: Value = serde_json::from_str(&events[5]).expect("json");
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 4);
    // Chat omits unset fields (vLLM serialises chat chunks with exclude_unset).
    assert!(usage["usage"].get("prompt_tokens_details").is_none());
    srv.shutdown().await;
}

#[tokio::test]
async fn non_stream_answers_and_usage_details_flag() {
    let mut cfg = config(20.0, 2048);
    cfg.enable_prompt_tokens_details = false;
    let srv = start(cfg).await;
    let body = json!({"prompt": prose(3, 200), "max_tokens": 3, "ignore_eos": true}).to_string();
    let (st, v) = call_json(srv.addr(), "POST", "/v1/completions", &body).await;
    assert_eq!(st, 200);
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    let text = v["choices"][0]["text"].as_str().expect("text").to_owned();
    // Repeat: cached, but the flag is off, so no details.
    let (_, v2) = call_json(srv.addr(), "POST", "/v1/completions", &body).await;
    assert!(v2["usage"]["prompt_tokens_details"].is_null());
    // Deterministic text for the same prompt.
    assert_eq!(v2["choices"][0]["text"], text);

    let chat =
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
                      "max_completion_tokens": 2, "ignore_eos": true})
        .to_string();
    let (st, v) = call_json(srv.addr(), "POST", "/v1/chat/completions", &chat).await;
    assert_eq!(st, 200);
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["usage"]["completion_tokens"], 2);
    srv.shutdown().await;
}

#[tokio::test]
async fn errors_have_vllm_bodies_and_statuses() {
    let srv = start(config(20.0, 2048)).await;
    let a = srv.addr();
    let cases = [
        ("/v1/completions", "{\"prompt\": ", 400),
        ("/v1/completions", "[1,2]", 400),
        ("/v1/completions", "{\"max_tokens\": 3}", 400),
        (
            "/v1/chat/completions",
            "{\"model\": \"kvroute/emulated-8b\"}",
            400,
        ),
        (
            "/v1/completions",
            "{\"prompt\": \"hi\", \"max_tokens\": -1}",
            400,
        ),
        (
            "/v1/completions",
            "{\"prompt\": \"hi\", \"max_tokens\": 0}",
            400,
        ),
        (
            "/v1/completions",
            "{\"prompt\": \"hi\", \"model\": \"nope\"}",
            404,
        ),
        (
            "/v1/chat/completions",
            "{\"messages\": [], \"model\": \"nope\"}",
            404,
        ),
        (
            "/v1/completions",
            "{\"prompt\": \"hi\", \"max_tokens\": 9000}",
            400,
        ),
        ("/v1/completions", "{\"prompt\": [1, 99999999]}", 400),
        ("/tokenize", "{}", 400),
    ];
    for (path, body, want) in cases {
        let (st, v) = call_json(a, "POST", path, body).await;
        assert_eq!(st, want, "{path} {body}");
        let e = &v["error"];
        assert_eq!(keys(e), s(&["code", "message", "param", "type"]), "{body}");
        assert_eq!(e["code"], want);
        assert!(!e["message"].as_str().expect("message").is_empty());
    }
    // A prompt over max_model_len.
    let long = "word ".repeat(9000);
    let (st, v) = call_json(
        a,
        "POST",
        "/v1/completions",
        &json!({"prompt": long, "max_tokens": 1}).to_string(),
    )
    .await;
    assert_eq!(st, 400);
    assert!(
        v["error"]["message"]
            .as_str()
            .expect("m")
            .contains("maximum context length is 8192")
    );
    assert_eq!(call(a, "GET", "/nope", "").await.0, 404);
    assert_eq!(call(a, "GET", "/v1/completions", "").await.0, 405);
    // The server survived all of it.
    assert_eq!(call(a, "GET", "/health", "").await, (200, String::new()));
    srv.shutdown().await;
}

#[tokio::test]
async fn disconnect_mid_stream_aborts_and_frees_blocks() {
    let srv = start(config(1.0, 2048)).await;
    let body =
        json!({"prompt": prose(4, 400), "max_tokens": 4000, "ignore_eos": true, "stream": true})
            .to_string();
    let (st, mut resp) = send(srv.addr(), "POST", "/v1/completions", &body).await;
    assert_eq!(st, 200);
    let _ = resp.frame().await.expect("frame").expect("ok");
    let m = srv.metrics();
    assert_eq!(m.running, 1);
    assert!(m.kv_usage > 0.0);
    drop(resp); // closes the connection: the next chunk write fails and drops the body
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = srv.metrics();
        if m.running == 0 && m.kv_usage == 0.0 {
            assert_eq!(m.aborted, 1);
            assert!(m.counters.generation_tokens < 4000);
            break;
        }
        assert!(Instant::now() < deadline, "request not aborted: {m:?}");
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The freed blocks kept their hashes: the prompt still hits.
    let (_, v) = call_json(
        srv.addr(),
        "POST",
        "/v1/completions",
        &json!({"prompt": prose(4, 400), "max_tokens": 1}).to_string(),
    )
    .await;
    assert!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .expect("cached")
            > 0
    );
    srv.shutdown().await;
}

#[tokio::test]
async fn tokenize_render_and_usage_agree_on_ids() {
    let mut cfg = config(20.0, 2048);
    cfg.engine.model.tokenize_ms = 26.0;
    let srv = start(cfg).await;
    let a = srv.addr();
    let text = prose(5, 40);
    let t0 = Instant::now();
    let (st, tok) = call_json(
        a,
        "POST",
        "/tokenize",
        &json!({"model": "kvroute/emulated-8b", "prompt": text, "add_special_tokens": true})
            .to_string(),
    )
    .await;
    assert_eq!(st, 200);
    // Modelled frontend cost: 26 ms / speed 20.
    assert!(t0.elapsed() >= Duration::from_micros(1300));
    assert_eq!(
        keys(&tok),
        s(&["count", "max_model_len", "token_strs", "tokens"])
    );
    assert_eq!(tok["tokens"], json!(engine::tokenizer::encode(&text, true)));
    let (_, r) = call_json(
        a,
        "POST",
        "/v1/completions/render",
        &json!({"prompt": text}).to_string(),
    )
    .await;
    assert_eq!(r[0]["token_ids"], tok["tokens"]);
    let msgs = json!([{"role": "user", "content": text}]);
    let (_, ct) = call_json(
        a,
        "POST",
        "/tokenize",
        &json!({"messages": msgs}).to_string(),
    )
    .await;
    let (_, cr) = call_json(
        a,
        "POST",
        "/v1/chat/completions/render",
        &json!({"messages": msgs}).to_string(),
    )
    .await;
    assert_eq!(ct["tokens"], cr["token_ids"]);
    let (_, v) = call_json(
        a,
        "POST",
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 1}).to_string(),
    )
    .await;
    assert_eq!(v["usage"]["prompt_tokens"], ct["count"]);
    srv.shutdown().await;
}

#[tokio::test]
async fn models_metrics_health_and_reset() {
    let srv = start(config(20.0, 512)).await;
    let a = srv.addr();
    let (st, m) = call_json(a, "GET", "/v1/models", "").await;
    assert_eq!(st, 200);
    assert_eq!(m["object"], "list");
    assert_eq!(
        keys(&m["data"][0]),
        s(&[
            "created",
            "id",
            "max_model_len",
            "object",
            "owned_by",
            "parent",
            "permission",
            "root"
        ])
    );
    assert_eq!(m["data"][0]["owned_by"], "vllm");
    let body = json!({"prompt": prose(6, 100), "max_tokens": 2}).to_string();
    call(a, "POST", "/v1/completions", &body).await;
    let (_, text) = call(a, "GET", "/metrics", "").await;
    assert!(text.contains("vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"512\"} 1.0"));
    for series in [
        "vllm:num_requests_running{",
        "vllm:num_requests_waiting{",
        "vllm:kv_cache_usage_perc{",
        "vllm:prefix_cache_queries_total{",
        "vllm:prefix_cache_hits_total{",
        "vllm:num_preemptions_total{",
        "vllm:time_to_first_token_seconds_bucket{",
        "vllm:inter_token_latency_seconds_bucket{",
        "vllm:e2e_request_latency_seconds_count{",
        "vllm:request_queue_time_seconds_sum{",
        "kvroute_engine_lateness_seconds_bucket{",
    ] {
        assert!(text.contains(series), "missing {series}");
    }
    assert_eq!(call(a, "POST", "/reset_prefix_cache", "").await.0, 200);
    let (_, v) = call_json(a, "POST", "/v1/completions", &body).await;
    assert!(
        v["usage"]["prompt_tokens_details"].is_null(),
        "cache was reset"
    );
    srv.shutdown().await;
}

#[tokio::test]
async fn disconnect_of_a_non_stream_request_aborts_it() {
    let srv = start(config(1.0, 2048)).await;
    let body = json!({"prompt": prose(7, 100), "max_tokens": 4000, "ignore_eos": true}).to_string();
    let addr = srv.addr();
    let client = tokio::spawn(async move { call(addr, "POST", "/v1/completions", &body).await });
    let deadline = Instant::now() + Duration::from_secs(10);
    while srv.metrics().running == 0 {
        assert!(Instant::now() < deadline, "request never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    client.abort(); // drops the connection with the request in flight
    let _ = client.await;
    loop {
        let m = srv.metrics();
        if m.running == 0 && m.kv_usage == 0.0 {
            assert_eq!(m.aborted, 1);
            break;
        }
        assert!(Instant::now() < deadline, "request not aborted: {m:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    srv.shutdown().await;
}

#[tokio::test]
async fn llama_slots_serve_token_exact_hits_and_keep_an_aborted_prefix() {
    let mut cfg = config(20.0, 2048);
    cfg.engine.cache_model = engine::CacheModel::LLAMA_FLEET;
    cfg.engine.model = engine::StepModel {
        speed: 20.0,
        ..engine::StepModel::llama_tiny()
    };
    let srv = start(cfg).await;
    let body =
        |p: &str, n: u32| json!({"prompt": p, "max_tokens": n, "ignore_eos": true}).to_string();
    let p = prose(5, 300);
    let (_, v) = call_json(srv.addr(), "POST", "/v1/completions", &body(&p, 3)).await;
    let n = v["usage"]["prompt_tokens"].as_u64().expect("n");
    assert!(v["usage"]["prompt_tokens_details"].is_null(), "unseen");
    let (_, v) = call_json(srv.addr(), "POST", "/v1/completions", &body(&p, 3)).await;
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"],
        n - 1,
        "the slot's common prefix, not whole blocks"
    );
    // Idle slots still hold their sequences: the KV usage says so.
    assert!(srv.metrics().kv_usage > 0.0);

    // A client that disconnects mid-stream frees its slot, which keeps what was computed.
    let q = prose(6, 400);
    let stream =
        json!({"prompt": q, "max_tokens": 4000, "ignore_eos": true, "stream": true}).to_string();
    let (st, mut resp) = send(srv.addr(), "POST", "/v1/completions", &stream).await;
    assert_eq!(st, 200);
    let _ = resp.frame().await.expect("frame").expect("ok");
    drop(resp);
    let deadline = Instant::now() + Duration::from_secs(10);
    while srv.metrics().running != 0 {
        assert!(Instant::now() < deadline, "request not aborted");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(srv.metrics().aborted, 1);
    let (_, v) = call_json(srv.addr(), "POST", "/v1/completions", &body(&q, 1)).await;
    let nq = v["usage"]["prompt_tokens"].as_u64().expect("n");
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], nq - 1);
    srv.shutdown().await;
}
