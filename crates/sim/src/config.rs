//! What a virtual cell simulates: the fleet, the router model and the driver settings.

use engine_core::EngineConfig;
use policies::PolicySpec;

use crate::SimError;

/// The model name the live fleet serves by default (also the block-key salt).
pub const DEFAULT_MODEL: &str = "kvroute/emulated-8b";

/// How the router's own costs are modelled. Every cost is a constant, so rows stay
/// byte-identical for a seed; the real decision time is measured on the side
/// ([`crate::CellSummary::decide_wall_ns_p50`]) and never enters a row.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterModel {
    /// Cost of one `Policy::decide` call, µs (written to `decide_ns` as `× 1000`).
    pub decide_cost_us: u64,
    /// Everything else from request arrival to the upstream request written (parse, render,
    /// hashing, connection), µs. `overhead_us` in the row is this plus the decision cost.
    pub forward_overhead_us: u64,
    /// Exact residency's `/tokenize` round trip before routing, µs; `None` takes the engine
    /// step model's `tokenize_ms` (26 ms by default, the reference p50).
    pub tokenize_us: Option<u64>,
    /// Transport delay of a KV event batch from the engine to the router's index, µs, on top of
    /// the step: a batch becomes visible at the end of the step that scheduled its blocks plus
    /// this delay.
    pub event_transport_us: u64,
    /// Router byte-block size for belief keys (`--block-bytes`).
    pub block_bytes: usize,
    /// Estimated canonical bytes per engine token that turns matched belief blocks into
    /// predicted tokens (the router's `bytes_per_token`; default
    /// [`policies::DEFAULT_BELIEF_BYTES_PER_TOKEN`]).
    pub bytes_per_token: f64,
}

impl Default for RouterModel {
    fn default() -> Self {
        Self {
            decide_cost_us: 10,
            forward_overhead_us: 70,
            tokenize_us: None,
            event_transport_us: 200,
            block_bytes: 64,
            bytes_per_token: policies::DEFAULT_BELIEF_BYTES_PER_TOKEN,
        }
    }
}

/// The driver's settings, as `driver closed|open` takes them.
#[derive(Debug, Clone, PartialEq)]
pub struct DriverModel {
    /// Requests sent before this many seconds carry `warmup = 1`.
    pub warmup_s: f64,
    /// No new request is sent once its scheduled time reaches this (`--duration-s`).
    pub duration_s: Option<f64>,
    /// Per-request timeout: the client gives up and the engine aborts the request.
    pub timeout_s: f64,
}

impl Default for DriverModel {
    fn default() -> Self {
        Self {
            warmup_s: 0.0,
            duration_s: None,
            timeout_s: 600.0,
        }
    }
}

/// Everything one virtual cell needs besides the plan.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Number of engine replicas (ids 0..n, as the router numbers `--replicas`).
    pub replicas: u32,
    /// The engine of every replica (its seed is offset by the replica id; KV events are
    /// switched on only for exact-residency policies).
    pub engine: EngineConfig,
    /// Per-replica step-time multiplier (a throttled card); empty = all 1. Multiplies the
    /// engine config's own `slowdown`.
    pub slowdowns: Vec<f64>,
    /// The routing policy; its `salt` is overwritten with [`SimConfig::model`] so exact keys and
    /// event-derived keys agree, as the router does.
    pub policy: PolicySpec,
    /// Served model name: the request `model` field and the block-key salt.
    pub model: String,
    /// Router cost model.
    pub router: RouterModel,
    /// Driver settings.
    pub driver: DriverModel,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            replicas: 5,
            engine: EngineConfig::default(),
            slowdowns: Vec::new(),
            policy: PolicySpec::default(),
            model: DEFAULT_MODEL.to_string(),
            router: RouterModel::default(),
            driver: DriverModel::default(),
        }
    }
}

impl SimConfig {
    /// A default config for `replicas` replicas and the policy `policy` (its defaults).
    pub fn new(replicas: u32, policy: &str) -> Self {
        Self {
            replicas,
            policy: PolicySpec::named(policy),
            ..Self::default()
        }
    }

    /// Fleet KV capacity in tokens (what working-set sizing divides by).
    pub fn capacity_tokens(&self) -> u64 {
        u64::from(self.replicas) * self.engine.capacity_tokens()
    }

    /// The slowdown of replica `i` (1 when not given).
    pub fn slowdown(&self, i: usize) -> f64 {
        self.slowdowns.get(i).copied().unwrap_or(1.0)
    }

    /// The tokenize round trip in µs.
    pub fn tokenize_us(&self) -> u64 {
        self.router
            .tokenize_us
            .unwrap_or_else(|| self.engine.model.tokenize_us())
    }

    /// Checks every field; the message names the bad one.
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |m: String| Err(SimError::Config(m));
        if self.replicas == 0 {
            return bad("replicas must be at least 1".into());
        }
        if self.replicas > 65_536 {
            return bad(format!("replicas {} exceeds 65536", self.replicas));
        }
        if let Err(e) = self.engine.validate() {
            return bad(format!("engine: {e}"));
        }
        if self.slowdowns.len() > self.replicas as usize {
            return bad(format!(
                "{} slowdowns given for {} replicas",
                self.slowdowns.len(),
                self.replicas
            ));
        }
        if let Some(s) = self
            .slowdowns
            .iter()
            .find(|s| !(s.is_finite() && **s > 0.0))
        {
            return bad(format!("slowdowns must be finite and > 0, got {s}"));
        }
        if let Err(e) = self.policy.validate() {
            return bad(format!("policy: {e}"));
        }
        if self.router.block_bytes == 0 {
            return bad("router block_bytes must be at least 1".into());
        }
        let bpt = self.router.bytes_per_token;
        if !(bpt.is_finite() && bpt > 0.0) {
            return bad(format!("router bytes_per_token must be > 0, got {bpt}"));
        }
        let d = &self.driver;
        if !(d.warmup_s.is_finite() && d.warmup_s >= 0.0) {
            return bad(format!("warm-up must be >= 0 s, got {}", d.warmup_s));
        }
        if !(d.timeout_s.is_finite() && d.timeout_s > 0.0) {
            return bad(format!("timeout must be > 0 s, got {}", d.timeout_s));
        }
        if let Some(s) = d.duration_s
            && !(s.is_finite() && s > 0.0)
        {
            return bad(format!("duration must be > 0 s, got {s}"));
        }
        Ok(())
    }
}
