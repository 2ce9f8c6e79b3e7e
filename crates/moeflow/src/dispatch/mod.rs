//! Quantize+Dispatch and Combine: the strategies that move tokens to experts and results home.
//!
//! A [`PrepareFinalize`] is one object because its two halves must agree on where every row
//! went. Any strategy composes with any [`crate::experts::Experts`] of the same activation
//! format. One file per strategy:
//!
//! | strategy | dispatch | combine |
//! | --- | --- | --- |
//! | [`Local`] | none | weight-and-reduce |
//! | [`AllGather`] | pad to the group's max, all-gather rows + ids + weights + extras | reduce-scatter (+ TP all-reduce) |
//! | [`allgather_logits()`] | all-gather router logits, route after dispatch | reduce-scatter |
//! | [`Multicast`] | every rank broadcasts its slice | all-reduce, slice own range |
//! | [`All2AllV`] | counts, then all-to-all-v of slot rows | reverse all-to-all-v |
//! | [`LowLatency`] | fixed-capacity buffers, batched format, counts inside the data | fixed-capacity return |
//! | [`TpSlice`] | pad and slice tokens over TP ranks around any of the above | all-gather over TP, unpad |
//!
//! Combine is bitwise exact on the CPU f32 path: expert output travels per (token, slot) with
//! `-0.0` where a rank did not compute the slot, reductions start from `-0.0`, and the weighted
//! sum over slots happens at home in slot order, exactly as on a single rank.

mod all2allv;
mod allgather;
mod allgather_logits;
mod local;
mod lowlatency;
mod multicast;
mod tp_slice;

pub use all2allv::All2AllV;
pub use allgather::AllGather;
pub use allgather_logits::allgather_logits;
pub use local::Local;
pub use lowlatency::LowLatency;
pub use multicast::Multicast;
pub use tp_slice::{TpPadding, TpSlice};

use crate::comm::{CommExt, Communicator};
use crate::error::{MoeError, Result};
use crate::experts::ActivationFormat;
use crate::placement::ExpertPlacement;
use crate::quant::{quantize, QuantConfig, QuantRows};
use crate::reduce::WeightAndReduce;
use crate::router::{Router, TopK};
use std::any::Any;
use std::borrow::Cow;
use std::sync::Arc;

/// A per-token tensor that travels with the tokens (e.g. an adapter id): `width` 32-bit words
/// per token (bit patterns; f32 values travel as their bits).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Extra {
    /// Words per token.
    pub width: usize,
    /// `[tokens, width]`.
    pub data: Vec<u32>,
}

impl Extra {
    /// Rows `rows` of this tensor, in that order.
    pub fn gather(&self, rows: impl Iterator<Item = usize>) -> Extra {
        let w = self.width;
        Extra { width: w, data: rows.flat_map(|r| self.data[r * w..(r + 1) * w].iter().copied()).collect() }
    }
}

/// What a rank hands to prepare.
#[derive(Clone, Copy)]
pub struct DispatchInput<'a> {
    /// `[tokens, H]`.
    pub hidden: &'a [f32],
    /// H.
    pub hidden_size: usize,
    /// Number of tokens on this rank (may be 0).
    pub tokens: usize,
    /// Routing `[tokens, k]` (logical expert ids), when routed before dispatch.
    pub topk: &'a TopK,
    /// Router logits `[tokens, E]`, for strategies that route after dispatch.
    pub logits: &'a [f32],
    /// The router, for strategies that route after dispatch.
    pub router: &'a dyn Router,
    /// Per-token tensors that travel with the tokens.
    pub extras: &'a [Extra],
    /// Multiply rows by their router weight before they leave (top-k = 1).
    pub weights_on_input: bool,
    /// Format the rows travel in (quantized before they leave, scales alongside).
    pub quant: QuantConfig,
}

/// Rows in the batched format: `[local_experts, capacity, H]`, expert `e` using its first
/// `counts[e]` rows.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchedLayout {
    /// Rows reserved per local expert.
    pub capacity: usize,
    /// Valid rows per local expert.
    pub counts: Vec<usize>,
}

