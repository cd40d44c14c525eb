//! The residency index.
//!
//! # Layout
//!
//! - Nodes live in one vector whose capacity (`node_cap`) is reserved up front as address space
//!   and committed by the OS as it fills: nodes never move, indexing is one bounds check. A node
//!   is 48 bytes: its key, its parent's slot, two LRU links, a child count and three inline
//!   entries. A fourth replica moves the entries to a side vector (a prefix held by more than
//!   three replicas).
//! - Keys are found through an open-addressing table of `u64` buckets (slot and 32 hash bits;
//!   linear probing, backward-shift deletion, load 0.6–0.75, growth 1.25×): 11–13 bytes per node,
//!   and neither a mismatching probe nor a deletion touches a node.
//! - One intrusive LRU list over all nodes. Every operation that touches a chain links it at the
//!   recent end tail-first, so a node's parent is always more recent than the node. The least
//!   recent node is therefore always a leaf, and evicting it drops a chain's tail before its head.
//!   Chain segments already adjacent in the list move as one piece.
//! - Lookups hash the next 16 keys and load their buckets and likely nodes together, so the
//!   cache misses of a long prompt overlap. Past the first 16 keys a lookup first guesses that
//!   the chain continues in neighbouring slots (a chain's nodes are mostly created together) and
//!   checks the guess by the node's key: a key found there never reads its bucket, one random
//!   cache line less per block (measured: a cold 128-block lookup 13 → 6–8 µs).
//!
//! # Rules (the reference model in `tests/differential.rs` restates them)
//!
//! - `insert(r, keys)` makes `keys[0]` a root and `keys[i-1]` the parent of `keys[i]`, creates
//!   missing nodes, sets `r`'s entry on every node to `now`, and moves the chain to the recent end
//!   (tail first). Only the first `node_cap` keys are used, and the chain stops before a key that
//!   repeats an earlier key of the same chain. A new node beyond the cap first evicts the least
//!   recently touched node that is not part of the chain.
//! - `lookup(keys)` gives, per replica, the number of leading keys whose node holds a live entry
//!   of that replica. An entry is live while `now - touched ≤ ttl` (speculative entries use the
//!   speculative TTL; with no TTL a confirmed entry never expires).
//! - Removing entries (`forget`, `removed`, `cleared`, `remove_replica`) frees every node left
//!   with no entries at all and no children, cascading to its parent.

use crate::hash::{cache_salted, chain_token_keys, token_salt_seed};
use crate::{BlockKey, KvEvent, ReplicaId};
use std::collections::HashMap;
use std::fmt;

/// Configuration of a [`PrefixIndex`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexConfig {
    /// Most nodes the index ever holds (1 ..= 16,777,214). Enforced on every insert.
    pub node_cap: usize,
    /// Sliding lifetime of a confirmed entry since it was last touched; `None` = never expires
    /// (event-fed mode, where removals come from the engine).
    pub ttl_us: Option<u64>,
    /// Lifetime of a speculative entry (inserted on routing, awaiting the engine's event).
    pub speculative_ttl_us: u64,
    /// Salt of block 0 for keys re-derived from events (the model name, as the router uses it).
    pub salt: Vec<u8>,
    /// Tokens per block expected in events; must equal the block size of the caller's keys.
    pub tokens_per_block: u32,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            node_cap: 1 << 20,
            // About the eviction lifetime measured on the reference fleet (~57 s).
            ttl_us: Some(60_000_000),
            speculative_ttl_us: 2_000_000,
            salt: Vec::new(),
            tokens_per_block: 16,
        }
    }
}

/// Why an index operation was refused. The index is unchanged when an error is returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IndexError {
    /// `node_cap` is 0 or above [`PrefixIndex::MAX_NODE_CAP`].
    BadNodeCap(usize),
    /// `tokens_per_block` is 0 or above [`PrefixIndex::MAX_TOKENS_PER_BLOCK`].
    BadTokensPerBlock(u32),
    /// More than [`PrefixIndex::MAX_REPLICAS`] replicas at once.
    TooManyReplicas,
    /// An event's block size differs from [`IndexConfig::tokens_per_block`].
    BlockSizeMismatch {
        /// The configured block size.
        expected: u32,
        /// The event's block size.
        got: u32,
    },
    /// A stored event's token count is not `block_hashes.len() * block_size`.
    TokenCountMismatch {
        /// Number of block hashes in the event.
        blocks: usize,
        /// Number of token ids in the event.
        tokens: usize,
    },
    /// A stored event names a parent hash this replica never reported (events were lost, or the
    /// subscriber joined late without replay).
    UnknownParent(u64),
}

impl fmt::Display for IndexError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IndexError::BadNodeCap(c) => write!(
                f,
                "node cap {c} is out of range 1..={}",
                PrefixIndex::MAX_NODE_CAP
            ),
            IndexError::BadTokensPerBlock(t) => write!(
                f,
                "tokens per block {t} is out of range 1..={}",
                PrefixIndex::MAX_TOKENS_PER_BLOCK
            ),
            IndexError::TooManyReplicas => write!(
                f,
                "more than {} replicas in one index",
                PrefixIndex::MAX_REPLICAS
            ),
            IndexError::BlockSizeMismatch { expected, got } => write!(
                f,
                "event block size {got} differs from the index's {expected} tokens per block"
            ),
            IndexError::TokenCountMismatch { blocks, tokens } => {
                write!(f, "stored event has {tokens} token ids for {blocks} blocks")
            }
            IndexError::UnknownParent(h) => {
                write!(f, "stored event names unknown parent block hash {h:#x}")
            }
        }
    }
}

impl std::error::Error for IndexError {}

