//! Closed-loop and open-loop runs of a plan: scheduling, rows, progress, summary.
//!
//! Both drivers honour "one turn of a conversation in flight at a time":
//! - closed loop: a conversation belongs to one user for a whole walk (turn 1 to its last
//!   turn, think times included). A user whose next draw is owned by another user skips it
//!   (drops it) and takes the first free draw among its next `workload::SKIP_WINDOW_DRAWS`
//!   draws (script draws, then the plan's spare draws). Only when the whole window is owned
//!   does it wait, FIFO, for the first one (the wait shows in `send_lag_ms`). Slot `k` of a
//!   user's script keeps its think time, turn and request id `u{user}-{k}`; only the walk's
//!   conversation may change. The rule lives in `workload::WalkCursor`, which the simulator
//!   drives too;
//! - open loop: the arrivals are grouped per conversation and each conversation's arrivals are
//!   sent by one task, in order: an arrival is sent at its scheduled time, or as soon as the
//!   conversation's previous turn completes if that is later. Gaps are never rescaled; lateness
//!   is recorded per row as `send_lag_ms`.
//!
//! With shared conversations (`workload::Sharing::Shared`) neither rule holds a conversation:
//! closed-loop users walk their scripts as drawn (the cursor never claims, skips or waits), and
//! every open-loop arrival is sent at its scheduled time even while its conversation's previous
//! turn is in flight.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use schema::stats::quantile_in_place;
use workload::{Pick, Plan, Schedule, WalkCursor, closed_request_id, open_request_id};

use crate::DriverError;
use crate::client::{ChatRequest, Outcome, Requester, chat_body};
use crate::metrics::latencies;
use crate::rows::{ClientRow, RowWriter};

/// Send lag (p90) above which the summary warns that the schedule was not kept.
const LATE_SEND_WARN_MS: f64 = 100.0;

/// When to draw the progress line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProgressMode {
    /// Only when stderr is a terminal.
    #[default]
    Auto,
    /// Never.
    Off,
    /// Always (even into a file).
    On,
}

/// How to run a plan.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// Base URL of the server (router, replica or vLLM), e.g. `http://127.0.0.1:8000`.
    pub url: String,
    /// Where `client.csv` goes (rows stream into `<out>.partial` until the run ends).
    pub out: PathBuf,
    /// Model name; `None` = the first id of `GET /v1/models`.
    pub model: Option<String>,
    /// Requests sent before this many seconds are flagged `warmup = 1`.
    pub warmup_s: f64,
    /// A request not finished this many seconds after it was sent fails with `timeout`.
    pub timeout_s: f64,
    /// Stop sending new requests after this many seconds (in-flight ones finish).
    pub duration_s: Option<f64>,
    /// Open loop, one turn at a time per conversation: once `duration_s` has passed, a turn
    /// still queued behind its conversation's previous turn that has already waited longer
    /// than this past its schedule is not sent; it gets a row with an `abandoned:` error. Give
    /// it the SLO's TTFT bound: such a turn has missed the SLO whatever happens next (its TTFT
    /// counts from the scheduled time), so the run ends without draining a backlog that
    /// cannot change a verdict. `None`: every scheduled turn is sent.
    pub abandon_after_s: Option<f64>,
    /// Check the server with `GET /v1/models` before starting (clear error when unreachable).
    pub preflight: bool,
    /// Progress line on stderr.
    pub progress: ProgressMode,
    /// Also rewrite the progress line into this file once a second, whatever `progress` says: an
    /// orchestrator that sends the driver's stderr to a log reads it from there and shows it on
    /// its own terminal.
    pub progress_file: Option<PathBuf>,
    /// Reuse connections between requests (a keep-alive pool). Off (`--no-keep-alive`): one
    /// connection per request, for a server that closes a connection after a streamed response
    /// while announcing keep-alive (llama.cpp's `llama-server`, driven directly).
    pub keep_alive: bool,
}

impl RunConfig {
    /// Defaults: no warm-up, 600 s request timeout, no duration cap, preflight on, progress on
    /// a terminal.
    pub fn new(url: impl Into<String>, out: impl Into<PathBuf>) -> Self {
        Self {
            url: url.into(),
            out: out.into(),
            model: None,
            warmup_s: 0.0,
            timeout_s: 600.0,
            duration_s: None,
            abandon_after_s: None,
            preflight: true,
            progress: ProgressMode::Auto,
            progress_file: None,
            keep_alive: true,
        }
    }

