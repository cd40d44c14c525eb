//! `experiment`: what a kvroute experiment is, as a library.
//!
//! The sweeps' grids (points, the load axis, quick variants, the policies compared), the
//! measurements directory layout and its resume rule, publication into `docs/measurements/`, the
//! calibration record and the rules that derive it from measurements, and the virtual sweep's
//! cell (one repetition simulated through `sim`, drift-checked, recorded). `xtask` drives these:
//! it keeps argument parsing, the resumable loop, progress and the processes.
//!
//! Module map:
//! - [`grid`]: [`grid::SweepName`], [`grid::Point`], [`grid::points`], [`grid::policies`].
//! - [`cell`]: one repetition directory — [`cell::CellState`] (the resume rule), atomic writes,
//!   `meta.json` written last, discarded attempts, the measured-window rule.
//! - [`publish`]: a finished sweep or fault run → `docs/measurements/<name>/`.
//! - [`calibration`]: `calibration.json` ([`calibration::Calibration`]) and its derivation rules.
//! - [`virtual_sweep`]: the virtual sweep's fleet, calibration and cell.

pub mod calibration;
pub mod cell;
pub mod grid;
pub mod publish;
pub mod virtual_sweep;

#[cfg(test)]
mod scratch;
