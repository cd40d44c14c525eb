//! CPU time of the proxy processes, read from `/proc` before and after a cell.
//!
//! Preferred source: `/proc/<pid>/task/<tid>/schedstat`, whose first field is the thread's time
//! on a CPU in nanoseconds, summed over the process's threads. `/proc/<pid>/schedstat` alone
//! would be the main thread only; the router's work runs on its tokio worker and row-writer
//! threads. Fallback: `/proc/<pid>/stat` utime + stime, which covers the whole thread group
//! (exited threads included) but counts in clock ticks (1 / `sysconf(_SC_CLK_TCK)` s, usually
//! 10 ms). The fallback is taken when schedstat is missing (a kernel without `CONFIG_SCHED_INFO`)
//! or when a thread seen before the cell is gone after it (its time would be lost from the sum).

use std::collections::BTreeMap;

/// Where a CPU figure came from; decides its resolution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CpuSource {
    /// Per-thread `schedstat`, nanoseconds.
    Schedstat,
    /// Process `stat` utime + stime, clock ticks.
    Stat,
}

impl CpuSource {
    /// The resolution of one process's CPU-time difference, seconds.
    pub(crate) fn resolution_s(self, clock_ticks_per_s: u64) -> f64 {
        match self {
            CpuSource::Schedstat => 1e-9,
            CpuSource::Stat => 1.0 / clock_ticks_per_s.max(1) as f64,
        }
    }

    /// One line for under the table.
    pub(crate) fn describe(self, clock_ticks_per_s: u64) -> String {
        match self {
            CpuSource::Schedstat => "CPU: /proc/<pid>/task/<tid>/schedstat (time on CPU, ns), summed over the proxy's threads and processes; ± is the reading's resolution per 1k requests.".to_string(),
            CpuSource::Stat => format!(
                "CPU: /proc/<pid>/stat utime + stime in clock ticks of 1/{clock_ticks_per_s} s (schedstat absent, or a thread exited during a cell); ± is one tick per process per 1k requests."
            ),
        }
    }
}

/// 1 / `sysconf(_SC_CLK_TCK)`: the unit of `stat`'s utime and stime.
pub(crate) fn clock_ticks_per_s() -> u64 {
    rustix::param::clock_ticks_per_second()
}

/// The fields of `/proc/<pid>/stat` the bench uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stat {
    /// Parent process id.
    pub(crate) ppid: u32,
    /// User-mode CPU time of the thread group, clock ticks.
    pub(crate) utime_ticks: u64,
    /// Kernel-mode CPU time of the thread group, clock ticks.
    pub(crate) stime_ticks: u64,
}

/// Parses `/proc/<pid>/stat`. The command name (field 2) is in parentheses and may itself hold
/// spaces and parentheses, so fields are counted from the last `)`.
pub(crate) fn parse_stat(text: &str) -> Option<Stat> {
    let (_, rest) = text.rsplit_once(')')?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the command name: state(0) ppid(1) pgrp(2) session(3) tty_nr(4) tpgid(5) flags(6)
    // minflt(7) cminflt(8) majflt(9) cmajflt(10) utime(11) stime(12).
    Some(Stat {
        ppid: f.get(1)?.parse().ok()?,
        utime_ticks: f.get(11)?.parse().ok()?,
        stime_ticks: f.get(12)?.parse().ok()?,
    })
}

/// Parses `/proc/<pid>/schedstat` (`on_cpu_ns run_delay_ns timeslices`): time on a CPU, ns.
pub(crate) fn parse_schedstat(text: &str) -> Option<u64> {
    text.split_whitespace().next()?.parse().ok()
}

/// One reading of a process's CPU time.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct CpuReading {
    /// utime + stime of the whole thread group, clock ticks.
    stat_ticks: u64,
    /// Time on a CPU per thread id, ns; `None` when schedstat cannot be read.
    on_cpu_ns_by_tid: Option<BTreeMap<u32, u64>>,
}

