//! The sweep report: per point, per policy, the median of repetitions with its range, margins and
//! verdicts, winner and runner-up, mechanism, belief divergence and decay, implied TTL and node
//! cap; across the sweep, router overhead per policy and the adaptive-router test. This is the
//! structure `report.json` serialises (schema in the crate README).

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::compare::{Basis, Margin, Refusal, Verdict, check_comparable, margin};
use crate::drift::{DriftClass, DriftConfig, DriftVerdict, check_rows, recorded_class};
use crate::error::Result;
use crate::load::{IncompleteRep, RepData, SweepData, discover, load_point};
use crate::meta::Slo;
use crate::metrics::{
    Decay, Divergence, Implied, Latency, Mechanism, MetricsConfig, Overhead, OverheadSamples,
    RepMetrics, Request, Split, decay, divergence, implied, measured_requests, rep_metrics,
};
use crate::stats::Spread;
use schema::ATTAINMENT_TARGET;

/// Version of the `report.json` layout; bumped on any incompatible change.
pub const SCHEMA_VERSION: u32 = 1;

/// Policy names in the order tables list them (CONTRACTS.md); unknown names follow, sorted.
pub const POLICY_ORDER: &[&str] = &[
    "round-robin",
    "least-outstanding",
    "session-affinity",
    "session-bounded",
    "prefix-hash",
    "prefix-affinity",
    "prefix-affinity-spill-off",
    "exact-residency",
    "exact-residency-spec",
];

/// The session-affinity baseline.
pub const SESSION_AFFINITY: &str = "session-affinity";
/// The prefix-affinity baseline (and the adaptive-router test's reference).
pub const PREFIX_AFFINITY: &str = "prefix-affinity";

/// A policy's place in [`POLICY_ORDER`] (unknown names after it, by name): the tables' order.
pub fn policy_rank(name: &str) -> (usize, String) {
    (
        POLICY_ORDER
            .iter()
            .position(|p| *p == name)
            .unwrap_or(POLICY_ORDER.len()),
        name.to_string(),
    )
}

/// Knobs of the report.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ReportConfig {
    /// Metric knobs.
    pub metrics: MetricsConfig,
    /// Drift thresholds.
    pub drift: DriftConfig,
}

/// A repetition the sweep set aside, with its reason.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SetAside {
    /// `k` of `rep-<k>`.
    pub rep: u32,
    /// Reason from meta.json.
    pub reason: String,
    /// Its goodput (req/s) and SLO attainment, measured like a used repetition's and never
    /// counted: what the cell's figures leave out, so a reader sees its size. `None` in reports
    /// written before 2 Dec 2026.
    #[serde(default)]
    pub goodput_rps: Option<f64>,
    /// See `goodput_rps`.
    #[serde(default)]
    pub slo_attainment: Option<f64>,
}

/// A used repetition that is overloaded (docs/ARCHITECTURE.md, "Calibration"): its drift is a backlog growing through
/// the window, so it is counted — its goodput and attainment are what the policy delivers at
/// this load — and marked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OverloadedRep {
    /// `k` of `rep-<k>`.
    pub rep: u32,
    /// The sweep's recorded reason, else this report's drift check's.
    pub reason: String,
}

/// The report's own drift check on a used repetition.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RepDrift {
    /// `k` of `rep-<k>`.
    pub rep: u32,
    /// The check's outcome.
    pub verdict: DriftVerdict,
}

/// Median-with-range of each mechanism figure.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MechanismSpread {
    /// Engine prefix-hit rate.
    pub prefix_hit_rate: Option<Spread>,
    /// Prompt tokens computed per request.
    pub new_tokens_per_request: Option<Spread>,
    /// Busiest replica's share of requests.
    pub busiest_share: Option<Spread>,
    /// Spill fire rate.
    pub spill_rate: Option<Spread>,
    /// Replicas per hot conversation.
    pub replicas_per_hot_conversation: Option<Spread>,
}

fn spread_of<T>(reps: &[T], f: impl Fn(&T) -> Option<f64>) -> Option<Spread> {
    let v: Vec<f64> = reps.iter().filter_map(f).collect();
    Spread::of(&v)
}

fn mechanism_spread(ms: &[&Mechanism]) -> MechanismSpread {
    MechanismSpread {
        prefix_hit_rate: spread_of(ms, |m| m.prefix_hit_rate),
        new_tokens_per_request: spread_of(ms, |m| m.new_tokens_per_request),
        busiest_share: spread_of(ms, |m| m.busiest_share),
        spill_rate: spread_of(ms, |m| m.spill_rate),
        replicas_per_hot_conversation: spread_of(ms, |m| m.replicas_per_hot_conversation),
    }
}

