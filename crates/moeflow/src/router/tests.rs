//! Router tests: hand-computed cases and an independent sort-based f64 implementation.

use super::*;
use rand::{Rng, SeedableRng};

fn route1(cfg: RouterConfig, e: usize, k: usize, bias: Option<Vec<f32>>, logits: &[f32]) -> (Vec<i32>, Vec<f32>) {
    let r = cfg.build(e, k, bias).unwrap();
    let t = r.route(logits, 1).unwrap();
    (t.ids, t.weights)
}

fn close(a: &[f32], b: &[f64], tol: f64) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(&x, &y)| (x as f64 - y).abs() <= tol * (1.0 + y.abs()))
}

#[test]
fn softmax_hand_computed() {
    let l = [1.0, 2.0, 3.0, 0.0];
    let (ids, w) = route1(RouterConfig::Softmax { renormalize: true }, 4, 2, None, &l);
    assert_eq!(ids, [2, 1]);
    let (e2, e3) = (2f64.exp(), 3f64.exp());
    assert!(close(&w, &[e3 / (e2 + e3), e2 / (e2 + e3)], 1e-6), "{w:?}");
    let (ids, w) = route1(RouterConfig::Softmax { renormalize: false }, 4, 2, None, &l);
    assert_eq!(ids, [2, 1]);
    let z = 1.0 + 1f64.exp() + e2 + e3;
    assert!(close(&w, &[e3 / z, e2 / z], 1e-6), "{w:?}");
    // Ties go to the lower id.
    let (ids, w) = route1(RouterConfig::Softmax { renormalize: false }, 4, 2, None, &[1.0; 4]);
    assert_eq!(ids, [0, 1]);
    assert!(close(&w, &[0.25, 0.25], 1e-7));
}

#[test]
fn topk_softmax_hand_computed() {
    let (ids, w) = route1(RouterConfig::TopKSoftmax, 4, 2, None, &[0.5, -1.0, 2.0, 2.0]);
    assert_eq!(ids, [2, 3]);
    assert!(close(&w, &[0.5, 0.5], 1e-7));
    let (ids, w) = route1(RouterConfig::TopKSoftmax, 4, 2, None, &[0.0, 1.0, -5.0, 0.0]);
    assert_eq!(ids, [1, 0]);
    let s = 1.0 + 1f64.exp();
    assert!(close(&w, &[1f64.exp() / s, 1.0 / s], 1e-6), "{w:?}");
}

