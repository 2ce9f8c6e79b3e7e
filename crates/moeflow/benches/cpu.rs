//! `cargo bench -p moeflow --bench cpu`: the CPU path's kernels and layer, timed by divan.
//!
//! Throughput is in FLOPs ("items" per second), to read against this machine's ceilings,
//! which the bench measures and prints first: the dense f32 matmul rate of an independent
//! tuned kernel (the `gemm` crate), the AVX2 FMA peak and the AVX512-BF16 dot-product peak.
//! Shapes are OLMoE-1B-7B's (hidden 2048, expert width 1024, 64 experts, top-8), the CPU target
//! of the project.

use divan::counter::ItemsCount;
use divan::Bencher;
use moeflow::backend::cpu::ceiling;
use moeflow::backend::cpu::dot::{dot_grouped_gemm, PairPanels};
use moeflow::backend::cpu::gemm::{grouped_gemm, Rows, Segment};
use moeflow::backend::cpu::packed::PackedMatrices;
use moeflow::{preset, DType, LayerOptions, MoeConfig, MoeLayer, Tensor};
use std::sync::OnceLock;

fn main() {
    let c = ceiling::measure();
    let rate = |g: Option<f64>| g.map_or("n/a".to_string(), |g| format!("{g:.1} GFLOP/s"));
    println!(
        "this machine: f32 matmul {:.1} GFLOP/s (gemm crate, the floor's rate), FMA peak {}, bf16 dot peak {} (the bf16-dot GEMM's ceiling), copy {:.1} GB/s",
        c.matmul_gflops,
        rate(c.fma_peak_gflops),
        rate(c.bf16_dot_peak_gflops),
        c.copy_gbps
    );
    println!("items/s below are FLOP/s (tokens/s for the routers): divide by the matmul rate for the fraction of the floor\n");
    divan::main();
}

fn olmoe() -> MoeConfig {
    preset::preset("olmoe-1b-7b").expect("the olmoe-1b-7b preset").config
}

/// Rows per expert at 256 tokens, top-8 over 64 experts.
const ROWS_PER_EXPERT: usize = 32;

/// The up projection's weights of every expert (`[64 · 2I, H]`), packed once per dtype.
fn up_weights_f32() -> &'static PackedMatrices<f32> {
    static W: OnceLock<PackedMatrices<f32>> = OnceLock::new();
    W.get_or_init(|| {
        let c = olmoe();
        let w = preset::uniform(c.num_experts * 2 * c.inter * c.hidden, 0.05, 1);
        PackedMatrices::pack(&w, c.num_experts, 2 * c.inter, c.hidden)
    })
}

fn up_weights_bf16_source() -> Vec<half::bf16> {
    let c = olmoe();
    preset::uniform(c.num_experts * 2 * c.inter * c.hidden, 0.05, 1).into_iter().map(half::bf16::from_f32).collect()
}

fn up_weights_bf16() -> &'static PackedMatrices<half::bf16> {
    static W: OnceLock<PackedMatrices<half::bf16>> = OnceLock::new();
    W.get_or_init(|| {
        let c = olmoe();
        PackedMatrices::pack(&up_weights_bf16_source(), c.num_experts, 2 * c.inter, c.hidden)
    })
}

fn up_weights_bf16_pairs() -> &'static PairPanels {
    static W: OnceLock<PairPanels> = OnceLock::new();
    W.get_or_init(|| {
        let c = olmoe();
        PairPanels::pack(&up_weights_bf16_source(), c.num_experts, 2 * c.inter, c.hidden)
    })
}

/// The experts' grouped GEMM alone: the up projection of 256 tokens' 2048 slots, 32 rows for
/// each of the 64 experts, `C [2048, 2I] = A · W[e]ᵀ`, weights streamed from memory.
#[divan::bench(args = ["f32", "bf16", "bf16-dot"], sample_count = 10)]
fn grouped_gemm_up_projection(bencher: Bencher, dtype: &str) {
    let c = olmoe();
    let (rows, n, k) = (c.num_experts * ROWS_PER_EXPERT, 2 * c.inter, c.hidden);
    let a = preset::uniform(rows * k, 1.0, 2);
    let segments: Vec<Segment> = (0..c.num_experts)
        .map(|e| Segment { expert: e, row_start: e * ROWS_PER_EXPERT, rows: ROWS_PER_EXPERT })
        .collect();
    let mut out = vec![0f32; rows * n];
    let flops = 2 * rows * n * k;
    let bencher = bencher.counter(ItemsCount::new(flops));
    match dtype {
        "f32" => {
            let w = up_weights_f32();
            bencher.bench_local(|| grouped_gemm(&a, Rows::strided(k), &segments, w, &mut out, Rows::strided(n)));
        }
        "bf16" => {
            let w = up_weights_bf16();
            bencher.bench_local(|| grouped_gemm(&a, Rows::strided(k), &segments, w, &mut out, Rows::strided(n)));
        }
        _ => {
            let w = up_weights_bf16_pairs();
            bencher.bench_local(|| dot_grouped_gemm(&a, Rows::strided(k), &segments, w, &mut out, Rows::strided(n)));
        }
    }
}

fn layer(dtype: DType) -> &'static MoeLayer {
    static F32: OnceLock<MoeLayer> = OnceLock::new();
    static BF16: OnceLock<MoeLayer> = OnceLock::new();
    let cell = if dtype == DType::F32 { &F32 } else { &BF16 };
    cell.get_or_init(|| {
        let c = olmoe();
        let w = preset::random_weights(&c, dtype, 3);
        MoeLayer::new(&c, &w, LayerOptions::default()).expect("the OLMoE layer")
    })
}

/// The whole layer (router, permute, experts, combine) with bf16 weights, per token count.
#[divan::bench(args = [1, 32, 256], sample_count = 10)]
fn layer_forward_bf16(bencher: Bencher, tokens: usize) {
    forward(bencher, DType::BF16, tokens);
}

/// The whole layer with f32 weights at 256 tokens.
#[divan::bench(args = [256], sample_count = 10)]
fn layer_forward_f32(bencher: Bencher, tokens: usize) {
    forward(bencher, DType::F32, tokens);
}

fn forward(bencher: Bencher, dtype: DType, tokens: usize) {
    let c = olmoe();
    let layer = layer(dtype);
    let x = Tensor::from_f32(&[tokens, c.hidden], preset::uniform(tokens * c.hidden, 1.0, 4)).expect("input");
    bencher.counter(ItemsCount::new(c.expert_flops(tokens) as u64)).bench_local(|| layer.forward(&x).expect("forward"));
}

/// Every router kind on 256 tokens' logits over 64 experts, top-8.
#[divan::bench(args = ["softmax", "topk-softmax", "sigmoid-grouped", "softmax-grouped"])]
fn router(bencher: Bencher, kind: &str) {
    use moeflow::RouterConfig;
    let config = match kind {
        "softmax" => RouterConfig::Softmax { renormalize: true },
        "topk-softmax" => RouterConfig::TopKSoftmax,
        "sigmoid-grouped" => RouterConfig::DEEPSEEK_V3,
        _ => RouterConfig::SoftmaxGrouped { n_group: 8, topk_group: 4, renormalize: false, scaling: 1.0 },
    };
    let (e, k, t) = (64, 8, 256);
    let r = config.build(e, k, None).expect("router");
    let logits = preset::uniform(t * e, 4.0, 5);
    bencher.counter(ItemsCount::new(t)).bench_local(|| r.route(&logits, t).expect("route"));
}
