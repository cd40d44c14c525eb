//! Decision sharing between routers: N routers in front of one fleet each publish their routing
//! decisions and insert their peers' into their own believed index, so a prefix-affinity router
//! sees the whole fleet's traffic rather than its 1/N share (issue #19, the sharing arm).
//!
//! Transport: ZMQ PUB/SUB, as the engines' KV events ([`crate::events`]). A router binds one PUB
//! socket (`--share-decisions-bind`) and subscribes to each peer's (`--share-decisions-peer`).
//!
//! Wire format, one message per request served with block keys (after retries, the replica that
//! really served, as [`policies::Policy::on_served`] sees it):
//!
//! | frame | content |
//! | --- | --- |
//! | 0 | topic [`TOPIC`] (`kvroute.decisions`) |
//! | 1 | sequence number, 8 bytes big-endian, 1 for the publisher's first message |
//! | 2 | msgpack array `[router_id (str), ts_us (uint, sender wall clock µs since the Unix epoch), replica (str: the upstream base URL as in the router's replica list, without a trailing `/`), block_keys (array of uint)]` |
//!
//! Replicas travel as URLs because ids are per process; a receiver maps the URL to its own id
//! (an unknown URL is counted and ignored). The receiver inserts with its *own* clock at receipt
//! as the entry's time (its TTL clock); `ts_us` is informational (delay diagnostics). Readers
//! accept trailing array elements, so fields may be appended later.
//!
//! Publishing never blocks the request path: the decision goes through a bounded channel to the
//! publisher task, and when the channel is full it is dropped and counted; the PUB socket itself
//! drops messages for a slow subscriber (zeromq's PUB), which the subscriber sees as a gap.
//!
//! Gap rule, as the KV event consumer's ([`crate::events::SeqTracker`]), but nothing is
//! repaired: per peer, the last sequence number is tracked; a jump counts one gap and
//! `missed` = the numbers skipped (a late join counts the messages before it). A missed
//! decision can only make this router *under*-predict — its believed index lacks an entry the
//! peer's routing created, so it may miss where it could have matched, never match on a prefix
//! no replica was sent — which is why there is no replay. A sequence going back (to 1, or to any
//! number not above the last) is a restarted peer: tracking restarts there (the numbers below it
//! count as missed).
//!
//! ## Shared load view (`--share-loads`)
//!
//! Sharing the belief alone concentrates load: every router believes the same group prefixes
//! and sends their new conversations to the same replica, while each sees only its own share of
//! that replica's in-flight requests, so the spill test never trips (results.md, "N routers over
//! one fleet"). With `--share-loads` a router also publishes its own in-flight count per replica
//! on the same PUB socket, and adds its peers' latest counts to its own before every decision
//! ([`crate::state::Replica::peer_outstanding`]).
//!
//! | frame | content |
//! | --- | --- |
//! | 0 | topic [`LOADS_TOPIC`] (`kvroute.loads`) |
//! | 1 | sequence number, 8 bytes big-endian, counted separately from the decisions' |
//! | 2 | msgpack array `[router_id (str), ts_us (uint), [[replica (str: base URL), in_flight (uint)], …]]` |
//!
//! Each message is the publisher's whole view (every replica it has), so a lost one is repaired
//! by the next and no gap rule is needed. The publisher polls its counters every
//! [`LOAD_POLL`] and sends when they changed, and at least every [`LOAD_HEARTBEAT`]. A receiver
//! replaces that peer's previous contribution with the new one; a peer silent for
//! [`LOAD_STALE_AFTER`] (stopped, partitioned) has its contribution removed and counted as
//! expired, as does a subscriber that ends. Counts lag by at most the poll period plus the
//! transport; this router's own are exact.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use rmpv::Value;
use tokio::sync::mpsc;

use crate::state::{Replica, Shared};

/// Topic frame of every decision message (also the SUB filter).
pub const TOPIC: &str = "kvroute.decisions";

/// Topic frame of every load-view message (`--share-loads`).
pub const LOADS_TOPIC: &str = "kvroute.loads";

/// How often a router sharing its loads reads its in-flight counters (and publishes them when
/// they changed). 5 ms: a request at the emulated fleet's capacity lasts 150–500 ms wall, so
/// the view lags by a few per cent of a request at most, at ≤ 200 small messages a second.
pub const LOAD_POLL: Duration = Duration::from_millis(5);

/// Longest time between two load-view messages of one router, changed or not, so a peer that
/// (re)joins learns the view without waiting for a change.
pub const LOAD_HEARTBEAT: Duration = Duration::from_millis(500);

/// A peer whose load view has not been heard from for this long (four heartbeats) is taken as
/// gone: its contribution is removed (`kvroute_shared_loads_expired_total`).
pub const LOAD_STALE_AFTER: Duration = Duration::from_millis(2000);

