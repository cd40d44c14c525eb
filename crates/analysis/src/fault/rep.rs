//! One repetition: every failed request classified against the loss bounds, the share of
//! requests per replica and the TTFT in windows around the fault, goodput per second and the
//! recovery after the restart.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{FaultEvents, FaultKind, Instants, PROBE_PREFIX, fmt_opt};
use crate::meta::{Slo, WindowClock};
use crate::metrics::{GoodputBucket, SPILL_BRANCHES, goodput_series};
use crate::rows::{ClientRow, RouterRow};
use crate::stats::{mean, quantile};

/// Slack added to the clock uncertainty when deciding whether a request arrived before the
/// fault: the time the kill itself takes to land (signal delivery, socket teardown).
const FAULT_SLACK_S: f64 = 0.005;

/// Buckets (s) over which SLO attainment after the restart is compared with before the fault.
const RECOVERY_BUCKETS: usize = 3;

/// Share of the attainment before the fault that counts as recovered.
const RECOVERED_SHARE: f64 = 0.95;

/// One request the fault lost, with what the router knew of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LostRequest {
    /// Request id.
    pub request_id: String,
    /// Sent (driver clock), s.
    pub sent_s: Option<f64>,
    /// The client's error.
    pub error: String,
    /// Replica the router dispatched it to, if any.
    pub replica: Option<u32>,
    /// Arrival at the router (router clock), s.
    pub arrival_s: Option<f64>,
    /// Whether it is within the bound: dispatched to the victim and in flight at the kill.
    pub allowed: bool,
    /// Why not, when not.
    pub why: Option<String>,
}

/// Requests per replica in one window of router arrivals.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShareWindow {
    /// `before`, `draining`, `outage`, `after`.
    pub window: String,
    /// Window start (router clock), s.
    pub start_s: f64,
    /// Window end (router clock), s.
    pub end_s: f64,
    /// Requests dispatched in the window.
    pub requests: u64,
    /// Share of those per replica, in router id order.
    pub share: Vec<f64>,
    /// Share of the window's decisions that declined their match (`spill-load`,
    /// `spill-residency`); `None` when no row has a branch.
    #[serde(default)]
    pub spill_rate: Option<f64>,
    /// Engine-reported cached ÷ prompt tokens over the window's requests that report both (the
    /// router parses them from the usage chunk in passing); `None` when none does.
    #[serde(default)]
    pub prefix_hit_rate: Option<f64>,
}

/// TTFT of the successful requests sent in one window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TtftWindow {
    /// `before`, `outage`, `after-early`, `after-late`, `victim-after-early`.
    pub window: String,
    /// Requests with a TTFT.
    pub requests: u64,
    /// Median, ms.
    pub p50_ms: Option<f64>,
    /// 90th percentile, ms.
    pub p90_ms: Option<f64>,
}

/// What one repetition shows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RepOutcome {
    /// Policy.
    pub policy: String,
    /// Repetition.
    pub rep: u32,
    /// Requests sent.
    pub sent: u64,
    /// Requests that failed (error or non-2xx).
    pub lost: Vec<LostRequest>,
    /// Broken bounds, in words (empty: the bounds hold).
    pub violations: Vec<String>,
    /// Victim's outstanding count just before the fault.
    pub outstanding_at_fault: Option<u32>,
    /// Per-replica load in each window.
    pub shares: Vec<ShareWindow>,
    /// TTFT around the restart.
    pub ttft: Vec<TtftWindow>,
    /// Goodput per 1 s of send time from the start of the load (driver clock).
    pub goodput: Vec<GoodputBucket>,
    /// Mean goodput before the fault, during the outage, after the restart, req/s.
    pub goodput_before_rps: Option<f64>,
    /// During the outage.
    pub goodput_outage_rps: Option<f64>,
    /// After the restart.
    pub goodput_after_rps: Option<f64>,
    /// SLO attainment (good ÷ sent) before the fault, during the outage, after the restart.
    pub attainment: [Option<f64>; 3],
    /// Seconds from the restart to the start of the first 3-s span whose SLO attainment (good ÷
    /// sent) is back to 95% of its level before the fault; `None`: not within the run. Counted
    /// in whole buckets, so it is at least the gap to the next bucket start.
    pub recovery_s: Option<f64>,
    /// The fault's instants on the driver's clock.
    pub driver: Instants,
}

impl RepOutcome {
    /// The repetition in one line, as `cargo xtask fault` prints it when the repetition ends.
    pub fn one_line(&self) -> String {
        let allowed = self.lost.iter().filter(|l| l.allowed).count();
        format!(
            "{} sent, {} lost ({allowed} in flight on the victim, outstanding {} at the fault), {} violations; goodput {} before, {} during, {} after; recovered {}",
            self.sent,
            self.lost.len(),
            self.outstanding_at_fault
                .map_or_else(|| "?".into(), |o| o.to_string()),
            self.violations.len(),
            fmt_opt(self.goodput_before_rps, 1),
            fmt_opt(self.goodput_outage_rps, 1),
            fmt_opt(self.goodput_after_rps, 1),
            self.recovery_s.map_or_else(
                || "not within the run".to_string(),
                |s| format!("{s:.1} s after the restart")
            ),
        )
    }
}

