//! One test per rule of the index (see `src/index.rs`).

use kv_index::hash::{byte_block_keys, cache_salted, token_block_keys};
use kv_index::{IndexConfig, IndexError, KvEvent, Matches, PrefixIndex};

fn keys(seed: u8, blocks: usize) -> Vec<u64> {
    let bytes: Vec<u8> = (0..blocks * 64)
        .map(|i| (i as u8).wrapping_mul(seed))
        .collect();
    byte_block_keys(&[seed], &bytes, 64)
}

fn belief(cap: usize, ttl_us: u64) -> PrefixIndex {
    PrefixIndex::new(IndexConfig {
        node_cap: cap,
        ttl_us: Some(ttl_us),
        ..IndexConfig::default()
    })
    .unwrap()
}

fn exact() -> PrefixIndex {
    PrefixIndex::new(IndexConfig {
        node_cap: 1_000,
        ttl_us: None,
        speculative_ttl_us: 2_000,
        salt: b"model".to_vec(),
        tokens_per_block: 4,
    })
    .unwrap()
}

fn hits(idx: &PrefixIndex, k: &[u64], now: u64) -> Vec<(u32, u32)> {
    let mut m = Matches::new();
    idx.lookup(k, now, &mut m);
    m.hits().to_vec()
}

#[test]
fn lookup_counts_leading_blocks_per_replica_and_stops_at_first_miss() {
    let mut idx = belief(100, 1_000);
    let a = keys(3, 8);
    idx.insert(0, &a[..8], 0).unwrap();
    idx.insert(1, &a[..3], 0).unwrap();
    assert_eq!(hits(&idx, &a, 1), vec![(0, 8), (1, 3)]);
    // A prompt that diverges after block 5 matches only its common prefix.
    let mut b = a[..5].to_vec();
    b.extend(keys(9, 3));
    assert_eq!(hits(&idx, &b, 1), vec![(0, 5), (1, 3)]);
    // Replica 2 holds blocks 1.. but not block 0: it matches nothing.
    idx.insert(2, &a[..1], 0).unwrap();
    idx.forget(2, &a[..1]);
    assert_eq!(hits(&idx, &a, 1), vec![(0, 8), (1, 3)]);
    let mut m = Matches::new();
    idx.lookup(&a, 1, &mut m);
    assert_eq!(
        (m.blocks(0), m.blocks(1), m.blocks(7), m.longest()),
        (8, 3, 0, 8)
    );
}

#[test]
fn ttl_slides_per_replica_and_node_and_lookup_does_not_refresh() {
    let mut idx = belief(100, 1_000);
    let a = keys(5, 4);
    idx.insert(0, &a, 0).unwrap();
    idx.insert(1, &a[..2], 500).unwrap();
    assert_eq!(
        hits(&idx, &a, 1_000),
        vec![(0, 4), (1, 2)],
        "age == ttl is still live"
    );
    assert_eq!(
        hits(&idx, &a, 1_001),
        vec![(1, 2)],
        "replica 0 expired, replica 1 did not"
    );
    // Reuse refreshes: replica 1 re-inserts at 1_400, so its entries live until 2_400.
    idx.insert(1, &a[..2], 1_400).unwrap();
    assert_eq!(hits(&idx, &a, 2_400), vec![(1, 2)]);
    assert_eq!(hits(&idx, &a, 2_401), vec![]);
    // A lookup never refreshes.
    let mut idx = belief(100, 1_000);
    idx.insert(0, &a, 0).unwrap();
    for t in (0..=1_000).step_by(100) {
        assert_eq!(hits(&idx, &a, t), vec![(0, 4)]);
    }
    assert_eq!(hits(&idx, &a, 1_001), vec![]);
}

