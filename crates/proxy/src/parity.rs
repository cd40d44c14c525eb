//! Token parity: the startup check that the router's exact block keys are the engine's blocks.
//!
//! Exact residency keys a request by the token ids a replica's `/tokenize` gives for the body the
//! router sends ([`crate::request::ParsedRequest::tokenize_body`]) and matches them against the
//! blocks the engines report. When those ids are not the ones the engine prefills (another chat
//! template, a BOS one side adds and the other does not, another tokenizer on one replica) or the
//! router's block size is not the engine's, the index matches nothing and routing still "works":
//! the field's most common silent failure. So before a router with exact keys takes traffic, and
//! before an added replica joins, every replica is probed with [`PROBES`]:
//!
//! 1. `GET /metrics`: vLLM's `vllm:cache_config_info{block_size=…}` must equal the router's
//!    block size (`--block-tokens`); an engine without the gauge is not checked on this point.
//! 2. For each probe, `POST /tokenize` with the router's own tokenize body, then the probe
//!    itself with `max_tokens` 1 and `return_token_ids` (vLLM ≥ 0.10.2 answers the prompt's ids:
//!    chat at the top level, completions in the choice). The two id lists must be equal; without
//!    ids, `usage.prompt_tokens` must equal the count.
//! 3. Across replicas: every replica's `/tokenize` must give the same ids for each probe, since
//!    the router tokenizes a request on any healthy replica and routes it to another.
//!
//! A disagreement is a [`ParityError`] naming the replica, the probe and the first differing
//! token: the router refuses to start (or the admin API refuses the replica). A replica that
//! cannot be probed (unreachable, an error status, no model name) is reported as unchecked and
//! not refused: it may be starting. The continuous check on live traffic is
//! [`crate::metrics::Metrics::record_prompt_tokens`]. Probe requests carry [`PROBE_HEADER`].

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use serde_json::Value;

use crate::request::{self, Endpoint};
use crate::state::{Replica, Shared};

/// Header on every probe request (value `token-parity`), so an engine's logs, a test's mock and
/// anything that counts requests can tell the probes from traffic.
pub const PROBE_HEADER: &str = "x-kvroute-probe";

/// Longest wait for one probe request. A cold tiny-model vLLM on 2 CPU cores answers a
/// 1,000-token prefill in about 0.25 s (docs/vllm.md); a first request on a real model may
/// compile kernels, so the bound is generous. An unanswered probe leaves the replica unchecked.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(30);

/// One fixed probe request.
#[derive(Debug, Clone, Copy)]
pub struct Probe {
    /// Its name in messages.
    pub name: &'static str,
    /// The endpoint it is sent to.
    pub endpoint: Endpoint,
    /// Its body, without `model` (added per fleet).
    pub body: &'static str,
}

/// The probes: a one-turn chat, a multi-turn chat with a system prompt (a template's role
/// markers, separators and generation prompt all show), and a completion (BOS handling).
pub const PROBES: [Probe; 3] = [
    Probe {
        name: "chat-one-turn",
        endpoint: Endpoint::Chat,
        body: r#"{"messages":[{"role":"user","content":"Token parity probe: the quick brown fox jumps over the lazy dog, 0123456789."}]}"#,
    },
    Probe {
        name: "chat-multi-turn",
        endpoint: Endpoint::Chat,
        body: r#"{"messages":[{"role":"system","content":"You are the router's token parity probe."},{"role":"user","content":"Name three colours."},{"role":"assistant","content":"Red, green and blue."},{"role":"user","content":"And three more?"}]}"#,
    },
    Probe {
        name: "completion",
        endpoint: Endpoint::Completions,
        body: r#"{"prompt":"Token parity probe, completion form: one two three four five six seven eight."}"#,
    },
];

/// A disagreement between the router's keys and an engine: the router must not route on them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("token parity: {0}")]
pub struct ParityError(pub String);

/// What probing one replica found.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplicaParity {
    /// Every probe agreed with the engine.
    Agreed {
        /// Per probe, the ids the router keys (`/tokenize` with its own body).
        tokens: Vec<Vec<u32>>,
        /// Per probe, the pieces' text (`return_token_strs`; empty when not answered).
        pieces: Vec<Vec<String>>,
        /// The engine's block size from `/metrics`, when it publishes one.
        block_size: Option<u32>,
        /// Whether the engine answered token ids (else only counts were compared).
        compared_ids: bool,
    },
    /// Not checked, and why (unreachable, an error status, no model name).
    Unchecked(String),
}

