//! DeepSeek-V2 and V3: `mlp.gate.weight` (+ `e_score_correction_bias` in V3),
//! `mlp.experts.N.*_proj`, `mlp.shared_experts.*_proj` (n_shared_experts wide); MoE layers from
//! `first_k_dense_replace` and `moe_layer_freq`. V3's released fp8 e4m3 weights with
//! `weight_scale_inv` per 128×128 block are dequantized on load.

use super::dequant::fp8_block;
use super::qwen_moe::proj_names;
use super::{stack_experts, Checkpoint, Family, HfConfig};
use crate::config::{MoeConfig, MoeWeights, SharedConfig, SharedWeights};
use crate::error::{MoeError, Result};
use crate::experts::{Activation, ExpertWeights, QuantizedScales};
use crate::quant::WeightQuant;
use crate::router::RouterConfig;
use crate::tensor::Tensor;
use crate::DType;

pub(crate) struct DeepSeek;

/// Block size of fp8 weight scales (`quantization_config.weight_block_size`, default 128).
fn block_size(ckpt: &Checkpoint) -> Result<usize> {
    let size = ckpt
        .config
        .json
        .get("quantization_config")
        .and_then(|q| q.get("weight_block_size"))
        .and_then(|b| b.get(0))
        .and_then(|v| v.as_u64())
        .map_or(128, |v| v as usize);
    if size == 0 {
        return Err(MoeError::Format("config.json: quantization_config.weight_block_size must be positive".into()));
    }
    Ok(size)
}

fn is_fp8(ckpt: &Checkpoint, name: &str) -> bool {
    ckpt.info(name).map(|(_, d)| d.starts_with("f8")).unwrap_or(false)
}

/// A projection `[n, k]` in f32, dequantized when stored as fp8 with block scales.
fn weight(ckpt: &Checkpoint, name: &str, n: usize, k: usize) -> Result<Vec<f32>> {
    let w = ckpt.f32s(name, &[n, k])?;
    if !is_fp8(ckpt, name) {
        return Ok(w);
    }
    let b = block_size(ckpt)?;
    let scale = ckpt.f32s(&format!("{name}_scale_inv"), &[n.div_ceil(b), k.div_ceil(b)])?;
    let out = fp8_block(&w, &scale, n, k, b)?;
    crate::error::check_finite(&format!("{name} times {name}_scale_inv"), &out)?;
    Ok(out)
}

fn triplet(ckpt: &Checkpoint, p: &str, (h, i): (usize, usize)) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    Ok((
        weight(ckpt, &format!("{p}gate_proj.weight"), i, h)?,
        weight(ckpt, &format!("{p}up_proj.weight"), i, h)?,
        weight(ckpt, &format!("{p}down_proj.weight"), h, i)?,
    ))
}

