//! All-gather out, reduce-scatter back: every rank receives every rank's rows, ids and
//! weights, and a reduce-scatter brings each rank the sums of its own tokens (the gathering
//! strategies' default collectives; see [`super::gathering`]).

use super::gathering::GatherForm;

/// All-gather / reduce-scatter.
pub(in crate::backend::cuda::layer) struct AllGather;

impl GatherForm for AllGather {
    const NAME: &'static str = "allgather";
}
