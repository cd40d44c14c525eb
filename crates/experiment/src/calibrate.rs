//! The calibration procedure (docs/ARCHITECTURE.md, "Calibration"): floors straight at each
//! replica, concurrency 1, on unseen prompts trimmed to exactly the reference length by the
//! replica's own `/tokenize`; KV capacity from `/metrics`; throttling outliers and the cells'
//! throttle bound; bytes per token against `/tokenize` on the reference plan's prompts; then the
//! reference load through the router → the index TTL (observed decay, else the LRU-cycle model) and
//! node cap. What it measures is recorded and judged by the rules of [`crate::calibration`]; this
//! module starts the processes and times the phases, printing each with an ETA on stderr.
//!
//! The fleet must answer vLLM's `POST /tokenize` (chat form, `{"count": …}`): without it neither
//! the floors' prompt length nor the bytes per token can be measured, and the calibration stops
//! with an error that says so rather than fall back on an estimate.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};

use fleet::evidence::{EvidenceConfig, EvidenceSampler};
use fleet::{DriverSettings, Fleet, RouterSettings, http};
use schema::engine::TokenizeShape;
use schema::{EngineKind, Meta, Slo};
use workload::{Message, Plan};

use crate::attempt::{Attempt, run_attempt};
use crate::bins::Bins;
use crate::calibration::{
    self, BytesPerToken, Calibration, DerivationRules, FloorPrompts, IndexCalibration,
    REFERENCE_PROMPT_TOKENS, ReplicaCalibration, SLO_FACTOR,
};
use crate::capacity::{self, CapacitySettings};
use crate::cell;
use crate::fleet_spec::{FleetKind, FleetSpec};
use crate::grid;
use crate::plan_file::ensure_plan;
use crate::progress::fmt_duration;

/// A replica whose TTFT or ITL floor exceeds the median of its peers by this factor is an
/// outlier.
pub const DEFAULT_OUTLIER_FACTOR: f64 = 1.3;

/// Closed-loop users of the reference load.
pub const DEFAULT_USERS: u32 = 32;

/// Mean think time of the reference load, s of model time.
pub const DEFAULT_THINK_MODEL_S: f64 = 1.0;

/// Unseen-prompt requests per replica for the floors: 30, or 12 with `--quick`.
pub fn default_requests_per_replica(quick: bool) -> u32 {
    if quick { 12 } else { 30 }
}

/// What a calibration runs with (defaults already applied).
#[derive(Debug, Clone)]
pub struct CalibrateSettings {
    /// The fleet.
    pub fleet: FleetSpec,
    /// Where `calibration.json` goes; its plans and rows go to `<stem>-runs/` beside it.
    pub out: PathBuf,
    /// Keep a throttling outlier in the fleet instead of excluding it.
    pub include_outliers: bool,
    /// Outlier factor over the peers' median floors.
    pub outlier_factor: f64,
    /// Unseen-prompt requests per replica for the floors.
    pub requests_per_replica: u32,
    /// Concurrent floor requests per replica (closed-loop users): 1, or a llama fleet's slots
    /// ([`FleetSpec::default_floor_users`]).
    pub floor_users: u32,
    /// Closed-loop users of the reference load.
    pub users: u32,
    /// Mean think time of the reference load, s of model time (wall = think ÷ speed).
    pub think_model_s: f64,
    /// Warm-up of the reference run, wall s.
    pub warmup_s: f64,
    /// Measured window of the reference run, wall s.
    pub measure_s: f64,
    /// Workload seed.
    pub seed: u64,
    /// Git revision recorded in the calibration and the reference run's meta.
    pub git_rev: Option<String>,
    /// Tool versions recorded beside it.
    pub versions: serde_json::Value,
    /// The capacity search after the reference run ([`crate::capacity`]); `None` skips it
    /// (`calibrate --no-capacity`, and the calibration a closed-loop sweep or a fault run makes
    /// for itself).
    pub capacity: Option<CapacitySettings>,
}

