//! Policies without a residency index: `round-robin`, `random`, `least-outstanding`,
//! `session-affinity`, `session-bounded`, `prefix-hash`.

use crate::ring::{Ring, bound, session_point};
use crate::{
    Branch, Chooser, Decision, Keying, Policy, PolicySpec, ReplicaView, RouteError, RouteRequest,
    ServedNeeds, plain,
};

/// `round-robin`: the next eligible replica in fleet order after the previous choice.
#[derive(Clone, Debug, Default)]
pub struct RoundRobin {
    cursor: usize,
}

impl RoundRobin {
    /// Starts at the first replica.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Policy for RoundRobin {
    fn name(&self) -> &str {
        "round-robin"
    }
    fn keying(&self) -> Keying {
        Keying::None
    }

    fn served_needs(&self) -> ServedNeeds {
        // No `on_served`: the decision is all this policy keeps.
        ServedNeeds::Never
    }
    fn decide(
        &mut self,
        _: &RouteRequest<'_>,
        fleet: &[ReplicaView],
    ) -> Result<Decision, RouteError> {
        let n = fleet.len();
        for k in 0..n {
            let i = (self.cursor + k) % n;
            if fleet[i].eligible() {
                self.cursor = (i + 1) % n;
                return Ok(plain(fleet, i, Branch::Rr));
            }
        }
        Err(RouteError::NoEligibleReplica)
    }
}

/// `random`: a seeded uniform draw over the eligible replicas, the usual baseline of published
/// router comparisons. Unlike round-robin it does not lock into a cyclic prompt order: with 8
/// replicas and prompts cycled in a stage whose length is a multiple of 8, round-robin sends
/// each prompt to the same replica every time, which a random draw does not.
#[derive(Clone, Debug)]
pub struct Random {
    chooser: Chooser,
}

impl Random {
    /// Draws from `seed`.
    pub fn new(seed: u64) -> Self {
        Random {
            chooser: Chooser::new(seed),
        }
    }
}

impl Policy for Random {
    fn name(&self) -> &str {
        "random"
    }
    fn keying(&self) -> Keying {
        Keying::None
    }

    fn served_needs(&self) -> ServedNeeds {
        // No `on_served`: the draw is all this policy keeps.
        ServedNeeds::Never
    }
    fn decide(
        &mut self,
        _: &RouteRequest<'_>,
        fleet: &[ReplicaView],
    ) -> Result<Decision, RouteError> {
        let i = self
            .chooser
            .uniform(fleet)
            .ok_or(RouteError::NoEligibleReplica)?;
        Ok(plain(fleet, i, Branch::Random))
    }
}

/// `least-outstanding`: fewest outstanding; ties broken by a seeded draw.
#[derive(Clone, Debug)]
pub struct LeastOutstanding {
    chooser: Chooser,
}

impl LeastOutstanding {
    /// Tie-breaks drawn from `seed`.
    pub fn new(seed: u64) -> Self {
        LeastOutstanding {
            chooser: Chooser::new(seed),
        }
    }
}

impl Policy for LeastOutstanding {
    fn name(&self) -> &str {
        "least-outstanding"
    }
    fn keying(&self) -> Keying {
        Keying::None
    }

    fn served_needs(&self) -> ServedNeeds {
        // No `on_served`: the decision is all this policy keeps.
        ServedNeeds::Never
    }
    fn decide(
        &mut self,
        _: &RouteRequest<'_>,
        fleet: &[ReplicaView],
    ) -> Result<Decision, RouteError> {
        least_outstanding(&mut self.chooser, fleet)
    }
}

/// `session-affinity` (no load bound) and `session-bounded` (bounded loads, factor `c`):
/// a consistent-hash ring keyed by the session id. Requests without a session id go to the
/// least outstanding replica (branch `least`).
#[derive(Clone, Debug)]
pub struct SessionAffinity {
    ring: Ring,
    bounded: bool,
    load_factor: f64,
    chooser: Chooser,
}

