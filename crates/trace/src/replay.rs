//! A trace mapped to a replay plan: which requests, when, in which session, how long their
//! prompts are and how many tokens each asks for. Prompt texts are not stored; [`ReplayPlan::
//! prompt_into`] generates a request's text from its block ids when it is sent.
//!
//! The mapping (`ReplaySpec`):
//! - **Blocks.** Each hash id is a block of `block_tokens` (B) tokens of text, `B ×
//!   bytes_per_token` bytes (`crate::text`). B = 512 is the trace's own block size; B < 512 scales
//!   every prompt down by 512/B and keeps the sharing structure (the same ids, in the same order).
//! - **Prompt length.** `prompt_tokens = ⌈input_length × B / 512⌉`, so the last block is cut to
//!   the request's own length and is never empty (`(n − 1) × 512 < input_length` for n ids).
//! - **Output.** `max_tokens = output_length` as the trace gives it — not scaled with B (a
//!   completion is generated token by token whatever the prompt's size); 0 becomes 1, the
//!   smallest request an engine accepts.
//! - **Time.** The slice is the requests with `start_s ≤ timestamp < start_s + duration_s`
//!   (trace seconds), at most `max_requests` of them in arrival order; a request is sent at
//!   `(timestamp − start_s) × time_scale`. Open loop: nothing waits for an earlier response —
//!   every prompt is fixed by the trace, so no byte depends on what an engine generated.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

use crate::TraceError;
use crate::parse::{TRACE_BLOCK_TOKENS, Trace};
use crate::session::Sessions;
use crate::text;

/// Version of the replay plan's canonical encoding (what the fingerprint hashes).
pub const REPLAY_FORMAT: u32 = 1;

/// The default block size: the trace's own, so prompts keep their real lengths.
pub const DEFAULT_BLOCK_TOKENS: u32 = 512;

/// Largest block size accepted (8× the trace's own).
const MAX_BLOCK_TOKENS: u32 = 4096;

/// How a trace is mapped to requests.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ReplaySpec {
    /// Tokens of text per hash id (B); 512 replays prompts at their real length.
    pub block_tokens: u32,
    /// Bytes of text per token (the workload's 4).
    pub bytes_per_token: u32,
    /// Seed of the block texts.
    pub seed: u64,
    /// Replay time = trace time × this (0.5 sends twice as fast).
    pub time_scale: f64,
    /// Start of the slice, trace seconds.
    pub start_s: f64,
    /// Length of the slice, trace seconds (`None`: to the end).
    pub duration_s: Option<f64>,
    /// At most this many requests of the slice, in arrival order.
    pub max_requests: Option<u32>,
}

impl Default for ReplaySpec {
    fn default() -> Self {
        Self {
            block_tokens: DEFAULT_BLOCK_TOKENS,
            bytes_per_token: workload::spec::DEFAULT_BYTES_PER_TOKEN,
            seed: 7,
            time_scale: 1.0,
            start_s: 0.0,
            duration_s: None,
            max_requests: None,
        }
    }
}

impl ReplaySpec {
    /// Checks every parameter, naming the one out of range.
    pub fn validate(&self) -> Result<(), TraceError> {
        let bad = |m: String| Err(TraceError::Spec(m));
        if !(1..=MAX_BLOCK_TOKENS).contains(&self.block_tokens) {
            return bad(format!(
                "block tokens must be in 1..={MAX_BLOCK_TOKENS}, got {}",
                self.block_tokens
            ));
        }
        if !(1..=16).contains(&self.bytes_per_token) {
            return bad(format!(
                "bytes per token must be in 1..=16, got {}",
                self.bytes_per_token
            ));
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return bad(format!("time scale must be > 0, got {}", self.time_scale));
        }
        if !(self.start_s.is_finite() && self.start_s >= 0.0) {
            return bad(format!("start must be ≥ 0 s, got {}", self.start_s));
        }
        if let Some(d) = self.duration_s
            && !(d.is_finite() && d > 0.0)
        {
            return bad(format!("duration must be > 0 s, got {d}"));
        }
        if self.max_requests == Some(0) {
            return bad("max requests must be at least 1".into());
        }
        Ok(())
    }