    fn validate(&self) -> Result<(), DriverError> {
        let bad = |m: String| Err(DriverError::Config(m));
        if !self.warmup_s.is_finite() || self.warmup_s < 0.0 {
            return bad(format!("warm-up must be >= 0 s, got {}", self.warmup_s));
        }
        if !self.timeout_s.is_finite() || self.timeout_s <= 0.0 {
            return bad(format!("timeout must be > 0 s, got {}", self.timeout_s));
        }
        if let Some(d) = self.duration_s
            && (!d.is_finite() || d <= 0.0)
        {
            return bad(format!("duration must be > 0 s, got {d}"));
        }
        if let Some(a) = self.abandon_after_s {
            if !a.is_finite() || a < 0.0 {
                return bad(format!("abandon-after must be >= 0 s, got {a}"));
            }
            if self.duration_s.is_none() {
                return bad(
                    "abandoning queued turns needs a duration (it applies after it)".into(),
                );
            }
        }
        if !self.preflight && self.model.is_none() {
            return bad("a model name is required when the preflight is off".into());
        }
        Ok(())
    }
}

/// p50 / p90 / p99 of a metric, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Quantiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Quantiles {
    /// The quantiles of `values` (reordered), by `schema::stats` — the report's definition;
    /// `None` when there are no values.
    pub fn of(values: &mut [f64]) -> Option<Self> {
        Some(Self {
            p50: quantile_in_place(values, 0.5)?,
            p90: quantile_in_place(values, 0.90)?,
            p99: quantile_in_place(values, 0.99)?,
        })
    }
}

/// What a run did, for the summary table and for the sweep's bookkeeping.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RunSummary {
    /// `closed` or `open`.
    pub mode: String,
    /// The model requested.
    pub model: String,
    /// [`Plan::name`].
    pub plan_name: String,
    /// [`Plan::fingerprint_hex`].
    pub plan_fingerprint: String,
    /// The final `client.csv`.
    pub out: PathBuf,
    /// Rows written (requests sent or attempted).
    pub requests: u64,
    /// Planned requests never sent (duration cap reached).
    pub not_sent: u64,
    /// Closed loop: draws a user passed over because another user owned the conversation
    /// (`workload::walk`); 0 in the open loop.
    pub skipped_draws: u64,
    /// Rows without error.
    pub ok: u64,
    /// Rows with an error.
    pub errors: u64,
    /// Errors per kind (`connect`, `timeout`, `http`, `stream`, `sse`, `upstream`).
    pub errors_by_kind: BTreeMap<String, u64>,
    /// Rows flagged warm-up.
    pub warmup_requests: u64,
    /// Clock start to the last response, seconds.
    pub elapsed_s: f64,
    /// End of warm-up to the last response, seconds.
    pub measured_s: f64,
    /// Successful measured requests per second of the measured window.
    pub throughput_rps: f64,
    /// TTFT over successful measured requests.
    pub ttft_ms: Option<Quantiles>,
    /// Per-request ITL p50, distribution over successful measured requests.
    pub itl_p50_ms: Option<Quantiles>,
    /// End-to-end latency over successful measured requests.
    pub e2el_ms: Option<Quantiles>,
    /// Send lag over all rows.
    pub send_lag_ms: Option<Quantiles>,
    /// Output tokens over all rows.
    pub output_tokens: u64,
    /// Content chunks over all rows.
    pub chunks: u64,
}

impl std::fmt::Display for RunSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "plan      {} ({})",
            self.plan_name, self.plan_fingerprint
        )?;
        writeln!(f, "mode      {}   model {}", self.mode, self.model)?;
        writeln!(
            f,
            "requests  {} sent, {} ok, {} errors, {} warm-up, {} not sent, {} skipped draws",
            self.requests,
            self.ok,
            self.errors,
            self.warmup_requests,
            self.not_sent,
            self.skipped_draws
        )?;
        if !self.errors_by_kind.is_empty() {
            let kinds: Vec<String> = self
                .errors_by_kind
                .iter()
                .map(|(k, n)| format!("{k} {n}"))
                .collect();
            writeln!(f, "errors    {}", kinds.join(", "))?;
        }
        writeln!(
            f,
            "window    {:.1} s elapsed, {:.1} s measured, {:.2} ok req/s, {} chunks, {} output tokens",
            self.elapsed_s, self.measured_s, self.throughput_rps, self.chunks, self.output_tokens
        )?;
        writeln!(
            f,
            "{:<14}{:>10}{:>10}{:>10}",
            "metric (ms)", "p50", "p90", "p99"
        )?;
        for (name, q) in [
            ("ttft", self.ttft_ms),
            ("itl p50", self.itl_p50_ms),
            ("e2el", self.e2el_ms),
            ("send lag", self.send_lag_ms),
        ] {
            match q {
                Some(q) => writeln!(f, "{name:<14}{:>10.2}{:>10.2}{:>10.2}", q.p50, q.p90, q.p99)?,
                None => writeln!(f, "{name:<14}{:>10}{:>10}{:>10}", "-", "-", "-")?,
            }
        }
        if let Some(lag) = self.send_lag_ms.filter(|q| q.p90 > LATE_SEND_WARN_MS) {
            writeln!(
                f,
                "warning   10% of sends were ≥ {:.0} ms behind schedule (p99 {:.0} ms): turns \
                 waited for their conversation's previous turn; see send_lag_ms",
                lag.p90, lag.p99
            )?;
        }
        write!(f, "rows      {}", self.out.display())
    }
}

