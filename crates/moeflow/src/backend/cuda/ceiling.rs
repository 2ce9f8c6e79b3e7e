//! The GPU's own ceilings, measured where the benchmark runs: dense bf16 and fp8 GEMM rates (on
//! a cool GPU, and under sustained load) and device-to-device copy bandwidth.

use super::blas_handle::BlasHandle;
use super::dense_fp8::DenseFp8;
use super::layer::gemm_bf16;
use super::{err, Gpu, GpuCeilings};
use crate::error::Result;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{sys as drv, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

/// Seconds of back-to-back GEMMs before the sustained rate is timed: long enough for the
/// power cap to bring the clocks down (on H100 and H200 they fall within a second of a MoE
/// layer's GEMMs, throttled for software power capping; docs/tuning.md).
const LOAD_SECONDS: f64 = 1.0;
/// The square GEMM both rates are measured on.
const N: usize = 8192;

/// The cool ceilings of GPU `device` (see [`GpuCeilings`]).
pub fn measure_ceilings(device: usize) -> Result<GpuCeilings> {
    let gpu = Gpu::new(device)?;
    let blas = BlasHandle::new(gpu.stream.clone())?;
    measure(&gpu, &blas)
}

/// The dense bf16 GEMM TFLOP/s GPU `device` holds under sustained load (see
/// `measure_sustained`).
pub fn measure_sustained_gemm(device: usize) -> Result<f64> {
    let gpu = Gpu::new(device)?;
    let blas = BlasHandle::new(gpu.stream.clone())?;
    measure_sustained(&gpu, &blas)
}

/// Random bf16 operands and an output of the N × N GEMM.
struct Operands {
    a: CudaSlice<u16>,
    w: CudaSlice<u16>,
    c: CudaSlice<u16>,
}

impl Operands {
    fn new(g: &Gpu) -> Result<Self> {
        let alloc = |len: usize| g.stream.alloc_zeros::<u16>(len).map_err(|e| err("alloc", e));
        let (a, w, c) = (alloc(N * N)?, alloc(N * N)?, alloc(N * N)?);
        let fill = g.function("fill_uniform_bf16")?;
        for (seed, m) in [(1u64, &a), (2, &w)] {
            let (ptr, len, scale) = (m.device_ptr(&g.stream).0, (N * N) as i64, 1.0f32);
            let blocks = (N * N).div_ceil(256).min(65_535) as u32;
            let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: fill_uniform_bf16(bf16*, long, u64, float) writes the N² values of `m`.
            unsafe { g.stream.launch_builder(&fill).arg(&ptr).arg(&len).arg(&seed).arg(&scale).launch(cfg) }
                .map_err(|e| err("fill", e))?;
        }
        Ok(Operands { a, w, c })
    }

    fn gemm(&self, g: &Gpu, blas: &CudaBlas) -> Result<()> {
        let p = |s: &CudaSlice<u16>| s.device_ptr(&g.stream).0;
        gemm_bf16(blas, p(&self.w), N, N, p(&self.a), p(&self.c), N)
    }
}

/// Milliseconds `f` takes on the stream, `reps` times back to back.
fn span(g: &Gpu, reps: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    let new = || g.ctx.new_event(Some(drv::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| err("event", e));
    let (e0, e1) = (new()?, new()?);
    e0.record(&g.stream).map_err(|e| err("event", e))?;
    for _ in 0..reps {
        f()?;
    }
    e1.record(&g.stream).map_err(|e| err("event", e))?;
    e1.synchronize().map_err(|e| err("event", e))?;
    Ok(e0.elapsed_ms(&e1).map_err(|e| err("event", e))? as f64)
}

/// Median milliseconds of 5 single runs of `f` after a warm-up.
fn median_ms(g: &Gpu, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    median_of_runs(&mut || span(g, 1, f))
}

/// The median of 5 of `timed`'s milliseconds, after one run as a warm-up.
fn median_of_runs(timed: &mut dyn FnMut() -> Result<f64>) -> Result<f64> {
    timed()?;
    let mut v = (0..5).map(|_| timed()).collect::<Result<Vec<_>>>()?;
    v.sort_by(f64::total_cmp);
    Ok(v[v.len() / 2])
}

fn tflops(ms: f64) -> f64 {
    2.0 * (N * N * N) as f64 / ms / 1e9
}

pub(super) fn measure(g: &Gpu, blas: &CudaBlas) -> Result<GpuCeilings> {
    let ops = Operands::new(g)?;
    let gemm_ms = median_ms(g, &mut || ops.gemm(g, blas))?;
    drop(ops);
    let bytes = 1usize << 30;
    let alloc = |len: usize| g.stream.alloc_zeros::<u16>(len).map_err(|e| err("alloc", e));
    let (src, mut dst) = (alloc(bytes / 2)?, alloc(bytes / 2)?);
    let copy_ms = median_ms(g, &mut || g.stream.memcpy_dtod(&src, &mut dst).map_err(|e| err("copy", e)))?;
    Ok(GpuCeilings { gemm_tflops: tflops(gemm_ms), copy_gbps: 2.0 * bytes as f64 / copy_ms / 1e6 })
}

/// The GEMM's rate over 20 runs after [`LOAD_SECONDS`] of back-to-back runs. It leaves the GPU
/// throttled for a while, so benchmarks measure it after their own runs.
fn measure_sustained(g: &Gpu, blas: &CudaBlas) -> Result<f64> {
    let ops = Operands::new(g)?;
    Ok(tflops(loaded_ms(g, &mut || ops.gemm(g, blas))?))
}

/// Milliseconds a run of `f` takes over 20 runs after [`LOAD_SECONDS`] of back-to-back runs.
fn loaded_ms(g: &Gpu, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    let mut loaded = 0.0;
    while loaded < LOAD_SECONDS * 1e3 {
        loaded += span(g, 50, f)?;
    }
    Ok(span(g, 20, f)? / 20.0)
}

/// The dense fp8 GEMM's TFLOP/s on GPU `device`: cuBLASLt over the N × N operands' random values
/// as e4m3 codes, one scale a tensor (see [`DenseFp8`]); the median of 5 runs on a cool GPU, or
/// with `sustained` the rate after [`LOAD_SECONDS`] of load (as [`measure_sustained_gemm`]).
/// `None` where the GPU has no fp8 GEMM (before compute capability 8.9).
pub fn measure_fp8_gemm(device: usize, sustained: bool) -> Result<Option<f64>> {
    let g = Gpu::new(device)?;
    let Some(gemm) = DenseFp8::new(&g, N)? else {
        return Ok(None);
    };
    let ops = Operands::new(&g)?;
    let (a, w) = (fp8_codes(&g, &ops.a)?, fp8_codes(&g, &ops.w)?);
    let p = |s: &CudaSlice<u8>| s.device_ptr(&g.stream).0;
    let operands = [p(&a), p(&w), ops.c.device_ptr(&g.stream).0];
    let mut run = || gemm.run(&g, operands);
    let ms = if sustained { loaded_ms(&g, &mut run)? } else { median_ms(&g, &mut run)? };
    Ok(Some(tflops(ms)))
}

/// The e4m3 codes of the N × N bf16 values `x` (one scale per 128 values, as the layer quantizes
/// its rows), so that the fp8 GEMM multiplies realistic codes.
fn fp8_codes(g: &Gpu, x: &CudaSlice<u16>) -> Result<CudaSlice<u8>> {
    let codes = g.stream.alloc_zeros::<u8>(N * N).map_err(|e| err("alloc", e))?;
    let scales = g.stream.alloc_zeros::<f32>(N * N / 128).map_err(|e| err("alloc", e))?;
    let quantize = g.function("quantize_rows_bf16")?;
    let (xp, cp, sp) = (x.device_ptr(&g.stream).0, codes.device_ptr(&g.stream).0, scales.device_ptr(&g.stream).0);
    let (rows, h, group, fp8_kind, cap, none) = (N as i64, N as i32, 128i32, 2i32, 1i32, 0u64);
    // SAFETY: quantize_rows_bf16(bf16*, long, int, int, int, int*, int, u8*, float*, bf16*) over
    // N rows of N values: x holds them, codes N² bytes, scales N² / 128 floats; no counts, no
    // values written back.
    unsafe {
        g.stream
            .launch_builder(&quantize)
            .arg(&xp)
            .arg(&rows)
            .arg(&h)
            .arg(&group)
            .arg(&fp8_kind)
            .arg(&none)
            .arg(&cap)
            .arg(&cp)
            .arg(&sp)
            .arg(&none)
            .launch(super::quant::quantize_launch(N, N, 128))
    }
    .map_err(|e| err("quantize_rows_bf16", e))?;
    Ok(codes)
}

/// Device memory from `cuMemAlloc` (which peer access reaches, unlike the stream-ordered
/// pool's), freed on drop.
struct Raw(u64);

impl Raw {
    fn new(bytes: usize) -> Result<Raw> {
        let mut p = 0u64;
        // SAFETY: allocates `bytes` bytes in the current context.
        match unsafe { drv::cuMemAlloc_v2(&mut p, bytes) } {
            drv::cudaError_enum::CUDA_SUCCESS => Ok(Raw(p)),
            r => Err(err("allocating for the peer copy", r)),
        }
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        // SAFETY: allocated by `Raw::new`, freed once.
        unsafe { drv::cuMemFree_v2(self.0) };
    }
}

/// GB/s of a 224 MiB copy from GPU `from` into GPU `to`'s memory over their link, one way,
/// median of 5 after a warm-up: the ceiling of what expert parallelism moves between them.
pub fn measure_peer_copy(from: usize, to: usize) -> Result<f64> {
    peer_rate(&[(from, to)], None)
}

/// GB/s of the NVLink transport's push kernel on `sms` SMs copying 16384 rows of 14336 bytes
/// (DeepSeek-V3's bf16 rows) from GPU `from` into GPU `to`'s memory, median of 5 after a
/// warm-up: what the transport's copy reaches against [`measure_peer_copy`].
pub fn measure_peer_push(from: usize, to: usize, sms: u32) -> Result<f64> {
    peer_rate(&[(from, to)], Some(sms))
}

/// GB/s each way (the slower way's) while GPUs `a` and `b` send into each other's memory at
/// once, as both ranks of an all-to-all do: the plain copy with `push_sms` `None`, else the
/// push kernel on that many SMs of each GPU; as the one-way measures, median of 5.
pub fn measure_peer_both_ways(a: usize, b: usize, push_sms: Option<u32>) -> Result<f64> {
    peer_rate(&[(a, b), (b, a)], push_sms)
}

/// Rows every peer measure copies...
const PEER_ROWS: usize = 16_384;
/// ...of DeepSeek-V3's bf16 hidden size...
const PEER_ROW_BYTES: usize = 14_336;
/// ...224 MiB in all.
const PEER_BYTES: usize = PEER_ROWS * PEER_ROW_BYTES;

/// The rate of the slower of `legs` (from, to) run at the same time, GB/s (see
/// [`measure_peer_both_ways`]).
fn peer_rate(legs: &[(usize, usize)], push_sms: Option<u32>) -> Result<f64> {
    let mut legs = legs.iter().map(|&(from, to)| PeerLeg::new(from, to, push_sms)).collect::<Result<Vec<_>>>()?;
    let mut round = || -> Result<f64> {
        let mut spans = Vec::with_capacity(legs.len());
        for leg in legs.iter_mut() {
            spans.push(leg.start()?);
        }
        let mut slowest = 0.0f64;
        for (e0, e1) in spans {
            e1.synchronize().map_err(|e| err("event", e))?;
            slowest = slowest.max(e0.elapsed_ms(&e1).map_err(|e| err("event", e))? as f64);
        }
        Ok(slowest)
    };
    Ok(PEER_BYTES as f64 / median_of_runs(&mut round)? / 1e6)
}

/// One way of a peer measure: [`PEER_BYTES`] from a buffer on GPU `from` into one on `to`, by
/// the copy engines or by the push kernel. The fields drop in order: the buffers before the
/// contexts, whose last holder's drop releases the GPU's primary context and all its memory.
struct PeerLeg {
    push: Option<PushLeg>,
    src: Raw,
    dst: Raw,
    g: Gpu,
    _peer: std::sync::Arc<cudarc::driver::CudaContext>,
}

/// The push kernel's launch state for one leg: its lane table, the flag it raises (a word after
/// the rows in `dst`), its counters, and its grid.
struct PushLeg {
    kernel: cudarc::driver::CudaFunction,
    table: CudaSlice<u8>,
    flags: CudaSlice<u64>,
    counters: CudaSlice<u64>,
    sms: u32,
}

impl PeerLeg {
    fn new(from: usize, to: usize, push_sms: Option<u32>) -> Result<PeerLeg> {
        let g = Gpu::new(from)?;
        let peer = super::nccl::context(to)?;
        peer.bind_to_thread().map_err(|e| err("binding context", e))?;
        let dst = Raw::new(PEER_BYTES + 8)?;
        g.ctx.bind_to_thread().map_err(|e| err("binding context", e))?;
        // SAFETY: the source context is bound; enabling twice reports "already enabled".
        let r = unsafe { drv::cuCtxEnablePeerAccess(peer.cu_ctx(), 0) };
        if !matches!(r, drv::cudaError_enum::CUDA_SUCCESS | drv::cudaError_enum::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
        {
            return Err(err("enabling peer access", r));
        }
        let src = Raw::new(PEER_BYTES)?;
        let push = match push_sms {
            None => None,
            Some(sms) => {
                let s = &g.stream;
                let lane = super::layer::lane_record(src.0, 0, dst.0, 0, PEER_ROWS, PEER_ROW_BYTES);
                Some(PushLeg {
                    kernel: g.function("nvl_push")?,
                    table: s.clone_htod(&lane).map_err(|e| err("upload", e))?,
                    flags: s.clone_htod(&[dst.0 + PEER_BYTES as u64]).map_err(|e| err("upload", e))?,
                    counters: s.alloc_zeros::<u64>(3).map_err(|e| err("alloc", e))?,
                    sms: sms.max(1),
                })
            }
        };
        Ok(PeerLeg { push, src, dst, g, _peer: peer })
    }

    /// Enqueues one copy between two events, and returns them.
    fn start(&mut self) -> Result<(cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)> {
        let (g, s) = (&self.g, &self.g.stream);
        let new = || g.ctx.new_event(Some(drv::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| err("event", e));
        let (e0, e1) = (new()?, new()?);
        e0.record(s).map_err(|e| err("event", e))?;
        match &self.push {
            None => {
                // SAFETY: both allocations hold PEER_BYTES bytes; the copy is ordered on the stream.
                unsafe { cudarc::driver::result::memcpy_dtod_async(self.dst.0, self.src.0, PEER_BYTES, s.cu_stream()) }
                    .map_err(|e| err("peer copy", e))?
            }
            Some(p) => {
                let (tp, fp, cp) = (p.table.device_ptr(s).0, p.flags.device_ptr(s).0, p.counters.device_ptr(s).0);
                // The counters as an exchange's (sent, received, done); no rank answers this
                // push, so its kernel waits for no sender.
                let (one, done, wait) = (1i32, cp + 16, super::layer::NvlWait::on_no_sender(cp + 8));
                let cfg = LaunchConfig { grid_dim: (p.sms, 1, 1), block_dim: (512, 1, 1), shared_mem_bytes: 0 };
                // SAFETY: nvl_push(PushLane*, int, u64**, int, u64*, unsigned*, NvlWait) over one
                // lane of whole rows inside `src` and `dst`; one flag word after the rows in
                // `dst`; the counters start zeroed, and the wait on no sender only writes the
                // count at `cp + 8`.
                unsafe {
                    s.launch_builder(&p.kernel)
                        .arg(&tp)
                        .arg(&one)
                        .arg(&fp)
                        .arg(&one)
                        .arg(&cp)
                        .arg(&done)
                        .arg(&wait)
                        .launch(cfg)
                }
                .map_err(|e| err("nvl_push", e))?;
            }
        }
        e1.record(s).map_err(|e| err("event", e))?;
        Ok((e0, e1))
    }
}
