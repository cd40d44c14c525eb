//! Replica sources and their lifecycle: start, health, stop, cycle, kill one, restart one.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{err, fail};
use crate::{Error, Result};

use crate::gpu::{self, FleetGpus, GpuBackend, PidsByDevice, StartedGpus};
use crate::http;
use crate::llama::{self, LlamaSpec};
use crate::metrics::CacheConfig;
use crate::process::ChildGuard;
use schema::EngineKind;

/// Where the replicas come from.
#[derive(Debug, Clone)]
pub enum Source {
    /// `engine` processes spawned on loopback with ephemeral ports.
    Emulated(EmulatedSpec),
    /// Any server started from a shell command template (vLLM, SGLang).
    Command(CommandSpec),
    /// URLs managed elsewhere (a Kubernetes deployment, a shared box).
    Static(StaticSpec),
    /// llama.cpp `llama-server` processes on loopback (CPU), flags pinned by [`LlamaSpec`].
    Llama(LlamaSpec),
    /// Real vLLM processes on loopback (CPU), flags pinned by [`crate::vllm::VllmSpec`].
    Vllm(VllmFleetSpec),
}

/// A fleet of real vLLM replicas on this machine's CPU cores.
#[derive(Debug, Clone, PartialEq)]
pub struct VllmFleetSpec {
    /// Every replica's settings (its `cores` are replaced per replica).
    pub spec: crate::vllm::VllmSpec,
    /// Number of replicas.
    pub replicas: usize,
    /// `VLLM_CPU_OMP_THREADS_BIND` per replica, cycled (`["0", "1"]`: replica i on core i % 2).
    pub cores: Vec<String>,
}

impl VllmFleetSpec {
    /// `replicas` replicas of `spec`, replica i on core `i % cores` of this machine's cores.
    pub fn new(spec: crate::vllm::VllmSpec, replicas: usize) -> VllmFleetSpec {
        let n = std::thread::available_parallelism().map_or(1, usize::from);
        VllmFleetSpec {
            spec,
            replicas,
            cores: (0..n).map(|c| c.to_string()).collect(),
        }
    }

    /// Replica `index`'s settings.
    pub fn replica(&self, index: usize) -> crate::vllm::VllmSpec {
        let mut s = self.spec.clone();
        if !self.cores.is_empty() {
            s.cores = self.cores[index % self.cores.len()].clone();
        }
        s
    }

    /// What `meta.json` records: the replica settings and the cores.
    pub fn meta(&self) -> serde_json::Value {
        let mut m = self.spec.meta();
        m["replicas"] = self.replicas.into();
        m["cores_per_replica"] = serde_json::json!(
            (0..self.replicas)
                .map(|i| self.replica(i).cores)
                .collect::<Vec<_>>()
        );
        m["reset"] = "POST /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1)".into();
        m
    }
}

impl Source {
    /// `emulated`, `command` or `static` (recorded in meta.json).
    pub fn kind(&self) -> &'static str {
        match self {
            Source::Emulated(_) => "emulated",
            Source::Command(_) => "command",
            Source::Static(_) => "static",
            Source::Llama(_) => "llama",
            Source::Vllm(_) => "vllm",
        }
    }

    /// The engine the replicas run: llama.cpp for a llama fleet; vLLM's API otherwise (the
    /// emulator speaks it; a command or static fleet is taken to be vLLM unless said otherwise).
    pub fn engine(&self) -> EngineKind {
        match self {
            Source::Llama(_) => EngineKind::LlamaCpp,
            _ => EngineKind::Vllm,
        }
    }

    /// Why this source's replicas cannot feed a policy that needs KV events (exact residency),
    /// or `None` when they can: a llama fleet, and an emulated one with the llama-slots cache
    /// model, publish none.
    pub fn no_kv_events_reason(&self) -> Option<&'static str> {
        match self {
            Source::Llama(_) => EngineKind::LlamaCpp.no_kv_events_reason(),
            Source::Emulated(spec) => spec.cache.no_kv_events_reason(),
            Source::Command(_) | Source::Static(_) | Source::Vllm(_) => None,
        }
    }

    /// Number of replicas this source provides.
    pub fn replicas(&self) -> usize {
        match self {
            Source::Emulated(s) => s.replicas,
            Source::Command(s) => s.replicas,
            Source::Static(s) => s.urls.len(),
            Source::Llama(s) => s.replicas,
            Source::Vllm(s) => s.replicas,
        }
    }
}

/// `--sched-fifo-priority` of every emulated replica: the lowest real-time level, so a waking
/// engine thread preempts ordinary work (a compile, the driver) instead of waiting a scheduler
/// slice. On a loaded 2-core machine it cut lateness p99 from 5–100 ms to 0.20–0.25 ms at speed 6
/// (crates/engine/README.md, "Lateness"). The engine reports a refusal and runs on; the lateness
/// evidence still judges the cell.
pub const EMULATED_SCHED_FIFO_PRIORITY: u8 = 1;

/// Emulated replicas: one `engine` process each.
#[derive(Debug, Clone)]
pub struct EmulatedSpec {
    /// Path of the `engine` binary.
    pub engine_bin: PathBuf,
    /// Number of replicas.
    pub replicas: usize,
    /// `--speed`: every modelled duration is divided by it.
    pub speed: f64,
    /// `--slowdown` per replica (missing entries are 1.0): a throttled card.
    pub slowdowns: Vec<f64>,
    /// `--num-gpu-blocks`; `None` keeps the engine's default.
    pub num_gpu_blocks: Option<u64>,
    /// `--model` (also the served model name).
    pub model: String,
    /// Base seed; replica i gets `seed + i`.
    pub seed: u64,
    /// Publish KV events (`--kv-events-port 0`), needed by the exact-residency policies.
    pub kv_events: bool,
    /// Extra flags passed verbatim to every engine.
    pub extra_args: Vec<String>,
    /// The KV cache the engines model (`--cache-model`): vLLM's paged prefix cache, or
    /// llama.cpp's slots with the llama-tiny step model (an emulated llama fleet).
    pub cache: EmulatedCache,
}

