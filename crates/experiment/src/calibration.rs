//! `calibration.json`: what a calibration measured and the settings it implies, and the rules that
//! derive them from measurements (DESIGN.md §3.9): floors → SLO, throttling outliers, KV capacity,
//! requests per closed-loop user, and the reference run's belief decay → index TTL and node cap.
//!
//! Measuring is [`crate::calibrate`] (it starts the fleet and drives the load); everything here
//! is a pure function of what it measured, except reading and writing the record.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use fleet::evidence::GpuSummary;
use fleet::metrics::CacheConfig;
use schema::Slo;

use crate::cell;

/// SLO = this many times the floor (DESIGN.md §3.9).
pub const SLO_FACTOR: f64 = 3.0;

/// Share of throttled samples above the peers' median that makes a card an outlier (the
/// reference fleet's throttling card: 67% of samples, the others 0–34%).
pub const THROTTLE_SHARE_MARGIN: f64 = 0.3;

/// What meta.json records about the fleet (`fleet {source, replicas, speed, slowdowns,
/// capacity_tokens}` plus detail), and what decides whether a calibration still applies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FleetKey {
    /// `emulated`, `command` or `static`.
    pub source: String,
    /// Replicas in use.
    pub replicas: usize,
    /// Emulator speed (1 for real engines).
    pub speed: f64,
    /// Slowdown per replica in use.
    pub slowdowns: Vec<f64>,
    /// KV blocks per emulated replica when set.
    pub num_gpu_blocks: Option<u64>,
    /// Model.
    pub model: String,
    /// Command template or static URLs.
    pub detail: Option<String>,
}

/// One replica's calibration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplicaCalibration {
    /// Index in the fleet as given (before exclusions).
    pub index: usize,
    /// Base URL during calibration.
    pub url: String,
    /// Emulated slowdown (1 for real engines).
    pub slowdown: f64,
    /// TTFT p50 of unseen prompts at concurrency 1, ms (wall).
    pub ttft_p50_ms: f64,
    /// Per-request ITL p50, median over requests, ms (wall).
    pub itl_p50_ms: f64,
    /// Requests the floors rest on (successful, nothing cached).
    pub requests_used: usize,
    /// From `vllm:cache_config_info`.
    pub cache: Option<CacheConfig>,
    /// Largest of TTFT and ITL floor ÷ the median of the other replicas.
    pub outlier_ratio: Option<f64>,
    /// Share of GPU samples with a throttle reason during the floors (command fleets with NVML).
    #[serde(default)]
    pub gpu_throttle_share: Option<f64>,
    /// Set when the replica is excluded (or would be, with --include-outliers).
    pub outlier_reason: Option<String>,
}

/// The index settings implied by the reference load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IndexCalibration {
    /// Index TTL, wall s (at the calibration speed); `None` when nothing was observed.
    pub ttl_s: Option<f64>,
    /// True when no band fell below the honour threshold: the TTL is at least `ttl_s`.
    pub ttl_is_lower_bound: bool,
    /// Node cap from the capacity model scaled by the honoured share.
    pub node_cap: Option<u64>,
    /// Share of predicted tokens the engines honoured.
    pub honoured_share: Option<f64>,
    /// The analysis's full output (bands, counts).
    pub detail: serde_json::Value,
}

/// `calibration.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// The fleet this calibration is valid for (before exclusions).
    pub fleet: FleetKey,
    /// Per replica, in fleet order.
    pub replicas: Vec<ReplicaCalibration>,
    /// Replicas the sweeps use.
    pub used_replicas: Vec<usize>,
    /// Median floors over the used replicas, ms (wall).
    pub floors: Slo,
    /// `SLO_FACTOR`.
    pub slo_factor: f64,
    /// SLO = factor × floors, ms (wall).
    pub slo: Slo,
    /// Σ capacity of the used replicas, tokens.
    pub capacity_tokens: u64,
    /// Index TTL and node cap.
    pub index: IndexCalibration,
    /// GPU evidence during the floors (empty without NVML).
    pub gpus: Vec<GpuSummary>,
    /// `"ok"` or `"no GPU"` and why.
    pub gpu_status: String,
    /// Where the reference run's rows are.
    pub reference_run: Option<PathBuf>,
    /// Git revision.
    pub git_rev: Option<String>,
    /// Versions.
    pub versions: serde_json::Value,
    /// The fleet's capacity and the curve it was found on ([`crate::capacity`]); `None` when the
    /// calibration ran without the capacity search (and in files written before it existed).
    #[serde(default)]
    pub capacity: Option<crate::capacity::Capacity>,
}

