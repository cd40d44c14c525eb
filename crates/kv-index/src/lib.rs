//! `kv-index`: a residency index for cache-aware LLM routing.
//!
//! A prompt is cut into fixed-size blocks whose keys are chained hashes ([`hash`]), so key `i`
//! names the whole prefix `0..=i`. [`PrefixIndex`] remembers, per key, which replicas are believed
//! (belief mode: what the router sent) or known (event-fed mode: what the engines reported) to hold
//! that prefix, and answers "how many leading blocks of this prompt does each replica hold?".
//!
//! The crate is pure: no I/O, no clock reads, no async. Time is passed in as `now_us`
//! (microseconds on a caller-chosen monotonic clock, below 2^47). Memory is bounded by
//! [`IndexConfig::node_cap`] whatever the input.
//!
//! Module map:
//! - [`hash`]: stable chained block keys over bytes or token ids.
//! - [`index`]: [`PrefixIndex`], [`Matches`], [`IndexConfig`], [`IndexStats`], [`IndexError`].

#![forbid(unsafe_code)]

pub mod hash;
pub mod index;

pub use index::{IndexConfig, IndexError, IndexStats, Matches, PrefixIndex};

/// A 64-bit chained block key; equal keys name equal prefixes.
pub type BlockKey = u64;

/// A replica, as numbered by the router (see `docs/CONTRACTS.md`).
pub type ReplicaId = u32;

/// One engine KV-cache event, already decoded from the wire (kv-index never parses msgpack).
///
/// Mirrors vLLM's `BlockStored`, `BlockRemoved` and `AllBlocksCleared`. Hashes are the engine's
/// own; the index maps them to its own keys, which it re-derives from `token_ids`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// A contiguous run of newly full blocks of one request.
    Stored {
        /// Engine hashes of the new blocks, in chain order.
        block_hashes: Vec<u64>,
        /// Engine hash of the block before the first new one; `None` when the run starts at block 0.
        parent_block_hash: Option<u64>,
        /// Exactly the new blocks' tokens (`block_hashes.len() * block_size` ids).
        token_ids: Vec<u32>,
        /// Tokens per block on the engine.
        block_size: u32,
        /// The `cache_salt` of the request that stored the blocks, when it had one. Engines that
        /// honour it (vLLM, SGLang) keep a salted prefix apart from the same tokens unsalted, so
        /// the index keys a run that starts at block 0 under [`hash::cache_salted`]; a run with a
        /// parent inherits the parent's chain and ignores it.
        cache_salt: Option<String>,
    },
    /// Blocks evicted from the engine's cache (one event per evicted block in vLLM).
    Removed {
        /// Engine hashes of the evicted blocks.
        block_hashes: Vec<u64>,
    },
    /// The engine dropped its whole prefix cache.
    AllCleared,
}
