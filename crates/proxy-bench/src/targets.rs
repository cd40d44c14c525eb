//! What the load goes through: nothing (direct), the `router` binary, HAProxy or nginx, each a
//! child process on a loopback port with the pids whose CPU is the proxy's.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::ProxyBenchArgs;
use crate::stats::percentile;

/// One target of the benchmark.
pub(crate) struct Target {
    /// Name in the table (`direct`, `router <policy>`, `haproxy`, `nginx`).
    pub(crate) name: String,
    /// Where the load generator connects.
    pub(crate) addr: String,
    /// Processes whose CPU time is the proxy's (empty for direct).
    pub(crate) pids: Vec<u32>,
    child: Option<Child>,
    /// The router's `router.csv` (routers only).
    rows: Option<PathBuf>,
}

impl Drop for Target {
    /// SIGKILLs the target's whole process group (it was spawned as the group's leader,
    /// [`in_own_group`]): nginx's worker outlives a SIGKILLed master otherwise.
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", c.id())])
                .status();
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `cmd` as the leader of a new process group, so that [`Target`]'s drop can end it with every
/// process it forks.
fn in_own_group(cmd: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    cmd.process_group(0)
}

impl Target {
    /// The first upstream itself, the baseline every other target is compared with.
    pub(crate) fn direct(upstream: &str) -> Target {
        Target {
            name: "direct".into(),
            addr: upstream.to_string(),
            pids: vec![],
            child: None,
            rows: None,
        }
    }

    /// For a router: SIGTERM (its graceful shutdown writes and flushes the rows) and wait.
    pub(crate) fn stop_router(&mut self) {
        if let (Some(c), Some(_)) = (&mut self.child, &self.rows) {
            let _ = Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status();
            let _ = c.wait();
            self.child = None;
        }
    }

