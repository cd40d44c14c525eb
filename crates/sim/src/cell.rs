//! One virtual repetition on disk, and grids of them in parallel.
//!
//! A cell directory gets `client.csv`, `router.csv`, `evidence.jsonl` and, last, `meta.json`
//! (docs/CONTRACTS.md, "Measurements layout"), each written to a temp name and renamed, so a
//! reader that sees `meta.json` with `"complete": true` sees the whole cell.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use schema::evidence::{Evidence, VirtualEvidence};
use schema::stats::quantile_in_place;
use serde::Serialize;
use workload::{ArrivalSpec, Plan, Schedule};

use crate::SimError;
use crate::config::SimConfig;
use crate::prompts::PromptBook;
use crate::rows::{client_csv, client_row, router_csv, router_row};
use crate::sim::{SimOutput, simulate_with};

/// `meta.json`, the SLO and the window: one definition for every writer and reader
/// (crates/schema).
pub use schema::{Meta, Slo, Window};

/// The measured window from the send times: the sweep's rule for live cells,
/// [`Window::measured`].
pub fn measured_window(
    sent_s: &[f64],
    warmup_s: f64,
    planned_end_s: f64,
    closed_users: Option<usize>,
) -> Result<Window, SimError> {
    Window::measured(sent_s, warmup_s, planned_end_s, closed_users)
        .map_err(|e| SimError::Window(e.to_string()))
}

/// What the sweep knows about a cell that the simulation does not: its place in the sweep and
/// the provenance fields of `meta.json`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CellMeta {
    /// Sweep name.
    pub sweep: String,
    /// Point name.
    pub point: String,
    /// Repetition number (1-based).
    pub rep: u32,
    /// The SLO (the calibrated one, or [`Slo::default`]).
    pub slo: Slo,
    /// Where the measured window ends at the latest (driver clock), s; `None`: the plan's
    /// duration (open loop) or `--duration-s` when set, else unbounded.
    pub planned_end_s: Option<f64>,
    /// Git revision.
    pub git_rev: Option<String>,
    /// Tool versions (free-form JSON).
    pub versions: serde_json::Value,
    /// Extra run settings recorded under `run` (free-form JSON; the simulator adds its own).
    pub run: serde_json::Value,
}

/// What one virtual cell measured, for progress lines, benchmarks and the scale table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CellSummary {
    /// Policy name.
    pub policy: String,
    /// Replicas.
    pub replicas: u32,
    /// Rows written.
    pub requests: usize,
    /// Requests without an error.
    pub ok: usize,
    /// The measured window.
    pub window: Window,
    /// Requests in the window meeting the SLO ÷ window length, req/s.
    pub goodput_rps: f64,
    /// Requests in the window ÷ window length, req/s.
    pub throughput_rps: f64,
    /// Median TTFT in the window, ms.
    pub ttft_p50_ms: Option<f64>,
    /// Median per-request ITL p50 in the window, ms.
    pub itl_p50_ms: Option<f64>,
    /// Engine-reported cached ÷ prompt tokens in the window.
    pub hit_rate: f64,
    /// The busiest replica's share of all requests.
    pub busiest_share: f64,
    /// Spill decisions ÷ decisions.
    pub spill_rate: f64,
    /// Preemptions over the run.
    pub preemptions: u64,
    /// Index nodes at the end (prefix and exact policies).
    pub index_nodes: Option<usize>,
    /// Index heap bytes at the end.
    pub index_bytes: Option<usize>,
    /// Median wall time of one `decide` call, ns (measured, not modelled).
    pub decide_wall_ns_p50: Option<u64>,
    /// 99th percentile of the same.
    pub decide_wall_ns_p99: Option<u64>,
    /// Virtual time the run covered, s.
    pub virtual_s: f64,
    /// Wall time the simulation took (not writing), s.
    pub wall_s: f64,
    /// Events processed.
    pub events: u64,
    /// Closed loop: draws passed over because another user owned them (`workload::walk`).
    pub skipped_draws: u64,
}

/// A quantile of measured wall times in whole nanoseconds (the timer's resolution).
fn wall_ns_quantile(ns: &mut [f64], q: f64) -> Option<u64> {
    quantile_in_place(ns, q).map(|v| v.round() as u64)
}

