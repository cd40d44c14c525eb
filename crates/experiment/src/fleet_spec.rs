//! The fleet an experiment runs against, as settings: where the replicas come from (emulated,
//! a command template, static URLs), how many and how fast. `FleetSpec::source` turns it into a
//! `fleet::Source` (with a calibration's exclusions), `FleetSpec::key` into the `FleetKey` a
//! calibration is valid for and `meta.json` records.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

use fleet::{
    CommandSpec, EmulatedCache, EmulatedSpec, FleetOptions, LlamaSpec, Source, StaticSpec,
};
use schema::EngineKind;

use crate::calibration::FleetKey;

/// Default emulator speed-up. Chosen so that `sweep pressure-grid --quick` fits a fresh 2-core
/// machine's 20-minute budget while engine lateness stays within its bound (see xtask's README).
pub const DEFAULT_SPEED: f64 = 6.0;

/// KV blocks per emulated replica: about a 3090's pool for a 4-bit 8B model (the reference fleet,
/// crates/engine-core/README.md, "Defaults and calibration": ~16 GB of KV at 128 KiB per token ≈
/// 125k tokens ≈ 7,800 blocks), so that even working set 0.25 holds many more conversations than
/// the 32 users (a closed-loop user waits while another holds the same conversation's turn).
pub const FULL_BLOCKS: u64 = 8192;
/// KV blocks per replica with `--quick`: half the pool, so the cache fills within the short
/// warm-up, while working set 1 still holds ~70 conversations for 32 users.
pub const QUICK_BLOCKS: u64 = 4096;

/// `--max-model-len` of a vLLM fleet's replicas.
pub const VLLM_MAX_MODEL_LEN: u32 = 4096;

/// Replicas by default: 5, or 3 with `--quick`.
pub fn default_replicas(quick: bool) -> usize {
    if quick { 3 } else { 5 }
}

/// KV blocks per emulated replica by default.
pub fn default_blocks(quick: bool) -> u64 {
    if quick { QUICK_BLOCKS } else { FULL_BLOCKS }
}

/// Where replicas come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum FleetKind {
    /// Spawn `engine` processes on loopback.
    Emulated,
    /// Start replicas from `--command` (vLLM, SGLang).
    Command,
    /// Use `--urls` managed elsewhere.
    Static,
    /// Start llama.cpp `llama-server` replicas on loopback (CPU; `fleet::llama`).
    Llama,
    /// Start real vLLM replicas on loopback (CPU; `fleet::vllm`, the install of
    /// `scripts/vllm-server.sh`).
    Vllm,
}

/// The KV cache an emulated fleet's engines model (`--cache-model`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "kebab-case")]
pub enum CacheModelKind {
    /// vLLM's paged prefix cache (the emulator's default).
    #[default]
    Paged,
    /// llama.cpp's slots with the llama fleet's pinned settings and the llama-tiny step model
    /// ([`EmulatedCache::llama_fleet`]): the emulated twin of `--fleet llama`.
    LlamaSlots,
    /// vLLM's paged cache with the vLLM fleet's 32-token blocks and 4,096 tokens per sequence
    /// and the `vllm-tiny-cpu` step model ([`EmulatedCache::vllm_fleet`]): the emulated twin of
    /// `--fleet vllm`.
    VllmTiny,
}

/// Emulator speed of an emulated llama-slots fleet by default: 1, the real llama fleet's, so a
/// plan's wall-clock think times and rates are the same on both.
pub const LLAMA_SLOTS_SPEED: f64 = 1.0;

/// The emulator speed by default for a cache model: [`DEFAULT_SPEED`], or
/// [`LLAMA_SLOTS_SPEED`] for llama-slots.
pub fn default_speed(cache_model: CacheModelKind) -> f64 {
    match cache_model {
        CacheModelKind::Paged => DEFAULT_SPEED,
        CacheModelKind::LlamaSlots | CacheModelKind::VllmTiny => LLAMA_SLOTS_SPEED,
    }
}

