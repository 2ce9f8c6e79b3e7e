//! The whole MoE layer resident on GPUs: router in f32, rows permuted by expert on the device
//! (counts and offsets computed there, rows in slot order so runs repeat exactly), bf16 expert
//! GEMMs with f32 accumulation (moeflow's grouped wgmma GEMM on Hopper, cuBLAS elsewhere),
//! activation, and a weighted combine in slot order. On one GPU, or as one rank of an
//! expert-parallel group ([`CudaMoeLayer::new_ep`]) whose tokens travel to the ranks holding
//! their experts on the device, written into the peers' memory ([`nvlink`]) or over NCCL;
//! [`low_latency`] holds its fixed-capacity form, captured in a CUDA graph, and
//! [`fp8_weights`] its fp8 experts.
//!
//! This file builds the layer and runs it as the modular kernel does on the CPU: [`route`]
//! (router GEMM and top-k; small batches in one launch), then a prepare/finalize strategy
//! ([`strategy`]: one GPU's permute, all-to-all-v, the gathering forms, low-latency, and TP
//! slicing around any of them) around the experts ([`experts`]: the Hopper, masked and cuBLAS
//! GEMMs behind one contract), with the shared experts ([`expert_gemm`]) beside them.
//! [`permute`], [`combine`] and [`expert_parallel`] hold the kernels and exchanges the
//! strategies share; [`buffers`] the scratch memory of a run.

