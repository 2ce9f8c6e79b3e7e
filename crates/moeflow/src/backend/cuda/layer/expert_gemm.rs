//! The shared experts (on a side stream beside the routed ones: cuBLAS, the fp8 Hopper GEMM
//! for a W8A8 layer's fp8 shared expert, or deterministic mode's fixed-order Hopper GEMM) and
//! the GEMM and activation helpers the experts share; the routed experts themselves are the
//! implementations in [`super::experts`].

use super::fp8_weights::Fp8Experts;
use super::hopper_fp8_gemm::{Fp8Operand, GemmOut, HopperFp8Gemm};
use super::hopper_gemm::Epilogue;
use super::masked_gemm::Fp8Rows;
use super::{check, dptr, err, Buffers, CudaMoeLayer};
use crate::error::Result;
use crate::experts::Activation;
use cudarc::cublas::{sys as cb, CudaBlas};
use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};

impl CudaMoeLayer {
    /// Forks side stream 0 from the layer's stream for the shared experts of the `t` tokens,
    /// after the layer's stream has quantized them where the layer does so once for all its
    /// experts ([`CudaMoeLayer::tokens_fp8`]); nothing without shared experts.
    pub(super) fn fork_shared(&self, b: &Buffers, t: usize) -> Result<()> {
        if self.w.shared.is_none() {
            return Ok(());
        }
        self.quantize_tokens_once(b, t)?;
        self.side.fork(&self.gpu.stream, [self.side.shared()])
    }

    /// Enqueues the shared experts of the `t` tokens in `b.x_bf` on side stream 0 (forked by
    /// [`CudaMoeLayer::fork_shared`]), writing `b.sy`; they overlap the routed experts until the
    /// main stream joins the side stream.
    pub(super) fn enqueue_shared(&self, b: &Buffers, t: usize) -> Result<()> {
        let Some(sh) = &self.w.shared else { return Ok(()) };
        if let (Some(on_fp8), Some(rows)) = (self.shared_fp8_gemm(), &b.shared_fp8) {
            return self.shared_fp8(b, t, on_fp8, rows);
        }
        if self.opts.deterministic {
            return self.shared_fixed(b, t);
        }
        let (h, si) = (self.config.hidden, sh.inter);
        let (stream, blas) = (&self.side.shared().stream, &self.side.shared().blas);
        let g = &self.gpu;
        let x = self.shared_input(stream, b, t)?;
        gemm_bf16(blas, dptr(&sh.w13, g), 2 * si, h, x, dptr(&b.sh13, g), t)?;
        // Null bias and expert map: the shared MLP is one expert without biases.
        self.act(stream, [dptr(&b.sh13, g), 0, 0, 0, dptr(&b.sact, g)], 0, t, si)?;
        self.round_shared_activation(stream, b, t)?;
        gemm_bf16(blas, dptr(&sh.w2, g), h, si, dptr(&b.sact, g), dptr(&b.sy, g), t)
    }

    /// Whether the shared expert multiplies fp8 rows (a W8A8 layer whose shared expert is fp8:
    /// see [`CudaMoeLayer::fp8_shared_expert`]).
    fn shared_w8a8(&self) -> bool {
        self.w8a8 && self.w.shared.as_ref().is_some_and(|sh| sh.fp8.is_some())
    }

    /// The fp8 GEMM and weights a W8A8 shared expert runs on: the fp8 Hopper GEMM where the
    /// layer's options allow it (not in deterministic mode) and it takes the shapes (hidden
    /// size a multiple of 16, intermediate of 64); `None` where bf16 GEMMs multiply the values
    /// the codes stand for instead.
    pub(super) fn shared_fp8_gemm(&self) -> Option<(&HopperFp8Gemm, &Fp8Experts)> {
        let sh = self.w.shared.as_ref().filter(|_| self.shared_w8a8() && self.opts.fp8_gemm)?;
        let fits = self.config.hidden.is_multiple_of(16) && sh.inter.is_multiple_of(64);
        let gemm = self.k.hopper_fp8_shared.as_ref().filter(|_| fits)?;
        Some((gemm, sh.fp8.as_ref()?))
    }

