//! Shared router state: the replica table, the policy, and the load accounting.
//!
//! Lock discipline: one `parking_lot::Mutex` holds the policy and the replica table. A routing
//! decision takes it once — snapshot the fleet, `decide`, increment the chosen replica's
//! outstanding — and releases it; nothing else (no I/O, no allocation beyond the scratch vector's
//! first growth) happens inside. Outstanding counters are atomics so the RAII guard can release
//! load without the lock (a decrement can only make a concurrent snapshot more conservative).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use http::uri::{Authority, Scheme};
use parking_lot::Mutex;
use policies::{Decision, Keying, Policy, ReplicaId, ReplicaView, RouteError, RouteRequest};

use crate::config::ReplicaSpec;
use crate::events::{EventEndpoints, EventSink, EventStats, run_subscriber};
use crate::metrics::Metrics;
use crate::rows::RowSink;
use crate::upstream::{Clock, UpstreamClient};

/// Sentinel of [`Replica::kv_usage_bits`]: no usage scraped (a NaN pattern no gauge produces).
pub const NO_KV_USAGE: u32 = u32::MAX;

/// One upstream replica and its live counters.
#[derive(Debug)]
pub struct Replica {
    /// Router-assigned id.
    pub id: ReplicaId,
    /// Base URL as configured.
    pub url: String,
    /// URL scheme.
    pub scheme: Scheme,
    /// URL authority (`host:port`).
    pub authority: Authority,
    /// KV event PUB endpoint.
    pub kv_events: Option<String>,
    /// KV event replay endpoint.
    pub kv_replay: Option<String>,
    /// Requests dispatched and not yet finished.
    pub outstanding: AtomicU32,
    /// Last health verdict (connection refusals also clear it).
    pub healthy: AtomicBool,
    /// Draining: no new requests.
    pub draining: AtomicBool,
    /// Set once removed from the table (in-flight requests may still hold it).
    pub removed: AtomicBool,
    /// Failed upstream attempts and mid-stream failures.
    pub upstream_errors: AtomicU64,
    /// Requests served (response head received).
    pub served: AtomicU64,
    /// The replica has reported `cached_tokens` before, so it runs with prompt-token details on
    /// and a usage without them means 0 cached (vLLM omits zero).
    pub reports_cached_tokens: AtomicBool,
    /// Last scraped KV-cache usage (f32 bits; [`NO_KV_USAGE`] when unknown).
    pub kv_usage_bits: AtomicU32,
    /// Event-stream counters.
    pub events: Arc<EventStats>,
    /// Background tasks (health, events) to stop on removal.
    pub(crate) tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl Replica {
    /// A replica from its spec; fails on a bad URL.
    pub fn new(id: ReplicaId, spec: &ReplicaSpec) -> Result<Self, String> {
        let (scheme, authority) = crate::upstream::parse_base_url(&spec.url)?;
        Ok(Replica {
            id,
            url: spec.url.trim_end_matches('/').to_string(),
            scheme,
            authority,
            kv_events: spec.kv_events.clone(),
            kv_replay: spec.kv_replay.clone(),
            outstanding: AtomicU32::new(0),
            healthy: AtomicBool::new(true),
            draining: AtomicBool::new(false),
            removed: AtomicBool::new(false),
            upstream_errors: AtomicU64::new(0),
            served: AtomicU64::new(0),
            reports_cached_tokens: AtomicBool::new(false),
            kv_usage_bits: AtomicU32::new(NO_KV_USAGE),
            events: Arc::new(EventStats::default()),
            tasks: Mutex::new(Vec::new()),
        })
    }

    /// Eligible for new requests.
    pub fn eligible(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
            && !self.draining.load(Ordering::Relaxed)
            && !self.removed.load(Ordering::Relaxed)
    }

    /// Last scraped KV-cache usage in 0..=1, when known.
    pub fn kv_usage(&self) -> Option<f32> {
        match self.kv_usage_bits.load(Ordering::Relaxed) {
            NO_KV_USAGE => None,
            bits => Some(f32::from_bits(bits)),
        }
    }

    pub(crate) fn stop_tasks(&self) {
        for t in self.tasks.lock().drain(..) {
            t.abort();
        }
    }
}

/// Holds one unit of a replica's outstanding load until dropped (body end, error, or client
/// disconnect — every path out of a request drops it).
#[derive(Debug)]
pub struct LoadGuard {
    replica: Arc<Replica>,
}

impl LoadGuard {
    /// The replica this load is on.
    pub fn replica(&self) -> &Arc<Replica> {
        &self.replica
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.replica.outstanding.fetch_sub(1, Ordering::AcqRel);
    }
}

struct Core {
    policy: Box<dyn Policy>,
    replicas: Vec<Arc<Replica>>,
    views: Vec<ReplicaView>,
}

/// A routing decision with its load already taken.
pub struct Routed {
    /// What the policy decided.
    pub decision: Decision,
    /// Time spent inside `Policy::decide`.
    pub decide_ns: u64,
    /// The load unit on the chosen replica.
    pub guard: LoadGuard,
}

/// State shared by every connection task.
pub struct Shared {
    core: Mutex<Core>,
    /// Policy name (the `policy` row column).
    pub policy_name: String,
    /// What block keys the policy needs.
    pub keying: Keying,
    /// Router-wide counters.
    pub metrics: Metrics,
    /// Row writer.
    pub rows: RowSink,
    /// Upstream client.
    pub client: UpstreamClient,
    /// Router clock.
    pub clock: Clock,
    /// Static settings.
    pub settings: Settings,
    /// Set once shutdown's grace period has passed: requests dropped from then on were cut by
    /// the router, not abandoned by their clients.
    cutting: AtomicBool,
    next_id: AtomicU32,
    request_seq: AtomicU64,
    request_salt: u64,
    tokenize_cursor: AtomicU32,
}

/// Settings the request path reads.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Belief/tokenize model override.
    pub model: Option<String>,
    /// Belief block size, bytes.
    pub block_bytes: usize,
    /// Engine block size, tokens (exact keys).
    pub block_tokens: u32,
    /// Predicted engine tokens per matched belief block (`block_bytes ÷ bytes_per_token`).
    pub belief_tokens_per_block: f64,
    /// Block-0 salt of exact keys (the policy's `salt`).
    pub exact_salt: String,
    /// Request body limit.
    pub max_body_bytes: usize,
    /// Scrape each replica's KV-cache usage with the health checks (the residency branch).
    pub scrape_kv_usage: bool,
}

