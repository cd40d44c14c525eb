//! A step model from a description of the hardware and the model (issue #41): the roofline rule
//! that turns public specifications (memory bandwidth, dense 16-bit tensor throughput, parameter
//! count, layer shape, tensor parallelism) into [`StepModel`]'s constants, with the efficiency
//! factors measured on the one fleet whose floors we have: the reference fit `vllm-3090`.
//!
//! The rule, per replica of `tp` GPUs (each term divided by `tp`: the weights, the KV heads and
//! the arithmetic are split across the group):
//!
//! - weights read once per step: `W = params × weight_bytes_per_param / tp`;
//! - KV read per context token per step: `kv = 2 × layers × kv_heads × head_dim × kv_bytes / tp`
//!   (K and V);
//! - effective bandwidth: `BW = one GPU's memory bandwidth × e_bw` (each GPU reads its share of the
//!   weights and KV at its own bandwidth, in parallel);
//! - compute per scheduled token (the dense layers' 2 FLOPs per parameter):
//!   `c_tok = 2 × params / tp / (peak dense FLOP/s × e_comp)`;
//! - attention compute per prefill token per context token (`QKᵀ` and `AV`, 2 FLOPs each per
//!   query head dimension): `c_attn = 4 × layers × attention_heads × head_dim / tp / (peak × e_attn)`.
//!
//! [`StepModel::raw_step_us`] then gives `T_step = T_ovh + max(T_mem, T_comp)`: decode is
//! memory-bound (weights plus context read once per step), prefill compute-bound.
//!
//! The efficiencies `e_bw`, `e_comp` and `e_attn` are the reference fit's constants divided by
//! what the same rule gives at 100% on its card and model ([`Efficiency::reference_fit`]): they
//! carry over what the fit measured (kernel, quantization and scheduling losses) to another card,
//! which is an assumption, stated wherever a derived model is used.
//!
//! What the rule leaves out: tensor-parallel communication (two all-reduces per layer; the rule
//! is optimistic for `tp > 1`, more so without NVLink), CUDA graphs and kernel-launch variation
//! with batch size (one fixed `overhead_ms` per step), and quantized-compute speed-ups (FP8 or INT4
//! tensor cores): compute is costed at the 16-bit dense rate whatever the weight format.

use crate::config::StepModel;

/// One accelerator's public specifications: what the roofline reads.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuSpec {
    /// Its name, as a description file gives it (`rtx-3090`, `h100-sxm`).
    pub name: String,
    /// Peak memory bandwidth, GB/s (10⁹ bytes per second), from the vendor's datasheet.
    pub memory_bandwidth_gb_s: f64,
    /// Peak dense 16-bit tensor throughput (FP16/BF16 with FP32 accumulate, no sparsity), TFLOPS.
    pub dense_fp16_tflops: f64,
    /// Where the two numbers come from (a datasheet's title or URL).
    pub source: String,
}

/// One model's shape, from its published configuration (`config.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    /// Its name, as a description file gives it.
    pub name: String,
    /// Parameter count.
    pub params: f64,
    /// Transformer layers (`num_hidden_layers`).
    pub layers: u32,
    /// Query heads (`num_attention_heads`).
    pub attention_heads: u32,
    /// KV heads (`num_key_value_heads`; fewer than the query heads under grouped-query attention).
    pub kv_heads: u32,
    /// Dimension of one head (`head_dim`, else `hidden_size / num_attention_heads`).
    pub head_dim: u32,
    /// Bytes per weight as served: 2 for BF16/FP16, 1 for FP8, about 0.56–0.6 for 4-bit with its
    /// scales (the reference: 4.7 GB for 8.03 B parameters).
    pub weight_bytes_per_param: f64,
    /// Bytes per cached K or V value: 2 for an FP16/BF16 KV cache, 1 for FP8.
    pub kv_bytes_per_value: f64,
    /// Where the shape comes from.
    pub source: String,
}

impl ModelSpec {
    /// KV bytes per token of context on one replica of `tp` GPUs, all of them together.
    pub fn kv_bytes_per_token(&self) -> f64 {
        2.0 * f64::from(self.layers)
            * f64::from(self.kv_heads)
            * f64::from(self.head_dim)
            * self.kv_bytes_per_value
    }

    /// Weight bytes of the whole model.
    pub fn weight_bytes(&self) -> f64 {
        self.params * self.weight_bytes_per_param
    }
}

/// The share of each peak that the engine achieves, as measured by a fit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Efficiency {
    /// Achieved ÷ peak memory bandwidth (the memory-bound decode).
    pub bandwidth: f64,
    /// Achieved ÷ peak dense throughput on the per-token (matmul) work.
    pub compute: f64,
    /// Achieved ÷ peak dense throughput on prefill attention.
    pub attention: f64,
}

