//! What the figures are drawn from: a grid sweep analysed by the `analysis` crate (figures 1–5)
//! and a fault sweep's `timeline.csv` (figure 6), each with the context every title names
//! (workload, fleet, SLO). Nothing here computes a metric; it loads, checks and describes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::error::fail;
use crate::{Error, Result};
use analysis::capacity::CapacityReport;
use analysis::{Report, ReportConfig, Slo, SweepData};

/// The description every figure's subtitle carries.
#[derive(Debug, Clone, PartialEq)]
pub struct Context {
    /// Sweep directory name.
    pub sweep: String,
    /// Workload name; where points differ, the parts that vary are written `*`.
    pub workload: String,
    /// Fleet in words (source, replicas, speed, KV capacity, slowdowns).
    pub fleet: String,
    /// The SLO goodput is measured against.
    pub slo: Slo,
}

impl Context {
    /// The SLO in words.
    pub fn slo_text(&self) -> String {
        format!(
            "SLO: TTFT < {} ms and ITL p50 < {} ms",
            short(self.slo.ttft_ms),
            short(self.slo.itl_ms)
        )
    }
}

/// A bound for a caption: to the microsecond, without float noise (3.9345000000000003 → 3.935).
fn short(ms: f64) -> String {
    let s = format!("{ms:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// A grid sweep (e.g. `pressure-grid`) loaded and analysed.
#[derive(Debug, Clone)]
pub struct GridInput {
    /// The sweep directory.
    pub dir: PathBuf,
    /// The analysis report over it.
    pub report: Report,
    /// Title context.
    pub context: Context,
    /// How its cells were driven, in words ([`drive_text`]): what set the one load at which
    /// every policy of a point ran, for the titles of the fixed-rate panels.
    pub drive: String,
}

/// The file of a per-policy capacity report in its sweep directory (written by `cargo xtask
/// sweep … --policy-capacity`, `analysis::capacity::CapacityReport` as JSON).
pub const CAPACITY_FILE: &str = "policy-capacity.json";

/// A per-policy capacity report (figures 1, 2 and 10): each policy's own capacity at every
/// point over plan seeds, as `analysis::capacity` built it.
#[derive(Debug, Clone)]
pub struct CapacityInput {
    /// The sweep directory holding [`CAPACITY_FILE`].
    pub dir: PathBuf,
    /// The report, parsed with the `analysis` crate's own types.
    pub report: CapacityReport,
}

/// One row of `timeline.csv` (docs/CONTRACTS.md, "Fault timeline").
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimelineRow {
    /// Bucket start, s since the start of the fault run's load.
    pub t_s: f64,
    /// Good requests per second in the bucket.
    pub goodput_rps: f64,
    /// Whether the faulted replica was up.
    pub replica_alive: bool,
    /// The range over repetitions `(min, max)`, req/s, when the timeline carries it
    /// (`goodput_min_rps`, `goodput_max_rps`; absent in timelines written before them).
    pub band: Option<(f64, f64)>,
    /// The rolling window the goodput was averaged over, s (`rolling_s`; absent: none).
    pub rolling_s: Option<f64>,
}

/// One policy's series through the fault.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyTimeline {
    /// Policy name.
    pub policy: String,
    /// Repetitions of this policy in the fault sweep (complete and accepted).
    pub reps: usize,
    /// Rows in time order.
    pub rows: Vec<TimelineRow>,
}

/// A fault sweep: its timeline and title context.
#[derive(Debug, Clone)]
pub struct FaultInput {
    /// The sweep directory.
    pub dir: PathBuf,
    /// One series per policy, in the analysis crate's policy order.
    pub series: Vec<PolicyTimeline>,
    /// Title context.
    pub context: Context,
}

/// Shortest exact decimal of a number (`1`, `0.25`), as point names and titles write them.
pub fn num(x: f64) -> String {
    format!("{x}")
}

/// Loads a grid sweep through `analysis::load_sweep` and analyses it with the default
/// configuration. Fails, naming what is wrong, when the sweep holds mismatched cells (the
/// comparability guard refused a point), points with different SLOs, or repetitions measured
/// on different fleets.
pub fn load_grid(dir: &Path) -> Result<GridInput> {
    let (sweep, report, context) = analysed(dir)?;
    Ok(GridInput {
        dir: dir.to_path_buf(),
        report,
        context,
        drive: drive_text(&sweep),
    })
}

/// What set the one load every policy of a point ran at, in words, from the used repetitions'
/// `meta.json` `run`: an open loop at a fraction of the calibrated capacity (`load_fraction`,
/// `capacity_scope`), an open loop at a rate of its own, or a closed loop of N users
/// (`arrival.Closed.users`); "at one load per point" when the repetitions record none of these
/// or disagree.
pub fn drive_text(sweep: &SweepData) -> String {
    let used: Vec<&schema::Run> = sweep
        .reps
        .iter()
        .filter(|r| r.meta.accepted)
        .filter_map(|r| r.meta.run.as_ref())
        .collect();
    let all_used = used.len() == sweep.reps.iter().filter(|r| r.meta.accepted).count();
    let same = |values: Vec<Option<String>>| -> Option<String> {
        let first = values.first()?.clone()?;
        values
            .iter()
            .all(|v| v.as_deref() == Some(first.as_str()))
            .then_some(first)
    };
    if used.is_empty() || !all_used {
        return "at one load per point, the same for every policy".to_string();
    }
    let fractions = same(
        used.iter()
            .map(|r| r.load_fraction.get().map(|f| num(*f)))
            .collect(),
    );
    let scope = same(
        used.iter()
            .map(|r| r.capacity_scope.get().cloned())
            .collect(),
    );
    let users = same(
        used.iter()
            .map(|r| {
                r.other
                    .get("arrival")
                    .and_then(|a| a.get("Closed"))
                    .and_then(|c| c.get("users"))
                    .and_then(|u| u.as_u64())
                    .map(|u| u.to_string())
            })
            .collect(),
    );
    let open = used.iter().all(|r| r.offered_rps.get().is_some());
    match (fractions, scope.as_deref(), users) {
        (Some(f), Some("per-point"), _) => format!(
            "at one open-loop rate per point, set by the calibration: {f}× that point's capacity, the same for every policy"
        ),
        (Some(f), Some("reference"), _) => format!(
            "at one open-loop rate, set by the calibration: {f}× its reference capacity, the same for every policy"
        ),
        (Some(f), _, _) => format!(
            "at one open-loop rate per point, set by the calibration: {f}× the calibrated capacity, the same for every policy"
        ),
        (None, _, _) if open => {
            "at one open-loop rate per point, the same for every policy".to_string()
        }
        (None, _, Some(u)) => {
            format!("at one closed-loop load, {u} users at every point, the same for every policy")
        }
        (None, _, None) => "at one load per point, the same for every policy".to_string(),
    }
}

/// Loads a per-policy capacity report from `dir` ([`CAPACITY_FILE`]) with the `analysis`
/// crate's types. Fails naming the file when it is missing, is not such a report, or has no
/// point.
pub fn load_capacity(dir: &Path) -> Result<CapacityInput> {
    let path = dir.join(CAPACITY_FILE);
    let text = std::fs::read_to_string(&path).map_err(|source| Error::CapacityRead {
        path: path.clone(),
        source,
    })?;
    let report: CapacityReport =
        serde_json::from_str(&text).map_err(|source| Error::CapacityParse {
            path: path.clone(),
            source,
        })?;
    if report.points.is_empty() {
        fail!(Invalid, "figures: {}: no point to draw", path.display());
    }
    Ok(CapacityInput {
        dir: dir.to_path_buf(),
        report,
    })
}

/// A sweep loaded, analysed and checked as [`load_grid`] does, with its repetitions.
fn analysed(dir: &Path) -> Result<(SweepData, Report, Context)> {
    let sweep = analysis::load_sweep(dir).map_err(|source| Error::Load {
        what: "sweep",
        dir: dir.to_path_buf(),
        source,
    })?;
    let report = analysis::analyze(&sweep, &ReportConfig::default());
    if !report.refused.is_empty() {
        let why: Vec<String> = report.refused.iter().map(|r| r.to_string()).collect();
        fail!(
            Invalid,
            "figures: {}: mismatched data: {}",
            dir.display(),
            why.join("; ")
        );
    }
    if report.points.is_empty() {
        fail!(
            Invalid,
            "figures: {}: no point has a complete repetition to draw",
            dir.display()
        );
    }
    let slo = one_slo(dir, &report)?;
    let fleet = fleet_text(dir, &sweep)?;
    let names: Vec<&str> = report
        .points
        .iter()
        .map(|p| p.workload_name.as_str())
        .collect();
    let context = Context {
        sweep: report.sweep.clone(),
        workload: workload_pattern(&names),
        fleet,
        slo,
    };
    Ok((sweep, report, context))
}

/// The load a point of a `load` sweep offered, as its repetitions' `meta.json` records it under
/// `run` (docs/CONTRACTS.md, "Measurements layout").
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Offered {
    /// Open-loop rate, requests per second of model time.
    pub offered_rps: f64,
    /// The same rate in wall requests per second (the unit of the report's goodput).
    pub offered_wall_rps: f64,
    /// Its fraction of the calibrated capacity, when the sweep ran at one (`--load`).
    pub load_fraction: Option<f64>,
    /// The capacity that fraction is of, requests per second of model time.
    pub capacity_rps: Option<f64>,
}

/// A `load` sweep loaded and analysed, with the load each point offered.
#[derive(Debug, Clone)]
pub struct LoadInput {
    /// The sweep directory.
    pub dir: PathBuf,
    /// The analysis report over it.
    pub report: Report,
    /// Title context.
    pub context: Context,
    /// The offered load of every point, by point name.
    pub offered: BTreeMap<String, Offered>,
}

/// Loads a `load` sweep as [`load_grid`] loads a grid, and reads each point's offered load from
/// its repetitions' `meta.json` (`run.offered_rps`, `run.offered_wall_rps`, `run.load_fraction`,
/// `run.capacity_rps`). A point whose repetitions record no offered rate (a closed loop) or
/// disagree about it is refused, naming the point.
pub fn load_load_sweep(dir: &Path) -> Result<LoadInput> {
    let (sweep, report, context) = analysed(dir)?;
    let mut offered: BTreeMap<String, (Offered, String)> = BTreeMap::new();
    for r in &sweep.reps {
        let run = r.meta.run.as_ref();
        let field = |f: fn(&schema::Run) -> &schema::Recorded<f64>| {
            run.and_then(|run| f(run).get().copied())
        };
        let cell = format!("{}/{}/rep-{}", r.point, r.policy, r.rep);
        let (Some(offered_rps), Some(offered_wall_rps)) =
            (field(|r| &r.offered_rps), field(|r| &r.offered_wall_rps))
        else {
            fail!(
                Invalid,
                "figures: {}: {cell}'s meta.json records no `run.offered_rps` and `run.offered_wall_rps`: not an open-loop point of a load sweep",
                dir.display()
            );
        };
        let o = Offered {
            offered_rps,
            offered_wall_rps,
            load_fraction: field(|r| &r.load_fraction),
            capacity_rps: field(|r| &r.capacity_rps),
        };
        match offered.get(&r.point) {
            Some((first, first_cell)) if *first != o => fail!(
                Invalid,
                "figures: {}: mismatched offered load at point `{}`: {first_cell} recorded {first:?}, {cell} recorded {o:?}",
                dir.display(),
                r.point
            ),
            Some(_) => {}
            None => {
                offered.insert(r.point.clone(), (o, cell));
            }
        }
    }
    Ok(LoadInput {
        dir: dir.to_path_buf(),
        report,
        context,
        offered: offered.into_iter().map(|(k, (o, _))| (k, o)).collect(),
    })
}

fn one_slo(dir: &Path, report: &Report) -> Result<Slo> {
    let first = &report.points[0];
    if let Some(other) = report.points.iter().find(|p| p.slo != first.slo) {
        fail!(
            Invalid,
            "figures: {}: mismatched SLOs: point `{}` has TTFT < {} ms / ITL < {} ms, point `{}` has TTFT < {} ms / ITL < {} ms; a figure across points needs one SLO",
            dir.display(),
            first.point,
            num(first.slo.ttft_ms),
            num(first.slo.itl_ms),
            other.point,
            num(other.slo.ttft_ms),
            num(other.slo.itl_ms)
        );
    }
    Ok(first.slo)
}

/// Fields of meta.json's `fleet` that describe how it was measured rather than which fleet it
/// is, left out when repetitions' fleets are compared: `keep_awake_threads` (the CPU spinners,
/// recorded from 2 Dec 2026; repetitions before that lack it) is judged per repetition by its
/// evidence (engine lateness), not by sameness.
pub const FLEET_INSTRUMENT_FIELDS: [&str; 1] = ["keep_awake_threads"];

/// The fleet without [`FLEET_INSTRUMENT_FIELDS`].
fn fleet_identity(fleet: &serde_json::Value) -> serde_json::Value {
    let mut f = fleet.clone();
    if let Some(o) = f.as_object_mut() {
        for k in FLEET_INSTRUMENT_FIELDS {
            o.remove(k);
        }
    }
    f
}

/// The fleet every used repetition recorded; different fleets in one sweep are an error.
fn fleet_text(dir: &Path, sweep: &SweepData) -> Result<String> {
    let mut fleets: BTreeMap<String, (serde_json::Value, String)> = BTreeMap::new();
    for r in sweep.reps.iter().filter(|r| r.meta.accepted) {
        let identity = fleet_identity(&r.meta.fleet);
        fleets
            .entry(identity.to_string())
            .or_insert_with(|| (identity, format!("{}/{}/rep-{}", r.point, r.policy, r.rep)));
    }
    let mut it = fleets.values();
    let Some((fleet, _)) = it.next() else {
        fail!(
            Invalid,
            "figures: {}: every repetition is set aside; nothing to draw",
            dir.display()
        );
    };
    if let Some((other, cell)) = it.next() {
        let first_cell = &fleets
            .values()
            .next()
            .map(|v| v.1.clone())
            .unwrap_or_default();
        fail!(
            Invalid,
            "figures: {}: mismatched fleets: {} recorded {}, {} recorded {}",
            dir.display(),
            first_cell,
            fleet,
            cell,
            other
        );
    }
    describe_fleet(fleet).map_err(|e| Error::FleetTitle {
        dir: dir.to_path_buf(),
        source: Box::new(e),
    })
}

/// The fleet in words, from the `fleet` object of meta.json.
pub fn describe_fleet(fleet: &serde_json::Value) -> Result<String> {
    let source = fleet
        .get("source")
        .and_then(|v| v.as_str())
        .ok_or(Error::MissingField("fleet.source"))?;
    let mut parts = vec![format!("{source} fleet")];
    if let Some(n) = fleet.get("replicas").and_then(|v| v.as_u64()) {
        parts.push(format!("{n} replicas"));
    }
    if let Some(speed) = fleet.get("speed").and_then(|v| v.as_f64())
        && speed != 1.0
    {
        parts.push(format!("speed ×{}", num(speed)));
    }
    if let Some(cap) = fleet.get("capacity_tokens").and_then(|v| v.as_u64()) {
        parts.push(format!("KV capacity {cap} tokens"));
    }
    if let Some(slow) = fleet.get("slowdowns").and_then(|v| v.as_array()) {
        let slowed: Vec<String> = slow
            .iter()
            .enumerate()
            .filter_map(|(i, v)| v.as_f64().filter(|f| *f != 1.0).map(|f| (i, f)))
            .map(|(i, f)| format!("replica {i} ×{}", num(f)))
            .collect();
        if !slowed.is_empty() {
            parts.push(format!("slowed: {}", slowed.join(", ")));
        }
    }
    Ok(parts.join(", "))
}

/// One name for several workloads: the `-`-separated parts they share, `*` where they differ
/// (`chat-ws*-cap9000-s*-t6`). Names with different part counts are listed instead.
pub fn workload_pattern(names: &[&str]) -> String {
    let mut distinct: Vec<&str> = names.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    match distinct.as_slice() {
        [] => String::new(),
        [one] => one.to_string(),
        many => {
            let split: Vec<Vec<&str>> = many.iter().map(|n| n.split('-').collect()).collect();
            if split.iter().any(|s| s.len() != split[0].len()) {
                return many.join(" | ");
            }
            (0..split[0].len())
                .map(|i| {
                    let part = split[0][i];
                    if split.iter().all(|s| s[i] == part) {
                        part.to_string()
                    } else {
                        // keep the parameter's letters: `ws0.25`, `ws1` → `ws*`
                        let letters: String = part
                            .chars()
                            .take_while(|c| c.is_ascii_alphabetic())
                            .collect();
                        let same_prefix = split.iter().all(|s| s[i].starts_with(&letters));
                        if same_prefix {
                            format!("{letters}*")
                        } else {
                            "*".to_string()
                        }
                    }
                })
                .collect::<Vec<_>>()
                .join("-")
        }
    }
}

/// The columns `timeline.csv` must start with (CONTRACTS.md); later columns are ignored.
pub const TIMELINE_COLUMNS: [&str; 4] = ["policy", "t_s", "goodput_rps", "replica_alive"];
/// Optional columns of `timeline.csv` after [`TIMELINE_COLUMNS`], read by name: the range over
/// repetitions and the rolling window (`analysis::fault::timeline`).
pub const TIMELINE_OPTIONAL_COLUMNS: [&str; 3] =
    ["goodput_min_rps", "goodput_max_rps", "rolling_s"];

/// Reads a fault timeline. Every defect names the file and line.
pub fn read_timeline(path: &Path) -> Result<Vec<(String, TimelineRow)>> {
    let mut rdr = csv::ReaderBuilder::new()
        .has_headers(true)
        .from_path(path)
        .map_err(|source| Error::TimelineOpen {
            path: path.to_path_buf(),
            source,
        })?;
    let header = rdr
        .headers()
        .map_err(|source| Error::TimelineHeader {
            path: path.to_path_buf(),
            source,
        })?
        .clone();
    let bad = |line: usize, message: String| Error::Timeline {
        path: path.to_path_buf(),
        line: Some(line),
        message,
    };
    for (i, want) in TIMELINE_COLUMNS.iter().enumerate() {
        if header.get(i) != Some(*want) {
            return Err(bad(
                1,
                format!(
                    "header must start with `{}`; column {} is `{}`",
                    TIMELINE_COLUMNS.join(","),
                    i + 1,
                    header.get(i).unwrap_or("(missing)")
                ),
            ));
        }
    }
    let optional: Vec<Option<usize>> = TIMELINE_OPTIONAL_COLUMNS
        .iter()
        .map(|name| header.iter().position(|h| h == *name))
        .collect();
    let mut out = Vec::new();
    for (i, rec) in rdr.records().enumerate() {
        let line = i + 2;
        let rec = rec.map_err(|source| Error::TimelineRow {
            path: path.to_path_buf(),
            line,
            source,
        })?;
        let field = |k: usize| rec.get(k).unwrap_or("");
        let policy = field(0).to_string();
        if policy.is_empty() {
            return Err(bad(line, "`policy` is empty".to_string()));
        }
        let number = |k: usize| -> Result<f64> {
            let text = field(k);
            text.parse::<f64>()
                .ok()
                .filter(|v| v.is_finite())
                .ok_or_else(|| {
                    bad(
                        line,
                        format!("`{}` is `{text}`, not a number", TIMELINE_COLUMNS[k]),
                    )
                })
        };
        let t_s = number(1)?;
        let goodput_rps = number(2)?;
        if goodput_rps < 0.0 {
            return Err(bad(
                line,
                format!("`goodput_rps` is negative ({goodput_rps})"),
            ));
        }
        let replica_alive = match field(3) {
            "1" => true,
            "0" => false,
            other => {
                return Err(bad(
                    line,
                    format!("`replica_alive` must be 0 or 1, got `{other}`"),
                ));
            }
        };
        let extra = |k: usize| -> Result<Option<f64>> {
            let Some(col) = optional[k] else {
                return Ok(None);
            };
            let text = field(col);
            text.parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v >= 0.0)
                .map(Some)
                .ok_or_else(|| {
                    bad(
                        line,
                        format!(
                            "`{}` is `{text}`, not a non-negative number",
                            TIMELINE_OPTIONAL_COLUMNS[k]
                        ),
                    )
                })
        };
        let band = match (extra(0)?, extra(1)?) {
            (Some(lo), Some(hi)) => Some((lo, hi)),
            _ => None,
        };
        out.push((
            policy,
            TimelineRow {
                t_s,
                goodput_rps,
                replica_alive,
                band,
                rolling_s: extra(2)?,
            },
        ));
    }
    if out.is_empty() {
        return Err(Error::Timeline {
            path: path.to_path_buf(),
            line: None,
            message: "no rows".to_string(),
        });
    }
    Ok(out)
}

