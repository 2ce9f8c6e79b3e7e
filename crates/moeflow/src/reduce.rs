//! Weight-and-reduce: turning per-slot expert outputs into one row per token.
//!
//! Chosen by the experts implementation (see [`crate::experts::Experts::weight_and_reduce`]),
//! applied by the strategy's finalize.

/// Applies top-k weights and sums, or passes through output that is already reduced.
pub trait WeightAndReduce: Send + Sync {
    /// f32 elements of expert output for `tokens` tokens (`[tokens, k, H]` or `[tokens, H]`).
    fn expert_output_len(&self, tokens: usize, k: usize, hidden: usize) -> usize;
    /// Writes `out [tokens, H]` from `expert_out` and `weights [tokens, k]`. With
    /// `weights_applied` the weights were multiplied into the inputs and are not applied again.
    fn apply(
        &self,
        expert_out: &[f32],
        weights: &[f32],
        k: usize,
        hidden: usize,
        weights_applied: bool,
        out: &mut [f32],
    );
}

/// `out[t] = Σ_j w[t,j] · y[t,j,:]`, summed in slot order `j = 0..k` (the contract that makes
/// results independent of where each slot was computed).
#[derive(Clone, Copy, Debug, Default)]
pub struct WeightedSum;

/// The experts already weighted and reduced: `out = expert_out` (`[tokens, H]`).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoOp;

impl WeightAndReduce for WeightedSum {
    fn expert_output_len(&self, tokens: usize, k: usize, hidden: usize) -> usize {
        tokens * k * hidden
    }

    fn apply(
        &self,
        expert_out: &[f32],
        weights: &[f32],
        k: usize,
        hidden: usize,
        weights_applied: bool,
        out: &mut [f32],
    ) {
        use rayon::prelude::*;
        if hidden == 0 {
            return;
        }
        let tokens = out.len() / hidden;
        let per_task = (16384 / (k * hidden).max(1)).max(1);
        out.par_chunks_mut(hidden * per_task).enumerate().for_each(|(c, rows)| {
            for (i, row) in rows.chunks_mut(hidden).enumerate() {
                let t = c * per_task + i;
                debug_assert!(t < tokens);
                row.iter_mut().for_each(|x| *x = 0.0);
                for j in 0..k {
                    let w = if weights_applied { 1.0 } else { weights[t * k + j] };
                    let y = &expert_out[(t * k + j) * hidden..(t * k + j + 1) * hidden];
                    for (o, &v) in row.iter_mut().zip(y) {
                        *o += w * v;
                    }
                }
            }
        });
    }
}

impl WeightAndReduce for NoOp {
    fn expert_output_len(&self, tokens: usize, _k: usize, hidden: usize) -> usize {
        tokens * hidden
    }

    fn apply(
        &self,
        expert_out: &[f32],
        _weights: &[f32],
        _k: usize,
        _hidden: usize,
        _weights_applied: bool,
        out: &mut [f32],
    ) {
        out.copy_from_slice(&expert_out[..out.len()]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weighted_sum_hand_computed() {
        // 2 tokens, k = 2, H = 3.
        let y = [1.0, 2.0, 3.0, 10.0, 20.0, 30.0, -1.0, 0.0, 1.0, 4.0, 4.0, 4.0];
        let w = [0.5, 0.25, 2.0, 1.0];
        let mut out = [f32::NAN; 6];
        WeightedSum.apply(&y, &w, 2, 3, false, &mut out);
        assert_eq!(out, [3.0, 6.0, 9.0, 2.0, 4.0, 6.0]);
        WeightedSum.apply(&y, &w, 2, 3, true, &mut out);
        assert_eq!(out, [11.0, 22.0, 33.0, 3.0, 4.0, 5.0]);
        let mut out = [f32::NAN; 3];
        NoOp.apply(&[1.0, 2.0, 3.0], &[], 2, 3, false, &mut out);
        assert_eq!(out, [1.0, 2.0, 3.0]);
        assert_eq!(WeightedSum.expert_output_len(2, 2, 3), 12);
        assert_eq!(NoOp.expert_output_len(2, 2, 3), 6);
    }
}
