//! The listeners (serving and admin), connection tasks (timeouts, the connection cap, lingering
//! close), background tasks (health checks, KV event subscribers) and graceful shutdown.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http::{Method, Request, StatusCode};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, watch};

use crate::admin::AdminAuth;
use crate::config::{RouterConfig, check_admin_exposure};
use crate::rows::RowSink;
use crate::service::ConnCtx;
use crate::sharing::{Sharing, SharingConfig};
use crate::state::{NO_KV_USAGE, Replica, Settings, Shared, start_replica_tasks};
use crate::upstream::{TimedBody, join_uri};

/// Lingering close (after an answer given before the request body was read): how long the
/// router keeps reading and discarding what the client still sends, in all and between two
/// reads, and how much at most — nginx's `lingering_time` and `lingering_timeout` (30 s, 5 s),
/// with a byte bound so one connection cannot make the router read without end.
pub const LINGER_TOTAL: Duration = Duration::from_secs(30);
/// See [`LINGER_TOTAL`].
pub const LINGER_IDLE: Duration = Duration::from_secs(5);
/// See [`LINGER_TOTAL`]: 256 MiB, 32 times the default body limit.
pub const LINGER_MAX_BYTES: usize = 256 << 20;
/// Most connections on the admin listener at once; more are closed at once.
pub const ADMIN_MAX_CONNECTIONS: usize = 64;

/// Why the router could not start.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    /// Bad configuration (policy, replica URL, …).
    #[error("configuration: {0}")]
    Config(String),
    /// Listening or file I/O failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// A running router.
pub struct Router {
    shared: Arc<Shared>,
    addr: SocketAddr,
    admin_addr: SocketAddr,
    stop_tx: watch::Sender<bool>,
    kill_tx: watch::Sender<bool>,
    accept: tokio::task::JoinHandle<()>,
    admin_accept: tokio::task::JoinHandle<()>,
    conns: Arc<ConnCount>,
    health: tokio::task::JoinHandle<()>,
    router_id: String,
    sharing: Sharing,
}

#[derive(Default)]
struct ConnCount {
    open: AtomicUsize,
    idle: Notify,
}

impl ConnCount {
    /// Waits until no connection is open; false when `limit` passed first.
    async fn wait_idle(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let idle = self.idle.notified();
            if self.open.load(Ordering::Acquire) == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, idle).await.is_err() {
                return self.open.load(Ordering::Acquire) == 0;
            }
        }
    }
}

/// One connection task: counted for graceful shutdown, holding a permit of its listener's
/// connection cap (the serving port's `--max-connections`, its refusals' bound, or the admin
/// listener's) for its life, and, on the serving port within the cap, counted in the
/// open-connections gauge (`kvroute_router_connections_open`).
struct ConnGuard {
    conns: Arc<ConnCount>,
    _permit: OwnedSemaphorePermit,
    gauge: Option<Arc<Shared>>,
}

impl ConnGuard {
    fn new(
        conns: &Arc<ConnCount>,
        permit: OwnedSemaphorePermit,
        gauge: Option<Arc<Shared>>,
    ) -> Self {
        conns.open.fetch_add(1, Ordering::AcqRel);
        if let Some(shared) = &gauge {
            shared
                .metrics
                .connections_open
                .fetch_add(1, Ordering::Relaxed);
        }
        ConnGuard {
            conns: conns.clone(),
            _permit: permit,
            gauge,
        }
    }
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        if let Some(shared) = &self.gauge {
            shared
                .metrics
                .connections_open
                .fetch_sub(1, Ordering::Relaxed);
        }
        if self.conns.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.conns.idle.notify_waiters();
        }
    }
}

/// Timeouts and limits of the connection tasks.
#[derive(Clone, Copy)]
struct ConnLimits {
    header_read_timeout: Duration,
    max_connections: usize,
    /// Most over-cap connections being answered 503 at once; past it they are closed at once.
    max_refusing: usize,
}