/// Default capacity of the channel between the request path and the publisher task
/// (decisions; a full channel drops and counts).
pub const DEFAULT_QUEUE: usize = 4096;

/// How long a failed peer connect waits before the next try (the peer may not be up yet).
const RECONNECT_PAUSE: Duration = Duration::from_millis(200);

/// Counters of the sharing arm, exported on `/metrics` as `kvroute_shared_decisions_*`. Bytes
/// count the three frames' payloads (topic, sequence, body), not ZMTP's framing (2 bytes a
/// short frame, 9 a long one) nor TCP's.
#[derive(Debug, Default)]
pub struct SharingStats {
    /// Decision messages handed to the PUB socket.
    pub published: AtomicU64,
    /// Their bytes (frame payloads).
    pub published_bytes: AtomicU64,
    /// Decisions not published: the channel to the publisher task was full (or the socket
    /// refused the message).
    pub dropped: AtomicU64,
    /// Messages received from peers (any shape).
    pub received: AtomicU64,
    /// Their bytes (frame payloads).
    pub received_bytes: AtomicU64,
    /// Peer decisions handed to the policy ([`policies::Policy::on_peer_served`]).
    pub applied: AtomicU64,
    /// Sequence gaps detected (including a late join or a restarted peer's lost start).
    pub gaps: AtomicU64,
    /// Sequence numbers skipped over all gaps: decisions never received.
    pub missed: AtomicU64,
    /// Peer decisions naming a replica URL this router does not have (ignored).
    pub unknown_replica: AtomicU64,
    /// Messages that could not be read (frame count, sequence frame or body): ignored.
    pub decode_errors: AtomicU64,
    /// Peers configured (a gauge).
    pub peers: AtomicU64,
    /// Peers whose SUB socket is connected and subscribed (a gauge): a harness waits for it to
    /// equal `peers` before sending load (PUB drops what it sends before a subscription).
    pub peers_connected: AtomicU64,
    /// Load-view messages handed to the PUB socket (`kvroute_shared_loads_published_total`).
    pub loads_published: AtomicU64,
    /// Load-view messages received and applied.
    pub loads_received: AtomicU64,
    /// Peers' load views removed because the peer fell silent or its subscriber ended.
    pub loads_expired: AtomicU64,
    /// Entries of received load views naming a replica URL this router does not have.
    pub loads_unknown_replica: AtomicU64,
}

impl SharingStats {
    /// Renders the `kvroute_shared_decisions_*` series.
    pub fn render_into(&self, out: &mut String) {
        use std::fmt::Write as _;
        let series: [(&str, &str, &str, &AtomicU64); 12] = [
            (
                "published_total",
                "counter",
                "Decision messages published to peers.",
                &self.published,
            ),
            (
                "published_bytes_total",
                "counter",
                "Bytes of published decision messages (frame payloads).",
                &self.published_bytes,
            ),
            (
                "dropped_total",
                "counter",
                "Decisions not published (publisher queue full).",
                &self.dropped,
            ),
            (
                "received_total",
                "counter",
                "Decision messages received from peers.",
                &self.received,
            ),
            (
                "received_bytes_total",
                "counter",
                "Bytes of received decision messages (frame payloads).",
                &self.received_bytes,
            ),
            (
                "applied_total",
                "counter",
                "Peer decisions applied to the policy.",
                &self.applied,
            ),
            (
                "gaps_total",
                "counter",
                "Sequence gaps in peers' decision streams (not repaired).",
                &self.gaps,
            ),
            (
                "missed_total",
                "counter",
                "Peer decisions skipped by sequence gaps.",
                &self.missed,
            ),
            (
                "unknown_replica_total",
                "counter",
                "Peer decisions naming a replica URL this router does not have.",
                &self.unknown_replica,
            ),
            (
                "decode_errors_total",
                "counter",
                "Peer messages that could not be decoded.",
                &self.decode_errors,
            ),
            ("peers", "gauge", "Peers configured.", &self.peers),
            (
                "peers_connected",
                "gauge",
                "Peers whose subscription is connected.",
                &self.peers_connected,
            ),
        ];
        let loads: [(&str, &str, &str, &AtomicU64); 4] = [
            (
                "published_total",
                "counter",
                "Load-view messages published to peers.",
                &self.loads_published,
            ),
            (
                "received_total",
                "counter",
                "Load-view messages received from peers and applied.",
                &self.loads_received,
            ),
            (
                "expired_total",
                "counter",
                "Peers' load views removed (peer silent or subscriber ended).",
                &self.loads_expired,
            ),
            (
                "unknown_replica_total",
                "counter",
                "Load-view entries naming a replica URL this router does not have.",
                &self.loads_unknown_replica,
            ),
        ];
        for (suffix, kind, help, v) in loads {
            let name = format!("kvroute_shared_loads_{suffix}");
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        }
        for (suffix, kind, help, v) in series {
            let name = format!("kvroute_shared_decisions_{suffix}");
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        }
    }
}

