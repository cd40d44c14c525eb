//! Shared router state: the replica table, the policy, and the load accounting.
//!
//! Lock discipline: one `parking_lot::Mutex` holds the policy and the replica table. A routing
//! decision takes it once — snapshot the fleet, `decide`, increment the chosen replica's
//! outstanding — and releases it; nothing else (no I/O, no allocation beyond the scratch vector's
//! first growth) happens inside. Outstanding counters are atomics so the RAII guard can release
//! load without the lock (a decrement can only make a concurrent snapshot more conservative).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use http::uri::{Authority, Scheme};
use parking_lot::Mutex;
use policies::{
    Decision, Keying, Policy, ReplicaId, ReplicaView, RouteError, RouteRequest, ServedNeeds,
};

use crate::config::ReplicaSpec;
use crate::events::{EventEndpoints, EventSink, EventStats, run_subscriber};
use crate::metrics::Metrics;
use crate::rows::RowSink;
use crate::sharing::{Publisher, SharingStats};
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
    /// Requests the peer routers last reported in flight on this replica, summed over peers
    /// (the shared load view, [`crate::sharing`]; 0 without `--share-loads`). Policies see
    /// `outstanding + peer_outstanding`; the in-flight ceiling counts only this router's own.
    pub peer_outstanding: AtomicU32,
    /// In rotation as far as health goes: cleared after `health_fails_to_down` consecutive
    /// failures (probes and requests alike), set again after `health_oks_to_up` consecutive
    /// passing probes ([`Replica::record_failure`], [`Replica::record_probe`]).
    pub healthy: AtomicBool,
    /// Consecutive failures since the last success (probe or request).
    pub fail_streak: AtomicU32,
    /// Consecutive passing probes while down.
    pub ok_streak: AtomicU32,
    /// Times health marked the replica down.
    pub marked_down: AtomicU64,
    /// Times health marked the replica up again.
    pub marked_up: AtomicU64,
    /// Health probes that passed.
    pub probes_ok: AtomicU64,
    /// Health probes that failed (error status, refused, or past the probe timeout).
    pub probes_failed: AtomicU64,
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
            peer_outstanding: AtomicU32::new(0),
            healthy: AtomicBool::new(true),
            fail_streak: AtomicU32::new(0),
            ok_streak: AtomicU32::new(0),
            marked_down: AtomicU64::new(0),
            marked_up: AtomicU64::new(0),
            probes_ok: AtomicU64::new(0),
            probes_failed: AtomicU64::new(0),
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

    /// Counts one failure (a failed probe, or a request the replica failed: refused connection,
    /// no response head in time, a reset, a stream cut or stalled). The `fails_to_down`-th in a
    /// row marks a healthy replica down; true when this call did.
    pub fn record_failure(&self, fails_to_down: u32) -> bool {
        self.ok_streak.store(0, Ordering::Relaxed);
        let streak = self
            .fail_streak
            .fetch_add(1, Ordering::AcqRel)
            .saturating_add(1);
        if streak >= fails_to_down.max(1) && self.healthy.swap(false, Ordering::AcqRel) {
            self.marked_down.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        false
    }

    /// A request the replica answered (its response head arrived): ends a failure streak. It
    /// does not bring a down replica back (only probes do); a down replica gets no new
    /// requests anyway. One relaxed load on the request path when there is no streak.
    pub fn record_request_ok(&self) {
        if self.fail_streak.load(Ordering::Relaxed) != 0 {
            self.fail_streak.store(0, Ordering::Relaxed);
        }
    }

    /// Counts one health probe: a failure goes through [`Replica::record_failure`]; a pass ends
    /// the failure streak and, on a down replica, the `oks_to_up`-th pass in a row marks it up.
    /// Returns the health after the probe.
    pub fn record_probe(&self, ok: bool, fails_to_down: u32, oks_to_up: u32) -> bool {
        if !ok {
            self.probes_failed.fetch_add(1, Ordering::Relaxed);
            self.record_failure(fails_to_down);
            return self.healthy.load(Ordering::Acquire);
        }
        self.probes_ok.fetch_add(1, Ordering::Relaxed);
        self.fail_streak.store(0, Ordering::Relaxed);
        if self.healthy.load(Ordering::Acquire) {
            return true;
        }
        let streak = self
            .ok_streak
            .fetch_add(1, Ordering::AcqRel)
            .saturating_add(1);
        if streak >= oks_to_up.max(1) && !self.healthy.swap(true, Ordering::AcqRel) {
            self.ok_streak.store(0, Ordering::Relaxed);
            self.marked_up.fetch_add(1, Ordering::Relaxed);
        }
        self.healthy.load(Ordering::Acquire)
    }

    pub(crate) fn stop_tasks(&self) {
        for t in self.tasks.lock().drain(..) {
            t.abort();
        }
    }
}

