//! The masked grouped GEMM's launcher (`kernels/masked_gemm.cu`): every expert's rows counted
//! on the device, bf16 or fp8 (128 × 128 block) weights, bf16 rows in and out; with fp8
//! weights the rows can be quantized to fp8 first (one scale per 128 values, W8A8). The
//! low-latency layer runs it over its padded layout (no host read, so it can be captured);
//! the single-GPU layer runs it over its grouped layout when the experts are fp8.

use super::{dptr, err, CudaMoeLayer};
use crate::error::{MoeError, Result};
use cudarc::driver::{sys as drv, CudaSlice, LaunchConfig, PushKernelArg};

/// fp8 e4m3 codes of the rows a W8A8 GEMM reads, with one f32 scale per 128 values.
pub(super) struct Fp8Rows {
    /// Values the buffers hold.
    len: usize,
    pub(super) codes: CudaSlice<u8>,
    pub(super) scales: CudaSlice<f32>,
}

/// The fp8 rows of a layer's W8A8 GEMMs: the up projection's input (its rows, or the tokens
/// it gathers them from), those tokens' rows copied in expert order where the GEMM does not
/// gather them itself, and the activation the down projection reads.
#[derive(Default)]
pub(super) struct Fp8RowBuffers {
    pub(super) input: Option<Fp8Rows>,
    pub(super) gathered: Option<Fp8Rows>,
    pub(super) act: Option<Fp8Rows>,
}

/// Dynamic shared memory of the masked GEMM, the larger of its two forms (masked_gemm.cu):
/// bf16, 4 stages of 128 weight rows and 64 token rows 64 deep, 144 bytes apart; fp8 needs
/// 4 · (128 · 144 + 32 · 272) = 108544.
const MASKED_GEMM_SMEM: u32 = 4 * (128 + 64) * 72 * 2;

/// Lets `masked_gemm` take its shared memory (above the 48 KiB a launch gets by default).
pub(super) fn allow_masked_gemm_smem(f: &cudarc::driver::CudaFunction) -> Result<()> {
    f.set_attribute(
        drv::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        MASKED_GEMM_SMEM as i32,
    )
    .map_err(|e| err("masked_gemm shared memory", e))
}

/// Launch shape of the masked GEMM over `n` output columns of `experts` experts: 128 columns a
/// block, 128 threads (256 for fp8 weights).
fn masked_gemm_launch(n: usize, experts: usize, fp8: bool) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(128) as u32, experts as u32, 1),
        block_dim: (if fp8 { 256 } else { 128 }, 1, 1),
        shared_mem_bytes: MASKED_GEMM_SMEM,
    }
}

/// The two expert projections: gate and up (`w13`), down (`w2`).
#[derive(Clone, Copy)]
pub(super) enum Projection {
    Up,
    Down,
}

/// Whether the masked GEMM takes `config`'s shapes (`K % 8 == 0`, even `N`), unless `asked`
/// is cuBLAS over the whole padded layout.
pub(super) fn masked_gemm_fits(config: &crate::config::MoeConfig, asked: super::super::LowLatencyGemm) -> bool {
    let (h, i) = (config.hidden, config.inter);
    h % 8 == 0 && i % 8 == 0 && asked == super::super::LowLatencyGemm::Masked
}

impl CudaMoeLayer {
    /// Quantizes the rows of every expert GEMM to fp8 e4m3 first, one f32 scale per 128 values
    /// of a row (`QuantConfig::Fp8Block`), and multiplies fp8 by fp8 (DeepSeek-V3's W8A8 block
    /// scheme) in the masked GEMM; where cuBLAS runs instead (larger batches), on the values
    /// the codes stand for. Needs fp8 experts ([`CudaMoeLayer::fp8_experts`]) and depths that
    /// are multiples of 16.
    pub fn fp8_activations(mut self) -> Result<Self> {
        let (h, i) = (self.config.hidden, self.config.inter);
        if self.w.fp8.is_none() {
            return Err(MoeError::Config("fp8 activations need fp8 experts (fp8_experts first)".into()));
        }
        if h % 16 != 0 || i % 16 != 0 {
            return Err(MoeError::Unsupported(format!(
                "fp8 activations need hidden and intermediate sizes divisible by 16 (got {h} and {i})"
            )));
        }
        if !self.masked {
            return Err(MoeError::Unsupported(
                "fp8 activations run in the masked GEMM (the options ask for the padded low-latency GEMM)".into(),
            ));
        }
        self.w8a8 = true;
        // A low-latency layer set up before now copies its rows into the padded layout again.
        self.size_ll_rows()?;
        Ok(self)
    }

