//! Sweep definitions: the points of each sweep (working set × skew, the load axis, turns, prompt
//! length; full and quick variants) and the policies compared at them. Shared by the live and
//! the virtual sweep, so both run the same grid.

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};
use workload::spec::{DEFAULT_PREFIX_TOKENS, DEFAULT_PRIVATE_CONTEXT_TOKENS};
/// The workload options a sweep's flags choose, re-exported for `cargo xtask sweep`.
pub use workload::{PrefixGroups, Sharing};

/// The policies a full sweep compares by default, in the order it runs them (this order decides
/// the cells' order and the list in `sweep.json`): every policy the router knows but `random`
/// ([`EXTRA_POLICIES`]).
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

/// Policies a sweep runs only when named (`--policies`): `random`, the seeded uniform baseline,
/// added after the published grids (which it would otherwise change). With [`ALL_POLICIES`],
/// every name the router knows (`policies::POLICY_NAMES`, tested).
pub const EXTRA_POLICIES: &[&str] = &["random"];

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

/// The workload options every point of a sweep shares: prefix groups and conversation sharing.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct WorkloadShape {
    /// Shared prefixes (`None`: every context private, the workload before prefix groups).
    pub prefix_groups: Option<PrefixGroups>,
    /// Whether several users may send turns of one conversation at once.
    pub sharing: Sharing,
}

impl WorkloadShape {
    /// The sweeps' default workload: [`PrefixGroups::DEFAULT`] (16 groups sharing 2,048-token
    /// prefixes, membership skew 1; why in `crates/workload/README.md`, "Prefix groups"),
    /// exclusive conversations.
    pub const DEFAULT: WorkloadShape = WorkloadShape {
        prefix_groups: Some(PrefixGroups::DEFAULT),
        sharing: Sharing::Exclusive,
    };

    /// The workload before prefix groups (`--prefix-groups 0`): private contexts, exclusive.
    pub const PRIVATE: WorkloadShape = WorkloadShape {
        prefix_groups: None,
        sharing: Sharing::Exclusive,
    };

    /// The context at turn 1 a point has unless it varies it: 512 private tokens after the
    /// group's shared prefix with groups, the whole 1,100-token context without (so that
    /// `--prefix-groups 0` gives back the old workload, name and bytes).
    pub fn context_tokens(&self) -> u32 {
        if self.prefix_groups.is_some() {
            DEFAULT_PRIVATE_CONTEXT_TOKENS
        } else {
            DEFAULT_PREFIX_TOKENS
        }
    }
}

impl Default for WorkloadShape {
    fn default() -> Self {
        WorkloadShape::DEFAULT
    }
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
    /// Context at turn 1, tokens: with prefix groups, the private context after the shared
    /// prefix.
    pub prefix_tokens: u32,
    /// Shared prefixes (`None`: every context private).
    pub prefix_groups: Option<PrefixGroups>,
    /// Whether several users may send turns of one conversation at once.
    pub sharing: Sharing,
    /// Arrival process.
    pub arrival: Arrival,
    /// The fraction of the calibrated capacity the open-loop rate is (`--load`); `None` for a
    /// closed loop or a rate given in req/s.
    #[serde(default)]
    pub load_fraction: Option<f64>,
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
    /// Replicas in use (scales the `load` sweep's absolute rates when no `--load` is asked for).
    pub replicas: usize,
    /// Open loop at fractions of the calibrated capacity (`--load`); `None` for the explicit
    /// closed loop (`--users`) or absolute rates (`--open-loop --rate`, `--rates`).
    pub load: Option<LoadAxis>,
    /// Prefix groups and sharing of every point.
    pub workload: WorkloadShape,
}

