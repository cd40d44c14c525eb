//! Differential harness: seeded random streams of lookup / insert / speculative insert / forget /
//! time advance (expiry) / stored / removed / cleared / remove-replica operations, under a small
//! node cap (so eviction runs constantly), checked step by step against a deliberately simple
//! reference model (ordered maps and linear scans). On a mismatch the stream is shrunk and the
//! seed and minimal stream are printed. `harness_catches_a_planted_bug` proves the harness fails
//! on an index that forgets removals. `long_chains_match_reference_model` runs prompts of up to
//! 60 blocks under caps of 20–159 nodes: past the first 16 keys a lookup finds nodes by guessing
//! that a chain continues in neighbouring slots (ascending, or descending where new nodes took an
//! evicted tail's slots) before asking the hash table, and those streams check that path against
//! the model, through eviction, removal and slot reuse.

use kv_index::hash::{chain_token_keys, token_block_keys, token_salt_seed};
use kv_index::{IndexConfig, KvEvent, Matches, PrefixIndex};
use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;
use std::collections::{BTreeMap, BTreeSet, HashMap};

const BLOCK: usize = 4;
const SALT: &[u8] = b"diff-model";
const TTL: u64 = 1_000;
const SPEC_TTL: u64 = 300;
const REPLICAS: u32 = 4;

fn config(cap: usize, ttl: Option<u64>) -> IndexConfig {
    IndexConfig {
        node_cap: cap,
        ttl_us: ttl,
        speculative_ttl_us: SPEC_TTL,
        salt: SALT.to_vec(),
        tokens_per_block: BLOCK as u32,
    }
}

// ----- operations ----------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    Insert {
        replica: u32,
        prompt: usize,
        blocks: usize,
        speculative: bool,
    },
    LookupInsert {
        prompt: usize,
        blocks: usize,
        pick: usize,
        speculative: bool,
    },
    Lookup {
        prompt: usize,
        blocks: usize,
    },
    Forget {
        replica: u32,
        prompt: usize,
        blocks: usize,
    },
    Advance {
        us: u64,
    },
    Stored {
        replica: u32,
        prompt: usize,
        from: usize,
        to: usize,
    },
    Removed {
        replica: u32,
        prompt: usize,
        block: usize,
    },
    Cleared {
        replica: u32,
    },
    RemoveReplica {
        replica: u32,
    },
}

/// Prompts sharing prefixes, as multi-turn sessions and shared system prompts do.
struct World {
    tokens: Vec<Vec<u32>>,
    own: Vec<Vec<u64>>,
    engine: Vec<Vec<u64>>,
}

/// The size of a stream's world: prompt lengths and node caps.
#[derive(Clone, Copy)]
struct Shape {
    /// Longest prompt, in blocks.
    max_blocks: usize,
    /// Node caps are drawn from `min_cap..max_cap`.
    min_cap: usize,
    max_cap: usize,
}

/// Short prompts under tiny caps: eviction on nearly every insert.
const SHORT: Shape = Shape {
    max_blocks: 12,
    min_cap: 6,
    max_cap: 40,
};

/// Prompts longer than the index's 16-key lookahead, under caps that hold a few of them.
const LONG: Shape = Shape {
    max_blocks: 60,
    min_cap: 20,
    max_cap: 160,
};

impl World {
    fn new(rng: &mut Pcg64Mcg, max_blocks: usize) -> Self {
        let mut tokens: Vec<Vec<u32>> = Vec::new();
        for p in 0..8 {
            let mut t = if p > 0 && rng.random_bool(0.7) {
                let base = &tokens[rng.random_range(0..p)];
                let keep = rng.random_range(0..=base.len() / BLOCK) * BLOCK;
                base[..keep].to_vec()
            } else {
                Vec::new()
            };
            let target = rng.random_range(1..=max_blocks) * BLOCK;
            while t.len() < target {
                t.push(rng.random_range(0..5));
            }
            tokens.push(t);
        }
        let own = tokens
            .iter()
            .map(|t| token_block_keys(SALT, t, BLOCK))
            .collect();
        // Engine hashes differ from own keys (another salt), as vLLM's do.
        let engine = tokens
            .iter()
            .map(|t| token_block_keys(b"engine", t, BLOCK))
            .collect();
        World {
            tokens,
            own,
            engine,
        }
    }

    fn blocks(&self, p: usize) -> usize {
        self.own[p].len()
    }
}

