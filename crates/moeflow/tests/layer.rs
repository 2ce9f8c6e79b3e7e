//! The single-rank layer against the f64 reference, chunking, and bad input.

mod common;

use common::*;
use moeflow::dispatch::Local;
use moeflow::{
    preset, Activation, Bf16Matmul, DType, ExpertsKind, LayerOptions, MoeError, MoeLayer, RouterConfig, SharedConfig,
    Tensor, TopK,
};
use proptest::prelude::*;

fn routers(experts: usize) -> Vec<RouterConfig> {
    let n_group = if experts >= 4 { 2 } else { 1 };
    vec![
        RouterConfig::Softmax { renormalize: true },
        RouterConfig::Softmax { renormalize: false },
        RouterConfig::TopKSoftmax,
        RouterConfig::SigmoidGrouped { n_group, topk_group: 1, renormalize: true, scaling: 2.5 },
        RouterConfig::SoftmaxGrouped { n_group: 2, topk_group: 2, renormalize: false, scaling: 1.5 },
    ]
}

const ACTIVATIONS: [Activation; 4] = [Activation::Silu, Activation::GeluErf, Activation::GeluTanh, Activation::GPT_OSS];

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Random shapes (hidden sizes that are not multiples of 8 or 16 included), routers,
    /// activations, weight dtypes, shared experts; T from 0.
    #[test]
    fn fast_path_matches_reference(
        tokens in 0usize..20,
        hidden in 1usize..41,
        inter in 1usize..30,
        half_experts in 1usize..6,
        k_frac in 0.0f64..1.0,
        router in 0usize..5,
        act in 0usize..4,
        variant in 0usize..3,
        shared in 0usize..3,
        chunk in proptest::option::of(1usize..7),
        seed in any::<u64>(),
    ) {
        let experts = 2 * half_experts;
        let router = routers(experts)[router].clone();
        // Grouped routers keep only half the experts: k fits in the kept groups.
        let max_k = match router { RouterConfig::SigmoidGrouped { n_group, .. } => experts / n_group, _ => experts };
        let k = 1 + ((max_k - 1) as f64 * k_frac) as usize;
        let shared = match shared { 0 => None, 1 => Some(SharedConfig { inter: inter + 3, gated: false }), _ => Some(SharedConfig { inter: 5, gated: true }) };
        let config = small_config(hidden, inter, experts, k, router, ACTIVATIONS[act], shared);
        let (dtype, bf16_matmul) = WEIGHT_VARIANTS[variant];
        let weights = preset::random_weights(&config, dtype, seed);
        let layer = MoeLayer::new(&config, &weights, LayerOptions { chunk_size: chunk, bf16_matmul, ..LayerOptions::default() }).unwrap();
        let (x, _) = hidden_input(tokens, hidden, seed ^ 1);
        check_against_reference(&config, &weights, &layer, &x, variant_tol(dtype, bf16_matmul));
    }
}

fn hidden_input(tokens: usize, h: usize, seed: u64) -> (Vec<f32>, Tensor) {
    hidden(tokens, h, seed)
}

