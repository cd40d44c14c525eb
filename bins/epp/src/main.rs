//! `epp`: kvroute as an Envoy endpoint picker (flags → [`epp::EppConfig`] → [`epp::run_blocking`]).
//! The routing flags are the router's, with the same meaning and defaults.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use proxy::cli::{KvEventsFormat, RoutingArgs};
use proxy::{ReplicaSpec, RouterConfig};

/// An Envoy `ext_proc` endpoint picker deciding with kvroute's router core.
#[derive(Debug, Parser)]
#[command(name = "epp", version, about)]
struct Args {
    /// gRPC listen address.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// gRPC listen port (0 = ephemeral; the readiness line names it).
    #[arg(long, default_value_t = 9002)]
    port: u16,
    /// Replica base URLs with IP hosts, comma-separated (ids 0, 1, … in this order).
    #[arg(
        long,
        value_delimiter = ',',
        required_unless_present = "config",
        conflicts_with = "config"
    )]
    replicas: Vec<String>,
    /// JSON replica list (the router's `--config` format), re-read when it changes.
    #[arg(long)]
    config: Option<PathBuf>,
    /// How often the --config file is checked for changes, milliseconds.
    #[arg(long, default_value_t = epp::config::DEFAULT_WATCH_INTERVAL_MS)]
    watch_interval_ms: u64,
    /// Eligible endpoints listed after the picked one for the proxy's retries.
    #[arg(long, default_value_t = epp::config::DEFAULT_FALLBACKS)]
    fallbacks: usize,
    // The routing flags shared with the router (`proxy::cli`).
    #[command(flatten)]
    routing: RoutingArgs,
    /// Which engine publishes the KV events: `vllm` (default) or `sglang`.
    #[arg(long, default_value = "vllm", value_enum)]
    kv_events_format: KvEventsFormat,
    /// Bytes of the router's rendering per engine token (belief predictions).
    #[arg(long, default_value_t = policies::DEFAULT_BELIEF_BYTES_PER_TOKEN)]
    bytes_per_token: f64,
    /// Tokio worker threads.
    #[arg(long, default_value_t = proxy::config::DEFAULT_WORKERS)]
    workers: usize,
    /// How long SIGTERM/SIGINT waits for open exchanges, milliseconds.
    #[arg(long, default_value_t = 30_000)]
    shutdown_grace_ms: u64,
    /// Run every thread (and the Envoy of --envoy) under SCHED_FIFO at this priority, as the
    /// router does in front of real-time emulated engines (0 = SCHED_OTHER, the default).
    #[arg(long, default_value_t = 0)]
    sched_fifo_priority: u8,
    /// Admin listener address (the router's admin API: `/admin/replicas…`, `/metrics`,
    /// `/health`). A non-loopback address needs --admin-token-file.
    #[arg(long, default_value = "127.0.0.1")]
    admin_host: String,
    /// File holding the bearer token the admin listener requires.
    #[arg(long)]
    admin_token_file: Option<PathBuf>,
    /// Also start Envoy in front of the replicas, wired to this picker (ext_proc + override_host).
    /// The readiness line then names Envoy's listener as `listening` and the picker as `epp`.
    #[arg(long)]
    envoy: bool,
    /// The Envoy binary (with --envoy; default: `$KVROUTE_ENVOY`, else where `scripts/envoy.sh`
    /// puts it).
    #[arg(long)]
    envoy_bin: Option<PathBuf>,
    /// Envoy's listen address (with --envoy).
    #[arg(long, default_value = "127.0.0.1")]
    envoy_host: String,
    /// Envoy's listen port (with --envoy; 0 = ephemeral).
    #[arg(long, default_value_t = 0)]
    envoy_port: u16,
    /// Where Envoy's bootstrap and log go (with --envoy; default: the current directory).
    #[arg(long, default_value = ".")]
    envoy_dir: PathBuf,
    /// This picker's name in its shared decisions (the router's flag).
    #[arg(long)]
    router_id: Option<String>,
    /// Publish this picker's routing decisions on a ZMQ PUB socket bound here (the router's
    /// flag: N pickers over one fleet).
    #[arg(long, value_name = "ENDPOINT")]
    share_decisions_bind: Option<String>,
    /// Subscribe to a peer's decisions and insert them into this picker's believed index
    /// (the router's flag); repeatable.
    #[arg(long, value_name = "ENDPOINT")]
    share_decisions_peer: Vec<String>,
    /// Share the load view with the peers too (the router's flag).
    #[arg(long)]
    share_loads: bool,
}

