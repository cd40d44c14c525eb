//! Real-time scheduling for kvroute's processes that must keep time on shared cores: the
//! emulator's threads (`engine`) and the router in front of an emulated fleet (`proxy`).
//!
//! The emulator keeps modelled time only if its engine thread wakes at each step's deadline. Under
//! `SCHED_OTHER` a wake-up on a busy machine waits for a scheduler slice: with three replicas, the
//! router and the driver on two cores, lateness p99 was 5–100 ms at speed 6 while a compile ran
//! (bound: 0.33 ms). Under `SCHED_FIFO` priority 1 a waking engine thread preempts every ordinary
//! thread at once: 0.20–0.25 ms p99 in the same conditions (crates/engine/README.md, "Lateness").
//! Priority 1 is the lowest real-time level: it outranks normal processes only, never the kernel's
//! own real-time threads, and the engine never runs long at it (it sleeps or spins ≤ 100 µs up to
//! each deadline), so it cannot starve the machine; the kernel's real-time throttling
//! (`sched_rt_runtime_us`) bounds it anyway.
//!
//! The same outranking starves a router left at `SCHED_OTHER` on those cores: every wake-up of
//! its workers waits behind the engines' real-time threads (docs/proxy-bench.md, "The router's
//! overhead in a live cell"). So a router in front of an emulated fleet asks for the engines'
//! level too (`router --sched-fifo-priority`), which a real fleet, whose engines run on their
//! own devices, does not need.

/// How a process's threads are scheduled, as reported in readiness lines and `/metrics`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scheduling {
    /// The default time-sharing policy (not asked for real time).
    Other,
    /// `SCHED_FIFO` at this priority, granted.
    Fifo(u8),
    /// `SCHED_FIFO` was asked for and refused (e.g. no `CAP_SYS_NICE`); the threads run under
    /// `SCHED_OTHER` and the lateness evidence decides whether the cell can be trusted.
    Refused {
        /// The priority asked for.
        priority: u8,
        /// The OS's reason.
        reason: String,
    },
}

impl Scheduling {
    /// The readiness line's `scheduling` value: `other`, `fifo:N` or `other (fifo:N refused: …)`.
    pub fn describe(&self) -> String {
        match self {
            Scheduling::Other => "other".to_owned(),
            Scheduling::Fifo(p) => format!("fifo:{p}"),
            Scheduling::Refused { priority, reason } => {
                format!("other (fifo:{priority} refused: {reason})")
            }
        }
    }

    /// The `SCHED_FIFO` priority in effect; 0 under `SCHED_OTHER`.
    pub fn fifo_priority(&self) -> u8 {
        match self {
            Scheduling::Fifo(p) => *p,
            _ => 0,
        }
    }
}

/// Asks for `SCHED_FIFO` at `priority` for the calling thread; threads it creates afterwards
/// inherit the policy (call it before building a runtime or spawning threads).
/// `priority` 0 asks for nothing and returns [`Scheduling::Other`].
// One libc call with no safe binding in the workspace's crates (rustix has none for
// sched_setscheduler); the workspace denies unsafe code elsewhere.
#[allow(unsafe_code)]
pub fn request_fifo(priority: u8) -> Scheduling {
    if priority == 0 {
        return Scheduling::Other;
    }
    let param = libc::sched_param {
        sched_priority: i32::from(priority),
    };
    // SAFETY: `sched_setscheduler` reads `param` only; pid 0 is the calling thread.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) };
    if rc == 0 {
        Scheduling::Fifo(priority)
    } else {
        Scheduling::Refused {
            priority,
            reason: std::io::Error::last_os_error().to_string(),
        }
    }
}

/// Asks for `SCHED_IDLE` for the calling thread: it runs only when nothing else on its CPU wants
/// to (a waking thread of any other policy preempts it at once). Needs no privilege.
// One libc call, as `request_fifo`.
#[allow(unsafe_code)]
pub fn request_idle() -> std::io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `sched_setscheduler` reads `param` only; pid 0 is the calling thread.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// One spinning thread per CPU at `SCHED_IDLE`, so that no CPU of a virtual machine halts while
/// an emulated fleet runs; stopped and joined on drop.
///
/// Why: a virtual CPU with nothing to run halts, and the hypervisor then takes it off its
/// physical core; a timer that should wake an engine thread on it waits for the hypervisor to
/// schedule it again. On this project's 2-core VM (2 Dec 2026) that made every replica's step
/// lateness p99 0.6–3 ms at a machine CPU busy of only 0.23 (bound 0.33 ms): the engines' own
/// `SCHED_FIFO` cannot help, the wait is outside the guest. With a spinner on each CPU no CPU
/// halts, and the same cells showed p99 0.05 ms on every replica (crates/rt-sched/README.md).
/// The spinners take only idle time: every other thread preempts them at once, and the
/// scheduler gives them almost no share against normal threads. Machine CPU busy then reads ~1.
pub struct KeepAwake {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl KeepAwake {
    /// Starts one spinner per available CPU; fails (starting none) when a thread cannot be
    /// spawned or is refused `SCHED_IDLE` — spinning at an ordinary priority would take CPU
    /// from the measured processes instead of idle time.
    pub fn start() -> std::io::Result<KeepAwake> {
        use std::sync::atomic::{AtomicBool, Ordering};
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut keep = KeepAwake {
            stop: std::sync::Arc::new(AtomicBool::new(false)),
            threads: Vec::with_capacity(cpus),
        };
        let (tx, rx) = std::sync::mpsc::channel();
        for i in 0..cpus {
            let (stop, tx) = (keep.stop.clone(), tx.clone());
            let handle = std::thread::Builder::new()
                .name(format!("keep-awake-{i}"))
                .spawn(move || {
                    let granted = request_idle();
                    let ok = granted.is_ok();
                    let _ = tx.send(granted);
                    while ok && !stop.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })?;
            keep.threads.push(handle);
        }
        drop(tx);
        for granted in rx.iter().take(cpus) {
            granted?; // `keep` drops here on a refusal and joins the others
        }
        Ok(keep)
    }