/// The `--load` axis: open-loop rates at fractions of the fleet's capacity.
///
/// Open loop, not closed: a closed loop's offered load depends on the latency it measures (its
/// users wait for each reply, so a slower policy is offered less work), while an open loop sends
/// the plan's Poisson schedule whatever the fleet does — one rate is the same offered load for
/// every policy, and a fraction above 1 really offers more than the fleet can serve.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadAxis {
    /// Fractions of the capacity; empty: the sweep's default ([`default_load_fractions`]).
    pub fractions: Vec<f64>,
    /// The calibrated capacity, requests per second of model time; `None` when the calibration
    /// has none (then the points cannot be built).
    pub capacity_rps: Option<f64>,
}

/// `--load` for the pressure grid, turns and prompt-length sweeps: at the capacity.
pub const DEFAULT_LOAD_FRACTIONS: &[f64] = &[1.0];

/// The `load` sweep's fractions: six rates from half to one and a half times the capacity, two
/// below it, the two either side of it, two well above.
pub const LOAD_SWEEP_FRACTIONS: &[f64] = &[0.5, 0.7, 0.9, 1.1, 1.3, 1.5];

/// The `load` sweep's fractions with `--quick`: below, at and above the capacity.
pub const QUICK_LOAD_SWEEP_FRACTIONS: &[f64] = &[0.5, 1.0, 1.5];

/// The fractions a sweep runs when `--load` is not given.
pub fn default_load_fractions(name: SweepName, quick: bool) -> &'static [f64] {
    match (name, quick) {
        (SweepName::Load, false) => LOAD_SWEEP_FRACTIONS,
        (SweepName::Load, true) => QUICK_LOAD_SWEEP_FRACTIONS,
        _ => DEFAULT_LOAD_FRACTIONS,
    }
}

/// A load fraction as point names write it: at least one decimal (`1.0`, `0.7`, `0.75`).
pub fn fmt_fraction(x: f64) -> String {
    let one = format!("{x:.1}");
    if one.parse::<f64>() == Ok(x) {
        one
    } else {
        format!("{x}")
    }
}

fn fmt(x: f64) -> String {
    format!("{x}")
}

/// One arrival choice of a sweep: the process, the load fraction it stands for, and the suffix
/// it adds to point names.
struct Load {
    arrival: Arrival,
    fraction: Option<f64>,
    suffix: String,
}

/// The arrivals `p` asks for: one per `--load` fraction, else the closed loop or the absolute
/// open-loop rate.
fn loads(name: SweepName, p: &GridParams) -> Result<Vec<Load>> {
    let Some(axis) = &p.load else {
        let arrival = match p.open_rate_rps {
            Some(rate) if rate > 0.0 && rate.is_finite() => Arrival::Open { rate_rps: rate },
            Some(rate) => {
                bail!("--rate must be a positive number of requests per second, got {rate}")
            }
            None if p.users == 0 => bail!("--users must be at least 1"),
            None => Arrival::Closed { users: p.users },
        };
        let suffix = match arrival {
            Arrival::Open { rate_rps } => format!("-rate{}", fmt(rate_rps)),
            Arrival::Closed { .. } | Arrival::Trace { .. } => String::new(),
        };
        return Ok(vec![Load {
            arrival,
            fraction: None,
            suffix,
        }]);
    };
    let fractions: &[f64] = if axis.fractions.is_empty() {
        default_load_fractions(name, p.quick)
    } else {
        &axis.fractions
    };
    if let Some(bad) = fractions.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
        bail!("--load takes positive fractions of the capacity, got {bad}");
    }
    let Some(capacity) = axis.capacity_rps else {
        bail!(
            "--load runs at fractions of the fleet's capacity, and the calibration has none; run `cargo xtask calibrate` (it finds the capacity) with this sweep's fleet flags, or run closed loop with --users N"
        );
    };
    let mut out: Vec<Load> = Vec::new();
    for &f in fractions {
        if out.iter().any(|l| l.fraction == Some(f)) {
            continue;
        }
        out.push(Load {
            arrival: Arrival::Open {
                rate_rps: crate::capacity::round_rate(f * capacity),
            },
            fraction: Some(f),
            suffix: format!("-load{}", fmt_fraction(f)),
        });
    }
    Ok(out)
}

