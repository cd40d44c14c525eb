//! Drift check: has a repetition settled, is it still warming up, or is it overloaded? Two trend
//! tests over the measured window — the SLO's outcome per time bucket, and the TTFT the SLO
//! judges of each request against the time that places it in the window (the window's clock:
//! scheduled time for an open loop, send time for a closed one) — each an OLS slope with its
//! t-statistic. The outcome per bucket is goodput for a closed loop, whose users send as fast as
//! they are served; for an open loop it is SLO attainment (the share of the bucket's requests that
//! met the SLO), because an open loop's arrivals are its plan's, identical for every policy, and
//! a Poisson plan whose arrivals thin out across a 40-s window would otherwise make every
//! policy's goodput "trend" at once (the virtual grid at a 1.35-req/s point, 1 Dec 2026). A
//! series is flagged when |t| exceeds `t_threshold` (default 3) AND the fitted change across the
//! whole window exceeds `min_relative_change` (default 10 %) of the series' scale: the first
//! guards against noise, the second against trends too small to matter (long windows make tiny
//! slopes "significant"). The scale is the series mean, except for TTFT, whose scale is the larger
//! of its mean and the SLO's TTFT bound: a TTFT that rises from 10 to 20 ms under a 167-ms bound
//! changes no request's verdict. Either flagged series marks the rep as drifting.
//!
//! A drifting repetition is not always warming (docs/ARCHITECTURE.md, "Calibration"): near and above capacity, a
//! policy that cannot sustain the offered load builds a backlog that grows through the whole
//! window, and a longer warm-up would not settle it. For an open loop ([`WindowClock::Scheduled`])
//! the check therefore measures the **backlog** — requests scheduled and not yet finished:
//! queued in the driver (scheduled, not sent) or in flight (sent, unfinished) — as its mean over
//! each time bucket, and tests its growth with the same trend test (flagged, and rising). A rep
//! whose backlog grows is [`DriftClass::Overloaded`] — whether or not its goodput or TTFT trend
//! too: deep in overload goodput sits flat at what the fleet serves, and the TTFT of the requests
//! that still succeed can be too scattered to trend, while the queue grows all the same. The
//! driver's queue alone (scheduled, not yet sent) is tested the same way, because a queue can
//! grow there while the whole backlog's trend drowns in the noise of the requests in flight: at a
//! skewed point the hottest conversation's turns are scheduled faster than one conversation can
//! be served turn after turn, so they wait behind each other in the driver, the same in every
//! policy. On 2 Dec 2026 (live grid, ws0.25-s1.4, 40-s windows) that queue rose from 0.18 to
//! 0.78 requests in all 7 policies measured (t = 3.1–3.4) while the whole backlog's t was
//! 2.2–2.8, and 4 of the 7 were set aside as "warming" twice; at ws0.25-s1 it was flat (|t| ≤
//! 0.2) in all 24 repetitions. That 10-bucket test has little power at a mean of a third of a
//! request (virtual ws0.25-s1.4: t = 2.3–2.5), so a rising TTFT trend is also split: OLS on the
//! same times makes its slope exactly the wait in the driver's slope plus the engines' side's,
//! and a trend more than [`WAIT_SHARE_OF_DRIFT`] of which is the wait is the driver's queue
//! growing. A re-run on the same plan repeats such a queue; one with a longer warm-up measures a
//! later stretch of the plan, not a settled version of this one. It is a
//! result, recorded with its goodput and attainment and marked so, not set aside. A drifting rep
//! with a flat or falling backlog, or a drifting closed loop (its users wait for replies, so it
//! has no backlog to grow), is [`DriftClass::Warming`] only when every trend it shows improves the
//! SLO's outcome (attainment or goodput rising, TTFT falling), as caches filling do: re-run with
//! a longer warm-up, or set aside. A trend for the worse (attainment or goodput falling, TTFT
//! rising) is [`DriftClass::Worsening`]: the fleet drifting (a queue the backlog test cannot yet
//! resolve, another process taking the cores), which a longer warm-up would not settle and a
//! re-run would only measure again. It is a result, recorded and marked like an overloaded one.
//! The rule is
//! [`CLASSIFICATION_RULE`]. Below `min_requests` measured requests the check is not run
//! (reported as skipped): a slope over a handful of requests says nothing.