/// One policy at one point: its used repetitions summarised.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cell {
    /// Policy name.
    pub policy: String,
    /// Repetitions the figures rest on.
    pub reps_used: Vec<u32>,
    /// Repetitions the sweep set aside (`accepted: false`).
    pub set_aside: Vec<SetAside>,
    /// Used repetitions that are overloaded (recorded so by the sweep, or so classified by this
    /// report's drift check): counted, and marked wherever the cell is shown. Absent when none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overloaded: Vec<OverloadedRep>,
    /// This report's drift check on each used repetition (the sweep's own check decided
    /// `accepted`; a `warming` verdict here on an accepted rep is worth a look).
    pub drift: Vec<RepDrift>,
    /// Goodput, req/s.
    pub goodput_rps: Option<Spread>,
    /// Share of measured requests meeting the SLO.
    pub slo_attainment: Option<Spread>,
    /// TTFT p50, ms.
    pub ttft_p50_ms: Option<Spread>,
    /// SLO attainment of the busiest replica's requests.
    pub busiest_replica_attainment: Option<Spread>,
    /// Share of measured requests that missed the TTFT bound (successful requests only).
    pub missed_ttft_share: Option<Spread>,
    /// Share of measured requests that missed the ITL bound (successful requests only; a
    /// request may miss both bounds).
    pub missed_itl_share: Option<Spread>,
    /// Share of measured requests that failed (error or non-2xx).
    pub error_share: Option<Spread>,
    /// TTFT p90, ms.
    pub ttft_p90_ms: Option<Spread>,
    /// TTFT p99, ms.
    pub ttft_p99_ms: Option<Spread>,
    /// Median per-request ITL p50, ms.
    pub itl_p50_ms: Option<Spread>,
    /// p99 of the per-request ITL p50s, ms.
    pub itl_p99_ms: Option<Spread>,
    /// Mechanism, all / first turns / later turns.
    pub mechanism: Split<MechanismSpread>,
    /// Router overhead p50, µs.
    pub overhead_p50_us: Option<Spread>,
    /// Router overhead p99, µs.
    pub overhead_p99_us: Option<Spread>,
    /// Belief divergence over the used repetitions' requests pooled.
    pub divergence: Divergence,
    /// Belief decay over the used repetitions' requests pooled.
    pub decay: Decay,
    /// TTL and node cap implied by the pooled honoured belief.
    pub implied: Implied,
    /// Each used repetition in full.
    pub reps: Vec<RepMetrics>,
}

/// A policy's rank at a point.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ranked {
    /// Policy name.
    pub policy: String,
    /// Its median goodput, req/s.
    pub goodput_median_rps: f64,
}

/// The grid axes a point name carries (`ws<ratio>-s<skew>[-suffix]`, as the sweep names points);
/// `None` where the name does not follow that form.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PointAxes {
    /// Working set ÷ fleet KV capacity.
    pub working_set_ratio: Option<f64>,
    /// Zipf exponent over conversations.
    pub zipf_s: Option<f64>,
}

/// Reads the axes from a point name such as `ws0.25-s1.4` or `ws1-s0-rate2`.
pub fn point_axes(name: &str) -> PointAxes {
    let mut parts = name.split('-');
    let ws = parts
        .next()
        .and_then(|p| p.strip_prefix("ws"))
        .and_then(|v| v.parse().ok());
    let skew = ws
        .and(parts.next())
        .and_then(|p| p.strip_prefix('s'))
        .and_then(|v| v.parse().ok());
    PointAxes {
        working_set_ratio: ws,
        zipf_s: skew,
    }
}

