//! vLLM's OpenAI-compatible request parsing and response shapes (crates/engine/README.md, "Server
//! surface").

use std::collections::VecDeque;
use std::fmt::Write as _;

use bytes::Bytes;
use serde_json::{Value, json};

use super::engine_loop::Emit;
use crate::config::EngineConfig;
use crate::core::SamplingParams;
use crate::tokenizer::{self, ChatMessage, VOCAB_SIZE};

/// An error answered with vLLM's body `{"error":{"message","type","param","code"}}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// Human-readable message.
    pub message: String,
    /// vLLM's error type name.
    pub kind: &'static str,
}

impl ApiError {
    /// 400 `BadRequestError`.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: 400,
            message: message.into(),
            kind: "BadRequestError",
        }
    }

    /// 404 `NotFoundError` for an unknown model.
    pub fn unknown_model(model: &str) -> Self {
        Self {
            status: 404,
            message: format!("The model `{model}` does not exist."),
            kind: "NotFoundError",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> String {
        json!({"error": {"message": self.message, "type": self.kind, "param": null, "code": self.status}})
            .to_string()
    }
}

/// Which OpenAI endpoint a generation request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `/v1/completions`.
    Completion,
    /// `/v1/chat/completions`.
    Chat,
}

/// A parsed, validated generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct GenRequest {
    /// Endpoint kind.
    pub kind: Kind,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Generation parameters (max_tokens resolved).
    pub params: SamplingParams,
    /// Stream the answer as SSE.
    pub stream: bool,
    /// Final usage chunk (`stream_options.include_usage`).
    pub include_usage: bool,
    /// Usage on every chunk (`stream_options.continuous_usage_stats`).
    pub continuous_usage: bool,
    /// `return_token_ids` (vLLM ≥ 0.10.2): a non-stream answer carries the prompt's token ids
    /// (chat: top-level `prompt_token_ids`; completions: the choice's) and the choice's
    /// generated `token_ids`. The router's token-parity probe reads them.
    pub return_token_ids: bool,
}

fn obj(body: &[u8]) -> Result<serde_json::Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("Invalid JSON body: {e}")))?;
    match v {
        Value::Object(m) => Ok(m),
        _ => Err(ApiError::bad_request(
            "The request body must be a JSON object",
        )),
    }
}

/// Checks the `model` field against the served names (absent means the default model).
pub fn check_model(m: &serde_json::Map<String, Value>, served: &[String]) -> Result<(), ApiError> {
    match m.get("model") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(s)) if served.iter().any(|n| n == s) => Ok(()),
        Some(Value::String(s)) => Err(ApiError::unknown_model(s)),
        Some(_) => Err(ApiError::bad_request("`model` must be a string")),
    }
}

fn get_bool(
    m: &serde_json::Map<String, Value>,
    key: &str,
    default: bool,
) -> Result<bool, ApiError> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad_request(format!("`{key}` must be a boolean"))),
    }
}

fn get_u32(m: &serde_json::Map<String, Value>, key: &str) -> Result<Option<u32>, ApiError> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .map(Some)
            .ok_or_else(|| {
                ApiError::bad_request(format!("`{key}` must be a non-negative integer"))
            }),
    }
}

fn token_ids(v: &[Value]) -> Result<Vec<u32>, ApiError> {
    v.iter()
        .map(|t| {
            t.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .filter(|&x| x < VOCAB_SIZE)
                .ok_or_else(|| ApiError::bad_request(format!("Token id {t} is out of vocabulary")))
        })
        .collect()
}

/// The completions prompt: a string, a token id list, or a one-element list of either.
pub fn completion_prompt(m: &serde_json::Map<String, Value>) -> Result<Vec<u32>, ApiError> {
    let add_special = get_bool(m, "add_special_tokens", true)?;
    let prompt = m
        .get("prompt")
        .ok_or_else(|| ApiError::bad_request("Field required: `prompt`"))?;
    match prompt {
        Value::String(s) => Ok(tokenizer::encode(s, add_special)),
        Value::Array(a) if a.is_empty() => Err(ApiError::bad_request("`prompt` must not be empty")),
        Value::Array(a) if a.iter().all(Value::is_number) => token_ids(a),
        Value::Array(a) if a.len() == 1 => match &a[0] {
            Value::String(s) => Ok(tokenizer::encode(s, add_special)),
            Value::Array(ids) => token_ids(ids),
            _ => Err(ApiError::bad_request(
                "`prompt` must be a string or a list of token ids",
            )),
        },
        Value::Array(_) => Err(ApiError::bad_request(
            "Batched prompts are not supported by the emulator; send one prompt per request",
        )),
        _ => Err(ApiError::bad_request(
            "`prompt` must be a string or a list of token ids",
        )),
    }
}