/// The points of sweep `name`: its axis (working set × skew, turns, prompt length, or for `load`
/// the load itself) × the arrivals asked for (`--load` fractions of the capacity, each a point
/// named `-load<f>`; or the closed loop / an absolute rate, the earlier naming).
///
/// Every sweep runs `p.workload` (the point names do not say which: the workload name in each
/// `meta.json` does).
pub fn points(name: SweepName, p: &GridParams) -> Result<Vec<Point>> {
    let turns = workload::spec::DEFAULT_TURNS;
    let prefix = p.workload.context_tokens();
    let point = |ratio: f64, zipf_s: f64, turns, prefix_tokens, arrival, suffix: &str| Point {
        name: format!("ws{}-s{}{suffix}", fmt(ratio), fmt(zipf_s)),
        ratio,
        zipf_s,
        turns,
        prefix_tokens,
        prefix_groups: p.workload.prefix_groups,
        sharing: p.workload.sharing,
        arrival,
        load_fraction: None,
    };
    let with_load = |mut pt: Point, load: &Load| {
        pt.load_fraction = load.fraction;
        pt
    };
    Ok(match name {
        SweepName::PressureGrid => {
            let (ratios, skews): (&[f64], &[f64]) = if p.quick {
                (&[1.0, 3.0], &[0.0, 1.4])
            } else {
                (&[0.25, 1.0, 3.0, 8.0], &[0.0, 1.0, 1.4])
            };
            let loads = loads(name, p)?;
            let mut out = Vec::new();
            for &r in ratios {
                for &s in skews {
                    for l in &loads {
                        out.push(with_load(
                            point(r, s, turns, prefix, l.arrival, &l.suffix),
                            l,
                        ));
                    }
                }
            }
            out
        }
        SweepName::Load if p.load.is_some() => loads(name, p)?
            .iter()
            .map(|l| with_load(point(1.0, 0.0, turns, prefix, l.arrival, &l.suffix), l))
            .collect(),
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
            let loads = loads(name, p)?;
            all.iter()
                .flat_map(|&t| {
                    loads.iter().map(move |l| {
                        with_load(
                            point(
                                1.0,
                                0.0,
                                t,
                                prefix,
                                l.arrival,
                                &format!("-t{t}{}", l.suffix),
                            ),
                            l,
                        )
                    })
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
            let loads = loads(name, p)?;
            all.iter()
                .flat_map(|&len| {
                    loads.iter().map(move |l| {
                        with_load(
                            point(
                                1.0,
                                0.0,
                                turns,
                                len,
                                l.arrival,
                                &format!("-p{len}{}", l.suffix),
                            ),
                            l,
                        )
                    })
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
        if !ALL_POLICIES.contains(&p.as_str()) && !EXTRA_POLICIES.contains(&p.as_str()) {
            bail!(
                "unknown policy `{p}`; known: {}, {}",
                ALL_POLICIES.join(", "),
                EXTRA_POLICIES.join(", ")
            );
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
            load: None,
            workload: WorkloadShape::default(),
        }
    }

    #[test]
    fn the_default_workload_has_prefix_groups_and_the_old_one_stays_reachable() {
        let grouped = points(SweepName::PressureGrid, &params(false)).unwrap();
        assert!(grouped.iter().all(|p| {
            p.prefix_groups == Some(PrefixGroups::DEFAULT)
                && p.prefix_tokens == 512
                && p.sharing == Sharing::Exclusive
        }));
        let mut old = params(false);
        old.workload = WorkloadShape::PRIVATE;
        let plain = points(SweepName::PressureGrid, &old).unwrap();
        assert!(
            plain
                .iter()
                .all(|p| p.prefix_groups.is_none() && p.prefix_tokens == 1_100)
        );
        // Same point names either way; the workload names differ.
        let names = |ps: &[Point]| ps.iter().map(|p| p.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(&grouped), names(&plain));
        let mut shared = params(true);
        shared.workload.sharing = Sharing::Shared;
        let turns = points(SweepName::Turns, &shared).unwrap();
        assert!(turns.iter().all(|p| p.sharing == Sharing::Shared));
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
    fn the_load_axis_names_points_by_their_fraction_of_the_capacity() {
        let axis = |fractions: &[f64], capacity: Option<f64>| {
            let mut p = params(false);
            p.load = Some(LoadAxis {
                fractions: fractions.to_vec(),
                capacity_rps: capacity,
            });
            p
        };
        // The default: every point at the capacity, open loop, named by the fraction.
        let grid = points(SweepName::PressureGrid, &axis(&[], Some(6.4))).unwrap();
        assert_eq!(grid.len(), 12);
        assert_eq!(grid[0].name, "ws0.25-s0-load1.0");
        assert!(
            grid.iter()
                .all(|p| p.arrival == Arrival::Open { rate_rps: 6.4 }
                    && p.load_fraction == Some(1.0))
        );
        // Three fractions: three points per cell of the grid, rates rounded to 0.001 req/s.
        let three = points(SweepName::PressureGrid, &axis(&[0.7, 1.0, 1.3], Some(6.4))).unwrap();
        assert_eq!(three.len(), 36);
        let names: Vec<&str> = three[..3].iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "ws0.25-s0-load0.7",
                "ws0.25-s0-load1.0",
                "ws0.25-s0-load1.3"
            ]
        );
        assert_eq!(three[0].arrival, Arrival::Open { rate_rps: 4.48 });
        assert_eq!(three[2].arrival, Arrival::Open { rate_rps: 8.32 });
        let turns = points(SweepName::Turns, &axis(&[0.75], Some(4.0))).unwrap();
        assert_eq!(turns[0].name, "ws1-s0-t2-load0.75");
        assert_eq!(turns[0].arrival, Arrival::Open { rate_rps: 3.0 });
        let prompts = points(SweepName::PromptLength, &axis(&[1.3], Some(4.0))).unwrap();
        assert_eq!(prompts[3].name, "ws1-s0-p2200-load1.3");
        // The load sweep: six rates from 0.5× to 1.5× by default, three with --quick.
        let load = points(SweepName::Load, &axis(&[], Some(10.0))).unwrap();
        let fractions: Vec<f64> = load.iter().filter_map(|p| p.load_fraction).collect();
        assert_eq!(fractions, LOAD_SWEEP_FRACTIONS);
        assert!(fractions.len() >= 6 && fractions[0] == 0.5 && fractions[5] == 1.5);
        assert_eq!(load[0].name, "ws1-s0-load0.5");
        assert_eq!(load[5].arrival, Arrival::Open { rate_rps: 15.0 });
        let mut quick = axis(&[], Some(10.0));
        quick.quick = true;
        assert_eq!(points(SweepName::Load, &quick).unwrap().len(), 3);
        // Without a capacity the points cannot be built, and the error names the command.
        let err = points(SweepName::PressureGrid, &axis(&[], None))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("cargo xtask calibrate") && err.contains("--users"),
            "{err}"
        );
        assert!(points(SweepName::Load, &axis(&[0.0], Some(4.0))).is_err());
        // The earlier forms stay: closed loop (no `-load`), --rates for the load sweep.
        let closed = points(SweepName::PressureGrid, &params(false)).unwrap();
        assert!(closed.iter().all(|p| p.load_fraction.is_none()));
        let mut rates = params(false);
        rates.rates_rps = vec![2.0, 4.0];
        assert_eq!(
            points(SweepName::Load, &rates).unwrap()[1].name,
            "ws1-s0-rate4"
        );
        assert_eq!(fmt_fraction(1.0), "1.0");
        assert_eq!(fmt_fraction(0.75), "0.75");
        assert_eq!(fmt_fraction(2.0), "2.0");
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
        let mut ours = [ALL_POLICIES, EXTRA_POLICIES].concat();
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