#[test]
fn awkward_routings_match_reference() {
    let config = small_config(19, 11, 8, 3, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    for (dtype, bf16_matmul) in WEIGHT_VARIANTS {
        let weights = preset::random_weights(&config, dtype, 5);
        let layer = MoeLayer::new(&config, &weights, LayerOptions { bf16_matmul, ..LayerOptions::default() }).unwrap();
        let tol = variant_tol(dtype, bf16_matmul);
        let (x, xt) = hidden(9, 19, 6);
        // One hot expert in every slot position it can take, others never hit.
        let mut ids = vec![0i32; 27];
        for t in 0..9 {
            ids[t * 3] = 5;
            ids[t * 3 + 1] = if t % 2 == 0 { 1 } else { 6 };
            ids[t * 3 + 2] = 2;
        }
        let w: Vec<f32> = (0..27).map(|i| 0.1 + (i % 5) as f32 * 0.2).collect();
        let topk = TopK { tokens: 9, k: 3, ids: ids.clone(), weights: w.clone() };
        let got = layer.forward_with_routing(&xt, &topk).unwrap().to_f32_vec();
        let ids64: Vec<usize> = ids.iter().map(|&i| i as usize).collect();
        let w64: Vec<f64> = w.iter().map(|&v| v as f64).collect();
        let want = moeflow::reference::forward_with_routing(&config, &weights, &x, &ids64, &w64).unwrap();
        let scale = magnitude_scale(&config, &weights, &x, &ids64, &w64);
        for (g, w) in got.iter().zip(&want) {
            assert!((*g as f64 - w).abs() <= tol * scale, "{g} vs {w} ({dtype}, {bf16_matmul:?})");
        }
    }
}

#[test]
fn top_k_equal_to_experts_and_top_1() {
    for (e, k) in [(4, 4), (6, 1), (1, 1)] {
        let config = small_config(13, 7, e, k, RouterConfig::Softmax { renormalize: false }, Activation::GeluErf, None);
        let weights = preset::random_weights(&config, DType::F32, 3);
        let layer = MoeLayer::new(&config, &weights, LayerOptions::default()).unwrap();
        let (x, _) = hidden(7, 13, 4);
        check_against_reference(&config, &weights, &layer, &x, F32_TOL);
    }
}

#[test]
fn router_bias_can_send_every_token_to_one_expert() {
    let config = small_config(24, 8, 16, 2, RouterConfig::TopKSoftmax, Activation::GPT_OSS, None);
    let mut weights = preset::random_weights(&config, DType::BF16, 8);
    let mut bias = vec![0f32; 16];
    bias[9] = 100.0;
    weights.gate_bias = Some(Tensor::from_f32(&[16], bias).unwrap());
    for bf16_matmul in [Bf16Matmul::Widen, Bf16Matmul::Dot] {
        let layer = MoeLayer::new(&config, &weights, LayerOptions { bf16_matmul, ..LayerOptions::default() }).unwrap();
        let (x, xt) = hidden(33, 24, 9);
        let topk = layer.route(&xt).unwrap();
        assert!(topk.ids.chunks(2).all(|c| c[0] == 9), "expert 9 is everyone's first choice");
        check_against_reference(&config, &weights, &layer, &x, variant_tol(DType::BF16, bf16_matmul));
    }
}

#[test]
fn weights_applied_on_input_for_top_1() {
    let mut config = small_config(16, 12, 4, 1, RouterConfig::Softmax { renormalize: false }, Activation::Silu, None);
    config.apply_router_weight_on_input = true;
    let weights = preset::random_weights(&config, DType::F32, 1);
    let layer = MoeLayer::new(&config, &weights, LayerOptions::default()).unwrap();
    let (x, _) = hidden(10, 16, 2);
    check_against_reference(&config, &weights, &layer, &x, F32_TOL);
    config.top_k = 2;
    let weights = preset::random_weights(&config, DType::F32, 1);
    let err = MoeLayer::new(&config, &weights, LayerOptions::default()).err().unwrap().to_string();
    assert!(err.contains("apply_router_weight_on_input needs top-k = 1"), "{err}");
}

#[test]
fn reference_experts_take_the_no_op_reduce_path() {
    let config = small_config(
        10,
        6,
        6,
        2,
        RouterConfig::Softmax { renormalize: true },
        Activation::GeluTanh,
        Some(SharedConfig { inter: 4, gated: true }),
    );
    let weights = preset::random_weights(&config, DType::F32, 4);
    let opts = LayerOptions {
        experts: ExpertsKind::Reference,
        chunk_size: Some(3),
        strategy: Box::new(Local),
        dual_batch: Some(Box::new(Local)),
        ..LayerOptions::default()
    };
    let layer = MoeLayer::new(&config, &weights, opts).unwrap();
    let (x, _) = hidden(8, 10, 5);
    check_against_reference(&config, &weights, &layer, &x, F32_TOL);
}

#[test]
fn chunked_equals_unchunked_bit_for_bit() {
    let config = small_config(
        37,
        21,
        12,
        4,
        RouterConfig::SigmoidGrouped { n_group: 4, topk_group: 2, renormalize: true, scaling: 2.5 },
        Activation::Silu,
        Some(SharedConfig { inter: 9, gated: false }),
    );
    for (dtype, bf16_matmul) in WEIGHT_VARIANTS {
        let weights = preset::random_weights(&config, dtype, 12);
        let (_, xt) = hidden(50, 37, 13);
        let options = |chunk_size| LayerOptions { chunk_size, bf16_matmul, ..LayerOptions::default() };
        let whole = MoeLayer::new(&config, &weights, options(None)).unwrap().forward(&xt).unwrap();
        for chunk in [1, 3, 7, 49, 50, 64] {
            let got = MoeLayer::new(&config, &weights, options(Some(chunk))).unwrap().forward(&xt).unwrap();
            let bits = |t: &Tensor| t.to_f32_vec().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&whole), "chunk {chunk}, {dtype}, {bf16_matmul:?}");
        }
    }
}

#[test]
fn zero_tokens_give_an_empty_output() {
    let config = small_config(
        8,
        4,
        4,
        2,
        RouterConfig::Softmax { renormalize: true },
        Activation::Silu,
        Some(SharedConfig { inter: 4, gated: true }),
    );
    let weights = preset::random_weights(&config, DType::F32, 1);
    let layer = MoeLayer::new(&config, &weights, LayerOptions::default()).unwrap();
    let out = layer.forward(&Tensor::from_f32(&[0, 8], vec![]).unwrap()).unwrap();
    assert_eq!(out.shape(), &[0, 8]);
}

