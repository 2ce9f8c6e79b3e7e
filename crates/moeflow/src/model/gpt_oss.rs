//! GPT-OSS: `mlp.router.weight/bias`, fused `mlp.experts.gate_up_proj [E, H, 2I]` with gate and
//! up interleaved on the last axis, `gate_up_proj_bias [E, 2I]`, `down_proj [E, I, H]`,
//! `down_proj_bias [E, H]`. Released checkpoints store the two projections as MXFP4
//! (`*_blocks [E, out, in/32, 16]`, `*_scales [E, out, in/32]`), dequantized here.

use super::dequant::mxfp4;
use super::{Checkpoint, Family, HfConfig};
use crate::config::{MoeConfig, MoeWeights};
use crate::error::MoeError;
use crate::error::Result;
use crate::experts::{Activation, ExpertWeights, QuantizedScales};
use crate::quant::WeightQuant;
use crate::router::RouterConfig;
use crate::tensor::CpuStorage;
use crate::tensor::Tensor;
use crate::DType;

pub(crate) struct GptOss;

/// `[E, out, in]` f32 from MXFP4 blocks when present, else from the dense tensor stored
/// `[E, in, out]` (transposed here).
fn projection(ckpt: &Checkpoint, name: &str, e: usize, out: usize, inp: usize) -> Result<Vec<f32>> {
    let blocks = format!("{name}_blocks");
    if ckpt.has(&blocks) {
        let groups = mxfp4_groups(name, inp)?;
        let b = ckpt.bytes(&blocks, &[e, out, groups, 16])?;
        let s = ckpt.bytes(&format!("{name}_scales"), &[e, out, groups])?;
        let w = mxfp4(b, s, e * out, groups)?;
        crate::error::check_finite(&format!("{name}_blocks times {name}_scales"), &w)?;
        return Ok(w);
    }
    let dense = ckpt.f32s(name, &[e, inp, out])?;
    let mut t = vec![0f32; e * out * inp];
    for x in 0..e {
        for i in 0..inp {
            for o in 0..out {
                t[(x * out + o) * inp + i] = dense[(x * inp + i) * out + o];
            }
        }
    }
    Ok(t)
}

/// The 32-value groups along a row of `inp` values (MXFP4 needs whole groups).
fn mxfp4_groups(name: &str, inp: usize) -> Result<usize> {
    if !inp.is_multiple_of(32) {
        return Err(MoeError::Format(format!("{name}_blocks: rows of {inp} values are not whole MXFP4 groups of 32")));
    }
    Ok(inp / 32)
}

/// MXFP4 `name_blocks [E, out, in/32, 16]` and `name_scales [E, out, in/32]` as one code per
/// byte `[E, out, in]` and f32 scales `[E, out · in/32]`.
fn mxfp4_codes(ckpt: &Checkpoint, name: &str, e: usize, out: usize, inp: usize) -> Result<(Vec<u8>, Vec<f32>)> {
    let groups = mxfp4_groups(name, inp)?;
    let b = ckpt.bytes(&format!("{name}_blocks"), &[e, out, groups, 16])?;
    let s = ckpt.bytes(&format!("{name}_scales"), &[e, out, groups])?;
    let codes = b.iter().flat_map(|&x| [x & 0x0f, x >> 4]).collect();
    Ok((codes, s.iter().map(|&x| f32::powi(2.0, x as i32 - 127)).collect()))
}

/// Row `j` of the interleaved gate/up projection goes to row `dst(j)`: gate rows first.
fn deinterleaved(j: usize, i: usize) -> usize {
    if j.is_multiple_of(2) {
        j / 2
    } else {
        i + j / 2
    }
}

impl Family for GptOss {
    fn is_moe_layer(_cfg: &HfConfig, _layer: usize) -> Result<bool> {
        Ok(true)
    }

    fn config(cfg: &HfConfig) -> Result<MoeConfig> {
        Ok(MoeConfig {
            hidden: cfg.usize("hidden_size")?,
            inter: cfg.usize("intermediate_size")?,
            num_experts: cfg.usize("num_local_experts")?,
            top_k: cfg.usize("num_experts_per_tok")?,
            router: RouterConfig::TopKSoftmax,
            activation: Activation::SwigluOai {
                alpha: cfg.f64_or("swiglu_alpha", 1.702)? as f32,
                limit: cfg.f64_or("swiglu_limit", 7.0)? as f32,
            },
            apply_router_weight_on_input: false,
            shared: None,
        })
    }

    fn tensor_names(ckpt: &Checkpoint, prefix: &str, _c: &MoeConfig) -> Vec<String> {
        let p = format!("{prefix}mlp.");
        let mut names = vec![format!("{p}router.weight"), format!("{p}router.bias")];
        for w in ["gate_up_proj", "down_proj"] {
            let base = format!("{p}experts.{w}");
            if ckpt.has(&format!("{base}_blocks")) {
                names.push(format!("{base}_blocks"));
                names.push(format!("{base}_scales"));
            } else {
                names.push(base.clone());
            }
            names.push(format!("{base}_bias"));
        }
        names
    }