/// One decoded decision message body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerDecision {
    /// The publishing router's `--router-id`.
    pub router_id: String,
    /// The publisher's wall clock at publication, µs since the Unix epoch.
    pub ts_us: u64,
    /// The replica that served, as its base URL.
    pub replica_url: String,
    /// The request's block keys.
    pub block_keys: Vec<u64>,
}

/// Why a decision body could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Not valid msgpack.
    #[error("msgpack: {0}")]
    Msgpack(String),
    /// Valid msgpack of another shape.
    #[error("unexpected shape: {0}")]
    Shape(&'static str),
}

/// Encodes a decision body (frame 2; see the module documentation).
pub fn encode_body(router_id: &str, ts_us: u64, replica_url: &str, block_keys: &[u64]) -> Vec<u8> {
    let mut out =
        Vec::with_capacity(32 + router_id.len() + replica_url.len() + 9 * block_keys.len());
    // Writing to a Vec cannot fail.
    let _ = rmp_serde::encode::write(&mut out, &(router_id, ts_us, replica_url, block_keys));
    out
}

/// A body's top-level msgpack array (every message body is one).
fn body_items(body: &[u8]) -> Result<Vec<Value>, DecodeError> {
    let mut rd = body;
    let v = rmpv::decode::read_value(&mut rd).map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    match v {
        Value::Array(items) => Ok(items),
        _ => Err(DecodeError::Shape("body is not an array")),
    }
}

/// A string field, or the shape error naming it.
fn string_field(v: &Value, what: &'static str) -> Result<String, DecodeError> {
    v.as_str()
        .map(str::to_string)
        .ok_or(DecodeError::Shape(what))
}

/// An unsigned field, or the shape error naming it.
fn u64_field(v: &Value, what: &'static str) -> Result<u64, DecodeError> {
    v.as_u64().ok_or(DecodeError::Shape(what))
}

/// Decodes a decision body; trailing array elements are ignored.
pub fn decode_body(body: &[u8]) -> Result<PeerDecision, DecodeError> {
    let items = body_items(body)?;
    let [router_id, ts_us, replica, keys, ..] = items.as_slice() else {
        return Err(DecodeError::Shape("body has fewer than 4 elements"));
    };
    let Value::Array(keys) = keys else {
        return Err(DecodeError::Shape("block_keys is not an array"));
    };
    Ok(PeerDecision {
        router_id: string_field(router_id, "router_id is not a string")?,
        ts_us: u64_field(ts_us, "ts_us is not an unsigned integer")?,
        replica_url: string_field(replica, "replica is not a string")?,
        block_keys: keys
            .iter()
            .map(|k| u64_field(k, "block key is not a u64"))
            .collect::<Result<_, _>>()?,
    })
}

/// The three frames of one decision message.
pub fn frames(seq: u64, body: Vec<u8>) -> Vec<Bytes> {
    topic_frames(TOPIC, seq, body)
}

/// The three frames of one message on `topic`.
pub fn topic_frames(topic: &'static str, seq: u64, body: Vec<u8>) -> Vec<Bytes> {
    vec![
        Bytes::from_static(topic.as_bytes()),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::from(body),
    ]
}

/// One decoded load-view message body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerLoads {
    /// The publishing router's `--router-id`.
    pub router_id: String,
    /// The publisher's wall clock at publication, µs since the Unix epoch.
    pub ts_us: u64,
    /// Its in-flight requests per replica, by base URL.
    pub in_flight: Vec<(String, u32)>,
}

/// Encodes a load-view body (frame 2 on [`LOADS_TOPIC`]; see the module documentation).
pub fn encode_loads_body(router_id: &str, ts_us: u64, in_flight: &[(String, u32)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + router_id.len() + 40 * in_flight.len());
    // Writing to a Vec cannot fail.
    let _ = rmp_serde::encode::write(&mut out, &(router_id, ts_us, in_flight));
    out
}

/// Decodes a load-view body; trailing array elements (of the body and of each entry) are
/// ignored.
pub fn decode_loads_body(body: &[u8]) -> Result<PeerLoads, DecodeError> {
    let items = body_items(body)?;
    let [router_id, ts_us, entries, ..] = items.as_slice() else {
        return Err(DecodeError::Shape("body has fewer than 3 elements"));
    };
    let Value::Array(entries) = entries else {
        return Err(DecodeError::Shape("in_flight is not an array"));
    };
    let in_flight = entries
        .iter()
        .map(|e| {
            let Value::Array(pair) = e else {
                return Err(DecodeError::Shape("an in_flight entry is not an array"));
            };
            let [url, n, ..] = pair.as_slice() else {
                return Err(DecodeError::Shape(
                    "an in_flight entry has fewer than 2 elements",
                ));
            };
            let n = u64_field(n, "in_flight is not a u32")?;
            let n = u32::try_from(n).map_err(|_| DecodeError::Shape("in_flight is not a u32"))?;
            Ok((string_field(url, "replica is not a string")?, n))
        })
        .collect::<Result<_, _>>()?;
    Ok(PeerLoads {
        router_id: string_field(router_id, "router_id is not a string")?,
        ts_us: u64_field(ts_us, "ts_us is not an unsigned integer")?,
        in_flight,
    })
}

