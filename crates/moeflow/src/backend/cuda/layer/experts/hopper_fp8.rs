//! W8A8 experts on the fp8 tensor cores ([`super::super::hopper_fp8_gemm`]): the rows (or, on
//! the grouped layout, the tokens the GEMM gathers them from, or from 128 rows an expert the
//! tokens' rows copied in expert order first) and the activation quantized to
//! fp8 e4m3 with one scale per 128 values, times the fp8 expert weights with their 128 × 128
//! block scales; expert sizes read on the device, the activation in the up projection's
//! epilogue, and quantized for the down projection by a separate pass or (an option, where the
//! intermediate size is a multiple of 128) in that epilogue, to the same codes. The same
//! quantized values as the bf16 path's W8A8 rounding, summed in another order.

use super::{DeviceExperts, ExpertRows};
use crate::backend::cuda::layer::hopper_fp8_gemm::{Fp8Gather, Fp8Operand, GemmOut, HopperFp8Gemm};
use crate::backend::cuda::layer::hopper_gemm::Epilogue;
use crate::backend::cuda::layer::masked_gemm::Fp8Rows;
use crate::backend::cuda::layer::strategy::Mark;
use crate::backend::cuda::layer::{dptr, Buffers, CudaMoeLayer};
use crate::error::{MoeError, Result};

/// The fp8 Hopper grouped GEMM (compute capability 9.0, fp8 experts, fp8 activations).
pub(in crate::backend::cuda::layer) struct HopperFp8;

impl DeviceExperts for HopperFp8 {
    fn name(&self) -> &'static str {
        "hopper-fp8"
    }

    fn gathers_rows(&self, _layer: &CudaMoeLayer, cap: usize) -> bool {
        cap == 0
    }

    fn gathers_fp8_rows(&self) -> bool {
        true
    }

    fn run(&self, layer: &CudaMoeLayer, _b: &mut Buffers, r: &ExpertRows, mark: Mark) -> Result<()> {
        let missing = || MoeError::Unsupported("the fp8 Hopper GEMM needs a Hopper GPU and fp8 experts".into());
        let gemm = layer.k.hopper_fp8.as_ref().ok_or_else(missing)?;
        let fp8 = layer.w.fp8.as_ref().ok_or_else(missing)?;
        let (h, i) = (layer.config.hidden, layer.config.inter);
        let (g, s) = (&layer.gpu, &layer.gpu.stream);
        let dev = [r.counts, r.offsets];
        let mut rows = layer.fp8_rows.lock().unwrap_or_else(|p| p.into_inner());
        // The up projection's input: the tokens themselves where the GEMM gathers its rows
        // (quantized here, unless they came quantized), else the permuted rows (padding rows
        // of a padded layout skipped).
        let (a, gather) = match r.gather {
            Some(gt) if gt.stride != h => {
                return Err(MoeError::Unsupported(format!(
                    "the fp8 Hopper GEMM gathers rows of {h} values laid end to end (got rows {} values apart)",
                    gt.stride
                )))
            }
            Some(gt) => {
                let x = match gt.fp8_scales {
                    Some(scales) => Fp8Operand { codes: gt.x, scales },
                    None => {
                        let q = layer.quantize_rows_fp8(&mut rows.input, gt.x, gt.tokens, h, 0, 0)?;
                        Fp8Operand { codes: dptr(&q.codes, g), scales: dptr(&q.scales, g) }
                    }
                };
                if layer.opts.copies_fp8_rows(r.rows, r.experts) {
                    // Copied in expert order, the rows come by TMA: faster than the GEMM's own
                    // gather once the products, not the weights' read, bound it (docs/tuning.md).
                    let q = Fp8Rows::at_least(&mut rows.gathered, s, r.rows * h)?;
                    let to = Fp8Operand { codes: dptr(&q.codes, g), scales: dptr(&q.scales, g) };
                    layer.gather_fp8_rows(x, gt.slot_of_row, gt.k, dev, r.experts, r.rows, to)?;
                    (to, None)
                } else {
                    (x, Some(Fp8Gather { x, slot_of_row: gt.slot_of_row, k: gt.k }))
                }
            }
            None => {
                let counts = if r.cap > 0 { r.counts } else { 0 };
                let q = layer.quantize_rows_fp8(&mut rows.input, r.a, r.rows, h, r.cap, counts)?;
                (Fp8Operand { codes: dptr(&q.codes, g), scales: dptr(&q.scales, g) }, None)
            }
        };
        let w13 = Fp8Operand { codes: dptr(&fp8.w13, g), scales: dptr(&fp8.s13, g) };
        let up = Epilogue::Activation { activation: layer.config.activation, bias: layer.b13_ptr() };
        let act = if layer.opts.fp8_act_epilogue && HopperFp8Gemm::writes_fp8_activation(2 * i) {
            // The epilogue writes the activation's codes: its own buffer, since the up
            // projection still reads the input's.
            let q = Fp8Rows::at_least(&mut rows.act, s, r.rows * i)?;
            let act = Fp8Operand { codes: dptr(&q.codes, g), scales: dptr(&q.scales, g) };
            gemm.run(s, w13, [2 * i, h], a, GemmOut::Fp8(act), [r.rows, r.busy], dev, r.experts, up, gather)?;
            mark(4)?;
            act
        } else {
            gemm.run(s, w13, [2 * i, h], a, GemmOut::Bf16(r.act), [r.rows, r.busy], dev, r.experts, up, gather)?;
            mark(4)?;
            // The activation's codes take the input's buffer: the stream runs this after the
            // up projection has read the rows'.
            let counts = if r.cap > 0 { r.counts } else { 0 };
            let q = layer.quantize_rows_fp8(&mut rows.input, r.act, r.rows, i, r.cap, counts)?;
            Fp8Operand { codes: dptr(&q.codes, g), scales: dptr(&q.scales, g) }
        };
        mark(5)?;
        let w2 = Fp8Operand { codes: dptr(&fp8.w2, g), scales: dptr(&fp8.s2, g) };
        gemm.run(s, w2, [h, i], act, GemmOut::Bf16(r.y), [r.rows, r.busy], dev, r.experts, Epilogue::Product, None)?;
        mark(6)
    }
}