impl Router {
    /// Binds, subscribes to KV events, starts health checks and begins serving. Must run inside
    /// a tokio runtime.
    pub async fn start(cfg: RouterConfig) -> Result<Router, RouterError> {
        let policy = policies::build(&cfg.policy).map_err(RouterError::Config)?;
        check_admin_exposure(&cfg.admin_host, cfg.admin_token.is_some())
            .map_err(RouterError::Config)?;
        if cfg.max_connections == 0 {
            return Err(RouterError::Config("max connections must be ≥ 1".into()));
        }
        for (name, ms) in [
            ("header-read timeout", cfg.header_read_timeout_ms),
            ("body-read timeout", cfg.body_read_timeout_ms),
            ("upstream head timeout", cfg.upstream_head_timeout_ms),
            ("upstream idle timeout", cfg.upstream_idle_timeout_ms),
            ("health timeout", cfg.health_timeout_ms),
        ] {
            if ms == 0 {
                return Err(RouterError::Config(format!("the {name} must be ≥ 1 ms")));
            }
        }
        let shared = shared_from_config(&cfg, policy)?;
        if let Some(keys) = &cfg.api_keys {
            shared.install_keys(keys.clone());
        }

        // Subscribe before taking traffic, so exact residency sees every event from the start.
        for r in shared.replicas() {
            start_replica_tasks(&shared, &r).await;
        }
        // Exact keys are only as good as the tokens: refuse to route on keys the engines would
        // not match (crate::parity). After the subscriptions, so the probes' blocks are known.
        if shared.keying == policies::Keying::ExactTokens && shared.settings.token_parity_check {
            let replicas = shared.replicas();
            if let Err(e) = crate::parity::check_fleet(&shared, &replicas, None).await {
                for r in &replicas {
                    r.stop_tasks();
                }
                return Err(RouterError::Config(format!(
                    "{e} (the router refuses to start; --no-token-parity-check starts it anyway)"
                )));
            }
        }
        let listener = TcpListener::bind((cfg.host.as_str(), cfg.port)).await?;
        let addr = listener.local_addr()?;
        let admin_listener = TcpListener::bind((cfg.admin_host.as_str(), cfg.admin_port)).await?;
        let admin_addr = admin_listener.local_addr()?;
        // Publisher and peer subscribers before taking traffic: every served decision is shared.
        let (router_id, sharing) = start_sharing(&shared, &cfg, addr.port()).await?;
        let health = tokio::spawn(health_loop(
            Arc::downgrade(&shared),
            Duration::from_millis(cfg.health_interval_ms.max(10)),
            Duration::from_millis(cfg.health_timeout_ms),
        ));
        let (stop_tx, stop_rx) = watch::channel(false);
        let (kill_tx, kill_rx) = watch::channel(false);
        let conns = Arc::new(ConnCount::default());
        let limits = ConnLimits {
            header_read_timeout: Duration::from_millis(cfg.header_read_timeout_ms),
            max_connections: cfg.max_connections,
            max_refusing: (cfg.max_connections / 8).max(64),
        };
        let watch = Watches {
            stop: stop_rx,
            kill: kill_rx,
        };
        let accept = tokio::spawn(accept_loop(
            listener,
            shared.clone(),
            watch.clone(),
            conns.clone(),
            limits,
        ));
        let auth = Arc::new(AdminAuth::new(cfg.admin_token.as_deref()));
        let admin_accept = tokio::spawn(admin_accept_loop(
            admin_listener,
            shared.clone(),
            auth,
            watch,
            conns.clone(),
            limits.header_read_timeout,
        ));
        Ok(Router {
            shared,
            addr,
            admin_addr,
            stop_tx,
            kill_tx,
            accept,
            admin_accept,
            conns,
            health,
            router_id,
            sharing,
        })
    }

    /// This router's name (`--router-id`, or the default of [`crate::sharing::default_router_id`]).
    pub fn router_id(&self) -> &str {
        &self.router_id
    }

    /// The bound endpoint of the decision publisher (port 0 resolved), when sharing decisions.
    pub fn share_endpoint(&self) -> Option<&str> {
        self.sharing.endpoint.as_deref()
    }

    /// The bound address of the serving port.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The bound address of the admin listener (`/admin/*`, `/metrics`, `/health`).
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// Shared state (replica table, counters), for embedding and tests.
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Stops accepting, lets in-flight responses finish (up to `grace`), then writes and
    /// flushes every row.
    pub async fn shutdown(self, grace: Duration) {
        let _ = self.stop_tx.send(true);
        let _ = self.accept.await;
        let _ = self.admin_accept.await;
        if !self.conns.wait_idle(grace).await {
            // Past the grace period: cut what is left. Dropped handlers and bodies write their
            // rows (`shutdown: cut …`) before the row file is closed below.
            self.shared.cut_in_flight();
            let _ = self.kill_tx.send(true);
            self.conns.wait_idle(Duration::from_secs(5)).await;
        }
        self.health.abort();
        let mut sharing = self.sharing;
        sharing.stop();
        for r in self.shared.replicas() {
            r.stop_tasks();
        }
        let shared = self.shared.clone();
        let _ = tokio::task::spawn_blocking(move || shared.rows.close()).await;
    }
}

