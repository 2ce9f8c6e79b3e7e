//! The CUDA layer against the f64 reference and the transformers fixtures. Needs the `cuda`
//! feature and a GPU: without a GPU every test prints SKIPPED and checks nothing; CI builds
//! without the feature, where the stand-in's error is tested in tests/layer.rs instead.
#![cfg(feature = "cuda")]

mod common;

use common::*;
use moeflow::backend::cuda::CudaMoeLayer;
use moeflow::model::{io, Checkpoint};
use moeflow::{preset, reference, Activation, DType, MoeConfig, MoeWeights, RouterConfig, SharedConfig, Tensor};

/// bf16 path: activations rounded to bf16 before each GEMM and GEMM outputs stored in bf16
/// (8 significand bits: 2^-8 ≈ 4e-3 per rounding, a few roundings in sequence).
const BF16_TOL: f64 = 2.5e-2;

/// fp8 e4m3 rows (3 significand bits: up to 2^-4 relative per value) before both expert GEMMs.
const FP8_ROWS_TOL: f64 = 8e-2;

fn layer(config: &MoeConfig, weights: &MoeWeights) -> Option<CudaMoeLayer> {
    match CudaMoeLayer::new(config, weights, &Default::default()) {
        Ok(l) => Some(l),
        Err(e) if e.to_string().contains("no CUDA driver") || e.to_string().contains("device 0 requested") => {
            eprintln!("SKIPPED (no GPU): {e}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// The quantization kernels on GPU 0, or `None` (saying SKIPPED) without a GPU.
fn quant_kernels() -> Option<moeflow::backend::cuda::CudaQuant> {
    match moeflow::backend::cuda::CudaQuant::new() {
        Ok(g) => Some(g),
        Err(e) => {
            eprintln!("SKIPPED (no GPU): {e}");
            None
        }
    }
}

fn rel(got: &[f32], want: &[f64]) -> f64 {
    let scale = want.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
    got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).abs()).fold(0.0, f64::max) / scale
}

#[test]
fn every_router_and_activation_matches_reference() {
    let cases = [
        (RouterConfig::Softmax { renormalize: true }, Activation::Silu, None, 8, 2),
        (RouterConfig::Softmax { renormalize: false }, Activation::GeluErf, None, 7, 1),
        (RouterConfig::TopKSoftmax, Activation::GPT_OSS, None, 12, 4),
        (
            RouterConfig::SigmoidGrouped { n_group: 4, topk_group: 2, renormalize: true, scaling: 2.5 },
            Activation::Silu,
            Some(SharedConfig { inter: 40, gated: false }),
            16,
            6,
        ),
        (
            RouterConfig::SoftmaxGrouped { n_group: 4, topk_group: 2, renormalize: false, scaling: 16.0 },
            Activation::GeluTanh,
            Some(SharedConfig { inter: 24, gated: true }),
            16,
            3,
        ),
    ];
    for (router, act, shared, e, k) in cases {
        // Hidden 200 and intermediate 72: not multiples of 128.
        let config = small_config(200, 72, e, k, router.clone(), act, shared);
        let weights = preset::random_weights(&config, DType::BF16, 5);
        let Some(gpu) = layer(&config, &weights) else { return };
        for tokens in [0, 1, 7, 300] {
            let (x, xt) = hidden(tokens, 200, tokens as u64 + 9);
            let got = gpu.forward(&xt).unwrap().to_f32_vec();
            assert_eq!(got.len(), tokens * 200);
            if tokens == 0 {
                continue;
            }
            let want = reference::forward(&config, &weights, &x).unwrap().out;
            let err = rel(&got, &want);
            println!("{router:?} {act:?} T {tokens}: relative error {err:.2e}");
            assert!(err <= BF16_TOL, "{router:?} {act:?} T {tokens}: {err:e}");
            // The same result run after run.
            assert_eq!(gpu.forward(&xt).unwrap().to_f32_vec(), got);
        }
    }
}

/// The router on the tensor cores inside the whole layer, where the layer takes it (128 experts and
/// more, or 64 with a gate of bf16 values on Hopper): its depth splits and their sum, and the
/// tokens' bf16 copy it writes, which the experts and the shared expert then read. Against the f64
/// reference and beside the same layer on cuBLAS's f32 router (`router_tf32: false`), from 1 token
/// (256 experts are past the one-launch router) to several token tiles; hidden 264 is not a
/// multiple of the router's 32-column stage; the same bits run after run.
#[test]
fn tensor_core_router_in_the_layer_matches_the_reference() {
    use moeflow::backend::cuda::CudaOptions;
    let router = RouterConfig::DEEPSEEK_V3;
    let shared = Some(SharedConfig { inter: 64, gated: false });
    // f32 gates, and gates of bf16 values as checkpoints store them (two products a product
    // on Hopper, which then also routes 64 experts on the tensor cores).
    for (experts, bf16_gate) in [(256, false), (256, true), (64, true)] {
        let config = small_config(264, 64, experts, 8, router.clone(), Activation::Silu, shared);
        let mut weights = preset::random_weights(&config, DType::BF16, 21);
        if bf16_gate {
            let rounded = weights.gate.to_f32_vec().iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
            weights.gate = Tensor::from_f32(weights.gate.shape(), rounded).unwrap();
        }
        let Some(gpu) = layer(&config, &weights) else { return };
        let cublas =
            CudaMoeLayer::new(&config, &weights, &CudaOptions { router_tf32: false, ..Default::default() }).unwrap();
        for tokens in [1, 5, 130, 1000] {
            let case = format!("{experts} experts, bf16 gate {bf16_gate}, T {tokens}");
            let (x, xt) = hidden(tokens, 264, tokens as u64 + 3);
            let want = reference::forward(&config, &weights, &x).unwrap().out;
            let got = gpu.forward(&xt).unwrap().to_f32_vec();
            let (err, err_cublas) = (rel(&got, &want), rel(&cublas.forward(&xt).unwrap().to_f32_vec(), &want));
            println!("tensor-core router, {case}: relative error {err:.2e} (cuBLAS's router {err_cublas:.2e})");
            assert!(err <= BF16_TOL, "{case}: relative error {err:e}");
            assert_eq!(gpu.forward(&xt).unwrap().to_f32_vec(), got, "{case}: the same result run after run");
        }
    }
}

/// Hidden sizes wide enough that a small batch's combine spreads each token over several
/// blocks (more than 256 chunks of 8 columns, or of single columns when H % 8 != 0), with a
/// shared expert, against the reference; a batch past the spread too.
#[test]
fn wide_tokens_of_small_batches_match_reference() {
    let shared = Some(SharedConfig { inter: 32, gated: true });
    for h in [4104, 2050] {
        let config = small_config(h, 48, 8, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, shared);
        let weights = preset::random_weights(&config, DType::BF16, 12);
        let Some(gpu) = layer(&config, &weights) else { return };
        for tokens in [1, 3, 600] {
            let (x, xt) = hidden(tokens, h, tokens as u64 + 40);
            let got = gpu.forward(&xt).unwrap().to_f32_vec();
            let want = reference::forward(&config, &weights, &x).unwrap().out;
            let err = rel(&got, &want);
            println!("H {h} T {tokens}: relative error {err:.2e}");
            assert!(err <= BF16_TOL, "H {h} T {tokens}: {err:e}");
        }
    }
}

/// The timed forward counts the experts that received rows (the bench's weight-read floor):
/// one token reaches exactly its top-k experts, 300 tokens all 16.
#[test]
fn timed_forward_counts_the_experts_used() {
    let config = small_config(64, 32, 16, 4, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let weights = preset::random_weights(&config, DType::BF16, 3);
    let Some(gpu) = layer(&config, &weights) else { return };
    for seed in 0..4 {
        assert_eq!(gpu.forward_timed(1, seed).unwrap().experts_used, 4, "one token, seed {seed}");
    }
    assert_eq!(gpu.forward_timed(300, 1).unwrap().experts_used, 16);
}

#[test]
fn one_hot_expert_and_unused_experts() {
    let config = small_config(64, 32, 10, 2, RouterConfig::TopKSoftmax, Activation::GPT_OSS, None);
    let mut weights = preset::random_weights(&config, DType::BF16, 6);
    let mut bias = vec![0f32; 10];
    bias[3] = 60.0;
    weights.gate_bias = Some(Tensor::from_f32(&[10], bias).unwrap());
    let Some(gpu) = layer(&config, &weights) else { return };
    let (x, xt) = hidden(513, 64, 1);
    let err = rel(&gpu.forward(&xt).unwrap().to_f32_vec(), &reference::forward(&config, &weights, &x).unwrap().out);
    println!("one hot expert: relative error {err:.2e}");
    assert!(err <= BF16_TOL);
}

#[test]
fn dual_batch_halves_match_the_reference() {
    let grouped = RouterConfig::SigmoidGrouped { n_group: 4, topk_group: 2, renormalize: true, scaling: 2.5 };
    let shared = Some(SharedConfig { inter: 48, gated: true });
    let config = small_config(136, 80, 16, 6, grouped, Activation::Silu, shared);
    let weights = preset::random_weights(&config, DType::BF16, 8);
    let Some(gpu) = layer(&config, &weights) else { return };
    let dual = gpu.dual_batch(None).unwrap();
    // Odd, one token (the second half empty), none, and enough rows for the per-expert GEMMs.
    for (t, seed) in [(37, 1), (1, 2), (0, 3), (2049, 4)] {
        let (x, xt) = hidden(t, 136, seed);
        let got = dual.forward(&xt).unwrap().to_f32_vec();
        assert_eq!(got.len(), t * 136);
        if t > 0 {
            let err = rel(&got, &reference::forward(&config, &weights, &x).unwrap().out);
            println!("dual-batch, {t} tokens: relative error {err:.2e}");
            assert!(err <= BF16_TOL, "{t} tokens: relative error {err:e}");
        }
    }
    let times = dual.forward_timed(300, 9).unwrap();
    assert!(times.total > 0.0 && times.total.is_finite());
}

/// A batch large enough for the bf16 copy to run beside the router GEMM (T · H ≥ 2^23), with
/// 512 rows per expert (on Hopper the wgmma GEMM with the activation in its epilogue, cuBLAS's
/// per-expert GEMMs elsewhere) and a gated shared expert on the side stream too.
#[test]
fn large_batch_matches_reference() {
    let shared = Some(SharedConfig { inter: 32, gated: true });
    let softmax = RouterConfig::Softmax { renormalize: true };
    let config = small_config(2048, 32, 16, 2, softmax, Activation::Silu, shared);
    let weights = preset::random_weights(&config, DType::BF16, 10);
    let Some(gpu) = layer(&config, &weights) else { return };
    let (x, xt) = hidden(4096, 2048, 11);
    let got = gpu.forward(&xt).unwrap().to_f32_vec();
    let err = rel(&got, &reference::forward(&config, &weights, &x).unwrap().out);
    println!("4096 tokens, hidden 2048: relative error {err:.2e}");
    assert!(err <= BF16_TOL, "relative error {err:e}");
    assert_eq!(gpu.forward(&xt).unwrap().to_f32_vec(), got, "differs run to run");
}

/// 2048 rows an expert without a shared expert (4096 tokens, top-2 of 4 experts), which one
/// Hopper GPU gives moeflow's grouped GEMM (cuBLAS above 1024 rows with a shared expert):
/// against the reference, and the same bits run after run.
#[test]
fn experts_of_2048_rows_without_a_shared_expert_match_reference() {
    let softmax = RouterConfig::Softmax { renormalize: true };
    let config = small_config(2048, 32, 4, 2, softmax, Activation::Silu, None);
    let weights = preset::random_weights(&config, DType::BF16, 12);
    let Some(gpu) = layer(&config, &weights) else { return };
    let (x, xt) = hidden(4096, 2048, 13);
    let got = gpu.forward(&xt).unwrap().to_f32_vec();
    let err = rel(&got, &reference::forward(&config, &weights, &x).unwrap().out);
    println!("4096 tokens over 4 experts, top-2: relative error {err:.2e}");
    assert!(err <= BF16_TOL, "relative error {err:e}");
    assert_eq!(gpu.forward(&xt).unwrap().to_f32_vec(), got, "differs run to run");
}

/// The fixtures: `MOEFLOW_FIXTURES`, the source tree this was built from, or `./fixtures`.
fn fixtures() -> std::path::PathBuf {
    if let Ok(d) = std::env::var("MOEFLOW_FIXTURES") {
        return d.into();
    }
    let built = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    if built.exists() {
        built
    } else {
        "fixtures".into()
    }
}

#[test]
fn fixtures_through_the_gpu() {
    for name in [
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
        "olmoe",
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v3_fp8",
        "deepseek_v3_fp8_128",
        "gpt_oss",
        "gpt_oss_mxfp4",
    ] {
        let dir = fixtures().join(name);
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
        let block = Checkpoint::open(&dir)
            .unwrap()
            .load_moe_block(Some(meta["layer"].as_u64().unwrap() as usize), DType::BF16)
            .unwrap();
        let Some(gpu) = layer(&block.config, &block.weights) else { return };
        let x = io::read_hidden_states(&dir.join("input.safetensors"), "hidden_states").unwrap();
        let want: Vec<f64> =
            io::read_hidden_states(&dir.join("expected.safetensors"), "hidden_states").unwrap().to_f64_vec();
        let err = rel(&gpu.forward(&x).unwrap().to_f32_vec(), &want);
        println!("fixture {name}: relative error {err:.2e} (weights rounded to bf16)");
        assert!(err <= BF16_TOL, "{name}: {err:e}");
    }
}

/// The DeepSeek-V3 fp8 checkpoint with 128 × 128 blocks through the GPU layer as stored: the
/// checkpoint's own codes and scales for the experts, with bf16 rows (W8A16) within bf16
/// rounding of transformers on the dequantized weights, and with fp8 rows too (W8A8; on Hopper
/// the fp8 grouped GEMM, 48 rows an expert, and the bf16 GEMMs on the same values; the shared
/// expert in bf16 and, quantized back to its own codes, in fp8) within fp8 rows' bound.
#[test]
fn fp8_checkpoint_through_the_gpu_as_stored() {
    use moeflow::backend::cuda::CudaOptions;
    let dir = fixtures().join("deepseek_v3_fp8_128");
    let block = Checkpoint::open(&dir).unwrap().load_moe_block_quantized(Some(1)).unwrap();
    let Some(probe) = layer(&block.config, &block.weights) else { return };
    assert!(probe.has_fp8_experts(), "the checkpoint's fp8 codes uploaded as they are");
    let x = io::read_hidden_states(&dir.join("input.safetensors"), "hidden_states").unwrap();
    let want: Vec<f64> =
        io::read_hidden_states(&dir.join("expected.safetensors"), "hidden_states").unwrap().to_f64_vec();
    let err = rel(&probe.forward(&x).unwrap().to_f32_vec(), &want);
    println!("deepseek_v3_fp8_128, fp8 experts and bf16 rows: relative error {err:.2e}");
    for (fp8_gemm, fp8_shared) in [(false, false), (true, false), (true, true)] {
        let opts = CudaOptions { fp8_gemm, ..Default::default() };
        let mut gpu = CudaMoeLayer::new(&block.config, &block.weights, &opts).unwrap().fp8_activations().unwrap();
        if fp8_shared {
            gpu = gpu.fp8_shared_expert().unwrap();
        }
        let w8a8 = rel(&gpu.forward(&x).unwrap().to_f32_vec(), &want);
        // Timed stage by stage (a graph replay would not name its experts).
        let experts = gpu.forward_timed_stages(x.shape()[0], 3).unwrap().experts;
        let shared = gpu.shared_expert_gemm().unwrap();
        println!("deepseek_v3_fp8_128 as W8A8 ({experts}, shared expert on {shared}): relative error {w8a8:.2e}");
        assert!(w8a8 <= FP8_ROWS_TOL, "W8A8 ({experts}): relative error {w8a8:e}");
        if fp8_gemm && gpu.has_fp8_gemm() {
            assert_eq!(experts, "hopper-fp8");
        }
    }
    assert!(err <= BF16_TOL, "W8A16: relative error {err:e}");
}

#[test]
fn quantization_kernels_match_the_cpu_bit_for_bit() {
    use moeflow::quant::{dequantize, quantize, QuantConfig};
    let Some(gpu) = quant_kernels() else { return };
    for q in [QuantConfig::Int8, QuantConfig::Fp8, QuantConfig::Fp8Block, QuantConfig::Mxfp8] {
        for h in [1usize, 33, 300, 7168] {
            // Rows of very different magnitudes, an all-zero row, and values deep in e4m3's
            // subnormal range relative to their row's maximum.
            let mut x = preset::uniform(6 * h, 1.0, h as u64);
            for (r, row) in x.chunks_mut(h).enumerate() {
                let scale = [1.0, 1e3, 1e-3, 0.0, 37.5, 1.0][r];
                row.iter_mut().for_each(|v| *v *= scale);
            }
            x[5 * h] = 1e4;
            let cpu = quantize(q, &x, h).unwrap();
            let dev = gpu.quantize(q, &x, h).unwrap();
            assert_eq!(dev.scales, cpu.scales, "{q} h {h}: scales");
            assert_eq!(dev.data, cpu.data, "{q} h {h}: codes");
            assert_eq!(gpu.dequantize(&cpu).unwrap(), dequantize(&cpu), "{q} h {h}: dequantize");
        }
        println!("{q}: codes, scales and dequantized values identical to the CPU");
    }
}

/// bf16 rows through the kernel the layers run on their bf16 activations (`quantize_rows_bf16`)
/// get the CPU's codes and scales bit for bit: every format on random rows, and, in groups of
/// 128 (where the kernel takes each quotient from a product and two FMAs rather than a
/// division; fp8 per 128, and int8 in rows of 128), every pair of bf16 significands: the
/// group's largest value a, its binade varied from 2^-40 to 2^40, then a value of each other
/// significand 0 to 21 binades below a, signs alternating; also zeros of both signs, and
/// groups past 2^±60, which divide.
#[test]
fn quantization_of_bf16_rows_matches_the_cpu_for_every_pair_of_significands() {
    use half::bf16;
    use moeflow::quant::{quantize, QuantConfig};
    let Some(gpu) = quant_kernels() else { return };
    let widen = |x: &[bf16]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
    let same = |q: QuantConfig, x: &[bf16], h: usize, what: &str| {
        let (cpu, dev) = (quantize(q, &widen(x), h).unwrap(), gpu.quantize_bf16(q, x, h).unwrap());
        assert_eq!(dev.scales, cpu.scales, "{q}, {what}: scales");
        let wrong = dev.data.iter().zip(&cpu.data).filter(|(a, b)| a != b).count();
        assert_eq!(wrong, 0, "{q}, {what}: {wrong} of {} codes differ from the CPU's", x.len());
    };
    for q in [QuantConfig::Int8, QuantConfig::Fp8, QuantConfig::Fp8Block, QuantConfig::Mxfp8] {
        for h in [1usize, 33, 300, 7168] {
            let mut x = preset::uniform(6 * h, 1.0, h as u64);
            for (r, row) in x.chunks_mut(h).enumerate() {
                row.iter_mut().for_each(|v| *v *= [1.0, 1e3, 1e-3, 0.0, 37.5, 1.0][r]);
            }
            same(q, &x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>(), h, &format!("random rows of {h}"));
        }
    }
    // Significand i (0 to 127) in binade e.
    let value = |i: u16, e: i32| bf16::from_f32((1.0 + i as f32 / 128.0) * 2f32.powi(e));
    let group = |a: u16, e: i32, d: i32| {
        let below =
            (0..128u16).filter(move |&i| i != a).map(move |i| value(i, e - if d == 0 && i > a { 1 } else { d }));
        std::iter::once(value(a, e)).chain(below.enumerate().map(|(j, v)| if j % 2 == 1 { -v } else { v }))
    };
    let mut x: Vec<bf16> = (0..128u16)
        .flat_map(|a| (0..22).flat_map(move |d| group(a, (a as i32 * 7 + d * 3) % 81 - 40, d)))
        .chain((0..8u16).flat_map(|a| [-70, 70].into_iter().flat_map(move |e| group(a * 16, e, 2))))
        .collect();
    x.push(bf16::ONE);
    x.extend((1..128).map(|j| if j % 2 == 1 { bf16::NEG_ZERO } else { bf16::ZERO }));
    let h = 128 * 9;
    x.resize(x.len().div_ceil(h) * h, bf16::ZERO);
    same(QuantConfig::Fp8Block, &x, h, "every pair of significands");
    // int8 takes one scale a row: rows of 128 are the same groups.
    same(QuantConfig::Int8, &x, 128, "every pair of significands");
    println!("bf16 rows: codes and scales identical to the CPU, {} values per 128 among them", x.len());
}

/// Values whose quotient by their group's scale lies within a few units in the last place of a
/// point where the code changes (a midpoint between two e4m3 codes, or k + ½ for int8) get the
/// CPU's codes. There the product with the scale's reciprocal, cheaper than the division, can
/// give another code than the division the CPU does; the test counts such values first, so
/// that a kernel that multiplied would fail it (docs/tuning.md).
#[test]
fn quantization_kernels_divide_where_the_code_changes() {
    use moeflow::quant::{fp8_e4m3_encode, quantize, QuantConfig};
    let Some(gpu) = quant_kernels() else { return };
    let e4m3_midpoints: Vec<f32> = (-6..9)
        .flat_map(|e| (0..8).map(move |k| (1.0 + (2 * k + 1) as f32 / 16.0) * 2f32.powi(e)))
        .chain((0..8).map(|k| (2 * k + 1) as f32 * 2f32.powi(-10)))
        .filter(|&m| m < 448.0)
        .collect();
    let int8_midpoints: Vec<f32> = (0..127).map(|k| k as f32 + 0.5).collect();
    let h = 1024;
    for (q, top, midpoints) in [
        (QuantConfig::Int8, 127.0f32, &int8_midpoints),
        (QuantConfig::Fp8, 448.0, &e4m3_midpoints),
        (QuantConfig::Fp8Block, 448.0, &e4m3_midpoints),
    ] {
        let code = |v: f32| match q {
            QuantConfig::Int8 => v.round().clamp(-127.0, 127.0) as i8 as u8,
            _ => fp8_e4m3_encode(v),
        };
        let (mut x, mut differ) = (Vec::new(), 0);
        for amax in [3.0f32, 0.79, 1.37e-3, 123.4, 5.9e4, 2.5e-30] {
            let s = amax / top;
            let y = 1.0 / s;
            // Within 3 units in the last place of each midpoint's multiple of s, both signs;
            // those whose product and quotient get different codes first.
            let mut near: Vec<(bool, f32)> = midpoints
                .iter()
                .flat_map(|&m| {
                    let at = (m * s).to_bits() as i64;
                    (-3..=3).map(move |d| f32::from_bits((at + d) as u32))
                })
                .filter(|v| v.abs() < amax)
                .flat_map(|v| [v, -v])
                .map(|v| (code(v * y) != code(v / s), v))
                .collect();
            near.sort_by_key(|&(d, _)| !d);
            differ += near.iter().filter(|&&(d, _)| d).count();
            // Rows whose 128-value groups each start with amax, so every group's scale is s.
            for row in near.chunks(h - h / 128) {
                let mut values = row.iter().map(|&(_, v)| v);
                x.extend((0..h).map(|i| if i % 128 == 0 { amax } else { values.next().unwrap_or(0.0) }));
            }
        }
        assert!(differ >= 20, "{q}: only {differ} values whose product and quotient get different codes");
        let cpu = quantize(q, &x, h).unwrap();
        let dev = gpu.quantize(q, &x, h).unwrap();
        assert_eq!(dev.scales, cpu.scales, "{q}: scales");
        let wrong = dev.data.iter().zip(&cpu.data).filter(|(a, b)| a != b).count();
        assert_eq!(wrong, 0, "{q}: {wrong} of {} codes differ from the CPU's", x.len());
        println!(
            "{q}: {} values near code boundaries ({differ} where the product's code is wrong) as on the CPU",
            x.len()
        );
    }
}

/// Experts quantized to fp8 on the device (128 × 128 blocks, with partial blocks at both edges)
/// compute, through the fp8 masked GEMM, what the CPU's fp8 quantization of the same weights
/// gives.
#[test]
fn fp8_experts_quantized_on_the_device_match_the_cpu_quantization() {
    let config = small_config(
        208,
        80,
        6,
        2,
        RouterConfig::Softmax { renormalize: true },
        Activation::Silu,
        Some(SharedConfig { inter: 40, gated: false }),
    );
    let weights = preset::random_weights(&config, DType::BF16, 8);
    let Some(layer) = layer(&config, &weights) else { return };
    let layer = layer.fp8_experts().unwrap();
    assert!(layer.has_fp8_experts());
    let mut quantized = weights.clone();
    quantized.experts = weights.experts.quantized(moeflow::quant::WeightQuant::Fp8Block(128)).unwrap();
    let (x, xt) = hidden(33, config.hidden, 9);
    let got = layer.forward(&xt).unwrap().to_f32_vec();
    let want = reference::forward(&config, &quantized, &x).unwrap().out;
    let err = rel(&got, &want);
    // Against the unquantized weights the error is far larger: the comparison can tell.
    let unquantized = rel(&got, &reference::forward(&config, &weights, &x).unwrap().out);
    eprintln!("fp8 experts: relative error {err:.2e} (against the bf16 weights: {unquantized:.2e})");
    assert!(err <= BF16_TOL, "relative error {err:e}");
    assert!(unquantized > 1.5 * err, "{unquantized:e} vs {err:e}");
    // W8A8: the GEMM rows quantized to fp8 too (a scale per 128 values), also past 32 rows per
    // expert (200 tokens), where bf16 rows would go to cuBLAS. fp8 rows add about 2^-5 of
    // noise per value, so the error is larger, and can be told apart from W8A16's.
    let layer = layer.fp8_activations().unwrap();
    assert!(layer.has_fp8_activations());
    for (t, seed) in [(33, 9), (200, 10)] {
        let (x, xt) = hidden(t, config.hidden, seed);
        let got = layer.forward(&xt).unwrap().to_f32_vec();
        let w8a8 = rel(&got, &reference::forward(&config, &quantized, &x).unwrap().out);
        eprintln!("fp8 experts and fp8 rows, {t} tokens: relative error {w8a8:.2e}");
        assert!(w8a8 <= FP8_ROWS_TOL, "{t} tokens: relative error {w8a8:e}");
        if t == 33 {
            assert!(w8a8 > 1.5 * err, "fp8 rows {w8a8:e} vs bf16 rows {err:e}");
        }
    }
}

/// A W8A8 layer on GPU 0: fp8 experts (quantized on the device) and fp8 rows, with `opts`.
fn w8a8_layer(config: &MoeConfig, weights: &MoeWeights, opts: &moeflow::backend::cuda::CudaOptions) -> CudaMoeLayer {
    CudaMoeLayer::new(config, weights, opts).unwrap().fp8_experts().unwrap().fp8_activations().unwrap()
}

/// W8A8 experts on the fp8 tensor cores (the fp8 Hopper GEMM, 125 rows an expert): against
/// the reference on the quantized weights within fp8 rows' bound, against the bf16 GEMMs on the
/// same quantized values (the W8A8 rounding) within bf16 rounding, and the same bits run after
/// run, as the layer that quantizes the activation in the up projection's epilogue instead of
/// a pass of its own, and as the layer that copies the up projection's rows in expert order
/// where the GEMM gathers them (1000 tokens, and 3 replayed from a graph). At 48 tokens (6
/// rows an expert) the 64-row tiles run two blocks an SM, with the bits of one block an SM,
/// within fp8 rows' bound of the reference. Widths that the kernel's tiles do not divide
/// (hidden 272: two 128-deep stages and a part). Skips on GPUs other than Hopper, saying so.
#[test]
fn w8a8_experts_on_the_fp8_tensor_cores_match_the_reference() {
    use moeflow::backend::cuda::CudaOptions;
    let shared = Some(SharedConfig { inter: 64, gated: true });
    let config = small_config(272, 128, 16, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, shared);
    let weights = preset::random_weights(&config, DType::BF16, 21);
    let Some(probe) = layer(&config, &weights) else { return };
    if !probe.has_fp8_gemm() {
        eprintln!(
            "SKIPPED w8a8_experts_on_the_fp8_tensor_cores_match_the_reference: {} is not a Hopper GPU",
            probe.device_name()
        );
        return;
    }
    let mut quantized = weights.clone();
    quantized.experts = weights.experts.quantized(moeflow::quant::WeightQuant::Fp8Block(128)).unwrap();
    let w8a8 = |fp8_gemm: bool| w8a8_layer(&config, &weights, &CudaOptions { fp8_gemm, ..Default::default() });
    let (tensor_cores, bf16_gemms) = (w8a8(true), w8a8(false));
    let epilogue = w8a8_layer(&config, &weights, &CudaOptions { fp8_act_epilogue: true, ..Default::default() });
    let (x, xt) = hidden(1000, config.hidden, 22);
    let got = tensor_cores.forward(&xt).unwrap().to_f32_vec();
    assert_eq!(tensor_cores.forward_timed(1000, 1).unwrap().experts, "hopper-fp8");
    assert_ne!(bf16_gemms.forward_timed(1000, 1).unwrap().experts, "hopper-fp8");
    let err = rel(&got, &reference::forward(&config, &quantized, &x).unwrap().out);
    let rounded = bf16_gemms.forward(&xt).unwrap().to_f32_vec();
    let apart = rel(&got, &rounded.iter().map(|&v| v as f64).collect::<Vec<_>>());
    eprintln!("W8A8 on the fp8 tensor cores, 1000 tokens: relative error {err:.2e}, {apart:.2e} from the bf16 GEMMs");
    assert!(err <= FP8_ROWS_TOL, "relative error {err:e}");
    assert!(apart <= BF16_TOL, "{apart:e} from the bf16 GEMMs on the same values");
    assert_eq!(tensor_cores.forward(&xt).unwrap().to_f32_vec(), got, "differs run to run");
    assert_eq!(epilogue.forward(&xt).unwrap().to_f32_vec(), got, "activation quantized in the epilogue");
    let (_, three) = hidden(3, config.hidden, 23);
    let want = tensor_cores.forward(&three).unwrap().to_f32_vec();
    assert_eq!(epilogue.forward(&three).unwrap().to_f32_vec(), want, "3 tokens: quantized in the epilogue");
    let copied = w8a8_layer(&config, &weights, &CudaOptions { fp8_row_copy: Some(true), ..Default::default() });
    assert_eq!(copied.forward(&xt).unwrap().to_f32_vec(), got, "rows copied in expert order");
    assert_eq!(copied.forward(&three).unwrap().to_f32_vec(), want, "3 tokens: rows copied in expert order");
    let one_block = w8a8_layer(&config, &weights, &CudaOptions { gemm_tile_blocks: Some(1), ..Default::default() });
    let (x48, x48t) = hidden(48, config.hidden, 24);
    let two = tensor_cores.forward(&x48t).unwrap().to_f32_vec();
    assert_eq!(one_block.forward(&x48t).unwrap().to_f32_vec(), two, "48 tokens: two blocks an SM against one");
    let err = rel(&two, &reference::forward(&config, &quantized, &x48).unwrap().out);
    assert!(err <= FP8_ROWS_TOL, "48 tokens: relative error {err:e}");
}

/// A W8A8 layer's fp8 shared expert (`fp8_shared_expert`): its weights quantized like the
/// routed experts' and its rows to fp8 too. Against the reference on the quantized weights
/// (routed and shared) within fp8 rows' bound; on the fp8 tensor cores (Hopper) within bf16
/// rounding of bf16 GEMMs on the same fp8 values; visibly apart from the layer whose shared
/// expert multiplies bf16 rows; the same bits run after run. One token (a graph replay) and
/// 1000 (a direct run); and asked for on a layer that has run already.
#[test]
fn fp8_shared_expert_matches_the_reference() {
    use moeflow::backend::cuda::CudaOptions;
    use moeflow::quant::WeightQuant;
    let shared = Some(SharedConfig { inter: 128, gated: true });
    let config = small_config(272, 128, 16, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, shared);
    let weights = preset::random_weights(&config, DType::BF16, 23);
    let Some(probe) = layer(&config, &weights) else { return };
    let mut quantized = weights.clone();
    quantized.experts = weights.experts.quantized(WeightQuant::Fp8Block(128)).unwrap();
    let sh = quantized.shared.as_mut().unwrap();
    sh.mlp = sh.mlp.quantized(WeightQuant::Fp8Block(128)).unwrap();
    let w8a8 = |fp8_gemm: bool| w8a8_layer(&config, &weights, &CudaOptions { fp8_gemm, ..Default::default() });
    let bf16_shared = w8a8(true);
    assert!(!bf16_shared.has_fp8_shared_expert());
    let (tensor_cores, bf16_gemms) =
        (w8a8(true).fp8_shared_expert().unwrap(), w8a8(false).fp8_shared_expert().unwrap());
    assert!(tensor_cores.has_fp8_shared_expert());
    let on = tensor_cores.shared_expert_gemm().unwrap();
    assert_eq!(on == "hopper-fp8", probe.has_fp8_gemm(), "the shared expert ran on {on}");
    assert_eq!(bf16_gemms.shared_expert_gemm(), Some("cublas"));
    for (t, seed) in [(1, 24), (1000, 25)] {
        let (x, xt) = hidden(t, config.hidden, seed);
        let got = tensor_cores.forward(&xt).unwrap().to_f32_vec();
        let err = rel(&got, &reference::forward(&config, &quantized, &x).unwrap().out);
        let rounded = bf16_gemms.forward(&xt).unwrap().to_f32_vec();
        let apart = rel(&got, &rounded.iter().map(|&v| v as f64).collect::<Vec<_>>());
        let bf16_rows = bf16_shared.forward(&xt).unwrap().to_f32_vec();
        let from_bf16 = rel(&got, &bf16_rows.iter().map(|&v| v as f64).collect::<Vec<_>>());
        eprintln!(
            "fp8 shared expert on {on}, {t} tokens: relative error {err:.2e}, {apart:.2e} from bf16 GEMMs on the same \
             values, {from_bf16:.2e} from a bf16 shared expert"
        );
        assert!(err <= FP8_ROWS_TOL, "{t} tokens: relative error {err:e}");
        assert!(apart <= BF16_TOL, "{t} tokens: {apart:e} from the bf16 GEMMs on the same values");
        assert!(from_bf16 > 2.0 * apart, "{t} tokens: {from_bf16:e} from a bf16 shared expert, {apart:e}");
        assert_eq!(tensor_cores.forward(&xt).unwrap().to_f32_vec(), got, "{t} tokens: differs run to run");
    }
    // Asked for after the layer has run (its buffers, graphs and cuBLAS workspaces in place):
    // the next call replaces the buffers and gives the same bits.
    let (_, one) = hidden(1, config.hidden, 24);
    let late = w8a8(true);
    late.forward(&one).unwrap();
    let late = late.fp8_shared_expert().unwrap();
    let want = tensor_cores.forward(&one).unwrap().to_f32_vec();
    assert_eq!(late.forward(&one).unwrap().to_f32_vec(), want, "fp8 shared expert asked for after a run");
}

/// Deterministic mode on one GPU: a token's output has the same bits alone, in small batches
/// (CUDA graphs), and anywhere in a batch of 4096; and stays within bf16 rounding of the
/// reference. Every router kind with a shared expert and biases; 32 experts take the
/// fixed-order router GEMM, 128 the tensor cores' (its depth in fixed blocks, the last one
/// partly filled at a width of 264).
#[test]
fn deterministic_tokens_have_the_same_bits_in_any_batch() {
    use moeflow::backend::cuda::CudaOptions;
    let det = CudaOptions { deterministic: true, ..Default::default() };
    let grouped = RouterConfig::SigmoidGrouped { n_group: 4, topk_group: 2, renormalize: true, scaling: 2.5 };
    let cases = [
        (grouped.clone(), Activation::Silu, Some(SharedConfig { inter: 64, gated: false }), 256, 32),
        (RouterConfig::TopKSoftmax, Activation::GPT_OSS, None, 256, 32),
        (
            RouterConfig::Softmax { renormalize: true },
            Activation::Silu,
            Some(SharedConfig { inter: 48, gated: true }),
            256,
            32,
        ),
        (grouped, Activation::Silu, Some(SharedConfig { inter: 64, gated: false }), 264, 128),
        (RouterConfig::TopKSoftmax, Activation::GPT_OSS, None, 512, 128),
    ];
    for (router, act, shared, h, e) in cases {
        let config = small_config(h, 128, e, 4, router, act, shared);
        let weights = preset::random_weights(&config, DType::BF16, 12);
        let Some(_) = layer(&config, &weights) else { return };
        let one = match CudaMoeLayer::new(&config, &weights, &det) {
            Ok(l) => l,
            Err(e) if e.to_string().contains("compute capability 9.0") => {
                eprintln!("SKIPPED deterministic_tokens_have_the_same_bits_in_any_batch: {e}");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        let h = config.hidden;
        let (x, xt) = hidden(4096, h, 31);
        let all: Vec<u32> = one.forward(&xt).unwrap().to_f32_vec().iter().map(|v| v.to_bits()).collect();
        let want = reference::forward(&config, &weights, &x).unwrap().out;
        let got: Vec<f32> = all.iter().map(|&b| f32::from_bits(b)).collect();
        assert!(rel(&got, &want) <= BF16_TOL, "{:?}: relative error {:e}", config.router, rel(&got, &want));
        for (a, t) in [(0usize, 1usize), (4095, 1), (10, 3), (64, 8), (1000, 64), (2000, 513)] {
            let xs = Tensor::from_f32(&[t, h], x[a * h..(a + t) * h].to_vec()).unwrap();
            let part: Vec<u32> = one.forward(&xs).unwrap().to_f32_vec().iter().map(|v| v.to_bits()).collect();
            assert!(
                part == all[a * h..(a + t) * h],
                "{:?}: tokens {a}..{} differ from the batch",
                config.router,
                a + t
            );
        }
        eprintln!("deterministic {:?}: every slice has the batch's bits", config.router);
    }
}
