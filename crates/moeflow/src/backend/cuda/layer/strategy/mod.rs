//! Quantize+Dispatch and Combine on the device: the GPU twin of [`crate::dispatch`]. A
//! [`DevicePrepareFinalize`] moves this rank's routed tokens to the ranks holding their experts
//! and brings the experts' outputs home; the layer composes one with the experts
//! ([`super::experts`]) and the router: `route → prepare → experts → finalize`, with the
//! shared experts on a side stream beside them. Each half is split in two, as DeepEP's hooks
//! and vLLM's asynchronous prepare/finalize are: `begin` enqueues the transfer on the layer's
//! stream and returns at once, `finish` enqueues what needs the transferred data, so a caller
//! can put other work between them (the dual-batch layer runs one micro-batch's GEMMs under the
//! other's transfers). One file per strategy:
//!
//! | strategy | prepare | finalize |
//! | --- | --- | --- |
//! | [`Local`] | count and group the rows by expert (one GPU) | weighted sum in slot order |
//! | [`All2AllV`] | counts all-gathered, each token once to each rank holding its experts (over NVLink planned on the device: `all2allv_nvlink`) | partial sums back (per slot in deterministic mode) |
//! | [`AllGather`] | every rank's rows, ids and weights, padded to the largest batch | reduce-scatter |
//! | [`AllGatherLogits`] | rows and router logits, routing after the gather | reduce-scatter |
//! | [`Multicast`] | one broadcast per rank | all-reduce, own rows kept |
//! | [`LowLatency`] | fixed-capacity messages, counts on the device, capturable | fixed-capacity return |
//! | [`TpSlice`](tp_slice::TpSlice) | around any of the above: this TP rank's contiguous share of the batch only ([`DevicePrepareFinalize::token_window`]) | the inner's, then the shares all-gathered over the TP group into the whole batch |

mod all2allv;
mod all2allv_nvlink;
mod allgather;
mod allgather_logits;
mod gathering;
mod local;
mod lowlatency;
mod multicast;
mod tp_slice;

pub(super) use all2allv::All2AllV;
pub(super) use all2allv_nvlink::rows_home_from_gemm;
pub(super) use allgather::AllGather;
pub(super) use allgather_logits::AllGatherLogits;
pub(super) use local::Local;
pub(super) use lowlatency::LowLatency;
pub(super) use multicast::Multicast;

use super::experts::ExpertRows;
use super::{Buffers, CudaMoeLayer};
use crate::error::Result;
use crate::parallel::StrategyKind;
use std::any::Any;
use std::sync::Arc;

/// Called at a stage boundary (0..=9, see [`CudaMoeLayer::forward_timed_stages`]): 2 when the
/// rows are staged to leave, 3 when they are grouped for the experts, 7 when the experts'
/// outputs are home.
pub(super) type Mark<'a> = &'a dyn Fn(usize) -> Result<()>;

/// A strategy's bookkeeping between its halves (its own type, downcast by the strategy).
pub(super) type State = Box<dyn Any + Send>;

/// What prepare hands to the experts, and what finalize needs to bring their outputs home.
pub(super) struct Dispatched {
    /// This rank's rows for its experts, grouped by local expert.
    pub(super) rows: ExpertRows,
    /// Bytes this rank sent to other ranks in the dispatch.
    pub(super) sent: Sent,
    /// The strategy's bookkeeping for finalize.
    pub(super) state: State,
}

/// Bytes a rank sent to the other ranks in a dispatch.
#[derive(Clone, Copy, Debug)]
pub(super) enum Sent {
    /// Known on the host when the dispatch was enqueued.
    Bytes(usize),
    /// `row_bytes` for each row the device array `rows` (an int per rank, this rank's own
    /// left out) says went to each rank: read once the run has completed.
    Counted { rows: u64, row_bytes: usize },
}

