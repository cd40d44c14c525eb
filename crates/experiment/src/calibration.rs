//! `calibration.json`: what a calibration measured and the settings it implies, and the rules that
//! derive them from measurements (docs/ARCHITECTURE.md, "Calibration"): floors (on unseen prompts
//! of the reference length) → SLO, throttling outliers and the cells' throttle bound, KV capacity,
//! bytes per token (against the fleet's `/tokenize`), requests per closed-loop user, the reference
//! run's belief decay or the LRU-cycle model → index TTL, and the node cap; and the lateness bound
//! of a cell. Every derived value records the rule that set it and its evidence; a bound is never a
//! value.
//!
//! Measuring is [`crate::calibrate`] (it starts the fleet and drives the load); everything here
//! is a pure function of what it measured, except reading and writing the record. What every
//! consumer (live sweep cells, fault runs, virtual cells) gives the router comes from one place,
//! [`Calibration::routing`].

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use serde::{Deserialize, Serialize};

use analysis::metrics::{CacheInflow, Decay, DecayBucket, Implied, MetricsConfig};
use fleet::RouterSettings;
use fleet::evidence::GpuSummary;
use fleet::metrics::CacheConfig;
use schema::Slo;
use workload::{ArrivalSpec, Message, Plan, Role, Schedule, Sizing, WorkloadSpec};

use crate::{cell, grid};

/// A floor prompt counts as unseen when fewer than this many of its tokens were served from
/// cache: one 16-token KV block. vLLM and SGLang (page size 16) cache whole blocks only, so for
/// them this means nothing cached, as before; llama.cpp caches token by token, and every prompt
/// shares its chat template's first ≈ 11 tokens with the previous one (measured on the tiny
/// llama fleet: with "none cached" 8 of 12 unseen prompts per replica were dropped), which moves
/// a 1,100-token prefill by about 1%.
pub const UNSEEN_BELOW_CACHED_TOKENS: u64 = 16;

/// Whether a floor request's prompt was unseen ([`UNSEEN_BELOW_CACHED_TOKENS`]); an engine that
/// reported no cached tokens counts as none cached.
pub fn is_unseen(cached_tokens: Option<u64>) -> bool {
    cached_tokens.unwrap_or(0) < UNSEEN_BELOW_CACHED_TOKENS
}

/// SLO = this many times the floor (docs/ARCHITECTURE.md, "Calibration").
pub const SLO_FACTOR: f64 = 3.0;

/// Share of throttled samples above the peers' median that makes a card an outlier (the
/// reference fleet's throttling card: 67% of samples, the others 0–34%).
pub const THROTTLE_SHARE_MARGIN: f64 = 0.3;

/// Prompt length of the floors, tokens: the reference fleet's floor is on an unseen prompt of about
/// 1,100 tokens (TTFT p50 329 ms; crates/engine-core/README.md, "Defaults and calibration").
pub const REFERENCE_PROMPT_TOKENS: u64 = 1_100;

/// Prompts of the reference plan whose bytes and tokens give the bytes-per-token ratio.
pub const BYTES_PER_TOKEN_PROMPTS: usize = 64;

/// A clean cell's engine lateness p99 is at most this share of the ITL floor, both in model
/// time: 98% of a request's gaps are then off by less than a quarter of the floor, so lateness
/// can move a request's median gap across the 3× SLO only when it already lies within a quarter
/// floor of it, and its TTFT by less than a quarter of the ITL floor.
pub const LATENESS_SHARE_OF_ITL_FLOOR: f64 = 0.25;

/// What meta.json records about the fleet (`fleet {source, replicas, speed, slowdowns,
/// capacity_tokens}` plus detail), and what decides whether a calibration still applies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FleetKey {
    /// `emulated`, `command` or `static`.
    pub source: String,
    /// Replicas in use.
    pub replicas: usize,
    /// Emulator speed (1 for real engines).
    pub speed: f64,
    /// Slowdown per replica in use.
    pub slowdowns: Vec<f64>,
    /// KV blocks per emulated replica when set.
    pub num_gpu_blocks: Option<u64>,
    /// Model.
    pub model: String,
    /// Command template or static URLs.
    pub detail: Option<String>,
}

/// One replica's calibration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplicaCalibration {
    /// Index in the fleet as given (before exclusions).
    pub index: usize,
    /// Base URL during calibration.
    pub url: String,
    /// Emulated slowdown (1 for real engines).
    pub slowdown: f64,
    /// TTFT p50 of unseen prompts at concurrency 1, ms (wall).
    pub ttft_p50_ms: f64,
    /// Per-request ITL p50, median over requests, ms (wall).
    pub itl_p50_ms: f64,
    /// Requests the floors rest on (successful, nothing cached).
    pub requests_used: usize,
    /// From `vllm:cache_config_info`.
    pub cache: Option<CacheConfig>,
    /// Largest of TTFT and ITL floor ÷ the median of the other replicas.
    pub outlier_ratio: Option<f64>,
    /// Share of GPU samples with a throttle reason during the floors (command fleets with NVML).
    #[serde(default)]
    pub gpu_throttle_share: Option<f64>,
    /// Set when the replica is excluded (or would be, with --include-outliers).
    pub outlier_reason: Option<String>,
}

/// Which rule set the index TTL (`index.ttl_rule` in calibration.json).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TtlRule {
    /// A gap band of the reference run fell below the honour threshold: belief older than its
    /// lower edge was mostly not honoured, so that edge is the TTL.
    ObservedDecay,
    /// No band fell: the time the fleet's LRU takes to cycle its cache, KV capacity (tokens, the
    /// replicas in use) ÷ the tokens entering the caches per second at the reference load.
    LruCycleModel,
}

impl TtlRule {
    /// The rule's name as calibration.json writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            TtlRule::ObservedDecay => "observed-decay",
            TtlRule::LruCycleModel => "lru-cycle-model",
        }
    }
}

/// What the TTL rests on (`index.ttl_evidence`): both rules' inputs, whichever applied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TtlEvidence {
    /// Honoured share below which a band counts as stale.
    pub honour_threshold: f64,
    /// Fewest requests a band needs to count.
    pub band_min_requests: u64,
    /// The first band below the threshold (rule `observed-decay`).
    pub stale_band: Option<DecayBucket>,
    /// When no band fell: the largest gap up to which belief was seen honoured, wall s — a lower
    /// bound of the TTL, recorded as evidence and never used as the TTL.
    pub observed_lower_bound_s: Option<f64>,
    /// KV capacity of the replicas in use, tokens.
    pub capacity_tokens: u64,
    /// Tokens entering the caches over the reference run's measured window.
    pub inflow: CacheInflow,
    /// `capacity_tokens ÷ inflow.tokens_per_s`, wall s: the LRU-cycle model's TTL.
    pub lru_cycle_s: Option<f64>,
    /// The reference run's own router TTL, wall s: longer than the whole run, so nothing
    /// expired while it measured how belief decays (a TTL there would cut the decay it
    /// measures short).
    pub reference_index_ttl_s: f64,
}

/// The index settings implied by the reference load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IndexCalibration {
    /// Index TTL, wall s (at the calibration speed), set by `ttl_rule`.
    pub ttl_s: Option<f64>,
    /// The rule that set `ttl_s` (absent in calibrations made before TTL rules).
    #[serde(default)]
    pub ttl_rule: Option<TtlRule>,
    /// Its inputs.
    #[serde(default)]
    pub ttl_evidence: Option<TtlEvidence>,
    /// Read from calibrations made before TTL rules, whose `ttl_s` could be a lower bound;
    /// never written (such a calibration is refused: see [`Calibration::routing`]).
    #[serde(default, skip_serializing, rename = "ttl_is_lower_bound")]
    pub legacy_ttl_is_lower_bound: bool,
    /// Node cap from the capacity model scaled by the honoured share.
    pub node_cap: Option<u64>,
    /// Share of predicted tokens the engines honoured.
    pub honoured_share: Option<f64>,
    /// The analysis's full output (bands, counts).
    pub detail: serde_json::Value,
}

/// Bytes of the router's canonical rendering per engine token (`bytes_per_token` in
/// calibration.json; the router's `--bytes-per-token`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BytesPerToken {
    /// Σ canonical bytes ÷ Σ tokens, rounded to 1/10,000.
    pub value: f64,
    /// How it was measured.
    pub rule: String,
    /// Prompts measured.
    pub prompts: usize,
    /// Σ the router's canonical bytes of those prompts (`<|role|>\n` + content + `\n` per message).
    pub canonical_bytes: u64,
    /// Σ their tokens as the fleet counts them (chat form, with its template).
    pub tokens: u64,
    /// What counted the tokens.
    pub source: String,
}

