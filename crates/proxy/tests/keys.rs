//! API keys and per-key limits end to end (`--api-keys`, crates/proxy/README.md "Keys and
//! limits"): 401/400 refusals with OpenAI's error body and a row, a streamed 200 with the right
//! key, the request limit under 128 concurrent requests with the limits' clock frozen, and the
//! token limit after a response's usage drained the bucket. Time is a `ManualClock`: no sleeps.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use proxy::keys::{ApiKeys, ManualClock, hash_line};

const S: u64 = 1_000_000_000;

/// A router over one default mock replica with `keys_file` as its key file and rows on; the
/// limits timed by `clock`.
async fn keyed_router(
    keys_file: &str,
    clock: &ManualClock,
) -> (MockReplica, proxy::Router, test_support::TempDir) {
    let replica = MockReplica::start(Script::default()).await;
    let dir = temp_dir("keys");
    let mut cfg = router_config(&[&replica], "round-robin");
    cfg.rows = Some(dir.path().join("router.csv"));
    let keys = ApiKeys::parse(keys_file, "keys.txt")
        .unwrap()
        .with_manual_clock(clock);
    cfg.api_keys = Some(Arc::new(keys));
    let router = start_router(cfg).await;
    (replica, router, dir)
}

async fn metrics(admin_url: &str) -> String {
    let (status, text) = get(&format!("{admin_url}/metrics")).await;
    assert_eq!(status, 200);
    text
}

