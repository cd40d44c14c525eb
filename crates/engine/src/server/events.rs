//! KV event publishing over ZMQ: a PUB socket with vLLM's three frames and a ROUTER replay socket.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use serde::Deserialize;
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::kv_events::{END_SEQ, Encoding, KvEvent, encode_batch};

/// Where and how KV events are published (vLLM's `--kv-events-config`, plus the encoding).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsConfig {
    /// PUB endpoint.
    pub endpoint: String,
    /// Bind (true) or connect (false) the PUB socket; vLLM's rule is [`should_bind`].
    pub bind: bool,
    /// ROUTER endpoint for replay, always bound; `None` disables replay.
    pub replay_endpoint: Option<String>,
    /// Topic frame of every message.
    pub topic: String,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// Event layout inside a batch.
    pub encoding: Encoding,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct VllmKvEventsJson {
    #[serde(default)]
    enable_kv_cache_events: bool,
    #[serde(default)]
    publisher: Option<String>,
    #[serde(default)]
    endpoint: Option<String>,
    #[serde(default)]
    replay_endpoint: Option<String>,
    #[serde(default)]
    buffer_steps: Option<usize>,
    #[serde(default)]
    hwm: Option<u64>,
    #[serde(default)]
    max_queue_size: Option<u64>,
    #[serde(default)]
    topic: Option<String>,
}

impl KvEventsConfig {
    /// Parses vLLM's `--kv-events-config` JSON. `Ok(None)` when events are disabled.
    pub fn from_vllm_json(json: &str, encoding: Encoding) -> Result<Option<Self>, EventsError> {
        let v: VllmKvEventsJson = serde_json::from_str(json).map_err(EventsError::ConfigJson)?;
        let _ = (v.hwm, v.max_queue_size);
        if !v.enable_kv_cache_events {
            return Ok(None);
        }
        match v.publisher.as_deref() {
            None | Some("zmq") => {}
            Some("null") => return Ok(None),
            Some(other) => return Err(EventsError::Publisher(other.to_string())),
        }
        let endpoint = v.endpoint.unwrap_or_else(|| "tcp://*:5557".to_owned());
        Ok(Some(Self {
            bind: should_bind(&endpoint),
            endpoint,
            replay_endpoint: v.replay_endpoint,
            topic: v.topic.unwrap_or_default(),
            buffer_steps: v.buffer_steps.unwrap_or(10_000),
            encoding,
        }))
    }
}

/// vLLM's rule: bind when the endpoint has a wildcard host (or a local transport).
pub fn should_bind(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

/// The zeromq crate resolves hosts, so a `*` host is spelled as the IPv4 wildcard.
fn bindable(endpoint: &str) -> Result<String, EventsError> {
    if !endpoint.starts_with("tcp://") {
        return Err(EventsError::NotTcp(endpoint.to_string()));
    }
    Ok(endpoint.replace("tcp://*:", "tcp://0.0.0.0:"))
}

/// A bound endpoint as a client should dial it (the wildcard becomes loopback).
fn dialable(endpoint: &str) -> String {
    endpoint.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")
}

/// Why the KV event sockets could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    /// `--kv-events-config` is not vLLM's JSON.
    #[error("invalid --kv-events-config: {0}")]
    ConfigJson(serde_json::Error),
    /// A publisher other than `zmq` or `null`.
    #[error("unsupported kv events publisher {0:?}")]
    Publisher(String),
    /// An endpoint of another transport than `tcp://`.
    #[error("only tcp:// KV event endpoints are supported, got {0:?}")]
    NotTcp(String),
    /// A socket could not bind.
    #[error("cannot bind KV {what} endpoint {endpoint}: {source}")]
    Bind {
        /// `events` (the PUB socket) or `replay` (the ROUTER socket).
        what: &'static str,
        /// The endpoint as configured.
        endpoint: String,
        /// zeromq's error.
        source: zeromq::ZmqError,
    },
}

/// Running publisher: the endpoints to announce and the task handles.
pub struct Publisher {
    /// PUB endpoint a subscriber should use.
    pub endpoint: String,
    /// Replay endpoint, when enabled.
    pub replay_endpoint: Option<String>,
    /// Background tasks (publisher, replay).
    pub tasks: Vec<tokio::task::JoinHandle<()>>,
}

type ReplayBuffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// Binds (or connects) the sockets and spawns the publisher and replay tasks.
pub async fn start(
    cfg: &KvEventsConfig,
    mut rx: mpsc::UnboundedReceiver<Vec<KvEvent>>,
) -> Result<Publisher, EventsError> {
    let mut pub_sock = PubSocket::new();
    let mut tasks = Vec::new();
    let endpoint = if cfg.bind {
        let ep = pub_sock
            .bind(&bindable(&cfg.endpoint)?)
            .await
            .map_err(|source| EventsError::Bind {
                what: "events",
                endpoint: cfg.endpoint.clone(),
                source,
            })?;
        dialable(&ep.to_string())
    } else {
        bindable(&cfg.endpoint)?;
        cfg.endpoint.clone()
    };
    let connect_to = (!cfg.bind).then(|| cfg.endpoint.clone());
    let buffer: ReplayBuffer = Arc::new(Mutex::new(VecDeque::new()));
    let replay_endpoint = match &cfg.replay_endpoint {
        None => None,
        Some(r) => {
            let mut router = RouterSocket::new();
            let ep = router
                .bind(&bindable(r)?)
                .await
                .map_err(|source| EventsError::Bind {
                    what: "replay",
                    endpoint: r.clone(),
                    source,
                })?;
            tasks.push(tokio::spawn(serve_replay(router, buffer.clone())));
            Some(dialable(&ep.to_string()))
        }
    };
    let topic = Bytes::from(cfg.topic.clone().into_bytes());
    let encoding = cfg.encoding;
    let keep = cfg.buffer_steps;
    let replay_on = cfg.replay_endpoint.is_some();
    tasks.push(tokio::spawn(async move {
        if let Some(ep) = connect_to {
            // Connect mode (a proxy in front): events before the connection are dropped, as
            // a PUB socket without peers does.
            if pub_sock.connect(&ep).await.is_err() {
                return;
            }
        }
        let mut seq: u64 = 0;
        while let Some(events) = rx.recv().await {
            let ts = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0);
            let payload = Bytes::from(encode_batch(ts, &events, 0, encoding));
            let frames = vec![
                topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload.clone(),
            ];
            if let Ok(msg) = ZmqMessage::try_from(frames) {
                let _ = pub_sock.send(msg).await;
            }
            if replay_on {
                let mut b = buffer.lock().expect("replay buffer lock");
                b.push_back((seq, payload));
                while b.len() > keep {
                    b.pop_front();
                }
            }
            seq += 1;
        }
    }));
    Ok(Publisher {
        endpoint,
        replay_endpoint,
        tasks,
    })
}

/// Answers replay requests: `[identity, (b"",) start_seq]` → `[seq, payload]…` then `[END_SEQ, b""]`.
async fn serve_replay(mut router: RouterSocket, buffer: ReplayBuffer) {
    loop {
        let Ok(msg) = router.recv().await else {
            return;
        };
        let frames = msg.into_vec();
        let (identity, delimited, start) = match frames.as_slice() {
            [id, empty, start] if empty.is_empty() => (id.clone(), true, start),
            [id, start] => (id.clone(), false, start),
            _ => continue,
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(u64::from_be_bytes) else {
            continue;
        };
        let batches: Vec<(u64, Bytes)> = buffer
            .lock()
            .expect("replay buffer lock")
            .iter()
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect();
        let reply = |seq: u64, payload: Bytes| {
            let mut f = vec![identity.clone()];
            if delimited {
                f.push(Bytes::new());
            }
            f.push(Bytes::copy_from_slice(&seq.to_be_bytes()));
            f.push(payload);
            ZmqMessage::try_from(f).expect("non-empty frames")
        };
        for (seq, payload) in batches {
            if router.send(reply(seq, payload)).await.is_err() {
                break;
            }
        }
        let _ = router.send(reply(END_SEQ, Bytes::new())).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_vllm_config_and_applies_bind_rule() {
        let c = KvEventsConfig::from_vllm_json(
            r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","topic":"kv@h:1@m"}"#,
            Encoding::Map,
        )
        .expect("valid")
        .expect("enabled");
        assert_eq!(c.endpoint, "tcp://*:5557");
        assert_eq!(c.topic, "kv@h:1@m");
        assert_eq!(c.encoding, Encoding::Map);
        assert!(should_bind(&c.endpoint));
        assert!(should_bind("tcp://[::]:5557"));
        assert!(!should_bind("tcp://10.0.0.1:5557"));
        assert_eq!(
            KvEventsConfig::from_vllm_json(r#"{"enable_kv_cache_events":false}"#, Encoding::Array)
                .unwrap(),
            None
        );
        assert!(KvEventsConfig::from_vllm_json("{", Encoding::Array).is_err());
        assert!(KvEventsConfig::from_vllm_json(r#"{"bogus":1}"#, Encoding::Array).is_err());
    }
}
