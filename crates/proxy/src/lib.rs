//! `proxy`: kvroute's router service — the sole ingress in front of N OpenAI-compatible replicas.
//!
//! It accepts `POST /v1/completions` and `POST /v1/chat/completions` (streamed or not), renders
//! each prompt into block keys (docs/ARCHITECTURE.md, "Prompt → blocks"), asks a
//! [`policies::Policy`] for a replica under one short lock that also takes the replica's load,
//! forwards the client's bytes unchanged, and streams the response back frame by frame. One row per
//! request goes to `router.csv` off the request path. Exact residency consumes each replica's KV
//! event stream (vLLM's ZMQ format).
//!
//! Module map:
//! - [`server`]: [`Router`] (start, addresses, graceful shutdown), [`run_blocking`] (the
//!   binary's main loop), the serving and admin listeners (timeouts, connection cap, lingering
//!   close), health checks with hysteresis, KV subscriber start-up.
//! - [`service`]: the serving port's handler — LLM endpoints, safe retries, upstream timeouts,
//!   hop-by-hop headers, `/v1/models`, `/health`, OpenAI-style errors.
//! - [`admin`]: the admin listener's handler — replica API, `/metrics`, bearer token.
//! - [`keys`]: API keys (hashed key file) and per-key request and token limits (token buckets).
//! - [`state`]: replica table, policy lock, RAII load guards.
//! - [`body`]: the streaming response body (usage scan, mid-stream failure, row completion).
//! - [`request`]: body parsing, canonical rendering, `/tokenize` bodies.
//! - [`usage`]: usage parsing in passing (SSE and JSON).
//! - [`events`]: KV event decoding (both encodings), sequence-gap detection, replay, subscriber.
//! - [`sharing`]: decision sharing between routers over one fleet (PUB of served decisions,
//!   SUB of peers', sequence gaps counted, never repaired).
//! - [`parity`]: the token-parity probes (block size, `/tokenize` vs the engine's own prompt ids,
//!   across replicas) run before exact keys are trusted.
//! - [`rows`]: `router.csv` writer thread.
//! - [`metrics`]: Prometheus counters and the overhead histogram.
//! - [`upstream`]: the pooled client, the router clock, the self-timing request body.
//! - [`config`]: [`RouterConfig`], [`ReplicaSpec`], config-file parsing.
//! - [`cli`]: the clap flags the router and `epp` binaries share ([`cli::RoutingArgs`]).

#![forbid(unsafe_code)]

pub mod admin;
pub mod body;
pub mod cli;
pub mod config;
pub mod events;
pub mod keys;
pub mod metrics;
pub mod parity;
pub mod request;
pub mod rows;
pub mod server;
pub mod service;
pub mod sharing;
pub mod state;
pub mod upstream;
pub mod usage;

pub use config::{ReplicaSpec, RouterConfig, load_replicas_file};
pub use server::{Router, RouterError, run_blocking};
