//! The Hopper grouped GEMM's launcher (`kernels/grouped_gemm_sm90.cu`): every expert's rows in
//! one persistent wgmma launch, expert counts and row offsets read on the device, operands
//! streamed by TMA through descriptors encoded here (or, for an up projection, token rows
//! gathered by the kernel itself: [`Gather`]), with the activation in the up projection's
//! epilogue ([`Epilogue`]).

use super::{act_params, err, CudaMoeLayer};
use crate::error::{MoeError, Result};
use crate::experts::Activation;
use cudarc::driver::{sys as drv, CudaFunction, CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};
use std::sync::Mutex;

/// Most experts one launch takes (the kernel keeps three ints per expert in shared memory).
pub(super) const MAX_EXPERTS: usize = 1024;

/// Experts from which a one-GPU layer with a shared expert takes the Hopper GEMM below 2 rows
/// an expert too (see [`CudaMoeLayer::hopper_for`]).
const MANY_EXPERTS: usize = 256;

/// Most shared memory a block may take on Hopper (227 KiB).
pub(super) const MAX_SMEM: u32 = 227 * 1024;

/// Rows an expert on average up to which a product takes the short kernel's 64-row tiles
/// (see [`HopperGemm::short_for`]): below it their deeper ring keeps more weight bytes in
/// flight; above it experts past 64 rows stream their weights twice (docs/tuning.md).
const SHORT_TO_ROWS: usize = 32;

/// One of the kernel's entry points: its tile rows (the boxes TMA reads from `A`), the rows
/// past them that an expert's last tile takes where they end the expert (`GG_TAIL`, in boxes of
/// their own), tile columns (two boxes of half as many rows read from `W`), ring stages and
/// threads.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Variant {
    rows: u32,
    tail: u32,
    cols: u32,
    stages: u32,
    threads: u32,
}

/// `grouped_gemm_sm90`: 128 × 256 tiles, two consumer warpgroups, tails of up to 32 rows.
const TILES_128: Variant = Variant { rows: 128, tail: 32, cols: 256, stages: 4, threads: 384 };
/// `grouped_gemm_sm90_short`: 64 × 256 tiles, one consumer warpgroup, a deeper ring.
const TILES_64: Variant = Variant { rows: 64, tail: 0, cols: 256, stages: 5, threads: 256 };
/// `grouped_gemm_sm90_short224`: 64 × 224 tiles, products only (see
/// [`HopperGemm::narrow_for`]).
const TILES_64_NARROW: Variant = Variant { rows: 64, tail: 0, cols: 224, stages: 5, threads: 256 };

/// What the Hopper GEMM writes.
#[derive(Clone, Copy, Debug)]
pub(super) enum Epilogue {
    /// The product, `C [rows, n]`.
    Product,
    /// The up projection's activation: `W` holds each expert's `n = 2 I` gate rows then up
    /// rows, and `C [rows, I] = act(gate + b) · (up + b)` from the f32 accumulators, `b` the
    /// expert's row of the f32 bias `[experts, 2 I]` at `bias` (0: no bias).
    Activation { activation: Activation, bias: u64 },
    /// The product, each row `r` stored at the address `rows[r]` (a device array of `u64`s,
    /// one a row) instead of `C`'s row `r`: deterministic mode's down projection writing
    /// each slot's row into its home's window. The bf16 GEMM's 128-row tiles only.
    Scatter { rows: u64 },
}

impl Epilogue {
    /// The kernels' epilogue arguments: the activation kind (-1: the product), its alpha and
    /// limit (see `act_mul` in activation.cu), and the bias's device address (0: none).
    pub(super) fn kernel_args(self) -> (i32, f32, f32, u64) {
        match self {
            Epilogue::Product | Epilogue::Scatter { .. } => (-1, 0.0, 0.0, 0),
            Epilogue::Activation { activation, bias } => {
                let (kind, alpha, limit) = act_params(activation);
                (kind, alpha, limit, bias)
            }
        }
    }
}

