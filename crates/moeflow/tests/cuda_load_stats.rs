//! Load statistics counted on the device by the GPU layer, against the CPU layer's routing.
//! Needs the `cuda` feature and a GPU: without a GPU the test prints SKIPPED and checks nothing.
#![cfg(feature = "cuda")]

mod common;

use common::*;
use moeflow::backend::cuda::CudaMoeLayer;
use moeflow::{preset, Activation, DType, MoeLayer, RouterConfig, SharedConfig};

/// With and without a shared expert (the count then runs on its side stream, beside the layer).
#[test]
fn the_device_counts_each_calls_routing_into_its_window() {
    for shared in [None, Some(SharedConfig { inter: 64, gated: false })] {
        counts_each_calls_routing_into_its_window(shared);
    }
}

fn counts_each_calls_routing_into_its_window(shared: Option<SharedConfig>) {
    // Top-3, so that the batches' slot counts (3, 9, 192, 900) are and are not multiples of the
    // counting kernel's four-id loads.
    let config = small_config(256, 128, 32, 3, RouterConfig::Softmax { renormalize: true }, Activation::Silu, shared);
    let weights = preset::random_weights(&config, DType::BF16, 3);
    let gpu = match CudaMoeLayer::new(&config, &weights, &Default::default()) {
        Ok(l) => l,
        Err(e) if e.to_string().contains("no CUDA driver") || e.to_string().contains("device 0 requested") => {
            eprintln!("SKIPPED (no GPU): {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let cpu = MoeLayer::new(&config, &weights, Default::default()).unwrap();
    // Small batches replay CUDA graphs: the counts must still land in successive rows.
    let sizes: Vec<usize> = (0..70).map(|i| [1, 3, 64, 300, 1][i % 5]).collect();
    let mut want = Vec::new();
    for (i, &t) in sizes.iter().enumerate() {
        let (_, x) = hidden(t, 256, 100 + i as u64);
        gpu.forward(&x).unwrap();
        let mut c = vec![0u64; 32];
        cpu.route(&x).unwrap().ids.iter().for_each(|&e| c[e as usize] += 1);
        want.push(c);
    }
    let stats = gpu.load_stats().unwrap();
    assert_eq!(stats.calls_seen, 70);
    assert_eq!(stats.calls.len(), moeflow::load_stats::DEFAULT_WINDOW);
    for (got, (want, &t)) in stats.calls.iter().zip(want.iter().zip(&sizes).skip(70 - stats.calls.len())) {
        assert_eq!(got.iter().sum::<u64>(), (t * 3) as u64);
        // bf16 rows may flip a near-tie between the GPU's and the CPU's choice.
        let moved: u64 = got.iter().zip(want).map(|(a, b)| a.abs_diff(*b)).sum();
        assert!(moved <= 2 + (t as u64) / 50, "shared {shared:?}, {t} tokens: {got:?} vs {want:?}");
    }
}

/// `load_stats: false` leaves the window empty; `load_recording_ms` times the counting kernel
/// alone without touching the layer's window (or, where the fused router counts, says 0).
#[test]
fn recording_can_be_turned_off_and_its_cost_is_timed_aside() {
    use moeflow::backend::cuda::CudaOptions;
    let config = small_config(256, 128, 32, 4, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let weights = preset::random_weights(&config, DType::BF16, 3);
    let off = CudaOptions { load_stats: false, ..Default::default() };
    let quiet = match CudaMoeLayer::new(&config, &weights, &off) {
        Ok(l) => l,
        Err(e) if e.to_string().contains("no CUDA driver") || e.to_string().contains("device 0 requested") => {
            eprintln!("SKIPPED (no GPU): {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let gpu = CudaMoeLayer::new(&config, &weights, &Default::default()).unwrap();
    for t in [1, 300] {
        let (_, x) = hidden(t, 256, 7);
        let (a, b) = (quiet.forward(&x).unwrap(), gpu.forward(&x).unwrap());
        assert_eq!(a, b, "recording changes no output");
    }
    assert_eq!(quiet.load_stats().unwrap().calls_seen, 0);
    assert_eq!(gpu.load_stats().unwrap().calls_seen, 2);
    for t in [1, 128, 4096] {
        let ms = gpu.load_recording_ms(t).unwrap();
        // One token may route in the fused router's one launch, which counts it too (0 ms).
        assert!((ms > 0.0 || t == 1 && ms == 0.0) && ms < 1.0, "{t} tokens: {ms} ms");
        eprintln!("load recording of {t} tokens: {:.2} µs", ms * 1e3);
    }
    assert_eq!(gpu.load_stats().unwrap().calls_seen, 2, "timing the recording counts no call");
}