/// The prompts the floors were measured on (`floor_prompts` in calibration.json).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FloorPrompts {
    /// Tokens of every floor prompt, as the fleet counts them (chat form).
    pub prompt_tokens: u64,
    /// How that length was reached and checked.
    pub rule: String,
    /// Distinct prompts fitted (over all replicas).
    pub prompts: usize,
    /// Token counts it took.
    pub tokenize_calls: usize,
}

/// The throttle bound of every cell on a command fleet with NVML (`gpu_throttle_bound`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ThrottleBound {
    /// A card throttled in a larger share of a cell's samples than this sets the cell aside.
    pub max_share: f64,
    /// Median throttled share of the replicas in use during the floors.
    pub peers_median_share: f64,
    /// [`THROTTLE_SHARE_MARGIN`].
    pub margin: f64,
    /// The rule.
    pub rule: String,
}

/// The engine-lateness bound of a cell, in model time and in wall time at the fleet's speed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LatenessBound {
    /// The share of the ITL floor (model time) allowed.
    pub share_of_itl_floor: f64,
    /// The ITL floor in model time, ms (the calibration's wall floor × speed).
    pub itl_floor_model_ms: f64,
    /// The bound in model time, ms.
    pub p99_model_ms: f64,
    /// The emulator speed the wall bound is for.
    pub speed: f64,
    /// The bound in wall ms (model ÷ speed): what the evidence check compares.
    pub p99_wall_ms: f64,
    /// The rule.
    pub rule: String,
}

/// The lateness bound: `share` × the ITL floor in model time, converted to wall time by `speed`.
/// `floors` are the calibration's, in wall ms at `speed`.
pub fn lateness_bound(floors: &Slo, speed: f64, share: f64) -> LatenessBound {
    let itl_floor_model_ms = floors.itl_ms * speed;
    let p99_model_ms = share * itl_floor_model_ms;
    LatenessBound {
        share_of_itl_floor: share,
        itl_floor_model_ms,
        p99_model_ms,
        speed,
        p99_wall_ms: p99_model_ms / speed,
        rule: format!(
            "engine lateness p99 ≤ {share} × ITL floor in model time; wall bound = model bound ÷ speed"
        ),
    }
}

/// What the router of every cell gets from a calibration: live sweep cells, fault runs and
/// virtual cells all take it from [`Calibration::routing`], so they run with one TTL.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Routing {
    /// Index TTL of belief policies, wall s.
    pub index_ttl_s: f64,
    /// The rule that set it.
    pub index_ttl_rule: TtlRule,
    /// Index node cap of belief policies.
    pub index_node_cap: Option<u64>,
    /// Bytes of the router's rendering per engine token (every policy).
    pub bytes_per_token: f64,
}

impl Routing {
    /// The router settings of a cell of `policy`: belief policies get the TTL and node cap,
    /// every policy the bytes per token.
    pub fn router_settings(&self, policy: &str, model: &str, seed: u64) -> RouterSettings {
        let belief = grid::uses_belief_index(policy);
        RouterSettings {
            policy: policy.to_string(),
            model: model.to_string(),
            seed,
            index_ttl_s: belief.then_some(self.index_ttl_s),
            index_node_cap: if belief { self.index_node_cap } else { None },
            bytes_per_token: Some(self.bytes_per_token),
            kv_events: grid::needs_kv_events(policy),
        }
    }

    /// The same settings in a simulated cell whose policy is already set in `cfg`.
    pub fn configure_sim(&self, cfg: &mut sim::SimConfig) {
        cfg.router.bytes_per_token = self.bytes_per_token;
        if grid::uses_belief_index(&cfg.policy.name) {
            cfg.policy.index_ttl_us = secs_to_us(self.index_ttl_s);
            if let Some(cap) = self.index_node_cap {
                cfg.policy.index_node_cap = usize::try_from(cap).unwrap_or(usize::MAX);
            }
        }
    }
}

/// Seconds → whole microseconds (as the router's `--index-ttl-s` converts them).
fn secs_to_us(s: f64) -> u64 {
    (s * 1e6) as u64
}

/// `calibration.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// The fleet this calibration is valid for (before exclusions).
    pub fleet: FleetKey,
    /// Per replica, in fleet order.
    pub replicas: Vec<ReplicaCalibration>,
    /// Replicas the sweeps use.
    pub used_replicas: Vec<usize>,
    /// Median floors over the used replicas, ms (wall).
    pub floors: Slo,
    /// `SLO_FACTOR`.
    pub slo_factor: f64,
    /// SLO = factor × floors, ms (wall).
    pub slo: Slo,
    /// Σ capacity of the used replicas, tokens.
    pub capacity_tokens: u64,
    /// The prompts the floors were measured on (absent in calibrations made before).
    #[serde(default)]
    pub floor_prompts: Option<FloorPrompts>,
    /// Index TTL and node cap.
    pub index: IndexCalibration,
    /// Bytes per token (absent in calibrations made before it was measured).
    #[serde(default)]
    pub bytes_per_token: Option<BytesPerToken>,
    /// GPU evidence during the floors (empty without NVML).
    pub gpus: Vec<GpuSummary>,
    /// `"ok"` or `"no GPU"` and why.
    pub gpu_status: String,
    /// The throttle bound of every cell (command fleets whose cards NVML read); `None`
    /// otherwise — an emulated fleet runs no GPU checks.
    #[serde(default)]
    pub gpu_throttle_bound: Option<ThrottleBound>,
    /// Where the reference run's rows are.
    pub reference_run: Option<PathBuf>,
    /// Git revision.
    pub git_rev: Option<String>,
    /// Versions.
    pub versions: serde_json::Value,
    /// The fleet's capacity and the curve it was found on ([`crate::capacity`]); `None` when the
    /// calibration ran without the capacity search (and in files written before it existed).
    #[serde(default)]
    pub capacity: Option<crate::capacity::Capacity>,
    /// The rule behind each derived value that carries no rule of its own (floors, SLO, KV
    /// capacity, outliers, node cap); `None` in files written before it was recorded.
    #[serde(default)]
    pub rules: Option<DerivationRules>,
}

/// `rules` in calibration.json: how the values without a rule field of their own were derived
/// (the TTL, bytes per token, floor prompts and capacity carry theirs beside their value).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DerivationRules {
    /// How `floors` came from the replicas' measurements.
    pub floors: String,
    /// How `slo` came from `floors`.
    pub slo: String,
    /// How `capacity_tokens` was read.
    pub capacity_tokens: String,
    /// Which replicas were set aside as throttling outliers, and by what test.
    pub outliers: String,
    /// How `index.node_cap` came from the reference run.
    pub node_cap: String,
}

impl DerivationRules {
    /// The rules of a live calibration as this build applies them: `outlier_factor` is its
    /// `--outlier-factor`, `tokens_per_block` the analysis's node granularity.
    /// `floor_users` is the floors' concurrency per replica (`CalibrateSettings::floor_users`).
    pub fn live(outlier_factor: f64, tokens_per_block: u32, floor_users: u32) -> Self {
        DerivationRules {
            floors: format!(
                "per replica, straight at it at concurrency {floor_users} ({}) on unseen prompts \
                 of the reference length (floor_prompts): TTFT p50 and per-request ITL p50; the \
                 fleet's floors are the median over the replicas in use",
                if floor_users > 1 {
                    "closed-loop users, no think time: every slot of a llama.cpp replica busy, \
                     as under load, since its decode batch shares one thread"
                } else {
                    "one request at a time"
                }
            ),
            slo: format!(
                "SLO = {SLO_FACTOR} × each floor (slo_factor), rounded to the microsecond"
            ),
            capacity_tokens: "Σ over the replicas in use of num_gpu_blocks × block_size from \
                              vllm:cache_config_info on /metrics (a llama.cpp fleet: \
                              /props' n_ctx, the shared pool under --kv-unified, else × \
                              total_slots)"
                .into(),
            outliers: format!(
                "a replica whose TTFT or ITL floor exceeds the median of its peers' by more than \
                 ×{outlier_factor} (--outlier-factor) is a throttling outlier and not used, \
                 unless --include-outliers; needs ≥ 3 replicas"
            ),
            node_cap: Self::node_cap_rule(tokens_per_block),
        }
    }

