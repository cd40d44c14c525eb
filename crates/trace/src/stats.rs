//! What a trace's sharing structure looks like: sessions, requests per session, how much of the
//! block traffic repeats. The crate README quotes these numbers for the conversation trace; the
//! `plan_trace` example prints them for any file.

use std::collections::HashMap;

use serde::Serialize;

use crate::parse::Trace;
use crate::session::Sessions;

/// The sharing structure of a trace.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TraceStats {
    /// Requests.
    pub requests: usize,
    /// Last arrival, s.
    pub span_s: f64,
    /// Mean prompt length, tokens.
    pub mean_input_tokens: f64,
    /// Longest prompt, tokens.
    pub max_input_tokens: u32,
    /// Mean completion length, tokens.
    pub mean_output_tokens: f64,
    /// Longest completion, tokens.
    pub max_output_tokens: u32,
    /// Blocks of the system prefix (`crate::session`).
    pub system_prefix_blocks: usize,
    /// Sessions.
    pub sessions: usize,
    /// Sessions with more than one request.
    pub multi_request_sessions: usize,
    /// Requests in those sessions.
    pub requests_in_multi_request_sessions: usize,
    /// Mean requests per session.
    pub requests_per_session_mean: f64,
    /// Median requests per session.
    pub requests_per_session_median: f64,
    /// Most requests in one session.
    pub requests_per_session_max: u32,
    /// Block references (Σ `hash_ids` lengths).
    pub block_refs: usize,
    /// Distinct block ids.
    pub distinct_blocks: usize,
    /// Share of block references that repeat a block an earlier request already sent.
    pub repeated_ref_share: f64,
    /// Share of distinct blocks that more than one request sends.
    pub shared_block_share: f64,
    /// Share of block references that are to the system prefix.
    pub system_ref_share: f64,
    /// Blocks (past the system prefix) that requests of two different sessions send: 0 when
    /// sessions partition the non-system blocks, as the session rule assumes.
    pub cross_session_blocks: usize,
}

impl TraceStats {
    /// Measures `trace` with its `sessions`.
    pub fn of(trace: &Trace, sessions: &Sessions) -> TraceStats {
        let n = trace.len();
        let mut refs: HashMap<u64, (u32, u32)> = HashMap::new(); // id → (requests, first session)
        let mut cross = 0usize;
        let mut block_refs = 0usize;
        let mut repeated = 0usize;
        let mut system_refs = 0usize;
        let prefix = sessions.system_prefix.len();
        for (k, r) in trace.records().iter().enumerate() {
            let ids = trace.hash_ids(r);
            let s = sessions.of_record[k];
            let in_prefix = if ids.starts_with(&sessions.system_prefix) {
                prefix
            } else {
                0
            };
            system_refs += in_prefix;
            for (j, &id) in ids.iter().enumerate() {
                block_refs += 1;
                match refs.get_mut(&id) {
                    Some(e) => {
                        repeated += 1;
                        e.0 += 1;
                        if j >= in_prefix && e.1 != s && e.1 != u32::MAX {
                            cross += 1;
                            e.1 = u32::MAX; // count each block once
                        }
                    }
                    None => {
                        refs.insert(id, (1, if j >= in_prefix { s } else { u32::MAX }));
                    }
                }
            }
        }
        let mut sizes = sessions.sizes();
        sizes.sort_unstable();
        let median = match sizes.len() {
            0 => 0.0,
            m if m % 2 == 1 => f64::from(sizes[m / 2]),
            m => (f64::from(sizes[m / 2 - 1]) + f64::from(sizes[m / 2])) / 2.0,
        };
        let multi: Vec<u32> = sizes.iter().copied().filter(|&s| s > 1).collect();
        let records = trace.records();
        let share = |a: usize, b: usize| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        TraceStats {
            requests: n,
            span_s: trace.span_us() as f64 / 1e6,
            mean_input_tokens: records
                .iter()
                .map(|r| f64::from(r.input_tokens))
                .sum::<f64>()
                / n as f64,
            max_input_tokens: records.iter().map(|r| r.input_tokens).max().unwrap_or(0),
            mean_output_tokens: records
                .iter()
                .map(|r| f64::from(r.output_tokens))
                .sum::<f64>()
                / n as f64,
            max_output_tokens: records.iter().map(|r| r.output_tokens).max().unwrap_or(0),
            system_prefix_blocks: prefix,
            sessions: sessions.len(),
            multi_request_sessions: multi.len(),
            requests_in_multi_request_sessions: multi.iter().map(|&s| s as usize).sum(),
            requests_per_session_mean: share(n, sessions.len()),
            requests_per_session_median: median,
            requests_per_session_max: sizes.last().copied().unwrap_or(0),
            block_refs,
            distinct_blocks: refs.len(),
            repeated_ref_share: share(repeated, block_refs),
            shared_block_share: share(refs.values().filter(|e| e.0 > 1).count(), refs.len()),
            system_ref_share: share(system_refs, block_refs),
            cross_session_blocks: cross,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_sessions_and_sharing() {
        let text = [
            r#"{"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [0, 1]}"#,
            r#"{"timestamp": 1, "input_length": 1536, "output_length": 6, "hash_ids": [0, 1, 2]}"#,
            r#"{"timestamp": 2, "input_length": 1024, "output_length": 2, "hash_ids": [0, 3]}"#,
        ]
        .join("\n");
        let t = Trace::parse_bytes("t", text.as_bytes()).unwrap();
        let s = TraceStats::of(&t, &Sessions::derive(&t));
        assert_eq!((s.requests, s.sessions, s.system_prefix_blocks), (3, 2, 1));
        assert_eq!(
            (
                s.multi_request_sessions,
                s.requests_in_multi_request_sessions
            ),
            (1, 2)
        );
        assert_eq!(
            (s.requests_per_session_max, s.requests_per_session_median),
            (2, 1.5)
        );
        assert_eq!((s.block_refs, s.distinct_blocks), (7, 4));
        // Repeats: 0 twice, 1 once.
        assert!((s.repeated_ref_share - 3.0 / 7.0).abs() < 1e-12);
        // Blocks 0 and 1 are sent by more than one request.
        assert_eq!(s.shared_block_share, 0.5);
        assert!((s.system_ref_share - 3.0 / 7.0).abs() < 1e-12);
        assert_eq!(s.cross_session_blocks, 0);
        assert_eq!(s.max_input_tokens, 1536);
    }
}
