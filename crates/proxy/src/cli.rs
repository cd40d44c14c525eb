//! The command-line flags the router (`bins/router`) and the endpoint picker (`bins/epp`) share:
//! [`RoutingArgs`], flattened into both binaries' `clap` parsers (`#[command(flatten)]`), so a
//! shared flag has one name, one help text, one default and one meaning. Flags whose help says
//! something binary-specific (`--host`, `--port`, `--replicas`, `--config`, `--workers`, the
//! sharing and admin-host flags, …) stay in each binary.
//!
//! Closed sets of values are [`clap::ValueEnum`]s: [`PolicyName`] (its values are
//! [`policies::POLICY_NAMES`], so the list lives in the `policies` crate, which knows nothing of
//! clap), [`OnOff`] (`--spill`) and [`KvEventsFormat`] (`--kv-events-format`, to
//! [`EventFormat`]). Their `ValueEnum` impls are written out, without per-value help, so `--help`
//! lists `[possible values: …]` exactly as the string parsers before them did.

use std::path::PathBuf;

use clap::ValueEnum;
use clap::builder::PossibleValue;

use crate::RouterConfig;
use crate::events::EventFormat;

/// Why the shared flags could not make a configuration.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CliError {
    /// `--index-ttl-s` is not a positive number of seconds.
    #[error("--index-ttl-s must be > 0, got {0}")]
    IndexTtl(f64),
    /// `--block-bytes 0`.
    #[error("--block-bytes must be ≥ 1")]
    BlockBytes,
    /// The policy's parameters are out of range.
    #[error(transparent)]
    Policy(#[from] policies::SpecError),
}

/// A routing policy's name: one of [`policies::POLICY_NAMES`] (`--policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyName(&'static str);

/// Every [`PolicyName`], in [`policies::POLICY_NAMES`] order.
const POLICIES: [PolicyName; policies::POLICY_NAMES.len()] = {
    let mut all = [PolicyName(""); policies::POLICY_NAMES.len()];
    let mut i = 0;
    while i < all.len() {
        all[i] = PolicyName(policies::POLICY_NAMES[i]);
        i += 1;
    }
    all
};

impl PolicyName {
    /// The name, as `--policy` takes it and rows write it.
    pub fn as_str(self) -> &'static str {
        self.0
    }
}

impl ValueEnum for PolicyName {
    fn value_variants<'a>() -> &'a [Self] {
        &POLICIES
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(PossibleValue::new(self.0))
    }
}

/// A switch given as `on` or `off` (`--spill`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnOff {
    /// `on`.
    On,
    /// `off`.
    Off,
}

impl ValueEnum for OnOff {
    fn value_variants<'a>() -> &'a [Self] {
        &[OnOff::On, OnOff::Off]
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(PossibleValue::new(match self {
            OnOff::On => "on",
            OnOff::Off => "off",
        }))
    }
}

/// `--kv-events-format`: which engine publishes the KV events ([`EventFormat`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvEventsFormat(pub EventFormat);

impl ValueEnum for KvEventsFormat {
    fn value_variants<'a>() -> &'a [Self] {
        &[
            KvEventsFormat(EventFormat::Vllm),
            KvEventsFormat(EventFormat::Sglang),
        ]
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(PossibleValue::new(self.0.name()))
    }
}

/// The routing flags the router and the endpoint picker share, with the same names, help texts
/// and defaults (docs/CONTRACTS.md, "router flags" and "epp flags").
#[derive(Debug, Clone, clap::Args)]
pub struct RoutingArgs {
    /// Routing policy.
    #[arg(long, default_value = "prefix-affinity", value_enum)]
    pub policy: PolicyName,
    /// KV event PUB endpoints, one per replica in the same order (exact residency).
    #[arg(long, value_delimiter = ',')]
    pub kv_events: Vec<String>,
    /// KV event replay (ROUTER) endpoints, one per replica in the same order (gap repair).
    #[arg(long, value_delimiter = ',')]
    pub kv_replay: Vec<String>,
    /// Where to write router.csv.
    #[arg(long)]
    pub rows: Option<PathBuf>,
    /// Model name: the salt of block keys and the model sent to /tokenize (default: each
    /// request's own `model`).
    #[arg(long)]
    pub model: Option<String>,
    /// Belief block size in bytes.
    #[arg(long, default_value_t = 64)]
    pub block_bytes: usize,
    /// Engine block size in tokens (exact keys).
    #[arg(long, default_value_t = 16)]
    pub block_tokens: u32,
    /// Sliding TTL of believed index entries, seconds.
    #[arg(long)]
    pub index_ttl_s: Option<f64>,
    /// Node cap of the index.
    #[arg(long)]
    pub index_node_cap: Option<usize>,
    /// Spill (load branch) of prefix-affinity / exact-residency.
    #[arg(long, value_enum)]
    pub spill: Option<OnOff>,
    /// Bounded-load factor c (session-bounded, prefix-hash).
    #[arg(long)]
    pub load_factor: Option<f64>,
    /// Seed of every tie-break.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Largest request body accepted; larger gets 413.
    #[arg(long, default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Health-check period, milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub health_interval_ms: u64,
    /// Health-check timeout, milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub health_timeout_ms: u64,
    /// Per-replica in-flight ceiling; when every eligible replica is at it, 429 (off when absent).
    #[arg(long)]
    pub max_in_flight_per_replica: Option<u32>,
    /// Admin listener port (0 = ephemeral; the readiness line names it).
    #[arg(long, default_value_t = 0)]
    pub admin_port: u16,
}