    /// The rules of a virtual-time calibration (`virtual_sweep::calibrate`).
    pub fn simulated(tokens_per_block: u32) -> Self {
        DerivationRules {
            floors: "the simulator's floor run (sim::calibrate_plan) on unseen prompts of the \
                     reference length (floor_prompts), one at a time: TTFT p50 and per-request \
                     ITL p50"
                .into(),
            slo: format!("SLO = {SLO_FACTOR} × each floor (slo_factor), not rounded"),
            capacity_tokens: "Σ over the simulated replicas of their configured blocks × block \
                              size"
                .into(),
            outliers: "none: every simulated replica runs the same step-time model".into(),
            node_cap: Self::node_cap_rule(tokens_per_block),
        }
    }

    fn node_cap_rule(tokens_per_block: u32) -> String {
        format!(
            "⌈capacity_tokens ÷ {tokens_per_block} tokens per node × the reference run's honoured \
             share⌉ (index.honoured_share)"
        )
    }
}

/// The pace of an open loop's primes ([`workload::OpenStart::Primed`]) and the rule that set it.
#[derive(Debug, Clone, PartialEq)]
pub struct PrimePace {
    /// Prompt tokens per wall second (at the calibration's speed).
    pub tokens_per_s: u32,
    /// Where it comes from.
    pub rule: String,
}

impl Calibration {
    /// How every open loop sized by this calibration starts (sweep cells, capacity-search steps,
    /// faults): the steady state's turn mix, after one prime per conversation the cache would
    /// hold, paced by [`Calibration::prime_pace`]. Without primes, a window free of cold resumes
    /// needed a warm-up of about one KV-cache turnover: up to 480 s of a quick-grid cell (4 Dec
    /// 2026), which made the main job take hours.
    pub fn open_start(&self) -> workload::OpenStart {
        workload::OpenStart::Primed {
            tokens_per_s: self.prime_pace().tokens_per_s,
        }
    }

    /// The primes' pace, prompt tokens per wall second: the replicas in use × the floor
    /// prompt's tokens ÷ the TTFT floor, the rate at which the fleet prefilled unseen prompts of
    /// the reference length one at a time per replica (`floors`, measured by this calibration).
    /// A prime is such a prefill (one output token), and the primes are spread evenly, so each
    /// replica meets them at about the rate it served them alone, while a batch prefills faster
    /// than that. Not the reference run's cache inflow (`index.ttl_evidence.inflow`): that rate
    /// carries the decode of a loaded fleet, which primes do not ask for, and paced at it the
    /// primes took 26.4 s of every quick ws3-s0 cell (4 Dec 2026).
    pub fn prime_pace(&self) -> PrimePace {
        let prompt_tokens = self
            .floor_prompts
            .as_ref()
            .map_or(REFERENCE_PROMPT_TOKENS, |f| f.prompt_tokens);
        let replicas = self.used_replicas.len().max(1) as f64;
        let rate = replicas * prompt_tokens as f64 / (self.floors.ttft_ms / 1e3).max(1e-6);
        PrimePace {
            tokens_per_s: rate.round().clamp(1.0, f64::from(u32::MAX)) as u32,
            rule: format!(
                "{replicas} replicas × the {prompt_tokens}-token floor prompt ÷ the TTFT floor {} ms: the fleet's prefill of unseen prompts, one at a time per replica",
                self.floors.ttft_ms
            ),
        }
    }

    /// Reads a calibration.json.
    pub fn read(path: &Path) -> Result<Calibration> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    /// Writes it atomically.
    pub fn write(&self, path: &Path) -> Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        cell::write_atomic(path, serde_json::to_string_pretty(self)?.as_bytes())
    }

    /// The index TTL, wall s: the value its rule set. A calibration made before TTL rules
    /// (whose `ttl_s` may be only a lower bound) or without a TTL is refused, never guessed.
    pub fn index_ttl_s(&self) -> Result<f64> {
        match (self.index.ttl_rule, self.index.ttl_s) {
            (Some(_), Some(t)) if t.is_finite() && t > 0.0 => Ok(t),
            (Some(rule), t) => bail!(
                "calibration.json's index TTL ({t:?}) is not a positive value although rule {} set it",
                rule.as_str()
            ),
            (None, t) => bail!(
                "this calibration records no rule for its index TTL ({}); it was made before TTLs were values — recalibrate",
                match t {
                    Some(t) if self.index.legacy_ttl_is_lower_bound =>
                        format!("{t} s, only a lower bound"),
                    Some(t) => format!("{t} s"),
                    None => "none".into(),
                }
            ),
        }
    }

    /// The derived values that name no rule (empty for a calibration of this build): the TTL
    /// (rule and evidence), bytes per token, floor prompts, capacity (when searched) and each
    /// of `rules`.
    pub fn values_without_rule(&self) -> Vec<&'static str> {
        let named = |s: &str| !s.trim().is_empty();
        let rules = self.rules.as_ref();
        let rule_of = |f: fn(&DerivationRules) -> &String| rules.is_some_and(|r| named(f(r)));
        [
            ("index.ttl_rule", self.index.ttl_rule.is_some()),
            ("index.ttl_evidence", self.index.ttl_evidence.is_some()),
            (
                "bytes_per_token.rule",
                self.bytes_per_token
                    .as_ref()
                    .is_some_and(|b| named(&b.rule)),
            ),
            (
                "floor_prompts.rule",
                self.floor_prompts.as_ref().is_some_and(|f| named(&f.rule)),
            ),
            (
                "capacity.rule",
                self.capacity.as_ref().is_none_or(|c| named(&c.rule)),
            ),
            ("rules.floors", rule_of(|r| &r.floors)),
            ("rules.slo", rule_of(|r| &r.slo)),
            ("rules.capacity_tokens", rule_of(|r| &r.capacity_tokens)),
            ("rules.outliers", rule_of(|r| &r.outliers)),
            ("rules.node_cap", rule_of(|r| &r.node_cap)),
        ]
        .into_iter()
        .filter_map(|(name, ok)| (!ok).then_some(name))
        .collect()
    }

    /// The measured bytes per token; refused when the calibration predates its measurement.
    pub fn bytes_per_token(&self) -> Result<f64> {
        self.bytes_per_token.as_ref().map(|b| b.value).ok_or_else(|| {
            anyhow!(
                "this calibration records no measured bytes per token; it was made before they were measured — recalibrate"
            )
        })
    }

    /// What the router of every cell gets from this calibration (TTL, node cap, bytes per
    /// token): the one function live sweep cells, fault runs and virtual cells take it from.
    pub fn routing(&self) -> Result<Routing> {
        let index_ttl_s = self.index_ttl_s()?;
        Ok(Routing {
            index_ttl_s,
            index_ttl_rule: self.index.ttl_rule.expect("index_ttl_s checked the rule"),
            index_node_cap: self.index.node_cap,
            bytes_per_token: self.bytes_per_token()?,
        })
    }
}

/// Median of `values` (through the analysis crate, the one place statistics live).
fn median(values: &[f64]) -> Option<f64> {
    analysis::stats::median(values)
}

/// Marks replicas whose floors exceed their peers' median by `factor`.
pub fn find_outliers(replicas: &mut [ReplicaCalibration], factor: f64) {
    let n = replicas.len();
    if n < 3 {
        // With two replicas there is no majority to call one of them the odd one out.
        return;
    }
    for i in 0..n {
        let others = |f: fn(&ReplicaCalibration) -> f64| -> Vec<f64> {
            replicas
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, r)| f(r))
                .collect()
        };
        let ttft_peers = median(&others(|r| r.ttft_p50_ms));
        let itl_peers = median(&others(|r| r.itl_p50_ms));
        let (Some(tp), Some(ip)) = (ttft_peers, itl_peers) else {
            continue;
        };
        let r = &mut replicas[i];
        let ratio = (r.ttft_p50_ms / tp).max(r.itl_p50_ms / ip);
        r.outlier_ratio = Some(ratio);
        if ratio > factor {
            r.outlier_reason = Some(format!(
                "throttling outlier: floors TTFT {:.1} ms / ITL {:.2} ms vs peers' median {:.1} / {:.2} ms ({ratio:.2}× > {factor}×)",
                r.ttft_p50_ms, r.itl_p50_ms, tp, ip
            ));
        }
    }
}