/// Live counters behind the progress line and the summary.
struct Sink {
    writer: Option<RowWriter>,
    write_error: Option<DriverError>,
    done: u64,
    errors: u64,
    errors_by_kind: BTreeMap<String, u64>,
    warmup: u64,
    last_end: Duration,
    ttft: Vec<f64>,
    itl: Vec<f64>,
    e2el: Vec<f64>,
    lag: Vec<f64>,
    /// Every TTFT so far (measured or not) for the progress line.
    progress_ttft: hdrhistogram::Histogram<u64>,
    output_tokens: u64,
    chunks: u64,
}

impl Sink {
    fn record(&mut self, row: &ClientRow, end: Duration) {
        if self.write_error.is_none()
            && let Some(w) = self.writer.as_mut()
            && let Err(e) = w.write(row)
        {
            self.write_error = Some(e);
        }
        self.done += 1;
        self.last_end = self.last_end.max(end);
        self.output_tokens += row.output_tokens.unwrap_or(0);
        self.chunks += u64::from(row.chunks);
        if let Some(l) = row.send_lag_ms {
            self.lag.push(l);
        }
        if row.warmup {
            self.warmup += 1;
        }
        if !row.is_ok() {
            self.errors += 1;
            *self
                .errors_by_kind
                .entry(row.error_kind().to_owned())
                .or_default() += 1;
            return;
        }
        if let Some(t) = row.ttft_ms {
            self.progress_ttft.saturating_record((t * 1e3) as u64);
        }
        if !row.warmup {
            self.ttft.extend(row.ttft_ms);
            self.itl.extend(row.itl_p50_ms);
            self.e2el.extend(row.e2el_ms);
        }
    }
}

/// What every task shares: the workload `W` (a plan, or a trace replay) and the run's state.
pub(crate) struct Shared<W = Plan> {
    pub(crate) plan: Arc<W>,
    pub(crate) requester: Requester,
    pub(crate) model: String,
    warmup: Duration,
    stop_at: Option<Duration>,
    abandon_after: Option<Duration>,
    sink: Mutex<Sink>,
}

/// What the summary names a workload by.
pub(crate) trait Named {
    /// The plan's name.
    fn plan_name(&self) -> String;
    /// The plan's fingerprint, hex.
    fn plan_fingerprint(&self) -> Result<String, DriverError>;
}

impl Named for Plan {
    fn plan_name(&self) -> String {
        self.name()
    }

    fn plan_fingerprint(&self) -> Result<String, DriverError> {
        self.fingerprint_hex()
            .map_err(|e| DriverError::Plan(e.to_string()))
    }
}

impl<W> Shared<W> {
    pub(crate) fn stopped(&self, scheduled: Duration) -> bool {
        self.stop_at.is_some_and(|s| scheduled >= s)
    }

    /// How long a turn scheduled at `scheduled` has waited, when it is to be abandoned: the run
    /// is past its stop time and the wait exceeds `abandon_after` (see
    /// [`RunConfig::abandon_after_s`]).
    fn abandoned_wait(&self, scheduled: Duration) -> Option<Duration> {
        let (stop, limit) = (self.stop_at?, self.abandon_after?);
        let now = self.requester.clock_start().elapsed();
        let wait = now.saturating_sub(scheduled);
        (now >= stop && wait > limit).then_some(wait)
    }
}

impl Shared {
    /// Sends one planned request, asking for `max_tokens` (`workload::Arrival::max_tokens` for
    /// an open loop's arrival), and records its row.
    async fn fire(
        &self,
        request_id: &str,
        conversation: u32,
        turn: u32,
        max_tokens: u32,
        scheduled: Duration,
    ) {
        let session_id = self.plan.session_id(conversation);
        let body = match self.plan.messages(conversation, turn) {
            Ok(m) => chat_body(&self.model, &m, max_tokens),
            Err(e) => {
                // Plans are checked on load, so this is a bug, but it still becomes a row.
                let outcome = Outcome {
                    sent: self.requester.clock_start().elapsed(),
                    error: Some(format!("http: {e}")),
                    ..Outcome::default()
                };
                self.record(request_id, &session_id, turn, scheduled, &outcome);
                return;
            }
        };
        let req = ChatRequest {
            request_id,
            session_id: &session_id,
            body,
        };
        let outcome = self.requester.send(&req).await;
        self.record(request_id, &session_id, turn, scheduled, &outcome);
    }
}