#[test]
fn node_cap_evicts_least_recent_leaves_tail_before_head() {
    let mut idx = belief(10, u64::MAX / 4);
    let a = keys(7, 10);
    idx.insert(0, &a, 0).unwrap();
    assert_eq!(idx.len(), 10);
    let b = keys(11, 3);
    idx.insert(1, &b, 1).unwrap();
    assert_eq!(idx.len(), 10);
    // The older chain lost its last three blocks, not its head.
    assert_eq!(hits(&idx, &a, 2), vec![(0, 7)]);
    assert!(idx.contains_key(a[0]) && !idx.contains_key(a[9]) && !idx.contains_key(a[7]));
    assert_eq!(hits(&idx, &b, 2), vec![(1, 3)]);
    assert_eq!(idx.stats().evictions, 3);
    // Touching `a` again makes `b` the oldest: it goes next, tail first.
    idx.insert(0, &a[..7], 3).unwrap();
    idx.insert(2, &keys(13, 1), 4).unwrap();
    assert_eq!(hits(&idx, &b, 5), vec![(1, 2)]);
}

#[test]
fn a_chain_longer_than_the_cap_keeps_its_head() {
    let mut idx = belief(4, 1_000);
    let a = keys(17, 9);
    idx.insert(0, &a, 0).unwrap();
    assert_eq!(idx.len(), 4);
    assert_eq!(hits(&idx, &a, 0), vec![(0, 4)]);
}

#[test]
fn memory_never_grows_past_the_cap_whatever_the_input() {
    let cap = 1_000;
    let mut idx = belief(cap, 1_000_000);
    // Random unrelated keys, long chains, a key shared by every chain at different depths
    // (re-parented each time), repeats inside a chain, many replicas, forgets.
    let mut x = 0x1234_5678_9abc_def0u64;
    for round in 0..2_000u64 {
        let chain: Vec<u64> = (0..(round % 97) as usize + 1)
            .map(|i| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                if i == (round % 40) as usize { 42 } else { x }
            })
            .collect();
        idx.insert((round % 37) as u32, &chain, round).unwrap();
        if round % 7 == 0 {
            idx.forget(((round + 3) % 37) as u32, &chain);
        }
        let s = idx.stats();
        assert!(s.nodes <= cap);
        // Nodes and table scale with the cap; only entries beyond three per node add memory.
        let extra: usize = s
            .replicas_per_node
            .iter()
            .enumerate()
            .skip(4)
            .map(|(k, n)| n * (k * 8 + 24))
            .sum();
        let bound = cap * (48 + 14) + extra + 96 * 1024;
        assert!(
            s.bytes <= bound,
            "round {round}: {} bytes > {bound}",
            s.bytes
        );
    }
    assert_eq!(idx.len(), cap);
}

#[test]
fn repeated_key_truncates_the_chain() {
    let mut idx = belief(100, 1_000);
    let a = keys(19, 3);
    let chain = [a[0], a[1], a[0], a[2]];
    idx.insert(0, &chain, 0).unwrap();
    assert_eq!(idx.len(), 2);
    assert!(
        !idx.contains_key(a[2]),
        "nothing after the repeat is inserted"
    );
    // Lookups stay literal: the repeated key's node does hold replica 0.
    assert_eq!(hits(&idx, &chain, 0), vec![(0, 3)]);
}

#[test]
fn forgetting_reclaims_empty_leaf_nodes_only() {
    let mut idx = belief(100, 1_000);
    let a = keys(23, 6);
    idx.insert(0, &a, 0).unwrap();
    idx.insert(1, &a[..2], 0).unwrap();
    idx.forget(0, &a[2..]);
    assert_eq!(
        idx.len(),
        2,
        "blocks 2..6 held only by replica 0 are reclaimed"
    );
    idx.forget(0, &a[..2]);
    assert_eq!(idx.len(), 2, "replica 1 still holds blocks 0..2");
    idx.forget(1, &a[1..2]);
    assert_eq!(idx.len(), 1);
    idx.remove_replica(1);
    assert!(idx.is_empty());
}

