//! All-to-all-v: every (token, slot) row goes to the rank holding its expert, and comes back.
//!
//! Dispatch: histogram of slots per destination rank, exchange of the counts, then all-to-all-v
//! of the rows (with their physical expert ids and extra tensors); the receiving experts regroup
//! rows by local expert as they permute. Combine: the reverse all-to-all-v brings each slot's
//! unweighted output home, where the weighted sum runs in slot order.

use super::{check_extras, gather_counts, local_rows, DispatchInput, Ep, Extra, PrepareFinalize, Prepared};
use crate::comm::CommExt;
use crate::error::{MoeError, Result};
use crate::quant::{dequantize, QuantRows};
use crate::reduce::{WeightAndReduce, WeightedSum};
use crate::router::TopK;
use std::borrow::Cow;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Count exchange plus all-to-all-v of slot rows, and back.
pub struct All2AllV {
    ep: Ep,
    bytes: AtomicUsize,
}

struct State {
    /// Per destination rank, the flat slot indices (token·k + slot) sent there, in order.
    sent: Vec<Vec<usize>>,
    /// Rows received from each source rank.
    received: Vec<usize>,
    tokens: usize,
    k: usize,
    hidden: usize,
    /// Home routing weights `[tokens, k]`.
    weights: Vec<f32>,
}

impl All2AllV {
    /// Over the EP group of `ep`.
    pub fn new(ep: Ep) -> Self {
        All2AllV { ep, bytes: AtomicUsize::new(0) }
    }
}

impl PrepareFinalize for All2AllV {
    fn ep(&self) -> Option<&Ep> {
        Some(&self.ep)
    }
    fn ep_mut(&mut self) -> Option<&mut Ep> {
        Some(&mut self.ep)
    }
    fn name(&self) -> &'static str {
        "all2allv"
    }

    fn local_experts(&self) -> Option<Vec<usize>> {
        Some(self.ep.local_experts())
    }

    fn prepare<'a>(&self, input: DispatchInput<'a>) -> Result<Prepared<'a>> {
        check_extras(input.extras, input.tokens)?;
        let c = &*self.ep.comm;
        let (n, h, k) = (c.size(), input.hidden_size, input.topk.k);
        let counts = gather_counts(c, "all2allv.token_counts", input.tokens)?;
        let first: usize = counts[..c.rank()].iter().sum();
        let (rows, topk) = local_rows(&input, &self.ep.placement, first)?;
        // Histogram: slots per destination, in slot order.
        let mut sent = vec![Vec::new(); n];
        for (s, &p) in topk.ids.iter().enumerate() {
            sent[self.ep.placement.rank_of(p as usize)].push(s);
        }
        let send_counts: Vec<Vec<u64>> = sent.iter().map(|v| vec![v.len() as u64]).collect();
        let received: Vec<usize> =
            c.all_to_all_vec("all2allv.split_sizes", send_counts)?.into_iter().map(|v| v[0] as usize).collect();
        let (rb, sp) = (rows.config.row_bytes(h), rows.config.scales_per_row(h));
        // Each destination's rows copied whole, one slice a slot.
        let part_rows = |d: usize| -> Vec<u8> {
            let mut part = Vec::with_capacity(sent[d].len() * rb);
            sent[d].iter().for_each(|&s| part.extend_from_slice(&rows.data[(s / k) * rb..(s / k + 1) * rb]));
            part
        };
        let part_scales = |d: usize| -> Vec<f32> {
            let mut part = Vec::with_capacity(sent[d].len() * sp);
            sent[d].iter().for_each(|&s| part.extend_from_slice(&rows.scales[(s / k) * sp..(s / k + 1) * sp]));
            part
        };
        let got_rows = c.all_to_all_v("all2allv.rows", (0..n).map(part_rows).collect())?;
        let got_scales = c.all_to_all_vec("all2allv.scales", (0..n).map(part_scales).collect())?;
        let got_ids =
            c.all_to_all_vec("all2allv.ids", (0..n).map(|d| sent[d].iter().map(|&s| topk.ids[s]).collect()).collect())?;
        let mut extras = Vec::new();
        for e in input.extras {
            let parts = (0..n).map(|d| e.gather(sent[d].iter().map(|&s| s / k)).data).collect();
            extras.push(Extra { width: e.width, data: c.all_to_all_vec("all2allv.extra", parts)?.concat() });
        }
        for (src, (r, ids)) in got_rows.iter().zip(&got_ids).enumerate() {
            if r.len() != received[src] * rb || ids.len() != received[src] {
                return Err(MoeError::Comm {
                    rank: c.rank(),
                    op: "all2allv.rows".into(),
                    message: format!("rank {src} announced {} rows but sent {}", received[src], ids.len()),
                });
            }
        }
        let total: usize = received.iter().sum();
        let remote: usize = (0..n).filter(|&d| d != c.rank()).map(|d| sent[d].len()).sum();
        let per_row = rb + 4 * sp + 4 + input.extras.iter().map(|e| e.width * 4).sum::<usize>();
        self.bytes.store(remote * per_row, Ordering::Relaxed);
        let hidden = dequantize(&QuantRows { data: got_rows.concat(), scales: got_scales.concat(), ..rows.clone() });
        Ok(Prepared {
            hidden: Cow::Owned(hidden),
            topk: Cow::Owned(TopK { tokens: total, k: 1, ids: got_ids.concat(), weights: vec![1.0; total] }),
            expert_map: Some(self.ep.expert_map()),
            batched: None,
            extras,
            weights_applied: input.weights_on_input,
            state: Box::new(State { sent, received, tokens: input.tokens, k, hidden: h, weights: topk.weights }),
        })
    }

    /// The experts saw one slot per row with weight 1, so `expert_out` is `[rows, H]` of
    /// unweighted outputs whatever `reduce` they chose; the weighted sum happens here.
    fn finalize(
        &self,
        prepared: &Prepared,
        expert_out: &[f32],
        _reduce: &dyn WeightAndReduce,
        out: &mut [f32],
    ) -> Result<()> {
        let st = prepared.state.downcast_ref::<State>().expect("all2allv state");
        let c = &*self.ep.comm;
        let h = st.hidden;
        // Output rows travel as their bytes (one copy out, one into place on arrival).
        let mut start = 0;
        let parts = st
            .received
            .iter()
            .map(|&r| {
                let p = bytemuck::cast_slice::<f32, u8>(&expert_out[start * h..(start + r) * h]).to_vec();
                start += r;
                p
            })
            .collect();
        let back = c.all_to_all_v("all2allv.combine", parts)?;
        let mut slots = vec![-0.0f32; st.tokens * st.k * h];
        let row = 4 * h;
        for (d, rows) in back.iter().enumerate() {
            if rows.len() != st.sent[d].len() * row {
                return Err(MoeError::Comm {
                    rank: c.rank(),
                    op: "all2allv.combine".into(),
                    message: format!("rank {d} returned {} bytes for {} rows", rows.len(), st.sent[d].len()),
                });
            }
            let bytes = bytemuck::cast_slice_mut::<f32, u8>(&mut slots);
            for (i, &s) in st.sent[d].iter().enumerate() {
                bytes[s * row..(s + 1) * row].copy_from_slice(&rows[i * row..(i + 1) * row]);
            }
        }
        let remote: usize = st.received.iter().enumerate().filter(|&(s, _)| s != c.rank()).map(|(_, &r)| r).sum();
        self.bytes.fetch_add(remote * h * 4, Ordering::Relaxed);
        WeightedSum.apply(&slots, &st.weights, st.k, h, prepared.weights_applied, out);
        Ok(())
    }

    fn bytes_moved(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }
}
