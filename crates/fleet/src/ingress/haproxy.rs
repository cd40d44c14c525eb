//! HAProxy as the ingress: Debian's HAProxy in place of the router — the bounded-load
//! consistent hashing a plain load balancer already offers (REFERENCE.md §5), as a real-peer
//! baseline for kvroute's `session-bounded`.
//!
//! HAProxy runs as a foreground child (`haproxy -db -f haproxy.cfg`) on loopback, owned by a
//! [`ChildGuard`] (killed with its process group when dropped), with a generated config:
//! `balance hdr(x-session-id)`, `hash-type consistent`, `hash-balance-factor` = the policy's
//! bound × 100, and `option http-no-delay`, without which every SSE chunk arrived ~200 ms late.
//! The driver talks to it exactly as to the router; a cell run this way has no `router.csv`
//! (its router columns are empty), and the per-server counts come from the stats socket
//! ([`Haproxy::show_stat`], [`Haproxy::write_stats`]).
//!
//! The same generator fronts any list of backend URLs with a chosen [`Balance`]: the N-router
//! ingress ([`super::routers`]) puts it in front of kvroute routers (backend `routers`) with
//! `balance roundrobin` or plain consistent hashing on `x-session-id`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::error::{err, fail};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

use crate::files::write_atomic;
use crate::http;
use crate::process::ChildGuard;

/// The policy name of an HAProxy cell (the `policy` directory and meta field).
pub const POLICY: &str = "haproxy-session-bounded";

/// What `apt-get` installs; named in every "not installed" error.
pub const INSTALL_HINT: &str =
    "install Debian's package (`apt-get install -y haproxy`, or run .ci/setup-packages.sh)";

/// How HAProxy chooses a server for each request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Balance {
    /// `balance hdr(x-session-id)`, `hash-type consistent` and `hash-balance-factor` =
    /// [`HaproxySettings::balance_factor`] × 100: bounded-load consistent hashing (the
    /// `--ingress haproxy` baseline).
    #[default]
    BoundedSessionHash,
    /// `balance hdr(x-session-id)` and `hash-type consistent` without a load bound: one session,
    /// one server, whatever the load (the sharded front of several routers).
    SessionHash,
    /// `balance roundrobin`: request by request, in turn.
    RoundRobin,
}

/// The knobs of the generated config.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HaproxySettings {
    /// How a server is chosen (default: bounded-load session hashing).
    pub balance: Balance,
    /// The backend's name in the config and in `show stat` (`replicas` in front of the fleet,
    /// `routers` in front of kvroute routers); its servers are `r0`, `r1`, … in backend order.
    pub backend: &'static str,
    /// The load bound c of bounded-load hashing (kvroute's `--load-factor`, default 1.25);
    /// HAProxy's `hash-balance-factor` is c × 100 ([`Balance::BoundedSessionHash`] only).
    pub balance_factor: f64,
    /// `nbthread` (one was as fast as two on a small shared machine, and cheaper).
    pub threads: u32,
    /// Client and server inactivity timeout, s: a stream may be silent this long.
    pub stream_timeout_s: f64,
    /// Health-check interval per server, ms (`GET /health`).
    pub check_interval_ms: u64,
}

impl Default for HaproxySettings {
    fn default() -> HaproxySettings {
        HaproxySettings {
            balance: Balance::BoundedSessionHash,
            backend: "replicas",
            balance_factor: 1.25,
            threads: 1,
            stream_timeout_s: 600.0,
            check_interval_ms: 1000,
        }
    }
}

impl HaproxySettings {
    /// `hash-balance-factor`: c × 100, rounded. HAProxy takes 0 (off) or at least 100.
    pub fn hash_balance_factor(&self) -> Result<u32> {
        let f = (self.balance_factor * 100.0).round();
        if !(self.balance_factor.is_finite() && (100.0..=100_000.0).contains(&f)) {
            fail!(
                Invalid,
                "the load bound must be at least 1 (HAProxy's hash-balance-factor is bound × 100 ≥ 100), got {}",
                self.balance_factor
            );
        }
        Ok(f as u32)
    }
}

/// `host:port` of a replica URL (`http://host:port[/]`).
fn server_address(url: &str) -> Result<String> {
    let (authority, _) = http::split_url(url)?;
    Ok(authority)
}

