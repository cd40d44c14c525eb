//! `prefix-affinity` (believed residency) and `exact-residency` (residency from engine KV events),
//! with their arms (`prefix-affinity-spill-off`, `exact-residency-spec`).
//!
//! Decision, shared by both:
//! 1. the longest match over eligible replicas; none → least outstanding (`miss`);
//! 2. among the replicas holding it, the least outstanding (`match`, or `tie` when several);
//! 3. spill (load branch, when on): decline the match when `matched − least > spill_abs` and
//!    `matched > spill_ratio × least` (outstanding requests), and send to the least loaded
//!    (`spill-load`);
//! 4. residency branch (when on): decline a match on a replica whose KV usage is above the
//!    threshold, and send to the least loaded other replica (`spill-residency`).
//!
//! Prefix-affinity inserts the chosen replica in the same index descent as the lookup, so a
//! burst sharing a new prefix sees it at once, and [`Policy::on_served`] inserts the replica
//! that really served when a retry moved the request; [`Policy::on_peer_served`] inserts a peer
//! router's decision the same way (N routers over one fleet, each sharing its decisions).
//! Exact-residency's index is fed only by KV events; its speculative arm inserts the chosen
//! replica's blocks as speculative entries (short TTL) until the engine's `BlockStored` confirms
//! them.

use crate::{
    Branch, Chooser, Decision, Keying, Policy, PolicySpec, ReplicaId, ReplicaView, RouteError,
    RouteRequest, ServedNeeds, SpillCheck, min_outstanding,
};
use kv_index::{IndexConfig, IndexStats, KvEvent, Matches, PrefixIndex};

/// Where the index's knowledge comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexMode {
    /// What the router sent (belief keys, sliding TTL).
    Belief,
    /// Engine KV events (exact keys, no TTL), optionally with a speculative layer.
    Exact {
        /// Insert the chosen replica's blocks as speculative entries.
        speculative: bool,
    },
}

/// Direct-mapped memory of recent decisions, so `on_served` skips re-inserting what `decide`
/// already inserted for the same replica.
const RECENT: usize = 1024;

/// `prefix-affinity`, `prefix-affinity-spill-off`, `exact-residency`, `exact-residency-spec`.
#[derive(Debug)]
pub struct PrefixPolicy {
    name: String,
    mode: IndexMode,
    spill: bool,
    spill_abs: u32,
    spill_ratio: f64,
    residency_branch: bool,
    residency_kv_usage: f32,
    index: PrefixIndex,
    matches: Matches,
    fleet_blocks: FleetBlocks,
    chooser: Chooser,
    recent: Vec<(u64, ReplicaId)>,
    event_errors: u64,
    /// Engine block size: predicted tokens are rounded down to whole engine blocks.
    engine_block_tokens: u32,
}

impl PrefixPolicy {
    /// Builds the policy; `spill` switches the load branch.
    pub fn new(
        spec: &PolicySpec,
        mode: IndexMode,
        spill: bool,
    ) -> Result<Self, crate::spec::SpecError> {
        let cfg = IndexConfig {
            node_cap: spec.index_node_cap,
            ttl_us: match mode {
                IndexMode::Belief => Some(spec.index_ttl_us),
                IndexMode::Exact { .. } => None,
            },
            speculative_ttl_us: spec.speculative_ttl_us,
            salt: spec.salt.as_bytes().to_vec(),
            tokens_per_block: spec.tokens_per_block,
        };
        let name = match mode {
            IndexMode::Belief if spill => "prefix-affinity",
            IndexMode::Belief => "prefix-affinity-spill-off",
            IndexMode::Exact { speculative: false } => "exact-residency",
            IndexMode::Exact { speculative: true } => "exact-residency-spec",
        };
        Ok(PrefixPolicy {
            name: name.to_string(),
            mode,
            spill,
            spill_abs: spec.spill_abs,
            spill_ratio: spec.spill_ratio,
            residency_branch: spec.residency_branch,
            residency_kv_usage: spec.residency_kv_usage,
            index: PrefixIndex::new(cfg)?,
            matches: Matches::new(),
            fleet_blocks: FleetBlocks::default(),
            chooser: Chooser::new(spec.seed),
            recent: vec![(0, ReplicaId::MAX); RECENT],
            event_errors: 0,
            engine_block_tokens: spec.tokens_per_block,
        })
    }

    /// The residency index (read-only; for diagnostics and tests).
    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    /// Index statistics.
    pub fn index_stats(&self) -> IndexStats {
        self.index.stats()
    }

    /// KV events the index refused (unknown parent, block-size mismatch, …) since creation.
    pub fn event_errors(&self) -> u64 {
        self.event_errors
    }

