//! The fault experiment's analysis (docs/ARCHITECTURE.md, "Faults"): what one repetition of `cargo xtask fault
//! kill|drain` shows, from its rows and its `fault.json`, and the summary of a fault run's
//! directory (`summary.md`, `summary.json`, `timeline.csv`; docs/CONTRACTS.md, "Fault timeline").
//! The procedure that produces the rows (fleet, router admin API, clock probes) is
//! `experiment::fault`.
//!
//! Loss bounds: a kill may lose only the requests in flight on the victim at the kill, none that
//! were not yet dispatched; a drain may lose nothing.
//!
//! Clocks: the driver's rows count from its own start, the router's from its own, and the fault
//! is timed on the clock of the process that caused it (xtask). A few deliberately malformed
//! requests (`x-request-id: fault-clock-probe-*`, answered 400 by the router before any routing)
//! put the router clock beside xtask's with the round trip as the error bar ([`probe_offset`]),
//! and the smallest router-arrival − driver-send gap over all requests maps the router clock
//! onto the driver's ([`router_minus_driver`]).
//!
//! | module | what |
//! |---|---|
//! | this one | the fault's record (`FaultEvents`, `Instants`, `FaultKind`), `fault_point` |
//! | `clock` | `ClockProbe`, `probe_offset`, `router_minus_driver` |
//! | `rep` | `analyse_rep`: loss-bound classification, share, TTFT and goodput windows, recovery |
//! | `gates` | the drift window (pre-fault), the gates a run records (`RecordedGates`), `rep_gates` |
//! | `comparison` | policies compared over the accepted repetitions with `compare::Verdict::judge` |
//! | `summary` | `summarize` a directory, `write_summary`, the timeline of figure 6 |
//! | `markdown` | `summary.md` |
//!
//! Gates: every fault repetition passes the sweep cell's two gates, the evidence check and the
//! drift test, the latter on the steady load before the fault (`gates::drift_window`); a
//! repetition the run set aside keeps its loss-bound check but leaves the comparisons and the
//! timeline.

use std::path::Path;

use serde::{Deserialize, Serialize};

mod clock;
mod comparison;
mod gates;
mod markdown;
mod rep;
mod summary;
#[cfg(test)]
mod tests;

pub use clock::{ClockProbe, probe_offset, router_minus_driver};
pub use comparison::{Comparison, Difference, PolicyFigure, compare};
pub use gates::{DRIFT_WINDOW_RULE, GateStatus, RecordedGates, RepGates, drift_window, rep_gates};
pub use markdown::markdown;
pub use rep::{LostRequest, RepOutcome, ShareWindow, TtftWindow, analyse_rep};
pub use summary::{
    Summary, TIMELINE_ROLLING_BUCKETS, TimelineRow, rolling_mean, summarize, timeline,
    timeline_csv, write_summary,
};

/// Request ids of the clock probes; their router rows are not requests of the experiment.
pub const PROBE_PREFIX: &str = "fault-clock-probe-";

/// Which fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FaultKind {
    /// SIGKILL mid-request, no warning.
    Kill,
    /// Drain through the router's admin API, then stop.
    Drain,
}

impl FaultKind {
    /// `kill` or `drain`.
    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::Kill => "kill",
            FaultKind::Drain => "drain",
        }
    }
}

/// The fault's instants on the three clocks, and what was seen at the fault; `fault.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaultEvents {
    /// Which fault.
    pub kind: FaultKind,
    /// Router id (= fleet index) of the faulted replica.
    pub victim: u32,
    /// Its URL (the same before and after the restart).
    pub victim_url: String,
    /// Replicas in the fleet.
    pub replicas: usize,
    /// Router clock − xtask's clock, s (from the best clock probe).
    pub router_minus_xtask_s: f64,
    /// Half the best probe's round trip: the error bar of `router_minus_xtask_s`, s.
    pub clock_uncertainty_s: f64,
    /// Router clock − driver clock, s: the smallest arrival − send gap over all requests.
    pub router_minus_driver_s: f64,
    /// Instants on xtask's clock (s since the rep began).
    pub xtask: Instants,
    /// The victim's outstanding count as the router reported it just before the fault.
    pub outstanding_at_fault: Option<u32>,
    /// How long the harness waited for the victim to have a request in flight, s.
    pub waited_for_inflight_s: f64,
    /// Planned end of the load on the driver's clock, s.
    pub run_end_s: f64,
    /// Warm-up on the driver's clock, s.
    pub warmup_s: f64,
}

/// Instants of one fault, all on one clock.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Instants {
    /// Kill: SIGKILL about to be sent. Drain: the router has acknowledged the drain.
    pub fault_s: f64,
    /// Drain: the victim's outstanding count reached 0.
    pub drained_s: Option<f64>,
    /// The process is gone (kill: reaped; drain: stopped).
    pub down_s: f64,
    /// Restart begun.
    pub restart_s: f64,
    /// Healthy again.
    pub up_s: f64,
    /// Drain: undrained.
    pub undrain_s: Option<f64>,
}

impl Instants {
    fn shifted(&self, by: f64) -> Instants {
        Instants {
            fault_s: self.fault_s + by,
            drained_s: self.drained_s.map(|t| t + by),
            down_s: self.down_s + by,
            restart_s: self.restart_s + by,
            up_s: self.up_s + by,
            undrain_s: self.undrain_s.map(|t| t + by),
        }
    }
}

impl FaultEvents {
    /// The instants on the router's clock (`router.csv` `arrival_s`).
    pub fn router(&self) -> Instants {
        self.xtask.shifted(self.router_minus_xtask_s)
    }
    /// The instants on the driver's clock (`client.csv` `_s` columns, the timeline's `t_s`).
    pub fn driver(&self) -> Instants {
        self.xtask
            .shifted(self.router_minus_xtask_s - self.router_minus_driver_s)
    }
}

/// The point of a fault run's directory, from the `sweep.json` the fault command writes
/// (`"sweep": "fault-kill"`, `"point": "ws1-s0-rate4"`); `None` for any other directory.
pub fn fault_point(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("sweep.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v["sweep"]
        .as_str()
        .is_some_and(|s| s.starts_with("fault-"))
        .then(|| v["point"].as_str().map(str::to_string))
        .flatten()
}

/// An optional number with `digits` decimals, `–` when absent.
fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "–".to_string(), |x| format!("{x:.digits$}"))
}
