//! The monolithic all-gather variant: router logits travel instead of top-k ids and weights,
//! and every rank routes the gathered tokens itself (the router is deterministic, so each token
//! gets the routing its home rank would give it).

use super::allgather::{AllGather, Payload};
use super::Ep;

/// All-gather of hidden states and router logits, routing after dispatch, reduce-scatter home.
pub fn allgather_logits(ep: Ep) -> AllGather {
    let mut s = AllGather::new(ep);
    s.payload = Payload::Logits;
    s
}