/// Why a description cannot give a step model; the message names the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DescribeError {
    /// A number that must be finite and positive.
    #[error("{field} must be a finite number > 0, got {value}")]
    NotPositive {
        /// The field, as a description file names it.
        field: &'static str,
        /// Its value.
        value: f64,
    },
    /// A count that must be at least 1.
    #[error("{field} must be at least 1")]
    Zero {
        /// The field.
        field: &'static str,
    },
    /// More KV heads than query heads, or heads that do not split across the group.
    #[error("{0}")]
    Shape(String),
}

/// The reference card of the fit `vllm-3090`: an RTX 3090 (GA102), 936.2 GB/s and 71 dense FP16
/// tensor TFLOPS with FP32 accumulate (142 with sparsity), per NVIDIA's Ampere GA102 GPU
/// architecture whitepaper, table "GeForce RTX 3090".
pub fn reference_gpu() -> GpuSpec {
    GpuSpec {
        name: "rtx-3090".into(),
        memory_bandwidth_gb_s: 936.2,
        dense_fp16_tflops: 71.0,
        source: "NVIDIA Ampere GA102 GPU Architecture whitepaper (GeForce RTX 3090: 936.2 GB/s; \
                 peak FP16 tensor TFLOPS with FP32 accumulate 71, dense)"
            .into(),
    }
}

/// The reference model of the fit `vllm-3090`: a Llama-3-8B-class model (8.03 B parameters, 32
/// layers, 32 query and 8 KV heads of 128) in 4-bit, served as 4.7 GB of weights, FP16 KV cache.
pub fn reference_model() -> ModelSpec {
    let defaults = StepModel::default();
    let params = 8.03e9;
    ModelSpec {
        name: "llama-3-8b-4bit".into(),
        params,
        layers: 32,
        attention_heads: 32,
        kv_heads: 8,
        head_dim: 128,
        weight_bytes_per_param: defaults.weight_bytes / params,
        kv_bytes_per_value: 2.0,
        source: "Llama 3 8B's config.json (32 layers, 32 heads, 8 KV heads, hidden 4096); the \
                 fit's 4.7 GB of 4-bit weights"
            .into(),
    }
}

impl Efficiency {
    /// The efficiencies of the reference fit: each of `vllm-3090`'s fitted constants divided by what
    /// the roofline gives for [`reference_gpu`] and [`reference_model`] at 100%. Measured once,
    /// on that fleet's floors (TTFT 329 ms unseen, 46 ms cached, ITL 7.8 ms at concurrency 1);
    /// used for every other card as its best available estimate.
    pub fn reference_fit() -> Efficiency {
        let fit = StepModel::default();
        let peak = roofline(&reference_gpu(), &reference_model(), 1, &Efficiency::PEAK);
        Efficiency {
            bandwidth: fit.bandwidth_bytes_per_s / peak.bandwidth_bytes_per_s,
            compute: peak.c_tok_ms / fit.c_tok_ms,
            attention: peak.c_attn_ms / fit.c_attn_ms,
        }
    }

    /// Every peak achieved: the roofline's upper bound, never a model of an engine.
    pub const PEAK: Efficiency = Efficiency {
        bandwidth: 1.0,
        compute: 1.0,
        attention: 1.0,
    };
}

/// The memory and compute constants of a replica of `tp` GPUs serving `model`, by the roofline
/// rule of this module's docs with efficiencies `eff`. Only the five roofline constants are set;
/// `overhead_ms`, `frontend_ms`, `tokenize_ms`, `c_decode_ctx_ms` (0: a GPU decode's attention
/// is in the memory term), `speed`, `slowdown` and `jitter` keep [`StepModel::default`]'s values
/// for the caller to set.
pub fn roofline(gpu: &GpuSpec, model: &ModelSpec, tp: u32, eff: &Efficiency) -> StepModel {
    let tp = f64::from(tp.max(1));
    let flops_per_ms = gpu.dense_fp16_tflops * 1e12 / 1000.0;
    StepModel {
        weight_bytes: model.weight_bytes() / tp,
        kv_bytes_per_token: model.kv_bytes_per_token() / tp,
        bandwidth_bytes_per_s: gpu.memory_bandwidth_gb_s * 1e9 * eff.bandwidth,
        c_tok_ms: 2.0 * model.params / tp / (flops_per_ms * eff.compute),
        c_attn_ms: 4.0
            * f64::from(model.layers)
            * f64::from(model.attention_heads)
            * f64::from(model.head_dim)
            / tp
            / (flops_per_ms * eff.attention),
        ..StepModel::default()
    }
}