/// Chat messages with string or text-part contents.
pub fn chat_messages(m: &serde_json::Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let msgs = m
        .get("messages")
        .ok_or_else(|| ApiError::bad_request("Field required: `messages`"))?
        .as_array()
        .ok_or_else(|| ApiError::bad_request("`messages` must be a list"))?;
    msgs.iter()
        .enumerate()
        .map(|(i, msg)| {
            let role = msg.get("role").and_then(Value::as_str).ok_or_else(|| {
                ApiError::bad_request(format!("messages[{i}]: field required: `role`"))
            })?;
            let content = match msg.get("content") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let mut texts = Vec::new();
                    for p in parts {
                        match (
                            p.get("type").and_then(Value::as_str),
                            p.get("text").and_then(Value::as_str),
                        ) {
                            (Some("text"), Some(t)) => texts.push(t),
                            _ => {
                                return Err(ApiError::bad_request(format!(
                                    "messages[{i}]: only text content parts are supported"
                                )));
                            }
                        }
                    }
                    texts.join("\n")
                }
                Some(_) => {
                    return Err(ApiError::bad_request(format!(
                        "messages[{i}]: `content` must be a string or a list of parts"
                    )));
                }
            };
            Ok(ChatMessage {
                role: role.to_owned(),
                content,
            })
        })
        .collect()
}

/// Chat prompt tokens: the fixed template, then the tokenizer (no extra BOS unless asked).
pub fn chat_prompt(m: &serde_json::Map<String, Value>) -> Result<Vec<u32>, ApiError> {
    let msgs = chat_messages(m)?;
    let add_special = get_bool(m, "add_special_tokens", false)?;
    Ok(tokenizer::encode(
        &tokenizer::render_chat(&msgs),
        add_special,
    ))
}

/// Parses and validates a generation request body.
pub fn parse_generate(
    kind: Kind,
    body: &[u8],
    served: &[String],
    cfg: &EngineConfig,
) -> Result<GenRequest, ApiError> {
    let m = obj(body)?;
    check_model(&m, served)?;
    if get_u32(&m, "n")?.is_some_and(|n| n != 1) {
        return Err(ApiError::bad_request(
            "Only n=1 is supported by the emulator",
        ));
    }
    let prompt = match kind {
        Kind::Completion => completion_prompt(&m)?,
        Kind::Chat => chat_prompt(&m)?,
    };
    let requested = match kind {
        Kind::Completion => get_u32(&m, "max_tokens")?.or(Some(16)),
        Kind::Chat => match get_u32(&m, "max_completion_tokens")? {
            Some(x) => Some(x),
            None => get_u32(&m, "max_tokens")?,
        },
    };
    let prompt_len = prompt.len() as u64;
    if prompt_len >= u64::from(cfg.max_model_len) {
        return Err(ApiError::bad_request(format!(
            "This model's maximum context length is {} tokens. However, your request has {} input \
             tokens. Please reduce the length of the input messages.",
            cfg.max_model_len, prompt_len
        )));
    }
    let max_tokens = requested.unwrap_or((u64::from(cfg.max_model_len) - prompt_len) as u32);
    if max_tokens == 0 {
        return Err(ApiError::bad_request(
            "max_tokens must be at least 1, got 0.",
        ));
    }
    let params = SamplingParams {
        max_tokens,
        ignore_eos: get_bool(&m, "ignore_eos", false)?,
    };
    crate::core::check_request(cfg, prompt.len(), params)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let stream = get_bool(&m, "stream", false)?;
    let (include_usage, continuous_usage) = match m.get("stream_options") {
        None | Some(Value::Null) => (false, false),
        Some(Value::Object(o)) => (
            get_bool(o, "include_usage", true)?,
            get_bool(o, "continuous_usage_stats", false)?,
        ),
        Some(_) => return Err(ApiError::bad_request("`stream_options` must be an object")),
    };
    if !stream && m.get("stream_options").is_some_and(|v| !v.is_null()) {
        return Err(ApiError::bad_request(
            "Stream options can only be defined when `stream=True`.",
        ));
    }
    let return_token_ids = get_bool(&m, "return_token_ids", false)?;
    Ok(GenRequest {
        kind,
        prompt,
        params,
        stream,
        include_usage,
        continuous_usage,
        return_token_ids,
    })
}

