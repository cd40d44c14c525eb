//! `experiment`: what a kvroute experiment is and how it is run, as a library.
//!
//! The sweeps' grids (points, the load axis, quick variants, the policies compared), the
//! measurements directory layout and its resume rule, publication into `docs/measurements/`, the
//! calibration record and the rules that derive it from measurements — and the procedures that
//! measure: the calibration, one live sweep cell, one fault repetition, the virtual sweep's cell.
//! The procedures start and stop processes through `fleet` and take a `should_stop` callback for
//! interrupts. `xtask` drives them: it keeps argument parsing, the resumable loops, progress
//! lines and the interrupt handler.
//!
//! Module map:
//! - [`grid`]: [`grid::SweepName`], [`grid::Point`], [`grid::points`], [`grid::policies`], the
//!   default windows.
//! - [`cell`]: one repetition directory — [`cell::CellState`] (the resume rule), atomic writes,
//!   `meta.json` written last, discarded attempts, the measured-window rule.
//! - [`plan_file`]: a point's plan on disk, written once and replayed.
//! - [`fleet_spec`]: [`FleetSpec`], the fleet as settings → `fleet::Source`, the fleet key.
//! - [`bins`]: [`Bins`], the release binaries the procedures run.
//! - [`attempt`]: one measured attempt (fleet cycled, ingress, driver, evidence, window).
//! - [`gate`]: the evidence and drift gates every sweep cell and fault repetition passes
//!   ([`gate::Gates`]: re-run, or record accepted or set aside).
//! - [`sweep`]: [`sweep::SweepSettings`] and the live sweep ([`sweep::LiveSweep`]).
//! - [`calibration`]: `calibration.json` ([`calibration::Calibration`]) and its derivation rules.
//! - [`calibrate`]: the calibration procedure, its phases printed with an ETA.
//! - [`capacity`]: the fleet's capacity — the rate search over a measuring callback, a sweep
//!   cell's window from the settling times it measured, and the live search.
//! - [`fault`]: the fault procedure ([`fault::FaultRun`]).
//! - [`virtual_sweep`]: the virtual sweep's fleet, calibration, preparation and cell.
//! - [`trace_sweep`]: the trace sweep's settings, point, `trace-plan.json` and engine limits.
//! - [`policy_capacity`]: each policy's own capacity at every point over several plan seeds,
//!   in virtual time or live from the simulator's predictions, judged by `analysis::capacity`.
//! - [`trace_capacity`]: each policy's own capacity on a trace — the fastest replay of it that
//!   meets the SLO — over several slices, in virtual time.
//! - [`publish`]: a finished sweep or fault run → `docs/measurements/<name>/`.
//! - [`rebuild`]: the rebuild check — every published report, summary, timeline, cross-check and
//!   figure rebuilt from its rows with today's code and compared byte for byte.
//! - [`progress`]: count-and-ETA lines for long loops.
//! - [`provenance`]: the git revision and tool versions results record.

pub mod attempt;
pub mod bins;
pub mod calibrate;
pub mod calibration;
pub mod capacity;
pub mod cell;
pub mod fault;
pub mod fleet_description;
pub mod fleet_spec;
pub mod gate;
pub mod grid;
pub mod plan_file;
pub mod policy_capacity;
pub mod progress;
pub mod provenance;
pub mod publish;
pub mod rebuild;
pub mod results_sources;
pub mod sweep;
pub mod trace_capacity;
pub mod trace_sweep;
pub mod virtual_sweep;
pub mod workload_description;

pub use bins::Bins;
pub use fleet_spec::{FleetKind, FleetSpec};

#[cfg(test)]
mod scratch;