/// The fleet a procedure runs against (defaults already applied).
#[derive(Debug, Clone, PartialEq)]
pub struct FleetSpec {
    /// Replica source.
    pub kind: FleetKind,
    /// Replicas (emulated, command; a static fleet has one per URL).
    pub replicas: usize,
    /// Emulator speed-up: every modelled duration is divided by it.
    pub speed: f64,
    /// Per-replica emulated slowdown factors; empty = all 1.
    pub slowdowns: Vec<f64>,
    /// KV blocks per emulated replica.
    pub num_gpu_blocks: u64,
    /// Model name (served by the replicas; the router's salt).
    pub model: String,
    /// Base seed of the emulated engines.
    pub engine_seed: u64,
    /// Command template for a command fleet.
    pub command: Option<String>,
    /// Host the command replicas listen on.
    pub host: String,
    /// First port of the command replicas (replica i: base + i).
    pub base_port: u16,
    /// First KV-event port of the command replicas.
    pub kv_base_port: Option<u16>,
    /// GPU ids of the command replicas.
    pub gpus: Vec<String>,
    /// Replica URLs of a static fleet.
    pub urls: Vec<String>,
    /// KV event endpoints of the static replicas, same order.
    pub kv_events: Vec<String>,
    /// Seconds a replica may take to become healthy.
    pub ready_timeout_s: f64,
    /// `llama-server` of a llama fleet.
    pub llama_server: PathBuf,
    /// The GGUF model a llama fleet serves (as `--model`).
    pub model_gguf: PathBuf,
    /// The install directory of a vLLM fleet (`fleet::vllm::default_dir`).
    pub vllm_dir: PathBuf,
    /// The KV cache an emulated fleet's engines model.
    pub cache_model: CacheModelKind,
    /// The fleet description an emulated fleet's engines follow (`--fleet-description`): their
    /// limits and step model; `None` for the emulator's default engine.
    pub description: Option<crate::fleet_description::FleetDescription>,
}

impl FleetSpec {
    /// The engine the replicas run (meta's `fleet.engine`).
    pub fn engine(&self) -> EngineKind {
        match self.kind {
            FleetKind::Llama => EngineKind::LlamaCpp,
            _ => EngineKind::Vllm,
        }
    }

    /// The engine's pinned flags for meta's `fleet.engine_flags` (a llama fleet's
    /// `LlamaSpec::meta`, an emulated llama-slots fleet's `EmulatedCache::meta`); `null`
    /// otherwise.
    pub fn engine_flags(&self) -> serde_json::Value {
        match self.kind {
            FleetKind::Llama => self.llama_spec(self.replica_count()).meta(),
            FleetKind::Vllm => self.vllm_spec(self.replica_count()).meta(),
            FleetKind::Emulated => self.emulated_cache().meta(),
            _ => serde_json::Value::Null,
        }
    }

    /// Concurrent floor requests per replica in a calibration: a llama fleet's slots (real or
    /// emulated), 1 otherwise. llama.cpp decodes every busy slot in one batch on the replica's
    /// thread, so its inter-token gap grows with the busy slots, which one request at a time
    /// never sees (one request: ITL 1.95 ms; the reference run with four slots busy: 29.2 ms,
    /// docs/engines.md); a paged engine's batch is wide enough that one request is its floor.
    pub fn default_floor_users(&self) -> u32 {
        match (self.kind, self.cache_model) {
            (FleetKind::Llama, _) => self.llama_spec(1).parallel,
            (FleetKind::Emulated, CacheModelKind::LlamaSlots) => match self.emulated_cache() {
                EmulatedCache::LlamaSlots { parallel_slots, .. } => parallel_slots,
                EmulatedCache::Paged
                | EmulatedCache::PagedTwin { .. }
                | EmulatedCache::Described(_) => 1,
            },
            _ => 1,
        }
    }

