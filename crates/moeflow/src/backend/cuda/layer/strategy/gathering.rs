//! What the gathering strategies share ([`super::AllGather`], [`super::AllGatherLogits`],
//! [`super::Multicast`]): every rank receives every rank's token rows with their routing (each
//! batch padded to the largest), runs its own experts on all of them, and the ranks' partial
//! outputs are summed back. No per-destination lists are built, at the price of moving every
//! row to every rank: the naive strategies, simplest where batches are small or most tokens go
//! to most ranks. Each rank's partial output of a token is its slots' weighted sum in slot
//! order (zeros when it holds none of them), as in all-to-all-v; the collectives add the
//! ranks' bf16 partials in NCCL's fixed order, so runs repeat exactly.

use super::{state_of, DevicePrepareFinalize, Dispatched, Mark, Sent, State};
use crate::backend::cuda::layer::expert_parallel::{LocalPlan, Localize};
use crate::backend::cuda::layer::{dptr, err, Buffers, CudaMoeLayer};
use crate::comm::Communicator;
use crate::error::Result;
use cudarc::driver::CudaSlice;
use cudarc::nccl::sys as nc;

/// The collectives one gathering strategy moves its rows with (by default all-gather out,
/// reduce-scatter back); [`DevicePrepareFinalize`] comes with them.
pub(in crate::backend::cuda::layer) trait GatherForm: Send + Sync {
    /// Name on the command line.
    const NAME: &'static str;
    /// Router logits travel in place of ids and weights, and every rank routes every token.
    const LOGITS: bool = false;

    /// Enqueues on `cs`: `bytes` at `src` on each of the `n` ranks into `dst`, rank `r`'s at
    /// `dst + r · bytes`.
    fn gather(
        src: u64,
        dst: u64,
        bytes: usize,
        _n: usize,
        comm: nc::ncclComm_t,
        cs: nc::cudaStream_t,
    ) -> nc::ncclResult_t {
        // SAFETY: `bytes` from every rank into n · bytes at `dst` (root r's at r · bytes); the
        // buffers were sized for the group's largest batch.
        unsafe { nc::ncclAllGather(src as _, dst as _, bytes, nc::ncclDataType_t::ncclUint8, comm, cs) }
    }

    /// Where this rank's `rows` summed rows of `h` land: `back`, or inside `part`.
    fn landing(_part: u64, back: u64, _rows: usize, _h: usize, _rank: usize) -> u64 {
        back
    }

    /// Enqueues on `cs` the sum over the `n` ranks of the `n · rows` bf16 rows of `h` at
    /// `part`, this rank's `rows` sums landing where [`GatherForm::landing`] says.
    fn sum(
        part: u64,
        back: u64,
        rows: usize,
        h: usize,
        _n: usize,
        comm: nc::ncclComm_t,
        cs: nc::cudaStream_t,
    ) -> nc::ncclResult_t {
        let (bf16, sum) = (nc::ncclDataType_t::ncclBfloat16, nc::ncclRedOp_t::ncclSum);
        // SAFETY: n · rows bf16 rows of h in; this rank's rows out, into `back`, sized for them.
        unsafe { nc::ncclReduceScatter(part as _, back as _, rows * h, bf16, sum, comm, cs) }
    }
}

/// What the halves share.
struct Plan {
    /// The largest batch of the group, and the tokens received (`ranks · t_max`).
    t_max: usize,
    received: usize,
    /// Every rank's slots per physical expert and batch size.
    all: Vec<i32>,
    plan: Option<LocalPlan>,
    /// Where this rank's summed rows land.
    landed: u64,
    /// The device flags of whose replicas share each rank's batch (0: every expert's).
    shares: u64,
}