/// The `balance` lines of `s.balance`, and what the config's first line says HAProxy is.
fn balance_lines(s: &HaproxySettings) -> Result<(String, &'static str)> {
    Ok(match s.balance {
        Balance::BoundedSessionHash => (
            format!(
                "    balance hdr(x-session-id)\n    hash-type consistent\n    hash-balance-factor {}\n",
                s.hash_balance_factor()?
            ),
            "the bounded-load hashing baseline",
        ),
        Balance::SessionHash => (
            "    balance hdr(x-session-id)\n    hash-type consistent\n".to_string(),
            "consistent hashing on x-session-id",
        ),
        Balance::RoundRobin => ("    balance roundrobin\n".to_string(), "round robin"),
    })
}

/// The HAProxy config for `backends` (base URLs, in order: server `r<i>` is backends\[i\] of
/// backend `s.backend` — replica i in front of the fleet), chosen by `s.balance`, listening on
/// `127.0.0.1:port`, stats socket at `stats_socket`.
pub fn render_config(
    backends: &[String],
    port: u16,
    stats_socket: &Path,
    s: &HaproxySettings,
) -> Result<String> {
    if backends.is_empty() {
        fail!(Invalid, "HAProxy needs at least one backend");
    }
    if s.threads == 0 {
        fail!(Invalid, "HAProxy needs at least one thread");
    }
    if !(s.stream_timeout_s.is_finite() && s.stream_timeout_s >= 1.0) {
        fail!(
            Invalid,
            "the stream timeout must be at least 1 s, got {}",
            s.stream_timeout_s
        );
    }
    let (balance, what) = balance_lines(s)?;
    if s.backend.is_empty()
        || !s
            .backend
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-')
    {
        fail!(
            Invalid,
            "the backend name must be letters, digits and dashes: {:?}",
            s.backend
        );
    }
    let socket = stats_socket.to_string_lossy();
    if socket.contains(char::is_whitespace) {
        fail!(
            Invalid,
            "the stats socket path may not contain spaces: {socket}"
        );
    }
    let timeout_ms = (s.stream_timeout_s * 1000.0).round() as u64;
    let mut cfg = format!(
        "# Generated by `cargo xtask` (kvroute): HAProxy as {what}.
global
    nbthread {threads}
    # Loopback load is hundreds of streams at most; a larger maxconn makes HAProxy ask for
    # more file descriptors than a container's limit allows, and it refuses to start.
    maxconn 4096
    stats socket {socket} mode 600 level admin
    stats timeout 30s

defaults
    mode http
    # SSE: without it every chunk was held back ~200 ms.
    option http-no-delay
    timeout connect 5s
    timeout client {timeout_ms}ms
    timeout server {timeout_ms}ms
    timeout queue {timeout_ms}ms
    timeout http-request 30s
    timeout http-keep-alive 60s

frontend ingress
    bind 127.0.0.1:{port}
    default_backend {backend}

backend {backend}
{balance}    option httpchk GET /health
",
        threads = s.threads,
        backend = s.backend,
    );
    for (i, url) in backends.iter().enumerate() {
        let addr = server_address(url)?;
        cfg.push_str(&format!(
            "    server r{i} {addr} check inter {}ms\n",
            s.check_interval_ms.max(100)
        ));
    }
    Ok(cfg)
}

/// The haproxy binary: `$KVROUTE_HAPROXY`, else `haproxy` on PATH, else Debian's
/// `/usr/sbin/haproxy` (sbin is often not on a user's PATH).
pub fn haproxy_bin() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("KVROUTE_HAPROXY") {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        fail!(
            NotInstalled,
            "KVROUTE_HAPROXY names {}, which is not a file",
            p.display()
        );
    }
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    dirs.extend(["/usr/sbin", "/usr/local/sbin", "/sbin"].map(PathBuf::from));
    dirs.into_iter()
        .map(|d| d.join("haproxy"))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            err!(
                NotInstalled,
                "HAProxy is not installed (no `haproxy` on PATH or in /usr/sbin); {INSTALL_HINT}"
            )
        })
}

/// One server line of `show stat`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServerStat {
    /// Server name (`r<i>` = replica i).
    pub name: String,
    /// Requests in flight now (`scur`).
    pub scur: u64,
    /// Sessions served in total (`stot`).
    pub stot: u64,
    /// `UP`, `DOWN`, …
    pub status: String,
}