/// What prepare hands to the experts: rows, their routing, and the strategy's private state
/// that finalize needs to bring results home.
pub struct Prepared<'a> {
    /// Rows for this rank's experts: `[rows, H]` (standard) or `[local, capacity, H]` (batched).
    pub hidden: Cow<'a, [f32]>,
    /// Routing of the standard-format rows (physical expert ids when `expert_map` is set).
    pub topk: Cow<'a, TopK>,
    /// Physical expert → local slot (`-1`: elsewhere); `None` when every expert is local.
    pub expert_map: Option<Arc<[i32]>>,
    /// Set for the batched format.
    pub batched: Option<BatchedLayout>,
    /// Per-row extras, aligned with the rows of `hidden`.
    pub extras: Vec<Extra>,
    /// The router weights were multiplied into `hidden`.
    pub weights_applied: bool,
    /// Strategy-specific bookkeeping for finalize.
    pub state: Box<dyn Any + Send + Sync>,
}

impl Prepared<'_> {
    /// The same, owning everything it borrowed, so it can outlive the dispatch's input.
    pub fn into_owned(self) -> Prepared<'static> {
        Prepared {
            hidden: Cow::Owned(self.hidden.into_owned()),
            topk: Cow::Owned(self.topk.into_owned()),
            expert_map: self.expert_map,
            batched: self.batched,
            extras: self.extras,
            weights_applied: self.weights_applied,
            state: self.state,
        }
    }
}

/// Moves tokens to the experts (prepare) and expert output back to token rows (finalize).
pub trait PrepareFinalize: Send + Sync {
    /// Name on the command line.
    fn name(&self) -> &'static str;
    /// The format prepare produces.
    fn activation_format(&self) -> ActivationFormat {
        ActivationFormat::Standard
    }
    /// Whether prepare routes (from `logits`) after dispatch instead of using `topk`.
    fn routes_after_dispatch(&self) -> bool {
        false
    }
    /// Logical experts held in this rank's local slots (`None`: all experts, slot = id).
    fn local_experts(&self) -> Option<Vec<usize>> {
        None
    }
    /// Dispatches this rank's tokens.
    fn prepare<'a>(&self, input: DispatchInput<'a>) -> Result<Prepared<'a>>;
    /// Combines `expert_out` (laid out as `reduce` says, for the prepared rows) into
    /// `out [tokens, H]` for the tokens given to prepare.
    fn finalize(
        &self,
        prepared: &Prepared,
        expert_out: &[f32],
        reduce: &dyn WeightAndReduce,
        out: &mut [f32],
    ) -> Result<()>;
    /// Bytes this rank sent in the last prepare and finalize (0 for local).
    fn bytes_moved(&self) -> usize {
        0
    }
    /// The expert-parallel group and placement this strategy dispatches over (`None`: one
    /// rank holding every expert).
    fn ep(&self) -> Option<&Ep> {
        None
    }
    /// [`PrepareFinalize::ep`], to change the placement between forward calls (live
    /// rebalancing: the layer moves the weights first).
    fn ep_mut(&mut self) -> Option<&mut Ep> {
        None
    }
}

/// `hidden [T, H]` with each row multiplied by its (single) router weight.
pub fn weight_rows(hidden: &[f32], hidden_size: usize, topk: &TopK) -> Result<Vec<f32>> {
    if topk.k != 1 {
        return Err(MoeError::Config(format!("apply_router_weight_on_input needs top-k = 1, got {}", topk.k)));
    }
    let mut rows = hidden.to_vec();
    for (row, &w) in rows.chunks_mut(hidden_size.max(1)).zip(&topk.weights) {
        row.iter_mut().for_each(|x| *x *= w);
    }
    Ok(rows)
}

/// The expert-parallel context every distributed strategy shares: the EP group and the
/// placement of experts on its ranks.
#[derive(Clone)]
pub struct Ep {
    /// The EP group.
    pub comm: Arc<dyn Communicator>,
    /// Experts on the group's ranks.
    pub placement: Arc<ExpertPlacement>,
}

