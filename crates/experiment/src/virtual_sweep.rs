//! The virtual sweep's pieces, which `cargo xtask sweep <name> --virtual` drives: the simulated
//! fleet, the virtual calibration in the live record's shape, the preparation of a sweep
//! directory (calibration, `sweep.json`, one job per unfinished repetition) and one repetition
//! simulated through `sim`, drift-checked and recorded. The points, policies and plans are the
//! live sweep's ([`SweepSettings::sweep_points`], [`grid::policies`],
//! [`SweepSettings::plan_for`]), so each `plan.bin` is byte-identical to what a live sweep of the
//! same settings writes — given the same calibration: a `--load` sweep's rates are fractions of
//! the capacity, and the virtual sweep finds the simulated fleet's own ([`find_capacity`]).
//!
//! The simulated fleet is the emulated fleet the live flags describe (replicas, blocks, speed,
//! slowdowns), so a plan's wall-scaled think times and rates mean the same thing. The virtual
//! calibration follows the live rules on simulated measurements: floors on unseen prompts of
//! exactly the reference length (the engine's tokenizer counts them), SLO = 3× the floors, bytes
//! per token on the reference plan, and a simulated reference run whose belief decay (else the
//! LRU-cycle model) sets the index TTL; every cell takes TTL, node cap and bytes per token from
//! [`Calibration::routing`], as live cells do. Every repetition gets its own policy and engine
//! seed and nothing else: the simulated engines run without step-time jitter, since no measured
//! noise model stands behind one, so the same seed gives byte-identical rows and repetitions
//! differ only where a seed decides (a policy's tie-breaks). The report calls their differences
//! *deterministic (virtual)* and draws no spread verdict from them (`analysis::compare::Basis`).
//! Each repetition's rows pass the live drift check before its `meta.json` (`"virtual": true`) is
//! written; a warming repetition is set aside at once (an overloaded one is accepted, marked by
//! its verdict, as live), since re-running a deterministic cell
//! would only repeat it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, anyhow, bail};

use fleet::Ingress;
use schema::Slo;
use workload::{ArrivalSpec, Message, Plan, WorkloadSpec};

use crate::calibration::{
    self, Calibration, FleetKey, REFERENCE_PROMPT_TOKENS, Routing, SLO_FACTOR,
};
use crate::capacity::{
    self, Capacity, CapacitySettings, SearchConfig, StepMeasurement, StepRequest,
};
use crate::cell::{self, CellState};
use crate::fleet_spec::{FleetKind, FleetSpec};
use crate::grid::{self, Point};
use crate::sweep::{CapacityScope, SweepSettings};

/// What a virtual sweep's repetitions are, as `sweep.json` records it.
pub const REPETITIONS: &str = "deterministic: no step-time jitter; repetitions differ only by their policy and engine seeds, so the report draws no spread verdict (deterministic (virtual))";

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
    /// The KV cache and step model the engines run (`--cache-model`).
    pub cache: fleet::EmulatedCache,
    /// The fleet description the engines follow (`--fleet-description`), if any.
    pub description: Option<crate::fleet_description::FleetDescription>,
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
            cache: spec.emulated_cache(),
            description: spec.description.clone(),
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
        if let Some(d) = &self.description {
            // The described engines, as the live fleet passes them (`engine_args`); the pool is
            // the fleet's.
            cfg.engine = d.engine_config();
        }
        cfg.engine.num_gpu_blocks = self.num_gpu_blocks;
        if let fleet::EmulatedCache::LlamaSlots {
            parallel_slots,
            slot_prompt_similarity,
            ctx_tokens,
            step_model,
        } = &self.cache
        {
            // The engines' `--cache-model llama-slots … --step-model …`, as the live fleet.
            cfg.engine.cache_model = engine_core::CacheModel::LlamaSlots {
                slots: *parallel_slots,
                similarity: *slot_prompt_similarity,
                ctx_tokens: *ctx_tokens,
            };
            cfg.engine.model = engine_core::StepModel::preset(step_model)
                .ok_or_else(|| anyhow!("unknown step model {step_model}"))?;
        }
        if let fleet::EmulatedCache::PagedTwin {
            block_size,
            max_model_len,
            step_model,
        } = &self.cache
        {
            // The engines' `--block-size … --max-model-len … --step-model …`, as the live fleet.
            cfg.engine.block_size = *block_size;
            cfg.engine.max_model_len = *max_model_len;
            cfg.engine.model = engine_core::StepModel::preset(step_model)
                .ok_or_else(|| anyhow!("unknown step model {step_model}"))?;
        }
        cfg.engine.model.speed = self.speed;
        // No step-time jitter: an invented noise level would only make deterministic
        // repetitions look like measured ones.
        cfg.engine.model.jitter = 0.0;
        cfg.slowdowns = used.iter().map(|&i| self.slowdown(i)).collect();
        cfg.model = self.model.clone();
        cfg.validate().map_err(|e| anyhow!("{e}"))?;
        Ok(cfg)
    }
}

/// What the virtual calibration's reference run runs with (the sweep's own settings).
#[derive(Debug, Clone)]
pub struct VirtualReference {
    /// Workload seed.
    pub seed: u64,
    /// Closed-loop users.
    pub users: u32,
    /// Mean think time, s of model time.
    pub think_model_s: f64,
    /// Warm-up, s.
    pub warmup_s: f64,
    /// Measured window, s.
    pub measure_s: f64,
    /// Where its rows go (`<sweep>/_calibration`, which the report does not read as a point).
    pub work: PathBuf,
}

