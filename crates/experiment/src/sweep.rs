//! The live sweep (docs/ARCHITECTURE.md, "Measurements and comparability"): its settings, shared
//! with the virtual sweep (points, plans), and the procedure of one cell — cycle the fleet, start
//! the router (or HAProxy), warm up, measure, check evidence and drift, re-run or set aside, write
//! `meta.json` last. The loop over points × repetitions × policies, resuming and progress are the
//! caller's (`cargo xtask sweep`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};

use fleet::evidence::EvidenceConfig;
use fleet::{DriverSettings, Fleet, Ingress, RouterSettings};
use schema::Meta;
use serde::{Deserialize, Serialize};
use workload::{ArrivalSpec, Sizing, WorkloadSpec};

use crate::attempt::{Attempt, bounds, run_attempt};
use crate::bins::Bins;
use crate::calibrate::{CalibrateSettings, calibrate};
use crate::calibration::{Calibration, Routing, requests_per_user};
use crate::capacity::{self, Capacity, CapacitySettings, CellWindow};
use crate::cell;
use crate::fleet_spec::{FleetKind, FleetSpec};
use crate::gate::{GateDecision, Gates};
use crate::grid::{self, Arrival, GridParams, LoadAxis, Point, SweepName, WorkloadShape};
use crate::plan_file::{PlanFile, ensure_labelled_plan};

/// Which capacity a sweep's `--load` fractions are fractions of (`--capacity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "kebab-case")]
pub enum CapacityScope {
    /// The calibration's capacity, measured at the reference point (ws 1, skew 0): every point
    /// runs at one absolute rate, so a harder point (larger working set, higher skew) shows
    /// what the fleet serves at the reference point's capacity.
    Reference,
    /// Each point's own capacity, found by the same search on that point's workload: every
    /// point runs at the same fraction of what the best policy can serve there, so every point
    /// is a comparison under pressure and none is overloaded for every policy.
    PerPoint,
}

impl CapacityScope {
    /// The scope when `--capacity` is not given: each point's own for a virtual sweep or an
    /// emulated fleet, the reference capacity otherwise — and always with a live calibration
    /// (`--live-calibration`: a cross-check must offer the live sweep's rates).
    pub fn default_for(live_calibration: bool, virtual_time: bool, kind: FleetKind) -> Self {
        if !live_calibration && (virtual_time || kind == FleetKind::Emulated) {
            CapacityScope::PerPoint
        } else {
            CapacityScope::Reference
        }
    }

    /// The flag's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            CapacityScope::Reference => "reference",
            CapacityScope::PerPoint => "per-point",
        }
    }
}

/// `--ingress`: what sits in front of the replicas (the command-line face of [`Ingress`]; several
/// routers come from `--routers N`, [`ingress_from_flags`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum IngressFlag {
    /// kvroute's router (policy from `--policies`).
    Router,
    /// HAProxy with bounded-load consistent hashing on `x-session-id`.
    Haproxy,
    /// Envoy with kvroute's endpoint picker (`epp-bin`; Envoy from `scripts/envoy.sh`).
    EnvoyEpp,
}

impl From<IngressFlag> for Ingress {
    /// The ingress `--ingress` names alone (one router, no front).
    fn from(flag: IngressFlag) -> Ingress {
        match flag {
            IngressFlag::Router => Ingress::Router,
            IngressFlag::Haproxy => Ingress::Haproxy,
            IngressFlag::EnvoyEpp => Ingress::EnvoyEpp,
        }
    }
}

/// The ingress a sweep's flags ask for: `--ingress`, with `--routers N` (N ≥ 2: N routers behind
/// HAProxy), `--front`, `--share-decisions` and `--share-loads`; refuses the combinations that
/// make no sense ([`Ingress::with_routers`]).
pub fn ingress_from_flags(
    flag: IngressFlag,
    routers: u32,
    front: Option<fleet::ingress::Front>,
    share_decisions: bool,
    share_loads: bool,
) -> Result<Ingress> {
    let base = Ingress::from(flag);
    Ingress::with_routers(base, routers, front, share_decisions, share_loads)
        .map_err(anyhow::Error::from)
}

/// What a sweep runs with (defaults already applied); the live and the virtual sweep share it.
#[derive(Debug, Clone)]
pub struct SweepSettings {
    /// Which sweep.
    pub name: SweepName,
    /// Reduced grid.
    pub quick: bool,
    /// Repetitions per point and policy.
    pub reps: u32,
    /// Policies chosen (empty: the defaults for `quick`).
    pub policies: Vec<String>,
    /// What sits in front of the replicas.
    pub ingress: Ingress,
    /// HAProxy's load bound c (`hash-balance-factor` = c × 100).
    pub balance_factor: f64,
    /// Closed-loop users.
    pub users: u32,
    /// Open loop at this model-time rate instead of closed loop.
    pub open_rate_rps: Option<f64>,
    /// Open loop at these fractions of the calibrated capacity (`--load`; empty: the sweep's
    /// default, [`grid::default_load_fractions`]); `None` for the explicit closed loop
    /// (`--users`) or absolute rates (`--open-loop --rate`, `--rates`).
    pub load_fractions: Option<Vec<f64>>,
    /// Model-time rates of the `load` sweep (empty: the defaults).
    pub rates_rps: Vec<f64>,
    /// Prefix groups and conversation sharing of every point.
    pub workload: WorkloadShape,
    /// Only these points (empty: all).
    pub points: Vec<String>,
    /// Mean think time of closed-loop users, s of model time (wall = think ÷ speed).
    pub think_model_s: f64,
    /// Warm-up per cell, wall s (a `--load` cell derives its own unless `warmup_given`).
    pub warmup_s: f64,
    /// `warmup_s` was given (`--warmup-s`): every cell uses it, none derives its warm-up from
    /// the capacity search's settling times.
    pub warmup_given: bool,
    /// Measured window per cell, wall s.
    pub measure_s: f64,
    /// The calibration to reuse when it is for this fleet (or where a fresh one goes).
    pub calibration: PathBuf,
    /// Recalibrate even when the calibration matches.
    pub recalibrate: bool,
    /// Largest engine lateness p99 a cell may show before it is discarded, as a share of the
    /// ITL floor in model time ([`crate::calibration::LATENESS_SHARE_OF_ITL_FLOOR`] by default;
    /// converted to wall time by the speed).
    pub lateness_share_of_itl_floor: f64,
    /// Re-runs of a cell whose evidence fails before it is set aside.
    pub evidence_retries: u32,
    /// Seconds between evidence samples.
    pub evidence_interval_s: f64,
    /// Per-request timeout, wall s.
    pub request_timeout_s: f64,
    /// Workload seed; repetition k's router gets `seed + k`.
    pub seed: u64,
    /// The fleet.
    pub fleet: FleetSpec,
    /// Git revision recorded in every `meta.json`.
    pub git_rev: Option<String>,
    /// Tool versions recorded beside it.
    pub versions: serde_json::Value,
    /// The trace the `trace` sweep replays (`None` for every other sweep).
    pub trace: Option<crate::trace_sweep::TraceSettings>,
    /// Virtual sweeps only: judge by this live calibration (SLO, routing values, capacity) instead
    /// of the virtual one, so a live and a virtual sweep can be cross-checked cell by cell.
    pub live_calibration: Option<PathBuf>,
    /// Where `--load` fractions apply: one capacity for every point (the reference point's, in
    /// the calibration), or each point's own, searched on that point's workload.
    pub capacity_scope: CapacityScope,
}

