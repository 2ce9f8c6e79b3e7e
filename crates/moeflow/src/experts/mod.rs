//! Permute → expert GEMMs → unpermute: the compute stage of the layer.
//!
//! Weights use the standard layout: `w13 [E, 2I, H]` (gate rows, then up rows) and
//! `w2 [E, H, I]`, with optional f32 biases `b13 [E, 2I]` and `b2 [E, H]`.

mod activation;
mod cpu;
mod reference;

pub use activation::Activation;
pub use cpu::CpuExperts;
pub use reference::{expert_row_f64, ReferenceExperts};

use crate::error::{MoeError, Result};
use crate::reduce::WeightAndReduce;
use crate::tensor::Tensor;
use crate::DType;

/// How a strategy hands tokens to the experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActivationFormat {
    /// `[rows, H]` with their top-k ids; the experts permute rows by expert themselves.
    Standard,
    /// `[local_experts, capacity, H]` with per-expert counts (fixed shapes).
    Batched,
}

/// The weights of `num_experts` gated MLP experts.
#[derive(Clone, Debug)]
pub struct ExpertWeights {
    /// `[E, 2I, H]`: gate projection rows, then up projection rows (f32, bf16 or f16).
    pub w13: Tensor,
    /// `[E, H, I]`: down projection.
    pub w2: Tensor,
    /// Optional `[E, 2I]` bias of the first GEMM.
    pub b13: Option<Tensor>,
    /// Optional `[E, H]` bias of the second GEMM.
    pub b2: Option<Tensor>,
}

impl ExpertWeights {
    /// `(E, H, I)` read from `w13` and `w2`, after checking that all shapes agree.
    pub fn dims(&self) -> Result<(usize, usize, usize)> {
        let s1 = self.w13.shape();
        if s1.len() != 3 || !s1[1].is_multiple_of(2) {
            return Err(MoeError::shape("w13", "[E, 2I, H]", s1));
        }
        let (e, i, h) = (s1[0], s1[1] / 2, s1[2]);
        self.w2.expect_shape("w2", &[e, h, i])?;
        if let Some(b) = &self.b13 {
            b.expect_shape("b13", &[e, 2 * i])?;
        }
        if let Some(b) = &self.b2 {
            b.expect_shape("b2", &[e, h])?;
        }
        for (what, t) in [("w13", &self.w13), ("w2", &self.w2)] {
            if !matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16) {
                return Err(MoeError::DType {
                    what: what.into(),
                    expected: "f32, bf16 or f16".into(),
                    got: t.dtype().to_string(),
                });
            }
        }
        Ok((e, h, i))
    }

    /// The experts `ids` (logical ids, in slot order) as a new stack.
    pub fn select(&self, ids: &[usize]) -> Result<ExpertWeights> {
        let pick = |t: &Tensor| t.index_select0(ids);
        Ok(ExpertWeights {
            w13: pick(&self.w13)?,
            w2: pick(&self.w2)?,
            b13: self.b13.as_ref().map(pick).transpose()?,
            b2: self.b2.as_ref().map(pick).transpose()?,
        })
    }

    /// Bytes of all expert weights.
    pub fn bytes(&self) -> usize {
        [Some(&self.w13), Some(&self.w2), self.b13.as_ref(), self.b2.as_ref()]
            .iter()
            .flatten()
            .map(|t| t.size_in_bytes())
            .sum()
    }
}

/// The tokens one rank's experts process, in the standard format.
#[derive(Clone, Copy, Debug)]
pub struct ExpertInput<'a> {
    /// `[tokens, H]` activations as dispatched (already weighted when applied on input).
    pub hidden: &'a [f32],
    /// Number of rows.
    pub tokens: usize,
    /// Global expert ids `[tokens, k]`.
    pub ids: &'a [i32],
    /// Router weights `[tokens, k]`.
    pub weights: &'a [f32],
    /// Experts per token.
    pub k: usize,
    /// Global expert → local slot, `-1` where the expert lives elsewhere (`None`: all local).
    pub expert_map: Option<&'a [i32]>,
    /// The router weights were multiplied into `hidden` already.
    pub weights_applied: bool,
}

impl ExpertInput<'_> {
    /// The local slot of the expert in `(token, slot)`, or `None` when it is not here.
    #[inline]
    pub fn local_expert(&self, flat_slot: usize) -> Option<usize> {
        let g = self.ids[flat_slot] as usize;
        match self.expert_map {
            None => Some(g),
            Some(m) => usize::try_from(m[g]).ok(),
        }
    }
}

/// Rows in the batched format: `hidden [local, capacity, H]`, expert `e` using its first
/// `counts[e]` rows.
#[derive(Clone, Copy, Debug)]
pub struct BatchedInput<'a> {
    /// `[local, capacity, H]`.
    pub hidden: &'a [f32],
    /// Rows per expert.
    pub capacity: usize,
    /// Valid rows per local expert.
    pub counts: &'a [usize],
}

/// An expert implementation: sizes its workspace, computes, and says how its output is reduced.
pub trait Experts: Send + Sync {
    /// Short name for reports.
    fn name(&self) -> &'static str;
    /// Whether it consumes `format`.
    fn supports(&self, format: ActivationFormat) -> bool {
        format == ActivationFormat::Standard
    }
    /// `(local experts, H, I)`.
    fn dims(&self) -> (usize, usize, usize);
    /// The format the experts take their input in: prepare quantizes rows to it before they
    /// travel (unless the experts quantize themselves, `defer_input_quant`).
    fn input_quant(&self) -> crate::quant::QuantConfig {
        crate::quant::QuantConfig::None
    }
    /// f32 elements of scratch space needed for `tokens` rows with `k` slots each.
    fn workspace_len(&self, tokens: usize, k: usize) -> usize;
    /// How finalize must turn this implementation's output into token rows.
    fn weight_and_reduce(&self) -> &'static dyn WeightAndReduce;
    /// Computes the experts for `input`, writing `out` (length from
    /// `weight_and_reduce().expert_output_len`); slots whose expert is not local are `-0.0`.
    fn apply(&self, input: &ExpertInput, workspace: &mut [f32], out: &mut [f32]) -> Result<()>;
    /// f32 elements of scratch space for the batched format with `rows` = local × capacity.
    fn batched_workspace_len(&self, _rows: usize) -> usize {
        0
    }
    /// Computes the batched format: `out [local, capacity, H]` unweighted, valid rows only.
    fn apply_batched(&self, _input: &BatchedInput, _workspace: &mut [f32], _out: &mut [f32]) -> Result<()> {
        Err(MoeError::Unsupported(format!("experts '{}' do not take the batched format", self.name())))
    }
}