/// The virtual calibration in the live calibration's shape, so the live plan builder reads it,
/// by the live rules ([`crate::calibration`]): floors from `sim::calibrate_plan` on `base` with
/// unseen prompts trimmed to exactly [`REFERENCE_PROMPT_TOKENS`] by the engine's tokenizer;
/// bytes per token on the reference plan; a simulated reference run (prefix-affinity, no
/// expiry, rows under `r.work`) whose decay, else the LRU-cycle model, sets the index TTL; and
/// `fleet` recorded with source `virtual`.
pub fn calibrate(
    base: &sim::SimConfig,
    r: &VirtualReference,
    used: Vec<usize>,
    mut fleet: FleetKey,
    git_rev: Option<String>,
    versions: serde_json::Value,
) -> Result<Calibration> {
    let mut count = |m: &[Message<'_>]| Ok(sim::prompts::engine_tokens(m).len() as u64);
    let (spec, arrival) = calibration::floors_workload(r.seed + 1000, CALIBRATION_REQUESTS, 1);
    let mut floors_plan = Plan::build(&spec, &arrival).map_err(|e| anyhow!("{e}"))?;
    let floor_prompts =
        calibration::fit_floor_prompts(&mut floors_plan, REFERENCE_PROMPT_TOKENS, &mut count)?;
    let c =
        sim::calibrate_plan(base, &floors_plan).map_err(|e| anyhow!("virtual calibration: {e}"))?;
    let floors = Slo {
        ttft_ms: c.ttft_p50_ms,
        itl_ms: c.itl_p50_ms,
    };
    // Not rounded as the live rule (`calibration::slo_from_floors`) rounds: virtual sweeps
    // keep recording the SLO they always have.
    let slo = Slo {
        ttft_ms: floors.ttft_ms * SLO_FACTOR,
        itl_ms: floors.itl_ms * SLO_FACTOR,
    };
    let speed = base.engine.model.speed;
    let run_s = r.warmup_s + r.measure_s;
    let (ref_spec, ref_arrival) = calibration::reference_workload(
        r.seed,
        c.capacity_tokens,
        r.users,
        r.think_model_s / speed,
        run_s,
        floors,
    );
    let plan = Plan::build(&ref_spec, &ref_arrival).map_err(|e| anyhow!("{e}"))?;
    let bytes_per_token = calibration::measure_bytes_per_token(
        &plan,
        &mut count,
        "the emulated engine's tokenizer (in process)",
    )?;
    // The reference run: prefix-affinity whose index outlives the run, as the live one.
    let reference_ttl_s = calibration::reference_index_ttl_s(run_s);
    let mut cfg = base.clone();
    cfg.policy = policies::PolicySpec::named("prefix-affinity");
    cfg.policy.seed = r.seed;
    cfg.policy.index_ttl_us = (reference_ttl_s * 1e6) as u64;
    cfg.router.bytes_per_token = bytes_per_token.value;
    cfg.driver = sim::DriverModel {
        warmup_s: r.warmup_s,
        duration_s: Some(run_s),
        timeout_s: 120.0,
    };
    let (point, policy) = ("ws1-s0", "prefix-affinity");
    let dir = cell::rep_dir(&r.work, point, policy, 1);
    cell::clear(&dir)?;
    let book = sim::PromptBook::new(&plan, &cfg.model, cfg.router.block_bytes, true)
        .map_err(|e| anyhow!("{e}"))?;
    let meta = sim::CellMeta {
        sweep: "calibration-reference".into(),
        point: point.into(),
        rep: 1,
        slo,
        planned_end_s: Some(run_s),
        git_rev: git_rev.clone(),
        versions: versions.clone(),
        run: serde_json::json!({"users": r.users, "index_ttl_s": reference_ttl_s}),
    };
    let (_, meta_json) = sim::write_cell_rows(&cfg, &plan, &book, &dir, &meta)
        .map_err(|e| anyhow!("the virtual reference run: {e}"))?;
    sim::write_meta(&dir, &meta_json).map_err(|e| anyhow!("{e}"))?;
    let rep = match analysis::load_rep(&dir, point, policy, 1).map_err(|e| anyhow!("{e}"))? {
        analysis::load::RepLoad::Complete(rep) => rep,
        analysis::load::RepLoad::Incomplete(why) => {
            bail!("the virtual reference run is incomplete: {why}")
        }
    };
    let index =
        calibration::index_from_reference(&rep, &slo, c.capacity_tokens, speed, reference_ttl_s)
            .with_context(|| format!("virtual reference run {}", dir.display()))?;
    fleet.source = "virtual".into();
    Ok(Calibration {
        fleet,
        replicas: Vec::new(),
        used_replicas: used,
        floors,
        slo_factor: SLO_FACTOR,
        slo,
        capacity_tokens: c.capacity_tokens,
        floor_prompts: Some(floor_prompts),
        index,
        bytes_per_token: Some(bytes_per_token),
        gpus: Vec::new(),
        gpu_status: "virtual".into(),
        gpu_throttle_bound: None,
        reference_run: Some(dir),
        git_rev,
        versions,
        capacity: None,
        rules: Some(calibration::DerivationRules::simulated(
            analysis::MetricsConfig::default().tokens_per_block,
        )),
    })
}

/// The simulated fleet's capacity: [`capacity::search`] with the live search's defaults and the
/// sweep's base windows, each step one simulated open-loop cell of the reference point's workload
/// (`<work>/capacity/<step>/<policy>/rep-1/`, rows and `meta.json` as a live step writes them),
/// judged by [`capacity::step_from_rep`] as live steps are. Starts from the floors' estimate
/// (there is no virtual reference run). Deterministic: the same settings find the same capacity.
pub fn find_capacity(
    s: &SweepSettings,
    base: &sim::SimConfig,
    cal: &Calibration,
    work: &Path,
) -> Result<Capacity> {
    let speed = base.engine.model.speed;
    let spec = capacity::reference_spec(s.seed, cal.capacity_tokens);
    let start = capacity::start_estimate(cal, speed, spec.output_tokens)?;
    find_capacity_of(
        s,
        base,
        cal,
        work,
        SearchTarget {
            spec: &spec,
            point: "ws1-s0",
            start,
            resolution: None,
            policies: None,
            min_window_requests: None,
            tuning: None,
        },
    )
}

/// The index TTL at a point's own rate (issue #35, item 6): the calibration's TTL rule
/// ([`calibration::index_from_reference`]: a band of decayed belief, else the LRU cycle of the
/// caches' inflow) applied to one simulated open-loop run of the point's workload `spec` at
/// `rate_rps` (model req/s, the point's capacity), under prefix-affinity whose index outlives
/// the run, as the calibration's reference run does. The run's windows are a search step's
/// (the sweep's, widened for the policy searches' minimum of requests, warm-up by
/// [`capacity::steady_step_warmup_s`]); its rows go under `work`.
pub fn point_index_ttl(
    s: &SweepSettings,
    base: &sim::SimConfig,
    cal: &Calibration,
    spec: &WorkloadSpec,
    point: &str,
    rate_rps: f64,
    work: &Path,
) -> Result<calibration::IndexCalibration> {
    let speed = base.engine.model.speed;
    let wall_rate = rate_rps * speed;
    let (warmup_s, measure_s) = step_windows(
        s.measure_s,
        spec,
        wall_rate,
        cal.open_start(),
        s.warmup_s,
        crate::policy_capacity::MIN_WINDOW_REQUESTS,
    )?;
    let run_s = warmup_s + measure_s;
    let reference_ttl_s = calibration::reference_index_ttl_s(run_s);
    let arrival = ArrivalSpec::Open {
        rate_rps: wall_rate,
        duration_s: run_s,
        start: cal.open_start(),
    };
    let plan = Plan::build(spec, &arrival).map_err(|e| anyhow!("{e}"))?;
    let book = sim::PromptBook::new(&plan, &base.model, base.router.block_bytes, true)
        .map_err(|e| anyhow!("prompts of {point}: {e}"))?;
    let policy = "prefix-affinity";
    let mut cfg = base.clone();
    step_policy(&mut cfg, policy, s.seed, &cal.routing()?, None);
    cfg.policy.index_ttl_us = (reference_ttl_s * 1e6) as u64;
    cfg.engine.seed = s.fleet.engine_seed;
    cfg.driver = sim::DriverModel {
        warmup_s,
        duration_s: Some(run_s),
        timeout_s: s.request_timeout_s,
    };
    let dir = cell::rep_dir(work, point, policy, 1);
    cell::clear(&dir)?;
    let meta = sim::CellMeta {
        sweep: "point-ttl-reference".into(),
        point: point.into(),
        rep: 1,
        slo: cal.slo,
        planned_end_s: Some(run_s),
        git_rev: s.git_rev.clone(),
        versions: s.versions.clone(),
        run: serde_json::json!({"offered_rps": rate_rps, "offered_wall_rps": wall_rate, "index_ttl_s": reference_ttl_s}),
    };
    let (_, meta_json) =
        sim::write_cell_rows(&cfg, &plan, &book, &dir, &meta).map_err(|e| anyhow!("{e}"))?;
    sim::write_meta(&dir, &meta_json).map_err(|e| anyhow!("{e}"))?;
    let rep = match analysis::load_rep(&dir, point, policy, 1).map_err(|e| anyhow!("{e}"))? {
        analysis::load::RepLoad::Complete(rep) => rep,
        analysis::load::RepLoad::Incomplete(why) => {
            bail!("the run at {point}'s rate is incomplete: {why}")
        }
    };
    calibration::index_from_reference(&rep, &cal.slo, cal.capacity_tokens, speed, reference_ttl_s)
        .with_context(|| format!("the TTL rule at {point}'s rate ({})", dir.display()))
}

/// A simulated open-loop step's warm-up and measured window, wall s: `measure_s` widened
/// to hold at least `min_window_requests` (and the drift check's minimum) at `wall_rate`, and a
/// warm-up long enough in the workload's own terms ([`capacity::steady_step_warmup_s`]) from
/// `warmup_s`. One rule for the capacity steps and the run that derives a point's TTL.
fn step_windows(
    measure_s: f64,
    spec: &WorkloadSpec,
    wall_rate: f64,
    open_start: workload::OpenStart,
    warmup_s: f64,
    min_window_requests: usize,
) -> Result<(f64, f64)> {
    let min_requests = analysis::DriftConfig::default()
        .min_requests
        .max(min_window_requests);
    let measure_s = measure_s.max(capacity::window_for_requests(wall_rate, min_requests));
    let warmup_s =
        capacity::steady_step_warmup_s(spec, wall_rate, open_start, warmup_s, measure_s)?;
    Ok((warmup_s, measure_s))
}

/// What one simulated capacity search searches: a workload, the name its steps go under, where
/// it starts, and optionally its resolution and the policies whose best decides.
#[derive(Debug, Clone)]
pub struct SearchTarget<'a> {
    /// The workload (a grid point's).
    pub spec: &'a WorkloadSpec,
    /// The name in the steps' names.
    pub point: &'a str,
    /// The first rate, model req/s, and why.
    pub start: (f64, String),
    /// Relative resolution (`None`: the search's default for the sweep).
    pub resolution: Option<f64>,
    /// The policies whose best decides (`None`: [`capacity::DEFAULT_POLICIES`]); one policy
    /// gives that policy's own capacity.
    pub policies: Option<Vec<String>>,
    /// Each step's measured window is sized for at least this many requests, × the window's
    /// margin (`None`: the drift check's minimum, as every step).
    pub min_window_requests: Option<usize>,
    /// A routing variant applied to the policy after the calibration's routing (`None`: the
    /// policy as every sweep cell runs it; `crate::policy_capacity::Variants`).
    pub tuning: Option<crate::policy_capacity::Tuning>,
}