impl SweepSettings {
    /// A quick pressure-grid sweep on the test fleet, for tests to vary (struct update).
    #[cfg(test)]
    pub(crate) fn test_quick() -> SweepSettings {
        SweepSettings {
            name: SweepName::PressureGrid,
            quick: true,
            reps: 1,
            policies: vec![],
            ingress: Ingress::Router,
            balance_factor: 1.25,
            users: 32,
            open_rate_rps: None,
            load_fractions: None,
            rates_rps: vec![],
            points: vec![],
            think_model_s: 1.0,
            warmup_s: 5.0,
            warmup_given: true,
            measure_s: 8.0,
            calibration: PathBuf::from("calibration.json"),
            recalibrate: false,
            lateness_share_of_itl_floor: crate::calibration::LATENESS_SHARE_OF_ITL_FLOOR,
            evidence_retries: 0,
            evidence_interval_s: 1.0,
            request_timeout_s: 60.0,
            seed: 7,
            fleet: FleetSpec::test_emulated(),
            workload: WorkloadShape::DEFAULT,
            git_rev: None,
            versions: serde_json::Value::Null,
            trace: None,
            live_calibration: None,
            capacity_scope: CapacityScope::Reference,
        }
    }

    /// Warm-up + measured window, wall s (the driver's `--duration-s`).
    pub fn run_s(&self) -> f64 {
        self.warmup_s + self.measure_s
    }

    /// The sweep's grid points under `cal` (its replicas in use, its capacity for `--load`),
    /// narrowed to `points`; the live and the virtual sweep share it so both run the same grid.
    pub fn sweep_points(&self, cal: &Calibration) -> Result<Vec<Point>> {
        if let Some(t) = crate::trace_sweep::settings_of(self)? {
            return grid::select_points(vec![t.point()], &self.points);
        }
        let points = grid::points(
            self.name,
            &GridParams {
                quick: self.quick,
                users: self.users,
                open_rate_rps: self.open_rate_rps,
                rates_rps: self.rates_rps.clone(),
                replicas: cal.used_replicas.len(),
                load: self.load_fractions.as_ref().map(|f| LoadAxis {
                    fractions: f.clone(),
                    capacity_rps: cal.capacity.as_ref().map(|c| c.rate_rps),
                }),
                workload: self.workload,
            },
        )?;
        grid::select_points(points, &self.points)
    }

    /// Whether the sweep runs at fractions of the capacity (and so needs a calibration with one).
    pub fn needs_capacity(&self) -> bool {
        self.load_fractions.is_some()
    }

    /// Refuses a calibration without a capacity when the sweep needs one, naming the command that
    /// fills it; `path` is where the calibration was read.
    pub fn check_capacity(&self, cal: &Calibration, path: &Path) -> Result<()> {
        if self.needs_capacity() && cal.capacity.is_none() {
            bail!(
                "{} has no capacity (it was calibrated without the capacity search), and --load runs at fractions of it; run `cargo xtask calibrate{} --out {}` with this sweep's fleet flags (or pass --recalibrate), or run closed loop with --users N",
                path.display(),
                if self.quick { " --quick" } else { "" },
                path.display()
            );
        }
        if let Some(why) = self.stale_capacity(cal) {
            bail!(
                "{}: {why}; run `cargo xtask calibrate{} --out {}` with this sweep's fleet flags (or pass --recalibrate)",
                path.display(),
                if self.quick { " --quick" } else { "" },
                path.display()
            );
        }
        Ok(())
    }

    /// Why `cal`'s capacity cannot size this sweep's open loops ([`capacity::Capacity::stale`]);
    /// `None` when it can or the sweep needs none.
    fn stale_capacity(&self, cal: &Calibration) -> Option<String> {
        cal.capacity
            .as_ref()
            .filter(|_| self.needs_capacity())
            .and_then(|c| c.stale(cal.open_start()))
    }

    /// The warm-up and measured window of `point`'s cells: for a `--load` point, derived from
    /// the capacity search's settling times ([`capacity::cell_window`]); otherwise the sweep's
    /// `--warmup-s` / `--measure-s`.
    pub fn window_for(&self, point: &Point, cal: &Calibration) -> Result<CellWindow> {
        match (point.arrival, point.load_fraction, &cal.capacity) {
            (Arrival::Open { rate_rps }, Some(_), Some(cap)) => capacity::cell_window(
                cap,
                rate_rps,
                self.fleet.effective_speed(),
                workload::prime_period_s(&self.spec_for(point, cal), cal.open_start())
                    .map_err(|e| anyhow!("the primes of {}: {e}", point.name))?,
                self.warmup_given.then_some(self.warmup_s),
                self.measure_s,
                analysis::DriftConfig::default().min_requests,
            ),
            (_, Some(_), None) => bail!(
                "point {} runs at a fraction of the capacity, and the calibration has none",
                point.name
            ),
            _ => Ok(CellWindow::fixed(
                self.warmup_s,
                self.measure_s,
                "the sweep's --warmup-s and --measure-s (or their defaults): a closed loop, or a rate given in req/s",
            )),
        }
    }

