//! The numbers each figure draws, picked out of the analysis report (figures 1–5 and 7–9), the
//! per-policy capacity report (the first panels of figures 1 and 2, and figure 10) or the
//! fault timeline (figure 6), and the CSV that publishes exactly those numbers.
//!
//! Nothing here derives a metric: every value is a field of `analysis::Report` or
//! `analysis::capacity::CapacityReport` (or a row of `timeline.csv`); the one verdict the
//! capacity report does not hold (figure 2's winner against its runner-up) is the report's own
//! rule, `analysis::capacity::verdict`. Where a figure needs something the input does not hold,
//! the builder fails with a message that names the figure, the point, the policy and the
//! missing value.

use crate::error::fail;
use crate::{Error, Result};
use analysis::capacity::{
    CapacityMargin, CapacityReport, CapacityVerdict, PointCapacities, PolicyCapacity,
};
use analysis::report::{PREFIX_AFFINITY, Point, SESSION_AFFINITY};
use analysis::stats::Spread;
use analysis::{Report, Verdict};

use schema::ATTAINMENT_TARGET;

use crate::input::{FaultInput, LoadInput, Offered, PolicyTimeline, num};

/// The spill-off arm of prefix-affinity.
pub const PREFIX_AFFINITY_SPILL_OFF: &str = "prefix-affinity-spill-off";
/// The stateless hashing rung of the knowledge ladder.
pub const PREFIX_HASH: &str = "prefix-hash";
/// The event-fed rung.
pub const EXACT_RESIDENCY: &str = "exact-residency";
/// The event-fed rung with the speculative layer.
pub const EXACT_RESIDENCY_SPEC: &str = "exact-residency-spec";

/// Policies whose router rows carry a predicted match (belief divergence applies).
pub const BELIEF_POLICIES: [&str; 4] = [
    PREFIX_AFFINITY,
    PREFIX_AFFINITY_SPILL_OFF,
    EXACT_RESIDENCY,
    EXACT_RESIDENCY_SPEC,
];

/// A CSV table: a header and rows of already formatted fields.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    /// Column names.
    pub header: Vec<&'static str>,
    /// Rows, each as long as the header.
    pub rows: Vec<Vec<String>>,
}

impl Table {
    /// The table as CSV text (`\n` line ends, quoting only where needed).
    pub fn to_csv(&self) -> Result<String> {
        let mut w = csv::WriterBuilder::new()
            .terminator(csv::Terminator::Any(b'\n'))
            .from_writer(Vec::new());
        let table = |source| Error::Table { source };
        w.write_record(&self.header).map_err(table)?;
        for r in &self.rows {
            w.write_record(r).map_err(table)?;
        }
        let bytes = w
            .into_inner()
            .map_err(|e| table(csv::Error::from(e.into_error())))?;
        // The fields are `String`s, so the CSV is UTF-8.
        Ok(String::from_utf8(bytes).expect("CSV of UTF-8 fields is UTF-8"))
    }
}

/// A spread's median, min and max as a table writes them.
fn spread_fields(x: &Spread) -> [String; 3] {
    [num(x.median), num(x.min), num(x.max)]
}

/// The one point of a sweep that runs one (an N-router sweep, a trace replay); `what` says why
/// there is one, for the error naming `figure`.
fn only_point<'r>(report: &'r Report, figure: &str, what: &str) -> Result<&'r Point> {
    match report.points.as_slice() {
        [p] => Ok(p),
        _ => fail!(
            Missing,
            "{figure}: sweep `{}` has {} points; {what}",
            report.sweep,
            report.points.len()
        ),
    }
}

fn opt(x: Option<f64>) -> String {
    x.map(num).unwrap_or_default()
}

/// How many repetitions the drawn medians rest on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reps {
    /// Fewest.
    pub min: usize,
    /// Most.
    pub max: usize,
}

impl Reps {
    /// Over the spreads drawn; `None` when there are none.
    pub fn of<'a>(spreads: impl IntoIterator<Item = &'a Spread>) -> Option<Reps> {
        let ns: Vec<usize> = spreads.into_iter().map(|s| s.n).collect();
        Some(Reps {
            min: *ns.iter().min()?,
            max: *ns.iter().max()?,
        })
    }

    /// In words, e.g. `3 reps per cell` or `2–3 reps per cell`.
    pub fn text(&self) -> String {
        let n = if self.min == self.max {
            self.min.to_string()
        } else {
            format!("{}–{}", self.min, self.max)
        };
        let unit = if self.max == 1 { "rep" } else { "reps" };
        format!("{n} {unit} per cell (median, min–max)")
    }
}

/// The cell of `policy` at `point`, if it ran there.
fn cell<'a>(point: &'a Point, policy: &str) -> Option<&'a analysis::report::Cell> {
    point.cells.iter().find(|c| c.policy == policy)
}

/// The goodput spread of `policy` at `point`.
pub fn goodput(point: &Point, policy: &str) -> Option<Spread> {
    cell(point, policy).and_then(|c| c.goodput_rps)
}

/// The median SLO attainment of `policy` at `point`.
pub fn attainment(point: &Point, policy: &str) -> Option<f64> {
    cell(point, policy)
        .and_then(|c| c.slo_attainment)
        .map(|s| s.median)
}

fn has_cell(point: &Point, policy: &str) -> bool {
    cell(point, policy).is_some()
}

/// The cell ran, but the drift check set every one of its repetitions aside: there is nothing to
/// draw, and that is a finding to show, not data missing from the input.
pub fn all_set_aside(point: &Point, policy: &str) -> bool {
    cell(point, policy).is_some_and(|c| {
        c.goodput_rps.is_none() && c.reps_used.is_empty() && !c.set_aside.is_empty()
    })
}

/// A grid cell drawn without numbers because the cells it needs had every repetition set aside.
#[derive(Debug, Clone, PartialEq)]
pub struct NoDataCell {
    /// Point name.
    pub point: String,
    /// Working set ÷ KV capacity.
    pub working_set_ratio: f64,
    /// Zipf exponent.
    pub zipf_s: f64,
    /// The policies whose repetitions were all set aside.
    pub set_aside: Vec<String>,
}

impl NoDataCell {
    fn new(point: &Point, working_set_ratio: f64, zipf_s: f64, set_aside: Vec<String>) -> Self {
        NoDataCell {
            point: point.point.clone(),
            working_set_ratio,
            zipf_s,
            set_aside,
        }
    }
}

/// What a figure leaves out because every repetition of the cell was set aside (`point policy`).
pub fn set_aside_note(not_drawn: &[String]) -> Option<String> {
    (!not_drawn.is_empty()).then(|| {
        format!(
            "not drawn, every repetition set aside by the drift check: {}",
            not_drawn.join(", ")
        )
    })
}

/// The CSV value of the verdict column for a cell drawn without numbers.
pub const NO_ACCEPTED_REPS: &str = "no accepted reps";

/// Grid points (both axes parsed from the name), with their axis values.
fn grid_points<'a>(report: &'a Report, figure: &str) -> Result<Vec<(&'a Point, f64, f64)>> {
    let pts: Vec<(&Point, f64, f64)> = report
        .points
        .iter()
        .filter_map(|p| Some((p, p.axes.working_set_ratio?, p.axes.zipf_s?)))
        .collect();
    if pts.is_empty() {
        let names: Vec<&str> = report.points.iter().map(|p| p.point.as_str()).collect();
        fail!(
            Missing,
            "{figure}: no point of sweep `{}` is named ws<ratio>-s<skew> (found: {})",
            report.sweep,
            names.join(", ")
        );
    }
    Ok(pts)
}

fn sorted_axis(values: impl Iterator<Item = f64>) -> Vec<f64> {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    v.dedup();
    v
}

fn missing(figure: &str, what: Vec<String>) -> Result<()> {
    if what.is_empty() {
        Ok(())
    } else {
        fail!(Missing, "{figure}: missing data: {}", what.join("; "))
    }
}

/// One cell of the pressure map.
#[derive(Debug, Clone, PartialEq)]
pub struct PressureCell {
    /// Point name.
    pub point: String,
    /// Working set ÷ KV capacity.
    pub working_set_ratio: f64,
    /// Zipf exponent.
    pub zipf_s: f64,
    /// Median goodput of prefix-affinity − session-affinity, req/s.
    pub margin_rps: f64,
    /// That margin ÷ session-affinity's median.
    pub relative: Option<f64>,
    /// Spread verdict of the two.
    pub verdict: Verdict,
    /// Prefix-affinity's median SLO attainment: goodput is a comparison of goodput only where
    /// some policy misses its SLO, so every cell states both sides'.
    pub pa_attainment: Option<f64>,
    /// Session-affinity's median SLO attainment.
    pub sa_attainment: Option<f64>,
    /// The report's flag: every policy met its SLO here, so the margin compares throughput.
    pub below_pressure: bool,
}

/// Figure 1: prefix-affinity's goodput margin over session-affinity across working set × skew.
#[derive(Debug, Clone, PartialEq)]
pub struct PressureData {
    /// Working-set ratios, ascending.
    pub ws_values: Vec<f64>,
    /// Skews, ascending.
    pub s_values: Vec<f64>,
    /// One per measured grid point.
    pub cells: Vec<PressureCell>,
    /// Points drawn without a margin (a side's repetitions were all set aside).
    pub no_data: Vec<NoDataCell>,
    /// Repetitions behind the medians.
    pub reps: Reps,
}

