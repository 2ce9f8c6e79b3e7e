//! Routers: router logits `[T, E]` → the top-k experts of each token and their weights.
//!
//! Each router matches the model family it is named after. Scores are computed in f32 and ties
//! break toward the lower expert (or group) id, so routing is deterministic.

mod sigmoid_grouped;
mod softmax;
mod softmax_grouped;
mod topk_softmax;

pub use sigmoid_grouped::SigmoidGrouped;
pub use softmax::SoftmaxTopK;
pub use softmax_grouped::SoftmaxGrouped;
pub use topk_softmax::TopKSoftmax;

use crate::error::{check_finite, MoeError, Result};
use serde::{Deserialize, Serialize};

/// The routing of `tokens` tokens: expert ids and weights, both `[tokens, k]` row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct TopK {
    /// Number of tokens (rows).
    pub tokens: usize,
    /// Experts per token.
    pub k: usize,
    /// Expert ids `[tokens, k]`, in the order the router chose them.
    pub ids: Vec<i32>,
    /// Router weights `[tokens, k]`.
    pub weights: Vec<f32>,
}

impl TopK {
    /// Checks shapes and that every id lies in `0..num_experts`.
    pub fn validate(&self, num_experts: usize) -> Result<()> {
        let n = self.tokens * self.k;
        if self.ids.len() != n || self.weights.len() != n {
            return Err(MoeError::shape(
                "top-k ids/weights",
                [self.tokens, self.k],
                format!("{} ids, {} weights", self.ids.len(), self.weights.len()),
            ));
        }
        if let Some(i) = self.ids.iter().position(|&e| e < 0 || e as usize >= num_experts) {
            return Err(MoeError::ExpertOutOfRange {
                id: self.ids[i] as i64,
                num_experts,
                token: i / self.k.max(1),
                slot: i % self.k.max(1),
            });
        }
        check_finite("top-k weights", &self.weights)
    }

    /// Rows `start..end` of this routing (a routing without ids, as strategies that route
    /// after dispatch receive, stays without ids).
    pub fn slice(&self, start: usize, end: usize) -> TopK {
        if self.ids.is_empty() {
            return TopK { tokens: end - start, k: self.k, ids: vec![], weights: vec![] };
        }
        TopK {
            tokens: end - start,
            k: self.k,
            ids: self.ids[start * self.k..end * self.k].to_vec(),
            weights: self.weights[start * self.k..end * self.k].to_vec(),
        }
    }
}

/// Chooses experts for each token from its router logits.
pub trait Router: Send + Sync {
    /// Number of experts scored.
    fn num_experts(&self) -> usize;
    /// Experts chosen per token.
    fn top_k(&self) -> usize;
    /// Routes one token: `logits [E]` → `(ids [k], weights [k])` written into the outputs.
    fn route_token(&self, logits: &[f32], ids: &mut [i32], weights: &mut [f32]);

    /// Routes `tokens` tokens from `logits [tokens, E]`; NaN or infinite logits are an error.
    fn route(&self, logits: &[f32], tokens: usize) -> Result<TopK> {
        let (e, k) = (self.num_experts(), self.top_k());
        if logits.len() != tokens * e {
            return Err(MoeError::shape("router logits", [tokens, e], logits.len()));
        }
        check_finite("router logits", logits)?;
        let mut out = TopK { tokens, k, ids: vec![0; tokens * k], weights: vec![0.0; tokens * k] };
        for t in 0..tokens {
            let (ids, weights) = (&mut out.ids[t * k..(t + 1) * k], &mut out.weights[t * k..(t + 1) * k]);
            self.route_token(&logits[t * e..(t + 1) * e], ids, weights);
        }
        Ok(out)
    }
}

/// Which router a layer uses, with its parameters (serialisable; see [`RouterConfig::build`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RouterConfig {
    /// Softmax over all experts, then top-k; optionally renormalised (Mixtral, Qwen3-MoE: yes;
    /// OLMoE, Qwen2-MoE: no).
    Softmax {
        /// Divide the k weights by their sum.
        renormalize: bool,
    },
    /// Top-k on the logits, then softmax over the k chosen (GPT-OSS).
    TopKSoftmax,
    /// Sigmoid scores, per-expert correction bias used only for choosing, group-limited choice,
    /// optional renormalisation, times `scaling` (DeepSeek-V3).
    SigmoidGrouped {
        /// Number of expert groups.
        n_group: usize,
        /// Groups kept per token.
        topk_group: usize,
        /// Divide the k weights by their sum.
        renormalize: bool,
        /// routed_scaling_factor.
        scaling: f32,
    },
    /// Softmax with group-limited greedy choice (group score = its best expert); renormalised
    /// when asked, otherwise multiplied by `scaling` (DeepSeek-V2).
    SoftmaxGrouped {
        /// Number of expert groups (1 = plain greedy top-k).
        n_group: usize,
        /// Groups kept per token.
        topk_group: usize,
        /// Divide the k weights by their sum (then `scaling` is not applied).
        renormalize: bool,
        /// routed_scaling_factor.
        scaling: f32,
    },
}

impl RouterConfig {
    /// DeepSeek-V3's router: sigmoid scores, 8 groups of which each token keeps 4, the top-k
    /// weights renormalized and scaled by 2.5.
    pub const DEEPSEEK_V3: RouterConfig =
        RouterConfig::SigmoidGrouped { n_group: 8, topk_group: 4, renormalize: true, scaling: 2.5 };