#[test]
fn lookup_insert_is_lookup_then_insert_in_one_descent() {
    let a = keys(29, 12);
    let mut one = belief(100, 1_000);
    let mut two = belief(100, 1_000);
    for idx in [&mut one, &mut two] {
        idx.insert(0, &a[..5], 0).unwrap();
        idx.insert(1, &a[..9], 0).unwrap();
    }
    let mut m = Matches::new();
    let chosen = one
        .lookup_insert(&a, 10, &mut m, |m| {
            assert_eq!(m.hits(), &[(0, 5), (1, 9)]);
            Some((2, false))
        })
        .unwrap();
    assert_eq!(chosen, Some(2));
    two.insert(2, &a, 10).unwrap();
    assert_eq!(hits(&one, &a, 11), hits(&two, &a, 11));
    assert_eq!(one.stats(), two.stats());
    // Choosing nobody inserts nothing.
    let b = keys(31, 3);
    assert_eq!(one.lookup_insert(&b, 12, &mut m, |_| None), Ok(None));
    assert!(!one.contains_key(b[0]));
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> KvEvent {
    KvEvent::Stored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: tokens.to_vec(),
        block_size: 4,
        cache_salt: None,
    }
}

#[test]
fn events_map_engine_hashes_to_own_keys_re_derived_from_tokens() {
    let mut idx = exact();
    let tokens: Vec<u32> = (100..124).collect(); // 6 blocks of 4
    let own = token_block_keys(b"model", &tokens, 4);
    // The engine reports the chain in two runs with its own (arbitrary) hashes.
    idx.apply_event(3, &stored(&[901, 902], None, &tokens[..8]), 0)
        .unwrap();
    idx.apply_event(3, &stored(&[903, 904, 905], Some(902), &tokens[8..20]), 0)
        .unwrap();
    assert_eq!(
        hits(&idx, &own, u64::MAX / 8),
        vec![(3, 5)],
        "confirmed entries never expire"
    );
    // Removal of block 3 by engine hash cuts the match there.
    idx.apply_event(
        3,
        &KvEvent::Removed {
            block_hashes: vec![904],
        },
        0,
    )
    .unwrap();
    assert_eq!(hits(&idx, &own, 1), vec![(3, 3)]);
    idx.apply_event(3, &KvEvent::AllCleared, 0).unwrap();
    assert_eq!(hits(&idx, &own, 1), vec![]);
    assert!(idx.is_empty(), "cleared nodes are reclaimed");
    assert_eq!(idx.stats().engine_hashes, 0);
}

fn with_salt(mut ev: KvEvent, salt: &str) -> KvEvent {
    if let KvEvent::Stored { cache_salt, .. } = &mut ev {
        *cache_salt = Some(salt.to_string());
    }
    ev
}

#[test]
fn a_salted_run_is_keyed_apart_from_the_same_tokens_unsalted() {
    let mut idx = exact();
    let tokens: Vec<u32> = (100..112).collect(); // 3 blocks of 4
    let plain = token_block_keys(b"model", &tokens, 4);
    let salted = token_block_keys(&cache_salted(b"model", Some(b"tenant-a")), &tokens, 4);
    // Replica 1 stored the salted chain in two runs; only block 0's run names the salt, and
    // a run with a parent inherits the chain whatever salt it names.
    let run0 = with_salt(stored(&[11], None, &tokens[..4]), "tenant-a");
    idx.apply_event(1, &run0, 0).unwrap();
    idx.apply_event(1, &stored(&[12, 13], Some(11), &tokens[4..]), 0)
        .unwrap();
    idx.apply_event(0, &stored(&[21, 22, 23], None, &tokens), 0)
        .unwrap();
    assert_eq!(hits(&idx, &salted, 1), vec![(1, 3)]);
    assert_eq!(hits(&idx, &plain, 1), vec![(0, 3)]);
    // An empty salt is no salt (vLLM tests `if request.cache_salt`).
    let empty = with_salt(stored(&[31], None, &tokens[..4]), "");
    idx.apply_event(2, &empty, 0).unwrap();
    assert_eq!(hits(&idx, &plain, 1), vec![(0, 3), (2, 1)]);
}

