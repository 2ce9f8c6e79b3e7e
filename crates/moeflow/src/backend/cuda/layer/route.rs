//! Stage 1, routing on the device: the tokens' bf16 copy, the f32 router GEMM (no TF32, so the
//! choices match the CPU reference's), the logits' bias and top-k for every router kind.

use super::{check, dptr, err, grid, Buffers, CudaMoeLayer};
use crate::error::{MoeError, Result};
use crate::router::RouterConfig;
use cudarc::cublas::sys as cb;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

impl CudaMoeLayer {
    /// f32 → bf16 copy of the tokens, router GEMM, bias, and top-k into `b.ids`/`b.weights`.
    pub(super) fn route(&self, b: &Buffers, t: usize) -> Result<()> {
        let c = &self.config;
        let (h, e) = (c.hidden, c.num_experts);
        let g = &self.gpu;
        let s = &g.stream;
        let p = |x: &CudaSlice<f32>| dptr(x, g);
        let pb = |x: &CudaSlice<u16>| dptr(x, g);
        let (n_th, n) = (t * h, (t * h) as i64);
        let (xp, xbp) = (p(&b.x), pb(&b.x_bf));
        // Large batches make their bf16 copy on side stream 0, beside the router GEMM (both
        // read x from memory). Measured on H200, DeepSeek-V3 shapes, the route stage: 0.187
        // against 0.205 ms at 4096 tokens, 0.114–0.143 against 0.161–0.168 at 2048; at 512 and
        // below the fork and join cost more than they hide (0.067 against 0.062 ms).
        let overlap = t * h >= 1 << 23;
        let side = if overlap { &self.side.shared().stream } else { s };
        if overlap {
            self.side.fork(s, [self.side.shared()])?;
        }
        // SAFETY: every launch below passes device pointers to buffers sized for `t` tokens
        // (see `buffers`) with the scalar types the kernel in moe.cu declares.
        unsafe {
            side.launch_builder(&self.k.to_bf16)
                .arg(&xp)
                .arg(&xbp)
                .arg(&n)
                .launch(grid(n_th))
                .map_err(|e| err("to_bf16", e))?;
        }
        self.gemm_f32_router(b, t)?;
        if let Some(bias) = &self.w.gate_bias {
            let (lp, bp, ti, ei) = (p(&b.logits), p(bias), t as i32, e as i32);
            // SAFETY: as above.
            unsafe { s.launch_builder(&self.k.add_bias).arg(&lp).arg(&bp).arg(&ti).arg(&ei).launch(grid(t * e)) }
                .map_err(|e| err("add_bias", e))?;
        }
        self.top_k(dptr(&b.logits, g), t, dptr(&b.ids, g), dptr(&b.weights, g))?;
        if overlap {
            self.side.join(s, [self.side.shared()])?;
        }
        Ok(())
    }

    /// Top-k ids `[t, k]` and weights `[t, k]` at `ids` and `weights` from the router logits
    /// `[t, E]` (bias added) at `logits`, for the layer's router kind.
    pub(super) fn top_k(&self, logits: u64, t: usize, ids: u64, weights: u64) -> Result<()> {
        let c = &self.config;
        let (e, k) = (c.num_experts, c.top_k);
        let g = &self.gpu;
        let (kind, n_group, topk_group, renorm, scaling) = match c.router {
            RouterConfig::Softmax { renormalize } => (0i32, 1i32, 1i32, renormalize as i32, 1.0f32),
            RouterConfig::TopKSoftmax => (1, 1, 1, 0, 1.0),
            RouterConfig::SigmoidGrouped { n_group, topk_group, renormalize, scaling } => {
                (2, n_group as i32, topk_group as i32, renormalize as i32, scaling)
            }
            RouterConfig::SoftmaxGrouped { n_group, topk_group, renormalize, scaling } => {
                (3, n_group as i32, topk_group as i32, renormalize as i32, scaling)
            }
        };
        if n_group > 64 {
            return Err(MoeError::Unsupported("more than 64 expert groups on the CUDA backend".into()));
        }
        if t == 0 {
            return Ok(());
        }
        let bp = self.w.correction_bias.as_ref().map_or(0u64, |x| dptr(x, g));
        let (ti, ei, ki) = (t as i32, e as i32, k as i32);
        // SAFETY: route(float*, float*, int, int, int, int, int, int, int, float, int*, float*)
        // reads t · E logits (and E bias values) and writes t · k ids and weights.
        unsafe {
            g.stream
                .launch_builder(&self.k.route)
                .arg(&logits)
                .arg(&bp)
                .arg(&ti)
                .arg(&ei)
                .arg(&ki)
                .arg(&kind)
                .arg(&n_group)
                .arg(&topk_group)
                .arg(&renorm)
                .arg(&scaling)
                .arg(&ids)
                .arg(&weights)
                .launch(LaunchConfig {
                    grid_dim: (t.div_ceil(4) as u32, 1, 1),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                })
        }
        .map(|_| ())
        .map_err(|e| err("route", e))
    }

    /// logits `[T, E]` = x `[T, H]` · gate `[E, H]`ᵀ in f32 (pedantic f32: no TF32).
    pub(super) fn gemm_f32_router(&self, b: &Buffers, t: usize) -> Result<()> {
        let (h, e) = (self.config.hidden as i32, self.config.num_experts as i32);
        let (alpha, beta) = (1.0f32, 0.0f32);
        let g = &self.gpu;
        // SAFETY: column-major view: C [E, T] = gate [H, E]ᵀ · x [H, T]; all buffers hold at
        // least those many f32 values.
        let st = unsafe {
            cb::cublasGemmEx(
                *self.blas.handle(),
                cb::cublasOperation_t::CUBLAS_OP_T,
                cb::cublasOperation_t::CUBLAS_OP_N,
                e,
                t as i32,
                h,
                &alpha as *const f32 as *const _,
                dptr(&self.w.gate, g) as *const _,
                cb::cudaDataType_t::CUDA_R_32F,
                h,
                dptr(&b.x, g) as *const _,
                cb::cudaDataType_t::CUDA_R_32F,
                h,
                &beta as *const f32 as *const _,
                dptr(&b.logits, g) as *mut _,
                cb::cudaDataType_t::CUDA_R_32F,
                e,
                cb::cublasComputeType_t::CUBLAS_COMPUTE_32F_PEDANTIC,
                cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        check(st, "router GEMM")
    }
}
