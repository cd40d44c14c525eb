//! Prometheus counters and the router-overhead histogram, all lock-free on the request path.
//!
//! The exposition is written with `format!`, not a metrics library: the series are fixed and
//! few, and `prometheus-client` would change the bytes (OpenMetrics `# EOF`, its own suffix and
//! float rules). The tests read the output back with `prom_text`, the parser the harness uses.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// Decision branch names in a fixed order (the policies contract's `Branch::as_str` values).
pub const BRANCHES: [&str; 10] = [
    "match",
    "tie",
    "miss",
    "spill-load",
    "spill-residency",
    "ring",
    "ring-walk",
    "rr",
    "least",
    "random",
];

/// Upper bounds (µs) of the overhead histogram's buckets; `+Inf` is implicit.
pub const OVERHEAD_BUCKETS_US: [u64; 14] = [
    5, 10, 20, 30, 50, 75, 100, 150, 250, 500, 1_000, 2_500, 5_000, 10_000,
];

/// Prompt-token mismatches logged one by one before only every [`MISMATCH_LOG_EVERY`]th is.
pub const MISMATCH_LOG_FIRST: u64 = 5;

/// Past the first [`MISMATCH_LOG_FIRST`], one prompt-token mismatch in this many is logged.
pub const MISMATCH_LOG_EVERY: u64 = 100;

/// Router-wide counters. Per-replica counters live on the replica.
#[derive(Debug, Default)]
pub struct Metrics {
    /// LLM requests received (completions and chat).
    pub requests: AtomicU64,
    /// Requests refused with 400.
    pub bad_requests: AtomicU64,
    /// Requests refused with 413.
    pub too_large: AtomicU64,
    /// Requests answered 503 because no replica was eligible.
    pub no_replica: AtomicU64,
    /// Upstream attempts beyond the first (retries before the first byte).
    pub retries: AtomicU64,
    /// Streams whose upstream failed after headers were sent to the client.
    pub stream_errors: AtomicU64,
    /// LLM requests whose client went away before their response ended (while sending the
    /// body, waiting for the head, or mid-stream).
    pub client_disconnects: AtomicU64,
    /// Tokenize round trips that failed (the request was routed without exact keys).
    pub tokenize_errors: AtomicU64,
    /// LLM requests refused with 408: the body did not arrive within the body-read timeout.
    pub body_timeouts: AtomicU64,
    /// Connections closed because a request head did not arrive within the header-read
    /// timeout (idle keep-alive connections closed by the same timer are not counted).
    pub header_timeouts: AtomicU64,
    /// Connections past `--max-connections`, answered 503 (or closed at once when even the
    /// refusals are at their bound).
    pub connections_refused: AtomicU64,
    /// Client connections open on the serving port (a gauge).
    pub connections_open: AtomicU64,
    /// LLM requests answered 429: every eligible replica at its in-flight ceiling.
    pub overloaded: AtomicU64,
    /// Upstream attempts that timed out: no response head in time (504) or a silent stream.
    pub upstream_timeouts: AtomicU64,
    /// Admin requests refused with 401 (missing or wrong bearer token).
    pub admin_unauthorized: AtomicU64,
    /// Requests whose prompt length the router knew (it tokenized them, or they came
    /// pre-tokenised) and whose engine reported `usage.prompt_tokens`: compared.
    pub prompt_tokens_compared: AtomicU64,
    /// Of those, the ones where the two counts differ: the router's `/tokenize` body does not
    /// tokenize as the engine's request does, so its exact keys cannot match the engine's blocks.
    pub prompt_token_mismatches: AtomicU64,
    /// Replicas whose startup token-parity probes agreed with their engine ([`crate::parity`]).
    pub token_parity_agreed: AtomicU64,
    /// Replicas the token-parity probes could not check (unreachable, an error status).
    pub token_parity_unchecked: AtomicU64,
    decisions: [AtomicU64; BRANCHES.len() + 1],
    overhead_buckets: [AtomicU64; OVERHEAD_BUCKETS_US.len() + 1],
    overhead_sum_us: AtomicU64,
    decide_sum_ns: AtomicU64,
}

impl Metrics {
    /// Counts one decision of the named branch (unknown names land in `other`).
    pub fn record_decision(&self, branch: &str, decide_ns: u64) {
        let i = BRANCHES
            .iter()
            .position(|b| *b == branch)
            .unwrap_or(BRANCHES.len());
        self.decisions[i].fetch_add(1, Ordering::Relaxed);
        self.decide_sum_ns.fetch_add(decide_ns, Ordering::Relaxed);
    }

    /// Records one request's router overhead.
    pub fn record_overhead(&self, overhead_us: u64) {
        let i = OVERHEAD_BUCKETS_US
            .iter()
            .position(|&b| overhead_us <= b)
            .unwrap_or(OVERHEAD_BUCKETS_US.len());
        self.overhead_buckets[i].fetch_add(1, Ordering::Relaxed);
        self.overhead_sum_us
            .fetch_add(overhead_us, Ordering::Relaxed);
    }

