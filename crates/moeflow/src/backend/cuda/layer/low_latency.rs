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

use super::graph::{blas_workspaces, elapsed_ms, LayerGraph};
use super::hopper_gemm::Epilogue;
use super::masked_gemm::Projection;
use super::{dptr, err, rows, CudaMoeLayer, EpLink, GpuStageTimes};
use crate::error::{MoeError, Result};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

/// Low-latency buffers, all sized by the capacity, and the captured layer.
pub(super) struct LlBuffers {
    /// Tokens in the current batch, read on the device.
    tokens: CudaSlice<i32>,
    send: CudaSlice<u8>,
    recv: CudaSlice<u8>,
    home_rows: CudaSlice<i32>,
    row_of_slot: CudaSlice<i32>,
    counts: CudaSlice<i32>,
    /// Where each local expert's rows start: `x · cap` (for the Hopper GEMM).
    offsets: CudaSlice<i32>,
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
        if self.opts.deterministic {
            return Err(MoeError::Unsupported(
                "the low-latency layer sums partial outputs across ranks; deterministic mode dispatches by all-to-all-v"
                    .into(),
            ));
        }
        let mut layer = self;
        let Some(link) = layer.ep.as_mut() else {
            return Err(MoeError::Config("low-latency dispatch needs an expert-parallel layer (new_ep)".into()));
        };
        if link.gathering.is_some() {
            return Err(MoeError::Config(
                "a layer dispatches one way: all-to-all-v, all-gather, multicast or lowlatency".into(),
            ));
        }
        if max_tokens_per_rank == 0 {
            return Err(MoeError::Config("lowlatency needs max_tokens_per_rank > 0".into()));
        }
        link.capacity = Some(max_tokens_per_rank);
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
        super::super::finite::ensure_low_latency(&self.gpu, m, [h, i, k, n, el])?;
        let (msg, cap) = (n * m, n * m);
        let s = &self.gpu.stream;
        let z16 = |n: usize| s.alloc_zeros::<u16>(n.max(1)).map_err(|e| err("allocating workspace", e));
        let z32 = |n: usize| s.alloc_zeros::<i32>(n.max(1)).map_err(|e| err("allocating workspace", e));
        let z8 = |n: usize| s.alloc_zeros::<u8>(n.max(1)).map_err(|e| err("allocating workspace", e));
        let workspaces = blas_workspaces(self, &[&self.blas, &self.side.shared().blas])?;
        Ok(LlBuffers {
            tokens: z32(1)?,
            send: z8(msg * row_stride(h, k))?,
            recv: z8(msg * row_stride(h, k))?,
            home_rows: z32(m * n)?,
            row_of_slot: z32(msg * k)?,
            counts: z32(el)?,
            offsets: s
                .clone_htod(&(0..el as i32).map(|x| x * cap as i32).collect::<Vec<_>>())
                .map_err(|e| err("allocating workspace", e))?,
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
            let graph = self.capture_layer(b, m)?;
            b.ll.as_mut().expect("allocated").graph = Some(graph);
        }
        let graph = b.ll.as_ref().expect("allocated").graph.as_ref().expect("captured above");
        let events = graph.launch(&self.gpu, timed)?;
        link.comm.wait("moe layer", s)?;
        let Some(events) = events else { return Ok(GpuStageTimes::default()) };
        Ok(GpuStageTimes {
            total: elapsed_ms(&events)?,
            dispatch_bytes: self.ll_sent_bytes(),
            ..GpuStageTimes::default()
        })
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
        let offsets = dptr(&ll.offsets, g);
        let bufs = [a, dptr(&ll.h13, g), dptr(&ll.act, g), dptr(&ll.y, g), 0];
        let (mi, ki, hi, stride_l, msg_i, cap_i) =
            (m as i32, k as i32, h as i32, stride as i64, msg as i32, cap as i32);
        let tables = link.tables.as_ref().expect("uploaded when the layer was assembled").ptrs(g);
        // SAFETY: ll_pack(bf16*, int*, float*, int*, int, int, int, int* x4, long, u8*, int*)
        // over M tokens × n destinations of buffers sized for them (routing ran on M rows); the
        // placement's tables cover every expert.
        unsafe {
            s.launch_builder(&self.k.ll_pack)
                .arg(&xb)
                .arg(&ids)
                .arg(&w)
                .arg(&tokens)
                .arg(&mi)
                .arg(&ki)
                .arg(&hi)
                .arg(&tables[0])
                .arg(&tables[1])
                .arg(&tables[2])
                .arg(&tables[3])
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
        if self.masked {
            let [a, h13, act, y, _] = bufs;
            let b13 = self.w.b13.as_ref().map_or(0u64, |x| dptr(x, g));
            let i = c.inter;
            let hopper = self.ll_hopper().map(|hg| (hg, [counts, offsets]));
            match hopper {
                Some((hg, dev)) => {
                    let epilogue = Epilogue::Activation { activation: c.activation, bias: b13 };
                    hg.run(s, dptr(&self.w.w13, g), [2 * i, h], [a, act], el * cap, dev, el, epilogue, None)?;
                    mark(4)?;
                }
                None => {
                    self.masked_gemm(Projection::Up, [a, h13], cap, counts, 0, el * cap)?;
                    mark(4)?;
                    self.act(s, [h13, b13, 0, counts, act], cap as i32, el * cap, i)?;
                }
            }
            mark(5)?;
            match hopper {
                Some((hg, dev)) => {
                    hg.run(s, dptr(&self.w.w2, g), [h, i], [act, y], el * cap, dev, el, Epilogue::Product, None)?
                }
                None => self.masked_gemm(Projection::Down, [act, y], cap, counts, 0, el * cap)?,
            }
            mark(6)?;
        } else {
            // No row offsets on the device: cuBLAS over the padded layout.
            self.mlp(b, bufs, el, cap, (&[], [counts, 0]), 0, None, mark)?;
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
                .launch(rows(msg, 256))
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
                .launch(rows(m, 256))
        }
        .map_err(|e| err("sum_partials", e))?;
        Ok(self.ll_sent_bytes())
    }
}