/// What a cell's rows and meta say about the workload it ran: a plan, or a trace replay.
pub(crate) struct Workload {
    /// The full name (content and arrival).
    pub(crate) name: String,
    /// The content name.
    pub(crate) workload_name: String,
    /// The content fingerprint.
    pub(crate) workload_fingerprint: String,
    /// The arrival-plan fingerprint.
    pub(crate) plan_fingerprint: String,
    /// Closed-loop users (the window rule), `None` for open loop.
    pub(crate) closed_users: Option<usize>,
    /// Where the schedule ends, s (∞ for a closed loop).
    pub(crate) plan_end_s: f64,
}

impl Workload {
    fn of_plan(plan: &Plan) -> Result<Workload, SimError> {
        let fp = |r: Result<String, workload::WorkloadError>| {
            r.map_err(|e| SimError::Plan(e.to_string()))
        };
        Ok(Workload {
            name: plan.name(),
            workload_name: plan.spec.name(),
            workload_fingerprint: fp(plan.workload_fingerprint_hex())?,
            plan_fingerprint: fp(plan.fingerprint_hex())?,
            closed_users: match &plan.schedule {
                Schedule::Closed { users, .. } => Some(users.len()),
                Schedule::Open { .. } => None,
            },
            plan_end_s: match plan.arrival {
                ArrivalSpec::Open { duration_s, .. } => duration_s,
                ArrivalSpec::Closed { .. } => f64::INFINITY,
            },
        })
    }
}

fn planned_end_s(cfg: &SimConfig, w: &Workload, meta: &CellMeta) -> f64 {
    meta.planned_end_s
        .unwrap_or(f64::INFINITY)
        .min(cfg.driver.duration_s.unwrap_or(f64::INFINITY))
        .min(w.plan_end_s)
}

/// Summarizes a run: window, goodput and mechanism numbers (the analysis crate recomputes
/// everything from the rows; this is for progress and benchmarks).
pub fn summarize(
    cfg: &SimConfig,
    plan: &Plan,
    out: &SimOutput,
    meta: &CellMeta,
    wall_s: f64,
) -> Result<CellSummary, SimError> {
    summarize_workload(cfg, &Workload::of_plan(plan)?, out, meta, wall_s)
}

pub(crate) fn summarize_workload(
    cfg: &SimConfig,
    w: &Workload,
    out: &SimOutput,
    meta: &CellMeta,
    wall_s: f64,
) -> Result<CellSummary, SimError> {
    let sent: Vec<f64> = out
        .outcomes
        .iter()
        .map(|o| o.sent_us as f64 / 1e6)
        .collect();
    let window = measured_window(
        &sent,
        cfg.driver.warmup_s,
        planned_end_s(cfg, w, meta),
        w.closed_users,
    )?;
    let mut in_window = 0usize;
    let mut good = 0usize;
    let mut ttft = Vec::new();
    let mut itl = Vec::new();
    let (mut cached, mut prompt) = (0u64, 0u64);
    let mut spills = 0usize;
    let mut decisions = 0usize;
    for o in &out.outcomes {
        if let Some(d) = &o.decision {
            decisions += 1;
            if d.branch.starts_with("spill") {
                spills += 1;
            }
        }
        let s = o.sent_us as f64 / 1e6;
        if o.warmup || s < window.measured_start_s || s >= window.measured_end_s {
            continue;
        }
        in_window += 1;
        if !o.is_ok() {
            continue;
        }
        let (t, i) = (o.ttft_ms(), o.itl_p50_ms());
        if let Some(t) = t {
            ttft.push(t);
        }
        if let Some(i) = i {
            itl.push(i);
        }
        if t.is_some_and(|t| t < meta.slo.ttft_ms) && i.is_some_and(|i| i < meta.slo.itl_ms) {
            good += 1;
        }
        cached += u64::from(o.cached_tokens);
        prompt += u64::from(o.prompt_tokens.unwrap_or(0));
    }
    let len_s = window.measured_end_s - window.measured_start_s;
    let total: u64 = out.per_replica_requests.iter().sum();
    let busiest = out.per_replica_requests.iter().copied().max().unwrap_or(0);
    let mut decide: Vec<f64> = out.decide_wall_ns.iter().map(|&ns| ns as f64).collect();
    Ok(CellSummary {
        policy: out.policy.clone(),
        replicas: cfg.replicas,
        requests: out.outcomes.len(),
        ok: out.outcomes.iter().filter(|o| o.is_ok()).count(),
        window,
        goodput_rps: good as f64 / len_s,
        throughput_rps: in_window as f64 / len_s,
        ttft_p50_ms: quantile_in_place(&mut ttft, 0.5),
        itl_p50_ms: quantile_in_place(&mut itl, 0.5),
        hit_rate: if prompt == 0 {
            0.0
        } else {
            cached as f64 / prompt as f64
        },
        busiest_share: if total == 0 {
            0.0
        } else {
            busiest as f64 / total as f64
        },
        spill_rate: if decisions == 0 {
            0.0
        } else {
            spills as f64 / decisions as f64
        },
        preemptions: out.engine.preemptions,
        index_nodes: out.index.as_ref().map(|s| s.nodes),
        index_bytes: out.index.as_ref().map(|s| s.bytes),
        decide_wall_ns_p50: wall_ns_quantile(&mut decide, 0.5),
        decide_wall_ns_p99: wall_ns_quantile(&mut decide, 0.99),
        virtual_s: out.end_us as f64 / 1e6,
        wall_s,
        events: out.events,
        skipped_draws: out.skipped_draws,
    })
}

