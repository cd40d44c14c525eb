//! The clock-agnostic engine core: requests, vLLM v1's scheduler and the step-time model.
//!
//! The caller owns time. [`Engine::add_request`] stamps a request with the caller's `now_us`;
//! it reaches the scheduler after the modelled frontend cost. [`Engine::step`] runs one scheduler
//! step starting at `now_us` and returns how long it lasts; its tokens are emitted at
//! `now_us + duration_us`, and the next step should start no earlier than that.
//! [`Engine::next_wakeup_us`] says when the engine next has work. A live server drives it with
//! a real clock; the simulator with a virtual one.

use std::collections::{HashMap, VecDeque};

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::block_pool::{BlockId, BlockPool};
use crate::config::{CacheModel, EngineConfig};
use crate::kv_events::KvEvent;
use crate::llama_slots::SlotCache;
use crate::tokenizer::{EOS_TOKEN_ID, NUM_GENERATED_WORDS, generated_token};

/// Caller-chosen request id, unique among live requests.
pub type RequestId = u64;

/// Parent hash of a chain's first block (vLLM's `NONE_HASH`), fixed so hashes are stable
/// across processes.
pub const ROOT_BLOCK_HASH: u64 = 0x9e37_79b9_7f4a_7c15;
const BLOCK_HASH_SEED: u64 = 0x6b76_5f62_6c6f_636b;
/// When EOS is not ignored, each generated token is EOS with probability 1 / this.
pub const EOS_ONE_IN: u64 = 256;

/// Chained hash of one full block: H(parent, token ids as little-endian u32).
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    // One-shot hashing of a stack buffer: the streaming hasher's setup costs more than a
    // 16-token block.
    const MAX_STACK_TOKENS: usize = 64;
    if tokens.len() <= MAX_STACK_TOKENS {
        let mut buf = [0u8; 8 + 4 * MAX_STACK_TOKENS];
        buf[..8].copy_from_slice(&parent.to_le_bytes());
        for (i, t) in tokens.iter().enumerate() {
            buf[8 + i * 4..12 + i * 4].copy_from_slice(&t.to_le_bytes());
        }
        return xxh3_64_with_seed(&buf[..8 + tokens.len() * 4], BLOCK_HASH_SEED);
    }
    let mut buf = Vec::with_capacity(8 + tokens.len() * 4);
    buf.extend_from_slice(&parent.to_le_bytes());
    for t in tokens {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(&buf, BLOCK_HASH_SEED)
}