/// Reads `pid`'s CPU time; `None` when the process is gone.
pub(crate) fn read(pid: u32) -> Option<CpuReading> {
    let stat = parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)?;
    let mut by_tid = BTreeMap::new();
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok();
    for e in tasks.into_iter().flatten().flatten() {
        let Ok(tid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        // A thread may exit between the listing and the read; it is then simply not there.
        if let Some(ns) = std::fs::read_to_string(e.path().join("schedstat"))
            .ok()
            .and_then(|t| parse_schedstat(&t))
        {
            by_tid.insert(tid, ns);
        }
    }
    Some(CpuReading {
        stat_ticks: stat.utime_ticks + stat.stime_ticks,
        on_cpu_ns_by_tid: (!by_tid.is_empty()).then_some(by_tid),
    })
}

/// Reads every pid (in order).
pub(crate) fn read_all(pids: &[u32]) -> Vec<Option<CpuReading>> {
    pids.iter().map(|&p| read(p)).collect()
}

/// CPU time spent between two readings, with its resolution.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct CpuTime {
    /// Seconds on a CPU.
    pub(crate) seconds: f64,
    /// Resolution of `seconds`: the difference of two readings is within this of the truth.
    pub(crate) resolution_s: f64,
    /// The (coarsest) source used.
    pub(crate) source: CpuSource,
}

/// CPU time of one process between `before` and `after`.
pub(crate) fn elapsed(before: &CpuReading, after: &CpuReading, clock_ticks_per_s: u64) -> CpuTime {
    if let (Some(b), Some(a)) = (&before.on_cpu_ns_by_tid, &after.on_cpu_ns_by_tid)
        && b.keys().all(|tid| a.contains_key(tid))
    {
        // Threads born during the window count whole (they started at zero).
        let ns: u64 = a
            .iter()
            .map(|(tid, &ns)| ns.saturating_sub(b.get(tid).copied().unwrap_or(0)))
            .sum();
        return CpuTime {
            seconds: ns as f64 * 1e-9,
            resolution_s: CpuSource::Schedstat.resolution_s(clock_ticks_per_s),
            source: CpuSource::Schedstat,
        };
    }
    let ticks = after.stat_ticks.saturating_sub(before.stat_ticks);
    CpuTime {
        seconds: ticks as f64 / clock_ticks_per_s.max(1) as f64,
        resolution_s: CpuSource::Stat.resolution_s(clock_ticks_per_s),
        source: CpuSource::Stat,
    }
}

/// CPU time of several processes (nginx: master and worker) between two [`read_all`]s: sums of
/// seconds and of resolutions; `None` when a process could not be read either time.
pub(crate) fn elapsed_all(
    before: &[Option<CpuReading>],
    after: &[Option<CpuReading>],
    clock_ticks_per_s: u64,
) -> Option<CpuTime> {
    let mut total: Option<CpuTime> = None;
    for (b, a) in before.iter().zip(after) {
        let t = elapsed(b.as_ref()?, a.as_ref()?, clock_ticks_per_s);
        total = Some(match total {
            None => t,
            Some(s) => CpuTime {
                seconds: s.seconds + t.seconds,
                resolution_s: s.resolution_s + t.resolution_s,
                source: if s.source == CpuSource::Stat || t.source == CpuSource::Stat {
                    CpuSource::Stat
                } else {
                    CpuSource::Schedstat
                },
            },
        });
    }
    total
}

