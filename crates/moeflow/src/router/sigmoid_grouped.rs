//! Sigmoid scores with a selection-only correction bias and group-limited choice (DeepSeek-V3's
//! `noaux_tc`).

use super::{renormalize, select_top_k, Groups, Router};

/// Scores `s = sigmoid(logit)`; experts are chosen on `s + bias`: groups ranked by the sum of
/// their two best biased scores, the best `topk_group` groups kept, then the top-k experts in
/// them. Weights are the unbiased `s`, renormalised if asked, times `scaling`.
#[derive(Clone, Debug)]
pub struct SigmoidGrouped {
    pub(crate) groups: Groups,
    pub(crate) top_k: usize,
    pub(crate) renormalize: bool,
    pub(crate) scaling: f32,
    pub(crate) bias: Vec<f32>,
}

impl Router for SigmoidGrouped {
    fn num_experts(&self) -> usize {
        self.groups.num_experts
    }
    fn top_k(&self) -> usize {
        self.top_k
    }
    fn route_token(&self, logits: &[f32], ids: &mut [i32], weights: &mut [f32]) {
        let scores: Vec<f32> = logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect();
        let biased: Vec<f32> = scores.iter().zip(&self.bias).map(|(s, b)| s + b).collect();
        let per = self.groups.num_experts / self.groups.n_group;
        let mut picks = Vec::with_capacity(self.top_k);
        let group_scores: Vec<f32> = biased
            .chunks(per)
            .map(|g| {
                select_top_k(g, 2.min(per), |_| true, &mut picks);
                picks.iter().map(|&i| g[i]).sum()
            })
            .collect();
        let mut allowed = vec![false; biased.len()];
        self.groups.allowed(&group_scores, &mut allowed);
        select_top_k(&biased, self.top_k, |i| allowed[i], &mut picks);
        for (j, &e) in picks.iter().enumerate() {
            ids[j] = e as i32;
            weights[j] = scores[e];
        }
        if self.renormalize && self.top_k > 1 {
            renormalize(weights, 1e-20);
        }
        weights.iter_mut().for_each(|w| *w *= self.scaling);
    }
}
