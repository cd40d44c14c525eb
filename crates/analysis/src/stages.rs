//! A load ladder's stages in the units public serving benchmarks report (vLLM's and SGLang's
//! `bench_serving`): per stage, request throughput, output and total token throughput, TTFT p50
//! and p90 and the prefix-cache hit share, beside SLO attainment; then the mean over stages.
//!
//! A stage's duration is `bench_serving`'s: from its first request's scheduled time to the end of
//! its last request (the last token, or the failure), so a backlog that outlives the arrivals
//! stretches it. Throughputs count succeeded requests only; TTFT percentiles are over succeeded
//! requests (the one definition, `schema::stats`); attainment is over every request of the
//! stage, judged by [`crate::metrics::is_good`] on the scheduled clock (a trace replay's).
//! Every request counts: a ladder has no warm-up to set aside, its load changes by design, and
//! the drift gate does not apply to it.

use serde::{Deserialize, Serialize};

use crate::load::RepData;
use crate::metrics::is_good;
use crate::rows::ClientRow;
use schema::{Meta, Slo, WindowClock};

/// One stage's numbers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageStats {
    /// 0-based stage.
    pub stage: u32,
    /// The stage's offered rate, req/s; `None`: all at once.
    pub offered_rps: Option<f64>,
    /// Requests of the stage (rows).
    pub requests: usize,
    /// Of which succeeded.
    pub succeeded: usize,
    /// First scheduled time to the last request's end, s.
    pub duration_s: f64,
    /// Succeeded requests ÷ duration.
    pub request_rps: f64,
    /// Output tokens of succeeded requests ÷ duration.
    pub output_tokens_per_s: f64,
    /// Prompt + output tokens of succeeded requests ÷ duration.
    pub total_tokens_per_s: f64,
    /// TTFT median of succeeded requests, ms.
    pub ttft_p50_ms: Option<f64>,
    /// TTFT p90 of succeeded requests, ms.
    pub ttft_p90_ms: Option<f64>,
    /// Cached prompt tokens ÷ prompt tokens of succeeded requests.
    pub cache_hit_share: Option<f64>,
    /// Requests within the SLO ÷ requests.
    pub attainment: f64,
}

/// The stages of one cell and their mean.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageReport {
    /// Each stage, in order.
    pub stages: Vec<StageStats>,
    /// The mean of each quantity over the stages (equal weight per stage, as `bench_serving`
    /// ladders are averaged); `stage` is the count and `offered_rps` the mean of the bounded
    /// rates.
    pub mean: StageStats,
}

/// One repetition's stages, as a sweep report carries them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellStages {
    /// Point directory name.
    pub point: String,
    /// Policy directory name.
    pub policy: String,
    /// Repetition.
    pub rep: u32,
    /// The SLO attainment is judged by (the cell's, on its wall clock).
    pub slo: Slo,
    /// The stages.
    pub report: StageReport,
}

/// The `(stage, first_line, last_line)` runs a repetition's replay recorded (`run.trace.stages`,
/// or `run.sweep.trace.stages` in a virtual cell's meta): empty for anything but a generated,
/// staged trace.
pub fn stage_runs(meta: &Meta) -> Vec<(u32, u32, u32)> {
    let Some(run) = &meta.run else {
        return Vec::new();
    };
    let trace = run
        .other
        .get("trace")
        .or_else(|| run.other.get("sweep").and_then(|s| s.get("trace")));
    let Some(runs) = trace
        .and_then(|t| t.get("stages"))
        .and_then(|s| s.as_array())
    else {
        return Vec::new();
    };
    let num = |v: &serde_json::Value, k: &str| v.get(k).and_then(|x| x.as_u64()).map(|x| x as u32);
    runs.iter()
        .filter_map(|r| {
            Some((
                num(r, "stage")?,
                num(r, "first_line")?,
                num(r, "last_line")?,
            ))
        })
        .collect()
}

