//! KV event consumer: vLLM's and SGLang's ZMQ/msgpack event streams → [`kv_index::KvEvent`].
//!
//! Wire format (crates/proxy/README.md, "KV events"; `ZmqEventPublisher` in vLLM's
//! `vllm/distributed/kv_events.py` and SGLang's `python/sglang/srt/disaggregation/kv_events.py`):
//! each message is three frames — topic, an 8-byte big-endian sequence number, and a msgpack batch
//! `[ts, events, rank]`. Both engines declare their structs with msgspec, so the layouts differ by
//! release:
//!
//! | release | batch | events |
//! | --- | --- | --- |
//! | vLLM @ b4e69e0, SGLang @ 006d053 | `[ts, events]` | positional, `["BlockStored", hashes, parent, token_ids, block_size, lora_id]`, `["BlockRemoved", hashes]` |
//! | vLLM 0.11.0 | `[ts, events, data_parallel_rank]` | positional, as above plus a trailing `medium` |
//! | vLLM 0.33.0 | `[ts, events, data_parallel_rank]` | maps tagged `type`; `lora_id`, `medium`, `lora_name` always, `extra_keys`, `group_idx`, … when set |
//! | SGLang 0.5.23 | `[ts, events, attn_dp_rank]` | maps tagged `type`; `medium`, `cache_salt`, `session_id`, `lora_name` when set |
//!
//! Positional arrays stop where the release's fields stop (msgspec omits trailing defaults), so
//! every field past `block_size` is optional here. Which trailing fields exist, and where a
//! request's `cache_salt` is found, is engine-specific: [`EventFormat`] says which engine to read
//! (vLLM: the untagged salt in block 0's `extra_keys`; SGLang: the `cache_salt` field). Engine
//! hashes are never compared with the router's: SGLang's are its own SHA-256 prefixes and vLLM's
//! depend on its hash algorithm and seed, so blocks are keyed from the `token_ids` every
//! `BlockStored` carries and the hashes only link a run to its parent and name removals.
//!
//! The stream is never trusted blindly: every sequence gap is counted, then repaired from the
//! engine's replay socket when one is configured; when replay is unavailable or incomplete, the
//! replica is treated as cleared (its believed residency is dropped), which can only make the
//! router under-predict, never route on state the engine no longer has.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kv_index::KvEvent;
use rmpv::Value;

/// Sequence number that ends a replay answer.
pub const REPLAY_END_SEQ: u64 = u64::MAX;

/// Which engine publishes a replica's events: decides where the trailing fields of a
/// `BlockStored` are (and so a request's `cache_salt`). The router's `--kv-events-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EventFormat {
    /// vLLM (the default): the salt is the untagged string in block 0's `extra_keys`, after the
    /// LoRA name when `lora_name` is set (`to_event_extra_keys`, `vllm/v1/core/kv_cache_utils.py`).
    #[default]
    Vllm,
    /// SGLang: the salt is the event's own `cache_salt` field (SGLang 0.5.23).
    Sglang,
}

impl EventFormat {
    /// The flag value: `vllm` or `sglang`.
    pub fn name(self) -> &'static str {
        match self {
            EventFormat::Vllm => "vllm",
            EventFormat::Sglang => "sglang",
        }
    }
}

impl std::str::FromStr for EventFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "vllm" => Ok(EventFormat::Vllm),
            "sglang" => Ok(EventFormat::Sglang),
            other => Err(format!(
                "unknown KV event format {other:?} (expected vllm or sglang)"
            )),
        }
    }
}

/// A decoded event batch.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Engine timestamp (seconds, engine clock).
    pub ts: f64,
    /// Events in order.
    pub events: Vec<KvEvent>,
    /// Events of kinds this consumer does not know (skipped, counted).
    pub unknown_events: u32,
    /// Events about another storage tier than the GPU (`medium` other than `"GPU"`, e.g. a CPU
    /// offload tier): skipped, since a removal from that tier says nothing of the GPU's copy.
    pub other_tier_events: u32,
    /// The publisher's data-parallel rank (vLLM `data_parallel_rank`, SGLang `attn_dp_rank`),
    /// when the batch carries one. Each rank publishes on its own port (endpoint port + rank),
    /// so one subscription sees one rank.
    pub data_parallel_rank: Option<i64>,
}

/// Why a payload could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Not valid msgpack.
    #[error("msgpack: {0}")]
    Msgpack(String),
    /// Valid msgpack of an unexpected shape.
    #[error("unexpected shape: {0}")]
    Shape(&'static str),
}

