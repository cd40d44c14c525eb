//! Router configuration (what `router`'s flags and `--config` file fill in).

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// One upstream replica.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaSpec {
    /// Base URL, e.g. `http://127.0.0.1:8000` (paths are appended to it).
    pub url: String,
    /// KV event PUB endpoint (`tcp://…`), for exact residency.
    #[serde(default)]
    pub kv_events: Option<String>,
    /// KV event replay (ROUTER) endpoint, used to repair sequence gaps.
    #[serde(default)]
    pub kv_replay: Option<String>,
}

impl ReplicaSpec {
    /// A replica with only a URL.
    pub fn new(url: impl Into<String>) -> Self {
        ReplicaSpec {
            url: url.into(),
            kv_events: None,
            kv_replay: None,
        }
    }
}

/// Everything the router needs to start.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Listen address.
    pub host: String,
    /// Listen port (0 = ephemeral).
    pub port: u16,
    /// Replicas, ids assigned in this order.
    pub replicas: Vec<ReplicaSpec>,
    /// The routing policy.
    pub policy: policies::PolicySpec,
    /// `router.csv` path; `None` writes no rows.
    pub rows: Option<PathBuf>,
    /// Salt for belief keys and the model for `/tokenize`; `None` uses each request's `model`.
    /// (Exact keys use `policy.salt` and `policy.tokens_per_block`, which the policy's
    /// event-fed index shares.)
    pub model: Option<String>,
    /// Belief block size in bytes.
    pub block_bytes: usize,
    /// Estimated canonical-rendering bytes per engine token, which converts matched belief
    /// blocks into predicted engine tokens (`predicted_match_tokens`). Default
    /// [`policies::DEFAULT_BELIEF_BYTES_PER_TOKEN`], measured for the emulator's tokenizer; an
    /// estimate for real models.
    pub bytes_per_token: f64,
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
    /// Health-check period.
    pub health_interval_ms: u64,
    /// Tokio worker threads (default [`DEFAULT_WORKERS`]).
    pub workers: usize,
    /// `SCHED_FIFO` priority asked for every thread of [`crate::server::run_blocking`] (0: the
    /// default time-sharing policy). For a router sharing cores with real-time emulated
    /// engines; see the `rt-sched` crate.
    pub sched_fifo_priority: u8,
    /// How long graceful shutdown waits for in-flight responses before cutting them.
    pub shutdown_grace_ms: u64,
    /// Capacity of the row queue.
    pub rows_queue: usize,
    /// Admin listener address (`/admin/*`, `/metrics`, `/health`); loopback by default.
    pub admin_host: String,
    /// Admin listener port (0 = ephemeral; the readiness line names it).
    pub admin_port: u16,
    /// Bearer token the admin listener requires; `None` = no token, which is refused unless
    /// `admin_host` is a loopback address.
    pub admin_token: Option<String>,
    /// How long a client may take to send a request head (and, on a keep-alive connection, how
    /// long it may stay idle between requests), ms.
    pub header_read_timeout_ms: u64,
    /// How long a client may take to send a request body once its head is in, ms.
    pub body_read_timeout_ms: u64,
    /// Most client connections open at once on the serving port; past it new connections are
    /// answered 503 and closed.
    pub max_connections: usize,
    /// How long a replica may take to send its response head (from dispatch), ms.
    pub upstream_head_timeout_ms: u64,
    /// Longest silence between two frames of a replica's response body, ms.
    pub upstream_idle_timeout_ms: u64,
    /// Health-check timeout, ms.
    pub health_timeout_ms: u64,
    /// Consecutive failures (probes or requests) that mark a healthy replica down.
    pub health_fails_to_down: u32,
    /// Consecutive passing probes that mark a down replica up.
    pub health_oks_to_up: u32,
    /// Per-replica in-flight ceiling: a replica at it gets no new request; when every eligible
    /// replica is at it the router answers 429. `None` = no ceiling.
    pub max_in_flight_per_replica: Option<u32>,
    /// Keep upstream connections open between requests (a pooled client). Off
    /// (`--no-upstream-keep-alive`): one connection per request, for engines that close a
    /// connection after a streamed response while announcing keep-alive (llama.cpp's
    /// `llama-server`: a request sent on such a pooled connection fails with a 502, never retried
    /// because it was sent).
    pub upstream_keep_alive: bool,
    /// Which engine publishes the replicas' KV events (`--kv-events-format`, default vLLM): it
    /// decides where a `BlockStored` carries the request's `cache_salt`.
    pub kv_events_format: crate::events::EventFormat,
    /// This router's name in its shared decisions and readiness line (`--router-id`); `None`:
    /// [`crate::sharing::default_router_id`] of the bound serving port.
    pub router_id: Option<String>,
    /// Where to bind the PUB socket that publishes this router's decisions to its peers
    /// (`--share-decisions-bind`, e.g. `tcp://127.0.0.1:5600`; port 0 picks one, named in the
    /// readiness line as `share_endpoint`); `None`: not published.
    pub share_decisions_bind: Option<String>,
    /// Peers' decision PUB endpoints to subscribe to (`--share-decisions-peer`, repeatable).
    pub share_decisions_peers: Vec<String>,
    /// Capacity of the queue between the request path and the decision publisher (a full queue
    /// drops and counts); default [`crate::sharing::DEFAULT_QUEUE`].
    pub share_decisions_queue: usize,
    /// Share the load view too (`--share-loads`): publish this router's in-flight count per
    /// replica on the sharing socket and add the peers' to its own before every decision
    /// ([`crate::sharing`], "Shared load view"). Needs `share_decisions_bind` or peers.
    pub share_loads: bool,
    /// API keys and their limits (`--api-keys FILE`, [`crate::keys`]): with them, the LLM
    /// endpoints and `/v1/models` need `Authorization: Bearer <key>`. `None` (the default): no
    /// keys, no limits. The endpoint picker (`epp`) does not enforce them.
    pub api_keys: Option<std::sync::Arc<crate::keys::ApiKeys>>,
    /// Probe every replica's token parity before taking traffic and before an added replica
    /// joins, refusing on a disagreement ([`crate::parity`]); only for exact keys
    /// (`exact-residency`). On by default; `--no-token-parity-check` turns it off.
    pub token_parity_check: bool,
}

