//! Fixed-capacity low-latency expert parallelism on the device, the shape of DeepEP's
//! low-latency mode: every buffer, message and GEMM is sized by the capacity `M` tokens per
//! rank, never by the batch, and nothing is read back to the host, so the whole layer (routing,
//! dispatch, expert GEMMs, combine, shared experts) is captured once in a CUDA graph and
//! replayed on every call. The batch size lives in device memory; rows past it ride along
//! unused.
//!
//! Each rank sends every rank one message of `M` rows (`[k local ids | k weights | H bf16]`,
//! ids -1 where the token has no expert there), the receiver lays the rows out `n·M` per local
//! expert (a token reaches an expert at most once) and counts them on the device, the masked
//! grouped GEMM (`kernels/masked_gemm.cu`) runs each expert over its counted rows only, and the
//! weighted sum per message row goes back as one bf16 row, summed at home in rank order.

use super::{dptr, err, grid, rows, CudaMoeLayer, EpLink, GpuStageTimes};
use crate::error::{MoeError, Result};
use cudarc::cublas::sys as cb;
use cudarc::driver::{sys as drv, CudaGraph, CudaSlice, LaunchConfig, PushKernelArg};

/// cuBLAS workspace per handle, set before capture so no GEMM allocates inside the graph.
const BLAS_WORKSPACE: usize = 32 << 20;

/// Dynamic shared memory of the masked GEMM, the larger of its two forms (masked_gemm.cu):
/// bf16, 4 stages of 128 weight rows and 64 token rows 64 deep, 144 bytes apart; fp8 needs
/// 4 · (128 · 144 + 32 · 272) = 108544.
const MASKED_GEMM_SMEM: u32 = 4 * (128 + 64) * 72 * 2;

/// Lets `masked_gemm` take its shared memory (above the 48 KiB a launch gets by default).
fn allow_masked_gemm_smem(f: &cudarc::driver::CudaFunction) -> Result<()> {
    f.set_attribute(
        drv::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        MASKED_GEMM_SMEM as i32,
    )
    .map_err(|e| err("masked_gemm shared memory", e))
}

/// Launch shape of the masked GEMM over `n` output columns of `experts` experts: 128 columns a
/// block, 128 threads (256 for fp8 weights).
fn masked_gemm_launch(n: usize, experts: usize, fp8: bool) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(128) as u32, experts as u32, 1),
        block_dim: (if fp8 { 256 } else { 128 }, 1, 1),
        shared_mem_bytes: MASKED_GEMM_SMEM,
    }
}

/// The captured layer. CUDA graphs are not synchronised internally; this one is only touched
/// under the layer's buffer lock.
struct LayerGraph(CudaGraph);

// SAFETY: the graph is used from one thread at a time (under the layer's buffer mutex), which
// is all CUDA asks of graph objects.
unsafe impl Send for LayerGraph {}

/// Low-latency buffers, all sized by the capacity, and the captured layer.
pub(super) struct LlBuffers {
    /// Tokens in the current batch, read on the device.
    tokens: CudaSlice<i32>,
    send: CudaSlice<u8>,
    recv: CudaSlice<u8>,
    home_rows: CudaSlice<i32>,
    row_of_slot: CudaSlice<i32>,
    counts: CudaSlice<i32>,
    a: CudaSlice<u16>,
    h13: CudaSlice<u16>,
    act: CudaSlice<u16>,
    y: CudaSlice<u16>,
    part: CudaSlice<u16>,
    back: CudaSlice<u16>,
    /// cuBLAS workspaces (main handle, shared-expert handle); they must outlive the graph.
    _workspaces: Vec<CudaSlice<u8>>,
    graph: Option<LayerGraph>,
}

/// The two expert projections: gate and up (`w13`), down (`w2`).
#[derive(Clone, Copy)]
enum Projection {
    Up,
    Down,
}

/// Bytes of one message row: `k` ids and `k` weights, padded to 16 bytes, then `h` bf16.
fn row_stride(h: usize, k: usize) -> usize {
    (8 * k).div_ceil(16) * 16 + (2 * h).div_ceil(16) * 16
}

