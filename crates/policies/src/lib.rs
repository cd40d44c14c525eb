//! `policies`: the routing policies of kvroute.
//!
//! A [`Policy`] decides, from a request's routing inputs ([`RouteRequest`]) and a snapshot of the
//! fleet ([`ReplicaView`] per replica), which replica serves it, and returns a [`Decision`] that
//! records why (its [`Branch`], the predicted cached prefix, what the spill rule compared).
//! Policies are deterministic given [`PolicySpec::seed`] and the call sequence; they read no clock
//! and do no I/O.
//!
//! Module map:
//! - [`spec`]: [`PolicySpec`] (names, parameters and defaults) and [`build`].
//! - [`ring`]: the consistent-hash ring with bounded loads used by the session and prefix-hash
//!   policies.
//! - [`simple`]: `round-robin`, `least-outstanding`, `session-affinity`, `session-bounded`,
//!   `prefix-hash`.
//! - [`prefix`]: `prefix-affinity` (believed index) and `exact-residency` (event-fed index),
//!   with their arms.
//!
//! Callers hold the policy and the outstanding counters under one lock: `decide`, then increment
//! the chosen replica's outstanding before releasing it.

#![forbid(unsafe_code)]

pub mod prefix;
pub mod ring;
pub mod simple;
pub mod spec;

pub use spec::{POLICY_NAMES, PolicySpec, SpecError, build, build_typed};

use rand::Rng;
use rand_pcg::Pcg64Mcg;
use std::fmt;

/// A replica, numbered by the router in `--replicas` order; ids are never reused.
pub type ReplicaId = kv_index::ReplicaId;

/// What a policy sees of one replica when deciding.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReplicaView {
    /// The replica.
    pub id: ReplicaId,
    /// Requests dispatched to it and not yet finished, as counted by the router.
    pub outstanding: u32,
    /// Passing health checks.
    pub healthy: bool,
    /// Being drained: finishes what it has, receives nothing new.
    pub draining: bool,
    /// KV-cache usage in 0..=1 from the replica's metrics, when known (residency branch).
    pub kv_usage: Option<f32>,
}

impl ReplicaView {
    /// A healthy, idle, undrained replica.
    pub fn idle(id: ReplicaId) -> Self {
        ReplicaView {
            id,
            outstanding: 0,
            healthy: true,
            draining: false,
            kv_usage: None,
        }
    }

    /// Whether the replica may receive a new request.
    pub fn eligible(&self) -> bool {
        self.healthy && !self.draining
    }
}

/// Default estimate of the router's canonical chat bytes per engine token
/// (`router --bytes-per-token`). Measured on the workload generator's chat text (~1,100-token
/// prefix, 150-token user turns, 128-token replies) against the emulator's tokenizer and Llama 3
/// chat template, over the canonical rendering's bytes (whose per-message framing is shorter than
/// the template's special tokens): 3.87–3.93 per conversation, 3.88 minimises the error of the
/// predicted match. Real models differ (Llama 3's BPE gives about 4.2 on English prose); set it
/// from `/tokenize` counts of representative prompts.
pub const DEFAULT_BELIEF_BYTES_PER_TOKEN: f64 = 3.88;

/// Engine tokens per belief key block of `block_bytes` bytes, given a `bytes_per_token`
/// estimate (0 when the estimate is not a positive finite number).
pub fn belief_tokens_per_block(block_bytes: usize, bytes_per_token: f64) -> f64 {
    if bytes_per_token.is_finite() && bytes_per_token > 0.0 {
        block_bytes as f64 / bytes_per_token
    } else {
        0.0
    }
}

/// Predicted cached tokens for `blocks` matched key blocks of `tokens_per_block` tokens each,
/// rounded down to whole engine blocks of `engine_block_tokens` (the engine's hit is
/// block-aligned). A non-finite or negative `tokens_per_block` predicts 0.
pub fn predicted_tokens(blocks: u32, tokens_per_block: f64, engine_block_tokens: u32) -> u32 {
    if !(tokens_per_block.is_finite() && tokens_per_block > 0.0) {
        return 0;
    }
    let tokens = f64::from(blocks) * tokens_per_block;
    // Tolerate float error just below a whole number (e.g. 64 bytes ÷ 4.0 × n).
    let tokens = (tokens + 1e-6).floor().min(f64::from(u32::MAX)) as u32;
    let block = engine_block_tokens.max(1);
    tokens / block * block
}