    /// What `sweep.json` records for both the live and the virtual sweep (each adds its own keys):
    /// the settings, the points and policies, the capacity and the calibration.
    pub fn record(
        &self,
        points: &[Point],
        policies: &[String],
        cal: &Calibration,
    ) -> serde_json::Value {
        serde_json::json!({
            "sweep": self.name.as_str(),
            "quick": self.quick,
            "points": points,
            "policies": policies,
            "reps": self.reps,
            "warmup_s": self.warmup_s,
            "measure_s": self.measure_s,
            "think_model_s": self.think_model_s,
            "load_fractions": self.load_fractions,
            "capacity_rps": cal.capacity.as_ref().map(|c| c.rate_rps),
            "capacity_scope": self.capacity_scope.as_str(),
            "calibration": cal,
            "trace": self.trace,
        })
    }

    /// What `meta.json`'s `run` records about a point's arrival and window, shared by the live
    /// and the virtual cell: the arrival, the load fraction and the absolute offered rate (model
    /// and wall req/s; `null` for a closed loop, whose offered load depends on the latency it
    /// meets), the capacity it is a fraction of, and the window with its rule.
    pub fn run_record(
        &self,
        point: &Point,
        cal: &Calibration,
        window: &CellWindow,
    ) -> serde_json::Value {
        let offered_rps = match point.arrival {
            Arrival::Open { rate_rps } => Some(rate_rps),
            // A trace's offered load is its own (and changes through it).
            Arrival::Closed { .. } | Arrival::Trace { .. } => None,
        };
        serde_json::json!({
            "arrival": point.arrival,
            "load_fraction": point.load_fraction,
            "offered_rps": offered_rps,
            // to the µreq/s, without float noise (56.43, not 56.42999999999999)
            "offered_wall_rps": offered_rps.map(|r| (r * self.fleet.effective_speed() * 1e6).round() / 1e6),
            "capacity_rps": point.load_fraction.and(cal.capacity.as_ref().map(|c| c.rate_rps)),
            "capacity_scope": point.load_fraction.map(|_| self.capacity_scope.as_str()),
            "window": window,
            "think_model_s": self.think_model_s,
        })
    }

    /// The workload of `point`'s cells (its conversations, sized against the calibration's KV
    /// capacity), without the arrivals.
    pub fn spec_for(&self, point: &Point, cal: &Calibration) -> WorkloadSpec {
        WorkloadSpec {
            seed: self.seed,
            sizing: Sizing::WorkingSet {
                capacity_tokens: cal.capacity_tokens,
                ratio: point.ratio,
            },
            zipf_s: point.zipf_s,
            turns: point.turns,
            prefix_tokens: point.prefix_tokens,
            prefix_groups: point.prefix_groups,
            sharing: point.sharing,
            ..WorkloadSpec::default()
        }
    }

    /// `point` and the calibration its cells run under when the point has its own capacity
    /// (`CapacityScope::PerPoint`): `cal` with `capacity` replaced, so the rate (`--load` ×
    /// the point's capacity), the derived window and `meta.json`'s `run.capacity_rps` all come
    /// from it. Fails when the sweep's grid no longer has a point of that name.
    pub fn at_point_capacity(
        &self,
        point: &Point,
        cal: &Calibration,
        capacity: Capacity,
    ) -> Result<(Point, Calibration)> {
        let mut own = cal.clone();
        own.capacity = Some(capacity);
        let p = self
            .sweep_points(&own)?
            .into_iter()
            .find(|p| p.name == point.name)
            .ok_or_else(|| anyhow!("point {} is not in the grid", point.name))?;
        Ok((p, own))
    }

    /// The plan of one point (`<sweep>/<point>/plan.bin`), sized by the calibration's capacity and
    /// floors; the virtual sweep writes the same bytes.
    pub fn plan_for(&self, point: &Point, cal: &Calibration, sweep_dir: &Path) -> Result<PlanFile> {
        let speed = self.fleet.effective_speed();
        let spec = self.spec_for(point, cal);
        let run_s = self.window_for(point, cal)?.run_s();
        let arrival = match point.arrival {
            Arrival::Closed { users } => {
                let think_wall_s = self.think_model_s / speed;
                ArrivalSpec::Closed {
                    users,
                    think_mean_s: think_wall_s,
                    requests_per_user: requests_per_user(
                        run_s,
                        think_wall_s,
                        cal.floors,
                        spec.output_tokens,
                    ),
                }
            }
            Arrival::Open { rate_rps } => ArrivalSpec::Open {
                rate_rps: rate_rps * speed,
                duration_s: run_s,
                start: cal.open_start(),
            },
            Arrival::Trace { .. } => {
                return crate::trace_sweep::ensure_trace_plan(self, point, sweep_dir);
            }
        };
        // The load fraction is the sweep's, not the plan's: the name carries it beside the rate.
        let label = point
            .load_fraction
            .map_or_else(String::new, |f| format!("-load{}", grid::fmt_fraction(f)));
        ensure_labelled_plan(&sweep_dir.join(&point.name), &spec, &arrival, &label)
    }

    /// The router settings of `policy`'s repetition `rep` under `routing` (the calibration's):
    /// the router seed is `seed + rep`.
    pub fn router_settings(&self, routing: &Routing, policy: &str, rep: u32) -> RouterSettings {
        routing.router_settings(policy, &self.fleet.model, self.seed + u64::from(rep))
    }