/// Decodes one msgpack batch payload published by an engine of `format`.
pub fn decode_batch(payload: &[u8], format: EventFormat) -> Result<EventBatch, DecodeError> {
    let mut rd = payload;
    let v = rmpv::decode::read_value(&mut rd).map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    let (ts, events, rank) = match &v {
        Value::Array(items) if items.len() >= 2 => (&items[0], &items[1], items.get(2)),
        Value::Map(_) => (
            map_get(&v, "ts").ok_or(DecodeError::Shape("batch map without ts"))?,
            map_get(&v, "events").ok_or(DecodeError::Shape("batch map without events"))?,
            map_get(&v, "data_parallel_rank").or_else(|| map_get(&v, "attn_dp_rank")),
        ),
        _ => return Err(DecodeError::Shape("batch is not [ts, events, …]")),
    };
    let ts = ts
        .as_f64()
        .or_else(|| ts.as_i64().map(|i| i as f64))
        .unwrap_or(0.0);
    let Value::Array(raw_events) = events else {
        return Err(DecodeError::Shape("events is not an array"));
    };
    let mut out = EventBatch {
        ts,
        events: Vec::with_capacity(raw_events.len()),
        unknown_events: 0,
        other_tier_events: 0,
        data_parallel_rank: rank.and_then(Value::as_i64),
    };
    for ev in raw_events {
        match decode_event(ev, format)? {
            Decoded::Event(e) => out.events.push(e),
            Decoded::Unknown => out.unknown_events += 1,
            Decoded::OtherTier => out.other_tier_events += 1,
        }
    }
    Ok(out)
}

fn map_get<'v>(v: &'v Value, key: &str) -> Option<&'v Value> {
    match v {
        Value::Map(entries) => entries
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v),
        _ => None,
    }
}

enum Decoded {
    Event(KvEvent),
    Unknown,
    OtherTier,
}

/// The fields of one event, wherever the encoding put them (absent = `Nil`).
struct Fields<'v> {
    tag: &'v str,
    block_hashes: &'v Value,
    parent: &'v Value,
    token_ids: &'v Value,
    block_size: &'v Value,
    medium: &'v Value,
    lora_name: &'v Value,
    extra_keys: &'v Value,
    cache_salt: &'v Value,
}

/// Decodes one event; a well-formed event of an unknown kind or of another tier is skipped.
fn decode_event(ev: &Value, format: EventFormat) -> Result<Decoded, DecodeError> {
    const NIL: &Value = &Value::Nil;
    let f = match ev {
        Value::Array(items) => {
            let tag = items
                .first()
                .and_then(Value::as_str)
                .ok_or(DecodeError::Shape("event without tag"))?;
            let at = |i: usize| items.get(i).unwrap_or(NIL);
            match tag {
                // Positional BlockStored: [tag, hashes, parent, token_ids, block_size, lora_id,
                // then the engine's trailing fields in declaration order].
                "BlockStored" => {
                    let (medium, lora_name, extra_keys, cache_salt) = match format {
                        // vLLM: medium, lora_name, extra_keys, group_idx, …
                        EventFormat::Vllm => (at(6), at(7), at(8), NIL),
                        // SGLang: medium, cache_salt, session_id, lora_name.
                        EventFormat::Sglang => (at(6), at(9), NIL, at(7)),
                    };
                    Fields {
                        tag,
                        block_hashes: at(1),
                        parent: at(2),
                        token_ids: at(3),
                        block_size: at(4),
                        medium,
                        lora_name,
                        extra_keys,
                        cache_salt,
                    }
                }
                // Positional BlockRemoved: [tag, hashes, medium, …] in both engines.
                _ => Fields {
                    tag,
                    block_hashes: at(1),
                    parent: NIL,
                    token_ids: NIL,
                    block_size: NIL,
                    medium: at(2),
                    lora_name: NIL,
                    extra_keys: NIL,
                    cache_salt: NIL,
                },
            }
        }
        Value::Map(_) => {
            let tag = map_get(ev, "type")
                .and_then(Value::as_str)
                .ok_or(DecodeError::Shape("event map without type"))?;
            let k = |key: &str| map_get(ev, key).unwrap_or(NIL);
            Fields {
                tag,
                block_hashes: k("block_hashes"),
                parent: k("parent_block_hash"),
                token_ids: k("token_ids"),
                block_size: k("block_size"),
                medium: k("medium"),
                lora_name: k("lora_name"),
                extra_keys: match format {
                    EventFormat::Vllm => k("extra_keys"),
                    EventFormat::Sglang => NIL,
                },
                cache_salt: match format {
                    EventFormat::Vllm => NIL,
                    EventFormat::Sglang => k("cache_salt"),
                },
            }
        }
        _ => return Err(DecodeError::Shape("event is neither array nor map")),
    };
    if !matches!(f.tag, "BlockStored" | "BlockRemoved" | "AllBlocksCleared") {
        return Ok(Decoded::Unknown);
    }
    match f.medium {
        Value::Nil => {}
        m if m.as_str() == Some("GPU") => {}
        Value::String(_) => return Ok(Decoded::OtherTier),
        _ => return Err(DecodeError::Shape("medium is not a string")),
    }
    Ok(Decoded::Event(match f.tag {
        "BlockStored" => stored(&f)?,
        "BlockRemoved" => KvEvent::Removed {
            block_hashes: hashes(f.block_hashes)?,
        },
        _ => KvEvent::AllCleared,
    }))
}

