//! The fused router of small batches (`route_small` in route.cu, through
//! [`CudaMoeLayer::route_fused`]) against references, on poisoned outputs: the bf16 copy bit for
//! bit, the logits against f64 dot products, the choices against the CPU routers on the
//! kernel's own logits (ids exactly, weights to f32 rounding), and the counts, offsets and maps
//! against those the ids give (rows of an expert in slot order); a token's logits the same bits
//! alone and in a batch; more tokens or experts than it takes refused. Every router kind, 8 to
//! 128 experts, widths that are and are not multiples of the kernel's 128 columns, 1 to 4 tokens,
//! each launched twice (the kernel sets its block counter back for the next launch).

use super::CudaMoeLayer;
use crate::experts::Activation;
use crate::router::RouterConfig;
use crate::{preset, DType};

/// (router, experts, top-k, hidden) cases.
fn cases() -> Vec<(RouterConfig, usize, usize, usize)> {
    let sigmoid = RouterConfig::DEEPSEEK_V3;
    vec![
        (RouterConfig::Softmax { renormalize: true }, 64, 8, 7168),
        (sigmoid.clone(), 256, 8, 200),
        (sigmoid, 64, 8, 7168),
        (RouterConfig::TopKSoftmax, 128, 4, 96),
        (RouterConfig::TopKSoftmax, 8, 1, 1000),
        (RouterConfig::Softmax { renormalize: false }, 128, 32, 130),
        (RouterConfig::SoftmaxGrouped { n_group: 10, topk_group: 3, renormalize: false, scaling: 16.0 }, 120, 6, 64),
        (RouterConfig::Softmax { renormalize: false }, 1000, 32, 130),
    ]
}