    /// A stopped router's `overhead_us` p50 / p99 at `streams`; `None` for other targets or
    /// when the rows cannot be read (said on stderr).
    pub(crate) fn router_overhead(&self, streams: usize) -> Option<(f64, f64)> {
        let rows = self.rows.as_ref()?;
        match router_overhead(rows) {
            Ok(by_streams) => by_streams.get(&streams).copied(),
            Err(e) => {
                eprintln!("proxy-bench: {}: {e:#}", self.name);
                None
            }
        }
    }
}

/// The stream count a bench request id (`r{round}-k{streams}-{i}`) was sent at.
pub(crate) fn streams_of(request_id: &str) -> Option<usize> {
    request_id
        .split('-')
        .nth(1)?
        .strip_prefix('k')?
        .parse()
        .ok()
}

/// `overhead_us` p50 / p99 per stream count, from a router's rows (read by the analysis crate's
/// strict reader).
pub(crate) fn router_overhead(rows: &std::path::Path) -> Result<HashMap<usize, (f64, f64)>> {
    let mut by_streams: HashMap<usize, Vec<f64>> = HashMap::new();
    for r in analysis::read_router_csv(rows)? {
        if let (Some(k), Some(ov)) = (streams_of(&r.request_id), r.overhead_us) {
            by_streams.entry(k).or_default().push(ov as f64);
        }
    }
    Ok(by_streams
        .into_iter()
        .map(|(k, v)| (k, (percentile(&v, 0.5), percentile(&v, 0.99))))
        .collect())
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Polls until something accepts on `addr` (HAProxy and nginx print no readiness line).
fn wait_listening(addr: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(addr).is_err() {
        if Instant::now() > deadline {
            bail!("nothing listening on {addr}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Starts the router binary with `policy` and `workers` threads in front of `upstreams`,
/// writing its rows into the working directory; its readiness line gives the address. With
/// `name_workers` the target's name (and rows file) says the worker count; a `bin` other than
/// `--router-bin` (the `--baseline-router-bin`) is named `… (baseline)`.
pub(crate) fn start_router(
    a: &ProxyBenchArgs,
    bin: &std::path::Path,
    policy: &str,
    workers: usize,
    name_workers: bool,
    upstreams: &[String],
) -> Result<Target> {
    let suffix = if name_workers {
        format!("-w{workers}")
    } else {
        String::new()
    };
    let baseline = bin != a.router_bin.as_path();
    let tag = if baseline { "-baseline" } else { "" };
    let rows = a.dir.join(format!("router-{policy}{suffix}{tag}.csv"));
    let mut cmd = Command::new(bin);
    cmd.args([
        "--port",
        "0",
        "--policy",
        policy,
        "--workers",
        &workers.to_string(),
        "--model",
        "bench",
    ])
    .arg("--replicas")
    .arg(
        upstreams
            .iter()
            .map(|u| format!("http://{u}"))
            .collect::<Vec<_>>()
            .join(","),
    )
    .arg("--rows")
    .arg(&rows)
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    let mut child = in_own_group(&mut cmd).spawn().with_context(|| {
        format!(
            "spawning {} (build it: cargo build --release -p router-bin)",
            bin.display()
        )
    })?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("router stdout")?).read_line(&mut line)?;
    let v: serde_json::Value =
        serde_json::from_str(&line).with_context(|| format!("router readiness line: {line:?}"))?;
    let addr = v["listening"].as_str().context("listening")?.to_string();
    Ok(Target {
        name: format!(
            "router {policy}{}{}",
            if name_workers {
                format!(" w{workers}")
            } else {
                String::new()
            },
            if baseline { " (baseline)" } else { "" }
        ),
        addr,
        pids: vec![child.id()],
        child: Some(child),
        rows: Some(rows),
    })
}

/// Whether `bin -v` runs.
pub(crate) fn installed(bin: &str) -> bool {
    Command::new(bin)
        .arg("-v")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

/// HAProxy's configuration: `mode http`, `option http-no-delay`, consistent hashing on
/// `x-session-id` with `hash-balance-factor 125`.
fn haproxy_config(threads: usize, port: u16, upstreams: &[String]) -> String {
    let mut cfg = format!(
        "global\n  maxconn 4000\n  nbthread {threads}\ndefaults\n  mode http\n  option http-no-delay\n  option http-keep-alive\n  timeout connect 5s\n  timeout client 120s\n  timeout server 120s\nfrontend fe\n  bind 127.0.0.1:{port}\n  default_backend be\nbackend be\n  balance hdr(x-session-id)\n  hash-type consistent\n  hash-balance-factor 125\n"
    );
    for (i, u) in upstreams.iter().enumerate() {
        let _ = writeln!(cfg, "  server s{i} {u} maxconn 2000");
    }
    cfg
}

/// Starts HAProxy (foreground, `-db`) in front of `upstreams`.
pub(crate) fn start_haproxy(a: &ProxyBenchArgs, upstreams: &[String]) -> Result<Target> {
    let port = free_port()?;
    let path = a.dir.join("haproxy.cfg");
    std::fs::write(&path, haproxy_config(a.haproxy_threads, port, upstreams))?;
    let mut cmd = Command::new("haproxy");
    cmd.arg("-db")
        .arg("-f")
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    let child = in_own_group(&mut cmd).spawn()?;
    let addr = format!("127.0.0.1:{port}");
    wait_listening(&addr)?;
    Ok(Target {
        name: "haproxy".into(),
        addr,
        pids: vec![child.id()],
        child: Some(child),
        rows: None,
    })
}

/// nginx's configuration (one worker, everything under `dir`): `hash $http_x_session_id
/// consistent`, `proxy_buffering off`, upstream keep-alive.
fn nginx_config(dir: &std::path::Path, port: u16, upstreams: &[String]) -> String {
    let d = dir.display();
    let servers: String = upstreams
        .iter()
        .map(|u| format!("    server {u};\n"))
        .collect();
    format!(
        "worker_processes 1;\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/nginx-error.log;\nevents {{ worker_connections 20000; }}\nhttp {{\n  access_log off;\n  client_body_temp_path {d}/nginx-body;\n  proxy_temp_path {d}/nginx-proxy;\n  fastcgi_temp_path {d}/nginx-fcgi;\n  uwsgi_temp_path {d}/nginx-uwsgi;\n  scgi_temp_path {d}/nginx-scgi;\n  upstream be {{\n    hash $http_x_session_id consistent;\n{servers}    keepalive 1024;\n  }}\n  server {{\n    listen 127.0.0.1:{port};\n    location / {{\n      proxy_pass http://be;\n      proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n      proxy_buffering off;\n    }}\n  }}\n}}\n"
    )
}

/// Starts nginx (foreground, `daemon off`) in front of `upstreams`; its CPU is the master's and
/// the worker's.
pub(crate) fn start_nginx(a: &ProxyBenchArgs, upstreams: &[String]) -> Result<Target> {
    let port = free_port()?;
    let dir = std::fs::canonicalize(&a.dir)?;
    let path = dir.join("nginx.conf");
    std::fs::write(&path, nginx_config(&dir, port, upstreams))?;
    let mut cmd = Command::new("nginx");
    cmd.arg("-p")
        .arg(&dir)
        .arg("-c")
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    let child = in_own_group(&mut cmd).spawn()?;
    let addr = format!("127.0.0.1:{port}");
    wait_listening(&addr)?;
    // The master only supervises; the worker does the proxying. Count both.
    let master = child.id();
    let mut pids = vec![master];
    pids.extend(crate::cpu::children_of(master));
    Ok(Target {
        name: "nginx".into(),
        addr,
        pids,
        child: Some(child),
        rows: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_name_their_stream_count() {
        assert_eq!(streams_of("r0-k200-2999"), Some(200));
        assert_eq!(streams_of("r4-k1-0"), Some(1));
        assert_eq!(streams_of("kvr-0123456789abcdef"), None);
        assert_eq!(streams_of("r0"), None);
    }

    #[test]
    fn configs_list_every_upstream() {
        let ups = ["127.0.0.1:1".to_string(), "127.0.0.1:2".to_string()];
        let h = haproxy_config(2, 9000, &ups);
        assert!(h.contains("nbthread 2\n") && h.contains("bind 127.0.0.1:9000\n"));
        assert!(h.contains(
            "  server s0 127.0.0.1:1 maxconn 2000\n  server s1 127.0.0.1:2 maxconn 2000\n"
        ));
        let n = nginx_config(std::path::Path::new("/w"), 9001, &ups);
        assert!(n.contains("pid /w/nginx.pid;") && n.contains("listen 127.0.0.1:9001;"));
        assert!(
            n.contains("    server 127.0.0.1:1;\n    server 127.0.0.1:2;\n    keepalive 1024;")
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn through_a_router_every_request_lands_in_its_rows() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = listener.local_addr().unwrap();
        tokio::spawn(crate::upstream::serve(
            listener,
            2,
            Duration::from_millis(1),
        ));
        let dir = test_support::temp_dir("proxy-bench-rows");
        let rows = dir.path().join("router.csv");
        let mut cfg = proxy::RouterConfig::new(
            vec![proxy::ReplicaSpec::new(format!("http://{upstream}"))],
            policies::PolicySpec::named("prefix-affinity"),
        );
        cfg.rows = Some(rows.clone());
        let router = proxy::Router::start(cfg).await.unwrap();
        let addr = router.local_addr().to_string();
        let one = crate::load::run_cell(&addr, 1, 3, "r0-k1").await;
        let three = crate::load::run_cell(&addr, 3, 6, "r0-k3").await;
        router.shutdown(Duration::from_secs(5)).await;
        for s in [&one, &three] {
            assert_eq!(s.errors, 0);
            assert_eq!(s.delivery_us.len(), s.ttfb_us.len() * 3);
        }
        assert_eq!((one.ttfb_us.len(), three.ttfb_us.len()), (3, 6));
        let overhead = router_overhead(&rows).unwrap();
        let mut ks: Vec<usize> = overhead.keys().copied().collect();
        ks.sort();
        assert_eq!(ks, [1, 3]);
        assert!(overhead.values().all(|&(p50, p99)| p50 > 0.0 && p99 >= p50));
    }
}
