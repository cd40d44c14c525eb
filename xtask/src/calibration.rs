//! `cargo xtask calibrate`: floors → SLO, KV capacity, index TTL and node cap, outliers.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use serde::{Deserialize, Serialize};

use fleet::evidence::{EvidenceConfig, EvidenceSampler, GpuSummary};
use fleet::{DriverSettings, Fleet, RouterSettings, http, metrics};
use workload::{ArrivalSpec, Sizing, WorkloadSpec};

use crate::cell::{self, Meta, Slo};
use crate::env::Bins;
use crate::fleetargs::{FleetArgs, FleetKey};
use crate::interrupt;
use crate::run::{self, Attempt};

/// SLO = this many times the floor (DESIGN.md §3.9).
pub const SLO_FACTOR: f64 = 3.0;

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

/// One replica's calibration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplicaCalibration {
    /// Index in the fleet as given (before exclusions).
    pub index: usize,
    /// Base URL during calibration.
    pub url: String,
    /// Emulated slowdown (1 for real engines).
    pub slowdown: f64,
    /// TTFT p50 of unseen prompts at concurrency 1, ms (wall).
    pub ttft_p50_ms: f64,
    /// Per-request ITL p50, median over requests, ms (wall).
    pub itl_p50_ms: f64,
    /// Requests the floors rest on (successful, nothing cached).
    pub requests_used: usize,
    /// From `vllm:cache_config_info`.
    pub cache: Option<metrics::CacheConfig>,
    /// Largest of TTFT and ITL floor ÷ the median of the other replicas.
    pub outlier_ratio: Option<f64>,
    /// Share of GPU samples with a throttle reason during the floors (command fleets with NVML).
    #[serde(default)]
    pub gpu_throttle_share: Option<f64>,
    /// Set when the replica is excluded (or would be, with --include-outliers).
    pub outlier_reason: Option<String>,
}

/// The index settings implied by the reference load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IndexCalibration {
    /// Index TTL, wall s (at the calibration speed); `None` when nothing was observed.
    pub ttl_s: Option<f64>,
    /// True when no band fell below the honour threshold: the TTL is at least `ttl_s`.
    pub ttl_is_lower_bound: bool,
    /// Node cap from the capacity model scaled by the honoured share.
    pub node_cap: Option<u64>,
    /// Share of predicted tokens the engines honoured.
    pub honoured_share: Option<f64>,
    /// The analysis's full output (bands, counts).
    pub detail: serde_json::Value,
}

/// `calibration.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// The fleet this calibration is valid for (before exclusions).
    pub fleet: FleetKey,
    /// Per replica, in fleet order.
    pub replicas: Vec<ReplicaCalibration>,
    /// Replicas the sweeps use.
    pub used_replicas: Vec<usize>,
    /// Median floors over the used replicas, ms (wall).
    pub floors: Slo,
    /// `SLO_FACTOR`.
    pub slo_factor: f64,
    /// SLO = factor × floors, ms (wall).
    pub slo: Slo,
    /// Σ capacity of the used replicas, tokens.
    pub capacity_tokens: u64,
    /// Index TTL and node cap.
    pub index: IndexCalibration,
    /// GPU evidence during the floors (empty without NVML).
    pub gpus: Vec<GpuSummary>,
    /// `"ok"` or `"no GPU"` and why.
    pub gpu_status: String,
    /// Where the reference run's rows are.
    pub reference_run: Option<PathBuf>,
    /// Git revision.
    pub git_rev: Option<String>,
    /// Versions.
    pub versions: serde_json::Value,
}

impl Calibration {
    /// Reads a calibration.json.
    pub fn read(path: &Path) -> Result<Calibration> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    /// Writes it atomically.
    pub fn write(&self, path: &Path) -> Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        cell::write_atomic(path, serde_json::to_string_pretty(self)?.as_bytes())
    }
}

/// Median of `values` (through the analysis crate, the one place statistics live).
fn median(values: &[f64]) -> Option<f64> {
    analysis::stats::median(values)
}

/// Marks replicas whose floors exceed their peers' median by `factor`.
pub fn find_outliers(replicas: &mut [ReplicaCalibration], factor: f64) {
    let n = replicas.len();
    if n < 3 {
        // With two replicas there is no majority to call one of them the odd one out.
        return;
    }
    for i in 0..n {
        let others = |f: fn(&ReplicaCalibration) -> f64| -> Vec<f64> {
            replicas
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, r)| f(r))
                .collect()
        };
        let ttft_peers = median(&others(|r| r.ttft_p50_ms));
        let itl_peers = median(&others(|r| r.itl_p50_ms));
        let (Some(tp), Some(ip)) = (ttft_peers, itl_peers) else {
            continue;
        };
        let r = &mut replicas[i];
        let ratio = (r.ttft_p50_ms / tp).max(r.itl_p50_ms / ip);
        r.outlier_ratio = Some(ratio);
        if ratio > factor {
            r.outlier_reason = Some(format!(
                "throttling outlier: floors TTFT {:.1} ms / ITL {:.2} ms vs peers' median {:.1} / {:.2} ms ({ratio:.2}× > {factor}×)",
                r.ttft_p50_ms, r.itl_p50_ms, tp, ip
            ));
        }
    }
}

