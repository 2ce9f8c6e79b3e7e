//! TP slicing around any other strategy: the ranks of a TP group hold the same batch of `t`
//! tokens; each routes only its contiguous share `[a, b)` ([`crate::rank_layer::share`])
//! through the shared experts and the inner strategy, and after the inner's finalize the
//! shares' outputs are all-gathered over the TP group on the device (each padded to the
//! largest share, `t.div_ceil(n)` rows) and laid out in rank order, so every TP rank's `b.out`
//! holds the whole batch's `[t, H]` without passing through host memory; outputs that go out
//! as bf16 cross as bf16. The shared experts' start and the send beside the routing are the
//! inner strategy's.
//!
//! The layer learns the share from [`DevicePrepareFinalize::token_window`] and copies in only
//! those rows. Its runs are not captured into CUDA graphs ([`DevicePrepareFinalize::captures`]):
//! the all-gather's size and the layout of the shares follow the batch, which a graph would
//! fix, and the TP communicator launches through NCCL's own thread (a non-blocking
//! communicator), which a capture on the layer's thread does not take in.

use super::{DevicePrepareFinalize, Dispatched, Mark, SharedStart, State};
use crate::backend::cuda::layer::{dptr, err, grid, Buffers, CudaMoeLayer};
use crate::backend::cuda::NcclComm;
use crate::comm::Communicator;
use crate::error::{MoeError, Result};
use crate::rank_layer::{largest_share, share};
use cudarc::driver::PushKernelArg;
use cudarc::nccl::sys as nc;
use std::sync::Arc;

/// This TP rank's share of every batch through `inner`, the shares all-gathered over `tp`.
pub(in crate::backend::cuda::layer) struct TpSlice {
    inner: Arc<dyn DevicePrepareFinalize>,
    tp: Arc<NcclComm>,
}

impl TpSlice {
    /// Enqueues the all-gather of every TP rank's share of the outputs (the first rows of
    /// `b.out`) and lays them out in rank order as the whole batch's `[b.batch, H]` in `b.out`.
    /// Outputs that go out as bf16 (`b.out_bf16`) cross as bf16, half the bytes: each share
    /// rounded first, then widened back into `b.out`, whose rounding on the way out then
    /// changes nothing, so the caller gets the bits an f32 gather gives.
    fn gather(&self, l: &CudaMoeLayer, b: &mut Buffers) -> Result<()> {
        let (t, n, h) = (b.batch, self.tp.size(), l.config.hidden);
        let most = largest_share(t, n);
        // Every rank of the group has the same batch: all of them skip an empty one.
        if most == 0 {
            return Ok(());
        }
        let g = &l.gpu;
        let s = &g.stream;
        if b.tp_gathered.as_ref().is_none_or(|v| v.len() < n * most * h) {
            b.tp_gathered = Some(s.alloc_zeros::<f32>(n * most * h).map_err(|e| err("allocating workspace", e))?);
        }
        let gathered = dptr(b.tp_gathered.as_ref().expect("allocated above"), g);
        let out = dptr(&b.out, g);
        if b.out.len() < t * h {
            return Err(MoeError::Config(format!(
                "the layer's output buffer holds {} rows, not the {t} of the TP group's batch",
                b.out.len() / h
            )));
        }
        let count = most * h;
        let bf16 = b.out_bf16;
        // As bf16, the gathered shares take the first n · most · H halves of the buffer and
        // this rank's rounded share the next most · H (n ≥ 1, so they fit in its 2 n · most · H).
        let (src, elem, dtype) = match bf16 {
            true => (gathered + 2 * (n * count) as u64, 2, nc::ncclDataType_t::ncclBfloat16),
            false => (out, 4, nc::ncclDataType_t::ncclFloat32),
        };
        if bf16 {
            let len = count as i64;
            // SAFETY: f32_to_bf16_kernel(float*, bf16*, long) reads the `most · H` floats of
            // this rank's share (`b.out` holds t ≥ most rows) and writes as many bf16 values at
            // `src`, past the gathered shares' halves (see above).
            unsafe { s.launch_builder(&l.k.to_bf16).arg(&out).arg(&src).arg(&len).launch(grid(count)) }
                .map_err(|e| err("rounding the TP share", e))?;
        }
        self.tp.enqueue("tp output", s, |comm, cs| {
            // SAFETY: `most · H` values (f32, or bf16 with `bf16`) from every TP rank's share
            // into the n · most · H values at `gathered`, rank r's at r · most · H.
            unsafe { nc::ncclAllGather(src as _, gathered as _, count, dtype, comm, cs) }
        })?;
        for r in 0..n {
            let (a, z) = share(t, n, r);
            if z <= a {
                continue;
            }
            let (to, from) = (out + (a * h * 4) as u64, gathered + (r * count * elem) as u64);
            let len = (z - a) * h;
            // SAFETY: rank r's `z - a ≤ most` rows at r · most in `gathered` (n · most rows of
            // `elem` bytes a value) to rows [a, z) of `out` (t rows, checked above), in stream
            // order after the all-gather read `out`'s first rows; bf16_to_f32_kernel(bf16*,
            // float*, long) widens `len` values.
            unsafe {
                match bf16 {
                    true => {
                        let n = len as i64;
                        s.launch_builder(&l.k.widen_bf16).arg(&from).arg(&to).arg(&n).launch(grid(len)).map(|_| ())
                    }
                    false => cudarc::driver::result::memcpy_dtod_async(to, from, len * 4, s.cu_stream()),
                }
            }
            .map_err(|e| err("laying out the TP shares", e))?;
        }
        Ok(())
    }
}

