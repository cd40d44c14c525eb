//! Policy names, parameters and defaults, and [`build`].

use crate::Policy;
use crate::prefix::{IndexMode, PrefixPolicy};
use crate::simple::{LeastOutstanding, PrefixHash, Random, RoundRobin, SessionAffinity};

/// Every policy name [`build`] accepts (CLI `--policy`, the `policy` row column).
pub const POLICY_NAMES: [&str; 10] = [
    "round-robin",
    "least-outstanding",
    "session-affinity",
    "session-bounded",
    "prefix-hash",
    "prefix-affinity",
    "prefix-affinity-spill-off",
    "exact-residency",
    "exact-residency-spec",
    "random",
];

/// A policy's name and parameters. Every field has a default ([`PolicySpec::default`] is
/// `prefix-affinity`; [`PolicySpec::named`] starts from the defaults with another name).
///
/// The arm names set their switches: `prefix-affinity-spill-off` builds prefix-affinity with
/// `spill = false`, `exact-residency-spec` builds exact-residency with `speculative = true`,
/// whatever those fields say. Conversely `prefix-affinity` with `spill = false` and
/// `exact-residency` with `speculative = true` build (and report the name of) those arms.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicySpec {
    /// One of [`POLICY_NAMES`].
    pub name: String,
    /// Seed of every tie-break.
    pub seed: u64,
    /// Bounded-load factor `c` of `session-bounded` and `prefix-hash` (≥ 1; default 1.25).
    pub load_factor: f64,
    /// Virtual nodes per replica on the consistent-hash ring (default 150).
    pub virtual_nodes: u32,
    /// Leading blocks `prefix-hash` hashes onto the ring (default 16, ≈ 256 tokens).
    pub prefix_hash_blocks: u32,
    /// Spill (load branch) of `prefix-affinity` / `exact-residency` (default on).
    pub spill: bool,
    /// Spill needs `matched − least > spill_abs` outstanding (default 4).
    pub spill_abs: u32,
    /// … and `matched > spill_ratio × least` (default 1.5). 0 disables this half.
    pub spill_ratio: f64,
    /// Residency branch: decline a match on a replica believed to be evicting (default off).
    pub residency_branch: bool,
    /// KV usage above which the residency branch believes a replica is evicting (default 0.95).
    pub residency_kv_usage: f32,
    /// Sliding TTL of believed entries (prefix-affinity; default 60 s, about the eviction
    /// lifetime measured on the reference fleet).
    pub index_ttl_us: u64,
    /// Node cap of the index (default 1,048,576 nodes, ≈ 60 MiB).
    pub index_node_cap: usize,
    /// Speculative layer of `exact-residency` (set by the `exact-residency-spec` name).
    pub speculative: bool,
    /// Lifetime of a speculative entry (default 2 s).
    pub speculative_ttl_us: u64,
    /// Block-0 salt of exact keys, which the index re-derives from KV events (the model name);
    /// must be the salt the caller uses for [`Keying::ExactTokens`](crate::Keying) keys.
    pub salt: String,
    /// Engine block size in tokens (default 16); KV events with another size are rejected.
    pub tokens_per_block: u32,
}

impl Default for PolicySpec {
    fn default() -> Self {
        PolicySpec {
            name: "prefix-affinity".to_string(),
            seed: 0,
            load_factor: 1.25,
            virtual_nodes: 150,
            prefix_hash_blocks: 16,
            spill: true,
            spill_abs: 4,
            spill_ratio: 1.5,
            residency_branch: false,
            residency_kv_usage: 0.95,
            index_ttl_us: 60_000_000,
            index_node_cap: 1 << 20,
            speculative: false,
            speculative_ttl_us: 2_000_000,
            salt: String::new(),
            tokens_per_block: 16,
        }
    }
}

impl PolicySpec {
    /// The defaults with `name`.
    pub fn named(name: &str) -> Self {
        PolicySpec {
            name: name.to_string(),
            ..PolicySpec::default()
        }
    }

