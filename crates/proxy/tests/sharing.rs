//! Decision sharing between routers (`proxy::sharing`): two in-process routers over the same
//! scripted replicas, one publishing to the other; a hand-made PUB for the gap rule.

mod common;

use std::time::Duration;

use common::*;
use proxy::Router;
use proxy::sharing::{TOPIC, encode_body};

/// A `kvroute_shared_decisions_*` counter of the router whose admin listener is `admin_url`.
async fn shared_metric(admin_url: &str, suffix: &str) -> f64 {
    let (_, text) = get(&format!("{admin_url}/metrics")).await;
    metric(&text, &format!("kvroute_shared_decisions_{suffix}"))
        .unwrap_or_else(|| panic!("kvroute_shared_decisions_{suffix} missing from /metrics"))
}

/// Waits until the counter reaches `at_least`.
async fn wait_metric(admin_url: &str, suffix: &str, at_least: f64) {
    eventually(
        &format!("kvroute_shared_decisions_{suffix} ≥ {at_least}"),
        WAIT,
        || {
            let admin_url = admin_url.to_string();
            async move { shared_metric(&admin_url, suffix).await >= at_least }
        },
    )
    .await;
}

fn admin(router: &Router) -> String {
    format!("http://{}", router.admin_addr())
}

/// Makes sure `receiver`'s subscription to `sender` is live before the test's real traffic
/// (PUB drops what it sends before the subscription reaches it): waits for the connect, then
/// sends probe requests through `sender` until `receiver` has received one. The probe is a
/// completion (rendered without the chat framing), so its keys share no prefix with a chat.
async fn wait_share_live(sender: &Router, receiver: &Router) {
    let receiver_admin = admin(receiver);
    wait_metric(&receiver_admin, "peers_connected", 1.0).await;
    let url = format!("http://{}", sender.local_addr());
    let probe = "probe: decision sharing warm-up text, long enough for one 64-byte key block.";
    eventually("a shared probe decision received", WAIT, || {
        let (url, receiver_admin) = (url.clone(), receiver_admin.clone());
        async move {
            let r = post(&url, "/v1/completions", completion(probe), &[])
                .await
                .finish()
                .await;
            assert_eq!(r.status, 200);
            shared_metric(&receiver_admin, "received_total").await >= 1.0
        }
    })
    .await;
}

