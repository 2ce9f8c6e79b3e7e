//! This machine's ceilings, measured: dense f32 matmul rate (with the `gemm` crate, an
//! independent well-tuned kernel), the cores' AVX2 fused multiply-add peak and AVX512-BF16
//! dot-product peak (independent chains on every thread: no GEMM built on those instructions
//! can beat them) and memory copy bandwidth. Benchmarks report against them.

use std::time::Instant;

/// Measured ceilings of the host.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct HostCeilings {
    /// Dense f32 matmul, all threads, GFLOP/s (median of several runs).
    pub matmul_gflops: f64,
    /// Memory copy, bytes read plus written, GB/s (median).
    pub copy_gbps: f64,
    /// f32 FMA peak of all threads together, GFLOP/s (median); `None` without AVX2 and FMA.
    pub fma_peak_gflops: Option<f64>,
    /// AVX512-BF16 dot-product peak of all threads together, GFLOP/s (median); `None` without
    /// AVX512-BF16.
    pub bf16_dot_peak_gflops: Option<f64>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Measures both ceilings (about a second).
pub fn measure() -> HostCeilings {
    HostCeilings {
        matmul_gflops: matmul_gflops(1536, 5),
        copy_gbps: copy_gbps(64 << 20, 5),
        fma_peak_gflops: fma_peak_gflops(5),
        bf16_dot_peak_gflops: bf16_dot_peak_gflops(5),
    }
}

/// Median over `runs` of the f32 FMA rate of every thread at once, GFLOP/s (timed as
/// `parallel_peak` does): twelve independent chains of 8-wide fused multiply-adds, enough to cover
/// the FMA latency on two pipes. `None` where AVX2 and FMA are missing.
pub fn fma_peak_gflops(runs: usize) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: AVX2 and FMA were detected above.
        return Some(unsafe { parallel_peak(runs, 12 * 16, fma_chains) });
    }
    let _ = runs;
    None
}

/// Median over `runs` of the AVX512-BF16 dot-product rate of every thread at once, GFLOP/s
/// (timed as `parallel_peak` does): twelve independent chains of `vdpbf16ps`, each 16 lanes × 2
/// products, the ceiling of the bf16 dot-product GEMM ([`super::dot`]). `None` where the
/// instruction is missing.
pub fn bf16_dot_peak_gflops(runs: usize) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    if super::dot::available() {
        // SAFETY: AVX512F and AVX512-BF16 were detected by `available`.
        return Some(unsafe { parallel_peak(runs, 12 * 16 * 4, dot_chains) });
    }
    let _ = runs;
    None
}

/// Median over `runs` of the rate of `chains` on every thread at once, GFLOP/s, each of its
/// steps worth `flops_per_step`: 32 chunks per thread handed out as threads free up, as the
/// GEMM's tasks are, so a thread that starts late or shares its core does not hold the others
/// back.
///
/// # Safety
/// `chains` must be safe to call on this CPU (its instructions detected).
#[cfg(target_arch = "x86_64")]
unsafe fn parallel_peak(runs: usize, flops_per_step: usize, chains: unsafe fn(usize) -> f32) -> f64 {
    use rayon::prelude::*;
    const STEPS: usize = 600_000;
    let chunks = 32 * rayon::current_num_threads();
    let mut samples = Vec::new();
    for _ in 0..runs + 1 {
        let t = Instant::now();
        // SAFETY: the caller vouches for `chains` on this CPU.
        let sums: Vec<f32> = (0..chunks).into_par_iter().map(|_| unsafe { chains(STEPS) }).collect();
        let secs = t.elapsed().as_secs_f64();
        std::hint::black_box(sums);
        samples.push((chunks * STEPS * flops_per_step) as f64 / secs / 1e9);
    }
    samples.remove(0);
    median(samples)
}

/// `steps` rounds of 12 independent `vdpbf16ps`; returns a value that depends on all of them.
///
/// # Safety
/// Requires AVX512F and AVX512-BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dot_chains(steps: usize) -> f32 {
    use std::arch::x86_64::*;
    // Pairs of bf16 0.5 and 2^-20: each step adds 2^-20 to every lane.
    let a: __m512bh = std::mem::transmute(_mm512_set1_epi32(0x3f00_3f00));
    let b: __m512bh = std::mem::transmute(_mm512_set1_epi32(0x3580_3580));
    let mut acc = [_mm512_setzero_ps(); 12];
    for _ in 0..std::hint::black_box(steps) {
        for v in acc.iter_mut() {
            *v = _mm512_dpbf16_ps(*v, a, b);
        }
    }
    acc.iter().map(|&v| _mm512_reduce_add_ps(v)).sum()
}

/// `steps` rounds of 12 independent 8-wide FMAs; returns a value that depends on all of them.
///
/// # Safety
/// Requires AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_chains(steps: usize) -> f32 {
    use std::arch::x86_64::*;
    let (b, c) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
    let mut acc = [_mm256_setzero_ps(); 12];
    for (i, a) in acc.iter_mut().enumerate() {
        *a = _mm256_set1_ps(i as f32);
    }
    for _ in 0..std::hint::black_box(steps) {
        for a in acc.iter_mut() {
            *a = _mm256_fmadd_ps(*a, b, c);
        }
    }
    let mut out = [0f32; 8];
    let mut total = _mm256_setzero_ps();
    for a in acc {
        total = _mm256_add_ps(total, a);
    }
    _mm256_storeu_ps(out.as_mut_ptr(), total);
    out.iter().sum()
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

#[cfg(test)]
mod tests {
    #[test]
    fn fma_peak_is_a_positive_rate_where_avx2_exists() {
        let peak = super::fma_peak_gflops(1);
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            let p = peak.expect("AVX2 and FMA present");
            assert!(p.is_finite() && p > 0.0, "{p}");
            return;
        }
        assert!(peak.is_none());
    }

    #[test]
    fn bf16_dot_peak_is_a_positive_rate_where_avx512_bf16_exists() {
        let peak = super::bf16_dot_peak_gflops(1);
        if super::super::dot::available() {
            let p = peak.expect("AVX512-BF16 present");
            assert!(p.is_finite() && p > 0.0, "{p}");
        } else {
            assert!(peak.is_none());
        }
    }
}
