//! N kvroute routers behind one real front balancer (`--routers N`, issue #19): the same fleet,
//! the same plan and the same policy in every router, with Debian's HAProxy in front — `balance
//! roundrobin` (the `rr` arm) or consistent hashing on `x-session-id` without a load bound (the
//! sharded arm, [`Front::SessionHash`]). HAProxy's config comes from the one generator in
//! [`super::haproxy`] (backend `routers`, server `r<K>` = router `r<K>`).
//!
//! Router K is started exactly as the single router is ([`fleet_router_command`]: the same
//! command line, `--sched-fifo-priority` and keep-alive rules), writing `router-<K>.csv` and
//! `router-<K>.log` in the cell, with `--router-id r<K>`; with decision sharing it also gets
//! `--share-decisions-bind tcp://127.0.0.1:<port K>` and one `--share-decisions-peer` per other
//! router ([`share_args`]). At the end ([`Routers::finish`]) each router's CPU time is read from
//! `/proc/<pid>/stat` and (when sharing) its `kvroute_shared_decisions_*_total` counters from its
//! `/metrics`, HAProxy's per-server counts from its stats socket; then HAProxy and the routers
//! stop (SIGTERM: they flush their rows), the per-router rows are merged into the cell's
//! `router.csv` (one header, every row, `arrival_s` on router `r0`'s clock) and `routers.json`
//! is written (docs/CONTRACTS.md, "Measurements layout").
//!
//! Cells run this way are named `r<N>-<rr|hash>[-share]-<policy>` ([`RoutersSettings::cell_policy`],
//! [`router_policy`]), beside the single router's cells of the same policy.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::{err, fail};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

use super::Ingress;
use super::haproxy::{Balance, Haproxy, HaproxySettings, ServerStat};
use super::router::{RouterSettings, fleet_router_command, spawn_router};
use crate::files::write_atomic;
use crate::fleet::Fleet;
use crate::http;
use crate::process::{ChildGuard, Readiness};

/// The front balancer in front of the routers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Front {
    /// HAProxy `balance roundrobin`: request by request, so a session's turns meet every router.
    #[serde(rename = "rr")]
    RoundRobin,
    /// HAProxy `balance hdr(x-session-id)` + `hash-type consistent`: a session's turns all go
    /// through one router (the sharded arm).
    SessionHash,
}

impl Front {
    /// The flag's spelling (`--front rr|session-hash`), also `meta.json`'s `run.front`.
    pub fn as_str(self) -> &'static str {
        match self {
            Front::RoundRobin => "rr",
            Front::SessionHash => "session-hash",
        }
    }

    /// Its part of a cell name (`rr`, `hash`).
    pub fn cell_tag(self) -> &'static str {
        match self {
            Front::RoundRobin => "rr",
            Front::SessionHash => "hash",
        }
    }

    /// HAProxy's balance mode for it.
    pub fn balance(self) -> Balance {
        match self {
            Front::RoundRobin => Balance::RoundRobin,
            Front::SessionHash => Balance::SessionHash,
        }
    }
}

impl std::str::FromStr for Front {
    type Err = Error;

    /// `rr` or `session-hash` (the flag's spellings).
    fn from_str(s: &str) -> Result<Front> {
        match s {
            "rr" => Ok(Front::RoundRobin),
            "session-hash" => Ok(Front::SessionHash),
            other => Err(err!(
                Invalid,
                "unknown front {other:?}: `rr` (round robin) or `session-hash` (consistent hashing on x-session-id)"
            )),
        }
    }
}

/// How many routers, behind which front, sharing their decisions or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoutersSettings {
    /// Routers (at least 1: one router behind the front is the control arm that measures the
    /// front's own cost; one router without a front is [`Ingress::Router`]).
    pub count: u32,
    /// The front balancer.
    pub front: Front,
    /// Each router publishes its routing decisions to the others and applies theirs
    /// (`--share-decisions-bind` / `--share-decisions-peer`).
    pub share: bool,
    /// With `share`, the routers share their load view too (`--share-loads`: each adds the
    /// others' in-flight counts to its own before deciding). Cells `r<N>-<front>-share-loads-`.
    #[serde(default)]
    pub share_loads: bool,
}

impl RoutersSettings {
    /// The prefix of its cells' policy directory names: `r4-rr-`, `r4-hash-`, `r4-rr-share-`,
    /// `r4-rr-share-loads-`.
    pub fn cell_prefix(&self) -> String {
        format!(
            "r{}-{}-{}",
            self.count,
            self.front.cell_tag(),
            match (self.share, self.share_loads) {
                (true, true) => "share-loads-",
                (true, false) => "share-",
                _ => "",
            }
        )
    }

