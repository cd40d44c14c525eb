//! `cargo xtask fault kill|drain` (docs/ARCHITECTURE.md, "Faults"): flags → `experiment::fault::FaultSettings`,
//! then the loop over repetitions × policies (finished ones skipped, progress with an ETA), each
//! run by `experiment::fault::FaultRun::run_rep` through the sweep's evidence and drift gates;
//! then the summary, failing when a loss bound broke. The procedure is `experiment::fault`; what the rows show is `analysis::fault`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};

use analysis::fault::FaultKind;
use experiment::Bins;
use experiment::cell::{self, CellState};
use experiment::fault::{FaultRun, FaultSettings, default_phases_s};
use experiment::progress::Progress;
use experiment::sweep::IngressFlag;
use schema::Slo;

use crate::fleetargs::FleetArgs;
use crate::{env, interrupt};

/// Which fault, as the command line names it (`analysis::fault::FaultKind` for the rest; clap's
/// derive needs a type of this crate).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KindArg {
    /// SIGKILL mid-request, no warning.
    Kill,
    /// Drain through the router's admin API, then stop.
    Drain,
}

impl From<KindArg> for FaultKind {
    fn from(k: KindArg) -> FaultKind {
        match k {
            KindArg::Kill => FaultKind::Kill,
            KindArg::Drain => FaultKind::Drain,
        }
    }
}

/// Flags of `cargo xtask fault`.
#[derive(Debug, Clone, Args)]
pub struct FaultArgs {
    /// Which fault.
    #[arg(value_enum)]
    pub kind: KindArg,
    /// What sits in front of the fleet: `router`, or `envoy-epp` (cells `envoy-epp-<policy>`).
    #[arg(long, value_enum, default_value_t = IngressFlag::Router)]
    pub ingress: IngressFlag,
    /// Small fleet and short phases (3 replicas by default).
    #[arg(long)]
    pub quick: bool,
    /// Repetitions per policy (the timeline takes the median per second).
    #[arg(long, default_value_t = 1)]
    pub reps: u32,
    /// Policies to fault, comma-separated (default: session-affinity, prefix-affinity,
    /// prefix-affinity-spill-off).
    #[arg(long, value_delimiter = ',')]
    pub policies: Vec<String>,
    /// Open-loop rate, requests per second of model time (wall rate = rate × speed). Default:
    /// 0.8 × replicas, the middle of the `load` sweep.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Fleet index of the replica to fault (= its router id).
    #[arg(long, default_value_t = 0)]
    pub victim: usize,
    /// Warm-up, wall s (default 10, or 3 with --quick).
    #[arg(long)]
    pub warmup_s: Option<f64>,
    /// Steady load after the warm-up and before the fault, wall s (default 30, or 10 with --quick).
    #[arg(long)]
    pub before_s: Option<f64>,
    /// How long the replica stays down, s of model time (wall = ÷ speed).
    #[arg(long, default_value_t = 60.0)]
    pub outage_model_s: f64,
    /// Load kept running after the planned restart, wall s (default 60, or 20 with --quick).
    #[arg(long)]
    pub after_s: Option<f64>,
    /// How long to wait for the victim to have a request in flight before faulting it, wall s.
    #[arg(long, default_value_t = 10.0)]
    pub inflight_wait_s: f64,
    /// Root of the measurements.
    #[arg(long, default_value = "measurements")]
    pub out: PathBuf,
    /// Directory name (default `fault-<kind>`, `-quick` appended with --quick).
    #[arg(long)]
    pub sweep_dir_name: Option<String>,
    /// Calibration to use (run first when missing or made for another fleet), unless the SLO is
    /// given with --slo-ttft-ms/--slo-itl-ms.
    #[arg(long, default_value = "measurements/calibration.json")]
    pub calibration: PathBuf,
    /// Recalibrate even when the calibration matches.
    #[arg(long)]
    pub recalibrate: bool,
    /// Skip calibration: TTFT bound of the SLO, ms (the KV capacity is read from the replicas).
    #[arg(long, requires = "slo_itl_ms")]
    pub slo_ttft_ms: Option<f64>,
    /// Skip calibration: per-request ITL p50 bound of the SLO, ms.
    #[arg(long, requires = "slo_ttft_ms")]
    pub slo_itl_ms: Option<f64>,
    /// Delete the directory first instead of resuming it.
    #[arg(long)]
    pub fresh: bool,
    /// Per-request timeout, wall s.
    #[arg(long, default_value_t = 60.0)]
    pub request_timeout_s: f64,
    /// Seconds between evidence samples.
    #[arg(long, default_value_t = 1.0)]
    pub evidence_interval_s: f64,
    /// Engine-lateness bound as a share of the ITL floor in model time (the sweep's bound;
    /// the wall bound is that ÷ speed).
    #[arg(long, default_value_t = experiment::calibration::LATENESS_SHARE_OF_ITL_FLOOR)]
    pub lateness_share_of_itl_floor: f64,
    /// Re-runs of a repetition whose evidence fails before it is set aside.
    #[arg(long, default_value_t = 2)]
    pub evidence_retries: u32,
    /// Workload seed.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Use the binaries already in target/release.
    #[arg(long)]
    pub no_build: bool,
    /// The fleet.
    #[command(flatten)]
    pub fleet: FleetArgs,
}