impl CalibrateSettings {
    /// The default calibration of `fleet` into `out` (what `calibrate` without flags does, and a
    /// sweep or fault run that has to calibrate first).
    pub fn defaults(
        fleet: FleetSpec,
        out: PathBuf,
        quick: bool,
        seed: u64,
        git_rev: Option<String>,
        versions: serde_json::Value,
    ) -> CalibrateSettings {
        let floor_users = fleet.default_floor_users();
        CalibrateSettings {
            fleet,
            out,
            include_outliers: false,
            outlier_factor: DEFAULT_OUTLIER_FACTOR,
            requests_per_replica: default_requests_per_replica(quick),
            floor_users,
            users: DEFAULT_USERS,
            think_model_s: DEFAULT_THINK_MODEL_S,
            warmup_s: grid::default_warmup_s(quick),
            measure_s: grid::default_measure_s(quick),
            seed,
            git_rev,
            versions,
            capacity: None,
        }
    }

    fn run_s(&self) -> f64 {
        self.warmup_s + self.measure_s
    }

    /// What the reference run is guessed to take before it has run: its warm-up and measured
    /// window, plus the fleet's start and the drain (the sweep's per-cell guess).
    fn reference_estimate(&self) -> Duration {
        Duration::from_secs_f64(self.run_s() + 4.0)
    }
}

/// The phases a calibration goes through, each printed with the time so far and what is left.
const PHASES: usize = 2;

/// `calibrate [k/2] <what> — <elapsed> elapsed[, ETA <left>]` (no ETA while nothing is timed).
fn phase_line(phase: usize, what: &str, elapsed: Duration, eta: Option<Duration>) -> String {
    let eta = eta.map_or_else(String::new, |d| format!(", ETA {}", fmt_duration(d)));
    format!(
        "calibrate [{phase}/{PHASES}] {what} — {} elapsed{eta}",
        fmt_duration(elapsed)
    )
}

