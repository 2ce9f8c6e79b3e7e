//! Fixed-capacity low-latency dispatch (the MC2 / DeepEP low-latency shape).
//!
//! Every buffer has a fixed size set by `max_tokens_per_rank` (M): each rank sends every other
//! rank one message of M token rows, whose header carries the count, so no exchange of counts
//! precedes the data and shapes never depend on the batch. Receivers lay tokens out in the
//! batched format `[local_experts, M × EP, H]` (a token reaches an expert at most once, so M × EP
//! rows per expert always suffice). Combine returns fixed `[M, k, H]` buffers and the weighted
//! sum runs at home. A batch above M is an error before any communication.

use super::{check_extras, outgoing_rows, BatchedLayout, DispatchInput, Ep, Extra, PrepareFinalize, Prepared};
use crate::comm::CommExt;
use crate::error::{MoeError, Result};
use crate::quant::{dequantize, QuantRows};
use crate::reduce::{WeightAndReduce, WeightedSum};
use crate::router::TopK;
use std::borrow::Cow;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Fixed-capacity dispatch and combine in the batched format.
pub struct LowLatency {
    ep: Ep,
    max_tokens: usize,
    bytes: AtomicUsize,
}

struct State {
    /// Per destination: the local token indices sent there, in message order.
    sent: Vec<Vec<usize>>,
    /// For each batched row (local expert · capacity + position): (source, message index, slot).
    origin: Vec<Option<(usize, usize, usize)>>,
    tokens: usize,
    k: usize,
    hidden: usize,
    weights: Vec<f32>,
}

impl LowLatency {
    /// Over the EP group of `ep`, each rank sending at most `max_tokens_per_rank` tokens.
    pub fn new(ep: Ep, max_tokens_per_rank: usize) -> Result<Self> {
        if max_tokens_per_rank == 0 {
            return Err(MoeError::Config("lowlatency needs max_tokens_per_rank > 0".into()));
        }
        let ranks = ep.comm.size();
        if max_tokens_per_rank.checked_mul(ranks).and_then(|c| c.checked_mul(ranks)).is_none() {
            return Err(MoeError::Config(format!(
                "lowlatency max_tokens_per_rank {max_tokens_per_rank} over {ranks} ranks overflows the buffer sizes"
            )));
        }
        Ok(LowLatency { ep, max_tokens: max_tokens_per_rank, bytes: AtomicUsize::new(0) })
    }

    /// Rows reserved per local expert.
    pub fn capacity(&self) -> usize {
        self.max_tokens * self.ep.comm.size()
    }
}

/// Bytes one rank holds for a dispatch and combine at capacity `m` per rank: messages sent and
/// received (`n` each, 32-bit words), the batched layout of `local` experts with its origins,
/// and the experts' output rows. Computed in u128 so no flag value can overflow it.
#[allow(clippy::too_many_arguments)]
fn dispatch_bytes(n: usize, m: usize, k: usize, h: usize, rb: usize, sp: usize, extras: usize, local: usize) -> u128 {
    let (n, m, k, h, rb, sp, extras, local) =
        (n as u128, m as u128, k as u128, h as u128, rb as u128, sp as u128, extras as u128, local as u128);
    let words = 1 + m * k + m * (rb.div_ceil(4) + sp + extras);
    let rows = local * m * n;
    let origin = std::mem::size_of::<Option<(usize, usize, usize)>>() as u128;
    2 * n * words * 4 + rows * (rb + 4 * sp + 4 * extras + origin + 4 * h) + n * m * k * h * 4
}

/// One fixed-size message: `[count, local slot per (token, k) (M·k, -1 = not here),
/// rows (M·`row_words`), scales (M·`scales`), extras (M·width each)]`, all 32-bit words.
fn message_len(m: usize, k: usize, row_words: usize, scales: usize, extras: &[Extra]) -> usize {
    1 + m * k + m * (row_words + scales) + extras.iter().map(|e| m * e.width).sum::<usize>()
}

