//! Gated activations: `act(gate) * up`, in f32 for the fast path and f64 for the reference.

use serde::{Deserialize, Serialize};

/// The activation-and-multiply applied between the two expert GEMMs.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Activation {
    /// `silu(gate) * up` (Mixtral, Qwen, OLMoE, DeepSeek).
    Silu,
    /// `gelu(gate) * up` with the exact erf GELU.
    GeluErf,
    /// `gelu(gate) * up` with the tanh approximation.
    GeluTanh,
    /// GPT-OSS: `gate = min(gate, limit)`, `up = clamp(up, ±limit)`,
    /// `(up + 1) * gate * sigmoid(alpha * gate)`.
    SwigluOai {
        /// Sigmoid sharpness (1.702 in GPT-OSS).
        alpha: f32,
        /// Clamp limit (7.0 in GPT-OSS).
        limit: f32,
    },
}

impl Activation {
    /// GPT-OSS's clamped SwiGLU with its published constants.
    pub const GPT_OSS: Activation = Activation::SwigluOai { alpha: 1.702, limit: 7.0 };

    /// `act(gate) * up` in f32.
    #[inline]
    pub fn apply(self, gate: f32, up: f32) -> f32 {
        match self {
            Activation::Silu => gate / (1.0 + (-gate).exp()) * up,
            Activation::GeluErf => 0.5 * gate * (1.0 + libm::erff(gate * std::f32::consts::FRAC_1_SQRT_2)) * up,
            Activation::GeluTanh => {
                let c = (2.0 / std::f32::consts::PI).sqrt();
                0.5 * gate * (1.0 + (c * (gate + 0.044715 * gate * gate * gate)).tanh()) * up
            }
            Activation::SwigluOai { alpha, limit } => {
                let g = gate.min(limit);
                let u = up.clamp(-limit, limit);
                (u + 1.0) * (g / (1.0 + (-alpha * g).exp()))
            }
        }
    }

    /// `act(gate) * up` in f64 (the reference).
    pub fn apply_f64(self, gate: f64, up: f64) -> f64 {
        match self {
            Activation::Silu => gate / (1.0 + (-gate).exp()) * up,
            Activation::GeluErf => 0.5 * gate * (1.0 + libm::erf(gate / std::f64::consts::SQRT_2)) * up,
            Activation::GeluTanh => {
                let c = (2.0 / std::f64::consts::PI).sqrt();
                0.5 * gate * (1.0 + (c * (gate + 0.044715 * gate.powi(3))).tanh()) * up
            }
            Activation::SwigluOai { alpha, limit } => {
                let (alpha, limit) = (alpha as f64, limit as f64);
                let g = gate.min(limit);
                let u = up.clamp(-limit, limit);
                (u + 1.0) * (g / (1.0 + (-alpha * g).exp()))
            }
        }
    }

    /// Name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Activation::Silu => "silu",
            Activation::GeluErf => "gelu",
            Activation::GeluTanh => "gelu_tanh",
            Activation::SwigluOai { .. } => "swiglu_oai",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed_values() {
        let s = |x: f64| 1.0 / (1.0 + (-x).exp());
        assert!((Activation::Silu.apply_f64(1.0, 2.0) - 2.0 * s(1.0)).abs() < 1e-15);
        // gelu(1) = 0.5 * (1 + erf(1/sqrt 2)) = 0.8413447460685429
        assert!((Activation::GeluErf.apply_f64(1.0, 1.0) - 0.841_344_746_068_542_9).abs() < 1e-12);
        assert!((Activation::GeluTanh.apply_f64(1.0, 1.0) - 0.841_191_990_607_7).abs() < 1e-9);
        // Clamps: gate 10 -> 7, up -9 -> -7.
        let want = (-7.0 + 1.0) * 7.0 * s(1.702 * 7.0);
        assert!((Activation::GPT_OSS.apply_f64(10.0, -9.0) - want).abs() < 1e-9);
        // The lower side of gate is not clamped.
        assert!((Activation::GPT_OSS.apply_f64(-10.0, 0.0) - (-10.0 * s(-17.02))).abs() < 1e-12);
    }

    #[test]
    fn f32_matches_f64() {
        for act in [Activation::Silu, Activation::GeluErf, Activation::GeluTanh, Activation::GPT_OSS] {
            for i in -80..80 {
                let (g, u) = (i as f32 * 0.13, 1.0 - i as f32 * 0.05);
                let (a, b) = (act.apply(g, u) as f64, act.apply_f64(g as f64, u as f64));
                assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "{act:?} {g} {u}: {a} vs {b}");
            }
        }
    }
}