/// A request's routing inputs.
#[derive(Clone, Copy, Debug)]
pub struct RouteRequest<'a> {
    /// The `x-session-id` header, when present.
    pub session_id: Option<&'a str>,
    /// Chained block keys of the prompt: belief keys (router byte blocks) or exact keys (engine
    /// token blocks), as [`Policy::keying`] asks.
    pub block_keys: &'a [u64],
    /// Engine tokens one key block stands for: converts matched blocks to predicted tokens.
    /// Exact keys: the engine block size (16). Belief keys: `block_bytes ÷ bytes_per_token` (see
    /// [`belief_tokens_per_block`]), an estimate, since the router never sees engine tokens.
    pub tokens_per_block: f64,
    /// Now, in microseconds on the caller's monotonic clock.
    pub now_us: u64,
}

/// What block keys a policy needs in [`RouteRequest::block_keys`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keying {
    /// None (keys are ignored; pass an empty slice).
    None,
    /// Router-side byte-block keys: `kv_index::hash::byte_block_keys(model, prompt, block_bytes)`.
    BeliefBytes,
    /// Engine token-block keys: `kv_index::hash::token_block_keys(salt, token_ids, 16)` with the
    /// salt of [`PolicySpec::salt`] (the same keys the policy re-derives from KV events).
    ExactTokens,
}

/// Why a replica was chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Branch {
    /// One replica held the longest believed/known match.
    Match,
    /// Several replicas held the longest match; the least loaded of them was chosen.
    Tie,
    /// No replica held any of the prompt; least outstanding.
    Miss,
    /// The matched replica was too loaded compared with the least loaded one.
    SpillLoad,
    /// The matched replica was believed to be evicting (KV usage above the threshold).
    SpillResidency,
    /// The key's ring owner.
    Ring,
    /// A later replica on the ring (the owner was ineligible or over its bound).
    RingWalk,
    /// Round robin.
    Rr,
    /// Least outstanding.
    Least,
    /// A seeded uniform draw over the eligible replicas.
    Random,
}

impl Branch {
    /// The row value: `match`, `tie`, `miss`, `spill-load`, `spill-residency`, `ring`,
    /// `ring-walk`, `rr`, `least`, `random`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Branch::Match => "match",
            Branch::Tie => "tie",
            Branch::Miss => "miss",
            Branch::SpillLoad => "spill-load",
            Branch::SpillResidency => "spill-residency",
            Branch::Ring => "ring",
            Branch::RingWalk => "ring-walk",
            Branch::Rr => "rr",
            Branch::Least => "least",
            Branch::Random => "random",
        }
    }
}

impl fmt::Display for Branch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the spill rule compared, when it ran.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SpillCheck {
    /// The replica holding the (chosen) longest match.
    pub matched_replica: ReplicaId,
    /// Its outstanding requests.
    pub matched_outstanding: u32,
    /// The least-loaded eligible replica (seeded tie-break).
    pub least_replica: ReplicaId,
    /// Its outstanding requests.
    pub least_outstanding: u32,
    /// The absolute margin: spill needs `matched − least > spill_abs`.
    pub spill_abs: u32,
    /// The ratio margin: spill needs `matched > spill_ratio × least`.
    pub spill_ratio: f64,
    /// The matched replica's KV usage, when the residency branch looked at it.
    pub matched_kv_usage: Option<f32>,
    /// Whether the match was declined.
    pub spilled: bool,
}

