//! `--skew` on GPU layers: the bias added to the router on the device is the one the host adds
//! to the weights (`Skew::apply`), bit for bit, and skews the routing of weights generated on
//! the device as asked. Needs the `cuda` feature and a GPU: without a GPU the tests print
//! SKIPPED and check nothing.
#![cfg(feature = "cuda")]

mod common;

use common::*;
use moeflow::backend::cuda::CudaMoeLayer;
use moeflow::parallel::ParallelConfig;
use moeflow::skew::Skew;
use moeflow::{preset, Activation, DType, ExpertsKind, RouterConfig};

/// A GPU layer over `weights`, or `None` (SKIPPED printed) without a GPU.
fn gpu_layer(config: &moeflow::MoeConfig, weights: &moeflow::MoeWeights, test: &str) -> Option<CudaMoeLayer> {
    match CudaMoeLayer::new(config, weights, &Default::default()) {
        Ok(l) => Some(l),
        Err(e) if e.to_string().contains("no CUDA driver") || e.to_string().contains("device 0 requested") => {
            eprintln!("SKIPPED {test} (no GPU): {e}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// The router kinds skewed: softmax without a bias, GPT-OSS's with one, DeepSeek's grouped
/// sigmoid with its correction bias.
fn configs() -> Vec<moeflow::MoeConfig> {
    let grouped = RouterConfig::SigmoidGrouped { n_group: 4, topk_group: 2, renormalize: true, scaling: 2.5 };
    vec![
        small_config(128, 64, 32, 4, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None),
        small_config(128, 64, 16, 2, RouterConfig::TopKSoftmax, Activation::GPT_OSS, None),
        small_config(128, 64, 32, 4, grouped, Activation::Silu, None),
    ]
}

#[test]
fn the_device_skew_is_the_host_skew_bit_for_bit() {
    let test = "the_device_skew_is_the_host_skew_bit_for_bit";
    for config in configs() {
        let weights = preset::random_weights(&config, DType::BF16, 21);
        let Some(plain) = gpu_layer(&config, &weights, test) else { return };
        let (_, x) = hidden(300, config.hidden, 22);
        for skew in [Skew::Zipf(1.2), Skew::Hot { experts: vec![1, 5], share: 0.3 }] {
            let mut host = weights.clone();
            skew.apply(&config, &mut host).unwrap();
            let want = CudaMoeLayer::new(&config, &host, &Default::default()).unwrap().forward(&x).unwrap();
            let device = CudaMoeLayer::new(&config, &weights, &Default::default()).unwrap().skew_router(&skew).unwrap();
            let got = device.forward(&x).unwrap();
            let bits = |t: &moeflow::Tensor| t.to_f32_vec().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert!(bits(&got) == bits(&want), "{:?}, {skew}: the device skew differs from the host's", config.router);
            assert!(bits(&got) != bits(&plain.forward(&x).unwrap()), "{skew} changed nothing");
        }
    }
}

#[test]
fn weights_generated_on_the_device_route_as_skewed() {
    let test = "weights_generated_on_the_device_route_as_skewed";
    for config in configs() {
        let e = config.num_experts;
        // Per expert, the share of the (token, slot) pairs of 4096 tokens through the layer
        // `rank_layer` builds on the device with `skew`.
        let shares = |skew: Option<Skew>| -> Option<Vec<f64>> {
            let spec = moeflow::RankLayerSpec { skew, ..moeflow::RankLayerSpec::random_on_device(&config, 5) };
            let layer = match ParallelConfig::default().rank_layer(None, ExpertsKind::Cuda { device: 0 }, &spec) {
                Ok(l) => l,
                Err(err) if err.to_string().contains("no CUDA driver") || err.to_string().contains("device 0") => {
                    eprintln!("SKIPPED {test} (no GPU): {err}");
                    return None;
                }
                Err(err) => panic!("{err}"),
            };
            let (_, x) = hidden(4096, config.hidden, 23);
            layer.forward(&x).unwrap();
            let totals = layer.load_stats().unwrap().totals();
            let all: u64 = totals.iter().sum();
            Some(totals.iter().map(|&c| c as f64 / all as f64).collect())
        };
        let Some(flat) = shares(None) else { return };
        let zipf = shares(Some(Skew::Zipf(1.2))).unwrap();
        let head = |s: &[f64]| s[..4].iter().sum::<f64>();
        assert!(head(&zipf) > 1.8 * head(&flat), "{:?}: zipf {zipf:?} vs {flat:?}", config.router);
        let hot = shares(Some(Skew::Hot { experts: vec![2, e - 1], share: 0.3 })).unwrap();
        assert!((hot[2] + hot[e - 1] - 0.3).abs() < 0.03, "{:?}: hot share {}", config.router, hot[2] + hot[e - 1]);
        eprintln!("{:?}: first 4 experts {:.3} flat, {:.3} zipf:1.2", config.router, head(&flat), head(&zipf));
    }
}
