//! Multicast: each rank broadcasts its rows, ids and weights to all (one broadcast per root),
//! and an all-reduce gives every rank every token's sum, of which it keeps its own (see
//! [`super::gathering`]).

use super::gathering::GatherForm;
use cudarc::nccl::sys as nc;

/// One broadcast per rank out, all-reduce back.
pub(in crate::backend::cuda::layer) struct Multicast;

impl GatherForm for Multicast {
    const NAME: &'static str = "multicast";

    fn gather(
        src: u64,
        dst: u64,
        bytes: usize,
        n: usize,
        comm: nc::ncclComm_t,
        cs: nc::cudaStream_t,
    ) -> nc::ncclResult_t {
        (0..n)
            .map(|root| {
                let at = (dst + (root * bytes) as u64) as _;
                // SAFETY: root's `bytes` into its block of the n · bytes at `dst`, sized for the
                // group's largest batch.
                unsafe { nc::ncclBroadcast(src as _, at, bytes, nc::ncclDataType_t::ncclUint8, root as i32, comm, cs) }
            })
            .find(|r| *r != nc::ncclResult_t::ncclSuccess)
            .unwrap_or(nc::ncclResult_t::ncclSuccess)
    }

    fn landing(part: u64, _back: u64, rows: usize, h: usize, rank: usize) -> u64 {
        part + (2 * rank * rows * h) as u64
    }

    fn sum(
        part: u64,
        _back: u64,
        rows: usize,
        h: usize,
        n: usize,
        comm: nc::ncclComm_t,
        cs: nc::cudaStream_t,
    ) -> nc::ncclResult_t {
        let (bf16, sum) = (nc::ncclDataType_t::ncclBfloat16, nc::ncclRedOp_t::ncclSum);
        // SAFETY: the n · rows bf16 rows of h at `part` summed over the ranks in place.
        unsafe { nc::ncclAllReduce(part as _, part as _, n * rows * h, bf16, sum, comm, cs) }
    }
}
