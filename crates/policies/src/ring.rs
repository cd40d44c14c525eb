//! Consistent-hash ring with optional bounded loads (Mirrokni, Thorup, Zadimoghaddam 2016).
//!
//! Each replica owns `virtual_nodes` points at `xxh3(id, v)`; a key goes to the first point at or
//! after its hash, clockwise. The ring covers every replica in the fleet view, eligible or not, so
//! a replica that is briefly unhealthy or draining only diverts its own keys, and keys return when
//! it comes back. The ring is rebuilt lazily when the fleet's ids change.

use crate::ReplicaView;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

const POINT_SEED: u64 = 0x7269_6e67_706f_696e;

/// Hash of a session id onto the ring.
pub fn session_point(session_id: &str) -> u64 {
    xxh3_64(session_id.as_bytes())
}

/// The ring.
#[derive(Clone, Debug, Default)]
pub struct Ring {
    virtual_nodes: u32,
    /// Fleet ids in fleet order when last built: the ring stores fleet indices.
    ids: Vec<u32>,
    /// (point, fleet index), sorted by point.
    points: Vec<(u64, u32)>,
    /// Scratch: which fleet indices were already rejected during one walk.
    seen: Vec<bool>,
}

/// Outcome of a ring walk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingPick {
    /// Fleet index of the chosen replica.
    pub index: usize,
    /// Whether it is the key's owner (else the walk went past ineligible or full replicas).
    pub owner: bool,
}

impl Ring {
    /// An empty ring with `virtual_nodes` points per replica.
    pub fn new(virtual_nodes: u32) -> Self {
        Ring {
            virtual_nodes: virtual_nodes.max(1),
            ..Ring::default()
        }
    }

    /// Rebuilds when the fleet's ids (or their order) changed since the last call.
    pub fn sync(&mut self, fleet: &[ReplicaView]) {
        if self.ids.len() == fleet.len() && self.ids.iter().zip(fleet).all(|(a, r)| *a == r.id) {
            return;
        }
        self.ids = fleet.iter().map(|r| r.id).collect();
        self.points.clear();
        for (i, r) in fleet.iter().enumerate() {
            for v in 0..self.virtual_nodes {
                let mut b = [0u8; 8];
                b[..4].copy_from_slice(&r.id.to_le_bytes());
                b[4..].copy_from_slice(&v.to_le_bytes());
                self.points
                    .push((xxh3_64_with_seed(&b, POINT_SEED), i as u32));
            }
        }
        // Ties on a point are broken by id so the order never depends on fleet order.
        let ids = &self.ids;
        self.points
            .sort_unstable_by_key(|&(p, i)| (p, ids[i as usize]));
        self.seen = vec![false; fleet.len()];
    }

    /// The first replica clockwise from `point` that is eligible and, when `bound` is given,
    /// has `outstanding + 1 ≤ bound`. `None` when no replica qualifies. Call [`sync`](Self::sync)
    /// with the same fleet first.
    pub fn pick(
        &mut self,
        point: u64,
        fleet: &[ReplicaView],
        bound: Option<u32>,
    ) -> Option<RingPick> {
        if self.points.is_empty() {
            return None;
        }
        let start = self.points.partition_point(|&(p, _)| p < point);
        let n = self.points.len();
        let mut owner = true;
        let mut rejected = 0;
        let mut result = None;
        for k in 0..n {
            let i = self.points[(start + k) % n].1 as usize;
            if self.seen[i] {
                continue;
            }
            let r = &fleet[i];
            let fits = bound.is_none_or(|b| r.outstanding < b); // outstanding + 1 ≤ bound
            if r.eligible() && fits {
                result = Some(RingPick { index: i, owner });
                break;
            }
            owner = false;
            self.seen[i] = true;
            rejected += 1;
            if rejected == fleet.len() {
                break;
            }
        }
        self.seen.iter_mut().for_each(|s| *s = false);
        result
    }
}

/// The bounded-load allowance `⌈c·(total+1)/n⌉` over the eligible replicas (total = their
/// outstanding sum, n = their count); `None` when none is eligible.
pub fn bound(fleet: &[ReplicaView], c: f64) -> Option<u32> {
    let (n, total) = fleet
        .iter()
        .filter(|r| r.eligible())
        .fold((0u64, 0u64), |(n, t), r| (n + 1, t + r.outstanding as u64));
    if n == 0 {
        return None;
    }
    // The epsilon keeps float noise (1.25 × 4 / 5 = 1.0000000000000002) from adding a whole
    // request to the allowance.
    let b = (c * (total + 1) as f64 / n as f64 - 1e-9).ceil().max(1.0);
    Some(b.min(u32::MAX as f64) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loads(l: &[u32]) -> Vec<ReplicaView> {
        l.iter()
            .enumerate()
            .map(|(i, &o)| ReplicaView {
                outstanding: o,
                ..ReplicaView::idle(i as u32)
            })
            .collect()
    }

    #[test]
    fn bound_is_the_exact_ceiling() {
        assert_eq!(bound(&loads(&[0; 5]), 1.25), Some(1));
        // 1.25 × 4 / 5 is 1.0000000000000002 in floating point: still 1.
        assert_eq!(bound(&loads(&[3, 0, 0, 0, 0]), 1.25), Some(1));
        assert_eq!(bound(&loads(&[4; 5]), 1.25), Some(6));
        assert_eq!(bound(&loads(&[10, 0]), 2.0), Some(11));
        let mut down = loads(&[100, 1]);
        down[0].healthy = false;
        assert_eq!(bound(&down, 1.25), Some(3), "only eligible replicas count");
        down[1].draining = true;
        assert_eq!(bound(&down, 1.25), None);
    }

    #[test]
    fn a_walk_skips_full_and_ineligible_replicas_once_each() {
        let mut f = loads(&[5, 0, 0]);
        let mut ring = Ring::new(150);
        ring.sync(&f);
        let p = session_point("k");
        let owner = ring.pick(p, &f, None).unwrap();
        assert!(owner.owner);
        f[owner.index].healthy = false;
        let walked = ring.pick(p, &f, None).unwrap();
        assert!(!walked.owner && walked.index != owner.index);
        for r in f.iter_mut() {
            r.healthy = true;
            r.outstanding = 9;
        }
        assert_eq!(ring.pick(p, &f, Some(9)), None, "everyone is full");
    }
}
