//! The f64 reference experts: one token at a time, plain loops, f64 accumulation.
//! Deliberately simple; used to check every faster path.

use super::{Activation, ExpertInput, ExpertWeights, Experts};
use crate::error::Result;
use crate::reduce::{NoOp, WeightAndReduce};
use crate::tensor::{CpuStorage, Tensor};
use half::bf16;
use std::borrow::Cow;

/// A stack of expert matrices as the reference reads them: f32 values, or bf16 values read in
/// place (so a layer's bf16 weights are never copied whole); both widen exactly to f64.
#[derive(Clone, Debug)]
pub enum WeightValues<'a> {
    /// f32 values, borrowed or (for quantized weights) dequantized.
    F32(Cow<'a, [f32]>),
    /// bf16 values, borrowed.
    BF16(&'a [bf16]),
}

impl<'a> WeightValues<'a> {
    /// `weights.w13`: borrowed when stored as f32 or bf16, else dequantized to f32.
    pub fn w13(weights: &'a ExpertWeights) -> Self {
        Self::stored(&weights.w13, weights).unwrap_or_else(|| WeightValues::F32(Cow::Owned(weights.w13_f32())))
    }

    /// `weights.w2`, as [`WeightValues::w13`].
    pub fn w2(weights: &'a ExpertWeights) -> Self {
        Self::stored(&weights.w2, weights).unwrap_or_else(|| WeightValues::F32(Cow::Owned(weights.w2_f32())))
    }

    fn stored(t: &'a Tensor, weights: &ExpertWeights) -> Option<Self> {
        match (&weights.quant, t.cpu()) {
            (None, CpuStorage::F32(v)) => Some(WeightValues::F32(Cow::Borrowed(v))),
            (None, CpuStorage::BF16(v)) => Some(WeightValues::BF16(v)),
            _ => None,
        }
    }

    /// `Σ_j w[start + j] · x[j]` in f64, summed in order.
    fn dot(&self, start: usize, x: &[f64]) -> f64 {
        let end = start + x.len();
        match self {
            WeightValues::F32(w) => w[start..end].iter().zip(x).map(|(&a, &b)| a as f64 * b).sum(),
            WeightValues::BF16(w) => w[start..end].iter().zip(x).map(|(&a, &b)| a.to_f64() * b).sum(),
        }
    }
}

/// Expert `e` applied to one row `x [H]` in f64: `w2 · act(w13 · x + b13) + b2`.
/// `w13 [E, 2I, H]`, `w2 [E, H, I]` (the stored values, widened exactly).
#[allow(clippy::too_many_arguments)]
pub fn expert_row_f64(
    w13: &WeightValues,
    w2: &WeightValues,
    b13: Option<&[f32]>,
    b2: Option<&[f32]>,
    activation: Activation,
    (h, i): (usize, usize),
    e: usize,
    x: &[f64],
) -> Vec<f64> {
    let bias = |b: Option<&[f32]>, n: usize, j: usize| b.map_or(0.0, |b| b[e * n + j] as f64);
    let act: Vec<f64> = (0..i)
        .map(|j| {
            let g = w13.dot((e * 2 * i + j) * h, x) + bias(b13, 2 * i, j);
            let u = w13.dot((e * 2 * i + i + j) * h, x) + bias(b13, 2 * i, i + j);
            activation.apply_f64(g, u)
        })
        .collect();
    (0..h).map(|r| w2.dot((e * h + r) * i, &act) + bias(b2, h, r)).collect()
}

/// Experts computed by [`expert_row_f64`]; they weight and sum their own output (so finalize
/// uses [`NoOp`]), which also exercises that path of the layer.
#[derive(Clone, Debug)]
pub struct ReferenceExperts {
    dims: (usize, usize, usize),
    activation: Activation,
    w13: Vec<f32>,
    w2: Vec<f32>,
    b13: Option<Vec<f32>>,
    b2: Option<Vec<f32>>,
}

impl ReferenceExperts {
    /// Copies `weights` as f32 values.
    pub fn new(weights: &ExpertWeights, activation: Activation) -> Result<Self> {
        Ok(ReferenceExperts {
            dims: weights.validate("reference experts")?,
            activation,
            w13: weights.w13_f32(),
            w2: weights.w2_f32(),
            b13: weights.b13.as_ref().map(|b| b.to_f32_vec()),
            b2: weights.b2.as_ref().map(|b| b.to_f32_vec()),
        })
    }
}

impl Experts for ReferenceExperts {
    fn name(&self) -> &'static str {
        "reference"
    }
    fn dims(&self) -> (usize, usize, usize) {
        self.dims
    }
    fn workspace_len(&self, _tokens: usize, _k: usize) -> usize {
        0
    }
    fn weight_and_reduce(&self) -> &'static dyn WeightAndReduce {
        &NoOp
    }
    fn apply(&self, input: &ExpertInput, _workspace: &mut [f32], out: &mut [f32]) -> Result<()> {
        use rayon::prelude::*;
        let (_, h, i) = self.dims;
        let k = input.k;
        out.par_chunks_mut(h.max(1)).enumerate().for_each(|(t, row)| {
            let x: Vec<f64> = input.hidden[t * h..(t + 1) * h].iter().map(|&v| v as f64).collect();
            let mut acc = vec![0f64; h];
            for j in 0..k {
                let Some(e) = input.local_expert(t * k + j) else { continue };
                let w = if input.weights_applied { 1.0 } else { input.weights[t * k + j] as f64 };
                let y = expert_row_f64(
                    &WeightValues::F32(Cow::Borrowed(&self.w13)),
                    &WeightValues::F32(Cow::Borrowed(&self.w2)),
                    self.b13.as_deref(),
                    self.b2.as_deref(),
                    self.activation,
                    (h, i),
                    e,
                    &x,
                );
                acc.iter_mut().zip(&y).for_each(|(a, v)| *a += w * v);
            }
            row.iter_mut().zip(&acc).for_each(|(o, &a)| *o = a as f32);
        });
        Ok(())
    }
}
