//! Fleet flags shared by `calibrate`, `sweep` and `fault`, converted into the library's
//! `experiment::FleetSpec` (defaults for `--quick` applied).

use std::path::PathBuf;

use clap::Args;

use experiment::fleet_description::FleetDescription;
use experiment::fleet_spec::{
    CacheModelKind, FleetKind, FleetSpec, default_blocks, default_replicas, default_speed,
};

/// The fleet a command runs against.
#[derive(Debug, Clone, Args)]
pub struct FleetArgs {
    /// Replica source.
    #[arg(long, value_enum, default_value_t = FleetKind::Emulated)]
    pub fleet: FleetKind,
    /// Replicas (emulated, command). Default: 5, or 3 with --quick.
    #[arg(long)]
    pub replicas: Option<usize>,
    /// Emulator speed-up (durations ÷ it). Default: 6, or 1 with `--cache-model llama-slots`.
    #[arg(long)]
    pub speed: Option<f64>,
    /// Emulated engines' KV cache: `paged` (vLLM's) or `llama-slots` (the llama fleet's twin).
    #[arg(long, value_enum, default_value_t = CacheModelKind::Paged)]
    pub cache_model: CacheModelKind,
    /// A fleet description (`fleets/*.toml`) whose engines the emulated fleet runs; its KV sets the pool.
    #[arg(long, value_parser = FleetDescription::from_arg)]
    pub fleet_description: Option<FleetDescription>,
    /// Per-replica emulated slowdown factors, e.g. `1,1,1,1,1.5` (a throttled card).
    #[arg(long, value_delimiter = ',')]
    pub slowdowns: Vec<f64>,
    /// KV blocks per emulated replica (`--num-gpu-blocks`). Default: 8192, or 4096 with --quick.
    #[arg(long)]
    pub num_gpu_blocks: Option<u64>,
    /// Model name (served by the replicas; the router's salt).
    #[arg(long, default_value = "kvroute/emulated-8b")]
    pub model: String,
    /// Base seed of the emulated engines.
    #[arg(long, default_value_t = 1)]
    pub engine_seed: u64,
    /// Command template for `--fleet command`; placeholders {model} {port} {kv_port} {gpu}
    /// {index} {host}; runs with CUDA_VISIBLE_DEVICES={gpu}.
    #[arg(long)]
    pub command: Option<String>,
    /// Host the command replicas listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// First port of the command replicas (replica i: base + i).
    #[arg(long, default_value_t = 8100)]
    pub base_port: u16,
    /// First KV-event port of the command replicas (replica i: base + i).
    #[arg(long)]
    pub kv_base_port: Option<u16>,
    /// GPU ids for the command replicas, e.g. `0,1,2,3,4`.
    #[arg(long, value_delimiter = ',')]
    pub gpus: Vec<String>,
    /// Replica URLs for `--fleet static`.
    #[arg(long, value_delimiter = ',')]
    pub urls: Vec<String>,
    /// KV event endpoints of the static replicas, same order.
    #[arg(long, value_delimiter = ',')]
    pub kv_events: Vec<String>,
    /// Seconds a replica may take to become healthy.
    #[arg(long, default_value_t = 120.0)]
    pub ready_timeout_s: f64,
    /// `llama-server` for `--fleet llama` (default: scripts/llama-server.sh's cache,
    /// `~/.cache/kvroute/llama-<version>/bin/llama-server`, or `$KVROUTE_LLAMA_DIR/bin/…`).
    #[arg(long)]
    pub llama_server: Option<PathBuf>,
    /// GGUF model for `--fleet llama` (default: the tiny word-vocabulary model in the same cache).
    #[arg(long)]
    pub model_gguf: Option<PathBuf>,
    /// vLLM's install for `--fleet vllm` (default: scripts/vllm-server.sh's cache,
    /// `~/.cache/kvroute/vllm-0.32.0`, or `$KVROUTE_VLLM_DIR`).
    #[arg(long)]
    pub vllm_dir: Option<PathBuf>,
}

impl FleetArgs {
    /// The fleet these flags describe, with the defaults of a `--quick` or full run.
    pub fn spec(&self, quick: bool) -> FleetSpec {
        let or = |p: &Option<PathBuf>, d: fn() -> PathBuf| p.clone().unwrap_or_else(d);
        FleetSpec {
            kind: self.fleet,
            replicas: self.replicas.unwrap_or_else(|| default_replicas(quick)),
            speed: self.speed.unwrap_or(default_speed(self.cache_model)),
            slowdowns: self.slowdowns.clone(),
            num_gpu_blocks: (self
                .num_gpu_blocks
                .or(FleetDescription::blocks(&self.fleet_description)))
            .unwrap_or_else(|| default_blocks(quick)),
            model: self.model.clone(),
            engine_seed: self.engine_seed,
            command: self.command.clone(),
            host: self.host.clone(),
            base_port: self.base_port,
            kv_base_port: self.kv_base_port,
            gpus: self.gpus.clone(),
            urls: self.urls.clone(),
            kv_events: self.kv_events.clone(),
            ready_timeout_s: self.ready_timeout_s,
            llama_server: or(&self.llama_server, fleet::llama::default_server_bin),
            model_gguf: or(&self.model_gguf, fleet::llama::default_tiny_model),
            vllm_dir: or(&self.vllm_dir, fleet::vllm::default_dir),
            cache_model: self.cache_model,
            description: self.fleet_description.clone(),
        }
    }
}
