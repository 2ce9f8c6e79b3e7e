//! What every expert-parallel strategy of the layer shares: the link to the group (its
//! communicator and placement), the buffers rows travel in, the count exchange, the row
//! exchange over NCCL, and the grouping of received slots by local expert with their partial
//! sums (see [`super::strategy`] for the strategies themselves).

use super::super::NcclComm;
use super::experts::{groups_of, DeviceExperts, ExpertRows, Form};
use super::hopper_gemm::Gather;
use super::permute::Grouping;
use super::placement::PlacementTables;
use super::{dptr, err, grid, rows, Buffers, CudaMoeLayer};
use crate::backend::host_route::RouteTable;
use crate::config::MoeConfig;
use crate::error::{MoeError, Result};
use crate::placement::ExpertPlacement;
use cudarc::driver::{CudaSlice, CudaStream, PushKernelArg};
use std::sync::Arc;

/// Expert-parallel buffers. At home: which token goes to which rank, with its ids, and where
/// each home slot is served. Where the experts are: the received slots regrouped by local
/// expert for the GEMMs (`a`, `h13`, `act`, `y`). The rows themselves travel through
/// [`EpStaging`] where a dispatch stages them in this rank's memory. Capacities grow to the
/// largest call seen.
pub(super) struct EpBuffers {
    /// Capacities: rows sent, rows received, expert rows (padded), home tokens.
    pub(super) cap: [usize; 4],
    pub(super) send_idx: CudaSlice<i32>,
    pub(super) send_ids: CudaSlice<i32>,
    pub(super) home_rows: CudaSlice<i32>,
    pub(super) local_ids: CudaSlice<i32>,
    pub(super) counts: CudaSlice<i32>,
    /// The counting sort's counts per chunk of the received slots.
    pub(super) chunk_counts: CudaSlice<i32>,
    pub(super) offsets: CudaSlice<i32>,
    pub(super) row_of_slot: CudaSlice<i32>,
    pub(super) slot_of_row: CudaSlice<i32>,
    pub(super) expert_of_row: CudaSlice<i32>,
    pub(super) a: CudaSlice<u16>,
    pub(super) h13: CudaSlice<u16>,
    pub(super) act: CudaSlice<u16>,
    pub(super) y: CudaSlice<u16>,
    /// Deterministic mode: where each home slot's returned row is.
    pub(super) slot_row: CudaSlice<i32>,
    /// Deterministic mode over NVLink planned on the device: where the down projection stores
    /// each of its rows (an address in its home's window, see `nvl_slot_addresses`).
    pub(super) y_rows: CudaSlice<u64>,
    /// A dispatch planned on the device: where each rank's rows start in a receiver's window
    /// (`ranks + 1` ints), the tokens this rank sends each rank (`ranks`), and its batch (1);
    /// where each home slot is served (rank and local slot) and the ranks each token goes to.
    pub(super) plan: CudaSlice<i32>,
    pub(super) dest: CudaSlice<i32>,
    pub(super) ranks: CudaSlice<u32>,
    /// The rows' own buffers, for the dispatches that stage them here (over NCCL, or planned
    /// on the host); `None` until such a dispatch runs, since the dispatch planned on the
    /// device moves every row through the NVLink windows.
    staging: Option<EpStaging>,
}

/// The rows of a dispatch staged in this rank's memory, at the capacities of its
/// [`EpBuffers`]. At home: the token rows sent (one per token and destination rank, grouped by
/// destination) with their weights, and the partial outputs that come back. Where the experts
/// are: the token rows received (grouped by source) with their ids and weights, and the
/// partial sums per received token.
pub(super) struct EpStaging {
    pub(super) send_rows: CudaSlice<u16>,
    pub(super) send_w: CudaSlice<f32>,
    pub(super) back: CudaSlice<u16>,
    pub(super) recv_rows: CudaSlice<u16>,
    pub(super) recv_ids: CudaSlice<i32>,
    pub(super) recv_w: CudaSlice<f32>,
    pub(super) part: CudaSlice<u16>,
    /// Deterministic mode: the served slots' expert rows in the order they go home, the rows
    /// of `y` they come from, and the rows that came back home.
    pub(super) ret: CudaSlice<u16>,
    pub(super) ret_idx: CudaSlice<i32>,
    pub(super) back_slots: CudaSlice<u16>,
    /// All-gather of router logits: this rank's `[tokens, E]`, padded, and every rank's.
    pub(super) send_logits: CudaSlice<f32>,
    pub(super) recv_logits: CudaSlice<f32>,
}

