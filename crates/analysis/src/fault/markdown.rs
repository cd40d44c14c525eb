//! `summary.md`: the loss-bound verdict, the gates, the comparisons and the tables of a fault
//! run.

use super::{FaultKind, Summary, fmt_opt};
use crate::stats::Spread;

fn spread_text(s: &Spread, digits: usize) -> String {
    format!("{:.d$} [{:.d$}–{:.d$}]", s.median, s.min, s.max, d = digits)
}

/// The gates: a warning when some were not recorded, the set-aside repetitions, the table.
fn gates(md: &mut String, s: &Summary) {
    let unrecorded: Vec<_> = s.gates.iter().filter(|g| !g.recorded()).collect();
    if !unrecorded.is_empty() {
        let trending = unrecorded
            .iter()
            .filter(|g| g.drift_check.trending())
            .count();
        md.push_str(&format!(
            "**Gates not recorded for {} of {} repetitions**: they ran before fault repetitions were gated, so the run never checked their evidence nor ran their drift test, and wrote `accepted: true` for each. They are counted as accepted below; nothing here says they passed. This summary's own drift test on their pre-fault window flags {trending} of them as still trending (gates table).\n\n",
            unrecorded.len(),
            s.gates.len()
        ));
    }
    let set_aside: Vec<String> = s
        .gates
        .iter()
        .filter(|g| !g.accepted)
        .map(|g| {
            format!(
                "- {} rep-{}: {}",
                g.policy,
                g.rep,
                g.set_aside_reason
                    .as_deref()
                    .unwrap_or("no reason recorded")
            )
        })
        .collect();
    if !set_aside.is_empty() {
        md.push_str(&format!(
            "**Set aside** (loss bounds still checked; left out of the comparisons and the timeline):\n\n{}\n\n",
            set_aside.join("\n")
        ));
    }
}

fn gates_table(md: &mut String, s: &Summary) {
    md.push_str(&format!(
        "\n## Gates\n\nAs for a sweep cell: evidence first, then the drift test. Drift window: {}.\n\n| policy | rep | accepted | attempts | evidence (run) | drift (run) | drift (this summary) |\n|---|---|---|---|---|---|---|\n",
        s.drift_rule
    ));
    for g in &s.gates {
        let own = &g.drift_check;
        let own = match (&own.skipped, own.trending()) {
            (Some(why), _) => format!("not run: {why}"),
            (None, true) => own.reason.clone().unwrap_or_else(|| "warming".into()),
            (None, false) => "settled".to_string(),
        };
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} ({:.1}–{:.1} s) |\n",
            g.policy,
            g.rep,
            if g.accepted { "yes" } else { "set aside" },
            // 0: a meta.json that does not record its attempts.
            if g.attempts == 0 {
                "–".to_string()
            } else {
                g.attempts.to_string()
            },
            g.evidence.text(),
            g.drift.text(),
            own,
            g.drift_window.measured_start_s,
            g.drift_window.measured_end_s,
        ));
    }
}