fn stored(f: &Fields<'_>) -> Result<KvEvent, DecodeError> {
    let block_hashes = hashes(f.block_hashes)?;
    let parent_block_hash = match f.parent {
        Value::Nil => None,
        v => Some(hash(v)?),
    };
    let Value::Array(toks) = f.token_ids else {
        return Err(DecodeError::Shape("token_ids is not an array"));
    };
    let token_ids = toks
        .iter()
        .map(|t| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or(DecodeError::Shape("token id is not a u32"))
        })
        .collect::<Result<Vec<u32>, _>>()?;
    let block_size = match f.block_size {
        Value::Nil => 16,
        v => v
            .as_u64()
            .and_then(|b| u32::try_from(b).ok())
            .filter(|&b| b > 0)
            .ok_or(DecodeError::Shape("bad block_size"))?,
    };
    // The salt only matters where a chain starts (block 0); later runs inherit their parent's.
    let cache_salt = match (parent_block_hash, f.cache_salt) {
        (Some(_), _) => None,
        (None, Value::Nil) => vllm_extra_keys_salt(f.extra_keys, f.lora_name)?,
        (None, Value::String(s)) => s.as_str().map(str::to_string),
        (None, _) => return Err(DecodeError::Shape("cache_salt is not a string")),
    };
    Ok(KvEvent::Stored {
        block_hashes,
        parent_block_hash,
        token_ids,
        block_size,
        cache_salt,
    })
}

/// The `cache_salt` in vLLM's `extra_keys` of a run that starts at block 0: block 0's entry
/// lists, untagged and in order, the LoRA name (when `lora_name` is set), `[mm_identifier,
/// offset]` pairs, the salt, and prompt-embedding digests (bytes) — so the salt is the first bare
/// string after the LoRA name (`generate_block_hash_extra_keys` and `to_event_extra_keys` in
/// `vllm/v1/core/kv_cache_utils.py`, 0.33.0).
fn vllm_extra_keys_salt(
    extra_keys: &Value,
    lora_name: &Value,
) -> Result<Option<String>, DecodeError> {
    let block0 = match extra_keys {
        Value::Nil => return Ok(None),
        Value::Array(per_block) => per_block.first().unwrap_or(&Value::Nil),
        _ => return Err(DecodeError::Shape("extra_keys is not an array")),
    };
    let keys = match block0 {
        Value::Nil => return Ok(None),
        Value::Array(keys) => keys,
        _ => return Err(DecodeError::Shape("extra_keys entry is not an array")),
    };
    let skip = usize::from(!lora_name.is_nil());
    Ok(keys
        .iter()
        .filter_map(Value::as_str)
        .nth(skip)
        .map(str::to_string))
}

fn hashes(v: &Value) -> Result<Vec<u64>, DecodeError> {
    match v {
        Value::Array(items) => items.iter().map(hash).collect(),
        _ => Err(DecodeError::Shape("block_hashes is not an array")),
    }
}

/// An engine block hash as a u64: integers as their 64-bit pattern (SGLang sends signed int64,
/// vLLM unsigned); byte strings (vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`: the 32-byte
/// SHA-256) folded from their first eight bytes, big-endian — engine hashes only need to be
/// stable within one replica, since keys are re-derived from token ids.
fn hash(v: &Value) -> Result<u64, DecodeError> {
    if let Some(u) = v.as_u64() {
        return Ok(u);
    }
    if let Some(i) = v.as_i64() {
        return Ok(i as u64);
    }
    if let Value::Binary(b) = v {
        let mut buf = [0u8; 8];
        let n = b.len().min(8);
        buf[8 - n..].copy_from_slice(&b[..n]);
        return Ok(u64::from_be_bytes(buf));
    }
    Err(DecodeError::Shape(
        "block hash is neither integer nor bytes",
    ))
}

