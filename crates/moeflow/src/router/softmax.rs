//! Softmax over all experts, then top-k (Mixtral, Qwen2/3-MoE, OLMoE).

use super::{renormalize, select_top_k, softmax, Router};

/// Softmax over `[E]`, keep the `top_k` largest probabilities, optionally renormalised to sum 1.
#[derive(Clone, Debug)]
pub struct SoftmaxTopK {
    /// Experts scored.
    pub num_experts: usize,
    /// Experts kept.
    pub top_k: usize,
    /// Divide the kept probabilities by their sum.
    pub renormalize: bool,
}

impl Router for SoftmaxTopK {
    fn num_experts(&self) -> usize {
        self.num_experts
    }
    fn top_k(&self) -> usize {
        self.top_k
    }
    fn route_token(&self, logits: &[f32], ids: &mut [i32], weights: &mut [f32]) {
        let mut probs = vec![0.0; logits.len()];
        softmax(logits, &mut probs);
        let mut picks = Vec::with_capacity(self.top_k);
        select_top_k(&probs, self.top_k, |_| true, &mut picks);
        for (j, &e) in picks.iter().enumerate() {
            ids[j] = e as i32;
            weights[j] = probs[e];
        }
        if self.renormalize {
            renormalize(weights, 0.0);
        }
    }
}
