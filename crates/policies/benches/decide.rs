//! `cargo bench -p policies`: decision time per policy at 5 and 64 replicas, and prefix-affinity
//! from the prompt's bytes (block hashing + index lookup+insert + spill check) for a 2,048-token
//! (8 KiB) prompt. Criterion measures each; a summary table is printed at the end.

use criterion::Criterion;
use kv_index::KvEvent;
use kv_index::hash::{byte_block_keys, byte_block_keys_into, token_block_keys};
use policies::{POLICY_NAMES, Policy, PolicySpec, ReplicaView, RouteRequest, build};
use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;
use std::hint::black_box;
use std::time::{Duration, Instant};

const SESSIONS: usize = 800;
const PROMPT_BYTES: usize = 8 * 1024;
const SALT: &[u8] = b"bench-model";

struct Setup {
    fleet: Vec<ReplicaView>,
    sessions: Vec<String>,
    bytes: Vec<Vec<u8>>,
    keys: Vec<Vec<u64>>,
    tokens: Vec<Vec<u32>>,
    exact: Vec<Vec<u64>>,
}

fn setup(replicas: u32) -> Setup {
    let mut rng = Pcg64Mcg::seed_from_u64(replicas as u64);
    let fleet = (0..replicas)
        .map(|id| ReplicaView {
            outstanding: rng.random_range(0..8),
            ..ReplicaView::idle(id)
        })
        .collect();
    let bytes: Vec<Vec<u8>> = (0..SESSIONS)
        .map(|_| (0..PROMPT_BYTES).map(|_| rng.random()).collect())
        .collect();
    let keys = bytes.iter().map(|b| byte_block_keys(SALT, b, 64)).collect();
    let tokens: Vec<Vec<u32>> = (0..SESSIONS)
        .map(|_| (0..2048).map(|_| rng.random_range(0..128_000)).collect())
        .collect();
    let exact = tokens
        .iter()
        .map(|t| token_block_keys(SALT, t, 16))
        .collect();
    Setup {
        fleet,
        sessions: (0..SESSIONS).map(|s| format!("session-{s:06}")).collect(),
        bytes,
        keys,
        tokens,
        exact,
    }
}

fn make(name: &str, s: &Setup) -> Box<dyn Policy> {
    let spec = PolicySpec {
        salt: String::from_utf8_lossy(SALT).into_owned(),
        ..PolicySpec::named(name)
    };
    let mut p = build(&spec).expect("policy");
    // Warm the indexes: every session served once (belief), or reported by its engine (exact).
    for i in 0..SESSIONS {
        let r = s.fleet[i % s.fleet.len()].id;
        let req = request(s, i, 0);
        if name.starts_with("exact") {
            let ev = KvEvent::Stored {
                block_hashes: (0..128).map(|b| (i * 1000 + b) as u64).collect(),
                parent_block_hash: None,
                token_ids: s.tokens[i].clone(),
                block_size: 16,
                cache_salt: None,
            };
            p.on_kv_event(r, &ev, 0);
        } else {
            p.on_served(&req, r);
        }
    }
    p
}

fn request<'a>(s: &'a Setup, i: usize, now_us: u64) -> RouteRequest<'a> {
    RouteRequest {
        session_id: Some(&s.sessions[i]),
        block_keys: &s.keys[i],
        tokens_per_block: 16.0,
        now_us,
    }
}

fn keys_for<'a>(name: &str, s: &'a Setup, i: usize) -> &'a [u64] {
    if name.starts_with("exact") {
        &s.exact[i]
    } else {
        &s.keys[i]
    }
}

/// One decision for session `i`; the caller's part of the protocol (count it outstanding) is
/// left out so the fleet stays the same across iterations.
fn decide(p: &mut dyn Policy, name: &str, s: &Setup, i: usize, now_us: u64) -> u32 {
    let req = RouteRequest {
        block_keys: keys_for(name, s, i),
        ..request(s, i, now_us)
    };
    p.decide(&req, &s.fleet).expect("decision").replica
}

/// Prefix-affinity from the bytes: hash into a reused buffer, then decide.
fn decide_from_bytes(
    p: &mut dyn Policy,
    s: &Setup,
    bytes: &[u8],
    buf: &mut Vec<u64>,
    i: usize,
    now: u64,
) -> u32 {
    byte_block_keys_into(SALT, bytes, 64, buf);
    let req = RouteRequest {
        session_id: Some(&s.sessions[i]),
        block_keys: buf,
        tokens_per_block: 16.0,
        now_us: now,
    };
    p.decide(&req, &s.fleet).expect("decision").replica
}

/// Total time of `iters` decisions from bytes, each prompt first copied into a buffer outside the
/// timing: a router has just parsed the request, so its bytes are in cache.
fn hot_from_bytes(
    p: &mut dyn Policy,
    s: &Setup,
    hot: &mut [u8],
    buf: &mut Vec<u64>,
    first: usize,
    iters: u64,
) -> Duration {
    let mut total = Duration::ZERO;
    for k in 0..iters as usize {
        let i = (first + k) % SESSIONS;
        hot.copy_from_slice(&s.bytes[i]);
        let t = Instant::now();
        black_box(decide_from_bytes(p, s, hot, buf, i, (first + k) as u64));
        total += t.elapsed();
    }
    total
}

