//! The fleet's capacity (docs/ARCHITECTURE.md, "Calibration": the operating point): the highest
//! offered open-loop rate at which the best of a small set of policies still meets the SLO on at
//! least [`ATTAINMENT_TARGET`] of its measured requests. Sweeps then run at named fractions of it
//! (`--load`), so that a comparison is made where the fleet is under pressure.
//!
//! Open loop, because a closed loop's offered load depends on the latency it measures: its users
//! wait for each reply, so a slower policy is offered less work and looks better than it is. An
//! open loop sends the plan's Poisson schedule whatever the fleet does, so one rate means the same
//! offered load for every policy, and a rate the fleet cannot sustain shows as a growing backlog.
//!
//! Three parts:
//! - [`search`]: the rate search, a pure function over a measuring callback — coarse geometric
//!   steps from a stated start, then geometric bisection to a stated resolution. A rate *meets*
//!   when a policy's settled step served ≥ [`ATTAINMENT_TARGET`] of its measured requests within
//!   the SLO. The step is an open loop, so its measured requests are those *scheduled* in the
//!   window and each TTFT counts from the scheduled time (docs/CONTRACTS.md, "Which requests are
//!   measured"): a turn that queued in the driver behind its conversation's previous turn —
//!   the backlog of overload — is measured, and misses by its wait. A step the drift check calls
//!   overloaded (its backlog, or the driver's queue alone, grows through the window) does not
//!   meet and is not re-run: a longer warm-up would not settle it. Neither does a worsening
//!   step (attainment falling or TTFT rising with no queue growing: only an improving trend is
//!   warming). A step the drift check calls warming is re-run with its warm-up
//!   doubled; one still unsettled after [`SearchConfig::max_lengthenings`] re-runs counts as not
//!   meeting the SLO (the fleet did not hold that rate steady), and is recorded so — never
//!   silently used.
//! - [`cell_window`]: a sweep cell's warm-up from the settling time the search measured at the
//!   nearest rate, and its measured window sized for the drift check's minimum requests.
//! - [`find_live`]: the procedure that measures a step on the live fleet (one open-loop cell of
//!   the reference point's workload through the router) and runs the search; the virtual sweep
//!   measures its steps in the simulator with the same search and [`step_from_rep`].

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};
use serde::{Deserialize, Serialize};

use fleet::evidence::EvidenceConfig;
use fleet::{DriverSettings, Fleet};
use schema::{ATTAINMENT_TARGET, Meta};
use workload::{ArrivalSpec, Sizing, WorkloadSpec};

use crate::attempt::{Attempt, bounds, run_attempt};
use crate::bins::Bins;
use crate::calibrate::CalibrateSettings;
use crate::calibration::Calibration;
use crate::cell;
use crate::fleet_spec::FleetKind;
use crate::grid;
use crate::plan_file::ensure_plan;
use crate::progress::fmt_duration;

/// The policies whose best decides the capacity: the hashing baseline and the cache-aware router
/// (a fleet "can serve" a rate when a sensible router meets the SLO there).
pub const DEFAULT_POLICIES: &[&str] = &["session-affinity", "prefix-affinity"];

/// A sweep cell's warm-up is this many times the warm-up the capacity search needed to settle at
/// the nearest rate: the search's steps settle on a doubling ladder, so the settled warm-up is an
/// upper estimate by up to 2× already, and 1.5× more covers a cell that settles a little later
/// than the step did (another policy, another working set).
///
/// A floor of 1.5 × the time the cell's load takes to fill the fleet's KV capacity once (the
/// caches evict nothing until full, so a window holding that turn trends) was tried on the
/// virtual grid at 1.0× each point's capacity (1 Dec 2026): warm-ups of 34–518 s instead of
/// 30–120 s, and fewer settled cells (182 of 324 against 210; ws3-s0 went from 27 warming to 18
/// settled, ws1-s1.4 from 27 settled to 27 warming). At a point's capacity the fleet is at the
/// edge, and a longer run gives a marginal backlog longer to show; the steps' cache inflow
/// stays recorded (`StepMeasurement::inflow_tokens_per_s`) as the evidence.
///
/// What those cells were warming through was mostly not the caches but the workload: every
/// conversation started at turn 1, and at 3× and 8× the KV capacity the prompts kept growing for
/// 2–5 minutes. Since open loops start at the steady state's turn mix ([`Calibration::open_start`]) and
/// an open loop's drift is judged by attainment rather than by its plan's arrivals, the same
/// virtual grid with this margin settles 291 of 324 cells (1 Dec 2026, 21:50 UTC; 27 of 27 at ws3-s0 and
/// 24 of 27 at ws8-s0), and a point's hit rate is at its steady level from the second 20-s
/// bucket of a 600-s cell on.
pub const WARMUP_MARGIN: f64 = 1.5;

/// A measured window holds at least this many times the drift check's minimum requests at the
/// cell's rate, so that Poisson noise does not leave the check skipped.
pub const WINDOW_REQUEST_MARGIN: f64 = 2.0;

/// The largest share of a capacity step's measured requests that may be *cold resumes*
/// (`workload::cold_resume_share`: a conversation's first turn in the run after its first turn,
/// whose whole history every replica must prefill — an artefact of the run's start that no
/// router avoids; counted only for a conversation the steady state would hold in the cache,
/// `workload::steadily_cached`, since 4 Dec 2026). A step's warm-up is doubled until its window holds no more
/// ([`steady_step_warmup_s`]). 1%: a hundredth of the 10% of requests the SLO's target lets
/// miss. Without it a step's window at a low rate held mostly such turns, so lowering the rate
/// did not make the SLO easier and a search could "fail at every rate" (the quick virtual grid
/// at ws3-s0, 3 Dec 2026: 62–71% attainment at every rate down to 0.018 req/s).
pub const MAX_COLD_RESUME_SHARE: f64 = 0.01;

/// Doublings of a step's warm-up the cold-resume rule may ask for: 2^16 × a 5-s warm-up is
/// 91 hours of plan time, past any workload the grids size.
pub const MAX_COLD_RESUME_DOUBLINGS: u32 = 16;

/// A step's warm-up (s of the plan, i.e. wall): the primes' period of `start`
/// (`workload::prime_period_s`) and `base_s`, the latter doubled until the measured window of
/// `measure_s` after it holds at most [`MAX_COLD_RESUME_SHARE`] cold resumes of `spec` at
/// `wall_rate_rps` (an open loop from `start`, [`Calibration::open_start`]). Fails, naming the
/// share, when even the last doubling leaves more.
pub fn steady_step_warmup_s(
    spec: &WorkloadSpec,
    wall_rate_rps: f64,
    start: workload::OpenStart,
    base_s: f64,
    measure_s: f64,
) -> Result<f64> {
    let (warmup_s, share) = workload::steady_state_warmup_s(
        spec,
        wall_rate_rps,
        start,
        base_s,
        measure_s,
        MAX_COLD_RESUME_SHARE,
        MAX_COLD_RESUME_DOUBLINGS,
    )
    .map_err(|e| anyhow!("the steady-state warm-up of {}: {e}", spec.name()))?;
    if share > MAX_COLD_RESUME_SHARE {
        bail!(
            "a {:.0}-s warm-up still leaves {:.1}% of the window's requests resuming a conversation cold at {wall_rate_rps} req/s (wall) of {} (at most {:.0}% allowed)",
            warmup_s,
            share * 100.0,
            spec.name(),
            MAX_COLD_RESUME_SHARE * 100.0
        );
    }
    Ok(warmup_s)
}

/// Rates are rounded to this many requests per second (model time), so that point and step names
/// stay short and a rate read back from a name is the rate that ran.
pub const RATE_RESOLUTION_RPS: f64 = 0.001;

/// Rounds a rate to [`RATE_RESOLUTION_RPS`].
pub fn round_rate(rate_rps: f64) -> f64 {
    // Divide by the whole number of steps per req/s (1000), not multiply by 0.001: the result is
    // then the double nearest the decimal (28.214, not 28.214000000000002).
    let per_rps = (1.0 / RATE_RESOLUTION_RPS).round();
    (rate_rps * per_rps).round() / per_rps
}

/// What the search runs with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SearchConfig {
    /// First rate measured, requests per second of model time.
    pub start_rps: f64,
    /// How that start was chosen (recorded beside it).
    pub start_rule: String,
    /// Coarse step: each coarse rate is the previous one × or ÷ this factor (> 1).
    pub step_factor: f64,
    /// Bisection stops once the lowest failing rate is within this share above the highest
    /// meeting rate (0.1: within 10%).
    pub resolution: f64,
    /// Most coarse steps up (or down) before the search gives up.
    pub max_coarse_steps: u32,
    /// Coarse steps taken at `step_factor` before each further one squares the previous step's
    /// factor (×1.1, ×1.1, ×1.1, ×1.21, ×1.46, ×2.14: from 1.77× to 5.0× in six steps), so a
    /// start far from the answer still brackets it; `None`: every coarse step is
    /// `step_factor`. A live search that starts at the simulator's prediction takes fine
    /// steps near it and wide ones past it.
    #[serde(default)]
    pub widen_after: Option<u32>,
    /// Re-runs of an unsettled step, each with its warm-up doubled, before it counts as not
    /// meeting the SLO.
    pub max_lengthenings: u32,
    /// The policies whose best decides (measured in this order; the last one to meet the SLO
    /// goes first at the next rate).
    pub policies: Vec<String>,
    /// How every step's open loop starts ([`Calibration::open_start`]); recorded in the
    /// capacity, which is stale for open loops that start otherwise.
    #[serde(default)]
    pub open_start: workload::OpenStart,
}

