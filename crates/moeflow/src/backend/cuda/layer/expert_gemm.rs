//! The shared experts (on a side stream beside the routed ones, or on the layer's stream in
//! deterministic mode) and the GEMM and activation helpers the experts share; the routed
//! experts themselves are the implementations in [`super::experts`].

use super::hopper_gemm::Epilogue;
use super::{check, dptr, err, Buffers, CudaMoeLayer};
use crate::error::Result;
use crate::experts::Activation;
use cudarc::cublas::{sys as cb, CudaBlas};
use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};

impl CudaMoeLayer {
    /// Starts the shared experts of the `t` tokens in `b.x_bf` on side stream 0, writing `b.sy`;
    /// they overlap the routed experts until the main stream joins the side stream.
    pub(super) fn shared_on_side_stream(&self, b: &Buffers, t: usize) -> Result<()> {
        let Some(sh) = &self.w.shared else { return Ok(()) };
        let (h, si) = (self.config.hidden, sh.inter);
        if self.opts.deterministic {
            return self.shared_fixed(b, t);
        }
        let (stream, blas) = (&self.side.shared().stream, &self.side.shared().blas);
        self.side.fork(&self.gpu.stream, [self.side.shared()])?;
        let g = &self.gpu;
        gemm_bf16(blas, dptr(&sh.w13, g), 2 * si, h, dptr(&b.x_bf, g), dptr(&b.sh13, g), t)?;
        // Null bias and expert map: the shared MLP is one expert without biases.
        self.act(stream, [dptr(&b.sh13, g), 0, 0, 0, dptr(&b.sact, g)], 0, t, si)?;
        gemm_bf16(blas, dptr(&sh.w2, g), h, si, dptr(&b.sact, g), dptr(&b.sy, g), t)
    }

    /// Deterministic mode's shared expert, on side stream 0 beside the routed experts: the up
    /// projection with the activation in its epilogue and the down projection, each a
    /// one-expert Hopper GEMM (its own instance, whose tile counter no other stream shares),
    /// whose sums do not depend on the batch.
    fn shared_fixed(&self, b: &Buffers, t: usize) -> Result<()> {
        let Some(sh) = &self.w.shared else { return Ok(()) };
        let hopper = self.k.hopper_shared.as_ref().expect("deterministic layers have the Hopper GEMM");
        let (h, si) = (self.config.hidden, sh.inter);
        let g = &self.gpu;
        let side = self.side.shared();
        self.side.fork(&g.stream, [side])?;
        let s = &side.stream;
        let rows = dptr(&b.shared_rows, g);
        // SAFETY: sets the two ints of `shared_rows` (t rows from offset 0), on the stream.
        unsafe {
            let st = s.cu_stream();
            let r = cudarc::driver::sys::cuMemsetD32Async(rows, t as u32, 1, st);
            if r != cudarc::driver::sys::cudaError_enum::CUDA_SUCCESS {
                return Err(err("setting the shared expert's rows", r));
            }
            let r = cudarc::driver::sys::cuMemsetD32Async(rows + 4, 0, 1, st);
            if r != cudarc::driver::sys::cudaError_enum::CUDA_SUCCESS {
                return Err(err("setting the shared expert's rows", r));
            }
        }
        let co = [rows, rows + 4];
        let act = Epilogue::Activation { activation: self.config.activation, bias: 0 };
        hopper.run(s, dptr(&sh.w13, g), [2 * si, h], [dptr(&b.x_bf, g), dptr(&b.sact, g)], [t, t], co, 1, act, None)?;
        hopper.run(
            s,
            dptr(&sh.w2, g),
            [h, si],
            [dptr(&b.sact, g), dptr(&b.sy, g)],
            [t, t],
            co,
            1,
            Epilogue::Product,
            None,
        )
    }

    /// [`act_and_mul`] with this layer's kernel and activation.
    pub(super) fn act(
        &self,
        stream: &cudarc::driver::CudaStream,
        ptrs: [u64; 5],
        cap: i32,
        rows: usize,
        inter: usize,
    ) -> Result<()> {
        act_and_mul(stream, &self.k.act, self.config.activation, ptrs, cap, rows, inter)
    }
}

/// `C[rows, n] = A[rows, kdim] · W[n, kdim]ᵀ` on `blas`'s stream, bf16 in and out, f32
/// accumulation; `w`, `a`, `c` are device addresses.
pub(in crate::backend::cuda) fn gemm_bf16(
    blas: &CudaBlas,
    w: u64,
    n: usize,
    kdim: usize,
    a: u64,
    c: u64,
    rows_: usize,
) -> Result<()> {
    let (alpha, beta) = (1.0f32, 0.0f32);
    // SAFETY: column-major C [n, rows] = W [kdim, n]ᵀ · A [kdim, rows]; the caller passes
    // addresses of buffers holding at least those many bf16 values.
    let st = unsafe {
        cb::cublasGemmEx(
            *blas.handle(),
            cb::cublasOperation_t::CUBLAS_OP_T,
            cb::cublasOperation_t::CUBLAS_OP_N,
            n as i32,
            rows_ as i32,
            kdim as i32,
            &alpha as *const f32 as *const _,
            w as *const _,
            cb::cudaDataType_t::CUDA_R_16BF,
            kdim as i32,
            a as *const _,
            cb::cudaDataType_t::CUDA_R_16BF,
            kdim as i32,
            &beta as *const f32 as *const _,
            c as *mut _,
            cb::cudaDataType_t::CUDA_R_16BF,
            n as i32,
            cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    };
    check(st, "bf16 GEMM")
}

/// Launches the act-and-mul kernel on `stream`: `out [rows, inter] = act(gate + b13) · (up +
/// b13)` from `h13 [rows, 2 inter]`, the bias row chosen by `expert_of_row` (or `row / cap` when
/// `cap > 0`, skipping rows past `counts[row / cap]` when `counts` is given); `ptrs` = [h13,
/// b13, expert_of_row, counts, out], 0 meaning no bias / no map / no counts.
pub(in crate::backend::cuda) fn act_and_mul(
    stream: &cudarc::driver::CudaStream,
    kernel: &CudaFunction,
    activation: Activation,
    ptrs: [u64; 5],
    cap: i32,
    rows: usize,
    inter: usize,
) -> Result<()> {
    let [h13, b13, expert_of_row, counts, out] = ptrs;
    let (kind, alpha, limit) = act_params(activation);
    let (rows_l, inter_i) = (rows as i64, inter as i32);
    // SAFETY: act_and_mul(bf16*, float*, int*, int, int*, long, int, int, float, float, bf16*)
    // over `rows` rows of buffers the caller sized for them.
    unsafe {
        stream
            .launch_builder(kernel)
            .arg(&h13)
            .arg(&b13)
            .arg(&expert_of_row)
            .arg(&cap)
            .arg(&counts)
            .arg(&rows_l)
            .arg(&inter_i)
            .arg(&kind)
            .arg(&alpha)
            .arg(&limit)
            .arg(&out)
            .launch(LaunchConfig {
                grid_dim: (rows.clamp(1, 1 << 20) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
    }
    .map(|_| ())
    .map_err(|e| err("act_and_mul", e))
}

pub(super) fn act_params(a: Activation) -> (i32, f32, f32) {
    match a {
        Activation::Silu => (0, 0.0, 0.0),
        Activation::GeluErf => (1, 0.0, 0.0),
        Activation::GeluTanh => (2, 0.0, 0.0),
        Activation::SwigluOai { alpha, limit } => (3, alpha, limit),
    }
}
