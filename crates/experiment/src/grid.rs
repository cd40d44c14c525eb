//! Sweep definitions: the points of each sweep (working set × skew, the load axis, turns, prompt
//! length; full and quick variants) and the policies compared at them. Shared by the live and
//! the virtual sweep, so both run the same grid.

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

/// Every policy name the router knows (docs/CONTRACTS.md), in the order a sweep runs them (the
/// same names as `policies::POLICY_NAMES`, tested; this order decides the cells' order and the
/// list in `sweep.json`).
pub const ALL_POLICIES: &[&str] = &[
    "round-robin",
    "least-outstanding",
    "session-affinity",
    "prefix-affinity",
    "prefix-affinity-spill-off",
    "prefix-hash",
    "exact-residency",
    "exact-residency-spec",
    "session-bounded",
];

/// The policies a `--quick` sweep compares by default: the plain baseline, the hashing
/// baseline and the cache-aware router.
pub const QUICK_POLICIES: &[&str] = &["round-robin", "session-affinity", "prefix-affinity"];

/// Warm-up per cell, wall s: long enough for the caches to fill and the users' turns to fall out
/// of step after their simultaneous start.
pub const FULL_WARMUP_S: f64 = 20.0;
/// Measured window per cell, wall s.
pub const FULL_MEASURE_S: f64 = 40.0;
/// Warm-up per cell with `--quick`, wall s.
pub const QUICK_WARMUP_S: f64 = 5.0;
/// Measured window per cell with `--quick`, wall s.
pub const QUICK_MEASURE_S: f64 = 8.0;

/// Default warm-up of a cell (and of the calibration's reference run), wall s.
pub fn default_warmup_s(quick: bool) -> f64 {
    if quick { QUICK_WARMUP_S } else { FULL_WARMUP_S }
}

/// Default measured window of a cell (and of the calibration's reference run), wall s.
pub fn default_measure_s(quick: bool) -> f64 {
    if quick {
        QUICK_MEASURE_S
    } else {
        FULL_MEASURE_S
    }
}

/// The sweeps `cargo xtask sweep <name>` knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "kebab-case")]
pub enum SweepName {
    /// Working set × skew.
    PressureGrid,
    /// Open-loop rate axis at the frozen point (ws 1, skew 0).
    Load,
    /// Turns per conversation at the frozen point.
    Turns,
    /// Context-prefix length at the frozen point.
    PromptLength,
    /// A Mooncake-format trace replayed (`crate::trace_sweep`; its one point comes from the
    /// trace settings, not from this grid).
    Trace,
}

impl SweepName {
    /// The directory / display name.
    pub fn as_str(self) -> &'static str {
        match self {
            SweepName::PressureGrid => "pressure-grid",
            SweepName::Load => "load",
            SweepName::Turns => "turns",
            SweepName::PromptLength => "prompt-length",
            SweepName::Trace => "trace",
        }
    }
}

/// How requests arrive at a point.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Arrival {
    /// `users` closed-loop users.
    Closed {
        /// Concurrent users.
        users: u32,
    },
    /// Poisson arrivals at `rate_rps` requests per second of model time.
    Open {
        /// Model-time rate (the wall rate is `rate_rps × speed`).
        rate_rps: f64,
    },
    /// A trace's own arrival times (`crate::trace_sweep`), open loop.
    Trace {
        /// Model time = trace time × this (the wall time divides it by the speed).
        time_scale: f64,
    },
}

/// One grid point: the workload parameters that vary, and the arrival process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Point {
    /// Directory name, e.g. `ws1-s0`, `ws1-s0-rate4`.
    pub name: String,
    /// Working set ÷ fleet KV capacity.
    pub ratio: f64,
    /// Zipf exponent over conversations.
    pub zipf_s: f64,
    /// Turns per conversation.
    pub turns: u32,
    /// Context prefix at turn 1, tokens.
    pub prefix_tokens: u32,
    /// Arrival process.
    pub arrival: Arrival,
}

/// What the grid is built from.
#[derive(Debug, Clone)]
pub struct GridParams {
    /// Reduced grid.
    pub quick: bool,
    /// Closed-loop users (the reference load is 32).
    pub users: u32,
    /// Open loop at this model-time rate instead of closed loop (pressure-grid, turns,
    /// prompt-length); `load` always runs open loop.
    pub open_rate_rps: Option<f64>,
    /// Model-time rates of the `load` sweep; empty: the defaults.
    pub rates_rps: Vec<f64>,
    /// Replicas in use (scales the default `load` rates).
    pub replicas: usize,
}

