//! The virtual sweep's pieces, which `cargo xtask sweep <name> --virtual` drives: the simulated
//! fleet, the virtual calibration in the live record's shape, the preparation of a sweep
//! directory (calibration, `sweep.json`, one job per unfinished repetition) and one repetition
//! simulated through `sim`, drift-checked and recorded. The points, policies and plans are the
//! live sweep's ([`SweepSettings::sweep_points`], [`grid::policies`],
//! [`SweepSettings::plan_for`]), so each `plan.bin` is byte-identical to what a live sweep of the
//! same settings writes.
//!
//! The simulated fleet is the emulated fleet the live flags describe (replicas, blocks, speed,
//! slowdowns), so a plan's wall-scaled think times and rates mean the same thing. The SLO comes
//! from `sim::calibrate` (3× the virtual floors). Every repetition gets its own policy and engine
//! seed and a small step-time jitter, so repetitions differ the way live ones do, while the same
//! seed still gives byte-identical rows. Each repetition's rows pass the live drift check before
//! its `meta.json` (`"virtual": true`) is written; a drifting repetition is set aside at once,
//! since re-running a deterministic cell would only repeat it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, anyhow, bail};

use fleet::Ingress;
use schema::Slo;
use workload::{Plan, WorkloadSpec};

use crate::calibration::{Calibration, FleetKey, IndexCalibration, SLO_FACTOR};
use crate::cell::{self, CellState};
use crate::fleet_spec::{FleetKind, FleetSpec};
use crate::grid::{self, Point};
use crate::sweep::SweepSettings;

/// Step-time jitter of every virtual engine: enough that repetitions differ.
pub const JITTER: f64 = 0.02;

/// Unseen single-turn prompts the virtual calibration measures.
const CALIBRATION_REQUESTS: u32 = 64;

/// A replica whose slowdown exceeds the fleet's median by this factor is left out, as the live
/// calibration leaves out a throttling outlier (its floors scale with the slowdown).
const OUTLIER_FACTOR: f64 = 1.3;

/// The emulated fleet a virtual sweep simulates (what the live `--fleet emulated` flags describe).
#[derive(Debug, Clone, PartialEq)]
pub struct EmulatedFleet {
    /// Replicas as given (before exclusions).
    pub replicas: usize,
    /// KV blocks per replica.
    pub num_gpu_blocks: u32,
    /// Emulator speed-up: every modelled duration is divided by it.
    pub speed: f64,
    /// Slowdown per replica as given; a missing factor is 1.
    pub slowdowns: Vec<f64>,
    /// Model name (served by the replicas; the router's salt).
    pub model: String,
}

impl EmulatedFleet {
    /// The emulated fleet `spec` describes.
    pub fn of(spec: &FleetSpec) -> Result<EmulatedFleet> {
        let blocks = u32::try_from(spec.num_gpu_blocks)
            .map_err(|_| anyhow!("--num-gpu-blocks {} is too large", spec.num_gpu_blocks))?;
        Ok(EmulatedFleet {
            replicas: spec.replica_count(),
            num_gpu_blocks: blocks,
            speed: spec.speed,
            slowdowns: spec.slowdowns.clone(),
            model: spec.model.clone(),
        })
    }

    fn slowdown(&self, i: usize) -> f64 {
        self.slowdowns.get(i).copied().unwrap_or(1.0)
    }

    /// Replicas in use: all but those slowed beyond `OUTLIER_FACTOR` × the median slowdown.
    pub fn used_replicas(&self) -> Vec<usize> {
        let slow: Vec<f64> = (0..self.replicas).map(|i| self.slowdown(i)).collect();
        let median = analysis::stats::median(&slow).unwrap_or(1.0);
        let used: Vec<usize> = (0..self.replicas)
            .filter(|&i| slow[i] <= median * OUTLIER_FACTOR)
            .collect();
        if used.is_empty() {
            (0..self.replicas).collect()
        } else {
            used
        }
    }

