//! The device router (`route` in route.cu, through [`CudaMoeLayer::top_k`]) against the CPU
//! routers on the same logits: ids exactly, weights to f32 rounding. Logits drawn from a few
//! values give many ties (which the lower id must win), and expert counts past one warp's 32
//! lanes, group-limited choices and the 1024-expert limit are all covered.

use super::{dptr, CudaMoeLayer};
use crate::experts::Activation;
use crate::router::RouterConfig;
use crate::{preset, DType};

/// (router, experts, top-k) cases: every router kind, with and without ties.
fn cases() -> Vec<(RouterConfig, usize, usize)> {
    let sigmoid =
        |n_group, topk_group| RouterConfig::SigmoidGrouped { n_group, topk_group, renormalize: true, scaling: 2.5 };
    vec![
        (RouterConfig::Softmax { renormalize: true }, 64, 8),
        (RouterConfig::Softmax { renormalize: false }, 1000, 32),
        (RouterConfig::TopKSoftmax, 128, 4),
        (RouterConfig::TopKSoftmax, 8, 1),
        (sigmoid(8, 4), 256, 8),
        (sigmoid(8, 4), 64, 8),
        (sigmoid(64, 2), 1024, 6),
        (RouterConfig::SoftmaxGrouped { n_group: 10, topk_group: 3, renormalize: false, scaling: 16.0 }, 160, 6),
    ]
}

/// Needs a GPU; says loudly when it skips.
#[test]
fn device_top_k_matches_the_cpu_routers_ties_included() {
    let name = "device_top_k_matches_the_cpu_routers_ties_included";
    if crate::backend::cuda::skip_without_gpu(name) {
        return;
    }
    let t = 37;
    for (router, e, k) in cases() {
        let config = preset::config(32, 16, e, k, router.clone(), Activation::Silu, None);
        let weights = preset::random_weights(&config, DType::BF16, 3);
        let layer = CudaMoeLayer::new(&config, &weights, &Default::default()).unwrap();
        let bias = weights.correction_bias.as_ref().map(|b| b.to_f32_vec());
        let cpu = router.build(e, k, bias).unwrap();
        for tied in [true, false] {
            // Tied: nine values a quarter apart, so most tokens have equal logits among their picks.
            let logits: Vec<f32> = preset::uniform(t * e, 2.0, e as u64 + tied as u64)
                .into_iter()
                .map(|x| if tied { (x * 2.0).round() / 4.0 } else { x })
                .collect();
            let want = cpu.route(&logits, t).unwrap();
            let s = &layer.gpu.stream;
            let dl = s.clone_htod(&logits).unwrap();
            let ids = s.clone_htod(&vec![-7i32; t * k]).unwrap();
            let w = s.clone_htod(&vec![f32::NAN; t * k]).unwrap();
            let g = &layer.gpu;
            layer.top_k(dptr(&dl, g), t, dptr(&ids, g), dptr(&w, g)).unwrap();
            let (got_ids, got_w) = (s.clone_dtoh(&ids).unwrap(), s.clone_dtoh(&w).unwrap());
            let case = format!("{router:?}, {e} experts, top-{k}, tied {tied}");
            assert_eq!(got_ids, want.ids, "{case}: ids");
            for (i, (&a, &b)) in got_w.iter().zip(&want.weights).enumerate() {
                assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{case}: weight {i}: {a} against {b}");
            }
        }
    }
    eprintln!("device top-k matches the CPU routers");
}
