//! The trace sweep (`cargo xtask sweep trace --trace FILE`): a Mooncake-format trace replayed by
//! every policy, live or virtual, through the sweep machinery of [`crate::sweep`] and
//! [`crate::virtual_sweep`]. Its one point is the mapping (`b<B>-x<time scale>[…]`); its plan is a
//! `trace-plan.json` ([`trace::ReplayFile`]: the trace's path and hash, the mapping, the plan's
//! name and fingerprints) written once and replayed by every cell (`driver replay --plan`), or
//! simulated (`sim::write_trace_cell_rows`).
//!
//! Time: the trace's timestamps are model time, like a workload's think times and rates. Model
//! time = trace time × `time_scale`; the wall clock divides it by the emulator's speed, so the
//! replay's wall time scale is `time_scale ÷ speed`. The slice is `[start_s, start_s +
//! duration_s)` of trace time, by default as long as the cell (warm-up + measured window) covers:
//! `run_s × speed ÷ time_scale`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use serde::Serialize;

use fleet::Source;
use trace::{ReplayFile, ReplayPlan, ReplaySpec, Trace};

use crate::cell::write_atomic;
use crate::grid::{Arrival, Point, SweepName};
use crate::plan_file::PlanFile;
use crate::sweep::SweepSettings;

/// Block size of the full trace sweep: the trace's own, prompts at their real length.
pub const FULL_BLOCK_TOKENS: u32 = trace::replay::DEFAULT_BLOCK_TOKENS;
/// Time scale of the full trace sweep: the trace's own arrival times.
pub const FULL_TIME_SCALE: f64 = 1.0;
/// Block size with `--quick`: prompts scaled down 16× (mean 752 tokens on the conversation
/// trace, longest 7,887), so that most prompts are no longer than the calibration's unseen
/// prompts (≈ 1,100 tokens) whose floor sets the TTFT bound. Measured virtually (README, "Trace
/// sweep"): at B = 64 (mean 1,504, longest 15,774) about 45% of requests missed the TTFT bound
/// even at a third of the trace's rate, by prompt length alone, not by load.
pub const QUICK_BLOCK_TOKENS: u32 = 32;
/// Time scale with `--quick`: the trace's own arrival rate. Measured virtually (README, "Trace
/// sweep"), the quick fleet's capacity at B = 32 lies between time scales 0.35 and 0.5, so this
/// is about half of it — a load the 2-core machine's live emulators sustain.
pub const QUICK_TIME_SCALE: f64 = 1.0;
/// Warm-up of a `--quick` trace cell, wall s: 60 s of trace time at speed 6 — the caches start
/// cold.
pub const QUICK_WARMUP_S: f64 = 10.0;
/// Measured window of a `--quick` trace cell, wall s: 180 s of trace time at speed 6 (569
/// measured requests from the conversation trace's start; the grid's 8 s would hold about 150).
pub const QUICK_MEASURE_S: f64 = 30.0;
/// The engines' `--max-model-len` when nothing asks for more (the engine's own default).
const ENGINE_DEFAULT_MAX_MODEL_LEN: u32 = 8192;

/// Default warm-up of a cell of sweep `name`, wall s: the trace's with `--quick`, else the grid's.
pub fn default_warmup_s(name: SweepName, quick: bool) -> f64 {
    match (name, quick) {
        (SweepName::Trace, true) => QUICK_WARMUP_S,
        _ => crate::grid::default_warmup_s(quick),
    }
}

/// Default measured window of a cell of sweep `name`, wall s.
pub fn default_measure_s(name: SweepName, quick: bool) -> f64 {
    match (name, quick) {
        (SweepName::Trace, true) => QUICK_MEASURE_S,
        _ => crate::grid::default_measure_s(quick),
    }
}

/// What the trace sweep replays.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TraceSettings {
    /// The Mooncake-format JSONL trace.
    pub trace: PathBuf,
    /// Tokens of text per hash id (B).
    pub block_tokens: u32,
    /// Model time = trace time × this.
    pub time_scale: f64,
    /// Start of the slice, trace s.
    pub start_s: f64,
    /// Length of the slice, trace s; `None`: what the cell covers.
    pub duration_s: Option<f64>,
    /// At most this many requests of the slice.
    pub max_requests: Option<u32>,
}

impl TraceSettings {
    /// The settings with the defaults of a full or a `--quick` sweep for what is not given.
    pub fn new(
        trace: PathBuf,
        quick: bool,
        block_tokens: Option<u32>,
        time_scale: Option<f64>,
    ) -> TraceSettings {
        TraceSettings {
            trace,
            block_tokens: block_tokens.unwrap_or(if quick {
                QUICK_BLOCK_TOKENS
            } else {
                FULL_BLOCK_TOKENS
            }),
            time_scale: time_scale.unwrap_or(if quick {
                QUICK_TIME_SCALE
            } else {
                FULL_TIME_SCALE
            }),
            start_s: 0.0,
            duration_s: None,
            max_requests: None,
        }
    }

