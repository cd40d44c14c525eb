//! The fault experiment (docs/ARCHITECTURE.md, "Faults"): steady open-loop load at the frozen point
//! (working set 1, skew 0) through the router, one replica faulted mid-run and restarted. This
//! module is the procedure (fleet, the router's admin API, clock probes, one repetition, its
//! files); what the rows show (loss bounds, clock alignment, windows, summary, timeline) is
//! `analysis::fault`, and the loop over repetitions with its progress is the caller's (`cargo xtask
//! fault`).
//!
//! - `kill`: SIGKILL the victim, with no warning, at a moment the router counts requests in
//!   flight on it; restart it after 60 s of model time (÷ speed). Only requests in flight on the
//!   victim at the kill may be lost; none that were not yet dispatched.
//! - `drain`: `POST /admin/replicas/{id}/drain`, wait for its outstanding count to reach 0, stop
//!   it, restart it after the same outage, `…/undrain`. Nothing may be lost.
//!
//! Gates: every repetition passes a sweep cell's gates ([`Gates`]): the evidence check with the
//! sweep's bounds, then the drift test on the steady load before the fault
//! (`analysis::fault::drift_window`: the outage and the recovery are the fault's effect, not
//! warming). Failed evidence is re-run up to `evidence_retries` times, drift once (the attempt
//! moved to `_discarded/` with its reason); then the repetition is recorded accepted or set
//! aside, and `meta.json` records what each gate said (`run.gates`).
//!
//! Layout: `measurements/fault-<kind>[-quick]/<point>/<policy>/rep-<k>/` holds the rows of every
//! sweep (`client.csv`, `router.csv`, `evidence.jsonl`, `meta.json`) plus `fault.json` (the
//! fault's instants on every clock); beside them `timeline.csv` (docs/CONTRACTS.md, "Fault
//! timeline"), `summary.md` and `summary.json`.
//!
//! Clocks: the fault is timed on this process's clock; a few deliberately malformed requests
//! (`x-request-id: fault-clock-probe-*`, answered 400 by the router before any routing) let
//! `analysis::fault` place it on the router's and the driver's clocks.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use serde::{Deserialize, Serialize};

use analysis::fault::{
    ClockProbe, FaultEvents, FaultKind, GateStatus, Instants, PROBE_PREFIX, RecordedGates, Summary,
    analyse_rep, drift_window, probe_offset, router_minus_driver,
};
use analysis::{ClientRow, DriftConfig};
use fleet::evidence::{EvidenceConfig, EvidenceSampler, EvidenceSummary};
use fleet::{DriverSettings, Fleet, RouterSettings, http};
use schema::{Meta, Slo, Window};
use workload::{ArrivalSpec, Sizing, WorkloadSpec};

use crate::bins::Bins;
use crate::calibrate::{CalibrateSettings, calibrate};
use crate::calibration::{Calibration, Routing};
use crate::cell;
use crate::fleet_spec::{FleetKind, FleetSpec};
use crate::gate::{GateDecision, Gates};
use crate::grid;
use crate::plan_file::{PlanFile, ensure_plan};

/// The policies faulted by default: the hashing baseline and the cache-aware router with its
/// spill branch on and off (the branch that decides where a dead replica's sessions go).
pub const DEFAULT_POLICIES: &[&str] = &[
    "session-affinity",
    "prefix-affinity",
    "prefix-affinity-spill-off",
];

/// A fault run's default directory name: `fault-<kind>`, `-quick` appended with `quick`.
pub fn default_dir_name(kind: FaultKind, quick: bool) -> String {
    let base = format!("fault-{}", kind.as_str());
    if quick { format!("{base}-quick") } else { base }
}

/// The default warm-up, steady load before the fault, and load after the planned restart, wall
/// s: `(warmup, before, after)`.
pub fn default_phases_s(quick: bool) -> (f64, f64, f64) {
    if quick {
        (3.0, 10.0, 20.0)
    } else {
        (10.0, 30.0, 60.0)
    }
}

