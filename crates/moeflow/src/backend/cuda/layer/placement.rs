//! An expert placement on the device: the tables the kernels read to find which rank and local
//! slot serve each (token, slot) — `placed_replica` in placement.cu, the same rule as
//! [`ExpertPlacement::replica_of`] on the host — and which experts' replicas share each rank's
//! batch ([`ExpertPlacement::shared_replicas`], written per call).

use super::super::Gpu;
use super::{dptr, err};
use crate::error::Result;
use crate::placement::ExpertPlacement;
use cudarc::driver::CudaSlice;

/// Per logical expert its first replica and replica count; per physical id (replicas of an
/// expert consecutive) its rank and local slot.
pub(super) struct PlacementTables {
    rep_first: CudaSlice<i32>,
    rep_count: CudaSlice<i32>,
    rep_rank: CudaSlice<i32>,
    rep_slot: CudaSlice<i32>,
    /// Whether some expert has more than one replica.
    replicated: bool,
    /// `[ranks, E]`: whether expert e's replicas share rank r's batch (1) or not (0), written
    /// on the layer's stream for each call that needs it.
    pub(super) shared: CudaSlice<i32>,
}

impl PlacementTables {
    /// The tables of `placement`, uploaded on `gpu`'s stream.
    pub(super) fn upload(placement: &ExpertPlacement, gpu: &Gpu) -> Result<Self> {
        let (mut first, mut count, mut rank, mut slot) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for e in 0..placement.num_experts() {
            let reps = placement.replicas_of(e);
            first.push(rank.len() as i32);
            count.push(reps.len() as i32);
            for &p in reps {
                let (r, s) = placement.physical_slot(p);
                rank.push(r as i32);
                slot.push(s as i32);
            }
        }
        let up = |v: &[i32]| gpu.stream.clone_htod(v).map_err(|e| err("uploading the placement", e));
        let shared = placement.ranks() * placement.num_experts();
        Ok(PlacementTables {
            rep_first: up(&first)?,
            rep_count: up(&count)?,
            rep_rank: up(&rank)?,
            rep_slot: up(&slot)?,
            replicated: placement.num_physical() > placement.num_experts(),
            shared: gpu.stream.alloc_zeros(shared.max(1)).map_err(|e| err("allocating the placement", e))?,
        })
    }

    /// Whether the kernels need per-batch sharing flags: some expert has replicas and they
    /// share a batch only from `min_rows` rows (otherwise a null pointer says "every expert
    /// shares").
    pub(super) fn needs_shares(&self, min_rows: usize) -> bool {
        self.replicated && min_rows > 0
    }

    /// The four tables' device addresses: first, count, rank, slot.
    pub(super) fn ptrs(&self, gpu: &Gpu) -> [u64; 4] {
        [dptr(&self.rep_first, gpu), dptr(&self.rep_count, gpu), dptr(&self.rep_rank, gpu), dptr(&self.rep_slot, gpu)]
    }
}

impl super::CudaMoeLayer {
    /// Which replicated experts share this rank's batch (`ids [*tokens, k]` on the device, the
    /// count read there too), counted on the device into the table's first E flags: their
    /// address, or 0 (null: every expert shares) when the placement has no replicas or the
    /// layer always shares.
    pub(super) fn replica_shares(&self, tables: &PlacementTables, ids: u64, tokens: u64, ranks: usize) -> Result<u64> {
        use cudarc::driver::{LaunchConfig, PushKernelArg};
        let min_rows = self.opts.replica_min_rows;
        if !tables.needs_shares(min_rows) {
            return Ok(0);
        }
        let g = &self.gpu;
        let (flags, count) = (dptr(&tables.shared, g), dptr(&tables.rep_count, g));
        let (ki, ei, least) =
            (self.config.top_k as i32, self.config.num_experts as i32, min_rows.div_ceil(ranks) as i32);
        // SAFETY: replica_shares(int*, int*, int, int, int*, int, int*) over the batch's
        // `*tokens` rows of k ids into the table's first E flags; 4096 ints of shared memory for
        // the counts.
        unsafe {
            let mut p = g.stream.launch_builder(&self.k.replica_shares);
            p.arg(&ids).arg(&tokens).arg(&ki).arg(&ei).arg(&count).arg(&least).arg(&flags);
            p.launch(LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 4 * 4096 })
        }
        .map_err(|e| err("replica_shares", e))?;
        Ok(flags)
    }
}
