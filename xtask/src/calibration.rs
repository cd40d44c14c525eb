//! `cargo xtask calibrate`: flags → `experiment::calibrate::CalibrateSettings`; the procedure
//! (floors, KV capacity, outliers, the reference load, phases with an ETA, then the fleet's
//! capacity) is `experiment::calibrate` and `experiment::capacity`, the record and its rules
//! `experiment::calibration`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use experiment::Bins;
use experiment::calibrate::{self, CalibrateSettings};
use experiment::calibration::Calibration;
use experiment::capacity::CapacitySettings;

use crate::fleetargs::FleetArgs;
use crate::{env, interrupt};

/// Flags of `cargo xtask calibrate`.
#[derive(Debug, Clone, Args)]
pub struct CalibrateArgs {
    /// The fleet.
    #[command(flatten)]
    pub fleet: FleetArgs,
    /// Where calibration.json goes.
    #[arg(long, default_value = "measurements/calibration.json")]
    pub out: PathBuf,
    /// Smaller fleet and shorter runs (what `sweep --quick` uses).
    #[arg(long)]
    pub quick: bool,
    /// Keep a throttling outlier in the fleet instead of excluding it.
    #[arg(long)]
    pub include_outliers: bool,
    /// A replica whose TTFT or ITL floor exceeds the median of its peers by this factor is an
    /// outlier.
    #[arg(long, default_value_t = 1.3)]
    pub outlier_factor: f64,
    /// Unseen-prompt requests per replica for the floors (default 30, or 12 with --quick).
    #[arg(long)]
    pub requests: Option<u32>,
    /// Closed-loop users of the reference load.
    #[arg(long, default_value_t = 32)]
    pub users: u32,
    /// Mean think time of the reference load, s of model time (wall = think ÷ speed).
    #[arg(long, default_value_t = 1.0)]
    pub think_s: f64,
    /// Warm-up of the reference run, wall s (default 20, or 5 with --quick).
    #[arg(long)]
    pub warmup_s: Option<f64>,
    /// Measured window of the reference run, wall s (default 40, or 8 with --quick).
    #[arg(long)]
    pub measure_s: Option<f64>,
    /// Use the binaries already in target/release.
    #[arg(long)]
    pub no_build: bool,
    /// Workload seed.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Skip the capacity search (sweeps with `--load` then refuse this calibration).
    #[arg(long)]
    pub no_capacity: bool,
    /// Policies whose best decides the capacity, comma-separated (default:
    /// session-affinity,prefix-affinity).
    #[arg(long, value_delimiter = ',')]
    pub capacity_policies: Vec<String>,
    /// First rate of the capacity search, req/s of model time (default: the reference run's
    /// throughput).
    #[arg(long)]
    pub capacity_start_rps: Option<f64>,
    /// Relative resolution of the capacity search's bisection (default 0.05, or 0.15 with
    /// --quick).
    #[arg(long)]
    pub capacity_resolution: Option<f64>,
    /// Engine-lateness bound of a capacity step, as a share of the ITL floor in model time
    /// (the cells' rule; the wall bound is that ÷ speed).
    #[arg(long, default_value_t = experiment::calibration::LATENESS_SHARE_OF_ITL_FLOOR)]
    pub lateness_share_of_itl_floor: f64,
}

impl CalibrateArgs {
    /// The settings these flags ask for.
    pub fn settings(&self) -> CalibrateSettings {
        let defaults = CalibrateSettings::defaults(
            self.fleet.spec(self.quick),
            self.out.clone(),
            self.quick,
            self.seed,
            env::git_rev(),
            env::versions(),
        );
        CalibrateSettings {
            include_outliers: self.include_outliers,
            outlier_factor: self.outlier_factor,
            requests_per_replica: self.requests.unwrap_or(defaults.requests_per_replica),
            users: self.users,
            think_model_s: self.think_s,
            warmup_s: self.warmup_s.unwrap_or(defaults.warmup_s),
            measure_s: self.measure_s.unwrap_or(defaults.measure_s),
            capacity: (!self.no_capacity).then(|| {
                let d = CapacitySettings::defaults(self.quick);
                CapacitySettings {
                    policies: if self.capacity_policies.is_empty() {
                        d.policies.clone()
                    } else {
                        self.capacity_policies.clone()
                    },
                    start_rps: self.capacity_start_rps,
                    resolution: self.capacity_resolution.unwrap_or(d.resolution),
                    lateness_share_of_itl_floor: self.lateness_share_of_itl_floor,
                    ..d
                }
            }),
            ..defaults
        }
    }
}

/// Runs the whole calibration and writes it to `args.out`.
pub fn calibrate(args: &CalibrateArgs, bins: &Bins) -> Result<Calibration> {
    calibrate::calibrate(&args.settings(), bins, &interrupt::requested)
}
