//! All-gather of rows and router logits out, reduce-scatter back: every rank routes every
//! token itself (the same kernel on the same logits, so the same choice as at home), which
//! sends `E` floats a token in place of `k` ids and weights (see [`super::gathering`]).

use super::gathering::GatherForm;

/// All-gather of router logits / reduce-scatter.
pub(in crate::backend::cuda::layer) struct AllGatherLogits;

impl GatherForm for AllGatherLogits {
    const NAME: &'static str = "allgather-logits";
    const LOGITS: bool = true;
}
