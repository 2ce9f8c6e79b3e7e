//! All-gather dispatch, reduce-scatter combine (naive DP/EP).
//!
//! Dispatch pads every rank's batch to the largest in the gather group and all-gathers rows,
//! top-k ids and weights (or router logits, see [`super::allgather_logits()`]) and extra tensors;
//! every rank then runs its local experts on every gathered token. Combine reduce-scatters the
//! per-slot outputs home (then all-reduces over TP ranks when tokens were gathered over the DP
//! group only) and applies the weighted sum there.

use super::{
    check_extras, gather_counts, local_rows, DispatchInput, Ep, Extra, GatheredRows, PrepareFinalize, Prepared,
};
use crate::comm::{CommExt, Communicator};
use crate::error::Result;
use crate::quant::{dequantize, quantize, QuantRows};
use crate::reduce::WeightAndReduce;
use crate::router::TopK;
use std::borrow::Cow;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// What travels with the rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Payload {
    /// Top-k ids and weights, routed at home.
    TopK,
    /// Router logits; every rank routes the gathered tokens.
    Logits,
}

/// The all-gather / reduce-scatter strategy.
pub struct AllGather {
    ep: Ep,
    gather: Arc<dyn Communicator>,
    tp: Option<Arc<dyn Communicator>>,
    pub(crate) payload: Payload,
    bytes: AtomicUsize,
}

struct State {
    rows: GatheredRows,
    hidden: usize,
}

impl AllGather {
    /// Sequence-parallel form: every EP rank holds distinct tokens; gather and reduce-scatter
    /// over the EP group.
    pub fn new(ep: Ep) -> Self {
        let gather = ep.comm.clone();
        AllGather { ep, gather, tp: None, payload: Payload::TopK, bytes: AtomicUsize::new(0) }
    }

    /// DP form: the ranks of a TP group hold the same tokens; gather and reduce-scatter over
    /// the DP group (`dp`: ranks with this rank's TP index), then all-reduce over `tp`.
    pub fn with_dp_tp(ep: Ep, dp: Arc<dyn Communicator>, tp: Arc<dyn Communicator>) -> Self {
        AllGather { ep, gather: dp, tp: Some(tp), payload: Payload::TopK, bytes: AtomicUsize::new(0) }
    }
}

/// Pads `data` (`rows × width`) to `max_rows × width`, all-gathers, and strips each rank's
/// padding: the concatenation of every rank's rows.
fn gather_padded<T: bytemuck::Pod>(
    comm: &dyn Communicator,
    op: &str,
    data: &[T],
    width: usize,
    counts: &[usize],
) -> Result<Vec<T>> {
    let max = counts.iter().copied().max().unwrap_or(0);
    let mut padded = data.to_vec();
    padded.resize(max * width, T::zeroed());
    let all = comm.all_gather_vec(op, &padded)?;
    Ok(all.iter().zip(counts).flat_map(|(v, &c)| v[..c * width].iter().copied()).collect())
}

impl PrepareFinalize for AllGather {
    fn ep(&self) -> Option<&Ep> {
        Some(&self.ep)
    }
    fn ep_mut(&mut self) -> Option<&mut Ep> {
        Some(&mut self.ep)
    }
    fn name(&self) -> &'static str {
        match self.payload {
            Payload::TopK => "allgather",
            Payload::Logits => "allgather-logits",
        }
    }

    fn routes_after_dispatch(&self) -> bool {
        self.payload == Payload::Logits
    }

    fn local_experts(&self) -> Option<Vec<usize>> {
        Some(self.ep.local_experts())
    }

    fn prepare<'a>(&self, input: DispatchInput<'a>) -> Result<Prepared<'a>> {
        check_extras(input.extras, input.tokens)?;
        let g = &*self.gather;
        let (h, t) = (input.hidden_size, input.tokens);
        let counts = gather_counts(g, "allgather.counts", t)?;
        let rows = GatheredRows { counts, rank: g.rank() };
        let (offset, total) = (rows.offset(), rows.counts.iter().sum::<usize>());
        let max = rows.counts.iter().copied().max().unwrap_or(0);
        let extras = input
            .extras
            .iter()
            .map(|e| {
                Ok(Extra { width: e.width, data: gather_padded(g, "allgather.extra", &e.data, e.width, &rows.counts)? })
            })
            .collect::<Result<Vec<_>>>()?;
        let (rb, sp) = (input.quant.row_bytes(h), input.quant.scales_per_row(h));
        let mut sent = max * (rb + 4 * sp + input.extras.iter().map(|e| e.width * 4).sum::<usize>());
        let gather_rows = |q: &QuantRows| -> Result<Vec<f32>> {
            let data = gather_padded(g, "allgather.hidden", &q.data, rb, &rows.counts)?;
            let scales = gather_padded(g, "allgather.scales", &q.scales, sp, &rows.counts)?;
            Ok(dequantize(&QuantRows { data, scales, ..q.clone() }))
        };
        let (hidden, topk, weights_applied) = match self.payload {
            Payload::TopK => {
                let (local, topk) = local_rows(&input, &self.ep.placement, offset)?;
                let k = topk.k;
                let hidden = gather_rows(&local)?;
                let ids = gather_padded(g, "allgather.ids", &topk.ids, k, &rows.counts)?;
                let weights = gather_padded(g, "allgather.weights", &topk.weights, k, &rows.counts)?;
                sent += max * k * 8;
                (hidden, TopK { tokens: total, k, ids, weights }, input.weights_on_input)
            }
            Payload::Logits => {
                let e = input.router.num_experts();
                let hidden = gather_rows(&quantize(input.quant, input.hidden, h)?)?;
                let logits = gather_padded(g, "allgather.logits", input.logits, e, &rows.counts)?;
                sent += max * e * 4;
                let routed = input.router.route(&logits, total)?;
                let ids = self.ep.placement.to_physical(&routed, 0);
                let topk = TopK { ids, ..routed };
                let hidden = if input.weights_on_input { super::weight_rows(&hidden, h, &topk)? } else { hidden };
                (hidden, topk, input.weights_on_input)
            }
        };
        self.bytes.store(sent * (g.size() - 1), Ordering::Relaxed);
        Ok(Prepared {
            hidden: Cow::Owned(hidden),
            topk: Cow::Owned(topk),
            expert_map: Some(self.ep.expert_map()),
            batched: None,
            extras,
            weights_applied,
            state: Box::new(State { rows, hidden: h }),
        })
    }

    fn finalize(
        &self,
        prepared: &Prepared,
        expert_out: &[f32],
        reduce: &dyn WeightAndReduce,
        out: &mut [f32],
    ) -> Result<()> {
        let state = prepared.state.downcast_ref::<State>().expect("allgather state");
        let k = prepared.topk.k;
        let per_row = reduce.expert_output_len(1, k, state.hidden);
        let elems: Vec<usize> = state.rows.counts.iter().map(|&c| c * per_row).collect();
        let mut mine = self.gather.reduce_scatter_sum("allgather.combine", expert_out, &elems)?;
        if let Some(tp) = &self.tp {
            mine = tp.all_reduce_sum("allgather.tp_all_reduce", &mine)?;
        }
        let (offset, t) = (state.rows.offset(), state.rows.counts[state.rows.rank]);
        let weights = &prepared.topk.weights[offset * k..(offset + t) * k];
        reduce.apply(&mine, weights, k, state.hidden, prepared.weights_applied, out);
        let combine = (expert_out.len() - elems[state.rows.rank]) * 4;
        self.bytes.fetch_add(combine, Ordering::Relaxed);
        Ok(())
    }

    fn bytes_moved(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }
}