    /// The spinning threads (one per CPU).
    pub fn threads(&self) -> usize {
        self.threads.len()
    }
}

impl Drop for KeepAwake {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_asks_for_nothing() {
        assert_eq!(request_fifo(0), Scheduling::Other);
        assert_eq!(Scheduling::Other.describe(), "other");
        assert_eq!(Scheduling::Other.fifo_priority(), 0);
    }

    #[test]
    fn descriptions_name_the_outcome() {
        assert_eq!(Scheduling::Fifo(1).describe(), "fifo:1");
        let refused = Scheduling::Refused {
            priority: 1,
            reason: "Operation not permitted (os error 1)".into(),
        };
        assert_eq!(
            refused.describe(),
            "other (fifo:1 refused: Operation not permitted (os error 1))"
        );
        assert_eq!(refused.fifo_priority(), 0);
    }

    #[test]
    #[allow(unsafe_code)]
    fn keep_awake_spins_one_idle_thread_per_cpu_and_stops_on_drop() {
        std::thread::spawn(|| {
            request_idle().expect("SCHED_IDLE needs no privilege");
            // SAFETY: reads the calling thread's policy.
            assert_eq!(unsafe { libc::sched_getscheduler(0) }, libc::SCHED_IDLE);
        })
        .join()
        .unwrap();
        let keep = KeepAwake::start().unwrap();
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(keep.threads(), cpus);
        drop(keep); // joins every spinner: the test ends only if they all stopped
    }

    /// The calling thread's policy and real-time priority, as the kernel reports them.
    #[allow(unsafe_code)]
    fn policy_and_priority() -> (i32, i32) {
        let mut param = libc::sched_param { sched_priority: -1 };
        // SAFETY: both read the calling thread's scheduling; `param` is written only.
        let (policy, rc) = unsafe {
            (
                libc::sched_getscheduler(0),
                libc::sched_getparam(0, &mut param),
            )
        };
        assert!(
            policy >= 0 && rc == 0,
            "{}",
            std::io::Error::last_os_error()
        );
        (policy, param.sched_priority)
    }

    #[test]
    fn a_granted_request_is_in_effect_on_the_thread() {
        // On its own thread, so the test harness's other threads keep their policy.
        std::thread::spawn(|| {
            let before = policy_and_priority();
            match request_fifo(1) {
                Scheduling::Fifo(1) => {
                    assert_eq!(policy_and_priority(), (libc::SCHED_FIFO, 1));
                    // … and a thread created afterwards inherits it, as the engine relies on.
                    let child = std::thread::spawn(policy_and_priority).join().unwrap();
                    assert_eq!(child, (libc::SCHED_FIFO, 1), "a new thread inherits FIFO 1");
                }
                // Refusal is a legitimate outcome of a valid priority only for want of privilege
                // (no CAP_SYS_NICE, RLIMIT_RTPRIO 0, or a cgroup without real-time runtime): EPERM,
                // with the thread left as it was.
                Scheduling::Refused { priority, reason } => {
                    assert_eq!(priority, 1);
                    let eperm = std::io::Error::from_raw_os_error(libc::EPERM).to_string();
                    assert_eq!(reason, eperm, "refused for another reason than privilege");
                    assert_eq!(policy_and_priority(), before, "a refusal changes nothing");
                }
                other => panic!("asked for fifo:1, got {other:?}"),
            }
        })
        .join()
        .unwrap();
    }

    #[test]
    fn an_invalid_priority_is_refused_with_the_os_reason_and_changes_nothing() {
        // SCHED_FIFO priorities run 1..=99: the kernel checks that before any privilege, so this
        // is refused (EINVAL) everywhere, privileged or not.
        std::thread::spawn(|| {
            let before = policy_and_priority();
            let einval = std::io::Error::from_raw_os_error(libc::EINVAL).to_string();
            assert_eq!(
                request_fifo(100),
                Scheduling::Refused {
                    priority: 100,
                    reason: einval
                }
            );
            assert_eq!(policy_and_priority(), before);
        })
        .join()
        .unwrap();
    }
}