    /// Checks every parameter; the error names the bad one.
    pub fn validate(&self) -> Result<(), SpecError> {
        if !POLICY_NAMES.contains(&self.name.as_str()) {
            return Err(SpecError::UnknownPolicy(self.name.clone()));
        }
        if !(self.load_factor.is_finite() && self.load_factor >= 1.0) {
            return Err(SpecError::LoadFactor(self.load_factor));
        }
        if self.virtual_nodes == 0 || self.virtual_nodes > 10_000 {
            return Err(SpecError::VirtualNodes(self.virtual_nodes));
        }
        if self.prefix_hash_blocks == 0 {
            return Err(SpecError::PrefixHashBlocks);
        }
        if !(self.spill_ratio.is_finite() && self.spill_ratio >= 0.0) {
            return Err(SpecError::SpillRatio(self.spill_ratio));
        }
        if !(0.0..=1.0).contains(&self.residency_kv_usage) {
            return Err(SpecError::ResidencyKvUsage(self.residency_kv_usage));
        }
        if self.index_node_cap == 0 || self.index_node_cap > kv_index::PrefixIndex::MAX_NODE_CAP {
            return Err(SpecError::IndexNodeCap(self.index_node_cap));
        }
        if self.index_ttl_us == 0 {
            return Err(SpecError::IndexTtl);
        }
        if self.tokens_per_block == 0
            || self.tokens_per_block > kv_index::PrefixIndex::MAX_TOKENS_PER_BLOCK
        {
            return Err(SpecError::TokensPerBlock(self.tokens_per_block));
        }
        Ok(())
    }
}

/// Why a [`PolicySpec`] cannot build a policy: the parameter out of range, with its value.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpecError {
    /// Not one of [`POLICY_NAMES`].
    #[error("unknown policy {0:?}; expected one of {names}", names = POLICY_NAMES.join(", "))]
    UnknownPolicy(String),
    /// `load_factor` below 1 (or not finite).
    #[error("load factor c must be ≥ 1, got {0}")]
    LoadFactor(f64),
    /// `virtual_nodes` outside 1..=10000.
    #[error("virtual nodes must be in 1..=10000, got {0}")]
    VirtualNodes(u32),
    /// `prefix_hash_blocks` 0.
    #[error("prefix-hash blocks must be ≥ 1")]
    PrefixHashBlocks,
    /// `spill_ratio` negative (or not finite).
    #[error("spill ratio must be ≥ 0, got {0}")]
    SpillRatio(f64),
    /// `residency_kv_usage` outside 0..=1.
    #[error("residency KV-usage threshold must be in 0..=1, got {0}")]
    ResidencyKvUsage(f32),
    /// `index_node_cap` outside 1..=[`kv_index::PrefixIndex::MAX_NODE_CAP`].
    #[error("index node cap must be in 1..={max}, got {0}", max = kv_index::PrefixIndex::MAX_NODE_CAP)]
    IndexNodeCap(usize),
    /// `index_ttl_us` 0.
    #[error("index TTL must be > 0")]
    IndexTtl,
    /// `tokens_per_block` outside 1..=[`kv_index::PrefixIndex::MAX_TOKENS_PER_BLOCK`].
    #[error("tokens per block must be in 1..={max}, got {0}", max = kv_index::PrefixIndex::MAX_TOKENS_PER_BLOCK)]
    TokensPerBlock(u32),
    /// The prefix index refused its configuration.
    #[error(transparent)]
    Index(#[from] kv_index::IndexError),
}

/// Builds the policy `spec` names. The error is [`SpecError`]'s message: the router's
/// `RouterError::Config` (crates/proxy) carries it as text.
pub fn build(spec: &PolicySpec) -> Result<Box<dyn Policy>, String> {
    build_typed(spec).map_err(|e| e.to_string())
}

/// [`build`], with the error as a [`SpecError`].
pub fn build_typed(spec: &PolicySpec) -> Result<Box<dyn Policy>, SpecError> {
    spec.validate()?;
    Ok(match spec.name.as_str() {
        "round-robin" => Box::new(RoundRobin::new()),
        "random" => Box::new(Random::new(spec.seed)),
        "least-outstanding" => Box::new(LeastOutstanding::new(spec.seed)),
        "session-affinity" => Box::new(SessionAffinity::new(spec, false)),
        "session-bounded" => Box::new(SessionAffinity::new(spec, true)),
        "prefix-hash" => Box::new(PrefixHash::new(spec)),
        // The arm names force their switch; the policy then reports the arm's name.
        "prefix-affinity" => Box::new(PrefixPolicy::new(spec, IndexMode::Belief, spec.spill)?),
        "prefix-affinity-spill-off" => Box::new(PrefixPolicy::new(spec, IndexMode::Belief, false)?),
        "exact-residency" => Box::new(PrefixPolicy::new(
            spec,
            IndexMode::Exact {
                speculative: spec.speculative,
            },
            spec.spill,
        )?),
        "exact-residency-spec" => Box::new(PrefixPolicy::new(
            spec,
            IndexMode::Exact { speculative: true },
            spec.spill,
        )?),
        other => return Err(SpecError::UnknownPolicy(other.to_string())),
    })
}
