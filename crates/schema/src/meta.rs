//! `meta.json`: what a sweep records about one repetition (docs/CONTRACTS.md, "Measurements
//! layout"), with the SLO and the measured window it names.
//!
//! One type for writers and readers. Writers (the live sweep, the fault run, calibration, the
//! simulator) fill every field, and [`Meta`] serializes them in declaration order — the order of
//! every published `meta.json`. Readers parse leniently where writers may reasonably differ: names
//! and fingerprints as strings or numbers, fields a minimal `meta.json` leaves out (they take the
//! defaults documented on each field), unknown extra fields (the simulator's `sim` summary) ignored.
//! The SLO and the window are strict: the analysis depends on them.

use serde::{Deserialize, Serialize};

/// A policy *meets its SLO* at an offered load when at least this share of its measured requests
/// meet the per-request SLO. One definition for the calibration's capacity search (the highest
/// load at which the best policy still meets it) and the report's "below pressure" flag (a point
/// where every policy meets it says nothing about goodput under pressure). 90% is the level
/// the capacity rule names (DESIGN.md's operating point, issue #15).
pub const ATTAINMENT_TARGET: f64 = 0.9;

/// The SLO a request must meet to count towards goodput: TTFT below `ttft_ms` and per-request
/// ITL p50 below `itl_ms` (both strict), no error.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    /// TTFT bound, ms.
    pub ttft_ms: f64,
    /// Per-request ITL p50 bound, ms.
    pub itl_ms: f64,
}

impl Default for Slo {
    /// 3× the reference floors (REFERENCE.md §1): TTFT < 990 ms, ITL p50 < 24 ms.
    fn default() -> Self {
        Self {
            ttft_ms: 990.0,
            itl_ms: 24.0,
        }
    }
}

/// Which time of a client row places it in the measured window, and which time its TTFT is
/// judged from (docs/CONTRACTS.md, "Which requests are measured").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WindowClock {
    /// The send time (`sent_s`), TTFT from the send: a closed loop, whose users wait for each
    /// reply, so the load they offer already answers to the latency they meet. The default for a
    /// `meta.json` that does not say: every file written before the field existed was measured so.
    #[default]
    Sent,
    /// The plan's time (`scheduled_s`), TTFT from it: an open loop (or a trace replay), whose
    /// offered load is the schedule. A turn that waited in the driver because its conversation's
    /// previous turn was still running (the fleet was saturated) counts in the window it was
    /// scheduled in, and the wait counts against its TTFT.
    Scheduled,
}

impl WindowClock {
    /// [`WindowClock::Sent`] (the default, left out of `meta.json`).
    pub fn is_sent(&self) -> bool {
        *self == WindowClock::Sent
    }
}

/// The measured window of a repetition, on the driver's clock (the clock of `client.csv`'s `_s`
/// columns).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Window {
    /// Length of the discarded warm-up, s.
    pub warmup_s: f64,
    /// Start of the measured window, s.
    pub measured_start_s: f64,
    /// End of the measured window, s.
    pub measured_end_s: f64,
    /// Which time of a row the window is defined by ([`WindowClock`]); absent reads as `sent`,
    /// and `sent` is not written (so files written before the field existed read back to
    /// their own bytes).
    #[serde(default, skip_serializing_if = "WindowClock::is_sent")]
    pub clock: WindowClock,
}

/// Why a run has no measured window.
#[derive(Debug, Clone, PartialEq)]
pub enum WindowError {
    /// A closed loop sent no more requests than it has users.
    TooFewSends {
        /// Requests sent (finite send times).
        sent: usize,
        /// Closed-loop users.
        users: usize,
    },
    /// The window would end before the warm-up does.
    EndsBeforeWarmup {
        /// Where the window would end, s.
        end_s: f64,
        /// End of the warm-up, s.
        warmup_s: f64,
    },
}

impl std::fmt::Display for WindowError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WindowError::TooFewSends { sent, users } => write!(
                f,
                "only {sent} requests were sent by {users} users: too few for a measured window"
            ),
            WindowError::EndsBeforeWarmup { end_s, warmup_s } => write!(
                f,
                "the run ended ({end_s:.2} s on the driver's clock) before its warm-up did ({warmup_s:.2} s): give it more requests or a shorter warm-up"
            ),
        }
    }
}

impl std::error::Error for WindowError {}

