//! `cargo xtask sweep <name>`: flags → `experiment::sweep::SweepSettings`, then the resumable
//! loop over points × repetitions × policies (finished cells skipped, progress with an ETA), each
//! cell run by `experiment::sweep::LiveSweep::run_cell`; then the report.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;

use experiment::Bins;
use experiment::cell::{self, CellState};
use experiment::grid::{PrefixGroups, Sharing, SweepName, WorkloadShape};
use experiment::progress::Progress;
use experiment::sweep::{CapacityScope, IngressFlag, LiveSweep, SweepSettings};
use experiment::virtual_sweep;

use crate::fleetargs::FleetArgs;
use crate::{env, interrupt, report};

/// Flags of `cargo xtask sweep`.
#[derive(Debug, Clone, Args)]
pub struct SweepArgs {
    /// Which sweep.
    #[arg(value_enum)]
    pub name: SweepName,
    /// Reduced grid, 3 replicas, short cells: the main job on a small machine.
    #[arg(long)]
    pub quick: bool,
    /// Repetitions per point and policy.
    #[arg(long, default_value_t = 3)]
    pub reps: u32,
    /// Policies to compare, comma-separated (default: all nine; three with --quick).
    #[arg(long, value_delimiter = ',')]
    pub policies: Vec<String>,
    /// What sits in front of the replicas: kvroute's router (policies from `--policies`),
    /// HAProxy with bounded-load consistent hashing on `x-session-id` (one policy,
    /// `haproxy-session-bounded`), or Envoy + kvroute's endpoint picker (cells `envoy-epp-<policy>`).
    #[arg(long, value_enum, default_value_t = IngressFlag::Router)]
    pub ingress: IngressFlag,
    /// Run N kvroute routers (the same policy in each; N = 1: the one router) behind HAProxy
    /// (`--front`); cells `r<N>-<rr|hash>[-share[-loads]]-<policy>` beside the one router's.
    #[arg(long, default_value_t = 1)]
    pub routers: u32,
    /// HAProxy in front of `--routers N`: `rr` (round robin, the default) or `session-hash`
    /// (consistent hashing on `x-session-id`: each session through one router); with one
    /// router, it puts that router behind HAProxy (the front's own cost, cells `r1-…`).
    #[arg(long)]
    pub front: Option<fleet::ingress::Front>,
    /// With `--routers N`: each router publishes its routing decisions to the others over ZMQ
    /// and inserts theirs into its own index.
    #[arg(long)]
    pub share_decisions: bool,
    /// With `--share-decisions`: share the routers' in-flight counts too (`-share-loads-` cells).
    #[arg(long)]
    pub share_loads: bool,
    /// HAProxy's load bound c (`hash-balance-factor` = c × 100), with `--ingress haproxy`
    /// (alias `--load-factor`, the router's name for session-bounded's bound).
    #[arg(long, visible_alias = "load-factor", default_value_t = 1.25)]
    pub balance_factor: f64,
    /// Open-loop load as fractions of the calibrated capacity, comma-separated (default 1.0;
    /// the `load` sweep: 0.5,0.7,0.9,1.1,1.3,1.5, or 0.5,1.0,1.5 with --quick). Poisson
    /// arrivals at fraction × capacity: open loop because a closed loop's offered load depends
    /// on the latency it measures. Needs a calibration with a capacity (`cargo xtask calibrate`).
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["users", "open_loop", "rates"])]
    pub load: Vec<f64>,
    /// Closed loop with this many users instead of `--load` (the earlier sweeps: 32).
    #[arg(long)]
    pub users: Option<u32>,
    /// Open loop at an absolute `--rate` instead of `--load` (pressure-grid, turns,
    /// prompt-length).
    #[arg(long, requires = "rate")]
    pub open_loop: bool,
    /// Open-loop rate, requests per second of model time (wall rate = rate × speed).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Only these points (names as in the sweep directory, e.g. `ws1-s0`), comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub points: Vec<String>,
    /// Absolute model-time rates of the `load` sweep, comma-separated, instead of `--load`.
    #[arg(long, value_delimiter = ',')]
    pub rates: Vec<f64>,
    /// Mean think time of closed-loop users, s of model time (wall = think ÷ speed).
    #[arg(long, default_value_t = 1.0)]
    pub think_s: f64,
    /// Prefix groups: conversations share one of G prefixes (0 = every context private, the
    /// workload and names before groups; the points' context is then 1,100 tokens, else 512
    /// private tokens after the shared prefix).
    #[arg(long, default_value_t = PrefixGroups::DEFAULT.count)]
    pub prefix_groups: u32,
    /// Each group's shared prefix, tokens.
    #[arg(long, default_value_t = PrefixGroups::DEFAULT.prefix_tokens)]
    pub group_prefix_tokens: u32,
    /// Zipf exponent of group membership (0 = uniform), separate from the skew axis.
    #[arg(long, default_value_t = PrefixGroups::DEFAULT.zipf_s)]
    pub group_skew: f64,
    /// `exclusive` (a conversation belongs to one user at a time) or `shared` (several users
    /// may send turns of one conversation at once).
    #[arg(long, default_value = "exclusive")]
    pub conversation_sharing: Sharing,
    /// Warm-up per cell, wall s (discarded). Default: a `--load` cell's from the settling time
    /// the capacity search measured at the nearest rate × 1.5; otherwise 20, or 5 with --quick.
    #[arg(long)]
    pub warmup_s: Option<f64>,
    /// Measured window per cell, wall s (default 40, or 8 with --quick).
    #[arg(long)]
    pub measure_s: Option<f64>,
    /// Root of the measurements.
    #[arg(long, default_value = "measurements")]
    pub out: PathBuf,
    /// Sweep directory name (default: the sweep's name, `-quick` appended with --quick).
    #[arg(long)]
    pub sweep_dir_name: Option<String>,
    /// Calibration to use (run first when missing or made for another fleet).
    #[arg(long, default_value = "measurements/calibration.json")]
    pub calibration: PathBuf,
    /// Recalibrate even when the calibration matches.
    #[arg(long)]
    pub recalibrate: bool,
    /// Delete the sweep directory first instead of resuming it.
    #[arg(long)]
    pub fresh: bool,
    /// Largest engine lateness p99 a cell may show before it is discarded and re-run, as a
    /// share of the calibrated ITL floor in model time (the wall bound is that ÷ speed).
    #[arg(long, default_value_t = experiment::calibration::LATENESS_SHARE_OF_ITL_FLOOR)]
    pub lateness_share_of_itl_floor: f64,
    /// Re-runs of a cell whose evidence fails before it is set aside.
    #[arg(long, default_value_t = 2)]
    pub evidence_retries: u32,
    /// Seconds between evidence samples.
    #[arg(long, default_value_t = 1.0)]
    pub evidence_interval_s: f64,
    /// Per-request timeout, wall s.
    #[arg(long, default_value_t = 60.0)]
    pub request_timeout_s: f64,
    /// Workload seed.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Use the binaries already in target/release.
    #[arg(long)]
    pub no_build: bool,
    /// Skip the report at the end.
    #[arg(long)]
    pub no_report: bool,
    /// Run in virtual time through the simulator (`sim` crate) instead of live processes;
    /// default directory `<sweep>[-quick]-virtual`.
    #[arg(long = "virtual")]
    pub virtual_time: bool,
    /// With `--virtual`: judge by this live calibration (its SLO, TTL, node cap, bytes per token
    /// and capacity) instead of a virtual one, so the two sweeps can be cross-checked
    /// (`cargo xtask crosscheck`). The fleet flags must be the live sweep's.
    #[arg(long, requires = "virtual_time")]
    pub live_calibration: Option<PathBuf>,
    /// Instead of the cells, search each policy's own capacity at every point (the highest rate
    /// at which that policy alone meets the SLO, to 5%) for `--seeds` plan seeds (`--seed`,
    /// `--seed`+1, …), and write `policy-capacity.{md,json}` (`experiment::policy_capacity`).
    /// With `--virtual`, in the simulator; without, live on the fleet, each search starting at
    /// the simulator's prediction of it (also written: `predicted-capacity.{md,json}` and the
    /// comparison `predicted-vs-live.json`).
    #[arg(long)]
    pub policy_capacity: bool,
    /// Plan seeds of `--policy-capacity`.
    #[arg(long, default_value_t = 3, requires = "policy_capacity")]
    pub seeds: u32,
    /// With `--policy-capacity`: also search each belief-index policy with the calibration's TTL ×
    /// each factor, comma-separated (`<policy> ttl×<f>`; margins over the policy's defaults).
    #[arg(long, value_delimiter = ',', requires = "policy_capacity")]
    pub ttl_scale: Vec<f64>,
    /// With `--policy-capacity`: also search each spilling policy with this absolute spill margin
    /// (spill needs matched − least > N outstanding; default 4), comma-separated (`<policy> spill-abs <n>`).
    #[arg(long, value_delimiter = ',', requires = "policy_capacity")]
    pub spill_abs: Vec<u32>,
    /// With `--policy-capacity`: also search each spilling policy with this ratio spill margin
    /// (spill needs matched > R × least; default 1.5), comma-separated (`<policy> spill-ratio <r>`).
    #[arg(long, value_delimiter = ',', requires = "policy_capacity")]
    pub spill_ratio: Vec<f64>,
    /// With `--policy-capacity --virtual`: also search each belief-index policy with the TTL derived at each point's own rate (`<policy> ttl@point`).
    #[arg(long, requires = "policy_capacity")]
    pub ttl_at_point: bool,
    /// Which capacity `--load` is a fraction of: `per-point` (each point's own; live on an
    /// emulated fleet, and virtual with `--live-calibration`, the measured reference × the
    /// simulator's ratio of the point's to the reference's; the default) or `reference` (the
    /// calibration's at ws 1 / skew 0; the default on other fleets and with `--live-calibration`).
    #[arg(long, value_enum)]
    pub capacity: Option<CapacityScope>,
    /// The fleet.
    #[command(flatten)]
    pub fleet: FleetArgs,
    /// The trace of `sweep trace`.
    #[command(flatten)]
    pub trace: crate::trace_args::TraceArgs,
}

