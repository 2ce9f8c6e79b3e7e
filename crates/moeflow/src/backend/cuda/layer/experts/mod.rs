//! Stage 3 on the device, the experts: the GPU twin of [`crate::experts`]. A
//! [`DeviceExperts`] takes this rank's rows grouped by local expert ([`ExpertRows`]) and writes
//! each row's expert output: up projection, activation, down projection, bf16 in and out with
//! f32 accumulation. Any implementation composes with any prepare/finalize strategy
//! ([`super::strategy`]); the layer's typed policy ([`CudaOptions::expert_gemm`], the GPU and
//! the batch's shape) picks one per batch ([`CudaMoeLayer::device_counted`],
//! [`CudaMoeLayer::host_counted`]). One file per implementation:
//!
//! | implementation | expert sizes read | layouts |
//! | --- | --- | --- |
//! | [`Hopper`] | on the device | grouped or padded; gathers its rows itself; activation in its epilogue |
//! | [`HopperFp8`] | on the device | as [`Hopper`], fp8 rows and weights (W8A8) on the fp8 tensor cores |
//! | [`Masked`] | on the device | grouped or padded; bf16 or fp8 weights, W8A8 |
//! | [`CublasPadded`] | on the host | padded: one strided-batched GEMM |
//! | [`CublasGrouped`] | on the host | grouped: one grouped call |
//! | [`CublasPerExpert`] | on the host | grouped: one GEMM per expert over the side streams |
//!
//! [`CudaOptions::expert_gemm`]: crate::backend::CudaOptions::expert_gemm

mod cublas_grouped;
mod cublas_padded;
mod cublas_per_expert;
mod hopper;
mod hopper_fp8;
mod masked;

pub(super) use cublas_grouped::CublasGrouped;
pub(super) use cublas_padded::CublasPadded;
pub(super) use cublas_per_expert::CublasPerExpert;
pub(super) use hopper::Hopper;
pub(super) use hopper_fp8::HopperFp8;
pub(super) use masked::Masked;

use super::hopper_gemm::Gather;
use super::strategy::Mark;
use super::{dptr, Buffers, CudaMoeLayer};
use crate::backend::cuda_options::CublasLayout;
use crate::error::Result;

/// Rows for this rank's experts: `experts` local experts whose rows are grouped (expert `x`
/// from row `offsets[x]`, `cap` = 0) or padded (expert `x` from row `x · cap`), `rows` rows in
/// all, with their expert sizes on the device (`counts`, `offsets`) and, where the host read
/// them, as `groups` (expert, first row, rows) of the experts with rows.
pub(super) struct ExpertRows {
    /// The implementation the policy picked for these rows.
    pub(super) imp: &'static dyn DeviceExperts,
    /// Input rows `[rows, H]` (bf16; not written when `gather` is set).
    pub(super) a: u64,
    /// Scratch for the up projection `[rows, 2I]` and the activation `[rows, I]`.
    pub(super) h13: u64,
    pub(super) act: u64,
    /// The output rows `[rows, H]`.
    pub(super) y: u64,
    /// The expert of each row (grouped layout; 0 for the padded one).
    pub(super) expert_of_row: u64,
    pub(super) experts: usize,
    pub(super) cap: usize,
    pub(super) rows: usize,
    /// Rows the experts hold at most, which picks the GEMMs' tiles: `rows`, except in the
    /// low-latency layout, whose capacity bounds them more tightly than its extent does.
    pub(super) busy: usize,
    pub(super) groups: Vec<(usize, usize, usize)>,
    /// Device ints: rows per expert, and first row per expert (0 when padded without them).
    pub(super) counts: u64,
    pub(super) offsets: u64,
    /// Where the Hopper GEMM reads its input rows instead of `a`.
    pub(super) gather: Option<Gather>,
    /// Where each output row goes instead of `y`: a device array of an address a row (see
    /// [`Epilogue::Scatter`](super::hopper_gemm::Epilogue::Scatter)), for implementations
    /// that [`DeviceExperts::scatters_rows`].
    pub(super) y_rows: Option<u64>,
}

/// The routed experts over rows grouped by local expert.
pub(super) trait DeviceExperts: Send + Sync {
    /// Name in `describe()` and the bench header.
    fn name(&self) -> &'static str;
    /// Whether it reads the input rows from where [`Gather`] says (they are not copied into
    /// `a` first) for a layout padded to `cap` rows (0: grouped).
    fn gathers_rows(&self, _layer: &CudaMoeLayer, _cap: usize) -> bool {
        false
    }
    /// Whether its gathered rows may be fp8 codes with their scales ([`Gather::fp8_scales`]).
    fn gathers_fp8_rows(&self) -> bool {
        false
    }
    /// Whether it reads the low-latency layer's input rows from the received messages
    /// themselves (a [`Gather`] whose rows sit inside the message records), so that they are
    /// not copied into the padded layout first.
    fn gathers_received_rows(&self, _layer: &CudaMoeLayer) -> bool {
        false
    }
    /// Whether it stores each output row at the address [`ExpertRows::y_rows`] names.
    fn scatters_rows(&self) -> bool {
        false
    }
    /// `y` = down(act(up(a))) for every row of `rows`, on the layer's stream; marks 4 after
    /// the up projection, 5 after the activation, 6 after the down projection.
    fn run(&self, layer: &CudaMoeLayer, b: &mut Buffers, rows: &ExpertRows, mark: Mark) -> Result<()>;
}

/// Where the experts run, as the policy sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Form {
    /// One GPU, every expert here.
    OneGpu,
    /// An expert-parallel rank of a batch-sized layout (all-to-all-v, the gathering forms).
    ExpertParallel,
    /// A low-latency rank: the padded layout of its capacity, nothing read on the host.
    LowLatency,
}

