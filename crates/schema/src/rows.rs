//! The rows are the system of record: one `client.csv` row per request (the driver, or the
//! simulator on its virtual clock) and one `router.csv` row per routing decision (the router, or
//! the simulator). These are their columns, in contract order (docs/CONTRACTS.md, "Rows"); every
//! writer writes this header and every reader resolves its columns against it. Columns stay stable;
//! additions go at the end.
//!
//! Units are in the names: `_s` seconds since the writer's own monotonic start (6 decimals),
//! `_ms` milliseconds (3 decimals), `_us`, `_ns` as named. An empty cell is not applicable or
//! unknown.

/// The `error` kind of a client row the driver wrote for a turn it abandoned instead of sending
/// (`driver --abandon-after-ms`): `abandoned: …`. The driver writes it, the analysis counts such a
/// row as a TTFT miss.
pub const ABANDONED_ERROR_KIND: &str = "abandoned";

/// `client.csv` columns, in contract order.
pub const CLIENT_COLUMNS: [&str; 19] = [
    "request_id",
    "session_id",
    "turn",
    "scheduled_s",
    "sent_s",
    "first_token_s",
    "last_s",
    "ttft_ms",
    "itl_p50_ms",
    "tpot_ms",
    "e2el_ms",
    "prompt_tokens",
    "output_tokens",
    "cached_tokens",
    "status",
    "error",
    "warmup",
    "send_lag_ms",
    "chunks",
];

/// `router.csv` columns, in contract order.
pub const ROUTER_COLUMNS: [&str; 17] = [
    "request_id",
    "session_id",
    "arrival_s",
    "policy",
    "replica",
    "branch",
    "predicted_match_tokens",
    "outstanding_chosen",
    "outstanding_min",
    "decide_ns",
    "overhead_us",
    "tokenize_ms",
    "upstream_status",
    "cached_tokens",
    "prompt_tokens",
    "error",
    "attempts",
];

/// Whether two column lists name the same columns in the same order. A `const fn`, so a reader
/// that declares its columns by field name can check them against [`CLIENT_COLUMNS`] or
/// [`ROUTER_COLUMNS`] at compile time: `const _: () = assert!(same_columns(&MINE, &CLIENT_COLUMNS));`.
pub const fn same_columns(a: &[&str], b: &[&str]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        let (x, y) = (a[i].as_bytes(), b[i].as_bytes());
        if x.len() != y.len() {
            return false;
        }
        let mut j = 0;
        while j < x.len() {
            if x[j] != y[j] {
                return false;
            }
            j += 1;
        }
        i += 1;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_columns_compares_names_and_order() {
        assert!(same_columns(&CLIENT_COLUMNS, &CLIENT_COLUMNS));
        assert!(!same_columns(&CLIENT_COLUMNS, &ROUTER_COLUMNS));
        assert!(!same_columns(&["a", "b"], &["b", "a"]));
        assert!(!same_columns(&["ab"], &["a"]));
        assert!(same_columns(&[], &[]));
    }

    #[test]
    fn names_are_unique() {
        for cols in [&CLIENT_COLUMNS[..], &ROUTER_COLUMNS[..]] {
            let mut sorted = cols.to_vec();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), cols.len());
        }
    }
}