impl EmulatedSpec {
    /// The slowdown of replica `index` (1.0 when not given).
    pub fn slowdown(&self, index: usize) -> f64 {
        self.slowdowns.get(index).copied().unwrap_or(1.0)
    }
}

/// The KV cache an emulated replica models, as `engine` flags.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum EmulatedCache {
    /// vLLM's paged prefix cache (`--cache-model paged`, the engine's default; KV events when
    /// asked).
    #[default]
    Paged,
    /// llama.cpp's `llama-server` slots (`--cache-model llama-slots --parallel-slots N
    /// --slot-prompt-similarity F --ctx-tokens N --step-model S`): no KV events.
    LlamaSlots {
        /// `--parallel-slots` (llama-server's `-np`).
        parallel_slots: u32,
        /// `--slot-prompt-similarity`.
        slot_prompt_similarity: f64,
        /// `--ctx-tokens` (llama-server's `-c` with `--kv-unified`).
        ctx_tokens: u32,
        /// `--step-model` preset (`llama-tiny`: the tiny grid model on one CPU thread).
        step_model: String,
    },
    /// vLLM's paged prefix cache with a real vLLM fleet's pinned shape and a step model fitted
    /// to it (`--block-size B --max-model-len N --step-model S`): the emulated twin of a vLLM
    /// fleet (KV events when asked).
    PagedTwin {
        /// `--block-size` (a vLLM fleet on CPU: 32).
        block_size: u32,
        /// `--max-model-len`.
        max_model_len: u32,
        /// `--step-model` preset (`vllm-tiny-cpu`: the tiny model on one CPU core).
        step_model: String,
    },
    /// vLLM's paged prefix cache with the limits and step model of a fleet description file
    /// (`experiment::fleet_description`): every limit and step-time constant passed as the
    /// engine's own flag (KV events when asked).
    Described(Box<DescribedEngine>),
}

/// An emulated engine as a fleet description gives it: its name and the `engine` binary's
/// flags that carry its limits and step-time constants. `fleet` may not depend on `engine-core`
/// (docs/ARCHITECTURE.md, the layering), so the constants travel as the flags the engine parses,
/// made in one place from the engine config the description derives
/// (`experiment::fleet_description::engine_args`).
#[derive(Debug, Clone, PartialEq)]
pub struct DescribedEngine {
    /// The description's name (recorded in meta, for the reader).
    pub name: String,
    /// The engine flags, `--block-size …` to `--tokenize-ms …`.
    pub args: Vec<String>,
}

impl EmulatedCache {
    /// The llama fleet's pinned slot settings ([`LlamaSpec::new`]'s `-np`,
    /// `--slot-prompt-similarity` and `-c`) with the step model fitted to its tiny model
    /// (`llama-tiny`): the emulated twin of `--fleet llama`.
    pub fn llama_fleet() -> EmulatedCache {
        let pinned = LlamaSpec::new(PathBuf::new(), PathBuf::new(), "", 0);
        EmulatedCache::LlamaSlots {
            parallel_slots: pinned.parallel,
            slot_prompt_similarity: pinned.slot_prompt_similarity,
            ctx_tokens: pinned.ctx_size_tokens,
            step_model: "llama-tiny".into(),
        }
    }

    /// The vLLM fleet's pinned shape ([`crate::vllm::VllmSpec`]'s 32-token blocks, the 4,096
    /// tokens per sequence a vLLM grid fleet runs with) and the step model fitted to its tiny
    /// model on one core (`vllm-tiny-cpu`): the emulated twin of `--fleet vllm`.
    pub fn vllm_fleet(max_model_len: u32) -> EmulatedCache {
        let pinned = crate::vllm::VllmSpec::new(Path::new(""));
        EmulatedCache::PagedTwin {
            block_size: pinned.block_size_tokens,
            max_model_len,
            step_model: "vllm-tiny-cpu".into(),
        }
    }

