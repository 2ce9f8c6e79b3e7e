//! The router GEMM on the tensor cores at f32 accuracy (router_tf32.cu: on `wgmma` on Hopper,
//! `router_partials_tf32_sm90`, else `mma.sync`, `router_partials_tf32`): logits `[T, E]` =
//! x `[T, H]` · gate `[E, H]`ᵀ + bias, each f32 product the sum of three TF32 products of the
//! operands' heads and tails (two where the gate holds TF32 values, whose tails are zero: the
//! `_tf32_gate` forms), the tensor cores' truncating sums cut every 32 columns and added in
//! f32. The depth is split so the grid fills the GPU; with more than one split,
//! `router_sum_fixed` adds the splits' partials in order.

use super::route::ROUTER_FIXED_COLS;
use super::{dptr, err, Buffers, CudaMoeLayer};
use crate::error::{MoeError, Result};
use cudarc::driver::sys as drv;
use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

/// Tokens and experts of a block's tile (`RT_BM`, `RT_BN` in router_tf32.cu).
const TILE: usize = 128;

/// Columns of a stage (`RT_BK`): a split's columns are a multiple of it.
const DEPTH: usize = 32;

/// Fewest columns a split takes (four stages), so a small batch's many splits still stream.
const MIN_COLS: usize = 128;

/// Floats between rows of a padded tile in shared memory (`RT_LD`).
const ROW_FLOATS: u32 = 36;

/// Stages of the `mma.sync` kernel's ring (`RT_STAGES`).
const STAGES: u32 = 3;

/// Stages of the `wgmma` kernel's ring (`RT_SM90_STAGES`): one chunk multiplying, one being
/// split, two loading.
const STAGES_SM90: u32 = 4;

/// Dynamic shared memory of `router_partials_tf32`: the stages of 128 token rows and 128 gate
/// rows, padded.
const SMEM: u32 = STAGES * (2 * TILE as u32) * ROW_FLOATS * 4;

/// Dynamic shared memory of `router_partials_tf32_sm90`: the stages of 128 padded token rows
/// and of the gate's 128 rows of 32 heads and 32 tails, plus 1 KiB to align the gate tiles.
const SMEM_SM90: u32 = STAGES_SM90 * (TILE as u32 * ROW_FLOATS * 4 + 2 * TILE as u32 * DEPTH as u32 * 4) + 1024;

/// A router kernel's forms: for any f32 gate (three TF32 products a product), for a gate of
/// TF32 values such as a checkpoint's bf16 router (`_tf32_gate`: the same bits from two
/// products, since the gate's tails are zero), and on Hopper for bf16 tokens and such a gate
/// (`_bf16_tokens`: the same bits from one product, since the tokens' tails are zero too).
pub(super) struct RouterForms {
    any_gate: CudaFunction,
    tf32_gate: CudaFunction,
    bf16_tokens: Option<CudaFunction>,
}

impl RouterForms {
    /// Kernel `name`, `name`_tf32_gate and with `bf16_tokens` `name`_bf16_tokens of
    /// router_tf32.cu, allowed `smem` bytes of shared memory (above the 48 KiB a launch gets by
    /// default).
    fn load(gpu: &super::Gpu, name: &str, smem: u32, bf16_tokens: bool) -> Result<Self> {
        let attr = drv::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        let bf16_tokens = match bf16_tokens {
            true => Some(gpu.function(&format!("{name}_bf16_tokens"))?),
            false => None,
        };
        let forms = RouterForms {
            any_gate: gpu.function(name)?,
            tf32_gate: gpu.function(&format!("{name}_tf32_gate"))?,
            bf16_tokens,
        };
        for f in [&forms.any_gate, &forms.tf32_gate].into_iter().chain(forms.bf16_tokens.as_ref()) {
            f.set_attribute(attr, smem as i32).map_err(|e| err(&format!("{name} shared memory"), e))?;
        }
        Ok(forms)
    }

    /// The `mma.sync` forms, for any GPU the module runs on.
    pub(super) fn load_mma_sync(gpu: &super::Gpu) -> Result<Self> {
        Self::load(gpu, "router_partials_tf32", SMEM, false)
    }

    /// The wgmma forms where the GPU is a Hopper (compute capability 9.0, where the module is
    /// built for sm_90a).
    pub(super) fn load_sm90(gpu: &super::Gpu) -> Result<Option<Self>> {
        let cc = gpu.ctx.compute_capability().map_err(|e| err("compute capability", e))?;
        if cc != (9, 0) {
            return Ok(None);
        }
        Self::load(gpu, "router_partials_tf32_sm90", SMEM_SM90, true).map(Some)
    }
}

