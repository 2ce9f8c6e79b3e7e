//! The fp8 Hopper grouped GEMM's launcher (`kernels/grouped_gemm_fp8_sm90.cu`): fp8 e4m3 rows
//! (one f32 scale per 128 values) times fp8 e4m3 expert weights (one per 128 × 128 block) on
//! the fp8 tensor cores, every expert's rows in one persistent launch that reads the expert
//! counts and row offsets on the device, bf16 out, with the activation in the up projection's
//! epilogue (and optionally its quantization to fp8 for the down projection) and the rows
//! optionally gathered from the tokens by the kernel itself.

use super::err;
use super::hopper_gemm::{persistent_blocks, persistent_kernel, tensor_map, Epilogue, MAX_EXPERTS, MAX_SMEM};
use crate::error::{MoeError, Result};
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use std::sync::Mutex;

/// Weight rows of a tile.
const TILE_COLS: u32 = 128;

/// One of the kernel's entry points: its tile rows (64 a consumer warpgroup), ring stages,
/// threads (a producer warpgroup and the consumers) and blocks an SM. [`TILES_128`] keeps two
/// sets of partial sums, so a block's products run while the last block's are scaled in; the
/// others one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Variant {
    name: &'static str,
    rows: u32,
    stages: u32,
    threads: u32,
    /// Blocks an SM of the persistent grid.
    per_sm: u32,
}

const TILES_128: Variant = Variant { name: "grouped_gemm_fp8_sm90", rows: 128, stages: 6, threads: 384, per_sm: 1 };
const TILES_64: Variant = Variant { name: "grouped_gemm_fp8_sm90_short", rows: 64, stages: 9, threads: 256, per_sm: 1 };

/// 64-row tiles two blocks an SM, each over a 4-stage ring: one block's epilogue and tile
/// changes run while the other multiplies, for batches that give most experts rows.
const TILES_64_TWO: Variant =
    Variant { name: "grouped_gemm_fp8_sm90_short_two", rows: 64, stages: 4, threads: 256, per_sm: 2 };

/// Decode tiles: up to 16 rows of an expert by 128 weight rows, the products run with the
/// weights as `wgmma`'s rows and the tile's rows as its columns, over a 12-stage ring: at a few
/// rows an expert a thread then scales 16 partial sums into its accumulators a stage, not 64.
const TILES_16_DECODE: Variant =
    Variant { name: "grouped_gemm_fp8_sm90_decode", rows: 16, stages: 12, threads: 256, per_sm: 1 };

/// 128- and 64-row tiles of one set with the activation quantized in the epilogue.
const TILES_128_ACT_FP8: Variant =
    Variant { name: "grouped_gemm_fp8_sm90_act_fp8", rows: 128, stages: 6, threads: 384, per_sm: 1 };
const TILES_64_ACT_FP8: Variant =
    Variant { name: "grouped_gemm_fp8_sm90_short_act_fp8", rows: 64, stages: 9, threads: 256, per_sm: 1 };

/// Rows an expert on average up to which a product takes 64-row tiles, as the bf16 Hopper GEMM
/// does (its `SHORT_TO_ROWS`): their deeper ring keeps more weight bytes in flight.
const SHORT_TO_ROWS: usize = 32;

/// Rows an expert on average up to which a product without fp8 out takes the decode tiles
/// ([`TILES_16_DECODE`]).
const DECODE_TO_ROWS: usize = 4;

/// Rows in all up to which a product without fp8 out takes the decode tiles whatever its
/// experts (two tiles a column block at most): a one-expert GEMM, such as the shared expert's.
const DECODE_TO_ROWS_IN_ALL: usize = 32;

/// Rows an expert on average above which 64-row tiles run two blocks an SM
/// ([`TILES_64_TWO`]); at fewer, one block's deeper ring streams the weights faster
/// (docs/tuning.md).
const TWO_BLOCKS_ABOVE_ROWS: usize = 4;

/// Dynamic shared memory of variant `v` for `experts` experts: the ring of row and weight
/// tiles 128 codes deep, 1 KiB to align it, two weight scales, two mbarriers and a located
/// tile a stage, `experts + 1` tile offsets, a copy of the counts and row offsets, and the tile
/// a gathering producer works on.
fn smem_bytes(v: Variant, experts: usize) -> u32 {
    v.stages * ((v.rows + TILE_COLS) * 128 + 8 + 16 + 16) + 1024 + 4 * (3 * experts as u32 + 2)
}

/// `v`, or where its shared memory for `experts` experts exceeds an SM's (the deep rings of the
/// decode and 64-row tiles, beyond about 810 and 820 experts), the next taller tiles of the
/// same output that fit.
fn fitting(v: Variant, experts: usize) -> Variant {
    match v {
        _ if smem_bytes(v, experts) <= MAX_SMEM => v,
        TILES_64_ACT_FP8 => TILES_128_ACT_FP8,
        TILES_16_DECODE => fitting(TILES_64, experts),
        _ => TILES_128,
    }
}

