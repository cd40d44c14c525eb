//! Per-request facts and the figures computed from a set of requests: goodput, latency,
//! mechanism (hit rate, new tokens, busiest share, spill rate, replicas per hot conversation),
//! belief divergence, belief decay and router overhead. Every function here takes already
//! selected requests, so the same code serves one repetition and a pool of repetitions.

use std::collections::{BTreeMap, BTreeSet};

use ahash::AHashMap as HashMap;

use serde::{Deserialize, Serialize};

use crate::load::RepData;
use crate::meta::{Slo, Window, WindowClock};
use crate::rows::{ClientRow, RouterRow};
use crate::stats::{mean, median, quantile};

/// Knobs of the analysis, with the defaults the report uses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetricsConfig {
    /// How many conversations (most requests first) count as hot.
    pub hot_conversations: usize,
    /// Tokens per index node, to turn a token capacity into a node cap.
    pub tokens_per_block: u32,
    /// Upper edges (s) of the belief-decay buckets; a last open bucket follows.
    pub decay_edges_s: Vec<f64>,
    /// Honoured share below which belief counts as stale (implied TTL).
    pub honour_threshold: f64,
    /// Fewest requests a decay bucket needs to take part in the implied TTL.
    pub decay_min_requests: u64,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            hot_conversations: 10,
            tokens_per_block: 16,
            decay_edges_s: vec![1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0],
            honour_threshold: 0.5,
            decay_min_requests: 5,
        }
    }
}

/// Branch names counted as a spill (the policy declined its match).
pub const SPILL_BRANCHES: &[&str] = &["spill-load", "spill-residency"];

/// The time that places `row` in a window measured on `clock`: the scheduled time for an open
/// loop, the send time for a closed one (each falling back on the other when the row lacks it;
/// a row with neither was never sent, and is in no window).
pub fn window_time_s(row: &ClientRow, clock: WindowClock) -> Option<f64> {
    match clock {
        WindowClock::Scheduled => row.scheduled_s.or(row.sent_s),
        WindowClock::Sent => row.sent_s.or(row.scheduled_s),
    }
}

/// How long `row` waited in the driver between its scheduled and its send time, ms (0 when
/// either is missing, or it was sent on time).
pub fn queued_ms(row: &ClientRow) -> f64 {
    match (row.scheduled_s, row.sent_s) {
        (Some(scheduled), Some(sent)) => ((sent - scheduled) * 1e3).max(0.0),
        _ => 0.0,
    }
}

/// The TTFT the SLO judges, ms: on [`WindowClock::Scheduled`] (open loop) from the scheduled
/// time — the row's TTFT plus the time it waited in the driver ([`queued_ms`]), so a turn held
/// back because the fleet was saturated counts against the SLO; on [`WindowClock::Sent`] the
/// row's own TTFT (from the send).
pub fn slo_ttft_ms(row: &ClientRow, clock: WindowClock) -> Option<f64> {
    match clock {
        WindowClock::Scheduled => row.ttft_ms.map(|t| t + queued_ms(row)),
        WindowClock::Sent => row.ttft_ms,
    }
}

/// Whether a request meets the SLO: no error, a 2xx status, TTFT ([`slo_ttft_ms`] on `clock`)
/// below the bound and per-request ITL p50 below the bound. A request with at most one output
/// token has no gaps, so no ITL to violate; any other request without a measured ITL fails.
pub fn is_good(row: &ClientRow, slo: &Slo, clock: WindowClock) -> bool {
    slo_miss(row, slo, clock) == SloMiss::default()
}

/// Which bounds a request missed. An error (or non-2xx status) is reported alone: its TTFT and
/// ITL are not judged. A successful request may miss both TTFT and ITL. A turn the driver
/// abandoned (`abandoned:`, never sent: after the run's end it had waited past the TTFT bound
/// behind its conversation's previous turn) missed the TTFT bound, and counts there.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SloMiss {
    /// Failed: an error or a non-2xx status.
    pub error: bool,
    /// Succeeded with TTFT at or above the bound (or none measured).
    pub ttft: bool,
    /// Succeeded with per-request ITL p50 at or above the bound (or none measured with more
    /// than one output token).
    pub itl: bool,
}

/// The bounds `row` missed under `slo`, its TTFT judged on `clock` ([`is_good`] is "missed
/// none").
pub fn slo_miss(row: &ClientRow, slo: &Slo, clock: WindowClock) -> SloMiss {
    if row.error.as_deref().is_some_and(is_abandoned) {
        return SloMiss {
            ttft: true,
            ..SloMiss::default()
        };
    }
    if row.error.is_some() || !(200..300).contains(&row.status) {
        return SloMiss {
            error: true,
            ..SloMiss::default()
        };
    }
    let ttft_ok = slo_ttft_ms(row, clock).is_some_and(|t| t < slo.ttft_ms);
    let itl_ok = match row.itl_p50_ms {
        Some(itl) => itl < slo.itl_ms,
        None => row.output_tokens.is_some_and(|n| n <= 1),
    };
    SloMiss {
        error: false,
        ttft: !ttft_ok,
        itl: !itl_ok,
    }
}

/// The share of a run's measured requests (not warm-up, inside `window` by its clock) that
/// succeeded and missed the SLO by less than `late_ms`: TTFT ([`slo_ttft_ms`]) or per-request
/// ITL p50 at or above its bound and below bound + `late_ms`. Engine lateness only delays
/// emission (the emulator's deadlines are absolute), by at most its size, so these are the only
/// verdicts a lateness of `late_ms` can have turned from within the SLO to outside it. `None`
/// when no request was measured.
pub fn missed_by_less_than_share(
    client: &[ClientRow],
    slo: &Slo,
    window: &Window,
    late_ms: f64,
) -> Option<f64> {
    let near = |value: f64, bound: f64| value >= bound && value < bound + late_ms;
    let (mut measured, mut near_miss) = (0u64, 0u64);
    for c in client.iter().filter(|c| !c.warmup) {
        if !window_time_s(c, window.clock).is_some_and(|t| window.contains(t)) {
            continue;
        }
        measured += 1;
        // A failed request's verdict is its error, which lateness cannot change.
        if slo_miss(c, slo, window.clock).error {
            continue;
        }
        let ttft = slo_ttft_ms(c, window.clock).is_some_and(|t| near(t, slo.ttft_ms));
        let itl = c.itl_p50_ms.is_some_and(|t| near(t, slo.itl_ms));
        near_miss += u64::from(ttft || itl);
    }
    (measured > 0).then(|| near_miss as f64 / measured as f64)
}

/// Whether a client row's `error` is the driver's `abandoned:` (a turn never sent because it
/// had already waited past the TTFT bound after the run's end; `driver --abandon-after-ms`).
pub fn is_abandoned(error: &str) -> bool {
    error
        .strip_prefix(schema::rows::ABANDONED_ERROR_KIND)
        .is_some_and(|rest| rest.starts_with(':'))
}

