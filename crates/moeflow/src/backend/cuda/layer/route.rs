//! Stage 1, routing on the device: the tokens' bf16 copy, the router GEMM at f32 accuracy (on
//! the tensor cores, `router_tf32.rs`, or cuBLAS's f32 path; never plain TF32, so the choices
//! match the CPU reference's), the logits' bias and top-k for every router kind; small
//! batches on one GPU do all of that, and the permute's counts and maps, in one launch. The
//! low-latency graph, captured on its capacity's rows, computes the logits and top-k of the
//! batch's rows alone, reading the batch size on the device.

use super::low_latency::LlBuffers;
use super::{check, dptr, err, grid, Buffers, CudaMoeLayer};
use crate::error::{MoeError, Result};
use crate::router::RouterConfig;
use cudarc::cublas::sys as cb;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

/// Most tokens the fused router takes (`ROUTE_SMALL_TOKENS` in route.cu).
pub(super) const FUSED_ROUTE_TOKENS: usize = 4;

/// Most experts the fused router takes (`ROUTE_SMALL_EXPERTS` in route.cu; see
/// [`CudaMoeLayer::routes_fused`]).
pub(super) const FUSED_ROUTE_EXPERTS: usize = 128;

/// Most experts the narrow top-k kernel takes (`ROUTE_EXPERTS` in route.cu); `route_wide` takes
/// the rest.
const ROUTE_EXPERTS: usize = 256;

/// Columns each partial sum of deterministic mode's router GEMM takes (`ROUTER_FIXED_COLS`
/// in router_fixed.cu).
pub(super) const ROUTER_FIXED_COLS: usize = 256;

/// Columns each partial sum of the low-latency graph's router takes (`ROUTER_LIVE_COLS` in
/// router_fixed.cu).
pub(super) const ROUTER_LIVE_COLS: usize = 112;

/// Rows each block of the low-latency graph's router takes at most (`ROUTER_LIVE_ROWS` in router_fixed.cu).
const ROUTER_LIVE_ROWS: usize = 128;

/// Columns of `x` each block of the fused router takes (`ROUTE_SMALL_COLS` in route.cu).
pub(super) const ROUTE_COLS: usize = 128;

impl CudaMoeLayer {
    /// f32 → bf16 copy of the tokens, router GEMM, bias, and top-k into `b.ids`/`b.weights`;
    /// where [`CudaMoeLayer::routes_fused`] says so, all of it and the permute's counts,
    /// offsets and maps in one launch. bf16 tokens (`b.tokens_bf16`) need no copy: the router
    /// reads their rows.
    pub(super) fn route(&self, b: &Buffers, t: usize) -> Result<()> {
        if b.tokens_bf16 && !self.routes_bf16_tokens(t) {
            return Err(MoeError::Unsupported(format!("a router that reads {t} bf16 tokens as they are")));
        }
        if self.routes_fused(t) {
            return self.route_fused(b, t);
        }
        let c = &self.config;
        let (h, e) = (c.hidden, c.num_experts);
        let g = &self.gpu;
        let s = &g.stream;
        let p = |x: &CudaSlice<f32>| dptr(x, g);
        let pb = |x: &CudaSlice<u16>| dptr(x, g);
        let (n_th, n) = (t * h, (t * h) as i64);
        let (xp, xbp) = (p(&b.x), pb(&b.x_bf));
        // bf16 tokens are their own copy. The tensor-core router writes the bf16 copy as it
        // reads f32 tokens. Otherwise large batches make it on side stream 0, beside the router
        // GEMM (both read x from memory); for small ones the fork and join cost more than they
        // hide (docs/tuning.md).
        let router_copies = b.tokens_bf16 || (b.ll.is_none() && self.router_on_tensor_cores());
        let overlap = !router_copies && t * h >= 1 << 23;
        let side = if overlap { &self.side.shared().stream } else { s };
        if overlap {
            self.side.fork(s, [self.side.shared()])?;
        }
        if !router_copies {
            // SAFETY: f32_to_bf16_kernel(float*, bf16*, long) over the t · H values of `b.x`
            // into `b.x_bf`, both sized for `t` tokens (see `buffers`).
            unsafe {
                side.launch_builder(&self.k.to_bf16)
                    .arg(&xp)
                    .arg(&xbp)
                    .arg(&n)
                    .launch(grid(n_th))
                    .map_err(|e| err("to_bf16", e))?;
            }
        }
        // The low-latency graph routes its capacity's rows, but computes the batch's alone (its
        // size read on the device).
        let live = b.ll.as_ref().map_or(0u64, |ll| dptr(&ll.tokens, g));
        if let Some(ll) = &b.ll {
            self.router_live(b, t, ll)?;
        } else if self.opts.deterministic && !self.router_on_tensor_cores() {
            self.router_fixed(b, t)?;
        } else if self.opts.deterministic {
            self.router_tf32_fixed(b, t)?;
        } else if self.router_on_tensor_cores() {
            self.router_tf32(b, t)?;
        } else {
            self.gemm_f32_router(b, t)?;
            if let Some(bias) = &self.w.gate_bias {
                let (lp, bp, ti, ei) = (p(&b.logits), p(bias), t as i32, e as i32);
                // SAFETY: add_bias(float*, float*, int, int) over the t · E logits and E biases.
                unsafe { s.launch_builder(&self.k.add_bias).arg(&lp).arg(&bp).arg(&ti).arg(&ei).launch(grid(t * e)) }
                    .map_err(|e| err("add_bias", e))?;
            }
        }
        self.top_k_live(dptr(&b.logits, g), t, live, dptr(&b.ids, g), dptr(&b.weights, g))?;
        if overlap {
            self.side.join(s, [self.side.shared()])?;
        }
        Ok(())
    }