/// What a fault run runs with (defaults already applied).
#[derive(Debug, Clone)]
pub struct FaultSettings {
    /// Which fault.
    pub kind: FaultKind,
    /// Small fleet and short phases.
    pub quick: bool,
    /// Repetitions per policy.
    pub reps: u32,
    /// Policies chosen (empty: [`DEFAULT_POLICIES`]).
    pub policies: Vec<String>,
    /// Open-loop rate, requests per second of model time (`None`: 0.8 × replicas).
    pub rate_model_rps: Option<f64>,
    /// Fleet index of the replica to fault (= its router id).
    pub victim: usize,
    /// Warm-up, wall s.
    pub warmup_s: f64,
    /// Steady load after the warm-up and before the fault, wall s.
    pub before_s: f64,
    /// How long the replica stays down, s of model time.
    pub outage_model_s: f64,
    /// Load kept running after the planned restart, wall s.
    pub after_s: f64,
    /// How long to wait for the victim to have a request in flight, wall s.
    pub inflight_wait_s: f64,
    /// The calibration to reuse when it is for this fleet (or where a fresh one goes).
    pub calibration: PathBuf,
    /// Recalibrate even when the calibration matches.
    pub recalibrate: bool,
    /// The SLO given outright (no calibration; the KV capacity is read from the replicas).
    pub slo: Option<Slo>,
    /// Per-request timeout, wall s.
    pub request_timeout_s: f64,
    /// Seconds between evidence samples.
    pub evidence_interval_s: f64,
    /// The engine-lateness bound as a share of the ITL floor in model time (the sweep's evidence
    /// bound, `calibration::lateness_bound`).
    pub lateness_share_of_itl_floor: f64,
    /// Re-runs of a repetition whose evidence fails before it is set aside.
    pub evidence_retries: u32,
    /// Workload seed.
    pub seed: u64,
    /// The fleet.
    pub fleet: FleetSpec,
    /// Git revision recorded in every `meta.json`.
    pub git_rev: Option<String>,
    /// Tool versions recorded beside it.
    pub versions: serde_json::Value,
    /// What sits in front of the fleet: kvroute's router, or Envoy deciding through kvroute's
    /// endpoint picker (cells `envoy-epp-<policy>`); HAProxy is refused (no admin API to drain
    /// through, no router rows to place the fault on).
    pub ingress: fleet::Ingress,
}

impl FaultSettings {
    /// The outage in wall seconds.
    pub fn outage_wall_s(&self) -> f64 {
        self.outage_model_s / self.fleet.effective_speed()
    }

    /// The whole run, wall s: warm-up, before, outage, after.
    pub fn run_s(&self) -> f64 {
        self.warmup_s + self.before_s + self.outage_wall_s() + self.after_s
    }

    /// Refuses settings a fault cannot run with (naming the flag).
    pub fn check(&self) -> Result<()> {
        if self.reps == 0 {
            bail!("--reps must be at least 1");
        }
        match self.ingress {
            fleet::Ingress::Router | fleet::Ingress::EnvoyEpp => {}
            fleet::Ingress::Haproxy => bail!(
                "a fault runs through kvroute's router or Envoy with its endpoint picker (--ingress router|envoy-epp): HAProxy has no admin API to drain through and writes no router rows to place the fault on"
            ),
            fleet::Ingress::Routers(_) => bail!(
                "a fault runs through one router (or Envoy with its endpoint picker): N routers have N admin APIs and N clocks, which the fault's drain and clock probes do not handle"
            ),
        }
        for (name, v) in [
            ("--warmup-s", self.warmup_s),
            ("--before-s", self.before_s),
            ("--after-s", self.after_s),
            ("--outage-model-s", self.outage_model_s),
            ("--inflight-wait-s", self.inflight_wait_s),
            ("--request-timeout-s", self.request_timeout_s),
            (
                "--lateness-share-of-itl-floor",
                self.lateness_share_of_itl_floor,
            ),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                bail!("{name} must be a non-negative number of seconds, got {v}");
            }
        }
        if self.before_s <= 0.0 || self.after_s <= 0.0 {
            bail!("--before-s and --after-s must be positive: the fault needs load around it");
        }
        if self.outage_wall_s() < 1.0 {
            bail!(
                "the outage is {:.2} s of wall time (--outage-model-s {} ÷ speed {}); it must last at least 1 s so that the timeline's 1-s buckets see the replica down",
                self.outage_wall_s(),
                self.outage_model_s,
                self.fleet.effective_speed()
            );
        }
        if self.fleet.kind == FleetKind::Static {
            bail!(
                "a fault needs replicas this harness starts and stops: use --fleet emulated or --fleet command"
            );
        }
        if let Some(slo) = self.slo
            && !(slo.ttft_ms > 0.0
                && slo.itl_ms > 0.0
                && slo.ttft_ms.is_finite()
                && slo.itl_ms.is_finite())
        {
            bail!("--slo-ttft-ms and --slo-itl-ms must be positive");
        }
        Ok(())
    }

    /// The open-loop rate in requests per second of model time: the one given, else 0.8 per
    /// replica (the middle of the `load` sweep), rounded to 1/1000.
    fn model_rate(&self, replicas: usize) -> Result<f64> {
        let rate = self.rate_model_rps.unwrap_or(0.8 * replicas as f64);
        if !(rate.is_finite() && rate > 0.0) {
            bail!("--rate must be positive, got {rate}");
        }
        Ok((rate * 1000.0).round() / 1000.0)
    }
}

/// The point directory: the frozen point (working set 1, skew 0) at `rate`, named like the
/// `load` sweep's points.
pub fn point_name(model_rate_rps: f64) -> String {
    format!("ws1-s0-rate{model_rate_rps}")
}

/// What the run needs from a calibration (or from the SLO given outright); recorded in
/// `sweep.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Setup {
    /// The SLO.
    pub slo: Slo,
    /// The fleet's KV capacity (sizes the working set).
    pub capacity_tokens: u64,
    /// TTL, node cap and bytes per token from the calibration ([`Calibration::routing`], as
    /// every sweep cell); `None` with the SLO given outright and no calibration for this fleet,
    /// when belief policies are refused.
    pub routing: Option<Routing>,
    /// Replicas in use.
    pub used_replicas: Vec<usize>,
    /// Whether a calibration gave these (not the SLO flags).
    pub calibrated: bool,
    /// The floors the lateness bound is a share of: the calibration's, or with the SLO given
    /// outright the SLO ÷ `SLO_FACTOR` (the floors that SLO stands for under the SLO rule).
    pub floors: Slo,
    /// The calibration's throttle bound (command fleets whose cards NVML read).
    pub throttle: Option<crate::calibration::ThrottleBound>,
}