fn header<'h>(h: &'h http::HeaderMap, name: &str) -> &'h str {
    h.get(name)
        .unwrap_or_else(|| panic!("no {name} in {h:?}"))
        .to_str()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_required_and_refusals_get_openai_bodies_and_rows() {
    let clock = ManualClock::new();
    let file = format!("# test keys\nalice {}\n", hash_line("sk-alice"));
    let (replica, router, dir) = keyed_router(&file, &clock).await;
    let url = format!("http://{}", router.local_addr());
    let admin_url = format!("http://{}", router.admin_addr());

    // No key: 401 with OpenAI's body.
    let s = post(&url, "/v1/completions", completion("a"), &[]).await;
    assert_eq!(
        header(&s.headers, "www-authenticate"),
        "Bearer realm=\"kvroute\""
    );
    let (status, body) = read_json(s).await;
    assert_eq!(status, 401);
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert_eq!(body["error"]["code"], "invalid_api_key");
    assert_eq!(body["error"]["param"], serde_json::Value::Null);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("missing API key")
    );
    assert_eq!(body.as_object().unwrap().len(), 1);
    assert_eq!(body["error"].as_object().unwrap().len(), 4);

    // A wrong key, on chat too.
    let wrong = [("authorization", "Bearer sk-mallory")];
    let (status, body) = read_json(
        post(
            &url,
            "/v1/chat/completions",
            chat(&[("user", "hi")]),
            &wrong,
        )
        .await,
    )
    .await;
    assert_eq!(status, 401);
    assert_eq!(body["error"]["message"], "invalid API key");

    // The right key: streamed through.
    let right = [("Authorization", "Bearer sk-alice")];
    let r = post(&url, "/v1/completions", completion("b"), &right)
        .await
        .finish()
        .await;
    assert_eq!(r.status, 200);
    assert!(r.done);
    assert_eq!(r.events.len(), 5, "4 content events + usage");
    assert!(
        r.headers.get("x-ratelimit-limit-requests").is_none(),
        "no limits, no rate-limit headers"
    );

    // Two Authorization headers (names in different cases: one name to hyper), whatever they
    // hold: 400, never tried one by one.
    let body = completion("c").to_string();
    let mut conn = raw_post(
        router.local_addr(),
        "/v1/completions",
        body.len(),
        body.as_bytes(),
        &[
            ("Authorization", "Bearer sk-mallory"),
            ("AUTHORIZATION", "Bearer sk-alice"),
        ],
    )
    .await;
    let answer = read_to_eof(&mut conn).await;
    // Hanging up ends the router's lingering drain of the connection.
    drop(conn);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("several Authorization headers"), "{answer}");

    // An oversized header: 400; a non-Bearer one: 401.
    let big = format!("Bearer {}", "k".repeat(2000));
    let (status, _) = read_json(
        post(
            &url,
            "/v1/completions",
            completion("d"),
            &[("authorization", &big)],
        )
        .await,
    )
    .await;
    assert_eq!(status, 400);
    let basic = [("authorization", "Basic c2stYWxpY2U=")];
    let (status, _) = read_json(post(&url, "/v1/completions", completion("e"), &basic).await).await;
    assert_eq!(status, 401);

    // `/v1/models` needs the key too; `/health` stays open.
    let (status, _, _) = send_with("GET", &format!("{url}/v1/models"), "", &[]).await;
    assert_eq!(status, 401);
    let (status, _, _) = send_with("GET", &format!("{url}/v1/models"), "", &right).await;
    assert_eq!(status, 200);
    assert_eq!(get(&format!("{url}/health")).await.0, 200);

    // Only the admitted request reached the replica.
    assert_eq!(replica.state.count(), 1);
    let m = metrics(&admin_url).await;
    for (series, want) in [
        ("kvroute_router_key_requests_total{key=\"alice\"}", 2.0),
        ("kvroute_router_key_requests_total{key=\"unknown\"}", 6.0),
        (
            "kvroute_router_key_rejected_total{key=\"unknown\",reason=\"auth\"}",
            6.0,
        ),
        (
            "kvroute_router_key_rejected_total{key=\"alice\",reason=\"requests\"}",
            0.0,
        ),
        ("kvroute_router_bad_requests_total", 0.0),
    ] {
        assert_eq!(metric(&m, series), Some(want), "{series}");
    }
    router.shutdown(Duration::from_secs(5)).await;

    // Every LLM request has its row: five `auth:` refusals and the one served.
    let rows = read_rows(&dir.path().join("router.csv"));
    assert_eq!(rows.len(), 6, "{rows:?}");
    let refused: Vec<_> = rows
        .iter()
        .filter(|r| r["error"].starts_with("auth: "))
        .collect();
    assert_eq!(refused.len(), 5, "{rows:?}");
    let mut statuses: Vec<&str> = refused
        .iter()
        .map(|r| r["upstream_status"].as_str())
        .collect();
    statuses.sort_unstable();
    assert_eq!(statuses, ["400", "400", "401", "401", "401"]);
    assert!(
        rows.iter().all(|r| !r["error"].contains("sk-")),
        "a key in a row"
    );
    let served: Vec<_> = rows.iter().filter(|r| r["error"].is_empty()).collect();
    assert_eq!(served.len(), 1);
    assert_eq!(served[0]["upstream_status"], "200");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_limit_holds_under_concurrency() {
    // The limits' clock stays at 0: the bucket never refills, so exactly `burst` pass.
    let clock = ManualClock::new();
    let file = format!("alice {} rps=10 burst=10\n", hash_line("sk-alice"));
    let (replica, router, dir) = keyed_router(&file, &clock).await;
    let url = format!("http://{}", router.local_addr());
    let admin_url = format!("http://{}", router.admin_addr());
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..64 {
        let url = url.clone();
        tasks.spawn(async move {
            let mut out = Vec::new();
            for i in 0..2 {
                let auth = [("authorization", "Bearer sk-alice")];
                let s = post(
                    &url,
                    "/v1/completions",
                    completion(&format!("{t}-{i}")),
                    &auth,
                )
                .await;
                if s.status == 200 {
                    let r = s.finish().await;
                    assert!(r.done);
                    out.push((200, r.headers, serde_json::Value::Null));
                } else {
                    let headers = s.headers.clone();
                    let (status, body) = read_json(s).await;
                    out.push((status, headers, body));
                }
            }
            out
        });
    }
    let mut answers = Vec::new();
    while let Some(r) = tasks.join_next().await {
        answers.extend(r.unwrap());
    }
    assert_eq!(answers.len(), 128);
    let ok: Vec<_> = answers.iter().filter(|a| a.0 == 200).collect();
    let limited: Vec<_> = answers.iter().filter(|a| a.0 == 429).collect();
    assert_eq!(ok.len(), 10, "admitted");
    assert_eq!(limited.len(), 118, "refused");
    assert_eq!(replica.state.count(), 10);
    // The admitted ones counted the bucket down, as OpenAI's headers say.
    let mut remaining: Vec<u32> = ok
        .iter()
        .map(|a| {
            header(&a.1, "x-ratelimit-remaining-requests")
                .parse()
                .unwrap()
        })
        .collect();
    remaining.sort_unstable();
    assert_eq!(remaining, (0..10).collect::<Vec<_>>());
    for (_, h, body) in &limited {
        assert_eq!(header(h, "retry-after"), "1");
        assert_eq!(header(h, "retry-after-ms"), "100");
        assert_eq!(header(h, "x-ratelimit-limit-requests"), "10");
        assert_eq!(header(h, "x-ratelimit-remaining-requests"), "0");
        assert_eq!(header(h, "x-ratelimit-reset-requests"), "1s");
        assert_eq!(body["error"]["type"], "requests");
        assert_eq!(body["error"]["code"], "rate_limit_exceeded");
    }
    let m = metrics(&admin_url).await;
    assert_eq!(
        metric(&m, "kvroute_router_key_requests_total{key=\"alice\"}"),
        Some(128.0)
    );
    assert_eq!(
        metric(
            &m,
            "kvroute_router_key_rejected_total{key=\"alice\",reason=\"requests\"}"
        ),
        Some(118.0)
    );
    assert_eq!(metric(&m, "kvroute_router_overloaded_total"), Some(0.0));
    // A tenth of a second later, one more.
    clock.advance_ns(S / 10);
    let auth = [("authorization", "Bearer sk-alice")];
    let r = post(&url, "/v1/completions", completion("later"), &auth)
        .await
        .finish()
        .await;
    assert_eq!(r.status, 200);
    router.shutdown(Duration::from_secs(5)).await;
    let rows = read_rows(&dir.path().join("router.csv"));
    assert_eq!(rows.len(), 129);
    let limited_rows = rows
        .iter()
        .filter(|r| r["error"].starts_with("rate_limit: ") && r["upstream_status"] == "429")
        .count();
    assert_eq!(limited_rows, 118);
    assert!(rows.iter().any(|r| r["error"].contains("key `alice`")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_limit_refuses_once_usage_drained_the_bucket() {
    let clock = ManualClock::new();
    let file = format!("alice {} tokens_per_min=100\n", hash_line("sk-alice"));
    let (_replica, router, dir) = keyed_router(&file, &clock).await;
    let url = format!("http://{}", router.local_addr());
    let admin_url = format!("http://{}", router.admin_addr());
    let auth = [("authorization", "Bearer sk-alice")];
    // The mock reports the body's length as prompt_tokens (well over 100) and 4 completion
    // tokens: the bucket is positive at admission, negative once the usage is charged.
    let prompt = "p".repeat(200);
    let r = post(&url, "/v1/completions", completion(&prompt), &auth)
        .await
        .finish()
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(header(&r.headers, "x-ratelimit-limit-tokens"), "100");
    assert_eq!(header(&r.headers, "x-ratelimit-remaining-tokens"), "100");
    let used = completion(&prompt).to_string().len() as u64 + 4;
    // The charge lands when the router sees the upstream's end of body, which may come just
    // after the client read `[DONE]`.
    eventually("the usage is charged", WAIT, || {
        let admin_url = admin_url.clone();
        async move {
            metric(
                &metrics(&admin_url).await,
                "kvroute_router_key_tokens_total{key=\"alice\"}",
            ) == Some(used as f64)
        }
    })
    .await;
    let s = post(&url, "/v1/completions", completion("next"), &auth).await;
    let headers = s.headers.clone();
    let (status, body) = read_json(s).await;
    assert_eq!(status, 429);
    assert_eq!(body["error"]["type"], "tokens");
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");
    // In debt by used − 100 tokens at 100 a minute: positive again after 0.6 s per token.
    let debt_s = (used - 100) as f64 * 0.6;
    let retry: u64 = header(&headers, "retry-after").parse().unwrap();
    assert_eq!(retry, (debt_s.floor() as u64) + 1, "debt {debt_s} s");
    assert_eq!(header(&headers, "x-ratelimit-remaining-tokens"), "0");
    assert_eq!(header(&headers, "x-ratelimit-limit-tokens"), "100");
    assert!(header(&headers, "x-ratelimit-reset-tokens").ends_with('s'));
    // Not yet…
    clock.advance_ns((retry - 1) * S);
    let (status, _) = read_json(post(&url, "/v1/completions", completion("x"), &auth).await).await;
    assert_eq!(status, 429);
    // …and then.
    clock.advance_ns(S);
    let r = post(&url, "/v1/completions", completion("y"), &auth)
        .await
        .finish()
        .await;
    assert_eq!(r.status, 200);
    let m = metrics(&admin_url).await;
    assert_eq!(
        metric(
            &m,
            "kvroute_router_key_rejected_total{key=\"alice\",reason=\"tokens\"}"
        ),
        Some(2.0)
    );
    router.shutdown(Duration::from_secs(5)).await;
    let rows = read_rows(&dir.path().join("router.csv"));
    let limited: Vec<_> = rows
        .iter()
        .filter(|r| r["error"].starts_with("rate_limit: "))
        .collect();
    assert_eq!(limited.len(), 2);
    assert!(
        limited[0]["error"].contains("tokens per minute (limit 100)"),
        "{}",
        limited[0]["error"]
    );
}