/// One peer's contribution to this router's load view: what it last reported per replica, as
/// added to [`crate::state::Replica::peer_outstanding`]. Replacing it applies only the
/// differences; clearing (or dropping) it takes the whole contribution back, so a peer that
/// stops or goes silent leaves nothing behind.
#[derive(Debug, Default)]
pub struct PeerLoadView {
    applied: HashMap<u32, (Arc<Replica>, u32)>,
}

impl PeerLoadView {
    /// Replaces this peer's contribution with `in_flight` (a replica absent from it counts 0);
    /// returns how many entries named a URL `shared` does not have (ignored).
    pub fn replace(&mut self, shared: &Shared, in_flight: &[(String, u32)]) -> u64 {
        let mut unknown = 0;
        let mut seen: Vec<u32> = Vec::with_capacity(in_flight.len());
        // One snapshot of the table for the whole view (not a lock per entry).
        let table = shared.replicas();
        for (url, n) in in_flight {
            let Some(r) = crate::state::find_by_url(&table, url) else {
                unknown += 1;
                continue;
            };
            seen.push(r.id);
            let old = self.applied.get(&r.id).map_or(0, |(_, old)| *old);
            adjust(r, old, *n);
            self.applied.insert(r.id, (r.clone(), *n));
        }
        self.applied.retain(|id, (r, old)| {
            let keep = seen.contains(id);
            if !keep {
                adjust(r, *old, 0);
            }
            keep
        });
        unknown
    }

    /// Takes the whole contribution back; true when there was any.
    pub fn clear(&mut self) -> bool {
        let had = !self.applied.is_empty();
        for (r, old) in self.applied.values() {
            adjust(r, *old, 0);
        }
        self.applied.clear();
        had
    }
}

impl Drop for PeerLoadView {
    fn drop(&mut self) {
        self.clear();
    }
}

/// Moves `r`'s peer count from a contribution of `old` to one of `new`.
fn adjust(r: &Replica, old: u32, new: u32) {
    use std::cmp::Ordering as Cmp;
    match new.cmp(&old) {
        Cmp::Greater => {
            r.peer_outstanding.fetch_add(new - old, Ordering::AcqRel);
        }
        Cmp::Less => {
            r.peer_outstanding.fetch_sub(old - new, Ordering::AcqRel);
        }
        Cmp::Equal => {}
    }
}

/// Per-peer sequence tracking (the gap rule of the module documentation), separate from the
/// socket so it can be tested deterministically.
#[derive(Debug, Default, Clone)]
pub struct PeerSeq {
    last: Option<u64>,
}

impl PeerSeq {
    /// Accepts `seq` and returns how many sequence numbers were skipped before it (0: in order).
    /// A fresh tracker expects 1; a number not above the last restarts tracking (the peer
    /// restarted) and counts the numbers below it, from 1, as skipped.
    pub fn observe(&mut self, seq: u64) -> u64 {
        let expected = match self.last {
            Some(last) if seq > last => last + 1,
            _ => 1,
        };
        self.last = Some(seq);
        seq.saturating_sub(expected)
    }
}

/// The wall clock in µs since the Unix epoch (0 before it): every message's `ts_us`.
fn wall_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// A decision waiting for the publisher task.
struct Outgoing {
    ts_us: u64,
    replica: Arc<Replica>,
    keys: Vec<u64>,
}

/// The request path's end of the publisher: a bounded channel to the task that owns the PUB
/// socket.
#[derive(Debug)]
pub struct Publisher {
    tx: mpsc::Sender<Outgoing>,
    stats: Arc<SharingStats>,
}

impl std::fmt::Debug for Outgoing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outgoing")
            .field("replica", &self.replica.url)
            .field("keys", &self.keys.len())
            .finish()
    }
}

