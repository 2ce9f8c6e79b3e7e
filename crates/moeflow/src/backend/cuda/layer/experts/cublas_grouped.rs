//! The routed experts through cuBLAS on the grouped layout in one grouped call per projection
//! (`cublasGemmGroupedBatchedEx`), the expert sizes and matrix addresses passed from the host.

use super::{unfused_mlp, DeviceExperts, ExpertRows};
use crate::backend::cuda::layer::strategy::Mark;
use crate::backend::cuda::layer::{check, dptr, err, Buffers, CudaMoeLayer};
use crate::error::Result;
use cudarc::cublas::sys as cb;

/// cuBLAS, one grouped call.
pub(in crate::backend::cuda::layer) struct CublasGrouped;

impl DeviceExperts for CublasGrouped {
    fn name(&self) -> &'static str {
        "cublas-grouped"
    }

    fn run(&self, layer: &CudaMoeLayer, b: &mut Buffers, r: &ExpertRows, mark: Mark) -> Result<()> {
        let g = &layer.gpu;
        unfused_mlp(layer, r, mark, |w, n, kdim, a, c| {
            let count = r.groups.len();
            if count == 0 {
                return Ok(());
            }
            let wbase = dptr(w, g);
            let mut ptrs = Vec::with_capacity(3 * count);
            ptrs.extend(r.groups.iter().map(|&(x, _, _)| wbase + 2 * (x * n * kdim) as u64));
            ptrs.extend(r.groups.iter().map(|&(_, off, _)| a + 2 * (off * kdim) as u64));
            ptrs.extend(r.groups.iter().map(|&(_, off, _)| c + 2 * (off * n) as u64));
            g.stream
                .memcpy_htod(&ptrs, &mut b.ptrs.slice_mut(0..3 * count))
                .map_err(|e| err("GEMM pointer arrays", e))?;
            let base = dptr(&b.ptrs, g);
            let ta = vec![cb::cublasOperation_t::CUBLAS_OP_T; count];
            let tb = vec![cb::cublasOperation_t::CUBLAS_OP_N; count];
            let m: Vec<i32> = vec![n as i32; count];
            let nn: Vec<i32> = r.groups.iter().map(|&(_, _, rows)| rows as i32).collect();
            let kk: Vec<i32> = vec![kdim as i32; count];
            let ones = vec![1.0f32; count];
            let zeros = vec![0.0f32; count];
            let sizes = vec![1i32; count];
            // SAFETY: column-major per group: C [n, rows] = W [kdim, n]ᵀ · A [kdim, rows]; the
            // device pointer arrays (uploaded above, stream-ordered) address `count` matrices
            // of those sizes inside the weight and workspace buffers; host arrays have `count`
            // entries.
            let st = unsafe {
                cb::cublasGemmGroupedBatchedEx(
                    *layer.blas.handle(),
                    ta.as_ptr(),
                    tb.as_ptr(),
                    m.as_ptr(),
                    nn.as_ptr(),
                    kk.as_ptr(),
                    ones.as_ptr() as *const _,
                    base as *const *const _,
                    cb::cudaDataType_t::CUDA_R_16BF,
                    kk.as_ptr(),
                    (base + 8 * count as u64) as *const *const _,
                    cb::cudaDataType_t::CUDA_R_16BF,
                    kk.as_ptr(),
                    zeros.as_ptr() as *const _,
                    (base + 16 * count as u64) as *const *mut _,
                    cb::cudaDataType_t::CUDA_R_16BF,
                    m.as_ptr(),
                    count as i32,
                    sizes.as_ptr(),
                    cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                )
            };
            check(st, "grouped GEMM")
        })
    }
}
