//! Where a live routing decision's time goes, on the router's own state (`proxy::state::Shared`,
//! the same lock, views and policy the request path uses), without the network:
//!
//! `cargo run --release -p proxy --example decide_cost [-- --decisions 600 --evict-mib 48]`
//!
//! For prefix-affinity over 5 replicas, 800 chat sessions of 8 KiB warmed into the index, each
//! decision a next turn of one session (its prompt plus a new tail), it times the stages of the
//! request path separately — parse + render + hash (`keys`), `Shared::route` (lock, views, `decide`, load increment; `decide_ns` is
//! the part inside `decide`), `Shared::served` (no lock for the decided replica) and the same
//! call made to take the lock as it did before — in
//! three conditions:
//! - `warm`: decisions back to back, as in `cargo bench -p policies`;
//! - `cold`: `--evict-mib` of other memory written between two decisions, as the engines and
//!   the driver do between two requests on the shared cores of a live cell;
//! - `events`: exact-residency with a second thread applying KV event batches through the same
//!   lock (`Shared::kv_events`) as fast as it can, the worst case of lock contention.
//!
//! Percentiles are type 7 over the decisions (`schema::stats::quantile`'s rule).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use policies::{PolicySpec, RouteRequest};
use proxy::ReplicaSpec;
use proxy::request::{Endpoint, parse};
use proxy::rows::RowSink;
use proxy::state::{Settings, Shared};
use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;

const SESSIONS: usize = 800;
const PROMPT_BYTES: usize = 8 * 1024;
const MODEL: &str = "bench-model";

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    let h = (v.len() - 1) as f64 * q;
    let (lo, hi) = (h.floor() as usize, h.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (h - lo as f64)
}

fn shared(policy: &str) -> Shared {
    let spec = PolicySpec {
        salt: MODEL.into(),
        ..PolicySpec::named(policy)
    };
    let replicas: Vec<ReplicaSpec> = (0..5)
        .map(|i| ReplicaSpec::new(format!("http://127.0.0.1:{}", 9 + i)))
        .collect();
    let settings = Settings {
        model: Some(MODEL.into()),
        block_bytes: 64,
        block_tokens: 16,
        belief_tokens_per_block: policies::belief_tokens_per_block(
            64,
            policies::DEFAULT_BELIEF_BYTES_PER_TOKEN,
        ),
        exact_salt: MODEL.into(),
        kv_events_format: proxy::events::EventFormat::Vllm,
        max_body_bytes: 8 << 20,
        scrape_kv_usage: false,
        body_read_timeout: std::time::Duration::from_secs(30),
        upstream_head_timeout: std::time::Duration::from_secs(300),
        upstream_idle_timeout: std::time::Duration::from_secs(120),
        health_fails_to_down: 3,
        health_oks_to_up: 2,
        max_in_flight_per_replica: u32::MAX,
        upstream_keep_alive: true,
        token_parity_check: false,
    };
    Shared::new(
        policies::build(&spec).expect("policy"),
        &replicas,
        RowSink::disabled(),
        settings,
        7,
    )
    .expect("state")
}

/// One chat body per session and turn: the session's 8 KiB context, then `turn` short turns.
fn body(contexts: &[String], session: usize, turn: usize) -> Vec<u8> {
    let mut msgs = vec![serde_json::json!({"role": "system", "content": contexts[session]})];
    for t in 0..turn {
        msgs.push(serde_json::json!({"role": "user", "content": format!("question {t} of session {session}")}));
        msgs.push(
            serde_json::json!({"role": "assistant", "content": format!("answer {t}, scripted")}),
        );
    }
    msgs.push(serde_json::json!({"role": "user", "content": format!("question {turn}")}));
    serde_json::json!({"model": MODEL, "messages": msgs, "stream": true})
        .to_string()
        .into_bytes()
}

#[derive(Default)]
struct Samples {
    parse_ns: Vec<f64>,
    render_ns: Vec<f64>,
    hash_ns: Vec<f64>,
    keys_ns: Vec<f64>,
    route_ns: Vec<f64>,
    decide_ns: Vec<f64>,
    served_ns: Vec<f64>,
    served_locked_ns: Vec<f64>,
}

impl Samples {
    fn print(&mut self, mode: &str) {
        let mut row = format!("| {mode} |");
        for v in [
            &mut self.parse_ns,
            &mut self.render_ns,
            &mut self.hash_ns,
            &mut self.keys_ns,
            &mut self.decide_ns,
            &mut self.route_ns,
            &mut self.served_ns,
            &mut self.served_locked_ns,
        ] {
            row.push_str(&format!(
                " {:.1} / {:.1} |",
                quantile(v, 0.5) / 1e3,
                quantile(v, 0.99) / 1e3
            ));
        }
        println!("{row}");
    }
}