impl<W> Shared<W> {
    /// The row of a turn abandoned after the run's stop time: never sent (no send time, no
    /// latencies), an `abandoned:` error that says how long it had waited.
    fn record_abandoned(
        &self,
        request_id: &str,
        session_id: &str,
        turn: u32,
        scheduled: Duration,
        wait: Duration,
    ) {
        let limit_ms = self.abandon_after.map_or(0.0, |a| a.as_secs_f64() * 1e3);
        let row = ClientRow {
            request_id: request_id.to_owned(),
            session_id: Some(session_id.to_owned()),
            turn,
            scheduled_s: Some(scheduled.as_secs_f64()),
            sent_s: None,
            first_token_s: None,
            last_s: None,
            ttft_ms: None,
            itl_p50_ms: None,
            tpot_ms: None,
            e2el_ms: None,
            prompt_tokens: None,
            output_tokens: None,
            cached_tokens: None,
            status: 0,
            error: Some(format!(
                "{}: not sent; after the run's end it had waited {:.0} ms behind its conversation's previous turn, past the {limit_ms:.0} ms TTFT bound",
                schema::rows::ABANDONED_ERROR_KIND,
                wait.as_secs_f64() * 1e3
            )),
            warmup: false,
            send_lag_ms: None,
            chunks: 0,
        };
        let end = scheduled + wait;
        if let Ok(mut sink) = self.sink.lock() {
            sink.record(&row, end);
        }
    }

    pub(crate) fn record(
        &self,
        request_id: &str,
        session_id: &str,
        turn: u32,
        scheduled: Duration,
        o: &Outcome,
    ) {
        let output_tokens = o.output_tokens();
        let lat = latencies(o.sent, &o.chunks, o.end, output_tokens);
        let s = |d: Duration| d.as_secs_f64();
        let row = ClientRow {
            request_id: request_id.to_owned(),
            session_id: Some(session_id.to_owned()),
            turn,
            scheduled_s: Some(s(scheduled)),
            sent_s: Some(s(o.sent)),
            first_token_s: o.chunks.first().map(|c| s(c.at)),
            last_s: o.chunks.last().map(|c| s(c.at)),
            ttft_ms: lat.ttft_ms,
            itl_p50_ms: lat.itl_p50_ms,
            tpot_ms: lat.tpot_ms,
            e2el_ms: lat.e2el_ms,
            prompt_tokens: o.usage.prompt_tokens,
            output_tokens,
            cached_tokens: o.usage.cached_tokens,
            status: o.status,
            // An empty message is no error (the cell is empty either way).
            error: o.error.clone().filter(|e| !e.is_empty()),
            warmup: o.sent < self.warmup,
            send_lag_ms: Some(o.sent.saturating_sub(scheduled).as_secs_f64() * 1e3),
            chunks: u32::try_from(o.chunks.len()).unwrap_or(u32::MAX),
        };
        let end = o.end.unwrap_or(o.sent);
        // A poisoned lock means another task panicked; its JoinError is reported instead.
        if let Ok(mut sink) = self.sink.lock() {
            sink.record(&row, end);
        }
    }
}

/// Runs a plan with the driver its schedule calls for.
pub async fn run(plan: &Plan, cfg: &RunConfig) -> Result<RunSummary, DriverError> {
    match plan.schedule {
        Schedule::Closed { .. } => run_closed(plan, cfg).await,
        Schedule::Open { .. } => run_open(plan, cfg).await,
    }
}

/// [`run`] on a fresh single-threaded runtime (one core, as the benchmark measured).
pub fn run_blocking(plan: &Plan, cfg: &RunConfig) -> Result<RunSummary, DriverError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| DriverError::Io(format!("cannot start the runtime: {e}")))?;
    rt.block_on(run(plan, cfg))
}