/// Name of figure 1 in messages.
pub const FIG1: &str = "figure 1 (pressure map)";
/// Name of figure 2 in messages.
pub const FIG2: &str = "figure 2 (winners map)";
/// Name of figure 3 in messages.
pub const FIG3: &str = "figure 3 (mechanism)";
/// Name of figure 4 in messages.
pub const FIG4: &str = "figure 4 (knowledge ladder)";
/// Name of figure 5 in messages.
pub const FIG5: &str = "figure 5 (belief divergence and decay)";
/// Name of figure 6 in messages.
pub const FIG6: &str = "figure 6 (fault timeline)";

/// Picks figure 1's numbers: the report's margin of prefix-affinity over session-affinity at
/// every grid point. Every grid point must have both policies' goodput, or have run them and
/// set every repetition aside (drawn as such).
pub fn pressure(report: &Report) -> Result<PressureData> {
    let pts = grid_points(report, FIG1)?;
    let mut cells = Vec::new();
    let mut no_data = Vec::new();
    let mut spreads = Vec::new();
    let mut lack = Vec::new();
    for (p, ws, s) in &pts {
        let pa = goodput(p, PREFIX_AFFINITY);
        let sa = goodput(p, SESSION_AFFINITY);
        let mut aside = Vec::new();
        for (name, g) in [(PREFIX_AFFINITY, pa), (SESSION_AFFINITY, sa)] {
            if g.is_none() {
                if all_set_aside(p, name) {
                    aside.push(name.to_string());
                } else {
                    lack.push(format!("point `{}` has no {name} goodput", p.point));
                }
            }
        }
        if !aside.is_empty() {
            no_data.push(NoDataCell::new(p, *ws, *s, aside));
            continue;
        }
        let (Some(pa), Some(sa), Some(m)) = (pa, sa, p.margin(PREFIX_AFFINITY, SESSION_AFFINITY))
        else {
            continue;
        };
        spreads.extend([pa, sa]);
        cells.push(PressureCell {
            point: p.point.clone(),
            working_set_ratio: *ws,
            zipf_s: *s,
            margin_rps: m.margin_rps,
            relative: m.relative,
            verdict: m.verdict,
            pa_attainment: attainment(p, PREFIX_AFFINITY),
            sa_attainment: attainment(p, SESSION_AFFINITY),
            below_pressure: p.below_pressure,
        });
    }
    missing(FIG1, lack)?;
    Ok(PressureData {
        ws_values: sorted_axis(pts.iter().map(|(_, ws, _)| *ws)),
        s_values: sorted_axis(pts.iter().map(|(_, _, s)| *s)),
        reps: Reps::of(&spreads)
            .ok_or_else(|| Error::Missing(format!("{FIG1}: no goodput to draw")))?,
        cells,
        no_data,
    })
}

impl PressureData {
    /// Exactly the numbers drawn.
    pub fn table(&self) -> Table {
        Table {
            header: vec![
                "point",
                "working_set_ratio",
                "zipf_s",
                "margin_rps",
                "margin_relative",
                "verdict",
                "prefix_affinity_attainment",
                "session_affinity_attainment",
                "below_pressure",
            ],
            rows: self
                .cells
                .iter()
                .map(|c| {
                    vec![
                        c.point.clone(),
                        num(c.working_set_ratio),
                        num(c.zipf_s),
                        num(c.margin_rps),
                        opt(c.relative),
                        c.verdict.as_str().to_string(),
                        opt(c.pa_attainment),
                        opt(c.sa_attainment),
                        c.below_pressure.to_string(),
                    ]
                })
                .chain(self.no_data.iter().map(no_data_row::<2, 3>))
                .collect(),
        }
    }
}

/// A CSV row for a cell drawn without numbers: point and axes, `EMPTY` empty fields, the
/// verdict column saying why, then `AFTER` empty fields.
fn no_data_row<const EMPTY: usize, const AFTER: usize>(c: &NoDataCell) -> Vec<String> {
    let mut row = vec![c.point.clone(), num(c.working_set_ratio), num(c.zipf_s)];
    row.extend(std::iter::repeat_n(String::new(), EMPTY));
    row.push(NO_ACCEPTED_REPS.to_string());
    row.extend(std::iter::repeat_n(String::new(), AFTER));
    row
}

/// One cell of the winners map.
#[derive(Debug, Clone, PartialEq)]
pub struct WinnerCell {
    /// Point name.
    pub point: String,
    /// Working set ÷ KV capacity.
    pub working_set_ratio: f64,
    /// Zipf exponent.
    pub zipf_s: f64,
    /// Highest median goodput.
    pub winner: String,
    /// Its median, req/s.
    pub winner_rps: f64,
    /// Second highest.
    pub runner_up: String,
    /// Its median, req/s.
    pub runner_up_rps: f64,
    /// Winner vs runner-up.
    pub verdict: Verdict,
    /// The winner's median SLO attainment.
    pub winner_attainment: Option<f64>,
    /// The runner-up's median SLO attainment.
    pub runner_up_attainment: Option<f64>,
    /// The report's flag: every policy met its SLO here, so the winner won on throughput.
    pub below_pressure: bool,
}

/// Figure 2: the winner and runner-up at every grid point.
#[derive(Debug, Clone, PartialEq)]
pub struct WinnersData {
    /// Working-set ratios, ascending.
    pub ws_values: Vec<f64>,
    /// Skews, ascending.
    pub s_values: Vec<f64>,
    /// One per grid point with a winner and a runner-up.
    pub cells: Vec<WinnerCell>,
    /// Points without a runner-up because policies' repetitions were all set aside.
    pub no_data: Vec<NoDataCell>,
    /// Repetitions behind the winners' and runners-up's medians.
    pub reps: Reps,
}

/// Picks figure 2's numbers: the report's winner, runner-up and their verdict per grid point.
pub fn winners(report: &Report) -> Result<WinnersData> {
    let pts = grid_points(report, FIG2)?;
    let mut cells = Vec::new();
    let mut no_data = Vec::new();
    let mut spreads = Vec::new();
    let mut lack = Vec::new();
    for (p, ws, s) in &pts {
        let (Some(w), Some(r), Some(v)) = (&p.winner, &p.runner_up, p.winner_verdict) else {
            let aside: Vec<String> = p
                .cells
                .iter()
                .filter(|c| all_set_aside(p, &c.policy))
                .map(|c| c.policy.clone())
                .collect();
            if !aside.is_empty() {
                no_data.push(NoDataCell::new(p, *ws, *s, aside));
                continue;
            }
            lack.push(format!(
                "point `{}` has fewer than two policies with goodput (a winner needs a runner-up)",
                p.point
            ));
            continue;
        };
        spreads.extend(goodput(p, &w.policy));
        spreads.extend(goodput(p, &r.policy));
        cells.push(WinnerCell {
            point: p.point.clone(),
            working_set_ratio: *ws,
            zipf_s: *s,
            winner: w.policy.clone(),
            winner_rps: w.goodput_median_rps,
            runner_up: r.policy.clone(),
            runner_up_rps: r.goodput_median_rps,
            verdict: v,
            winner_attainment: attainment(p, &w.policy),
            runner_up_attainment: attainment(p, &r.policy),
            below_pressure: p.below_pressure,
        });
    }
    missing(FIG2, lack)?;
    Ok(WinnersData {
        ws_values: sorted_axis(pts.iter().map(|(_, ws, _)| *ws)),
        s_values: sorted_axis(pts.iter().map(|(_, _, s)| *s)),
        reps: Reps::of(&spreads)
            .ok_or_else(|| Error::Missing(format!("{FIG2}: no goodput to draw")))?,
        cells,
        no_data,
    })
}

impl WinnersData {
    /// Exactly the numbers drawn.
    pub fn table(&self) -> Table {
        Table {
            header: vec![
                "point",
                "working_set_ratio",
                "zipf_s",
                "winner",
                "winner_goodput_median_rps",
                "runner_up",
                "runner_up_goodput_median_rps",
                "verdict",
                "winner_attainment",
                "runner_up_attainment",
                "below_pressure",
            ],
            rows: self
                .cells
                .iter()
                .map(|c| {
                    vec![
                        c.point.clone(),
                        num(c.working_set_ratio),
                        num(c.zipf_s),
                        c.winner.clone(),
                        num(c.winner_rps),
                        c.runner_up.clone(),
                        num(c.runner_up_rps),
                        c.verdict.as_str().to_string(),
                        opt(c.winner_attainment),
                        opt(c.runner_up_attainment),
                        c.below_pressure.to_string(),
                    ]
                })
                .chain(self.no_data.iter().map(no_data_row::<4, 3>))
                .collect(),
        }
    }
}

/// What a marker of figure 3 stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MechRole {
    /// prefix-affinity (spill on, the default).
    SpillOn,
    /// prefix-affinity-spill-off.
    SpillOff,
    /// session-affinity, drawn as the reference the hit-rate difference is read against.
    Reference,
}

impl MechRole {
    /// As the CSV and legend write it.
    pub fn as_str(&self) -> &'static str {
        match self {
            MechRole::SpillOn => "spill on",
            MechRole::SpillOff => "spill off",
            MechRole::Reference => "reference",
        }
    }
}

/// One marker of figure 3.
#[derive(Debug, Clone, PartialEq)]
pub struct MechMarker {
    /// Point name.
    pub point: String,
    /// Policy.
    pub policy: String,
    /// Role.
    pub role: MechRole,
    /// Busiest replica's share of requests.
    pub busiest_share: Spread,
    /// Engine prefix-hit rate.
    pub prefix_hit_rate: Spread,
}

/// Figure 3: engine prefix-hit rate against the busiest replica's share, spill on vs off, with
/// session-affinity at the same points as the reference the difference is read against.
#[derive(Debug, Clone, PartialEq)]
pub struct MechanismData {
    /// Markers, by point then role.
    pub markers: Vec<MechMarker>,
    /// `point policy` of arms not drawn because every repetition was set aside.
    pub not_drawn: Vec<String>,
    /// Repetitions behind the medians.
    pub reps: Reps,
}

