//! The KV event decoder, the replay client and the exact-residency policy against byte fixtures
//! written from vLLM's and SGLang's own struct definitions (`tests/fixtures/kv_events/`, whose
//! README derives every byte; none comes from kvroute's encoder).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kv_index::KvEvent;
use kv_index::hash::{cache_salted, token_block_keys};
use parking_lot::Mutex;
use policies::{Branch, PolicySpec, ReplicaView, RouteRequest, build};
use proxy::events::{
    EventBatch, EventEndpoints, EventFormat, EventSink, EventStats, StreamConsumer, decode_batch,
    parse_replay_frames, run_subscriber,
};
use proxy::request::{Endpoint, parse};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/kv_events/");
const MODEL: &str = "m";

fn fixture(name: &str) -> Vec<u8> {
    let path = format!("{DIR}{name}");
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn decode(name: &str, format: EventFormat) -> EventBatch {
    decode_batch(&fixture(name), format).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Messages of a `.frames` fixture (per message: u32 BE frame count, then u32 BE length + bytes
/// per frame; see the README).
fn messages(name: &str) -> Vec<Vec<Bytes>> {
    let data = fixture(name);
    let mut rd = &data[..];
    let u32_be = |rd: &mut &[u8]| {
        let (n, rest) = rd.split_at(4);
        *rd = rest;
        u32::from_be_bytes(n.try_into().unwrap()) as usize
    };
    let mut out = Vec::new();
    while !rd.is_empty() {
        let n = u32_be(&mut rd);
        let mut msg = Vec::with_capacity(n);
        for _ in 0..n {
            let len = u32_be(&mut rd);
            let (f, rest) = rd.split_at(len);
            rd = rest;
            msg.push(Bytes::copy_from_slice(f));
        }
        out.push(msg);
    }
    out
}

/// The fixtures' prompt: 48 tokens, three blocks of 16.
fn prompt() -> Vec<u32> {
    (100..148).collect()
}

const H: [u64; 3] = [
    0xF1E2_D3C4_B5A6_9788,
    0x0123_4567_89AB_CDEF,
    0x8000_0000_0000_0001,
];
const HS: [i64; 3] = [-0x1122_3344_5566_7788, 0x7FFF_FFFF_FFFF_FFF0, -1];
const HSALT: [u64; 2] = [0x5A17_0000_0000_0001, 0x5A17_0000_0000_0002];

fn stored(hashes: &[u64], parent: Option<u64>, lo: usize, hi: usize) -> KvEvent {
    KvEvent::Stored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: prompt()[lo..hi].to_vec(),
        block_size: 16,
        cache_salt: None,
    }
}

fn salted(ev: KvEvent, salt: &str) -> KvEvent {
    match ev {
        KvEvent::Stored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            ..
        } => KvEvent::Stored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            cache_salt: Some(salt.into()),
        },
        other => other,
    }
}

fn removed(hashes: &[u64]) -> KvEvent {
    KvEvent::Removed {
        block_hashes: hashes.to_vec(),
    }
}

// ----- the decoder, fixture by fixture ---------------------------------------------------------

#[test]
fn vllm_0_33_0_int_hashes_decode_field_by_field() {
    let b0 = decode("vllm-0.33.0-int-seq0.bin", EventFormat::Vllm);
    assert_eq!(b0.ts, 1_764_547_200.25);
    assert_eq!(b0.data_parallel_rank, Some(0));
    assert_eq!(b0.events, vec![stored(&H[..2], None, 0, 32)]);
    let b1 = decode("vllm-0.33.0-int-seq1.bin", EventFormat::Vllm);
    assert_eq!(b1.events, vec![stored(&H[2..], Some(H[1]), 32, 48)]);
    let b2 = decode("vllm-0.33.0-int-seq2.bin", EventFormat::Vllm);
    assert_eq!(b2.events, vec![removed(&H[2..])]);
    for b in [b0, b1, b2] {
        assert_eq!((b.unknown_events, b.other_tier_events), (0, 0));
    }
}