/// `/tokenize`: completion form (`prompt`) or chat form (`messages`).
pub fn tokenize(body: &[u8], served: &[String], max_model_len: u32) -> Result<Value, ApiError> {
    let m = obj(body)?;
    check_model(&m, served)?;
    let (ids, text) = if m.contains_key("messages") {
        let msgs = chat_messages(&m)?;
        let text = tokenizer::render_chat(&msgs);
        let add = get_bool(&m, "add_special_tokens", false)?;
        (tokenizer::encode(&text, add), (text, add))
    } else {
        let p = m.get("prompt").and_then(Value::as_str).ok_or_else(|| {
            ApiError::bad_request("Field required: `prompt` (a string) or `messages`")
        })?;
        let add = get_bool(&m, "add_special_tokens", true)?;
        (tokenizer::encode(p, add), (p.to_owned(), add))
    };
    let token_strs = if get_bool(&m, "return_token_strs", false)? {
        let mut strs = tokenizer::pieces(&text.0);
        if text.1 {
            strs.insert(0, "<|begin_of_text|>".to_owned());
        }
        json!(strs)
    } else {
        Value::Null
    };
    Ok(
        json!({"count": ids.len(), "max_model_len": max_model_len, "tokens": ids, "token_strs": token_strs}),
    )
}

/// Usage object; `prompt_tokens_details` only when enabled and non-zero (as vLLM).
fn usage_json(
    out: &mut String,
    prompt: u32,
    completion: u32,
    cached: Option<u32>,
    null_details: bool,
) {
    let _ = write!(
        out,
        "{{\"prompt_tokens\":{prompt},\"total_tokens\":{},\"completion_tokens\":{completion}",
        prompt + completion
    );
    match cached {
        Some(c) => {
            let _ = write!(out, ",\"prompt_tokens_details\":{{\"cached_tokens\":{c}}}");
        }
        None if null_details => out.push_str(",\"prompt_tokens_details\":null"),
        None => {}
    }
    out.push('}');
}

/// Turns engine emissions into vLLM's SSE chunks, or accumulates a non-stream answer.
pub struct Formatter {
    kind: Kind,
    head: String,
    details: bool,
    include_usage: bool,
    continuous_usage: bool,
    /// Prompt tokens (from the engine).
    pub prompt_tokens: u32,
    /// Tokens generated so far.
    pub completion_tokens: u32,
    /// Prefix-cache hit reported by the engine.
    pub cached_tokens: u32,
    /// Generated text so far (non-stream only).
    pub text: String,
    /// Finish reason, once finished.
    pub finish: Option<&'static str>,
    /// The prompt's and the generated token ids, kept when the request asked for
    /// `return_token_ids` (non-stream only).
    token_ids: Option<(Vec<u32>, Vec<u32>)>,
}

