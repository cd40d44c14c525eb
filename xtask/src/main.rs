//! `cargo xtask …`: the experiment loop — calibrate, sweep, report — and CI convenience.
//!
//! A thin driver: clap flags become the experiment crate's settings, and this crate keeps the
//! resumable loops, their progress lines and the Ctrl-C handler. The procedures (calibration, a
//! sweep's cell, a fault repetition, the virtual sweep's cell) are `experiment`'s; they run the
//! engines, router and driver as processes (docs/CONTRACTS.md) through the fleet crate, and the
//! analysis crate turns rows into verdicts.

mod calibration;
mod env;
mod fault;
mod figures_cmd;
mod fleetargs;
mod interrupt;
mod publish;
mod report;
mod sweep;
mod trace_args;
mod virtual_sweep;

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Result, bail};
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "cargo xtask", about = "kvroute's experiment loop")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Measure floors (→ SLO), KV capacity, index TTL and node cap, and the fleet's capacity (the
    /// highest open-loop rate the best policy serves within the SLO); exclude a throttling outlier.
    Calibrate(Box<calibration::CalibrateArgs>),
    /// Run a sweep (pressure-grid, load, turns, prompt-length, trace), resumably, then report.
    Sweep(Box<sweep::SweepArgs>),
    /// Fault a replica under steady load (`kill` or `drain`) and check the loss bounds.
    Fault(Box<fault::FaultArgs>),
    /// Print the report of a sweep directory (and write report.md / report.json into it); for a
    /// fault run's directory, rebuild its summary (summary.md / summary.json / timeline.csv).
    Report {
        /// The sweep directory, e.g. measurements/pressure-grid-quick.
        dir: PathBuf,
    },
    /// Live vs virtual: the same sweep's two directories compared cell by cell and effect by
    /// effect at effect-sized bounds (`analysis::crosscheck`); writes crosscheck.md / .json into
    /// the live directory and fails when they do not agree.
    Crosscheck {
        /// The live sweep directory.
        live: PathBuf,
        /// The virtual sweep directory (run with the live sweep's `--calibration`).
        virtual_dir: PathBuf,
        /// The policy the effects are margins over.
        #[arg(long, default_value = "session-affinity")]
        baseline: String,
    },
    /// Write the trace a workload description (`workloads/*.toml`) describes, for `sweep trace
    /// --trace` (`experiment::workload_description`).
    Workload {
        /// The description.
        description: PathBuf,
        /// The trace to write (JSONL).
        #[arg(long)]
        out: PathBuf,
    },
    /// Copy a sweep's summaries, meta and gzip-compressed rows into docs/measurements/.
    Publish(publish::PublishArgs),
    /// Render the figures from published measurements (`figures::render_all`).
    Figures(figures_cmd::FiguresArgs),
    /// The rebuild check: every published report, fault summary, timeline, cross-check and
    /// figure rebuilt from its rows with today's code (`experiment::rebuild`); fails naming each
    /// file that differs and its first differing line. `--write` replaces them.
    Rebuild(report::RebuildArgs),
    /// The router's own cost next to HAProxy and nginx, on in-process SSE upstreams.
    ProxyBench {
        /// The benchmark's flags.
        #[command(flatten)]
        args: Box<proxy_bench::ProxyBenchArgs>,
        /// Use the router binary already in target/release.
        #[arg(long)]
        no_build: bool,
    },
    /// CI as `.ci/run` defines it: system packages, llama-server and Envoy, fmt check, clippy
    /// (-D warnings) and every test, the ignored ones included.
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
        Cmd::Rebuild(args) => to_workspace_root().and_then(|()| report::rebuild(&args)),
        Cmd::ProxyBench { args, no_build } => bins(no_build).and_then(|_| proxy_bench::run(&args)),
        Cmd::Fault(args) => bins(args.no_build).and_then(|b| fault::fault(&args, &b).map(|_| ())),
        Cmd::Report { dir } => report::write(&dir),
        Cmd::Crosscheck {
            live,
            virtual_dir,
            baseline,
        } => report::crosscheck(&live, &virtual_dir, &baseline),
        Cmd::Workload { description, out } => {
            experiment::workload_description::write(&description, &out)
        }
        Cmd::Publish(args) => to_workspace_root().and_then(|()| publish::run(&args).map(|_| ())),
        Cmd::Ci => ci(),
    };
    if let Err(e) = result {
        eprintln!("xtask: error: {e:#}");
        std::process::exit(if interrupt::requested() { 130 } else { 1 });
    }
}