/// Writes `bytes` to `path` atomically: a temp file in the same directory, fsync, rename (the
/// `atomic-write-file` crate).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), SimError> {
    let io = |e: std::io::Error| SimError::Io(format!("{}: {e}", path.display()));
    let mut f = atomic_write_file::AtomicWriteFile::open(path).map_err(io)?;
    f.write_all(bytes).map_err(io)?;
    f.commit().map_err(io)
}

/// The rows of a run as `client.csv` and `router.csv` bytes.
pub fn render_rows(out: &SimOutput) -> Result<(Vec<u8>, Vec<u8>), SimError> {
    let csv_err = |e: csv::Error| SimError::Io(format!("csv: {e}"));
    let session = |o: &crate::rows::Outcome| out.session_ids[o.conversation as usize].as_str();
    let client =
        client_csv(out.outcomes.iter().map(|o| client_row(o, session(o)))).map_err(csv_err)?;
    let router = router_csv((out.outcomes.iter()).map(|o| router_row(o, session(o), &out.policy)))
        .map_err(csv_err)?;
    Ok((client, router))
}

fn meta_json(
    cfg: &SimConfig,
    w: &Workload,
    meta: &CellMeta,
    summary: &CellSummary,
) -> Result<serde_json::Value, SimError> {
    let slowdowns: Vec<f64> = (0..cfg.replicas as usize)
        .map(|i| cfg.slowdown(i))
        .collect();
    let r = &cfg.router;
    let mut fleet = serde_json::json!({
        "source": "virtual",
        "replicas": cfg.replicas,
        "speed": cfg.engine.model.speed,
        "slowdowns": slowdowns,
        "capacity_tokens": cfg.capacity_tokens(),
        "num_gpu_blocks": cfg.engine.num_gpu_blocks,
        "block_size": cfg.engine.block_size,
    });
    // The paged (vLLM) model's meta stays as it was; llama.cpp's slot model is recorded.
    if let engine_core::CacheModel::LlamaSlots {
        slots,
        similarity,
        ctx_tokens,
    } = cfg.engine.cache_model
    {
        fleet["cache_model"] = serde_json::json!({
            "name": cfg.engine.cache_model.name(),
            "parallel_slots": slots,
            "slot_prompt_similarity": similarity,
            "ctx_tokens": ctx_tokens,
        });
    }
    let json = |e: serde_json::Error| SimError::Io(format!("meta.json: {e}"));
    let written = Meta {
        sweep: meta.sweep.clone(),
        point: meta.point.clone(),
        policy: summary.policy.clone(),
        rep: meta.rep,
        workload_name: w.workload_name.clone(),
        workload_fingerprint: w.workload_fingerprint.clone(),
        plan_fingerprint: w.plan_fingerprint.clone(),
        fleet,
        slo: meta.slo,
        window: summary.window,
        git_rev: meta.git_rev.clone(),
        versions: meta.versions.clone(),
        virtual_time: true,
        complete: true,
        accepted: true,
        set_aside_reason: None,
        attempts: 1,
        evidence: Some(Evidence::Virtual(VirtualEvidence::new())),
        drift: None,
        run: serde_json::from_value(serde_json::json!({
            "plan_name": w.name,
            "model": cfg.model,
            "policy_seed": cfg.policy.seed,
            "engine_seed": cfg.engine.seed,
            "warmup_s": cfg.driver.warmup_s,
            "duration_s": cfg.driver.duration_s,
            "timeout_s": cfg.driver.timeout_s,
            "decide_cost_us": r.decide_cost_us,
            "forward_overhead_us": r.forward_overhead_us,
            "tokenize_us": cfg.tokenize_us(),
            "event_transport_us": r.event_transport_us,
            "block_bytes": r.block_bytes,
            "bytes_per_token": r.bytes_per_token,
            "sweep": meta.run,
        }))
        .map_err(json)?,
    };
    // A JSON value, so that a sweep can still set `accepted`, `set_aside_reason` and `drift`
    // (null: the simulator runs no drift check) after its own check; the summary rides along
    // under `run.sim`. `write_meta` writes it back through `schema::Meta`, so the file is the
    // one type's bytes, as every live writer's is.
    let mut value = serde_json::to_value(&written).map_err(json)?;
    value["run"]["sim"] = serde_json::to_value(summary).map_err(json)?;
    Ok(value)
}