    /// Whether the expert GEMMs quantize their rows to fp8 (see [`CudaMoeLayer::fp8_activations`]).
    pub fn has_fp8_activations(&self) -> bool {
        self.w8a8
    }

    /// `C[b_x + r] = A[b_x + r] · W[x]ᵀ` for every expert `x` held here and `r < counts[x]`
    /// (read on the device), where expert `x`'s rows start at `b_x = offsets[x]` (grouped
    /// layout, `rows` rows in all), or at `x·cap` when `offsets` is 0 (padded layout, `rows`
    /// = experts · cap), with the weights of `projection`: fp8 codes when the layer holds them
    /// (and their depth is a multiple of 16), else bf16; bf16 in and out, f32 accumulation.
    /// With fp8 activations the rows are quantized first and the product is fp8 × fp8.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn masked_gemm(
        &self,
        projection: Projection,
        [a, c]: [u64; 2],
        cap: usize,
        counts: u64,
        offsets: u64,
        rows: usize,
    ) -> Result<()> {
        let (h, i) = (self.config.hidden, self.config.inter);
        let (w, n, kdim, fp8) = match projection {
            Projection::Up => (&self.w.w13, 2 * i, h, self.w.fp8.as_ref().map(|f| (&f.w13, &f.s13))),
            Projection::Down => (&self.w.w2, h, i, self.w.fp8.as_ref().map(|f| (&f.w2, &f.s2))),
        };
        let fp8 = fp8.filter(|_| kdim % 16 == 0);
        let experts = w.len() / (n * kdim);
        let (capi, ni, ki) = (cap as i32, n as i32, kdim as i32);
        let cfg = masked_gemm_launch(n, experts, fp8.is_some());
        let s = &self.gpu.stream;
        if let (Some((codes, scales)), true) = (fp8, self.w8a8) {
            let mut guard = self.fp8_rows.lock().unwrap_or_else(|p| p.into_inner());
            let q =
                self.quantize_rows_fp8(&mut guard.input, a, rows, kdim, cap, if offsets == 0 { counts } else { 0 })?;
            let (wp, sp, qa, qs) = (
                dptr(codes, &self.gpu),
                dptr(scales, &self.gpu),
                dptr(&q.codes, &self.gpu),
                dptr(&q.scales, &self.gpu),
            );
            // SAFETY: masked_gemm_w8a8(u8*, float*, u8*, float*, bf16*, int*, int*, int, int, int):
            // W holds `experts` [n, kdim] code matrices and their block scales, the row codes
            // and scales the `rows` rows just quantized; C, counts and offsets as below.
            return unsafe {
                let mut l = s.launch_builder(&self.k.masked_gemm_w8a8);
                l.arg(&wp).arg(&sp).arg(&qa).arg(&qs).arg(&c).arg(&counts).arg(&offsets).arg(&capi).arg(&ni).arg(&ki);
                l.launch(cfg)
            }
            .map(|_| ())
            .map_err(|e| err("masked_gemm_w8a8", e));
        }
        // SAFETY: masked_gemm(bf16*, bf16*, bf16*, int*, int*, int, int, int) and
        // masked_gemm_fp8(u8*, float*, bf16*, bf16*, int*, int*, int, int, int): W holds
        // `experts` [n, kdim] matrices (and their block scales), A and C the rows the counts
        // and offsets (or cap) place, counts and offsets one int per expert; kdim % 8 == 0 (16
        // for fp8) and n is even (`masked`).
        unsafe {
            match fp8 {
                Some((codes, scales)) => {
                    let (wp, sp) = (dptr(codes, &self.gpu), dptr(scales, &self.gpu));
                    let mut l = s.launch_builder(&self.k.masked_gemm_fp8);
                    l.arg(&wp).arg(&sp).arg(&a).arg(&c).arg(&counts).arg(&offsets).arg(&capi).arg(&ni).arg(&ki);
                    l.launch(cfg)
                }
                None => {
                    let wp = dptr(w, &self.gpu);
                    let mut l = s.launch_builder(&self.k.masked_gemm);
                    l.arg(&wp).arg(&a).arg(&c).arg(&counts).arg(&offsets).arg(&capi).arg(&ni).arg(&ki);
                    l.launch(cfg)
                }
            }
        }
        .map(|_| ())
        .map_err(|e| err("masked_gemm", e))
    }

    /// The device addresses of the fp8 rows' codes and scales: the input's, the gathered
    /// rows', then the activation's (0 before the first use). [`CudaMoeLayer::quantize_rows_fp8`]
    /// and [`Fp8Rows::at_least`] move them when they grow the buffers.
    pub(super) fn fp8_rows_at(&self) -> [[u64; 2]; 3] {
        let rows = self.fp8_rows.lock().unwrap_or_else(|p| p.into_inner());
        let at = |q: &Option<Fp8Rows>| {
            q.as_ref().map_or([0, 0], |q| [dptr(&q.codes, &self.gpu), dptr(&q.scales, &self.gpu)])
        };
        [at(&rows.input), at(&rows.gathered), at(&rows.act)]
    }

    /// The `rows` bf16 rows of `kdim` values at `a` as fp8 codes with one scale per 128 values,
    /// in `buf` (grown when short; it is sized at the first, uncaptured, run of a graph, and
    /// the layer's graphs are dropped when it moves).
    /// Padded rows (`counts` given: row r past `counts[r / cap]`) are skipped.
    pub(super) fn quantize_rows_fp8<'a>(
        &self,
        buf: &'a mut Option<Fp8Rows>,
        a: u64,
        rows: usize,
        kdim: usize,
        cap: usize,
        counts: u64,
    ) -> Result<&'a Fp8Rows> {
        let q = Fp8Rows::at_least(buf, &self.gpu.stream, rows * kdim)?;
        let out = [dptr(&q.codes, &self.gpu), dptr(&q.scales, &self.gpu), 0];
        self.quantize_rows_on(&self.gpu.stream, a, [rows, kdim], cap, counts, out)?;
        Ok(q)
    }

    /// Rounds the `rows` bf16 rows of `kdim` values at `x`, in place, to the values their fp8
    /// codes (one scale per 128 values) stand for: the rows of a W8A8 GEMM, for the cuBLAS
    /// paths that multiply bf16 values.
    pub(super) fn round_rows_fp8(&self, x: u64, rows: usize, kdim: usize) -> Result<()> {
        self.quantize_rows_on(&self.gpu.stream, x, [rows, kdim], 1, 0, [0, 0, x])
    }

    /// Quantizes the `rows` bf16 rows of `kdim` values at `a` to fp8 e4m3 with one scale per
    /// 128 values, on `stream`, writing (where the address is not 0) the codes `[rows, kdim]`,
    /// the scales `[rows, ceil(kdim / 128)]` and the bf16 values the codes stand for
    /// `[rows, kdim]` (which may be `a` itself: each lane reads its values before writing
    /// them). With `counts` given, row r past `counts[r / cap]` is skipped (a padded layout).
    pub(super) fn quantize_rows_on(
        &self,
        stream: &cudarc::driver::CudaStream,
        a: u64,
        [rows, kdim]: [usize; 2],
        cap: usize,
        counts: u64,
        [codes, scales, values]: [u64; 3],
    ) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        let (ki, group, kind, capi, rows_l) = (kdim as i32, 128i32, 2i32, cap.max(1) as i32, rows as i64);
        let cfg = super::super::quant::quantize_launch(rows, kdim, 128);
        // SAFETY: quantize_rows_bf16(bf16*, long, int, int, int, int*, int, u8*, float*, bf16*)
        // over `rows` rows of kdim values at `a`; the caller's codes, scales and values (each
        // null or holding rows · kdim codes, rows · ceil(kdim / 128) scales, rows · kdim
        // values); counts (or null) one int per expert.
        unsafe {
            stream
                .launch_builder(&self.k.quantize_bf16)
                .arg(&a)
                .arg(&rows_l)
                .arg(&ki)
                .arg(&group)
                .arg(&kind)
                .arg(&counts)
                .arg(&capi)
                .arg(&codes)
                .arg(&scales)
                .arg(&values)
                .launch(cfg)
        }
        .map(|_| ())
        .map_err(|e| err("quantize_rows_bf16", e))
    }
}

