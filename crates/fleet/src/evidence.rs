//! Evidence that a measured window was clean, sampled while it runs into `evidence.jsonl`.
//!
//! On GPUs (NVML): the processes on each card — any process outside the fleet's process groups
//! is foreign and spoils the cell —, SM clock, temperature and throttle reasons. On the emulated
//! fleet: each engine's lateness (`kvroute_engine_lateness_seconds` from `/metrics`), the
//! emulator's stand-in for a clean GPU, and the host's CPU load. No NVML library (or no driver)
//! is recorded as "no GPU", never an error.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use serde::Serialize;
use serde_json::json;

use crate::http;
use crate::metrics::Histogram;

/// The emulator's lateness histogram (docs/CONTRACTS.md / the engine issue).
pub const LATENESS_METRIC: &str = "kvroute_engine_lateness_seconds";

/// What to sample.
#[derive(Debug, Clone)]
pub struct EvidenceConfig {
    /// Replica base URLs whose `/metrics` carry the lateness histogram (empty: none).
    pub lateness_urls: Vec<String>,
    /// Process groups that belong to the fleet; a GPU process outside them is foreign.
    pub fleet_process_groups: Vec<u32>,
    /// Check GPU processes for foreigners (off for static fleets, whose processes are not ours).
    pub check_foreign: bool,
    /// Try NVML at all.
    pub gpu: bool,
    /// Time between samples.
    pub interval: Duration,
}

/// Per-replica lateness over the whole sampled window (first scrape to last).
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct LatenessSummary {
    /// Replica index.
    pub replica: usize,
    /// Steps observed in the window.
    pub steps: f64,
    /// Upper bound of the bucket holding the 99th percentile, ms (`None`: past the last bucket).
    pub p99_ms: Option<f64>,
    /// Mean lateness, ms.
    pub mean_ms: Option<f64>,
}

/// Per-card GPU observations over the window.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct GpuSummary {
    /// NVML device index.
    pub device: u32,
    /// Device name.
    pub name: String,
    /// Lowest and highest SM clock seen, MHz.
    pub sm_clock_mhz_min: Option<u32>,
    /// Highest SM clock seen, MHz.
    pub sm_clock_mhz_max: Option<u32>,
    /// Hottest reading, °C.
    pub temperature_c_max: Option<u32>,
    /// Share of samples with a throttle reason other than idle / application clocks.
    pub throttle_share: f64,
    /// Samples taken of this card.
    pub samples: u32,
}

/// Everything the evidence check needs, also written as the last line of `evidence.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct EvidenceSummary {
    /// Seconds sampled.
    pub duration_s: f64,
    /// Sampling rounds.
    pub samples: u32,
    /// `"ok"` or `"no GPU"`.
    pub gpu_status: String,
    /// Why there is no GPU evidence, when there is none.
    pub gpu_reason: Option<String>,
    /// Per card.
    pub gpus: Vec<GpuSummary>,
    /// Processes seen on a card that are not the fleet's: `(device, pid, why)`.
    pub foreign_processes: Vec<(u32, u32, String)>,
    /// Per emulated replica.
    pub lateness: Vec<LatenessSummary>,
    /// Highest 1-minute load average seen.
    pub loadavg_1m_max: Option<f64>,
    /// Mean share of CPU time busy across the window (0..1).
    pub cpu_busy_mean: Option<f64>,
    /// Host CPUs.
    pub cpus: usize,
}

/// Limits a clean cell respects.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvidenceBounds {
    /// Largest acceptable engine lateness p99, ms.
    pub max_lateness_p99_ms: f64,
}

impl EvidenceSummary {
    /// `Err(reason)` when the cell must be discarded and re-run.
    pub fn check(&self, bounds: &EvidenceBounds) -> std::result::Result<(), String> {
        if let Some((device, pid, why)) = self.foreign_processes.first() {
            return Err(format!(
                "foreign process {pid} on GPU {device} ({why}); {} foreign in all",
                self.foreign_processes.len()
            ));
        }
        for l in &self.lateness {
            match l.p99_ms {
                Some(p99) if p99 <= bounds.max_lateness_p99_ms => {}
                Some(p99) => {
                    return Err(format!(
                        "replica {} lateness p99 {p99:.3} ms exceeds the bound {:.3} ms",
                        l.replica, bounds.max_lateness_p99_ms
                    ));
                }
                None if l.steps > 0.0 => {
                    return Err(format!(
                        "replica {} lateness p99 past the histogram's last bucket (bound {:.3} ms)",
                        l.replica, bounds.max_lateness_p99_ms
                    ));
                }
                None => {}
            }
        }
        Ok(())
    }
}