    /// The sweep's one point: `b<B>-x<time scale>[-from<start>][-d<duration>][-n<max>]`. The
    /// workload axes of a grid point do not apply (0).
    pub fn point(&self) -> Point {
        let mut name = format!("b{}-x{}", self.block_tokens, self.time_scale);
        if self.start_s > 0.0 {
            name.push_str(&format!("-from{}", self.start_s));
        }
        if let Some(d) = self.duration_s {
            name.push_str(&format!("-d{d}"));
        }
        if let Some(n) = self.max_requests {
            name.push_str(&format!("-n{n}"));
        }
        Point {
            name,
            ratio: 0.0,
            zipf_s: 0.0,
            turns: 0,
            prefix_tokens: 0,
            prefix_groups: None,
            sharing: workload::Sharing::Exclusive,
            arrival: Arrival::Trace {
                time_scale: self.time_scale,
            },
            load_fraction: None,
        }
    }

    /// The replay's mapping on the wall clock of a fleet at `speed` whose cells run `run_s`.
    pub fn spec(&self, speed: f64, run_s: f64, seed: u64) -> ReplaySpec {
        ReplaySpec {
            block_tokens: self.block_tokens,
            time_scale: self.time_scale / speed,
            start_s: self.start_s,
            duration_s: Some(self.duration_s.unwrap_or(run_s * speed / self.time_scale)),
            max_requests: self.max_requests,
            seed,
            ..ReplaySpec::default()
        }
    }
}

/// The trace settings of a sweep: present exactly when it is the trace sweep.
pub fn settings_of(s: &SweepSettings) -> Result<Option<&TraceSettings>> {
    match (s.name, &s.trace) {
        (SweepName::Trace, Some(t)) => Ok(Some(t)),
        (SweepName::Trace, None) => bail!("the trace sweep needs --trace FILE"),
        (_, Some(_)) => bail!(
            "--trace is for `sweep trace`; `sweep {}` runs its own workload",
            s.name.as_str()
        ),
        (_, None) => Ok(None),
    }
}

/// Loads the trace and maps it as the sweep `s` asks; returns the plan and the trace's absolute
/// path (what the driver opens, whatever its working directory).
pub fn replay_plan(s: &SweepSettings) -> Result<(ReplayPlan, PathBuf)> {
    let t = settings_of(s)?.ok_or_else(|| anyhow!("not a trace sweep"))?;
    let (trace, path) = read_trace(t)?;
    let spec = t.spec(s.fleet.effective_speed(), s.run_s(), s.seed);
    Ok((ReplayPlan::build(&trace, &spec)?, path))
}

/// Writes `<point>/trace-plan.json` once (a resumed sweep whose trace or mapping changed is
/// refused, as [`crate::plan_file::ensure_plan`] refuses a changed plan) and returns it as the
/// point's plan file.
pub fn ensure_trace_plan(s: &SweepSettings, point: &Point, sweep_dir: &Path) -> Result<PlanFile> {
    let dir = sweep_dir.join(&point.name);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let (plan, trace_path) = replay_plan(s)?;
    let record = ReplayFile::new(&trace_path.display().to_string(), &plan);
    let path = dir.join("trace-plan.json");
    if path.exists() {
        let old: ReplayFile = serde_json::from_slice(
            &std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?,
        )
        .with_context(|| format!("{} is not a trace replay", path.display()))?;
        if old.plan_fingerprint != record.plan_fingerprint || old.trace_hash != record.trace_hash {
            bail!(
                "{} holds replay `{}` of a trace hashed {}, but this sweep now asks for `{}` of {}; the trace or the sweep's parameters changed since it started — resume with the same flags and trace, or start a new sweep with --out or --fresh",
                path.display(),
                old.name,
                old.trace_hash,
                record.name,
                record.trace_hash
            );
        }
    } else {
        write_atomic(&path, serde_json::to_string_pretty(&record)?.as_bytes())?;
    }
    Ok(PlanFile {
        path,
        name: record.name,
        workload_name: record.workload_name,
        workload_fingerprint: record.workload_fingerprint,
        plan_fingerprint: record.plan_fingerprint,
        requests: record.requests,
    })
}

/// The engines' `max_model_len` a replay needs: its longest request's context
/// (`sim::context_tokens`: engine prompt tokens + `max_tokens`), when that is more than the
/// engine's default. A limit the engines enforce, not a measured value.
pub fn max_model_len(plan: &ReplayPlan) -> Option<u32> {
    let need = sim::context_tokens(plan);
    (need > ENGINE_DEFAULT_MAX_MODEL_LEN).then_some(need)
}