/// The policy of a search step: `policy` at its defaults with `seed`, the calibration's routing
/// (TTL, node cap, bytes per token, as every sweep cell and every live step gets it), then
/// `tuning` on top.
pub fn step_policy(
    cfg: &mut sim::SimConfig,
    policy: &str,
    seed: u64,
    routing: &Routing,
    tuning: Option<&crate::policy_capacity::Tuning>,
) {
    cfg.policy = policies::PolicySpec::named(policy);
    cfg.policy.seed = seed;
    routing.configure_sim(cfg);
    if let Some(t) = tuning {
        t.apply(&mut cfg.policy);
    }
}

/// [`find_capacity`] on `target`'s workload, from its start, to its resolution.
pub fn find_capacity_of(
    s: &SweepSettings,
    base: &sim::SimConfig,
    cal: &Calibration,
    work: &Path,
    target: SearchTarget<'_>,
) -> Result<Capacity> {
    let SearchTarget {
        spec,
        point,
        start,
        resolution,
        policies,
        min_window_requests,
        tuning,
    } = target;
    let started = std::time::Instant::now();
    let routing = cal.routing()?;
    let defaults = CapacitySettings::defaults(s.quick);
    let c = CapacitySettings {
        warmup_s: s.warmup_s,
        measure_s: s.measure_s,
        resolution: resolution.unwrap_or(defaults.resolution),
        policies: policies.unwrap_or_else(|| defaults.policies.clone()),
        ..defaults
    };
    let speed = base.engine.model.speed;
    let (start_rps, start_rule) = start;
    let cfg = SearchConfig {
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
    let sweep_dir = work.join("capacity");
    cell::clear(&sweep_dir)?;
    let mut workload_name = String::new();
    let mut measure = |step: &StepRequest| -> Result<StepMeasurement> {
        let wall_rate = step.rate_rps * speed;
        // Long enough, in the workload's own terms, that the window is past the run's start:
        // at most MAX_COLD_RESUME_SHARE of its requests resume a conversation cold.
        let (warmup_s, measure_s) = step_windows(
            c.measure_s,
            spec,
            wall_rate,
            cfg.open_start,
            capacity::step_warmup_s(c.warmup_s, step.lengthening),
            min_window_requests.unwrap_or(0),
        )?;
        let run_s = warmup_s + measure_s;
        let step_point = capacity::step_point_of(point, step.rate_rps, step.lengthening);
        let arrival = ArrivalSpec::Open {
            rate_rps: wall_rate,
            duration_s: run_s,
            start: cfg.open_start,
        };
        let plan = Plan::build(spec, &arrival).map_err(|e| anyhow!("{e}"))?;
        workload_name = plan.spec.name();
        let book = sim::PromptBook::new(&plan, &base.model, base.router.block_bytes, true)
            .map_err(|e| anyhow!("prompts of {step_point}: {e}"))?;
        let mut cfg = base.clone();
        step_policy(&mut cfg, &step.policy, s.seed, &routing, tuning.as_ref());
        cfg.engine.seed = s.fleet.engine_seed;
        cfg.driver = sim::DriverModel {
            warmup_s,
            duration_s: Some(run_s),
            timeout_s: s.request_timeout_s,
        };
        let dir = cell::rep_dir(&sweep_dir, &step_point, &step.policy, 1);
        cell::clear(&dir)?;
        let meta = sim::CellMeta {
            sweep: "calibration-capacity".into(),
            point: step_point,
            rep: 1,
            slo: cal.slo,
            planned_end_s: Some(run_s),
            git_rev: s.git_rev.clone(),
            versions: s.versions.clone(),
            run: serde_json::json!({"offered_rps": step.rate_rps, "offered_wall_rps": wall_rate, "lengthening": step.lengthening}),
        };
        let (_, meta_json) =
            sim::write_cell_rows(&cfg, &plan, &book, &dir, &meta).map_err(|e| anyhow!("{e}"))?;
        sim::write_meta(&dir, &meta_json).map_err(|e| anyhow!("{e}"))?;
        capacity::step_from_rep(&dir, speed, warmup_s, measure_s, None)
    };
    let mut cap = capacity::search(&cfg, &mut measure)?;
    cap.workload = workload_name;
    cap.search_wall_s = started.elapsed().as_secs_f64();
    Ok(cap)
}

/// One capacity search a per-point sweep needs: a name and the workload searched.
type Search = (String, WorkloadSpec);

/// The `--load` points' distinct workloads, each named after the first point that has it
/// (its name without `-load<f>`), and each point's owner among them: one capacity search serves
/// every point that differs only in its load fraction.
fn searches_by_workload(
    s: &SweepSettings,
    cal: &Calibration,
    points: &[Point],
) -> (Vec<Search>, Vec<(String, String)>) {
    let mut searches: Vec<Search> = Vec::new();
    let mut of_point = Vec::new();
    for p in points.iter().filter(|p| p.load_fraction.is_some()) {
        let spec = s.spec_for(p, cal);
        let owner = match searches.iter().find(|(_, sp)| *sp == spec) {
            Some((name, _)) => name.clone(),
            None => {
                let name = p.name.split("-load").next().unwrap_or(&p.name).to_string();
                searches.push((name.clone(), spec));
                name
            }
        };
        of_point.push((p.name.clone(), owner));
    }
    (searches, of_point)
}

/// Runs `search` for each named workload, as many at once as there are cores, each recorded in
/// `<records>/<name>/capacity.json`; a record `cal` may reuse ([`PointCapacity::reusable`]) is
/// reused (a resume). Returns `(name, capacity)` in the order given.
fn searched_in_parallel(
    searches: &[Search],
    cal: &Calibration,
    records: &Path,
    search: &(dyn Fn(&str, &WorkloadSpec) -> Result<Capacity> + Sync),
) -> Result<Vec<(String, Capacity)>> {
    let record = |name: &str| records.join(name).join("capacity.json");
    let one = |name: &String, spec: &WorkloadSpec| -> Result<(String, Capacity)> {
        if let Some(c) = PointCapacity::reusable(&record(name), &spec.name(), cal) {
            return Ok((name.clone(), c.capacity));
        }
        let c = search(name, spec)?;
        PointCapacity {
            slo: cal.slo,
            capacity: c.clone(),
            simulated: None,
        }
        .write(&record(name))?;
        Ok((name.clone(), c))
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut found = Vec::new();
    for chunk in searches.chunks(threads.max(1)) {
        let results: Vec<Result<(String, Capacity)>> = std::thread::scope(|scope| {
            let handles: Vec<_> = chunk
                .iter()
                .map(|(name, spec)| scope.spawn(|| one(name, spec)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow!("a capacity search panicked")))
                })
                .collect()
        });
        for r in results {
            found.push(r?);
        }
    }
    Ok(found)
}

