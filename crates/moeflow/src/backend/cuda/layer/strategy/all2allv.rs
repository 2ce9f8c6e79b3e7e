//! All-to-all-v as DeepEP does it: the counts all-gathered on the device, each token sent once
//! to every rank holding one of its experts (with its ids local to that rank and its weights),
//! its slots there regrouped by local expert, and the weighted sum over the slots served there
//! sent back as one bf16 row per (token, rank) and summed at home in rank order. In
//! deterministic mode the served slots' expert rows go back as they are and the home weights
//! and sums them in slot order, as one GPU does, so the bits do not depend on the layout.

use super::{state_of, DevicePrepareFinalize, Dispatched, Mark, State};
use crate::backend::cuda::layer::expert_parallel::Localize;
use crate::backend::cuda::layer::{dptr, err, rows, Buffers, CudaMoeLayer};
use crate::backend::host_route::HostRoute;
use crate::comm::Communicator;
use crate::error::Result;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

/// All-to-all-v of token rows.
pub(in crate::backend::cuda::layer) struct All2AllV;

/// What the halves share: the routing plan and every rank's counts.
struct Plan {
    route: HostRoute,
    /// Every rank's slots per physical expert and tokens per destination.
    all: Vec<i32>,
    /// Tokens this rank sends to / receives from each rank.
    send_tok: Vec<usize>,
    recv_tok: Vec<usize>,
    received: usize,
    plan: Option<crate::backend::cuda::layer::expert_parallel::LocalPlan>,
}

impl DevicePrepareFinalize for All2AllV {
    fn name(&self) -> &'static str {
        "all2allv"
    }

    fn prepare_begin(&self, l: &CudaMoeLayer, b: &mut Buffers, t: usize, mark: Mark) -> Result<State> {
        let link = l.ep.as_ref().expect("an expert-parallel layer");
        let (h, k) = (l.config.hidden, l.config.top_k);
        let (n, rank) = (link.comm.size(), link.comm.rank());
        let g = &l.gpu;
        let s = &g.stream;
        // Home: each slot's serving replica, the ranks each token goes to (in token order per
        // destination) with its ids local to that rank (-1 for slots served elsewhere), and the
        // slots per physical expert: the one host read of the routing.
        let (ids, _) = l.read_routing(b, t)?;
        let route = HostRoute::new(&link.placement, &link.route_table, &ids, k, t);
        let (send_tok, sent) = (route.counts.clone(), route.send_idx.len());
        // Every rank's slot counts per physical expert and token counts per destination.
        let np = link.placement.num_physical();
        let m = np + n;
        let mine: Vec<i32> = route.phys_counts.iter().copied().chain(send_tok.iter().map(|&x| x as i32)).collect();
        let all = l.gather_counts(b, link, &mine)?;
        let recv_tok: Vec<usize> = (0..n).map(|src| all[src * m + np + rank] as usize).collect();
        let received: usize = recv_tok.iter().sum();
        let local: Vec<usize> =
            (0..link.local).map(|j| (0..n).map(|src| all[src * m + link.phys_first + j] as usize).sum()).collect();
        let plan = l.local_plan(&local);
        l.grow_ep_buffers(b, [sent, received, plan.rows, t], n)?;
        let ep = b.ep.as_mut().expect("allocated");
        let up = |what: &str, r: std::result::Result<(), cudarc::driver::DriverError>| r.map_err(|e| err(what, e));
        if sent > 0 {
            up("upload", s.memcpy_htod(&route.send_idx, &mut ep.send_idx.slice_mut(0..sent)))?;
            up("upload", s.memcpy_htod(&route.send_ids, &mut ep.send_ids.slice_mut(0..sent * k)))?;
        }
        if t > 0 {
            up("upload", s.memcpy_htod(&route.home_rows, &mut ep.home_rows.slice_mut(0..t * n)))?;
        }
        let (pi, pf, pb) =
            (|x: &CudaSlice<i32>| dptr(x, g), |x: &CudaSlice<f32>| dptr(x, g), |x: &CudaSlice<u16>| dptr(x, g));
        let (send_rows, send_idx, send_ids, send_w) =
            (pb(&ep.send_rows), pi(&ep.send_idx), pi(&ep.send_ids), pf(&ep.send_w));
        let (recv_rows, recv_ids, recv_w) = (pb(&ep.recv_rows), pi(&ep.recv_ids), pf(&ep.recv_w));
        let (hi, sent_i, k2) = (h as i32, sent as i32, 2 * k as i32);
        // The token rows and their weights (k 4-byte values = 2k 16-bit words a row).
        for (src, width, dst) in [(pb(&b.x_bf), hi, send_rows), (dptr(&b.weights, g), k2, send_w)] {
            // SAFETY: take_rows(bf16*, int*, int, int, bf16*): dst[j] = src[send_idx[j]] for j <
            // sent, rows of `width` 16-bit words; every index is a token of this batch.
            unsafe {
                s.launch_builder(&l.k.take)
                    .arg(&src)
                    .arg(&send_idx)
                    .arg(&sent_i)
                    .arg(&width)
                    .arg(&dst)
                    .launch(rows(sent, 128))
            }
            .map_err(|e| err("take_rows", e))?;
        }
        mark(2)?;
        l.exchange_rows(
            link,
            "moe dispatch",
            &[(send_rows, 2 * h), (send_ids, 4 * k), (send_w, 4 * k)],
            &send_tok,
            &[(recv_rows, 2 * h), (recv_ids, 4 * k), (recv_w, 4 * k)],
            &recv_tok,
        )?;
        Ok(Box::new(Plan { route, all, send_tok, recv_tok, received, plan: Some(plan) }))
    }

    fn prepare_finish(
        &self,
        l: &CudaMoeLayer,
        b: &mut Buffers,
        _t: usize,
        pending: State,
        mark: Mark,
    ) -> Result<Dispatched> {
        let mut p = state_of::<Plan>(pending, self.name())?;
        let plan = p.plan.take().expect("planned in prepare_begin");
        let rows = l.group_received(b, p.received, plan, Localize::Resolved)?;
        mark(3)?;
        let link = l.ep.as_ref().expect("an expert-parallel layer");
        let (h, k, rank) = (l.config.hidden, l.config.top_k, link.comm.rank());
        let row = 2 * h + 8 * k;
        let sent = p.send_tok.iter().enumerate().filter(|&(d, _)| d != rank).map(|(_, &r)| r * row).sum();
        Ok(Dispatched { rows, sent, state: p })
    }

    fn finalize_begin(&self, l: &CudaMoeLayer, b: &mut Buffers, t: usize, d: &mut Dispatched) -> Result<()> {
        let p = d.state.downcast_ref::<Plan>().expect("this strategy's state");
        let link = l.ep.as_ref().expect("an expert-parallel layer");
        let h = l.config.hidden;
        if l.opts.deterministic {
            return return_slots(l, b, t, p, d.rows.y, d.rows.experts);
        }
        l.partial_sums(b, p.received)?;
        let ep = b.ep.as_ref().expect("allocated");
        let (part, back) = (dptr(&ep.part, &l.gpu), dptr(&ep.back, &l.gpu));
        l.exchange_rows(link, "moe combine", &[(part, 2 * h)], &p.recv_tok, &[(back, 2 * h)], &p.send_tok)
    }

    fn finalize_finish(&self, l: &CudaMoeLayer, b: &mut Buffers, t: usize, _d: Dispatched, mark: Mark) -> Result<()> {
        let link = l.ep.as_ref().expect("an expert-parallel layer");
        let g = &l.gpu;
        mark(7)?;
        let ep = b.ep.as_ref().expect("allocated");
        if l.opts.deterministic {
            if t == 0 {
                return Ok(());
            }
            let (back, slot_row) = (dptr(&ep.back_slots, g), dptr(&ep.slot_row, g));
            let b2 = l.w.b2_all.as_ref().map_or(0u64, |x| dptr(x, g));
            return l.combine_rows(b, t, back, slot_row, b2);
        }
        let (back, home_rows) = (dptr(&ep.back, g), dptr(&ep.home_rows, g));
        l.sum_home(back, home_rows, t, link.comm.size(), dptr(&b.out, g))
    }
}