impl CudaMoeLayer {
    /// Switches this expert-parallel layer to fixed-capacity low-latency dispatch for batches of
    /// at most `max_tokens_per_rank` tokens per rank: the first call runs the layer once and
    /// captures it in a CUDA graph, every call replays that graph. Collective like the layer's
    /// other calls: every rank switches with the same capacity.
    pub fn low_latency(self, max_tokens_per_rank: usize) -> Result<Self> {
        let mut layer = self;
        let Some(link) = layer.ep.as_mut() else {
            return Err(MoeError::Config("low-latency dispatch needs an expert-parallel layer (new_ep)".into()));
        };
        if max_tokens_per_rank == 0 {
            return Err(MoeError::Config("lowlatency needs max_tokens_per_rank > 0".into()));
        }
        link.capacity = Some(max_tokens_per_rank);
        allow_masked_gemm_smem(&layer.k.masked_gemm)?;
        allow_masked_gemm_smem(&layer.k.masked_gemm_fp8)?;
        let ll = layer.ll_buffers(max_tokens_per_rank)?;
        let mut guard = layer.bufs.lock().unwrap_or_else(|p| p.into_inner());
        layer.buffers(&mut guard, max_tokens_per_rank)?.ll = Some(ll);
        drop(guard);
        Ok(layer)
    }

    /// The low-latency capacity in tokens per rank, when the layer dispatches that way.
    pub fn capacity(&self) -> Option<usize> {
        self.ep.as_ref().and_then(|l| l.capacity)
    }

    fn ll_buffers(&self, m: usize) -> Result<LlBuffers> {
        use crate::comm::Communicator;
        let link = self.ep.as_ref().expect("checked by the caller");
        let c = &self.config;
        let (h, i, k, n, el) = (c.hidden, c.inter, c.top_k, link.comm.size(), link.local);
        let (msg, cap) = (n * m, n * m);
        let s = &self.gpu.stream;
        let z16 = |n: usize| s.alloc_zeros::<u16>(n.max(1)).map_err(|e| err("allocating workspace", e));
        let z32 = |n: usize| s.alloc_zeros::<i32>(n.max(1)).map_err(|e| err("allocating workspace", e));
        let z8 = |n: usize| s.alloc_zeros::<u8>(n.max(1)).map_err(|e| err("allocating workspace", e));
        let workspaces = vec![z8(BLAS_WORKSPACE)?, z8(BLAS_WORKSPACE)?];
        for (ws, blas) in workspaces.iter().zip([&self.blas, &self.side[0].1]) {
            // SAFETY: the workspace is device memory of BLAS_WORKSPACE bytes held by these
            // buffers; the layer drops its cuBLAS handles (fields `side`, `blas`) before them.
            let st = unsafe { cb::cublasSetWorkspace_v2(*blas.handle(), dptr(ws, &self.gpu) as _, BLAS_WORKSPACE) };
            super::check(st, "cuBLAS workspace")?;
        }
        Ok(LlBuffers {
            tokens: z32(1)?,
            send: z8(msg * row_stride(h, k))?,
            recv: z8(msg * row_stride(h, k))?,
            home_rows: z32(m * n)?,
            row_of_slot: z32(msg * k)?,
            counts: z32(el)?,
            a: z16(el * cap * h)?,
            h13: z16(el * cap * 2 * i)?,
            act: z16(el * cap * i)?,
            y: z16(el * cap * h)?,
            part: z16(msg * h)?,
            back: z16(msg * h)?,
            _workspaces: workspaces,
            graph: None,
        })
    }