/// Goodput in one time bucket of a series.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GoodputBucket {
    /// Bucket start (driver clock), s.
    pub start_s: f64,
    /// Requests sent in the bucket.
    pub requests: u64,
    /// Of those, meeting the SLO.
    pub good: u64,
    /// good ÷ bucket length, req/s.
    pub goodput_rps: f64,
}

/// Goodput per `bucket_s` bucket over [`start_s`, `end_s`) of the time `clock` places rows by
/// ([`window_time_s`]; the SLO judged on the same clock), warm-up flag ignored (the caller picks
/// the span): the timeline of a fault run, or a drift plot. Empty when the span or the bucket is
/// not positive.
pub fn goodput_series(
    client: &[ClientRow],
    slo: &Slo,
    clock: WindowClock,
    start_s: f64,
    end_s: f64,
    bucket_s: f64,
) -> Vec<GoodputBucket> {
    if !(bucket_s > 0.0 && end_s > start_s) {
        return Vec::new();
    }
    let n = ((end_s - start_s) / bucket_s).ceil() as usize;
    let mut out: Vec<GoodputBucket> = (0..n)
        .map(|i| GoodputBucket {
            start_s: start_s + i as f64 * bucket_s,
            requests: 0,
            good: 0,
            goodput_rps: 0.0,
        })
        .collect();
    for c in client {
        let Some(t) = window_time_s(c, clock) else {
            continue;
        };
        if t < start_s || t >= end_s {
            continue;
        }
        let b = &mut out[(((t - start_s) / bucket_s) as usize).min(n - 1)];
        b.requests += 1;
        b.good += u64::from(is_good(c, slo, clock));
    }
    for b in &mut out {
        b.goodput_rps = b.good as f64 / bucket_s;
    }
    out
}

/// One measured request: its client row joined with its router row (when there is one), plus
/// what the analysis derives per request.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// The driver's row.
    pub client: &'a ClientRow,
    /// The router's row with the same `request_id`, if any.
    pub router: Option<&'a RouterRow>,
    /// The first turn of its conversation.
    pub first_turn: bool,
    /// Meets the SLO.
    pub good: bool,
    /// The bounds it missed (all false when `good`).
    pub miss: SloMiss,
    /// The TTFT the SLO judged ([`slo_ttft_ms`] on the window's clock), ms.
    pub ttft_ms: Option<f64>,
    /// Succeeded (no error, 2xx).
    pub ok: bool,
    /// Engine-reported prompt tokens (client row, else router row).
    pub prompt_tokens: Option<u64>,
    /// Engine-reported cached tokens (client row, else router row; an absent value reads as 0 on
    /// a successful request when the repetition reports cached tokens at all, as vLLM omits zero).
    pub engine_cached_tokens: Option<u64>,
    /// Seconds since the router last saw this session (router clock); `None` for its first.
    pub since_last_served_s: Option<f64>,
}

/// The measured requests of a repetition: not warm-up, and inside the measured window by the
/// time its clock names ([`window_time_s`]: the scheduled time for an open loop, the send time
/// for a closed one; requests with neither were never sent and are left out), each judged
/// against the SLO on that clock ([`slo_miss`]).
pub fn measured_requests<'a>(rep: &'a RepData, slo: &Slo) -> Vec<Request<'a>> {
    let window = rep.meta.window;
    let by_id: HashMap<&str, &RouterRow> = rep
        .router
        .iter()
        .flatten()
        .map(|r| (r.request_id.as_str(), r))
        .collect();
    let since = since_last_served(rep.router.as_deref().unwrap_or(&[]));
    let first_turn = rep.client.iter().map(|c| c.turn).min().unwrap_or(0);
    let cached_reported = rep.client.iter().any(|c| c.cached_tokens.is_some())
        || rep
            .router
            .iter()
            .flatten()
            .any(|r| r.cached_tokens.is_some());
    rep.client
        .iter()
        .filter(|c| !c.warmup)
        .filter(|c| window_time_s(c, window.clock).is_some_and(|t| window.contains(t)))
        .map(|c| {
            let router = by_id.get(c.request_id.as_str()).copied();
            let ok = c.error.is_none() && (200..300).contains(&c.status);
            let prompt_tokens = c.prompt_tokens.or(router.and_then(|r| r.prompt_tokens));
            let engine_cached_tokens = c
                .cached_tokens
                .or(router.and_then(|r| r.cached_tokens))
                .or((ok && cached_reported && prompt_tokens.is_some()).then_some(0));
            let miss = slo_miss(c, slo, window.clock);
            Request {
                client: c,
                router,
                first_turn: c.turn == first_turn,
                good: miss == SloMiss::default(),
                miss,
                ttft_ms: slo_ttft_ms(c, window.clock),
                ok,
                prompt_tokens,
                engine_cached_tokens,
                since_last_served_s: since.get(c.request_id.as_str()).copied().flatten(),
            }
        })
        .collect()
}

/// For each router row, the gap since the previous arrival of the same session.
fn since_last_served(rows: &[RouterRow]) -> HashMap<&str, Option<f64>> {
    let mut order: Vec<&RouterRow> = rows.iter().collect();
    order.sort_by(|a, b| {
        a.arrival_s
            .total_cmp(&b.arrival_s)
            .then(a.request_id.cmp(&b.request_id))
    });
    let mut last: HashMap<&str, f64> = HashMap::new();
    let mut out = HashMap::new();
    for r in order {
        let gap = match r.session_id.as_deref() {
            Some(s) => last.insert(s, r.arrival_s).map(|prev| r.arrival_s - prev),
            None => None,
        };
        out.insert(r.request_id.as_str(), gap);
    }
    out
}

/// Latency and SLO figures of a set of requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    /// Requests considered.
    pub requests: u64,
    /// Requests meeting the SLO.
    pub good: u64,
    /// Requests with an error or a non-2xx status (an abandoned turn is a TTFT miss, not an error).
    pub errors: u64,
    /// good / requests.
    pub slo_attainment: Option<f64>,
    /// TTFT p50 over successful requests, ms (the TTFT the SLO judges: from the scheduled time
    /// for an open loop, [`slo_ttft_ms`]; so are p90 and p99).
    pub ttft_p50_ms: Option<f64>,
    /// TTFT p90 over successful requests, ms.
    pub ttft_p90_ms: Option<f64>,
    /// TTFT p99 over successful requests, ms.
    pub ttft_p99_ms: Option<f64>,
    /// Median of the per-request ITL p50s, ms.
    pub itl_p50_ms: Option<f64>,
    /// p99 of the per-request ITL p50s (the quantity the SLO bounds), ms.
    pub itl_p99_ms: Option<f64>,
    /// Successful requests that missed the TTFT bound.
    pub missed_ttft: u64,
    /// Successful requests that missed the ITL bound (a request may miss both).
    pub missed_itl: u64,
}

