//! KV event tests: a ZMQ subscriber decodes the published frames (both encodings), fills any
//! gap before its first message through the replay socket, and reconstructs the engine's cached
//! block set exactly.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use engine::kv_events::{END_SEQ, Encoding, KvEvent, decode_batch};
use engine::server::KvEventsConfig;
use serde_json::json;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// Multiset of cached hashes as a subscriber sees them (duplicates are not deduplicated).
#[derive(Default)]
struct Mirror {
    encoding: Option<Encoding>,
    counts: HashMap<u64, u32>,
    next_seq: Option<u64>,
    stored: usize,
    removed: usize,
}

impl Mirror {
    fn apply(&mut self, seq: u64, payload: &[u8]) {
        if let Some(n) = self.next_seq {
            assert_eq!(seq, n, "sequence gap");
        }
        self.next_seq = Some(seq + 1);
        let raw = rmpv::decode::read_value(&mut &payload[..]).expect("msgpack");
        for ev in raw[1].as_array().expect("event list") {
            match self.encoding {
                Some(Encoding::Array) => assert!(ev.is_array() && ev[0].is_str(), "{ev}"),
                Some(Encoding::Map) => assert!(ev.is_map() && ev["type"].is_str(), "{ev}"),
                None => {}
            }
        }
        let batch = decode_batch(payload).expect("payload decodes");
        assert_eq!(batch.data_parallel_rank, Some(0));
        assert!(batch.ts > 1.0e9, "ts is wall-clock seconds");
        for ev in batch.events {
            match ev {
                KvEvent::BlockStored {
                    block_hashes,
                    token_ids,
                    block_size,
                    parent_block_hash,
                } => {
                    assert_eq!(block_size, 16);
                    assert_eq!(token_ids.len(), block_hashes.len() * 16);
                    // Chained: each stored hash is H(parent, its tokens).
                    let mut parent = parent_block_hash.unwrap_or(engine::core::ROOT_BLOCK_HASH);
                    for (h, toks) in block_hashes.iter().zip(token_ids.chunks(16)) {
                        assert_eq!(*h, engine::block_hash(parent, toks));
                        parent = *h;
                        *self.counts.entry(*h).or_default() += 1;
                    }
                    self.stored += 1;
                }
                KvEvent::BlockRemoved { block_hashes } => {
                    for h in block_hashes {
                        let c = self.counts.get_mut(&h).expect("removal of a stored hash");
                        *c -= 1;
                        if *c == 0 {
                            self.counts.remove(&h);
                        }
                    }
                    self.removed += 1;
                }
                KvEvent::AllBlocksCleared => self.counts.clear(),
            }
        }
    }

    fn set(&self) -> HashSet<u64> {
        self.counts.keys().copied().collect()
    }
}

async fn replay(endpoint: &str, start: u64) -> Vec<(u64, Bytes)> {
    let mut d = DealerSocket::new();
    d.connect(endpoint).await.expect("replay connect");
    let req = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&start.to_be_bytes()),
    ])
    .expect("frames");
    d.send(req).await.expect("send");
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let m = tokio::time::timeout_at(deadline, d.recv())
            .await
            .expect("the replay ends (END_SEQ) within 10 s")
            .expect("replay answer")
            .into_vec();
        assert_eq!(m.len(), 3, "[b\"\", seq, payload]");
        assert!(m[0].is_empty());
        let seq = u64::from_be_bytes(m[1].as_ref().try_into().expect("8-byte seq"));
        if seq == END_SEQ {
            assert!(m[2].is_empty());
            return out;
        }
        out.push((seq, m[2].clone()));
    }
}

