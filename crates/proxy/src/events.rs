//! KV event consumer: vLLM's ZMQ/msgpack event stream → [`kv_index::KvEvent`].
//!
//! Wire format (REFERENCE.md §4): each message is three frames — topic, an 8-byte big-endian
//! sequence number, and a msgpack batch `[ts, events, data_parallel_rank]`. Events come either as
//! positional arrays (`["BlockStored", hashes, parent, token_ids, block_size, lora_id, …]`, older
//! vLLM) or as maps with a `"type"` key (newer vLLM, defaults omitted); both decode here.
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

/// A decoded event batch.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Engine timestamp (seconds, engine clock).
    pub ts: f64,
    /// Events in order.
    pub events: Vec<KvEvent>,
    /// Events of kinds this consumer does not know (skipped, counted).
    pub unknown_events: u32,
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

/// Decodes one msgpack batch payload.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut rd = payload;
    let v = rmpv::decode::read_value(&mut rd).map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    let (ts, events) = match &v {
        Value::Array(items) if items.len() >= 2 => (&items[0], &items[1]),
        Value::Map(_) => (
            map_get(&v, "ts").ok_or(DecodeError::Shape("batch map without ts"))?,
            map_get(&v, "events").ok_or(DecodeError::Shape("batch map without events"))?,
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
    };
    for ev in raw_events {
        match decode_event(ev)? {
            Some(e) => out.events.push(e),
            None => out.unknown_events += 1,
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

/// Decodes one event; `Ok(None)` for a well-formed event of an unknown kind.
fn decode_event(ev: &Value) -> Result<Option<KvEvent>, DecodeError> {
    match ev {
        Value::Array(items) => {
            let tag = items
                .first()
                .and_then(Value::as_str)
                .ok_or(DecodeError::Shape("event without tag"))?;
            let at = |i: usize| items.get(i).unwrap_or(&Value::Nil);
            Ok(match tag {
                "BlockStored" => Some(stored(at(1), at(2), at(3), at(4))?),
                "BlockRemoved" => Some(KvEvent::Removed {
                    block_hashes: hashes(at(1))?,
                }),
                "AllBlocksCleared" => Some(KvEvent::AllCleared),
                _ => None,
            })
        }
        Value::Map(_) => {
            let tag = map_get(ev, "type")
                .and_then(Value::as_str)
                .ok_or(DecodeError::Shape("event map without type"))?;
            let f = |k: &str| map_get(ev, k).unwrap_or(&Value::Nil);
            Ok(match tag {
                "BlockStored" => Some(stored(
                    f("block_hashes"),
                    f("parent_block_hash"),
                    f("token_ids"),
                    f("block_size"),
                )?),
                "BlockRemoved" => Some(KvEvent::Removed {
                    block_hashes: hashes(f("block_hashes"))?,
                }),
                "AllBlocksCleared" => Some(KvEvent::AllCleared),
                _ => None,
            })
        }
        _ => Err(DecodeError::Shape("event is neither array nor map")),
    }
}

fn stored(
    block_hashes: &Value,
    parent: &Value,
    token_ids: &Value,
    block_size: &Value,
) -> Result<KvEvent, DecodeError> {
    let block_hashes = hashes(block_hashes)?;
    let parent_block_hash = match parent {
        Value::Nil => None,
        v => Some(hash(v)?),
    };
    let Value::Array(toks) = token_ids else {
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
    let block_size = match block_size {
        Value::Nil => 16,
        v => v
            .as_u64()
            .and_then(|b| u32::try_from(b).ok())
            .filter(|&b| b > 0)
            .ok_or(DecodeError::Shape("bad block_size"))?,
    };
    Ok(KvEvent::Stored {
        block_hashes,
        parent_block_hash,
        token_ids,
        block_size,
    })
}

fn hashes(v: &Value) -> Result<Vec<u64>, DecodeError> {
    match v {
        Value::Array(items) => items.iter().map(hash).collect(),
        _ => Err(DecodeError::Shape("block_hashes is not an array")),
    }
}

/// An engine block hash as a u64: integers as their 64-bit pattern (vLLM may send them signed);
/// byte strings (sha256-style hashes) folded from their first eight bytes, big-endian — engine
/// hashes only need to be stable, since keys are re-derived from token ids.
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
}

/// How long a replay request may take before the gap is declared unrepairable.
const REPLAY_TIMEOUT: Duration = Duration::from_millis(1000);

/// Subscribes and consumes one replica's event stream forever (abort the task to stop it).
/// `connected` fires once the SUB socket is connected and subscribed.
pub async fn run_subscriber(
    ep: EventEndpoints,
    sink: Arc<dyn EventSink>,
    stats: Arc<EventStats>,
    connected: Option<tokio::sync::oneshot::Sender<()>>,
) {
    use zeromq::{Socket, SocketRecv};
    let mut connected = connected;
    loop {
        let mut sub = zeromq::SubSocket::new();
        if sub.connect(&ep.publisher).await.is_err() || sub.subscribe("").await.is_err() {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        if let Some(tx) = connected.take() {
            let _ = tx.send(());
        }
        let mut seq_tracker = SeqTracker::default();
        loop {
            let msg = match sub.recv().await {
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
            match seq_tracker.check(seq) {
                SeqVerdict::InOrder => {}
                SeqVerdict::Restarted { to } => {
                    stats.gaps.fetch_add(1, Ordering::Relaxed);
                    sink.apply(&[KvEvent::AllCleared]);
                    if to > 0 {
                        let repaired = match &ep.replay {
                            Some(replay) => replay_range(replay, 0, to, &*sink, &stats).await,
                            None => false,
                        };
                        if !repaired {
                            stats.gaps_unrepaired.fetch_add(1, Ordering::Relaxed);
                            sink.apply(&[KvEvent::AllCleared]);
                        }
                    }
                }
                SeqVerdict::Gap { from, to } => {
                    stats.gaps.fetch_add(1, Ordering::Relaxed);
                    let repaired = match &ep.replay {
                        Some(replay) => replay_range(replay, from, to, &*sink, &stats).await,
                        None => false,
                    };
                    if !repaired {
                        stats.gaps_unrepaired.fetch_add(1, Ordering::Relaxed);
                        sink.apply(&[KvEvent::AllCleared]);
                    }
                }
            }
            match decode_batch(payload) {
                Ok(batch) => {
                    stats
                        .unknown_events
                        .fetch_add(u64::from(batch.unknown_events), Ordering::Relaxed);
                    sink.apply(&batch.events);
                    stats.batches.fetch_add(1, Ordering::Relaxed);
                }
                Err(_) => {
                    // A batch we cannot read is a batch we missed.
                    stats.decode_errors.fetch_add(1, Ordering::Relaxed);
                    stats.gaps_unrepaired.fetch_add(1, Ordering::Relaxed);
                    sink.apply(&[KvEvent::AllCleared]);
                }
            }
            seq_tracker.accept(seq);
        }
    }
}

/// Asks the replay socket for batches `from..to` and applies them in order. True when every
/// missing batch was recovered.
async fn replay_range(
    endpoint: &str,
    from: u64,
    to: u64,
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
        match decode_batch(&payload) {
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

/// One replay round trip over a DEALER socket, framed as vLLM's ROUTER expects: an empty
/// delimiter then the 8-byte start sequence; answers are `[seq, payload]` (after an optional
/// empty delimiter), ending with [`REPLAY_END_SEQ`].
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
        let frames: Vec<&bytes::Bytes> = frames.iter().skip_while(|f| f.is_empty()).collect();
        let Some(seq) = frames
            .first()
            .and_then(|f| <[u8; 8]>::try_from(f.as_ref()).ok())
        else {
            return Err(zeromq::ZmqError::NoMessage);
        };
        let seq = u64::from_be_bytes(seq);
        if seq == REPLAY_END_SEQ {
            return Ok(out);
        }
        let payload = frames.get(1).map(|p| p.to_vec()).unwrap_or_default();
        out.push((seq, payload));
        if seq + 1 >= to {
            return Ok(out);
        }
    }
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
            },
            KvEvent::Stored {
                block_hashes: vec![3],
                parent_block_hash: Some(u64::MAX),
                token_ids: (32..48).collect(),
                block_size: 16,
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
            let b = decode_batch(&batch(1.25, &sample(), enc)).unwrap();
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
        let b = decode_batch(&buf).unwrap();
        assert_eq!(
            b.events,
            vec![KvEvent::Removed {
                block_hashes: vec![u64::MAX, 0x0102]
            }]
        );
        assert_eq!(b.unknown_events, 1);
    }

    #[test]
    fn malformed_payloads_are_errors_not_panics() {
        assert!(decode_batch(b"").is_err());
        assert!(decode_batch(&[0xc1]).is_err());
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, &Value::from(5)).unwrap();
        assert!(decode_batch(&buf).is_err());
        let bad = Value::Array(vec![
            Value::from(0.0),
            Value::Array(vec![Value::Array(vec![
                Value::from("BlockStored"),
                Value::from(1),
            ])]),
        ]);
        buf.clear();
        rmpv::encode::write_value(&mut buf, &bad).unwrap();
        assert!(decode_batch(&buf).is_err());
    }

    #[test]
    fn sequence_tracking() {
        let mut t = SeqTracker::default();
        assert_eq!(t.check(0), SeqVerdict::InOrder);
        t.accept(0);
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