/// Per-replica event-stream counters, exported in `/metrics`.
#[derive(Debug, Default)]
pub struct EventStats {
    /// Batches applied.
    pub batches: AtomicU64,
    /// Sequence gaps detected (including a late join and an engine restart).
    pub gaps: AtomicU64,
    /// Gaps that replay could not repair, so the replica was treated as cleared.
    pub gaps_unrepaired: AtomicU64,
    /// Batches that failed to decode (treated like a gap).
    pub decode_errors: AtomicU64,
    /// Events of unknown kinds, skipped.
    pub unknown_events: AtomicU64,
    /// Events about a storage tier other than the GPU, skipped.
    pub other_tier_events: AtomicU64,
    /// Engine restarts: the sequence went backwards, or the connection to the publisher was
    /// lost (a restarting engine closes it). Each dropped the replica's residency.
    pub restarts: AtomicU64,
    /// `AllBlocksCleared` events from the engine (a prefix-cache reset), each applied as a
    /// clear of the replica's residency.
    pub cleared: AtomicU64,
}

/// Where the consumer's decisions go: applied events, in order.
pub trait EventSink: Send + Sync + 'static {
    /// Applies one batch's events.
    fn apply(&self, events: &[KvEvent]);
}

/// Sequence tracking, separated from the socket so it can be tested deterministically.
#[derive(Debug, Default)]
pub struct SeqTracker {
    expected: Option<u64>,
}

/// What to do about a received sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqVerdict {
    /// In order: apply it.
    InOrder,
    /// Batches `from..to` were missed: repair them before applying this one.
    Gap {
        /// First missed sequence number.
        from: u64,
        /// This batch's sequence number.
        to: u64,
    },
    /// The sequence went backwards: the engine restarted, so its cache is empty; batches
    /// `0..to` of the new engine were missed when `to > 0`.
    Restarted {
        /// This batch's sequence number.
        to: u64,
    },
}

impl SeqTracker {
    /// Classifies `seq` given everything accepted so far. A fresh subscriber expects sequence 0
    /// (it joined before the engine published anything); anything else is a late join.
    pub fn check(&self, seq: u64) -> SeqVerdict {
        match self.expected {
            None if seq == 0 => SeqVerdict::InOrder,
            None => SeqVerdict::Gap { from: 0, to: seq },
            Some(e) if seq == e => SeqVerdict::InOrder,
            Some(e) if seq > e => SeqVerdict::Gap { from: e, to: seq },
            Some(_) => SeqVerdict::Restarted { to: seq },
        }
    }

    /// The last sequence number applied, if any.
    pub fn last(&self) -> Option<u64> {
        self.expected.map(|e| e.wrapping_sub(1))
    }

    /// Marks `seq` as applied.
    pub fn accept(&mut self, seq: u64) {
        self.expected = Some(seq.wrapping_add(1));
    }
}

/// Splits a SUB message into (sequence, payload); tolerates a missing topic frame.
fn split_message(frames: &[bytes::Bytes]) -> Option<(u64, &[u8])> {
    let (seq, payload) = match frames.len() {
        3 => (&frames[1], &frames[2]),
        2 => (&frames[0], &frames[1]),
        _ => return None,
    };
    let seq: [u8; 8] = seq.as_ref().try_into().ok()?;
    Some((u64::from_be_bytes(seq), payload.as_ref()))
}

/// Endpoints of one replica's event stream.
#[derive(Debug, Clone)]
pub struct EventEndpoints {
    /// PUB endpoint to subscribe to.
    pub publisher: String,
    /// ROUTER replay endpoint, when known.
    pub replay: Option<String>,
    /// Which engine publishes them.
    pub format: EventFormat,
}

/// How often an idle subscriber looks for a lost publisher connection.
const MONITOR_POLL: Duration = Duration::from_millis(200);

/// How long a replay request may take before the gap is declared unrepairable.
const REPLAY_TIMEOUT: Duration = Duration::from_millis(1000);

/// One replica's event stream as the router consumes it: the sequence tracker and what each
/// message, gap, restart or lost connection does to the replica's residency. Separated from
/// the socket ([`run_subscriber`] drives it) so that restarts and gaps can be tested message by
/// message.
pub struct StreamConsumer {
    ep: EventEndpoints,
    sink: Arc<dyn EventSink>,
    stats: Arc<EventStats>,
    seq: SeqTracker,
}

impl StreamConsumer {
    /// A consumer that has seen nothing yet (it expects sequence 0).
    pub fn new(ep: EventEndpoints, sink: Arc<dyn EventSink>, stats: Arc<EventStats>) -> Self {
        StreamConsumer {
            ep,
            sink,
            stats,
            seq: SeqTracker::default(),
        }
    }

