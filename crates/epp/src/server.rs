//! The endpoint picker's gRPC server: Envoy's `ext_proc` service (one [`exchange`] task per
//! stream) and the gRPC health service (`liveness`, `readiness`, the `ext_proc` service name and
//! the server as a whole), on one listener; the router's state, KV subscribers, health checks and
//! row writer behind it; an optional watched endpoint file.
//!
//! [`exchange`]: crate::exchange

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use proxy::server::{health_loop, shared_from_config};
use proxy::state::{Shared, start_replica_tasks};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic_health::ServingStatus;

use crate::config::EppConfig;
use crate::endpoints::WatchStats;
use crate::envoy::{Bootstrap, EnvoyProcess};
use crate::exchange::{Outbound, Picker};

/// The gRPC health service names the picker reports (EPP protocol, "Health Checking"), besides
/// the whole server (`""`).
pub const HEALTH_SERVICES: [&str; 3] = [
    "liveness",
    "readiness",
    "envoy.service.ext_proc.v3.ExternalProcessor",
];

/// Answers queued per exchange before the exchange task waits for the proxy to read.
const OUTBOUND_QUEUE: usize = 64;

/// Why the picker could not start.
#[derive(Debug, thiserror::Error)]
pub enum EppError {
    /// Bad configuration (policy, replica URL without an IP host, …).
    #[error("configuration: {0}")]
    Config(String),
    /// Listening or file I/O failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The Envoy the binary was asked to start did not come up.
    #[error("envoy: {0}")]
    Envoy(#[from] crate::envoy::EnvoyError),
    /// The replica list is not a valid endpoint set.
    #[error("configuration: {0}")]
    Endpoints(#[from] crate::endpoints::EndpointError),
}

/// How long [`run_blocking`] waits for the Envoy it starts.
const ENVOY_READY_WITHIN: Duration = Duration::from_secs(30);

impl From<proxy::RouterError> for EppError {
    fn from(e: proxy::RouterError) -> Self {
        match e {
            proxy::RouterError::Config(c) => EppError::Config(c),
            proxy::RouterError::Io(io) => EppError::Io(io),
        }
    }
}

/// The `ext_proc` service: each stream is one HTTP request's exchange.
struct Service {
    picker: Arc<Picker>,
}

#[tonic::async_trait]
impl ExternalProcessor for Service {
    type ProcessStream = Pin<Box<dyn tokio_stream::Stream<Item = Outbound> + Send + 'static>>;

    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, tonic::Status> {
        let (tx, rx) = mpsc::channel(OUTBOUND_QUEUE);
        tokio::spawn(crate::exchange::run(
            self.picker.clone(),
            request.into_inner(),
            tx,
        ));
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// A running endpoint picker.
pub struct Epp {
    shared: Arc<Shared>,
    addr: SocketAddr,
    admin_addr: SocketAddr,
    admin_stop: tokio::sync::watch::Sender<bool>,
    admin: tokio::task::JoinHandle<()>,
    reporter: tonic_health::server::HealthReporter,
    stop: Option<oneshot::Sender<()>>,
    serve: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    background: Vec<tokio::task::JoinHandle<()>>,
    watch: Arc<WatchStats>,
    /// Decision sharing with peer routers/pickers (`cfg.router.share_decisions_*`; the epp
    /// binary has no flags for it yet): stopped on drop.
    sharing: proxy::sharing::Sharing,
}

impl Epp {
    /// Builds the router state (policy, replicas from the list or the file, rows), subscribes to
    /// KV events, starts health checks and the file watcher, binds and serves. Must run inside a
    /// tokio runtime.
    pub async fn start(mut cfg: EppConfig) -> Result<Epp, EppError> {
        // The file's bytes as loaded: the watcher applies only what differs from them.
        let mut loaded = Vec::new();
        if let Some(path) = &cfg.replicas_file {
            loaded = std::fs::read(path)
                .map_err(|e| EppError::Config(format!("{}: {e}", path.display())))?;
            cfg.router.replicas = crate::endpoints::parse_file(path, &loaded)?;
        }
        crate::endpoints::check_specs(&cfg.router.replicas)?;
        proxy::config::check_admin_exposure(
            &cfg.router.admin_host,
            cfg.router.admin_token.is_some(),
        )
        .map_err(EppError::Config)?;
        if cfg.router.health_timeout_ms == 0 {
            return Err(EppError::Config("the health timeout must be ≥ 1 ms".into()));
        }
        let policy = policies::build(&cfg.router.policy).map_err(EppError::Config)?;
        let shared = shared_from_config(&cfg.router, policy)?;
        for r in shared.replicas() {
            start_replica_tasks(&shared, &r).await;
        }
        let listener = TcpListener::bind((cfg.router.host.as_str(), cfg.router.port)).await?;
        let addr = listener.local_addr()?;
        // The router's admin listener, unchanged: replica API (drain, add, remove), `/metrics`,
        // `/health`.
        let admin_listener =
            TcpListener::bind((cfg.router.admin_host.as_str(), cfg.router.admin_port)).await?;
        let admin_addr = admin_listener.local_addr()?;
        let (_, sharing) = proxy::server::start_sharing(&shared, &cfg.router, addr.port()).await?;
        let (admin_stop, admin_stop_rx) = tokio::sync::watch::channel(false);
        let admin = proxy::server::spawn_admin(
            admin_listener,
            shared.clone(),
            Arc::new(proxy::admin::AdminAuth::new(
                cfg.router.admin_token.as_deref(),
            )),
            Duration::from_millis(cfg.router.header_read_timeout_ms.max(1)),
            admin_stop_rx,
        );
        let mut background = vec![tokio::spawn(health_loop(
            Arc::downgrade(&shared),
            Duration::from_millis(cfg.router.health_interval_ms.max(10)),
            Duration::from_millis(cfg.router.health_timeout_ms),
        ))];
        let watch = Arc::new(WatchStats::default());
        if let Some(path) = cfg.replicas_file.clone() {
            background.push(tokio::spawn(crate::endpoints::watch_file(
                Arc::downgrade(&shared),
                path,
                std::mem::take(&mut loaded),
                Duration::from_millis(cfg.watch_interval_ms.max(10)),
                watch.clone(),
            )));
        }
        let (reporter, health) = tonic_health::server::health_reporter();
        reporter
            .set_service_status("", ServingStatus::Serving)
            .await;
        for name in HEALTH_SERVICES {
            reporter
                .set_service_status(name, ServingStatus::Serving)
                .await;
        }
        let service = ExternalProcessorServer::new(Service {
            picker: Arc::new(Picker {
                shared: shared.clone(),
                fallbacks: cfg.fallbacks,
            }),
        });
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let incoming =
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        let serve = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(health)
                .add_service(service)
                .serve_with_incoming_shutdown(incoming, async move {
                    let _ = stop_rx.await;
                }),
        );
        Ok(Epp {
            shared,
            addr,
            admin_addr,
            admin_stop,
            admin,
            reporter,
            stop: Some(stop_tx),
            serve,
            background,
            watch,
            sharing,
        })
    }

    /// The bound gRPC address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The admin listener's address (the router's admin API: `/admin/replicas…`, `/metrics`,
    /// `/health`).
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// What the endpoint file watcher did (all zero without a file).
    pub fn watch_stats(&self) -> &WatchStats {
        &self.watch
    }

    /// The router state (replica table, counters), for embedding and tests.
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Stops accepting, lets open exchanges finish (up to `grace`), then writes and flushes
    /// every row (an exchange still open then writes its row as cut off).
    pub async fn shutdown(mut self, grace: Duration) {
        // Health first, so a gateway that checks it stops sending new requests.
        for name in std::iter::once("").chain(HEALTH_SERVICES) {
            self.reporter
                .set_service_status(name, ServingStatus::NotServing)
                .await;
        }
        let _ = self.admin_stop.send(true);
        let _ = (&mut self.admin).await;
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = tokio::time::timeout(grace, &mut self.serve).await;
        self.serve.abort();
        for t in &self.background {
            t.abort();
        }
        self.sharing.stop();
        for r in self.shared.replicas() {
            // Ends the KV subscribers (the replica's own tasks).
            self.shared.remove_replica(r.id);
        }
        let shared = self.shared.clone();
        let _ = tokio::task::spawn_blocking(move || shared.rows.close()).await;
    }
}

/// Runs the picker until SIGTERM or SIGINT: `SCHED_FIFO` when asked (`sched_fifo_priority`, as
/// the router), a runtime with `cfg.router.workers` threads, the readiness line
/// `{"listening":"GRPC","admin":"HOST:PORT","workers":N,"scheduling":"other"}` on stdout, then a
/// graceful shutdown that flushes the rows. With `cfg.envoy`, Envoy is started in front of the
/// replicas first and the line names its listener:
/// `{"listening":"ENVOY","epp":"GRPC","admin":"…","envoy_admin":"ADMIN","workers":N,"scheduling":…}`;
/// Envoy is killed before the picker shuts down (and with it, should the picker die: it is the
/// picker's child, in its process group, killed on drop).
pub fn run_blocking(cfg: EppConfig) -> Result<(), EppError> {
    let workers = cfg.router.workers.max(1);
    // Before the runtime, as the router does: its threads inherit the policy, and so does the
    // Envoy it starts (a child process keeps its parent's scheduling).
    let scheduling = rt_sched::request_fifo(cfg.router.sched_fifo_priority);
    if let rt_sched::Scheduling::Refused { .. } = &scheduling {
        eprintln!("epp: scheduling {}", scheduling.describe());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()?;
    let grace = Duration::from_millis(cfg.router.shutdown_grace_ms);
    rt.block_on(async move {
        use tokio::signal::unix::{SignalKind, signal};
        // Installed before the readiness line: a supervisor may signal as soon as it read it.
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let launch = cfg.envoy.clone();
        let epp = Epp::start(cfg).await?;
        let envoy = match launch {
            Some(l) => {
                let endpoints = epp
                    .shared()
                    .replicas()
                    .iter()
                    .map(|r| crate::endpoints::endpoint_of(&r.url))
                    .collect::<Result<Vec<_>, _>>()?;
                let mut bootstrap = Bootstrap::new(epp.local_addr(), endpoints);
                bootstrap.listen = l.listen;
                std::fs::create_dir_all(&l.dir)?;
                let envoy =
                    EnvoyProcess::start(&l.bin, &bootstrap, &l.dir, ENVOY_READY_WITHIN).await?;
                Some(envoy)
            }
            None => None,
        };
        let line = match &envoy {
            // The gateway's address is what clients use; the picker's is named beside it.
            Some(e) => serde_json::json!({
                "listening": e.listen_addr().to_string(),
                "epp": epp.local_addr().to_string(),
                "admin": epp.admin_addr().to_string(),
                "envoy_admin": e.admin_addr().to_string(),
                "workers": workers,
                "scheduling": scheduling.describe(),
            }),
            None => serde_json::json!({
                "listening": epp.local_addr().to_string(),
                "admin": epp.admin_addr().to_string(),
                "workers": workers,
                "scheduling": scheduling.describe(),
            }),
        };
        println!("{line}");
        use std::io::Write;
        let _ = std::io::stdout().flush();
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        // Envoy first: no new exchanges, then the picker's rows.
        if let Some(e) = envoy {
            e.kill().await;
        }
        epp.shutdown(grace).await;
        Ok(())
    })
}