    /// The cache the emulated engines model: the paged default, or llama-slots with the llama
    /// fleet's pinned settings.
    pub fn emulated_cache(&self) -> EmulatedCache {
        match self.cache_model {
            CacheModelKind::Paged => match &self.description {
                Some(d) => d.emulated_cache(),
                None => EmulatedCache::Paged,
            },
            CacheModelKind::LlamaSlots => EmulatedCache::llama_fleet(),
            CacheModelKind::VllmTiny => EmulatedCache::vllm_fleet(VLLM_MAX_MODEL_LEN),
        }
    }

    /// Why this fleet's replicas cannot feed a policy that needs KV events, or `None`.
    pub fn no_kv_events_reason(&self) -> Option<&'static str> {
        match self.kind {
            FleetKind::Llama => EngineKind::LlamaCpp.no_kv_events_reason(),
            FleetKind::Emulated => self.emulated_cache().no_kv_events_reason(),
            FleetKind::Command | FleetKind::Static | FleetKind::Vllm => None,
        }
    }

    /// Refuses `policies` that need KV events on a fleet that publishes none (a llama fleet,
    /// an emulated llama-slots one), before any process starts.
    pub fn check_policies(&self, policies: &[String]) -> Result<()> {
        if let Some(reason) = self.no_kv_events_reason()
            && let Some(p) = policies.iter().find(|p| crate::grid::needs_kv_events(p))
        {
            bail!(
                "policy {p} needs the engines' KV events and cannot run on this fleet ({}): {reason}. Use a policy that keeps its own belief of residency (prefix-affinity, prefix-hash) or the session policies",
                self.describe()
            );
        }
        Ok(())
    }

    /// `llama`, `emulated`, `emulated llama-slots`, … (for messages).
    fn describe(&self) -> String {
        let kind = format!("{:?}", self.kind).to_lowercase();
        match (self.kind, self.cache_model) {
            (FleetKind::Emulated, CacheModelKind::LlamaSlots) => format!("{kind} llama-slots"),
            (FleetKind::Emulated, CacheModelKind::VllmTiny) => format!("{kind} vllm-tiny"),
            _ => kind,
        }
    }

    /// A vLLM fleet: `fleet::vllm::VllmSpec::new`'s replica serving this fleet's model name with
    /// `num_gpu_blocks` blocks of 32 tokens and 4,096 tokens per sequence (the grid's six-turn
    /// conversations reach about 3,000 of the tiny model's tokens), replicas spread over this
    /// machine's cores.
    fn vllm_spec(&self, replicas: usize) -> fleet::VllmFleetSpec {
        let mut spec = fleet::vllm::VllmSpec::new(&self.vllm_dir);
        spec.model = self.model.clone();
        spec.max_model_len = VLLM_MAX_MODEL_LEN;
        spec.num_gpu_blocks = u32::try_from(self.num_gpu_blocks).unwrap_or(u32::MAX);
        fleet::VllmFleetSpec::new(spec, replicas)
    }

    fn llama_spec(&self, replicas: usize) -> LlamaSpec {
        let mut spec = LlamaSpec::new(
            self.llama_server.clone(),
            self.model_gguf.clone(),
            &self.model,
            replicas,
        );
        spec.seed = self.engine_seed;
        spec
    }

    /// The replica count (before any exclusion).
    pub fn replica_count(&self) -> usize {
        match self.kind {
            FleetKind::Static => self.urls.len(),
            _ => self.replicas,
        }
    }

    /// The speed the timings run at (real engines: 1).
    pub fn effective_speed(&self) -> f64 {
        match self.kind {
            FleetKind::Emulated => self.speed,
            _ => 1.0,
        }
    }

    /// The fleet source, keeping only the replicas in `keep` (all when `None`).
    pub fn source(
        &self,
        engine_bin: &Path,
        kv_events: bool,
        keep: Option<&[usize]>,
    ) -> Result<Source> {
        let n = self.replica_count();
        if n == 0 {
            bail!("the fleet has no replicas (give --replicas, or --urls for --fleet static)");
        }
        let all: Vec<usize> = (0..n).collect();
        let keep: Vec<usize> = keep.map_or(all, |k| k.to_vec());
        if let Some(bad) = keep.iter().find(|&&i| i >= n) {
            bail!("replica {bad} is outside a fleet of {n}");
        }
        if !self.slowdowns.is_empty() && self.slowdowns.len() != n {
            bail!(
                "--slowdowns gives {} factors for {n} replicas",
                self.slowdowns.len()
            );
        }
        self.check_description()?;
        if self.cache_model != CacheModelKind::Paged && self.kind != FleetKind::Emulated {
            bail!(
                "--cache-model applies to --fleet emulated (a real fleet's cache is its engine's)"
            );
        }
        if kv_events && let Some(reason) = self.no_kv_events_reason() {
            bail!(
                "a policy needs KV events, which this fleet ({}) cannot publish: {reason}",
                self.describe()
            );
        }
        Ok(match self.kind {
            FleetKind::Emulated => Source::Emulated(EmulatedSpec {
                engine_bin: engine_bin.to_path_buf(),
                replicas: keep.len(),
                speed: self.speed,
                slowdowns: keep.iter().map(|&i| self.slowdown(i)).collect(),
                // llama-slots sizes its pool by --ctx-tokens; the blocks are unused there.
                num_gpu_blocks: (self.cache_model != CacheModelKind::LlamaSlots)
                    .then_some(self.num_gpu_blocks),
                model: self.model.clone(),
                seed: self.engine_seed,
                kv_events,
                extra_args: Vec::new(),
                cache: self.emulated_cache(),
            }),
            FleetKind::Command => {
                let Some(template) = self.command.clone() else {
                    bail!("--fleet command needs --command TEMPLATE");
                };
                if keep.len() != n && self.gpus.is_empty() {
                    bail!(
                        "excluding replicas of a command fleet needs --gpus to say which card each one uses"
                    );
                }
                let gpus: Vec<String> = keep
                    .iter()
                    .map(|&i| self.gpus.get(i).cloned().unwrap_or_else(|| i.to_string()))
                    .collect();
                Source::Command(CommandSpec {
                    template,
                    model: self.model.clone(),
                    replicas: keep.len(),
                    host: self.host.clone(),
                    base_port: self.base_port,
                    kv_base_port: self.kv_base_port,
                    gpus,
                })
            }
            FleetKind::Llama => Source::Llama(self.llama_spec(keep.len())),
            FleetKind::Vllm => Source::Vllm(self.vllm_spec(keep.len())),
            FleetKind::Static => Source::Static(StaticSpec {
                urls: keep.iter().map(|&i| self.urls[i].clone()).collect(),
                kv_events: keep
                    .iter()
                    .filter_map(|&i| self.kv_events.get(i).cloned())
                    .collect(),
            }),
        })
    }

    /// Refuses a fleet description where it cannot apply: it describes emulated engines of
    /// vLLM's paged cache, so not a real fleet, and not with another `--cache-model`.
    pub fn check_description(&self) -> Result<()> {
        if let Some(d) = &self.description {
            if self.kind != FleetKind::Emulated {
                bail!(
                    "--fleet-description {} describes emulated engines; a real fleet's engines are what they are (give --fleet emulated, or --virtual)",
                    d.path.display()
                );
            }
            if self.cache_model != CacheModelKind::Paged {
                bail!(
                    "--fleet-description {} describes vLLM's paged cache; it cannot be combined with --cache-model {:?}",
                    d.path.display(),
                    self.cache_model
                );
            }
        }
        Ok(())
    }

    /// Log directory and timeouts.
    pub fn options(&self, log_dir: &Path) -> FleetOptions {
        FleetOptions {
            ready_timeout: Duration::from_secs_f64(self.ready_timeout_s.max(1.0)),
            // Every measurement on an emulated fleet: a halted virtual CPU wakes the engines
            // late (rt_sched::KeepAwake).
            keep_cpus_awake: self.kind == FleetKind::Emulated,
            ..FleetOptions::new(log_dir)
        }
    }

    /// The key a calibration is valid for (before any exclusion).
    pub fn key(&self) -> FleetKey {
        let n = self.replica_count();
        FleetKey {
            source: format!("{:?}", self.kind).to_lowercase(),
            replicas: n,
            speed: self.effective_speed(),
            slowdowns: (0..n).map(|i| self.slowdown(i)).collect(),
            num_gpu_blocks: ((self.kind == FleetKind::Emulated
                && self.cache_model != CacheModelKind::LlamaSlots)
                || self.kind == FleetKind::Vllm)
                .then_some(self.num_gpu_blocks),
            model: self.model.clone(),
            detail: match self.kind {
                FleetKind::Emulated => match self.emulated_cache() {
                    EmulatedCache::Paged => None,
                    cache => Some(format!("engine {}", cache.args().join(" "))),
                },
                FleetKind::Command => self.command.clone(),
                FleetKind::Static => Some(self.urls.join(",")),
                FleetKind::Llama => Some(self.llama_spec(n).key()),
                FleetKind::Vllm => Some(self.vllm_spec(n).spec.args(0, 0).join(" ")),
            },
        }
    }

    /// Replica `i`'s slowdown (1 when not given).
    fn slowdown(&self, i: usize) -> f64 {
        self.slowdowns.get(i).copied().unwrap_or(1.0)
    }
}