impl Calibration {
    /// Reads a calibration.json.
    pub fn read(path: &Path) -> Result<Calibration> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    /// Writes it atomically.
    pub fn write(&self, path: &Path) -> Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        cell::write_atomic(path, serde_json::to_string_pretty(self)?.as_bytes())
    }
}

/// Median of `values` (through the analysis crate, the one place statistics live).
fn median(values: &[f64]) -> Option<f64> {
    analysis::stats::median(values)
}

/// Marks replicas whose floors exceed their peers' median by `factor`.
pub fn find_outliers(replicas: &mut [ReplicaCalibration], factor: f64) {
    let n = replicas.len();
    if n < 3 {
        // With two replicas there is no majority to call one of them the odd one out.
        return;
    }
    for i in 0..n {
        let others = |f: fn(&ReplicaCalibration) -> f64| -> Vec<f64> {
            replicas
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, r)| f(r))
                .collect()
        };
        let ttft_peers = median(&others(|r| r.ttft_p50_ms));
        let itl_peers = median(&others(|r| r.itl_p50_ms));
        let (Some(tp), Some(ip)) = (ttft_peers, itl_peers) else {
            continue;
        };
        let r = &mut replicas[i];
        let ratio = (r.ttft_p50_ms / tp).max(r.itl_p50_ms / ip);
        r.outlier_ratio = Some(ratio);
        if ratio > factor {
            r.outlier_reason = Some(format!(
                "throttling outlier: floors TTFT {:.1} ms / ITL {:.2} ms vs peers' median {:.1} / {:.2} ms ({ratio:.2}× > {factor}×)",
                r.ttft_p50_ms, r.itl_p50_ms, tp, ip
            ));
        }
    }
}

/// Marks replicas whose card throttled far more often than its peers' cards did.
/// `gpu_of(i)` is the NVML device of replica i, when known.
pub fn find_throttle_outliers(
    replicas: &mut [ReplicaCalibration],
    gpus: &[GpuSummary],
    gpu_of: impl Fn(usize) -> Option<u32>,
) {
    for r in replicas.iter_mut() {
        r.gpu_throttle_share = gpu_of(r.index)
            .and_then(|d| gpus.iter().find(|g| g.device == d))
            .map(|g| g.throttle_share);
    }
    if replicas.len() < 3 {
        return;
    }
    for i in 0..replicas.len() {
        let Some(share) = replicas[i].gpu_throttle_share else {
            continue;
        };
        let peers: Vec<f64> = replicas
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .filter_map(|(_, r)| r.gpu_throttle_share)
            .collect();
        let Some(m) = median(&peers) else { continue };
        if share - m > THROTTLE_SHARE_MARGIN && replicas[i].outlier_reason.is_none() {
            replicas[i].outlier_reason = Some(format!(
                "throttling outlier: GPU throttled on {:.0}% of samples vs peers' median {:.0}%",
                share * 100.0,
                m * 100.0
            ));
        }
    }
}

/// The replicas the sweeps use: those without an outlier reason (all of them with
/// `include_outliers`), or every replica when that would leave none.
pub fn replicas_in_use(replicas: &[ReplicaCalibration], include_outliers: bool) -> Vec<usize> {
    let used: Vec<usize> = replicas
        .iter()
        .filter(|r| include_outliers || r.outlier_reason.is_none())
        .map(|r| r.index)
        .collect();
    if used.is_empty() {
        replicas.iter().map(|r| r.index).collect()
    } else {
        used
    }
}

/// The fleet's floors: the median TTFT and ITL floor over the replicas in `used`; `None` when
/// none of them was measured.
pub fn floors(replicas: &[ReplicaCalibration], used: &[usize]) -> Option<Slo> {
    let in_use: Vec<&ReplicaCalibration> = replicas
        .iter()
        .filter(|r| used.contains(&r.index))
        .collect();
    Some(Slo {
        ttft_ms: median(&in_use.iter().map(|r| r.ttft_p50_ms).collect::<Vec<_>>())?,
        itl_ms: median(&in_use.iter().map(|r| r.itl_p50_ms).collect::<Vec<_>>())?,
    })
}

