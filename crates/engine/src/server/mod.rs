//! The HTTP and ZMQ surface of an emulated replica (tokio + hyper; the only async code here).
//!
//! [`start`] binds the listener and the KV event sockets, spawns the engine thread
//! ([`engine_loop`]) and the accept loop, and returns a [`Server`] handle whose
//! [`Server::readiness_line`] is what the `engine` binary prints once it accepts connections.

pub mod api;
pub mod engine_loop;
pub mod events;
pub mod metrics;
pub mod sched;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Method, Response, StatusCode, header};
use http_body_util::{BodyExt, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot, watch};

use self::api::{ApiError, Formatter, GenRequest, Kind};
use self::engine_loop::{Clock, Command, Emit};
pub use self::events::KvEventsConfig;
use self::metrics::MetricsState;
use crate::config::{CacheModel, EngineConfig};
use crate::core::{Engine, RequestId};

/// Everything one emulated replica needs to start.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Listen address host (`127.0.0.1` by default).
    pub host: String,
    /// Listen port; 0 picks an ephemeral one.
    pub port: u16,
    /// Model names accepted in requests; the first is reported in responses and `/v1/models`.
    pub served_model_names: Vec<String>,
    /// The model path/name (`root` in `/v1/models`).
    pub model: String,
    /// Engine core configuration.
    pub engine: EngineConfig,
    /// Report `prompt_tokens_details.cached_tokens` in usage (vLLM's flag).
    pub enable_prompt_tokens_details: bool,
    /// KV event publishing; `None` disables it.
    pub kv_events: Option<KvEventsConfig>,
    /// Largest accepted request body, bytes.
    pub max_body_bytes: usize,
    /// How the process's threads are scheduled (the binary asks before it builds the runtime;
    /// see [`sched`]); reported in the readiness line and `/metrics`.
    pub scheduling: sched::Scheduling,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".to_owned(),
            port: 0,
            served_model_names: vec![DEFAULT_MODEL.to_owned()],
            model: DEFAULT_MODEL.to_owned(),
            engine: EngineConfig::default(),
            enable_prompt_tokens_details: false,
            kv_events: None,
            max_body_bytes: 32 << 20,
            scheduling: sched::Scheduling::Other,
        }
    }
}

/// The model name the emulator serves unless told otherwise.
pub const DEFAULT_MODEL: &str = "kvroute/emulated-8b";

struct AppState {
    served: Vec<String>,
    model: String,
    engine_cfg: EngineConfig,
    details: bool,
    max_body_bytes: usize,
    cmd: std::sync::mpsc::Sender<Command>,
    metrics: Arc<Mutex<MetricsState>>,
    clock: Clock,
    next_id: AtomicU64,
    created: u64,
    engine_thread: Arc<std::thread::JoinHandle<()>>,
}

/// A running replica. Dropping it stops the engine thread; [`Server::shutdown`] also waits.
pub struct Server {
    addr: SocketAddr,
    cache_model: CacheModel,
    kv_events: Option<String>,
    kv_replay: Option<String>,
    scheduling: sched::Scheduling,
    shutdown_tx: watch::Sender<bool>,
    cmd: std::sync::mpsc::Sender<Command>,
    metrics: Arc<Mutex<MetricsState>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Invalid engine configuration.
    #[error("invalid configuration: {0}")]
    Config(#[from] engine_core::ConfigError),
    /// No `--served-model-name` (nor `--model`).
    #[error("invalid configuration: at least one served model name is needed")]
    NoServedModel,
    /// KV events asked of the llama-slots cache model.
    #[error(
        "invalid configuration: the llama-slots cache model records no KV events (llama.cpp's llama-server publishes none): drop --kv-events-config/--kv-events-port"
    )]
    EventsWithoutPagedCache,
    /// The engine thread could not be spawned.
    #[error("invalid configuration: cannot spawn the engine thread: {0}")]
    Thread(std::io::Error),
    /// The HTTP listener could not bind.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// Address tried.
        addr: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A KV event socket could not be set up.
    #[error(transparent)]
    Events(#[from] events::EventsError),
}