#[test]
fn workspace_is_reused_across_calls() {
    let config = small_config(16, 8, 4, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let weights = preset::random_weights(&config, DType::F32, 1);
    let layer = MoeLayer::new(&config, &weights, LayerOptions::default()).unwrap();
    layer.forward(&hidden(32, 16, 1).1).unwrap();
    let after_large = layer.workspace_bytes();
    assert!(after_large > 0);
    layer.forward(&hidden(4, 16, 2).1).unwrap();
    assert_eq!(layer.workspace_bytes(), after_large, "a smaller call reuses the buffers");
}

fn expect_err<T>(r: Result<T, MoeError>, needles: &[&str]) {
    let Err(e) = r else { panic!("expected an error mentioning {needles:?}") };
    let e = e.to_string();
    for n in needles {
        assert!(e.contains(n), "error '{e}' should mention '{n}'");
    }
}

#[test]
fn bad_input_is_a_clear_error() {
    let config = small_config(8, 4, 4, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let weights = preset::random_weights(&config, DType::F32, 1);
    let layer = MoeLayer::new(&config, &weights, LayerOptions::default()).unwrap();
    // Wrong hidden size.
    expect_err(
        layer.forward(&Tensor::from_f32(&[2, 9], vec![0.0; 18]).unwrap()),
        &["hidden_states", "[T, 8]", "[2, 9]"],
    );
    expect_err(layer.forward(&Tensor::from_i32(&[2, 8], vec![0; 16]).unwrap()), &["hidden_states", "i32"]);
    // NaN input.
    let mut x = vec![0.5f32; 16];
    x[11] = f32::NAN;
    expect_err(layer.forward(&Tensor::from_f32(&[2, 8], x).unwrap()), &["non-finite", "hidden_states", "index 11"]);
    // Expert id out of range.
    let (_, xt) = hidden(2, 8, 1);
    let topk = TopK { tokens: 2, k: 2, ids: vec![0, 1, 3, 4], weights: vec![0.5; 4] };
    expect_err(layer.forward_with_routing(&xt, &topk), &["expert id 4", "0..4", "token 1", "slot 1"]);
    let topk = TopK { tokens: 2, k: 2, ids: vec![0, 1, -1, 2], weights: vec![0.5; 4] };
    expect_err(layer.forward_with_routing(&xt, &topk), &["expert id -1"]);
    // k > E.
    let mut big_k = config.clone();
    big_k.top_k = 5;
    expect_err(MoeLayer::new(&big_k, &weights, LayerOptions::default()), &["top-k 5", "1..=4"]);
    // A NaN router bias is refused when the layer is built.
    let mut nan_bias = weights.clone();
    nan_bias.gate_bias = Some(Tensor::from_f32(&[4], vec![0.0, f32::NAN, 0.0, 0.0]).unwrap());
    expect_err(MoeLayer::new(&config, &nan_bias, LayerOptions::default()), &["non-finite", "router bias", "index 1"]);
    // Finite router weights and inputs whose logits overflow: expert 1's row is all 1e38.
    let mut huge_gate = weights.clone();
    let mut g = huge_gate.gate.to_f32_vec();
    g[8..16].iter_mut().for_each(|v| *v = 1e38);
    huge_gate.gate = Tensor::from_f32(&[4, 8], g).unwrap();
    let layer = MoeLayer::new(&config, &huge_gate, LayerOptions::default()).unwrap();
    let ones = Tensor::from_f32(&[2, 8], vec![1.0; 16]).unwrap();
    expect_err(layer.forward(&ones), &["non-finite", "router logits", "index 1"]);
    // Mismatched weight shapes.
    let mut bad = weights.clone();
    bad.experts.w2 = Tensor::zeros(&[4, 8, 5], DType::F32);
    expect_err(MoeLayer::new(&config, &bad, LayerOptions::default()), &["w2", "[4, 8, 4]", "[4, 8, 5]"]);
    let mut bad = weights.clone();
    bad.gate = Tensor::zeros(&[3, 8], DType::F32);
    expect_err(MoeLayer::new(&config, &bad, LayerOptions::default()), &["router gate", "[4, 8]", "[3, 8]"]);
    let mut bad = weights.clone();
    bad.experts.w13 = Tensor::zeros(&[4, 8, 8], DType::I8);
    expect_err(MoeLayer::new(&config, &bad, LayerOptions::default()), &["w13", "i8"]);
    let mut shared_cfg = config.clone();
    shared_cfg.shared = Some(SharedConfig { inter: 4, gated: false });
    expect_err(MoeLayer::new(&shared_cfg, &weights, LayerOptions::default()), &["no shared weights"]);
    expect_err(
        MoeLayer::new(&config, &weights, LayerOptions { chunk_size: Some(0), ..LayerOptions::default() }),
        &["chunk size"],
    );
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_backend_without_the_feature_is_a_clear_error() {
    let config = small_config(8, 4, 4, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let weights = preset::random_weights(&config, DType::F32, 1);
    let Err(e) = moeflow::backend::cuda::CudaMoeLayer::new(&config, &weights, &Default::default()) else {
        panic!("expected an error")
    };
    assert!(e.to_string().contains("--features cuda"), "{e}");
}