/// Rows of `A` gathered by the GEMM itself: row `r` is row `slot_of_row[r] / k` of
/// `x [tokens, kdim]` (device pointers), as the permute would have copied it: bf16 values, or,
/// with `fp8_scales`, fp8 e4m3 codes with those scales (`[tokens, ceil(kdim / 128)]` f32), for
/// the fp8 GEMM. The rows of `x` start `stride` values apart: `kdim`, or more where they sit
/// inside larger records (the low-latency layer's received messages; bf16 only, 16-byte
/// aligned).
#[derive(Clone, Copy, Debug)]
pub(super) struct Gather {
    pub x: u64,
    pub fp8_scales: Option<u64>,
    pub tokens: usize,
    pub slot_of_row: u64,
    pub k: usize,
    pub stride: usize,
}

/// Dynamic shared memory of variant `v` for `experts` experts: the ring of row (with a tail's)
/// and weight tiles 64 deep (bf16), 1 KiB to align it, two mbarriers and a located tile a
/// stage, `experts + 1` tile offsets, a copy of the counts and row offsets, and the tile a
/// gathering producer works on.
fn smem_bytes(v: Variant, experts: usize) -> u32 {
    v.stages * ((v.rows + v.tail + v.cols) * 64 * 2 + 16 + 16) + 1024 + 4 * (3 * experts as u32 + 2)
}

/// A TMA descriptor, which the kernel takes by value.
#[repr(transparent)]
pub(super) struct TensorMap(drv::CUtensorMap);

// SAFETY: a plain 128-byte C struct, passed as a `__grid_constant__` kernel parameter.
unsafe impl DeviceRepr for TensorMap {}

