//! Trace replay (`driver replay`): a Mooncake-format trace mapped by the `trace` crate, sent open
//! loop at the plan's times.
//!
//! Each request is sent at its scheduled time as its own task; nothing waits for an earlier
//! response, not even one of the same session — every prompt is fixed by the trace, so no byte
//! depends on what an engine generated, and holding a turn back would change the trace's arrival
//! process. A request's prompt text is generated from its block ids when it is sent (never held
//! for the whole plan) and sent as one user message. Rows are the open loop's: `request_id`
//! `t<line>` (the trace line), `session_id` the session rule's `s<block>` / `r<line>`, `turn` the
//! request's turn within its session over the whole trace, `scheduled_s` the plan time,
//! `send_lag_ms` the lateness.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use trace::{ReplayFile, ReplayPlan, ReplaySpec, Trace};
use workload::{Message, Role};

use crate::DriverError;
use crate::client::{ChatRequest, chat_body};
use crate::run::{
    Named, RunConfig, RunSummary, Shared, finish, prepare_with, sleep_until, spawn_progress,
};

impl Named for ReplayPlan {
    fn plan_name(&self) -> String {
        self.name()
    }

    fn plan_fingerprint(&self) -> Result<String, DriverError> {
        Ok(self.fingerprint_hex())
    }
}

/// Reads and parses the trace at `path` (malformed lines: `path:line: why`).
pub fn load_trace(path: &Path) -> Result<Trace, DriverError> {
    let name = path.display().to_string();
    let file = std::fs::File::open(path)
        .map_err(|e| DriverError::Io(format!("cannot open the trace {name}: {e}")))?;
    Trace::parse_reader(&name, std::io::BufReader::new(file))
        .map_err(|e| DriverError::Plan(e.to_string()))
}

/// The replay of the trace at `path` mapped by `spec`.
pub fn load_replay(path: &Path, spec: &ReplaySpec) -> Result<ReplayPlan, DriverError> {
    let trace = load_trace(path)?;
    let plan = ReplayPlan::build(&trace, spec).map_err(|e| DriverError::Plan(e.to_string()))?;
    if plan.drain_starts().contains(&true) {
        return Err(DriverError::Plan(format!(
            "{} has a stage that waits for the one before it to drain (\"drain\": true); only the simulator replays that (`sweep trace --virtual`)",
            path.display()
        )));
    }
    Ok(plan)
}

/// The replay a [`ReplayFile`] (a sweep's `trace-plan.json`) records: its trace, mapped by its
/// spec, refused unless the trace's bytes and the plan's fingerprint are the recorded ones.
pub fn load_replay_file(path: &Path) -> Result<ReplayPlan, DriverError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| DriverError::Io(format!("cannot read {}: {e}", path.display())))?;
    let file: ReplayFile = serde_json::from_str(&text)
        .map_err(|e| DriverError::Plan(format!("{}: not a trace replay: {e}", path.display())))?;
    let plan = load_replay(Path::new(&file.trace), &file.spec)?;
    file.check(&plan)
        .map_err(|e| DriverError::Plan(format!("{}: {e}", path.display())))?;
    Ok(plan)
}

impl Shared<ReplayPlan> {
    /// Sends request `index` of the replay and records its row.
    async fn fire_replay(&self, index: usize, scheduled: Duration) {
        let r = self.plan.requests()[index];
        let mut prompt = String::new();
        self.plan.prompt_into(&r, &mut prompt);
        let messages = [Message {
            role: Role::User,
            content: std::borrow::Cow::Borrowed(&prompt),
        }];
        let request_id = ReplayPlan::request_id(&r);
        let session_id = self.plan.session_id(r.session);
        let req = ChatRequest {
            request_id: &request_id,
            session_id,
            body: chat_body(&self.model, &messages, r.max_tokens),
        };
        drop(prompt);
        let outcome = self.requester.send(&req).await;
        self.record(&request_id, session_id, r.turn, scheduled, &outcome);
    }
}

/// Replays `plan` open loop; writes `cfg.out`. `cfg.duration_s` stops new sends (unsent requests
/// are counted as not sent).
pub async fn run_replay(plan: &ReplayPlan, cfg: &RunConfig) -> Result<RunSummary, DriverError> {
    let shared = prepare_with(Arc::new(plan.clone()), cfg).await?;
    let total = plan.len() as u64;
    let start = shared.requester.clock_start();
    let progress = spawn_progress(
        &shared,
        cfg,
        total,
        Some(Duration::from_micros(plan.end_us())),
    );
    let mut tasks = Vec::with_capacity(plan.len());
    for (i, r) in plan.requests().iter().enumerate() {
        let scheduled = Duration::from_micros(r.at_us);
        if shared.stopped(scheduled) {
            break;
        }
        sleep_until(start + scheduled).await;
        let shared = shared.clone();
        tasks.push(tokio::spawn(async move {
            shared.fire_replay(i, scheduled).await;
            (1, 0)
        }));
    }
    finish(shared, tasks, progress, total, "replay").await
}

/// [`run_replay`] on a fresh single-threaded runtime.
pub fn run_replay_blocking(plan: &ReplayPlan, cfg: &RunConfig) -> Result<RunSummary, DriverError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| DriverError::Io(format!("cannot start the runtime: {e}")))?;
    rt.block_on(run_replay(plan, cfg))
}