/// Runs the whole calibration and writes it to `s.out`. Every wait gives up with "interrupted"
/// once `should_stop` says so.
pub fn calibrate(
    s: &CalibrateSettings,
    bins: &Bins,
    should_stop: &dyn Fn() -> bool,
) -> Result<Calibration> {
    let started = Instant::now();
    let out_dir = s
        .out
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    // One scratch directory per calibration file, so that calibrating another fleet into another
    // file never meets this one's plans and rows (`calibration.json` → `calibration-runs/`).
    let stem = s
        .out
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "calibration".into());
    let work = out_dir.join(format!("{stem}-runs"));
    let speed = s.fleet.effective_speed();
    eprintln!(
        "xtask calibrate: {} fleet of {} replica(s), speed {speed}",
        s.fleet.key().source,
        s.fleet.replica_count()
    );

    // 1. Floors, straight at each replica, concurrency 1, unseen prompts.
    let requests = s.requests_per_replica;
    eprintln!(
        "{}",
        phase_line(
            1,
            &format!(
                "floors: {} replicas × {requests} unseen requests, {} at a time",
                s.fleet.replica_count(),
                s.floor_users
            ),
            started.elapsed(),
            None,
        )
    );
    let source = s.fleet.source(&bins.engine, false, None)?;
    let mut fleet = Fleet::new(source, s.fleet.options(&work.join("logs")))?;
    fleet.start(should_stop)?;
    let sampler = EvidenceSampler::start(
        EvidenceConfig {
            lateness_urls: vec![],
            fleet_process_groups: fleet.process_groups(),
            check_foreign: !matches!(s.fleet.kind, FleetKind::Static),
            gpu: true,
            interval: Duration::from_secs(1),
            fleet_gpus: fleet.gpus(),
        },
        &{
            std::fs::create_dir_all(&work)?;
            work.join("floors-evidence.jsonl")
        },
    )?;
    let floors_started = Instant::now();
    let total = fleet.replicas().len();
    let mut replicas = Vec::new();
    let mut fitted: Option<FloorPrompts> = None;
    for info in fleet.replicas() {
        if should_stop() {
            bail!("interrupted");
        }
        let dir = work.join(format!("floors/replica-{}", info.index));
        cell::clear(&dir)?;
        let (spec, arrival) = calibration::floors_workload(
            s.seed + 1000 + info.index as u64,
            requests,
            s.floor_users,
        );
        let mut plan =
            Plan::build(&spec, &arrival).map_err(|e| anyhow!("the floors' plan: {e}"))?;
        let fit = calibration::fit_floor_prompts(&mut plan, REFERENCE_PROMPT_TOKENS, &mut |m| {
            tokenize_count(s.fleet.engine(), &info.url, &s.fleet.model, m)
        })
        .map_err(|e| anyhow!("replica {}: {e:#}", info.index))?;
        fitted = Some(match fitted.take() {
            None => fit,
            Some(f) => FloorPrompts {
                prompts: f.prompts + fit.prompts,
                tokenize_calls: f.tokenize_calls + fit.tokenize_calls,
                ..f
            },
        });
        let plan_path = dir.join("plan.bin");
        cell::write_atomic(
            &plan_path,
            &plan
                .to_bytes()
                .map_err(|e| anyhow!("encoding the floors' plan: {e}"))?,
        )?;
        let mut driver = fleet::start_driver(
            &bins.driver,
            &info.url,
            &plan_path,
            &dir.join("client.csv"),
            &DriverSettings {
                mode: "closed",
                warmup_s: 0.0,
                duration_s: None,
                timeout_s: 120.0,
                model: s.fleet.model.clone(),
                abandon_after_ms: None,
                // Straight at a replica: llama.cpp's closes a connection after each stream.
                keep_alive: s.fleet.engine().keeps_connections_alive(),
            },
            &dir.join("driver.log"),
        )?;
        fleet::wait_driver(
            &mut driver,
            &mut fleet,
            Duration::from_secs(600),
            should_stop,
            |_| Ok(()),
        )?;
        let rows = analysis::read_client_csv(&dir.join("client.csv"))
            .map_err(|e| anyhow!("reading calibration rows: {e}"))?;
        let unseen: Vec<&analysis::ClientRow> = rows
            .iter()
            .filter(|r| r.error.is_none() && (200..300).contains(&r.status))
            .filter(|r| calibration::is_unseen(r.cached_tokens))
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
        let cache = fleet.kv_cache(info.index);
        eprintln!(
            "  replica {}: TTFT p50 {ttft_p50_ms:.1} ms, ITL p50 {itl_p50_ms:.2} ms over {} unseen {REFERENCE_PROMPT_TOKENS}-token prompts; KV {}",
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
        // The floors left: the mean replica so far times those left; then the reference run.
        let done = replicas.len();
        let per_replica = floors_started.elapsed() / done as u32;
        eprintln!(
            "{}",
            phase_line(
                1,
                &format!("floors: {done}/{total} replicas"),
                started.elapsed(),
                Some(per_replica * (total - done) as u32 + s.reference_estimate()),
            )
        );
    }
    let gpu_evidence = sampler.finish()?;

    // 2. Outliers.
    calibration::find_outliers(&mut replicas, s.outlier_factor);
    if matches!(s.fleet.kind, FleetKind::Command) {
        let gpu_ids = s.fleet.gpus.clone();
        calibration::find_throttle_outliers(&mut replicas, &gpu_evidence.gpus, |i| {
            gpu_ids
                .get(i)
                .map_or(Some(i as u32), |g| g.trim().parse().ok())
        });
    }
    let used = calibration::replicas_in_use(&replicas, s.include_outliers);
    // The cells' throttle bound comes from the cards NVML read; an emulated fleet has none.
    let gpu_throttle_bound = match s.fleet.kind {
        FleetKind::Command => calibration::throttle_bound(&replicas, &used),
        FleetKind::Emulated | FleetKind::Static | FleetKind::Llama | FleetKind::Vllm => None,
    };
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
    if !(floors.ttft_ms > 0.0 && floors.itl_ms > 0.0) {
        // A zero floor is below what the client could resolve; 3× it is no SLO.
        bail!(
            "the measured floors (TTFT {:.3} ms, ITL {:.3} ms) are not positive: the replicas stream faster than this client resolves; lower --speed or calibrate on a quieter machine",
            floors.ttft_ms,
            floors.itl_ms
        );
    }
    let slo = calibration::slo_from_floors(floors);
    let capacity_tokens = calibration::capacity_tokens(&replicas, &used);
    if capacity_tokens == 0 {
        bail!(
            "no replica reported its KV capacity (vllm:cache_config_info on /metrics; llama.cpp: /props); the KV capacity is unknown"
        );
    }
    eprintln!(
        "  floors TTFT {:.1} ms, ITL {:.2} ms → SLO TTFT < {:.1} ms, ITL p50 < {:.2} ms; fleet KV capacity {capacity_tokens} tokens",
        floors.ttft_ms, floors.itl_ms, slo.ttft_ms, slo.itl_ms
    );

    // Bytes per token, on the reference plan's prompts, against a replica in use.
    let think_wall_s = s.think_model_s / speed;
    let (ref_spec, ref_arrival) = calibration::reference_workload(
        s.seed,
        capacity_tokens,
        s.users,
        think_wall_s,
        s.run_s(),
        floors,
    );
    let ref_plan =
        Plan::build(&ref_spec, &ref_arrival).map_err(|e| anyhow!("the reference plan: {e}"))?;
    let tokenizer_url = fleet
        .replicas()
        .iter()
        .find(|r| used.contains(&r.index))
        .map(|r| r.url.clone())
        .ok_or_else(|| anyhow!("no replica in use to tokenize on"))?;
    let bytes_per_token = calibration::measure_bytes_per_token(
        &ref_plan,
        &mut |m| tokenize_count(s.fleet.engine(), &tokenizer_url, &s.fleet.model, m),
        &http::join(&tokenizer_url, "/tokenize"),
    )?;
    fleet.stop();
    eprintln!(
        "  bytes per token {:.4} ({} canonical bytes ÷ {} tokens over {} prompts)",
        bytes_per_token.value,
        bytes_per_token.canonical_bytes,
        bytes_per_token.tokens,
        bytes_per_token.prompts
    );

    // 3. Reference load through the router with prefix-affinity: eviction TTL and node cap.
    eprintln!(
        "{}",
        phase_line(
            2,
            &format!(
                "reference run (≈ {:.0} s)",
                s.reference_estimate().as_secs_f64()
            ),
            started.elapsed(),
            Some(s.reference_estimate()),
        )
    );
    let reference = Reference {
        work: &work,
        used: &used,
        slo,
        capacity_tokens,
        speed,
        spec: ref_spec,
        arrival: ref_arrival,
        bytes_per_token: &bytes_per_token,
    };
    let (index, reference_run) = reference_run(s, bins, &reference, should_stop)?;
    let mut calibration = Calibration {
        fleet: s.fleet.key(),
        replicas,
        used_replicas: used,
        floors,
        slo_factor: SLO_FACTOR,
        slo,
        capacity_tokens,
        floor_prompts: fitted,
        index,
        bytes_per_token: Some(bytes_per_token),
        gpus: gpu_evidence.gpus.clone(),
        gpu_status: match &gpu_evidence.gpu_reason {
            Some(reason) => format!("{}: {reason}", gpu_evidence.gpu_status),
            None => gpu_evidence.gpu_status.clone(),
        },
        gpu_throttle_bound,
        reference_run: Some(reference_run),
        git_rev: s.git_rev.clone(),
        versions: s.versions.clone(),
        capacity: None,
        rules: Some(DerivationRules::live(
            s.outlier_factor,
            analysis::MetricsConfig::default().tokens_per_block,
            s.floor_users,
        )),
    };
    if let Some(c) = &s.capacity {
        calibration.capacity = Some(capacity::find_live(
            s,
            c,
            bins,
            &calibration,
            &work,
            should_stop,
        )?);
    }
    calibration.write(&s.out)?;
    eprintln!("xtask calibrate: wrote {}", s.out.display());
    Ok(calibration)
}