/// Default of [`RouterConfig::workers`]: 2, chosen by measurement (docs/proxy-bench.md,
/// 2026-12-01): side by side in one `cargo xtask proxy-bench` run on the shared 2-core machine,
/// two workers used less CPU per request in all four cells at 50 and 200 streams (0.38–0.49 vs
/// 0.43–0.55 s per 1,000 requests, ns resolution), and their first-event medians were lower in
/// 7 of 8 comparisons (within the round-to-round spread of that loaded machine). With one
/// worker every stream's frames wait behind each request's parse, hash and decision. On the
/// same machine idle, one worker used 10–17 % less CPU (docs/proxy-bench.md, "quiet machine"):
/// 2 is kept because a sweep's router shares its cores with the engines and the driver, the
/// loaded case; measuring it in a sweep's own conditions is still open.
pub const DEFAULT_WORKERS: usize = 2;

/// Default of [`RouterConfig::header_read_timeout_ms`]: 10 s, HAProxy's documented
/// `timeout http-request` example (HAProxy also uses it for idle keep-alive connections when
/// `timeout http-keep-alive` is not set, as hyper's timer does here).
pub const DEFAULT_HEADER_READ_TIMEOUT_MS: u64 = 10_000;
/// Default of [`RouterConfig::body_read_timeout_ms`]: 30 s — the largest default body (8 MiB)
/// at about 2 Mbit/s; a body trickled slower than that is refused with 408.
pub const DEFAULT_BODY_READ_TIMEOUT_MS: u64 = 30_000;
/// Default of [`RouterConfig::max_connections`]: each client connection may hold an upstream
/// connection too, so 4,096 stays inside a common 10,000–20,000 open-file limit.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// Default of [`RouterConfig::upstream_head_timeout_ms`]: 5 min. A streamed response's head
/// comes at once (vLLM sends it before the first token), but a non-streamed one comes only after
/// the whole generation (8,192 tokens at 30 tokens/s ≈ 4.5 min).
pub const DEFAULT_UPSTREAM_HEAD_TIMEOUT_MS: u64 = 300_000;
/// Default of [`RouterConfig::upstream_idle_timeout_ms`]: 2 min between frames. The wait for
/// the first token (a queued request's TTFT under load) falls in it, so it is twice nginx's
/// `proxy_read_timeout` default of 60 s.
pub const DEFAULT_UPSTREAM_IDLE_TIMEOUT_MS: u64 = 120_000;

/// Whether `host` (an admin listener address) is loopback-only: `localhost` or a loopback IP.
/// Anything else (another IP, a host name, `0.0.0.0`) may be reachable from other machines.
pub fn is_loopback_host(host: &str) -> bool {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    h.eq_ignore_ascii_case("localhost")
        || h.parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Refuses `--share-loads` without a sharing socket: the load view travels on the decision
/// sharing's PUB socket and subscriptions, so it needs `--share-decisions-bind` (to publish)
/// or a `--share-decisions-peer` (to receive).
pub fn check_share_loads(cfg: &RouterConfig) -> Result<(), String> {
    if cfg.share_loads && cfg.share_decisions_bind.is_none() && cfg.share_decisions_peers.is_empty()
    {
        return Err(
            "--share-loads shares the load view with peer routers over the decision-sharing \
             sockets: it needs --share-decisions-bind or --share-decisions-peer"
                .into(),
        );
    }
    Ok(())
}

/// Refuses an admin listener on `admin_host` without a token unless it is loopback: the admin
/// API (drain, add or remove replicas) would be reachable from other machines. The binary checks
/// its flags with it before starting, [`crate::Router::start`] any config it is given.
pub fn check_admin_exposure(admin_host: &str, has_token: bool) -> Result<(), String> {
    if has_token || is_loopback_host(admin_host) {
        return Ok(());
    }
    Err(format!(
        "the admin API (drain, add or remove replicas) would be reachable on {admin_host} without a token: give --admin-token-file, or keep --admin-host on loopback"
    ))
}

/// Reads an admin token file: its content with surrounding whitespace trimmed; an empty file is
/// an error (it would accept an empty bearer token).
pub fn load_admin_token(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let token = text.trim();
    if token.is_empty() {
        return Err(format!("{}: the admin token file is empty", path.display()));
    }
    if token.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!(
            "{}: the admin token must be one word (no whitespace)",
            path.display()
        ));
    }
    Ok(token.to_string())
}

