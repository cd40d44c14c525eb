//! Real-time scheduling for the emulator's threads: the `rt-sched` crate, which the router shares
//! (see its documentation for why priority 1 and what it costs).

pub use rt_sched::{Scheduling, request_fifo};
