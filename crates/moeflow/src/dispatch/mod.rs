//! Quantize+Dispatch and Combine: the strategies that move tokens to experts and results home.
//!
//! A [`PrepareFinalize`] is one object because its two halves must agree on where every row
//! went. Any strategy composes with any [`crate::experts::Experts`] of the same activation
//! format.

mod local;

pub use local::Local;

use crate::error::{MoeError, Result};
use crate::experts::ActivationFormat;
use crate::reduce::WeightAndReduce;
use crate::router::TopK;
use std::any::Any;
use std::borrow::Cow;

/// What prepare hands to the experts: rows, their routing, and the strategy's private state
/// that finalize needs to bring results home.
pub struct Prepared<'a> {
    /// `[tokens, H]` rows for this rank's experts.
    pub hidden: Cow<'a, [f32]>,
    /// Routing of those rows (global expert ids).
    pub topk: Cow<'a, TopK>,
    /// Global expert → local slot (`-1`: elsewhere); `None` when every expert is local.
    pub expert_map: Option<Cow<'a, [i32]>>,
    /// The router weights were multiplied into `hidden`.
    pub weights_applied: bool,
    /// Strategy-specific bookkeeping for finalize.
    pub state: Box<dyn Any + Send + Sync>,
}

/// Moves tokens to the experts (prepare) and expert output back to token rows (finalize).
pub trait PrepareFinalize: Send + Sync {
    /// Name on the command line.
    fn name(&self) -> &'static str;
    /// The format prepare produces.
    fn activation_format(&self) -> ActivationFormat {
        ActivationFormat::Standard
    }
    /// Dispatches `hidden [T, H]` with `topk`. With `weights_on_input` (top-k = 1) the rows are
    /// multiplied by their router weight before they leave.
    fn prepare<'a>(
        &self,
        hidden: &'a [f32],
        hidden_size: usize,
        topk: &'a TopK,
        weights_on_input: bool,
    ) -> Result<Prepared<'a>>;
    /// Combines `expert_out` (as `reduce` lays it out, for the prepared rows) into `out [T, H]`
    /// for the `T` tokens given to prepare.
    fn finalize(
        &self,
        prepared: &Prepared,
        expert_out: &[f32],
        hidden_size: usize,
        reduce: &dyn WeightAndReduce,
        out: &mut [f32],
    ) -> Result<()>;
}

/// `hidden [T, H]` with each row multiplied by its (single) router weight.
pub fn weight_rows(hidden: &[f32], hidden_size: usize, topk: &TopK) -> Result<Vec<f32>> {
    if topk.k != 1 {
        return Err(MoeError::Config(format!("apply_router_weight_on_input needs top-k = 1, got {}", topk.k)));
    }
    let mut rows = hidden.to_vec();
    for (row, &w) in rows.chunks_mut(hidden_size.max(1)).zip(&topk.weights) {
        row.iter_mut().for_each(|x| *x *= w);
    }
    Ok(rows)
}