    /// Bytes of one whole block.
    pub fn block_bytes(&self) -> usize {
        self.block_tokens as usize * self.bytes_per_token as usize
    }

    /// The content part of a plan's name: `trace-<hash>-b<B>[-bpt<b>]-seed<s>` (the first 8 hex
    /// digits of the trace's hash).
    pub fn workload_name(&self, trace_hash: u64) -> String {
        let bpt = if self.bytes_per_token == workload::spec::DEFAULT_BYTES_PER_TOKEN {
            String::new()
        } else {
            format!("-bpt{}", self.bytes_per_token)
        };
        format!(
            "trace-{:08x}-b{}{bpt}-seed{}",
            trace_hash >> 32,
            self.block_tokens,
            self.seed
        )
    }

    /// The arrival part: `replay-x<scale>[-from<start>][-d<duration>][-n<max>]`, the time scale
    /// rounded to 6 decimals (the fingerprint keeps every bit).
    pub fn arrival_name(&self) -> String {
        let mut s = format!("replay-x{}", (self.time_scale * 1e6).round() / 1e6);
        if self.start_s > 0.0 {
            s.push_str(&format!("-from{}", self.start_s));
        }
        if let Some(d) = self.duration_s {
            s.push_str(&format!("-d{d}"));
        }
        if let Some(n) = self.max_requests {
            s.push_str(&format!("-n{n}"));
        }
        s
    }
}

/// One request of a replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayRequest {
    /// Line of the trace it comes from (1-based); the request id is `t<line>`.
    pub line: u32,
    /// When to send it, µs after the replay starts.
    pub at_us: u64,
    /// Index into the plan's sessions.
    pub session: u32,
    /// 1-based turn within its session (over the whole trace).
    pub turn: u32,
    /// The trace's `input_length`.
    pub trace_input_tokens: u32,
    /// Prompt length after scaling, tokens (`⌈input_length × B / 512⌉`).
    pub prompt_tokens: u32,
    /// `max_tokens`: the trace's `output_length` (at least 1).
    pub max_tokens: u32,
    ids_start: u32,
    ids_len: u32,
}

/// Consecutive trace lines of one load-ladder stage (a generated trace's `stage` field): how a
/// report splits a replay's rows (`t<line>`) by stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageRun {
    /// The 0-based stage.
    pub stage: u32,
    /// First trace line of the run (1-based).
    pub first_line: u32,
    /// Last trace line of the run, inclusive.
    pub last_line: u32,
    /// The stage starts only when everything before it has ended (`"drain": true`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub after_drain: bool,
}

/// A trace slice mapped to requests; the texts are generated on demand.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayPlan {
    spec: ReplaySpec,
    trace_hash: u64,
    trace_requests: u32,
    trace_span_us: u64,
    system_prefix: Vec<u64>,
    session_ids: Vec<String>,
    requests: Vec<ReplayRequest>,
    ids: Vec<u64>,
    stage_runs: Vec<StageRun>,
}

fn secs_to_us(s: f64) -> u64 {
    (s * 1e6).round() as u64
}