/// Marks replicas whose card throttled far more often than its peers' cards did.
/// `gpu_of(i)` is the NVML device of replica i, when known.
pub fn find_throttle_outliers(
    replicas: &mut [ReplicaCalibration],
    gpus: &[GpuSummary],
    gpu_of: impl Fn(usize) -> Option<u32>,
) {
    for r in replicas.iter_mut() {
        r.gpu_throttle_share = gpu_of(r.index)
            .and_then(|d| gpus.iter().find(|g| g.device == d))
            .map(|g| g.throttle_share);
    }
    if replicas.len() < 3 {
        return;
    }
    for i in 0..replicas.len() {
        let Some(share) = replicas[i].gpu_throttle_share else {
            continue;
        };
        let peers: Vec<f64> = replicas
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .filter_map(|(_, r)| r.gpu_throttle_share)
            .collect();
        let Some(m) = median(&peers) else { continue };
        if share - m > THROTTLE_SHARE_MARGIN && replicas[i].outlier_reason.is_none() {
            replicas[i].outlier_reason = Some(format!(
                "throttling outlier: GPU throttled on {:.0}% of samples vs peers' median {:.0}%",
                share * 100.0,
                m * 100.0
            ));
        }
    }
}

/// The replicas the sweeps use: those without an outlier reason (all of them with
/// `include_outliers`), or every replica when that would leave none.
pub fn replicas_in_use(replicas: &[ReplicaCalibration], include_outliers: bool) -> Vec<usize> {
    let used: Vec<usize> = replicas
        .iter()
        .filter(|r| include_outliers || r.outlier_reason.is_none())
        .map(|r| r.index)
        .collect();
    if used.is_empty() {
        replicas.iter().map(|r| r.index).collect()
    } else {
        used
    }
}

/// The fleet's floors: the median TTFT and ITL floor over the replicas in `used`; `None` when
/// none of them was measured.
pub fn floors(replicas: &[ReplicaCalibration], used: &[usize]) -> Option<Slo> {
    let in_use: Vec<&ReplicaCalibration> = replicas
        .iter()
        .filter(|r| used.contains(&r.index))
        .collect();
    Some(Slo {
        ttft_ms: median(&in_use.iter().map(|r| r.ttft_p50_ms).collect::<Vec<_>>())?,
        itl_ms: median(&in_use.iter().map(|r| r.itl_p50_ms).collect::<Vec<_>>())?,
    })
}

/// SLO = `SLO_FACTOR` × the floors, rounded to the microsecond.
pub fn slo_from_floors(floors: Slo) -> Slo {
    // Microsecond precision is all a millisecond bound can use; rounding keeps the recorded
    // SLO free of binary-fraction noise (207.78150000000002).
    let round_us = |ms: f64| (ms * 1e3).round() / 1e3;
    Slo {
        ttft_ms: round_us(floors.ttft_ms * SLO_FACTOR),
        itl_ms: round_us(floors.itl_ms * SLO_FACTOR),
    }
}

/// Σ KV capacity of the replicas in `used`, tokens (what sizes the working sets); 0 when none
/// reported its cache shape.
pub fn capacity_tokens(replicas: &[ReplicaCalibration], used: &[usize]) -> u64 {
    replicas
        .iter()
        .filter(|r| used.contains(&r.index))
        .map(|r| r.cache.map_or(0, |c| c.capacity_tokens()))
        .sum()
}

/// Requests per closed-loop user so that a run of `run_s` wall seconds never runs dry: twice
/// the estimate from the floors (the driver's `--duration-s` ends the run on time).
pub fn requests_per_user(run_s: f64, think_wall_s: f64, floors: Slo, output_tokens: u32) -> u32 {
    let service_s = (floors.ttft_ms + f64::from(output_tokens) * floors.itl_ms) / 1e3;
    let cycle_s = (think_wall_s + service_s).max(1e-3);
    ((2.0 * run_s / cycle_s).ceil() as u32).clamp(4, 100_000)
}

/// The index settings the reference run implies: belief decay by time since the session was
/// last served, in bands scaled to wall seconds at `speed` (so they cover the same model-time
/// gaps), → node cap (`analysis::metrics::{decay, implied}`) and TTL by [`ttl_rule`], with the
/// tokens entering the caches over the measured window (`analysis::metrics::cache_inflow`).
/// `reference_index_ttl_s` is the TTL the reference run's router ran with (recorded).
pub fn index_from_reference(
    rep: &analysis::RepData,
    slo: &Slo,
    capacity_tokens: u64,
    speed: f64,
    reference_index_ttl_s: f64,
) -> Result<IndexCalibration> {
    let requests = analysis::metrics::measured_requests(rep, slo);
    let mut cfg = analysis::MetricsConfig::default();
    cfg.decay_edges_s = cfg.decay_edges_s.iter().map(|e| e / speed).collect();
    let decay = analysis::metrics::decay(&requests, &cfg.decay_edges_s);
    let implied = analysis::metrics::implied(&decay, Some(capacity_tokens), &cfg);
    let inflow = analysis::metrics::cache_inflow(&requests, rep.meta.window.measured_s());
    let (ttl_s, rule, evidence) = ttl_rule(
        &decay,
        &implied,
        &cfg,
        inflow,
        capacity_tokens,
        reference_index_ttl_s,
    )?;
    Ok(IndexCalibration {
        ttl_s: Some(ttl_s),
        ttl_rule: Some(rule),
        ttl_evidence: Some(evidence),
        legacy_ttl_is_lower_bound: false,
        node_cap: implied.node_cap,
        honoured_share: implied.honoured_share,
        detail: serde_json::json!({"decay": decay, "implied": implied, "config": cfg}),
    })
}

/// The index TTL and the rule that sets it. Rule 1 (`observed-decay`): a band of the reference
/// run (with at least `cfg.decay_min_requests`) fell below `cfg.honour_threshold` honoured →
/// its lower edge. Rule 2 (`lru-cycle-model`), when none fell: KV capacity ÷ the tokens entering
/// the caches per second (`inflow`) — how long an idle prefix survives before the LRU reuses
/// its blocks. The largest gap seen honoured is recorded as a lower bound and never used.
/// Errors when neither rule applies.
pub fn ttl_rule(
    decay: &Decay,
    implied: &Implied,
    cfg: &MetricsConfig,
    inflow: CacheInflow,
    capacity_tokens: u64,
    reference_index_ttl_s: f64,
) -> Result<(f64, TtlRule, TtlEvidence)> {
    let lru_cycle_s = inflow
        .tokens_per_s
        .filter(|r| *r > 0.0 && capacity_tokens > 0)
        .map(|r| capacity_tokens as f64 / r);
    let stale_band = implied.observed_ttl_s().and_then(|t| {
        decay
            .by_gap
            .iter()
            .find(|b| b.lower_s == t && b.requests >= cfg.decay_min_requests)
            .cloned()
    });
    let evidence = TtlEvidence {
        honour_threshold: cfg.honour_threshold,
        band_min_requests: cfg.decay_min_requests,
        stale_band,
        observed_lower_bound_s: implied.ttl_lower_bound_s(),
        capacity_tokens,
        inflow,
        lru_cycle_s,
        reference_index_ttl_s,
    };
    if let Some(t) = implied.observed_ttl_s().filter(|t| *t > 0.0) {
        return Ok((t, TtlRule::ObservedDecay, evidence));
    }
    if let Some(t) = lru_cycle_s {
        return Ok((t, TtlRule::LruCycleModel, evidence));
    }
    bail!(
        "no rule sets the index TTL: no band of the reference run fell below {} honoured{}, and the tokens entering the caches are unknown ({} of {} successful requests report prompt, cached and output tokens over {:.1} s; capacity {capacity_tokens} tokens) — run the engines so that usage reports cached tokens (vLLM: --enable-prompt-tokens-details)",
        cfg.honour_threshold,
        if implied.observed_ttl_s() == Some(0.0) {
            " above 0 s"
        } else {
            ""
        },
        evidence.inflow.requests_reporting,
        evidence.inflow.requests,
        evidence.inflow.window_s
    )
}

/// The reference run's router TTL, wall s: the run's hard limit (3 × its length + 60 s, the
/// limit `run_attempt` gets), so no entry can expire while the run measures how belief decays.
pub fn reference_index_ttl_s(run_s: f64) -> f64 {
    (run_s * 3.0 + 60.0).ceil()
}