/// Latency and SLO figures of `reqs`.
pub fn latency(reqs: &[Request<'_>]) -> Latency {
    let ttft: Vec<f64> = reqs
        .iter()
        .filter(|r| r.ok)
        .filter_map(|r| r.ttft_ms)
        .collect();
    let itl: Vec<f64> = reqs
        .iter()
        .filter(|r| r.ok)
        .filter_map(|r| r.client.itl_p50_ms)
        .collect();
    let good = reqs.iter().filter(|r| r.good).count() as u64;
    Latency {
        requests: reqs.len() as u64,
        good,
        errors: reqs.iter().filter(|r| r.miss.error).count() as u64,
        slo_attainment: (!reqs.is_empty()).then(|| good as f64 / reqs.len() as f64),
        ttft_p50_ms: quantile(&ttft, 0.5),
        ttft_p90_ms: quantile(&ttft, 0.9),
        ttft_p99_ms: quantile(&ttft, 0.99),
        itl_p50_ms: median(&itl),
        itl_p99_ms: quantile(&itl, 0.99),
        missed_ttft: reqs.iter().filter(|r| r.miss.ttft).count() as u64,
        missed_itl: reqs.iter().filter(|r| r.miss.itl).count() as u64,
    }
}

/// Mechanism figures of a set of requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Mechanism {
    /// Requests considered.
    pub requests: u64,
    /// Σ engine cached tokens ÷ Σ prompt tokens over successful requests reporting both.
    pub prefix_hit_rate: Option<f64>,
    /// Mean prompt tokens the engine had to compute (prompt − cached) per request.
    pub new_tokens_per_request: Option<f64>,
    /// The replica that served the most requests.
    pub busiest_replica: Option<u32>,
    /// Its share of the routed requests.
    pub busiest_share: Option<f64>,
    /// Share of decisions whose branch is `spill-load` or `spill-residency`.
    pub spill_rate: Option<f64>,
    /// Mean distinct replicas that served each hot conversation.
    pub replicas_per_hot_conversation: Option<f64>,
    /// Hot conversations that mean is over.
    pub hot_conversations: u64,
}

/// Mechanism figures of `reqs`; the hot conversations are the `hot` with most requests in `reqs`
/// (ties by session id, for determinism).
pub fn mechanism(reqs: &[Request<'_>], hot: usize) -> Mechanism {
    let mut cached_sum = 0u64;
    let mut prompt_sum = 0u64;
    let mut new_tokens = Vec::new();
    for r in reqs.iter().filter(|r| r.ok) {
        if let (Some(p), Some(c)) = (r.prompt_tokens, r.engine_cached_tokens) {
            cached_sum += c.min(p);
            prompt_sum += p;
            new_tokens.push(p.saturating_sub(c) as f64);
        }
    }
    let mut per_replica: BTreeMap<u32, u64> = BTreeMap::new();
    let mut branches = 0u64;
    let mut spills = 0u64;
    let mut per_session: BTreeMap<&str, (u64, BTreeSet<u32>)> = BTreeMap::new();
    for r in reqs {
        let Some(router) = r.router else { continue };
        if let Some(b) = router.branch.as_deref() {
            branches += 1;
            spills += u64::from(SPILL_BRANCHES.contains(&b));
        }
        if let Some(rep) = router.replica {
            *per_replica.entry(rep).or_default() += 1;
            if let Some(s) = r.client.session_id.as_deref() {
                let e = per_session.entry(s).or_default();
                e.0 += 1;
                e.1.insert(rep);
            }
        }
    }
    let routed: u64 = per_replica.values().sum();
    // Highest count wins; among equals the lowest id, so the choice is deterministic.
    let busiest = per_replica
        .iter()
        .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))
        .map(|(id, n)| (*id, *n));
    let mut sessions: Vec<(&str, u64, usize)> = per_session
        .iter()
        .map(|(s, (n, set))| (*s, *n, set.len()))
        .collect();
    sessions.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    sessions.truncate(hot);
    let hot_replicas: Vec<f64> = sessions.iter().map(|s| s.2 as f64).collect();
    Mechanism {
        requests: reqs.len() as u64,
        prefix_hit_rate: (prompt_sum > 0).then(|| cached_sum as f64 / prompt_sum as f64),
        new_tokens_per_request: mean(&new_tokens),
        busiest_replica: busiest.map(|b| b.0),
        busiest_share: busiest.map(|b| b.1 as f64 / routed as f64),
        spill_rate: (branches > 0).then(|| spills as f64 / branches as f64),
        replicas_per_hot_conversation: mean(&hot_replicas),
        hot_conversations: hot_replicas.len() as u64,
    }
}

/// A figure over all requests, first turns only, and later turns only.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Split<T> {
    /// All measured requests.
    pub all: T,
    /// First turns of their conversations.
    pub first_turn: T,
    /// Second and later turns.
    pub later_turns: T,
}

/// Applies `f` to all requests, to first turns and to later turns.
pub fn split<T>(reqs: &[Request<'_>], f: impl Fn(&[Request<'_>]) -> T) -> Split<T> {
    let (first, later): (Vec<Request<'_>>, Vec<Request<'_>>) =
        reqs.iter().partition(|r| r.first_turn);
    Split {
        all: f(reqs),
        first_turn: f(&first),
        later_turns: f(&later),
    }
}

/// One side of belief divergence (over- or under-prediction), never netted with the other.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DivergenceSide {
    /// Requests on this side.
    pub count: u64,
    /// Σ |predicted − cached| over them, tokens.
    pub tokens_total: u64,
    /// Mean size, tokens.
    pub tokens_mean: Option<f64>,
    /// Median size, tokens.
    pub tokens_p50: Option<f64>,
    /// Largest size, tokens.
    pub tokens_max: Option<u64>,
}

impl DivergenceSide {
    fn of(sizes: &[u64]) -> DivergenceSide {
        let f: Vec<f64> = sizes.iter().map(|&s| s as f64).collect();
        DivergenceSide {
            count: sizes.len() as u64,
            tokens_total: sizes.iter().sum(),
            tokens_mean: mean(&f),
            tokens_p50: median(&f),
            tokens_max: sizes.iter().copied().max(),
        }
    }
}

/// Belief divergence: the router's predicted match vs the engine's cached tokens per request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Divergence {
    /// Successful requests with both a prediction and an engine-reported cached count.
    pub compared: u64,
    /// Predicted exactly what the engine reused.
    pub exact: u64,
    /// Predicted more than the engine reused (belief too optimistic).
    pub over: DivergenceSide,
    /// Predicted less than the engine reused (belief too pessimistic).
    pub under: DivergenceSide,
}

