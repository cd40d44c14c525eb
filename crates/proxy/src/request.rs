//! Request parsing and canonical rendering (docs/ARCHITECTURE.md, "Prompt → blocks").
//!
//! The router never re-serialises what it forwards: the client's bytes go upstream unchanged. It
//! parses only the fields it routes on, and renders the prompt into one canonical byte string that
//! belief keying cuts into blocks. The rendering is documented in the crate README so another
//! router (or the simulator) can reproduce the same keys.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

/// Which OpenAI-compatible endpoint a request targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions`.
    Chat,
}

impl Endpoint {
    /// The request path.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}

/// Why a request body was refused (becomes a 400 with an OpenAI-style body).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// The body is not valid JSON, or a routed field has the wrong type.
    #[error("invalid JSON body: {0}")]
    Json(String),
    /// A completions request without `prompt`.
    #[error("'prompt' is required")]
    MissingPrompt,
    /// A chat request without a non-empty `messages` array.
    #[error("'messages' is required and must be a non-empty array")]
    MissingMessages,
}

impl ParseError {
    /// The `param` field of the error body, when one field is at fault.
    pub fn param(&self) -> Option<&'static str> {
        match self {
            ParseError::Json(_) => None,
            ParseError::MissingPrompt => Some("prompt"),
            ParseError::MissingMessages => Some("messages"),
        }
    }
}

/// A prompt as the completions API accepts it.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum Prompt<'a> {
    /// One text prompt.
    #[serde(borrow)]
    Text(Cow<'a, str>),
    /// A batch of text prompts.
    #[serde(borrow)]
    Texts(Vec<Cow<'a, str>>),
    /// One pre-tokenised prompt.
    Tokens(Vec<u32>),
    /// A batch of pre-tokenised prompts.
    TokenBatches(Vec<Vec<u32>>),
}

/// One content part of a chat message (`{"type":"text","text":…}` and friends).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct ContentPart<'a> {
    /// The part's type (`text`, `image_url`, …).
    #[serde(borrow, rename = "type", default)]
    pub kind: Option<Cow<'a, str>>,
    /// Text of a `text` part.
    #[serde(borrow, default, skip_serializing_if = "Option::is_none")]
    pub text: Option<Cow<'a, str>>,
    /// `image_url` of an image part; kept opaque.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_url: Option<serde_json::Value>,
}

/// Chat message content: a string or a list of parts.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum Content<'a> {
    /// Plain text.
    #[serde(borrow)]
    Text(Cow<'a, str>),
    /// Content parts.
    #[serde(borrow)]
    Parts(Vec<ContentPart<'a>>),
}

/// One chat message, reduced to what routing and tokenisation need.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct Message<'a> {
    /// `system`, `user`, `assistant`, `tool`, …
    #[serde(borrow)]
    pub role: Cow<'a, str>,
    /// The content; `null` for assistant tool-call turns.
    #[serde(borrow, default)]
    pub content: Option<Content<'a>>,
}

#[derive(Deserialize)]
struct RawBody<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    prompt: Option<Prompt<'a>>,
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(borrow, default)]
    user: Option<Cow<'a, str>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(borrow, default)]
    cache_salt: Option<SaltField<'a>>,
}

/// `cache_salt` as the engines accept it: one string (vLLM, SGLang), or for SGLang's batch
/// requests a list, one per prompt — which one routing key cannot honour, so it is ignored.
#[derive(Deserialize)]
#[serde(untagged)]
enum SaltField<'a> {
    One(#[serde(borrow)] Cow<'a, str>),
    Other(serde::de::IgnoredAny),
}