    /// The fp8 GEMM of a W8A8 shared expert (its own instance, whose tile counter no other
    /// stream shares), where the GPU has it. Beside an expert-parallel layer's dispatch it
    /// leaves the transport's SMs free ([`super::CudaOptions::transport_sms`]): on every SM
    /// its persistent blocks would hold the exchange's kernel back until they end.
    pub(super) fn shared_fp8_gemm_for(
        gpu: &super::Gpu,
        opts: &super::CudaOptions,
        expert_parallel: bool,
    ) -> Result<Option<HopperFp8Gemm>> {
        let gemm = HopperFp8Gemm::load(gpu, opts)?;
        Ok(gemm.map(|g| if expert_parallel { g.leaving(opts.transport_sms) } else { g }))
    }

    /// What multiplies the shared expert: `"hopper-fp8"` (a W8A8 shared expert on the fp8
    /// tensor cores), `"hopper"` (deterministic mode's fixed-order GEMM) or `"cublas"`; `None`
    /// without a shared expert.
    pub fn shared_expert_gemm(&self) -> Option<&'static str> {
        self.w.shared.as_ref()?;
        Some(match (self.shared_fp8_gemm(), self.opts.deterministic) {
            (Some(_), _) => "hopper-fp8",
            (None, true) => "hopper",
            (None, false) => "cublas",
        })
    }

    /// The shared expert's rows for bf16 GEMMs: `b.x_bf`, or where its rows are fp8
    /// ([`CudaMoeLayer::shared_w8a8`]) the values their codes stand for, written on `stream`
    /// into `b.sy` (which the down projection overwrites last).
    fn shared_input(&self, stream: &cudarc::driver::CudaStream, b: &Buffers, t: usize) -> Result<u64> {
        let x = dptr(&b.x_bf, &self.gpu);
        if !self.shared_w8a8() {
            return Ok(x);
        }
        let rounded = dptr(&b.sy, &self.gpu);
        self.quantize_rows_on(stream, x, [t, self.config.hidden], 1, 0, [0, 0, rounded])?;
        Ok(rounded)
    }

    /// Rounds the shared expert's activation `b.sact` in place to its fp8 values, on `stream`,
    /// where its rows are fp8 and bf16 GEMMs multiply them.
    fn round_shared_activation(&self, stream: &cudarc::driver::CudaStream, b: &Buffers, t: usize) -> Result<()> {
        match &self.w.shared {
            Some(sh) if self.shared_w8a8() => {
                let act = dptr(&b.sact, &self.gpu);
                self.quantize_rows_on(stream, act, [t, sh.inter], 1, 0, [0, 0, act])
            }
            _ => Ok(()),
        }
    }

    /// Where a call quantizes its tokens to fp8 once, on the layer's stream as the shared
    /// experts start, for both the fp8 shared expert and the routed experts that gather fp8
    /// rows (a one-GPU layer whose W8A8 shared expert runs on the fp8 tensor cores): the first
    /// `t · hidden` codes and `t · ceil(hidden / 128)` scales of the shared expert's rows.
    /// `None` elsewhere.
    pub(super) fn tokens_fp8(&self, b: &Buffers) -> Option<Fp8Operand> {
        let rows = b.shared_fp8.as_ref().filter(|_| self.ep.is_none())?;
        Some(Fp8Operand { codes: dptr(&rows.codes, &self.gpu), scales: dptr(&rows.scales, &self.gpu) })
    }

    /// Quantizes the `t` tokens of `b.x_bf` into [`CudaMoeLayer::tokens_fp8`] on the layer's
    /// stream, where the layer has them and its fused router has not quantized them already.
    fn quantize_tokens_once(&self, b: &Buffers, t: usize) -> Result<()> {
        match self.tokens_fp8(b) {
            Some(x) if !self.routes_fused(t) => self.quantize_tokens(&self.gpu.stream, b, t, x),
            _ => Ok(()),
        }
    }

    /// Quantizes the `t` tokens of `b.x_bf` (`[t, hidden]` bf16) on `stream` into fp8 codes
    /// with one scale per 128 values, at `into`.
    fn quantize_tokens(
        &self,
        stream: &cudarc::driver::CudaStream,
        b: &Buffers,
        t: usize,
        into: Fp8Operand,
    ) -> Result<()> {
        let x = dptr(&b.x_bf, &self.gpu);
        self.quantize_rows_on(stream, x, [t, self.config.hidden], 1, 0, [into.codes, into.scales, 0])
    }

    /// A W8A8 shared expert on the fp8 tensor cores, on side stream 0: its rows quantized into
    /// the first part of `rows` (unless the layer's stream has done it:
    /// [`CudaMoeLayer::tokens_fp8`]), the up projection with the activation in its
    /// epilogue, the activation quantized into the part after them, the down projection; each
    /// a one-expert fp8 Hopper GEMM with its own tile counter.
    fn shared_fp8(
        &self,
        b: &Buffers,
        t: usize,
        (gemm, fp8): (&HopperFp8Gemm, &Fp8Experts),
        rows: &Fp8Rows,
    ) -> Result<()> {
        let (h, si) = (self.config.hidden, self.w.shared.as_ref().map_or(0, |sh| sh.inter));
        let g = &self.gpu;
        let s = &self.side.shared().stream;
        let co = self.set_shared_rows(s, b, t)?;
        let a = Fp8Operand { codes: dptr(&rows.codes, g), scales: dptr(&rows.scales, g) };
        if self.tokens_fp8(b).is_none() {
            self.quantize_tokens(s, b, t, a)?;
        }
        let w13 = Fp8Operand { codes: dptr(&fp8.w13, g), scales: dptr(&fp8.s13, g) };
        let act = Epilogue::Activation { activation: self.config.activation, bias: 0 };
        gemm.run(s, w13, [2 * si, h], a, GemmOut::Bf16(dptr(&b.sact, g)), [t, t], co, 1, act, None)?;
        // The activation's codes go after the tokens', which the routed experts may still read.
        let after = (t * h) as u64;
        let act_rows = Fp8Operand { codes: a.codes + after, scales: a.scales + 4 * (t * h.div_ceil(128)) as u64 };
        self.quantize_rows_on(s, dptr(&b.sact, g), [t, si], 1, 0, [act_rows.codes, act_rows.scales, 0])?;
        let w2 = Fp8Operand { codes: dptr(&fp8.w2, g), scales: dptr(&fp8.s2, g) };
        gemm.run(s, w2, [h, si], act_rows, GemmOut::Bf16(dptr(&b.sy, g)), [t, t], co, 1, Epilogue::Product, None)
    }

    /// Sets `b.shared_rows` on `s` to the shared expert's `t` rows from offset 0, and returns
    /// the device addresses of that count and offset (the one-expert GEMMs' sizes).
    fn set_shared_rows(&self, s: &cudarc::driver::CudaStream, b: &Buffers, t: usize) -> Result<[u64; 2]> {
        let rows = dptr(&b.shared_rows, &self.gpu);
        for (at, value) in [(rows, t as u32), (rows + 4, 0)] {
            // SAFETY: sets one of the two ints of `shared_rows`, on the stream.
            let r = unsafe { cudarc::driver::sys::cuMemsetD32Async(at, value, 1, s.cu_stream()) };
            if r != cudarc::driver::sys::cudaError_enum::CUDA_SUCCESS {
                return Err(err("setting the shared expert's rows", r));
            }
        }
        Ok([rows, rows + 4])
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
        let s = &self.side.shared().stream;
        let co = self.set_shared_rows(s, b, t)?;
        let x = self.shared_input(s, b, t)?;
        let act = Epilogue::Activation { activation: self.config.activation, bias: 0 };
        hopper.run(s, dptr(&sh.w13, g), [2 * si, h], [x, dptr(&b.sact, g)], [t, t], co, 1, act, None)?;
        self.round_shared_activation(s, b, t)?;
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