impl SearchConfig {
    /// The factor of coarse step `k` (0-based): `step_factor`, squared once per step past
    /// `widen_after`.
    pub fn coarse_factor(&self, k: u32) -> f64 {
        match self.widen_after {
            Some(w) if k >= w => self.step_factor.powf(2f64.powi((k - w + 1) as i32)),
            _ => self.step_factor,
        }
    }

    /// How far the coarse steps reach from the start, either way: the product of every
    /// coarse factor.
    pub fn coarse_span(&self) -> f64 {
        (0..self.max_coarse_steps)
            .map(|k| self.coarse_factor(k))
            .product()
    }

    /// `6 coarse steps of ×1.1` or `6 coarse steps of ×1.1, widening after 3 (×5.05 in all)`.
    fn coarse_text(&self, sign: &str) -> String {
        match self.widen_after {
            Some(w) if w < self.max_coarse_steps => format!(
                "{} coarse steps of {sign}{}, widening after {w} ({sign}{:.2} in all)",
                self.max_coarse_steps,
                self.step_factor,
                self.coarse_span()
            ),
            _ => format!(
                "{} coarse steps of {sign}{}",
                self.max_coarse_steps, self.step_factor
            ),
        }
    }
}

/// One measurement the search asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct StepRequest {
    /// Offered rate, requests per second of model time.
    pub rate_rps: f64,
    /// The policy routing it.
    pub policy: String,
    /// 0 for the first run at this rate and policy; k for the k-th re-run, whose warm-up is
    /// 2^k × the base warm-up.
    pub lengthening: u32,
}

/// What one step measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMeasurement {
    /// Share of measured requests meeting the SLO; `None` when none were measured. Measured by
    /// the open loop's rule: the requests scheduled in the window, each TTFT from its scheduled
    /// time, so turns that queued in the driver while the fleet fell behind count (as misses).
    pub attainment: Option<f64>,
    /// Requests meeting the SLO ÷ measured window, requests per second of model time.
    pub goodput_rps: f64,
    /// Requests in the measured window.
    pub measured_requests: u64,
    /// The drift check ran and found no trend, and the evidence was clean: the step says
    /// something about the rate.
    pub settled: bool,
    /// Why not settled (drift, too few requests for the check, evidence).
    pub unsettled_reason: Option<String>,
    /// The drift check found the step overloaded (its backlog, or the driver's queue alone, grows
    /// through the window): it does not meet, and a longer warm-up would not settle it, so it is
    /// not re-run.
    #[serde(default)]
    pub overloaded: bool,
    /// The drift check found the step worsening (a trend for the worse — attainment falling,
    /// TTFT rising — with no queue growing): only an improving trend is warming, so it does not
    /// meet and is not re-run, like an overloaded step.
    #[serde(default)]
    pub worsening: bool,
    /// Unsettled only by a warming trend that improves the SLO's outcome (TTFT falling,
    /// attainment or goodput rising), with clean evidence and no growing backlog: if its
    /// attainment already meets the target, the settled fleet would meet it too, so the step
    /// meets ([`search`]).
    #[serde(default)]
    pub improving: bool,
    /// Warm-up of the step, wall s.
    pub warmup_s: f64,
    /// Measured window of the step, wall s.
    pub measure_s: f64,
    /// Tokens entering the engines' caches per wall second over the measured window (Σ prompt −
    /// cached + output of the measured requests ÷ the window; `analysis::metrics::cache_inflow`),
    /// when every request reported its tokens: how fast this load fills the fleet's KV capacity.
    #[serde(default)]
    pub inflow_tokens_per_s: Option<f64>,
    /// The step's repetition directory, when it has one.
    pub dir: Option<PathBuf>,
}

/// One measured step, as `calibration.json` records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CurvePoint {
    /// Offered rate, requests per second of model time.
    pub rate_rps: f64,
    /// The policy routing it.
    pub policy: String,
    /// `coarse` or `bisect`.
    pub phase: String,
    /// Re-runs before this one at this rate and policy (each doubling the warm-up).
    pub lengthening: u32,
    /// What the step measured (its fields stand at this level in `calibration.json`).
    #[serde(flatten)]
    pub step: StepMeasurement,
    /// Settled and attainment ≥ the target.
    pub meets_target: bool,
}

/// The fleet's capacity: `calibration.json`'s `capacity`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Capacity {
    /// The capacity: the highest rate measured at which the best policy met the target,
    /// requests per second of model time (wall rate = rate × the fleet's speed).
    pub rate_rps: f64,
    /// The rule, in words, with the numbers that applied.
    pub rule: String,
    /// Share of measured requests that must meet the SLO ([`ATTAINMENT_TARGET`]).
    pub target: f64,
    /// Relative resolution of the bisection.
    pub resolution: f64,
    /// The lowest rate measured above the capacity at which no policy met the target.
    pub failing_rps: f64,
    /// The policy that met the target at the capacity.
    pub best_policy: String,
    /// The policies whose best decides.
    pub policies: Vec<String>,
    /// The search's settings (start and its rule, steps, re-runs).
    pub search: SearchConfig,
    /// The workload the steps ran (the reference point's, open loop), by name.
    pub workload: String,
    /// Where the steps' open loops started their conversations; absent in a file written
    /// before the start was chosen, which searched fresh starts.
    #[serde(default)]
    pub open_start: workload::OpenStart,
    /// Wall seconds the whole search took (fleet starts included).
    pub search_wall_s: f64,
    /// Every step, in the order measured.
    pub curve: Vec<CurvePoint>,
}

impl Capacity {
    /// Why this capacity cannot size today's open loops, which start as `today`
    /// ([`Calibration::open_start`]): its steps started their conversations otherwise; `None`
    /// when it can.
    pub fn stale(&self, today: workload::OpenStart) -> Option<String> {
        (self.open_start != today).then(|| {
            format!(
                "its capacity was searched on open loops with a {:?} start, and open loops now start {today:?} (the steady state's turn mix, after priming the histories the cache would hold)",
                self.open_start,
            )
        })
    }

    /// The settled steps (those that say something about their rate).
    pub fn settled(&self) -> impl Iterator<Item = &CurvePoint> {
        self.curve.iter().filter(|p| p.step.settled)
    }
}

impl SearchConfig {
    fn check(&self) -> Result<()> {
        if !(self.start_rps.is_finite() && self.start_rps > 0.0) {
            bail!(
                "the capacity search needs a positive start rate, got {}",
                self.start_rps
            );
        }
        if !(self.step_factor.is_finite() && self.step_factor > 1.0) {
            bail!(
                "the capacity search's step factor must be > 1, got {}",
                self.step_factor
            );
        }
        if !(self.resolution.is_finite() && self.resolution > 0.0) {
            bail!(
                "the capacity search's resolution must be > 0, got {}",
                self.resolution
            );
        }
        if self.max_coarse_steps == 0 {
            bail!("the capacity search needs at least one coarse step");
        }
        if self.policies.is_empty() {
            bail!("the capacity search needs at least one policy");
        }
        Ok(())
    }
}

/// The search in progress: the curve so far and which policy met the target last.
struct Searcher<'a> {
    cfg: &'a SearchConfig,
    measure: &'a mut dyn FnMut(&StepRequest) -> Result<StepMeasurement>,
    curve: Vec<CurvePoint>,
    last_meeting: Option<String>,
}