/// The server rows of backend `backend` in `show stat` CSV output.
pub fn parse_show_stat(text: &str, backend: &str) -> Result<Vec<ServerStat>> {
    let mut lines = text.lines();
    let header = lines
        .next()
        .and_then(|h| h.strip_prefix("# "))
        .ok_or_else(|| {
            err!(
                Answer,
                "`show stat` answered without its CSV header: {text:.200}"
            )
        })?;
    let cols: Vec<&str> = header.split(',').collect();
    let col = |name: &str| {
        cols.iter()
            .position(|c| *c == name)
            .ok_or_else(|| err!(Answer, "`show stat` has no `{name}` column"))
    };
    let (px, sv, scur, stot, status) = (
        col("pxname")?,
        col("svname")?,
        col("scur")?,
        col("stot")?,
        col("status")?,
    );
    let mut out = Vec::new();
    for line in lines.filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split(',').collect();
        let get = |i: usize| f.get(i).copied().unwrap_or("");
        if get(px) != backend || matches!(get(sv), "FRONTEND" | "BACKEND") {
            continue;
        }
        out.push(ServerStat {
            name: get(sv).to_string(),
            scur: get(scur).parse().unwrap_or(0),
            stot: get(stot).parse().unwrap_or(0),
            status: get(status).to_string(),
        });
    }
    Ok(out)
}

/// A running HAProxy. Dropping it kills it; [`Haproxy::terminate`] stops it gracefully.
#[derive(Debug)]
pub struct Haproxy {
    guard: ChildGuard,
    url: String,
    stats_socket: PathBuf,
    backend: &'static str,
}

static SOCKETS: AtomicU32 = AtomicU32::new(0);

/// A loopback port the kernel just handed out (free when picked, not reserved).
pub(crate) fn free_port() -> Result<u16> {
    // HAProxy cannot announce an ephemeral port, so pick one the kernel just handed out.
    let socket = |source| Error::Socket {
        what: "finding a free loopback port".to_string(),
        source,
    };
    let l = TcpListener::bind("127.0.0.1:0").map_err(socket)?;
    Ok(l.local_addr().map_err(socket)?.port())
}

impl Haproxy {
    /// Writes `dir/haproxy.cfg`, checks it (`haproxy -c`), starts `haproxy -db -f` with its
    /// output in `dir/haproxy.log`, and waits until it accepts connections and answers on its
    /// stats socket; `should_stop` (a Ctrl-C flag) is polled while waiting.
    pub fn start(
        backends: &[String],
        s: &HaproxySettings,
        dir: &Path,
        should_stop: &dyn Fn() -> bool,
    ) -> Result<Haproxy> {
        let bin = haproxy_bin()?;
        std::fs::create_dir_all(dir).map_err(Error::io("creating", dir))?;
        // Unix socket paths are short (108 bytes): keep it in the temp dir, not the cell.
        let stats_socket = std::env::temp_dir().join(format!(
            "kvroute-haproxy-{}-{}.sock",
            std::process::id(),
            SOCKETS.fetch_add(1, Ordering::Relaxed)
        ));
        let config = dir.join("haproxy.cfg");
        let log = dir.join("haproxy.log");
        let mut last_error = None;
        // The port is free when picked but not reserved; another process may take it first.
        for _ in 0..3 {
            let port = free_port()?;
            let text = render_config(backends, port, &stats_socket, s)?;
            write_atomic(&config, text.as_bytes())?;
            let check = Command::new(&bin)
                .arg("-c")
                .arg("-f")
                .arg(&config)
                .output()
                .map_err(|source| Error::Spawn {
                    what: format!("running {} -c", bin.display()),
                    source,
                })?;
            if !check.status.success() {
                fail!(
                    Answer,
                    "HAProxy rejected {}: {}{}",
                    config.display(),
                    String::from_utf8_lossy(&check.stdout),
                    String::from_utf8_lossy(&check.stderr)
                );
            }
            let _ = std::fs::remove_file(&stats_socket);
            let mut cmd = Command::new(&bin);
            cmd.arg("-db").arg("-f").arg(&config);
            let guard = ChildGuard::spawn("haproxy", cmd, &log)?;
            let mut h = Haproxy {
                guard,
                url: format!("http://127.0.0.1:{port}"),
                stats_socket: stats_socket.clone(),
                backend: s.backend,
            };
            match h.wait_ready(Duration::from_secs(10), should_stop) {
                Ok(()) => return Ok(h),
                Err(e) => {
                    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
                    let tail: Vec<&str> = log_text.lines().rev().take(5).collect();
                    let e = e.context(format!(
                        "HAProxy's last words: {}",
                        tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
                    ));
                    if !log_text.to_ascii_lowercase().contains("bind") {
                        return Err(e);
                    }
                    last_error = Some(e);
                }
            }
        }
        Err(last_error.unwrap_or_else(|| err!(Exited, "HAProxy did not start")))
    }