    /// Runs the low-latency layer on the first `t` of the capacity's rows of `b.x` (into
    /// `b.out`): sets the batch size on the device, replays the layer's graph (capturing it on
    /// the first call, after one direct run), and waits. With `timed`, only the total is
    /// measured (events around the replay).
    pub(super) fn ll_run(&self, b: &mut super::Buffers, t: usize, timed: bool) -> Result<GpuStageTimes> {
        let link = self.ep.as_ref().expect("low-latency layers are expert-parallel");
        let m = link.capacity.expect("low-latency layers have a capacity");
        let s = &self.gpu.stream;
        self.ll_set_tokens(b, t)?;
        if b.ll.as_ref().expect("allocated by low_latency()").graph.is_none() {
            // A direct run first: NCCL connects its peers, cuBLAS picks its kernels, the
            // modules load, none of which may happen inside a capture.
            self.run(b, m, false)?;
            s.begin_capture(drv::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| err("begin capture", e))?;
            let enqueued = self.enqueue(b, m, &|_| Ok(()));
            let captured = s.end_capture(drv::CUgraphInstantiate_flags_enum(0));
            enqueued?;
            let graph =
                captured.map_err(|e| err("end capture", e))?.ok_or_else(|| err("end capture", "empty graph"))?;
            b.ll.as_mut().expect("allocated").graph = Some(LayerGraph(graph));
        }
        let graph = &b.ll.as_ref().expect("allocated").graph.as_ref().expect("captured above").0;
        let events = if timed {
            let ev = || self.gpu.ctx.new_event(Some(drv::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| err("event", e));
            Some((ev()?, ev()?))
        } else {
            None
        };
        if let Some((start, _)) = &events {
            start.record(s).map_err(|e| err("event", e))?;
        }
        graph.launch().map_err(|e| err("graph launch", e))?;
        if let Some((_, stop)) = &events {
            stop.record(s).map_err(|e| err("event", e))?;
        }
        link.comm.wait("moe layer", s)?;
        let Some((start, stop)) = events else { return Ok(GpuStageTimes::default()) };
        let total = start.elapsed_ms(&stop).map_err(|e| err("event time", e))? as f64;
        Ok(GpuStageTimes { total, dispatch_bytes: self.ll_sent_bytes(), ..GpuStageTimes::default() })
    }

    /// A clear error when `t` tokens exceed the low-latency capacity (checked before any
    /// communication).
    pub(super) fn check_capacity(&self, t: usize) -> Result<()> {
        match self.capacity() {
            Some(m) if t > m => Err(MoeError::Config(format!(
                "batch of {t} tokens exceeds the low-latency capacity of {m} tokens per rank"
            ))),
            _ => Ok(()),
        }
    }

    /// Writes the batch size `t` where the low-latency kernels read it.
    pub(super) fn ll_set_tokens(&self, b: &mut super::Buffers, t: usize) -> Result<()> {
        self.check_capacity(t)?;
        let ll = b.ll.as_mut().expect("allocated by low_latency()");
        self.gpu.stream.memcpy_htod(&[t as i32], &mut ll.tokens).map_err(|e| err("batch size", e))
    }

    /// Whether the masked GEMM takes this layer's shapes (`K % 8 == 0`, even `N`), unless
    /// `MOEFLOW_LL_GEMM=padded` asks for cuBLAS over the whole padded layout.
    fn masked_gemm_fits(&self) -> bool {
        let (h, i) = (self.config.hidden, self.config.inter);
        h % 8 == 0 && i % 8 == 0 && std::env::var("MOEFLOW_LL_GEMM").as_deref() != Ok("padded")
    }

    /// `C[x·cap + r] = A[x·cap + r] · W[x]ᵀ` for every local expert `x` and `r < counts[x]`
    /// (read on the device) with the weights of `projection`: fp8 codes when the layer holds
    /// them (and their depth is a multiple of 16), else bf16; bf16 in and out, f32 accumulation.
    fn masked_gemm(&self, projection: Projection, a: u64, c: u64, cap: usize, counts: u64) -> Result<()> {
        let (h, i) = (self.config.hidden, self.config.inter);
        let (w, n, kdim, fp8) = match projection {
            Projection::Up => (&self.w.w13, 2 * i, h, self.w.fp8.as_ref().map(|f| (&f.w13, &f.s13))),
            Projection::Down => (&self.w.w2, h, i, self.w.fp8.as_ref().map(|f| (&f.w2, &f.s2))),
        };
        let fp8 = fp8.filter(|_| kdim % 16 == 0);
        let experts = w.len() / (n * kdim);
        let (capi, ni, ki) = (cap as i32, n as i32, kdim as i32);
        let cfg = masked_gemm_launch(n, experts, fp8.is_some());
        let s = &self.gpu.stream;
        // SAFETY: masked_gemm(bf16*, bf16*, bf16*, int*, int, int, int) and masked_gemm_fp8(u8*,
        // float*, bf16*, bf16*, int*, int, int, int): W holds `experts` [n, kdim] matrices (and
        // their block scales), A and C `experts · cap` rows of kdim and n values, counts one int
        // per expert; kdim % 8 == 0 (16 for fp8) and n is even (masked_gemm_fits).
        unsafe {
            match fp8 {
                Some((codes, scales)) => {
                    let (wp, sp) = (dptr(codes, &self.gpu), dptr(scales, &self.gpu));
                    let mut l = s.launch_builder(&self.k.masked_gemm_fp8);
                    l.arg(&wp).arg(&sp).arg(&a).arg(&c).arg(&counts).arg(&capi).arg(&ni).arg(&ki);
                    l.launch(cfg)
                }
                None => {
                    let wp = dptr(w, &self.gpu);
                    let mut l = s.launch_builder(&self.k.masked_gemm);
                    l.arg(&wp).arg(&a).arg(&c).arg(&counts).arg(&capi).arg(&ni).arg(&ki);
                    l.launch(cfg)
                }
            }
        }
        .map(|_| ())
        .map_err(|e| err("masked_gemm", e))
    }

    /// Bytes one rank sends to the others per call: one message of `M` rows to each.
    fn ll_sent_bytes(&self) -> usize {
        use crate::comm::Communicator;
        let link = self.ep.as_ref().expect("expert-parallel");
        let c = &self.config;
        (link.comm.size() - 1) * link.capacity.unwrap_or(0) * row_stride(c.hidden, c.top_k)
    }

    /// The low-latency middle of the layer, after routing `M` rows: pack the messages, exchange
    /// them, group the received rows by local expert, the GEMMs over the padded layout, the
    /// weighted partial sums, their return and the sum at home into `b.out`. Enqueue only.
    pub(super) fn ll_experts(
        &self,
        b: &mut super::Buffers,
        link: &EpLink,
        mark: &dyn Fn(usize) -> Result<()>,
    ) -> Result<usize> {
        use crate::comm::Communicator;
        let c = &self.config;
        let (h, k) = (c.hidden, c.top_k);
        let (n, el, m) = (link.comm.size(), link.local, link.capacity.expect("low-latency"));
        let (msg, cap, stride) = (n * m, n * m, row_stride(h, k));
        let g = &self.gpu;
        let s = &g.stream;
        let ll = b.ll.as_ref().expect("allocated by low_latency()");
        let (xb, ids, w, tokens) = (dptr(&b.x_bf, g), dptr(&b.ids, g), dptr(&b.weights, g), dptr(&ll.tokens, g));
        let (send, recv, home_rows, row_of_slot) =
            (dptr(&ll.send, g), dptr(&ll.recv, g), dptr(&ll.home_rows, g), dptr(&ll.row_of_slot, g));
        let (counts, a, part, back) = (dptr(&ll.counts, g), dptr(&ll.a, g), dptr(&ll.part, g), dptr(&ll.back, g));
        let bufs = [a, dptr(&ll.h13, g), dptr(&ll.act, g), dptr(&ll.y, g), 0];
        let (mi, ki, hi, eli, stride_l, msg_i, cap_i) =
            (m as i32, k as i32, h as i32, el as i32, stride as i64, msg as i32, cap as i32);
        // SAFETY: ll_pack(bf16*, int*, float*, int*, int, int, int, int, long, u8*, int*) over M
        // tokens × n destinations of buffers sized for them (routing ran on M rows).
        unsafe {
            s.launch_builder(&self.k.ll_pack)
                .arg(&xb)
                .arg(&ids)
                .arg(&w)
                .arg(&tokens)
                .arg(&mi)
                .arg(&ki)
                .arg(&hi)
                .arg(&eli)
                .arg(&stride_l)
                .arg(&send)
                .arg(&home_rows)
                .launch(LaunchConfig { grid_dim: (m as u32, n as u32, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 })
        }
        .map_err(|e| err("ll_pack", e))?;
        mark(2)?;
        let every = vec![m; n];
        self.exchange_rows(link, "moe low-latency dispatch", &[(send, stride)], &every, &[(recv, stride)], &every)?;
        // SAFETY: row_of_slot holds msg · k ints; ll_group(u8*, long, int, int, int, int*, int*)
        // and ll_gather(u8*, long, int, int, int, int*, bf16*) read the msg received rows and
        // write rows below el · cap of `a`.
        unsafe {
            cudarc::driver::result::memset_d8_async(row_of_slot, 0xff, 4 * msg * k, s.cu_stream())
                .map_err(|e| err("memset", e))?;
            s.launch_builder(&self.k.ll_group)
                .arg(&recv)
                .arg(&stride_l)
                .arg(&msg_i)
                .arg(&ki)
                .arg(&cap_i)
                .arg(&row_of_slot)
                .arg(&counts)
                .launch(LaunchConfig { grid_dim: (el as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 })
                .map_err(|e| err("ll_group", e))?;
            s.launch_builder(&self.k.ll_gather)
                .arg(&recv)
                .arg(&stride_l)
                .arg(&msg_i)
                .arg(&ki)
                .arg(&hi)
                .arg(&row_of_slot)
                .arg(&a)
                .launch(rows(msg, 128))
                .map_err(|e| err("ll_gather", e))?;
        }
        mark(3)?;
        if self.masked_gemm_fits() {
            let [a, h13, act, y, _] = bufs;
            let b13 = self.w.b13.as_ref().map_or(0u64, |x| dptr(x, g));
            let i = c.inter;
            self.masked_gemm(Projection::Up, a, h13, cap, counts)?;
            mark(4)?;
            self.act(s, [h13, b13, 0, counts, act], cap as i32, el * cap, i)?;
            mark(5)?;
            self.masked_gemm(Projection::Down, act, y, cap, counts)?;
            mark(6)?;
        } else {
            self.mlp(b, bufs, el, cap, &[], 0, mark)?;
        }
        let b2 = self.w.b2.as_ref().map_or(0u64, |x| dptr(x, g));
        let y = bufs[3];
        // SAFETY: ll_combine(u8*, long, bf16*, float*, int*, int, int, int, bf16*) over the msg
        // received rows; their expert rows come from ll_group.
        unsafe {
            s.launch_builder(&self.k.ll_combine)
                .arg(&recv)
                .arg(&stride_l)
                .arg(&y)
                .arg(&b2)
                .arg(&row_of_slot)
                .arg(&msg_i)
                .arg(&ki)
                .arg(&hi)
                .arg(&part)
                .launch(grid(msg * h))
        }
        .map_err(|e| err("ll_combine", e))?;
        self.exchange_rows(link, "moe low-latency combine", &[(part, 2 * h)], &every, &[(back, 2 * h)], &every)?;
        mark(7)?;
        let (ni, outp) = (n as i32, dptr(&b.out, g));
        // SAFETY: sum_partials(bf16*, int*, int, int, int, float*): home_rows holds M · n
        // entries, each -1 or a row of `back`.
        unsafe {
            s.launch_builder(&self.k.sum_partials)
                .arg(&back)
                .arg(&home_rows)
                .arg(&mi)
                .arg(&ni)
                .arg(&hi)
                .arg(&outp)
                .launch(grid(m * h))
        }
        .map_err(|e| err("sum_partials", e))?;
        Ok(self.ll_sent_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{dptr, Gpu};
    use crate::quant::WeightQuant;
    use cudarc::driver::PushKernelArg;
    use half::bf16;

    /// The masked GEMM, bf16 and fp8 weights, against an f64 product of the same values, with
    /// poisoned outputs: widths that are not multiples of the tile (and of the fp8 scale
    /// blocks), counts of 0, 1, a partial tile, exactly one pass, more than one pass, and the
    /// whole capacity. Needs a GPU; says loudly when it skips.
    #[test]
    fn masked_gemm_matches_f64_and_leaves_masked_rows_alone() {
        if super::super::super::device_count() == 0 {
            eprintln!("SKIPPED masked_gemm_matches_f64_and_leaves_masked_rows_alone: no CUDA device");
            return;
        }
        let gpu = Gpu::new(0).unwrap();
        let s = &gpu.stream;
        for fp8 in [false, true] {
            let f = gpu.function(if fp8 { "masked_gemm_fp8" } else { "masked_gemm" }).unwrap();
            super::allow_masked_gemm_smem(&f).unwrap();
            let shapes =
                if fp8 { [(200usize, 144usize), (256, 64), (130, 16)] } else { [(200, 136), (256, 64), (130, 8)] };
            for (n, k) in shapes {
                let cap = 130;
                let counts: Vec<i32> = vec![0, 1, 17, 64, 65, 130];
                let e = counts.len();
                let bits = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x).to_bits()).collect::<Vec<u16>>();
                let w32 = crate::preset::uniform(e * n * k, 1.0, 5);
                let a = bits(&crate::preset::uniform(e * cap * k, 1.0, 6));
                let poison = 0x7fc1u16; // a NaN that no product yields
                let (ad, cd) = (s.clone_htod(&a).unwrap(), s.clone_htod(&vec![poison; e * cap * n]).unwrap());
                let countd = s.clone_htod(&counts).unwrap();
                let (ap, cp, np) = (dptr(&ad, &gpu), dptr(&cd, &gpu), dptr(&countd, &gpu));
                let (capi, ni, ki) = (cap as i32, n as i32, k as i32);
                let cfg = super::masked_gemm_launch(n, e, fp8);
                // The weights as the kernel sees them, in f64.
                let weights: Vec<f64> = if fp8 {
                    let q = WeightQuant::Fp8Block(128);
                    let (codes, scales) = q.quantize(&w32, e, n, k).unwrap();
                    let (wd, sd) = (s.clone_htod(&codes).unwrap(), s.clone_htod(&scales).unwrap());
                    let (wp, sp) = (dptr(&wd, &gpu), dptr(&sd, &gpu));
                    // SAFETY: buffers sized as the kernel reads and writes them (see masked_gemm_fp8).
                    unsafe {
                        let mut l = s.launch_builder(&f);
                        l.arg(&wp).arg(&sp).arg(&ap).arg(&cp).arg(&np).arg(&capi).arg(&ni).arg(&ki);
                        l.launch(cfg).unwrap();
                    }
                    s.synchronize().unwrap();
                    q.dequantize(&codes, &scales, e, n, k).into_iter().map(f64::from).collect()
                } else {
                    let w = bits(&w32);
                    let wd = s.clone_htod(&w).unwrap();
                    let wp = dptr(&wd, &gpu);
                    // SAFETY: buffers sized as the kernel reads and writes them (see masked_gemm).
                    unsafe {
                        let mut l = s.launch_builder(&f);
                        l.arg(&wp).arg(&ap).arg(&cp).arg(&np).arg(&capi).arg(&ni).arg(&ki);
                        l.launch(cfg).unwrap();
                    }
                    s.synchronize().unwrap();
                    w.iter().map(|&x| bf16::from_bits(x).to_f64()).collect()
                };
                let got = s.clone_dtoh(&cd).unwrap();
                let v = |x: u16| bf16::from_bits(x).to_f64();
                for (x, &cnt) in counts.iter().enumerate() {
                    for r in 0..cap {
                        for j in 0..n {
                            let out = got[(x * cap + r) * n + j];
                            let what = format!("fp8 {fp8}, n {n} k {k}: expert {x} row {r} col {j}");
                            if r >= cnt as usize {
                                assert_eq!(out, poison, "{what}: past its count, written");
                                continue;
                            }
                            let want: f64 =
                                (0..k).map(|q| v(a[(x * cap + r) * k + q]) * weights[(x * n + j) * k + q]).sum();
                            let tol = 1e-2 * (1.0 + want.abs());
                            assert!((v(out) - want).abs() <= tol, "{what}: {} vs {want}", v(out));
                        }
                    }
                }
            }
        }
    }
}
