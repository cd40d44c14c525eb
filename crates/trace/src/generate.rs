//! Generated traces in the Mooncake format: the single-turn shared-prefix workload of common
//! prefix-cache benchmarks (SGLang's `bench_serving --dataset-name generated-shared-prefix`:
//! groups × prompts, each a group's shared system prompt and its own question), sent as a staged
//! load ladder.
//!
//! - **Prompts.** Prompt `p = g × prompts_per_group + m` is group `g`'s shared prefix
//!   (`prefix_tokens`, whole 512-token trace blocks, ids `g × Pb …`) followed by its own question
//!   (`question_tokens`, ids after every group's prefix, `⌈Q ÷ 512⌉` of them, the last one cut by
//!   `input_length`). Two prompts of one group share exactly the prefix's blocks; no two groups
//!   share a block. Every group has exactly `prompts_per_group` prompts.
//! - **Order.** The prompts are shuffled once (Fisher–Yates, seeded) and the requests take them
//!   in that order, cycled: request `i` sends prompt `order[i mod (groups × prompts)]`. A prompt
//!   sent again is the same bytes (its whole prompt is then cached where it ran before).
//! - **Stages.** Stage `k` sends `requests` requests at `rate_rps` (Poisson: exponential gaps,
//!   seeded, first arrival at the stage's start), or all at its start when the rate is
//!   unbounded (`bench_serving`'s default `--request-rate inf`). Stage `k + 1` starts at stage
//!   `k`'s nominal end, `start + requests ÷ rate`, or at its last arrival if that came later (so
//!   stages never interleave). With `wait_for_drain` a stage starts only when every request
//!   before it has ended: its lines carry `"drain": true` and a replayer (the simulator) shifts
//!   it and every later arrival by the wait. An unbounded stage may be followed only by one that
//!   waits (its nominal end is its start).
//! - **Records.** Each line carries `"stage": k` (0-based) beside the four Mooncake fields, so
//!   a report can split the rows by stage (`t<line>` request ids); other readers ignore it.
//!
//! Pure: the caller writes the bytes.

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64;

use crate::TraceError;
use crate::parse::TRACE_BLOCK_TOKENS;

/// One stage of a load ladder.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stage {
    /// Offered rate, requests per second (Poisson); `None`: every request at the stage's start.
    pub rate_rps: Option<f64>,
    /// Requests the stage sends.
    pub requests: u32,
    /// The stage starts only when every request before it has ended (its lines carry
    /// `"drain": true`; a replayer shifts it and every later arrival by the wait).
    pub wait_for_drain: bool,
}

/// The single-turn shared-prefix workload and its ladder.
#[derive(Debug, Clone, PartialEq)]
pub struct SharedPrefix {
    /// Groups G: distinct shared prefixes.
    pub groups: u32,
    /// Prompts per group M.
    pub prompts_per_group: u32,
    /// Every group's shared prefix, tokens: whole trace blocks of 512.
    pub prefix_tokens: u32,
    /// Each prompt's own question after the prefix, tokens (≥ 1).
    pub question_tokens: u32,
    /// `output_length` of every request, tokens.
    pub output_tokens: u32,
    /// Seed of the prompt order and the arrival gaps.
    pub seed: u64,
    /// The ladder, in order.
    pub stages: Vec<Stage>,
}

/// Most prompts (groups × prompts per group) a generated trace may hold.
pub const MAX_PROMPTS: u64 = 1_000_000;
/// Most requests a generated trace may hold.
pub const MAX_REQUESTS: u64 = 10_000_000;

impl SharedPrefix {
    /// Checks every field; the error names the wrong one.
    pub fn validate(&self) -> Result<(), TraceError> {
        let bad = |m: String| Err(TraceError::Spec(m));
        if self.groups == 0 || self.prompts_per_group == 0 {
            return bad(format!(
                "groups ({}) and prompts_per_group ({}) must be ≥ 1",
                self.groups, self.prompts_per_group
            ));
        }
        if u64::from(self.groups) * u64::from(self.prompts_per_group) > MAX_PROMPTS {
            return bad(format!(
                "{} × {} prompts exceed {MAX_PROMPTS}",
                self.groups, self.prompts_per_group
            ));
        }
        if self.prefix_tokens == 0 || u64::from(self.prefix_tokens) % TRACE_BLOCK_TOKENS != 0 {
            return bad(format!(
                "prefix_tokens {} must be a positive multiple of the trace's {TRACE_BLOCK_TOKENS}-token block (a prefix that ends inside a block would share only its whole blocks)",
                self.prefix_tokens
            ));
        }
        if self.question_tokens == 0 {
            return bad("question_tokens must be ≥ 1".into());
        }
        if u64::from(self.prefix_tokens) + u64::from(self.question_tokens) > u64::from(u32::MAX) {
            return bad("prefix_tokens + question_tokens exceed 2^32 - 1 tokens".into());
        }
        if self.stages.is_empty() {
            return bad("the ladder has no stage".into());
        }
        let mut total = 0u64;
        for (k, s) in self.stages.iter().enumerate() {
            if s.requests == 0 {
                return bad(format!("stage {k} sends no request"));
            }
            match s.rate_rps {
                Some(r) if !(r.is_finite() && r > 0.0) => {
                    return bad(format!("stage {k}: rate {r} req/s must be > 0"));
                }
                None if self.stages.get(k + 1).is_some_and(|n| !n.wait_for_drain) => {
                    return bad(format!(
                        "stage {k} sends everything at once, so stage {} would start at the same instant: let it wait_for_drain",
                        k + 1
                    ));
                }
                _ => {}
            }
            if k == 0 && s.wait_for_drain {
                return bad("stage 0 has nothing before it to wait for".into());
            }
            total += u64::from(s.requests);
        }
        if total > MAX_REQUESTS {
            return bad(format!("{total} requests exceed {MAX_REQUESTS}"));
        }
        Ok(())
    }

