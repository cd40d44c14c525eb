//! vLLM KV cache events: the pure data, and their msgpack wire form (crates/engine-core README,
//! "KV events").
//!
//! A published batch is `[ts, events, data_parallel_rank]`. Each event is either a positional
//! array tagged by its name first (`["BlockStored", hashes, parent, token_ids, block_size,
//! lora_id, medium]`, older vLLM releases) or a map with a `"type"` key (newer releases). The
//! decoder accepts both, so a subscriber need not know which one the engine speaks.

use rmpv::Value;

/// One KV cache event, as vLLM's `kv_events` module defines it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// A contiguous run of one request's newly full blocks entered the prefix cache.
    BlockStored {
        /// Chained hashes of the stored blocks, in chain order.
        block_hashes: Vec<u64>,
        /// Hash of the block before the first stored one; `None` when the run starts the chain.
        parent_block_hash: Option<u64>,
        /// Exactly the stored blocks' tokens (`block_hashes.len() × block_size` ids).
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
    },
    /// Blocks were evicted (one event per evicted block in vLLM, one hash each).
    BlockRemoved {
        /// Hashes of the evicted blocks.
        block_hashes: Vec<u64>,
    },
    /// The whole prefix cache was cleared (`/reset_prefix_cache`).
    AllBlocksCleared,
}

/// How events are laid out inside a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Encoding {
    /// Positional arrays tagged by the event name (vLLM ≤ 0.10 style).
    #[default]
    Array,
    /// Maps with a `"type"` key, default-valued trailing fields omitted (newer vLLM).
    Map,
}

impl std::str::FromStr for Encoding {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "array" => Ok(Self::Array),
            "map" => Ok(Self::Map),
            other => Err(format!(
                "unknown kv event encoding {other:?} (expected array|map)"
            )),
        }
    }
}

/// The storage medium vLLM names for GPU-resident blocks.
pub const MEDIUM_GPU: &str = "GPU";

/// A decoded batch.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Wall-clock seconds (Unix epoch) at which the batch was published.
    pub ts: f64,
    /// The events, in the order they happened.
    pub events: Vec<KvEvent>,
    /// Data-parallel rank of the publishing engine.
    pub data_parallel_rank: Option<i64>,
}

/// Why a payload could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// Not valid msgpack.
    #[error("invalid msgpack: {0}")]
    Msgpack(String),
    /// Valid msgpack, but not shaped like a KV event batch.
    #[error("unexpected shape: {0}")]
    Shape(String),
}

fn hashes_value(h: &[u64]) -> Value {
    Value::Array(h.iter().map(|&x| Value::from(x)).collect())
}

fn event_value(ev: &KvEvent, enc: Encoding) -> Value {
    match (ev, enc) {
        (
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
            },
            _,
        ) => {
            let parent = parent_block_hash.map_or(Value::Nil, Value::from);
            let tokens = Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect());
            match enc {
                Encoding::Array => Value::Array(vec![
                    Value::from("BlockStored"),
                    hashes_value(block_hashes),
                    parent,
                    tokens,
                    Value::from(*block_size),
                    Value::Nil,
                    Value::from(MEDIUM_GPU),
                ]),
                Encoding::Map => Value::Map(vec![
                    (Value::from("type"), Value::from("BlockStored")),
                    (Value::from("block_hashes"), hashes_value(block_hashes)),
                    (Value::from("parent_block_hash"), parent),
                    (Value::from("token_ids"), tokens),
                    (Value::from("block_size"), Value::from(*block_size)),
                    (Value::from("lora_id"), Value::Nil),
                    (Value::from("medium"), Value::from(MEDIUM_GPU)),
                ]),
            }
        }
        (KvEvent::BlockRemoved { block_hashes }, Encoding::Array) => Value::Array(vec![
            Value::from("BlockRemoved"),
            hashes_value(block_hashes),
            Value::from(MEDIUM_GPU),
        ]),
        (KvEvent::BlockRemoved { block_hashes }, Encoding::Map) => Value::Map(vec![
            (Value::from("type"), Value::from("BlockRemoved")),
            (Value::from("block_hashes"), hashes_value(block_hashes)),
            (Value::from("medium"), Value::from(MEDIUM_GPU)),
        ]),
        (KvEvent::AllBlocksCleared, Encoding::Array) => {
            Value::Array(vec![Value::from("AllBlocksCleared")])
        }
        (KvEvent::AllBlocksCleared, Encoding::Map) => {
            Value::Map(vec![(Value::from("type"), Value::from("AllBlocksCleared"))])
        }
    }
}