use super::blas_handle::BlasHandle;
use super::{err, CudaOptions, ExpertGemm, Gpu};
pub use crate::backend::GpuStageTimes;
use crate::config::{MoeConfig, MoeWeights};
use crate::error::{MoeError, Result};
use crate::placement::ExpertPlacement;
use crate::router::RouterConfig;
use crate::tensor::Tensor;
use cudarc::cublas::sys as cb;
use cudarc::driver::{sys as drv, CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use std::sync::Mutex;

mod buffers;
mod combine;
mod device_calls;
mod dual_batch;
mod expert_gemm;
mod expert_parallel;
mod experts;
mod fp8_weights;
#[cfg(test)]
mod fused_route_tests;
mod graph;
mod hopper_fp8_gemm;
mod hopper_gemm;
mod host_ints;
mod load_recording;
mod low_latency;
mod masked_gemm;
mod nvlink;
mod permute;
mod placement;
mod rebalance;
mod route;
mod router_skew;
mod router_tf32;
mod side_streams;
mod strategy;
#[cfg(test)]
mod top_k_tests;

use buffers::Buffers;
pub use dual_batch::CudaDualBatch;
use expert_gemm::act_params;
pub(super) use expert_gemm::{act_and_mul, gemm_bf16};
use expert_parallel::{EpBuffers, EpLink};
pub(super) use nvlink::{lane_record, NvlWait};
use side_streams::SideStreams;
use strategy::SharedStart;

struct Kernels {
    to_bf16: CudaFunction,
    widen_bf16: CudaFunction,
    take_f32: CudaFunction,
    take_bf16: CudaFunction,
    hand_out: CudaFunction,
    add_bias: CudaFunction,
    route: CudaFunction,
    route_wide: CudaFunction,
    route_small: CudaFunction,
    write_ints: CudaFunction,
    count: CudaFunction,
    scatter: CudaFunction,
    gather: CudaFunction,
    gather_fp8: CudaFunction,
    take: CudaFunction,
    act: CudaFunction,
    combine: CudaFunction,
    combine_partial: CudaFunction,
    router_partials: CudaFunction,
    router_partials_wide: CudaFunction,
    router_sum: CudaFunction,
    router_live: CudaFunction,
    router_tf32: router_tf32::RouterForms,
    /// The tensor-core router on wgmma, on Hopper only.
    router_tf32_sm90: Option<router_tf32::RouterForms>,
    compact_served: CudaFunction,
    sum_partials: CudaFunction,
    sum_partials_live: CudaFunction,
    localize: CudaFunction,
    localize_placed: CudaFunction,
    replica_shares: CudaFunction,
    add_shared: CudaFunction,
    fill_bf16: CudaFunction,
    fill_f32: CudaFunction,
    stamp_clock: CudaFunction,
    ll_pack: CudaFunction,
    ll_arrange: CudaFunction,
    ll_send: CudaFunction,
    ll_combine: CudaFunction,
    ll_combine_push: CudaFunction,
    nvl_push: CudaFunction,
    nvl_combine_push: CudaFunction,
    nvl_slot_addresses: CudaFunction,
    nvl_plan_slots: CudaFunction,
    nvl_plan: CudaFunction,
    nvl_landed_ids: CudaFunction,
    masked_gemm: CudaFunction,
    masked_gemm_fp8: CudaFunction,
    masked_gemm_w8a8: CudaFunction,
    quantize_fp8: CudaFunction,
    quantize_bf16: CudaFunction,
    /// The wgmma grouped GEMM, on Hopper GPUs.
    hopper: Option<hopper_gemm::HopperGemm>,
    /// Its fp8 form (W8A8 experts), on Hopper GPUs.
    hopper_fp8: Option<hopper_fp8_gemm::HopperFp8Gemm>,
    /// Deterministic mode: a second instance (its own tile counter) for the shared expert, which
    /// runs on a side stream beside the routed experts' GEMMs.
    hopper_shared: Option<hopper_gemm::HopperGemm>,
    /// A second instance of the fp8 one for an fp8 shared expert (see
    /// [`CudaMoeLayer::fp8_shared_expert`]), on its side stream.
    hopper_fp8_shared: Option<hopper_fp8_gemm::HopperFp8Gemm>,
}

struct SharedMlp {
    inter: usize,
    w13: CudaSlice<u16>,
    w2: CudaSlice<u16>,
    gate: Option<CudaSlice<f32>>,
    /// Its fp8 codes, when asked for (see [`CudaMoeLayer::fp8_shared_expert`]).
    fp8: Option<fp8_weights::Fp8Experts>,
}

struct DeviceWeights {
    gate: CudaSlice<f32>,
    /// Whether every gate value is a TF32 value (bf16 ones are), which the tensor-core router
    /// multiplies in two products instead of three.
    gate_is_tf32: bool,
    gate_bias: Option<CudaSlice<f32>>,
    correction_bias: Option<CudaSlice<f32>>,
    w13: CudaSlice<u16>,
    w2: CudaSlice<u16>,
    b13: Option<CudaSlice<f32>>,
    b2: Option<CudaSlice<f32>>,
    /// Every expert's down-projection bias, at home on a deterministic expert-parallel rank
    /// (which adds it in the combine, as one GPU does).
    b2_all: Option<CudaSlice<f32>>,
    shared: Option<SharedMlp>,
    /// The routed experts as fp8 codes too (see [`fp8_weights`]).
    fp8: Option<fp8_weights::Fp8Experts>,
}

/// Called with (stage boundary 0..=9, the layer's stream) as a run is enqueued; boundary 3
/// comes right before the expert GEMMs, 6 right after them.
type StageHook<'a> = dyn Fn(usize, &cudarc::driver::CudaStream) -> Result<()> + Sync + 'a;

/// The hook that does nothing.
fn no_hook(_stage: usize, _stream: &cudarc::driver::CudaStream) -> Result<()> {
    Ok(())
}

/// What one run of the layer did: bytes dispatched to other ranks, the strategy and the
/// experts' implementation.
struct Ran {
    sent: strategy::Sent,
    strategy: &'static str,
    experts: &'static str,
}

/// How a timed run goes where the layer replays graphs: the graph, timed whole; its capture
/// with clock stamps between the stages (low-latency layers); or the stages run directly.
#[derive(Clone, Copy)]
enum Replay {
    Graph,
    Stamped,
    Direct,
}

/// The first and last events of a timed run.
struct Span {
    first: cudarc::driver::CudaEvent,
    last: cudarc::driver::CudaEvent,
}

/// One MoE layer resident on a GPU.
pub struct CudaMoeLayer {
    gpu: Gpu,
    /// Side streams, each with its own cuBLAS handle.
    side: SideStreams,
    /// Whether the masked GEMM takes this layer's shapes (see [`masked_gemm::masked_gemm_fits`]).
    masked: bool,
    /// How the layer runs (kernel choices, graphs, deterministic mode).
    opts: CudaOptions,
    /// Whether the masked GEMMs quantize their rows to fp8 (see `fp8_activations`).
    w8a8: bool,
    /// Their rows' fp8 codes and scales.
    fp8_rows: Mutex<masked_gemm::Fp8RowBuffers>,
    blas: BlasHandle,
    config: MoeConfig,
    k: Kernels,
    /// The weights (shared by the two halves of a dual-batch layer).
    w: std::sync::Arc<DeviceWeights>,
    bufs: Mutex<Option<Buffers>>,
    /// Set when the layer is one rank of an expert-parallel group.
    ep: Option<EpLink>,
    /// The GPU's SMs (grids sized to fill it).
    sms: usize,
    /// How tokens reach the experts and their outputs come home.
    strategy: std::sync::Arc<dyn strategy::DevicePrepareFinalize>,
    /// `--strategy auto`: the table that picks the strategy per batch instead.
    auto: Option<std::sync::Arc<crate::auto_strategy::AutoStrategy>>,
    /// Return outputs holding NaN or infinity instead of an error (see `finite`).
    allow_nonfinite: bool,
    /// Tokens per logical expert of the last calls, counted on the device (`load_stats.rs`).
    pub(in crate::backend::cuda) load: super::load_stats::DeviceLoadStats,
    /// Set during the direct run before a graph's capture (see [`CudaMoeLayer::warm_up`]).
    warming_up: std::sync::atomic::AtomicBool,
    /// Calls on device memory that do not wait: their non-finite records (see [`device_calls`]).
    calls: Mutex<Option<device_calls::DeviceCalls>>,
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

impl CudaMoeLayer {
    fn open(config: &MoeConfig, device: usize, opts: &CudaOptions) -> Result<(Gpu, BlasHandle, Kernels)> {
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
        let gpu = Gpu::with_nvrtc_options(device, &opts.nvrtc_options)?;
        gpu.ctx.bind_to_thread().map_err(|e| err("binding context", e))?;
        let blas = BlasHandle::new(gpu.stream.clone())?;
        let f = |n: &str| gpu.function(n);
        let k = Kernels {
            to_bf16: f("f32_to_bf16_kernel")?,
            widen_bf16: f("bf16_to_f32_kernel")?,
            take_f32: f("clear_nonfinite_f32")?,
            take_bf16: f("clear_nonfinite_bf16")?,
            hand_out: f("copy_counting_nonfinite")?,
            add_bias: f("add_row_bias")?,
            route: f("route")?,
            route_wide: f("route_wide")?,
            route_small: f("route_small")?,
            write_ints: f("write_ints")?,
            count: f("count_chunks")?,
            scatter: f("scatter_chunks")?,
            gather: f("gather_rows")?,
            gather_fp8: f("gather_fp8_rows")?,
            take: f("take_rows")?,
            act: f("act_and_mul")?,
            combine: f("combine")?,
            combine_partial: f("combine_partial")?,
            router_partials: f("router_partials_fixed")?,
            router_partials_wide: f("router_partials_fixed_wide")?,
            router_sum: f("router_sum_fixed")?,
            router_live: f("router_live_partials")?,
            router_tf32: router_tf32::RouterForms::load_mma_sync(&gpu)?,
            router_tf32_sm90: router_tf32::RouterForms::load_sm90(&gpu)?,
            compact_served: f("compact_served")?,
            sum_partials: f("sum_partials")?,
            sum_partials_live: f("sum_partials_live")?,
            localize: f("localize_ids")?,
            localize_placed: f("localize_placed")?,
            replica_shares: f("replica_shares")?,
            add_shared: f("add_shared")?,
            fill_bf16: f("fill_uniform_bf16")?,
            fill_f32: f("fill_uniform_f32")?,
            stamp_clock: f("stamp_clock")?,
            ll_pack: f("ll_pack")?,
            ll_arrange: f("ll_arrange")?,
            ll_send: f("ll_send")?,
            ll_combine: f("ll_combine")?,
            ll_combine_push: f("ll_combine_push")?,
            nvl_push: f("nvl_push")?,
            nvl_combine_push: f("nvl_combine_push")?,
            nvl_slot_addresses: f("nvl_slot_addresses")?,
            nvl_plan_slots: f("nvl_plan_slots")?,
            nvl_plan: f("nvl_plan")?,
            nvl_landed_ids: f("nvl_landed_ids")?,
            masked_gemm: f("masked_gemm")?,
            masked_gemm_fp8: f("masked_gemm_fp8")?,
            masked_gemm_w8a8: f("masked_gemm_w8a8")?,
            quantize_fp8: f("quantize_weight_blocks_fp8")?,
            quantize_bf16: f("quantize_rows_bf16")?,
            hopper: hopper_gemm::HopperGemm::load(&gpu, opts)?,
            hopper_fp8: hopper_fp8_gemm::HopperFp8Gemm::load(&gpu, opts)?,
            hopper_shared: match opts.deterministic {
                true => hopper_gemm::HopperGemm::load(&gpu, opts)?,
                false => None,
            },
            hopper_fp8_shared: None,
        };
        masked_gemm::allow_masked_gemm_smem(&k.masked_gemm)?;
        masked_gemm::allow_masked_gemm_smem(&k.masked_gemm_fp8)?;
        masked_gemm::allow_masked_gemm_smem(&k.masked_gemm_w8a8)?;
        Ok((gpu, blas, k))
    }

    /// A layer over `w` on the opened GPU, with its side streams, empty buffers and bf16 rows.
    fn assemble(
        config: &MoeConfig,
        (gpu, blas, mut k): (Gpu, BlasHandle, Kernels),
        w: std::sync::Arc<DeviceWeights>,
        mut ep: Option<EpLink>,
        opts: &CudaOptions,
    ) -> Result<Self> {
        // An fp8 shared expert (the twin of a dual-batch layer) runs on its own fp8 GEMM.
        if w.shared.as_ref().is_some_and(|sh| sh.fp8.is_some()) && !opts.deterministic {
            k.hopper_fp8_shared = Self::shared_fp8_gemm_for(&gpu, opts, ep.is_some())?;
        }
        if let Some(link) = ep.as_mut() {
            link.tables = Some(placement::PlacementTables::upload(&link.placement, &gpu)?);
            link.transport = Mutex::new(nvlink::LinkTransport::Pending(opts.transport));
        }
        let opts = &Self::effective_options(config, &k, opts)?;
        let sms = gpu
            .ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| err("SM count", e))?
            .max(1) as usize;
        Ok(CudaMoeLayer {
            sms,
            side: SideStreams::new(&gpu, opts)?,
            load: super::load_stats::DeviceLoadStats::new(&gpu, config.num_experts)?,
            warming_up: std::sync::atomic::AtomicBool::new(false),
            calls: Mutex::new(None),
            gpu,
            masked: masked_gemm::masked_gemm_fits(config, opts.low_latency_gemm),
            opts: opts.clone(),
            w8a8: false,
            fp8_rows: Mutex::new(Default::default()),
            blas,
            config: config.clone(),
            k,
            w,
            bufs: Mutex::new(None),
            auto: None,
            strategy: match ep {
                Some(_) => std::sync::Arc::new(strategy::All2AllV),
                None => std::sync::Arc::new(strategy::Local),
            },
            ep,
            allow_nonfinite: false,
        })
    }

    /// `opts` as this layer runs them: deterministic mode takes the Hopper GEMM in 128 × 256
    /// tiles for every batch and routes without the fused router (whose sums differ from the
    /// fixed-order router GEMM's); an error where that cannot run.
    fn effective_options(config: &MoeConfig, k: &Kernels, opts: &CudaOptions) -> Result<CudaOptions> {
        if !opts.deterministic {
            return Ok(opts.clone());
        }
        let (h, i) = (config.hidden, config.inter);
        let si = config.shared.map_or(8, |s| s.inter);
        if k.hopper.is_none() {
            return Err(MoeError::Unsupported(
                "deterministic mode runs the Hopper grouped GEMM, which needs a GPU of compute capability 9.0".into(),
            ));
        }
        if ![h, i, si].iter().all(|x| x.is_multiple_of(8)) {
            return Err(MoeError::Unsupported(format!(
                "deterministic mode needs hidden and intermediate sizes divisible by 8 (got {h}, {i} and shared {si})"
            )));
        }
        Ok(CudaOptions {
            expert_gemm: ExpertGemm::Hopper,
            gemm_tile_rows: Some(128),
            gemm_tile_cols: Some(256),
            fused_route: false,
            ..opts.clone()
        })
    }

    /// Uploads `weights` (expert weights as bf16, router in f32) to GPU 0.
    pub fn new(config: &MoeConfig, weights: &MoeWeights, opts: &CudaOptions) -> Result<Self> {
        Self::new_on(config, weights, 0, None, opts)
    }

    /// [`CudaMoeLayer::new`] on GPU `device`.
    pub fn new_on_device(config: &MoeConfig, weights: &MoeWeights, device: usize, opts: &CudaOptions) -> Result<Self> {
        Self::new_on(config, weights, device, None, opts)
    }

    /// One rank of an expert-parallel layer over `comm` (all-to-all-v of bf16 rows on the
    /// device): this rank keeps the experts `placement` gives it (replicas included) on its
    /// communicator's GPU. Collective: every rank of `comm` builds its layer together.
    pub fn new_ep(
        config: &MoeConfig,
        weights: &MoeWeights,
        comm: super::NcclComm,
        placement: std::sync::Arc<ExpertPlacement>,
        opts: &CudaOptions,
    ) -> Result<Self> {
        let link = Self::link(config, comm, placement)?;
        Self::new_on(config, weights, link.comm.device(), Some(link), opts)
    }

    fn new_on(
        config: &MoeConfig,
        weights: &MoeWeights,
        device: usize,
        ep: Option<EpLink>,
        opts: &CudaOptions,
    ) -> Result<Self> {
        weights.validate(config)?;
        let (gpu, blas, k) = Self::open(config, device, opts)?;
        let s = &gpu.stream;
        let experts = match &ep {
            Some(l) => {
                use crate::comm::Communicator;
                weights.experts.select(l.placement.local_experts(l.comm.rank()))?
            }
            None => weights.experts.clone(),
        };
        let held = experts.w13.elem_count() as u128 + experts.w2.elem_count() as u128;
        super::finite::ensure_device_memory(&gpu, "expert weights (bf16)", 2 * held)?;
        let up_f32 = |t: &Tensor| s.clone_htod(&t.to_f32_vec()).map_err(|e| err("upload", e));
        let up_bf16 = |t: &Tensor| s.clone_htod(&bf16_bits(t)).map_err(|e| err("upload", e));
        let gate = weights.gate.to_f32_vec();
        let w = DeviceWeights {
            gate: s.clone_htod(&gate).map_err(|e| err("upload", e))?,
            gate_is_tf32: router_tf32::is_tf32(&gate),
            gate_bias: weights.gate_bias.as_ref().map(up_f32).transpose()?,
            correction_bias: weights.correction_bias.as_ref().map(up_f32).transpose()?,
            // Quantized experts run on the GPU as bf16 of their dequantized values (fp8 ones
            // also as their codes, which the low-latency layer streams).
            w13: up_bf16(&Tensor::from_f32(experts.w13.shape(), experts.w13_f32())?)?,
            w2: up_bf16(&Tensor::from_f32(experts.w2.shape(), experts.w2_f32())?)?,
            b13: experts.b13.as_ref().map(up_f32).transpose()?,
            b2: experts.b2.as_ref().map(up_f32).transpose()?,
            b2_all: match (&ep, &weights.experts.b2) {
                (Some(_), Some(b2)) if opts.deterministic => Some(up_f32(b2)?),
                _ => None,
            },
            // A shared expert stored quantized (a DeepSeek fp8 checkpoint kept as stored) runs
            // as bf16 of its dequantized values, as the routed experts do.
            shared: match (&weights.shared, config.shared) {
                (Some(sw), Some(sc)) => Some(SharedMlp {
                    inter: sc.inter,
                    w13: up_bf16(&Tensor::from_f32(sw.mlp.w13.shape(), sw.mlp.w13_f32())?)?,
                    w2: up_bf16(&Tensor::from_f32(sw.mlp.w2.shape(), sw.mlp.w2_f32())?)?,
                    gate: sw.gate.as_ref().map(up_f32).transpose()?,
                    fp8: None,
                }),
                _ => None,
            },
            fp8: fp8_weights::Fp8Experts::upload(&experts, s)?,
        };
        Self::assemble(config, (gpu, blas, k), std::sync::Arc::new(w), ep, opts)
    }

    /// A layer whose weights are generated on the device (uniform, seeded), for benchmarks of
    /// shapes too large to build on the host.
    pub fn random(config: &MoeConfig, seed: u64, opts: &CudaOptions) -> Result<Self> {
        Self::random_on(config, seed, 0, None, opts)
    }

    /// [`CudaMoeLayer::random`] on GPU `device`.
    pub fn random_on_device(config: &MoeConfig, seed: u64, device: usize, opts: &CudaOptions) -> Result<Self> {
        Self::random_on(config, seed, device, None, opts)
    }

    /// [`CudaMoeLayer::new_ep`] with weights generated on the device (each rank its own
    /// experts), for benchmarks.
    pub fn random_ep(
        config: &MoeConfig,
        seed: u64,
        comm: super::NcclComm,
        placement: std::sync::Arc<ExpertPlacement>,
        opts: &CudaOptions,
    ) -> Result<Self> {
        let link = Self::link(config, comm, placement)?;
        Self::random_on(config, seed, link.comm.device(), Some(link), opts)
    }

    fn random_on(config: &MoeConfig, seed: u64, device: usize, ep: Option<EpLink>, opts: &CudaOptions) -> Result<Self> {
        let (gpu, blas, k) = Self::open(config, device, opts)?;
        let (e, h, i) = (config.num_experts, config.hidden, config.inter);
        // Routed experts held here (all of them on one GPU).
        let held = ep.as_ref().map_or(e, |l| l.local);
        // One router for every rank, as a model has; each rank's experts its own.
        let router_seed = seed;
        let seed = seed ^ ep.as_ref().map_or(0, |l| (l.phys_first as u64) << 20);
        let biases = matches!(config.router, RouterConfig::TopKSoftmax);
        let sh = 1.0 / (h as f32).sqrt();
        let mut n = 0u64;
        let mut f32s = |len: usize, scale: f32, seed: u64| -> Result<CudaSlice<f32>> {
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
        // Rounded to bf16 values, as checkpoints store their routers (DeepSeek-V3's among them).
        let gate: Vec<f32> =
            (gpu.stream.clone_dtoh(&f32s(e * h, 3.0 * sh, router_seed)?).map_err(|e| err("download", e))?)
                .into_iter()
                .map(|v| half::bf16::from_f32(v).to_f32())
                .collect();
        let gate_is_tf32 = router_tf32::is_tf32(&gate);
        let gate = gpu.stream.clone_htod(&gate).map_err(|e| err("upload", e))?;
        let gate_bias = if biases { Some(f32s(e, 0.5, router_seed)?) } else { None };
        // DeepSeek-V3's correction bias is trained to even the experts' loads; under a random
        // gate every expert is alike in expectation, so the bias that evens them is zero. A
        // random one would not be: ±0.05 beside sigmoid scores spread by about 0.2 made the
        // experts' rows 256 ± 127 at 4096 tokens on EP 2 (docs/tuning.md). `--skew` skews on
        // purpose.
        let correction_bias = if matches!(config.router, RouterConfig::SigmoidGrouped { .. }) {
            Some(gpu.stream.alloc_zeros::<f32>(e).map_err(|e| err("alloc", e))?)
        } else {
            None
        };
        let b13 = if biases { Some(f32s(held * 2 * i, 0.1, seed)?) } else { None };
        let b2 = if biases { Some(f32s(held * h, 0.1, seed)?) } else { None };
        let b2_all = if biases && ep.is_some() && opts.deterministic { Some(f32s(e * h, 0.1, seed)?) } else { None };
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
                fp8: None,
            }),
            None => None,
        };
        let w = DeviceWeights {
            gate,
            gate_is_tf32,
            gate_bias,
            correction_bias,
            w13,
            w2,
            b13,
            b2,
            b2_all,
            shared,
            fp8: None,
        };
        Self::assemble(config, (gpu, blas, k), std::sync::Arc::new(w), ep, opts)
    }

    /// Whether forwards return outputs holding NaN or infinity (`true`) or refuse them with
    /// an error naming the count and the first position (`false`, the default; counted on the
    /// device).
    pub fn allow_nonfinite(mut self, allow: bool) -> Self {
        self.allow_nonfinite = allow;
        self
    }

    /// The layer's configuration.
    pub fn config(&self) -> &MoeConfig {
        &self.config
    }

    /// The options it was built with.
    pub fn options(&self) -> &CudaOptions {
        &self.opts
    }

    /// Whether W8A8 experts can multiply on the fp8 tensor cores here (the fp8 Hopper GEMM: a
    /// Hopper GPU, options that allow it).
    pub fn has_fp8_gemm(&self) -> bool {
        self.k.hopper_fp8.is_some()
    }

    /// The device's name.
    pub fn device_name(&self) -> String {
        self.gpu.ctx.name().unwrap_or_else(|_| "unknown GPU".into())
    }

    /// `hidden_states [T, H]` → `[T, H]` f32 (copies in and out included). A small batch on
    /// one GPU replays the layer's CUDA graph for its size (captured at its first call; see
    /// the `graph` module).
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
        let (t, h) = (s[0], self.config.hidden);
        // This rank's rows of the batch (a TP share, or all of them).
        let (a, z) = self.strategy.token_window(t);
        let capacity = self.capacity();
        self.check_capacity(self.strategy.largest_window(t))?;
        let mut guard = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
        let b = self.batch_buffers(&mut guard, t)?;
        self.gpu
            .stream
            .memcpy_htod(&x[a * h..z * h], &mut b.x.slice_mut(0..(z - a) * h))
            .map_err(|e| err("copy in", e))?;
        match capacity {
            Some(_) => self.ll_run(b, z - a, false)?,
            None if graph && self.takes_graph(z - a) => self.graph_run(b, z - a, false)?,
            None => self.run_marks(b, z - a, false, hook)?.0,
        };
        if !self.allow_nonfinite {
            super::finite::check_output(&self.gpu, &b.out.slice(0..t * self.config.hidden), self.config.hidden)?;
        }
        let mut out = vec![0f32; t * self.config.hidden];
        self.gpu
            .stream
            .memcpy_dtoh(&b.out.slice(0..t * self.config.hidden), &mut out)
            .map_err(|e| err("copy out", e))?;
        Tensor::from_f32(&[t, self.config.hidden], out)
    }

    /// `out [t, H]` = the layer on `x [t, H]`, both f32 in this layer's GPU memory (device
    /// addresses), ordered on the caller's `stream` (a raw `CUstream`, such as PyTorch's current
    /// stream; 0 for the default stream): the layer starts after the work already enqueued
    /// there, and work enqueued there afterwards starts after the output is written. Nothing
    /// goes through host memory.
    ///
    /// On one GPU, where the batch's whole run stays on the device (expert GEMMs that read the
    /// expert sizes there: see `layer/device_calls.rs`), the host returns without waiting and a
    /// CUDA graph capturing `stream` takes the layer in (after one call of that batch size
    /// outside the capture; meanwhile no other thread may create a layer, whose cuBLAS handles
    /// invalidate a capture, or make other calls that CUDA forbids beside one);
    /// non-finite inputs and outputs are reported by a later call or
    /// [`CudaMoeLayer::synchronize_device`]. Elsewhere the host returns once the layer's run
    /// has completed, as [`CudaMoeLayer::forward`] does (an error for non-finite inputs before
    /// the run, for a non-finite output after `out` is written), and a capture is refused with
    /// an error saying what reads the host.
    ///
    /// A TP-sliced layer ([`CudaMoeLayer::tp_slice`]) copies in only its share's rows of `x`
    /// and writes every row of `out`.
    pub fn forward_device(&self, x: u64, out: u64, t: usize, stream: u64) -> Result<()> {
        self.forward_device_as(x, out, t, stream, false)
    }

    /// [`CudaMoeLayer::forward_device`] on bf16 hidden states: `x [t, H]` and `out [t, H]` bf16,
    /// as inference engines hold them. The layer computes as for the same values in f32 (a bf16
    /// value is an f32 value), so `out` is the f32 call's output rounded to the nearest bf16;
    /// on Hopper the router reads the bf16 rows as they are ([`CudaMoeLayer::routes_bf16_tokens`]).
    pub fn forward_device_bf16(&self, x: u64, out: u64, t: usize, stream: u64) -> Result<()> {
        self.forward_device_as(x, out, t, stream, true)
    }

    /// [`CudaMoeLayer::forward_device`] on f32 hidden states, or with `bf16` on bf16 ones.
    fn forward_device_as(&self, x: u64, out: u64, t: usize, stream: u64, bf16: bool) -> Result<()> {
        let h = self.config.hidden;
        let (a, z) = self.strategy.token_window(t);
        let capacity = self.capacity();
        self.check_capacity(self.strategy.largest_window(t))?;
        let g = &self.gpu;
        g.ctx.bind_to_thread().map_err(|e| err("binding context", e))?;
        let capture = self.caller_capturing(stream)?;
        match (self.host_read(t), capture) {
            (None, _) => return self.forward_device_enqueued(x, out, t, stream, capture, bf16),
            (Some(why), true) => {
                return Err(MoeError::Unsupported(format!(
                    "capturing this layer into a CUDA graph: {why}, so it waits for the GPU; call it outside the \
                     capture"
                )))
            }
            (Some(_), false) => {}
        }
        let s = &g.stream;
        let caller = stream as drv::CUstream;
        let ready = g.ctx.new_event(None).map_err(|e| err("event", e))?;
        // SAFETY: records an event of this context on the caller's stream (same device).
        let r = unsafe { drv::cuEventRecord(ready.cu_event(), caller) };
        if r != drv::cudaError_enum::CUDA_SUCCESS {
            return Err(err("waiting for the caller's stream", r));
        }
        s.wait(&ready).map_err(|e| err("waiting for the caller's stream", e))?;
        let mut guard = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
        let b = self.batch_buffers(&mut guard, t)?;
        let rows = z - a;
        // A direct run's router reads bf16 tokens as they are (a graph's reads the f32 rows).
        let bf16_rows = bf16 && !self.takes_graph(rows) && self.routes_bf16_tokens(rows);
        if rows > 0 {
            let found = super::finite::fresh_count(g)?;
            let at = x + (a * h * if bf16 { 2 } else { 4 }) as u64;
            self.take_tokens(b, at, rows, bf16, !bf16_rows, dptr(&found, g))?;
            super::finite::check_input_count(g, &found, at, bf16, "hidden_states")?;
        }
        b.tokens_bf16 = bf16_rows;
        b.out_bf16 = bf16;
        match capacity {
            Some(_) => self.ll_run(b, rows, false)?,
            None if self.takes_graph(rows) => self.graph_run(b, rows, false)?,
            None => self.run_marks(b, rows, false, &no_hook)?.0,
        };
        let found = if self.allow_nonfinite { None } else { Some(super::finite::fresh_count(g)?) };
        self.copy_output(b, out, t, bf16, found.as_ref().map_or(0, |f| dptr(f, g)))?;
        if let Some(found) = &found {
            super::finite::check_output_count(g, found, &b.out.slice(0..t * h), h)?;
        }
        let done = s.record_event(None).map_err(|e| err("event", e))?;
        // SAFETY: the caller's stream waits for an event of this context (same device).
        let r = unsafe { drv::cuStreamWaitEvent(caller, done.cu_event(), 0) };
        if r != drv::cudaError_enum::CUDA_SUCCESS {
            return Err(err("ordering the caller's stream", r));
        }
        Ok(())
    }

    /// Takes `rows` tokens' hidden states in from device address `x` (f32, or bf16 with `bf16`),
    /// on the layer's stream: f32 ones into `b.x`; bf16 ones into `b.x_bf` as they are and, with
    /// `widen`, into `b.x` as f32 too (for every router but the one that reads bf16 rows, see
    /// [`CudaMoeLayer::routes_bf16_tokens`]). Each NaN or infinity is taken as 0 and counted into
    /// the `{count, first index}` at `count` (see `finite.rs`).
    fn take_tokens(&self, b: &Buffers, x: u64, rows: usize, bf16: bool, widen: bool, count: u64) -> Result<()> {
        let (g, n) = (&self.gpu, rows * self.config.hidden);
        let (xp, xbp, len) = (dptr(&b.x, g), dptr(&b.x_bf, g), n as i64);
        let s = &g.stream;
        let cfg = super::finite::warps_over(n);
        // SAFETY: clear_nonfinite_bf16(bf16*, bf16*, float*, long long, unsigned long long*)
        // reads n bf16 values at `x` and clear_nonfinite_f32(float*, float*, long long, unsigned
        // long long*) n floats (the caller's promise); they write n values into `b.x_bf` and,
        // unless null, `b.x` (or into `b.x`), which hold `rows` rows, and update the two u64 at
        // `count`.
        unsafe {
            match bf16 {
                true => {
                    let xp = if widen { xp } else { 0u64 };
                    s.launch_builder(&self.k.take_bf16).arg(&x).arg(&xbp).arg(&xp).arg(&len).arg(&count).launch(cfg)
                }
                false => s.launch_builder(&self.k.take_f32).arg(&x).arg(&xp).arg(&len).arg(&count).launch(cfg),
            }
        }
        .map(|_| ())
        .map_err(|e| err("copy in", e))
    }

    /// Copies the first `t` rows of `b.out` to device address `out`: as they are, or with `bf16`
    /// rounded to the nearest bf16 (ties to even), on the layer's stream, counting their NaN and
    /// infinities into the `{count, first index}` at `count` unless it is 0 (see `finite.rs`).
    fn copy_output(&self, b: &Buffers, out: u64, t: usize, bf16: bool, count: u64) -> Result<()> {
        let (g, n) = (&self.gpu, t * self.config.hidden);
        if n == 0 {
            return Ok(());
        }
        let (op, bf16, len) = (dptr(&b.out, g), bf16 as i32, n as i64);
        // SAFETY: copy_counting_nonfinite(float*, void*, int, long long, unsigned long long*)
        // reads n floats of `b.out`, writes n values (bf16 with `bf16`, else f32) at `out` (the
        // caller's promise) and, unless null, updates the two u64 at `count`.
        unsafe {
            g.stream
                .launch_builder(&self.k.hand_out)
                .arg(&op)
                .arg(&out)
                .arg(&bf16)
                .arg(&len)
                .arg(&count)
                .launch(super::finite::warps_over(n))
        }
        .map(|_| ())
        .map_err(|e| err("copy out", e))
    }

    /// Runs `tokens` tokens of uniform random input already on the device and returns the
    /// per-stage event times (for benchmarks). Expert-parallel ranks first wait for each other
    /// on the device, so that the times start together on every rank. A low-latency layer, and
    /// a small batch on one GPU (see the `graph` module), replays its graph and times only the
    /// whole; [`CudaMoeLayer::forward_timed_stages`] times the stages. A TP-sliced layer runs
    /// its share of the batch and times the whole layer, the TP all-gather included (in the
    /// combine stage).
    pub fn forward_timed(&self, tokens: usize, seed: u64) -> Result<GpuStageTimes> {
        self.timed(tokens, seed, Replay::Graph)
    }

    /// [`CudaMoeLayer::forward_timed`] with every stage timed: a low-latency layer replays a
    /// capture of its graph that stamps the GPU's clock between the stages (a strategy it
    /// does not capture runs its stages directly, on all `M` rows of its capacity); a small
    /// batch on one GPU runs directly, with events.
    pub fn forward_timed_stages(&self, tokens: usize, seed: u64) -> Result<GpuStageTimes> {
        self.timed(tokens, seed, Replay::Stamped)
    }

    fn timed(&self, tokens: usize, seed: u64, replay: Replay) -> Result<GpuStageTimes> {
        self.timed_marks(tokens, seed, replay, &no_hook).map(|(times, _)| times)
    }

    /// [`CudaMoeLayer::timed`], calling `hook` at every stage boundary of a direct run and also
    /// returning the run's first and last events (none when nothing ran, or for a graph
    /// replay).
    fn timed_marks(
        &self,
        tokens: usize,
        seed: u64,
        replay: Replay,
        hook: &StageHook<'_>,
    ) -> Result<(GpuStageTimes, Option<Span>)> {
        let (a, z) = self.strategy.token_window(tokens);
        let rows = z - a;
        let capacity = self.capacity();
        self.check_capacity(self.strategy.largest_window(tokens))?;
        let mut guard = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
        let b = self.batch_buffers(&mut guard, tokens)?;
        let n = rows * self.config.hidden;
        // The TP ranks of a group pass the same seed: each share gets values of its own.
        let seed = seed ^ ((a as u64) << 32);
        // bf16 hidden states, as inference engines and the PyTorch baselines hold them, where a
        // direct run's router reads them as they are; else f32 ones.
        let graph = matches!(replay, Replay::Graph) && self.takes_graph(rows);
        b.tokens_bf16 = !graph && self.routes_bf16_tokens(rows);
        // Their outputs, as such engines take them, in bf16 too.
        b.out_bf16 = b.tokens_bf16;
        let (fill, ptr) = match b.tokens_bf16 {
            true => (&self.k.fill_bf16, dptr(&b.x_bf, &self.gpu)),
            false => (&self.k.fill_f32, dptr(&b.x, &self.gpu)),
        };
        let (len, scale) = (n as i64, 1.0f32);
        // SAFETY: fills the first `n` values of the input buffer (bf16 or f32, as the kernel
        // writes), which holds at least `n`.
        unsafe { self.gpu.stream.launch_builder(fill).arg(&ptr).arg(&len).arg(&seed).arg(&scale).launch(grid(n)) }
            .map_err(|e| err("fill", e))?;
        if let Some(link) = &self.ep {
            self.align_ranks(b, link)?;
        }
        let captures = self.strategy.captures();
        match (capacity, replay) {
            (Some(_), Replay::Graph) => Ok((self.ll_run(b, rows, true)?, None)),
            (Some(_), Replay::Stamped) if captures => Ok((self.ll_run_stamped(b, rows)?, None)),
            (Some(m), _) => {
                self.ll_set_tokens(b, rows)?;
                self.run_marks(b, m, true, hook)
            }
            (None, Replay::Graph) if self.takes_graph(rows) => Ok((self.graph_run(b, rows, true)?, None)),
            (None, _) => self.run_marks(b, rows, true, hook),
        }
    }

    /// The buffers for a batch of `t` tokens: room for the rows any rank sharing the batch
    /// routes (at least the low-latency capacity), an output of all `t` rows, and `b.batch`
    /// set to `t`.
    fn batch_buffers<'a>(&self, guard: &'a mut Option<Buffers>, t: usize) -> Result<&'a mut Buffers> {
        let most = self.strategy.largest_window(t);
        let b = self.buffers(guard, self.capacity().unwrap_or(most).max(most))?;
        let h = self.config.hidden;
        // Only a TP-sliced layer routes fewer rows than it returns; it captures no graph that
        // could point into the output it replaces.
        if b.out.len() < t * h {
            b.out = self.gpu.stream.alloc_zeros::<f32>(t * h).map_err(|e| err("allocating workspace", e))?;
        }
        b.batch = t;
        b.tokens_bf16 = false;
        b.out_bf16 = false;
        Ok(b)
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

    /// [`CudaMoeLayer::run`] before a graph's capture (modules load, cuBLAS picks its kernels,
    /// NCCL connects): its routing is not counted in the load statistics, since the graph's
    /// first replay runs the same call.
    fn warm_up(&self, b: &mut Buffers, t: usize) -> Result<()> {
        use std::sync::atomic::Ordering;
        self.warming_up.store(true, Ordering::Relaxed);
        let ran = self.run(b, t, false);
        self.warming_up.store(false, Ordering::Relaxed);
        ran.map(|_| ())
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
        let ran = self.enqueue(b, t, &mark)?;
        self.strategy.wait(self)?;
        if !timed {
            return Ok((GpuStageTimes::default(), None));
        }
        let ms = |a: usize, z: usize| -> Result<f64> {
            Ok(marks[a].elapsed_ms(&marks[z]).map_err(|e| err("event time", e))? as f64)
        };
        let times = GpuStageTimes {
            dispatch_bytes: self.sent_bytes(ran.sent)?,
            experts_used: self.experts_used(b)?,
            strategy: ran.strategy,
            experts: ran.experts,
            transport: self.ep.as_ref().map_or("", |l| l.transport_name()),
            device_plan: self.dispatch_planned_on_device(),
            rows_beside_routing: self.dispatch_rows_beside_routing(),
            rows_home_from_gemm: self.dispatch_planned_on_device() && strategy::rows_home_from_gemm(self),
            ..stages_between(ms)?
        };
        let mut marks = marks;
        let last = marks.pop().expect("ten marks");
        Ok((times, Some(Span { first: marks.swap_remove(0), last })))
    }

    /// Waits for the run enqueued on the layer's stream: against the expert-parallel
    /// communicator's deadline (naming the transport's failed waits), or for one GPU's stream.
    fn wait_run(&self) -> Result<()> {
        let s = &self.gpu.stream;
        match &self.ep {
            Some(link) => link.check_transport(link.comm.wait("moe layer", s)),
            None => s.synchronize().map_err(|e| err("synchronize", e)),
        }
    }

    /// The bytes a completed run dispatched to other ranks (read from the device where the
    /// dispatch counted them there).
    fn sent_bytes(&self, sent: strategy::Sent) -> Result<usize> {
        use crate::comm::Communicator;
        let (strategy::Sent::Counted { rows, row_bytes }, Some(link)) = (sent, &self.ep) else {
            return Ok(match sent {
                strategy::Sent::Bytes(b) => b,
                strategy::Sent::Counted { .. } => 0,
            });
        };
        let (n, rank) = (link.comm.size(), link.comm.rank());
        let mut counts = vec![0i32; n];
        // SAFETY: `rows` holds an int per rank, written by the completed run.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut counts, rows) }.map_err(|e| err("reading counts", e))?;
        Ok(counts.iter().enumerate().filter(|&(d, _)| d != rank).map(|(_, &c)| c.max(0) as usize * row_bytes).sum())
    }

    /// The experts that received rows in the last run on `b`: any of one GPU's, or an
    /// expert-parallel rank's own (from its grouped rows' counts, or the low-latency layout's);
    /// 0 before an expert-parallel rank has grouped any.
    fn experts_used(&self, b: &Buffers) -> Result<usize> {
        let s = &self.gpu.stream;
        let counts = match (&self.ep, &b.ll, &b.ep) {
            (None, _, _) => s.clone_dtoh(&b.counts),
            (Some(link), Some(ll), _) => s.clone_dtoh(&ll.counts.slice(..link.local)),
            // The grouped counts end with the bucket of slots served elsewhere.
            (Some(link), None, Some(ep)) => s.clone_dtoh(&ep.counts.slice(..link.local)),
            (Some(_), None, None) => return Ok(0),
        }
        .map_err(|e| err("reading expert counts", e))?;
        Ok(counts.iter().filter(|&&c| c > 0).count())
    }

    /// Enqueues the whole layer on the `t` tokens in `b.x` (into `b.out`) on the layer's
    /// stream, calling `mark(0..=9)` between the stages; returns the bytes dispatched to other
    /// ranks and the names of the strategy and the experts' implementation that ran.
    fn enqueue(&self, b: &mut Buffers, t: usize, mark: &dyn Fn(usize) -> Result<()>) -> Result<Ran> {
        let g = &self.gpu;
        mark(0)?;
        // Every rank's batch size, where the auto table or the strategy needs it: exchanged
        // first, beside the routing, so the host has it by the time the routing has run.
        if let Some(batches) = b.batches.as_mut() {
            batches.forget();
        }
        let shares = self.ep.as_ref().filter(|_| self.auto.is_some() || self.strategy.needs_batches(self));
        if let Some(link) = shares {
            self.share_batches(b, link, t)?;
        }
        // An expert-parallel rank without tokens still takes part in every exchange.
        if t > 0 {
            self.route(b, t)?;
        }
        if shares.is_some() {
            self.join_batches()?;
        }
        // What the dispatch sends that does not depend on the routing leaves beside it.
        b.rows_sent_early = false;
        let pf = self.strategy_for(b, t)?;
        pf.send_beside_routing(self, b, t)?;
        // The fused router has counted its call already.
        if self.records_load() && !self.routes_fused(t) {
            let live = b.ll.as_ref().map(|ll| (dptr(&ll.tokens, g), self.config.top_k));
            // Beside the layer on the shared experts' side stream where the call has them (the
            // layer's stream joins it for their output, and has joined the batch sizes' exchange
            // on it already), so small batches do not wait for the count (docs/tuning.md); else
            // on the layer's stream.
            let beside = t > 0 && self.w.shared.is_some();
            if beside {
                self.side.fork(&g.stream, [self.side.shared()])?;
            }
            let s = if beside { &self.side.shared().stream } else { &g.stream };
            self.load.record(s, dptr(&b.ids, g), t * self.config.top_k, live)?;
        }
        mark(1)?;
        // The modular kernel: prepare → experts → finalize, with the shared experts on a side
        // stream from the end of the routing or of the send, their launches enqueued before or
        // after the send's (`SharedStart`).
        let start = pf.shared_start(self);
        if t > 0 {
            match start {
                SharedStart::AfterRouting => self.fork_shared(b, t).and_then(|_| self.enqueue_shared(b, t))?,
                SharedStart::LaunchedAfterSend => self.fork_shared(b, t)?,
                SharedStart::AfterSend => {}
            }
        }
        let pending = pf.prepare_begin(self, b, t, mark)?;
        if t > 0 {
            match start {
                SharedStart::AfterRouting => {}
                SharedStart::LaunchedAfterSend => self.enqueue_shared(b, t)?,
                SharedStart::AfterSend => self.fork_shared(b, t).and_then(|_| self.enqueue_shared(b, t))?,
            }
        }
        let mut d = pf.prepare_finish(self, b, t, pending, mark)?;
        if d.rows.y_rows.is_some() && !d.rows.imp.scatters_rows() {
            return Err(MoeError::Unsupported(format!("the {} experts store their rows in place", d.rows.imp.name())));
        }
        if d.rows.rows > 0 {
            d.rows.imp.run(self, b, &d.rows, mark)?;
        } else {
            (4..=6).try_for_each(mark)?;
        }
        pf.finalize_begin(self, b, t, &mut d)?;
        let ran = Ran { sent: d.sent, strategy: pf.name(), experts: d.rows.imp.name() };
        pf.finalize_finish(self, b, t, d, mark)?;
        mark(8)?;
        // Strategies that combine at home with one GPU's combine add the shared output in it;
        // the others get it here.
        if !pf.adds_shared(self) {
            self.add_shared_output(b, t)?;
        }
        mark(9)?;
        Ok(ran)
    }

    /// Whether this call counts its tokens per expert into the load statistics: where they are
    /// on, except in the direct run before a graph's capture, which computes what the graph's
    /// first replay computes again (that call's routing is counted once, by the replay). The
    /// fused router counts them in its own launch; other calls launch `count_expert_load`
    /// after the routing.
    pub(super) fn records_load(&self) -> bool {
        self.opts.load_stats && !self.warming_up.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Adds the shared experts' output, computed on the side stream (joined here), to the
    /// first `t` rows of `b.out`; nothing without shared experts or tokens.
    fn add_shared_output(&self, b: &mut Buffers, t: usize) -> Result<()> {
        let (Some(sh), true) = (&self.w.shared, t > 0) else { return Ok(()) };
        let g = &self.gpu;
        let s = &g.stream;
        self.side.join(s, [self.side.shared()])?;
        let gate = sh.gate.as_ref().map_or(0u64, |x| dptr(x, g));
        let (yp, xp, ti, hi, outp) =
            (dptr(&b.sy, g), dptr(&b.x, g), t as i32, self.config.hidden as i32, dptr(&b.out, g));
        // The low-latency batch's rows alone, its size read on the device.
        let live = b.ll.as_ref().map_or(0u64, |ll| dptr(&ll.tokens, g));
        // SAFETY: add_shared(float*, bf16*, float*, float*, int, int, int*) over `t` rows (the
        // first `*live` when not null); the shared output was computed on the side stream
        // joined above.
        unsafe {
            s.launch_builder(&self.k.add_shared)
                .arg(&outp)
                .arg(&yp)
                .arg(&xp)
                .arg(&gate)
                .arg(&ti)
                .arg(&hi)
                .arg(&live)
                .launch(rows(t, 256))
                .map_err(|e| err("add_shared", e))?;
        }
        Ok(())
    }
}

/// The stages of a run between its ten boundaries (`mark(0..=9)` in `enqueue`), `ms(a, z)` the
/// milliseconds from boundary `a` to `z`; the other fields left at their defaults.
fn stages_between(ms: impl Fn(usize, usize) -> Result<f64>) -> Result<GpuStageTimes> {
    Ok(GpuStageTimes {
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
        ..GpuStageTimes::default()
    })
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
