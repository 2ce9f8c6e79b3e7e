//! The device-resident gathering forms of the expert-parallel layer: every rank receives
//! every rank's token rows with their routing (each batch padded to the largest), runs its own
//! experts on all of them, and the ranks' partial outputs are summed back. No
//! per-destination lists are built, at the price of moving every row to every rank: the naive
//! strategies, simplest where batches are small or most tokens go to most ranks.
//! - all-gather / reduce-scatter ([`CudaMoeLayer::all_gather`]): one all-gather out, and a
//!   reduce-scatter brings each rank the sums of its own tokens;
//! - all-gather of router logits ([`CudaMoeLayer::all_gather_logits`]): the same with each
//!   token's router logits in place of its ids and weights, every rank routing every token
//!   itself (the same kernel on the same logits, so the same choice as at home);
//! - multicast ([`CudaMoeLayer::multicast`]): each rank broadcasts its rows to all (one
//!   broadcast per root), and an all-reduce gives every rank every token's sum, of which it
//!   keeps its own.
//!
//! Each rank's partial output of a token is its slots' weighted sum in slot order (zeros when
//! it holds none of them), as in the all-to-all-v layer; the collectives add the ranks' bf16
//! partials in NCCL's fixed order, so runs repeat exactly.

use super::expert_parallel::Localize;
use super::{dptr, err, Buffers, CudaMoeLayer, EpLink};
use crate::error::{MoeError, Result};
use cudarc::driver::CudaSlice;

/// How a gathering layer moves rows (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Gathering {
    /// All-gather out, reduce-scatter back.
    AllGather,
    /// All-gather of rows and router logits out (routing after it), reduce-scatter back.
    AllGatherLogits,
    /// A broadcast from each rank out, all-reduce back.
    Multicast,
}

impl CudaMoeLayer {
    /// This expert-parallel layer dispatching by all-gather and combining by reduce-scatter
    /// (see the module docs) instead of all-to-all-v. Not with the low-latency form.
    pub fn all_gather(self) -> Result<Self> {
        self.gathering(Gathering::AllGather)
    }

    /// This expert-parallel layer all-gathering router logits with the rows, every rank
    /// routing every token, and combining by reduce-scatter (see the module docs).
    pub fn all_gather_logits(self) -> Result<Self> {
        self.gathering(Gathering::AllGatherLogits)
    }

    /// This expert-parallel layer dispatching by one broadcast per rank and combining by
    /// all-reduce (see the module docs) instead of all-to-all-v. Not with the low-latency form.
    pub fn multicast(self) -> Result<Self> {
        self.gathering(Gathering::Multicast)
    }

    fn gathering(self, how: Gathering) -> Result<Self> {
        if self.opts.deterministic {
            return Err(MoeError::Unsupported(format!(
                "{how:?} sums partial outputs across ranks; deterministic mode dispatches by all-to-all-v"
            )));
        }
        let mut layer = self;
        let Some(link) = layer.ep.as_mut() else {
            return Err(MoeError::Config(format!("{how:?} dispatch needs an expert-parallel layer (new_ep)")));
        };
        if link.capacity.is_some() || link.gathering.is_some_and(|g| g != how) {
            return Err(MoeError::Config(
                "a layer dispatches one way: all-to-all-v, all-gather, multicast or lowlatency".into(),
            ));
        }
        link.gathering = Some(how);
        Ok(layer)
    }

