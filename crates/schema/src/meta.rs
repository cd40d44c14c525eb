//! `meta.json`: what a sweep records about one repetition (docs/CONTRACTS.md, "Measurements
//! layout"), with the SLO and the measured window it names, and its run record ([`Run`]); its
//! evidence and drift verdict are [`crate::evidence`]'s and [`crate::drift`]'s types.
//!
//! One type for writers and readers. Writers (the live sweep, the fault run, calibration, the
//! simulator) fill every field, and [`Meta`] serializes them in declaration order — the order of
//! every published `meta.json` — with the keys inside `evidence`, `drift` and `run` in alphabetical
//! order, as they were written when those sections were free-form. Readers parse leniently where
//! writers may reasonably differ: names and fingerprints as strings or numbers, fields a minimal
//! `meta.json` leaves out (they take the defaults documented on each field), unknown top-level
//! fields ignored, and within the typed sections what each type documents (a drift verdict's
//! missing fields default, evidence of an unknown shape and run fields not typed here are kept as
//! written). The SLO and the window are strict: the analysis depends on them.

use serde::{Deserialize, Serialize};

use crate::drift::DriftVerdict;
use crate::evidence::Evidence;

/// A policy *meets its SLO* at an offered load when at least this share of its measured requests
/// meet the per-request SLO. One definition for the calibration's capacity search (the highest
/// load at which the best policy still meets it) and the report's "below pressure" flag (a point
/// where every policy meets it says nothing about goodput under pressure). 90% is the level
/// the capacity rule names (docs/ARCHITECTURE.md, "Calibration": the operating point; issue #15).
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
    /// 3× the reference floors (crates/engine-core/README.md, "Defaults and calibration"): TTFT <
    /// 990 ms, ITL p50 < 24 ms.
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
    /// The evidence of the accepted attempt (`null`: none recorded).
    #[serde(default, serialize_with = "sorted")]
    pub evidence: Option<Evidence>,
    /// The drift verdict of the accepted attempt (`null`: no drift check ran).
    #[serde(default, serialize_with = "sorted")]
    pub drift: Option<DriftVerdict>,
    /// Run settings (`null`: none recorded).
    #[serde(default, serialize_with = "sorted")]
    pub run: Option<Run>,
}

/// Writes a section as a JSON object with its keys in alphabetical order, at every depth: the
/// order of every published `meta.json`, whose sections were written as free-form JSON.
fn sorted<T: Serialize, S: serde::Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    // `serde_json`'s map (without `preserve_order`) keeps its keys sorted.
    serde_json::to_value(v)
        .map_err(serde::ser::Error::custom)?
        .serialize(s)
}

/// A `meta.json` field that writers may leave out, write as `null`, or fill: read as it was
/// written, and written back the same way (absent stays absent, `null` stays `null`), so a file
/// reads back to its own bytes. Readers take [`Recorded::get`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub enum Recorded<T> {
    /// Not in the file (written before the field existed, or by a writer that has none).
    #[default]
    Absent,
    /// Written as `null`: not applicable.
    Null,
    /// Written with a value.
    Value(T),
}

impl<T> Recorded<T> {
    /// The value, if one was written.
    pub fn get(&self) -> Option<&T> {
        match self {
            Recorded::Value(v) => Some(v),
            Recorded::Absent | Recorded::Null => None,
        }
    }

    /// Not in the file (then not written either).
    pub fn is_absent(&self) -> bool {
        matches!(self, Recorded::Absent)
    }
}

impl<T> From<Option<T>> for Recorded<T> {
    /// A writer's value: `None` is written as `null`.
    fn from(v: Option<T>) -> Recorded<T> {
        v.map_or(Recorded::Null, Recorded::Value)
    }
}

impl<T: Serialize> Serialize for Recorded<T> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // `Absent` is skipped by its field (`skip_serializing_if = "Recorded::is_absent"`).
        self.get().serialize(s)
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Recorded<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Option::<T>::deserialize(d)?.into())
    }
}

/// A repetition's `run` in `meta.json`: how it was run (docs/CONTRACTS.md, "Measurements
/// layout"). Each writer records its own settings (a live sweep cell, a fault repetition, a
/// calibration or capacity step, a virtual cell — the simulator's nest the sweep's under
/// `sweep` and add `sim`); the fields typed here are the ones readers take out, the rest stay in
/// [`Run::other`] as written. Every field is read as written and written back the same way
/// ([`Recorded`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Run {
    /// The `--load` fraction of the capacity a sweep cell ran at (`null`: closed loop or an
    /// absolute rate).
    #[serde(default, skip_serializing_if = "Recorded::is_absent")]
    pub load_fraction: Recorded<f64>,
    /// The open-loop rate, model req/s (`null`: a closed loop or a trace).
    #[serde(default, skip_serializing_if = "Recorded::is_absent")]
    pub offered_rps: Recorded<f64>,
    /// The open-loop rate, wall req/s (model × speed).
    #[serde(default, skip_serializing_if = "Recorded::is_absent")]
    pub offered_wall_rps: Recorded<f64>,
    /// The capacity `load_fraction` is of, model req/s.
    #[serde(default, skip_serializing_if = "Recorded::is_absent")]
    pub capacity_rps: Recorded<f64>,
    /// Whose capacity that is: `reference` (the calibration's) or `per-point`.
    #[serde(default, skip_serializing_if = "Recorded::is_absent")]
    pub capacity_scope: Recorded<String>,
    /// kvroute routers serving the cell ([`Meta::routers`]).
    #[serde(default, skip_serializing_if = "Recorded::is_absent")]
    pub routers: Recorded<u64>,
    /// The balancer in front of several routers: `rr` or `session-hash`.
    #[serde(default, skip_serializing_if = "Recorded::is_absent")]
    pub front: Recorded<String>,
    /// Whether the routers shared their routing decisions.
    #[serde(default, skip_serializing_if = "Recorded::is_absent")]
    pub share_decisions: Recorded<bool>,
    /// Whether the routers shared their load view too.
    #[serde(default, skip_serializing_if = "Recorded::is_absent")]
    pub share_loads: Recorded<bool>,
    /// Everything else the writer recorded (`arrival`, `window`, `router`, `driver`, `gates`,
    /// `trace`, `sim`, …), as written.
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

