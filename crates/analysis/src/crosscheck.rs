//! Live vs virtual: the same sweep run through real processes and through the simulator, cell by
//! cell and effect by effect.
//!
//! The simulator is only worth its speed if it reproduces what the live fleet measures at the
//! resolution the project reports: the policy effects are 1–7% of goodput, so a cross-check that
//! passes at 10% says nothing about them. Two reports are compared on:
//! - each cell (point × policy): goodput, SLO attainment, TTFT p90 and the engines' prefix-hit
//!   rate, live median against virtual median;
//! - each effect: every policy's relative goodput margin over the baseline at a point, live
//!   against virtual — the quantity the published comparisons state.
//!
//! Unlike cells are refused, never compared: the two reports must hold the same plan and the same
//! SLO at a point (a virtual sweep calibrated on its own would judge against other bounds; run it
//! with the live sweep's `calibration.json`).
//!
//! A difference is judged at the tolerance or at the cell's resolution, whichever is wider: the
//! resolution is the larger of the two sides' repetition ranges (max − min). A cell whose own
//! repetitions spread wider than the tolerance cannot be called different at that tolerance —
//! prefix-affinity near capacity is such a cell: its load-tie decisions turn microseconds of
//! timing into different placements, and its virtual repetitions alone (seeds only) spread 4.8%
//! of goodput at ws3-s0-rate3 on the quick fleet (2 Dec 2026). The resolution is reported beside
//! every verdict; with one repetition a side it is zero and the tolerance alone judges.

use serde::Serialize;

use crate::report::{Cell, Point, Report};

/// How close live and virtual must be to agree.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Tolerance {
    /// Largest |live − virtual| ÷ virtual of a cell's median goodput.
    pub goodput_rel: f64,
    /// Largest |live − virtual| of a cell's median SLO attainment (a share, 0–1).
    pub attainment_abs: f64,
    /// Largest |live − virtual| of an effect: a policy's relative goodput margin over the
    /// baseline (shares of the baseline's goodput).
    pub effect_abs: f64,
}

impl Tolerance {
    /// The size of the effects the project reports (docs/results.md: 1–7% of goodput): 3% of
    /// goodput, 3 points of attainment, 3 points of margin. A cross-check looser than the smallest
    /// effect it vouches for would pass a simulator that gets every conclusion wrong.
    pub const EFFECT_SIZED: Tolerance = Tolerance {
        goodput_rel: 0.03,
        attainment_abs: 0.03,
        effect_abs: 0.03,
    };
}

/// One cell, live against virtual (medians over repetitions).
#[derive(Debug, Clone, Serialize)]
pub struct CellCheck {
    /// Point name.
    pub point: String,
    /// Policy.
    pub policy: String,
    /// Live goodput median, req/s.
    pub live_goodput_rps: f64,
    /// Live goodput range (min, max) over repetitions.
    pub live_goodput_range_rps: (f64, f64),
    /// Virtual goodput median, req/s.
    pub virtual_goodput_rps: f64,
    /// (live − virtual) ÷ virtual.
    pub goodput_rel_diff: Option<f64>,
    /// Live SLO attainment median.
    pub live_attainment: Option<f64>,
    /// Virtual SLO attainment median.
    pub virtual_attainment: Option<f64>,
    /// Live TTFT p90 median, ms.
    pub live_ttft_p90_ms: Option<f64>,
    /// Virtual TTFT p90 median, ms.
    pub virtual_ttft_p90_ms: Option<f64>,
    /// Live engine prefix-hit rate median.
    pub live_hit_rate: Option<f64>,
    /// Virtual engine prefix-hit rate median.
    pub virtual_hit_rate: Option<f64>,
    /// The cell's goodput resolution: the larger of the live and virtual repetition ranges
    /// (max − min), ÷ the virtual median.
    pub goodput_resolution_rel: f64,
    /// The cell's attainment resolution: the larger of the two sides' repetition ranges.
    pub attainment_resolution_abs: f64,
    /// Goodput within max(tolerance, resolution) and attainment within max(tolerance,
    /// resolution).
    pub agrees: bool,
}

