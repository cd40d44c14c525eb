//! The drift check's verdict on a repetition (docs/ARCHITECTURE.md, "Calibration": warming or
//! overloaded; docs/CONTRACTS.md, "Measurements layout": `drift`): the thresholds it applied, its
//! trend tests and its class. `analysis::drift` computes it (and re-exports these types); the
//! sweeps record it in `meta.json` ([`crate::Meta::drift`]), and the report and the fault summary
//! read it back.

use serde::{Deserialize, Serialize};

/// Thresholds of the drift check.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DriftConfig {
    /// Time buckets the goodput series is cut into.
    pub buckets: usize,
    /// |t| above which a slope counts as real.
    pub t_threshold: f64,
    /// |slope × window| ÷ mean above which a real slope matters.
    pub min_relative_change: f64,
    /// Fewest measured requests the check needs; fewer → skipped, not flagged.
    pub min_requests: usize,
}

impl Default for DriftConfig {
    fn default() -> Self {
        DriftConfig {
            buckets: 10,
            t_threshold: 3.0,
            min_relative_change: 0.10,
            min_requests: 20,
        }
    }
}

/// One trend test.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrendTest {
    /// Points fitted (buckets, or requests).
    pub n: usize,
    /// Slope per second of window (req/s per s for goodput, ms per s for TTFT, requests per s for
    /// the backlog).
    pub slope_per_s: f64,
    /// Slope ÷ its standard error; `None` for a perfect line (unbounded).
    pub t_stat: Option<f64>,
    /// |slope × window length| ÷ series mean; `None` when the mean is zero.
    pub relative_change: Option<f64>,
    /// Both thresholds exceeded.
    pub flagged: bool,
}

/// What the drift check concluded about a repetition.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DriftClass {
    /// No series trends: the repetition says something about its cell.
    #[default]
    Settled,
    /// Every series that trends improves the SLO's outcome (attainment or goodput rising, TTFT
    /// falling) and no backlog grows: not yet settled; re-run longer or set aside.
    Warming,
    /// A series trends for the worse (attainment or goodput falling, TTFT rising) and no backlog
    /// grows: the fleet is drifting, not warming, and a longer warm-up would not settle it. A
    /// result, recorded with its goodput and attainment and marked, never re-run as warming.
    Worsening,
    /// The open-loop backlog, or the driver's queue alone, grows through the window (whether or
    /// not a series trends): the offered load is not sustained. A result, marked, not set aside.
    Overloaded,
    /// Too few measured requests to run the check.
    Skipped,
}

impl DriftClass {
    /// The class as `meta.json` and the report write it.
    pub fn as_str(&self) -> &'static str {
        match self {
            DriftClass::Settled => "settled",
            DriftClass::Warming => "warming",
            DriftClass::Worsening => "worsening",
            DriftClass::Overloaded => "overloaded",
            DriftClass::Skipped => "skipped",
        }
    }
}

/// Outcome of the drift check on one repetition: what the analysis computes and what `meta.json`
/// records as `drift`. Every field defaults when absent (files written before it existed, or a
/// hand-written record), so any recorded verdict reads.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DriftVerdict {
    /// Still warming: every flagged series improves and no backlog grows
    /// ([`DriftClass::Warming`]). False for a trend for the worse ([`DriftClass::Worsening`],
    /// told by `class`).
    pub warming: bool,
    /// Goodput per bucket vs time, for a closed loop; `None` for an open loop (judged by
    /// `attainment` instead) or with fewer than 3 buckets.
    pub goodput: Option<TrendTest>,
    /// Share of each bucket's measured requests that met the SLO vs time, for an open loop
    /// (whose arrivals, and so whose goodput per bucket, are the plan's); `None` for a closed
    /// loop or with fewer than 3 buckets.
    pub attainment: Option<TrendTest>,
    /// TTFT (as the SLO judges it) vs the window's time; `None` with fewer than 3 successful
    /// requests.
    pub ttft: Option<TrendTest>,
    /// Human-readable reason when warming or overloaded, for `set_aside_reason` and the report.
    pub reason: Option<String>,
    /// Why the check was not run (too few measured requests); `None` when it ran.
    pub skipped: Option<String>,
    /// The thresholds applied.
    pub config: DriftConfig,
    /// A growing open-loop backlog ([`DriftClass::Overloaded`]).
    pub overloaded: bool,
    /// The verdict: settled, warming, worsening, overloaded or skipped.
    pub class: DriftClass,
    /// Mean backlog per bucket (requests scheduled and not yet finished) vs time, in requests
    /// per s of window; `None` for a closed loop (no backlog to measure) or with fewer than 3
    /// buckets. Its `flagged` with a positive slope is "grows".
    pub backlog: Option<TrendTest>,
    /// Mean backlog over the window, requests; `None` when not measured.
    pub backlog_mean: Option<f64>,
    /// Mean driver queue per bucket (requests scheduled and not yet sent) vs time, in requests
    /// per s of window; `None` when `backlog` is. Its `flagged` with a positive slope is "grows".
    pub unsent: Option<TrendTest>,
    /// Mean driver queue over the window, requests; `None` when not measured.
    pub unsent_mean: Option<f64>,
    /// Of a flagged, rising TTFT trend of an open loop, the share of its slope that is the wait
    /// in the driver (the rest is the TTFT from the send); `None` otherwise. Above
    /// `analysis::drift::WAIT_SHARE_OF_DRIFT` the drift is the driver's queue growing: overloaded.
    pub wait_share: Option<f64>,
    /// The classification rule in words (`analysis::drift::CLASSIFICATION_RULE`).
    pub rule: String,
}

impl DriftVerdict {
    /// Not settled: warming, worsening or overloaded.
    pub fn drifting(&self) -> bool {
        self.warming || self.overloaded || self.worsening()
    }

    /// A trend for the worse with no growing backlog ([`DriftClass::Worsening`]).
    pub fn worsening(&self) -> bool {
        self.class == DriftClass::Worsening
    }

    /// A series trends and no backlog grows: warming or worsening, the verdicts a drift gate
    /// that wants a settled window fails.
    pub fn trending(&self) -> bool {
        self.warming || self.worsening()
    }
}