/// The reference load's workload: working set 1 of `capacity_tokens`, skew 0, the default
/// conversation shape, and `users` closed-loop users thinking `think_wall_s` on average with
/// enough requests for `run_s` ([`requests_per_user`]). The live and the virtual reference run
/// both use it.
pub fn reference_workload(
    seed: u64,
    capacity_tokens: u64,
    users: u32,
    think_wall_s: f64,
    run_s: f64,
    floors: Slo,
) -> (WorkloadSpec, ArrivalSpec) {
    // The sweeps' default workload (shared group prefixes), so the TTL and node cap are measured
    // on the traffic they will serve.
    let shape = crate::grid::WorkloadShape::DEFAULT;
    let spec = WorkloadSpec {
        seed,
        sizing: Sizing::WorkingSet {
            capacity_tokens,
            ratio: 1.0,
        },
        prefix_tokens: shape.context_tokens(),
        prefix_groups: shape.prefix_groups,
        sharing: shape.sharing,
        ..WorkloadSpec::default()
    };
    let arrival = ArrivalSpec::Closed {
        users,
        think_mean_s: think_wall_s,
        requests_per_user: requests_per_user(run_s, think_wall_s, floors, spec.output_tokens),
    };
    (spec, arrival)
}

/// The floors' workload for one replica: single-turn conversations, many more than `requests`
/// so that prompts are (almost all) unseen — the few repeats are filtered out by their cached
/// tokens — with a context prefix long enough to be trimmed to [`REFERENCE_PROMPT_TOKENS`]
/// ([`fit_floor_prompts`]); `users` closed-loop users (1: one request at a time; a llama fleet:
/// one per slot, `FleetSpec::default_floor_users`), no think time, `requests` in all (rounded
/// up to a whole number per user).
pub fn floors_workload(seed: u64, requests: u32, users: u32) -> (WorkloadSpec, ArrivalSpec) {
    let users = users.max(1);
    let user_tokens = WorkloadSpec::default().user_tokens;
    let spec = WorkloadSpec {
        seed,
        sizing: Sizing::Conversations(requests.saturating_mul(8).max(1)),
        turns: 1,
        // The template and the user turn come on top; a quarter more leaves room to trim.
        prefix_tokens: (REFERENCE_PROMPT_TOKENS as u32 * 5 / 4).saturating_sub(user_tokens),
        ..WorkloadSpec::default()
    };
    let arrival = ArrivalSpec::Closed {
        users,
        think_mean_s: 0.0,
        requests_per_user: requests.div_ceil(users),
    };
    (spec, arrival)
}

/// Counts a chat prompt's tokens the way the fleet does (its `/tokenize`, chat form).
pub type TokenCount<'a> = dyn FnMut(&[Message<'_>]) -> Result<u64> + 'a;

/// The conversations a single-turn plan sends, in first-use order.
fn sent_conversations(plan: &Plan) -> Vec<u32> {
    let mut seen = BTreeSet::new();
    let steps: Vec<u32> = match &plan.schedule {
        Schedule::Closed { users, .. } => users.iter().flatten().map(|s| s.conversation).collect(),
        Schedule::Open { arrivals } => arrivals.iter().map(|a| a.conversation).collect(),
    };
    steps.into_iter().filter(|c| seen.insert(*c)).collect()
}

/// Trims the context prefix (system message) of every conversation a single-turn `plan` sends
/// until its chat prompt counts exactly `target` tokens by `count` (the fleet's `/tokenize`),
/// so the floors are measured on prompts of exactly the reference length. Per prompt: the
/// shortest prefix that reaches `target` by interpolation search over its length, then checked
/// exact (a tokenizer may jump past `target` at that cut: the next few cuts are tried). Errors
/// when a prompt is shorter than `target` untrimmed or no cut gives exactly `target`.
pub fn fit_floor_prompts(
    plan: &mut Plan,
    target: u64,
    count: &mut TokenCount<'_>,
) -> Result<FloorPrompts> {
    if plan.spec.turns != 1 {
        bail!(
            "the floors' plan must be single-turn, not {} turns",
            plan.spec.turns
        );
    }
    let mut calls = 0usize;
    let sent = sent_conversations(plan);
    for &c in &sent {
        let conv = &plan.conversations[c as usize];
        let user = conv.users[0].clone();
        let system = conv.system.clone();
        let mut tokens_at = |len: usize| -> Result<u64> {
            calls += 1;
            count(&[
                Message {
                    role: Role::System,
                    content: std::borrow::Cow::Borrowed(&system[..len]),
                },
                Message {
                    role: Role::User,
                    content: std::borrow::Cow::Borrowed(&user),
                },
            ])
        };
        let full = tokens_at(system.len())?;
        if full < target {
            bail!(
                "conversation {c}'s prompt counts {full} tokens untrimmed, fewer than the {target} the floors need"
            );
        }
        // Invariant: tokens(lo) < target ≤ tokens(hi).
        let (mut lo, mut hi) = (0usize, system.len());
        let (mut t_lo, mut t_hi) = (tokens_at(0)?, full);
        if t_lo >= target {
            bail!(
                "conversation {c}'s prompt counts {t_lo} tokens without any context prefix, not fewer than {target}"
            );
        }
        while next_boundary(&system, lo) < hi {
            // Interpolate where the target falls, kept strictly inside the bracket.
            let frac = (target - t_lo) as f64 / (t_hi - t_lo).max(1) as f64;
            let guess = lo + ((hi - lo) as f64 * frac) as usize;
            let mid = floor_boundary(&system, guess.clamp(lo + 1, hi - 1));
            let mid = if mid <= lo {
                next_boundary(&system, lo)
            } else {
                mid
            };
            if mid >= hi {
                break;
            }
            let t = tokens_at(mid)?;
            if t < target {
                (lo, t_lo) = (mid, t);
            } else {
                (hi, t_hi) = (mid, t);
            }
        }
        let mut cut = hi;
        let mut tokens = t_hi;
        let mut tries = 0;
        while tokens != target {
            tries += 1;
            cut = next_boundary(&system, cut);
            if tries > 16 || cut > system.len() {
                bail!(
                    "no cut of conversation {c}'s context prefix gives exactly {target} tokens (the tokenizer jumps from {t_lo} to {t_hi} at byte {hi})"
                );
            }
            tokens = tokens_at(cut)?;
        }
        plan.conversations[c as usize].system.truncate(cut);
    }
    Ok(FloorPrompts {
        prompt_tokens: target,
        rule: format!(
            "each unseen prompt's context prefix trimmed until the fleet's token count (chat form) is exactly {target}, and checked"
        ),
        prompts: sent.len(),
        tokenize_calls: calls,
    })
}

/// The largest char boundary of `s` at or below `i`.
fn floor_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// The smallest char boundary of `s` above `i` (`s.len() + 1` past the end).
fn next_boundary(s: &str, i: usize) -> usize {
    let mut j = i + 1;
    while j < s.len() && !s.is_char_boundary(j) {
        j += 1;
    }
    j
}

/// Bytes per token: Σ the router's canonical bytes ÷ Σ the fleet's token counts over
/// [`BYTES_PER_TOKEN_PROMPTS`] prompts of `plan` spread over its conversations and turns
/// (`sim::prompts::canonical_bytes` is the router's rendering, pinned to it by sim's tests).
pub fn measure_bytes_per_token(
    plan: &Plan,
    count: &mut TokenCount<'_>,
    source: &str,
) -> Result<BytesPerToken> {
    let n_conv = plan.conversations.len();
    let turns = plan.spec.turns.max(1);
    if n_conv == 0 {
        bail!("the plan has no conversations to measure bytes per token on");
    }
    let prompts = BYTES_PER_TOKEN_PROMPTS;
    let (mut bytes, mut tokens) = (0u64, 0u64);
    let mut buf = Vec::new();
    for i in 0..prompts {
        let conversation = (i * n_conv / prompts) as u32;
        let turn = 1 + (i as u32 % turns);
        let messages = plan
            .messages(conversation, turn)
            .map_err(|e| anyhow!("{e}"))?;
        buf.clear();
        sim::prompts::canonical_bytes(&messages, &mut buf);
        bytes += buf.len() as u64;
        tokens += count(&messages)?;
    }
    if tokens == 0 {
        bail!("{source} counted no tokens in {prompts} prompts");
    }
    Ok(BytesPerToken {
        value: (bytes as f64 / tokens as f64 * 1e4).round() / 1e4,
        rule: format!(
            "Σ router canonical bytes ÷ Σ token counts (chat form) over {prompts} prompts of the reference plan, spread over its conversations and turns"
        ),
        prompts,
        canonical_bytes: bytes,
        tokens,
        source: source.to_string(),
    })
}