/// Picks figure 3's numbers (all turns): at every point where the spill-off arm ran, both arms'
/// busiest share and prefix-hit rate, and session-affinity's where it ran.
pub fn mechanism(report: &Report) -> Result<MechanismData> {
    let pts: Vec<&Point> = report
        .points
        .iter()
        .filter(|p| has_cell(p, PREFIX_AFFINITY_SPILL_OFF))
        .collect();
    if pts.is_empty() {
        fail!(
            Missing,
            "{FIG3}: missing data: no point of sweep `{}` has a `{PREFIX_AFFINITY_SPILL_OFF}` cell (the spill-off arm); run the sweep with it",
            report.sweep
        );
    }
    let mut markers = Vec::new();
    let mut not_drawn = Vec::new();
    let mut lack = Vec::new();
    for p in pts {
        for (policy, role) in [
            (SESSION_AFFINITY, MechRole::Reference),
            (PREFIX_AFFINITY, MechRole::SpillOn),
            (PREFIX_AFFINITY_SPILL_OFF, MechRole::SpillOff),
        ] {
            let Some(cell) = cell(p, policy) else {
                if role != MechRole::Reference {
                    lack.push(format!("point `{}` has no `{policy}` cell", p.point));
                }
                continue;
            };
            if all_set_aside(p, policy) {
                not_drawn.push(format!("{} {policy}", p.point));
                continue;
            }
            let m = &cell.mechanism.all;
            match (m.busiest_share, m.prefix_hit_rate) {
                (Some(b), Some(h)) => markers.push(MechMarker {
                    point: p.point.clone(),
                    policy: policy.to_string(),
                    role,
                    busiest_share: b,
                    prefix_hit_rate: h,
                }),
                (b, h) if role != MechRole::Reference => {
                    let mut what = Vec::new();
                    if b.is_none() {
                        what.push("busiest-replica share (router.csv rows)");
                    }
                    if h.is_none() {
                        what.push("engine prefix-hit rate (cached_tokens)");
                    }
                    lack.push(format!(
                        "point `{}` `{policy}` has no {}",
                        p.point,
                        what.join(" and no ")
                    ));
                }
                _ => {}
            }
        }
    }
    missing(FIG3, lack)?;
    let spreads: Vec<Spread> = markers
        .iter()
        .flat_map(|m| [m.busiest_share, m.prefix_hit_rate])
        .collect();
    Ok(MechanismData {
        reps: Reps::of(&spreads)
            .ok_or_else(|| Error::Missing(format!("{FIG3}: nothing to draw")))?,
        markers,
        not_drawn,
    })
}

impl MechanismData {
    /// Exactly the numbers drawn.
    pub fn table(&self) -> Table {
        Table {
            header: vec![
                "point",
                "policy",
                "role",
                "busiest_share_median",
                "busiest_share_min",
                "busiest_share_max",
                "prefix_hit_rate_median",
                "prefix_hit_rate_min",
                "prefix_hit_rate_max",
            ],
            rows: self
                .markers
                .iter()
                .map(|m| {
                    let (b, h) = (m.busiest_share, m.prefix_hit_rate);
                    vec![
                        m.point.clone(),
                        m.policy.clone(),
                        m.role.as_str().to_string(),
                        num(b.median),
                        num(b.min),
                        num(b.max),
                        num(h.median),
                        num(h.min),
                        num(h.max),
                    ]
                })
                .collect(),
        }
    }
}

/// The rungs of the knowledge ladder, bottom up, with their labels; the last is optional.
pub const LADDER: [(&str, &str); 4] = [
    (PREFIX_HASH, "prefix-hash (no index)"),
    (PREFIX_AFFINITY, "believed (prefix-affinity)"),
    (EXACT_RESIDENCY, "exact (exact-residency)"),
    (EXACT_RESIDENCY_SPEC, "exact + speculative"),
];

/// One bar of figure 4.
#[derive(Debug, Clone, PartialEq)]
pub struct LadderBar {
    /// Point name.
    pub point: String,
    /// Policy.
    pub policy: String,
    /// Index into [`LADDER`].
    pub rung: usize,
    /// Goodput, req/s.
    pub goodput: Spread,
}

/// Figure 4: goodput by how much the router knows about the engines' caches.
#[derive(Debug, Clone, PartialEq)]
pub struct LadderData {
    /// Points in report order.
    pub points: Vec<String>,
    /// Bars by point, then rung.
    pub bars: Vec<LadderBar>,
    /// `point policy` of rungs not drawn because every repetition was set aside.
    pub not_drawn: Vec<String>,
    /// Repetitions behind the medians.
    pub reps: Reps,
}

/// Picks figure 4's numbers: at every point where a ladder arm (prefix-hash, exact-residency,
/// exact-residency-spec) ran, the goodput of prefix-hash, prefix-affinity and exact-residency
/// (required) and exact-residency-spec (drawn where it ran).
pub fn ladder(report: &Report) -> Result<LadderData> {
    let arms = [PREFIX_HASH, EXACT_RESIDENCY, EXACT_RESIDENCY_SPEC];
    let pts: Vec<&Point> = report
        .points
        .iter()
        .filter(|p| arms.iter().any(|a| has_cell(p, a)))
        .collect();
    if pts.is_empty() {
        fail!(
            Missing,
            "{FIG4}: missing data: no point of sweep `{}` has a `{PREFIX_HASH}`, `{EXACT_RESIDENCY}` or `{EXACT_RESIDENCY_SPEC}` cell",
            report.sweep
        );
    }
    let mut bars = Vec::new();
    let mut not_drawn = Vec::new();
    let mut lack = Vec::new();
    for p in &pts {
        for (rung, (policy, _)) in LADDER.iter().enumerate() {
            if all_set_aside(p, policy) {
                not_drawn.push(format!("{} {policy}", p.point));
                continue;
            }
            match goodput(p, policy) {
                Some(g) => bars.push(LadderBar {
                    point: p.point.clone(),
                    policy: policy.to_string(),
                    rung,
                    goodput: g,
                }),
                None if *policy != EXACT_RESIDENCY_SPEC => {
                    lack.push(format!("point `{}` has no {policy} goodput", p.point));
                }
                None => {}
            }
        }
    }
    missing(FIG4, lack)?;
    Ok(LadderData {
        points: pts.iter().map(|p| p.point.clone()).collect(),
        reps: Reps::of(bars.iter().map(|b| &b.goodput))
            .ok_or_else(|| Error::Missing(format!("{FIG4}: nothing to draw")))?,
        bars,
        not_drawn,
    })
}

impl LadderData {
    /// Exactly the numbers drawn.
    pub fn table(&self) -> Table {
        Table {
            header: vec![
                "point",
                "policy",
                "rung",
                "goodput_median_rps",
                "goodput_min_rps",
                "goodput_max_rps",
                "reps",
            ],
            rows: self
                .bars
                .iter()
                .map(|b| {
                    vec![
                        b.point.clone(),
                        b.policy.clone(),
                        LADDER[b.rung].1.to_string(),
                        num(b.goodput.median),
                        num(b.goodput.min),
                        num(b.goodput.max),
                        b.goodput.n.to_string(),
                    ]
                })
                .collect(),
        }
    }
}

/// One policy's belief divergence at one point (its repetitions' requests pooled by analysis).
#[derive(Debug, Clone, PartialEq)]
pub struct DivergenceBar {
    /// Point name.
    pub point: String,
    /// Policy.
    pub policy: String,
    /// Requests compared.
    pub compared: u64,
    /// Over-predicted requests.
    pub over_count: u64,
    /// Their mean size, tokens (`None` when there are none).
    pub over_tokens_mean: Option<f64>,
    /// Under-predicted requests.
    pub under_count: u64,
    /// Their mean size, tokens.
    pub under_tokens_mean: Option<f64>,
}

/// One band of prefix-affinity's belief decay at one point.
#[derive(Debug, Clone, PartialEq)]
pub struct DecayPoint {
    /// Point name.
    pub point: String,
    /// The point's working-set ratio, when its name carries one (styles the line).
    pub working_set_ratio: Option<f64>,
    /// The point's skew, when its name carries one (styles the marker).
    pub zipf_s: Option<f64>,
    /// Index of the band in the report's `by_gap` list.
    pub band: usize,
    /// Lower edge, s.
    pub lower_s: f64,
    /// Upper edge, s (`None`: open).
    pub upper_s: Option<f64>,
    /// Requests with a prediction in the band.
    pub requests: u64,
    /// Share of predicted tokens the engine honoured.
    pub honoured_share: f64,
}

/// Figure 5: belief divergence (over and under separately) and decay.
#[derive(Debug, Clone, PartialEq)]
pub struct BeliefData {
    /// Divergence bars by point, then policy.
    pub divergence: Vec<DivergenceBar>,
    /// Every band edge of the report's decay (lower edges), for the x axis.
    pub band_edges: Vec<(f64, Option<f64>)>,
    /// prefix-affinity's decay, by point then band; bands with no prediction are left out.
    pub decay: Vec<DecayPoint>,
    /// Repetitions behind the pooled numbers.
    pub reps: Reps,
}