impl Formatter {
    /// A formatter for one response.
    pub fn new(
        kind: Kind,
        id: &str,
        created: u64,
        model: &str,
        details: bool,
        req: &GenRequest,
    ) -> Self {
        let object = match kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        };
        let head = format!(
            "{{\"id\":{},\"object\":\"{object}\",\"created\":{created},\"model\":{}",
            serde_json::to_string(id).expect("string"),
            serde_json::to_string(model).expect("string"),
        );
        Self {
            kind,
            head,
            details,
            include_usage: req.include_usage,
            continuous_usage: req.continuous_usage,
            prompt_tokens: req.prompt.len() as u32,
            completion_tokens: 0,
            cached_tokens: 0,
            text: String::new(),
            finish: None,
            token_ids: req
                .return_token_ids
                .then(|| (req.prompt.clone(), Vec::new())),
        }
    }

    fn cached(&self) -> Option<u32> {
        (self.details && self.cached_tokens > 0).then_some(self.cached_tokens)
    }

    fn push_event(q: &mut VecDeque<Bytes>, json: &str) {
        let mut s = String::with_capacity(json.len() + 8);
        s.push_str("data: ");
        s.push_str(json);
        s.push_str("\n\n");
        q.push_back(Bytes::from(s));
    }

    /// Appends the SSE events for one emission; returns true when the stream is complete.
    pub fn on_emit_stream(&mut self, e: Emit, q: &mut VecDeque<Bytes>) -> bool {
        self.count(e);
        let text = serde_json::to_string(tokenizer::decode_token(e.token)).expect("string");
        let finish = match e.finish {
            Some(f) => format!("\"{}\"", f.as_str()),
            None => "null".to_owned(),
        };
        let mut s = String::with_capacity(self.head.len() + 160);
        match self.kind {
            Kind::Completion => {
                s.push_str(&self.head);
                let _ = write!(
                    s,
                    ",\"choices\":[{{\"index\":0,\"text\":{text},\"logprobs\":null,\"finish_reason\":{finish},\"stop_reason\":null}}],\"usage\":"
                );
                if self.continuous_usage {
                    usage_json(
                        &mut s,
                        self.prompt_tokens,
                        self.completion_tokens,
                        self.cached(),
                        true,
                    );
                } else {
                    s.push_str("null");
                }
                s.push('}');
            }
            Kind::Chat => {
                if e.output_index == 0 {
                    // The role chunk goes out with the first token, after prefill.
                    let mut r = self.head.clone();
                    r.push_str(",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}]}");
                    Self::push_event(q, &r);
                }
                s.push_str(&self.head);
                let _ = write!(
                    s,
                    ",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":{text}}},\"logprobs\":null,\"finish_reason\":{finish}"
                );
                if e.finish.is_some() {
                    s.push_str(",\"stop_reason\":null");
                }
                s.push_str("}]");
                if self.continuous_usage {
                    s.push_str(",\"usage\":");
                    usage_json(
                        &mut s,
                        self.prompt_tokens,
                        self.completion_tokens,
                        self.cached(),
                        false,
                    );
                }
                s.push('}');
            }
        }
        Self::push_event(q, &s);
        if e.finish.is_none() {
            return false;
        }
        if self.include_usage {
            let mut u = self.head.clone();
            u.push_str(",\"choices\":[],\"usage\":");
            usage_json(
                &mut u,
                self.prompt_tokens,
                self.completion_tokens,
                self.cached(),
                self.kind == Kind::Completion,
            );
            u.push('}');
            Self::push_event(q, &u);
        }
        q.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        true
    }

    /// Error event then `[DONE]`, when the engine stops a stream early.
    pub fn stream_error(q: &mut VecDeque<Bytes>, message: &str) {
        let err = ApiError {
            status: 500,
            message: message.to_owned(),
            kind: "InternalServerError",
        };
        Self::push_event(q, &err.body());
        q.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
    }

    /// Records one emission for a non-stream answer; returns true when finished.
    pub fn absorb(&mut self, e: Emit) -> bool {
        self.count(e);
        self.text.push_str(tokenizer::decode_token(e.token));
        if let Some((_, out)) = &mut self.token_ids {
            out.push(e.token);
        }
        e.finish.is_some()
    }

    fn count(&mut self, e: Emit) {
        self.prompt_tokens = e.prompt_tokens;
        self.cached_tokens = e.cached_tokens;
        self.completion_tokens = e.output_index + 1;
        self.finish = e.finish.map(|f| f.as_str());
    }

    /// The non-stream response body.
    pub fn final_json(&self, id: &str, created: u64, model: &str) -> String {
        let mut usage = String::new();
        // Non-stream answers are whole pydantic dumps in vLLM: unset details are null.
        usage_json(
            &mut usage,
            self.prompt_tokens,
            self.completion_tokens,
            self.cached(),
            true,
        );
        let usage: Value = serde_json::from_str(&usage).expect("usage is valid JSON");
        let mut v = match self.kind {
            Kind::Completion => json!({
                "id": id, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": self.text, "logprobs": null,
                             "finish_reason": self.finish, "stop_reason": null, "prompt_logprobs": null}],
                "usage": usage,
            }),
            Kind::Chat => json!({
                "id": id, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0,
                             "message": {"role": "assistant", "content": self.text,
                                         "reasoning_content": null, "tool_calls": []},
                             "logprobs": null, "finish_reason": self.finish, "stop_reason": null}],
                "usage": usage, "prompt_logprobs": null,
            }),
        };
        // vLLM's placement: a chat answer carries the prompt's ids at the top level, a
        // completion in its choice; both put the generated ids in the choice.
        if let Some((prompt, out)) = &self.token_ids {
            v["choices"][0]["token_ids"] = json!(out);
            match self.kind {
                Kind::Chat => v["prompt_token_ids"] = json!(prompt),
                Kind::Completion => v["choices"][0]["prompt_token_ids"] = json!(prompt),
            }
        }
        v.to_string()
    }
}
