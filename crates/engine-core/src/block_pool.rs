//! vLLM v1's paged KV block pool with prefix caching.
//!
//! Blocks live in one array; the free ones form an intrusive doubly linked LRU queue (vLLM's
//! `FreeKVCacheBlockQueue`), so removal from the middle on a cache hit is O(1). Rules kept from
//! vLLM: block 0 is the null block and never handed out; only full blocks carry a hash; a freed
//! block keeps its hash and stays hit-able until its slot is popped for reuse (lazy eviction,
//! which is when `BlockRemoved` fires); never-cached blocks go to the front of the queue so they
//! are reused first; identical blocks are not deduplicated.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::kv_events::KvEvent;

/// Index of a block in the pool (0 is the null block).
pub type BlockId = u32;

const NIL: u32 = u32::MAX;

/// Block hashes are already uniformly mixed 64-bit values, so the map uses them as they are.
#[derive(Default)]
struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u64(&mut self, i: u64) {
        self.0 = i;
    }
}

type HashToBlocks = HashMap<u64, CachedSlot, BuildHasherDefault<IdentityHasher>>;

/// Blocks that carry one hash. Almost always one; several only when identical blocks were
/// computed concurrently (no dedup).
enum CachedSlot {
    One(BlockId),
    Many(Vec<BlockId>),
}

#[derive(Clone, Copy)]
struct Block {
    ref_cnt: u32,
    hash: u64,
    has_hash: bool,
    in_free: bool,
    prev: u32,
    next: u32,
}

/// The pool: blocks, the free queue and the hash → block map.
pub struct BlockPool {
    block_size: u32,
    blocks: Vec<Block>,
    head: u32,
    tail: u32,
    num_free: u32,
    cached: HashToBlocks,
    caching: bool,
    events_on: bool,
    events: Vec<KvEvent>,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks (block 0 reserved as the null block), all free and uncached.
    pub fn new(
        num_blocks: u32,
        block_size: u32,
        enable_caching: bool,
        enable_events: bool,
    ) -> Self {
        assert!(
            num_blocks >= 2,
            "a pool needs the null block and at least one more"
        );
        let mut pool = Self {
            block_size,
            blocks: vec![
                Block {
                    ref_cnt: 0,
                    hash: 0,
                    has_hash: false,
                    in_free: false,
                    prev: NIL,
                    next: NIL,
                };
                num_blocks as usize
            ],
            head: NIL,
            tail: NIL,
            num_free: 0,
            cached: HashToBlocks::default(),
            caching: enable_caching,
            events_on: enable_events,
            events: Vec::new(),
        };
        for id in 1..num_blocks {
            pool.push_back(id);
        }
        pool
    }

    /// Blocks in the pool, the null block included.
    pub fn num_blocks(&self) -> u32 {
        self.blocks.len() as u32
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Free blocks, cached-but-unreferenced ones included.
    pub fn num_free_blocks(&self) -> u32 {
        self.num_free
    }

    /// vLLM's `kv_cache_usage_perc`: `1 − free / (num_gpu_blocks − 1)`.
    pub fn usage(&self) -> f64 {
        1.0 - f64::from(self.num_free) / f64::from(self.num_blocks() - 1)
    }

    /// A block currently holding `hash`, if any (free or in use).
    pub fn lookup(&self, hash: u64) -> Option<BlockId> {
        match self.cached.get(&hash)? {
            CachedSlot::One(id) => Some(*id),
            CachedSlot::Many(ids) => ids.first().copied(),
        }
    }

    /// Takes a reference on each block; a free one leaves the free queue (a cache hit).
    pub fn touch(&mut self, ids: &[BlockId]) {
        for &id in ids {
            let b = self.blocks[id as usize];
            if b.ref_cnt == 0 && b.in_free {
                self.unlink(id);
            }
            self.blocks[id as usize].ref_cnt += 1;
        }
    }

    /// Pops `n` blocks from the front of the free queue into `out`, evicting any cached content
    /// they still hold. Returns false (taking nothing) when fewer than `n` are free.
    pub fn allocate(&mut self, n: u32, out: &mut Vec<BlockId>) -> bool {
        if n > self.num_free {
            return false;
        }
        for _ in 0..n {
            let id = self.head;
            self.unlink(id);
            if self.blocks[id as usize].has_hash {
                self.evict(id);
            }
            self.blocks[id as usize].ref_cnt = 1;
            out.push(id);
        }
        true
    }

    /// Drops one reference on each block of a request, visiting them tail-first so that a
    /// chain's deepest block is queued (and so evicted) before its parent. Unreferenced cached
    /// blocks go to the back of the queue, never-cached ones to the front.
    pub fn free_tail_first(&mut self, ids: &[BlockId]) {
        for &id in ids.iter().rev() {
            if id == 0 {
                continue;
            }
            let b = &mut self.blocks[id as usize];
            debug_assert!(b.ref_cnt > 0, "double free of block {id}");
            b.ref_cnt = b.ref_cnt.saturating_sub(1);
            if b.ref_cnt == 0 {
                if b.has_hash {
                    self.push_back(id);
                } else {
                    self.push_front(id);
                }
            }
        }
    }

    /// Marks `ids` (newly full blocks of one request, in chain order) as cached under `hashes`,
    /// and records one `BlockStored` for the run. `tokens` are exactly those blocks' tokens.
    pub fn cache_blocks(
        &mut self,
        ids: &[BlockId],
        hashes: &[u64],
        parent: Option<u64>,
        tokens: &[u32],
    ) {
        if !self.caching || ids.is_empty() {
            return;
        }
        debug_assert_eq!(ids.len(), hashes.len());
        for (&id, &h) in ids.iter().zip(hashes) {
            let b = &mut self.blocks[id as usize];
            debug_assert!(!b.has_hash, "block {id} cached twice");
            b.hash = h;
            b.has_hash = true;
            match self.cached.entry(h) {
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(CachedSlot::One(id));
                }
                std::collections::hash_map::Entry::Occupied(mut o) => {
                    let slot = o.get_mut();
                    match slot {
                        CachedSlot::One(first) => *slot = CachedSlot::Many(vec![*first, id]),
                        CachedSlot::Many(v) => v.push(id),
                    }
                }
            }
        }
        if self.events_on {
            self.events.push(KvEvent::BlockStored {
                block_hashes: hashes.to_vec(),
                parent_block_hash: parent,
                token_ids: tokens.to_vec(),
                block_size: self.block_size,
            });
        }
    }