/// The shutdown signals every connection task watches: `stop` (finish the response in flight,
/// then close) and `kill` (past the grace period: cut now).
#[derive(Clone)]
struct Watches {
    stop: watch::Receiver<bool>,
    kill: watch::Receiver<bool>,
}

/// Accepts, waiting out transient errors (out of file descriptors and similar) instead of
/// spinning; `None` once shutdown began.
async fn accept(
    listener: &TcpListener,
    stop: &mut watch::Receiver<bool>,
) -> Option<(TcpStream, SocketAddr)> {
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = stop.changed() => return None,
        };
        match accepted {
            Ok(s) => return Some(s),
            Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    mut watch: Watches,
    conns: Arc<ConnCount>,
    limits: ConnLimits,
) {
    // The cap, as permits: a connection holds one for its life (its task's `ConnGuard`).
    let serving = Arc::new(Semaphore::new(limits.max_connections));
    let refusing = Arc::new(Semaphore::new(limits.max_refusing));
    while let Some((stream, peer)) = accept(&listener, &mut watch.stop).await {
        let _ = stream.set_nodelay(true);
        let (over_cap, permit, gauge) = match serving.clone().try_acquire_owned() {
            Ok(permit) => (None, permit, Some(shared.clone())),
            Err(_) => {
                shared
                    .metrics
                    .connections_refused
                    .fetch_add(1, Ordering::Relaxed);
                match refusing.clone().try_acquire_owned() {
                    Ok(permit) => (Some(limits.max_connections), permit, None),
                    // Even the refusals are at their bound: close without a word.
                    Err(_) => continue,
                }
            }
        };
        let guard = ConnGuard::new(&conns, permit, gauge);
        let ctx = Arc::new(ConnCtx::new(Some(peer.ip()), over_cap));
        let shared = shared.clone();
        let watch = watch.clone();
        tokio::spawn(async move {
            let _guard = guard;
            let svc = {
                let (shared, ctx) = (shared.clone(), ctx.clone());
                service_fn(move |req| crate::service::handle(shared.clone(), ctx.clone(), req))
            };
            let mut b = http1::Builder::new();
            b.timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout);
            if over_cap.is_some() {
                b.keep_alive(false);
            }
            let conn = b.serve_connection(TokioIo::new(stream), svc);
            let Some((result, conn)) = drive(conn, watch.clone()).await else {
                return;
            };
            match result {
                Ok(()) if ctx.linger.load(Ordering::Relaxed) => {
                    linger(conn.into_parts().io.into_inner(), watch.kill).await;
                }
                Err(e) if e.is_timeout() => {
                    let parts = conn.into_parts();
                    let idle = parts.read_buf.is_empty() && ctx.requests() > 0;
                    if !idle {
                        // A partial head (or nothing at all on a fresh connection).
                        shared
                            .metrics
                            .header_timeouts
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    if !parts.read_buf.is_empty() {
                        let stream = parts.io.into_inner();
                        answer_header_timeout(stream, limits.header_read_timeout, watch.kill).await;
                    }
                }
                _ => {}
            }
        });
    }
}

/// Runs a connection until it ends, or, once shutdown begins, until its response in flight is
/// done; `None` when the grace period's end cut it. Returns the result with the connection
/// (whose IO a lingering close still needs).
///
/// Why not `hyper_util::server::graceful::GracefulShutdown`: its `watch` consumes the connection
/// and yields only its result, so the IO a lingering close or a late 408 needs
/// (`Connection::into_parts`) is gone, and it has no grace-period cut (its `shutdown` waits for
/// every connection; the router's `kill` drops them and writes their rows as cut).
async fn drive<S>(
    mut conn: http1::Connection<TokioIo<TcpStream>, S>,
    mut watch: Watches,
) -> Option<(hyper::Result<()>, http1::Connection<TokioIo<TcpStream>, S>)>
where
    S: hyper::service::HttpService<hyper::body::Incoming, ResBody = crate::body::RouterBody>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    http1::Connection<TokioIo<TcpStream>, S>: Unpin,
{
    let result = tokio::select! {
        r = &mut conn => Some(r),
        _ = watch.stop.changed() => None,
    };
    let result = match result {
        Some(r) => r,
        None => {
            // Finish the response in flight, then close.
            std::pin::Pin::new(&mut conn).graceful_shutdown();
            tokio::select! {
                r = &mut conn => r,
                _ = watch.kill.changed() => return None,
            }
        }
    };
    Some((result, conn))
}