/// Needs a GPU; says loudly when it skips.
#[test]
fn fused_router_matches_the_references() {
    let name = "fused_router_matches_the_references";
    if crate::backend::cuda::skip_without_gpu(name) {
        return;
    }
    for (case_no, (router, e, k, h)) in cases().into_iter().enumerate() {
        let activation = match router {
            RouterConfig::TopKSoftmax => Activation::SwigluOai { alpha: 1.702, limit: 7.0 },
            _ => Activation::Silu,
        };
        let config = preset::config(h, 16, e, k, router.clone(), activation, None);
        let weights = preset::random_weights(&config, DType::BF16, 5 + case_no as u64);
        let layer = CudaMoeLayer::new(&config, &weights, &Default::default()).unwrap();
        let gate = weights.gate.to_f32_vec();
        let gate_bias = weights.gate_bias.as_ref().map(|b| b.to_f32_vec());
        let cpu = router.build(e, k, weights.correction_bias.as_ref().map(|b| b.to_f32_vec())).unwrap();
        let mut guard = layer.bufs.lock().unwrap();
        let b = layer.buffers(&mut guard, super::route::FUSED_ROUTE_TOKENS).unwrap();
        if e > super::route::FUSED_ROUTE_EXPERTS {
            let err = layer.route_fused(b, 1).unwrap_err().to_string();
            assert!(err.contains("fused router takes up to"), "{e} experts: {err}");
            continue;
        }
        let s = layer.gpu.stream.clone();
        for t in 1..=super::route::FUSED_ROUTE_TOKENS {
            for launch in 0..2u64 {
                let case = format!("{router:?}, {e} experts, top-{k}, H {h}, {t} tokens, launch {launch}");
                let x = preset::uniform(t * h, 1.0, 100 * case_no as u64 + 10 * t as u64 + launch);
                s.memcpy_htod(&x, &mut b.x.slice_mut(0..t * h)).unwrap();
                s.memcpy_htod(&vec![0xFFFFu16; t * h], &mut b.x_bf.slice_mut(0..t * h)).unwrap();
                s.memcpy_htod(&vec![f32::NAN; t * e], &mut b.logits.slice_mut(0..t * e)).unwrap();
                s.memcpy_htod(&vec![-7i32; t * k], &mut b.ids.slice_mut(0..t * k)).unwrap();
                s.memcpy_htod(&vec![f32::NAN; t * k], &mut b.weights.slice_mut(0..t * k)).unwrap();
                for buf in [&mut b.counts, &mut b.offsets, &mut b.row_of_slot, &mut b.slot_of_row, &mut b.expert_of_row]
                {
                    let n = buf.len();
                    s.memcpy_htod(&vec![-3i32; n], &mut buf.slice_mut(0..n)).unwrap();
                }
                layer.route_fused(b, t).unwrap();
                let read_i = |v: &cudarc::driver::CudaSlice<i32>, n: usize| s.clone_dtoh(&v.slice(0..n)).unwrap();
                let x_bf = s.clone_dtoh(&b.x_bf.slice(0..t * h)).unwrap();
                let want_bf: Vec<u16> = x.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
                assert_eq!(x_bf, want_bf, "{case}: bf16 copy");
                let logits = s.clone_dtoh(&b.logits.slice(0..t * e)).unwrap();
                for (i, &got) in logits.iter().enumerate() {
                    let (tok, x_e) = (i / e, i % e);
                    let row = &gate[x_e * h..(x_e + 1) * h];
                    let xs = &x[tok * h..(tok + 1) * h];
                    let dot: f64 = xs.iter().zip(row).map(|(&a, &g)| a as f64 * g as f64).sum();
                    let size: f64 = xs.iter().zip(row).map(|(&a, &g)| (a as f64 * g as f64).abs()).sum();
                    let want = dot + gate_bias.as_ref().map_or(0.0, |b| b[x_e] as f64);
                    // Rounding bound: a block's partial (four products, a tree of 32), then the
                    // sums over the blocks.
                    let bound = (h.div_ceil(super::route::ROUTE_COLS) + 8) as f64 * f32::EPSILON as f64 * size + 1e-6;
                    assert!((got as f64 - want).abs() <= bound, "{case}: logit {i}: {got} against {want}");
                }
                let chosen = cpu.route(&logits, t).unwrap();
                let ids = read_i(&b.ids, t * k);
                assert_eq!(ids, chosen.ids, "{case}: ids");
                let w = s.clone_dtoh(&b.weights.slice(0..t * k)).unwrap();
                for (i, (&a, &want)) in w.iter().zip(&chosen.weights).enumerate() {
                    assert!((a - want).abs() <= 1e-5 * want.abs().max(1.0), "{case}: weight {i}: {a} against {want}");
                }
                let (counts, offsets, rows) = super::permute::tests::sort(&ids, e, 0, -1, -1);
                assert_eq!(read_i(&b.counts, e), counts, "{case}: counts");
                assert_eq!(read_i(&b.offsets, e + 1), offsets, "{case}: offsets");
                assert_eq!(read_i(&b.row_of_slot, t * k), rows, "{case}: row of each slot");
                let (slot_of_row, expert_of_row) = (read_i(&b.slot_of_row, t * k), read_i(&b.expert_of_row, t * k));
                for (slot, &r) in rows.iter().enumerate() {
                    assert_eq!(slot_of_row[r as usize], slot as i32, "{case}: slot of row {r}");
                    assert_eq!(expert_of_row[r as usize], ids[slot], "{case}: expert of row {r}");
                }
            }
        }
        // A token's logits are the same bits whatever the batch: alone, and third of four.
        let one = preset::uniform(h, 1.0, 999);
        let mut four = preset::uniform(4 * h, 1.0, 998);
        four[2 * h..3 * h].copy_from_slice(&one);
        let mut logits_of = |x: &[f32], t: usize| {
            s.memcpy_htod(x, &mut b.x.slice_mut(0..t * h)).unwrap();
            layer.route_fused(b, t).unwrap();
            s.clone_dtoh(&b.logits.slice(0..t * e)).unwrap()
        };
        let alone: Vec<u32> = logits_of(&one, 1).iter().map(|v| v.to_bits()).collect();
        let third: Vec<u32> = logits_of(&four, 4)[2 * e..3 * e].iter().map(|v| v.to_bits()).collect();
        assert_eq!(alone, third, "case {case_no}: a token's logits alone and in a batch of four");
        let refused = layer.route_fused(b, super::route::FUSED_ROUTE_TOKENS + 1);
        assert!(refused.is_err_and(|e| e.to_string().contains("fused router")), "case {case_no}: 5 tokens refused");
    }
    eprintln!("fused router matches the references");
}

/// The whole layer with the fused router against the same layer without it, 1 to 4 tokens,
/// with and without a shared expert: the same choices, so outputs equal up to the routing
/// weights' last bits. Needs a Hopper GPU (where the fused router runs); says loudly when it
/// skips.
#[test]
fn layers_with_and_without_the_fused_router_agree() {
    let name = "layers_with_and_without_the_fused_router_agree";
    if crate::backend::cuda::skip_without_gpu(name) {
        return;
    }
    let router = RouterConfig::DEEPSEEK_V3;
    for shared in [None, Some(crate::config::SharedConfig { inter: 64, gated: false })] {
        let config = preset::config(512, 64, 64, 8, router.clone(), Activation::Silu, shared);
        let weights = preset::random_weights(&config, DType::BF16, 9);
        let fused = CudaMoeLayer::new(&config, &weights, &Default::default()).unwrap();
        if fused.k.hopper.is_none() {
            eprintln!("SKIPPED {name}: the fused router runs with the Hopper GEMM, and this GPU has none");
            return;
        }
        let unfused = super::CudaOptions { fused_route: false, ..Default::default() };
        let plain = CudaMoeLayer::new(&config, &weights, &unfused).unwrap();
        for t in 1..=super::route::FUSED_ROUTE_TOKENS {
            assert!(fused.routes_fused(t) && !plain.routes_fused(t), "{t} tokens: which layer fuses");
            let x = crate::tensor::Tensor::from_f32(&[t, 512], preset::uniform(t * 512, 1.0, 70 + t as u64)).unwrap();
            let (a, b) = (fused.forward(&x).unwrap().to_f32_vec(), plain.forward(&x).unwrap().to_f32_vec());
            let size = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            let worst = a.iter().zip(&b).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
            assert!(
                size > 0.0 && worst <= 1e-4 * size,
                "{t} tokens, shared {shared:?}: differ by {worst} (size {size})"
            );
        }
    }
    eprintln!("layers with and without the fused router agree");
}