    /// The connection to the publisher was lost. An engine that restarts closes it, and its
    /// successor starts again from sequence 0 with an empty cache; a sequence that resumes above
    /// the last one seen would not reveal that. So the replica's residency is dropped now and
    /// the tracker starts over: the next batch is in order at sequence 0, and anything later is
    /// repaired from replay as a late join (or, unrepaired, leaves the replica cleared). Counted
    /// in [`EventStats::restarts`] and logged.
    pub fn publisher_lost(&mut self) {
        self.restarted(&format!(
            "lost the connection to the publisher after sequence {}",
            self.seq
                .last()
                .map_or("(none)".to_string(), |s| s.to_string())
        ));
        self.seq = SeqTracker::default();
    }

    fn restarted(&self, why: &str) {
        let n = self.stats.restarts.fetch_add(1, Ordering::Relaxed) + 1;
        eprintln!(
            "kvroute: KV events from {}: {why}: engine restart assumed, dropping its residency (restart {n})",
            self.ep.publisher
        );
        self.sink.apply(&[KvEvent::AllCleared]);
    }

    /// Replays the batches `[from, to)`; when that fails (no replay endpoint, or an incomplete
    /// answer) the gap is unrepaired and the replica's residency is cleared.
    async fn repair_or_clear(&self, from: u64, to: u64) {
        let (ep, sink, stats) = (&self.ep, &*self.sink, &*self.stats);
        let repaired = match &ep.replay {
            Some(replay) => replay_range(replay, from, to, ep.format, sink, stats).await,
            None => false,
        };
        if !repaired {
            stats.gaps_unrepaired.fetch_add(1, Ordering::Relaxed);
            sink.apply(&[KvEvent::AllCleared]);
        }
    }

    /// Consumes one message, `seq` and its msgpack `payload`: a gap is repaired from replay
    /// first (else the replica is cleared), a sequence that goes backwards is an engine restart
    /// (residency dropped, the new engine's earlier batches replayed), then the batch is applied.
    pub async fn message(&mut self, seq: u64, payload: &[u8]) {
        let (ep, sink, stats) = (&self.ep, &*self.sink, &*self.stats);
        match self.seq.check(seq) {
            SeqVerdict::InOrder => {}
            SeqVerdict::Restarted { to } => {
                stats.gaps.fetch_add(1, Ordering::Relaxed);
                self.restarted(&format!(
                    "sequence went back from {} to {seq}",
                    self.seq.last().unwrap_or(0)
                ));
                if to > 0 {
                    self.repair_or_clear(0, to).await;
                }
            }
            SeqVerdict::Gap { from, to } => {
                stats.gaps.fetch_add(1, Ordering::Relaxed);
                self.repair_or_clear(from, to).await;
            }
        }
        match decode_batch(payload, ep.format) {
            Ok(batch) => apply_batch(&batch, sink, stats),
            Err(_) => {
                // A batch we cannot read is a batch we missed.
                stats.decode_errors.fetch_add(1, Ordering::Relaxed);
                stats.gaps_unrepaired.fetch_add(1, Ordering::Relaxed);
                sink.apply(&[KvEvent::AllCleared]);
            }
        }
        self.seq.accept(seq);
    }
}

/// Applies one decoded batch and counts it (its skipped events, its `AllBlocksCleared`).
fn apply_batch(batch: &EventBatch, sink: &dyn EventSink, stats: &EventStats) {
    stats
        .unknown_events
        .fetch_add(u64::from(batch.unknown_events), Ordering::Relaxed);
    stats
        .other_tier_events
        .fetch_add(u64::from(batch.other_tier_events), Ordering::Relaxed);
    let cleared = batch
        .events
        .iter()
        .filter(|e| matches!(e, KvEvent::AllCleared))
        .count();
    if cleared > 0 {
        stats.cleared.fetch_add(cleared as u64, Ordering::Relaxed);
    }
    sink.apply(&batch.events);
    stats.batches.fetch_add(1, Ordering::Relaxed);
}