    /// Clears the prefix cache if no block is in use (vLLM refuses otherwise), recording
    /// `AllBlocksCleared`. Returns whether it cleared.
    pub fn reset(&mut self) -> bool {
        if self.num_free != self.num_blocks() - 1 {
            return false;
        }
        self.cached.clear();
        for b in &mut self.blocks {
            b.has_hash = false;
        }
        if self.events_on {
            self.events.push(KvEvent::AllBlocksCleared);
        }
        true
    }

    /// Moves the events recorded since the last call into `out`.
    pub fn take_events(&mut self, out: &mut Vec<KvEvent>) {
        out.append(&mut self.events);
    }

    /// The hash a block carries, if it is cached.
    pub fn block_hash(&self, id: BlockId) -> Option<u64> {
        let b = &self.blocks[id as usize];
        b.has_hash.then_some(b.hash)
    }

    /// References held on a block.
    pub fn ref_count(&self, id: BlockId) -> u32 {
        self.blocks[id as usize].ref_cnt
    }

    /// Every hash currently in the prefix cache (for tests and event reconciliation).
    pub fn cached_hashes(&self) -> std::collections::HashSet<u64> {
        self.cached.keys().copied().collect()
    }

    /// Number of cached blocks (counting duplicates of one hash separately).
    pub fn num_cached_blocks(&self) -> usize {
        self.cached
            .values()
            .map(|s| match s {
                CachedSlot::One(_) => 1,
                CachedSlot::Many(v) => v.len(),
            })
            .sum()
    }

