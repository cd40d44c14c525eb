//! The evidence that a measured window was clean (docs/CONTRACTS.md, "Measurements layout":
//! `evidence`; crates/fleet/README.md, "Evidence"): what `fleet`'s sampler summarises into the
//! last line of `evidence.jsonl` and a sweep records in `meta.json` ([`crate::Meta::evidence`], as
//! [`Evidence`]), with the bounds a clean cell respects and the check against them. `fleet`
//! re-exports these types and fills them; `experiment` judges a cell with
//! [`EvidenceSummary::check`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A repetition's `evidence` in `meta.json`: what was sampled on a live fleet, what a virtual
/// cell records, or (read leniently) a record of another shape, kept as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Evidence {
    /// Sampled while a live cell ran (`fleet::evidence::EvidenceSampler`).
    Sampled(Box<EvidenceSummary>),
    /// A virtual cell: nothing was sampled (the simulator has no wall clock to be late on).
    Virtual(VirtualEvidence),
    /// A record of neither shape (hand-written, or from a writer this build does not know),
    /// kept as it was read.
    Other(serde_json::Value),
}

impl From<EvidenceSummary> for Evidence {
    fn from(s: EvidenceSummary) -> Evidence {
        Evidence::Sampled(Box::new(s))
    }
}

/// What a virtual cell records as its evidence: `{"source": "virtual", "lateness_p99_ms": 0.0}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VirtualEvidence {
    /// `virtual`.
    pub source: String,
    /// The engines' lateness p99, ms: 0 in virtual time.
    pub lateness_p99_ms: f64,
}

impl VirtualEvidence {
    /// The record of a virtual cell.
    pub fn new() -> VirtualEvidence {
        VirtualEvidence {
            source: "virtual".into(),
            lateness_p99_ms: 0.0,
        }
    }
}

impl Default for VirtualEvidence {
    fn default() -> VirtualEvidence {
        VirtualEvidence::new()
    }
}

/// Per-replica lateness over the whole sampled window (first scrape to last).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LatenessSummary {
    /// Replica index.
    pub replica: usize,
    /// Steps observed in the window.
    pub steps: f64,
    /// Upper bound of the bucket holding the 99th percentile, ms (`None`: past the last bucket).
    pub p99_ms: Option<f64>,
    /// Upper bound of the bucket holding the 99.9th percentile, ms (`None`: past the last
    /// bucket, or not recorded by an older sampler).
    #[serde(default)]
    pub p999_ms: Option<f64>,
    /// Mean lateness, ms.
    pub mean_ms: Option<f64>,
}

/// Per-card GPU observations over the window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// The cards the GPU checks cover (the fleet's; every card when those are not known), with
    /// their replicas and the share of samples per throttle reason.
    #[serde(default)]
    pub gpu_throttle: Vec<GpuThrottle>,
    /// Whether the throttle share could be measured on the fleet's cards, and why not.
    #[serde(default)]
    pub throttle_check: CheckStatus,
    /// Whether every compute process on the fleet's cards could be told the fleet's or foreign,
    /// and why not.
    #[serde(default)]
    pub foreign_check: CheckStatus,
    /// Set when the lateness exceeded its p99 bound and the attempt was kept because that
    /// lateness could not have turned enough SLO verdicts to matter: the rule and the numbers
    /// (the caller's judgement, `experiment::gate::check_evidence`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lateness_kept: Option<String>,
}

/// Whether a check could be made over the window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", content = "reason", rename_all = "lowercase")]
pub enum CheckStatus {
    /// Made on everything it covers.
    Done,
    /// Not made, on purpose (an emulated fleet, a caller that turned it off).
    Off(String),
    /// Not made (or not on everything), because the data was missing: why.
    Unavailable(String),
}

impl Default for CheckStatus {
    /// What a summary written before the check existed reads as.
    fn default() -> CheckStatus {
        CheckStatus::Unavailable("not recorded".into())
    }
}

/// Throttling of one card the checks cover.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuThrottle {
    /// NVML device index.
    pub device: u32,
    /// Replicas on this card (empty when the fleet's cards are not known).
    pub replicas: Vec<usize>,
    /// Samples taken of this card.
    pub samples: u32,
    /// Share of samples with a throttle reason other than idle / application clocks (the share
    /// calibration measures, as [`GpuSummary::throttle_share`]).
    pub throttle_share: f64,
    /// Share of samples per reason (`fleet::gpu::throttle_groups`: `thermal slowdown`, `power cap`, …).
    pub reason_shares: BTreeMap<String, f64>,
}

impl GpuThrottle {
    /// The reasons seen, most frequent first.
    pub fn reasons_by_share(&self) -> Vec<&str> {
        let mut reasons: Vec<(&str, f64)> = self
            .reason_shares
            .iter()
            .map(|(name, share)| (name.as_str(), *share))
            .collect();
        reasons.sort_by(|a, b| b.1.total_cmp(&a.1));
        reasons.into_iter().map(|(name, _)| name).collect()
    }
}

/// Limits a clean cell respects.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvidenceBounds {
    /// Largest acceptable engine lateness p99, ms.
    pub max_lateness_p99_ms: f64,
    /// Largest acceptable share of samples in which one of the fleet's cards throttled — the
    /// calibrated outlier bound, filled by the caller from calibration; `None`: not checked.
    pub max_throttle_share: Option<f64>,
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
        if let Some(bound) = bounds.max_throttle_share {
            for g in &self.gpu_throttle {
                if g.samples > 0 && g.throttle_share > bound {
                    return Err(format!(
                        "GPU {}{} throttled ({}) in {:.0}% of samples, above the calibrated bound {:.0}%",
                        g.device,
                        match g.replicas.as_slice() {
                            [] => String::new(),
                            [r] => format!(" (replica {r})"),
                            rs => format!(" (replicas {rs:?})"),
                        },
                        g.reasons_by_share().join(", "),
                        g.throttle_share * 100.0,
                        bound * 100.0
                    ));
                }
            }
        }
        // Every replica over the bound is named, not only the first: a check that stopped at
        // the first would name replica 0 whenever the whole machine was late, which once read as
        // a fault of replica 0 alone.
        let over: Vec<String> = (self.lateness.iter())
            .filter_map(|l| match l.p99_ms {
                Some(p99) if p99 <= bounds.max_lateness_p99_ms => None,
                Some(p99) => Some(format!("replica {} lateness p99 {p99:.3} ms", l.replica)),
                None if l.steps > 0.0 => Some(format!(
                    "replica {} lateness p99 past the histogram's last bucket",
                    l.replica
                )),
                None => None,
            })
            .collect();
        if !over.is_empty() {
            let within = self.lateness.len() - over.len();
            return Err(format!(
                "{} {} the bound {:.3} ms ({within} of {} replicas within it)",
                over.join(", "),
                if over.len() == 1 { "exceeds" } else { "exceed" },
                bounds.max_lateness_p99_ms,
                self.lateness.len()
            ));
        }
        Ok(())
    }
}