    /// Compares the router's prompt length for a request (`router`: the token ids it keyed, in
    /// full) with the engine's `usage.prompt_tokens` (`engine`), counting the comparison and any
    /// mismatch. Mismatches are logged to stderr with the request id — the first
    /// [`MISMATCH_LOG_FIRST`], then every [`MISMATCH_LOG_EVERY`]th — so a tokenization drift is
    /// loud without flooding the log. True when they differ.
    pub fn record_prompt_tokens(&self, request_id: &str, router: u64, engine: u64) -> bool {
        self.prompt_tokens_compared.fetch_add(1, Ordering::Relaxed);
        if router == engine {
            return false;
        }
        let n = self.prompt_token_mismatches.fetch_add(1, Ordering::Relaxed) + 1;
        if n <= MISMATCH_LOG_FIRST || n.is_multiple_of(MISMATCH_LOG_EVERY) {
            eprintln!(
                "kvroute: prompt token mismatch #{n}: request {request_id}: router tokenized {router} tokens, engine reported prompt_tokens {engine}"
            );
        }
        true
    }

    /// Decisions counted for `branch`.
    pub fn decisions(&self, branch: &str) -> u64 {
        BRANCHES
            .iter()
            .position(|b| *b == branch)
            .map_or(0, |i| self.decisions[i].load(Ordering::Relaxed))
    }

    /// Renders the router-wide part of the Prometheus exposition.
    pub fn render_into(&self, out: &mut String, policy: &str) {
        let c = |out: &mut String, name: &str, help: &str, v: &AtomicU64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        };
        c(
            out,
            "kvroute_router_requests_total",
            "LLM requests received.",
            &self.requests,
        );
        c(
            out,
            "kvroute_router_bad_requests_total",
            "Requests refused with 400.",
            &self.bad_requests,
        );
        c(
            out,
            "kvroute_router_too_large_total",
            "Requests refused with 413.",
            &self.too_large,
        );
        c(
            out,
            "kvroute_router_no_replica_total",
            "Requests refused with 503 (no eligible replica).",
            &self.no_replica,
        );
        c(
            out,
            "kvroute_router_retries_total",
            "Upstream retries before the first byte.",
            &self.retries,
        );
        c(
            out,
            "kvroute_router_stream_errors_total",
            "Upstream failures after the response started.",
            &self.stream_errors,
        );
        c(
            out,
            "kvroute_router_client_disconnects_total",
            "LLM requests whose client went away before the response ended.",
            &self.client_disconnects,
        );
        c(
            out,
            "kvroute_router_tokenize_errors_total",
            "Failed tokenize round trips.",
            &self.tokenize_errors,
        );
        c(
            out,
            "kvroute_router_body_timeouts_total",
            "Requests refused with 408 (body not received in time).",
            &self.body_timeouts,
        );
        c(
            out,
            "kvroute_router_header_timeouts_total",
            "Connections closed for a request head not received in time.",
            &self.header_timeouts,
        );
        c(
            out,
            "kvroute_router_connections_refused_total",
            "Connections refused past --max-connections.",
            &self.connections_refused,
        );
        let _ = writeln!(
            out,
            "# HELP kvroute_router_connections_open Client connections open on the serving port.\n# TYPE kvroute_router_connections_open gauge\nkvroute_router_connections_open {}",
            self.connections_open.load(Ordering::Relaxed)
        );
        c(
            out,
            "kvroute_router_overloaded_total",
            "Requests answered 429 (every eligible replica at its in-flight ceiling).",
            &self.overloaded,
        );
        c(
            out,
            "kvroute_router_upstream_timeouts_total",
            "Upstream attempts that timed out (no response head, or a silent stream).",
            &self.upstream_timeouts,
        );
        c(
            out,
            "kvroute_router_admin_unauthorized_total",
            "Admin requests refused with 401.",
            &self.admin_unauthorized,
        );
        c(
            out,
            "kvroute_router_prompt_tokens_compared_total",
            "Requests whose router-side prompt length was compared with the engine's usage.prompt_tokens.",
            &self.prompt_tokens_compared,
        );
        c(
            out,
            "kvroute_router_prompt_token_mismatches_total",
            "Compared requests whose router-side prompt length differs from the engine's usage.prompt_tokens.",
            &self.prompt_token_mismatches,
        );
        c(
            out,
            "kvroute_router_token_parity_agreed_total",
            "Replicas whose token-parity probes agreed with their engine (at startup or when added).",
            &self.token_parity_agreed,
        );
        c(
            out,
            "kvroute_router_token_parity_unchecked_total",
            "Replicas the token-parity probes could not check (unreachable or an error status).",
            &self.token_parity_unchecked,
        );

