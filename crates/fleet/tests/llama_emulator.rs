//! Differential test of the emulator's llama.cpp cache model against the real `llama-server`,
//! request by request, in the manner of Dynamo's kv-router tests: the same multi-turn chat
//! script goes to one real replica (the tiny model, the fleet's pinned flags) and to the
//! emulator (`engine --cache-model llama-slots`, the same slot settings), and each side's
//! reported cached tokens are compared.
//!
//! **The unit.** The two sides tokenize differently (the tiny GGUF's word vocabulary and ChatML
//! template; the emulator's ~4-bytes-per-token tokenizer and Llama 3 template), and each side
//! continues a conversation with its own generated reply, so raw token counts cannot be equal.
//! What the slot model decides — which slot a request lands on, and so whether the conversation's
//! earlier turns are still cached — is tokenizer-independent. So every request is classified on
//! each side, in that side's own tokens: a later turn is a **hit** when its cached tokens cover
//! at least the whole previous turn's prompt (the conversation's slot survived and was chosen),
//! else a **miss**; a first turn is **first** (nothing of its own to find) and must have cached
//! less than a tenth of its prompt on both sides. Agreement is the share of requests whose classes
//! match; the cached share of the prompt is reported beside it.
//!
//! **The script.** 6 conversations × 4 turns on 4 slots, interleaved in a different order each
//! round, so slots are reused and overwritten (least recently used); one turn appends a message
//! so long that the conversation's cached share falls below `--slot-prompt-similarity` 0.1 (the
//! request goes to the LRU slot, not its own); one round holds a slot busy with a long
//! generation while two other requests choose among the remaining slots. Requests otherwise go
//! one at a time, so slot choice does not depend on timing.
//!
//! **The self-test.** The same script against four deliberately wrong emulators — vLLM's paged
//! prefix cache (1-token blocks, ample pool), llama-slots with the similarity rule off (LRU
//! only), with a threshold of 0.01 instead of 0.1, and with 8 slots instead of 4 — must each
//! disagree with the real engine on at least one request; otherwise the comparison could not tell
//! a right model from a wrong one. Each request's latency on both sides is printed beside its
//! class (reported, not asserted: the emulator runs the measured floors, the real engine shares
//! the machine).
//!
//! Ignored by default (`cargo test -p fleet --test llama_emulator -- --include-ignored`), never
//! skipped: without the llama-server binary or the model the test fails with
//! `bash scripts/llama-server.sh`. Builds the release `engine` binary first (a no-op when fresh).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fleet::fleet::never;
use fleet::http;
use fleet::llama::{self, LlamaSpec};
use fleet::{Fleet, FleetOptions, Source};
use serde_json::{Value, json};

use test_support::release_bin;

const MODEL: &str = "kvroute/tiny";
const CONVERSATIONS: usize = 6;

/// An emulator process, killed through its own handle when dropped.
struct Emulator {
    child: Child,
    url: String,
}