impl<G: GatherForm> DevicePrepareFinalize for G {
    fn name(&self) -> &'static str {
        G::NAME
    }

    fn prepare_begin(&self, l: &CudaMoeLayer, b: &mut Buffers, t: usize, mark: Mark) -> Result<State> {
        let c = &l.config;
        let (h, e, k) = (c.hidden, c.num_experts, c.top_k);
        let link = l.ep.as_ref().expect("an expert-parallel layer");
        let (n, el) = (link.comm.size(), link.local);
        let g = &l.gpu;
        let s = &g.stream;
        // Every rank's slots per physical expert (the placement's rule picks each slot's
        // replica from its token's index in its rank's batch and whether the expert's replicas
        // share it) and batch size: this rank's experts' rows, the padding.
        let (ids, _) = l.read_routing(b, t)?;
        let p = &link.placement;
        let (np, min_rows) = (p.num_physical(), l.opts.replica_min_rows);
        let shared = p.shared_replicas(&ids, n, min_rows);
        let mut mine = vec![0i32; np + 1];
        for (i, &id) in ids.iter().enumerate() {
            mine[p.replica_of(id as usize, i / k, i % k, shared[id as usize])] += 1;
        }
        mine[np] = t as i32;
        let all = l.gather_counts(b, link, &mine)?;
        let m = np + 1;
        let t_max = (0..n).map(|r| all[r * m + np] as usize).max().unwrap_or(0);
        // Which experts' replicas share each rank's batch, for the receivers' kernel.
        let tables = link.tables.as_ref().expect("uploaded when the layer was assembled");
        let shares = if tables.needs_shares(min_rows) && t_max > 0 {
            let flags: Vec<i32> =
                (0..n).flat_map(|r| p.shared_by_served(&all[r * m..r * m + np], n, min_rows)).map(i32::from).collect();
            let dst = dptr(&tables.shared, g);
            // SAFETY: n · E flags into the table's [ranks, E] scratch, on the layer's stream
            // (every earlier reader of it is ordered before); from pageable memory, the call
            // returns once the flags are staged.
            unsafe { cudarc::driver::result::memcpy_htod_async(dst, &flags, s.cu_stream()) }
                .map_err(|e| err("upload", e))?;
            dst
        } else {
            0
        };
        let local: Vec<usize> =
            (0..el).map(|j| (0..n).map(|r| all[r * m + link.phys_first + j] as usize).sum()).collect();
        let plan = l.local_plan(&local);
        let received = n * t_max;
        l.grow_ep_buffers(b, [t_max, received, plan.rows, t], n, true)?;
        mark(2)?;
        let state = Box::new(Plan { t_max, received, all, plan: Some(plan), landed: 0, shares });
        if t_max == 0 {
            // No rank has tokens: nothing to move, every later stage empty.
            return Ok(state);
        }
        let ep = b.ep.as_mut().expect("allocated");
        let (pi, pf, pb) =
            (|x: &CudaSlice<i32>| dptr(x, g), |x: &CudaSlice<f32>| dptr(x, g), |x: &CudaSlice<u16>| dptr(x, g));
        // This rank's batch, padded to t_max tokens of zeros with no expert (id -1): rows with
        // ids and weights, or rows with router logits.
        let staged = ep.staging();
        let (send_rows, send_ids, send_w) = (pb(&staged.send_rows), pi(&ep.send_ids), pf(&staged.send_w));
        let (recv_rows, recv_ids, recv_w) = (pb(&staged.recv_rows), pi(&staged.recv_ids), pf(&staged.recv_w));
        let (send_logits, recv_logits) = (pf(&staged.send_logits), pf(&staged.recv_logits));
        let (own, gathered) = if G::LOGITS {
            (
                vec![(pb(&b.x_bf), send_rows, 2 * h, 0u8), (pf(&b.logits), send_logits, 4 * e, 0)],
                vec![(send_rows, recv_rows, 2 * h), (send_logits, recv_logits, 4 * e)],
            )
        } else {
            (
                vec![
                    (pb(&b.x_bf), send_rows, 2 * h, 0u8),
                    (pi(&b.ids), send_ids, 4 * k, 0xff),
                    (pf(&b.weights), send_w, 4 * k, 0),
                ],
                vec![(send_rows, recv_rows, 2 * h), (send_ids, recv_ids, 4 * k), (send_w, recv_w, 4 * k)],
            )
        };
        for (src, dst, width, pad) in own {
            // SAFETY: the send buffers hold t_max rows of `width` bytes (t ≤ t_max); the
            // sources hold this batch's t rows; both on the layer's stream.
            unsafe {
                if t > 0 {
                    cudarc::driver::result::memcpy_dtod_async(dst, src, t * width, s.cu_stream())
                        .map_err(|e| err("staging the gather", e))?;
                }
                if t < t_max {
                    cudarc::driver::result::memset_d8_async(
                        dst + (t * width) as u64,
                        pad,
                        (t_max - t) * width,
                        s.cu_stream(),
                    )
                    .map_err(|e| err("padding the gather", e))?;
                }
            }
        }
        link.comm.enqueue("moe gather", s, |comm, cs| {
            for (src, dst, width) in gathered {
                let r = G::gather(src, dst, t_max * width, n, comm, cs);
                if r != nc::ncclResult_t::ncclSuccess {
                    return r;
                }
            }
            nc::ncclResult_t::ncclSuccess
        })?;
        Ok(state)
    }

    fn prepare_finish(
        &self,
        l: &CudaMoeLayer,
        b: &mut Buffers,
        _t: usize,
        pending: State,
        mark: Mark,
    ) -> Result<Dispatched> {
        let mut p = state_of::<Plan>(pending, G::NAME)?;
        let c = &l.config;
        let (h, e, k) = (c.hidden, c.num_experts, c.top_k);
        let link = l.ep.as_ref().expect("an expert-parallel layer");
        let (n, np) = (link.comm.size(), link.placement.num_physical());
        let (t_max, received) = (p.t_max, p.received);
        let s = &l.gpu.stream;
        if G::LOGITS && t_max > 0 {
            let staged = b.ep.as_ref().expect("allocated").staging();
            let (recv_logits, recv_ids, recv_w) =
                (dptr(&staged.recv_logits, &l.gpu), dptr(&staged.recv_ids, &l.gpu), dptr(&staged.recv_w, &l.gpu));
            // Every token routed here, then the padding's choices dropped (id -1).
            l.top_k(recv_logits, received, recv_ids, recv_w)?;
            for r in 0..n {
                let tr = p.all[r * (np + 1) + np] as usize;
                if tr < t_max {
                    let at = recv_ids + (4 * k * (r * t_max + tr)) as u64;
                    // SAFETY: rows tr .. t_max of rank r's block of the n · t_max · k ids.
                    unsafe { cudarc::driver::result::memset_d8_async(at, 0xff, 4 * k * (t_max - tr), s.cu_stream()) }
                        .map_err(|e| err("dropping the padding", e))?;
                }
            }
        }
        let plan = p.plan.take().expect("planned in prepare_begin");
        let at = b.ep.as_ref().expect("allocated").staging().landed(&l.gpu);
        let rows = l.group_received(
            &l.gpu.stream,
            b,
            received,
            plan,
            Localize::Placed { period: t_max, shared: p.shares },
            at,
        )?;
        mark(3)?;
        let row = if G::LOGITS { 2 * h + 4 * e } else { 2 * h + 8 * k };
        Ok(Dispatched { rows, sent: Sent::Bytes((n - 1) * t_max * row), state: p })
    }

    fn finalize_begin(&self, l: &CudaMoeLayer, b: &mut Buffers, _t: usize, d: &mut Dispatched) -> Result<()> {
        let p = d.state.downcast_mut::<Plan>().expect("this strategy's state");
        if p.t_max == 0 {
            return Ok(());
        }
        let link = l.ep.as_ref().expect("an expert-parallel layer");
        let (h, n, rank) = (l.config.hidden, link.comm.size(), link.comm.rank());
        l.partial_sums(b, p.received, b.ep.as_ref().expect("allocated").staging().landed(&l.gpu))?;
        let ep = b.ep.as_ref().expect("allocated");
        let staged = ep.staging();
        let (part, back, t_max) = (dptr(&staged.part, &l.gpu), dptr(&staged.back, &l.gpu), p.t_max);
        p.landed = G::landing(part, back, t_max, h, rank);
        link.comm.enqueue("moe sum", &l.gpu.stream, |comm, cs| G::sum(part, back, t_max, h, n, comm, cs))
    }

    fn finalize_finish(&self, l: &CudaMoeLayer, b: &mut Buffers, t: usize, d: Dispatched, mark: Mark) -> Result<()> {
        mark(7)?;
        let p = state_of::<Plan>(d.state, G::NAME)?;
        if t == 0 || p.t_max == 0 {
            return Ok(());
        }
        let g = &l.gpu;
        // out = the summed rows' first t in f32: one "rank" whose row t is token t's.
        let identity: Vec<i32> = (0..t as i32).collect();
        let home = b.ep.as_mut().expect("allocated");
        g.stream.memcpy_htod(&identity, &mut home.home_rows.slice_mut(0..t)).map_err(|e| err("upload", e))?;
        let home_rows = dptr(&b.ep.as_ref().expect("allocated").home_rows, g);
        l.sum_home(b, p.landed, home_rows, t, 1)
    }
}
