//! All-to-all-v over the NVLink transport with its plan made on the device: no read of the
//! routing back to the host, and the receivers learn their row counts from peer memory.
//!
//! The ranks first all-gather their batch sizes, before the routing (one small host read,
//! the only one, which waits for that exchange and not for the routing), which fixes every
//! buffer and window region: a receiver's window holds rank `s`'s rows from row
//! `starts[s]` = the batches of the ranks before `s`, room for all of `s`'s tokens. Then, on
//! the device: a thread per token finds where its slots are served, then another plans its
//! dispatch (`nvl_plan` in nvlink.cu: the token's position among those sent to each rank, in
//! token order, with its ids local there). A first push (the head) copies each token's ids
//! once to each such rank, and this rank's counts to every rank; a second copies the rows
//! (fp8 codes and their scales for W8A8 experts on the fp8 GEMM, quantized once at home) and
//! weights the same way, with only as many rows as the plan counted. While the rows cross the
//! link, the receiver marks the rows no rank sent as served elsewhere and groups the slots by
//! local expert on a side stream; then it runs the Hopper GEMM, which reads the experts' sizes
//! on the device and gathers the rows from the window itself (the permute fused into its
//! loads).
//!
//! Where nearly every token reaches every rank ([`CudaOptions::copies_whole_batches`]), the
//! plan gives every token its own position on every rank and the copy engines move the whole
//! batch as it lies, with no SMs; the weights then go in the head, and a push of no rows raises
//! the flags. Whole batches of bf16 tokens leave beside the routing ([`send_beside_routing`]).
//!
//! The kernel that sums each token's slots served here writes the sum straight into its
//! home's window, in the room its home left for this rank (no staging rows, no push); home
//! sums them in rank order, as the host-planned all-to-all-v does. In deterministic mode the
//! down projection itself stores each served slot's expert row into the row of that (token,
//! slot) in its home's window, so the rows cross the link under the GEMM, and home weights and
//! sums the slots in slot order as one GPU does; where the batch does not cross whole, each
//! token row carries its position in its home batch (in the head).
//!
//! [`CudaOptions::copies_whole_batches`]: crate::backend::cuda_options::CudaOptions::copies_whole_batches

use super::all2allv::{regions_of, BACK, COUNTS, IDS, ROWS, ROW_SCALES, SLOTS, TOKENS, WEIGHTS};
use super::{Dispatched, Mark, Sent, State};
use crate::backend::cuda::layer::combine::per_token;
use crate::backend::cuda::layer::expert_parallel::{EpLink, Landed, LocalPlan, Localize};
use crate::backend::cuda::layer::experts::ExpertRows;
use crate::backend::cuda::layer::nvlink::{CopyLane, Exchange, Lane};
use crate::backend::cuda::layer::{dptr, err, grid, Buffers, CudaMoeLayer};
use crate::comm::Communicator;
use crate::error::Result;
use cudarc::driver::{LaunchConfig, PushKernelArg};

/// The most ranks the device plan takes (a token's destinations are a 32-bit mask).
const MAX_RANKS: usize = 32;

// The plan's head (the ranks' starts and counts, and the batch) goes to the device in one
// `write_ints` launch.
const _: () = assert!(2 * MAX_RANKS + 2 <= super::super::host_ints::HOST_INTS);

/// Threads of a block of the plan (`NVL_PLAN_THREADS` in nvlink.cu), a token each.
const PLAN_THREADS: usize = 256;

/// What the halves share.
pub(super) struct DevicePlan {
    /// The largest rank's batch.
    most: usize,
    landed: Landed,
    /// The window's regions of the returned sums (deterministic mode: of the returned slot
    /// rows) and of the counts every rank sent here.
    back: u64,
    counts: u64,
    /// Deterministic mode: where the received token rows' positions in their home batch
    /// landed (`None` for whole batches, whose rows keep their positions).
    tokens: Option<u64>,
    /// The slots served here grouped by local expert, taken by `prepare_finish`.
    rows: Option<ExpertRows>,
}