impl ReplayPlan {
    /// Maps `trace` by `spec`. Deterministic: the same trace bytes and spec give a byte-identical
    /// plan ([`ReplayPlan::encode`]).
    pub fn build(trace: &Trace, spec: &ReplaySpec) -> Result<ReplayPlan, TraceError> {
        spec.validate()?;
        let sessions = Sessions::derive(trace);
        let start_us = secs_to_us(spec.start_s);
        let end_us = spec.duration_s.map(|d| start_us + secs_to_us(d));
        let cap = spec.max_requests.map_or(usize::MAX, |n| n as usize);
        let b = u64::from(spec.block_tokens);
        let mut slice_session: HashMap<u32, u32> = HashMap::new();
        let mut session_ids = Vec::new();
        let mut requests = Vec::new();
        let mut ids = Vec::new();
        let mut stage_runs: Vec<StageRun> = Vec::new();
        for (k, r) in trace.records().iter().enumerate() {
            if r.timestamp_us < start_us {
                continue;
            }
            if end_us.is_some_and(|e| r.timestamp_us >= e) || requests.len() == cap {
                break;
            }
            let full = sessions.of_record[k];
            let session = *slice_session.entry(full).or_insert_with(|| {
                session_ids.push(sessions.keys[full as usize].id());
                (session_ids.len() - 1) as u32
            });
            let prompt_tokens = (u64::from(r.input_tokens) * b).div_ceil(TRACE_BLOCK_TOKENS);
            let block_ids = trace.hash_ids(r);
            let (Ok(prompt_tokens), Ok(ids_start)) =
                (u32::try_from(prompt_tokens), u32::try_from(ids.len()))
            else {
                return Err(TraceError::Spec(format!(
                    "line {}: the scaled prompt or the slice is too large",
                    r.line
                )));
            };
            requests.push(ReplayRequest {
                line: r.line,
                at_us: ((r.timestamp_us - start_us) as f64 * spec.time_scale).round() as u64,
                session,
                turn: sessions.turn_of_record[k],
                trace_input_tokens: r.input_tokens,
                prompt_tokens,
                max_tokens: r.output_tokens.max(1),
                ids_start,
                ids_len: block_ids.len() as u32,
            });
            ids.extend_from_slice(block_ids);
            if let Some(stage) = r.stage {
                match stage_runs.last_mut() {
                    Some(run)
                        if run.stage == stage
                            && run.after_drain == r.drain
                            && run.last_line + 1 == r.line =>
                    {
                        run.last_line = r.line;
                    }
                    _ => stage_runs.push(StageRun {
                        stage,
                        first_line: r.line,
                        last_line: r.line,
                        after_drain: r.drain,
                    }),
                }
            }
        }
        if requests.is_empty() {
            return Err(TraceError::Spec(format!(
                "the slice from {} s{} of {} selects no request (the trace spans {:.1} s)",
                spec.start_s,
                spec.duration_s
                    .map(|d| format!(" for {d} s"))
                    .unwrap_or_default(),
                trace.source(),
                trace.span_us() as f64 / 1e6
            )));
        }
        Ok(ReplayPlan {
            spec: *spec,
            trace_hash: trace.content_hash(),
            trace_requests: trace.len() as u32,
            trace_span_us: trace.span_us(),
            system_prefix: sessions.system_prefix,
            session_ids,
            requests,
            ids,
            stage_runs,
        })
    }

    /// The slice's load-ladder stages as runs of consecutive lines (empty when the trace's
    /// lines carry no `stage`). Not part of the fingerprint: a stage labels requests, it does not
    /// change what is sent.
    pub fn stage_runs(&self) -> &[StageRun] {
        &self.stage_runs
    }

    /// For each request, whether it opens a stage that waits for everything before it to end
    /// (the first request of a `"drain": true` stage after another stage).
    pub fn drain_starts(&self) -> Vec<bool> {
        let starts: std::collections::HashSet<u32> = self
            .stage_runs
            .windows(2)
            .filter(|w| w[1].after_drain && w[0].stage != w[1].stage)
            .map(|w| w[1].first_line)
            .collect();
        self.requests
            .iter()
            .map(|r| starts.contains(&r.line))
            .collect()
    }

    /// The mapping parameters.
    pub fn spec(&self) -> &ReplaySpec {
        &self.spec
    }

    /// xxh3-64 of the trace file's bytes.
    pub fn trace_hash(&self) -> u64 {
        self.trace_hash
    }

    /// [`ReplayPlan::trace_hash`] as 16 hex digits.
    pub fn trace_hash_hex(&self) -> String {
        format!("{:016x}", self.trace_hash)
    }

    /// Requests in the whole trace (not only the slice).
    pub fn trace_requests(&self) -> u32 {
        self.trace_requests
    }