/// Which kernel computes the tensor-core router's products: wgmma (Hopper) or `mma.sync`, in
/// the form for any gate or, with `tf32_gate`, the one for a gate of TF32 values (the layer's
/// gate must be one); with `bf16_tokens` (wgmma and `tf32_gate` too), the form that reads the
/// tokens' bf16 rows (`b.x_bf`) instead of their f32 ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct RouterKernel {
    pub(super) wgmma: bool,
    pub(super) tf32_gate: bool,
    pub(super) bf16_tokens: bool,
}

/// Whether every value of `gate` is a TF32 value (its low 13 mantissa bits zero), so that its
/// 3xTF32 tails are zero: bf16 values are.
pub(super) fn is_tf32(gate: &[f32]) -> bool {
    gate.iter().all(|v| v.to_bits() & 0x1fff == 0)
}

/// How the depth `h` of `t` tokens' router GEMM over `e` experts splits on a GPU of `sms` SMs:
/// (splits, columns a split). As many splits as bring the tiles to about one block an SM, each
/// at least [`MIN_COLS`] columns, a multiple of [`DEPTH`].
pub(super) fn splits(t: usize, e: usize, h: usize, sms: usize) -> (usize, usize) {
    let tiles = t.div_ceil(TILE).max(1) * e.div_ceil(TILE).max(1);
    let most = (h / MIN_COLS).max(1);
    let want = (sms / tiles).clamp(1, most);
    let cols = h.div_ceil(want).div_ceil(DEPTH).max(1) * DEPTH;
    (h.div_ceil(cols).max(1), cols)
}

/// Floats of partials the router of up to `t` tokens needs on a GPU of `sms` SMs (0 when one
/// split does: it writes the logits).
pub(super) fn partial_floats(t: usize, e: usize, h: usize, sms: usize) -> usize {
    // Every batch up to t; from sms · 128 tokens on, one split fills the GPU.
    (1..=t.min(sms * TILE))
        .chain(std::iter::once(t))
        .map(|m| match splits(m, e, h, sms) {
            (1, _) => 0,
            (s, _) => s * m * e,
        })
        .max()
        .unwrap_or(0)
}

impl CudaMoeLayer {
    /// Whether the router GEMM runs on the tensor cores (`router_partials_tf32`): the option
    /// on, the hidden size a multiple of 4 (its 16-byte copies) and at least a tile's
    /// [`TILE`] experts, or half of one for a gate of TF32 values on Hopper. With fewer, half
    /// a tile or more multiplies zeros and cuBLAS's f32 GEMM is as fast, except against
    /// wgmma's two products (docs/tuning.md).
    pub(super) fn router_on_tensor_cores(&self) -> bool {
        let e = self.config.num_experts;
        let half_tile = e >= TILE / 2 && self.k.router_tf32_sm90.is_some() && self.w.gate_is_tf32;
        self.opts.router_tf32 && self.config.hidden.is_multiple_of(4) && (e >= TILE || half_tile)
    }

    /// logits `[t, E]` in `b.logits` = x `[t, H]` · gate `[E, H]`ᵀ plus the gate's bias, on the
    /// tensor cores at f32 accuracy: with wgmma on Hopper, else `mma.sync` (two products a
    /// product where the gate holds TF32 values); and x's bf16 copy into `b.x_bf`, written as
    /// the router reads the tokens; with `b.tokens_bf16`, the tokens come from their bf16 rows
    /// and no copy is written.
    pub(super) fn router_tf32(&self, b: &Buffers, t: usize) -> Result<()> {
        let kernel = RouterKernel {
            wgmma: self.k.router_tf32_sm90.is_some(),
            tf32_gate: self.w.gate_is_tf32,
            bf16_tokens: b.tokens_bf16,
        };
        self.router_tf32_on(b, t, kernel)
    }