    /// The cell name of `policy` run this way (`r4-rr-prefix-affinity`).
    pub fn cell_policy(&self, policy: &str) -> String {
        format!("{}{policy}", self.cell_prefix())
    }
}

/// The routers' policy of a cell name: `r<N>-<rr|hash>[-share[-loads]]-<policy>` → `<policy>`;
/// any other name is returned as it is.
pub fn router_policy(cell: &str) -> &str {
    let strip = || -> Option<&str> {
        let rest = cell.strip_prefix('r')?;
        let digits = rest.find(|c: char| !c.is_ascii_digit())?;
        if digits == 0 {
            return None;
        }
        let rest = rest[digits..].strip_prefix('-')?;
        let rest = ["rr-", "hash-"].iter().find_map(|t| rest.strip_prefix(t))?;
        Some(
            rest.strip_prefix("share-loads-")
                .or_else(|| rest.strip_prefix("share-"))
                .unwrap_or(rest),
        )
    };
    strip().unwrap_or(cell)
}

impl Ingress {
    /// `base` (the `--ingress` flag) with the sweep's `--routers count`, `--front`,
    /// `--share-decisions` and `--share-loads`: `base` itself for one router without `--front`,
    /// [`Ingress::Routers`] for more — or for one router with `--front` given, a control arm
    /// that measures the front's own cost (cells `r1-rr-<policy>`). Refuses what does not make
    /// sense: routers behind HAProxy or Envoy in place of the router, none, `--share-decisions`
    /// with one router, and `--share-loads` without `--share-decisions`.
    pub fn with_routers(
        base: Ingress,
        count: u32,
        front: Option<Front>,
        share: bool,
        share_loads: bool,
    ) -> Result<Ingress> {
        if count == 0 {
            fail!(Invalid, "--routers must be at least 1");
        }
        if share_loads && !share {
            fail!(
                Invalid,
                "--share-loads shares the routers' load view over their decision-sharing sockets; it needs --share-decisions"
            );
        }
        if count == 1 && share {
            fail!(
                Invalid,
                "--share-decisions shares routing decisions between routers; it needs --routers 2 or more"
            );
        }
        if count == 1 && front.is_none() {
            return Ok(base);
        }
        match base {
            Ingress::Router => Ok(Ingress::Routers(RoutersSettings {
                count,
                front: front.unwrap_or(Front::RoundRobin),
                share,
                share_loads,
            })),
            Ingress::Haproxy | Ingress::EnvoyEpp | Ingress::Routers(_) => fail!(
                Invalid,
                "--routers and --front run kvroute routers behind HAProxy; they cannot be combined with --ingress {} (which replaces the router)",
                match base {
                    Ingress::EnvoyEpp => "envoy-epp",
                    _ => "haproxy",
                }
            ),
        }
    }
}

/// Router K's id, `r<K>` (its `--router-id`, its server name in HAProxy, its files' suffix).
pub fn router_id(k: usize) -> String {
    format!("r{k}")
}

/// The decision-sharing flags of router `k` when the routers' sharing sockets are on `ports`
/// (one per router, in order): `--share-decisions-bind tcp://127.0.0.1:<ports[k]>` and
/// `--share-decisions-peer tcp://127.0.0.1:<ports[j]>` for every j ≠ k, and `--share-loads`
/// when `loads`.
pub fn share_args(k: usize, ports: &[u16], loads: bool) -> Vec<String> {
    let mut args = vec![
        "--share-decisions-bind".to_string(),
        format!("tcp://127.0.0.1:{}", ports[k]),
    ];
    if loads {
        args.push("--share-loads".to_string());
    }
    for (_, port) in ports.iter().enumerate().filter(|(j, _)| *j != k) {
        args.push("--share-decisions-peer".to_string());
        args.push(format!("tcp://127.0.0.1:{port}"));
    }
    args
}

/// `count` distinct loopback ports the kernel just handed out (all bound at once, so distinct;
/// free when picked, not reserved).
fn free_ports(count: usize) -> Result<Vec<u16>> {
    let socket = |source| Error::Socket {
        what: "finding a free loopback port".to_string(),
        source,
    };
    let listeners: Vec<TcpListener> = (0..count)
        .map(|_| TcpListener::bind("127.0.0.1:0").map_err(socket))
        .collect::<Result<_>>()?;
    listeners
        .iter()
        .map(|l| Ok(l.local_addr().map_err(socket)?.port()))
        .collect()
}