/// Picks figure 5's numbers: divergence of every belief policy with compared requests, and
/// prefix-affinity's decay per point.
pub fn belief(report: &Report) -> Result<BeliefData> {
    let mut divergence = Vec::new();
    let mut decay = Vec::new();
    let mut spreads = Vec::new();
    let mut band_edges: Vec<(f64, Option<f64>)> = Vec::new();
    for p in &report.points {
        for c in p
            .cells
            .iter()
            .filter(|c| BELIEF_POLICIES.contains(&c.policy.as_str()))
        {
            let d = &c.divergence;
            if d.compared > 0 {
                spreads.extend(c.goodput_rps);
                divergence.push(DivergenceBar {
                    point: p.point.clone(),
                    policy: c.policy.clone(),
                    compared: d.compared,
                    over_count: d.over.count,
                    over_tokens_mean: d.over.tokens_mean,
                    under_count: d.under.count,
                    under_tokens_mean: d.under.tokens_mean,
                });
            }
            if c.policy == PREFIX_AFFINITY {
                if band_edges.is_empty() {
                    band_edges = c
                        .decay
                        .by_gap
                        .iter()
                        .map(|b| (b.lower_s, b.upper_s))
                        .collect();
                }
                for (band, b) in c.decay.by_gap.iter().enumerate() {
                    if let Some(share) = b.honoured_share {
                        decay.push(DecayPoint {
                            point: p.point.clone(),
                            working_set_ratio: p.axes.working_set_ratio,
                            zipf_s: p.axes.zipf_s,
                            band,
                            lower_s: b.lower_s,
                            upper_s: b.upper_s,
                            requests: b.requests,
                            honoured_share: share,
                        });
                    }
                }
            }
        }
    }
    let mut lack = Vec::new();
    if divergence.is_empty() {
        lack.push(format!(
            "no cell of {} has requests with both a predicted match (router.csv predicted_match_tokens) and engine cached tokens",
            BELIEF_POLICIES.join(", ")
        ));
    }
    if decay.is_empty() {
        lack.push(format!(
            "no `{PREFIX_AFFINITY}` cell has a decay band with predicted tokens (router.csv predicted_match_tokens > 0 after a session's first request)"
        ));
    }
    missing(FIG5, lack)?;
    Ok(BeliefData {
        divergence,
        band_edges,
        decay,
        reps: Reps::of(&spreads)
            .ok_or_else(|| Error::Missing(format!("{FIG5}: the compared cells have no goodput")))?,
    })
}

/// A decay band in words: `0–1 s`, `300+ s`.
pub fn band_label(lower_s: f64, upper_s: Option<f64>) -> String {
    match upper_s {
        Some(u) => format!("{}–{} s", num(lower_s), num(u)),
        None => format!("{}+ s", num(lower_s)),
    }
}

impl BeliefData {
    /// Exactly the numbers drawn, both panels in one table (`panel` says which).
    pub fn table(&self) -> Table {
        let mut rows = Vec::new();
        for d in &self.divergence {
            for (panel, count, mean) in [
                ("over", d.over_count, d.over_tokens_mean),
                ("under", d.under_count, d.under_tokens_mean),
            ] {
                rows.push(vec![
                    panel.to_string(),
                    d.point.clone(),
                    d.policy.clone(),
                    String::new(),
                    d.compared.to_string(),
                    count.to_string(),
                    opt(mean),
                    String::new(),
                ]);
            }
        }
        for k in &self.decay {
            rows.push(vec![
                "decay".to_string(),
                k.point.clone(),
                PREFIX_AFFINITY.to_string(),
                band_label(k.lower_s, k.upper_s),
                String::new(),
                k.requests.to_string(),
                String::new(),
                num(k.honoured_share),
            ]);
        }
        Table {
            header: vec![
                "panel",
                "point",
                "policy",
                "since_last_served",
                "compared",
                "requests",
                "tokens_mean",
                "honoured_share",
            ],
            rows,
        }
    }
}

/// A replica outage: `[down_s, up_s)`, `up_s` `None` when it did not come back in the timeline.
pub type Outage = (f64, Option<f64>);

/// Figure 6: goodput per second through a replica kill and restart, per policy.
#[derive(Debug, Clone, PartialEq)]
pub struct TimelineData {
    /// One series per policy.
    pub series: Vec<PolicyTimeline>,
}

/// Picks figure 6's numbers. Every series must show the replica down and up again.
pub fn timeline(input: &FaultInput) -> Result<TimelineData> {
    let mut lack = Vec::new();
    for s in &input.series {
        if s.rows.iter().all(|r| r.replica_alive) {
            lack.push(format!(
                "`{}` never has replica_alive = 0 (no kill in its timeline)",
                s.policy
            ));
        }
    }
    missing(FIG6, lack)?;
    Ok(TimelineData {
        series: input.series.clone(),
    })
}

impl TimelineData {
    /// Exactly the numbers drawn.
    pub fn table(&self) -> Table {
        Table {
            header: vec![
                "policy",
                "t_s",
                "goodput_rps",
                "replica_alive",
                "goodput_min_rps",
                "goodput_max_rps",
                "rolling_s",
            ],
            rows: self
                .series
                .iter()
                .flat_map(|s| {
                    s.rows.iter().map(|r| {
                        vec![
                            s.policy.clone(),
                            num(r.t_s),
                            num(r.goodput_rps),
                            u8::from(r.replica_alive).to_string(),
                            opt(r.band.map(|b| b.0)),
                            opt(r.band.map(|b| b.1)),
                            opt(r.rolling_s),
                        ]
                    })
                })
                .collect(),
        }
    }

    /// The rolling window every row states, s (`None` when the timeline has none, or when its
    /// rows disagree — then the caption says per second).
    pub fn rolling_s(&self) -> Option<f64> {
        let mut all = self
            .series
            .iter()
            .flat_map(|s| s.rows.iter().map(|r| r.rolling_s));
        let first = all.next()??;
        all.all(|r| r == Some(first)).then_some(first)
    }

    /// Repetitions behind the series.
    pub fn reps(&self) -> Reps {
        Reps {
            min: self.series.iter().map(|s| s.reps).min().unwrap_or(0),
            max: self.series.iter().map(|s| s.reps).max().unwrap_or(0),
        }
    }

    /// Intervals `[down, up)` in which `series`' replica was down (`up` is `None` if it never
    /// came back within the timeline).
    pub fn outages(series: &PolicyTimeline) -> Vec<Outage> {
        let mut out = Vec::new();
        let mut down: Option<f64> = None;
        for r in &series.rows {
            match (r.replica_alive, down) {
                (false, None) => down = Some(r.t_s),
                (true, Some(d)) => {
                    out.push((d, Some(r.t_s)));
                    down = None;
                }
                _ => {}
            }
        }
        if let Some(d) = down {
            out.push((d, None));
        }
        out
    }
}

/// Name of figure 7 in messages.
pub const FIG7: &str = "figure 7 (load curve)";

/// The knee of one policy's attainment curve: walking the offered rates upwards, the last rate
/// at which the median attainment is at or above [`ATTAINMENT_TARGET`] before the first rate at
/// which it is not ("the highest rate where the policy still meets it"). `None` when the lowest
/// rate already misses it. `points` are `(offered rate, median attainment)` in any order.
pub fn knee(points: &[(f64, f64)]) -> Option<f64> {
    let mut sorted = points.to_vec();
    sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
    sorted
        .iter()
        .take_while(|(_, attainment)| *attainment >= ATTAINMENT_TARGET)
        .last()
        .map(|(rate, _)| *rate)
}

/// One point of a policy's load curve.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadPoint {
    /// Point name.
    pub point: String,
    /// What it offered.
    pub offered: Offered,
    /// Goodput, wall req/s.
    pub goodput: Spread,
    /// SLO attainment (share of measured requests meeting the SLO).
    pub attainment: Spread,
}

/// One policy's load curve.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadSeries {
    /// Policy name.
    pub policy: String,
    /// Its points by offered rate, ascending.
    pub points: Vec<LoadPoint>,
    /// [`knee`] of its median attainments, wall req/s; `None` when it misses at every rate.
    pub knee_wall_rps: Option<f64>,
}

/// Figure 7: goodput and SLO attainment against offered load, per policy, knees marked.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadCurveData {
    /// One per policy, in the report's policy order.
    pub series: Vec<LoadSeries>,
    /// The calibrated capacity the fractions are of, model req/s (when recorded).
    pub capacity_rps: Option<f64>,
    /// `point policy` of cells not drawn because every repetition was set aside.
    pub not_drawn: Vec<String>,
    /// Repetitions behind the medians.
    pub reps: Reps,
}

/// Picks figure 7's numbers: for every policy, its goodput and attainment spreads at every point
/// of the load sweep, by offered rate, and its knee. Needs at least two offered rates.
pub fn load_curve(input: &LoadInput) -> Result<LoadCurveData> {
    let report = &input.report;
    if input.offered.len() < 2 {
        fail!(
            Missing,
            "{FIG7}: missing data: sweep `{}` has {} offered rate(s); a load curve needs at least two",
            report.sweep,
            input.offered.len()
        );
    }
    // Series in the tables' policy order (then by name), whatever order the points list their
    // cells in: the drawing order, and so each series' marker, is fixed by the policy alone.
    let mut policies: Vec<&str> = Vec::new();
    for p in &report.points {
        for c in &p.cells {
            if !policies.contains(&c.policy.as_str()) {
                policies.push(&c.policy);
            }
        }
    }
    policies.sort_by_key(|p| (crate::input::policy_rank(p), *p));
    let mut series = Vec::new();
    let mut not_drawn = Vec::new();
    let mut lack = Vec::new();
    for policy in policies {
        let mut points = Vec::new();
        for p in &report.points {
            let Some(cell) = cell(p, policy) else {
                continue;
            };
            if all_set_aside(p, policy) {
                not_drawn.push(format!("{} {policy}", p.point));
                continue;
            }
            let Some(offered) = input.offered.get(&p.point) else {
                lack.push(format!("point `{}` has no offered load", p.point));
                continue;
            };
            match (cell.goodput_rps, cell.slo_attainment) {
                (Some(goodput), Some(attainment)) => points.push(LoadPoint {
                    point: p.point.clone(),
                    offered: *offered,
                    goodput,
                    attainment,
                }),
                _ => lack.push(format!(
                    "point `{}` has no {policy} goodput or attainment",
                    p.point
                )),
            }
        }
        points.sort_by(|a, b| {
            a.offered
                .offered_wall_rps
                .total_cmp(&b.offered.offered_wall_rps)
        });
        let knee_wall_rps = knee(
            &points
                .iter()
                .map(|p| (p.offered.offered_wall_rps, p.attainment.median))
                .collect::<Vec<_>>(),
        );
        if !points.is_empty() {
            series.push(LoadSeries {
                policy: policy.to_string(),
                points,
                knee_wall_rps,
            });
        }
    }
    missing(FIG7, lack)?;
    let capacity_rps = input.offered.values().find_map(|o| o.capacity_rps);
    Ok(LoadCurveData {
        reps: Reps::of(
            series
                .iter()
                .flat_map(|s| s.points.iter().map(|p| &p.goodput)),
        )
        .ok_or_else(|| Error::Missing(format!("{FIG7}: nothing to draw")))?,
        series,
        capacity_rps,
        not_drawn,
    })
}