impl SweepArgs {
    /// The settings these flags ask for (the live and the virtual sweep share them); refuses
    /// `--routers` combinations that make no sense.
    pub fn settings(&self) -> Result<SweepSettings> {
        // The closed loop or an absolute rate, asked for explicitly, keep the earlier sweeps'
        // arrivals; otherwise the sweep runs at `--load` fractions of the capacity.
        // A trace replay's load is the trace's own arrivals (× its time scale): no capacity
        // sizes it, so none is searched or required of the calibration.
        let explicit_arrival = self.users.is_some()
            || self.open_loop
            || (self.name == SweepName::Load && !self.rates.is_empty())
            || self.name == SweepName::Trace;
        Ok(SweepSettings {
            name: self.name,
            quick: self.quick,
            reps: self.reps,
            policies: self.policies.clone(),
            ingress: experiment::sweep::ingress_from_flags(
                self.ingress,
                self.routers,
                self.front,
                self.share_decisions,
                self.share_loads,
            )?,
            balance_factor: self.balance_factor,
            users: self.users.unwrap_or(experiment::calibrate::DEFAULT_USERS),
            open_rate_rps: if self.open_loop { self.rate } else { None },
            load_fractions: (!explicit_arrival).then(|| self.load.clone()),
            rates_rps: self.rates.clone(),
            workload: WorkloadShape {
                prefix_groups: PrefixGroups::from_count(
                    self.prefix_groups,
                    self.group_prefix_tokens,
                    self.group_skew,
                ),
                sharing: self.conversation_sharing,
            },
            points: self.points.clone(),
            think_model_s: self.think_s,
            warmup_s: self.warmup_s.unwrap_or_else(|| {
                experiment::trace_sweep::default_warmup_s(self.name, self.quick)
            }),
            warmup_given: self.warmup_s.is_some(),
            measure_s: self.measure_s.unwrap_or_else(|| {
                experiment::trace_sweep::default_measure_s(self.name, self.quick)
            }),
            calibration: self.calibration.clone(),
            recalibrate: self.recalibrate,
            lateness_share_of_itl_floor: self.lateness_share_of_itl_floor,
            evidence_retries: self.evidence_retries,
            evidence_interval_s: self.evidence_interval_s,
            request_timeout_s: self.request_timeout_s,
            seed: self.seed,
            fleet: self.fleet.spec(self.quick),
            git_rev: env::git_rev(),
            versions: env::versions(),
            trace: self.trace.settings(self.quick),
            live_calibration: self.live_calibration.clone(),
            capacity_scope: self.capacity.unwrap_or(CapacityScope::default_for(
                self.live_calibration.is_some(),
                self.virtual_time,
                self.fleet.spec(self.quick).kind,
            )),
        })
    }