/// A background sampler; [`EvidenceSampler::finish`] stops it and returns the summary.
pub struct EvidenceSampler {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<Result<EvidenceSummary>>>,
}

impl EvidenceSampler {
    /// Takes the baseline scrape now and samples every `interval` into `out` until finished.
    pub fn start(config: EvidenceConfig, out: &Path) -> Result<EvidenceSampler> {
        let file = File::create(out).with_context(|| format!("creating {}", out.display()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let mut state = SamplerState::new(config, BufWriter::new(file));
        // Baseline first, so the window's deltas start now and not when the thread is scheduled.
        state.sample()?;
        let handle = std::thread::Builder::new()
            .name("evidence".into())
            .spawn(move || {
                let mut next = Instant::now() + state.config.interval;
                while !flag.load(Ordering::Relaxed) {
                    let now = Instant::now();
                    if now >= next {
                        state.sample()?;
                        next += state.config.interval;
                        continue;
                    }
                    std::thread::sleep((next - now).min(Duration::from_millis(50)));
                }
                state.sample()?;
                state.finish()
            })
            .context("spawning the evidence thread")?;
        Ok(EvidenceSampler {
            stop,
            handle: Some(handle),
        })
    }

    /// Final sample, summary line, flush; returns the summary.
    pub fn finish(mut self) -> Result<EvidenceSummary> {
        self.stop.store(true, Ordering::Relaxed);
        let handle = self
            .handle
            .take()
            .ok_or_else(|| anyhow!("evidence sampler already finished"))?;
        handle
            .join()
            .map_err(|_| anyhow!("the evidence thread panicked"))?
    }
}

impl Drop for EvidenceSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

struct GpuState {
    nvml: nvml_wrapper::Nvml,
    summaries: Vec<GpuSummary>,
    throttled: Vec<u32>,
}

struct SamplerState {
    config: EvidenceConfig,
    out: BufWriter<File>,
    started: Instant,
    samples: u32,
    gpu: Option<GpuState>,
    gpu_reason: Option<String>,
    foreign: Vec<(u32, u32, String)>,
    first_lateness: Vec<Option<Histogram>>,
    last_lateness: Vec<Option<Histogram>>,
    cpu_prev: Option<CpuTimes>,
    cpu_busy: Vec<f64>,
    loadavg_max: Option<f64>,
}

impl SamplerState {
    fn new(config: EvidenceConfig, out: BufWriter<File>) -> SamplerState {
        let n = config.lateness_urls.len();
        let (gpu, gpu_reason) = if config.gpu {
            match nvml_wrapper::Nvml::init() {
                Ok(nvml) => {
                    let count = nvml.device_count().unwrap_or(0);
                    let summaries = (0..count)
                        .map(|device| GpuSummary {
                            device,
                            name: nvml
                                .device_by_index(device)
                                .and_then(|d| d.name())
                                .unwrap_or_default(),
                            sm_clock_mhz_min: None,
                            sm_clock_mhz_max: None,
                            temperature_c_max: None,
                            throttle_share: 0.0,
                            samples: 0,
                        })
                        .collect();
                    (
                        Some(GpuState {
                            nvml,
                            summaries,
                            throttled: vec![0; count as usize],
                        }),
                        None,
                    )
                }
                Err(e) => (None, Some(format!("NVML unavailable: {e}"))),
            }
        } else {
            (None, Some("GPU sampling off".to_string()))
        };
        SamplerState {
            config,
            out,
            started: Instant::now(),
            samples: 0,
            gpu,
            gpu_reason,
            foreign: Vec::new(),
            first_lateness: vec![None; n],
            last_lateness: vec![None; n],
            cpu_prev: None,
            cpu_busy: Vec::new(),
            loadavg_max: None,
        }
    }

    fn t_s(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    fn write(&mut self, value: serde_json::Value) -> Result<()> {
        serde_json::to_writer(&mut self.out, &value)?;
        self.out.write_all(b"\n")?;
        Ok(())
    }

    fn sample(&mut self) -> Result<()> {
        let t_s = self.t_s();
        if self.samples == 0 {
            let status = if self.gpu.is_some() { "ok" } else { "no GPU" };
            let reason = self.gpu_reason.clone();
            self.write(
                json!({"t_s": t_s, "kind": "gpu-status", "status": status, "reason": reason}),
            )?;
        }
        self.samples += 1;
        self.sample_host(t_s)?;
        self.sample_lateness(t_s)?;
        self.sample_gpus(t_s)?;
        self.out.flush()?;
        Ok(())
    }

    fn sample_host(&mut self, t_s: f64) -> Result<()> {
        let loadavg = std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok());
        if let Some(l) = loadavg {
            self.loadavg_max = Some(self.loadavg_max.map_or(l, |m: f64| m.max(l)));
        }
        let now = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| CpuTimes::parse(&s));
        let busy = match (self.cpu_prev, now) {
            (Some(prev), Some(now)) => now.busy_share_since(&prev),
            _ => None,
        };
        if let Some(b) = busy {
            self.cpu_busy.push(b);
        }
        if now.is_some() {
            self.cpu_prev = now;
        }
        self.write(json!({"t_s": t_s, "kind": "host", "loadavg_1m": loadavg, "cpu_busy": busy}))
    }

    fn sample_lateness(&mut self, t_s: f64) -> Result<()> {
        for i in 0..self.config.lateness_urls.len() {
            let url = http::join(&self.config.lateness_urls[i], "/metrics");
            let scraped = http::get(&url, Duration::from_secs(2))
                .ok()
                .filter(|r| r.status == 200)
                .and_then(|r| Histogram::from_text(&r.text(), LATENESS_METRIC));
            let Some(hist) = scraped else {
                self.write(json!({"t_s": t_s, "kind": "engine", "replica": i, "error": "no lateness histogram"}))?;
                continue;
            };
            let interval = match &self.last_lateness[i] {
                Some(prev) => hist.delta(prev),
                None => hist.clone(),
            };
            let p99 = interval.quantile_upper_bound(0.99).map(|s| s * 1e3);
            self.write(json!({
                "t_s": t_s, "kind": "engine", "replica": i, "steps": interval.count,
                "lateness_p99_ms": p99.filter(|v| v.is_finite()),
                "lateness_p99_past_last_bucket": p99.is_some_and(|v| v.is_infinite()),
                "lateness_mean_ms": interval.mean().map(|s| s * 1e3),
            }))?;
            if self.first_lateness[i].is_none() {
                self.first_lateness[i] = Some(hist.clone());
            }
            self.last_lateness[i] = Some(hist);
        }
        Ok(())
    }

    fn sample_gpus(&mut self, t_s: f64) -> Result<()> {
        let Some(gpu) = self.gpu.as_mut() else {
            return Ok(());
        };
        let mut lines = Vec::new();
        for (slot, summary) in gpu.summaries.iter_mut().enumerate() {
            let Ok(device) = gpu.nvml.device_by_index(summary.device) else {
                continue;
            };
            summary.samples += 1;
            let sm = device
                .clock_info(nvml_wrapper::enum_wrappers::device::Clock::SM)
                .ok();
            let temp = device
                .temperature(nvml_wrapper::enum_wrappers::device::TemperatureSensor::Gpu)
                .ok();
            let reasons = device.current_throttle_reasons().ok();
            if let Some(sm) = sm {
                summary.sm_clock_mhz_min = Some(summary.sm_clock_mhz_min.map_or(sm, |m| m.min(sm)));
                summary.sm_clock_mhz_max = Some(summary.sm_clock_mhz_max.map_or(sm, |m| m.max(sm)));
            }
            if let Some(t) = temp {
                summary.temperature_c_max = Some(summary.temperature_c_max.map_or(t, |m| m.max(t)));
            }
            let mut reason_names = Vec::new();
            let mut throttling = false;
            if let Some(r) = reasons {
                use nvml_wrapper::bitmasks::device::ThrottleReasons as T;
                for (name, flag) in r.iter_names() {
                    reason_names.push(name.to_string());
                    if flag != T::GPU_IDLE && flag != T::APPLICATIONS_CLOCKS_SETTING {
                        throttling = true;
                    }
                }
            }
            if throttling {
                gpu.throttled[slot] += 1;
            }
            summary.throttle_share = f64::from(gpu.throttled[slot]) / f64::from(summary.samples);
            let mut procs = Vec::new();
            let compute = device.running_compute_processes().unwrap_or_default();
            let graphics = device.running_graphics_processes().unwrap_or_default();
            for p in compute.iter().chain(graphics.iter()) {
                let group = process_group_of(p.pid);
                let ours = group.is_some_and(|g| self.config.fleet_process_groups.contains(&g));
                if self.config.check_foreign && !ours {
                    let why = match group {
                        Some(g) => format!("process group {g} is not the fleet's"),
                        None => "pid not visible in /proc".to_string(),
                    };
                    if !self
                        .foreign
                        .iter()
                        .any(|f| f.0 == summary.device && f.1 == p.pid)
                    {
                        self.foreign.push((summary.device, p.pid, why));
                    }
                }
                procs.push(json!({"pid": p.pid, "fleet": ours}));
            }
            lines.push(json!({
                "t_s": t_s, "kind": "gpu", "device": summary.device, "sm_clock_mhz": sm,
                "temperature_c": temp, "throttle_reasons": reason_names, "processes": procs,
            }));
        }
        for line in lines {
            self.write(line)?;
        }
        Ok(())
    }

    fn finish(mut self) -> Result<EvidenceSummary> {
        let lateness = (0..self.config.lateness_urls.len())
            .filter_map(|i| {
                let last = self.last_lateness[i].as_ref()?;
                let first = self.first_lateness[i].as_ref()?;
                let window = last.delta(first);
                let p99 = window.quantile_upper_bound(0.99);
                Some(LatenessSummary {
                    replica: i,
                    steps: window.count,
                    p99_ms: p99.filter(|v| v.is_finite()).map(|s| s * 1e3),
                    mean_ms: window.mean().map(|s| s * 1e3),
                })
            })
            .collect();
        let cpu_busy_mean = (!self.cpu_busy.is_empty())
            .then(|| self.cpu_busy.iter().sum::<f64>() / self.cpu_busy.len() as f64);
        let summary = EvidenceSummary {
            duration_s: self.t_s(),
            samples: self.samples,
            gpu_status: if self.gpu.is_some() { "ok" } else { "no GPU" }.to_string(),
            gpu_reason: self.gpu_reason.clone(),
            gpus: self
                .gpu
                .as_ref()
                .map(|g| g.summaries.clone())
                .unwrap_or_default(),
            foreign_processes: self.foreign.clone(),
            lateness,
            loadavg_1m_max: self.loadavg_max,
            cpu_busy_mean,
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        let mut line = serde_json::to_value(&summary)?;
        if let Some(obj) = line.as_object_mut() {
            obj.insert("kind".into(), json!("summary"));
            obj.insert("t_s".into(), json!(summary.duration_s));
        }
        self.write(line)?;
        self.out.flush()?;
        Ok(summary)
    }
}

/// Aggregate CPU jiffies from the first line of `/proc/stat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuTimes {
    /// All jiffies.
    pub total: u64,
    /// Idle plus iowait jiffies.
    pub idle: u64,
}

impl CpuTimes {
    /// Parses the `cpu ` line.
    pub fn parse(stat: &str) -> Option<CpuTimes> {
        let line = stat.lines().find(|l| l.starts_with("cpu "))?;
        let fields: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .filter_map(|f| f.parse().ok())
            .collect();
        if fields.len() < 4 {
            return None;
        }
        // user nice system idle iowait irq softirq steal (guest is already inside user).
        let total = fields.iter().take(8).sum();
        let idle = fields[3] + fields.get(4).copied().unwrap_or(0);
        Some(CpuTimes { total, idle })
    }