/// Moves routed tokens to the experts (prepare) and their outputs back into `b.out [t, H]`
/// (finalize), on the layer's stream, for the `t` tokens routed into `b` (`ids`, `weights`
/// `[t, k]`, rows in `x_bf`). Every rank of an expert-parallel group calls every half in the
/// same order, also with no tokens.
///
/// The layer routes the rows [`DevicePrepareFinalize::token_window`] gives of the batch of
/// `b.batch` tokens its caller passed: all of them but for [`tp_slice::TpSlice`]'s share, whose
/// finalize leaves the whole batch's `[b.batch, H]` in `b.out`.
pub(super) trait DevicePrepareFinalize: Send + Sync {
    /// Name on the command line (TP slicing takes its inner strategy's: it is a separate option).
    fn name(&self) -> &'static str;
    /// Tokens `[a, b)` of a batch of `t` that this rank routes and dispatches: all of them, or
    /// TP slicing's share. The layer copies in only those rows.
    fn token_window(&self, t: usize) -> (usize, usize) {
        (0, t)
    }
    /// The most tokens of a batch of `t` that any rank sharing it routes: every rank checks
    /// this against its capacity, so all of them refuse a batch one of them cannot take.
    fn largest_window(&self, t: usize) -> usize {
        t
    }
    /// Whether prepare needs every rank's batch size ([`CudaMoeLayer::batches`]): the layer
    /// then exchanges them before the routing, so the host learns them while it runs.
    fn needs_batches(&self, _layer: &CudaMoeLayer) -> bool {
        false
    }
    /// Whether the layer may capture its runs with this strategy into a CUDA graph.
    fn captures(&self) -> bool {
        true
    }
    /// Ranks that share each batch (the TP group's size; 1 unless sliced).
    fn tp_size(&self) -> usize {
        1
    }
    /// `base` wrapped as this strategy wraps its own inner one (an auto table's pick runs TP
    /// sliced when the layer is); `base` itself for the strategies that wrap none.
    fn around(&self, base: Arc<dyn DevicePrepareFinalize>) -> Arc<dyn DevicePrepareFinalize> {
        base
    }
    /// Waits for the run enqueued on the layer's stream, against the deadline of every
    /// communicator the strategy used (see [`CudaMoeLayer::wait_run`]).
    fn wait(&self, layer: &CudaMoeLayer) -> Result<()> {
        layer.wait_run()
    }
    /// Enqueues, beside the routing (enqueued but not yet run), what the dispatch sends that
    /// does not depend on it; nothing by default. Collective where it opens a window.
    fn send_beside_routing(&self, _layer: &CudaMoeLayer, _b: &mut Buffers, _t: usize) -> Result<()> {
        Ok(())
    }
    /// Plans the dispatch, stages the rows and enqueues their transfer (marks 2).
    fn prepare_begin(&self, layer: &CudaMoeLayer, b: &mut Buffers, t: usize, mark: Mark) -> Result<State>;
    /// Groups the arrived rows by local expert for the experts (marks 3).
    fn prepare_finish(
        &self,
        layer: &CudaMoeLayer,
        b: &mut Buffers,
        t: usize,
        pending: State,
        mark: Mark,
    ) -> Result<Dispatched>;
    /// Enqueues the transfer of the experts' outputs (`d.rows.y`) toward their tokens' ranks.
    fn finalize_begin(&self, layer: &CudaMoeLayer, b: &mut Buffers, t: usize, d: &mut Dispatched) -> Result<()>;
    /// Marks 7 and sums the arrived outputs into `b.out [t, H]`, each token's in a fixed order
    /// (with the shared experts' output where the strategy adds it at home).
    fn finalize_finish(&self, layer: &CudaMoeLayer, b: &mut Buffers, t: usize, d: Dispatched, mark: Mark)
        -> Result<()>;
    /// Where the shared experts start relative to [`DevicePrepareFinalize::prepare_begin`]'s
    /// transfer.
    fn shared_start(&self, _layer: &CudaMoeLayer) -> SharedStart {
        SharedStart::AfterRouting
    }
    /// Whether finalize adds the shared experts' output (one GPU's combine, deterministic
    /// mode's combine at home, and the sum at home of an ungated shared expert's:
    /// [`CudaMoeLayer::shared_summed_at_home`]); otherwise the layer adds it after finalize.
    fn adds_shared(&self, layer: &CudaMoeLayer) -> bool {
        layer.opts.deterministic || layer.shared_summed_at_home()
    }
}

/// Where the shared experts, on their side stream, start relative to the send that
/// [`DevicePrepareFinalize::prepare_begin`] enqueues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SharedStart {
    /// Forked and launched before the send: they start at the routing's end.
    AfterRouting,
    /// Forked before the send, so that on the device they wait only for the routing, but
    /// launched after the send's launches: the host reaches the transfer first, where the
    /// shared experts' cuBLAS launches would have held it past the routing's end.
    LaunchedAfterSend,
    /// Forked and launched after the send: their GEMMs would hold the SMs a short sending
    /// kernel needs.
    AfterSend,
}

/// The strategy's own state out of `state` (an error naming `strategy` if another's).
pub(super) fn state_of<T: 'static>(state: State, strategy: &str) -> Result<Box<T>> {
    state.downcast::<T>().map_err(|_| {
        crate::error::MoeError::Unsupported(format!("{strategy} was handed another strategy's dispatch state"))
    })
}