/// Each `--load` point's own capacity under [`CapacityScope::PerPoint`] (empty otherwise), as
/// `(point name, capacity)`: the reference search ([`find_capacity_of`]) on the point's workload,
/// started at the reference capacity (the reference point's own workload takes the
/// calibration's capacity as it is), with its steps and `capacity.json` in
/// `<dir>/calibration-runs/<point>/` (reused on a resume when it was searched on the same
/// workload under the same SLO). Points that differ only in their load fraction share one search
/// (one workload); each point gets a copy in `<dir>/<point>/capacity.json`, which `publish`
/// keeps. Searches run on all cores.
fn point_capacities(
    s: &SweepSettings,
    base: &sim::SimConfig,
    cal: &Calibration,
    points: &[Point],
    dir: &Path,
) -> Result<Vec<(String, Capacity)>> {
    if s.capacity_scope != CapacityScope::PerPoint || !s.needs_capacity() {
        return Ok(Vec::new());
    }
    let reference = cal
        .capacity
        .as_ref()
        .ok_or_else(|| anyhow!("a per-point capacity search starts from the reference capacity, and the calibration has none"))?;
    let (searches, of_point) = searches_by_workload(s, cal, points);
    let order: Vec<String> = searches.iter().map(|(name, _)| name.clone()).collect();
    // The reference point's own workload: its capacity is the calibration's, not searched.
    let (given, to_search): (Vec<_>, Vec<_>) = searches
        .into_iter()
        .partition(|(_, spec)| reference.workload == spec.name());
    let start = (
        reference.rate_rps,
        format!(
            "the reference point's capacity ({} req/s, the calibration's)",
            reference.rate_rps
        ),
    );
    let runs = dir.join("calibration-runs");
    let mut found = searched_in_parallel(&to_search, cal, &runs, &|name, spec| {
        find_capacity_of(
            s,
            base,
            cal,
            &runs.join(name),
            SearchTarget {
                spec,
                point: name,
                start: start.clone(),
                resolution: None,
                policies: None,
                min_window_requests: None,
                tuning: None,
            },
        )
        .with_context(|| format!("the capacity of point {name}"))
    })?;
    found.extend(given.into_iter().map(|(name, _)| (name, reference.clone())));
    found.sort_by_key(|(name, _)| order.iter().position(|n| n == name));
    for (name, c) in &found {
        eprintln!(
            "xtask: capacity of {name}: {} req/s (model time; {} steps, {})",
            c.rate_rps,
            c.curve.len(),
            c.rule
        );
    }
    let mut out = Vec::new();
    for (point, owner) in of_point {
        let Some((_, c)) = found.iter().find(|(n, _)| *n == owner) else {
            continue;
        };
        PointCapacity {
            slo: cal.slo,
            capacity: c.clone(),
            simulated: None,
        }
        .write(&dir.join(&point).join("capacity.json"))
        .with_context(|| format!("recording the capacity of {point}"))?;
        out.push((point, c.clone()));
    }
    Ok(out)
}

