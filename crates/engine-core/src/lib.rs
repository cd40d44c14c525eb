//! The emulated vLLM replica's pure core: paged KV block pool with prefix caching, vLLM v1's
//! scheduler, a calibrated step-time model, a deterministic tokenizer and KV events. llama.cpp's
//! per-slot cache ([`llama_slots`]) is the alternative cache model ([`config::CacheModel`]).
//!
//! Everything here is pure and clock-agnostic: the [`core::Engine`] is driven by `step(now_us)`,
//! so the same code runs against a real clock (the `engine` crate's server) or a virtual one (the
//! simulator). No async runtime, sockets, files or clocks. See the crate README for the module map.

pub mod block_pool;
pub mod config;
pub mod core;
pub mod describe;
pub mod kv_events;
pub mod llama_slots;
pub mod tokenizer;

pub use crate::config::{CacheModel, ConfigError, DEFAULT_NUM_GPU_BLOCKS, EngineConfig, StepModel};
pub use crate::core::{
    AddError, Counters, Engine, FinishReason, RequestId, SamplingParams, StepOutput, TokenOut,
    block_hash, block_hashes,
};
pub use crate::kv_events::{Encoding, KvEvent};