/// The fp8 codes and block scales of `count` experts, kept as they are stored.
fn keep_fp8(
    ckpt: &Checkpoint,
    count: usize,
    (h, i): (usize, usize),
    at: &dyn Fn(usize) -> String,
) -> Result<ExpertWeights> {
    let b = block_size(ckpt)?;
    if i % b != 0 {
        return Err(MoeError::Unsupported(format!(
            "keeping fp8 weights needs the intermediate size ({i}) to be a multiple of the {b}-wide scale blocks"
        )));
    }
    let (mut c13, mut s13, mut c2, mut s2) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for x in 0..count {
        let p = at(x);
        for (w, n, k) in [("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)] {
            let name = format!("{p}{w}.weight");
            if !is_fp8(ckpt, &name) {
                return Err(MoeError::Unsupported(format!("{name} is not stored in fp8: nothing to keep")));
            }
            let (codes, scales) = if w == "down_proj" { (&mut c2, &mut s2) } else { (&mut c13, &mut s13) };
            if let crate::tensor::CpuStorage::F8E4M3(v) = ckpt.tensor(&name, &[n, k])?.cpu() {
                codes.extend(v.iter().map(|q| q.to_bits()));
            }
            scales.extend(ckpt.f32s(&format!("{name}_scale_inv"), &[n.div_ceil(b), k.div_ceil(b)])?);
        }
    }
    let codes = |c: Vec<u8>, shape: &[usize]| {
        Tensor::new(shape, crate::tensor::CpuStorage::F8E4M3(c.into_iter().map(float8::F8E4M3::from_bits).collect()))
    };
    let format = WeightQuant::Fp8Block(b);
    Ok(ExpertWeights {
        w13: codes(c13, &[count, 2 * i, h])?,
        w2: codes(c2, &[count, h, i])?,
        b13: None,
        b2: None,
        quant: Some(QuantizedScales {
            format,
            w13: Tensor::from_f32(&[count, format.scales_len(2 * i, h)], s13)?,
            w2: Tensor::from_f32(&[count, format.scales_len(h, i)], s2)?,
        }),
    })
}

impl Family for DeepSeek {
    fn is_moe_layer(cfg: &HfConfig, layer: usize) -> Result<bool> {
        let freq = cfg.usize_or("moe_layer_freq", 1)?.max(1);
        Ok(cfg.usize_or("n_routed_experts", 0)? > 0
            && layer >= cfg.usize_or("first_k_dense_replace", 0)?
            && layer.is_multiple_of(freq))
    }

    fn config(cfg: &HfConfig) -> Result<MoeConfig> {
        let inter = cfg.usize("moe_intermediate_size")?;
        let n_group = cfg.usize_or("n_group", 1)?.max(1);
        let topk_group = cfg.usize_or("topk_group", 1)?.max(1);
        let renormalize = cfg.bool_or("norm_topk_prob", false)?;
        let scaling = cfg.f64_or("routed_scaling_factor", 1.0)? as f32;
        let v3 = cfg.model_type == "deepseek_v3";
        let scoring = cfg.str_or("scoring_func", if v3 { "sigmoid" } else { "softmax" })?;
        let method = cfg.str_or("topk_method", if v3 { "noaux_tc" } else { "greedy" })?;
        let router = match (scoring, method) {
            ("sigmoid", "noaux_tc") => RouterConfig::SigmoidGrouped { n_group, topk_group, renormalize, scaling },
            ("softmax", "greedy") => RouterConfig::SoftmaxGrouped { n_group: 1, topk_group: 1, renormalize, scaling },
            ("softmax", "group_limited_greedy") => {
                RouterConfig::SoftmaxGrouped { n_group, topk_group, renormalize, scaling }
            }
            (s, m) => {
                return Err(MoeError::Unsupported(format!(
                    "DeepSeek routing scoring_func '{s}' with topk_method '{m}'"
                )))
            }
        };
        let shared = match cfg.usize_or("n_shared_experts", 0)? {
            0 => None,
            n => Some(SharedConfig {
                inter: n.checked_mul(inter).ok_or_else(|| {
                    MoeError::Format(format!(
                        "config.json: n_shared_experts {n} × moe_intermediate_size {inter} overflows"
                    ))
                })?,
                gated: false,
            }),
        };
        Ok(MoeConfig {
            hidden: cfg.usize("hidden_size")?,
            inter,
            num_experts: cfg.usize("n_routed_experts")?,
            top_k: cfg.usize("num_experts_per_tok")?,
            router,
            activation: Activation::Silu,
            apply_router_weight_on_input: false,
            shared,
        })
    }

    fn tensor_names(ckpt: &Checkpoint, prefix: &str, c: &MoeConfig) -> Vec<String> {
        let p = format!("{prefix}mlp.");
        let mut names = vec![format!("{p}gate.weight")];
        if matches!(c.router, RouterConfig::SigmoidGrouped { .. }) {
            names.push(format!("{p}gate.e_score_correction_bias"));
        }
        let mut projections = Vec::new();
        for e in 0..c.num_experts {
            projections.extend(proj_names(&format!("{p}experts.{e}.")));
        }
        if c.shared.is_some() {
            projections.extend(proj_names(&format!("{p}shared_experts.")));
        }
        for name in projections {
            if is_fp8(ckpt, &name) {
                names.push(format!("{name}_scale_inv"));
            }
            names.push(name);
        }
        names
    }

    fn load(ckpt: &Checkpoint, prefix: &str, c: &MoeConfig, dtype: DType) -> Result<MoeWeights> {
        load_with(ckpt, prefix, c, &|count, inter, at| {
            stack_experts(count, (c.hidden, inter), dtype, |x| triplet(ckpt, &at(x), (c.hidden, inter)))
        })
    }

    fn load_quantized(ckpt: &Checkpoint, prefix: &str, c: &MoeConfig) -> Result<MoeWeights> {
        load_with(ckpt, prefix, c, &|count, inter, at| keep_fp8(ckpt, count, (c.hidden, inter), at))
    }
}

/// Reads `count` experts of intermediate size `inter`; expert x's tensors start with `at(x)`.
type Stacker<'a> = dyn Fn(usize, usize, &dyn Fn(usize) -> String) -> Result<ExpertWeights> + 'a;

/// The block, its routed and shared experts read by `stack`.
fn load_with(ckpt: &Checkpoint, prefix: &str, c: &MoeConfig, stack: &Stacker) -> Result<MoeWeights> {
    let p = format!("{prefix}mlp.");
    let (h, i, e) = (c.hidden, c.inter, c.num_experts);
    let experts = stack(e, i, &|x| format!("{p}experts.{x}."))?;
    let shared = match c.shared {
        None => None,
        Some(s) => Some(SharedWeights { mlp: stack(1, s.inter, &|_| format!("{p}shared_experts."))?, gate: None }),
    };
    let correction_bias = if matches!(c.router, RouterConfig::SigmoidGrouped { .. }) {
        Some(ckpt.tensor(&format!("{p}gate.e_score_correction_bias"), &[e])?)
    } else {
        None
    };
    Ok(MoeWeights {
        gate: ckpt.tensor(&format!("{p}gate.weight"), &[e, h])?,
        gate_bias: None,
        correction_bias,
        experts,
        shared,
    })
}