impl Emulator {
    fn start(bin: &Path, speed: &str, extra: &[&str]) -> Emulator {
        let mut child = Command::new(bin)
            .args([
                "--port",
                "0",
                "--model",
                MODEL,
                "--enable-prompt-tokens-details",
                "--max-model-len",
                "16384",
                "--step-model",
                "llama-tiny",
                "--speed",
                speed,
            ])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("engine starts");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("readiness line");
        let ready: Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("readiness line {line:?}: {e}"));
        let url = format!("http://{}", ready["listening"].as_str().expect("listening"));
        Emulator { child, url }
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One request of the script.
#[derive(Debug, Clone, Copy)]
struct Req {
    conv: usize,
    /// Bytes of the new user message.
    user_bytes: usize,
    max_tokens: u32,
}

/// A step: one request alone, or a long request holding its slot while others run one by one.
#[derive(Debug, Clone)]
enum Step {
    Alone(Req),
    Busy { hold: Req, during: Vec<Req> },
}

fn req(conv: usize, user_bytes: usize) -> Req {
    Req {
        conv,
        user_bytes,
        max_tokens: 16,
    }
}

/// 6 conversations × 4 turns, rounds interleaved so that 4 slots are reused and overwritten.
fn script() -> Vec<Step> {
    let mut s = Vec::new();
    // Round 1: six first turns on four slots; the fifth and sixth overwrite the two least
    // recently used.
    for c in 0..CONVERSATIONS {
        s.push(Step::Alone(req(c, 600 + 80 * c)));
    }
    // Round 2, another order. Conversation 5 comes first with a message so long (~14 kB) that
    // its cached share falls below 0.1: it takes the least recently used slot (conversation 2's),
    // not its own, which is alive and more recent.
    for c in [5, 0, 3, 1, 4, 2] {
        let bytes = if c == 5 { 14_000 } else { 300 };
        s.push(Step::Alone(req(c, bytes)));
    }
    // Round 3: conversation 2 generates long enough to hold its slot while 4 and 0 choose among
    // the other three; then the rest.
    s.push(Step::Busy {
        hold: Req {
            conv: 2,
            user_bytes: 200,
            max_tokens: 1200,
        },
        during: vec![req(4, 250), req(0, 250)],
    });
    for c in [5, 1, 3] {
        s.push(Step::Alone(req(c, 250)));
    }
    // Round 4.
    for c in [1, 3, 5, 2, 0, 4] {
        s.push(Step::Alone(req(c, 200)));
    }
    s
}

/// What one side reported for one request.
#[derive(Debug, Clone, Copy)]
struct Obs {
    conv: usize,
    turn: usize,
    prompt_tokens: u64,
    cached_tokens: u64,
    /// Client-side latency of the whole (non-streamed) request, ms.
    latency_ms: f64,
}

/// One chat answer.
struct Reply {
    text: String,
    prompt_tokens: u64,
    cached_tokens: u64,
    latency_ms: f64,
}

/// One side's conversations (its own replies) and what it reported, in script order.
struct Side {
    url: String,
    history: Vec<Vec<Value>>,
    obs: Vec<Obs>,
}

fn user_text(conv: usize, turn: usize, bytes: usize) -> String {
    // A distinct opening per conversation and turn; English-like words the tiny model's
    // vocabulary holds.
    let lead = format!("Conversation {conv} turn {turn}: ");
    workload::text::english_like((conv * 100 + turn) as u64 + 7, &lead, bytes)
}

/// Sends one chat request.
fn chat(url: &str, messages: &[Value], max_tokens: u32) -> Reply {
    let t0 = Instant::now();
    let body = json!({
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": true,
    });
    let r = http::post(
        &http::join(url, "/v1/chat/completions"),
        Some(&body.to_string()),
        Duration::from_secs(120),
    )
    .unwrap_or_else(|e| panic!("{url}: {e:#}"));
    assert_eq!(r.status, 200, "{url}: {}", r.text());
    let v: Value = serde_json::from_slice(&r.body).expect("JSON");
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .expect("content")
        .to_string();
    let usage = &v["usage"];
    let prompt = usage["prompt_tokens"].as_u64().expect("prompt_tokens");
    // vLLM (and the emulator) omit the details when nothing was cached; llama.cpp always sends
    // them, and `timings.cache_n` beside.
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .or_else(|| v["timings"]["cache_n"].as_u64())
        .unwrap_or(0);
    Reply {
        text,
        prompt_tokens: prompt,
        cached_tokens: cached,
        latency_ms: t0.elapsed().as_secs_f64() * 1000.0,
    }
}

impl Side {
    fn new(url: &str) -> Side {
        Side {
            url: url.to_string(),
            history: vec![Vec::new(); CONVERSATIONS],
            obs: Vec::new(),
        }
    }

    /// The messages of `r`'s next turn (its history plus the new user message).
    fn messages(&self, r: Req) -> Vec<Value> {
        let turn = self.history[r.conv].len() / 2 + 1;
        let mut m = self.history[r.conv].clone();
        m.push(json!({"role": "user", "content": user_text(r.conv, turn, r.user_bytes)}));
        m
    }

    fn record(&mut self, r: Req, mut messages: Vec<Value>, reply: Reply) {
        let turn = self.history[r.conv].len() / 2 + 1;
        messages.push(json!({"role": "assistant", "content": reply.text}));
        self.history[r.conv] = messages;
        self.obs.push(Obs {
            conv: r.conv,
            turn,
            prompt_tokens: reply.prompt_tokens,
            cached_tokens: reply.cached_tokens,
            latency_ms: reply.latency_ms,
        });
    }

    fn send(&mut self, r: Req) {
        let m = self.messages(r);
        let reply = chat(&self.url, &m, r.max_tokens);
        self.record(r, m, reply);
    }

