//! Fleet description files (issue #41): a TOML file that says what a user's fleet is — the GPU,
//! the model, tensor parallelism, the engine's limits and the KV capacity per replica — from
//! which the engine's step model follows by the roofline rule of `engine_core::describe`.
//!
//! ```toml
//! name = "h100-llama-3.1-8b-bf16"
//! tp = 1
//! kv_tokens_per_replica = 400_000   # vLLM's "GPU KV cache size: N tokens"
//! block_tokens = 16
//! max_num_batched_tokens = 8192
//! max_num_seqs = 256
//! max_model_len = 32768
//! step_overhead_ms = 0.8            # the reference fit's; see its source
//! frontend_ms = 38.0
//!
//! [gpu]
//! name = "h100-sxm"
//! memory_bandwidth_gb_s = 3350
//! dense_fp16_tflops = 989.4
//! source = "NVIDIA H100 Tensor Core GPU datasheet"
//!
//! [model]
//! name = "llama-3.1-8b"
//! params = 8.03e9
//! layers = 32
//! attention_heads = 32
//! kv_heads = 8
//! head_dim = 128
//! weight_bytes_per_param = 2
//! kv_bytes_per_value = 2
//! source = "meta-llama/Llama-3.1-8B config.json"
//! ```
//!
//! Optional: `step_model = "<preset>"` keeps a *fitted* step model instead of the roofline (the
//! reference fleet's description does, so that its output stays byte for byte what it was; its
//! roofline is checked against the fit instead), and an `[efficiency]` table (`bandwidth`,
//! `compute`, `attention`, with a `source`) in place of the reference fit's
//! (`engine_core::describe::Efficiency::reference_fit`). Unknown keys are refused, and every
//! error names `path:line`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use engine_core::describe::{self, Efficiency, GpuSpec, ModelSpec};
use engine_core::{EngineConfig, StepModel};
use serde::Deserialize;

/// The directory of the descriptions kvroute ships, relative to the workspace root.
pub const SHIPPED_DIR: &str = "fleets";