    /// The whole trace's last arrival, µs (unscaled).
    pub fn trace_span_us(&self) -> u64 {
        self.trace_span_us
    }

    /// The system prefix the session rule found (`crate::session`).
    pub fn system_prefix(&self) -> &[u64] {
        &self.system_prefix
    }

    /// The requests, in send order.
    pub fn requests(&self) -> &[ReplayRequest] {
        &self.requests
    }

    /// Number of requests.
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// Whether the plan is empty (never true for a built plan).
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// Sessions in the slice.
    pub fn session_count(&self) -> usize {
        self.session_ids.len()
    }

    /// The `x-session-id` of session index `session` (`s<block>` or `r<line>`).
    pub fn session_id(&self, session: u32) -> &str {
        &self.session_ids[session as usize]
    }

    /// The `x-request-id` of a request: `t<line>`.
    pub fn request_id(r: &ReplayRequest) -> String {
        format!("t{}", r.line)
    }

    /// The block ids of a request's prompt.
    pub fn block_ids(&self, r: &ReplayRequest) -> &[u64] {
        let start = r.ids_start as usize;
        &self.ids[start..start + r.ids_len as usize]
    }

    /// Bytes of a request's prompt text.
    pub fn prompt_bytes(&self, r: &ReplayRequest) -> usize {
        r.prompt_tokens as usize * self.spec.bytes_per_token as usize
    }

    /// Appends a request's prompt text to `out` (generated from its block ids).
    pub fn prompt_into(&self, r: &ReplayRequest, out: &mut String) {
        text::prompt_into(
            self.spec.seed,
            self.block_ids(r),
            self.spec.block_bytes(),
            self.prompt_bytes(r),
            out,
        );
    }

    /// A request's prompt text.
    pub fn prompt(&self, r: &ReplayRequest) -> String {
        let mut s = String::new();
        self.prompt_into(r, &mut s);
        s
    }

    /// The last send time, µs after the start.
    pub fn end_us(&self) -> u64 {
        self.requests.last().map_or(0, |r| r.at_us)
    }

    /// Where the replay's schedule ends, µs after the start: the slice's length × the time
    /// scale when a duration was given, else just past the last request.
    pub fn planned_end_us(&self) -> u64 {
        match self.spec.duration_s {
            Some(d) => secs_to_us(d * self.spec.time_scale),
            None => self.end_us() + 1,
        }
    }

    /// The content name (`ReplaySpec::workload_name`).
    pub fn workload_name(&self) -> String {
        self.spec.workload_name(self.trace_hash)
    }

    /// The full name: content and arrival, e.g. `trace-1f0e6c2a-b64-seed7-replay-x2`.
    pub fn name(&self) -> String {
        format!("{}-{}", self.workload_name(), self.spec.arrival_name())
    }