/// Seed of a request's generated tokens: xxh3 (seeded) of the prompt's token ids as
/// little-endian u32, the value a streaming `Xxh3::with_seed(seed)` fed the same bytes digests
/// to. `scratch` holds the bytes, so a busy engine hashes without allocating.
pub fn prompt_key(prompt: &[u32], seed: u64, scratch: &mut Vec<u8>) -> u64 {
    // One contiguous one-shot hash: the streaming hasher's per-update buffering and its final
    // merge cost more than copying the ids once (xxh3's one-shot and streaming forms are
    // specified to agree).
    scratch.clear();
    scratch.resize(prompt.len() * 4, 0);
    for (bytes, t) in scratch.chunks_exact_mut(4).zip(prompt) {
        bytes.copy_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(scratch, seed)
}

/// Chained hashes of every full block of `tokens`.
pub fn block_hashes(tokens: &[u32], block_size: u32) -> Vec<u64> {
    let mut parent = ROOT_BLOCK_HASH;
    tokens
        .chunks_exact(block_size as usize)
        .map(|b| {
            parent = block_hash(parent, b);
            parent
        })
        .collect()
}

/// Checks a request against an engine's limits: non-empty prompt, `max_tokens ≥ 1`,
/// prompt + `max_tokens` ≤ `max_model_len`, and small enough to fit the KV pool alone (under
/// llama-slots: prompt + `max_tokens` ≤ `ctx_tokens` as well, reported as the context length).
pub fn check_request(
    cfg: &EngineConfig,
    prompt_tokens: usize,
    params: SamplingParams,
) -> Result<(), AddError> {
    if prompt_tokens == 0 {
        return Err(AddError::EmptyPrompt);
    }
    if params.max_tokens == 0 {
        return Err(AddError::ZeroMaxTokens);
    }
    let total = prompt_tokens as u64 + u64::from(params.max_tokens);
    let max_model_len = match cfg.cache_model {
        CacheModel::Paged => cfg.max_model_len,
        CacheModel::LlamaSlots { ctx_tokens, .. } => cfg.max_model_len.min(ctx_tokens),
    };
    if total > u64::from(max_model_len) {
        return Err(AddError::TooLong {
            prompt_tokens: prompt_tokens.min(u32::MAX as usize) as u32,
            max_tokens: params.max_tokens,
            max_model_len,
        });
    }
    if let CacheModel::LlamaSlots { .. } = cfg.cache_model {
        return Ok(());
    }
    let needed = total.div_ceil(u64::from(cfg.block_size));
    let available = cfg.num_gpu_blocks - 1;
    if needed > u64::from(available) {
        return Err(AddError::TooLargeForCache {
            needed_blocks: needed.min(u64::from(u32::MAX)) as u32,
            available_blocks: available,
        });
    }
    Ok(())
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// The model produced EOS (and `ignore_eos` was off).
    Stop,
    /// `max_tokens` (or `max_model_len`) was reached.
    Length,
}

impl FinishReason {
    /// OpenAI/vLLM spelling: `stop` or `length`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

/// Per-request generation parameters the engine honours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SamplingParams {
    /// Most tokens to generate (at least 1).
    pub max_tokens: u32,
    /// Keep generating past EOS until `max_tokens`.
    pub ignore_eos: bool,
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddError {
    /// Another live request has this id.
    #[error("request id {0} is already in use")]
    DuplicateId(RequestId),
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// `max_tokens` is zero.
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    /// Prompt plus `max_tokens` exceeds `max_model_len` (vLLM's wording).
    #[error(
        "This model's maximum context length is {max_model_len} tokens. However, you requested \
         {} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). Please \
         reduce the length of the messages or completion.",
        prompt_tokens + max_tokens
    )]
    TooLong {
        /// Prompt tokens.
        prompt_tokens: u32,
        /// Requested completion tokens.
        max_tokens: u32,
        /// The engine's limit.
        max_model_len: u32,
    },
    /// The request could never fit in the KV pool, even alone.
    #[error("the request needs {needed_blocks} KV blocks but the cache holds {available_blocks}")]
    TooLargeForCache {
        /// Blocks the request would need at its longest.
        needed_blocks: u32,
        /// Usable blocks in the pool.
        available_blocks: u32,
    },
}

/// One generated token, as emitted at the end of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenOut {
    /// The request.
    pub id: RequestId,
    /// Generated token id (text via [`crate::tokenizer::decode_token`]).
    pub token: u32,
    /// 0 for the first generated token.
    pub output_index: u32,
    /// Set on the request's last token.
    pub finish: Option<FinishReason>,
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Prompt tokens served from the cache at first scheduling, ≤ n−1 (paged: block-aligned;
    /// llama-slots: the common prefix with the chosen slot).
    pub cached_tokens: u32,
}

/// Everything one step did. Reused across steps by [`Engine::step_into`] to avoid allocation.
#[derive(Debug, Default, Clone)]
pub struct StepOutput {
    /// When the step started (the `now_us` passed in).
    pub start_us: u64,
    /// Modelled step duration after speed, slowdown and jitter; 0 when nothing ran.
    pub duration_us: u64,
    /// Tokens sampled by this step, in scheduling order.
    pub tokens: Vec<TokenOut>,
    /// Requests scheduled for the first time in this step (for queue-time accounting).
    pub admitted: Vec<RequestId>,
    /// KV events recorded during the step (and any left from a reset before it).
    pub kv_events: Vec<KvEvent>,
    /// Tokens scheduled.
    pub num_scheduled_tokens: u32,
    /// Requests scheduled.
    pub num_scheduled_reqs: u32,
    /// Requests preempted by this step.
    pub num_preempted: u32,
}

