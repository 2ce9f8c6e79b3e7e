//! The whole layer in f64, deliberately simple: the yardstick every faster path is checked
//! against. Routing uses full sorts in f64; experts use [`expert_row_f64`].

use crate::config::{MoeConfig, MoeWeights};
use crate::error::Result;
use crate::experts::{expert_row_f64, WeightValues};
use crate::router::RouterConfig;
use rayon::prelude::*;

/// The reference's answer for `T` tokens.
#[derive(Clone, Debug)]
pub struct ReferenceOutput {
    /// Chosen experts `[T, k]`.
    pub ids: Vec<usize>,
    /// Their weights `[T, k]`.
    pub weights: Vec<f64>,
    /// The scores experts were chosen by `[T, E]` (to recognise near-ties).
    pub choice_scores: Vec<f64>,
    /// Layer output `[T, H]`.
    pub out: Vec<f64>,
}

/// Routes one token in f64: `(ids [k], weights [k], choice scores [E])`.
pub fn route_token_f64(cfg: &RouterConfig, logits: &[f64], k: usize, bias: &[f64]) -> (Vec<usize>, Vec<f64>, Vec<f64>) {
    let e = logits.len();
    let order = |s: &[f64], allowed: &dyn Fn(usize) -> bool| {
        let mut idx: Vec<usize> = (0..s.len()).filter(|&i| allowed(i)).collect();
        idx.sort_by(|&a, &b| s[b].total_cmp(&s[a]).then(a.cmp(&b)));
        idx
    };
    let softmax = |x: &[f64]| {
        let m = x.iter().cloned().fold(f64::MIN, f64::max);
        let z: f64 = x.iter().map(|v| (v - m).exp()).sum();
        x.iter().map(|v| (v - m).exp() / z).collect::<Vec<_>>()
    };
    let normalize = |w: &mut Vec<f64>, eps: f64| {
        let t: f64 = w.iter().sum::<f64>() + eps;
        w.iter_mut().for_each(|x| *x /= t);
    };
    match *cfg {
        RouterConfig::Softmax { renormalize } => {
            let p = softmax(logits);
            let ids = order(&p, &|_| true)[..k].to_vec();
            let mut w: Vec<f64> = ids.iter().map(|&i| p[i]).collect();
            if renormalize {
                normalize(&mut w, 0.0);
            }
            (ids, w, p)
        }
        RouterConfig::TopKSoftmax => {
            let ids = order(logits, &|_| true)[..k].to_vec();
            let w = softmax(&ids.iter().map(|&i| logits[i]).collect::<Vec<_>>());
            (ids, w, logits.to_vec())
        }
        RouterConfig::SigmoidGrouped { n_group, topk_group, renormalize, scaling } => {
            let s: Vec<f64> = logits.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect();
            let b: Vec<f64> = s.iter().zip(bias).map(|(x, y)| x + y).collect();
            let per = e / n_group;
            let gs: Vec<f64> = (0..n_group)
                .map(|g| {
                    let mut v = b[g * per..(g + 1) * per].to_vec();
                    v.sort_by(|x, y| y.total_cmp(x));
                    v.iter().take(2).sum()
                })
                .collect();
            let keep = order(&gs, &|_| true)[..topk_group].to_vec();
            let ids = order(&b, &|i| keep.contains(&(i / per)))[..k].to_vec();
            let mut w: Vec<f64> = ids.iter().map(|&i| s[i]).collect();
            if renormalize && k > 1 {
                normalize(&mut w, 1e-20);
            }
            w.iter_mut().for_each(|x| *x *= scaling as f64);
            (ids, w, b)
        }
        RouterConfig::SoftmaxGrouped { n_group, topk_group, renormalize, scaling } => {
            let p = softmax(logits);
            let per = e / n_group;
            let gs: Vec<f64> =
                (0..n_group).map(|g| p[g * per..(g + 1) * per].iter().cloned().fold(f64::MIN, f64::max)).collect();
            let keep = order(&gs, &|_| true)[..topk_group].to_vec();
            let ids = order(&p, &|i| keep.contains(&(i / per)))[..k].to_vec();
            let mut w: Vec<f64> = ids.iter().map(|&i| p[i]).collect();
            if renormalize && k > 1 {
                normalize(&mut w, 1e-20);
            } else {
                w.iter_mut().for_each(|x| *x *= scaling as f64);
            }
            (ids, w, p)
        }
    }
}

