//! The routed experts through cuBLAS on the padded layout: every expert's rows padded to the
//! largest expert's, one strided-batched GEMM per projection (rows past an expert's count are
//! computed and ignored).

use super::{unfused_mlp, DeviceExperts, ExpertRows};
use crate::backend::cuda::layer::strategy::Mark;
use crate::backend::cuda::layer::{check, dptr, Buffers, CudaMoeLayer};
use crate::error::Result;
use cudarc::cublas::sys as cb;

/// cuBLAS, padded and strided-batched.
pub(in crate::backend::cuda::layer) struct CublasPadded;

impl DeviceExperts for CublasPadded {
    fn name(&self) -> &'static str {
        "cublas-padded"
    }

    fn run(&self, layer: &CudaMoeLayer, _b: &mut Buffers, r: &ExpertRows, mark: Mark) -> Result<()> {
        unfused_mlp(layer, r, mark, |w, n, kdim, a, c| {
            let (alpha, beta, cap) = (1.0f32, 0.0f32, r.cap);
            // SAFETY: per batch entry x, column-major C_x [n, cap] = W_x [kdim, n]ᵀ · A_x
            // [kdim, cap], strides in elements; the buffers hold `experts` such matrices.
            let st = unsafe {
                cb::cublasGemmStridedBatchedEx(
                    *layer.blas.handle(),
                    cb::cublasOperation_t::CUBLAS_OP_T,
                    cb::cublasOperation_t::CUBLAS_OP_N,
                    n as i32,
                    cap as i32,
                    kdim as i32,
                    &alpha as *const f32 as *const _,
                    dptr(w, &layer.gpu) as *const _,
                    cb::cudaDataType_t::CUDA_R_16BF,
                    kdim as i32,
                    (n * kdim) as i64,
                    a as *const _,
                    cb::cudaDataType_t::CUDA_R_16BF,
                    kdim as i32,
                    (cap * kdim) as i64,
                    &beta as *const f32 as *const _,
                    c as *mut _,
                    cb::cudaDataType_t::CUDA_R_16BF,
                    n as i32,
                    (cap * n) as i64,
                    r.experts as i32,
                    cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            };
            check(st, "padded batched GEMM")
        })
    }
}
