//! The virtual counterpart of `cargo xtask calibrate`: TTFT and ITL floors at concurrency 1 on
//! unseen prompts, straight at one replica, and the SLO derived from them (3× each).

use serde::Serialize;
use workload::{ArrivalSpec, Plan, Sizing, WorkloadSpec};

use crate::SimError;
use schema::stats::quantile_in_place;

use crate::cell::Slo;
use crate::config::SimConfig;
use crate::sim::simulate;

/// What a virtual calibration measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Calibration {
    /// Requests measured (unseen prompts only).
    pub requests: usize,
    /// Median TTFT, ms.
    pub ttft_p50_ms: f64,
    /// Median per-request ITL p50, ms.
    pub itl_p50_ms: f64,
    /// 3× each floor.
    pub slo: Slo,
    /// The fleet's KV capacity, tokens (what working-set sizing divides by).
    pub capacity_tokens: u64,
}

/// Sends `requests` single-turn prompts shaped like `shape` (its prefix, user and output
/// lengths) one at a time to a single replica of `cfg`'s engine, and takes the medians of the
/// requests that found nothing in the cache.
pub fn calibrate(
    cfg: &SimConfig,
    shape: &WorkloadSpec,
    requests: u32,
) -> Result<Calibration, SimError> {
    if requests == 0 {
        return Err(SimError::Config(
            "calibration needs at least 1 request".into(),
        ));
    }
    let spec = WorkloadSpec {
        // Many more conversations than requests, so repeats (cache hits) are rare; any that
        // happen are left out below.
        sizing: Sizing::Conversations(requests.saturating_mul(20).min(1_000_000)),
        zipf_s: 0.0,
        turns: 1,
        ..*shape
    };
    let arrival = ArrivalSpec::Closed {
        users: 1,
        think_mean_s: 0.0,
        requests_per_user: requests,
    };
    let plan = Plan::build(&spec, &arrival).map_err(|e| SimError::Plan(e.to_string()))?;
    calibrate_plan(cfg, &plan)
}

/// Sends the requests of `plan` (its schedule, one user at a time as planned) to a single
/// replica of `cfg`'s engine and takes the medians of the requests that found nothing in the
/// cache: the floors on prompts the caller shaped (the live calibration trims them to exactly
/// the reference length, and the virtual one does the same).
pub fn calibrate_plan(cfg: &SimConfig, plan: &Plan) -> Result<Calibration, SimError> {
    let mut one = cfg.clone();
    one.replicas = 1;
    one.slowdowns = cfg.slowdowns.first().copied().into_iter().collect();
    one.policy = policies::PolicySpec::named("round-robin");
    one.driver.warmup_s = 0.0;
    one.driver.duration_s = None;
    let out = simulate(&one, plan)?;
    let unseen: Vec<_> = out
        .outcomes
        .iter()
        .filter(|o| o.is_ok() && o.cached_tokens == 0)
        .collect();
    let mut ttft: Vec<f64> = unseen.iter().filter_map(|o| o.ttft_ms()).collect();
    let mut itl: Vec<f64> = unseen.iter().filter_map(|o| o.itl_p50_ms()).collect();
    let (Some(ttft_p50_ms), Some(itl_p50_ms)) = (
        quantile_in_place(&mut ttft, 0.5),
        quantile_in_place(&mut itl, 0.5),
    ) else {
        return Err(SimError::Window(
            "no unseen request completed with two or more tokens".into(),
        ));
    };
    Ok(Calibration {
        requests: unseen.len(),
        ttft_p50_ms,
        itl_p50_ms,
        slo: Slo {
            ttft_ms: 3.0 * ttft_p50_ms,
            itl_ms: 3.0 * itl_p50_ms,
        },
        capacity_tokens: cfg.capacity_tokens(),
    })
}
