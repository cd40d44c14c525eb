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
    fn a_granted_request_is_in_effect_on_the_thread() {
        // On its own thread, so the test harness's other threads keep their policy.
        std::thread::spawn(|| match request_fifo(1) {
            Scheduling::Fifo(1) => {
                // SAFETY: reads the calling thread's policy.
                let policy = unsafe { libc::sched_getscheduler(0) };
                assert_eq!(policy, libc::SCHED_FIFO);
            }
            // Refusal is a legitimate outcome (no CAP_SYS_NICE); it must say why.
            Scheduling::Refused { reason, .. } => assert!(!reason.is_empty()),
            other => panic!("unexpected {other:?}"),
        })
        .join()
        .unwrap();
    }
}
