//! Renders a [`Report`] as Markdown: one table per point, its SLO attainment and latency, then
//! mechanism, belief, overhead, the adaptive-router test, and everything that was not analysed or
//! should be read with care.

use std::fmt::Write;

use crate::compare::Margin;
use crate::drift::DriftVerdict;
use crate::metrics::DecayBucket;
use crate::report::{Cell, PREFIX_AFFINITY, Point, Report, SESSION_AFFINITY};
use crate::stats::Spread;
use schema::ATTAINMENT_TARGET;

const DASH: &str = "—";

fn num(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| DASH.to_string(), |x| format!("{x:.decimals$}"))
}

fn pct(v: Option<f64>) -> String {
    v.map_or_else(|| DASH.to_string(), |x| format!("{:.1}%", x * 100.0))
}

fn spread(s: &Option<Spread>, decimals: usize) -> String {
    match s {
        Some(s) => format!(
            "{:.d$} [{:.d$}–{:.d$}]",
            s.median,
            s.min,
            s.max,
            d = decimals
        ),
        None => DASH.to_string(),
    }
}

fn median(s: &Option<Spread>) -> Option<f64> {
    s.map(|s| s.median)
}

fn margin_cell(m: Option<&Margin>) -> String {
    match m {
        Some(m) => {
            format!(
                "{:+.3} ({}) {}",
                m.margin_rps,
                m.relative
                    .map_or_else(|| DASH.to_string(), |r| format!("{:+.1}%", r * 100.0)),
                m.verdict.as_str()
            ) + if m.overloaded { " · overloaded" } else { "" }
        }
        None => DASH.to_string(),
    }
}

/// A cell's policy name, marked when it rests on an overloaded repetition.
fn policy_label(c: &Cell) -> String {
    if c.overloaded.is_empty() {
        c.policy.clone()
    } else {
        format!("{} (overloaded)", c.policy)
    }
}

fn pair(a: Option<f64>, b: Option<f64>, f: fn(Option<f64>) -> String) -> String {
    format!("{} / {}", f(a), f(b))
}

fn band(b: &DecayBucket) -> String {
    match b.upper_s {
        Some(u) => format!("{}–{} s", b.lower_s, u),
        None => format!("≥ {} s", b.lower_s),
    }
}

fn point_table(out: &mut String, p: &Point) {
    let _ = writeln!(out, "## Point `{}`\n", p.point);
    let _ = writeln!(
        out,
        "Workload `{}` · plan `{}` · SLO: TTFT < {} ms, ITL p50 < {} ms\n",
        p.workload_name, p.plan_fingerprint, p.slo.ttft_ms, p.slo.itl_ms
    );
    if p.below_pressure {
        let _ = writeln!(
            out,
            "**Below pressure:** every policy met its SLO on at least {:.0}% of measured requests here, so goodput restates the offered load; read this point as a latency comparison, not as what a policy buys under pressure.\n",
            ATTAINMENT_TARGET * 100.0
        );
    }
    out.push_str(
        "| policy | reps | goodput req/s median [min–max] | SLO attainment | vs session-affinity | vs prefix-affinity | TTFT p50 ms | hit rate | busiest share | spill rate | overhead p50 / p99 µs |\n",
    );
    out.push_str("|---|---|---|---|---|---|---|---|---|---|---|\n");
    for c in &p.cells {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} / {} |",
            policy_label(c),
            c.reps_used.len(),
            spread(&c.goodput_rps, 3),
            pct(median(&c.slo_attainment)),
            margin_cell(p.margin(&c.policy, SESSION_AFFINITY)),
            margin_cell(p.margin(&c.policy, PREFIX_AFFINITY)),
            num(median(&c.ttft_p50_ms), 1),
            pct(median(&c.mechanism.all.prefix_hit_rate)),
            pct(median(&c.mechanism.all.busiest_share)),
            pct(median(&c.mechanism.all.spill_rate)),
            num(median(&c.overhead_p50_us), 0),
            num(median(&c.overhead_p99_us), 0),
        );
    }
    out.push('\n');
    match (&p.winner, &p.runner_up, p.winner_verdict) {
        (Some(w), Some(r), Some(v)) => {
            let _ = writeln!(
                out,
                "**Winner:** {} ({:.3} req/s); runner-up {} ({:.3} req/s); the difference {}.\n",
                w.policy,
                w.goodput_median_rps,
                r.policy,
                r.goodput_median_rps,
                match v {
                    crate::compare::Verdict::Separates => "separates",
                    crate::compare::Verdict::WithinSpread => "is within spread",
                    crate::compare::Verdict::TooFewReps => "rests on too few reps to judge",
                    crate::compare::Verdict::Deterministic =>
                        "is deterministic (virtual: no measured spread to judge it against)",
                }
            );
        }
        (Some(w), _, _) => {
            let _ = writeln!(
                out,
                "**Winner:** {} ({:.3} req/s); no runner-up.\n",
                w.policy, w.goodput_median_rps
            );
        }
        _ => out.push_str("No policy has goodput at this point.\n\n"),
    }
    for c in &p.cells {
        notes(out, c);
    }
    let skipped: Vec<String> = p
        .cells
        .iter()
        .flat_map(|c| {
            c.drift
                .iter()
                .filter(|d| d.verdict.skipped.is_some())
                .map(move |d| format!("{}/rep-{}", c.policy, d.rep))
        })
        .collect();
    if let Some(any) = p.cells.iter().flat_map(|c| &c.drift).next()
        && !skipped.is_empty()
    {
        let _ = writeln!(
            out,
            "Drift check not run on {} (fewer than {} measured requests each).\n",
            skipped.join(", "),
            any.verdict.config.min_requests
        );
    }
}

