//! The GPU's own ceilings, measured where the benchmark runs: dense bf16 GEMM rate, cool and
//! under sustained load, and device-to-device copy bandwidth.

use super::layer::gemm_bf16;
use super::{err, Gpu};
use super::GpuCeilings;
use crate::error::Result;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{sys as drv, DevicePtr, LaunchConfig, PushKernelArg};

/// Seconds of back-to-back GEMMs before the sustained rate is timed: long enough for the
/// power cap to bring the clocks down (on H200 they fall from 1980 MHz to 1425–1560 within
/// a second of a MoE layer's GEMMs, throttled for software power capping).
const LOAD_SECONDS: f64 = 1.0;

/// The ceilings of GPU `device` (see [`GpuCeilings`]).
pub fn measure_ceilings(device: usize) -> Result<GpuCeilings> {
    let gpu = Gpu::new(device)?;
    let blas = CudaBlas::new(gpu.stream.clone()).map_err(|e| err("cuBLAS handle", e))?;
    measure(&gpu, &blas)
}

pub(super) fn measure(g: &Gpu, blas: &CudaBlas) -> Result<GpuCeilings> {
    let n = 8192usize;
    let alloc = |len: usize| g.stream.alloc_zeros::<u16>(len).map_err(|e| err("alloc", e));
    let (a, w, c) = (alloc(n * n)?, alloc(n * n)?, alloc(n * n)?);
    let fill = g.function("fill_uniform_bf16")?;
    for (seed, m) in [(1u64, &a), (2, &w)] {
        let (ptr, len, scale) = (m.device_ptr(&g.stream).0, (n * n) as i64, 1.0f32);
        let blocks = (n * n).div_ceil(256).min(65_535) as u32;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: fill_uniform_bf16(bf16*, long, u64, float) writes the n² values of `m`.
        unsafe { g.stream.launch_builder(&fill).arg(&ptr).arg(&len).arg(&seed).arg(&scale).launch(cfg) }
            .map_err(|e| err("fill", e))?;
    }
    // Milliseconds `f` takes on the stream, `reps` times back to back.
    let span = |reps: usize, f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        let new = || g.ctx.new_event(Some(drv::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| err("event", e));
        let (e0, e1) = (new()?, new()?);
        e0.record(&g.stream).map_err(|e| err("event", e))?;
        for _ in 0..reps {
            f()?;
        }
        e1.record(&g.stream).map_err(|e| err("event", e))?;
        e1.synchronize().map_err(|e| err("event", e))?;
        Ok(e0.elapsed_ms(&e1).map_err(|e| err("event", e))? as f64)
    };
    // Median of 5 single runs after a warm-up.
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        span(1, f)?;
        let mut v = (0..5).map(|_| span(1, f)).collect::<Result<Vec<_>>>()?;
        v.sort_by(f64::total_cmp);
        Ok(v[v.len() / 2])
    };
    let ptr = |s: &cudarc::driver::CudaSlice<u16>| s.device_ptr(&g.stream).0;
    let (ap, wp, cp) = (ptr(&a), ptr(&w), ptr(&c));
    let mut gemm = || gemm_bf16(blas, wp, n, n, ap, cp, n);
    let gemm_ms = time(&mut gemm)?;
    let mut loaded = 0.0;
    while loaded < LOAD_SECONDS * 1e3 {
        loaded += span(50, &mut gemm)?;
    }
    let sustained_ms = span(20, &mut gemm)? / 20.0;
    let bytes = 1usize << 30;
    let (src, mut dst) = (alloc(bytes / 2)?, alloc(bytes / 2)?);
    let copy_ms = time(&mut || g.stream.memcpy_dtod(&src, &mut dst).map_err(|e| err("copy", e)))?;
    let tflops = |ms: f64| 2.0 * (n * n * n) as f64 / ms / 1e9;
    Ok(GpuCeilings {
        gemm_tflops: tflops(gemm_ms),
        gemm_tflops_sustained: tflops(sustained_ms),
        copy_gbps: 2.0 * bytes as f64 / copy_ms / 1e6,
    })
}