/// Checks a card, a model and a group size before [`roofline`] uses them.
pub fn check(gpu: &GpuSpec, model: &ModelSpec, tp: u32) -> Result<(), DescribeError> {
    let positive = [
        ("gpu.memory_bandwidth_gb_s", gpu.memory_bandwidth_gb_s),
        ("gpu.dense_fp16_tflops", gpu.dense_fp16_tflops),
        ("model.params", model.params),
        ("model.weight_bytes_per_param", model.weight_bytes_per_param),
        ("model.kv_bytes_per_value", model.kv_bytes_per_value),
    ];
    for (field, value) in positive {
        if !value.is_finite() || value <= 0.0 {
            return Err(DescribeError::NotPositive { field, value });
        }
    }
    let counts = [
        ("tp", tp),
        ("model.layers", model.layers),
        ("model.attention_heads", model.attention_heads),
        ("model.kv_heads", model.kv_heads),
        ("model.head_dim", model.head_dim),
    ];
    for (field, value) in counts {
        if value == 0 {
            return Err(DescribeError::Zero { field });
        }
    }
    if model.kv_heads > model.attention_heads {
        return Err(DescribeError::Shape(format!(
            "model.kv_heads ({}) exceeds model.attention_heads ({})",
            model.kv_heads, model.attention_heads
        )));
    }
    if !model.attention_heads.is_multiple_of(tp) {
        return Err(DescribeError::Shape(format!(
            "tp {tp} does not divide model.attention_heads ({}): vLLM refuses such a split",
            model.attention_heads
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        ((a - b) / b).abs() < 1e-9
    }

    #[test]
    fn the_rule_at_the_reference_fit_gives_back_the_fit() {
        // The anchor: the reference card and model, at the efficiencies measured on them, are the
        // fitted `vllm-3090` constants (to rounding), so the rule adds no constant of its own.
        let eff = Efficiency::reference_fit();
        let derived = roofline(&reference_gpu(), &reference_model(), 1, &eff);
        let fit = StepModel::default();
        assert!(close(derived.weight_bytes, fit.weight_bytes));
        assert!(close(derived.kv_bytes_per_token, fit.kv_bytes_per_token));
        assert!(close(
            derived.bandwidth_bytes_per_s,
            fit.bandwidth_bytes_per_s
        ));
        assert!(close(derived.c_tok_ms, fit.c_tok_ms));
        assert!(close(derived.c_attn_ms, fit.c_attn_ms));
        // 2 × 32 layers × 8 KV heads × 128 × 2 B: the fit's KV bytes are the model's shape.
        assert_eq!(
            reference_model().kv_bytes_per_token(),
            fit.kv_bytes_per_token
        );
    }

    #[test]
    fn the_reference_efficiencies_are_shares_of_the_peaks() {
        let eff = Efficiency::reference_fit();
        for (name, e) in [
            ("bandwidth", eff.bandwidth),
            ("compute", eff.compute),
            ("attention", eff.attention),
        ] {
            assert!(e > 0.0 && e <= 1.0, "{name} efficiency {e}");
        }
        // 690 of 936.2 GB/s.
        assert!((eff.bandwidth - 690.0 / 936.2).abs() < 1e-12);
    }

    #[test]
    fn tensor_parallelism_splits_every_per_replica_cost() {
        let (gpu, model, eff) = (
            reference_gpu(),
            reference_model(),
            Efficiency::reference_fit(),
        );
        let one = roofline(&gpu, &model, 1, &eff);
        let two = roofline(&gpu, &model, 2, &eff);
        assert!(close(two.weight_bytes * 2.0, one.weight_bytes));
        assert!(close(two.kv_bytes_per_token * 2.0, one.kv_bytes_per_token));
        assert!(close(two.c_tok_ms * 2.0, one.c_tok_ms));
        assert!(close(two.c_attn_ms * 2.0, one.c_attn_ms));
        // Each GPU reads its own share at its own bandwidth.
        assert_eq!(two.bandwidth_bytes_per_s, one.bandwidth_bytes_per_s);
        // A batch-1 decode step is memory-bound and about halves (the fixed overhead stays).
        let step = |m: &StepModel| m.raw_step_us(1, 1_100, 0.0, 1_100);
        assert!(step(&two) < step(&one) * 0.6);
    }

    #[test]
    fn a_bad_description_names_its_field() {
        let (gpu, mut model) = (reference_gpu(), reference_model());
        assert_eq!(check(&gpu, &model, 1), Ok(()));
        assert_eq!(
            check(&gpu, &model, 0),
            Err(DescribeError::Zero { field: "tp" })
        );
        assert!(
            matches!(check(&gpu, &model, 3), Err(DescribeError::Shape(m)) if m.contains("tp 3"))
        );
        model.params = f64::NAN;
        assert!(matches!(
            check(&gpu, &model, 1),
            Err(DescribeError::NotPositive {
                field: "model.params",
                ..
            })
        ));
        let mut model = reference_model();
        model.kv_heads = 64;
        assert!(matches!(
            check(&gpu, &model, 1),
            Err(DescribeError::Shape(_))
        ));
    }
}
