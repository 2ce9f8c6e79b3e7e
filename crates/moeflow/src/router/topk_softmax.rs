//! Top-k on the logits, then softmax over the k chosen (GPT-OSS; its router bias is part of the
//! logits).

use super::{select_top_k, softmax, Router};

/// Keep the `top_k` largest logits; weights are the softmax of those k logits.
#[derive(Clone, Debug)]
pub struct TopKSoftmax {
    /// Experts scored.
    pub num_experts: usize,
    /// Experts kept.
    pub top_k: usize,
}

impl Router for TopKSoftmax {
    fn num_experts(&self) -> usize {
        self.num_experts
    }
    fn top_k(&self) -> usize {
        self.top_k
    }
    fn route_token(&self, logits: &[f32], ids: &mut [i32], weights: &mut [f32]) {
        let mut picks = Vec::with_capacity(self.top_k);
        select_top_k(logits, self.top_k, |_| true, &mut picks);
        let chosen: Vec<f32> = picks.iter().map(|&e| logits[e]).collect();
        softmax(&chosen, weights);
        for (id, &e) in ids.iter_mut().zip(&picks) {
            *id = e as i32;
        }
    }
}