use std::path::Path;

use crate::error::Result;
use crate::meta::{Slo, Window, WindowClock};
use crate::metrics::{is_good, queued_ms, slo_ttft_ms, window_time_s};
use crate::rows::{ClientRow, read_client_csv};
use crate::stats::ols;

pub use schema::drift::{DriftClass, DriftConfig, DriftVerdict, TrendTest};

/// The rule that tells a warming repetition from a worsening or an overloaded one, as `meta.json`'s `drift`
/// records it beside the evidence.
pub const CLASSIFICATION_RULE: &str = "drifting = the SLO outcome per bucket (closed loop: goodput; open loop: SLO attainment, as its arrivals are the plan's) or the TTFT the SLO judges trends across the measured window (OLS slope, |t| > t_threshold and fitted change > min_relative_change of the series mean; for TTFT, of the larger of its mean and the TTFT bound); overloaded = open loop and the backlog (requests scheduled and not yet finished: queued in the driver or in flight; its mean over each bucket) or the driver's queue alone (scheduled, not yet sent) rises by the same test, drifting or not, or the TTFT trend rises and more than half of its slope is the wait in the driver (OLS of the wait on the same times); warming = drifting with neither queue rising (flat or falling ones, or a closed loop, which has no backlog to grow) and every flagged trend improving the SLO's outcome (attainment or goodput up, TTFT down); worsening = drifting with neither queue rising and some flagged trend for the worse (attainment or goodput down, TTFT up); an overloaded or worsening rep is a result, recorded with its goodput and attainment and marked, a warming one is re-run with a longer warm-up or set aside";

/// Above this share of a rising TTFT trend's slope being the wait in the driver, the drift is
/// the driver's queue growing, not the engines warming: more of the trend is the queue than the
/// engines. On 2 Dec 2026 the live ws0.25-s1.4 cells' trends were the driver's queue in every
/// policy while the engines' own TTFT stayed flat.
pub const WAIT_SHARE_OF_DRIFT: f64 = 0.5;

/// When a request of `row` stopped counting as backlog: its end (send + end-to-end latency, else
/// its last byte); `None` when it never ended (it is backlog to the end).
fn finished_s(row: &ClientRow) -> Option<f64> {
    match (row.sent_s, row.e2el_ms) {
        (Some(sent), Some(e2el)) => Some(sent + e2el / 1e3),
        _ => row.last_s,
    }
}

/// The mean backlog over each of `buckets` equal buckets of `window`: Σ over requests of the time
/// each spent between its scheduled time (else its send time) and its end inside the bucket ÷ the
/// bucket's length. Every row counts, warm-up ones included (one still queued or in flight in the
/// window is backlog there).
pub fn backlog_per_bucket(client: &[ClientRow], window: &Window, buckets: usize) -> Vec<f64> {
    occupancy_per_bucket(client, window, buckets, |c| {
        let start = c.scheduled_s.or(c.sent_s)?;
        Some((start, finished_s(c).unwrap_or(f64::INFINITY).max(start)))
    })
}

/// The mean driver queue over each of `buckets` equal buckets of `window`: as
/// [`backlog_per_bucket`], each request counted from its scheduled time to its send time (to the
/// end when never sent). A row without a scheduled time (a closed loop's) never queues.
pub fn unsent_per_bucket(client: &[ClientRow], window: &Window, buckets: usize) -> Vec<f64> {
    occupancy_per_bucket(client, window, buckets, |c| {
        let start = c.scheduled_s?;
        Some((start, c.sent_s.unwrap_or(f64::INFINITY).max(start)))
    })
}