    /// The simulated fleet's base config (no policy yet), keeping only the replicas in `used`.
    pub fn base_config(&self, used: &[usize]) -> Result<sim::SimConfig> {
        let mut cfg = sim::SimConfig::new(used.len() as u32, "round-robin");
        cfg.engine.num_gpu_blocks = self.num_gpu_blocks;
        cfg.engine.model.speed = self.speed;
        cfg.engine.model.jitter = JITTER;
        cfg.slowdowns = used.iter().map(|&i| self.slowdown(i)).collect();
        cfg.model = self.model.clone();
        cfg.validate().map_err(|e| anyhow!("{e}"))?;
        Ok(cfg)
    }
}

/// The virtual calibration in the live calibration's shape, so the live plan builder reads it:
/// floors from `sim::calibrate` on `base` with prompts shaped by the workload seeded `seed`, and
/// `fleet` recorded with source `virtual`. No virtual reference run: belief policies keep the
/// policies crate's default TTL and node cap (recorded per cell in `meta.run`).
pub fn calibrate(
    base: &sim::SimConfig,
    seed: u64,
    used: Vec<usize>,
    mut fleet: FleetKey,
    git_rev: Option<String>,
    versions: serde_json::Value,
) -> Result<Calibration> {
    let shape = WorkloadSpec {
        seed,
        ..WorkloadSpec::default()
    };
    let c = sim::calibrate(base, &shape, CALIBRATION_REQUESTS)
        .map_err(|e| anyhow!("virtual calibration: {e}"))?;
    let floors = Slo {
        ttft_ms: c.ttft_p50_ms,
        itl_ms: c.itl_p50_ms,
    };
    fleet.source = "virtual".into();
    Ok(Calibration {
        fleet,
        replicas: Vec::new(),
        used_replicas: used,
        floors,
        slo_factor: SLO_FACTOR,
        // Not rounded as the live rule (`calibration::slo_from_floors`) rounds: virtual sweeps
        // keep recording the SLO they always have.
        slo: Slo {
            ttft_ms: floors.ttft_ms * SLO_FACTOR,
            itl_ms: floors.itl_ms * SLO_FACTOR,
        },
        capacity_tokens: c.capacity_tokens,
        index: IndexCalibration {
            ttl_s: None,
            ttl_is_lower_bound: false,
            node_cap: None,
            honoured_share: None,
            detail: serde_json::json!({"source": "virtual: policy defaults"}),
        },
        gpus: Vec::new(),
        gpu_status: "virtual".into(),
        reference_run: None,
        git_rev,
        versions,
    })
}

/// What every repetition of a virtual sweep shares.
#[derive(Debug, Clone)]
pub struct CellSettings {
    /// The simulated fleet (`EmulatedFleet::base_config`); each cell sets its policy and seeds.
    pub base: sim::SimConfig,
    /// Sweep name, as `meta.json` records it.
    pub sweep: String,
    /// Router seed; repetition k runs with `seed + k`, as the live router gets `--seed seed + k`.
    pub seed: u64,
    /// Base seed of the engines; repetition k gets its own from it.
    pub engine_seed: u64,
    /// Discarded warm-up, s.
    pub warmup_s: f64,
    /// Warm-up + measured window, s (the driver's `--duration-s`).
    pub run_s: f64,
    /// Per-request timeout, s.
    pub timeout_s: f64,
    /// The SLO of the drift check and of `meta.json`.
    pub slo: Slo,
    /// Git revision.
    pub git_rev: Option<String>,
    /// Tool versions.
    pub versions: serde_json::Value,
}

/// What a point's cells replay.
#[derive(Debug, Clone)]
pub enum Work {
    /// A workload plan.
    Plan {
        /// The point's plan, shared by its cells.
        plan: Arc<Plan>,
        /// The plan's prompts, computed once per point.
        book: Arc<sim::PromptBook>,
    },
    /// A trace replay (`crate::trace_sweep`).
    Trace {
        /// The replay, shared by the point's cells.
        plan: Arc<trace::ReplayPlan>,
        /// The engines' `max_model_len` it needs, when more than their default.
        max_model_len: Option<u32>,
    },
}

