//! Helpers shared by the integration tests: random layers and the reference comparison.
#![allow(dead_code)]

use moeflow::{
    preset, reference, Activation, Bf16Matmul, DType, MoeConfig, MoeLayer, MoeWeights, RouterConfig, SharedConfig,
    Tensor,
};

/// Relative bound for the f32 paths against the f64 reference: f32 rounding (2^-24 per op)
/// over reductions of at most a few thousand terms stays far below it, relative to the terms'
/// magnitude where their sum cancels ([`magnitude`], which `check_against_reference` scales by).
pub const F32_TOL: f64 = 2e-5;

/// A small layer of the given shape and semantics.
pub fn small_config(
    hidden: usize,
    inter: usize,
    experts: usize,
    top_k: usize,
    router: RouterConfig,
    activation: Activation,
    shared: Option<SharedConfig>,
) -> MoeConfig {
    preset::config(hidden, inter, experts, top_k, router, activation, shared)
}

/// The layer the fp8-expert GPU tests run, for `ranks` expert-parallel ranks: depths 144 and 80
/// (multiples of 16, as fp8 rows need, but not of the 128-deep scale blocks), 4 experts a rank,
/// top-3, a gated shared expert.
pub fn fp8_test_config(ranks: usize) -> MoeConfig {
    let shared = Some(SharedConfig { inter: 48, gated: true });
    small_config(144, 80, 4 * ranks, 3, RouterConfig::Softmax { renormalize: true }, Activation::Silu, shared)
}

/// Inputs uniform in [-1, 1].
pub fn hidden(tokens: usize, h: usize, seed: u64) -> (Vec<f32>, Tensor) {
    let x = preset::uniform(tokens * h, 1.0, seed);
    let t = Tensor::from_f32(&[tokens, h], x.clone()).unwrap();
    (x, t)
}

/// Compares the layer with the reference: routing (ids equal except near-ties, weights close)
/// and output (with the layer's own routing) within `tol` of the largest value of its
/// [`magnitude`]. Returns that relative error.
pub fn check_against_reference(config: &MoeConfig, weights: &MoeWeights, layer: &MoeLayer, x: &[f32], tol: f64) -> f64 {
    let (h, k) = (config.hidden, config.top_k);
    let tokens = x.len() / h;
    let xt = Tensor::from_f32(&[tokens, h], x.to_vec()).unwrap();
    let topk = layer.route(&xt).unwrap();
    let r = reference::forward(config, weights, x).unwrap();
    let e = config.num_experts;
    for t in 0..tokens {
        let got: Vec<usize> = topk.ids[t * k..(t + 1) * k].iter().map(|&i| i as usize).collect();
        let want = &r.ids[t * k..(t + 1) * k];
        if got != want {
            let s = &r.choice_scores[t * e..(t + 1) * e];
            let gap = got.iter().zip(want).map(|(&a, &b)| (s[a] - s[b]).abs()).fold(0.0, f64::max);
            assert!(gap < 1e-4, "token {t}: routing {got:?} vs reference {want:?} (gap {gap})");
            continue;
        }
        for j in 0..k {
            let (a, b) = (topk.weights[t * k + j] as f64, r.weights[t * k + j]);
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "token {t} slot {j}: weight {a} vs {b}");
        }
    }
    let ids: Vec<usize> = topk.ids.iter().map(|&i| i as usize).collect();
    let w: Vec<f64> = topk.weights.iter().map(|&v| v as f64).collect();
    let want = reference::forward_with_routing(config, weights, x, &ids, &w).unwrap();
    let got = layer.forward(&xt).unwrap();
    assert_eq!(got.shape(), &[tokens, h]);
    let got = got.to_f32_vec();
    let scale = magnitude_scale(config, weights, x, &ids, &w).max(1e-30);
    let err = got.iter().zip(&want).map(|(&g, &w)| (g as f64 - w).abs()).fold(0.0, f64::max) / scale;
    assert!(err <= tol, "relative error {err:e} > {tol:e}");
    assert!(got.iter().all(|v| v.is_finite()));
    err
}

/// The weights' dtype variants the fast path supports.
pub const WEIGHT_DTYPES: [DType; 2] = [DType::F32, DType::BF16];