impl RoutingArgs {
    /// The policy these flags name, with their parameters (seed, salt = `--model`, block
    /// tokens, index TTL and cap, spill, load factor); not yet validated, so a binary can set
    /// its own parameters first and then call [`policies::PolicySpec::validate`].
    pub fn policy_spec(&self) -> Result<policies::PolicySpec, CliError> {
        let mut p = policies::PolicySpec::named(self.policy.as_str());
        p.seed = self.seed;
        p.salt = self.model.clone().unwrap_or_default();
        p.tokens_per_block = self.block_tokens;
        if let Some(v) = self.index_ttl_s {
            if !(v.is_finite() && v > 0.0) {
                return Err(CliError::IndexTtl(v));
            }
            p.index_ttl_us = (v * 1e6) as u64;
        }
        if let Some(v) = self.index_node_cap {
            p.index_node_cap = v;
        }
        if let Some(v) = self.spill {
            p.spill = v == OnOff::On;
        }
        if let Some(v) = self.load_factor {
            p.load_factor = v;
        }
        Ok(p)
    }

    /// Sets the router settings these flags hold (rows, model, block bytes, body limit,
    /// health period and timeout, in-flight ceiling, admin port); `--block-bytes 0` is refused.
    pub fn apply(&self, cfg: &mut RouterConfig) -> Result<(), CliError> {
        if self.block_bytes == 0 {
            return Err(CliError::BlockBytes);
        }
        cfg.rows = self.rows.clone();
        cfg.model = self.model.clone();
        cfg.block_bytes = self.block_bytes;
        cfg.max_body_bytes = self.max_body_bytes;
        cfg.health_interval_ms = self.health_interval_ms;
        cfg.health_timeout_ms = self.health_timeout_ms;
        cfg.max_in_flight_per_replica = self.max_in_flight_per_replica;
        cfg.admin_port = self.admin_port;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        routing: RoutingArgs,
    }

    #[test]
    fn every_policy_name_parses_and_others_are_refused() {
        for name in policies::POLICY_NAMES {
            let cli = Cli::try_parse_from(["x", "--policy", name]).unwrap();
            assert_eq!(cli.routing.policy.as_str(), name);
            assert_eq!(cli.routing.policy_spec().unwrap().name, name);
        }
        assert_eq!(
            Cli::try_parse_from(["x"]).unwrap().routing.policy.as_str(),
            "prefix-affinity"
        );
        assert!(Cli::try_parse_from(["x", "--policy", "fastest"]).is_err());
    }

    #[test]
    fn flags_reach_the_spec_and_the_config() {
        let cli = Cli::try_parse_from([
            "x",
            "--policy",
            "prefix-affinity",
            "--spill",
            "off",
            "--index-ttl-s",
            "2.5",
            "--seed",
            "9",
            "--model",
            "m",
            "--block-bytes",
            "32",
        ])
        .unwrap();
        let p = cli.routing.policy_spec().unwrap();
        assert!(!p.spill);
        assert_eq!(
            (p.index_ttl_us, p.seed, p.salt.as_str()),
            (2_500_000, 9, "m")
        );
        let mut cfg = RouterConfig::new(Vec::new(), p);
        cli.routing.apply(&mut cfg).unwrap();
        assert_eq!((cfg.block_bytes, cfg.model.as_deref()), (32, Some("m")));
        assert!(Cli::try_parse_from(["x", "--spill", "maybe"]).is_err());
        let zero = Cli::try_parse_from(["x", "--block-bytes", "0"]).unwrap();
        let e = zero.routing.apply(&mut cfg).unwrap_err();
        assert_eq!(e.to_string(), "--block-bytes must be ≥ 1");
        let ttl = Cli::try_parse_from(["x", "--index-ttl-s", "0"]).unwrap();
        assert!(
            ttl.routing
                .policy_spec()
                .unwrap_err()
                .to_string()
                .contains("--index-ttl-s")
        );
    }

    #[test]
    fn kv_events_format_values_are_the_event_formats() {
        #[derive(Debug, Parser)]
        struct F {
            #[arg(long, default_value = "vllm", value_enum)]
            kv_events_format: KvEventsFormat,
        }
        assert_eq!(
            F::try_parse_from(["x"]).unwrap().kv_events_format.0,
            EventFormat::Vllm
        );
        let s = F::try_parse_from(["x", "--kv-events-format", "sglang"]).unwrap();
        assert_eq!(s.kv_events_format.0, EventFormat::Sglang);
        assert!(F::try_parse_from(["x", "--kv-events-format", "x"]).is_err());
    }
}
