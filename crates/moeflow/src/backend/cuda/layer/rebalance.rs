//! Live rebalancing of an expert-parallel GPU layer: between forward calls the layer takes a
//! new [`ExpertPlacement`], moving its routed experts' device buffers between the ranks over
//! its NCCL communicator, with the CPU layer's contract (`crate::layer`'s `rebalance.rs`):
//!
//! 1. **agree:** each rank checks the placement (the layer's experts and ranks, at least one
//!    expert a rank, weights not shared with a dual-batch twin, device memory for the new
//!    experts beside the old) and all ranks compare a fingerprint of it; any refusal or
//!    difference is an error on every rank before any weight moves.
//! 2. **aside:** each rank allocates its experts under the new placement beside the old ones
//!    (bf16 `w13`/`w2`, the f32 biases, the fp8 codes and block scales when the layer has
//!    them), the placement's device tables and, low-latency, buffers for its new expert count;
//!    all ranks report whether they could.
//! 3. **move:** one NCCL group of `ncclSend`/`ncclRecv` on device buffers: each expert a rank
//!    newly holds comes, as stored, from one of its old holders (`dst mod holders`, the CPU
//!    rule); experts a rank keeps are device copies. Awaited against the communicator's
//!    deadline.
//! 4. **commit:** only when every rank has its experts does each swap in the new buffers, its
//!    placement (route table, first physical id, local count, device tables) and drop the
//!    buffers sized by the old local count (the expert-parallel scratch, the low-latency
//!    buffers and their captured graph). Otherwise every rank returns an error and keeps
//!    running the old placement (a communicator aborted by a timeout or a dead peer stays
//!    aborted).
//!
//! The experts are the same bits wherever they live and every (token, slot) goes to one
//! replica, so deterministic mode gives the same bits before and after; the default mode's
//! partial sums change order with the placement (within the bf16 contract).

use super::super::Gpu;
use super::fp8_weights::Fp8Experts;
use super::low_latency::LlBuffers;
use super::placement::PlacementTables;
use super::{dptr, err, CudaMoeLayer, DeviceWeights};
use crate::backend::host_route::RouteTable;
use crate::comm::{CommExt, Communicator};
use crate::error::{MoeError, Result};
use crate::layer::rebalance::{agree, transfers};
use crate::placement::ExpertPlacement;
use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use std::sync::Arc;

/// One tensor of the routed experts, `[local, ...]`: its old and new buffers' addresses and
/// the bytes of one expert.
#[derive(Clone, Copy)]
struct Part {
    old: u64,
    new: u64,
    bytes: usize,
}

/// A rank's experts under the new placement, built beside the old ones, with what else the
/// placement needs on the device.
struct Aside {
    w13: CudaSlice<u16>,
    w2: CudaSlice<u16>,
    b13: Option<CudaSlice<f32>>,
    b2: Option<CudaSlice<f32>>,
    fp8: Option<Fp8Experts>,
    parts: Vec<Part>,
    tables: PlacementTables,
    ll: Option<LlBuffers>,
}

/// The routed experts' tensors of `w` as (elements, bytes per element), in the order the
/// parts of [`Aside`] follow: w13, w2, the biases present, then the fp8 codes and scales.
fn tensor_sizes(w: &DeviceWeights) -> Vec<(usize, usize)> {
    let (two, four) = (std::mem::size_of::<u16>(), std::mem::size_of::<f32>());
    let mut out = vec![(w.w13.len(), two), (w.w2.len(), two)];
    out.extend(w.b13.as_ref().map(|b| (b.len(), four)));
    out.extend(w.b2.as_ref().map(|b| (b.len(), four)));
    if let Some(f) = &w.fp8 {
        out.extend([(f.w13.len(), 1), (f.s13.len(), four), (f.w2.len(), 1), (f.s2.len(), four)]);
    }
    out
}

/// A buffer for `new` experts beside `old` (`held` experts), with the [`Part`] that moves it.
fn beside<T: DeviceRepr + ValidAsZeroBits>(
    gpu: &Gpu,
    old: &CudaSlice<T>,
    held: usize,
    new: usize,
    parts: &mut Vec<Part>,
) -> Result<CudaSlice<T>> {
    let per = old.len() / held;
    let buf = gpu.stream.alloc_zeros::<T>((new * per).max(1)).map_err(|e| err("allocating the moved experts", e))?;
    parts.push(Part { old: dptr(old, gpu), new: dptr(&buf, gpu), bytes: per * std::mem::size_of::<T>() });
    Ok(buf)
}

impl CudaMoeLayer {
    /// The placement this layer's experts follow (`None` on one GPU, where every expert is
    /// local).
    pub fn placement(&self) -> Option<Arc<ExpertPlacement>> {
        self.ep.as_ref().map(|l| l.placement.clone())
    }