impl CudaMoeLayer {
    /// This expert-parallel layer dispatching by all-gather and combining by reduce-scatter
    /// (`strategy/allgather.rs`) instead of all-to-all-v. Not with the low-latency form.
    pub fn all_gather(self) -> Result<Self> {
        self.gathering(Arc::new(AllGather))
    }

    /// This expert-parallel layer all-gathering router logits with the rows, every rank
    /// routing every token, and combining by reduce-scatter (`strategy/allgather_logits.rs`).
    pub fn all_gather_logits(self) -> Result<Self> {
        self.gathering(Arc::new(AllGatherLogits))
    }

    /// This expert-parallel layer dispatching by one broadcast per rank and combining by
    /// all-reduce (`strategy/multicast.rs`) instead of all-to-all-v. Not with the low-latency form.
    pub fn multicast(self) -> Result<Self> {
        self.gathering(Arc::new(Multicast))
    }

    fn gathering(mut self, how: Arc<dyn DevicePrepareFinalize>) -> Result<Self> {
        let name = how.name();
        self.not_yet_tp_sliced(name)?;
        if self.opts.deterministic {
            return Err(crate::error::MoeError::Unsupported(format!(
                "{name} sums partial outputs across ranks; deterministic mode dispatches by all-to-all-v"
            )));
        }
        if self.ep.is_none() {
            return Err(crate::error::MoeError::Config(format!(
                "{name} dispatch needs an expert-parallel layer (new_ep)"
            )));
        }
        if ![All2AllV.name(), name].contains(&self.strategy.name()) {
            return Err(crate::error::MoeError::Config(
                "a layer dispatches one way: all-to-all-v, all-gather, multicast or lowlatency".into(),
            ));
        }
        self.strategy = how;
        Ok(self)
    }

    /// The prepare/finalize strategy this layer composes (its name on the command line;
    /// `auto` when a table picks it per batch).
    pub fn strategy_name(&self) -> &'static str {
        match self.auto {
            Some(_) => "auto",
            None => self.strategy.name(),
        }
    }

    /// This expert-parallel layer picking its strategy per batch from `table` (see
    /// [`crate::auto_strategy`]): the largest batch of any rank, exchanged on the device
    /// before each run, selects the row. Not in deterministic mode, whose all-to-all-v is
    /// what makes the bits independent of the layout.
    pub fn auto(mut self, table: crate::auto_strategy::AutoStrategy) -> Result<Self> {
        table.validate()?;
        self.not_yet_tp_sliced("strategy 'auto'")?;
        if self.opts.deterministic {
            return Err(crate::error::MoeError::Unsupported(
                "strategy 'auto' picks gathering forms that sum partial outputs across ranks; deterministic mode dispatches by all-to-all-v".into(),
            ));
        }
        if self.ep.is_none() || self.strategy.name() != All2AllV.name() {
            return Err(crate::error::MoeError::Config(
                "strategy 'auto' needs an expert-parallel layer that dispatches by all-to-all-v before it".into(),
            ));
        }
        self.auto = Some(Arc::new(table));
        Ok(self)
    }

    /// An error naming `what` when the layer is TP-sliced already: TP slicing wraps the
    /// strategy the layer has, so the strategy is chosen first.
    pub(super) fn not_yet_tp_sliced(&self, what: &str) -> Result<()> {
        match self.strategy.tp_size() {
            1 => Ok(()),
            _ => Err(crate::error::MoeError::Config(format!(
                "{what} after tp_slice: TP slicing wraps the layer's strategy, so choose the strategy first"
            ))),
        }
    }

    /// The strategy of a run of `t` tokens here: the layer's own, or the auto table's row
    /// for the largest batch of any rank (one small exchange on the device), wrapped as the
    /// layer's own is.
    pub(super) fn strategy_for(&self, b: &mut Buffers, t: usize) -> Result<Arc<dyn DevicePrepareFinalize>> {
        let (Some(table), Some(link)) = (&self.auto, &self.ep) else { return Ok(self.strategy.clone()) };
        let largest = self.batches(b, link, t)?.into_iter().max().unwrap_or(0);
        let pick: Arc<dyn DevicePrepareFinalize> = match table.pick(largest) {
            StrategyKind::AllGather => Arc::new(AllGather),
            StrategyKind::AllGatherLogits => Arc::new(AllGatherLogits),
            StrategyKind::Multicast => Arc::new(Multicast),
            _ => Arc::new(All2AllV),
        };
        Ok(self.strategy.around(pick))
    }
}
