//! All-gather out, reduce-scatter back: every rank receives every rank's rows, ids and
//! weights, and a reduce-scatter brings each rank the sums of its own tokens (see
//! [`super::gathering`]).

use super::gathering::GatherForm;
use cudarc::nccl::sys as nc;

/// All-gather / reduce-scatter.
pub(in crate::backend::cuda::layer) struct AllGather;

/// `bytes` from every rank into `dst`, rank after rank (shared with [`super::AllGatherLogits`]).
pub(super) fn all_gather(
    src: u64,
    dst: u64,
    bytes: usize,
    comm: nc::ncclComm_t,
    cs: nc::cudaStream_t,
) -> nc::ncclResult_t {
    // SAFETY: `bytes` from every rank into n · bytes at `dst` (root r's at r · bytes); the
    // buffers were sized for the group's largest batch.
    unsafe { nc::ncclAllGather(src as _, dst as _, bytes, nc::ncclDataType_t::ncclUint8, comm, cs) }
}

/// The sums of this rank's `rows` rows of `h` into `back` (shared with
/// [`super::AllGatherLogits`]).
pub(super) fn reduce_scatter(
    part: u64,
    back: u64,
    rows: usize,
    h: usize,
    comm: nc::ncclComm_t,
    cs: nc::cudaStream_t,
) -> nc::ncclResult_t {
    let (bf16, sum) = (nc::ncclDataType_t::ncclBfloat16, nc::ncclRedOp_t::ncclSum);
    // SAFETY: n · rows bf16 rows of h in; this rank's rows out, into `back`, sized for them.
    unsafe { nc::ncclReduceScatter(part as _, back as _, rows * h, bf16, sum, comm, cs) }
}

impl GatherForm for AllGather {
    const NAME: &'static str = "allgather";

    fn gather(
        src: u64,
        dst: u64,
        bytes: usize,
        _n: usize,
        comm: nc::ncclComm_t,
        cs: nc::cudaStream_t,
    ) -> nc::ncclResult_t {
        all_gather(src, dst, bytes, comm, cs)
    }

    fn landing(_part: u64, back: u64, _rows: usize, _h: usize, _rank: usize) -> u64 {
        back
    }

    fn sum(
        part: u64,
        back: u64,
        rows: usize,
        h: usize,
        _n: usize,
        comm: nc::ncclComm_t,
        cs: nc::cudaStream_t,
    ) -> nc::ncclResult_t {
        reduce_scatter(part, back, rows, h, comm, cs)
    }
}