impl RouterConfig {
    /// Defaults for everything but the replicas and the policy.
    pub fn new(replicas: Vec<ReplicaSpec>, policy: policies::PolicySpec) -> Self {
        RouterConfig {
            host: "127.0.0.1".into(),
            port: 0,
            replicas,
            policy,
            rows: None,
            model: None,
            block_bytes: 64,
            bytes_per_token: policies::DEFAULT_BELIEF_BYTES_PER_TOKEN,
            max_body_bytes: 8 << 20,
            health_interval_ms: 1000,
            workers: DEFAULT_WORKERS,
            sched_fifo_priority: 0,
            shutdown_grace_ms: 30_000,
            rows_queue: crate::rows::DEFAULT_QUEUE_ROWS,
            admin_host: "127.0.0.1".into(),
            admin_port: 0,
            admin_token: None,
            header_read_timeout_ms: DEFAULT_HEADER_READ_TIMEOUT_MS,
            body_read_timeout_ms: DEFAULT_BODY_READ_TIMEOUT_MS,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            upstream_head_timeout_ms: DEFAULT_UPSTREAM_HEAD_TIMEOUT_MS,
            upstream_idle_timeout_ms: DEFAULT_UPSTREAM_IDLE_TIMEOUT_MS,
            health_timeout_ms: 1000,
            health_fails_to_down: 3,
            health_oks_to_up: 2,
            max_in_flight_per_replica: None,
            upstream_keep_alive: true,
            kv_events_format: crate::events::EventFormat::default(),
            router_id: None,
            share_decisions_bind: None,
            share_decisions_peers: Vec::new(),
            share_decisions_queue: crate::sharing::DEFAULT_QUEUE,
            share_loads: false,
            api_keys: None,
            token_parity_check: true,
        }
    }
}

/// A replica list from a config file: a JSON array of replicas, or an object with a `replicas`
/// array. Each replica is `{"url": …, "kv_events": …, "kv_replay": …}` or a bare URL string.
pub fn load_replicas_file(path: &Path) -> Result<Vec<ReplicaSpec>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse_replicas_json(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Parses the config-file replica list (see [`load_replicas_file`]).
pub fn parse_replicas_json(text: &str) -> Result<Vec<ReplicaSpec>, String> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Entry {
        Url(String),
        Full(ReplicaSpec),
    }
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum File {
        List(Vec<Entry>),
        Obj { replicas: Vec<Entry> },
    }
    let f: File = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let entries = match f {
        File::List(v) | File::Obj { replicas: v } => v,
    };
    let out: Vec<ReplicaSpec> = entries
        .into_iter()
        .map(|e| match e {
            Entry::Url(u) => ReplicaSpec::new(u),
            Entry::Full(r) => r,
        })
        .collect();
    for r in &out {
        crate::upstream::parse_base_url(&r.url)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_file_forms() {
        let a = parse_replicas_json(
            r#"["http://127.0.0.1:1", {"url":"http://h:2","kv_events":"tcp://h:3"}]"#,
        )
        .unwrap();
        assert_eq!(a[0], ReplicaSpec::new("http://127.0.0.1:1"));
        assert_eq!(a[1].kv_events.as_deref(), Some("tcp://h:3"));
        let b = parse_replicas_json(r#"{"replicas":["http://127.0.0.1:1"]}"#).unwrap();
        assert_eq!(b.len(), 1);
        assert!(parse_replicas_json(r#"{"replicas":[{"uri":"x"}]}"#).is_err());
        assert!(parse_replicas_json(r#"["not a url"]"#).is_err());
    }

    #[test]
    fn loopback_hosts() {
        for h in [
            "127.0.0.1",
            "127.0.0.2",
            "::1",
            "[::1]",
            "localhost",
            "LOCALHOST",
        ] {
            assert!(is_loopback_host(h), "{h}");
        }
        for h in ["0.0.0.0", "::", "10.0.0.1", "example.org", ""] {
            assert!(!is_loopback_host(h), "{h}");
        }
    }

    #[test]
    fn admin_token_files() {
        let dir = test_support::temp_dir("proxy-config");
        let p = dir.path().join("token");
        std::fs::write(&p, "  s3cret-token\n").unwrap();
        assert_eq!(load_admin_token(&p).unwrap(), "s3cret-token");
        std::fs::write(&p, "\n").unwrap();
        assert!(load_admin_token(&p).unwrap_err().contains("empty"));
        std::fs::write(&p, "two words").unwrap();
        assert!(load_admin_token(&p).unwrap_err().contains("one word"));
        assert!(load_admin_token(&dir.path().join("missing")).is_err());
    }
}
