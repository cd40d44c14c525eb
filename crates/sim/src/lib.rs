//! `sim`: kvroute in virtual time.
//!
//! The same workload plans, routing policies, `kv-index` and engine core as the live harness,
//! driven by a discrete-event loop on a simulated clock instead of processes and sockets. A cell
//! writes `client.csv` and `router.csv` in the live schema plus a `meta.json` that says
//! `"virtual": true`, so the analysis, report and figures read virtual and live sweeps alike.
//! The same config and seed give byte-identical rows.
//!
//! Module map:
//! - [`config`]: [`SimConfig`] — fleet, router cost model, driver settings.
//! - [`prompts`]: [`PromptBook`] — every turn's engine tokens and router belief keys, once per plan.
//! - [`sim`]: the event loop; [`simulate`] returns every request's [`rows::Outcome`].
//! - [`rows`]: rendering outcomes as `client.csv` / `router.csv` records.
//! - [`calibrate`]: [`calibrate()`] and [`calibrate_plan`] — TTFT/ITL floors and the SLO, as
//!   `xtask calibrate` measures them (on a plan the caller shaped, or one built from a shape).
//! - [`cell`]: [`run_cell`] (rows + meta on disk, atomically), [`run_grid`] (cells in parallel),
//!   [`CellSummary`].
//! - [`trace`]: trace replays ([`simulate_trace`], [`run_trace_cell`], [`context_tokens`]).

#![forbid(unsafe_code)]

pub mod calibrate;
pub mod cell;
pub mod config;
pub mod prompts;
pub mod rows;
pub mod sim;
pub mod trace;

pub use calibrate::{Calibration, calibrate, calibrate_plan};
pub use cell::{
    CellMeta, CellSummary, GridJob, Slo, Window, measured_window, run_cell, run_cell_with,
    run_grid, summarize, write_cell_rows, write_meta,
};
pub use config::{DEFAULT_MODEL, DriverModel, RouterModel, SimConfig};
pub use prompts::PromptBook;
pub use sim::{EngineTotals, SimOutput, simulate, simulate_trace, simulate_with};
pub use trace::{context_tokens, run_trace_cell, write_trace_cell_rows};

/// Why a virtual run could not be done.
#[derive(Debug, Clone, PartialEq)]
pub enum SimError {
    /// A config value is out of range; the message names it.
    Config(String),
    /// The plan is inconsistent.
    Plan(String),
    /// No measured window could be formed (too few requests, or all inside the warm-up).
    Window(String),
    /// Writing the cell's files failed.
    Io(String),
}

impl std::fmt::Display for SimError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SimError::Config(m) => write!(f, "invalid simulation config: {m}"),
            SimError::Plan(m) => write!(f, "invalid plan: {m}"),
            SimError::Window(m) => write!(f, "no measured window: {m}"),
            SimError::Io(m) => write!(f, "cannot write the cell: {m}"),
        }
    }
}

impl std::error::Error for SimError {}