/// fp8 codes `[rows, k]` at `codes` with their f32 scales `[rows, ceil(k / 128)]` at `scales`
/// (device pointers): rows of `A`, or with `[experts, ceil(n / 128), ceil(k / 128)]` block
/// scales an expert weight `W [experts · n, k]`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Fp8Operand {
    pub codes: u64,
    pub scales: u64,
}

/// What the GEMM writes for its `[rows, width]` output.
#[derive(Clone, Copy, Debug)]
pub(super) enum GemmOut {
    /// bf16 rows at this device address.
    Bf16(u64),
    /// fp8 codes with one scale per 128 values, as [`Fp8Operand`] rows: the activation of an
    /// up projection quantized in its epilogue for the down projection, with the codes and
    /// scales a separate pass over its bf16 values would give (`width` a multiple of 128).
    Fp8(Fp8Operand),
}

/// Rows of `A` gathered by the GEMM itself: row `r` is token `slot_of_row[r] / k` of `x`, the
/// tokens' codes and scales (as [`Fp8Operand`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct Fp8Gather {
    pub x: Fp8Operand,
    pub slot_of_row: u64,
    pub k: usize,
}

/// How a GEMM picks its entry point per batch: the tile rows and blocks an SM the options ask
/// for, and whether it leaves SMs free.
#[derive(Clone, Copy, Debug, Default)]
struct TileChoice {
    rows_asked: Option<u32>,
    blocks_asked: Option<u32>,
    /// Whether [`HopperFp8Gemm::leaving`] left SMs free (then one block an SM, so that the
    /// blocks stay off them).
    leaves_sms: bool,
}

impl TileChoice {
    /// The entry point for `rows` rows over `experts` experts: decode tiles up to
    /// [`DECODE_TO_ROWS`] rows an expert on average (or [`DECODE_TO_ROWS_IN_ALL`] rows in all),
    /// 64-row tiles up to [`SHORT_TO_ROWS`], else 128-row tiles (or as the options ask: 16, 64
    /// or 128 rows); 64-row tiles run two blocks an SM above [`TWO_BLOCKS_ABOVE_ROWS`] rows an
    /// expert (or as the options ask), unless the GEMM leaves SMs free; an activation quantized
    /// in the epilogue (`fp8_out`) takes the 64- or 128-row entry points that do that. Tiles
    /// whose shared memory would not fit take taller ones ([`fitting`]).
    fn variant(&self, rows: usize, experts: usize, fp8_out: bool) -> Variant {
        let decode = !fp8_out
            && match self.rows_asked {
                Some(r) => r == TILES_16_DECODE.rows,
                None => rows <= DECODE_TO_ROWS * experts.max(1) || rows <= DECODE_TO_ROWS_IN_ALL,
            };
        if decode {
            return fitting(TILES_16_DECODE, experts);
        }
        let short = match self.rows_asked {
            Some(r) => r != TILES_128.rows,
            None => rows <= SHORT_TO_ROWS * experts.max(1),
        };
        let two = !self.leaves_sms
            && match self.blocks_asked {
                Some(b) => b == TILES_64_TWO.per_sm,
                None => rows > TWO_BLOCKS_ABOVE_ROWS * experts.max(1),
            };
        let v = match (short, fp8_out) {
            (true, false) if two => TILES_64_TWO,
            (true, false) => TILES_64,
            (true, true) => TILES_64_ACT_FP8,
            (false, true) => TILES_128_ACT_FP8,
            (false, false) => TILES_128,
        };
        fitting(v, experts)
    }
}

/// The kernel's entry points ([`TILES_128`], [`TILES_64`], [`TILES_64_TWO`],
/// [`TILES_16_DECODE`] and the two that quantize the activation), its persistent blocks (one an
/// SM, or two for [`TILES_64_TWO`]; every SM unless [`HopperFp8Gemm::leaving`] leaves some
/// free), their shared tile counter (as [`super::hopper_gemm::HopperGemm`]'s) and how it picks
/// its tiles.
pub(super) struct HopperFp8Gemm {
    f: CudaFunction,
    short: CudaFunction,
    act_fp8: CudaFunction,
    short_act_fp8: CudaFunction,
    short_two: CudaFunction,
    decode: CudaFunction,
    blocks: u32,
    next_tile: Mutex<CudaSlice<i32>>,
    choice: TileChoice,
}

