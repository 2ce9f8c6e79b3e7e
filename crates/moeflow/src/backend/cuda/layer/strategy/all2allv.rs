//! All-to-all-v as DeepEP does it: the counts all-gathered on the device, each token sent once
//! to every rank holding one of its experts (with its ids local to that rank and its weights),
//! its slots there regrouped by local expert, and the weighted sum over the slots served there
//! sent back as one bf16 row per (token, rank) and summed at home in rank order. In
//! deterministic mode the served slots' expert rows go back as they are and the home weights
//! and sums them in slot order, as one GPU does, so the bits do not depend on the layout.
//! Rows travel over the link's transport: NCCL send/receive from staged rows, or the NVLink
//! transport's push, which gathers the token rows and weights by index straight into the peers'
//! windows (see [`super::super::nvlink`]). This file plans the dispatch on the host; over NVLink
//! [`super::all2allv_nvlink`] plans it on the device where it applies.

use super::all2allv_nvlink::{self, DevicePlan};
use super::{state_of, DevicePrepareFinalize, Dispatched, Mark, Sent, SharedStart, State};
use crate::backend::cuda::layer::expert_parallel::{EpLink, Landed, Localize};
use crate::backend::cuda::layer::nvlink::{Exchange, Lane};
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
    /// Where the rows landed, and, over NVLink, the window's regions of the returns.
    landed: Landed,
    nvlink: Option<Returns>,
}

/// The NVLink window's regions (see [`regions_of`]), the same for both plans, so that a layer
/// that takes either keeps its window.
pub(super) const ROWS: usize = 0;
pub(super) const IDS: usize = 1;
pub(super) const WEIGHTS: usize = 2;
pub(super) const BACK: usize = 3;
pub(super) const SLOTS: usize = 4;
pub(super) const COUNTS: usize = 5;
pub(super) const ROW_SCALES: usize = 6;
pub(super) const TOKENS: usize = 7;

/// Over NVLink: where the experts' outputs come home (partial sums, or deterministic mode's
/// slot rows), and the rows each rank sends each rank in the dispatch (`[src · n + dst]`).
struct Returns {
    back: u64,
    slots: u64,
    counts: Vec<usize>,
}

