//! The discrete-event loop: driver, router and engines on one virtual clock.
//!
//! Events live in a binary heap ordered by `(time_us, seq)`, where `seq` is the insertion
//! counter, so simultaneous events run in the order they were created and a seed gives the same
//! run every time. What each actor does mirrors the live process it stands for:
//!
//! - driver: closed-loop users think (the plan's think time), then send; open-loop arrivals fire
//!   at their scheduled time. A closed-loop user owns a conversation for its whole walk and
//!   picks its next walk with `workload::WalkCursor` exactly as the live driver does: a draw
//!   owned by another user is dropped for the next free one in the window (script draws, then
//!   the plan's spare draws), and only a fully owned window waits, FIFO. Open loop: a conversation's turns go one at a time, so a turn
//!   whose predecessor is still running waits, FIFO. With shared conversations
//!   (`workload::Sharing::Shared`) neither holds: the cursor never claims, and every request is
//!   sent when it fires, whatever else of its conversation is in flight — the live driver's rule.
//!   A trace replay's requests are sent at their plan times, none waiting for another (as
//!   `driver replay` sends them).
//! - router: belief and keyless policies decide on arrival; exact residency first pays the
//!   tokenize round trip. `decide`, then the chosen replica's outstanding is incremented; it is
//!   decremented when the response ends. The request reaches the engine after the modelled
//!   forward overhead and decision cost.
//! - engines: the engine crate's own core, stepped exactly as its server's loop steps it (a step
//!   starts at the previous step's end or at the next frontend completion; its tokens and KV
//!   events are emitted at its end). KV event batches reach the policy one transport delay after
//!   the step that produced them ends.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Instant;

use engine_core::{Engine, EngineConfig, SamplingParams, StepOutput};
use kv_index::IndexStats;
use policies::prefix::{IndexMode, PrefixPolicy};
use policies::{Keying, Policy, PolicySpec, ReplicaView, RouteRequest};
use trace::ReplayPlan;
use workload::{Pick, Plan, Schedule, WalkCursor};

use crate::SimError;
use crate::config::SimConfig;
use crate::prompts::PromptBook;
use crate::rows::{Origin, Outcome, RouterDecision};

/// A policy, keeping the concrete prefix policy so its index statistics can be read.
enum Routing {
    Prefix(Box<PrefixPolicy>),
    Other(Box<dyn Policy>),
}

impl Routing {
    fn build(spec: &PolicySpec) -> Result<Self, SimError> {
        spec.validate()
            .map_err(|e| SimError::Config(e.to_string()))?;
        let prefix = |mode, spill| -> Result<Self, SimError> {
            let p = PrefixPolicy::new(spec, mode, spill)
                .map_err(|e| SimError::Config(e.to_string()))?;
            Ok(Routing::Prefix(Box::new(p)))
        };
        // The same arms as `policies::build`, kept concrete for their index statistics (a test
        // checks the names agree).
        match spec.name.as_str() {
            "prefix-affinity" => prefix(IndexMode::Belief, spec.spill),
            "prefix-affinity-spill-off" => prefix(IndexMode::Belief, false),
            "exact-residency" => prefix(
                IndexMode::Exact {
                    speculative: spec.speculative,
                },
                spec.spill,
            ),
            "exact-residency-spec" => prefix(IndexMode::Exact { speculative: true }, spec.spill),
            _ => Ok(Routing::Other(
                policies::build(spec).map_err(SimError::Config)?,
            )),
        }
    }

    fn get(&mut self) -> &mut dyn Policy {
        match self {
            Routing::Prefix(p) => p.as_mut(),
            Routing::Other(p) => p.as_mut(),
        }
    }

    fn name(&self) -> &str {
        match self {
            Routing::Prefix(p) => p.name(),
            Routing::Other(p) => p.name(),
        }
    }

    fn keying(&self) -> Keying {
        match self {
            Routing::Prefix(p) => p.keying(),
            Routing::Other(p) => p.keying(),
        }
    }

    fn index_stats(&self) -> Option<IndexStats> {
        match self {
            Routing::Prefix(p) => Some(p.index_stats()),
            Routing::Other(_) => None,
        }
    }