    fn load(ckpt: &Checkpoint, prefix: &str, c: &MoeConfig, dtype: DType) -> Result<MoeWeights> {
        let p = format!("{prefix}mlp.");
        let (e, h, i) = (c.num_experts, c.hidden, c.inter);
        // gate_up rows alternate gate, up: de-interleave into gate rows then up rows.
        let gu = projection(ckpt, &format!("{p}experts.gate_up_proj"), e, 2 * i, h)?;
        let gub = ckpt.f32s(&format!("{p}experts.gate_up_proj_bias"), &[e, 2 * i])?;
        let (mut w13, mut b13) = (vec![0f32; e * 2 * i * h], vec![0f32; e * 2 * i]);
        for x in 0..e {
            for j in 0..2 * i {
                let dst = x * 2 * i + deinterleaved(j, i);
                w13[dst * h..(dst + 1) * h].copy_from_slice(&gu[(x * 2 * i + j) * h..(x * 2 * i + j + 1) * h]);
                b13[dst] = gub[x * 2 * i + j];
            }
        }
        let w2 = projection(ckpt, &format!("{p}experts.down_proj"), e, h, i)?;
        let experts = ExpertWeights {
            w13: Tensor::from_f32_as(&[e, 2 * i, h], &w13, dtype)?,
            w2: Tensor::from_f32_as(&[e, h, i], &w2, dtype)?,
            b13: Some(Tensor::from_f32(&[e, 2 * i], b13)?),
            b2: Some(ckpt.tensor(&format!("{p}experts.down_proj_bias"), &[e, h])?.to_dtype(DType::F32)),
            quant: None,
        };
        Ok(MoeWeights {
            gate: ckpt.tensor(&format!("{p}router.weight"), &[e, h])?,
            gate_bias: Some(ckpt.tensor(&format!("{p}router.bias"), &[e])?),
            correction_bias: None,
            experts,
            shared: None,
        })
    }

    fn load_quantized(ckpt: &Checkpoint, prefix: &str, c: &MoeConfig) -> Result<MoeWeights> {
        let p = format!("{prefix}mlp.");
        let (e, h, i) = (c.num_experts, c.hidden, c.inter);
        if !ckpt.has(&format!("{p}experts.gate_up_proj_blocks")) {
            return Err(MoeError::Unsupported("this GPT-OSS checkpoint stores no MXFP4 experts to keep".into()));
        }
        let (gu, gus) = mxfp4_codes(ckpt, &format!("{p}experts.gate_up_proj"), e, 2 * i, h)?;
        let (c2, s2) = mxfp4_codes(ckpt, &format!("{p}experts.down_proj"), e, h, i)?;
        // De-interleave gate/up rows of codes, scales and bias.
        let gub = ckpt.f32s(&format!("{p}experts.gate_up_proj_bias"), &[e, 2 * i])?;
        let (g, per) = (h / 32, 2 * i);
        let (mut c13, mut s13, mut b13) = (vec![0u8; e * per * h], vec![0f32; e * per * g], vec![0f32; e * per]);
        for x in 0..e {
            for j in 0..per {
                let (src, dst) = (x * per + j, x * per + deinterleaved(j, i));
                c13[dst * h..(dst + 1) * h].copy_from_slice(&gu[src * h..(src + 1) * h]);
                s13[dst * g..(dst + 1) * g].copy_from_slice(&gus[src * g..(src + 1) * g]);
                b13[dst] = gub[src];
            }
        }
        let codes =
            |c: Vec<u8>, shape: &[usize]| Tensor::new(shape, CpuStorage::I8(c.into_iter().map(|b| b as i8).collect()));
        let format = WeightQuant::Mxfp4;
        let experts = ExpertWeights {
            w13: codes(c13, &[e, 2 * i, h])?,
            w2: codes(c2, &[e, h, i])?,
            b13: Some(Tensor::from_f32(&[e, 2 * i], b13)?),
            b2: Some(ckpt.tensor(&format!("{p}experts.down_proj_bias"), &[e, h])?.to_dtype(DType::F32)),
            quant: Some(QuantizedScales {
                format,
                w13: Tensor::from_f32(&[e, format.scales_len(2 * i, h)], s13)?,
                w2: Tensor::from_f32(&[e, format.scales_len(h, i)], s2)?,
            }),
        };
        Ok(MoeWeights {
            gate: ckpt.tensor(&format!("{p}router.weight"), &[e, h])?,
            gate_bias: Some(ckpt.tensor(&format!("{p}router.bias"), &[e])?),
            correction_bias: None,
            experts,
            shared: None,
        })
    }
}