impl Server {
    /// The HTTP address actually bound.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The KV event PUB endpoint, when events are on.
    pub fn kv_events_endpoint(&self) -> Option<&str> {
        self.kv_events.as_deref()
    }

    /// The KV replay endpoint, when replay is on.
    pub fn kv_replay_endpoint(&self) -> Option<&str> {
        self.kv_replay.as_deref()
    }

    /// The one JSON line the binary prints once it accepts connections (docs/CONTRACTS.md).
    pub fn readiness_line(&self) -> String {
        // Written by hand to keep the documented key order (serde_json sorts object keys).
        let opt = |v: &Option<String>| serde_json::to_string(v).expect("string or null");
        format!(
            "{{\"listening\":{},\"kv_events\":{},\"kv_replay\":{},\"scheduling\":{},\"cache_model\":\"{}\"}}",
            serde_json::to_string(&self.addr.to_string()).expect("string"),
            opt(&self.kv_events),
            opt(&self.kv_replay),
            serde_json::to_string(&self.scheduling.describe()).expect("string"),
            self.cache_model.name()
        )
    }

    /// A copy of the metrics state (counters, gauges, histograms).
    pub fn metrics(&self) -> MetricsState {
        self.metrics.lock().expect("metrics lock").clone()
    }

    /// The block hashes now in the engine's prefix cache (what KV events should reconstruct).
    pub async fn cached_block_hashes(&self) -> Option<std::collections::HashSet<u64>> {
        let (tx, rx) = oneshot::channel();
        self.cmd.send(Command::CachedHashes(tx)).ok()?;
        rx.await.ok()
    }

    /// Stops accepting, stops the engine thread and waits for the background tasks.
    pub async fn shutdown(mut self) {
        let _ = self.shutdown_tx.send(true);
        let _ = self.cmd.send(Command::Shutdown);
        for t in self.tasks.drain(..) {
            t.abort();
            let _ = t.await;
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.shutdown_tx.send(true);
        let _ = self.cmd.send(Command::Shutdown);
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Starts a replica: binds, spawns the engine thread and the accept loop.
pub async fn start(cfg: ServerConfig) -> Result<Server, StartError> {
    if cfg.served_model_names.is_empty() {
        return Err(StartError::NoServedModel);
    }
    if cfg.kv_events.is_some() && cfg.engine.cache_model != CacheModel::Paged {
        return Err(StartError::EventsWithoutPagedCache);
    }
    let mut engine_cfg = cfg.engine.clone();
    engine_cfg.enable_kv_events = cfg.kv_events.is_some();
    let engine = Engine::new(engine_cfg.clone())?;
    let addr = format!("{}:{}", cfg.host, cfg.port);
    let listener = TcpListener::bind(&addr)
        .await
        .map_err(|source| StartError::Listen {
            addr: addr.clone(),
            source,
        })?;
    let local = listener
        .local_addr()
        .map_err(|source| StartError::Listen { addr, source })?;

    let mut tasks = Vec::new();
    let (events_tx, kv_events, kv_replay) = match &cfg.kv_events {
        None => (None, None, None),
        Some(ec) => {
            let (tx, rx) = mpsc::unbounded_channel();
            let p = events::start(ec, rx).await?;
            tasks.extend(p.tasks);
            (Some(tx), Some(p.endpoint), p.replay_endpoint)
        }
    };

    let clock = Clock::start();
    let metrics = Arc::new(Mutex::new(MetricsState {
        sched_fifo_priority: cfg.scheduling.fifo_priority(),
        ..MetricsState::default()
    }));
    let (cmd_tx, cmd_rx) = std::sync::mpsc::channel();
    let thread_metrics = metrics.clone();
    let thread_scheduling = cfg.scheduling.clone();
    let engine_thread = std::thread::Builder::new()
        .name("engine-core".into())
        .spawn(move || {
            // One level above the HTTP workers: a step deadline preempts token streaming.
            if let sched::Scheduling::Fifo(p) = thread_scheduling {
                let _ = sched::request_fifo(p.saturating_add(1).min(99));
            }
            engine_loop::run(engine, cmd_rx, clock, thread_metrics, events_tx)
        })
        .map_err(StartError::Thread)?;

    let state = Arc::new(AppState {
        served: cfg.served_model_names.clone(),
        model: cfg.model.clone(),
        engine_cfg,
        details: cfg.enable_prompt_tokens_details,
        max_body_bytes: cfg.max_body_bytes,
        cmd: cmd_tx.clone(),
        metrics: metrics.clone(),
        clock,
        next_id: AtomicU64::new(1),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        engine_thread: Arc::new(engine_thread),
    });
    let (shutdown_tx, mut shutdown_rx) = watch::channel(false);
    tasks.push(tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = shutdown_rx.changed() => return,
                acc = listener.accept() => {
                    let Ok((stream, _)) = acc else { continue };
                    let _ = stream.set_nodelay(true);
                    let st = state.clone();
                    tokio::spawn(async move {
                        let svc = service_fn(move |req| handle(req, st.clone()));
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), svc)
                            .await;
                    });
                }
            }
        }
    }));
    Ok(Server {
        addr: local,
        cache_model: cfg.engine.cache_model,
        kv_events,
        kv_replay,
        scheduling: cfg.scheduling.clone(),
        shutdown_tx,
        cmd: cmd_tx,
        metrics,
        tasks,
    })
}

