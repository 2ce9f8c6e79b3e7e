//! Routed experts in fp8 e4m3 with one f32 scale per 128 × 128 block (DeepSeek-V3's format,
//! [`WeightQuant::Fp8Block`]`(128)`): the codes the low-latency layer's masked GEMM streams
//! (half the bytes of bf16), beside the bf16 values they stand for, which every other path
//! uses, so all paths compute with the same weights.

use super::{dptr, err, CudaMoeLayer};
use crate::error::{MoeError, Result};
use crate::experts::ExpertWeights;
use crate::quant::WeightQuant;
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use std::sync::Arc;

/// Block edge of the fp8 weight scales.
const BLOCK: usize = 128;

/// fp8 codes `[E, N, K]` and block scales `[E, ceil(N / 128), ceil(K / 128)]` of both
/// projections.
pub(super) struct Fp8Experts {
    pub(super) w13: CudaSlice<u8>,
    pub(super) s13: CudaSlice<f32>,
    pub(super) w2: CudaSlice<u8>,
    pub(super) s2: CudaSlice<f32>,
}

impl Fp8Experts {
    /// The codes and scales of `experts` when they are stored as fp8 with 128 × 128 blocks.
    pub(super) fn upload(experts: &ExpertWeights, stream: &Arc<CudaStream>) -> Result<Option<Self>> {
        let Some(codes) = experts.codes().filter(|c| c.format == WeightQuant::Fp8Block(BLOCK)) else {
            return Ok(None);
        };
        let up8 = |v: &[u8]| stream.clone_htod(v).map_err(|e| err("upload", e));
        let up32 = |v: &[f32]| stream.clone_htod(v).map_err(|e| err("upload", e));
        Ok(Some(Fp8Experts {
            w13: up8(&codes.w13)?,
            s13: up32(&codes.w13_scales)?,
            w2: up8(&codes.w2)?,
            s2: up32(&codes.w2_scales)?,
        }))
    }
}

impl CudaMoeLayer {
    /// Quantizes this layer's routed experts to fp8 e4m3 with one scale per 128 × 128 block on
    /// the device (bit for bit what [`WeightQuant::Fp8Block`]`(128)` gives on the CPU) and
    /// replaces the bf16 weights by the values the codes stand for. The low-latency layer then
    /// streams the codes; every path computes with the same weights.
    pub fn fp8_experts(mut self) -> Result<Self> {
        if self.w.fp8.is_some() {
            return Ok(self);
        }
        let c = &self.config;
        let (h, i) = (c.hidden, c.inter);
        let held = self.w.w2.len() / (h * i);
        let s = &self.gpu.stream;
        let quantize = |w: &mut CudaSlice<u16>, n: usize, k: usize| -> Result<(CudaSlice<u8>, CudaSlice<f32>)> {
            let codes = s.alloc_zeros::<u8>(w.len().max(1)).map_err(|e| err("allocating fp8 weights", e))?;
            let (nb, kb) = (n.div_ceil(BLOCK), k.div_ceil(BLOCK));
            let scales = s.alloc_zeros::<f32>((held * nb * kb).max(1)).map_err(|e| err("allocating fp8 scales", e))?;
            let (wp, cp, sp, ni, ki) =
                (dptr(w, &self.gpu), dptr(&codes, &self.gpu), dptr(&scales, &self.gpu), n as i32, k as i32);
            let cfg = LaunchConfig {
                grid_dim: (kb as u32, nb as u32, held as u32),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: quantize_weight_blocks_fp8(bf16*, int, int, u8*, float*) over `held`
            // matrices [n, k] of `w`, writing as many codes and held · nb · kb scales.
            unsafe { s.launch_builder(&self.k.quantize_fp8).arg(&wp).arg(&ni).arg(&ki).arg(&cp).arg(&sp).launch(cfg) }
                .map_err(|e| err("quantize_weight_blocks_fp8", e))?;
            Ok((codes, scales))
        };
        if held == 0 {
            return Err(MoeError::Config("fp8 experts: the layer holds no routed experts".into()));
        }
        let w = std::sync::Arc::get_mut(&mut self.w).ok_or_else(|| {
            MoeError::Config("fp8_experts: quantize before splitting the layer for dual-batch overlap".into())
        })?;
        let (w13, s13) = quantize(&mut w.w13, 2 * i, h)?;
        let (w2, s2) = quantize(&mut w.w2, h, i)?;
        w.fp8 = Some(Fp8Experts { w13, s13, w2, s2 });
        Ok(self)
    }

    /// Whether the routed experts are held as fp8 codes too.
    pub fn has_fp8_experts(&self) -> bool {
        self.w.fp8.is_some()
    }
}