impl Searcher<'_> {
    /// Whether the best policy meets the target at `rate_rps`: the policies in turn (the one
    /// that met it last first), each re-run while unsettled; the first that meets it ends the
    /// step, since the best of the set then meets it.
    fn meets(&mut self, rate_rps: f64, phase: &str) -> Result<Option<String>> {
        let mut order: Vec<String> = self.cfg.policies.clone();
        if let Some(p) = &self.last_meeting
            && let Some(i) = order.iter().position(|x| x == p)
        {
            let p = order.remove(i);
            order.insert(0, p);
        }
        for policy in order {
            for lengthening in 0..=self.cfg.max_lengthenings {
                let m = (self.measure)(&StepRequest {
                    rate_rps,
                    policy: policy.clone(),
                    lengthening,
                })?;
                // A step still warming in the good direction that already meets the target
                // meets it: settling would only raise its attainment.
                let meets_target = (m.settled || m.improving)
                    && m.attainment.is_some_and(|a| a >= ATTAINMENT_TARGET);
                self.curve.push(CurvePoint {
                    rate_rps,
                    policy: policy.clone(),
                    phase: phase.to_string(),
                    lengthening,
                    step: m.clone(),
                    meets_target,
                });
                if meets_target {
                    self.last_meeting = Some(policy.clone());
                    return Ok(Some(policy));
                }
                // An overloaded or worsening step is a result (it does not meet); only a
                // warming one is re-run.
                if m.settled || m.overloaded || m.worsening {
                    break;
                }
            }
        }
        Ok(None)
    }

    /// Why the steps at `rate_rps` missed, when it is not load: every one settled with no
    /// growing backlog (the drift check's overload test), so their misses are the requests' own
    /// service times against the SLO — a lower rate would not help. Empty otherwise.
    fn why_unmet(&self, rate_rps: f64) -> String {
        let steps: Vec<&CurvePoint> = self
            .curve
            .iter()
            .filter(|p| p.rate_rps == rate_rps)
            .collect();
        if !steps.is_empty() && steps.iter().all(|p| p.step.settled && !p.step.overloaded) {
            format!(
                ". Every step there settled with no growing backlog, so the misses are not load: requests miss on their own service time (the prefill of what their replica does not hold, and their decode) against the SLO's bounds, which {:.0}% of requests must meet at any rate — {} down did not change that",
                ATTAINMENT_TARGET * 100.0,
                self.cfg.coarse_text("÷")
            )
        } else {
            String::new()
        }
    }

    /// What the steps at `rate_rps` measured, for an error message.
    fn describe(&self, rate_rps: f64) -> String {
        self.curve
            .iter()
            .filter(|p| p.rate_rps == rate_rps)
            .map(|p| {
                format!(
                    "{} attainment {}{}",
                    p.policy,
                    p.step
                        .attainment
                        .map_or_else(|| "none".into(), |a| format!("{:.1}%", a * 100.0)),
                    match &p.step.unsettled_reason {
                        Some(why) => format!(" (unsettled: {why})"),
                        None => String::new(),
                    }
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// The search ended without a bracket: the fleet met the target at every rate it tried, or
/// at none (or stepped below the rate resolution). A result about the fleet, not a failure of
/// the machinery; `anyhow::Error::downcast_ref` tells it apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unbracketed {
    /// One line for a table: which end is open and what the last step there measured.
    pub summary: String,
    /// The whole explanation (the error's text).
    pub message: String,
}

impl std::fmt::Display for Unbracketed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Unbracketed {}

/// The rate search: coarse steps of `step_factor` from `start_rps` (up while the best policy
/// meets the target, down while it does not) until one meeting and one failing rate bracket the
/// capacity, then geometric bisection until the failing rate is within `resolution` of the
/// meeting one. `measure` measures one step. Errors: the fleet fails even at the lowest rate
/// tried, or meets the target at every rate up to the highest tried (a bound is not a value), or
/// a measurement fails.
pub fn search(
    cfg: &SearchConfig,
    measure: &mut dyn FnMut(&StepRequest) -> Result<StepMeasurement>,
) -> Result<Capacity> {
    cfg.check()?;
    let started = Instant::now();
    let mut s = Searcher {
        cfg,
        measure,
        curve: Vec::new(),
        last_meeting: None,
    };
    let next = |r: f64| -> Result<f64> {
        let r = round_rate(r);
        if r < RATE_RESOLUTION_RPS {
            let message = format!("the capacity search stepped below {RATE_RESOLUTION_RPS} req/s");
            return Err(Unbracketed {
                summary: message.clone(),
                message,
            }
            .into());
        }
        Ok(r)
    };
    let start = next(cfg.start_rps)?;
    // (highest meeting rate and its policy, lowest failing rate)
    let (mut lo, mut hi): ((f64, String), f64);
    match s.meets(start, "coarse")? {
        Some(policy) => {
            lo = (start, policy);
            let mut failing = None;
            for k in 0..cfg.max_coarse_steps {
                let r = next(lo.0 * cfg.coarse_factor(k))?;
                match s.meets(r, "coarse")? {
                    Some(policy) => lo = (r, policy),
                    None => {
                        failing = Some(r);
                        break;
                    }
                }
            }
            hi = failing.ok_or_else(|| Unbracketed {
                summary: format!("met the SLO at every rate tried, up to {} req/s", lo.0),
                message: format!(
                    "the fleet met the SLO on ≥ {:.0}% of requests at every rate tried, up to {} req/s ({} from {start}); its capacity is higher than that — start higher or allow more steps",
                    ATTAINMENT_TARGET * 100.0,
                    lo.0,
                    cfg.coarse_text("×")
                ),
            })?;
        }
        None => {
            hi = start;
            let mut meeting = None;
            for k in 0..cfg.max_coarse_steps {
                let r = next(hi / cfg.coarse_factor(k))?;
                match s.meets(r, "coarse")? {
                    Some(policy) => {
                        meeting = Some((r, policy));
                        break;
                    }
                    None => hi = r,
                }
            }
            lo = match meeting {
                Some(m) => m,
                None => {
                    let why = s.why_unmet(hi);
                    return Err(Unbracketed {
                        summary: format!(
                            "met the SLO at no rate tried, down to {hi} req/s ({}){}",
                            s.describe(hi),
                            if why.is_empty() { "" } else { ": not load" }
                        ),
                        message: format!(
                            "the fleet fails its SLO even at the lowest rate tried, {hi} req/s (model time; {} from {start}): no policy of [{}] met the SLO on ≥ {:.0}% of measured requests there — {}{why}",
                            cfg.coarse_text("÷"),
                            cfg.policies.join(", "),
                            ATTAINMENT_TARGET * 100.0,
                            s.describe(hi)
                        ),
                    }
                    .into());
                }
            };
        }
    }
    while hi > lo.0 * (1.0 + cfg.resolution) {
        let mid = next((lo.0 * hi).sqrt())?;
        if mid <= lo.0 || mid >= hi {
            // The rates are as close as their rounding allows.
            break;
        }
        match s.meets(mid, "bisect")? {
            Some(policy) => lo = (mid, policy),
            None => hi = mid,
        }
    }
    let rule = format!(
        "capacity = the highest offered open-loop rate (req/s of model time) at which the best of [{}] met the SLO on ≥ {:.0}% of its measured requests (the requests scheduled in the window, each TTFT counted from its scheduled time, so turns queued in the driver count), in a settled step (drift check passed, evidence clean) or one whose only drift is a warming trend that improves the SLO's outcome (settling would only raise its attainment); coarse steps of ×{} from {start} req/s ({}), then geometric bisection until the lowest failing rate ({hi}) was within {:.0}% of it; a step the drift check called overloaded (its backlog, or the driver's queue alone, growing through the window) or worsening (attainment falling or TTFT rising with no queue growing: only an improving trend is warming) does not meet and was not re-run; a warming step was re-run with its warm-up doubled up to {} time(s), and a step still unsettled counts as not meeting the SLO",
        cfg.policies.join(", "),
        ATTAINMENT_TARGET * 100.0,
        cfg.step_factor,
        cfg.start_rule,
        cfg.resolution * 100.0,
        cfg.max_lengthenings,
    );
    Ok(Capacity {
        rate_rps: lo.0,
        rule,
        target: ATTAINMENT_TARGET,
        resolution: cfg.resolution,
        failing_rps: hi,
        best_policy: lo.1,
        policies: cfg.policies.clone(),
        search: cfg.clone(),
        workload: String::new(),
        open_start: cfg.open_start,
        search_wall_s: started.elapsed().as_secs_f64(),
        curve: s.curve,
    })
}

/// A sweep cell's warm-up and measured window, with the rule that set them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellWindow {
    /// Warm-up, wall s.
    pub warmup_s: f64,
    /// Measured window, wall s.
    pub measure_s: f64,
    /// How they were set, in words.
    pub rule: String,
    /// The capacity-search rate whose settling time set the warm-up (model req/s), if any.
    pub settled_at_rps: Option<f64>,
    /// The warm-up that settled there, wall s.
    pub settled_warmup_s: Option<f64>,
}

impl CellWindow {
    /// Warm-up + measured window, wall s (the driver's `--duration-s`).
    pub fn run_s(&self) -> f64 {
        self.warmup_s + self.measure_s
    }

    /// A window fixed by the sweep's flags (closed loop, or `--warmup-s` given).
    pub fn fixed(warmup_s: f64, measure_s: f64, rule: &str) -> CellWindow {
        CellWindow {
            warmup_s,
            measure_s,
            rule: rule.to_string(),
            settled_at_rps: None,
            settled_warmup_s: None,
        }
    }
}

/// The smallest measured window (wall s) that holds [`WINDOW_REQUEST_MARGIN`] × `min_requests`
/// requests at `wall_rate_rps`.
pub fn window_for_requests(wall_rate_rps: f64, min_requests: usize) -> f64 {
    WINDOW_REQUEST_MARGIN * min_requests as f64 / wall_rate_rps
}

/// The window of an open-loop cell at `rate_rps` (model time) on a fleet running at `speed`:
///
/// - warm-up: the primes' period of the cell's plan, `prime_s` (`workload::prime_period_s`: the
///   same at every rate of a workload), then [`WARMUP_MARGIN`] × the rest of the warm-up the
///   capacity search settled with at the lowest settled rate at or above `rate_rps` (a higher
///   load settles later, so the rate above is the safe side); above every settled rate, the
///   settled warm-up at the highest one (stated as an extrapolation). The margin covers the
///   settling, not the primes, whose length does not depend on the load. `warmup_given` (the sweep's `--warmup-s`) replaces the derivation. Not
///   lengthened to the time the load takes to fill the caches: tried, and at 1.0× a point's
///   capacity the longer cells drifted more, not less (see `WARMUP_MARGIN`).
/// - measured window: `measure_s`, lengthened when needed so that the window holds
///   [`WINDOW_REQUEST_MARGIN`] × the drift check's `min_requests` at this rate.
pub fn cell_window(
    cap: &Capacity,
    rate_rps: f64,
    speed: f64,
    prime_s: f64,
    warmup_given: Option<f64>,
    measure_s: f64,
    min_requests: usize,
) -> Result<CellWindow> {
    let wall_rate = rate_rps * speed;
    if !(wall_rate.is_finite() && wall_rate > 0.0) {
        bail!("a cell's rate must be positive, got {rate_rps} req/s at speed {speed}");
    }
    let needed = window_for_requests(wall_rate, min_requests);
    let measure = measure_s.max(needed);
    let measure_rule = if needed > measure_s {
        format!(
            "measured window {measure:.1} s: lengthened from {measure_s} s to hold {WINDOW_REQUEST_MARGIN}× the drift check's {min_requests} requests at {wall_rate:.2} req/s (wall)"
        )
    } else {
        format!(
            "measured window {measure_s} s (holds ≥ {WINDOW_REQUEST_MARGIN}× the drift check's {min_requests} requests at {wall_rate:.2} req/s wall)"
        )
    };
    if let Some(w) = warmup_given {
        return Ok(CellWindow {
            warmup_s: w,
            measure_s: measure,
            rule: format!("warm-up {w} s given by --warmup-s; {measure_rule}"),
            settled_at_rps: None,
            settled_warmup_s: None,
        });
    }
    // The longest settled warm-up at each settled rate.
    let mut settled: Vec<(f64, f64)> = Vec::new();
    for p in cap.settled() {
        match settled.iter_mut().find(|(r, _)| *r == p.rate_rps) {
            Some((_, w)) => *w = w.max(p.step.warmup_s),
            None => settled.push((p.rate_rps, p.step.warmup_s)),
        }
    }
    settled.sort_by(|a, b| a.0.total_cmp(&b.0));
    let at_or_above = settled.iter().find(|(r, _)| *r >= rate_rps - 1e-9);
    let (from, how) = match at_or_above {
        Some(x) => (*x, "the lowest settled capacity-search rate at or above it"),
        None => match settled.last() {
            Some(x) => (
                *x,
                "extrapolated: no capacity-search step settled at or above this rate; the highest settled one",
            ),
            None => bail!(
                "the calibration's capacity search has no settled step to size a warm-up from; recalibrate (cargo xtask calibrate)"
            ),
        },
    };
    let settle = (from.1 - prime_s).max(0.0);
    let warmup = prime_s + WARMUP_MARGIN * settle;
    let primes = if prime_s > 0.0 {
        format!("the primes' {prime_s:.1} s + ")
    } else {
        String::new()
    };
    Ok(CellWindow {
        warmup_s: warmup,
        measure_s: measure,
        rule: format!(
            "warm-up {warmup:.1} s = {primes}{WARMUP_MARGIN} × the {settle:.1} s after them of the {} s warm-up the drift check settled with at {} req/s ({how}; this cell {rate_rps} req/s, model time); {measure_rule}",
            from.1, from.0
        ),
        settled_at_rps: Some(from.0),
        settled_warmup_s: Some(from.1),
    })
}

/// What a finished step's repetition directory (with its `meta.json`) measured: the report's
/// attainment over its measured requests (by the window's clock: an open loop's scheduled
/// time), goodput in model time, and the drift check on its rows, whose class marks an
/// overloaded step (`evidence_failed`: the evidence check's complaint, which also leaves the
/// step unsettled).
pub fn step_from_rep(
    dir: &Path,
    speed: f64,
    warmup_s: f64,
    measure_s: f64,
    evidence_failed: Option<String>,
) -> Result<StepMeasurement> {
    let rep = match analysis::load::load_rep(dir, "capacity-step", "policy", 1)
        .map_err(|e| anyhow!("loading the capacity step {}: {e}", dir.display()))?
    {
        analysis::load::RepLoad::Complete(rep) => rep,
        analysis::load::RepLoad::Incomplete(why) => {
            bail!("the capacity step {} is incomplete: {why}", dir.display())
        }
    };
    let slo = rep.meta.slo;
    let window = rep.meta.window;
    let requests = analysis::metrics::measured_requests(&rep, &slo);
    let latency = analysis::metrics::latency(&requests);
    let drift = analysis::check_rows(
        &rep.client,
        &slo,
        &window,
        &analysis::DriftConfig::default(),
    );
    // Warming is in the good direction only: every flagged trend improves the SLO's outcome
    // (TTFT down, attainment or goodput up) with no growing backlog (`analysis::drift`); a trend
    // for the worse is `worsening`.
    let improving = evidence_failed.is_none() && drift.skipped.is_none() && drift.warming;
    let unsettled_reason = evidence_failed
        .map(|e| format!("evidence: {e}"))
        .or(drift.skipped.clone())
        .or(drift.reason.clone());
    let inflow = analysis::metrics::cache_inflow(&requests, window.measured_s());
    Ok(StepMeasurement {
        attainment: latency.slo_attainment,
        goodput_rps: latency.good as f64 / window.measured_s() / speed,
        measured_requests: latency.requests,
        settled: unsettled_reason.is_none(),
        overloaded: drift.overloaded,
        worsening: drift.worsening(),
        improving,
        unsettled_reason,
        warmup_s,
        measure_s,
        inflow_tokens_per_s: inflow.tokens_per_s,
        dir: Some(dir.to_path_buf()),
    })
}

/// How the live capacity search runs (part of [`CalibrateSettings`]).
#[derive(Debug, Clone, PartialEq)]
pub struct CapacitySettings {
    /// The policies whose best decides.
    pub policies: Vec<String>,
    /// Coarse step factor.
    pub step_factor: f64,
    /// Relative resolution of the bisection.
    pub resolution: f64,
    /// Most coarse steps up or down.
    pub max_coarse_steps: u32,
    /// Re-runs of an unsettled step (warm-up doubled each time).
    pub max_lengthenings: u32,
    /// Start here instead of the estimate from the reference run (model req/s).
    pub start_rps: Option<f64>,
    /// Base warm-up of a step, wall s.
    pub warmup_s: f64,
    /// Base measured window of a step, wall s (lengthened for the drift check's minimum).
    pub measure_s: f64,
    /// The engine-lateness bound as a share of the ITL floor in model time (the cells' rule,
    /// `calibration::lateness_bound`) a step must keep to count as settled.
    pub lateness_share_of_itl_floor: f64,
}

impl CapacitySettings {
    /// The defaults: `--quick` searches coarser (×2 steps, 15% resolution, one re-run) with the
    /// quick cells' window (5 + 8 s), to stay within a few minutes; the full search steps ×1.5
    /// to 5%, with two re-runs and the full cells' window (20 + 40 s).
    pub fn defaults(quick: bool) -> CapacitySettings {
        CapacitySettings {
            policies: DEFAULT_POLICIES.iter().map(|p| p.to_string()).collect(),
            step_factor: if quick { 2.0 } else { 1.5 },
            resolution: if quick { 0.15 } else { 0.05 },
            max_coarse_steps: 6,
            max_lengthenings: if quick { 1 } else { 2 },
            start_rps: None,
            warmup_s: grid::default_warmup_s(quick),
            measure_s: grid::default_measure_s(quick),
            lateness_share_of_itl_floor: crate::calibration::LATENESS_SHARE_OF_ITL_FLOOR,
        }
    }
}

/// The search's start: the throughput of the calibration's reference run (requests sent in its
/// measured window ÷ the window, in model time) — a load the fleet has just served in closed loop;
/// without a reference run, what the replicas serve one request at a time by their floors.
pub fn start_estimate(cal: &Calibration, speed: f64, output_tokens: u32) -> Result<(f64, String)> {
    if let Some(dir) = &cal.reference_run
        && let Ok(analysis::load::RepLoad::Complete(rep)) =
            analysis::load::load_rep(dir, "reference", "prefix-affinity", 1)
    {
        let n = analysis::metrics::measured_requests(&rep, &rep.meta.slo).len();
        let rate = n as f64 / rep.meta.window.measured_s() / speed;
        if rate > 0.0 {
            return Ok((
                round_rate(rate),
                format!(
                    "the reference run's throughput: {n} requests in its {:.1} s measured window at speed {speed}",
                    rep.meta.window.measured_s()
                ),
            ));
        }
    }
    let f = cal.floors;
    let service_model_s = (f.ttft_ms + f64::from(output_tokens) * f.itl_ms) / 1e3 * speed;
    if !(service_model_s.is_finite() && service_model_s > 0.0) {
        bail!("the calibration has no floors to estimate a start rate from");
    }
    let replicas = cal.used_replicas.len().max(1);
    Ok((
        round_rate(replicas as f64 / service_model_s),
        format!(
            "{replicas} replicas each serving one request at a time at the floors (TTFT {:.1} ms + {output_tokens} × ITL {:.2} ms, wall)",
            f.ttft_ms, f.itl_ms
        ),
    ))
}

/// The reference point's workload, as the calibration's reference run sends it: working set 1×
/// the fleet's KV capacity, skew 0, the workload defaults.
pub fn reference_spec(seed: u64, capacity_tokens: u64) -> WorkloadSpec {
    // The sweeps' default workload (shared group prefixes), as the reference run's.
    let shape = grid::WorkloadShape::DEFAULT;
    WorkloadSpec {
        seed,
        sizing: Sizing::WorkingSet {
            capacity_tokens,
            ratio: 1.0,
        },
        prefix_tokens: shape.context_tokens(),
        prefix_groups: shape.prefix_groups,
        sharing: shape.sharing,
        ..WorkloadSpec::default()
    }
}

/// The step's point name: `ws1-s0-rate<r>`, `-long<k>` for its k-th re-run.
pub fn step_point(rate_rps: f64, lengthening: u32) -> String {
    step_point_of(REFERENCE_POINT, rate_rps, lengthening)
}

/// The step's point name for a search at grid point `base`: `<base>-rate<r>[-long<k>]`.
pub fn step_point_of(base: &str, rate_rps: f64, lengthening: u32) -> String {
    if lengthening == 0 {
        format!("{base}-rate{rate_rps}")
    } else {
        format!("{base}-rate{rate_rps}-long{lengthening}")
    }
}

/// The step's warm-up (wall s): the base doubled per re-run.
pub fn step_warmup_s(base_warmup_s: f64, lengthening: u32) -> f64 {
    base_warmup_s * 2f64.powi(lengthening as i32)
}

/// A capacity step's per-request timeout, wall s: 4 × the longest a request meeting the SLO can
/// take (TTFT bound + output tokens × ITL bound), at least 10 s. A request still running then has
/// missed its SLO anyway; waiting the sweep's 60 s for it would only make an overloaded step drain
/// for a minute.
pub fn step_timeout_s(slo: &schema::Slo, output_tokens: u32) -> f64 {
    (4.0 * (slo.ttft_ms + f64::from(output_tokens) * slo.itl_ms) / 1e3).max(10.0)
}

/// The live capacity search of the calibration: on the replicas the calibration uses, each step
/// one open-loop cell of the reference point's workload through the router
/// (`<work>/capacity/<step>/<policy>/rep-1/`, a repetition directory like a sweep's), judged by
/// [`step_from_rep`]; then [`search`] ([`search_live`] on the reference workload from
/// [`start_estimate`]). Prints one line per step on stderr.
pub fn find_live(
    s: &CalibrateSettings,
    c: &CapacitySettings,
    bins: &Bins,
    cal: &Calibration,
    work: &Path,
    should_stop: &dyn Fn() -> bool,
) -> Result<Capacity> {
    // Unknown names are refused before anything runs.
    grid::policies(&c.policies, false)?;
    s.fleet.check_policies(&c.policies)?;
    let speed = s.fleet.effective_speed();
    let spec = reference_spec(s.seed, cal.capacity_tokens);
    let (estimate, estimate_rule) = start_estimate(cal, speed, spec.output_tokens)?;
    let (start_rps, start_rule) = match c.start_rps {
        Some(r) => (r, "given (--capacity-start-rps)".to_string()),
        None => (estimate, estimate_rule),
    };
    let search = SearchConfig {
        start_rps,
        start_rule,
        step_factor: c.step_factor,
        resolution: c.resolution,
        max_coarse_steps: c.max_coarse_steps,
        widen_after: None,
        max_lengthenings: c.max_lengthenings,
        policies: c.policies.clone(),
        open_start: cal.open_start(),
    };
    search_live(
        &LiveSearch {
            fleet: &s.fleet,
            bins,
            cal,
            spec: &spec,
            search,
            warmup_s: c.warmup_s,
            measure_s: c.measure_s,
            min_window_requests: 0,
            lateness_share_of_itl_floor: c.lateness_share_of_itl_floor,
            seed: s.seed,
            point: REFERENCE_POINT,
            sweep: "calibration-capacity",
            git_rev: s.git_rev.clone(),
            versions: s.versions.clone(),
            work,
        },
        should_stop,
    )
}

/// The reference point's name, the prefix of the calibration's capacity steps.
pub const REFERENCE_POINT: &str = "ws1-s0";

/// One live capacity search: a workload searched on a fleet, judged by a calibration (its SLO,
/// routing values, evidence bounds and the primes' pace). The calibration's own search
/// ([`find_live`]) and each policy's own live search (`crate::policy_capacity::run_live`) are
/// this.
#[derive(Debug, Clone)]
pub struct LiveSearch<'a> {
    /// The fleet; its replicas in use are the calibration's.
    pub fleet: &'a crate::fleet_spec::FleetSpec,
    /// The release binaries.
    pub bins: &'a Bins,
    /// The calibration every step is judged by.
    pub cal: &'a Calibration,
    /// The workload searched.
    pub spec: &'a WorkloadSpec,
    /// The search: start, steps, resolution, the policies whose best decides, the open start.
    pub search: SearchConfig,
    /// Base warm-up of a step, wall s, after the primes (doubled per re-run).
    pub warmup_s: f64,
    /// Base measured window of a step, wall s.
    pub measure_s: f64,
    /// Each step's window is sized for at least this many requests (and the drift check's
    /// minimum), × [`WINDOW_REQUEST_MARGIN`] through [`window_for_requests`].
    pub min_window_requests: usize,
    /// The engine-lateness bound as a share of the ITL floor (the cells' rule).
    pub lateness_share_of_itl_floor: f64,
    /// The router's seed.
    pub seed: u64,
    /// The steps are named `<point>-rate<r>[-long<k>]`.
    pub point: &'a str,
    /// The `sweep` each step's `meta.json` names.
    pub sweep: &'a str,
    /// Git revision recorded in each step's `meta.json`.
    pub git_rev: Option<String>,
    /// Tool versions recorded beside it.
    pub versions: serde_json::Value,
    /// The steps go to `<work>/capacity/` (cleared first: a search measures afresh), the fleet's
    /// logs to `<work>/logs/`.
    pub work: &'a Path,
}

/// Runs [`LiveSearch`]: each step primes the caches, warms up ([`steady_step_warmup_s`], the
/// virtual search's rule) and measures one open-loop cell through the router on a fleet started
/// afresh, judged by [`step_from_rep`] with the evidence gate; then [`search`]. Prints one line
/// per step on stderr.
pub fn search_live(run: &LiveSearch<'_>, should_stop: &dyn Fn() -> bool) -> Result<Capacity> {
    let started = Instant::now();
    let LiveSearch {
        fleet: fleet_spec,
        bins,
        cal,
        spec,
        search: cfg,
        ..
    } = run;
    grid::policies(&cfg.policies, false)?;
    fleet_spec.check_policies(&cfg.policies)?;
    let speed = fleet_spec.effective_speed();
    let routing = cal.routing()?;
    let cell_bounds = bounds(cal, fleet_spec.kind, speed, run.lateness_share_of_itl_floor);
    let kv_events = cfg.policies.iter().any(|p| grid::needs_kv_events(p));
    let source = fleet_spec.source(&bins.engine, kv_events, Some(&cal.used_replicas))?;
    let sweep_dir = run.work.join("capacity");
    // A search measures afresh: the steps of a search being replaced are not evidence.
    cell::clear(&sweep_dir)?;
    let mut fleet = Fleet::new(source, fleet_spec.options(&run.work.join("logs")))?;
    eprintln!(
        "capacity search of {} over [{}] from {} req/s (model time; {}), steps ×{}, resolution {:.0}%",
        run.point,
        cfg.policies.join(", "),
        cfg.start_rps,
        cfg.start_rule,
        cfg.step_factor,
        cfg.resolution * 100.0
    );
    let min_requests = analysis::DriftConfig::default()
        .min_requests
        .max(run.min_window_requests);
    let timeout_s = step_timeout_s(&cal.slo, spec.output_tokens);
    let mut workload_name = String::new();
    let mut steps = 0u32;
    let mut measure = |step: &StepRequest| -> Result<StepMeasurement> {
        if should_stop() {
            bail!("interrupted");
        }
        let wall_rate = step.rate_rps * speed;
        let measure_s = run
            .measure_s
            .max(window_for_requests(wall_rate, min_requests));
        // The primes (the same at every rate: they depend on the workload and the pace), then
        // the base warm-up doubled per re-run, and as long as the window still holds cold
        // resumes.
        let warmup_s = steady_step_warmup_s(
            spec,
            wall_rate,
            cfg.open_start,
            step_warmup_s(run.warmup_s, step.lengthening),
            measure_s,
        )?;
        let run_s = warmup_s + measure_s;
        let point = step_point_of(run.point, step.rate_rps, step.lengthening);
        let arrival = ArrivalSpec::Open {
            rate_rps: wall_rate,
            duration_s: run_s,
            start: cfg.open_start,
        };
        let plan = ensure_plan(&sweep_dir.join(&point), spec, &arrival)?;
        workload_name = plan.workload_name.clone();
        let dir = cell::rep_dir(&sweep_dir, &point, &step.policy, 1);
        // The calibration's routing, as every sweep cell gets it.
        let router = routing.router_settings(&step.policy, &fleet_spec.model, run.seed);
        let driver = DriverSettings {
            mode: "open",
            warmup_s,
            duration_s: Some(run_s),
            timeout_s,
            model: fleet_spec.model.clone(),
            // A turn still queued past the TTFT bound after the step's end has missed already.
            abandon_after_ms: Some(cal.slo.ttft_ms),
            // Through the router or HAProxy, which keep connections alive.
            keep_alive: true,
        };
        let attempt = |fleet: &mut Fleet| {
            cell::clear(&dir)?;
            run_attempt(
                fleet,
                Attempt {
                    bins,
                    dir: &dir,
                    plan: &plan,
                    router: router.clone(),
                    driver: driver.clone(),
                    closed_users: None,
                    planned_end_s: run_s,
                    slo: cal.slo,
                    evidence: EvidenceConfig {
                        lateness_urls: vec![],
                        fleet_process_groups: vec![],
                        check_foreign: !matches!(fleet_spec.kind, FleetKind::Static),
                        gpu: true,
                        interval: Duration::from_secs(1),
                        fleet_gpus: Default::default(),
                    },
                    sample_lateness: matches!(fleet_spec.kind, FleetKind::Emulated),
                    ingress: fleet::Ingress::Router,
                    haproxy: fleet::ingress::HaproxySettings::default(),
                    limit: Duration::from_secs_f64(run_s * 3.0 + 90.0),
                },
                should_stop,
            )
        };
        // A failed attempt (a process that did not start) is retried once, as a sweep cell is.
        let result = match attempt(&mut fleet) {
            Ok(r) => r,
            Err(e) if should_stop() => return Err(e.context("interrupted")),
            Err(e) => {
                eprintln!(
                    "capacity step {point} {}: {e:#}; retrying once",
                    step.policy
                );
                attempt(&mut fleet)?
            }
        };
        let mut result = result;
        let client = analysis::read_client_csv(&dir.join("client.csv"))
            .map_err(|e| anyhow!("capacity step rows in {}: {e}", dir.display()))?;
        let evidence_failed = crate::gate::check_evidence(
            &mut result.evidence,
            &cell_bounds.evidence(),
            &client,
            &cal.slo,
            &result.window,
        )
        .err();
        drop(client);
        let meta = Meta {
            sweep: run.sweep.into(),
            point: point.clone(),
            policy: step.policy.clone(),
            rep: 1,
            workload_name: plan.workload_name.clone(),
            workload_fingerprint: plan.workload_fingerprint.clone(),
            plan_fingerprint: plan.plan_fingerprint.clone(),
            fleet: serde_json::json!({"source": fleet_spec.key().source, "engine": fleet_spec.engine(), "engine_flags": fleet_spec.engine_flags(), "replicas": cal.used_replicas.len(), "speed": speed, "capacity_tokens": cal.capacity_tokens}),
            slo: cal.slo,
            window: result.window,
            git_rev: run.git_rev.clone(),
            versions: run.versions.clone(),
            virtual_time: false,
            complete: true,
            accepted: true,
            set_aside_reason: None,
            attempts: 1,
            evidence: Some(result.evidence.clone().into()),
            drift: None,
            run: serde_json::from_value(serde_json::json!({
                "offered_rps": step.rate_rps,
                "offered_wall_rps": wall_rate,
                "lengthening": step.lengthening,
                "router": router,
                "driver": driver,
            }))?,
        };
        cell::write_meta(&dir, &meta)?;
        let m = step_from_rep(&dir, speed, warmup_s, measure_s, evidence_failed)?;
        steps += 1;
        eprintln!(
            "  capacity step {steps}: {} req/s, {}{}: attainment {}, goodput {:.2} req/s over {} requests{} — {} elapsed",
            step.rate_rps,
            step.policy,
            if step.lengthening > 0 {
                format!(" (warm-up {warmup_s} s)")
            } else {
                String::new()
            },
            m.attainment
                .map_or_else(|| "none".into(), |a| format!("{:.1}%", a * 100.0)),
            m.goodput_rps,
            m.measured_requests,
            m.unsettled_reason
                .as_ref()
                .map_or_else(String::new, |w| format!(", unsettled ({w})")),
            fmt_duration(started.elapsed()),
        );
        Ok(m)
    };
    let result = search(cfg, &mut measure);
    fleet.stop();
    let mut cap = result?;
    cap.workload = workload_name;
    cap.search_wall_s = started.elapsed().as_secs_f64();
    eprintln!(
        "  capacity {} req/s (model time; {} met the SLO on ≥ {:.0}%; {} req/s did not) after {} steps in {}",
        cap.rate_rps,
        cap.best_policy,
        cap.target * 100.0,
        cap.failing_rps,
        cap.curve.len(),
        fmt_duration(started.elapsed())
    );
    Ok(cap)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake fleet: attainment of `policy` at `rate` from a curve, settled unless `unsettled`
    /// says otherwise for that (rate, policy, lengthening).
    struct Fake<A, U> {
        attainment: A,
        unsettled: U,
        /// Whether the drift check calls a step at this rate overloaded (and so unsettled).
        overloaded: fn(f64) -> bool,
        calls: Vec<StepRequest>,
    }

    impl<A: Fn(f64, &str) -> f64, U: Fn(&StepRequest) -> bool> Fake<A, U> {
        fn measure(&mut self, step: &StepRequest) -> Result<StepMeasurement> {
            self.calls.push(step.clone());
            let a = (self.attainment)(step.rate_rps, &step.policy);
            let overloaded = (self.overloaded)(step.rate_rps);
            let unsettled = overloaded || (self.unsettled)(step);
            Ok(StepMeasurement {
                attainment: Some(a),
                goodput_rps: a * step.rate_rps,
                measured_requests: 100,
                settled: !unsettled,
                unsettled_reason: if overloaded {
                    Some("overloaded: the backlog grows".to_string())
                } else {
                    unsettled.then(|| "warming: TTFT trends up".to_string())
                },
                overloaded,
                worsening: false,
                improving: false,
                warmup_s: step_warmup_s(5.0, step.lengthening),
                measure_s: 8.0,
                inflow_tokens_per_s: None,
                dir: None,
            })
        }
    }

    fn config(start: f64) -> SearchConfig {
        SearchConfig {
            start_rps: start,
            start_rule: "test".into(),
            step_factor: 2.0,
            resolution: 0.1,
            max_coarse_steps: 6,
            widen_after: None,
            max_lengthenings: 1,
            policies: vec!["session-affinity".into(), "prefix-affinity".into()],
            open_start: workload::OpenStart::Stationary,
        }
    }

    /// Monotone: full attainment up to `knee`, then falling fast.
    fn monotone(knee: f64) -> impl Fn(f64) -> f64 {
        move |r| {
            if r <= knee {
                0.99
            } else {
                (0.99 - (r - knee) / knee * 2.0).max(0.0)
            }
        }
    }

    /// Where [`monotone`]`(knee)` crosses the target: 0.99 − 2(r − knee)/knee = 0.9.
    fn crossing(knee: f64) -> f64 {
        knee * (1.0 + (0.99 - ATTAINMENT_TARGET) / 2.0)
    }

    fn run<A: Fn(f64, &str) -> f64, U: Fn(&StepRequest) -> bool>(
        cfg: &SearchConfig,
        fake: &mut Fake<A, U>,
    ) -> Result<Capacity> {
        search(cfg, &mut |s| fake.measure(s))
    }

    #[test]
    fn a_monotone_curve_is_bracketed_then_bisected_to_the_resolution() {
        // prefix-affinity holds to 10 req/s, session-affinity to 6: the best decides.
        let pa = monotone(10.0);
        let sa = monotone(6.0);
        let mut fake = Fake {
            attainment: |r: f64, p: &str| if p == "prefix-affinity" { pa(r) } else { sa(r) },
            unsettled: |_: &StepRequest| false,
            overloaded: |_| false,
            calls: vec![],
        };
        let cap = run(&config(2.0), &mut fake).unwrap();
        // 2, 4, 8 meet; 16 fails; bisection between 8 and 16.
        assert!(cap.rate_rps <= crossing(10.0), "{}", cap.rate_rps);
        assert!(cap.failing_rps > crossing(10.0));
        assert!(cap.failing_rps <= cap.rate_rps * 1.1 + 1e-9);
        // The curve at the capacity: prefix-affinity met the target there.
        assert_eq!(cap.best_policy, "prefix-affinity");
        assert_eq!(cap.target, ATTAINMENT_TARGET);
        let at_cap: Vec<&CurvePoint> = cap
            .curve
            .iter()
            .filter(|p| p.rate_rps == cap.rate_rps && p.meets_target)
            .collect();
        assert_eq!(at_cap.len(), 1);
        // Every failing rate was measured for both policies; a meeting rate stops at the first
        // policy that meets (the last one that met goes first).
        let at_fail: Vec<&str> = cap
            .curve
            .iter()
            .filter(|p| p.rate_rps == cap.failing_rps)
            .map(|p| p.policy.as_str())
            .collect();
        assert_eq!(at_fail.len(), 2);
        assert!(cap.curve.iter().any(|p| p.phase == "coarse"));
        assert!(cap.curve.iter().any(|p| p.phase == "bisect"));
        assert!(
            cap.rule.contains("90%") && cap.rule.contains("×2"),
            "{}",
            cap.rule
        );
        assert_eq!(fake.calls.len(), cap.curve.len());
    }

    #[test]
    fn a_start_above_capacity_steps_down() {
        let a = monotone(3.0);
        let mut fake = Fake {
            attainment: |r: f64, _: &str| a(r),
            unsettled: |_: &StepRequest| false,
            overloaded: |_| false,
            calls: vec![],
        };
        let cap = run(&config(20.0), &mut fake).unwrap();
        // 20, 10, 5 fail; 2.5 meets; then bisection in [2.5, 5].
        assert!(
            cap.rate_rps >= 2.5 && cap.rate_rps <= crossing(3.0),
            "{}",
            cap.rate_rps
        );
        assert!(cap.failing_rps > crossing(3.0));
        assert!(cap.failing_rps <= cap.rate_rps * 1.1 + 1e-9);
        assert_eq!(cap.curve[0].rate_rps, 20.0);
    }

    #[test]
    fn an_unsettled_step_is_lengthened_and_one_that_never_settles_does_not_count() {
        // The first run at every rate drifts; re-run with a doubled warm-up it settles.
        let a = monotone(8.0);
        let mut fake = Fake {
            attainment: |r: f64, _: &str| a(r),
            unsettled: |s: &StepRequest| s.lengthening == 0,
            overloaded: |_| false,
            calls: vec![],
        };
        let cap = run(&config(2.0), &mut fake).unwrap();
        assert!(cap.rate_rps <= crossing(8.0) && cap.failing_rps > crossing(8.0));
        assert!(cap.failing_rps <= cap.rate_rps * 1.1 + 1e-9);
        let first = &cap.curve[0];
        assert!(!first.step.settled && !first.meets_target && first.step.warmup_s == 5.0);
        assert_eq!(
            first.step.attainment,
            Some(0.99),
            "measured, yet not counted"
        );
        let second = &cap.curve[1];
        assert!(second.step.settled && second.meets_target);
        assert_eq!((second.lengthening, second.step.warmup_s), (1, 10.0));

        // A rate whose steps never settle (still warming after every lengthening) counts as
        // not meeting, even with an attainment above the target.
        let mut fake = Fake {
            attainment: |_: f64, _: &str| 0.95,
            unsettled: |s: &StepRequest| s.rate_rps > 5.0,
            overloaded: |_| false,
            calls: vec![],
        };
        let cap = run(&config(2.0), &mut fake).unwrap();
        assert!(cap.rate_rps <= 5.0, "{}", cap.rate_rps);
        assert!(cap.failing_rps > 5.0);
        let unsettled: Vec<&CurvePoint> = cap.curve.iter().filter(|p| !p.step.settled).collect();
        assert!(!unsettled.is_empty());
        assert!(unsettled.iter().all(|p| !p.meets_target));
        // Each policy at a never-settling rate ran 1 + max_lengthenings times.
        let at_8 = cap.curve.iter().filter(|p| p.rate_rps == 8.0).count();
        assert_eq!(at_8, 4);
    }

    #[test]
    fn an_overloaded_step_does_not_meet_and_is_not_re_run() {
        // Above 6 req/s the backlog grows through every window: the drift check calls the step
        // overloaded. It does not meet, whatever its attainment, and a longer warm-up would not
        // settle it, so each policy runs once there (a warming step runs 1 + max_lengthenings).
        let mut fake = Fake {
            attainment: |_: f64, _: &str| 0.97,
            unsettled: |_: &StepRequest| false,
            overloaded: |r| r > 6.0,
            calls: vec![],
        };
        let cap = run(&config(2.0), &mut fake).unwrap();
        assert!(cap.rate_rps <= 6.0 && cap.failing_rps > 6.0, "{cap:?}");
        let failing: Vec<&CurvePoint> = cap
            .curve
            .iter()
            .filter(|p| p.rate_rps == cap.failing_rps)
            .collect();
        assert_eq!(failing.len(), 2, "one run per policy: {failing:?}");
        assert!(
            failing
                .iter()
                .all(|p| p.step.overloaded && !p.step.settled && !p.meets_target)
        );
        assert!(failing.iter().all(|p| p.lengthening == 0));
        assert!(cap.rule.contains("scheduled time"), "{}", cap.rule);
        assert!(cap.rule.contains("overloaded"), "{}", cap.rule);
    }

    #[test]
    fn a_worsening_step_does_not_meet_and_is_not_re_run_as_warming() {
        // Above 3 req/s every step meets 97% but its TTFT rises through the window with no queue
        // growing: worsening. It does not meet, and each policy runs it once (a warming step
        // would run 1 + max_lengthenings times).
        let mut measure = |step: &StepRequest| -> Result<StepMeasurement> {
            let worsening = step.rate_rps > 3.0;
            Ok(StepMeasurement {
                attainment: Some(0.97),
                goodput_rps: 0.97 * step.rate_rps,
                measured_requests: 100,
                settled: !worsening,
                unsettled_reason: worsening
                    .then(|| "worsening (no queue grows): TTFT trends up".to_string()),
                overloaded: false,
                worsening,
                improving: false,
                warmup_s: step_warmup_s(5.0, step.lengthening),
                measure_s: 8.0,
                inflow_tokens_per_s: None,
                dir: None,
            })
        };
        let cap = search(&config(1.0), &mut measure).unwrap();
        assert!(cap.rate_rps <= 3.0 && cap.failing_rps > 3.0, "{cap:?}");
        let worsening: Vec<&CurvePoint> = cap.curve.iter().filter(|p| p.step.worsening).collect();
        assert!(!worsening.is_empty());
        assert!(
            worsening
                .iter()
                .all(|p| p.lengthening == 0 && !p.meets_target),
            "{worsening:?}"
        );
        assert!(
            cap.rule.contains("only an improving trend is warming"),
            "{}",
            cap.rule
        );
    }

    #[test]
    fn a_noisy_curve_still_ends_bracketed() {
        // Attainment wobbles ±3 points around a falling curve (seeded by the rate itself), so
        // the curve is not monotone near the knee; the search still returns a meeting rate with
        // a failing one within the resolution above it.
        let base = monotone(7.0);
        let noise = |r: f64| {
            (((r * 1000.0).round() as u64).wrapping_mul(2654435761) % 61) as f64 / 1000.0 - 0.03
        };
        let mut fake = Fake {
            attainment: |r: f64, _: &str| (base(r) + noise(r)).clamp(0.0, 1.0),
            unsettled: |_: &StepRequest| false,
            overloaded: |_| false,
            calls: vec![],
        };
        let cap = run(&config(1.0), &mut fake).unwrap();
        let meets = |r: f64| cap.curve.iter().any(|p| p.rate_rps == r && p.meets_target);
        assert!(meets(cap.rate_rps));
        assert!(!meets(cap.failing_rps));
        assert!(cap.failing_rps <= cap.rate_rps * 1.1 + 1e-9);
        assert!((6.0..=7.5).contains(&cap.rate_rps), "{}", cap.rate_rps);
    }

    #[test]
    fn a_step_still_warming_towards_better_meets_when_it_already_meets_the_target() {
        // Every step at or below 4 req/s meets 95% but is unsettled by a warming trend.
        let measure = |improving: bool| {
            move |step: &StepRequest| -> Result<StepMeasurement> {
                let a = if step.rate_rps <= 4.0 { 0.95 } else { 0.5 };
                Ok(StepMeasurement {
                    attainment: Some(a),
                    goodput_rps: a * step.rate_rps,
                    measured_requests: 100,
                    settled: false,
                    unsettled_reason: Some("warming: TTFT trends down".into()),
                    overloaded: false,
                    worsening: false,
                    improving,
                    warmup_s: step_warmup_s(5.0, step.lengthening),
                    measure_s: 8.0,
                    inflow_tokens_per_s: None,
                    dir: None,
                })
            }
        };
        // Improving (TTFT falling): settling only raises attainment, so 95% meets.
        let c = search(&config(1.0), &mut measure(true)).unwrap();
        assert!(
            c.rate_rps >= 4.0 / 1.1 && c.rate_rps <= 4.0,
            "{}",
            c.rate_rps
        );
        assert!(c.rule.contains("improves the SLO's outcome"), "{}", c.rule);
        // Not improving (TTFT rising, say): unsettled never meets, at any rate.
        let err = search(&config(1.0), &mut measure(false)).unwrap_err();
        assert!(err.downcast_ref::<Unbracketed>().is_some(), "{err}");
        assert!(!err.to_string().contains("not load"), "{err}");
    }

    #[test]
    fn a_widening_search_brackets_a_capacity_far_below_its_start() {
        // ×1.1 steps from 10 req/s with the capacity at 2.5: six plain steps reach only
        // 10 ÷ 1.77 = 5.64 and find no bracket; widened after three they reach 10 ÷ 5.05.
        let mut cfg = config(10.0);
        cfg.step_factor = 1.1;
        cfg.resolution = 0.05;
        let fake = || Fake {
            attainment: |r: f64, _: &str| monotone(2.5)(r),
            unsettled: |_: &StepRequest| false,
            overloaded: |r| r > 2.5,
            calls: vec![],
        };
        let err = run(&cfg, &mut fake()).unwrap_err();
        assert!(err.downcast_ref::<Unbracketed>().is_some(), "{err}");
        assert!(
            err.to_string().contains("6 coarse steps of ÷1.1 from 10"),
            "{err}"
        );
        cfg.widen_after = Some(3);
        assert!(
            (cfg.coarse_span() - 5.05).abs() < 0.01,
            "{}",
            cfg.coarse_span()
        );
        let factors: Vec<f64> = (0..6)
            .map(|k| (cfg.coarse_factor(k) * 100.0).round() / 100.0)
            .collect();
        assert_eq!(factors, [1.1, 1.1, 1.1, 1.21, 1.46, 2.14]);
        let c = run(&cfg, &mut fake()).unwrap();
        assert!(
            c.rate_rps <= 2.5 && c.rate_rps >= 2.5 / 1.05,
            "{}",
            c.rate_rps
        );
    }

    #[test]
    fn a_fleet_that_fails_even_at_the_lowest_rate_is_a_clear_error() {
        let mut fake = Fake {
            attainment: |_: f64, _: &str| 0.4,
            unsettled: |_: &StepRequest| false,
            overloaded: |_| false,
            calls: vec![],
        };
        let err = run(&config(8.0), &mut fake).unwrap_err();
        let unbracketed = err
            .downcast_ref::<Unbracketed>()
            .expect("a search without a bracket is typed")
            .clone();
        let err = err.to_string();
        assert!(
            err.contains("fails its SLO even at the lowest rate"),
            "{err}"
        );
        assert!(err.contains("0.125 req/s"), "{err}");
        assert!(err.contains("prefix-affinity attainment 40.0%"), "{err}");
        // Every step there settled with no growing backlog: the misses are not load, and the
        // error says so in the workload's terms instead of suspecting the machine.
        assert!(err.contains("the misses are not load"), "{err}");
        assert!(!err.contains("throttled"), "{err}");
        assert!(
            unbracketed
                .summary
                .starts_with("met the SLO at no rate tried, down to 0.125 req/s"),
            "{}",
            unbracketed.summary
        );
        assert!(unbracketed.summary.ends_with(": not load"));
        // Overloaded at every rate: load, so no such claim.
        let mut fake = Fake {
            attainment: |_: f64, _: &str| 0.4,
            unsettled: |_: &StepRequest| false,
            overloaded: |_| true,
            calls: vec![],
        };
        let err = run(&config(8.0), &mut fake).unwrap_err().to_string();
        assert!(!err.contains("not load"), "{err}");
        // 1 + 6 rates, both policies each.
        assert_eq!(fake.calls.len(), 14);
        // A fleet that meets everywhere has no capacity within reach: a bound is not a value.
        let mut fake = Fake {
            attainment: |_: f64, _: &str| 1.0,
            unsettled: |_: &StepRequest| false,
            overloaded: |_| false,
            calls: vec![],
        };
        let err = run(&config(1.0), &mut fake).unwrap_err().to_string();
        assert!(err.contains("every rate tried, up to 64 req/s"), "{err}");
        // Bad settings are refused before anything runs.
        let mut bad = config(1.0);
        bad.step_factor = 1.0;
        assert!(run(&bad, &mut fake).is_err());
        bad = config(0.0);
        assert!(run(&bad, &mut fake).is_err());
    }

    fn capacity_with(curve: Vec<(f64, f64, bool)>) -> Capacity {
        Capacity {
            rate_rps: 8.0,
            rule: String::new(),
            target: ATTAINMENT_TARGET,
            resolution: 0.1,
            failing_rps: 8.8,
            best_policy: "prefix-affinity".into(),
            policies: vec!["prefix-affinity".into()],
            search: config(2.0),
            workload: String::new(),
            open_start: workload::OpenStart::Stationary,
            search_wall_s: 0.0,
            curve: curve
                .into_iter()
                .map(|(rate_rps, warmup_s, settled)| CurvePoint {
                    rate_rps,
                    policy: "prefix-affinity".into(),
                    phase: "coarse".into(),
                    lengthening: 0,
                    step: StepMeasurement {
                        attainment: Some(0.95),
                        goodput_rps: rate_rps,
                        measured_requests: 100,
                        settled,
                        unsettled_reason: None,
                        overloaded: false,
                        worsening: false,
                        improving: false,
                        warmup_s,
                        measure_s: 8.0,
                        inflow_tokens_per_s: None,
                        dir: None,
                    },
                    meets_target: settled,
                })
                .collect(),
        }
    }

    #[test]
    fn the_warm_up_comes_from_the_settling_time_at_the_nearest_rate_at_or_above() {
        // Settled at 4 (5 s), 8 (10 s after a re-run: the 5 s run is unsettled), 12 (20 s).
        let cap = capacity_with(vec![
            (4.0, 5.0, true),
            (8.0, 5.0, false),
            (8.0, 10.0, true),
            (12.0, 20.0, true),
            (16.0, 5.0, false),
            (16.0, 10.0, false),
        ]);
        let w = cell_window(&cap, 5.6, 6.0, 0.0, None, 8.0, 20).unwrap();
        assert_eq!(w.settled_at_rps, Some(8.0));
        assert_eq!(w.warmup_s, 15.0);
        assert!(w.rule.contains("1.5 × the 10.0 s after them"), "{}", w.rule);
        // Primes are not scaled by the margin: 4 s of primes in a settled 10 s → 4 + 1.5 × 6.
        let primed = cell_window(&cap, 5.6, 6.0, 4.0, None, 8.0, 20).unwrap();
        assert_eq!(primed.warmup_s, 13.0);
        assert!(
            primed.rule.contains("the primes' 4.0 s + 1.5 × the 6.0 s"),
            "{}",
            primed.rule
        );
        let w = cell_window(&cap, 8.0, 6.0, 0.0, None, 8.0, 20).unwrap();
        assert_eq!((w.settled_at_rps, w.warmup_s), (Some(8.0), 15.0));
        let w = cell_window(&cap, 2.0, 6.0, 0.0, None, 8.0, 20).unwrap();
        assert_eq!((w.settled_at_rps, w.warmup_s), (Some(4.0), 7.5));
        // Above every settled rate: the highest settled one, said to be an extrapolation.
        let w = cell_window(&cap, 13.0, 6.0, 0.0, None, 8.0, 20).unwrap();
        assert_eq!((w.settled_at_rps, w.warmup_s), (Some(12.0), 30.0));
        assert!(w.rule.contains("extrapolated"), "{}", w.rule);
        // The measured window holds 2 × 20 requests: at 0.5 req/s × speed 2 = 1 req/s wall,
        // 40 s; at a high rate the given 8 s.
        let w = cell_window(&cap, 0.5, 2.0, 0.0, None, 8.0, 20).unwrap();
        assert_eq!(w.measure_s, 40.0);
        assert!(w.rule.contains("lengthened from 8 s"), "{}", w.rule);
        assert_eq!(
            cell_window(&cap, 8.0, 6.0, 0.0, None, 8.0, 20)
                .unwrap()
                .measure_s,
            8.0
        );
        // --warmup-s replaces the derivation (and says so).
        let w = cell_window(&cap, 8.0, 6.0, 0.0, Some(3.0), 8.0, 20).unwrap();
        assert_eq!((w.warmup_s, w.settled_at_rps), (3.0, None));
        assert!(w.rule.contains("--warmup-s"));
        assert_eq!(w.run_s(), 11.0);
        // Nothing settled: refused.
        let none = capacity_with(vec![(4.0, 5.0, false)]);
        assert!(cell_window(&none, 4.0, 6.0, 0.0, None, 8.0, 20).is_err());
    }

    #[test]
    fn rates_and_step_names_round_to_the_resolution() {
        assert_eq!(round_rate(2.0 * 3.3333333), 6.667);
        assert_eq!(round_rate(1.5 * 18.809), 28.214);
        assert_eq!(step_point(6.667, 0), "ws1-s0-rate6.667");
        assert_eq!(step_point(6.667, 2), "ws1-s0-rate6.667-long2");
        assert_eq!(step_warmup_s(5.0, 2), 20.0);
        let slo = schema::Slo {
            ttft_ms: 1000.0,
            itl_ms: 20.0,
        };
        assert_eq!(step_timeout_s(&slo, 100), 12.0);
        assert_eq!(step_timeout_s(&schema::Slo::default(), 1), 10.0);
        let q = CapacitySettings::defaults(true);
        assert_eq!(
            (q.step_factor, q.resolution, q.max_lengthenings),
            (2.0, 0.15, 1)
        );
        assert_eq!(q.policies, DEFAULT_POLICIES);
        assert_eq!((q.warmup_s, q.measure_s), (5.0, 8.0));
    }
}
