//! Fixed-capacity low-latency expert parallelism on the device, the shape of DeepEP's
//! low-latency mode: every buffer, message and GEMM is sized by the capacity `M` tokens per
//! rank, never by the batch, and nothing is read back to the host, so the whole layer (routing,
//! dispatch, expert GEMMs, combine, shared experts) is captured once in a CUDA graph and
//! replayed on every call. The batch size lives in device memory; rows past it ride along
//! unused.
//!
//! This file holds the layer's side of it (the switch, the buffers, the graph's capture and
//! replay); the dispatch and combine are the [`super::strategy::LowLatency`] strategy, and the
//! experts run on its padded layout (the Hopper or the masked grouped GEMM, which read the
//! counts on the device). Events cannot time stages inside a graph, so a second capture of the
//! layer stamps the GPU's clock at every stage boundary for
//! [`CudaMoeLayer::forward_timed_stages`].

use super::graph::{blas_workspaces, elapsed_ms, LayerGraph};
use super::{err, strategy, CudaMoeLayer, GpuStageTimes, Ran};
use crate::error::{MoeError, Result};
use cudarc::driver::CudaSlice;

/// Low-latency buffers, all sized by the capacity, and the captured layer.
pub(super) struct LlBuffers {
    /// Tokens in the current batch, read on the device.
    pub(super) tokens: CudaSlice<i32>,
    /// The router's partial sums, `[H / ROUTER_LIVE_COLS, M, E]` (see `router_live`).
    pub(super) router_partials: CudaSlice<f32>,
    pub(super) send: CudaSlice<u8>,
    pub(super) recv: CudaSlice<u8>,
    pub(super) home_rows: CudaSlice<i32>,
    pub(super) row_of_slot: CudaSlice<i32>,
    /// The message slot (`row · k + j`) of each row of the padded layout, where the expert GEMM
    /// gathers its rows from the received messages.
    pub(super) slot_of_row: CudaSlice<i32>,
    pub(super) counts: CudaSlice<i32>,
    /// Where each local expert's rows start: `x · cap` (for the Hopper GEMM).
    pub(super) offsets: CudaSlice<i32>,
    /// The up projection's rows in the padded layout, `[el · cap, H]`; one value where the
    /// expert GEMM gathers its rows from the received messages instead.
    pub(super) a: CudaSlice<u16>,
    pub(super) h13: CudaSlice<u16>,
    pub(super) act: CudaSlice<u16>,
    pub(super) y: CudaSlice<u16>,
    pub(super) part: CudaSlice<u16>,
    pub(super) back: CudaSlice<u16>,
    /// cuBLAS workspaces (main handle, shared-expert handle); they must outlive the graph.
    _workspaces: Vec<CudaSlice<u8>>,
    graph: Option<LayerGraph>,
    /// The layer captured with a clock stamp at each of its ten stage boundaries, written to
    /// `stamps`, and what its run does.
    stamped: Option<(LayerGraph, Ran)>,
    stamps: CudaSlice<u64>,
}

impl LlBuffers {
    /// Takes over `old`'s cuBLAS workspaces (set on the layer's handles), which these
    /// buffers' graph will then use.
    pub(super) fn adopt_workspaces(&mut self, old: &mut LlBuffers) {
        self._workspaces = std::mem::take(&mut old._workspaces);
    }
}

/// Bytes of one message row: `k` ids and `k` weights, padded to 16 bytes, then `h` bf16.
pub(super) fn row_stride(h: usize, k: usize) -> usize {
    row_offset(k) + (2 * h).div_ceil(16) * 16
}

/// Where a message row's values start: past its `k` ids and `k` weights, padded to 16 bytes
/// (the kernels' `ll_row_offset`).
pub(super) fn row_offset(k: usize) -> usize {
    (8 * k).div_ceil(16) * 16
}

impl CudaMoeLayer {
    /// Switches this expert-parallel layer to fixed-capacity low-latency dispatch for batches of
    /// at most `max_tokens_per_rank` tokens per rank: the first call runs the layer once and
    /// captures it in a CUDA graph, every call replays that graph. Collective like the layer's
    /// other calls: every rank switches with the same capacity.
    pub fn low_latency(self, max_tokens_per_rank: usize) -> Result<Self> {
        self.not_yet_tp_sliced("lowlatency")?;
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
        if layer.strategy.name() != "all2allv" {
            return Err(MoeError::Config(
                "a layer dispatches one way: all-to-all-v, all-gather, multicast or lowlatency".into(),
            ));
        }
        if max_tokens_per_rank == 0 {
            return Err(MoeError::Config("lowlatency needs max_tokens_per_rank > 0".into()));
        }
        link.capacity = Some(max_tokens_per_rank);
        layer.strategy = std::sync::Arc::new(strategy::LowLatency);
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
        let mut ll = self.ll_buffers_for(m, self.ep.as_ref().expect("checked by the caller").local)?;
        ll._workspaces = blas_workspaces(self, &[&self.blas, &self.side.shared().blas])?;
        Ok(ll)
    }

