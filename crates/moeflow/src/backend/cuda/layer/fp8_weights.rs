//! Experts in fp8 e4m3 with one f32 scale per 128 × 128 block (DeepSeek-V3's format,
//! [`WeightQuant::Fp8Block`]`(128)`): the codes the fp8 GEMMs stream (half the bytes of bf16),
//! beside the bf16 values they stand for, which every other path uses, so all paths compute
//! with the same weights. The routed experts' and, on its own request, the shared expert's.

use super::{dptr, err, CudaMoeLayer};
use crate::error::{MoeError, Result};
use crate::experts::ExpertWeights;
use crate::quant::WeightQuant;
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use std::sync::Arc;

/// Block edge of the fp8 weight scales.
const BLOCK: usize = 128;

/// fp8 codes `[E, N, K]` and block scales `[E, ceil(N / 128), ceil(K / 128)]` of both
/// projections (E = 1 for the shared expert).
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
        if held == 0 {
            return Err(MoeError::Config("fp8 experts: the layer holds no routed experts".into()));
        }
        let (gpu, kernel) = (&self.gpu, &self.k.quantize_fp8);
        let w = std::sync::Arc::get_mut(&mut self.w).ok_or_else(|| {
            MoeError::Config("fp8_experts: quantize before splitting the layer for dual-batch overlap".into())
        })?;
        let (w13, s13) = quantize_blocks(gpu, kernel, &mut w.w13, [held, 2 * i, h])?;
        let (w2, s2) = quantize_blocks(gpu, kernel, &mut w.w2, [held, h, i])?;
        w.fp8 = Some(Fp8Experts { w13, s13, w2, s2 });
        // A low-latency layer set up before now runs the masked GEMM on its padded rows.
        self.size_ll_rows()?;
        Ok(self)
    }

    /// Quantizes the shared expert as [`CudaMoeLayer::fp8_experts`] does the routed ones (a
    /// DeepSeek-V3 fp8 checkpoint's shared expert, dequantized on loading, gets its own codes
    /// back). With fp8 activations ([`CudaMoeLayer::fp8_activations`]) its rows are quantized
    /// too, one scale per 128 values: on Hopper it then runs on the fp8 tensor cores (reading
    /// half the bytes), elsewhere as bf16 GEMMs on the values the codes stand for. A layer
    /// without a shared expert is returned unchanged.
    pub fn fp8_shared_expert(mut self) -> Result<Self> {
        if self.w.shared.as_ref().is_none_or(|sh| sh.fp8.is_some()) {
            return Ok(self);
        }
        let h = self.config.hidden;
        if self.k.hopper_fp8_shared.is_none() && !self.opts.deterministic {
            self.k.hopper_fp8_shared = Self::shared_fp8_gemm_for(&self.gpu, &self.opts, self.ep.is_some())?;
        }
        let (gpu, kernel) = (&self.gpu, &self.k.quantize_fp8);
        let w = std::sync::Arc::get_mut(&mut self.w).ok_or_else(|| {
            MoeError::Config("fp8_shared_expert: quantize before splitting the layer for dual-batch overlap".into())
        })?;
        let sh = w.shared.as_mut().expect("checked above");
        let si = sh.inter;
        let (w13, s13) = quantize_blocks(gpu, kernel, &mut sh.w13, [1, 2 * si, h])?;
        let (w2, s2) = quantize_blocks(gpu, kernel, &mut sh.w2, [1, h, si])?;
        sh.fp8 = Some(Fp8Experts { w13, s13, w2, s2 });
        // Buffers allocated before hold no fp8 rows for the shared expert: marked empty, they
        // are replaced at the next call as when they grow (the graphs dropped, the cuBLAS
        // workspaces and the buffers a caller's graph points into kept).
        if let Some(b) = self.bufs.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            b.tokens = 0;
        }
        Ok(self)
    }

    /// Whether the routed experts are held as fp8 codes too.
    pub fn has_fp8_experts(&self) -> bool {
        self.w.fp8.is_some()
    }

    /// Whether the shared expert is held as fp8 codes too (see
    /// [`CudaMoeLayer::fp8_shared_expert`]).
    pub fn has_fp8_shared_expert(&self) -> bool {
        self.w.shared.as_ref().is_some_and(|sh| sh.fp8.is_some())
    }
}

/// Quantizes `held` bf16 matrices `[n, k]` at `w` to fp8 codes with one scale per 128 × 128
/// block on the device (`quantize_weight_blocks_fp8`), and overwrites them with the values the
/// codes stand for; returns the codes and the `[held, ceil(n / 128), ceil(k / 128)]` scales.
fn quantize_blocks(
    gpu: &super::Gpu,
    kernel: &cudarc::driver::CudaFunction,
    w: &mut CudaSlice<u16>,
    [held, n, k]: [usize; 3],
) -> Result<(CudaSlice<u8>, CudaSlice<f32>)> {
    let s = &gpu.stream;
    let codes = s.alloc_zeros::<u8>(w.len().max(1)).map_err(|e| err("allocating fp8 weights", e))?;
    let (nb, kb) = (n.div_ceil(BLOCK), k.div_ceil(BLOCK));
    let scales = s.alloc_zeros::<f32>((held * nb * kb).max(1)).map_err(|e| err("allocating fp8 scales", e))?;
    let (wp, cp, sp, ni, ki) = (dptr(w, gpu), dptr(&codes, gpu), dptr(&scales, gpu), n as i32, k as i32);
    let cfg =
        LaunchConfig { grid_dim: (kb as u32, nb as u32, held as u32), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: quantize_weight_blocks_fp8(bf16*, int, int, u8*, float*) over `held` matrices
    // [n, k] of `w`, writing as many codes and held · nb · kb scales.
    unsafe { s.launch_builder(kernel).arg(&wp).arg(&ni).arg(&ki).arg(&cp).arg(&sp).launch(cfg) }
        .map_err(|e| err("quantize_weight_blocks_fp8", e))?;
    Ok((codes, scales))
}
