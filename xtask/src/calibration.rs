//! `cargo xtask calibrate`: measures floors, KV capacity and the reference load on the fleet;
//! `experiment::calibration` derives the SLO, outliers, index TTL and node cap from them and
//! defines `calibration.json`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Result, anyhow, bail};
use clap::Args;

use analysis::Slo;
use experiment::calibration::{self, IndexCalibration, ReplicaCalibration, SLO_FACTOR};
use fleet::evidence::{EvidenceConfig, EvidenceSampler};
use fleet::{DriverSettings, Fleet, RouterSettings, http, metrics};
use workload::{ArrivalSpec, Sizing, WorkloadSpec};

pub use experiment::calibration::Calibration;

use crate::cell::{self, Meta};
use crate::env::Bins;
use crate::fleetargs::FleetArgs;
use crate::interrupt;
use crate::run::{self, Attempt};

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
}

impl CalibrateArgs {
    fn warmup(&self) -> f64 {
        self.warmup_s
            .unwrap_or_else(|| crate::fleetargs::default_warmup_s(self.quick))
    }
    fn measure(&self) -> f64 {
        self.measure_s
            .unwrap_or_else(|| crate::fleetargs::default_measure_s(self.quick))
    }
}

/// Runs the whole calibration and writes it to `args.out`.
pub fn calibrate(args: &CalibrateArgs, bins: &Bins) -> Result<Calibration> {
    let out_dir = args
        .out
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    // One scratch directory per calibration file, so that calibrating another fleet into another
    // file never meets this one's plans and rows (`calibration.json` → `calibration-runs/`).
    let stem = args
        .out
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "calibration".into());
    let work = out_dir.join(format!("{stem}-runs"));
    let speed = args.fleet.effective_speed();
    eprintln!(
        "xtask calibrate: {} fleet of {} replica(s), speed {speed}",
        args.fleet.key(args.quick).source,
        args.fleet.replica_count(args.quick)
    );

    // 1. Floors, straight at each replica, concurrency 1, unseen prompts.
    let source = args.fleet.source(&bins.engine, args.quick, false, None)?;
    let mut fleet = Fleet::new(source, args.fleet.options(&work.join("logs")))?;
    fleet.start(&interrupt::requested)?;
    let sampler = EvidenceSampler::start(
        EvidenceConfig {
            lateness_urls: vec![],
            fleet_process_groups: fleet.process_groups(),
            check_foreign: !matches!(args.fleet.fleet, crate::fleetargs::FleetKind::Static),
            gpu: true,
            interval: Duration::from_secs(1),
            fleet_gpus: fleet.gpus(),
        },
        &{
            std::fs::create_dir_all(&work)?;
            work.join("floors-evidence.jsonl")
        },
    )?;
    let requests = args.requests.unwrap_or(if args.quick { 12 } else { 30 });
    let mut replicas = Vec::new();
    for info in fleet.replicas() {
        if interrupt::requested() {
            bail!("interrupted");
        }
        let dir = work.join(format!("floors/replica-{}", info.index));
        cell::clear(&dir)?;
        let spec = WorkloadSpec {
            seed: args.seed + 1000 + info.index as u64,
            // Many more conversations than requests, so that prompts are (almost all) unseen;
            // the few repeats are filtered out by their cached tokens.
            sizing: Sizing::Conversations(requests * 8),
            turns: 1,
            ..WorkloadSpec::default()
        };
        let arrival = ArrivalSpec::Closed {
            users: 1,
            think_mean_s: 0.0,
            requests_per_user: requests,
        };
        let plan = run::ensure_plan(&dir, &spec, &arrival)?;
        let mut driver = fleet::start_driver(
            &bins.driver,
            &info.url,
            &plan.path,
            &dir.join("client.csv"),
            &DriverSettings {
                mode: "closed",
                warmup_s: 0.0,
                duration_s: None,
                timeout_s: 120.0,
                model: args.fleet.model.clone(),
            },
            &dir.join("driver.log"),
        )?;
        fleet::wait_driver(
            &mut driver,
            &mut fleet,
            Duration::from_secs(600),
            &interrupt::requested,
            |_| Ok(()),
        )?;
        let rows = analysis::read_client_csv(&dir.join("client.csv"))
            .map_err(|e| anyhow!("reading calibration rows: {e}"))?;
        let unseen: Vec<&analysis::ClientRow> = rows
            .iter()
            .filter(|r| r.error.is_none() && (200..300).contains(&r.status))
            .filter(|r| r.cached_tokens.unwrap_or(0) == 0)
            .collect();
        let ttft: Vec<f64> = unseen.iter().filter_map(|r| r.ttft_ms).collect();
        let itl: Vec<f64> = unseen.iter().filter_map(|r| r.itl_p50_ms).collect();
        let (Some(ttft_p50_ms), Some(itl_p50_ms)) = (
            analysis::stats::median(&ttft),
            analysis::stats::median(&itl),
        ) else {
            bail!(
                "replica {} answered no successful unseen request ({} rows); see {}",
                info.index,
                rows.len(),
                dir.join("driver.log").display()
            );
        };
        let cache = http::get(&http::join(&info.url, "/metrics"), Duration::from_secs(5))
            .ok()
            .and_then(|r| metrics::cache_config(&r.text()));
        eprintln!(
            "  replica {}: TTFT p50 {ttft_p50_ms:.1} ms, ITL p50 {itl_p50_ms:.2} ms over {} unseen requests; KV {}",
            info.index,
            ttft.len(),
            cache.map_or_else(
                || "unknown".to_string(),
                |c| format!("{} tokens", c.capacity_tokens())
            )
        );
        replicas.push(ReplicaCalibration {
            index: info.index,
            url: info.url.clone(),
            slowdown: info.slowdown,
            ttft_p50_ms,
            itl_p50_ms,
            requests_used: ttft.len(),
            cache,
            outlier_ratio: None,
            gpu_throttle_share: None,
            outlier_reason: None,
        });
    }
    let gpu_evidence = sampler.finish()?;
    fleet.stop();

    // 2. Outliers.
    calibration::find_outliers(&mut replicas, args.outlier_factor);
    if matches!(args.fleet.fleet, crate::fleetargs::FleetKind::Command) {
        let gpu_ids = args.fleet.gpus.clone();
        calibration::find_throttle_outliers(&mut replicas, &gpu_evidence.gpus, |i| {
            gpu_ids
                .get(i)
                .map_or(Some(i as u32), |g| g.trim().parse().ok())
        });
    }
    let used = calibration::replicas_in_use(&replicas, args.include_outliers);
    for r in replicas.iter().filter(|r| r.outlier_reason.is_some()) {
        eprintln!(
            "  replica {}: {} — {}",
            r.index,
            r.outlier_reason.as_deref().unwrap_or(""),
            if used.contains(&r.index) {
                "kept (--include-outliers)"
            } else {
                "excluded"
            }
        );
    }
    let floors =
        calibration::floors(&replicas, &used).ok_or_else(|| anyhow!("no replica floors"))?;
    let slo = calibration::slo_from_floors(floors);
    let capacity_tokens = calibration::capacity_tokens(&replicas, &used);
    if capacity_tokens == 0 {
        bail!("no replica reported vllm:cache_config_info on /metrics; the KV capacity is unknown");
    }
    eprintln!(
        "  floors TTFT {:.1} ms, ITL {:.2} ms → SLO TTFT < {:.1} ms, ITL p50 < {:.2} ms; fleet KV capacity {capacity_tokens} tokens",
        floors.ttft_ms, floors.itl_ms, slo.ttft_ms, slo.itl_ms
    );

    // 3. Reference load through the router with prefix-affinity: eviction TTL and node cap.
    let (index, reference_run) = reference_run(
        args,
        bins,
        &work,
        &used,
        slo,
        floors,
        capacity_tokens,
        speed,
    )?;
    let calibration = Calibration {
        fleet: args.fleet.key(args.quick),
        replicas,
        used_replicas: used,
        floors,
        slo_factor: SLO_FACTOR,
        slo,
        capacity_tokens,
        index,
        gpus: gpu_evidence.gpus.clone(),
        gpu_status: match &gpu_evidence.gpu_reason {
            Some(reason) => format!("{}: {reason}", gpu_evidence.gpu_status),
            None => gpu_evidence.gpu_status.clone(),
        },
        reference_run: Some(reference_run),
        git_rev: crate::env::git_rev(),
        versions: crate::env::versions(),
    };
    calibration.write(&args.out)?;
    eprintln!("xtask calibrate: wrote {}", args.out.display());
    Ok(calibration)
}