fn notes(out: &mut String, c: &Cell) {
    for s in &c.set_aside {
        let _ = writeln!(
            out,
            "- {}: rep-{} set aside ({}){}; the figures rest on {} repetition(s).",
            c.policy,
            s.rep,
            s.reason,
            match (s.goodput_rps, s.slo_attainment) {
                (Some(g), Some(a)) => format!(
                    "; not counted, it measured {g:.3} req/s at {:.1}% attainment",
                    a * 100.0
                ),
                (Some(g), None) => format!("; not counted, it measured {g:.3} req/s"),
                _ => String::new(),
            },
            c.reps_used.len()
        );
    }
    for o in &c.overloaded {
        let _ = writeln!(
            out,
            "- {}: rep-{} is overloaded ({}); it is counted — its goodput and attainment are what the policy delivers at this load — and marked.",
            c.policy, o.rep, o.reason
        );
    }
    let mut noted = !c.set_aside.is_empty() || !c.overloaded.is_empty();
    // Worsening repetitions first, then warming ones, each with the drift check's reason.
    type Note = (fn(&DriftVerdict) -> bool, &'static str, &'static str);
    let notes: [Note; 2] = [
        (
            DriftVerdict::worsening,
            "drifts for the worse by this report's drift check",
            "; it is counted — a longer warm-up would not settle it — and marked.",
        ),
        (
            |v| v.warming,
            "is flagged `warming` by this report's drift check",
            " but was accepted by the sweep.",
        ),
    ];
    for (applies, what, then) in notes {
        for d in c.drift.iter().filter(|d| applies(&d.verdict)) {
            noted = true;
            let why = d.verdict.reason.as_deref().unwrap_or("");
            let _ = writeln!(out, "- {}: rep-{} {what} ({why}){then}", c.policy, d.rep);
        }
    }
    if noted {
        out.push('\n');
    }
}

fn pct_spread(s: &Option<Spread>) -> String {
    match s {
        Some(s) => format!(
            "{:.1}% [{:.1}–{:.1}]",
            s.median * 100.0,
            s.min * 100.0,
            s.max * 100.0
        ),
        None => DASH.to_string(),
    }
}

fn slo_table(out: &mut String, p: &Point) {
    let _ = writeln!(
        out,
        "### SLO attainment and latency, `{}` (medians of repetitions; attainment with [min–max])\n",
        p.point
    );
    out.push_str("| policy | attainment | busiest replica's attainment | TTFT p50 / p90 / p99 ms | ITL p50 / p99 ms | missed: TTFT / ITL / error |\n");
    out.push_str("|---|---|---|---|---|---|\n");
    for c in &p.cells {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} / {} / {} | {} / {} | {} / {} / {} |",
            policy_label(c),
            pct_spread(&c.slo_attainment),
            pct_spread(&c.busiest_replica_attainment),
            num(median(&c.ttft_p50_ms), 1),
            num(median(&c.ttft_p90_ms), 1),
            num(median(&c.ttft_p99_ms), 1),
            num(median(&c.itl_p50_ms), 1),
            num(median(&c.itl_p99_ms), 1),
            pct(median(&c.missed_ttft_share)),
            pct(median(&c.missed_itl_share)),
            pct(median(&c.error_share)),
        );
    }
    out.push('\n');
}