    /// `paged` or `llama-slots` (the engine's `--cache-model`).
    pub fn name(&self) -> &'static str {
        match self {
            EmulatedCache::Paged
            | EmulatedCache::PagedTwin { .. }
            | EmulatedCache::Described(_) => "paged",
            EmulatedCache::LlamaSlots { .. } => "llama-slots",
        }
    }

    /// The engine flags (none for the paged default).
    pub fn args(&self) -> Vec<String> {
        match self {
            EmulatedCache::Paged => Vec::new(),
            EmulatedCache::Described(d) => d.args.clone(),
            EmulatedCache::PagedTwin {
                block_size,
                max_model_len,
                step_model,
            } => vec![
                "--block-size".into(),
                block_size.to_string(),
                "--max-model-len".into(),
                max_model_len.to_string(),
                "--step-model".into(),
                step_model.clone(),
            ],
            EmulatedCache::LlamaSlots {
                parallel_slots,
                slot_prompt_similarity,
                ctx_tokens,
                step_model,
            } => vec![
                "--cache-model".into(),
                "llama-slots".into(),
                "--parallel-slots".into(),
                parallel_slots.to_string(),
                "--slot-prompt-similarity".into(),
                slot_prompt_similarity.to_string(),
                "--ctx-tokens".into(),
                ctx_tokens.to_string(),
                "--step-model".into(),
                step_model.clone(),
            ],
        }
    }

    /// What meta records as `fleet.engine_flags`: `null` for the paged default, else the
    /// cache model and its settings.
    pub fn meta(&self) -> serde_json::Value {
        match self {
            EmulatedCache::Paged => serde_json::Value::Null,
            EmulatedCache::Described(d) => serde_json::json!({
                "engine": "emulator",
                "cache_model": self.name(),
                "description": d.name,
                "args": d.args,
            }),
            EmulatedCache::PagedTwin {
                block_size,
                max_model_len,
                step_model,
            } => serde_json::json!({
                "engine": "emulator",
                "cache_model": self.name(),
                "block_size_tokens": block_size,
                "max_model_len": max_model_len,
                "step_model": step_model,
                "args": self.args(),
            }),
            EmulatedCache::LlamaSlots {
                parallel_slots,
                slot_prompt_similarity,
                ctx_tokens,
                step_model,
            } => serde_json::json!({
                "engine": "emulator",
                "cache_model": self.name(),
                "parallel_slots": parallel_slots,
                "slot_prompt_similarity": slot_prompt_similarity,
                "ctx_size_tokens": ctx_tokens,
                "step_model": step_model,
                "args": self.args(),
                "capacity_rule": "capacity_tokens = --ctx-tokens per replica (the emulator's /metrics: block_size 1, num_gpu_blocks = ctx tokens)",
            }),
        }
    }

    /// Why these engines cannot feed a policy that needs KV events, or `None` when they can.
    pub fn no_kv_events_reason(&self) -> Option<&'static str> {
        match self {
            EmulatedCache::Paged
            | EmulatedCache::PagedTwin { .. }
            | EmulatedCache::Described(_) => None,
            EmulatedCache::LlamaSlots { .. } => Some(
                "the emulator's llama-slots cache model publishes no KV events, as llama.cpp's llama-server publishes none (its per-slot caches are not visible outside the process)",
            ),
        }
    }
}

/// Replicas started from a command template.
///
/// Placeholders: `{model}`, `{port}`, `{kv_port}`, `{gpu}`, `{index}`, `{host}`. The command runs
/// under `sh -c` with `CUDA_VISIBLE_DEVICES={gpu}`.
#[derive(Debug, Clone)]
pub struct CommandSpec {
    /// e.g. `vllm serve {model} --port {port} --enable-prompt-tokens-details --kv-events-config …`.
    pub template: String,
    /// Substituted for `{model}`.
    pub model: String,
    /// Number of replicas.
    pub replicas: usize,
    /// Host the replicas listen on (URLs are `http://{host}:{port}`).
    pub host: String,
    /// Replica i listens on `base_port + i`.
    pub base_port: u16,
    /// Replica i publishes KV events on `kv_base_port + i` when set.
    pub kv_base_port: Option<u16>,
    /// GPU ids; replica i gets `gpus[i % len]` (empty: `i`).
    pub gpus: Vec<String>,
}

impl CommandSpec {
    /// The shell command line of replica `index`.
    pub fn render(&self, index: usize) -> Result<String> {
        let port = self.port(index)?;
        let kv_port = match self.kv_base_port {
            Some(base) => offset_port(base, index)?.to_string(),
            None => String::new(),
        };
        if self.template.contains("{kv_port}") && self.kv_base_port.is_none() {
            fail!(
                Invalid,
                "the command template uses {{kv_port}} but no KV event base port was given"
            );
        }
        Ok(self
            .template
            .replace("{model}", &self.model)
            .replace("{port}", &port.to_string())
            .replace("{kv_port}", &kv_port)
            .replace("{gpu}", &self.gpu(index))
            .replace("{index}", &index.to_string())
            .replace("{host}", &self.host))
    }

    /// The GPU id of replica `index`.
    pub fn gpu(&self, index: usize) -> String {
        if self.gpus.is_empty() {
            index.to_string()
        } else {
            self.gpus[index % self.gpus.len()].clone()
        }
    }

    fn port(&self, index: usize) -> Result<u16> {
        offset_port(self.base_port, index)
    }
}

fn offset_port(base: u16, index: usize) -> Result<u16> {
    u16::try_from(usize::from(base) + index)
        .map_err(|_| err!(Invalid, "port {base} + {index} is past 65535"))
}

/// Replicas managed elsewhere.
#[derive(Debug, Clone)]
pub struct StaticSpec {
    /// Base URLs, `http://host:port`.
    pub urls: Vec<String>,
    /// KV event endpoints, same order (may be shorter or empty).
    pub kv_events: Vec<String>,
}

/// Timeouts and where logs go.
#[derive(Debug, Clone)]
pub struct FleetOptions {
    /// `replica-<i>.log` files are written here.
    pub log_dir: PathBuf,
    /// How long a replica may take from spawn to a healthy `/health`.
    pub ready_timeout: Duration,
    /// How long a SIGTERMed replica may take to exit before SIGKILL.
    pub stop_grace: Duration,
    /// Keep every CPU busy at `SCHED_IDLE` while an emulated fleet exists
    /// ([`rt_sched::KeepAwake`]: on a virtual machine a halted CPU wakes the engines late). For
    /// measurements; tests leave it off.
    pub keep_cpus_awake: bool,
}

impl FleetOptions {
    /// Logs in `log_dir`, 60 s to become healthy, 5 s to stop.
    pub fn new(log_dir: impl Into<PathBuf>) -> FleetOptions {
        FleetOptions {
            log_dir: log_dir.into(),
            ready_timeout: Duration::from_secs(60),
            stop_grace: Duration::from_secs(5),
            keep_cpus_awake: false,
        }
    }
}

