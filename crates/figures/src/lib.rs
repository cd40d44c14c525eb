//! kvroute's figures (docs/ARCHITECTURE.md, "Figures", and the load curve of the operating point), each as PNG,
//! SVG and a CSV of exactly the numbers drawn, from published measurements.
//!
//! Figures 1–5 come from a grid sweep analysed by the `analysis` crate; figures 1 and 2 lead with
//! a capacity panel from a per-policy capacity report (`policy-capacity.json`,
//! `analysis::capacity`), which figure 10 draws whole; figure 6 from a fault
//! sweep's `timeline.csv` (docs/CONTRACTS.md); figure 7 from a `load` sweep, analysed the same
//! way, with each point's offered load from its `meta.json`; figure 8 from an N-router sweep;
//! figure 9 from a trace replay. The figures never compute a metric themselves:
//! they pick numbers out of `analysis::Report` and `analysis::capacity::CapacityReport` and fail,
//! naming what is missing, when a number they need is not there. Text is drawn with an embedded
//! font (no fontconfig).
//!
//! ```no_run
//! let files = figures::render_all("docs/measurements".as_ref(), "docs/figures".as_ref())?;
//! # Ok::<(), figures::Error>(())
//! ```

pub mod data;
pub mod draw;
pub mod error;
pub mod font;
pub mod input;

use std::fmt;
use std::path::{Path, PathBuf};

pub use error::{Error, Result};

pub use input::{
    CapacityInput, Context, FaultInput, GridInput, LoadInput, load_capacity, load_fault, load_grid,
    load_load_sweep,
};

/// Sweep directories looked for (in order) under the measurements directory for figures 1–5.
pub const GRID_SWEEPS: [&str; 2] = ["pressure-grid", "pressure-grid-quick"];
/// Sweep directories looked for (in order) for figure 6: the kill at the quick fleet's calibrated
/// capacity first (`xtask fault kill --quick --rate <capacity> --sweep-dir-name
/// fault-kill-quick-capacity`), where an outage shows against the noise.
pub const FAULT_SWEEPS: [&str; 3] = [
    "fault-kill-quick-capacity",
    "fault-kill",
    "fault-kill-quick",
];
/// Sweep directories looked for (in order) for figure 7: a live load sweep first, the virtual
/// one (`sweep load --virtual`, published as `load-virtual`) when no live one is published.
pub const LOAD_SWEEPS: [&str; 3] = ["load", "load-quick", "load-virtual"];
/// Sweep directories looked for (in order) for figure 8: an N-router sweep (`xtask sweep load
/// --routers N …`, cells `r<N>-<front>[-share]-<policy>`, published under one of these names).
pub const ROUTERS_SWEEPS: [&str; 2] = ["routers", "routers-quick"];
/// Sweep directories looked for (in order) for figure 9: a trace replay (`xtask sweep trace`).
pub const TRACE_SWEEPS: [&str; 2] = ["trace", "trace-quick"];
/// Sweep directories looked for (in order) for the capacity panels of figures 1 and 2 and for
/// figure 10: a per-policy capacity report ([`input::CAPACITY_FILE`]) over the full grid (`xtask
/// sweep pressure-grid --virtual --policy-capacity`), else over the quick grid.
pub const CAPACITY_SWEEPS: [&str; 2] = [
    "pressure-grid-virtual-policy-capacity",
    "pressure-grid-quick-policy-capacity-virtual",
];

/// The figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FigureId {
    /// 1: prefix-affinity's margin over session-affinity across working set × skew.
    PressureMap,
    /// 2: winner and runner-up per grid point.
    WinnersMap,
    /// 3: prefix-hit rate vs busiest replica's share, spill on vs off.
    Mechanism,
    /// 4: prefix-hash vs believed vs exact (± speculative).
    KnowledgeLadder,
    /// 5: belief divergence and decay.
    Belief,
    /// 6: goodput per second through a replica kill and restart.
    FaultTimeline,
    /// 7: goodput and SLO attainment against offered load, per policy, knees marked.
    LoadCurve,
    /// 8: engine prefix-hit rate and goodput against the number of routers, per policy and arm.
    Routers,
    /// 9: goodput, SLO attainment and engine prefix-hit rate of every policy replaying a trace.
    TraceReplay,
    /// 10: each policy's own capacity at every point (median with the seed range), its ratio
    /// to session-affinity and the verdict.
    PolicyCapacity,
}

