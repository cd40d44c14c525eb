//! `cargo xtask sweep trace` flags: the trace and its mapping, as `experiment::trace_sweep`'s
//! settings.

use std::path::PathBuf;

use clap::Args;
use experiment::trace_sweep::TraceSettings;

/// The trace the `trace` sweep replays.
#[derive(Debug, Clone, Args)]
pub struct TraceArgs {
    /// `sweep trace`: the Mooncake-format JSONL trace to replay.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Tokens of text per hash id: 512 keeps prompts at their real length, less scales them down
    /// (default 512, or 64 with --quick).
    #[arg(long, requires = "trace")]
    pub trace_block_tokens: Option<u32>,
    /// Model time = trace time × this; the wall clock divides by the speed (default 1, or 2 with
    /// --quick).
    #[arg(long, requires = "trace")]
    pub time_scale: Option<f64>,
    /// Start of the replayed slice, trace seconds.
    #[arg(long, requires = "trace", default_value_t = 0.0)]
    pub trace_start_s: f64,
    /// Length of the slice, trace seconds (default: what a cell's warm-up and window cover).
    #[arg(long, requires = "trace")]
    pub trace_duration_s: Option<f64>,
    /// At most this many requests of the slice.
    #[arg(long, requires = "trace")]
    pub max_requests: Option<u32>,
}

impl TraceArgs {
    /// The settings, when a trace is given.
    pub fn settings(&self, quick: bool) -> Option<TraceSettings> {
        let trace = self.trace.clone()?;
        Some(TraceSettings {
            start_s: self.trace_start_s,
            duration_s: self.trace_duration_s,
            max_requests: self.max_requests,
            ..TraceSettings::new(trace, quick, self.trace_block_tokens, self.time_scale)
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::sweep::SweepArgs;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        s: SweepArgs,
    }

    #[test]
    fn trace_flags_become_the_trace_settings_with_the_quick_defaults() {
        let t = T::try_parse_from(["t", "trace", "--quick", "--trace", "t.jsonl"]).unwrap();
        let s = t.s.settings().unwrap();
        let trace = s.trace.expect("trace settings");
        assert_eq!(
            (trace.block_tokens, trace.time_scale),
            (
                experiment::trace_sweep::QUICK_BLOCK_TOKENS,
                experiment::trace_sweep::QUICK_TIME_SCALE
            )
        );
        let t = T::try_parse_from([
            "t",
            "trace",
            "--trace",
            "t.jsonl",
            "--trace-block-tokens",
            "128",
            "--time-scale",
            "0.5",
            "--max-requests",
            "100",
        ])
        .unwrap();
        let trace = t.s.settings().unwrap().trace.unwrap();
        assert_eq!(
            (trace.block_tokens, trace.time_scale, trace.max_requests),
            (128, 0.5, Some(100))
        );
        assert_eq!(trace.point().name, "b128-x0.5-n100");
        // Mapping flags need a trace.
        assert!(T::try_parse_from(["t", "load", "--time-scale", "2"]).is_err());
    }
}