impl HopperFp8Gemm {
    /// The kernel on a Hopper GPU (compute capability 9.0), when `opts` allow the Hopper GEMM;
    /// `None` elsewhere.
    pub(super) fn load(gpu: &super::Gpu, opts: &super::CudaOptions) -> Result<Option<Self>> {
        let cc = gpu.ctx.compute_capability().map_err(|e| err("compute capability", e))?;
        if cc != (9, 0) || !opts.expert_gemm.allows_hopper() {
            return Ok(None);
        }
        let load = |v: Variant| persistent_kernel(gpu, v.name, smem_bytes(v, MAX_EXPERTS));
        let (f, short) = (load(TILES_128)?, load(TILES_64)?);
        let (act_fp8, short_act_fp8) = (load(TILES_128_ACT_FP8)?, load(TILES_64_ACT_FP8)?);
        let (short_two, decode) = (load(TILES_64_TWO)?, load(TILES_16_DECODE)?);
        let (blocks, next_tile) = persistent_blocks(gpu)?;
        let choice =
            TileChoice { rows_asked: opts.gemm_tile_rows, blocks_asked: opts.gemm_tile_blocks, leaves_sms: false };
        Ok(Some(HopperFp8Gemm { f, short, act_fp8, short_act_fp8, short_two, decode, blocks, next_tile, choice }))
    }

    /// The same GEMM on all SMs but `sms` (at least one): for a GEMM that runs beside kernels
    /// that need SMs of their own, such as an expert-parallel layer's shared expert beside the
    /// dispatch, whose transport would otherwise wait for the GEMM's blocks to end.
    pub(super) fn leaving(mut self, sms: u32) -> Self {
        self.blocks = self.blocks.saturating_sub(sms).max(1);
        self.choice.leaves_sms = true;
        self
    }

    /// Whether the up projection over `n` weight rows (gate and up halves) can write its
    /// activation as fp8 codes with per-128 scales ([`GemmOut::Fp8`]): each half a whole number
    /// of 128-value groups.
    pub(super) fn writes_fp8_activation(n: usize) -> bool {
        n.is_multiple_of(256)
    }

    /// `C[r] = A[r] · W[x]ᵀ` for every expert `x < experts` and its rows `r` in
    /// `offsets[x] .. offsets[x] + counts[x]` (device ints; `busy` rows at most in all, which
    /// picks the tiles), `A` fp8 rows `[rows, kdim]`, `W`
    /// fp8 weights `[experts · n, kdim]` (see [`Fp8Operand`]), `C` `[rows, n]` written as `out`
    /// says (or, with an activation, `[rows, n / 2]`: see [`Epilogue`]); f32 sums, each
    /// 128-deep block scaled into them. `kdim` must be a multiple of 16, `n` of 8 (of 128 with
    /// an activation, whose halves then start on weight scale blocks; of 256 for fp8 out, which
    /// needs an activation). With `gather` the rows of `A` are read from the tokens it names
    /// instead of from `a`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run(
        &self,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
        w: Fp8Operand,
        [n, kdim]: [usize; 2],
        a: Fp8Operand,
        out: GemmOut,
        [rows, busy]: [usize; 2],
        [counts, offsets]: [u64; 2],
        experts: usize,
        epilogue: Epilogue,
        gather: Option<Fp8Gather>,
    ) -> Result<()> {
        if matches!(epilogue, Epilogue::Scatter { .. }) {
            return Err(MoeError::Unsupported("the fp8 Hopper grouped GEMM stores its rows in place".into()));
        }
        let (kind, alpha, limit, bias) = epilogue.kernel_args();
        let width_step = if kind >= 0 { 128 } else { 8 };
        if n % width_step != 0 || kdim % 16 != 0 || experts > MAX_EXPERTS {
            return Err(MoeError::Unsupported(format!(
                "the fp8 Hopper grouped GEMM needs widths divisible by {width_step}, depths by 16 and at most \
                 {MAX_EXPERTS} experts (got n {n}, k {kdim}, {experts} experts)"
            )));
        }
        let (c, q) = match out {
            GemmOut::Bf16(c) => (c, Fp8Operand { codes: 0, scales: 0 }),
            GemmOut::Fp8(q) if kind >= 0 && Self::writes_fp8_activation(n) => (0, q),
            GemmOut::Fp8(_) => {
                return Err(MoeError::Unsupported(format!(
                    "fp8 output from the fp8 Hopper grouped GEMM needs an activation over a width divisible by 256 \
                     (got n {n})"
                )))
            }
        };
        if rows == 0 || experts == 0 {
            return Ok(());
        }
        let v = self.choice.variant(busy, experts, q.codes != 0);
        let a_map = tensor_map(a.codes, rows, kdim, v.rows, 1)?;
        let w_map = tensor_map(w.codes, experts * n, kdim, TILE_COLS / 2, 1)?;
        let (ei, ni, ki) = (experts as i32, n as i32, kdim as i32);
        let counter = self.next_tile.lock().unwrap_or_else(|p| p.into_inner());
        let (next, _guard) = counter.device_ptr(stream);
        let cfg = LaunchConfig {
            grid_dim: (self.blocks * v.per_sm, 1, 1),
            block_dim: (v.threads, 1, 1),
            shared_mem_bytes: smem_bytes(v, experts),
        };
        let (a_scales, gx, gs, gk) = match gather {
            Some(g) => (g.x.scales, g.x.codes, g.slot_of_row, g.k as i32),
            None => (a.scales, 0u64, 0u64, 1i32),
        };
        // SAFETY: grouped_gemm_fp8_sm90(map, map, bf16*, int*, int*, int, int, int, int*, int,
        // float, float, float*, float*, float*, u8*, int*, int, u8*, float*) with its threads
        // and shared memory: the maps describe A's codes ([rows, kdim]) and W's ([experts · n,
        // kdim]); the scales hold a row's (or a token's) ceil(kdim / 128) and an expert's
        // ceil(n / 128) · ceil(kdim / 128); C holds `rows` rows of n (n / 2 with an
        // activation); counts and offsets hold `experts` ints placing rows inside `rows`; the
        // counter is two ints, zero at every launch; the bias, when given, `experts · n`
        // floats; a gather's slots name tokens of its x; fp8 out (then C is 0) holds `rows` rows
        // of n / 2 codes and n / 256 scales.
        unsafe {
            let f = match v {
                TILES_64 => &self.short,
                TILES_64_TWO => &self.short_two,
                TILES_128_ACT_FP8 => &self.act_fp8,
                TILES_64_ACT_FP8 => &self.short_act_fp8,
                TILES_16_DECODE => &self.decode,
                _ => &self.f,
            };
            let mut l = stream.launch_builder(f);
            l.arg(&a_map).arg(&w_map).arg(&c).arg(&counts).arg(&offsets).arg(&ei).arg(&ni).arg(&ki).arg(&next);
            l.arg(&kind).arg(&alpha).arg(&limit).arg(&bias);
            l.arg(&a_scales).arg(&w.scales).arg(&gx).arg(&gs).arg(&gk).arg(&q.codes).arg(&q.scales);
            l.launch(cfg)
        }
        .map(|_| ())
        .map_err(|e| err("grouped_gemm_fp8_sm90", e))
    }
}