/// Share of throttled samples above the peers' median that makes a card an outlier (the
/// reference fleet's throttling card: 67% of samples, the others 0–34%).
pub const THROTTLE_SHARE_MARGIN: f64 = 0.3;

/// Marks replicas whose card throttled far more often than its peers' cards did.
/// `gpu_of(i)` is the NVML device of replica i, when known.
pub fn find_throttle_outliers(
    replicas: &mut [ReplicaCalibration],
    gpus: &[GpuSummary],
    gpu_of: impl Fn(usize) -> Option<u32>,
) {
    for r in replicas.iter_mut() {
        r.gpu_throttle_share = gpu_of(r.index)
            .and_then(|d| gpus.iter().find(|g| g.device == d))
            .map(|g| g.throttle_share);
    }
    if replicas.len() < 3 {
        return;
    }
    for i in 0..replicas.len() {
        let Some(share) = replicas[i].gpu_throttle_share else {
            continue;
        };
        let peers: Vec<f64> = replicas
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .filter_map(|(_, r)| r.gpu_throttle_share)
            .collect();
        let Some(m) = median(&peers) else { continue };
        if share - m > THROTTLE_SHARE_MARGIN && replicas[i].outlier_reason.is_none() {
            replicas[i].outlier_reason = Some(format!(
                "throttling outlier: GPU throttled on {:.0}% of samples vs peers' median {:.0}%",
                share * 100.0,
                m * 100.0
            ));
        }
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
        let (Some(ttft_p50_ms), Some(itl_p50_ms)) = (median(&ttft), median(&itl)) else {
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
    find_outliers(&mut replicas, args.outlier_factor);
    if matches!(args.fleet.fleet, crate::fleetargs::FleetKind::Command) {
        let gpu_ids = args.fleet.gpus.clone();
        find_throttle_outliers(&mut replicas, &gpu_evidence.gpus, |i| {
            gpu_ids
                .get(i)
                .map_or(Some(i as u32), |g| g.trim().parse().ok())
        });
    }
    let mut used: Vec<usize> = replicas
        .iter()
        .filter(|r| args.include_outliers || r.outlier_reason.is_none())
        .map(|r| r.index)
        .collect();
    if used.is_empty() {
        used = replicas.iter().map(|r| r.index).collect();
    }
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
    let used_reps: Vec<&ReplicaCalibration> = replicas
        .iter()
        .filter(|r| used.contains(&r.index))
        .collect();
    let floors = Slo {
        ttft_ms: median(&used_reps.iter().map(|r| r.ttft_p50_ms).collect::<Vec<_>>())
            .ok_or_else(|| anyhow!("no replica floors"))?,
        itl_ms: median(&used_reps.iter().map(|r| r.itl_p50_ms).collect::<Vec<_>>())
            .ok_or_else(|| anyhow!("no replica floors"))?,
    };
    // Microsecond precision is all a millisecond bound can use; rounding keeps the recorded
    // SLO free of binary-fraction noise (207.78150000000002).
    let round_us = |ms: f64| (ms * 1e3).round() / 1e3;
    let slo = Slo {
        ttft_ms: round_us(floors.ttft_ms * SLO_FACTOR),
        itl_ms: round_us(floors.itl_ms * SLO_FACTOR),
    };
    let capacity_tokens: u64 = used_reps
        .iter()
        .map(|r| r.cache.map_or(0, |c| c.capacity_tokens()))
        .sum();
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

/// Requests per closed-loop user so that a run of `run_s` wall seconds never runs dry: twice
/// the estimate from the floors (the driver's `--duration-s` ends the run on time).
pub fn requests_per_user(run_s: f64, think_wall_s: f64, floors: Slo, output_tokens: u32) -> u32 {
    let service_s = (floors.ttft_ms + f64::from(output_tokens) * floors.itl_ms) / 1e3;
    let cycle_s = (think_wall_s + service_s).max(1e-3);
    ((2.0 * run_s / cycle_s).ceil() as u32).clamp(4, 100_000)
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
        requests_per_user: requests_per_user(run_s, think_wall_s, floors, spec.output_tokens),
    };
    let plan = run::ensure_plan(&sweep_dir.join(point), &spec, &arrival)?;
    cell::clear(&dir)?;
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
            slo,
            evidence: EvidenceConfig {
                lateness_urls: vec![],
                fleet_process_groups: vec![],
                check_foreign: false,
                gpu: false,
                interval: Duration::from_secs(1),
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
        slo,
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
    let analysis_slo = analysis::Slo {
        ttft_ms: slo.ttft_ms,
        itl_ms: slo.itl_ms,
    };
    let requests = analysis::metrics::measured_requests(&rep, &analysis_slo);
    // Decay bands in wall seconds at this speed, so that they cover the same model-time gaps.
    let mut cfg = analysis::MetricsConfig::default();
    cfg.decay_edges_s = cfg.decay_edges_s.iter().map(|e| e / speed).collect();
    let decay = analysis::metrics::decay(&requests, &cfg.decay_edges_s);
    let implied = analysis::metrics::implied(&decay, Some(capacity_tokens), &cfg);
    eprintln!(
        "  index: TTL {} s{}, node cap {}, honoured share {}",
        implied
            .ttl_s
            .map_or_else(|| "unknown".into(), |t| format!("{t:.2}")),
        if implied.ttl_is_lower_bound {
            " (lower bound)"
        } else {
            ""
        },
        implied
            .node_cap
            .map_or_else(|| "unknown".into(), |c| c.to_string()),
        implied
            .honoured_share
            .map_or_else(|| "unknown".into(), |h| format!("{h:.2}")),
    );
    Ok((
        IndexCalibration {
            ttl_s: implied.ttl_s,
            ttl_is_lower_bound: implied.ttl_is_lower_bound,
            node_cap: implied.node_cap,
            honoured_share: implied.honoured_share,
            detail: serde_json::json!({"decay": decay, "implied": implied, "config": cfg}),
        },
        dir,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(index: usize, ttft: f64, itl: f64) -> ReplicaCalibration {
        ReplicaCalibration {
            index,
            url: String::new(),
            slowdown: 1.0,
            ttft_p50_ms: ttft,
            itl_p50_ms: itl,
            requests_used: 10,
            cache: None,
            outlier_ratio: None,
            gpu_throttle_share: None,
            outlier_reason: None,
        }
    }

    fn gpu(device: u32, throttle_share: f64) -> GpuSummary {
        GpuSummary {
            device,
            name: "card".into(),
            sm_clock_mhz_min: Some(960),
            sm_clock_mhz_max: Some(1305),
            temperature_c_max: Some(80),
            throttle_share,
            samples: 100,
        }
    }

    #[test]
    fn a_card_that_throttles_far_more_is_an_outlier() {
        let mut r: Vec<ReplicaCalibration> = (0..5).map(|i| replica(i, 55.0, 1.3)).collect();
        let gpus = [
            gpu(0, 0.0),
            gpu(1, 0.34),
            gpu(2, 0.1),
            gpu(3, 0.2),
            gpu(4, 0.67),
        ];
        find_throttle_outliers(&mut r, &gpus, |i| Some(i as u32));
        let flagged: Vec<usize> = r
            .iter()
            .filter(|r| r.outlier_reason.is_some())
            .map(|r| r.index)
            .collect();
        assert_eq!(flagged, [4]);
        assert_eq!(r[1].gpu_throttle_share, Some(0.34));
        // Without a device map nothing is known and nothing is flagged.
        let mut r: Vec<ReplicaCalibration> = (0..5).map(|i| replica(i, 55.0, 1.3)).collect();
        find_throttle_outliers(&mut r, &gpus, |_| None);
        assert!(
            r.iter()
                .all(|r| r.outlier_reason.is_none() && r.gpu_throttle_share.is_none())
        );
    }

    #[test]
    fn a_throttled_replica_is_an_outlier() {
        let mut r = vec![
            replica(0, 55.0, 1.30),
            replica(1, 54.0, 1.31),
            replica(2, 56.0, 1.29),
            replica(3, 55.5, 1.30),
            replica(4, 82.0, 1.95),
        ];
        find_outliers(&mut r, 1.3);
        let flagged: Vec<usize> = r
            .iter()
            .filter(|r| r.outlier_reason.is_some())
            .map(|r| r.index)
            .collect();
        assert_eq!(flagged, [4]);
        assert!(r[4].outlier_ratio.unwrap() > 1.4);
        assert!(r[0].outlier_ratio.unwrap() < 1.1);
    }

    #[test]
    fn two_replicas_have_no_outlier() {
        let mut r = vec![replica(0, 50.0, 1.0), replica(1, 100.0, 2.0)];
        find_outliers(&mut r, 1.3);
        assert!(r.iter().all(|r| r.outlier_reason.is_none()));
    }

    #[test]
    fn requests_per_user_covers_the_run_twice() {
        let floors = Slo {
            ttft_ms: 55.0,
            itl_ms: 1.3,
        };
        // service 0.055 + 128 × 0.0013 = 0.2214 s; cycle 0.3881 s; 2 × 13 s / 0.3881 = 67.
        assert_eq!(requests_per_user(13.0, 1.0 / 6.0, floors, 128), 67);
        assert_eq!(requests_per_user(0.0, 0.0, floors, 128), 4);
    }
}