fn config(a: Args) -> Result<epp::EppConfig, String> {
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
        if !list.is_empty() && (a.config.is_some() || list.len() != replicas.len()) {
            return Err(format!(
                "{flag} needs one endpoint per --replicas entry (with --config, name them in the file)"
            ));
        }
    }
    for (i, r) in replicas.iter_mut().enumerate() {
        r.kv_events = routing.kv_events.get(i).cloned().or(r.kv_events.take());
        r.kv_replay = routing.kv_replay.get(i).cloned().or(r.kv_replay.take());
    }
    let p = routing.policy_spec().map_err(|e| e.to_string())?;
    p.validate().map_err(|e| e.to_string())?;
    let mut r = RouterConfig::new(replicas, p);
    routing.apply(&mut r).map_err(|e| e.to_string())?;
    r.host = a.host;
    r.port = a.port;
    r.bytes_per_token = a.bytes_per_token;
    r.workers = a.workers.max(1);
    r.shutdown_grace_ms = a.shutdown_grace_ms;
    r.kv_events_format = a.kv_events_format.0;
    r.sched_fifo_priority = a.sched_fifo_priority;
    if a.router_id.as_deref().is_some_and(str::is_empty) {
        return Err("--router-id must not be empty".into());
    }
    r.router_id = a.router_id;
    r.share_decisions_bind = a.share_decisions_bind;
    r.share_decisions_peers = a.share_decisions_peer;
    r.share_loads = a.share_loads;
    proxy::config::check_share_loads(&r)?;
    proxy::config::check_admin_exposure(&a.admin_host, a.admin_token_file.is_some())?;
    r.admin_host = a.admin_host;
    r.admin_token = match &a.admin_token_file {
        Some(p) => Some(proxy::config::load_admin_token(p)?),
        None => None,
    };
    let mut cfg = epp::EppConfig::new(r);
    cfg.replicas_file = a.config;
    cfg.watch_interval_ms = a.watch_interval_ms;
    cfg.fallbacks = a.fallbacks;
    if a.envoy {
        let ip: std::net::IpAddr = a
            .envoy_host
            .parse()
            .map_err(|_| format!("--envoy-host must be an IP address, got {}", a.envoy_host))?;
        cfg.envoy = Some(epp::EnvoyLaunch {
            bin: a.envoy_bin.unwrap_or_else(epp::envoy::default_bin),
            listen: std::net::SocketAddr::new(ip, a.envoy_port),
            dir: a.envoy_dir,
        });
    }
    Ok(cfg)
}

fn main() -> ExitCode {
    let cfg = match config(Args::parse()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("epp: {e}");
            return ExitCode::from(2);
        }
    };
    match epp::run_blocking(cfg) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("epp: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sharing_flags_reach_the_router_config_and_an_empty_id_is_refused() {
        let cfg = config(Args::parse_from([
            "epp",
            "--replicas",
            "http://127.0.0.1:1",
            "--router-id",
            "e1",
            "--share-decisions-bind",
            "tcp://127.0.0.1:0",
            "--share-decisions-peer",
            "tcp://127.0.0.1:7001",
            "--share-decisions-peer",
            "tcp://127.0.0.1:7002",
        ]))
        .unwrap();
        assert_eq!(cfg.router.router_id.as_deref(), Some("e1"));
        assert_eq!(
            cfg.router.share_decisions_bind.as_deref(),
            Some("tcp://127.0.0.1:0")
        );
        assert_eq!(
            cfg.router.share_decisions_peers,
            ["tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002"]
        );
        let err = config(Args::parse_from([
            "epp",
            "--replicas",
            "http://127.0.0.1:1",
            "--router-id",
            "",
        ]))
        .unwrap_err();
        assert!(err.contains("--router-id"), "{err}");
        let alone = ["epp", "--replicas", "http://127.0.0.1:1", "--share-loads"];
        let err = config(Args::parse_from(alone)).unwrap_err();
        assert!(err.contains("--share-decisions-bind"), "{err}");
        let mut with_peer = alone.to_vec();
        with_peer.extend(["--share-decisions-peer", "tcp://127.0.0.1:7001"]);
        assert!(
            config(Args::parse_from(with_peer))
                .unwrap()
                .router
                .share_loads
        );
    }
}
