//! Bad input on the GPU: outputs that overflow are found on the device and refused (or
//! returned when allowed), and requests for more device memory than there is end in an error
//! naming what was being allocated. Needs the `cuda` feature and a GPU: without one every test
//! prints SKIPPED and checks nothing.
#![cfg(feature = "cuda")]

use moeflow::backend::cuda::{device_count, CudaMoeLayer};
use moeflow::{preset, Activation, DType, MoeError, RouterConfig, Tensor};

fn have_gpu(test: &str) -> bool {
    let n = device_count();
    if n == 0 {
        eprintln!("SKIPPED {test}: no CUDA device");
    }
    n > 0
}

#[test]
fn overflowing_outputs_are_counted_on_the_device() {
    if !have_gpu("overflowing_outputs_are_counted_on_the_device") {
        return;
    }
    let config = preset::config(64, 32, 8, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let weights = preset::random_weights(&config, DType::BF16, 3);
    // Finite inputs whose products overflow inside the experts; token 0 stays small.
    let mut x = preset::uniform(5 * 64, 1.0, 9);
    x[64..].iter_mut().for_each(|v| *v *= 1e25);
    let x = Tensor::from_f32(&[5, 64], x).unwrap();
    let err = CudaMoeLayer::new(&config, &weights, &Default::default()).unwrap().forward(&x).unwrap_err();
    let allowed =
        CudaMoeLayer::new(&config, &weights, &Default::default()).unwrap().allow_nonfinite(true).forward(&x).unwrap();
    let out = allowed.to_f32_vec();
    let bad: Vec<usize> = (0..out.len()).filter(|&i| !out[i].is_finite()).collect();
    assert!(!bad.is_empty(), "the inputs should overflow");
    match err {
        MoeError::NonFiniteOutput { count, token, column, .. } => {
            assert_eq!(count, bad.len());
            assert_eq!((token, column), (bad[0] / 64, bad[0] % 64));
            assert!(token >= 1);
        }
        e => panic!("expected a non-finite output error, got {e}"),
    }
    // Finite outputs pass the check.
    let small = Tensor::from_f32(&[5, 64], preset::uniform(5 * 64, 1.0, 9)).unwrap();
    let out = CudaMoeLayer::new(&config, &weights, &Default::default()).unwrap().forward(&small).unwrap();
    assert!(out.to_f32_vec().iter().all(|v| v.is_finite()));
}

/// The same overflow through device memory, f32 and bf16 hidden states alike
/// (`forward_device`, `forward_device_bf16`): the count and the first position are the host's,
/// from the call itself where it waits (cuBLAS's experts read the host) or from the next
/// `synchronize_device` where it does not (the library's choice on Hopper).
#[test]
fn overflowing_outputs_of_calls_on_device_memory_are_counted() {
    use cudarc::driver::{CudaContext, DevicePtr};
    use moeflow::backend::cuda_options::{CudaOptions, ExpertGemm};
    if !have_gpu("overflowing_outputs_of_calls_on_device_memory_are_counted") {
        return;
    }
    let config = preset::config(64, 32, 8, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let weights = preset::random_weights(&config, DType::BF16, 3);
    // bf16 values, so that both calls take the same ones.
    let mut x = preset::uniform(5 * 64, 1.0, 9);
    x[64..].iter_mut().for_each(|v| *v *= 1e25);
    let x: Vec<f32> = x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
    let x16: Vec<u16> = x.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
    let stream = CudaContext::new(0).unwrap().new_stream().unwrap();
    let raw = stream.cu_stream() as u64;
    let (x32d, x16d) = (stream.clone_htod(&x).unwrap(), stream.clone_htod(&x16).unwrap());
    let (out32, out16) = (stream.alloc_zeros::<f32>(x.len()).unwrap(), stream.alloc_zeros::<u16>(x.len()).unwrap());
    for gemm in [ExpertGemm::Cublas, ExpertGemm::Auto] {
        let layer =
            CudaMoeLayer::new(&config, &weights, &CudaOptions { expert_gemm: gemm, ..Default::default() }).unwrap();
        let want = match layer.forward(&Tensor::from_f32(&[5, 64], x.clone()).unwrap()).unwrap_err() {
            MoeError::NonFiniteOutput { count, token, column, .. } => (count, token, column),
            e => panic!("expected a non-finite output error, got {e}"),
        };
        for bf16 in [false, true] {
            let called = if bf16 {
                let (xp, _a) = x16d.device_ptr(&stream);
                let (op, _b) = out16.device_ptr(&stream);
                layer.forward_device_bf16(xp, op, 5, raw)
            } else {
                let (xp, _a) = x32d.device_ptr(&stream);
                let (op, _b) = out32.device_ptr(&stream);
                layer.forward_device(xp, op, 5, raw)
            };
            let reported = called.and_then(|()| layer.synchronize_device(raw, std::time::Duration::from_secs(20)));
            match reported {
                Err(MoeError::NonFiniteOutput { count, token, column, .. }) => {
                    assert_eq!((count, token, column), want, "{gemm:?}, bf16 {bf16}: the host's count and position")
                }
                other => panic!("{gemm:?}, bf16 {bf16}: expected a non-finite output error, got {other:?}"),
            }
            layer.synchronize_device(raw, std::time::Duration::from_secs(20)).expect("reported once");
        }
    }
}

/// A layer that allows non-finite outputs hands the same overflow out through device memory as
/// it is: neither the call nor the next `synchronize_device` reports it, and the output holds
/// the host's output bits (f32) or their bf16 rounding. A NaN among the hidden states is still
/// refused, at its index. The hidden states and the outputs sit one value past their
/// allocations' starts, off the copies' 16-byte steps, so that every value goes through their
/// one-by-one loops (the output's copy here counting nothing).
#[test]
fn allowed_overflows_pass_through_unaligned_device_memory() {
    use cudarc::driver::{CudaContext, DevicePtr};
    use moeflow::backend::cuda_options::{CudaOptions, ExpertGemm};
    let name = "allowed_overflows_pass_through_unaligned_device_memory";
    if !have_gpu(name) {
        return;
    }
    let (t, h) = (5, 64);
    let config = preset::config(h, 32, 8, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let weights = preset::random_weights(&config, DType::BF16, 3);
    // bf16 values, so that both calls take the same ones; tokens 1 and on overflow.
    let mut x = preset::uniform(t * h, 1.0, 9);
    x[h..].iter_mut().for_each(|v| *v *= 1e25);
    let x: Vec<f32> = x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
    let stream = CudaContext::new(0).unwrap().new_stream().unwrap();
    let raw = stream.cu_stream() as u64;
    for gemm in [ExpertGemm::Cublas, ExpertGemm::Auto] {
        let opts = CudaOptions { expert_gemm: gemm, ..Default::default() };
        let layer = CudaMoeLayer::new(&config, &weights, &opts).unwrap().allow_nonfinite(true);
        let host = layer.forward(&Tensor::from_f32(&[t, h], x.clone()).unwrap()).unwrap().to_f32_vec();
        assert!(host.iter().any(|v| !v.is_finite()), "{gemm:?}: the inputs overflow");
        for (bf16, nan) in [false, true].into_iter().flat_map(|b| [(b, false), (b, true)]) {
            let mut values = x.clone();
            if nan {
                values[h + 5] = f32::NAN;
            }
            let label =
                format!("{gemm:?}, {}, {}", if bf16 { "bf16" } else { "f32" }, if nan { "a NaN" } else { "finite" });
            // One value before the hidden states and before the output.
            let (called, out) = if bf16 {
                let padded: Vec<u16> =
                    [0.0].iter().chain(&values).map(|&v| half::bf16::from_f32(v).to_bits()).collect();
                let (xd, od) = (stream.clone_htod(&padded).unwrap(), stream.alloc_zeros::<u16>(t * h + 1).unwrap());
                let (xp, _a) = xd.device_ptr(&stream);
                let (op, _b) = od.device_ptr(&stream);
                let called = layer
                    .forward_device_bf16(xp + 2, op + 2, t, raw)
                    .and_then(|()| layer.synchronize_device(raw, std::time::Duration::from_secs(20)));
                let out =
                    stream.clone_dtoh(&od).unwrap()[1..].iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect();
                (called, out)
            } else {
                let padded: Vec<f32> = [0.0].iter().chain(&values).copied().collect();
                let (xd, od) = (stream.clone_htod(&padded).unwrap(), stream.alloc_zeros::<f32>(t * h + 1).unwrap());
                let (xp, _a) = xd.device_ptr(&stream);
                let (op, _b) = od.device_ptr(&stream);
                let called = layer
                    .forward_device(xp + 4, op + 4, t, raw)
                    .and_then(|()| layer.synchronize_device(raw, std::time::Duration::from_secs(20)));
                (called, stream.clone_dtoh(&od).unwrap()[1..].to_vec())
            };
            if nan {
                match called {
                    Err(MoeError::NonFinite { index, .. }) => assert_eq!(index, h + 5, "{label}: the NaN's index"),
                    other => panic!("{label}: expected the NaN input refused, got {other:?}"),
                }
                layer.synchronize_device(raw, std::time::Duration::from_secs(20)).expect("reported once");
                continue;
            }
            called.unwrap_or_else(|e| panic!("{label}: {e}"));
            for (i, (&got, &want)) in out.iter().zip(&host).enumerate() {
                let want = if bf16 { half::bf16::from_f32(want).to_f32() } else { want };
                let same = if want.is_nan() { got.is_nan() } else { got.to_bits() == want.to_bits() };
                assert!(same, "{label}: output {i} is {got}, the host's {want}");
            }
            eprintln!("{name}: {label}: the overflowing output as the host's");
        }
    }
}

#[test]
fn device_out_of_memory_names_the_allocation() {
    if !have_gpu("device_out_of_memory_names_the_allocation") {
        return;
    }
    // 1024 experts (the CUDA layer's most) of 8192 × 8192: 384 GiB of bf16 weights, generated
    // on the device.
    let config =
        preset::config(8192, 8192, 1024, 8, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let e = CudaMoeLayer::random(&config, 1, &Default::default()).err().expect("more than any GPU holds").to_string();
    assert!(e.contains("out of memory") || e.contains("needs"), "{e}");
    // A batch whose workspace exceeds the device: refused before allocating, with the bytes.
    let config = preset::config(4096, 1024, 8, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let layer = CudaMoeLayer::random(&config, 1, &Default::default()).unwrap();
    let e = match layer.forward_timed(1 << 28, 1) {
        Ok(_) => panic!("a workspace of 2^28 tokens was allocated"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("workspace for 268435456 tokens on GPU 0") && e.contains("needs"), "{e}");
    // The layer still works afterwards.
    layer.forward_timed(16, 1).unwrap();
}