/// The counters a router sharing its decisions exports (`kvroute_shared_decisions_<name>_total`),
/// recorded per router in `routers.json`.
pub const SHARED_DECISION_COUNTERS: [&str; 10] = [
    "published",
    "published_bytes",
    "dropped",
    "received",
    "received_bytes",
    "applied",
    "gaps",
    "missed",
    "unknown_replica",
    "decode_errors",
];

/// The load-view counters every router exports (`kvroute_shared_loads_<name>_total`), recorded
/// beside [`SHARED_DECISION_COUNTERS`] as `loads_<name>` (zero unless `--share-loads`).
pub const SHARED_LOAD_COUNTERS: [&str; 4] = ["published", "received", "expired", "unknown_replica"];

/// A gauge's value in a `/metrics` text (the first sample of that name).
fn gauge(metrics: &str, name: &str) -> Option<f64> {
    prom_text::samples(metrics)
        .find(|s| s.name == name)
        .map(|s| s.value)
}

/// The shared-decision counters of a `/metrics` text, summed over label sets, by short name
/// ([`SHARED_DECISION_COUNTERS`]), and the load-view counters as `loads_<name>`
/// ([`SHARED_LOAD_COUNTERS`]). Fails naming the first counter the text lacks.
pub fn shared_decision_counters(metrics: &str) -> Result<BTreeMap<String, f64>> {
    let mut out = BTreeMap::new();
    for s in prom_text::samples(metrics) {
        let Some(name) = s.name.strip_suffix("_total") else {
            continue;
        };
        let short = if let Some(d) = name.strip_prefix("kvroute_shared_decisions_")
            && SHARED_DECISION_COUNTERS.contains(&d)
        {
            d.to_string()
        } else if let Some(l) = name.strip_prefix("kvroute_shared_loads_")
            && SHARED_LOAD_COUNTERS.contains(&l)
        {
            format!("loads_{l}")
        } else {
            continue;
        };
        *out.entry(short).or_insert(0.0) += s.value;
    }
    if let Some(missing) = SHARED_DECISION_COUNTERS
        .iter()
        .find(|c| !out.contains_key(**c))
    {
        fail!(
            Answer,
            "no kvroute_shared_decisions_{missing}_total (a router without decision sharing?)"
        );
    }
    if let Some(missing) = SHARED_LOAD_COUNTERS
        .iter()
        .find(|c| !out.contains_key(&format!("loads_{c}")))
    {
        fail!(
            Answer,
            "no kvroute_shared_loads_{missing}_total (a router from before --share-loads?)"
        );
    }
    Ok(out)
}

/// The clock tick of `/proc/<pid>/stat`'s CPU times, `sysconf(_SC_CLK_TCK)` (usually 100).
pub fn clock_ticks_per_s() -> u64 {
    rustix::param::clock_ticks_per_second()
}