/// The evidence bounds of a repetition: the sweep cells' rule on the setup's floors.
fn rep_bounds(s: &FaultSettings, setup: &Setup) -> crate::attempt::CellBounds {
    crate::attempt::bounds_from(
        &setup.floors,
        setup.throttle.as_ref(),
        s.fleet.kind,
        s.fleet.effective_speed(),
        s.lateness_share_of_itl_floor,
    )
}

/// The SLO, capacity and index settings: from the SLO given (capacity read from the replicas,
/// routing from `s.calibration` when it is for this fleet), else the directory's own
/// calibration, else `s.calibration` when it is for this fleet, else a fresh calibration.
fn setup(
    s: &FaultSettings,
    bins: &Bins,
    dir: &Path,
    kv_events: bool,
    should_stop: &dyn Fn() -> bool,
) -> Result<Setup> {
    if let Some(slo) = s.slo {
        let n = s.fleet.replica_count();
        let source = s.fleet.source(&bins.engine, kv_events, None)?;
        let mut fleet = Fleet::new(source, s.fleet.options(&dir.join("logs").join("fleet")))?;
        fleet.start(should_stop)?;
        let mut capacity_tokens = 0;
        for r in fleet.replicas() {
            let cache = fleet.kv_cache(r.index).ok_or_else(|| {
                anyhow!(
                    "replica {} reports no KV capacity (vllm:cache_config_info on /metrics; llama.cpp: /props); it is unknown",
                    r.index
                )
            })?;
            capacity_tokens += cache.capacity_tokens();
        }
        fleet.stop();
        // The SLO is given; what the router needs still comes from the one calibration.
        let routing = s
            .calibration
            .exists()
            .then(|| Calibration::read(&s.calibration).ok())
            .flatten()
            .filter(|c| c.fleet == s.fleet.key())
            .and_then(|c| c.routing().ok());
        return Ok(Setup {
            slo,
            capacity_tokens,
            routing,
            used_replicas: (0..n).collect(),
            calibrated: false,
            floors: Slo {
                ttft_ms: slo.ttft_ms / crate::calibration::SLO_FACTOR,
                itl_ms: slo.itl_ms / crate::calibration::SLO_FACTOR,
            },
            throttle: None,
        });
    }
    let key = s.fleet.key();
    let own = dir.join("calibration.json");
    let cal = if own.exists() {
        let c = Calibration::read(&own)?;
        if c.fleet != key {
            bail!(
                "{} was calibrated for another fleet; resume it with the same fleet flags or use --fresh / --sweep-dir-name",
                dir.display()
            );
        }
        c
    } else {
        let reuse = (!s.recalibrate && s.calibration.exists())
            .then(|| Calibration::read(&s.calibration).ok())
            .flatten()
            .filter(|c| c.fleet == key);
        match reuse {
            Some(c) => c,
            None => calibrate(
                &CalibrateSettings::defaults(
                    s.fleet.clone(),
                    s.calibration.clone(),
                    s.quick,
                    s.seed,
                    s.git_rev.clone(),
                    s.versions.clone(),
                ),
                bins,
                should_stop,
            )?,
        }
    };
    cal.write(&own)?;
    Setup::from_calibration(&cal).with_context(|| format!("{}", own.display()))
}

impl Setup {
    /// Everything from `cal`: SLO, capacity, replicas in use and the routing every sweep cell
    /// gets ([`Calibration::routing`]).
    pub fn from_calibration(cal: &Calibration) -> Result<Setup> {
        Ok(Setup {
            slo: cal.slo,
            capacity_tokens: cal.capacity_tokens,
            routing: Some(cal.routing()?),
            used_replicas: cal.used_replicas.clone(),
            calibrated: true,
            floors: cal.floors,
            throttle: cal.gpu_throttle_bound.clone(),
        })
    }
}

/// The router settings of `policy`'s repetition `rep`: the calibration's routing (router seed
/// `seed + rep`, as sweep cells); a belief policy without a calibration is refused.
pub fn router_settings(
    s: &FaultSettings,
    setup: &Setup,
    policy: &str,
    rep: u32,
) -> Result<RouterSettings> {
    // An envoy-epp cell (`envoy-epp-<policy>`) routes with its picker's policy.
    let policy = fleet::ingress::envoy_epp::picker_policy(policy);
    let seed = s.seed + u64::from(rep);
    match &setup.routing {
        Some(routing) => Ok(routing.router_settings(policy, &s.fleet.model, seed)),
        None if grid::uses_belief_index(policy) => bail!(
            "{policy} needs the calibrated index TTL, and the SLO was given outright with no calibration for this fleet at {}: run `cargo xtask calibrate` with the same fleet flags (--out {}) first, or drop --slo-ttft-ms/--slo-itl-ms",
            s.calibration.display(),
            s.calibration.display()
        ),
        None => Ok(RouterSettings {
            policy: policy.to_string(),
            model: s.fleet.model.clone(),
            seed,
            kv_events: grid::needs_kv_events(policy),
            ..RouterSettings::default()
        }),
    }
}

