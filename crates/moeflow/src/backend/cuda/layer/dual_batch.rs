//! Dual-batch overlap on the GPU: a batch is split into two micro-batches that run at once,
//! each through its own instance of the layer (its own stream, buffers, cuBLAS handles and,
//! expert-parallel, its own communicator) over one shared copy of the weights. Each half is
//! driven by a host thread of its own, so the host synchronisations of one (the all-to-all-v
//! counts) never hold up the other: one micro-batch's dispatch and combine overlap the
//! other's expert GEMMs, and on one GPU the memory-bound stages of one overlap the GEMMs of
//! the other.

use super::{err, CudaMoeLayer, Span};
use crate::backend::GpuStageTimes;
use crate::error::{MoeError, Result};
use crate::tensor::Tensor;
use std::sync::Mutex;

/// One layer as two micro-batch halves sharing its weights (see the module docs).
pub struct CudaDualBatch {
    halves: [CudaMoeLayer; 2],
}

impl CudaMoeLayer {
    /// Splits this layer into two micro-batch halves over the same weights. An
    /// expert-parallel layer needs `comm`, a second communicator over the same ranks in the
    /// same order (e.g. [`super::super::NcclComm::duplicate`] of the first); one GPU takes
    /// `None`. The low-latency layer (one captured graph) does not split.
    pub fn dual_batch(self, comm: Option<super::super::NcclComm>) -> Result<CudaDualBatch> {
        if self.capacity().is_some() {
            return Err(MoeError::Unsupported("dual-batch overlap of the low-latency layer".into()));
        }
        let link = match (&self.ep, comm) {
            (Some(_), Some(c)) => Some(Self::link(&self.config, c)?),
            (None, None) => None,
            (Some(_), None) => {
                return Err(MoeError::Config(
                    "dual-batch overlap of an expert-parallel layer needs a second communicator".into(),
                ))
            }
            (None, Some(_)) => {
                return Err(MoeError::Config("dual-batch overlap on one GPU takes no communicator".into()))
            }
        };
        let (gpu, blas, k) = Self::open(&self.config, self.gpu.ordinal)?;
        let twin = CudaMoeLayer {
            side: super::side_streams(&gpu)?,
            gpu,
            grouped: self.grouped,
            masked: self.masked,
            w8a8: self.w8a8,
            fp8_rows: Mutex::new(None),
            blas,
            config: self.config.clone(),
            k,
            w: self.w.clone(),
            bufs: Mutex::new(None),
            ep: link,
        };
        Ok(CudaDualBatch { halves: [self, twin] })
    }
}

/// Tokens of the two micro-batches of a batch of `t`.
fn split(t: usize) -> [usize; 2] {
    [t.div_ceil(2), t / 2]
}

impl CudaDualBatch {
    /// `hidden [T, H]` → `[T, H]` f32: the first `ceil(T / 2)` tokens through one half, the
    /// rest through the other, at the same time.
    pub fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        let h = self.halves[0].config.hidden;
        let s = hidden.shape();
        if s.len() != 2 || s[1] != h {
            return Err(MoeError::shape("hidden_states", format!("[T, {h}]"), s));
        }
        let x = hidden.to_f32_vec();
        let [t0, t1] = split(s[0]);
        let parts =
            [Tensor::from_f32(&[t0, h], x[..t0 * h].to_vec())?, Tensor::from_f32(&[t1, h], x[t0 * h..].to_vec())?];
        let outs = self.on_both(|layer, j| layer.forward(&parts[j]))?;
        let mut out = outs[0].to_f32_vec();
        out.extend(outs[1].to_f32_vec());
        Tensor::from_f32(&[s[0], h], out)
    }

    /// Runs `tokens` tokens of uniform random input split over the two halves; the total is
    /// from the earlier half's start to the later half's end, the stages are micro-batch 0's,
    /// the dispatched bytes both halves'.
    pub fn forward_timed(&self, tokens: usize, seed: u64) -> Result<GpuStageTimes> {
        let parts = split(tokens);
        let [(a, sa), (b, sb)] =
            self.on_both(|layer, j| layer.timed_marks(parts[j], seed ^ ((j as u64) << 40), false))?;
        let total = match (sa, sb) {
            (Some(sa), Some(sb)) => whole(&sa, &sb)?,
            _ => a.total.max(b.total),
        };
        Ok(GpuStageTimes { total, dispatch_bytes: a.dispatch_bytes + b.dispatch_bytes, ..a })
    }

    /// `f(half, j)` for both halves at once, each on a host thread of its own.
    fn on_both<T: Send>(&self, f: impl Fn(&CudaMoeLayer, usize) -> Result<T> + Sync) -> Result<[T; 2]> {
        let [r0, r1] = std::thread::scope(|scope| {
            let run = |j: usize| {
                let (layer, f) = (&self.halves[j], &f);
                scope.spawn(move || {
                    layer.gpu.ctx.bind_to_thread().map_err(|e| err("binding context", e))?;
                    f(layer, j)
                })
            };
            let handles = [run(0), run(1)];
            handles.map(|h| h.join().unwrap_or_else(|_| Err(MoeError::Config("a micro-batch thread panicked".into()))))
        });
        Ok([r0?, r1?])
    }
}

/// Milliseconds from the earlier of two runs' first events to the later of their last.
fn whole(a: &Span, b: &Span) -> Result<f64> {
    let ms = |x: &cudarc::driver::CudaEvent, y: &cudarc::driver::CudaEvent| -> Result<f64> {
        Ok(x.elapsed_ms(y).map_err(|e| err("event time", e))? as f64)
    };
    let start = ms(&a.first, &b.first)?.min(0.0);
    let end = ms(&a.first, &a.last)?.max(ms(&a.first, &b.last)?);
    Ok(end - start)
}
