//! What kvroute's rows and repetitions *are*: one definition each, shared by every crate that
//! writes or reads them.
//!
//! - [`meta`]: a repetition's `meta.json` ([`Meta`]), its SLO ([`Slo`]) and measured window
//!   ([`Window`], with the sweep's window rule [`Window::measured`]), and its run record
//!   ([`Run`]).
//! - [`evidence`]: the evidence that a window was clean ([`EvidenceSummary`], recorded as
//!   [`Evidence`]) and the check against its bounds.
//! - [`drift`]: the drift check's verdict ([`DriftVerdict`]).
//! - [`rows`]: the `client.csv` and `router.csv` rows ([`ClientRow`], [`RouterRow`]: every writer
//!   serializes them, every reader deserializes them) and their columns ([`CLIENT_COLUMNS`],
//!   [`ROUTER_COLUMNS`]), in contract order (docs/CONTRACTS.md, "Rows").
//! - [`stats`]: the one percentile definition ([`stats::quantile`], R type 7).
//! - [`engine`]: which engine serves a fleet ([`EngineKind`]) and what differs between engines
//!   (cached tokens, tokenize shape, reset, KV events).
//!
//! Pure data and arithmetic: no I/O, no clock, no async.

pub mod drift;
pub mod engine;
pub mod evidence;
pub mod meta;
pub mod rows;
pub mod stats;

pub use drift::DriftVerdict;
pub use engine::EngineKind;
pub use evidence::{Evidence, EvidenceSummary};
pub use meta::{ATTAINMENT_TARGET, Meta, Recorded, Run, Slo, Window, WindowClock, WindowError};
pub use rows::{CLIENT_COLUMNS, ClientRow, ROUTER_COLUMNS, RouterRow};

/// An error and its causes, `: `-separated (what `anyhow`'s `{:#}` prints): the one text every
/// library's typed error gives where a message with its causes is kept (a report, a log line).
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut next = error.source();
    while let Some(e) = next {
        text.push_str(": ");
        text.push_str(&e.to_string());
        next = e.source();
    }
    text
}

#[cfg(test)]
mod error_chain_tests {
    #[derive(Debug)]
    struct Outer(std::io::Error);

    impl std::fmt::Display for Outer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("reading plan.bin")
        }
    }

    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn an_error_is_printed_with_its_causes() {
        let e = Outer(std::io::Error::other("disk full"));
        assert_eq!(super::error_chain(&e), "reading plan.bin: disk full");
    }
}