    /// Whether the router reads a batch of `t` bf16 tokens as they are (the tensor-core router's
    /// `_bf16_tokens` form, see [`CudaMoeLayer::router_tf32`]; the bits of the f32 form on the
    /// same values, so deterministic mode takes it too), so that nothing needs their f32 rows: a
    /// direct run (no low-latency capacity, no fused small-batch route) on Hopper with a gate of
    /// TF32 values, H a multiple of 8, and no shared expert gate (whose dot product reads the
    /// f32 rows).
    pub(super) fn routes_bf16_tokens(&self, t: usize) -> bool {
        self.k.router_tf32_sm90.as_ref().is_some_and(|f| f.bf16_tokens.is_some())
            && self.w.gate_is_tf32
            && self.router_on_tensor_cores()
            && self.capacity().is_none()
            && !self.routes_fused(t)
            && self.config.hidden.is_multiple_of(8)
            && self.w.shared.as_ref().is_none_or(|s| s.gate.is_none())
    }

    /// [`CudaMoeLayer::router_tf32`] with the given kernel.
    pub(super) fn router_tf32_on(&self, b: &Buffers, t: usize, kernel: RouterKernel) -> Result<()> {
        let (h, e) = (self.config.hidden, self.config.num_experts);
        let (split, cols) = splits(t, e, h, self.sms);
        self.router_tf32_split(b, t, kernel, (split, cols), b.router_split.as_ref())
    }

    /// Deterministic mode's router on the tensor cores: [`CudaMoeLayer::router_tf32`] with the
    /// depth split into blocks of [`ROUTER_FIXED_COLS`] columns whatever the batch, their
    /// partials (in `b.router_fixed`) added in column order, so that each logit is the same sum
    /// in the same order for any batch (a token's products do not depend on the other rows of
    /// its tile).
    pub(super) fn router_tf32_fixed(&self, b: &Buffers, t: usize) -> Result<()> {
        let h = self.config.hidden;
        let kernel = RouterKernel {
            wgmma: self.k.router_tf32_sm90.is_some(),
            tf32_gate: self.w.gate_is_tf32,
            bf16_tokens: b.tokens_bf16,
        };
        let depth = (h.div_ceil(ROUTER_FIXED_COLS), ROUTER_FIXED_COLS);
        self.router_tf32_split(b, t, kernel, depth, b.router_fixed.as_ref())
    }