/// Index statistics (see [`PrefixIndex::stats`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Live nodes.
    pub nodes: usize,
    /// The configured node cap.
    pub node_cap: usize,
    /// Replica entries over all nodes (live or expired but not yet reclaimed).
    pub entries: usize,
    /// `replicas_per_node[k]` = number of nodes holding exactly `k` entries.
    pub replicas_per_node: Vec<usize>,
    /// Heap bytes held by the index (slab, table, entry overflow, event hash maps, scratch).
    pub bytes: usize,
    /// Nodes evicted to respect the cap, since creation.
    pub evictions: u64,
    /// Replicas currently known to the index.
    pub replicas: usize,
    /// Engine hash → own key mappings held for event-fed mode.
    pub engine_hashes: usize,
}

/// Per replica, the number of leading blocks it holds (see [`PrefixIndex::lookup`]).
///
/// Reuse one `Matches` across calls: it keeps its buffers.
#[derive(Clone, Debug, Default)]
pub struct Matches {
    depth: Vec<u32>,
    hits: Vec<(ReplicaId, u32)>,
}

impl Matches {
    /// An empty result.
    pub fn new() -> Self {
        Self::default()
    }

    /// Leading blocks held by `replica` (0 when it holds none).
    pub fn blocks(&self, replica: ReplicaId) -> u32 {
        self.hits
            .iter()
            .find(|(r, _)| *r == replica)
            .map_or(0, |&(_, b)| b)
    }

    /// Replicas holding at least one leading block, with their matched block counts, in
    /// ascending replica order.
    pub fn hits(&self) -> &[(ReplicaId, u32)] {
        &self.hits
    }

    /// The longest match over all replicas.
    pub fn longest(&self) -> u32 {
        self.hits.iter().map(|&(_, b)| b).max().unwrap_or(0)
    }

    fn clear(&mut self) {
        self.hits.clear();
    }
}

const NONE: u32 = u32::MAX;
/// Bit of `Node::children` marking a node of the chain being placed (counts stay below 2^24).
const IN_CHAIN: u32 = 1 << 31;
const EMPTY_ENTRY: u64 = u64::MAX;
/// Slot value of an inline entry that points at the overflow vector instead.
const OVERFLOW_SLOT: u64 = 0xFFFE;
const SLOT_MASK: u64 = 0xFFFF;
const SPEC_BIT: u64 = 1 << 16;
const TIME_SHIFT: u32 = 17;
const TIME_MAX: u64 = (1 << 47) - 1;
const EMPTY_BUCKET: u64 = u64::MAX;
/// Keys whose buckets and nodes are loaded together ahead of the descent.
const WARM_AHEAD: usize = 16;

#[derive(Clone, Copy, Debug)]
struct Node {
    key: BlockKey,
    parent: u32,
    /// Newer neighbour in the LRU list (`NONE` at the head or when detached).
    prev: u32,
    /// Older neighbour in the LRU list.
    next: u32,
    children: u32,
    /// Up to three entries; when more, `entries[2]` points at the overflow vector.
    entries: [u64; 3],
}

const _: () = assert!(std::mem::size_of::<Node>() == 48);

impl Node {
    const FREE: Node = Node {
        key: 0,
        parent: NONE,
        prev: NONE,
        next: NONE,
        children: 0,
        entries: [EMPTY_ENTRY; 3],
    };

    fn overflow(&self) -> Option<usize> {
        let e = self.entries[2];
        (e != EMPTY_ENTRY && e & SLOT_MASK == OVERFLOW_SLOT).then_some((e >> 32) as usize)
    }

    fn is_empty(&self) -> bool {
        self.entries[0] == EMPTY_ENTRY
    }
}

/// Node storage: one vector whose capacity (`node_cap` nodes) is reserved up front, so it never
/// reallocates or moves nodes. The reservation is address space only: the operating system
/// commits pages as nodes are first written, so resident memory follows the high-water mark of
/// live nodes, and indexing is a single bounds-checked access.
#[derive(Default)]
struct Slab {
    nodes: Vec<Node>,
}

impl Slab {
    fn with_capacity(cap: usize) -> Option<Self> {
        let mut nodes = Vec::new();
        nodes.try_reserve_exact(cap).ok()?;
        Some(Slab { nodes })
    }
    #[inline]
    fn get(&self, i: u32) -> &Node {
        &self.nodes[i as usize]
    }
    #[inline]
    fn get_mut(&mut self, i: u32) -> &mut Node {
        &mut self.nodes[i as usize]
    }
    /// The slot of `key` if the node at `slot` holds it (a slot past the high-water mark, or a
    /// free one, holds no key: a freed node is reset to [`Node::FREE`], key 0, so key 0 is
    /// never guessed). Exact: live nodes have distinct keys, so a match is the key's node.
    #[inline]
    fn holds(&self, slot: i64, key: BlockKey) -> bool {
        key != 0
            && usize::try_from(slot)
                .ok()
                .and_then(|s| self.nodes.get(s))
                .is_some_and(|n| n.key == key)
    }
    /// Finds the nodes of `keys` that continue a run of slots: key `j` is guessed at
    /// `from + (j + 1) × stride` and checked by its node's key (loads of neighbouring slots,
    /// which share cache lines and which the hardware prefetches). Returns the bit mask of the
    /// keys found and their slots in `probes[j].candidate`.
    fn guess_run(
        &self,
        keys: &[BlockKey],
        from: u32,
        stride: i64,
        probes: &mut [Probe; WARM_AHEAD],
    ) -> u32 {
        let mut found = 0;
        for (j, (p, &k)) in probes.iter_mut().zip(keys).enumerate() {
            let slot = i64::from(from) + (j as i64 + 1) * stride;
            if self.holds(slot, k) {
                p.candidate = slot as u32;
                found |= 1 << j;
            }
        }
        found
    }
    /// Nodes ever handed out (the committed part).
    fn high_water(&self) -> usize {
        self.nodes.len()
    }
    /// A fresh slot past the high-water mark (within the reservation).
    fn push(&mut self) -> u32 {
        self.nodes.push(Node::FREE);
        (self.nodes.len() - 1) as u32
    }
}