/// One repetition to simulate.
#[derive(Debug, Clone)]
pub struct Job {
    /// Point name.
    pub point: String,
    /// Policy name.
    pub policy: String,
    /// Repetition number (1-based).
    pub rep: u32,
    /// What it replays.
    pub work: Work,
    /// The repetition directory (`<sweep>/<point>/<policy>/rep-<k>`).
    pub dir: PathBuf,
    /// Run settings recorded under `meta.run`.
    pub run: serde_json::Value,
}

/// Simulates one repetition into `job.dir` (cleared first), checks drift on its rows, writes
/// `meta.json` last. Returns whether the repetition was accepted.
pub fn run_cell(s: &CellSettings, job: &Job) -> Result<bool> {
    let mut cfg = s.base.clone();
    cfg.policy = policies::PolicySpec::named(&job.policy);
    cfg.policy.seed = s.seed.wrapping_add(u64::from(job.rep));
    cfg.engine.seed = s
        .engine_seed
        .wrapping_mul(1_000_003)
        .wrapping_add(u64::from(job.rep));
    cfg.driver = sim::DriverModel {
        warmup_s: s.warmup_s,
        duration_s: Some(s.run_s),
        timeout_s: s.timeout_s,
    };
    cell::clear(&job.dir)?;
    let meta = sim::CellMeta {
        sweep: s.sweep.clone(),
        point: job.point.clone(),
        rep: job.rep,
        slo: s.slo,
        planned_end_s: Some(s.run_s),
        git_rev: s.git_rev.clone(),
        versions: s.versions.clone(),
        run: job.run.clone(),
    };
    let written = match &job.work {
        Work::Plan { plan, book } => sim::write_cell_rows(&cfg, plan, book, &job.dir, &meta),
        Work::Trace {
            plan,
            max_model_len,
        } => {
            if let Some(n) = *max_model_len {
                cfg.engine.max_model_len = cfg.engine.max_model_len.max(n);
            }
            sim::write_trace_cell_rows(&cfg, plan, &job.dir, &meta)
        }
    };
    let (summary, mut meta_json) = written.map_err(|e| anyhow!("{e}"))?;
    let drift = analysis::check_rep_dir(
        &job.dir,
        &s.slo,
        &summary.window,
        &analysis::DriftConfig::default(),
    )
    .map_err(|e| anyhow!("drift check of {}: {e}", job.dir.display()))?;
    let accepted = !drift.warming;
    meta_json["accepted"] = serde_json::Value::Bool(accepted);
    meta_json["set_aside_reason"] = if accepted {
        serde_json::Value::Null
    } else {
        let why = drift.reason.clone().unwrap_or_else(|| "warming".into());
        serde_json::Value::String(format!(
            "drifted (virtual, deterministic: not re-run): {why}"
        ))
    };
    meta_json["drift"] = serde_json::to_value(&drift)?;
    sim::write_meta(&job.dir, &meta_json).map_err(|e| anyhow!("{e}"))?;
    Ok(accepted)
}

/// Refuses settings the simulator cannot model (before anything is written).
pub fn check(s: &SweepSettings) -> Result<()> {
    if !matches!(s.fleet.kind, FleetKind::Emulated) {
        bail!(
            "--virtual simulates the emulated fleet its flags describe; --fleet command/static cannot be simulated"
        );
    }
    if !matches!(s.ingress, Ingress::Router) {
        bail!("--virtual models kvroute's router only; HAProxy ingress is live-only");
    }
    if s.reps == 0 {
        bail!("--reps must be at least 1");
    }
    Ok(())
}

/// A virtual sweep ready to run: what it runs under and the repetitions left to simulate.
pub struct Prepared {
    /// The virtual calibration (also in `<dir>/calibration.json`).
    pub calibration: Calibration,
    /// The points, in order.
    pub points: Vec<Point>,
    /// The policies compared.
    pub policies: Vec<String>,
    /// The repetitions not yet done, in the live sweep's order.
    pub jobs: Vec<Job>,
    /// Repetitions already done (skipped on a resume).
    pub skipped: usize,
    /// What every repetition shares.
    pub cells: CellSettings,
}