    /// Takes `placement` between forward calls, moving the routed experts' weights (bf16,
    /// biases, fp8 codes and scales) between the ranks of the layer's expert-parallel group
    /// over NCCL (collective: every rank calls it with the same placement). A placement for
    /// other experts or ranks, leaving a rank without experts, different on some rank, or
    /// whose experts do not fit a rank's free memory is refused before any weight moves; a
    /// failure on any rank during the move is an error on every rank, which keeps the old
    /// placement. Deterministic mode gives the same bits before and after (see the module).
    /// A layer whose weights were generated on the device moves them as they are (its
    /// replicas were not copies of their experts).
    pub fn rebalance(&mut self, placement: Arc<ExpertPlacement>) -> Result<()> {
        let link = self.ep.as_ref().ok_or_else(|| {
            MoeError::Config("rebalancing needs an expert-parallel layer; this one runs on one GPU".into())
        })?;
        let (comm, old) = (&link.comm, link.placement.clone());
        // 1. Agree.
        agree(comm, &placement, self.check_placement(&placement))?;
        // 2. Build aside.
        let aside = self.aside(&old, &placement);
        let ready = comm.all_gather_vec("rebalance.aside", &[u8::from(aside.is_ok())])?;
        let aside = aside?;
        if let Some(r) = ready.iter().position(|v| v[0] == 0) {
            return Err(MoeError::Config(format!(
                "rebalance: rank {r} could not allocate its new experts; nothing moved"
            )));
        }
        // 3. Move.
        let moved = self.move_experts(&old, &placement, &aside.parts);
        // 4. Commit only if every rank has its experts.
        let done = comm.all_gather_vec("rebalance.commit", &[u8::from(moved.is_ok())])?;
        moved?;
        if let Some(r) = done.iter().position(|v| v[0] == 0) {
            return Err(MoeError::Config(format!(
                "rebalance: rank {r} could not take its experts; the old placement stays"
            )));
        }
        self.install(placement, aside);
        Ok(())
    }

    /// This rank's own verdict on `placement`.
    fn check_placement(&self, placement: &ExpertPlacement) -> Result<()> {
        let link = self.ep.as_ref().expect("checked by the caller");
        let (e, n, rank) = (self.config.num_experts, link.comm.size(), link.comm.rank());
        if placement.num_experts() != e || placement.ranks() != n {
            return Err(MoeError::Config(format!(
                "rebalance: the placement is for {} experts on {} ranks, the layer has {e} experts on {n} ranks",
                placement.num_experts(),
                placement.ranks()
            )));
        }
        if let Some(r) = (0..n).find(|&r| placement.local_experts(r).is_empty()) {
            return Err(MoeError::Config(format!(
                "rebalance: the placement leaves rank {r} without experts; every GPU rank holds at least one"
            )));
        }
        if link.local == 0 {
            return Err(MoeError::Config(format!("rebalance: rank {rank} holds no experts to move")));
        }
        if Arc::strong_count(&self.w) > 1 {
            return Err(MoeError::Unsupported(
                "rebalancing a layer split for dual-batch overlap (its halves share one copy of the weights)".into(),
            ));
        }
        let new = placement.local_experts(rank).len();
        let per_expert: usize = tensor_sizes(&self.w).iter().map(|(len, size)| len / link.local * size).sum();
        super::super::finite::ensure_device_memory(
            &self.gpu,
            &format!("rebalance: {new} experts under the new placement, beside the {} held now", link.local),
            (new * per_expert) as u128,
        )?;
        if let Some(m) = link.capacity {
            let c = &self.config;
            super::super::finite::ensure_low_latency(&self.gpu, m, [c.hidden, c.inter, c.top_k, n, new])?;
        }
        Ok(())
    }

    /// This rank's experts under `new` allocated beside the old ones, with the placement's
    /// device tables and, low-latency, buffers for the new local count.
    fn aside(&self, old: &ExpertPlacement, new: &ExpertPlacement) -> Result<Aside> {
        let link = self.ep.as_ref().expect("checked by the caller");
        let rank = link.comm.rank();
        let (held, now) = (old.local_experts(rank).len(), new.local_experts(rank).len());
        let (g, w) = (&self.gpu, &self.w);
        let mut parts = Vec::new();
        let w13 = beside(g, &w.w13, held, now, &mut parts)?;
        let w2 = beside(g, &w.w2, held, now, &mut parts)?;
        let b13 = w.b13.as_ref().map(|b| beside(g, b, held, now, &mut parts)).transpose()?;
        let b2 = w.b2.as_ref().map(|b| beside(g, b, held, now, &mut parts)).transpose()?;
        let fp8 = match &w.fp8 {
            None => None,
            Some(f) => Some(Fp8Experts {
                w13: beside(g, &f.w13, held, now, &mut parts)?,
                s13: beside(g, &f.s13, held, now, &mut parts)?,
                w2: beside(g, &f.w2, held, now, &mut parts)?,
                s2: beside(g, &f.s2, held, now, &mut parts)?,
            }),
        };
        let tables = PlacementTables::upload(new, g)?;
        let ll = link.capacity.map(|m| self.ll_buffers_for(m, now)).transpose()?;
        Ok(Aside { w13, w2, b13, b2, fp8, parts, tables, ll })
    }