/// Σ over rows of the overlap of `span(row)` (start, end; s) with each bucket ÷ its length.
fn occupancy_per_bucket(
    client: &[ClientRow],
    window: &Window,
    buckets: usize,
    span: impl Fn(&ClientRow) -> Option<(f64, f64)>,
) -> Vec<f64> {
    let window_s = window.measured_s();
    if buckets == 0 || window_s <= 0.0 {
        return Vec::new();
    }
    let width = window_s / buckets as f64;
    let mut busy_s = vec![0.0f64; buckets];
    for (start, end) in client.iter().filter_map(&span) {
        for (i, b) in busy_s.iter_mut().enumerate() {
            let lo = window.measured_start_s + i as f64 * width;
            let hi = lo + width;
            let overlap = end.min(hi) - start.max(lo);
            if overlap > 0.0 {
                *b += overlap;
            }
        }
    }
    busy_s.into_iter().map(|b| b / width).collect()
}

/// One trend test: OLS of `y` on `x`, flagged when |t| > `t_threshold` and the fitted change
/// across the window exceeds `min_relative_change` of the series mean.
fn trend(x: &[f64], y: &[f64], window_s: f64, cfg: &DriftConfig) -> Option<TrendTest> {
    trend_on_scale(x, y, window_s, |mean| mean, cfg)
}

/// [`trend`] with the fitted change judged against `scale(series mean)` instead of the mean:
/// flagged when |t| > `t_threshold` and |slope × window| > `min_relative_change` × that scale;
/// `relative_change` is |slope × window| ÷ the series mean, as in [`trend`].
fn trend_on_scale(
    x: &[f64],
    y: &[f64],
    window_s: f64,
    scale: impl FnOnce(f64) -> f64,
    cfg: &DriftConfig,
) -> Option<TrendTest> {
    let fit = ols(x, y)?;
    let change = (fit.slope * window_s).abs();
    let relative_change = (fit.y_mean.abs() > 0.0).then(|| change / fit.y_mean.abs());
    let scale = scale(fit.y_mean.abs());
    let significant = match fit.t_stat {
        Some(t) => t.abs() > cfg.t_threshold,
        None => fit.slope != 0.0,
    };
    let flagged = significant && scale > 0.0 && change / scale > cfg.min_relative_change;
    Some(TrendTest {
        n: fit.n,
        slope_per_s: fit.slope,
        t_stat: fit.t_stat,
        relative_change,
        flagged,
    })
}

fn describe(name: &str, t: &TrendTest) -> String {
    format!(
        "{name} trends {} by {:.0}% across the window (t = {})",
        if t.slope_per_s > 0.0 { "up" } else { "down" },
        t.relative_change.unwrap_or(0.0) * 100.0,
        t_stat_text(t)
    )
}

/// A queue's growth, for an overloaded reason.
fn describe_growth(what: &str, t: &TrendTest, mean: Option<f64>) -> String {
    format!(
        "{what} grows {:.3} requests/s across the window (mean {:.2}, t = {})",
        t.slope_per_s,
        mean.unwrap_or(0.0),
        t_stat_text(t)
    )
}

/// `t` to one decimal, or "unbounded" for a perfect line.
fn t_stat_text(t: &TrendTest) -> String {
    t.t_stat
        .map_or_else(|| "unbounded".to_string(), |v| format!("{v:.1}"))
}

/// A flagged trend with a positive slope: the series grows.
fn rises(t: &&TrendTest) -> bool {
    t.flagged && t.slope_per_s > 0.0
}