#[test]
fn vllm_0_33_0_bytes_hashes_fold_to_their_first_eight_bytes() {
    let b = decode("vllm-0.33.0-bytes.bin", EventFormat::Vllm);
    let fold = |x: u64| x * 0x0101_0101_0101_0101;
    let (a, bb, c) = (fold(0xA1), fold(0xB2), fold(0xC3));
    assert_eq!(
        b.events,
        vec![
            stored(&[a, bb], None, 0, 32),
            stored(&[c], Some(bb), 32, 48),
            removed(&[c]),
        ]
    );
}

#[test]
fn vllm_salt_is_read_from_block_zeros_extra_keys_only_in_vllm_format() {
    let b = decode("vllm-0.33.0-salted.bin", EventFormat::Vllm);
    assert_eq!(
        b.events,
        vec![salted(stored(&HSALT, None, 0, 32), "tenant-a")]
    );
    // Read as SGLang's layout, the salt is looked for in a `cache_salt` field vLLM never sends.
    let as_sglang = decode("vllm-0.33.0-salted.bin", EventFormat::Sglang);
    assert_eq!(as_sglang.events, vec![stored(&HSALT, None, 0, 32)]);
}

#[test]
fn vllm_all_blocks_cleared_from_data_parallel_rank_one() {
    let b = decode("vllm-0.33.0-cleared-dp1.bin", EventFormat::Vllm);
    assert_eq!(b.data_parallel_rank, Some(1));
    assert_eq!(b.events, vec![KvEvent::AllCleared]);
}

#[test]
fn vllm_0_11_0_positional_events_with_the_medium_and_a_cpu_tier_skipped() {
    let b = decode("vllm-0.11.0-array.bin", EventFormat::Vllm);
    assert_eq!(b.data_parallel_rank, Some(0));
    assert_eq!(
        b.events,
        vec![
            stored(&H[..2], None, 0, 32),
            stored(&H[2..], Some(H[1]), 32, 48),
            removed(&H[2..]),
            KvEvent::AllCleared,
        ]
    );
    assert_eq!((b.other_tier_events, b.unknown_events), (1, 0));
}

#[test]
fn vllm_b4e69e0_positional_events_without_trailing_fields() {
    let b = decode("vllm-b4e69e0-array.bin", EventFormat::Vllm);
    assert_eq!(
        b.data_parallel_rank, None,
        "that release's batch is [ts, events]"
    );
    assert_eq!(
        b.events,
        vec![
            stored(&H[..2], None, 0, 32),
            stored(&H[2..], Some(H[1]), 32, 48),
            removed(&H[2..]),
            KvEvent::AllCleared,
        ]
    );
}

fn sglang_chain() -> Vec<KvEvent> {
    let h = HS.map(|x| x as u64);
    vec![
        stored(&h[..1], None, 0, 16),
        stored(&h[1..2], Some(h[0]), 16, 32),
        stored(&h[2..], Some(h[1]), 32, 48),
        removed(&h[2..]),
    ]
}

#[test]
fn sglang_006d053_shorter_arrays_one_page_per_event() {
    let b = decode("sglang-006d053-array.bin", EventFormat::Sglang);
    assert_eq!(b.data_parallel_rank, None);
    assert_eq!(b.events, sglang_chain());
}

#[test]
fn sglang_0_5_23_maps_carry_the_salt_on_their_own_field() {
    let b = decode("sglang-0.5.23.bin", EventFormat::Sglang);
    assert_eq!(b.data_parallel_rank, Some(0), "attn_dp_rank");
    let mut want = sglang_chain();
    want.push(salted(stored(&HSALT[..1], None, 0, 16), "tenant-a"));
    // The second salted page names the salt too, but it extends its parent's (salted) chain.
    want.push(stored(&HSALT[1..], Some(HSALT[0]), 16, 32));
    assert_eq!(b.events, want);
    let c = decode("sglang-0.5.23-cleared.bin", EventFormat::Sglang);
    assert_eq!(c.events, vec![KvEvent::AllCleared]);
}

