//! `summary.md`: the loss-bound verdict and the tables of a fault run.

use super::{FaultKind, Summary, fmt_opt};

fn with_attainment(goodput: Option<f64>, attainment: Option<f64>) -> String {
    match attainment {
        Some(a) => format!("{} ({:.0}%)", fmt_opt(goodput, 2), a * 100.0),
        None => fmt_opt(goodput, 2),
    }
}

/// The human summary.
pub fn markdown(s: &Summary) -> String {
    let mut md = format!("# Fault `{}` at {}\n\n", s.kind.as_str(), s.point);
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
    md.push_str("\nWindows are on the driver's clock: *before* is the steady load ahead of the fault, *outage* from the replica going down to it being healthy again, *after, early* the first third of the rest (0.5–10 s). The timeline of goodput per second is `timeline.csv` (figure 6).\n");
    md
}
