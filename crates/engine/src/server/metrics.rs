//! Prometheus text rendering of the engine's `vllm:` series and its own lateness histogram.
//!
//! Written with `format!`, not a metrics library: the names, labels and value spellings mirror
//! vLLM's exposition (the router and the harness read them as they would vLLM's), and
//! `prometheus-client` would change those bytes (OpenMetrics `# EOF`, its own suffix and float
//! rules). The tests read the output back with `prom_text`, the parser the router and harness
//! use.

use std::fmt::Write as _;

use crate::config::CacheModel;
use crate::core::Counters;

/// A Prometheus histogram with fixed bucket bounds (seconds).
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

/// Buckets of vLLM's `time_to_first_token_seconds`.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// Buckets of vLLM's `inter_token_latency_seconds`.
pub const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// Buckets of vLLM's request-level latency histograms (e2e, queue).
pub const REQUEST_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// Buckets of `kvroute_engine_lateness_seconds`: fine (≤ 50 µs apart) up to 0.5 ms, where the
/// sweep's bound lies — a quarter of the ITL floor in model time, ÷ speed: ~0.33 ms wall at speed
/// 6 on the emulated 8B model — so the p99's bucket bound (what the check compares) overstates
/// the true p99 by little.
pub const LATENESS_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00015, 0.0002, 0.00025, 0.0003, 0.00035, 0.0004, 0.00045, 0.0005, 0.0006,
    0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

impl Histogram {
    /// An empty histogram over `bounds` (ascending, `+Inf` implied).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    /// Records one observation in seconds.
    pub fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    /// Observations recorded.
    pub fn count(&self) -> u64 {
        self.count
    }

    fn render(&self, out: &mut String, name: &str, labels: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cum += c;
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b}\"}} {cum}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
    }
}

/// Everything `/metrics` shows, updated by the engine thread after each step.
#[derive(Debug, Clone)]
pub struct MetricsState {
    /// Engine counters.
    pub counters: Counters,
    /// Requests in the running batch.
    pub running: usize,
    /// Requests waiting (frontend-pending ones included, as vLLM counts them once queued).
    pub waiting: usize,
    /// KV cache usage fraction.
    pub kv_usage: f64,
    /// Time to first token, s.
    pub ttft: Histogram,
    /// Gap between consecutive tokens of a request, s.
    pub itl: Histogram,
    /// Arrival to last token, s.
    pub e2e: Histogram,
    /// Frontend-done to first scheduled, s.
    pub queue: Histogram,
    /// Emission time minus modelled step end, s.
    pub lateness: Histogram,
    /// Lateness in µs, for exact quantiles (benchmarks, evidence).
    pub lateness_us: hdrhistogram::Histogram<u64>,
    /// Requests finished, by reason.
    pub finished_stop: u64,
    /// Requests finished by length.
    pub finished_length: u64,
    /// Requests aborted (client gone).
    pub aborted: u64,
    /// `SCHED_FIFO` priority of the engine's threads; 0 under `SCHED_OTHER` (see `sched`).
    pub sched_fifo_priority: u8,
}

impl Default for MetricsState {
    fn default() -> Self {
        Self {
            counters: Counters::default(),
            running: 0,
            waiting: 0,
            kv_usage: 0.0,
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(REQUEST_BUCKETS),
            queue: Histogram::new(REQUEST_BUCKETS),
            lateness: Histogram::new(LATENESS_BUCKETS),
            // Bounded so saturating_record clamps only past 60 s (an auto-resizing histogram clamps
            // at its initial 2 ms range).
            lateness_us: hdrhistogram::Histogram::new_with_bounds(1, 60_000_000, 3)
                .expect("valid bounds"),
            finished_stop: 0,
            finished_length: 0,
            aborted: 0,
            sched_fifo_priority: 0,
        }
    }
}

fn gauge(out: &mut String, name: &str, labels: &str, help: &str, v: f64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {v}"
    );
}

fn counter(out: &mut String, name: &str, labels: &str, help: &str, v: u64) {
    let _ = writeln!(
        out,
        "# HELP {name}_total {help}\n# TYPE {name}_total counter\n{name}_total{{{labels}}} {v}"
    );
}

/// Appends `kvroute_engine_cache_model_info{cache_model=…}` 1: which cache the replica models
/// (`paged`, or `llama-slots` with its `parallel_slots`, `slot_prompt_similarity` and
/// `ctx_tokens`).
pub fn render_cache_model(out: &mut String, cache_model: &CacheModel) {
    let labels = match *cache_model {
        CacheModel::Paged => "cache_model=\"paged\"".to_string(),
        CacheModel::LlamaSlots {
            slots,
            similarity,
            ctx_tokens,
        } => format!(
            "cache_model=\"llama-slots\",ctx_tokens=\"{ctx_tokens}\",parallel_slots=\"{slots}\",slot_prompt_similarity=\"{similarity}\""
        ),
    };
    let _ = writeln!(
        out,
        "# HELP kvroute_engine_cache_model_info The KV cache this emulated replica models.\n# TYPE kvroute_engine_cache_model_info gauge\nkvroute_engine_cache_model_info{{{labels}}} 1"
    );
}