/// Belief divergence of `reqs`. Policies without belief (round-robin, session-affinity, …) write
/// a predicted match of 0 on every row; counting those as under-predictions would invent a
/// belief, so a set of requests with no positive prediction at all has nothing to compare.
pub fn divergence(reqs: &[Request<'_>]) -> Divergence {
    let believes = reqs.iter().any(|r| {
        r.router
            .and_then(|x| x.predicted_match_tokens)
            .is_some_and(|p| p > 0)
    });
    if !believes {
        return Divergence::default();
    }
    let mut over = Vec::new();
    let mut under = Vec::new();
    let mut exact = 0;
    for r in reqs.iter().filter(|r| r.ok) {
        let (Some(pred), Some(cached)) = (
            r.router.and_then(|x| x.predicted_match_tokens),
            r.engine_cached_tokens,
        ) else {
            continue;
        };
        match pred.cmp(&cached) {
            std::cmp::Ordering::Greater => over.push(pred - cached),
            std::cmp::Ordering::Less => under.push(cached - pred),
            std::cmp::Ordering::Equal => exact += 1,
        }
    }
    Divergence {
        compared: (over.len() + under.len()) as u64 + exact,
        exact,
        over: DivergenceSide::of(&over),
        under: DivergenceSide::of(&under),
    }
}

/// Honoured belief among requests whose session was last served within a time band.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecayBucket {
    /// Lower edge, s (inclusive).
    pub lower_s: f64,
    /// Upper edge, s (exclusive); `None` for the open last bucket.
    pub upper_s: Option<f64>,
    /// Requests with a positive prediction in the band.
    pub requests: u64,
    /// Σ predicted match tokens.
    pub predicted_tokens: u64,
    /// Σ min(predicted, engine cached) tokens.
    pub honoured_tokens: u64,
    /// honoured ÷ predicted.
    pub honoured_share: Option<f64>,
}

/// Belief decay: share of predicted tokens the engine honoured, by time since the session was
/// last served.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decay {
    /// Requests of sessions the router had not seen before (a prediction there comes from a
    /// shared prefix, not from the session's own history).
    pub unseen: DecayBucket,
    /// Bands of time since the session's previous request.
    pub by_gap: Vec<DecayBucket>,
    /// Over all bands (and unseen).
    pub overall: DecayBucket,
}

fn bucket(lower_s: f64, upper_s: Option<f64>, items: &[(u64, u64)]) -> DecayBucket {
    let predicted: u64 = items.iter().map(|i| i.0).sum();
    let honoured: u64 = items.iter().map(|i| i.1).sum();
    DecayBucket {
        lower_s,
        upper_s,
        requests: items.len() as u64,
        predicted_tokens: predicted,
        honoured_tokens: honoured,
        honoured_share: (predicted > 0).then(|| honoured as f64 / predicted as f64),
    }
}

/// Belief decay of `reqs` with band edges `edges_s`.
pub fn decay(reqs: &[Request<'_>], edges_s: &[f64]) -> Decay {
    let mut unseen = Vec::new();
    let mut bands: Vec<Vec<(u64, u64)>> = vec![Vec::new(); edges_s.len() + 1];
    let mut all = Vec::new();
    for r in reqs.iter().filter(|r| r.ok) {
        let (Some(pred), Some(cached)) = (
            r.router.and_then(|x| x.predicted_match_tokens),
            r.engine_cached_tokens,
        ) else {
            continue;
        };
        if pred == 0 {
            continue;
        }
        let item = (pred, pred.min(cached));
        all.push(item);
        match r.since_last_served_s {
            None => unseen.push(item),
            Some(gap) => {
                let i = edges_s
                    .iter()
                    .position(|&e| gap < e)
                    .unwrap_or(edges_s.len());
                bands[i].push(item);
            }
        }
    }
    let by_gap = bands
        .iter()
        .enumerate()
        .map(|(i, items)| {
            let lower = if i == 0 { 0.0 } else { edges_s[i - 1] };
            bucket(lower, edges_s.get(i).copied(), items)
        })
        .collect();
    Decay {
        unseen: bucket(0.0, None, &unseen),
        by_gap,
        overall: bucket(0.0, None, &all),
    }
}

/// The index TTL and node cap that the honoured belief implies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Implied {
    /// Share of all predicted tokens the engines honoured.
    pub honoured_share: Option<f64>,
    /// Belief older than this is mostly not honoured: the lower edge of the first band (with at
    /// least `decay_min_requests`) whose honoured share is below `honour_threshold`.
    pub ttl_s: Option<f64>,
    /// True when no band fell below the threshold: the TTL is at least `ttl_s` (the upper edge
    /// of the last band observed, or its lower edge when that band is open).
    pub ttl_is_lower_bound: bool,
    /// Fleet KV capacity, tokens (from meta).
    pub capacity_tokens: Option<u64>,
    /// ⌈capacity_tokens ÷ tokens_per_block × honoured_share⌉: the nodes of belief that can be
    /// true at once.
    pub node_cap: Option<u64>,
}

impl Implied {
    /// The TTL a band of observed decay sets: `ttl_s` when a band fell below the honour
    /// threshold, `None` when `ttl_s` is only a lower bound (a bound is evidence, never a value).
    pub fn observed_ttl_s(&self) -> Option<f64> {
        self.ttl_s.filter(|_| !self.ttl_is_lower_bound)
    }

    /// The largest gap up to which belief was seen honoured, when no band fell below the
    /// threshold: a lower bound of the TTL, recorded as evidence only.
    pub fn ttl_lower_bound_s(&self) -> Option<f64> {
        self.ttl_s.filter(|_| self.ttl_is_lower_bound)
    }
}

/// The TTL and node cap implied by `decay`, for a fleet of `capacity_tokens`.
pub fn implied(decay: &Decay, capacity_tokens: Option<u64>, cfg: &MetricsConfig) -> Implied {
    let bands: Vec<&DecayBucket> = decay
        .by_gap
        .iter()
        .filter(|b| b.requests >= cfg.decay_min_requests)
        .collect();
    let stale = bands
        .iter()
        .find(|b| b.honoured_share.is_some_and(|s| s < cfg.honour_threshold));
    let (ttl_s, ttl_is_lower_bound) = match (stale, bands.last()) {
        (Some(b), _) => (Some(b.lower_s), false),
        (None, Some(last)) => (Some(last.upper_s.unwrap_or(last.lower_s)), true),
        (None, None) => (None, false),
    };
    let honoured_share = decay.overall.honoured_share;
    let node_cap = match (capacity_tokens, honoured_share) {
        (Some(cap), Some(h)) if cfg.tokens_per_block > 0 => {
            Some((cap as f64 / f64::from(cfg.tokens_per_block) * h).ceil() as u64)
        }
        _ => None,
    };
    Implied {
        honoured_share,
        ttl_s,
        ttl_is_lower_bound,
        capacity_tokens,
        node_cap,
    }
}

/// Tokens that entered the engines' prefix caches while a set of requests ran: prompt tokens
/// not served from cache (prompt − cached) plus generated tokens, which vLLM caches too once
/// they fill a block. What the LRU-cycle model of the index TTL divides the KV capacity by.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheInflow {
    /// Successful requests considered.
    pub requests: u64,
    /// Of those, the ones that report prompt, cached and output tokens (the sums are theirs).
    pub requests_reporting: u64,
    /// Σ prompt tokens.
    pub prompt_tokens: u64,
    /// Σ engine-reported cached tokens (each capped at its prompt).
    pub cached_tokens: u64,
    /// Σ generated tokens.
    pub output_tokens: u64,
    /// Σ (prompt − cached + output).
    pub new_tokens: u64,
    /// The span the requests were sent in, s.
    pub window_s: f64,
    /// `new_tokens ÷ window_s`; `None` unless every successful request reported its tokens (a
    /// partial sum would understate the rate) and the window is positive.
    pub tokens_per_s: Option<f64>,
}

