//! `cargo xtask figures`: the figures (docs/ARCHITECTURE.md, "Figures", and the load curve) from published measurements,
//! through `figures::render_all` (this module only wires the paths).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

/// Flags of `cargo xtask figures`.
#[derive(Debug, Clone, Args)]
pub struct FiguresArgs {
    /// Where the published sweeps are (`pressure-grid[-quick]/`, `fault-kill[-quick]/`, …, and
    /// the per-policy capacity report `pressure-grid-virtual-policy-capacity/`).
    #[arg(long, default_value = "docs/measurements")]
    pub measurements: PathBuf,
    /// Where `<stem>.png`, `<stem>.svg` and `<stem>.csv` go.
    #[arg(long, default_value = "docs/figures")]
    pub out: PathBuf,
}

/// Renders every figure it can; an error lists each figure that could not be drawn.
pub fn run(args: &FiguresArgs) -> Result<()> {
    let files = figures::render_all(&args.measurements, &args.out).with_context(|| {
        format!(
            "rendering figures from {} into {}",
            args.measurements.display(),
            args.out.display()
        )
    })?;
    for f in &files {
        println!("{}", f.display());
    }
    eprintln!(
        "xtask figures: {} files written to {}",
        files.len(),
        args.out.display()
    );
    Ok(())
}