/// What is known about one running replica.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ReplicaInfo {
    /// Position in the fleet (the router assigns ids in this order).
    pub index: usize,
    /// Base URL.
    pub url: String,
    /// KV event PUB endpoint, when published.
    pub kv_events: Option<String>,
    /// KV event replay endpoint, when known.
    pub kv_replay: Option<String>,
    /// Process id (= process group id) when this fleet started it.
    pub pid: Option<u32>,
    /// Log file when this fleet started it.
    pub log_path: Option<PathBuf>,
    /// Emulated slowdown (1.0 otherwise).
    pub slowdown: f64,
}

struct Slot {
    info: ReplicaInfo,
    guard: Option<ChildGuard>,
    starts: u32,
}

/// Starts replica `index`'s process (its `starts`-th start) with `cmd`, log header first, and
/// the slot it fills: `url` and `kv_events` as known before readiness (empty / `None` when the
/// readiness line will say).
fn spawn_replica(
    cmd: Command,
    index: usize,
    starts: u32,
    log_path: PathBuf,
    url: String,
    kv_events: Option<String>,
    slowdown: f64,
) -> Result<Slot> {
    write_log_header(&log_path, index, starts, &cmd)?;
    let guard = ChildGuard::spawn(&format!("replica {index}"), cmd, &log_path)?;
    Ok(Slot {
        info: ReplicaInfo {
            index,
            url,
            kv_events,
            kv_replay: None,
            pid: guard.pid(),
            log_path: Some(log_path),
            slowdown,
        },
        guard: Some(guard),
        starts: starts + 1,
    })
}

/// A set of replicas under one lifecycle. Every child is killed when the fleet is dropped.
pub struct Fleet {
    source: Source,
    options: FleetOptions,
    slots: Vec<Slot>,
    /// The GPU reader of a command fleet, opened at its first start (or given); an emulated or
    /// static fleet never opens one.
    gpu_backend: Option<std::result::Result<Arc<dyn GpuBackend>, String>>,
    /// Per replica: its NVML devices (command fleets, while running).
    replica_devices: Vec<std::result::Result<Vec<u32>, String>>,
    /// Per device: compute pids that appeared on it while the replicas started.
    started_pids: PidsByDevice,
    /// An emulated fleet's CPU spinners ([`FleetOptions::keep_cpus_awake`]), for its lifetime.
    keep_awake: Option<rt_sched::KeepAwake>,
}

/// Never interrupted; for callers without a Ctrl-C flag.
pub fn never() -> bool {
    false
}

impl Fleet {
    /// A fleet that has not started yet.
    pub fn new(source: Source, options: FleetOptions) -> Result<Fleet> {
        if source.replicas() == 0 {
            fail!(Invalid, "a fleet needs at least one replica");
        }
        if let Source::Llama(spec) = &source {
            llama::check_installed(&spec.server_bin, &spec.model_gguf)?;
        }
        if let Source::Vllm(spec) = &source {
            crate::vllm::check_installed(&spec.spec.dir)?;
        }
        if let Source::Emulated(spec) = &source {
            if !(spec.speed.is_finite() && spec.speed > 0.0) {
                fail!(
                    Invalid,
                    "emulated speed must be a positive number, got {}",
                    spec.speed
                );
            }
            if let Some(bad) = spec
                .slowdowns
                .iter()
                .find(|s| !(s.is_finite() && **s > 0.0))
            {
                fail!(Invalid, "slowdowns must be positive numbers, got {bad}");
            }
        }
        let keep_awake = if options.keep_cpus_awake && matches!(source, Source::Emulated(_)) {
            Some(rt_sched::KeepAwake::start().map_err(|source| Error::KeepAwake { source })?)
        } else {
            None
        };
        Ok(Fleet {
            source,
            options,
            slots: Vec::new(),
            gpu_backend: None,
            replica_devices: Vec::new(),
            started_pids: BTreeMap::new(),
            keep_awake,
        })
    }

    /// CPU spinners kept running beside the replicas ([`FleetOptions::keep_cpus_awake`]; 0: none).
    pub fn keep_awake_threads(&self) -> usize {
        self.keep_awake
            .as_ref()
            .map_or(0, rt_sched::KeepAwake::threads)
    }

    /// Reads the GPUs through `backend` instead of NVML (tests: [`gpu::ScriptedGpus`]). Only a
    /// command fleet reads GPUs at all.
    pub fn with_gpu_backend(mut self, backend: Arc<dyn GpuBackend>) -> Fleet {
        self.gpu_backend = Some(Ok(backend));
        self
    }

    /// What the evidence sampler needs to know of this fleet's GPUs: none for an emulated fleet
    /// (GPUs are not read at all), not known for a static one, and for a command fleet its
    /// replicas' cards and the compute processes they put there while starting.
    pub fn gpus(&self) -> FleetGpus {
        match &self.source {
            Source::Emulated(_) => FleetGpus::Emulated,
            Source::Llama(_) | Source::Vllm(_) => FleetGpus::Cpu,
            Source::Static(_) => FleetGpus::Unknown,
            Source::Command(_) => FleetGpus::Started(StartedGpus {
                backend: self
                    .gpu_backend
                    .clone()
                    .unwrap_or_else(|| Err("the fleet has not started".into())),
                replica_devices: self.replica_devices.clone(),
                started_pids: self.started_pids.clone(),
            }),
        }
    }

    /// The GPU reader of a command fleet, opened once; `None` for other sources.
    fn gpu_backend(&mut self) -> Option<std::result::Result<Arc<dyn GpuBackend>, String>> {
        if !matches!(self.source, Source::Command(_)) {
            return None;
        }
        Some(self.gpu_backend.get_or_insert_with(gpu::open_nvml).clone())
    }