#[cfg(test)]
impl FleetSpec {
    /// A small emulated fleet for tests across the crate (3 replicas, quick blocks).
    pub(crate) fn test_emulated() -> FleetSpec {
        FleetSpec {
            kind: FleetKind::Emulated,
            replicas: 3,
            speed: DEFAULT_SPEED,
            slowdowns: vec![],
            num_gpu_blocks: QUICK_BLOCKS,
            model: "m".into(),
            engine_seed: 1,
            command: None,
            host: "127.0.0.1".into(),
            base_port: 8100,
            kv_base_port: None,
            gpus: vec![],
            urls: vec![],
            kv_events: vec![],
            ready_timeout_s: 120.0,
            llama_server: PathBuf::from("llama-server"),
            model_gguf: PathBuf::from("m.gguf"),
            vllm_dir: PathBuf::from("vllm"),
            cache_model: CacheModelKind::Paged,
            description: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn emulated() -> FleetSpec {
        FleetSpec::test_emulated()
    }

    #[test]
    fn the_key_and_the_source_follow_the_spec() {
        let mut spec = emulated();
        spec.slowdowns = vec![1.0, 1.0, 1.5];
        let key = spec.key();
        assert_eq!(key.source, "emulated");
        assert_eq!(key.slowdowns, [1.0, 1.0, 1.5]);
        assert_eq!(key.num_gpu_blocks, Some(QUICK_BLOCKS));
        let Source::Emulated(e) = spec
            .source(Path::new("engine"), true, Some(&[0, 2]))
            .unwrap()
        else {
            panic!("not emulated")
        };
        assert_eq!(
            (e.replicas, e.slowdowns, e.kv_events),
            (2, vec![1.0, 1.5], true)
        );
        assert!(spec.source(Path::new("engine"), false, Some(&[3])).is_err());
        spec.slowdowns = vec![1.0];
        assert!(spec.source(Path::new("engine"), false, None).is_err());
        // Real engines run at speed 1; a static fleet has one replica per URL.
        spec.kind = FleetKind::Static;
        spec.urls = vec!["http://a".into(), "http://b".into()];
        assert_eq!((spec.replica_count(), spec.effective_speed()), (2, 1.0));
        assert_eq!(spec.key().num_gpu_blocks, None);
        assert_eq!(spec.key().detail.as_deref(), Some("http://a,http://b"));
        assert_eq!(spec.engine(), EngineKind::Vllm);
        assert!(spec.engine_flags().is_null());
        // A llama fleet: llama.cpp, speed 1, its pinned flags in the key and in meta.
        spec.kind = FleetKind::Llama;
        spec.slowdowns = vec![];
        assert_eq!(spec.engine(), EngineKind::LlamaCpp);
        assert_eq!((spec.replica_count(), spec.effective_speed()), (3, 1.0));
        assert!(spec.key().detail.unwrap().contains("-np 4 -c 16384 -t 1"));
        assert_eq!(spec.engine_flags()["ctx_size_tokens"], 16384);
        let Source::Llama(l) = spec
            .source(Path::new("engine"), false, Some(&[0, 2]))
            .unwrap()
        else {
            panic!("not llama")
        };
        assert_eq!(l.replicas, 2);
        let exact = vec!["round-robin".to_string(), "exact-residency".to_string()];
        assert!(
            spec.check_policies(&exact)
                .unwrap_err()
                .to_string()
                .contains("llama.cpp's llama-server publishes no KV events")
        );
        // The cache model belongs to emulated fleets only.
        spec.cache_model = CacheModelKind::LlamaSlots;
        assert!(spec.source(Path::new("engine"), false, None).is_err());
    }

    #[test]
    fn an_emulated_llama_fleet_runs_the_llama_fleets_slots_without_kv_events() {
        let paged = emulated();
        let spec = FleetSpec {
            cache_model: CacheModelKind::LlamaSlots,
            speed: default_speed(CacheModelKind::LlamaSlots),
            ..emulated()
        };
        // The engines get the llama fleet's pinned slot settings and the llama-tiny step model.
        let Source::Emulated(e) = spec.source(Path::new("engine"), false, None).unwrap() else {
            panic!("not emulated")
        };
        let pinned = LlamaSpec::new(PathBuf::new(), PathBuf::new(), "m", 3);
        assert_eq!(e.num_gpu_blocks, None);
        assert_eq!(e.speed, 1.0);
        assert_eq!(
            e.cache.args().join(" "),
            format!(
                "--cache-model llama-slots --parallel-slots {} --slot-prompt-similarity {} --ctx-tokens {} --step-model llama-tiny",
                pinned.parallel, pinned.slot_prompt_similarity, pinned.ctx_size_tokens
            )
        );
        assert_eq!(
            e.cache.args().join(" "),
            "--cache-model llama-slots --parallel-slots 4 --slot-prompt-similarity 0.1 --ctx-tokens 16384 --step-model llama-tiny"
        );
        // Meta records it; the key tells it from the paged fleet (a calibration of one is not
        // the other's); the engine API stays vLLM's (the emulator's).
        let flags = spec.engine_flags();
        assert_eq!(flags["cache_model"], "llama-slots");
        assert_eq!(flags["parallel_slots"], 4);
        assert_eq!(flags["ctx_size_tokens"], 16384);
        assert_eq!(flags["step_model"], "llama-tiny");
        assert!(paged.engine_flags().is_null());
        assert_ne!(spec.key(), paged.key());
        assert_eq!(spec.key().num_gpu_blocks, None);
        assert!(
            spec.key()
                .detail
                .unwrap()
                .contains("--cache-model llama-slots")
        );
        assert_eq!(spec.engine(), EngineKind::Vllm);
        // Exact residency is refused, as on the real llama fleet: no KV events.
        let e = spec.source(Path::new("engine"), true, None).unwrap_err();
        assert!(
            e.to_string()
                .contains("emulated llama-slots) cannot publish: the emulator's llama-slots cache model publishes no KV events"),
            "{e}"
        );
        let policies: Vec<String> = ["round-robin", "prefix-affinity", "exact-residency"]
            .map(String::from)
            .to_vec();
        let e = spec.check_policies(&policies).unwrap_err().to_string();
        assert!(
            e.starts_with("policy exact-residency needs the engines' KV events and cannot run on this fleet (emulated llama-slots)"),
            "{e}"
        );
        assert!(spec.check_policies(&policies[..2]).is_ok());
        // Its floors, like the real llama fleet's, are measured with every slot busy.
        assert_eq!(
            (spec.default_floor_users(), paged.default_floor_users()),
            (4, 1)
        );
        assert!(paged.check_policies(&policies).is_ok());
    }
}