impl Fp8Rows {
    /// Buffers for the codes and scales of `len` values (rows of depths that are multiples of
    /// 16, so at most `len / 16` groups of 128), on `stream`.
    pub(super) fn new(stream: &std::sync::Arc<cudarc::driver::CudaStream>, len: usize) -> Result<Self> {
        Ok(Fp8Rows {
            len,
            codes: stream.alloc_zeros::<u8>(len.max(1)).map_err(|e| err("allocating fp8 rows", e))?,
            scales: stream.alloc_zeros::<f32>(len / 16 + 1).map_err(|e| err("allocating fp8 rows", e))?,
        })
    }

    /// The buffers in `buf`, replaced by ones for `len` values when they hold fewer.
    pub(super) fn at_least<'a>(
        buf: &'a mut Option<Fp8Rows>,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
        len: usize,
    ) -> Result<&'a Fp8Rows> {
        if buf.as_ref().is_none_or(|q| q.len < len) {
            *buf = Some(Fp8Rows::new(stream, len)?);
        }
        Ok(buf.as_ref().expect("allocated above"))
    }
}

#[cfg(test)]
mod tests {
    use super::super::{dptr, Gpu};
    use crate::quant::{QuantConfig, WeightQuant};
    use cudarc::driver::PushKernelArg;
    use half::bf16;