impl Window {
    /// The measured window from the driver's send times: the sweep's rule, for live and virtual
    /// cells alike.
    ///
    /// Starts at the end of the warm-up. Open loop (`closed_users` `None`): ends where the
    /// schedule ends, `planned_end_s`, and rows are placed by their scheduled time
    /// ([`WindowClock::Scheduled`]). Closed loop with `users` users: ends at the send time of
    /// the request that leaves fewer than `users` unsent — past it some user must have run out of
    /// work, so the offered concurrency is no longer the point's; the tail is drain, not load.
    /// `planned_end_s` caps it (the window asked for); rows are placed by their send time
    /// ([`WindowClock::Sent`]).
    pub fn measured(
        sent_s: &[f64],
        warmup_s: f64,
        planned_end_s: f64,
        closed_users: Option<usize>,
    ) -> Result<Window, WindowError> {
        let end_s = match closed_users {
            None => planned_end_s,
            Some(users) => {
                let mut sorted: Vec<f64> =
                    sent_s.iter().copied().filter(|t| t.is_finite()).collect();
                sorted.sort_by(f64::total_cmp);
                if sorted.len() <= users {
                    return Err(WindowError::TooFewSends {
                        sent: sorted.len(),
                        users,
                    });
                }
                sorted[sorted.len() - users].min(planned_end_s)
            }
        };
        if end_s <= warmup_s {
            return Err(WindowError::EndsBeforeWarmup { end_s, warmup_s });
        }
        Ok(Window {
            warmup_s,
            measured_start_s: warmup_s,
            measured_end_s: end_s,
            clock: if closed_users.is_some() {
                WindowClock::Sent
            } else {
                WindowClock::Scheduled
            },
        })
    }

    /// Length of the measured window, s.
    pub fn measured_s(&self) -> f64 {
        self.measured_end_s - self.measured_start_s
    }

    /// Whether a time (of the window's [`WindowClock`]) falls in the measured window (start
    /// inclusive, end exclusive).
    pub fn contains(&self, t_s: f64) -> bool {
        t_s >= self.measured_start_s && t_s < self.measured_end_s
    }
}

/// The keys every `meta.json` carries (docs/CONTRACTS.md, "Measurements layout"); writers add
/// evidence, drift and run detail after them.
pub const CONTRACT_FIELDS: [&str; 16] = [
    "sweep",
    "point",
    "policy",
    "rep",
    "workload_name",
    "workload_fingerprint",
    "plan_fingerprint",
    "fleet",
    "slo",
    "window",
    "git_rev",
    "versions",
    "virtual",
    "complete",
    "accepted",
    "set_aside_reason",
];

/// One repetition's `meta.json`. Field order is the file's key order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    /// Sweep name; empty when not recorded.
    #[serde(default, deserialize_with = "lenient::text_or_empty")]
    pub sweep: String,
    /// Grid point name; empty when not recorded (the directory name is authoritative).
    #[serde(default, deserialize_with = "lenient::text_or_empty")]
    pub point: String,
    /// Policy name; empty when not recorded (the directory name is authoritative).
    #[serde(default, deserialize_with = "lenient::text_or_empty")]
    pub policy: String,
    /// Repetition number, 1-based; 0 when not recorded (the directory name is authoritative).
    #[serde(default, deserialize_with = "lenient::count")]
    pub rep: u32,
    /// Workload name (derived from its parameters).
    #[serde(deserialize_with = "lenient::text")]
    pub workload_name: String,
    /// Hash of the workload's parameters; empty when not recorded.
    #[serde(default, deserialize_with = "lenient::text_or_empty")]
    pub workload_fingerprint: String,
    /// Hash of the arrival plan's bytes.
    #[serde(deserialize_with = "lenient::text")]
    pub plan_fingerprint: String,
    /// Fleet description (`source, replicas, speed, slowdowns, capacity_tokens`, …), free-form.
    #[serde(default)]
    pub fleet: serde_json::Value,
    /// The SLO goodput is measured against.
    pub slo: Slo,
    /// The measured window.
    pub window: Window,
    /// Git revision of the code that measured.
    #[serde(default, deserialize_with = "lenient::opt_text")]
    pub git_rev: Option<String>,
    /// Tool versions, free-form.
    #[serde(default)]
    pub versions: serde_json::Value,
    /// Measured under the virtual clock (`sim`); false when not recorded.
    #[serde(
        default,
        rename = "virtual",
        deserialize_with = "lenient::flag_or_false"
    )]
    pub virtual_time: bool,
    /// The repetition finished and all its files are written.
    #[serde(default, deserialize_with = "lenient::flag_or_false")]
    pub complete: bool,
    /// Counted in the comparison; `false` when the sweep set it aside (drift, evidence).
    /// Absent means accepted.
    #[serde(default = "lenient::yes", deserialize_with = "lenient::flag_or_true")]
    pub accepted: bool,
    /// Why it was set aside.
    #[serde(default, deserialize_with = "lenient::opt_text")]
    pub set_aside_reason: Option<String>,
    /// Attempts this repetition took (discarded attempts live under `_discarded/`); 0 when not
    /// recorded.
    #[serde(default, deserialize_with = "lenient::count")]
    pub attempts: u32,
    /// The evidence summary of the accepted attempt, free-form.
    #[serde(default)]
    pub evidence: serde_json::Value,
    /// The drift verdict of the accepted attempt (`null`: no drift check ran), free-form.
    #[serde(default)]
    pub drift: serde_json::Value,
    /// Run settings (users, rate, durations, policy flags), free-form.
    #[serde(default)]
    pub run: serde_json::Value,
}

