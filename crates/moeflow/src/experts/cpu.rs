//! The fast CPU experts: two grouped GEMMs on packed weights (f32, bf16 widened to f32, or
//! bf16 dot products with bf16-rounded activations) around the activation, over rows grouped
//! by expert. The permutation is an index list, not a copy: the first GEMM reads each row from
//! its token, the second writes it to its `[tokens, k, H]` slot (unweighted).

use super::{Activation, ActivationFormat, BatchedInput, ExpertInput, ExpertWeights, Experts};
use crate::backend::cpu::dot::Bf16Matmul;
use crate::backend::cpu::gemm::{Rows, Segment};
use crate::backend::cpu::packed::PackedStack;
use crate::error::{MoeError, Result};
use crate::reduce::{WeightAndReduce, WeightedSum};
use rayon::prelude::*;

/// Expert weights packed for the CPU GEMM, with their activation and biases.
#[derive(Clone, Debug)]
pub struct CpuExperts {
    experts: usize,
    hidden: usize,
    inter: usize,
    activation: Activation,
    w13: PackedStack,
    w2: PackedStack,
    b13: Option<Vec<f32>>,
    b2: Option<Vec<f32>>,
    input_quant: crate::quant::QuantConfig,
    defer_input_quant: bool,
}

impl CpuExperts {
    /// Packs `weights` (f32 stays f32, bf16 stays bf16 for the kernel `bf16` picks, f16
    /// becomes f32, quantized weights stay quantized).
    pub fn new(weights: &ExpertWeights, activation: Activation, bf16: Bf16Matmul) -> Result<Self> {
        let (e, h, i) = weights.validate("cpu experts")?;
        let (w13, w2) = match weights.codes() {
            Some(q) => (
                PackedStack::quantized(q.format, q.w13, q.w13_scales, e, 2 * i, h),
                PackedStack::quantized(q.format, q.w2, q.w2_scales, e, h, i),
            ),
            None => (
                PackedStack::from_tensor(&weights.w13, e, 2 * i, h, bf16),
                PackedStack::from_tensor(&weights.w2, e, h, i, bf16),
            ),
        };
        Ok(CpuExperts {
            experts: e,
            hidden: h,
            inter: i,
            activation,
            input_quant: crate::quant::QuantConfig::None,
            defer_input_quant: false,
            w13,
            w2,
            b13: weights.b13.as_ref().map(|b| b.to_f32_vec()),
            b2: weights.b2.as_ref().map(|b| b.to_f32_vec()),
        })
    }

    /// The same experts taking their input quantized to `quant` (dispatch quantizes rows).
    pub fn with_input_quant(mut self, quant: crate::quant::QuantConfig) -> Self {
        self.input_quant = quant;
        self
    }

    /// The same experts quantizing their input themselves instead of having prepare do it.
    pub fn deferring_input_quant(mut self, defer: bool) -> Self {
        self.defer_input_quant = defer;
        self
    }

    /// Bytes of packed weights.
    pub fn weight_bytes(&self) -> usize {
        self.w13.bytes() + self.w2.bytes()
    }

    /// Runs every row of `x [rows, H]` through expert 0 (a dense MLP, as shared experts are):
    /// `out [rows, H]`.
    pub fn dense_forward(&self, x: &[f32], rows: usize, workspace: &mut Vec<f32>, out: &mut [f32]) {
        let segments = [Segment { expert: 0, row_start: 0, rows }];
        let need = rows * 3 * self.inter;
        if workspace.len() < need {
            workspace.resize(need, 0.0);
        }
        let (h13, act) = workspace[..need].split_at_mut(rows * 2 * self.inter);
        self.gemm1_act(x, Rows::strided(self.hidden), &segments, h13, act);
        self.gemm2(act, &segments, out, Rows::strided(self.hidden));
    }

    /// The rows the first GEMM reads: `hidden` itself, or, when these experts quantize their
    /// own input, its rows quantized (per token, as prepare would have) and widened back into
    /// `deferred`.
    fn gemm_input<'a>(&self, hidden: &'a [f32], deferred: &'a mut Vec<f32>) -> Result<&'a [f32]> {
        if self.defer_input_quant && self.input_quant != crate::quant::QuantConfig::None {
            *deferred = crate::quant::dequantize(&crate::quant::quantize(self.input_quant, hidden, self.hidden)?);
            Ok(deferred)
        } else {
            Ok(hidden)
        }
    }

    /// `h13 = a · w13^T + b13`, then `act = act(gate) * up`, over rows grouped in `segments`
    /// (`a`'s rows found through `a_rows`; `h13` and `act` are in GEMM row order).
    fn gemm1_act(&self, a: &[f32], a_rows: Rows, segments: &[Segment], h13: &mut [f32], act: &mut [f32]) {
        let i = self.inter;
        self.w13.gemm(a, a_rows, segments, h13, Rows::strided(2 * i));
        add_bias(h13, Rows::strided(2 * i), 2 * i, segments, self.b13.as_deref());
        if i == 0 {
            return;
        }
        let activation = self.activation;
        // Rows outside every segment (the batched format's unused capacity) are skipped.
        let rows = act.len() / i;
        let mut used = vec![false; rows];
        segments.iter().for_each(|s| used[s.row_start..s.row_start + s.rows].iter_mut().for_each(|u| *u = true));
        act.par_chunks_mut(i).zip(h13.par_chunks(2 * i)).zip(used.par_iter()).with_min_len(16).for_each(
            |((arow, hrow), &used)| {
                if used {
                    let (gate, up) = hrow.split_at(i);
                    crate::backend::cpu::activation::gated_row(activation, gate, up, arow);
                }
            },
        );
    }