impl DevicePrepareFinalize for All2AllV {
    fn name(&self) -> &'static str {
        "all2allv"
    }

    fn needs_batches(&self, l: &CudaMoeLayer) -> bool {
        all2allv_nvlink::applies_to(l)
    }

    /// The device-planned dispatch over NVLink: its plan and head go out before the host
    /// spends its time on the shared experts' cuBLAS launches.
    fn shared_start(&self, l: &CudaMoeLayer) -> SharedStart {
        match all2allv_nvlink::applies_to(l) {
            true => SharedStart::LaunchedAfterSend,
            false => SharedStart::AfterRouting,
        }
    }

    /// Whole batches over NVLink leave by the copy engines while the routing runs.
    fn send_beside_routing(&self, l: &CudaMoeLayer, b: &mut Buffers, t: usize) -> Result<()> {
        if all2allv_nvlink::applies_to(l) {
            all2allv_nvlink::send_beside_routing(l, b, t)?;
        }
        Ok(())
    }

    fn prepare_begin(&self, l: &CudaMoeLayer, b: &mut Buffers, t: usize, mark: Mark) -> Result<State> {
        let link = l.ep.as_ref().expect("an expert-parallel layer");
        let planned =
            if all2allv_nvlink::applies(l, link) { all2allv_nvlink::prepare_begin(l, b, t, mark)? } else { None };
        link.device_planned.store(planned.is_some(), std::sync::atomic::Ordering::Relaxed);
        if planned.is_none() {
            link.rows_beside_routing.store(false, std::sync::atomic::Ordering::Relaxed);
        }
        if let Some(state) = planned {
            return Ok(state);
        }
        let (h, k) = (l.config.hidden, l.config.top_k);
        let (n, rank) = (link.comm.size(), link.comm.rank());
        let g = &l.gpu;
        let s = &g.stream;
        // Home: each slot's serving replica, the ranks each token goes to (in token order per
        // destination) with its ids local to that rank (-1 for slots served elsewhere), and the
        // slots per physical expert: the one host read of the routing.
        let (ids, _) = l.read_routing(b, t)?;
        let shared = link.placement.shared_replicas(&ids, n, l.opts.replica_min_rows);
        let route = HostRoute::new(&link.placement, &link.route_table, &ids, k, t, &shared);
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
        l.grow_ep_buffers(b, [sent, received, plan.rows, t], n, true)?;
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
        let staged = ep.staging();
        let (send_rows, send_idx, send_ids, send_w) =
            (pb(&staged.send_rows), pi(&ep.send_idx), pi(&ep.send_ids), pf(&staged.send_w));
        let landed = staged.landed(g);
        let counts: Vec<usize> = (0..n * n).map(|i| all[(i / n) * m + np + i % n] as usize).collect();
        let mut state = Plan { route, all, send_tok, recv_tok, received, plan: Some(plan), landed, nvlink: None };
        if let Some(at) = l.nvlink(link, &regions(l, link, &state.all, &counts))? {
            // The rows and weights gathered by token straight into the peers' windows.
            mark(2)?;
            let lanes = [
                Lane {
                    src: pb(&b.x_bf),
                    idx: Some(send_idx),
                    row_bytes: 2 * h,
                    region: ROWS,
                    counts: &counts,
                    live: None,
                },
                Lane { src: send_ids, idx: None, row_bytes: 4 * k, region: IDS, counts: &counts, live: None },
                Lane {
                    src: dptr(&b.weights, g),
                    idx: Some(send_idx),
                    row_bytes: 4 * k,
                    region: WEIGHTS,
                    counts: &counts,
                    live: None,
                },
            ];
            l.exchange_nvlink(link, Exchange::Dispatch, &lanes)?;
            state.landed = Landed { rows: at[ROWS], fp8_scales: None, ids: at[IDS], w: at[WEIGHTS] };
            state.nvlink = Some(Returns { back: at[BACK], slots: at[SLOTS], counts });
            return Ok(Box::new(state));
        }
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
            &state.send_tok,
            &[(landed.rows, 2 * h), (landed.ids, 4 * k), (landed.w, 4 * k)],
            &state.recv_tok,
        )?;
        Ok(Box::new(state))
    }

    fn prepare_finish(
        &self,
        l: &CudaMoeLayer,
        b: &mut Buffers,
        _t: usize,
        pending: State,
        mark: Mark,
    ) -> Result<Dispatched> {
        let pending = match pending.downcast::<DevicePlan>() {
            Ok(p) => return all2allv_nvlink::prepare_finish(l, b, p, mark),
            Err(other) => other,
        };
        let mut p = state_of::<Plan>(pending, self.name())?;
        let plan = p.plan.take().expect("planned in prepare_begin");
        let rows = l.group_received(&l.gpu.stream, b, p.received, plan, Localize::Resolved, p.landed)?;
        mark(3)?;
        let link = l.ep.as_ref().expect("an expert-parallel layer");
        let (h, k, rank) = (l.config.hidden, l.config.top_k, link.comm.rank());
        let row = 2 * h + 8 * k;
        let sent = p.send_tok.iter().enumerate().filter(|&(d, _)| d != rank).map(|(_, &r)| r * row).sum();
        Ok(Dispatched { rows, sent: Sent::Bytes(sent), state: p })
    }

    fn finalize_begin(&self, l: &CudaMoeLayer, b: &mut Buffers, t: usize, d: &mut Dispatched) -> Result<()> {
        if let Some(p) = d.state.downcast_ref::<DevicePlan>() {
            return all2allv_nvlink::finalize_begin(l, b, p);
        }
        let p = d.state.downcast_ref::<Plan>().expect("this strategy's state");
        let link = l.ep.as_ref().expect("an expert-parallel layer");
        let h = l.config.hidden;
        if l.opts.deterministic {
            return return_slots(l, b, t, p, d.rows.y, d.rows.experts);
        }
        l.partial_sums(b, p.received, p.landed)?;
        let staged = b.ep.as_ref().expect("allocated").staging();
        let (part, back) = (dptr(&staged.part, &l.gpu), dptr(&staged.back, &l.gpu));
        if let Some(r) = &p.nvlink {
            // The partial sums go home the way the rows came: the dispatch's counts transposed.
            let n = link.comm.size();
            let back_counts: Vec<usize> = (0..n * n).map(|i| r.counts[(i % n) * n + i / n]).collect();
            let lane = Lane { src: part, idx: None, row_bytes: 2 * h, region: BACK, counts: &back_counts, live: None };
            return l.exchange_nvlink(link, Exchange::Combine, &[lane]);
        }
        l.exchange_rows(link, "moe combine", &[(part, 2 * h)], &p.recv_tok, &[(back, 2 * h)], &p.send_tok)
    }

    fn finalize_finish(&self, l: &CudaMoeLayer, b: &mut Buffers, t: usize, d: Dispatched, mark: Mark) -> Result<()> {
        if let Some(p) = d.state.downcast_ref::<DevicePlan>() {
            return all2allv_nvlink::finalize_finish(l, b, t, p, mark);
        }
        let link = l.ep.as_ref().expect("an expert-parallel layer");
        let g = &l.gpu;
        mark(7)?;
        let p = state_of::<Plan>(d.state, self.name())?;
        let ep = b.ep.as_ref().expect("allocated");
        if l.opts.deterministic {
            if t == 0 {
                return Ok(());
            }
            let back = p.nvlink.as_ref().map_or_else(|| dptr(&ep.staging().back_slots, g), |r| r.slots);
            let slot_row = dptr(&ep.slot_row, g);
            let b2 = l.w.b2_all.as_ref().map_or(0u64, |x| dptr(x, g));
            return l.combine_rows(b, t, back, slot_row, b2);
        }
        let back = p.nvlink.as_ref().map_or_else(|| dptr(&ep.staging().back, g), |r| r.back);
        let home_rows = dptr(&ep.home_rows, g);
        l.sum_home(b, back, home_rows, t, link.comm.size())
    }
}