#[cfg(test)]
mod tests {
    use super::super::{dptr, Gpu};
    use super::{fitting, smem_bytes, TileChoice, Variant, MAX_EXPERTS, MAX_SMEM};
    use super::{TILES_128, TILES_128_ACT_FP8, TILES_16_DECODE, TILES_64, TILES_64_ACT_FP8, TILES_64_TWO};

    /// The tiles each batch gets, by rows an expert on average (64 experts): decode tiles up to
    /// 4 without fp8 out (and up to 32 rows in all, a one-expert GEMM's), 64-row tiles up to
    /// 32, two blocks an SM above 4 unless the GEMM leaves SMs free (whatever the options ask),
    /// 128-row tiles above 32; the options' rows and blocks; the quantizing entry points for
    /// fp8 out; taller tiles where the deeper rings do not fit.
    #[test]
    fn each_batch_gets_the_tiles_its_rows_call_for() {
        let free = TileChoice::default();
        let picks = |c: TileChoice, rows_an_expert: usize, fp8_out: bool| c.variant(64 * rows_an_expert, 64, fp8_out);
        for (rows, want) in
            [(0, TILES_16_DECODE), (2, TILES_16_DECODE), (4, TILES_16_DECODE), (5, TILES_64_TWO), (32, TILES_64_TWO)]
        {
            assert_eq!(picks(free, rows, false), want, "{rows} rows an expert");
        }
        assert_eq!(picks(free, 1, true), TILES_64_ACT_FP8);
        assert_eq!(free.variant(32, 1, false), TILES_16_DECODE, "a one-expert GEMM of 32 rows");
        assert_eq!(free.variant(33, 1, false), TILES_128, "a one-expert GEMM of 33 rows");
        assert_eq!(free.variant(20, 1, true), TILES_64_ACT_FP8, "fp8 out of a one-expert GEMM of 20 rows");
        assert_eq!(free.variant(32, 4, false), TILES_16_DECODE, "32 rows of 4 experts");
        assert_eq!(picks(TileChoice { rows_asked: Some(16), ..free }, 512, false), TILES_16_DECODE);
        assert_eq!(picks(TileChoice { rows_asked: Some(16), ..free }, 1, true), TILES_64_ACT_FP8);
        // From 813 experts the decode ring no longer fits beside their counts; to 822 the
        // 64-row one does.
        assert_eq!(free.variant(64, 815, false), TILES_64, "decode rings past the SM's memory");
        assert_eq!(picks(free, 33, false), TILES_128);
        assert_eq!(picks(free, 512, false), TILES_128);
        assert_eq!(picks(free, 16, true), TILES_64_ACT_FP8);
        assert_eq!(picks(free, 64, true), TILES_128_ACT_FP8);
        let leaving = TileChoice { leaves_sms: true, ..free };
        let leaving_asked = TileChoice { blocks_asked: Some(2), ..leaving };
        for c in [leaving, leaving_asked] {
            assert_eq!(picks(c, 16, false), TILES_64, "a GEMM leaving SMs free runs one block an SM");
        }
        assert_eq!(picks(TileChoice { blocks_asked: Some(2), ..free }, 5, false), TILES_64_TWO);
        assert_eq!(picks(TileChoice { rows_asked: Some(64), blocks_asked: Some(2), ..free }, 3, false), TILES_64_TWO);
        assert_eq!(picks(TileChoice { blocks_asked: Some(1), ..free }, 16, false), TILES_64);
        assert_eq!(picks(TileChoice { rows_asked: Some(128), ..free }, 1, false), TILES_128);
        assert_eq!(picks(TileChoice { rows_asked: Some(64), ..free }, 512, false), TILES_64_TWO);
        assert_eq!(free.variant(8, MAX_EXPERTS, false), TILES_128, "64-row rings past the SM's memory");
    }