    /// Builds the router for `num_experts` experts and `top_k`; `correction_bias [E]` is the
    /// DeepSeek-V3 selection bias (required by, and only accepted for, `SigmoidGrouped`).
    pub fn build(
        &self,
        num_experts: usize,
        top_k: usize,
        correction_bias: Option<Vec<f32>>,
    ) -> Result<Box<dyn Router>> {
        if top_k == 0 || top_k > num_experts {
            return Err(MoeError::Config(format!(
                "top-k {top_k} must be in 1..={num_experts} (the number of experts)"
            )));
        }
        // Routers keep per-expert state (scores, biases, groups).
        crate::memory::ensure(
            &format!("router state for {num_experts} experts"),
            crate::memory::bytes(&[num_experts], 2 * std::mem::size_of::<f32>()),
        )?;
        if correction_bias.is_some() && !matches!(self, RouterConfig::SigmoidGrouped { .. }) {
            return Err(MoeError::Config("a correction bias is only used by the sigmoid_grouped router".into()));
        }
        Ok(match *self {
            RouterConfig::Softmax { renormalize } => Box::new(SoftmaxTopK { num_experts, top_k, renormalize }),
            RouterConfig::TopKSoftmax => Box::new(TopKSoftmax { num_experts, top_k }),
            RouterConfig::SigmoidGrouped { n_group, topk_group, renormalize, scaling } => {
                let groups = Groups::new(num_experts, top_k, n_group, topk_group, 2)?;
                let bias = correction_bias.unwrap_or_else(|| vec![0.0; num_experts]);
                if bias.len() != num_experts {
                    return Err(MoeError::shape("e_score_correction_bias", [num_experts], [bias.len()]));
                }
                check_finite("e_score_correction_bias", &bias)?;
                Box::new(SigmoidGrouped { groups, top_k, renormalize, scaling, bias })
            }
            RouterConfig::SoftmaxGrouped { n_group, topk_group, renormalize, scaling } => {
                let groups = Groups::new(num_experts, top_k, n_group, topk_group, 1)?;
                Box::new(SoftmaxGrouped { groups, top_k, renormalize, scaling })
            }
        })
    }

    /// A short human-readable description.
    pub fn describe(&self) -> String {
        match self {
            RouterConfig::Softmax { renormalize: true } => "softmax top-k, renormalised".into(),
            RouterConfig::Softmax { renormalize: false } => "softmax top-k".into(),
            RouterConfig::TopKSoftmax => "top-k on logits, softmax over k".into(),
            RouterConfig::SigmoidGrouped { n_group, topk_group, scaling, .. } => {
                format!("sigmoid + bias, {n_group} groups, top-{topk_group} groups, ×{scaling}")
            }
            RouterConfig::SoftmaxGrouped { n_group, topk_group, .. } => {
                format!("softmax, group-limited greedy ({n_group} groups, top-{topk_group})")
            }
        }
    }
}

/// Expert groups for group-limited routing: `n_group` equal groups, `topk_group` kept.
#[derive(Clone, Debug)]
pub(crate) struct Groups {
    pub num_experts: usize,
    pub n_group: usize,
    pub topk_group: usize,
}

impl Groups {
    fn new(num_experts: usize, top_k: usize, n_group: usize, topk_group: usize, min_per_group: usize) -> Result<Self> {
        if n_group == 0 || !num_experts.is_multiple_of(n_group) {
            return Err(MoeError::Config(format!("{num_experts} experts cannot be split into {n_group} equal groups")));
        }
        if topk_group == 0 || topk_group > n_group {
            return Err(MoeError::Config(format!("topk_group {topk_group} must be in 1..={n_group}")));
        }
        let per = num_experts / n_group;
        if n_group > 1 && per < min_per_group {
            return Err(MoeError::Config(format!("groups of {per} experts are too small (need {min_per_group})")));
        }
        if top_k > topk_group * per {
            return Err(MoeError::Config(format!(
                "top-k {top_k} exceeds the {} experts of the {topk_group} kept groups",
                topk_group * per
            )));
        }
        Ok(Groups { num_experts, n_group, topk_group })
    }

    /// Marks in `allowed` the experts of the `topk_group` groups with the highest scores.
    pub fn allowed(&self, group_scores: &[f32], allowed: &mut [bool]) {
        let per = self.num_experts / self.n_group;
        let mut picks = Vec::with_capacity(self.topk_group);
        select_top_k(group_scores, self.topk_group, |_| true, &mut picks);
        allowed.iter_mut().for_each(|a| *a = false);
        for g in picks {
            allowed[g * per..(g + 1) * per].iter_mut().for_each(|a| *a = true);
        }
    }
}

/// Appends to `out` the indices of the `k` largest `scores` among those `allowed`, largest
/// first; equal scores go to the lower index.
pub(crate) fn select_top_k(scores: &[f32], k: usize, allowed: impl Fn(usize) -> bool, out: &mut Vec<usize>) {
    out.clear();
    for _ in 0..k {
        let mut best: Option<usize> = None;
        for (i, &s) in scores.iter().enumerate() {
            if !allowed(i) || out.contains(&i) {
                continue;
            }
            if best.is_none_or(|b| s > scores[b]) {
                best = Some(i);
            }
        }
        match best {
            Some(b) => out.push(b),
            None => break,
        }
    }
}

/// Softmax of `x` into `out` (max-subtracted, f32).
pub(crate) fn softmax(x: &[f32], out: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for (o, &v) in out.iter_mut().zip(x) {
        *o = (v - max).exp();
        sum += *o;
    }
    out.iter_mut().for_each(|o| *o /= sum);
}

/// Divides `w` by its sum plus `eps`.
pub(crate) fn renormalize(w: &mut [f32], eps: f32) {
    let sum: f32 = w.iter().sum::<f32>() + eps;
    w.iter_mut().for_each(|x| *x /= sum);
}

#[cfg(test)]
mod tests;