/// The file figure 6 reads inside a fault sweep directory.
pub const TIMELINE_FILE: &str = "timeline.csv";

/// Loads a fault sweep: `timeline.csv` for the series, the repetitions' meta.json (through
/// `analysis::load_sweep`) for workload, fleet, SLO and repetitions. A policy in the timeline
/// without repetitions, or with repetitions but no series, is mismatched data.
pub fn load_fault(dir: &Path) -> Result<FaultInput> {
    let path = dir.join(TIMELINE_FILE);
    if !path.is_file() {
        fail!(
            Missing,
            "figures: the fault timeline {} is missing (the fault experiment writes it; columns {})",
            path.display(),
            TIMELINE_COLUMNS.join(",")
        );
    }
    let rows = read_timeline(&path)?;
    let sweep = analysis::load_sweep(dir).map_err(|source| Error::Load {
        what: "fault sweep",
        dir: dir.to_path_buf(),
        source,
    })?;
    let used: Vec<_> = sweep.reps.iter().filter(|r| r.meta.accepted).collect();
    let mut by_policy: BTreeMap<(usize, String), Vec<TimelineRow>> = BTreeMap::new();
    for (policy, row) in rows {
        by_policy
            .entry((policy_rank(&policy), policy))
            .or_default()
            .push(row);
    }
    let mut series = Vec::new();
    for ((_, policy), mut rows) in by_policy {
        rows.sort_by(|a, b| a.t_s.total_cmp(&b.t_s));
        if let Some(w) = rows.windows(2).find(|w| w[0].t_s == w[1].t_s) {
            return Err(Error::Timeline {
                path: path.clone(),
                line: None,
                message: format!("policy `{policy}` has two rows at t_s = {}", num(w[0].t_s)),
            });
        }
        let reps = used.iter().filter(|r| r.policy == policy).count();
        if reps == 0 {
            fail!(
                Invalid,
                "figures: mismatched data: {} has a series for `{policy}` but {} holds no accepted `<point>/{policy}/rep-<k>/` with meta.json",
                path.display(),
                dir.display()
            );
        }
        series.push(PolicyTimeline { policy, reps, rows });
    }
    let mut missing: Vec<&str> = used
        .iter()
        .map(|r| r.policy.as_str())
        .filter(|p| !series.iter().any(|s| s.policy == *p))
        .collect();
    missing.dedup();
    if !missing.is_empty() {
        fail!(
            Missing,
            "figures: missing data: {} has no series for {} (measured in {})",
            path.display(),
            missing
                .iter()
                .map(|p| format!("`{p}`"))
                .collect::<Vec<_>>()
                .join(", "),
            dir.display()
        );
    }
    let first = used.first().ok_or_else(|| {
        Error::Invalid(format!(
            "figures: {}: no accepted repetition",
            dir.display()
        ))
    })?;
    if let Some(other) = used.iter().find(|r| r.meta.slo != first.meta.slo) {
        fail!(
            Invalid,
            "figures: {}: mismatched SLOs: {}/rep-{} vs {}/rep-{}",
            dir.display(),
            first.policy,
            first.rep,
            other.policy,
            other.rep
        );
    }
    let names: Vec<&str> = used.iter().map(|r| r.meta.workload_name.as_str()).collect();
    let context = Context {
        sweep: sweep.sweep.clone(),
        workload: workload_pattern(&names),
        fleet: fleet_text(dir, &sweep)?,
        slo: first.meta.slo,
    };
    Ok(FaultInput {
        dir: dir.to_path_buf(),
        series,
        context,
    })
}

