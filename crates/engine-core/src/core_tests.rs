//! Unit tests of the scheduler and its use of the block pool, in virtual time.

use super::*;
use crate::config::StepModel;
use std::collections::HashSet;

fn cfg(num_gpu_blocks: u32) -> EngineConfig {
    EngineConfig {
        num_gpu_blocks,
        model: StepModel {
            frontend_ms: 0.0,
            ..StepModel::default()
        },
        ..EngineConfig::default()
    }
}

fn params(max_tokens: u32) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ignore_eos: true,
    }
}

/// Distinct tokens per `tag`, so prompts with different tags share no block.
fn prompt(tag: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| tag * 100_000 + i).collect()
}

/// Steps until idle, returning every token with its emission time, and the final time.
fn run(e: &mut Engine, mut now: u64) -> (Vec<(u64, TokenOut)>, u64) {
    let mut toks = Vec::new();
    let mut out = StepOutput::default();
    while let Some(t) = e.next_wakeup_us(now) {
        now = t;
        e.step_into(now, &mut out);
        if out.num_scheduled_reqs == 0 {
            break;
        }
        now = out.end_us();
        toks.extend(out.tokens.iter().map(|t| (now, *t)));
    }
    (toks, now)
}

fn finished(toks: &[(u64, TokenOut)], id: RequestId) -> &TokenOut {
    &toks
        .iter()
        .find(|(_, t)| t.id == id && t.finish.is_some())
        .expect("request finished")
        .1
}

#[test]
fn hit_is_capped_at_n_minus_one_block_aligned() {
    let mut e = Engine::new(cfg(512)).expect("valid");
    e.add_request(1, prompt(1, 1024), params(1), 0).expect("ok");
    let (toks, now) = run(&mut e, 0);
    assert_eq!(finished(&toks, 1).cached_tokens, 0);
    e.add_request(2, prompt(1, 1024), params(1), now)
        .expect("ok");
    let (toks, now) = run(&mut e, now);
    assert_eq!(finished(&toks, 2).cached_tokens, 1008);
    // A prompt one token longer hits every full block.
    e.add_request(3, prompt(1, 1025), params(1), now)
        .expect("ok");
    let (toks, _) = run(&mut e, now);
    assert_eq!(finished(&toks, 3).cached_tokens, 1024);
    assert_eq!(e.counters().prefix_cache_hits_tokens, 1008 + 1024);
    assert_eq!(e.counters().prefix_cache_queries_tokens, 1024 * 2 + 1025);
}

#[test]
fn lookup_stops_at_first_miss() {
    let mut e = Engine::new(cfg(512)).expect("valid");
    e.add_request(1, prompt(1, 64), params(1), 0).expect("ok");
    let (_, now) = run(&mut e, 0);
    // Same block 0, different block 1, identical blocks 2 and 3: only block 0 hits,
    // because block hashes are chained on their parents.
    let mut p = prompt(1, 65);
    p[20] = 7;
    e.add_request(2, p, params(1), now).expect("ok");
    let (toks, _) = run(&mut e, now);
    assert_eq!(finished(&toks, 2).cached_tokens, 16);
}