impl LoadCurveData {
    /// Exactly the numbers drawn; `knee` is 1 on the row of each policy's knee.
    pub fn table(&self) -> Table {
        Table {
            header: vec![
                "policy",
                "point",
                "load_fraction",
                "offered_rps",
                "offered_wall_rps",
                "goodput_median_rps",
                "goodput_min_rps",
                "goodput_max_rps",
                "attainment_median",
                "attainment_min",
                "attainment_max",
                "reps",
                "knee",
            ],
            rows: self
                .series
                .iter()
                .flat_map(|s| {
                    s.points.iter().map(move |p| {
                        vec![
                            s.policy.clone(),
                            p.point.clone(),
                            opt(p.offered.load_fraction),
                            num(p.offered.offered_rps),
                            num(p.offered.offered_wall_rps),
                            num(p.goodput.median),
                            num(p.goodput.min),
                            num(p.goodput.max),
                            num(p.attainment.median),
                            num(p.attainment.min),
                            num(p.attainment.max),
                            p.goodput.n.to_string(),
                            u8::from(s.knee_wall_rps == Some(p.offered.offered_wall_rps))
                                .to_string(),
                        ]
                    })
                })
                .collect(),
        }
    }
}

/// Name of figure 8 in messages.
pub const FIG8: &str = "figure 8 (N routers)";

/// How a cell of an N-router sweep was run, read from its cell name: `r<N>-<front>-<policy>`,
/// `r<N>-<front>-share-<policy>` or `r<N>-<front>-share-loads-<policy>` (`xtask sweep …
/// --routers N --front rr|hash [--share-decisions [--share-loads]]`); any other name is one
/// router in front of the fleet, `N = 1`, which has no front balancer and nobody to share with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouterArm {
    /// Routers behind the front balancer.
    pub routers: u32,
    /// The front balancer's rule (`rr`, `hash`); empty for one router.
    pub front: String,
    /// Whether the routers shared their routing decisions.
    pub share: bool,
    /// Whether they shared their load view too.
    pub share_loads: bool,
    /// The routing policy every router ran.
    pub policy: String,
}

impl RouterArm {
    /// Parses a cell (policy directory) name; see [`RouterArm`].
    pub fn of_cell(name: &str) -> RouterArm {
        let single = || RouterArm {
            routers: 1,
            front: String::new(),
            share: false,
            share_loads: false,
            policy: name.to_string(),
        };
        let Some(rest) = name.strip_prefix('r') else {
            return single();
        };
        let Some((n, rest)) = rest.split_once('-') else {
            return single();
        };
        let (Ok(routers), Some((front, rest))) = (n.parse::<u32>(), rest.split_once('-')) else {
            return single();
        };
        let (share, share_loads, policy) = match rest.strip_prefix("share-") {
            Some(p) => match p.strip_prefix("loads-") {
                Some(p) => (true, true, p),
                None => (true, false, p),
            },
            None => (false, false, rest),
        };
        RouterArm {
            routers,
            front: front.to_string(),
            share,
            share_loads,
            policy: policy.to_string(),
        }
    }

    /// The arm's line style in figure 8: 0 round-robin front (solid), 1 session-hash front
    /// (dashed), 2 and 3 shared decisions behind the round-robin or the session-hash front
    /// (dotted; square or diamond markers), 4 and 5 shared decisions and loads behind either
    /// (long dashes; cross or ring markers), as the figure's caption says.
    pub fn style(&self) -> usize {
        let hash = usize::from(self.front == "hash");
        match (self.share, self.share_loads) {
            (true, true) => 4 + hash,
            (true, false) => 2 + hash,
            _ => hash,
        }
    }

    /// The arm's label in the legend: the front balancer, `+ shared decisions` when shared.
    pub fn arm_label(&self) -> String {
        let front = match self.front.as_str() {
            "rr" => "round-robin front",
            "hash" => "session-hash front",
            other => other,
        };
        match (self.share, self.share_loads) {
            (true, true) => format!("{front} + shared decisions and loads"),
            (true, false) => format!("{front} + shared decisions"),
            _ => front.to_string(),
        }
    }
}

/// One router count of an arm.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutersPoint {
    /// Routers.
    pub routers: u32,
    /// The cell it was measured in.
    pub cell: String,
    /// Engine prefix-hit rate.
    pub hit_rate: Spread,
    /// Goodput, wall req/s.
    pub goodput: Spread,
    /// SLO attainment.
    pub attainment: Spread,
}

/// One policy under one arm (front balancer, sharing) against the number of routers. Its
/// `N = 1` point is one router behind the same front (`r1-<front>-<policy>`) when the sweep ran
/// it, else the policy's single router without a front.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutersSeries {
    /// The routing policy.
    pub policy: String,
    /// The front balancer ([`RouterArm::front`]).
    pub front: String,
    /// [`RouterArm::arm_label`].
    pub arm: String,
    /// [`RouterArm::style`]: its line style.
    pub arm_index: usize,
    /// By router count, ascending.
    pub points: Vec<RoutersPoint>,
}

/// Figure 8: engine prefix-hit rate and goodput against the number of routers sharing one
/// fleet, per policy and arm.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutersData {
    /// The point (workload at its load) every cell ran.
    pub point: String,
    /// The series.
    pub series: Vec<RoutersSeries>,
    /// Cells not drawn because every repetition was set aside.
    pub not_drawn: Vec<String>,
    /// Repetitions behind the medians.
    pub reps: Reps,
}

/// Picks figure 8's numbers from a sweep of one point whose cells are named as
/// [`RouterArm::of_cell`] reads them. Needs exactly one point and at least one cell with more
/// than one router.
pub fn routers(report: &Report) -> Result<RoutersData> {
    let p = only_point(
        report,
        FIG8,
        "an N-router sweep runs one point (its policies are the arms)",
    )?;
    let mut points: Vec<(RouterArm, RoutersPoint)> = Vec::new();
    let mut not_drawn = Vec::new();
    let mut lack = Vec::new();
    for c in &p.cells {
        if all_set_aside(p, &c.policy) {
            not_drawn.push(format!("{} {}", p.point, c.policy));
            continue;
        }
        match (
            c.mechanism.all.prefix_hit_rate,
            c.goodput_rps,
            c.slo_attainment,
        ) {
            (Some(hit_rate), Some(goodput), Some(attainment)) => {
                let arm = RouterArm::of_cell(&c.policy);
                points.push((
                    arm.clone(),
                    RoutersPoint {
                        routers: arm.routers,
                        cell: c.policy.clone(),
                        hit_rate,
                        goodput,
                        attainment,
                    },
                ));
            }
            _ => lack.push(format!(
                "cell `{}` has no hit rate, goodput or attainment",
                c.policy
            )),
        }
    }
    missing(FIG8, lack)?;
    let mut series: Vec<RoutersSeries> = Vec::new();
    for (arm, pt) in points.iter().filter(|(a, _)| a.routers > 1) {
        let label = arm.arm_label();
        let arm_index = arm.style();
        match series
            .iter_mut()
            .find(|s| s.policy == arm.policy && s.arm == label)
        {
            Some(s) => s.points.push(pt.clone()),
            None => series.push(RoutersSeries {
                policy: arm.policy.clone(),
                front: arm.front.clone(),
                arm: label,
                arm_index,
                points: vec![pt.clone()],
            }),
        }
    }
    if series.is_empty() {
        fail!(
            Missing,
            "{FIG8}: missing data: sweep `{}` has no cell with more than one router (cells named r<N>-<front>-<policy>)",
            report.sweep
        );
    }
    for s in &mut series {
        // N = 1: one router behind the same front when that was measured (it isolates the
        // front's own cost), else the single router without a front.
        let one = |front: &str| {
            points.iter().find(|(a, _)| {
                a.routers == 1 && a.policy == s.policy && a.front == front && !a.share
            })
        };
        if let Some((_, one)) = one(&s.front).or_else(|| one("")) {
            s.points.push(one.clone());
        }
        s.points.sort_by_key(|p| p.routers);
    }
    Ok(RoutersData {
        point: p.point.clone(),
        reps: Reps::of(points.iter().map(|(_, p)| &p.goodput))
            .ok_or_else(|| Error::Missing(format!("{FIG8}: nothing to draw")))?,
        series,
        not_drawn,
    })
}