/// One effect: a policy's relative margin over the baseline at a point, live against virtual.
#[derive(Debug, Clone, Serialize)]
pub struct EffectCheck {
    /// Point name.
    pub point: String,
    /// The policy.
    pub policy: String,
    /// The baseline it is measured against.
    pub baseline: String,
    /// Live margin ÷ live baseline median.
    pub live_rel: f64,
    /// Virtual margin ÷ virtual baseline median.
    pub virtual_rel: f64,
    /// The bound it was judged at: the tolerance, or the two cells' goodput resolutions carried
    /// into the margin when that is wider: (1 + virtual margin) × √(policy² + baseline²).
    pub bound_abs: f64,
    /// The virtual effect is larger than that bound: agreement vouches for its size. When not,
    /// agreement says only that both sides find the effect small.
    pub resolved: bool,
    /// |live − virtual| within the bound.
    pub agrees: bool,
    /// Both have the same sign, or one of them is within the bound of zero.
    pub same_direction: bool,
}

/// A point that could not be compared, and why.
#[derive(Debug, Clone, Serialize)]
pub struct Refused {
    /// Point name.
    pub point: String,
    /// What differs (or is missing).
    pub reason: String,
}

/// The whole cross-check.
#[derive(Debug, Clone, Serialize)]
pub struct Crosscheck {
    /// The bounds it was judged by.
    pub tolerance: Tolerance,
    /// The baseline policy of the effects.
    pub baseline: String,
    /// Cells compared.
    pub cells: Vec<CellCheck>,
    /// Effects compared.
    pub effects: Vec<EffectCheck>,
    /// Points not compared.
    pub refused: Vec<Refused>,
}

impl Crosscheck {
    /// Every cell and every effect agrees and nothing was refused.
    pub fn passes(&self) -> bool {
        self.refused.is_empty()
            && !self.cells.is_empty()
            && self.cells.iter().all(|c| c.agrees)
            && self.effects.iter().all(|e| e.agrees)
    }

    /// The largest |goodput difference| over cells, relative to virtual.
    pub fn worst_goodput_rel_diff(&self) -> Option<f64> {
        self.cells
            .iter()
            .filter_map(|c| c.goodput_rel_diff.map(f64::abs))
            .max_by(f64::total_cmp)
    }

    /// The widest goodput resolution over cells (0 with one repetition a side): the smallest
    /// goodput difference this cross-check could call a disagreement.
    pub fn worst_goodput_resolution_rel(&self) -> f64 {
        self.cells
            .iter()
            .map(|c| c.goodput_resolution_rel)
            .fold(0.0, f64::max)
    }
}

fn goodput(c: &Cell) -> Option<(f64, f64, f64)> {
    c.goodput_rps.as_ref().map(|s| (s.median, s.min, s.max))
}

/// max − min of a spread over repetitions (0 when absent).
fn range(s: &Option<crate::stats::Spread>) -> f64 {
    s.as_ref().map_or(0.0, |s| s.max - s.min)
}

fn median(s: &Option<crate::stats::Spread>) -> Option<f64> {
    s.as_ref().map(|s| s.median)
}

fn hit_rate(c: &Cell) -> Option<f64> {
    median(&c.mechanism.all.prefix_hit_rate)
}

fn comparable(live: &Point, virt: &Point) -> Result<(), String> {
    if live.plan_fingerprint != virt.plan_fingerprint {
        return Err(format!(
            "plan_fingerprint differs: live {}, virtual {} (the plans differ; a plan's \
             fingerprint hashes its format byte, so plans written before and after a plan \
             format change — workload::PLAN_FORMAT — never match: run both sides with one format)",
            live.plan_fingerprint, virt.plan_fingerprint
        ));
    }
    if live.slo != virt.slo {
        return Err(format!(
            "SLO differs: live TTFT {} ms / ITL {} ms, virtual TTFT {} ms / ITL {} ms \
             (run the virtual sweep with the live sweep's calibration.json)",
            live.slo.ttft_ms, live.slo.itl_ms, virt.slo.ttft_ms, virt.slo.itl_ms
        ));
    }
    if live.window_clock != virt.window_clock {
        return Err(format!(
            "window clock differs: live {:?}, virtual {:?} (one side was measured by send time, \
             the other by scheduled time; re-report the older sweep)",
            live.window_clock, virt.window_clock
        ));
    }
    if live.virtual_time || !virt.virtual_time {
        return Err("the first report must be live and the second virtual".into());
    }
    Ok(())
}