#[allow(clippy::too_many_arguments)]
fn reference_run(
    args: &CalibrateArgs,
    bins: &Bins,
    work: &Path,
    used: &[usize],
    slo: Slo,
    floors: Slo,
    capacity_tokens: u64,
    speed: f64,
) -> Result<(IndexCalibration, PathBuf)> {
    let policy = "prefix-affinity";
    let point = "ws1-s0";
    let source = args
        .fleet
        .source(&bins.engine, args.quick, false, Some(used))?;
    let mut fleet = Fleet::new(source, args.fleet.options(&work.join("logs")))?;
    let sweep_dir = work.join("reference");
    // A calibration always measures afresh: the previous reference run (and its plan, which may
    // have been made for another fleet or plan format) belongs to the calibration being replaced.
    cell::clear(&sweep_dir)?;
    let dir = sweep_dir.join(point).join(policy).join("rep-1");
    let think_wall_s = args.think_s / speed;
    let run_s = args.warmup() + args.measure();
    let spec = WorkloadSpec {
        seed: args.seed,
        sizing: Sizing::WorkingSet {
            capacity_tokens,
            ratio: 1.0,
        },
        ..WorkloadSpec::default()
    };
    let arrival = ArrivalSpec::Closed {
        users: args.users,
        think_mean_s: think_wall_s,
        requests_per_user: calibration::requests_per_user(
            run_s,
            think_wall_s,
            floors,
            spec.output_tokens,
        ),
    };
    let plan = run::ensure_plan(&sweep_dir.join(point), &spec, &arrival)?;
    cell::clear(&dir)?;
    // The attempt and `meta.json` take this crate's `Slo` (the same type once one schema crate
    // defines it).
    let cell_slo = cell::Slo {
        ttft_ms: slo.ttft_ms,
        itl_ms: slo.itl_ms,
    };
    eprintln!(
        "  reference load: {} users, ws 1, skew 0, {policy}, {:.0} s warm-up + {:.0} s",
        args.users,
        args.warmup(),
        args.measure()
    );
    let result = run::run_attempt(
        &mut fleet,
        Attempt {
            bins,
            dir: &dir,
            plan: &plan,
            router: RouterSettings {
                policy: policy.into(),
                model: args.fleet.model.clone(),
                seed: args.seed,
                ..RouterSettings::default()
            },
            driver: DriverSettings {
                mode: "closed",
                warmup_s: args.warmup(),
                duration_s: Some(run_s),
                timeout_s: 120.0,
                model: args.fleet.model.clone(),
            },
            closed_users: Some(args.users as usize),
            planned_end_s: run_s,
            slo: cell_slo,
            evidence: EvidenceConfig {
                lateness_urls: vec![],
                fleet_process_groups: vec![],
                check_foreign: false,
                gpu: false,
                interval: Duration::from_secs(1),
                fleet_gpus: Default::default(),
            },
            sample_lateness: matches!(args.fleet.fleet, crate::fleetargs::FleetKind::Emulated),
            ingress: fleet::Ingress::Router,
            haproxy: fleet::ingress::HaproxySettings::default(),
            limit: Duration::from_secs_f64(run_s * 3.0 + 60.0),
        },
    )?;
    fleet.stop();
    let meta = Meta {
        sweep: "calibration-reference".into(),
        point: point.into(),
        policy: policy.into(),
        rep: 1,
        workload_name: plan.workload_name.clone(),
        workload_fingerprint: plan.workload_fingerprint.clone(),
        plan_fingerprint: plan.plan_fingerprint.clone(),
        fleet: serde_json::json!({"source": args.fleet.key(args.quick).source, "replicas": used.len(), "speed": speed, "capacity_tokens": capacity_tokens}),
        slo: cell_slo,
        window: result.window,
        git_rev: crate::env::git_rev(),
        versions: crate::env::versions(),
        virtual_time: false,
        complete: true,
        accepted: true,
        set_aside_reason: None,
        attempts: 1,
        evidence: serde_json::to_value(&result.evidence)?,
        drift: serde_json::Value::Null,
        run: serde_json::json!({"users": args.users, "think_wall_s": think_wall_s}),
    };
    cell::write_meta(&dir, &meta)?;
    let rep = match analysis::load::load_rep(&dir, point, policy, 1)
        .map_err(|e| anyhow!("loading the reference run: {e}"))?
    {
        analysis::load::RepLoad::Complete(rep) => rep,
        analysis::load::RepLoad::Incomplete(why) => bail!("the reference run is incomplete: {why}"),
    };
    let index = calibration::index_from_reference(&rep, &slo, capacity_tokens, speed);
    eprintln!(
        "  index: TTL {} s{}, node cap {}, honoured share {}",
        index
            .ttl_s
            .map_or_else(|| "unknown".into(), |t| format!("{t:.2}")),
        if index.ttl_is_lower_bound {
            " (lower bound)"
        } else {
            ""
        },
        index
            .node_cap
            .map_or_else(|| "unknown".into(), |c| c.to_string()),
        index
            .honoured_share
            .map_or_else(|| "unknown".into(), |h| format!("{h:.2}")),
    );
    Ok((index, dir))
}