impl RoutersData {
    /// Exactly the numbers drawn (an `N = 1` cell once per arm that draws it).
    pub fn table(&self) -> Table {
        Table {
            header: vec![
                "policy",
                "arm",
                "routers",
                "cell",
                "hit_rate_median",
                "hit_rate_min",
                "hit_rate_max",
                "goodput_median_rps",
                "goodput_min_rps",
                "goodput_max_rps",
                "attainment_median",
                "attainment_min",
                "attainment_max",
                "reps",
            ],
            rows: self
                .series
                .iter()
                .flat_map(|s| {
                    s.points.iter().map(move |p| {
                        let mut row = vec![
                            s.policy.clone(),
                            s.arm.clone(),
                            p.routers.to_string(),
                            p.cell.clone(),
                        ];
                        for x in [&p.hit_rate, &p.goodput, &p.attainment] {
                            row.extend(spread_fields(x));
                        }
                        row.push(p.goodput.n.to_string());
                        row
                    })
                })
                .collect(),
        }
    }
}

/// Name of figure 9 in messages.
pub const FIG9: &str = "figure 9 (trace replay)";

/// One policy's bar group in figure 9.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceBar {
    /// Policy.
    pub policy: String,
    /// Goodput, wall req/s.
    pub goodput: Spread,
    /// SLO attainment.
    pub attainment: Spread,
    /// Engine prefix-hit rate.
    pub hit_rate: Spread,
    /// Whether a repetition was overloaded (its backlog grew through the window).
    pub overloaded: bool,
}

/// Figure 9: every policy replaying one trace: goodput, SLO attainment and engine prefix-hit rate.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceData {
    /// The point (the trace slice and its mapping, e.g. `b32-x1`).
    pub point: String,
    /// One per policy, in the report's policy order.
    pub bars: Vec<TraceBar>,
    /// Policies not drawn because every repetition was set aside.
    pub not_drawn: Vec<String>,
    /// Repetitions behind the medians.
    pub reps: Reps,
}

/// Picks figure 9's numbers from a trace sweep (`xtask sweep trace`): its one point, every
/// policy's goodput, attainment and hit rate.
pub fn trace_replay(report: &Report) -> Result<TraceData> {
    let p = only_point(report, FIG9, "a trace sweep replays one slice (one point)")?;
    let mut bars = Vec::new();
    let mut not_drawn = Vec::new();
    let mut lack = Vec::new();
    for c in &p.cells {
        if all_set_aside(p, &c.policy) {
            not_drawn.push(format!("{} {}", p.point, c.policy));
            continue;
        }
        match (
            c.goodput_rps,
            c.slo_attainment,
            c.mechanism.all.prefix_hit_rate,
        ) {
            (Some(goodput), Some(attainment), Some(hit_rate)) => bars.push(TraceBar {
                policy: c.policy.clone(),
                goodput,
                attainment,
                hit_rate,
                overloaded: !c.overloaded.is_empty(),
            }),
            _ => lack.push(format!(
                "point `{}` has no {} goodput, attainment or hit rate",
                p.point, c.policy
            )),
        }
    }
    missing(FIG9, lack)?;
    Ok(TraceData {
        point: p.point.clone(),
        reps: Reps::of(bars.iter().map(|b| &b.goodput))
            .ok_or_else(|| Error::Missing(format!("{FIG9}: nothing to draw")))?,
        bars,
        not_drawn,
    })
}

impl TraceData {
    /// Exactly the numbers drawn.
    pub fn table(&self) -> Table {
        Table {
            header: vec![
                "policy",
                "goodput_median_rps",
                "goodput_min_rps",
                "goodput_max_rps",
                "attainment_median",
                "attainment_min",
                "attainment_max",
                "hit_rate_median",
                "hit_rate_min",
                "hit_rate_max",
                "overloaded",
                "reps",
            ],
            rows: self
                .bars
                .iter()
                .map(|b| {
                    let mut row = vec![b.policy.clone()];
                    for x in [&b.goodput, &b.attainment, &b.hit_rate] {
                        row.extend(spread_fields(x));
                    }
                    row.push(u8::from(b.overloaded).to_string());
                    row.push(b.goodput.n.to_string());
                    row
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::TimelineRow;

    #[test]
    fn the_knee_is_the_last_meeting_rate_before_the_first_miss() {
        assert_eq!(knee(&[(1.0, 0.99), (2.0, 0.95), (3.0, 0.7)]), Some(2.0));
        // Unsorted input, and the target itself meets it.
        assert_eq!(knee(&[(3.0, 0.7), (1.0, 0.99), (2.0, 0.9)]), Some(2.0));
        // A rate above a miss that meets again does not move the knee: "still meets".
        assert_eq!(knee(&[(1.0, 0.95), (2.0, 0.85), (3.0, 0.92)]), Some(1.0));
        // Meets everywhere: the highest rate; misses at the lowest: no knee.
        assert_eq!(knee(&[(1.0, 0.95), (2.0, 0.91)]), Some(2.0));
        assert_eq!(knee(&[(1.0, 0.5), (2.0, 0.95)]), None);
        assert_eq!(knee(&[]), None);
    }

    #[test]
    fn reps_text_names_one_count_or_a_range() {
        assert_eq!(
            Reps { min: 3, max: 3 }.text(),
            "3 reps per cell (median, min–max)"
        );
        assert_eq!(
            Reps { min: 2, max: 3 }.text(),
            "2–3 reps per cell (median, min–max)"
        );
        assert_eq!(
            Reps { min: 1, max: 1 }.text(),
            "1 rep per cell (median, min–max)"
        );
    }

    #[test]
    fn band_labels_close_the_open_band() {
        assert_eq!(band_label(0.0, Some(1.0)), "0–1 s");
        assert_eq!(band_label(300.0, None), "300+ s");
    }

    #[test]
    fn outages_pair_kills_with_restarts() {
        let row = |t_s: f64, alive: bool| TimelineRow {
            t_s,
            goodput_rps: 1.0,
            replica_alive: alive,
            band: None,
            rolling_s: None,
        };
        let s = PolicyTimeline {
            policy: "p".into(),
            reps: 1,
            rows: vec![
                row(0.0, true),
                row(1.0, false),
                row(2.0, false),
                row(3.0, true),
                row(4.0, false),
            ],
        };
        assert_eq!(
            TimelineData::outages(&s),
            vec![(1.0, Some(3.0)), (4.0, None)]
        );
    }

    #[test]
    fn router_cells_name_their_arm() {
        let a = RouterArm::of_cell("r4-rr-share-prefix-affinity");
        assert_eq!(
            (a.routers, a.front.as_str(), a.share, a.policy.as_str()),
            (4, "rr", true, "prefix-affinity")
        );
        assert_eq!(a.arm_label(), "round-robin front + shared decisions");
        let styles: Vec<usize> = [
            "r2-rr-p",
            "r2-hash-p",
            "r2-rr-share-p",
            "r2-hash-share-p",
            "r2-rr-share-loads-p",
            "r2-hash-share-loads-p",
        ]
        .iter()
        .map(|c| RouterArm::of_cell(c).style())
        .collect();
        assert_eq!(styles, [0, 1, 2, 3, 4, 5], "each arm its own look");
        let l = RouterArm::of_cell("r8-hash-share-loads-prefix-affinity");
        assert_eq!(
            (l.routers, l.share, l.share_loads, l.policy.as_str()),
            (8, true, true, "prefix-affinity")
        );
        assert_eq!(
            l.arm_label(),
            "session-hash front + shared decisions and loads"
        );
        let b = RouterArm::of_cell("r8-hash-session-affinity");
        assert_eq!(
            (b.routers, b.front.as_str(), b.share, b.policy.as_str()),
            (8, "hash", false, "session-affinity")
        );
        // A policy name that starts with `r` is one router, not a parse of its words.
        for single in ["round-robin", "prefix-affinity", "rx-rr-p"] {
            let c = RouterArm::of_cell(single);
            assert_eq!((c.routers, c.policy.as_str()), (1, single));
        }
    }

    #[test]
    fn tables_quote_only_where_needed() {
        let t = Table {
            header: vec!["a", "b"],
            rows: vec![vec!["x,y".into(), "1".into()]],
        };
        assert_eq!(t.to_csv().unwrap(), "a,b\n\"x,y\",1\n");
    }
}

// ---------------------------------------------------------------------------------------------
// Each policy's own capacity (figure 10, and the first panels of figures 1 and 2), picked out of
// a per-policy capacity report (`analysis::capacity::CapacityReport`).

/// Name of figure 10 in messages.
pub const FIG10: &str = "figure 10 (policy capacity)";

/// The CSV value of the `verdict` column of the baseline's own row in figure 10.
pub const REFERENCE: &str = "reference";

/// The CSV value of the winners' verdict when several policies share the highest median.
pub const TIED: &str = "tied";

/// What a capacity figure says about the report it was drawn from (its subtitle).
#[derive(Debug, Clone, PartialEq)]
pub struct CapacityContext {
    /// The sweep the report belongs to.
    pub sweep: String,
    /// Where the numbers come from, in the report's words.
    pub basis: String,
    /// The baseline every ratio is taken over.
    pub baseline: String,
    /// The plan seeds.
    pub seeds: Vec<u64>,
    /// The searches' relative resolution.
    pub resolution: f64,
    /// Share of measured requests that must meet the SLO.
    pub target: f64,
    /// The analysis rules the report was built with.
    pub rules: String,
}

impl CapacityContext {
    fn of(r: &CapacityReport) -> CapacityContext {
        CapacityContext {
            sweep: r.sweep.clone(),
            basis: r.basis.clone(),
            baseline: r.baseline.clone(),
            seeds: r.seeds.clone(),
            resolution: r.resolution,
            target: r.target,
            rules: r.rules.clone(),
        }
    }

    /// `3 plan seeds (7, 8, 9)`.
    pub fn seeds_text(&self) -> String {
        let list: Vec<String> = self.seeds.iter().map(u64::to_string).collect();
        let unit = if self.seeds.len() == 1 {
            "plan seed"
        } else {
            "plan seeds"
        };
        format!("{} {unit} ({})", self.seeds.len(), list.join(", "))
    }
}

/// The points of a capacity report with both axes parsed from their names; a point named
/// otherwise is refused, named.
fn capacity_points<'a>(
    r: &'a CapacityReport,
    figure: &str,
) -> Result<Vec<(&'a PointCapacities, f64, f64)>> {
    let mut out = Vec::new();
    let mut odd = Vec::new();
    for p in &r.points {
        let axes = analysis::report::point_axes(&p.point);
        match (axes.working_set_ratio, axes.zipf_s) {
            (Some(ws), Some(s)) => out.push((p, ws, s)),
            _ => odd.push(p.point.clone()),
        }
    }
    if !odd.is_empty() || out.is_empty() {
        fail!(
            Missing,
            "{figure}: every point of the capacity report of sweep `{}` must be named ws<ratio>-s<skew> (found: {})",
            r.sweep,
            if odd.is_empty() {
                "no point".to_string()
            } else {
                odd.join(", ")
            }
        );
    }
    Ok(out)
}

fn capacity_of<'a>(p: &'a PointCapacities, policy: &str) -> Option<&'a PolicyCapacity> {
    p.policies.iter().find(|c| c.policy == policy)
}

fn capacity_margin<'a>(p: &'a PointCapacities, policy: &str) -> Option<&'a CapacityMargin> {
    p.margins.iter().find(|m| m.policy == policy)
}