/// A parsed and checked fleet description.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetDescription {
    /// The file it was read from.
    pub path: PathBuf,
    /// Its name (`name`).
    pub name: String,
    /// The accelerator.
    pub gpu: GpuSpec,
    /// The model.
    pub model: ModelSpec,
    /// GPUs per replica (tensor parallelism).
    pub tp: u32,
    /// KV capacity of one replica in tokens, as vLLM reports it (blocks × block size).
    pub kv_tokens_per_replica: u64,
    /// Tokens per KV block (vLLM's `--block-size`).
    pub block_tokens: u32,
    /// Token budget of one step (`--max-num-batched-tokens`).
    pub max_num_batched_tokens: u32,
    /// Most sequences in one step (`--max-num-seqs`).
    pub max_num_seqs: u32,
    /// Longest prompt plus output (`--max-model-len`).
    pub max_model_len: u32,
    /// Fixed cost of one engine step, ms.
    pub step_overhead_ms: f64,
    /// Per-request front-end cost (HTTP, template, tokenize) before scheduling, ms.
    pub frontend_ms: f64,
    /// A fitted step-model preset used in place of the roofline, when the file names one.
    pub fitted_step_model: Option<String>,
    /// The efficiencies the roofline uses, and where they come from.
    pub efficiency: Efficiency,
    /// Where the efficiencies come from.
    pub efficiency_source: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    name: String,
    tp: u32,
    kv_tokens_per_replica: u64,
    block_tokens: u32,
    max_num_batched_tokens: u32,
    max_num_seqs: u32,
    max_model_len: u32,
    step_overhead_ms: f64,
    frontend_ms: f64,
    #[serde(default)]
    step_model: Option<String>,
    gpu: GpuFile,
    model: ModelFile,
    #[serde(default)]
    efficiency: Option<EfficiencyFile>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GpuFile {
    name: String,
    memory_bandwidth_gb_s: f64,
    dense_fp16_tflops: f64,
    source: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelFile {
    name: String,
    params: f64,
    layers: u32,
    attention_heads: u32,
    kv_heads: u32,
    head_dim: u32,
    weight_bytes_per_param: f64,
    kv_bytes_per_value: f64,
    source: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EfficiencyFile {
    bandwidth: f64,
    compute: f64,
    attention: f64,
    source: String,
}

/// The 1-based line of byte `offset` in `text`.
fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

/// The line of `key = …` (at the start of a line) in `text`, for errors found after parsing.
pub(crate) fn line_of_key(text: &str, key: &str) -> Option<usize> {
    text.lines()
        .position(|l| {
            l.trim_start()
                .strip_prefix(key)
                .is_some_and(|rest| rest.trim_start().starts_with('='))
        })
        .map(|i| i + 1)
}

impl FleetDescription {
    /// [`FleetDescription::read`] for a command-line value (clap's `value_parser`).
    pub fn from_arg(path: &str) -> Result<FleetDescription, String> {
        Self::read(Path::new(path)).map_err(|e| format!("{e:#}"))
    }

    /// The pool a description sets (`--num-gpu-blocks` when the flag is not given), if any.
    pub fn blocks(description: &Option<FleetDescription>) -> Option<u64> {
        description.as_ref().map(|d| u64::from(d.num_gpu_blocks()))
    }

    /// Reads and checks the description at `path`.
    pub fn read(path: &Path) -> Result<FleetDescription> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the fleet description {}", path.display()))?;
        Self::parse(path, &text)
    }

    /// Parses and checks `text`, read from `path` (named in every error as `path:line`).
    pub fn parse(path: &Path, text: &str) -> Result<FleetDescription> {
        let file: File = from_toml(path, text)?;
        let at = |key: &str| -> String {
            match line_of_key(text, key) {
                Some(line) => format!("{}:{line}", path.display()),
                None => path.display().to_string(),
            }
        };
        let gpu = GpuSpec {
            name: file.gpu.name,
            memory_bandwidth_gb_s: file.gpu.memory_bandwidth_gb_s,
            dense_fp16_tflops: file.gpu.dense_fp16_tflops,
            source: file.gpu.source,
        };
        let model = ModelSpec {
            name: file.model.name,
            params: file.model.params,
            layers: file.model.layers,
            attention_heads: file.model.attention_heads,
            kv_heads: file.model.kv_heads,
            head_dim: file.model.head_dim,
            weight_bytes_per_param: file.model.weight_bytes_per_param,
            kv_bytes_per_value: file.model.kv_bytes_per_value,
            source: file.model.source,
        };
        describe::check(&gpu, &model, file.tp).map_err(|e| {
            let key = match &e {
                describe::DescribeError::NotPositive { field, .. }
                | describe::DescribeError::Zero { field } => {
                    field.rsplit('.').next().unwrap_or(field).to_string()
                }
                describe::DescribeError::Shape(_) => "tp".to_string(),
            };
            anyhow!("{}: {e}", at(&key))
        })?;
        let (efficiency, efficiency_source) = match file.efficiency {
            Some(e) => {
                for (key, v) in [
                    ("bandwidth", e.bandwidth),
                    ("compute", e.compute),
                    ("attention", e.attention),
                ] {
                    if !v.is_finite() || v <= 0.0 || v > 1.0 {
                        bail!(
                            "{}: efficiency.{key} must be a share of the peak in (0, 1], got {v}",
                            at(key)
                        );
                    }
                }
                (
                    Efficiency {
                        bandwidth: e.bandwidth,
                        compute: e.compute,
                        attention: e.attention,
                    },
                    e.source,
                )
            }
            None => (
                Efficiency::reference_fit(),
                "the reference fit vllm-3090 (engine_core::describe::Efficiency::reference_fit): \
                 its fitted constants over the roofline's peaks on an RTX 3090 with a 4-bit 8B model"
                    .to_string(),
            ),
        };
        if let Some(preset) = &file.step_model
            && StepModel::preset(preset).is_none()
        {
            bail!(
                "{}: unknown step_model {preset:?} (the fitted presets: {})",
                at("step_model"),
                engine_core::config::STEP_MODEL_PRESETS.join(", ")
            );
        }
        for (key, v) in [
            ("step_overhead_ms", file.step_overhead_ms),
            ("frontend_ms", file.frontend_ms),
        ] {
            if !v.is_finite() || v < 0.0 {
                bail!("{}: {key} must be a finite number >= 0, got {v}", at(key));
            }
        }
        if file.block_tokens == 0
            || !file
                .kv_tokens_per_replica
                .is_multiple_of(u64::from(file.block_tokens))
        {
            bail!(
                "{}: kv_tokens_per_replica ({}) must be a whole number of blocks of block_tokens ({})",
                at("kv_tokens_per_replica"),
                file.kv_tokens_per_replica,
                file.block_tokens
            );
        }
        let description = FleetDescription {
            path: path.to_path_buf(),
            name: file.name,
            gpu,
            model,
            tp: file.tp,
            kv_tokens_per_replica: file.kv_tokens_per_replica,
            block_tokens: file.block_tokens,
            max_num_batched_tokens: file.max_num_batched_tokens,
            max_num_seqs: file.max_num_seqs,
            max_model_len: file.max_model_len,
            step_overhead_ms: file.step_overhead_ms,
            frontend_ms: file.frontend_ms,
            fitted_step_model: file.step_model,
            efficiency,
            efficiency_source,
        };
        description
            .engine_config()
            .validate()
            .map_err(|e| anyhow!("{}: {e}", path.display()))?;
        Ok(description)
    }

    /// The step model: the fitted preset the file names, else the roofline of its GPU and model
    /// at its efficiencies; either with the file's step overhead and front-end cost.
    pub fn step_model(&self) -> StepModel {
        match &self.fitted_step_model {
            Some(preset) => StepModel {
                overhead_ms: self.step_overhead_ms,
                frontend_ms: self.frontend_ms,
                ..StepModel::preset(preset).expect("checked by parse")
            },
            None => self.roofline_step_model(),
        }
    }

    /// The roofline's step model, whether or not the file keeps a fitted one (for the check of a
    /// fitted description against its roofline).
    pub fn roofline_step_model(&self) -> StepModel {
        StepModel {
            overhead_ms: self.step_overhead_ms,
            frontend_ms: self.frontend_ms,
            ..describe::roofline(&self.gpu, &self.model, self.tp, &self.efficiency)
        }
    }

    /// KV blocks per replica, vLLM's `num_gpu_blocks` (its KV tokens ÷ block size).
    pub fn num_gpu_blocks(&self) -> u32 {
        u32::try_from(self.kv_tokens_per_replica / u64::from(self.block_tokens)).unwrap_or(u32::MAX)
    }

    /// The emulated engines this description gives: the emulator's default engine
    /// (`EmulatedCache::Paged`, no flags) when it is exactly that one, so the reference fleet's
    /// description changes nothing a run records; else its engine config as the engine's flags
    /// ([`engine_args`]). The pool (`--num-gpu-blocks`) is the fleet's, set apart.
    pub fn emulated_cache(&self) -> fleet::EmulatedCache {
        let cfg = self.engine_config();
        let default = EngineConfig::default();
        if (EngineConfig {
            num_gpu_blocks: default.num_gpu_blocks,
            ..cfg.clone()
        }) == default
        {
            return fleet::EmulatedCache::Paged;
        }
        fleet::EmulatedCache::Described(Box::new(fleet::DescribedEngine {
            name: self.name.clone(),
            args: engine_args(&cfg),
        }))
    }

    /// One replica's engine configuration: the described limits and step model, everything else
    /// at the engine's defaults.
    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            block_size: self.block_tokens,
            num_gpu_blocks: self.num_gpu_blocks(),
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            max_model_len: self.max_model_len,
            model: self.step_model(),
            ..EngineConfig::default()
        }
    }
}

