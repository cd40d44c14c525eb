//! `router`: kvroute's cache-aware router (flags → [`proxy::RouterConfig`] → [`proxy::run_blocking`]).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use proxy::cli::{KvEventsFormat, RoutingArgs};
use proxy::{ReplicaSpec, RouterConfig};

/// A streaming, OpenAI-compatible router in front of N replicas.
#[derive(Debug, Parser)]
#[command(name = "router", version, about)]
struct Args {
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Listen port (0 = ephemeral; the readiness line names it).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Replica base URLs, comma-separated (ids 0, 1, … in this order).
    #[arg(
        long,
        value_delimiter = ',',
        required_unless_present = "config",
        conflicts_with = "config"
    )]
    replicas: Vec<String>,
    /// JSON file with the replica list (`[{"url":…,"kv_events":…,"kv_replay":…}]`).
    #[arg(long)]
    config: Option<PathBuf>,
    // The routing flags shared with `epp` (`proxy::cli`).
    #[command(flatten)]
    routing: RoutingArgs,
    /// Which engine publishes the KV events: `vllm` (default) or `sglang`. It says where a
    /// `BlockStored` carries the storing request's `cache_salt` (vLLM: block 0's `extra_keys`;
    /// SGLang: its own field); blocks are keyed from the events' token ids either way.
    #[arg(long, default_value = "vllm", value_enum)]
    kv_events_format: KvEventsFormat,
    /// Bytes of the router's rendering per engine token: converts matched belief blocks into
    /// `predicted_match_tokens` (measured for the emulator's tokenizer; an estimate for real models).
    #[arg(long, default_value_t = policies::DEFAULT_BELIEF_BYTES_PER_TOKEN)]
    bytes_per_token: f64,
    /// Spill needs matched − least outstanding > N.
    #[arg(long)]
    spill_abs: Option<u32>,
    /// Spill needs matched > F × least outstanding (0 disables this half).
    #[arg(long)]
    spill_ratio: Option<f64>,
    /// Virtual nodes per replica on the hash ring.
    #[arg(long)]
    virtual_nodes: Option<u32>,
    /// Leading blocks prefix-hash hashes.
    #[arg(long)]
    prefix_hash_blocks: Option<u32>,
    /// Residency branch: decline matches on replicas above this KV usage (0..1); off when absent.
    #[arg(long)]
    residency_kv_usage: Option<f32>,
    /// Lifetime of speculative entries (exact-residency-spec), milliseconds.
    #[arg(long)]
    speculative_ttl_ms: Option<u64>,
    /// Tokio worker threads (2 measured best on a 2-core machine; see docs/proxy-bench.md).
    #[arg(long, default_value_t = proxy::config::DEFAULT_WORKERS)]
    workers: usize,
    /// Run every router thread under `SCHED_FIFO` at this priority (0: no). For a router that
    /// shares its cores with real-time emulated engines (which run at 1); the readiness line's
    /// `scheduling` says what was granted.
    #[arg(long, default_value_t = 0)]
    sched_fifo_priority: u8,
    /// How long SIGTERM/SIGINT waits for in-flight responses, milliseconds.
    #[arg(long, default_value_t = 30_000)]
    shutdown_grace_ms: u64,
    /// Admin listener address (`/admin/*`, `/metrics`, `/health`). A non-loopback address needs
    /// --admin-token-file.
    #[arg(long, default_value = "127.0.0.1")]
    admin_host: String,
    /// File holding the bearer token the admin listener requires (`Authorization: Bearer …`).
    #[arg(long)]
    admin_token_file: Option<PathBuf>,
    /// Time a client has to send a request head (and an idle keep-alive connection stays open), ms.
    #[arg(long, default_value_t = proxy::config::DEFAULT_HEADER_READ_TIMEOUT_MS)]
    header_read_timeout_ms: u64,
    /// Time a client has to send a request body once its head is in, ms (408 beyond).
    #[arg(long, default_value_t = proxy::config::DEFAULT_BODY_READ_TIMEOUT_MS)]
    body_read_timeout_ms: u64,
    /// Most client connections at once; past it new ones get 503 and are closed.
    #[arg(long, default_value_t = proxy::config::DEFAULT_MAX_CONNECTIONS)]
    max_connections: usize,
    /// Time a replica has to send its response head, ms (504 beyond; never retried).
    #[arg(long, default_value_t = proxy::config::DEFAULT_UPSTREAM_HEAD_TIMEOUT_MS)]
    upstream_head_timeout_ms: u64,
    /// Longest silence between two frames of a replica's response, ms (the stream ends with an
    /// error event beyond).
    #[arg(long, default_value_t = proxy::config::DEFAULT_UPSTREAM_IDLE_TIMEOUT_MS)]
    upstream_idle_timeout_ms: u64,
    /// Consecutive failures (probes or requests) that mark a replica down.
    #[arg(long, default_value_t = 3)]
    health_fails_to_down: u32,
    /// Consecutive passing probes that mark a down replica up.
    #[arg(long, default_value_t = 2)]
    health_oks_to_up: u32,
    /// One upstream connection per request instead of a keep-alive pool: for engines that close
    /// a connection after a streamed response while announcing keep-alive (llama.cpp's
    /// llama-server), where a request on a pooled connection fails with a 502.
    #[arg(long)]
    no_upstream_keep_alive: bool,
    /// Skip the token-parity probes (exact-residency only): by default the router checks, before
    /// taking traffic and before an added replica joins, that every replica's block size is
    /// --block-tokens and that the ids /tokenize gives are the ids the engine prefills (and the
    /// same on every replica), and refuses to start on a disagreement, naming the first
    /// differing token.
    #[arg(long)]
    no_token_parity_check: bool,
    /// This router's name in its shared decisions and its readiness line (default:
    /// HOSTNAME:PORT of the serving port, or `router`).
    #[arg(long)]
    router_id: Option<String>,
    /// Publish this router's routing decisions (one ZMQ message per request served with block
    /// keys) on a PUB socket bound here, e.g. `tcp://127.0.0.1:5600` (port 0 picks one; the
    /// readiness line's `share_endpoint` names it). For N routers over one fleet.
    #[arg(long, value_name = "ENDPOINT")]
    share_decisions_bind: Option<String>,
    /// Subscribe to a peer router's decisions (its --share-decisions-bind endpoint) and insert
    /// them into this router's believed index (prefix-affinity); repeatable. Gaps are counted
    /// (`kvroute_shared_decisions_gaps_total`), never repaired.
    #[arg(long, value_name = "ENDPOINT")]
    share_decisions_peer: Vec<String>,
    /// Share the load view too: publish this router's in-flight count per replica on the
    /// --share-decisions-bind socket (when it changes, polled every 5 ms, and every 0.5 s) and
    /// add the peers' latest counts to its own before each decision, so the spill rule and the
    /// least-loaded choices see the whole fleet's load. A peer silent for 2 s is dropped from it.
    #[arg(long)]
    share_loads: bool,
    /// Require API keys on the LLM endpoints and /v1/models (`Authorization: Bearer <key>`; 401
    /// without a known key). FILE holds one key per line, `<name> sha256:<hex of SHA-256 of the
    /// key>`, with optional per-key limits `rps=N [burst=N] tokens_per_min=N` (429 past them);
    /// `#` comments. A malformed file is refused at start (crates/proxy/README.md, "Keys and
    /// limits"). Off when absent.
    #[arg(long, value_name = "FILE")]
    api_keys: Option<PathBuf>,
}