fn spread_opt_fields(x: Option<Spread>) -> [String; 3] {
    x.map_or_else(Default::default, |s| spread_fields(&s))
}

fn require_baseline(r: &CapacityReport, figure: &str) -> Result<()> {
    if r.baseline != SESSION_AFFINITY {
        fail!(
            Invalid,
            "{figure}: the capacity report of sweep `{}` takes its ratios over `{}`, not {SESSION_AFFINITY}",
            r.sweep,
            r.baseline
        );
    }
    Ok(())
}

/// One point of figure 1's capacity panel: prefix-affinity's own capacity against
/// session-affinity's.
#[derive(Debug, Clone, PartialEq)]
pub struct CapacityRatioCell {
    /// Point name.
    pub point: String,
    /// Working set ÷ KV capacity.
    pub working_set_ratio: f64,
    /// Zipf exponent.
    pub zipf_s: f64,
    /// Prefix-affinity's capacity over seeds (model req/s); `None` when no seed is bracketed.
    pub prefix_affinity: Option<Spread>,
    /// Session-affinity's.
    pub session_affinity: Option<Spread>,
    /// The report's ratio of the medians (prefix-affinity ÷ session-affinity).
    pub ratio: Option<f64>,
    /// The report's verdict between the two.
    pub verdict: CapacityVerdict,
}

/// Figure 1's capacity panel.
#[derive(Debug, Clone, PartialEq)]
pub struct CapacityRatioData {
    /// The report's context.
    pub context: CapacityContext,
    /// Working-set ratios, ascending.
    pub ws_values: Vec<f64>,
    /// Skews, ascending.
    pub s_values: Vec<f64>,
    /// One per point, in the report's order.
    pub cells: Vec<CapacityRatioCell>,
}

/// Picks figure 1's capacity panel: at every point of the capacity report, prefix-affinity's
/// and session-affinity's capacity (median [min–max] over seeds) and the report's ratio and
/// verdict between them. A point without either policy fails, named.
pub fn pressure_capacity(r: &CapacityReport) -> Result<CapacityRatioData> {
    require_baseline(r, FIG1)?;
    let pts = capacity_points(r, FIG1)?;
    let mut cells = Vec::new();
    let mut lack = Vec::new();
    for (p, ws, s) in &pts {
        let (pa, sa) = (
            capacity_of(p, PREFIX_AFFINITY),
            capacity_of(p, SESSION_AFFINITY),
        );
        let m = capacity_margin(p, PREFIX_AFFINITY);
        for (name, there) in [
            (PREFIX_AFFINITY, pa.is_some()),
            (SESSION_AFFINITY, sa.is_some()),
        ] {
            if !there {
                lack.push(format!(
                    "point `{}` of the capacity report has no {name} capacity",
                    p.point
                ));
            }
        }
        let (Some(pa), Some(sa)) = (pa, sa) else {
            continue;
        };
        let Some(m) = m else {
            lack.push(format!(
                "point `{}` of the capacity report has no margin of {PREFIX_AFFINITY} over {SESSION_AFFINITY}",
                p.point
            ));
            continue;
        };
        cells.push(CapacityRatioCell {
            point: p.point.clone(),
            working_set_ratio: *ws,
            zipf_s: *s,
            prefix_affinity: pa.spread,
            session_affinity: sa.spread,
            ratio: m.ratio,
            verdict: m.verdict,
        });
    }
    missing(FIG1, lack)?;
    Ok(CapacityRatioData {
        context: CapacityContext::of(r),
        ws_values: sorted_axis(pts.iter().map(|(_, ws, _)| *ws)),
        s_values: sorted_axis(pts.iter().map(|(_, _, s)| *s)),
        cells,
    })
}

impl CapacityRatioData {
    /// Exactly the numbers drawn.
    pub fn table(&self) -> Table {
        Table {
            header: vec![
                "point",
                "working_set_ratio",
                "zipf_s",
                "prefix_affinity_capacity_median_rps",
                "prefix_affinity_capacity_min_rps",
                "prefix_affinity_capacity_max_rps",
                "session_affinity_capacity_median_rps",
                "session_affinity_capacity_min_rps",
                "session_affinity_capacity_max_rps",
                "capacity_ratio",
                "verdict",
            ],
            rows: self
                .cells
                .iter()
                .map(|c| {
                    let mut row = vec![c.point.clone(), num(c.working_set_ratio), num(c.zipf_s)];
                    row.extend(spread_opt_fields(c.prefix_affinity));
                    row.extend(spread_opt_fields(c.session_affinity));
                    row.push(opt(c.ratio));
                    row.push(c.verdict.as_str().to_string());
                    row
                })
                .collect(),
        }
    }
}

/// One point of figure 2's capacity panel: the policy (or policies, tied) with the highest
/// median capacity, against session-affinity and against the runner-up.
#[derive(Debug, Clone, PartialEq)]
pub struct CapacityWinnerCell {
    /// Point name.
    pub point: String,
    /// Working set ÷ KV capacity.
    pub working_set_ratio: f64,
    /// Zipf exponent.
    pub zipf_s: f64,
    /// The report's best: the policies with the highest median capacity, in table order
    /// (several when tied; none unless every policy is bracketed).
    pub best: Vec<String>,
    /// Their median capacity (model req/s).
    pub median: Option<f64>,
    /// The winner's [min–max] over seeds, when there is one winner.
    pub spread: Option<Spread>,
    /// Session-affinity is among the best.
    pub baseline_among_best: bool,
    /// The best's ratio to session-affinity (the report's margin; equal medians share it);
    /// `None` when session-affinity is among them.
    pub ratio: Option<f64>,
    /// The report's verdicts of the best over session-affinity, distinct, in order; empty when
    /// session-affinity is among them.
    pub vs_baseline: Vec<CapacityVerdict>,
    /// With one winner: the policy with the next highest median (the first in table order
    /// where several share it) and its capacity.
    pub runner_up: Option<(String, Spread)>,
    /// The winner against the runner-up (`analysis::capacity::verdict` at the report's
    /// resolution); `None` when tied or when there is no runner-up.
    pub verdict: Option<CapacityVerdict>,
}

impl CapacityWinnerCell {
    /// The verdict column: the winner against the runner-up, [`TIED`], or why there is none.
    pub fn verdict_text(&self) -> &'static str {
        match (self.best.len(), self.verdict) {
            (0, _) => CapacityVerdict::NotBracketed.as_str(),
            (1, Some(v)) => v.as_str(),
            (1, None) => "no runner-up",
            _ => TIED,
        }
    }

    /// The verdicts over session-affinity as one field (`/`-joined), `baseline among the best`
    /// when it is.
    pub fn vs_baseline_text(&self) -> String {
        if self.baseline_among_best {
            return "baseline among the best".to_string();
        }
        self.vs_baseline
            .iter()
            .map(|v| v.as_str())
            .collect::<Vec<_>>()
            .join("/")
    }
}

/// Figure 2's capacity panel.
#[derive(Debug, Clone, PartialEq)]
pub struct CapacityWinnersData {
    /// The report's context.
    pub context: CapacityContext,
    /// Working-set ratios, ascending.
    pub ws_values: Vec<f64>,
    /// Skews, ascending.
    pub s_values: Vec<f64>,
    /// One per point, in the report's order.
    pub cells: Vec<CapacityWinnerCell>,
}

