//! Placing the fault on the rows' clocks: router − xtask from the clock probes, router − driver
//! from the requests themselves.

use std::collections::BTreeMap;

use crate::rows::{ClientRow, RouterRow};

/// One clock probe as xtask timed it: a request the router answers 400 before routing.
#[derive(Debug, Clone, PartialEq)]
pub struct ClockProbe {
    /// Its `x-request-id` (starts with [`super::PROBE_PREFIX`]).
    pub request_id: String,
    /// Written, s on xtask's clock.
    pub sent_s: f64,
    /// The first bytes of the answer read, s on xtask's clock.
    pub answered_s: f64,
}

/// Router − xtask clock offset from the probe with the shortest round trip, and its error bar
/// (half that round trip), s; `None` when `router.csv` has a row for no probe.
pub fn probe_offset(probes: &[ClockProbe], router: &[RouterRow]) -> Option<(f64, f64)> {
    let mut best: Option<(f64, f64)> = None;
    for p in probes {
        let Some(row) = router.iter().find(|r| r.request_id == p.request_id) else {
            continue;
        };
        let half = (p.answered_s - p.sent_s) / 2.0;
        let offset = row.arrival_s - (p.sent_s + half);
        if best.is_none_or(|(_, h)| half < h) {
            best = Some((offset, half));
        }
    }
    best
}

/// Router − driver clock offset: the smallest arrival − send gap (network time is never
/// negative, so the smallest gap is the closest to the offset).
pub fn router_minus_driver(client: &[ClientRow], router: &[RouterRow]) -> Option<f64> {
    let sent: BTreeMap<&str, f64> = client
        .iter()
        .filter_map(|c| c.sent_s.map(|s| (c.request_id.as_str(), s)))
        .collect();
    router
        .iter()
        .filter_map(|r| sent.get(r.request_id.as_str()).map(|s| r.arrival_s - s))
        .min_by(f64::total_cmp)
}
