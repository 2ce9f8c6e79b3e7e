//! The whole MoE layer resident on GPUs: router in f32, rows permuted by expert on the device
//! (counts and offsets computed there, rows in slot order so runs repeat exactly), bf16 expert
//! GEMMs with f32 accumulation (padded strided-batched, or per expert over side streams),
//! activation, and a weighted combine in slot order. On one GPU, or as one rank of an
//! expert-parallel group ([`CudaMoeLayer::new_ep`]) whose tokens travel to the ranks holding
//! their experts over NCCL, on the device; [`all_gather`] holds that group's gathering forms
//! (all-gather, all-gather of logits, multicast), [`low_latency`] its fixed-capacity form,
//! captured in a CUDA graph, and [`fp8_weights`] its fp8 experts.

use super::blas_handle::BlasHandle;
use super::{err, Gpu};
pub use crate::backend::GpuStageTimes;
use crate::config::{MoeConfig, MoeWeights};
use crate::error::{MoeError, Result};
use crate::experts::Activation;
use crate::router::RouterConfig;
use crate::tensor::Tensor;
use cudarc::cublas::{sys as cb, CudaBlas};
use cudarc::driver::{sys as drv, CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use hopper_gemm::{Epilogue, Gather};
use std::sync::Mutex;

mod all_gather;
mod dual_batch;
mod hopper_gemm;
pub use dual_batch::CudaDualBatch;
mod fp8_weights;
mod graph;
mod low_latency;
mod masked_gemm;
mod side_streams;
use side_streams::SideStreams;
#[cfg(test)]
mod top_k_tests;

struct Kernels {
    to_bf16: CudaFunction,
    add_bias: CudaFunction,
    route: CudaFunction,
    count: CudaFunction,
    scatter: CudaFunction,
    gather: CudaFunction,
    take: CudaFunction,
    act: CudaFunction,
    combine: CudaFunction,
    combine_partial: CudaFunction,
    sum_partials: CudaFunction,
    localize: CudaFunction,
    add_shared: CudaFunction,
    fill_bf16: CudaFunction,
    fill_f32: CudaFunction,
    ll_pack: CudaFunction,
    ll_group: CudaFunction,
    ll_gather: CudaFunction,
    ll_combine: CudaFunction,
    masked_gemm: CudaFunction,
    masked_gemm_fp8: CudaFunction,
    masked_gemm_w8a8: CudaFunction,
    quantize_fp8: CudaFunction,
    quantize_bf16: CudaFunction,
    /// The wgmma grouped GEMM, on Hopper GPUs.
    hopper: Option<hopper_gemm::HopperGemm>,
}

struct SharedMlp {
    inter: usize,
    w13: CudaSlice<u16>,
    w2: CudaSlice<u16>,
    gate: Option<CudaSlice<f32>>,
}

struct DeviceWeights {
    gate: CudaSlice<f32>,
    gate_bias: Option<CudaSlice<f32>>,
    correction_bias: Option<CudaSlice<f32>>,
    w13: CudaSlice<u16>,
    w2: CudaSlice<u16>,
    b13: Option<CudaSlice<f32>>,
    b2: Option<CudaSlice<f32>>,
    shared: Option<SharedMlp>,
    /// The routed experts as fp8 codes too (see [`fp8_weights`]).
    fp8: Option<fp8_weights::Fp8Experts>,
}

/// Scratch buffers for up to `tokens` tokens.
struct Buffers {
    tokens: usize,
    x: CudaSlice<f32>,
    x_bf: CudaSlice<u16>,
    logits: CudaSlice<f32>,
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
    counts: CudaSlice<i32>,
    offsets: CudaSlice<i32>,
    row_of_slot: CudaSlice<i32>,
    slot_of_row: CudaSlice<i32>,
    expert_of_row: CudaSlice<i32>,
    a: CudaSlice<u16>,
    h13: CudaSlice<u16>,
    act: CudaSlice<u16>,
    y: CudaSlice<u16>,
    out: CudaSlice<f32>,
    ptrs: CudaSlice<u64>,
    /// Shared experts' intermediate, activation and output (they run on a side stream).
    sh13: CudaSlice<u16>,
    sact: CudaSlice<u16>,
    sy: CudaSlice<u16>,
    /// Expert-parallel buffers, grown to the rows this rank sends and receives.
    ep: Option<EpBuffers>,
    /// Expert-parallel count exchange: this rank's `[E + ranks]`, then every rank's.
    exchange: Option<CudaSlice<i32>>,
    /// Low-latency buffers and the captured layer (see [`low_latency`]).
    ll: Option<low_latency::LlBuffers>,
    /// One GPU: small batches' graphs and their cuBLAS workspaces (see [`graph`]).
    graphs: graph::LocalGraphs,
}

/// Expert-parallel buffers. At home: the token rows sent (one per token and destination
/// rank, grouped by destination) with their ids and weights, and the partial outputs that come
/// back. Where the experts are: the token rows received (grouped by source), their slots
/// regrouped by local expert for the GEMMs (`a`, `h13`, `act`, `y`), and the partial sums per
/// received token. Capacities grow to the largest call seen.
struct EpBuffers {
    /// Capacities: rows sent, rows received, expert rows (padded), home tokens.
    cap: [usize; 4],
    send_idx: CudaSlice<i32>,
    send_rows: CudaSlice<u16>,
    send_ids: CudaSlice<i32>,
    send_w: CudaSlice<f32>,
    home_rows: CudaSlice<i32>,
    back: CudaSlice<u16>,
    recv_rows: CudaSlice<u16>,
    recv_ids: CudaSlice<i32>,
    recv_w: CudaSlice<f32>,
    local_ids: CudaSlice<i32>,
    counts: CudaSlice<i32>,
    offsets: CudaSlice<i32>,
    row_of_slot: CudaSlice<i32>,
    slot_of_row: CudaSlice<i32>,
    expert_of_row: CudaSlice<i32>,
    a: CudaSlice<u16>,
    h13: CudaSlice<u16>,
    act: CudaSlice<u16>,
    y: CudaSlice<u16>,
    part: CudaSlice<u16>,
    /// All-gather of router logits: this rank's `[tokens, E]`, padded, and every rank's.
    send_logits: CudaSlice<f32>,
    recv_logits: CudaSlice<f32>,
}

/// The expert-parallel side of a layer: its communicator, the experts this rank holds
/// (contiguous ranges, `local` experts from global id `first`), and the low-latency capacity
/// in tokens per rank when the layer dispatches that way.
struct EpLink {
    comm: super::NcclComm,
    first: usize,
    local: usize,
    capacity: Option<usize>,
    /// How a gathering layer moves tokens ([`all_gather`]); `None`: all-to-all-v (or the
    /// low-latency form).
    gathering: Option<all_gather::Gathering>,
}

/// Called with (stage boundary 0..=9, the layer's stream) as a run is enqueued; boundary 3
/// comes right before the expert GEMMs, 6 right after them.
type StageHook<'a> = dyn Fn(usize, &cudarc::driver::CudaStream) -> Result<()> + Sync + 'a;

/// The hook that does nothing.
fn no_hook(_stage: usize, _stream: &cudarc::driver::CudaStream) -> Result<()> {
    Ok(())
}

/// The first and last events of a timed run.
struct Span {
    first: cudarc::driver::CudaEvent,
    last: cudarc::driver::CudaEvent,
}

/// How this rank's experts take the slots they received (see `CudaMoeLayer::local_plan`).
struct LocalPlan {
    /// Slots of this rank's experts.
    slots: usize,
    /// Rows per expert in the padded layout, 0 for the grouped one.
    cap: usize,
    /// Rows of the expert GEMMs.
    rows: usize,
    /// (local expert, first row, rows) of each expert with rows.
    groups: Vec<(usize, usize, usize)>,
}

/// Which slots [`CudaMoeLayer::group_rows`] groups: `slots` expert ids at `ids` over
/// `experts` experts (padded to `cap` rows each when `cap > 0`), leaving out expert `skip`.
struct Grouping {
    ids: u64,
    slots: usize,
    experts: usize,
    cap: usize,
    skip: i32,
    /// Copy the rows into place (false: the Hopper GEMM gathers them itself).
    copy_rows: bool,
}

/// One MoE layer resident on a GPU.
pub struct CudaMoeLayer {
    gpu: Gpu,
    /// Side streams, each with its own cuBLAS handle.
    side: SideStreams,
    /// One grouped cuBLAS call per GEMM instead of one call per expert.
    grouped: bool,
    /// Whether the masked GEMM takes this layer's shapes (see [`masked_gemm::masked_gemm_fits`]).
    masked: bool,
    /// Whether the masked GEMMs quantize their rows to fp8 (see `fp8_activations`).
    w8a8: bool,
    /// Their rows' fp8 codes and scales.
    fp8_rows: Mutex<Option<masked_gemm::Fp8Rows>>,
    blas: BlasHandle,
    config: MoeConfig,
    k: Kernels,
    /// The weights (shared by the two halves of a dual-batch layer).
    w: std::sync::Arc<DeviceWeights>,
    bufs: Mutex<Option<Buffers>>,
    /// Set when the layer is one rank of an expert-parallel group.
    ep: Option<EpLink>,
}

fn bf16_bits(t: &Tensor) -> Vec<u16> {
    match t.cpu() {
        crate::tensor::CpuStorage::BF16(v) => v.iter().map(|x| x.to_bits()).collect(),
        _ => t.to_f32_vec().iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect(),
    }
}

pub(super) fn grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 65_535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn rows(n: usize, threads: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (n.max(1) as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

/// 256-thread blocks over `t` tokens of `h` columns for `combine`: one block per token, and
/// below about four blocks per SM that way, each token's columns shared out over up to as many
/// blocks as give every thread one 8-column chunk.
fn per_token(t: usize, h: usize) -> LaunchConfig {
    let chunks = if h.is_multiple_of(8) { h / 8 } else { h };
    let split = 528usize.div_ceil(t.max(1)).clamp(1, chunks.div_ceil(256));
    LaunchConfig { grid_dim: (t.max(1) as u32, split as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

impl CudaMoeLayer {
    fn open(config: &MoeConfig, device: usize) -> Result<(Gpu, BlasHandle, Kernels)> {
        config.validate()?;
        if config.apply_router_weight_on_input {
            return Err(MoeError::Unsupported("apply_router_weight_on_input on the CUDA backend".into()));
        }
        if config.num_experts > 1024 {
            return Err(MoeError::Unsupported(format!(
                "{} experts above 1024 on the CUDA backend",
                config.num_experts
            )));
        }
        if config.top_k > 32 {
            return Err(MoeError::Unsupported(format!("top-k {} above 32 on the CUDA backend", config.top_k)));
        }
        let gpu = Gpu::new(device)?;
        gpu.ctx.bind_to_thread().map_err(|e| err("binding context", e))?;
        let blas = BlasHandle::new(gpu.stream.clone())?;
        let f = |n: &str| gpu.function(n);
        let k = Kernels {
            to_bf16: f("f32_to_bf16_kernel")?,
            add_bias: f("add_row_bias")?,
            route: f("route")?,
            count: f("count_slots")?,
            scatter: f("scatter_slots")?,
            gather: f("gather_rows")?,
            take: f("take_rows")?,
            act: f("act_and_mul")?,
            combine: f("combine")?,
            combine_partial: f("combine_partial")?,
            sum_partials: f("sum_partials")?,
            localize: f("localize_ids")?,
            add_shared: f("add_shared")?,
            fill_bf16: f("fill_uniform_bf16")?,
            fill_f32: f("fill_uniform_f32")?,
            ll_pack: f("ll_pack")?,
            ll_group: f("ll_group")?,
            ll_gather: f("ll_gather")?,
            ll_combine: f("ll_combine")?,
            masked_gemm: f("masked_gemm")?,
            masked_gemm_fp8: f("masked_gemm_fp8")?,
            masked_gemm_w8a8: f("masked_gemm_w8a8")?,
            quantize_fp8: f("quantize_weight_blocks_fp8")?,
            quantize_bf16: f("quantize_rows_bf16")?,
            hopper: hopper_gemm::HopperGemm::load(&gpu)?,
        };
        masked_gemm::allow_masked_gemm_smem(&k.masked_gemm)?;
        masked_gemm::allow_masked_gemm_smem(&k.masked_gemm_fp8)?;
        masked_gemm::allow_masked_gemm_smem(&k.masked_gemm_w8a8)?;
        Ok((gpu, blas, k))
    }

    /// A layer over `w` on the opened GPU, with its side streams, empty buffers and bf16 rows.
    fn assemble(
        config: &MoeConfig,
        (gpu, blas, k): (Gpu, BlasHandle, Kernels),
        w: std::sync::Arc<DeviceWeights>,
        ep: Option<EpLink>,
    ) -> Result<Self> {
        Ok(CudaMoeLayer {
            side: SideStreams::new(&gpu)?,
            gpu,
            grouped: gemm_mode() == GemmMode::Grouped,
            masked: masked_gemm::masked_gemm_fits(config),
            w8a8: false,
            fp8_rows: Mutex::new(None),
            blas,
            config: config.clone(),
            k,
            w,
            bufs: Mutex::new(None),
            ep,
        })
    }

    /// Uploads `weights` (expert weights as bf16, router in f32) to GPU 0.
    pub fn new(config: &MoeConfig, weights: &MoeWeights) -> Result<Self> {
        Self::new_on(config, weights, 0, None)
    }

    /// One rank of an expert-parallel layer over `comm` (all-to-all-v of bf16 rows on the
    /// device): this rank keeps the experts of its contiguous share, `E / ranks` of them, on
    /// its communicator's GPU. Collective: every rank of `comm` builds its layer together.
    pub fn new_ep(config: &MoeConfig, weights: &MoeWeights, comm: super::NcclComm) -> Result<Self> {
        let link = Self::link(config, comm)?;
        Self::new_on(config, weights, link.comm.device(), Some(link))
    }

    fn link(config: &MoeConfig, comm: super::NcclComm) -> Result<EpLink> {
        use crate::comm::Communicator;
        let (e, n) = (config.num_experts, comm.size());
        if !e.is_multiple_of(n) {
            return Err(MoeError::Unsupported(format!(
                "the device-resident expert-parallel layer splits experts evenly: {e} experts on {n} ranks"
            )));
        }
        Ok(EpLink { first: comm.rank() * (e / n), local: e / n, comm, capacity: None, gathering: None })
    }

    fn new_on(config: &MoeConfig, weights: &MoeWeights, device: usize, ep: Option<EpLink>) -> Result<Self> {
        weights.validate(config)?;
        let (gpu, blas, k) = Self::open(config, device)?;
        let s = &gpu.stream;
        let experts = match &ep {
            Some(l) => weights.experts.select(&(l.first..l.first + l.local).collect::<Vec<_>>())?,
            None => weights.experts.clone(),
        };
        let up_f32 = |t: &Tensor| s.clone_htod(&t.to_f32_vec()).map_err(|e| err("upload", e));
        let up_bf16 = |t: &Tensor| s.clone_htod(&bf16_bits(t)).map_err(|e| err("upload", e));
        let w = DeviceWeights {
            gate: up_f32(&weights.gate)?,
            gate_bias: weights.gate_bias.as_ref().map(up_f32).transpose()?,
            correction_bias: weights.correction_bias.as_ref().map(up_f32).transpose()?,
            // Quantized experts run on the GPU as bf16 of their dequantized values (fp8 ones
            // also as their codes, which the low-latency layer streams).
            w13: up_bf16(&Tensor::from_f32(experts.w13.shape(), experts.w13_f32())?)?,
            w2: up_bf16(&Tensor::from_f32(experts.w2.shape(), experts.w2_f32())?)?,
            b13: experts.b13.as_ref().map(up_f32).transpose()?,
            b2: experts.b2.as_ref().map(up_f32).transpose()?,
            shared: match (&weights.shared, config.shared) {
                (Some(sw), Some(sc)) => Some(SharedMlp {
                    inter: sc.inter,
                    w13: up_bf16(&sw.mlp.w13)?,
                    w2: up_bf16(&sw.mlp.w2)?,
                    gate: sw.gate.as_ref().map(up_f32).transpose()?,
                }),
                _ => None,
            },
            fp8: fp8_weights::Fp8Experts::upload(&experts, s)?,
        };
        Self::assemble(config, (gpu, blas, k), std::sync::Arc::new(w), ep)
    }

    /// A layer whose weights are generated on the device (uniform, seeded), for benchmarks of
    /// shapes too large to build on the host.
    pub fn random(config: &MoeConfig, seed: u64) -> Result<Self> {
        Self::random_on(config, seed, 0, None)
    }

    /// [`CudaMoeLayer::new_ep`] with weights generated on the device (each rank its own
    /// experts), for benchmarks.
    pub fn random_ep(config: &MoeConfig, seed: u64, comm: super::NcclComm) -> Result<Self> {
        let link = Self::link(config, comm)?;
        Self::random_on(config, seed, link.comm.device(), Some(link))
    }

    fn random_on(config: &MoeConfig, seed: u64, device: usize, ep: Option<EpLink>) -> Result<Self> {
        let (gpu, blas, k) = Self::open(config, device)?;
        let (e, h, i) = (config.num_experts, config.hidden, config.inter);
        // Routed experts held here (all of them on one GPU).
        let held = ep.as_ref().map_or(e, |l| l.local);
        let seed = seed ^ ep.as_ref().map_or(0, |l| (l.first as u64) << 20);
        let biases = matches!(config.router, RouterConfig::TopKSoftmax);
        let sh = 1.0 / (h as f32).sqrt();
        let mut n = 0u64;
        let mut f32s = |len: usize, scale: f32| -> Result<CudaSlice<f32>> {
            n += 1;
            let s = gpu.stream.alloc_zeros::<f32>(len).map_err(|e| err("alloc", e))?;
            let (ptr, lenl, seed) = (dptr(&s, &gpu), len as i64, seed ^ (n << 40));
            // SAFETY: fill_uniform_f32(float*, long, u64, float) writes `len` floats of `s`.
            unsafe {
                gpu.stream.launch_builder(&k.fill_f32).arg(&ptr).arg(&lenl).arg(&seed).arg(&scale).launch(grid(len))
            }
            .map_err(|e| err("fill", e))?;
            Ok(s)
        };
        let gate = f32s(e * h, 3.0 * sh)?;
        let gate_bias = if biases { Some(f32s(e, 0.5)?) } else { None };
        let correction_bias =
            if matches!(config.router, RouterConfig::SigmoidGrouped { .. }) { Some(f32s(e, 0.05)?) } else { None };
        let b13 = if biases { Some(f32s(held * 2 * i, 0.1)?) } else { None };
        let b2 = if biases { Some(f32s(held * h, 0.1)?) } else { None };
        let mut m = 100u64;
        let mut bf16s = |len: usize, scale: f32| -> Result<CudaSlice<u16>> {
            m += 1;
            let s = gpu.stream.alloc_zeros::<u16>(len).map_err(|e| err("alloc", e))?;
            let (ptr, lenl, seed) = (dptr(&s, &gpu), len as i64, seed ^ (m << 40));
            // SAFETY: fill_uniform_bf16(bf16*, long, u64, float) writes `len` values of `s`.
            unsafe {
                gpu.stream.launch_builder(&k.fill_bf16).arg(&ptr).arg(&lenl).arg(&seed).arg(&scale).launch(grid(len))
            }
            .map_err(|e| err("fill", e))?;
            Ok(s)
        };
        let w13 = bf16s(held * 2 * i * h, 2.0 * sh)?;
        let w2 = bf16s(held * h * i, 2.0 / (i as f32).sqrt())?;
        let shared = match config.shared {
            Some(sc) => Some(SharedMlp {
                inter: sc.inter,
                w13: bf16s(2 * sc.inter * h, 2.0 * sh)?,
                w2: bf16s(h * sc.inter, 2.0 / (sc.inter as f32).sqrt())?,
                gate: None,
            }),
            None => None,
        };
        let w = DeviceWeights { gate, gate_bias, correction_bias, w13, w2, b13, b2, shared, fp8: None };
        Self::assemble(config, (gpu, blas, k), std::sync::Arc::new(w), ep)
    }

    /// The layer's configuration.
    pub fn config(&self) -> &MoeConfig {
        &self.config
    }

    /// The device's name.
    pub fn device_name(&self) -> String {
        self.gpu.ctx.name().unwrap_or_else(|_| "unknown GPU".into())
    }

    /// `hidden_states [T, H]` → `[T, H]` f32 (copies in and out included). A small batch on
    /// one GPU replays the layer's CUDA graph for its size (captured at its first call; see
    /// [`graph`]).
    pub fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        self.forward_hooked(hidden, &no_hook, true)
    }

    /// [`CudaMoeLayer::forward`], calling `hook(stage, stream)` at every stage boundary.
    /// With `graph`, a small batch on one GPU replays its graph (see [`graph`]) and `hook` is
    /// not called.
    fn forward_hooked(&self, hidden: &Tensor, hook: &StageHook<'_>, graph: bool) -> Result<Tensor> {
        let s = hidden.shape();
        if s.len() != 2 || s[1] != self.config.hidden {
            return Err(MoeError::shape("hidden_states", format!("[T, {}]", self.config.hidden), s));
        }
        let x = hidden.to_f32_vec();
        crate::error::check_finite("hidden_states", &x)?;
        let t = s[0];
        let capacity = self.capacity();
        self.check_capacity(t)?;
        let mut guard = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
        let b = self.buffers(&mut guard, capacity.unwrap_or(t))?;
        self.gpu
            .stream
            .memcpy_htod(&x, &mut b.x.slice_mut(0..t * self.config.hidden))
            .map_err(|e| err("copy in", e))?;
        match capacity {
            Some(_) => self.ll_run(b, t, false)?,
            None if graph && self.takes_graph(t) => self.graph_run(b, t, false)?,
            None => self.run_marks(b, t, false, hook)?.0,
        };
        let mut out = vec![0f32; t * self.config.hidden];
        self.gpu
            .stream
            .memcpy_dtoh(&b.out.slice(0..t * self.config.hidden), &mut out)
            .map_err(|e| err("copy out", e))?;
        Tensor::from_f32(&[t, self.config.hidden], out)
    }

    /// Runs `tokens` tokens of uniform random input already on the device and returns the
    /// per-stage event times (for benchmarks). A low-latency layer, and a small batch on one
    /// GPU (see [`graph`]), replays its graph and times only the whole;
    /// [`CudaMoeLayer::forward_timed_stages`] times the stages.
    pub fn forward_timed(&self, tokens: usize, seed: u64) -> Result<GpuStageTimes> {
        self.timed(tokens, seed, true)
    }

    /// [`CudaMoeLayer::forward_timed`] with every stage timed, without a graph (a low-latency
    /// layer runs its stages directly, on all `M` rows of its capacity).
    pub fn forward_timed_stages(&self, tokens: usize, seed: u64) -> Result<GpuStageTimes> {
        self.timed(tokens, seed, false)
    }

    fn timed(&self, tokens: usize, seed: u64, graph: bool) -> Result<GpuStageTimes> {
        self.timed_marks(tokens, seed, graph, &no_hook).map(|(times, _)| times)
    }

    /// [`CudaMoeLayer::timed`], calling `hook` at every stage boundary and also returning the
    /// run's first and last events (none when nothing ran, or for a graph replay).
    fn timed_marks(
        &self,
        tokens: usize,
        seed: u64,
        graph: bool,
        hook: &StageHook<'_>,
    ) -> Result<(GpuStageTimes, Option<Span>)> {
        let capacity = self.capacity();
        self.check_capacity(tokens)?;
        let mut guard = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
        let b = self.buffers(&mut guard, capacity.unwrap_or(tokens))?;
        let n = tokens * self.config.hidden;
        let (ptr, len, scale) = (dptr(&b.x, &self.gpu), n as i64, 1.0f32);
        // SAFETY: fills the first `n` floats of the input buffer, which holds at least `n`.
        unsafe {
            self.gpu.stream.launch_builder(&self.k.fill_f32).arg(&ptr).arg(&len).arg(&seed).arg(&scale).launch(grid(n))
        }
        .map_err(|e| err("fill", e))?;
        match capacity {
            Some(m) if !graph => {
                self.ll_set_tokens(b, tokens)?;
                self.run_marks(b, m, true, hook)
            }
            Some(_) => Ok((self.ll_run(b, tokens, true)?, None)),
            None if graph && self.takes_graph(tokens) => Ok((self.graph_run(b, tokens, true)?, None)),
            None => self.run_marks(b, tokens, true, hook),
        }
    }

    fn buffers<'a>(&self, guard: &'a mut Option<Buffers>, tokens: usize) -> Result<&'a mut Buffers> {
        if guard.as_ref().is_none_or(|b| b.tokens < tokens) {
            let graphs = guard.take().map(|b| b.graphs.carried_over()).unwrap_or_default();
            let c = &self.config;
            let (t, h, e, i, k) = (tokens.max(1), c.hidden, c.num_experts, c.inter, c.top_k);
            let wide = i.max(c.shared.map_or(0, |s| s.inter));
            let s = &self.gpu.stream;
            // Row buffers hold up to 2 t k rows (the padded layout's limit).
            let r = 2 * t * k;
            macro_rules! z {
                ($ty:ty, $n:expr) => {
                    s.alloc_zeros::<$ty>($n).map_err(|e| err("allocating workspace", e))?
                };
            }
            *guard = Some(Buffers {
                tokens: t,
                x: z!(f32, t * h),
                x_bf: z!(u16, t * h),
                logits: z!(f32, t * e),
                ids: z!(i32, t * k),
                weights: z!(f32, t * k),
                counts: z!(i32, e),
                offsets: z!(i32, e + 1),
                row_of_slot: z!(i32, t * k),
                slot_of_row: z!(i32, r),
                expert_of_row: z!(i32, r),
                a: z!(u16, r * h),
                h13: z!(u16, r.max(t) * 2 * wide),
                act: z!(u16, r.max(t) * wide),
                y: z!(u16, r.max(t) * h),
                out: z!(f32, t * h),
                ptrs: z!(u64, 3 * e.max(1)),
                sh13: z!(u16, (t * 2 * c.shared.map_or(0, |s| s.inter)).max(1)),
                sact: z!(u16, (t * c.shared.map_or(0, |s| s.inter)).max(1)),
                sy: z!(u16, if c.shared.is_some() { t * h } else { 1 }),
                ep: None,
                exchange: None,
                ll: None,
                graphs,
            });
        }
        Ok(guard.as_mut().expect("allocated above"))
    }

    /// Measured ceilings of this GPU: see [`super::measure_ceilings`].
    pub fn measure_ceilings(&self) -> Result<super::GpuCeilings> {
        super::ceiling::measure(&self.gpu, &self.blas)
    }

    /// Bytes of device memory of the weights.
    pub fn weight_bytes(&self) -> usize {
        2 * (self.w.w13.len() + self.w.w2.len()) + self.w.shared.as_ref().map_or(0, |s| 2 * (s.w13.len() + s.w2.len()))
    }

    /// Runs the layer on the `t` tokens in `b.x` into `b.out` and waits for it; with `timed`,
    /// CUDA events around every stage.
    fn run(&self, b: &mut Buffers, t: usize, timed: bool) -> Result<GpuStageTimes> {
        self.run_marks(b, t, timed, &no_hook).map(|(times, _)| times)
    }

    /// [`CudaMoeLayer::run`], calling `hook` at every stage boundary (after its event) and
    /// also returning the first and last events when timed.
    fn run_marks(
        &self,
        b: &mut Buffers,
        t: usize,
        timed: bool,
        hook: &StageHook<'_>,
    ) -> Result<(GpuStageTimes, Option<Span>)> {
        if t == 0 && self.ep.is_none() {
            return Ok((GpuStageTimes::default(), None));
        }
        let g = &self.gpu;
        let s = &g.stream;
        let marks: Vec<cudarc::driver::CudaEvent> = if timed {
            (0..10)
                .map(|_| g.ctx.new_event(Some(drv::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| err("event", e)))
                .collect::<Result<_>>()?
        } else {
            Vec::new()
        };
        let mark = |n: usize| -> Result<()> {
            if let Some(ev) = marks.get(n) {
                ev.record(s).map_err(|e| err("event", e))?;
            }
            hook(n, s)
        };
        let sent = self.enqueue(b, t, &mark)?;
        match &self.ep {
            Some(link) => link.comm.wait("moe layer", s)?,
            None => s.synchronize().map_err(|e| err("synchronize", e))?,
        }
        if !timed {
            return Ok((GpuStageTimes::default(), None));
        }
        let ms = |a: usize, z: usize| -> Result<f64> {
            Ok(marks[a].elapsed_ms(&marks[z]).map_err(|e| err("event time", e))? as f64)
        };
        let times = GpuStageTimes {
            route: ms(0, 1)?,
            permute: ms(1, 2)?,
            dispatch: ms(2, 3)?,
            gemm1: ms(3, 4)?,
            act: ms(4, 5)?,
            gemm2: ms(5, 6)?,
            collect: ms(6, 7)?,
            combine: ms(7, 8)?,
            shared: ms(8, 9)?,
            total: ms(0, 9)?,
            dispatch_bytes: sent,
            experts_used: self.experts_used(b)?,
        };
        let mut marks = marks;
        let last = marks.pop().expect("ten marks");
        Ok((times, Some(Span { first: marks.swap_remove(0), last })))
    }

    /// One GPU: the experts that received rows in the last run on `b` (0 elsewhere).
    fn experts_used(&self, b: &Buffers) -> Result<usize> {
        if self.ep.is_some() {
            return Ok(0);
        }
        let counts = self.gpu.stream.clone_dtoh(&b.counts).map_err(|e| err("reading expert counts", e))?;
        Ok(counts.iter().filter(|&&c| c > 0).count())
    }

    /// Enqueues the whole layer on the `t` tokens in `b.x` (into `b.out`) on the layer's
    /// stream, calling `mark(0..=9)` between the stages; returns the bytes dispatched to other
    /// ranks.
    fn enqueue(&self, b: &mut Buffers, t: usize, mark: &dyn Fn(usize) -> Result<()>) -> Result<usize> {
        let h = self.config.hidden;
        let g = &self.gpu;
        let s = &g.stream;
        let p = |x: &CudaSlice<f32>| dptr(x, g);
        let pb = |x: &CudaSlice<u16>| dptr(x, g);
        let opt = |x: &Option<CudaSlice<f32>>| x.as_ref().map_or(0u64, |x| dptr(x, g));
        mark(0)?;
        // An expert-parallel rank without tokens still takes part in every exchange.
        if t > 0 {
            self.route(b, t)?;
        }
        mark(1)?;
        if t > 0 {
            self.shared_on_side_stream(b, t)?;
        }
        let sent = match &self.ep {
            Some(link) if link.capacity.is_some() => self.ll_experts(b, link, mark)?,
            Some(link) if link.gathering.is_some() => {
                let how = link.gathering.expect("checked");
                self.gathered_experts(b, t, link, how, mark)?
            }
            Some(link) => self.ep_experts(b, t, link, mark)?,
            None => {
                self.local_experts(b, t, mark)?;
                if t > 0 {
                    self.combine_local(b, t)?;
                }
                0
            }
        };
        mark(8)?;
        // One GPU adds the shared output in its combine; expert-parallel ranks add it here.
        if let (Some(sh), true, true) = (&self.w.shared, t > 0, self.ep.is_some()) {
            self.side.join(s, [self.side.shared()])?;
            let (yp, xp2, gp, ti, hi, outp) = (pb(&b.sy), p(&b.x), opt(&sh.gate), t as i32, h as i32, p(&b.out));
            // SAFETY: add_shared(float*, bf16*, float*, float*, int, int) over `t` rows; the
            // shared output was computed on the side stream joined above.
            unsafe {
                s.launch_builder(&self.k.add_shared)
                    .arg(&outp)
                    .arg(&yp)
                    .arg(&xp2)
                    .arg(&gp)
                    .arg(&ti)
                    .arg(&hi)
                    .launch(rows(t, 256))
                    .map_err(|e| err("add_shared", e))?;
            }
        }
        mark(9)?;
        Ok(sent)
    }

    /// The single-GPU combine: `b.out [t, H]` = the weighted sum of each token's expert rows
    /// in slot order, plus the (gated) shared expert's output once its side stream is joined.
    fn combine_local(&self, b: &Buffers, t: usize) -> Result<()> {
        let (g, c) = (&self.gpu, &self.config);
        let s = &g.stream;
        let opt = |x: &Option<CudaSlice<f32>>| x.as_ref().map_or(0u64, |x| dptr(x, g));
        let (ys, xp, gp) = match &self.w.shared {
            Some(sh) => {
                self.side.join(s, [self.side.shared()])?;
                (dptr(&b.sy, g), dptr(&b.x, g), opt(&sh.gate))
            }
            None => (0, 0, 0),
        };
        let (yp, b2, wp, outp) = (dptr(&b.y, g), opt(&self.w.b2), dptr(&b.weights, g), dptr(&b.out, g));
        let (rs, ip) = (dptr(&b.row_of_slot, g), dptr(&b.ids, g));
        let (ti, ki, hi, applied) = (t as i32, c.top_k as i32, c.hidden as i32, 0i32);
        // SAFETY: combine(bf16*, float*, int*, float*, int*, int, int, int, int, bf16*, float*,
        // float*, float*) over the `t` tokens' slots, whose rows `b.y` holds; the shared output
        // (or null) was computed on the side stream joined above.
        unsafe {
            s.launch_builder(&self.k.combine)
                .arg(&yp)
                .arg(&b2)
                .arg(&ip)
                .arg(&wp)
                .arg(&rs)
                .arg(&ti)
                .arg(&ki)
                .arg(&hi)
                .arg(&applied)
                .arg(&ys)
                .arg(&xp)
                .arg(&gp)
                .arg(&outp)
                .launch(per_token(t, c.hidden))
        }
        .map(|_| ())
        .map_err(|e| err("combine", e))
    }

    /// f32 → bf16 copy of the tokens, router GEMM, bias, and top-k into `b.ids`/`b.weights`.
    fn route(&self, b: &Buffers, t: usize) -> Result<()> {
        let c = &self.config;
        let (h, e) = (c.hidden, c.num_experts);
        let g = &self.gpu;
        let s = &g.stream;
        let p = |x: &CudaSlice<f32>| dptr(x, g);
        let pb = |x: &CudaSlice<u16>| dptr(x, g);
        let (n_th, n) = (t * h, (t * h) as i64);
        let (xp, xbp) = (p(&b.x), pb(&b.x_bf));
        // Large batches make their bf16 copy on side stream 0, beside the router GEMM (both
        // read x from memory). Measured on H200, DeepSeek-V3 shapes, the route stage: 0.187
        // against 0.205 ms at 4096 tokens, 0.114–0.143 against 0.161–0.168 at 2048; at 512 and
        // below the fork and join cost more than they hide (0.067 against 0.062 ms).
        let overlap = t * h >= 1 << 23;
        let side = if overlap { &self.side.shared().stream } else { s };
        if overlap {
            self.side.fork(s, [self.side.shared()])?;
        }
        // SAFETY: every launch below passes device pointers to buffers sized for `t` tokens
        // (see `buffers`) with the scalar types the kernel in moe.cu declares.
        unsafe {
            side.launch_builder(&self.k.to_bf16)
                .arg(&xp)
                .arg(&xbp)
                .arg(&n)
                .launch(grid(n_th))
                .map_err(|e| err("to_bf16", e))?;
        }
        self.gemm_f32_router(b, t)?;
        if let Some(bias) = &self.w.gate_bias {
            let (lp, bp, ti, ei) = (p(&b.logits), p(bias), t as i32, e as i32);
            // SAFETY: as above.
            unsafe { s.launch_builder(&self.k.add_bias).arg(&lp).arg(&bp).arg(&ti).arg(&ei).launch(grid(t * e)) }
                .map_err(|e| err("add_bias", e))?;
        }
        self.top_k(dptr(&b.logits, g), t, dptr(&b.ids, g), dptr(&b.weights, g))?;
        if overlap {
            self.side.join(s, [self.side.shared()])?;
        }
        Ok(())
    }

    /// Top-k ids `[t, k]` and weights `[t, k]` at `ids` and `weights` from the router logits
    /// `[t, E]` (bias added) at `logits`, for the layer's router kind.
    fn top_k(&self, logits: u64, t: usize, ids: u64, weights: u64) -> Result<()> {
        let c = &self.config;
        let (e, k) = (c.num_experts, c.top_k);
        let g = &self.gpu;
        let (kind, n_group, topk_group, renorm, scaling) = match c.router {
            RouterConfig::Softmax { renormalize } => (0i32, 1i32, 1i32, renormalize as i32, 1.0f32),
            RouterConfig::TopKSoftmax => (1, 1, 1, 0, 1.0),
            RouterConfig::SigmoidGrouped { n_group, topk_group, renormalize, scaling } => {
                (2, n_group as i32, topk_group as i32, renormalize as i32, scaling)
            }
            RouterConfig::SoftmaxGrouped { n_group, topk_group, renormalize, scaling } => {
                (3, n_group as i32, topk_group as i32, renormalize as i32, scaling)
            }
        };
        if n_group > 64 {
            return Err(MoeError::Unsupported("more than 64 expert groups on the CUDA backend".into()));
        }
        if t == 0 {
            return Ok(());
        }
        let bp = self.w.correction_bias.as_ref().map_or(0u64, |x| dptr(x, g));
        let (ti, ei, ki) = (t as i32, e as i32, k as i32);
        // SAFETY: route(float*, float*, int, int, int, int, int, int, int, float, int*, float*)
        // reads t · E logits (and E bias values) and writes t · k ids and weights.
        unsafe {
            g.stream
                .launch_builder(&self.k.route)
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

    /// Rows of `b.x_bf` into `b.a` grouped by expert (expert `x` from row `offsets[x]`, or
    /// `x · cap` when `cap > 0`), with the slot/row maps; without `copy_rows` only the maps
    /// (the Hopper GEMM then gathers the rows itself).
    fn permute(&self, b: &Buffers, t: usize, cap: usize, copy_rows: bool) -> Result<()> {
        let (e, k) = (self.config.num_experts, self.config.top_k);
        let g = &self.gpu;
        let pi = |x: &CudaSlice<i32>| dptr(x, g);
        let maps = [pi(&b.row_of_slot), pi(&b.slot_of_row), pi(&b.expert_of_row)];
        let plan = Grouping { ids: pi(&b.ids), slots: t * k, experts: e, cap, skip: -1, copy_rows };
        self.group_rows(&plan, pi(&b.counts), pi(&b.offsets), maps, dptr(&b.x_bf, g), k, dptr(&b.a, g))
    }

    /// Offsets from the device counts, the slot/row maps, and row `s / k` of `x` copied to row
    /// `row_of_slot[s]` of `a` for every slot (slots of expert `skip` are left out).
    #[allow(clippy::too_many_arguments)]
    fn group_rows(
        &self,
        p: &Grouping,
        counts: u64,
        offsets: u64,
        maps: [u64; 3],
        x: u64,
        k: usize,
        a: u64,
    ) -> Result<()> {
        let s = &self.gpu.stream;
        let (slots, ei, capi, skip) = (p.slots as i32, p.experts as i32, p.cap as i32, p.skip);
        let [rs, sr, er] = maps;
        let warps = LaunchConfig { grid_dim: (p.experts as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        let (hi, ki) = (self.config.hidden as i32, k as i32);
        // SAFETY: scatter_slots(int*, int, int, int*, int, int, int*, int*, int*, int*) and
        // gather_rows(bf16*, int, int*, int, int, bf16*) over buffers the caller sized for `slots`
        // slots, `experts` counts, `experts + 1` offsets and the rows the counts give (e · cap <= 2
        // slots when padded).
        unsafe {
            s.launch_builder(&self.k.scatter)
                .arg(&p.ids)
                .arg(&slots)
                .arg(&ei)
                .arg(&counts)
                .arg(&capi)
                .arg(&skip)
                .arg(&offsets)
                .arg(&rs)
                .arg(&sr)
                .arg(&er)
                .launch(warps)
                .map_err(|e| err("scatter", e))?;
            if p.copy_rows {
                s.launch_builder(&self.k.gather)
                    .arg(&x)
                    .arg(&hi)
                    .arg(&rs)
                    .arg(&ki)
                    .arg(&slots)
                    .arg(&a)
                    .launch(rows(p.slots, 128))
                    .map_err(|e| err("gather", e))?;
            }
        }
        Ok(())
    }

    /// Padded (`cap` rows per expert, one strided-batched GEMM) unless padding would more
    /// than double `rows`, or the Hopper GEMM runs (it takes the grouped layout as it is, see
    /// `hopper_for`); 0 means grouped.
    fn padding(&self, experts: usize, rows: usize, counts: impl Iterator<Item = usize>) -> usize {
        let max = counts.max().unwrap_or(0);
        let padded = match gemm_mode() {
            GemmMode::Padded => true,
            GemmMode::Auto => self.hopper_for(rows, experts).is_none() && rows / experts.max(1) <= 192,
            GemmMode::Cublas => rows / experts.max(1) <= 192,
            GemmMode::Loop | GemmMode::Grouped | GemmMode::Hopper => false,
        };
        if padded && experts * max <= 2 * rows {
            max
        } else {
            0
        }
    }

    /// GEMM, activation, GEMM over `a` (rows grouped as `groups` say, or padded to `cap` per
    /// expert over `experts` experts; `dev` holds the same counts and row offsets on the
    /// device; the Hopper GEMM runs when the offsets are there, with the activation in its
    /// up projection's epilogue), writing `y`.
    #[allow(clippy::too_many_arguments)]
    fn mlp(
        &self,
        b: &mut Buffers,
        bufs: [u64; 5],
        experts: usize,
        cap: usize,
        (groups, dev): (&[(usize, usize, usize)], [u64; 2]),
        rows_total: usize,
        gather: Option<Gather>,
        mark: &dyn Fn(usize) -> Result<()>,
    ) -> Result<()> {
        let [a, h13, act, y, expert_of_row] = bufs;
        let (h, i) = (self.config.hidden, self.config.inter);
        let act_rows = if cap > 0 { experts * cap } else { rows_total };
        // W8A8 through cuBLAS: the rows rounded to their fp8 values first.
        if self.w8a8 {
            self.round_rows_fp8(a, act_rows, h)?;
        }
        let b13 = self.w.b13.as_ref().map_or(0u64, |x| dptr(x, &self.gpu));
        let hopper = self.hopper_for(rows_total, experts).filter(|_| cap == 0 && dev[1] != 0);
        if gather.is_some() && hopper.is_none() {
            return Err(MoeError::Unsupported("rows left to gather without the Hopper GEMM".into()));
        }
        if let Some(hg) = hopper {
            let epilogue = Epilogue::Activation { activation: self.config.activation, bias: b13 };
            hg.run(
                &self.gpu.stream,
                dptr(&self.w.w13, &self.gpu),
                [2 * i, h],
                [a, act],
                act_rows,
                dev,
                experts,
                epilogue,
                gather,
            )?;
            mark(4)?;
        } else {
            match cap {
                0 => self.grouped_gemm(b, &self.w.w13, 2 * i, h, a, h13, groups)?,
                _ => self.padded_gemm(&self.w.w13, 2 * i, h, a, h13, experts, cap)?,
            }
            mark(4)?;
            self.act(&self.gpu.stream, [h13, b13, expert_of_row, 0, act], cap as i32, act_rows, i)?;
        }
        if self.w8a8 {
            self.round_rows_fp8(act, act_rows, i)?;
        }
        mark(5)?;
        match (hopper, cap) {
            (Some(hg), _) => {
                let w2 = dptr(&self.w.w2, &self.gpu);
                hg.run(&self.gpu.stream, w2, [h, i], [act, y], act_rows, dev, experts, Epilogue::Product, None)?
            }
            (None, 0) => self.grouped_gemm(b, &self.w.w2, h, i, act, y, groups)?,
            (None, _) => self.padded_gemm(&self.w.w2, h, i, act, y, experts, cap)?,
        }
        mark(6)
    }

    /// The single-GPU middle of the layer: permute, the experts, output rows in `b.y`.
    fn local_experts(&self, b: &mut Buffers, t: usize, mark: &dyn Fn(usize) -> Result<()>) -> Result<()> {
        let (e, k) = (self.config.num_experts, self.config.top_k);
        let g = &self.gpu;
        let s = &g.stream;
        let (ip, cp, slots, ei) = (dptr(&b.ids, g), dptr(&b.counts, g), (t * k) as i32, e as i32);
        let warps = LaunchConfig { grid_dim: (e as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: count_slots(int*, int, int, int*) over the `t k` ids of this batch.
        unsafe { s.launch_builder(&self.k.count).arg(&ip).arg(&slots).arg(&ei).arg(&cp).launch(warps) }
            .map_err(|e| err("count", e))?;
        // fp8 experts run the masked GEMM on the grouped (unpadded) rows while the weights
        // dominate (up to 32 rows per expert on average; measured on H200, DeepSeek-V3 shapes:
        // 1.19 ms against bf16's 1.56 at 16 rows, 2.92 against 1.80 at 64); cuBLAS on their bf16
        // values above (rows rounded to fp8 first when they are quantized too).
        let fp8 = self.w.fp8.is_some() && self.masked && t * k <= 32 * e;
        // Expert sizes on the host decide cuBLAS's GEMM shapes; the masked and Hopper GEMMs
        // read them on the device, so the host does not wait for them.
        let on_device = fp8 || self.hopper_for(t * k, e).is_some();
        let mut counts = Vec::new();
        if !on_device {
            counts = vec![0i32; e];
            s.memcpy_dtoh(&b.counts, &mut counts).map_err(|e| err("reading expert counts", e))?;
        }
        let cap = if on_device { 0 } else { self.padding(e, t * k, counts.iter().map(|&c| c as usize)) };
        // The Hopper GEMM gathers the rows of its up projection itself.
        let gather = (!fp8 && self.hopper_gathers(t * k, e, cap)).then(|| Gather {
            x: dptr(&b.x_bf, g),
            slot_of_row: dptr(&b.slot_of_row, g),
            k,
        });
        self.permute(b, t, cap, gather.is_none())?;
        let mut groups = Vec::new();
        let mut off = 0usize;
        for (x, &cnt) in counts.iter().enumerate() {
            if cnt > 0 {
                groups.push((x, off, cnt as usize));
            }
            off += cnt as usize;
        }
        mark(2)?;
        mark(3)?;
        let bufs = [dptr(&b.a, g), dptr(&b.h13, g), dptr(&b.act, g), dptr(&b.y, g), dptr(&b.expert_of_row, g)];
        if fp8 {
            // fp8 experts: the masked GEMM over the grouped rows, counts and offsets on the device.
            let [a, h13, act, y, expert_of_row] = bufs;
            let (counts, offsets) = (dptr(&b.counts, g), dptr(&b.offsets, g));
            let b13 = self.w.b13.as_ref().map_or(0u64, |x| dptr(x, g));
            self.masked_gemm(masked_gemm::Projection::Up, [a, h13], 0, counts, offsets, t * k)?;
            mark(4)?;
            self.act(s, [h13, b13, expert_of_row, 0, act], 0, t * k, self.config.inter)?;
            mark(5)?;
            self.masked_gemm(masked_gemm::Projection::Down, [act, y], 0, counts, offsets, t * k)?;
            mark(6)?;
        } else {
            let dev = [dptr(&b.counts, g), dptr(&b.offsets, g)];
            self.mlp(b, bufs, e, cap, (&groups, dev), t * k, gather, mark)?;
        }
        mark(7)
    }

    /// The expert-parallel layer after routing, with token dispatch as DeepEP does it: each
    /// token goes once to every rank holding one of its experts, with its ids and weights (the
    /// counts are all-gathered first, on the device); there its slots are regrouped by local
    /// expert for the GEMMs, and the weighted sum over the local slots comes back as one bf16
    /// row per (token, rank), summed at home in rank order into `b.out`. Returns the bytes this
    /// rank sent to other ranks in the dispatch.
    fn ep_experts(
        &self,
        b: &mut Buffers,
        t: usize,
        link: &EpLink,
        mark: &dyn Fn(usize) -> Result<()>,
    ) -> Result<usize> {
        use crate::comm::Communicator;
        let c = &self.config;
        let (h, e, k) = (c.hidden, c.num_experts, c.top_k);
        let (n, rank, el, first) = (link.comm.size(), link.comm.rank(), link.local, link.first);
        let g = &self.gpu;
        let s = &g.stream;
        // Home: slots per expert, and the ranks each token goes to, in token order per
        // destination (the one host read of the routing).
        let (ids, counts) = self.read_routing(b, t)?;
        // The GPU waits for this loop. Up to 64 ranks, each token's destinations are a bit
        // mask, without a division or an unpredictable branch per slot (4096 tokens, top-8,
        // EP 2: 45–75 µs against 105 µs for a branch per slot on a 2-core dev VM; the
        // branchy loop with divisions took 0.21–0.26 ms on the H200 host).
        let mut lists: Vec<Vec<usize>> = (0..n).map(|_| Vec::with_capacity(t)).collect();
        if n <= 64 {
            let bit_of: Vec<u64> = (0..e).map(|x| 1 << (x / el)).collect();
            for (tok, row) in ids.chunks_exact(k).enumerate() {
                let mut mask = row.iter().fold(0u64, |m, &id| m | bit_of[id as usize]);
                while mask != 0 {
                    lists[mask.trailing_zeros() as usize].push(tok);
                    mask &= mask - 1;
                }
            }
        } else {
            for (tok, row) in ids.chunks_exact(k).enumerate() {
                for &id in row {
                    let list = &mut lists[id as usize / el];
                    if list.last() != Some(&tok) {
                        list.push(tok);
                    }
                }
            }
        }
        let send_tok: Vec<usize> = lists.iter().map(Vec::len).collect();
        let sent: usize = send_tok.iter().sum();
        let (mut send_idx, mut home_rows) = (Vec::with_capacity(sent), vec![-1i32; t * n]);
        for (d, list) in lists.iter().enumerate() {
            for &tok in list {
                home_rows[tok * n + d] = send_idx.len() as i32;
                send_idx.push(tok as i32);
            }
        }
        // Every rank's slot counts per expert and token counts per destination.
        let m = e + n;
        let mine: Vec<i32> = counts.iter().copied().chain(send_tok.iter().map(|&x| x as i32)).collect();
        let all = self.gather_counts(b, link, &mine)?;
        let recv_tok: Vec<usize> = (0..n).map(|src| all[src * m + e + rank] as usize).collect();
        let received: usize = recv_tok.iter().sum();
        let local: Vec<usize> = (0..el).map(|j| (0..n).map(|src| all[src * m + first + j] as usize).sum()).collect();
        let plan = self.local_plan(&local);
        let need = [sent, received, plan.rows, t];
        self.grow_ep_buffers(b, need, n)?;
        let ep = b.ep.as_mut().expect("allocated");
        let up = |what: &str, r: std::result::Result<(), cudarc::driver::DriverError>| r.map_err(|e| err(what, e));
        if sent > 0 {
            up("upload", s.memcpy_htod(&send_idx, &mut ep.send_idx.slice_mut(0..sent)))?;
        }
        if t > 0 {
            up("upload", s.memcpy_htod(&home_rows, &mut ep.home_rows.slice_mut(0..t * n)))?;
        }
        let (pi, pf, pb) =
            (|x: &CudaSlice<i32>| dptr(x, g), |x: &CudaSlice<f32>| dptr(x, g), |x: &CudaSlice<u16>| dptr(x, g));
        let (xbp, send_rows, send_idx_p) = (pb(&b.x_bf), pb(&ep.send_rows), pi(&ep.send_idx));
        let (recv_rows, recv_ids, recv_w) = (pb(&ep.recv_rows), pi(&ep.recv_ids), pf(&ep.recv_w));
        let (part, back) = (pb(&ep.part), pb(&ep.back));
        let (home_rows_p, send_ids_p, send_w_p) = (pi(&ep.home_rows), pi(&ep.send_ids), pf(&ep.send_w));
        let (hi, sent_i, k2) = (h as i32, sent as i32, 2 * k as i32);
        // The token rows, and their ids and weights (k 4-byte values = 2k 16-bit words a row).
        for (src, width, dst) in
            [(xbp, hi, send_rows), (pi(&b.ids), k2, send_ids_p), (dptr(&b.weights, g), k2, send_w_p)]
        {
            // SAFETY: take_rows(bf16*, int*, int, int, bf16*): dst[j] = src[send_idx[j]] for j <
            // sent, rows of `width` 16-bit words; every index is a token of this batch.
            unsafe {
                s.launch_builder(&self.k.take)
                    .arg(&src)
                    .arg(&send_idx_p)
                    .arg(&sent_i)
                    .arg(&width)
                    .arg(&dst)
                    .launch(rows(sent, 128))
            }
            .map_err(|e| err("take_rows", e))?;
        }
        mark(2)?;
        self.exchange_rows(
            link,
            "moe dispatch",
            &[(send_rows, 2 * h), (send_ids_p, 4 * k), (send_w_p, 4 * k)],
            &send_tok,
            &[(recv_rows, 2 * h), (recv_ids, 4 * k), (recv_w, 4 * k)],
            &recv_tok,
        )?;
        self.serve_received(b, received, &plan, mark)?;
        self.exchange_rows(link, "moe combine", &[(part, 2 * h)], &recv_tok, &[(back, 2 * h)], &send_tok)?;
        mark(7)?;
        self.sum_home(back, home_rows_p, t, n, dptr(&b.out, g))?;
        let row = 2 * h + 8 * k;
        Ok(send_tok.iter().enumerate().filter(|&(d, _)| d != rank).map(|(_, &r)| r * row).sum())
    }

    /// `out [t, H]` (f32) = for each home token, the sum in order of the `n` bf16 rows of
    /// `back` that `home_rows` (`t · n` ints, -1: none) names for it.
    fn sum_home(&self, back: u64, home_rows: u64, t: usize, n: usize, out: u64) -> Result<()> {
        if t == 0 {
            return Ok(());
        }
        let (ti, ni, hi) = (t as i32, n as i32, self.config.hidden as i32);
        // SAFETY: sum_partials(bf16*, int*, int, int, int, float*): home_rows holds t · n
        // entries, each -1 or a row of `back`; `out` holds t rows of H.
        unsafe {
            self.gpu
                .stream
                .launch_builder(&self.k.sum_partials)
                .arg(&back)
                .arg(&home_rows)
                .arg(&ti)
                .arg(&ni)
                .arg(&hi)
                .arg(&out)
                .launch(rows(t, 256))
        }
        .map(|_| ())
        .map_err(|e| err("sum_partials", e))
    }

    /// This rank's routing read to the host: the `t · k` expert ids and the slots per expert.
    fn read_routing(&self, b: &Buffers, t: usize) -> Result<(Vec<i32>, Vec<i32>)> {
        let k = self.config.top_k;
        let mut ids = vec![0i32; t * k];
        if t > 0 {
            self.gpu.stream.memcpy_dtoh(&b.ids.slice(0..t * k), &mut ids).map_err(|e| err("reading ids", e))?;
        }
        let mut counts = vec![0i32; self.config.num_experts];
        for &id in &ids {
            counts[id as usize] += 1;
        }
        Ok((ids, counts))
    }

    /// Every rank's `mine` (the same length on every rank), rank after rank, through an NCCL
    /// all-gather on the device and a host read.
    fn gather_counts(&self, b: &mut Buffers, link: &EpLink, mine: &[i32]) -> Result<Vec<i32>> {
        use crate::comm::Communicator;
        use cudarc::nccl::sys as nc;
        let (n, m, s) = (link.comm.size(), mine.len(), &self.gpu.stream);
        if b.exchange.as_ref().is_none_or(|x| x.len() < m * (n + 1)) {
            b.exchange = Some(s.alloc_zeros::<i32>(m * (n + 1)).map_err(|e| err("allocating workspace", e))?);
        }
        let ex = b.exchange.as_mut().expect("allocated");
        s.memcpy_htod(mine, &mut ex.slice_mut(0..m)).map_err(|e| err("upload", e))?;
        let exp = dptr(ex, &self.gpu);
        link.comm.enqueue("moe counts", s, |comm, cs| {
            // SAFETY: all-gather of m ints per rank into the n · m ints after this rank's own.
            unsafe {
                nc::ncclAllGather(exp as _, (exp + 4 * m as u64) as _, m, nc::ncclDataType_t::ncclInt32, comm, cs)
            }
        })?;
        link.comm.wait("moe counts", s)?;
        let mut all = vec![0i32; n * m];
        s.memcpy_dtoh(&b.exchange.as_ref().expect("allocated").slice(m..m * (n + 1)), &mut all)
            .map_err(|e| err("reading counts", e))?;
        Ok(all)
    }

    /// How this rank's experts take `local[j]` slots each: padded to a capacity (`cap` > 0)
    /// or grouped, the rows of the grouped GEMMs, and (expert, first row, rows) per expert hit.
    fn local_plan(&self, local: &[usize]) -> LocalPlan {
        let el = local.len();
        let slots: usize = local.iter().sum();
        let cap = self.padding(el, slots, local.iter().copied());
        let mut groups = Vec::new();
        let mut off = 0;
        for (j, &cnt) in local.iter().enumerate() {
            if cnt > 0 {
                groups.push((j, if cap > 0 { j * cap } else { off }, cnt));
            }
            off += cnt;
        }
        LocalPlan { slots, cap, rows: if cap > 0 { el * cap } else { slots }, groups }
    }

    /// Where the experts are: the `received` tokens in `b.ep` (rows, ids, weights) through
    /// this rank's experts, as planned, into `part` (one bf16 row per received token: the
    /// weighted sum of its slots held here, in slot order; zeros where none is).
    fn serve_received(
        &self,
        b: &mut Buffers,
        received: usize,
        plan: &LocalPlan,
        mark: &dyn Fn(usize) -> Result<()>,
    ) -> Result<()> {
        let link = self.ep.as_ref().expect("an expert-parallel layer");
        let (h, k, el, first) = (self.config.hidden, self.config.top_k, link.local, link.first);
        let (g, cap) = (&self.gpu, plan.cap);
        let s = &g.stream;
        let ep = b.ep.as_ref().expect("allocated by the caller");
        let (pi, pf, pb) =
            (|x: &CudaSlice<i32>| dptr(x, g), |x: &CudaSlice<f32>| dptr(x, g), |x: &CudaSlice<u16>| dptr(x, g));
        let (recv_rows, recv_ids, recv_w, local_ids) =
            (pb(&ep.recv_rows), pi(&ep.recv_ids), pf(&ep.recv_w), pi(&ep.local_ids));
        let (ecounts, eoffsets, part) = (pi(&ep.counts), pi(&ep.offsets), pb(&ep.part));
        let maps = [pi(&ep.row_of_slot), pi(&ep.slot_of_row), pi(&ep.expert_of_row)];
        let bufs = [pb(&ep.a), pb(&ep.h13), pb(&ep.act), pb(&ep.y), maps[2]];
        let hi = h as i32;
        // Where the experts are: the received slots regrouped by local expert.
        let (rk, first_i, el_i, buckets) = ((received * k) as i32, first as i32, el as i32, (el + 1) as i32);
        // SAFETY: localize_ids(int*, int, int, int, int*) and count_slots(int*, int, int, int*)
        // over the received * k ids; the counts buffer holds el + 1 buckets.
        unsafe {
            s.launch_builder(&self.k.localize)
                .arg(&recv_ids)
                .arg(&rk)
                .arg(&first_i)
                .arg(&el_i)
                .arg(&local_ids)
                .launch(grid(received * k))
                .map_err(|e| err("localize_ids", e))?;
            let warps = LaunchConfig { grid_dim: (el as u32 + 1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
            s.launch_builder(&self.k.count)
                .arg(&local_ids)
                .arg(&rk)
                .arg(&buckets)
                .arg(&ecounts)
                .launch(warps)
                .map_err(|e| err("count", e))?;
        }
        // As on one GPU, the Hopper GEMM gathers the received rows of its up projection itself.
        let gather =
            self.hopper_gathers(plan.slots, el, cap).then_some(Gather { x: recv_rows, slot_of_row: maps[1], k });
        let copy_rows = gather.is_none();
        let grouping =
            Grouping { ids: local_ids, slots: received * k, experts: el + 1, cap, skip: el as i32, copy_rows };
        self.group_rows(&grouping, ecounts, eoffsets, maps, recv_rows, k, bufs[0])?;
        mark(3)?;
        self.mlp(b, bufs, el, cap, (&plan.groups, [ecounts, eoffsets]), plan.slots, gather, mark)?;
        let b2 = self.w.b2.as_ref().map_or(0u64, |x| dptr(x, g));
        let (ri, ki) = (received as i32, k as i32);
        // SAFETY: combine_partial(bf16*, float*, int*, float*, int*, int, int, int, bf16*) over
        // the received tokens; rows come from the grouping above.
        unsafe {
            s.launch_builder(&self.k.combine_partial)
                .arg(&bufs[3])
                .arg(&b2)
                .arg(&local_ids)
                .arg(&recv_w)
                .arg(&maps[0])
                .arg(&ri)
                .arg(&ki)
                .arg(&hi)
                .arg(&part)
                .launch(rows(received, 256))
        }
        .map_err(|e| err("combine_partial", e))?;
        Ok(())
    }

    /// Sends `from[peer]` rows of each `(buffer, bytes per row)` in `src` (rows grouped by
    /// peer) to every peer and receives `into[peer]` rows into the matching buffers of `dst`, in
    /// one NCCL group on the layer's stream; the rows a rank keeps are a device copy.
    fn exchange_rows(
        &self,
        link: &EpLink,
        op: &str,
        src: &[(u64, usize)],
        from: &[usize],
        dst: &[(u64, usize)],
        into: &[usize],
    ) -> Result<()> {
        use crate::comm::Communicator;
        use cudarc::nccl::sys as nc;
        let (n, rank) = (link.comm.size(), link.comm.rank());
        let s = &self.gpu.stream;
        let (so, ro) = (from[..rank].iter().sum::<usize>(), into[..rank].iter().sum::<usize>());
        for (&(sb, sw), &(db, _)) in src.iter().zip(dst) {
            if from[rank] > 0 {
                // SAFETY: both ranges lie inside buffers sized for these counts; the copy is
                // ordered on the layer's stream.
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        db + (ro * sw) as u64,
                        sb + (so * sw) as u64,
                        from[rank] * sw,
                        s.cu_stream(),
                    )
                }
                .map_err(|e| err("local copy", e))?;
            }
        }
        link.comm.enqueue(op, s, |comm, cs| {
            let (mut so, mut ro) = (0usize, 0usize);
            for peer in 0..n {
                for (&(sb, sw), &(db, dw)) in src.iter().zip(dst) {
                    let (sn, rn) = if peer == rank { (0, 0) } else { (from[peer] * sw, into[peer] * dw) };
                    // SAFETY: offsets stay inside the buffers, sized for these counts; every
                    // peer posts the matching calls, in the same order, from the same counts.
                    let r = unsafe {
                        let u8t = nc::ncclDataType_t::ncclUint8;
                        let mut r = nc::ncclResult_t::ncclSuccess;
                        if sn > 0 {
                            r = nc::ncclSend((sb + (so * sw) as u64) as _, sn, u8t, peer as i32, comm, cs);
                        }
                        if rn > 0 && r == nc::ncclResult_t::ncclSuccess {
                            r = nc::ncclRecv((db + (ro * dw) as u64) as _, rn, u8t, peer as i32, comm, cs);
                        }
                        r
                    };
                    if r != nc::ncclResult_t::ncclSuccess {
                        return r;
                    }
                }
                so += from[peer];
                ro += into[peer];
            }
            nc::ncclResult_t::ncclSuccess
        })
    }

    /// `b.ep` grown, where needed, to `need` = [rows sent, rows received, expert rows, home
    /// tokens] on `ranks` ranks (each capacity keeps its largest so far).
    fn grow_ep_buffers(&self, b: &mut Buffers, need: [usize; 4], ranks: usize) -> Result<()> {
        if b.ep.as_ref().is_none_or(|x| x.cap.iter().zip(&need).any(|(have, want)| have < want)) {
            let old = b.ep.as_ref().map_or([0; 4], |x| x.cap);
            b.ep = None;
            b.ep = Some(self.ep_buffers(std::array::from_fn(|i| need[i].max(old[i])), ranks)?);
        }
        Ok(())
    }

    /// Expert-parallel buffers for `cap` = [rows sent, rows received, expert rows, home tokens]
    /// (each rounded up to a power of two) on `ranks` ranks.
    fn ep_buffers(&self, cap: [usize; 4], ranks: usize) -> Result<EpBuffers> {
        let c = &self.config;
        let (h, i, k, e) = (c.hidden, c.inter, c.top_k, c.num_experts);
        let el = self.ep.as_ref().map_or(e, |l| l.local);
        let cap = cap.map(|x| x.max(1).next_power_of_two());
        let [sent, recv, rows2, t] = cap;
        let s = &self.gpu.stream;
        let z16 = |n: usize| s.alloc_zeros::<u16>(n).map_err(|e| err("allocating workspace", e));
        let z32 = |n: usize| s.alloc_zeros::<i32>(n).map_err(|e| err("allocating workspace", e));
        let zf = |n: usize| s.alloc_zeros::<f32>(n).map_err(|e| err("allocating workspace", e));
        Ok(EpBuffers {
            cap,
            send_idx: z32(sent)?,
            send_rows: z16(sent * h)?,
            send_ids: z32(sent * k)?,
            send_w: zf(sent * k)?,
            home_rows: z32(t * ranks)?,
            back: z16(sent * h)?,
            recv_rows: z16(recv * h)?,
            recv_ids: z32(recv * k)?,
            recv_w: zf(recv * k)?,
            local_ids: z32(recv * k)?,
            counts: z32(el + 1)?,
            offsets: z32(el + 2)?,
            row_of_slot: z32(recv * k)?,
            slot_of_row: z32(rows2)?,
            expert_of_row: z32(rows2)?,
            a: z16(rows2 * h)?,
            h13: z16(rows2 * 2 * i)?,
            act: z16(rows2 * i)?,
            y: z16(rows2 * h)?,
            part: z16(recv * h)?,
            send_logits: zf(sent * e)?,
            recv_logits: zf(recv * e)?,
        })
    }

    /// logits `[T, E]` = x `[T, H]` · gate `[E, H]`ᵀ in f32 (pedantic f32: no TF32).
    fn gemm_f32_router(&self, b: &Buffers, t: usize) -> Result<()> {
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

    /// For each group (expert, first row, rows): `C[rows, n] = A[rows, kdim] · W[expert]ᵀ`,
    /// bf16 in and out, f32 accumulation, one grouped cuBLAS call.
    #[allow(clippy::too_many_arguments)]
    fn grouped_gemm(
        &self,
        b: &mut Buffers,
        w: &CudaSlice<u16>,
        n: usize,
        kdim: usize,
        a: u64,
        c: u64,
        groups: &[(usize, usize, usize)],
    ) -> Result<()> {
        if groups.is_empty() {
            return Ok(());
        }
        if !self.grouped {
            // One cuBLAS GEMM per expert, spread over the side streams: each picks its best
            // tensor-core kernel for its size, and together they fill the GPU.
            let main = &self.gpu.stream;
            let streams = self.side.gemm();
            self.side.fork(main, streams)?;
            let wbase = dptr(w, &self.gpu);
            for (q, &(x, off, r)) in groups.iter().enumerate() {
                let blas = &streams[q % streams.len()].blas;
                gemm_bf16(
                    blas,
                    wbase + 2 * (x * n * kdim) as u64,
                    n,
                    kdim,
                    a + 2 * (off * kdim) as u64,
                    c + 2 * (off * n) as u64,
                    r,
                )?;
            }
            self.side.join(main, streams)?;
            return Ok(());
        }
        let g = &self.gpu;
        let count = groups.len();
        let wbase = dptr(w, g);
        let mut ptrs = Vec::with_capacity(3 * count);
        ptrs.extend(groups.iter().map(|&(x, _, _)| wbase + 2 * (x * n * kdim) as u64));
        ptrs.extend(groups.iter().map(|&(_, off, _)| a + 2 * (off * kdim) as u64));
        ptrs.extend(groups.iter().map(|&(_, off, _)| c + 2 * (off * n) as u64));
        g.stream.memcpy_htod(&ptrs, &mut b.ptrs.slice_mut(0..3 * count)).map_err(|e| err("GEMM pointer arrays", e))?;
        let base = dptr(&b.ptrs, g);
        let ta = vec![cb::cublasOperation_t::CUBLAS_OP_T; count];
        let tb = vec![cb::cublasOperation_t::CUBLAS_OP_N; count];
        let m: Vec<i32> = vec![n as i32; count];
        let nn: Vec<i32> = groups.iter().map(|&(_, _, r)| r as i32).collect();
        let kk: Vec<i32> = vec![kdim as i32; count];
        let ones = vec![1.0f32; count];
        let zeros = vec![0.0f32; count];
        let sizes = vec![1i32; count];
        // SAFETY: column-major per group: C [n, rows] = W [kdim, n]ᵀ · A [kdim, rows]; the
        // device pointer arrays (uploaded above, stream-ordered) address `count` matrices of
        // those sizes inside the weight and workspace buffers; host arrays have `count` entries.
        let st = unsafe {
            cb::cublasGemmGroupedBatchedEx(
                *self.blas.handle(),
                ta.as_ptr(),
                tb.as_ptr(),
                m.as_ptr(),
                nn.as_ptr(),
                kk.as_ptr(),
                ones.as_ptr() as *const _,
                base as *const *const _,
                cb::cudaDataType_t::CUDA_R_16BF,
                kk.as_ptr(),
                (base + 8 * count as u64) as *const *const _,
                cb::cudaDataType_t::CUDA_R_16BF,
                kk.as_ptr(),
                zeros.as_ptr() as *const _,
                (base + 16 * count as u64) as *const *mut _,
                cb::cudaDataType_t::CUDA_R_16BF,
                m.as_ptr(),
                count as i32,
                sizes.as_ptr(),
                cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            )
        };
        check(st, "grouped GEMM")
    }

    /// Starts the shared experts of the `t` tokens in `b.x_bf` on side stream 0, writing `b.sy`;
    /// they overlap the routed experts until the main stream joins the side stream.
    fn shared_on_side_stream(&self, b: &Buffers, t: usize) -> Result<()> {
        let Some(sh) = &self.w.shared else { return Ok(()) };
        let (h, si) = (self.config.hidden, sh.inter);
        let (stream, blas) = (&self.side.shared().stream, &self.side.shared().blas);
        self.side.fork(&self.gpu.stream, [self.side.shared()])?;
        let g = &self.gpu;
        gemm_bf16(blas, dptr(&sh.w13, g), 2 * si, h, dptr(&b.x_bf, g), dptr(&b.sh13, g), t)?;
        // Null bias and expert map: the shared MLP is one expert without biases.
        self.act(stream, [dptr(&b.sh13, g), 0, 0, 0, dptr(&b.sact, g)], 0, t, si)?;
        gemm_bf16(blas, dptr(&sh.w2, g), h, si, dptr(&b.sact, g), dptr(&b.sy, g), t)
    }

    /// [`act_and_mul`] with this layer's kernel and activation.
    fn act(
        &self,
        stream: &cudarc::driver::CudaStream,
        ptrs: [u64; 5],
        cap: i32,
        rows: usize,
        inter: usize,
    ) -> Result<()> {
        act_and_mul(stream, &self.k.act, self.config.activation, ptrs, cap, rows, inter)
    }

    /// Padded layout: expert `x` owns rows `x·cap..(x+1)·cap`; one strided-batched GEMM
    /// `C[x] = A[x] · W[x]ᵀ` over all experts (rows past an expert's count are ignored later).
    #[allow(clippy::too_many_arguments)]
    fn padded_gemm(
        &self,
        w: &CudaSlice<u16>,
        n: usize,
        kdim: usize,
        a: u64,
        c: u64,
        experts: usize,
        cap: usize,
    ) -> Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: per batch entry x, column-major C_x [n, cap] = W_x [kdim, n]ᵀ · A_x [kdim, cap],
        // strides in elements; the buffers hold `experts` such matrices.
        let st = unsafe {
            cb::cublasGemmStridedBatchedEx(
                *self.blas.handle(),
                cb::cublasOperation_t::CUBLAS_OP_T,
                cb::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                cap as i32,
                kdim as i32,
                &alpha as *const f32 as *const _,
                dptr(w, &self.gpu) as *const _,
                cb::cudaDataType_t::CUDA_R_16BF,
                kdim as i32,
                (n * kdim) as i64,
                a as *const _,
                cb::cudaDataType_t::CUDA_R_16BF,
                kdim as i32,
                (cap * kdim) as i64,
                &beta as *const f32 as *const _,
                c as *mut _,
                cb::cudaDataType_t::CUDA_R_16BF,
                n as i32,
                (cap * n) as i64,
                experts as i32,
                cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        check(st, "padded batched GEMM")
    }
}

/// `C[rows, n] = A[rows, kdim] · W[n, kdim]ᵀ` on `blas`'s stream, bf16 in and out, f32
/// accumulation; `w`, `a`, `c` are device addresses.
pub(super) fn gemm_bf16(blas: &CudaBlas, w: u64, n: usize, kdim: usize, a: u64, c: u64, rows_: usize) -> Result<()> {
    let (alpha, beta) = (1.0f32, 0.0f32);
    // SAFETY: column-major C [n, rows] = W [kdim, n]ᵀ · A [kdim, rows]; the caller passes
    // addresses of buffers holding at least those many bf16 values.
    let st = unsafe {
        cb::cublasGemmEx(
            *blas.handle(),
            cb::cublasOperation_t::CUBLAS_OP_T,
            cb::cublasOperation_t::CUBLAS_OP_N,
            n as i32,
            rows_ as i32,
            kdim as i32,
            &alpha as *const f32 as *const _,
            w as *const _,
            cb::cudaDataType_t::CUDA_R_16BF,
            kdim as i32,
            a as *const _,
            cb::cudaDataType_t::CUDA_R_16BF,
            kdim as i32,
            &beta as *const f32 as *const _,
            c as *mut _,
            cb::cudaDataType_t::CUDA_R_16BF,
            n as i32,
            cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    };
    check(st, "bf16 GEMM")
}

/// Launches the act-and-mul kernel on `stream`: `out [rows, inter] = act(gate + b13) · (up +
/// b13)` from `h13 [rows, 2 inter]`, the bias row chosen by `expert_of_row` (or `row / cap` when
/// `cap > 0`, skipping rows past `counts[row / cap]` when `counts` is given); `ptrs` = [h13,
/// b13, expert_of_row, counts, out], 0 meaning no bias / no map / no counts.
pub(super) fn act_and_mul(
    stream: &cudarc::driver::CudaStream,
    kernel: &CudaFunction,
    activation: Activation,
    ptrs: [u64; 5],
    cap: i32,
    rows: usize,
    inter: usize,
) -> Result<()> {
    let [h13, b13, expert_of_row, counts, out] = ptrs;
    let (kind, alpha, limit) = act_params(activation);
    let (rows_l, inter_i) = (rows as i64, inter as i32);
    // SAFETY: act_and_mul(bf16*, float*, int*, int, int*, long, int, int, float, float, bf16*)
    // over `rows` rows of buffers the caller sized for them.
    unsafe {
        stream
            .launch_builder(kernel)
            .arg(&h13)
            .arg(&b13)
            .arg(&expert_of_row)
            .arg(&cap)
            .arg(&counts)
            .arg(&rows_l)
            .arg(&inter_i)
            .arg(&kind)
            .arg(&alpha)
            .arg(&limit)
            .arg(&out)
            .launch(LaunchConfig {
                grid_dim: (rows.clamp(1, 1 << 20) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
    }
    .map(|_| ())
    .map_err(|e| err("act_and_mul", e))
}

/// How the expert GEMMs run (`MOEFLOW_EXPERT_GEMM`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GemmMode {
    /// The Hopper grouped GEMM where it runs (compute capability 9.0) and is the faster
    /// choice (`CudaMoeLayer::hopper_for`), else `Cublas`.
    Auto,
    /// cuBLAS: padded up to 192 rows per expert on average, per-expert GEMMs above (measured
    /// on H200, DeepSeek-V3 shapes: padded is faster up to 128 rows per expert, per-expert
    /// from 256).
    Cublas,
    /// Every expert padded to the largest; one strided-batched GEMM.
    Padded,
    /// One GEMM per expert over the side streams.
    Loop,
    /// One `cublasGemmGroupedBatchedEx` call.
    Grouped,
    /// moeflow's wgmma grouped GEMM (`hopper_gemm`) at every size, where it runs.
    Hopper,
}

impl GemmMode {
    /// Whether the Hopper grouped GEMM may run.
    fn allows_hopper(self) -> bool {
        matches!(self, GemmMode::Auto | GemmMode::Hopper)
    }
}

fn gemm_mode() -> GemmMode {
    match std::env::var("MOEFLOW_EXPERT_GEMM").as_deref() {
        Ok("cublas") => GemmMode::Cublas,
        Ok("padded") => GemmMode::Padded,
        Ok("loop") => GemmMode::Loop,
        Ok("grouped") => GemmMode::Grouped,
        Ok("hopper") => GemmMode::Hopper,
        _ => GemmMode::Auto,
    }
}

fn check(st: cb::cublasStatus_t, what: &str) -> Result<()> {
    if st == cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(err(what, st))
    }
}

/// The raw device address of `s` (event tracking is off, so the guard has nothing to do).
fn dptr<T>(s: &CudaSlice<T>, g: &Gpu) -> u64 {
    let (p, _guard) = s.device_ptr(&g.stream);
    p
}

fn act_params(a: Activation) -> (i32, f32, f32) {
    match a {
        Activation::Silu => (0, 0.0, 0.0),
        Activation::GeluErf => (1, 0.0, 0.0),
        Activation::GeluTanh => (2, 0.0, 0.0),
        Activation::SwigluOai { alpha, limit } => (3, alpha, limit),
    }
}