/// What probing a fleet found: the replicas that agreed and those left unchecked.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FleetParity {
    /// Replicas whose probes all agreed.
    pub agreed: usize,
    /// Replicas left unchecked: (url, why).
    pub unchecked: Vec<(String, String)>,
}

/// The replica the others' `/tokenize` ids are compared with: the first that agreed.
#[derive(Debug, Clone, PartialEq)]
pub struct Reference {
    /// `replica N (url)`.
    pub who: String,
    /// Its id.
    pub id: policies::ReplicaId,
    /// Per probe, its `/tokenize` ids.
    pub tokens: Vec<Vec<u32>>,
    /// Per probe, its pieces' text.
    pub pieces: Vec<Vec<String>>,
}

/// The first index where `a` and `b` differ (the shorter one's length when one is a prefix of
/// the other); `None` when equal.
pub fn first_difference(a: &[u32], b: &[u32]) -> Option<usize> {
    match a.iter().zip(b).position(|(x, y)| x != y) {
        Some(i) => Some(i),
        None if a.len() == b.len() => None,
        None => Some(a.len().min(b.len())),
    }
}

/// `router 9 ("<s>") vs engine 1` at `i`, for a message.
fn describe_difference(
    i: usize,
    (left, left_ids, left_strs): (&str, &[u32], &[String]),
    (right, right_ids): (&str, &[u32]),
) -> String {
    let tok = |ids: &[u32]| ids.get(i).map_or("(end)".to_string(), |t| t.to_string());
    let piece = left_strs
        .get(i)
        .map(|s| format!(" ({s:?})"))
        .unwrap_or_default();
    format!(
        "first differ at token {i}: {left} {}{piece} vs {right} {} ({left} has {} tokens, {right} {})",
        tok(left_ids),
        tok(right_ids),
        left_ids.len(),
        right_ids.len()
    )
}

/// One probe request with [`PROBE_HEADER`], read whole (bounded) within [`PROBE_TIMEOUT`].
async fn probe_request(
    shared: &Shared,
    replica: &Replica,
    method: Method,
    path: &str,
    body: Option<Vec<u8>>,
) -> Result<(StatusCode, Bytes), String> {
    let fut = crate::service::small_request(
        shared,
        replica,
        method,
        path,
        body,
        &[(PROBE_HEADER, "token-parity")],
    );
    let (status, _, body) = tokio::time::timeout(PROBE_TIMEOUT, fut)
        .await
        .map_err(|_| format!("no answer within {PROBE_TIMEOUT:?}"))??;
    Ok((status, body))
}

/// The engine's block size from its `/metrics` (`vllm:cache_config_info{block_size=…}`).
async fn engine_block_size(shared: &Shared, r: &Replica) -> Option<u32> {
    let (status, body) = probe_request(shared, r, Method::GET, "/metrics", None)
        .await
        .ok()?;
    if !status.is_success() {
        return None;
    }
    let text = std::str::from_utf8(&body).ok()?;
    prom_text::samples(text)
        .find(|s| s.name == "vllm:cache_config_info")
        .and_then(|s| s.label("block_size").and_then(|b| b.parse().ok()))
}

/// The model name the probes use: the router's `--model`, else the replica's first served model.
async fn probe_model(shared: &Shared, r: &Replica) -> Result<String, String> {
    if let Some(m) = &shared.settings.model {
        return Ok(m.clone());
    }
    let (status, body) = probe_request(shared, r, Method::GET, "/v1/models", None).await?;
    if !status.is_success() {
        return Err(format!("/v1/models returned {status}"));
    }
    let v: Value = serde_json::from_slice(&body).map_err(|e| format!("/v1/models: {e}"))?;
    v.pointer("/data/0/id")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| "/v1/models names no model (give --model)".to_string())
}

/// An error body's message, shortened, for an unchecked reason.
fn short(body: &[u8]) -> String {
    let s = String::from_utf8_lossy(body);
    let s = s.trim();
    if s.chars().count() > 200 {
        format!("{}…", s.chars().take(200).collect::<String>())
    } else {
        s.to_string()
    }
}

/// A probe `POST` of `body` to `path` that must succeed; `Err`: why the replica stays
/// unchecked (no answer, or an error status with the start of its body).
async fn post_ok(shared: &Shared, r: &Replica, path: &str, body: &Value) -> Result<Bytes, String> {
    let (status, reply) = probe_request(
        shared,
        r,
        Method::POST,
        path,
        Some(body.to_string().into_bytes()),
    )
    .await
    .map_err(|why| format!("{path}: {why}"))?;
    if !status.is_success() {
        return Err(format!("{path} returned {status}: {}", short(&reply)));
    }
    Ok(reply)
}

