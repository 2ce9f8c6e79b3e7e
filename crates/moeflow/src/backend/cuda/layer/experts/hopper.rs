//! The routed experts through moeflow's Hopper wgmma grouped GEMM ([`super::super::hopper_gemm`]):
//! expert sizes read on the device, the activation in the up projection's epilogue, the input
//! rows gathered by the GEMM itself on the grouped layout.

use super::{DeviceExperts, ExpertRows};
use crate::backend::cuda::layer::hopper_gemm::Epilogue;
use crate::backend::cuda::layer::strategy::Mark;
use crate::backend::cuda::layer::{dptr, Buffers, CudaMoeLayer};
use crate::error::{MoeError, Result};

/// The Hopper grouped GEMM (compute capability 9.0).
pub(in crate::backend::cuda::layer) struct Hopper;

impl DeviceExperts for Hopper {
    fn name(&self) -> &'static str {
        "hopper"
    }

    fn gathers_rows(&self, layer: &CudaMoeLayer, cap: usize) -> bool {
        // W8A8 rounds the rows in place first.
        cap == 0 && !layer.w8a8
    }

    fn gathers_received_rows(&self, layer: &CudaMoeLayer) -> bool {
        !layer.w8a8
    }

    fn scatters_rows(&self) -> bool {
        true
    }

    fn run(&self, layer: &CudaMoeLayer, _b: &mut Buffers, r: &ExpertRows, mark: Mark) -> Result<()> {
        let hg = layer
            .k
            .hopper
            .as_ref()
            .ok_or_else(|| MoeError::Unsupported("the Hopper GEMM needs a GPU of compute capability 9.0".into()))?;
        let (h, i) = (layer.config.hidden, layer.config.inter);
        let (g, s) = (&layer.gpu, &layer.gpu.stream);
        if r.gather.is_none() {
            layer.round_for_w8a8(r.a, r.rows, h)?;
        }
        let dev = [r.counts, r.offsets];
        let up = Epilogue::Activation { activation: layer.config.activation, bias: layer.b13_ptr() };
        hg.run(s, dptr(&layer.w.w13, g), [2 * i, h], [r.a, r.act], [r.rows, r.busy], dev, r.experts, up, r.gather)?;
        mark(4)?;
        layer.round_for_w8a8(r.act, r.rows, i)?;
        mark(5)?;
        let down = r.y_rows.map_or(Epilogue::Product, |rows| Epilogue::Scatter { rows });
        hg.run(s, dptr(&layer.w.w2, g), [h, i], [r.act, r.y], [r.rows, r.busy], dev, r.experts, down, None)?;
        mark(6)
    }
}
