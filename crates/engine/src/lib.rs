//! An emulated vLLM replica: paged KV block pool with prefix caching, vLLM v1's scheduler, a
//! calibrated step-time model, a deterministic tokenizer, KV events, and (in [`server`]) the HTTP
//! and ZMQ surface that speaks vLLM's API. llama.cpp's per-slot cache ([`llama_slots`]) is the
//! alternative cache model ([`config::CacheModel`]).
//!
//! Everything outside [`server`] is pure and clock-agnostic: the [`core::Engine`] is driven by
//! `step(now_us)`, so the same code runs against a real clock (the server) or a virtual one (the
//! simulator). See the crate README for the module map.

pub mod block_pool;
pub mod config;
pub mod core;
pub mod kv_events;
pub mod llama_slots;
pub mod server;
pub mod tokenizer;

pub use crate::config::{CacheModel, DEFAULT_NUM_GPU_BLOCKS, EngineConfig, StepModel};
pub use crate::core::{
    AddError, Counters, Engine, FinishReason, RequestId, SamplingParams, StepOutput, TokenOut,
    block_hash, block_hashes,
};
pub use crate::kv_events::{Encoding, KvEvent};