/// The 408 a client gets when its request head did not arrive in time (hyper closes the
/// connection without a word), then a lingering close.
async fn answer_header_timeout(
    mut stream: TcpStream,
    limit: Duration,
    kill: watch::Receiver<bool>,
) {
    let body = serde_json::json!({"error": {
        "message": format!("request head not received within {} ms", limit.as_millis()),
        "type": "RequestTimeoutError", "param": null, "code": 408}})
    .to_string();
    let answer = format!(
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let written =
        tokio::time::timeout(Duration::from_secs(1), stream.write_all(answer.as_bytes())).await;
    if matches!(written, Ok(Ok(()))) {
        linger(stream, kill).await;
    }
}

/// Lingering close: FIN after the answer, then read and discard what the client still sends —
/// so a client that writes its whole body before reading gets to read the answer instead of a
/// reset — until it closes, goes quiet for [`LINGER_IDLE`], [`LINGER_TOTAL`] passes, or
/// [`LINGER_MAX_BYTES`] were read (or shutdown cuts it).
async fn linger(mut stream: TcpStream, mut kill: watch::Receiver<bool>) {
    let _ = stream.shutdown().await;
    let end = tokio::time::Instant::now() + LINGER_TOTAL;
    let mut buf = vec![0u8; 64 << 10];
    let mut drained = 0usize;
    loop {
        let wait = LINGER_IDLE.min(end.saturating_duration_since(tokio::time::Instant::now()));
        if wait.is_zero() {
            return;
        }
        let read = tokio::select! {
            r = tokio::time::timeout(wait, stream.read(&mut buf)) => r,
            _ = kill.changed() => return,
        };
        match read {
            Ok(Ok(n)) if n > 0 => {
                drained += n;
                if drained >= LINGER_MAX_BYTES {
                    return;
                }
            }
            _ => return,
        }
    }
}

async fn admin_accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    auth: Arc<AdminAuth>,
    mut watch: Watches,
    conns: Arc<ConnCount>,
    header_read_timeout: Duration,
) {
    let open = Arc::new(Semaphore::new(ADMIN_MAX_CONNECTIONS));
    while let Some((stream, _)) = accept(&listener, &mut watch.stop).await {
        let Ok(permit) = open.clone().try_acquire_owned() else {
            continue;
        };
        let guard = ConnGuard::new(&conns, permit, None);
        let (shared, auth, watch) = (shared.clone(), auth.clone(), watch.clone());
        tokio::spawn(async move {
            let _guard = guard;
            let svc =
                service_fn(move |req| crate::admin::handle(shared.clone(), auth.clone(), req));
            let conn = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_read_timeout)
                .serve_connection(TokioIo::new(stream), svc);
            let _ = drive(conn, watch).await;
        });
    }
}

/// Serves the admin API ([`crate::admin::handle`]: `/admin/replicas…`, `/metrics`, `/health`)
/// on `listener` for `shared`, as the router's admin listener does (at most
/// [`ADMIN_MAX_CONNECTIONS`], hyper's header-read timer), until `stop` turns true; connections
/// still open then are cut. The endpoint picker (`epp`) runs its admin listener here.
pub fn spawn_admin(
    listener: TcpListener,
    shared: Arc<Shared>,
    auth: Arc<AdminAuth>,
    header_read_timeout: Duration,
    stop: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    let watch = Watches {
        kill: stop.clone(),
        stop,
    };
    tokio::spawn(admin_accept_loop(
        listener,
        shared,
        auth,
        watch,
        Arc::new(ConnCount::default()),
        header_read_timeout,
    ))
}