/// `capacity.json` of a per-point search: a point's own capacity and the SLO it was judged by.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct PointCapacity {
    /// The SLO the search's steps were judged by.
    pub slo: Slo,
    /// The capacity, its rule and its curve.
    pub capacity: Capacity,
    /// A live point's capacity scaled from the simulator's ([`simulated_point_capacities`]);
    /// absent for a search's own result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub simulated: Option<SimulatedScaling>,
}

impl PointCapacity {
    /// The record at `path`, if there is one that reads.
    pub fn read(path: &Path) -> Option<PointCapacity> {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
    }

    /// The record at `path` when a resume may reuse it: searched on `workload` under `cal`'s
    /// SLO, on open loops that start as `cal`'s do ([`Calibration::open_start`]).
    pub fn reusable(path: &Path, workload: &str, cal: &Calibration) -> Option<PointCapacity> {
        PointCapacity::read(path).filter(|c| {
            c.capacity.workload == workload
                && c.slo == cal.slo
                && c.capacity.stale(cal.open_start()).is_none()
        })
    }

    /// Writes the record to `path` atomically (its directory created).
    pub fn write(&self, path: &Path) -> Result<()> {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        cell::write_atomic(path, serde_json::to_string_pretty(self)?.as_bytes())
    }
}

/// How a live point's capacity came from the simulator: the live reference capacity × the
/// point's simulated capacity ÷ the reference point's simulated capacity.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SimulatedScaling {
    /// The live calibration's capacity at the reference point, model req/s.
    pub live_reference_rps: f64,
    /// The simulator's capacity at the reference point (same SLO and routing), model req/s.
    pub simulated_reference_rps: f64,
    /// The simulator's capacity at this point, model req/s.
    pub simulated_point_rps: f64,
    /// Relative resolution of both simulated searches.
    pub resolution: f64,
}

impl SimulatedScaling {
    /// The live point's capacity, model req/s, to 1/1000.
    pub fn live_point_rps(&self) -> f64 {
        let r = self.live_reference_rps * self.simulated_point_rps / self.simulated_reference_rps;
        (r * 1000.0).round() / 1000.0
    }
}

/// Resolution of the simulated searches behind a live sweep's per-point capacities: their ratio
/// carries both searches' errors, and a simulated step costs well under a second.
pub const SIMULATED_RESOLUTION: f64 = 0.05;

/// Each `--load` point's own capacity for a **live** sweep of an emulated fleet under
/// [`CapacityScope::PerPoint`] (empty otherwise), as `(point name, capacity)`. A live search per
/// point would take minutes of fleet time each; the simulator runs the same engine core, and at
/// the quick fleet's capacity it reproduced session-affinity's live cells exactly and
/// prefix-affinity's within 3% (docs/results.md, "Live vs virtual"). So each point's live
/// capacity is the live reference capacity × the simulator's capacity at that point ÷ the
/// simulator's at the reference point, both searched with the live calibration's SLO and routing
/// to [`SIMULATED_RESOLUTION`] (steps under `<dir>/calibration-runs/simulated/`). The reference
/// point's own workload keeps the live capacity as measured. Each point's `capacity.json` records
/// the three rates ([`SimulatedScaling`]); a resume with the same workloads and SLO reuses them.
/// A virtual sweep judged by a live calibration (`prepare`) takes its points' rates from here
/// too, so its plans are the live sweep's. Other fleets are refused: the simulator models the
/// emulator only.
pub fn simulated_point_capacities(
    s: &SweepSettings,
    cal: &Calibration,
    points: &[Point],
    dir: &Path,
) -> Result<Vec<(String, Capacity)>> {
    let any_load_point = points.iter().any(|p| p.load_fraction.is_some());
    if s.capacity_scope != CapacityScope::PerPoint || !s.needs_capacity() || !any_load_point {
        return Ok(Vec::new());
    }
    if s.fleet.kind != FleetKind::Emulated {
        bail!(
            "--capacity per-point on a live sweep scales the simulator's per-point capacities to the measured reference capacity, and the simulator models the emulated engine only; run this fleet with --capacity reference"
        );
    }
    let live = cal.capacity.clone().ok_or_else(|| {
        anyhow!("a per-point capacity scales the reference capacity, and the calibration has none")
    })?;
    let base = EmulatedFleet::of(&s.fleet)?.base_config(&cal.used_replicas)?;
    let reference_spec = capacity::reference_spec(s.seed, cal.capacity_tokens);
    let (searches, of_point) = searches_by_workload(s, cal, points);
    // Points of the reference workload keep the live capacity; the simulator searches the
    // reference workload under its own name and every other workload under its point's.
    let of_point: Vec<(String, Option<String>)> = of_point
        .into_iter()
        .map(|(point, owner)| {
            let is_reference = searches
                .iter()
                .any(|(name, spec)| *name == owner && *spec == reference_spec);
            (point, (!is_reference).then_some(owner))
        })
        .collect();
    let mut to_search = vec![("reference".to_string(), reference_spec)];
    to_search.extend(
        searches
            .into_iter()
            .filter(|(_, spec)| *spec != reference_spec),
    );
    let start = (
        live.rate_rps,
        format!(
            "the live reference capacity ({} req/s, the calibration's)",
            live.rate_rps
        ),
    );
    let runs = dir.join("calibration-runs").join("simulated");
    let found = searched_in_parallel(&to_search, cal, &runs, &|name, spec| {
        let res = Some(SIMULATED_RESOLUTION);
        find_capacity_of(
            s,
            &base,
            cal,
            &runs.join(name),
            SearchTarget {
                spec,
                point: name,
                start: start.clone(),
                resolution: res,
                policies: None,
                min_window_requests: None,
                tuning: None,
            },
        )
        .with_context(|| format!("the simulated capacity of {name}"))
    })?;
    let simulated_reference = found
        .iter()
        .find(|(n, _)| n == "reference")
        .map(|(_, c)| c.rate_rps)
        .ok_or_else(|| anyhow!("the simulated reference search found nothing"))?;
    let mut out = Vec::new();
    for (point, owner) in of_point {
        let (capacity, simulated) = match owner {
            None => (live.clone(), None),
            Some(owner) => {
                let Some((_, sim_point)) = found.iter().find(|(n, _)| *n == owner) else {
                    continue;
                };
                let scaling = SimulatedScaling {
                    live_reference_rps: live.rate_rps,
                    simulated_reference_rps: simulated_reference,
                    simulated_point_rps: sim_point.rate_rps,
                    resolution: SIMULATED_RESOLUTION,
                };
                let mut c = sim_point.clone();
                c.rate_rps = scaling.live_point_rps();
                c.failing_rps =
                    (c.failing_rps * c.rate_rps / sim_point.rate_rps * 1000.0).round() / 1000.0;
                c.rule = format!(
                    "live capacity at the reference point ({} req/s) × this point's simulated capacity ({} req/s) ÷ the reference point's simulated capacity ({} req/s), both simulated with the live calibration's SLO and routing to {:.0}% resolution; the simulated search's rule: {}",
                    live.rate_rps,
                    sim_point.rate_rps,
                    simulated_reference,
                    SIMULATED_RESOLUTION * 100.0,
                    sim_point.rule
                );
                (c, Some(scaling))
            }
        };
        eprintln!(
            "xtask: capacity of {point}: {} req/s (model time; {})",
            capacity.rate_rps,
            match &simulated {
                Some(sc) => format!(
                    "{} × {} ÷ {} simulated",
                    sc.live_reference_rps, sc.simulated_point_rps, sc.simulated_reference_rps
                ),
                None => "the reference point's, measured live".into(),
            }
        );
        PointCapacity {
            slo: cal.slo,
            capacity: capacity.clone(),
            simulated,
        }
        .write(&dir.join(&point).join("capacity.json"))
        .with_context(|| format!("recording the capacity of {point}"))?;
        out.push((point, capacity));
    }
    Ok(out)
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
    /// Per-request timeout, s.
    pub timeout_s: f64,
    /// The SLO of the drift check and of `meta.json`.
    pub slo: Slo,
    /// TTL, node cap and bytes per token from the calibration ([`Calibration::routing`]).
    pub routing: Routing,
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
    /// Discarded warm-up, s (the point's, [`SweepSettings::window_for`]).
    pub warmup_s: f64,
    /// Warm-up + measured window, s (the driver's `--duration-s`).
    pub run_s: f64,
    /// The point's workload name, as the live sweep records it (with its `-load<f>` label).
    pub workload_name: String,
    /// Run settings recorded under `meta.run` (the live cell's [`SweepSettings::run_record`]).
    pub run: serde_json::Value,
}

