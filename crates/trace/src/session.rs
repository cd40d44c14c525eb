//! Which requests of a trace belong to one conversation.
//!
//! A Mooncake trace names no sessions; it names blocks. Every request of a chat service starts with
//! the service's system prompt (in `mooncake-conversation.jsonl`, block 0 opens all 12,031
//! requests), and the turns of one conversation then share the conversation's first user block.
//! The rule:
//!
//! 1. The **system prefix** is the longest run of leading ids shared by every request that starts
//!    with the most common first id — when a majority of requests start with it; otherwise it is
//!    empty. (A majority, not all, so that one stray request cannot erase it.)
//! 2. A request that starts with the system prefix belongs to the session keyed by its **first
//!    block after the prefix** (`s<id>`); one that has no block after it is a session of its own
//!    (`r<line>`); one that does not start with the prefix is keyed by its first block.
//! 3. A request's **turn** is its 1-based place among its session's requests in arrival order,
//!    over the whole trace (slicing a replay does not renumber turns).
//!
//! Why the first block after the prefix: a conversation's later turns re-send its earlier turns,
//! so they all begin with the same first user block, and no two conversations share a block past
//! the system prompt (measured on the conversation trace: no block after block 0 is shared by two
//! sessions so formed; see the crate README for the numbers).

use std::collections::HashMap;

use crate::parse::Trace;

/// What names a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SessionKey {
    /// The first block after the system prefix.
    Block(u64),
    /// A request with no block after the system prefix: its own session, by line number.
    Request(u32),
}

impl SessionKey {
    /// The `x-session-id` of the session: `s<block id>` or `r<line>`.
    pub fn id(&self) -> String {
        match self {
            SessionKey::Block(b) => format!("s{b}"),
            SessionKey::Request(line) => format!("r{line}"),
        }
    }
}

/// The sessions of a trace: one per key, numbered in order of first arrival.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sessions {
    /// The system prefix (rule 1).
    pub system_prefix: Vec<u64>,
    /// Session index of each record (in [`Trace::records`] order).
    pub of_record: Vec<u32>,
    /// 1-based turn of each record within its session.
    pub turn_of_record: Vec<u32>,
    /// The key of each session index.
    pub keys: Vec<SessionKey>,
}

/// The system prefix of a trace (rule 1).
fn system_prefix(trace: &Trace) -> Vec<u64> {
    let mut first: HashMap<u64, usize> = HashMap::new();
    for r in trace.records() {
        *first.entry(trace.hash_ids(r)[0]).or_default() += 1;
    }
    // The most common first id; ties go to the smallest id, so the rule is deterministic.
    let Some((&lead, &count)) = first
        .iter()
        .max_by(|a, b| a.1.cmp(b.1).then_with(|| b.0.cmp(a.0)))
    else {
        return Vec::new();
    };
    if count * 2 <= trace.len() {
        return Vec::new();
    }
    let mut prefix: Option<&[u64]> = None;
    for r in trace.records() {
        let ids = trace.hash_ids(r);
        if ids[0] != lead {
            continue;
        }
        prefix = Some(match prefix {
            None => ids,
            Some(p) => {
                let common = p.iter().zip(ids).take_while(|(a, b)| a == b).count();
                &p[..common]
            }
        });
    }
    prefix.map(<[u64]>::to_vec).unwrap_or_default()
}

impl Sessions {
    /// Applies the rule to `trace`.
    pub fn derive(trace: &Trace) -> Sessions {
        let prefix = system_prefix(trace);
        let mut index: HashMap<SessionKey, u32> = HashMap::new();
        let mut keys = Vec::new();
        let mut turns: Vec<u32> = Vec::new();
        let mut of_record = Vec::with_capacity(trace.len());
        let mut turn_of_record = Vec::with_capacity(trace.len());
        for r in trace.records() {
            let ids = trace.hash_ids(r);
            let key = if ids.starts_with(&prefix) {
                match ids.get(prefix.len()) {
                    Some(&b) => SessionKey::Block(b),
                    None => SessionKey::Request(r.line),
                }
            } else {
                SessionKey::Block(ids[0])
            };
            let s = *index.entry(key).or_insert_with(|| {
                keys.push(key);
                turns.push(0);
                (keys.len() - 1) as u32
            });
            turns[s as usize] += 1;
            of_record.push(s);
            turn_of_record.push(turns[s as usize]);
        }
        Sessions {
            system_prefix: prefix,
            of_record,
            turn_of_record,
            keys,
        }
    }

    /// Number of sessions.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether there is no session.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Requests per session, by session index.
    pub fn sizes(&self) -> Vec<u32> {
        let mut n = vec![0u32; self.keys.len()];
        for &s in &self.of_record {
            n[s as usize] += 1;
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(lines: &[(u64, &[u64])]) -> Trace {
        let text: String = lines
            .iter()
            .map(|(ts, ids)| {
                format!(
                    "{{\"timestamp\": {ts}, \"input_length\": {}, \"output_length\": 5, \"hash_ids\": {ids:?}}}\n",
                    ids.len() * 512
                )
            })
            .collect();
        Trace::parse_bytes("t", text.as_bytes()).unwrap()
    }

    #[test]
    fn sessions_are_keyed_by_the_first_block_after_the_system_prefix() {
        // Block 0 opens every request: the system prompt. Sessions: 1 (three turns, one of them
        // a branch that drops the last turn), 5, and a request with nothing after the prefix.
        let t = trace(&[
            (0, &[0, 1, 2]),
            (10, &[0, 5, 6]),
            (20, &[0, 1, 2, 3, 4]),
            (30, &[0]),
            (40, &[0, 1, 2, 7]),
        ]);
        let s = Sessions::derive(&t);
        assert_eq!(s.system_prefix, [0]);
        assert_eq!(
            s.keys,
            [
                SessionKey::Block(1),
                SessionKey::Block(5),
                SessionKey::Request(4)
            ]
        );
        assert_eq!(s.of_record, [0, 1, 0, 2, 0]);
        assert_eq!(s.turn_of_record, [1, 1, 2, 1, 3]);
        assert_eq!(s.sizes(), [3, 1, 1]);
        let ids: Vec<String> = s.keys.iter().map(SessionKey::id).collect();
        assert_eq!(ids, ["s1", "s5", "r4"]);
    }

    #[test]
    fn the_system_prefix_is_the_majority_lead_and_may_be_longer_than_one_block() {
        // Three of four requests open with [9, 8]; the stray one is keyed by its first block.
        let t = trace(&[
            (0, &[9, 8, 1]),
            (1, &[9, 8, 2, 3]),
            (2, &[4, 5]),
            (3, &[9, 8, 1, 6]),
        ]);
        let s = Sessions::derive(&t);
        assert_eq!(s.system_prefix, [9, 8]);
        assert_eq!(
            s.keys,
            [
                SessionKey::Block(1),
                SessionKey::Block(2),
                SessionKey::Block(4)
            ]
        );
        assert_eq!(s.turn_of_record, [1, 1, 1, 2]);
        // No majority lead: no prefix, every request keyed by its first block.
        let t = trace(&[(0, &[1, 2]), (1, &[3, 4]), (2, &[1, 2, 5]), (3, &[6])]);
        let s = Sessions::derive(&t);
        assert!(s.system_prefix.is_empty());
        assert_eq!(s.of_record, [0, 1, 0, 2]);
    }
}