impl Shared {
    /// Builds the shared state; replicas get ids 0..n in order.
    pub fn new(
        policy: Box<dyn Policy>,
        specs: &[ReplicaSpec],
        rows: RowSink,
        settings: Settings,
        request_salt: u64,
    ) -> Result<Self, String> {
        let replicas = specs
            .iter()
            .enumerate()
            .map(|(i, s)| Replica::new(i as ReplicaId, s).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        let policy_name = policy.name().to_string();
        let keying = policy.keying();
        Ok(Shared {
            core: Mutex::new(Core {
                policy,
                views: Vec::with_capacity(replicas.len()),
                replicas,
            }),
            policy_name,
            keying,
            metrics: Metrics::default(),
            rows,
            client: crate::upstream::client(),
            clock: Clock::new(),
            settings,
            cutting: AtomicBool::new(false),
            next_id: AtomicU32::new(specs.len() as u32),
            request_seq: AtomicU64::new(0),
            request_salt,
            tokenize_cursor: AtomicU32::new(0),
        })
    }

    /// Marks the requests still in flight as cut by the router (shutdown past its grace period).
    pub(crate) fn cut_in_flight(&self) {
        self.cutting.store(true, Ordering::Release);
    }

    /// The row error of a request dropped before it finished, `stage` saying when (`before the
    /// response head`): `shutdown: cut …` once shutdown cuts, else `client: disconnected …`
    /// (counted in `client_disconnects`).
    pub(crate) fn dropped_error(&self, stage: &str) -> String {
        if self.cutting.load(Ordering::Acquire) {
            format!("shutdown: cut {stage}")
        } else {
            self.metrics
                .client_disconnects
                .fetch_add(1, Ordering::Relaxed);
            format!("client: disconnected {stage}")
        }
    }

    /// Decides and takes load, atomically with respect to other decisions.
    pub fn route(&self, req: &RouteRequest<'_>) -> Result<Routed, RouteError> {
        self.route_excluding(req, &[])
    }

    /// Like [`Shared::route`], but the `excluded` replicas (already tried for this request) are
    /// shown to the policy as unhealthy.
    pub fn route_excluding(
        &self,
        req: &RouteRequest<'_>,
        excluded: &[ReplicaId],
    ) -> Result<Routed, RouteError> {
        let mut core = self.core.lock();
        let Core {
            policy,
            replicas,
            views,
        } = &mut *core;
        views.clear();
        views.extend(replicas.iter().map(|r| ReplicaView {
            id: r.id,
            outstanding: r.outstanding.load(Ordering::Acquire),
            healthy: r.healthy.load(Ordering::Relaxed) && !excluded.contains(&r.id),
            draining: r.draining.load(Ordering::Relaxed),
            kv_usage: r.kv_usage(),
        }));
        let t0 = std::time::Instant::now();
        let decision = policy.decide(req, views)?;
        let decide_ns = t0.elapsed().as_nanos() as u64;
        let Some(replica) = replicas.iter().find(|r| r.id == decision.replica) else {
            return Err(RouteError::NoEligibleReplica);
        };
        replica.outstanding.fetch_add(1, Ordering::AcqRel);
        let guard = LoadGuard {
            replica: replica.clone(),
        };
        drop(core);
        Ok(Routed {
            decision,
            decide_ns,
            guard,
        })
    }

    /// Tells the policy which replica actually got the request.
    pub fn served(&self, req: &RouteRequest<'_>, replica: ReplicaId) {
        self.core.lock().policy.on_served(req, replica);
    }

    /// A snapshot of the replica table.
    pub fn replicas(&self) -> Vec<Arc<Replica>> {
        self.core.lock().replicas.clone()
    }

    /// The replica with `id`, if present.
    pub fn replica(&self, id: ReplicaId) -> Option<Arc<Replica>> {
        self.core
            .lock()
            .replicas
            .iter()
            .find(|r| r.id == id)
            .cloned()
    }

    /// Adds a replica with the next unused id.
    pub fn add_replica(&self, spec: &ReplicaSpec) -> Result<Arc<Replica>, String> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let r = Arc::new(Replica::new(id, spec)?);
        self.core.lock().replicas.push(r.clone());
        Ok(r)
    }