fn fmt(x: f64) -> String {
    format!("{x}")
}

fn point(
    ratio: f64,
    zipf_s: f64,
    turns: u32,
    prefix: u32,
    arrival: Arrival,
    suffix: &str,
) -> Point {
    Point {
        name: format!("ws{}-s{}{suffix}", fmt(ratio), fmt(zipf_s)),
        ratio,
        zipf_s,
        turns,
        prefix_tokens: prefix,
        arrival,
    }
}

/// The points of sweep `name`.
pub fn points(name: SweepName, p: &GridParams) -> Result<Vec<Point>> {
    let turns = workload::spec::DEFAULT_TURNS;
    let prefix = workload::spec::DEFAULT_PREFIX_TOKENS;
    let arrival = match p.open_rate_rps {
        Some(rate) if rate > 0.0 && rate.is_finite() => Arrival::Open { rate_rps: rate },
        Some(rate) => bail!("--rate must be a positive number of requests per second, got {rate}"),
        None if p.users == 0 => bail!("--users must be at least 1"),
        None => Arrival::Closed { users: p.users },
    };
    let open_suffix = |a: Arrival| match a {
        Arrival::Open { rate_rps } => format!("-rate{}", fmt(rate_rps)),
        Arrival::Closed { .. } | Arrival::Trace { .. } => String::new(),
    };
    Ok(match name {
        SweepName::PressureGrid => {
            let (ratios, skews): (&[f64], &[f64]) = if p.quick {
                (&[1.0, 3.0], &[0.0, 1.4])
            } else {
                (&[0.25, 1.0, 3.0, 8.0], &[0.0, 1.0, 1.4])
            };
            let mut out = Vec::new();
            for &r in ratios {
                for &s in skews {
                    out.push(point(r, s, turns, prefix, arrival, &open_suffix(arrival)));
                }
            }
            out
        }
        SweepName::Load => {
            let scale = p.replicas as f64 / 5.0;
            let rates: Vec<f64> = if !p.rates_rps.is_empty() {
                p.rates_rps.clone()
            } else if p.quick {
                vec![3.0 * scale, 6.0 * scale]
            } else {
                [2.0, 4.0, 6.0, 8.0, 10.0]
                    .iter()
                    .map(|r| r * scale)
                    .collect()
            };
            if let Some(bad) = rates.iter().find(|r| !(r.is_finite() && **r > 0.0)) {
                bail!("rates must be positive, got {bad}");
            }
            rates
                .into_iter()
                .map(|r| {
                    let r = (r * 1000.0).round() / 1000.0;
                    point(
                        1.0,
                        0.0,
                        turns,
                        prefix,
                        Arrival::Open { rate_rps: r },
                        &format!("-rate{}", fmt(r)),
                    )
                })
                .collect()
        }
        SweepName::Turns => {
            let all: &[u32] = if p.quick { &[2, 6] } else { &[2, 4, 6, 10] };
            all.iter()
                .map(|&t| {
                    point(
                        1.0,
                        0.0,
                        t,
                        prefix,
                        arrival,
                        &format!("-t{t}{}", open_suffix(arrival)),
                    )
                })
                .collect()
        }
        SweepName::Trace => {
            bail!("the trace sweep's point comes from its trace settings (--trace FILE)")
        }
        SweepName::PromptLength => {
            let all: &[u32] = if p.quick {
                &[550, 2200]
            } else {
                &[275, 550, 1100, 2200]
            };
            all.iter()
                .map(|&len| {
                    point(
                        1.0,
                        0.0,
                        turns,
                        len,
                        arrival,
                        &format!("-p{len}{}", open_suffix(arrival)),
                    )
                })
                .collect()
        }
    })
}

/// Keeps the points named in `only` (all when empty); an unknown name is an error.
pub fn select_points(points: Vec<Point>, only: &[String]) -> Result<Vec<Point>> {
    if only.is_empty() {
        return Ok(points);
    }
    if let Some(unknown) = only.iter().find(|n| !points.iter().any(|p| &p.name == *n)) {
        let names: Vec<&str> = points.iter().map(|p| p.name.as_str()).collect();
        bail!(
            "no point `{unknown}` in this sweep; its points are {}",
            names.join(", ")
        );
    }
    Ok(points
        .into_iter()
        .filter(|p| only.contains(&p.name))
        .collect())
}