/// The expert-parallel side of a layer: its communicator, where every expert lives (this
/// rank's `local` slots are physical ids `phys_first ..`), and the low-latency capacity in
/// tokens per rank when the layer dispatches that way.
pub(super) struct EpLink {
    pub(super) comm: NcclComm,
    pub(super) placement: Arc<ExpertPlacement>,
    pub(super) local: usize,
    pub(super) phys_first: usize,
    /// The placement's tables on the device (uploaded when the layer is assembled).
    pub(super) tables: Option<PlacementTables>,
    /// Where each expert with one replica is served, for the host's dispatch plan.
    pub(super) route_table: RouteTable,
    pub(super) capacity: Option<usize>,
    /// How rows travel between the ranks (see [`super::nvlink`]).
    pub(super) transport: std::sync::Mutex<super::nvlink::LinkTransport>,
    /// Whether the last all-to-all-v dispatch was planned on the device.
    pub(super) device_planned: std::sync::atomic::AtomicBool,
    /// Whether the last all-to-all-v dispatch sent its rows beside the routing.
    pub(super) rows_beside_routing: std::sync::atomic::AtomicBool,
}

/// Where the rows a rank received lie, with their ids and weights: its buffers (NCCL), or its
/// NVLink window's regions. The rows are bf16, or, with `fp8_scales`, fp8 e4m3 codes with
/// those scales (one f32 per 128 values).
#[derive(Clone, Copy, Debug)]
pub(super) struct Landed {
    pub(super) rows: u64,
    pub(super) fp8_scales: Option<u64>,
    pub(super) ids: u64,
    pub(super) w: u64,
}

impl EpBuffers {
    /// The staged rows' buffers, which `grow_ep_buffers(.., true)` allocated.
    pub(super) fn staging(&self) -> &EpStaging {
        self.staging.as_ref().expect("allocated by a staging dispatch's grow_ep_buffers")
    }
}

impl EpStaging {
    /// The received rows, ids and weights in these buffers.
    pub(super) fn landed(&self, g: &super::Gpu) -> Landed {
        Landed {
            rows: dptr(&self.recv_rows, g),
            fp8_scales: None,
            ids: dptr(&self.recv_ids, g),
            w: dptr(&self.recv_w, g),
        }
    }
}

/// Every rank's batch size on its way to the host: an all-gather enqueued before the routing,
/// copied into page-locked memory, the event after the copy, and the sizes once read (for
/// this call only: [`Batches::forget`] runs as each call starts).
pub(super) struct Batches {
    host: cudarc::driver::PinnedHostSlice<i32>,
    ready: Option<cudarc::driver::CudaEvent>,
    read: Option<Vec<usize>>,
}

impl Batches {
    /// Forgets the last call's sizes.
    pub(super) fn forget(&mut self) {
        self.read = None;
    }
}

/// How a rank finds the slots it serves among the received ones.
#[derive(Clone, Copy, Debug)]
pub(super) enum Localize {
    /// The ids arrive as local slots already (-1: served elsewhere).
    Resolved,
    /// The ids arrive as logical experts, row `r` being token `r mod period` of rank
    /// `r / period`; the placement's tables say which slots this rank serves, with `shared`
    /// (a device `[ranks, E]` of flags, or 0 for every expert) whose replicas share each
    /// rank's batch.
    Placed { period: usize, shared: u64 },
    /// The ids arrive as local slots (-1: served elsewhere) in a window where rank `s`'s rows
    /// start at row `starts[s]`, and only the first `counts[s]` of them were sent (device
    /// arrays of an int per rank, `ranks + 1` starts).
    Landed { counts: u64, starts: u64 },
}

