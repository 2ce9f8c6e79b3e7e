//! The routed experts through the masked grouped GEMM ([`super::super::masked_gemm`]): each
//! expert over its counted rows only (read on the device), with bf16 or fp8 weights and, with
//! fp8 activations, fp8 × fp8 products.

use super::{DeviceExperts, ExpertRows};
use crate::backend::cuda::layer::masked_gemm::Projection;
use crate::backend::cuda::layer::strategy::Mark;
use crate::backend::cuda::layer::{Buffers, CudaMoeLayer};
use crate::error::Result;

/// The masked grouped GEMM.
pub(in crate::backend::cuda::layer) struct Masked;

impl DeviceExperts for Masked {
    fn name(&self) -> &'static str {
        "masked"
    }

    fn run(&self, layer: &CudaMoeLayer, _b: &mut Buffers, r: &ExpertRows, mark: Mark) -> Result<()> {
        let i = layer.config.inter;
        // The padded layout places rows by the cap, the grouped one by the offsets.
        let (offsets, counts_for_act) = if r.cap > 0 { (0, r.counts) } else { (r.offsets, 0) };
        layer.masked_gemm(Projection::Up, [r.a, r.h13], r.cap, r.counts, offsets, r.rows)?;
        mark(4)?;
        let ptrs = [r.h13, layer.b13_ptr(), r.expert_of_row, counts_for_act, r.act];
        layer.act(&layer.gpu.stream, ptrs, r.cap as i32, r.rows, i)?;
        mark(5)?;
        layer.masked_gemm(Projection::Down, [r.act, r.y], r.cap, r.counts, offsets, r.rows)?;
        mark(6)
    }
}
