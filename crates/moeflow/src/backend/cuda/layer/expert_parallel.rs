//! One rank of an expert-parallel layer with the all-to-all-v dispatch as DeepEP does it: the
//! counts all-gathered on the device, each token sent once to every rank holding one of its
//! experts, served there, and its partial sum sent back.

use super::super::NcclComm;
use super::hopper_gemm::Gather;
use super::permute::Grouping;
use super::placement::PlacementTables;
use super::{all_gather, dptr, err, grid, rows, Buffers, CudaMoeLayer};
use crate::backend::host_route::HostRoute;
use crate::config::MoeConfig;
use crate::error::{MoeError, Result};
use crate::placement::ExpertPlacement;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use std::sync::Arc;

/// Expert-parallel buffers. At home: the token rows sent (one per token and destination
/// rank, grouped by destination) with their ids and weights, and the partial outputs that come
/// back. Where the experts are: the token rows received (grouped by source), their slots
/// regrouped by local expert for the GEMMs (`a`, `h13`, `act`, `y`), and the partial sums per
/// received token. Capacities grow to the largest call seen.
pub(super) struct EpBuffers {
    /// Capacities: rows sent, rows received, expert rows (padded), home tokens.
    pub(super) cap: [usize; 4],
    pub(super) send_idx: CudaSlice<i32>,
    pub(super) send_rows: CudaSlice<u16>,
    pub(super) send_ids: CudaSlice<i32>,
    pub(super) send_w: CudaSlice<f32>,
    pub(super) home_rows: CudaSlice<i32>,
    pub(super) back: CudaSlice<u16>,
    pub(super) recv_rows: CudaSlice<u16>,
    pub(super) recv_ids: CudaSlice<i32>,
    pub(super) recv_w: CudaSlice<f32>,
    pub(super) local_ids: CudaSlice<i32>,
    pub(super) counts: CudaSlice<i32>,
    pub(super) offsets: CudaSlice<i32>,
    pub(super) row_of_slot: CudaSlice<i32>,
    pub(super) slot_of_row: CudaSlice<i32>,
    pub(super) expert_of_row: CudaSlice<i32>,
    pub(super) a: CudaSlice<u16>,
    pub(super) h13: CudaSlice<u16>,
    pub(super) act: CudaSlice<u16>,
    pub(super) y: CudaSlice<u16>,
    pub(super) part: CudaSlice<u16>,
    /// Deterministic mode: the served slots' expert rows in the order they go home, the rows
    /// of `y` they come from, the rows that came back home, and where each home slot's row is.
    pub(super) ret: CudaSlice<u16>,
    pub(super) ret_idx: CudaSlice<i32>,
    pub(super) back_slots: CudaSlice<u16>,
    pub(super) slot_row: CudaSlice<i32>,
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
    pub(super) capacity: Option<usize>,
    /// How a gathering layer moves tokens ([`all_gather`]); `None`: all-to-all-v (or the
    /// low-latency form).
    pub(super) gathering: Option<all_gather::Gathering>,
}

/// How a rank finds the slots it serves among the received ones.
#[derive(Clone, Copy, Debug)]
pub(super) enum Localize {
    /// The ids arrive as local slots already (-1: served elsewhere).
    Resolved,
    /// The ids arrive as logical experts, row `r` being token `r mod period` of its rank; the
    /// placement's tables say which slots this rank serves.
    Placed { period: usize },
}

