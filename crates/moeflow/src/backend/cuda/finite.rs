//! Non-finite values found on the device: reduction kernels (`kernels/finite.cu`) over an f32
//! buffer, or over a layer's hidden states as they are copied in and its output as it is copied
//! out, of which only two numbers (the count and the first index) come back to the host, never
//! the tensor. Also device memory checked before large allocations, and out-of-memory errors
//! that say what was being allocated.

use super::{err, Gpu};
use crate::error::{MoeError, Result};
use cudarc::driver::{result, CudaSlice, CudaView, LaunchConfig, PushKernelArg};

/// NaN and infinities among the `x.len()` values of `x`: `(count, first flat index)`, or
/// `None` when all are finite. Waits for the layer's stream.
pub(crate) fn count_nonfinite(gpu: &Gpu, x: &CudaView<'_, f32>) -> Result<Option<(usize, usize)>> {
    let n = x.len();
    if n == 0 {
        return Ok(None);
    }
    let s = &gpu.stream;
    let mut result = fresh_count(gpu)?;
    let kernel = gpu.function("count_nonfinite_f32")?;
    let len = n as i64;
    // SAFETY: count_nonfinite_f32(const float*, long long, unsigned long long*) reads the `n`
    // floats of `x` and updates the two values of `result`; both live until the copy below,
    // which waits for the kernel on the same stream.
    unsafe { s.launch_builder(&kernel).arg(x).arg(&len).arg(&mut result).launch(warps_over(n)) }
        .map_err(|e| err("counting non-finite values", e))?;
    read_count(gpu, &result)
}

/// The grid of the non-finite kernels over `n` values: blocks of 256 threads, at most 1024.
pub(crate) fn warps_over(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 1024) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A `{count, first index}` on the device for the kernels of `finite.cu`, none found yet.
pub(crate) fn fresh_count(gpu: &Gpu) -> Result<CudaSlice<u64>> {
    gpu.stream.clone_htod(&[0u64, u64::MAX]).map_err(|e| err("allocating the non-finite count", e))
}

/// What `count` (see [`fresh_count`]) holds once the layer's stream has run to here: `(count,
/// first flat index)`, or `None` when none was found. Waits for the stream.
pub(crate) fn read_count(gpu: &Gpu, count: &CudaSlice<u64>) -> Result<Option<(usize, usize)>> {
    let host = gpu.stream.clone_dtoh(count).map_err(|e| err("reading the non-finite count", e))?;
    Ok((host[0] > 0).then(|| (host[0] as usize, host[1] as usize)))
}

/// Refuses an output `[T, hidden]` on the device that holds NaN or infinity, naming the count
/// and the first one's position (its value is read back alone).
pub(crate) fn check_output(gpu: &Gpu, out: &CudaView<'_, f32>, hidden: usize) -> Result<()> {
    output_error(gpu, out, hidden, count_nonfinite(gpu, out)?)
}

/// [`check_output`] where `count` (see [`fresh_count`]) holds the count of `out`'s non-finite
/// values, made on the layer's stream (by `copy_counting_nonfinite`). Waits for the stream.
pub(crate) fn check_output_count(
    gpu: &Gpu,
    count: &CudaSlice<u64>,
    out: &CudaView<'_, f32>,
    hidden: usize,
) -> Result<()> {
    output_error(gpu, out, hidden, read_count(gpu, count)?)
}

/// The error for output `out [T, hidden]` in which `found` (`(count, first flat index)`) names
/// non-finite values; `Ok` for none.
fn output_error(gpu: &Gpu, out: &CudaView<'_, f32>, hidden: usize, found: Option<(usize, usize)>) -> Result<()> {
    let Some((count, first)) = found else {
        return Ok(());
    };
    let mut value = [0f32];
    gpu.stream.memcpy_dtoh(&out.slice(first..first + 1), &mut value).map_err(|e| err("reading a value", e))?;
    let hidden = hidden.max(1);
    Err(MoeError::NonFiniteOutput { count, token: first / hidden, column: first % hidden, value: value[0] })
}

/// The error for input `x [T, hidden]` on the device at address `x` (the caller's memory; f32
/// values, or bf16 with `bf16`) in which `count` (see [`fresh_count`], filled as the input was
/// taken in) found NaN or infinity: the error [`crate::error::check_finite`] gives for host
/// input, naming the first such value. `Ok` when none was found. Waits for the layer's stream.
pub(crate) fn check_input_count(gpu: &Gpu, count: &CudaSlice<u64>, x: u64, bf16: bool, what: &str) -> Result<()> {
    let Some((_count, first)) = read_count(gpu, count)? else {
        return Ok(());
    };
    let mut bytes = [0u8; 4];
    let width = if bf16 { 2 } else { 4 };
    // SAFETY: `x` holds the values the count ran over (the caller's promise), `first` among
    // them, `width` bytes each; reading the count waited for the layer's stream, after which no
    // work of the layer writes `x`, and this copy returns once the bytes are here.
    unsafe { result::memcpy_dtoh_sync(&mut bytes[..width], x + (width * first) as u64) }
        .map_err(|e| err("reading a value", e))?;
    let value = match bf16 {
        true => half::bf16::from_le_bytes([bytes[0], bytes[1]]).to_f32(),
        false => f32::from_le_bytes(bytes),
    };
    Err(MoeError::NonFinite { what: what.to_string(), index: first, value })
}

/// Refuses `bytes` for `what` on `gpu` when they exceed its free memory, before allocating.
pub(crate) fn ensure_device_memory(gpu: &Gpu, what: &str, bytes: u128) -> Result<()> {
    if bytes > isize::MAX as u128 {
        return Err(MoeError::OutOfMemory {
            what: format!("{what} on GPU {}", gpu.ordinal),
            needed: bytes,
            available: None,
        });
    }
    let (free, _total) = gpu.ctx.mem_get_info().map_err(|e| err("querying free memory", e))?;
    if bytes > free as u128 {
        return Err(MoeError::OutOfMemory {
            what: format!("{what} on GPU {}", gpu.ordinal),
            needed: bytes,
            available: Some(free as u128),
        });
    }
    Ok(())
}

/// Refuses a low-latency capacity of `m` tokens per rank whose buffers (messages of every
/// rank's rows, the `[local, ranks · m, ·]` expert rows) exceed the device or whose row
/// offsets exceed the kernels' 32-bit indices. `dims` = (hidden, inter, top-k, ranks, local).
pub(crate) fn ensure_low_latency(gpu: &Gpu, m: usize, [h, i, k, n, local]: [usize; 5]) -> Result<()> {
    let what = format!("low-latency buffers for max_tokens_per_rank {m}");
    let rows = crate::memory::bytes(&[local, n, m], 1);
    if rows > i32::MAX as u128 {
        return Err(MoeError::Config(format!("{what}: {rows} expert rows exceed the kernels' 32-bit row indices")));
    }
    let messages = crate::memory::bytes(&[n, m, 4 * h + 3 * k + 8], 2);
    let experts = crate::memory::bytes(&[local, n, m, 2 * h + 3 * i], 2);
    ensure_device_memory(gpu, &what, messages + experts)
}

/// Whether a CUDA error (as `err` formats it) is the device running out of memory.
pub(crate) fn is_out_of_memory(debug: &str) -> bool {
    debug.contains("CUDA_ERROR_OUT_OF_MEMORY")
}