    /// The canonical bytes of the plan: format, trace hash, every mapping parameter, the system
    /// prefix, the session ids and every request with its block ids. The texts are a pure
    /// function of these, so equal bytes mean identical requests.
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc(Vec::with_capacity(
            64 + self.ids.len() * 8 + self.requests.len() * 40,
        ));
        e.0.extend_from_slice(b"kvroute-trace-replay");
        e.u32(REPLAY_FORMAT);
        self.encode_content(&mut e);
        e.u32(self.trace_requests);
        e.u64(self.trace_span_us);
        e.f64(self.spec.time_scale);
        e.f64(self.spec.start_s);
        e.opt_f64(self.spec.duration_s);
        e.u32(self.spec.max_requests.unwrap_or(0));
        e.u64(self.system_prefix.len() as u64);
        for &id in &self.system_prefix {
            e.u64(id);
        }
        e.u64(self.session_ids.len() as u64);
        for s in &self.session_ids {
            e.u64(s.len() as u64);
            e.0.extend_from_slice(s.as_bytes());
        }
        e.u64(self.requests.len() as u64);
        for r in &self.requests {
            e.u32(r.line);
            e.u64(r.at_us);
            e.u32(r.session);
            e.u32(r.turn);
            e.u32(r.trace_input_tokens);
            e.u32(r.prompt_tokens);
            e.u32(r.max_tokens);
            e.u32(r.ids_len);
            for &id in self.block_ids(r) {
                e.u64(id);
            }
        }
        e.0
    }

    fn encode_content(&self, e: &mut Enc) {
        e.u64(self.trace_hash);
        e.u32(self.spec.block_tokens);
        e.u32(self.spec.bytes_per_token);
        e.u64(self.spec.seed);
    }

    /// xxh3-64 of [`ReplayPlan::encode`], 16 hex digits: the arrival-plan fingerprint.
    pub fn fingerprint_hex(&self) -> String {
        format!("{:016x}", xxh3_64(&self.encode()))
    }

    /// Fingerprint of the content mapping only (trace hash, B, bytes per token, seed): equal
    /// across slices and time scales of one trace mapped the same way.
    pub fn workload_fingerprint_hex(&self) -> String {
        let mut e = Enc(Vec::new());
        e.0.extend_from_slice(b"kvroute-trace-content");
        e.u32(REPLAY_FORMAT);
        self.encode_content(&mut e);
        format!("{:016x}", xxh3_64(&e.0))
    }

    /// What the plan is, as one JSON object (names, fingerprints, the mapping, sizes).
    pub fn describe(&self) -> serde_json::Value {
        let prompt: u64 = self
            .requests
            .iter()
            .map(|r| u64::from(r.prompt_tokens))
            .sum();
        let output: u64 = self.requests.iter().map(|r| u64::from(r.max_tokens)).sum();
        serde_json::json!({
            "name": self.name(),
            "workload_name": self.workload_name(),
            "fingerprint": self.fingerprint_hex(),
            "workload_fingerprint": self.workload_fingerprint_hex(),
            "trace_hash": self.trace_hash_hex(),
            "trace_requests": self.trace_requests,
            "trace_span_s": self.trace_span_us as f64 / 1e6,
            "spec": self.spec,
            "system_prefix_blocks": self.system_prefix.len(),
            "requests": self.requests.len(),
            "sessions": self.session_ids.len(),
            "first_line": self.requests.first().map(|r| r.line),
            "last_line": self.requests.last().map(|r| r.line),
            "replay_span_s": self.end_us() as f64 / 1e6,
            "prompt_tokens": prompt,
            "max_tokens": output,
        })
    }
}

/// Little-endian canonical encoding.
struct Enc(Vec<u8>);