#[test]
fn a_block_stored_twice_needs_two_removals() {
    let mut idx = exact();
    let tokens: Vec<u32> = (0..8).collect();
    let own = token_block_keys(b"model", &tokens, 4);
    idx.stored(0, None, &[7, 8], &tokens, 4, 0).unwrap();
    idx.stored(0, None, &[7, 8], &tokens, 4, 0).unwrap();
    idx.removed(0, &[8]);
    assert_eq!(hits(&idx, &own, 0), vec![(0, 2)]);
    idx.removed(0, &[8]);
    assert_eq!(hits(&idx, &own, 0), vec![(0, 1)]);
}

#[test]
fn bad_events_are_refused_and_change_nothing() {
    let mut idx = exact();
    let t: Vec<u32> = (0..8).collect();
    assert_eq!(
        idx.stored(0, Some(5), &[1, 2], &t, 4, 0),
        Err(IndexError::UnknownParent(5))
    );
    idx.stored(0, None, &[1], &t[..4], 4, 0).unwrap();
    assert_eq!(
        idx.stored(0, Some(99), &[2], &t[4..], 4, 0),
        Err(IndexError::UnknownParent(99))
    );
    assert_eq!(
        idx.stored(0, None, &[1, 2], &t, 16, 0),
        Err(IndexError::BlockSizeMismatch {
            expected: 4,
            got: 16
        })
    );
    assert_eq!(
        idx.stored(0, None, &[1, 2], &t[..7], 4, 0),
        Err(IndexError::TokenCountMismatch {
            blocks: 2,
            tokens: 7
        })
    );
    assert_eq!(idx.len(), 1);
    // Unknown replicas and hashes are ignored.
    idx.removed(9, &[1]);
    idx.removed(0, &[12345]);
    idx.cleared(9);
    idx.remove_replica(9);
    assert_eq!(idx.len(), 1);
    assert!(IndexError::UnknownParent(5).to_string().contains("0x5"));
}

#[test]
fn stored_touches_ancestors_so_a_shared_head_outlives_its_tails() {
    let mut idx = PrefixIndex::new(IndexConfig {
        node_cap: 4,
        ttl_us: None,
        salt: b"model".to_vec(),
        tokens_per_block: 4,
        ..IndexConfig::default()
    })
    .unwrap();
    let head: Vec<u32> = (0..4).collect();
    idx.stored(0, None, &[1], &head, 4, 0).unwrap();
    // Three different continuations of the same head, one after the other, under a cap of 4.
    for (h, first) in [(2u64, 10u32), (3, 20), (4, 30), (5, 40)] {
        let t: Vec<u32> = (first..first + 4).collect();
        idx.stored(0, Some(1), &[h], &t, 4, 0).unwrap();
    }
    let own_head = token_block_keys(b"model", &head, 4);
    assert!(
        idx.contains_key(own_head[0]),
        "the shared head must not be evicted first"
    );
    assert_eq!(idx.len(), 4);
}

#[test]
fn speculative_entries_expire_unless_confirmed_and_never_downgrade_confirmed() {
    let mut idx = exact();
    let tokens: Vec<u32> = (0..12).collect();
    let own = token_block_keys(b"model", &tokens, 4);
    idx.insert_speculative(1, &own, 0).unwrap();
    assert_eq!(hits(&idx, &own, 2_000), vec![(1, 3)]);
    assert_eq!(hits(&idx, &own, 2_001), vec![], "speculative TTL passed");
    // Speculative again, then the engine confirms the first two blocks.
    idx.insert_speculative(1, &own, 3_000).unwrap();
    idx.stored(1, None, &[50, 51], &tokens[..8], 4, 3_100)
        .unwrap();
    assert_eq!(
        hits(&idx, &own, 10_000),
        vec![(1, 2)],
        "confirmed blocks stay"
    );
    // A later speculative insert does not turn confirmed entries back into speculative ones.
    idx.insert_speculative(1, &own, 20_000).unwrap();
    assert_eq!(hits(&idx, &own, 30_000), vec![(1, 2)]);
    // A removal drops a confirmed entry.
    idx.removed(1, &[51]);
    assert_eq!(hits(&idx, &own, 30_000), vec![(1, 1)]);
}