fn gen_ops(rng: &mut Pcg64Mcg, world: &World, n: usize) -> Vec<Op> {
    (0..n)
        .map(|_| {
            let replica = rng.random_range(0..REPLICAS);
            let prompt = rng.random_range(0..world.tokens.len());
            let nb = world.blocks(prompt);
            let blocks = rng.random_range(0..=nb);
            match rng.random_range(0..100) {
                0..=19 => Op::Insert {
                    replica,
                    prompt,
                    blocks,
                    speculative: rng.random_bool(0.2),
                },
                20..=29 => Op::LookupInsert {
                    prompt,
                    blocks,
                    pick: rng.random_range(0..6),
                    speculative: rng.random_bool(0.2),
                },
                30..=44 => Op::Lookup { prompt, blocks },
                45..=49 => Op::Forget {
                    replica,
                    prompt,
                    blocks,
                },
                50..=59 => Op::Advance {
                    us: rng.random_range(0..400),
                },
                60..=79 => {
                    let from = rng.random_range(0..nb);
                    let to = rng.random_range(from..=nb);
                    Op::Stored {
                        replica,
                        prompt,
                        from,
                        to,
                    }
                }
                80..=95 => Op::Removed {
                    replica,
                    prompt,
                    block: rng.random_range(0..nb),
                },
                96..=98 => Op::Cleared { replica },
                _ => Op::RemoveReplica { replica },
            }
        })
        .collect()
}

// ----- the system under test, behind a trait so a planted bug can be swapped in ----------------

trait Backend {
    fn make(cfg: IndexConfig) -> Self;
    fn index(&mut self) -> &mut PrefixIndex;
    fn removed(&mut self, replica: u32, hashes: &[u64]) {
        self.index().removed(replica, hashes);
    }
}

impl Backend for PrefixIndex {
    fn make(cfg: IndexConfig) -> Self {
        PrefixIndex::new(cfg).expect("valid config")
    }
    fn index(&mut self) -> &mut PrefixIndex {
        self
    }
}

/// The planted bug: an index that ignores removal events.
struct ForgetsRemovals(PrefixIndex);

impl Backend for ForgetsRemovals {
    fn make(cfg: IndexConfig) -> Self {
        ForgetsRemovals(PrefixIndex::new(cfg).expect("valid config"))
    }
    fn index(&mut self) -> &mut PrefixIndex {
        &mut self.0
    }
    fn removed(&mut self, _: u32, _: &[u64]) {}
}

// ----- the reference model -------------------------------------------------------------------

#[derive(Debug)]
struct RefNode {
    parent: Option<u64>,
    children: usize,
    entries: BTreeMap<u32, (u64, bool)>,
    seq: u64,
}

/// The rules of `kv_index::index`, restated as plainly as possible.
struct Reference {
    cap: usize,
    ttl: Option<u64>,
    nodes: BTreeMap<u64, RefNode>,
    seq: u64,
    known: BTreeSet<u32>,
    engine: HashMap<u32, HashMap<u64, (u64, u32)>>,
}

impl Reference {
    fn new(cap: usize, ttl: Option<u64>) -> Self {
        Reference {
            cap,
            ttl,
            nodes: BTreeMap::new(),
            seq: 0,
            known: BTreeSet::new(),
            engine: HashMap::new(),
        }
    }

    fn alive(&self, (t, spec): (u64, bool), now: u64) -> bool {
        let age = now.saturating_sub(t);
        if spec {
            age <= SPEC_TTL
        } else {
            self.ttl.is_none_or(|ttl| age <= ttl)
        }
    }