impl Ep {
    /// Checks that the placement spans the group.
    pub fn new(comm: Arc<dyn Communicator>, placement: Arc<ExpertPlacement>) -> Result<Self> {
        if placement.ranks() != comm.size() {
            return Err(MoeError::Config(format!(
                "placement spans {} ranks but the EP group has {}",
                placement.ranks(),
                comm.size()
            )));
        }
        Ok(Ep { comm, placement })
    }

    /// This rank's logical experts.
    pub fn local_experts(&self) -> Vec<usize> {
        self.placement.local_experts(self.comm.rank()).to_vec()
    }

    /// Physical id → local slot on this rank.
    pub fn expert_map(&self) -> Arc<[i32]> {
        self.placement.expert_map(self.comm.rank()).into()
    }
}

/// Token counts of every rank of `comm`.
pub(crate) fn gather_counts(comm: &dyn Communicator, op: &str, tokens: usize) -> Result<Vec<usize>> {
    Ok(comm.all_gather_vec(op, &[tokens as u64])?.into_iter().map(|v| v[0] as usize).collect())
}

/// This rank's rows as they leave, for `input` whose first token has global index
/// `first_token`: weighted if asked, quantized to `input.quant`; ids mapped to replicas.
pub(crate) fn local_rows(
    input: &DispatchInput<'_>,
    placement: &ExpertPlacement,
    first_token: usize,
) -> Result<(QuantRows, TopK)> {
    let rows = outgoing_rows(input)?;
    let topk = TopK { ids: placement.to_physical(input.topk, first_token), ..input.topk.clone() };
    Ok((rows, topk))
}

/// `input`'s rows, weighted when asked, quantized to `input.quant`.
pub(crate) fn outgoing_rows(input: &DispatchInput<'_>) -> Result<QuantRows> {
    if input.weights_on_input {
        quantize(input.quant, &weight_rows(input.hidden, input.hidden_size, input.topk)?, input.hidden_size)
    } else {
        quantize(input.quant, input.hidden, input.hidden_size)
    }
}

/// The finalize state shared by the gather-based strategies: this rank's rows within the
/// gathered batch and every rank's count.
pub(crate) struct GatheredRows {
    pub counts: Vec<usize>,
    pub rank: usize,
}

impl GatheredRows {
    pub fn offset(&self) -> usize {
        self.counts[..self.rank].iter().sum()
    }
}

/// Checks that `extras` have one row per token.
pub(crate) fn check_extras(extras: &[Extra], tokens: usize) -> Result<()> {
    for (i, e) in extras.iter().enumerate() {
        if e.data.len() != tokens * e.width {
            return Err(MoeError::shape(format!("extra tensor {i}"), [tokens, e.width], e.data.len()));
        }
    }
    Ok(())
}

/// Starts `strategy.prepare(input)` on a scoped thread: spawning is the hook that starts the
/// dispatch, joining the handle is the receiver that completes it. The caller computes
/// meanwhile (shared experts, the other micro-batch).
pub fn prepare_async<'scope, 'env>(
    scope: &'scope std::thread::Scope<'scope, 'env>,
    strategy: &'env dyn PrepareFinalize,
    input: DispatchInput<'env>,
) -> std::thread::ScopedJoinHandle<'scope, Result<Prepared<'env>>> {
    scope.spawn(move || strategy.prepare(input))
}

/// Starts `strategy.finalize(...)` on a scoped thread; joining the handle completes it.
pub fn finalize_async<'scope, 'env>(
    scope: &'scope std::thread::Scope<'scope, 'env>,
    strategy: &'env dyn PrepareFinalize,
    prepared: &'env Prepared<'env>,
    expert_out: &'env [f32],
    reduce: &'env dyn WeightAndReduce,
    out: &'env mut [f32],
) -> std::thread::ScopedJoinHandle<'scope, Result<()>> {
    scope.spawn(move || strategy.finalize(prepared, expert_out, reduce, out))
}
