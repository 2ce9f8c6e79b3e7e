//! Skewed routing for layers with random weights: a per-expert bias added to the router
//! logits (the weights' `gate_bias`), so a few experts receive most tokens, reproducibly and
//! without a real model.
//!
//! - `zipf:S` adds `-S · ln(1 + e)` to expert `e`'s logit: under a softmax router each expert's
//!   score is multiplied by `(1 + e)^-S` (Zipf's law over the expert ids, expert 0 hottest),
//!   then the router picks its top-k as usual. `S = 0` changes nothing.
//! - `hot:E1,E2,...:P` adds one bias `δ` to the listed experts' logits, with `δ` chosen so that
//!   a share `P` of all (token, slot) pairs goes to them: found by bisection over `δ` on
//!   [`CALIBRATION_TOKENS`] tokens uniform in `[-1, 1]` (seed [`CALIBRATION_SEED`]) routed by
//!   the layer's own router. `P` must lie in `(0, 1)` and, since a token takes an expert at
//!   most once, below `n / k` for `n` listed experts and top-`k`.

use crate::config::{MoeConfig, MoeWeights};
use crate::error::{MoeError, Result};
use crate::tensor::Tensor;
use std::str::FromStr;

/// Tokens the `hot` skew's bias is fitted on.
pub const CALIBRATION_TOKENS: usize = 512;

/// Seed of the `hot` skew's calibration tokens.
pub const CALIBRATION_SEED: u64 = 0x5eed_0b1a5;

/// How routing is skewed (see the module).
#[derive(Clone, Debug, PartialEq)]
pub enum Skew {
    /// Expert `e`'s logit plus `-S · ln(1 + e)`.
    Zipf(f64),
    /// The listed experts' logits plus one bias giving them `share` of the (token, slot) pairs.
    Hot {
        /// The hot experts.
        experts: Vec<usize>,
        /// Their share of all (token, slot) pairs, in `(0, 1)`.
        share: f64,
    },
}

impl FromStr for Skew {
    type Err = MoeError;
    fn from_str(s: &str) -> Result<Self> {
        let bad = |why: &str| MoeError::Config(format!("skew '{s}': {why} (zipf:S or hot:E1,E2,...:P)"));
        let parts: Vec<&str> = s.split(':').collect();
        match parts.as_slice() {
            ["zipf", exponent] => {
                let v: f64 = exponent.parse().map_err(|_| bad("the exponent is not a number"))?;
                if !(0.0..=16.0).contains(&v) {
                    return Err(bad("the exponent must lie in [0, 16]"));
                }
                Ok(Skew::Zipf(v))
            }
            ["hot", list, share] => {
                let experts = list
                    .split(',')
                    .map(|e| e.trim().parse::<usize>().map_err(|_| bad("an expert id is not a number")))
                    .collect::<Result<Vec<_>>>()?;
                let share: f64 = share.parse().map_err(|_| bad("the share is not a number"))?;
                if !(share > 0.0 && share < 1.0) {
                    return Err(bad("the share must lie strictly between 0 and 1"));
                }
                Ok(Skew::Hot { experts, share })
            }
            _ => Err(bad("unknown form")),
        }
    }
}

impl std::fmt::Display for Skew {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Skew::Zipf(s) => write!(f, "zipf:{s}"),
            Skew::Hot { experts, share } => {
                let ids: Vec<String> = experts.iter().map(|e| e.to_string()).collect();
                write!(f, "hot:{}:{share}", ids.join(","))
            }
        }
    }
}

/// The router weights a skew's bias depends on (the `hot` form fits its bias to them).
#[derive(Clone, Copy, Debug)]
pub struct RouterWeights<'a> {
    /// The gate `[E, H]`.
    pub gate: &'a [f32],
    /// The bias `[E]` added to the logits, if any.
    pub gate_bias: Option<&'a [f32]>,
    /// The selection-only bias `[E]` of DeepSeek's grouped router, if any.
    pub correction_bias: Option<&'a [f32]>,
}

