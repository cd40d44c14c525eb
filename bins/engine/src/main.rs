//! `engine`: one emulated vLLM replica (or, with `--cache-model llama-slots`, a llama.cpp
//! `llama-server`'s slot cache). Parses vLLM-like flags, starts the server, prints the readiness
//! line (docs/CONTRACTS.md) and runs until SIGTERM/SIGINT.

use clap::Parser;
use engine::server::{self, KvEventsConfig, ServerConfig};
use engine::{CacheModel, Encoding, EngineConfig, StepModel};

/// An emulated vLLM replica: paged KV cache with prefix caching, v1 scheduler, calibrated step times.
#[derive(Parser, Debug)]
#[command(name = "engine", version)]
struct Args {
    /// Listen host.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Listen port (0 = ephemeral).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Model name (vLLM's `--model`; `root` in /v1/models).
    #[arg(long, default_value = server::DEFAULT_MODEL)]
    model: String,
    /// Names accepted in requests (default: the model name); the first is reported.
    #[arg(long, num_args = 1.., value_delimiter = ',')]
    served_model_name: Vec<String>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// KV blocks in the pool, null block included.
    #[arg(long, default_value_t = engine::DEFAULT_NUM_GPU_BLOCKS)]
    num_gpu_blocks: u32,
    /// Token budget per scheduler step.
    #[arg(long, default_value_t = 2048)]
    max_num_batched_tokens: u32,
    /// Most running requests.
    #[arg(long, default_value_t = 256)]
    max_num_seqs: u32,
    /// Longest prompt + output.
    #[arg(long, default_value_t = 8192)]
    max_model_len: u32,
    /// The KV cache modelled: `paged` (vLLM's paged prefix cache) or `llama-slots` (llama.cpp's
    /// llama-server: per-slot caches chosen by prompt similarity; no KV events).
    #[arg(long, default_value = "paged", value_parser = ["paged", "llama-slots"])]
    cache_model: String,
    /// llama-slots: parallel slots (llama-server's `-np`).
    #[arg(long, default_value_t = 4)]
    parallel_slots: u32,
    /// llama-slots: the share of a prompt a slot's common prefix must exceed for the request to
    /// prefer that slot (llama-server's `--slot-prompt-similarity`; 0 = least recently used only).
    #[arg(long, default_value_t = 0.1)]
    slot_prompt_similarity: f64,
    /// llama-slots: KV cells shared by the slots (llama-server's `-c` with `--kv-unified`).
    #[arg(long, default_value_t = 16384)]
    ctx_tokens: u32,
    /// Step-model preset the constant flags start from: `vllm-3090` (the default) or
    /// `llama-tiny` (the tiny llama.cpp grid model on one CPU thread); a constant flag given
    /// explicitly overrides the preset's value.
    #[arg(long, default_value = "vllm-3090", value_parser = engine::config::STEP_MODEL_PRESETS.to_vec())]
    step_model: String,
    /// Report prompt_tokens_details.cached_tokens in usage.
    #[arg(long)]
    enable_prompt_tokens_details: bool,
    /// vLLM's KV events JSON, e.g. '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557"}'.
    #[arg(long)]
    kv_events_config: Option<String>,
    /// Shortcut: publish KV events on tcp://127.0.0.1:N (0 = ephemeral), with replay on an ephemeral port.
    #[arg(long)]
    kv_events_port: Option<u16>,
    /// Replay port for the --kv-events-port shortcut (0 = ephemeral).
    #[arg(long, default_value_t = 0)]
    kv_replay_port: u16,
    /// Event layout: array (positional, older vLLM) or map (newer vLLM).
    #[arg(long, default_value = "array")]
    kv_events_encoding: Encoding,
    /// Divides every modelled duration (1 = real time).
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
    /// Multiplies this replica's step time (a throttled card).
    #[arg(long, default_value_t = 1.0)]
    slowdown: f64,
    /// Seed of generated text and jitter.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Relative step-time jitter in [0, 1).
    #[arg(long, default_value_t = 0.0)]
    jitter: f64,
    /// Step model: fixed per-step overhead, ms (default: the --step-model preset's).
    #[arg(long)]
    step_overhead_ms: Option<f64>,
    /// Step model: weight bytes read per step (default: the --step-model preset's).
    #[arg(long)]
    weight_bytes: Option<f64>,
    /// Step model: KV bytes per context token (default: the --step-model preset's).
    #[arg(long)]
    kv_bytes_per_token: Option<f64>,
    /// Step model: effective memory bandwidth, bytes/s (default: the --step-model
    /// preset's).
    #[arg(long)]
    bandwidth_bytes_per_s: Option<f64>,
    /// Step model: compute per scheduled token, ms (default: the --step-model preset's).
    #[arg(long)]
    c_tok_ms: Option<f64>,
    /// Step model: attention compute per prefill token per context token, ms (default: the
    /// --step-model preset's).
    #[arg(long)]
    c_attn_ms: Option<f64>,
    /// Step model: compute per context token of each decode, ms (default: the --step-model
    /// preset's; 0 in vllm-3090).
    #[arg(long)]
    c_decode_ctx_ms: Option<f64>,
    /// Per-request frontend cost before scheduling, ms (default: the --step-model preset's).
    #[arg(long)]
    frontend_ms: Option<f64>,
    /// Cost of a /tokenize or render round trip, ms (default: the --step-model preset's).
    #[arg(long)]
    tokenize_ms: Option<f64>,
    /// Tokio worker threads for HTTP (the engine core has its own thread). One is as fast as
    /// two on a small shared machine and cheaper (REFERENCE.md §7).
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Run the engine's threads under SCHED_FIFO at this priority (1–99; 0 = the default
    /// SCHED_OTHER). Emulated fleets use 1 so a busy machine does not make steps late; a refusal
    /// (no CAP_SYS_NICE) is reported in the readiness line and the engine runs on.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=99))]
    sched_fifo_priority: u8,
}