#[test]
fn the_format_flag_parses_and_names_itself() {
    for f in [EventFormat::Vllm, EventFormat::Sglang] {
        assert_eq!(f.name().parse::<EventFormat>(), Ok(f));
    }
    assert_eq!(EventFormat::default(), EventFormat::Vllm);
    assert!(
        "trtllm"
            .parse::<EventFormat>()
            .unwrap_err()
            .contains("vllm or sglang")
    );
}

// ----- events in → index → exact-residency picks the holder ------------------------------------

/// Feeds each replica's fixture batches to an exact-residency policy and routes `body` (a
/// completions request with the prompt's token ids), keyed as the router keys it.
fn route(feeds: &[(u32, &str, EventFormat)], body: &str) -> policies::Decision {
    let mut p = build(&PolicySpec {
        salt: MODEL.into(),
        ..PolicySpec::named("exact-residency")
    })
    .unwrap();
    for &(replica, name, format) in feeds {
        for ev in decode(name, format).events {
            p.on_kv_event(replica, &ev, 1);
        }
    }
    let parsed = parse(Endpoint::Completions, body.as_bytes()).unwrap();
    let keys = token_block_keys(
        &parsed.key_salt(MODEL.as_bytes()),
        parsed.given_tokens().unwrap(),
        16,
    );
    let fleet: Vec<ReplicaView> = (0..3).map(ReplicaView::idle).collect();
    let req = RouteRequest {
        session_id: None,
        block_keys: &keys,
        tokens_per_block: 16.0,
        now_us: 2,
    };
    p.decide(&req, &fleet).unwrap()
}

fn body(salt: Option<&str>) -> String {
    let tokens: Vec<String> = prompt().iter().map(u32::to_string).collect();
    let salt = salt.map_or(String::new(), |s| format!(",\"cache_salt\":\"{s}\""));
    format!(
        "{{\"model\":\"{MODEL}\",\"prompt\":[{}]{salt}}}",
        tokens.join(",")
    )
}

#[test]
fn exact_residency_routes_to_the_replica_whose_events_hold_the_prefix() {
    // vLLM 0.33.0 on replica 2 (two blocks after the removal), old vLLM on replica 0 (cleared
    // at the end of its batch), old SGLang on replica 1 (two pages after the removal).
    for (feeds, want) in [
        (
            vec![
                (2, "vllm-0.33.0-int-seq0.bin", EventFormat::Vllm),
                (2, "vllm-0.33.0-int-seq1.bin", EventFormat::Vllm),
                (2, "vllm-0.33.0-int-seq2.bin", EventFormat::Vllm),
                (0, "vllm-b4e69e0-array.bin", EventFormat::Vllm),
            ],
            (2, 2),
        ),
        (
            vec![(2, "vllm-0.33.0-bytes.bin", EventFormat::Vllm)],
            (2, 2),
        ),
        (
            vec![(1, "sglang-006d053-array.bin", EventFormat::Sglang)],
            (1, 2),
        ),
        (vec![(1, "sglang-0.5.23.bin", EventFormat::Sglang)], (1, 2)),
    ] {
        let d = route(&feeds, &body(None));
        assert_eq!(
            (d.replica, d.predicted_match_blocks, d.branch),
            (want.0, want.1, Branch::Match),
            "{feeds:?}"
        );
        assert_eq!(d.predicted_match_tokens, want.1 * 16);
    }
}

