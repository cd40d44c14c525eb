//! Prompt tokens and belief keys of every (conversation, turn), computed once per plan.
//!
//! The live path renders each request twice: the router renders the chat messages into its
//! canonical bytes (`<|role|>\n` + content + `\n` per message) and keys 64-byte blocks; the
//! engine renders them through the Llama 3 chat template and tokenizes. Both renderings of turn
//! `k` are prefixes of turn `k+1`'s (modulo the template's closing assistant header), so one
//! pass over a conversation's last turn gives every turn: the engine tokenizer never lets a
//! piece cross a special token, hence the tokens of a concatenation of template segments are the
//! concatenation of their tokens. Tests pin both against the live functions.

use engine_core::tokenizer::{self, ChatMessage};
use workload::{Plan, Role};

use crate::SimError;

/// Tokens and keys of one conversation at its last turn, with per-turn cut points.
#[derive(Debug, Clone)]
struct Conv {
    /// `<|begin_of_text|>` and every message segment up to the last user message.
    tokens: Vec<u32>,
    /// `user_ends[k-1]` = tokens before the assistant header of turn `k`.
    user_ends: Vec<u32>,
    /// Belief keys of the last turn's canonical bytes (empty when not asked for).
    belief_keys: Vec<u64>,
    /// `byte_lens[k-1]` = canonical bytes of turn `k`.
    byte_lens: Vec<u32>,
}

/// Every conversation's prompts for one plan and salt. Immutable once built, so cells of one
/// grid point share it across threads.
#[derive(Debug, Clone)]
pub struct PromptBook {
    convs: Vec<Conv>,
    tail: Vec<u32>,
    block_bytes: usize,
    model: String,
}

/// The engine's chat-template segment of one message.
fn segment(role: &str, content: &str) -> String {
    let mut s = String::with_capacity(content.len() + 48);
    s.push_str("<|start_header_id|>");
    s.push_str(role);
    s.push_str("<|end_header_id|>\n\n");
    s.push_str(content);
    s.push_str("<|eot_id|>");
    s
}

/// The router's canonical bytes of a chat request (proxy `ParsedRequest::render_into`).
pub fn canonical_bytes(messages: &[workload::Message<'_>], out: &mut Vec<u8>) {
    for m in messages {
        out.extend_from_slice(b"<|");
        out.extend_from_slice(m.role.as_str().as_bytes());
        out.extend_from_slice(b"|>\n");
        out.extend_from_slice(m.content.as_bytes());
        out.push(b'\n');
    }
}

/// The engine's prompt tokens of a chat request (server `chat_prompt` with the defaults).
pub fn engine_tokens(messages: &[workload::Message<'_>]) -> Vec<u32> {
    let msgs: Vec<ChatMessage> = messages
        .iter()
        .map(|m| ChatMessage {
            role: m.role.as_str().to_string(),
            content: m.content.to_string(),
        })
        .collect();
    tokenizer::encode(&tokenizer::render_chat(&msgs), false)
}

impl PromptBook {
    /// Tokenizes every conversation of `plan`; with `belief` also keys its canonical bytes in
    /// `block_bytes` blocks salted by `model`.
    pub fn new(
        plan: &Plan,
        model: &str,
        block_bytes: usize,
        belief: bool,
    ) -> Result<Self, SimError> {
        if block_bytes == 0 {
            return Err(SimError::Config("block_bytes must be at least 1".into()));
        }
        let turns = plan.spec.turns;
        let mut convs = Vec::with_capacity(plan.conversations.len());
        let mut bytes = Vec::new();
        for c in 0..plan.conversations.len() as u32 {
            let msgs = plan
                .messages(c, turns)
                .map_err(|e| SimError::Plan(e.to_string()))?;
            let mut tokens = Vec::with_capacity(msgs.iter().map(|m| m.content.len() / 3).sum());
            tokens.push(tokenizer::BOS_TOKEN_ID);
            let mut user_ends = Vec::with_capacity(turns as usize);
            let mut byte_lens = Vec::with_capacity(turns as usize);
            bytes.clear();
            for m in &msgs {
                tokenizer::encode_into(&segment(m.role.as_str(), &m.content), false, &mut tokens);
                canonical_bytes(std::slice::from_ref(m), &mut bytes);
                if m.role == Role::User {
                    user_ends.push(tokens.len() as u32);
                    byte_lens.push(bytes.len() as u32);
                }
            }
            let belief_keys = if belief {
                kv_index::hash::byte_block_keys(model.as_bytes(), &bytes, block_bytes)
            } else {
                Vec::new()
            };
            convs.push(Conv {
                tokens,
                user_ends,
                belief_keys,
                byte_lens,
            });
        }
        let tail = tokenizer::encode("<|start_header_id|>assistant<|end_header_id|>\n\n", false);
        Ok(Self {
            convs,
            tail,
            block_bytes,
            model: model.to_string(),
        })
    }

    /// The salt the keys were built with.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// Whether the book holds belief keys.
    pub fn has_belief_keys(&self) -> bool {
        self.convs.iter().any(|c| !c.belief_keys.is_empty())
    }

    /// Conversations held.
    pub fn len(&self) -> usize {
        self.convs.len()
    }

    /// Whether the book is empty.
    pub fn is_empty(&self) -> bool {
        self.convs.is_empty()
    }

    fn conv(&self, conversation: u32, turn: u32) -> Result<&Conv, SimError> {
        let c = self
            .convs
            .get(conversation as usize)
            .ok_or_else(|| SimError::Plan(format!("conversation {conversation} out of range")))?;
        if turn == 0 || turn as usize > c.user_ends.len() {
            return Err(SimError::Plan(format!(
                "turn {turn} of conversation {conversation} out of range"
            )));
        }
        Ok(c)
    }

    /// Appends the engine prompt tokens of `turn` (1-based) of `conversation` to `out`.
    pub fn prompt_into(
        &self,
        conversation: u32,
        turn: u32,
        out: &mut Vec<u32>,
    ) -> Result<(), SimError> {
        let c = self.conv(conversation, turn)?;
        let end = c.user_ends[turn as usize - 1] as usize;
        out.reserve(end + self.tail.len());
        out.extend_from_slice(&c.tokens[..end]);
        out.extend_from_slice(&self.tail);
        Ok(())
    }

    /// Belief keys of `turn` of `conversation` (the full byte blocks of its canonical bytes).
    pub fn belief_keys(&self, conversation: u32, turn: u32) -> Result<&[u64], SimError> {
        let c = self.conv(conversation, turn)?;
        let n = c.byte_lens[turn as usize - 1] as usize / self.block_bytes;
        Ok(&c.belief_keys[..n.min(c.belief_keys.len())])
    }
}