/// Whether `l` dispatches this way: the Hopper GEMM (bf16) or the fp8 Hopper GEMM (W8A8, not
/// in deterministic mode) for its experts, at most [`MAX_RANKS`] ranks, and a link that is not
/// (yet) known to move rows over NCCL. The same on every rank.
pub(super) fn applies(l: &CudaMoeLayer, link: &EpLink) -> bool {
    l.opts.device_plan
        && !(rows_home_from_gemm(l) && l.hopper_fp8_runs())
        && link.comm.size() <= MAX_RANKS
        && l.device_planned_experts().is_some()
        && link.transport_name() != "nccl"
}

/// Whether this dispatch's down projection stores each served slot's expert row straight into
/// its home's window, where home weights and sums the slots in slot order (deterministic mode),
/// rather than a kernel after it sending home one sum a (token, rank).
pub(in crate::backend::cuda::layer) fn rows_home_from_gemm(l: &CudaMoeLayer) -> bool {
    l.opts.deterministic
}

/// [`applies`] to `l`'s link, where `l` is expert-parallel.
pub(super) fn applies_to(l: &CudaMoeLayer) -> bool {
    l.ep.as_ref().is_some_and(|link| applies(l, link))
}

/// Every rank's batch this call and the window's regions, which hold them all.
struct Window {
    /// Every rank's batch.
    tokens: Vec<usize>,
    /// Where each rank's rows start in a receiver's regions (n + 1).
    starts: Vec<usize>,
    /// Where each region starts in this rank's window.
    at: Vec<u64>,
}

/// Every rank's batch and the window (opened or grown as they need); `None` when the link
/// turned out to move rows over NCCL. Collective where it opens a window.
fn window(l: &CudaMoeLayer, b: &mut Buffers, link: &EpLink, t: usize) -> Result<Option<Window>> {
    let (h, k, n) = (l.config.hidden, l.config.top_k, link.comm.size());
    let tokens = l.batches(b, link, t)?;
    let mut starts = vec![0usize; n + 1];
    for (r, &x) in tokens.iter().enumerate() {
        starts[r + 1] = starts[r] + x;
    }
    let received = starts[n];
    let most = tokens.iter().copied().max().unwrap_or(0);
    // fp8 experts on the fp8 GEMM take the tokens as fp8 codes with their scales: quantized
    // once at home, they cross the link at their byte size.
    let scale_rows = if l.hopper_fp8_runs() { received } else { 0 };
    // Room in every receiver's window for every rank's whole batch, and at home for a sum from
    // every rank for each token (deterministic mode: a row for each of its slots, and the
    // received rows' home positions).
    let (back, slots, positions) = match rows_home_from_gemm(l) {
        true => (0, most * k, received),
        false => (n * most, 0, 0),
    };
    let regions = regions_of(h, k, n, [received, received, received, back, slots, scale_rows, positions]);
    Ok(l.nvlink(link, &regions)?.map(|at| Window { tokens, starts, at }))
}

/// Whether this call sends whole batches by the copy engines (the same on every rank).
fn sends_whole(l: &CudaMoeLayer, link: &EpLink) -> bool {
    l.opts.copies_whole_batches(link.comm.size(), l.config.top_k)
}

/// Whole batches of bf16 tokens that are in place before the routing (they came in as bf16)
/// leave beside it: the copy engines move them into every rank's window on the copies' side
/// stream (this rank's own share on the shared experts' stream), both taken up from the
/// layer's stream before the routing ([`CudaMoeLayer::share_batches`]); the layer's stream
/// waits for the own share at once (it ends long before the routing does) and for the peers'
/// before the rows' exchange raises its flags (the head goes ahead of them). Every rank that
/// sends whole batches opens the window here, even where its own rows wait for the dispatch,
/// so that the collective opening stays in step. Collective where it opens a window.
pub(super) fn send_beside_routing(l: &CudaMoeLayer, b: &mut Buffers, t: usize) -> Result<()> {
    let link = l.ep.as_ref().expect("an expert-parallel layer");
    if l.hopper_fp8_runs() || !sends_whole(l, link) {
        return Ok(());
    }
    let Some(w) = window(l, b, link, t)? else { return Ok(()) };
    if !b.tokens_bf16 || t == 0 {
        return Ok(());
    }
    let n = link.comm.size();
    let room: Vec<usize> = (0..n * n).map(|i| w.tokens[i / n]).collect();
    let rows = [CopyLane { src: dptr(&b.x_bf, &l.gpu), row_bytes: 2 * l.config.hidden, region: ROWS, counts: &room }];
    let (peers, own) = (l.side.copies(), l.side.shared());
    l.side.after_tokens_in(peers)?;
    l.copy_to_windows(link, &rows, &peers.stream, &own.stream)?;
    l.side.join(&l.gpu.stream, [own])?;
    b.rows_sent_early = true;
    Ok(())
}