async fn reconstructs_cached_set(encoding: Encoding) {
    let mut cfg = config(50.0, 96); // small pool: evictions happen
    cfg.kv_events = Some(KvEventsConfig {
        endpoint: "tcp://127.0.0.1:0".into(),
        bind: true,
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        topic: "kv@test".into(),
        buffer_steps: 100_000,
        encoding,
    });
    let srv = start(cfg).await;
    let mut sub = SubSocket::new();
    sub.connect(srv.kv_events_endpoint().expect("events on"))
        .await
        .expect("sub connect");
    sub.subscribe("").await.expect("subscribe");

    // A workload with shared prefixes, repeats, generated blocks and evictions.
    let mut handles = Vec::new();
    for round in 0..3u32 {
        for conv in 0..6u32 {
            let body =
                json!({"prompt": prose(conv, 120 + 40 * round as usize), "max_tokens": 20 + conv,
                              "ignore_eos": true, "stream": conv % 2 == 0})
                .to_string();
            let addr = srv.addr();
            handles.push(tokio::spawn(async move {
                call(addr, "POST", "/v1/completions", &body).await.0
            }));
        }
        for h in handles.drain(..) {
            assert_eq!(h.await.expect("task"), 200);
        }
    }
    let truth = srv.cached_block_hashes().await.expect("engine alive");
    assert!(!truth.is_empty());

    let mut mirror = Mirror {
        encoding: Some(encoding),
        ..Mirror::default()
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while mirror.set() != truth {
        assert!(
            Instant::now() < deadline,
            "subscriber never matched the engine's cache"
        );
        let m = tokio::time::timeout(Duration::from_secs(10), sub.recv())
            .await
            .expect("a message within 10 s")
            .expect("recv")
            .into_vec();
        assert_eq!(m.len(), 3, "topic, seq, payload");
        assert_eq!(m[0].as_ref(), b"kv@test");
        let seq = u64::from_be_bytes(m[1].as_ref().try_into().expect("8-byte seq"));
        if mirror.next_seq.is_none() && seq > 0 {
            // Joined late: fetch what came before from the replay socket.
            for (s, p) in replay(srv.kv_replay_endpoint().expect("replay on"), 0).await {
                if s < seq {
                    mirror.apply(s, &p);
                }
            }
        }
        mirror.apply(seq, &m[2]);
    }
    assert!(
        mirror.removed > 0,
        "the workload should have evicted blocks"
    );
    assert!(mirror.stored > 0);

    // Reset: AllBlocksCleared empties the mirror too.
    assert_eq!(
        call(srv.addr(), "POST", "/reset_prefix_cache", "").await.0,
        200
    );
    let m = tokio::time::timeout(Duration::from_secs(10), sub.recv())
        .await
        .expect("msg")
        .expect("recv")
        .into_vec();
    let seq = u64::from_be_bytes(m[1].as_ref().try_into().expect("seq"));
    mirror.apply(seq, &m[2]);
    assert!(mirror.set().is_empty());
    assert!(srv.cached_block_hashes().await.expect("alive").is_empty());

    // Replay from the middle returns exactly the tail, in order.
    let tail = replay(srv.kv_replay_endpoint().expect("replay on"), seq - 1).await;
    assert_eq!(
        tail.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        vec![seq - 1, seq]
    );
    srv.shutdown().await;
}

#[tokio::test]
async fn subscriber_reconstructs_cache_array_encoding() {
    reconstructs_cached_set(Encoding::Array).await;
}

#[tokio::test]
async fn subscriber_reconstructs_cache_map_encoding() {
    reconstructs_cached_set(Encoding::Map).await;
}

fn events_cfg(endpoint: &str, bind: bool, replay: Option<&str>) -> engine::server::ServerConfig {
    let mut cfg = config(50.0, 96);
    cfg.kv_events = Some(KvEventsConfig {
        endpoint: endpoint.into(),
        bind,
        replay_endpoint: replay.map(str::to_owned),
        topic: String::new(),
        buffer_steps: 100_000,
        encoding: Encoding::Array,
    });
    cfg
}

async fn workload(addr: std::net::SocketAddr) {
    for conv in 0..8u32 {
        let body = json!({"prompt": prose(conv % 3, 150 + 10 * conv as usize), "max_tokens": 24, "ignore_eos": true}).to_string();
        assert_eq!(call(addr, "POST", "/v1/completions", &body).await.0, 200);
    }
}

#[tokio::test]
async fn late_joiner_rebuilds_the_cache_from_replay_alone() {
    let srv = start(events_cfg(
        "tcp://127.0.0.1:0",
        true,
        Some("tcp://127.0.0.1:0"),
    ))
    .await;
    workload(srv.addr()).await; // nobody subscribed: every batch is lost to PUB
    let truth = srv.cached_block_hashes().await.expect("alive");
    let mut mirror = Mirror::default();
    let deadline = Instant::now() + Duration::from_secs(20);
    // The publisher may still be buffering the last batches; replay again from where we stopped.
    while mirror.set() != truth {
        assert!(
            Instant::now() < deadline,
            "replay never matched the engine's cache"
        );
        let from = mirror.next_seq.unwrap_or(0);
        for (s, p) in replay(srv.kv_replay_endpoint().expect("replay on"), from).await {
            mirror.apply(s, &p);
        }
    }
    assert!(mirror.stored > 0);
    srv.shutdown().await;
}

#[tokio::test]
async fn connect_mode_publishes_to_a_bound_subscriber() {
    // vLLM's rule: an endpoint without a wildcard is connected to (e.g. a proxy that binds).
    let mut sub = SubSocket::new();
    let ep = sub
        .bind("tcp://127.0.0.1:0")
        .await
        .expect("sub binds")
        .to_string();
    sub.subscribe("").await.expect("subscribe");
    assert!(!engine::server::events::should_bind(&ep));
    let srv = start(events_cfg(&ep, false, None)).await;
    assert_eq!(srv.kv_events_endpoint(), Some(ep.as_str()));
    assert!(srv.kv_replay_endpoint().is_none());
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut got = None;
    // Batches sent before the connection completes are dropped (PUB semantics): keep sending
    // work until one arrives.
    while got.is_none() {
        assert!(
            Instant::now() < deadline,
            "no batch reached the bound subscriber"
        );
        workload(srv.addr()).await;
        if let Ok(m) = tokio::time::timeout(Duration::from_millis(500), sub.recv()).await {
            got = Some(m.expect("recv").into_vec());
        }
    }
    let m = got.expect("message");
    assert_eq!(m.len(), 3);
    assert!(m[0].is_empty(), "default topic is empty");
    assert!(!decode_batch(&m[2]).expect("decodes").events.is_empty());
    srv.shutdown().await;
}