    /// The compute pids on the cards of `replicas` now, keyed by device (command fleets whose
    /// GPU reader opened; empty otherwise).
    fn gpu_snapshot(&mut self, replicas: &[usize]) -> PidsByDevice {
        let Some(Ok(backend)) = self.gpu_backend() else {
            return BTreeMap::new();
        };
        let devices: BTreeSet<u32> = replicas
            .iter()
            .filter_map(|&i| self.replica_devices.get(i)?.as_ref().ok())
            .flatten()
            .copied()
            .collect();
        gpu::compute_pids(backend.as_ref(), devices)
    }

    /// Resolves the cards of every replica of a command fleet (before it spawns them).
    fn resolve_replica_devices(&mut self) {
        let Source::Command(spec) = &self.source else {
            self.replica_devices.clear();
            return;
        };
        let spec = spec.clone();
        let backend = self.gpu_backend().and_then(std::result::Result::ok);
        self.replica_devices = (0..spec.replicas)
            .map(|i| {
                gpu::resolve_devices(&spec.gpu(i), backend.as_deref())
                    .map_err(|e| format!("replica {i}'s card is not known: {e}"))
            })
            .collect();
    }

    /// Adds what appeared on each card between `before` and now to the fleet's processes.
    fn record_started_pids(&mut self, before: PidsByDevice, replicas: &[usize]) {
        for (device, after) in self.gpu_snapshot(replicas) {
            let new = match (before.get(&device), after) {
                (Some(Ok(before)), Ok(after)) => Ok(after.difference(before).copied().collect()),
                (Some(Err(e)), _) => Err(e.clone()),
                (_, Err(e)) => Err(e),
                (None, Ok(_)) => Err(format!("GPU {device}: not listed before the start")),
            };
            match (self.started_pids.get_mut(&device), new) {
                (Some(Ok(known)), Ok(new)) => known.extend(new),
                (Some(slot), Err(e)) => *slot = Err(e),
                (Some(Err(_)), Ok(_)) => {}
                (None, new) => {
                    self.started_pids.insert(device, new);
                }
            }
        }
    }

    /// The source this fleet was built from.
    pub fn source(&self) -> &Source {
        &self.source
    }

    /// Starts every replica and waits until each is healthy.
    ///
    /// All replicas are spawned before any is awaited, so startups overlap.
    pub fn start(&mut self, should_stop: &dyn Fn() -> bool) -> Result<()> {
        if !self.slots.is_empty() {
            fail!(State, "the fleet is already running");
        }
        let n = self.source.replicas();
        let all: Vec<usize> = (0..n).collect();
        // A command fleet's processes on its cards: what is there before the spawn is not ours,
        // what appears until the replicas are ready is (vLLM's workers included), whether or not
        // `/proc` can see it (NVML reports host pids in a container).
        self.resolve_replica_devices();
        let before = self.gpu_snapshot(&all);
        let mut slots = Vec::with_capacity(n);
        for index in 0..n {
            slots.push(self.spawn_slot(index, None, 0)?);
        }
        self.slots = slots;
        for index in 0..n {
            if let Err(e) = self.await_ready(index, should_stop) {
                self.stop();
                return Err(e);
            }
        }
        self.record_started_pids(before, &all);
        Ok(())
    }

    /// Stops every replica this fleet started (SIGTERM, then SIGKILL after the grace period).
    pub fn stop(&mut self) {
        for slot in &mut self.slots {
            if let Some(guard) = slot.guard.as_mut() {
                guard.signal(libc::SIGTERM);
            }
        }
        for slot in &mut self.slots {
            if let Some(mut guard) = slot.guard.take() {
                guard.terminate(self.options.stop_grace);
            }
        }
        self.slots.clear();
        self.replica_devices.clear();
        self.started_pids.clear();
    }

    /// Makes every replica forget its cache, so that a second pass never reads back what the
    /// first prefilled: processes are restarted; static replicas get `POST /reset_prefix_cache`.
    /// A llama fleet restarts too (`EngineKind::LlamaCpp.cache_reset()`): llama.cpp has no
    /// `reset_prefix_cache`, and `POST /slots/{id}?action=erase` clears a slot but not the
    /// `--cache-ram` prompt store; the tiny model restarts in well under a second.
    pub fn cycle(&mut self, should_stop: &dyn Fn() -> bool) -> Result<()> {
        match &self.source {
            // A vLLM replica takes 20–40 s to start on 2 cores; its reset endpoint (dev mode)
            // clears the prefix cache, and the router of the next cell subscribes afresh.
            Source::Static(_) | Source::Vllm(_) => {
                if self.slots.is_empty() {
                    return self.start(should_stop);
                }
                for slot in &self.slots {
                    reset_prefix_cache(&slot.info.url).map_err(|e| {
                        e.context(format!(
                            "cycling replica {} ({})",
                            slot.info.index, slot.info.url
                        ))
                    })?;
                }
                Ok(())
            }
            _ => {
                self.stop();
                self.start(should_stop)
            }
        }
    }

    /// SIGKILLs replica `index` (the fault `kill -9`); it stays down until [`Fleet::restart_one`].
    pub fn kill_one(&mut self, index: usize) -> Result<()> {
        let slot = self.slot_mut(index)?;
        match slot.guard.as_mut() {
            Some(guard) => {
                guard.kill();
                slot.guard = None;
                Ok(())
            }
            None => fail!(
                State,
                "replica {index} has no process here to kill (static replicas are managed elsewhere, or it is already down)"
            ),
        }
    }

