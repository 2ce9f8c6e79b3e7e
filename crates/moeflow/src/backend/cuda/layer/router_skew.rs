//! A routing skew ([`Skew`], `--skew`) on a GPU layer, typically one whose weights were
//! generated on the device: the skew's bias `[E]` is added to the router's logit bias
//! (`gate_bias`, created where absent), exactly as [`Skew::apply`] adds it to host weights.
//! The router's weights come to the host to compute it (the `hot` form fits its bias to the
//! layer's own router there, as on the CPU); the experts' weights never leave the device.

use super::{err, CudaMoeLayer};
use crate::error::{MoeError, Result};
use crate::skew::{RouterWeights, Skew};
use cudarc::driver::CudaSlice;

impl CudaMoeLayer {
    /// Adds `skew`'s bias to this layer's router logits (see the module). Before the layer is
    /// split for dual-batch overlap.
    pub fn skew_router(mut self, skew: &Skew) -> Result<Self> {
        let s = &self.gpu.stream;
        let down = |x: &CudaSlice<f32>| s.clone_dtoh(x).map_err(|e| err("reading the router", e));
        let gate = down(&self.w.gate)?;
        let gate_bias = self.w.gate_bias.as_ref().map(down).transpose()?;
        let correction_bias = self.w.correction_bias.as_ref().map(down).transpose()?;
        let router =
            RouterWeights { gate: &gate, gate_bias: gate_bias.as_deref(), correction_bias: correction_bias.as_deref() };
        let bias = skew.bias_for_router(&self.config, &router)?;
        let mut sum = gate_bias.unwrap_or_else(|| vec![0.0; bias.len()]);
        sum.iter_mut().zip(&bias).for_each(|(g, b)| *g += b);
        let up = s.clone_htod(&sum).map_err(|e| err("uploading the router bias", e))?;
        let w = std::sync::Arc::get_mut(&mut self.w).ok_or_else(|| {
            MoeError::Config("skew_router: skew the router before splitting the layer for dual-batch overlap".into())
        })?;
        w.gate_bias = Some(up);
        Ok(self)
    }
}
