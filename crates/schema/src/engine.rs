//! Which inference engine serves a fleet, and what differs between the engines kvroute talks to:
//! a small, explicit adapter table instead of engine checks scattered through the crates.
//!
//! | | vLLM (and kvroute's emulator) | SGLang | llama.cpp `llama-server` |
//! |---|---|---|---|
//! | cached tokens | `usage.prompt_tokens_details.cached_tokens` (`--enable-prompt-tokens-details`) | same (`--enable-cache-report`) | same, and `timings.cache_n` |
//! | tokenize | `POST /tokenize {model, messages}` → `{count, tokens}` | `POST /tokenize {model, messages}` | `POST /apply-template {messages}` → `{prompt}`, then `POST /tokenize {content}` → `{tokens}` |
//! | health | `GET /health` 200 | `GET /health` 200 | `GET /health` 200 (503 while loading) |
//! | KV capacity | `vllm:cache_config_info` on `/metrics` | (not read) | the pinned context size (`/props`) |
//! | reset between policies | `POST /reset_prefix_cache` | `POST /flush_cache` | none: restart the process |
//! | KV events | ZMQ (`--kv-events-config`) | ZMQ, vLLM's layout | none |
//! | upstream keep-alive | pooled | pooled | closes after a stream: one connection per request |

use serde::{Deserialize, Serialize};

/// The engine a fleet's replicas run (recorded as `engine` in `meta.json`'s `fleet`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EngineKind {
    /// vLLM, or kvroute's emulator, which speaks vLLM's API.
    Vllm,
    /// SGLang (`python -m sglang.launch_server`).
    Sglang,
    /// llama.cpp's `llama-server`.
    LlamaCpp,
}

/// How a token count is asked of an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizeShape {
    /// `POST /tokenize {"model", "messages"}` → `{"count", "tokens"}` (vLLM, SGLang): the chat
    /// template is applied by the endpoint.
    Messages,
    /// `POST /apply-template {"messages"}` → `{"prompt"}`, then `POST /tokenize {"content",
    /// "add_special": true, "parse_special": true}` → `{"tokens": [...]}` (llama.cpp).
    TemplateThenContent,
}

/// How a replica forgets its prefix cache between two policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheReset {
    /// `POST` to this path (vLLM: `/reset_prefix_cache`; SGLang: `/flush_cache`).
    Endpoint(&'static str),
    /// No endpoint clears everything the engine keeps: restart the process.
    Restart,
}

impl EngineKind {
    /// Every kind, in a stable order.
    pub const ALL: [EngineKind; 3] = [EngineKind::Vllm, EngineKind::Sglang, EngineKind::LlamaCpp];

    /// `vllm`, `sglang` or `llama-cpp` (the serialized name).
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
            EngineKind::LlamaCpp => "llama-cpp",
        }
    }

    /// Parses [`EngineKind::as_str`]'s names.
    pub fn parse(name: &str) -> Option<EngineKind> {
        EngineKind::ALL.into_iter().find(|k| k.as_str() == name)
    }

    /// Why this engine cannot feed a policy that needs KV events (exact residency), or `None`
    /// when it can publish them.
    pub fn no_kv_events_reason(self) -> Option<&'static str> {
        match self {
            EngineKind::Vllm | EngineKind::Sglang => None,
            EngineKind::LlamaCpp => Some(
                "llama.cpp's llama-server publishes no KV events (it has no KV event publisher: its per-slot caches are not visible outside the process)",
            ),
        }
    }

    /// The tokenize endpoint's request and response shapes.
    pub fn tokenize_shape(self) -> TokenizeShape {
        match self {
            EngineKind::Vllm | EngineKind::Sglang => TokenizeShape::Messages,
            EngineKind::LlamaCpp => TokenizeShape::TemplateThenContent,
        }
    }

    /// How a replica forgets its cache between policies.
    pub fn cache_reset(self) -> CacheReset {
        match self {
            EngineKind::Vllm => CacheReset::Endpoint("/reset_prefix_cache"),
            EngineKind::Sglang => CacheReset::Endpoint("/flush_cache"),
            // `POST /slots/{id}?action=erase` clears a slot, but not the host-memory prompt
            // cache (`--cache-ram`); a restart of the tiny model takes well under a second.
            EngineKind::LlamaCpp => CacheReset::Restart,
        }
    }

    /// Whether a connection stays usable after a streamed response, as its `Keep-Alive` header
    /// says. llama.cpp's `llama-server` (11434) announces `Keep-Alive: timeout=5, max=100` and
    /// closes the connection after the stream anyway (`curl` reports "Connection died, retrying a
    /// fresh connect" on the second request of a connection); a pooled client that reuses it
    /// before noticing the close fails the request after sending it (the router's 502, not
    /// retried). The router then runs with `--no-upstream-keep-alive`.
    pub fn keeps_connections_alive(self) -> bool {
        !matches!(self, EngineKind::LlamaCpp)
    }

    /// The health endpoint (200 when ready).
    pub fn health_path(self) -> &'static str {
        "/health"
    }
}

impl std::fmt::Display for EngineKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The cached prompt tokens an engine reported for one request: the OpenAI usage field
/// (`usage.prompt_tokens_details.cached_tokens`) when present, else llama.cpp's
/// `timings.cache_n` (older `llama-server` builds report only the latter); `None` when neither
/// was sent (unknown, not zero).
pub fn cached_tokens(usage_details: Option<u64>, timings_cache_n: Option<u64>) -> Option<u64> {
    usage_details.or(timings_cache_n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_serialize_kebab_case() {
        for k in EngineKind::ALL {
            assert_eq!(EngineKind::parse(k.as_str()), Some(k));
            assert_eq!(
                serde_json::to_string(&k).unwrap(),
                format!("\"{}\"", k.as_str())
            );
        }
        assert_eq!(EngineKind::parse("llama.cpp"), None);
    }

    #[test]
    fn the_adapter_says_what_differs() {
        assert!(EngineKind::Vllm.no_kv_events_reason().is_none());
        assert!(
            EngineKind::LlamaCpp
                .no_kv_events_reason()
                .unwrap()
                .contains("no KV events")
        );
        assert_eq!(EngineKind::LlamaCpp.cache_reset(), CacheReset::Restart);
        assert_eq!(
            EngineKind::Vllm.cache_reset(),
            CacheReset::Endpoint("/reset_prefix_cache")
        );
        assert_eq!(
            EngineKind::LlamaCpp.tokenize_shape(),
            TokenizeShape::TemplateThenContent
        );
        assert!(EngineKind::Vllm.keeps_connections_alive());
        assert!(!EngineKind::LlamaCpp.keeps_connections_alive());
        assert_eq!(cached_tokens(Some(3), Some(5)), Some(3));
        assert_eq!(cached_tokens(None, Some(5)), Some(5));
        assert_eq!(cached_tokens(None, None), None);
    }
}