    /// Low-latency buffers of capacity `m` for `el` local experts, without cuBLAS workspaces
    /// (a rebalanced layer's, built before it takes its new placement, which then adopt the
    /// workspaces its handles already use: see [`LlBuffers::adopt_workspaces`]).
    pub(super) fn ll_buffers_for(&self, m: usize, el: usize) -> Result<LlBuffers> {
        use crate::comm::Communicator;
        let link = self.ep.as_ref().expect("checked by the caller");
        let c = &self.config;
        let (h, i, k, n) = (c.hidden, c.inter, c.top_k, link.comm.size());
        super::super::finite::ensure_low_latency(&self.gpu, m, [h, i, k, n, el])?;
        let (msg, cap) = (n * m, n * m);
        let s = &self.gpu.stream;
        let z16 = |n: usize| s.alloc_zeros::<u16>(n.max(1)).map_err(|e| err("allocating workspace", e));
        let z32 = |n: usize| s.alloc_zeros::<i32>(n.max(1)).map_err(|e| err("allocating workspace", e));
        let z8 = |n: usize| s.alloc_zeros::<u8>(n.max(1)).map_err(|e| err("allocating workspace", e));
        let partials = h.div_ceil(super::route::ROUTER_LIVE_COLS) * m * c.num_experts;
        Ok(LlBuffers {
            tokens: z32(1)?,
            router_partials: s.alloc_zeros::<f32>(partials.max(1)).map_err(|e| err("allocating workspace", e))?,
            send: z8(msg * row_stride(h, k))?,
            recv: z8(msg * row_stride(h, k))?,
            home_rows: z32(m * n)?,
            row_of_slot: z32(msg * k)?,
            slot_of_row: z32(el * cap)?,
            counts: z32(el)?,
            offsets: s
                .clone_htod(&(0..el as i32).map(|x| x * cap as i32).collect::<Vec<_>>())
                .map_err(|e| err("allocating workspace", e))?,
            a: z16(self.ll_padded_values(m, el))?,
            h13: z16(el * cap * 2 * i)?,
            act: z16(el * cap * i)?,
            y: z16(el * cap * h)?,
            part: z16(msg * h)?,
            back: z16(msg * h)?,
            _workspaces: Vec::new(),
            graph: None,
            stamped: None,
            stamps: s.alloc_zeros::<u64>(10).map_err(|e| err("allocating workspace", e))?,
        })
    }

    /// Values of the padded rows `LlBuffers::a` at capacity `m` with `el` local experts:
    /// `el · n·m` rows of H, or one where the expert GEMM gathers its rows from the received
    /// messages and never reads them (470 MB saved at EP 2, capacity 128, DeepSeek-V3). The
    /// GEMM is fixed by the capacity and the options, and by whether the rows are fp8.
    fn ll_padded_values(&self, m: usize, el: usize) -> usize {
        use crate::comm::Communicator;
        let n = self.ep.as_ref().map_or(1, |l| l.comm.size());
        let cap = n * m;
        let gathers = self
            .device_counted(el * cap, el, super::experts::Form::LowLatency)
            .is_some_and(|imp| imp.gathers_received_rows(self));
        if gathers {
            1
        } else {
            el * cap * self.config.hidden
        }
    }

    /// Grows the low-latency buffers' padded rows to what the layer's expert GEMM now needs
    /// (after `fp8_experts` or `fp8_activations`, whose GEMMs read them); nothing on other
    /// layers.
    pub(super) fn size_ll_rows(&self) -> Result<()> {
        let Some((m, el)) = self.ep.as_ref().and_then(|l| l.capacity.map(|m| (m, l.local))) else {
            return Ok(());
        };
        let need = self.ll_padded_values(m, el);
        let mut guard = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(ll) = guard.as_mut().and_then(|b| b.ll.as_mut()) {
            if ll.a.len() < need {
                ll.a = self.gpu.stream.alloc_zeros::<u16>(need).map_err(|e| err("allocating workspace", e))?;
            }
        }
        Ok(())
    }