/// The request path's shared state for `cfg` with the built `policy` (checking the bytes per
/// token and the in-flight ceiling): the row sink (`cfg.rows`),
/// the [`Settings`] derived from the configuration, and the replica table. Nothing is started
/// (no KV subscriber, no health checks: [`start_replica_tasks`] and [`health_loop`] do that).
/// The router and the endpoint picker (`epp`) build their state here.
pub fn shared_from_config(
    cfg: &RouterConfig,
    policy: Box<dyn policies::Policy>,
) -> Result<Arc<Shared>, RouterError> {
    if !(cfg.bytes_per_token.is_finite() && cfg.bytes_per_token > 0.0) {
        return Err(RouterError::Config(format!(
            "bytes per token must be a positive number, got {}",
            cfg.bytes_per_token
        )));
    }
    if cfg.max_in_flight_per_replica == Some(0) {
        return Err(RouterError::Config(
            "the per-replica in-flight ceiling must be ≥ 1".into(),
        ));
    }
    let rows = match &cfg.rows {
        Some(p) => RowSink::create(p, cfg.rows_queue)?,
        None => RowSink::disabled(),
    };
    let settings = Settings {
        model: cfg.model.clone(),
        block_bytes: cfg.block_bytes,
        block_tokens: cfg.policy.tokens_per_block,
        belief_tokens_per_block: policies::belief_tokens_per_block(
            cfg.block_bytes,
            cfg.bytes_per_token,
        ),
        exact_salt: cfg.policy.salt.clone(),
        kv_events_format: cfg.kv_events_format,
        scrape_kv_usage: cfg.policy.residency_branch,
        max_body_bytes: cfg.max_body_bytes,
        body_read_timeout: Duration::from_millis(cfg.body_read_timeout_ms),
        upstream_head_timeout: Duration::from_millis(cfg.upstream_head_timeout_ms),
        upstream_idle_timeout: Duration::from_millis(cfg.upstream_idle_timeout_ms),
        health_fails_to_down: cfg.health_fails_to_down.max(1),
        health_oks_to_up: cfg.health_oks_to_up.max(1),
        max_in_flight_per_replica: cfg.max_in_flight_per_replica.unwrap_or(u32::MAX),
        upstream_keep_alive: cfg.upstream_keep_alive,
        token_parity_check: cfg.token_parity_check,
    };
    let salt = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        ^ u64::from(std::process::id()) << 32;
    Ok(Arc::new(
        Shared::new(policy, &cfg.replicas, rows, settings, salt).map_err(RouterError::Config)?,
    ))
}

/// Starts decision sharing as `cfg` asks ([`crate::sharing::start`]: the publisher when
/// `share_decisions_bind` is set, one subscriber per peer) and resolves the router id (the
/// default names `port`). Shared by the router and the endpoint picker (`epp`).
pub async fn start_sharing(
    shared: &Arc<Shared>,
    cfg: &RouterConfig,
    port: u16,
) -> Result<(String, Sharing), RouterError> {
    let router_id = cfg
        .router_id
        .clone()
        .unwrap_or_else(|| crate::sharing::default_router_id(port));
    let sharing = crate::sharing::start(
        shared,
        &SharingConfig {
            router_id: router_id.clone(),
            bind: cfg.share_decisions_bind.clone(),
            peers: cfg.share_decisions_peers.clone(),
            queue: cfg.share_decisions_queue,
            share_loads: cfg.share_loads,
        },
    )
    .await
    .map_err(RouterError::Config)?;
    Ok((router_id, sharing))
}

/// Probes every replica's `/health` every `every` (each probe bounded by `timeout`) and feeds
/// the health hysteresis (and, for the residency branch, the KV-usage scrape) until the state
/// is dropped.
pub async fn health_loop(shared: std::sync::Weak<Shared>, every: Duration, timeout: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(s) = shared.upgrade() else { return };
        let reps = s.replicas();
        let checks = reps.iter().map(|r| {
            let s = s.clone();
            let r = r.clone();
            tokio::spawn(async move {
                let ok = check_health(&s, &r, timeout).await;
                let (down, up) = (s.settings.health_fails_to_down, s.settings.health_oks_to_up);
                let healthy = r.record_probe(ok, down, up);
                if healthy && s.settings.scrape_kv_usage {
                    let usage = scrape_kv_usage(&s, &r, timeout).await;
                    r.kv_usage_bits
                        .store(usage.map_or(NO_KV_USAGE, f32::to_bits), Ordering::Relaxed);
                }
            })
        });
        let checks: Vec<_> = checks.collect();
        drop(s);
        for c in checks {
            let _ = c.await;
        }
    }
}

async fn check_health(s: &Shared, r: &Replica, timeout: Duration) -> bool {
    let Ok(uri) = join_uri(&r.scheme, &r.authority, "/health") else {
        return false;
    };
    let Ok(req) = Request::builder()
        .method(Method::GET)
        .uri(uri)
        .body(TimedBody::empty())
    else {
        return false;
    };
    match tokio::time::timeout(timeout, s.client.request(req)).await {
        Ok(Ok(resp)) => resp.status() == StatusCode::OK,
        _ => false,
    }
}