impl StepOutput {
    /// When the step's tokens are emitted.
    pub fn end_us(&self) -> u64 {
        self.start_us + self.duration_us
    }

    fn clear(&mut self) {
        self.duration_us = 0;
        self.tokens.clear();
        self.admitted.clear();
        self.kv_events.clear();
        self.num_scheduled_tokens = 0;
        self.num_scheduled_reqs = 0;
        self.num_preempted = 0;
    }
}

/// Cumulative counters, vLLM's metrics where vLLM has one.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Counters {
    /// Prompt tokens of requests that produced their first token.
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub generation_tokens: u64,
    /// Tokens looked up in the prefix cache (`vllm:prefix_cache_queries`).
    pub prefix_cache_queries_tokens: u64,
    /// Tokens found in the prefix cache (`vllm:prefix_cache_hits`).
    pub prefix_cache_hits_tokens: u64,
    /// Preemptions (`vllm:num_preemptions`).
    pub preemptions: u64,
    /// Steps that scheduled work.
    pub steps: u64,
    /// Requests finished by EOS.
    pub finished_stop: u64,
    /// Requests finished by length.
    pub finished_length: u64,
    /// Requests aborted by the caller.
    pub aborted: u64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Where {
    Pending,
    Waiting,
    Running,
}

struct Request {
    id: RequestId,
    tokens: Vec<u32>,
    num_prompt: u32,
    params: SamplingParams,
    num_output: u32,
    num_computed: u32,
    blocks: Vec<BlockId>,
    hashes: Vec<u64>,
    num_cached_blocks: u32,
    cached_tokens: Option<u32>,
    gen_key: u64,
    place: Where,
    /// Under llama-slots, the slot serving the request once admitted.
    llama_slot: Option<u32>,
}

/// One emulated engine: block pool (or llama.cpp's slots), scheduler queues and step model.
pub struct Engine {
    cfg: EngineConfig,
    pool: BlockPool,
    /// `Some` under [`CacheModel::LlamaSlots`]: the slots replace the pool's prefix cache.
    llama: Option<SlotCache>,
    slots: Vec<Option<Request>>,
    free_slots: Vec<u32>,
    index: HashMap<RequestId, u32, ahash::RandomState>,
    pending: VecDeque<(u64, u32)>,
    waiting: VecDeque<u32>,
    running: Vec<u32>,
    stalled: bool,
    counters: Counters,
    rng: Pcg64Mcg,
    frontend_us: u64,
    step_scale: f64,
    sched: Vec<(u32, u32, u32)>,
    hits: Vec<BlockId>,
    /// Scratch for the prompt's bytes in [`prompt_key`], reused across requests.
    key_bytes: Vec<u8>,
}

/// Extends `req.hashes` to cover `num_blocks` full blocks.
fn ensure_hashes(req: &mut Request, num_blocks: usize, block_size: usize) {
    while req.hashes.len() < num_blocks {
        let i = req.hashes.len();
        let parent = if i == 0 {
            ROOT_BLOCK_HASH
        } else {
            req.hashes[i - 1]
        };
        let h = block_hash(parent, &req.tokens[i * block_size..(i + 1) * block_size]);
        req.hashes.push(h);
    }
}