/// Runs a closed-loop plan; writes `cfg.out`.
pub async fn run_closed(plan: &Plan, cfg: &RunConfig) -> Result<RunSummary, DriverError> {
    let Schedule::Closed { users, spare_draws } = &plan.schedule else {
        return Err(DriverError::Config(
            "this plan is open-loop; run it with `driver open`".into(),
        ));
    };
    let shared = prepare(plan, cfg).await?;
    let total = plan.request_count() as u64;
    // A conversation's owner: the user walking it, from the decision to start the walk until
    // the walk's last response (workload::walk). Tokio's mutex hands off in FIFO order.
    let owners: Arc<Vec<Arc<tokio::sync::Mutex<()>>>> = Arc::new(
        (0..plan.conversations.len())
            .map(|_| Arc::new(tokio::sync::Mutex::new(())))
            .collect(),
    );
    let start = shared.requester.clock_start();
    let progress = spawn_progress(&shared, cfg, total, None);
    let mut tasks = Vec::with_capacity(users.len());
    for (u, script) in users.iter().enumerate() {
        let shared = shared.clone();
        let owners = owners.clone();
        let script = script.clone();
        let mut cursor = WalkCursor::new(
            &script,
            spare_draws.get(u).map_or(&[], Vec::as_slice),
            plan.spec.sharing,
        );
        tasks.push(tokio::spawn(async move {
            let mut held: Option<tokio::sync::OwnedMutexGuard<()>> = None;
            let mut ready = start;
            let mut sent = 0u64;
            loop {
                let pick = cursor.next(|c| {
                    match owners.get(c as usize).map(|m| m.clone().try_lock_owned()) {
                        Some(Ok(guard)) => {
                            held = Some(guard);
                            true
                        }
                        _ => false,
                    }
                });
                let (k, conversation, ends_walk) = match pick {
                    Pick::Step {
                        step,
                        conversation,
                        ends_walk,
                    } => (step, conversation, ends_walk),
                    Pick::Wait { conversation, step } => {
                        let (Some(owner), Some(first)) =
                            (owners.get(conversation as usize), script.get(step))
                        else {
                            break;
                        };
                        // The think time runs while waiting; lateness shows in send_lag_ms.
                        let scheduled = ready + Duration::from_micros(first.think_us) - start;
                        if shared.stopped(scheduled) {
                            break;
                        }
                        held = Some(owner.clone().lock_owned().await);
                        match cursor.start_waited() {
                            Pick::Step {
                                step,
                                conversation,
                                ends_walk,
                            } => (step, conversation, ends_walk),
                            _ => break,
                        }
                    }
                    Pick::Done => break,
                };
                let Some(step) = script.get(k) else {
                    break;
                };
                let scheduled_at = ready + Duration::from_micros(step.think_us);
                let scheduled = scheduled_at - start;
                if shared.stopped(scheduled) {
                    break;
                }
                sleep_until(scheduled_at).await;
                let id = closed_request_id(u, k);
                shared
                    .fire(
                        &id,
                        conversation,
                        step.turn,
                        shared.plan.spec.output_tokens,
                        scheduled,
                    )
                    .await;
                sent += 1;
                if ends_walk {
                    held = None;
                }
                ready = Instant::now();
            }
            drop(held);
            (sent, cursor.skipped())
        }));
    }
    finish(shared, tasks, progress, total, "closed").await
}

/// Runs an open-loop plan; writes `cfg.out`.
pub async fn run_open(plan: &Plan, cfg: &RunConfig) -> Result<RunSummary, DriverError> {
    let Schedule::Open { arrivals } = &plan.schedule else {
        return Err(DriverError::Config(
            "this plan is closed-loop; run it with `driver closed`".into(),
        ));
    };
    let shared = prepare(plan, cfg).await?;
    let total = arrivals.len() as u64;
    if !plan.spec.sharing.one_turn_at_a_time() {
        return run_open_shared(shared, cfg, arrivals).await;
    }
    let mut per_conversation: Vec<Vec<(usize, u64, u32, u32)>> =
        vec![Vec::new(); plan.conversations.len()];
    for (i, a) in arrivals.iter().enumerate() {
        if let Some(list) = per_conversation.get_mut(a.conversation as usize) {
            list.push((i, a.at_us, a.turn, a.max_tokens(plan.spec.output_tokens)));
        }
    }
    let plan_end = Duration::from_micros(arrivals.last().map_or(0, |a| a.at_us));
    let start = shared.requester.clock_start();
    let progress = spawn_progress(&shared, cfg, total, Some(plan_end));
    let mut tasks = Vec::new();
    for (c, list) in per_conversation.into_iter().enumerate() {
        if list.is_empty() {
            continue;
        }
        let shared = shared.clone();
        tasks.push(tokio::spawn(async move {
            let mut sent = 0u64;
            for (i, at_us, turn, max_tokens) in list {
                let scheduled = Duration::from_micros(at_us);
                if shared.stopped(scheduled) {
                    break;
                }
                if let Some(wait) = shared.abandoned_wait(scheduled) {
                    let session_id = shared.plan.session_id(c as u32);
                    shared.record_abandoned(
                        &open_request_id(i),
                        &session_id,
                        turn,
                        scheduled,
                        wait,
                    );
                    // A row like a sent request's, so rows + not sent = planned.
                    sent += 1;
                    continue;
                }
                sleep_until(start + scheduled).await;
                shared
                    .fire(&open_request_id(i), c as u32, turn, max_tokens, scheduled)
                    .await;
                sent += 1;
            }
            (sent, 0)
        }));
    }
    finish(shared, tasks, progress, total, "open").await
}