/// Routes `decisions` next turns of random sessions; `between` runs between two decisions.
fn measure(
    s: &Shared,
    contexts: &[String],
    decisions: usize,
    seed: u64,
    mut between: impl FnMut(),
) -> Samples {
    let mut rng = Pcg64Mcg::seed_from_u64(seed);
    let mut out = Samples::default();
    let mut rendered = Vec::new();
    for i in 0..decisions {
        let session = rng.random_range(0..SESSIONS);
        between();
        // Built after the eviction: the body is as warm as one just read from the socket.
        let b = body(contexts, session, 1 + i % 5);
        let t0 = Instant::now();
        let parsed = parse(Endpoint::Chat, &b).expect("body");
        let tp = Instant::now();
        rendered.clear();
        parsed.render_into(&mut rendered);
        let tr = Instant::now();
        let mut keys = Vec::new();
        kv_index::hash::byte_block_keys_into(MODEL.as_bytes(), &rendered, 64, &mut keys);
        let t1 = Instant::now();
        out.parse_ns.push((tp - t0).as_nanos() as f64);
        out.render_ns.push((tr - tp).as_nanos() as f64);
        out.hash_ns.push((t1 - tr).as_nanos() as f64);
        out.keys_ns.push((t1 - t0).as_nanos() as f64);
        let req = RouteRequest {
            session_id: None,
            block_keys: &keys,
            tokens_per_block: s.settings.belief_tokens_per_block,
            now_us: s.clock.now_us(),
        };
        let routed = s.route(&req).expect("a replica");
        let t2 = Instant::now();
        s.served(&req, routed.decision.replica, routed.guard.replica());
        let t3 = Instant::now();
        // What `served` cost before it skipped the lock: the same call told that a retry moved
        // the request, which takes the lock and calls `on_served`; for the replica `decide` chose
        // that returns at its `recent` check, changing nothing (as the old call did).
        let chose = routed.guard.replica();
        s.served(&req, chose.id + 1, chose);
        let t4 = Instant::now();
        out.served_locked_ns.push((t4 - t3).as_nanos() as f64);
        drop(routed.guard);
        out.route_ns.push((t2 - t1).as_nanos() as f64);
        out.decide_ns.push(routed.decide_ns as f64);
        out.served_ns.push((t3 - t2).as_nanos() as f64);
    }
    out
}

fn main() {
    let decisions = arg("--decisions", 600);
    let evict_mib = arg("--evict-mib", 48);
    let mut rng = Pcg64Mcg::seed_from_u64(2026);
    let contexts: Vec<String> = (0..SESSIONS)
        .map(|_| {
            (0..PROMPT_BYTES)
                .map(|_| char::from(rng.random_range(b'a'..=b'z')))
                .collect()
        })
        .collect();
    println!(
        "decide_cost: prefix-affinity, 5 replicas, {SESSIONS} sessions × {PROMPT_BYTES} B warmed, {decisions} decisions per mode; µs p50 / p99\n"
    );
    println!(
        "| mode | parse | render | hash | parse + render + hash | decide_ns | route (lock + views + decide) | served | served, locked (before) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");

    let s = shared("prefix-affinity");
    // Warm the index: every session's first turn served once.
    let _ = measure(&s, &contexts, SESSIONS * 2, 1, || {});
    measure(&s, &contexts, decisions, 2, || {}).print("warm");
    let mut evict = vec![0u8; evict_mib << 20];
    let mut pass = 0u8;
    measure(&s, &contexts, decisions, 3, || {
        pass = pass.wrapping_add(1);
        for line in evict.chunks_mut(64) {
            line[0] = pass;
        }
        std::hint::black_box(&evict);
    })
    .print(&format!("cold ({evict_mib} MiB between)"));

    // Lock contention: exact-residency, a second thread applying event batches back to back.
    let s = Arc::new(shared("exact-residency"));
    let stop = Arc::new(AtomicBool::new(false));
    let applier = {
        let (s, stop) = (s.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            let mut batches = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let events: Vec<kv_index::KvEvent> = (0..16)
                    .map(|_| {
                        n += 1;
                        kv_index::KvEvent::Stored {
                            block_hashes: vec![n],
                            parent_block_hash: None,
                            token_ids: (0..16).map(|t| (n * 16 + t) as u32).collect(),
                            block_size: 16,
                            cache_salt: None,
                        }
                    })
                    .collect();
                s.kv_events((n % 5) as u32, &events);
                batches += 1;
            }
            batches
        })
    };
    let t = Instant::now();
    let mut m = measure(&s, &contexts, decisions, 4, || {});
    stop.store(true, Ordering::Relaxed);
    let batches = applier.join().unwrap();
    m.print("events (exact-residency, 16-event batches back to back)");
    println!(
        "\n{batches} event batches applied in {:.2} s alongside ({:.0}/s).",
        t.elapsed().as_secs_f64(),
        batches as f64 / t.elapsed().as_secs_f64()
    );
}