/// How this rank's experts take the slots they received (see `CudaMoeLayer::local_plan`).
pub(super) struct LocalPlan {
    /// The experts' implementation.
    pub(super) imp: &'static dyn DeviceExperts,
    /// Rows per expert in the padded layout, 0 for the grouped one.
    pub(super) cap: usize,
    /// Rows of the expert GEMMs.
    pub(super) rows: usize,
    /// (local expert, first row, rows) of each expert with rows, grouped.
    pub(super) groups: Vec<(usize, usize, usize)>,
}

impl CudaMoeLayer {
    /// The expert-parallel side of a layer over `comm` with experts where `placement` puts
    /// them (an error when it is for other experts or another number of ranks).
    pub(super) fn link(config: &MoeConfig, comm: NcclComm, placement: Arc<ExpertPlacement>) -> Result<EpLink> {
        use crate::comm::Communicator;
        let (e, n, rank) = (config.num_experts, comm.size(), comm.rank());
        if placement.num_experts() != e || placement.ranks() != n {
            return Err(MoeError::Config(format!(
                "a placement of {} experts on {} ranks for a layer of {e} experts on {n} ranks",
                placement.num_experts(),
                placement.ranks()
            )));
        }
        let phys_first = (0..rank).map(|r| placement.local_experts(r).len()).sum();
        let local = placement.local_experts(rank).len();
        let route_table = RouteTable::new(&placement);
        let transport = std::sync::Mutex::new(super::nvlink::LinkTransport::Pending(Default::default()));
        let (device_planned, rows_beside_routing) = Default::default();
        Ok(EpLink {
            placement,
            local,
            phys_first,
            tables: None,
            route_table,
            comm,
            capacity: None,
            transport,
            device_planned,
            rows_beside_routing,
        })
    }

    /// This rank's routing read to the host: the `t · k` expert ids and the slots per expert.
    pub(super) fn read_routing(&self, b: &Buffers, t: usize) -> Result<(Vec<i32>, Vec<i32>)> {
        let k = self.config.top_k;
        let mut ids = vec![0i32; t * k];
        if t > 0 {
            self.gpu.stream.memcpy_dtoh(&b.ids.slice(0..t * k), &mut ids).map_err(|e| err("reading ids", e))?;
        }
        let mut counts = vec![0i32; self.config.num_experts];
        for &id in &ids {
            counts[id as usize] += 1;
        }
        Ok((ids, counts))
    }