/// All policies at one grid point.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Point {
    /// Point directory name.
    pub point: String,
    /// Axes parsed from the name (for maps over working set × skew).
    pub axes: PointAxes,
    /// The workload every cell sent.
    pub workload_name: String,
    /// The arrival plan every cell sent.
    pub plan_fingerprint: String,
    /// The SLO goodput is measured against (of the first cell; differences are warned about).
    pub slo: Slo,
    /// Cells in policy order.
    pub cells: Vec<Cell>,
    /// Every ordered pair of policies with goodput.
    pub margins: Vec<Margin>,
    /// Highest median goodput.
    pub winner: Option<Ranked>,
    /// Second highest.
    pub runner_up: Option<Ranked>,
    /// Winner vs runner-up.
    pub winner_verdict: Option<Verdict>,
    /// Every policy met its SLO here ([`below_pressure`]): the point compares latencies, not
    /// what a policy buys under pressure.
    pub below_pressure: bool,
    /// Whether the repetitions ran in virtual time: their differences are deterministic and
    /// carry no spread verdict ([`Verdict::Deterministic`]). Absent (false) for live points.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub virtual_time: bool,
    /// Which time placed its requests in the window and started their TTFT (the first
    /// repetition's `window.clock`); absent reads as `sent`, which is not written.
    #[serde(default, skip_serializing_if = "schema::WindowClock::is_sent")]
    pub window_clock: schema::WindowClock,
}

impl Point {
    /// The margin of `policy` over `baseline`, when both have goodput here.
    pub fn margin(&self, policy: &str, baseline: &str) -> Option<&Margin> {
        self.margins
            .iter()
            .find(|m| m.policy == policy && m.baseline == baseline)
    }
}

/// Router overhead of one policy over the whole sweep (measured requests pooled).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyOverhead {
    /// Policy name.
    pub policy: String,
    /// Its overhead.
    pub overhead: Overhead,
}

/// A policy that beats prefix-affinity beyond the spread at some point.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Beat {
    /// The point.
    pub point: String,
    /// The margin (policy over prefix-affinity, verdict `separates`).
    pub margin: Margin,
}

/// A sweep still in progress: its record (`sweep.json`: points × policies × repetitions) plans
/// repetitions that have not finished, as when a grid longer than a session is interrupted and
/// published to be resumed. The report says so first, so the tables are never read as the whole.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InProgress {
    /// Repetitions the record plans.
    pub planned_reps: usize,
    /// Of those, finished (a complete `meta.json`, accepted or set aside).
    pub finished_reps: usize,
    /// Planned points with no finished repetition.
    pub points_not_started: Vec<String>,
    /// Planned points with some, not all, repetitions finished.
    pub points_partial: Vec<String>,
}

/// The sweep record's plan against the finished `(point, policy, rep)`s; `None` when the record
/// is absent or unreadable or every planned repetition has finished.
pub fn in_progress(
    record: &serde_json::Value,
    finished: &std::collections::BTreeSet<(String, String, u32)>,
) -> Option<InProgress> {
    let names = |key: &str, field: Option<&str>| -> Option<Vec<String>> {
        (record.get(key)?.as_array()?.iter())
            .map(|v| match field {
                Some(f) => v.get(f)?.as_str().map(str::to_owned),
                None => v.as_str().map(str::to_owned),
            })
            .collect()
    };
    let points = names("points", Some("name"))?;
    let policies = names("policies", None)?;
    let reps = u32::try_from(record.get("reps")?.as_u64()?).ok()?;
    let (mut planned, mut done) = (0, 0);
    let (mut not_started, mut partial) = (Vec::new(), Vec::new());
    for point in &points {
        let planned_here = policies.len() * reps as usize;
        let done_here = (policies.iter())
            .flat_map(|p| (1..=reps).map(move |k| (p, k)))
            .filter(|(p, k)| finished.contains(&(point.clone(), (*p).clone(), *k)))
            .count();
        planned += planned_here;
        done += done_here;
        if done_here == 0 {
            not_started.push(point.clone());
        } else if done_here < planned_here {
            partial.push(point.clone());
        }
    }
    (done < planned).then_some(InProgress {
        planned_reps: planned,
        finished_reps: done,
        points_not_started: not_started,
        points_partial: partial,
    })
}

/// Would a router that picks its policy per load point beat always using prefix-affinity?
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdaptiveTest {
    /// The reference policy.
    pub baseline: String,
    /// Points where prefix-affinity was measured and compared.
    pub points_tested: Vec<String>,
    /// Where some policy beats it beyond the spread.
    pub beats: Vec<Beat>,
    /// The finding in one sentence (including the null result).
    pub statement: String,
}