/// Encodes one batch `[ts, events, data_parallel_rank]` as msgpack.
pub fn encode_batch(
    ts: f64,
    events: &[KvEvent],
    data_parallel_rank: u32,
    enc: Encoding,
) -> Vec<u8> {
    let v = Value::Array(vec![
        Value::F64(ts),
        Value::Array(events.iter().map(|e| event_value(e, enc)).collect()),
        Value::from(data_parallel_rank),
    ]);
    let mut out = Vec::with_capacity(64 + events.len() * 96);
    rmpv::encode::write_value(&mut out, &v).expect("writing to a Vec cannot fail");
    out
}

fn shape(msg: impl Into<String>) -> DecodeError {
    DecodeError::Shape(msg.into())
}

/// A block hash as vLLM may send it: a 64-bit integer, or bytes (the first 8, big-endian).
fn hash_of(v: &Value) -> Result<u64, DecodeError> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|x| x as u64))
            .ok_or_else(|| shape("hash integer out of range")),
        Value::Binary(b) => {
            let mut buf = [0u8; 8];
            let n = b.len().min(8);
            buf[8 - n..].copy_from_slice(&b[b.len() - n..]);
            Ok(u64::from_be_bytes(buf))
        }
        _ => Err(shape("hash is neither integer nor bytes")),
    }
}

fn hashes_of(v: &Value) -> Result<Vec<u64>, DecodeError> {
    v.as_array()
        .ok_or_else(|| shape("block_hashes is not an array"))?
        .iter()
        .map(hash_of)
        .collect()
}

fn tokens_of(v: &Value) -> Result<Vec<u32>, DecodeError> {
    v.as_array()
        .ok_or_else(|| shape("token_ids is not an array"))?
        .iter()
        .map(|t| {
            t.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| shape("token id is not a u32"))
        })
        .collect()
}

fn parent_of(v: Option<&Value>) -> Result<Option<u64>, DecodeError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(x) => hash_of(x).map(Some),
    }
}

fn decode_event(v: &Value) -> Result<KvEvent, DecodeError> {
    match v {
        Value::Array(a) => {
            let tag = a
                .first()
                .and_then(Value::as_str)
                .ok_or_else(|| shape("event array without a name tag"))?;
            match tag {
                "BlockStored" => Ok(KvEvent::BlockStored {
                    block_hashes: hashes_of(
                        a.get(1).ok_or_else(|| shape("BlockStored too short"))?,
                    )?,
                    parent_block_hash: parent_of(a.get(2))?,
                    token_ids: tokens_of(a.get(3).ok_or_else(|| shape("BlockStored too short"))?)?,
                    block_size: a
                        .get(4)
                        .and_then(Value::as_u64)
                        .and_then(|x| u32::try_from(x).ok())
                        .ok_or_else(|| shape("BlockStored block_size"))?,
                }),
                "BlockRemoved" => Ok(KvEvent::BlockRemoved {
                    block_hashes: hashes_of(
                        a.get(1).ok_or_else(|| shape("BlockRemoved too short"))?,
                    )?,
                }),
                "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
                other => Err(shape(format!("unknown event {other:?}"))),
            }
        }
        Value::Map(m) => {
            let get = |k: &str| {
                m.iter()
                    .find(|(key, _)| key.as_str() == Some(k))
                    .map(|(_, v)| v)
            };
            let tag = get("type")
                .and_then(Value::as_str)
                .ok_or_else(|| shape("event map without \"type\""))?;
            match tag {
                "BlockStored" => Ok(KvEvent::BlockStored {
                    block_hashes: hashes_of(
                        get("block_hashes").ok_or_else(|| shape("no block_hashes"))?,
                    )?,
                    parent_block_hash: parent_of(get("parent_block_hash"))?,
                    token_ids: tokens_of(get("token_ids").ok_or_else(|| shape("no token_ids"))?)?,
                    block_size: get("block_size")
                        .and_then(Value::as_u64)
                        .and_then(|x| u32::try_from(x).ok())
                        .ok_or_else(|| shape("BlockStored block_size"))?,
                }),
                "BlockRemoved" => Ok(KvEvent::BlockRemoved {
                    block_hashes: hashes_of(
                        get("block_hashes").ok_or_else(|| shape("no block_hashes"))?,
                    )?,
                }),
                "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
                other => Err(shape(format!("unknown event {other:?}"))),
            }
        }
        _ => Err(shape("event is neither array nor map")),
    }
}