/// A repetition's stages, when its replay has them: rows `t<line>` by their line's run, on the
/// model clock of the fleet's recorded `speed`.
pub fn rep_stages(rep: &RepData) -> Option<CellStages> {
    let runs = stage_runs(&rep.meta);
    if runs.is_empty() {
        return None;
    }
    let speed = rep
        .meta
        .fleet
        .get("speed")
        .and_then(|v| v.as_f64())
        .unwrap_or(1.0);
    let stage_of = |r: &ClientRow| {
        let line: u32 = r.request_id.strip_prefix('t')?.parse().ok()?;
        runs.iter()
            .find(|(_, first, last)| (*first..=*last).contains(&line))
            .map(|(stage, _, _)| *stage)
    };
    Some(CellStages {
        point: rep.point.clone(),
        policy: rep.policy.clone(),
        rep: rep.rep,
        slo: rep.meta.slo,
        report: stage_report(&rep.client, stage_of, speed, &rep.meta.slo)?,
    })
}

/// End of a row's request, s: its last token, else its send plus its end-to-end time.
fn end_s(r: &ClientRow) -> Option<f64> {
    r.last_s
        .or_else(|| Some(r.sent_s? + r.e2el_ms? / 1000.0))
        .or(r.scheduled_s)
}

/// The stats of the rows `stage_of` assigns to each stage (rows it assigns none are left out),
/// with times and rates on the model clock of a fleet run at `speed` (wall durations × speed;
/// 1 for real engines). A stage's offered rate is its schedule's: (requests − 1) ÷ (last −
/// first scheduled time), `None` when they share one instant. `None` when no row has a stage.
pub fn stage_report(
    rows: &[ClientRow],
    stage_of: impl Fn(&ClientRow) -> Option<u32>,
    speed: f64,
    slo: &Slo,
) -> Option<StageReport> {
    let mut by_stage: std::collections::BTreeMap<u32, Vec<&ClientRow>> = Default::default();
    for r in rows {
        if let Some(k) = stage_of(r) {
            by_stage.entry(k).or_default().push(r);
        }
    }
    if by_stage.is_empty() {
        return None;
    }
    let stages: Vec<StageStats> = by_stage
        .into_iter()
        .map(|(k, rows)| one_stage(k, &rows, speed, slo))
        .collect();
    let n = stages.len() as f64;
    let mean_of = |f: &dyn Fn(&StageStats) -> f64| stages.iter().map(f).sum::<f64>() / n;
    let mean_opt = |f: &dyn Fn(&StageStats) -> Option<f64>| {
        let v: Vec<f64> = stages.iter().filter_map(f).collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    };
    let mean = StageStats {
        stage: stages.len() as u32,
        offered_rps: mean_opt(&|s| s.offered_rps),
        requests: stages.iter().map(|s| s.requests).sum::<usize>() / stages.len(),
        succeeded: stages.iter().map(|s| s.succeeded).sum::<usize>() / stages.len(),
        duration_s: mean_of(&|s| s.duration_s),
        request_rps: mean_of(&|s| s.request_rps),
        output_tokens_per_s: mean_of(&|s| s.output_tokens_per_s),
        total_tokens_per_s: mean_of(&|s| s.total_tokens_per_s),
        ttft_p50_ms: mean_opt(&|s| s.ttft_p50_ms),
        ttft_p90_ms: mean_opt(&|s| s.ttft_p90_ms),
        cache_hit_share: mean_opt(&|s| s.cache_hit_share),
        attainment: mean_of(&|s| s.attainment),
    };
    Some(StageReport { stages, mean })
}

