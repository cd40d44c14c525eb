//! Trace replays in virtual time: a `trace::ReplayPlan` run through the same event loop, router
//! model and engines as a workload plan (`crate::sim::simulate_trace`), open loop, each prompt
//! generated from its block ids and tokenized when the request is decided — never all at once —
//! exactly as the live `driver replay` sends it (one user message) and the live engine renders
//! and tokenizes it. Rows and `meta.json` are the live schema's; the plan's names and
//! fingerprints are the trace replay's.

use std::path::Path;
use std::time::Instant;

use trace::{ReplayPlan, ReplayRequest};
use workload::{Message, Role};

use crate::SimError;
use crate::cell::{CellMeta, CellSummary, Workload, write_meta, write_workload_rows};
use crate::config::SimConfig;
use crate::prompts::{canonical_bytes, engine_tokens};
use crate::sim::simulate_trace;

/// Writes request `q`'s engine prompt tokens into `tokens` (its text as one user message, through
/// the engine's chat template and tokenizer) and, when `keys` is given, the router's belief keys
/// of its canonical bytes (`block_bytes` blocks salted by `model`) into `keys`.
pub fn request_into(
    plan: &ReplayPlan,
    q: &ReplayRequest,
    model: &str,
    block_bytes: usize,
    tokens: &mut Vec<u32>,
    keys: Option<&mut Vec<u64>>,
) {
    let text = plan.prompt(q);
    let message = [Message {
        role: Role::User,
        content: std::borrow::Cow::Borrowed(&text),
    }];
    *tokens = engine_tokens(&message);
    if let Some(keys) = keys {
        let mut bytes = Vec::with_capacity(text.len() + 16);
        canonical_bytes(&message, &mut bytes);
        *keys = kv_index::hash::byte_block_keys(model.as_bytes(), &bytes, block_bytes);
    }
}

/// The longest context the replay asks of an engine: the most, over its requests, of engine
/// prompt tokens + `max_tokens`. An engine whose `max_model_len` is below it refuses that request
/// (a 400 row), so the simulated fleet and the live emulated engines are given at least this.
pub fn context_tokens(plan: &ReplayPlan) -> u32 {
    let mut tokens = Vec::new();
    plan.requests()
        .iter()
        .map(|q| {
            request_into(plan, q, "", 64, &mut tokens, None);
            tokens.len() as u32 + q.max_tokens
        })
        .max()
        .unwrap_or(0)
}

fn workload(plan: &ReplayPlan) -> Workload {
    Workload {
        name: plan.name(),
        workload_name: plan.workload_name(),
        workload_fingerprint: plan.workload_fingerprint_hex(),
        plan_fingerprint: plan.fingerprint_hex(),
        closed_users: None,
        plan_end_s: plan.planned_end_us() as f64 / 1e6,
    }
}

/// Simulates one repetition of a trace replay and writes everything but `meta.json` (as
/// `crate::write_cell_rows` does for a plan); returns the summary and the `meta.json` value.
pub fn write_trace_cell_rows(
    cfg: &SimConfig,
    plan: &ReplayPlan,
    out_dir: &Path,
    meta: &CellMeta,
) -> Result<(CellSummary, serde_json::Value), SimError> {
    let started = Instant::now();
    let out = simulate_trace(cfg, plan)?;
    let wall_s = started.elapsed().as_secs_f64();
    write_workload_rows(cfg, &workload(plan), &out, wall_s, out_dir, meta)
}

/// Simulates one repetition of a trace replay into `out_dir`: rows, evidence, then `meta.json`.
pub fn run_trace_cell(
    cfg: &SimConfig,
    plan: &ReplayPlan,
    out_dir: &Path,
    meta: &CellMeta,
) -> Result<CellSummary, SimError> {
    let (summary, meta_value) = write_trace_cell_rows(cfg, plan, out_dir, meta)?;
    write_meta(out_dir, &meta_value)?;
    Ok(summary)
}
