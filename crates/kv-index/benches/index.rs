//! `cargo bench -p kv-index`: lookup+insert of a 2,048-token prompt (128 blocks) against an index
//! of 100,000 nodes over 5 replicas, block insert throughput, bytes per node. Criterion measures
//! each; a summary table against the targets is printed at the end.

use criterion::{Criterion, Throughput};
use kv_index::hash::byte_block_keys;
use kv_index::{IndexConfig, Matches, PrefixIndex};
use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;
use std::hint::black_box;
use std::time::{Duration, Instant};

const NODES: usize = 100_000;
const REPLICAS: u32 = 5;
const BLOCKS: usize = 128;

fn random_chain(rng: &mut Pcg64Mcg, blocks: usize) -> Vec<u64> {
    let bytes: Vec<u8> = (0..blocks * 64).map(|_| rng.random()).collect();
    byte_block_keys(b"bench-model", &bytes, 64)
}

/// An index at exactly `NODES` nodes (its cap) built from 128-block conversations, and prompts
/// that continue them: 120 blocks already believed on the conversation's replica plus 8 new.
fn setup() -> (PrefixIndex, Vec<Vec<u64>>) {
    let mut rng = Pcg64Mcg::seed_from_u64(7);
    let mut idx = PrefixIndex::new(IndexConfig {
        node_cap: NODES,
        ttl_us: Some(60_000_000),
        ..IndexConfig::default()
    })
    .expect("config");
    let mut convs = Vec::new();
    let mut r = 0;
    while idx.len() < NODES {
        let c = random_chain(&mut rng, BLOCKS);
        idx.insert(r % REPLICAS, &c, 0).expect("insert");
        convs.push(c);
        r += 1;
    }
    let prompts = convs
        .iter()
        .map(|c| {
            let mut p = c[..120].to_vec();
            p.extend(random_chain(&mut rng, 8));
            p
        })
        .collect();
    (idx, prompts)
}

fn lookup_insert(idx: &mut PrefixIndex, m: &mut Matches, p: &[u64], now: u64) -> u32 {
    let chosen = idx
        .lookup_insert(p, now, m, |m| {
            let best = m.hits().iter().max_by_key(|h| h.1).map_or(0, |h| h.0);
            Some((best, false))
        })
        .expect("insert");
    chosen.unwrap_or(0)
}

fn median_ns(mut f: impl FnMut() -> u64, per_call: u64, rounds: usize) -> f64 {
    let mut v: Vec<f64> = (0..rounds)
        .map(|_| {
            let t = Instant::now();
            let n = f();
            t.elapsed().as_nanos() as f64 / (n * per_call) as f64
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();

    let (mut idx, prompts) = setup();
    let mut m = Matches::new();
    let mut i = 0usize;
    let mut now = 1u64;
    c.bench_function(
        "lookup_insert/128-block prompt, 100k nodes, 5 replicas",
        |b| {
            b.iter(|| {
                i = (i + 1) % prompts.len();
                now += 1;
                black_box(lookup_insert(&mut idx, &mut m, &prompts[i], now))
            })
        },
    );

    let mut g = c.benchmark_group("insert");
    g.throughput(Throughput::Elements(BLOCKS as u64));
    let mut rng = Pcg64Mcg::seed_from_u64(9);
    let fresh: Vec<Vec<u64>> = (0..2_000).map(|_| random_chain(&mut rng, BLOCKS)).collect();
    let (mut full, _) = setup();
    let mut j = 0usize;
    g.bench_function(
        "new 128-block chain into a full 100k-node index (evicting)",
        |b| {
            b.iter(|| {
                j = (j + 1) % fresh.len();
                now += 1;
                full.insert((j % 5) as u32, black_box(&fresh[j]), now)
                    .expect("insert");
            })
        },
    );
    g.finish();
    c.final_summary();

    // Summary table: medians of 15 rounds of 200 calls each, measured here in one run.
    let lookup_ns = median_ns(
        || {
            for _ in 0..200 {
                i = (i + 1) % prompts.len();
                now += 1;
                black_box(lookup_insert(&mut idx, &mut m, &prompts[i], now));
            }
            200
        },
        1,
        15,
    );
    let insert_ns = median_ns(
        || {
            for _ in 0..200 {
                j = (j + 1) % fresh.len();
                now += 1;
                full.insert((j % 5) as u32, &fresh[j], now).expect("insert");
            }
            200
        },
        BLOCKS as u64,
        15,
    );
    let s = idx.stats();
    let bytes_per_node = s.bytes as f64 / s.nodes as f64;
    println!();
    println!("| measure | median | target |");
    println!("|---|---|---|");
    println!(
        "| lookup+insert, 128-block prompt, {} nodes, 5 replicas | {:.2} µs | ≤ 3 µs |",
        s.nodes,
        lookup_ns / 1_000.0
    );
    println!(
        "| block inserts (new chains, index at cap, evicting) | {:.1} M/s | ≥ 5 M/s |",
        1_000.0 / insert_ns
    );
    println!(
        "| bytes per node ({} nodes, {} entries) | {:.1} B | ≤ 64 B |",
        s.nodes, s.entries, bytes_per_node
    );
}
