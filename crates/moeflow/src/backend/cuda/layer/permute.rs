//! Stage 2, the permute: expert counts into offsets, the slot/row maps, and the token rows
//! copied into expert order (or left for the Hopper GEMM to gather).

use super::{dptr, err, rows, Buffers, CudaMoeLayer};
use crate::error::Result;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

/// Which slots [`CudaMoeLayer::group_rows`] groups: `slots` expert ids at `ids` over
/// `experts` experts (padded to `cap` rows each when `cap > 0`), leaving out expert `skip`.
pub(super) struct Grouping {
    pub(super) ids: u64,
    pub(super) slots: usize,
    pub(super) experts: usize,
    pub(super) cap: usize,
    pub(super) skip: i32,
    /// Copy the rows into place (false: the Hopper GEMM gathers them itself).
    pub(super) copy_rows: bool,
}

impl CudaMoeLayer {
    /// Rows of `b.x_bf` into `b.a` grouped by expert (expert `x` from row `offsets[x]`, or
    /// `x · cap` when `cap > 0`), with the slot/row maps; without `copy_rows` only the maps
    /// (the Hopper GEMM then gathers the rows itself).
    pub(super) fn permute(&self, b: &Buffers, t: usize, cap: usize, copy_rows: bool) -> Result<()> {
        let (e, k) = (self.config.num_experts, self.config.top_k);
        let g = &self.gpu;
        let pi = |x: &CudaSlice<i32>| dptr(x, g);
        let maps = [pi(&b.row_of_slot), pi(&b.slot_of_row), pi(&b.expert_of_row)];
        let plan = Grouping { ids: pi(&b.ids), slots: t * k, experts: e, cap, skip: -1, copy_rows };
        self.group_rows(&plan, pi(&b.counts), pi(&b.offsets), maps, dptr(&b.x_bf, g), k, dptr(&b.a, g))
    }

    /// Offsets from the device counts, the slot/row maps, and row `s / k` of `x` copied to row
    /// `row_of_slot[s]` of `a` for every slot (slots of expert `skip` are left out).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn group_rows(
        &self,
        p: &Grouping,
        counts: u64,
        offsets: u64,
        maps: [u64; 3],
        x: u64,
        k: usize,
        a: u64,
    ) -> Result<()> {
        let s = &self.gpu.stream;
        let (slots, ei, capi, skip) = (p.slots as i32, p.experts as i32, p.cap as i32, p.skip);
        let [rs, sr, er] = maps;
        let warps = LaunchConfig { grid_dim: (p.experts as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        let (hi, ki) = (self.config.hidden as i32, k as i32);
        // SAFETY: scatter_slots(int*, int, int, int*, int, int, int*, int*, int*, int*) and
        // gather_rows(bf16*, int, int*, int, int, bf16*) over buffers the caller sized for `slots`
        // slots, `experts` counts, `experts + 1` offsets and the rows the counts give (e · cap <= 2
        // slots when padded).
        unsafe {
            s.launch_builder(&self.k.scatter)
                .arg(&p.ids)
                .arg(&slots)
                .arg(&ei)
                .arg(&counts)
                .arg(&capi)
                .arg(&skip)
                .arg(&offsets)
                .arg(&rs)
                .arg(&sr)
                .arg(&er)
                .launch(warps)
                .map_err(|e| err("scatter", e))?;
            if p.copy_rows {
                s.launch_builder(&self.k.gather)
                    .arg(&x)
                    .arg(&hi)
                    .arg(&rs)
                    .arg(&ki)
                    .arg(&slots)
                    .arg(&a)
                    .launch(rows(p.slots, 128))
                    .map_err(|e| err("gather", e))?;
            }
        }
        Ok(())
    }
}