/// What the reference run starts from: the floors' results.
struct Reference<'a> {
    work: &'a Path,
    used: &'a [usize],
    slo: Slo,
    capacity_tokens: u64,
    speed: f64,
    spec: workload::WorkloadSpec,
    arrival: workload::ArrivalSpec,
    bytes_per_token: &'a BytesPerToken,
}

/// The token count of a chat prompt, by the engine's own tokenizer: vLLM's chat form
/// `POST <url>/tokenize {model, messages}` → `count` (else the length of `tokens`), or for
/// llama.cpp `/apply-template` then `/tokenize` (`fleet::llama::tokenize_messages`). A fleet
/// without it is an error that names what the calibration needs.
pub fn tokenize_count(
    engine: EngineKind,
    url: &str,
    model: &str,
    messages: &[Message<'_>],
) -> Result<u64> {
    let messages: Vec<serde_json::Value> = messages
        .iter()
        .map(|m| serde_json::json!({"role": m.role.as_str(), "content": m.content}))
        .collect();
    if engine.tokenize_shape() == TokenizeShape::TemplateThenContent {
        return fleet::llama::tokenize_messages(url, &messages).map_err(anyhow::Error::from);
    }
    let body = serde_json::json!({
        "model": model,
        "messages": messages,
    });
    let endpoint = http::join(url, "/tokenize");
    let needs = "the calibration counts tokens with the fleet's own /tokenize (vLLM: POST /tokenize {model, messages} → {count, tokens}) to fit the floors' prompts and measure bytes per token";
    let response = http::post(&endpoint, Some(&body.to_string()), Duration::from_secs(30))
        .map_err(|e| anyhow!("{}; {needs}", e.chain()))?;
    if response.status != 200 {
        bail!(
            "{endpoint} answered {}: {}; {needs}",
            response.status,
            response.text().chars().take(200).collect::<String>()
        );
    }
    let v: serde_json::Value = serde_json::from_slice(&response.body)
        .map_err(|e| anyhow!("{endpoint} answered no JSON ({e}); {needs}"))?;
    v.get("count")
        .and_then(serde_json::Value::as_u64)
        .or_else(|| {
            v.get("tokens")
                .and_then(serde_json::Value::as_array)
                .map(|t| t.len() as u64)
        })
        .ok_or_else(|| anyhow!("{endpoint} answered without `count` or `tokens`; {needs}"))
}

/// The reference run's router: prefix-affinity with the measured bytes per token and an index
/// TTL longer than the run ([`calibration::reference_index_ttl_s`]) — the run measures how
/// belief decays, which an expiring index would cut short (calibration.json records it as
/// `index.ttl_evidence.reference_index_ttl_s`).
pub fn reference_router(
    model: &str,
    seed: u64,
    bytes_per_token: f64,
    run_s: f64,
) -> RouterSettings {
    RouterSettings {
        policy: "prefix-affinity".into(),
        model: model.to_string(),
        seed,
        index_ttl_s: Some(calibration::reference_index_ttl_s(run_s)),
        index_node_cap: None,
        bytes_per_token: Some(bytes_per_token),
        kv_events: false,
    }
}

/// The reference load (ws 1, skew 0, prefix-affinity) on the replicas in use → the index
/// settings, and the repetition directory it left.
fn reference_run(
    s: &CalibrateSettings,
    bins: &Bins,
    r: &Reference<'_>,
    should_stop: &dyn Fn() -> bool,
) -> Result<(IndexCalibration, PathBuf)> {
    let policy = "prefix-affinity";
    let point = "ws1-s0";
    let source = s.fleet.source(&bins.engine, false, Some(r.used))?;
    let mut fleet = Fleet::new(source, s.fleet.options(&r.work.join("logs")))?;
    let sweep_dir = r.work.join("reference");
    // A calibration always measures afresh: the previous reference run (and its plan, which may
    // have been made for another fleet or plan format) belongs to the calibration being replaced.
    cell::clear(&sweep_dir)?;
    let dir = cell::rep_dir(&sweep_dir, point, policy, 1);
    let think_wall_s = s.think_model_s / r.speed;
    let run_s = s.run_s();
    let plan = ensure_plan(&sweep_dir.join(point), &r.spec, &r.arrival)?;
    cell::clear(&dir)?;
    eprintln!(
        "  reference load: {} users, ws 1, skew 0, {policy}, {:.0} s warm-up + {:.0} s",
        s.users, s.warmup_s, s.measure_s
    );
    let router = reference_router(&s.fleet.model, s.seed, r.bytes_per_token.value, run_s);
    let reference_ttl_s = router.index_ttl_s.unwrap_or_default();
    let result = run_attempt(
        &mut fleet,
        Attempt {
            bins,
            dir: &dir,
            plan: &plan,
            router: router.clone(),
            driver: DriverSettings {
                mode: "closed",
                warmup_s: s.warmup_s,
                duration_s: Some(run_s),
                timeout_s: 120.0,
                model: s.fleet.model.clone(),
                abandon_after_ms: None,
                keep_alive: true,
            },
            closed_users: Some(s.users as usize),
            planned_end_s: run_s,
            slo: r.slo,
            evidence: EvidenceConfig {
                lateness_urls: vec![],
                fleet_process_groups: vec![],
                check_foreign: false,
                gpu: false,
                interval: Duration::from_secs(1),
                fleet_gpus: Default::default(),
            },
            sample_lateness: matches!(s.fleet.kind, FleetKind::Emulated),
            ingress: fleet::Ingress::Router,
            haproxy: fleet::ingress::HaproxySettings::default(),
            limit: Duration::from_secs_f64(run_s * 3.0 + 60.0),
        },
        should_stop,
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
        fleet: serde_json::json!({"source": s.fleet.key().source, "engine": s.fleet.engine(), "engine_flags": s.fleet.engine_flags(), "replicas": r.used.len(), "speed": r.speed, "capacity_tokens": r.capacity_tokens}),
        slo: r.slo,
        window: result.window,
        git_rev: s.git_rev.clone(),
        versions: s.versions.clone(),
        virtual_time: false,
        complete: true,
        accepted: true,
        set_aside_reason: None,
        attempts: 1,
        evidence: Some(result.evidence.clone().into()),
        drift: None,
        run: serde_json::from_value(
            serde_json::json!({"users": s.users, "think_wall_s": think_wall_s, "router": router}),
        )?,
    };
    cell::write_meta(&dir, &meta)?;
    let rep = match analysis::load::load_rep(&dir, point, policy, 1)
        .map_err(|e| anyhow!("loading the reference run: {e}"))?
    {
        analysis::load::RepLoad::Complete(rep) => rep,
        analysis::load::RepLoad::Incomplete(why) => bail!("the reference run is incomplete: {why}"),
    };
    let index = calibration::index_from_reference(
        &rep,
        &r.slo,
        r.capacity_tokens,
        r.speed,
        reference_ttl_s,
    )
    .map_err(|e| anyhow!("{e:#} (reference run: {})", dir.display()))?;
    eprintln!(
        "  index: TTL {} s ({}), node cap {}, honoured share {}",
        index
            .ttl_s
            .map_or_else(|| "unknown".into(), |t| format!("{t:.2}")),
        index.ttl_rule.map_or("no rule", |r| r.as_str()),
        index
            .node_cap
            .map_or_else(|| "unknown".into(), |c| c.to_string()),
        index
            .honoured_share
            .map_or_else(|| "unknown".into(), |h| format!("{h:.2}")),
    );
    Ok((index, dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_print_the_time_so_far_and_what_is_left() {
        assert_eq!(
            phase_line(
                2,
                "reference run (≈ 17 s)",
                Duration::from_secs(12),
                Some(Duration::from_secs(17))
            ),
            "calibrate [2/2] reference run (≈ 17 s) — 0m12s elapsed, ETA 0m17s"
        );
        assert_eq!(
            phase_line(1, "floors", Duration::ZERO, None),
            "calibrate [1/2] floors — 0m00s elapsed"
        );
    }

    #[test]
    fn the_defaults_follow_quick() {
        let spec = crate::fleet_spec::FleetSpec::test_emulated();
        let out = PathBuf::from("c.json");
        let quick = CalibrateSettings::defaults(
            spec.clone(),
            out.clone(),
            true,
            7,
            None,
            Default::default(),
        );
        assert_eq!(
            (quick.requests_per_replica, quick.warmup_s, quick.measure_s),
            (12, 5.0, 8.0)
        );
        assert_eq!(quick.reference_estimate(), Duration::from_secs(17));
        let full = CalibrateSettings::defaults(spec, out, false, 7, None, Default::default());
        assert_eq!(
            (full.requests_per_replica, full.warmup_s, full.measure_s),
            (30, 20.0, 40.0)
        );
        assert_eq!((full.users, full.outlier_factor), (32, 1.3));
    }
}