/// The routed view of a request body, borrowing from the body bytes where it can.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedRequest<'a> {
    /// The endpoint it was sent to.
    pub endpoint: Endpoint,
    /// `model`, when present.
    pub model: Option<Cow<'a, str>>,
    /// `prompt` (completions).
    pub prompt: Option<Prompt<'a>>,
    /// `messages` (chat).
    pub messages: Option<Vec<Message<'a>>>,
    /// `user`, the session fallback when `x-session-id` is absent.
    pub user: Option<Cow<'a, str>>,
    /// `stream`.
    pub stream: bool,
    /// `cache_salt`, when one string: the engines keep a salted prompt's cache apart from the
    /// same prompt unsalted, so routing keys it apart too ([`Self::key_salt`]).
    pub cache_salt: Option<Cow<'a, str>>,
}

/// Parses a request body for `endpoint`, checking the fields the API requires.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<ParsedRequest<'_>, ParseError> {
    let raw: RawBody<'_> =
        serde_json::from_slice(body).map_err(|e| ParseError::Json(e.to_string()))?;
    match endpoint {
        Endpoint::Completions if raw.prompt.is_none() => return Err(ParseError::MissingPrompt),
        Endpoint::Chat if raw.messages.as_ref().is_none_or(|m| m.is_empty()) => {
            return Err(ParseError::MissingMessages);
        }
        _ => {}
    }
    Ok(ParsedRequest {
        endpoint,
        model: raw.model,
        prompt: raw.prompt,
        messages: raw.messages,
        user: raw.user,
        stream: raw.stream.unwrap_or(false),
        cache_salt: match raw.cache_salt {
            Some(SaltField::One(s)) => Some(s),
            _ => None,
        },
    })
}

/// Separator between prompts of a batch; a byte that never occurs in UTF-8 text.
const BATCH_SEPARATOR: u8 = 0xFF;

impl ParsedRequest<'_> {
    /// The block-0 salt of this request's keys: `base` (the model) extended by its
    /// `cache_salt`, as [`kv_index::hash::cache_salted`] defines it — the same salt the
    /// exact-residency index gives a salted engine event.
    pub fn key_salt<'s>(&self, base: &'s [u8]) -> Cow<'s, [u8]> {
        kv_index::hash::cache_salted(base, self.cache_salt.as_deref().map(str::as_bytes))
    }

    /// Renders the prompt into the canonical byte string of docs/ARCHITECTURE.md, "Prompt →
    /// blocks", appending to `out`.
    ///
    /// Completions: the prompt text as UTF-8; token prompts as little-endian `u32`s; batch
    /// members joined by `0xFF`. Chat: per message, in order, `<|role|>\n` + content + `\n`, where
    /// list content concatenates its text parts (an image part contributes its URL JSON).
    pub fn render_into(&self, out: &mut Vec<u8>) {
        match self.endpoint {
            Endpoint::Completions => match &self.prompt {
                Some(Prompt::Text(t)) => out.extend_from_slice(t.as_bytes()),
                Some(Prompt::Texts(ts)) => {
                    for (i, t) in ts.iter().enumerate() {
                        if i > 0 {
                            out.push(BATCH_SEPARATOR);
                        }
                        out.extend_from_slice(t.as_bytes());
                    }
                }
                Some(Prompt::Tokens(ids)) => push_tokens(out, ids),
                Some(Prompt::TokenBatches(batches)) => {
                    for (i, ids) in batches.iter().enumerate() {
                        if i > 0 {
                            out.push(BATCH_SEPARATOR);
                        }
                        push_tokens(out, ids);
                    }
                }
                None => {}
            },
            Endpoint::Chat => {
                for m in self.messages.iter().flatten() {
                    out.extend_from_slice(b"<|");
                    out.extend_from_slice(m.role.as_bytes());
                    out.extend_from_slice(b"|>\n");
                    match &m.content {
                        Some(Content::Text(t)) => out.extend_from_slice(t.as_bytes()),
                        Some(Content::Parts(parts)) => {
                            for p in parts {
                                if let Some(t) = &p.text {
                                    out.extend_from_slice(t.as_bytes());
                                } else if let Some(url) = &p.image_url {
                                    out.extend_from_slice(url.to_string().as_bytes());
                                }
                            }
                        }
                        None => {}
                    }
                    out.push(b'\n');
                }
            }
        }
    }

    /// The canonical byte string as a fresh vector.
    pub fn render(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.render_into(&mut out);
        out
    }

    /// Token ids given directly by the client (a single pre-tokenised completions prompt), which
    /// spare exact-residency routing the tokenize round trip.
    pub fn given_tokens(&self) -> Option<&[u32]> {
        match (&self.endpoint, &self.prompt) {
            (Endpoint::Completions, Some(Prompt::Tokens(ids))) => Some(ids),
            _ => None,
        }
    }

    /// The body of a vLLM `POST /tokenize` call for this request's prompt (completions form with
    /// `prompt`, chat form with `messages`, so the engine applies its chat template).
    pub fn tokenize_body(&self, model: &str) -> Vec<u8> {
        #[derive(Serialize)]
        struct Tok<'b, 'a> {
            model: &'b str,
            #[serde(skip_serializing_if = "Option::is_none")]
            prompt: Option<&'b Prompt<'a>>,
            #[serde(skip_serializing_if = "Option::is_none")]
            messages: Option<&'b Vec<Message<'a>>>,
            add_special_tokens: bool,
        }
        let body = match self.endpoint {
            Endpoint::Completions => Tok {
                model,
                prompt: self.prompt.as_ref(),
                messages: None,
                add_special_tokens: true,
            },
            Endpoint::Chat => Tok {
                model,
                prompt: None,
                messages: self.messages.as_ref(),
                add_special_tokens: false,
            },
        };
        // Serialising owned, already-validated data cannot fail.
        serde_json::to_vec(&body).unwrap_or_default()
    }
}

