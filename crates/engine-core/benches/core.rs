//! Engine-core step cost: the simulator steps the core millions of times.

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use engine_core::{Engine, EngineConfig, SamplingParams, StepModel, StepOutput};
use std::time::Instant;

fn engine(events: bool) -> Engine {
    Engine::new(EngineConfig {
        num_gpu_blocks: 16_384,
        enable_kv_events: events,
        model: StepModel {
            frontend_ms: 0.0,
            ..StepModel::default()
        },
        ..EngineConfig::default()
    })
    .expect("valid config")
}

/// A conversation-like prompt: a shared 1,100-token prefix per conversation plus a turn.
fn prompt(conv: u32, turn: u32) -> Vec<u32> {
    let mut p: Vec<u32> = (0..1100).map(|i| conv * 10_000 + i).collect();
    p.extend((0..150 * (turn + 1)).map(|i| 5_000_000 + conv * 10_000 + i));
    p
}

/// `n` closed-loop conversations against one engine in virtual time.
struct Load {
    e: Engine,
    out: StepOutput,
    now: u64,
    next_id: u64,
    conv_of: std::collections::HashMap<u64, (u32, u32)>,
}

impl Load {
    fn new(n: u32, events: bool) -> Self {
        let mut l = Self {
            e: engine(events),
            out: StepOutput::default(),
            now: 0,
            next_id: 0,
            conv_of: Default::default(),
        };
        for c in 0..n {
            l.add(c, 0);
        }
        l
    }

    fn add(&mut self, conv: u32, turn: u32) {
        let params = SamplingParams {
            max_tokens: 128,
            ignore_eos: true,
        };
        self.e
            .add_request(self.next_id, prompt(conv, turn), params, self.now)
            .expect("fits");
        self.conv_of.insert(self.next_id, (conv, turn));
        self.next_id += 1;
    }

    /// One step; each finished conversation sends its next turn at once.
    fn step(&mut self) {
        let t = self
            .e
            .next_wakeup_us(self.now)
            .expect("closed loop never idles");
        self.e.step_into(t, &mut self.out);
        self.now = self.out.end_us();
        let done: Vec<(u32, u32)> = self
            .out
            .tokens
            .iter()
            .filter(|t| t.finish.is_some())
            .filter_map(|t| self.conv_of.remove(&t.id))
            .collect();
        for (conv, turn) in done {
            self.add(conv, (turn + 1) % 8);
        }
    }
}

/// Times `iters` steps after reaching steady state.
fn run_steps(n: u32, events: bool, iters: u64) -> std::time::Duration {
    let mut l = Load::new(n, events);
    for _ in 0..300 {
        l.step();
    }
    let start = Instant::now();
    for _ in 0..iters {
        l.step();
    }
    start.elapsed()
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("engine_step");
    for n in [1u32, 32, 256] {
        for events in [true, false] {
            let id = format!("{n}_running/events_{}", if events { "on" } else { "off" });
            g.bench_with_input(BenchmarkId::from_parameter(id), &n, |b, &n| {
                b.iter_custom(|iters| run_steps(n, events, iters));
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