    fn fingerprint(keys: &[u64]) -> u64 {
        keys.last().copied().unwrap_or(0) ^ (keys.len() as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }

    /// Inserts `keys` on `replica` unless the last decision with the same fingerprint already
    /// put them there (what `decide` inserted in its own descent is not inserted twice).
    fn insert_served(&mut self, keys: &[u64], replica: ReplicaId, now_us: u64, speculative: bool) {
        if keys.is_empty() {
            return;
        }
        let fp = Self::fingerprint(keys);
        if self.recent[(fp % RECENT as u64) as usize] == (fp, replica) {
            return;
        }
        // An index refusal (too many replicas) only loses the belief.
        let _ = if speculative {
            self.index.insert_speculative(replica, keys, now_us)
        } else {
            self.index.insert(replica, keys, now_us)
        };
        Self::remember(&mut self.recent, keys, replica);
    }

    fn remember(recent: &mut [(u64, ReplicaId)], keys: &[u64], replica: ReplicaId) {
        let fp = Self::fingerprint(keys);
        recent[(fp % RECENT as u64) as usize] = (fp, replica);
    }
}

/// Per fleet position, the blocks the lookup matched: the lookup's hits (sorted by id) merged
/// with the fleet's ids (sorted once per fleet change), O(fleet + hits) per decision rather
/// than O(fleet × hits) — a shared system prompt is held by every replica of a large fleet.
#[derive(Clone, Debug, Default)]
struct FleetBlocks {
    ids: Vec<ReplicaId>,
    sorted: Vec<(ReplicaId, usize)>,
    blocks: Vec<u32>,
}

impl FleetBlocks {
    fn fill(&mut self, m: &Matches, fleet: &[ReplicaView]) -> &[u32] {
        if self.ids.len() != fleet.len() || self.ids.iter().zip(fleet).any(|(a, r)| *a != r.id) {
            self.ids = fleet.iter().map(|r| r.id).collect();
            self.sorted = fleet.iter().enumerate().map(|(i, r)| (r.id, i)).collect();
            self.sorted.sort_unstable();
        }
        self.blocks.clear();
        self.blocks.resize(fleet.len(), 0);
        let mut hits = m.hits().iter().peekable();
        for &(id, pos) in &self.sorted {
            while hits.next_if(|h| h.0 < id).is_some() {}
            if let Some(&&(hid, b)) = hits.peek()
                && hid == id
            {
                self.blocks[pos] = b;
            }
        }
        &self.blocks
    }
}

/// The decision rule on a lookup result, given per fleet position as `blocks` (see the module
/// documentation).
#[allow(clippy::too_many_arguments)]
fn choose(
    blocks: &[u32],
    fleet: &[ReplicaView],
    chooser: &mut Chooser,
    spill: bool,
    spill_abs: u32,
    spill_ratio: f64,
    residency: Option<f32>,
    tokens_per_block: f64,
    engine_block_tokens: u32,
) -> Option<Decision> {
    let min_out = min_outstanding(fleet);
    let best = fleet
        .iter()
        .zip(blocks)
        .filter(|(r, _)| r.eligible())
        .map(|(_, &b)| b)
        .max()
        .unwrap_or(0);
    let decision = |i: usize, branch: Branch, spill: Option<SpillCheck>| Decision {
        replica: fleet[i].id,
        branch,
        predicted_match_blocks: blocks[i],
        predicted_match_tokens: crate::predicted_tokens(
            blocks[i],
            tokens_per_block,
            engine_block_tokens,
        ),
        outstanding_chosen: fleet[i].outstanding,
        outstanding_min: min_out,
        spill,
    };
    if best == 0 {
        let i = chooser.least(fleet, |_, _| true)?;
        return Some(decision(i, Branch::Miss, None));
    }
    let holders = fleet
        .iter()
        .zip(blocks)
        .filter(|(r, b)| r.eligible() && **b == best)
        .count();
    let matched = chooser.least(fleet, |i, _| blocks[i] == best)?;
    let branch = if holders > 1 {
        Branch::Tie
    } else {
        Branch::Match
    };
    if !spill && residency.is_none() {
        return Some(decision(matched, branch, None));
    }
    let least = chooser.least(fleet, |_, _| true)?;
    let (mo, lo) = (fleet[matched].outstanding, fleet[least].outstanding);
    let mut check = SpillCheck {
        matched_replica: fleet[matched].id,
        matched_outstanding: mo,
        least_replica: fleet[least].id,
        least_outstanding: lo,
        spill_abs,
        spill_ratio,
        matched_kv_usage: None,
        spilled: false,
    };
    if spill && mo.saturating_sub(lo) > spill_abs && mo as f64 > spill_ratio * lo as f64 {
        check.spilled = true;
        return Some(decision(least, Branch::SpillLoad, Some(check)));
    }
    if let Some(threshold) = residency {
        let usage = fleet[matched].kv_usage;
        check.matched_kv_usage = usage;
        if usage.is_some_and(|u| u > threshold) {
            let other = fleet[matched].id;
            if let Some(i) = chooser.least(fleet, |_, r| r.id != other) {
                check.spilled = true;
                check.least_replica = fleet[i].id;
                check.least_outstanding = fleet[i].outstanding;
                return Some(decision(i, Branch::SpillResidency, Some(check)));
            }
        }
    }
    Some(decision(matched, branch, Some(check)))
}

impl Policy for PrefixPolicy {
    fn name(&self) -> &str {
        &self.name
    }

