//! Evidence that a measured window was clean, sampled while it runs into `evidence.jsonl`.
//!
//! On GPUs (through [`crate::gpu::GpuBackend`], NVML on a real fleet): the compute processes on
//! the fleet's cards — one that is not the fleet's is foreign and spoils the cell; graphics-only
//! ones (a desktop compositor) never do —, SM clock, temperature and throttle reasons, whose
//! share per card is held against the calibrated bound. On the emulated fleet no GPU is read:
//! each engine's lateness (`kvroute_engine_lateness_seconds` from `/metrics`) is the emulator's
//! stand-in for a clean GPU, with the host's CPU load. No NVML library (or no driver) is recorded
//! as "no GPU", never an error, and a check that cannot be made says so and why
//! ([`CheckStatus`]).

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::err;
use crate::{Error, Result};
use serde_json::json;

use crate::gpu::{self, FleetGpus, GpuBackend};
use crate::http;
use crate::metrics::Histogram;

/// The emulator's lateness histogram (docs/CONTRACTS.md / the engine issue).
pub const LATENESS_METRIC: &str = "kvroute_engine_lateness_seconds";

/// What to sample.
#[derive(Debug, Clone)]
pub struct EvidenceConfig {
    /// Replica base URLs whose `/metrics` carry the lateness histogram (empty: none).
    pub lateness_urls: Vec<String>,
    /// Process groups that belong to the fleet; a compute process on the fleet's cards outside
    /// them (and not recorded there at fleet start) is foreign.
    pub fleet_process_groups: Vec<u32>,
    /// Check GPU processes for foreigners (off for static fleets, whose processes are not ours).
    pub check_foreign: bool,
    /// Read the GPUs at all (never on an emulated fleet, whatever this says).
    pub gpu: bool,
    /// Time between samples.
    pub interval: Duration,
    /// The fleet's GPUs ([`crate::Fleet::gpus`]): none for an emulated fleet, whose GPUs are not
    /// read at all; the default (`Unknown`) samples every card NVML shows.
    pub fleet_gpus: FleetGpus,
}

pub use schema::evidence::{
    CheckStatus, EvidenceBounds, EvidenceSummary, GpuSummary, GpuThrottle, LatenessSummary,
};

