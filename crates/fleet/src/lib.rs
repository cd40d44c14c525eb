//! Replica lifecycle, ingress and driver processes, and per-cell evidence for the kvroute
//! harness.
//!
//! - [`process`]: [`process::ChildGuard`], a child in its own process group, logs captured to a
//!   file, killed by its handle on drop (also while unwinding), readiness lines awaited.
//! - [`fleet`]: [`fleet::Fleet`] over three [`fleet::Source`]s — emulated `engine` processes,
//!   command templates (vLLM), static URLs — with health wait, stop, cycle, kill one, restart one.
//! - [`ingress`]: what sits in front of the fleet — kvroute's router ([`ingress::router`]),
//!   HAProxy ([`ingress::haproxy`]: config, stats socket, lifecycle), Envoy with the endpoint
//!   picker ([`ingress::envoy_epp`]) or several routers behind HAProxy ([`ingress::routers`]) —
//!   started and finished per cell through [`ingress::IngressProcess`].
//! - [`driver_process`]: the load driver's command line, start, and the wait that watches the
//!   fleet.
//! - [`evidence`]: [`evidence::EvidenceSampler`] writes `evidence.jsonl` through a measured
//!   window (NVML on GPUs, engine lateness and host CPU load on the emulator) and returns an
//!   [`evidence::EvidenceSummary`] whose [`evidence::EvidenceSummary::check`] discards a cell.
//! - [`gpu`]: [`gpu::GpuBackend`], what is read from the GPUs (NVML on a real fleet, scripted
//!   in tests), and [`gpu::FleetGpus`], what a fleet knows of its cards and processes.
//! - [`metrics`]: what is read from a replica's `/metrics` (cache shape, histograms and window
//!   deltas), on the `prom-text` parser.
//! - [`http`]: blocking HTTP for control-plane calls, on `ureq`.
//! - [`error`]: [`Error`], the crate's one error type, each message naming the replica,
//!   process, log, file or URL concerned.
//! - [`llama`]: llama.cpp's `llama-server` replicas ([`llama::LlamaSpec`]): the pinned command
//!   line, the listening line, the KV capacity rule, the install cache's paths.

pub mod driver_process;
pub mod error;
pub mod evidence;
mod files;
pub mod fleet;
pub mod gpu;
pub mod http;
pub mod ingress;
pub mod llama;
pub mod metrics;
pub mod process;
pub mod vllm;

pub use driver_process::{DriverSettings, start_driver, wait_driver};
pub use error::{Error, Result};
pub use evidence::{CheckStatus, EvidenceBounds, EvidenceConfig, EvidenceSampler, EvidenceSummary};
pub use fleet::{
    CommandSpec, DescribedEngine, EmulatedCache, EmulatedSpec, Fleet, FleetOptions, ReplicaInfo,
    Source, StaticSpec, VllmFleetSpec,
};
pub use gpu::{FleetGpus, GpuBackend};
pub use ingress::{Ingress, IngressProcess, RouterSettings, RoutersSettings};
pub use llama::LlamaSpec;
pub use metrics::{CacheConfig, Histogram};
pub use process::{ChildGuard, Readiness, kill_all};