    /// `y = act · w2^T + b2` over rows grouped in `segments`, `y`'s rows found through `y_rows`.
    fn gemm2(&self, act: &[f32], segments: &[Segment], y: &mut [f32], y_rows: Rows) {
        self.w2.gemm(act, Rows::strided(self.inter), segments, y, y_rows);
        add_bias(y, y_rows, self.hidden, segments, self.b2.as_deref());
    }
}

/// Adds `bias [E, n]` of each segment's expert to its rows of `c`, found through `rows` (whose
/// stride is at least `n`).
fn add_bias(c: &mut [f32], rows: Rows, n: usize, segments: &[Segment], bias: Option<&[f32]>) {
    let Some(bias) = bias else { return };
    // The expert of every buffer row, so the rows are visited in parallel in buffer order.
    let stride = rows.stride.max(1);
    let mut expert_of = vec![usize::MAX; c.len().div_ceil(stride)];
    for s in segments {
        for j in s.row_start..s.row_start + s.rows {
            expert_of[rows.of(j)] = s.expert;
        }
    }
    c.par_chunks_mut(stride).zip(expert_of.par_iter()).for_each(|(row, &e)| {
        if e != usize::MAX {
            for (x, &bv) in row[..n].iter_mut().zip(&bias[e * n..(e + 1) * n]) {
                *x += bv;
            }
        }
    });
}

impl Experts for CpuExperts {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn dims(&self) -> (usize, usize, usize) {
        (self.experts, self.hidden, self.inter)
    }

    fn supports(&self, _format: ActivationFormat) -> bool {
        true
    }

    fn input_quant(&self) -> crate::quant::QuantConfig {
        self.input_quant
    }

    fn defer_input_quant(&self) -> bool {
        self.defer_input_quant
    }

    fn batched_workspace_len(&self, rows: usize) -> usize {
        rows * 3 * self.inter
    }

    fn apply_batched(&self, input: &BatchedInput, workspace: &mut [f32], out: &mut [f32]) -> Result<()> {
        let (h, i, cap) = (self.hidden, self.inter, input.capacity);
        let rows = self.experts * cap;
        input.check(self.experts, h, out)?;
        if workspace.len() < self.batched_workspace_len(rows) {
            return Err(MoeError::Config("expert workspace too small".into()));
        }
        let segments: Vec<Segment> = (0..self.experts)
            .filter(|&e| input.counts[e] > 0)
            .map(|e| Segment { expert: e, row_start: e * cap, rows: input.counts[e] })
            .collect();
        let (h13, rest) = workspace.split_at_mut(rows * 2 * i);
        let act = &mut rest[..rows * i];
        let mut deferred = Vec::new();
        let hidden = self.gemm_input(input.hidden, &mut deferred)?;
        self.gemm1_act(hidden, Rows::strided(h), &segments, h13, act);
        self.gemm2(act, &segments, out, Rows::strided(h));
        Ok(())
    }

    fn workspace_len(&self, tokens: usize, k: usize) -> usize {
        tokens * k * 3 * self.inter
    }

    fn weight_and_reduce(&self) -> &'static dyn WeightAndReduce {
        &WeightedSum
    }

    fn apply(&self, input: &ExpertInput, workspace: &mut [f32], out: &mut [f32]) -> Result<()> {
        let (h, i, k) = (self.hidden, self.inter, input.k);
        let slots = input.tokens * k;
        if out.len() != slots * h || input.hidden.len() != input.tokens * h {
            return Err(MoeError::shape("expert input/output", [input.tokens, k, h], out.len()));
        }
        if workspace.len() < self.workspace_len(input.tokens, k) {
            return Err(MoeError::Config("expert workspace too small".into()));
        }
        // Permute: slots grouped by local expert, in token-then-slot order within an expert.
        let groups = input.group_slots(self.experts)?;
        let (rows, order, row_of_slot) = (groups.rows(), &groups.order, &groups.row_of_slot);
        let segments: Vec<Segment> =
            groups.segments().map(|(expert, row_start, rows)| Segment { expert, row_start, rows }).collect();

        // Workspace: GEMM1 output and activation, in GEMM row order. The first GEMM reads each
        // row from its token, the second writes it to its slot.
        let (h13, rest) = workspace.split_at_mut(rows * 2 * i);
        let act = &mut rest[..rows * i];
        let token_of_row: Vec<u32> = order.iter().map(|&s| s / k as u32).collect();
        let mut deferred = Vec::new();
        let hidden = self.gemm_input(input.hidden, &mut deferred)?;
        self.gemm1_act(hidden, Rows::indexed(h, &token_of_row), &segments, h13, act);
        self.gemm2(act, &segments, out, Rows::indexed(h, order));
        // Slots no local expert computed.
        out.par_chunks_mut(h.max(1)).zip(row_of_slot.par_iter()).for_each(|(dst, &r)| {
            if r == u32::MAX {
                dst.fill(-0.0);
            }
        });
        Ok(())
    }
}
