//! The engine thread: owns the [`Engine`] core and steps it at modelled deadlines.
//!
//! It runs on a dedicated OS thread rather than a tokio task because tokio's timer wheel has a
//! 1 ms resolution, which alone would push lateness p99 to ~1 ms; a futex wait with a timeout
//! (`recv_timeout`) wakes within tens of µs. Deadlines are absolute: each step starts at the
//! previous step's modelled end, never at the (late) moment the thread woke, so lateness does not
//! accumulate into drift.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use super::metrics::MetricsState;
use crate::core::{Engine, FinishReason, RequestId, SamplingParams, StepOutput};
use crate::kv_events::KvEvent;

/// What the engine sends to one request's response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Emit {
    /// Generated token id.
    pub token: u32,
    /// 0 for the first token.
    pub output_index: u32,
    /// Set on the last token.
    pub finish: Option<FinishReason>,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
}

/// Commands from HTTP handlers to the engine thread.
pub enum Command {
    /// A validated request; tokens go to `tx`.
    Add {
        /// Engine-internal id.
        id: RequestId,
        /// Prompt token ids.
        prompt: Vec<u32>,
        /// Generation parameters.
        params: SamplingParams,
        /// Arrival on the engine clock, µs.
        arrival_us: u64,
        /// Where the tokens go.
        tx: mpsc::UnboundedSender<Emit>,
    },
    /// The client went away.
    Abort(RequestId),
    /// `/reset_prefix_cache`; answers whether it cleared.
    Reset(oneshot::Sender<bool>),
    /// The hashes now in the prefix cache (tests, reconciliation).
    CachedHashes(oneshot::Sender<std::collections::HashSet<u64>>),
    /// Stop the thread.
    Shutdown,
}

/// The engine's monotonic clock: µs since the server started.
#[derive(Clone, Copy)]
pub struct Clock(Instant);

impl Clock {
    /// A clock starting now.
    pub fn start() -> Self {
        Self(Instant::now())
    }
    /// µs since start.
    pub fn now_us(&self) -> u64 {
        self.0.elapsed().as_micros() as u64
    }
}

/// Longest time before a deadline the thread stops sleeping and starts spinning, µs.
const SPIN_US: u64 = 100;

struct Live {
    tx: mpsc::UnboundedSender<Emit>,
    arrival_us: u64,
    last_emit_us: u64,
}