fn one_stage(stage: u32, rows: &[&ClientRow], speed: f64, slo: &Slo) -> StageStats {
    let scheduled: Vec<f64> = rows
        .iter()
        .filter_map(|r| r.scheduled_s.or(r.sent_s))
        .collect();
    let start = scheduled.iter().copied().fold(f64::INFINITY, f64::min);
    let last = scheduled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let offered_rps =
        (last > start).then(|| (scheduled.len() - 1) as f64 / ((last - start) * speed));
    let end = rows
        .iter()
        .filter_map(|r| end_s(r))
        .fold(f64::NEG_INFINITY, f64::max);
    let duration_s = if end > start {
        (end - start) * speed
    } else {
        0.0
    };
    let ok: Vec<&&ClientRow> = rows.iter().filter(|r| r.is_ok()).collect();
    let per_s = |x: f64| {
        if duration_s > 0.0 {
            x / duration_s
        } else {
            0.0
        }
    };
    let output: u64 = ok.iter().filter_map(|r| r.output_tokens).sum();
    let prompt: u64 = ok.iter().filter_map(|r| r.prompt_tokens).sum();
    let cached: u64 = ok.iter().filter_map(|r| r.cached_tokens).sum();
    let mut ttft: Vec<f64> = ok.iter().filter_map(|r| Some(r.ttft_ms? * speed)).collect();
    let good = rows
        .iter()
        .filter(|r| is_good(r, slo, WindowClock::Scheduled))
        .count();
    StageStats {
        stage,
        offered_rps,
        requests: rows.len(),
        succeeded: ok.len(),
        duration_s,
        request_rps: per_s(ok.len() as f64),
        output_tokens_per_s: per_s(output as f64),
        total_tokens_per_s: per_s((prompt + output) as f64),
        ttft_p50_ms: schema::stats::quantile_in_place(&mut ttft, 0.5),
        ttft_p90_ms: schema::stats::quantile_in_place(&mut ttft, 0.9),
        cache_hit_share: (prompt > 0).then(|| cached as f64 / prompt as f64),
        attainment: good as f64 / rows.len() as f64,
    }
}

