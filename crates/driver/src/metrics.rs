//! Per-request latency metrics from chunk arrival times (pure).
//!
//! Definitions (docs/ARCHITECTURE.md, "Metrics"):
//! - TTFT = first content chunk − send.
//! - ITL p50 = median over the request's gaps between consecutive content chunks, each gap
//!   divided by the tokens that chunk carried (1 when the server did not say); the median is
//!   `schema::stats`'s (type 7), so an even count takes the mean of the two middle values.
//!   A chunk is what the client could tell apart: events that arrived in the same socket read
//!   (the same timestamp) are one chunk carrying all their tokens. Counting them as separate
//!   chunks would add a 0 ms gap for each — when the client is starved of CPU and reads a burst,
//!   the ITL p50 would fall to 0 and derive an SLO bound of 0.
//! - TPOT = (last content chunk − first content chunk) ÷ (output tokens − 1).
//! - E2E = end of the response (or the failure) − send.

use std::time::Duration;

use schema::stats::quantile_in_place;

/// One content chunk: when it arrived and how many tokens it carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkMark {
    /// Arrival, since the driver's clock start.
    pub at: Duration,
    /// Tokens in the chunk (≥ 1).
    pub tokens: u32,
}

/// Derived per-request latencies, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Latencies {
    /// Time to first content token.
    pub ttft_ms: Option<f64>,
    /// Median per-token inter-chunk gap.
    pub itl_p50_ms: Option<f64>,
    /// Mean time per output token after the first.
    pub tpot_ms: Option<f64>,
    /// Send to end of response.
    pub e2el_ms: Option<f64>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Computes the latencies of one request.
///
/// `output_tokens` is the server's count when it sent one, else the sum of chunk tokens.
pub fn latencies(
    sent: Duration,
    chunks: &[ChunkMark],
    end: Option<Duration>,
    output_tokens: Option<u64>,
) -> Latencies {
    let first = chunks.first().map(|c| c.at);
    let last = chunks.last().map(|c| c.at);
    let mut gaps: Vec<f64> = Vec::with_capacity(chunks.len());
    // (arrival, tokens) of the chunk being gathered, and of the one before it.
    let mut prev: Option<Duration> = None;
    let mut cur: Option<(Duration, u32)> = None;
    for c in chunks {
        match cur {
            Some((at, tokens)) if at == c.at => {
                cur = Some((at, tokens.saturating_add(c.tokens.max(1))));
            }
            _ => {
                if let Some((at, tokens)) = cur {
                    if let Some(p) = prev {
                        gaps.push(ms(at.saturating_sub(p)) / f64::from(tokens));
                    }
                    prev = Some(at);
                }
                cur = Some((c.at, c.tokens.max(1)));
            }
        }
    }
    if let (Some(p), Some((at, tokens))) = (prev, cur) {
        gaps.push(ms(at.saturating_sub(p)) / f64::from(tokens));
    }
    let tpot_ms = match (first, last, output_tokens) {
        (Some(f), Some(l), Some(n)) if n > 1 => Some(ms(l.saturating_sub(f)) / (n - 1) as f64),
        _ => None,
    };
    Latencies {
        ttft_ms: first.map(|f| ms(f.saturating_sub(sent))),
        itl_p50_ms: quantile_in_place(&mut gaps, 0.5),
        tpot_ms,
        e2el_ms: end.map(|e| ms(e.saturating_sub(sent))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at_ms(v: u64, tokens: u32) -> ChunkMark {
        ChunkMark {
            at: Duration::from_millis(v),
            tokens,
        }
    }

    #[test]
    fn exact_values() {
        let chunks = [at_ms(110, 1), at_ms(120, 1), at_ms(150, 3), at_ms(158, 1)];
        let l = latencies(
            Duration::from_millis(10),
            &chunks,
            Some(Duration::from_millis(160)),
            Some(6),
        );
        assert_eq!(l.ttft_ms, Some(100.0));
        // Gaps per token: 10, 30/3 = 10, 8 → median 10.
        assert_eq!(l.itl_p50_ms, Some(10.0));
        assert_eq!(l.tpot_ms, Some(48.0 / 5.0));
        assert_eq!(l.e2el_ms, Some(150.0));
    }

    #[test]
    fn even_count_median_and_single_chunk() {
        // Gaps 10, 20, 40, 30: the mean of the middle two.
        let even = [
            at_ms(0, 1),
            at_ms(10, 1),
            at_ms(30, 1),
            at_ms(70, 1),
            at_ms(100, 1),
        ];
        let l = latencies(Duration::ZERO, &even, None, None);
        assert_eq!(l.itl_p50_ms, Some(25.0));
        let l = latencies(Duration::ZERO, &[at_ms(5, 1)], None, Some(1));
        assert_eq!(l.ttft_ms, Some(5.0));
        assert_eq!(l.itl_p50_ms, None);
        assert_eq!(l.tpot_ms, None);
        assert_eq!(l.e2el_ms, None);
    }

    #[test]
    fn events_of_one_read_are_one_chunk() {
        // A starved client reads bursts: 2 events at 10 ms, 3 at 16 ms, 1 at 18 ms. Gaps per
        // token: 6/3 = 2, 2/1 = 2 — not the 0 ms gaps that separate events of one read give.
        let burst = [
            at_ms(10, 1),
            at_ms(10, 1),
            at_ms(16, 1),
            at_ms(16, 1),
            at_ms(16, 1),
            at_ms(18, 1),
        ];
        let l = latencies(Duration::ZERO, &burst, None, Some(6));
        assert_eq!(l.itl_p50_ms, Some(2.0));
        assert_eq!(l.ttft_ms, Some(10.0));
        // TPOT keeps its definition: (last − first) ÷ (tokens − 1).
        assert_eq!(l.tpot_ms, Some(8.0 / 5.0));
        // One read with the whole reply: no gap to measure.
        let one = [at_ms(4, 1), at_ms(4, 2)];
        assert_eq!(
            latencies(Duration::ZERO, &one, None, Some(3)).itl_p50_ms,
            None
        );
    }
}