/// Deterministic mode's return: each served slot's expert row (of `y`, over `experts` local
/// experts), as it is, in the order it goes home (by source rank, token and slot), sent back
/// to its token's rank, where [`All2AllV::finalize_finish`] weights and sums it in slot order
/// with the combine one GPU runs.
fn return_slots(l: &CudaMoeLayer, b: &mut Buffers, t: usize, p: &Plan, y: u64, experts: usize) -> Result<()> {
    let link = l.ep.as_ref().expect("an expert-parallel layer");
    let (h, k, n) = (l.config.hidden, l.config.top_k, link.comm.size());
    let (g, placement) = (&l.gpu, &link.placement);
    let s = &g.stream;
    let m = placement.num_physical() + n;
    // Rows served here for each source, and rows each destination serves for this rank.
    let served_from: Vec<usize> =
        (0..n).map(|src| (0..link.local).map(|j| p.all[src * m + link.phys_first + j] as usize).sum()).collect();
    let mut served_to = vec![0usize; n];
    for (phys, &c) in p.route.phys_counts.iter().enumerate() {
        served_to[placement.physical_slot(phys).0] += c as usize;
    }
    let served: usize = served_from.iter().sum();
    let ep = b.ep.as_mut().expect("allocated");
    if t > 0 {
        let rows = p.route.slot_rows(t, k);
        s.memcpy_htod(&rows, &mut ep.slot_row.slice_mut(0..t * k)).map_err(|e| err("upload", e))?;
    }
    let (local_ids, row_of_slot) = (dptr(&ep.local_ids, g), dptr(&ep.row_of_slot, g));
    let (ret_idx, ret, back) = (dptr(&ep.ret_idx, g), dptr(&ep.ret, g), dptr(&ep.back_slots, g));
    let (n_slots, el_i, served_i, hi) = ((p.received * k) as i32, experts as i32, served as i32, h as i32);
    // SAFETY: compact_served(int*, int*, int, int, int*) reads the received · k local ids and
    // slot rows and writes `served` row indices; take_rows copies those rows of y (h wide)
    // into `ret`, which holds the plan's rows ≥ served rows.
    unsafe {
        s.launch_builder(&l.k.compact_served)
            .arg(&local_ids)
            .arg(&row_of_slot)
            .arg(&n_slots)
            .arg(&el_i)
            .arg(&ret_idx)
            .launch(LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 })
            .map_err(|e| err("compact_served", e))?;
        s.launch_builder(&l.k.take)
            .arg(&y)
            .arg(&ret_idx)
            .arg(&served_i)
            .arg(&hi)
            .arg(&ret)
            .launch(rows(served, 128))
            .map_err(|e| err("take_rows", e))?;
    }
    l.exchange_rows(link, "moe combine", &[(ret, 2 * h)], &served_from, &[(back, 2 * h)], &served_to)
}