    /// A gathering layer's expert stage on this rank's `t` routed tokens (route done): gathers
    /// `how`, runs the experts here, sums back into `b.out [t, H]`. Returns the bytes this
    /// rank sent to other ranks in the gather.
    pub(super) fn gathered_experts(
        &self,
        b: &mut Buffers,
        t: usize,
        link: &EpLink,
        how: Gathering,
        mark: &dyn Fn(usize) -> Result<()>,
    ) -> Result<usize> {
        use crate::comm::Communicator;
        use cudarc::nccl::sys as nc;
        let c = &self.config;
        let (h, e, k) = (c.hidden, c.num_experts, c.top_k);
        let (n, rank, el) = (link.comm.size(), link.comm.rank(), link.local);
        let g = &self.gpu;
        let s = &g.stream;
        // Every rank's slots per physical expert (the placement's rule picks each slot's
        // replica from its token's index in its rank's batch) and batch size: this rank's
        // experts' rows, the padding.
        let (ids, _) = self.read_routing(b, t)?;
        let np = link.placement.num_physical();
        let mut mine = vec![0i32; np + 1];
        for (i, &id) in ids.iter().enumerate() {
            mine[link.placement.replica_for(id as usize, i / k, i % k)] += 1;
        }
        mine[np] = t as i32;
        let all = self.gather_counts(b, link, &mine)?;
        let m = np + 1;
        let t_max = (0..n).map(|r| all[r * m + np] as usize).max().unwrap_or(0);
        let local: Vec<usize> =
            (0..el).map(|j| (0..n).map(|r| all[r * m + link.phys_first + j] as usize).sum()).collect();
        let plan = self.local_plan(&local);
        let received = n * t_max;
        let need = [t_max, received, plan.rows, t];
        self.grow_ep_buffers(b, need, n)?;
        mark(2)?;
        if t_max == 0 {
            // No rank has tokens: nothing to move, every later stage empty.
            for stage in 3..=7 {
                mark(stage)?;
            }
            return Ok(0);
        }
        let ep = b.ep.as_mut().expect("allocated");
        let (pi, pf, pb) =
            (|x: &CudaSlice<i32>| dptr(x, g), |x: &CudaSlice<f32>| dptr(x, g), |x: &CudaSlice<u16>| dptr(x, g));
        // This rank's batch, padded to t_max tokens of zeros with no expert (id -1): rows with
        // ids and weights, or rows with router logits.
        let (send_rows, send_ids, send_w) = (pb(&ep.send_rows), pi(&ep.send_ids), pf(&ep.send_w));
        let (recv_rows, recv_ids, recv_w) = (pb(&ep.recv_rows), pi(&ep.recv_ids), pf(&ep.recv_w));
        let (send_logits, recv_logits) = (pf(&ep.send_logits), pf(&ep.recv_logits));
        let logits = how == Gathering::AllGatherLogits;
        let (own, gathered) = if logits {
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
        let u8t = nc::ncclDataType_t::ncclUint8;
        link.comm.enqueue("moe gather", s, |comm, cs| {
            for (src, dst, width) in gathered {
                let bytes = t_max * width;
                // SAFETY: t_max rows of `width` bytes from every rank into n · t_max rows (root
                // r's into rows r · t_max ..).
                let r = unsafe {
                    match how {
                        Gathering::AllGather | Gathering::AllGatherLogits => {
                            nc::ncclAllGather(src as _, dst as _, bytes, u8t, comm, cs)
                        }
                        Gathering::Multicast => (0..n)
                            .map(|root| {
                                let at = (dst + (root * bytes) as u64) as _;
                                nc::ncclBroadcast(src as _, at, bytes, u8t, root as i32, comm, cs)
                            })
                            .find(|r| *r != nc::ncclResult_t::ncclSuccess)
                            .unwrap_or(nc::ncclResult_t::ncclSuccess),
                    }
                };
                if r != nc::ncclResult_t::ncclSuccess {
                    return r;
                }
            }
            nc::ncclResult_t::ncclSuccess
        })?;
        if logits {
            // Every token routed here, then the padding's choices dropped (id -1).
            self.top_k(recv_logits, received, recv_ids, recv_w)?;
            for r in 0..n {
                let tr = all[r * m + np] as usize;
                if tr < t_max {
                    let at = recv_ids + (4 * k * (r * t_max + tr)) as u64;
                    // SAFETY: rows tr .. t_max of rank r's block of the n · t_max · k ids.
                    unsafe { cudarc::driver::result::memset_d8_async(at, 0xff, 4 * k * (t_max - tr), s.cu_stream()) }
                        .map_err(|e| err("dropping the padding", e))?;
                }
            }
        }
        self.serve_received(b, received, &plan, Localize::Placed { period: t_max }, mark)?;
        let ep = b.ep.as_ref().expect("allocated");
        let part = pb(&ep.part);
        let (bf16, sum) = (nc::ncclDataType_t::ncclBfloat16, nc::ncclRedOp_t::ncclSum);
        // This rank's t_max summed rows: reduce-scattered into `back`, or its share of the
        // all-reduced partials.
        let back = match how {
            Gathering::AllGather | Gathering::AllGatherLogits => pb(&ep.back),
            Gathering::Multicast => part + (2 * rank * t_max * h) as u64,
        };
        link.comm.enqueue("moe sum", s, |comm, cs| {
            // SAFETY: n · t_max bf16 rows of h in; this rank's t_max rows out (`back`), or all
            // of them in place.
            unsafe {
                match how {
                    Gathering::AllGather | Gathering::AllGatherLogits => {
                        nc::ncclReduceScatter(part as _, back as _, t_max * h, bf16, sum, comm, cs)
                    }
                    Gathering::Multicast => nc::ncclAllReduce(part as _, part as _, n * t_max * h, bf16, sum, comm, cs),
                }
            }
        })?;
        mark(7)?;
        if t > 0 {
            // out = back's first t rows in f32: one "rank" whose row t is token t's.
            let identity: Vec<i32> = (0..t as i32).collect();
            let home = b.ep.as_mut().expect("allocated");
            s.memcpy_htod(&identity, &mut home.home_rows.slice_mut(0..t)).map_err(|e| err("upload", e))?;
        }
        let home_rows = pi(&b.ep.as_ref().expect("allocated").home_rows);
        self.sum_home(back, home_rows, t, 1, dptr(&b.out, g))?;
        let row = if logits { 2 * h + 4 * e } else { 2 * h + 8 * k };
        Ok((n - 1) * t_max * row)
    }
}