/// The cache inflow of `reqs`, sent over `window_s` seconds (a closed loop in steady state
/// computes about what it sends, so the tokens of the requests sent in the window are the
/// tokens that entered the caches in it).
pub fn cache_inflow(reqs: &[Request<'_>], window_s: f64) -> CacheInflow {
    let ok: Vec<&Request<'_>> = reqs.iter().filter(|r| r.ok).collect();
    let (mut prompt, mut cached, mut output, mut reporting) = (0u64, 0u64, 0u64, 0u64);
    for r in &ok {
        if let (Some(p), Some(c), Some(o)) = (
            r.prompt_tokens,
            r.engine_cached_tokens,
            r.client.output_tokens,
        ) {
            prompt += p;
            cached += c.min(p);
            output += o;
            reporting += 1;
        }
    }
    let new_tokens = prompt - cached + output;
    let complete = reporting > 0 && reporting == ok.len() as u64;
    CacheInflow {
        requests: ok.len() as u64,
        requests_reporting: reporting,
        prompt_tokens: prompt,
        cached_tokens: cached,
        output_tokens: output,
        new_tokens,
        window_s,
        tokens_per_s: (complete && window_s > 0.0).then(|| new_tokens as f64 / window_s),
    }
}

/// Router cost per request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Overhead {
    /// Requests with a recorded overhead.
    pub requests: u64,
    /// Router overhead p50, µs.
    pub overhead_p50_us: Option<f64>,
    /// Router overhead p99, µs.
    pub overhead_p99_us: Option<f64>,
    /// Time in `decide` p50, ns.
    pub decide_p50_ns: Option<f64>,
    /// Time in `decide` p99, ns.
    pub decide_p99_ns: Option<f64>,
    /// Tokenize round trip p50, ms (exact residency only).
    pub tokenize_p50_ms: Option<f64>,
}

/// Raw router-cost samples, to pool across repetitions (and points) before taking quantiles.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OverheadSamples {
    overhead_us: Vec<f64>,
    decide_ns: Vec<f64>,
    tokenize_ms: Vec<f64>,
}

impl OverheadSamples {
    /// Adds one router row's costs.
    pub fn add(&mut self, r: &RouterRow) {
        self.overhead_us.extend(r.overhead_us.map(|us| us as f64));
        self.decide_ns.extend(r.decide_ns.map(|d| d as f64));
        self.tokenize_ms.extend(r.tokenize_ms);
    }

    /// Adds every sample of `other`.
    pub fn extend(&mut self, other: &OverheadSamples) {
        self.overhead_us.extend_from_slice(&other.overhead_us);
        self.decide_ns.extend_from_slice(&other.decide_ns);
        self.tokenize_ms.extend_from_slice(&other.tokenize_ms);
    }

    /// Nothing was recorded (no router rows, or rows without costs).
    pub fn is_empty(&self) -> bool {
        self.overhead_us.is_empty() && self.decide_ns.is_empty() && self.tokenize_ms.is_empty()
    }

    /// Quantiles of what was added.
    pub fn summary(&self) -> Overhead {
        Overhead {
            requests: self.overhead_us.len() as u64,
            overhead_p50_us: quantile(&self.overhead_us, 0.5),
            overhead_p99_us: quantile(&self.overhead_us, 0.99),
            decide_p50_ns: quantile(&self.decide_ns, 0.5),
            decide_p99_ns: quantile(&self.decide_ns, 0.99),
            tokenize_p50_ms: quantile(&self.tokenize_ms, 0.5),
        }
    }
}

/// Router overhead of `rows`.
pub fn overhead<'a>(rows: impl Iterator<Item = &'a RouterRow>) -> Overhead {
    let mut samples = OverheadSamples::default();
    rows.for_each(|r| samples.add(r));
    samples.summary()
}

/// Decision branches and how often each was taken.
pub fn branch_counts(reqs: &[Request<'_>]) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for b in reqs
        .iter()
        .filter_map(|r| r.router.and_then(|x| x.branch.as_deref()))
    {
        *out.entry(b.to_string()).or_default() += 1;
    }
    out
}

/// Everything measured in one repetition.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RepMetrics {
    /// `k` of `rep-<k>`.
    pub rep: u32,
    /// Measured window length, s.
    pub window_s: f64,
    /// Requests meeting the SLO in the window ÷ window length, req/s.
    pub goodput_rps: f64,
    /// Latency and SLO counts.
    pub latency: Latency,
    /// SLO attainment of the requests routed to the busiest replica (most routed requests, by
    /// the router rows); `None` without router rows. A policy that piles load on one replica
    /// can hold a fair fleet-wide attainment while that replica's users miss. Turns the driver
    /// abandoned reached no replica and are not in it (in an overloaded cell it reads high).
    #[serde(default)]
    pub busiest_replica_attainment: Option<f64>,
    /// Mechanism figures, all / first / later turns.
    pub mechanism: Split<Mechanism>,
    /// Belief divergence.
    pub divergence: Divergence,
    /// Router overhead over the measured requests.
    pub overhead: Overhead,
    /// Decision branches.
    pub branches: BTreeMap<String, u64>,
    /// Whether a router.csv was present.
    pub has_router_rows: bool,
    /// Measured requests without a router row although the rep has router rows (abandoned
    /// turns, never sent, are not counted).
    pub unjoined_requests: u64,
}