/// An expert stack's weights and biases as the reference reads them.
struct Flat<'a> {
    w13: WeightValues<'a>,
    w2: WeightValues<'a>,
    b13: Option<Vec<f32>>,
    b2: Option<Vec<f32>>,
}

impl<'a> Flat<'a> {
    fn new(w: &'a crate::experts::ExpertWeights) -> Self {
        Flat {
            w13: WeightValues::w13(w),
            w2: WeightValues::w2(w),
            b13: w.b13.as_ref().map(|b| b.to_f32_vec()),
            b2: w.b2.as_ref().map(|b| b.to_f32_vec()),
        }
    }
}

/// Runs the whole layer in f64 on `hidden [T, H]`.
pub fn forward(config: &MoeConfig, weights: &MoeWeights, hidden: &[f32]) -> Result<ReferenceOutput> {
    weights.validate(config)?;
    let (e, h, k) = (config.num_experts, config.hidden, config.top_k);
    let tokens = hidden.len() / h;
    let gate = weights.gate.to_f32_vec();
    let gate_bias = weights.gate_bias.as_ref().map(|b| b.to_f64_vec());
    let bias = weights.correction_bias.as_ref().map_or(vec![0.0; e], |b| b.to_f64_vec());
    let routed: Vec<(Vec<usize>, Vec<f64>, Vec<f64>)> = (0..tokens)
        .into_par_iter()
        .map(|t| {
            let x = &hidden[t * h..(t + 1) * h];
            let logits: Vec<f64> = (0..e)
                .map(|j| {
                    let dot: f64 = gate[j * h..(j + 1) * h].iter().zip(x).map(|(&w, &v)| w as f64 * v as f64).sum();
                    dot + gate_bias.as_ref().map_or(0.0, |b| b[j])
                })
                .collect();
            route_token_f64(&config.router, &logits, k, &bias)
        })
        .collect();
    let ids: Vec<usize> = routed.iter().flat_map(|r| r.0.clone()).collect();
    let w: Vec<f64> = routed.iter().flat_map(|r| r.1.clone()).collect();
    let choice_scores = routed.into_iter().flat_map(|r| r.2).collect();
    let out = forward_with_routing(config, weights, hidden, &ids, &w)?;
    Ok(ReferenceOutput { ids, weights: w, choice_scores, out })
}

/// The layer in f64 with a given routing (`ids`, `weights` `[T, k]`): routed experts weighted
/// and summed, plus shared experts.
pub fn forward_with_routing(
    config: &MoeConfig,
    weights: &MoeWeights,
    hidden: &[f32],
    ids: &[usize],
    topk_weights: &[f64],
) -> Result<Vec<f64>> {
    let (h, i, k) = (config.hidden, config.inter, config.top_k);
    let tokens = hidden.len() / h;
    let routed = Flat::new(&weights.experts);
    let shared = weights
        .shared
        .as_ref()
        .map(|s| (Flat::new(&s.mlp), s.gate.as_ref().map(|g| g.to_f64_vec()), config.shared.map_or(0, |c| c.inter)));
    let rows: Vec<Vec<f64>> = (0..tokens)
        .into_par_iter()
        .map(|t| {
            let x: Vec<f64> = hidden[t * h..(t + 1) * h].iter().map(|&v| v as f64).collect();
            let mut acc = vec![0f64; h];
            for j in 0..k {
                let mut w = topk_weights[t * k + j];
                let mut input = x.clone();
                if config.apply_router_weight_on_input {
                    input.iter_mut().for_each(|v| *v *= w);
                    w = 1.0;
                }
                let y = expert_row_f64(
                    &routed.w13,
                    &routed.w2,
                    routed.b13.as_deref(),
                    routed.b2.as_deref(),
                    config.activation,
                    (h, i),
                    ids[t * k + j],
                    &input,
                );
                acc.iter_mut().zip(&y).for_each(|(a, v)| *a += w * v);
            }
            if let Some((s, gate, si)) = &shared {
                let y = expert_row_f64(&s.w13, &s.w2, None, None, config.activation, (h, *si), 0, &x);
                let g = gate.as_ref().map_or(1.0, |g| {
                    let z: f64 = g.iter().zip(&x).map(|(a, b)| a * b).sum();
                    1.0 / (1.0 + (-z).exp())
                });
                acc.iter_mut().zip(&y).for_each(|(a, v)| *a += g * v);
            }
            acc
        })
        .collect();
    Ok(rows.concat())
}