/// Compares a live report with a virtual one point by point; effects are margins over `baseline`.
pub fn crosscheck(live: &Report, virt: &Report, baseline: &str, tol: Tolerance) -> Crosscheck {
    let mut out = Crosscheck {
        tolerance: tol,
        baseline: baseline.to_string(),
        cells: Vec::new(),
        effects: Vec::new(),
        refused: Vec::new(),
    };
    for lp in &live.points {
        let Some(vp) = virt.points.iter().find(|p| p.point == lp.point) else {
            out.refused.push(Refused {
                point: lp.point.clone(),
                reason: "no such point in the virtual report".into(),
            });
            continue;
        };
        if let Err(reason) = comparable(lp, vp) {
            out.refused.push(Refused {
                point: lp.point.clone(),
                reason,
            });
            continue;
        }
        let mut pairs = Vec::new();
        for lc in &lp.cells {
            let Some(vc) = vp.cells.iter().find(|c| c.policy == lc.policy) else {
                out.refused.push(Refused {
                    point: lp.point.clone(),
                    reason: format!("{}: no virtual cell", lc.policy),
                });
                continue;
            };
            let (Some(lg), Some(vg)) = (goodput(lc), goodput(vc)) else {
                out.refused.push(Refused {
                    point: lp.point.clone(),
                    reason: format!("{}: no accepted repetition on one side", lc.policy),
                });
                continue;
            };
            let rel = (vg.0 != 0.0).then(|| (lg.0 - vg.0) / vg.0);
            let goodput_resolution_rel = if vg.0 != 0.0 {
                range(&lc.goodput_rps).max(range(&vc.goodput_rps)) / vg.0
            } else {
                0.0
            };
            let attainment_resolution_abs =
                range(&lc.slo_attainment).max(range(&vc.slo_attainment));
            let (la, va) = (median(&lc.slo_attainment), median(&vc.slo_attainment));
            let attainment_ok = match (la, va) {
                (Some(a), Some(b)) => {
                    (a - b).abs() <= tol.attainment_abs.max(attainment_resolution_abs)
                }
                _ => false,
            };
            out.cells.push(CellCheck {
                point: lp.point.clone(),
                policy: lc.policy.clone(),
                live_goodput_rps: lg.0,
                live_goodput_range_rps: (lg.1, lg.2),
                virtual_goodput_rps: vg.0,
                goodput_rel_diff: rel,
                live_attainment: la,
                virtual_attainment: va,
                live_ttft_p90_ms: median(&lc.ttft_p90_ms),
                virtual_ttft_p90_ms: median(&vc.ttft_p90_ms),
                live_hit_rate: hit_rate(lc),
                virtual_hit_rate: hit_rate(vc),
                goodput_resolution_rel,
                attainment_resolution_abs,
                agrees: rel.is_some_and(|r| r.abs() <= tol.goodput_rel.max(goodput_resolution_rel))
                    && attainment_ok,
            });
            pairs.push((lc.policy.clone(), lg.0, vg.0, goodput_resolution_rel));
        }
        let Some(&(_, lb, vb, base_resolution)) = pairs.iter().find(|p| p.0 == baseline) else {
            continue;
        };
        if lb == 0.0 || vb == 0.0 {
            continue;
        }
        for (policy, lg, vg, resolution) in pairs.iter().filter(|p| p.0 != baseline) {
            let (l, v) = ((lg - lb) / lb, (vg - vb) / vb);
            // The margin is g/b − 1: relative uncertainties of g and b carry into it scaled by
            // g/b, combined as independent (root sum of squares).
            let carried = (1.0 + v).abs() * resolution.hypot(base_resolution);
            let bound = tol.effect_abs.max(carried);
            out.effects.push(EffectCheck {
                point: lp.point.clone(),
                policy: policy.clone(),
                baseline: baseline.to_string(),
                live_rel: l,
                virtual_rel: v,
                bound_abs: bound,
                resolved: v.abs() > bound,
                agrees: (l - v).abs() <= bound,
                same_direction: l * v >= 0.0 || l.abs() <= bound || v.abs() <= bound,
            });
        }
    }
    out
}

fn pct(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{:+.1}%", v * 100.0))
}

fn share(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{:.1}%", v * 100.0))
}

fn ms(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{v:.0}"))
}