fn mechanism_table(out: &mut String, p: &Point) {
    let _ = writeln!(
        out,
        "### Mechanism by turn, `{}` (first / later turns)\n",
        p.point
    );
    out.push_str("| policy | hit rate | new tokens per request | busiest share | spill rate | replicas per hot conversation (all) |\n");
    out.push_str("|---|---|---|---|---|---|\n");
    for c in &p.cells {
        let (f, l) = (&c.mechanism.first_turn, &c.mechanism.later_turns);
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            c.policy,
            pair(median(&f.prefix_hit_rate), median(&l.prefix_hit_rate), pct),
            pair(
                median(&f.new_tokens_per_request),
                median(&l.new_tokens_per_request),
                |v| num(v, 0)
            ),
            pair(median(&f.busiest_share), median(&l.busiest_share), pct),
            pair(median(&f.spill_rate), median(&l.spill_rate), pct),
            num(median(&c.mechanism.all.replicas_per_hot_conversation), 2),
        );
    }
    out.push('\n');
}

fn belief_tables(out: &mut String, p: &Point) {
    let cells: Vec<&Cell> = p
        .cells
        .iter()
        .filter(|c| c.divergence.compared > 0)
        .collect();
    if cells.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "### Belief divergence, `{}` (predicted vs engine-cached tokens; over and under never netted)\n",
        p.point
    );
    out.push_str("| policy | compared | exact | over: requests | over: tokens total / mean | under: requests | under: tokens total / mean | honoured share | implied TTL s | implied node cap |\n");
    out.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
    for c in &cells {
        let d = &c.divergence;
        let ttl = match c.implied.ttl_s {
            Some(t) if c.implied.ttl_is_lower_bound => format!("≥ {t}"),
            Some(t) => format!("{t}"),
            None => DASH.to_string(),
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} / {} | {} | {} / {} | {} | {} | {} |",
            c.policy,
            d.compared,
            d.exact,
            d.over.count,
            d.over.tokens_total,
            num(d.over.tokens_mean, 1),
            d.under.count,
            d.under.tokens_total,
            num(d.under.tokens_mean, 1),
            pct(c.implied.honoured_share),
            ttl,
            c.implied
                .node_cap
                .map_or_else(|| DASH.to_string(), |n| n.to_string()),
        );
    }
    out.push('\n');
    let _ = writeln!(
        out,
        "### Belief decay, `{}` (honoured share of predicted tokens by time since the session was last served; requests in brackets)\n",
        p.point
    );
    let mut header = String::from("| since last served |");
    let mut rule = String::from("|---|");
    for c in &cells {
        let _ = write!(header, " {} |", c.policy);
        rule.push_str("---|");
    }
    let _ = writeln!(out, "{header}\n{rule}");
    let cellf = |b: &DecayBucket| format!("{} ({})", pct(b.honoured_share), b.requests);
    let mut row = String::from("| never (first request) |");
    for c in &cells {
        let _ = write!(row, " {} |", cellf(&c.decay.unseen));
    }
    let _ = writeln!(out, "{row}");
    let bands = cells[0].decay.by_gap.len();
    for i in 0..bands {
        if cells.iter().all(|c| c.decay.by_gap[i].requests == 0) {
            continue;
        }
        let mut row = format!("| {} |", band(&cells[0].decay.by_gap[i]));
        for c in &cells {
            let _ = write!(row, " {} |", cellf(&c.decay.by_gap[i]));
        }
        let _ = writeln!(out, "{row}");
    }
    out.push('\n');
}

fn summary(out: &mut String, report: &Report) {
    if report.points.is_empty() {
        return;
    }
    out.push_str("## Summary\n\n");
    out.push_str("| point | winner | runner-up | winner vs runner-up | prefix-affinity vs session-affinity | pressure |\n");
    out.push_str("|---|---|---|---|---|---|\n");
    for p in &report.points {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            p.point,
            p.winner.as_ref().map_or(DASH, |w| w.policy.as_str()),
            p.runner_up.as_ref().map_or(DASH, |w| w.policy.as_str()),
            p.winner_verdict.map_or(DASH, |v| v.as_str()),
            margin_cell(p.margin(PREFIX_AFFINITY, SESSION_AFFINITY)),
            pressure_label(p),
        );
    }
    out.push('\n');
}

/// The summary's pressure column: below or under pressure, and which policies were overloaded.
fn pressure_label(p: &Point) -> String {
    let base = if p.below_pressure {
        "below pressure"
    } else {
        "under pressure"
    };
    let over: Vec<&str> = p
        .cells
        .iter()
        .filter(|c| !c.overloaded.is_empty())
        .map(|c| c.policy.as_str())
        .collect();
    if over.is_empty() {
        base.to_string()
    } else {
        format!("{base}; overloaded: {}", over.join(", "))
    }
}