fn comparisons(md: &mut String, s: &Summary) {
    md.push_str("## Comparisons (accepted repetitions)\n\n");
    if let Some(r) = &s.refused {
        md.push_str(&format!("Not compared: {r}.\n\n"));
        return;
    }
    md.push_str("Median [min–max] over each policy's accepted repetitions; each pair is judged by the sweep report's verdict function: *separates* when the ranges do not overlap, *within spread* when they do, *too few reps* when a side has fewer than two.\n\n| figure | policy | reps | median [min–max] |\n|---|---|---|---|\n");
    for c in &s.comparisons {
        let digits = if c.unit == "s" { 1 } else { 2 };
        for p in &c.policies {
            let value = match (&p.spread, p.missing.as_slice()) {
                (Some(sp), _) => spread_text(sp, digits),
                (None, []) => "–".to_string(),
                (None, missing) => format!(
                    "– (not within the run in rep {})",
                    missing
                        .iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            };
            md.push_str(&format!(
                "| {} ({}) | {} | {} | {} |\n",
                c.label,
                c.unit,
                p.policy,
                p.reps.len(),
                value
            ));
        }
    }
    md.push_str("\n| figure | policy vs baseline | difference | verdict |\n|---|---|---|---|\n");
    for c in &s.comparisons {
        let digits = if c.unit == "s" { 1 } else { 2 };
        for d in &c.differences {
            md.push_str(&format!(
                "| {} ({}) | {} vs {} | {:+.digits$}{} | {} |\n",
                c.label,
                c.unit,
                d.policy,
                d.baseline,
                d.difference,
                d.relative
                    .map_or_else(String::new, |r| format!(" ({:+.1}%)", r * 100.0)),
                d.verdict.as_str()
            ));
        }
    }
    md.push('\n');
}

fn with_attainment(goodput: Option<f64>, attainment: Option<f64>) -> String {
    match attainment {
        Some(a) => format!("{} ({:.0}%)", fmt_opt(goodput, 2), a * 100.0),
        None => fmt_opt(goodput, 2),
    }
}

/// The human summary.
pub fn markdown(s: &Summary) -> String {
    let mut md = format!("# Fault `{}` at {}\n\n", s.kind.as_str(), s.point);
    md.push_str(&crate::markdown::rules_line(&s.rules));
    let rule = match s.kind {
        FaultKind::Kill => {
            "only requests in flight on the killed replica may be lost; none that were not yet dispatched"
        }
        FaultKind::Drain => "a drain loses nothing",
    };
    if s.violations.is_empty() {
        md.push_str(&format!("**Loss bounds hold** ({rule}).\n\n"));
    } else {
        md.push_str(&format!(
            "**Loss bounds BROKEN** ({rule}): {} violations.\n\n",
            s.violations.len()
        ));
        for v in &s.violations {
            md.push_str(&format!("- {v}\n"));
        }
        md.push('\n');
    }
    gates(&mut md, s);
    comparisons(&mut md, s);
    md.push_str("## Requests lost\n\n| policy | rep | sent | lost | in flight on the victim | outside the bound | victim outstanding at the fault |\n|---|---|---|---|---|---|---|\n");
    for r in &s.reps {
        let allowed = r.lost.iter().filter(|l| l.allowed).count();
        md.push_str(&format!(
            "| {} | {} | {} | {} | {allowed} | {} | {} |\n",
            r.policy,
            r.rep,
            r.sent,
            r.lost.len(),
            r.lost.len() - allowed,
            r.outstanding_at_fault
                .map_or_else(|| "–".into(), |o| o.to_string()),
        ));
    }
    md.push_str("\n## Goodput (req/s, mean of 1-s buckets; SLO attainment = good ÷ sent)\n\n| policy | rep | before | outage | after restart | recovered (s after restart) |\n|---|---|---|---|---|---|\n");
    for r in &s.reps {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            r.policy,
            r.rep,
            with_attainment(r.goodput_before_rps, r.attainment[0]),
            with_attainment(r.goodput_outage_rps, r.attainment[1]),
            with_attainment(r.goodput_after_rps, r.attainment[2]),
            r.recovery_s
                .map_or_else(|| "not within the run".into(), |x| format!("{x:.1}")),
        ));
    }
    md.push_str("\n## Share of requests per replica\n\n| policy | rep | window | requests | shares (replica 0, 1, …) | spill rate | engine prefix-hit rate |\n|---|---|---|---|---|---|---|\n");
    let pct = |v: Option<f64>| v.map_or_else(|| "–".to_string(), |x| format!("{:.1}%", x * 100.0));
    for r in &s.reps {
        for w in &r.shares {
            let shares: Vec<String> = w
                .share
                .iter()
                .map(|x| format!("{:.0}%", x * 100.0))
                .collect();
            md.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} |\n",
                r.policy,
                r.rep,
                w.window,
                w.requests,
                shares.join(" · "),
                pct(w.spill_rate),
                pct(w.prefix_hit_rate)
            ));
        }
    }
    md.push_str("\n## TTFT around the restart (ms, p50 / p90)\n\n| policy | rep | before | outage | after, early | after, late | victim, early after restart |\n|---|---|---|---|---|---|---|\n");
    for r in &s.reps {
        let cell = |name: &str| {
            r.ttft.iter().find(|t| t.window == name).map_or_else(
                || "–".to_string(),
                |t| {
                    format!(
                        "{} / {} (n={})",
                        fmt_opt(t.p50_ms, 1),
                        fmt_opt(t.p90_ms, 1),
                        t.requests
                    )
                },
            )
        };
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} |\n",
            r.policy,
            r.rep,
            cell("before"),
            cell("outage"),
            cell("after-early"),
            cell("after-late"),
            cell("victim-after-early"),
        ));
    }
    gates_table(&mut md, s);
    md.push_str("\nWindows are on the driver's clock: *before* is the steady load ahead of the fault, *outage* from the replica going down to it being healthy again, *after, early* the first third of the rest (0.5–10 s). The timeline of goodput per second is `timeline.csv` (figure 6).\n");
    md
}