/// A key's hash, home bucket and the slot found there when its tag matched.
#[derive(Clone, Copy, Default)]
struct Probe {
    h: u64,
    home: usize,
    candidate: u32,
}

/// Open-addressing table from key to slot. A bucket is `hash32 << 32 | slot`, where `hash32`
/// is 32 bits of a remix of the key: it gives the home position (fast range reduction, so the
/// table may have any size and grows by 1.25×, keeping memory per node tight) and doubles as a
/// 32-bit tag, so neither a mismatching probe nor a deletion's backward shift reads a node.
struct Table {
    buckets: Vec<u64>,
    len: usize,
}

impl Table {
    fn with_buckets(n: usize) -> Self {
        Table {
            buckets: vec![EMPTY_BUCKET; n.max(16)],
            len: 0,
        }
    }
    #[inline]
    fn hash32(key: BlockKey) -> u64 {
        key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32
    }
    #[inline]
    fn home_of(&self, h32: u64) -> usize {
        ((h32 * self.buckets.len() as u64) >> 32) as usize
    }
    #[inline]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.buckets.len() {
            0
        } else {
            i + 1
        }
    }
    /// Bucket position of `key`, if present.
    #[inline]
    fn position(&self, key: BlockKey, slab: &Slab) -> Option<usize> {
        let h = Self::hash32(key);
        let mut i = self.home_of(h);
        loop {
            let b = self.buckets[i];
            if b == EMPTY_BUCKET {
                return None;
            }
            if b >> 32 == h && slab.get(b as u32).key == key {
                return Some(i);
            }
            i = self.next(i);
        }
    }
    /// Hashes the next keys and issues the memory loads of their home buckets, then of their
    /// likely nodes, all together, so that the cache misses overlap instead of being paid one
    /// after the other in the descent (a safe stand-in for prefetch instructions).
    ///
    /// Keys whose bit is set in `known` (already found by [`Slab::guess_run`]) are skipped: their
    /// bucket is never read.
    fn prepare(
        &self,
        keys: &[BlockKey],
        probes: &mut [Probe; WARM_AHEAD],
        known: u32,
        slab: &Slab,
    ) {
        for (j, (p, &k)) in probes.iter_mut().zip(keys).enumerate() {
            if known & (1 << j) != 0 {
                continue;
            }
            let h = Self::hash32(k);
            let home = self.home_of(h);
            let b = self.buckets[home];
            *p = Probe {
                h,
                home,
                candidate: if b >> 32 == h { b as u32 } else { NONE },
            };
        }
        let mut acc = 0u64;
        for (j, p) in probes.iter().take(keys.len()).enumerate() {
            if known & (1 << j) == 0 && p.candidate != NONE {
                acc ^= slab.get(p.candidate).key;
            }
        }
        std::hint::black_box(acc);
    }
    /// [`find`](Self::find) with the hashing and first probe done by [`prepare`](Self::prepare).
    #[inline]
    fn find_prepared(&self, key: BlockKey, p: Probe, slab: &Slab) -> Option<u32> {
        if p.candidate != NONE && slab.get(p.candidate).key == key {
            return Some(p.candidate);
        }
        let mut i = p.home;
        loop {
            let b = self.buckets[i];
            if b == EMPTY_BUCKET {
                return None;
            }
            if b >> 32 == p.h && slab.get(b as u32).key == key {
                return Some(b as u32);
            }
            i = self.next(i);
        }
    }
    #[inline]
    fn find(&self, key: BlockKey, slab: &Slab) -> Option<u32> {
        self.position(key, slab).map(|i| self.buckets[i] as u32)
    }
    fn insert(&mut self, key: BlockKey, slot: u32) {
        if (self.len + 1) * 4 > self.buckets.len() * 3 {
            self.grow();
        }
        self.place(Self::hash32(key) << 32 | slot as u64);
        self.len += 1;
    }
    fn place(&mut self, b: u64) {
        let mut i = self.home_of(b >> 32);
        while self.buckets[i] != EMPTY_BUCKET {
            i = self.next(i);
        }
        self.buckets[i] = b;
    }
    fn grow(&mut self) {
        let old = std::mem::take(&mut self.buckets);
        self.buckets = vec![EMPTY_BUCKET; old.len() + old.len() / 4];
        for b in old.into_iter().filter(|&b| b != EMPTY_BUCKET) {
            self.place(b);
        }
    }
    fn remove(&mut self, key: BlockKey, slab: &Slab) {
        let Some(mut hole) = self.position(key, slab) else {
            return;
        };
        let mut j = hole;
        // Backward-shift deletion: pull later members of the run into the hole when their home
        // is not cyclically inside (hole, j].
        loop {
            j = self.next(j);
            let b = self.buckets[j];
            if b == EMPTY_BUCKET {
                break;
            }
            let home = self.home_of(b >> 32);
            let inside = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !inside {
                self.buckets[hole] = b;
                hole = j;
            }
        }
        self.buckets[hole] = EMPTY_BUCKET;
        self.len -= 1;
    }
}

#[derive(Clone, Copy)]
struct Write {
    slot: u16,
    speculative: bool,
    now: u64,
}