/// Decodes a batch payload in either encoding.
pub fn decode_batch(mut bytes: &[u8]) -> Result<EventBatch, DecodeError> {
    let v =
        rmpv::decode::read_value(&mut bytes).map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    let a = v.as_array().ok_or_else(|| shape("batch is not an array"))?;
    let ts = match a.first() {
        Some(Value::F64(x)) => *x,
        Some(Value::F32(x)) => f64::from(*x),
        Some(Value::Integer(i)) => i.as_f64().unwrap_or(0.0),
        _ => return Err(shape("batch has no ts")),
    };
    let events = a
        .get(1)
        .and_then(Value::as_array)
        .ok_or_else(|| shape("batch has no event list"))?
        .iter()
        .map(decode_event)
        .collect::<Result<Vec<_>, _>>()?;
    let data_parallel_rank = a.get(2).and_then(Value::as_i64);
    Ok(EventBatch {
        ts,
        events,
        data_parallel_rank,
    })
}

/// Sequence number that ends a replay answer (`[END_SEQ, b""]`).
pub const END_SEQ: u64 = u64::MAX;

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<KvEvent> {
        vec![
            KvEvent::BlockStored {
                block_hashes: vec![1, u64::MAX - 3],
                parent_block_hash: None,
                token_ids: (0..32).collect(),
                block_size: 16,
            },
            KvEvent::BlockStored {
                block_hashes: vec![9],
                parent_block_hash: Some(u64::MAX - 3),
                token_ids: (100..116).collect(),
                block_size: 16,
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![9],
            },
            KvEvent::AllBlocksCleared,
        ]
    }

    #[test]
    fn round_trip_both_encodings() {
        for enc in [Encoding::Array, Encoding::Map] {
            let bytes = encode_batch(12.5, &sample(), 0, enc);
            let b = decode_batch(&bytes).expect("decodes");
            assert_eq!(b.events, sample());
            assert_eq!(b.ts, 12.5);
            assert_eq!(b.data_parallel_rank, Some(0));
        }
    }

    #[test]
    fn array_layout_matches_vllm() {
        let bytes = encode_batch(1.0, &sample()[..1], 0, Encoding::Array);
        let v = rmpv::decode::read_value(&mut &bytes[..]).expect("msgpack");
        let ev = &v[1][0];
        assert_eq!(ev[0].as_str(), Some("BlockStored"));
        assert!(ev[2].is_nil());
        assert_eq!(ev[4].as_u64(), Some(16));
        assert!(ev[5].is_nil());
        assert_eq!(ev[6].as_str(), Some("GPU"));
        let bytes = encode_batch(1.0, &sample()[..1], 0, Encoding::Map);
        let v = rmpv::decode::read_value(&mut &bytes[..]).expect("msgpack");
        assert_eq!(v[1][0]["type"].as_str(), Some("BlockStored"));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(decode_batch(&[0xc1]).is_err());
        assert!(decode_batch(&encode_batch(0.0, &[], 0, Encoding::Array)[..3]).is_err());
        let not_batch = {
            let mut out = Vec::new();
            rmpv::encode::write_value(&mut out, &Value::from("x")).expect("vec");
            out
        };
        assert!(decode_batch(&not_batch).is_err());
    }
}