impl Enc {
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn f64(&mut self, v: f64) {
        self.u64(v.to_bits());
    }
    fn opt_f64(&mut self, v: Option<f64>) {
        match v {
            None => self.0.push(0),
            Some(v) => {
                self.0.push(1);
                self.f64(v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two sessions (block 1: three turns; block 5: one) behind system block 0.
    fn trace() -> Trace {
        let lines = [
            (0, 700, 20, vec![0, 1]),
            (1000, 900, 0, vec![0, 5]),
            (2000, 1500, 30, vec![0, 1, 2]),
            (4000, 2000, 40, vec![0, 1, 2, 3]),
        ];
        let text: String = lines
            .iter()
            .map(|(ts, input, output, ids)| {
                format!(
                    "{{\"timestamp\": {ts}, \"input_length\": {input}, \"output_length\": {output}, \"hash_ids\": {ids:?}}}\n"
                )
            })
            .collect();
        Trace::parse_bytes("t.jsonl", text.as_bytes()).unwrap()
    }

    #[test]
    fn prompts_scale_with_the_block_size_and_outputs_stay_as_given() {
        let t = trace();
        let full = ReplayPlan::build(&t, &ReplaySpec::default()).unwrap();
        let r = full.requests();
        let prompt: Vec<u32> = r.iter().map(|r| r.prompt_tokens).collect();
        assert_eq!(prompt, [700, 900, 1500, 2000]);
        let max: Vec<u32> = r.iter().map(|r| r.max_tokens).collect();
        assert_eq!(max, [20, 1, 30, 40], "as given; 0 becomes 1");
        for r in r {
            assert_eq!(full.prompt(r).len(), r.prompt_tokens as usize * 4);
        }
        let small = ReplayPlan::build(
            &t,
            &ReplaySpec {
                block_tokens: 64,
                ..ReplaySpec::default()
            },
        )
        .unwrap();
        let prompt: Vec<u32> = small.requests().iter().map(|r| r.prompt_tokens).collect();
        // ⌈700·64/512⌉ = 88 (87.5), 112.5 → 113, 187.5 → 188, 250.
        assert_eq!(prompt, [88, 113, 188, 250]);
        let max: Vec<u32> = small.requests().iter().map(|r| r.max_tokens).collect();
        assert_eq!(max, [20, 1, 30, 40]);
        // One token of the last block survives the smallest scaling.
        let tiny = ReplayPlan::build(
            &t,
            &ReplaySpec {
                block_tokens: 1,
                ..ReplaySpec::default()
            },
        )
        .unwrap();
        let prompt: Vec<u32> = tiny.requests().iter().map(|r| r.prompt_tokens).collect();
        assert_eq!(prompt, [2, 2, 3, 4]);
    }

    #[test]
    fn time_scales_and_slices() {
        let t = trace();
        let at = |spec: ReplaySpec| -> Vec<(u32, u64)> {
            ReplayPlan::build(&t, &spec)
                .unwrap()
                .requests()
                .iter()
                .map(|r| (r.line, r.at_us))
                .collect()
        };
        assert_eq!(
            at(ReplaySpec::default()),
            [(1, 0), (2, 1_000_000), (3, 2_000_000), (4, 4_000_000)]
        );
        assert_eq!(
            at(ReplaySpec {
                time_scale: 0.25,
                ..ReplaySpec::default()
            }),
            [(1, 0), (2, 250_000), (3, 500_000), (4, 1_000_000)]
        );
        // From 1 s for 3 s: lines 2 and 3 (line 4 at 4 s is outside [1, 4)), times from the
        // slice's start, turns as in the whole trace.
        let plan = ReplayPlan::build(
            &t,
            &ReplaySpec {
                start_s: 1.0,
                duration_s: Some(3.0),
                time_scale: 2.0,
                ..ReplaySpec::default()
            },
        )
        .unwrap();
        let got: Vec<(u32, u64, &str, u32)> = plan
            .requests()
            .iter()
            .map(|r| (r.line, r.at_us, plan.session_id(r.session), r.turn))
            .collect();
        assert_eq!(got, [(2, 0, "s5", 1), (3, 2_000_000, "s1", 2)]);
        assert_eq!(
            plan.name(),
            format!("{}-replay-x2-from1-d3", plan.workload_name())
        );
        let capped = at(ReplaySpec {
            max_requests: Some(2),
            ..ReplaySpec::default()
        });
        assert_eq!(capped.len(), 2);
        let none = ReplayPlan::build(
            &t,
            &ReplaySpec {
                start_s: 10.0,
                ..ReplaySpec::default()
            },
        )
        .unwrap_err();
        assert!(none.to_string().contains("selects no request"), "{none}");
    }

    #[test]
    fn requests_sharing_leading_ids_share_exactly_those_blocks() {
        let t = trace();
        let spec = ReplaySpec {
            block_tokens: 32,
            ..ReplaySpec::default()
        };
        let plan = ReplayPlan::build(&t, &spec).unwrap();
        let block = spec.block_bytes();
        let p: Vec<String> = plan.requests().iter().map(|r| plan.prompt(r)).collect();
        // Lines 3 and 4 share [0, 1, 2]; line 3's block 2 is cut, line 4's is whole.
        assert_eq!(p[2][..2 * block], p[3][..2 * block]);
        assert_eq!(p[2][2 * block..], p[3][2 * block..p[2].len()]);
        // Lines 1 and 2 share only block 0; their cut second blocks (1 and 5) are the first
        // bytes of two different blocks.
        assert_eq!(p[0][..block], p[1][..block]);
        let n = p[0].len().min(p[1].len());
        assert_eq!(
            p[0][block..],
            text::block_text(spec.seed, 1, block)[..p[0].len() - block]
        );
        assert_ne!(p[0][block..n], p[1][block..n]);
        // Every prompt opens with the system block's text.
        let system = text::block_text(spec.seed, 0, block);
        assert!(p.iter().all(|p| p.starts_with(&system)));
    }

    #[test]
    fn plans_are_byte_identical_and_fingerprints_follow_every_parameter() {
        let t = trace();
        let spec = ReplaySpec {
            block_tokens: 64,
            time_scale: 0.5,
            ..ReplaySpec::default()
        };
        let a = ReplayPlan::build(&t, &spec).unwrap();
        let b = ReplayPlan::build(&trace(), &spec).unwrap();
        assert_eq!(a.encode(), b.encode());
        assert_eq!(a.fingerprint_hex(), b.fingerprint_hex());
        for (x, y) in a.requests().iter().zip(b.requests()) {
            assert_eq!(a.prompt(x), b.prompt(y));
        }
        let variants = [
            ReplaySpec {
                block_tokens: 32,
                ..spec
            },
            ReplaySpec {
                bytes_per_token: 3,
                ..spec
            },
            ReplaySpec { seed: 8, ..spec },
            ReplaySpec {
                time_scale: 0.25,
                ..spec
            },
            ReplaySpec {
                start_s: 0.5,
                ..spec
            },
            ReplaySpec {
                duration_s: Some(100.0),
                ..spec
            },
            ReplaySpec {
                max_requests: Some(100),
                ..spec
            },
        ];
        let mut fingerprints = vec![a.fingerprint_hex()];
        let mut names = vec![a.name()];
        for v in variants {
            let p = ReplayPlan::build(&t, &v).unwrap();
            fingerprints.push(p.fingerprint_hex());
            names.push(p.name());
        }
        let unique: std::collections::BTreeSet<_> = fingerprints.iter().collect();
        assert_eq!(unique.len(), fingerprints.len(), "{fingerprints:?}");
        let unique: std::collections::BTreeSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "{names:?}");
        // Another trace file (one byte more): another hash, name and both fingerprints.
        let other = Trace::parse_bytes(
            "t2",
            format!(
                "{}{}",
                r#"{"timestamp": 0, "input_length": 700, "output_length": 20, "hash_ids": [0, 1]} "#,
                "\n"
            )
            .as_bytes(),
        )
        .unwrap();
        let o = ReplayPlan::build(&other, &spec).unwrap();
        assert_ne!(o.workload_name(), a.workload_name());
        assert_ne!(o.workload_fingerprint_hex(), a.workload_fingerprint_hex());
        // The content fingerprint ignores time and slicing, not the mapping.
        let slower = ReplayPlan::build(
            &t,
            &ReplaySpec {
                time_scale: 3.0,
                ..spec
            },
        )
        .unwrap();
        assert_eq!(
            slower.workload_fingerprint_hex(),
            a.workload_fingerprint_hex()
        );
    }

    #[test]
    fn bad_specs_are_refused() {
        let t = trace();
        for spec in [
            ReplaySpec {
                block_tokens: 0,
                ..ReplaySpec::default()
            },
            ReplaySpec {
                time_scale: 0.0,
                ..ReplaySpec::default()
            },
            ReplaySpec {
                start_s: f64::NAN,
                ..ReplaySpec::default()
            },
            ReplaySpec {
                duration_s: Some(-1.0),
                ..ReplaySpec::default()
            },
            ReplaySpec {
                max_requests: Some(0),
                ..ReplaySpec::default()
            },
        ] {
            assert!(matches!(
                ReplayPlan::build(&t, &spec),
                Err(TraceError::Spec(_))
            ));
        }
    }
}