    fn event_errors(&self) -> u64 {
        match self {
            Routing::Prefix(p) => p.event_errors(),
            Routing::Other(_) => 0,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Ev {
    /// A closed-loop user's think time ended, or an open-loop arrival is due.
    Fire(u32),
    /// Exact residency: the tokenize round trip of request `r` is back.
    Decide(u32),
    /// Replica `r` may start a step (stale unless it equals the replica's `wake_at`).
    Wake(u32),
    /// Replica `r`'s step in flight ends.
    StepEnd(u32),
    /// A KV event batch (slot) of a replica reaches the router.
    Deliver(u32, u32),
}

struct Item {
    t: u64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Item {
    fn eq(&self, o: &Self) -> bool {
        (self.t, self.seq) == (o.t, o.seq)
    }
}
impl Eq for Item {}
impl PartialOrd for Item {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Item {
    // Reversed: BinaryHeap is a max-heap and the earliest event must come out first.
    fn cmp(&self, o: &Self) -> Ordering {
        (o.t, o.seq).cmp(&(self.t, self.seq))
    }
}

/// A request in flight (or waiting for its conversation's previous turn).
struct Live {
    out: Outcome,
    replica: Option<u32>,
    /// Inter-token gaps, µs (whole µs: the virtual clock's unit).
    gaps: Vec<f64>,
    done: bool,
}

struct Replica {
    engine: Engine,
    out: StepOutput,
    in_flight: bool,
    /// End of the last step: the earliest start of the next.
    logical_us: u64,
    wake_at: Option<u64>,
}

/// Engine-side totals of a run (summed over replicas).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineTotals {
    /// Prompt tokens looked up in the prefix caches.
    pub prefix_queries_tokens: u64,
    /// Prompt tokens found there.
    pub prefix_hits_tokens: u64,
    /// Preemptions.
    pub preemptions: u64,
    /// Steps that scheduled work.
    pub steps: u64,
    /// Generated tokens.
    pub generation_tokens: u64,
    /// KV event batches delivered to the router.
    pub event_batches: u64,
}

/// Everything a run produced: one outcome per request in completion order (the order the live
/// driver writes its rows), and the run's totals.
#[derive(Debug, Clone)]
pub struct SimOutput {
    /// The policy's name (the `policy` column).
    pub policy: String,
    /// Outcomes in completion order.
    pub outcomes: Vec<Outcome>,
    /// Session id per conversation (`Plan::session_id`).
    pub session_ids: Vec<String>,
    /// Virtual time when the last request ended, µs.
    pub end_us: u64,
    /// Engine totals.
    pub engine: EngineTotals,
    /// Requests served per replica.
    pub per_replica_requests: Vec<u64>,
    /// The index's statistics at the end (prefix and exact policies).
    pub index: Option<IndexStats>,
    /// KV events the index refused.
    pub index_event_errors: u64,
    /// Wall-clock time inside `Policy::decide`, ns, one per decision (measured on the side;
    /// never written to rows).
    pub decide_wall_ns: Vec<u64>,
    /// Events processed.
    pub events: u64,
    /// Closed loop: draws passed over because another user owned them (`workload::walk`).
    pub skipped_draws: u64,
}

/// What a run replays: a workload plan with its prompt book, or a trace replay (open loop,
/// prompts generated per request, `crate::trace`).
#[derive(Clone, Copy)]
enum Source<'a> {
    Plan {
        plan: &'a Plan,
        book: &'a PromptBook,
    },
    Trace(&'a ReplayPlan),
}

impl Source<'_> {
    /// Conversations (plan) or sessions (trace): what `Outcome::conversation` indexes.
    fn conversations(&self) -> usize {
        match self {
            Source::Plan { plan, .. } => plan.conversations.len(),
            Source::Trace(t) => t.session_count(),
        }
    }

    fn request_count(&self) -> usize {
        match self {
            Source::Plan { plan, .. } => plan.request_count(),
            Source::Trace(t) => t.len(),
        }
    }

    fn session_id(&self, c: u32) -> String {
        match self {
            Source::Plan { plan, .. } => plan.session_id(c),
            Source::Trace(t) => t.session_id(c).to_string(),
        }
    }
}

struct Sim<'a> {
    cfg: &'a SimConfig,
    src: Source<'a>,
    policy: Routing,
    keying: Keying,
    heap: BinaryHeap<Item>,
    seq: u64,
    /// Client timeouts `(at_us, request)`: sends happen in time order and every timeout is the
    /// same length, so this queue is already sorted and stays out of the heap.
    timeouts: VecDeque<(u64, u32)>,
    replicas: Vec<Replica>,
    fleet: Vec<ReplicaView>,
    reqs: Vec<Live>,
    conv_busy: Vec<bool>,
    conv_queue: Vec<VecDeque<u32>>,
    /// Closed loop: each user's walk cursor.
    cursors: Vec<WalkCursor>,
    /// Closed loop: the script index of each user's next or current request, its
    /// conversation, and whether it ends the walk.
    user_step: Vec<(u32, u32, bool)>,
    /// Closed loop: when that request is scheduled (ready + think), µs.
    user_sched_us: Vec<u64>,
    /// Closed loop: the conversation each user owns.
    user_owns: Vec<Option<u32>>,
    /// Closed loop: each conversation's owner.
    conv_owner: Vec<Option<u32>>,
    /// Closed loop: users waiting for a conversation, FIFO.
    conv_waiters: Vec<VecDeque<u32>>,
    batches: Vec<Option<(u32, Vec<engine_core::KvEvent>)>>,
    free_batches: Vec<u32>,
    gap_pool: Vec<Vec<f64>>,
    session_ids: Vec<String>,
    keys_buf: Vec<u64>,
    /// Trace replay: the belief keys of the request being decided.
    trace_keys: Vec<u64>,
    /// Finished requests, in completion order.
    finished: Vec<u32>,
    per_replica_requests: Vec<u64>,
    decide_wall_ns: Vec<u64>,
    stop_us: Option<u64>,
    warmup_us: u64,
    timeout_us: u64,
    tokenize_us: u64,
    max_tokens: u32,
    event_batches: u64,
    events: u64,
    now: u64,
    /// When the last request ended (stale timeouts run later and must not count).
    last_end_us: u64,
    /// Trace replay: which requests open a stage that waits for everything before it to end
    /// (`trace::ReplayPlan::drain_starts`).
    drain_starts: Vec<bool>,
    /// Trace replay: the request held back until the fleet drains.
    drain_pending: Option<u32>,
    /// Trace replay: how long the drains so far have delayed every later arrival, µs.
    drain_shift_us: u64,
    /// Trace replay: requests fired and not yet ended.
    trace_open: u32,
}

/// Simulates `plan` under `cfg`, building the prompt book itself.
pub fn simulate(cfg: &SimConfig, plan: &Plan) -> Result<SimOutput, SimError> {
    cfg.validate()?;
    let book = PromptBook::new(plan, &cfg.model, cfg.router.block_bytes, true)?;
    simulate_with(cfg, plan, &book)
}

/// Simulates `plan` under `cfg` with a prompt book built for this plan (shared across the
/// policies of one grid point). The book must hold belief keys when the policy needs them.
pub fn simulate_with(
    cfg: &SimConfig,
    plan: &Plan,
    book: &PromptBook,
) -> Result<SimOutput, SimError> {
    cfg.validate()?;
    plan.check().map_err(|e| SimError::Plan(e.to_string()))?;
    if book.len() != plan.conversations.len() {
        return Err(SimError::Config(format!(
            "prompt book holds {} conversations, the plan {}",
            book.len(),
            plan.conversations.len()
        )));
    }
    if book.model() != cfg.model {
        return Err(SimError::Config(format!(
            "prompt book was salted with {:?}, the config says {:?}",
            book.model(),
            cfg.model
        )));
    }
    run(cfg, Source::Plan { plan, book })
}

/// Simulates a trace replay under `cfg`: every request at its plan time, open loop (no request
/// waits for another), its prompt generated and tokenized when it is decided (`crate::trace`).
/// The engines' `max_model_len` must admit the longest request (`crate::trace::context_tokens`).
pub fn simulate_trace(cfg: &SimConfig, plan: &ReplayPlan) -> Result<SimOutput, SimError> {
    cfg.validate()?;
    run(cfg, Source::Trace(plan))
}

fn run(cfg: &SimConfig, src: Source<'_>) -> Result<SimOutput, SimError> {
    let mut spec = cfg.policy.clone();
    spec.salt = cfg.model.clone();
    spec.tokens_per_block = cfg.engine.block_size;
    let policy = Routing::build(&spec)?;
    let keying = policy.keying();
    if keying == Keying::ExactTokens && cfg.engine.cache_model != engine_core::CacheModel::Paged {
        return Err(SimError::Config(format!(
            "policy {} needs the engines' KV events, and the {} cache model (llama.cpp's \
             llama-server) publishes none",
            spec.name,
            cfg.engine.cache_model.name()
        )));
    }
    if keying == Keying::BeliefBytes
        && let Source::Plan { book, .. } = src
        && !book.has_belief_keys()
    {
        return Err(SimError::Config(
            "the prompt book has no belief keys but the policy needs them".into(),
        ));
    }
    let mut replicas = Vec::with_capacity(cfg.replicas as usize);
    for i in 0..cfg.replicas as usize {
        let mut ec: EngineConfig = cfg.engine.clone();
        ec.seed = cfg.engine.seed.wrapping_add(i as u64);
        ec.enable_kv_events = keying == Keying::ExactTokens;
        ec.model.slowdown *= cfg.slowdown(i);
        let engine = Engine::new(ec).map_err(|e| SimError::Config(format!("engine {i}: {e}")))?;
        replicas.push(Replica {
            engine,
            out: StepOutput::default(),
            in_flight: false,
            logical_us: 0,
            wake_at: None,
        });
    }
    let secs_us = |s: f64| (s * 1e6).round() as u64;
    let n_conv = src.conversations();
    let mut sim = Sim {
        cfg,
        src,
        policy,
        keying,
        heap: BinaryHeap::new(),
        seq: 0,
        timeouts: VecDeque::new(),
        replicas,
        fleet: (0..cfg.replicas).map(ReplicaView::idle).collect(),
        reqs: Vec::with_capacity(src.request_count()),
        conv_busy: vec![false; n_conv],
        conv_queue: vec![VecDeque::new(); n_conv],
        cursors: Vec::new(),
        user_step: Vec::new(),
        user_sched_us: Vec::new(),
        user_owns: Vec::new(),
        conv_owner: vec![None; n_conv],
        conv_waiters: vec![VecDeque::new(); n_conv],
        batches: Vec::new(),
        free_batches: Vec::new(),
        gap_pool: Vec::new(),
        session_ids: (0..n_conv as u32).map(|c| src.session_id(c)).collect(),
        keys_buf: Vec::new(),
        trace_keys: Vec::new(),
        finished: Vec::with_capacity(src.request_count()),
        per_replica_requests: vec![0; cfg.replicas as usize],
        decide_wall_ns: Vec::with_capacity(src.request_count()),
        stop_us: cfg.driver.duration_s.map(secs_us),
        warmup_us: secs_us(cfg.driver.warmup_s),
        timeout_us: secs_us(cfg.driver.timeout_s),
        tokenize_us: cfg.tokenize_us(),
        max_tokens: match src {
            Source::Plan { plan, .. } => plan.spec.output_tokens,
            // Per request (the trace's output length); see `decide`.
            Source::Trace(_) => 0,
        },
        event_batches: 0,
        events: 0,
        now: 0,
        last_end_us: 0,
        drain_starts: match src {
            Source::Trace(t) => t.drain_starts(),
            Source::Plan { .. } => Vec::new(),
        },
        drain_pending: None,
        drain_shift_us: 0,
        trace_open: 0,
    };
    sim.start();
    sim.run();
    let mut totals = EngineTotals {
        event_batches: sim.event_batches,
        ..EngineTotals::default()
    };
    for r in &sim.replicas {
        let c = r.engine.counters();
        totals.prefix_queries_tokens += c.prefix_cache_queries_tokens;
        totals.prefix_hits_tokens += c.prefix_cache_hits_tokens;
        totals.preemptions += c.preemptions;
        totals.steps += c.steps;
        totals.generation_tokens += c.generation_tokens;
    }
    Ok(SimOutput {
        policy: sim.policy.name().to_string(),
        session_ids: std::mem::take(&mut sim.session_ids),
        end_us: sim.last_end_us,
        engine: totals,
        per_replica_requests: sim.per_replica_requests,
        index: sim.policy.index_stats(),
        index_event_errors: sim.policy.event_errors(),
        decide_wall_ns: sim.decide_wall_ns,
        events: sim.events,
        skipped_draws: sim.cursors.iter().map(WalkCursor::skipped).sum(),
        outcomes: {
            let mut reqs: Vec<Option<Outcome>> =
                sim.reqs.into_iter().map(|l| Some(l.out)).collect();
            sim.finished
                .iter()
                .filter_map(|&r| reqs[r as usize].take())
                .collect()
        },
    })
}

impl Sim<'_> {
    fn push(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        self.heap.push(Item {
            t,
            seq: self.seq,
            ev,
        });
    }

    fn stopped(&self, scheduled_us: u64) -> bool {
        self.stop_us.is_some_and(|s| scheduled_us >= s)
    }

    fn start(&mut self) {
        let plan = match self.src {
            Source::Plan { plan, .. } => plan,
            Source::Trace(t) => {
                if let Some(r) = t.requests().first()
                    && !self.stopped(r.at_us)
                {
                    self.push(r.at_us, Ev::Fire(0));
                }
                return;
            }
        };
        match &plan.schedule {
            Schedule::Closed { users, spare_draws } => {
                self.cursors = users
                    .iter()
                    .enumerate()
                    .map(|(u, s)| {
                        let spare = spare_draws.get(u).map_or(&[][..], Vec::as_slice);
                        WalkCursor::new(s, spare, plan.spec.sharing)
                    })
                    .collect();
                self.user_step = vec![(0, 0, false); users.len()];
                self.user_sched_us = vec![0; users.len()];
                self.user_owns = vec![None; users.len()];
                for u in 0..users.len() {
                    self.schedule_user(u as u32, 0);
                }
            }
            Schedule::Open { arrivals } => {
                if let Some(a) = arrivals.first()
                    && !self.stopped(a.at_us)
                {
                    self.push(a.at_us, Ev::Fire(0));
                }
            }
        }
    }

    /// A closed-loop user became ready at `ready_us`: it picks its next step (claiming a
    /// conversation when a walk starts), which fires after its think.
    fn schedule_user(&mut self, user: u32, ready_us: u64) {
        let Source::Plan { plan, .. } = self.src else {
            return;
        };
        let Schedule::Closed { users, .. } = &plan.schedule else {
            return;
        };
        let u = user as usize;
        let script = &users[u];
        let owners = &mut self.conv_owner;
        let pick = self.cursors[u].next(|c| match owners.get_mut(c as usize) {
            Some(o @ None) => {
                *o = Some(user);
                true
            }
            _ => false,
        });
        match pick {
            Pick::Step {
                step,
                conversation,
                ends_walk,
            } => {
                // Only a claiming (exclusive) cursor owns what it walks.
                if self.cursors[u].claims() {
                    self.user_owns[u] = Some(conversation);
                }
                let at = ready_us + script[step].think_us;
                if self.stopped(at) {
                    self.release(user, ready_us);
                    return;
                }
                self.user_step[u] = (step as u32, conversation, ends_walk);
                self.user_sched_us[u] = at;
                self.push(at, Ev::Fire(user));
            }
            Pick::Wait { conversation, step } => {
                // The think runs while waiting, as in the live driver.
                let at = ready_us + script[step].think_us;
                if self.stopped(at) {
                    return;
                }
                self.user_sched_us[u] = at;
                self.conv_waiters[conversation as usize].push_back(user);
            }
            Pick::Done => {}
        }
    }

    /// Ends `user`'s ownership of its conversation at `t`, handing it to the first waiter.
    fn release(&mut self, user: u32, t: u64) {
        let Some(c) = self.user_owns[user as usize].take() else {
            return;
        };
        let c = c as usize;
        let Some(w) = self.conv_waiters[c].pop_front() else {
            self.conv_owner[c] = None;
            return;
        };
        self.conv_owner[c] = Some(w);
        self.user_owns[w as usize] = Some(c as u32);
        match self.cursors[w as usize].start_waited() {
            Pick::Step {
                step,
                conversation,
                ends_walk,
            } => {
                self.user_step[w as usize] = (step as u32, conversation, ends_walk);
                let at = self.user_sched_us[w as usize].max(t);
                self.push(at, Ev::Fire(w));
            }
            // Unreachable for a waiter, but never leave the conversation owned by nobody.
            Pick::Wait { .. } | Pick::Done => self.release(w, t),
        }
    }

    fn run(&mut self) {
        loop {
            let next_heap = self.heap.peek().map(|i| i.t);
            // Drop timeouts of requests that already ended without touching the clock.
            while let Some(&(_, r)) = self.timeouts.front()
                && self.reqs[r as usize].done
            {
                self.timeouts.pop_front();
            }
            if let Some(&(at, r)) = self.timeouts.front()
                && next_heap.is_none_or(|h| at < h)
            {
                self.timeouts.pop_front();
                self.now = self.now.max(at);
                self.events += 1;
                self.timeout(r, at);
                continue;
            }
            let Some(Item { t, ev, .. }) = self.heap.pop() else {
                break;
            };
            self.now = self.now.max(t);
            self.events += 1;
            match ev {
                Ev::Fire(who) => self.fire(who, t),
                Ev::Decide(r) => self.decide(r, t),
                Ev::Wake(i) => {
                    let rep = &mut self.replicas[i as usize];
                    // A superseded wake, or one made obsolete by a step that started at once
                    // when the previous one ended.
                    if rep.wake_at == Some(t) && !rep.in_flight {
                        rep.wake_at = None;
                        self.start_step(i, t);
                    }
                }
                Ev::StepEnd(i) => self.end_step(i, t),
                Ev::Deliver(i, b) => self.deliver(i, b, t),
            }
        }
    }

    fn fire(&mut self, who: u32, t: u64) {
        let plan = match self.src {
            Source::Plan { plan, .. } => plan,
            Source::Trace(trace) => {
                let requests = trace.requests();
                if let Some(next) = requests.get(who as usize + 1) {
                    let at = next.at_us + self.drain_shift_us;
                    if self.drain_starts[who as usize + 1] {
                        // Sent when everything before it has ended (`finish`).
                        self.drain_pending = Some(who + 1);
                    } else if !self.stopped(at) {
                        self.push(at, Ev::Fire(who + 1));
                    }
                }
                self.trace_open += 1;
                let q = requests[who as usize];
                let origin = Origin::Trace {
                    index: who,
                    line: q.line,
                };
                let r = self.open_request(origin, q.session, q.turn, t, t);
                // Open loop without turn order: a trace's prompt never depends on a reply.
                self.send(r, t);
                return;
            }
        };
        let (origin, conversation, turn, scheduled_us) = match &plan.schedule {
            Schedule::Closed { users, .. } => {
                let (k, conversation, _) = self.user_step[who as usize];
                let step = users[who as usize][k as usize];
                (
                    Origin::Closed {
                        user: who,
                        index: k,
                    },
                    conversation,
                    step.turn,
                    self.user_sched_us[who as usize].min(t),
                )
            }
            Schedule::Open { arrivals } => {
                let a = arrivals[who as usize];
                if let Some(next) = arrivals.get(who as usize + 1)
                    && !self.stopped(next.at_us)
                {
                    let at = next.at_us;
                    self.push(at, Ev::Fire(who + 1));
                }
                (Origin::Open { index: who }, a.conversation, a.turn, t)
            }
        };
        let r = self.open_request(origin, conversation, turn, scheduled_us, t);
        let c = conversation as usize;
        if !plan.spec.sharing.one_turn_at_a_time() {
            self.send(r, t);
        } else if self.conv_busy[c] {
            self.conv_queue[c].push_back(r);
        } else {
            self.conv_busy[c] = true;
            self.send(r, t);
        }
    }

    /// Records a new request fired at `t`; returns its index.
    fn open_request(
        &mut self,
        origin: Origin,
        conversation: u32,
        turn: u32,
        scheduled_us: u64,
        t: u64,
    ) -> u32 {
        let r = self.reqs.len() as u32;
        let gaps = self.gap_pool.pop().unwrap_or_default();
        self.reqs.push(Live {
            out: Outcome {
                origin,
                conversation,
                turn,
                scheduled_us,
                sent_us: t,
                first_us: None,
                last_us: None,
                end_us: t,
                itl_p50_us: None,
                prompt_tokens: None,
                output_tokens: 0,
                cached_tokens: 0,
                status: 0,
                error: String::new(),
                warmup: false,
                decision: None,
            },
            replica: None,
            gaps,
            done: false,
        });
        r
    }

    fn send(&mut self, r: u32, t: u64) {
        let live = &mut self.reqs[r as usize];
        live.out.sent_us = t;
        live.out.warmup = t < self.warmup_us;
        self.timeouts.push_back((t + self.timeout_us, r));
        if self.keying == Keying::ExactTokens {
            let at = t + self.tokenize_us;
            self.push(at, Ev::Decide(r));
        } else {
            self.decide(r, t);
        }
    }

    fn decide(&mut self, r: u32, t: u64) {
        if self.reqs[r as usize].done {
            return; // timed out during the tokenize round trip
        }
        let (conversation, turn, origin) = {
            let o = &self.reqs[r as usize].out;
            (o.conversation, o.turn, o.origin)
        };
        let mut prompt = Vec::new();
        let mut max_tokens = self.max_tokens;
        match (self.src, origin) {
            (Source::Trace(trace), Origin::Trace { index, .. }) => {
                let q = trace.requests()[index as usize];
                max_tokens = q.max_tokens;
                let belief = self.keying == Keying::BeliefBytes;
                crate::trace::request_into(
                    trace,
                    &q,
                    &self.cfg.model,
                    self.cfg.router.block_bytes,
                    &mut prompt,
                    belief.then_some(&mut self.trace_keys),
                );
            }
            (Source::Plan { plan, book }, _) => {
                // An open loop's arrival asks for what the driver sends it with (one token for
                // a prime).
                if let (Origin::Open { index }, Schedule::Open { arrivals }) =
                    (origin, &plan.schedule)
                    && let Some(a) = arrivals.get(index as usize)
                {
                    max_tokens = a.max_tokens(max_tokens);
                }
                if let Err(e) = book.prompt_into(conversation, turn, &mut prompt) {
                    self.fail(r, t, 400, format!("http: {e}"));
                    return;
                }
            }
            (Source::Trace(_), _) => {
                self.fail(r, t, 400, "http: not a trace request".into());
                return;
            }
        }
        let tokens_per_block;
        let keys: &[u64] = match self.keying {
            Keying::None => {
                tokens_per_block = f64::from(self.cfg.engine.block_size);
                &[]
            }
            Keying::BeliefBytes => {
                tokens_per_block = policies::belief_tokens_per_block(
                    self.cfg.router.block_bytes,
                    self.cfg.router.bytes_per_token,
                );
                match self.src {
                    // In range: `prompt_into` accepted the same conversation and turn.
                    Source::Plan { book, .. } => {
                        book.belief_keys(conversation, turn).unwrap_or(&[])
                    }
                    Source::Trace(_) => &self.trace_keys,
                }
            }
            Keying::ExactTokens => {
                tokens_per_block = f64::from(self.cfg.engine.block_size);
                // As the router keys it (`proxy::service::route_keys`).
                kv_index::hash::token_block_keys_into(
                    self.cfg.model.as_bytes(),
                    kv_index::hash::cacheable_prompt_tokens(&prompt),
                    self.cfg.engine.block_size as usize,
                    &mut self.keys_buf,
                );
                &self.keys_buf
            }
        };
        let req = RouteRequest {
            session_id: Some(&self.session_ids[conversation as usize]),
            block_keys: keys,
            tokens_per_block,
            now_us: t,
        };
        let t0 = Instant::now();
        let decided = self.policy.get().decide(&req, &self.fleet);
        self.decide_wall_ns.push(t0.elapsed().as_nanos() as u64);
        let d = match decided {
            Ok(d) => d,
            Err(e) => {
                self.fail(r, t, 503, format!("upstream: no replica available: {e}"));
                return;
            }
        };
        self.policy.get().on_served(&req, d.replica);
        let i = d.replica as usize;
        self.fleet[i].outstanding += 1;
        let exact = self.keying == Keying::ExactTokens;
        let rc = &self.cfg.router;
        let decision = RouterDecision {
            replica: d.replica,
            branch: d.branch.as_str(),
            predicted_match_tokens: d.predicted_match_tokens,
            outstanding_chosen: d.outstanding_chosen,
            outstanding_min: d.outstanding_min,
            decide_ns: rc.decide_cost_us * 1000,
            overhead_us: rc.forward_overhead_us + rc.decide_cost_us,
            tokenize_us: exact.then_some(self.tokenize_us),
        };
        let dispatch = t + rc.forward_overhead_us + rc.decide_cost_us;
        let live = &mut self.reqs[r as usize];
        live.out.decision = Some(decision);
        live.replica = Some(d.replica);
        let params = SamplingParams {
            max_tokens,
            ignore_eos: true,
        };
        let prompt_len = prompt.len();
        let added = self.replicas[i]
            .engine
            .add_request(u64::from(r), prompt, params, dispatch);
        match added {
            Ok(()) => {
                self.reqs[r as usize].out.prompt_tokens = Some(prompt_len as u32);
                self.ensure_wake(d.replica);
            }
            Err(e) => {
                let msg = format!("http: 400 {e}");
                self.fail(r, dispatch, 400, msg);
            }
        }
    }

    /// Schedules replica `i`'s next step if it is idle and has work.
    fn ensure_wake(&mut self, i: u32) {
        let rep = &self.replicas[i as usize];
        if rep.in_flight {
            return; // the step's end reschedules
        }
        if let Some(w) = rep.engine.next_wakeup_us(rep.logical_us)
            && rep.wake_at.is_none_or(|cur| w < cur)
        {
            self.replicas[i as usize].wake_at = Some(w);
            self.push(w, Ev::Wake(i));
        }
    }

    fn start_step(&mut self, i: u32, t: u64) {
        let rep = &mut self.replicas[i as usize];
        let start = t.max(rep.logical_us);
        rep.engine.step_into(start, &mut rep.out);
        if rep.out.num_scheduled_reqs > 0 {
            rep.in_flight = true;
            rep.wake_at = None;
            let end = rep.out.end_us();
            self.push(end, Ev::StepEnd(i));
        } else {
            rep.logical_us = start;
            self.take_events(i, start);
            // Nothing could run now: wait for the next frontend completion (never `start`
            // itself, which would spin).
            let rep = &self.replicas[i as usize];
            if let Some(w) = rep.engine.next_wakeup_us(start)
                && w > start
            {
                self.replicas[i as usize].wake_at = Some(w);
                self.push(w, Ev::Wake(i));
            }
        }
    }

    /// Queues the replica's pending KV events for delivery one transport delay after `t`.
    fn take_events(&mut self, i: u32, t: u64) {
        let rep = &mut self.replicas[i as usize];
        if rep.out.kv_events.is_empty() {
            return;
        }
        let events = std::mem::take(&mut rep.out.kv_events);
        let slot = match self.free_batches.pop() {
            Some(s) => {
                self.batches[s as usize] = Some((i, events));
                s
            }
            None => {
                self.batches.push(Some((i, events)));
                (self.batches.len() - 1) as u32
            }
        };
        let at = t + self.cfg.router.event_transport_us;
        self.push(at, Ev::Deliver(i, slot));
    }

    fn deliver(&mut self, i: u32, slot: u32, t: u64) {
        let Some((_, mut events)) = self.batches[slot as usize].take() else {
            return;
        };
        self.free_batches.push(slot);
        self.event_batches += 1;
        for e in events.drain(..) {
            let ev = match e {
                engine_core::KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                } => kv_index::KvEvent::Stored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    cache_salt: None,
                },
                engine_core::KvEvent::BlockRemoved { block_hashes } => {
                    kv_index::KvEvent::Removed { block_hashes }
                }
                engine_core::KvEvent::AllBlocksCleared => kv_index::KvEvent::AllCleared,
            };
            self.policy.get().on_kv_event(i, &ev, t);
        }
        // Hand the emptied vector back to the replica so its next batch reuses the buffer.
        let rep = &mut self.replicas[i as usize];
        if rep.out.kv_events.capacity() == 0 {
            rep.out.kv_events = events;
        }
    }

    fn end_step(&mut self, i: u32, t: u64) {
        {
            let rep = &mut self.replicas[i as usize];
            rep.in_flight = false;
            rep.logical_us = t;
        }
        self.take_events(i, t);
        if self.cfg.policy.residency_branch {
            // The live router polls `vllm:kv_cache_usage_perc`; here the view is as of the last
            // step end.
            self.fleet[i as usize].kv_usage =
                Some(self.replicas[i as usize].engine.kv_usage() as f32);
        }
        let tokens = std::mem::take(&mut self.replicas[i as usize].out.tokens);
        for tok in &tokens {
            let live = &mut self.reqs[tok.id as usize];
            if live.done {
                continue;
            }
            if tok.output_index == 0 {
                live.out.first_us = Some(t);
                live.out.cached_tokens = tok.cached_tokens;
                live.out.status = 200;
            } else if let Some(last) = live.out.last_us {
                live.gaps.push((t - last) as f64);
            }
            live.out.last_us = Some(t);
            live.out.output_tokens += 1;
            if tok.finish.is_some() {
                self.complete(tok.id as u32, t);
            }
        }
        self.replicas[i as usize].out.tokens = tokens;
        // The engine loop starts the next step at once when it has work.
        let rep = &self.replicas[i as usize];
        match rep.engine.next_wakeup_us(t) {
            Some(w) if w == t => self.start_step(i, t),
            Some(w) => {
                self.replicas[i as usize].wake_at = Some(w);
                self.push(w, Ev::Wake(i));
            }
            None => self.replicas[i as usize].wake_at = None,
        }
    }

    fn complete(&mut self, r: u32, t: u64) {
        let live = &mut self.reqs[r as usize];
        live.done = true;
        live.out.end_us = t;
        live.out.itl_p50_us = schema::stats::quantile_in_place(&mut live.gaps, 0.5);
        self.finish(r, t);
    }

    fn timeout(&mut self, r: u32, t: u64) {
        if self.reqs[r as usize].done {
            return;
        }
        if let Some(i) = self.reqs[r as usize].replica {
            self.replicas[i as usize].engine.abort(u64::from(r));
        }
        let status = self.reqs[r as usize].out.status;
        let msg = format!(
            "timeout: no complete response within {} s",
            self.cfg.driver.timeout_s
        );
        self.fail(r, t, status, msg);
    }

    fn fail(&mut self, r: u32, t: u64, status: u16, error: String) {
        let live = &mut self.reqs[r as usize];
        live.done = true;
        live.out.end_us = t;
        live.out.status = status;
        live.out.error = error;
        self.finish(r, t);
    }

    /// Releases everything a finished request held and lets its successors go.
    fn finish(&mut self, r: u32, t: u64) {
        self.last_end_us = self.last_end_us.max(t);
        let live = &mut self.reqs[r as usize];
        let mut gaps = std::mem::take(&mut live.gaps);
        gaps.clear();
        self.gap_pool.push(gaps);
        let conversation = live.out.conversation as usize;
        let origin = live.out.origin;
        if let Some(i) = live.replica {
            let f = &mut self.fleet[i as usize];
            f.outstanding = f.outstanding.saturating_sub(1);
            self.per_replica_requests[i as usize] += 1;
        }
        self.finished.push(r);
        if let (Origin::Trace { .. }, Source::Trace(trace)) = (origin, self.src) {
            self.trace_open -= 1;
            if self.trace_open == 0
                && let Some(next) = self.drain_pending.take()
            {
                // The stage that waited starts now: it and every later arrival move by the wait.
                let planned = trace.requests()[next as usize].at_us + self.drain_shift_us;
                let at = planned.max(t);
                self.drain_shift_us += at - planned;
                if !self.stopped(at) {
                    self.push(at, Ev::Fire(next));
                }
            }
        }
        if let Some(next) = self.conv_queue[conversation].pop_front() {
            self.send(next, t);
        } else {
            self.conv_busy[conversation] = false;
        }
        if let Origin::Closed { user, .. } = origin {
            if self.user_step[user as usize].2 {
                self.release(user, t);
            }
            self.schedule_user(user, t);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_pop_in_time_then_creation_order() {
        let mut heap = BinaryHeap::new();
        for (t, seq) in [(5, 1), (3, 2), (5, 0), (3, 3)] {
            heap.push(Item {
                t,
                seq,
                ev: Ev::Wake(0),
            });
        }
        let order: Vec<(u64, u64)> =
            std::iter::from_fn(|| heap.pop().map(|i| (i.t, i.seq))).collect();
        assert_eq!(order, [(3, 2), (3, 3), (5, 0), (5, 1)]);
    }
}