impl Publisher {
    /// Queues one served decision without waiting: a full queue drops it (counted in
    /// `dropped`). One allocation (the keys) and a wall-clock read.
    pub fn offer(&self, replica: Arc<Replica>, block_keys: &[u64]) {
        let out = Outgoing {
            ts_us: wall_us(),
            replica,
            keys: block_keys.to_vec(),
        };
        if self.tx.try_send(out).is_err() {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// What [`start`] set up: the bound endpoint and the background tasks (aborted on drop).
#[derive(Debug, Default)]
pub struct Sharing {
    /// The PUB socket's bound endpoint (port 0 resolved), when publishing.
    pub endpoint: Option<String>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Sharing {
    /// Stops the publisher and the peer subscribers.
    pub fn stop(&mut self) {
        for t in self.tasks.drain(..) {
            t.abort();
        }
    }
}

impl Drop for Sharing {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Where sharing is configured: the router's [`crate::RouterConfig`] fields.
#[derive(Debug, Clone, Default)]
pub struct SharingConfig {
    /// This router's name in its messages.
    pub router_id: String,
    /// PUB endpoint to bind (`tcp://HOST:PORT`; port 0 picks one), or none (no publishing).
    pub bind: Option<String>,
    /// Peers' PUB endpoints to subscribe to.
    pub peers: Vec<String>,
    /// Capacity of the publisher queue (0 is taken as 1).
    pub queue: usize,
    /// Publish this router's load view and apply the peers' ("Shared load view").
    pub share_loads: bool,
}

/// Binds the PUB socket (when `cfg.bind`), installs the publisher on `shared` (so
/// [`Shared::served`] publishes), and starts one subscriber per peer. Peers are not waited
/// for: each subscriber retries its connect every 200 ms in the background, and
/// `kvroute_shared_decisions_peers_connected` says how many are connected. Must run inside a
/// tokio runtime; fails when the bind does.
pub async fn start(shared: &Arc<Shared>, cfg: &SharingConfig) -> Result<Sharing, String> {
    use zeromq::Socket;
    let mut sharing = Sharing::default();
    let stats = shared.sharing.clone();
    if let Some(bind) = &cfg.bind {
        let mut sock = zeromq::PubSocket::new();
        let ep = sock
            .bind(bind)
            .await
            .map_err(|e| format!("cannot bind the decision publisher on {bind}: {e}"))?;
        sharing.endpoint = Some(ep.to_string());
        let (tx, rx) = mpsc::channel(cfg.queue.max(1));
        shared
            .set_publisher(Publisher {
                tx,
                stats: stats.clone(),
            })
            .map_err(|_| "a decision publisher is already installed".to_string())?;
        sharing.tasks.push(tokio::spawn(run_publisher(
            sock,
            rx,
            cfg.router_id.clone(),
            stats.clone(),
            cfg.share_loads.then(|| Arc::downgrade(shared)),
        )));
    }
    stats
        .peers
        .fetch_add(cfg.peers.len() as u64, Ordering::Relaxed);
    for peer in &cfg.peers {
        sharing.tasks.push(tokio::spawn(run_peer(
            peer.clone(),
            Arc::downgrade(shared),
            stats.clone(),
            cfg.share_loads,
        )));
    }
    Ok(sharing)
}

/// The publisher task: numbers, encodes and sends each queued decision, and, when `loads`
/// holds the router state (`--share-loads`), its load view whenever it changed (polled every
/// [`LOAD_POLL`]) and at least every [`LOAD_HEARTBEAT`].
async fn run_publisher(
    mut sock: zeromq::PubSocket,
    mut rx: mpsc::Receiver<Outgoing>,
    router_id: String,
    stats: Arc<SharingStats>,
    loads: Option<Weak<Shared>>,
) {
    use zeromq::SocketSend;
    let mut seq = 0u64;
    let mut loads_seq = 0u64;
    let mut poll = tokio::time::interval(LOAD_POLL);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    // The counts last published (by replica id) and when: a poll that finds them unchanged
    // before the heartbeat builds nothing.
    let mut last_sent: Option<(Vec<(u32, u32)>, tokio::time::Instant)> = None;
    loop {
        let d = tokio::select! {
            d = rx.recv() => match d {
                Some(d) => d,
                None => return,
            },
            _ = poll.tick(), if loads.is_some() => {
                let Some(shared) = loads.as_ref().and_then(Weak::upgrade) else { return };
                let table = shared.replicas();
                drop(shared);
                let counts: Vec<(u32, u32)> = table
                    .iter()
                    .map(|r| (r.id, r.outstanding.load(Ordering::Acquire)))
                    .collect();
                let due = last_sent.as_ref().is_none_or(|(last, at)| {
                    *last != counts || at.elapsed() >= LOAD_HEARTBEAT
                });
                if !due {
                    continue;
                }
                loads_seq += 1;
                let view: Vec<(String, u32)> = table
                    .iter()
                    .zip(&counts)
                    .map(|(r, (_, n))| (r.url.clone(), *n))
                    .collect();
                let body = encode_loads_body(&router_id, wall_us(), &view);
                if let Ok(msg) =
                    zeromq::ZmqMessage::try_from(topic_frames(LOADS_TOPIC, loads_seq, body))
                    && sock.send(msg).await.is_ok()
                {
                    stats.loads_published.fetch_add(1, Ordering::Relaxed);
                }
                last_sent = Some((counts, tokio::time::Instant::now()));
                continue;
            }
        };
        seq += 1;
        let body = encode_body(&router_id, d.ts_us, &d.replica.url, &d.keys);
        let bytes = (TOPIC.len() + 8 + body.len()) as u64;
        let msg = match zeromq::ZmqMessage::try_from(frames(seq, body)) {
            Ok(m) => m,
            Err(_) => {
                stats.dropped.fetch_add(1, Ordering::Relaxed);
                continue;
            }
        };
        if sock.send(msg).await.is_ok() {
            stats.published.fetch_add(1, Ordering::Relaxed);
            stats.published_bytes.fetch_add(bytes, Ordering::Relaxed);
        } else {
            stats.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Splits a message into (is a load view, sequence, body); `None` for another shape or topic.
fn split(frames: &[Bytes]) -> Option<(bool, u64, &[u8])> {
    let [topic, seq, body] = frames else {
        return None;
    };
    let loads = match topic.as_ref() {
        t if t == TOPIC.as_bytes() => false,
        t if t == LOADS_TOPIC.as_bytes() => true,
        _ => return None,
    };
    let seq: [u8; 8] = seq.as_ref().try_into().ok()?;
    Some((loads, u64::from_be_bytes(seq), body.as_ref()))
}

/// One peer's subscriber: connects (retrying), then applies every decision (and, with `loads`,
/// every load view) until the router state is dropped (or the task is aborted). The peer's load
/// contribution is taken back when it falls silent for [`LOAD_STALE_AFTER`] and when this task
/// ends.
async fn run_peer(endpoint: String, shared: Weak<Shared>, stats: Arc<SharingStats>, loads: bool) {
    use zeromq::{Socket, SocketRecv};
    let mut view = PeerLoadView::default();
    loop {
        let mut sub = zeromq::SubSocket::new();
        let subscribed = sub.connect(&endpoint).await.is_ok()
            && sub.subscribe(TOPIC).await.is_ok()
            && (!loads || sub.subscribe(LOADS_TOPIC).await.is_ok());
        if !subscribed {
            if shared.strong_count() == 0 {
                return;
            }
            tokio::time::sleep(RECONNECT_PAUSE).await;
            continue;
        }
        stats.peers_connected.fetch_add(1, Ordering::Relaxed);
        let _connected = Connected(&stats);
        let mut seq = PeerSeq::default();
        let mut loads_heard = tokio::time::Instant::now();
        loop {
            // Wake at least once a heartbeat to notice a silent peer.
            let msg = match tokio::time::timeout(LOAD_HEARTBEAT, sub.recv()).await {
                Ok(Ok(m)) => Some(m),
                Ok(Err(_)) => {
                    // The socket reconnects on its own; pause so a dead peer cannot spin us.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    None
                }
                Err(_) => None,
            };
            if loads && loads_heard.elapsed() >= LOAD_STALE_AFTER && view.clear() {
                stats.loads_expired.fetch_add(1, Ordering::Relaxed);
            }
            let Some(msg) = msg else { continue };
            let frames = msg.into_vec();
            let split = split(&frames);
            if !matches!(split, Some((true, ..))) {
                // Decision messages and unreadable ones (any shape) count as received.
                stats.received.fetch_add(1, Ordering::Relaxed);
                stats.received_bytes.fetch_add(
                    frames.iter().map(|f| f.len() as u64).sum(),
                    Ordering::Relaxed,
                );
            }
            let Some((is_loads, n, body)) = split else {
                stats.decode_errors.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            if is_loads {
                let Ok(l) = decode_loads_body(body) else {
                    stats.decode_errors.fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                let Some(s) = shared.upgrade() else { return };
                let unknown = view.replace(&s, &l.in_flight);
                stats
                    .loads_unknown_replica
                    .fetch_add(unknown, Ordering::Relaxed);
                stats.loads_received.fetch_add(1, Ordering::Relaxed);
                loads_heard = tokio::time::Instant::now();
                continue;
            }
            let missed = seq.observe(n);
            if missed > 0 {
                stats.gaps.fetch_add(1, Ordering::Relaxed);
                stats.missed.fetch_add(missed, Ordering::Relaxed);
            }
            let Ok(d) = decode_body(body) else {
                stats.decode_errors.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            let Some(s) = shared.upgrade() else { return };
            if s.peer_served(&d.replica_url, &d.block_keys) {
                stats.applied.fetch_add(1, Ordering::Relaxed);
            } else {
                stats.unknown_replica.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Decrements `peers_connected` when a connected subscriber ends (aborted or returned).
struct Connected<'a>(&'a SharingStats);

impl Drop for Connected<'_> {
    fn drop(&mut self) {
        self.0.peers_connected.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The default `--router-id`: `HOSTNAME:PORT` (the kernel's host name, else `$HOSTNAME`), or
/// `router` when no host name is known.
pub fn default_router_id(port: u16) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty());
    match host {
        Some(h) => format!("{h}:{port}"),
        None => "router".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_body_round_trips_and_tolerates_trailing_fields() {
        let view = vec![
            ("http://127.0.0.1:8001".to_string(), 3u32),
            ("http://127.0.0.1:8002".to_string(), 0),
            ("http://127.0.0.1:8003".to_string(), u32::MAX),
        ];
        let body = encode_loads_body("r0", 1_700_000_000_000_000, &view);
        assert_eq!(
            decode_loads_body(&body).unwrap(),
            PeerLoads {
                router_id: "r0".into(),
                ts_us: 1_700_000_000_000_000,
                in_flight: view,
            }
        );
        let mut longer = Vec::new();
        rmp_serde::encode::write(
            &mut longer,
            &("r1", 5u64, [("http://h:1", 2u32, "x")], "extra"),
        )
        .unwrap();
        assert_eq!(
            decode_loads_body(&longer).unwrap().in_flight,
            vec![("http://h:1".to_string(), 2)]
        );
        let mut negative = Vec::new();
        rmp_serde::encode::write(&mut negative, &("r1", 5u64, [("http://h:1", -1i64)])).unwrap();
        assert!(decode_loads_body(&negative).is_err());
        assert!(decode_loads_body(b"\x01").is_err());
    }

    /// A router's state over two replicas that are never contacted, with `policy`.
    fn two_replica_state(policy: &str) -> Arc<Shared> {
        let specs = vec![
            crate::config::ReplicaSpec::new("http://127.0.0.1:1"),
            crate::config::ReplicaSpec::new("http://127.0.0.1:2/"),
        ];
        let spec = policies::PolicySpec::named(policy);
        let cfg = crate::config::RouterConfig::new(specs, spec.clone());
        crate::server::shared_from_config(&cfg, policies::build(&spec).unwrap()).unwrap()
    }

    fn peer_counts(shared: &Shared) -> Vec<u32> {
        shared
            .replicas()
            .iter()
            .map(|r| r.peer_outstanding.load(Ordering::Relaxed))
            .collect()
    }

    #[test]
    fn a_peer_load_view_replaces_its_contribution_and_takes_it_back() {
        let shared = two_replica_state("least-outstanding");
        let (a, b) = (
            "http://127.0.0.1:1".to_string(),
            "http://127.0.0.1:2".to_string(),
        );
        let mut p1 = PeerLoadView::default();
        assert_eq!(p1.replace(&shared, &[(a.clone(), 3), (b.clone(), 1)]), 0);
        assert_eq!(peer_counts(&shared), [3, 1]);
        // The next view replaces the last: a replica left out counts 0.
        assert_eq!(p1.replace(&shared, &[(a.clone(), 1)]), 0);
        assert_eq!(peer_counts(&shared), [1, 0]);
        // A second peer adds to the first; an unknown URL is counted and ignored.
        let mut p2 = PeerLoadView::default();
        let unknown = p2.replace(&shared, &[(a.clone(), 2), ("http://elsewhere:9".into(), 5)]);
        assert_eq!((unknown, peer_counts(&shared)), (1, vec![3, 0]));
        assert!(p1.clear());
        assert!(!p1.clear(), "nothing left to take back");
        assert_eq!(peer_counts(&shared), [2, 0]);
        drop(p2);
        assert_eq!(
            peer_counts(&shared),
            [0, 0],
            "a dropped view leaves nothing behind"
        );
    }

    #[test]
    fn decisions_see_the_peers_load_and_the_ceiling_counts_only_this_routers() {
        let shared = two_replica_state("least-outstanding");
        let mut peer = PeerLoadView::default();
        peer.replace(&shared, &[("http://127.0.0.1:1".into(), 5)]);
        let req = policies::RouteRequest {
            session_id: None,
            block_keys: &[],
            tokens_per_block: 0.0,
            now_us: 0,
        };
        // Replica 0 carries the peer's 5: every one of 5 requests goes to replica 1, whose own
        // load grows to 5 (a tie with replica 0's view only at the last).
        let mut guards = Vec::new();
        for _ in 0..5 {
            let routed = shared.route(&req).unwrap();
            assert_eq!(routed.decision.replica, 1);
            guards.push(routed.guard);
        }
        let own: Vec<u32> = shared
            .replicas()
            .iter()
            .map(|r| r.outstanding.load(Ordering::Relaxed))
            .collect();
        assert_eq!(own, [0, 5], "the peer's load is not this router's own");
        peer.clear();
        assert_eq!(shared.route(&req).unwrap().decision.replica, 0);
    }

    #[test]
    fn body_round_trips_and_tolerates_trailing_fields() {
        let keys = [0u64, 1, 300, u64::MAX, 0x1234_5678_9abc_def0];
        let body = encode_body("r0", 1_700_000_000_000_000, "http://127.0.0.1:8001", &keys);
        let d = decode_body(&body).unwrap();
        assert_eq!(
            d,
            PeerDecision {
                router_id: "r0".into(),
                ts_us: 1_700_000_000_000_000,
                replica_url: "http://127.0.0.1:8001".into(),
                block_keys: keys.to_vec(),
            }
        );
        // A later writer's extra field is ignored.
        let mut longer = Vec::new();
        rmp_serde::encode::write(&mut longer, &("r1", 5u64, "http://h:1", [7u64], "extra"))
            .unwrap();
        assert_eq!(decode_body(&longer).unwrap().block_keys, vec![7]);
    }

    /// The wire cost of one decision for the workload's typical prompt: ~1,100 engine tokens at
    /// the measured 3.88 canonical bytes per token is 4,268 bytes, 66 full 64-byte blocks.
    #[test]
    fn a_typical_prompt_costs_657_bytes_a_message() {
        let rendering = vec![b'x'; (1100.0 * policies::DEFAULT_BELIEF_BYTES_PER_TOKEN) as usize];
        let keys = kv_index::hash::byte_block_keys(b"kvroute/emulated-8b", &rendering, 64);
        assert_eq!(keys.len(), 66);
        let body = encode_body("r0", 1_767_225_600_000_000, "http://127.0.0.1:8001", &keys);
        // fixarray 1 + fixstr "r0" 3 + uint64 ts 9 + fixstr URL 22 + array16 header 3 + 66 keys
        // × 9 (uint64: a hash is below 2^32 with probability 2^-32).
        assert_eq!(body.len(), 1 + 3 + 9 + 22 + 3 + 66 * 9);
        let message: usize = frames(1, body).iter().map(Bytes::len).sum();
        assert_eq!(message, 657, "topic 17 + sequence 8 + body 632");
    }

    #[test]
    fn malformed_bodies_are_errors_not_panics() {
        assert!(matches!(decode_body(b""), Err(DecodeError::Msgpack(_))));
        // A 4-element array header with nothing after it (a truncated body).
        assert!(matches!(decode_body(&[0x94]), Err(DecodeError::Msgpack(_))));
        // The reserved marker.
        assert!(decode_body(&[0xc1]).is_err());
        let enc = |v: &Value| {
            let mut b = Vec::new();
            rmpv::encode::write_value(&mut b, v).unwrap();
            b
        };
        let s = |x: &str| Value::from(x);
        for v in [
            Value::from(3),
            Value::Array(vec![s("r"), Value::from(1)]),
            Value::Array(vec![
                Value::from(1),
                Value::from(1),
                s("u"),
                Value::Array(vec![]),
            ]),
            Value::Array(vec![s("r"), Value::from(-1), s("u"), Value::Array(vec![])]),
            Value::Array(vec![
                s("r"),
                Value::from(1),
                Value::Nil,
                Value::Array(vec![]),
            ]),
            Value::Array(vec![s("r"), Value::from(1), s("u"), s("keys")]),
            Value::Array(vec![
                s("r"),
                Value::from(1),
                s("u"),
                Value::Array(vec![Value::from(-5)]),
            ]),
        ] {
            assert!(
                matches!(decode_body(&enc(&v)), Err(DecodeError::Shape(_))),
                "{v:?}"
            );
        }
    }

    #[test]
    fn sequence_gaps_restarts_and_late_joins() {
        let mut s = PeerSeq::default();
        assert_eq!(s.observe(1), 0);
        assert_eq!(s.observe(2), 0);
        assert_eq!(s.observe(5), 2, "3 and 4 missed");
        assert_eq!(s.observe(6), 0);
        // The peer restarted: tracking starts over at 1.
        assert_eq!(s.observe(1), 0);
        assert_eq!(s.observe(2), 0);
        // A repeat is a restart at its number: 1 of the new stream was missed.
        assert_eq!(s.observe(2), 1);
        assert_eq!(s.observe(1), 0);
        assert_eq!(s.observe(4), 2);
        let mut late = PeerSeq::default();
        assert_eq!(late.observe(10), 9, "a late join counts what it never saw");
        assert_eq!(PeerSeq::default().observe(0), 0);
    }

    #[test]
    fn frames_split_back() {
        let f = frames(42, encode_body("r", 1, "http://h:1", &[9]));
        let (loads, seq, body) = split(&f).unwrap();
        assert_eq!((loads, seq), (false, 42));
        assert_eq!(decode_body(body).unwrap().block_keys, vec![9]);
        let l = topic_frames(LOADS_TOPIC, 7, encode_loads_body("r", 1, &[]));
        assert!(matches!(split(&l), Some((true, 7, _))));
        assert!(split(&f[1..]).is_none());
        let mut wrong = f.clone();
        wrong[0] = Bytes::from_static(b"kv@mock");
        assert!(split(&wrong).is_none());
        wrong = f;
        wrong[1] = Bytes::from_static(b"short");
        assert!(split(&wrong).is_none());
    }
}
