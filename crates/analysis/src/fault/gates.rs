//! The gates of one fault repetition, the same two a sweep cell passes (docs/ARCHITECTURE.md, "Analysis"): the
//! evidence check, then the drift test — with the fault excluded from the drift test. Drift is
//! measured on the steady load before the fault ([`drift_window`]): the outage and the recovery
//! after the restart are the fault's own effect (goodput falls, then climbs back as the restarted
//! replica's cache warms), a trend the drift test would flag on every repetition, while the
//! pre-fault load is what must have settled for the "before" baseline and the recovery level to
//! mean anything. The run records what each gate said (`meta.json` `run.gates`,
//! [`RecordedGates`]); the summary reads it back ([`RepGates`]) and runs its own drift test on
//! the same window beside it, as the sweep report does.

use serde::{Deserialize, Serialize};

use super::FaultEvents;
use crate::drift::{DriftConfig, DriftVerdict, check_rows};
use crate::load::RepData;
use crate::meta::{Window, WindowClock};

/// The rule that places a fault repetition's drift window, as `meta.json` and the summary
/// state it.
pub const DRIFT_WINDOW_RULE: &str = "pre-fault: from the end of the warm-up to the fault, on the driver's clock; the outage and the recovery after the restart are the fault's effect and are not tested for drift";

/// The window the drift test of a fault repetition runs on: from the end of the warm-up to the
/// fault, on the driver's clock (empty when the fault came before the warm-up ended, and the
/// test is then not run).
pub fn drift_window(events: &FaultEvents) -> Window {
    Window {
        warmup_s: events.warmup_s,
        measured_start_s: events.warmup_s,
        measured_end_s: events.driver().fault_s.max(events.warmup_s),
        // The fault analysis places rows by their send time throughout (its windows are cut at
        // events on the driver's send clock).
        clock: WindowClock::Sent,
    }
}

/// What one gate said about a repetition.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", content = "reason", rename_all = "kebab-case")]
pub enum GateStatus {
    /// Checked and passed.
    Passed,
    /// Checked and failed: why.
    Failed(String),
    /// The check could not be made (too few requests in the window): why. As for a sweep cell,
    /// it holds nothing back, and it is never reported as passed.
    NotRun(String),
    /// The run recorded no outcome: fault repetitions recorded before fault runs were gated.
    NotRecorded,
}

impl GateStatus {
    /// The status in a few words, as `summary.md` prints it.
    pub fn text(&self) -> String {
        match self {
            GateStatus::Passed => "passed".into(),
            GateStatus::Failed(why) => format!("failed: {why}"),
            GateStatus::NotRun(why) => format!("not run: {why}"),
            GateStatus::NotRecorded => "not recorded".into(),
        }
    }

    /// The drift gate's status from a drift verdict.
    pub fn of_drift(v: &DriftVerdict) -> GateStatus {
        if let Some(why) = &v.skipped {
            GateStatus::NotRun(why.clone())
        } else if v.trending() {
            GateStatus::Failed(v.reason.clone().unwrap_or_else(|| "warming".into()))
        } else {
            GateStatus::Passed
        }
    }
}

/// What the fault run's gates said about the attempt it recorded: `meta.json` `run.gates`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordedGates {
    /// The evidence check (`fleet::evidence::EvidenceSummary::check`, the sweep's bounds).
    pub evidence: GateStatus,
    /// The drift test on `drift_window`.
    pub drift: GateStatus,
    /// Where the drift test ran (driver clock).
    pub drift_window: Window,
    /// [`DRIFT_WINDOW_RULE`].
    pub drift_rule: String,
}

impl RecordedGates {
    /// The record of one attempt's gates.
    pub fn new(evidence: GateStatus, drift: &DriftVerdict, drift_window: Window) -> RecordedGates {
        RecordedGates {
            evidence,
            drift: GateStatus::of_drift(drift),
            drift_window,
            drift_rule: DRIFT_WINDOW_RULE.to_string(),
        }
    }

    /// The record in `meta.run`, if the run wrote one (`None` for runs before gating, or a
    /// record this build cannot read).
    pub fn from_run(run: &serde_json::Value) -> Option<RecordedGates> {
        run.get("gates").and_then(Self::from_record)
    }

    /// The record in a repetition's `meta.json` (`run.gates`), as [`RecordedGates::from_run`].
    pub fn from_meta(meta: &crate::meta::Meta) -> Option<RecordedGates> {
        (meta.run.as_ref()?.other.get("gates")).and_then(Self::from_record)
    }

    fn from_record(gates: &serde_json::Value) -> Option<RecordedGates> {
        serde_json::from_value(gates.clone()).ok()
    }
}

/// A repetition's gates as the summary reports them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RepGates {
    /// Policy.
    pub policy: String,
    /// Repetition.
    pub rep: u32,
    /// Whether the run accepted it (`meta.json` `accepted`); only accepted repetitions enter
    /// the comparisons and the timeline.
    pub accepted: bool,
    /// Why it was set aside, when it was.
    pub set_aside_reason: Option<String>,
    /// Attempts the run made (discarded ones are under `_discarded/`).
    pub attempts: u32,
    /// The evidence gate as the run recorded it.
    pub evidence: GateStatus,
    /// The drift gate as the run recorded it.
    pub drift: GateStatus,
    /// The window of this summary's drift test ([`drift_window`]).
    pub drift_window: Window,
    /// This summary's own drift test on that window.
    pub drift_check: DriftVerdict,
}

impl RepGates {
    /// Whether the run recorded both gates' outcomes.
    pub fn recorded(&self) -> bool {
        self.evidence != GateStatus::NotRecorded && self.drift != GateStatus::NotRecorded
    }
}

/// The gates of a loaded repetition: what its run recorded (or "not recorded"), and this
/// analysis's drift test on the pre-fault window.
pub fn rep_gates(data: &RepData, events: &FaultEvents, cfg: &DriftConfig) -> RepGates {
    let window = drift_window(events);
    let recorded = RecordedGates::from_meta(&data.meta);
    RepGates {
        policy: data.policy.clone(),
        rep: data.rep,
        accepted: data.meta.accepted,
        set_aside_reason: data.meta.set_aside_reason.clone(),
        attempts: data.meta.attempts,
        evidence: recorded
            .as_ref()
            .map_or(GateStatus::NotRecorded, |g| g.evidence.clone()),
        drift: recorded.map_or(GateStatus::NotRecorded, |g| g.drift),
        drift_window: window,
        drift_check: check_rows(&data.client, &data.meta.slo, &window, cfg),
    }
}
