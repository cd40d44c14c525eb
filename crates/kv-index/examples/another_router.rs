//! How another router uses `kv-index`: hash a prompt, look it up, pick a replica, insert — in one
//! descent — and, in event-fed mode, keep the index exact from engine KV events.
//!
//! Run: `cargo run -p kv-index --example another_router`

use kv_index::hash::{byte_block_keys, token_block_keys};
use kv_index::{IndexConfig, KvEvent, Matches, PrefixIndex};

/// A stand-in for the router's own load counters.
struct Replica {
    id: u32,
    in_flight: u32,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    belief_mode()?;
    event_fed_mode()?;
    Ok(())
}

/// Belief mode: the index learns from what this router sent.
fn belief_mode() -> Result<(), Box<dyn std::error::Error>> {
    println!("== belief mode ==");
    let mut index = PrefixIndex::new(IndexConfig {
        node_cap: 100_000,
        ttl_us: Some(60_000_000),
        ..IndexConfig::default()
    })?;
    let mut fleet: Vec<Replica> = (0..3).map(|id| Replica { id, in_flight: 0 }).collect();
    let mut matches = Matches::new();
    let system = "You are a helpful assistant. ".repeat(8);
    let turns = [
        format!("{system}User: what is a KV cache?"),
        format!(
            "{system}User: what is a KV cache?\nAssistant: the attention keys and values of earlier tokens, kept so they need not be recomputed.\nUser: and prefix caching?"
        ),
        format!("{system}User: tell me a story about a lighthouse keeper who collects seashells."),
    ];
    for (t, prompt) in turns.iter().enumerate() {
        let now_us = 1_000_000 * t as u64;
        // 64-byte blocks (about 16 tokens), salted with the model name.
        let keys = byte_block_keys(b"my-model", prompt.as_bytes(), 64);
        let chosen = index.lookup_insert(&keys, now_us, &mut matches, |m| {
            // Longest match; otherwise (or on ties) the least loaded.
            let best = m.longest();
            let pick = fleet
                .iter()
                .filter(|r| best == 0 || m.blocks(r.id) == best)
                .min_by_key(|r| r.in_flight)?;
            Some((pick.id, false))
        })?;
        let chosen = chosen.ok_or("empty fleet")?;
        fleet[chosen as usize].in_flight += 1;
        println!(
            "turn {t}: {} blocks, matches {:?} → replica {chosen}",
            keys.len(),
            matches.hits()
        );
    }
    let s = index.stats();
    println!(
        "stats: {} nodes, {} entries, {} bytes ({:.1} B/node), replicas per node {:?}",
        s.nodes,
        s.entries,
        s.bytes,
        s.bytes as f64 / s.nodes.max(1) as f64,
        s.replicas_per_node
    );
    Ok(())
}

/// Event-fed mode: the index learns only from the engines' KV events, keyed by token blocks.
fn event_fed_mode() -> Result<(), Box<dyn std::error::Error>> {
    println!("== event-fed mode ==");
    let mut index = PrefixIndex::new(IndexConfig {
        node_cap: 100_000,
        ttl_us: None,
        speculative_ttl_us: 2_000_000,
        salt: b"my-model".to_vec(),
        tokens_per_block: 16,
    })?;
    let tokens: Vec<u32> = (0..80).map(|i| 1000 + i).collect(); // 5 full blocks
    let keys = token_block_keys(b"my-model", &tokens, 16);
    let mut matches = Matches::new();

    // Routed to replica 2: believe it speculatively until the engine confirms.
    index.insert_speculative(2, &keys, 0)?;
    index.lookup(&keys, 1_000, &mut matches);
    println!("speculative: {:?}", matches.hits());

    // Replica 2's engine reports the blocks it stored (its own hashes), in two runs.
    index.apply_event(
        2,
        &KvEvent::Stored {
            block_hashes: vec![0xa1, 0xa2, 0xa3],
            parent_block_hash: None,
            token_ids: tokens[..48].to_vec(),
            block_size: 16,
            cache_salt: None,
        },
        10_000,
    )?;
    index.apply_event(
        2,
        &KvEvent::Stored {
            block_hashes: vec![0xa4],
            parent_block_hash: Some(0xa3),
            token_ids: tokens[48..64].to_vec(),
            block_size: 16,
            cache_salt: None,
        },
        10_000,
    )?;
    index.lookup(&keys, 5_000_000, &mut matches);
    println!(
        "after events, speculative layer expired: {:?}",
        matches.hits()
    );

    // The engine evicts the tail block; then the replica leaves the fleet.
    index.apply_event(
        2,
        &KvEvent::Removed {
            block_hashes: vec![0xa4],
        },
        6_000_000,
    )?;
    index.lookup(&keys, 6_000_000, &mut matches);
    println!("after a removal: {:?}", matches.hits());
    // An event naming a parent we never saw is refused, not guessed at.
    let lost = index.apply_event(
        2,
        &KvEvent::Stored {
            block_hashes: vec![0xb2],
            parent_block_hash: Some(0xb1),
            token_ids: vec![7; 16],
            block_size: 16,
            cache_salt: None,
        },
        6_000_000,
    );
    println!("event with an unknown parent: {}", lost.unwrap_err());
    index.remove_replica(2);
    println!("after remove_replica: {} nodes", index.len());
    Ok(())
}