impl SessionAffinity {
    /// From the spec's ring size, load factor and seed; `bounded` selects session-bounded.
    pub fn new(spec: &PolicySpec, bounded: bool) -> Self {
        SessionAffinity {
            ring: Ring::new(spec.virtual_nodes),
            bounded,
            load_factor: spec.load_factor,
            chooser: Chooser::new(spec.seed),
        }
    }
}

impl Policy for SessionAffinity {
    fn name(&self) -> &str {
        if self.bounded {
            "session-bounded"
        } else {
            "session-affinity"
        }
    }
    fn keying(&self) -> Keying {
        Keying::None
    }

    fn served_needs(&self) -> ServedNeeds {
        // No `on_served`: the decision is all this policy keeps.
        ServedNeeds::Never
    }
    fn decide(
        &mut self,
        req: &RouteRequest<'_>,
        fleet: &[ReplicaView],
    ) -> Result<Decision, RouteError> {
        let Some(session) = req.session_id else {
            return least_outstanding(&mut self.chooser, fleet);
        };
        ring_decide(
            &mut self.ring,
            session_point(session),
            fleet,
            self.bounded.then_some(self.load_factor),
        )
    }
}

/// The eligible replica with the fewest outstanding requests, ties drawn by `chooser`
/// (branch `least`): `least-outstanding` itself and the fallback of the keyed policies.
fn least_outstanding(chooser: &mut Chooser, fleet: &[ReplicaView]) -> Result<Decision, RouteError> {
    let i = chooser
        .least(fleet, |_, _| true)
        .ok_or(RouteError::NoEligibleReplica)?;
    Ok(plain(fleet, i, Branch::Least))
}

fn ring_decide(
    ring: &mut Ring,
    point: u64,
    fleet: &[ReplicaView],
    load_factor: Option<f64>,
) -> Result<Decision, RouteError> {
    let limit = match load_factor {
        Some(c) => Some(bound(fleet, c).ok_or(RouteError::NoEligibleReplica)?),
        None => None,
    };
    ring.sync(fleet);
    let pick = ring
        .pick(point, fleet, limit)
        .ok_or(RouteError::NoEligibleReplica)?;
    let branch = if pick.owner {
        Branch::Ring
    } else {
        Branch::RingWalk
    };
    Ok(plain(fleet, pick.index, branch))
}

/// `prefix-hash`: stateless; the key of the prompt's leading `prefix_hash_blocks` blocks (a
/// chained key names its whole prefix) placed on the bounded-load ring. Prompts shorter than
/// one block go to the least outstanding replica (branch `least`).
#[derive(Clone, Debug)]
pub struct PrefixHash {
    ring: Ring,
    blocks: usize,
    load_factor: f64,
    chooser: Chooser,
}

impl PrefixHash {
    /// From the spec's ring size, prefix length, load factor and seed.
    pub fn new(spec: &PolicySpec) -> Self {
        PrefixHash {
            ring: Ring::new(spec.virtual_nodes),
            blocks: spec.prefix_hash_blocks as usize,
            load_factor: spec.load_factor,
            chooser: Chooser::new(spec.seed),
        }
    }
}

impl Policy for PrefixHash {
    fn name(&self) -> &str {
        "prefix-hash"
    }
    fn keying(&self) -> Keying {
        Keying::BeliefBytes
    }

    fn served_needs(&self) -> ServedNeeds {
        // No `on_served`: the decision is all this policy keeps.
        ServedNeeds::Never
    }
    fn decide(
        &mut self,
        req: &RouteRequest<'_>,
        fleet: &[ReplicaView],
    ) -> Result<Decision, RouteError> {
        let n = req.block_keys.len().min(self.blocks);
        if n == 0 {
            return least_outstanding(&mut self.chooser, fleet);
        }
        // Block keys are already uniform 64-bit hashes; remix so the ring position is not the
        // index's own bucket position.
        let point = req.block_keys[n - 1]
            .wrapping_mul(0xD6E8_FEB8_6659_FD93)
            .rotate_left(29);
        ring_decide(&mut self.ring, point, fleet, Some(self.load_factor))
    }
}