/// Drift check over client rows: the measured requests are those not in warm-up and inside
/// `window` by its clock (as in goodput); the backlog is measured for an open loop
/// ([`WindowClock::Scheduled`]) and classifies a drifting rep ([`CLASSIFICATION_RULE`]).
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
        .filter_map(|c| window_time_s(c, window.clock).map(|t| (t, c)))
        .filter(|(t, _)| window.contains(*t))
        .collect();
    if measured.len() < cfg.min_requests {
        return DriftVerdict {
            warming: false,
            goodput: None,
            attainment: None,
            ttft: None,
            reason: None,
            skipped: Some(format!(
                "{} measured requests, fewer than the {} the drift check needs",
                measured.len(),
                cfg.min_requests
            )),
            config: *cfg,
            overloaded: false,
            class: DriftClass::Skipped,
            backlog: None,
            backlog_mean: None,
            unsent: None,
            unsent_mean: None,
            wait_share: None,
            rule: CLASSIFICATION_RULE.to_string(),
        };
    }
    let bucket_width_s = window_s / cfg.buckets.max(1) as f64;
    let bucket_mid = |i: usize| window.measured_start_s + (i as f64 + 0.5) * bucket_width_s;
    let open_loop = window.clock == WindowClock::Scheduled;
    // Good and measured requests per bucket.
    let per_bucket = (cfg.buckets >= 3 && window_s > 0.0).then(|| {
        let mut good = vec![0u64; cfg.buckets];
        let mut all = vec![0u64; cfg.buckets];
        for (t, c) in &measured {
            let i =
                (((t - window.measured_start_s) / bucket_width_s) as usize).min(cfg.buckets - 1);
            all[i] += 1;
            if is_good(c, slo, window.clock) {
                good[i] += 1;
            }
        }
        (good, all)
    });
    // A closed loop's goodput per bucket: its users send as fast as they are served, so a
    // trend in it is the system's. An open loop's arrivals are the plan's: its goodput per bucket
    // follows the Poisson draws of that plan (identical for every policy, so a plan whose
    // arrivals happen to thin out across the window set every policy aside at once), and the
    // share of each bucket's requests that met the SLO is what the policy changes.
    let goodput = per_bucket
        .as_ref()
        .filter(|_| !open_loop)
        .and_then(|(good, _)| {
            let x: Vec<f64> = (0..cfg.buckets).map(bucket_mid).collect();
            let y: Vec<f64> = good.iter().map(|&g| g as f64 / bucket_width_s).collect();
            trend(&x, &y, window_s, cfg)
        });
    let attainment = per_bucket
        .as_ref()
        .filter(|_| open_loop)
        .and_then(|(good, all)| {
            let (x, y): (Vec<f64>, Vec<f64>) = (0..cfg.buckets)
                .filter(|&i| all[i] > 0)
                .map(|i| (bucket_mid(i), good[i] as f64 / all[i] as f64))
                .unzip();
            trend(&x, &y, window_s, cfg)
        });
    let judged: Vec<(f64, f64, &ClientRow)> = measured
        .iter()
        .filter(|(_, c)| c.error.is_none() && (200..300).contains(&c.status))
        .filter_map(|(t, c)| slo_ttft_ms(c, window.clock).map(|v| (*t, v, *c)))
        .collect();
    let x: Vec<f64> = judged.iter().map(|(t, _, _)| *t).collect();
    let y: Vec<f64> = judged.iter().map(|(_, v, _)| *v).collect();
    // A TTFT trend matters on the scale the SLO judges: a change of a tenth of a 10-ms mean
    // cannot move a request across a 167-ms bound, and at a small working set a few slow turns
    // of a hot conversation late in the window are enough to make such a mean trend.
    let ttft = trend_on_scale(&x, &y, window_s, |mean| mean.max(slo.ttft_ms), cfg);
    // An open loop's judged TTFT is the wait in the driver plus the TTFT from the send; OLS on
    // the same times splits the TTFT slope exactly into the two slopes, so the share of a rising
    // TTFT trend that is the driver's wait says whether the drift is a queue growing in the
    // driver (the engines' side flat) or the engines' own latency changing (module doc).
    let wait_share = ttft
        .as_ref()
        .filter(|t| t.flagged && t.slope_per_s > 0.0 && window.clock == WindowClock::Scheduled)
        .and_then(|t| {
            let wait: Vec<f64> = judged.iter().map(|(_, _, c)| queued_ms(c)).collect();
            ols(&x, &wait).map(|fit| fit.slope / t.slope_per_s)
        });
    // The backlog of an open loop: a closed loop's users wait for their replies, so its backlog
    // is bounded by its users and says nothing about overload.
    let queue_trend = |per_bucket: fn(&[ClientRow], &Window, usize) -> Vec<f64>| {
        if window.clock == WindowClock::Scheduled && cfg.buckets >= 3 {
            let y = per_bucket(client, window, cfg.buckets);
            let x: Vec<f64> = (0..cfg.buckets).map(bucket_mid).collect();
            (trend(&x, &y, window_s, cfg), crate::stats::mean(&y))
        } else {
            (None, None)
        }
    };
    let (backlog, backlog_mean) = queue_trend(backlog_per_bucket);
    // The driver's queue on its own: at a skewed point it can grow while the whole backlog's
    // trend is lost in the noise of the requests in flight (module doc).
    let (unsent, unsent_mean) = queue_trend(unsent_per_bucket);
    let mut reasons = Vec::new();
    if let Some(t) = goodput.as_ref().filter(|t| t.flagged) {
        reasons.push(describe("goodput", t));
    }
    if let Some(t) = attainment.as_ref().filter(|t| t.flagged) {
        reasons.push(describe("SLO attainment", t));
    }
    if let Some(t) = ttft.as_ref().filter(|t| t.flagged) {
        reasons.push(describe("TTFT", t));
    }
    let drifting = !reasons.is_empty();
    // Only a trend that improves the SLO's outcome is warming; one flagged the other way is the
    // fleet getting worse, which a longer warm-up does not fix.
    let worse = |t: &Option<TrendTest>, up_is_good: bool| {
        t.as_ref()
            .is_some_and(|t| t.flagged && (t.slope_per_s > 0.0) != up_is_good)
    };
    let for_the_worse = worse(&goodput, true) || worse(&attainment, true) || worse(&ttft, false);
    let backlog_rising = backlog.as_ref().filter(rises);
    let unsent_rising = unsent.as_ref().filter(rises);
    let queue_drift = wait_share.filter(|&share| share > WAIT_SHARE_OF_DRIFT);
    let grows = backlog_rising.is_some() || unsent_rising.is_some() || queue_drift.is_some();
    let class = match (drifting, grows) {
        (_, true) => DriftClass::Overloaded,
        (true, false) if for_the_worse => DriftClass::Worsening,
        (true, false) => DriftClass::Warming,
        (false, false) => DriftClass::Settled,
    };
    let reason = match class {
        DriftClass::Overloaded => {
            let mut queues = Vec::new();
            if let Some(b) = backlog_rising {
                queues.push(describe_growth("the backlog", b, backlog_mean));
            }
            if let Some(u) = unsent_rising {
                queues.push(describe_growth(
                    "the driver's queue of unsent requests",
                    u,
                    unsent_mean,
                ));
            }
            if let Some(share) = queue_drift {
                queues.push(format!(
                    "the wait in the driver is {:.0}% of the TTFT trend",
                    share * 100.0
                ));
            }
            Some(format!(
                "overloaded: {}; {}",
                queues.join("; "),
                if reasons.is_empty() {
                    "attainment and TTFT do not trend".to_string()
                } else {
                    reasons.join("; ")
                }
            ))
        }
        DriftClass::Warming => Some(format!("warming: {}", reasons.join("; "))),
        DriftClass::Worsening => Some(format!(
            "worsening (no queue grows): {}",
            reasons.join("; ")
        )),
        _ => None,
    };
    DriftVerdict {
        warming: class == DriftClass::Warming,
        goodput,
        attainment,
        ttft,
        reason,
        skipped: None,
        config: *cfg,
        overloaded: class == DriftClass::Overloaded,
        class,
        backlog,
        backlog_mean,
        unsent,
        unsent_mean,
        wait_share,
        rule: CLASSIFICATION_RULE.to_string(),
    }
}

/// The drift class the sweep recorded in a repetition's `meta.json` (`drift.class`); `None` when
/// it recorded none (no check ran). A verdict written before the classification existed reads as
/// `settled` (the class's default), never as overloaded.
pub fn recorded_class(meta: &crate::meta::Meta) -> Option<DriftClass> {
    meta.drift.as_ref().map(|d| d.class)
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