impl Skew {
    /// The bias `[E]` this skew adds to the router logits of `config` with `weights`.
    pub fn bias(&self, config: &MoeConfig, weights: &MoeWeights) -> Result<Vec<f32>> {
        let (gate, gate_bias, correction_bias) = (
            weights.gate.to_f32_vec(),
            weights.gate_bias.as_ref().map(|b| b.to_f32_vec()),
            weights.correction_bias.as_ref().map(|b| b.to_f32_vec()),
        );
        let router =
            RouterWeights { gate: &gate, gate_bias: gate_bias.as_deref(), correction_bias: correction_bias.as_deref() };
        self.bias_for_router(config, &router)
    }

    /// [`Skew::bias`] from the router's weights alone (all the bias depends on; a GPU layer
    /// reads them from the device).
    pub fn bias_for_router(&self, config: &MoeConfig, router: &RouterWeights<'_>) -> Result<Vec<f32>> {
        let e = config.num_experts;
        match self {
            Skew::Zipf(s) => Ok((0..e).map(|i| (-s * (1.0 + i as f64).ln()) as f32).collect()),
            Skew::Hot { experts, share } => {
                let mut hot = vec![false; e];
                for &x in experts {
                    if x >= e {
                        return Err(MoeError::Config(format!("skew {self}: expert {x} of {e}")));
                    }
                    if std::mem::replace(&mut hot[x], true) {
                        return Err(MoeError::Config(format!("skew {self}: expert {x} listed twice")));
                    }
                }
                let most = experts.len() as f64 / config.top_k as f64;
                if *share >= most.min(1.0) {
                    return Err(MoeError::Config(format!(
                        "skew {self}: {} experts can take at most {:.3} of top-{} slots",
                        experts.len(),
                        most.min(1.0),
                        config.top_k
                    )));
                }
                if router.gate.len() != e * config.hidden {
                    return Err(MoeError::shape("gate", format!("[{e}, {}]", config.hidden), router.gate.len()));
                }
                let delta = fit_hot_bias(config, router, &hot, *share)?;
                Ok(hot.iter().map(|&h| if h { delta } else { 0.0 }).collect())
            }
        }
    }

    /// Adds this skew's bias to `weights.gate_bias` (creating it where absent).
    pub fn apply(&self, config: &MoeConfig, weights: &mut MoeWeights) -> Result<()> {
        let bias = self.bias(config, weights)?;
        let mut gate_bias = weights.gate_bias.as_ref().map_or_else(|| vec![0.0; bias.len()], |b| b.to_f32_vec());
        gate_bias.iter_mut().zip(&bias).for_each(|(g, b)| *g += b);
        weights.gate_bias = Some(Tensor::from_f32(&[bias.len()], gate_bias)?);
        Ok(())
    }
}

/// The router logits `[T, E]` of the calibration tokens (bias included).
fn calibration_logits(config: &MoeConfig, router: &RouterWeights<'_>) -> Vec<f32> {
    use rayon::prelude::*;
    let (e, h) = (config.num_experts, config.hidden);
    let x = crate::preset::uniform(CALIBRATION_TOKENS * h, 1.0, CALIBRATION_SEED);
    let (gate, bias) = (router.gate, router.gate_bias);
    let mut logits = vec![0f32; CALIBRATION_TOKENS * e];
    logits.par_chunks_mut(e).zip(x.par_chunks(h)).for_each(|(row, xr)| {
        for (j, l) in row.iter_mut().enumerate() {
            let g = &gate[j * h..(j + 1) * h];
            *l = xr.iter().zip(g).map(|(a, b)| a * b).sum::<f32>() + bias.as_ref().map_or(0.0, |b| b[j]);
        }
    });
    logits
}

