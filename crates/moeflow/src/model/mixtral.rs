//! Mixtral: `block_sparse_moe.gate`, `block_sparse_moe.experts.N.w1/w3/w2` (gate, up, down);
//! softmax top-k, renormalised.

use super::{stack_experts, Checkpoint, Family, HfConfig};
use crate::config::{MoeConfig, MoeWeights};
use crate::error::Result;
use crate::experts::Activation;
use crate::router::RouterConfig;
use crate::DType;

pub(crate) struct Mixtral;

impl Family for Mixtral {
    fn is_moe_layer(_cfg: &HfConfig, _layer: usize) -> Result<bool> {
        Ok(true)
    }

    fn config(cfg: &HfConfig) -> Result<MoeConfig> {
        Ok(MoeConfig {
            hidden: cfg.usize("hidden_size")?,
            inter: cfg.usize("intermediate_size")?,
            num_experts: cfg.usize("num_local_experts")?,
            top_k: cfg.usize("num_experts_per_tok")?,
            router: RouterConfig::Softmax { renormalize: true },
            activation: Activation::Silu,
            apply_router_weight_on_input: false,
            shared: None,
        })
    }

    fn tensor_names(_ckpt: &Checkpoint, prefix: &str, c: &MoeConfig) -> Vec<String> {
        let p = format!("{prefix}block_sparse_moe.");
        let mut names = vec![format!("{p}gate.weight")];
        for e in 0..c.num_experts {
            names.extend(["w1", "w3", "w2"].map(|w| format!("{p}experts.{e}.{w}.weight")));
        }
        names
    }

    fn load(ckpt: &Checkpoint, prefix: &str, c: &MoeConfig, dtype: DType) -> Result<MoeWeights> {
        let p = format!("{prefix}block_sparse_moe.");
        let (h, i) = (c.hidden, c.inter);
        let experts = stack_experts(c.num_experts, (h, i), dtype, |e| {
            let w = |n: &str, s: &[usize]| ckpt.f32s(&format!("{p}experts.{e}.{n}.weight"), s);
            Ok((w("w1", &[i, h])?, w("w3", &[i, h])?, w("w2", &[h, i])?))
        })?;
        Ok(MoeWeights {
            gate: ckpt.tensor(&format!("{p}gate.weight"), &[c.num_experts, h])?,
            gate_bias: None,
            correction_bias: None,
            experts,
            shared: None,
        })
    }
}