/// The simulated cell of `policy`'s repetition `rep`: the base fleet with the policy, its
/// seeds, the calibrated routing settings and the driver's.
pub fn cell_config(
    s: &CellSettings,
    policy: &str,
    rep: u32,
    warmup_s: f64,
    run_s: f64,
) -> sim::SimConfig {
    let mut cfg = s.base.clone();
    cfg.policy = policies::PolicySpec::named(policy);
    cfg.policy.seed = s.seed.wrapping_add(u64::from(rep));
    s.routing.configure_sim(&mut cfg);
    cfg.engine.seed = s
        .engine_seed
        .wrapping_mul(1_000_003)
        .wrapping_add(u64::from(rep));
    cfg.driver = sim::DriverModel {
        warmup_s,
        duration_s: Some(run_s),
        timeout_s: s.timeout_s,
    };
    cfg
}

/// Simulates one repetition into `job.dir` (cleared first), checks drift on its rows, writes
/// `meta.json` last. Returns the drift check's class: a `warming` repetition is set aside, any
/// other accepted (an `overloaded` one marked so by its recorded verdict).
pub fn run_cell(s: &CellSettings, job: &Job) -> Result<analysis::DriftClass> {
    let mut cfg = cell_config(s, &job.policy, job.rep, job.warmup_s, job.run_s);
    cell::clear(&job.dir)?;
    let meta = sim::CellMeta {
        sweep: s.sweep.clone(),
        point: job.point.clone(),
        rep: job.rep,
        slo: s.slo,
        planned_end_s: Some(job.run_s),
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
    // A load ladder (a generated trace's stages) changes its load by design: its drift is
    // recorded, never a reason to set it aside; the report gives it stage by stage instead.
    let ladder = job.run["trace"]["stages"]
        .as_array()
        .is_some_and(|s| !s.is_empty());
    let accepted = ladder || !drift.warming;
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
    // The live meta's workload name and run record (load fraction, offered rate, window): the
    // simulator records its own run beside them.
    meta_json["workload_name"] = serde_json::Value::String(job.workload_name.clone());
    if let (Some(run), Some(ours)) = (meta_json["run"].as_object_mut(), job.run.as_object()) {
        for (k, v) in ours {
            run.entry(k.clone()).or_insert_with(|| v.clone());
        }
    }
    sim::write_meta(&job.dir, &meta_json).map_err(|e| anyhow!("{e}"))?;
    Ok(drift.class)
}

/// Refuses settings the simulator cannot model (before anything is written).
pub fn check(s: &SweepSettings) -> Result<()> {
    if !matches!(s.fleet.kind, FleetKind::Emulated) {
        bail!(
            "--virtual simulates the emulated fleet its flags describe; --fleet command/static cannot be simulated"
        );
    }
    if !matches!(s.ingress, Ingress::Router) {
        bail!(
            "--virtual models one kvroute router only; the HAProxy and Envoy ingresses and --routers N are live-only"
        );
    }
    if s.reps == 0 {
        bail!("--reps must be at least 1");
    }
    s.fleet.check_description()
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
    // Checked before the calibration and its capacity search, which take a while.
    let policies = grid::policies(&s.policies, s.quick)?;
    // The simulator refuses exact keying on llama-slots too; say so before calibrating.
    s.fleet.check_policies(&policies)?;
    let fleet = EmulatedFleet::of(&s.fleet)?;
    let used = fleet.used_replicas();
    let base = fleet.base_config(&used)?;
    let reference = VirtualReference {
        seed: s.seed,
        users: s.users,
        think_model_s: s.think_model_s,
        warmup_s: s.warmup_s,
        measure_s: s.measure_s,
        work: dir.join("_calibration"),
    };
    let cal = match &s.live_calibration {
        // A cross-check judges both sides by one calibration: the live one, read as is.
        Some(path) => {
            let c = Calibration::read(path)?;
            if c.fleet != s.fleet.key() {
                bail!(
                    "{} was calibrated for another fleet ({:?}); give the virtual sweep the live sweep's fleet flags",
                    path.display(),
                    c.fleet
                );
            }
            if c.used_replicas != used {
                bail!(
                    "{} uses replicas {:?}, the simulated fleet {:?}",
                    path.display(),
                    c.used_replicas,
                    used
                );
            }
            c.routing()?;
            if s.needs_capacity() {
                s.check_capacity(&c, path)?;
            }
            c
        }
        None => {
            let mut cal = calibrate(
                &base,
                &reference,
                used,
                s.fleet.key(),
                s.git_rev.clone(),
                s.versions.clone(),
            )?;
            if s.needs_capacity() {
                cal.capacity = Some(find_capacity(
                    s,
                    &base,
                    &cal,
                    &dir.join("calibration-runs"),
                )?);
            }
            cal
        }
    };
    cal.write(&dir.join("calibration.json"))?;
    let routing = cal.routing()?;
    let points = s.sweep_points(&cal)?;
    cell::write_atomic(
        &dir.join("sweep.json"),
        serde_json::to_string_pretty(&{
            let mut record = s.record(&points, &policies, &cal);
            record["virtual"] = serde_json::json!(true);
            record["speed"] = serde_json::json!(s.fleet.speed);
            record["repetitions"] = serde_json::json!(REPETITIONS);
            record["calibration_source"] = match &s.live_calibration {
                Some(p) => serde_json::json!(format!("live: {}", p.display())),
                None => serde_json::json!("virtual"),
            };
            record
        })?
        .as_bytes(),
    )?;
    // Judged by a live calibration, each point runs at the rate the live sweep gave it (the
    // measured reference × the simulator's ratio), so the two sweeps' plans are the same bytes
    // and `crosscheck` can compare every point; otherwise each point's own simulated search.
    let own_capacities = if s.live_calibration.is_some() {
        simulated_point_capacities(s, &cal, &points, dir)?
    } else {
        point_capacities(s, &base, &cal, &points, dir)?
    };
    let mut jobs = Vec::new();
    let mut skipped = 0usize;
    for point in &points {
        // Under a per-point capacity the point's rate, window and recorded capacity are its own.
        let (point, cal) = match own_capacities.iter().find(|(n, _)| *n == point.name) {
            Some((_, c)) => s.at_point_capacity(point, &cal, c.clone())?,
            None => (point.clone(), cal.clone()),
        };
        let point = &point;
        let window = s.window_for(point, &cal)?;
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
                    warmup_s: window.warmup_s,
                    run_s: window.run_s(),
                    workload_name: plan_file.workload_name.clone(),
                    run: {
                        let mut run = s.run_record(point, &cal, &window);
                        run["plan"] = serde_json::Value::String(plan_file.name.clone());
                        run["routing"] = serde_json::to_value(&routing)?;
                        run["trace"] =
                            serde_json::to_value(crate::trace_sweep::meta_of(&plan_file))?;
                        run
                    },
                });
            }
        }
    }
    let cells = CellSettings {
        base,
        sweep: s.name.as_str().to_string(),
        seed: s.seed,
        engine_seed: s.fleet.engine_seed,
        timeout_s: s.request_timeout_s,
        slo: cal.slo,
        routing,
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

    use workload::{ArrivalSpec, Sizing, WorkloadSpec};

    use crate::scratch::Scratch;

    fn fleet(replicas: usize, slowdowns: &[f64]) -> EmulatedFleet {
        EmulatedFleet {
            replicas,
            num_gpu_blocks: 1024,
            speed: 6.0,
            slowdowns: slowdowns.to_vec(),
            model: sim::DEFAULT_MODEL.into(),
            cache: fleet::EmulatedCache::Paged,
            description: None,
        }
    }

    /// A live sweep's per-point capacities: the reference point keeps the live capacity; a
    /// skewed point gets the live capacity × the simulator's ratio, recorded with its three
    /// rates; a resume reuses the searches; a fleet the simulator does not model is refused.
    #[test]
    fn live_points_scale_the_simulators_ratio_to_the_measured_reference() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/measurements");
        let cal =
            Calibration::read(&root.join("pressure-grid-quick-capacity/calibration.json")).unwrap();
        let live_rps = cal.capacity.as_ref().unwrap().rate_rps;
        let mut s = SweepSettings {
            load_fractions: Some(vec![1.0]),
            points: vec!["ws1-s0-load1.0".into(), "ws1-s1.4-load1.0".into()],
            capacity_scope: CapacityScope::PerPoint,
            fleet: FleetSpec {
                model: cal.fleet.model.clone(),
                ..FleetSpec::test_emulated()
            },
            ..SweepSettings::test_quick()
        };
        let points = s.sweep_points(&cal).unwrap();
        let dir = Scratch::new("live-per-point");
        let found = simulated_point_capacities(&s, &cal, &points, &dir.0).unwrap();
        assert_eq!(found.len(), 2, "{found:?}");
        assert_eq!(found[0].0, "ws1-s0-load1.0");
        assert_eq!(
            found[0].1.rate_rps, live_rps,
            "the reference point keeps the live one"
        );
        let record: PointCapacity = serde_json::from_str(
            &std::fs::read_to_string(dir.0.join("ws1-s1.4-load1.0/capacity.json")).unwrap(),
        )
        .unwrap();
        let scaling = record.simulated.clone().expect("scaled from the simulator");
        assert_eq!(scaling.live_reference_rps, live_rps);
        assert_eq!(found[1].1.rate_rps, scaling.live_point_rps());
        assert_eq!(record.capacity.rate_rps, scaling.live_point_rps());
        assert!(
            scaling.simulated_point_rps < scaling.simulated_reference_rps,
            "skew 1.4's convoy lowers the capacity: {scaling:?}"
        );
        assert!(
            record.capacity.rule.contains("simulated capacity"),
            "{}",
            record.capacity.rule
        );
        // A resume finds both searches recorded and reuses them.
        let again = simulated_point_capacities(&s, &cal, &points, &dir.0).unwrap();
        assert_eq!(again[1].1.rate_rps, found[1].1.rate_rps);
        // A virtual sweep judged by that live calibration runs each point at the live sweep's
        // rate, so its plans are the same bytes and `crosscheck` can compare every point.
        let judged = Scratch::new("live-per-point-virtual");
        // The published calibration predates primed open starts, which a sweep refuses; marked
        // with today's start here, since only its rates matter to this test.
        let mut live: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(root.join("pressure-grid-quick-capacity/calibration.json"))
                .unwrap(),
        )
        .unwrap();
        live["capacity"]["open_start"] = serde_json::to_value(cal.open_start()).unwrap();
        let live_path = judged.0.join("live-calibration.json");
        std::fs::write(&live_path, live.to_string()).unwrap();
        let virtual_settings = SweepSettings {
            live_calibration: Some(live_path),
            ..s.clone()
        };
        prepare(&virtual_settings, &judged.0).unwrap();
        let record: PointCapacity = serde_json::from_str(
            &std::fs::read_to_string(judged.0.join("ws1-s1.4-load1.0/capacity.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(record.capacity.rate_rps, found[1].1.rate_rps);
        assert!(record.simulated.is_some(), "{record:?}");
        s.fleet.kind = FleetKind::Static;
        let e = simulated_point_capacities(&s, &cal, &points, &dir.0).unwrap_err();
        assert!(e.to_string().contains("--capacity reference"), "{e}");
    }

    /// Only one router is simulated: several routers, HAProxy and Envoy are refused.
    #[test]
    fn the_simulator_refuses_what_it_does_not_model() {
        use crate::sweep::SweepSettings;
        check(&SweepSettings::test_quick()).unwrap();
        let routers = fleet::Ingress::with_routers(fleet::Ingress::Router, 2, None, false, false);
        let s = SweepSettings {
            ingress: routers.unwrap(),
            ..SweepSettings::test_quick()
        };
        let e = check(&s).unwrap_err().to_string();
        assert!(e.contains("--virtual") && e.contains("--routers N"), "{e}");
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
        assert_eq!(base.engine.model.jitter, 0.0, "no invented step-time noise");
    }

    /// `--fleet emulated --cache-model llama-slots --virtual`: the simulated engines run the
    /// llama fleet's slots and the llama-tiny step model at the fleet's speed; exact residency
    /// is refused before anything runs.
    #[test]
    fn an_emulated_llama_fleet_is_simulated_with_its_slots() {
        let spec = FleetSpec {
            cache_model: crate::fleet_spec::CacheModelKind::LlamaSlots,
            speed: 1.0,
            ..FleetSpec::test_emulated()
        };
        let f = EmulatedFleet::of(&spec).unwrap();
        let base = f.base_config(&f.used_replicas()).unwrap();
        assert_eq!(
            base.engine.cache_model,
            engine_core::CacheModel::LLAMA_FLEET
        );
        let tiny = engine_core::StepModel::llama_tiny();
        assert_eq!(
            (base.engine.model.c_tok_ms, base.engine.model.speed),
            (tiny.c_tok_ms, 1.0)
        );
        assert_eq!(base.capacity_tokens(), 3 * 16384);
        let s = SweepSettings {
            fleet: spec,
            policies: vec!["prefix-affinity".into(), "exact-residency".into()],
            ..SweepSettings::test_quick()
        };
        let dir = Scratch::new("virtual-llama-refused");
        let e = prepare(&s, &dir.0).err().unwrap().to_string();
        assert!(
            e.contains("cannot run on this fleet (emulated llama-slots)"),
            "{e}"
        );
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
        let reference = VirtualReference {
            seed: 7,
            users: 8,
            think_model_s: 1.0,
            warmup_s: 2.0,
            measure_s: 6.0,
            work: s.0.join("_calibration"),
        };
        let cal = calibrate(&base, &reference, used, key, None, serde_json::Value::Null).unwrap();
        assert_eq!(cal.fleet.source, "virtual");
        assert_eq!(cal.slo.ttft_ms, cal.floors.ttft_ms * SLO_FACTOR);
        let routing = cal.routing().unwrap();
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
            timeout_s: 60.0,
            slo: cal.slo,
            routing,
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
            warmup_s,
            run_s,
            workload_name: plan.spec.name(),
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

    /// A fleet description's engines are the simulated fleet's: the reference description is
    /// the emulator's default engine (no flags, the same key, the same simulated config, so
    /// every virtual result is unchanged), and another description's limits and step model reach
    /// the simulator exactly as the engine flags a live fleet passes carry them.
    #[test]
    fn a_described_fleet_is_simulated_with_its_engines() {
        use crate::fleet_description::{FleetDescription, shipped};
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let all = shipped(&root).unwrap();
        let by = |name: &str| -> FleetDescription {
            all.iter().find(|d| d.name == name).unwrap().clone()
        };
        let base = |s: &FleetSpec| {
            let f = EmulatedFleet::of(s).unwrap();
            f.base_config(&f.used_replicas()).unwrap()
        };
        let plain = FleetSpec::test_emulated();
        let reference = FleetSpec {
            description: Some(by("rtx3090-llama-3-8b-4bit")),
            ..plain.clone()
        };
        assert_eq!(reference.emulated_cache(), fleet::EmulatedCache::Paged);
        assert_eq!(reference.key(), plain.key());
        assert_eq!(base(&reference).engine, base(&plain).engine);

        let h100 = by("h100-llama-3.1-8b-bf16");
        let spec = FleetSpec {
            description: Some(h100.clone()),
            num_gpu_blocks: u64::from(h100.num_gpu_blocks()),
            ..plain.clone()
        };
        let cfg = base(&spec).engine;
        let want = h100.engine_config();
        assert_eq!(
            cfg.model,
            engine_core::StepModel {
                speed: plain.speed,
                jitter: 0.0,
                ..want.model.clone()
            }
        );
        assert_eq!(
            (
                cfg.block_size,
                cfg.num_gpu_blocks,
                cfg.max_num_batched_tokens
            ),
            (
                want.block_size,
                want.num_gpu_blocks,
                want.max_num_batched_tokens
            )
        );
        assert_eq!(
            (cfg.max_num_seqs, cfg.max_model_len),
            (want.max_num_seqs, want.max_model_len)
        );
        // The live engines' flags read back to the very constants simulated.
        let args = spec.emulated_cache().args();
        let flag = |name: &str| -> f64 {
            let i = args.iter().position(|a| a == name).unwrap();
            args[i + 1].parse().unwrap()
        };
        assert_eq!(flag("--c-tok-ms"), want.model.c_tok_ms);
        assert_eq!(
            flag("--bandwidth-bytes-per-s"),
            want.model.bandwidth_bytes_per_s
        );
        assert_eq!(flag("--kv-bytes-per-token"), want.model.kv_bytes_per_token);
        assert_eq!(flag("--max-num-seqs"), f64::from(want.max_num_seqs));
        // A calibration for one fleet is not another's.
        assert_ne!(spec.key(), plain.key());
        // A description applies to emulated paged engines only.
        let real = FleetSpec {
            kind: FleetKind::Static,
            ..spec.clone()
        };
        assert!(real.check_description().is_err());
        let slots = FleetSpec {
            cache_model: crate::fleet_spec::CacheModelKind::LlamaSlots,
            ..spec
        };
        assert!(slots.check_description().is_err());
    }
}