/// Response body: a whole buffer, or an SSE stream fed by the engine thread.
pub enum RespBody {
    /// A complete body.
    Full(Option<Bytes>),
    /// A token stream.
    Sse(Box<SseBody>),
}

/// Streams one request's tokens as SSE; aborts the request if dropped before it finished.
pub struct SseBody {
    rx: mpsc::UnboundedReceiver<Emit>,
    fmt: Formatter,
    queue: VecDeque<Bytes>,
    done: bool,
    guard: AbortGuard,
}

impl Body for RespBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            RespBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            RespBody::Sse(s) => loop {
                if let Some(b) = s.queue.pop_front() {
                    return Poll::Ready(Some(Ok(Frame::data(b))));
                }
                if s.done {
                    return Poll::Ready(None);
                }
                match s.rx.poll_recv(cx) {
                    Poll::Ready(Some(e)) => {
                        if s.fmt.on_emit_stream(e, &mut s.queue) {
                            s.done = true;
                            s.guard.finished = true;
                        }
                    }
                    Poll::Ready(None) => {
                        Formatter::stream_error(&mut s.queue, "the engine stopped this request");
                        s.done = true;
                        s.guard.finished = true;
                    }
                    Poll::Pending => return Poll::Pending,
                }
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RespBody::Full(b) => b.is_none(),
            RespBody::Sse(s) => s.done && s.queue.is_empty(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RespBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            RespBody::Full(None) => SizeHint::with_exact(0),
            RespBody::Sse(_) => SizeHint::default(),
        }
    }
}

/// Sends `Abort` to the engine when a response goes away before its request finished
/// (a client disconnect drops the body or the handler future).
struct AbortGuard {
    id: RequestId,
    cmd: std::sync::mpsc::Sender<Command>,
    finished: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.cmd.send(Command::Abort(self.id));
        }
    }
}

fn full(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<RespBody> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, content_type)
        .body(RespBody::Full(Some(body.into())))
        .expect("static response parts are valid")
}

fn json_response(status: StatusCode, body: String) -> Response<RespBody> {
    full(status, "application/json", body)
}

fn error_response(e: &ApiError) -> Response<RespBody> {
    json_response(
        StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST),
        e.body(),
    )
}

async fn read_body(req: hyper::Request<Incoming>, limit: usize) -> Result<Bytes, ApiError> {
    Limited::new(req.into_body(), limit)
        .collect()
        .await
        .map(|c| c.to_bytes())
        .map_err(|e| ApiError::bad_request(format!("Cannot read the request body: {e}")))
}