    /// The routing variants of `--policy-capacity` (`--ttl-scale`, `--spill-abs`,
    /// `--spill-ratio`), each varied alone.
    pub fn variants(&self) -> experiment::policy_capacity::Variants {
        experiment::policy_capacity::Variants {
            ttl_scales: self.ttl_scale.clone(),
            spill_abs: self.spill_abs.clone(),
            spill_ratios: self.spill_ratio.clone(),
            ttl_at_point: self.ttl_at_point,
        }
    }

    fn dir(&self) -> PathBuf {
        let quick = if self.quick { "-quick" } else { "" };
        let name = (self.sweep_dir_name.clone())
            .unwrap_or_else(|| format!("{}{quick}", self.name.as_str()));
        self.out.join(name)
    }
}

/// Runs the sweep; returns its directory.
pub fn sweep(args: &SweepArgs, bins: &Bins) -> Result<PathBuf> {
    let settings = args.settings()?;
    let sweep_dir = args.dir();
    if args.fresh && sweep_dir.exists() {
        std::fs::remove_dir_all(&sweep_dir)
            .with_context(|| format!("removing {}", sweep_dir.display()))?;
    }
    std::fs::create_dir_all(&sweep_dir)?;
    if args.reps == 0 {
        bail!("--reps must be at least 1");
    }
    if args.policy_capacity {
        if args.variants() != experiment::policy_capacity::Variants::default() {
            bail!(
                "--ttl-scale, --ttl-at-point, --spill-abs and --spill-ratio vary the virtual searches (add --virtual); the live searches run each policy at its defaults"
            );
        }
        let started = Instant::now();
        let outcome = experiment::policy_capacity::run_live(
            &settings,
            bins,
            &sweep_dir,
            args.seeds,
            &interrupt::requested,
        )?;
        println!("{}", analysis::capacity::markdown(&outcome.live));
        println!(
            "{}",
            analysis::capacity::prediction_markdown(&outcome.checks)
        );
        eprintln!(
            "xtask: each policy's own capacity, live, in {}: {}",
            experiment::progress::fmt_duration(started.elapsed()),
            sweep_dir.join("policy-capacity.md").display()
        );
        return Ok(sweep_dir);
    }
    let mut live = LiveSweep::start(&settings, bins, &sweep_dir, &interrupt::requested)?;
    let (cal, points) = (&live.calibration, &live.points);
    let own = virtual_sweep::simulated_point_capacities(&settings, cal, points, &sweep_dir)?;
    live.at_point_capacities(own)?;
    let (points, policies) = (live.points.clone(), live.policies.clone());
    let total = points.len() * policies.len() * args.reps as usize;
    let mut progress = Progress::new(total, Duration::from_secs_f64(settings.run_s() + 4.0));
    eprintln!("{}", live.banner());
    for point in &points {
        let plan = live.plan_for(point)?;
        for rep in 1..=args.reps {
            for policy in &policies {
                if interrupt::requested() {
                    bail!(
                        "interrupted; completed cells are kept, rerun the same command to resume"
                    );
                }
                let dir = cell::rep_dir(&sweep_dir, &point.name, policy, rep);
                if CellState::of(&dir).is_done() {
                    progress.skipped();
                    continue;
                }
                let t0 = Instant::now();
                let outcome = live.run_cell(point, policy, rep, &plan, &interrupt::requested)?;
                progress.ran(t0.elapsed());
                let what = format!("{} {policy} rep-{rep}: {outcome}", point.name);
                eprintln!("{}", progress.line(&what));
            }
        }
    }
    live.stop();
    if !args.no_report {
        report::write(&sweep_dir)?;
    }
    policy_capacity(args, &settings, &sweep_dir)?;
    Ok(sweep_dir)
}