/// The fast path's arithmetic variants: f32 weights, bf16 weights widened to f32, and bf16
/// weights taking bf16 dot products (the portable kernel where AVX512-BF16 is missing).
pub const WEIGHT_VARIANTS: [(DType, Bf16Matmul); 3] =
    [(DType::F32, Bf16Matmul::Widen), (DType::BF16, Bf16Matmul::Widen), (DType::BF16, Bf16Matmul::Dot)];

/// Error bound of bf16 dot products against the f64 reference, as a fraction of the output's
/// magnitude without cancellation ([`magnitude`]): activations rounded to bf16 (2^-9 relative)
/// before each GEMM.
pub const BF16_DOT_TOL: f64 = 5e-2;

/// The reference output on every input's, weight's and routing weight's magnitude: what the
/// layer's terms add up to without cancellation. Rounding errs in proportion to the terms, not
/// to their sum, which in a tiny random layer can cancel to a small fraction of them, so the
/// error bounds are fractions of this output's largest value. Unquantized weights only.
pub fn magnitude(config: &MoeConfig, weights: &MoeWeights, x: &[f32], ids: &[usize], w: &[f64]) -> Vec<f64> {
    assert!(weights.experts.quant.is_none(), "the magnitude of quantized weights");
    let abs = |t: &Tensor| {
        let values: Vec<f32> = t.to_f32_vec().iter().map(|v| v.abs()).collect();
        Tensor::from_f32_as(t.shape(), &values, t.dtype()).unwrap()
    };
    let experts = |e: &moeflow::ExpertWeights| moeflow::ExpertWeights {
        w13: abs(&e.w13),
        w2: abs(&e.w2),
        b13: e.b13.as_ref().map(abs),
        b2: e.b2.as_ref().map(abs),
        quant: None,
    };
    let magnitudes = MoeWeights {
        gate: weights.gate.clone(),
        gate_bias: weights.gate_bias.clone(),
        correction_bias: weights.correction_bias.clone(),
        experts: experts(&weights.experts),
        shared: weights
            .shared
            .as_ref()
            .map(|s| moeflow::SharedWeights { mlp: experts(&s.mlp), gate: s.gate.as_ref().map(abs) }),
    };
    let x: Vec<f32> = x.iter().map(|v| v.abs()).collect();
    let w: Vec<f64> = w.iter().map(|v| v.abs()).collect();
    reference::forward_with_routing(config, &magnitudes, &x, ids, &w).unwrap()
}

/// The error bound of a weight variant.
pub fn variant_tol(dtype: DType, bf16: Bf16Matmul) -> f64 {
    if dtype == DType::BF16 && bf16.uses_dot() {
        BF16_DOT_TOL
    } else {
        F32_TOL
    }
}

/// The largest value of [`magnitude`]: the scale of the error bounds.
pub fn magnitude_scale(config: &MoeConfig, weights: &MoeWeights, x: &[f32], ids: &[usize], w: &[f64]) -> f64 {
    magnitude(config, weights, x, ids, w).iter().fold(0f64, |m, v| m.max(v.abs()))
}

/// The GPUs a multi-GPU test runs on, held by that test alone until `_serial` drops: a test
/// binary runs its tests on threads side by side, and two low-latency tests side by side on
/// the same GPUs both failed at their deadline (kernels that spin on a peer can hold the SMs
/// the other test's peer needs), while each passes alone.
#[cfg(feature = "cuda")]
pub struct Gpus {
    /// How many (2, or 4 where there are that many).
    pub n: usize,
    pub _serial: std::sync::MutexGuard<'static, ()>,
}

/// The GPUs to use, taken from every other test of the binary, or `None` after saying loudly
/// that the test is skipped.
#[cfg(feature = "cuda")]
pub fn gpus(test: &str) -> Option<Gpus> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let n = moeflow::backend::cuda::device_count();
    if n < 2 {
        eprintln!("SKIPPED {test}: needs 2 GPUs, found {n}");
        return None;
    }
    // A test that failed while holding them leaves them usable.
    let serial = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    Some(Gpus { n: if n >= 4 { 4 } else { 2 }, _serial: serial })
}