/// Computes a repetition's metrics from its measured requests.
pub fn rep_metrics(rep: &RepData, reqs: &[Request<'_>], cfg: &MetricsConfig) -> RepMetrics {
    let window_s = rep.meta.window.measured_s();
    let lat = latency(reqs);
    let has_router_rows = rep.router.is_some();
    let mechanism = split(reqs, |r| mechanism(r, cfg.hot_conversations));
    let busiest_replica_attainment = mechanism.all.busiest_replica.and_then(|b| {
        let on: Vec<&Request<'_>> = reqs
            .iter()
            .filter(|r| r.router.and_then(|x| x.replica) == Some(b))
            .collect();
        (!on.is_empty()).then(|| on.iter().filter(|r| r.good).count() as f64 / on.len() as f64)
    });
    RepMetrics {
        rep: rep.rep,
        window_s,
        goodput_rps: lat.good as f64 / window_s,
        latency: lat,
        busiest_replica_attainment,
        mechanism,
        divergence: divergence(reqs),
        overhead: overhead(reqs.iter().filter_map(|r| r.router)),
        branches: branch_counts(reqs),
        has_router_rows,
        unjoined_requests: if has_router_rows {
            // An abandoned turn was never sent, so it has no router row by design.
            reqs.iter()
                .filter(|r| r.router.is_none())
                .filter(|r| !r.client.error.as_deref().is_some_and(is_abandoned))
                .count() as u64
        } else {
            0
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::{Meta, Window};
    use std::path::PathBuf;

    const SLO: Slo = Slo {
        ttft_ms: 990.0,
        itl_ms: 24.0,
    };

    fn client(id: &str, session: &str, turn: u32, sent_s: f64) -> ClientRow {
        ClientRow {
            request_id: id.into(),
            session_id: Some(session.into()),
            turn,
            scheduled_s: Some(sent_s),
            sent_s: Some(sent_s),
            first_token_s: None,
            last_s: None,
            ttft_ms: Some(100.0),
            itl_p50_ms: Some(10.0),
            tpot_ms: None,
            e2el_ms: None,
            prompt_tokens: Some(1000),
            output_tokens: Some(10),
            cached_tokens: None,
            status: 200,
            error: None,
            warmup: false,
            send_lag_ms: None,
            chunks: 0,
        }
    }

    fn router(
        id: &str,
        session: &str,
        arrival_s: f64,
        predicted: u64,
        cached: Option<u64>,
    ) -> RouterRow {
        RouterRow {
            request_id: id.into(),
            session_id: Some(session.into()),
            arrival_s,
            policy: "prefix-affinity".into(),
            replica: Some(0),
            branch: Some("match".into()),
            predicted_match_tokens: Some(predicted),
            outstanding_chosen: None,
            outstanding_min: None,
            decide_ns: None,
            overhead_us: None,
            tokenize_ms: None,
            upstream_status: Some(200),
            cached_tokens: cached,
            prompt_tokens: Some(1000),
            error: None,
            attempts: 1,
        }
    }

    fn rep(client: Vec<ClientRow>, router: Option<Vec<RouterRow>>) -> RepData {
        let meta: Meta = serde_json::from_value(serde_json::json!({
            "workload_name": "w", "plan_fingerprint": 42,
            "slo": {"ttft_ms": 990.0, "itl_ms": 24.0},
            "window": {"warmup_s": 0.0, "measured_start_s": 0.0, "measured_end_s": 100.0},
            "fleet": {"capacity_tokens": 16000}, "complete": true
        }))
        .unwrap();
        assert_eq!(meta.plan_fingerprint, "42");
        assert_eq!(
            meta.window,
            Window {
                warmup_s: 0.0,
                measured_start_s: 0.0,
                measured_end_s: 100.0,
                clock: WindowClock::Sent,
            }
        );
        RepData {
            point: "p".into(),
            policy: "prefix-affinity".into(),
            rep: 1,
            dir: PathBuf::new(),
            meta,
            client,
            router,
        }
    }

    #[test]
    fn goodput_series_buckets_by_send_time() {
        let mut rows: Vec<ClientRow> = (0..10)
            .map(|i| client(&format!("r{i}"), "s", 1, f64::from(i) * 0.5))
            .collect();
        rows[5].error = Some("timeout: 30 s".into());
        let s = goodput_series(&rows, &SLO, WindowClock::Sent, 0.0, 5.0, 2.0);
        // buckets [0,2) [2,4) [4,5): sends at 0..1.5, 2..3.5 (2.5 failed), 4..4.5
        let got: Vec<(u64, u64)> = s.iter().map(|b| (b.requests, b.good)).collect();
        assert_eq!(got, [(4, 4), (4, 3), (2, 2)]);
        assert_eq!(s[1].goodput_rps, 1.5);
        assert!(goodput_series(&rows, &SLO, WindowClock::Sent, 0.0, 5.0, 0.0).is_empty());
    }

    /// A repetition with a 5 s warm-up and a window to 100 s; `clock` as `meta.json` writes it
    /// (`None`: absent, as a closed loop's and every file before the field).
    fn rep_on(client: Vec<ClientRow>, clock: Option<&str>) -> RepData {
        let mut window = serde_json::json!(
            {"warmup_s": 5.0, "measured_start_s": 5.0, "measured_end_s": 100.0}
        );
        if let Some(c) = clock {
            window["clock"] = c.into();
        }
        let mut r = rep(client, None);
        r.meta.window = serde_json::from_value(window).unwrap();
        r
    }

    #[test]
    fn an_open_loop_counts_turns_by_their_scheduled_time_and_their_wait_against_the_slo() {
        let queued = |id: &str, scheduled_s: f64, sent_s: f64| {
            let mut c = client(id, id, 1, sent_s);
            c.scheduled_s = Some(scheduled_s);
            c.send_lag_ms = Some((sent_s - scheduled_s) * 1e3);
            c
        };
        let rows = vec![
            // scheduled in the warm-up, held back by its conversation's previous turn past it
            queued("early", 4.0, 6.0),
            // on time: 100 ms TTFT either way
            queued("on-time", 10.0, 10.0),
            // waited 1.5 s in the driver: TTFT 1,600 ms from its scheduled time
            queued("waited", 20.0, 21.5),
            // scheduled in the window, sent only after it ended
            queued("late", 99.5, 101.0),
        ];
        let open = rep_on(rows.clone(), Some("scheduled"));
        let reqs = measured_requests(&open, &SLO);
        let ids: Vec<&str> = reqs.iter().map(|r| r.client.request_id.as_str()).collect();
        assert_eq!(ids, ["on-time", "waited", "late"]);
        let lat = latency(&reqs);
        assert_eq!((lat.requests, lat.good, lat.missed_ttft), (3, 1, 2));
        assert_eq!(lat.ttft_p50_ms, Some(1600.0));
        assert_eq!(lat.ttft_p99_ms.map(|t| t.round()), Some(1600.0));
        // A closed loop (and any meta.json without a clock) places rows by their send time and
        // judges the TTFT from the send, as before.
        let closed = rep_on(rows, None);
        let reqs = measured_requests(&closed, &SLO);
        let ids: Vec<&str> = reqs.iter().map(|r| r.client.request_id.as_str()).collect();
        assert_eq!(ids, ["early", "on-time", "waited"]);
        assert_eq!(latency(&reqs).good, 3);
    }

    /// A turn the driver abandoned (never sent: it had waited past the TTFT bound behind its
    /// conversation's previous turn after the run's end) is measured by its scheduled time and
    /// missed the TTFT bound — not an error, and outside the TTFT percentiles (it has no TTFT).
    #[test]
    fn an_abandoned_turn_is_a_ttft_miss() {
        let mut abandoned = client("gone", "gone", 2, 0.0);
        abandoned.scheduled_s = Some(99.0);
        abandoned.sent_s = None;
        abandoned.ttft_ms = None;
        abandoned.itl_p50_ms = None;
        abandoned.status = 0;
        abandoned.error = Some(
            "abandoned: not sent; after the run's end it had waited 1200 ms behind its conversation's previous turn, past the 166 ms TTFT bound".into(),
        );
        assert_eq!(
            slo_miss(&abandoned, &SLO, WindowClock::Scheduled),
            SloMiss {
                ttft: true,
                ..SloMiss::default()
            }
        );
        let rows = vec![client("ok", "ok", 1, 50.0), abandoned];
        let rep = rep_on(rows, Some("scheduled"));
        let reqs = measured_requests(&rep, &SLO);
        let lat = latency(&reqs);
        assert_eq!((lat.requests, lat.good, lat.missed_ttft), (2, 1, 1));
        assert_eq!((lat.errors, lat.ttft_p99_ms), (0, Some(100.0)));
    }

    #[test]
    fn good_means_strictly_below_both_bounds_without_error() {
        let ok = client("a", "s", 1, 1.0);
        assert!(is_good(&ok, &SLO, WindowClock::Sent));
        let at_bound = ClientRow {
            ttft_ms: Some(990.0),
            ..ok.clone()
        };
        assert!(!is_good(&at_bound, &SLO, WindowClock::Sent));
        let slow_itl = ClientRow {
            itl_p50_ms: Some(24.0),
            ..ok.clone()
        };
        assert!(!is_good(&slow_itl, &SLO, WindowClock::Sent));
        let failed = ClientRow {
            error: Some("stream: reset".into()),
            ..ok.clone()
        };
        assert!(!is_good(&failed, &SLO, WindowClock::Sent));
        let http_500 = ClientRow {
            status: 500,
            ..ok.clone()
        };
        assert!(!is_good(&http_500, &SLO, WindowClock::Sent));
        // one output token: no gaps, so no ITL to miss; several tokens without ITL: not measured
        let one = ClientRow {
            itl_p50_ms: None,
            output_tokens: Some(1),
            ..ok.clone()
        };
        assert!(is_good(&one, &SLO, WindowClock::Sent));
        let unmeasured = ClientRow {
            itl_p50_ms: None,
            ..ok
        };
        assert!(!is_good(&unmeasured, &SLO, WindowClock::Sent));
    }

    #[test]
    fn only_requests_just_over_a_bound_are_verdicts_lateness_could_flip() {
        let window = Window {
            warmup_s: 0.0,
            measured_start_s: 0.0,
            measured_end_s: 10.0,
            clock: WindowClock::Scheduled,
        };
        let ok = client("a", "s", 1, 1.0);
        let with = |ttft_ms: f64, itl_ms: f64, send_lag_s: f64| ClientRow {
            ttft_ms: Some(ttft_ms),
            itl_p50_ms: Some(itl_ms),
            sent_s: Some(1.0 + send_lag_s),
            ..ok.clone()
        };
        let rows = vec![
            with(100.0, 10.0, 0.0),    // well within: lateness cannot flip it
            with(990.0, 10.0, 0.0),    // TTFT at the bound: missed by 0 < 2 ms
            with(991.5, 10.0, 0.0),    // missed by 1.5 ms
            with(992.0, 10.0, 0.0),    // missed by 2 ms: more than lateness could add
            with(100.0, 25.9, 0.0),    // ITL p50 missed by 1.9 ms
            with(989.0, 10.0, 0.0015), // 989 ms + 1.5 ms waited in the driver: missed by 0.5 ms
            ClientRow {
                status: 500,
                ..with(990.5, 10.0, 0.0)
            }, // failed: not a lateness verdict
            ClientRow {
                warmup: true,
                ..with(990.5, 10.0, 0.0)
            }, // warm-up: not measured
            ClientRow {
                scheduled_s: Some(11.0),
                sent_s: Some(11.0),
                ..with(990.5, 10.0, 0.0)
            }, // after the window
        ];
        let share = missed_by_less_than_share(&rows, &SLO, &window, 2.0).unwrap();
        assert!((share - 4.0 / 7.0).abs() < 1e-12, "{share}");
        assert_eq!(
            missed_by_less_than_share(&rows, &SLO, &window, 0.0),
            Some(0.0)
        );
        assert_eq!(missed_by_less_than_share(&[], &SLO, &window, 2.0), None);
    }

    #[test]
    fn absent_cached_reads_as_zero_only_when_the_rep_reports_cached_tokens() {
        let mut c = vec![client("a", "s", 1, 1.0), client("b", "s", 2, 2.0)];
        let r = rep(c.clone(), None);
        let reqs = measured_requests(&r, &SLO);
        assert_eq!(reqs[0].engine_cached_tokens, None);
        assert_eq!(mechanism(&reqs, 10).prefix_hit_rate, None);
        c[1].cached_tokens = Some(500);
        let r = rep(c, None);
        let reqs = measured_requests(&r, &SLO);
        assert_eq!(reqs[0].engine_cached_tokens, Some(0));
        assert_eq!(mechanism(&reqs, 10).prefix_hit_rate, Some(0.25));
        // turns are 1-based here; the first turn is the lowest turn in the file
        assert!(reqs[0].first_turn && !reqs[1].first_turn);
    }

    #[test]
    fn decay_buckets_by_gap_since_the_session_was_last_served() {
        // session s: arrivals 0, 0.5 (gap 0.5), 10.5 (gap 10); session t: 3 (unseen), 40 (gap 37)
        let c = vec![
            client("a", "s", 1, 0.0),
            client("b", "s", 2, 0.5),
            client("c", "s", 3, 10.5),
            client("d", "t", 1, 3.0),
            client("e", "t", 2, 40.0),
        ];
        let r = vec![
            router("a", "s", 100.0, 0, Some(0)),
            router("b", "s", 100.5, 512, Some(512)),
            router("c", "s", 110.5, 1000, Some(200)),
            router("d", "t", 103.0, 64, Some(64)),
            router("e", "t", 140.0, 800, Some(900)),
        ];
        let data = rep(c, Some(r));
        let reqs = measured_requests(&data, &SLO);
        let d = decay(&reqs, &MetricsConfig::default().decay_edges_s);
        assert_eq!((d.unseen.requests, d.unseen.honoured_tokens), (1, 64));
        let find = |lower: f64| d.by_gap.iter().find(|b| b.lower_s == lower).unwrap();
        assert_eq!(find(0.0).honoured_share, Some(1.0));
        assert_eq!(
            (find(10.0).predicted_tokens, find(10.0).honoured_tokens),
            (1000, 200)
        );
        // under-prediction honours all that was predicted, never more
        assert_eq!(
            (find(30.0).predicted_tokens, find(30.0).honoured_tokens),
            (800, 800)
        );
        assert_eq!(d.overall.predicted_tokens, 512 + 1000 + 64 + 800);
        let cfg = MetricsConfig {
            decay_min_requests: 1,
            ..MetricsConfig::default()
        };
        let imp = implied(&d, data.meta.capacity_tokens(), &cfg);
        // the 10–20 s band honours 20% < 50%: belief older than 10 s is stale
        assert_eq!((imp.ttl_s, imp.ttl_is_lower_bound), (Some(10.0), false));
        let h = (512.0 + 200.0 + 64.0 + 800.0) / 2376.0;
        assert_eq!(imp.honoured_share, Some(h));
        assert_eq!(imp.node_cap, Some((1000.0 * h).ceil() as u64));
    }

    #[test]
    fn implied_ttl_is_a_lower_bound_when_belief_never_goes_stale() {
        let c = vec![client("a", "s", 1, 0.0), client("b", "s", 2, 3.0)];
        let r = vec![
            router("a", "s", 0.0, 0, Some(0)),
            router("b", "s", 3.0, 100, Some(100)),
        ];
        let data = rep(c, Some(r));
        let reqs = measured_requests(&data, &SLO);
        let cfg = MetricsConfig {
            decay_min_requests: 1,
            ..MetricsConfig::default()
        };
        let imp = implied(&decay(&reqs, &cfg.decay_edges_s), None, &cfg);
        assert_eq!((imp.ttl_s, imp.ttl_is_lower_bound), (Some(5.0), true));
        assert_eq!(imp.node_cap, None);
        // The bound is evidence, never the TTL.
        assert_eq!(imp.observed_ttl_s(), None);
        assert_eq!(imp.ttl_lower_bound_s(), Some(5.0));
    }

    #[test]
    fn an_observed_band_is_the_ttl_and_no_lower_bound() {
        let imp = Implied {
            honoured_share: Some(0.9),
            ttl_s: Some(10.0),
            ttl_is_lower_bound: false,
            capacity_tokens: None,
            node_cap: None,
        };
        assert_eq!(imp.observed_ttl_s(), Some(10.0));
        assert_eq!(imp.ttl_lower_bound_s(), None);
    }

    #[test]
    fn cache_inflow_counts_uncached_prompt_and_generated_tokens() {
        let mut c = vec![client("a", "s", 1, 0.0), client("b", "s", 2, 1.0)];
        for (row, (p, cached, o)) in c.iter_mut().zip([(1000, 0, 100), (1300, 1008, 100)]) {
            row.prompt_tokens = Some(p);
            row.cached_tokens = Some(cached);
            row.output_tokens = Some(o);
        }
        let data = rep(c.clone(), None);
        let reqs = measured_requests(&data, &SLO);
        let f = cache_inflow(&reqs, 4.0);
        // (1000 − 0 + 100) + (1300 − 1008 + 100) = 1492 tokens over 4 s.
        assert_eq!(
            (f.new_tokens, f.requests, f.requests_reporting),
            (1492, 2, 2)
        );
        assert_eq!(f.tokens_per_s, Some(373.0));
        // A request that does not report its output leaves the rate unknown, not understated.
        c[1].output_tokens = None;
        let data = rep(c, None);
        let f = cache_inflow(&measured_requests(&data, &SLO), 4.0);
        assert_eq!((f.requests_reporting, f.tokens_per_s), (1, None));
        assert_eq!(cache_inflow(&[], 4.0).tokens_per_s, None);
    }
}

#[cfg(test)]
mod props {
    use super::*;
    use proptest::prelude::*;

    fn rows(pairs: &[(u64, u64)]) -> (Vec<ClientRow>, Vec<RouterRow>) {
        let client = pairs
            .iter()
            .enumerate()
            .map(|(i, &(_, cached))| ClientRow {
                request_id: format!("r{i}"),
                session_id: Some(format!("s{}", i % 3)),
                turn: 1,
                scheduled_s: None,
                sent_s: Some(i as f64),
                first_token_s: None,
                last_s: None,
                ttft_ms: Some(10.0),
                itl_p50_ms: Some(1.0),
                tpot_ms: None,
                e2el_ms: None,
                prompt_tokens: Some(10_000),
                output_tokens: Some(4),
                cached_tokens: Some(cached),
                status: 200,
                error: None,
                warmup: false,
                send_lag_ms: None,
                chunks: 0,
            })
            .collect();
        let router = pairs
            .iter()
            .enumerate()
            .map(|(i, &(pred, _))| RouterRow {
                request_id: format!("r{i}"),
                session_id: Some(format!("s{}", i % 3)),
                arrival_s: i as f64,
                policy: "prefix-affinity".into(),
                replica: Some((i % 4) as u32),
                branch: Some("match".into()),
                predicted_match_tokens: Some(pred),
                outstanding_chosen: None,
                outstanding_min: None,
                decide_ns: None,
                overhead_us: None,
                tokenize_ms: None,
                upstream_status: None,
                cached_tokens: None,
                prompt_tokens: None,
                error: None,
                attempts: 0,
            })
            .collect();
        (client, router)
    }

    proptest! {
        // A fixed seed: the same cases on every run and machine.
        #![proptest_config(ProptestConfig {
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x006b_7672_6f75_7465),
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        /// Over- and under-prediction partition the compared requests and their sizes add up to
        /// the absolute differences: nothing cancels.
        #[test]
        fn divergence_sides_partition_and_never_cancel(
            pairs in proptest::collection::vec((prop_oneof![Just(0u64), 0u64..4096], 0u64..4096), 0..60)
        ) {
            let (client, router) = rows(&pairs);
            let reqs: Vec<Request<'_>> = client
                .iter()
                .zip(&router)
                .map(|(c, r)| Request {
                    client: c,
                    router: Some(r),
                    first_turn: false,
                    good: true,
                    miss: SloMiss::default(),
                    ttft_ms: c.ttft_ms,
                    ok: true,
                    prompt_tokens: c.prompt_tokens,
                    engine_cached_tokens: c.cached_tokens,
                    since_last_served_s: Some(1.5),
                })
                .collect();
            let d = divergence(&reqs);
            if pairs.iter().all(|p| p.0 == 0) {
                // no belief at all: nothing to compare
                prop_assert_eq!(d, Divergence::default());
                return Ok(());
            }
            prop_assert_eq!(d.compared, pairs.len() as u64);
            prop_assert_eq!(d.over.count + d.under.count + d.exact, d.compared);
            let over: u64 = pairs.iter().filter(|p| p.0 > p.1).map(|p| p.0 - p.1).sum();
            let under: u64 = pairs.iter().filter(|p| p.0 < p.1).map(|p| p.1 - p.0).sum();
            prop_assert_eq!(d.over.tokens_total, over);
            prop_assert_eq!(d.under.tokens_total, under);
            let dec = decay(&reqs, &MetricsConfig::default().decay_edges_s);
            prop_assert!(dec.overall.honoured_tokens <= dec.overall.predicted_tokens);
            let busiest = mechanism(&reqs, 10).busiest_share;
            if !pairs.is_empty() {
                let b = busiest.unwrap();
                prop_assert!((0.25..=1.0).contains(&b));
            }
        }

        /// A quantile lies between the smallest and largest value and grows with q.
        #[test]
        fn quantiles_are_bounded_and_monotone(
            v in proptest::collection::vec(-1e6f64..1e6, 1..50),
            q1 in 0.0f64..=1.0,
            q2 in 0.0f64..=1.0,
        ) {
            let (lo, hi) = if q1 <= q2 { (q1, q2) } else { (q2, q1) };
            let a = crate::stats::quantile(&v, lo).unwrap();
            let b = crate::stats::quantile(&v, hi).unwrap();
            let min = v.iter().copied().fold(f64::INFINITY, f64::min);
            let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            prop_assert!(min <= a && a <= b && b <= max);
        }
    }
}
