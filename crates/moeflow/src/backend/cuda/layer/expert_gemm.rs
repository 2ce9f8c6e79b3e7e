//! Stage 3, the experts: the single-GPU middle of the layer (count, permute, GEMMs), the
//! up projection, activation and down projection through the Hopper grouped GEMM, cuBLAS
//! (grouped, per expert over side streams, or padded and strided-batched) or the masked GEMM,
//! and the shared experts on a side stream.

use super::hopper_gemm::{Epilogue, Gather};
use super::{check, dptr, err, masked_gemm, Buffers, CudaMoeLayer, ExpertGemm};
use crate::error::{MoeError, Result};
use crate::experts::Activation;
use cudarc::cublas::{sys as cb, CudaBlas};
use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

impl CudaMoeLayer {
    /// The single-GPU middle of the layer: permute, the experts, output rows in `b.y`.
    pub(super) fn local_experts(&self, b: &mut Buffers, t: usize, mark: &dyn Fn(usize) -> Result<()>) -> Result<()> {
        let (e, k) = (self.config.num_experts, self.config.top_k);
        let g = &self.gpu;
        let s = &g.stream;
        let (ip, cp, slots, ei) = (dptr(&b.ids, g), dptr(&b.counts, g), (t * k) as i32, e as i32);
        // The fused router has written the counts, offsets and maps already.
        let fused = self.routes_fused(t);
        if !fused {
            let warps = LaunchConfig { grid_dim: (e as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: count_slots(int*, int, int, int*) over the `t k` ids of this batch.
            unsafe { s.launch_builder(&self.k.count).arg(&ip).arg(&slots).arg(&ei).arg(&cp).launch(warps) }
                .map_err(|e| err("count", e))?;
        }
        // fp8 experts run the masked GEMM on the grouped (unpadded) rows while the weights
        // dominate (up to 32 rows per expert on average, where reading half the bytes wins;
        // docs/tuning.md); cuBLAS on their bf16 values above (rows rounded to fp8 first when
        // they are quantized too).
        let fp8 = self.w.fp8.is_some() && self.masked && t * k <= 32 * e;
        // Expert sizes on the host decide cuBLAS's GEMM shapes; the masked and Hopper GEMMs
        // read them on the device, so the host does not wait for them.
        let on_device = fp8 || self.hopper_for(t * k, e).is_some();
        let mut counts = Vec::new();
        if !on_device {
            counts = vec![0i32; e];
            s.memcpy_dtoh(&b.counts, &mut counts).map_err(|e| err("reading expert counts", e))?;
        }
        let cap = if on_device { 0 } else { self.padding(e, t * k, counts.iter().map(|&c| c as usize)) };
        // The Hopper GEMM gathers the rows of its up projection itself.
        let gather = (!fp8 && self.hopper_gathers(t * k, e, cap)).then(|| Gather {
            x: dptr(&b.x_bf, g),
            slot_of_row: dptr(&b.slot_of_row, g),
            k,
        });
        if !fused {
            self.permute(b, t, cap, gather.is_none())?;
        }
        let mut groups = Vec::new();
        let mut off = 0usize;
        for (x, &cnt) in counts.iter().enumerate() {
            if cnt > 0 {
                groups.push((x, off, cnt as usize));
            }
            off += cnt as usize;
        }
        mark(2)?;
        mark(3)?;
        let bufs = [dptr(&b.a, g), dptr(&b.h13, g), dptr(&b.act, g), dptr(&b.y, g), dptr(&b.expert_of_row, g)];
        if fp8 {
            // fp8 experts: the masked GEMM over the grouped rows, counts and offsets on the device.
            let [a, h13, act, y, expert_of_row] = bufs;
            let (counts, offsets) = (dptr(&b.counts, g), dptr(&b.offsets, g));
            let b13 = self.w.b13.as_ref().map_or(0u64, |x| dptr(x, g));
            self.masked_gemm(masked_gemm::Projection::Up, [a, h13], 0, counts, offsets, t * k)?;
            mark(4)?;
            self.act(s, [h13, b13, expert_of_row, 0, act], 0, t * k, self.config.inter)?;
            mark(5)?;
            self.masked_gemm(masked_gemm::Projection::Down, [act, y], 0, counts, offsets, t * k)?;
            mark(6)?;
        } else {
            let dev = [dptr(&b.counts, g), dptr(&b.offsets, g)];
            self.mlp(b, bufs, e, cap, (&groups, dev), t * k, gather, mark)?;
        }
        mark(7)
    }

    /// Padded (`cap` rows per expert, one strided-batched GEMM) unless padding would more
    /// than double `rows`, or the Hopper GEMM runs (it takes the grouped layout as it is, see
    /// `hopper_for`); 0 means grouped.
    pub(super) fn padding(&self, experts: usize, rows: usize, counts: impl Iterator<Item = usize>) -> usize {
        let max = counts.max().unwrap_or(0);
        let padded = match self.opts.expert_gemm {
            ExpertGemm::Padded => true,
            ExpertGemm::Auto => self.hopper_for(rows, experts).is_none() && rows / experts.max(1) <= 192,
            ExpertGemm::Cublas => rows / experts.max(1) <= 192,
            ExpertGemm::Loop | ExpertGemm::Grouped | ExpertGemm::Hopper => false,
        };
        if padded && experts * max <= 2 * rows {
            max
        } else {
            0
        }
    }

    /// GEMM, activation, GEMM over `a` (rows grouped as `groups` say, or padded to `cap` per
    /// expert over `experts` experts; `dev` holds the same counts and row offsets on the
    /// device; the Hopper GEMM runs when the offsets are there, with the activation in its
    /// up projection's epilogue), writing `y`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mlp(
        &self,
        b: &mut Buffers,
        bufs: [u64; 5],
        experts: usize,
        cap: usize,
        (groups, dev): (&[(usize, usize, usize)], [u64; 2]),
        rows_total: usize,
        gather: Option<Gather>,
        mark: &dyn Fn(usize) -> Result<()>,
    ) -> Result<()> {
        let [a, h13, act, y, expert_of_row] = bufs;
        let (h, i) = (self.config.hidden, self.config.inter);
        let act_rows = if cap > 0 { experts * cap } else { rows_total };
        // W8A8 through cuBLAS: the rows rounded to their fp8 values first.
        if self.w8a8 {
            self.round_rows_fp8(a, act_rows, h)?;
        }
        let b13 = self.w.b13.as_ref().map_or(0u64, |x| dptr(x, &self.gpu));
        let hopper = self.hopper_for(rows_total, experts).filter(|_| cap == 0 && dev[1] != 0);
        if gather.is_some() && hopper.is_none() {
            return Err(MoeError::Unsupported("rows left to gather without the Hopper GEMM".into()));
        }
        if let Some(hg) = hopper {
            let epilogue = Epilogue::Activation { activation: self.config.activation, bias: b13 };
            hg.run(
                &self.gpu.stream,
                dptr(&self.w.w13, &self.gpu),
                [2 * i, h],
                [a, act],
                act_rows,
                dev,
                experts,
                epilogue,
                gather,
            )?;
            mark(4)?;
        } else {
            match cap {
                0 => self.grouped_gemm(b, &self.w.w13, 2 * i, h, a, h13, groups)?,
                _ => self.padded_gemm(&self.w.w13, 2 * i, h, a, h13, experts, cap)?,
            }
            mark(4)?;
            self.act(&self.gpu.stream, [h13, b13, expert_of_row, 0, act], cap as i32, act_rows, i)?;
        }
        if self.w8a8 {
            self.round_rows_fp8(act, act_rows, i)?;
        }
        mark(5)?;
        match (hopper, cap) {
            (Some(hg), _) => {
                let w2 = dptr(&self.w.w2, &self.gpu);
                hg.run(&self.gpu.stream, w2, [h, i], [act, y], act_rows, dev, experts, Epilogue::Product, None)?
            }
            (None, 0) => self.grouped_gemm(b, &self.w.w2, h, i, act, y, groups)?,
            (None, _) => self.padded_gemm(&self.w.w2, h, i, act, y, experts, cap)?,
        }
        mark(6)
    }

    /// For each group (expert, first row, rows): `C[rows, n] = A[rows, kdim] · W[expert]ᵀ`,
    /// bf16 in and out, f32 accumulation, one grouped cuBLAS call.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn grouped_gemm(
        &self,
        b: &mut Buffers,
        w: &CudaSlice<u16>,
        n: usize,
        kdim: usize,
        a: u64,
        c: u64,
        groups: &[(usize, usize, usize)],
    ) -> Result<()> {
        if groups.is_empty() {
            return Ok(());
        }
        if !self.grouped {
            // One cuBLAS GEMM per expert, spread over the side streams: each picks its best
            // tensor-core kernel for its size, and together they fill the GPU.
            let main = &self.gpu.stream;
            let streams = self.side.gemm();
            self.side.fork(main, streams)?;
            let wbase = dptr(w, &self.gpu);
            for (q, &(x, off, r)) in groups.iter().enumerate() {
                let blas = &streams[q % streams.len()].blas;
                gemm_bf16(
                    blas,
                    wbase + 2 * (x * n * kdim) as u64,
                    n,
                    kdim,
                    a + 2 * (off * kdim) as u64,
                    c + 2 * (off * n) as u64,
                    r,
                )?;
            }
            self.side.join(main, streams)?;
            return Ok(());
        }
        let g = &self.gpu;
        let count = groups.len();
        let wbase = dptr(w, g);
        let mut ptrs = Vec::with_capacity(3 * count);
        ptrs.extend(groups.iter().map(|&(x, _, _)| wbase + 2 * (x * n * kdim) as u64));
        ptrs.extend(groups.iter().map(|&(_, off, _)| a + 2 * (off * kdim) as u64));
        ptrs.extend(groups.iter().map(|&(_, off, _)| c + 2 * (off * n) as u64));
        g.stream.memcpy_htod(&ptrs, &mut b.ptrs.slice_mut(0..3 * count)).map_err(|e| err("GEMM pointer arrays", e))?;
        let base = dptr(&b.ptrs, g);
        let ta = vec![cb::cublasOperation_t::CUBLAS_OP_T; count];
        let tb = vec![cb::cublasOperation_t::CUBLAS_OP_N; count];
        let m: Vec<i32> = vec![n as i32; count];
        let nn: Vec<i32> = groups.iter().map(|&(_, _, r)| r as i32).collect();
        let kk: Vec<i32> = vec![kdim as i32; count];
        let ones = vec![1.0f32; count];
        let zeros = vec![0.0f32; count];
        let sizes = vec![1i32; count];
        // SAFETY: column-major per group: C [n, rows] = W [kdim, n]ᵀ · A [kdim, rows]; the
        // device pointer arrays (uploaded above, stream-ordered) address `count` matrices of
        // those sizes inside the weight and workspace buffers; host arrays have `count` entries.
        let st = unsafe {
            cb::cublasGemmGroupedBatchedEx(
                *self.blas.handle(),
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
    }

    /// Padded layout: expert `x` owns rows `x·cap..(x+1)·cap`; one strided-batched GEMM
    /// `C[x] = A[x] · W[x]ᵀ` over all experts (rows past an expert's count are ignored later).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn padded_gemm(
        &self,
        w: &CudaSlice<u16>,
        n: usize,
        kdim: usize,
        a: u64,
        c: u64,
        experts: usize,
        cap: usize,
    ) -> Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: per batch entry x, column-major C_x [n, cap] = W_x [kdim, n]ᵀ · A_x [kdim, cap],
        // strides in elements; the buffers hold `experts` such matrices.
        let st = unsafe {
            cb::cublasGemmStridedBatchedEx(
                *self.blas.handle(),
                cb::cublasOperation_t::CUBLAS_OP_T,
                cb::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                cap as i32,
                kdim as i32,
                &alpha as *const f32 as *const _,
                dptr(w, &self.gpu) as *const _,
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
                experts as i32,
                cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        check(st, "padded batched GEMM")
    }
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

    /// Deterministic mode's shared expert, on the layer's stream (the Hopper GEMM's tile
    /// counter serves one stream): the up projection with the activation in its epilogue and
    /// the down projection, each a one-expert Hopper GEMM, whose sums do not depend on the
    /// batch.
    fn shared_fixed(&self, b: &Buffers, t: usize) -> Result<()> {
        let Some(sh) = &self.w.shared else { return Ok(()) };
        let hopper = self.k.hopper.as_ref().expect("deterministic layers have the Hopper GEMM");
        let (h, si) = (self.config.hidden, sh.inter);
        let g = &self.gpu;
        let s = &g.stream;
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
        hopper.run(s, dptr(&sh.w13, g), [2 * si, h], [dptr(&b.x_bf, g), dptr(&b.sact, g)], t, co, 1, act, None)?;
        hopper.run(s, dptr(&sh.w2, g), [h, si], [dptr(&b.sact, g), dptr(&b.sy, g)], t, co, 1, Epilogue::Product, None)
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