/// SLO = `SLO_FACTOR` × the floors, rounded to the microsecond.
pub fn slo_from_floors(floors: Slo) -> Slo {
    // Microsecond precision is all a millisecond bound can use; rounding keeps the recorded
    // SLO free of binary-fraction noise (207.78150000000002).
    let round_us = |ms: f64| (ms * 1e3).round() / 1e3;
    Slo {
        ttft_ms: round_us(floors.ttft_ms * SLO_FACTOR),
        itl_ms: round_us(floors.itl_ms * SLO_FACTOR),
    }
}

/// Σ KV capacity of the replicas in `used`, tokens (what sizes the working sets); 0 when none
/// reported its cache shape.
pub fn capacity_tokens(replicas: &[ReplicaCalibration], used: &[usize]) -> u64 {
    replicas
        .iter()
        .filter(|r| used.contains(&r.index))
        .map(|r| r.cache.map_or(0, |c| c.capacity_tokens()))
        .sum()
}

/// Requests per closed-loop user so that a run of `run_s` wall seconds never runs dry: twice
/// the estimate from the floors (the driver's `--duration-s` ends the run on time).
pub fn requests_per_user(run_s: f64, think_wall_s: f64, floors: Slo, output_tokens: u32) -> u32 {
    let service_s = (floors.ttft_ms + f64::from(output_tokens) * floors.itl_ms) / 1e3;
    let cycle_s = (think_wall_s + service_s).max(1e-3);
    ((2.0 * run_s / cycle_s).ceil() as u32).clamp(4, 100_000)
}