/// The `engine` binary's flags for `cfg`'s limits and step-time constants (its pool, seed, speed,
/// slowdown and jitter are the fleet's, passed apart). Rust prints an `f64` in the shortest form
/// that reads back to the same value, so the engine runs exactly these constants.
pub fn engine_args(cfg: &EngineConfig) -> Vec<String> {
    let m = &cfg.model;
    let limits = [
        ("--block-size", cfg.block_size),
        ("--max-num-batched-tokens", cfg.max_num_batched_tokens),
        ("--max-num-seqs", cfg.max_num_seqs),
        ("--max-model-len", cfg.max_model_len),
    ];
    let constants = [
        ("--step-overhead-ms", m.overhead_ms),
        ("--weight-bytes", m.weight_bytes),
        ("--kv-bytes-per-token", m.kv_bytes_per_token),
        ("--bandwidth-bytes-per-s", m.bandwidth_bytes_per_s),
        ("--c-tok-ms", m.c_tok_ms),
        ("--c-attn-ms", m.c_attn_ms),
        ("--c-decode-ctx-ms", m.c_decode_ctx_ms),
        ("--frontend-ms", m.frontend_ms),
        ("--tokenize-ms", m.tokenize_ms),
    ];
    let limits = limits.iter().map(|(f, v)| [f.to_string(), v.to_string()]);
    let constants = constants
        .iter()
        .map(|(f, v)| [f.to_string(), v.to_string()]);
    limits.chain(constants).flatten().collect()
}

/// `text`, read from `path`, as a `T`; a TOML error (a typo'd key, a wrong type) names
/// `path:line`. The one parser of the description files (fleets and workloads).
pub(crate) fn from_toml<T: serde::de::DeserializeOwned>(path: &Path, text: &str) -> Result<T> {
    toml::from_str(text).map_err(|e| {
        let line = e.span().map_or(1, |s| line_of(text, s.start));
        anyhow!("{}:{line}: {}", path.display(), e.message().trim_end())
    })
}

