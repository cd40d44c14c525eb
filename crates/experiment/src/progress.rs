//! Progress over the units of a long command (a sweep's cells, a fault run's repetitions, a
//! calibration's replicas): a count and an ETA from the units run so far, in one format for every
//! command, and `fmt_duration` for the calibration's phase lines.

use std::time::{Duration, Instant};

/// Units done out of a total, and how long the ones run here took.
#[derive(Debug, Clone)]
pub struct Progress {
    total: usize,
    done: usize,
    ran: usize,
    ran_time: Duration,
    started: Instant,
    estimate_per_unit: Duration,
}

impl Progress {
    /// `total` units, each guessed to take `estimate_per_unit` until one has run.
    pub fn new(total: usize, estimate_per_unit: Duration) -> Progress {
        Progress {
            total,
            done: 0,
            ran: 0,
            ran_time: Duration::ZERO,
            started: Instant::now(),
            estimate_per_unit,
        }
    }

    /// A unit found done already (a resumed run): counted, but it says nothing of the time.
    pub fn skipped(&mut self) {
        self.done += 1;
    }

    /// A unit run here, which took `took`.
    pub fn ran(&mut self, took: Duration) {
        self.done += 1;
        self.ran += 1;
        self.ran_time += took;
    }

    /// Time left: the mean of the units run so far (the estimate before any) times those left.
    pub fn eta(&self) -> Duration {
        let per = if self.ran > 0 {
            self.ran_time / self.ran as u32
        } else {
            self.estimate_per_unit
        };
        per * self.total.saturating_sub(self.done) as u32
    }

    /// `[done/total] <what> — <elapsed> elapsed, ETA <left>`.
    pub fn line(&self, what: &str) -> String {
        format!(
            "[{}/{}] {what} — {} elapsed, ETA {}",
            self.done,
            self.total,
            fmt_duration(self.started.elapsed()),
            fmt_duration(self.eta()),
        )
    }
}

/// `1h02m` from an hour on, else `1m15s`.
pub fn fmt_duration(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else {
        format!("{}m{:02}s", s / 60, s % 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eta_uses_units_run_so_far() {
        let mut p = Progress::new(10, Duration::from_secs(20));
        assert_eq!(p.eta(), Duration::from_secs(200));
        // Two units skipped on resume, two run at 15 s each.
        p.skipped();
        p.skipped();
        p.ran(Duration::from_secs(15));
        p.ran(Duration::from_secs(15));
        assert_eq!(p.eta(), Duration::from_secs(90));
        let line = p.line("session-affinity rep-1: 10 sent");
        assert!(
            line.starts_with("[4/10] session-affinity rep-1: 10 sent — 0m0"),
            "{line}"
        );
        assert!(line.ends_with(" elapsed, ETA 1m30s"), "{line}");
        assert_eq!(fmt_duration(Duration::from_secs(3725)), "1h02m");
        assert_eq!(fmt_duration(Duration::from_secs(75)), "1m15s");
    }
}
