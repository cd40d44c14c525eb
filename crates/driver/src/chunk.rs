//! Interpreting one SSE `data:` payload of an OpenAI-compatible stream.
//!
//! Tolerant by design: extra keys and `null`s (`reasoning_content`, `tool_calls`, `logprobs`,
//! `usage: null`) are ignored, the role chunk (`delta.content: ""`) carries no token, and the
//! usage chunk has `choices: []`. Chat (`delta.content`) and completions (`text`) both count.

use serde::Deserialize;

/// Token counts reported by the server's usage chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.completion_tokens`.
    pub completion_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`, else llama.cpp's `timings.cache_n` beside
    /// the usage (schema::engine::cached_tokens); absent means unknown, not zero.
    pub cached_tokens: Option<u64>,
}

/// What one payload said.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Chunk {
    /// Generated text, when the payload carries a non-empty content delta.
    pub content: Option<String>,
    /// The usage object, when present and not `null`.
    pub usage: Option<Usage>,
    /// An error payload's message.
    pub error: Option<String>,
}

#[derive(Deserialize)]
struct ChunkJson {
    #[serde(default)]
    choices: Option<Vec<ChoiceJson>>,
    #[serde(default)]
    usage: Option<UsageJson>,
    #[serde(default)]
    error: Option<serde_json::Value>,
    /// llama.cpp's `timings` (`cache_n`: prompt tokens read from the cache).
    #[serde(default)]
    timings: Option<TimingsJson>,
}

#[derive(Deserialize)]
struct TimingsJson {
    #[serde(default)]
    cache_n: Option<u64>,
}

#[derive(Deserialize)]
struct ChoiceJson {
    #[serde(default)]
    delta: Option<DeltaJson>,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct DeltaJson {
    #[serde(default)]
    content: Option<String>,
}

#[derive(Deserialize)]
struct UsageJson {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<DetailsJson>,
}

#[derive(Deserialize)]
struct DetailsJson {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

/// The message of an OpenAI error object (`{"message":…}` or a bare string), else its JSON.
pub fn error_message(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Object(o) => match o.get("message") {
            Some(serde_json::Value::String(s)) => s.clone(),
            _ => v.to_string(),
        },
        _ => v.to_string(),
    }
}

/// Why a `data:` payload is not an OpenAI chunk; `head` is its first 80 characters.
#[derive(Debug, thiserror::Error)]
pub enum ChunkError {
    /// Not JSON of a chunk's shape.
    #[error("payload is not an OpenAI chunk ({source}): {head:?}")]
    NotJson {
        /// The JSON error.
        source: serde_json::Error,
        /// The payload's start.
        head: String,
    },
    /// JSON, but with no `choices`, `usage` or `error`.
    #[error("payload has no choices, usage or error: {head:?}")]
    NotAChunk {
        /// The payload's start.
        head: String,
    },
}

/// Interprets one `data:` payload (not `[DONE]`). Errors when it is not JSON or not shaped
/// like an OpenAI chunk (no `choices`, `usage` or `error`).
pub fn parse_chunk(data: &str) -> Result<Chunk, ChunkError> {
    let head = || data.chars().take(80).collect::<String>();
    let json: ChunkJson = serde_json::from_str(data).map_err(|source| ChunkError::NotJson {
        source,
        head: head(),
    })?;
    if json.choices.is_none() && json.usage.is_none() && json.error.is_none() {
        return Err(ChunkError::NotAChunk { head: head() });
    }
    let cache_n = json.timings.and_then(|t| t.cache_n);
    let mut content: Option<String> = None;
    for choice in json.choices.into_iter().flatten() {
        let piece = choice.delta.and_then(|d| d.content).or(choice.text);
        if let Some(p) = piece.filter(|p| !p.is_empty()) {
            match &mut content {
                Some(c) => c.push_str(&p),
                None => content = Some(p),
            }
        }
    }
    Ok(Chunk {
        content,
        usage: json.usage.map(|u| Usage {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            cached_tokens: schema::engine::cached_tokens(
                u.prompt_tokens_details.and_then(|d| d.cached_tokens),
                cache_n,
            ),
        }),
        error: json
            .error
            .filter(|e| !e.is_null())
            .map(|e| error_message(&e)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_chat_chunks() {
        let role = r#"{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":"","reasoning_content":null,"tool_calls":null},"logprobs":null,"finish_reason":null}],"usage":null}"#;
        assert_eq!(parse_chunk(role).unwrap(), Chunk::default());
        let tok = r#"{"choices":[{"index":0,"delta":{"content":" hi"},"finish_reason":null}]}"#;
        assert_eq!(parse_chunk(tok).unwrap().content.as_deref(), Some(" hi"));
        let usage = r#"{"choices":[],"usage":{"prompt_tokens":1024,"total_tokens":1152,"completion_tokens":128,"prompt_tokens_details":{"cached_tokens":1008}}}"#;
        assert_eq!(
            parse_chunk(usage).unwrap().usage,
            Some(Usage {
                prompt_tokens: Some(1024),
                completion_tokens: Some(128),
                cached_tokens: Some(1008)
            })
        );
        let no_details = r#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"prompt_tokens_details":null}}"#;
        assert_eq!(
            parse_chunk(no_details)
                .unwrap()
                .usage
                .unwrap()
                .cached_tokens,
            None
        );
    }

    #[test]
    fn llama_cpp_timings_fill_in_cached_tokens() {
        let both = r#"{"choices":[],"usage":{"completion_tokens":8,"prompt_tokens":1453,"prompt_tokens_details":{"cached_tokens":1199}},"timings":{"cache_n":1000,"prompt_n":254}}"#;
        assert_eq!(
            parse_chunk(both).unwrap().usage.unwrap().cached_tokens,
            Some(1199)
        );
        let timings_only = r#"{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":2},"timings":{"cache_n":6}}"#;
        assert_eq!(
            parse_chunk(timings_only).unwrap().usage.unwrap(),
            Usage {
                prompt_tokens: Some(10),
                completion_tokens: Some(2),
                cached_tokens: Some(6)
            }
        );
    }

    #[test]
    fn completions_text_and_errors() {
        let c = r#"{"object":"text_completion","choices":[{"index":0,"text":"ab","logprobs":null,"finish_reason":null,"stop_reason":null}],"usage":null}"#;
        assert_eq!(parse_chunk(c).unwrap().content.as_deref(), Some("ab"));
        let e = r#"{"error":{"message":"boom","type":"x","param":null,"code":500}}"#;
        assert_eq!(parse_chunk(e).unwrap().error.as_deref(), Some("boom"));
    }

    #[test]
    fn malformed_payloads_are_errors() {
        assert!(
            parse_chunk("not json")
                .unwrap_err()
                .to_string()
                .contains("not an OpenAI chunk")
        );
        assert!(parse_chunk(r#"{"hello":1}"#).is_err());
        assert!(parse_chunk("[1,2]").is_err());
    }
}
