//! The markdown table the bench prints.

use std::fmt::Write as _;

use crate::stats::Figures;

/// The setup the title line states.
pub(crate) struct TableSpec {
    /// Upstream servers.
    pub(crate) upstreams: usize,
    /// SSE events per response.
    pub(crate) events: usize,
    /// Gap between events, ms.
    pub(crate) gap_ms: u64,
    /// Interleaved rounds.
    pub(crate) rounds: usize,
    /// Cores shared by everything.
    pub(crate) cores: usize,
    /// Router worker threads.
    pub(crate) router_workers: String,
    /// HAProxy threads.
    pub(crate) haproxy_threads: usize,
}

/// One line of the table.
pub(crate) struct TableRow {
    /// Target name; the row named `direct` is the baseline of its stream count.
    pub(crate) target: String,
    /// Concurrent streams.
    pub(crate) streams: usize,
    /// The cell's figures over rounds.
    pub(crate) figures: Figures,
    /// The router's `overhead_us` p50 / p99 (routers only).
    pub(crate) overhead_us: Option<(f64, f64)>,
}

/// CPU per 1k requests with its resolution: `0.283 (±0.003)`; a resolution finer than the
/// printed digits shows as `±<0.001`.
fn cpu_cell(seconds: f64, resolution_s: f64) -> String {
    if resolution_s < 0.0005 {
        format!("{seconds:.3} (±<0.001)")
    } else {
        format!("{seconds:.3} (±{resolution_s:.3})")
    }
}

/// The title line, the table (rows in the given order; added figures against the `direct` row
/// of the same stream count) and `notes`, one paragraph each.
pub(crate) fn render(spec: &TableSpec, rows: &[TableRow], notes: &[String]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Proxy cost: {} upstreams, SSE {} events {} ms apart, {} rounds interleaved (medians of per-round p50/p99), {} cores shared by upstreams, load generator and proxy; router workers {}, HAProxy threads {}.\n",
        spec.upstreams,
        spec.events,
        spec.gap_ms,
        spec.rounds,
        spec.cores,
        spec.router_workers,
        spec.haproxy_threads
    );
    let _ = writeln!(
        out,
        "| target | streams | first event p50 / p99 (µs; added vs direct) | per-event delivery p50 / p99 (µs; added) | CPU s / 1k req (± resolution) | router overhead_us p50 / p99 | errors |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let f = &r.figures;
        let k = r.streams;
        let errors = f.errors;
        if r.target == "direct" {
            let _ = writeln!(
                out,
                "| direct | {k} | {:.0} / {:.0} (absolute) | {:.0} / {:.0} (absolute) | — | — | {errors} |",
                f.ttfb_p50_us, f.ttfb_p99_us, f.event_p50_us, f.event_p99_us
            );
            continue;
        }
        let [tp50, tp99, ep50, ep99] = rows
            .iter()
            .find(|d| d.target == "direct" && d.streams == k)
            .map_or([f64::NAN; 4], |d| f.added_to(&d.figures));
        let cpu = f
            .cpu
            .map_or("—".to_string(), |c| cpu_cell(c.seconds, c.resolution_s));
        let overhead = r.overhead_us.map_or("—".to_string(), |(p50, p99)| {
            format!("{p50:.0} / {p99:.0}")
        });
        let _ = writeln!(
            out,
            "| {} | {k} | {tp50:+.0} / {tp99:+.0} | {ep50:+.0} / {ep99:+.0} | {cpu} | {overhead} | {errors} |",
            r.target
        );
    }
    for n in notes {
        let _ = writeln!(out, "\n{n}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::CpuPer1k;

    fn figures(ttfb: f64, cpu: Option<(f64, f64)>) -> Figures {
        Figures {
            ttfb_p50_us: ttfb,
            ttfb_p99_us: ttfb * 4.0,
            event_p50_us: 51.0,
            event_p99_us: 165.0,
            cpu: cpu.map(|(seconds, resolution_s)| CpuPer1k {
                seconds,
                resolution_s,
            }),
            errors: 0,
        }
    }

    #[test]
    fn rows_render_as_before_with_the_cpu_resolution() {
        let spec = TableSpec {
            upstreams: 4,
            events: 16,
            gap_ms: 8,
            rounds: 5,
            cores: 2,
            router_workers: "1".into(),
            haproxy_threads: 1,
        };
        let rows = [
            TableRow {
                target: "direct".into(),
                streams: 200,
                figures: figures(1804.0, None),
                overhead_us: None,
            },
            TableRow {
                target: "router prefix-affinity".into(),
                streams: 200,
                figures: figures(5271.4, Some((0.2834, 1e-9 / 3.0))),
                overhead_us: Some((10.2, 15686.0)),
            },
            TableRow {
                target: "haproxy".into(),
                streams: 200,
                figures: figures(1000.0, Some((0.2171, 0.01 / 3.0))),
                overhead_us: None,
            },
        ];
        let t = render(&spec, &rows, &["Skipped: nginx.".to_string()]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(
            lines[0],
            "Proxy cost: 4 upstreams, SSE 16 events 8 ms apart, 5 rounds interleaved (medians of per-round p50/p99), 2 cores shared by upstreams, load generator and proxy; router workers 1, HAProxy threads 1."
        );
        assert_eq!(
            lines[2],
            "| target | streams | first event p50 / p99 (µs; added vs direct) | per-event delivery p50 / p99 (µs; added) | CPU s / 1k req (± resolution) | router overhead_us p50 / p99 | errors |"
        );
        assert_eq!(
            lines[4],
            "| direct | 200 | 1804 / 7216 (absolute) | 51 / 165 (absolute) | — | — | 0 |"
        );
        assert_eq!(
            lines[5],
            "| router prefix-affinity | 200 | +3467 / +13870 | +0 / +0 | 0.283 (±<0.001) | 10 / 15686 | 0 |"
        );
        assert_eq!(
            lines[6],
            "| haproxy | 200 | -804 / -3216 | +0 / +0 | 0.217 (±0.003) | — | 0 |"
        );
        assert_eq!(lines[8], "Skipped: nginx.");
    }
}
