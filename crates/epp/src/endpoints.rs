//! The endpoint set: replica URLs as the `<ip:port>` endpoints the EPP protocol names, and the
//! watched replica file.
//!
//! The proxy (Envoy's `override_host` policy) matches a picked endpoint against its cluster's
//! hosts by address, so every replica URL must have an IP literal host. The file watcher polls
//! the file's contents (no inotify: one small read per period, the same on every platform) and
//! applies the difference by URL through the replica table's own add/remove, which is what the
//! router's admin API does.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use proxy::ReplicaSpec;
use proxy::state::{Replica, Shared, start_replica_tasks};

/// Why a replica list cannot be the picker's endpoint set. The replica table's and the URL
/// parser's refusals (crates/proxy) come as their messages.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    /// The replica URL does not parse (the router's message).
    #[error("{0}")]
    Url(String),
    /// A host name where the protocol needs an IP literal.
    #[error(
        "replica URL {0:?}: the endpoint picker names endpoints as <ip:port>, so the host must be an IP address"
    )]
    NotIp(String),
    /// The replica table refused an added replica (the router's message).
    #[error("{0}")]
    Replica(String),
    /// The endpoint file is not UTF-8 or not the router's `--config` format.
    #[error("{}: {reason}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}

/// A replica's endpoint as the EPP protocol writes it (`ip:port`, IPv6 bracketed), or why it has
/// none (a host name instead of an IP literal).
pub fn endpoint_of(url: &str) -> Result<SocketAddr, EndpointError> {
    let (_, authority) = proxy::upstream::parse_base_url(url).map_err(EndpointError::Url)?;
    let port = authority.port_u16().unwrap_or(80);
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let ip: std::net::IpAddr = host
        .parse()
        .map_err(|_| EndpointError::NotIp(url.to_string()))?;
    Ok(SocketAddr::new(ip, port))
}

/// Checks that every replica has an `ip:port` endpoint.
pub fn check_specs(specs: &[ReplicaSpec]) -> Result<(), EndpointError> {
    specs.iter().try_for_each(|s| endpoint_of(&s.url).map(drop))
}

/// The replica currently serving `endpoint` (the proxy's report of what it used).
pub fn replica_at(shared: &Shared, endpoint: &str) -> Option<Arc<Replica>> {
    let addr: SocketAddr = endpoint.trim().parse().ok()?;
    shared
        .replicas()
        .into_iter()
        .find(|r| endpoint_of(&r.url).ok() == Some(addr))
}

/// What one reload of the endpoint file changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Applied {
    /// URLs added.
    pub added: Vec<String>,
    /// URLs removed.
    pub removed: Vec<String>,
}

/// Makes the replica table hold exactly `specs` (by URL): adds the new ones (starting their KV
/// subscribers), removes the missing ones. A spec without an `ip:port` endpoint is refused whole
/// (nothing changes).
pub async fn apply(shared: &Arc<Shared>, specs: &[ReplicaSpec]) -> Result<Applied, EndpointError> {
    check_specs(specs)?;
    let current = shared.replicas();
    let mut applied = Applied::default();
    for r in &current {
        if !specs.iter().any(|s| s.url.trim_end_matches('/') == r.url) {
            shared.remove_replica(r.id);
            applied.removed.push(r.url.clone());
        }
    }
    for s in specs {
        if !current.iter().any(|r| r.url == s.url.trim_end_matches('/')) {
            let r = shared.add_replica(s).map_err(EndpointError::Replica)?;
            start_replica_tasks(shared, &r).await;
            applied.added.push(r.url.clone());
        }
    }
    Ok(applied)
}

/// What the endpoint file watcher did so far.
#[derive(Debug, Default)]
pub struct WatchStats {
    /// Changed lists applied.
    pub applied: AtomicU64,
    /// Changed lists refused (unparsable, or an endpoint without an IP host): the table stays.
    pub refused: AtomicU64,
}

/// Re-reads `path` every `every` and applies a list that differs from the last one seen
/// (`loaded`: the bytes the table was built from) until the state is dropped. A changed file that
/// cannot be parsed or applied leaves the table as it is (counted in `stats.refused`, reported
/// on stderr).
pub async fn watch_file(
    shared: Weak<Shared>,
    path: PathBuf,
    loaded: Vec<u8>,
    every: Duration,
    stats: Arc<WatchStats>,
) {
    let mut last = Some(loaded);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let now = tokio::fs::read(&path).await.ok();
        if now.is_none() || now == last {
            continue;
        }
        last = now;
        let text = last.as_deref().unwrap_or_default();
        match reload(&shared, &path, text).await {
            Ok(_) => stats.applied.fetch_add(1, Ordering::Relaxed),
            Err(e) => {
                eprintln!("epp: endpoint file {}: {e}", path.display());
                stats.refused.fetch_add(1, Ordering::Relaxed)
            }
        };
    }
}

async fn reload(shared: &Arc<Shared>, path: &Path, text: &[u8]) -> Result<Applied, EndpointError> {
    let specs = parse_file(path, text)?;
    apply(shared, &specs).await
}

/// Parses an endpoint file's bytes (the router's `--config` format), naming the file on error.
pub fn parse_file(path: &Path, text: &[u8]) -> Result<Vec<ReplicaSpec>, EndpointError> {
    let file = |reason: String| EndpointError::File {
        path: path.to_path_buf(),
        reason,
    };
    let text = std::str::from_utf8(text).map_err(|e| file(e.to_string()))?;
    proxy::config::parse_replicas_json(text).map_err(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_need_ip_hosts() {
        assert_eq!(
            endpoint_of("http://127.0.0.1:8001").unwrap().to_string(),
            "127.0.0.1:8001"
        );
        assert_eq!(
            endpoint_of("http://[::1]:9000/").unwrap().to_string(),
            "[::1]:9000"
        );
        assert_eq!(
            endpoint_of("http://10.0.0.5").unwrap().to_string(),
            "10.0.0.5:80"
        );
        let e = endpoint_of("http://localhost:8000")
            .unwrap_err()
            .to_string();
        assert!(e.contains("must be an IP address"), "{e}");
    }
}