/// Descriptor of the matrix `[rows, cols]` at `ptr` of `elem` bytes a value (2: bf16, 1: fp8
/// codes; row-major, rows 16-byte aligned), read in boxes of `box_rows` rows by 128 bytes,
/// 128-byte swizzled, zeros past its edges.
pub(super) fn tensor_map(ptr: u64, rows: usize, cols: usize, box_rows: u32, elem: usize) -> Result<TensorMap> {
    let dims = [cols as u64, rows as u64];
    let strides = [(elem * cols) as u64];
    let boxes = [128 / elem as u32, box_rows];
    let dtype = match elem {
        1 => drv::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        _ => drv::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
    };
    let unit = [1u32, 1];
    let mut map = std::mem::MaybeUninit::<drv::CUtensorMap>::uninit();
    // SAFETY: the arrays hold rank (2) entries (strides rank − 1); the address and stride are
    // 16-byte aligned, the box fits the 256-element and 128-byte swizzle limits.
    let status = unsafe {
        drv::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dtype,
            2,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            unit.as_ptr(),
            drv::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            drv::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            drv::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            drv::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if status != drv::CUresult::CUDA_SUCCESS {
        return Err(err("encoding a TMA descriptor", status));
    }
    // SAFETY: initialised by the successful call above.
    Ok(TensorMap(unsafe { map.assume_init() }))
}

/// The kernel, the SMs its persistent blocks fill, and the tile counter they share with the
/// count of blocks done claiming (zero at every launch: the last block done zeroes both).
pub(super) struct HopperGemm {
    f: CudaFunction,
    /// The same in 64-row tiles (`grouped_gemm_sm90_short`).
    short: CudaFunction,
    /// The same in 64 × 224 tiles (`grouped_gemm_sm90_short224`).
    narrow: CudaFunction,
    /// The 128-row tiles storing each row at its own address (`grouped_gemm_sm90_scatter`).
    scatter: CudaFunction,
    sms: u32,
    next_tile: Mutex<CudaSlice<i32>>,
    /// The tile height and the 64-row tiles' width the options ask for (`None`: per batch).
    rows_asked: Option<u32>,
    cols_asked: Option<u32>,
}

/// Kernel `name`, allowed `smem` bytes of dynamic shared memory (at most [`MAX_SMEM`]): an
/// entry point of the persistent grouped GEMMs.
pub(super) fn persistent_kernel(gpu: &super::Gpu, name: &str, smem: u32) -> Result<CudaFunction> {
    let f = gpu.function(name)?;
    f.set_attribute(
        drv::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem.min(MAX_SMEM) as i32,
    )
    .map_err(|e| err(&format!("{name} shared memory"), e))?;
    Ok(f)
}

/// The persistent grouped GEMMs' grid (a block per SM) and their shared tile counter: two
/// ints, zeroed here and left zero by every launch.
pub(super) fn persistent_blocks(gpu: &super::Gpu) -> Result<(u32, Mutex<CudaSlice<i32>>)> {
    let sms = gpu
        .ctx
        .attribute(drv::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| err("SM count", e))?;
    let next_tile = gpu.stream.alloc_zeros::<i32>(2).map_err(|e| err("allocating the tile counter", e))?;
    gpu.stream.synchronize().map_err(|e| err("zeroing the tile counter", e))?;
    Ok((sms.max(1) as u32, Mutex::new(next_tile)))
}

impl HopperGemm {
    /// The kernel on a Hopper GPU (compute capability 9.0, where the module is built for
    /// sm_90a), when `opts` do not ask for cuBLAS; `None` elsewhere.
    pub(super) fn load(gpu: &super::Gpu, opts: &super::CudaOptions) -> Result<Option<Self>> {
        let cc = gpu.ctx.compute_capability().map_err(|e| err("compute capability", e))?;
        if cc != (9, 0) || !opts.expert_gemm.allows_hopper() {
            return Ok(None);
        }
        let load = |name: &str, v: Variant| persistent_kernel(gpu, name, smem_bytes(v, MAX_EXPERTS));
        let (f, short) = (load("grouped_gemm_sm90", TILES_128)?, load("grouped_gemm_sm90_short", TILES_64)?);
        let narrow = load("grouped_gemm_sm90_short224", TILES_64_NARROW)?;
        let scatter = load("grouped_gemm_sm90_scatter", TILES_128)?;
        let (sms, next_tile) = persistent_blocks(gpu)?;
        Ok(Some(HopperGemm {
            f,
            short,
            narrow,
            scatter,
            sms,
            next_tile,
            rows_asked: opts.gemm_tile_rows,
            cols_asked: opts.gemm_tile_cols,
        }))
    }

    /// Whether a product over `rows` rows of `experts` experts takes 64-row tiles: up to
    /// [`SHORT_TO_ROWS`] rows an expert on average, where tiles mostly stream weights and the
    /// short kernel's deeper ring keeps more of them in flight.
    fn short_for(&self, rows: usize, experts: usize) -> bool {
        match self.rows_asked {
            // (The fp8 GEMM's decode height, 16, takes the 64-row tiles here.)
            Some(r) => r <= TILES_64.rows,
            None => rows <= SHORT_TO_ROWS * experts.max(1),
        }
    }

    /// Whether a product `n` wide over `rows` rows of `experts` experts, in 64-row tiles,
    /// takes them 224 columns wide: when that fills the SMs' last wave better than 256
    /// columns, counting the experts that random routing reaches, `experts · (1 − (1 −
    /// 1/experts)^rows)`. One token of DeepSeek-V3's down projection (7168 wide, 8 experts)
    /// makes 224 tiles of 256 columns on 132 SMs (1.7 a SM) or 256 of 224 (1.9 a SM). The tile
    /// width does not change any sum (each output's products are added in the same order).
    fn narrow_for(&self, rows: usize, experts: usize, n: usize) -> bool {
        if let Some(cols) = self.cols_asked {
            return cols == TILES_64_NARROW.cols;
        }
        let e = experts.max(1) as f64;
        let reached = e * (1.0 - (1.0 - 1.0 / e).powi(rows.min(1 << 20) as i32));
        let sms = self.sms as f64;
        let fill = |cols: usize| {
            let tiles = reached * n.div_ceil(cols) as f64;
            tiles / ((tiles / sms).ceil().max(1.0) * sms)
        };
        fill(TILES_64_NARROW.cols as usize) > fill(TILES_64.cols as usize)
    }

    /// `C[r] = A[r] · W[x]ᵀ` for every expert `x < experts` and its rows `r` in
    /// `offsets[x] .. offsets[x] + counts[x]` (device ints; `busy` rows at most in all, which
    /// picks the tiles), where `A` is `[rows, kdim]` at `a`, `C` is `[rows, n]` at `c` and `W`
    /// is `[experts, n, kdim]` at `w`; bf16, f32 accumulation. `kdim` and `n` must be
    /// multiples of 8 (16 with an activation, whose `C` is `[rows, n / 2]`: see [`Epilogue`]).
    /// With `gather` the rows of `A` are read from where it says instead of from `a` (see
    /// [`Gather`]). In 64-row tiles where [`HopperGemm::short_for`] says so (a product 224
    /// columns wide where [`HopperGemm::narrow_for`] says so), else in 128-row tiles, which
    /// [`Epilogue::Scatter`] always takes.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run(
        &self,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
        w: u64,
        shape: [usize; 2],
        ac: [u64; 2],
        [rows, busy]: [usize; 2],
        counts_offsets: [u64; 2],
        experts: usize,
        epilogue: Epilogue,
        gather: Option<Gather>,
    ) -> Result<()> {
        let product = matches!(epilogue, Epilogue::Product);
        let scatter = matches!(epilogue, Epilogue::Scatter { .. });
        let v = match self.short_for(busy, experts) && !scatter {
            true if product && self.narrow_for(busy, experts, shape[0]) => TILES_64_NARROW,
            true => TILES_64,
            false => TILES_128,
        };
        self.launch(stream, w, shape, ac, rows, counts_offsets, experts, epilogue, gather, v)
    }

    /// [`HopperGemm::run`] with the kernel variant `v`.
    #[allow(clippy::too_many_arguments)]
    fn launch(
        &self,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
        w: u64,
        [n, kdim]: [usize; 2],
        [a, c]: [u64; 2],
        rows: usize,
        [counts, offsets]: [u64; 2],
        experts: usize,
        epilogue: Epilogue,
        gather: Option<Gather>,
        v: Variant,
    ) -> Result<()> {
        let (kind, alpha, limit, bias) = epilogue.kernel_args();
        let width_step = if kind >= 0 { 16 } else { 8 };
        if n % width_step != 0 || kdim % 8 != 0 || experts > MAX_EXPERTS {
            return Err(MoeError::Unsupported(format!(
                "the Hopper grouped GEMM needs widths divisible by {width_step} and at most {MAX_EXPERTS} \
                 experts (got n {n}, k {kdim}, {experts} experts)"
            )));
        }
        if gather.is_some_and(|g| g.fp8_scales.is_some()) {
            return Err(MoeError::Unsupported("the bf16 Hopper grouped GEMM cannot gather fp8 rows".into()));
        }
        if rows == 0 || experts == 0 {
            return Ok(());
        }
        let a_map = tensor_map(a, rows, kdim, v.rows, 2)?;
        // Variants without tails never read the tail's descriptor: they take A's again, with no
        // second encoding on the launch path.
        let tail_map = if v.tail > 0 { Some(tensor_map(a, rows, kdim, v.tail, 2)?) } else { None };
        if v.cols != 256 && !matches!(epilogue, Epilogue::Product) {
            return Err(MoeError::Unsupported(
                "the Hopper grouped GEMM's activation in tiles other than 256 wide".into(),
            ));
        }
        let (scatter, out_rows) = match epilogue {
            Epilogue::Scatter { rows } if v == TILES_128 => (true, rows),
            Epilogue::Scatter { .. } => {
                return Err(MoeError::Unsupported(
                    "the Hopper grouped GEMM scatters its rows in 128-row tiles only".into(),
                ))
            }
            _ => (false, 0u64),
        };
        let w_map = tensor_map(w, experts * n, kdim, v.cols / 2, 2)?;
        let (ei, ni, ki) = (experts as i32, n as i32, kdim as i32);
        // Launches through this lock run one after another on the device (one stream a layer).
        let counter = self.next_tile.lock().unwrap_or_else(|p| p.into_inner());
        let (next, _guard) = counter.device_ptr(stream);
        let cfg = LaunchConfig {
            grid_dim: (self.sms, 1, 1),
            block_dim: (v.threads, 1, 1),
            shared_mem_bytes: smem_bytes(v, experts),
        };
        // SAFETY: grouped_gemm_sm90, _scatter, _short and _short224(map, map, map, bf16*, int*,
        // int*, int, int, int, int*, int, float, float, float*, bf16*, int*, int, long, u64*),
        // launched with their threads and shared memory: the maps describe A ([rows, kdim], in
        // boxes of the variant's tile rows, and of its tail's) and W ([experts · n, kdim]); C
        // holds `rows` rows of n (n / 2 with an activation); counts and offsets hold `experts`
        // ints that place rows inside A's `rows`; the counter is two ints, zero at every launch
        // (see `HopperGemm`); the bias, when given, holds `experts · n` floats; a gather's map
        // holds `rows` slots whose tokens are rows of its x, `stride` values apart; with
        // Scatter, `out_rows` holds an address of n writable bf16 values for each of the `rows`
        // rows (`C` is not written).
        unsafe {
            let f = match v {
                TILES_64 => &self.short,
                TILES_64_NARROW => &self.narrow,
                _ if scatter => &self.scatter,
                _ => &self.f,
            };
            let mut l = stream.launch_builder(f);
            l.arg(&a_map)
                .arg(&w_map)
                .arg(tail_map.as_ref().unwrap_or(&a_map))
                .arg(&c)
                .arg(&counts)
                .arg(&offsets)
                .arg(&ei)
                .arg(&ni)
                .arg(&ki)
                .arg(&next);
            l.arg(&kind).arg(&alpha).arg(&limit).arg(&bias);
            let (gx, gs, gk, gst) =
                gather.map_or((0u64, 0u64, 1i32, kdim as i64), |g| (g.x, g.slot_of_row, g.k as i32, g.stride as i64));
            l.arg(&gx).arg(&gs).arg(&gk).arg(&gst).arg(&out_rows);
            l.launch(cfg)
        }
        .map(|_| ())
        .map_err(|e| err("grouped_gemm_sm90", e))
    }
}