/// The bias on the `hot` experts' logits that routes `share` of the calibration tokens'
/// (token, slot) pairs to them (bisection; the share grows with the bias).
fn fit_hot_bias(config: &MoeConfig, weights: &RouterWeights<'_>, hot: &[bool], share: f64) -> Result<f32> {
    let e = config.num_experts;
    let router = config.router.build(e, config.top_k, weights.correction_bias.map(|b| b.to_vec()))?;
    let base = calibration_logits(config, weights);
    let share_at = |delta: f32| -> Result<f64> {
        let mut logits = base.clone();
        for row in logits.chunks_mut(e) {
            row.iter_mut().zip(hot).filter(|(_, &h)| h).for_each(|(l, _)| *l += delta);
        }
        let ids = router.route(&logits, CALIBRATION_TOKENS)?.ids;
        Ok(ids.iter().filter(|&&i| hot[i as usize]).count() as f64 / ids.len() as f64)
    };
    let (mut lo, mut hi) = (-64f32, 64f32);
    for _ in 0..40 {
        let mid = 0.5 * (lo + hi);
        if share_at(mid)? < share {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(hi)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{preset, DType, MoeLayer, Tensor};

    fn small(name: &str) -> (MoeConfig, MoeWeights) {
        let mut config = preset::preset(name).unwrap().config.with_num_experts(32).unwrap();
        (config.hidden, config.inter) = (64, 16);
        config.shared = None;
        let weights = preset::random_weights(&config, DType::F32, 4);
        (config, weights)
    }

    /// Per expert, the share of (token, slot) pairs of `t` fresh tokens.
    fn shares(config: &MoeConfig, weights: &MoeWeights, t: usize) -> Vec<f64> {
        let layer = MoeLayer::new(config, weights, Default::default()).unwrap();
        let x = Tensor::from_f32(&[t, config.hidden], preset::uniform(t * config.hidden, 1.0, 77)).unwrap();
        let ids = layer.route(&x).unwrap().ids;
        let mut c = vec![0f64; config.num_experts];
        ids.iter().for_each(|&i| c[i as usize] += 1.0 / ids.len() as f64);
        c
    }

    #[test]
    fn parses_and_refuses() {
        assert_eq!("zipf:1.2".parse::<Skew>().unwrap(), Skew::Zipf(1.2));
        assert_eq!("hot:3,7:0.5".parse::<Skew>().unwrap(), Skew::Hot { experts: vec![3, 7], share: 0.5 });
        assert_eq!("hot:3,7:0.5".parse::<Skew>().unwrap().to_string(), "hot:3,7:0.5");
        for bad in ["zipf", "zipf:x", "zipf:-1", "hot:1:1.5", "hot:a:0.5", "uniform"] {
            assert!(bad.parse::<Skew>().is_err(), "{bad}");
        }
        let (config, weights) = small("olmoe-1b-7b");
        let e = Skew::Hot { experts: vec![99], share: 0.1 }.bias(&config, &weights).unwrap_err();
        assert!(e.to_string().contains("expert 99 of 32"), "{e}");
        // One expert can take at most 1/k of the slots.
        let e = Skew::Hot { experts: vec![1], share: 0.5 }.bias(&config, &weights).unwrap_err();
        assert!(e.to_string().contains("at most 0.125"), "{e}");
    }

    #[test]
    fn zipf_makes_low_ids_hot_and_is_reproducible() {
        for name in ["olmoe-1b-7b", "deepseek-v3", "gpt-oss-120b"] {
            let (config, mut weights) = small(name);
            let flat = shares(&config, &weights, 2000);
            Skew::Zipf(1.2).apply(&config, &mut weights).unwrap();
            let skewed = shares(&config, &weights, 2000);
            let head = |s: &[f64]| s[..4].iter().sum::<f64>();
            assert!(head(&skewed) > 1.8 * head(&flat), "{name}: {skewed:?} vs {flat:?}");
            assert_eq!(shares(&config, &weights, 2000), skewed);
        }
    }

    #[test]
    fn hot_experts_get_the_share_asked_for() {
        for name in ["olmoe-1b-7b", "deepseek-v3"] {
            let (config, mut weights) = small(name);
            Skew::Hot { experts: vec![2, 9], share: 0.2 }.apply(&config, &mut weights).unwrap();
            let s = shares(&config, &weights, 4000);
            assert!((s[2] + s[9] - 0.2).abs() < 0.02, "{name}: {}", s[2] + s[9]);
        }
    }
}