/// Plans the dispatch on the device and pushes the rows (marks 2); `None` when the link turned
/// out to move rows over NCCL (no window opened), so the host plans it instead. Collective.
pub(super) fn prepare_begin(l: &CudaMoeLayer, b: &mut Buffers, t: usize, mark: Mark) -> Result<Option<State>> {
    let link = l.ep.as_ref().expect("an expert-parallel layer");
    let c = &l.config;
    let (h, k) = (c.hidden, c.top_k);
    let (n, el) = (link.comm.size(), link.local);
    let g = &l.gpu;
    let s = &g.stream;
    let Some(Window { tokens, starts, at }) = window(l, b, link, t)? else { return Ok(None) };
    let received = starts[n];
    let most = tokens.iter().copied().max().unwrap_or(0);
    let fp8 = l.hopper_fp8_runs();
    // Whole batches by the copy engines, or the rows each rank serves by the push kernel.
    let whole = sends_whole(l, link);
    l.grow_ep_buffers(b, [n * t, received, received * k.min(el), t], n, false)?;
    let ep = b.ep.as_mut().expect("allocated");
    let plan = dptr(&ep.plan, g);
    // The plan's device array: where each rank's rows start, then the rows this rank sent.
    let (plan_starts, sent) = (plan, plan + 4 * (n as u64 + 1));
    let mut head: Vec<i32> = starts.iter().map(|&x| x as i32).collect();
    head.extend(std::iter::repeat_n(0, n));
    head.push(t as i32);
    l.write_ints(s, plan, &head)?;
    let (send_idx, send_ids, home_rows) = (dptr(&ep.send_idx, g), dptr(&ep.send_ids, g), dptr(&ep.home_rows, g));
    let (ids, weights, x) = (dptr(&b.ids, g), dptr(&b.weights, g), dptr(&b.x_bf, g));
    if t > 0 {
        let tables = link.tables.as_ref().expect("uploaded when the layer was assembled");
        let tp = tables.ptrs(g);
        let (ti, ki, ni, whole_i) = (t as i32, k as i32, n as i32, whole as i32);
        // `sent + 4 n` holds this batch's size for the count.
        let shared = l.replica_shares(tables, ids, sent + 4 * n as u64, n)?;
        let (dest, ranks) = (dptr(&ep.dest, g), dptr(&ep.ranks, g));
        let slot_row = if rows_home_from_gemm(l) { dptr(&ep.slot_row, g) } else { 0u64 };
        // SAFETY: nvl_plan_slots(int*, int, int, int* x5, int*, unsigned*, int*) over the t · k
        // ids into dest and slot_row (t · k ints; deterministic layers' buffers hold them, and
        // slot_row is null otherwise) and ranks (t); the tables cover every expert, and
        // `shared` (when not null) too. nvl_plan(int*, unsigned*, int, int, int, int, int*,
        // int*, int*, int*) from them, a thread per token: send_idx and send_ids hold n · t rows
        // (of 1 and k ints), home_rows t · n ints, `sent` n ints; n <= MAX_RANKS = 32.
        unsafe {
            let mut p = s.launch_builder(&l.k.nvl_plan_slots);
            p.arg(&ids).arg(&ti).arg(&ki);
            p.arg(&tp[0]).arg(&tp[1]).arg(&tp[2]).arg(&tp[3]).arg(&shared).arg(&dest).arg(&ranks).arg(&slot_row);
            p.launch(grid(t)).map_err(|e| err("nvl_plan_slots", e))?;
            let mut p = s.launch_builder(&l.k.nvl_plan);
            p.arg(&dest).arg(&ranks).arg(&ti).arg(&ki).arg(&ni).arg(&whole_i);
            p.arg(&send_idx).arg(&send_ids).arg(&home_rows).arg(&sent);
            p.launch(LaunchConfig {
                grid_dim: (t.div_ceil(PLAN_THREADS) as u32, 1, 1),
                block_dim: (PLAN_THREADS as u32, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(|e| err("nvl_plan", e))?;
    }
    mark(2)?;
    // Room from rank s to any rank: s's batch; this rank's counts: one int to each.
    let room: Vec<usize> = (0..n * n).map(|i| tokens[i / n]).collect();
    let one = vec![1usize; n * n];
    let counted = |src, idx, row_bytes, region| Lane { src, idx, row_bytes, region, counts: &room, live: Some(sent) };
    // The token rows: (source, bytes a row, region).
    let token_rows = if fp8 {
        // Their transfer ends before the layer's stream reaches the experts (which join the
        // grouping's stream, where a copy takes this rank's own share), so it reads the codes
        // before anything requantizes into these buffers.
        let mut rows = l.fp8_rows.lock().unwrap_or_else(|p| p.into_inner());
        let q = l.quantize_rows_fp8(&mut rows.input, x, t, h, 0, 0)?;
        vec![(dptr(&q.codes, g), h, ROWS), (dptr(&q.scales, g), 4 * h.div_ceil(128), ROW_SCALES)]
    } else {
        vec![(x, 2 * h, ROWS)]
    };
    // The head goes first, the ids and counts (and, with whole batches, the weights): each
    // receiver groups its slots by local expert on a side stream while the rows cross the
    // link, off the dispatch's critical path.
    let mut head = vec![
        counted(send_ids, None, 4 * k, IDS),
        Lane { src: sent, idx: None, row_bytes: 4, region: COUNTS, counts: &one, live: None },
    ];
    let weights = counted(weights, Some(send_idx), 4 * k, WEIGHTS);
    if whole {
        head.push(weights);
    }
    // Deterministic mode's slot rows come home to their token's rows: the receiver learns
    // where each token row came from (whole batches keep their positions).
    let slot_rows = rows_home_from_gemm(l);
    if slot_rows && !whole {
        head.push(counted(send_idx, None, 4, TOKENS));
    }
    let side = l.side.grouping();
    let imp = l.device_planned_experts().expect("checked by `applies`");
    let early = std::mem::take(&mut b.rows_sent_early);
    link.rows_beside_routing.store(early, std::sync::atomic::Ordering::Relaxed);
    // The rows sent beside the routing land before the flags of the rows' exchange; where the
    // grouping copies rows (experts that do not gather them), before the head's.
    if early && !imp.gathers_rows(l, 0) {
        l.side.join(s, [l.side.copies()])?;
    }
    l.exchange_nvlink(link, Exchange::DispatchHead, &head)?;
    l.side.fork(s, [side])?;
    // The rows are enqueued before the grouping's launches, so that they follow the head on
    // the device without waiting for the host: whole batches as they lie (this rank's own
    // copy on the grouping's stream, beside the peers'), unless they left beside the routing,
    // then a push of no rows that raises the flags their receivers wait for; else the rows
    // each rank serves. Every rank runs the same two exchanges either way.
    if whole {
        if early {
            l.side.join(s, [l.side.copies()])?;
        } else {
            let copies: Vec<CopyLane> = token_rows
                .iter()
                .map(|&(src, row_bytes, region)| CopyLane { src, row_bytes, region, counts: &room })
                .collect();
            l.copy_to_windows(link, &copies, s, &side.stream)?;
        }
        l.exchange_nvlink(link, Exchange::Dispatch, &[])?;
    } else {
        let mut lanes = vec![weights];
        lanes
            .extend(token_rows.iter().map(|&(src, row_bytes, region)| counted(src, Some(send_idx), row_bytes, region)));
        l.exchange_nvlink(link, Exchange::Dispatch, &lanes)?;
    }
    let fp8_scales = fp8.then_some(at[ROW_SCALES]);
    let landed = Landed { rows: at[ROWS], fp8_scales, ids: at[IDS], w: at[WEIGHTS] };
    let plan = LocalPlan { imp, cap: 0, rows: received * k.min(el), groups: Vec::new() };
    let localize = Localize::Landed { counts: at[COUNTS], starts: plan_starts };
    let rows = l.group_received(&side.stream, b, received, plan, localize, landed)?;
    let back = at[if slot_rows { SLOTS } else { BACK }];
    let tokens = (slot_rows && !whole).then_some(at[TOKENS]);
    let state = DevicePlan { most, landed, back, counts: at[COUNTS], tokens, rows: Some(rows) };
    Ok(Some(Box::new(state)))
}

/// Waits for the grouping of the slots served here (begun by `prepare_begin` beside the
/// rows' push) and hands the grouped rows to the experts (marks 3).
pub(super) fn prepare_finish(
    l: &CudaMoeLayer,
    b: &mut Buffers,
    mut p: Box<DevicePlan>,
    mark: Mark,
) -> Result<Dispatched> {
    let link = l.ep.as_ref().expect("an expert-parallel layer");
    let (h, k) = (l.config.hidden, l.config.top_k);
    l.side.join(&l.gpu.stream, [l.side.grouping()])?;
    let mut rows = p.rows.take().expect("grouped by prepare_begin");
    if rows_home_from_gemm(l) {
        rows.y_rows = Some(slot_addresses(l, b, &p)?);
    }
    mark(3)?;
    // The plan's device array: where each rank's rows start, then the rows this rank sent.
    let starts = dptr(&b.ep.as_ref().expect("allocated").plan, &l.gpu);
    let row_bytes = match p.landed.fp8_scales {
        Some(_) => h + 4 * h.div_ceil(128) + 8 * k,
        None => 2 * h + 8 * k,
    };
    let sent = Sent::Counted { rows: starts + 4 * (link.comm.size() as u64 + 1), row_bytes };
    Ok(Dispatched { rows, sent, state: p })
}

/// The weighted sums over the slots served here, written home by the kernel that sums them
/// (`nvl_combine_push`): to each rank as many rows as it sent, into the room it left for this
/// rank; the kernel then waits until every rank's sums for this rank's tokens have landed.
/// In deterministic mode the down projection has stored the slots' expert rows at home
/// already ([`slot_addresses`]): an exchange of no rows raises the flags and waits for every
/// rank's.
pub(super) fn finalize_begin(l: &CudaMoeLayer, b: &mut Buffers, p: &DevicePlan) -> Result<()> {
    let link = l.ep.as_ref().expect("an expert-parallel layer");
    if rows_home_from_gemm(l) {
        return l.exchange_nvlink(link, Exchange::Combine, &[]);
    }
    let (h, k) = (l.config.hidden, l.config.top_k);
    let (n, rank) = (link.comm.size() as i32, link.comm.rank() as i32);
    let g = &l.gpu;
    let ep = b.ep.as_ref().expect("allocated");
    let (y, local_ids, row_of_slot) = (dptr(&ep.y, g), dptr(&ep.local_ids, g), dptr(&ep.row_of_slot, g));
    let b2 = l.w.b2.as_ref().map_or(0u64, |x| dptr(x, g));
    // The plan's device array starts with where each rank's rows start (n + 1 ints).
    let starts = dptr(&ep.plan, g);
    let (ki, hi, back) = (k as i32, h as i32, BACK as i32);
    l.write_window(link, 1, |w| {
        // SAFETY: nvl_combine_push(bf16*, float*, int*, float*, int*, int, int, int*, int*, int,
        // int, u64*, int, int, u64**, int, u64*, unsigned*, NvlWait) over the received rows,
        // grouped by `group_received` (rank s's from starts[s], at most its batch); rank s's
        // sums land in region BACK of its window, which holds n times its batch (`regions_of`
        // above); the flags, counters and wait are the link's (see WindowWrite).
        unsafe {
            let mut c = g.stream.launch_builder(&l.k.nvl_combine_push);
            c.arg(&y).arg(&b2).arg(&local_ids).arg(&p.landed.w).arg(&row_of_slot).arg(&ki).arg(&hi);
            c.arg(&starts).arg(&p.counts).arg(&n).arg(&rank).arg(&w.regions).arg(&w.nregions).arg(&back);
            c.arg(&w.flags).arg(&w.nflags).arg(&w.sent).arg(&w.done).arg(&w.wait);
            c.launch(per_token(n as usize * p.most, h))
        }
        .map(|_| ())
        .map_err(|e| err("nvl_combine_push", e))
    })
}

/// Deterministic mode: where the down projection stores each of its rows, the row of its
/// (token, slot) in its home's window (`nvl_slot_addresses`), in `ep.y_rows`.
fn slot_addresses(l: &CudaMoeLayer, b: &Buffers, p: &DevicePlan) -> Result<u64> {
    let link = l.ep.as_ref().expect("an expert-parallel layer");
    let (h, k, n) = (l.config.hidden, l.config.top_k, link.comm.size());
    let g = &l.gpu;
    let ep = b.ep.as_ref().expect("allocated");
    let (row_of_slot, out) = (dptr(&ep.row_of_slot, g), dptr(&ep.y_rows, g));
    let (regions, nregions) = l.window_regions(link)?;
    let tokens = p.tokens.unwrap_or(0);
    // The plan's device array starts with where each rank's rows start (n + 1 ints).
    let starts = dptr(&ep.plan, g);
    let (ki, hi, ni, slots) = (k as i32, h as i32, n as i32, SLOTS as i32);
    // SAFETY: nvl_slot_addresses(int*, int*, int, int, int*, int*, int, u64*, int, int, u64*)
    // over the received slots, grouped by `group_received` (rank s's rows from starts[s], at
    // most its batch, with their home positions in `tokens` when not null): each served slot's
    // grouped row gets an address in region SLOTS of its home's window, which holds k rows for
    // each token of the largest batch (`window` above); `y_rows` holds the grouped rows.
    unsafe {
        let mut c = g.stream.launch_builder(&l.k.nvl_slot_addresses);
        c.arg(&row_of_slot).arg(&tokens).arg(&ki).arg(&hi);
        c.arg(&starts).arg(&p.counts).arg(&ni).arg(&regions).arg(&nregions).arg(&slots).arg(&out);
        c.launch(grid(n * p.most * k))
    }
    .map_err(|e| err("nvl_slot_addresses", e))?;
    Ok(out)
}

/// Sums each token's returned rows in rank order into `b.out` (marks 7); in deterministic
/// mode weights and sums its returned slot rows in slot order, as one GPU does.
pub(super) fn finalize_finish(l: &CudaMoeLayer, b: &mut Buffers, t: usize, p: &DevicePlan, mark: Mark) -> Result<()> {
    let link = l.ep.as_ref().expect("an expert-parallel layer");
    mark(7)?;
    let ep = b.ep.as_ref().expect("allocated");
    if rows_home_from_gemm(l) {
        if t == 0 {
            return Ok(());
        }
        let b2 = l.w.b2_all.as_ref().map_or(0u64, |x| dptr(x, &l.gpu));
        return l.combine_rows(b, t, p.back, dptr(&ep.slot_row, &l.gpu), b2);
    }
    l.sum_home(b, p.back, dptr(&ep.home_rows, &l.gpu), t, link.comm.size())
}

#[cfg(test)]
mod tests {
    use crate::backend::cuda::kernel_define;

    /// The plan's block mirrors nvlink.cu's.
    #[test]
    fn plan_constants_mirror_nvlink_cu() {
        assert_eq!(kernel_define("NVL_PLAN_THREADS"), Some(super::PLAN_THREADS as i64));
    }
}