/// The residency index. See the module documentation for its layout and rules.
pub struct PrefixIndex {
    cfg: IndexConfig,
    slab: Slab,
    table: Table,
    free: Vec<u32>,
    len: usize,
    /// Most recently touched node.
    head: u32,
    /// Least recently touched node.
    tail: u32,
    overflow: Vec<Vec<u64>>,
    overflow_free: Vec<u32>,
    slot_of: HashMap<ReplicaId, u16>,
    slot_replica: Vec<Option<ReplicaId>>,
    free_slots: Vec<u16>,
    /// Per slot: engine hash → (own key, how many stored copies the engine reported).
    engine: Vec<HashMap<u64, (BlockKey, u32), ahash::RandomState>>,
    path: Vec<u32>,
    keys_buf: Vec<BlockKey>,
    evictions: u64,
}

impl fmt::Debug for PrefixIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrefixIndex")
            .field("nodes", &self.len)
            .field("node_cap", &self.cfg.node_cap)
            .field("replicas", &self.slot_of.len())
            .finish()
    }
}

impl PrefixIndex {
    /// Largest accepted node cap (16,777,214 nodes, about 1 GiB).
    pub const MAX_NODE_CAP: usize = (1 << 24) - 2;
    /// Largest accepted block size in tokens.
    pub const MAX_TOKENS_PER_BLOCK: u32 = 1 << 16;
    /// Most replicas one index tracks at once (ids are free-form; slots are reused).
    pub const MAX_REPLICAS: usize = 0xFFFE;

    /// An empty index.
    pub fn new(cfg: IndexConfig) -> Result<Self, IndexError> {
        if cfg.node_cap == 0 || cfg.node_cap > Self::MAX_NODE_CAP {
            return Err(IndexError::BadNodeCap(cfg.node_cap));
        }
        if cfg.tokens_per_block == 0 || cfg.tokens_per_block > Self::MAX_TOKENS_PER_BLOCK {
            return Err(IndexError::BadTokensPerBlock(cfg.tokens_per_block));
        }
        let table = Table::with_buckets((cfg.node_cap.min(4096) * 4).div_ceil(3));
        let slab = Slab::with_capacity(cfg.node_cap).ok_or(IndexError::BadNodeCap(cfg.node_cap))?;
        Ok(PrefixIndex {
            cfg,
            slab,
            table,
            free: Vec::new(),
            len: 0,
            head: NONE,
            tail: NONE,
            overflow: Vec::new(),
            overflow_free: Vec::new(),
            slot_of: HashMap::new(),
            slot_replica: Vec::new(),
            free_slots: Vec::new(),
            engine: Vec::new(),
            path: Vec::new(),
            keys_buf: Vec::new(),
            evictions: 0,
        })
    }

    /// The configuration the index was built with.
    pub fn config(&self) -> &IndexConfig {
        &self.cfg
    }

    /// Number of live nodes (never above the cap).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the index holds no node.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether a node exists for `key` (whatever its entries).
    pub fn contains_key(&self, key: BlockKey) -> bool {
        self.table.find(key, &self.slab).is_some()
    }

    // ----- lookups -------------------------------------------------------------------------

    /// Fills `out` with, per replica, the number of leading `keys` it holds live at `now_us`.
    ///
    /// Read-only: lookups neither refresh TTLs nor reorder the LRU. O(matched length × entries
    /// per node); stops at the first key no replica continues.
    pub fn lookup(&self, keys: &[BlockKey], now_us: u64, out: &mut Matches) {
        let mut path = Vec::new();
        self.descend(keys, now_us, out, &mut path, false);
    }

    /// Looks `keys` up, lets `choose` pick a replica from the result, and inserts the chain for
    /// it, reusing the lookup's descent. `choose` returns the replica and whether its entries
    /// are speculative; `None` inserts nothing. Returns the chosen replica.
    pub fn lookup_insert<F>(
        &mut self,
        keys: &[BlockKey],
        now_us: u64,
        out: &mut Matches,
        choose: F,
    ) -> Result<Option<ReplicaId>, IndexError>
    where
        F: FnOnce(&Matches) -> Option<(ReplicaId, bool)>,
    {
        let mut path = std::mem::take(&mut self.path);
        path.clear();
        self.descend(keys, now_us, out, &mut path, true);
        let chosen = choose(out);
        let result = match chosen {
            Some((replica, speculative)) => self.slot_for(replica).map(|slot| {
                let w = Write {
                    slot,
                    speculative,
                    now: now_us.min(TIME_MAX),
                };
                self.place_chain(keys, &mut path, 0, w);
                Some(replica)
            }),
            None => Ok(None),
        };
        self.path = path;
        result
    }

    /// Believes `replica` holds the prefix `keys` as of `now_us` (belief mode, or a routed
    /// request in event-fed mode): creates missing nodes and refreshes the replica's entries.
    pub fn insert(
        &mut self,
        replica: ReplicaId,
        keys: &[BlockKey],
        now_us: u64,
    ) -> Result<(), IndexError> {
        self.insert_kind(replica, keys, now_us, false)
    }

    /// Like [`insert`](Self::insert), but the entries are speculative: they live for the
    /// speculative TTL unless an engine event confirms them, and never overwrite a live
    /// confirmed entry.
    pub fn insert_speculative(
        &mut self,
        replica: ReplicaId,
        keys: &[BlockKey],
        now_us: u64,
    ) -> Result<(), IndexError> {
        self.insert_kind(replica, keys, now_us, true)
    }