#[test]
fn a_salted_request_matches_only_the_salted_prefix() {
    // vLLM: replica 0 holds the prompt unsalted (int seq0), replica 1 the same tokens salted.
    let vllm = [
        (0, "vllm-0.33.0-int-seq0.bin", EventFormat::Vllm),
        (1, "vllm-0.33.0-salted.bin", EventFormat::Vllm),
    ];
    let d = route(&vllm, &body(Some("tenant-a")));
    assert_eq!((d.replica, d.predicted_match_blocks), (1, 2));
    let d = route(&vllm, &body(None));
    assert_eq!((d.replica, d.predicted_match_blocks), (0, 2));
    // Another tenant's salt matches neither.
    assert_eq!(route(&vllm, &body(Some("tenant-b"))).branch, Branch::Miss);
    // SGLang: one replica holds both chains; the salted request sees only the salted one (two
    // pages), the unsalted one only its own (two pages after the removal).
    let sgl = [(1, "sglang-0.5.23.bin", EventFormat::Sglang)];
    let d = route(&sgl, &body(Some("tenant-a")));
    assert_eq!((d.replica, d.predicted_match_blocks), (1, 2));
    let salted_keys = token_block_keys(&cache_salted(b"m", Some(b"tenant-a")), &prompt(), 16);
    assert_ne!(salted_keys, token_block_keys(b"m", &prompt(), 16));
}

// ----- the wire: three-frame messages, a lost batch, replay -----------------------------------

#[derive(Default)]
struct Recorder {
    events: Mutex<Vec<KvEvent>>,
    batches: tokio::sync::Notify,
}

impl EventSink for Recorder {
    fn apply(&self, events: &[KvEvent]) {
        self.events.lock().extend_from_slice(events);
        self.batches.notify_one();
    }
}

/// A ROUTER that answers every replay request from a `.frames` fixture (the frames a DEALER
/// receives), keeping the batches at or after the requested start and the end marker.
async fn replay_server(answers: Vec<Vec<Bytes>>) -> (String, tokio::task::JoinHandle<()>) {
    use zeromq::{Socket, SocketRecv, SocketSend};
    let mut router = zeromq::RouterSocket::new();
    let ep = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let task = tokio::spawn(async move {
        while let Ok(msg) = router.recv().await {
            let frames = msg.into_vec();
            let [id, delim, start] = frames.as_slice() else {
                continue;
            };
            assert!(
                delim.is_empty(),
                "the request's second frame is the empty delimiter"
            );
            let start = u64::from_be_bytes(start.as_ref().try_into().unwrap());
            for answer in &answers {
                let (seq, _) = parse_replay_frames(answer).unwrap();
                if seq < start {
                    continue;
                }
                let mut reply = vec![id.clone()];
                reply.extend(answer.iter().cloned());
                let _ = router
                    .send(zeromq::ZmqMessage::try_from(reply).unwrap())
                    .await;
            }
        }
    });
    (ep, task)
}

/// Plays the stream fixture (seq 0, then seq 2: batch 1 lost) against the subscriber, with a
/// replay socket answering from `replay_fixture`; returns what the sink saw and the stats.
async fn gap_repaired_by(replay_fixture: &str) -> (Vec<KvEvent>, Arc<EventStats>) {
    use zeromq::{Socket, SocketSend};
    let stream = messages("vllm-0.33.0-stream.frames");
    let (replay, replay_task) = replay_server(messages(replay_fixture)).await;
    let mut publisher = zeromq::PubSocket::new();
    let endpoint = publisher.bind("tcp://127.0.0.1:0").await.unwrap();
    let sink = Arc::new(Recorder::default());
    let stats = Arc::new(EventStats::default());
    let (tx, rx) = tokio::sync::oneshot::channel();
    let sub = tokio::spawn(run_subscriber(
        EventEndpoints {
            publisher: endpoint.to_string(),
            replay: Some(replay),
            format: EventFormat::Vllm,
        },
        sink.clone(),
        stats.clone(),
        Some(tx),
    ));
    rx.await.unwrap();
    let send = |m: &Vec<Bytes>| zeromq::ZmqMessage::try_from(m.clone()).unwrap();
    // A PUB drops what it sends before the subscription reaches it: resend batch 0 until it
    // lands (each try waits long enough that no earlier copy can still be in flight), for at
    // most 10 s.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        publisher.send(send(&stream[0])).await.unwrap();
        let landed = tokio::time::timeout(Duration::from_millis(500), sink.batches.notified());
        if landed.await.is_ok() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the subscription never received batch 0"
        );
    }
    publisher.send(send(&stream[1])).await.unwrap();
    // Wait on what the sink holds (it is filled before it notifies; the stats lag behind it):
    // three events whether the gap was repaired or cleared.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while sink.events.lock().len() < 3 {
        tokio::time::timeout_at(deadline, sink.batches.notified())
            .await
            .expect("the subscriber applies the repaired and the live batch");
    }
    sub.abort();
    replay_task.abort();
    let events = sink.events.lock().clone();
    (events, stats)
}

