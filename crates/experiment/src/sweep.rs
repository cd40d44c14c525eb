//! The live sweep (DESIGN.md §3.8): its settings, shared with the virtual sweep (points, plans),
//! and the procedure of one cell — cycle the fleet, start the router (or HAProxy), warm up,
//! measure, check evidence and drift, re-run or set aside, write `meta.json` last. The loop over
//! points × repetitions × policies, resuming and progress are the caller's (`cargo xtask sweep`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Result, anyhow, bail};

use fleet::evidence::EvidenceConfig;
use fleet::{DriverSettings, Fleet, Ingress, RouterSettings};
use schema::Meta;
use workload::{ArrivalSpec, Sizing, WorkloadSpec};

use crate::attempt::{Attempt, bounds, run_attempt};
use crate::bins::Bins;
use crate::calibrate::{CalibrateSettings, calibrate};
use crate::calibration::{Calibration, requests_per_user};
use crate::cell;
use crate::fleet_spec::{FleetKind, FleetSpec};
use crate::grid::{self, Arrival, GridParams, Point, SweepName};
use crate::plan_file::{PlanFile, ensure_plan};

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
    /// Model-time rates of the `load` sweep (empty: the defaults).
    pub rates_rps: Vec<f64>,
    /// Only these points (empty: all).
    pub points: Vec<String>,
    /// Mean think time of closed-loop users, s of model time (wall = think ÷ speed).
    pub think_model_s: f64,
    /// Warm-up per cell, wall s.
    pub warmup_s: f64,
    /// Measured window per cell, wall s.
    pub measure_s: f64,
    /// The calibration to reuse when it is for this fleet (or where a fresh one goes).
    pub calibration: PathBuf,
    /// Recalibrate even when the calibration matches.
    pub recalibrate: bool,
    /// Largest engine lateness p99 (wall ms) a cell may show before it is discarded.
    pub max_lateness_p99_ms: f64,
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
}

impl SweepSettings {
    /// Warm-up + measured window, wall s (the driver's `--duration-s`).
    pub fn run_s(&self) -> f64 {
        self.warmup_s + self.measure_s
    }