    /// Every entry point, up to the most experts the launcher takes, gets tiles whose shared
    /// memory fits an SM, of the same output; the 64-row tiles fit DeepSeek-V3's 256 experts
    /// as they are.
    #[test]
    fn every_choice_of_tiles_fits_in_shared_memory() {
        let all = [TILES_128, TILES_64, TILES_64_TWO, TILES_16_DECODE, TILES_128_ACT_FP8, TILES_64_ACT_FP8];
        let quantizes = |v: Variant| v.name.ends_with("act_fp8");
        for v in all {
            for experts in [1, 64, 256, 512, 900, MAX_EXPERTS] {
                let f = fitting(v, experts);
                assert!(smem_bytes(f, experts) <= MAX_SMEM, "{} at {experts} experts", f.name);
                assert_eq!(quantizes(f), quantizes(v), "{} became {}", v.name, f.name);
            }
            assert_eq!(fitting(v, 256), v, "{} at 256 experts", v.name);
        }
    }
    use super::{Epilogue, Fp8Gather, Fp8Operand, GemmOut, HopperFp8Gemm};
    use crate::backend::cuda::random_e4m3_codes as codes;
    use crate::experts::Activation;
    use crate::quant::fp8_e4m3_decode;
    use half::bf16;

    /// The up projection with its activation quantized in the epilogue (`GemmOut::Fp8`), two
    /// launches, against the activation's bf16 rows `bf16_out` (the same GEMM with bf16 out)
    /// quantized on the host: the same codes and scales bit for bit on the experts' rows, the
    /// other rows' poison left alone. A width that is not a multiple of 128 is refused.
    #[allow(clippy::type_complexity)]
    fn fp8_out_matches_a_separate_pass(
        gemm: &HopperFp8Gemm,
        (w, a, gather): (Fp8Operand, Fp8Operand, Option<Fp8Gather>),
        [n, k]: [usize; 2],
        dev: [u64; 2],
        (counts, offsets): (&[i32], &[i32]),
        epilogue: Epilogue,
        bf16_out: &[u16],
    ) {
        let gpu = Gpu::new(0).unwrap();
        let s = &gpu.stream;
        let (width, e) = (n / 2, counts.len());
        let rows = bf16_out.len() / width;
        let groups = width.div_ceil(128);
        let (code_poison, scale_poison) = (0x5au8, -3.0f32);
        let mut codes = s.clone_htod(&vec![code_poison; rows * width]).unwrap();
        let mut scales = s.clone_htod(&vec![scale_poison; rows * groups]).unwrap();
        let q = Fp8Operand { codes: dptr(&codes, &gpu), scales: dptr(&scales, &gpu) };
        let run = || gemm.run(s, w, [n, k], a, GemmOut::Fp8(q), [rows, rows], dev, e, epilogue, gather);
        if width % 128 != 0 {
            assert!(run().is_err(), "fp8 out over {width} columns was not refused");
            return;
        }
        let mut first = None;
        for _ in 0..2 {
            s.memcpy_htod(&vec![code_poison; rows * width], &mut codes).unwrap();
            s.memcpy_htod(&vec![scale_poison; rows * groups], &mut scales).unwrap();
            run().unwrap();
            first.get_or_insert_with(|| (s.clone_dtoh(&codes).unwrap(), s.clone_dtoh(&scales).unwrap()));
        }
        let (got_codes, got_scales) = (s.clone_dtoh(&codes).unwrap(), s.clone_dtoh(&scales).unwrap());
        assert!(
            first == Some((got_codes.clone(), got_scales.clone())),
            "width {width}: a second launch gives other bits"
        );
        let mut owned = vec![false; rows];
        for (&c, &o) in counts.iter().zip(offsets) {
            owned[o as usize..(o + c) as usize].iter_mut().for_each(|x| *x = true);
        }
        for r in 0..rows {
            let (code_row, scale_row) =
                (&got_codes[r * width..(r + 1) * width], &got_scales[r * groups..(r + 1) * groups]);
            if !owned[r] {
                assert!(code_row.iter().all(|&c| c == code_poison), "width {width}: codes of row {r} written");
                assert!(scale_row.iter().all(|&c| c == scale_poison), "width {width}: scales of row {r} written");
                continue;
            }
            let values: Vec<f32> =
                bf16_out[r * width..(r + 1) * width].iter().map(|&b| bf16::from_bits(b).to_f32()).collect();
            let want = crate::quant::quantize(crate::quant::QuantConfig::Fp8Block, &values, width).unwrap();
            assert_eq!(code_row, &want.data[..], "width {width}: codes of row {r}");
            assert_eq!(scale_row, &want.scales[..], "width {width}: scales of row {r}");
        }
    }