/// The whole report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// [`SCHEMA_VERSION`].
    pub schema_version: u32,
    /// Sweep directory name.
    pub sweep: String,
    /// The analysis rules this report was built with ([`crate::RULES_VERSION`]); empty in a
    /// report written before reports named them.
    #[serde(default)]
    pub rules: String,
    /// Knobs used.
    pub config: ReportConfig,
    /// Tabulated points, sorted by name.
    pub points: Vec<Point>,
    /// Points not tabulated because their cells are not comparable.
    pub refused: Vec<Refusal>,
    /// Repetition directories without a complete meta.json (never analysed).
    pub incomplete: Vec<IncompleteRep>,
    /// What the sweep's record plans and has not finished; `None` when every planned repetition
    /// has finished or the directory has no record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_progress: Option<InProgress>,
    /// Router overhead per policy across the sweep.
    pub overhead_by_policy: Vec<PolicyOverhead>,
    /// The adaptive-router test.
    pub adaptive_router_test: AdaptiveTest,
    /// Things a reader should know (mixed SLOs, unjoined rows, meta/dir mismatches).
    pub warnings: Vec<String>,
    /// Each repetition's load-ladder stages, when its replay has them (`crate::stages`); absent
    /// from every other report.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<crate::stages::CellStages>,
}

/// `count` as a share of the measured requests; `None` when there were none.
fn share(count: u64, lat: &Latency) -> Option<f64> {
    (lat.requests > 0).then(|| count as f64 / lat.requests as f64)
}

/// Whether `cells` is below pressure: every cell with an attainment has a median attainment at
/// or above [`ATTAINMENT_TARGET`], so no policy misses its SLO and goodput only restates the
/// offered load. `false` when no cell has an attainment (nothing to judge).
pub fn below_pressure(cells: &[Cell]) -> bool {
    let medians: Vec<f64> = cells
        .iter()
        .filter_map(|c| c.slo_attainment.map(|a| a.median))
        .collect();
    !medians.is_empty() && medians.iter().all(|&a| a >= ATTAINMENT_TARGET)
}

fn build_cell(policy: &str, reps: &[&RepData], cfg: &ReportConfig) -> (Cell, OverheadSamples) {
    let mut set_aside = Vec::new();
    let mut used: Vec<&RepData> = Vec::new();
    for r in reps {
        if !r.meta.accepted {
            let m = rep_metrics(r, &measured_requests(r, &r.meta.slo), &cfg.metrics);
            set_aside.push(SetAside {
                rep: r.rep,
                reason: r
                    .meta
                    .set_aside_reason
                    .clone()
                    .unwrap_or_else(|| "set aside (no reason recorded)".into()),
                goodput_rps: Some(m.goodput_rps),
                slo_attainment: m.latency.slo_attainment,
            });
        } else {
            used.push(r);
        }
    }
    let mut metrics = Vec::new();
    let mut pooled: Vec<Request<'_>> = Vec::new();
    let mut drift = Vec::new();
    let mut capacity = None;
    let mut overloaded = Vec::new();
    for r in &used {
        let reqs = measured_requests(r, &r.meta.slo);
        metrics.push(rep_metrics(r, &reqs, &cfg.metrics));
        let verdict = check_rows(&r.client, &r.meta.slo, &r.meta.window, &cfg.drift);
        let recorded = recorded_class(&r.meta) == Some(DriftClass::Overloaded);
        if recorded || verdict.overloaded {
            let from_meta = recorded
                .then(|| r.meta.drift.as_ref().and_then(|d| d.reason.as_deref()))
                .flatten();
            overloaded.push(OverloadedRep {
                rep: r.rep,
                reason: from_meta
                    .map(str::to_string)
                    .or_else(|| verdict.reason.clone())
                    .unwrap_or_else(|| "overloaded".into()),
            });
        }
        drift.push(RepDrift {
            rep: r.rep,
            verdict,
        });
        capacity = capacity.or(r.meta.capacity_tokens());
        pooled.extend(reqs);
    }
    let mech = |f: fn(&Split<Mechanism>) -> &Mechanism| {
        let ms: Vec<&Mechanism> = metrics.iter().map(|m| f(&m.mechanism)).collect();
        mechanism_spread(&ms)
    };
    let dec = decay(&pooled, &cfg.metrics.decay_edges_s);
    let imp = implied(&dec, capacity, &cfg.metrics);
    let mut samples = OverheadSamples::default();
    pooled
        .iter()
        .filter_map(|r| r.router)
        .for_each(|r| samples.add(r));
    let cell = Cell {
        policy: policy.to_string(),
        reps_used: used.iter().map(|r| r.rep).collect(),
        set_aside,
        overloaded,
        drift,
        goodput_rps: spread_of(&metrics, |m| Some(m.goodput_rps)),
        slo_attainment: spread_of(&metrics, |m| m.latency.slo_attainment),
        busiest_replica_attainment: spread_of(&metrics, |m| m.busiest_replica_attainment),
        missed_ttft_share: spread_of(&metrics, |m| share(m.latency.missed_ttft, &m.latency)),
        missed_itl_share: spread_of(&metrics, |m| share(m.latency.missed_itl, &m.latency)),
        error_share: spread_of(&metrics, |m| share(m.latency.errors, &m.latency)),
        ttft_p50_ms: spread_of(&metrics, |m| m.latency.ttft_p50_ms),
        ttft_p90_ms: spread_of(&metrics, |m| m.latency.ttft_p90_ms),
        ttft_p99_ms: spread_of(&metrics, |m| m.latency.ttft_p99_ms),
        itl_p50_ms: spread_of(&metrics, |m| m.latency.itl_p50_ms),
        itl_p99_ms: spread_of(&metrics, |m| m.latency.itl_p99_ms),
        mechanism: Split {
            all: mech(|s| &s.all),
            first_turn: mech(|s| &s.first_turn),
            later_turns: mech(|s| &s.later_turns),
        },
        overhead_p50_us: spread_of(&metrics, |m| m.overhead.overhead_p50_us),
        overhead_p99_us: spread_of(&metrics, |m| m.overhead.overhead_p99_us),
        divergence: divergence(&pooled),
        decay: dec,
        implied: imp,
        reps: metrics,
    };
    (cell, samples)
}