/// A W8A8 layer's fused router writes its tokens' fp8 codes and scales, bit for bit those of
/// the quantization pass over its bf16 copy, for 1 to 4 tokens and widths that are and are not
/// multiples of 128 (on poisoned buffers, each launched twice). Needs a Hopper GPU (where the
/// fp8 GEMM gathers the codes); says loudly when it skips.
#[test]
fn fused_router_quantizes_the_tokens_as_the_pass_does() {
    let name = "fused_router_quantizes_the_tokens_as_the_pass_does";
    if crate::backend::cuda::skip_without_gpu(name) {
        return;
    }
    let router = RouterConfig::DEEPSEEK_V3;
    for h in [256usize, 336] {
        let shared = Some(crate::config::SharedConfig { inter: 64, gated: false });
        let config = preset::config(h, 64, 64, 8, router.clone(), Activation::Silu, shared);
        let weights = preset::random_weights(&config, DType::BF16, 31);
        let layer = CudaMoeLayer::new(&config, &weights, &Default::default()).unwrap();
        let layer = layer.fp8_experts().unwrap().fp8_activations().unwrap().fp8_shared_expert().unwrap();
        if !layer.routes_fused(1) {
            eprintln!("SKIPPED {name}: W8A8 batches do not route in one launch here (not a Hopper GPU)");
            return;
        }
        let s = layer.gpu.stream.clone();
        let mut guard = layer.bufs.lock().unwrap();
        let b = layer.buffers(&mut guard, super::route::FUSED_ROUTE_TOKENS).unwrap();
        let groups = h.div_ceil(128);
        let want = super::masked_gemm::Fp8Rows::new(&s, super::route::FUSED_ROUTE_TOKENS * h).unwrap();
        for t in 1..=super::route::FUSED_ROUTE_TOKENS {
            for launch in 0..2u64 {
                let case = format!("H {h}, {t} tokens, launch {launch}");
                // A value far above the rest of its group and one far below, and at the second
                // launch a whole group so small that its scale lies outside the products' range
                // (the kernels divide there).
                let mut x = preset::uniform(t * h, 1.0, 40 * t as u64 + launch);
                x[0] *= 3.0e4;
                x[h - 1] *= 1.0e-30;
                if launch == 1 {
                    x[128..256].iter_mut().for_each(|v| *v *= 1.0e-30);
                }
                s.memcpy_htod(&x, &mut b.x.slice_mut(0..t * h)).unwrap();
                let rows = b.shared_fp8.as_mut().expect("a W8A8 shared expert's rows");
                s.memcpy_htod(&vec![0x7Fu8; t * h], &mut rows.codes.slice_mut(0..t * h)).unwrap();
                s.memcpy_htod(&vec![f32::NAN; t * groups], &mut rows.scales.slice_mut(0..t * groups)).unwrap();
                layer.route_fused(b, t).unwrap();
                let x_bf = super::dptr(&b.x_bf, &layer.gpu);
                let into = [super::dptr(&want.codes, &layer.gpu), super::dptr(&want.scales, &layer.gpu), 0];
                layer.quantize_rows_on(&s, x_bf, [t, h], 1, 0, into).unwrap();
                let rows = b.shared_fp8.as_ref().expect("a W8A8 shared expert's rows");
                let got = s.clone_dtoh(&rows.codes.slice(0..t * h)).unwrap();
                assert_eq!(got, s.clone_dtoh(&want.codes.slice(0..t * h)).unwrap(), "{case}: codes");
                let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
                let (got, pass) = (&rows.scales.slice(0..t * groups), &want.scales.slice(0..t * groups));
                assert_eq!(bits(s.clone_dtoh(got).unwrap()), bits(s.clone_dtoh(pass).unwrap()), "{case}: scales");
            }
        }
    }
    eprintln!("the fused router quantizes the tokens as the pass does");
}