    fn lookup(&self, keys: &[u64], now: u64) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        for &r in &self.known {
            let d = keys
                .iter()
                .take_while(|k| {
                    self.nodes
                        .get(k)
                        .and_then(|n| n.entries.get(&r))
                        .is_some_and(|&e| self.alive(e, now))
                })
                .count();
            if d > 0 {
                out.push((r, d as u32));
            }
        }
        out
    }

    fn reparent(&mut self, key: u64, parent: Option<u64>) {
        let old = self.nodes[&key].parent;
        if old != parent {
            if let Some(o) = old {
                self.nodes.get_mut(&o).unwrap().children -= 1;
            }
            if let Some(p) = parent {
                self.nodes.get_mut(&p).unwrap().children += 1;
            }
            self.nodes.get_mut(&key).unwrap().parent = parent;
        }
    }

    fn remove_node(&mut self, key: u64) {
        let n = self.nodes.remove(&key).unwrap();
        assert_eq!(n.children, 0, "reference: removing a node with children");
        if let Some(p) = n.parent {
            self.nodes.get_mut(&p).unwrap().children -= 1;
        }
    }

    fn place(&mut self, keys: &[u64], write_from: usize, replica: u32, spec: bool, now: u64) {
        self.known.insert(replica);
        let mut chain: Vec<u64> = Vec::new();
        for &k in keys.iter().take(self.cap) {
            if chain.contains(&k) {
                break;
            }
            if !self.nodes.contains_key(&k) {
                if self.nodes.len() >= self.cap {
                    let victim = *self
                        .nodes
                        .iter()
                        .filter(|(k, _)| !chain.contains(k))
                        .min_by_key(|(_, n)| n.seq)
                        .unwrap()
                        .0;
                    self.remove_node(victim);
                }
                self.nodes.insert(
                    k,
                    RefNode {
                        parent: None,
                        children: 0,
                        entries: BTreeMap::new(),
                        seq: 0,
                    },
                );
            }
            self.reparent(k, chain.last().copied());
            chain.push(k);
        }
        for &k in chain.iter().skip(write_from) {
            let old = self.nodes[&k].entries.get(&replica).copied();
            let keep = spec && old.is_some_and(|e| !e.1 && self.alive(e, now));
            if !keep {
                self.nodes
                    .get_mut(&k)
                    .unwrap()
                    .entries
                    .insert(replica, (now, spec));
            }
        }
        for &k in chain.iter().rev() {
            self.seq += 1;
            self.nodes.get_mut(&k).unwrap().seq = self.seq;
        }
    }

    fn reclaim_from(&mut self, mut k: u64) {
        while let Some(n) = self.nodes.get(&k) {
            if !n.entries.is_empty() || n.children > 0 {
                return;
            }
            let parent = n.parent;
            self.remove_node(k);
            match parent {
                Some(p) => k = p,
                None => return,
            }
        }
    }

    fn drop_replica_entries(&mut self, replica: u32) {
        for n in self.nodes.values_mut() {
            n.entries.remove(&replica);
        }
        while let Some(k) = self
            .nodes
            .iter()
            .find(|(_, n)| n.entries.is_empty() && n.children == 0)
            .map(|(k, _)| *k)
        {
            self.remove_node(k);
        }
    }

    fn forget(&mut self, replica: u32, keys: &[u64]) {
        if !self.known.contains(&replica) {
            return;
        }
        for &k in keys {
            if let Some(n) = self.nodes.get_mut(&k) {
                n.entries.remove(&replica);
                self.reclaim_from(k);
            }
        }
    }

    fn stored(
        &mut self,
        replica: u32,
        parent: Option<u64>,
        hashes: &[u64],
        tokens: &[u32],
        now: u64,
    ) -> bool {
        if parent.is_some() && !self.known.contains(&replica) {
            return false;
        }
        let map = self.engine.entry(replica).or_default();
        let parent_key = match parent {
            None => None,
            Some(h) => match map.get(&h) {
                Some(&(own, _)) => Some(own),
                None => return false,
            },
        };
        let mut keys = Vec::new();
        if let Some(pk) = parent_key {
            let mut k = Some(pk);
            while let Some(key) = k {
                let Some(n) = self.nodes.get(&key) else { break };
                keys.push(key);
                k = n.parent;
            }
            keys.reverse();
        }
        let ancestors = keys.len();
        chain_token_keys(
            parent_key.unwrap_or_else(|| token_salt_seed(SALT)),
            tokens,
            BLOCK,
            &mut keys,
        );
        let map = self.engine.entry(replica).or_default();
        for (&h, &own) in hashes.iter().zip(&keys[ancestors..]) {
            let e = map.entry(h).or_insert((own, 0));
            e.0 = own;
            e.1 += 1;
        }
        self.place(&keys, ancestors, replica, false, now);
        true
    }

    fn removed(&mut self, replica: u32, hashes: &[u64]) {
        if !self.known.contains(&replica) {
            return;
        }
        for h in hashes {
            let map = self.engine.entry(replica).or_default();
            let Some(e) = map.get_mut(h) else { continue };
            e.1 -= 1;
            if e.1 > 0 {
                continue;
            }
            let own = e.0;
            map.remove(h);
            if let Some(n) = self.nodes.get_mut(&own) {
                n.entries.remove(&replica);
                self.reclaim_from(own);
            }
        }
    }

    fn cleared(&mut self, replica: u32) {
        if self.known.contains(&replica) {
            self.engine.remove(&replica);
            self.drop_replica_entries(replica);
        }
    }

    fn remove_replica(&mut self, replica: u32) {
        if self.known.remove(&replica) {
            self.engine.remove(&replica);
            self.drop_replica_entries(replica);
        }
    }

    fn entries(&self) -> usize {
        self.nodes.values().map(|n| n.entries.len()).sum()
    }
}