/// A table of several cells' stages: one row per (cell, stage) and one per cell's mean.
pub fn markdown(cells: &[CellStages]) -> String {
    let mut out = String::from(
        "| cell | stage | offered req/s | requests | duration s | req/s | output tok/s | total tok/s | TTFT p50 ms | TTFT p90 ms | cache hit | SLO attainment |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let opt = |v: Option<f64>, d: usize| v.map_or("—".to_string(), |x| format!("{x:.d$}"));
    for c in cells {
        let (label, report) = (format!("{} {} rep-{}", c.point, c.policy, c.rep), &c.report);
        let rows = report
            .stages
            .iter()
            .map(|s| (s.stage.to_string(), s))
            .chain((report.stages.len() > 1).then(|| ("mean".to_string(), &report.mean)));
        for (stage, s) in rows {
            out.push_str(&format!(
                "| {label} | {stage} | {} | {} | {:.2} | {:.2} | {:.0} | {:.0} | {} | {} | {} | {:.1}% |\n",
                s.offered_rps
                    .map_or("all at once".to_string(), |r| format!("{r:.3}")),
                s.requests,
                s.duration_s,
                s.request_rps,
                s.output_tokens_per_s,
                s.total_tokens_per_s,
                opt(s.ttft_p50_ms, 1),
                opt(s.ttft_p90_ms, 1),
                s.cache_hit_share
                    .map_or("—".to_string(), |h| format!("{:.1}%", h * 100.0)),
                s.attainment * 100.0
            ));
        }
    }
    if let Some(c) = cells.first() {
        out.push_str(&format!(
            "\nModel time (wall × the fleet's speed). Offered: the stage's schedule, (requests − 1) ÷ its span. Duration: first scheduled time to the last request's end. Throughputs and TTFT percentiles count succeeded requests. SLO attainment: TTFT < {:.1} ms from the scheduled time and per-request ITL p50 < {:.2} ms, on the wall clock. Every request of a stage counts: a ladder has no warm-up and no drift set-aside (its load changes by design).\n",
            c.slo.ttft_ms, c.slo.itl_ms
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: u32, scheduled: f64, ttft_ms: f64, e2el_ms: f64, cached: u64) -> ClientRow {
        ClientRow {
            request_id: format!("t{id}"),
            scheduled_s: Some(scheduled),
            sent_s: Some(scheduled),
            first_token_s: Some(scheduled + ttft_ms / 1000.0),
            last_s: Some(scheduled + e2el_ms / 1000.0),
            ttft_ms: Some(ttft_ms),
            itl_p50_ms: Some(5.0),
            e2el_ms: Some(e2el_ms),
            prompt_tokens: Some(1000),
            output_tokens: Some(100),
            cached_tokens: Some(cached),
            status: 200,
            chunks: 100,
            ..ClientRow::default()
        }
    }

    #[test]
    fn each_stage_is_measured_from_its_first_arrival_to_its_last_end() {
        let slo = Slo {
            ttft_ms: 100.0,
            itl_ms: 10.0,
        };
        // Stage 0: two requests at 0 s and 1 s, the last ending at 3 s. Stage 1: four at 10 s,
        // one of them failing and one over the TTFT bound.
        let mut rows = vec![row(1, 0.0, 50.0, 2000.0, 500), row(2, 1.0, 50.0, 2000.0, 0)];
        for i in 0..4 {
            rows.push(row(
                3 + i,
                10.0,
                20.0 + 100.0 * f64::from(i % 2),
                1000.0,
                1000,
            ));
        }
        rows[5].status = 500;
        rows[5].error = Some("http: 500".into());
        let stage_of = |r: &ClientRow| {
            let line: u32 = r.request_id[1..].parse().ok()?;
            Some(u32::from(line > 2))
        };
        let rep = stage_report(&rows, stage_of, 1.0, &slo).unwrap();
        let (a, b) = (&rep.stages[0], &rep.stages[1]);
        assert_eq!((a.requests, a.succeeded, a.duration_s), (2, 2, 3.0));
        assert!((a.request_rps - 2.0 / 3.0).abs() < 1e-12);
        assert!((a.output_tokens_per_s - 200.0 / 3.0).abs() < 1e-9);
        assert!((a.total_tokens_per_s - 2200.0 / 3.0).abs() < 1e-9);
        assert_eq!(a.cache_hit_share, Some(0.25));
        assert_eq!((a.ttft_p50_ms, a.attainment), (Some(50.0), 1.0));
        assert_eq!((b.requests, b.succeeded, b.duration_s), (4, 3, 1.0));
        assert_eq!(b.request_rps, 3.0);
        // TTFTs of the succeeded: 20, 120, 20 (the failing one had 120): p50 20, p90 by
        // linear interpolation 20 + 0.8 × 100 = 100.
        assert_eq!((b.ttft_p50_ms, b.ttft_p90_ms), (Some(20.0), Some(100.0)));
        assert_eq!(b.attainment, 0.5, "two of four within the SLO");
        assert_eq!(rep.mean.attainment, 0.75);
        assert_eq!(rep.mean.offered_rps, Some(1.0));
        // At speed 2 the model clock runs twice the wall's: durations double, rates halve.
        let fast = stage_report(&rows, stage_of, 2.0, &slo).unwrap();
        assert_eq!(
            (fast.stages[1].duration_s, fast.stages[1].request_rps),
            (2.0, 1.5)
        );
        assert_eq!(fast.stages[0].offered_rps, Some(0.5));
        assert_eq!(fast.stages[1].ttft_p50_ms, Some(40.0));
        let md = markdown(&[CellStages {
            point: "p".into(),
            policy: "rr".into(),
            rep: 1,
            slo,
            report: rep,
        }]);
        assert!(
            md.contains("| p rr rep-1 | 1 | all at once | 4 | 1.00 | 3.00 | 300 | 3300 |"),
            "{md}"
        );
        assert!(md.contains("| p rr rep-1 | mean |"), "{md}");
        assert!(stage_report(&rows, |_| None, 1.0, &slo).is_none());
    }
}
