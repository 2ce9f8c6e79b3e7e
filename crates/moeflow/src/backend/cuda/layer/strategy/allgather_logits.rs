//! All-gather of rows and router logits out, reduce-scatter back: every rank routes every
//! token itself (the same kernel on the same logits, so the same choice as at home), which
//! sends `E` floats a token in place of `k` ids and weights (see [`super::gathering`]).

use super::allgather::{all_gather, reduce_scatter};
use super::gathering::GatherForm;
use cudarc::nccl::sys as nc;

/// All-gather of router logits / reduce-scatter.
pub(in crate::backend::cuda::layer) struct AllGatherLogits;

impl GatherForm for AllGatherLogits {
    const NAME: &'static str = "allgather-logits";
    const LOGITS: bool = true;

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