/// The index settings the reference run implies: belief decay by time since the session was
/// last served, in bands scaled to wall seconds at `speed` (so they cover the same model-time
/// gaps), → TTL and node cap (`analysis::metrics::{decay, implied}`).
pub fn index_from_reference(
    rep: &analysis::RepData,
    slo: &Slo,
    capacity_tokens: u64,
    speed: f64,
) -> IndexCalibration {
    let requests = analysis::metrics::measured_requests(rep, slo);
    let mut cfg = analysis::MetricsConfig::default();
    cfg.decay_edges_s = cfg.decay_edges_s.iter().map(|e| e / speed).collect();
    let decay = analysis::metrics::decay(&requests, &cfg.decay_edges_s);
    let implied = analysis::metrics::implied(&decay, Some(capacity_tokens), &cfg);
    IndexCalibration {
        ttl_s: implied.ttl_s,
        ttl_is_lower_bound: implied.ttl_is_lower_bound,
        node_cap: implied.node_cap,
        honoured_share: implied.honoured_share,
        detail: serde_json::json!({"decay": decay, "implied": implied, "config": cfg}),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(index: usize, ttft: f64, itl: f64) -> ReplicaCalibration {
        ReplicaCalibration {
            index,
            url: String::new(),
            slowdown: 1.0,
            ttft_p50_ms: ttft,
            itl_p50_ms: itl,
            requests_used: 10,
            cache: None,
            outlier_ratio: None,
            gpu_throttle_share: None,
            outlier_reason: None,
        }
    }

    fn gpu(device: u32, throttle_share: f64) -> GpuSummary {
        GpuSummary {
            device,
            name: "card".into(),
            sm_clock_mhz_min: Some(960),
            sm_clock_mhz_max: Some(1305),
            temperature_c_max: Some(80),
            throttle_share,
            samples: 100,
        }
    }

    #[test]
    fn a_card_that_throttles_far_more_is_an_outlier() {
        let mut r: Vec<ReplicaCalibration> = (0..5).map(|i| replica(i, 55.0, 1.3)).collect();
        let gpus = [
            gpu(0, 0.0),
            gpu(1, 0.34),
            gpu(2, 0.1),
            gpu(3, 0.2),
            gpu(4, 0.67),
        ];
        find_throttle_outliers(&mut r, &gpus, |i| Some(i as u32));
        let flagged: Vec<usize> = r
            .iter()
            .filter(|r| r.outlier_reason.is_some())
            .map(|r| r.index)
            .collect();
        assert_eq!(flagged, [4]);
        assert_eq!(r[1].gpu_throttle_share, Some(0.34));
        // Without a device map nothing is known and nothing is flagged.
        let mut r: Vec<ReplicaCalibration> = (0..5).map(|i| replica(i, 55.0, 1.3)).collect();
        find_throttle_outliers(&mut r, &gpus, |_| None);
        assert!(
            r.iter()
                .all(|r| r.outlier_reason.is_none() && r.gpu_throttle_share.is_none())
        );
    }

    #[test]
    fn a_throttled_replica_is_an_outlier() {
        let mut r = vec![
            replica(0, 55.0, 1.30),
            replica(1, 54.0, 1.31),
            replica(2, 56.0, 1.29),
            replica(3, 55.5, 1.30),
            replica(4, 82.0, 1.95),
        ];
        find_outliers(&mut r, 1.3);
        let flagged: Vec<usize> = r
            .iter()
            .filter(|r| r.outlier_reason.is_some())
            .map(|r| r.index)
            .collect();
        assert_eq!(flagged, [4]);
        assert!(r[4].outlier_ratio.unwrap() > 1.4);
        assert!(r[0].outlier_ratio.unwrap() < 1.1);
    }

    #[test]
    fn two_replicas_have_no_outlier() {
        let mut r = vec![replica(0, 50.0, 1.0), replica(1, 100.0, 2.0)];
        find_outliers(&mut r, 1.3);
        assert!(r.iter().all(|r| r.outlier_reason.is_none()));
    }

    #[test]
    fn floors_slo_and_capacity_come_from_the_replicas_in_use() {
        let mut r = vec![
            replica(0, 50.0, 1.0),
            replica(1, 54.0, 1.2),
            replica(2, 52.0, 1.1),
            replica(3, 90.0, 2.0),
        ];
        for (i, x) in r.iter_mut().enumerate() {
            x.cache = Some(CacheConfig {
                block_size_tokens: 16,
                num_gpu_blocks: 100 * (i as u64 + 1),
            });
        }
        r[3].outlier_reason = Some("throttling outlier".into());
        let used = replicas_in_use(&r, false);
        assert_eq!(used, [0, 1, 2]);
        assert_eq!(replicas_in_use(&r, true), [0, 1, 2, 3]);
        let floors = floors(&r, &used).unwrap();
        assert_eq!((floors.ttft_ms, floors.itl_ms), (52.0, 1.1));
        assert_eq!(capacity_tokens(&r, &used), 16 * (100 + 200 + 300));
        // Every replica an outlier: none would be left, so all are used.
        for x in &mut r {
            x.outlier_reason = Some("throttling outlier".into());
        }
        assert_eq!(replicas_in_use(&r, false), [0, 1, 2, 3]);
        assert!(super::floors(&r, &[]).is_none());
        assert_eq!(capacity_tokens(&r, &[]), 0);
    }

    #[test]
    fn the_slo_is_three_times_the_floors_to_the_microsecond() {
        let slo = slo_from_floors(Slo {
            ttft_ms: 55.12345,
            itl_ms: 1.3,
        });
        assert_eq!((slo.ttft_ms, slo.itl_ms), (165.37, 3.9));
    }

    #[test]
    fn requests_per_user_covers_the_run_twice() {
        let floors = Slo {
            ttft_ms: 55.0,
            itl_ms: 1.3,
        };
        // service 0.055 + 128 × 0.0013 = 0.2214 s; cycle 0.3881 s; 2 × 13 s / 0.3881 = 67.
        assert_eq!(requests_per_user(13.0, 1.0 / 6.0, floors, 128), 67);
        assert_eq!(requests_per_user(0.0, 0.0, floors, 128), 4);
    }

    #[test]
    fn the_index_settings_come_from_decay_bands_in_wall_seconds() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/analysis/sweep-basic/ws3-s1/prefix-affinity/rep-1");
        let analysis::load::RepLoad::Complete(rep) =
            analysis::load_rep(&dir, "ws3-s1", "prefix-affinity", 1).unwrap()
        else {
            panic!("the fixture repetition is complete");
        };
        let slo = rep.meta.slo;
        let at_speed_1 = index_from_reference(&rep, &slo, 100_000, 1.0);
        let at_speed_4 = index_from_reference(&rep, &slo, 100_000, 4.0);
        let edges = |i: &IndexCalibration| -> Vec<f64> {
            serde_json::from_value(i.detail["config"]["decay_edges_s"].clone()).unwrap()
        };
        let default_edges = analysis::MetricsConfig::default().decay_edges_s;
        assert_eq!(edges(&at_speed_1), default_edges);
        let quarter: Vec<f64> = default_edges.iter().map(|e| e / 4.0).collect();
        assert_eq!(edges(&at_speed_4), quarter);
        for key in ["decay", "implied", "config"] {
            assert!(at_speed_1.detail.get(key).is_some(), "detail lacks {key}");
        }
        assert_eq!(
            at_speed_1.honoured_share,
            at_speed_1.detail["implied"]["honoured_share"].as_f64()
        );
    }
}