    fn wait_ready(&mut self, timeout: Duration, should_stop: &dyn Fn() -> bool) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let (authority, _) = http::split_url(&self.url)?;
        loop {
            if should_stop() {
                fail!(Interrupted, "interrupted while waiting for HAProxy");
            }
            if let Some(status) = self.guard.try_wait()? {
                fail!(
                    Exited,
                    "HAProxy exited ({status}) before it was ready; see its log {}",
                    self.guard.log_path().display()
                );
            }
            if TcpStream::connect(&authority).is_ok() && self.show_stat().is_ok() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                fail!(
                    Timeout,
                    "HAProxy did not accept connections on {} within {:.0} s; see its log {}",
                    self.url,
                    timeout.as_secs_f64(),
                    self.guard.log_path().display()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `http://127.0.0.1:PORT`, what the driver is pointed at.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Its log (stdout and stderr).
    pub fn log_path(&self) -> &Path {
        self.guard.log_path()
    }

    /// A raw command on the stats socket (`show stat`, `show info`, …).
    fn command(&self, command: &str) -> Result<String> {
        let mut s = UnixStream::connect(&self.stats_socket).map_err(|source| Error::Socket {
            what: format!("connecting to {}", self.stats_socket.display()),
            source,
        })?;
        let on_socket = |source| Error::Socket {
            what: format!("`{command}` on {}", self.stats_socket.display()),
            source,
        };
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(on_socket)?;
        s.write_all(format!("{command}\n").as_bytes())
            .map_err(on_socket)?;
        let mut out = String::new();
        s.read_to_string(&mut out).map_err(on_socket)?;
        Ok(out)
    }

    /// Per-server in-flight (`scur`) and totals (`stot`) of its backend.
    pub fn show_stat(&self) -> Result<Vec<ServerStat>> {
        parse_show_stat(&self.command("show stat")?, self.backend)
    }

    /// Non-blocking: the exit status if HAProxy has exited.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        self.guard.try_wait()
    }

    /// Stops it like the router is stopped after a cell: SIGUSR1 (HAProxy's soft stop: finish
    /// what is in flight, then exit), then SIGKILL after `grace`. Returns the exit status when
    /// it stopped within the grace period.
    pub fn terminate(&mut self, grace: Duration) -> Option<ExitStatus> {
        self.guard.signal(libc::SIGUSR1);
        match self.guard.wait_timeout(grace) {
            Ok(Some(status)) => Some(status),
            _ => {
                self.guard.kill();
                None
            }
        }
    }

    /// Writes [`Haproxy::show_stat`] to `path` as JSON (the per-server counts a cell without
    /// router rows keeps as its load-share evidence). Call it before [`Haproxy::terminate`].
    pub fn write_stats(&self, path: &Path) -> Result<Vec<ServerStat>> {
        let stats = self.show_stat()?;
        let text = serde_json::to_string_pretty(&stats).map_err(|source| Error::Json {
            what: format!("writing {}", path.display()),
            source,
        })?;
        write_atomic(path, text.as_bytes())?;
        Ok(stats)
    }
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        self.guard.kill();
        let _ = std::fs::remove_file(&self.stats_socket);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> String {
        render_config(
            &[
                "http://127.0.0.1:4001".into(),
                "http://127.0.0.1:4002/".into(),
            ],
            9000,
            Path::new("/tmp/x.sock"),
            &HaproxySettings::default(),
        )
        .unwrap()
    }

    #[test]
    fn config_has_the_required_directives() {
        let cfg = config();
        for needle in [
            "mode http",
            "option http-no-delay",
            "balance hdr(x-session-id)",
            "hash-type consistent",
            "hash-balance-factor 125",
            "bind 127.0.0.1:9000",
            "stats socket /tmp/x.sock",
            "timeout server 600000ms",
            "timeout client 600000ms",
            "server r0 127.0.0.1:4001 check",
            "server r1 127.0.0.1:4002 check",
        ] {
            assert!(cfg.contains(needle), "config lacks `{needle}`:\n{cfg}");
        }
        assert!(
            !cfg.contains("daemon"),
            "HAProxy must stay a foreground child"
        );
        let factor = |c: f64| {
            HaproxySettings {
                balance_factor: c,
                ..HaproxySettings::default()
            }
            .hash_balance_factor()
        };
        assert_eq!(factor(2.0).unwrap(), 200);
        assert_eq!(factor(1.0).unwrap(), 100);
        assert!(factor(0.9).is_err());
        assert!(factor(f64::NAN).is_err());
        assert!(render_config(&[], 1, Path::new("/tmp/s"), &HaproxySettings::default()).is_err());
        assert!(
            render_config(
                &["https://x:1".into()],
                1,
                Path::new("/tmp/s"),
                &HaproxySettings::default()
            )
            .is_err()
        );
    }

    /// The whole file, byte for byte: a cell's `haproxy.cfg` is part of what a sweep leaves.
    #[test]
    fn config_text_is_pinned() {
        let expected = r#"# Generated by `cargo xtask` (kvroute): HAProxy as the bounded-load hashing baseline.
global
    nbthread 1
    # Loopback load is hundreds of streams at most; a larger maxconn makes HAProxy ask for
    # more file descriptors than a container's limit allows, and it refuses to start.
    maxconn 4096
    stats socket /tmp/x.sock mode 600 level admin
    stats timeout 30s

defaults
    mode http
    # SSE: without it every chunk was held back ~200 ms.
    option http-no-delay
    timeout connect 5s
    timeout client 600000ms
    timeout server 600000ms
    timeout queue 600000ms
    timeout http-request 30s
    timeout http-keep-alive 60s

frontend ingress
    bind 127.0.0.1:9000
    default_backend replicas

backend replicas
    balance hdr(x-session-id)
    hash-type consistent
    hash-balance-factor 125
    option httpchk GET /health
    server r0 127.0.0.1:4001 check inter 1000ms
    server r1 127.0.0.1:4002 check inter 1000ms
"#;
        assert_eq!(config(), expected);
    }

    /// The other balance modes: the same generator, only the balance lines and names change.
    #[test]
    fn round_robin_and_plain_session_hash_configs() {
        let urls = [
            "http://127.0.0.1:5001".to_string(),
            "http://127.0.0.1:5002".into(),
        ];
        let render = |balance| {
            let s = HaproxySettings {
                balance,
                backend: "routers",
                // Ignored by both modes (no bound).
                balance_factor: 0.5,
                ..HaproxySettings::default()
            };
            render_config(&urls, 9100, Path::new("/tmp/y.sock"), &s).unwrap()
        };
        let rr = render(Balance::RoundRobin);
        assert!(
            rr.starts_with("# Generated by `cargo xtask` (kvroute): HAProxy as round robin.\n")
        );
        assert!(rr.contains("    default_backend routers\n\nbackend routers\n    balance roundrobin\n    option httpchk GET /health\n"), "{rr}");
        assert!(
            !rr.contains("hash-type") && !rr.contains("hash-balance-factor"),
            "{rr}"
        );
        let hash = render(Balance::SessionHash);
        assert!(hash.contains("backend routers\n    balance hdr(x-session-id)\n    hash-type consistent\n    option httpchk GET /health\n"), "{hash}");
        assert!(
            !hash.contains("hash-balance-factor"),
            "no load bound: {hash}"
        );
        for cfg in [&rr, &hash] {
            assert!(cfg.contains("option http-no-delay"));
            assert!(cfg.contains(
                "server r0 127.0.0.1:5001 check inter 1000ms\n    server r1 127.0.0.1:5002 check"
            ));
        }
        let bad = HaproxySettings {
            backend: "my routers",
            ..HaproxySettings::default()
        };
        assert!(render_config(&urls, 1, Path::new("/tmp/s"), &bad).is_err());
    }

    #[test]
    fn show_stat_rows_are_parsed() {
        let text = "# pxname,svname,qcur,qmax,scur,smax,slim,stot,bin,bout,dreq,dresp,ereq,econ,eresp,wretr,wredis,status\n\
ingress,FRONTEND,,,1,2,20000,9,0,0,0,0,0,,,,,OPEN\n\
replicas,r0,0,0,1,1,,5,0,0,,0,,0,0,0,0,UP\n\
replicas,r1,0,0,0,1,,4,0,0,,0,,0,0,0,0,DOWN\n\
replicas,BACKEND,0,0,1,2,2000,9,0,0,0,0,,0,0,0,0,UP\n\n";
        let s = parse_show_stat(text, "replicas").unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].name.as_str(), s[0].scur, s[0].stot), ("r0", 1, 5));
        assert_eq!(s[1].status, "DOWN");
        assert!(parse_show_stat(text, "routers").unwrap().is_empty());
        assert!(parse_show_stat("Unknown command", "replicas").is_err());
    }
}
