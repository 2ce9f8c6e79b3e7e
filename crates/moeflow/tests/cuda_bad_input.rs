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