impl FigureId {
    /// All of them, in order.
    pub const ALL: [FigureId; 10] = [
        FigureId::PressureMap,
        FigureId::WinnersMap,
        FigureId::Mechanism,
        FigureId::KnowledgeLadder,
        FigureId::Belief,
        FigureId::FaultTimeline,
        FigureId::LoadCurve,
        FigureId::Routers,
        FigureId::TraceReplay,
        FigureId::PolicyCapacity,
    ];

    /// File stem of its outputs (`<stem>.png`, `.svg`, `.csv`).
    pub fn stem(&self) -> &'static str {
        match self {
            FigureId::PressureMap => "fig1-pressure-map",
            FigureId::WinnersMap => "fig2-winners-map",
            FigureId::Mechanism => "fig3-mechanism",
            FigureId::KnowledgeLadder => "fig4-knowledge-ladder",
            FigureId::Belief => "fig5-belief",
            FigureId::FaultTimeline => "fig6-fault-timeline",
            FigureId::LoadCurve => "fig7-load-curve",
            FigureId::Routers => "fig8-routers",
            FigureId::TraceReplay => "fig9-trace-replay",
            FigureId::PolicyCapacity => "fig10-policy-capacity",
        }
    }

    /// Whether the figure draws a per-policy capacity report (figures 1 and 2 lead with it,
    /// figure 10 is it).
    pub fn needs_capacity(&self) -> bool {
        matches!(
            self,
            FigureId::PressureMap | FigureId::WinnersMap | FigureId::PolicyCapacity
        )
    }

    /// Parses `1`…`10` or a stem (`fig3-mechanism`) or its tail (`mechanism`).
    pub fn parse(s: &str) -> Option<FigureId> {
        FigureId::ALL.into_iter().enumerate().find_map(|(i, f)| {
            let stem = f.stem();
            (s == (i + 1).to_string() || s == stem || stem.split_once('-').map(|x| x.1) == Some(s))
                .then_some(f)
        })
    }
}

impl fmt::Display for FigureId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.stem())
    }
}

/// Where the figures read from.
#[derive(Debug, Clone, PartialEq)]
pub struct Sources {
    /// The grid sweep directory (figures 1–5).
    pub grid: PathBuf,
    /// The fault sweep directory holding `timeline.csv` (figure 6).
    pub fault: PathBuf,
    /// The `load` sweep directory (figure 7).
    pub load: PathBuf,
    /// The N-router sweep directory (figure 8).
    pub routers: PathBuf,
    /// The trace replay sweep directory (figure 9).
    pub trace: PathBuf,
    /// The directory of the per-policy capacity report (figures 1, 2 and 10).
    pub capacity: PathBuf,
}