/// Renders the Prometheus exposition text.
pub fn render(m: &MetricsState, model_name: &str, block_size: u32, num_gpu_blocks: u32) -> String {
    let mut out = String::with_capacity(8192);
    let model = model_name.replace('\\', "\\\\").replace('"', "\\\"");
    let l = format!("engine=\"0\",model_name=\"{model}\"");
    gauge(
        &mut out,
        "vllm:num_requests_running",
        &l,
        "Number of requests in model execution batches.",
        m.running as f64,
    );
    gauge(
        &mut out,
        "vllm:num_requests_waiting",
        &l,
        "Number of requests waiting to be processed.",
        m.waiting as f64,
    );
    gauge(
        &mut out,
        "vllm:kv_cache_usage_perc",
        &l,
        "KV-cache usage. 1 means 100 percent usage.",
        m.kv_usage,
    );
    gauge(
        &mut out,
        "vllm:gpu_cache_usage_perc",
        &l,
        "GPU KV-cache usage (older name).",
        m.kv_usage,
    );
    counter(
        &mut out,
        "vllm:prefix_cache_queries",
        &l,
        "Prefix cache queries, in terms of number of queried tokens.",
        m.counters.prefix_cache_queries_tokens,
    );
    counter(
        &mut out,
        "vllm:prefix_cache_hits",
        &l,
        "Prefix cache hits, in terms of number of cached tokens.",
        m.counters.prefix_cache_hits_tokens,
    );
    counter(
        &mut out,
        "vllm:num_preemptions",
        &l,
        "Cumulative number of preemption from the engine.",
        m.counters.preemptions,
    );
    counter(
        &mut out,
        "vllm:prompt_tokens",
        &l,
        "Number of prefill tokens processed.",
        m.counters.prompt_tokens,
    );
    counter(
        &mut out,
        "vllm:generation_tokens",
        &l,
        "Number of generation tokens processed.",
        m.counters.generation_tokens,
    );
    let _ = writeln!(
        out,
        "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter"
    );
    let _ = writeln!(
        out,
        "vllm:request_success_total{{{l},finished_reason=\"stop\"}} {}",
        m.finished_stop
    );
    let _ = writeln!(
        out,
        "vllm:request_success_total{{{l},finished_reason=\"length\"}} {}",
        m.finished_length
    );
    let _ = writeln!(
        out,
        "vllm:request_success_total{{{l},finished_reason=\"abort\"}} {}",
        m.aborted
    );
    let _ = writeln!(
        out,
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\n\
         vllm:cache_config_info{{block_size=\"{block_size}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"{num_gpu_blocks}\"}} 1.0"
    );
    m.ttft.render(
        &mut out,
        "vllm:time_to_first_token_seconds",
        &l,
        "Histogram of time to first token in seconds.",
    );
    m.itl.render(
        &mut out,
        "vllm:inter_token_latency_seconds",
        &l,
        "Histogram of inter-token latency in seconds.",
    );
    m.e2e.render(
        &mut out,
        "vllm:e2e_request_latency_seconds",
        &l,
        "Histogram of e2e request latency in seconds.",
    );
    m.queue.render(
        &mut out,
        "vllm:request_queue_time_seconds",
        &l,
        "Histogram of time spent in WAITING phase for request.",
    );
    m.lateness.render(
        &mut out,
        "kvroute_engine_lateness_seconds",
        &l,
        "How far each step's emission fell behind its modelled time.",
    );
    gauge(
        &mut out,
        "kvroute_engine_sched_fifo_priority",
        &l,
        "SCHED_FIFO priority of the engine's threads (0: SCHED_OTHER).",
        f64::from(m.sched_fifo_priority),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_lateness_quantiles_are_not_clamped() {
        let mut m = MetricsState::default();
        for us in [100, 5_000, 17_000] {
            m.lateness_us.saturating_record(us);
        }
        assert!(m.lateness_us.max() >= 16_990, "{}", m.lateness_us.max());
    }

    #[test]
    fn renders_cache_config_and_cumulative_buckets() {
        let mut m = MetricsState::default();
        m.lateness.observe(0.0002);
        m.lateness.observe(0.003);
        m.counters.prefix_cache_hits_tokens = 1008;
        let s = render(&m, "kvroute/emulated-8b", 16, 2048);
        assert!(s.contains("vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"2048\"} 1.0"));
        assert!(s.contains(
            "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"kvroute/emulated-8b\"} 1008"
        ));
        assert!(s.contains("kvroute_engine_lateness_seconds_bucket{engine=\"0\",model_name=\"kvroute/emulated-8b\",le=\"0.00025\"} 1"));
        assert!(s.contains("kvroute_engine_lateness_seconds_bucket{engine=\"0\",model_name=\"kvroute/emulated-8b\",le=\"+Inf\"} 2"));
    }

    fn find_value(samples: &[prom_text::Sample], name: &str) -> f64 {
        samples.iter().find(|x| x.name == name).unwrap().value
    }

    #[test]
    fn exposition_reads_back_whole() {
        let mut m = MetricsState {
            kv_usage: 0.25,
            sched_fifo_priority: 1,
            ..MetricsState::default()
        };
        m.ttft.observe(0.03);
        let s = render(&m, "a \"quoted\" model", 16, 2048);
        let mut samples = Vec::new();
        let mut typed = 0;
        for line in s.lines() {
            match prom_text::parse_line(line) {
                Ok(prom_text::Line::Sample(x)) => samples.push(x),
                Ok(prom_text::Line::Type { .. }) => typed += 1,
                Ok(prom_text::Line::Help { .. }) => {}
                other => panic!("`{line}` is not exposition text: {other:?}"),
            }
        }
        assert_eq!(typed, 17, "one TYPE per family");
        assert_eq!(
            find_value(&samples, "kvroute_engine_sched_fifo_priority"),
            1.0
        );
        let find = |name: &str| samples.iter().find(|x| x.name == name).unwrap();
        let usage = find("vllm:kv_cache_usage_perc");
        assert_eq!(usage.value, 0.25);
        assert_eq!(usage.label("model_name"), Some("a \"quoted\" model"));
        let cfg = find("vllm:cache_config_info");
        assert_eq!(cfg.label("num_gpu_blocks"), Some("2048"));
        assert_eq!(find("vllm:time_to_first_token_seconds_count").value, 1.0);
    }
}