/// Open loop with shared conversations: one dispatcher sends every arrival at its scheduled
/// time, each as its own task, whether or not its conversation has a turn in flight.
async fn run_open_shared(
    shared: Arc<Shared>,
    cfg: &RunConfig,
    arrivals: &[workload::Arrival],
) -> Result<RunSummary, DriverError> {
    let total = arrivals.len() as u64;
    let plan_end = Duration::from_micros(arrivals.last().map_or(0, |a| a.at_us));
    let start = shared.requester.clock_start();
    let progress = spawn_progress(&shared, cfg, total, Some(plan_end));
    let dispatcher = {
        let shared = shared.clone();
        let arrivals = arrivals.to_vec();
        tokio::spawn(async move {
            let mut sends = tokio::task::JoinSet::new();
            let mut sent = 0u64;
            // A send task only fails by panicking; pass that on to `finish`.
            let mut count = |done: Result<(), tokio::task::JoinError>| match done {
                Ok(()) => sent += 1,
                Err(e) => panic!("a send task failed: {e}"),
            };
            for (i, a) in arrivals.into_iter().enumerate() {
                let scheduled = Duration::from_micros(a.at_us);
                if shared.stopped(scheduled) {
                    break;
                }
                sleep_until(start + scheduled).await;
                let shared = shared.clone();
                sends.spawn(async move {
                    shared
                        .fire(
                            &open_request_id(i),
                            a.conversation,
                            a.turn,
                            a.max_tokens(shared.plan.spec.output_tokens),
                            scheduled,
                        )
                        .await;
                });
                // Reap finished sends as we go, so a long schedule holds only those in flight.
                while let Some(done) = sends.try_join_next() {
                    count(done);
                }
            }
            while let Some(done) = sends.join_next().await {
                count(done);
            }
            (sent, 0)
        })
    };
    finish(shared, vec![dispatcher], progress, total, "open").await
}

/// Sleeps until `at`, not at all when it has passed: tokio rounds deadlines up to its next
/// millisecond tick, which would add up to 1 ms of send lag to every zero-think request.
pub(crate) async fn sleep_until(at: Instant) {
    if at > Instant::now() {
        tokio::time::sleep_until(at.into()).await;
    }
}

async fn prepare(plan: &Plan, cfg: &RunConfig) -> Result<Arc<Shared>, DriverError> {
    plan.check().map_err(|e| DriverError::Plan(e.to_string()))?;
    prepare_with(Arc::new(plan.clone()), cfg).await
}

/// Preflight, model, rows and clock for a run of `plan` (already checked).
pub(crate) async fn prepare_with<W>(
    plan: Arc<W>,
    cfg: &RunConfig,
) -> Result<Arc<Shared<W>>, DriverError> {
    cfg.validate()?;
    // The clock starts after the preflight so that plan time 0 is when sending may begin.
    let probe = Requester::new(
        &cfg.url,
        Instant::now(),
        Duration::from_secs_f64(cfg.timeout_s),
    )?;
    let model = match (&cfg.model, cfg.preflight) {
        (Some(m), false) => m.clone(),
        (Some(m), true) => {
            probe.models().await?;
            m.clone()
        }
        (None, _) => probe
            .models()
            .await?
            .into_iter()
            .next()
            .ok_or_else(|| DriverError::Config("the server lists no model".into()))?,
    };
    let writer = RowWriter::create(&cfg.out)?;
    let start = Instant::now();
    let requester = Requester::new(&cfg.url, start, Duration::from_secs_f64(cfg.timeout_s))?
        .keep_alive(cfg.keep_alive);
    Ok(Arc::new(Shared {
        plan,
        requester,
        model,
        warmup: Duration::from_secs_f64(cfg.warmup_s),
        stop_at: cfg.duration_s.map(Duration::from_secs_f64),
        abandon_after: cfg.abandon_after_s.map(Duration::from_secs_f64),
        sink: Mutex::new(Sink {
            writer: Some(writer),
            write_error: None,
            done: 0,
            errors: 0,
            errors_by_kind: BTreeMap::new(),
            warmup: 0,
            last_end: Duration::ZERO,
            ttft: Vec::new(),
            itl: Vec::new(),
            e2el: Vec::new(),
            lag: Vec::new(),
            // Microseconds up to an hour; `saturating_record` clamps rather than resizes.
            progress_ttft: hdrhistogram::Histogram::new_with_bounds(1, 3_600_000_000, 3)
                .map_err(|e| DriverError::Io(e.to_string()))?,
            output_tokens: 0,
            chunks: 0,
        }),
    }))
}

