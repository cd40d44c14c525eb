//! Router configuration (what `router`'s flags and `--config` file fill in).

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// One upstream replica.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaSpec {
    /// Base URL, e.g. `http://127.0.0.1:8000` (paths are appended to it).
    pub url: String,
    /// KV event PUB endpoint (`tcp://…`), for exact residency.
    #[serde(default)]
    pub kv_events: Option<String>,
    /// KV event replay (ROUTER) endpoint, used to repair sequence gaps.
    #[serde(default)]
    pub kv_replay: Option<String>,
}

impl ReplicaSpec {
    /// A replica with only a URL.
    pub fn new(url: impl Into<String>) -> Self {
        ReplicaSpec {
            url: url.into(),
            kv_events: None,
            kv_replay: None,
        }
    }
}

/// Everything the router needs to start.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Listen address.
    pub host: String,
    /// Listen port (0 = ephemeral).
    pub port: u16,
    /// Replicas, ids assigned in this order.
    pub replicas: Vec<ReplicaSpec>,
    /// The routing policy.
    pub policy: policies::PolicySpec,
    /// `router.csv` path; `None` writes no rows.
    pub rows: Option<PathBuf>,
    /// Salt for belief keys and the model for `/tokenize`; `None` uses each request's `model`.
    /// (Exact keys use `policy.salt` and `policy.tokens_per_block`, which the policy's
    /// event-fed index shares.)
    pub model: Option<String>,
    /// Belief block size in bytes.
    pub block_bytes: usize,
    /// Estimated canonical-rendering bytes per engine token, which converts matched belief
    /// blocks into predicted engine tokens (`predicted_match_tokens`). Default
    /// [`policies::DEFAULT_BELIEF_BYTES_PER_TOKEN`], measured for the emulator's tokenizer; an
    /// estimate for real models.
    pub bytes_per_token: f64,
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
    /// Health-check period.
    pub health_interval_ms: u64,
    /// Tokio worker threads.
    pub workers: usize,
    /// How long graceful shutdown waits for in-flight responses before cutting them.
    pub shutdown_grace_ms: u64,
    /// Capacity of the row queue.
    pub rows_queue: usize,
}

impl RouterConfig {
    /// Defaults for everything but the replicas and the policy.
    pub fn new(replicas: Vec<ReplicaSpec>, policy: policies::PolicySpec) -> Self {
        RouterConfig {
            host: "127.0.0.1".into(),
            port: 0,
            replicas,
            policy,
            rows: None,
            model: None,
            block_bytes: 64,
            bytes_per_token: policies::DEFAULT_BELIEF_BYTES_PER_TOKEN,
            max_body_bytes: 8 << 20,
            health_interval_ms: 1000,
            workers: 1,
            shutdown_grace_ms: 30_000,
            rows_queue: crate::rows::DEFAULT_QUEUE_ROWS,
        }
    }
}

/// A replica list from a config file: a JSON array of replicas, or an object with a `replicas`
/// array. Each replica is `{"url": …, "kv_events": …, "kv_replay": …}` or a bare URL string.
pub fn load_replicas_file(path: &Path) -> Result<Vec<ReplicaSpec>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse_replicas_json(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Parses the config-file replica list (see [`load_replicas_file`]).
pub fn parse_replicas_json(text: &str) -> Result<Vec<ReplicaSpec>, String> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Entry {
        Url(String),
        Full(ReplicaSpec),
    }
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum File {
        List(Vec<Entry>),
        Obj { replicas: Vec<Entry> },
    }
    let f: File = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let entries = match f {
        File::List(v) | File::Obj { replicas: v } => v,
    };
    let out: Vec<ReplicaSpec> = entries
        .into_iter()
        .map(|e| match e {
            Entry::Url(u) => ReplicaSpec::new(u),
            Entry::Full(r) => r,
        })
        .collect();
    for r in &out {
        crate::upstream::parse_base_url(&r.url)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_file_forms() {
        let a = parse_replicas_json(
            r#"["http://127.0.0.1:1", {"url":"http://h:2","kv_events":"tcp://h:3"}]"#,
        )
        .unwrap();
        assert_eq!(a[0], ReplicaSpec::new("http://127.0.0.1:1"));
        assert_eq!(a[1].kv_events.as_deref(), Some("tcp://h:3"));
        let b = parse_replicas_json(r#"{"replicas":["http://127.0.0.1:1"]}"#).unwrap();
        assert_eq!(b.len(), 1);
        assert!(parse_replicas_json(r#"{"replicas":[{"uri":"x"}]}"#).is_err());
        assert!(parse_replicas_json(r#"["not a url"]"#).is_err());
    }
}