fn bins(no_build: bool) -> Result<experiment::Bins> {
    to_workspace_root()?;
    if no_build {
        let b = env::release_bins();
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

/// `.ci/run`, the one definition of CI: the installs, the style gates and every test, the
/// ignored ones included.
fn ci() -> Result<()> {
    let root = env::workspace_root();
    eprintln!("xtask ci: bash .ci/run");
    let status = Command::new("bash")
        .arg(root.join(".ci").join("run"))
        .current_dir(&root)
        .status()?;
    if !status.success() {
        bail!(".ci/run failed ({status})");
    }
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
        assert_eq!(
            args.fleet.spec(false).speed,
            experiment::fleet_spec::DEFAULT_SPEED
        );
        assert!(Cli::try_parse_from(["xtask", "sweep", "pressure-grid", "--open-loop"]).is_err());
        assert!(Cli::try_parse_from(["xtask", "sweep", "nonsense"]).is_err());
    }

    #[test]
    fn flags_become_the_library_settings_with_the_quick_defaults() {
        let parse = |args: &[&str]| Cli::try_parse_from(args).unwrap().command;
        let Cmd::Calibrate(c) = parse(&["xtask", "calibrate", "--quick", "--requests", "4"]) else {
            panic!("not calibrate")
        };
        let c = c.settings();
        assert_eq!((c.requests_per_replica, c.users), (4, 32));
        assert_eq!((c.warmup_s, c.measure_s, c.fleet.replicas), (5.0, 8.0, 3));
        assert_eq!(c.fleet.num_gpu_blocks, experiment::fleet_spec::QUICK_BLOCKS);
        let Cmd::Sweep(s) = parse(&["xtask", "sweep", "load", "--open-loop", "--rate", "2"]) else {
            panic!("not a sweep")
        };
        let s = s.settings().unwrap();
        assert_eq!(
            (s.open_rate_rps, s.warmup_s, s.fleet.replicas),
            (Some(2.0), 20.0, 5)
        );
        assert_eq!(s.ingress, fleet::Ingress::Router);
        let routers = |a: &str| match parse(
            &format!("xtask sweep load {a}")
                .split(' ')
                .collect::<Vec<_>>(),
        ) {
            Cmd::Sweep(s) => s.settings().map(|s| s.ingress),
            _ => panic!("not a sweep"),
        };
        let r = routers("--routers 4 --front session-hash --share-decisions").unwrap();
        assert_eq!(r.record_file_name(), "sweep-r4-hash-share.json");
        assert!(routers("--routers 2 --ingress haproxy").is_err());
        assert!(routers("--share-decisions").is_err() && routers("--front rr").is_ok());
        // The arrival: `--load` fractions of the capacity by default; the closed loop and
        // absolute rates only when asked for.
        let sweep = |args: &[&str]| match parse(args) {
            Cmd::Sweep(s) => s.settings().unwrap(),
            _ => panic!("not a sweep"),
        };
        let s = sweep(&["xtask", "sweep", "pressure-grid", "--quick"]);
        assert_eq!(s.load_fractions, Some(vec![]));
        assert!(s.needs_capacity() && !s.warmup_given);
        let s = sweep(&["xtask", "sweep", "turns", "--load", "0.7,1.0,1.3"]);
        assert_eq!(s.load_fractions, Some(vec![0.7, 1.0, 1.3]));
        let words = |a: &'static str| a.split(' ').collect::<Vec<_>>();
        let s = sweep(&words("xtask sweep pressure-grid --users 8 --warmup-s 2"));
        assert_eq!((s.load_fractions, s.users, s.warmup_given), (None, 8, true));
        assert_eq!(
            sweep(&["xtask", "sweep", "load", "--rates", "2,4"]).load_fractions,
            None
        );
        assert!(
            Cli::try_parse_from(["xtask", "sweep", "load", "--load", "1", "--users", "8"]).is_err()
        );
        let Cmd::Calibrate(c) = parse(&["xtask", "calibrate", "--quick"]) else {
            panic!("not calibrate")
        };
        let cap = c
            .settings()
            .capacity
            .expect("calibrate searches the capacity");
        assert_eq!(cap, experiment::capacity::CapacitySettings::defaults(true));
        let Cmd::Calibrate(c) = parse(&["xtask", "calibrate", "--no-capacity"]) else {
            panic!("not calibrate")
        };
        assert!(c.settings().capacity.is_none());
        let Cmd::Fault(f) = parse(&words(
            "xtask fault drain --quick --slo-ttft-ms 100 --slo-itl-ms 5",
        )) else {
            panic!("not a fault")
        };
        assert_eq!(f.dir(), PathBuf::from("measurements/fault-drain-quick"));
        let f = f.settings();
        assert_eq!(f.kind, analysis::fault::FaultKind::Drain);
        assert_eq!((f.warmup_s, f.before_s, f.after_s), (3.0, 10.0, 20.0));
        assert_eq!(f.slo.map(|s| (s.ttft_ms, s.itl_ms)), Some((100.0, 5.0)));
        f.check().unwrap();
    }
}