    /// The calibration for this sweep: the sweep directory's own (a resumed sweep keeps its SLO),
    /// else `calibration` when made for this fleet and by the current rules, else a fresh one.
    pub(crate) fn calibration_for(
        &self,
        bins: &Bins,
        sweep_dir: &Path,
        should_stop: &dyn Fn() -> bool,
    ) -> Result<Calibration> {
        let key = self.fleet.key();
        let own = sweep_dir.join("calibration.json");
        if own.exists() {
            let c = Calibration::read(&own)?;
            if c.fleet != key {
                bail!(
                    "{} was calibrated for another fleet ({:?}); resume it with the same fleet flags or start a new sweep (--fresh or --sweep-dir-name)",
                    sweep_dir.display(),
                    c.fleet
                );
            }
            self.check_capacity(&c, &own)?;
            return Ok(c);
        }
        if !self.recalibrate && self.calibration.exists() {
            match Calibration::read(&self.calibration) {
                Ok(c) if c.fleet == key && c.routing().is_ok() => match self.stale_capacity(&c) {
                    Some(why) => {
                        eprintln!(
                            "xtask: {}: {why}; recalibrating",
                            self.calibration.display()
                        )
                    }
                    None => {
                        eprintln!("xtask: using {}", self.calibration.display());
                        self.check_capacity(&c, &self.calibration)?;
                        return Ok(c);
                    }
                },
                Ok(c) if c.fleet == key => eprintln!(
                    "xtask: {} is for this fleet but {:#}; recalibrating",
                    self.calibration.display(),
                    c.routing().unwrap_err()
                ),
                Ok(_) => eprintln!(
                    "xtask: {} is for another fleet; recalibrating",
                    self.calibration.display()
                ),
                Err(e) => eprintln!("xtask: {e:#}; recalibrating"),
            }
        }
        let settings = CalibrateSettings {
            users: self.users,
            think_model_s: self.think_model_s,
            warmup_s: self.warmup_s,
            measure_s: self.measure_s,
            // The capacity search only when the sweep runs at fractions of it, on the sweep's
            // own base windows.
            capacity: self.needs_capacity().then(|| CapacitySettings {
                warmup_s: self.warmup_s,
                measure_s: self.measure_s,
                lateness_share_of_itl_floor: self.lateness_share_of_itl_floor,
                ..CapacitySettings::defaults(self.quick)
            }),
            ..CalibrateSettings::defaults(
                self.fleet.clone(),
                self.calibration.clone(),
                self.quick,
                self.seed,
                self.git_rev.clone(),
                self.versions.clone(),
            )
        };
        calibrate(&settings, bins, should_stop)
    }
}

/// The file that records a sweep run's settings: `sweep.json` for the router, `sweep-haproxy.json`
/// for HAProxy cells run into the same directory, `sweep-r4-rr.json` for four routers behind a
/// round-robin front, …, so that adding them does not overwrite the record of the router grid
/// ([`Ingress::record_file_name`]).
pub fn record_file_name(ingress: Ingress) -> String {
    ingress.record_file_name()
}

/// Settings that must agree for two runs into one directory to be one sweep.
const RECORD_SETTINGS: [&str; 7] = [
    "sweep",
    "quick",
    "reps",
    "warmup_s",
    "measure_s",
    "think_model_s",
    "speed",
];

/// The record to write when `earlier` is already on disk: a run restricted with `--points` or
/// `--policies` (a resume, or arms added later) with the same settings adds its points and
/// policies to the earlier record instead of shrinking it to its own; a run with other settings
/// replaces it (each repetition's `meta.json` keeps its own settings either way).
pub fn merged_record(
    earlier: Option<serde_json::Value>,
    mut record: serde_json::Value,
) -> serde_json::Value {
    let Some(earlier) = earlier else {
        return record;
    };
    if RECORD_SETTINGS
        .iter()
        .any(|k| earlier.get(k) != record.get(k))
    {
        return record;
    }
    for (key, id) in [("points", Some("name")), ("policies", None)] {
        let key_of = |v: &serde_json::Value| match id {
            Some(id) => v.get(id).cloned(),
            None => Some(v.clone()),
        };
        let mut union: Vec<serde_json::Value> = earlier
            .get(key)
            .and_then(|v| v.as_array())
            .cloned()
            .unwrap_or_default();
        let new = record
            .get(key)
            .and_then(|v| v.as_array())
            .cloned()
            .unwrap_or_default();
        for item in new {
            let k = key_of(&item);
            if let Some(slot) = union.iter_mut().find(|u| key_of(u) == k) {
                *slot = item;
            } else {
                union.push(item);
            }
        }
        record[key] = serde_json::Value::Array(union);
    }
    record
}

/// A live sweep under way: its calibration, points and policies, and the fleet its cells run on.
pub struct LiveSweep<'a> {
    settings: &'a SweepSettings,
    bins: &'a Bins,
    dir: PathBuf,
    /// The calibration every cell runs under (also in `<dir>/calibration.json`).
    pub calibration: Calibration,
    /// What every cell's router gets from it.
    pub routing: Routing,
    /// The policies compared, in the order a repetition runs them.
    pub policies: Vec<String>,
    /// The points, in order.
    pub points: Vec<Point>,
    /// Points with a capacity of their own ([`LiveSweep::at_point_capacities`]) and the
    /// calibration their cells run under (`calibration` with that capacity).
    own_calibrations: Vec<(String, Calibration)>,
    fleet: Fleet,
}

