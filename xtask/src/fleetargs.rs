//! Fleet flags shared by `calibrate` and `sweep`, and the fleet description recorded in meta
//! (`FleetArgs::key`, an `experiment::calibration::FleetKey`).

use std::path::Path;
use std::time::Duration;

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

use experiment::calibration::FleetKey;
use fleet::{CommandSpec, EmulatedSpec, FleetOptions, Source, StaticSpec};

/// Default emulator speed-up. Chosen so that `sweep pressure-grid --quick` fits a fresh 2-core
/// machine's 20-minute budget while engine lateness stays within its bound (see README).
pub const DEFAULT_SPEED: f64 = 6.0;

/// KV blocks per emulated replica: about a 3090's pool for a 4-bit 8B model (REFERENCE.md §1:
/// ~16 GB of KV at 128 KiB per token ≈ 125k tokens ≈ 7,800 blocks), so that even working set
/// 0.25 holds many more conversations than the 32 users (a closed-loop user waits while
/// another holds the same conversation's turn).
pub const FULL_BLOCKS: u64 = 8192;
/// KV blocks per replica with `--quick`: half the pool, so the cache fills within the short
/// warm-up, while working set 1 still holds ~70 conversations for 32 users.
pub const QUICK_BLOCKS: u64 = 4096;
/// Warm-up per cell, wall s: long enough for the caches to fill and the users' turns to fall out
/// of step after their simultaneous start.
pub const FULL_WARMUP_S: f64 = 20.0;
/// Measured window per cell, wall s.
pub const FULL_MEASURE_S: f64 = 40.0;
/// Warm-up per cell with `--quick`, wall s.
pub const QUICK_WARMUP_S: f64 = 5.0;
/// Measured window per cell with `--quick`, wall s.
pub const QUICK_MEASURE_S: f64 = 8.0;

/// Default warm-up, wall s.
pub fn default_warmup_s(quick: bool) -> f64 {
    if quick { QUICK_WARMUP_S } else { FULL_WARMUP_S }
}

/// Default measured window, wall s.
pub fn default_measure_s(quick: bool) -> f64 {
    if quick {
        QUICK_MEASURE_S
    } else {
        FULL_MEASURE_S
    }
}

/// Where replicas come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FleetKind {
    /// Spawn `engine` processes on loopback.
    Emulated,
    /// Start replicas from `--command` (vLLM, SGLang).
    Command,
    /// Use `--urls` managed elsewhere.
    Static,
}

/// The fleet a command runs against.
#[derive(Debug, Clone, Args)]
pub struct FleetArgs {
    /// Replica source.
    #[arg(long, value_enum, default_value_t = FleetKind::Emulated)]
    pub fleet: FleetKind,
    /// Replicas (emulated, command). Default: 5, or 3 with --quick.
    #[arg(long)]
    pub replicas: Option<usize>,
    /// Emulator speed-up: every modelled duration is divided by it.
    #[arg(long, default_value_t = DEFAULT_SPEED)]
    pub speed: f64,
    /// Per-replica emulated slowdown factors, e.g. `1,1,1,1,1.5` (a throttled card).
    #[arg(long, value_delimiter = ',')]
    pub slowdowns: Vec<f64>,
    /// KV blocks per emulated replica (`--num-gpu-blocks`). Default: 8192, or 4096 with --quick.
    #[arg(long)]
    pub num_gpu_blocks: Option<u64>,
    /// Model name (served by the replicas; the router's salt).
    #[arg(long, default_value = "kvroute/emulated-8b")]
    pub model: String,
    /// Base seed of the emulated engines.
    #[arg(long, default_value_t = 1)]
    pub engine_seed: u64,
    /// Command template for `--fleet command`; placeholders {model} {port} {kv_port} {gpu}
    /// {index} {host}; runs with CUDA_VISIBLE_DEVICES={gpu}.
    #[arg(long)]
    pub command: Option<String>,
    /// Host the command replicas listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// First port of the command replicas (replica i: base + i).
    #[arg(long, default_value_t = 8100)]
    pub base_port: u16,
    /// First KV-event port of the command replicas (replica i: base + i).
    #[arg(long)]
    pub kv_base_port: Option<u16>,
    /// GPU ids for the command replicas, e.g. `0,1,2,3,4`.
    #[arg(long, value_delimiter = ',')]
    pub gpus: Vec<String>,
    /// Replica URLs for `--fleet static`.
    #[arg(long, value_delimiter = ',')]
    pub urls: Vec<String>,
    /// KV event endpoints of the static replicas, same order.
    #[arg(long, value_delimiter = ',')]
    pub kv_events: Vec<String>,
    /// Seconds a replica may take to become healthy.
    #[arg(long, default_value_t = 120.0)]
    pub ready_timeout_s: f64,
}