    /// The sweep's grid points for a fleet of `replicas`, narrowed to `points`; the live and the
    /// virtual sweep share it so both run the same grid.
    pub fn sweep_points(&self, replicas: usize) -> Result<Vec<Point>> {
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
                replicas,
            },
        )?;
        grid::select_points(points, &self.points)
    }

    /// The plan of one point (`<sweep>/<point>/plan.bin`), sized by the calibration's capacity and
    /// floors; the virtual sweep writes the same bytes.
    pub fn plan_for(&self, point: &Point, cal: &Calibration, sweep_dir: &Path) -> Result<PlanFile> {
        let speed = self.fleet.effective_speed();
        let spec = WorkloadSpec {
            seed: self.seed,
            sizing: Sizing::WorkingSet {
                capacity_tokens: cal.capacity_tokens,
                ratio: point.ratio,
            },
            zipf_s: point.zipf_s,
            turns: point.turns,
            prefix_tokens: point.prefix_tokens,
            ..WorkloadSpec::default()
        };
        let run_s = self.run_s();
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
            },
            Arrival::Trace { .. } => {
                return crate::trace_sweep::ensure_trace_plan(self, point, sweep_dir);
            }
        };
        ensure_plan(&sweep_dir.join(&point.name), &spec, &arrival)
    }

    /// The calibration for this sweep: the sweep directory's own (a resumed sweep keeps its SLO),
    /// else `calibration` when made for this fleet, else a fresh one.
    fn calibration_for(
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
            return Ok(c);
        }
        if !self.recalibrate && self.calibration.exists() {
            match Calibration::read(&self.calibration) {
                Ok(c) if c.fleet == key => {
                    eprintln!("xtask: using {}", self.calibration.display());
                    return Ok(c);
                }
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
/// for HAProxy cells run into the same directory, so that adding them does not overwrite the
/// record of the router grid.
pub fn record_file_name(ingress: Ingress) -> &'static str {
    match ingress {
        Ingress::Router => "sweep.json",
        Ingress::Haproxy => "sweep-haproxy.json",
    }
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
    /// The policies compared, in the order a repetition runs them.
    pub policies: Vec<String>,
    /// The points, in order.
    pub points: Vec<Point>,
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
        let cal = s.calibration_for(bins, dir, should_stop)?;
        cal.write(&dir.join("calibration.json"))?;
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
        };
        let points = s.sweep_points(cal.used_replicas.len())?;
        let kv_events = policies.iter().any(|p| grid::needs_kv_events(p));
        let source = s
            .fleet
            .source(&bins.engine, kv_events, Some(&cal.used_replicas))?;
        let source = crate::trace_sweep::with_engine_limits(source, s)?;
        let fleet = Fleet::new(source, s.fleet.options(&dir.join("logs").join("fleet")))?;
        let record = serde_json::json!({
            "sweep": s.name.as_str(),
            "quick": s.quick,
            "points": points,
            "policies": policies,
            "reps": s.reps,
            "warmup_s": s.warmup_s,
            "measure_s": s.measure_s,
            "think_model_s": s.think_model_s,
            "speed": s.fleet.effective_speed(),
            "max_lateness_p99_ms": s.max_lateness_p99_ms,
            "calibration": cal,
            "trace": s.trace,
        });
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
            policies,
            points,
            fleet,
        })
    }

    /// The plan of `point`, written once and replayed by every cell of it.
    pub fn plan_for(&self, point: &Point) -> Result<PlanFile> {
        self.settings.plan_for(point, &self.calibration, &self.dir)
    }

    /// Stops the fleet.
    pub fn stop(mut self) {
        self.fleet.stop();
    }

    /// Runs one repetition of `policy` at `point` into its directory until it is recorded:
    /// a failed attempt is discarded and re-run once, failed evidence up to `evidence_retries`
    /// times, a drifting one once; then it is accepted or set aside with its reason, and
    /// `meta.json` is written last. Returns the outcome for the progress line. On an interrupt
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
        let cal = &self.calibration;
        let sweep_dir = self.dir.as_path();
        let dir = cell::rep_dir(sweep_dir, &point.name, policy, rep);
        let run_s = s.run_s();
        let (mode, closed_users) = match point.arrival {
            Arrival::Closed { users } => ("closed", Some(users as usize)),
            Arrival::Open { .. } => ("open", None),
            Arrival::Trace { .. } => ("replay", None),
        };
        let belief = grid::uses_belief_index(policy);
        let router = RouterSettings {
            policy: policy.to_string(),
            model: s.fleet.model.clone(),
            seed: s.seed + u64::from(rep),
            index_ttl_s: if belief { cal.index.ttl_s } else { None },
            index_node_cap: if belief { cal.index.node_cap } else { None },
            kv_events: grid::needs_kv_events(policy),
        };
        let driver = DriverSettings {
            mode,
            warmup_s: s.warmup_s,
            duration_s: Some(run_s),
            timeout_s: s.request_timeout_s,
            model: s.fleet.model.clone(),
        };
        let mut drift_reruns = 0u32;
        let mut evidence_reruns = 0u32;
        let mut failures = 0u32;
        let mut attempt = 0u32;
        let mut set_aside: Option<String> = None;
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
            // Evidence first: a dirty window says nothing about warming.
            if let Err(why) = result.evidence.check(&bounds(s.max_lateness_p99_ms)) {
                if evidence_reruns < s.evidence_retries {
                    evidence_reruns += 1;
                    eprintln!(
                        "xtask: {} {policy} rep-{rep}: evidence failed ({why}); discarded, re-running",
                        point.name
                    );
                    cell::discard(
                        sweep_dir,
                        &point.name,
                        policy,
                        rep,
                        attempt,
                        &format!("evidence: {why}"),
                    )?;
                    continue;
                }
                set_aside = Some(format!(
                    "evidence failed on {} attempts: {why}",
                    evidence_reruns + 1
                ));
            }
            let drift = analysis::check_rep_dir(
                &dir,
                &cal.slo,
                &result.window,
                &analysis::DriftConfig::default(),
            )
            .map_err(|e| anyhow!("drift check of {}: {e}", dir.display()))?;
            if set_aside.is_none() && drift.warming {
                let why = drift.reason.clone().unwrap_or_else(|| "warming".into());
                if drift_reruns == 0 {
                    drift_reruns += 1;
                    eprintln!(
                        "xtask: {} {policy} rep-{rep}: drift ({why}); re-running once",
                        point.name
                    );
                    cell::discard(
                        sweep_dir,
                        &point.name,
                        policy,
                        rep,
                        attempt,
                        &format!("drift: {why}"),
                    )?;
                    continue;
                }
                set_aside = Some(format!("drifted twice: {why}"));
            }
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
                    "speed": s.fleet.effective_speed(),
                    "slowdowns": replicas.iter().map(|r| r.slowdown).collect::<Vec<_>>(),
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
                evidence: serde_json::to_value(&result.evidence)?,
                drift: serde_json::to_value(&drift)?,
                run: serde_json::json!({
                    "plan": plan.name,
                    "router": router,
                    "driver": driver,
                    "think_model_s": s.think_model_s,
                    "arrival": point.arrival,
                    "requests": result.requests,
                    "trace": crate::trace_sweep::meta_of(plan),
                }),
            };
            if should_stop() {
                let _ = std::fs::remove_dir_all(&dir);
                bail!("interrupted before the cell was recorded");
            }
            cell::write_meta(&dir, &meta)?;
            return Ok(match set_aside {
                None => format!(
                    "accepted, goodput {:.2} req/s over {:.1} s{}",
                    result.goodput_rps,
                    result.window.measured_end_s - result.window.measured_start_s,
                    if attempt > 1 {
                        format!(" (attempt {attempt})")
                    } else {
                        String::new()
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
    }
}