fn build_point(
    point: &str,
    reps: &[&RepData],
    cfg: &ReportConfig,
    warnings: &mut Vec<String>,
) -> (Point, Vec<(String, OverheadSamples)>) {
    let mut by_policy: BTreeMap<(usize, String), Vec<&RepData>> = BTreeMap::new();
    for r in reps {
        by_policy.entry(policy_rank(&r.policy)).or_default().push(r);
    }
    let first = reps[0];
    for r in reps {
        if r.meta.slo != first.meta.slo {
            warnings.push(format!(
                "point `{point}`: {}/rep-{} has SLO {:?}, {}/rep-{} has {:?}",
                r.policy, r.rep, r.meta.slo, first.policy, first.rep, first.meta.slo
            ));
        }
    }
    let (cells, samples): (Vec<Cell>, Vec<OverheadSamples>) = by_policy
        .iter()
        .map(|((_, policy), reps)| build_cell(policy, reps, cfg))
        .unzip();
    let samples = cells
        .iter()
        .map(|c| c.policy.clone())
        .zip(samples)
        .collect();
    let with_goodput: Vec<(&str, Spread)> = cells
        .iter()
        .filter_map(|c| c.goodput_rps.map(|g| (c.policy.as_str(), g)))
        .collect();
    let basis = Basis::of(reps.iter().map(|r| r.meta.virtual_time));
    let is_overloaded = |policy: &str| {
        cells
            .iter()
            .any(|c| c.policy == policy && !c.overloaded.is_empty())
    };
    let mut margins = Vec::new();
    for (a, ga) in &with_goodput {
        for (b, gb) in &with_goodput {
            if a != b {
                let mut m = margin(a, ga, b, gb, basis);
                m.overloaded = is_overloaded(a) || is_overloaded(b);
                margins.push(m);
            }
        }
    }
    let mut ranked = with_goodput.clone();
    // Highest median first; equal medians fall back to table order, so the result is stable.
    ranked.sort_by(|a, b| b.1.median.total_cmp(&a.1.median));
    let rank = |i: usize| {
        ranked.get(i).map(|(p, g)| Ranked {
            policy: p.to_string(),
            goodput_median_rps: g.median,
        })
    };
    let winner_verdict = match (ranked.first(), ranked.get(1)) {
        (Some(a), Some(b)) => Some(Verdict::judge(&a.1, &b.1, basis)),
        _ => None,
    };
    let point = Point {
        point: point.to_string(),
        axes: point_axes(point),
        workload_name: first.meta.workload_name.clone(),
        plan_fingerprint: first.meta.plan_fingerprint.clone(),
        slo: first.meta.slo,
        winner: rank(0),
        runner_up: rank(1),
        winner_verdict,
        below_pressure: below_pressure(&cells),
        cells,
        margins,
        virtual_time: basis == Basis::Deterministic,
        window_clock: first.meta.window.clock,
    };
    (point, samples)
}