/// The cross-check as markdown: the cells table, the effects table, refusals, the verdict.
pub fn render_markdown(c: &Crosscheck) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let t = &c.tolerance;
    let _ = writeln!(
        s,
        "Agreement bounds: goodput within {:.0}% of virtual, attainment within {:.0} points, \
         each policy's margin over {} within {:.0} points — or within the cell's resolution \
         (the wider of the two sides' repetition ranges) where that is wider.\n",
        t.goodput_rel * 100.0,
        t.attainment_abs * 100.0,
        c.baseline,
        t.effect_abs * 100.0
    );
    s.push_str("| point | policy | goodput live (range) | virtual | live − virtual | resolution | attainment live / virtual | TTFT p90 ms live / virtual | hit rate live / virtual | agrees |\n");
    s.push_str("|---|---|---:|---:|---:|---:|---:|---:|---:|:---:|\n");
    for x in &c.cells {
        let _ = writeln!(
            s,
            "| {} | {} | {:.3} ({:.3}–{:.3}) | {:.3} | {} | {:.1}% | {} / {} | {} / {} | {} / {} | {} |",
            x.point,
            x.policy,
            x.live_goodput_rps,
            x.live_goodput_range_rps.0,
            x.live_goodput_range_rps.1,
            x.virtual_goodput_rps,
            pct(x.goodput_rel_diff),
            x.goodput_resolution_rel * 100.0,
            share(x.live_attainment),
            share(x.virtual_attainment),
            ms(x.live_ttft_p90_ms),
            ms(x.virtual_ttft_p90_ms),
            share(x.live_hit_rate),
            share(x.virtual_hit_rate),
            if x.agrees { "yes" } else { "**no**" }
        );
    }
    if !c.effects.is_empty() {
        s.push_str("\n| point | effect | live | virtual | judged within | resolved | same direction | agrees |\n|---|---|---:|---:|---:|:---:|:---:|:---:|\n");
        for e in &c.effects {
            let _ = writeln!(
                s,
                "| {} | {} vs {} | {} | {} | {:.1} points | {} | {} | {} |",
                e.point,
                e.policy,
                e.baseline,
                pct(Some(e.live_rel)),
                pct(Some(e.virtual_rel)),
                e.bound_abs * 100.0,
                if e.resolved {
                    "yes"
                } else {
                    "no: within the bound of zero"
                },
                if e.same_direction { "yes" } else { "**no**" },
                if e.agrees { "yes" } else { "**no**" }
            );
        }
    }
    for r in &c.refused {
        let _ = writeln!(s, "\nRefused {}: {}", r.point, r.reason);
    }
    let _ = writeln!(
        s,
        "\nVerdict: {}{}",
        if c.passes() {
            "agrees"
        } else {
            "does not agree"
        },
        c.worst_goodput_rel_diff()
            .map_or(String::new(), |w| format!(
                " (largest goodput difference {:.1}%; widest cell resolution {:.1}%)",
                w * 100.0,
                c.worst_goodput_resolution_rel() * 100.0
            ))
    );
    s
}

/// Analyses a live and a virtual sweep directory and cross-checks them; writes `crosscheck.md`
/// and `crosscheck.json` into `out`.
pub fn crosscheck_dirs(
    live: &std::path::Path,
    virt: &std::path::Path,
    baseline: &str,
    tol: Tolerance,
    out: &std::path::Path,
) -> crate::Result<Crosscheck> {
    let (c, files) = crosscheck_files(
        live,
        virt,
        &live.display().to_string(),
        &virt.display().to_string(),
        baseline,
        tol,
    )?;
    crate::output::write_files(out, &files)?;
    Ok(c)
}

/// Analyses a live and a virtual sweep directory and cross-checks them; returns the
/// cross-check and its files (`crosscheck.md` naming the two directories as `live_name` and
/// `virt_name`, then `crosscheck.json`) without writing them, so that a published cross-check can
/// be rebuilt and compared byte for byte from anywhere.
pub fn crosscheck_files(
    live: &std::path::Path,
    virt: &std::path::Path,
    live_name: &str,
    virt_name: &str,
    baseline: &str,
    tol: Tolerance,
) -> crate::Result<(Crosscheck, Vec<crate::OutputFile>)> {
    let cfg = crate::ReportConfig::default();
    let l = crate::analyze_dir(live, &cfg)?;
    let v = crate::analyze_dir(virt, &cfg)?;
    let c = crosscheck(&l, &v, baseline, tol);
    let md = format!(
        "# Live vs virtual\n\nLive: `{live_name}`. Virtual: `{virt_name}`.\n\n{}",
        render_markdown(&c)
    );
    let json = serde_json::to_vec_pretty(&c).expect("plain data serialises");
    let files = vec![
        crate::OutputFile {
            name: "crosscheck.md",
            bytes: md.into_bytes(),
        },
        crate::OutputFile {
            name: "crosscheck.json",
            bytes: json,
        },
    ];
    Ok((c, files))
}