async fn handle(
    req: hyper::Request<Incoming>,
    st: Arc<AppState>,
) -> Result<Response<RespBody>, Infallible> {
    let arrival_us = st.clock.now_us();
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    let resp = match (method.clone(), path.as_str()) {
        (Method::GET, "/health") => {
            if st.engine_thread.is_finished() {
                full(StatusCode::SERVICE_UNAVAILABLE, "text/plain", Bytes::new())
            } else {
                full(StatusCode::OK, "text/plain", Bytes::new())
            }
        }
        (Method::GET, "/version") => json_response(
            StatusCode::OK,
            json!({"version": concat!("kvroute-emulator-", env!("CARGO_PKG_VERSION"))}).to_string(),
        ),
        (Method::GET, "/v1/models") => json_response(StatusCode::OK, models_json(&st)),
        (Method::GET, "/metrics") => {
            // Copy under the lock, render outside it: the engine thread takes this lock per step.
            let snapshot = st.metrics.lock().expect("metrics lock").clone();
            // Under llama-slots the cache is `ctx_tokens` cells of one token each.
            let (block_size, num_gpu_blocks) = match st.engine_cfg.cache_model {
                CacheModel::Paged => (st.engine_cfg.block_size, st.engine_cfg.num_gpu_blocks),
                CacheModel::LlamaSlots { ctx_tokens, .. } => (1, ctx_tokens),
            };
            let mut text = metrics::render(&snapshot, &st.served[0], block_size, num_gpu_blocks);
            metrics::render_cache_model(&mut text, &st.engine_cfg.cache_model);
            full(
                StatusCode::OK,
                "text/plain; version=0.0.4; charset=utf-8",
                text,
            )
        }
        (Method::POST, "/reset_prefix_cache") => {
            let (tx, rx) = oneshot::channel();
            let _ = st.cmd.send(Command::Reset(tx));
            match rx.await {
                Ok(true) => full(StatusCode::OK, "text/plain", Bytes::new()),
                Ok(false) => error_response(&ApiError {
                    status: 409,
                    message: "Failed to reset prefix cache: some blocks are still in use by running requests".into(),
                    kind: "ConflictError",
                }),
                Err(_) => error_response(&engine_dead()),
            }
        }
        (Method::POST, "/tokenize") => match read_body(req, st.max_body_bytes).await {
            Err(e) => error_response(&e),
            Ok(body) => {
                frontend_delay(&st).await;
                match api::tokenize(&body, &st.served, st.engine_cfg.max_model_len) {
                    Ok(v) => json_response(StatusCode::OK, v.to_string()),
                    Err(e) => error_response(&e),
                }
            }
        },
        (Method::POST, "/v1/completions/render" | "/v1/chat/completions/render") => {
            let kind = if path.contains("chat") {
                Kind::Chat
            } else {
                Kind::Completion
            };
            match read_body(req, st.max_body_bytes).await {
                Err(e) => error_response(&e),
                Ok(body) => {
                    frontend_delay(&st).await;
                    match render(kind, &body, &st.served) {
                        Ok(s) => json_response(StatusCode::OK, s),
                        Err(e) => error_response(&e),
                    }
                }
            }
        }
        (Method::POST, "/v1/completions" | "/v1/chat/completions") => {
            let kind = if path.contains("chat") {
                Kind::Chat
            } else {
                Kind::Completion
            };
            let request_id = req
                .headers()
                .get("x-request-id")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            match read_body(req, st.max_body_bytes).await {
                Err(e) => error_response(&e),
                Ok(body) => match api::parse_generate(kind, &body, &st.served, &st.engine_cfg) {
                    Err(e) => error_response(&e),
                    Ok(g) => generate(&st, g, request_id, arrival_us).await,
                },
            }
        }
        (
            _,
            "/health"
            | "/version"
            | "/v1/models"
            | "/metrics"
            | "/reset_prefix_cache"
            | "/tokenize"
            | "/v1/completions"
            | "/v1/chat/completions"
            | "/v1/completions/render"
            | "/v1/chat/completions/render",
        ) => json_response(
            StatusCode::METHOD_NOT_ALLOWED,
            json!({"detail": "Method Not Allowed"}).to_string(),
        ),
        _ => json_response(
            StatusCode::NOT_FOUND,
            json!({"detail": "Not Found"}).to_string(),
        ),
    };
    Ok(resp)
}