/// Every `*.toml` file in `dir`, sorted by path, read by `read`: the shipped descriptions.
pub(crate) fn read_toml_dir<T>(dir: &Path, read: impl Fn(&Path) -> Result<T>) -> Result<Vec<T>> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    paths.sort();
    paths.iter().map(|p| read(p)).collect()
}

/// The descriptions kvroute ships (`fleets/*.toml` under `root`), sorted by path.
pub fn shipped(root: &Path) -> Result<Vec<FleetDescription>> {
    read_toml_dir(&root.join(SHIPPED_DIR), FleetDescription::read)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
    }

    #[test]
    fn every_shipped_description_parses_and_the_reference_keeps_its_fit() {
        let all = shipped(&root()).unwrap();
        assert!(all.len() >= 3, "{} descriptions", all.len());
        let reference = all
            .iter()
            .find(|d| d.fitted_step_model.as_deref() == Some("vllm-3090"))
            .expect("the reference fleet's description");
        // Byte for byte: the engine the reference description gives is today's default engine
        // with the description's pool, so every virtual result made with it is unchanged.
        let cfg = reference.engine_config();
        assert_eq!(cfg.model, StepModel::default());
        assert_eq!(
            EngineConfig {
                num_gpu_blocks: engine_core::DEFAULT_NUM_GPU_BLOCKS,
                ..cfg
            },
            EngineConfig::default()
        );
        // And its roofline, at the reference efficiencies, is the fit to rounding.
        let roof = reference.roofline_step_model();
        let fit = StepModel::default();
        for (a, b) in [
            (roof.weight_bytes, fit.weight_bytes),
            (roof.kv_bytes_per_token, fit.kv_bytes_per_token),
            (roof.bandwidth_bytes_per_s, fit.bandwidth_bytes_per_s),
            (roof.c_tok_ms, fit.c_tok_ms),
            (roof.c_attn_ms, fit.c_attn_ms),
            (roof.overhead_ms, fit.overhead_ms),
            (roof.frontend_ms, fit.frontend_ms),
        ] {
            assert!(((a - b) / b).abs() < 1e-6, "{a} vs {b}");
        }
        for d in &all {
            assert!(
                !d.gpu.source.is_empty() && !d.model.source.is_empty(),
                "{}",
                d.name
            );
        }
    }

    #[test]
    fn a_broken_description_names_its_line() {
        let good =
            std::fs::read_to_string(root().join(SHIPPED_DIR).join("h100-llama-3.1-8b-bf16.toml"))
                .unwrap();
        let p = Path::new("fleet.toml");
        FleetDescription::parse(p, &good).unwrap();
        // A typo'd key: refused at its line, not ignored.
        let typo = good.replacen("max_num_seqs", "max_num_seq", 1);
        let line = typo
            .lines()
            .position(|l| l.starts_with("max_num_seq "))
            .unwrap()
            + 1;
        let err = FleetDescription::parse(p, &typo).unwrap_err().to_string();
        assert!(err.starts_with(&format!("fleet.toml:{line}:")), "{err}");
        // A value out of range: its own line.
        let bad = good.replacen("tp = 1", "tp = 3", 1);
        let line = bad.lines().position(|l| l.starts_with("tp = 3")).unwrap() + 1;
        let err = FleetDescription::parse(p, &bad).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!("fleet.toml:{line}:")) && err.contains("tp 3"),
            "{err}"
        );
        let bad = good.replacen("block_tokens = 16", "block_tokens = 48", 1);
        let err = FleetDescription::parse(p, &bad).unwrap_err().to_string();
        assert!(err.contains("whole number of blocks"), "{err}");
        let bad = good.replacen("[gpu]", "[gpu]\nmemory_bandwidth_gb_s = 1", 1);
        assert!(FleetDescription::parse(p, &bad).is_err(), "a duplicate key");
    }

    #[test]
    fn a_faster_card_gives_shorter_steps_by_the_rule() {
        let all = shipped(&root()).unwrap();
        let by = |name: &str| all.iter().find(|d| d.name == name).unwrap().step_model();
        let (ref_step, h100) = (by("rtx3090-llama-3-8b-4bit"), by("h100-llama-3.1-8b-bf16"));
        // A batch-1 decode at 1,100 tokens of context is memory-bound on both: BF16 weights are
        // 3.4× the reference's 4-bit bytes, over 3.6× its bandwidth.
        let decode = |m: &StepModel| m.raw_step_us(1, 1_100, 0.0, 1_100);
        assert!(decode(&h100) < decode(&ref_step));
        // A 1,100-token prefill is compute-bound on both, and the H100's peak is 13.9× the 3090's.
        let prefill = |m: &StepModel| m.raw_step_us(1_100, 1_100, 1_100.0 * 550.0, 0);
        assert!(prefill(&h100) * 5.0 < prefill(&ref_step));
    }
}