/// The replica in `table` whose base URL is `url` (a trailing `/` ignored): how a peer's
/// message, which names replicas by URL, finds this router's.
pub fn find_by_url<'a>(table: &'a [Arc<Replica>], url: &str) -> Option<&'a Arc<Replica>> {
    let url = url.trim_end_matches('/');
    table.iter().find(|r| r.url == url)
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

/// Why no replica could take a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoRoute {
    /// The policy found no eligible replica (none healthy, all draining or already tried).
    Policy(RouteError),
    /// Eligible replicas exist, but every one is at the per-replica in-flight ceiling.
    AtCeiling(u32),
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
    /// When the policy's `on_served` has an effect (the lock it takes is skipped otherwise).
    served_needs: ServedNeeds,
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
    /// Decision-sharing counters (`kvroute_shared_decisions_*`; zero when not sharing).
    pub sharing: Arc<SharingStats>,
    /// Where served decisions are published, once [`crate::sharing::start`] installed it.
    publisher: OnceLock<Publisher>,
    /// API keys and limits, once [`Shared::install_keys`] installed them (the router only).
    keys: OnceLock<Arc<crate::keys::ApiKeys>>,
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
    /// Which engine publishes the replicas' KV events.
    pub kv_events_format: crate::events::EventFormat,
    /// Request body limit.
    pub max_body_bytes: usize,
    /// Scrape each replica's KV-cache usage with the health checks (the residency branch).
    pub scrape_kv_usage: bool,
    /// Client body deadline, from the moment the head is in.
    pub body_read_timeout: Duration,
    /// Upstream response-head deadline, from dispatch.
    pub upstream_head_timeout: Duration,
    /// Longest silence between two upstream body frames.
    pub upstream_idle_timeout: Duration,
    /// Consecutive failures that mark a replica down.
    pub health_fails_to_down: u32,
    /// Consecutive passing probes that mark it up.
    pub health_oks_to_up: u32,
    /// Per-replica in-flight ceiling (`u32::MAX` = none).
    pub max_in_flight_per_replica: u32,
    /// Pool upstream connections (`RouterConfig::upstream_keep_alive`).
    pub upstream_keep_alive: bool,
    /// Probe token parity before a replica takes traffic (`RouterConfig::token_parity_check`).
    pub token_parity_check: bool,
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
        let served_needs = policy.served_needs();
        Ok(Shared {
            core: Mutex::new(Core {
                policy,
                views: Vec::with_capacity(replicas.len()),
                replicas,
            }),
            policy_name,
            keying,
            served_needs,
            metrics: Metrics::default(),
            rows,
            client: crate::upstream::client(settings.upstream_keep_alive),
            clock: Clock::new(),
            settings,
            sharing: Arc::default(),
            publisher: OnceLock::new(),
            keys: OnceLock::new(),
            cutting: AtomicBool::new(false),
            next_id: AtomicU32::new(specs.len() as u32),
            request_seq: AtomicU64::new(0),
            request_salt,
            tokenize_cursor: AtomicU32::new(0),
        })
    }

    /// Makes the serving port require these API keys and apply their limits (once; a second
    /// call changes nothing).
    pub fn install_keys(&self, keys: Arc<crate::keys::ApiKeys>) {
        let _ = self.keys.set(keys);
    }

    /// The API keys, when the router requires them.
    pub fn keys(&self) -> Option<&Arc<crate::keys::ApiKeys>> {
        self.keys.get()
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
    pub fn route(&self, req: &RouteRequest<'_>) -> Result<Routed, NoRoute> {
        self.route_excluding(req, &[])
    }

    /// Like [`Shared::route`], but the `excluded` replicas (already tried for this request) are
    /// shown to the policy as unhealthy, and so are replicas at the in-flight ceiling.
    pub fn route_excluding(
        &self,
        req: &RouteRequest<'_>,
        excluded: &[ReplicaId],
    ) -> Result<Routed, NoRoute> {
        let ceiling = self.settings.max_in_flight_per_replica;
        let mut at_ceiling = 0u32;
        let mut core = self.core.lock();
        let Core {
            policy,
            replicas,
            views,
        } = &mut *core;
        views.clear();
        views.extend(replicas.iter().map(|r| {
            let outstanding = r.outstanding.load(Ordering::Acquire);
            let mut healthy = r.healthy.load(Ordering::Relaxed) && !excluded.contains(&r.id);
            let draining = r.draining.load(Ordering::Relaxed);
            if healthy && !draining && outstanding >= ceiling {
                // Full: not eligible for this request, like a replica already tried.
                at_ceiling += 1;
                healthy = false;
            }
            ReplicaView {
                id: r.id,
                // The fleet's load as far as this router knows it: its own plus what its peers
                // last reported (zero unless loads are shared).
                outstanding: outstanding.saturating_add(r.peer_outstanding.load(Ordering::Relaxed)),
                healthy,
                draining,
                kv_usage: r.kv_usage(),
            }
        }));
        let t0 = std::time::Instant::now();
        let decided = policy.decide(req, views);
        let decide_ns = t0.elapsed().as_nanos() as u64;
        let decision = match decided {
            Ok(d) => d,
            Err(_) if at_ceiling > 0 => return Err(NoRoute::AtCeiling(ceiling)),
            Err(e) => return Err(NoRoute::Policy(e)),
        };
        let Some(replica) = replicas.iter().find(|r| r.id == decision.replica) else {
            return Err(NoRoute::Policy(RouteError::NoEligibleReplica));
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

    /// Takes one unit of `replica`'s outstanding load outside a decision: the endpoint picker
    /// moves a request's load here when the proxy served it from a fallback endpoint.
    pub fn take_load(&self, replica: &Arc<Replica>) -> LoadGuard {
        replica.outstanding.fetch_add(1, Ordering::AcqRel);
        LoadGuard {
            replica: replica.clone(),
        }
    }

    /// Tells the policy which replica actually got the request (`decided` is the one its
    /// decision chose; a retry may have moved it), and, when sharing decisions, queues it for
    /// the peers (never waiting: see [`Publisher::offer`]). Takes the policy's lock only when
    /// the policy's `on_served` can change something ([`policies::Policy::served_needs`]):
    /// for every policy but a retried belief request, a request costs one lock, its decision's.
    pub fn served(&self, req: &RouteRequest<'_>, decided: ReplicaId, replica: &Arc<Replica>) {
        if self.served_needs.call(decided, replica.id) {
            self.core.lock().policy.on_served(req, replica.id);
        }
        if let Some(p) = self.publisher.get()
            && !req.block_keys.is_empty()
        {
            p.offer(replica.clone(), req.block_keys);
        }
    }

    /// Installs the decision publisher (once; [`crate::sharing::start`] does it). Gives it back
    /// when one is already installed.
    pub fn set_publisher(&self, publisher: Publisher) -> Result<(), Publisher> {
        self.publisher.set(publisher)
    }

    /// A peer router served a request with `block_keys` on the replica whose base URL is
    /// `replica_url`: hands it to the policy ([`policies::Policy::on_peer_served`]) with this
    /// router's clock as the time. False when no replica here has that URL.
    pub fn peer_served(&self, replica_url: &str, block_keys: &[u64]) -> bool {
        let now_us = self.clock.now_us();
        let mut core = self.core.lock();
        let Some(id) = find_by_url(&core.replicas, replica_url).map(|r| r.id) else {
            return false;
        };
        core.policy.on_peer_served(block_keys, id, now_us);
        true
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
        // Under the lock without copying the table: one `Arc` clone per request.
        let core = self.core.lock();
        let reps = &core.replicas;
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
        format: shared.settings.kv_events_format,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn replica() -> Replica {
        Replica::new(0, &ReplicaSpec::new("http://127.0.0.1:1")).unwrap()
    }

    #[test]
    fn health_needs_n_failures_down_and_m_probes_up() {
        let r = replica();
        // Two failures, then a request answered: the streak starts over.
        assert!(!r.record_failure(3));
        assert!(!r.record_failure(3));
        r.record_request_ok();
        assert!(!r.record_failure(3));
        assert!(!r.record_failure(3));
        assert!(r.healthy.load(Ordering::Relaxed));
        // A passing probe ends a streak too; then three failures in a row (probe, requests).
        assert!(r.record_probe(true, 3, 2));
        assert!(r.record_probe(false, 3, 2));
        assert!(!r.record_failure(3));
        assert!(
            r.record_failure(3),
            "the third failure in a row marks it down"
        );
        assert!(!r.healthy.load(Ordering::Relaxed));
        assert!(!r.record_failure(3), "already down: no second transition");
        // Up again only after two passing probes in a row; a failed one restarts the count.
        assert!(!r.record_probe(true, 3, 2));
        assert!(!r.record_probe(false, 3, 2));
        assert!(!r.record_probe(true, 3, 2));
        r.record_request_ok();
        assert!(
            !r.healthy.load(Ordering::Relaxed),
            "requests do not bring it back"
        );
        assert!(r.record_probe(true, 3, 2));
        assert_eq!(r.marked_down.load(Ordering::Relaxed), 1);
        assert_eq!(r.marked_up.load(Ordering::Relaxed), 1);
        assert_eq!(r.probes_failed.load(Ordering::Relaxed), 2);
        assert_eq!(r.probes_ok.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn thresholds_of_one_act_at_once() {
        let r = replica();
        assert!(r.record_failure(1));
        assert!(r.record_probe(true, 1, 1));
    }
}
