//! Qwen2-MoE, Qwen3-MoE and OLMoE: `mlp.gate`, `mlp.experts.N.gate_proj/up_proj/down_proj`;
//! softmax top-k, renormalised per `norm_topk_prob`. Qwen2-MoE adds `mlp.shared_expert.*` and
//! the sigmoid gate `mlp.shared_expert_gate`.

use super::{stack_experts, Checkpoint, Family, HfConfig};
use crate::config::{MoeConfig, MoeWeights, SharedConfig, SharedWeights};
use crate::error::Result;
use crate::experts::Activation;
use crate::router::RouterConfig;
use crate::DType;

pub(crate) struct QwenMoe;

/// `gate_proj`, `up_proj`, `down_proj` of `{p}` as one expert's (gate, up, down).
pub(crate) fn proj_triplet(
    ckpt: &Checkpoint,
    p: &str,
    (h, i): (usize, usize),
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    Ok((
        ckpt.f32s(&format!("{p}gate_proj.weight"), &[i, h])?,
        ckpt.f32s(&format!("{p}up_proj.weight"), &[i, h])?,
        ckpt.f32s(&format!("{p}down_proj.weight"), &[h, i])?,
    ))
}

pub(crate) fn proj_names(p: &str) -> [String; 3] {
    ["gate_proj", "up_proj", "down_proj"].map(|w| format!("{p}{w}.weight"))
}

impl Family for QwenMoe {
    fn is_moe_layer(cfg: &HfConfig, layer: usize) -> Result<bool> {
        if cfg.model_type == "olmoe" {
            return Ok(true);
        }
        let step = cfg.usize_or("decoder_sparse_step", 1)?.max(1);
        Ok(!cfg.usize_list("mlp_only_layers")?.contains(&layer)
            && cfg.usize_any(&["num_experts", "num_local_experts"])? > 0
            && (layer + 1).is_multiple_of(step))
    }

    fn config(cfg: &HfConfig) -> Result<MoeConfig> {
        let olmoe = cfg.model_type == "olmoe";
        let inter = if olmoe { cfg.usize("intermediate_size")? } else { cfg.usize("moe_intermediate_size")? };
        let shared = match cfg.usize_or("shared_expert_intermediate_size", 0)? {
            0 => None,
            n => Some(SharedConfig { inter: n, gated: true }),
        };
        Ok(MoeConfig {
            hidden: cfg.usize("hidden_size")?,
            inter,
            num_experts: cfg.usize_any(&["num_experts", "num_local_experts"])?,
            top_k: cfg.usize("num_experts_per_tok")?,
            router: RouterConfig::Softmax { renormalize: cfg.bool_or("norm_topk_prob", false)? },
            activation: Activation::Silu,
            apply_router_weight_on_input: false,
            shared,
        })
    }

    fn tensor_names(_ckpt: &Checkpoint, prefix: &str, c: &MoeConfig) -> Vec<String> {
        let p = format!("{prefix}mlp.");
        let mut names = vec![format!("{p}gate.weight")];
        for e in 0..c.num_experts {
            names.extend(proj_names(&format!("{p}experts.{e}.")));
        }
        if c.shared.is_some() {
            names.extend(proj_names(&format!("{p}shared_expert.")));
            names.push(format!("{p}shared_expert_gate.weight"));
        }
        names
    }

    fn load(ckpt: &Checkpoint, prefix: &str, c: &MoeConfig, dtype: DType) -> Result<MoeWeights> {
        let p = format!("{prefix}mlp.");
        let (h, i) = (c.hidden, c.inter);
        let experts =
            stack_experts(c.num_experts, (h, i), dtype, |e| proj_triplet(ckpt, &format!("{p}experts.{e}."), (h, i)))?;
        let shared = match c.shared {
            None => None,
            Some(s) => Some(SharedWeights {
                mlp: stack_experts(1, (h, s.inter), dtype, |_| {
                    proj_triplet(ckpt, &format!("{p}shared_expert."), (h, s.inter))
                })?,
                gate: Some(ckpt.tensor(&format!("{p}shared_expert_gate.weight"), &[1, h])?.reshape(&[h])?),
            }),
        };
        Ok(MoeWeights {
            gate: ckpt.tensor(&format!("{p}gate.weight"), &[c.num_experts, h])?,
            gate_bias: None,
            correction_bias: None,
            experts,
            shared,
        })
    }
}