/// Picks figure 2's capacity panel: at every point, the report's best (the highest median
/// capacity), its ratio and verdict over session-affinity from the report's margins, and, with
/// one winner, the runner-up and the report's verdict rule between the two.
pub fn capacity_winners(r: &CapacityReport) -> Result<CapacityWinnersData> {
    require_baseline(r, FIG2)?;
    let pts = capacity_points(r, FIG2)?;
    let mut cells = Vec::new();
    let mut lack = Vec::new();
    for (p, ws, s) in &pts {
        let best: Vec<&PolicyCapacity> = p.best.iter().filter_map(|b| capacity_of(p, b)).collect();
        if best.len() != p.best.len() {
            lack.push(format!(
                "point `{}` of the capacity report names a best policy it has no capacity for",
                p.point
            ));
            continue;
        }
        let baseline_among_best = p.best.iter().any(|b| b == SESSION_AFFINITY);
        let margins: Vec<&CapacityMargin> = p
            .best
            .iter()
            .filter(|b| *b != SESSION_AFFINITY)
            .filter_map(|b| capacity_margin(p, b))
            .collect();
        let mut vs_baseline: Vec<CapacityVerdict> = Vec::new();
        if !baseline_among_best {
            for m in &margins {
                if !vs_baseline.contains(&m.verdict) {
                    vs_baseline.push(m.verdict);
                }
            }
        }
        let (runner_up, verdict) = match best.as_slice() {
            [w] => {
                let ru = p
                    .policies
                    .iter()
                    .filter(|c| c.policy != w.policy)
                    .filter_map(|c| c.spread.map(|s| (c, s)))
                    .fold(None::<(&PolicyCapacity, Spread)>, |acc, (c, s)| match acc {
                        Some((_, a)) if a.median >= s.median => acc,
                        _ => Some((c, s)),
                    });
                match ru {
                    Some((c, s)) => (
                        Some((c.policy.clone(), s)),
                        Some(analysis::capacity::verdict(w, c, r.resolution)),
                    ),
                    None => (None, None),
                }
            }
            _ => (None, None),
        };
        cells.push(CapacityWinnerCell {
            point: p.point.clone(),
            working_set_ratio: *ws,
            zipf_s: *s,
            best: p.best.clone(),
            median: best.first().and_then(|b| b.spread).map(|s| s.median),
            spread: match best.as_slice() {
                [w] => w.spread,
                _ => None,
            },
            baseline_among_best,
            ratio: if baseline_among_best {
                None
            } else {
                margins.first().and_then(|m| m.ratio)
            },
            vs_baseline,
            runner_up,
            verdict,
        });
    }
    missing(FIG2, lack)?;
    Ok(CapacityWinnersData {
        context: CapacityContext::of(r),
        ws_values: sorted_axis(pts.iter().map(|(_, ws, _)| *ws)),
        s_values: sorted_axis(pts.iter().map(|(_, _, s)| *s)),
        cells,
    })
}

impl CapacityWinnersData {
    /// Exactly the numbers drawn.
    pub fn table(&self) -> Table {
        Table {
            header: vec![
                "point",
                "working_set_ratio",
                "zipf_s",
                "winner",
                "winner_capacity_median_rps",
                "winner_capacity_min_rps",
                "winner_capacity_max_rps",
                "winner_vs_session_affinity",
                "winner_vs_session_affinity_verdict",
                "runner_up",
                "runner_up_capacity_median_rps",
                "verdict",
            ],
            rows: self
                .cells
                .iter()
                .map(|c| {
                    let mut row = vec![
                        c.point.clone(),
                        num(c.working_set_ratio),
                        num(c.zipf_s),
                        c.best.join(";"),
                        opt(c.median),
                    ];
                    row.extend(
                        c.spread
                            .map_or_else(Default::default, |s| [num(s.min), num(s.max)]),
                    );
                    row.push(opt(c.ratio));
                    row.push(c.vs_baseline_text());
                    row.push(
                        c.runner_up
                            .as_ref()
                            .map(|r| r.0.clone())
                            .unwrap_or_default(),
                    );
                    row.push(opt(c.runner_up.as_ref().map(|r| r.1.median)));
                    row.push(c.verdict_text().to_string());
                    row
                })
                .collect(),
        }
    }
}

/// One policy of one panel of figure 10.
#[derive(Debug, Clone, PartialEq)]
pub struct CapacityBar {
    /// The policy.
    pub policy: String,
    /// Its capacity over seeds (model req/s); `None` when no seed is bracketed.
    pub spread: Option<Spread>,
    /// The report's ratio to the baseline; `None` for the baseline itself.
    pub ratio: Option<f64>,
    /// The report's verdict over the baseline; `None` for the baseline itself.
    pub verdict: Option<CapacityVerdict>,
    /// Among the report's best at this point.
    pub best: bool,
}

impl CapacityBar {
    /// Whether this is the baseline's own bar.
    pub fn is_reference(&self) -> bool {
        self.verdict.is_none()
    }
}

/// One point of figure 10: every policy's bar.
#[derive(Debug, Clone, PartialEq)]
pub struct CapacityPanel {
    /// Point name.
    pub point: String,
    /// Working set ÷ KV capacity.
    pub working_set_ratio: f64,
    /// Zipf exponent.
    pub zipf_s: f64,
    /// The policies in the report's (table) order.
    pub bars: Vec<CapacityBar>,
}

/// Figure 10: each policy's own capacity at every point.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyCapacityData {
    /// The report's context.
    pub context: CapacityContext,
    /// Working-set ratios, ascending.
    pub ws_values: Vec<f64>,
    /// Skews, ascending.
    pub s_values: Vec<f64>,
    /// One per point, in the report's order.
    pub panels: Vec<CapacityPanel>,
}

/// Picks figure 10's numbers: per point, every policy's capacity (median [min–max] over seeds)
/// and the report's ratio and verdict over its baseline. A point without the baseline, or a
/// policy without its margin, fails, named.
pub fn policy_capacity(r: &CapacityReport) -> Result<PolicyCapacityData> {
    let pts = capacity_points(r, FIG10)?;
    let mut panels = Vec::new();
    let mut lack = Vec::new();
    for (p, ws, s) in &pts {
        if capacity_of(p, &r.baseline).is_none() {
            lack.push(format!(
                "point `{}` has no {} capacity (the baseline)",
                p.point, r.baseline
            ));
            continue;
        }
        let mut bars = Vec::new();
        for c in &p.policies {
            let best = p.best.contains(&c.policy);
            if c.policy == r.baseline {
                bars.push(CapacityBar {
                    policy: c.policy.clone(),
                    spread: c.spread,
                    ratio: None,
                    verdict: None,
                    best,
                });
                continue;
            }
            let Some(m) = capacity_margin(p, &c.policy) else {
                lack.push(format!(
                    "point `{}` has no margin of {} over {}",
                    p.point, c.policy, r.baseline
                ));
                continue;
            };
            bars.push(CapacityBar {
                policy: c.policy.clone(),
                spread: c.spread,
                ratio: m.ratio,
                verdict: Some(m.verdict),
                best,
            });
        }
        panels.push(CapacityPanel {
            point: p.point.clone(),
            working_set_ratio: *ws,
            zipf_s: *s,
            bars,
        });
    }
    missing(FIG10, lack)?;
    Ok(PolicyCapacityData {
        context: CapacityContext::of(r),
        ws_values: sorted_axis(pts.iter().map(|(_, ws, _)| *ws)),
        s_values: sorted_axis(pts.iter().map(|(_, _, s)| *s)),
        panels,
    })
}

impl PolicyCapacityData {
    /// Exactly the numbers drawn: one row per point and policy.
    pub fn table(&self) -> Table {
        Table {
            header: vec![
                "point",
                "working_set_ratio",
                "zipf_s",
                "policy",
                "capacity_median_rps",
                "capacity_min_rps",
                "capacity_max_rps",
                "seeds",
                "ratio_to_session_affinity",
                "verdict",
                "best",
            ],
            rows: self
                .panels
                .iter()
                .flat_map(|p| {
                    p.bars.iter().map(move |b| {
                        let mut row = vec![
                            p.point.clone(),
                            num(p.working_set_ratio),
                            num(p.zipf_s),
                            b.policy.clone(),
                        ];
                        row.extend(spread_opt_fields(b.spread));
                        row.push(b.spread.map(|s| s.n.to_string()).unwrap_or_default());
                        row.push(opt(b.ratio));
                        row.push(
                            b.verdict
                                .map_or(REFERENCE, CapacityVerdict::as_str)
                                .to_string(),
                        );
                        row.push(b.best.to_string());
                        row
                    })
                })
                .collect(),
        }
    }
}

/// The value of the `panel` column of figures 1 and 2 for the capacity panel.
pub const PANEL_CAPACITY: &str = "capacity";
/// The value of the `panel` column of figures 1 and 2 for the fixed-rate panel.
pub const PANEL_FIXED_RATE: &str = "fixed-rate";

/// Both panels of figure 1 or 2 in one table, as figure 5 keeps its two: a `panel` column
/// ([`PANEL_CAPACITY`], [`PANEL_FIXED_RATE`]) first, then the capacity panel's columns, then the
/// fixed-rate panel's that the capacity panel does not share (a shared name, such as `point`
/// or `verdict`, is one column); each row leaves the other panel's columns empty.
pub fn with_panels(capacity: Table, fixed: Table) -> Table {
    let mut header = vec!["panel"];
    header.extend(capacity.header.iter().copied());
    for h in &fixed.header {
        if !header.contains(h) {
            header.push(h);
        }
    }
    let place = |panel: &str, t: &Table| -> Vec<Vec<String>> {
        t.rows
            .iter()
            .map(|r| {
                header
                    .iter()
                    .map(|h| {
                        if *h == "panel" {
                            return panel.to_string();
                        }
                        t.header
                            .iter()
                            .position(|x| x == h)
                            .map(|i| r[i].clone())
                            .unwrap_or_default()
                    })
                    .collect()
            })
            .collect()
    };
    let mut rows = place(PANEL_CAPACITY, &capacity);
    rows.extend(place(PANEL_FIXED_RATE, &fixed));
    Table { header, rows }
}