/// A check made on everything it covers, or unavailable where data was missing (`gaps`: why).
fn check_from_gaps(gaps: &BTreeSet<String>) -> CheckStatus {
    if gaps.is_empty() {
        CheckStatus::Done
    } else {
        CheckStatus::Unavailable(gaps.iter().cloned().collect::<Vec<_>>().join("; "))
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
        let file = File::create(out).map_err(Error::io("creating", out))?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let mut state = SamplerState::new(config, BufWriter::new(file), gpu::open_nvml);
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
            .map_err(|source| Error::Spawn {
                what: "spawning the evidence thread".to_string(),
                source,
            })?;
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
            .ok_or_else(|| err!(State, "evidence sampler already finished"))?;
        handle
            .join()
            .map_err(|_| err!(State, "the evidence thread panicked"))?
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
    backend: Arc<dyn GpuBackend>,
    summaries: Vec<GpuSummary>,
    throttled: Vec<u32>,
    /// Per card: samples per throttle group.
    reason_counts: Vec<BTreeMap<&'static str, u32>>,
    /// Cards the checks cover → replicas on them; `None`: every card (the fleet's not known).
    fleet_devices: Option<BTreeMap<u32, Vec<usize>>>,
    /// Per fleet card: the compute pids that appeared while the fleet started; `None`: the
    /// fleet's cards are not known.
    started_pids: Option<gpu::PidsByDevice>,
    /// Why the throttle check is not complete.
    throttle_gaps: BTreeSet<String>,
    /// Why the foreign-process check is not complete.
    foreign_gaps: BTreeSet<String>,
}

impl GpuState {
    fn new(backend: Arc<dyn GpuBackend>, fleet: Option<&gpu::StartedGpus>) -> GpuState {
        let mut throttle_gaps = BTreeSet::new();
        let mut foreign_gaps = BTreeSet::new();
        let count = backend.device_count().unwrap_or_else(|e| {
            let gap = format!("NVML could not count the cards ({e})");
            throttle_gaps.insert(gap.clone());
            foreign_gaps.insert(gap);
            0
        });
        let summaries: Vec<GpuSummary> = (0..count)
            .map(|device| GpuSummary {
                device,
                name: backend.name(device).unwrap_or_default(),
                sm_clock_mhz_min: None,
                sm_clock_mhz_max: None,
                temperature_c_max: None,
                throttle_share: 0.0,
                samples: 0,
            })
            .collect();
        let fleet_devices = fleet.map(|f| {
            for gap in f.replica_devices.iter().filter_map(|d| d.as_ref().err()) {
                throttle_gaps.insert(gap.clone());
                foreign_gaps.insert(gap.clone());
            }
            let devices = f.devices();
            for (device, replicas) in &devices {
                if *device >= count {
                    let gap =
                        format!("GPU {device} of replicas {replicas:?} is not among the {count} cards NVML shows");
                    throttle_gaps.insert(gap.clone());
                    foreign_gaps.insert(gap);
                }
            }
            devices
        });
        GpuState {
            backend,
            throttled: vec![0; summaries.len()],
            reason_counts: vec![BTreeMap::new(); summaries.len()],
            summaries,
            fleet_devices,
            started_pids: fleet.map(|f| f.started_pids.clone()),
            throttle_gaps,
            foreign_gaps,
        }
    }

    /// Whether the checks cover `device`.
    fn checks(&self, device: u32) -> bool {
        self.fleet_devices
            .as_ref()
            .is_none_or(|d| d.contains_key(&device))
    }

    /// The cards the checks cover, with their throttle shares.
    fn throttle(&self) -> Vec<GpuThrottle> {
        self.summaries
            .iter()
            .enumerate()
            .filter(|(_, s)| self.checks(s.device))
            .map(|(slot, s)| {
                let share = |n: u32| {
                    if s.samples == 0 {
                        0.0
                    } else {
                        f64::from(n) / f64::from(s.samples)
                    }
                };
                GpuThrottle {
                    device: s.device,
                    replicas: self
                        .fleet_devices
                        .as_ref()
                        .and_then(|d| d.get(&s.device).cloned())
                        .unwrap_or_default(),
                    samples: s.samples,
                    throttle_share: share(self.throttled[slot]),
                    reason_shares: self.reason_counts[slot]
                        .iter()
                        .map(|(name, n)| (name.to_string(), share(*n)))
                        .collect(),
                }
            })
            .collect()
    }
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

/// Reason recorded for an emulated fleet's GPUs.
const CPU_NO_GPU: &str = "CPU fleet (llama.cpp): no GPU is read";

const EMULATED_NO_GPU: &str =
    "emulated fleet: GPUs are not read (the engines' lateness is the evidence)";

impl SamplerState {
    /// `open_nvml` is called only when the fleet's GPUs are not known and GPU sampling is on;
    /// never for an emulated fleet.
    fn new(
        config: EvidenceConfig,
        out: BufWriter<File>,
        open_nvml: fn() -> std::result::Result<Arc<dyn GpuBackend>, String>,
    ) -> SamplerState {
        let n = config.lateness_urls.len();
        let (gpu, gpu_reason) = if !config.gpu {
            (None, Some("GPU sampling off".to_string()))
        } else {
            match &config.fleet_gpus {
                FleetGpus::Emulated => (None, Some(EMULATED_NO_GPU.to_string())),
                FleetGpus::Cpu => (None, Some(CPU_NO_GPU.to_string())),
                FleetGpus::Unknown => match open_nvml() {
                    Ok(backend) => (Some(GpuState::new(backend, None)), None),
                    Err(e) => (None, Some(e)),
                },
                FleetGpus::Started(fleet) => match &fleet.backend {
                    Ok(backend) => (Some(GpuState::new(Arc::clone(backend), Some(fleet))), None),
                    Err(e) => (None, Some(e.clone())),
                },
            }
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
        serde_json::to_writer(&mut self.out, &value).map_err(|source| Error::Json {
            what: "writing evidence.jsonl".to_string(),
            source,
        })?;
        self.out
            .write_all(b"\n")
            .map_err(|source| Error::Evidence { source })?;
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
        self.out
            .flush()
            .map_err(|source| Error::Evidence { source })?;
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
        for slot in 0..gpu.summaries.len() {
            let device = gpu.summaries[slot].device;
            let checked = gpu.checks(device);
            let reading = match gpu.backend.read(device) {
                Ok(r) => r,
                Err(e) => {
                    // A card NVML cannot reach is not sampled at all this round.
                    if checked {
                        let gap = format!("GPU {device} not readable ({e})");
                        if self.config.check_foreign {
                            gpu.foreign_gaps.insert(gap.clone());
                        }
                        gpu.throttle_gaps.insert(gap);
                    }
                    continue;
                }
            };
            let summary = &mut gpu.summaries[slot];
            summary.samples += 1;
            if let Some(sm) = reading.sm_clock_mhz {
                summary.sm_clock_mhz_min = Some(summary.sm_clock_mhz_min.map_or(sm, |m| m.min(sm)));
                summary.sm_clock_mhz_max = Some(summary.sm_clock_mhz_max.map_or(sm, |m| m.max(sm)));
            }
            if let Some(t) = reading.temperature_c {
                summary.temperature_c_max = Some(summary.temperature_c_max.map_or(t, |m| m.max(t)));
            }
            let mut reason_names = Vec::new();
            match reading.throttle {
                Ok(r) => {
                    reason_names = r.iter_names().map(|(name, _)| name.to_string()).collect();
                    if gpu::is_throttling(r) {
                        gpu.throttled[slot] += 1;
                    }
                    for group in gpu::throttle_groups(r) {
                        *gpu.reason_counts[slot].entry(group).or_default() += 1;
                    }
                }
                Err(e) if checked => {
                    gpu.throttle_gaps
                        .insert(format!("GPU {device}: throttle reasons not readable ({e})"));
                }
                Err(_) => {}
            }
            summary.throttle_share = f64::from(gpu.throttled[slot]) / f64::from(summary.samples);

            let processes = gpu.backend.processes(device);
            let compute = processes.compute.unwrap_or_else(|e| {
                if checked && self.config.check_foreign {
                    gpu.foreign_gaps
                        .insert(format!("GPU {device}: compute processes not listed ({e})"));
                }
                Vec::new()
            });
            let graphics: Vec<u32> = processes
                .graphics
                .unwrap_or_default()
                .into_iter()
                .filter(|p| !compute.contains(p))
                .collect();
            let started = gpu.started_pids.as_ref().map(|s| {
                s.get(&device)
                    .cloned()
                    .unwrap_or_else(|| Ok(BTreeSet::new()))
            });
            let mut procs = Vec::new();
            for (pid, kind) in compute
                .iter()
                .map(|p| (*p, "compute"))
                .chain(graphics.iter().map(|p| (*p, "graphics")))
            {
                let group = process_group_of(pid);
                let ours = group.is_some_and(|g| self.config.fleet_process_groups.contains(&g))
                    || matches!(&started, Some(Ok(s)) if s.contains(&pid));
                // Only a compute process on one of the fleet's cards can spoil the cell.
                if !ours && kind == "compute" && checked && self.config.check_foreign {
                    let why = match (group, &started) {
                        (Some(g), _) => Some(format!("process group {g} is not the fleet's")),
                        (None, Some(Ok(_))) => Some(format!(
                            "pid not visible in /proc and not among the processes the fleet started on GPU {device}"
                        )),
                        (None, Some(Err(e))) => {
                            gpu.foreign_gaps.insert(format!(
                                "pid {pid} on GPU {device} is not visible in /proc and the fleet's processes there are not known ({e})"
                            ));
                            None
                        }
                        (None, None) => {
                            gpu.foreign_gaps.insert(format!(
                                "pid {pid} on GPU {device} is not visible in /proc (a container sees host pids) and the fleet's cards and processes are not known"
                            ));
                            None
                        }
                    };
                    if let Some(why) = why
                        && !self.foreign.iter().any(|f| f.0 == device && f.1 == pid)
                    {
                        self.foreign.push((device, pid, why));
                    }
                }
                procs.push(json!({"pid": pid, "fleet": ours, "kind": kind}));
            }
            lines.push(json!({
                "t_s": t_s, "kind": "gpu", "device": device, "sm_clock_mhz": reading.sm_clock_mhz,
                "temperature_c": reading.temperature_c, "throttle_reasons": reason_names,
                "processes": procs,
            }));
        }
        for line in lines {
            self.write(line)?;
        }
        Ok(())
    }

    /// The throttle and foreign-process checks' status over the window.
    fn check_status(&self) -> (CheckStatus, CheckStatus) {
        if matches!(self.config.fleet_gpus, FleetGpus::Emulated) {
            let off = CheckStatus::Off(EMULATED_NO_GPU.into());
            return (off.clone(), off);
        }
        if matches!(self.config.fleet_gpus, FleetGpus::Cpu) {
            let off = CheckStatus::Off(CPU_NO_GPU.into());
            return (off.clone(), off);
        }
        let Some(gpu) = &self.gpu else {
            let why = self.gpu_reason.clone().unwrap_or_default();
            let status = if self.config.gpu {
                CheckStatus::Unavailable(why)
            } else {
                CheckStatus::Off(why)
            };
            return (status.clone(), status);
        };
        let mut throttle_gaps = gpu.throttle_gaps.clone();
        if !gpu.summaries.iter().any(|s| gpu.checks(s.device)) {
            throttle_gaps.insert(format!(
                "no card to check among the {} NVML shows",
                gpu.summaries.len()
            ));
        }
        for s in gpu.summaries.iter().filter(|s| gpu.checks(s.device)) {
            if s.samples == 0 {
                throttle_gaps.insert(format!("GPU {} never sampled", s.device));
            }
        }
        let foreign = if self.config.check_foreign {
            check_from_gaps(&gpu.foreign_gaps)
        } else {
            CheckStatus::Off("turned off for this run (a static fleet's processes are not ours to know; a fault run restarts a replica)".into())
        };
        (check_from_gaps(&throttle_gaps), foreign)
    }

    fn finish(mut self) -> Result<EvidenceSummary> {
        let lateness = (0..self.config.lateness_urls.len())
            .filter_map(|i| {
                let last = self.last_lateness[i].as_ref()?;
                let first = self.first_lateness[i].as_ref()?;
                let window = last.delta(first);
                let p99 = window.quantile_upper_bound(0.99);
                let p999 = window.quantile_upper_bound(0.999);
                Some(LatenessSummary {
                    replica: i,
                    steps: window.count,
                    p99_ms: p99.filter(|v| v.is_finite()).map(|s| s * 1e3),
                    p999_ms: p999.filter(|v| v.is_finite()).map(|s| s * 1e3),
                    mean_ms: window.mean().map(|s| s * 1e3),
                })
            })
            .collect();
        let cpu_busy_mean = (!self.cpu_busy.is_empty())
            .then(|| self.cpu_busy.iter().sum::<f64>() / self.cpu_busy.len() as f64);
        let (throttle_check, foreign_check) = self.check_status();
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
            gpu_throttle: self
                .gpu
                .as_ref()
                .map(GpuState::throttle)
                .unwrap_or_default(),
            throttle_check,
            foreign_check,
            lateness_kept: None,
        };
        let mut line = serde_json::to_value(&summary).map_err(|source| Error::Json {
            what: "the evidence summary".to_string(),
            source,
        })?;
        if let Some(obj) = line.as_object_mut() {
            obj.insert("kind".into(), json!("summary"));
            obj.insert("t_s".into(), json!(summary.duration_s));
        }
        self.write(line)?;
        self.out
            .flush()
            .map_err(|source| Error::Evidence { source })?;
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
    use crate::gpu::{ScriptedGpus, StartedGpus, ThrottleReasons};

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
                p999_ms: Some(3.0),
                mean_ms: Some(0.3),
            }],
            loadavg_1m_max: Some(1.0),
            cpu_busy_mean: Some(0.5),
            cpus: 2,
            gpu_throttle: vec![],
            throttle_check: CheckStatus::Unavailable("NVML unavailable".into()),
            foreign_check: CheckStatus::Unavailable("NVML unavailable".into()),
            lateness_kept: None,
        }
    }

    fn lateness(max_lateness_p99_ms: f64) -> EvidenceBounds {
        EvidenceBounds {
            max_lateness_p99_ms,
            max_throttle_share: None,
        }
    }

    /// The calibrated throttle bound of these tests: 12% of samples.
    const THROTTLE_BOUND: EvidenceBounds = EvidenceBounds {
        max_lateness_p99_ms: 5.0,
        max_throttle_share: Some(0.12),
    };

    /// A pid above Linux's largest `pid_max` (2^22): never visible in /proc, like a host pid
    /// seen from a container.
    const HOST_PID: u32 = 5_000_000;
    const OTHER_HOST_PID: u32 = 5_000_001;

    fn config(fleet_gpus: FleetGpus) -> EvidenceConfig {
        EvidenceConfig {
            lateness_urls: vec![],
            fleet_process_groups: vec![],
            check_foreign: true,
            gpu: true,
            interval: Duration::from_millis(10),
            fleet_gpus,
        }
    }

    /// A command fleet of one replica per card `0..replicas`, on `backend`, whose processes at
    /// start were `started` (per card).
    fn started(backend: &Arc<ScriptedGpus>, started: &[&[u32]]) -> FleetGpus {
        FleetGpus::Started(StartedGpus {
            backend: Ok(Arc::clone(backend) as Arc<dyn GpuBackend>),
            replica_devices: (0..started.len() as u32).map(|d| Ok(vec![d])).collect(),
            started_pids: started
                .iter()
                .enumerate()
                .map(|(d, pids)| (d as u32, Ok(pids.iter().copied().collect())))
                .collect(),
        })
    }

    fn no_nvml() -> std::result::Result<Arc<dyn GpuBackend>, String> {
        Err("NVML unavailable: libnvidia-ml.so: cannot open shared object file".into())
    }

    fn nvml_must_not_open() -> std::result::Result<Arc<dyn GpuBackend>, String> {
        panic!("NVML opened")
    }

    /// Samples `rounds` times (deterministically, without the thread) and summarises.
    fn sample(
        name: &str,
        config: EvidenceConfig,
        open_nvml: fn() -> std::result::Result<Arc<dyn GpuBackend>, String>,
        rounds: u32,
    ) -> (EvidenceSummary, String) {
        let scratch = test_support::temp_dir(&format!("fleet-evidence-{name}"));
        let path = scratch.path().join("evidence.jsonl");
        let out = BufWriter::new(File::create(&path).unwrap());
        let mut state = SamplerState::new(config, out, open_nvml);
        for _ in 0..rounds {
            state.sample().unwrap();
        }
        let summary = state.finish().unwrap();
        (summary, std::fs::read_to_string(&path).unwrap())
    }

    /// Card 0 throttles for thermal reasons in `hot` of 50 samples (idle otherwise); card 1,
    /// not the fleet's, throttles in every sample.
    fn thermal(hot: u32) -> (EvidenceSummary, String) {
        let gpus = Arc::new(ScriptedGpus::new(2));
        for i in 0..50 {
            gpus.push_throttle(
                0,
                if i < hot {
                    ThrottleReasons::SW_THERMAL_SLOWDOWN | ThrottleReasons::HW_THERMAL_SLOWDOWN
                } else {
                    ThrottleReasons::GPU_IDLE
                },
            );
        }
        gpus.push_throttle(1, ThrottleReasons::HW_SLOWDOWN);
        let config = config(started(&gpus, &[&[]]));
        sample(&format!("thermal-{hot}"), config, nvml_must_not_open, 50)
    }

    #[test]
    fn lateness_bound_discards_and_passes() {
        let s = summary();
        assert!(s.check(&lateness(5.0)).is_ok());
        let err = s.check(&lateness(1.0)).unwrap_err();
        assert!(err.contains("replica 0") && err.contains("2.500"), "{err}");
        let mut past = summary();
        past.lateness[0].p99_ms = None;
        assert!(past.check(&lateness(5.0)).is_err());
        past.lateness[0].steps = 0.0;
        assert!(past.check(&lateness(5.0)).is_ok());
    }

    #[test]
    fn every_late_replica_is_named_not_only_the_first() {
        let mut s = summary();
        let late = |replica, p99_ms| LatenessSummary {
            replica,
            steps: 100.0,
            p99_ms,
            p999_ms: p99_ms,
            mean_ms: Some(0.3),
        };
        s.lateness = vec![late(0, Some(2.5)), late(1, Some(0.2)), late(2, None)];
        assert_eq!(
            s.check(&lateness(1.0)).unwrap_err(),
            "replica 0 lateness p99 2.500 ms, replica 2 lateness p99 past the histogram's last \
             bucket exceed the bound 1.000 ms (1 of 3 replicas within it)"
        );
        s.lateness[0].p99_ms = Some(0.5);
        assert_eq!(
            s.check(&lateness(1.0)).unwrap_err(),
            "replica 2 lateness p99 past the histogram's last bucket exceeds the bound 1.000 ms \
             (2 of 3 replicas within it)"
        );
    }

    #[test]
    fn foreign_gpu_process_discards() {
        let mut s = summary();
        s.foreign_processes
            .push((1, 4242, "process group 7 is not the fleet's".into()));
        let err = s.check(&lateness(5.0)).unwrap_err();
        assert!(err.contains("4242") && err.contains("GPU 1"), "{err}");
    }

    #[test]
    fn a_card_that_throttled_above_the_calibrated_bound_sets_the_cell_aside() {
        let (s, text) = thermal(17);
        assert_eq!(s.throttle_check, CheckStatus::Done);
        assert_eq!(s.gpu_throttle.len(), 1, "only the fleet's card is checked");
        assert_eq!(s.gpu_throttle[0].reason_shares["thermal slowdown"], 0.34);
        let err = s.check(&THROTTLE_BOUND).unwrap_err();
        assert_eq!(
            err,
            "GPU 0 (replica 0) throttled (thermal slowdown) in 34% of samples, above the calibrated bound 12%"
        );
        assert!(
            s.check(&lateness(5.0)).is_ok(),
            "no bound from calibration, no throttle check"
        );
        assert!(
            text.contains("\"throttle_check\":{\"status\":\"done\"}"),
            "{text}"
        );
    }

    #[test]
    fn a_card_that_throttled_below_the_bound_is_accepted() {
        let (s, _) = thermal(5);
        assert_eq!(s.gpu_throttle[0].throttle_share, 0.1);
        assert_eq!(s.check(&THROTTLE_BOUND), Ok(()));
    }

    #[test]
    fn a_graphics_only_process_never_spoils_a_cell() {
        let gpus = Arc::new(ScriptedGpus::new(1));
        gpus.push_throttle(0, ThrottleReasons::GPU_IDLE);
        // pid 1 is visible and not in the fleet's process group: a compositor-like stranger.
        gpus.push_processes(0, &[], &[1]);
        let (s, text) = sample("graphics", config(started(&gpus, &[&[]])), no_nvml, 3);
        assert_eq!(s.foreign_processes, vec![]);
        assert_eq!(s.foreign_check, CheckStatus::Done);
        assert_eq!(s.check(&THROTTLE_BOUND), Ok(()));
        assert!(
            text.contains("{\"fleet\":false,\"kind\":\"graphics\",\"pid\":1}"),
            "{text}"
        );
    }

    #[test]
    fn a_compute_process_outside_the_fleet_sets_the_cell_aside() {
        let gpus = Arc::new(ScriptedGpus::new(1));
        gpus.push_throttle(0, ThrottleReasons::GPU_IDLE);
        gpus.push_processes(0, &[1], &[1]);
        let (s, _) = sample("compute", config(started(&gpus, &[&[]])), no_nvml, 3);
        assert_eq!(s.foreign_processes.len(), 1);
        let err = s.check(&THROTTLE_BOUND).unwrap_err();
        assert!(
            err.starts_with("foreign process 1 on GPU 0 (process group"),
            "{err}"
        );
    }

    #[test]
    fn host_pids_recorded_at_fleet_start_are_the_fleets() {
        let gpus = Arc::new(ScriptedGpus::new(1));
        gpus.push_throttle(0, ThrottleReasons::GPU_IDLE);
        gpus.push_processes(0, &[HOST_PID], &[]);
        let (s, text) = sample(
            "host-pid",
            config(started(&gpus, &[&[HOST_PID]])),
            no_nvml,
            3,
        );
        assert_eq!(s.foreign_processes, vec![]);
        assert_eq!(s.foreign_check, CheckStatus::Done);
        assert_eq!(s.check(&THROTTLE_BOUND), Ok(()));
        assert!(text.contains(&format!(
            "{{\"fleet\":true,\"kind\":\"compute\",\"pid\":{HOST_PID}}}"
        )));
    }

    #[test]
    fn an_unknown_pid_appearing_later_on_a_replicas_card_is_foreign() {
        let gpus = Arc::new(ScriptedGpus::new(2));
        gpus.push_throttle(0, ThrottleReasons::GPU_IDLE)
            .push_throttle(1, ThrottleReasons::GPU_IDLE);
        gpus.push_processes(0, &[HOST_PID], &[]).push_processes(
            0,
            &[HOST_PID, OTHER_HOST_PID],
            &[],
        );
        // Card 1 is not the fleet's: what runs there is none of the cell's business.
        gpus.push_processes(1, &[OTHER_HOST_PID + 1], &[]);
        let mut config = config(started(&gpus, &[&[HOST_PID]]));
        if let FleetGpus::Started(s) = &mut config.fleet_gpus {
            s.replica_devices = vec![Ok(vec![0])];
        }
        let (s, _) = sample("later", config, no_nvml, 3);
        assert_eq!(
            s.foreign_processes,
            vec![(
                0,
                OTHER_HOST_PID,
                "pid not visible in /proc and not among the processes the fleet started on GPU 0"
                    .to_string()
            )]
        );
        assert!(
            s.check(&lateness(5.0))
                .unwrap_err()
                .contains(&OTHER_HOST_PID.to_string())
        );
    }

    #[test]
    fn an_invisible_pid_without_a_start_list_makes_the_check_unavailable_not_passed() {
        let gpus = Arc::new(ScriptedGpus::new(1));
        gpus.push_throttle(0, ThrottleReasons::GPU_IDLE);
        gpus.push_processes(0, &[HOST_PID], &[]);
        let mut fleet = started(&gpus, &[&[]]);
        if let FleetGpus::Started(s) = &mut fleet {
            s.started_pids.insert(
                0,
                Err("GPU 0: compute processes not listed (NotSupported)".into()),
            );
        }
        let (s, _) = sample("unverifiable", config(fleet), no_nvml, 2);
        assert_eq!(s.foreign_processes, vec![]);
        let CheckStatus::Unavailable(why) = &s.foreign_check else {
            panic!("{:?}", s.foreign_check);
        };
        assert!(
            why.contains(&format!("pid {HOST_PID} on GPU 0 is not visible in /proc"))
                && why.contains("NotSupported"),
            "{why}"
        );
    }

    #[test]
    fn without_nvml_the_gpu_checks_say_they_are_unavailable_and_why() {
        let (s, text) = sample("no-nvml", config(FleetGpus::Unknown), no_nvml, 2);
        assert_eq!(s.gpu_status, "no GPU");
        for status in [&s.throttle_check, &s.foreign_check] {
            assert_eq!(
                status,
                &CheckStatus::Unavailable(no_nvml().unwrap_err()),
                "{status:?}"
            );
        }
        assert_eq!(s.check(&THROTTLE_BOUND), Ok(()));
        assert!(
            text.contains("\"foreign_check\":{\"reason\":\"NVML unavailable"),
            "{text}"
        );
    }

    #[test]
    fn an_emulated_fleet_reads_no_gpu() {
        let (s, text) = sample(
            "emulated",
            config(FleetGpus::Emulated),
            nvml_must_not_open,
            2,
        );
        assert_eq!(s.gpu_status, "no GPU");
        assert_eq!(s.gpu_reason.as_deref(), Some(EMULATED_NO_GPU));
        assert_eq!(s.throttle_check, CheckStatus::Off(EMULATED_NO_GPU.into()));
        assert_eq!(s.foreign_check, CheckStatus::Off(EMULATED_NO_GPU.into()));
        assert!(!text.contains("\"kind\":\"gpu\""));
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
        assert_eq!(process_group_of(HOST_PID), None);
    }

    #[test]
    fn sampler_without_gpu_or_engines_records_no_gpu() {
        let scratch = test_support::temp_dir("fleet-evidence-sampler");
        let out = scratch.path().join("evidence.jsonl");
        let mut config = config(FleetGpus::Unknown);
        config.gpu = false;
        let sampler = EvidenceSampler::start(config, &out).unwrap();
        let s = sampler.finish().unwrap();
        assert_eq!(s.gpu_status, "no GPU");
        assert!(matches!(s.foreign_check, CheckStatus::Off(_)));
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
    }
}