/// A routing decision.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Decision {
    /// The chosen replica (eligible at decision time).
    pub replica: ReplicaId,
    /// Why.
    pub branch: Branch,
    /// Leading blocks the chosen replica is believed/known to hold.
    pub predicted_match_blocks: u32,
    /// `predicted_match_blocks × RouteRequest::tokens_per_block`, rounded down to whole engine
    /// blocks ([`PolicySpec::tokens_per_block`]) as the engine only reuses full blocks (see
    /// [`predicted_tokens`]).
    pub predicted_match_tokens: u32,
    /// The chosen replica's outstanding requests before this one.
    pub outstanding_chosen: u32,
    /// The least outstanding over eligible replicas.
    pub outstanding_min: u32,
    /// What the spill rule compared, when it ran.
    pub spill: Option<SpillCheck>,
}

/// Why no decision could be made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteError {
    /// Every replica is unhealthy or draining (or the fleet is empty).
    NoEligibleReplica,
}

impl fmt::Display for RouteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RouteError::NoEligibleReplica => f.write_str("no healthy, undrained replica"),
        }
    }
}

impl std::error::Error for RouteError {}

/// When a policy's [`Policy::on_served`] has an effect ([`Policy::served_needs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServedNeeds {
    /// Never: the call is a no-op whichever replica served the request.
    Never,
    /// Only when the request was served by another replica than `decide` chose (a retry moved
    /// it): `decide` already recorded its own choice.
    WhenMoved,
    /// Always call it.
    Always,
}

impl ServedNeeds {
    /// Whether `on_served` must be called for a request decided on `decided` and served on
    /// `served`.
    pub fn call(self, decided: ReplicaId, served: ReplicaId) -> bool {
        match self {
            ServedNeeds::Never => false,
            ServedNeeds::WhenMoved => decided != served,
            ServedNeeds::Always => true,
        }
    }
}

/// A routing policy. See the crate documentation for the calling protocol.
pub trait Policy: Send {
    /// The policy's name as in [`POLICY_NAMES`] (e.g. `prefix-affinity-spill-off`).
    fn name(&self) -> &str;

    /// Which block keys the caller must supply.
    fn keying(&self) -> Keying;

    /// Chooses a replica among the eligible ones of `fleet`.
    fn decide(
        &mut self,
        req: &RouteRequest<'_>,
        fleet: &[ReplicaView],
    ) -> Result<Decision, RouteError>;

    /// The replica that actually got the request (after retries).
    fn on_served(&mut self, req: &RouteRequest<'_>, replica: ReplicaId) {
        let _ = (req, replica);
    }

    /// When [`Policy::on_served`] can change anything, so a caller that must lock the policy to
    /// call it (the router) may skip the call and its lock. Fixed for the policy's lifetime. The
    /// default, [`ServedNeeds::Always`], is right for any policy; a narrower answer is a promise
    /// that the skipped calls would have changed nothing.
    fn served_needs(&self) -> ServedNeeds {
        ServedNeeds::Always
    }

    /// A peer router (another router in front of the same fleet) served a request whose block
    /// keys were `block_keys` on `replica` (this router's id for the peer's replica);
    /// `now_us` is this router's own clock at receipt (its TTL clock, not the peer's). A policy
    /// whose index is its own belief adds it as [`Policy::on_served`] would; the default, and
    /// any policy whose truth comes from elsewhere (engine KV events), ignores it.
    fn on_peer_served(&mut self, block_keys: &[u64], replica: ReplicaId, now_us: u64) {
        let _ = (block_keys, replica, now_us);
    }

    /// A decoded KV event from `replica`'s engine.
    fn on_kv_event(&mut self, replica: ReplicaId, event: &kv_index::KvEvent, now_us: u64) {
        let _ = (replica, event, now_us);
    }

    /// `replica` left the fleet for good.
    fn on_replica_removed(&mut self, replica: ReplicaId) {
        let _ = replica;
    }
}

/// Seeded tie-breaking choices shared by the policies.
#[derive(Clone, Debug)]
pub(crate) struct Chooser {
    rng: Pcg64Mcg,
}

impl Chooser {
    pub(crate) fn new(seed: u64) -> Self {
        Chooser {
            rng: Pcg64Mcg::new(0xcafe_f00d_d15e_a5e5_u128 ^ ((seed as u128) << 64 | seed as u128)),
        }
    }