    /// Prompts in all: groups × prompts per group.
    pub fn prompts(&self) -> u32 {
        self.groups * self.prompts_per_group
    }

    /// The order the requests take the prompts in: one seeded shuffle of `0..prompts`.
    pub fn prompt_order(&self) -> Vec<u32> {
        let mut order: Vec<u32> = (0..self.prompts()).collect();
        let mut rng = Pcg64::seed_from_u64(self.seed);
        for i in (1..order.len()).rev() {
            let j = rng.random_range(0..=i);
            order.swap(i, j);
        }
        order
    }

    /// Every request's arrival, µs from the start, with its stage.
    pub fn arrivals_us(&self) -> Vec<(u64, u32)> {
        // Gaps from their own stream, so the order and the arrivals never move each other.
        let mut rng = Pcg64::seed_from_u64(self.seed ^ 0x9e37_79b9_7f4a_7c15);
        let mut out = Vec::new();
        let mut start_s = 0.0f64;
        for (k, s) in self.stages.iter().enumerate() {
            let mut t = start_s;
            for i in 0..s.requests {
                if let (Some(r), true) = (s.rate_rps, i > 0) {
                    // Inverse transform of U in [0, 1): the gap is finite.
                    let u: f64 = rng.random();
                    t += -(1.0 - u).ln() / r;
                }
                out.push(((t * 1e6).round() as u64, k as u32));
            }
            // A Poisson stage's last arrival may fall past its nominal end: the next stage starts
            // at the later of the two, so stages never interleave.
            if let Some(r) = s.rate_rps {
                start_s = (start_s + f64::from(s.requests) / r).max(t);
            }
        }
        out
    }

    /// The trace, one JSON object per line in arrival order.
    pub fn to_jsonl(&self) -> Result<String, TraceError> {
        self.validate()?;
        let prefix_blocks = u64::from(self.prefix_tokens) / TRACE_BLOCK_TOKENS;
        let question_blocks = u64::from(self.question_tokens).div_ceil(TRACE_BLOCK_TOKENS);
        let first_question_id = u64::from(self.groups) * prefix_blocks;
        let input = self.prefix_tokens + self.question_tokens;
        let order = self.prompt_order();
        let mut out = String::new();
        let mut ids: Vec<String> = Vec::new();
        for (i, (at_us, stage)) in self.arrivals_us().into_iter().enumerate() {
            let p = u64::from(order[i % order.len()]);
            let g = p / u64::from(self.prompts_per_group);
            ids.clear();
            ids.extend((0..prefix_blocks).map(|b| (g * prefix_blocks + b).to_string()));
            ids.extend(
                (0..question_blocks)
                    .map(|b| (first_question_id + p * question_blocks + b).to_string()),
            );
            out.push_str(&format!(
                "{{\"timestamp\": {}.{:03}, \"input_length\": {input}, \"output_length\": {}, \"hash_ids\": [{}], \"stage\": {stage}{}}}\n",
                at_us / 1000,
                at_us % 1000,
                self.output_tokens,
                ids.join(", "),
                if self.stages[stage as usize].wait_for_drain {
                    ", \"drain\": true"
                } else {
                    ""
                }
            ));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Trace;

    fn spec(stages: Vec<Stage>) -> SharedPrefix {
        SharedPrefix {
            groups: 4,
            prompts_per_group: 3,
            prefix_tokens: 1024,
            question_tokens: 100,
            output_tokens: 16,
            seed: 5,
            stages,
        }
    }

    #[test]
    fn prompts_share_exactly_their_groups_prefix_and_cycle_in_one_shuffled_order() {
        let s = spec(vec![Stage {
            rate_rps: None,
            requests: 30,
            wait_for_drain: false,
        }]);
        let text = s.to_jsonl().unwrap();
        let t = Trace::parse_bytes("gen", text.as_bytes()).unwrap();
        assert_eq!(t.len(), 30);
        let order = s.prompt_order();
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..12).collect::<Vec<_>>(), "a permutation");
        assert_ne!(order, sorted, "shuffled (seed 5)");
        for (i, r) in t.records().iter().enumerate() {
            let p = u64::from(order[i % 12]);
            let ids = t.hash_ids(r);
            assert_eq!(
                (r.input_tokens, r.output_tokens, r.stage),
                (1124, 16, Some(0))
            );
            assert_eq!(ids.len(), 3, "2 prefix blocks and one cut question block");
            let g = p / 3;
            assert_eq!(&ids[..2], &[2 * g, 2 * g + 1]);
            assert_eq!(ids[2], 8 + p, "each prompt's own question block");
            assert_eq!(r.timestamp_us, 0, "all at once");
        }
        // Every group has exactly its prompts.
        for g in 0..4u64 {
            let n = (0..12)
                .filter(|&i| t.hash_ids(&t.records()[i])[0] == 2 * g)
                .count();
            assert_eq!(n, 3);
        }
        assert_eq!(text, s.to_jsonl().unwrap(), "deterministic");
    }