        out.push_str("# HELP kvroute_router_decisions_total Routing decisions by policy branch.\n# TYPE kvroute_router_decisions_total counter\n");
        for (i, b) in BRANCHES.iter().chain(std::iter::once(&"other")).enumerate() {
            let _ = writeln!(
                out,
                "kvroute_router_decisions_total{{policy=\"{policy}\",branch=\"{b}\"}} {}",
                self.decisions[i].load(Ordering::Relaxed)
            );
        }
        let total: u64 = self
            .decisions
            .iter()
            .map(|d| d.load(Ordering::Relaxed))
            .sum();
        let _ = writeln!(
            out,
            "# HELP kvroute_router_decide_ns_sum Nanoseconds spent in Policy::decide.\n# TYPE kvroute_router_decide_ns_sum counter\nkvroute_router_decide_ns_sum {}\nkvroute_router_decide_count {total}",
            self.decide_sum_ns.load(Ordering::Relaxed)
        );

        out.push_str("# HELP kvroute_router_overhead_us Router overhead per request (arrival to upstream write, plus upstream first byte to client first byte).\n# TYPE kvroute_router_overhead_us histogram\n");
        let mut cum = 0;
        for (i, b) in OVERHEAD_BUCKETS_US.iter().enumerate() {
            cum += self.overhead_buckets[i].load(Ordering::Relaxed);
            let _ = writeln!(out, "kvroute_router_overhead_us_bucket{{le=\"{b}\"}} {cum}");
        }
        cum += self.overhead_buckets[OVERHEAD_BUCKETS_US.len()].load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "kvroute_router_overhead_us_bucket{{le=\"+Inf\"}} {cum}"
        );
        let _ = writeln!(
            out,
            "kvroute_router_overhead_us_sum {}",
            self.overhead_sum_us.load(Ordering::Relaxed)
        );
        let _ = writeln!(out, "kvroute_router_overhead_us_count {cum}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative_and_decisions_labelled() {
        let m = Metrics::default();
        m.record_overhead(3);
        m.record_overhead(40);
        m.record_overhead(1_000_000);
        m.record_decision("match", 100);
        m.record_decision("bogus", 1);
        let mut s = String::new();
        m.render_into(&mut s, "prefix-affinity");
        assert!(s.contains("kvroute_router_overhead_us_bucket{le=\"5\"} 1\n"));
        assert!(s.contains("kvroute_router_overhead_us_bucket{le=\"50\"} 2\n"));
        assert!(s.contains("kvroute_router_overhead_us_bucket{le=\"+Inf\"} 3\n"));
        assert!(s.contains(
            "kvroute_router_decisions_total{policy=\"prefix-affinity\",branch=\"match\"} 1\n"
        ));
        assert!(s.contains("branch=\"other\"} 1\n"));
        assert_eq!(m.decisions("match"), 1);
    }

    #[test]
    fn exposition_reads_back_whole() {
        let m = Metrics::default();
        m.requests.fetch_add(7, Ordering::Relaxed);
        m.record_overhead(40);
        m.record_decision("spill-load", 10);
        let mut s = String::new();
        m.render_into(&mut s, "prefix-affinity");
        let mut samples = Vec::new();
        for line in s.lines() {
            match prom_text::parse_line(line) {
                Ok(prom_text::Line::Sample(x)) => samples.push(x),
                Ok(prom_text::Line::Help { .. } | prom_text::Line::Type { .. }) => {}
                other => panic!("`{line}` is not exposition text: {other:?}"),
            }
        }
        let value = |name: &str, label: Option<(&str, &str)>| {
            samples
                .iter()
                .find(|x| x.name == name && label.is_none_or(|(k, v)| x.label(k) == Some(v)))
                .map(|x| x.value)
        };
        assert_eq!(value("kvroute_router_requests_total", None), Some(7.0));
        assert_eq!(
            value(
                "kvroute_router_decisions_total",
                Some(("branch", "spill-load"))
            ),
            Some(1.0)
        );
        assert_eq!(
            value("kvroute_router_overhead_us_bucket", Some(("le", "+Inf"))),
            Some(1.0)
        );
        assert_eq!(value("kvroute_router_decide_count", None), Some(1.0));
    }

    #[test]
    fn prompt_token_parity_counts_comparisons_and_mismatches() {
        let m = Metrics::default();
        assert!(!m.record_prompt_tokens("kvr-a", 1100, 1100));
        assert!(m.record_prompt_tokens("kvr-b", 1100, 1101));
        let mut s = String::new();
        m.render_into(&mut s, "exact-residency");
        assert!(s.contains("kvroute_router_prompt_tokens_compared_total 2\n"));
        assert!(s.contains("kvroute_router_prompt_token_mismatches_total 1\n"));
    }
}