fn push_tokens(out: &mut Vec<u8>, ids: &[u32]) {
    out.reserve(ids.len() * 4);
    for id in ids {
        out.extend_from_slice(&id.to_le_bytes());
    }
}

/// The `tokens` field of a `/tokenize` reply, or the `token_ids` of a render reply.
pub fn parse_tokenize_reply(body: &[u8]) -> Result<Vec<u32>, String> {
    #[derive(Deserialize)]
    struct TokReply {
        #[serde(default)]
        tokens: Option<Vec<u32>>,
        #[serde(default)]
        token_ids: Option<Vec<u32>>,
    }
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Reply {
        One(TokReply),
        Many(Vec<TokReply>),
    }
    let reply: Reply = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let first = match reply {
        Reply::One(r) => r,
        Reply::Many(mut v) if !v.is_empty() => v.swap_remove(0),
        Reply::Many(_) => return Err("empty render reply".into()),
    };
    first
        .tokens
        .or(first.token_ids)
        .ok_or_else(|| "reply has neither 'tokens' nor 'token_ids'".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completions_text_renders_as_utf8() {
        let r = parse(
            Endpoint::Completions,
            br#"{"model":"m","prompt":"hello\nworld","stream":true}"#,
        )
        .unwrap();
        assert_eq!(r.render(), b"hello\nworld");
        assert!(r.stream);
        assert_eq!(r.model.as_deref(), Some("m"));
    }

    #[test]
    fn completions_token_prompt_renders_little_endian() {
        let r = parse(Endpoint::Completions, br#"{"prompt":[1,256]}"#).unwrap();
        assert_eq!(r.render(), vec![1, 0, 0, 0, 0, 1, 0, 0]);
        assert_eq!(r.given_tokens(), Some(&[1u32, 256][..]));
    }

    #[test]
    fn batch_prompts_are_separated() {
        let r = parse(Endpoint::Completions, br#"{"prompt":["a","b"]}"#).unwrap();
        assert_eq!(r.render(), b"a\xFFb");
    }

    #[test]
    fn chat_renders_role_markers_in_order() {
        let body = br#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":[{"type":"text","text":"U1"},{"type":"text","text":"U2"}]},{"role":"assistant","content":null}],"user":"sess"}"#;
        let r = parse(Endpoint::Chat, body).unwrap();
        assert_eq!(
            r.render(),
            b"<|system|>\nS\n<|user|>\nU1U2\n<|assistant|>\n\n"
        );
        assert_eq!(r.user.as_deref(), Some("sess"));
    }

    #[test]
    fn rendering_is_a_prefix_of_the_next_turn() {
        let t1 = br#"{"messages":[{"role":"user","content":"hi"}]}"#;
        let t2 =
            br#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"yo"}]}"#;
        let a = parse(Endpoint::Chat, t1).unwrap().render();
        let b = parse(Endpoint::Chat, t2).unwrap().render();
        assert!(b.starts_with(&a));
    }

    #[test]
    fn bad_inputs_are_refused() {
        assert!(matches!(
            parse(Endpoint::Chat, b"{not json"),
            Err(ParseError::Json(_))
        ));
        assert!(matches!(
            parse(Endpoint::Chat, b"[1,2]"),
            Err(ParseError::Json(_))
        ));
        assert_eq!(
            parse(Endpoint::Completions, b"{}"),
            Err(ParseError::MissingPrompt)
        );
        assert_eq!(
            parse(Endpoint::Chat, br#"{"messages":[]}"#),
            Err(ParseError::MissingMessages)
        );
        assert_eq!(
            parse(Endpoint::Chat, br#"{"prompt":"x"}"#),
            Err(ParseError::MissingMessages)
        );
        assert!(matches!(
            parse(Endpoint::Completions, br#"{"prompt":5}"#),
            Err(ParseError::Json(_))
        ));
    }

    #[test]
    fn cache_salt_is_kept_when_one_string_and_salts_the_keys() {
        let salted = parse(
            Endpoint::Completions,
            br#"{"prompt":"p","cache_salt":"tenant-a"}"#,
        )
        .unwrap();
        assert_eq!(salted.cache_salt.as_deref(), Some("tenant-a"));
        assert_ne!(&*salted.key_salt(b"m"), b"m");
        let plain = parse(Endpoint::Completions, br#"{"prompt":"p"}"#).unwrap();
        assert_eq!(&*plain.key_salt(b"m"), b"m");
        // SGLang's per-prompt list for a batch is accepted, not routed on.
        let batch = parse(
            Endpoint::Completions,
            br#"{"prompt":["a","b"],"cache_salt":["x","y"]}"#,
        )
        .unwrap();
        assert_eq!(batch.cache_salt, None);
    }

    #[test]
    fn tokenize_body_uses_the_matching_form() {
        let r = parse(
            Endpoint::Chat,
            br#"{"messages":[{"role":"user","content":"hi"}]}"#,
        )
        .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&r.tokenize_body("m")).unwrap();
        assert_eq!(v["model"], "m");
        assert_eq!(v["messages"][0]["role"], "user");
        assert!(v.get("prompt").is_none());
        let r = parse(Endpoint::Completions, br#"{"prompt":"abc"}"#).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&r.tokenize_body("m")).unwrap();
        assert_eq!(v["prompt"], "abc");
    }

    #[test]
    fn tokenize_replies_in_both_forms() {
        assert_eq!(
            parse_tokenize_reply(
                br#"{"count":2,"max_model_len":8,"tokens":[5,6],"token_strs":null}"#
            )
            .unwrap(),
            vec![5, 6]
        );
        assert_eq!(
            parse_tokenize_reply(br#"[{"token_ids":[7]}]"#).unwrap(),
            vec![7]
        );
        assert_eq!(
            parse_tokenize_reply(br#"{"token_ids":[8]}"#).unwrap(),
            vec![8]
        );
        assert!(parse_tokenize_reply(br#"{"count":1}"#).is_err());
        assert!(parse_tokenize_reply(b"nope").is_err());
    }
}
