//! Drift check: is a repetition still warming up? Two trend tests over the measured window —
//! goodput per time bucket, and TTFT of each request against its send time — each an OLS slope
//! with its t-statistic. A series is flagged when |t| exceeds `t_threshold` (default 3) AND the
//! fitted change across the whole window exceeds `min_relative_change` (default 10 %) of the
//! series mean: the first guards against noise, the second against trends too small to matter
//! (long windows make tiny slopes "significant"). Either flagged series marks the rep `warming`.
//! Below `min_requests` measured requests the check is not run (reported as skipped): a slope
//! over a handful of requests says nothing.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::meta::{Slo, Window};
use crate::metrics::is_good;
use crate::rows::{ClientRow, read_client_csv};
use crate::stats::ols;

/// Thresholds of the drift check.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DriftConfig {
    /// Time buckets the goodput series is cut into.
    pub buckets: usize,
    /// |t| above which a slope counts as real.
    pub t_threshold: f64,
    /// |slope × window| ÷ mean above which a real slope matters.
    pub min_relative_change: f64,
    /// Fewest measured requests the check needs; fewer → skipped, not flagged.
    pub min_requests: usize,
}

impl Default for DriftConfig {
    fn default() -> Self {
        DriftConfig {
            buckets: 10,
            t_threshold: 3.0,
            min_relative_change: 0.10,
            min_requests: 20,
        }
    }
}

/// One trend test.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrendTest {
    /// Points fitted (buckets, or requests).
    pub n: usize,
    /// Slope per second of window (req/s per s for goodput, ms per s for TTFT).
    pub slope_per_s: f64,
    /// Slope ÷ its standard error; `None` for a perfect line (unbounded).
    pub t_stat: Option<f64>,
    /// |slope × window length| ÷ series mean; `None` when the mean is zero.
    pub relative_change: Option<f64>,
    /// Both thresholds exceeded.
    pub flagged: bool,
}

/// Outcome of the drift check on one repetition.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DriftVerdict {
    /// Still warming: at least one series flagged.
    pub warming: bool,
    /// Goodput per bucket vs time; `None` with fewer than 3 buckets.
    pub goodput: Option<TrendTest>,
    /// TTFT vs send time; `None` with fewer than 3 successful requests.
    pub ttft: Option<TrendTest>,
    /// Human-readable reason when warming, for `set_aside_reason`.
    pub reason: Option<String>,
    /// Why the check was not run (too few measured requests); `None` when it ran.
    pub skipped: Option<String>,
    /// The thresholds applied.
    pub config: DriftConfig,
}

fn trend(x: &[f64], y: &[f64], window_s: f64, cfg: &DriftConfig) -> Option<TrendTest> {
    let fit = ols(x, y)?;
    let relative_change =
        (fit.y_mean.abs() > 0.0).then(|| (fit.slope * window_s).abs() / fit.y_mean.abs());
    let significant = match fit.t_stat {
        Some(t) => t.abs() > cfg.t_threshold,
        None => fit.slope != 0.0,
    };
    let flagged = significant && relative_change.is_some_and(|r| r > cfg.min_relative_change);
    Some(TrendTest {
        n: fit.n,
        slope_per_s: fit.slope,
        t_stat: fit.t_stat,
        relative_change,
        flagged,
    })
}

fn describe(name: &str, t: &TrendTest) -> String {
    let t_stat = t
        .t_stat
        .map_or_else(|| "unbounded".to_string(), |v| format!("{v:.1}"));
    format!(
        "{name} trends {} by {:.0}% across the window (t = {t_stat})",
        if t.slope_per_s > 0.0 { "up" } else { "down" },
        t.relative_change.unwrap_or(0.0) * 100.0
    )
}

/// Drift check over client rows: the measured requests are those not in warm-up and sent inside
/// `window` (as in goodput).
pub fn check_rows(
    client: &[ClientRow],
    slo: &Slo,
    window: &Window,
    cfg: &DriftConfig,
) -> DriftVerdict {
    let window_s = window.measured_s();
    let measured: Vec<(f64, &ClientRow)> = client
        .iter()
        .filter(|c| !c.warmup)
        .filter_map(|c| c.sent_s.or(c.scheduled_s).map(|t| (t, c)))
        .filter(|(t, _)| window.contains(*t))
        .collect();
    if measured.len() < cfg.min_requests {
        return DriftVerdict {
            warming: false,
            goodput: None,
            ttft: None,
            reason: None,
            skipped: Some(format!(
                "{} measured requests, fewer than the {} the drift check needs",
                measured.len(),
                cfg.min_requests
            )),
            config: *cfg,
        };
    }
    let goodput = (cfg.buckets >= 3 && window_s > 0.0)
        .then(|| {
            let width = window_s / cfg.buckets as f64;
            let mut good = vec![0u64; cfg.buckets];
            for (t, c) in &measured {
                if is_good(c, slo) {
                    let i = ((t - window.measured_start_s) / width) as usize;
                    good[i.min(cfg.buckets - 1)] += 1;
                }
            }
            let x: Vec<f64> = (0..cfg.buckets)
                .map(|i| window.measured_start_s + (i as f64 + 0.5) * width)
                .collect();
            let y: Vec<f64> = good.iter().map(|&g| g as f64 / width).collect();
            trend(&x, &y, window_s, cfg)
        })
        .flatten();
    let (x, y): (Vec<f64>, Vec<f64>) = measured
        .iter()
        .filter(|(_, c)| c.error.is_none() && (200..300).contains(&c.status))
        .filter_map(|(t, c)| c.ttft_ms.map(|v| (*t, v)))
        .unzip();
    let ttft = trend(&x, &y, window_s, cfg);
    let mut reasons = Vec::new();
    if let Some(t) = goodput.as_ref().filter(|t| t.flagged) {
        reasons.push(describe("goodput", t));
    }
    if let Some(t) = ttft.as_ref().filter(|t| t.flagged) {
        reasons.push(describe("TTFT", t));
    }
    DriftVerdict {
        warming: !reasons.is_empty(),
        goodput,
        ttft,
        reason: (!reasons.is_empty()).then(|| format!("warming: {}", reasons.join("; "))),
        skipped: None,
        config: *cfg,
    }
}

/// Drift check on a just-finished repetition directory, before its `meta.json` is written: reads
/// `<dir>/client.csv` (strictly) and applies [`check_rows`].
pub fn check_rep_dir(
    dir: &Path,
    slo: &Slo,
    window: &Window,
    cfg: &DriftConfig,
) -> Result<DriftVerdict> {
    let client = read_client_csv(&dir.join("client.csv"))?;
    Ok(check_rows(&client, slo, window, cfg))
}
