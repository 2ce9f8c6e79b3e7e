//! This machine's ceilings, measured: dense f32 matmul rate (with the `gemm` crate, an
//! independent well-tuned kernel) and memory copy bandwidth. Benchmarks report against them.

use std::time::Instant;

/// Measured ceilings of the host.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct HostCeilings {
    /// Dense f32 matmul, all threads, GFLOP/s (median of several runs).
    pub matmul_gflops: f64,
    /// Memory copy, bytes read plus written, GB/s (median).
    pub copy_gbps: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Measures both ceilings (about a second).
pub fn measure() -> HostCeilings {
    HostCeilings { matmul_gflops: matmul_gflops(1536, 5), copy_gbps: copy_gbps(64 << 20, 5) }
}

/// Median GFLOP/s of an `n³` f32 matmul over `runs` runs.
pub fn matmul_gflops(n: usize, runs: usize) -> f64 {
    let a: Vec<f32> = (0..n * n).map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5).collect();
    let b: Vec<f32> = (0..n * n).map(|i| ((i * 104_729) % 1000) as f32 * 1e-3 - 0.5).collect();
    let mut c = vec![0f32; n * n];
    let threads = rayon::current_num_threads();
    let mut samples = Vec::new();
    for _ in 0..runs + 1 {
        let t = Instant::now();
        // SAFETY: a, b, c are n×n row-major buffers (row stride n, column stride 1) that live
        // across the call, and c does not alias a or b.
        unsafe {
            gemm::gemm(
                n,
                n,
                n,
                c.as_mut_ptr(),
                1,
                n as isize,
                false,
                a.as_ptr(),
                1,
                n as isize,
                b.as_ptr(),
                1,
                n as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::Rayon(threads),
            )
        };
        samples.push(2.0 * (n * n * n) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    samples.remove(0);
    median(samples)
}

/// Median GB/s (read + written) of copying `bytes` over `runs` runs.
pub fn copy_gbps(bytes: usize, runs: usize) -> f64 {
    use rayon::prelude::*;
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let mut samples = Vec::new();
    for _ in 0..runs + 1 {
        let t = Instant::now();
        dst.par_chunks_mut(1 << 20).zip(src.par_chunks(1 << 20)).for_each(|(d, s)| d.copy_from_slice(s));
        samples.push(2.0 * bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    samples.remove(0);
    std::hint::black_box(&dst);
    median(samples)
}