/// Subscribes and consumes one replica's event stream forever (abort the task to stop it).
/// `connected` fires once the SUB socket is connected and subscribed. The socket reconnects on
/// its own when the publisher goes away; each lost connection goes to
/// [`StreamConsumer::publisher_lost`] before any message of the next connection is read.
pub async fn run_subscriber(
    ep: EventEndpoints,
    sink: Arc<dyn EventSink>,
    stats: Arc<EventStats>,
    connected: Option<tokio::sync::oneshot::Sender<()>>,
) {
    use zeromq::{Socket, SocketEvent, SocketRecv};
    let mut connected = connected;
    loop {
        let mut sub = zeromq::SubSocket::new();
        let mut monitor = sub.monitor();
        if sub.connect(&ep.publisher).await.is_err() || sub.subscribe("").await.is_err() {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        if let Some(tx) = connected.take() {
            let _ = tx.send(());
        }
        let mut consumer = StreamConsumer::new(ep.clone(), sink.clone(), stats.clone());
        let mut tick = tokio::time::interval(MONITOR_POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            // A lost connection is reported (from inside `recv`, before the socket reconnects)
            // on the monitor channel: drained on a timer, so an idle replica is cleared soon
            // after its engine goes away, and before every message, so the clear always comes
            // before the next connection's first batch. (`recv` loses nothing when the timer
            // wins: it returns a message only from the poll that took it.)
            let msg = tokio::select! {
                m = sub.recv() => Some(m),
                _ = tick.tick() => None,
            };
            while let Ok(ev) = monitor.try_recv() {
                if let SocketEvent::Disconnected(_) = ev {
                    consumer.publisher_lost();
                }
            }
            let Some(msg) = msg else {
                continue;
            };
            let msg = match msg {
                Ok(m) => m,
                Err(_) => {
                    // The socket reconnects on its own; pause so a dead peer cannot spin us.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let frames = msg.into_vec();
            let Some((seq, payload)) = split_message(&frames) else {
                stats.decode_errors.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            consumer.message(seq, payload).await;
        }
    }
}

/// Asks the replay socket for batches `from..to` and applies them in order. True when every
/// missing batch was recovered.
async fn replay_range(
    endpoint: &str,
    from: u64,
    to: u64,
    format: EventFormat,
    sink: &dyn EventSink,
    stats: &EventStats,
) -> bool {
    let fetched = tokio::time::timeout(REPLAY_TIMEOUT, fetch_replay(endpoint, from, to)).await;
    let Ok(Ok(batches)) = fetched else {
        return false;
    };
    let mut next = from;
    let mut decoded = Vec::with_capacity(batches.len());
    for (seq, payload) in batches {
        if seq < next {
            continue;
        }
        if seq != next {
            return false;
        }
        match decode_batch(&payload, format) {
            Ok(b) => decoded.push(b),
            Err(_) => return false,
        }
        next += 1;
        if next == to {
            break;
        }
    }
    if next != to {
        return false;
    }
    for b in decoded {
        sink.apply(&b.events);
        stats.batches.fetch_add(1, Ordering::Relaxed);
    }
    true
}

/// One replay round trip over a DEALER socket, framed as the engines' ROUTER expects: an empty
/// delimiter then the 8-byte start sequence (`_service_replay` reads `[identity, "", start]`).
/// Answers come as [`parse_replay_frames`] reads them, until [`REPLAY_END_SEQ`] or `to - 1`.
async fn fetch_replay(
    endpoint: &str,
    from: u64,
    to: u64,
) -> Result<Vec<(u64, Vec<u8>)>, zeromq::ZmqError> {
    use zeromq::{Socket, SocketRecv, SocketSend};
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(endpoint).await?;
    let req: Vec<bytes::Bytes> = vec![
        bytes::Bytes::new(),
        bytes::Bytes::copy_from_slice(&from.to_be_bytes()),
    ];
    let req = zeromq::ZmqMessage::try_from(req).map_err(|_| zeromq::ZmqError::NoMessage)?;
    dealer.send(req).await?;
    let mut out = Vec::new();
    loop {
        let frames = dealer.recv().await?.into_vec();
        let Some((seq, payload)) = parse_replay_frames(&frames) else {
            return Err(zeromq::ZmqError::NoMessage);
        };
        if seq == REPLAY_END_SEQ {
            return Ok(out);
        }
        out.push((seq, payload.to_vec()));
        if seq + 1 >= to {
            return Ok(out);
        }
    }
}

/// One replay answer as a DEALER receives it: the empty delimiter, then `[topic, seq, payload]`
/// (vLLM 0.33.0 and SGLang 0.5.23 send the topic, empty on the end marker) or `[seq, payload]`
/// (vLLM @ b4e69e0). Exactly one delimiter is stripped, because the topic itself may be empty.
pub fn parse_replay_frames(frames: &[bytes::Bytes]) -> Option<(u64, &[u8])> {
    let rest = match frames.split_first() {
        Some((delim, rest)) if delim.is_empty() => rest,
        _ => frames,
    };
    let (seq, payload) = match rest {
        [_topic, seq, payload] => (seq, payload),
        [seq, payload] => (seq, payload),
        _ => return None,
    };
    let seq: [u8; 8] = seq.as_ref().try_into().ok()?;
    Some((u64::from_be_bytes(seq), payload.as_ref()))
}

/// Msgpack encoders for tests and tools that need to publish vLLM-shaped events (the engine
/// emulator has its own publisher; these exist so the router can be tested without it).
pub mod encode {
    use kv_index::KvEvent;
    use rmpv::Value;

    /// Event encoding, as vLLM releases differ.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Encoding {
        /// Positional arrays (older vLLM).
        Array,
        /// Maps with a `type` key, defaults omitted (newer vLLM).
        Map,
    }

    fn u64s(v: &[u64]) -> Value {
        Value::Array(v.iter().map(|&h| Value::from(h)).collect())
    }

    fn event(e: &KvEvent, enc: Encoding) -> Value {
        let s = |x: &str| Value::from(x);
        match (e, enc) {
            (
                KvEvent::Stored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    ..
                },
                Encoding::Array,
            ) => Value::Array(vec![
                s("BlockStored"),
                u64s(block_hashes),
                parent_block_hash.map_or(Value::Nil, Value::from),
                Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
                Value::from(*block_size),
                Value::Nil,
                s("GPU"),
            ]),
            (
                KvEvent::Stored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    ..
                },
                Encoding::Map,
            ) => {
                let mut m = vec![
                    (s("type"), s("BlockStored")),
                    (s("block_hashes"), u64s(block_hashes)),
                    (
                        s("token_ids"),
                        Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
                    ),
                    (s("block_size"), Value::from(*block_size)),
                ];
                if let Some(p) = parent_block_hash {
                    m.push((s("parent_block_hash"), Value::from(*p)));
                }
                Value::Map(m)
            }
            (KvEvent::Removed { block_hashes }, Encoding::Array) => {
                Value::Array(vec![s("BlockRemoved"), u64s(block_hashes), s("GPU")])
            }
            (KvEvent::Removed { block_hashes }, Encoding::Map) => Value::Map(vec![
                (s("type"), s("BlockRemoved")),
                (s("block_hashes"), u64s(block_hashes)),
            ]),
            (KvEvent::AllCleared, Encoding::Array) => Value::Array(vec![s("AllBlocksCleared")]),
            (KvEvent::AllCleared, Encoding::Map) => {
                Value::Map(vec![(s("type"), s("AllBlocksCleared"))])
            }
        }
    }

    /// Encodes a batch `[ts, events, dp_rank]` as msgpack.
    pub fn batch(ts: f64, events: &[KvEvent], enc: Encoding) -> Vec<u8> {
        let v = Value::Array(vec![
            Value::from(ts),
            Value::Array(events.iter().map(|e| event(e, enc)).collect()),
            Value::from(0),
        ]);
        let mut out = Vec::new();
        // Writing msgpack into a Vec cannot fail.
        let _ = rmpv::encode::write_value(&mut out, &v);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::encode::{Encoding, batch};
    use super::*;

    fn sample() -> Vec<KvEvent> {
        vec![
            KvEvent::Stored {
                block_hashes: vec![1, u64::MAX],
                parent_block_hash: None,
                token_ids: (0..32).collect(),
                block_size: 16,
                cache_salt: None,
            },
            KvEvent::Stored {
                block_hashes: vec![3],
                parent_block_hash: Some(u64::MAX),
                token_ids: (32..48).collect(),
                block_size: 16,
                cache_salt: None,
            },
            KvEvent::Removed {
                block_hashes: vec![3],
            },
            KvEvent::AllCleared,
        ]
    }

    #[test]
    fn both_encodings_round_trip() {
        for enc in [Encoding::Array, Encoding::Map] {
            let b = decode_batch(&batch(1.25, &sample(), enc), EventFormat::Vllm).unwrap();
            assert_eq!(b.events, sample(), "{enc:?}");
            assert_eq!(b.ts, 1.25);
            assert_eq!(b.unknown_events, 0);
        }
    }

    #[test]
    fn signed_and_binary_hashes_and_unknown_events() {
        let v = Value::Array(vec![
            Value::from(2.0),
            Value::Array(vec![
                Value::Array(vec![
                    Value::from("BlockRemoved"),
                    Value::Array(vec![
                        Value::from(-1i64),
                        Value::Binary(vec![0, 0, 0, 0, 0, 0, 1, 2, 99]),
                    ]),
                ]),
                Value::Array(vec![Value::from("SomethingNew"), Value::from(1)]),
            ]),
        ]);
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, &v).unwrap();
        let b = decode_batch(&buf, EventFormat::Vllm).unwrap();
        assert_eq!(
            b.events,
            vec![KvEvent::Removed {
                block_hashes: vec![u64::MAX, 0x0102]
            }]
        );
        assert_eq!(b.unknown_events, 1);
    }

    fn stored_map(extra: Vec<(&str, Value)>) -> Value {
        let mut m = vec![
            (Value::from("type"), Value::from("BlockStored")),
            (
                Value::from("block_hashes"),
                Value::Array(vec![Value::from(1)]),
            ),
            (Value::from("parent_block_hash"), Value::Nil),
            (
                Value::from("token_ids"),
                Value::Array((0..16).map(Value::from).collect()),
            ),
            (Value::from("block_size"), Value::from(16)),
        ];
        m.extend(extra.into_iter().map(|(k, v)| (Value::from(k), v)));
        Value::Map(m)
    }

    fn one_event(ev: Value, format: EventFormat) -> EventBatch {
        let v = Value::Array(vec![Value::from(0.0), Value::Array(vec![ev])]);
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, &v).unwrap();
        decode_batch(&buf, format).unwrap()
    }

    fn salt_of(b: &EventBatch) -> Option<&str> {
        match &b.events[..] {
            [KvEvent::Stored { cache_salt, .. }] => cache_salt.as_deref(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn vllm_salt_comes_after_the_lora_name_and_ignores_mm_pairs_and_digests() {
        let keys = |k: Vec<Value>| Value::Array(vec![Value::Array(k), Value::Nil]);
        let with_lora = stored_map(vec![
            ("lora_name", Value::from("adapter")),
            (
                "extra_keys",
                keys(vec![
                    Value::from("adapter"),
                    Value::Array(vec![Value::from("mm-hash"), Value::from(0)]),
                    Value::from("tenant"),
                    Value::Binary(vec![1, 2]),
                ]),
            ),
        ]);
        assert_eq!(
            salt_of(&one_event(with_lora, EventFormat::Vllm)),
            Some("tenant")
        );
        // Without a salt, a LoRA name alone is not one.
        let lora_only = stored_map(vec![
            ("lora_name", Value::from("adapter")),
            ("extra_keys", keys(vec![Value::from("adapter")])),
        ]);
        assert_eq!(salt_of(&one_event(lora_only, EventFormat::Vllm)), None);
    }

    #[test]
    fn events_of_another_tier_are_skipped_and_counted() {
        for (medium, format) in [
            ("CPU", EventFormat::Vllm),
            ("CPU_PINNED", EventFormat::Sglang),
        ] {
            let b = one_event(stored_map(vec![("medium", Value::from(medium))]), format);
            assert!(b.events.is_empty(), "{medium}");
            assert_eq!(b.other_tier_events, 1);
            let removed = Value::Array(vec![
                Value::from("BlockRemoved"),
                Value::Array(vec![Value::from(1)]),
                Value::from(medium),
            ]);
            assert_eq!(one_event(removed, format).other_tier_events, 1);
        }
        let gpu = one_event(
            stored_map(vec![("medium", Value::from("GPU"))]),
            EventFormat::Vllm,
        );
        assert_eq!((gpu.events.len(), gpu.other_tier_events), (1, 0));
    }

    #[test]
    fn malformed_payloads_are_errors_not_panics() {
        assert!(decode_batch(b"", EventFormat::Vllm).is_err());
        assert!(decode_batch(&[0xc1], EventFormat::Vllm).is_err());
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, &Value::from(5)).unwrap();
        assert!(decode_batch(&buf, EventFormat::Vllm).is_err());
        let bad = Value::Array(vec![
            Value::from(0.0),
            Value::Array(vec![Value::Array(vec![
                Value::from("BlockStored"),
                Value::from(1),
            ])]),
        ]);
        buf.clear();
        rmpv::encode::write_value(&mut buf, &bad).unwrap();
        assert!(decode_batch(&buf, EventFormat::Vllm).is_err());
    }

    #[test]
    fn sequence_tracking() {
        let mut t = SeqTracker::default();
        assert_eq!(t.last(), None);
        assert_eq!(t.check(0), SeqVerdict::InOrder);
        t.accept(0);
        assert_eq!(t.last(), Some(0));
        assert_eq!(t.check(1), SeqVerdict::InOrder);
        t.accept(1);
        assert_eq!(t.check(4), SeqVerdict::Gap { from: 2, to: 4 });
        t.accept(4);
        assert_eq!(t.check(3), SeqVerdict::Restarted { to: 3 });
        assert_eq!(t.check(0), SeqVerdict::Restarted { to: 0 });
        let fresh = SeqTracker::default();
        assert_eq!(fresh.check(7), SeqVerdict::Gap { from: 0, to: 7 });
    }

    #[test]
    fn message_split_tolerates_missing_topic() {
        let seq = bytes::Bytes::copy_from_slice(&9u64.to_be_bytes());
        let p = bytes::Bytes::from_static(b"x");
        assert_eq!(
            split_message(&[bytes::Bytes::from_static(b"kv"), seq.clone(), p.clone()]),
            Some((9, &b"x"[..]))
        );
        assert_eq!(split_message(&[seq, p.clone()]), Some((9, &b"x"[..])));
        assert_eq!(split_message(&[p]), None);
    }
}