    /// Busy share between `earlier` and `self`; `None` when no time passed.
    pub fn busy_share_since(&self, earlier: &CpuTimes) -> Option<f64> {
        let total = self.total.checked_sub(earlier.total)?;
        let idle = self.idle.checked_sub(earlier.idle)?;
        (total > 0).then(|| (total - idle.min(total)) as f64 / total as f64)
    }
}

/// The process group of `pid` from `/proc/<pid>/stat`, `None` when not visible.
pub fn process_group_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses; fields resume after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    // state ppid pgrp
    rest.split_whitespace().nth(2)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary() -> EvidenceSummary {
        EvidenceSummary {
            duration_s: 10.0,
            samples: 10,
            gpu_status: "no GPU".into(),
            gpu_reason: Some("NVML unavailable".into()),
            gpus: vec![],
            foreign_processes: vec![],
            lateness: vec![LatenessSummary {
                replica: 0,
                steps: 100.0,
                p99_ms: Some(2.5),
                mean_ms: Some(0.3),
            }],
            loadavg_1m_max: Some(1.0),
            cpu_busy_mean: Some(0.5),
            cpus: 2,
        }
    }

    #[test]
    fn lateness_bound_discards_and_passes() {
        let s = summary();
        assert!(
            s.check(&EvidenceBounds {
                max_lateness_p99_ms: 5.0
            })
            .is_ok()
        );
        let err = s
            .check(&EvidenceBounds {
                max_lateness_p99_ms: 1.0,
            })
            .unwrap_err();
        assert!(err.contains("replica 0") && err.contains("2.500"), "{err}");
        let mut past = summary();
        past.lateness[0].p99_ms = None;
        assert!(
            past.check(&EvidenceBounds {
                max_lateness_p99_ms: 5.0
            })
            .is_err()
        );
        past.lateness[0].steps = 0.0;
        assert!(
            past.check(&EvidenceBounds {
                max_lateness_p99_ms: 5.0
            })
            .is_ok()
        );
    }