/// The policies to compare: `--policies` when given (checked), else the defaults.
pub fn policies(chosen: &[String], quick: bool) -> Result<Vec<String>> {
    if chosen.is_empty() {
        let defaults = if quick { QUICK_POLICIES } else { ALL_POLICIES };
        return Ok(defaults.iter().map(|s| s.to_string()).collect());
    }
    let mut out: Vec<String> = Vec::new();
    for p in chosen {
        if !ALL_POLICIES.contains(&p.as_str()) {
            bail!("unknown policy `{p}`; known: {}", ALL_POLICIES.join(", "));
        }
        if !out.contains(p) {
            out.push(p.clone());
        }
    }
    Ok(out)
}

/// Whether a policy needs the engines' KV events.
pub fn needs_kv_events(policy: &str) -> bool {
    policy.starts_with("exact-residency")
}

/// Whether a policy keeps a believed index (takes the calibrated TTL and node cap).
pub fn uses_belief_index(policy: &str) -> bool {
    policy.starts_with("prefix-affinity")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(quick: bool) -> GridParams {
        GridParams {
            quick,
            users: 32,
            open_rate_rps: None,
            rates_rps: vec![],
            replicas: 5,
        }
    }

    #[test]
    fn pressure_grid_full_and_quick() {
        let full = points(SweepName::PressureGrid, &params(false)).unwrap();
        assert_eq!(full.len(), 12);
        assert_eq!(full[0].name, "ws0.25-s0");
        assert!(full.iter().any(|p| p.name == "ws8-s1.4"));
        assert!(
            full.iter()
                .all(|p| p.arrival == Arrival::Closed { users: 32 })
        );
        let quick = points(SweepName::PressureGrid, &params(true)).unwrap();
        let names: Vec<&str> = quick.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["ws1-s0", "ws1-s1.4", "ws3-s0", "ws3-s1.4"]);
    }

    #[test]
    fn open_loop_and_axes() {
        let mut p = params(false);
        p.open_rate_rps = Some(4.0);
        let open = points(SweepName::PressureGrid, &p).unwrap();
        assert_eq!(open[0].name, "ws0.25-s0-rate4");
        p.open_rate_rps = Some(-1.0);
        assert!(points(SweepName::PressureGrid, &p).is_err());
        let load = points(SweepName::Load, &params(false)).unwrap();
        assert_eq!(load.len(), 5);
        assert!(load.iter().all(|p| p.ratio == 1.0 && p.zipf_s == 0.0));
        assert_eq!(load[1].name, "ws1-s0-rate4");
        let turns = points(SweepName::Turns, &params(true)).unwrap();
        assert_eq!(turns[1].turns, 6);
        assert_eq!(turns[1].name, "ws1-s0-t6");
        let prompts = points(SweepName::PromptLength, &params(false)).unwrap();
        assert_eq!(prompts[0].prefix_tokens, 275);
    }

    #[test]
    fn policy_choice_is_checked() {
        assert_eq!(policies(&[], false).unwrap().len(), 9);
        assert_eq!(policies(&[], true).unwrap(), QUICK_POLICIES);
        let chosen = policies(&["prefix-hash".into(), "prefix-hash".into()], false).unwrap();
        assert_eq!(chosen, ["prefix-hash"]);
        let err = policies(&["fastest".into()], false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("fastest") && err.contains("round-robin"));
        assert!(needs_kv_events("exact-residency-spec"));
        assert!(!needs_kv_events("prefix-affinity"));
        assert!(uses_belief_index("prefix-affinity-spill-off"));
    }

    #[test]
    fn every_policy_is_one_the_policies_crate_builds() {
        let mut ours = ALL_POLICIES.to_vec();
        let mut theirs = policies::POLICY_NAMES.to_vec();
        ours.sort_unstable();
        theirs.sort_unstable();
        assert_eq!(ours, theirs);
        assert!(QUICK_POLICIES.iter().all(|p| ALL_POLICIES.contains(p)));
    }

    #[test]
    fn points_are_selected_by_name() {
        let grid = || points(SweepName::PressureGrid, &params(true)).unwrap();
        assert_eq!(select_points(grid(), &[]).unwrap().len(), 4);
        let one = select_points(grid(), &["ws3-s0".to_string()]).unwrap();
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].ratio, 3.0);
        let err = select_points(grid(), &["ws9-s0".to_string()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("ws9-s0") && err.contains("ws1-s0"), "{err}");
    }
}