    fn insert_kind(
        &mut self,
        replica: ReplicaId,
        keys: &[BlockKey],
        now_us: u64,
        speculative: bool,
    ) -> Result<(), IndexError> {
        let slot = self.slot_for(replica)?;
        let mut path = std::mem::take(&mut self.path);
        path.clear();
        let w = Write {
            slot,
            speculative,
            now: now_us.min(TIME_MAX),
        };
        self.place_chain(keys, &mut path, 0, w);
        self.path = path;
        Ok(())
    }

    /// Drops `replica`'s entries on the nodes of `keys` (belief mode: e.g. a request that was
    /// routed to `replica` but served elsewhere), reclaiming nodes left empty.
    pub fn forget(&mut self, replica: ReplicaId, keys: &[BlockKey]) {
        let Some(&slot) = self.slot_of.get(&replica) else {
            return;
        };
        for &k in keys {
            if let Some(i) = self.table.find(k, &self.slab) {
                self.remove_entry(i, slot);
                self.reclaim_from(i);
            }
        }
    }

    // ----- event-fed mode ----------------------------------------------------------------

    /// Applies one decoded engine event from `replica`.
    pub fn apply_event(
        &mut self,
        replica: ReplicaId,
        event: &KvEvent,
        now_us: u64,
    ) -> Result<(), IndexError> {
        match event {
            KvEvent::Stored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                cache_salt,
            } => self.stored_salted(
                replica,
                *parent_block_hash,
                block_hashes,
                token_ids,
                *block_size,
                cache_salt.as_deref().map(str::as_bytes),
                now_us,
            ),
            KvEvent::Removed { block_hashes } => {
                self.removed(replica, block_hashes);
                Ok(())
            }
            KvEvent::AllCleared => {
                self.cleared(replica);
                Ok(())
            }
        }
    }

    /// The engine of `replica` stored `block_hashes` (its hashes) holding `token_ids`, chained
    /// after `parent` (its hash of the preceding block, `None` at block 0), for a request without
    /// a `cache_salt` (see [`KvEvent::Stored`] for one with).
    ///
    /// Own keys are re-derived from the tokens (salted like the router's exact keys), the engine
    /// hashes are remembered only to resolve later removals, and the whole chain, ancestors
    /// included, becomes most recently used. Entries are confirmed (they replace speculative
    /// ones).
    pub fn stored(
        &mut self,
        replica: ReplicaId,
        parent: Option<u64>,
        block_hashes: &[u64],
        token_ids: &[u32],
        block_size: u32,
        now_us: u64,
    ) -> Result<(), IndexError> {
        self.stored_salted(
            replica,
            parent,
            block_hashes,
            token_ids,
            block_size,
            None,
            now_us,
        )
    }

    /// [`Self::stored`] for a request salted `cache_salt`: it seeds block 0 (see
    /// [`crate::hash::cache_salted`]) and is ignored when `parent` is given, whose key already
    /// carries it.
    // One argument per field of `KvEvent::Stored` plus who and when: grouping them would only
    // rebuild the event.
    #[allow(clippy::too_many_arguments)]
    fn stored_salted(
        &mut self,
        replica: ReplicaId,
        parent: Option<u64>,
        block_hashes: &[u64],
        token_ids: &[u32],
        block_size: u32,
        cache_salt: Option<&[u8]>,
        now_us: u64,
    ) -> Result<(), IndexError> {
        if block_size != self.cfg.tokens_per_block {
            return Err(IndexError::BlockSizeMismatch {
                expected: self.cfg.tokens_per_block,
                got: block_size,
            });
        }
        if token_ids.len() != block_hashes.len() * block_size as usize {
            return Err(IndexError::TokenCountMismatch {
                blocks: block_hashes.len(),
                tokens: token_ids.len(),
            });
        }
        let slot = match self.slot_of.get(&replica) {
            Some(&s) => s,
            None if parent.is_some() => {
                return Err(IndexError::UnknownParent(parent.unwrap_or_default()));
            }
            None => self.slot_for(replica)?,
        };
        let parent_key = match parent {
            None => None,
            Some(h) => match self.engine[slot as usize].get(&h) {
                Some(&(own, _)) => Some(own),
                None => return Err(IndexError::UnknownParent(h)),
            },
        };
        let mut keys = std::mem::take(&mut self.keys_buf);
        keys.clear();
        let mut path = std::mem::take(&mut self.path);
        path.clear();
        // Ancestors (by parent links) first, root to parent, so that the chain is touched whole.
        if let Some(pk) = parent_key
            && let Some(p) = self.table.find(pk, &self.slab)
        {
            let mut i = p;
            while i != NONE {
                path.push(i);
                i = self.slab.get(i).parent;
            }
            path.reverse();
            keys.extend(path.iter().map(|&i| self.slab.get(i).key));
        }
        let ancestors = keys.len();
        let seed = parent_key
            .unwrap_or_else(|| token_salt_seed(&cache_salted(&self.cfg.salt, cache_salt)));
        chain_token_keys(seed, token_ids, block_size as usize, &mut keys);
        let map = &mut self.engine[slot as usize];
        for (&h, &own) in block_hashes.iter().zip(&keys[ancestors..]) {
            let e = map.entry(h).or_insert((own, 0));
            e.0 = own;
            e.1 += 1;
        }
        let w = Write {
            slot,
            speculative: false,
            now: now_us.min(TIME_MAX),
        };
        self.place_chain(&keys, &mut path, ancestors, w);
        self.path = path;
        self.keys_buf = keys;
        Ok(())
    }

    /// The engine of `replica` evicted `block_hashes`. A hash stored twice (engines do not
    /// deduplicate) stays until removed twice.
    pub fn removed(&mut self, replica: ReplicaId, block_hashes: &[u64]) {
        let Some(&slot) = self.slot_of.get(&replica) else {
            return;
        };
        for h in block_hashes {
            let map = &mut self.engine[slot as usize];
            let Some(e) = map.get_mut(h) else {
                continue;
            };
            e.1 -= 1;
            if e.1 > 0 {
                continue;
            }
            let own = e.0;
            map.remove(h);
            if let Some(i) = self.table.find(own, &self.slab) {
                self.remove_entry(i, slot);
                self.reclaim_from(i);
            }
        }
    }

    /// The engine of `replica` dropped its whole cache: all its entries go.
    pub fn cleared(&mut self, replica: ReplicaId) {
        if let Some(&slot) = self.slot_of.get(&replica) {
            self.engine[slot as usize].clear();
            self.drop_slot_entries(slot);
        }
    }

    /// Forgets `replica` entirely (it left the fleet); its slot may be reused.
    pub fn remove_replica(&mut self, replica: ReplicaId) {
        if let Some(slot) = self.slot_of.remove(&replica) {
            self.engine[slot as usize] = HashMap::default();
            self.drop_slot_entries(slot);
            self.slot_replica[slot as usize] = None;
            self.free_slots.push(slot);
        }
    }

    /// Counts and memory. O(nodes).
    pub fn stats(&self) -> IndexStats {
        let mut per = vec![0usize; 4];
        let mut entries = 0;
        let mut i = self.head;
        while i != NONE {
            let n = self.entry_count(self.slab.get(i));
            if per.len() <= n {
                per.resize(n + 1, 0);
            }
            per[n] += 1;
            entries += n;
            i = self.slab.get(i).next;
        }
        let overflow_bytes: usize = self
            .overflow
            .iter()
            .map(|v| v.capacity() * 8 + std::mem::size_of::<Vec<u64>>())
            .sum();
        // hashbrown: one (key, value) slot plus one control byte per bucket.
        let engine_bytes: usize = self
            .engine
            .iter()
            .map(|m| m.capacity() * (std::mem::size_of::<(u64, (BlockKey, u32))>() + 1))
            .sum();
        // Committed node memory: the slab's reservation beyond its high-water mark is address
        // space the operating system has not backed.
        let bytes = self.slab.high_water() * std::mem::size_of::<Node>()
            + self.table.buckets.capacity() * 8
            + self.free.capacity() * 4
            + overflow_bytes
            + self.overflow_free.capacity() * 4
            + engine_bytes
            + self.slot_replica.capacity() * 8
            + self.slot_of.capacity() * 9
            + self.path.capacity() * 4
            + self.keys_buf.capacity() * 8;
        IndexStats {
            nodes: self.len,
            node_cap: self.cfg.node_cap,
            entries,
            replicas_per_node: per,
            bytes,
            evictions: self.evictions,
            replicas: self.slot_of.len(),
            engine_hashes: self.engine.iter().map(HashMap::len).sum(),
        }
    }

    // ----- internals -----------------------------------------------------------------------

    fn slot_for(&mut self, replica: ReplicaId) -> Result<u16, IndexError> {
        if let Some(&s) = self.slot_of.get(&replica) {
            return Ok(s);
        }
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None if self.slot_replica.len() < Self::MAX_REPLICAS => {
                self.slot_replica.push(None);
                self.engine.push(HashMap::default());
                (self.slot_replica.len() - 1) as u16
            }
            None => return Err(IndexError::TooManyReplicas),
        };
        self.slot_replica[slot as usize] = Some(replica);
        self.slot_of.insert(replica, slot);
        Ok(slot)
    }

    #[inline]
    fn alive(&self, e: u64, now: u64) -> bool {
        let age = now.saturating_sub(e >> TIME_SHIFT);
        if e & SPEC_BIT != 0 {
            age <= self.cfg.speculative_ttl_us
        } else {
            self.cfg.ttl_us.is_none_or(|ttl| age <= ttl)
        }
    }

    /// One descent: matches into `out`; with `record`, the slots of the leading keys that exist
    /// (up to the first missing key) into `path`.
    fn descend(
        &self,
        keys: &[BlockKey],
        now_us: u64,
        out: &mut Matches,
        path: &mut Vec<u32>,
        record: bool,
    ) {
        let now = now_us.min(TIME_MAX);
        let ttl = self.cfg.ttl_us.unwrap_or(u64::MAX);
        let spec_ttl = self.cfg.speculative_ttl_us;
        let nslots = self.slot_replica.len();
        out.clear();
        out.depth.clear();
        out.depth.resize(nslots, 0);
        let mut matching = nslots > 0;
        let limit = keys.len().min(self.cfg.node_cap);
        let mut probes = [Probe::default(); WARM_AHEAD];
        // The slots of the last two nodes found: a chain's nodes are mostly created together, so
        // they sit in consecutive slots (ascending when pushed or reused from the free stack
        // after a removal, descending when they replace an evicted chain tail). Keys found there
        // by their node's key skip the hash table, whose bucket would be one more random cache
        // line per block.
        let (mut last, mut before) = (NONE, NONE);
        'descent: for base in (0..limit).step_by(WARM_AHEAD) {
            let chunk = &keys[base..(base + WARM_AHEAD).min(limit)];
            let known = if last == NONE {
                0
            } else {
                let stride = if before != NONE && before == last.wrapping_add(1) {
                    -1
                } else {
                    1
                };
                self.slab.guess_run(chunk, last, stride, &mut probes)
            };
            self.table.prepare(chunk, &mut probes, known, &self.slab);
            for (j, &k) in chunk.iter().enumerate() {
                let found = if known & (1 << j) != 0 {
                    Some(probes[j].candidate)
                } else {
                    self.table.find_prepared(k, probes[j], &self.slab)
                };
                let Some(i) = found else {
                    break 'descent;
                };
                (before, last) = (last, i);
                if record {
                    path.push(i);
                }
                if matching {
                    let d = (base + j) as u32;
                    let mut advanced = false;
                    let node = self.slab.get(i);
                    let mut visit = |e: u64| {
                        let s = (e & SLOT_MASK) as usize;
                        let ttl = if e & SPEC_BIT != 0 { spec_ttl } else { ttl };
                        if s < nslots
                            && out.depth[s] == d
                            && now.saturating_sub(e >> TIME_SHIFT) <= ttl
                        {
                            out.depth[s] = d + 1;
                            advanced = true;
                        }
                    };
                    // Entries are packed: stop at the first empty one.
                    let [e0, e1, e2] = node.entries;
                    if e0 != EMPTY_ENTRY {
                        visit(e0);
                        if e1 != EMPTY_ENTRY {
                            visit(e1);
                            match node.overflow() {
                                Some(o) => self.overflow[o].iter().for_each(|&e| visit(e)),
                                None if e2 != EMPTY_ENTRY => visit(e2),
                                None => {}
                            }
                        }
                    }
                    if !advanced {
                        matching = false;
                        if !record {
                            break 'descent;
                        }
                    }
                }
            }
        }
        for (s, &d) in out.depth.iter().enumerate() {
            if d > 0
                && let Some(r) = self.slot_replica[s]
            {
                out.hits.push((r, d));
            }
        }
        out.hits.sort_unstable();
    }

    /// Places a chain (see the module rules). `path` holds the slots of the leading keys already
    /// found (all existing); entries are written on `keys[write_from..]`.
    fn place_chain(&mut self, keys: &[BlockKey], path: &mut Vec<u32>, write_from: usize, w: Write) {
        let limit = keys.len().min(self.cfg.node_cap);
        // 1. The known part, in one pass: mark it (stopping at a repeated node), fix its parent
        //    links before any eviction (a linked node must never be the parent of a detached
        //    one, or the LRU tail might not be a leaf), and detach it run by run: nodes already
        //    consecutive in the LRU list in chain order (a chain touched before) move as one.
        let known = path.len().min(limit);
        let mut n = 0;
        let (mut run_first, mut run_last, mut last_next) = (NONE, NONE, NONE);
        for &i in &path[..known] {
            let node = self.slab.get_mut(i);
            if node.children & IN_CHAIN != 0 {
                break;
            }
            node.children |= IN_CHAIN;
            let next = node.next;
            // `run_last` is the node before this one in the chain: its parent.
            if node.parent != run_last {
                self.set_parent(i, run_last);
            }
            if run_first == NONE {
                run_first = i;
            } else if last_next != i {
                self.unlink_run(run_first, run_last);
                run_first = i;
            }
            run_last = i;
            last_next = next;
            n += 1;
        }
        if run_first != NONE {
            self.unlink_run(run_first, run_last);
        }
        let repeated = n < known;
        path.truncate(n);
        // 2. The rest of the chain: existing nodes are detached, missing ones created (which may
        //    evict the least recent node outside the chain).
        if !repeated {
            while n < limit {
                let k = keys[n];
                let i = match self.table.find(k, &self.slab) {
                    Some(i) if self.slab.get(i).children & IN_CHAIN != 0 => break,
                    Some(i) => {
                        self.unlink_run(i, i);
                        i
                    }
                    None => self.new_node(k),
                };
                self.slab.get_mut(i).children |= IN_CHAIN;
                self.set_parent(i, if n == 0 { NONE } else { path[n - 1] });
                path.push(i);
                n += 1;
            }
        }
        if n == 0 {
            return;
        }
        // 3. Entries, unmark, and link the chain at the recent end in chain order (head most
        //    recent), writing links only where a run ends.
        for (j, &i) in path.iter().enumerate() {
            if j >= write_from {
                self.write_entry(i, w);
            }
            let node = self.slab.get_mut(i);
            node.children &= !IN_CHAIN;
            if let Some(&b) = path.get(j + 1)
                && node.next != b
            {
                node.next = b;
                self.slab.get_mut(b).prev = i;
            }
        }
        let (first, last) = (path[0], path[n - 1]);
        let old = self.head;
        self.slab.get_mut(first).prev = NONE;
        self.slab.get_mut(last).next = old;
        if old == NONE {
            self.tail = last;
        } else {
            self.slab.get_mut(old).prev = last;
        }
        self.head = first;
    }

    /// Detaches the consecutive list segment `first ..= last` (both linked, or `first == last`
    /// unlinked, which is a no-op).
    fn unlink_run(&mut self, first: u32, last: u32) {
        let prev = self.slab.get(first).prev;
        let next = self.slab.get(last).next;
        if prev == NONE {
            if self.head != first {
                return; // not linked
            }
            self.head = next;
        } else {
            self.slab.get_mut(prev).next = next;
        }
        if next == NONE {
            self.tail = prev;
        } else {
            self.slab.get_mut(next).prev = prev;
        }
        self.slab.get_mut(first).prev = NONE;
        self.slab.get_mut(last).next = NONE;
    }

    fn set_parent(&mut self, i: u32, want: u32) {
        let have = self.slab.get(i).parent;
        if have != want {
            if have != NONE {
                self.slab.get_mut(have).children -= 1;
            }
            if want != NONE {
                self.slab.get_mut(want).children += 1;
            }
            self.slab.get_mut(i).parent = want;
        }
    }

    fn new_node(&mut self, key: BlockKey) -> u32 {
        if self.len >= self.cfg.node_cap {
            self.evict_one();
        }
        let i = match self.free.pop() {
            Some(i) => i,
            None => self.slab.push(),
        };
        *self.slab.get_mut(i) = Node { key, ..Node::FREE };
        self.table.insert(key, i);
        self.len += 1;
        i
    }

    fn evict_one(&mut self) {
        let t = self.tail;
        debug_assert!(t != NONE, "cap reached with every node in the chain");
        if t == NONE {
            return;
        }
        debug_assert_eq!(self.slab.get(t).children, 0, "LRU tail must be a leaf");
        self.free_node(t);
        self.evictions += 1;
    }

    /// Frees node `i` (which must be linked and childless).
    fn free_node(&mut self, i: u32) {
        self.unlink(i);
        let node = *self.slab.get(i);
        self.table.remove(node.key, &self.slab);
        if let Some(o) = node.overflow() {
            self.overflow[o] = Vec::new();
            self.overflow_free.push(o as u32);
        }
        if node.parent != NONE {
            self.slab.get_mut(node.parent).children -= 1;
        }
        *self.slab.get_mut(i) = Node::FREE;
        self.free.push(i);
        self.len -= 1;
    }

    /// Frees `i` and then its ancestors while they have no entries and no children.
    fn reclaim_from(&mut self, mut i: u32) {
        loop {
            let n = self.slab.get(i);
            if !n.is_empty() || n.children > 0 {
                return;
            }
            let parent = n.parent;
            self.free_node(i);
            if parent == NONE {
                return;
            }
            i = parent;
        }
    }

    fn drop_slot_entries(&mut self, slot: u16) {
        // Walk oldest to newest: children are older than parents, so freeing cascades upwards
        // within one pass.
        let mut i = self.tail;
        while i != NONE {
            let newer = self.slab.get(i).prev;
            self.remove_entry(i, slot);
            let n = self.slab.get(i);
            if n.is_empty() && n.children == 0 {
                self.free_node(i);
            }
            i = newer;
        }
    }

    fn unlink(&mut self, i: u32) {
        self.unlink_run(i, i);
    }

    fn entry_count(&self, n: &Node) -> usize {
        match n.overflow() {
            Some(o) => 2 + self.overflow[o].len(),
            None => n.entries.iter().filter(|&&e| e != EMPTY_ENTRY).count(),
        }
    }

    fn write_entry(&mut self, i: u32, w: Write) {
        let now = w.now;
        let value = (now << TIME_SHIFT) | if w.speculative { SPEC_BIT } else { 0 } | w.slot as u64;
        // Fast path: the replica's entry comes first (a node held by one replica).
        if !w.speculative {
            let first = &mut self.slab.get_mut(i).entries[0];
            if *first != EMPTY_ENTRY && *first & SLOT_MASK == w.slot as u64 {
                *first = value;
                return;
            }
        }
        let keep =
            |this: &Self, old: u64| w.speculative && old & SPEC_BIT == 0 && this.alive(old, now);
        let node = *self.slab.get(i);
        // Existing entry of this slot?
        for k in 0..3 {
            let e = node.entries[k];
            if e == EMPTY_ENTRY {
                break;
            }
            if k == 2 && node.overflow().is_some() {
                break;
            }
            if e & SLOT_MASK == w.slot as u64 {
                if !keep(self, e) {
                    self.slab.get_mut(i).entries[k] = value;
                }
                return;
            }
        }
        if let Some(o) = node.overflow() {
            if let Some(pos) = self.overflow[o]
                .iter()
                .position(|&e| e & SLOT_MASK == w.slot as u64)
            {
                if !keep(self, self.overflow[o][pos]) {
                    self.overflow[o][pos] = value;
                }
            } else {
                self.overflow[o].push(value);
            }
            return;
        }
        // New entry.
        let n = self.slab.get_mut(i);
        if let Some(k) = n.entries.iter().position(|&e| e == EMPTY_ENTRY) {
            n.entries[k] = value;
            return;
        }
        let spilled = vec![n.entries[2], value];
        let o = match self.overflow_free.pop() {
            Some(o) => {
                self.overflow[o as usize] = spilled;
                o
            }
            None => {
                self.overflow.push(spilled);
                (self.overflow.len() - 1) as u32
            }
        };
        self.slab.get_mut(i).entries[2] = ((o as u64) << 32) | OVERFLOW_SLOT;
    }

    fn remove_entry(&mut self, i: u32, slot: u16) {
        let node = *self.slab.get(i);
        let s = slot as u64;
        if let Some(o) = node.overflow() {
            let v = &mut self.overflow[o];
            let victim = if node.entries[0] & SLOT_MASK == s {
                Some(0)
            } else if node.entries[1] & SLOT_MASK == s {
                Some(1)
            } else {
                None
            };
            match victim {
                Some(k) => {
                    let last = v.pop().unwrap_or(EMPTY_ENTRY);
                    self.slab.get_mut(i).entries[k] = last;
                }
                None => match v.iter().position(|&e| e & SLOT_MASK == s) {
                    Some(p) => {
                        v.swap_remove(p);
                    }
                    None => return,
                },
            }
            let v = &mut self.overflow[o];
            if v.len() == 1 {
                let only = v[0];
                self.overflow[o] = Vec::new();
                self.overflow_free.push(o as u32);
                self.slab.get_mut(i).entries[2] = only;
            }
            return;
        }
        let n = self.slab.get_mut(i);
        let Some(k) = n
            .entries
            .iter()
            .position(|&e| e != EMPTY_ENTRY && e & SLOT_MASK == s)
        else {
            return;
        };
        let last = n
            .entries
            .iter()
            .rposition(|&e| e != EMPTY_ENTRY)
            .unwrap_or(k);
        n.entries[k] = n.entries[last];
        n.entries[last] = EMPTY_ENTRY;
    }
}