impl Meta {
    /// Fleet KV capacity in tokens, when the sweep recorded it.
    pub fn capacity_tokens(&self) -> Option<u64> {
        self.fleet.get("capacity_tokens").and_then(|v| v.as_u64())
    }

    /// A typed field of the run record, if the record has it.
    fn run_field<T>(&self, field: impl FnOnce(&Run) -> &Recorded<T>) -> Option<&T> {
        self.run.as_ref().and_then(|r| field(r).get())
    }

    /// How many kvroute routers served the cell (`run.routers`): 1 when not recorded (every
    /// cell before `--routers`, and HAProxy or Envoy in place of the router, which record none).
    pub fn routers(&self) -> u64 {
        self.run_field(|r| &r.routers).copied().unwrap_or(1)
    }

    /// The balancer in front of several routers (`run.front`: `rr`, `session-hash`); `None` for
    /// one router or when not recorded.
    pub fn routers_front(&self) -> Option<&str> {
        self.run_field(|r| &r.front).map(String::as_str)
    }

    /// Whether the routers shared their routing decisions (`run.share_decisions`); false when
    /// not recorded.
    pub fn share_decisions(&self) -> bool {
        self.run_field(|r| &r.share_decisions)
            .copied()
            .unwrap_or(false)
    }

    /// Whether the routers shared their load view too (`run.share_loads`); false when not
    /// recorded (cells from before the flag shared decisions only).
    pub fn share_loads(&self) -> bool {
        self.run_field(|r| &r.share_loads).copied().unwrap_or(false)
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
            evidence: None,
            drift: None,
            run: Some(serde_json::from_value(serde_json::json!({"users": 4})).unwrap()),
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
        r.run = Some(
            serde_json::from_value(
                serde_json::json!({"routers": 4, "front": "session-hash", "share_decisions": true}),
            )
            .unwrap(),
        );
        assert_eq!(
            (r.routers(), r.routers_front(), r.share_decisions()),
            (4, Some("session-hash"), true)
        );
        assert!(
            !m.share_loads() && !r.share_loads(),
            "absent: decisions only"
        );
        r.run.as_mut().unwrap().share_loads = Recorded::Value(true);
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
    fn a_run_record_reads_back_as_it_was_written() {
        // Absent stays absent, `null` stays `null`, other fields stay as they were, and keys are
        // written in alphabetical order (the order of every published `meta.json`).
        let text = r#"{"zeta":{"b":1,"a":[2.0]},"front":null,"routers":2,"arrival":{"Open":{"rate_rps":1.5}}}"#;
        let run: Run = serde_json::from_str(text).unwrap();
        assert_eq!(run.front, Recorded::Null);
        assert_eq!(run.routers, Recorded::Value(2));
        assert!(run.offered_rps.is_absent() && run.other.contains_key("zeta"));
        let mut m = written();
        m.run = Some(run);
        let back = serde_json::to_value(&m).unwrap();
        assert_eq!(
            serde_json::to_string(&back["run"]).unwrap(),
            r#"{"arrival":{"Open":{"rate_rps":1.5}},"front":null,"routers":2,"zeta":{"a":[2.0],"b":1}}"#
        );
        assert_eq!((m.routers(), m.routers_front()), (2, None));
        // A drift record of any shape reads (missing fields take their defaults); no record is
        // `null`.
        let drift: crate::DriftVerdict =
            serde_json::from_str(r#"{"class": "overloaded", "reason": "queue"}"#).unwrap();
        assert_eq!(drift.class, crate::drift::DriftClass::Overloaded);
        assert!(!drift.warming);
        assert_eq!(
            serde_json::to_value(written()).unwrap()["drift"],
            serde_json::Value::Null
        );
        // Evidence: sampled, virtual, or anything else, kept as written.
        for (text, virtual_) in [
            (r#"{"source": "virtual", "lateness_p99_ms": 0.0}"#, true),
            (r#"{"hand": "written"}"#, false),
        ] {
            let e: crate::Evidence = serde_json::from_str(text).unwrap();
            assert_eq!(matches!(e, crate::Evidence::Virtual(_)), virtual_, "{text}");
            assert_eq!(
                serde_json::to_value(&e).unwrap(),
                serde_json::from_str::<serde_json::Value>(text).unwrap()
            );
        }
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
