//! `cargo xtask …`: the experiment loop — calibrate, sweep, report — and CI convenience.
//!
//! Orchestration only: the engines, router and driver run as processes through their CLIs
//! (docs/CONTRACTS.md), the fleet crate manages their lifecycles and evidence, the workload crate
//! builds the plans, the experiment crate defines the grids, the measurements layout, publication
//! and the calibration record, and the analysis crate turns rows into verdicts.

mod calibration;
mod cell;
mod env;
mod fault;
mod figures_cmd;
mod fleetargs;
mod interrupt;
mod progress;
mod publish;
mod report;
mod run;
#[cfg(test)]
mod scratch;
mod sweep;
mod virtual_sweep;

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Result, bail};
use clap::{Parser, Subcommand};
// The sweeps' definitions, as `crate::grid` for the commands that run them.
use experiment::grid;

#[derive(Debug, Parser)]
#[command(name = "cargo xtask", about = "kvroute's experiment loop")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Measure floors (→ SLO), KV capacity, index TTL and node cap; exclude a throttling outlier.
    Calibrate(Box<calibration::CalibrateArgs>),
    /// Run a sweep (pressure-grid, load, turns, prompt-length), resumably, then report.
    Sweep(Box<sweep::SweepArgs>),
    /// Fault a replica under steady load (`kill` or `drain`) and check the loss bounds.
    Fault(Box<fault::FaultArgs>),
    /// Print the report of a sweep directory (and write report.md / report.json into it); for a
    /// fault run's directory, rebuild its summary (summary.md / summary.json / timeline.csv).
    Report {
        /// The sweep directory, e.g. measurements/pressure-grid-quick.
        dir: PathBuf,
    },
    /// Copy a sweep's summaries, meta and gzip-compressed rows into docs/measurements/.
    Publish(publish::PublishArgs),
    /// Render the six figures from published measurements (`figures::render_all`).
    Figures(figures_cmd::FiguresArgs),
    /// The router's own cost next to HAProxy and nginx, on in-process SSE upstreams.
    ProxyBench {
        /// The benchmark's flags.
        #[command(flatten)]
        args: Box<proxy_bench::ProxyBenchArgs>,
        /// Use the router binary already in target/release.
        #[arg(long)]
        no_build: bool,
    },
    /// fmt check, clippy (-D warnings) and tests over the workspace.
    Ci,
}

fn main() {
    interrupt::install();
    let cli = Cli::parse();
    let result = match cli.command {
        Cmd::Calibrate(args) => {
            bins(args.no_build).and_then(|b| calibration::calibrate(&args, &b).map(|_| ()))
        }
        Cmd::Sweep(args) if args.virtual_time => {
            to_workspace_root().and_then(|()| virtual_sweep::sweep(&args).map(|_| ()))
        }
        Cmd::Sweep(args) => bins(args.no_build).and_then(|b| sweep::sweep(&args, &b).map(|_| ())),
        Cmd::Figures(args) => to_workspace_root().and_then(|()| figures_cmd::run(&args)),
        Cmd::ProxyBench { args, no_build } => bins(no_build).and_then(|_| proxy_bench::run(&args)),
        Cmd::Fault(args) => bins(args.no_build).and_then(|b| fault::fault(&args, &b).map(|_| ())),
        Cmd::Report { dir } => report::write(&dir),
        Cmd::Publish(args) => to_workspace_root().and_then(|()| publish::run(&args).map(|_| ())),
        Cmd::Ci => ci(),
    };
    if let Err(e) = result {
        eprintln!("xtask: error: {e:#}");
        std::process::exit(if interrupt::requested() { 130 } else { 1 });
    }
}

fn bins(no_build: bool) -> Result<env::Bins> {
    to_workspace_root()?;
    if no_build {
        let b = env::Bins::release();
        b.check()?;
        Ok(b)
    } else {
        env::build_release_bins()
    }
}

/// Paths given on the command line (measurements/…) are relative to the workspace root, where
/// `cargo xtask` is meant to be run from; makes that true wherever cargo was invoked.
fn to_workspace_root() -> Result<()> {
    let root = env::workspace_root();
    if std::env::current_dir().ok().as_deref() != Some(root.as_path()) {
        std::env::set_current_dir(&root)?;
    }
    Ok(())
}

fn ci() -> Result<()> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let steps: [&[&str]; 3] = [
        &["fmt", "--all", "--check"],
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ],
        &["test", "--workspace"],
    ];
    for step in steps {
        eprintln!("xtask ci: cargo {}", step.join(" "));
        let status = Command::new(&cargo)
            .current_dir(env::workspace_root())
            .args(step)
            .status()?;
        if !status.success() {
            bail!("cargo {} failed ({status})", step.join(" "));
        }
    }
    eprintln!("xtask ci: all green");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn main_job_flags_parse() {
        let cli = Cli::try_parse_from(["xtask", "sweep", "pressure-grid", "--quick"]).unwrap();
        let Cmd::Sweep(args) = cli.command else {
            panic!("not a sweep")
        };
        assert!(args.quick);
        assert_eq!(args.reps, 3);
        assert_eq!(args.fleet.speed, fleetargs::DEFAULT_SPEED);
        assert!(Cli::try_parse_from(["xtask", "sweep", "pressure-grid", "--open-loop"]).is_err());
        assert!(Cli::try_parse_from(["xtask", "sweep", "nonsense"]).is_err());
    }
}
