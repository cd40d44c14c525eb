//! The gates every measured repetition passes before it is recorded — a live sweep cell and a
//! fault repetition alike (DESIGN.md §3.10): the evidence check first (a dirty window says
//! nothing about warming), then the drift test. Failed evidence is re-run up to the caller's
//! retries, a warming repetition once; after that the repetition is recorded set aside, with
//! its reason. An overloaded repetition (DESIGN.md §3.9: it drifts because its open-loop backlog
//! grows through the window — the policy cannot sustain the offered load, and a longer warm-up
//! would not settle it) is a result: recorded at once, accepted, its verdict in `meta.json`'s
//! `drift` marking it. The caller runs the attempts, discards the ones re-run, and writes
//! `meta.json`.

use analysis::DriftVerdict;

/// How a repetition set aside for failed evidence begins its `set_aside_reason`. Such a
/// repetition says nothing about its cell (the machine was noisy, not the policy), so a resumed
/// sweep measures it again ([`crate::cell::CellState::is_done`]); one set aside for drift is final.
pub const EVIDENCE_SET_ASIDE_PREFIX: &str = "evidence failed on ";

/// What to do with the attempt just measured.
#[derive(Debug, Clone, PartialEq)]
pub enum GateDecision {
    /// Discard the attempt (`cell::discard`, with `reason`) and run it again.
    Rerun {
        /// Why, as `discarded.json` records it: `evidence: …` or `drift: …`.
        reason: String,
        /// The progress line's words: what failed and what happens next.
        note: String,
    },
    /// Record it: accepted when `set_aside` is `None`, else set aside with that reason.
    Record {
        /// Why the repetition is set aside, when it is.
        set_aside: Option<String>,
    },
}

/// The gate counters of one repetition across its attempts.
#[derive(Debug, Clone)]
pub struct Gates {
    evidence_retries: u32,
    evidence_reruns: u32,
    drift_reruns: u32,
}

impl Gates {
    /// Gates that re-run failed evidence up to `evidence_retries` times and drift once.
    pub fn new(evidence_retries: u32) -> Gates {
        Gates {
            evidence_retries,
            evidence_reruns: 0,
            drift_reruns: 0,
        }
    }

    /// Judges one attempt from its evidence check (`Err(why)`: failed) and its drift verdict.
    pub fn judge(&mut self, evidence: Result<(), String>, drift: &DriftVerdict) -> GateDecision {
        if let Err(why) = evidence {
            if self.evidence_reruns < self.evidence_retries {
                self.evidence_reruns += 1;
                return GateDecision::Rerun {
                    note: format!("evidence failed ({why}); discarded, re-running"),
                    reason: format!("evidence: {why}"),
                };
            }
            return GateDecision::Record {
                set_aside: Some(format!(
                    "{EVIDENCE_SET_ASIDE_PREFIX}{} attempts: {why}",
                    self.evidence_reruns + 1
                )),
            };
        }
        if drift.overloaded {
            // Not set aside and not re-run: the growing backlog is the measurement.
            return GateDecision::Record { set_aside: None };
        }
        if drift.warming {
            let why = drift.reason.clone().unwrap_or_else(|| "warming".into());
            if self.drift_reruns == 0 {
                self.drift_reruns += 1;
                return GateDecision::Rerun {
                    note: format!("drift ({why}); re-running once"),
                    reason: format!("drift: {why}"),
                };
            }
            return GateDecision::Record {
                set_aside: Some(format!("drifted twice: {why}")),
            };
        }
        GateDecision::Record { set_aside: None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use analysis::DriftClass;

    fn drift(warming: bool) -> DriftVerdict {
        DriftVerdict {
            warming,
            goodput: None,
            attainment: None,
            ttft: None,
            reason: warming.then(|| "warming: TTFT trends down by 20%".to_string()),
            skipped: None,
            config: analysis::DriftConfig::default(),
            overloaded: false,
            class: if warming {
                DriftClass::Warming
            } else {
                DriftClass::Settled
            },
            backlog: None,
            backlog_mean: None,
            rule: analysis::drift::CLASSIFICATION_RULE.to_string(),
        }
    }

    fn overloaded() -> DriftVerdict {
        DriftVerdict {
            warming: false,
            overloaded: true,
            class: DriftClass::Overloaded,
            reason: Some("overloaded: the backlog grows 0.67 requests/s across the window (mean 40.0, t = 55.0); warming: TTFT trends up by 300%".into()),
            ..drift(false)
        }
    }

    #[test]
    fn an_overloaded_repetition_is_recorded_at_once_not_re_run_or_set_aside() {
        let mut g = Gates::new(2);
        assert_eq!(
            g.judge(Ok(()), &overloaded()),
            GateDecision::Record { set_aside: None }
        );
        // Evidence still comes first: a dirty overloaded attempt is re-run.
        let mut g = Gates::new(1);
        assert!(rerun(&g.judge(Err("lateness".into()), &overloaded())).starts_with("evidence"));
    }

    fn rerun(d: &GateDecision) -> &str {
        match d {
            GateDecision::Rerun { reason, .. } => reason,
            other => panic!("expected a re-run, got {other:?}"),
        }
    }

    #[test]
    fn evidence_is_retried_then_sets_aside_and_drift_is_retried_once() {
        let mut g = Gates::new(2);
        let dirty = || Err("replica 0 lateness p99 9.000 ms exceeds the bound 5.000 ms".into());
        assert!(rerun(&g.judge(dirty(), &drift(false))).starts_with("evidence: replica 0"));
        assert!(rerun(&g.judge(dirty(), &drift(true))).starts_with("evidence: "));
        assert_eq!(
            g.judge(dirty(), &drift(false)),
            GateDecision::Record {
                set_aside: Some(
                    "evidence failed on 3 attempts: replica 0 lateness p99 9.000 ms exceeds the bound 5.000 ms"
                        .into()
                )
            }
        );
        let mut g = Gates::new(2);
        assert_eq!(
            rerun(&g.judge(Ok(()), &drift(true))),
            "drift: warming: TTFT trends down by 20%"
        );
        assert_eq!(
            g.judge(Ok(()), &drift(true)),
            GateDecision::Record {
                set_aside: Some("drifted twice: warming: TTFT trends down by 20%".into())
            }
        );
        assert_eq!(
            Gates::new(0).judge(Ok(()), &drift(false)),
            GateDecision::Record { set_aside: None }
        );
    }
}