    /// Starts replica `index` again on the same ports, so the router's URL stays valid.
    pub fn restart_one(&mut self, index: usize, should_stop: &dyn Fn() -> bool) -> Result<()> {
        let (previous, starts) = {
            let slot = self.slot_mut(index)?;
            if let Some(mut guard) = slot.guard.take() {
                guard.terminate(Duration::from_secs(5));
            }
            (slot.info.clone(), slot.starts)
        };
        let before = self.gpu_snapshot(&[index]);
        let fresh = self.spawn_slot(index, Some(&previous), starts)?;
        self.slots[index] = fresh;
        self.await_ready(index, should_stop)?;
        self.record_started_pids(before, &[index]);
        Ok(())
    }

    /// The running replicas, in fleet order.
    pub fn replicas(&self) -> Vec<ReplicaInfo> {
        self.slots.iter().map(|s| s.info.clone()).collect()
    }

    /// Base URLs in fleet order.
    pub fn urls(&self) -> Vec<String> {
        self.slots.iter().map(|s| s.info.url.clone()).collect()
    }

    /// KV event endpoints in fleet order; `None` where a replica publishes none.
    pub fn kv_event_endpoints(&self) -> Vec<Option<String>> {
        self.slots
            .iter()
            .map(|s| s.info.kv_events.clone())
            .collect()
    }

    /// The engine the replicas run (recorded in meta as `fleet.engine`).
    pub fn engine(&self) -> EngineKind {
        self.source.engine()
    }

    /// The `SCHED_FIFO` priority its replicas' threads run at on this machine's cores: emulated
    /// replicas [`EMULATED_SCHED_FIFO_PRIORITY`]; `None` for the others (their processes keep
    /// the default policy, or run elsewhere).
    pub fn replica_sched_fifo_priority(&self) -> Option<u8> {
        match &self.source {
            Source::Emulated(_) => Some(EMULATED_SCHED_FIFO_PRIORITY),
            _ => None,
        }
    }