/// For the trace sweep, emulated replicas get `--max-model-len` for the replay's longest request;
/// other fleets are told what their replicas must admit.
pub fn with_engine_limits(source: Source, s: &SweepSettings) -> Result<Source> {
    if settings_of(s)?.is_none() {
        return Ok(source);
    }
    let (plan, _) = replay_plan(s)?;
    let Some(need) = max_model_len(&plan) else {
        return Ok(source);
    };
    Ok(match source {
        Source::Emulated(mut spec) => {
            spec.extra_args
                .extend(["--max-model-len".to_string(), need.to_string()]);
            Source::Emulated(spec)
        }
        other => {
            eprintln!(
                "xtask: the replay's longest request needs a context of {need} tokens; replicas that admit less answer it with a 400 row"
            );
            other
        }
    })
}

/// What `meta.json` records of a cell's replay (under `run.trace`): the `trace-plan.json` beside
/// the plan file, or `null` for a workload plan.
pub fn meta_of(plan: &PlanFile) -> serde_json::Value {
    if plan.path.file_name().is_none_or(|n| n != "trace-plan.json") {
        return serde_json::Value::Null;
    }
    std::fs::read(&plan.path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(serde_json::Value::Null)
}

/// Reads and parses the sweep's trace; returns it with its canonical path.
pub(crate) fn read_trace(t: &TraceSettings) -> Result<(Trace, PathBuf)> {
    let path = t
        .trace
        .canonicalize()
        .with_context(|| format!("the trace {}", t.trace.display()))?;
    let bytes =
        std::fs::read(&path).with_context(|| format!("reading the trace {}", path.display()))?;
    let trace = Trace::parse_bytes(&t.trace.display().to_string(), &bytes)?;
    Ok((trace, path))
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::scratch::Scratch;

    fn settings(trace: Option<TraceSettings>) -> SweepSettings {
        SweepSettings {
            name: SweepName::Trace,
            trace,
            ..SweepSettings::test_quick()
        }
    }

    #[test]
    fn the_point_and_the_wall_clock_mapping() {
        let mut t = TraceSettings::new(PathBuf::from("t.jsonl"), true, None, None);
        assert_eq!(
            (t.block_tokens, t.time_scale),
            (QUICK_BLOCK_TOKENS, QUICK_TIME_SCALE)
        );
        assert_eq!(default_warmup_s(SweepName::Trace, true), QUICK_WARMUP_S);
        assert_eq!(
            default_measure_s(SweepName::Load, true),
            crate::grid::default_measure_s(true)
        );
        t.time_scale = 2.0;
        t.block_tokens = 64;
        assert_eq!(t.point().name, "b64-x2");
        assert_eq!(t.point().arrival, Arrival::Trace { time_scale: 2.0 });
        // Speed 6, 13 s cells: wall = trace × 2 ÷ 6; the slice covers 13 × 6 ÷ 2 = 39 trace s.
        let spec = t.spec(6.0, 13.0, 7);
        assert!((spec.time_scale - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(spec.duration_s, Some(39.0));
        t.start_s = 600.0;
        t.duration_s = Some(120.0);
        t.max_requests = Some(50);
        assert_eq!(t.point().name, "b64-x2-from600-d120-n50");
        assert_eq!(t.spec(6.0, 13.0, 7).duration_s, Some(120.0));
        let full = TraceSettings::new(PathBuf::from("t"), false, None, None);
        assert_eq!((full.block_tokens, full.time_scale), (512, 1.0));
    }

    #[test]
    fn the_trace_plan_is_written_once_and_a_changed_trace_refused() {
        let s = Scratch::new("trace-plan");
        let trace = s.0.join("t.jsonl");
        let line = |ts: u64, id: u64| {
            format!(
                "{{\"timestamp\": {ts}, \"input_length\": 700, \"output_length\": 4, \"hash_ids\": [0, {id}]}}\n"
            )
        };
        std::fs::write(&trace, line(0, 1) + &line(500, 2)).unwrap();
        let settings = settings(Some(TraceSettings::new(trace.clone(), true, None, None)));
        let cal = crate::calibration::tests::current_calibration();
        let points = settings.sweep_points(&cal).unwrap();
        assert_eq!(points.len(), 1);
        let first = ensure_trace_plan(&settings, &points[0], &s.0).unwrap();
        assert_eq!(first.requests, 2);
        assert!(first.path.ends_with("b32-x1/trace-plan.json"));
        let again = ensure_trace_plan(&settings, &points[0], &s.0).unwrap();
        assert_eq!(again, first);
        let record = meta_of(&first);
        assert_eq!(record["plan_fingerprint"], first.plan_fingerprint);
        assert_eq!(record["spec"]["block_tokens"], QUICK_BLOCK_TOKENS);
        std::fs::write(&trace, line(0, 1) + &line(500, 3)).unwrap();
        let err = ensure_trace_plan(&settings, &points[0], &s.0)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("the trace or the sweep's parameters changed"),
            "{err}"
        );
        // Settings that do not match the sweep are refused.
        let wrong = SweepSettings {
            trace: None,
            ..settings.clone()
        };
        assert!(wrong.sweep_points(&cal).is_err());
        let misplaced = SweepSettings {
            name: SweepName::PressureGrid,
            ..settings
        };
        assert!(misplaced.sweep_points(&cal).is_err());
    }
}