#[test]
fn many_replicas_per_node_overflow_inline_storage() {
    let mut idx = belief(100, 1_000);
    let a = keys(37, 3);
    for r in 0..64 {
        idx.insert(r * 3, &a[..(r as usize % 3) + 1], 0).unwrap();
    }
    let h = hits(&idx, &a, 0);
    assert_eq!(h.len(), 64);
    assert!(h.iter().all(|&(r, b)| b == (r / 3) % 3 + 1));
    for r in 0..64 {
        idx.remove_replica(r * 3);
        assert_eq!(hits(&idx, &a, 0).len(), 63 - r as usize);
    }
    assert!(idx.is_empty());
    let s = idx.stats();
    assert_eq!((s.nodes, s.entries, s.replicas), (0, 0, 0));
}

#[test]
fn replica_slots_are_reused_after_removal() {
    let mut idx = belief(100, 1_000);
    let a = keys(41, 2);
    for r in 0..10_000u32 {
        idx.insert(r, &a, 0).unwrap();
        idx.remove_replica(r);
    }
    assert_eq!(idx.stats().replicas, 0);
    idx.insert(77, &a, 0).unwrap();
    assert_eq!(hits(&idx, &a, 0), vec![(77, 2)]);
}

#[test]
fn stats_report_distribution_and_bytes() {
    let mut idx = belief(1_000, 1_000);
    let a = keys(43, 4);
    idx.insert(0, &a, 0).unwrap();
    idx.insert(1, &a[..2], 0).unwrap();
    let s = idx.stats();
    assert_eq!((s.nodes, s.entries, s.replicas), (4, 6, 2));
    assert_eq!(&s.replicas_per_node[..3], &[0, 2, 2]);
    assert!(s.bytes > 4 * 48);
}

#[test]
fn bytes_per_node_stay_under_64_at_100k_nodes_over_5_replicas() {
    let mut idx = belief(200_000, 1_000_000);
    let mut made = 0;
    let mut p = 0u8;
    while idx.len() < 100_000 {
        p = p.wrapping_add(1);
        let bytes: Vec<u8> = (0..128 * 64)
            .map(|i| (i as u8) ^ p ^ (made as u8))
            .collect();
        let k = byte_block_keys(&(made as u64).to_le_bytes(), &bytes, 64);
        idx.insert(made % 5, &k[..k.len().min(100_000 - idx.len())], 0)
            .unwrap();
        made += 1;
    }
    let s = idx.stats();
    assert_eq!(s.nodes, 100_000);
    let per_node = s.bytes as f64 / s.nodes as f64;
    assert!(per_node <= 64.0, "{per_node:.1} bytes per node");
}

#[test]
fn bad_config_is_an_error() {
    for cap in [0, PrefixIndex::MAX_NODE_CAP + 1] {
        let e = PrefixIndex::new(IndexConfig {
            node_cap: cap,
            ..IndexConfig::default()
        })
        .unwrap_err();
        assert_eq!(e, IndexError::BadNodeCap(cap));
    }
    for t in [0, PrefixIndex::MAX_TOKENS_PER_BLOCK + 1] {
        let e = PrefixIndex::new(IndexConfig {
            tokens_per_block: t,
            ..IndexConfig::default()
        })
        .unwrap_err();
        assert_eq!(e, IndexError::BadTokensPerBlock(t));
        assert!(e.to_string().contains("tokens per block"));
    }
}