/// Whether the sweep in `dir` is published part-way: its `report.json` says `in_progress`
/// (`analysis::report::InProgress`).
fn in_progress(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("report.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .is_some_and(|r| r.get("in_progress").is_some_and(|v| !v.is_null()))
}

impl Sources {
    /// The first of [`GRID_SWEEPS`], of [`FAULT_SWEEPS`], of [`LOAD_SWEEPS`], … that exists under
    /// `measurements_dir` and is not in progress (its `report.json` has no `in_progress`: a grid
    /// published part-way, to be resumed, is not drawn as if it were whole); the first name when
    /// none is, so that errors name it. Of [`CAPACITY_SWEEPS`], the first that holds its
    /// report ([`input::CAPACITY_FILE`]).
    pub fn discover(measurements_dir: &Path) -> Sources {
        let pick = |names: &[&str]| {
            names
                .iter()
                .map(|n| measurements_dir.join(n))
                .find(|p| p.is_dir() && !in_progress(p))
                .unwrap_or_else(|| measurements_dir.join(names[0]))
        };
        Sources {
            grid: pick(&GRID_SWEEPS),
            fault: pick(&FAULT_SWEEPS),
            load: pick(&LOAD_SWEEPS),
            routers: pick(&ROUTERS_SWEEPS),
            trace: pick(&TRACE_SWEEPS),
            capacity: CAPACITY_SWEEPS
                .iter()
                .map(|n| measurements_dir.join(n))
                .find(|p| p.join(input::CAPACITY_FILE).is_file())
                .unwrap_or_else(|| measurements_dir.join(CAPACITY_SWEEPS[0])),
        }
    }
}

/// Renders every figure from `measurements_dir` (see [`Sources::discover`]) into `out_dir`.
/// Every figure that can be drawn is written even when another fails; the error then lists
/// each failure with what is missing. Returns the files written.
pub fn render_all(measurements_dir: &Path, out_dir: &Path) -> Result<Vec<PathBuf>> {
    render(
        &Sources::discover(measurements_dir),
        out_dir,
        &FigureId::ALL,
    )
}

/// Renders `which` from `sources` into `out_dir` (created if needed): for each figure
/// `<stem>.png`, `<stem>.svg` and `<stem>.csv`. Same error behaviour as [`render_all`].
pub fn render(sources: &Sources, out_dir: &Path, which: &[FigureId]) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(out_dir).map_err(|source| Error::CreateDir {
        path: out_dir.to_path_buf(),
        source,
    })?;
    let needs_grid = which.iter().any(|f| {
        !matches!(
            f,
            FigureId::FaultTimeline
                | FigureId::LoadCurve
                | FigureId::Routers
                | FigureId::TraceReplay
                | FigureId::PolicyCapacity
        )
    });
    let grid = if needs_grid {
        Some(grid_input(&sources.grid))
    } else {
        None
    };
    let needs_capacity = which.iter().any(|f| f.needs_capacity());
    let capacity = needs_capacity.then(|| capacity_input(&sources.capacity));
    let mut files = Vec::new();
    let mut failures = Vec::new();
    for &fig in which {
        let out =
            match (fig, &grid) {
                (FigureId::FaultTimeline, _) => load_fault(&sources.fault)
                    .and_then(|f| render_one(fig, Input::Fault(&f), out_dir)),
                (FigureId::LoadCurve, _) => load_input(&sources.load)
                    .and_then(|l| render_one(fig, Input::Load(&l), out_dir)),
                (FigureId::Routers, _) => routers_input(&sources.routers)
                    .and_then(|r| render_one(fig, Input::Routers(&r), out_dir)),
                (FigureId::TraceReplay, _) => trace_input(&sources.trace)
                    .and_then(|t| render_one(fig, Input::Trace(&t), out_dir)),
                (FigureId::PolicyCapacity, _) => match &capacity {
                    Some(Ok(c)) => render_one(fig, Input::Capacity(c), out_dir),
                    Some(Err(e)) => Err(Error::Missing(e.chain())),
                    None => unreachable!("the capacity report is loaded for figure 10"),
                },
                (FigureId::PressureMap | FigureId::WinnersMap, Some(Ok(g))) => match &capacity {
                    Some(Ok(c)) => render_one(fig, Input::Maps(g, c), out_dir),
                    Some(Err(e)) => Err(Error::Missing(e.chain())),
                    None => unreachable!("the capacity report is loaded for figures 1 and 2"),
                },
                (_, Some(Ok(g))) => render_one(fig, Input::Grid(g), out_dir),
                (_, Some(Err(e))) => {
                    failures.push(format!("{fig}: {}", e.chain()));
                    continue;
                }
                (_, None) => unreachable!("the grid is loaded whenever a grid figure is asked for"),
            };
        match out {
            Ok(mut written) => files.append(&mut written),
            Err(e) => failures.push(format!("{fig}: {}", e.chain())),
        }
    }
    if !failures.is_empty() {
        return Err(Error::NotDrawn {
            failures,
            total: which.len(),
            written: files,
        });
    }
    Ok(files)
}

