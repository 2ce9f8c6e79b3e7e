//! The single-rank strategy: nothing to move; finalize is the weight-and-reduce.

use super::{weight_rows, PrepareFinalize, Prepared};
use crate::error::Result;
use crate::reduce::WeightAndReduce;
use crate::router::TopK;
use std::borrow::Cow;

/// All experts on this rank: prepare borrows the input, finalize reduces in place.
#[derive(Clone, Copy, Debug, Default)]
pub struct Local;

impl PrepareFinalize for Local {
    fn name(&self) -> &'static str {
        "local"
    }

    fn prepare<'a>(
        &self,
        hidden: &'a [f32],
        hidden_size: usize,
        topk: &'a TopK,
        weights_on_input: bool,
    ) -> Result<Prepared<'a>> {
        let hidden =
            if weights_on_input { Cow::Owned(weight_rows(hidden, hidden_size, topk)?) } else { Cow::Borrowed(hidden) };
        Ok(Prepared {
            hidden,
            topk: Cow::Borrowed(topk),
            expert_map: None,
            weights_applied: weights_on_input,
            state: Box::new(()),
        })
    }

    fn finalize(
        &self,
        prepared: &Prepared,
        expert_out: &[f32],
        hidden_size: usize,
        reduce: &dyn WeightAndReduce,
        out: &mut [f32],
    ) -> Result<()> {
        let topk = &prepared.topk;
        reduce.apply(expert_out, &topk.weights, topk.k, hidden_size, prepared.weights_applied, out);
        Ok(())
    }
}