pub(crate) type ProgressTask = Option<(
    tokio::task::JoinHandle<()>,
    tokio::sync::oneshot::Sender<()>,
)>;

pub(crate) fn spawn_progress<W: Send + Sync + 'static>(
    shared: &Arc<Shared<W>>,
    cfg: &RunConfig,
    total: u64,
    plan_end: Option<Duration>,
) -> ProgressTask {
    let on = match cfg.progress {
        ProgressMode::Auto => std::io::stderr().is_terminal(),
        ProgressMode::On => true,
        ProgressMode::Off => false,
    };
    let file = cfg.progress_file.clone();
    if !on && file.is_none() {
        return None;
    }
    let shared = shared.clone();
    let (tx, mut rx) = tokio::sync::oneshot::channel();
    let handle = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = &mut rx => break,
                _ = tick.tick() => {}
            }
            let elapsed = shared.requester.clock_start().elapsed();
            let line = match shared.sink.lock() {
                Ok(s) => progress_line(&s, total, elapsed, plan_end),
                Err(_) => break,
            };
            if let Some(path) = &file {
                // Best effort: a reader sees the last whole line or none (one short write).
                let _ = std::fs::write(path, format!("{line}\n"));
            }
            if on {
                let mut err = std::io::stderr().lock();
                let _ = write!(err, "\r\x1b[2K{line}");
                let _ = err.flush();
            }
        }
        if on {
            let _ = writeln!(std::io::stderr());
        }
        // The file ends on the run's final count, not on the last tick's.
        if let Some(path) = &file
            && let Ok(s) = shared.sink.lock()
        {
            let elapsed = shared.requester.clock_start().elapsed();
            let _ = std::fs::write(
                path,
                format!("{}\n", progress_line(&s, total, elapsed, plan_end)),
            );
        }
    });
    Some((handle, tx))
}

fn progress_line(s: &Sink, total: u64, elapsed: Duration, plan_end: Option<Duration>) -> String {
    let secs = elapsed.as_secs_f64().max(1e-3);
    let rate = s.done as f64 / secs;
    let eta_s = match plan_end {
        Some(end) => end.as_secs_f64() - secs,
        None if rate > 0.0 => total.saturating_sub(s.done) as f64 / rate,
        None => f64::NAN,
    };
    let ttft = if s.progress_ttft.is_empty() {
        "-".to_owned()
    } else {
        format!(
            "{:.1} ms",
            s.progress_ttft.value_at_quantile(0.5) as f64 / 1e3
        )
    };
    let eta = if eta_s.is_finite() {
        format!("{:.0} s", eta_s.max(0.0))
    } else {
        "-".to_owned()
    };
    format!(
        "{}/{} done  {rate:.1} req/s  {} errors  TTFT p50 {ttft}  ETA {eta}",
        s.done, total, s.errors
    )
}