// ----- running a stream ----------------------------------------------------------------------

struct Case {
    world: World,
    cap: usize,
    ttl: Option<u64>,
}

/// What a stream exercised (so the test can show it is not vacuous).
#[derive(Default, Debug)]
struct Coverage {
    evictions: u64,
    hit_lookups: u64,
    stored_ok: u64,
    stored_refused: u64,
    overflowed: u64,
    /// Full-prompt lookups that matched more than 16 blocks (past the first lookahead chunk).
    deep_hits: u64,
}

fn run<B: Backend>(case: &Case, ops: &[Op]) -> Result<Coverage, String> {
    let mut cov = Coverage::default();
    let w = &case.world;
    let mut sut = B::make(config(case.cap, case.ttl));
    let mut reference = Reference::new(case.cap, case.ttl);
    let mut now = 0u64;
    let mut m = Matches::new();
    for (step, op) in ops.iter().enumerate() {
        let fail = |what: String| Err(format!("step {step} ({op:?}): {what}"));
        match *op {
            Op::Insert {
                replica,
                prompt,
                blocks,
                speculative,
            } => {
                let keys = &w.own[prompt][..blocks];
                let r = if speculative {
                    sut.index().insert_speculative(replica, keys, now)
                } else {
                    sut.index().insert(replica, keys, now)
                };
                if r.is_err() {
                    return fail(format!("insert refused: {r:?}"));
                }
                reference.place(keys, 0, replica, speculative, now);
            }
            Op::LookupInsert {
                prompt,
                blocks,
                pick,
                speculative,
            } => {
                let keys = &w.own[prompt][..blocks];
                let want = reference.lookup(keys, now);
                // Pick among the hits when there are any, else a replica by number.
                let choice = want
                    .get(pick)
                    .map(|&(r, _)| r)
                    .unwrap_or(pick as u32 % REPLICAS);
                let mut seen = Vec::new();
                let got = sut.index().lookup_insert(keys, now, &mut m, |mm| {
                    seen = mm.hits().to_vec();
                    Some((choice, speculative))
                });
                if got != Ok(Some(choice)) {
                    return fail(format!("lookup_insert returned {got:?}"));
                }
                if seen != want {
                    return fail(format!("lookup_insert saw {seen:?}, reference {want:?}"));
                }
                reference.place(keys, 0, choice, speculative, now);
            }
            Op::Lookup { prompt, blocks } => {
                let keys = &w.own[prompt][..blocks];
                sut.index().lookup(keys, now, &mut m);
                let want = reference.lookup(keys, now);
                if m.hits() != want.as_slice() {
                    return fail(format!("lookup {:?}, reference {want:?}", m.hits()));
                }
                cov.hit_lookups += u64::from(!want.is_empty());
            }
            Op::Forget {
                replica,
                prompt,
                blocks,
            } => {
                let keys = &w.own[prompt][..blocks];
                sut.index().forget(replica, keys);
                reference.forget(replica, keys);
            }
            Op::Advance { us } => now += us,
            Op::Stored {
                replica,
                prompt,
                from,
                to,
            } => {
                let event = KvEvent::Stored {
                    block_hashes: w.engine[prompt][from..to].to_vec(),
                    parent_block_hash: (from > 0).then(|| w.engine[prompt][from - 1]),
                    token_ids: w.tokens[prompt][from * BLOCK..to * BLOCK].to_vec(),
                    block_size: BLOCK as u32,
                    cache_salt: None,
                };
                let got = sut.index().apply_event(replica, &event, now).is_ok();
                if got {
                    cov.stored_ok += 1;
                } else {
                    cov.stored_refused += 1;
                }
                let KvEvent::Stored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    ..
                } = &event
                else {
                    unreachable!()
                };
                let want =
                    reference.stored(replica, *parent_block_hash, block_hashes, token_ids, now);
                if got != want {
                    return fail(format!("stored accepted={got}, reference accepted={want}"));
                }
            }
            Op::Removed {
                replica,
                prompt,
                block,
            } => {
                let h = [w.engine[prompt][block]];
                sut.removed(replica, &h);
                reference.removed(replica, &h);
            }
            Op::Cleared { replica } => {
                sut.index().cleared(replica);
                reference.cleared(replica);
            }
            Op::RemoveReplica { replica } => {
                sut.index().remove_replica(replica);
                reference.remove_replica(replica);
            }
        }
        let stats = sut.index().stats();
        cov.evictions = stats.evictions;
        cov.overflowed += stats.replicas_per_node.iter().skip(4).sum::<usize>() as u64;
        if stats.nodes > case.cap {
            return fail(format!("{} nodes over the cap {}", stats.nodes, case.cap));
        }
        if stats.nodes != reference.nodes.len() || stats.entries != reference.entries() {
            return fail(format!(
                "{} nodes / {} entries, reference {} / {}",
                stats.nodes,
                stats.entries,
                reference.nodes.len(),
                reference.entries()
            ));
        }
        // Every prompt, in full, every step: divergence shows up where it starts.
        for (p, keys) in w.own.iter().enumerate() {
            sut.index().lookup(keys, now, &mut m);
            let want = reference.lookup(keys, now);
            cov.deep_hits += u64::from(m.longest() > 16);
            if m.hits() != want.as_slice() {
                return fail(format!(
                    "full lookup of prompt {p}: {:?}, reference {want:?}",
                    m.hits()
                ));
            }
        }
    }
    Ok(cov)
}