/// Simulates one repetition and writes it into `out_dir` (created if needed): `client.csv`,
/// `router.csv`, `evidence.jsonl`, then `meta.json` with `"virtual": true`.
pub fn run_cell(
    cfg: &SimConfig,
    plan: &Plan,
    out_dir: &Path,
    meta: &CellMeta,
) -> Result<CellSummary, SimError> {
    let book = PromptBook::new(plan, &cfg.model, cfg.router.block_bytes, true)?;
    run_cell_with(cfg, plan, &book, out_dir, meta)
}

/// [`run_cell`] with a prompt book shared by the cells of one plan.
pub fn run_cell_with(
    cfg: &SimConfig,
    plan: &Plan,
    book: &PromptBook,
    out_dir: &Path,
    meta: &CellMeta,
) -> Result<CellSummary, SimError> {
    let (summary, meta_value) = write_cell_rows(cfg, plan, book, out_dir, meta)?;
    write_meta(out_dir, &meta_value)?;
    Ok(summary)
}

/// Simulates one repetition and writes everything but `meta.json`: `client.csv`, `router.csv`
/// and `evidence.jsonl`. Returns the summary and the `meta.json` value (`complete: true`,
/// `accepted: true`), so a sweep can run its drift check on the rows first, set `accepted` /
/// `set_aside_reason`, and then call [`write_meta`].
pub fn write_cell_rows(
    cfg: &SimConfig,
    plan: &Plan,
    book: &PromptBook,
    out_dir: &Path,
    meta: &CellMeta,
) -> Result<(CellSummary, serde_json::Value), SimError> {
    let started = Instant::now();
    let out = simulate_with(cfg, plan, book)?;
    let wall_s = started.elapsed().as_secs_f64();
    write_workload_rows(cfg, &Workload::of_plan(plan)?, &out, wall_s, out_dir, meta)
}

/// The rows, evidence and `meta.json` value of a finished run of `w`.
pub(crate) fn write_workload_rows(
    cfg: &SimConfig,
    w: &Workload,
    out: &SimOutput,
    wall_s: f64,
    out_dir: &Path,
    meta: &CellMeta,
) -> Result<(CellSummary, serde_json::Value), SimError> {
    let summary = summarize_workload(cfg, w, out, meta, wall_s)?;
    std::fs::create_dir_all(out_dir)
        .map_err(|e| SimError::Io(format!("{}: {e}", out_dir.display())))?;
    // A stale meta from an earlier attempt must not vouch for the new rows while they are
    // being replaced.
    let meta_path = out_dir.join("meta.json");
    if meta_path.exists() {
        std::fs::remove_file(&meta_path)
            .map_err(|e| SimError::Io(format!("{}: {e}", meta_path.display())))?;
    }
    let (client, router) = render_rows(out)?;
    write_atomic(&out_dir.join("client.csv"), &client)?;
    write_atomic(&out_dir.join("router.csv"), &router)?;
    let evidence = serde_json::json!({
        "source": "virtual",
        "virtual_s": summary.virtual_s,
        "preemptions": summary.preemptions,
        "lateness_p99_ms": 0.0,
    });
    write_atomic(
        &out_dir.join("evidence.jsonl"),
        format!("{evidence}\n").as_bytes(),
    )?;
    let meta_value = meta_json(cfg, w, meta, &summary)?;
    Ok((summary, meta_value))
}