/// Probes one replica ([`PROBES`], block size). `Err` on a disagreement; a replica that cannot
/// be probed is [`ReplicaParity::Unchecked`].
pub async fn check_replica(shared: &Shared, r: &Replica) -> Result<ReplicaParity, ParityError> {
    let who = format!("replica {} ({})", r.id, r.url);
    let block_size = engine_block_size(shared, r).await;
    let router_block = shared.settings.block_tokens;
    if let Some(b) = block_size
        && b != router_block
    {
        return Err(ParityError(format!(
            "{who} caches in blocks of {b} tokens (vllm:cache_config_info on /metrics) but the \
             router keys blocks of {router_block} tokens (--block-tokens): no exact key would \
             ever match; start the router with --block-tokens {b}"
        )));
    }
    let model = match probe_model(shared, r).await {
        Ok(m) => m,
        Err(why) => return Ok(ReplicaParity::Unchecked(why)),
    };
    let mut tokens = Vec::with_capacity(PROBES.len());
    let mut pieces = Vec::with_capacity(PROBES.len());
    let mut compared_ids = true;
    for probe in PROBES {
        let parsed =
            request::parse(probe.endpoint, probe.body.as_bytes()).expect("the fixed probes parse");
        // The router's own tokenize body, plus the pieces' text for the message.
        let mut tok_body: Value =
            serde_json::from_slice(&parsed.tokenize_body(&model)).expect("a JSON object");
        tok_body["return_token_strs"] = Value::Bool(true);
        let body = match post_ok(shared, r, "/tokenize", &tok_body).await {
            Ok(b) => b,
            Err(why) => return Ok(ReplicaParity::Unchecked(why)),
        };
        let router_ids = match request::parse_tokenize_reply(&body) {
            Ok(t) => t,
            Err(why) => return Ok(ReplicaParity::Unchecked(format!("/tokenize: {why}"))),
        };
        let strs: Vec<String> = serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|mut v| serde_json::from_value(v["token_strs"].take()).ok())
            .unwrap_or_default();

        let mut gen_body: Value = serde_json::from_str(probe.body).expect("a JSON object");
        gen_body["model"] = Value::String(model.clone());
        gen_body["max_tokens"] = 1.into();
        gen_body["temperature"] = 0.into();
        gen_body["stream"] = Value::Bool(false);
        gen_body["return_token_ids"] = Value::Bool(true);
        let path = probe.endpoint.path();
        let body = match post_ok(shared, r, path, &gen_body).await {
            Ok(b) => b,
            Err(why) => return Ok(ReplicaParity::Unchecked(why)),
        };
        let v: Value = serde_json::from_slice(&body).unwrap_or_default();
        let engine_ids = match probe.endpoint {
            Endpoint::Chat => v.get("prompt_token_ids"),
            Endpoint::Completions => v.pointer("/choices/0/prompt_token_ids"),
        }
        .and_then(|ids| serde_json::from_value::<Vec<u32>>(ids.clone()).ok());
        match engine_ids {
            Some(engine_ids) => {
                if let Some(i) = first_difference(&router_ids, &engine_ids) {
                    return Err(ParityError(format!(
                        "{who}, probe `{}`: the ids the router keys (/tokenize with its body) and \
                         the ids the engine prefilled ({path}, return_token_ids) {}. A chat \
                         template, BOS or special-token setting that /tokenize and generation \
                         apply differently: exact residency would predict hits the engine does \
                         not have",
                        probe.name,
                        describe_difference(
                            i,
                            ("router", &router_ids, &strs),
                            ("engine", &engine_ids)
                        )
                    )));
                }
            }
            None => {
                compared_ids = false;
                match v.pointer("/usage/prompt_tokens").and_then(Value::as_u64) {
                    Some(n) if n == router_ids.len() as u64 => {}
                    Some(n) => {
                        return Err(ParityError(format!(
                            "{who}, probe `{}`: the router keys {} tokens (/tokenize with its \
                             body) but the engine prefilled {n} ({path}, usage.prompt_tokens; it \
                             returned no token ids to name the first difference)",
                            probe.name,
                            router_ids.len()
                        )));
                    }
                    None => {
                        return Ok(ReplicaParity::Unchecked(format!(
                            "{path} answered neither prompt_token_ids nor usage.prompt_tokens"
                        )));
                    }
                }
            }
        }
        tokens.push(router_ids);
        pieces.push(strs);
    }
    Ok(ReplicaParity::Agreed {
        tokens,
        pieces,
        block_size,
        compared_ids,
    })
}