fn sig(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

#[test]
fn sigmoid_grouped_hand_computed() {
    let cfg = RouterConfig::SigmoidGrouped { n_group: 4, topk_group: 2, renormalize: true, scaling: 2.5 };
    // Group 0 has the single best expert but the worst pair sum among the top three groups.
    let l = [3.0, -3.0, 1.0, 1.0, 0.5, 0.5, -2.0, -2.0];
    let (ids, w) = route1(cfg.clone(), 8, 2, None, &l);
    assert_eq!(ids, [2, 3]);
    assert!(close(&w, &[1.25, 1.25], 1e-6), "{w:?}");
    // The bias decides the choice but not the weights.
    let mut bias = vec![0.0; 8];
    bias[5] = 1.0;
    let (ids, w) = route1(cfg, 8, 2, Some(bias), &l);
    assert_eq!(ids, [5, 2]);
    let (a, b) = (sig(0.5), sig(1.0));
    assert!(close(&w, &[2.5 * a / (a + b), 2.5 * b / (a + b)], 1e-6), "{w:?}");
    // Without renormalisation the weights are the scaled sigmoids.
    let cfg = RouterConfig::SigmoidGrouped { n_group: 1, topk_group: 1, renormalize: false, scaling: 2.0 };
    let (ids, w) = route1(cfg, 8, 1, None, &l);
    assert_eq!(ids, [0]);
    assert!(close(&w, &[2.0 * sig(3.0)], 1e-6));
}

#[test]
fn softmax_grouped_hand_computed() {
    // Groups of two; group 1 holds the best expert, group 0 the second-best group.
    let l = [1.0, 0.9, 2.0, -3.0, 0.0, 0.95, -1.0, -1.0];
    let cfg = RouterConfig::SoftmaxGrouped { n_group: 4, topk_group: 1, renormalize: false, scaling: 3.0 };
    let (ids, _) = route1(cfg, 8, 2, None, &l);
    assert_eq!(ids, [2, 3], "only group 1 is kept");
    let cfg = RouterConfig::SoftmaxGrouped { n_group: 4, topk_group: 2, renormalize: false, scaling: 3.0 };
    let (ids, w) = route1(cfg, 8, 2, None, &l);
    assert_eq!(ids, [2, 0]);
    let z: f64 = l.iter().map(|&x| (x as f64).exp()).sum();
    assert!(close(&w, &[3.0 * 2f64.exp() / z, 3.0 * 1f64.exp() / z], 1e-6), "{w:?}");
    let cfg = RouterConfig::SoftmaxGrouped { n_group: 4, topk_group: 2, renormalize: true, scaling: 3.0 };
    let (_, w) = route1(cfg, 8, 2, None, &l);
    let (a, b) = (2f64.exp(), 1f64.exp());
    assert!(close(&w, &[a / (a + b), b / (a + b)], 1e-6), "{w:?}");
}

#[test]
fn bad_configs_and_logits_are_errors() {
    let soft = RouterConfig::Softmax { renormalize: true };
    assert!(soft.build(4, 5, None).err().unwrap().to_string().contains("top-k 5"));
    assert!(soft.build(4, 0, None).is_err());
    assert!(soft.build(4, 2, Some(vec![0.0; 4])).is_err());
    let g = RouterConfig::SigmoidGrouped { n_group: 3, topk_group: 1, renormalize: true, scaling: 1.0 };
    assert!(g.build(8, 2, None).err().unwrap().to_string().contains("3 equal groups"));
    let g = RouterConfig::SigmoidGrouped { n_group: 4, topk_group: 1, renormalize: true, scaling: 1.0 };
    assert!(g.build(8, 3, None).err().unwrap().to_string().contains("exceeds"));
    assert!(g.build(8, 2, Some(vec![0.0; 7])).is_err());
    let r = soft.build(4, 2, None).unwrap();
    let err = r.route(&[0.0, 1.0, f32::NAN, 0.0, 1.0, 2.0, 3.0, 4.0], 2).unwrap_err().to_string();
    assert!(err.contains("non-finite") && err.contains("router logits") && err.contains("index 2"), "{err}");
    assert!(r.route(&[0.0; 7], 2).unwrap_err().to_string().contains("router logits"));
    assert_eq!(r.route(&[], 0).unwrap().ids.len(), 0);
}

use crate::reference::route_token_f64 as reference_route;

#[test]
fn routers_match_independent_implementation_on_random_logits() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let configs = [
        RouterConfig::Softmax { renormalize: true },
        RouterConfig::Softmax { renormalize: false },
        RouterConfig::TopKSoftmax,
        RouterConfig::SigmoidGrouped { n_group: 8, topk_group: 4, renormalize: true, scaling: 2.5 },
        RouterConfig::SigmoidGrouped { n_group: 1, topk_group: 1, renormalize: false, scaling: 1.0 },
        RouterConfig::SoftmaxGrouped { n_group: 8, topk_group: 3, renormalize: false, scaling: 16.0 },
        RouterConfig::SoftmaxGrouped { n_group: 4, topk_group: 2, renormalize: true, scaling: 1.0 },
    ];
    let (e, tokens) = (64, 200);
    let mut near_ties = 0;
    for cfg in &configs {
        for k in [1, 2, 6, 8] {
            let bias: Vec<f32> = (0..e).map(|_| rng.gen_range(-0.1..0.1)).collect();
            let use_bias = matches!(cfg, RouterConfig::SigmoidGrouped { .. });
            let r = cfg.build(e, k, use_bias.then(|| bias.clone())).unwrap();
            let logits: Vec<f32> = (0..tokens * e).map(|_| rng.gen_range(-4.0..4.0)).collect();
            let out = r.route(&logits, tokens).unwrap();
            let bias64: Vec<f64> = if use_bias { bias.iter().map(|&b| b as f64).collect() } else { vec![0.0; e] };
            for t in 0..tokens {
                let l64: Vec<f64> = logits[t * e..(t + 1) * e].iter().map(|&x| x as f64).collect();
                let (ids, w, scores) = reference_route(cfg, &l64, k, &bias64);
                let got: Vec<usize> = out.ids[t * k..(t + 1) * k].iter().map(|&i| i as usize).collect();
                if got != ids {
                    // Only a near-tie in the choosing score may flip f32 against f64.
                    let gap = got.iter().zip(&ids).map(|(&a, &b)| (scores[a] - scores[b]).abs()).fold(0.0, f64::max);
                    assert!(gap < 1e-5, "{cfg:?} k {k} token {t}: {got:?} vs {ids:?}");
                    near_ties += 1;
                    continue;
                }
                assert!(close(&out.weights[t * k..(t + 1) * k], &w, 2e-6), "{cfg:?} k {k} token {t}");
            }
        }
    }
    assert!(near_ties < 5, "{near_ties} near ties");
}