/// Deterministic mode's return: each served slot's expert row (of `y`, over `experts` local
/// experts), as it is, in the order it goes home (by source rank, token and slot), sent back
/// to its token's rank, where [`All2AllV::finalize_finish`] weights and sums it in slot order
/// with the combine one GPU runs.
fn return_slots(l: &CudaMoeLayer, b: &mut Buffers, t: usize, p: &Plan, y: u64, experts: usize) -> Result<()> {
    let link = l.ep.as_ref().expect("an expert-parallel layer");
    let (h, k, n) = (l.config.hidden, l.config.top_k, link.comm.size());
    let (g, placement, rank) = (&l.gpu, &link.placement, link.comm.rank());
    let s = &g.stream;
    // Rows served here for each source, and rows each destination serves for this rank.
    let served_from: Vec<usize> = (0..n).map(|src| served_by(link, &p.all, rank, src)).collect();
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
    let staged = ep.staging();
    let (ret_idx, ret, back) = (dptr(&staged.ret_idx, g), dptr(&staged.ret, g), dptr(&staged.back_slots, g));
    let (n_slots, el_i, served_i, hi) = ((p.received * k) as i32, experts as i32, served as i32, h as i32);
    // SAFETY: compact_served(int*, int*, int, int, int*) reads the received · k local ids and
    // slot rows and writes `served` row indices.
    unsafe {
        s.launch_builder(&l.k.compact_served)
            .arg(&local_ids)
            .arg(&row_of_slot)
            .arg(&n_slots)
            .arg(&el_i)
            .arg(&ret_idx)
            .launch(LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 })
            .map_err(|e| err("compact_served", e))?;
    }
    if p.nvlink.is_some() {
        // The served rows of y, gathered straight into their home's window: rank r serves
        // rank s the slots of s on r's experts.
        let counts: Vec<usize> = (0..n * n).map(|i| served_by(link, &p.all, i / n, i % n)).collect();
        let lane = Lane { src: y, idx: Some(ret_idx), row_bytes: 2 * h, region: SLOTS, counts: &counts, live: None };
        return l.exchange_nvlink(link, Exchange::Combine, &[lane]);
    }
    // SAFETY: take_rows copies the `served` rows of y (h wide) named by ret_idx into `ret`,
    // which holds the plan's rows ≥ served rows.
    unsafe {
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

/// Slots rank `server` serves for rank `src`: `src`'s slots on `server`'s experts (`all` holds
/// every rank's slots per physical expert, then its tokens per destination).
fn served_by(link: &EpLink, all: &[i32], server: usize, src: usize) -> usize {
    let placement = &link.placement;
    let m = placement.num_physical() + link.comm.size();
    let first: usize = (0..server).map(|r| placement.local_experts(r).len()).sum();
    (first..first + placement.local_experts(server).len()).map(|phys| all[src * m + phys] as usize).sum()
}

/// The NVLink window's region sizes in bytes, the same on every rank (from every rank's
/// counts): the token rows, ids and weights the busiest receiver gets, the partial sums the
/// busiest sender gets back, and in deterministic mode the slot rows of the largest batch.
fn regions(l: &CudaMoeLayer, link: &EpLink, all: &[i32], counts: &[usize]) -> [usize; 8] {
    let (h, k, n) = (l.config.hidden, l.config.top_k, link.comm.size());
    let np = link.placement.num_physical();
    let received = (0..n).map(|d| (0..n).map(|s| counts[s * n + d]).sum::<usize>()).max().unwrap_or(0);
    let sent = (0..n).map(|s| counts[s * n..(s + 1) * n].iter().sum::<usize>()).max().unwrap_or(0);
    let slots = match l.opts.deterministic {
        true => {
            (0..n).map(|r| all[r * (np + n)..r * (np + n) + np].iter().map(|&c| c as usize).sum()).max().unwrap_or(0)
        }
        false => 0,
    };
    regions_of(h, k, n, [received, received, received, sent, slots, 0, 0])
}

/// The window's regions in bytes for `rows` = [token rows (bf16, or fp8 codes), their ids,
/// their weights, returned sums, returned slot rows, the fp8 token rows' scales, the token rows'
/// positions in their home batch] of hidden size `h` and `k` slots, and a count from each of
/// `n` ranks.
pub(super) fn regions_of(h: usize, k: usize, n: usize, rows: [usize; 7]) -> [usize; 8] {
    let [x, ids, w, back, slots, scales, tokens] = rows;
    [x * 2 * h, ids * 4 * k, w * 4 * k, back * 2 * h, slots * 2 * h, 4 * n, scales * 4 * h.div_ceil(128), 4 * tokens]
}