    /// Fills this rank's new buffers (`parts`): device copies of the experts it keeps, and one
    /// NCCL group sending every expert a peer newly holds from here and receiving those this
    /// rank newly holds; waits for it against the communicator's deadline.
    fn move_experts(&self, old: &ExpertPlacement, new: &ExpertPlacement, parts: &[Part]) -> Result<()> {
        use cudarc::nccl::sys as nc;
        let link = self.ep.as_ref().expect("checked by the caller");
        let rank = link.comm.rank();
        let s = &self.gpu.stream;
        let (held, mine) = (old.local_experts(rank), new.local_experts(rank));
        let slot_in =
            |list: &[usize], x: usize| list.iter().position(|&y| y == x).expect("the plan names held experts");
        for (j, &x) in mine.iter().enumerate() {
            let Some(i) = held.iter().position(|&y| y == x) else { continue };
            for p in parts {
                // SAFETY: slot i of the old buffer and slot j of the new one each hold
                // `p.bytes`; the copy is ordered on the layer's stream, which is idle
                // between forward calls.
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        p.new + (j * p.bytes) as u64,
                        p.old + (i * p.bytes) as u64,
                        p.bytes,
                        s.cu_stream(),
                    )
                }
                .map_err(|e| err("copying kept experts", e))?;
            }
        }
        // Every rank walks the same plan: sends to a peer and receives from it follow the
        // peer's list of new experts in order, tensor by tensor, so the calls match.
        let plan = transfers(old, new);
        let sends: Vec<(usize, usize)> = (0..plan.len())
            .flat_map(|dst| plan[dst].iter().filter(|(_, src)| *src == rank).map(move |&(x, _)| (dst, x)))
            .map(|(dst, x)| (dst, slot_in(held, x)))
            .collect();
        let recvs: Vec<(usize, usize)> = plan[rank].iter().map(|&(x, src)| (src, slot_in(mine, x))).collect();
        if !sends.is_empty() || !recvs.is_empty() {
            link.comm.enqueue("rebalance.weights", s, |comm, cs| {
                let u8t = nc::ncclDataType_t::ncclUint8;
                let calls = sends
                    .iter()
                    .map(|&(peer, slot)| (true, peer, slot))
                    .chain(recvs.iter().map(|&(peer, slot)| (false, peer, slot)));
                for (send, peer, slot) in calls {
                    for p in parts {
                        // SAFETY: slot `slot` of the old (send) or new (receive) buffer holds
                        // `p.bytes`; the peer posts the matching call for the same expert and
                        // tensor, in the same order (see above).
                        let r = unsafe {
                            if send {
                                nc::ncclSend(
                                    (p.old + (slot * p.bytes) as u64) as _,
                                    p.bytes,
                                    u8t,
                                    peer as i32,
                                    comm,
                                    cs,
                                )
                            } else {
                                nc::ncclRecv(
                                    (p.new + (slot * p.bytes) as u64) as _,
                                    p.bytes,
                                    u8t,
                                    peer as i32,
                                    comm,
                                    cs,
                                )
                            }
                        };
                        if r != nc::ncclResult_t::ncclSuccess {
                            return r;
                        }
                    }
                }
                nc::ncclResult_t::ncclSuccess
            })?;
        }
        link.comm.wait("rebalance.weights", s)
    }

    /// Swaps in the new experts and placement (every rank has its experts), and drops the
    /// buffers sized by the old local count.
    fn install(&mut self, placement: Arc<ExpertPlacement>, aside: Aside) {
        let w = Arc::get_mut(&mut self.w).expect("checked: the weights are not shared");
        (w.w13, w.w2, w.b13, w.b2, w.fp8) = (aside.w13, aside.w2, aside.b13, aside.b2, aside.fp8);
        let link = self.ep.as_mut().expect("checked by the caller");
        let rank = link.comm.rank();
        link.local = placement.local_experts(rank).len();
        link.phys_first = (0..rank).map(|r| placement.local_experts(r).len()).sum();
        link.route_table = RouteTable::new(&placement);
        link.tables = Some(aside.tables);
        link.placement = placement;
        let mut guard = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = guard.as_mut() {
            // Regrown at the next call for the new local count.
            b.ep = None;
            // A fresh graph is captured at the next call, over the new buffers and weights,
            // with the cuBLAS workspaces the handles already use.
            if let Some(mut ll) = aside.ll {
                if let Some(old) = b.ll.as_mut() {
                    ll.adopt_workspaces(old);
                }
                b.ll = Some(ll);
            }
        }
    }
}