impl Meta {
    /// Fleet KV capacity in tokens, when the sweep recorded it.
    pub fn capacity_tokens(&self) -> Option<u64> {
        self.fleet.get("capacity_tokens").and_then(|v| v.as_u64())
    }

    /// How many kvroute routers served the cell (`run.routers`): 1 when not recorded (every
    /// cell before `--routers`, and HAProxy or Envoy in place of the router, which record none).
    pub fn routers(&self) -> u64 {
        self.run
            .get("routers")
            .and_then(|v| v.as_u64())
            .unwrap_or(1)
    }

    /// The balancer in front of several routers (`run.front`: `rr`, `session-hash`); `None` for
    /// one router or when not recorded.
    pub fn routers_front(&self) -> Option<&str> {
        self.run.get("front").and_then(|v| v.as_str())
    }

    /// Whether the routers shared their routing decisions (`run.share_decisions`); false when
    /// not recorded.
    pub fn share_decisions(&self) -> bool {
        self.run
            .get("share_decisions")
            .and_then(|v| v.as_bool())
            .unwrap_or(false)
    }

    /// Whether the routers shared their load view too (`run.share_loads`); false when not
    /// recorded (cells from before the flag shared decisions only).
    pub fn share_loads(&self) -> bool {
        self.run
            .get("share_loads")
            .and_then(|v| v.as_bool())
            .unwrap_or(false)
    }
}

/// Lenient field readers: what older or hand-written `meta.json` files may hold.
mod lenient {
    use serde::{Deserialize, Deserializer, de::Error as _};
    use serde_json::Value;

    /// A name or fingerprint as text: strings as they are, numbers (and other values) as JSON
    /// text, so `42` and `"42"` compare equal. `None` for null.
    fn value_text(v: Value) -> Option<String> {
        match v {
            Value::Null => None,
            Value::String(s) => Some(s),
            other => Some(other.to_string()),
        }
    }