fn adaptive_test(points: &[Point]) -> AdaptiveTest {
    let mut tested = Vec::new();
    let mut beats = Vec::new();
    let mut deterministic = 0usize;
    for p in points {
        if !p
            .cells
            .iter()
            .any(|c| c.policy == PREFIX_AFFINITY && c.goodput_rps.is_some())
        {
            continue;
        }
        // A virtual point's differences have no measured spread to beat.
        if p.virtual_time {
            deterministic += 1;
            continue;
        }
        tested.push(p.point.clone());
        for m in p.margins.iter().filter(|m| m.baseline == PREFIX_AFFINITY) {
            if m.margin_rps > 0.0 && m.verdict == Verdict::Separates {
                beats.push(Beat {
                    point: p.point.clone(),
                    margin: m.clone(),
                });
            }
        }
    }
    let statement = if tested.is_empty() && deterministic > 0 {
        format!(
            "Not tested: every point with prefix-affinity ({deterministic}) ran in virtual time, whose repetitions are deterministic, so no margin can be judged against a measured spread."
        )
    } else if tested.is_empty() {
        "Not tested: no point has prefix-affinity measured.".to_string()
    } else if beats.is_empty() {
        format!(
            "Null result: at none of the {} points tested does any policy beat prefix-affinity beyond the spread of repetitions, so a router that switches policy by load point would gain nothing measurable here.",
            tested.len()
        )
    } else {
        let list: Vec<String> = beats
            .iter()
            .map(|b| {
                format!(
                    "{} at `{}` (+{:.3} req/s)",
                    b.margin.policy, b.point, b.margin.margin_rps
                )
            })
            .collect();
        format!(
            "At {} of {} points tested some policy beats prefix-affinity beyond the spread: {}. An adaptive router could gain there.",
            beats
                .iter()
                .map(|b| &b.point)
                .collect::<std::collections::BTreeSet<_>>()
                .len(),
            tested.len(),
            list.join(", ")
        )
    };
    AdaptiveTest {
        baseline: PREFIX_AFFINITY.to_string(),
        points_tested: tested,
        beats,
        statement,
    }
}

/// Accumulates points one at a time, so a sweep need not be in memory all at once.
struct Builder<'c> {
    cfg: &'c ReportConfig,
    points: Vec<Point>,
    refused: Vec<Refusal>,
    warnings: Vec<String>,
    overhead: BTreeMap<(usize, String), OverheadSamples>,
    stages: Vec<crate::stages::CellStages>,
}

impl<'c> Builder<'c> {
    fn new(cfg: &'c ReportConfig) -> Self {
        Builder {
            cfg,
            points: Vec::new(),
            refused: Vec::new(),
            warnings: Vec::new(),
            overhead: BTreeMap::new(),
            stages: Vec::new(),
        }
    }

    fn add_point(&mut self, point: &str, reps: &[&RepData]) {
        if reps.is_empty() {
            return;
        }
        self.stages
            .extend(reps.iter().filter_map(|r| crate::stages::rep_stages(r)));
        for r in reps {
            let id = format!("{}/{}/rep-{}", r.point, r.policy, r.rep);
            // An empty name was not recorded.
            let (point, policy) = (&r.meta.point, &r.meta.policy);
            if !point.is_empty() && *point != r.point {
                self.warnings.push(format!(
                    "{id}: meta.json names point `{point}`; the directory name is used"
                ));
            }
            if !policy.is_empty() && *policy != r.policy {
                self.warnings.push(format!(
                    "{id}: meta.json names policy `{policy}`; the directory name is used"
                ));
            }
        }
        if let Err(refusal) = check_comparable(point, reps) {
            self.refused.push(refusal);
            return;
        }
        let (p, samples) = build_point(point, reps, self.cfg, &mut self.warnings);
        for c in &p.cells {
            for m in c.reps.iter().filter(|m| m.unjoined_requests > 0) {
                self.warnings.push(format!(
                    "{}/{}/rep-{}: {} measured requests have no router row",
                    p.point, c.policy, m.rep, m.unjoined_requests
                ));
            }
        }
        for (policy, s) in samples {
            let acc = self.overhead.entry(policy_rank(&policy)).or_default();
            acc.extend(&s);
        }
        self.points.push(p);
    }

    fn finish(self, sweep: String, incomplete: Vec<IncompleteRep>) -> Report {
        let overhead_by_policy = self
            .overhead
            .into_iter()
            .filter(|(_, s)| !s.is_empty())
            .map(|((_, policy), s)| PolicyOverhead {
                policy,
                overhead: s.summary(),
            })
            .collect();
        Report {
            schema_version: SCHEMA_VERSION,
            sweep,
            rules: crate::RULES_VERSION.to_string(),
            config: self.cfg.clone(),
            adaptive_router_test: adaptive_test(&self.points),
            points: self.points,
            refused: self.refused,
            incomplete,
            in_progress: None,
            overhead_by_policy,
            warnings: self.warnings,
            stages: self.stages,
        }
    }
}