/// How this rank's experts take the slots they received (see `CudaMoeLayer::local_plan`).
pub(super) struct LocalPlan {
    /// Slots of this rank's experts.
    pub(super) slots: usize,
    /// Rows per expert in the padded layout, 0 for the grouped one.
    pub(super) cap: usize,
    /// Rows of the expert GEMMs.
    pub(super) rows: usize,
    /// (local expert, first row, rows) of each expert with rows.
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
        Ok(EpLink { placement, local, phys_first, tables: None, comm, capacity: None, gathering: None })
    }

    /// The expert-parallel layer after routing, with token dispatch as DeepEP does it: each
    /// token goes once to every rank holding one of its experts, with its ids and weights (the
    /// counts are all-gathered first, on the device); there its slots are regrouped by local
    /// expert for the GEMMs, and the weighted sum over the local slots comes back as one bf16
    /// row per (token, rank), summed at home in rank order into `b.out`. Returns the bytes this
    /// rank sent to other ranks in the dispatch.
    pub(super) fn ep_experts(
        &self,
        b: &mut Buffers,
        t: usize,
        link: &EpLink,
        mark: &dyn Fn(usize) -> Result<()>,
    ) -> Result<usize> {
        use crate::comm::Communicator;
        let c = &self.config;
        let (h, k) = (c.hidden, c.top_k);
        let (n, rank) = (link.comm.size(), link.comm.rank());
        let g = &self.gpu;
        let s = &g.stream;
        // Home: each slot's serving replica, the ranks each token goes to (in token order per
        // destination) with its ids local to that rank (-1 for slots served elsewhere), and the
        // slots per physical expert: the one host read of the routing.
        let (ids, _) = self.read_routing(b, t)?;
        let route = HostRoute::new(&link.placement, &ids, k, t);
        let (send_tok, sent) = (route.lists.iter().map(Vec::len).collect::<Vec<_>>(), route.send_idx.len());
        // Every rank's slot counts per physical expert and token counts per destination.
        let np = link.placement.num_physical();
        let m = np + n;
        let mine: Vec<i32> = route.phys_counts.iter().copied().chain(send_tok.iter().map(|&x| x as i32)).collect();
        let all = self.gather_counts(b, link, &mine)?;
        let recv_tok: Vec<usize> = (0..n).map(|src| all[src * m + np + rank] as usize).collect();
        let received: usize = recv_tok.iter().sum();
        let local: Vec<usize> =
            (0..link.local).map(|j| (0..n).map(|src| all[src * m + link.phys_first + j] as usize).sum()).collect();
        let plan = self.local_plan(&local);
        let (send_idx, home_rows, send_ids) = (&route.send_idx, &route.home_rows, &route.send_ids);
        let need = [sent, received, plan.rows, t];
        self.grow_ep_buffers(b, need, n)?;
        let ep = b.ep.as_mut().expect("allocated");
        let up = |what: &str, r: std::result::Result<(), cudarc::driver::DriverError>| r.map_err(|e| err(what, e));
        if sent > 0 {
            up("upload", s.memcpy_htod(send_idx, &mut ep.send_idx.slice_mut(0..sent)))?;
            up("upload", s.memcpy_htod(send_ids, &mut ep.send_ids.slice_mut(0..sent * k)))?;
        }
        if t > 0 {
            up("upload", s.memcpy_htod(home_rows, &mut ep.home_rows.slice_mut(0..t * n)))?;
        }
        let (pi, pf, pb) =
            (|x: &CudaSlice<i32>| dptr(x, g), |x: &CudaSlice<f32>| dptr(x, g), |x: &CudaSlice<u16>| dptr(x, g));
        let (xbp, send_rows, send_idx_p) = (pb(&b.x_bf), pb(&ep.send_rows), pi(&ep.send_idx));
        let (recv_rows, recv_ids, recv_w) = (pb(&ep.recv_rows), pi(&ep.recv_ids), pf(&ep.recv_w));
        let (part, back) = (pb(&ep.part), pb(&ep.back));
        let (home_rows_p, send_ids_p, send_w_p) = (pi(&ep.home_rows), pi(&ep.send_ids), pf(&ep.send_w));
        let (hi, sent_i, k2) = (h as i32, sent as i32, 2 * k as i32);
        // The token rows and their weights (k 4-byte values = 2k 16-bit words a row).
        for (src, width, dst) in [(xbp, hi, send_rows), (dptr(&b.weights, g), k2, send_w_p)] {
            // SAFETY: take_rows(bf16*, int*, int, int, bf16*): dst[j] = src[send_idx[j]] for j <
            // sent, rows of `width` 16-bit words; every index is a token of this batch.
            unsafe {
                s.launch_builder(&self.k.take)
                    .arg(&src)
                    .arg(&send_idx_p)
                    .arg(&sent_i)
                    .arg(&width)
                    .arg(&dst)
                    .launch(rows(sent, 128))
            }
            .map_err(|e| err("take_rows", e))?;
        }
        mark(2)?;
        self.exchange_rows(
            link,
            "moe dispatch",
            &[(send_rows, 2 * h), (send_ids_p, 4 * k), (send_w_p, 4 * k)],
            &send_tok,
            &[(recv_rows, 2 * h), (recv_ids, 4 * k), (recv_w, 4 * k)],
            &recv_tok,
        )?;
        self.serve_received(b, received, &plan, Localize::Resolved, mark)?;
        if self.opts.deterministic {
            self.return_slots(b, link, &route, &all, t, mark)?;
            let row = 2 * h + 8 * k;
            return Ok(send_tok.iter().enumerate().filter(|&(d, _)| d != rank).map(|(_, &r)| r * row).sum());
        }
        self.exchange_rows(link, "moe combine", &[(part, 2 * h)], &recv_tok, &[(back, 2 * h)], &send_tok)?;
        mark(7)?;
        self.sum_home(back, home_rows_p, t, n, dptr(&b.out, g))?;
        let row = 2 * h + 8 * k;
        Ok(send_tok.iter().enumerate().filter(|&(d, _)| d != rank).map(|(_, &r)| r * row).sum())
    }

    /// Deterministic mode's combine: every rank sends the expert rows of the slots it served
    /// (`ep.ret`, by source rank) back to their tokens' ranks, and each home weights and sums
    /// its tokens' rows in slot order into `b.out`, with the combine one GPU runs.
    fn return_slots(
        &self,
        b: &mut Buffers,
        link: &EpLink,
        route: &HostRoute,
        all: &[i32],
        t: usize,
        mark: &dyn Fn(usize) -> Result<()>,
    ) -> Result<()> {
        use crate::comm::Communicator;
        let (h, k, n) = (self.config.hidden, self.config.top_k, link.comm.size());
        let p = &link.placement;
        let (np, g) = (p.num_physical(), &self.gpu);
        let m = np + n;
        // Rows served here for each source, and rows each destination serves for this rank.
        let served_from: Vec<usize> =
            (0..n).map(|src| (0..link.local).map(|j| all[src * m + link.phys_first + j] as usize).sum()).collect();
        let mut served_to = vec![0usize; n];
        for (phys, &c) in route.phys_counts.iter().enumerate() {
            served_to[p.physical_slot(phys).0] += c as usize;
        }
        let ep = b.ep.as_mut().expect("allocated");
        if t > 0 {
            let rows = route.slot_rows(t, k);
            g.stream.memcpy_htod(&rows, &mut ep.slot_row.slice_mut(0..t * k)).map_err(|e| err("upload", e))?;
        }
        let (ret, back, slot_row) = (dptr(&ep.ret, g), dptr(&ep.back_slots, g), dptr(&ep.slot_row, g));
        self.exchange_rows(link, "moe combine", &[(ret, 2 * h)], &served_from, &[(back, 2 * h)], &served_to)?;
        mark(7)?;
        if t == 0 {
            return Ok(());
        }
        let b2 = self.w.b2_all.as_ref().map_or(0u64, |x| dptr(x, g));
        self.combine_rows(b, t, back, slot_row, b2)
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

    /// Every rank's `mine` (the same length on every rank), rank after rank, through an NCCL
    /// all-gather on the device and a host read.
    pub(super) fn gather_counts(&self, b: &mut Buffers, link: &EpLink, mine: &[i32]) -> Result<Vec<i32>> {
        use crate::comm::Communicator;
        use cudarc::nccl::sys as nc;
        let (n, m, s) = (link.comm.size(), mine.len(), &self.gpu.stream);
        if b.exchange.as_ref().is_none_or(|x| x.len() < m * (n + 1)) {
            b.exchange = Some(s.alloc_zeros::<i32>(m * (n + 1)).map_err(|e| err("allocating workspace", e))?);
        }
        let ex = b.exchange.as_mut().expect("allocated");
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

    /// How this rank's experts take `local[j]` slots each: padded to a capacity (`cap` > 0)
    /// or grouped, the rows of the grouped GEMMs, and (expert, first row, rows) per expert hit.
    pub(super) fn local_plan(&self, local: &[usize]) -> LocalPlan {
        let el = local.len();
        let slots: usize = local.iter().sum();
        let cap = self.padding(el, slots, local.iter().copied());
        let mut groups = Vec::new();
        let mut off = 0;
        for (j, &cnt) in local.iter().enumerate() {
            if cnt > 0 {
                groups.push((j, if cap > 0 { j * cap } else { off }, cnt));
            }
            off += cnt;
        }
        LocalPlan { slots, cap, rows: if cap > 0 { el * cap } else { slots }, groups }
    }

    /// Where the experts are: the `received` tokens in `b.ep` (rows, ids, weights) through
    /// this rank's experts, as planned, into `part` (one bf16 row per received token: the
    /// weighted sum of its slots held here, in slot order; zeros where none is).
    pub(super) fn serve_received(
        &self,
        b: &mut Buffers,
        received: usize,
        plan: &LocalPlan,
        localize: Localize,
        mark: &dyn Fn(usize) -> Result<()>,
    ) -> Result<()> {
        use crate::comm::Communicator;
        let link = self.ep.as_ref().expect("an expert-parallel layer");
        let (h, k, el) = (self.config.hidden, self.config.top_k, link.local);
        let (g, cap) = (&self.gpu, plan.cap);
        let s = &g.stream;
        let ep = b.ep.as_ref().expect("allocated by the caller");
        let (pi, pf, pb) =
            (|x: &CudaSlice<i32>| dptr(x, g), |x: &CudaSlice<f32>| dptr(x, g), |x: &CudaSlice<u16>| dptr(x, g));
        let (recv_rows, recv_ids, recv_w, local_ids) =
            (pb(&ep.recv_rows), pi(&ep.recv_ids), pf(&ep.recv_w), pi(&ep.local_ids));
        let (ecounts, eoffsets, part) = (pi(&ep.counts), pi(&ep.offsets), pb(&ep.part));
        let (ret_idx, ret) = (pi(&ep.ret_idx), pb(&ep.ret));
        let maps = [pi(&ep.row_of_slot), pi(&ep.slot_of_row), pi(&ep.expert_of_row)];
        let bufs = [pb(&ep.a), pb(&ep.h13), pb(&ep.act), pb(&ep.y), maps[2]];
        let hi = h as i32;
        // Where the experts are: the received slots regrouped by local expert.
        let (rk, el_i, buckets) = ((received * k) as i32, el as i32, (el + 1) as i32);
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
            Localize::Placed { period } => {
                let tables = link.tables.as_ref().expect("uploaded when the layer was assembled").ptrs(g);
                let (ki, period_i, rank_i) = (k as i32, period.max(1) as i32, link.comm.rank() as i32);
                // SAFETY: localize_placed(int*, int, int, int, int* x4, int, int, int*) over the
                // received * k logical ids (or -1); the tables cover every expert.
                unsafe {
                    let mut l = s.launch_builder(&self.k.localize_placed);
                    l.arg(&recv_ids).arg(&rk).arg(&ki).arg(&period_i);
                    l.arg(&tables[0]).arg(&tables[1]).arg(&tables[2]).arg(&tables[3]);
                    l.arg(&rank_i).arg(&el_i).arg(&local_ids).launch(grid(received * k))
                }
                .map_err(|e| err("localize_placed", e))?;
            }
        }
        let warps = LaunchConfig { grid_dim: (el as u32 + 1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: count_slots(int*, int, int, int*) over the received * k local ids; the counts
        // buffer holds el + 1 buckets.
        unsafe {
            s.launch_builder(&self.k.count)
                .arg(&local_ids)
                .arg(&rk)
                .arg(&buckets)
                .arg(&ecounts)
                .launch(warps)
                .map_err(|e| err("count", e))?;
        }
        // As on one GPU, the Hopper GEMM gathers the received rows of its up projection itself.
        let gather =
            self.hopper_gathers(plan.slots, el, cap).then_some(Gather { x: recv_rows, slot_of_row: maps[1], k });
        let copy_rows = gather.is_none();
        let grouping =
            Grouping { ids: local_ids, slots: received * k, experts: el + 1, cap, skip: el as i32, copy_rows };
        self.group_rows(&grouping, ecounts, eoffsets, maps, recv_rows, k, bufs[0])?;
        mark(3)?;
        self.mlp(b, bufs, el, cap, (&plan.groups, [ecounts, eoffsets]), plan.slots, gather, mark)?;
        if self.opts.deterministic {
            // Each served slot's expert row, as it is, in the order it goes home: by source
            // rank, token and slot (the home weights and sums them as one GPU does).
            let n_slots = (received * k) as i32;
            let served = plan.slots as i32;
            // SAFETY: compact_served(int*, int*, int, int, int*) reads the received · k local
            // ids and slot rows and writes `served` (plan.slots) row indices; take_rows copies
            // those rows of y (h wide) into `ret`, which holds plan.rows ≥ served rows.
            unsafe {
                s.launch_builder(&self.k.compact_served)
                    .arg(&local_ids)
                    .arg(&maps[0])
                    .arg(&n_slots)
                    .arg(&el_i)
                    .arg(&ret_idx)
                    .launch(LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 })
                    .map_err(|e| err("compact_served", e))?;
                s.launch_builder(&self.k.take)
                    .arg(&bufs[3])
                    .arg(&ret_idx)
                    .arg(&served)
                    .arg(&hi)
                    .arg(&ret)
                    .launch(rows(plan.slots, 128))
                    .map_err(|e| err("take_rows", e))?;
            }
            return Ok(());
        }
        let b2 = self.w.b2.as_ref().map_or(0u64, |x| dptr(x, g));
        let (ri, ki) = (received as i32, k as i32);
        // SAFETY: combine_partial(bf16*, float*, int*, float*, int*, int, int, int, bf16*) over
        // the received tokens; rows come from the grouping above.
        unsafe {
            s.launch_builder(&self.k.combine_partial)
                .arg(&bufs[3])
                .arg(&b2)
                .arg(&local_ids)
                .arg(&recv_w)
                .arg(&maps[0])
                .arg(&ri)
                .arg(&ki)
                .arg(&hi)
                .arg(&part)
                .launch(rows(received, 256))
        }
        .map_err(|e| err("combine_partial", e))?;
        Ok(())
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
    /// tokens] on `ranks` ranks (each capacity keeps its largest so far).
    pub(super) fn grow_ep_buffers(&self, b: &mut Buffers, need: [usize; 4], ranks: usize) -> Result<()> {
        if b.ep.as_ref().is_none_or(|x| x.cap.iter().zip(&need).any(|(have, want)| have < want)) {
            let old = b.ep.as_ref().map_or([0; 4], |x| x.cap);
            b.ep = None;
            b.ep = Some(self.ep_buffers(std::array::from_fn(|i| need[i].max(old[i])), ranks)?);
        }
        Ok(())
    }

    /// Expert-parallel buffers for `cap` = [rows sent, rows received, expert rows, home tokens]
    /// (each rounded up to a power of two) on `ranks` ranks.
    pub(super) fn ep_buffers(&self, cap: [usize; 4], ranks: usize) -> Result<EpBuffers> {
        let c = &self.config;
        let (h, i, k, e) = (c.hidden, c.inter, c.top_k, c.num_experts);
        let el = self.ep.as_ref().map_or(e, |l| l.local);
        let cap = cap.map(|x| x.max(1).next_power_of_two());
        let [sent, recv, rows2, t] = cap;
        let det = self.opts.deterministic;
        let s = &self.gpu.stream;
        let z16 = |n: usize| s.alloc_zeros::<u16>(n).map_err(|e| err("allocating workspace", e));
        let z32 = |n: usize| s.alloc_zeros::<i32>(n).map_err(|e| err("allocating workspace", e));
        let zf = |n: usize| s.alloc_zeros::<f32>(n).map_err(|e| err("allocating workspace", e));
        Ok(EpBuffers {
            cap,
            send_idx: z32(sent)?,
            send_rows: z16(sent * h)?,
            send_ids: z32(sent * k)?,
            send_w: zf(sent * k)?,
            home_rows: z32(t * ranks)?,
            back: z16(sent * h)?,
            recv_rows: z16(recv * h)?,
            recv_ids: z32(recv * k)?,
            recv_w: zf(recv * k)?,
            local_ids: z32(recv * k)?,
            counts: z32(el + 1)?,
            offsets: z32(el + 2)?,
            row_of_slot: z32(recv * k)?,
            slot_of_row: z32(rows2)?,
            expert_of_row: z32(rows2)?,
            a: z16(rows2 * h)?,
            h13: z16(rows2 * 2 * i)?,
            act: z16(rows2 * i)?,
            y: z16(rows2 * h)?,
            part: z16(recv * h)?,
            ret: z16(if det { rows2 * h } else { 1 })?,
            ret_idx: z32(if det { rows2 } else { 1 })?,
            back_slots: z16(if det { t * k * h } else { 1 })?,
            slot_row: z32(if det { t * k } else { 1 })?,
            send_logits: zf(sent * e)?,
            recv_logits: zf(recv * e)?,
        })
    }
}
