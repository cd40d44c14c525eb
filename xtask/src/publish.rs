//! `cargo xtask publish <sweep dir>`: `experiment::publish` — summaries, meta and gzip-compressed
//! rows of a finished sweep or fault run into `docs/measurements/<name>/`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use experiment::publish::Published;

/// Flags of `cargo xtask publish`.
#[derive(Debug, Clone, Args)]
pub struct PublishArgs {
    /// The sweep directory, e.g. `measurements/pressure-grid`.
    pub dir: PathBuf,
    /// Where the published sweeps live; the copy goes to `<to>/<sweep directory name>`.
    #[arg(long, default_value = "docs/measurements")]
    pub to: PathBuf,
}

/// Publishes `args.dir` into `args.to` and says what was copied.
pub fn run(args: &PublishArgs) -> Result<Published> {
    let out = experiment::publish::publish(&args.dir, &args.to)?;
    eprintln!(
        "xtask publish: {} → {}: {} files ({} compressed row files) from {} finished repetitions, {:.1} MB{}",
        args.dir.display(),
        out.dest.display(),
        out.files,
        out.row_files,
        out.reps,
        out.bytes as f64 / 1e6,
        if out.unfinished_reps > 0 {
            format!("; {} unfinished repetitions left out", out.unfinished_reps)
        } else {
            String::new()
        }
    );
    Ok(out)
}