/// Writes `meta.json` into `dir` atomically, through [`schema::Meta`] (the one type every
/// writer serializes, so readers see the same bytes a live sweep writes): the last file of a
/// repetition. Fails when `meta` is not a `Meta`.
pub fn write_meta(dir: &Path, meta: &serde_json::Value) -> Result<(), SimError> {
    let io = |e: serde_json::Error| SimError::Io(format!("meta.json: {e}"));
    let typed: Meta = serde_json::from_value(meta.clone()).map_err(io)?;
    let text = serde_json::to_vec_pretty(&typed).map_err(io)?;
    write_atomic(&dir.join("meta.json"), &text)
}

/// One cell of a grid.
#[derive(Debug, Clone)]
pub struct GridJob {
    /// The config (policy, fleet, router model, driver).
    pub cfg: SimConfig,
    /// The point's plan, shared by its cells.
    pub plan: Arc<Plan>,
    /// The plan's prompt book, shared by its cells; built by [`run_grid`] when `None`.
    pub book: Option<Arc<PromptBook>>,
    /// The repetition directory.
    pub out_dir: PathBuf,
    /// Sweep fields of `meta.json`.
    pub meta: CellMeta,
}

/// Runs `jobs` on `threads` OS threads (at least 1) and returns their results in job order.
/// Jobs that share a plan (the same `Arc`) and model share one prompt book.
pub fn run_grid(mut jobs: Vec<GridJob>, threads: usize) -> Vec<Result<CellSummary, SimError>> {
    let mut books: Vec<(*const Plan, String, usize, Arc<PromptBook>)> = Vec::new();
    let mut early: Vec<Option<SimError>> = vec![None; jobs.len()];
    for (j, job) in jobs.iter_mut().enumerate() {
        if job.book.is_some() {
            continue;
        }
        let key = (
            Arc::as_ptr(&job.plan),
            job.cfg.model.clone(),
            job.cfg.router.block_bytes,
        );
        if let Some(b) = books
            .iter()
            .find(|b| (b.0, &b.1, b.2) == (key.0, &key.1, key.2))
        {
            job.book = Some(b.3.clone());
            continue;
        }
        match PromptBook::new(&job.plan, &key.1, key.2, true) {
            Ok(b) => {
                let b = Arc::new(b);
                books.push((key.0, key.1, key.2, b.clone()));
                job.book = Some(b);
            }
            Err(e) => early[j] = Some(e),
        }
    }
    let next = AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<Result<CellSummary, SimError>>>> = (0..jobs.len())
        .map(|_| std::sync::Mutex::new(None))
        .collect();
    let jobs = &jobs;
    let early = &early;
    std::thread::scope(|s| {
        for _ in 0..threads.max(1).min(jobs.len().max(1)) {
            s.spawn(|| {
                loop {
                    let j = next.fetch_add(1, Ordering::Relaxed);
                    let Some(job) = jobs.get(j) else { break };
                    let r = match (&early[j], &job.book) {
                        (Some(e), _) => Err(e.clone()),
                        (None, Some(book)) => {
                            run_cell_with(&job.cfg, &job.plan, book, &job.out_dir, &job.meta)
                        }
                        (None, None) => Err(SimError::Config("no prompt book".into())),
                    };
                    if let Ok(mut slot) = results[j].lock() {
                        *slot = Some(r);
                    }
                }
            });
        }
    });
    results
        .into_iter()
        .map(|m| {
            m.into_inner()
                .ok()
                .flatten()
                .unwrap_or_else(|| Err(SimError::Io("a grid worker panicked".into())))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_replaces_the_whole_file_and_leaves_no_temp() {
        let dir = test_support::temp_dir("sim-atomic");
        let path = dir.path().join("x.csv");
        write_atomic(&path, b"first version, longer").expect("write");
        write_atomic(&path, b"second").expect("write");
        assert_eq!(std::fs::read(&path).expect("read"), b"second");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("list")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }
}