impl FleetArgs {
    /// The replica count this invocation asks for.
    pub fn replica_count(&self, quick: bool) -> usize {
        match self.fleet {
            FleetKind::Static => self.urls.len(),
            _ => self.replicas.unwrap_or(if quick { 3 } else { 5 }),
        }
    }

    /// KV blocks per emulated replica.
    pub fn blocks(&self, quick: bool) -> u64 {
        self.num_gpu_blocks
            .unwrap_or(if quick { QUICK_BLOCKS } else { FULL_BLOCKS })
    }

    /// The speed the timings run at (real engines: 1).
    pub fn effective_speed(&self) -> f64 {
        match self.fleet {
            FleetKind::Emulated => self.speed,
            _ => 1.0,
        }
    }

    /// The fleet source, keeping only the replicas in `keep` (all when `None`).
    pub fn source(
        &self,
        engine_bin: &Path,
        quick: bool,
        kv_events: bool,
        keep: Option<&[usize]>,
    ) -> Result<Source> {
        let n = self.replica_count(quick);
        if n == 0 {
            bail!("the fleet has no replicas (give --replicas, or --urls for --fleet static)");
        }
        let all: Vec<usize> = (0..n).collect();
        let keep: Vec<usize> = keep.map_or(all, |k| k.to_vec());
        if let Some(bad) = keep.iter().find(|&&i| i >= n) {
            bail!("replica {bad} is outside a fleet of {n}");
        }
        if !self.slowdowns.is_empty() && self.slowdowns.len() != n {
            bail!(
                "--slowdowns gives {} factors for {n} replicas",
                self.slowdowns.len()
            );
        }
        Ok(match self.fleet {
            FleetKind::Emulated => Source::Emulated(EmulatedSpec {
                engine_bin: engine_bin.to_path_buf(),
                replicas: keep.len(),
                speed: self.speed,
                slowdowns: keep
                    .iter()
                    .map(|&i| self.slowdowns.get(i).copied().unwrap_or(1.0))
                    .collect(),
                num_gpu_blocks: Some(self.blocks(quick)),
                model: self.model.clone(),
                seed: self.engine_seed,
                kv_events,
                extra_args: Vec::new(),
            }),
            FleetKind::Command => {
                let Some(template) = self.command.clone() else {
                    bail!("--fleet command needs --command TEMPLATE");
                };
                if keep.len() != n && self.gpus.is_empty() {
                    bail!(
                        "excluding replicas of a command fleet needs --gpus to say which card each one uses"
                    );
                }
                let gpus: Vec<String> = keep
                    .iter()
                    .map(|&i| self.gpus.get(i).cloned().unwrap_or_else(|| i.to_string()))
                    .collect();
                Source::Command(CommandSpec {
                    template,
                    model: self.model.clone(),
                    replicas: keep.len(),
                    host: self.host.clone(),
                    base_port: self.base_port,
                    kv_base_port: self.kv_base_port,
                    gpus,
                })
            }
            FleetKind::Static => Source::Static(StaticSpec {
                urls: keep.iter().map(|&i| self.urls[i].clone()).collect(),
                kv_events: keep
                    .iter()
                    .filter_map(|&i| self.kv_events.get(i).cloned())
                    .collect(),
            }),
        })
    }

    /// Log directory and timeouts.
    pub fn options(&self, log_dir: &Path) -> FleetOptions {
        FleetOptions {
            ready_timeout: Duration::from_secs_f64(self.ready_timeout_s.max(1.0)),
            ..FleetOptions::new(log_dir)
        }
    }

    /// The key a calibration is valid for (before any exclusion).
    pub fn key(&self, quick: bool) -> FleetKey {
        let n = self.replica_count(quick);
        FleetKey {
            source: format!("{:?}", self.fleet).to_lowercase(),
            replicas: n,
            speed: self.effective_speed(),
            slowdowns: (0..n)
                .map(|i| self.slowdowns.get(i).copied().unwrap_or(1.0))
                .collect(),
            num_gpu_blocks: matches!(self.fleet, FleetKind::Emulated).then(|| self.blocks(quick)),
            model: self.model.clone(),
            detail: match self.fleet {
                FleetKind::Emulated => None,
                FleetKind::Command => self.command.clone(),
                FleetKind::Static => Some(self.urls.join(",")),
            },
        }
    }
}
