//! The figures of a cell: per-round percentiles, medians over rounds, the added time against
//! direct, and CPU per 1,000 requests.

use crate::cpu::CpuTime;
use crate::load::CellSamples;

/// Percentile `q` in [0, 1]; NaN when there are no samples. The workspace's one definition,
/// `analysis::stats::quantile` (linear interpolation between closest ranks, R type 7), so the
/// bench and the report agree by construction.
pub(crate) fn percentile(values: &[f64], q: f64) -> f64 {
    analysis::stats::quantile(values, q).unwrap_or(f64::NAN)
}

/// Requests per cell: `streams × waves`, at least `min_requests`.
pub(crate) fn requests_per_cell(streams: usize, waves: usize, min_requests: usize) -> usize {
    (streams * waves).max(min_requests)
}

/// `seconds` spread over `requests`, per 1,000 requests.
pub(crate) fn per_1k_requests(seconds: f64, requests: usize) -> f64 {
    seconds / requests.max(1) as f64 * 1000.0
}

/// CPU seconds per 1,000 requests, with the resolution of the reading on the same scale.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct CpuPer1k {
    /// CPU seconds per 1,000 requests.
    pub(crate) seconds: f64,
    /// Resolution of `seconds`.
    pub(crate) resolution_s: f64,
}

/// The figures of one round of one cell (target × streams), or of a cell over its rounds (each
/// figure the median of the rounds', errors summed, the CPU resolution the coarsest round's): one
/// shape, so a cell is summarised by the same type its rounds are.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Figures {
    /// Time to first event, p50, µs.
    pub(crate) ttfb_p50_us: f64,
    /// Time to first event, p99, µs.
    pub(crate) ttfb_p99_us: f64,
    /// Per-event delivery time (arrival − send stamp), p50, µs.
    pub(crate) event_p50_us: f64,
    /// Per-event delivery time, p99, µs.
    pub(crate) event_p99_us: f64,
    /// The proxy's CPU; `None` for direct.
    pub(crate) cpu: Option<CpuPer1k>,
    /// Failed requests.
    pub(crate) errors: usize,
}

impl Figures {
    /// The round's figures from its samples and the proxy's CPU over its `requests`.
    pub(crate) fn new(samples: &CellSamples, cpu: Option<&CpuTime>, requests: usize) -> Self {
        Figures {
            ttfb_p50_us: percentile(&samples.ttfb_us, 0.5),
            ttfb_p99_us: percentile(&samples.ttfb_us, 0.99),
            event_p50_us: percentile(&samples.delivery_us, 0.5),
            event_p99_us: percentile(&samples.delivery_us, 0.99),
            cpu: cpu.map(|c| CpuPer1k {
                seconds: per_1k_requests(c.seconds, requests),
                resolution_s: per_1k_requests(c.resolution_s, requests),
            }),
            errors: samples.errors,
        }
    }

    /// Medians over `rounds` (NaN figures when there are none).
    pub(crate) fn over_rounds(rounds: &[Figures]) -> Self {
        let med =
            |f: fn(&Figures) -> f64| percentile(&rounds.iter().map(f).collect::<Vec<_>>(), 0.5);
        let cpus: Vec<CpuPer1k> = rounds.iter().filter_map(|r| r.cpu).collect();
        let cpu = (!cpus.is_empty()).then(|| CpuPer1k {
            seconds: percentile(&cpus.iter().map(|c| c.seconds).collect::<Vec<_>>(), 0.5),
            resolution_s: cpus.iter().map(|c| c.resolution_s).fold(0.0, f64::max),
        });
        Figures {
            ttfb_p50_us: med(|r| r.ttfb_p50_us),
            ttfb_p99_us: med(|r| r.ttfb_p99_us),
            event_p50_us: med(|r| r.event_p50_us),
            event_p99_us: med(|r| r.event_p99_us),
            cpu,
            errors: rounds.iter().map(|r| r.errors).sum(),
        }
    }