    /// The tensor-core router with its depth in `split` blocks of `cols` columns (a multiple
    /// of [`DEPTH`]), their partials in `partials` where there is more than one.
    fn router_tf32_split(
        &self,
        b: &Buffers,
        t: usize,
        kernel: RouterKernel,
        (split, cols): (usize, usize),
        partials: Option<&CudaSlice<f32>>,
    ) -> Result<()> {
        if t == 0 {
            return Ok(());
        }
        let (h, e) = (self.config.hidden, self.config.num_experts);
        let g = &self.gpu;
        let bias = self.w.gate_bias.as_ref().map_or(0u64, |x| dptr(x, g));
        let logits = dptr(&b.logits, g);
        let (out, in_kernel_bias) = match (split, partials) {
            (1, _) => (logits, bias),
            (_, Some(partials)) => (dptr(partials, g), 0u64),
            (_, None) => {
                return Err(MoeError::Unsupported(format!(
                    "the tensor-core router's {split} splits need partials these buffers lack"
                )))
            }
        };
        let (gp, x_bf) = (dptr(&self.w.gate, g), dptr(&b.x_bf, g));
        // bf16 tokens are read from their rows, which need no copy.
        let (xp, x_bf) = if kernel.bf16_tokens { (x_bf, 0u64) } else { (dptr(&b.x, g), x_bf) };
        let (ti, ei, hi, ci) = (t as i32, e as i32, h as i32, cols as i32);
        if kernel.tf32_gate && !self.w.gate_is_tf32 {
            return Err(MoeError::Unsupported("the router's gate holds values that are not TF32 values".into()));
        }
        let (forms, smem) = match (&self.k.router_tf32_sm90, kernel.wgmma) {
            (_, false) => (&self.k.router_tf32, SMEM),
            (Some(k), true) => (k, SMEM_SM90),
            (None, true) => return Err(MoeError::Unsupported("the wgmma router needs a Hopper GPU".into())),
        };
        let f = match (kernel.bf16_tokens, &forms.bf16_tokens) {
            (false, _) if kernel.tf32_gate => &forms.tf32_gate,
            (false, _) => &forms.any_gate,
            (true, Some(f)) if kernel.tf32_gate && h.is_multiple_of(8) => f,
            (true, _) => {
                return Err(MoeError::Unsupported(
                    "bf16 tokens need the wgmma router, a gate of TF32 values and H a multiple of 8".into(),
                ))
            }
        };
        let cfg = LaunchConfig {
            grid_dim: (e.div_ceil(TILE) as u32, t.div_ceil(TILE) as u32, split as u32),
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem,
        };
        // SAFETY: router_partials_tf32(_sm90)(_tf32_gate)(float*, float*, int, int, int, int,
        // float*, float*, bf16*) reads t · H and E · H floats (H a multiple of 4, checked by
        // `router_on_tensor_cores`) and writes split · t · E floats (the logits for one split,
        // else the partials, which `partial_floats` sized for this many tokens) and t · H bf16
        // values into `b.x_bf`, sized for `t` tokens; the _bf16_tokens form (same arguments,
        // bf16* first) reads t · H bf16 values of `b.x_bf` instead (H a multiple of 8, checked
        // above) and writes no copy.
        unsafe {
            g.stream
                .launch_builder(f)
                .arg(&xp)
                .arg(&gp)
                .arg(&ti)
                .arg(&ei)
                .arg(&hi)
                .arg(&ci)
                .arg(&in_kernel_bias)
                .arg(&out)
                .arg(&x_bf)
                .launch(cfg)
        }
        .map_err(|e| err("router_partials_tf32", e))?;
        if split > 1 {
            self.router_sum(out, t, split, bias, 0, logits)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{is_tf32, partial_floats, splits, RouterKernel, DEPTH, MIN_COLS};
    use crate::backend::cuda::kernel_define;
    use crate::backend::cuda::layer::CudaMoeLayer;
    use crate::experts::Activation;
    use crate::router::RouterConfig;
    use crate::{preset, DType};

    /// The tensor-core router's logits, every kernel (`mma.sync`, and wgmma on Hopper, each also in
    /// its form for gates of TF32 values where the gate is one; on poisoned outputs; called
    /// directly, also for expert counts the layer leaves to cuBLAS) against f64 dot products,
    /// within 2e-6 of the sum of the products' magnitudes (f32 accumulation over a few thousand
    /// columns), next to cuBLAS's f32 GEMM on the same values; the same bits at a second launch and
    /// from every kernel; the tokens' bf16 copy each kernel writes rounded to nearest even, every
    /// value of the batch. Widths that are and are not multiples of the 32-column stage, batches
    /// from 1 token to several tiles and splits, experts not a multiple of the 128-expert tile,
    /// with and without the gate's bias, f32 and bf16 gates. Needs a GPU; says loudly when it
    /// skips.
    #[test]
    fn tensor_core_router_matches_f64_dot_products() {
        let name = "tensor_core_router_matches_f64_dot_products";
        if crate::backend::cuda::skip_without_gpu(name) {
            return;
        }
        let softmax = RouterConfig::Softmax { renormalize: true };
        // (router, experts, k, hidden, batches, whether the gate holds bf16 values)
        let cases = [
            (softmax.clone(), 256, 8, 7168, vec![1usize, 7, 128, 129, 1000, 4096], false),
            (softmax.clone(), 256, 8, 7168, vec![1, 129, 4096], true),
            (RouterConfig::TopKSoftmax, 32, 4, 2880, vec![1, 300], false),
            (softmax.clone(), 1000, 8, 132, vec![3, 257], true),
            (softmax.clone(), 64, 8, 2048, vec![5, 1000], true),
            (softmax, 8, 2, 100, vec![1, 130], false),
        ];
        for (case_no, (router, e, k, h, batches, bf16_gate)) in cases.into_iter().enumerate() {
            let config = preset::config(h, 16, e, k, router, Activation::Silu, None);
            let mut weights = preset::random_weights(&config, DType::BF16, 40 + case_no as u64);
            if bf16_gate {
                let rounded: Vec<f32> =
                    weights.gate.to_f32_vec().iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
                weights.gate = crate::tensor::Tensor::from_f32(weights.gate.shape(), rounded).unwrap();
            }
            let layer = CudaMoeLayer::new(&config, &weights, &Default::default()).unwrap();
            let sm90 = layer.k.router_tf32_sm90.is_some();
            let wants = e >= 128 || (e >= 64 && sm90 && bf16_gate);
            assert_eq!(layer.router_on_tensor_cores(), wants, "{e} experts, H {h}");
            assert_eq!(layer.w.gate_is_tf32, bf16_gate, "{e} experts, H {h}: the gate's TF32 check");
            let gate = weights.gate.to_f32_vec();
            let bias = weights.gate_bias.as_ref().map(|b| b.to_f32_vec());
            let most = *batches.iter().max().unwrap();
            let mut guard = layer.bufs.lock().unwrap();
            let b = layer.buffers(&mut guard, most).unwrap();
            let s = layer.gpu.stream.clone();
            // The layer keeps partials only where it routes on the tensor cores.
            if b.router_split.is_none() {
                let room = partial_floats(most, e, h, layer.sms).max(1);
                b.router_split = Some(s.alloc_zeros::<f32>(room).unwrap());
            }
            for t in batches {
                let case = format!("{e} experts, H {h}, {t} tokens, bias {}, bf16 gate {bf16_gate}", bias.is_some());
                let x = preset::uniform(t * h, 1.0, 7 * t as u64 + case_no as u64);
                s.memcpy_htod(&x, &mut b.x.slice_mut(0..t * h)).unwrap();
                // 0: cuBLAS's f32 GEMM, 1: mma.sync, 2: wgmma (Hopper only), 3 and 4: the same
                // for a gate of TF32 values. The logits and the tokens' bf16 copy, both
                // poisoned before.
                let mut logits_of = |kernel: usize| {
                    s.memcpy_htod(&vec![f32::NAN; t * e], &mut b.logits.slice_mut(0..t * e)).unwrap();
                    s.memcpy_htod(&vec![0xffffu16; t * h], &mut b.x_bf.slice_mut(0..t * h)).unwrap();
                    match kernel {
                        0 => layer.gemm_f32_router(b, t).unwrap(),
                        k => {
                            let kernel = RouterKernel { wgmma: k % 2 == 0, tf32_gate: k > 2, bf16_tokens: false };
                            layer.router_tf32_on(b, t, kernel).unwrap()
                        }
                    }
                    (s.clone_dtoh(&b.logits.slice(0..t * e)).unwrap(), s.clone_dtoh(&b.x_bf.slice(0..t * h)).unwrap())
                };
                let (cublas, _) = logits_of(0);
                let rounded: Vec<u16> = x.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
                let kernels: Vec<usize> = match (layer.k.router_tf32_sm90.is_some(), bf16_gate) {
                    (false, false) => vec![1],
                    (false, true) => vec![1, 3],
                    (true, false) => vec![1, 2],
                    (true, true) => vec![1, 2, 3, 4],
                };
                let mut worst = [0f64; 5];
                let mut sync_logits = None;
                for &kernel in &kernels {
                    let ((got, copy), (again, _)) = (logits_of(kernel), logits_of(kernel));
                    let same = got.iter().zip(&again).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{case}, kernel {kernel}: a second launch gives the same bits");
                    // Every kernel adds the same products in the same order (the TF32 gate's
                    // form without those of its zero tails).
                    if kernel == 1 {
                        sync_logits = Some(got.clone());
                    } else if let Some(sync) = &sync_logits {
                        let same = got.iter().zip(sync).all(|(a, b): (&f32, &f32)| a.to_bits() == b.to_bits());
                        assert!(same, "{case}: kernel {kernel}'s logits are not mma.sync's bits");
                    }
                    if let Some(i) = (0..t * h).find(|&i| copy[i] != rounded[i]) {
                        panic!(
                            "{case}, kernel {kernel}: bf16 copy of value {i} is {:#x}, not {:#x}",
                            copy[i], rounded[i]
                        );
                    }
                    // Every row of small batches, every seventh of large ones.
                    let step = if t > 300 { 7 } else { 1 };
                    for tok in (0..t).step_by(step) {
                        let xs = &x[tok * h..(tok + 1) * h];
                        for x_e in 0..e {
                            let row = &gate[x_e * h..(x_e + 1) * h];
                            let dot: f64 = xs.iter().zip(row).map(|(&a, &g)| a as f64 * g as f64).sum();
                            let size: f64 = xs.iter().zip(row).map(|(&a, &g)| (a as f64 * g as f64).abs()).sum();
                            let b_e = bias.as_ref().map_or(0.0, |b| b[x_e] as f64);
                            let i = tok * e + x_e;
                            let off = (got[i] as f64 - dot - b_e).abs() / size.max(1e-30);
                            assert!(
                                off <= 2e-6,
                                "{case}, kernel {kernel}: logit {i}: {} against {}",
                                got[i],
                                dot + b_e
                            );
                            worst[kernel] = worst[kernel].max(off);
                            if kernel == 1 {
                                worst[0] = worst[0].max((cublas[i] as f64 - dot).abs() / size.max(1e-30));
                            }
                        }
                    }
                }
                let [worst_cublas, worst_sync, worst_wgmma, worst_sync_tf32, worst_wgmma_tf32] = worst;
                eprintln!(
                    "{case}: worst error of the products' magnitudes: mma.sync {worst_sync:.2e}, wgmma \
                     {worst_wgmma:.2e}, for a TF32 gate {worst_sync_tf32:.2e} and {worst_wgmma_tf32:.2e} (0: \
                     not run), cuBLAS f32 {worst_cublas:.2e}"
                );
            }
        }
    }

    /// bf16 tokens through the wgmma router's `_bf16_tokens` form: the logits are the bits of the
    /// form for f32 tokens on the same values (a gate of bf16 values, as checkpoints and the
    /// random layers hold), and the tokens' rows are left as they were. DeepSeek-V3's 256 experts
    /// (one split and several) and 64 experts, batches from 1 token to several tiles. Needs a
    /// Hopper GPU; says loudly when it skips.
    #[test]
    fn bf16_tokens_route_to_the_bits_of_their_f32_values() {
        let name = "bf16_tokens_route_to_the_bits_of_their_f32_values";
        if crate::backend::cuda::skip_without_gpu(name) {
            return;
        }
        let grouped = RouterConfig::DEEPSEEK_V3;
        let softmax = RouterConfig::Softmax { renormalize: true };
        for (case_no, (router, e, h, batches)) in
            [(grouped, 256, 7168, vec![1usize, 129, 4096]), (softmax, 64, 2048, vec![5, 1000])].into_iter().enumerate()
        {
            let config = preset::config(h, 16, e, 8, router, Activation::Silu, None);
            let layer = CudaMoeLayer::random(&config, 11 + case_no as u64, &Default::default()).unwrap();
            if layer.k.router_tf32_sm90.is_none() {
                eprintln!("SKIPPED {name}: the bf16-token router needs a Hopper GPU");
                return;
            }
            let most = *batches.iter().max().unwrap();
            let mut guard = layer.bufs.lock().unwrap();
            let b = layer.buffers(&mut guard, most).unwrap();
            let s = layer.gpu.stream.clone();
            for t in batches {
                assert!(
                    layer.routes_bf16_tokens(t) || t <= super::super::route::FUSED_ROUTE_TOKENS,
                    "{e} experts, {t} tokens"
                );
                let bits: Vec<u16> = preset::uniform(t * h, 1.0, 3 + t as u64)
                    .iter()
                    .map(|&v| half::bf16::from_f32(v).to_bits())
                    .collect();
                let widened: Vec<f32> = bits.iter().map(|&v| half::bf16::from_bits(v).to_f32()).collect();
                s.memcpy_htod(&widened, &mut b.x.slice_mut(0..t * h)).unwrap();
                let mut logits_of = |bf16_tokens: bool| {
                    s.memcpy_htod(&vec![f32::NAN; t * e], &mut b.logits.slice_mut(0..t * e)).unwrap();
                    s.memcpy_htod(&bits, &mut b.x_bf.slice_mut(0..t * h)).unwrap();
                    let kernel = RouterKernel { wgmma: true, tf32_gate: true, bf16_tokens };
                    layer.router_tf32_on(b, t, kernel).unwrap();
                    (s.clone_dtoh(&b.logits.slice(0..t * e)).unwrap(), s.clone_dtoh(&b.x_bf.slice(0..t * h)).unwrap())
                };
                let ((f32_logits, _), (bf16_logits, rows)) = (logits_of(false), logits_of(true));
                assert!(f32_logits.iter().all(|v| v.is_finite()), "{e} experts, {t} tokens: every logit written");
                if let Some(i) = (0..t * e).find(|&i| f32_logits[i].to_bits() != bf16_logits[i].to_bits()) {
                    panic!(
                        "{e} experts, {t} tokens: logit {i} is {} from bf16 tokens, {} from f32",
                        bf16_logits[i], f32_logits[i]
                    );
                }
                assert!(rows == bits, "{e} experts, {t} tokens: the bf16 rows were written over");
                eprintln!("{name}: {e} experts, H {h}, {t} tokens: the same {} logits", t * e);
            }
        }
    }

    /// A gate is TF32 where every value's low 13 mantissa bits are zero: bf16 values are, an
    /// f32 value with any of those bits is not.
    #[test]
    fn tf32_gates_are_those_without_low_bits() {
        let bf16: Vec<f32> = preset::uniform(4096, 0.1, 3).iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
        assert!(is_tf32(&bf16) && is_tf32(&[]) && is_tf32(&[0.0, -0.0, f32::INFINITY, 1.5]));
        assert!(!is_tf32(&preset::uniform(4096, 0.1, 3)));
        let mut one_off = bf16;
        one_off[4095] = f32::from_bits(one_off[4095].to_bits() | 1);
        assert!(!is_tf32(&one_off));
    }

    /// The random layers `bench` runs hold bf16 gates, as checkpoints do, so their routers take
    /// the two-product form for a gate of TF32 values; on Hopper with 256 experts (DeepSeek-V3)
    /// on `wgmma`, and on the tensor cores at 64 experts too. Needs a GPU; says loudly when it
    /// skips.
    #[test]
    fn random_layers_route_with_the_tf32_gate_form() {
        let name = "random_layers_route_with_the_tf32_gate_form";
        if crate::backend::cuda::skip_without_gpu(name) {
            return;
        }
        let softmax = RouterConfig::Softmax { renormalize: true };
        let grouped = RouterConfig::DEEPSEEK_V3;
        for (router, e) in [(softmax.clone(), 64), (softmax, 256), (grouped, 256), (RouterConfig::TopKSoftmax, 128)] {
            let config = preset::config(512, 16, e, 8, router.clone(), Activation::Silu, None);
            let layer = CudaMoeLayer::random(&config, 5, &Default::default()).unwrap();
            assert!(layer.w.gate_is_tf32, "{router:?}, {e} experts: the random gate holds values that are not TF32");
            let sm90 = layer.k.router_tf32_sm90.is_some();
            assert_eq!(layer.router_on_tensor_cores(), e >= 128 || sm90, "{router:?}, {e} experts");
            eprintln!("{name}: {router:?}, {e} experts: a TF32 gate, on the tensor cores (wgmma: {sm90})");
        }
    }

    /// Splits cover the depth exactly once in multiples of 32 columns, at least 128 each unless
    /// the depth is shorter, about one block an SM; the partials' room is what the largest
    /// batch up to `t` needs.
    #[test]
    fn router_splits_cover_the_depth_and_fill_the_gpu() {
        for &(e, h) in &[(256usize, 7168usize), (64, 2048), (8, 100), (1000, 132), (128, 4)] {
            for t in [1usize, 7, 128, 129, 1000, 4096, 16384] {
                let (s, cols) = splits(t, e, h, 132);
                assert_eq!(cols % DEPTH, 0, "{t} {e} {h}");
                assert!(s >= 1 && (s - 1) * cols < h && s * cols >= h, "{t} {e} {h}: {s} × {cols}");
                assert!(cols >= MIN_COLS.min(h.div_ceil(DEPTH) * DEPTH), "{t} {e} {h}: {cols}");
                let tiles = t.div_ceil(128) * e.div_ceil(128);
                assert!(s == 1 || tiles * s <= 132 + tiles, "{t} {e} {h}: {s} splits of {tiles} tiles");
                let room = partial_floats(t, e, h, 132);
                for m in 1..=t.min(300) {
                    let (sm, _) = splits(m, e, h, 132);
                    assert!(sm == 1 || sm * m * e <= room, "{m} of {t}: {sm} splits");
                }
            }
        }
        assert_eq!(splits(4096, 256, 7168, 132), (2, 3584));
        assert_eq!([super::SMEM, super::SMEM_SM90], [110_592, 204_800 + 1024]);
        assert_eq!(splits(128, 256, 7168, 132), (56, 128));
    }

    /// The tile and ring constants mirrored from router_tf32.cu hold its values.
    #[test]
    fn tile_constants_mirror_router_tf32_cu() {
        let pairs = [
            ("RT_BM", super::TILE),
            ("RT_BN", super::TILE),
            ("RT_BK", DEPTH),
            ("RT_LD", super::ROW_FLOATS as usize),
            ("RT_STAGES", super::STAGES as usize),
            ("RT_SM90_STAGES", super::STAGES_SM90 as usize),
        ];
        for (name, value) in pairs {
            assert_eq!(kernel_define(name), Some(value as i64), "{name}");
        }
    }
}