/// Table order of policies (the analysis crate's), unknown names after, by name.
pub fn policy_rank(name: &str) -> usize {
    analysis::report::POLICY_ORDER
        .iter()
        .position(|p| *p == name)
        .unwrap_or(analysis::report::POLICY_ORDER.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workload_pattern_stars_the_varying_parameters() {
        let names = [
            "chat-ws1-cap9000-s0-t6",
            "chat-ws3-cap9000-s1.4-t6",
            "chat-ws1-cap9000-s1.4-t6",
        ];
        assert_eq!(workload_pattern(&names), "chat-ws*-cap9000-s*-t6");
        assert_eq!(workload_pattern(&["a-b", "a-b"]), "a-b");
        assert_eq!(workload_pattern(&["a-b", "a-b-c"]), "a-b | a-b-c");
    }

    #[test]
    fn fleet_description_needs_a_source() {
        let f = serde_json::json!({"source": "emulated", "replicas": 3, "speed": 20.0,
            "capacity_tokens": 49152, "slowdowns": [1.0, 2.5, 1.0]});
        assert_eq!(
            describe_fleet(&f).unwrap(),
            "emulated fleet, 3 replicas, speed ×20, KV capacity 49152 tokens, slowed: replica 1 ×2.5"
        );
        let err = describe_fleet(&serde_json::json!({"replicas": 3})).unwrap_err();
        assert!(err.to_string().contains("fleet.source"), "{err}");
    }
}