    /// Removes a replica: no new requests; in-flight ones finish on their own guards.
    pub fn remove_replica(&self, id: ReplicaId) -> Option<Arc<Replica>> {
        let mut core = self.core.lock();
        let pos = core.replicas.iter().position(|r| r.id == id)?;
        let r = core.replicas.remove(pos);
        r.removed.store(true, Ordering::Relaxed);
        core.policy.on_replica_removed(id);
        drop(core);
        r.stop_tasks();
        Some(r)
    }

    /// Applies engine KV events from `replica` to the policy.
    pub fn kv_events(&self, replica: ReplicaId, events: &[kv_index::KvEvent]) {
        if events.is_empty() {
            return;
        }
        let now_us = self.clock.now_us();
        let mut core = self.core.lock();
        for e in events {
            core.policy.on_kv_event(replica, e, now_us);
        }
    }

    /// A fresh request id: unique within the process, unpredictable across runs.
    pub fn new_request_id(&self) -> String {
        let n = self.request_seq.fetch_add(1, Ordering::Relaxed);
        format!("kvr-{:016x}", splitmix64(n ^ self.request_salt))
    }

    /// The replica to ask for `/tokenize`: the next eligible one in turn (all replicas serve the
    /// same model, so any tokenizer will do; rotating spreads the round trips).
    pub fn tokenizer_replica(&self) -> Option<Arc<Replica>> {
        let reps = self.replicas();
        if reps.is_empty() {
            return None;
        }
        let start = self.tokenize_cursor.fetch_add(1, Ordering::Relaxed) as usize;
        (0..reps.len())
            .map(|i| &reps[(start + i) % reps.len()])
            .find(|r| r.eligible())
            .cloned()
    }
}

/// Routes a replica's decoded events into the shared policy.
pub struct ReplicaEventSink {
    /// The router state.
    pub shared: std::sync::Weak<Shared>,
    /// Which replica the events come from.
    pub replica: ReplicaId,
}

impl EventSink for ReplicaEventSink {
    fn apply(&self, events: &[kv_index::KvEvent]) {
        if let Some(s) = self.shared.upgrade() {
            s.kv_events(self.replica, events);
        }
    }
}

/// How long [`start_replica_tasks`] waits for a KV event subscriber to connect before going on
/// (the subscriber keeps retrying in the background).
const SUBSCRIBE_WAIT: Duration = Duration::from_secs(2);

/// Starts a replica's KV event subscriber (if it has an endpoint), waiting briefly for it to
/// connect; `Replica::stop_tasks` ends it. Called at startup (server) and when the admin API
/// adds a replica (service).
pub async fn start_replica_tasks(shared: &Arc<Shared>, r: &Arc<Replica>) {
    let Some(publisher) = r.kv_events.clone() else {
        return;
    };
    let ep = EventEndpoints {
        publisher,
        replay: r.kv_replay.clone(),
    };
    let sink = Arc::new(ReplicaEventSink {
        shared: Arc::downgrade(shared),
        replica: r.id,
    });
    let (tx, rx) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(run_subscriber(ep, sink, r.events.clone(), Some(tx)));
    r.tasks.lock().push(task);
    let _ = tokio::time::timeout(SUBSCRIBE_WAIT, rx).await;
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}