/// Processes whose parent is `pid` (nginx's workers), from `/proc/*/stat`.
pub(crate) fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if std::fs::read_to_string(e.path().join("stat"))
            .ok()
            .and_then(|t| parse_stat(&t))
            .is_some_and(|s| s.ppid == pid)
        {
            out.push(p);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stat line of the kernel's format, with a command name made awkward on purpose.
    const STAT: &str = "4242 (rou) ter (x)) S 4100 4242 4100 34816 4242 4194304 1261 0 0 0 183 57 0 0 20 0 3 0 7654321 1136660480 2816 18446744073709551615 1 1 0 0 0 0 0 4096 17664 0 0 0 17 1 0 0 0 0 0\n";

    #[test]
    fn stat_fields_count_from_the_last_parenthesis() {
        assert_eq!(
            parse_stat(STAT),
            Some(Stat {
                ppid: 4100,
                utime_ticks: 183,
                stime_ticks: 57
            })
        );
        assert_eq!(parse_stat("4242 (router) S 4100"), None);
        assert_eq!(parse_stat("no parenthesis at all"), None);
    }

    #[test]
    fn schedstat_first_field_is_ns_on_cpu() {
        assert_eq!(
            parse_schedstat("2401375023 96840310 5212\n"),
            Some(2_401_375_023)
        );
        assert_eq!(parse_schedstat(""), None);
        assert_eq!(parse_schedstat("x 1 2"), None);
    }

    fn reading(stat_ticks: u64, threads: &[(u32, u64)]) -> CpuReading {
        CpuReading {
            stat_ticks,
            on_cpu_ns_by_tid: (!threads.is_empty()).then(|| threads.iter().copied().collect()),
        }
    }

    #[test]
    fn schedstat_sums_threads_and_counts_new_ones_whole() {
        let before = reading(100, &[(1, 1_000_000_000), (2, 500_000_000)]);
        let after = reading(
            130,
            &[(1, 1_200_000_000), (2, 550_000_000), (3, 50_000_000)],
        );
        let t = elapsed(&before, &after, 100);
        assert_eq!(t.source, CpuSource::Schedstat);
        assert!((t.seconds - 0.3).abs() < 1e-12, "{t:?}");
        assert_eq!(t.resolution_s, 1e-9);
    }

    #[test]
    fn an_exited_thread_or_missing_schedstat_falls_back_to_stat_ticks() {
        let before = reading(100, &[(1, 1_000_000_000), (2, 500_000_000)]);
        let exited = reading(131, &[(1, 1_200_000_000)]);
        let t = elapsed(&before, &exited, 100);
        assert_eq!(t.source, CpuSource::Stat);
        assert!((t.seconds - 0.31).abs() < 1e-12, "{t:?}");
        assert_eq!(t.resolution_s, 0.01);

        let t = elapsed(&reading(100, &[]), &reading(103, &[]), 250);
        assert_eq!(t.source, CpuSource::Stat);
        assert!((t.seconds - 0.012).abs() < 1e-12, "{t:?}");
        assert_eq!(t.resolution_s, 0.004);
    }

    #[test]
    fn processes_add_up_and_the_coarsest_source_wins() {
        let b = [Some(reading(10, &[(1, 0)])), Some(reading(20, &[]))];
        let a = [
            Some(reading(11, &[(1, 250_000_000)])),
            Some(reading(45, &[])),
        ];
        let t = elapsed_all(&b, &a, 100).unwrap();
        assert!((t.seconds - 0.5).abs() < 1e-12, "{t:?}");
        assert!((t.resolution_s - (1e-9 + 0.01)).abs() < 1e-15, "{t:?}");
        assert_eq!(t.source, CpuSource::Stat);
        assert_eq!(elapsed_all(&[Some(reading(1, &[]))], &[None], 100), None);
        assert_eq!(elapsed_all(&[], &[], 100), None);
    }

    #[test]
    fn this_process_reads_from_proc() {
        let pid = std::process::id();
        let before = read(pid).expect("/proc/self");
        // Burn a little CPU so the difference is positive on either source.
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let after = read(pid).unwrap();
        let t = elapsed(&before, &after, clock_ticks_per_s());
        assert!(t.seconds >= 0.0);
        assert!(clock_ticks_per_s() > 0);
        assert!(!children_of(std::process::id()).contains(&pid));
    }
}