    fn run(mut self, script: &[Step]) -> Vec<Obs> {
        for step in script {
            match step {
                Step::Alone(r) => self.send(*r),
                Step::Busy { hold, during } => {
                    let m = self.messages(*hold);
                    let (url, m2, max) = (self.url.clone(), m.clone(), hold.max_tokens);
                    let long = std::thread::spawn(move || {
                        let reply = chat(&url, &m2, max);
                        (reply, Instant::now())
                    });
                    // The others go once the held request holds its slot (its generation lasts
                    // seconds).
                    wait_running(&self.url);
                    for r in during {
                        self.send(*r);
                    }
                    let others_done = Instant::now();
                    let (reply, held_done) = long.join().expect("held request");
                    assert!(
                        held_done > others_done,
                        "{}: the held request finished before the others: the busy-slot round \
                         did not hold its slot",
                        self.url
                    );
                    // Record the held request first: it was admitted first.
                    let n = during.len();
                    let later: Vec<Obs> = self.obs.drain(self.obs.len() - n..).collect();
                    self.record(*hold, m, reply);
                    self.obs.extend(later);
                }
            }
        }
        self.obs
    }
}

/// Waits until the replica at `url` runs a request: llama-server's `GET /slots` shows a slot
/// `is_processing`, the emulator's `/metrics` a non-zero `vllm:num_requests_running`.
fn wait_running(url: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let slots = http::get(&http::join(url, "/slots"), Duration::from_secs(5)).ok();
        let running = match slots.filter(|r| r.status == 200) {
            Some(r) => serde_json::from_slice::<Value>(&r.body)
                .ok()
                .and_then(|v| v.as_array().cloned())
                .is_some_and(|a| a.iter().any(|s| s["is_processing"] == true)),
            None => {
                let m = http::get(&http::join(url, "/metrics"), Duration::from_secs(5))
                    .expect("metrics")
                    .text();
                m.lines().any(|l| {
                    l.starts_with("vllm:num_requests_running{")
                        && l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) >= Some(1.0)
                })
            }
        };
        if running {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{url}: the held request never ran"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A request's class on one side: `first`, `hit` (the previous turn's whole prompt cached) or
/// `miss`.
fn classes(obs: &[Obs]) -> Vec<&'static str> {
    let mut prev = [None; CONVERSATIONS];
    obs.iter()
        .map(|o| {
            let class = match prev[o.conv] {
                None => "first",
                Some(p) if o.cached_tokens >= p => "hit",
                Some(_) => "miss",
            };
            prev[o.conv] = Some(o.prompt_tokens);
            class
        })
        .collect()
}

/// Requests whose classes differ, and the per-request comparison table.
fn compare(real: &[Obs], emu: &[Obs]) -> (usize, String) {
    assert_eq!(real.len(), emu.len());
    let (cr, ce) = (classes(real), classes(emu));
    let mut table = String::from(
        "conv turn | real cached/prompt share class ms | emulator cached/prompt share class ms\n",
    );
    let mut differ = 0;
    for i in 0..real.len() {
        let (r, e) = (real[i], emu[i]);
        assert_eq!(
            (r.conv, r.turn),
            (e.conv, e.turn),
            "the sides ran the same script"
        );
        let mark = if cr[i] == ce[i] { "" } else { "  <-- differs" };
        differ += usize::from(cr[i] != ce[i]);
        table.push_str(&format!(
            "{:>4} {:>4} | {:>5}/{:<5} {:.2} {:<5} {:>6.0} | {:>5}/{:<5} {:.2} {:<5} {:>6.0}{mark}\n",
            r.conv,
            r.turn,
            r.cached_tokens,
            r.prompt_tokens,
            r.cached_tokens as f64 / r.prompt_tokens as f64,
            cr[i],
            r.latency_ms,
            e.cached_tokens,
            e.prompt_tokens,
            e.cached_tokens as f64 / e.prompt_tokens as f64,
            ce[i],
            e.latency_ms,
        ));
    }
    (differ, table)
}

#[test]
#[ignore = "needs llama-server and the release binaries: bash scripts/llama-server.sh && cargo build --release"]
fn emulated_llama_slots_match_the_real_llama_server_request_by_request() {
    let (bin, model) = (llama::default_server_bin(), llama::default_tiny_model());
    if let Err(e) = llama::check_installed(&bin, &model) {
        panic!("{e:#}");
    }
    let spec = LlamaSpec::new(bin, model, MODEL, 1);
    let engine = release_bin("engine");
    let dir = test_support::temp_dir("llama-emu");
    let options = FleetOptions {
        ready_timeout: Duration::from_secs(60),
        ..FleetOptions::new(dir.path().join("logs"))
    };
    let mut fleet = Fleet::new(Source::Llama(spec.clone()), options).unwrap();
    fleet.start(&never).unwrap();
    let script = script();
    let real = Side::new(&fleet.urls()[0]).run(&script);
    fleet.stop();

    // The emulator with the real replica's slot settings.
    let slot_flags = [
        "--cache-model".to_string(),
        "llama-slots".to_string(),
        "--parallel-slots".to_string(),
        spec.parallel.to_string(),
        "--slot-prompt-similarity".to_string(),
        spec.slot_prompt_similarity.to_string(),
        "--ctx-tokens".to_string(),
        spec.ctx_size_tokens.to_string(),
    ];
    let flags: Vec<&str> = slot_flags.iter().map(String::as_str).collect();
    // At speed 1 the latencies compare with the real engine's (`--step-model llama-tiny`).
    let emu = Emulator::start(&engine, "1", &flags);
    let metrics = http::get(&http::join(&emu.url, "/metrics"), Duration::from_secs(5))
        .unwrap()
        .text();
    assert!(
        metrics.contains("kvroute_engine_cache_model_info{cache_model=\"llama-slots\""),
        "{metrics}"
    );
    let emulated = Side::new(&emu.url).run(&script);
    drop(emu);

    let first_ok = real.iter().zip(&emulated).all(|(r, e)| {
        r.turn > 1
            || (r.cached_tokens * 10 < r.prompt_tokens && e.cached_tokens * 10 < e.prompt_tokens)
    });
    let (differ, table) = compare(&real, &emulated);
    let n = real.len();
    let hits = classes(&real).iter().filter(|c| **c == "hit").count();
    let share_gap = real
        .iter()
        .zip(&emulated)
        .map(|(r, e)| {
            (r.cached_tokens as f64 / r.prompt_tokens as f64
                - e.cached_tokens as f64 / e.prompt_tokens as f64)
                .abs()
        })
        .fold(0.0f64, f64::max);
    eprintln!(
        "llama-slots vs llama-server: {} of {n} requests agree ({hits} hits on the real engine); \
         largest cached-share gap {share_gap:.3}\n{table}",
        n - differ
    );
    // Timing beside the slots (reported, not asserted: the shared machine inflates the real
    // side): the emulator's latency over the real engine's, per class, requests sent alone.
    let busy: Vec<usize> = {
        let mut i = 0;
        let mut v = Vec::new();
        for step in &script {
            match step {
                Step::Alone(_) => i += 1,
                Step::Busy { during, .. } => {
                    v.extend(i..=i + during.len());
                    i += 1 + during.len();
                }
            }
        }
        v
    };
    let real_classes = classes(&real);
    for class in ["first", "hit", "miss"] {
        let mut ratios: Vec<f64> = (0..n)
            .filter(|i| real_classes[*i] == class && !busy.contains(i))
            .map(|i| emulated[i].latency_ms / real[i].latency_ms)
            .collect();
        ratios.sort_by(f64::total_cmp);
        if let (Some(lo), Some(hi)) = (ratios.first(), ratios.last()) {
            eprintln!(
                "latency emulator / real, {class}: median {:.2} ({lo:.2}–{hi:.2}, {} requests)",
                ratios[ratios.len() / 2],
                ratios.len()
            );
        }
    }
    assert!(
        first_ok,
        "a first turn found more than a tenth of its prompt cached\n{table}"
    );
    assert!(
        hits >= 4 && hits <= n - CONVERSATIONS - 4,
        "the script must give both hits and misses on later turns ({hits} hits)\n{table}"
    );
    assert_eq!(
        differ, 0,
        "the emulator's slot model disagrees with llama-server\n{table}"
    );

    // The self-test: wrong models must be caught.
    let wrong: [(&str, Vec<&str>); 4] = [
        (
            "vLLM's paged prefix cache (1-token blocks, ample pool)",
            vec![
                "--cache-model",
                "paged",
                "--block-size",
                "1",
                "--num-gpu-blocks",
                "40000",
            ],
        ),
        (
            "llama-slots without the similarity rule (LRU only)",
            vec![
                "--cache-model",
                "llama-slots",
                "--parallel-slots",
                "4",
                "--slot-prompt-similarity",
                "0",
            ],
        ),
        (
            "llama-slots with a similarity threshold of 0.01",
            vec![
                "--cache-model",
                "llama-slots",
                "--parallel-slots",
                "4",
                "--slot-prompt-similarity",
                "0.01",
            ],
        ),
        (
            "llama-slots with 8 slots",
            vec!["--cache-model", "llama-slots", "--parallel-slots", "8"],
        ),
    ];
    for (name, flags) in wrong {
        // Slot choice does not depend on time in this script: a faster clock saves wall time.
        let emu = Emulator::start(&engine, "2", &flags);
        let obs = Side::new(&emu.url).run(&script);
        drop(emu);
        let (differ, table) = compare(&real, &obs);
        eprintln!("self-test, {name}: {differ} of {n} requests differ");
        assert!(
            differ > 0,
            "the comparison did not catch a wrong model ({name})\n{table}"
        );
    }
}