fn ok(c: &ClientRow) -> bool {
    c.error.is_none() && (200..300).contains(&c.status)
}

/// Classifies every failed request against the loss bounds and measures the timeline.
pub fn analyse_rep(
    policy: &str,
    rep: u32,
    events: &FaultEvents,
    client: &[ClientRow],
    router: &[RouterRow],
    slo: &Slo,
) -> RepOutcome {
    let r_ev = events.router();
    let d_ev = events.driver();
    let router: Vec<&RouterRow> = router
        .iter()
        .filter(|r| !r.request_id.starts_with(PROBE_PREFIX))
        .collect();
    let by_id: BTreeMap<&str, &RouterRow> =
        router.iter().map(|r| (r.request_id.as_str(), *r)).collect();
    let tol = events.clock_uncertainty_s + FAULT_SLACK_S;
    let sent_rows: Vec<&ClientRow> = client.iter().filter(|c| c.sent_s.is_some()).collect();
    let mut lost = Vec::new();
    let mut violations = Vec::new();
    for c in sent_rows.iter().filter(|c| !ok(c)) {
        let row = by_id.get(c.request_id.as_str()).copied();
        let error = c
            .error
            .clone()
            .unwrap_or_else(|| format!("status {}", c.status));
        let why = match (events.kind, row) {
            (FaultKind::Drain, _) => Some("a drain may lose nothing".to_string()),
            // The router writes a row for every request that reached it, whatever its client
            // did (a hang-up before the response head included): no row, never dispatched.
            (FaultKind::Kill, None) => {
                Some("the router never recorded it: it was not dispatched".to_string())
            }
            // A stream cut by the kill keeps the 200 its headers carried; an error status is
            // the router's own answer. It stands for a request in flight on the victim only
            // when the router had handed it to the victim (and so did not retry it) before the
            // victim was seen down: an engine that dies between reading a request and sending
            // its head (real vLLM takes ~0.1 s to go down) fails it that way. Any other answer
            // of the router's own means the request never reached the victim.
            (FaultKind::Kill, Some(r))
                if c.status >= 300
                    && !(r.replica == Some(events.victim)
                        && r.error
                            .as_deref()
                            .is_some_and(|e| e.contains(schema::rows::SENT_NOT_RETRIED))) =>
            {
                Some(format!(
                    "the router answered {} itself: it was not in flight on the killed replica",
                    c.status
                ))
            }
            (FaultKind::Kill, Some(r)) => match r.replica {
                None => Some("the router dispatched it nowhere".to_string()),
                Some(id) if id != events.victim => {
                    Some(format!("dispatched to replica {id}, not the killed one"))
                }
                Some(_) if r.arrival_s > r_ev.down_s + tol => Some(format!(
                    "arrived {:.3} s after the kill: not in flight at it",
                    r.arrival_s - r_ev.down_s
                )),
                Some(_) => match (c.sent_s, c.e2el_ms) {
                    (Some(s), Some(e)) if s + e / 1e3 < d_ev.fault_s - tol => Some(format!(
                        "it ended {:.3} s before the kill",
                        d_ev.fault_s - (s + e / 1e3)
                    )),
                    _ => None,
                },
            },
        };
        if let Some(w) = &why {
            violations.push(format!("{}: {error} — {w}", c.request_id));
        }
        lost.push(LostRequest {
            request_id: c.request_id.clone(),
            sent_s: c.sent_s,
            error,
            replica: row.and_then(|r| r.replica),
            arrival_s: row.map(|r| r.arrival_s),
            allowed: why.is_none(),
            why,
        });
    }
    let end_r = events.run_end_s + events.router_minus_driver_s;
    let warm_r = events.warmup_s + events.router_minus_driver_s;
    let mut windows = vec![("before", warm_r, r_ev.fault_s)];
    if events.kind == FaultKind::Drain {
        windows.push(("draining", r_ev.fault_s, r_ev.down_s));
    }
    windows.push(("outage", r_ev.down_s, r_ev.up_s));
    windows.push(("after", r_ev.up_s, end_r));
    let shares = windows
        .into_iter()
        .map(|(name, start, end)| share_window(name, start, end, &router, events.replicas))
        .collect();

    let end_d = events.run_end_s;
    let early = ((end_d - d_ev.up_s) / 3.0).clamp(0.5, 10.0);
    let before_start = events.warmup_s.max(d_ev.fault_s - (end_d - d_ev.up_s));
    let victim_rows: Vec<&ClientRow> = client
        .iter()
        .filter(|c| {
            by_id
                .get(c.request_id.as_str())
                .is_some_and(|r| r.replica == Some(events.victim))
        })
        .collect();
    let all: Vec<&ClientRow> = client.iter().collect();
    let ttft = vec![
        ttft_window("before", &all, before_start, d_ev.fault_s),
        ttft_window("outage", &all, d_ev.down_s, d_ev.up_s),
        ttft_window("after-early", &all, d_ev.up_s, d_ev.up_s + early),
        ttft_window("after-late", &all, d_ev.up_s + early, end_d),
        ttft_window(
            "victim-after-early",
            &victim_rows,
            d_ev.up_s,
            d_ev.up_s + early,
        ),
    ];

    // By send time, as every window of the fault analysis.
    let goodput = goodput_series(client, slo, WindowClock::Sent, 0.0, end_d, 1.0);
    let mean_in = |a: f64, b: f64| {
        let v: Vec<f64> = goodput
            .iter()
            .filter(|g| g.start_s >= a && g.start_s + 1.0 <= b)
            .map(|g| g.goodput_rps)
            .collect();
        mean(&v)
    };
    let goodput_before_rps = mean_in(before_start, d_ev.fault_s);
    let goodput_outage_rps = mean_in(d_ev.down_s, d_ev.up_s);
    let goodput_after_rps = mean_in(d_ev.up_s, end_d);
    // Recovery is judged on SLO attainment (good ÷ sent), not on goodput itself: the open-loop
    // plan's arrivals per second are Poisson, and their noise alone would move goodput by more
    // than any threshold worth setting.
    let attainment = |buckets: &[&GoodputBucket]| {
        let sent: u64 = buckets.iter().map(|g| g.requests).sum();
        let good: u64 = buckets.iter().map(|g| g.good).sum();
        (sent > 0).then(|| good as f64 / sent as f64)
    };
    let before_buckets: Vec<&GoodputBucket> = goodput
        .iter()
        .filter(|g| g.start_s >= before_start && g.start_s + 1.0 <= d_ev.fault_s)
        .collect();
    let within = |a: f64, b: f64| -> Vec<&GoodputBucket> {
        goodput
            .iter()
            .filter(|g| g.start_s >= a && g.start_s + 1.0 <= b)
            .collect()
    };
    let attainments = [
        attainment(&before_buckets),
        attainment(&within(d_ev.down_s, d_ev.up_s)),
        attainment(&within(d_ev.up_s, end_d)),
    ];
    let recovery_s = attainment(&before_buckets).and_then(|level| {
        let after: Vec<&GoodputBucket> =
            goodput.iter().filter(|g| g.start_s >= d_ev.up_s).collect();
        (0..after.len()).find_map(|i| {
            let w = &after[i..(i + RECOVERY_BUCKETS).min(after.len())];
            attainment(w)
                .is_some_and(|a| a >= RECOVERED_SHARE * level)
                .then(|| (w[0].start_s - d_ev.up_s).max(0.0))
        })
    });
    RepOutcome {
        policy: policy.to_string(),
        rep,
        sent: sent_rows.len() as u64,
        lost,
        violations,
        outstanding_at_fault: events.outstanding_at_fault,
        shares,
        ttft,
        goodput,
        goodput_before_rps,
        goodput_outage_rps,
        goodput_after_rps,
        attainment: attainments,
        recovery_s,
        driver: d_ev,
    }
}