fn config(a: &Args) -> Result<ServerConfig, String> {
    let cache_model = match a.cache_model.as_str() {
        "llama-slots" => CacheModel::LlamaSlots {
            slots: a.parallel_slots,
            similarity: a.slot_prompt_similarity,
            ctx_tokens: a.ctx_tokens,
        },
        _ => CacheModel::Paged,
    };
    let preset = StepModel::preset(&a.step_model)
        .ok_or_else(|| format!("unknown --step-model {}", a.step_model))?;
    let kv_events = match (&a.kv_events_config, a.kv_events_port) {
        (Some(_), Some(_)) => {
            return Err("give either --kv-events-config or --kv-events-port, not both".into());
        }
        (Some(json), None) => {
            KvEventsConfig::from_vllm_json(json, a.kv_events_encoding).map_err(|e| e.to_string())?
        }
        (None, Some(port)) => Some(KvEventsConfig {
            // Port 0 must bind to resolve; "*" would bind every interface, so bind loopback.
            endpoint: format!("tcp://127.0.0.1:{port}"),
            bind: true,
            replay_endpoint: Some(format!("tcp://127.0.0.1:{}", a.kv_replay_port)),
            topic: String::new(),
            buffer_steps: 10_000,
            encoding: a.kv_events_encoding,
        }),
        (None, None) => None,
    };
    let served = if a.served_model_name.is_empty() {
        vec![a.model.clone()]
    } else {
        a.served_model_name.clone()
    };
    Ok(ServerConfig {
        host: a.host.clone(),
        port: a.port,
        served_model_names: served,
        model: a.model.clone(),
        enable_prompt_tokens_details: a.enable_prompt_tokens_details,
        kv_events,
        engine: EngineConfig {
            block_size: a.block_size,
            num_gpu_blocks: a.num_gpu_blocks,
            max_num_batched_tokens: a.max_num_batched_tokens,
            max_num_seqs: a.max_num_seqs,
            max_model_len: a.max_model_len,
            seed: a.seed,
            cache_model,
            model: StepModel {
                overhead_ms: a.step_overhead_ms.unwrap_or(preset.overhead_ms),
                weight_bytes: a.weight_bytes.unwrap_or(preset.weight_bytes),
                kv_bytes_per_token: a.kv_bytes_per_token.unwrap_or(preset.kv_bytes_per_token),
                bandwidth_bytes_per_s: a
                    .bandwidth_bytes_per_s
                    .unwrap_or(preset.bandwidth_bytes_per_s),
                c_tok_ms: a.c_tok_ms.unwrap_or(preset.c_tok_ms),
                c_attn_ms: a.c_attn_ms.unwrap_or(preset.c_attn_ms),
                c_decode_ctx_ms: a.c_decode_ctx_ms.unwrap_or(preset.c_decode_ctx_ms),
                frontend_ms: a.frontend_ms.unwrap_or(preset.frontend_ms),
                tokenize_ms: a.tokenize_ms.unwrap_or(preset.tokenize_ms),
                speed: a.speed,
                slowdown: a.slowdown,
                jitter: a.jitter,
            },
            ..EngineConfig::default()
        },
        ..ServerConfig::default()
    })
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let cfg = match config(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("engine: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    // Before the runtime: its workers and the engine thread inherit the policy.
    let scheduling = server::sched::request_fifo(args.sched_fifo_priority);
    if let server::sched::Scheduling::Refused { .. } = &scheduling {
        eprintln!("engine: scheduling {}", scheduling.describe());
    }
    let cfg = ServerConfig { scheduling, ..cfg };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.workers.max(1))
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("engine: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    rt.block_on(async move {
        let server = match server::start(cfg).await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("engine: {e}");
                return std::process::ExitCode::FAILURE;
            }
        };
        // Handlers go in before the readiness line: a supervisor may signal as soon as it reads it.
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("engine: cannot install SIGTERM handler: {e}");
                    return std::process::ExitCode::FAILURE;
                }
            };
        let mut int = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        {
            Ok(s) => s,
            Err(e) => {
                eprintln!("engine: cannot install SIGINT handler: {e}");
                return std::process::ExitCode::FAILURE;
            }
        };
        println!("{}", server.readiness_line());
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        server.shutdown().await;
        std::process::ExitCode::SUCCESS
    })
}
