//! Softmax with group-limited greedy choice (DeepSeek-V2).

use super::{renormalize, select_top_k, softmax, Groups, Router};

/// Softmax over all experts; groups ranked by their best probability, the best `topk_group`
/// kept, top-k experts chosen in them. Weights are the probabilities, renormalised when asked
/// (k > 1), otherwise multiplied by `scaling`.
#[derive(Clone, Debug)]
pub struct SoftmaxGrouped {
    pub(crate) groups: Groups,
    pub(crate) top_k: usize,
    pub(crate) renormalize: bool,
    pub(crate) scaling: f32,
}

impl Router for SoftmaxGrouped {
    fn num_experts(&self) -> usize {
        self.groups.num_experts
    }
    fn top_k(&self) -> usize {
        self.top_k
    }
    fn route_token(&self, logits: &[f32], ids: &mut [i32], weights: &mut [f32]) {
        let mut probs = vec![0.0; logits.len()];
        softmax(logits, &mut probs);
        let per = self.groups.num_experts / self.groups.n_group;
        let group_scores: Vec<f32> =
            probs.chunks(per).map(|g| g.iter().copied().fold(f32::NEG_INFINITY, f32::max)).collect();
        let mut allowed = vec![false; probs.len()];
        self.groups.allowed(&group_scores, &mut allowed);
        let mut picks = Vec::with_capacity(self.top_k);
        select_top_k(&probs, self.top_k, |i| allowed[i], &mut picks);
        for (j, &e) in picks.iter().enumerate() {
            ids[j] = e as i32;
            weights[j] = probs[e];
        }
        if self.renormalize && self.top_k > 1 {
            renormalize(weights, 1e-20);
        } else {
            weights.iter_mut().for_each(|w| *w *= self.scaling);
        }
    }
}