/// Probes `replicas` in order, each on its own, then compares their `/tokenize` ids with the
/// first agreeing replica's (`reference`, when the caller already holds one: the admin API
/// adding a replica). Logs one line per replica to stderr. `Err` on the first disagreement.
pub async fn check_fleet(
    shared: &Shared,
    replicas: &[Arc<Replica>],
    mut reference: Option<Reference>,
) -> Result<FleetParity, ParityError> {
    let mut out = FleetParity::default();
    for r in replicas {
        let who = format!("replica {} ({})", r.id, r.url);
        match check_replica(shared, r).await? {
            ReplicaParity::Unchecked(why) => {
                eprintln!(
                    "kvroute: token parity: {who} not checked: {why}; its exact keys are unverified"
                );
                out.unchecked.push((r.url.clone(), why));
            }
            ReplicaParity::Agreed {
                tokens,
                pieces,
                block_size,
                compared_ids,
            } => {
                if let Some(reference) = &reference {
                    for (i, probe) in PROBES.iter().enumerate() {
                        let (theirs, mine) = (&reference.tokens[i], &tokens[i]);
                        if let Some(at) = first_difference(theirs, mine) {
                            return Err(ParityError(format!(
                                "{who} tokenizes probe `{}` unlike {}: {}. The router \
                                 tokenizes each request on any healthy replica, so every \
                                 replica must share one tokenizer and chat template",
                                probe.name,
                                reference.who,
                                describe_difference(
                                    at,
                                    (
                                        &format!("replica {}", reference.id),
                                        theirs,
                                        &reference.pieces[i]
                                    ),
                                    (&format!("replica {}", r.id), mine)
                                )
                            )));
                        }
                    }
                } else {
                    reference = Some(Reference {
                        who: who.clone(),
                        id: r.id,
                        tokens,
                        pieces,
                    });
                }
                eprintln!(
                    "kvroute: token parity: {who}: {} probes agree ({}); block size {}",
                    PROBES.len(),
                    if compared_ids {
                        "token ids"
                    } else {
                        "token counts only: the engine returned no ids"
                    },
                    match block_size {
                        Some(b) => format!("{b} tokens, as the router's"),
                        None => "not published (no vllm:cache_config_info)".to_string(),
                    }
                );
                out.agreed += 1;
            }
        }
    }
    shared
        .metrics
        .token_parity_agreed
        .fetch_add(out.agreed as u64, std::sync::atomic::Ordering::Relaxed);
    shared.metrics.token_parity_unchecked.fetch_add(
        out.unchecked.len() as u64,
        std::sync::atomic::Ordering::Relaxed,
    );
    Ok(out)
}

/// The reference for a replica joining a running fleet: the `/tokenize` ids of the first other
/// eligible replica that agrees with its engine, if any.
pub async fn reference_of(
    shared: &Shared,
    others: &[Arc<Replica>],
) -> Result<Option<Reference>, ParityError> {
    for r in others.iter().filter(|r| r.eligible()) {
        if let ReplicaParity::Agreed { tokens, pieces, .. } = check_replica(shared, r).await? {
            return Ok(Some(Reference {
                who: format!("replica {} ({})", r.id, r.url),
                id: r.id,
                tokens,
                pieces,
            }));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_difference_names_the_index() {
        assert_eq!(first_difference(&[1, 2, 3], &[1, 2, 3]), None);
        assert_eq!(first_difference(&[1, 2, 3], &[1, 9, 3]), Some(1));
        assert_eq!(first_difference(&[1, 2], &[1, 2, 3]), Some(2));
        assert_eq!(first_difference(&[], &[7]), Some(0));
    }

    #[test]
    fn the_probes_parse_and_have_tokenize_bodies() {
        for p in PROBES {
            let parsed = request::parse(p.endpoint, p.body.as_bytes()).unwrap();
            let body: Value = serde_json::from_slice(&parsed.tokenize_body("m")).unwrap();
            assert_eq!(body["model"], "m");
            assert!(body.get("messages").is_some() || body.get("prompt").is_some());
        }
    }

    #[test]
    fn a_difference_is_described_with_the_piece() {
        let d = describe_difference(
            0,
            ("router", &[5, 6], &["<|im_start|>".to_string()]),
            ("engine", &[1, 5, 6]),
        );
        assert_eq!(
            d,
            "first differ at token 0: router 5 (\"<|im_start|>\") vs engine 1 (router has 2 tokens, engine 3)"
        );
    }
}