/// Greedy delta-debugging: drop chunks of the stream while it still fails.
fn shrink<B: Backend>(case: &Case, mut ops: Vec<Op>) -> Vec<Op> {
    let mut chunk = ops.len() / 2;
    while chunk >= 1 {
        let mut i = 0;
        while i < ops.len() {
            let mut candidate = ops.clone();
            candidate.drain(i..(i + chunk).min(ops.len()));
            if run::<B>(case, &candidate).is_err() {
                ops = candidate;
            } else {
                i += chunk;
            }
        }
        chunk /= 2;
    }
    ops
}

/// Runs `streams` seeded streams; on the first failure returns the seed, the error and the shrunk
/// stream.
fn check<B: Backend>(
    first_seed: u64,
    streams: u64,
    len: usize,
    shape: Shape,
) -> Result<Coverage, (u64, String, Vec<Op>)> {
    let mut total = Coverage::default();
    for seed in first_seed..first_seed + streams {
        let mut rng = Pcg64Mcg::seed_from_u64(seed);
        let world = World::new(&mut rng, shape.max_blocks);
        let cap = rng.random_range(shape.min_cap..shape.max_cap);
        let ttl = if rng.random_bool(0.5) {
            Some(TTL)
        } else {
            None
        };
        let case = Case { world, cap, ttl };
        let ops = gen_ops(&mut rng, &case.world, len);
        match run::<B>(&case, &ops) {
            Ok(c) => {
                total.evictions += c.evictions;
                total.hit_lookups += c.hit_lookups;
                total.stored_ok += c.stored_ok;
                total.stored_refused += c.stored_refused;
                total.overflowed += c.overflowed;
                total.deep_hits += c.deep_hits;
            }
            Err(_) => {
                let small = shrink::<B>(&case, ops);
                let err = run::<B>(&case, &small).expect_err("shrunk stream still fails");
                return Err((seed, err, small));
            }
        }
    }
    Ok(total)
}

#[test]
fn index_matches_reference_model() {
    match check::<PrefixIndex>(1, 300, 400, SHORT) {
        Err((seed, err, ops)) => panic!(
            "differential failure at seed {seed}: {err}\nshrunk stream ({} ops):\n{ops:#?}",
            ops.len()
        ),
        Ok(cov) => {
            // The streams must exercise every mechanism, or agreement proves little.
            assert!(cov.evictions > 1_000, "{cov:?}");
            assert!(cov.hit_lookups > 1_000, "{cov:?}");
            assert!(cov.stored_ok > 1_000 && cov.stored_refused > 100, "{cov:?}");
            assert!(cov.overflowed > 0, "{cov:?}");
        }
    }
}

#[test]
fn harness_catches_a_planted_bug() {
    let (seed, err, ops) = check::<ForgetsRemovals>(1, 300, 400, SHORT)
        .expect_err("the harness must notice an index that forgets removals");
    assert!(
        ops.iter().any(|op| matches!(op, Op::Removed { .. })),
        "seed {seed}: {err}"
    );
    assert!(ops.len() <= 8, "shrinking left {} ops: {ops:#?}", ops.len());
}

#[test]
fn long_chains_match_reference_model() {
    match check::<PrefixIndex>(1_000, 120, 300, LONG) {
        Err((seed, err, ops)) => panic!(
            "differential failure at seed {seed} (long chains): {err}\nshrunk stream ({} ops):\n{ops:#?}",
            ops.len()
        ),
        Ok(cov) => {
            assert!(cov.evictions > 1_000, "{cov:?}");
            assert!(cov.hit_lookups > 1_000, "{cov:?}");
            assert!(cov.deep_hits > 10_000, "{cov:?}");
            assert!(cov.stored_ok > 500 && cov.stored_refused > 50, "{cov:?}");
        }
    }
}