/// Runs the engine loop until `Shutdown` or every command sender is gone.
pub fn run(
    mut engine: Engine,
    rx: Receiver<Command>,
    clock: Clock,
    metrics: Arc<Mutex<MetricsState>>,
    events_tx: Option<mpsc::UnboundedSender<Vec<KvEvent>>>,
) {
    let frontend_us = engine.config().model.frontend_us();
    let mut live: HashMap<RequestId, Live> = HashMap::new();
    let mut out = StepOutput::default();
    let mut in_flight = false;
    // Modelled end of the last step: the earliest start of the next.
    let mut logical_us = 0u64;
    let mut aborted = 0u64;
    loop {
        let target = if in_flight {
            Some(out.end_us())
        } else {
            engine.next_wakeup_us(logical_us)
        };
        let cmd = match target {
            None => match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => return,
            },
            Some(t) => {
                let now = clock.now_us();
                // Spin at most 1/16 of the wait being ended, so fast replicas (high --speed)
                // do not burn a core.
                let spin_us = if in_flight {
                    (out.duration_us / 16).min(SPIN_US)
                } else {
                    (frontend_us / 16).min(SPIN_US)
                };
                if now + spin_us < t {
                    // Sleep until just before the deadline (the futex timeout has ~50 µs of
                    // slack), then spin the rest so emission lands on time.
                    match rx.recv_timeout(Duration::from_micros(t - now - spin_us)) {
                        Ok(c) => Some(c),
                        Err(RecvTimeoutError::Timeout) => continue,
                        Err(RecvTimeoutError::Disconnected) => return,
                    }
                } else if now < t {
                    match rx.try_recv() {
                        Ok(c) => Some(c),
                        Err(_) => {
                            // Busy-wait, not yield: on a contended machine a yield hands the
                            // core to a CPU hog for a whole scheduler slice (~2 ms late).
                            std::hint::spin_loop();
                            continue;
                        }
                    }
                } else if in_flight {
                    None // emit first; pending commands wait one iteration
                } else {
                    rx.try_recv().ok()
                }
            }
        };
        if let Some(cmd) = cmd {
            match cmd {
                Command::Add {
                    id,
                    prompt,
                    params,
                    arrival_us,
                    tx,
                } => {
                    if engine.add_request(id, prompt, params, arrival_us).is_ok() {
                        live.insert(
                            id,
                            Live {
                                tx,
                                arrival_us,
                                last_emit_us: 0,
                            },
                        );
                    }
                    // On error `tx` drops, which the handler reports as an engine error.
                }
                Command::Abort(id) => {
                    if engine.abort(id) {
                        aborted += 1;
                    }
                    live.remove(&id);
                }
                Command::Reset(ans) => {
                    let ok = engine.reset_prefix_cache();
                    let mut evs = Vec::new();
                    engine.take_events(&mut evs);
                    if let (Some(tx), false) = (&events_tx, evs.is_empty()) {
                        let _ = tx.send(evs);
                    }
                    let _ = ans.send(ok);
                }
                Command::CachedHashes(ans) => {
                    let _ = ans.send(engine.pool().cached_hashes());
                }
                Command::Shutdown => return,
            }
            publish_gauges(&engine, &metrics, aborted);
            // Re-evaluate the target: the command may have changed it.
            continue;
        }
        let Some(t) = target else { continue };
        if in_flight {
            // The step's modelled end: emit its tokens and events.
            let now = clock.now_us();
            let late_us = now.saturating_sub(t);
            logical_us = t;
            in_flight = false;
            // Events go out before the tokens, so a client that saw its last token can rely on
            // the batch having been handed to the publisher.
            if let (Some(tx), false) = (&events_tx, out.kv_events.is_empty()) {
                let _ = tx.send(std::mem::take(&mut out.kv_events));
            }
            // One lock per step: /metrics readers copy the state and render outside it.
            let mut m = metrics.lock().expect("metrics lock");
            for tok in &out.tokens {
                let Some(l) = live.get_mut(&tok.id) else {
                    continue;
                };
                let _ = l.tx.send(Emit {
                    token: tok.token,
                    output_index: tok.output_index,
                    finish: tok.finish,
                    prompt_tokens: tok.prompt_tokens,
                    cached_tokens: tok.cached_tokens,
                });
                if tok.output_index == 0 {
                    m.ttft
                        .observe(now.saturating_sub(l.arrival_us) as f64 / 1e6);
                } else {
                    m.itl
                        .observe(now.saturating_sub(l.last_emit_us) as f64 / 1e6);
                }
                l.last_emit_us = now;
                if let Some(f) = tok.finish {
                    m.e2e.observe(now.saturating_sub(l.arrival_us) as f64 / 1e6);
                    match f {
                        FinishReason::Stop => m.finished_stop += 1,
                        FinishReason::Length => m.finished_length += 1,
                    }
                    live.remove(&tok.id);
                }
            }
            m.lateness.observe(late_us as f64 / 1e6);
            m.lateness_us.saturating_record(late_us);
            drop(m);
            publish_gauges(&engine, &metrics, aborted);
            continue;
        }
        // Start a step at its modelled start (never earlier than the last step's end).
        let start = t.max(logical_us);
        engine.step_into(start, &mut out);
        if !out.admitted.is_empty() {
            let mut m = metrics.lock().expect("metrics lock");
            for id in &out.admitted {
                if let Some(l) = live.get(id) {
                    let ready = l.arrival_us + frontend_us;
                    m.queue.observe(start.saturating_sub(ready) as f64 / 1e6);
                }
            }
        }
        if out.num_scheduled_reqs > 0 {
            in_flight = true;
        } else {
            logical_us = start;
            if let (Some(tx), false) = (&events_tx, out.kv_events.is_empty()) {
                let _ = tx.send(std::mem::take(&mut out.kv_events));
            }
        }
    }
}

fn publish_gauges(engine: &Engine, metrics: &Mutex<MetricsState>, aborted: u64) {
    let mut m = metrics.lock().expect("metrics lock");
    m.counters = engine.counters().clone();
    m.running = engine.num_running();
    m.waiting = engine.num_waiting() + engine.num_pending();
    m.kv_usage = engine.kv_usage();
    m.aborted = aborted;
}