impl FaultArgs {
    /// The settings these flags ask for.
    pub fn settings(&self) -> FaultSettings {
        let (warmup_s, before_s, after_s) = default_phases_s(self.quick);
        FaultSettings {
            kind: self.kind.into(),
            quick: self.quick,
            reps: self.reps,
            policies: self.policies.clone(),
            rate_model_rps: self.rate,
            victim: self.victim,
            warmup_s: self.warmup_s.unwrap_or(warmup_s),
            before_s: self.before_s.unwrap_or(before_s),
            outage_model_s: self.outage_model_s,
            after_s: self.after_s.unwrap_or(after_s),
            inflight_wait_s: self.inflight_wait_s,
            calibration: self.calibration.clone(),
            recalibrate: self.recalibrate,
            slo: match (self.slo_ttft_ms, self.slo_itl_ms) {
                (Some(ttft_ms), Some(itl_ms)) => Some(Slo { ttft_ms, itl_ms }),
                _ => None,
            },
            request_timeout_s: self.request_timeout_s,
            evidence_interval_s: self.evidence_interval_s,
            lateness_share_of_itl_floor: self.lateness_share_of_itl_floor,
            evidence_retries: self.evidence_retries,
            seed: self.seed,
            fleet: self.fleet.spec(self.quick),
            git_rev: env::git_rev(),
            versions: env::versions(),
            ingress: self.ingress.into(),
        }
    }

    /// The fault run's directory.
    pub fn dir(&self) -> PathBuf {
        let kind = FaultKind::from(self.kind);
        let default = || experiment::fault::default_dir_name(kind, self.quick);
        self.out
            .join(self.sweep_dir_name.clone().unwrap_or_else(default))
    }
}

/// Runs the fault experiment, writes the timeline and summary; fails when a loss bound broke.
/// Returns the directory.
pub fn fault(args: &FaultArgs, bins: &Bins) -> Result<PathBuf> {
    let s = args.settings();
    s.check()?;
    let dir = args.dir();
    if args.fresh && dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir)?;
    let mut run = FaultRun::start(&s, bins, &dir, &interrupt::requested)?;
    let policies = run.policies.clone();
    let speed = s.fleet.effective_speed();
    eprintln!(
        "xtask fault {}: {} policies × {} reps into {} ({} replicas, victim {}, {} req/s model = {:.1} req/s wall, outage {:.1} s wall, SLO TTFT < {:.1} ms, ITL p50 < {:.2} ms)",
        s.kind.as_str(),
        policies.len(),
        s.reps,
        dir.display(),
        run.setup.used_replicas.len(),
        s.victim,
        run.rate_model_rps,
        run.rate_model_rps * speed,
        s.outage_wall_s(),
        run.setup.slo.ttft_ms,
        run.setup.slo.itl_ms,
    );
    // Each repetition also cycles the fleet, starts the router and waits out the driver.
    let mut progress = Progress::new(
        policies.len() * s.reps as usize,
        Duration::from_secs_f64(s.run_s() + 5.0),
    );
    for rep in 1..=s.reps {
        for policy in &policies {
            if interrupt::requested() {
                bail!(
                    "interrupted; completed repetitions are kept, rerun the same command to resume"
                );
            }
            let rep_dir = cell::rep_dir(&dir, &run.point, policy, rep);
            if CellState::of(&rep_dir).is_done() {
                progress.skipped();
                continue;
            }
            cell::clear(&rep_dir)?;
            let started = Instant::now();
            match run.run_rep(policy, rep, &rep_dir, &interrupt::requested) {
                Ok(line) => {
                    progress.ran(started.elapsed());
                    eprintln!("{}", progress.line(&format!("{policy} rep-{rep}: {line}")));
                }
                Err(e) => {
                    // No half repetition may look whole: it has no meta, and it goes.
                    let _ = std::fs::remove_dir_all(&rep_dir);
                    run.stop();
                    return Err(e.context(format!("fault {policy} rep-{rep}")));
                }
            }
        }
    }
    let summary = run.finish(&dir)?;
    println!("{}", analysis::fault::markdown(&summary));
    if !summary.violations.is_empty() {
        bail!(
            "the loss bounds broke ({} violations; see {}):\n  {}",
            summary.violations.len(),
            dir.join("summary.md").display(),
            summary.violations.join("\n  ")
        );
    }
    Ok(dir)
}