    /// The masked GEMM, bf16 and fp8 weights (and fp8 rows, W8A8), against an f64 product of
    /// the same values, with poisoned outputs: widths that are not multiples of the tile (and
    /// of the fp8 scale blocks), counts of 0, 1, a partial tile, exactly one pass, more than
    /// one pass, and the whole capacity. Needs a GPU; says loudly when it skips.
    #[test]
    fn masked_gemm_matches_f64_and_leaves_masked_rows_alone() {
        if crate::backend::cuda::skip_without_gpu("masked_gemm_matches_f64_and_leaves_masked_rows_alone") {
            return;
        }
        let gpu = Gpu::new(0).unwrap();
        let s = &gpu.stream;
        for kernel in ["masked_gemm", "masked_gemm_fp8", "masked_gemm_w8a8"] {
            let fp8 = kernel != "masked_gemm";
            let f = gpu.function(kernel).unwrap();
            super::allow_masked_gemm_smem(&f).unwrap();
            let shapes =
                if fp8 { [(200usize, 144usize), (256, 64), (130, 16)] } else { [(200, 136), (256, 64), (130, 8)] };
            for (n, k) in shapes {
                let cap = 130;
                let counts: Vec<i32> = vec![0, 1, 17, 64, 65, 130];
                let e = counts.len();
                let bits = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x).to_bits()).collect::<Vec<u16>>();
                let w32 = crate::preset::uniform(e * n * k, 1.0, 5);
                let a = bits(&crate::preset::uniform(e * cap * k, 1.0, 6));
                let poison = 0x7fc1u16; // a NaN that no product yields
                let (ad, cd) = (s.clone_htod(&a).unwrap(), s.clone_htod(&vec![poison; e * cap * n]).unwrap());
                let countd = s.clone_htod(&counts).unwrap();
                let (ap, cp, np) = (dptr(&ad, &gpu), dptr(&cd, &gpu), dptr(&countd, &gpu));
                let (capi, ni, ki) = (cap as i32, n as i32, k as i32);
                let cfg = super::masked_gemm_launch(n, e, fp8);
                let mut rows: Vec<f64> = a.iter().map(|&x| bf16::from_bits(x).to_f64()).collect();
                // The weights as the kernel sees them, in f64.
                let weights: Vec<f64> = if fp8 {
                    let q = WeightQuant::Fp8Block(128);
                    let (codes, scales) = q.quantize(&w32, e, n, k).unwrap();
                    let (wd, sd) = (s.clone_htod(&codes).unwrap(), s.clone_htod(&scales).unwrap());
                    let (wp, sp) = (dptr(&wd, &gpu), dptr(&sd, &gpu));
                    if kernel == "masked_gemm_w8a8" {
                        // The rows as fp8 codes with a scale per 128 values, quantized on the host.
                        let a32: Vec<f32> = rows.iter().map(|&x| x as f32).collect();
                        let qa = crate::quant::quantize(QuantConfig::Fp8Block, &a32, k).unwrap();
                        rows = crate::quant::dequantize(&qa).into_iter().map(f64::from).collect();
                        let (qd, qsd) = (s.clone_htod(&qa.data).unwrap(), s.clone_htod(&qa.scales).unwrap());
                        let (qp, qsp) = (dptr(&qd, &gpu), dptr(&qsd, &gpu));
                        // SAFETY: buffers sized as the kernel reads and writes them (see masked_gemm_w8a8).
                        unsafe {
                            let mut l = s.launch_builder(&f);
                            l.arg(&wp).arg(&sp).arg(&qp).arg(&qsp).arg(&cp).arg(&np).arg(&0u64);
                            l.arg(&capi).arg(&ni).arg(&ki).launch(cfg).unwrap();
                        }
                        s.synchronize().unwrap();
                    } else {
                        // SAFETY: buffers sized as the kernel reads and writes them (see masked_gemm_fp8).
                        unsafe {
                            let mut l = s.launch_builder(&f);
                            l.arg(&wp).arg(&sp).arg(&ap).arg(&cp).arg(&np).arg(&0u64).arg(&capi).arg(&ni).arg(&ki);
                            l.launch(cfg).unwrap();
                        }
                        s.synchronize().unwrap();
                    }
                    q.dequantize(&codes, &scales, e, n, k).into_iter().map(f64::from).collect()
                } else {
                    let w = bits(&w32);
                    let wd = s.clone_htod(&w).unwrap();
                    let wp = dptr(&wd, &gpu);
                    // SAFETY: buffers sized as the kernel reads and writes them (see masked_gemm).
                    unsafe {
                        let mut l = s.launch_builder(&f);
                        l.arg(&wp).arg(&ap).arg(&cp).arg(&np).arg(&0u64).arg(&capi).arg(&ni).arg(&ki);
                        l.launch(cfg).unwrap();
                    }
                    s.synchronize().unwrap();
                    w.iter().map(|&x| bf16::from_bits(x).to_f64()).collect()
                };
                let got = s.clone_dtoh(&cd).unwrap();
                let v = |x: u16| bf16::from_bits(x).to_f64();
                for (x, &cnt) in counts.iter().enumerate() {
                    for r in 0..cap {
                        for j in 0..n {
                            let out = got[(x * cap + r) * n + j];
                            let what = format!("{kernel}, n {n} k {k}: expert {x} row {r} col {j}");
                            if r >= cnt as usize {
                                assert_eq!(out, poison, "{what}: past its count, written");
                                continue;
                            }
                            let want: f64 =
                                (0..k).map(|q| rows[(x * cap + r) * k + q] * weights[(x * n + j) * k + q]).sum();
                            let tol = 1e-2 * (1.0 + want.abs());
                            assert!((v(out) - want).abs() <= tol, "{what}: {} vs {want}", v(out));
                        }
                    }
                }
            }
        }
    }
}