    fn keying(&self) -> Keying {
        match self.mode {
            IndexMode::Belief => Keying::BeliefBytes,
            IndexMode::Exact { .. } => Keying::ExactTokens,
        }
    }

    fn decide(
        &mut self,
        req: &RouteRequest<'_>,
        fleet: &[ReplicaView],
    ) -> Result<Decision, RouteError> {
        let PrefixPolicy {
            mode,
            spill,
            spill_abs,
            spill_ratio,
            residency_branch,
            residency_kv_usage,
            index,
            matches,
            fleet_blocks,
            chooser,
            recent,
            engine_block_tokens,
            ..
        } = self;
        let residency = residency_branch.then_some(*residency_kv_usage);
        let mut rule = |m: &Matches| {
            choose(
                fleet_blocks.fill(m, fleet),
                fleet,
                chooser,
                *spill,
                *spill_abs,
                *spill_ratio,
                residency,
                req.tokens_per_block,
                *engine_block_tokens,
            )
        };
        let keys = req.block_keys;
        let inserts = match *mode {
            IndexMode::Belief => Some(false),
            IndexMode::Exact { speculative: true } => Some(true),
            IndexMode::Exact { speculative: false } => None,
        };
        let decision = match inserts {
            Some(speculative) if !keys.is_empty() => {
                let mut made = None;
                // An index refusal (too many replicas) only loses the belief, not the request.
                let _ = index.lookup_insert(keys, req.now_us, matches, |m| {
                    made = rule(m);
                    made.map(|d| (d.replica, speculative))
                });
                if let Some(d) = made {
                    Self::remember(recent, keys, d.replica);
                }
                made
            }
            _ => {
                index.lookup(keys, req.now_us, matches);
                rule(matches)
            }
        };
        decision.ok_or(RouteError::NoEligibleReplica)
    }

    fn served_needs(&self) -> ServedNeeds {
        match self.mode {
            // `decide` inserted the keys for its choice (and remembered them in `recent`, so
            // `on_served` for the same replica returns at once); only a retry's replica is new.
            IndexMode::Belief | IndexMode::Exact { speculative: true } => ServedNeeds::WhenMoved,
            // The engines' events are the only truth.
            IndexMode::Exact { speculative: false } => ServedNeeds::Never,
        }
    }

    fn on_served(&mut self, req: &RouteRequest<'_>, replica: ReplicaId) {
        let speculative = match self.mode {
            IndexMode::Belief => false,
            IndexMode::Exact { speculative: true } => true,
            IndexMode::Exact { speculative: false } => return,
        };
        self.insert_served(req.block_keys, replica, req.now_us, speculative);
    }

    /// A peer router's decision joins the believed index exactly as this router's own
    /// [`Policy::on_served`] would (same `recent` dedup); exact modes ignore it, their truth being
    /// the engines' KV events, which every router receives itself.
    fn on_peer_served(&mut self, block_keys: &[u64], replica: ReplicaId, now_us: u64) {
        if self.mode == IndexMode::Belief {
            self.insert_served(block_keys, replica, now_us, false);
        }
    }

    fn on_kv_event(&mut self, replica: ReplicaId, event: &KvEvent, now_us: u64) {
        if let IndexMode::Exact { .. } = self.mode
            && self.index.apply_event(replica, event, now_us).is_err()
        {
            self.event_errors += 1;
        }
    }

