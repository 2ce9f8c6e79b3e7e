//! Tensor-parallel padding and slicing around any expert-parallel strategy.
//!
//! The ranks of a TP group hold the same tokens. Each pads the batch (to a multiple of the TP
//! size, or to a fixed length whose tail is masked out), keeps its own contiguous slice, and
//! hands only those tokens to the inner strategy; after combine the TP group all-gathers the
//! slices and strips the padding, so every TP rank ends with every token's output. Two
//! deployment switches skip the slicing (shared experts run data-parallel, or the all-reduce
//! of the attention output was replaced): then every TP rank dispatches all its tokens.

use super::{DispatchInput, Extra, PrepareFinalize, Prepared};
use crate::comm::{CommExt, Communicator};
use crate::error::{MoeError, Result};
use crate::reduce::WeightAndReduce;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// How the token dimension is padded before slicing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpPadding {
    /// To the next multiple of the TP size (the all-to-all prepare).
    Multiple,
    /// To this fixed length, padding rows masked out (the MC2 prepare); must divide by TP.
    Fixed(usize),
}

/// Slices tokens across a TP group around an inner strategy.
pub struct TpSlice {
    inner: Box<dyn PrepareFinalize>,
    tp: Arc<dyn Communicator>,
    padding: TpPadding,
    skip: bool,
    /// Slices of prepares not yet finalized, oldest first.
    pending: Mutex<VecDeque<Slice>>,
}

#[derive(Clone, Copy, Debug)]
struct Slice {
    tokens: usize,
    start: usize,
    end: usize,
    chunk: usize,
    hidden: usize,
}

impl TpSlice {
    /// Slices over `tp` around `inner`.
    pub fn new(inner: Box<dyn PrepareFinalize>, tp: Arc<dyn Communicator>, padding: TpPadding) -> Result<Self> {
        if let TpPadding::Fixed(n) = padding {
            if n == 0 || !n.is_multiple_of(tp.size()) {
                return Err(MoeError::Config(format!(
                    "fixed TP padding {n} must be a positive multiple of TP {}",
                    tp.size()
                )));
            }
        }
        Ok(TpSlice { inner, tp, padding, skip: false, pending: Mutex::new(VecDeque::new()) })
    }

    /// The same strategy with slicing switched off (shared-expert DP or replaced all-reduce).
    pub fn skipped(mut self) -> Self {
        self.skip = true;
        self
    }
}

impl PrepareFinalize for TpSlice {
    fn ep(&self) -> Option<&super::Ep> {
        self.inner.ep()
    }
    fn ep_mut(&mut self) -> Option<&mut super::Ep> {
        self.inner.ep_mut()
    }
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn activation_format(&self) -> crate::experts::ActivationFormat {
        self.inner.activation_format()
    }
    fn routes_after_dispatch(&self) -> bool {
        self.inner.routes_after_dispatch()
    }
    fn local_experts(&self) -> Option<Vec<usize>> {
        self.inner.local_experts()
    }
    fn bytes_moved(&self) -> usize {
        self.inner.bytes_moved()
    }

    fn prepare<'a>(&self, input: DispatchInput<'a>) -> Result<Prepared<'a>> {
        if self.skip {
            return self.inner.prepare(input);
        }
        let (t, h, size) = (input.tokens, input.hidden_size, self.tp.size());
        let padded = match self.padding {
            TpPadding::Multiple => t.div_ceil(size) * size,
            TpPadding::Fixed(n) if t <= n => n,
            TpPadding::Fixed(n) => {
                return Err(MoeError::Config(format!("batch of {t} tokens exceeds the fixed TP padding of {n}")))
            }
        };
        let chunk = padded / size;
        let start = (self.tp.rank() * chunk).min(t);
        let end = ((self.tp.rank() + 1) * chunk).min(t);
        let topk = input.topk.slice(start, end);
        let extras: Vec<Extra> = input.extras.iter().map(|e| e.gather(start..end)).collect();
        let e = input.router.num_experts();
        let logits = if input.logits.is_empty() { input.logits } else { &input.logits[start * e..end * e] };
        let sub = DispatchInput {
            hidden: &input.hidden[start * h..end * h],
            tokens: end - start,
            topk: &topk,
            logits,
            extras: &extras,
            ..input
        };
        let prepared = self.inner.prepare(sub)?.into_owned();
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).push_back(Slice {
            tokens: t,
            start,
            end,
            chunk,
            hidden: h,
        });
        Ok(prepared)
    }

    fn finalize(
        &self,
        prepared: &Prepared,
        expert_out: &[f32],
        reduce: &dyn WeightAndReduce,
        out: &mut [f32],
    ) -> Result<()> {
        if self.skip {
            return self.inner.finalize(prepared, expert_out, reduce, out);
        }
        let s = self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop_front()
            .ok_or_else(|| MoeError::Config("TP slice: finalize without a matching prepare".into()))?;
        let mut mine = vec![0f32; s.chunk * s.hidden];
        self.inner.finalize(prepared, expert_out, reduce, &mut mine[..(s.end - s.start) * s.hidden])?;
        let all = self.tp.all_gather_vec("tp_slice.all_gather", &mine)?.concat();
        out.copy_from_slice(&all[..s.tokens * s.hidden]);
        Ok(())
    }
}