fn whole_stream() -> Vec<KvEvent> {
    vec![
        stored(&H[..2], None, 0, 32),
        stored(&H[2..], Some(H[1]), 32, 48),
        removed(&H[2..]),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_batch_is_replayed_from_a_router_that_sends_the_topic() {
    let (events, stats) = gap_repaired_by("vllm-0.33.0-replay-from1.frames").await;
    assert_eq!(
        stats
            .gaps_unrepaired
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    assert_eq!(stats.gaps.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert_eq!(events, whole_stream());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_batch_is_replayed_from_a_router_without_the_topic() {
    let (events, stats) = gap_repaired_by("vllm-b4e69e0-replay-from1.frames").await;
    assert_eq!(
        stats
            .gaps_unrepaired
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    assert_eq!(events, whole_stream());
}

// ----- an engine restart: its residency goes, the new engine's counts ------------------------

/// An exact-residency policy fed by one replica's event stream (replica 1 of two).
struct PolicySink(Mutex<Box<dyn policies::Policy>>);

impl PolicySink {
    fn new() -> Arc<Self> {
        let p = build(&PolicySpec {
            salt: MODEL.into(),
            ..PolicySpec::named("exact-residency")
        })
        .unwrap();
        Arc::new(PolicySink(Mutex::new(p)))
    }

    /// Blocks of `tokens` the policy predicts replica 1 holds (0 on a miss).
    fn predicted_blocks(&self, tokens: &[u32]) -> u32 {
        let keys = token_block_keys(MODEL.as_bytes(), tokens, 16);
        let fleet: Vec<ReplicaView> = (0..2).map(ReplicaView::idle).collect();
        let req = RouteRequest {
            session_id: None,
            block_keys: &keys,
            tokens_per_block: 16.0,
            now_us: 2,
        };
        let d = self.0.lock().decide(&req, &fleet).unwrap();
        match d.branch {
            Branch::Miss => 0,
            _ => {
                assert_eq!(d.replica, 1);
                d.predicted_match_blocks
            }
        }
    }
}

impl EventSink for PolicySink {
    fn apply(&self, events: &[KvEvent]) {
        let mut p = self.0.lock();
        for e in events {
            p.on_kv_event(1, e, 1);
        }
    }
}

/// A second prompt, sharing no block with [`prompt`].
fn other_prompt() -> Vec<u32> {
    (500..532).collect()
}

fn other_stored() -> KvEvent {
    KvEvent::Stored {
        block_hashes: vec![0xB0, 0xB1],
        parent_block_hash: None,
        token_ids: other_prompt(),
        block_size: 16,
        cache_salt: None,
    }
}

fn consumer(sink: &Arc<PolicySink>) -> (StreamConsumer, Arc<EventStats>) {
    let stats = Arc::new(EventStats::default());
    let ep = EventEndpoints {
        publisher: "tcp://127.0.0.1:1".into(),
        replay: None,
        format: EventFormat::Vllm,
    };
    (StreamConsumer::new(ep, sink.clone(), stats.clone()), stats)
}

fn payload(events: &[KvEvent]) -> Vec<u8> {
    proxy::events::encode::batch(0.0, events, proxy::events::encode::Encoding::Map)
}

fn load(stats: &EventStats) -> [u64; 3] {
    use std::sync::atomic::Ordering::Relaxed;
    [
        stats.restarts.load(Relaxed),
        stats.cleared.load(Relaxed),
        stats.gaps_unrepaired.load(Relaxed),
    ]
}

#[tokio::test]
async fn a_restarted_engines_sequence_going_back_drops_the_old_residency() {
    let sink = PolicySink::new();
    let (mut c, stats) = consumer(&sink);
    // The first engine stores the whole prompt over three batches (seq 0..=2).
    c.message(0, &payload(&[stored(&H[..2], None, 0, 32)]))
        .await;
    c.message(1, &payload(&[])).await;
    c.message(2, &payload(&[stored(&H[2..], Some(H[1]), 32, 48)]))
        .await;
    assert_eq!(sink.predicted_blocks(&prompt()), 3);
    // It restarts: sequence 0 again, an empty cache, then the other prompt and the first block
    // of this one again (vLLM's sha256 block hashes are the same across restarts).
    c.message(0, &payload(&[other_stored(), stored(&H[..1], None, 0, 16)]))
        .await;
    assert_eq!(
        sink.predicted_blocks(&prompt()),
        1,
        "only what the new engine stored"
    );
    assert_eq!(sink.predicted_blocks(&other_prompt()), 2);
    assert_eq!(load(&stats), [1, 0, 0]);
    // An AllBlocksCleared (a prefix-cache reset) drops it all again, counted as a clear.
    c.message(1, &payload(&[KvEvent::AllCleared])).await;
    assert_eq!(sink.predicted_blocks(&other_prompt()), 0);
    assert_eq!(sink.predicted_blocks(&prompt()), 0);
    assert_eq!(load(&stats), [1, 1, 0]);
}

#[tokio::test]
async fn a_lost_publisher_connection_drops_the_residency_even_when_the_sequence_goes_on() {
    let sink = PolicySink::new();
    let (mut c, stats) = consumer(&sink);
    c.message(0, &payload(&[stored(&H[..2], None, 0, 32)]))
        .await;
    c.message(1, &payload(&[])).await;
    assert_eq!(sink.predicted_blocks(&prompt()), 2);
    // The engine went away; by the time the socket reconnects, its successor has published
    // batches 0..=2 and sends 3: above the old engine's last, so the sequence alone would call
    // it in order and keep the old residency.
    c.publisher_lost();
    assert_eq!(sink.predicted_blocks(&prompt()), 0);
    c.message(3, &payload(&[other_stored()])).await;
    assert_eq!(sink.predicted_blocks(&other_prompt()), 2);
    assert_eq!(sink.predicted_blocks(&prompt()), 0);
    // One restart; batches 0..3 of the new engine were a late join with no replay: unrepaired.
    assert_eq!(load(&stats), [1, 0, 1]);
}

#[test]
fn replay_frames_of_both_releases_and_the_end_marker() {
    for name in [
        "vllm-0.33.0-replay-from1.frames",
        "vllm-b4e69e0-replay-from1.frames",
    ] {
        let m = messages(name);
        let seqs: Vec<u64> = m
            .iter()
            .map(|f| parse_replay_frames(f).unwrap().0)
            .collect();
        assert_eq!(seqs, vec![1, 2, u64::MAX], "{name}");
        let (_, payload) = parse_replay_frames(&m[0]).unwrap();
        assert_eq!(payload, &fixture("vllm-0.33.0-int-seq1.bin")[..], "{name}");
    }
    // The live stream's frames: topic, 8-byte big-endian sequence, the batch.
    let s = messages("vllm-0.33.0-stream.frames");
    assert_eq!(s[0][0], Bytes::from_static(b"kv@127.0.0.1:8000@m"));
    assert_eq!(s[1][1].as_ref(), &2u64.to_be_bytes());
    assert_eq!(s[1][2].as_ref(), &fixture("vllm-0.33.0-int-seq2.bin")[..]);
}