    #[test]
    fn stages_follow_each_other_at_their_rates() {
        let s = spec(vec![
            Stage {
                rate_rps: Some(2.0),
                requests: 2_000,
                wait_for_drain: false,
            },
            Stage {
                rate_rps: Some(8.0),
                requests: 4_000,
                wait_for_drain: false,
            },
        ]);
        let arrivals = s.arrivals_us();
        let stage =
            |k: u32| -> Vec<u64> { arrivals.iter().filter(|a| a.1 == k).map(|a| a.0).collect() };
        let (a, b) = (stage(0), stage(1));
        assert_eq!((a.len(), b.len()), (2_000, 4_000));
        assert_eq!(a[0], 0);
        // Stage 1 starts at 2,000 ÷ 2 s, or at stage 0's last arrival if that is later.
        assert_eq!(b[0], 1_000_000_000u64.max(a[a.len() - 1]));
        assert!(arrivals.windows(2).all(|w| w[0].0 <= w[1].0), "in order");
        // Mean gap within 5% of 1 ÷ rate (2,000 and 4,000 exponential gaps: sd 2.2% and 1.6%).
        let mean_gap_s = |v: &[u64]| (v[v.len() - 1] - v[0]) as f64 / 1e6 / (v.len() - 1) as f64;
        assert!(
            (mean_gap_s(&a) * 2.0 - 1.0).abs() < 0.05,
            "{}",
            mean_gap_s(&a)
        );
        assert!(
            (mean_gap_s(&b) * 8.0 - 1.0).abs() < 0.05,
            "{}",
            mean_gap_s(&b)
        );
        let t = Trace::parse_bytes("gen", s.to_jsonl().unwrap().as_bytes()).unwrap();
        assert_eq!(t.records()[2_000].stage, Some(1));
    }

    #[test]
    fn what_cannot_be_generated_is_refused_by_name() {
        let mut s = spec(vec![
            Stage {
                rate_rps: None,
                requests: 4,
                wait_for_drain: false,
            },
            Stage {
                rate_rps: Some(1.0),
                requests: 4,
                wait_for_drain: false,
            },
        ]);
        let err = s.to_jsonl().unwrap_err().to_string();
        assert!(err.contains("stage 0 sends everything at once"), "{err}");
        // Allowed when the next stage waits for it to drain; its lines say so.
        s.stages[1].wait_for_drain = true;
        let t = Trace::parse_bytes("gen", s.to_jsonl().unwrap().as_bytes()).unwrap();
        assert_eq!(
            t.records().iter().map(|r| r.drain).collect::<Vec<_>>(),
            [false, false, false, false, true, true, true, true]
        );
        s.stages.reverse();
        assert!(
            s.validate()
                .unwrap_err()
                .to_string()
                .contains("nothing before it")
        );
        s.stages[0].wait_for_drain = false;
        s.to_jsonl().unwrap();
        s.prefix_tokens = 1000;
        assert!(
            s.validate()
                .unwrap_err()
                .to_string()
                .contains("prefix_tokens 1000")
        );
        s.prefix_tokens = 512;
        s.stages[0].rate_rps = Some(0.0);
        assert!(
            s.validate()
                .unwrap_err()
                .to_string()
                .contains("stage 0: rate 0")
        );
        s.stages[0].rate_rps = Some(1.0);
        s.groups = 0;
        assert!(s.validate().unwrap_err().to_string().contains("groups (0)"));
    }
}