    /// Top-k ids `[t, k]` and weights `[t, k]` at `ids` and `weights` from the router logits
    /// `[t, E]` (bias added) at `logits`, for the layer's router kind.
    pub(super) fn top_k(&self, logits: u64, t: usize, ids: u64, weights: u64) -> Result<()> {
        self.top_k_live(logits, t, 0, ids, weights)
    }

    /// [`CudaMoeLayer::top_k`] of the first `*live` of the `t` rows when `live` (a device int)
    /// is not null; the other rows' ids and weights are left as they were.
    fn top_k_live(&self, logits: u64, t: usize, live: u64, ids: u64, weights: u64) -> Result<()> {
        let (e, k) = (self.config.num_experts, self.config.top_k);
        let g = &self.gpu;
        let [kind, n_group, topk_group, renorm] = self.router_kind()?;
        let scaling = self.router_scaling();
        if t == 0 {
            return Ok(());
        }
        let bp = self.w.correction_bias.as_ref().map_or(0u64, |x| dptr(x, g));
        let (ti, ei, ki) = (t as i32, e as i32, k as i32);
        let kernel = if e <= ROUTE_EXPERTS { &self.k.route } else { &self.k.route_wide };
        // SAFETY: route(_wide)(float*, float*, int, int, int, int, int, int, int, float, int*, int*,
        // float*) reads t · E logits (and E bias values, and one int at `live` when not null) and
        // writes t · k ids and weights.
        unsafe {
            g.stream
                .launch_builder(kernel)
                .arg(&logits)
                .arg(&bp)
                .arg(&ti)
                .arg(&ei)
                .arg(&ki)
                .arg(&kind)
                .arg(&n_group)
                .arg(&topk_group)
                .arg(&renorm)
                .arg(&scaling)
                .arg(&live)
                .arg(&ids)
                .arg(&weights)
                .launch(LaunchConfig {
                    grid_dim: (t.div_ceil(4) as u32, 1, 1),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                })
        }
        .map(|_| ())
        .map_err(|e| err("route", e))
    }