    /// The latency figures minus direct's at the same stream count (what the proxy adds), in
    /// the order ttfb p50, ttfb p99, event p50, event p99.
    pub(crate) fn added_to(&self, direct: &Figures) -> [f64; 4] {
        [
            self.ttfb_p50_us - direct.ttfb_p50_us,
            self.ttfb_p99_us - direct.ttfb_p99_us,
            self.event_p50_us - direct.event_p50_us,
            self.event_p99_us - direct.event_p99_us,
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::CpuSource;

    #[test]
    fn percentile_interpolates_between_ranks() {
        let v = [40.0, 10.0, 30.0, 20.0];
        assert_eq!(percentile(&v, 0.5), 25.0);
        assert_eq!(percentile(&v, 0.0), 10.0);
        assert_eq!(percentile(&v, 1.0), 40.0);
        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        assert!((percentile(&hundred, 0.99) - 99.01).abs() < 1e-9);
        assert!(percentile(&[], 0.5).is_nan());
    }

    #[test]
    fn requests_and_cpu_per_1k() {
        assert_eq!(requests_per_cell(200, 15, 30), 3000);
        assert_eq!(requests_per_cell(1, 15, 30), 30);
        assert!((per_1k_requests(0.84, 3000) - 0.28).abs() < 1e-12);
        // One 10 ms tick over 3,000 requests is 0.0033 s per 1k; over 30 it was 0.33.
        assert!((per_1k_requests(0.01, 3000) - 0.01 / 3.0).abs() < 1e-12);
        assert!((per_1k_requests(0.01, 30) - 1.0 / 3.0).abs() < 1e-12);
    }

    fn samples(ttfb_us: &[f64], delivery_us: &[f64], errors: usize) -> CellSamples {
        CellSamples {
            ttfb_us: ttfb_us.to_vec(),
            delivery_us: delivery_us.to_vec(),
            errors,
        }
    }

    #[test]
    fn a_round_from_samples_and_cpu() {
        let cpu = CpuTime {
            seconds: 0.6,
            resolution_s: 0.01,
            source: CpuSource::Stat,
        };
        let r = Figures::new(
            &samples(&[100.0, 300.0], &[5.0, 7.0, 9.0], 1),
            Some(&cpu),
            2000,
        );
        assert_eq!(r.ttfb_p50_us, 200.0);
        assert!((r.ttfb_p99_us - 298.0).abs() < 1e-9);
        assert_eq!(r.event_p50_us, 7.0);
        assert_eq!(
            r.cpu,
            Some(CpuPer1k {
                seconds: 0.3,
                resolution_s: 0.005
            })
        );
        assert_eq!(r.errors, 1);
        assert_eq!(Figures::new(&samples(&[], &[], 0), None, 10).cpu, None);
        assert!(
            Figures::new(&samples(&[], &[], 0), None, 10)
                .ttfb_p50_us
                .is_nan()
        );
    }

    fn round(ttfb_p50_us: f64, cpu: Option<(f64, f64)>, errors: usize) -> Figures {
        Figures {
            ttfb_p50_us,
            ttfb_p99_us: ttfb_p50_us * 2.0,
            event_p50_us: 10.0,
            event_p99_us: 20.0,
            cpu: cpu.map(|(seconds, resolution_s)| CpuPer1k {
                seconds,
                resolution_s,
            }),
            errors,
        }
    }

    #[test]
    fn cells_take_medians_over_rounds_and_the_coarsest_resolution() {
        let c = Figures::over_rounds(&[
            round(300.0, Some((0.30, 0.0033)), 0),
            round(100.0, Some((0.25, 0.01)), 2),
            round(200.0, Some((0.28, 0.0033)), 1),
        ]);
        assert_eq!(c.ttfb_p50_us, 200.0);
        assert_eq!(c.ttfb_p99_us, 400.0);
        assert_eq!(
            c.cpu,
            Some(CpuPer1k {
                seconds: 0.28,
                resolution_s: 0.01
            })
        );
        assert_eq!(c.errors, 3);
        let direct = Figures::over_rounds(&[round(150.0, None, 0)]);
        assert_eq!(direct.cpu, None);
        assert_eq!(c.added_to(&direct), [50.0, 100.0, 0.0, 0.0]);
        assert!(Figures::over_rounds(&[]).ttfb_p50_us.is_nan());
    }
}