fn engine_dead() -> ApiError {
    ApiError {
        status: 503,
        message: "The engine is not running".into(),
        kind: "ServiceUnavailableError",
    }
}

/// The tokenize and render endpoints cost modelled frontend time (26 ms p50 measured under
/// load on the reference fleet), which the exact-residency policy pays before every decision.
async fn frontend_delay(st: &AppState) {
    let us = st.engine_cfg.model.tokenize_us();
    if us > 0 {
        tokio::time::sleep(std::time::Duration::from_micros(us)).await;
    }
}

fn render(kind: Kind, body: &[u8], served: &[String]) -> Result<String, ApiError> {
    let m: serde_json::Map<String, serde_json::Value> = match serde_json::from_slice(body) {
        Ok(serde_json::Value::Object(m)) => m,
        Ok(_) => {
            return Err(ApiError::bad_request(
                "The request body must be a JSON object",
            ));
        }
        Err(e) => return Err(ApiError::bad_request(format!("Invalid JSON body: {e}"))),
    };
    api::check_model(&m, served)?;
    Ok(match kind {
        Kind::Completion => json!([{"token_ids": api::completion_prompt(&m)?}]).to_string(),
        Kind::Chat => json!({"token_ids": api::chat_prompt(&m)?}).to_string(),
    })
}

fn models_json(st: &AppState) -> String {
    let data: Vec<_> = st
        .served
        .iter()
        .map(|name| {
            json!({
                "id": name, "object": "model", "created": st.created, "owned_by": "vllm",
                "root": st.model, "parent": null, "max_model_len": st.engine_cfg.max_model_len,
                "permission": [],
            })
        })
        .collect();
    json!({"object": "list", "data": data}).to_string()
}

async fn generate(
    st: &Arc<AppState>,
    g: GenRequest,
    request_id: Option<String>,
    arrival_us: u64,
) -> Response<RespBody> {
    let id = st.next_id.fetch_add(1, Ordering::Relaxed);
    let base = request_id.unwrap_or_else(|| {
        format!(
            "{:032x}",
            xxhash_rust::xxh3::xxh3_128(&id.to_le_bytes()) ^ u128::from(st.created)
        )
    });
    let resp_id = match g.kind {
        Kind::Completion => format!("cmpl-{base}"),
        Kind::Chat => format!("chatcmpl-{base}"),
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    let guard = AbortGuard {
        id,
        cmd: st.cmd.clone(),
        finished: false,
    };
    let model = st.served[0].clone();
    let mut fmt = Formatter::new(g.kind, &resp_id, st.created, &model, st.details, &g);
    if st
        .cmd
        .send(Command::Add {
            id,
            prompt: g.prompt,
            params: g.params,
            arrival_us,
            tx,
        })
        .is_err()
    {
        return error_response(&engine_dead());
    }
    if g.stream {
        let body = SseBody {
            rx,
            fmt,
            queue: VecDeque::new(),
            done: false,
            guard,
        };
        return Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
            .header(header::CACHE_CONTROL, "no-cache")
            .body(RespBody::Sse(Box::new(body)))
            .expect("static response parts are valid");
    }
    let mut guard = guard;
    loop {
        match rx.recv().await {
            Some(e) => {
                if fmt.absorb(e) {
                    guard.finished = true;
                    return json_response(
                        StatusCode::OK,
                        fmt.final_json(&resp_id, st.created, &model),
                    );
                }
            }
            None => {
                guard.finished = true;
                return error_response(&ApiError {
                    status: 500,
                    message: "the engine stopped this request".into(),
                    kind: "InternalServerError",
                });
            }
        }
    }
}