impl PrepareFinalize for LowLatency {
    fn ep(&self) -> Option<&Ep> {
        Some(&self.ep)
    }
    fn ep_mut(&mut self) -> Option<&mut Ep> {
        Some(&mut self.ep)
    }
    fn name(&self) -> &'static str {
        "lowlatency"
    }

    fn activation_format(&self) -> crate::experts::ActivationFormat {
        crate::experts::ActivationFormat::Batched
    }

    fn local_experts(&self) -> Option<Vec<usize>> {
        Some(self.ep.local_experts())
    }

    fn prepare<'a>(&self, input: DispatchInput<'a>) -> Result<Prepared<'a>> {
        let (c, p) = (&*self.ep.comm, &*self.ep.placement);
        let (n, m, h, k, t) = (c.size(), self.max_tokens, input.hidden_size, input.topk.k, input.tokens);
        if t > m {
            return Err(MoeError::Config(format!(
                "batch of {t} tokens exceeds the low-latency capacity of {m} tokens per rank"
            )));
        }
        check_extras(input.extras, t)?;
        let rows = outgoing_rows(&input)?;
        let (rb, sp) = (rows.config.row_bytes(h), rows.config.scales_per_row(h));
        // Every rank computes the same size from the same flags, so all refuse together,
        // before any message.
        let extras_width = input.extras.iter().map(|e| e.width).sum();
        crate::memory::ensure(
            &format!("low-latency buffers for max_tokens_per_rank {m} ({n} ranks, hidden {h}, top-{k})"),
            dispatch_bytes(
                n,
                m,
                k,
                h,
                rb,
                sp,
                extras_width,
                (0..n).map(|r| p.local_experts(r).len()).max().unwrap_or(0),
            ),
        )?;
        let rw = rb.div_ceil(4);
        let (rows_at, scales_at, extras_at) = (1 + m * k, 1 + m * k + m * rw, 1 + m * k + m * (rw + sp));
        // Global token index r·M + t: replicas are chosen without exchanging counts.
        let phys = p.to_physical(input.topk, c.rank() * m);
        let mut sent = vec![Vec::new(); n];
        let len = message_len(m, k, rw, sp, input.extras);
        let mut msgs = vec![vec![0u32; len]; n];
        let maps: Vec<Vec<i32>> = (0..n).map(|d| p.expert_map(d)).collect();
        for (d, msg) in msgs.iter_mut().enumerate() {
            msg[1..1 + m * k].iter_mut().for_each(|w| *w = u32::MAX);
            for tok in 0..t {
                let mine = (0..k).filter(|&j| p.rank_of(phys[tok * k + j] as usize) == d);
                let slots: Vec<usize> = mine.collect();
                if slots.is_empty() {
                    continue;
                }
                let i = sent[d].len();
                sent[d].push(tok);
                for j in slots {
                    msg[1 + i * k + j] = maps[d][phys[tok * k + j] as usize] as u32;
                }
                let row: &mut [u8] = bytemuck::cast_slice_mut(&mut msg[rows_at + i * rw..rows_at + (i + 1) * rw]);
                row[..rb].copy_from_slice(&rows.data[tok * rb..(tok + 1) * rb]);
                for (w, sc) in
                    msg[scales_at + i * sp..scales_at + (i + 1) * sp].iter_mut().zip(&rows.scales[tok * sp..])
                {
                    *w = sc.to_bits();
                }
                let mut at = extras_at;
                for e in input.extras {
                    msg[at + i * e.width..at + (i + 1) * e.width]
                        .copy_from_slice(&e.data[tok * e.width..(tok + 1) * e.width]);
                    at += m * e.width;
                }
            }
            msg[0] = sent[d].len() as u32;
        }
        let got = c.all_to_all_vec("lowlatency.dispatch", msgs)?;
        // Batched layout.
        let local = p.local_experts(c.rank()).len();
        let cap = self.capacity();
        let mut data = vec![0u8; local * cap * rb];
        let mut scales = vec![0f32; local * cap * sp];
        let mut extras: Vec<Extra> =
            input.extras.iter().map(|e| Extra { width: e.width, data: vec![0; local * cap * e.width] }).collect();
        let mut counts = vec![0usize; local];
        let mut origin = vec![None; local * cap];
        for (src, msg) in got.iter().enumerate() {
            if msg.len() != len {
                return Err(MoeError::Comm {
                    rank: c.rank(),
                    op: "lowlatency.dispatch".into(),
                    message: format!("rank {src} sent {} words, the fixed message has {len}", msg.len()),
                });
            }
            for i in 0..msg[0] as usize {
                for j in 0..k {
                    let l = msg[1 + i * k + j];
                    if l == u32::MAX {
                        continue;
                    }
                    let l = l as usize;
                    let r = l * cap + counts[l];
                    counts[l] += 1;
                    origin[r] = Some((src, i, j));
                    let row: &[u8] = bytemuck::cast_slice(&msg[rows_at + i * rw..rows_at + (i + 1) * rw]);
                    data[r * rb..(r + 1) * rb].copy_from_slice(&row[..rb]);
                    for (sc, &w) in scales[r * sp..(r + 1) * sp].iter_mut().zip(&msg[scales_at + i * sp..]) {
                        *sc = f32::from_bits(w);
                    }
                    let mut at = extras_at;
                    for e in extras.iter_mut() {
                        let w = e.width;
                        e.data[r * w..(r + 1) * w].copy_from_slice(&msg[at + i * w..at + (i + 1) * w]);
                        at += m * w;
                    }
                }
            }
        }
        self.bytes.store((n - 1) * len * 4, Ordering::Relaxed);
        let hidden = dequantize(&QuantRows { data, scales, ..rows });
        Ok(Prepared {
            hidden: Cow::Owned(hidden),
            topk: Cow::Owned(TopK { tokens: 0, k, ids: vec![], weights: vec![] }),
            expert_map: Some(self.ep.expert_map()),
            batched: Some(BatchedLayout { capacity: cap, counts }),
            extras,
            weights_applied: input.weights_on_input,
            state: Box::new(State { sent, origin, tokens: t, k, hidden: h, weights: input.topk.weights.clone() }),
        })
    }

    /// `expert_out` is `[local, capacity, H]` of unweighted rows; the weighted sum happens at home.
    fn finalize(
        &self,
        prepared: &Prepared,
        expert_out: &[f32],
        _reduce: &dyn WeightAndReduce,
        out: &mut [f32],
    ) -> Result<()> {
        let st = prepared.state.downcast_ref::<State>().expect("lowlatency state");
        let c = &*self.ep.comm;
        let (n, m, h, k) = (c.size(), self.max_tokens, st.hidden, st.k);
        let mut back = vec![vec![-0.0f32; m * k * h]; n];
        for (r, o) in st.origin.iter().enumerate() {
            if let Some((src, i, j)) = *o {
                back[src][(i * k + j) * h..(i * k + j + 1) * h].copy_from_slice(&expert_out[r * h..(r + 1) * h]);
            }
        }
        let got = c.all_to_all_vec::<f32>("lowlatency.combine", back)?;
        let mut slots = vec![-0.0f32; st.tokens * k * h];
        for (d, buf) in got.iter().enumerate() {
            for (i, &tok) in st.sent[d].iter().enumerate() {
                for j in 0..k {
                    let v = &buf[(i * k + j) * h..(i * k + j + 1) * h];
                    // Slots computed elsewhere came back as -0.0 rows: adding them is exact.
                    slots[(tok * k + j) * h..(tok * k + j + 1) * h].iter_mut().zip(v).for_each(|(s, &x)| *s += x);
                }
            }
        }
        self.bytes.fetch_add((n - 1) * m * k * h * 4, Ordering::Relaxed);
        WeightedSum.apply(&slots, &st.weights, k, h, prepared.weights_applied, out);
        Ok(())
    }

    fn bytes_moved(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }
}
