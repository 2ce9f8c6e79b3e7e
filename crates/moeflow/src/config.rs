//! What a MoE layer is: its shapes and semantics ([`MoeConfig`]) and its weights ([`MoeWeights`]).

use crate::error::{check_finite_tensor, MoeError, Result};
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
        if let Activation::SwigluOai { alpha, limit } = self.activation {
            if !alpha.is_finite() || !limit.is_finite() || limit <= 0.0 {
                return Err(MoeError::Config(format!(
                    "swiglu alpha ({alpha}) must be finite and limit ({limit}) finite and positive"
                )));
            }
        }
        if let RouterConfig::SigmoidGrouped { scaling, .. } | RouterConfig::SoftmaxGrouped { scaling, .. } = self.router
        {
            if !scaling.is_finite() {
                return Err(MoeError::Config(format!("routed scaling factor {scaling} must be finite")));
            }
        }
        // Every weight must be addressable: E × 2I × H elements in f32, without overflow.
        let (e, h, i) = (self.num_experts, self.hidden, self.inter);
        let shared = self.shared.map_or(0, |s| s.inter);
        if crate::memory::bytes(&[e, i.max(shared), h], 8) > isize::MAX as u128 {
            return Err(MoeError::Config(format!(
                "{e} experts of hidden size {h} and intermediate size {i} are more weights than this machine can address"
            )));
        }
        Ok(())
    }

    /// Bytes of expert and shared weights in `dtype` (saturating, never overflowing).
    pub fn weight_bytes(&self, dtype: crate::DType) -> u128 {
        let rows =
            (self.num_experts as u128).saturating_mul(self.inter as u128) + self.shared.map_or(0, |s| s.inter as u128);
        rows.saturating_mul(3 * self.hidden as u128).saturating_mul(dtype.size_in_bytes() as u128)
    }

    /// An estimate of the working memory a forward of `tokens` tokens takes on the CPU: the
    /// input and output in f32, `k` copies of each row with its expert output, and the
    /// experts' `[rows, 2I]` intermediate.
    pub fn forward_bytes(&self, tokens: usize) -> u128 {
        let (h, k) = (self.hidden as u128, self.top_k as u128);
        let inter = self.inter.max(self.shared.map_or(0, |s| s.inter)) as u128;
        let per_token = k.saturating_mul(2 * h + 3 * inter).saturating_add(3 * h).saturating_mul(4);
        per_token.saturating_mul(tokens as u128)
    }

    /// Refuses a batch of `tokens` tokens whose working memory ([`MoeConfig::forward_bytes`])
    /// exceeds what this machine has.
    pub fn check_batch(&self, tokens: usize) -> Result<()> {
        crate::memory::ensure(
            &format!("a forward of {tokens} tokens (hidden {}, top-{})", self.hidden, self.top_k),
            self.forward_bytes(tokens),
        )
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
        check_finite_tensor("router gate", &self.gate)?;
        if let Some(b) = &self.gate_bias {
            b.expect_shape("router bias", &[e])?;
            check_finite_tensor("router bias", b)?;
        }
        if let Some(b) = &self.correction_bias {
            b.expect_shape("e_score_correction_bias", &[e])?;
            check_finite_tensor("e_score_correction_bias", b)?;
        }
        let dims = self.experts.dims()?;
        if dims != (e, h, i) {
            return Err(MoeError::shape("experts (E, H, I)", (e, h, i), dims));
        }
        self.experts.check_values("routed experts")?;
        if let Some(s) = &self.shared {
            s.mlp.check_values("shared experts")?;
            if let Some(g) = &s.gate {
                check_finite_tensor("shared expert gate", g)?;
            }
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