    /// Runs the low-latency layer on the first `t` of the capacity's rows of `b.x` (into
    /// `b.out`): sets the batch size on the device, replays the layer's graph (capturing it on
    /// the first call, after one direct run), and waits. With `timed`, only the total is
    /// measured (events around the replay). A strategy the layer does not capture (TP
    /// slicing) runs the stages directly instead, every stage timed.
    pub(super) fn ll_run(&self, b: &mut super::Buffers, t: usize, timed: bool) -> Result<GpuStageTimes> {
        let link = self.ep.as_ref().expect("low-latency layers are expert-parallel");
        let m = link.capacity.expect("low-latency layers have a capacity");
        let s = &self.gpu.stream;
        self.ll_set_tokens(b, t)?;
        if !self.strategy.captures() {
            // TP slicing: the same stages on all `M` rows, run directly.
            return self.run(b, m, timed);
        }
        if b.ll.as_ref().expect("allocated by low_latency()").graph.is_none() {
            // A direct run first: NCCL connects its peers, cuBLAS picks its kernels, the
            // modules load, none of which may happen inside a capture.
            self.warm_up(b, m)?;
            let (graph, _) = self.capture_layer(b, m, None)?;
            b.ll.as_mut().expect("allocated").graph = Some(graph);
        }
        let graph = b.ll.as_ref().expect("allocated").graph.as_ref().expect("captured above");
        let events = graph.launch(&self.gpu, timed)?;
        link.check_transport(link.comm.wait("moe layer", s))?;
        let Some(events) = events else { return Ok(GpuStageTimes::default()) };
        Ok(GpuStageTimes {
            total: elapsed_ms(&events)?,
            dispatch_bytes: self.ll_sent_bytes(t),
            ..GpuStageTimes::default()
        })
    }

    /// [`CudaMoeLayer::ll_run`] timed stage by stage inside the graph: replays the layer's
    /// stamped capture (capturing it on the first call, after the plain graph's) and reads its
    /// clock stamps. The stamps, one-thread kernels between the stages, add a few microseconds
    /// to the whole.
    pub(super) fn ll_run_stamped(&self, b: &mut super::Buffers, t: usize) -> Result<GpuStageTimes> {
        let link = self.ep.as_ref().expect("low-latency layers are expert-parallel");
        let m = link.capacity.expect("low-latency layers have a capacity");
        if b.ll.as_ref().expect("allocated by low_latency()").graph.is_none() {
            self.ll_run(b, t, false)?;
        }
        self.ll_set_tokens(b, t)?;
        if b.ll.as_ref().expect("allocated").stamped.is_none() {
            let at = super::dptr(&b.ll.as_ref().expect("allocated").stamps, &self.gpu);
            let stamped = self.capture_layer(b, m, Some(at))?;
            b.ll.as_mut().expect("allocated").stamped = Some(stamped);
        }
        let ll = b.ll.as_ref().expect("allocated");
        let (graph, ran) = ll.stamped.as_ref().expect("captured above");
        graph.launch(&self.gpu, false)?;
        link.check_transport(link.comm.wait("moe layer", &self.gpu.stream))?;
        let ns = self.gpu.stream.clone_dtoh(&ll.stamps).map_err(|e| err("reading clock stamps", e))?;
        let ms = |a: usize, z: usize| Ok(ns[z].saturating_sub(ns[a]) as f64 * 1e-6);
        Ok(GpuStageTimes {
            dispatch_bytes: self.ll_sent_bytes(t),
            experts_used: self.experts_used(b)?,
            strategy: ran.strategy,
            experts: ran.experts,
            transport: link.transport_name(),
            ..super::stages_between(ms)?
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

    /// Bytes one rank sends to the others per call of `t` tokens: one message to each, of the
    /// batch's rows over NVLink, of all `M` rows over NCCL.
    pub(super) fn ll_sent_bytes(&self, t: usize) -> usize {
        use crate::comm::Communicator;
        let link = self.ep.as_ref().expect("expert-parallel");
        let c = &self.config;
        let m = link.capacity.unwrap_or(0);
        let rows = if link.writes_windows() { t.min(m) } else { m };
        (link.comm.size() - 1) * rows * row_stride(c.hidden, c.top_k)
    }
}
