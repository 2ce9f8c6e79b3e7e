//! The GPU's own ceilings, measured where the benchmark runs: dense bf16 GEMM rate and
//! device-to-device copy bandwidth.

use super::layer::gemm_bf16;
use super::{err, Gpu};
use crate::error::Result;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{sys as drv, DevicePtr, LaunchConfig, PushKernelArg};

/// Dense bf16 GEMM TFLOP/s (cuBLAS, 8192³ on random values: zeros draw less power and clock
/// higher) and copy GB/s (bytes read + written, 1 GiB device-to-device) of GPU `device`,
/// medians of 5 runs after a warm-up.
pub fn measure_ceilings(device: usize) -> Result<(f64, f64)> {
    let gpu = Gpu::new(device)?;
    let blas = CudaBlas::new(gpu.stream.clone()).map_err(|e| err("cuBLAS handle", e))?;
    measure(&gpu, &blas)
}

pub(super) fn measure(g: &Gpu, blas: &CudaBlas) -> Result<(f64, f64)> {
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
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        let mut v = Vec::new();
        for rep in 0..6 {
            let (e0, e1) = (
                g.ctx.new_event(Some(drv::CUevent_flags::CU_EVENT_DEFAULT)),
                g.ctx.new_event(Some(drv::CUevent_flags::CU_EVENT_DEFAULT)),
            );
            let (e0, e1) = (e0.map_err(|e| err("event", e))?, e1.map_err(|e| err("event", e))?);
            e0.record(&g.stream).map_err(|e| err("event", e))?;
            f()?;
            e1.record(&g.stream).map_err(|e| err("event", e))?;
            e1.synchronize().map_err(|e| err("event", e))?;
            if rep > 0 {
                v.push(e0.elapsed_ms(&e1).map_err(|e| err("event", e))? as f64);
            }
        }
        v.sort_by(f64::total_cmp);
        Ok(v[v.len() / 2])
    };
    let ptr = |s: &cudarc::driver::CudaSlice<u16>| s.device_ptr(&g.stream).0;
    let (ap, wp, cp) = (ptr(&a), ptr(&w), ptr(&c));
    let gemm_ms = time(&mut || gemm_bf16(blas, wp, n, n, ap, cp, n))?;
    let bytes = 1usize << 30;
    let (src, mut dst) = (alloc(bytes / 2)?, alloc(bytes / 2)?);
    let copy_ms = time(&mut || g.stream.memcpy_dtod(&src, &mut dst).map_err(|e| err("copy", e)))?;
    Ok((2.0 * (n * n * n) as f64 / gemm_ms / 1e9, 2.0 * bytes as f64 / copy_ms / 1e6))
}
