//! What a MoE layer is: its shapes and semantics ([`MoeConfig`]) and its weights ([`MoeWeights`]).

use crate::error::{check_finite, MoeError, Result};
use crate::experts::{Activation, ExpertWeights};
use crate::router::RouterConfig;
use crate::tensor::Tensor;
use serde::{Deserialize, Serialize};

/// Shapes and semantics of one MoE block.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Hidden size H.
    pub hidden: usize,
    /// Intermediate size I of each routed expert.
    pub inter: usize,
    /// Number of routed experts E.
    pub num_experts: usize,
    /// Experts per token k.
    pub top_k: usize,
    /// How tokens choose experts.
    pub router: RouterConfig,
    /// Activation between the expert GEMMs.
    pub activation: Activation,
    /// Multiply rows by their router weight before the experts (top-k = 1 only; Llama-4 style).
    #[serde(default)]
    pub apply_router_weight_on_input: bool,
    /// Shared experts added to every token's output, if any.
    #[serde(default)]
    pub shared: Option<SharedConfig>,
}

/// Shared (always-on) experts, computed as one dense MLP of width `inter`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SharedConfig {
    /// Total intermediate width (DeepSeek: n_shared_experts × moe_intermediate_size).
    pub inter: usize,
    /// Output multiplied by `sigmoid(x · gate)` per token (Qwen2-MoE).
    pub gated: bool,
}

/// The shared experts' weights: a one-expert stack `w13 [1, 2Is, H]`, `w2 [1, H, Is]`, and the
/// optional gate `[H]`.
#[derive(Clone, Debug)]
pub struct SharedWeights {
    /// The MLP.
    pub mlp: ExpertWeights,
    /// Per-token sigmoid gate weights `[H]`.
    pub gate: Option<Tensor>,
}

/// All weights of one MoE block.
#[derive(Clone, Debug)]
pub struct MoeWeights {
    /// Router `[E, H]`.
    pub gate: Tensor,
    /// Router bias `[E]` added to the logits (GPT-OSS).
    pub gate_bias: Option<Tensor>,
    /// Selection-only score bias `[E]` (DeepSeek-V3 `e_score_correction_bias`).
    pub correction_bias: Option<Tensor>,
    /// Routed experts.
    pub experts: ExpertWeights,
    /// Shared experts.
    pub shared: Option<SharedWeights>,
}

impl MoeConfig {
    /// Checks the configuration on its own.
    pub fn validate(&self) -> Result<()> {
        if self.hidden == 0 || self.inter == 0 || self.num_experts == 0 {
            return Err(MoeError::Config(format!(
                "hidden ({}), inter ({}) and num_experts ({}) must be positive",
                self.hidden, self.inter, self.num_experts
            )));
        }
        if self.top_k == 0 || self.top_k > self.num_experts {
            return Err(MoeError::Config(format!(
                "top-k {} must be in 1..={} (the number of experts)",
                self.top_k, self.num_experts
            )));
        }
        if self.apply_router_weight_on_input && self.top_k != 1 {
            return Err(MoeError::Config(format!("apply_router_weight_on_input needs top-k = 1, got {}", self.top_k)));
        }
        if let Some(s) = self.shared {
            if s.inter == 0 {
                return Err(MoeError::Config("shared expert width must be positive".into()));
            }
        }
        Ok(())
    }

    /// FLOPs of the routed experts for `tokens` tokens (3 GEMMs of 2·H·I per token-slot).
    pub fn expert_flops(&self, tokens: usize) -> f64 {
        let shared = self.shared.map_or(0, |s| s.inter);
        2.0 * 3.0 * self.hidden as f64 * (tokens * self.top_k * self.inter + tokens * shared) as f64
    }
}

impl MoeWeights {
    /// Checks every weight against `config`, naming the first mismatch.
    pub fn validate(&self, config: &MoeConfig) -> Result<()> {
        config.validate()?;
        let (e, h, i) = (config.num_experts, config.hidden, config.inter);
        self.gate.expect_shape("router gate", &[e, h])?;
        check_finite("router gate", &self.gate.to_f32_vec())?;
        if let Some(b) = &self.gate_bias {
            b.expect_shape("router bias", &[e])?;
        }
        if let Some(b) = &self.correction_bias {
            b.expect_shape("e_score_correction_bias", &[e])?;
        }
        let dims = self.experts.dims()?;
        if dims != (e, h, i) {
            return Err(MoeError::shape("experts (E, H, I)", (e, h, i), dims));
        }
        match (&config.shared, &self.shared) {
            (None, None) => {}
            (Some(c), Some(w)) => {
                let d = w.mlp.dims()?;
                if d != (1, h, c.inter) {
                    return Err(MoeError::shape("shared experts (1, H, Is)", (1, h, c.inter), d));
                }
                match (&w.gate, c.gated) {
                    (Some(g), true) => g.expect_shape("shared expert gate", &[h])?,
                    (None, false) => {}
                    _ => return Err(MoeError::Config("shared expert gate present iff the config says gated".into())),
                }
            }
            (Some(_), None) => {
                return Err(MoeError::Config("config has shared experts but no shared weights were given".into()))
            }
            (None, Some(_)) => {
                return Err(MoeError::Config("shared weights given but the config has no shared experts".into()))
            }
        }
        Ok(())
    }
}