/// A fault run under way: its setup, point, plan and fleet.
pub struct FaultRun<'a> {
    settings: &'a FaultSettings,
    bins: &'a Bins,
    /// The policies faulted, in order.
    pub policies: Vec<String>,
    /// SLO, capacity and index settings.
    pub setup: Setup,
    /// The open-loop rate, requests per second of model time.
    pub rate_model_rps: f64,
    /// The point directory's name.
    pub point: String,
    dir: PathBuf,
    plan: PlanFile,
    fleet: Fleet,
}

/// One attempt at a fault repetition, before its gates: what `meta.json` records.
struct FaultAttempt {
    events: FaultEvents,
    evidence: EvidenceSummary,
    client: Vec<ClientRow>,
    router_rows: Vec<analysis::RouterRow>,
    router_settings: RouterSettings,
    driver_settings: DriverSettings,
    replicas: Vec<fleet::ReplicaInfo>,
}

impl<'a> FaultRun<'a> {
    /// Into `dir` (created): the policies, the setup (calibrating when needed), the plan, the
    /// fleet (started by the first repetition) and `sweep.json`.
    pub fn start(
        settings: &'a FaultSettings,
        bins: &'a Bins,
        dir: &Path,
        should_stop: &dyn Fn() -> bool,
    ) -> Result<FaultRun<'a>> {
        let s = settings;
        let policies = if s.policies.is_empty() {
            DEFAULT_POLICIES.iter().map(|p| p.to_string()).collect()
        } else {
            grid::policies(&s.policies, s.quick)?
        };
        s.fleet.check_policies(&policies)?;
        s.check()?;
        let policies: Vec<String> = if s.ingress == fleet::Ingress::EnvoyEpp {
            fleet::ingress::envoy_epp::check_bin(&bins.router.with_file_name("epp"))?;
            let cell = fleet::ingress::envoy_epp::cell_policy;
            policies.iter().map(|p| cell(p)).collect()
        } else {
            policies
        };
        let kv_events = policies.iter().any(|p| grid::needs_kv_events(p));
        let setup = setup(s, bins, dir, kv_events, should_stop)?;
        // Refuse a policy the setup cannot route before any fleet starts.
        for p in &policies {
            router_settings(s, &setup, p, 1)?;
        }
        let n = setup.used_replicas.len();
        if s.victim >= n {
            bail!("--victim {} is outside a fleet of {n} replicas", s.victim);
        }
        if n < 2 {
            bail!("a fault needs at least 2 replicas: the others carry the load during the outage");
        }
        let speed = s.fleet.effective_speed();
        let rate = s.model_rate(n)?;
        let point = point_name(rate);
        let plan = ensure_plan(
            &dir.join(&point),
            &WorkloadSpec {
                seed: s.seed,
                sizing: Sizing::WorkingSet {
                    capacity_tokens: setup.capacity_tokens,
                    ratio: 1.0,
                },
                zipf_s: 0.0,
                ..WorkloadSpec::default()
            },
            &ArrivalSpec::Open {
                rate_rps: rate * speed,
                duration_s: s.run_s(),
                // Not primed (`Calibration::open_start`): a fault run's timeline is its kill's,
                // fixed in the run's seconds, and the published fault runs started this way.
                start: workload::OpenStart::Stationary,
            },
        )?;
        let source = s
            .fleet
            .source(&bins.engine, kv_events, Some(&setup.used_replicas))?;
        let fleet = Fleet::new(source, s.fleet.options(&dir.join("logs").join("fleet")))?;
        cell::write_atomic(
            &dir.join("sweep.json"),
            serde_json::to_string_pretty(&serde_json::json!({
                "sweep": format!("fault-{}", s.kind.as_str()),
                "kind": s.kind,
                "quick": s.quick,
                "point": point,
                "policies": policies,
                "reps": s.reps,
                "rate_model_rps": rate,
                "speed": speed,
                "victim": s.victim,
                "warmup_s": s.warmup_s,
                "before_s": s.before_s,
                "outage_model_s": s.outage_model_s,
                "outage_wall_s": s.outage_wall_s(),
                "after_s": s.after_s,
                "evidence_bounds": rep_bounds(s, &setup),
                "evidence_retries": s.evidence_retries,
                "drift_window": analysis::fault::DRIFT_WINDOW_RULE,
                "setup": setup,
            }))?
            .as_bytes(),
        )?;
        Ok(FaultRun {
            settings,
            bins,
            policies,
            setup,
            rate_model_rps: rate,
            point,
            dir: dir.to_path_buf(),
            plan,
            fleet,
        })
    }

    /// Stops the fleet.
    pub fn stop(&mut self) {
        self.fleet.stop();
    }

    /// Stops the fleet and writes the run's summary, timeline and `summary.md` from the rows.
    pub fn finish(mut self, dir: &Path) -> Result<Summary> {
        self.fleet.stop();
        Ok(analysis::fault::write_summary(
            dir,
            &self.point,
            &DriftConfig::default(),
        )?)
    }

    /// One repetition of `policy` into `rep_dir` (`<dir>/<point>/<policy>/rep-<rep>`) until it
    /// is recorded: each attempt cycles the fleet, starts the router, probes its clock, runs the
    /// load, faults the victim mid-request, restarts it and lets the load finish; then the gates
    /// ([`Gates`]: evidence, then drift on the pre-fault window) re-run it (the attempt moved to
    /// `_discarded/`) or record it, accepted or set aside, with `fault.json` and `meta.json`
    /// (last). Returns the outcome's line.
    pub fn run_rep(
        &mut self,
        policy: &str,
        rep: u32,
        rep_dir: &Path,
        should_stop: &dyn Fn() -> bool,
    ) -> Result<String> {
        let s = self.settings;
        let mut gates = Gates::new(s.evidence_retries);
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            cell::clear(rep_dir)?;
            let mut a = self.attempt(policy, rep, rep_dir, should_stop)?;
            let window = drift_window(&a.events);
            let drift =
                analysis::check_rows(&a.client, &self.setup.slo, &window, &DriftConfig::default());
            let evidence = crate::gate::check_evidence(
                &mut a.evidence,
                &rep_bounds(s, &self.setup).evidence(),
                &a.client,
                &self.setup.slo,
                &window,
            );
            let recorded = RecordedGates::new(
                match &evidence {
                    Ok(()) => GateStatus::Passed,
                    Err(why) => GateStatus::Failed(why.clone()),
                },
                &drift,
                window,
            );
            let set_aside = match gates.judge(evidence, &drift) {
                GateDecision::Rerun { reason, note } => {
                    eprintln!("xtask fault: {policy} rep-{rep}: {note}");
                    cell::discard(&self.dir, &self.point, policy, rep, attempt, &reason)?;
                    continue;
                }
                GateDecision::Record { set_aside } => set_aside,
            };
            let outcome = analyse_rep(
                policy,
                rep,
                &a.events,
                &a.client,
                &a.router_rows,
                &self.setup.slo,
            );
            let meta = Meta {
                sweep: format!("fault-{}", s.kind.as_str()),
                point: self.point.clone(),
                policy: policy.to_string(),
                rep,
                workload_name: self.plan.workload_name.clone(),
                workload_fingerprint: self.plan.workload_fingerprint.clone(),
                plan_fingerprint: self.plan.plan_fingerprint.clone(),
                fleet: serde_json::json!({
                    "source": s.fleet.key().source,
                    "replicas": a.replicas.len(),
                    "engine": s.fleet.engine(),
                    "engine_flags": s.fleet.engine_flags(),
                    "speed": s.fleet.effective_speed(),
                    "slowdowns": a.replicas.iter().map(|r| r.slowdown).collect::<Vec<_>>(),
                    "capacity_tokens": self.setup.capacity_tokens,
                    "model": s.fleet.model,
                    "used_replicas": self.setup.used_replicas,
                }),
                slo: self.setup.slo,
                window: Window {
                    warmup_s: s.warmup_s,
                    measured_start_s: s.warmup_s,
                    measured_end_s: s.run_s(),
                    // The fault analysis cuts its windows on the send clock.
                    clock: schema::WindowClock::Sent,
                },
                git_rev: s.git_rev.clone(),
                versions: s.versions.clone(),
                virtual_time: false,
                complete: true,
                accepted: set_aside.is_none(),
                set_aside_reason: set_aside.clone(),
                attempts: attempt,
                evidence: Some(a.evidence.clone().into()),
                drift: Some(drift.clone()),
                run: serde_json::from_value(serde_json::json!({
                    "plan": self.plan.name,
                    "ingress": s.ingress,
                    "router": a.router_settings,
                    "driver": a.driver_settings,
                    "fault": a.events,
                    "calibrated": self.setup.calibrated,
                    "requests": a.client.len(),
                    "gates": recorded,
                }))?,
            };
            if should_stop() {
                bail!("interrupted before the repetition was recorded");
            }
            cell::write_meta(rep_dir, &meta)?;
            let line = outcome.one_line();
            return Ok(match set_aside {
                None if attempt > 1 => format!("{line} (attempt {attempt})"),
                None => line,
                Some(why) => format!("set aside: {why}; {line}"),
            });
        }
    }

    /// One attempt at a repetition into `rep_dir` (empty, created), through `fault.json`.
    fn attempt(
        &mut self,
        policy: &str,
        rep: u32,
        rep_dir: &Path,
        should_stop: &dyn Fn() -> bool,
    ) -> Result<FaultAttempt> {
        let s = self.settings;
        let fleet = &mut self.fleet;
        let victim = s.victim;
        let victim_id = victim as u32;
        fleet.cycle(should_stop)?;
        let victim_info = fleet
            .replicas()
            .get(victim)
            .cloned()
            .ok_or_else(|| anyhow!("no replica {victim} in the fleet"))?;
        let router_settings = router_settings(s, &self.setup, policy, rep)?;
        let (mut router, url, admin_url) = match s.ingress {
            fleet::Ingress::EnvoyEpp => fleet::ingress::envoy_epp::start_envoy_epp(
                &self.bins.router.with_file_name("epp"),
                fleet,
                &router_settings,
                &rep_dir.join("router.csv"),
                &rep_dir.join("epp.log"),
                rep_dir,
                should_stop,
            )?,
            _ => fleet::ingress::start_router(
                &self.bins.router,
                fleet,
                &router_settings,
                &rep_dir.join("router.csv"),
                &rep_dir.join("router.log"),
                should_stop,
            )?,
        };
        let t0 = Instant::now();
        // The probe with the shortest round trip pins the router clock tightest.
        let mut probes = Vec::new();
        for i in 0..5 {
            let id = format!("{PROBE_PREFIX}{i}");
            probes.push(clock_probe(&url, &id, t0)?);
        }
        let driver_settings = DriverSettings {
            mode: "open",
            warmup_s: s.warmup_s,
            duration_s: Some(s.run_s()),
            timeout_s: s.request_timeout_s,
            model: s.fleet.model.clone(),
            // The fault timeline follows every request to its end.
            abandon_after_ms: None,
            // Through the router or HAProxy, which keep connections alive.
            keep_alive: true,
        };
        let client_csv = rep_dir.join("client.csv");
        let mut driver = fleet::start_driver(
            &self.bins.driver,
            &url,
            &self.plan.path,
            &client_csv,
            &driver_settings,
            &rep_dir.join("driver.log"),
        )?;
        let spawned = t0.elapsed().as_secs_f64();
        let evidence_path = rep_dir.join("evidence.jsonl");
        let evidence_cfg = EvidenceConfig {
            lateness_urls: fleet.urls(),
            fleet_process_groups: fleet.process_groups(),
            // The restarted replica is a new process group mid-run; it is ours, not a foreigner.
            check_foreign: false,
            gpu: true,
            interval: Duration::from_secs_f64(s.evidence_interval_s.max(0.05)),
            fleet_gpus: fleet.gpus(),
        };
        let mut sampler: Option<EvidenceSampler> = None;
        let warm_at = spawned + s.warmup_s;
        let mut tick = |now: f64| -> Result<()> {
            if sampler.is_none() && now >= warm_at {
                sampler = Some(EvidenceSampler::start(
                    evidence_cfg.clone(),
                    &evidence_path,
                )?);
            }
            Ok(())
        };
        let outage = s.outage_wall_s();
        let mut waiter = Waiter {
            t0,
            driver: &mut driver,
            fleet: &mut *fleet,
            should_stop,
        };
        waiter.until(spawned + s.warmup_s + s.before_s, &mut tick)?;

        // Fault mid-request: wait (briefly) for the router to count work on the victim, so that a
        // kill has something to lose and a drain something to finish.
        let wait_from = t0.elapsed().as_secs_f64();
        let outstanding = loop {
            let r = admin_replica(&admin_url, victim_id)?;
            let now = t0.elapsed().as_secs_f64();
            if r.outstanding > 0 || now - wait_from >= s.inflight_wait_s {
                break r.outstanding;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        let waited = t0.elapsed().as_secs_f64() - wait_from;
        if outstanding == 0 {
            eprintln!(
                "xtask fault: replica {victim} had nothing in flight for {:.1} s; faulting it anyway",
                s.inflight_wait_s
            );
        }
        let outstanding_at_fault = Some(outstanding);
        let (fault_s, drained_s, down_s) = match s.kind {
            FaultKind::Kill => {
                let fault_s = t0.elapsed().as_secs_f64();
                waiter.fleet.kill_one(victim)?;
                (fault_s, None, t0.elapsed().as_secs_f64())
            }
            FaultKind::Drain => {
                let answer = admin_post(&admin_url, victim_id, "drain")?;
                // The drain is in force once the router has answered; a request arriving before
                // that may still be routed to the victim (and is then one to finish, not to lose).
                let fault_s = t0.elapsed().as_secs_f64();
                if !answer.draining {
                    bail!("the router did not mark replica {victim} draining");
                }
                let limit = fault_s + s.request_timeout_s + 10.0;
                let drained_s = loop {
                    let r = admin_replica(&admin_url, victim_id)?;
                    let now = t0.elapsed().as_secs_f64();
                    if r.outstanding == 0 {
                        break now;
                    }
                    if now > limit {
                        bail!(
                            "replica {victim} still had {} requests outstanding {:.0} s after the drain",
                            r.outstanding,
                            now - fault_s
                        );
                    }
                    if let Some(status) = waiter.driver.try_wait()? {
                        bail!("the driver exited ({status}) during the drain");
                    }
                    std::thread::sleep(Duration::from_millis(2));
                };
                stop_gracefully(waiter.fleet, victim, &victim_info)?;
                (fault_s, Some(drained_s), t0.elapsed().as_secs_f64())
            }
        };
        waiter.until(down_s + outage, &mut tick)?;
        let restart_s = t0.elapsed().as_secs_f64();
        waiter.fleet.restart_one(victim, should_stop)?;
        let up_s = t0.elapsed().as_secs_f64();
        let undrain_s = match s.kind {
            FaultKind::Drain => {
                admin_post(&admin_url, victim_id, "undrain")?;
                Some(t0.elapsed().as_secs_f64())
            }
            FaultKind::Kill => None,
        };
        let limit = spawned + s.run_s() * 2.0 + s.request_timeout_s + 30.0;
        loop {
            if should_stop() {
                bail!("interrupted");
            }
            if let Some(status) = waiter.driver.try_wait()? {
                if !status.success() {
                    bail!(
                        "the driver failed ({status}); see its log {}",
                        waiter.driver.log_path().display()
                    );
                }
                break;
            }
            waiter.fleet.check_alive()?;
            let now = t0.elapsed().as_secs_f64();
            tick(now)?;
            if now > limit {
                bail!(
                    "the driver did not finish in time; see its log {}",
                    waiter.driver.log_path().display()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let sampler = match sampler {
            Some(s) => s,
            None => EvidenceSampler::start(evidence_cfg, &evidence_path)?,
        };
        let evidence = sampler.finish()?;
        if router.terminate(Duration::from_secs(15)).is_none() {
            eprintln!(
                "xtask: the router did not exit on SIGTERM within 15 s and was killed; its rows may be cut (log {})",
                router.log_path().display()
            );
        }
        drop(driver);

        let client = analysis::read_client_csv(&client_csv).map_err(|e| anyhow!("{e}"))?;
        let router_rows =
            analysis::read_router_csv(&rep_dir.join("router.csv")).map_err(|e| anyhow!("{e}"))?;
        let (router_minus_xtask_s, clock_uncertainty_s) = probe_offset(&probes, &router_rows)
            .ok_or_else(|| {
                anyhow!("router.csv has no row for any clock probe ({PROBE_PREFIX}*), so the fault cannot be placed on its clock")
            })?;
        let router_minus_driver_s =
            router_minus_driver(&client, &router_rows).ok_or_else(|| {
                anyhow!("no request appears in both the driver's and the router's rows")
            })?;
        let replicas = fleet.replicas();
        let events = FaultEvents {
            kind: s.kind,
            victim: victim_id,
            victim_url: victim_info.url.clone(),
            replicas: replicas.len(),
            router_minus_xtask_s,
            clock_uncertainty_s,
            router_minus_driver_s,
            xtask: Instants {
                fault_s,
                drained_s,
                down_s,
                restart_s,
                up_s,
                undrain_s,
            },
            outstanding_at_fault,
            waited_for_inflight_s: waited,
            run_end_s: s.run_s(),
            warmup_s: s.warmup_s,
        };
        cell::write_atomic(
            &rep_dir.join("fault.json"),
            serde_json::to_string_pretty(&events)?.as_bytes(),
        )?;
        Ok(FaultAttempt {
            events,
            evidence,
            client,
            router_rows,
            router_settings,
            driver_settings,
            replicas,
        })
    }
}

/// The router's view of one replica (`GET /admin/replicas`).
#[derive(Debug, Clone, Deserialize)]
struct AdminReplica {
    id: u32,
    outstanding: u32,
    #[serde(default)]
    draining: bool,
}

fn admin_replica(router: &str, id: u32) -> Result<AdminReplica> {
    let r = http::get(
        &http::join(router, "/admin/replicas"),
        Duration::from_secs(5),
    )?;
    if r.status != 200 {
        bail!("GET /admin/replicas answered {}: {}", r.status, r.text());
    }
    let list: Vec<AdminReplica> =
        serde_json::from_slice(&r.body).context("parsing GET /admin/replicas")?;
    list.into_iter()
        .find(|x| x.id == id)
        .ok_or_else(|| anyhow!("the router lists no replica {id}"))
}

fn admin_post(router: &str, id: u32, action: &str) -> Result<AdminReplica> {
    let url = http::join(router, &format!("/admin/replicas/{id}/{action}"));
    let r = http::post(&url, None, Duration::from_secs(5))?;
    if r.status != 200 {
        bail!("POST {url} answered {}: {}", r.status, r.text());
    }
    serde_json::from_slice(&r.body).with_context(|| format!("parsing the answer to POST {url}"))
}

/// One clock probe: a request the router answers 400 before routing, timed on `t0`'s clock
/// (seconds since `t0`).
fn clock_probe(router: &str, id: &str, t0: Instant) -> Result<ClockProbe> {
    let (authority, _) = http::split_url(router)?;
    let mut stream =
        TcpStream::connect(&authority).with_context(|| format!("connecting to {router}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.set_nodelay(true)?;
    // One write, so the router's arrival stamp falls between the two readings.
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\nContent-Type: application/json\r\nx-request-id: {id}\r\nContent-Length: 1\r\n\r\n{{"
    );
    let sent = t0.elapsed().as_secs_f64();
    stream.write_all(req.as_bytes())?;
    let mut first = [0u8; 12];
    stream.read_exact(&mut first)?;
    let answered = t0.elapsed().as_secs_f64();
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest);
    let status = String::from_utf8_lossy(&first[9..12]).into_owned();
    if status != "400" {
        bail!("the clock probe expected 400 from the router, got `{status}`");
    }
    Ok(ClockProbe {
        request_id: id.to_string(),
        sent_s: sent,
        answered_s: answered,
    })
}

/// What a repetition waits on while the load runs: the driver and the fleet, on `t0`'s clock.
struct Waiter<'w> {
    t0: Instant,
    driver: &'w mut fleet::ChildGuard,
    fleet: &'w mut Fleet,
    should_stop: &'w dyn Fn() -> bool,
}

impl Waiter<'_> {
    /// Sleeps until `deadline` (s since `t0`) while the driver runs; fails when the driver exits
    /// first, a replica other than a downed one dies, or on an interrupt.
    fn until(&mut self, deadline: f64, tick: &mut dyn FnMut(f64) -> Result<()>) -> Result<()> {
        loop {
            if (self.should_stop)() {
                bail!("interrupted");
            }
            if let Some(status) = self.driver.try_wait()? {
                bail!(
                    "the driver exited ({status}) before the fault was over; see its log {}",
                    self.driver.log_path().display()
                );
            }
            self.fleet.check_alive()?;
            let now = self.t0.elapsed().as_secs_f64();
            tick(now)?;
            if now >= deadline {
                return Ok(());
            }
            std::thread::sleep(Duration::from_secs_f64((deadline - now).min(0.02)));
        }
    }
}

/// SIGTERM to a drained replica, wait until it stops answering, then reap it.
fn stop_gracefully(fleet: &mut Fleet, index: usize, info: &fleet::ReplicaInfo) -> Result<()> {
    if let Some(pid) = info.pid {
        fleet::process::signal_group(pid, libc::SIGTERM);
        let health = http::join(&info.url, "/health");
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && http::get(&health, Duration::from_millis(200)).is_ok() {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    // Reaps it (and SIGKILLs it if the grace ran out).
    fleet.kill_one(index).map_err(anyhow::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> FaultSettings {
        let (warmup_s, before_s, after_s) = default_phases_s(true);
        FaultSettings {
            kind: FaultKind::Kill,
            quick: true,
            reps: 1,
            policies: vec![],
            rate_model_rps: None,
            victim: 0,
            warmup_s,
            before_s,
            outage_model_s: 60.0,
            after_s,
            inflight_wait_s: 10.0,
            calibration: PathBuf::from("c.json"),
            recalibrate: false,
            slo: None,
            request_timeout_s: 60.0,
            evidence_interval_s: 1.0,
            lateness_share_of_itl_floor: crate::calibration::LATENESS_SHARE_OF_ITL_FLOOR,
            evidence_retries: 2,
            seed: 7,
            fleet: FleetSpec::test_emulated(),
            git_rev: None,
            versions: serde_json::Value::Null,
            ingress: fleet::Ingress::Router,
        }
    }

    #[test]
    fn the_phases_and_the_rate_follow_the_settings() {
        let s = settings();
        s.check().unwrap();
        // 3 s warm-up + 10 s before + 60 s ÷ 6 outage + 20 s after.
        assert_eq!(s.outage_wall_s(), 10.0);
        assert_eq!(s.run_s(), 43.0);
        assert_eq!(s.model_rate(3).unwrap(), 2.4);
        assert_eq!(point_name(2.4), "ws1-s0-rate2.4");
        let given = FaultSettings {
            rate_model_rps: Some(1.23456),
            ..settings()
        };
        assert_eq!(given.model_rate(3).unwrap(), 1.235);
    }

    #[test]
    fn settings_a_fault_cannot_run_with_are_refused() {
        let refused = |s: FaultSettings| s.check().unwrap_err().to_string();
        assert!(
            refused(FaultSettings {
                reps: 0,
                ..settings()
            })
            .contains("--reps")
        );
        assert!(
            refused(FaultSettings {
                after_s: 0.0,
                ..settings()
            })
            .contains("--after-s")
        );
        assert!(
            refused(FaultSettings {
                outage_model_s: 3.0,
                ..settings()
            })
            .contains("at least 1 s")
        );
        let mut static_fleet = settings();
        static_fleet.fleet.kind = FleetKind::Static;
        assert!(refused(static_fleet).contains("--fleet emulated"));
        let bad_slo = FaultSettings {
            slo: Some(Slo {
                ttft_ms: 0.0,
                itl_ms: 1.0,
            }),
            ..settings()
        };
        assert!(refused(bad_slo).contains("--slo-ttft-ms"));
        let through = |ingress| FaultSettings {
            ingress,
            ..settings()
        };
        through(fleet::Ingress::EnvoyEpp).check().unwrap();
        assert!(refused(through(fleet::Ingress::Haproxy)).contains("no admin API"));
        let two =
            fleet::Ingress::with_routers(fleet::Ingress::Router, 2, None, false, false).unwrap();
        assert!(refused(through(two)).contains("N routers"));
        let bad_rate = FaultSettings {
            rate_model_rps: Some(-1.0),
            ..settings()
        };
        assert!(bad_rate.model_rate(3).is_err());
    }
}