impl CudaMoeLayer {
    /// The Hopper grouped GEMM for `rows` rows over `experts` experts, when the GPU and shapes
    /// take it and it is the better choice: from 2 to 1024 rows an expert on average (2048 on
    /// one GPU without a shared expert, where cuBLAS's down projection varies widely from run
    /// to run; with a shared expert cuBLAS's per-expert GEMMs there leave SMs that the shared
    /// expert fills). Below 2 rows an expert cuBLAS's GEMM shapes wait for the expert counts on
    /// the host, so one GPU takes this kernel there when the batch replays a CUDA graph (see
    /// [`super::graph`]; only this kernel allows it), or without a shared expert, or with one
    /// and at least [`MANY_EXPERTS`] experts; with a shared expert and fewer experts cuBLAS's
    /// small GEMMs leave SMs to the shared expert beside them. Expert-parallel ranks keep
    /// cuBLAS below 2 rows. Always with [`super::ExpertGemm::Hopper`]. The measurements behind
    /// each bound are in docs/tuning.md.
    pub(super) fn hopper_for(&self, rows: usize, experts: usize) -> Option<&HopperGemm> {
        let (h, i) = (self.config.hidden, self.config.inter);
        let per_expert = rows / experts.max(1);
        let tokens = rows / self.config.top_k.max(1);
        let graphed = self.opts.cuda_graphs && tokens <= super::graph::GRAPH_TOKENS;
        let few_rows_here = self.ep.is_none() && (graphed || self.config.shared.is_none() || experts >= MANY_EXPERTS);
        let wanted = match self.opts.expert_gemm {
            super::ExpertGemm::Hopper => true,
            _ => {
                let most = if self.ep.is_none() && self.config.shared.is_none() { 2048 } else { 1024 };
                per_expert <= most && (per_expert >= 2 || few_rows_here)
            }
        };
        self.k.hopper.as_ref().filter(|_| wanted && h % 8 == 0 && i % 8 == 0)
    }