async fn scrape_kv_usage(s: &Shared, r: &Replica, timeout: Duration) -> Option<f32> {
    let fut = crate::service::small_request(s, r, Method::GET, "/metrics", None, &[]);
    let (status, _, body) = tokio::time::timeout(timeout, fut).await.ok()?.ok()?;
    if !status.is_success() {
        return None;
    }
    parse_kv_usage(std::str::from_utf8(&body).ok()?)
}

/// The KV-cache usage (0..=1) in a vLLM Prometheus exposition: `vllm:kv_cache_usage_perc`, or
/// the older `vllm:gpu_cache_usage_perc`; the largest over label sets (one per engine).
pub fn parse_kv_usage(text: &str) -> Option<f32> {
    prom_text::samples(text)
        .filter(|s| s.name == "vllm:kv_cache_usage_perc" || s.name == "vllm:gpu_cache_usage_perc")
        .map(|s| s.value as f32)
        .filter(|v| v.is_finite())
        .map(|v| v.clamp(0.0, 1.0))
        .reduce(f32::max)
}

/// Runs the router until SIGTERM or SIGINT: builds a runtime with `cfg.workers` threads, prints
/// the readiness line (`{"listening":"HOST:PORT","admin":"HOST:PORT","workers":N,
/// "scheduling":…,"router_id":…,"share_endpoint":"tcp://…"|null}`) on stdout, then shuts
/// down gracefully and flushes the rows.
pub fn run_blocking(cfg: RouterConfig) -> Result<(), RouterError> {
    // A multi-thread runtime even with one worker: measured against a current-thread runtime,
    // CPU per request was the same but `overhead_us` p50 rose from ~10 µs to 160–770 µs at 50–200
    // streams (the I/O driver is polled less often there). Two workers by default: with one,
    // every stream's frames wait behind each request's parse, hash and decision (tens of µs on
    // cold caches; `examples/decide_cost.rs`), and two measured lower CPU per request and lower
    // first-event p99 at 50 and 200 streams (docs/proxy-bench.md).
    let workers = cfg.workers.max(1);
    // Before the runtime: its worker and blocking threads inherit the policy.
    let scheduling = rt_sched::request_fifo(cfg.sched_fifo_priority);
    if let rt_sched::Scheduling::Refused { .. } = &scheduling {
        eprintln!("router: scheduling {}", scheduling.describe());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()?;
    let grace = Duration::from_millis(cfg.shutdown_grace_ms);
    rt.block_on(async move {
        // The handlers are installed before the readiness line: a supervisor may signal as soon
        // as it has read it, and a signal that arrived before them would kill the process
        // without the graceful shutdown (and without the rows).
        let signals = Signals::install()?;
        let router = Router::start(cfg).await?;
        println!(
            "{}",
            serde_json::json!({
                "listening": router.local_addr().to_string(),
                "admin": router.admin_addr().to_string(),
                "workers": workers,
                "scheduling": scheduling.describe(),
                "router_id": router.router_id(),
                "share_endpoint": router.share_endpoint(),
            })
        );
        use std::io::Write;
        let _ = std::io::stdout().flush();
        signals.wait().await;
        router.shutdown(grace).await;
        Ok(())
    })
}

/// SIGTERM and SIGINT handlers, installed (replacing the default action of killing the
/// process) from construction on.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> Result<Self, RouterError> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    /// Resolves on the first SIGTERM or SIGINT received since `install`.
    async fn wait(mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_usage_from_vllm_metrics() {
        let text = "# HELP vllm:kv_cache_usage_perc KV usage\n# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\nvllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.5\n";
        assert_eq!(parse_kv_usage(text), Some(0.5));
        assert_eq!(
            parse_kv_usage("vllm:gpu_cache_usage_perc{model_name=\"m\"} 1.7\n"),
            Some(1.0)
        );
        assert_eq!(parse_kv_usage("vllm:num_requests_running 3\n"), None);
        assert_eq!(parse_kv_usage("vllm:kv_cache_usage_perc NaN\n"), None);
        // A timestamp after the value is not the value.
        assert_eq!(
            parse_kv_usage("vllm:kv_cache_usage_perc{engine=\"0\"} 0.75 1700000000000\n"),
            Some(0.75)
        );
    }
}