    /// Index (into `fleet`) of an eligible replica drawn uniformly (one draw per decision, so
    /// the choices are the seed's whatever the loads).
    pub(crate) fn uniform(&mut self, fleet: &[ReplicaView]) -> Option<usize> {
        let eligible = fleet.iter().filter(|r| r.eligible()).count();
        if eligible == 0 {
            return None;
        }
        let k = self.rng.random_range(0..eligible);
        fleet
            .iter()
            .enumerate()
            .filter(|(_, r)| r.eligible())
            .nth(k)
            .map(|(i, _)| i)
    }

    /// Index (into `fleet`) of the eligible replica with the fewest outstanding, ties broken
    /// uniformly at random among the tied (reservoir sampling, one pass). Also returns the
    /// eligible count.
    pub(crate) fn least<F>(&mut self, fleet: &[ReplicaView], mut allowed: F) -> Option<usize>
    where
        F: FnMut(usize, &ReplicaView) -> bool,
    {
        let mut best: Option<usize> = None;
        let mut ties = 0u32;
        for (i, r) in fleet.iter().enumerate() {
            if !r.eligible() || !allowed(i, r) {
                continue;
            }
            match best {
                Some(b) if fleet[b].outstanding < r.outstanding => {}
                Some(b) if fleet[b].outstanding == r.outstanding => {
                    ties += 1;
                    if self.rng.random_range(0..ties) == 0 {
                        best = Some(i);
                    }
                }
                _ => {
                    best = Some(i);
                    ties = 1;
                }
            }
        }
        best
    }
}

/// The least outstanding over eligible replicas (0 when none).
pub(crate) fn min_outstanding(fleet: &[ReplicaView]) -> u32 {
    fleet
        .iter()
        .filter(|r| r.eligible())
        .map(|r| r.outstanding)
        .min()
        .unwrap_or(0)
}

/// A decision without a predicted match.
pub(crate) fn plain(fleet: &[ReplicaView], i: usize, branch: Branch) -> Decision {
    Decision {
        replica: fleet[i].id,
        branch,
        predicted_match_blocks: 0,
        predicted_match_tokens: 0,
        outstanding_chosen: fleet[i].outstanding,
        outstanding_min: min_outstanding(fleet),
        spill: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn predicted_tokens_round_down_to_engine_blocks() {
        // Exact keys: blocks × 16 is already block-aligned.
        assert_eq!(predicted_tokens(10, 16.0, 16), 160);
        // 64-byte belief blocks at 3.88 bytes/token: 78 blocks = 4,992 bytes ≈ 1,286.6 tokens,
        // of which the engine can reuse 80 whole blocks.
        let tpb = belief_tokens_per_block(64, 3.88);
        assert_eq!(predicted_tokens(78, tpb, 16), 1280);
        // 4 bytes/token is exactly 16 tokens a block, float error notwithstanding.
        assert_eq!(
            predicted_tokens(7, belief_tokens_per_block(64, 4.0), 16),
            112
        );
        assert_eq!(predicted_tokens(0, tpb, 16), 0);
        // Engine block size 1 keeps the raw estimate.
        assert_eq!(predicted_tokens(3, 2.5, 1), 7);
    }

    #[test]
    fn bad_estimates_predict_nothing_rather_than_panic() {
        assert_eq!(belief_tokens_per_block(64, 0.0), 0.0);
        assert_eq!(belief_tokens_per_block(64, f64::NAN), 0.0);
        assert_eq!(belief_tokens_per_block(64, -1.0), 0.0);
        assert_eq!(predicted_tokens(5, f64::NAN, 16), 0);
        assert_eq!(predicted_tokens(5, f64::INFINITY, 16), 0);
        assert_eq!(predicted_tokens(5, -16.0, 16), 0);
        assert_eq!(predicted_tokens(5, 16.0, 0), 80);
        assert_eq!(predicted_tokens(u32::MAX, 1e9, 16), u32::MAX / 16 * 16);
    }
}