impl DevicePrepareFinalize for TpSlice {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn token_window(&self, t: usize) -> (usize, usize) {
        share(t, self.tp.size(), self.tp.rank())
    }

    fn largest_window(&self, t: usize) -> usize {
        largest_share(t, self.tp.size())
    }

    fn captures(&self) -> bool {
        false
    }

    fn tp_size(&self) -> usize {
        self.tp.size()
    }

    fn needs_batches(&self, layer: &CudaMoeLayer) -> bool {
        self.inner.needs_batches(layer)
    }

    fn around(&self, base: Arc<dyn DevicePrepareFinalize>) -> Arc<dyn DevicePrepareFinalize> {
        Arc::new(TpSlice { inner: self.inner.around(base), tp: self.tp.clone() })
    }

    /// The TP all-gather first, then the inner strategy's communicators: a TP wait that passes
    /// its deadline fails the group (the failure is shared by every communicator split from
    /// the same parent), so the inner's wait then aborts its own communicator too and the
    /// stream drains.
    fn wait(&self, l: &CudaMoeLayer) -> Result<()> {
        let tp = self.tp.wait("tp output", &l.gpu.stream);
        let inner = self.inner.wait(l);
        tp.and(inner)
    }

    fn shared_start(&self, l: &CudaMoeLayer) -> SharedStart {
        self.inner.shared_start(l)
    }

    fn send_beside_routing(&self, l: &CudaMoeLayer, b: &mut Buffers, t: usize) -> Result<()> {
        self.inner.send_beside_routing(l, b, t)
    }

    fn prepare_begin(&self, l: &CudaMoeLayer, b: &mut Buffers, t: usize, mark: Mark) -> Result<State> {
        self.inner.prepare_begin(l, b, t, mark)
    }

    fn prepare_finish(
        &self,
        l: &CudaMoeLayer,
        b: &mut Buffers,
        t: usize,
        pending: State,
        mark: Mark,
    ) -> Result<Dispatched> {
        self.inner.prepare_finish(l, b, t, pending, mark)
    }

    fn finalize_begin(&self, l: &CudaMoeLayer, b: &mut Buffers, t: usize, d: &mut Dispatched) -> Result<()> {
        self.inner.finalize_begin(l, b, t, d)
    }

    /// The inner's finalize and the shared experts' output of this rank's share, then the
    /// shares all-gathered into the whole batch.
    fn finalize_finish(&self, l: &CudaMoeLayer, b: &mut Buffers, t: usize, d: Dispatched, mark: Mark) -> Result<()> {
        self.inner.finalize_finish(l, b, t, d, mark)?;
        if !self.inner.adds_shared(l) {
            l.add_shared_output(b, t)?;
        }
        self.gather(l, b)
    }

    /// Always: the shared experts' output joins each share before the all-gather.
    fn adds_shared(&self, _: &CudaMoeLayer) -> bool {
        true
    }
}

impl CudaMoeLayer {
    /// This expert-parallel layer TP-sliced over `tp` (`strategy/tp_slice.rs` around the strategy it has,
    /// and around each pick of its auto table): the ranks of `tp` pass the same batch `[t, H]`
    /// to every forward call, each runs its contiguous share through the layer, and every rank
    /// gets the whole batch's output, all-gathered over `tp` on the device. Choose the strategy
    /// (low-latency, gathering, auto) first; dual-batch halves are not TP-sliced (slice around
    /// them on the host). Collective over `tp` at every call.
    pub fn tp_slice(mut self, tp: NcclComm) -> Result<Self> {
        self.not_yet_tp_sliced("tp_slice")?;
        if self.ep.is_none() {
            return Err(MoeError::Config(
                "TP slicing needs an expert-parallel layer (new_ep): a TP group shares its batch inside an \
                 expert-parallel layout"
                    .into(),
            ));
        }
        if tp.device() != self.gpu.ordinal {
            return Err(MoeError::Config(format!(
                "the TP communicator runs on GPU {}, the layer on GPU {}",
                tp.device(),
                self.gpu.ordinal
            )));
        }
        self.strategy = Arc::new(TpSlice { inner: self.strategy.clone(), tp: Arc::new(tp) });
        Ok(self)
    }

    /// Ranks that share each batch: the TP group's size when TP-sliced ([`CudaMoeLayer::tp_slice`]),
    /// else 1.
    pub fn tp_size(&self) -> usize {
        self.strategy.tp_size()
    }

    /// How many of a batch of `t` tokens this rank routes: its TP share when TP-sliced, else
    /// all of them.
    pub fn tokens_routed(&self, t: usize) -> usize {
        let (a, b) = self.strategy.token_window(t);
        b - a
    }
}
