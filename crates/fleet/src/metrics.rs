//! What the harness reads from a replica's `/metrics`, on top of [`prom_text`] (the one
//! Prometheus text parser of the workspace).
//!
//! Two things are read: the KV cache shape (`vllm:cache_config_info{block_size,num_gpu_blocks}`,
//! emitted by vLLM and by the emulator alike) and histograms such as the emulator's
//! `kvroute_engine_lateness_seconds`. Histograms are cumulative since the process started, so the
//! evidence of one measured window is the difference of two scrapes ([`Histogram::delta`]).

use std::collections::BTreeMap;

use prom_text::{parse_value, samples};

/// A replica's KV cache shape, from `vllm:cache_config_info`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CacheConfig {
    /// Tokens per KV block.
    pub block_size_tokens: u64,
    /// Blocks in the pool.
    pub num_gpu_blocks: u64,
}

impl CacheConfig {
    /// `num_gpu_blocks × block_size`, the replica's KV capacity in tokens.
    pub fn capacity_tokens(&self) -> u64 {
        self.num_gpu_blocks * self.block_size_tokens
    }
}

/// Reads `vllm:cache_config_info{block_size=…,num_gpu_blocks=…}` from an exposition.
pub fn cache_config(text: &str) -> Option<CacheConfig> {
    samples(text)
        .filter(|s| s.name == "vllm:cache_config_info")
        .find_map(|s| {
            Some(CacheConfig {
                block_size_tokens: s.label("block_size")?.parse().ok()?,
                num_gpu_blocks: s.label("num_gpu_blocks")?.parse().ok()?,
            })
        })
}

/// A cumulative histogram: `(upper bound, cumulative count)` sorted by bound, summed over label
/// sets other than `le`.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct Histogram {
    /// `(le, cumulative count)`, ascending `le`; the last bound is usually `+Inf`.
    pub buckets: Vec<(f64, f64)>,
    /// `_count`.
    pub count: f64,
    /// `_sum`.
    pub sum: f64,
}

impl Histogram {
    /// Reads histogram `name` (without the `_bucket` suffix); `None` when absent.
    pub fn from_text(text: &str, name: &str) -> Option<Histogram> {
        let bucket_name = format!("{name}_bucket");
        let count_name = format!("{name}_count");
        let sum_name = format!("{name}_sum");
        let mut by_le: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
        let mut hist = Histogram::default();
        let mut seen = false;
        for s in samples(text) {
            if s.name == bucket_name {
                let Some(le) = s.label("le").and_then(parse_value) else {
                    continue;
                };
                seen = true;
                // Order by the bound itself; f64 bits order correctly for non-negative bounds.
                let entry = by_le.entry(le.max(0.0).to_bits()).or_insert((le, 0.0));
                entry.1 += s.value;
            } else if s.name == count_name {
                hist.count += s.value;
            } else if s.name == sum_name {
                hist.sum += s.value;
            }
        }
        if !seen {
            return None;
        }
        hist.buckets = by_le.into_values().collect();
        Some(hist)
    }

    /// What accrued between `earlier` and `self` (two scrapes of one process).
    ///
    /// If the process restarted in between (counts went down), `self` is returned unchanged,
    /// which is exactly what accrued since the restart.
    pub fn delta(&self, earlier: &Histogram) -> Histogram {
        if earlier.count > self.count || earlier.buckets.len() != self.buckets.len() {
            return self.clone();
        }
        Histogram {
            buckets: self
                .buckets
                .iter()
                .zip(&earlier.buckets)
                .map(|(&(le, now), &(_, then))| (le, (now - then).max(0.0)))
                .collect(),
            count: self.count - earlier.count,
            sum: self.sum - earlier.sum,
        }
    }