    /// The free queue from front (next reused) to back.
    pub fn free_queue(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.num_free as usize);
        let mut cur = self.head;
        while cur != NIL {
            out.push(cur);
            cur = self.blocks[cur as usize].next;
        }
        out
    }

    fn evict(&mut self, id: BlockId) {
        let h = self.blocks[id as usize].hash;
        self.blocks[id as usize].has_hash = false;
        if let std::collections::hash_map::Entry::Occupied(mut o) = self.cached.entry(h) {
            let remove = match o.get_mut() {
                CachedSlot::One(x) => *x == id,
                CachedSlot::Many(v) => {
                    v.retain(|&x| x != id);
                    if v.len() == 1 {
                        let only = v[0];
                        *o.get_mut() = CachedSlot::One(only);
                    }
                    false
                }
            };
            if remove {
                o.remove();
            }
        }
        if self.events_on {
            self.events.push(KvEvent::BlockRemoved {
                block_hashes: vec![h],
            });
        }
    }

    fn push_back(&mut self, id: BlockId) {
        let tail = self.tail;
        let b = &mut self.blocks[id as usize];
        b.prev = tail;
        b.next = NIL;
        b.in_free = true;
        if tail == NIL {
            self.head = id;
        } else {
            self.blocks[tail as usize].next = id;
        }
        self.tail = id;
        self.num_free += 1;
    }

    fn push_front(&mut self, id: BlockId) {
        let head = self.head;
        let b = &mut self.blocks[id as usize];
        b.prev = NIL;
        b.next = head;
        b.in_free = true;
        if head == NIL {
            self.tail = id;
        } else {
            self.blocks[head as usize].prev = id;
        }
        self.head = id;
        self.num_free += 1;
    }

    fn unlink(&mut self, id: BlockId) {
        let Block { prev, next, .. } = self.blocks[id as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let b = &mut self.blocks[id as usize];
        b.prev = NIL;
        b.next = NIL;
        b.in_free = false;
        self.num_free -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(n: u32) -> BlockPool {
        BlockPool::new(n, 4, true, true)
    }

    fn events(p: &mut BlockPool) -> Vec<KvEvent> {
        let mut v = Vec::new();
        p.take_events(&mut v);
        v
    }

    #[test]
    fn null_block_never_handed_out() {
        let mut p = pool(4);
        let mut out = Vec::new();
        assert!(p.allocate(3, &mut out));
        assert_eq!(out, vec![1, 2, 3]);
        assert!(!p.allocate(1, &mut out));
        assert_eq!(p.usage(), 1.0);
    }

    #[test]
    fn tail_first_free_and_uncached_to_front() {
        let mut p = pool(8);
        let mut a = Vec::new();
        assert!(p.allocate(4, &mut a)); // 1,2,3,4; queue now 5,6,7
        p.cache_blocks(&a[..3], &[10, 11, 12], None, &[0; 12]);
        p.free_tail_first(&a);
        // Block 4 never cached → front. Cached 3,2,1 appended tail-first after 5,6,7.
        assert_eq!(p.free_queue(), vec![4, 5, 6, 7, 3, 2, 1]);
        let mut b = Vec::new();
        assert!(p.allocate(5, &mut b));
        assert_eq!(b, vec![4, 5, 6, 7, 3]);
        // Deepest block evicted first, lazily at reuse.
        let ev = events(&mut p);
        assert_eq!(
            ev.last(),
            Some(&KvEvent::BlockRemoved {
                block_hashes: vec![12]
            })
        );
        assert_eq!(p.lookup(12), None);
        assert_eq!(p.lookup(11), Some(2));
    }

    #[test]
    fn hit_pulls_block_out_of_free_queue() {
        let mut p = pool(6);
        let mut a = Vec::new();
        p.allocate(2, &mut a);
        p.cache_blocks(&a, &[7, 8], None, &[0; 8]);
        p.free_tail_first(&a);
        assert_eq!(p.num_free_blocks(), 5);
        let hit = p.lookup(7).expect("cached");
        p.touch(&[hit]);
        assert_eq!(p.num_free_blocks(), 4);
        assert_eq!(p.ref_count(hit), 1);
        assert!(!p.free_queue().contains(&hit));
        // A second holder shares the block; freeing once keeps it out of the queue.
        p.touch(&[hit]);
        p.free_tail_first(&[hit]);
        assert!(!p.free_queue().contains(&hit));
        p.free_tail_first(&[hit]);
        assert_eq!(*p.free_queue().last().expect("non-empty"), hit);
    }

    #[test]
    fn no_dedup_and_eviction_of_one_duplicate_keeps_the_other() {
        let mut p = pool(4);
        let mut a = Vec::new();
        let mut b = Vec::new();
        p.allocate(1, &mut a);
        p.allocate(1, &mut b);
        p.cache_blocks(&a, &[5], None, &[1; 4]);
        p.cache_blocks(&b, &[5], None, &[1; 4]);
        assert_eq!(p.num_cached_blocks(), 2);
        assert_eq!(events(&mut p).len(), 2);
        p.free_tail_first(&a);
        p.free_tail_first(&b);
        // Queue: 3 (never used), then a, then b.
        let mut c = Vec::new();
        p.allocate(2, &mut c);
        assert_eq!(c, vec![3, a[0]]);
        assert_eq!(
            events(&mut p),
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![5]
            }]
        );
        assert_eq!(p.lookup(5), Some(b[0]));
    }

    #[test]
    fn reset_only_when_idle() {
        let mut p = pool(4);
        let mut a = Vec::new();
        p.allocate(1, &mut a);
        p.cache_blocks(&a, &[5], None, &[1; 4]);
        assert!(!p.reset());
        p.free_tail_first(&a);
        events(&mut p);
        assert!(p.reset());
        assert_eq!(events(&mut p), vec![KvEvent::AllBlocksCleared]);
        assert!(p.cached_hashes().is_empty());
        // A cleared block is reused without a removal event.
        let mut b = Vec::new();
        p.allocate(3, &mut b);
        assert!(events(&mut p).is_empty());
    }
}