    /// logits `[T, E]` = x `[T, H]` · gate `[E, H]`ᵀ in f32 plus the gate's bias, each sum in
    /// one fixed order for any batch (deterministic mode where the router does not run on the
    /// tensor cores: [`CudaMoeLayer::router_tf32_fixed`] there): partial sums over
    /// [`ROUTER_FIXED_COLS`] columns each, then those added in column order
    /// (`router_partials_fixed`, `router_sum_fixed` in router_fixed.cu).
    pub(super) fn router_fixed(&self, b: &Buffers, t: usize) -> Result<()> {
        let (h, e) = (self.config.hidden, self.config.num_experts);
        let g = &self.gpu;
        let s = &g.stream;
        let blocks = h.div_ceil(ROUTER_FIXED_COLS);
        let partial = b.router_fixed.as_ref().expect("allocated for deterministic layers");
        let (xp, gp, lp, pp) = (dptr(&b.x, g), dptr(&self.w.gate, g), dptr(&b.logits, g), dptr(partial, g));
        let bias = self.w.gate_bias.as_ref().map_or(0u64, |x| dptr(x, g));
        let (ti, ei, hi) = (t as i32, e as i32, h as i32);
        // Large batches take 128 × 128 tiles (the same sums in the same order, bit for bit;
        // docs/tuning.md), small ones 64 × 64.
        let (kernel, tile) = if t >= 256 && e >= 128 && h.is_multiple_of(4) {
            (&self.k.router_partials_wide, 128)
        } else {
            (&self.k.router_partials, 64)
        };
        let cfg = LaunchConfig {
            grid_dim: (t.div_ceil(tile) as u32, e.div_ceil(tile) as u32, blocks as u32),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: router_partials_fixed(_wide)(float*, float*, int, int, int, float*) reads t · H and
        // E · H floats and writes blocks · t · E partials, which `partial` holds.
        unsafe {
            s.launch_builder(kernel)
                .arg(&xp)
                .arg(&gp)
                .arg(&ti)
                .arg(&ei)
                .arg(&hi)
                .arg(&pp)
                .launch(cfg)
                .map_err(|e| err("router_partials_fixed", e))?;
        }
        // Every row of the batch (no live count).
        self.router_sum(pp, t, blocks, bias, 0, lp)
    }

    /// logits `[T, E]` = the sum of the `blocks` partials `[blocks, T, E]` at `partials` in block
    /// order, plus `bias` `[E]` (when not null), for the first `*live` rows (all `T` when `live`
    /// is null).
    pub(super) fn router_sum(
        &self,
        partials: u64,
        t: usize,
        blocks: usize,
        bias: u64,
        live: u64,
        logits: u64,
    ) -> Result<()> {
        let (ti, ei, bi) = (t as i32, self.config.num_experts as i32, blocks as i32);
        // SAFETY: router_sum_fixed(float*, int, int, int, float*, int*, float*) reads blocks · t · E
        // partials (E bias values and one int at `live` when not null) and writes t · E logits.
        unsafe {
            self.gpu
                .stream
                .launch_builder(&self.k.router_sum)
                .arg(&partials)
                .arg(&ti)
                .arg(&ei)
                .arg(&bi)
                .arg(&bias)
                .arg(&live)
                .arg(&logits)
                .launch(grid(t * self.config.num_experts))
        }
        .map(|_| ())
        .map_err(|e| err("router_sum_fixed", e))
    }

    /// The low-latency graph's router: logits `[M, E]` = x `[M, H]` · gate `[E, H]`ᵀ in f32 plus
    /// the gate's bias, for the batch's rows alone (`ll.tokens`, read on the device), in partial
    /// sums over [`ROUTER_LIVE_COLS`] columns (`router_live_partials` in router_fixed.cu) added in order.
    /// A token's logits do not depend on the batch it comes in.
    fn router_live(&self, b: &Buffers, m: usize, ll: &LlBuffers) -> Result<()> {
        let (h, e) = (self.config.hidden, self.config.num_experts);
        let g = &self.gpu;
        let blocks = h.div_ceil(ROUTER_LIVE_COLS);
        let (xp, gp, live, pp) =
            (dptr(&b.x, g), dptr(&self.w.gate, g), dptr(&ll.tokens, g), dptr(&ll.router_partials, g));
        let bias = self.w.gate_bias.as_ref().map_or(0u64, |x| dptr(x, g));
        let (mi, ei, hi) = (m as i32, e as i32, h as i32);
        let cfg = LaunchConfig {
            grid_dim: (e.div_ceil(64) as u32, blocks as u32, m.div_ceil(ROUTER_LIVE_ROWS) as u32),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: router_live_partials(float*, float*, int, int, int, int*, float*) reads the first
        // *live (at most M) rows of x and E · H gate floats, and writes blocks · M · E partials,
        // which `ll.router_partials` holds.
        unsafe {
            g.stream
                .launch_builder(&self.k.router_live)
                .arg(&xp)
                .arg(&gp)
                .arg(&mi)
                .arg(&ei)
                .arg(&hi)
                .arg(&live)
                .arg(&pp)
                .launch(cfg)
        }
        .map_err(|e| err("router_live_partials", e))?;
        self.router_sum(pp, m, blocks, bias, live, dptr(&b.logits, g))
    }

    /// logits `[T, E]` = x `[T, H]` · gate `[E, H]`ᵀ in f32 (pedantic f32: no TF32).
    pub(super) fn gemm_f32_router(&self, b: &Buffers, t: usize) -> Result<()> {
        let (h, e) = (self.config.hidden as i32, self.config.num_experts as i32);
        let (alpha, beta) = (1.0f32, 0.0f32);
        let g = &self.gpu;
        // SAFETY: column-major view: C [E, T] = gate [H, E]ᵀ · x [H, T]; all buffers hold at
        // least those many f32 values.
        let st = unsafe {
            cb::cublasGemmEx(
                *self.blas.handle(),
                cb::cublasOperation_t::CUBLAS_OP_T,
                cb::cublasOperation_t::CUBLAS_OP_N,
                e,
                t as i32,
                h,
                &alpha as *const f32 as *const _,
                dptr(&self.w.gate, g) as *const _,
                cb::cudaDataType_t::CUDA_R_32F,
                h,
                dptr(&b.x, g) as *const _,
                cb::cudaDataType_t::CUDA_R_32F,
                h,
                &beta as *const f32 as *const _,
                dptr(&b.logits, g) as *mut _,
                cb::cudaDataType_t::CUDA_R_32F,
                e,
                cb::cublasComputeType_t::CUBLAS_COMPUTE_32F_PEDANTIC,
                cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        check(st, "router GEMM")
    }

    /// Whether `t` tokens route in one launch (`route_small` in route.cu): from 1 to
    /// [`FUSED_ROUTE_TOKENS`] tokens on one GPU whose Hopper GEMM gathers the rows itself (so
    /// the permute is the counts and maps alone: bf16 experts, or W8A8 experts on the fp8
    /// Hopper GEMM, which quantizes the tokens it gathers from), at most
    /// [`FUSED_ROUTE_EXPERTS`] experts. It replaces six launches: the bf16 copy, cuBLAS's two
    /// gemv kernels, route and the counting sort (seven where a W8A8 layer quantizes its
    /// tokens once: that pass too). Above [`FUSED_ROUTE_EXPERTS`]
    /// experts its 128-column blocks read the whole gate on few SMs and it is slower than the
    /// six launches (docs/tuning.md).
    pub(super) fn routes_fused(&self, t: usize) -> bool {
        let (e, k) = (self.config.num_experts, self.config.top_k);
        self.opts.fused_route
            && self.ep.is_none()
            && (1..=FUSED_ROUTE_TOKENS).contains(&t)
            && e <= FUSED_ROUTE_EXPERTS
            && (self.hopper_fp8_runs() || (self.w.fp8.is_none() && self.hopper_gathers(t * k, e, 0)))
    }

    /// The fused router over the `t` tokens in `b.x`: `b.x_bf`, `b.logits`, `b.ids`,
    /// `b.weights`, `b.counts`, `b.offsets` and the slot/row maps, as the unfused stages and
    /// the permute (grouped layout) write them, and the tokens' fp8 codes where the layer
    /// quantizes them once ([`CudaMoeLayer::tokens_fp8`]), as that pass writes them.
    pub(super) fn route_fused(&self, b: &Buffers, t: usize) -> Result<()> {
        let c = &self.config;
        let (h, e, k) = (c.hidden, c.num_experts, c.top_k);
        if !(1..=FUSED_ROUTE_TOKENS).contains(&t) || b.tokens < t {
            return Err(MoeError::Unsupported(format!(
                "the fused router takes 1 to {FUSED_ROUTE_TOKENS} tokens with buffers for them, not {t}"
            )));
        }
        if e > FUSED_ROUTE_EXPERTS {
            return Err(MoeError::Unsupported(format!(
                "the fused router takes up to {FUSED_ROUTE_EXPERTS} experts, not {e}"
            )));
        }
        let g = &self.gpu;
        let [kind, n_group, topk_group, renorm] = self.router_kind()?;
        let scaling = self.router_scaling();
        let opt = |x: &Option<CudaSlice<f32>>| x.as_ref().map_or(0u64, |x| dptr(x, g));
        let (pf, pi) = (|x: &CudaSlice<f32>| dptr(x, g), |x: &CudaSlice<i32>| dptr(x, g));
        let (xp, gate, gate_bias, corr) =
            (pf(&b.x), pf(&self.w.gate), opt(&self.w.gate_bias), opt(&self.w.correction_bias));
        let (partials, done, x_bf) = (pf(&b.route_partials), pi(&b.route_done), dptr(&b.x_bf, g));
        let (logits, ids, weights) = (pf(&b.logits), pi(&b.ids), pf(&b.weights));
        let (counts, offsets) = (pi(&b.counts), pi(&b.offsets));
        let maps = [pi(&b.row_of_slot), pi(&b.slot_of_row), pi(&b.expert_of_row)];
        // A W8A8 layer's tokens' fp8 codes, made here rather than by a pass of their own.
        let (codes, scales) = self.tokens_fp8(b).map_or((0u64, 0u64), |q| (q.codes, q.scales));
        // The call's load statistics, counted here rather than by a launch of their own.
        let (load_rows, load_calls, window) = if self.records_load() { self.load.ring() } else { (0, 0, 0) };
        let window = window as i32;
        let (ti, hi, ei, ki) = (t as i32, h as i32, e as i32, k as i32);
        // SAFETY: route_small(float*, float*, float*, float*, int, int, int, int, int, int, int,
        // int, float, float*, int*, bf16*, float*, int*, float*, int*, int*, int*, int*, int*,
        // u8*, float*, unsigned*, int, unsigned long long*) with t <= ROUTE_SMALL_TOKENS and one
        // block per 128 columns of H: the buffers hold t tokens (x, x_bf, logits, ids, weights,
        // maps, and the codes and scales when not null), E experts (gate, biases, counts, E + 1
        // offsets) and blocks · ROUTE_SMALL_TOKENS · E partials; `done` is zero at every launch
        // (the last block sets it back); the load ring, when not null, holds `window` rows of E
        // counts and its call counter.
        unsafe {
            let mut l = g.stream.launch_builder(&self.k.route_small);
            l.arg(&xp).arg(&gate).arg(&gate_bias).arg(&corr).arg(&ti).arg(&hi).arg(&ei).arg(&ki);
            l.arg(&kind).arg(&n_group).arg(&topk_group).arg(&renorm).arg(&scaling);
            l.arg(&partials).arg(&done).arg(&x_bf).arg(&logits).arg(&ids).arg(&weights);
            l.arg(&counts).arg(&offsets).arg(&maps[0]).arg(&maps[1]).arg(&maps[2]).arg(&codes).arg(&scales);
            l.arg(&load_rows).arg(&window).arg(&load_calls);
            l.launch(LaunchConfig {
                grid_dim: (h.div_ceil(ROUTE_COLS) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map(|_| ())
        .map_err(|e| err("route_small", e))
    }

    /// The router kind as route.cu's `route` takes it: [kind, groups, groups kept, renormalize]
    /// (kinds 0 softmax top-k, 1 top-k then softmax, 2 sigmoid grouped, 3 softmax grouped).
    fn router_kind(&self) -> Result<[i32; 4]> {
        let kind = match self.config.router {
            RouterConfig::Softmax { renormalize } => [0, 1, 1, renormalize as i32],
            RouterConfig::TopKSoftmax => [1, 1, 1, 0],
            RouterConfig::SigmoidGrouped { n_group, topk_group, renormalize, .. } => {
                [2, n_group as i32, topk_group as i32, renormalize as i32]
            }
            RouterConfig::SoftmaxGrouped { n_group, topk_group, renormalize, .. } => {
                [3, n_group as i32, topk_group as i32, renormalize as i32]
            }
        };
        if kind[1] > 64 {
            return Err(MoeError::Unsupported("more than 64 expert groups on the CUDA backend".into()));
        }
        Ok(kind)
    }

    /// The routed weights' scaling factor (1 for the ungrouped routers).
    fn router_scaling(&self) -> f32 {
        match self.config.router {
            RouterConfig::SigmoidGrouped { scaling, .. } | RouterConfig::SoftmaxGrouped { scaling, .. } => scaling,
            RouterConfig::Softmax { .. } | RouterConfig::TopKSoftmax => 1.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::cuda::kernel_define;

    /// The routing constants mirrored from route.cu and router_fixed.cu hold their values.
    #[test]
    fn routing_constants_mirror_the_kernels() {
        let pairs = [
            ("ROUTE_SMALL_TOKENS", super::FUSED_ROUTE_TOKENS),
            ("ROUTE_SMALL_EXPERTS", super::FUSED_ROUTE_EXPERTS),
            ("ROUTE_SMALL_COLS", super::ROUTE_COLS),
            ("ROUTE_EXPERTS", super::ROUTE_EXPERTS),
            ("ROUTER_FIXED_COLS", super::ROUTER_FIXED_COLS),
            ("ROUTER_LIVE_COLS", super::ROUTER_LIVE_COLS),
            ("ROUTER_LIVE_ROWS", super::ROUTER_LIVE_ROWS),
        ];
        for (name, value) in pairs {
            assert_eq!(kernel_define(name), Some(value as i64), "{name}");
        }
    }
}