    /// The upper bound of the bucket holding quantile `q` (0..=1): a conservative estimate.
    /// `None` without observations; `f64::INFINITY` when it falls past the last finite bound.
    pub fn quantile_upper_bound(&self, q: f64) -> Option<f64> {
        let total = self.buckets.last().map_or(0.0, |b| b.1).max(self.count);
        if total <= 0.0 {
            return None;
        }
        let rank = (q.clamp(0.0, 1.0) * total).ceil().max(1.0);
        self.buckets
            .iter()
            .find(|(_, cum)| *cum >= rank)
            .map(|(le, _)| *le)
            .or(Some(f64::INFINITY))
    }

    /// Mean observation, `None` without observations.
    pub fn mean(&self) -> Option<f64> {
        (self.count > 0.0).then(|| self.sum / self.count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXPO: &str = r#"# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="2048",prefix_caching="True"} 1.0
vllm:num_requests_running{model_name="m",engine="0"} 3
# TYPE kvroute_engine_lateness_seconds histogram
kvroute_engine_lateness_seconds_bucket{engine="0",le="0.0005"} 90
kvroute_engine_lateness_seconds_bucket{engine="0",le="0.001"} 98
kvroute_engine_lateness_seconds_bucket{engine="0",le="0.005"} 100
kvroute_engine_lateness_seconds_bucket{engine="0",le="+Inf"} 100
kvroute_engine_lateness_seconds_count{engine="0"} 100
kvroute_engine_lateness_seconds_sum{engine="0"} 0.04
"#;

    #[test]
    fn reads_cache_config() {
        let cfg = cache_config(EXPO).expect("cache config present");
        assert_eq!(cfg.block_size_tokens, 16);
        assert_eq!(cfg.num_gpu_blocks, 2048);
        assert_eq!(cfg.capacity_tokens(), 32_768);
        assert_eq!(cache_config("up 1\n"), None);
    }

    #[test]
    fn timestamped_scrapes_read_the_same() {
        let stamped: String = EXPO
            .lines()
            .map(|l| {
                if l.starts_with('#') {
                    format!("{l}\n")
                } else {
                    format!("{l} 1700000000000\n")
                }
            })
            .collect();
        assert_eq!(cache_config(&stamped), cache_config(EXPO));
        assert_eq!(
            Histogram::from_text(&stamped, "kvroute_engine_lateness_seconds"),
            Histogram::from_text(EXPO, "kvroute_engine_lateness_seconds")
        );
    }

    #[test]
    fn histogram_quantiles_and_window_delta() {
        let h = Histogram::from_text(EXPO, "kvroute_engine_lateness_seconds").unwrap();
        assert_eq!(h.count, 100.0);
        assert_eq!(h.quantile_upper_bound(0.5), Some(0.0005));
        assert_eq!(h.quantile_upper_bound(0.98), Some(0.001));
        assert_eq!(h.quantile_upper_bound(0.99), Some(0.005));
        // A window that saw only late steps: 10 new observations, all in the 5 ms bucket.
        let later = Histogram {
            buckets: vec![
                (0.0005, 90.0),
                (0.001, 98.0),
                (0.005, 110.0),
                (f64::INFINITY, 110.0),
            ],
            count: 110.0,
            sum: 0.09,
        };
        let d = later.delta(&h);
        assert_eq!(d.count, 10.0);
        assert_eq!(d.quantile_upper_bound(0.5), Some(0.005));
        assert!((d.mean().unwrap() - 0.005).abs() < 1e-9);
        // Restarted process: the later scrape stands alone.
        let restarted = Histogram {
            count: 5.0,
            ..later.clone()
        };
        assert_eq!(restarted.delta(&h).count, 5.0);
        assert_eq!(Histogram::default().quantile_upper_bound(0.99), None);
    }

    #[test]
    fn quantile_past_last_finite_bound_is_infinite() {
        let h = Histogram {
            buckets: vec![(0.001, 1.0), (f64::INFINITY, 10.0)],
            count: 10.0,
            sum: 1.0,
        };
        assert_eq!(h.quantile_upper_bound(0.99), Some(f64::INFINITY));
    }
}