    #[test]
    fn foreign_gpu_process_discards() {
        let mut s = summary();
        s.foreign_processes
            .push((1, 4242, "process group 7 is not the fleet's".into()));
        let err = s
            .check(&EvidenceBounds {
                max_lateness_p99_ms: 5.0,
            })
            .unwrap_err();
        assert!(err.contains("4242") && err.contains("GPU 1"), "{err}");
    }

    #[test]
    fn cpu_times_busy_share() {
        let a = CpuTimes::parse("cpu  100 0 100 700 100 0 0 0 0 0\ncpu0 1 2 3 4\n").unwrap();
        let b = CpuTimes::parse("cpu  200 0 200 750 150 0 0 0 0 0\n").unwrap();
        assert_eq!(a.total, 1000);
        assert_eq!(b.busy_share_since(&a), Some(200.0 / 300.0));
        assert_eq!(a.busy_share_since(&a), None);
        assert_eq!(CpuTimes::parse("intr 1 2"), None);
    }

    #[test]
    fn own_process_group_is_visible() {
        let pid = std::process::id();
        assert!(process_group_of(pid).is_some());
        assert_eq!(process_group_of(u32::MAX), None);
    }

    #[test]
    fn sampler_without_gpu_or_engines_records_no_gpu() {
        let dir = std::env::temp_dir().join(format!("fleet-evidence-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("evidence.jsonl");
        let sampler = EvidenceSampler::start(
            EvidenceConfig {
                lateness_urls: vec![],
                fleet_process_groups: vec![],
                check_foreign: true,
                gpu: false,
                interval: Duration::from_millis(10),
            },
            &out,
        )
        .unwrap();
        let s = sampler.finish().unwrap();
        assert_eq!(s.gpu_status, "no GPU");
        assert!(s.samples >= 2);
        let text = std::fs::read_to_string(&out).unwrap();
        let kinds: Vec<String> = text
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["kind"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        assert_eq!(kinds.first().map(String::as_str), Some("gpu-status"));
        assert_eq!(kinds.last().map(String::as_str), Some("summary"));
        std::fs::remove_dir_all(&dir).ok();
    }
}
