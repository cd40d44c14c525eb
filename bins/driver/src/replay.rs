//! `driver replay` and `driver trace-plan`: a Mooncake-format trace mapped by the `trace` crate
//! (`driver::replay`), replayed open loop or described.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use trace::ReplaySpec;
use trace::replay::DEFAULT_BLOCK_TOKENS;

use crate::SendArgs;

/// How the trace is mapped (`trace::ReplaySpec`).
#[derive(Args)]
pub struct MappingArgs {
    /// The Mooncake-format JSONL trace.
    #[arg(long, required_unless_present = "plan")]
    trace: Option<PathBuf>,
    /// Tokens of text per hash id: 512 replays prompts at their real length; less scales every
    /// prompt down by 512/B and keeps the sharing structure.
    #[arg(long, default_value_t = DEFAULT_BLOCK_TOKENS)]
    trace_block_tokens: u32,
    /// Replay time = trace time × this (0.5 sends twice as fast).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Start of the slice, trace seconds.
    #[arg(long, default_value_t = 0.0)]
    trace_start_s: f64,
    /// Length of the slice, trace seconds (default: to the end).
    #[arg(long)]
    trace_duration_s: Option<f64>,
    /// At most this many requests of the slice.
    #[arg(long)]
    max_requests: Option<u32>,
    /// Seed of the block texts.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// A replay recorded by a sweep (`trace-plan.json`) instead of the flags above; refused if
    /// the trace's bytes changed since.
    #[arg(long, conflicts_with = "trace")]
    plan: Option<PathBuf>,
}

impl MappingArgs {
    fn load(&self) -> Result<trace::ReplayPlan> {
        if let Some(plan) = &self.plan {
            return Ok(driver::load_replay_file(plan)?);
        }
        let Some(path) = &self.trace else {
            bail!("give --trace FILE or --plan trace-plan.json");
        };
        let spec = ReplaySpec {
            block_tokens: self.trace_block_tokens,
            time_scale: self.time_scale,
            start_s: self.trace_start_s,
            duration_s: self.trace_duration_s,
            max_requests: self.max_requests,
            seed: self.seed,
            ..ReplaySpec::default()
        };
        Ok(driver::load_replay(path, &spec)?)
    }
}

/// `driver replay` flags: the mapping and the run flags of `driver open`.
#[derive(Args)]
pub struct ReplayArgs {
    #[command(flatten)]
    mapping: MappingArgs,
    #[command(flatten)]
    send: SendArgs,
}

/// Prints the replay plan's description (one JSON line), as `driver plan` does for a plan.
pub fn describe(a: &MappingArgs) -> Result<()> {
    println!("{}", a.load()?.describe());
    Ok(())
}

/// Replays the trace; prints the plan's description, then the summary.
pub fn replay(a: &ReplayArgs) -> Result<()> {
    let plan = a.mapping.load()?;
    eprintln!("{}", plan.describe());
    let cfg = a.send.run_config();
    let summary = crate::interruptible(&cfg, driver::run_replay(&plan, &cfg))
        .context("replaying the trace")?;
    println!("{summary}");
    Ok(())
}