/// Router A routes turn 1 of a conversation; router B (its replicas listed in another order,
/// so its ids differ from A's) routes turn 2. Returns B's row for turn 2, A's chosen replica's
/// URL and B's replica URLs in B's order.
async fn turn_two_through_another_router(
    share: bool,
) -> (
    std::collections::HashMap<String, String>,
    String,
    Vec<String>,
) {
    let reps = [
        MockReplica::start(Script::default()).await,
        MockReplica::start(Script::default()).await,
        MockReplica::start(Script::default()).await,
    ];
    let dir = temp_dir(if share { "share-on" } else { "share-off" });
    let mut cfg_a = router_config(&[&reps[0], &reps[1], &reps[2]], "prefix-affinity");
    cfg_a.model = Some("mock-model".into());
    cfg_a.router_id = Some("r0".into());
    cfg_a.share_decisions_bind = Some("tcp://127.0.0.1:0".into());
    let a = start_router(cfg_a).await;
    let a_endpoint = a.share_endpoint().expect("A publishes").to_string();
    assert!(a_endpoint.starts_with("tcp://127.0.0.1:") && !a_endpoint.ends_with(":0"));

    let mut cfg_b = router_config(&[&reps[2], &reps[0], &reps[1]], "prefix-affinity");
    cfg_b.model = Some("mock-model".into());
    cfg_b.router_id = Some("r1".into());
    cfg_b.rows = Some(dir.path().join("router.csv"));
    if share {
        cfg_b.share_decisions_peers = vec![a_endpoint];
    }
    let b = start_router(cfg_b).await;
    assert_eq!(b.router_id(), "r1");
    let b_urls: Vec<String> = b
        .shared()
        .replicas()
        .iter()
        .map(|r| r.url.clone())
        .collect();
    if share {
        wait_share_live(&a, &b).await;
    }

    let system = "You are a careful assistant. Answer briefly and cite your sources. ".repeat(4);
    let mut convo = vec![("system", system.as_str()), ("user", "first question")];
    let applied_before = shared_metric(&admin(&b), "applied_total").await;
    let first = post(
        &format!("http://{}", a.local_addr()),
        "/v1/chat/completions",
        chat(&convo),
        &[],
    )
    .await
    .finish()
    .await;
    assert_eq!(first.status, 200);
    let home_url = a
        .shared()
        .replica(first.replica())
        .expect("A's replica")
        .url
        .clone();
    if share {
        wait_metric(&admin(&b), "applied_total", applied_before + 1.0).await;
    }
    convo.push(("assistant", "an answer"));
    convo.push(("user", "a follow-up question"));
    let second = post(
        &format!("http://{}", b.local_addr()),
        "/v1/chat/completions",
        chat(&convo),
        &[],
    )
    .await
    .finish()
    .await;
    assert_eq!(second.status, 200);

    let a_published = shared_metric(&admin(&a), "published_total").await;
    assert!(a_published >= 1.0, "A publishes its decisions");
    assert_eq!(shared_metric(&admin(&a), "dropped_total").await, 0.0);
    if share {
        assert_eq!(
            shared_metric(&admin(&b), "unknown_replica_total").await,
            0.0
        );
        assert_eq!(shared_metric(&admin(&b), "decode_errors_total").await, 0.0);
        assert!(shared_metric(&admin(&b), "received_bytes_total").await > 0.0);
    } else {
        assert_eq!(shared_metric(&admin(&b), "received_total").await, 0.0);
    }
    // B publishes nothing: it has no bind.
    assert_eq!(shared_metric(&admin(&b), "published_total").await, 0.0);
    a.shutdown(Duration::from_secs(5)).await;
    b.shutdown(Duration::from_secs(5)).await;
    let rows = read_rows(&dir.path().join("router.csv"));
    assert_eq!(rows.len(), 1, "B routed only turn 2");
    (rows[0].clone(), home_url, b_urls)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_decision_turns_the_next_turn_into_a_match() {
    let (row, home_url, b_urls) = turn_two_through_another_router(true).await;
    assert_eq!(row["branch"], "match", "{row:?}");
    let chosen: usize = row["replica"].parse().unwrap();
    assert_eq!(b_urls[chosen], home_url, "B follows A's replica, by URL");
    assert!(
        row["predicted_match_tokens"].parse::<u32>().unwrap() > 0,
        "{row:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_sharing_the_other_router_misses() {
    let (row, _, _) = turn_two_through_another_router(false).await;
    assert_eq!(row["branch"], "miss", "{row:?}");
    assert_eq!(row["predicted_match_tokens"], "0");
}

/// A hand-made decision publisher.
struct HandPub {
    sock: zeromq::PubSocket,
    endpoint: String,
}

impl HandPub {
    async fn bind() -> HandPub {
        use zeromq::Socket;
        let mut sock = zeromq::PubSocket::new();
        let endpoint = sock.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        HandPub { sock, endpoint }
    }

    async fn send(&mut self, frames: Vec<bytes::Bytes>) {
        use zeromq::SocketSend;
        self.sock
            .send(zeromq::ZmqMessage::try_from(frames).unwrap())
            .await
            .unwrap();
    }

    async fn decision(&mut self, seq: u64, body: Vec<u8>) {
        self.send(proxy::sharing::frames(seq, body)).await;
    }
}

/// Two scripted replicas and a router (`policy`, `--share-loads` when `share_loads`) subscribed
/// to a hand-made publisher, its subscription connected. Returns the replicas, the publisher,
/// the router and its admin URL.
async fn router_on_hand_pub(
    policy: &str,
    share_loads: bool,
) -> (MockReplica, MockReplica, HandPub, Router, String) {
    let a = MockReplica::start(Script::default()).await;
    let b = MockReplica::start(Script::default()).await;
    let publisher = HandPub::bind().await;
    let mut cfg = router_config(&[&a, &b], policy);
    cfg.share_decisions_peers = vec![publisher.endpoint.clone()];
    cfg.share_loads = share_loads;
    let router = start_router(cfg).await;
    let admin_url = admin(&router);
    assert_eq!(shared_metric(&admin_url, "peers").await, 1.0);
    wait_metric(&admin_url, "peers_connected", 1.0).await;
    (a, b, publisher, router, admin_url)
}

/// Sends `frames` until the router's `series` counter shows one received (PUB drops what it
/// sends before the subscription is live); each repeat must be harmless to the test.
async fn send_until_received(
    publisher: &mut HandPub,
    frames: Vec<bytes::Bytes>,
    admin_url: &str,
    series: &str,
) {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        publisher.send(frames.clone()).await;
        let (_, text) = get(&format!("{admin_url}/metrics")).await;
        if metric(&text, series).unwrap_or(0.0) >= 1.0 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "subscription not live within {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_gaps_are_counted_and_bad_messages_ignored() {
    let (_a, b, mut publisher, router, admin_url) =
        router_on_hand_pub("prefix-affinity", false).await;
    let good = |keys: &[u64]| encode_body("hand", 1, &format!("{}/", b.url), keys);
    // Probe with sequence 1 until the subscription is live: a repeated 1 is a restarted peer
    // whose stream starts at 1, so the repeats count no gap.
    send_until_received(
        &mut publisher,
        proxy::sharing::frames(1, good(&[1, 2, 3])),
        &admin_url,
        "kvroute_shared_decisions_received_total",
    )
    .await;
    let received = shared_metric(&admin_url, "received_total").await;
    let applied = shared_metric(&admin_url, "applied_total").await;
    assert_eq!(
        applied, received,
        "every probe applied (URL with a trailing /)"
    );
    assert_eq!(shared_metric(&admin_url, "gaps_total").await, 0.0);

    // 1 then 3: one gap, one decision missed.
    publisher.decision(3, good(&[4, 5])).await;
    wait_metric(&admin_url, "received_total", received + 1.0).await;
    assert_eq!(shared_metric(&admin_url, "gaps_total").await, 1.0);
    assert_eq!(shared_metric(&admin_url, "missed_total").await, 1.0);
    assert_eq!(
        shared_metric(&admin_url, "applied_total").await,
        applied + 1.0
    );

    // A malformed body, a message without its sequence frame, an unknown replica: counted,
    // not applied, and the subscriber goes on.
    publisher.decision(4, b"\x94not msgpack".to_vec()).await;
    publisher
        .send(vec![
            bytes::Bytes::from_static(TOPIC.as_bytes()),
            bytes::Bytes::from_static(b"body only"),
        ])
        .await;
    publisher
        .decision(5, encode_body("hand", 1, "http://127.0.0.1:1", &[6]))
        .await;
    publisher.decision(6, good(&[7, 8])).await;
    wait_metric(&admin_url, "received_total", received + 5.0).await;
    assert_eq!(shared_metric(&admin_url, "decode_errors_total").await, 2.0);
    assert_eq!(
        shared_metric(&admin_url, "unknown_replica_total").await,
        1.0
    );
    assert_eq!(
        shared_metric(&admin_url, "applied_total").await,
        applied + 2.0
    );
    assert_eq!(
        shared_metric(&admin_url, "gaps_total").await,
        1.0,
        "4..6 in order"
    );

    // A restarted peer (back to 1) resets the tracking without a gap.
    publisher.decision(1, good(&[9])).await;
    publisher.decision(2, good(&[10])).await;
    wait_metric(&admin_url, "received_total", received + 7.0).await;
    assert_eq!(shared_metric(&admin_url, "gaps_total").await, 1.0);
    assert_eq!(shared_metric(&admin_url, "missed_total").await, 1.0);
    router.shutdown(Duration::from_secs(5)).await;
}

/// A router's view of its peers' in-flight requests (`kvroute_router_peer_outstanding`), by
/// replica URL.
fn peer_outstanding_by_url(router: &Router) -> std::collections::HashMap<String, u32> {
    router
        .shared()
        .replicas()
        .iter()
        .map(|r| {
            (
                r.url.clone(),
                r.peer_outstanding
                    .load(std::sync::atomic::Ordering::Relaxed),
            )
        })
        .collect()
}

/// The replica (by URL) of an in-flight stream through `router`.
fn stream_replica(router: &Router, s: &SseStream) -> String {
    router.shared().replica(s.replica()).unwrap().url.clone()
}

/// Router A (session-affinity) holds 3 streams of one session on one replica X; router B
/// (least-outstanding, its replicas listed in the other order) then takes 2 streams. Returns
/// how many of B's went to X and to the other replica, and X's URL.
async fn least_loaded_through_another_router(share_loads: bool) -> (usize, usize) {
    let held = || Script {
        hold: true,
        ..Script::default()
    };
    let reps = [
        MockReplica::start(held()).await,
        MockReplica::start(held()).await,
    ];
    let mut cfg_a = router_config(&[&reps[0], &reps[1]], "session-affinity");
    cfg_a.router_id = Some("r0".into());
    cfg_a.share_decisions_bind = Some("tcp://127.0.0.1:0".into());
    cfg_a.share_loads = share_loads;
    let a = start_router(cfg_a).await;
    let mut cfg_b = router_config(&[&reps[1], &reps[0]], "least-outstanding");
    cfg_b.router_id = Some("r1".into());
    cfg_b.share_decisions_peers = vec![a.share_endpoint().unwrap().to_string()];
    cfg_b.share_loads = share_loads;
    let b = start_router(cfg_b).await;
    let b_admin = admin(&b);
    wait_metric(&b_admin, "peers_connected", 1.0).await;
    if share_loads {
        // A's heartbeat (every 0.5 s) reaches B once the subscription is live.
        eventually("a shared load view received", WAIT, || {
            let b_admin = b_admin.clone();
            async move {
                let (_, text) = get(&format!("{b_admin}/metrics")).await;
                metric(&text, "kvroute_shared_loads_received_total").unwrap_or(0.0) >= 1.0
            }
        })
        .await;
    }
    let a_url = format!("http://{}", a.local_addr());
    let mut a_streams = Vec::new();
    for _ in 0..3 {
        let mut s = post(
            &a_url,
            "/v1/completions",
            completion("hold me"),
            &[("x-session-id", "one-session")],
        )
        .await;
        assert_eq!(s.status, 200);
        s.next_event().await.expect("first event");
        a_streams.push(s);
    }
    let x = stream_replica(&a, &a_streams[0]);
    assert!(a_streams.iter().all(|s| stream_replica(&a, s) == x));
    if share_loads {
        eventually("the peer's outstanding 3", WAIT, || {
            let seen = peer_outstanding_by_url(&b).get(&x).copied();
            async move { seen == Some(3) }
        })
        .await;
    } else {
        assert!(peer_outstanding_by_url(&b).values().all(|n| *n == 0));
    }
    let b_url = format!("http://{}", b.local_addr());
    let mut b_streams = Vec::new();
    for _ in 0..2 {
        let mut s = post(&b_url, "/v1/completions", completion("and me"), &[]).await;
        assert_eq!(s.status, 200);
        s.next_event().await.expect("first event");
        b_streams.push(s);
    }
    let on_x = b_streams
        .iter()
        .filter(|s| stream_replica(&b, s) == x)
        .count();
    for r in &reps {
        r.state.release(5);
    }
    for s in a_streams.into_iter().chain(b_streams) {
        assert!(s.finish().await.done);
    }
    if share_loads {
        // A publishes the change: its streams are done, so B's view of X empties.
        eventually("the peer's outstanding 0", WAIT, || {
            let seen = peer_outstanding_by_url(&b).get(&x).copied();
            async move { seen == Some(0) }
        })
        .await;
        let (_, text) = get(&format!("{}/metrics", admin(&a))).await;
        assert!(metric(&text, "kvroute_shared_loads_published_total").unwrap() >= 2.0);
    }
    a.shutdown(Duration::from_secs(5)).await;
    b.shutdown(Duration::from_secs(5)).await;
    (on_x, 2 - on_x)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_in_flight_requests_steer_the_least_loaded_choice() {
    assert_eq!(
        least_loaded_through_another_router(true).await,
        (0, 2),
        "B sees A's 3 streams on X and sends both of its own to the other replica"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_shared_loads_the_other_router_splits_its_streams() {
    assert_eq!(
        least_loaded_through_another_router(false).await,
        (1, 1),
        "B sees only its own streams: one on each replica"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peers_load_view_expires_and_bad_entries_are_counted() {
    use proxy::sharing::{LOADS_TOPIC, encode_loads_body, topic_frames};
    let (a, b, mut publisher, router, admin_url) =
        router_on_hand_pub("least-outstanding", true).await;
    let loads = |view: &[(&str, u32)]| {
        let view: Vec<(String, u32)> = view.iter().map(|(u, n)| (u.to_string(), *n)).collect();
        topic_frames(LOADS_TOPIC, 1, encode_loads_body("hand", 1, &view))
    };
    let b_url = format!("{}/", b.url);
    let loads_metric = |suffix: &'static str| {
        let admin_url = admin_url.clone();
        async move {
            let (_, text) = get(&format!("{admin_url}/metrics")).await;
            metric(&text, &format!("kvroute_shared_loads_{suffix}")).unwrap()
        }
    };
    // Until the subscription is live, repeat the view (each replaces the last).
    send_until_received(
        &mut publisher,
        loads(&[(&b_url, 4), ("http://127.0.0.1:1", 9)]),
        &admin_url,
        "kvroute_shared_loads_received_total",
    )
    .await;
    assert_eq!(peer_outstanding_by_url(&router)[&b.url], 4);
    assert_eq!(peer_outstanding_by_url(&router)[&a.url], 0);
    assert!(loads_metric("unknown_replica_total").await >= 1.0);
    // A malformed view is a decode error and changes nothing.
    publisher
        .send(topic_frames(LOADS_TOPIC, 2, b"\x93not a view".to_vec()))
        .await;
    // The hand publisher now falls silent: after LOAD_STALE_AFTER its contribution is removed.
    let started = std::time::Instant::now();
    eventually("a stale load view expired", WAIT, || {
        let expired = loads_metric("expired_total");
        async move { expired.await >= 1.0 }
    })
    .await;
    assert!(started.elapsed() >= proxy::sharing::LOAD_STALE_AFTER / 2);
    assert_eq!(peer_outstanding_by_url(&router)[&b.url], 0);
    assert!(shared_metric(&admin_url, "decode_errors_total").await >= 1.0);
    router.shutdown(Duration::from_secs(5)).await;
}