    /// The fp8 grouped GEMM, in 128- and 64-row tiles (one and two blocks an SM) and decode
    /// tiles (all with the 64-row tiles' bits), against an f64 product of the values the codes and
    /// scales stand for, with poisoned outputs: experts with 0, 1, a partial tile, exactly one
    /// tile and several tiles of rows (tails that the 128-row tiles run as decode tiles among
    /// them), grouped and padded layouts, widths that are not tile multiples and depths that
    /// are not multiples of the 128-deep stage; every activation in the epilogue (with and
    /// without a bias); rows gathered by the GEMM from a shuffled copy of the tokens (three
    /// slots a token); every activation also quantized in the epilogue; 900 experts, whose
    /// 64-row tiles do not fit and fall back to 128 rows. The second of two launches is
    /// checked, and has the first's bits. Needs a Hopper GPU; says loudly when it skips.
    #[test]
    fn fp8_grouped_gemm_matches_f64_and_leaves_other_rows_alone() {
        let name = "fp8_grouped_gemm_matches_f64_and_leaves_other_rows_alone";
        if crate::backend::cuda::skip_without_gpu(name) {
            return;
        }
        let gpu = Gpu::new(0).unwrap();
        let tiles = |rows| crate::backend::cuda::CudaOptions { gemm_tile_rows: Some(rows), ..Default::default() };
        let Some(gemm128) = HopperFp8Gemm::load(&gpu, &tiles(128)).unwrap() else {
            eprintln!("SKIPPED {name}: not a Hopper GPU");
            return;
        };
        let gemm64 = HopperFp8Gemm::load(&gpu, &tiles(64)).unwrap().expect("a Hopper GPU");
        let two = crate::backend::cuda::CudaOptions { gemm_tile_blocks: Some(2), ..tiles(64) };
        let gemm64x2 = HopperFp8Gemm::load(&gpu, &two).unwrap().expect("a Hopper GPU");
        let gemm16 = HopperFp8Gemm::load(&gpu, &tiles(16)).unwrap().expect("a Hopper GPU");
        let s = &gpu.stream;
        let acts = [Activation::Silu, Activation::GeluErf, Activation::GeluTanh, Activation::GPT_OSS];
        // (n, k, activation and whether it has a bias)
        type Case = (usize, usize, Option<(Activation, bool)>);
        // At 2048 columns the 128-row tiles outnumber an H100's SMs, so blocks take several.
        let mut cases: Vec<Case> =
            vec![(264, 208, None), (128, 128, None), (8, 16, None), (520, 1024, None), (2048, 256, None)];
        for (x, &act) in acts.iter().enumerate() {
            cases.push(([256, 384, 512, 256][x], 144 + 128 * x, Some((act, x < 2))));
        }
        let cases: Vec<_> = cases.into_iter().flat_map(|c| [(c, false), (c, true)]).collect();
        // Tails past whole 128-row tiles of 1, 5, 16, 22 and 44 rows: the 128-row tiles run those
        // of up to 32 as decode tiles.
        let counts: Vec<i32> = vec![0, 1, 127, 128, 300, 0, 5, 400, 150];
        // 900 experts, mostly empty, at most 4 rows an expert on average (so one block an SM):
        // past what the 64-row rings' shared memory holds, so the GEMM asked for 64-row tiles
        // takes the 128-row ones (`fitting`).
        let many: Vec<i32> = (0..900).map(|x| [1, 40, 130][x % 54 / 18] * (x % 18 == 0) as i32).collect();
        let many_rows = many.iter().sum::<i32>() as usize;
        assert_eq!(gemm64.choice.variant(many_rows, many.len(), false), TILES_128);
        assert_eq!(gemm64.choice.variant(many_rows, many.len(), true), TILES_128_ACT_FP8);
        // Every case in 128-row tiles and in decode tiles, and every other one in 64-row tiles,
        // one block an SM and two (an activation quantized in the epilogue runs 64-row tiles
        // one block an SM either way); a product and an activation over the 900 experts.
        let cases = cases
            .iter()
            .map(|&c| (c, &gemm128, &counts))
            .chain(cases.iter().step_by(2).map(|&c| (c, &gemm64, &counts)))
            .chain(cases.iter().step_by(2).map(|&c| (c, &gemm64x2, &counts)))
            .chain(cases.iter().map(|&c| (c, &gemm16, &counts)))
            .chain(
                [((128, 256, None), true), ((256, 128, Some((Activation::Silu, false))), true)]
                    .map(|c| (c, &gemm64, &many)),
            );
        for (((n, k, act), gathered), gemm, counts) in cases {
            // Gathered rows in the grouped layout, the others in the padded one.
            let (e, cap) = (counts.len(), *counts.iter().max().unwrap());
            let offsets: Vec<i32> = match gathered {
                true => counts.iter().scan(0, |acc, &c| Some(std::mem::replace(acc, *acc + c))).collect(),
                false => (0..e as i32).map(|x| x * cap).collect(),
            };
            let rows = if gathered { counts.iter().sum::<i32>() as usize } else { e * cap as usize };
            let (kb, nb) = (k.div_ceil(128), n.div_ceil(128));
            let width = if act.is_some() { n / 2 } else { n };
            let w = codes(e * n * k, 7 + n as u64);
            let a = codes(rows * k, 8 + k as u64);
            // Scales around 2^-6 .. 2^-4 so the products stay in range.
            let scale = |i: usize, salt: usize| (1 + (i * 7 + salt) % 5) as f32 / 64.0;
            let ws: Vec<f32> = (0..e * nb * kb).map(|i| scale(i, 1)).collect();
            let as_: Vec<f32> = (0..rows * kb).map(|i| scale(i, 3)).collect();
            let bias: Vec<f32> = crate::preset::uniform(e * n, 1.0, 9);
            let with_bias = matches!(act, Some((_, true)));
            let poison = 0x7fc1u16;
            let up8 = |v: &[u8]| s.clone_htod(v).unwrap();
            let up32 = |v: &[f32]| s.clone_htod(v).unwrap();
            let (wd, wsd, bd) = (up8(&w), up32(&ws), up32(&bias));
            let (ad, asd) = (up8(&a), up32(&as_));
            let mut cd = s.clone_htod(&vec![poison; rows * width]).unwrap();
            let (countd, offd) = (s.clone_htod(counts).unwrap(), s.clone_htod(&offsets).unwrap());
            let ptrs = [dptr(&countd, &gpu), dptr(&offd, &gpu)];
            // Row r of A is token (r · 7919) % rows of x, held by slot 3 · token + r % 3.
            let token = |r: usize| (r * 7919) % rows;
            let mut x = vec![0u8; rows * k];
            let mut xs = vec![0f32; rows * kb];
            for r in 0..rows {
                x[token(r) * k..(token(r) + 1) * k].copy_from_slice(&a[r * k..(r + 1) * k]);
                xs[token(r) * kb..(token(r) + 1) * kb].copy_from_slice(&as_[r * kb..(r + 1) * kb]);
            }
            let slot_of_row: Vec<i32> = (0..rows).map(|r| (3 * token(r) + r % 3) as i32).collect();
            let (xd, xsd, sd) = (up8(&x), up32(&xs), s.clone_htod(&slot_of_row).unwrap());
            let gather = gathered.then(|| Fp8Gather {
                x: Fp8Operand { codes: dptr(&xd, &gpu), scales: dptr(&xsd, &gpu) },
                slot_of_row: dptr(&sd, &gpu),
                k: 3,
            });
            let epilogue = match act {
                None => Epilogue::Product,
                Some((activation, b)) => Epilogue::Activation { activation, bias: if b { dptr(&bd, &gpu) } else { 0 } },
            };
            let wop = Fp8Operand { codes: dptr(&wd, &gpu), scales: dptr(&wsd, &gpu) };
            let aop = Fp8Operand { codes: dptr(&ad, &gpu), scales: dptr(&asd, &gpu) };
            let mut first = None;
            for _ in 0..2 {
                s.memcpy_htod(&vec![poison; rows * width], &mut cd).unwrap();
                let out = GemmOut::Bf16(dptr(&cd, &gpu));
                gemm.run(s, wop, [n, k], aop, out, [rows, rows], ptrs, e, epilogue, gather).unwrap();
                first.get_or_insert_with(|| s.clone_dtoh(&cd).unwrap());
            }
            let got = s.clone_dtoh(&cd).unwrap();
            // Each 64 rows of a 128-row tile take the products and the scaling of a 64-row tile,
            // two blocks an SM run each tile as one block does, and the decode tiles (alone, or a
            // 128-row tile's tail) sum the same products in the same order: the same bits.
            let same_bits = [(&gemm128, "128-row tiles"), (&gemm64x2, "two blocks an SM"), (&gemm16, "decode tiles")];
            if let Some((_, which)) = same_bits.iter().find(|(g, _)| std::ptr::eq(gemm, *g)) {
                s.memcpy_htod(&vec![poison; rows * width], &mut cd).unwrap();
                let out = GemmOut::Bf16(dptr(&cd, &gpu));
                gemm64.run(s, wop, [n, k], aop, out, [rows, rows], ptrs, e, epilogue, gather).unwrap();
                assert!(s.clone_dtoh(&cd).unwrap() == got, "n {n} k {k} act {act:?}: {which} against 64-row tiles");
            }
            let v = gemm.choice.variant(rows, e, false);
            let what =
                format!("{}-row tiles {} an SM, n {n} k {k} activation {act:?} gathered {gathered}", v.rows, v.per_sm);
            assert!(first.as_ref() == Some(&got), "{what}: a second launch gives other bits");
            // The values the codes and scales stand for, decoded once: A [rows, k], W [e n, k].
            let af: Vec<f64> =
                (0..rows * k).map(|i| fp8_e4m3_decode(a[i]) as f64 * as_[(i / k) * kb + i % k / 128] as f64).collect();
            let wf: Vec<f64> = (0..e * n * k)
                .map(|i| {
                    let (x, j, q) = (i / k / n, i / k % n, i % k);
                    fp8_e4m3_decode(w[i]) as f64 * ws[(x * nb + j / 128) * kb + q / 128] as f64
                })
                .collect();
            let mut owned = vec![false; rows];
            for (x, (&cnt, &off)) in counts.iter().zip(&offsets).enumerate() {
                // The exact sum and the sum of the products' magnitudes.
                let dot = |r: usize, j: usize| {
                    let col = (x * n + j) * k;
                    af[r * k..(r + 1) * k]
                        .iter()
                        .zip(&wf[col..col + k])
                        .map(|(p, q)| p * q)
                        .fold((0.0, 0.0), |(s, m), v| (s + v, m + v.abs()))
                };
                for r in off as usize..(off + cnt) as usize {
                    owned[r] = true;
                    for j in 0..width {
                        // The tensor cores' fp8 sums keep about 14 bits (DeepSeek-V3's report):
                        // over a block's 128 products that stays within 2^-10 of their
                        // magnitudes; the blocks add in f32, and the output rounds to bf16
                        // (2^-9 of it). An activation passes a sum's error on scaled by at
                        // most about 1 + |gate| + |up|.
                        let (want, tol) = match act {
                            None => {
                                let (v, m) = dot(r, j);
                                (v, m / 1024.0)
                            }
                            Some((activation, _)) => {
                                let b = |c: usize| if with_bias { bias[x * n + c] as f64 } else { 0.0 };
                                let ((g, mg), (u, mu)) = (dot(r, j), dot(r, width + j));
                                let (g, u) = (g + b(j), u + b(width + j));
                                (activation.apply_f64(g, u), (mg + mu) / 1024.0 * (1.0 + g.abs() + u.abs()))
                            }
                        };
                        let out = bf16::from_bits(got[r * width + j]).to_f64();
                        let bound = want.abs() / 256.0 + tol + 1e-6;
                        assert!((out - want).abs() <= bound, "{what}: expert {x} row {r} col {j}: {out} vs {want}");
                    }
                }
            }
            for (r, _) in owned.iter().enumerate().filter(|(_, &o)| !o) {
                assert!(got[r * width..(r + 1) * width].iter().all(|&x| x == poison), "{what}: row {r} written");
            }
            eprintln!("fp8 grouped GEMM matches f64: {what}");
            // (fp8 out takes 64-row tiles where decode tiles are asked for.)
            if act.is_some() && !std::ptr::eq(gemm, &gemm16) {
                fp8_out_matches_a_separate_pass(
                    gemm,
                    (wop, aop, gather),
                    [n, k],
                    ptrs,
                    (counts, &offsets),
                    epilogue,
                    &got,
                );
                eprintln!("  and its activation quantized in the epilogue has the separate pass's codes");
            }
        }
    }
}