#[test]
fn generated_full_blocks_are_cached_and_events_carry_their_tokens() {
    let mut e = Engine::new(cfg(512)).expect("valid");
    e.add_request(1, prompt(1, 20), params(30), 0).expect("ok");
    let mut events = Vec::new();
    let mut now = 0;
    let mut generated = Vec::new();
    while let Some(t) = e.next_wakeup_us(now) {
        let out = e.step(t);
        now = out.end_us();
        events.extend(out.kv_events);
        generated.extend(out.tokens.iter().map(|t| t.token));
    }
    assert_eq!(generated.len(), 30);
    // 20 prompt + 30 generated = 50 tokens; the last one is never computed → 49 computed →
    // 3 full blocks, stored as they fill: one at prefill, then one per decode crossing.
    let stored: Vec<_> = events
        .iter()
        .filter_map(|ev| match ev {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                ..
            } => Some((block_hashes.clone(), *parent_block_hash, token_ids.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(stored.len(), 3);
    let mut all = prompt(1, 20);
    all.extend(&generated);
    let hashes = block_hashes(&all, 16);
    assert_eq!(stored[0], (vec![hashes[0]], None, all[..16].to_vec()));
    assert_eq!(
        stored[1],
        (vec![hashes[1]], Some(hashes[0]), all[16..32].to_vec())
    );
    assert_eq!(
        stored[2],
        (vec![hashes[2]], Some(hashes[1]), all[32..48].to_vec())
    );
    // The next turn (prompt = conversation so far) hits the generated blocks too.
    e.add_request(2, all[..49].to_vec(), params(1), now)
        .expect("ok");
    let (toks, _) = run(&mut e, now);
    assert_eq!(finished(&toks, 2).cached_tokens, 48);
}

#[test]
fn freed_chains_evict_tail_first_and_lazily() {
    // 1 null + 8 usable blocks.
    let mut e = Engine::new(cfg(9)).expect("valid");
    e.add_request(1, prompt(1, 64), params(1), 0).expect("ok");
    let (_, now) = run(&mut e, 0);
    let mut ev = Vec::new();
    e.take_events(&mut ev);
    assert_eq!(e.pool().num_free_blocks(), 8);
    let chain = block_hashes(&prompt(1, 64), 16);
    // Still fully hit-able while free (lazy eviction).
    assert_eq!(
        e.pool().cached_hashes(),
        chain.iter().copied().collect::<HashSet<_>>()
    );
    // A new 80-token request takes 5 blocks (4 never-used go first, then the chain's tail).
    e.add_request(2, prompt(2, 72), params(1), now).expect("ok");
    let out = e.step(now);
    let removed: Vec<u64> = out
        .kv_events
        .iter()
        .filter_map(|ev| match ev {
            KvEvent::BlockRemoved { block_hashes } => Some(block_hashes[0]),
            _ => None,
        })
        .collect();
    assert_eq!(removed, vec![chain[3]]);
    // The head of the chain still hits.
    let (_, now) = run(&mut e, out.end_us());
    e.add_request(3, prompt(1, 64), params(1), now).expect("ok");
    let (toks, _) = run(&mut e, now);
    assert_eq!(finished(&toks, 3).cached_tokens, 48);
}

#[test]
fn identical_concurrent_prefixes_are_not_deduplicated() {
    let mut e = Engine::new(cfg(64)).expect("valid");
    e.add_request(1, prompt(1, 64), params(2), 0).expect("ok");
    e.add_request(2, prompt(1, 64), params(2), 0).expect("ok");
    let out = e.step(0);
    // Blocks are cached when scheduled, so request 2 (admitted in the same step) already hits
    // request 1's first three blocks; the n−1 cap makes it recompute block 3, which it stores
    // again under the same hash instead of sharing request 1's copy.
    let stored: Vec<_> = out
        .kv_events
        .iter()
        .filter_map(|ev| match ev {
            KvEvent::BlockStored { block_hashes, .. } => Some(block_hashes.clone()),
            _ => None,
        })
        .collect();
    let chain = block_hashes(&prompt(1, 64), 16);
    assert_eq!(stored, vec![chain.clone(), vec![chain[3]]]);
    assert_eq!(e.pool().num_cached_blocks(), 5);
    assert_eq!(e.pool().cached_hashes().len(), 4);
    let b1 = e.request_blocks(1).expect("live").to_vec();
    let b2 = e.request_blocks(2).expect("live").to_vec();
    assert_eq!(b1[..3], b2[..3]);
    assert_ne!(b1[3], b2[3]);
    assert_eq!(e.pool().block_hash(b1[3]), e.pool().block_hash(b2[3]));
}

#[test]
fn shared_hit_blocks_are_ref_counted() {
    let mut e = Engine::new(cfg(64)).expect("valid");
    e.add_request(1, prompt(1, 64), params(1), 0).expect("ok");
    let (_, now) = run(&mut e, 0);
    e.add_request(2, prompt(1, 65), params(5), now).expect("ok");
    e.add_request(3, prompt(1, 66), params(5), now).expect("ok");
    e.step(now);
    let b2 = e.request_blocks(2).expect("live").to_vec();
    let b3 = e.request_blocks(3).expect("live").to_vec();
    assert_eq!(b2[..4], b3[..4]);
    assert!(b2[..4].iter().all(|&b| e.pool().ref_count(b) == 2));
    assert!(e.abort(2));
    assert!(b3[..4].iter().all(|&b| e.pool().ref_count(b) == 1));
}

#[test]
fn long_prompts_prefill_in_chunks_of_the_token_budget() {
    let mut e = Engine::new(cfg(1024)).expect("valid");
    e.add_request(1, prompt(1, 5000), params(1), 0).expect("ok");
    let mut chunks = Vec::new();
    let mut now = 0;
    while let Some(t) = e.next_wakeup_us(now) {
        let out = e.step(t);
        now = out.end_us();
        chunks.push((out.num_scheduled_tokens, out.tokens.len()));
    }
    assert_eq!(chunks, vec![(2048, 0), (2048, 0), (904, 1)]);
}

#[test]
fn running_first_then_waiting_within_budget_and_seq_cap() {
    let mut c = cfg(1024);
    c.max_num_seqs = 3;
    c.max_num_batched_tokens = 100;
    let mut e = Engine::new(c).expect("valid");
    e.add_request(1, prompt(1, 10), params(50), 0).expect("ok");
    e.step(0);
    for id in 2..=5 {
        e.add_request(id, prompt(id as u32, 60), params(50), 0)
            .expect("ok");
    }
    // Decode of 1 (1 token) first, then request 2's whole prompt (60), then 39 of request 3.
    let out = e.step(1);
    assert_eq!(out.num_scheduled_tokens, 100);
    assert_eq!(e.request_num_computed(1), Some(11));
    assert_eq!(e.request_num_computed(2), Some(60));
    assert_eq!(e.request_num_computed(3), Some(39));
    assert_eq!(e.num_running(), 3);
    assert_eq!(e.num_waiting(), 2);
    // max_num_seqs = 3 keeps 4 and 5 waiting even with budget left.
    let out = e.step(2);
    assert_eq!(out.num_scheduled_tokens, 1 + 1 + 21);
    assert_eq!(e.num_waiting(), 2);
}

#[test]
fn preemption_recomputes_last_admitted_and_resume_hits_cache() {
    // 1 null + 10 usable blocks; two requests that grow to 4 + 8 blocks cannot both fit.
    let mut c = cfg(11);
    c.max_num_batched_tokens = 2048;
    let mut e = Engine::new(c).expect("valid");
    e.add_request(1, prompt(1, 48), params(70), 0).expect("ok");
    e.add_request(2, prompt(2, 64), params(60), 0).expect("ok");
    let mut now = 0;
    let mut preempt_step_admitted = None;
    let mut resumed_hits = 0;
    let mut steps = 0;
    while let Some(t) = e.next_wakeup_us(now) {
        let hits_before = e.counters().prefix_cache_hits_tokens;
        let waiting_before = e.num_waiting();
        let out = e.step(t);
        now = out.end_us();
        steps += 1;
        if out.num_preempted > 0 && preempt_step_admitted.is_none() {
            // The last admitted (2) was preempted; nothing was admitted in that step.
            assert_eq!(e.request_num_computed(2), Some(0));
            assert!(e.request_blocks(2).expect("live").is_empty());
            assert_eq!(e.num_waiting(), waiting_before + 1);
            preempt_step_admitted = Some(out.admitted.len());
        }
        if preempt_step_admitted.is_some() && e.counters().prefix_cache_hits_tokens > hits_before {
            resumed_hits = e.counters().prefix_cache_hits_tokens - hits_before;
        }
        assert!(steps < 1000);
    }
    assert_eq!(preempt_step_admitted, Some(0));
    assert!(e.counters().preemptions >= 1);
    // The victim's blocks kept their hashes; those not reused by the survivor meanwhile hit.
    assert!(
        resumed_hits > 0 && resumed_hits % 16 == 0,
        "resume hit {resumed_hits} tokens"
    );
    assert_eq!(e.counters().finished_length, 2);
    assert_eq!(e.pool().num_free_blocks(), 10);
}

#[test]
fn abort_frees_blocks_everywhere() {
    let mut e = Engine::new(cfg(64)).expect("valid");
    e.add_request(1, prompt(1, 100), params(50), 0).expect("ok");
    e.add_request(2, prompt(2, 100), params(50), 10_000_000)
        .expect("ok");
    e.step(0);
    assert_eq!(e.pool().num_free_blocks(), 63 - 7);
    assert!(e.abort(1));
    assert!(e.abort(2));
    assert!(!e.abort(2));
    assert_eq!(e.pool().num_free_blocks(), 63);
    assert_eq!(e.num_requests(), 0);
    assert_eq!(e.next_wakeup_us(5), None);
    assert_eq!(e.counters().aborted, 2);
}

#[test]
fn reset_prefix_cache_only_when_idle_and_emits_cleared() {
    let mut e = Engine::new(cfg(64)).expect("valid");
    e.add_request(1, prompt(1, 40), params(3), 0).expect("ok");
    e.step(0);
    assert!(!e.reset_prefix_cache());
    let (_, now) = run(&mut e, 1);
    assert!(e.reset_prefix_cache());
    let mut ev = Vec::new();
    e.take_events(&mut ev);
    assert_eq!(ev.last(), Some(&KvEvent::AllBlocksCleared));
    e.add_request(2, prompt(1, 40), params(1), now).expect("ok");
    let (toks, _) = run(&mut e, now);
    assert_eq!(finished(&toks, 2).cached_tokens, 0);
}

#[test]
fn max_tokens_and_ignore_eos_are_honoured_deterministically() {
    let mut e = Engine::new(cfg(2048)).expect("valid");
    let mut stops = 0;
    for id in 0..20u64 {
        e.add_request(
            id,
            prompt(id as u32 + 1, 30),
            SamplingParams {
                max_tokens: 1500,
                ignore_eos: false,
            },
            0,
        )
        .expect("ok");
        e.add_request(1000 + id, prompt(id as u32 + 1, 30), params(1500), 0)
            .expect("ok");
    }
    let (toks, _) = run(&mut e, 0);
    for id in 0..20u64 {
        let a = finished(&toks, id);
        let b = finished(&toks, 1000 + id);
        assert_eq!(b.finish, Some(FinishReason::Length));
        assert_eq!(b.output_index, 1499);
        if a.finish == Some(FinishReason::Stop) {
            stops += 1;
            assert_eq!(a.token, EOS_TOKEN_ID);
        }
        // Same prompt, same seed → same text up to the EOS.
        let ta: Vec<u32> = toks
            .iter()
            .filter(|(_, t)| t.id == id)
            .map(|(_, t)| t.token)
            .collect();
        let tb: Vec<u32> = toks
            .iter()
            .filter(|(_, t)| t.id == 1000 + id)
            .map(|(_, t)| t.token)
            .collect();
        assert_eq!(ta[..ta.len() - 1], tb[..ta.len() - 1]);
    }
    assert!(
        stops >= 15,
        "EOS every ~256 tokens should stop most of 20 requests, got {stops}"
    );
}

#[test]
fn bad_requests_are_errors() {
    let mut e = Engine::new(cfg(64)).expect("valid");
    assert_eq!(
        e.add_request(1, vec![], params(1), 0),
        Err(AddError::EmptyPrompt)
    );
    assert_eq!(
        e.add_request(1, vec![1], params(0), 0),
        Err(AddError::ZeroMaxTokens)
    );
    assert!(matches!(
        e.add_request(1, vec![1; 8000], params(500), 0),
        Err(AddError::TooLong { .. })
    ));
    assert!(matches!(
        e.add_request(1, vec![1; 2000], params(1), 0),
        Err(AddError::TooLargeForCache { .. })
    ));
    e.add_request(1, vec![1], params(1), 0).expect("ok");
    assert_eq!(
        e.add_request(1, vec![1], params(1), 0),
        Err(AddError::DuplicateId(1))
    );
    assert!(
        Engine::new(EngineConfig {
            block_size: 0,
            ..EngineConfig::default()
        })
        .is_err()
    );
}

#[test]
fn frontend_cost_delays_scheduling() {
    let mut e = Engine::new(EngineConfig::default()).expect("valid");
    e.add_request(1, prompt(1, 10), params(1), 1_000)
        .expect("ok");
    assert_eq!(e.next_wakeup_us(1_000), Some(39_000));
    let out = e.step(38_999);
    assert_eq!(out.num_scheduled_reqs, 0);
    let out = e.step(39_000);
    assert_eq!(out.num_scheduled_reqs, 1);
}

#[test]
fn prefill_lengthens_co_running_decode_steps() {
    let mut e = Engine::new(cfg(2048)).expect("valid");
    e.add_request(1, prompt(1, 100), params(100), 0)
        .expect("ok");
    let (_, mut now) = (e.step(0), 0);
    now += 10_000;
    let decode = e.step(now).duration_us;
    e.add_request(2, prompt(2, 1500), params(1), now)
        .expect("ok");
    let with_prefill = e.step(now + decode).duration_us;
    assert!(
        with_prefill > 40 * decode,
        "decode {decode} µs, with prefill {with_prefill} µs"
    );
}

#[test]
fn speed_and_slowdown_scale_durations() {
    let base = {
        let mut e = Engine::new(EngineConfig::default()).expect("valid");
        e.add_request(1, prompt(1, 500), params(1), 0).expect("ok");
        let t = e.next_wakeup_us(0).expect("work");
        (t, e.step(t).duration_us)
    };
    let mut c = EngineConfig::default();
    c.model.speed = 4.0;
    c.model.slowdown = 2.0;
    let mut e = Engine::new(c).expect("valid");
    e.add_request(1, prompt(1, 500), params(1), 0).expect("ok");
    let t = e.next_wakeup_us(0).expect("work");
    assert_eq!(t, base.0 / 4);
    let d = e.step(t).duration_us as f64;
    assert!((d - base.1 as f64 / 2.0).abs() <= 1.0, "{d} vs {}", base.1);
}

/// Calibration: the reference fleet's three concurrency-1 floors (crates/engine-core README,
/// "Defaults and calibration") within 5%.
#[test]
fn calibration_floors_within_five_percent() {
    let mut e = Engine::new(EngineConfig::default()).expect("valid");
    let p = prompt(42, 1100);
    let t0 = 1_000_000;
    e.add_request(1, p.clone(), params(128), t0).expect("ok");
    let (toks, now) = run(&mut e, t0);
    let times: Vec<u64> = toks.iter().map(|(t, _)| *t).collect();
    let ttft_ms = (times[0] - t0) as f64 / 1000.0;
    let mut gaps: Vec<u64> = times.windows(2).map(|w| w[1] - w[0]).collect();
    gaps.sort_unstable();
    let itl_ms = gaps[gaps.len() / 2] as f64 / 1000.0;
    let t1 = now + 5_000_000;
    e.add_request(2, p, params(1), t1).expect("ok");
    let (toks, _) = run(&mut e, t1);
    let cached_ttft_ms = (toks[0].0 - t1) as f64 / 1000.0;
    let within = |got: f64, want: f64| (got - want).abs() / want <= 0.05;
    assert!(within(ttft_ms, 329.0), "unseen TTFT {ttft_ms} ms");
    assert!(
        within(cached_ttft_ms, 46.0),
        "cached TTFT {cached_ttft_ms} ms"
    );
    assert!(within(itl_ms, 7.8), "ITL {itl_ms} ms");
}

/// Seeded random add/abort/step sequences on a tight pool: block accounting, ref counts and the
/// event-derived cache mirror stay exact after every step.
#[test]
fn random_workload_keeps_pool_invariants_and_event_mirror() {
    use rand::{Rng, SeedableRng};
    for seed in 0..4u64 {
        let mut rng = rand_pcg::Pcg64Mcg::seed_from_u64(seed);
        let mut c = cfg(40);
        c.max_num_batched_tokens = 96;
        c.max_num_seqs = 6;
        let mut e = Engine::new(c).expect("valid");
        let mut mirror: std::collections::HashMap<u64, u32> = Default::default();
        let mut live: Vec<RequestId> = Vec::new();
        let mut next_id = 0u64;
        let mut now = 0u64;
        let mut out = StepOutput::default();
        for _ in 0..1500 {
            match rng.random_range(0..10) {
                0..=2 => {
                    // Conversations share prefixes: a few tags, varying lengths.
                    let tag = rng.random_range(0..4);
                    let len = rng.random_range(1..200);
                    let p = SamplingParams {
                        max_tokens: rng.random_range(1..60),
                        ignore_eos: rng.random_bool(0.5),
                    };
                    if e.add_request(next_id, prompt(tag, len), p, now).is_ok() {
                        live.push(next_id);
                    }
                    next_id += 1;
                }
                3 if !live.is_empty() => {
                    let id = live.swap_remove(rng.random_range(0..live.len()));
                    e.abort(id);
                }
                4 if rng.random_bool(0.05) => {
                    e.reset_prefix_cache();
                }
                _ => {}
            }
            if let Some(t) = e.next_wakeup_us(now) {
                e.step_into(t, &mut out);
                now = out.end_us().max(t + 1);
            } else {
                out = StepOutput::default();
                e.take_events(&mut out.kv_events);
            }
            for ev in out.kv_events.drain(..) {
                match ev {
                    KvEvent::BlockStored { block_hashes, .. } => {
                        for h in block_hashes {
                            *mirror.entry(h).or_default() += 1;
                        }
                    }
                    KvEvent::BlockRemoved { block_hashes } => {
                        for h in block_hashes {
                            let c = mirror.get_mut(&h).expect("removed hash was stored");
                            *c -= 1;
                            if *c == 0 {
                                mirror.remove(&h);
                            }
                        }
                    }
                    KvEvent::AllBlocksCleared => mirror.clear(),
                }
            }
            live.retain(|id| e.contains(*id));
            // Ref counts equal the number of live requests holding each block.
            let mut holders: std::collections::HashMap<BlockId, u32> = Default::default();
            for id in &live {
                for &b in e.request_blocks(*id).expect("live") {
                    *holders.entry(b).or_default() += 1;
                }
            }
            for b in 1..40u32 {
                assert_eq!(
                    e.pool().ref_count(b),
                    holders.get(&b).copied().unwrap_or(0),
                    "block {b}"
                );
            }
            assert_eq!(e.pool().num_free_blocks() as usize + holders.len(), 39);
            assert_eq!(
                e.pool().free_queue().len(),
                e.pool().num_free_blocks() as usize
            );
            let mirror_set: HashSet<u64> = mirror.keys().copied().collect();
            assert_eq!(mirror_set, e.pool().cached_hashes());
            assert_eq!(
                mirror.values().map(|&c| c as usize).sum::<usize>(),
                e.pool().num_cached_blocks()
            );
        }
        assert!(
            e.counters().preemptions > 0,
            "seed {seed}: the tight pool should preempt"
        );
    }
}

#[test]
fn jitter_is_seeded_and_bounded() {
    let run_with = |seed: u64, jitter: f64| {
        let mut c = cfg(2048);
        c.seed = seed;
        c.model.jitter = jitter;
        let mut e = Engine::new(c).expect("valid");
        e.add_request(1, prompt(1, 100), params(50), 0).expect("ok");
        let mut d = Vec::new();
        let mut now = 0;
        while let Some(t) = e.next_wakeup_us(now) {
            let out = e.step(t);
            now = out.end_us();
            d.push(out.duration_us);
        }
        d
    };
    let base = run_with(1, 0.0);
    let a = run_with(1, 0.1);
    assert_eq!(a, run_with(1, 0.1), "same seed, same durations");
    assert_ne!(a, run_with(2, 0.1), "different seed, different durations");
    assert_ne!(a, base);
    for (x, b) in a.iter().zip(&base) {
        let r = *x as f64 / *b as f64;
        assert!((0.89..=1.11).contains(&r), "jittered {x} vs {b}");
    }
    assert!(
        Engine::new(EngineConfig {
            model: StepModel {
                jitter: 1.5,
                ..StepModel::default()
            },
            ..EngineConfig::default()
        })
        .is_err()
    );
}

/// The streaming form `add_request` used before: 64 ids at a time into a seeded `Xxh3`.
fn streaming_prompt_key(prompt: &[u32], seed: u64) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::with_seed(seed);
    let mut buf = [0u8; 256];
    for chunk in prompt.chunks(64) {
        for (i, t) in chunk.iter().enumerate() {
            buf[i * 4..i * 4 + 4].copy_from_slice(&t.to_le_bytes());
        }
        h.update(&buf[..chunk.len() * 4]);
    }
    h.digest()
}

#[test]
fn prompt_key_is_the_streaming_hash_it_replaced() {
    // Lengths either side of xxh3's short (≤16 B), mid (≤240 B) and long-input paths and of its
    // 1,024-byte stripes block, so generated tokens (and every seeded run) stay as they were.
    let mut scratch = Vec::new();
    for len in [
        0usize, 1, 3, 4, 15, 59, 60, 61, 64, 255, 256, 257, 1279, 2750, 9000,
    ] {
        let prompt: Vec<u32> = (0..len as u32)
            .map(|i| i.wrapping_mul(2_654_435_761) % 128_256)
            .collect();
        for seed in [0u64, 7, u64::MAX] {
            assert_eq!(
                prompt_key(&prompt, seed, &mut scratch),
                streaming_prompt_key(&prompt, seed),
                "len {len} seed {seed}"
            );
        }
    }
    // The bytes hashed are the ids' little-endian encoding.
    assert_eq!(
        prompt_key(&[1, 2, 3], 0, &mut scratch),
        xxh3_64_with_seed(&[1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0], 0)
    );
}

/// llama-slots with `slots` slots, similarity 0.1 and `ctx_tokens` cells; no frontend delay.
fn llama_cfg(slots: u32, ctx_tokens: u32) -> EngineConfig {
    EngineConfig {
        cache_model: CacheModel::LlamaSlots {
            slots,
            similarity: 0.1,
            ctx_tokens,
        },
        ..cfg(64)
    }
}

/// Runs one request alone to completion and returns (cached tokens, every token it decoded).
fn serve(
    e: &mut Engine,
    id: RequestId,
    prompt: Vec<u32>,
    max_tokens: u32,
    now: u64,
) -> (u32, Vec<u32>, u64) {
    let mut full = prompt.clone();
    e.add_request(id, prompt, params(max_tokens), now)
        .expect("ok");
    let (toks, now) = run(e, now);
    full.extend(
        toks.iter()
            .filter(|(_, t)| t.id == id)
            .map(|(_, t)| t.token),
    );
    (finished(&toks, id).cached_tokens, full, now)
}

#[test]
fn llama_slots_cache_the_prompt_and_all_but_the_last_generated_token() {
    let mut e = Engine::new(llama_cfg(4, 16384)).expect("valid");
    let (cached, conv, now) = serve(&mut e, 1, prompt(1, 100), 8, 0);
    assert_eq!(cached, 0);
    // The slot holds 100 + 7 tokens: the 8th generated token was never decoded.
    let slot = e
        .llama_slots()
        .unwrap()
        .slots()
        .iter()
        .find(|s| !s.tokens.is_empty())
        .unwrap();
    assert_eq!(slot.tokens, conv[..107]);
    // Next turn: the whole conversation plus a new user message.
    let mut next = conv.clone();
    next.extend(prompt(2, 50));
    let (cached, _, now) = serve(&mut e, 2, next, 4, now);
    assert_eq!(cached, 107, "token-exact prefix, not block-aligned");
    // The same prompt again: all but its last token.
    let (cached, _, _) = serve(&mut e, 3, prompt(7, 40), 1, now);
    assert_eq!(cached, 0);
    let (cached, _, _) = serve(&mut e, 4, prompt(7, 40), 1, now + 1_000_000);
    assert_eq!(cached, 39);
    let c = e.counters();
    assert_eq!(c.prefix_cache_hits_tokens, 107 + 39);
    let mut ev = Vec::new();
    e.take_events(&mut ev);
    assert!(ev.is_empty(), "llama.cpp publishes no KV events");
}

#[test]
fn llama_slots_bound_concurrency_and_least_recently_used_slots_are_overwritten() {
    let mut e = Engine::new(llama_cfg(2, 16384)).expect("valid");
    for id in 1..=3 {
        e.add_request(id, prompt(id as u32, 64), params(4), 0)
            .expect("ok");
    }
    let out = e.step(0);
    assert_eq!(out.admitted, vec![1, 2], "two slots: the third waits");
    assert_eq!(e.num_waiting(), 1);
    let (_, now) = run(&mut e, out.end_us());
    // Slots now hold conversations 3 (released last) and 1 or 2 (the one 3 did not overwrite).
    // A new conversation takes the least recently used slot, overwriting it.
    let (c, _, now) = serve(&mut e, 4, prompt(4, 64), 4, now);
    assert_eq!(c, 0);
    // Conversation 3's slot survived (it was the most recently used): a repeat hits.
    let (c3, _, now) = serve(&mut e, 5, prompt(3, 70), 1, now);
    assert_eq!(c3, 64);
    // Conversations 1 and 2 are both gone by now.
    let (c1, _, now) = serve(&mut e, 6, prompt(1, 70), 1, now);
    let (c2, _, _) = serve(&mut e, 7, prompt(2, 70), 1, now);
    assert_eq!((c1, c2), (0, 0));
}

#[test]
fn llama_slots_below_the_similarity_threshold_take_the_lru_slot() {
    let mut e = Engine::new(llama_cfg(2, 16384)).expect("valid");
    let (_, a, now) = serve(&mut e, 1, prompt(1, 20), 2, 0); // slot 1 (fresh: highest id)
    let (_, _, now) = serve(&mut e, 2, prompt(2, 20), 2, now); // slot 0
    // Conversation 1 grows by a huge message: its slot's 21 tokens are < 10% of 300, so the
    // request goes to the LRU slot — which is conversation 1's own (released first): a hit.
    let mut long = a.clone();
    long.extend(prompt(3, 279));
    let (c, _, now) = serve(&mut e, 3, long.clone(), 2, now);
    assert_eq!(c, 21);
    // Now conversation 2's slot is the LRU: conversation 1 again over the threshold finds its slot
    // by similarity even though it is the most recent.
    let mut more = long.clone();
    more.truncate(200);
    let (c, _, _) = serve(&mut e, 4, more, 1, now);
    assert_eq!(
        c,
        200 - 1,
        "prefix of the slot's sequence: all but the last token"
    );
}

#[test]
fn llama_slots_purge_idle_slots_when_the_unified_context_is_full() {
    let mut e = Engine::new(llama_cfg(3, 300)).expect("valid");
    let (_, _, now) = serve(&mut e, 1, prompt(1, 100), 1, 0); // slot 2
    let (_, _, now) = serve(&mut e, 2, prompt(2, 100), 1, now); // slot 1
    assert!((e.kv_usage() - 200.0 / 300.0).abs() < 1e-9);
    // 150 more tokens need room: the lowest-id idle slot holding tokens (1) is erased.
    let (_, _, now) = serve(&mut e, 3, prompt(3, 150), 1, now);
    let held: Vec<usize> = e
        .llama_slots()
        .unwrap()
        .slots()
        .iter()
        .map(|s| s.tokens.len())
        .collect();
    assert_eq!(held, vec![150, 0, 100]);
    assert!(e.kv_usage() <= 1.0);
    // Too long for the context at all: refused up front, naming the context length.
    assert!(matches!(
        e.add_request(9, prompt(9, 299), params(2), now),
        Err(AddError::TooLong {
            max_model_len: 300,
            ..
        })
    ));
}

#[test]
fn llama_slots_abort_keeps_the_computed_prefix_and_reset_erases_idle_slots() {
    let mut e = Engine::new(EngineConfig {
        max_num_batched_tokens: 64,
        ..llama_cfg(1, 16384)
    })
    .expect("valid");
    e.add_request(1, prompt(1, 200), params(4), 0).expect("ok");
    let out = e.step(0);
    assert_eq!(
        out.num_scheduled_tokens, 64,
        "chunked prefill within the batch budget"
    );
    assert!(!e.reset_prefix_cache(), "refused while a request runs");
    assert!(e.abort(1));
    assert_eq!(e.llama_slots().unwrap().slots()[0].tokens, prompt(1, 64));
    let (c, _, now) = serve(&mut e, 2, prompt(1, 100), 1, out.end_us());
    assert_eq!(c, 64);
    assert!(e.reset_prefix_cache());
    let (c, _, _) = serve(&mut e, 3, prompt(1, 100), 1, now);
    assert_eq!(c, 0);
}

/// The `llama-tiny` step model against the floors `scripts/llama_step_floors.py` measured on the
/// real llama-server over four runs (crates/engine-core README, "llama-tiny"; raw numbers in
/// docs/measurements/llama-step-floors/). Prefill floors are the server's own work per fresh
/// prompt, the least of llama.cpp's `timings.prompt_ms` and the server threads' CPU time less 4 ms
/// of HTTP: 105 tokens 21.7 ms, 278 → 61.3, 1,005 → 306.8, 2,005 → 892.7, 4,005 → 2,735.9; the
/// client's fastest re-sent 1,008-token prompt 8.35 ms to first token; inter-token gaps (client,
/// fastest p50) 1.15 ms at ~140 tokens of context, 2.41 ms at ~1,010, 4.05 ms at ~2,010 and 2.67 ms
/// for four streams at ~150.
#[test]
fn llama_tiny_floors_match_the_measured_llama_server() {
    let model = StepModel::llama_tiny();
    let frontend_ms = model.frontend_ms;
    let mut e = Engine::new(EngineConfig {
        cache_model: CacheModel::LLAMA_FLEET,
        max_model_len: 16384,
        model,
        ..EngineConfig::default()
    })
    .expect("valid");
    let within = |got: f64, want: f64, tol: f64| (got - want).abs() / want <= tol;
    let mut now = 1_000_000;
    let mut id = 0;
    // (first-token time, median gap) of one request alone.
    let mut one = |e: &mut Engine, p: Vec<u32>, max_tokens: u32| {
        id += 1;
        now += 10_000_000;
        e.add_request(id, p, params(max_tokens), now).expect("ok");
        let (toks, _) = run(e, now);
        let times: Vec<u64> = toks.iter().map(|(t, _)| *t).collect();
        let gaps: Vec<u64> = times.windows(2).map(|w| w[1] - w[0]).collect();
        let itl = gaps.get(gaps.len() / 2).map_or(0.0, |g| *g as f64 / 1000.0);
        ((times[0] - now) as f64 / 1000.0, itl)
    };
    let mut report = Vec::new();
    for (tag, n, floor_ms) in [
        (1, 105, 21.7),
        (2, 278, 61.3),
        (3, 1005, 306.8),
        (4, 2005, 892.7),
        (5, 4005, 2735.9),
    ] {
        let (ttft, _) = one(&mut e, prompt(tag, n), 1);
        let prefill = ttft - frontend_ms;
        report.push(format!("prefill {n}: {prefill:.1} ms"));
        assert!(
            within(prefill, floor_ms, 0.05),
            "prefill of {n} tokens {prefill} ms"
        );
    }
    let (_, itl_1010) = one(&mut e, prompt(6, 1008), 8);
    let (cached, _) = one(&mut e, prompt(6, 1008), 1);
    let (_, itl_140) = one(&mut e, prompt(7, 108), 64);
    let (_, itl_2010) = one(&mut e, prompt(8, 2008), 8);
    assert!(within(cached, 8.35, 0.10), "cached TTFT {cached} ms");
    assert!(
        within(itl_140, 1.15, 0.10),
        "ITL at ~140 tokens {itl_140} ms"
    );
    assert!(
        within(itl_1010, 2.41, 0.10),
        "ITL at ~1,010 tokens {itl_1010} ms"
    );
    assert!(
        within(itl_2010, 4.05, 0.10),
        "ITL at ~2,010 tokens {itl_2010} ms"
    );
    // Four streams decoding together.
    for k in 0..4 {
        e.add_request(
            100 + k,
            prompt(20 + k as u32, 108),
            params(64),
            now + 20_000_000,
        )
        .expect("ok");
    }
    let (toks, _) = run(&mut e, now + 20_000_000);
    let times: Vec<u64> = toks
        .iter()
        .filter(|(_, t)| t.id == 100)
        .map(|(t, _)| *t)
        .collect();
    let mut gaps: Vec<u64> = times.windows(2).map(|w| w[1] - w[0]).collect();
    gaps.sort_unstable();
    let itl_4 = gaps[gaps.len() / 2] as f64 / 1000.0;
    assert!(within(itl_4, 2.67, 0.15), "ITL of four streams {itl_4} ms");
    eprintln!(
        "llama-tiny: {}; cached TTFT {cached:.2} ms; ITL {itl_140:.2} / {itl_1010:.2} / \
         {itl_2010:.2} ms, four streams {itl_4:.2} ms",
        report.join(", ")
    );
}