/// The line naming the analysis rules a report or summary was built with (a paragraph), or
/// nothing for one written before reports named them.
pub fn rules_line(rules: &str) -> String {
    if rules.is_empty() {
        String::new()
    } else {
        format!(
            "Built from the rows with analysis rules `{rules}` (`analysis::RULES_VERSION`; `cargo xtask rebuild` checks that this file is what today's rules make of them).\n\n"
        )
    }
}

/// The report as Markdown.
pub fn render(report: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# Sweep `{}`\n", report.sweep);
    out.push_str(&rules_line(&report.rules));
    if let Some(p) = &report.in_progress {
        let list = |v: &[String]| {
            if v.is_empty() {
                "none".to_owned()
            } else {
                v.iter()
                    .map(|n| format!("`{n}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        };
        let _ = writeln!(
            out,
            "**In progress: {} of the {} repetitions `sweep.json` plans have finished.** What follows covers only those; resume with the sweep's own command. Partly run: {}. Not started: {}.\n",
            p.finished_reps,
            p.planned_reps,
            list(&p.points_partial),
            list(&p.points_not_started)
        );
    }
    let _ = writeln!(
        out,
        "Goodput = requests meeting the SLO (TTFT and per-request ITL p50 below their bounds, no error) in the measured window ÷ window length; an open loop's requests are placed in the window by their scheduled time and their TTFT counts from it (a turn that waited in the driver counts its wait), a closed loop's by their send time. Each figure is the median of repetitions with [min–max]; two policies *separate* when their ranges do not overlap, otherwise the difference is *within spread* (*too few reps* when either side rests on fewer than two repetitions).\n"
    );
    if report.points.iter().any(|p| p.virtual_time) {
        out.push_str("**Virtual time.** The simulator is deterministic given its seeds: a virtual repetition's [min–max] is the spread of its seeds, not measured noise, so a virtual difference is reported as *deterministic (virtual)*, never as separating or within spread.\n\n");
    }
    if report
        .points
        .iter()
        .any(|p| p.cells.iter().any(|c| !c.overloaded.is_empty()))
    {
        out.push_str("**Overloaded** marks a cell with a repetition whose drift is a backlog (requests scheduled and not yet finished) growing through the window, or the driver's queue alone (scheduled, not yet sent: at a skewed point, the hottest conversation's turns waiting behind each other), or a rising TTFT trend that is mostly the wait in the driver: the offered load is not sustained there. Such a repetition is counted, not set aside — its goodput and attainment are the result — and every comparison resting on it is marked.\n\n");
    }
    summary(&mut out, report);
    for p in &report.points {
        point_table(&mut out, p);
        slo_table(&mut out, p);
        mechanism_table(&mut out, p);
        belief_tables(&mut out, p);
    }
    if !report.overhead_by_policy.is_empty() {
        out.push_str("## Router overhead per policy (all measured requests)\n\n");
        out.push_str("| policy | requests | overhead p50 µs | overhead p99 µs | decide p50 ns | decide p99 ns | tokenize p50 ms |\n");
        out.push_str("|---|---|---|---|---|---|---|\n");
        for o in &report.overhead_by_policy {
            let v = &o.overhead;
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} |",
                o.policy,
                v.requests,
                num(v.overhead_p50_us, 0),
                num(v.overhead_p99_us, 0),
                num(v.decide_p50_ns, 0),
                num(v.decide_p99_ns, 0),
                num(v.tokenize_p50_ms, 1)
            );
        }
        out.push('\n');
    }
    out.push_str("## Adaptive-router test\n\n");
    let _ = writeln!(out, "{}\n", report.adaptive_router_test.statement);
    if !report.refused.is_empty() {
        out.push_str("## Refused points (not comparable, not tabulated)\n\n");
        for r in &report.refused {
            let _ = writeln!(out, "- {r}");
        }
        out.push('\n');
    }
    if !report.incomplete.is_empty() {
        out.push_str("## Incomplete repetitions (not analysed)\n\n");
        for i in &report.incomplete {
            let _ = writeln!(
                out,
                "- `{}/{}/rep-{}`: {}",
                i.point, i.policy, i.rep, i.reason
            );
        }
        out.push('\n');
    }
    if !report.warnings.is_empty() {
        out.push_str("## Warnings\n\n");
        for w in &report.warnings {
            let _ = writeln!(out, "- {w}");
        }
        out.push('\n');
    }
    if !report.stages.is_empty() {
        out.push_str("## Stages\n\nThe replay's load ladder (a generated trace's stages), every repetition in the units serving benchmarks report.\n\n");
        out.push_str(&crate::stages::markdown(&report.stages));
        out.push('\n');
    }
    out
}
