//! The endpoint picker's configuration: the router's request-path settings
//! ([`proxy::RouterConfig`]: replicas, policy, rows, keys, health, in-flight ceiling) plus what
//! only the picker has (the endpoint file it watches, the fallback list's length).

use std::path::PathBuf;

use proxy::RouterConfig;

/// Default period of the endpoint file's check for changes.
pub const DEFAULT_WATCH_INTERVAL_MS: u64 = 1000;

/// Default length of the fallback list after the picked endpoint.
pub const DEFAULT_FALLBACKS: usize = 2;

/// Everything the endpoint picker needs to start.
#[derive(Debug, Clone)]
pub struct EppConfig {
    /// The request-path settings shared with the router. `host`/`port` are the gRPC listener;
    /// `replicas` the static endpoint list (ignored when `replicas_file` is set); the admin,
    /// connection and upstream-timeout fields are the router's own and unused here.
    pub router: RouterConfig,
    /// A replica-list file (the router's `--config` format) read at start and re-read when it
    /// changes: new URLs join, missing ones leave (in-flight requests finish).
    pub replicas_file: Option<PathBuf>,
    /// How often the file is checked for changes, ms.
    pub watch_interval_ms: u64,
    /// Eligible endpoints listed after the picked one (least outstanding first) for the proxy's
    /// retries (`x-gateway-destination-endpoint: picked,fallback,…`).
    pub fallbacks: usize,
    /// Start Envoy in front of the replicas, wired to this picker ([`run_blocking`] only).
    ///
    /// [`run_blocking`]: crate::run_blocking
    pub envoy: Option<EnvoyLaunch>,
}

/// Envoy started by the picker's binary: a whole gateway from one command (the harness's
/// `--ingress envoy-epp`). Its cluster is the replica list at start.
#[derive(Debug, Clone)]
pub struct EnvoyLaunch {
    /// The Envoy binary.
    pub bin: PathBuf,
    /// Its HTTP listener (port 0: ephemeral, named by the readiness line).
    pub listen: std::net::SocketAddr,
    /// Where its bootstrap (`envoy.json`) and log (`envoy.log`) go.
    pub dir: PathBuf,
}

impl EppConfig {
    /// Defaults for everything but the router settings.
    pub fn new(router: RouterConfig) -> Self {
        EppConfig {
            router,
            replicas_file: None,
            watch_interval_ms: DEFAULT_WATCH_INTERVAL_MS,
            fallbacks: DEFAULT_FALLBACKS,
            envoy: None,
        }
    }
}