/// Fails naming `figure`, the directory and the names looked for (`also` says how to make one)
/// when the sweep directory `dir` is missing.
fn require_sweep(
    dir: &Path,
    figure: &'static str,
    names: &[&'static str],
    also: &'static str,
) -> Result<()> {
    if !dir.is_dir() {
        return Err(Error::NoSweep {
            figure,
            dir: dir.to_path_buf(),
            looked_for: names.to_vec(),
            also,
        });
    }
    Ok(())
}

fn load_input(dir: &Path) -> Result<LoadInput> {
    let make = "; `cargo xtask sweep load` then `cargo xtask publish` make one";
    require_sweep(dir, "figure 7 needs a load sweep", &LOAD_SWEEPS, make)?;
    load_load_sweep(dir)
}

fn routers_input(dir: &Path) -> Result<GridInput> {
    let make = "; `cargo xtask sweep load --routers N …` then `cargo xtask publish` make one";
    require_sweep(
        dir,
        "figure 8 needs an N-router sweep",
        &ROUTERS_SWEEPS,
        make,
    )?;
    load_grid(dir)
}

fn trace_input(dir: &Path) -> Result<GridInput> {
    let make = "; `cargo xtask sweep trace --trace FILE` then `cargo xtask publish` make one";
    require_sweep(dir, "figure 9 needs a trace replay", &TRACE_SWEEPS, make)?;
    load_grid(dir)
}

fn grid_input(dir: &Path) -> Result<GridInput> {
    require_sweep(dir, "figures 1–5 need a grid sweep", &GRID_SWEEPS, "")?;
    load_grid(dir)
}

fn capacity_input(dir: &Path) -> Result<CapacityInput> {
    let make = "; `cargo xtask sweep pressure-grid --virtual --policy-capacity` writes one, published as `pressure-grid-virtual-policy-capacity/`";
    let file = dir.join(input::CAPACITY_FILE);
    if !file.is_file() {
        return Err(Error::NoSweep {
            figure: "figures 1, 2 and 10 need a per-policy capacity report",
            dir: file,
            looked_for: CAPACITY_SWEEPS.to_vec(),
            also: make,
        });
    }
    load_capacity(dir)
}

/// What one figure is drawn from.
#[derive(Debug, Clone, Copy)]
pub enum Input<'a> {
    /// A loaded grid sweep (figures 3–5).
    Grid(&'a GridInput),
    /// A loaded grid sweep and a per-policy capacity report (figures 1 and 2: the capacity
    /// panel first, the grid's fixed-rate panel second).
    Maps(&'a GridInput, &'a CapacityInput),
    /// A per-policy capacity report (figure 10).
    Capacity(&'a CapacityInput),
    /// A loaded fault sweep (figure 6).
    Fault(&'a FaultInput),
    /// A loaded `load` sweep (figure 7).
    Load(&'a LoadInput),
    /// A loaded N-router sweep (figure 8).
    Routers(&'a GridInput),
    /// A loaded trace replay (figure 9).
    Trace(&'a GridInput),
}

/// Draws one figure from an already loaded input and writes its three files into `out_dir`
/// (which must exist). Returns the files written.
pub fn render_one(fig: FigureId, input: Input<'_>, out_dir: &Path) -> Result<Vec<PathBuf>> {
    let base = out_dir.join(fig.stem());
    let png = base.with_extension("png");
    let svg = base.with_extension("svg");
    let csv = base.with_extension("csv");
    let table = match (fig, input) {
        (FigureId::FaultTimeline, Input::Fault(f)) => {
            let d = data::timeline(f)?;
            draw::render_files(
                &draw::TimelineFigure {
                    data: &d,
                    ctx: &f.context,
                },
                &png,
                &svg,
            )?;
            d.table()
        }
        (FigureId::LoadCurve, Input::Load(l)) => {
            let d = data::load_curve(l)?;
            draw::render_files(
                &draw::LoadCurveFigure {
                    data: &d,
                    ctx: &l.context,
                },
                &png,
                &svg,
            )?;
            d.table()
        }
        (FigureId::Routers, Input::Routers(g)) => {
            let d = data::routers(&g.report)?;
            draw::render_files(
                &draw::RoutersFigure {
                    data: &d,
                    ctx: &g.context,
                },
                &png,
                &svg,
            )?;
            d.table()
        }
        (FigureId::Routers, _) => {
            return Err(Error::WrongInput {
                fig,
                needs: "an N-router sweep",
            });
        }
        (FigureId::TraceReplay, Input::Trace(g)) => {
            let d = data::trace_replay(&g.report)?;
            draw::render_files(
                &draw::TraceFigure {
                    data: &d,
                    ctx: &g.context,
                },
                &png,
                &svg,
            )?;
            d.table()
        }
        (FigureId::TraceReplay, _) => {
            return Err(Error::WrongInput {
                fig,
                needs: "a trace replay",
            });
        }
        (FigureId::PolicyCapacity, Input::Capacity(c)) => {
            let d = data::policy_capacity(&c.report)?;
            draw::render_files(&draw::CapacityFigure { data: &d }, &png, &svg)?;
            d.table()
        }
        (FigureId::PolicyCapacity, _) => {
            return Err(Error::WrongInput {
                fig,
                needs: "a per-policy capacity report",
            });
        }
        (FigureId::PressureMap, Input::Maps(g, c)) => {
            let d = data::pressure(&g.report)?;
            let cap = data::pressure_capacity(&c.report)?;
            draw::render_files(
                &draw::PressureFigure {
                    data: &d,
                    capacity: &cap,
                    ctx: &g.context,
                    drive: &g.drive,
                },
                &png,
                &svg,
            )?;
            data::with_panels(cap.table(), d.table())
        }
        (FigureId::WinnersMap, Input::Maps(g, c)) => {
            let d = data::winners(&g.report)?;
            let cap = data::capacity_winners(&c.report)?;
            draw::render_files(
                &draw::WinnersFigure {
                    data: &d,
                    capacity: &cap,
                    ctx: &g.context,
                    drive: &g.drive,
                },
                &png,
                &svg,
            )?;
            data::with_panels(cap.table(), d.table())
        }
        (FigureId::PressureMap | FigureId::WinnersMap, _) => {
            return Err(Error::WrongInput {
                fig,
                needs: "a grid sweep and a per-policy capacity report",
            });
        }
        (FigureId::FaultTimeline, _) => {
            return Err(Error::WrongInput {
                fig,
                needs: "a fault sweep",
            });
        }
        (FigureId::LoadCurve, _) => {
            return Err(Error::WrongInput {
                fig,
                needs: "a load sweep",
            });
        }
        (
            _,
            Input::Fault(_)
            | Input::Load(_)
            | Input::Routers(_)
            | Input::Trace(_)
            | Input::Maps(..)
            | Input::Capacity(_),
        ) => {
            return Err(Error::WrongInput {
                fig,
                needs: "a grid sweep",
            });
        }
        (fig, Input::Grid(g)) => {
            let (r, ctx) = (&g.report, &g.context);
            match fig {
                FigureId::Mechanism => {
                    let d = data::mechanism(r)?;
                    draw::render_files(&draw::MechanismFigure { data: &d, ctx }, &png, &svg)?;
                    d.table()
                }
                FigureId::KnowledgeLadder => {
                    let d = data::ladder(r)?;
                    draw::render_files(&draw::LadderFigure { data: &d, ctx }, &png, &svg)?;
                    d.table()
                }
                FigureId::Belief => {
                    let d = data::belief(r)?;
                    draw::render_files(&draw::BeliefFigure { data: &d, ctx }, &png, &svg)?;
                    d.table()
                }
                FigureId::PressureMap
                | FigureId::WinnersMap
                | FigureId::FaultTimeline
                | FigureId::LoadCurve
                | FigureId::Routers
                | FigureId::TraceReplay
                | FigureId::PolicyCapacity => {
                    unreachable!("matched above")
                }
            }
        }
    };
    write_atomic(&csv, table.to_csv()?.as_bytes())?;
    Ok(vec![png, svg, csv])
}

/// Writes through a synced temp file and a rename (the `atomic-write-file` crate): a figure's data
/// file is never half written.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let write = |source| Error::Write {
        path: path.to_path_buf(),
        source,
    };
    let mut f = atomic_write_file::AtomicWriteFile::open(path).map_err(write)?;
    std::io::Write::write_all(&mut f, bytes)
        .and_then(|()| f.commit())
        .map_err(write)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grid_in_progress_is_passed_over_for_the_next_finished_one() {
        let root = std::env::temp_dir().join(format!("figures-sources-{}", std::process::id()));
        let write = |sweep: &str, report: &str| {
            std::fs::create_dir_all(root.join(sweep)).unwrap();
            std::fs::write(root.join(sweep).join("report.json"), report).unwrap();
        };
        write(
            "pressure-grid",
            r#"{"in_progress": {"planned_reps": 324, "finished_reps": 34}}"#,
        );
        write("pressure-grid-quick", r#"{"points": []}"#);
        assert_eq!(
            Sources::discover(&root).grid,
            root.join("pressure-grid-quick")
        );
        write("pressure-grid", r#"{"points": []}"#);
        assert_eq!(Sources::discover(&root).grid, root.join("pressure-grid"));
        std::fs::remove_dir_all(&root).unwrap();
    }
}