fn config(a: Args) -> Result<RouterConfig, String> {
    let mut replicas: Vec<ReplicaSpec> = match &a.config {
        Some(path) => proxy::load_replicas_file(path)?,
        None => a.replicas.iter().map(ReplicaSpec::new).collect(),
    };
    if replicas.is_empty() {
        return Err("no replicas given".into());
    }
    let routing = &a.routing;
    for (flag, list) in [
        ("--kv-events", &routing.kv_events),
        ("--kv-replay", &routing.kv_replay),
    ] {
        if !list.is_empty() && list.len() != replicas.len() {
            return Err(format!(
                "{flag} has {} endpoints for {} replicas",
                list.len(),
                replicas.len()
            ));
        }
    }
    for (i, r) in replicas.iter_mut().enumerate() {
        if let Some(e) = routing.kv_events.get(i) {
            r.kv_events = Some(e.clone());
        }
        if let Some(e) = routing.kv_replay.get(i) {
            r.kv_replay = Some(e.clone());
        }
    }
    let mut p = routing.policy_spec().map_err(|e| e.to_string())?;
    if let Some(v) = a.spill_abs {
        p.spill_abs = v;
    }
    if let Some(v) = a.spill_ratio {
        p.spill_ratio = v;
    }
    if let Some(v) = a.virtual_nodes {
        p.virtual_nodes = v;
    }
    if let Some(v) = a.prefix_hash_blocks {
        p.prefix_hash_blocks = v;
    }
    if let Some(v) = a.residency_kv_usage {
        p.residency_branch = true;
        p.residency_kv_usage = v;
    }
    if let Some(v) = a.speculative_ttl_ms {
        p.speculative_ttl_us = v * 1000;
    }
    p.validate().map_err(|e| e.to_string())?;
    proxy::config::check_admin_exposure(&a.admin_host, a.admin_token_file.is_some())?;
    let mut cfg = RouterConfig::new(replicas, p);
    routing.apply(&mut cfg).map_err(|e| e.to_string())?;
    cfg.host = a.host;
    cfg.port = a.port;
    cfg.bytes_per_token = a.bytes_per_token;
    cfg.workers = a.workers.max(1);
    cfg.sched_fifo_priority = a.sched_fifo_priority;
    cfg.shutdown_grace_ms = a.shutdown_grace_ms;
    cfg.admin_host = a.admin_host;
    cfg.admin_token = match &a.admin_token_file {
        Some(p) => Some(proxy::config::load_admin_token(p)?),
        None => None,
    };
    cfg.header_read_timeout_ms = a.header_read_timeout_ms;
    cfg.body_read_timeout_ms = a.body_read_timeout_ms;
    cfg.max_connections = a.max_connections;
    cfg.upstream_head_timeout_ms = a.upstream_head_timeout_ms;
    cfg.upstream_idle_timeout_ms = a.upstream_idle_timeout_ms;
    cfg.health_fails_to_down = a.health_fails_to_down;
    cfg.health_oks_to_up = a.health_oks_to_up;
    cfg.upstream_keep_alive = !a.no_upstream_keep_alive;
    cfg.token_parity_check = !a.no_token_parity_check;
    cfg.kv_events_format = a.kv_events_format.0;
    if a.router_id.as_deref().is_some_and(str::is_empty) {
        return Err("--router-id must not be empty".into());
    }
    cfg.router_id = a.router_id;
    cfg.share_decisions_bind = a.share_decisions_bind;
    cfg.share_decisions_peers = a.share_decisions_peer;
    cfg.share_loads = a.share_loads;
    if let Some(path) = &a.api_keys {
        let keys = proxy::keys::ApiKeys::load(path).map_err(|e| e.to_string())?;
        cfg.api_keys = Some(std::sync::Arc::new(keys));
    }
    proxy::config::check_share_loads(&cfg)?;
    Ok(cfg)
}

fn main() -> ExitCode {
    let cfg = match config(Args::parse()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("router: {e}");
            return ExitCode::from(2);
        }
    };
    match proxy::run_blocking(cfg) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("router: {e}");
            ExitCode::FAILURE
        }
    }
}