/// Analyses loaded sweep data. Points whose cells are not comparable are listed in `refused`
/// and not tabulated.
pub fn analyze(sweep: &SweepData, cfg: &ReportConfig) -> Report {
    let mut by_point: BTreeMap<&str, Vec<&RepData>> = BTreeMap::new();
    for r in &sweep.reps {
        by_point.entry(r.point.as_str()).or_default().push(r);
    }
    let mut b = Builder::new(cfg);
    for (point, reps) in &by_point {
        b.add_point(point, reps);
    }
    b.finish(sweep.sweep.clone(), sweep.incomplete.clone())
}

/// Loads and analyses a sweep directory one point at a time (only one point's rows are held in
/// memory), with the same result as [`analyze`] over [`crate::load::load_sweep`].
pub fn analyze_dir(dir: &Path, cfg: &ReportConfig) -> Result<Report> {
    let (sweep, points) = discover(dir)?;
    let mut b = Builder::new(cfg);
    let mut incomplete = Vec::new();
    let mut finished = std::collections::BTreeSet::new();
    for dirs in &points {
        let (reps, inc) = load_point(dirs)?;
        incomplete.extend(inc);
        finished.extend(
            reps.iter()
                .map(|r| (r.point.clone(), r.policy.clone(), r.rep)),
        );
        let refs: Vec<&RepData> = reps.iter().collect();
        b.add_point(&dirs.point, &refs);
    }
    let mut report = b.finish(sweep, incomplete);
    // The router grid's record; other ingresses' records (`sweep-haproxy.json`, …) plan cells
    // under other names beside it.
    let record = std::fs::read_to_string(dir.join("sweep.json")).ok();
    report.in_progress = record
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|r| in_progress(&r, &finished));
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sweep_with_planned_repetitions_unfinished_is_in_progress() {
        let record = serde_json::json!({
            "points": [{"name": "ws1-s0", "ratio": 1.0}, {"name": "ws3-s0"}, {"name": "ws8-s0"}],
            "policies": ["round-robin", "prefix-affinity"],
            "reps": 2,
        });
        let mut finished = std::collections::BTreeSet::new();
        for policy in ["round-robin", "prefix-affinity"] {
            for k in 1..=2 {
                finished.insert(("ws1-s0".to_owned(), policy.to_owned(), k));
            }
        }
        finished.insert(("ws3-s0".to_owned(), "round-robin".to_owned(), 1));
        // A repetition beyond the plan (another ingress's, an earlier --reps) is not counted.
        finished.insert(("ws3-s0".to_owned(), "haproxy".to_owned(), 1));
        assert_eq!(
            in_progress(&record, &finished),
            Some(InProgress {
                planned_reps: 12,
                finished_reps: 5,
                points_not_started: vec!["ws8-s0".into()],
                points_partial: vec!["ws3-s0".into()],
            })
        );
        for point in ["ws3-s0", "ws8-s0"] {
            for policy in ["round-robin", "prefix-affinity"] {
                for k in 1..=2 {
                    finished.insert((point.to_owned(), policy.to_owned(), k));
                }
            }
        }
        assert_eq!(in_progress(&record, &finished), None, "all finished");
        assert_eq!(
            in_progress(&serde_json::json!({"points": []}), &finished),
            None,
            "a record without policies or reps plans nothing"
        );
    }

    #[test]
    fn point_axes_follow_the_sweep_names() {
        let a = point_axes("ws0.25-s1.4");
        assert_eq!((a.working_set_ratio, a.zipf_s), (Some(0.25), Some(1.4)));
        let b = point_axes("ws1-s0-rate2");
        assert_eq!((b.working_set_ratio, b.zipf_s), (Some(1.0), Some(0.0)));
        let c = point_axes("frozen");
        assert_eq!((c.working_set_ratio, c.zipf_s), (None, None));
    }

    #[test]
    fn virtual_repetitions_get_deterministic_differences_not_verdicts() {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/analysis/sweep-basic");
        let cfg = ReportConfig::default();
        let live = analyze(&crate::load::load_sweep(&dir).unwrap(), &cfg);
        let mut data = crate::load::load_sweep(&dir).unwrap();
        for r in &mut data.reps {
            r.meta.virtual_time = true;
        }
        let virt = analyze(&data, &cfg);
        for (l, v) in live.points.iter().zip(&virt.points) {
            assert!(!l.virtual_time && v.virtual_time);
            // The same numbers: only the verdict changes.
            assert_eq!(l.margins.len(), v.margins.len());
            for (lm, vm) in l.margins.iter().zip(&v.margins) {
                assert_eq!(lm.margin_rps, vm.margin_rps);
                assert_eq!(vm.verdict, Verdict::Deterministic);
            }
            assert_eq!(
                v.winner_verdict.is_some(),
                l.winner_verdict.is_some(),
                "{}",
                v.point
            );
            assert!(
                v.winner_verdict
                    .is_none_or(|verdict| verdict == Verdict::Deterministic)
            );
        }
        // Live, the fixture's round-robin beats prefix-affinity beyond the spread at ws3-s1;
        // virtual, nothing is judged.
        assert!(!live.adaptive_router_test.beats.is_empty());
        assert!(virt.adaptive_router_test.beats.is_empty());
        assert!(virt.adaptive_router_test.points_tested.is_empty());
        assert!(
            virt.adaptive_router_test.statement.starts_with(
                "Not tested: every point with prefix-affinity (2) ran in virtual time"
            )
        );
        let md = crate::markdown::render(&virt);
        assert!(md.contains("**Virtual time.**"));
        assert!(md.contains("deterministic (virtual)"));
        assert!(!crate::markdown::render(&live).contains("deterministic (virtual)"));
        // A live report's JSON carries no `virtual_time` (published reports stay as they are).
        let json = serde_json::to_value(&live).unwrap();
        assert!(json["points"][0].get("virtual_time").is_none());
    }

    #[test]
    fn an_overloaded_repetition_is_counted_and_marked_wherever_it_is_shown() {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/analysis/sweep-basic");
        let cfg = ReportConfig::default();
        let mut data = crate::load::load_sweep(&dir).unwrap();
        let plain = analyze(&data, &cfg);
        let why = "overloaded: the backlog grows 0.67 requests/s across the window (mean 12.0, t = 40.0); warming: TTFT trends up by 300% across the window (t = 25.0)";
        for r in data
            .reps
            .iter_mut()
            .filter(|r| r.point == "ws1-s0" && r.policy == "round-robin" && r.rep == 2)
        {
            r.meta.drift = Some(DriftVerdict {
                class: DriftClass::Overloaded,
                reason: Some(why.into()),
                ..DriftVerdict::default()
            });
        }
        let marked = analyze(&data, &cfg);
        let (p0, p1) = (&plain.points[0], &marked.points[0]);
        assert_eq!(p1.point, "ws1-s0");
        let rr = |p: &Point| p.cells.iter().find(|c| c.policy == "round-robin").cloned();
        let (before, after) = (rr(p0).unwrap(), rr(p1).unwrap());
        // Counted: the same repetitions and figures; only the mark is new.
        assert_eq!(before.reps_used, after.reps_used);
        assert_eq!(before.goodput_rps, after.goodput_rps);
        assert!(before.overloaded.is_empty());
        assert_eq!(after.overloaded.len(), 1);
        assert_eq!(
            (after.overloaded[0].rep, after.overloaded[0].reason.as_str()),
            (2, why)
        );
        // Every comparison resting on round-robin is marked; the others are not.
        for m in &p1.margins {
            let touches = m.policy == "round-robin" || m.baseline == "round-robin";
            assert_eq!(m.overloaded, touches, "{m:?}");
        }
        assert!(p0.margins.iter().all(|m| !m.overloaded));
        let md = crate::markdown::render(&marked);
        assert!(md.contains("| round-robin (overloaded) |"), "{md}");
        assert!(md.contains("· overloaded"));
        assert!(
            md.contains("under pressure; overloaded: round-robin")
                || md.contains("below pressure; overloaded: round-robin")
        );
        assert!(md.contains(&format!("- round-robin: rep-2 is overloaded ({why})")));
        assert!(!crate::markdown::render(&plain).contains("overloaded"));
    }

    #[test]
    fn streaming_and_in_memory_analysis_agree() {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/analysis/sweep-basic");
        let cfg = ReportConfig::default();
        let streamed = analyze_dir(&dir, &cfg).unwrap();
        let in_memory = analyze(&crate::load::load_sweep(&dir).unwrap(), &cfg);
        assert_eq!(streamed, in_memory);
    }
}