    /// Whether the up projection over `rows` rows of `experts` experts gathers its rows itself
    /// ([`Gather`]): the Hopper GEMM runs on the grouped layout (`cap` 0), and the rows need no
    /// rounding in place first (W8A8).
    pub(super) fn hopper_gathers(&self, rows: usize, experts: usize, cap: usize) -> bool {
        cap == 0 && !self.w8a8 && self.hopper_for(rows, experts).is_some()
    }

    /// The Hopper grouped GEMM for the low-latency layer's padded layout (it reads the counts
    /// on the device, so the layer stays capturable), with bf16 experts, where it is faster
    /// than the masked GEMM (docs/tuning.md); fp8 experts and other GPUs run the masked GEMM.
    pub(super) fn ll_hopper(&self) -> Option<&HopperGemm> {
        let (h, i) = (self.config.hidden, self.config.inter);
        let wanted = self.opts.expert_gemm.allows_hopper() && self.w.fp8.is_none();
        self.k.hopper.as_ref().filter(|_| wanted && h % 8 == 0 && i % 8 == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{dptr, Gpu};
    use super::{Epilogue, Gather, HopperGemm};
    use crate::experts::Activation;
    use half::bf16;

    /// The Hopper grouped GEMM against an f64 product of the same bf16 values, with poisoned
    /// outputs: experts with 0, 1, a partial tile, exactly one tile and several tiles of rows,
    /// widths that are not tile multiples (and depths that are not multiples of 64), grouped
    /// and padded layouts, experts spanning more than one group of row blocks; then the same
    /// with every activation in the epilogue (gate and up halves of `n`, with and without a
    /// bias), with the rows gathered by the GEMM from a shuffled copy (three slots a token),
    /// all in 128-row tiles (experts ending in tails they take, and in tiles of their own) and
    /// in 64-row tiles (products also 224 columns wide), the first and last bit for bit as
    /// 64 × 256 tiles; products in 128-row tiles also with every row stored at an address of
    /// its own, bit for bit.
    /// The second of two launches is checked. The f64 reference is computed once a case, for
    /// every tiling and gathering. Needs a Hopper GPU; says loudly when it skips.
    #[test]
    fn hopper_grouped_gemm_matches_f64_and_leaves_other_rows_alone() {
        if crate::backend::cuda::skip_without_gpu("hopper_grouped_gemm_matches_f64_and_leaves_other_rows_alone") {
            return;
        }
        let gpu = Gpu::new(0).unwrap();
        let Some(gemm) = HopperGemm::load(&gpu, &Default::default()).unwrap() else {
            eprintln!("SKIPPED hopper_grouped_gemm_matches_f64_and_leaves_other_rows_alone: not a Hopper GPU");
            return;
        };
        let s = &gpu.stream;
        let bits = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x).to_bits()).collect::<Vec<u16>>();
        let v = |x: u16| bf16::from_bits(x).to_f64();
        let acts = [Activation::Silu, Activation::GeluErf, Activation::GeluTanh, Activation::GPT_OSS];
        // (n, k, padded layout, activation and whether it has a bias)
        type Case = (usize, usize, bool, Option<(Activation, bool)>);
        let mut cases: Vec<Case> =
            vec![(264, 200, false, None), (256, 64, true, None), (8, 8, false, None), (520, 1000, false, None)];
        // Activations: I = n / 2 of 16 (less than a tile), 136 (a tile and a part) and 256.
        for (x, &act) in acts.iter().enumerate() {
            cases.push(([32, 272, 512, 272][x], 136 + 8 * x, x % 2 == 1, Some((act, x < 2))));
            cases.push((512, 64, false, Some((act, x >= 2))));
        }
        for (n, k, padded, act) in cases {
            // 2100 rows: 17 row blocks of 128 (33 of 64), more than one group of 16. Tails
            // that 128-row tiles take in an expert's last tile: 1 (129), 32 (160) and 17 rows
            // (273, the third tile); 161 and 300 end in a tile of their own.
            let counts: Vec<i32> = vec![0, 1, 127, 128, 300, 0, 5, 2100, 129, 160, 161, 273];
            let e = counts.len();
            let cap = 2100;
            let offsets: Vec<i32> = if padded {
                (0..e as i32).map(|x| x * cap as i32).collect()
            } else {
                counts.iter().scan(0, |acc, &c| Some(std::mem::replace(acc, *acc + c))).collect()
            };
            let rows = if padded { e * cap } else { counts.iter().sum::<i32>() as usize };
            let width = if act.is_some() { n / 2 } else { n };
            let w = bits(&crate::preset::uniform(e * n * k, 1.0, 7));
            let a = bits(&crate::preset::uniform(rows * k, 1.0, 8));
            let bias: Vec<f32> = crate::preset::uniform(e * n, 1.0, 9);
            let with_bias = matches!(act, Some((_, true)));
            let poison = 0x7fc1u16; // a NaN that no product yields
            let (wd, ad, bd) = (s.clone_htod(&w).unwrap(), s.clone_htod(&a).unwrap(), s.clone_htod(&bias).unwrap());
            let mut cd = s.clone_htod(&vec![poison; rows * width]).unwrap();
            let (countd, offd) = (s.clone_htod(&counts).unwrap(), s.clone_htod(&offsets).unwrap());
            let ptrs = [dptr(&countd, &gpu), dptr(&offd, &gpu)];
            // Row r of A is token (r · 7919) % rows of x, held by slot 3 · token + r % 3; x's
            // rows start k + 8 values apart, as rows inside larger records do.
            let token = |r: usize| (r * 7919) % rows;
            let xs = k + 8;
            let mut x = vec![0u16; rows * xs];
            for r in 0..rows {
                x[token(r) * xs..token(r) * xs + k].copy_from_slice(&a[r * k..(r + 1) * k]);
            }
            let slot_of_row: Vec<i32> = (0..rows).map(|r| (3 * token(r) + r % 3) as i32).collect();
            let (xd, sd) = (s.clone_htod(&x).unwrap(), s.clone_htod(&slot_of_row).unwrap());
            let epilogue = match act {
                None => Epilogue::Product,
                Some((activation, b)) => Epilogue::Activation { activation, bias: if b { dptr(&bd, &gpu) } else { 0 } },
            };
            // The f64 reference of each expert's rows (want[r · width + j]); `owned` marks them.
            let (af, wf): (Vec<f64>, Vec<f64>) = (a.iter().map(|&x| v(x)).collect(), w.iter().map(|&x| v(x)).collect());
            let mut want = vec![0.0f64; rows * width];
            let mut owned = vec![false; rows];
            for (x, (&cnt, &off)) in counts.iter().zip(&offsets).enumerate() {
                let dot = |r: usize, j: usize| {
                    let col = (x * n + j) * k;
                    af[r * k..(r + 1) * k].iter().zip(&wf[col..col + k]).map(|(p, q)| p * q).sum::<f64>()
                };
                for r in off as usize..(off + cnt) as usize {
                    owned[r] = true;
                    for j in 0..width {
                        want[r * width + j] = match act {
                            None => dot(r, j),
                            Some((activation, _)) => {
                                let b = |c: usize| if with_bias { bias[x * n + c] as f64 } else { 0.0 };
                                activation.apply_f64(dot(r, j) + b(j), dot(r, width + j) + b(width + j))
                            }
                        };
                    }
                }
            }
            // Every case also with its rows gathered, and both again in 64-row tiles, products
            // in 64 × 224 tiles too.
            let narrow = act.is_none().then_some(super::TILES_64_NARROW);
            let variants = [Some(super::TILES_128), Some(super::TILES_64), narrow].into_iter().flatten();
            for (variant, gathered) in variants.flat_map(|v| [(v, false), (v, true)]) {
                let gather = gathered.then(|| Gather {
                    x: dptr(&xd, &gpu),
                    fp8_scales: None,
                    tokens: rows,
                    slot_of_row: dptr(&sd, &gpu),
                    k: 3,
                    stride: xs,
                });
                // Twice, so the second launch shows the tile counter starts again from zero.
                for _ in 0..2 {
                    s.memcpy_htod(&vec![poison; rows * width], &mut cd).unwrap();
                    let ac = [dptr(&ad, &gpu), dptr(&cd, &gpu)];
                    gemm.launch(s, dptr(&wd, &gpu), [n, k], ac, rows, ptrs, e, epilogue, gather, variant).unwrap();
                }
                let got = s.clone_dtoh(&cd).unwrap();
                let what = format!(
                    "n {n} k {k} padded {padded} activation {act:?} gathered {gathered} tiles {} × {}",
                    variant.rows, variant.cols
                );
                if variant != super::TILES_64 {
                    // Narrower tiles add each output's products in the same order, and so do the
                    // 128-row tiles' tails with their operands swapped: the same bits.
                    let ac = [dptr(&ad, &gpu), dptr(&cd, &gpu)];
                    let wide = super::TILES_64;
                    gemm.launch(s, dptr(&wd, &gpu), [n, k], ac, rows, ptrs, e, epilogue, gather, wide).unwrap();
                    assert!(s.clone_dtoh(&cd).unwrap() == got, "{what}: bits differ from 64 × 256 tiles");
                }
                if variant == super::TILES_128 && act.is_none() {
                    // Each row stored at an address of its own (row r at row (7919 r + 13) mod
                    // rows of another buffer): the same bits there, and nothing else written.
                    let to = |r: usize| (r * 7919 + 13) % rows;
                    let moved = s.clone_htod(&vec![poison; rows * width]).unwrap();
                    let at: Vec<u64> = (0..rows).map(|r| dptr(&moved, &gpu) + (2 * to(r) * width) as u64).collect();
                    let at = s.clone_htod(&at).unwrap();
                    let scatter = Epilogue::Scatter { rows: dptr(&at, &gpu) };
                    let ac = [dptr(&ad, &gpu), dptr(&cd, &gpu)];
                    gemm.launch(s, dptr(&wd, &gpu), [n, k], ac, rows, ptrs, e, scatter, gather, variant).unwrap();
                    let moved = s.clone_dtoh(&moved).unwrap();
                    for r in 0..rows {
                        let row = &moved[to(r) * width..(to(r) + 1) * width];
                        match owned[r] {
                            true => {
                                assert!(row == &got[r * width..(r + 1) * width], "{what}: row {r} scattered differs")
                            }
                            false => {
                                assert!(row.iter().all(|&x| x == poison), "{what}: row {r} of no expert scattered")
                            }
                        }
                    }
                }
                for r in 0..rows {
                    let row = &got[r * width..(r + 1) * width];
                    if !owned[r] {
                        assert!(row.iter().all(|&x| x == poison), "{what}: row {r} of no expert written");
                        continue;
                    }
                    for (j, &o) in row.iter().enumerate() {
                        let (out, want) = (v(o), want[r * width + j]);
                        let tol = 1e-2 * (1.0 + want.abs());
                        assert!((out - want).abs() <= tol, "{what}: row {r} col {j}: {out} vs {want}");
                    }
                }
                eprintln!("hopper grouped GEMM matches f64: {what}");
            }
        }
    }
}
