//! The CUDA backend (feature `cuda`): cudarc with dynamic loading, kernels compiled at run time
//! by NVRTC for the device's architecture (cached per process), bf16 cuBLAS expert GEMMs, and
//! NCCL communicators for expert parallelism across GPUs and processes.

mod blas_handle;
mod ceiling;
mod dense_fp8;
mod experts;
mod finite;
mod layer;
mod load_stats;
mod nccl;
mod peer_window;
mod quant;
mod watchdog;

pub use super::cuda_options::{CudaOptions, ExpertGemm, LowLatencyGemm, Transport};
pub use super::{GpuCeilings, GpuStageTimes};
pub use ceiling::{
    measure_ceilings, measure_fp8_gemm, measure_peer_both_ways, measure_peer_copy, measure_peer_push,
    measure_sustained_gemm,
};
pub use experts::CudaExperts;
pub use layer::{CudaDualBatch, CudaMoeLayer};

/// Number of CUDA devices (0 without a driver).
pub fn device_count() -> usize {
    // SAFETY: only probes whether the CUDA driver library can be loaded.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

/// For the library's GPU tests: whether there is no CUDA device, after saying loudly that
/// `test` skips. Otherwise the calling test thread shares the device with the other tests
/// until it ends (see [`gpu_alone`]).
#[cfg(test)]
pub(crate) fn skip_without_gpu(test: &str) -> bool {
    let none = device_count() == 0;
    if none {
        eprintln!("SKIPPED {test}: no CUDA device");
    } else {
        gpu_tests::hold(false);
    }
    none
}

/// For the library's GPU tests that capture a caller's stream into a graph, or whose own
/// captures fail on purpose or race each other: the calling test thread has the device to
/// itself until it ends. Other tests' calls beside a capture (making cuBLAS handles, freeing
/// page-locked memory) can invalidate it, and cudarc keeps one error slot per context, whose
/// errors recorded by a failed capture's calls the next call on any thread returns.
#[cfg(test)]
pub(crate) fn gpu_alone() {
    if device_count() > 0 {
        gpu_tests::hold(true);
    }
}

#[cfg(test)]
mod gpu_tests {
    use std::cell::RefCell;
    use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

    static DEVICE: RwLock<()> = RwLock::new(());

    /// This thread's hold on the device: shared with other tests, or alone.
    enum Hold {
        Shared { _guard: RwLockReadGuard<'static, ()> },
        Alone { _guard: RwLockWriteGuard<'static, ()> },
    }

    thread_local! {
        // libtest runs each test on a thread of its own, so the hold ends with the test.
        static HELD: RefCell<Option<Hold>> = const { RefCell::new(None) };
    }

    /// Takes the device for this thread (`alone`: exclusively), unless it holds it so already.
    pub(super) fn hold(alone: bool) {
        HELD.with(|held| {
            let mut held = held.borrow_mut();
            match (&*held, alone) {
                (Some(Hold::Alone { .. }), _) | (Some(Hold::Shared { .. }), false) => {}
                _ => {
                    // A shared hold is let go before the exclusive one is waited for.
                    *held = None;
                    *held = Some(if alone {
                        Hold::Alone { _guard: DEVICE.write().unwrap_or_else(|p| p.into_inner()) }
                    } else {
                        Hold::Shared { _guard: DEVICE.read().unwrap_or_else(|p| p.into_inner()) }
                    });
                }
            }
        });
    }
}

/// The integer of `#define name <integer>` in the kernel sources, for the tests that hold a
/// Rust constant to the kernel constant it mirrors; `None` where there is no such line.
#[cfg(test)]
pub(crate) fn kernel_define(name: &str) -> Option<i64> {
    KERNELS.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        if words.next() != Some("#define") || words.next() != Some(name) {
            return None;
        }
        words.next()?.parse().ok()
    })
}

/// The experts `weights` on GPU `device`, as the modular layer takes them.
pub fn experts(
    weights: &crate::experts::ExpertWeights,
    activation: crate::experts::Activation,
    device: usize,
) -> Result<Box<dyn crate::experts::Experts>> {
    Ok(Box::new(CudaExperts::new(weights, activation, device)?))
}
pub use nccl::{run_ranks_nccl, NcclComm};
pub use quant::CudaQuant;

use crate::error::{MoeError, Result};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use std::sync::{Arc, Mutex, OnceLock};

/// The kernel sources, compiled once per process and device.
const KERNELS: &str = concat!(
    include_str!("kernels/common.cu"),
    include_str!("kernels/route.cu"),
    include_str!("kernels/permute.cu"),
    include_str!("kernels/activation.cu"),
    include_str!("kernels/combine.cu"),
    include_str!("kernels/placement.cu"),
    include_str!("kernels/quant.cu"),
    include_str!("kernels/router_fixed.cu"),
    include_str!("kernels/low_latency.cu"),
    include_str!("kernels/masked_gemm.cu"),
    include_str!("kernels/grouped_gemm_sm90.cu"),
    include_str!("kernels/grouped_gemm_fp8_sm90.cu"),
    include_str!("kernels/router_tf32.cu"),
    include_str!("kernels/finite.cu"),
    include_str!("kernels/load_stats.cu"),
    include_str!("kernels/nvlink.cu")
);

/// A CUDA error while doing `what`; running out of device memory gets its own error.
fn err(what: &str, e: impl std::fmt::Debug) -> MoeError {
    let debug = format!("{e:?}");
    if finite::is_out_of_memory(&debug) {
        return MoeError::DeviceOutOfMemory { what: format!("CUDA: {what}") };
    }
    MoeError::Unsupported(format!("CUDA: {what}: {debug}"))
}

/// One GPU: context, stream, compiled kernels.
pub struct Gpu {
    /// The context.
    pub ctx: Arc<CudaContext>,
    /// The stream every operation runs on.
    pub stream: Arc<CudaStream>,
    /// The device's ordinal.
    pub ordinal: usize,
    module: Arc<CudaModule>,
}

/// The oldest compute capability the kernels compile for: their copies into shared memory use
/// `cp.async` (sm_80, Ampere).
const MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

/// An error naming GPU `ordinal`'s compute capability `cc` when it is older than
/// [`MIN_COMPUTE_CAPABILITY`], before NVRTC would fail on the kernels.
fn require_compute_capability(ordinal: usize, cc: (i32, i32)) -> Result<()> {
    if cc >= MIN_COMPUTE_CAPABILITY {
        return Ok(());
    }
    let (major, minor) = MIN_COMPUTE_CAPABILITY;
    Err(MoeError::Unsupported(format!(
        "GPU {ordinal} has compute capability {}.{}; moeflow's CUDA kernels need {major}.{minor} (Ampere) or newer",
        cc.0, cc.1
    )))
}

/// Compiled modules by device ordinal and extra NVRTC options.
type ModuleCache = Mutex<Vec<((usize, Vec<String>), Arc<CudaModule>)>>;

static MODULES: OnceLock<ModuleCache> = OnceLock::new();

impl Gpu {
    /// Opens device `ordinal`; a clear error when no driver or device is present.
    pub fn new(ordinal: usize) -> Result<Self> {
        Self::with_nvrtc_options(ordinal, &[])
    }

    /// [`Gpu::new`], its kernels compiled with `nvrtc_options` added (see
    /// [`CudaOptions::nvrtc_options`]).
    pub fn with_nvrtc_options(ordinal: usize, nvrtc_options: &[String]) -> Result<Self> {
        let ctx = nccl::context(ordinal)?;
        // SAFETY: moeflow orders all work on one stream per layer, so cudarc's per-buffer event
        // tracking is not needed.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| err("creating stream", e))?;
        let module = Self::module(&ctx, ordinal, nvrtc_options)?;
        Ok(Gpu { ctx, stream, ordinal, module })
    }

    fn module(ctx: &Arc<CudaContext>, ordinal: usize, nvrtc_options: &[String]) -> Result<Arc<CudaModule>> {
        let cache = MODULES.get_or_init(|| Mutex::new(Vec::new()));
        let mut cache = cache.lock().unwrap_or_else(|p| p.into_inner());
        let key = (ordinal, nvrtc_options.to_vec());
        if let Some((_, m)) = cache.iter().find(|(o, _)| *o == key) {
            return Ok(m.clone());
        }
        let (major, minor) = ctx.compute_capability().map_err(|e| err("compute capability", e))?;
        require_compute_capability(ordinal, (major, minor))?;
        // Hopper builds for sm_90a, whose wgmma and TMA the grouped GEMM needs.
        let suffix = if (major, minor) == (9, 0) { "a" } else { "" };
        let (ptx, _) = compile_kernels(&format!("sm_{major}{minor}{suffix}"), nvrtc_options)?;
        let module = ctx.load_module(ptx).map_err(|e| err("loading module", e))?;
        cache.push((key, module.clone()));
        Ok(module)
    }

    /// Kernel `name` of the compiled sources ([`KERNELS`]).
    pub fn function(&self, name: &str) -> Result<CudaFunction> {
        self.module.load_function(name).map_err(|e| err(&format!("kernel {name}"), e))
    }
}

/// The kernel sources compiled by NVRTC to PTX for `arch` (`sm_80`, `sm_90a`, …), with
/// `nvrtc_options` added, and NVRTC's log (ptxas's report where the options ask for one);
/// needs NVRTC's library, not a GPU. A failed compile's error holds the log.
fn compile_kernels(arch: &str, nvrtc_options: &[String]) -> Result<(cudarc::nvrtc::Ptx, String)> {
    use cudarc::nvrtc::result as nvrtc;
    let what = format!("NVRTC compile of the kernels for {arch}");
    let src = std::ffi::CString::new(KERNELS).map_err(|e| err(&what, e))?;
    let program = nvrtc::create_program(&src, None).map_err(|e| err(&what, e))?;
    let mut options = vec![format!("--gpu-architecture={arch}")];
    options.extend(nvrtc_options.iter().cloned());
    // SAFETY: `program` was created above; it is compiled, read and destroyed once each, and
    // the log and the PTX are NUL-terminated strings NVRTC wrote.
    unsafe {
        let compiled = nvrtc::compile_program(program, &options);
        let log = nvrtc::get_program_log(program)
            .map(|l| std::ffi::CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned());
        let ptx = compiled.and_then(|_| nvrtc::get_ptx(program));
        let _ = nvrtc::destroy_program(program);
        let log = log.map_err(|e| err(&what, e))?;
        let ptx = ptx.map_err(|e| err(&what, format!("{e:?}\n{log}")))?;
        let text = std::ffi::CStr::from_ptr(ptx.as_ptr()).to_string_lossy().into_owned();
        Ok((cudarc::nvrtc::Ptx::from_src(text), log))
    }
}

/// Random fp8 e4m3 codes for the GPU tests (a xorshift stream from `seed`), NaN (S.1111.111)
/// left out.
#[cfg(test)]
pub(crate) fn random_e4m3_codes(n: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let c = (state >> 24) as u8;
            if c & 0x7f == 0x7f {
                c & 0xfe
            } else {
                c
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{compile_kernels, require_compute_capability};
    use crate::error::MoeError;

    /// Every kernel compiles with NVRTC for Ampere (sm_80) and Hopper (sm_90a), the Hopper PTX
    /// with the grouped GEMMs' `wgmma` products and the Ampere PTX with their entry points left
    /// empty; and ptxas keeps every Hopper kernel's `wgmma` products asynchronous. It
    /// serializes them, with a warning ("wgmma.mma_async instructions are serialized …",
    /// C7510–C7520), when the paths out of a loop leave different products in flight, which
    /// made a GEMM 2.3 times slower (docs/tuning.md). Prints the kernels that spill. Needs
    /// NVRTC's library but no GPU (CI takes it from PyTorch's wheels); says loudly when it
    /// skips.
    #[test]
    fn kernels_compile_for_ampere_and_hopper() {
        // SAFETY: only tries to open the library by its names.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            eprintln!("SKIPPED kernels_compile_for_ampere_and_hopper: no NVRTC library found");
            return;
        }
        for (arch, hopper) in [("sm_80", false), ("sm_90a", true)] {
            let report = ["--ptxas-options=--verbose".to_string()];
            let (ptx, log) = compile_kernels(arch, &report).unwrap_or_else(|e| panic!("{e}"));
            let text = ptx.to_src();
            for entry in ["route", "combine", "quantize_rows_bf16", "grouped_gemm_sm90", "grouped_gemm_fp8_sm90"] {
                assert!(text.contains(&format!(".entry {entry}(")), "{arch}: no kernel {entry}");
            }
            assert_eq!(text.contains("wgmma.mma_async"), hopper, "{arch}: wgmma products present: {}", !hopper);
            assert!(
                log.contains("Compiling entry function 'grouped_gemm_fp8_sm90'"),
                "{arch}: no ptxas report:\n{log}"
            );
            let serialized: Vec<&str> =
                log.lines().filter(|l| l.contains("wgmma") && l.contains("serialized")).collect();
            assert!(serialized.is_empty(), "{arch}: ptxas serialized wgmma products:\n{}", serialized.join("\n"));
            eprintln!("the kernels compile for {arch}: {} KiB of PTX", text.len() / 1024);
            let mut kernel = "";
            for line in log.lines() {
                if let Some(name) = line.split("Function properties for ").nth(1) {
                    kernel = name.trim();
                } else if line.contains("bytes spill stores") && !line.contains(" 0 bytes spill stores") {
                    let spill = line.trim_start_matches(|c: char| c == ' ' || c == '.' || c.is_alphabetic());
                    eprintln!("  {kernel} spills: {spill}");
                }
            }
        }
    }

    /// GPUs older than Ampere get an error naming their compute capability; Ampere and newer
    /// pass.
    #[test]
    fn gpus_before_ampere_are_refused_by_name() {
        for cc in [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)] {
            assert!(require_compute_capability(1, cc).is_ok(), "{cc:?}");
        }
        for (cc, says) in [((7, 5), "compute capability 7.5"), ((7, 0), "7.0"), ((6, 1), "6.1")] {
            match require_compute_capability(3, cc) {
                Err(MoeError::Unsupported(m)) => assert!(m.contains(says) && m.contains("GPU 3"), "{m}"),
                other => panic!("{cc:?}: {other:?}"),
            }
        }
    }
}