/// The throttle bound of the cells: the median throttled share of the replicas in `used`
/// during the floors plus [`THROTTLE_SHARE_MARGIN`] (the calibration's outlier rule, applied
/// to every card of every cell). `None` when no replica in use has a share (no NVML).
pub fn throttle_bound(replicas: &[ReplicaCalibration], used: &[usize]) -> Option<ThrottleBound> {
    let shares: Vec<f64> = replicas
        .iter()
        .filter(|r| used.contains(&r.index))
        .filter_map(|r| r.gpu_throttle_share)
        .collect();
    let m = median(&shares)?;
    Some(ThrottleBound {
        max_share: m + THROTTLE_SHARE_MARGIN,
        peers_median_share: m,
        margin: THROTTLE_SHARE_MARGIN,
        rule: format!(
            "a card throttled in more than the median throttled share of the replicas in use during the floors ({:.0}%) + {:.0} points sets a cell aside (the calibration's outlier rule)",
            m * 100.0,
            THROTTLE_SHARE_MARGIN * 100.0
        ),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn replica(index: usize, ttft: f64, itl: f64) -> ReplicaCalibration {
        ReplicaCalibration {
            index,
            url: String::new(),
            slowdown: 1.0,
            ttft_p50_ms: ttft,
            itl_p50_ms: itl,
            requests_used: 10,
            cache: None,
            outlier_ratio: None,
            gpu_throttle_share: None,
            outlier_reason: None,
        }
    }

    fn gpu(device: u32, throttle_share: f64) -> GpuSummary {
        GpuSummary {
            device,
            name: "card".into(),
            sm_clock_mhz_min: Some(960),
            sm_clock_mhz_max: Some(1305),
            temperature_c_max: Some(80),
            throttle_share,
            samples: 100,
        }
    }

    #[test]
    fn a_prompt_with_less_than_a_block_cached_is_unseen() {
        assert!(is_unseen(None) && is_unseen(Some(0)));
        // llama.cpp's shared chat-template tokens.
        assert!(is_unseen(Some(11)));
        // One whole vLLM block is a cache hit.
        assert!(!is_unseen(Some(16)) && !is_unseen(Some(1_100)));
    }

    #[test]
    fn a_card_that_throttles_far_more_is_an_outlier() {
        let mut r: Vec<ReplicaCalibration> = (0..5).map(|i| replica(i, 55.0, 1.3)).collect();
        let gpus = [
            gpu(0, 0.0),
            gpu(1, 0.34),
            gpu(2, 0.1),
            gpu(3, 0.2),
            gpu(4, 0.67),
        ];
        find_throttle_outliers(&mut r, &gpus, |i| Some(i as u32));
        let flagged: Vec<usize> = r
            .iter()
            .filter(|r| r.outlier_reason.is_some())
            .map(|r| r.index)
            .collect();
        assert_eq!(flagged, [4]);
        assert_eq!(r[1].gpu_throttle_share, Some(0.34));
        // Without a device map nothing is known and nothing is flagged.
        let mut r: Vec<ReplicaCalibration> = (0..5).map(|i| replica(i, 55.0, 1.3)).collect();
        find_throttle_outliers(&mut r, &gpus, |_| None);
        assert!(
            r.iter()
                .all(|r| r.outlier_reason.is_none() && r.gpu_throttle_share.is_none())
        );
    }

    #[test]
    fn a_throttled_replica_is_an_outlier() {
        let mut r = vec![
            replica(0, 55.0, 1.30),
            replica(1, 54.0, 1.31),
            replica(2, 56.0, 1.29),
            replica(3, 55.5, 1.30),
            replica(4, 82.0, 1.95),
        ];
        find_outliers(&mut r, 1.3);
        let flagged: Vec<usize> = r
            .iter()
            .filter(|r| r.outlier_reason.is_some())
            .map(|r| r.index)
            .collect();
        assert_eq!(flagged, [4]);
        assert!(r[4].outlier_ratio.unwrap() > 1.4);
        assert!(r[0].outlier_ratio.unwrap() < 1.1);
    }

    #[test]
    fn two_replicas_have_no_outlier() {
        let mut r = vec![replica(0, 50.0, 1.0), replica(1, 100.0, 2.0)];
        find_outliers(&mut r, 1.3);
        assert!(r.iter().all(|r| r.outlier_reason.is_none()));
    }

    #[test]
    fn floors_slo_and_capacity_come_from_the_replicas_in_use() {
        let mut r = vec![
            replica(0, 50.0, 1.0),
            replica(1, 54.0, 1.2),
            replica(2, 52.0, 1.1),
            replica(3, 90.0, 2.0),
        ];
        for (i, x) in r.iter_mut().enumerate() {
            x.cache = Some(CacheConfig {
                block_size_tokens: 16,
                num_gpu_blocks: 100 * (i as u64 + 1),
            });
        }
        r[3].outlier_reason = Some("throttling outlier".into());
        let used = replicas_in_use(&r, false);
        assert_eq!(used, [0, 1, 2]);
        assert_eq!(replicas_in_use(&r, true), [0, 1, 2, 3]);
        let floors = floors(&r, &used).unwrap();
        assert_eq!((floors.ttft_ms, floors.itl_ms), (52.0, 1.1));
        assert_eq!(capacity_tokens(&r, &used), 16 * (100 + 200 + 300));
        // Every replica an outlier: none would be left, so all are used.
        for x in &mut r {
            x.outlier_reason = Some("throttling outlier".into());
        }
        assert_eq!(replicas_in_use(&r, false), [0, 1, 2, 3]);
        assert!(super::floors(&r, &[]).is_none());
        assert_eq!(capacity_tokens(&r, &[]), 0);
    }

    #[test]
    fn the_slo_is_three_times_the_floors_to_the_microsecond() {
        let slo = slo_from_floors(Slo {
            ttft_ms: 55.12345,
            itl_ms: 1.3,
        });
        assert_eq!((slo.ttft_ms, slo.itl_ms), (165.37, 3.9));
    }

    #[test]
    fn requests_per_user_covers_the_run_twice() {
        let floors = Slo {
            ttft_ms: 55.0,
            itl_ms: 1.3,
        };
        // service 0.055 + 128 × 0.0013 = 0.2214 s; cycle 0.3881 s; 2 × 13 s / 0.3881 = 67.
        assert_eq!(requests_per_user(13.0, 1.0 / 6.0, floors, 128), 67);
        assert_eq!(requests_per_user(0.0, 0.0, floors, 128), 4);
    }

    fn fixture_rep() -> Box<analysis::RepData> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/analysis/sweep-basic/ws3-s1/prefix-affinity/rep-1");
        let analysis::load::RepLoad::Complete(rep) =
            analysis::load_rep(&dir, "ws3-s1", "prefix-affinity", 1).unwrap()
        else {
            panic!("the fixture repetition is complete");
        };
        rep
    }

    #[test]
    fn the_index_settings_come_from_decay_bands_in_wall_seconds() {
        let rep = fixture_rep();
        let slo = rep.meta.slo;
        let at_speed_1 = index_from_reference(&rep, &slo, 100_000, 1.0, 300.0).unwrap();
        let at_speed_4 = index_from_reference(&rep, &slo, 100_000, 4.0, 300.0).unwrap();
        let edges = |i: &IndexCalibration| -> Vec<f64> {
            serde_json::from_value(i.detail["config"]["decay_edges_s"].clone()).unwrap()
        };
        let default_edges = analysis::MetricsConfig::default().decay_edges_s;
        assert_eq!(edges(&at_speed_1), default_edges);
        let quarter: Vec<f64> = default_edges.iter().map(|e| e / 4.0).collect();
        assert_eq!(edges(&at_speed_4), quarter);
        for key in ["decay", "implied", "config"] {
            assert!(at_speed_1.detail.get(key).is_some(), "detail lacks {key}");
        }
        assert_eq!(
            at_speed_1.honoured_share,
            at_speed_1.detail["implied"]["honoured_share"].as_f64()
        );
        // Whatever rule applied, it is recorded with its evidence, and the TTL is its value.
        let ev = at_speed_1.ttl_evidence.as_ref().unwrap();
        assert_eq!(ev.reference_index_ttl_s, 300.0);
        assert_eq!(ev.capacity_tokens, 100_000);
        match at_speed_1.ttl_rule.unwrap() {
            TtlRule::ObservedDecay => {
                assert_eq!(at_speed_1.ttl_s, ev.stale_band.as_ref().map(|b| b.lower_s))
            }
            TtlRule::LruCycleModel => assert_eq!(at_speed_1.ttl_s, ev.lru_cycle_s),
        }
    }

    fn band(lower_s: f64, upper_s: Option<f64>, predicted: u64, honoured: u64) -> DecayBucket {
        DecayBucket {
            lower_s,
            upper_s,
            requests: 10,
            predicted_tokens: predicted,
            honoured_tokens: honoured,
            honoured_share: Some(honoured as f64 / predicted as f64),
        }
    }

    fn inflow(tokens_per_s: Option<f64>) -> CacheInflow {
        CacheInflow {
            requests: 100,
            requests_reporting: if tokens_per_s.is_some() { 100 } else { 40 },
            prompt_tokens: 130_000,
            cached_tokens: 100_000,
            output_tokens: 12_800,
            new_tokens: 42_800,
            window_s: 8.0,
            tokens_per_s,
        }
    }

    fn decay_of(bands: Vec<DecayBucket>) -> (Decay, Implied) {
        let cfg = MetricsConfig::default();
        let all = band(0.0, None, 1000, 900);
        let decay = Decay {
            unseen: band(0.0, None, 1, 1),
            by_gap: bands,
            overall: all,
        };
        let implied = analysis::metrics::implied(&decay, Some(196_608), &cfg);
        (decay, implied)
    }

    /// The quick fleet's case: belief honoured in every band up to 3.33 s. Today's rule made
    /// 3.33 s (a lower bound) the TTL; the TTL is the LRU-cycle model's value, and the bound is
    /// only evidence.
    #[test]
    fn without_observed_decay_the_ttl_is_the_lru_cycle_model_never_the_bound() {
        let (decay, implied) = decay_of(vec![
            band(0.0, Some(1.0), 1000, 990),
            band(1.0, Some(3.33), 1000, 950),
        ]);
        let cfg = MetricsConfig::default();
        let (ttl, rule, ev) =
            ttl_rule(&decay, &implied, &cfg, inflow(Some(5_350.0)), 196_608, 99.0).unwrap();
        assert_eq!(rule, TtlRule::LruCycleModel);
        // 196,608 tokens ÷ 5,350 tokens/s.
        assert!((ttl - 196_608.0 / 5_350.0).abs() < 1e-9, "{ttl}");
        assert_eq!(ev.observed_lower_bound_s, Some(3.33));
        assert_ne!(Some(ttl), ev.observed_lower_bound_s);
        assert_eq!(ev.stale_band, None);
        assert_eq!(ev.lru_cycle_s, Some(ttl));
        // Without a measured inflow no rule applies: an error, not the bound.
        let e = ttl_rule(&decay, &implied, &cfg, inflow(None), 196_608, 99.0).unwrap_err();
        assert!(e.to_string().contains("no rule sets the index TTL"), "{e}");
    }

    #[test]
    fn a_band_below_half_honoured_sets_the_ttl() {
        let (decay, implied) = decay_of(vec![
            band(0.0, Some(1.0), 1000, 990),
            band(1.0, Some(2.0), 1000, 800),
            band(2.0, Some(5.0), 1000, 300),
            band(5.0, None, 1000, 100),
        ]);
        let cfg = MetricsConfig::default();
        let (ttl, rule, ev) =
            ttl_rule(&decay, &implied, &cfg, inflow(Some(5_350.0)), 196_608, 99.0).unwrap();
        assert_eq!((ttl, rule), (2.0, TtlRule::ObservedDecay));
        assert_eq!(ev.stale_band.unwrap().lower_s, 2.0);
        assert_eq!(ev.observed_lower_bound_s, None);
        // The model's value is recorded beside it.
        assert!(ev.lru_cycle_s.is_some());
    }

    #[test]
    fn the_reference_run_never_expires_belief() {
        let run_s = 13.0;
        let router = crate::calibrate::reference_router("m", 7, 3.9, run_s);
        let ttl = router.index_ttl_s.unwrap();
        // Longer than the run's hard limit: nothing it measures can expire.
        assert!(ttl >= run_s * 3.0 + 60.0, "{ttl}");
        assert_eq!(router.policy, "prefix-affinity");
        assert_eq!(router.bytes_per_token, Some(3.9));
    }

    /// A calibration with every rule applied, as calibration.json holds it.
    pub(crate) fn current_calibration() -> Calibration {
        let mut cal: Calibration = serde_json::from_str(
            &std::fs::read_to_string(
                Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("../../docs/measurements/pressure-grid-quick/calibration.json"),
            )
            .unwrap(),
        )
        .unwrap();
        let (decay, implied) = decay_of(vec![band(0.0, Some(1.0), 1000, 990)]);
        let (ttl, rule, ev) = ttl_rule(
            &decay,
            &implied,
            &MetricsConfig::default(),
            inflow(Some(5_000.0)),
            cal.capacity_tokens,
            99.0,
        )
        .unwrap();
        cal.index.ttl_s = Some(ttl);
        cal.index.ttl_rule = Some(rule);
        cal.index.ttl_evidence = Some(ev);
        cal.bytes_per_token = Some(BytesPerToken {
            value: 3.8812,
            rule: "r".into(),
            prompts: 64,
            canonical_bytes: 38_812,
            tokens: 10_000,
            source: "test".into(),
        });
        cal
    }

    /// Every derived value names its rule; a file from before `rules` says which do not.
    #[test]
    fn values_without_rule_names_the_unruled_ones() {
        let mut cal = current_calibration();
        assert!(cal.values_without_rule().contains(&"rules.floors"));
        assert!(cal.values_without_rule().contains(&"floor_prompts.rule"));
        cal.rules = Some(DerivationRules::live(1.3, 16, 1));
        cal.floor_prompts = Some(FloorPrompts {
            prompt_tokens: REFERENCE_PROMPT_TOKENS,
            rule: "r".into(),
            prompts: 12,
            tokenize_calls: 30,
        });
        assert_eq!(cal.values_without_rule(), Vec::<&str>::new());
        cal.rules.as_mut().unwrap().node_cap.clear();
        cal.bytes_per_token = None;
        assert_eq!(
            cal.values_without_rule(),
            vec!["bytes_per_token.rule", "rules.node_cap"]
        );
    }

    /// Calibrations written before TTL rules still read (so old directories stay readable), but
    /// their TTL — a lower bound or an unruled value — is never handed to a router.
    #[test]
    fn an_old_calibration_reads_but_its_ttl_is_refused() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/measurements");
        for sweep in [
            "pressure-grid-quick",
            "pressure-grid-closed-loop",
            "fault-kill",
        ] {
            let cal = Calibration::read(&root.join(sweep).join("calibration.json")).unwrap();
            let e = cal.routing().unwrap_err().to_string();
            assert!(e.contains("recalibrate"), "{sweep}: {e}");
            assert!(cal.bytes_per_token.is_none() && cal.index.ttl_rule.is_none());
        }
        let mut lower = current_calibration();
        lower.index.ttl_rule = None;
        lower.index.legacy_ttl_is_lower_bound = true;
        let e = lower.index_ttl_s().unwrap_err().to_string();
        assert!(e.contains("only a lower bound"), "{e}");
        // Written anew, the legacy flag is gone and the rule is there.
        let written = serde_json::to_value(current_calibration()).unwrap();
        assert!(written["index"].get("ttl_is_lower_bound").is_none());
        assert_eq!(written["index"]["ttl_rule"], "lru-cycle-model");
    }

    /// One calibration.json → the router command line of a live sweep cell, the simulator's
    /// config of a virtual cell and a fault run's router settings carry one TTL (and one node cap
    /// and bytes per token).
    #[test]
    fn every_consumer_gets_the_same_ttl_from_one_calibration() {
        let s = crate::scratch::Scratch::new("one-ttl");
        let path = s.0.join("calibration.json");
        current_calibration().write(&path).unwrap();
        let cal = Calibration::read(&path).unwrap();
        let ttl = cal.index_ttl_s().unwrap();
        let routing = cal.routing().unwrap();
        assert_eq!(routing.index_ttl_s, ttl);
        let policy = "prefix-affinity";

        // A live sweep cell: its router's command line.
        let fleet = crate::fleet_spec::FleetSpec::test_emulated();
        let sweep = crate::sweep::SweepSettings {
            calibration: path.clone(),
            evidence_retries: 2,
            fleet: fleet.clone(),
            ..crate::sweep::SweepSettings::test_quick()
        };
        let replicas: Vec<fleet::ReplicaInfo> = (0..3)
            .map(|i| fleet::ReplicaInfo {
                index: i,
                url: format!("http://127.0.0.1:{}", 4000 + i),
                kv_events: None,
                kv_replay: None,
                pid: None,
                log_path: None,
                slowdown: 1.0,
            })
            .collect();
        let cmd = fleet::ingress::router::router_command(
            Path::new("router"),
            &replicas,
            &sweep.router_settings(&routing, policy, 1),
            Path::new("router.csv"),
        )
        .unwrap();
        let args: Vec<String> = cmd
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let flag = |name: &str| -> f64 {
            let i = args.iter().position(|a| a == name).unwrap();
            args[i + 1].parse().unwrap()
        };
        assert_eq!(flag("--index-ttl-s"), ttl);
        assert_eq!(flag("--bytes-per-token"), 3.8812);

        // A virtual cell: the simulator's config.
        let base = crate::virtual_sweep::EmulatedFleet::of(&fleet)
            .unwrap()
            .base_config(&[0, 1, 2])
            .unwrap();
        let cells = crate::virtual_sweep::CellSettings {
            base,
            sweep: "pressure-grid".into(),
            seed: 7,
            engine_seed: 1,
            timeout_s: 60.0,
            slo: cal.slo,
            routing: routing.clone(),
            git_rev: None,
            versions: serde_json::Value::Null,
        };
        let sim_cfg = crate::virtual_sweep::cell_config(&cells, policy, 1, 5.0, 13.0);
        assert_eq!(sim_cfg.policy.index_ttl_us, (ttl * 1e6) as u64);
        assert_ne!(
            sim_cfg.policy.index_ttl_us,
            policies::PolicySpec::default().index_ttl_us,
            "not the policy default"
        );
        assert_eq!(sim_cfg.router.bytes_per_token, 3.8812);
        assert_eq!(
            sim_cfg.policy.index_node_cap as u64,
            cal.index.node_cap.unwrap()
        );

        // A fault run: its router settings.
        let setup = crate::fault::Setup::from_calibration(&cal).unwrap();
        let (warmup_s, before_s, after_s) = crate::fault::default_phases_s(true);
        let fault = crate::fault::FaultSettings {
            kind: analysis::fault::FaultKind::Kill,
            quick: true,
            reps: 1,
            policies: vec![],
            rate_model_rps: None,
            victim: 0,
            warmup_s,
            before_s,
            outage_model_s: 60.0,
            after_s,
            inflight_wait_s: 10.0,
            calibration: path,
            recalibrate: false,
            slo: None,
            request_timeout_s: 60.0,
            evidence_interval_s: 1.0,
            lateness_share_of_itl_floor: LATENESS_SHARE_OF_ITL_FLOOR,
            evidence_retries: 2,
            seed: 7,
            fleet,
            git_rev: None,
            versions: serde_json::Value::Null,
            ingress: fleet::Ingress::Router,
        };
        let fault_router = crate::fault::router_settings(&fault, &setup, policy, 1).unwrap();
        assert_eq!(fault_router.index_ttl_s, Some(ttl));
        assert_eq!(fault_router.bytes_per_token, Some(3.8812));
        assert_eq!(
            fault_router,
            sweep.router_settings(&routing, policy, 1),
            "a fault repetition's router is a sweep cell's"
        );
        // Without a calibration, a belief policy is refused rather than given a default.
        let bare = crate::fault::Setup {
            routing: None,
            calibrated: false,
            ..setup
        };
        let e = crate::fault::router_settings(&fault, &bare, policy, 1).unwrap_err();
        assert!(e.to_string().contains("calibrated index TTL"), "{e}");
        assert!(crate::fault::router_settings(&fault, &bare, "session-affinity", 1).is_ok());
    }

    /// The emulated engine's tokenizer stands in for the fleet's `/tokenize`: every prompt the
    /// floors send counts exactly the reference length after fitting (today's prompts: ~1,288).
    #[test]
    fn the_floors_prompts_are_fitted_to_exactly_the_reference_length() {
        let (spec, arrival) = floors_workload(1007, 12, 1);
        // Four users (a llama replica's slots) send the same 12 requests, three each.
        let (_, four) = floors_workload(1007, 12, 4);
        assert_eq!(
            four,
            ArrivalSpec::Closed {
                users: 4,
                think_mean_s: 0.0,
                requests_per_user: 3
            }
        );
        let mut plan = Plan::build(&spec, &arrival).unwrap();
        let mut count = |m: &[Message<'_>]| Ok(sim::prompts::engine_tokens(m).len() as u64);
        let before: Vec<u64> = sent_conversations(&plan)
            .iter()
            .map(|&c| count(&plan.messages(c, 1).unwrap()).unwrap())
            .collect();
        assert!(
            before.iter().all(|&t| t > REFERENCE_PROMPT_TOKENS),
            "{before:?}"
        );
        let fit = fit_floor_prompts(&mut plan, REFERENCE_PROMPT_TOKENS, &mut count).unwrap();
        let sent = sent_conversations(&plan);
        assert_eq!(fit.prompts, sent.len());
        assert_eq!(fit.prompt_tokens, REFERENCE_PROMPT_TOKENS);
        for &c in &sent {
            let t = count(&plan.messages(c, 1).unwrap()).unwrap();
            assert_eq!(t, REFERENCE_PROMPT_TOKENS, "conversation {c}");
        }
        // A handful of counts per prompt, not a scan.
        assert!(
            fit.tokenize_calls <= 16 * sent.len(),
            "{}",
            fit.tokenize_calls
        );
        // A prompt too short to reach the target is an error.
        let mut short = Plan::build(&spec, &arrival).unwrap();
        let e = fit_floor_prompts(&mut short, 100_000, &mut count).unwrap_err();
        assert!(e.to_string().contains("fewer than the 100000"), "{e}");
    }

    #[test]
    fn bytes_per_token_divide_canonical_bytes_by_the_fleet_s_count() {
        let spec = WorkloadSpec {
            sizing: Sizing::Conversations(40),
            ..WorkloadSpec::default()
        };
        let arrival = ArrivalSpec::Closed {
            users: 1,
            think_mean_s: 0.0,
            requests_per_user: 1,
        };
        let plan = Plan::build(&spec, &arrival).unwrap();
        // A fleet whose tokens are exactly two canonical bytes each.
        let mut halves = |m: &[Message<'_>]| {
            let mut b = Vec::new();
            sim::prompts::canonical_bytes(m, &mut b);
            Ok(b.len() as u64 / 2)
        };
        let b = measure_bytes_per_token(&plan, &mut halves, "test").unwrap();
        assert_eq!(b.prompts, BYTES_PER_TOKEN_PROMPTS);
        assert!((b.value - 2.0).abs() < 1e-3, "{}", b.value);
        // The emulator's tokenizer: the ratio the router's default estimate was fitted to.
        let mut engine = |m: &[Message<'_>]| Ok(sim::prompts::engine_tokens(m).len() as u64);
        let e = measure_bytes_per_token(&plan, &mut engine, "engine").unwrap();
        assert!((3.5..4.3).contains(&e.value), "{}", e.value);
        assert_eq!(
            e.value,
            (e.canonical_bytes as f64 / e.tokens as f64 * 1e4).round() / 1e4
        );
    }

    #[test]
    fn the_throttle_bound_is_the_peers_median_plus_the_margin() {
        let mut r: Vec<ReplicaCalibration> = (0..5).map(|i| replica(i, 55.0, 1.3)).collect();
        for (x, share) in r.iter_mut().zip([0.0, 0.34, 0.1, 0.2, 0.67]) {
            x.gpu_throttle_share = Some(share);
        }
        // Replica 4 excluded as an outlier: the median of 0, 0.34, 0.1, 0.2 is 0.15.
        let b = throttle_bound(&r, &[0, 1, 2, 3]).unwrap();
        assert!((b.peers_median_share - 0.15).abs() < 1e-12);
        assert!((b.max_share - (0.15 + THROTTLE_SHARE_MARGIN)).abs() < 1e-12);
        // No NVML, no bound.
        assert_eq!(throttle_bound(&[replica(0, 55.0, 1.3)], &[0]), None);
    }
}