/// utime + stime of a `/proc/<pid>/stat` line, clock ticks. The command name (field 2) is in
/// parentheses and may itself hold spaces and parentheses, so fields are counted from the last `)`.
pub fn parse_stat_cpu_ticks(text: &str) -> Option<u64> {
    let (_, rest) = text.rsplit_once(')')?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the command name: state(0) … utime(11) stime(12).
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// CPU seconds (user + system, all threads) of process `pid` so far.
fn cpu_s(pid: u32) -> Result<f64> {
    let path = format!("/proc/{pid}/stat");
    let text = std::fs::read_to_string(&path).map_err(Error::io("reading", &path))?;
    let ticks = parse_stat_cpu_ticks(&text).ok_or_else(|| err!(Answer, "cannot parse {path}"))?;
    Ok(ticks as f64 / clock_ticks_per_s() as f64)
}

/// Waits until every router's `kvroute_shared_decisions_peers_connected` reaches the number of
/// its peers (the others), polling their `/metrics`.
fn wait_peers_connected(
    routers: &[Running],
    timeout: Duration,
    should_stop: &dyn Fn() -> bool,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let peers = (routers.len() - 1) as f64;
    for r in routers {
        loop {
            if should_stop() {
                fail!(
                    Interrupted,
                    "interrupted while waiting for the routers to subscribe to each other"
                );
            }
            let url = http::join(&r.admin_url, "/metrics");
            let last = match http::get(&url, Duration::from_secs(2)) {
                Ok(resp) if resp.status == 200 => {
                    let text = resp.text();
                    let connected =
                        gauge(&text, "kvroute_shared_decisions_peers_connected").unwrap_or(-1.0);
                    if connected >= peers {
                        break;
                    }
                    format!("{connected} of {peers} peers connected")
                }
                Ok(resp) => format!("GET /metrics answered {}", resp.status),
                Err(e) => e.chain(),
            };
            if Instant::now() >= deadline {
                fail!(
                    Timeout,
                    "router {} did not subscribe to its peers' decisions within {:.0} s ({last}); see its log {}",
                    r.id,
                    timeout.as_secs_f64(),
                    r.guard.log_path().display()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    Ok(())
}

/// One router of a cell, as `routers.json` records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouterRecord {
    /// `r<K>`: its `--router-id`, its HAProxy server, its files `router-<K>.csv` / `.log`.
    pub id: String,
    /// Requests it routed: the rows of its `router-<K>.csv`.
    pub requests: u64,
    /// CPU seconds it used (utime + stime of `/proc/<pid>/stat`, all threads, read just before
    /// its SIGTERM); `null` when unreadable (a warning says why).
    pub cpu_s: Option<f64>,
    /// What was added to its `arrival_s` in the merged `router.csv` to put it on `r0`'s clock:
    /// its readiness time minus `r0`'s, s (each router's clock starts as it starts).
    pub clock_offset_s: f64,
    /// It exited within the grace period after SIGTERM (else it was killed; its rows may be cut).
    pub exited: bool,
    /// Its `kvroute_shared_decisions_*_total` counters scraped from `/metrics` just before the
    /// stop, by short name (`published`, `published_bytes`, `dropped`, `received`,
    /// `received_bytes`, `applied`, `gaps`, `missed`, `unknown_replica`, `decode_errors`); `null`
    /// without sharing or when the scrape failed (a warning says why).
    pub shared_decisions: Option<BTreeMap<String, f64>>,
}

/// `routers.json`: a cell run behind several routers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoutersRecord {
    /// How many routers.
    pub routers: u32,
    /// The front balancer (`rr`, `session-hash`).
    pub front: Front,
    /// Whether the routers shared their decisions.
    pub share_decisions: bool,
    /// Whether they shared their load view too (absent in records from before `--share-loads`).
    #[serde(default)]
    pub share_loads: bool,
    /// The unit of `/proc/<pid>/stat`'s CPU times the `cpu_s` came from, ticks per second.
    pub clock_ticks_per_s: u64,
    /// Each router, `r0` first.
    pub per_router: Vec<RouterRecord>,
    /// HAProxy's per-server counts at the end (server `r<K>` is router `r<K>`; `stot` counts
    /// the requests it passed, health checks excluded); empty when the stats socket did not
    /// answer (a warning says why).
    pub front_servers: Vec<ServerStat>,
}

/// One running router of [`Routers`].
#[derive(Debug)]
struct Running {
    id: String,
    guard: ChildGuard,
    url: String,
    admin_url: String,
    rows: PathBuf,
    ready_at: Instant,
}

/// N routers behind HAProxy, running. Dropping it kills every process (each by its own guard).
#[derive(Debug)]
pub struct Routers {
    settings: RoutersSettings,
    routers: Vec<Running>,
    front: Haproxy,
}

impl Routers {
    /// Starts `settings.count` routers in front of `fleet` (each with `router`'s settings, rows
    /// `dir/router-<K>.csv`, log `dir/router-<K>.log`; with sharing, [`share_args`]), then HAProxy
    /// in front of them (`haproxy`'s threads and timeouts, `settings.front`'s balance; config and
    /// log in `dir`), waiting for each to be ready (polling `should_stop`).
    pub fn start(
        router_bin: &Path,
        fleet: &Fleet,
        router: &RouterSettings,
        haproxy: &HaproxySettings,
        settings: RoutersSettings,
        dir: &Path,
        should_stop: &dyn Fn() -> bool,
    ) -> Result<Routers> {
        if settings.count == 0 {
            fail!(Invalid, "routers behind HAProxy means at least 1");
        }
        // Fails with the install hint before any router starts.
        super::haproxy::haproxy_bin()?;
        let n = settings.count as usize;
        let ports = if settings.share {
            free_ports(n)?
        } else {
            Vec::new()
        };
        let mut routers = Vec::with_capacity(n);
        for k in 0..n {
            let id = router_id(k);
            let rows = dir.join(format!("router-{k}.csv"));
            let mut cmd = fleet_router_command(router_bin, fleet, router, &rows)?;
            cmd.args(["--router-id", &id]);
            if settings.share {
                cmd.args(share_args(k, &ports, settings.share_loads));
            }
            let log = dir.join(format!("router-{k}.log"));
            let (guard, url, admin_url) =
                spawn_router(&format!("router {id}"), cmd, &log, should_stop)?;
            routers.push(Running {
                id,
                guard,
                url,
                admin_url,
                rows,
                ready_at: Instant::now(),
            });
        }
        if settings.share {
            // A PUB socket drops what it sends before a peer has subscribed: no load before
            // every router is subscribed to every other.
            wait_peers_connected(&routers, Duration::from_secs(30), should_stop)?;
        }
        let urls: Vec<String> = routers.iter().map(|r| r.url.clone()).collect();
        let front = Haproxy::start(
            &urls,
            &HaproxySettings {
                balance: settings.front.balance(),
                backend: "routers",
                ..haproxy.clone()
            },
            dir,
            should_stop,
        )?;
        Ok(Routers {
            settings,
            routers,
            front,
        })
    }

    /// HAProxy's URL: what the driver is pointed at.
    pub fn url(&self) -> &str {
        self.front.url()
    }

    /// The settings it runs with.
    pub fn settings(&self) -> RoutersSettings {
        self.settings
    }

    /// Router `r0`'s readiness line (every router runs the same command line).
    pub fn first_readiness(&self) -> Option<&Readiness> {
        self.routers.first().and_then(|r| r.guard.readiness())
    }

    /// Router `r<k>`'s serving URL, admin URL and rows file.
    pub fn router(&self, k: usize) -> Option<(&str, &str, &Path)> {
        self.routers
            .get(k)
            .map(|r| (r.url.as_str(), r.admin_url.as_str(), r.rows.as_path()))
    }

    /// Fails naming the first process (a router or HAProxy) that has exited, and its log.
    pub fn check_running(&mut self) -> Result<()> {
        for r in &mut self.routers {
            if let Some(status) = r.guard.try_wait()? {
                fail!(
                    Exited,
                    "router {} exited during the run ({status}); see its log {}",
                    r.id,
                    r.guard.log_path().display()
                );
            }
        }
        if let Some(status) = self.front.try_wait()? {
            fail!(
                Exited,
                "HAProxy in front of the routers exited during the run ({status}); see its log {}",
                self.front.log_path().display()
            );
        }
        Ok(())
    }

    /// Stops everything once the driver is done and leaves the cell's files: reads each router's
    /// CPU time and (sharing) its shared-decision counters, HAProxy's per-server counts; stops
    /// HAProxy (soft stop) and each router (SIGTERM, so it flushes its rows; killed after
    /// `grace`); merges `router-<K>.csv` into `dir/router.csv` ([`merge_router_rows`]) and writes
    /// `dir/routers.json`. Returns the warnings to show (a process killed, a reading missing).
    pub fn finish(self, dir: &Path, grace: Duration) -> Result<Vec<String>> {
        let Routers {
            settings,
            mut routers,
            mut front,
        } = self;
        let mut warnings = Vec::new();
        let front_servers = match front.show_stat() {
            Ok(s) => s,
            Err(e) => {
                warnings.push(format!("HAProxy's per-server counts: {}", e.chain()));
                Vec::new()
            }
        };
        let mut readings = Vec::with_capacity(routers.len());
        for r in &routers {
            let cpu = match r.guard.pid().map(cpu_s) {
                Some(Ok(s)) => Some(s),
                Some(Err(e)) => {
                    warnings.push(format!("router {}'s CPU time: {}", r.id, e.chain()));
                    None
                }
                None => None,
            };
            let shared = if settings.share {
                let scraped = http::get(
                    &http::join(&r.admin_url, "/metrics"),
                    Duration::from_secs(5),
                )
                .and_then(|resp| {
                    if resp.status != 200 {
                        fail!(Answer, "GET /metrics answered {}", resp.status);
                    }
                    shared_decision_counters(&resp.text())
                });
                match scraped {
                    Ok(c) => Some(c),
                    Err(e) => {
                        warnings.push(format!(
                            "router {}'s shared-decision counters: {}",
                            r.id,
                            e.chain()
                        ));
                        None
                    }
                }
            } else {
                None
            };
            readings.push((cpu, shared));
        }
        if front.terminate(grace).is_none() {
            warnings.push(format!(
                "HAProxy did not exit within {:.0} s and was killed (log {})",
                grace.as_secs_f64(),
                front.log_path().display()
            ));
        }
        drop(front);
        let mut exited = Vec::with_capacity(routers.len());
        for r in &mut routers {
            let ok = r.guard.terminate(grace).is_some();
            if !ok {
                warnings.push(format!(
                    "router {} did not exit within {:.0} s and was killed; its rows may be cut (log {})",
                    r.id,
                    grace.as_secs_f64(),
                    r.guard.log_path().display()
                ));
            }
            exited.push(ok);
        }
        let t0 = routers[0].ready_at;
        let parts: Vec<(PathBuf, f64)> = routers
            .iter()
            .map(|r| (r.rows.clone(), r.ready_at.duration_since(t0).as_secs_f64()))
            .collect();
        let counts = merge_router_rows(&parts, &dir.join("router.csv"))?;
        let record = RoutersRecord {
            routers: settings.count,
            front: settings.front,
            share_decisions: settings.share,
            share_loads: settings.share_loads,
            clock_ticks_per_s: clock_ticks_per_s(),
            per_router: routers
                .iter()
                .zip(readings)
                .zip(exited)
                .zip(counts.iter().zip(&parts))
                .map(
                    |(((r, (cpu_s, shared)), exited), (&requests, (_, offset)))| RouterRecord {
                        id: r.id.clone(),
                        requests,
                        cpu_s,
                        clock_offset_s: *offset,
                        exited,
                        shared_decisions: shared,
                    },
                )
                .collect(),
            front_servers,
        };
        let path = dir.join("routers.json");
        let text = serde_json::to_string_pretty(&record).map_err(|source| Error::Json {
            what: format!("writing {}", path.display()),
            source,
        })?;
        write_atomic(&path, text.as_bytes())?;
        Ok(warnings)
    }
}

/// Merges routers' rows files into one `out` (the columns of the first, once; every row of each,
/// in order) with each file's `arrival_s` shifted by its offset, s (onto one router's clock).
/// Every file must have the first one's header. Returns each file's row count.
pub fn merge_router_rows(parts: &[(PathBuf, f64)], out: &Path) -> Result<Vec<u64>> {
    let mut header: Option<csv::StringRecord> = None;
    let mut arrival = 0usize;
    let mut w = csv::WriterBuilder::new()
        .terminator(csv::Terminator::Any(b'\n'))
        .from_writer(Vec::new());
    let mut counts = Vec::with_capacity(parts.len());
    let writing = |source| Error::Csv {
        what: format!("writing {}", out.display()),
        source,
    };
    for (path, offset_s) in parts {
        let mut r = csv::ReaderBuilder::new()
            .from_path(path)
            .map_err(|source| Error::Csv {
                what: format!(
                    "reading {} (the router wrote no rows file?)",
                    path.display()
                ),
                source,
            })?;
        let h = r
            .headers()
            .map_err(|source| Error::Csv {
                what: format!("reading {}'s header", path.display()),
                source,
            })?
            .clone();
        match &header {
            None => {
                arrival = h
                    .iter()
                    .position(|c| c == "arrival_s")
                    .ok_or_else(|| err!(Invalid, "{} has no arrival_s column", path.display()))?;
                w.write_record(&h).map_err(writing)?;
                header = Some(h);
            }
            Some(first) if *first != h => fail!(
                Invalid,
                "{} has other columns than {} (routers of different versions?)",
                path.display(),
                parts[0].0.display()
            ),
            Some(_) => {}
        }
        let mut n = 0u64;
        for (i, rec) in r.records().enumerate() {
            let rec = rec.map_err(|source| Error::Csv {
                what: format!("{} row {}", path.display(), i + 1),
                source,
            })?;
            let t: f64 = rec
                .get(arrival)
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| {
                    err!(
                        Invalid,
                        "{} row {}: arrival_s is not a number",
                        path.display(),
                        i + 1
                    )
                })?;
            let shifted = format!("{:.6}", t + offset_s);
            let fields: Vec<&str> = rec
                .iter()
                .enumerate()
                .map(|(j, v)| if j == arrival { shifted.as_str() } else { v })
                .collect();
            w.write_record(&fields).map_err(writing)?;
            n += 1;
        }
        counts.push(n);
    }
    if header.is_none() {
        fail!(Invalid, "no router rows to merge");
    }
    let bytes = w
        .into_inner()
        .map_err(|e| writing(csv::Error::from(e.into_error())))?;
    write_atomic(out, &bytes)?;
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cell_names_carry_count_front_and_sharing() {
        let s = |count, front, share| RoutersSettings {
            count,
            front,
            share,
            share_loads: false,
        };
        assert_eq!(
            s(4, Front::RoundRobin, false).cell_policy("prefix-affinity"),
            "r4-rr-prefix-affinity"
        );
        assert_eq!(
            s(2, Front::SessionHash, false).cell_policy("session-affinity"),
            "r2-hash-session-affinity"
        );
        assert_eq!(
            s(8, Front::RoundRobin, true).cell_policy("exact-residency"),
            "r8-rr-share-exact-residency"
        );
        assert_eq!(
            s(8, Front::SessionHash, true).cell_prefix(),
            "r8-hash-share-"
        );
        let loads = RoutersSettings {
            share_loads: true,
            ..s(8, Front::SessionHash, true)
        };
        assert_eq!(
            loads.cell_policy("prefix-affinity"),
            "r8-hash-share-loads-prefix-affinity"
        );
        for cell in [
            "r8-hash-share-loads-prefix-affinity",
            "r2-rr-share-loads-prefix-affinity",
            "r4-rr-prefix-affinity",
            "r2-hash-prefix-affinity",
            "r16-rr-share-prefix-affinity",
            "r1-rr-prefix-affinity",
            "r8-hash-share-prefix-affinity",
        ] {
            assert_eq!(router_policy(cell), "prefix-affinity", "{cell}");
        }
        // Every other name is a router's (or another ingress's) own.
        for cell in [
            "round-robin",
            "r-rr-x",
            "r4-x-prefix-hash",
            "envoy-epp-prefix-hash",
            "rr-prefix-hash",
        ] {
            assert_eq!(router_policy(cell), cell);
        }
        assert_eq!(Front::SessionHash.as_str(), "session-hash");
        for f in [Front::RoundRobin, Front::SessionHash] {
            assert_eq!(f.as_str().parse::<Front>().ok(), Some(f));
        }
        assert!(
            "hash"
                .parse::<Front>()
                .unwrap_err()
                .to_string()
                .contains("session-hash")
        );
        assert_eq!(serde_json::to_value(Front::RoundRobin).unwrap(), "rr");
        assert_eq!(
            serde_json::to_value(Front::SessionHash).unwrap(),
            "session-hash"
        );
    }

    #[test]
    fn flags_that_make_no_sense_are_refused() {
        let ok = Ingress::with_routers(Ingress::Router, 4, None, false, false).unwrap();
        assert_eq!(
            ok,
            Ingress::Routers(RoutersSettings {
                count: 4,
                front: Front::RoundRobin,
                share: false,
                share_loads: false,
            })
        );
        let hash = Ingress::with_routers(Ingress::Router, 2, Some(Front::SessionHash), true, false)
            .unwrap();
        assert_eq!(
            hash,
            Ingress::Routers(RoutersSettings {
                count: 2,
                front: Front::SessionHash,
                share: true,
                share_loads: false,
            })
        );
        let loads = Ingress::with_routers(Ingress::Router, 8, Some(Front::SessionHash), true, true);
        let Ingress::Routers(loads) = loads.unwrap() else {
            panic!("routers sharing loads")
        };
        assert!(loads.share && loads.share_loads);
        // One router: today's ingress, unchanged.
        for base in [Ingress::Router, Ingress::Haproxy, Ingress::EnvoyEpp] {
            assert_eq!(
                Ingress::with_routers(base, 1, None, false, false).unwrap(),
                base
            );
        }
        let err = |base, n, front, share| {
            Ingress::with_routers(base, n, front, share, false)
                .unwrap_err()
                .to_string()
        };
        let e = Ingress::with_routers(Ingress::Router, 4, None, false, true)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("--share-loads") && e.contains("--share-decisions"),
            "{e}"
        );
        let e = err(Ingress::Haproxy, 2, None, false);
        assert!(e.contains("--ingress haproxy"), "{e}");
        let e = err(Ingress::EnvoyEpp, 4, None, false);
        assert!(e.contains("--ingress envoy-epp"), "{e}");
        let e = err(Ingress::Router, 1, None, true);
        assert!(
            e.starts_with("--share-decisions") && e.contains("--routers 2"),
            "{e}"
        );
        // One router behind the front: the control arm (its cost alone).
        let one = Ingress::with_routers(Ingress::Router, 1, Some(Front::SessionHash), false, false);
        let Ingress::Routers(one) = one.unwrap() else {
            panic!("one router behind the front")
        };
        assert_eq!(one.cell_policy("prefix-hash"), "r1-hash-prefix-hash");
        let e = err(Ingress::Haproxy, 1, Some(Front::RoundRobin), false);
        assert!(e.contains("--ingress haproxy"), "{e}");
        assert!(err(Ingress::Router, 0, None, false).contains("at least 1"));
    }

    #[test]
    fn share_flags_name_the_own_socket_and_every_peer() {
        let ports = [7001, 7002, 7003];
        assert_eq!(
            share_args(1, &ports, false).join(" "),
            "--share-decisions-bind tcp://127.0.0.1:7002 --share-decisions-peer tcp://127.0.0.1:7001 --share-decisions-peer tcp://127.0.0.1:7003"
        );
        assert_eq!(
            share_args(0, &ports[..2], false).join(" "),
            "--share-decisions-bind tcp://127.0.0.1:7001 --share-decisions-peer tcp://127.0.0.1:7002"
        );
        assert_eq!(
            share_args(0, &ports[..2], true).join(" "),
            "--share-decisions-bind tcp://127.0.0.1:7001 --share-loads --share-decisions-peer tcp://127.0.0.1:7002"
        );
        let p = free_ports(4).unwrap();
        let mut d = p.clone();
        d.sort_unstable();
        d.dedup();
        assert_eq!(d.len(), 4, "distinct ports: {p:?}");
    }

    #[test]
    fn shared_decision_counters_are_read_from_metrics() {
        let mut text =
            String::from("# TYPE kvroute_requests_total counter\nkvroute_requests_total 9\n");
        for (i, c) in SHARED_DECISION_COUNTERS.iter().enumerate() {
            text.push_str(&format!("kvroute_shared_decisions_{c}_total {}\n", i * 10));
        }
        // Label sets are summed.
        text.push_str("kvroute_shared_decisions_received_total{peer=\"r2\"} 5\n");
        let e = shared_decision_counters(&text).unwrap_err().to_string();
        assert!(e.contains("kvroute_shared_loads_published_total"), "{e}");
        for (i, c) in SHARED_LOAD_COUNTERS.iter().enumerate() {
            text.push_str(&format!("kvroute_shared_loads_{c}_total {}\n", i + 1));
        }
        let c = shared_decision_counters(&text).unwrap();
        assert_eq!(c.len(), 14);
        assert_eq!((c["loads_published"], c["loads_expired"]), (1.0, 3.0));
        assert_eq!(c["published"], 0.0);
        assert_eq!(c["received"], 35.0);
        assert_eq!(c["unknown_replica"], 80.0);
        text.push_str("kvroute_shared_decisions_peers_connected 3\n");
        assert_eq!(
            gauge(&text, "kvroute_shared_decisions_peers_connected"),
            Some(3.0)
        );
        assert_eq!(gauge(&text, "kvroute_shared_decisions_peers"), None);
        let e = shared_decision_counters("kvroute_requests_total 9\n").unwrap_err();
        assert!(
            e.to_string()
                .contains("kvroute_shared_decisions_published_total"),
            "{e}"
        );
    }

    #[test]
    fn cpu_ticks_are_read_past_the_command_name() {
        let line =
            "4242 (router (x) y) S 1 4242 4242 0 -1 4194304 100 0 0 0 250 31 0 0 20 0 3 0 1 2 3";
        assert_eq!(parse_stat_cpu_ticks(line), Some(281));
        assert_eq!(parse_stat_cpu_ticks("garbage"), None);
        // This process's own time grows past a tick once it has burnt some CPU.
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while cpu_s(std::process::id()).unwrap() == 0.0 && start.elapsed().as_secs() < 10 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(1));
        }
        assert!(cpu_s(std::process::id()).unwrap() > 0.0);
        assert!(clock_ticks_per_s() > 0);
    }

    #[test]
    fn rows_merge_under_one_header_on_one_clock() {
        let dir = test_support::temp_dir("fleet-routers");
        let header = "request_id,session_id,arrival_s,policy,error\n";
        let a = dir.path().join("router-0.csv");
        let b = dir.path().join("router-1.csv");
        std::fs::write(
            &a,
            format!("{header}q1,s1,1.000000,p,\nq3,s2,2.500000,p,\"upstream: a, b\"\n"),
        )
        .unwrap();
        std::fs::write(&b, format!("{header}q2,s1,0.250000,p,\n")).unwrap();
        let out = dir.path().join("router.csv");
        let counts = merge_router_rows(&[(a.clone(), 0.0), (b.clone(), 0.125)], &out).unwrap();
        assert_eq!(counts, [2, 1]);
        assert_eq!(
            std::fs::read_to_string(&out).unwrap(),
            format!(
                "{header}q1,s1,1.000000,p,\nq3,s2,2.500000,p,\"upstream: a, b\"\nq2,s1,0.375000,p,\n"
            )
        );
        std::fs::write(&b, "request_id,arrival_s\nq2,1\n").unwrap();
        let e = merge_router_rows(&[(a.clone(), 0.0), (b, 0.0)], &out).unwrap_err();
        assert!(e.to_string().contains("other columns"), "{e}");
        let e = merge_router_rows(&[(dir.path().join("none.csv"), 0.0)], &out).unwrap_err();
        assert!(e.to_string().contains("none.csv"), "{e}");
    }
}