fn share_window(name: &str, start: f64, end: f64, router: &[&RouterRow], n: usize) -> ShareWindow {
    let mut counts = vec![0u64; n];
    let (mut branches, mut spills, mut cached, mut prompt) = (0u64, 0u64, 0u64, 0u64);
    for r in router
        .iter()
        .filter(|r| r.arrival_s >= start && r.arrival_s < end)
    {
        if let Some(id) = r.replica
            && let Some(c) = counts.get_mut(id as usize)
        {
            *c += 1;
        }
        if let Some(b) = r.branch.as_deref() {
            branches += 1;
            spills += u64::from(SPILL_BRANCHES.contains(&b));
        }
        if let (Some(c), Some(p)) = (r.cached_tokens, r.prompt_tokens) {
            cached += c.min(p);
            prompt += p;
        }
    }
    let total: u64 = counts.iter().sum();
    ShareWindow {
        window: name.to_string(),
        start_s: start,
        end_s: end,
        requests: total,
        share: counts
            .iter()
            .map(|&c| {
                if total == 0 {
                    0.0
                } else {
                    c as f64 / total as f64
                }
            })
            .collect(),
        spill_rate: (branches > 0).then(|| spills as f64 / branches as f64),
        prefix_hit_rate: (prompt > 0).then(|| cached as f64 / prompt as f64),
    }
}

fn ttft_window(name: &str, rows: &[&ClientRow], start: f64, end: f64) -> TtftWindow {
    let v: Vec<f64> = rows
        .iter()
        .filter(|c| ok(c) && c.sent_s.is_some_and(|s| s >= start && s < end))
        .filter_map(|c| c.ttft_ms)
        .collect();
    TtftWindow {
        window: name.to_string(),
        requests: v.len() as u64,
        p50_ms: quantile(&v, 0.5),
        p90_ms: quantile(&v, 0.9),
    }
}
