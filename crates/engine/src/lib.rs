//! An emulated vLLM replica's server: the HTTP and ZMQ surface ([`server`]) that speaks vLLM's API
//! and drives the pure core of `engine-core` on a real clock, on its own thread.
//!
//! The core's modules and types are re-exported here (`engine::core`, `engine::Engine`, …), so the
//! `engine` binary and the tests that start a server name one crate. Code that needs only the core
//! (the simulator, the experiments) depends on `engine-core` instead. See the crate README for the
//! module map.

pub mod server;

pub use engine_core::{
    AddError, CacheModel, Counters, DEFAULT_NUM_GPU_BLOCKS, Encoding, Engine, EngineConfig,
    FinishReason, KvEvent, RequestId, SamplingParams, StepModel, StepOutput, TokenOut, block_hash,
    block_hashes, block_pool, config, core, kv_events, llama_slots, tokenizer,
};