impl Engine {
    /// Builds an engine; fails with a readable reason on an invalid config.
    pub fn new(cfg: EngineConfig) -> Result<Self, crate::config::ConfigError> {
        cfg.validate()?;
        let pool = BlockPool::new(
            cfg.num_gpu_blocks,
            cfg.block_size,
            cfg.enable_prefix_caching,
            cfg.enable_kv_events,
        );
        let llama = match cfg.cache_model {
            CacheModel::Paged => None,
            CacheModel::LlamaSlots {
                slots, similarity, ..
            } => Some(SlotCache::new(slots, similarity)),
        };
        Ok(Self {
            llama,
            frontend_us: cfg.model.frontend_us(),
            step_scale: cfg.model.step_scale(),
            rng: Pcg64Mcg::seed_from_u64(cfg.seed),
            pool,
            slots: Vec::new(),
            free_slots: Vec::new(),
            index: HashMap::default(),
            pending: VecDeque::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            stalled: false,
            counters: Counters::default(),
            sched: Vec::new(),
            hits: Vec::new(),
            key_bytes: Vec::new(),
            cfg,
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Read access to the block pool (tests, metrics, reconciliation).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Cumulative counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Requests in the running batch.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting for the scheduler (not counting those still in the frontend).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests still paying their frontend cost.
    pub fn num_pending(&self) -> usize {
        self.pending.len()
    }

    /// Live requests of any state.
    pub fn num_requests(&self) -> usize {
        self.index.len()
    }

    /// `vllm:kv_cache_usage_perc` as a fraction; under llama-slots the share of `ctx_tokens`
    /// held by the slots (idle slots' sequences and running requests' computed tokens).
    pub fn kv_usage(&self) -> f64 {
        match (&self.llama, self.cfg.cache_model) {
            (Some(_), CacheModel::LlamaSlots { ctx_tokens, .. }) => {
                self.llama_used_tokens() as f64 / f64::from(ctx_tokens)
            }
            _ => self.pool.usage(),
        }
    }

    /// The llama.cpp slots, under [`CacheModel::LlamaSlots`].
    pub fn llama_slots(&self) -> Option<&SlotCache> {
        self.llama.as_ref()
    }

    /// KV cells in use under llama-slots: idle slots' tokens plus running requests' computed
    /// tokens.
    fn llama_used_tokens(&self) -> u64 {
        let idle = self.llama.as_ref().map_or(0, SlotCache::idle_tokens);
        let running: u64 = self
            .running
            .iter()
            .map(|&s| u64::from(self.slots[s as usize].as_ref().expect("live").num_computed))
            .sum();
        idle + running
    }

    /// Whether `id` is live.
    pub fn contains(&self, id: RequestId) -> bool {
        self.index.contains_key(&id)
    }

    /// Checks a request against the limits without adding it (see [`check_request`]).
    pub fn check(&self, prompt_tokens: usize, params: SamplingParams) -> Result<(), AddError> {
        check_request(&self.cfg, prompt_tokens, params)
    }

    /// Adds a request arriving at `now_us`; it reaches the scheduler after the frontend cost.
    pub fn add_request(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        params: SamplingParams,
        now_us: u64,
    ) -> Result<(), AddError> {
        if self.index.contains_key(&id) {
            return Err(AddError::DuplicateId(id));
        }
        self.check(prompt.len(), params)?;
        let gen_key = prompt_key(&prompt, self.cfg.seed, &mut self.key_bytes);
        let req = Request {
            id,
            num_prompt: prompt.len() as u32,
            tokens: prompt,
            params,
            num_output: 0,
            num_computed: 0,
            blocks: Vec::new(),
            hashes: Vec::new(),
            num_cached_blocks: 0,
            cached_tokens: None,
            gen_key,
            place: Where::Pending,
            llama_slot: None,
        };
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.slots[s as usize] = Some(req);
                s
            }
            None => {
                self.slots.push(Some(req));
                (self.slots.len() - 1) as u32
            }
        };
        self.index.insert(id, slot);
        let ready = now_us + self.frontend_us;
        let pos = self
            .pending
            .iter()
            .rposition(|&(r, _)| r <= ready)
            .map_or(0, |p| p + 1);
        self.pending.insert(pos, (ready, slot));
        self.stalled = false;
        Ok(())
    }

    /// Aborts a live request, freeing its blocks. Returns whether it was live.
    pub fn abort(&mut self, id: RequestId) -> bool {
        let Some(slot) = self.index.remove(&id) else {
            return false;
        };
        let req = self.slots[slot as usize]
            .take()
            .expect("indexed slot is live");
        match req.place {
            Where::Pending => self.pending.retain(|&(_, s)| s != slot),
            Where::Waiting => self.waiting.retain(|&s| s != slot),
            Where::Running => self.running.retain(|&s| s != slot),
        }
        if let (Some(cache), Some(ls)) = (&mut self.llama, req.llama_slot) {
            // The slot keeps what the request computed so far, as llama.cpp's release does.
            let mut decoded = req.tokens;
            decoded.truncate(req.num_computed as usize);
            cache.release(ls as usize, decoded);
            self.free_slots.push(slot);
            self.counters.aborted += 1;
            self.stalled = false;
            return true;
        }
        self.pool.free_tail_first(&req.blocks);
        self.free_slots.push(slot);
        self.counters.aborted += 1;
        self.stalled = false;
        true
    }

    /// Clears the prefix cache if no request holds blocks (vLLM's rule). Records
    /// `AllBlocksCleared`, fetched by the next step or [`Engine::take_events`]. Under
    /// llama-slots (llama.cpp has no such endpoint): erases every slot if none is running, with
    /// no event.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if let Some(cache) = &mut self.llama {
            if !self.running.is_empty() {
                return false;
            }
            cache.erase_idle();
            return true;
        }
        self.pool.reset()
    }

    /// Moves KV events recorded outside a step (a reset) into `out`.
    pub fn take_events(&mut self, out: &mut Vec<KvEvent>) {
        self.pool.take_events(out);
    }

    /// When the engine next has work: `now_us` if a step could run now, the earliest frontend
    /// completion if only pending requests remain, `None` when idle.
    pub fn next_wakeup_us(&self, now_us: u64) -> Option<u64> {
        if !self.running.is_empty() || (!self.waiting.is_empty() && !self.stalled) {
            return Some(now_us);
        }
        self.pending.front().map(|&(ready, _)| ready.max(now_us))
    }

    /// Runs one step starting at `now_us` and returns what it did (allocating a fresh output).
    pub fn step(&mut self, now_us: u64) -> StepOutput {
        let mut out = StepOutput::default();
        self.step_into(now_us, &mut out);
        out
    }

    /// Runs one step starting at `now_us`, writing into a reused `out`.
    pub fn step_into(&mut self, now_us: u64, out: &mut StepOutput) {
        out.clear();
        out.start_us = now_us;
        while let Some(&(ready, slot)) = self.pending.front() {
            if ready > now_us {
                break;
            }
            self.pending.pop_front();
            self.slots[slot as usize].as_mut().expect("live").place = Where::Waiting;
            self.waiting.push_back(slot);
            self.stalled = false;
        }
        self.schedule(out);
        if self.sched.is_empty() {
            self.stalled = !self.waiting.is_empty();
            self.pool.take_events(&mut out.kv_events);
            return;
        }
        self.counters.steps += 1;
        out.duration_us = self.step_duration_us();
        self.update(out);
        self.pool.take_events(&mut out.kv_events);
    }

    fn step_duration_us(&mut self) -> u64 {
        let mut num_tokens = 0u64;
        let mut sum_ctx = 0u64;
        let mut attn = 0f64;
        let mut decode_ctx = 0u64;
        for &(slot, num_new, ctx_before) in &self.sched {
            num_tokens += u64::from(num_new);
            sum_ctx += u64::from(ctx_before + num_new);
            let req = self.slots[slot as usize].as_ref().expect("live");
            // A prefill chunk is any scheduled work that does not reach the sequence's end
            // with a single token; a decode's attention cost is in the memory term.
            let is_decode = num_new == 1 && ctx_before + 1 == req.tokens.len() as u32;
            if is_decode {
                decode_ctx += u64::from(ctx_before + 1);
            } else {
                attn += f64::from(num_new) * (f64::from(ctx_before) + f64::from(num_new) / 2.0);
            }
        }
        let raw = self
            .cfg
            .model
            .raw_step_us(num_tokens, sum_ctx, attn, decode_ctx);
        let jitter = if self.cfg.model.jitter > 0.0 {
            1.0 + self.cfg.model.jitter * (2.0 * self.rng.random::<f64>() - 1.0)
        } else {
            1.0
        };
        ((raw * self.step_scale * jitter).round() as u64).max(1)
    }

    fn schedule(&mut self, out: &mut StepOutput) {
        if self.llama.is_some() {
            self.schedule_llama(out);
            return;
        }
        self.sched.clear();
        let bs = self.cfg.block_size as usize;
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let slot = self.running[i];
            let req = self.slots[slot as usize].as_ref().expect("live");
            let num_new = (req.tokens.len() as u32 - req.num_computed).min(budget);
            let num_computed = req.num_computed;
            if num_new == 0 {
                i += 1;
                continue;
            }
            let scheduled = loop {
                if self.allocate_slots(slot, num_computed, num_new, false) {
                    break true;
                }
                let victim = self
                    .running
                    .pop()
                    .expect("running holds the current request");
                self.preempt(victim);
                out.num_preempted += 1;
                preempted = true;
                if victim == slot {
                    break false;
                }
            };
            if !scheduled {
                break;
            }
            self.sched.push((slot, num_new, num_computed));
            budget -= num_new;
            i += 1;
        }
        if preempted {
            return;
        }
        while budget > 0 && self.running.len() < self.cfg.max_num_seqs as usize {
            let Some(&slot) = self.waiting.front() else {
                break;
            };
            self.hits.clear();
            let req = self.slots[slot as usize].as_mut().expect("live");
            let num_tokens = req.tokens.len();
            if self.cfg.enable_prefix_caching {
                // The hit is capped so at least one token is recomputed: floor((n−1)/B) blocks.
                let max_blocks = (num_tokens - 1) / bs;
                ensure_hashes(req, max_blocks, bs);
                for &h in &req.hashes[..max_blocks] {
                    match self.pool.lookup(h) {
                        Some(b) => self.hits.push(b),
                        None => break,
                    }
                }
            }
            let num_computed = (self.hits.len() * bs) as u32;
            let num_new = (num_tokens as u32 - num_computed).min(budget);
            if !self.allocate_slots(slot, num_computed, num_new, true) {
                break;
            }
            if self.cfg.enable_prefix_caching {
                self.counters.prefix_cache_queries_tokens += num_tokens as u64;
                self.counters.prefix_cache_hits_tokens += u64::from(num_computed);
            }
            self.waiting.pop_front();
            self.running.push(slot);
            let req = self.slots[slot as usize].as_mut().expect("live");
            req.place = Where::Running;
            req.num_computed = num_computed;
            if req.cached_tokens.is_none() {
                req.cached_tokens = Some(num_computed);
                out.admitted.push(req.id);
            }
            self.sched.push((slot, num_new, num_computed));
            budget -= num_new;
        }
    }

    /// llama-server's scheduling under [`CacheModel::LlamaSlots`]: running slots first (each
    /// decode, or the next chunk of a prompt, within the batch budget), then waiting requests in
    /// arrival order while a slot is idle — each takes the slot [`SlotCache::select`] picks and
    /// skips the common prefix it keeps. A request is admitted only while the running requests'
    /// prompts and `max_tokens` fit `ctx_tokens` together (llama.cpp admits and fails the batch
    /// with "Context size has been exceeded"; the emulator waits instead). Then, as
    /// `try_clear_idle_slots` does when a batch finds no room, idle slots are erased lowest id
    /// first until the step's tokens fit.
    fn schedule_llama(&mut self, out: &mut StepOutput) {
        self.sched.clear();
        let CacheModel::LlamaSlots { ctx_tokens, .. } = self.cfg.cache_model else {
            unreachable!("schedule_llama runs under llama-slots only");
        };
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut reserved = 0u64;
        let mut in_use = 0u64;
        for &slot in &self.running {
            let req = self.slots[slot as usize].as_ref().expect("live");
            reserved += req.num_prompt as u64 + u64::from(req.params.max_tokens);
            let num_new = (req.tokens.len() as u32 - req.num_computed).min(budget);
            in_use += u64::from(req.num_computed + num_new);
            if num_new > 0 {
                self.sched.push((slot, num_new, req.num_computed));
                budget -= num_new;
            }
        }
        let max_running = self.cfg.max_running() as usize;
        let cache = self.llama.as_mut().expect("llama-slots");
        while budget > 0 && self.running.len() < max_running {
            let Some(&slot) = self.waiting.front() else {
                break;
            };
            let req = self.slots[slot as usize].as_mut().expect("live");
            let need = req.num_prompt as u64 + u64::from(req.params.max_tokens);
            if reserved + need > u64::from(ctx_tokens) {
                break;
            }
            let prompt = &req.tokens[..req.num_prompt as usize];
            let Some((ls, _)) = cache.select(prompt) else {
                break;
            };
            let num_computed = cache.acquire(ls, prompt);
            self.counters.prefix_cache_queries_tokens += u64::from(req.num_prompt);
            self.counters.prefix_cache_hits_tokens += u64::from(num_computed);
            self.waiting.pop_front();
            self.running.push(slot);
            req.place = Where::Running;
            req.llama_slot = Some(ls as u32);
            req.num_computed = num_computed;
            req.cached_tokens = Some(num_computed);
            out.admitted.push(req.id);
            let num_new = (req.tokens.len() as u32 - num_computed).min(budget);
            self.sched.push((slot, num_new, num_computed));
            budget -= num_new;
            reserved += need;
            in_use += u64::from(num_computed + num_new);
        }
        while in_use + cache.idle_tokens() > u64::from(ctx_tokens) {
            if cache.purge_one_idle() == 0 {
                break;
            }
        }
    }

    /// vLLM's `allocate_slots`: takes the prefix hits (when `with_hits`), allocates the blocks
    /// `num_computed + num_new` tokens need, and caches the blocks those tokens fill.
    fn allocate_slots(
        &mut self,
        slot: u32,
        num_computed: u32,
        num_new: u32,
        with_hits: bool,
    ) -> bool {
        let bs = self.cfg.block_size;
        let req = self.slots[slot as usize].as_mut().expect("live");
        let hits: &[BlockId] = if with_hits { &self.hits } else { &[] };
        let required = (num_computed + num_new).div_ceil(bs) as usize;
        let have = req.blocks.len() + hits.len();
        let need = required.saturating_sub(have) as u32;
        let evictable_hits = hits
            .iter()
            .filter(|&&b| self.pool.ref_count(b) == 0)
            .count() as u32;
        if need + evictable_hits > self.pool.num_free_blocks() {
            return false;
        }
        if !hits.is_empty() {
            self.pool.touch(hits);
            req.blocks.extend_from_slice(hits);
            req.num_cached_blocks = req.blocks.len() as u32;
        }
        let ok = self.pool.allocate(need, &mut req.blocks);
        debug_assert!(ok, "free count checked above");
        if self.cfg.enable_prefix_caching {
            let num_full = ((num_computed + num_new).min(req.tokens.len() as u32) / bs) as usize;
            let from = req.num_cached_blocks as usize;
            if num_full > from {
                ensure_hashes(req, num_full, bs as usize);
                let parent = from.checked_sub(1).map(|p| req.hashes[p]);
                self.pool.cache_blocks(
                    &req.blocks[from..num_full],
                    &req.hashes[from..num_full],
                    parent,
                    &req.tokens[from * bs as usize..num_full * bs as usize],
                );
                req.num_cached_blocks = num_full as u32;
            }
        }
        true
    }

    /// Preemption by recompute: blocks freed (they keep their hashes), progress reset, request
    /// to the front of the waiting queue.
    fn preempt(&mut self, slot: u32) {
        let req = self.slots[slot as usize].as_mut().expect("live");
        self.pool.free_tail_first(&req.blocks);
        req.blocks.clear();
        req.num_computed = 0;
        req.num_cached_blocks = 0;
        req.place = Where::Waiting;
        self.waiting.push_front(slot);
        self.counters.preemptions += 1;
    }

    fn update(&mut self, out: &mut StepOutput) {
        out.num_scheduled_reqs = self.sched.len() as u32;
        let mut any_finished = false;
        for k in 0..self.sched.len() {
            let (slot, num_new, _) = self.sched[k];
            out.num_scheduled_tokens += num_new;
            let req = self.slots[slot as usize].as_mut().expect("live");
            req.num_computed += num_new;
            if (req.num_computed as usize) < req.tokens.len() {
                continue; // a chunk of a longer prefill: nothing sampled yet
            }
            let k_out = u64::from(req.num_output);
            let m = xxh3_64_with_seed(&k_out.to_le_bytes(), req.gen_key);
            let token = if !req.params.ignore_eos && (m >> 32).is_multiple_of(EOS_ONE_IN) {
                EOS_TOKEN_ID
            } else {
                generated_token((m % NUM_GENERATED_WORDS as u64) as usize)
            };
            req.tokens.push(token);
            req.num_output += 1;
            if req.num_output == 1 {
                self.counters.prompt_tokens += u64::from(req.num_prompt);
            }
            self.counters.generation_tokens += 1;
            let finish = if !req.params.ignore_eos && token == EOS_TOKEN_ID {
                Some(FinishReason::Stop)
            } else if req.num_output >= req.params.max_tokens
                || req.tokens.len() >= self.cfg.max_model_len as usize
            {
                Some(FinishReason::Length)
            } else {
                None
            };
            out.tokens.push(TokenOut {
                id: req.id,
                token,
                output_index: req.num_output - 1,
                finish,
                prompt_tokens: req.num_prompt,
                cached_tokens: req.cached_tokens.unwrap_or(0),
            });
            if let Some(f) = finish {
                match f {
                    FinishReason::Stop => self.counters.finished_stop += 1,
                    FinishReason::Length => self.counters.finished_length += 1,
                }
                let req = self.slots[slot as usize].take().expect("live");
                if let (Some(cache), Some(ls)) = (&mut self.llama, req.llama_slot) {
                    // Prompt and generated tokens but the last: the one llama.cpp never decodes.
                    let mut decoded = req.tokens;
                    decoded.truncate(req.num_computed as usize);
                    cache.release(ls as usize, decoded);
                    self.index.remove(&req.id);
                    self.free_slots.push(slot);
                    any_finished = true;
                    continue;
                }
                self.pool.free_tail_first(&req.blocks);
                self.index.remove(&req.id);
                self.free_slots.push(slot);
                any_finished = true;
            }
        }
        if any_finished {
            let slots = &self.slots;
            self.running.retain(|&s| slots[s as usize].is_some());
        }
    }

    /// The blocks a live request holds, in chain order (tests and debugging).
    pub fn request_blocks(&self, id: RequestId) -> Option<&[BlockId]> {
        let slot = *self.index.get(&id)?;
        self.slots[slot as usize]
            .as_ref()
            .map(|r| r.blocks.as_slice())
    }

    /// Tokens a live request has computed so far.
    pub fn request_num_computed(&self, id: RequestId) -> Option<u32> {
        let slot = *self.index.get(&id)?;
        self.slots[slot as usize].as_ref().map(|r| r.num_computed)
    }
}

#[cfg(test)]
#[path = "core_tests.rs"]
mod tests;