/// Prepares `dir` (created): the simulated fleet, its calibration, `sweep.json`, each point's
/// plan and prompts, and a job for every repetition not yet done.
pub fn prepare(s: &SweepSettings, dir: &Path) -> Result<Prepared> {
    let n = s.fleet.replica_count();
    if n == 0 {
        bail!("the fleet has no replicas");
    }
    if !s.fleet.slowdowns.is_empty() && s.fleet.slowdowns.len() != n {
        bail!(
            "--slowdowns gives {} factors for {n} replicas",
            s.fleet.slowdowns.len()
        );
    }
    let fleet = EmulatedFleet::of(&s.fleet)?;
    let used = fleet.used_replicas();
    let base = fleet.base_config(&used)?;
    let cal = calibrate(
        &base,
        s.seed,
        used,
        s.fleet.key(),
        s.git_rev.clone(),
        s.versions.clone(),
    )?;
    cal.write(&dir.join("calibration.json"))?;
    let policies = grid::policies(&s.policies, s.quick)?;
    let points = s.sweep_points(cal.used_replicas.len())?;
    cell::write_atomic(
        &dir.join("sweep.json"),
        serde_json::to_string_pretty(&serde_json::json!({
            "sweep": s.name.as_str(),
            "virtual": true,
            "quick": s.quick,
            "points": points,
            "policies": policies,
            "reps": s.reps,
            "warmup_s": s.warmup_s,
            "measure_s": s.measure_s,
            "think_model_s": s.think_model_s,
            "speed": s.fleet.speed,
            "jitter": JITTER,
            "calibration": cal,
            "trace": s.trace,
        }))?
        .as_bytes(),
    )?;
    let mut jobs = Vec::new();
    let mut skipped = 0usize;
    for point in &points {
        let plan_file = s.plan_for(point, &cal, dir)?;
        let work = if crate::trace_sweep::settings_of(s)?.is_some() {
            let (plan, _) = crate::trace_sweep::replay_plan(s)?;
            let max_model_len = crate::trace_sweep::max_model_len(&plan);
            Work::Trace {
                plan: Arc::new(plan),
                max_model_len,
            }
        } else {
            let bytes = std::fs::read(&plan_file.path)
                .with_context(|| format!("reading {}", plan_file.path.display()))?;
            let plan = Arc::new(Plan::from_bytes(&bytes).map_err(|e| anyhow!("{e}"))?);
            let book = Arc::new(
                sim::PromptBook::new(&plan, &base.model, base.router.block_bytes, true)
                    .map_err(|e| anyhow!("prompts of {}: {e}", point.name))?,
            );
            Work::Plan { plan, book }
        };
        for rep in 1..=s.reps {
            for policy in &policies {
                let rep_dir = cell::rep_dir(dir, &point.name, policy, rep);
                if CellState::of(&rep_dir).is_done() {
                    skipped += 1;
                    continue;
                }
                jobs.push(Job {
                    point: point.name.clone(),
                    policy: policy.clone(),
                    rep,
                    work: work.clone(),
                    dir: rep_dir,
                    run: serde_json::json!({
                        "plan": plan_file.name,
                        "think_model_s": s.think_model_s,
                        "arrival": point.arrival,
                        "trace": crate::trace_sweep::meta_of(&plan_file),
                    }),
                });
            }
        }
    }
    let cells = CellSettings {
        base,
        sweep: s.name.as_str().to_string(),
        seed: s.seed,
        engine_seed: s.fleet.engine_seed,
        warmup_s: s.warmup_s,
        run_s: s.run_s(),
        timeout_s: s.request_timeout_s,
        slo: cal.slo,
        git_rev: s.git_rev.clone(),
        versions: s.versions.clone(),
    };
    Ok(Prepared {
        calibration: cal,
        points,
        policies,
        jobs,
        skipped,
        cells,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use workload::{ArrivalSpec, Sizing};

    use crate::scratch::Scratch;

    fn fleet(replicas: usize, slowdowns: &[f64]) -> EmulatedFleet {
        EmulatedFleet {
            replicas,
            num_gpu_blocks: 1024,
            speed: 6.0,
            slowdowns: slowdowns.to_vec(),
            model: sim::DEFAULT_MODEL.into(),
        }
    }

    #[test]
    fn outlier_replicas_are_left_out() {
        assert_eq!(fleet(4, &[1.0, 1.0, 1.0, 1.5]).used_replicas(), [0, 1, 2]);
        assert_eq!(fleet(3, &[]).used_replicas(), [0, 1, 2]);
        let base = fleet(4, &[1.0, 1.2, 1.0, 1.5])
            .base_config(&[0, 1, 2])
            .unwrap();
        assert_eq!(base.slowdowns, [1.0, 1.2, 1.0]);
        assert_eq!(base.engine.num_gpu_blocks, 1024);
        assert_eq!(base.engine.model.jitter, JITTER);
    }

    /// A tiny cell, run twice with one seed and once with the next repetition's: the same bytes,
    /// then other bytes; the live layout, with `"virtual": true` and a drift verdict.
    #[test]
    fn a_cell_is_deterministic_and_recorded_in_the_live_layout() {
        let s = Scratch::new("virtual-cell");
        let f = fleet(2, &[]);
        let used = f.used_replicas();
        let base = f.base_config(&used).unwrap();
        let key = FleetKey {
            source: "emulated".into(),
            replicas: 2,
            speed: f.speed,
            slowdowns: vec![1.0, 1.0],
            num_gpu_blocks: Some(1024),
            model: f.model.clone(),
            detail: None,
        };
        let cal = calibrate(&base, 7, used, key, None, serde_json::Value::Null).unwrap();
        assert_eq!(cal.fleet.source, "virtual");
        assert_eq!(cal.slo.ttft_ms, cal.floors.ttft_ms * SLO_FACTOR);
        let (warmup_s, run_s) = (2.0, 8.0);
        let spec = WorkloadSpec {
            seed: 7,
            sizing: Sizing::WorkingSet {
                capacity_tokens: cal.capacity_tokens,
                ratio: 1.0,
            },
            ..WorkloadSpec::default()
        };
        let think_wall_s = 1.0 / f.speed;
        let arrival = ArrivalSpec::Closed {
            users: 8,
            think_mean_s: think_wall_s,
            requests_per_user: crate::calibration::requests_per_user(
                run_s,
                think_wall_s,
                cal.floors,
                spec.output_tokens,
            ),
        };
        let plan = Arc::new(Plan::build(&spec, &arrival).unwrap());
        let book = Arc::new(
            sim::PromptBook::new(&plan, &base.model, base.router.block_bytes, true).unwrap(),
        );
        let settings = CellSettings {
            base,
            sweep: "pressure-grid".into(),
            seed: 7,
            engine_seed: 1,
            warmup_s,
            run_s,
            timeout_s: 60.0,
            slo: cal.slo,
            git_rev: None,
            versions: serde_json::Value::Null,
        };
        let job = |dir: &str, rep: u32| Job {
            point: "ws1-s0".into(),
            policy: "prefix-affinity".into(),
            rep,
            work: Work::Plan {
                plan: plan.clone(),
                book: book.clone(),
            },
            dir: s.0.join(dir),
            run: serde_json::json!({"plan": plan.name()}),
        };
        let rows = |dir: &str| std::fs::read(s.0.join(dir).join("client.csv")).unwrap();
        run_cell(&settings, &job("a", 1)).unwrap();
        run_cell(&settings, &job("b", 1)).unwrap();
        run_cell(&settings, &job("c", 2)).unwrap();
        assert_eq!(rows("a"), rows("b"), "one seed, one set of rows");
        assert_ne!(rows("a"), rows("c"), "another repetition, other rows");
        let meta: serde_json::Value =
            serde_json::from_slice(&std::fs::read(s.0.join("a/meta.json")).unwrap()).unwrap();
        assert_eq!(meta["virtual"], true);
        assert_eq!(meta["complete"], true);
        assert_eq!(meta["policy"], "prefix-affinity");
        assert!(meta["accepted"].is_boolean());
        assert!(meta["drift"]["warming"].is_boolean());
        assert!(cell::CellState::of(&s.0.join("a")).is_done());
    }
}