    pub(super) fn opt_text<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
        Ok(value_text(Value::deserialize(d)?))
    }

    pub(super) fn text_or_empty<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
        Ok(value_text(Value::deserialize(d)?).unwrap_or_default())
    }

    pub(super) fn text<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
        value_text(Value::deserialize(d)?).ok_or_else(|| D::Error::custom("must not be null"))
    }

    /// A count as a number or a numeric string; 0 for null.
    pub(super) fn count<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
        match Value::deserialize(d)? {
            Value::Null => Ok(0),
            Value::Number(n) => n
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| D::Error::custom(format!("`{n}` is not a count"))),
            Value::String(s) => s
                .trim()
                .parse()
                .map_err(|_| D::Error::custom(format!("`{s}` is not a count"))),
            other => Err(D::Error::custom(format!("`{other}` is not a count"))),
        }
    }

    pub(super) fn yes() -> bool {
        true
    }

    pub(super) fn flag_or_true<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
        Ok(Option::<bool>::deserialize(d)?.unwrap_or(true))
    }

    pub(super) fn flag_or_false<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
        Ok(Option::<bool>::deserialize(d)?.unwrap_or(false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn written() -> Meta {
        Meta {
            sweep: "s".into(),
            point: "ws1-s0".into(),
            policy: "round-robin".into(),
            rep: 1,
            workload_name: "w".into(),
            workload_fingerprint: "f".into(),
            plan_fingerprint: "p".into(),
            fleet: serde_json::json!({"source": "emulated", "capacity_tokens": 1000}),
            slo: Slo {
                ttft_ms: 100.0,
                itl_ms: 3.0,
            },
            window: Window {
                warmup_s: 1.0,
                measured_start_s: 1.0,
                measured_end_s: 5.0,
                clock: WindowClock::Sent,
            },
            git_rev: None,
            versions: serde_json::Value::Null,
            virtual_time: false,
            complete: true,
            accepted: false,
            set_aside_reason: Some("drift".into()),
            attempts: 2,
            evidence: serde_json::Value::Null,
            drift: serde_json::Value::Null,
            run: serde_json::json!({"users": 4}),
        }
    }

    #[test]
    fn writes_the_contract_keys_in_order_and_reads_them_back() {
        let m = written();
        let text = serde_json::to_string_pretty(&m).unwrap();
        // Top-level keys are the lines indented by exactly two spaces.
        let keys: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("  \""))
            .filter_map(|l| l.split_once("\":").map(|(k, _)| k))
            .collect();
        assert_eq!(
            keys,
            [
                "sweep",
                "point",
                "policy",
                "rep",
                "workload_name",
                "workload_fingerprint",
                "plan_fingerprint",
                "fleet",
                "slo",
                "window",
                "git_rev",
                "versions",
                "virtual",
                "complete",
                "accepted",
                "set_aside_reason",
                "attempts",
                "evidence",
                "drift",
                "run",
            ]
        );
        assert_eq!(serde_json::from_str::<Meta>(&text).unwrap(), m);
        assert_eq!(m.capacity_tokens(), Some(1000));
    }

    #[test]
    fn a_minimal_meta_reads_with_defaults() {
        let m: Meta = serde_json::from_value(serde_json::json!({
            "workload_name": "w", "plan_fingerprint": 42, "rep": "3",
            "slo": {"ttft_ms": 990, "itl_ms": 24},
            "window": {"warmup_s": 0, "measured_start_s": 0, "measured_end_s": 100},
            "accepted": null, "sim": {"anything": 1}
        }))
        .unwrap();
        assert_eq!(m.plan_fingerprint, "42");
        assert_eq!((m.sweep.as_str(), m.point.as_str(), m.rep), ("", "", 3));
        assert!(m.accepted, "absent or null means accepted");
        assert!(!m.complete && !m.virtual_time);
        assert_eq!((m.attempts, m.capacity_tokens()), (0, None));
        // Before `--routers`: one router, no front, no sharing.
        assert_eq!(
            (m.routers(), m.routers_front(), m.share_decisions()),
            (1, None, false)
        );
        let mut r = m.clone();
        r.run = serde_json::json!({"routers": 4, "front": "session-hash", "share_decisions": true});
        assert_eq!(
            (r.routers(), r.routers_front(), r.share_decisions()),
            (4, Some("session-hash"), true)
        );
        assert!(
            !m.share_loads() && !r.share_loads(),
            "absent: decisions only"
        );
        r.run["share_loads"] = true.into();
        assert!(r.share_loads());
        assert_eq!(m.window.measured_s(), 100.0);
        assert!(
            serde_json::from_value::<Meta>(serde_json::json!({
                "workload_name": "w", "plan_fingerprint": null,
                "slo": {"ttft_ms": 1, "itl_ms": 1},
                "window": {"warmup_s": 0, "measured_start_s": 0, "measured_end_s": 1}
            }))
            .is_err(),
            "the plan fingerprint is required"
        );
        assert!(
            serde_json::from_value::<Meta>(serde_json::json!({
                "workload_name": "w", "plan_fingerprint": "p", "rep": "rep-1",
                "slo": {"ttft_ms": 1, "itl_ms": 1},
                "window": {"warmup_s": 0, "measured_start_s": 0, "measured_end_s": 1}
            }))
            .is_err(),
            "a repetition number is a count"
        );
    }

    #[test]
    fn window_rules() {
        let sent: Vec<f64> = (0..20).map(f64::from).collect();
        let open = Window::measured(&sent, 2.0, 10.0, None).unwrap();
        assert_eq!((open.measured_start_s, open.measured_end_s), (2.0, 10.0));
        // An open loop is measured by the plan's time, a closed one by the send time; only the
        // former is written (absent reads as `sent`).
        assert_eq!(open.clock, WindowClock::Scheduled);
        let json = serde_json::to_value(open).unwrap();
        assert_eq!(json["clock"], "scheduled");
        let back: Window = serde_json::from_value(json).unwrap();
        assert_eq!(back, open);
        // 20 sends by 4 users: the 17th send (t = 16) leaves 3 unsent.
        let closed = Window::measured(&sent, 2.0, 100.0, Some(4)).unwrap();
        assert_eq!(closed.measured_end_s, 16.0);
        assert_eq!(closed.clock, WindowClock::Sent);
        assert!(serde_json::to_value(closed).unwrap().get("clock").is_none());
        let capped = Window::measured(&sent, 2.0, 12.0, Some(4)).unwrap();
        assert_eq!(capped.measured_end_s, 12.0);
        assert!(matches!(
            Window::measured(&sent, 17.0, 100.0, Some(4)),
            Err(WindowError::EndsBeforeWarmup { .. })
        ));
        assert_eq!(
            Window::measured(&sent[..3], 0.0, 100.0, Some(4)),
            Err(WindowError::TooFewSends { sent: 3, users: 4 })
        );
        assert!(closed.contains(2.0) && closed.contains(15.9));
        assert!(!closed.contains(16.0) && !closed.contains(1.9));
        assert_eq!(closed.measured_s(), 14.0);
    }
}