pub(crate) async fn finish<W: Named>(
    shared: Arc<Shared<W>>,
    tasks: Vec<tokio::task::JoinHandle<(u64, u64)>>,
    progress: ProgressTask,
    total: u64,
    mode: &str,
) -> Result<RunSummary, DriverError> {
    let mut sent = 0u64;
    let mut skipped_draws = 0u64;
    let mut panicked = None;
    for t in tasks {
        match t.await {
            Ok((n, skips)) => {
                sent += n;
                skipped_draws += skips;
            }
            Err(e) => panicked = Some(e.to_string()),
        }
    }
    if let Some((handle, stop)) = progress {
        let _ = stop.send(());
        let _ = handle.await;
    }
    if let Some(p) = panicked {
        return Err(DriverError::Io(format!("a driver task failed: {p}")));
    }
    let plan_fingerprint = shared.plan.plan_fingerprint()?;
    let mut sink = shared
        .sink
        .lock()
        .map_err(|_| DriverError::Io("row sink poisoned".into()))?;
    if let Some(e) = sink.write_error.take() {
        return Err(e);
    }
    let writer = sink
        .writer
        .take()
        .ok_or_else(|| DriverError::Io("rows already finished".into()))?;
    let out = writer.finish()?;
    let elapsed_s = sink.last_end.as_secs_f64();
    let measured_s = (elapsed_s - shared.warmup.as_secs_f64()).max(0.0);
    let measured_ok = sink.ttft.len().max(sink.e2el.len()) as u64;
    Ok(RunSummary {
        mode: mode.to_owned(),
        model: shared.model.clone(),
        plan_name: shared.plan.plan_name(),
        plan_fingerprint,
        out,
        requests: sink.done,
        not_sent: total.saturating_sub(sent),
        skipped_draws,
        ok: sink.done - sink.errors,
        errors: sink.errors,
        errors_by_kind: sink.errors_by_kind.clone(),
        warmup_requests: sink.warmup,
        elapsed_s,
        measured_s,
        throughput_rps: if measured_s > 0.0 {
            measured_ok as f64 / measured_s
        } else {
            0.0
        },
        ttft_ms: Quantiles::of(&mut sink.ttft),
        itl_p50_ms: Quantiles::of(&mut sink.itl),
        e2el_ms: Quantiles::of(&mut sink.e2el),
        send_lag_ms: Quantiles::of(&mut sink.lag),
        output_tokens: sink.output_tokens,
        chunks: sink.chunks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sink() -> Sink {
        Sink {
            writer: None,
            write_error: None,
            done: 0,
            errors: 0,
            errors_by_kind: BTreeMap::new(),
            warmup: 0,
            last_end: Duration::ZERO,
            ttft: Vec::new(),
            itl: Vec::new(),
            e2el: Vec::new(),
            lag: Vec::new(),
            progress_ttft: hdrhistogram::Histogram::new_with_bounds(1, 3_600_000_000, 3).unwrap(),
            output_tokens: 0,
            chunks: 0,
        }
    }

    #[test]
    fn sink_separates_warmup_and_errors() {
        let mut s = sink();
        let ok = ClientRow {
            ttft_ms: Some(40.0),
            itl_p50_ms: Some(8.0),
            e2el_ms: Some(100.0),
            output_tokens: Some(10),
            chunks: 10,
            send_lag_ms: Some(0.5),
            ..ClientRow::default()
        };
        s.record(&ok, Duration::from_secs(2));
        s.record(
            &ClientRow {
                warmup: true,
                ..ok.clone()
            },
            Duration::from_secs(1),
        );
        s.record(
            &ClientRow {
                error: Some("timeout: no response within 1s".into()),
                ..ClientRow::default()
            },
            Duration::from_secs(3),
        );
        assert_eq!((s.done, s.errors, s.warmup), (3, 1, 1));
        assert_eq!(s.ttft, vec![40.0]);
        assert_eq!(s.errors_by_kind.get("timeout"), Some(&1));
        assert_eq!(s.last_end, Duration::from_secs(3));
        assert_eq!(s.output_tokens, 20);
        let line = progress_line(&s, 10, Duration::from_secs(2), None);
        assert!(
            line.starts_with("3/10 done  1.5 req/s  1 errors  TTFT p50 40.0 ms"),
            "{line}"
        );
        assert!(line.ends_with("ETA 5 s"), "{line}");
    }

    #[test]
    fn summary_warns_when_the_schedule_slipped() {
        let on_time = RunSummary {
            send_lag_ms: Some(Quantiles {
                p50: 0.4,
                p90: 0.9,
                p99: 2.0,
            }),
            ..RunSummary::default()
        };
        let text = on_time.to_string();
        assert!(
            text.contains("send lag") && !text.contains("warning"),
            "{text}"
        );
        let late = RunSummary {
            send_lag_ms: Some(Quantiles {
                p50: 1.0,
                p90: 450.0,
                p99: 1_300.0,
            }),
            ..RunSummary::default()
        };
        assert!(
            late.to_string()
                .contains("warning   10% of sends were ≥ 450 ms")
        );
    }

    #[test]
    fn quantiles_interpolate_between_ranks() {
        let mut v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let q = Quantiles::of(&mut v).unwrap();
        assert_eq!(q.p50, 50.5);
        assert!((q.p90 - 90.1).abs() < 1e-9, "{q:?}");
        assert!((q.p99 - 99.01).abs() < 1e-9, "{q:?}");
        assert!(Quantiles::of(&mut []).is_none());
    }

    #[test]
    fn bad_configs_are_errors() {
        let base = RunConfig::new("http://127.0.0.1:1", "x.csv");
        for cfg in [
            RunConfig {
                warmup_s: -1.0,
                ..base.clone()
            },
            RunConfig {
                timeout_s: 0.0,
                ..base.clone()
            },
            RunConfig {
                duration_s: Some(f64::NAN),
                ..base.clone()
            },
            RunConfig {
                preflight: false,
                ..base.clone()
            },
        ] {
            assert!(matches!(cfg.validate(), Err(DriverError::Config(_))));
        }
        assert!(base.validate().is_ok());
    }
}
