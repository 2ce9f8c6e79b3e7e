//! Expert load statistics of the device-resident layer: a counting kernel
//! (`kernels/load_stats.cu`) enqueued right after routing writes each call's tokens per logical
//! expert into a device ring of the last calls; the host reads it only when asked
//! ([`CudaMoeLayer::load_stats`]), so a forward call never waits for it.

use super::{err, CudaMoeLayer, Gpu};
use crate::error::{MoeError, Result};
use crate::load_stats::LoadStats;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use std::sync::Arc;

/// The device ring of one layer's load counts.
pub struct DeviceLoadStats {
    /// `[window, E]` counts; row `c mod window` holds call `c`.
    rows: CudaSlice<u32>,
    /// Calls counted so far (one value, advanced by the kernel).
    calls: CudaSlice<u64>,
    count: CudaFunction,
    /// The stream the counts are written on, to read them after.
    stream: Arc<CudaStream>,
    num_experts: usize,
    window: usize,
}

impl DeviceLoadStats {
    /// A zeroed ring of [`crate::load_stats::DEFAULT_WINDOW`] calls over `num_experts` experts
    /// on `gpu`.
    pub fn new(gpu: &Gpu, num_experts: usize) -> Result<Self> {
        let window = crate::load_stats::DEFAULT_WINDOW;
        if num_experts == 0 || num_experts > 1 << 12 {
            return Err(MoeError::Unsupported(format!("load statistics of {num_experts} experts on the GPU")));
        }
        let s = &gpu.stream;
        Ok(DeviceLoadStats {
            rows: s.alloc_zeros::<u32>(window * num_experts).map_err(|e| err("load statistics ring", e))?,
            calls: s.alloc_zeros::<u64>(1).map_err(|e| err("load statistics counter", e))?,
            count: gpu.function("count_expert_load")?,
            stream: gpu.stream.clone(),
            num_experts,
            window,
        })
    }

    /// Enqueues the count of one call's `n` logical ids at device address `ids` on `stream`:
    /// the layer's, or a side stream that the layer's joins within the call (the counts are
    /// read on the layer's stream). `n` may be 0: the call is counted with no tokens. With
    /// `live` (a device int, the batch size of a low-latency layer, whose routing covers its
    /// whole capacity) only the first `live · k` ids count.
    pub fn record(&self, stream: &CudaStream, ids: u64, n: usize, live: Option<(u64, usize)>) -> Result<()> {
        let (ni, ei, wi) = (n as i32, self.num_experts as i32, self.window as i32);
        let (live_ptr, ki) = live.map_or((0u64, 0i32), |(p, k)| (p, k as i32));
        let (rows, calls) = (dptr(&self.rows, &self.stream), dptr(&self.calls, &self.stream));
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: (4 * self.num_experts) as u32,
        };
        // SAFETY: count_expert_load(int*, int, int*, int, int, unsigned*, int, unsigned long
        // long*) reads n ids at `ids` (a buffer of the layer's top-k, sized for the batch) and
        // the live batch size when given, writes one row of `rows` ([window, E]) and the
        // counter; E ≤ 4096 bins fit the shared memory asked for.
        unsafe {
            stream
                .launch_builder(&self.count)
                .arg(&ids)
                .arg(&ni)
                .arg(&live_ptr)
                .arg(&ki)
                .arg(&ei)
                .arg(&rows)
                .arg(&wi)
                .arg(&calls)
                .launch(cfg)
        }
        .map(|_| ())
        .map_err(|e| err("count_expert_load", e))
    }

    /// For a kernel that counts its call itself (the fused router), writing the ring as
    /// `count_expert_load` does: the device addresses of the `[window, E]` rows and of the call
    /// counter, and the window.
    pub fn ring(&self) -> (u64, u64, usize) {
        (dptr(&self.rows, &self.stream), dptr(&self.calls, &self.stream), self.window)
    }

    /// The window as [`LoadStats`] (waits for the stream's work so far).
    pub fn read(&self) -> Result<LoadStats> {
        let s = &self.stream;
        let rows = s.clone_dtoh(&self.rows).map_err(|e| err("reading load statistics", e))?;
        let seen = s.clone_dtoh(&self.calls).map_err(|e| err("reading load statistics", e))?[0];
        let mut stats = LoadStats::new(self.num_experts, self.window);
        let kept = seen.min(self.window as u64);
        for c in seen - kept..seen {
            let r = (c % self.window as u64) as usize;
            stats.push(rows[r * self.num_experts..(r + 1) * self.num_experts].iter().map(|&v| v as u64).collect());
        }
        stats.calls_seen = seen;
        Ok(stats)
    }
}

/// The raw device address of `s` (event tracking is off, so the guard has nothing to do).
fn dptr<T>(s: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    let (p, _guard) = s.device_ptr(stream);
    p
}

impl CudaMoeLayer {
    /// Tokens per logical expert of this rank's last forward calls (routed here, wherever their
    /// experts run), read from the device window; waits for the layer's queued work.
    pub fn load_stats(&self) -> Result<LoadStats> {
        self.load.read()
    }
}