/// Plan seeds of the main job's per-policy capacities.
pub const POLICY_CAPACITY_SEEDS: u32 = 3;

/// Each compared policy's own capacity at every point, over [`POLICY_CAPACITY_SEEDS`] plan
/// seeds, searched in virtual time under this run's live calibration (its SLO, routing values
/// and reference capacity; `experiment::policy_capacity`), into
/// `<sweep>/policy-capacity-virtual/policy-capacity.{md,json}`, and printed. The cells above run
/// every policy at one rate per point; this says what rate each sustains on its own. Virtual,
/// and so labelled: the live searches per policy take far longer than the job (issue #35). On
/// the quick grid it took 12 s (4 Dec 2026). Skipped for a fleet the simulator does not model
/// (anything but the emulator behind one router) and for sweeps without load points.
fn policy_capacity(
    args: &SweepArgs,
    settings: &SweepSettings,
    sweep_dir: &std::path::Path,
) -> Result<()> {
    if virtual_sweep::check(settings).is_err() || !settings.needs_capacity() {
        return Ok(());
    }
    let judged = SweepSettings {
        live_calibration: Some(args.calibration.clone()),
        ..settings.clone()
    };
    let dir = sweep_dir.join("policy-capacity-virtual");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let started = Instant::now();
    let report = experiment::policy_capacity::run_virtual(
        &judged,
        &dir,
        POLICY_CAPACITY_SEEDS,
        &experiment::policy_capacity::Variants::default(),
        &interrupt::requested,
    )?;
    println!("{}", analysis::capacity::markdown(&report));
    eprintln!(
        "xtask: each policy's own capacity (virtual, judged by this run's calibration, {POLICY_CAPACITY_SEEDS} plan seeds) in {:.0} s: {}",
        started.elapsed().as_secs_f64(),
        dir.join("policy-capacity.md").display()
    );
    Ok(())
}