    /// Why these replicas cannot feed a policy that needs KV events ([`Source::no_kv_events_reason`]).
    pub fn no_kv_events_reason(&self) -> Option<&'static str> {
        self.source.no_kv_events_reason()
    }

    /// What meta records of the replicas' engine settings: a llama fleet's pinned flags
    /// ([`LlamaSpec::meta`]), an emulated fleet's cache model when it is not the paged default
    /// ([`EmulatedCache::meta`]); `null` for the other sources.
    pub fn engine_meta(&self) -> serde_json::Value {
        match &self.source {
            Source::Llama(spec) => spec.meta(),
            Source::Vllm(spec) => spec.meta(),
            Source::Emulated(spec) => spec.cache.meta(),
            _ => serde_json::Value::Null,
        }
    }

    /// Replica `index`'s KV cache shape: from `vllm:cache_config_info` on `/metrics` (vLLM, the
    /// emulator), or for a llama fleet from `GET /props` by [`llama::capacity_from_props`] (one
    /// token per "block": llama.cpp caches token by token). `None` when the replica does not say.
    pub fn kv_cache(&self, index: usize) -> Option<CacheConfig> {
        let slot = self.slots.get(index)?;
        match &self.source {
            Source::Llama(spec) => {
                let r = http::get(
                    &http::join(&slot.info.url, "/props"),
                    Duration::from_secs(5),
                )
                .ok()?;
                let props: serde_json::Value = serde_json::from_slice(&r.body).ok()?;
                Some(CacheConfig {
                    block_size_tokens: 1,
                    num_gpu_blocks: llama::capacity_from_props(&props, spec.kv_unified)?,
                })
            }
            _ => {
                let r = http::get(
                    &http::join(&slot.info.url, "/metrics"),
                    Duration::from_secs(5),
                )
                .ok()?;
                crate::metrics::cache_config(&r.text())
            }
        }
    }

    /// The replicas' KV block size in tokens, as their first replica's `/metrics` reports it
    /// (`None` when it does not say).
    pub fn block_size_tokens(&self) -> Option<u32> {
        u32::try_from(self.kv_cache(0)?.block_size_tokens).ok()
    }

    /// Process group ids of every process this fleet runs (for the foreign-process check).
    pub fn process_groups(&self) -> Vec<u32> {
        self.slots.iter().filter_map(|s| s.info.pid).collect()
    }

    /// Fails naming the replica and its log when a process this fleet started has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        for slot in &mut self.slots {
            if let Some(guard) = slot.guard.as_mut()
                && let Some(status) = guard.try_wait()?
            {
                fail!(
                    Exited,
                    "replica {} exited unexpectedly ({status}); see its log {}",
                    slot.info.index,
                    guard.log_path().display()
                );
            }
        }
        Ok(())
    }

    fn slot_mut(&mut self, index: usize) -> Result<&mut Slot> {
        let len = self.slots.len();
        self.slots
            .get_mut(index)
            .ok_or_else(|| err!(Invalid, "no replica {index} (the fleet has {len})"))
    }

    fn log_path(&self, index: usize) -> PathBuf {
        self.options.log_dir.join(format!("replica-{index}.log"))
    }

    fn spawn_slot(
        &self,
        index: usize,
        previous: Option<&ReplicaInfo>,
        starts: u32,
    ) -> Result<Slot> {
        let log_path = self.log_path(index);
        match &self.source {
            Source::Emulated(spec) => {
                let mut cmd = Command::new(&spec.engine_bin);
                let port = previous.and_then(|p| port_of(&p.url)).unwrap_or(0);
                cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
                    .args(["--model", &spec.model])
                    .args(["--speed", &spec.speed.to_string()])
                    .args(["--slowdown", &spec.slowdown(index).to_string()])
                    .args(["--seed", &(spec.seed + index as u64).to_string()])
                    .arg("--enable-prompt-tokens-details")
                    .args([
                        "--sched-fifo-priority",
                        &EMULATED_SCHED_FIFO_PRIORITY.to_string(),
                    ]);
                if let Some(blocks) = spec.num_gpu_blocks {
                    cmd.args(["--num-gpu-blocks", &blocks.to_string()]);
                }
                cmd.args(spec.cache.args());
                if spec.kv_events {
                    if let Some(reason) = spec.cache.no_kv_events_reason() {
                        fail!(
                            Invalid,
                            "KV events were asked of an emulated fleet that has none: {reason}"
                        );
                    }
                    let kv_port = previous
                        .and_then(|p| p.kv_events.as_deref())
                        .and_then(port_of)
                        .unwrap_or(0);
                    cmd.args(["--kv-events-port", &kv_port.to_string()]);
                    // A restarted replica keeps its replay port too, so a subscriber can repair.
                    if let Some(replay) = previous
                        .and_then(|p| p.kv_replay.as_deref())
                        .and_then(port_of)
                    {
                        cmd.args(["--kv-replay-port", &replay.to_string()]);
                    }
                }
                cmd.args(&spec.extra_args);
                // URL and event endpoints come from its readiness line.
                spawn_replica(
                    cmd,
                    index,
                    starts,
                    log_path,
                    String::new(),
                    None,
                    spec.slowdown(index),
                )
            }
            Source::Command(spec) => {
                let line = spec.render(index)?;
                let mut cmd = Command::new("sh");
                // `exec` so the guard's pid is the server itself, not a waiting shell.
                cmd.arg("-c")
                    .arg(format!("exec {line}"))
                    .env("CUDA_VISIBLE_DEVICES", spec.gpu(index));
                let kv_events = match spec.kv_base_port {
                    Some(base) => {
                        Some(format!("tcp://{}:{}", spec.host, offset_port(base, index)?))
                    }
                    None => None,
                };
                let url = format!("http://{}:{}", spec.host, spec.port(index)?);
                spawn_replica(cmd, index, starts, log_path, url, kv_events, 1.0)
            }
            Source::Llama(spec) => {
                llama::check_installed(&spec.server_bin, &spec.model_gguf)?;
                // Port 0 on the first start (the server logs the one it bound); a restart keeps
                // the previous port, so the router's URL stays valid. stderr joins stdout so
                // that the listening line reaches `wait_for_line`.
                let port = previous.and_then(|p| port_of(&p.url)).unwrap_or(0);
                let mut cmd = Command::new("sh");
                cmd.arg("-c")
                    .arg("exec \"$0\" \"$@\" 2>&1")
                    .arg(&spec.server_bin)
                    .args(spec.args(index, port));
                // Its URL comes from the port it logs (`llama::parse_listening`).
                spawn_replica(cmd, index, starts, log_path, String::new(), None, 1.0)
            }
            Source::Vllm(spec) => {
                // Free ports on the first start; a restart keeps them, so the router's URL and
                // event endpoint stay valid.
                let port = match previous.and_then(|p| port_of(&p.url)) {
                    Some(p) => p,
                    None => crate::ingress::haproxy::free_port()?,
                };
                let kv_port = match previous
                    .and_then(|p| p.kv_events.as_deref())
                    .and_then(port_of)
                {
                    Some(p) => p,
                    None => crate::ingress::haproxy::free_port()?,
                };
                let cmd = spec.replica(index).command(port, kv_port);
                let url = format!("http://127.0.0.1:{port}");
                let kv_events = Some(format!("tcp://127.0.0.1:{kv_port}"));
                spawn_replica(cmd, index, starts, log_path, url, kv_events, 1.0)
            }
            Source::Static(spec) => Ok(Slot {
                info: ReplicaInfo {
                    index,
                    url: spec.urls[index].trim_end_matches('/').to_string(),
                    kv_events: spec.kv_events.get(index).cloned().filter(|s| !s.is_empty()),
                    kv_replay: None,
                    pid: None,
                    log_path: None,
                    slowdown: 1.0,
                },
                guard: None,
                starts: starts + 1,
            }),
        }
    }

    /// Readiness line (emulated: the JSON line; llama: `listening on …`), then `/health` 200
    /// within the ready timeout (llama-server answers 503 while it loads the model).
    fn await_ready(&mut self, index: usize, should_stop: &dyn Fn() -> bool) -> Result<()> {
        let deadline = Instant::now() + self.options.ready_timeout;
        let emulated = matches!(self.source, Source::Emulated(_));
        let llama = matches!(self.source, Source::Llama(_));
        let slot = &mut self.slots[index];
        if llama {
            let guard = slot
                .guard
                .as_mut()
                .ok_or_else(|| err!(State, "replica {index} has no process"))?;
            let port = guard.wait_for_line(
                self.options.ready_timeout,
                llama::parse_listening,
                should_stop,
            )?;
            slot.info.url = format!("http://127.0.0.1:{port}");
        }
        if emulated {
            let guard = slot
                .guard
                .as_mut()
                .ok_or_else(|| err!(State, "replica {index} has no process"))?;
            let ready = guard.wait_ready(self.options.ready_timeout, should_stop)?;
            slot.info.url = ready.url();
            slot.info.kv_events = ready.kv_events.clone();
            slot.info.kv_replay = ready.kv_replay.clone();
        }
        let log_hint = slot
            .info
            .log_path
            .as_ref()
            .map(|p| format!("; see its log {}", p.display()))
            .unwrap_or_default();
        let health = http::join(&slot.info.url, "/health");
        loop {
            if should_stop() {
                fail!(
                    Interrupted,
                    "replica {index}: interrupted while waiting for it to become healthy"
                );
            }
            if let Some(guard) = slot.guard.as_mut()
                && let Some(status) = guard.try_wait()?
            {
                fail!(
                    Exited,
                    "replica {index} ({}) exited ({status}) before it was healthy{log_hint}",
                    slot.info.url
                );
            }
            let last_error = match http::get(&health, Duration::from_secs(2)) {
                Ok(r) if r.status == 200 => return Ok(()),
                Ok(r) => format!("GET /health answered {}", r.status),
                Err(e) => e.chain(),
            };
            if Instant::now() >= deadline {
                fail!(
                    Timeout,
                    "replica {index} ({}) not healthy within {:.0} s (last: {last_error}){log_hint}",
                    slot.info.url,
                    self.options.ready_timeout.as_secs_f64()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        // Kill without grace: drop also runs while unwinding, when nobody waits for flushes.
        for slot in &mut self.slots {
            if let Some(mut guard) = slot.guard.take() {
                guard.kill();
            }
        }
    }
}

/// `POST /reset_prefix_cache` on one replica; any non-2xx answer is an error.
pub fn reset_prefix_cache(url: &str) -> Result<()> {
    // vLLM answers `{"success": false}` while blocks are still held (a request finishing):
    // retried a few times, then an error.
    for attempt in 0..5 {
        let r = http::post(
            &http::join(url, "/reset_prefix_cache"),
            None,
            Duration::from_secs(30),
        )?;
        if !(200..300).contains(&r.status) {
            fail!(
                Answer,
                "POST /reset_prefix_cache answered {}: {}",
                r.status,
                r.text()
            );
        }
        let refused = serde_json::from_slice::<serde_json::Value>(&r.body)
            .is_ok_and(|v| v.get("success") == Some(&serde_json::Value::Bool(false)));
        if !refused {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(200 << attempt));
    }
    fail!(
        Answer,
        "POST /reset_prefix_cache answered {{\"success\": false}} 5 times: blocks are still held"
    )
}

fn port_of(url: &str) -> Option<u16> {
    let authority = url.rsplit("//").next()?;
    let authority = authority.split('/').next()?;
    authority.rsplit(':').next()?.parse().ok()
}

fn write_log_header(path: &Path, index: usize, starts: u32, cmd: &Command) -> Result<()> {
    use std::io::Write;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(Error::io("creating log directory", dir))?;
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(Error::io("opening log file", path))?;
    let args: Vec<String> = cmd
        .get_args()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    writeln!(
        f,
        "=== replica {index} start #{} : {} {}",
        starts + 1,
        cmd.get_program().to_string_lossy(),
        args.join(" ")
    )
    .map_err(Error::io("writing log file", path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_template_renders_every_placeholder() {
        let spec = CommandSpec {
            template: "vllm serve {model} --host {host} --port {port} --kv-events-config '{\"endpoint\":\"tcp://*:{kv_port}\"}' # gpu {gpu} #{index}".into(),
            model: "m".into(),
            replicas: 2,
            host: "127.0.0.1".into(),
            base_port: 8000,
            kv_base_port: Some(5557),
            gpus: vec!["2".into(), "3".into()],
        };
        assert_eq!(
            spec.render(1).unwrap(),
            "vllm serve m --host 127.0.0.1 --port 8001 --kv-events-config '{\"endpoint\":\"tcp://*:5558\"}' # gpu 3 #1"
        );
        let no_kv = CommandSpec {
            kv_base_port: None,
            ..spec.clone()
        };
        assert!(no_kv.render(0).is_err());
        let overflow = CommandSpec {
            base_port: 65535,
            ..spec
        };
        assert!(overflow.render(1).is_err());
    }

    #[test]
    fn ports_are_read_from_urls() {
        assert_eq!(port_of("http://127.0.0.1:4000"), Some(4000));
        assert_eq!(port_of("tcp://127.0.0.1:5557"), Some(5557));
        assert_eq!(port_of("http://host/x"), None);
    }

    /// An emulated spec of `replicas` replicas at speed 1 (nothing is spawned until `start`).
    fn emulated(replicas: usize) -> EmulatedSpec {
        EmulatedSpec {
            engine_bin: "engine".into(),
            replicas,
            speed: 1.0,
            slowdowns: vec![],
            num_gpu_blocks: None,
            model: "m".into(),
            seed: 0,
            kv_events: false,
            extra_args: vec![],
            cache: EmulatedCache::Paged,
        }
    }

    #[test]
    fn bad_specs_are_refused() {
        let spec = emulated(0);
        assert!(Fleet::new(Source::Emulated(spec.clone()), FleetOptions::new("/tmp")).is_err());
        let slow = EmulatedSpec {
            replicas: 2,
            slowdowns: vec![1.0, -2.0],
            ..spec.clone()
        };
        assert!(Fleet::new(Source::Emulated(slow), FleetOptions::new("/tmp")).is_err());
        let fast = EmulatedSpec {
            replicas: 1,
            speed: 0.0,
            ..spec
        };
        assert!(Fleet::new(Source::Emulated(fast), FleetOptions::new("/tmp")).is_err());
    }

    #[test]
    fn only_an_emulated_fleet_asked_to_keeps_the_cpus_awake() {
        let spec = emulated(1);
        let awake = FleetOptions {
            keep_cpus_awake: true,
            ..FleetOptions::new("/tmp")
        };
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let fleet = Fleet::new(Source::Emulated(spec.clone()), awake.clone()).unwrap();
        assert_eq!(fleet.keep_awake_threads(), cpus);
        drop(fleet); // stops and joins the spinners
        let asleep = Fleet::new(Source::Emulated(spec), FleetOptions::new("/tmp")).unwrap();
        assert_eq!(asleep.keep_awake_threads(), 0);
        let real = Source::Static(StaticSpec {
            urls: vec!["http://127.0.0.1:1".into()],
            kv_events: vec![],
        });
        assert_eq!(Fleet::new(real, awake).unwrap().keep_awake_threads(), 0);
    }
}
