//! Replica lifecycle and per-cell evidence for the kvroute harness.
//!
//! - [`process`]: [`process::ChildGuard`], a child in its own process group, logs captured to a
//!   file, killed by its handle on drop (also while unwinding), readiness lines awaited.
//! - [`fleet`]: [`fleet::Fleet`] over three [`fleet::Source`]s — emulated `engine` processes,
//!   command templates (vLLM), static URLs — with health wait, stop, cycle, kill one, restart one.
//! - [`evidence`]: [`evidence::EvidenceSampler`] writes `evidence.jsonl` through a measured
//!   window (NVML on GPUs, engine lateness and host CPU load on the emulator) and returns an
//!   [`evidence::EvidenceSummary`] whose [`evidence::EvidenceSummary::check`] discards a cell.
//! - [`metrics`]: Prometheus text parsing (cache shape, histograms and window deltas).
//! - [`http`]: a tiny blocking HTTP/1.1 client for control-plane calls.

pub mod evidence;
pub mod fleet;
pub mod http;
pub mod metrics;
pub mod process;

pub use evidence::{EvidenceBounds, EvidenceConfig, EvidenceSampler, EvidenceSummary};
pub use fleet::{CommandSpec, EmulatedSpec, Fleet, FleetOptions, ReplicaInfo, Source, StaticSpec};
pub use metrics::{CacheConfig, Histogram};
pub use process::{ChildGuard, Readiness, kill_all};