    fn on_replica_removed(&mut self, replica: ReplicaId) {
        self.index.remove_replica(replica);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_index::IndexConfig;

    #[test]
    fn fleet_blocks_align_hits_with_fleet_positions() {
        let mut idx = PrefixIndex::new(IndexConfig::default()).unwrap();
        let keys = [1u64, 2, 3];
        idx.insert(7, &keys, 0).unwrap();
        idx.insert(3, &keys[..2], 0).unwrap();
        idx.insert(99, &keys[..1], 0).unwrap(); // not in the fleet
        let mut m = Matches::new();
        idx.lookup(&keys, 0, &mut m);
        let fleet: Vec<ReplicaView> = [12u32, 7, 0, 3]
            .into_iter()
            .map(ReplicaView::idle)
            .collect();
        let mut fb = FleetBlocks::default();
        assert_eq!(fb.fill(&m, &fleet), &[0, 3, 0, 2]);
        // Reordered and shrunk fleets are re-indexed.
        let fleet: Vec<ReplicaView> = [3u32, 99].into_iter().map(ReplicaView::idle).collect();
        assert_eq!(fb.fill(&m, &fleet), &[2, 1]);
    }

    #[test]
    fn a_prefix_held_by_a_large_fleet_ties_to_the_least_loaded() {
        let mut p = PrefixPolicy::new(&PolicySpec::default(), IndexMode::Belief, true).unwrap();
        let mut fleet: Vec<ReplicaView> = (0..500u32)
            .map(|id| ReplicaView {
                outstanding: 3 + id % 7,
                ..ReplicaView::idle(id)
            })
            .collect();
        fleet[321].outstanding = 0;
        let keys = [5u64, 6, 7, 8];
        for r in 0..500 {
            let req = RouteRequest {
                session_id: None,
                block_keys: &keys,
                tokens_per_block: 16.0,
                now_us: 0,
            };
            p.on_served(&req, r);
        }
        let req = RouteRequest {
            session_id: None,
            block_keys: &keys,
            tokens_per_block: 16.0,
            now_us: 1,
        };
        let d = p.decide(&req, &fleet).unwrap();
        assert_eq!(
            (d.replica, d.branch, d.predicted_match_blocks),
            (321, Branch::Tie, 4)
        );
    }

    fn req(keys: &[u64], now_us: u64) -> RouteRequest<'_> {
        RouteRequest {
            session_id: None,
            block_keys: keys,
            tokens_per_block: 16.0,
            now_us,
        }
    }

    #[test]
    fn a_peer_decision_joins_the_believed_index_like_an_own_one() {
        let fleet: Vec<ReplicaView> = (0..3u32).map(ReplicaView::idle).collect();
        let turn1 = [10u64, 11, 12];
        let turn2 = [10u64, 11, 12, 13, 14];
        // Without the peer's decision, turn 2 is a miss.
        let mut alone = PrefixPolicy::new(&PolicySpec::default(), IndexMode::Belief, true).unwrap();
        assert_eq!(
            alone.decide(&req(&turn2, 5), &fleet).unwrap().branch,
            Branch::Miss
        );
        // A peer served turn 1 on replica 2: turn 2 matches it there.
        let mut p = PrefixPolicy::new(&PolicySpec::default(), IndexMode::Belief, true).unwrap();
        p.on_peer_served(&turn1, 2, 1);
        let d = p.decide(&req(&turn2, 5), &fleet).unwrap();
        assert_eq!(
            (
                d.replica,
                d.branch,
                d.predicted_match_blocks,
                d.predicted_match_tokens
            ),
            (2, Branch::Match, 3, 48)
        );
        // Empty keys are ignored.
        let len = p.index().len();
        p.on_peer_served(&[], 1, 6);
        assert_eq!(p.index().len(), len);
    }

    #[test]
    fn a_peer_decision_expires_on_the_receivers_ttl_clock() {
        let spec = PolicySpec::default();
        let ttl = spec.index_ttl_us;
        let fleet: Vec<ReplicaView> = (0..2u32).map(ReplicaView::idle).collect();
        let keys = [7u64, 8];
        let mut p = PrefixPolicy::new(&spec, IndexMode::Belief, true).unwrap();
        p.on_peer_served(&keys, 1, 1_000);
        assert_eq!(
            p.decide(&req(&keys, 1_000 + ttl / 2), &fleet)
                .unwrap()
                .branch,
            Branch::Match
        );
        let mut q = PrefixPolicy::new(&spec, IndexMode::Belief, true).unwrap();
        q.on_peer_served(&keys, 1, 1_000);
        assert_eq!(
            q.decide(&req(&keys, 1_000 + ttl + 1), &fleet)
                .unwrap()
                .branch,
            Branch::Miss
        );
    }

    #[test]
    fn a_repeated_peer_decision_is_deduplicated_and_exact_modes_ignore_peers() {
        let spec = PolicySpec::default();
        let keys = [21u64, 22, 23];
        let mut p = PrefixPolicy::new(&spec, IndexMode::Belief, true).unwrap();
        p.on_peer_served(&keys, 0, 1);
        let once = p.index_stats().entries;
        assert_eq!(once, 3);
        // The same decision again is skipped by the `recent` memory.
        p.on_peer_served(&keys, 0, 2);
        assert_eq!(p.index_stats().entries, once);
        // The same keys on another replica are a new decision.
        p.on_peer_served(&keys, 1, 3);
        assert_eq!(p.index_stats().entries, 2 * once);
        for speculative in [false, true] {
            let mut e = PrefixPolicy::new(&spec, IndexMode::Exact { speculative }, true).unwrap();
            e.on_peer_served(&keys, 0, 1);
            assert!(e.index().is_empty(), "exact residency takes only KV events");
        }
    }
}
