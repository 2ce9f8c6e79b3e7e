//! The single-rank strategy: nothing to move; finalize is the weight-and-reduce.

use super::{check_extras, outgoing_rows, weight_rows, DispatchInput, PrepareFinalize, Prepared};
use crate::error::Result;
use crate::quant::{dequantize, QuantConfig};
use crate::reduce::WeightAndReduce;
use std::borrow::Cow;

/// All experts on this rank: prepare borrows the input, finalize reduces in place.
#[derive(Clone, Copy, Debug, Default)]
pub struct Local;

impl PrepareFinalize for Local {
    fn name(&self) -> &'static str {
        "local"
    }

    fn prepare<'a>(&self, input: DispatchInput<'a>) -> Result<Prepared<'a>> {
        check_extras(input.extras, input.tokens)?;
        // Nothing travels, but quantization is applied all the same, so a quantized layer
        // computes the same on one rank as on many.
        let hidden = if input.quant != QuantConfig::None {
            Cow::Owned(dequantize(&outgoing_rows(&input)?))
        } else if input.weights_on_input {
            Cow::Owned(weight_rows(input.hidden, input.hidden_size, input.topk)?)
        } else {
            Cow::Borrowed(input.hidden)
        };
        Ok(Prepared {
            hidden,
            topk: Cow::Borrowed(input.topk),
            expert_map: None,
            batched: None,
            extras: input.extras.to_vec(),
            weights_applied: input.weights_on_input,
            state: Box::new(input.hidden_size),
        })
    }

    fn finalize(
        &self,
        prepared: &Prepared,
        expert_out: &[f32],
        reduce: &dyn WeightAndReduce,
        out: &mut [f32],
    ) -> Result<()> {
        let topk = &prepared.topk;
        let h = *prepared.state.downcast_ref::<usize>().expect("local state is the hidden size");
        reduce.apply(expert_out, &topk.weights, topk.k, h, prepared.weights_applied, out);
        Ok(())
    }
}
