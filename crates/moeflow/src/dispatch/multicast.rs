//! Naive multicast: every rank broadcasts its slice of tokens; the slices line up by cumulative
//! token offsets. Combine all-reduces the per-slot outputs and each rank keeps its own range.

use super::{
    check_extras, gather_counts, local_rows, DispatchInput, Ep, Extra, GatheredRows, PrepareFinalize, Prepared,
};
use crate::comm::{CommExt, Communicator};
use crate::error::Result;
use crate::quant::{dequantize, QuantRows};
use crate::reduce::WeightAndReduce;
use crate::router::TopK;
use std::borrow::Cow;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Broadcast dispatch, all-reduce combine.
pub struct Multicast {
    ep: Ep,
    bytes: AtomicUsize,
}

struct State {
    rows: GatheredRows,
    hidden: usize,
}

impl Multicast {
    /// Over the EP group of `ep`.
    pub fn new(ep: Ep) -> Self {
        Multicast { ep, bytes: AtomicUsize::new(0) }
    }
}

/// Every rank's `data` in rank order, one broadcast per root.
fn multicast<T: bytemuck::Pod>(comm: &dyn Communicator, op: &str, data: &[T]) -> Result<Vec<T>> {
    let mut all = Vec::new();
    for root in 0..comm.size() {
        all.extend(comm.broadcast_vec(op, root, data)?);
    }
    Ok(all)
}

impl PrepareFinalize for Multicast {
    fn ep(&self) -> Option<&Ep> {
        Some(&self.ep)
    }
    fn ep_mut(&mut self) -> Option<&mut Ep> {
        Some(&mut self.ep)
    }
    fn name(&self) -> &'static str {
        "multicast"
    }

    fn local_experts(&self) -> Option<Vec<usize>> {
        Some(self.ep.local_experts())
    }

    fn prepare<'a>(&self, input: DispatchInput<'a>) -> Result<Prepared<'a>> {
        check_extras(input.extras, input.tokens)?;
        let c = &*self.ep.comm;
        let counts = gather_counts(c, "multicast.counts", input.tokens)?;
        let rows = GatheredRows { counts, rank: c.rank() };
        let total = rows.counts.iter().sum();
        let (local, topk) = local_rows(&input, &self.ep.placement, rows.offset())?;
        let data = multicast(c, "multicast.hidden", &local.data)?;
        let scales = multicast(c, "multicast.scales", &local.scales)?;
        let hidden = dequantize(&QuantRows { data, scales, ..local.clone() });
        let ids = multicast(c, "multicast.ids", &topk.ids)?;
        let weights = multicast(c, "multicast.weights", &topk.weights)?;
        let extras = input
            .extras
            .iter()
            .map(|e| Ok(Extra { width: e.width, data: multicast(c, "multicast.extra", &e.data)? }))
            .collect::<Result<Vec<_>>>()?;
        let sent = local.data.len()
            + 4 * (local.scales.len() + 2 * topk.ids.len() + input.extras.iter().map(|e| e.data.len()).sum::<usize>());
        self.bytes.store(sent * (c.size() - 1), Ordering::Relaxed);
        Ok(Prepared {
            hidden: Cow::Owned(hidden),
            topk: Cow::Owned(TopK { tokens: total, k: topk.k, ids, weights }),
            expert_map: Some(self.ep.expert_map()),
            batched: None,
            extras,
            weights_applied: input.weights_on_input,
            state: Box::new(State { rows, hidden: input.hidden_size }),
        })
    }

    fn finalize(
        &self,
        prepared: &Prepared,
        expert_out: &[f32],
        reduce: &dyn WeightAndReduce,
        out: &mut [f32],
    ) -> Result<()> {
        let state = prepared.state.downcast_ref::<State>().expect("multicast state");
        let k = prepared.topk.k;
        let per_row = reduce.expert_output_len(1, k, state.hidden);
        let summed = self.ep.comm.all_reduce_sum("multicast.combine", expert_out)?;
        let (offset, t) = (state.rows.offset(), state.rows.counts[state.rows.rank]);
        let mine = &summed[offset * per_row..(offset + t) * per_row];
        reduce.apply(
            mine,
            &prepared.topk.weights[offset * k..(offset + t) * k],
            k,
            state.hidden,
            prepared.weights_applied,
            out,
        );
        self.bytes.fetch_add(expert_out.len() * 4 * (self.ep.comm.size() - 1), Ordering::Relaxed);
        Ok(())
    }

    fn bytes_moved(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }
}