fn median_ns(mut one: impl FnMut(usize), rounds: usize, per_round: usize) -> f64 {
    let mut v: Vec<f64> = (0..rounds)
        .map(|r| {
            let t = Instant::now();
            for k in 0..per_round {
                one(r * per_round + k);
            }
            t.elapsed().as_nanos() as f64 / per_round as f64
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    let mut rows = Vec::new();
    for n in [5u32, 64] {
        let s = setup(n);
        for name in POLICY_NAMES {
            let mut p = make(name, &s);
            let mut i = 0;
            let mut now = 1;
            c.bench_function(&format!("decide/{name}/{n} replicas"), |b| {
                b.iter(|| {
                    i = (i + 1) % SESSIONS;
                    now += 1;
                    black_box(decide(p.as_mut(), name, &s, i, now))
                })
            });
            let ns = median_ns(
                |k| {
                    black_box(decide(
                        p.as_mut(),
                        name,
                        &s,
                        k % SESSIONS,
                        10_000 + k as u64,
                    ));
                },
                21,
                400,
            );
            rows.push((format!("{name} (keys given)"), n, ns));
        }
        let mut p = make("prefix-affinity", &s);
        let mut buf = Vec::new();
        let mut hot = vec![0u8; PROMPT_BYTES];
        let mut i = 0;
        let mut now = 1;
        c.bench_function(
            &format!("prefix-affinity from 8 KiB of bytes (cold)/{n} replicas"),
            |b| {
                b.iter(|| {
                    i = (i + 1) % SESSIONS;
                    now += 1;
                    black_box(decide_from_bytes(
                        p.as_mut(),
                        &s,
                        &s.bytes[i],
                        &mut buf,
                        i,
                        now,
                    ))
                })
            },
        );
        let mut first = 1_000_000;
        c.bench_function(
            &format!("prefix-affinity from 8 KiB of bytes (in cache)/{n} replicas"),
            |b| {
                b.iter_custom(|iters| {
                    first += iters as usize;
                    hot_from_bytes(p.as_mut(), &s, &mut hot, &mut buf, first, iters)
                })
            },
        );
        let cold_ns = median_ns(
            |k| {
                let i = k % SESSIONS;
                black_box(decide_from_bytes(
                    p.as_mut(),
                    &s,
                    &s.bytes[i],
                    &mut buf,
                    i,
                    10_000 + k as u64,
                ));
            },
            21,
            400,
        );
        let mut rounds: Vec<f64> = (0..21)
            .map(|r| {
                let d =
                    hot_from_bytes(p.as_mut(), &s, &mut hot, &mut buf, 2_000_000 + 400 * r, 400);
                d.as_nanos() as f64 / 400.0
            })
            .collect();
        rounds.sort_by(f64::total_cmp);
        let hot_ns = rounds[rounds.len() / 2];
        hot.copy_from_slice(&s.bytes[0]);
        let hash_ns = median_ns(
            |_| {
                byte_block_keys_into(SALT, black_box(&hot), 64, &mut buf);
                black_box(buf.len());
            },
            21,
            400,
        );
        rows.push((
            "hash 8 KiB (in cache) into 128 block keys".into(),
            n,
            hash_ns,
        ));
        rows.push((
            "prefix-affinity from 8 KiB prompt bytes in cache (hash + lookup+insert + spill)"
                .into(),
            n,
            hot_ns,
        ));
        rows.push((
            "prefix-affinity from 8 KiB prompt bytes, cold (read from a 6.4 MiB pool)".into(),
            n,
            cold_ns,
        ));
    }
    c.final_summary();

    println!();
    println!("| decision | 5 replicas | 64 replicas | target |");
    println!("|---|---|---|---|");
    let mut names: Vec<&String> = rows.iter().map(|r| &r.0).collect();
    names.dedup();
    let mut seen = std::collections::HashSet::new();
    for name in names {
        if !seen.insert(name.clone()) {
            continue;
        }
        let at = |n: u32| {
            rows.iter()
                .find(|r| &r.0 == name && r.1 == n)
                .map_or(f64::NAN, |r| r.2)
        };
        let target = if name.starts_with("prefix-affinity from 8 KiB prompt bytes in cache") {
            "≤ 5 µs"
        } else if name.starts_with("session-affinity") {
            "≤ 200 ns"
        } else {
            ""
        };
        let fmt = |ns: f64| {
            if ns >= 1_000.0 {
                format!("{:.2} µs", ns / 1_000.0)
            } else {
                format!("{ns:.0} ns")
            }
        };
        println!("| {name} | {} | {} | {target} |", fmt(at(5)), fmt(at(64)));
    }
}