    /// `b.exchange`, grown (zeroed) to at least `len` ints where it is shorter.
    fn exchange_room<'a>(&self, b: &'a mut Buffers, len: usize) -> Result<&'a mut CudaSlice<i32>> {
        if b.exchange.as_ref().is_none_or(|x| x.len() < len) {
            b.exchange = Some(self.gpu.stream.alloc_zeros::<i32>(len).map_err(|e| err("allocating workspace", e))?);
        }
        Ok(b.exchange.as_mut().expect("allocated"))
    }

    /// Holds the layer's stream, on the device, until every rank's stream has reached this
    /// point (an all-reduce of one int), for timed runs: the ranks then start the layer
    /// together, as a model's consecutive layers do (the previous layer's exchange ends on
    /// all of them at once), rather than when each host's launches reach its GPU. Collective.
    pub(super) fn align_ranks(&self, b: &mut Buffers, link: &EpLink) -> Result<()> {
        use cudarc::nccl::sys as nc;
        let exp = dptr(self.exchange_room(b, 1)?, &self.gpu);
        link.comm.enqueue("aligning the ranks' start", &self.gpu.stream, |comm, cs| {
            // SAFETY: an in-place all-reduce of the first int of the exchange buffer, whose
            // value no one reads (every exchange writes it before use).
            unsafe {
                nc::ncclAllReduce(
                    exp as _,
                    exp as _,
                    1,
                    nc::ncclDataType_t::ncclInt32,
                    nc::ncclRedOp_t::ncclSum,
                    comm,
                    cs,
                )
            }
        })
    }

    /// Every rank's `mine` (the same length on every rank), rank after rank, through an NCCL
    /// all-gather on the device and a host read.
    pub(super) fn gather_counts(&self, b: &mut Buffers, link: &EpLink, mine: &[i32]) -> Result<Vec<i32>> {
        use crate::comm::Communicator;
        use cudarc::nccl::sys as nc;
        let (n, m, s) = (link.comm.size(), mine.len(), &self.gpu.stream);
        let ex = self.exchange_room(b, m * (n + 1))?;
        s.memcpy_htod(mine, &mut ex.slice_mut(0..m)).map_err(|e| err("upload", e))?;
        let exp = dptr(ex, &self.gpu);
        link.comm.enqueue("moe counts", s, |comm, cs| {
            // SAFETY: all-gather of m ints per rank into the n · m ints after this rank's own.
            unsafe {
                nc::ncclAllGather(exp as _, (exp + 4 * m as u64) as _, m, nc::ncclDataType_t::ncclInt32, comm, cs)
            }
        })?;
        link.comm.wait("moe counts", s)?;
        let mut all = vec![0i32; n * m];
        s.memcpy_dtoh(&b.exchange.as_ref().expect("allocated").slice(m..m * (n + 1)), &mut all)
            .map_err(|e| err("reading counts", e))?;
        Ok(all)
    }

    /// Enqueues the all-gather of every rank's batch size (this rank's `t`) on the shared
    /// experts' side stream, to be read by [`CudaMoeLayer::batches`]: enqueued before the
    /// routing, it runs beside it, so the router does not wait for the peers and the host
    /// learns the sizes while the routing runs. The layer's stream joins the side stream
    /// before its next exchange ([`CudaMoeLayer::join_batches`]). Collective.
    pub(super) fn share_batches(&self, b: &mut Buffers, link: &EpLink, t: usize) -> Result<()> {
        use crate::comm::Communicator;
        use cudarc::nccl::sys as nc;
        let (n, s) = (link.comm.size(), &self.gpu.stream);
        self.exchange_room(b, n + 1)?;
        if b.batches.as_ref().is_none_or(|x| x.host.len() < n) {
            // SAFETY: page-locked host memory for n ints, written by the copy below before
            // any read (which waits for it).
            let host = unsafe { self.gpu.ctx.alloc_pinned_with_flags::<i32>(n, 0) }
                .map_err(|e| err("allocating host memory", e))?;
            b.batches = Some(Batches { host, ready: None, read: None });
        }
        let ex = b.exchange.as_mut().expect("allocated");
        let exp = dptr(ex, &self.gpu);
        self.write_ints(s, exp, &[t as i32])?;
        let side = self.side.shared();
        self.side.fork(s, [side])?;
        // For rows that leave beside the routing (`DevicePrepareFinalize::send_beside_routing`).
        self.side.tokens_in(s)?;
        link.comm.enqueue("moe batch sizes", &side.stream, |comm, cs| {
            // SAFETY: all-gather of one int per rank into the n ints after this rank's own.
            unsafe { nc::ncclAllGather(exp as _, (exp + 4) as _, 1, nc::ncclDataType_t::ncclInt32, comm, cs) }
        })?;
        let batches = b.batches.as_mut().expect("allocated");
        side.stream
            .memcpy_dtoh(&b.exchange.as_ref().expect("allocated").slice(1..n + 1), &mut batches.host)
            .map_err(|e| err("reading batch sizes", e))?;
        batches.ready = Some(side.stream.record_event(None).map_err(|e| err("event", e))?);
        batches.read = None;
        Ok(())
    }

    /// The layer's stream waits, on the device, for the batch sizes' all-gather
    /// ([`CudaMoeLayer::share_batches`]), so that no later collective of the communicator
    /// runs beside it.
    pub(super) fn join_batches(&self) -> Result<()> {
        self.side.join(&self.gpu.stream, [self.side.shared()])
    }

    /// Every rank's batch size in this call, as [`CudaMoeLayer::share_batches`] enqueued them
    /// (waited for against the communicator's deadline), or exchanged now with this rank's
    /// `t` when they were not.
    pub(super) fn batches(&self, b: &mut Buffers, link: &EpLink, t: usize) -> Result<Vec<usize>> {
        use crate::comm::Communicator;
        if let Some(read) = b.batches.as_ref().and_then(|x| x.read.clone()) {
            return Ok(read);
        }
        if b.batches.as_ref().is_none_or(|x| x.ready.is_none()) {
            self.share_batches(b, link, t)?;
        }
        let batches = b.batches.as_mut().expect("shared");
        let ready = batches.ready.take().expect("shared");
        link.comm.wait_event("moe batch sizes", &ready)?;
        let sizes = batches.host.as_slice().map_err(|e| err("reading batch sizes", e))?;
        let read: Vec<usize> = sizes[..link.comm.size()].iter().map(|&x| x.max(0) as usize).collect();
        batches.read = Some(read.clone());
        Ok(read)
    }

    /// How this rank's experts take `local[j]` slots each: the implementation the policy
    /// picks, padded to a capacity (`cap` > 0) or grouped, and the rows of its GEMMs.
    pub(super) fn local_plan(&self, local: &[usize]) -> LocalPlan {
        let slots: usize = local.iter().sum();
        let (imp, cap) = match self.device_counted(slots, local.len(), Form::ExpertParallel) {
            Some(imp) => (imp, 0),
            None => self.host_counted(slots, local),
        };
        LocalPlan { imp, cap, rows: if cap > 0 { local.len() * cap } else { slots }, groups: groups_of(local) }
    }

    /// Where the experts are: the slots of the `received` tokens (rows and ids `at`) that this
    /// rank serves, grouped by local expert as `plan` says, for the experts; enqueued on `s`.
    pub(super) fn group_received(
        &self,
        s: &CudaStream,
        b: &mut Buffers,
        received: usize,
        plan: LocalPlan,
        localize: Localize,
        at: Landed,
    ) -> Result<ExpertRows> {
        use crate::comm::Communicator;
        let link = self.ep.as_ref().expect("an expert-parallel layer");
        let (k, el) = (self.config.top_k, link.local);
        let (g, cap) = (&self.gpu, plan.cap);
        let ep = b.ep.as_ref().expect("allocated by the caller");
        let (pi, pb) = (|x: &CudaSlice<i32>| dptr(x, g), |x: &CudaSlice<u16>| dptr(x, g));
        let (recv_rows, recv_ids, local_ids) = (at.rows, at.ids, pi(&ep.local_ids));
        let (ecounts, eoffsets) = (pi(&ep.counts), pi(&ep.offsets));
        let maps = [pi(&ep.row_of_slot), pi(&ep.slot_of_row), pi(&ep.expert_of_row)];
        // Where the experts are: the received slots regrouped by local expert.
        let (rk, el_i) = ((received * k) as i32, el as i32);
        match localize {
            // SAFETY: localize_ids(int*, int, int, int, int*) over the received * k ids, which
            // are local slots or -1 (first 0).
            Localize::Resolved => unsafe {
                s.launch_builder(&self.k.localize)
                    .arg(&recv_ids)
                    .arg(&rk)
                    .arg(&0i32)
                    .arg(&el_i)
                    .arg(&local_ids)
                    .launch(grid(received * k))
                    .map_err(|e| err("localize_ids", e))?;
            },
            Localize::Landed { counts, starts } => {
                let (ni, rows_i) = (link.comm.size() as i32, received as i32);
                let ki = k as i32;
                // SAFETY: nvl_landed_ids(int*, int*, int*, int, int, int, int, int*) over the
                // received * k ids; counts holds an int per rank and starts one more.
                unsafe {
                    let mut l = s.launch_builder(&self.k.nvl_landed_ids);
                    l.arg(&recv_ids).arg(&counts).arg(&starts).arg(&ni).arg(&rows_i).arg(&ki).arg(&el_i);
                    l.arg(&local_ids).launch(grid(received * k))
                }
                .map_err(|e| err("nvl_landed_ids", e))?;
            }
            Localize::Placed { period, shared } => {
                let tables = link.tables.as_ref().expect("uploaded when the layer was assembled").ptrs(g);
                let (ki, period_i, rank_i) = (k as i32, period.max(1) as i32, link.comm.rank() as i32);
                let ei = self.config.num_experts as i32;
                // SAFETY: localize_placed(int*, int, int, int, int* x5, int, int, int, int*) over
                // the received * k logical ids (or -1); the tables cover every expert, and
                // `shared` (when not null) every rank's.
                unsafe {
                    let mut l = s.launch_builder(&self.k.localize_placed);
                    l.arg(&recv_ids).arg(&rk).arg(&ki).arg(&period_i);
                    l.arg(&tables[0]).arg(&tables[1]).arg(&tables[2]).arg(&tables[3]).arg(&shared).arg(&ei);
                    l.arg(&rank_i).arg(&el_i).arg(&local_ids).launch(grid(received * k))
                }
                .map_err(|e| err("localize_placed", e))?;
            }
        }
        // The el local experts and the bucket of slots served elsewhere.
        let chunk_counts = pi(&ep.chunk_counts);
        // A single chunk of slots is counted by the grouping's one launch.
        let counted = !super::permute::sorts_in_one_launch(received * k);
        if counted {
            self.count_slots(s, local_ids, received * k, el + 1, chunk_counts, ecounts)?;
        }
        // As on one GPU, the Hopper GEMM gathers the received rows of its up projection itself.
        let gather = plan.imp.gathers_rows(self, cap).then_some(Gather {
            x: recv_rows,
            fp8_scales: at.fp8_scales,
            tokens: received,
            slot_of_row: maps[1],
            k,
            stride: self.config.hidden,
        });
        let copy_rows = gather.is_none();
        let grouping = Grouping {
            ids: local_ids,
            slots: received * k,
            experts: el + 1,
            chunk_counts,
            counted,
            cap,
            skip: el as i32,
            copy_rows,
        };
        let a = pb(&ep.a);
        self.group_rows(s, &grouping, ecounts, eoffsets, maps, recv_rows, k, a)?;
        Ok(ExpertRows {
            imp: plan.imp,
            a,
            h13: pb(&ep.h13),
            act: pb(&ep.act),
            y: pb(&ep.y),
            expert_of_row: maps[2],
            experts: el,
            cap,
            rows: plan.rows,
            busy: plan.rows,
            groups: plan.groups,
            counts: ecounts,
            offsets: eoffsets,
            gather,
            y_rows: None,
        })
    }

    /// Where the experts are: `part` = one bf16 row per received token, the weighted sum of
    /// its slots served here in slot order (zeros where none is), from the experts' rows and
    /// the received weights (`at`).
    pub(super) fn partial_sums(&self, b: &Buffers, received: usize, at: Landed) -> Result<()> {
        let (h, k) = (self.config.hidden, self.config.top_k);
        let g = &self.gpu;
        let ep = b.ep.as_ref().expect("allocated by the caller");
        let (y, b2, local_ids, recv_w) =
            (dptr(&ep.y, g), self.w.b2.as_ref().map_or(0u64, |x| dptr(x, g)), dptr(&ep.local_ids, g), at.w);
        let (row_of_slot, part) = (dptr(&ep.row_of_slot, g), dptr(&ep.staging().part, g));
        let (ri, ki, hi) = (received as i32, k as i32, h as i32);
        // SAFETY: combine_partial(bf16*, float*, int*, float*, int*, int, int, int, bf16*) over
        // the received tokens; rows come from the grouping of `group_received`.
        unsafe {
            g.stream
                .launch_builder(&self.k.combine_partial)
                .arg(&y)
                .arg(&b2)
                .arg(&local_ids)
                .arg(&recv_w)
                .arg(&row_of_slot)
                .arg(&ri)
                .arg(&ki)
                .arg(&hi)
                .arg(&part)
                .launch(rows(received, 256))
        }
        .map(|_| ())
        .map_err(|e| err("combine_partial", e))
    }

    /// Sends `from[peer]` rows of each `(buffer, bytes per row)` in `src` (rows grouped by
    /// peer) to every peer and receives `into[peer]` rows into the matching buffers of `dst`, in
    /// one NCCL group on the layer's stream; the rows a rank keeps are a device copy.
    pub(super) fn exchange_rows(
        &self,
        link: &EpLink,
        op: &str,
        src: &[(u64, usize)],
        from: &[usize],
        dst: &[(u64, usize)],
        into: &[usize],
    ) -> Result<()> {
        use crate::comm::Communicator;
        use cudarc::nccl::sys as nc;
        let (n, rank) = (link.comm.size(), link.comm.rank());
        let s = &self.gpu.stream;
        let (so, ro) = (from[..rank].iter().sum::<usize>(), into[..rank].iter().sum::<usize>());
        for (&(sb, sw), &(db, _)) in src.iter().zip(dst) {
            if from[rank] > 0 {
                // SAFETY: both ranges lie inside buffers sized for these counts; the copy is
                // ordered on the layer's stream.
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        db + (ro * sw) as u64,
                        sb + (so * sw) as u64,
                        from[rank] * sw,
                        s.cu_stream(),
                    )
                }
                .map_err(|e| err("local copy", e))?;
            }
        }
        link.comm.enqueue(op, s, |comm, cs| {
            let (mut so, mut ro) = (0usize, 0usize);
            for peer in 0..n {
                for (&(sb, sw), &(db, dw)) in src.iter().zip(dst) {
                    let (sn, rn) = if peer == rank { (0, 0) } else { (from[peer] * sw, into[peer] * dw) };
                    // SAFETY: offsets stay inside the buffers, sized for these counts; every
                    // peer posts the matching calls, in the same order, from the same counts.
                    let r = unsafe {
                        let u8t = nc::ncclDataType_t::ncclUint8;
                        let mut r = nc::ncclResult_t::ncclSuccess;
                        if sn > 0 {
                            r = nc::ncclSend((sb + (so * sw) as u64) as _, sn, u8t, peer as i32, comm, cs);
                        }
                        if rn > 0 && r == nc::ncclResult_t::ncclSuccess {
                            r = nc::ncclRecv((db + (ro * dw) as u64) as _, rn, u8t, peer as i32, comm, cs);
                        }
                        r
                    };
                    if r != nc::ncclResult_t::ncclSuccess {
                        return r;
                    }
                }
                so += from[peer];
                ro += into[peer];
            }
            nc::ncclResult_t::ncclSuccess
        })
    }

    /// `b.ep` grown, where needed, to `need` = [rows sent, rows received, expert rows, home
    /// tokens] on `ranks` ranks (each capacity keeps its largest so far), with the staged
    /// rows' buffers where `staging` asks for them (a dispatch that stages rows here).
    pub(super) fn grow_ep_buffers(&self, b: &mut Buffers, need: [usize; 4], ranks: usize, staging: bool) -> Result<()> {
        if b.ep.as_ref().is_none_or(|x| x.cap.iter().zip(&need).any(|(have, want)| have < want)) {
            let old = b.ep.as_ref().map_or([0; 4], |x| x.cap);
            b.ep = None;
            b.ep = Some(self.ep_buffers(std::array::from_fn(|i| need[i].max(old[i])), ranks)?);
        }
        let ep = b.ep.as_mut().expect("allocated above");
        if staging && ep.staging.is_none() {
            ep.staging = Some(self.ep_staging(ep.cap)?);
        }
        Ok(())
    }

    /// Expert-parallel buffers for `cap` = [rows sent, rows received, expert rows, home tokens]
    /// (each rounded up to a power of two) on `ranks` ranks; the staged rows' buffers are
    /// [`CudaMoeLayer::ep_staging`]'s.
    fn ep_buffers(&self, cap: [usize; 4], ranks: usize) -> Result<EpBuffers> {
        let c = &self.config;
        let k = c.top_k;
        let el = self.ep.as_ref().map_or(c.num_experts, |l| l.local);
        let cap = cap.map(|x| x.max(1).next_power_of_two());
        let [sent, recv, rows2, t] = cap;
        let det = self.opts.deterministic;
        let s = &self.gpu.stream;
        let z16 = |n: usize| s.alloc_zeros::<u16>(n).map_err(|e| err("allocating workspace", e));
        let z32 = |n: usize| s.alloc_zeros::<i32>(n).map_err(|e| err("allocating workspace", e));
        Ok(EpBuffers {
            cap,
            send_idx: z32(sent)?,
            send_ids: z32(sent * k)?,
            home_rows: z32(t * ranks)?,
            local_ids: z32(recv * k)?,
            counts: z32(el + 1)?,
            chunk_counts: z32(super::permute::sort_counts_len(recv * k, el + 1))?,
            offsets: z32(el + 2)?,
            row_of_slot: z32(recv * k)?,
            slot_of_row: z32(rows2)?,
            expert_of_row: z32(rows2)?,
            a: z16(rows2 * c.hidden)?,
            h13: z16(rows2 * 2 * c.inter)?,
            act: z16(rows2 * c.inter)?,
            y: z16(rows2 * c.hidden)?,
            slot_row: z32(if det { t * k } else { 1 })?,
            y_rows: s.alloc_zeros::<u64>(if det { rows2 } else { 1 }).map_err(|e| err("allocating workspace", e))?,
            plan: z32(2 * ranks + 2)?,
            dest: z32(t * k)?,
            ranks: s.alloc_zeros::<u32>(t).map_err(|e| err("allocating workspace", e))?,
            staging: None,
        })
    }

    /// The staged rows' buffers at `cap`, the (rounded) capacities of [`CudaMoeLayer::ep_buffers`].
    fn ep_staging(&self, cap: [usize; 4]) -> Result<EpStaging> {
        let c = &self.config;
        let (h, k, e) = (c.hidden, c.top_k, c.num_experts);
        let [sent, recv, rows2, t] = cap;
        let det = self.opts.deterministic;
        let s = &self.gpu.stream;
        let z16 = |n: usize| s.alloc_zeros::<u16>(n).map_err(|e| err("allocating workspace", e));
        let z32 = |n: usize| s.alloc_zeros::<i32>(n).map_err(|e| err("allocating workspace", e));
        let zf = |n: usize| s.alloc_zeros::<f32>(n).map_err(|e| err("allocating workspace", e));
        Ok(EpStaging {
            send_rows: z16(sent * h)?,
            send_w: zf(sent * k)?,
            back: z16(sent * h)?,
            recv_rows: z16(recv * h)?,
            recv_ids: z32(recv * k)?,
            recv_w: zf(recv * k)?,
            part: z16(recv * h)?,
            ret: z16(if det { rows2 * h } else { 1 })?,
            ret_idx: z32(if det { rows2 } else { 1 })?,
            back_slots: z16(if det { t * k * h } else { 1 })?,
            send_logits: zf(sent * e)?,
            recv_logits: zf(recv * e)?,
        })
    }
}