impl CudaMoeLayer {
    /// The implementation that reads the expert sizes on the device for `slots` rows over
    /// `experts` experts, where one fits: W8A8 experts the fp8 Hopper GEMM where
    /// [`CudaMoeLayer::hopper_fp8_runs`] says so, at every batch and in the low-latency layer's
    /// padded layout (it streams the fp8 weights faster than the masked GEMM; docs/tuning.md);
    /// the low-latency layer otherwise the Hopper or the masked GEMM; other fp8 experts on one
    /// GPU the masked GEMM while the weights dominate (up to 32 rows per expert on average,
    /// where reading half the bytes wins); others the Hopper GEMM where
    /// [`CudaMoeLayer::hopper_for`] takes the batch. `None`: cuBLAS, whose GEMM shapes need the
    /// sizes on the host ([`CudaMoeLayer::host_counted`]).
    pub(super) fn device_counted(
        &self,
        slots: usize,
        experts: usize,
        form: Form,
    ) -> Option<&'static dyn DeviceExperts> {
        match form {
            Form::LowLatency if !self.masked => None,
            _ if self.hopper_fp8_runs() => Some(&HopperFp8),
            Form::LowLatency if self.ll_hopper().is_some() => Some(&Hopper),
            Form::LowLatency => Some(&Masked),
            Form::OneGpu if self.w.fp8.is_some() && self.masked && slots <= 32 * experts => Some(&Masked),
            _ => self.hopper_for(slots, experts).map(|_| &Hopper as &'static dyn DeviceExperts),
        }
    }

    /// Whether W8A8 experts multiply on the fp8 tensor cores: fp8 experts and activations, a
    /// Hopper GPU, [`crate::backend::CudaOptions::fp8_gemm`], and shapes the kernel takes
    /// (hidden size a multiple of 16, intermediate of 64).
    pub(super) fn hopper_fp8_runs(&self) -> bool {
        let (h, i) = (self.config.hidden, self.config.inter);
        self.w8a8 && self.opts.fp8_gemm && self.k.hopper_fp8.is_some() && h % 16 == 0 && i % 64 == 0
    }

    /// The experts' implementation for rows grouped on the device without a host count (a
    /// dispatch planned on the device): the fp8 Hopper GEMM for W8A8 experts where
    /// [`CudaMoeLayer::hopper_fp8_runs`] says so, else the Hopper GEMM with bf16 experts where
    /// it runs.
    pub(super) fn device_planned_experts(&self) -> Option<&'static dyn DeviceExperts> {
        if self.hopper_fp8_runs() {
            return Some(&HopperFp8);
        }
        self.ll_hopper().map(|_| &Hopper as &'static dyn DeviceExperts)
    }

    /// cuBLAS for `rows` rows over experts of `counts` rows each (read on the host), as
    /// [`ExpertGemm::cublas_layout`] lays it out; the padded layout's cap with it (0: grouped).
    pub(super) fn host_counted(&self, rows: usize, counts: &[usize]) -> (&'static dyn DeviceExperts, usize) {
        match self.opts.expert_gemm.cublas_layout(rows, counts) {
            CublasLayout::Padded { cap } => (&CublasPadded, cap),
            CublasLayout::Grouped => (&CublasGrouped, 0),
            CublasLayout::PerExpert => (&CublasPerExpert, 0),
        }
    }

    /// W8A8 through cuBLAS or the Hopper GEMM: `n` rows of `kdim` at `x` rounded to their fp8
    /// values in place (the masked GEMM quantizes its rows itself).
    pub(super) fn round_for_w8a8(&self, x: u64, n: usize, kdim: usize) -> Result<()> {
        if self.w8a8 {
            self.round_rows_fp8(x, n, kdim)?;
        }
        Ok(())
    }

    /// The device address of the up projection's bias, or 0.
    pub(super) fn b13_ptr(&self) -> u64 {
        self.w.b13.as_ref().map_or(0u64, |x| dptr(x, &self.gpu))
    }
}

/// The groups (expert, first row, rows) of the experts with rows among `counts`, grouped.
pub(super) fn groups_of(counts: &[usize]) -> Vec<(usize, usize, usize)> {
    let mut off = 0;
    let mut groups = Vec::new();
    for (x, &c) in counts.iter().enumerate() {
        if c > 0 {
            groups.push((x, off, c));
        }
        off += c;
    }
    groups
}

/// Up projection, activation, down projection over `r` with `gemm(weights, n, kdim, a, c)`
/// computing `C = A · W[x]ᵀ` per expert for one projection: the cuBLAS implementations'
/// common shape (the activation is a kernel of its own between them).
pub(super) fn unfused_mlp(
    layer: &CudaMoeLayer,
    r: &ExpertRows,
    mark: Mark,
    mut gemm: impl FnMut(&cudarc::driver::CudaSlice<u16>, usize, usize, u64, u64) -> Result<()>,
) -> Result<()> {
    let (h, i) = (layer.config.hidden, layer.config.inter);
    layer.round_for_w8a8(r.a, r.rows, h)?;
    gemm(&layer.w.w13, 2 * i, h, r.a, r.h13)?;
    mark(4)?;
    let ptrs = [r.h13, layer.b13_ptr(), r.expert_of_row, 0, r.act];
    layer.act(&layer.gpu.stream, ptrs, r.cap as i32, r.rows, i)?;
    layer.round_for_w8a8(r.act, r.rows, i)?;
    mark(5)?;
    gemm(&layer.w.w2, h, i, r.act, r.y)?;
    mark(6)
}

#[cfg(test)]
mod tests;