impl<'a> LiveSweep<'a> {
    /// Into `dir` (created): finds or makes the calibration, chooses the policies and points,
    /// prepares the fleet (started by the first cell) and writes the sweep's record.
    pub fn start(
        settings: &'a SweepSettings,
        bins: &'a Bins,
        dir: &Path,
        should_stop: &dyn Fn() -> bool,
    ) -> Result<LiveSweep<'a>> {
        let s = settings;
        // The policies first: a bad name is refused before the calibration runs.
        let policies = match s.ingress {
            Ingress::Router => grid::policies(&s.policies, s.quick)?,
            Ingress::Haproxy => {
                if !s.policies.is_empty() {
                    bail!(
                        "--policies chooses the router's policies; with --ingress haproxy the only policy is {}",
                        fleet::ingress::haproxy::POLICY
                    );
                }
                vec![fleet::ingress::haproxy::POLICY.to_string()]
            }
            // The router's policies, decided by the endpoint picker behind Envoy; the cells are
            // named `envoy-epp-<policy>` beside the router's.
            Ingress::EnvoyEpp => {
                fleet::ingress::envoy_epp::check_bin(&bins.router.with_file_name("epp"))?;
                grid::policies(&s.policies, s.quick)?
                    .iter()
                    .map(|p| fleet::ingress::envoy_epp::cell_policy(p))
                    .collect()
            }
            // The same policy in every router; cells `r<N>-<rr|hash>[-share]-<policy>`.
            Ingress::Routers(r) => {
                // HAProxy is the front: missing, it is refused before the calibration runs.
                fleet::ingress::haproxy::haproxy_bin()?;
                grid::policies(&s.policies, s.quick)?
                    .iter()
                    .map(|p| r.cell_policy(p))
                    .collect()
            }
        };
        // Refused before the calibration starts a fleet: exact residency needs KV events.
        let router_policies: Vec<String> = policies
            .iter()
            .map(|p| fleet::ingress::router_policy(p).to_string())
            .collect();
        s.fleet.check_policies(&router_policies)?;
        let cal = s.calibration_for(bins, dir, should_stop)?;
        let routing = cal
            .routing()
            .with_context(|| {
                format!(
                    "{}/calibration.json cannot set this sweep's routing; start the sweep afresh (--fresh) or in another directory",
                    dir.display()
                )
            })?;
        cal.write(&dir.join("calibration.json"))?;
        let points = s.sweep_points(&cal)?;
        let kv_events = router_policies.iter().any(|p| grid::needs_kv_events(p));
        let source = s
            .fleet
            .source(&bins.engine, kv_events, Some(&cal.used_replicas))?;
        let source = crate::trace_sweep::with_engine_limits(source, s)?;
        let fleet = Fleet::new(source, s.fleet.options(&dir.join("logs").join("fleet")))?;
        let mut record = s.record(&points, &policies, &cal);
        record["speed"] = serde_json::json!(s.fleet.effective_speed());
        record["lateness_share_of_itl_floor"] = serde_json::json!(s.lateness_share_of_itl_floor);
        record["evidence_bounds"] = serde_json::to_value(bounds(
            &cal,
            s.fleet.kind,
            s.fleet.effective_speed(),
            s.lateness_share_of_itl_floor,
        ))?;
        record["routing"] = serde_json::to_value(&routing)?;
        let record_path = dir.join(record_file_name(s.ingress));
        let earlier = std::fs::read_to_string(&record_path)
            .ok()
            .and_then(|text| serde_json::from_str(&text).ok());
        cell::write_atomic(
            &record_path,
            serde_json::to_string_pretty(&merged_record(earlier, record))?.as_bytes(),
        )?;
        Ok(LiveSweep {
            settings,
            bins,
            dir: dir.to_path_buf(),
            calibration: cal,
            routing,
            policies,
            points,
            own_calibrations: Vec::new(),
            fleet,
        })
    }

    /// Gives the named points capacities of their own (`CapacityScope::PerPoint`:
    /// `virtual_sweep::simulated_point_capacities`): each such point's rate, window and recorded
    /// capacity come from its own, as in the virtual sweep.
    pub fn at_point_capacities(&mut self, capacities: Vec<(String, Capacity)>) -> Result<()> {
        for (name, capacity) in capacities {
            let Some(i) = self.points.iter().position(|p| p.name == name) else {
                bail!("point {name} is not in this sweep");
            };
            let (point, cal) =
                self.settings
                    .at_point_capacity(&self.points[i], &self.calibration, capacity)?;
            self.points[i] = point;
            self.own_calibrations.push((name, cal));
        }
        Ok(())
    }

    /// The sweep's opening line: how many cells run where, and the SLO, KV capacity and fleet
    /// capacity they are judged by.
    pub fn banner(&self) -> String {
        let cal = &self.calibration;
        let (points, policies, reps) = (self.points.len(), self.policies.len(), self.settings.reps);
        format!(
            "xtask sweep {}: {points} points × {policies} policies × {reps} reps = {} cells into {} (SLO TTFT < {:.1} ms, ITL p50 < {:.2} ms; KV capacity {} tokens{})",
            self.settings.name.as_str(),
            points * policies * reps as usize,
            self.dir.display(),
            cal.slo.ttft_ms,
            cal.slo.itl_ms,
            cal.capacity_tokens,
            cal.capacity.as_ref().map_or_else(String::new, |c| format!(
                "; fleet capacity {} req/s",
                c.rate_rps
            ))
        )
    }

    /// The calibration `point`'s cells run under: its own capacity's, else the sweep's.
    fn calibration_of(&self, point: &Point) -> &Calibration {
        self.own_calibrations
            .iter()
            .find(|(n, _)| *n == point.name)
            .map_or(&self.calibration, |(_, c)| c)
    }

    /// The plan of `point`, written once and replayed by every cell of it.
    pub fn plan_for(&self, point: &Point) -> Result<PlanFile> {
        self.settings
            .plan_for(point, self.calibration_of(point), &self.dir)
    }

    /// Stops the fleet.
    pub fn stop(mut self) {
        self.fleet.stop();
    }

    /// Runs one repetition of `policy` at `point` into its directory until it is recorded:
    /// a failed attempt is discarded and re-run once; the gates ([`Gates`]) re-run failed
    /// evidence up to `evidence_retries` times, a warming one once; then it is accepted or set
    /// aside with its reason (an overloaded one is accepted at once, marked by its recorded
    /// drift verdict), and `meta.json` is written last. Returns the outcome for the progress line. On an interrupt
    /// the half cell is removed and nothing is recorded.
    pub fn run_cell(
        &mut self,
        point: &Point,
        policy: &str,
        rep: u32,
        plan: &PlanFile,
        should_stop: &dyn Fn() -> bool,
    ) -> Result<String> {
        let s = self.settings;
        let cal = &self.calibration_of(point).clone();
        let sweep_dir = self.dir.as_path();
        let dir = cell::rep_dir(sweep_dir, &point.name, policy, rep);
        let window = s.window_for(point, cal)?;
        let run_s = window.run_s();
        let (mode, closed_users) = match point.arrival {
            Arrival::Closed { users } => ("closed", Some(users as usize)),
            Arrival::Open { .. } => ("open", None),
            Arrival::Trace { .. } => ("replay", None),
        };
        let router = s.router_settings(&self.routing, fleet::ingress::router_policy(policy), rep);
        let cell_bounds = bounds(
            cal,
            s.fleet.kind,
            s.fleet.effective_speed(),
            s.lateness_share_of_itl_floor,
        );
        let driver = DriverSettings {
            mode,
            warmup_s: window.warmup_s,
            duration_s: Some(run_s),
            timeout_s: s.request_timeout_s,
            model: s.fleet.model.clone(),
            // Open loop: a turn still queued past the TTFT bound after the window has missed the
            // SLO already; writing it as abandoned ends an overloaded cell without its drain.
            abandon_after_ms: (mode == "open").then_some(cal.slo.ttft_ms),
            // Through the router or HAProxy, which keep connections alive.
            keep_alive: true,
        };
        let mut gates = Gates::new(s.evidence_retries);
        let mut failures = 0u32;
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            cell::clear(&dir)?;
            let result = run_attempt(
                &mut self.fleet,
                Attempt {
                    bins: self.bins,
                    dir: &dir,
                    plan,
                    router: router.clone(),
                    driver: driver.clone(),
                    closed_users,
                    planned_end_s: run_s,
                    slo: cal.slo,
                    evidence: EvidenceConfig {
                        lateness_urls: vec![],
                        fleet_process_groups: vec![],
                        check_foreign: !matches!(s.fleet.kind, FleetKind::Static),
                        gpu: true,
                        interval: Duration::from_secs_f64(s.evidence_interval_s.max(0.05)),
                        // run_attempt fills it from the fleet it runs on.
                        fleet_gpus: Default::default(),
                    },
                    sample_lateness: matches!(s.fleet.kind, FleetKind::Emulated),
                    ingress: s.ingress,
                    haproxy: fleet::ingress::HaproxySettings {
                        balance_factor: s.balance_factor,
                        ..fleet::ingress::HaproxySettings::default()
                    },
                    limit: Duration::from_secs_f64(run_s * 3.0 + s.request_timeout_s + 30.0),
                },
                should_stop,
            );
            let result = match result {
                Ok(r) => r,
                Err(e) if should_stop() => {
                    // Leave no half cell that could look whole: it has no meta, and we clear it.
                    let _ = std::fs::remove_dir_all(&dir);
                    return Err(e.context("interrupted"));
                }
                Err(e) => {
                    failures += 1;
                    let reason = format!("attempt {attempt} failed: {e:#}");
                    eprintln!("xtask: {} {policy} rep-{rep}: {reason}", point.name);
                    if failures >= 2 {
                        return Err(anyhow!(
                            "{} {policy} rep-{rep} failed twice; last: {e:#}",
                            point.name
                        ));
                    }
                    if dir.exists() {
                        cell::discard(sweep_dir, &point.name, policy, rep, attempt, &reason)?;
                    }
                    continue;
                }
            };
            let client = analysis::read_client_csv(&dir.join("client.csv"))
                .map_err(|e| anyhow!("drift check of {}: {e}", dir.display()))?;
            let drift = analysis::check_rows(
                &client,
                &cal.slo,
                &result.window,
                &analysis::DriftConfig::default(),
            );
            let mut result = result;
            let evidence = crate::gate::check_evidence(
                &mut result.evidence,
                &cell_bounds.evidence(),
                &client,
                &cal.slo,
                &result.window,
            );
            drop(client);
            let set_aside = match gates.judge(evidence, &drift) {
                GateDecision::Rerun { reason, note } => {
                    eprintln!("xtask: {} {policy} rep-{rep}: {note}", point.name);
                    cell::discard(sweep_dir, &point.name, policy, rep, attempt, &reason)?;
                    continue;
                }
                GateDecision::Record { set_aside } => set_aside,
            };
            let replicas = self.fleet.replicas();
            let meta = Meta {
                sweep: s.name.as_str().to_string(),
                point: point.name.clone(),
                policy: policy.to_string(),
                rep,
                workload_name: plan.workload_name.clone(),
                workload_fingerprint: plan.workload_fingerprint.clone(),
                plan_fingerprint: plan.plan_fingerprint.clone(),
                fleet: serde_json::json!({
                    "source": s.fleet.key().source,
                    "replicas": replicas.len(),
                    "engine": s.fleet.engine(),
                    "engine_flags": s.fleet.engine_flags(),
                    "speed": s.fleet.effective_speed(),
                    "slowdowns": replicas.iter().map(|r| r.slowdown).collect::<Vec<_>>(),
                    // SCHED_IDLE spinners beside the replicas: machine CPU busy reads ~1 with them.
                    "keep_awake_threads": self.fleet.keep_awake_threads(),
                    "capacity_tokens": cal.capacity_tokens,
                    "num_gpu_blocks": cal.fleet.num_gpu_blocks,
                    "model": s.fleet.model,
                    "used_replicas": cal.used_replicas,
                }),
                slo: cal.slo,
                window: result.window,
                git_rev: s.git_rev.clone(),
                versions: s.versions.clone(),
                virtual_time: false,
                complete: true,
                accepted: set_aside.is_none(),
                set_aside_reason: set_aside.clone(),
                attempts: attempt,
                evidence: Some(result.evidence.clone().into()),
                drift: Some(drift.clone()),
                run: {
                    let mut run = s.run_record(point, cal, &window);
                    run["plan"] = serde_json::json!(plan.name);
                    run["router"] = serde_json::to_value(&router)?;
                    // What the router ran with (its readiness line): issue #18's worker count.
                    run["router_workers"] = serde_json::json!(result.router_workers);
                    run["router_scheduling"] = serde_json::json!(result.router_scheduling);
                    // How many routers, behind which front, sharing decisions (issue #19).
                    if let Some(r) = s.ingress.routers_run_record() {
                        for (k, v) in r.as_object().into_iter().flatten() {
                            run[k] = v.clone();
                        }
                    }
                    run["routing"] = serde_json::to_value(&self.routing)?;
                    run["evidence_bounds"] = serde_json::to_value(&cell_bounds)?;
                    run["driver"] = serde_json::to_value(&driver)?;
                    run["requests"] = serde_json::json!(result.requests);
                    run["trace"] = serde_json::to_value(crate::trace_sweep::meta_of(plan))?;
                    serde_json::from_value(run)?
                },
            };
            if should_stop() {
                let _ = std::fs::remove_dir_all(&dir);
                bail!("interrupted before the cell was recorded");
            }
            cell::write_meta(&dir, &meta)?;
            return Ok(match set_aside {
                None => format!(
                    "accepted, goodput {:.2} req/s over {:.1} s{}{}",
                    result.goodput_rps,
                    result.window.measured_end_s - result.window.measured_start_s,
                    if attempt > 1 {
                        format!(" (attempt {attempt})")
                    } else {
                        String::new()
                    },
                    match (drift.overloaded, &drift.reason) {
                        (true, Some(why)) => format!("; marked {why}"),
                        _ => String::new(),
                    }
                ),
                Some(why) => format!("set aside: {why}"),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::capacity::{StepMeasurement, StepRequest, search, step_warmup_s};
    use crate::scratch::Scratch;

    /// A calibration of the test fleet (through JSON, so that fields added with defaults keep
    /// it valid), with a capacity found by the search on a fake fleet that meets the SLO up to
    /// 4 req/s and settles with a 5 s warm-up everywhere.
    fn calibration(with_capacity: bool) -> Calibration {
        let mut cal: Calibration = serde_json::from_value(serde_json::json!({
            "fleet": FleetSpec::test_emulated().key(),
            "replicas": [], "used_replicas": [0, 1, 2],
            "floors": {"ttft_ms": 50.0, "itl_ms": 1.5}, "slo_factor": 3.0,
            "slo": {"ttft_ms": 150.0, "itl_ms": 4.5}, "capacity_tokens": 196608,
            "index": {"ttl_s": null, "ttl_is_lower_bound": false, "node_cap": null,
                      "honoured_share": null, "detail": null},
            "gpus": [], "gpu_status": "no GPU", "reference_run": null,
            "git_rev": null, "versions": null,
        }))
        .unwrap();
        assert!(cal.capacity.is_none(), "absent in older files: None");
        if with_capacity {
            let cfg = crate::capacity::SearchConfig {
                start_rps: 2.0,
                start_rule: "test".into(),
                step_factor: 2.0,
                resolution: 0.15,
                max_coarse_steps: 4,
                widen_after: None,
                max_lengthenings: 1,
                policies: vec!["prefix-affinity".into()],
                open_start: workload::OpenStart::Stationary,
            };
            let mut cap = search(&cfg, &mut |step: &StepRequest| {
                let a = if step.rate_rps <= 4.0 { 0.95 } else { 0.5 };
                Ok(StepMeasurement {
                    attainment: Some(a),
                    goodput_rps: a * step.rate_rps,
                    measured_requests: 100,
                    settled: true,
                    unsettled_reason: None,
                    overloaded: false,
                    worsening: false,
                    improving: false,
                    warmup_s: step_warmup_s(5.0, step.lengthening),
                    measure_s: 8.0,
                    inflow_tokens_per_s: None,
                    dir: None,
                })
            })
            .unwrap();
            assert_eq!(cap.rate_rps, 4.0);
            // As if searched on today's open loops.
            cap.open_start = cal.open_start();
            cal.capacity = Some(cap);
        }
        cal
    }

    fn settings(load: Option<Vec<f64>>) -> SweepSettings {
        SweepSettings {
            name: SweepName::Load,
            users: 8,
            load_fractions: load,
            warmup_given: false,
            calibration: PathBuf::from("measurements/calibration.json"),
            ..SweepSettings::test_quick()
        }
    }

    #[test]
    fn load_points_carry_their_fraction_and_rate_into_names_windows_and_meta() {
        let mut cal = calibration(true);
        let s = settings(Some(vec![0.5, 1.5]));
        let points = s.sweep_points(&cal).unwrap();
        let names: Vec<&str> = points.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["ws1-s0-load0.5", "ws1-s0-load1.5"]);
        assert_eq!(points[1].arrival, Arrival::Open { rate_rps: 6.0 });
        // The primes' pace: 3 replicas × the 1,100-token floor prompt ÷ the 50-ms TTFT floor.
        assert_eq!(cal.prime_pace().tokens_per_s, 66_000);
        // Every step primed the caches first, then settled within 5 s.
        let prime_s =
            workload::prime_period_s(&s.spec_for(&points[0], &cal), cal.open_start()).unwrap();
        assert!(prime_s > 0.0);
        for p in &mut cal.capacity.as_mut().unwrap().curve {
            p.step.warmup_s = prime_s + 5.0;
        }
        // The warm-up: the primes, then 1.5 × the 5 s the search settled with after them at the
        // nearest rate at or above.
        let w = s.window_for(&points[0], &cal).unwrap();
        assert_eq!(w.settled_at_rps, Some(2.0));
        assert!((w.warmup_s - (prime_s + 7.5)).abs() < 1e-9, "{w:?}");
        let w_high = s.window_for(&points[1], &cal).unwrap();
        assert_eq!(
            w_high.settled_at_rps,
            Some(8.0),
            "the failing step settled too"
        );
        // meta.json's run record: fraction, offered rate (model and wall), capacity, window.
        let run = s.run_record(&points[1], &cal, &w_high);
        assert_eq!(run["load_fraction"], 1.5);
        assert_eq!(run["offered_rps"], 6.0);
        assert_eq!(run["offered_wall_rps"], 36.0);
        assert_eq!(run["capacity_rps"], 4.0);
        assert_eq!(run["window"]["warmup_s"], w_high.warmup_s);
        assert!(run["window"]["rule"].as_str().unwrap().contains("settled"));
        // The plan: the workload name carries the fraction; the schedule is the open-loop rate
        // (wall = model × speed) over the derived window.
        let scratch = Scratch::new("sweep-load-plan");
        let plan = s.plan_for(&points[0], &cal, &scratch.0).unwrap();
        assert!(
            plan.workload_name.ends_with("-load0.5"),
            "{}",
            plan.workload_name
        );
        assert!(
            plan.name
                .contains(&format!("-load0.5-open-l12-d{}-primed", w.warmup_s + 8.0)),
            "{}",
            plan.name
        );
        // --warmup-s given: every cell uses it.
        let mut given = settings(Some(vec![1.0]));
        given.warmup_given = true;
        let p = &given.sweep_points(&cal).unwrap()[0];
        assert_eq!(given.window_for(p, &cal).unwrap().warmup_s, 5.0);
        // A closed loop keeps the sweep's windows and records no offered rate.
        let closed = settings(None);
        let mut closed_grid = closed.clone();
        closed_grid.name = SweepName::PressureGrid;
        let p = &closed_grid.sweep_points(&cal).unwrap()[0];
        assert_eq!(p.name, "ws1-s0");
        let w = closed_grid.window_for(p, &cal).unwrap();
        assert_eq!((w.warmup_s, w.measure_s), (5.0, 8.0));
        let run = closed_grid.run_record(p, &cal, &w);
        assert!(run["offered_rps"].is_null() && run["load_fraction"].is_null());
    }

    #[test]
    fn flags_choose_the_ingress_and_the_default_capacity_scope() {
        use fleet::ingress::Front;
        let i = ingress_from_flags(
            IngressFlag::Router,
            4,
            Some(Front::SessionHash),
            false,
            false,
        );
        assert_eq!(i.unwrap().record_file_name(), "sweep-r4-hash.json");
        assert_eq!(
            ingress_from_flags(IngressFlag::EnvoyEpp, 1, None, false, false).unwrap(),
            Ingress::EnvoyEpp
        );
        assert!(ingress_from_flags(IngressFlag::Haproxy, 2, None, false, false).is_err());
        let run = ingress_from_flags(IngressFlag::Router, 2, None, true, false)
            .unwrap()
            .routers_run_record()
            .unwrap();
        assert_eq!(
            run,
            serde_json::json!({"routers": 2, "front": "rr", "share_decisions": true, "share_loads": false})
        );
        let loads = ingress_from_flags(IngressFlag::Router, 8, None, true, true).unwrap();
        assert_eq!(loads.record_file_name(), "sweep-r8-rr-share-loads.json");
        assert_eq!(loads.routers_run_record().unwrap()["share_loads"], true);
        assert!(ingress_from_flags(IngressFlag::Router, 8, None, false, true).is_err());
        assert_eq!(Ingress::Router.routers_run_record().unwrap()["routers"], 1);
        assert!(Ingress::Haproxy.routers_run_record().is_none());
        let scope = CapacityScope::default_for;
        assert_eq!(
            scope(false, false, FleetKind::Emulated),
            CapacityScope::PerPoint
        );
        assert_eq!(
            scope(false, true, FleetKind::Command),
            CapacityScope::PerPoint
        );
        assert_eq!(
            scope(false, false, FleetKind::Command),
            CapacityScope::Reference
        );
        assert_eq!(
            scope(true, true, FleetKind::Emulated),
            CapacityScope::Reference
        );
    }

    #[test]
    fn a_calibration_without_capacity_is_refused_naming_the_command() {
        let cal = calibration(false);
        let s = settings(Some(vec![]));
        let path = Path::new("measurements/calibration.json");
        let err = s.check_capacity(&cal, path).unwrap_err().to_string();
        assert!(
            err.contains("cargo xtask calibrate --quick --out measurements/calibration.json"),
            "{err}"
        );
        assert!(err.contains("--users"), "{err}");
        assert!(s.sweep_points(&cal).is_err());
        // Closed loop needs no capacity.
        settings(None).check_capacity(&cal, path).unwrap();
    }

    #[test]
    fn a_capacity_searched_on_fresh_open_loops_is_refused_naming_the_command() {
        // A calibration written before open loops started at the steady state's turn mix: its
        // file has no `open_start`, which reads as a fresh start.
        let mut cal = calibration(true);
        let mut json = serde_json::to_value(cal.capacity.as_ref().unwrap()).unwrap();
        json.as_object_mut().unwrap().remove("open_start");
        cal.capacity = Some(serde_json::from_value(json).unwrap());
        let s = settings(Some(vec![]));
        let path = Path::new("measurements/calibration.json");
        let err = s.check_capacity(&cal, path).unwrap_err().to_string();
        assert!(err.contains("Fresh start"), "{err}");
        assert!(
            err.contains("cargo xtask calibrate --quick --out measurements/calibration.json"),
            "{err}"
        );
        // The same capacity searched today passes, and a closed loop needs none.
        cal.capacity.as_mut().unwrap().open_start = cal.open_start();
        s.check_capacity(&cal, path).unwrap();
        settings(None).check_capacity(&cal, path).unwrap();
    }

    #[test]
    fn a_restricted_run_adds_to_the_sweep_record_instead_of_shrinking_it() {
        let rec = |points: &[&str], policies: &[&str], warmup_s: f64| {
            serde_json::json!({
                "sweep": "pressure-grid", "quick": false, "reps": 3, "warmup_s": warmup_s,
                "measure_s": 10.0, "think_model_s": 1.0, "speed": 6.0,
                "points": points.iter().map(|p| serde_json::json!({"name": p})).collect::<Vec<_>>(),
                "policies": policies,
            })
        };
        let names = |v: &serde_json::Value| -> Vec<String> {
            v["points"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p["name"].as_str().unwrap().to_string())
                .collect()
        };
        let full = rec(
            &["ws1-s0", "ws3-s0"],
            &["round-robin", "session-affinity"],
            15.0,
        );
        let resumed = rec(
            &["ws3-s0", "ws8-s0"],
            &["session-affinity", "prefix-affinity"],
            15.0,
        );
        let merged = merged_record(Some(full.clone()), resumed);
        assert_eq!(names(&merged), ["ws1-s0", "ws3-s0", "ws8-s0"]);
        assert_eq!(
            merged["policies"],
            serde_json::json!(["round-robin", "session-affinity", "prefix-affinity"])
        );
        // Other windows make another sweep: its record replaces the earlier one.
        let other = rec(&["ws8-s0"], &["round-robin"], 20.0);
        assert_eq!(names(&merged_record(Some(full), other.clone())), ["ws8-s0"]);
        assert_eq!(merged_record(None, other.clone()), other);
        // HAProxy cells keep their own record beside the router grid's.
        assert_eq!(record_file_name(Ingress::Router), "sweep.json");
        assert_eq!(record_file_name(Ingress::Haproxy), "sweep-haproxy.json");
        assert_eq!(record_file_name(Ingress::EnvoyEpp), "sweep-envoy-epp.json");
        // So do several routers, one record per count, front and sharing.
        let routers = |count, front, share| {
            record_file_name(Ingress::Routers(fleet::RoutersSettings {
                count,
                front,
                share,
                share_loads: false,
            }))
        };
        use fleet::ingress::Front;
        assert_eq!(routers(4, Front::RoundRobin, false), "sweep-r4-rr.json");
        assert_eq!(routers(2, Front::SessionHash, false), "sweep-r2-hash.json");
        assert_eq!(
            routers(8, Front::RoundRobin, true),
            "sweep-r8-rr-share.json"
        );
    }
}
