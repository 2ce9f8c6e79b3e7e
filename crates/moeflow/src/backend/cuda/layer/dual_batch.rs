//! Dual-batch overlap on the GPU: a batch is split into two micro-batches that run at once,
//! each through its own instance of the layer (its own stream, buffers, cuBLAS handles and,
//! expert-parallel, its own communicator) over one shared copy of the weights. Each half is
//! driven by a host thread of its own, so the host synchronisations of one (the all-to-all-v
//! counts) never hold up the other. The halves are staggered: micro-batch 1's expert GEMMs
//! wait on the device for micro-batch 0's to finish, so the GEMMs never compete for the GPU
//! while micro-batch 1's routing and dispatch run under micro-batch 0's GEMMs, and micro-batch
//! 0's combine under micro-batch 1's.

use super::{err, CudaMoeLayer, Span, StageHook};
use crate::backend::GpuStageTimes;
use crate::error::{MoeError, Result};
use crate::tensor::Tensor;
use cudarc::driver::{CudaEvent, CudaStream};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Mutex;
use std::time::Duration;

/// How long micro-batch 1 waits for micro-batch 0 to enqueue its GEMMs before giving up.
const STAGGER_DEADLINE: Duration = Duration::from_secs(60);

/// One layer as two micro-batch halves sharing its weights (see the module docs).
pub struct CudaDualBatch {
    halves: [CudaMoeLayer; 2],
}

impl CudaMoeLayer {
    /// Splits this layer into two micro-batch halves over the same weights. An
    /// expert-parallel layer needs `comm`, a second communicator over the same ranks in the
    /// same order (e.g. [`super::super::NcclComm::duplicate`] of the first); one GPU takes
    /// `None`. A low-latency layer's halves each take up to its capacity, each its own graph.
    pub fn dual_batch(self, comm: Option<super::super::NcclComm>) -> Result<CudaDualBatch> {
        if self.tp_size() > 1 {
            return Err(MoeError::Config(
                "dual-batch halves of a TP-sliced layer: split the layer into halves first and slice the batch \
                 around them (the halves cannot share one TP communicator)"
                    .into(),
            ));
        }
        let mut link = match (&self.ep, comm) {
            (Some(mine), Some(c)) => Some(Self::link(&self.config, c, mine.placement.clone())?),
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
        let opened = Self::open(&self.config, self.gpu.ordinal, &self.opts)?;
        let mut twin = Self::assemble(&self.config, opened, self.w.clone(), link.take(), &self.opts)?;
        twin.w8a8 = self.w8a8;
        // The twin exchanges tokens the same way (a low-latency twin with buffers of its own).
        match self.capacity() {
            Some(m) => twin = twin.low_latency(m)?,
            None => twin.strategy = self.strategy.clone(),
        }
        twin.auto = self.auto.clone();
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
        let outs = self.on_both(|layer, j, hook| layer.forward_hooked(&parts[j], hook, false))?;
        let mut out = outs[0].to_f32_vec();
        out.extend(outs[1].to_f32_vec());
        Tensor::from_f32(&[s[0], h], out)
    }

    /// Runs `tokens` tokens of uniform random input split over the two halves; the total is
    /// from the earlier half's start to the later half's end, the stages are micro-batch 0's,
    /// the dispatched bytes both halves' (the experts used are not counted).
    pub fn forward_timed(&self, tokens: usize, seed: u64) -> Result<GpuStageTimes> {
        let parts = split(tokens);
        let [(a, sa), (b, sb)] = self.on_both(|layer, j, hook| {
            layer.timed_marks(parts[j], seed ^ ((j as u64) << 40), super::Replay::Direct, hook)
        })?;
        let total = match (sa, sb) {
            (Some(sa), Some(sb)) => whole(&sa, &sb)?,
            _ => a.total.max(b.total),
        };
        // Which experts the two halves reached together is not counted.
        Ok(GpuStageTimes { total, dispatch_bytes: a.dispatch_bytes + b.dispatch_bytes, experts_used: 0, ..a })
    }

    /// `f(half, j, hook)` for both halves at once, each on a host thread of its own, with the
    /// hooks that stagger their GEMMs (see the module docs).
    fn on_both<T: Send>(&self, f: impl Fn(&CudaMoeLayer, usize, &StageHook<'_>) -> Result<T> + Sync) -> Result<[T; 2]> {
        let (tx, rx) = channel::<CudaEvent>();
        let stagger = Stagger { done: Mutex::new(Some(tx)), wait: Mutex::new(rx) };
        let [r0, r1] = std::thread::scope(|scope| {
            let (f, stagger) = (&f, &stagger);
            let run = |j: usize| {
                let layer = &self.halves[j];
                scope.spawn(move || {
                    let hook = move |stage: usize, s: &CudaStream| stagger.hook(j, stage, s);
                    let r = layer
                        .gpu
                        .ctx
                        .bind_to_thread()
                        .map_err(|e| err("binding context", e))
                        .and_then(|_| f(layer, j, &hook));
                    // Micro-batch 0 is done enqueueing (or failed): micro-batch 1 stops waiting.
                    if j == 0 {
                        stagger.done.lock().unwrap_or_else(|p| p.into_inner()).take();
                    }
                    r
                })
            };
            let handles = [run(0), run(1)];
            handles.map(|h| h.join().unwrap_or_else(|_| Err(MoeError::Config("a micro-batch thread panicked".into()))))
        });
        Ok([r0?, r1?])
    }
}

/// The link between the halves: micro-batch 0 sends an event recorded after its GEMMs, which
/// micro-batch 1's stream waits on before its own.
struct Stagger {
    done: Mutex<Option<Sender<CudaEvent>>>,
    wait: Mutex<Receiver<CudaEvent>>,
}

impl Stagger {
    fn hook(&self, half: usize, stage: usize, s: &CudaStream) -> Result<()> {
        match (half, stage) {
            (0, 6) => {
                let ev = s.record_event(None).map_err(|e| err("event", e))?;
                if let Some(tx) = self.done.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
                    // Micro-batch 1 may have stopped listening (failed): nothing to wait for.
                    let _ = tx.send(ev);
                }
                Ok(())
            }
            (1, 3) => match self.wait.lock().unwrap_or_else(|p| p.into_inner()).recv_timeout(STAGGER_DEADLINE) {
                Ok(ev) => s.wait(&ev).map_err(|e| err("stream wait", e)),
                // Micro-batch 0 ran no GEMMs (no tokens on one GPU) or failed: nothing to wait for.
                Err(RecvTimeoutError::Disconnected) => Ok(()),
                Err(RecvTimeoutError::Timeout) => Err(MoeError::Config(format!(
                    "dual-batch: micro-batch 0 did not reach its expert GEMMs within {STAGGER_DEADLINE:?}"
                ))),
            },
            _ => Ok(()),
        }
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
