//! Deterministic multi-turn chat workloads for kvroute.
//!
//! A [`Plan`] holds conversations (a context prefix — optionally a prefix group's shared prefix
//! then a private context — scripted user turns and scripted assistant replies, so no turn
//! depends on what an engine generated), sized against the fleet's KV capacity, plus an arrival schedule (closed loop or open loop) drawn with a bounded
//! [`Zipf`] over conversations. Plans serialize (a format byte, then MessagePack) so the identical plan is replayed
//! for every policy; [`Plan::name`] is derived from the parameters and
//! [`Plan::fingerprint`] hashes the plan's bytes.
//!
//! Pure: no I/O, no clock, no async.

pub mod plan;
pub mod spec;
pub mod text;
pub mod walk;
pub mod zipf;

pub use plan::{
    Arrival, Conversation, Layout, Message, PLAN_FORMAT, Plan, Role, Schedule, Step,
    closed_request_id, cold_resume_share, layout, open_request_id, prefix_lengths, prime_period_s,
    steadily_cached, steady_state_warmup_s,
};
pub use spec::{ArrivalSpec, OpenStart, PrefixGroups, Sharing, Sizing, WorkloadSpec};
pub use walk::{Pick, SKIP_WINDOW_DRAWS, Walk, WalkCursor, walks};
pub use zipf::Zipf;

/// Why a workload could not be built, encoded or decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkloadError {
    /// A parameter is out of range; the message names it.
    InvalidSpec(String),
    /// Serialization failed.
    Encode(String),
    /// The bytes are not a valid plan.
    Decode(String),
    /// A conversation or turn index outside the plan.
    OutOfRange(String),
}

impl std::fmt::Display for WorkloadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WorkloadError::InvalidSpec(m) => write!(f, "invalid workload: {m}"),
            WorkloadError::Encode(m) => write!(f, "cannot encode plan: {m}"),
            WorkloadError::Decode(m) => write!(f, "not a valid plan: {m}"),
            WorkloadError::OutOfRange(m) => write!(f, "out of range: {m}"),
        }
    }
}

impl std::error::Error for WorkloadError {}
