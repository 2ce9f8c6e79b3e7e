//! Calls on device memory that do not wait ([`CudaMoeLayer::forward_device`] on a one-GPU layer
//! whose whole run reads nothing on the host: expert GEMMs that read the expert sizes on the
//! device). The run is enqueued between the caller's stream and the layer's own and the host
//! returns at once, so a CUDA graph capturing the caller's stream (`torch.cuda.graph`) takes the
//! layer in.
//!
//! What the host checks after a run that waits, non-finite inputs and outputs, is counted on
//! the device instead, into running records that a copy at the end of every run mirrors into
//! pinned host memory: the next call (once the earlier runs have finished; it never waits for
//! them) or [`CudaMoeLayer::synchronize_device`] (which waits, up to a deadline) reports it.
//! Device errors surface the same way, from the event queries. Non-finite input values are set
//! to 0 in the layer's copy of the input before routing (whose choices index memory), so such a
//! call computes something finite, which is not to be trusted and is reported.
//!
//! A captured graph points into the layer's scratch buffers: those buffers are kept for the
//! layer's life once captured (a larger batch later gets new ones beside them). Replays and
//! direct calls of one layer share them, so they must be ordered, as work on one stream is.

use super::{dptr, err, Buffers, CudaMoeLayer};
use crate::error::{MoeError, Result};
use cudarc::driver::{
    result, sys as drv, CudaEvent, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use std::time::{Duration, Instant};

/// The running records of non-finite values and what the host has reported of them.
pub(super) struct DeviceCalls {
    /// One call's `{count, first index}` of the input, then of the output (reset by the latch).
    call: CudaSlice<u64>,
    /// Running `{count, latest first index, its value's bits}` of inputs, then of outputs.
    records: CudaSlice<u64>,
    /// Pinned host copy of `records`, written by the copy that ends every run.
    mirror: PinnedHostSlice<u64>,
    /// `mirror`'s address (taken once: cudarc's accessors wait on an event of their own).
    mirror_at: usize,
    /// Counts of `records` already reported: inputs, outputs.
    reported: [u64; 2],
    /// Recorded on the caller's stream right before a direct run.
    ready: CudaEvent,
    /// Recorded on the layer's stream at the end of the latest direct run.
    done: CudaEvent,
    /// Whether `done` has been recorded.
    started: bool,
    /// Buffers that captured graphs point into, kept for the layer's life.
    kept: Vec<Buffers>,
    latch: CudaFunction,
}

// SAFETY: `mirror_at` is the address of `mirror`, owned here; it is read with volatile reads
// under the layer's mutex, and written only by the device.
unsafe impl Send for DeviceCalls {}

impl DeviceCalls {
    fn new(layer: &CudaMoeLayer) -> Result<Self> {
        let g = &layer.gpu;
        let s = &g.stream;
        let mut call = s.alloc_zeros::<u64>(4).map_err(|e| err("allocating the non-finite counts", e))?;
        s.memcpy_htod(&[0, u64::MAX, 0, u64::MAX], &mut call).map_err(|e| err("resetting the non-finite counts", e))?;
        let records = s.alloc_zeros::<u64>(6).map_err(|e| err("allocating the non-finite records", e))?;
        // SAFETY: six u64 of page-locked host memory, zeroed right below before any use.
        let mut mirror = unsafe { g.ctx.alloc_pinned_with_flags::<u64>(6, 0) }.map_err(|e| err("pinned memory", e))?;
        let at = mirror.as_mut_ptr().map_err(|e| err("pinned memory", e))?;
        // SAFETY: `at` points at the six u64 of `mirror`, which no copy writes yet.
        unsafe { std::ptr::write_bytes(at, 0, 6) };
        s.synchronize().map_err(|e| err("synchronize", e))?;
        let event = || g.ctx.new_event(None).map_err(|e| err("event", e));
        Ok(DeviceCalls {
            call,
            records,
            mirror,
            mirror_at: at as usize,
            reported: [0; 2],
            ready: event()?,
            done: event()?,
            started: false,
            kept: Vec::new(),
            latch: g.function("latch_nonfinite")?,
        })
    }

    /// Keeps `b` (which a captured graph points into) for the layer's life.
    pub(super) fn keep(&mut self, b: Buffers) {
        self.kept.push(b);
    }

    /// This call's `{count, first index}` of record `which` (0: inputs, 1: outputs), on the
    /// device.
    fn call_count(&self, layer: &CudaMoeLayer, which: usize) -> u64 {
        dptr(&self.call, &layer.gpu) + 16 * which as u64
    }

    /// Enqueues on `s` the move of this call's count of record `which` (0: inputs, see
    /// [`CudaMoeLayer::take_tokens`]; 1: outputs, see [`CudaMoeLayer::copy_output`]) into the
    /// running record, the first value read at `values` (f32, or bf16 with `bf16`).
    fn latch(&self, layer: &CudaMoeLayer, s: &CudaStream, values: u64, bf16: bool, which: usize) -> Result<()> {
        let (call, record) = (self.call_count(layer, which), dptr(&self.records, &layer.gpu) + 24 * which as u64);
        let (bf16, one) =
            (bf16 as i32, LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 });
        // SAFETY: latch_nonfinite(const void*, int, unsigned long long*, unsigned long long*)
        // reads this call's two counts and, where they found any, one value at `values` (of the
        // values counted, which are a layer buffer or the caller's input, read in stream order
        // before the caller's stream goes on), updates the three values of the record and
        // resets the counts. The counts and records live as long as the layer.
        unsafe { s.launch_builder(&self.latch).arg(&values).arg(&bf16).arg(&call).arg(&record).launch(one) }
            .map(|_| ())
            .map_err(|e| err("latch", e))
    }

    /// Enqueues the copy of the records into the pinned mirror on `s`.
    fn mirror(&self, layer: &CudaMoeLayer, s: &CudaStream) -> Result<()> {
        // SAFETY: `mirror_at` holds six u64 of pinned memory owned by `self` (kept as long as
        // the layer, which outlives its runs and graphs); the records hold six u64 too.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(self.mirror_at as *mut u64, self.mirror.len());
            result::memcpy_dtoh_async(dst, dptr(&self.records, &layer.gpu), s.cu_stream())
        }
        .map_err(|e| err("copying the non-finite records", e))
    }

    /// The error for non-finite values counted since the last report (none: `Ok`); reads the
    /// mirror, which the caller makes sure the device has written.
    fn report(&mut self, hidden: usize) -> Result<()> {
        // SAFETY: six u64 of pinned memory owned by `self`; the device may be writing them
        // (a graph's replay), hence volatile reads.
        let m: Vec<u64> =
            (0..6).map(|i| unsafe { std::ptr::read_volatile((self.mirror_at as *const u64).add(i)) }).collect();
        let hidden = hidden.max(1);
        if m[0] > self.reported[0] {
            // The outputs of calls on non-finite inputs are not reported on their own.
            self.reported = [m[0], m[3]];
            return Err(MoeError::NonFinite {
                what: "hidden_states (of an earlier call on device memory: its output is not to be trusted)".into(),
                index: m[1] as usize,
                value: f32::from_bits(m[2] as u32),
            });
        }
        if m[3] > self.reported[1] {
            let count = (m[3] - self.reported[1]) as usize;
            self.reported[1] = m[3];
            let first = m[4] as usize;
            return Err(MoeError::NonFiniteOutput {
                count,
                token: first / hidden,
                column: first % hidden,
                value: f32::from_bits(m[5] as u32),
            });
        }
        Ok(())
    }

    /// The errors of direct runs that have finished, without waiting for those still running.
    fn finished_errors(&mut self, hidden: usize) -> Result<()> {
        if !self.started || !self.done.try_is_complete().map_err(|e| err("an earlier call on the GPU", e))? {
            return Ok(());
        }
        self.report(hidden)
    }
}

/// Waits for `event` until `deadline`, polling (a device error comes back as it is).
fn wait_until(event: &CudaEvent, deadline: Instant, timeout: Duration, what: &str) -> Result<()> {
    let start = Instant::now();
    loop {
        if event.try_is_complete().map_err(|e| err(what, e))? {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(MoeError::Comm {
                rank: 0,
                op: what.to_string(),
                message: format!("the GPU's work did not finish within {:.1} s", timeout.as_secs_f64()),
            });
        }
        if start.elapsed() < Duration::from_millis(1) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

/// Whether `stream` is being captured into a CUDA graph (an invalidated capture counts).
fn capturing(stream: drv::CUstream) -> Result<bool> {
    // SAFETY: queries the capture status of the caller's stream, of this context.
    let status = unsafe { result::stream::is_capturing(stream) }.map_err(|e| err("capture status", e))?;
    Ok(status != drv::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

impl CudaMoeLayer {
    /// Why a batch of `t` tokens on this layer reads something on the host (it then waits, and
    /// cannot be captured into a CUDA graph); `None` when its whole run stays on the device.
    pub(super) fn host_read(&self, t: usize) -> Option<String> {
        let (e, k) = (self.config.num_experts, self.config.top_k);
        if self.ep.is_some() {
            return Some("an expert-parallel rank exchanges its expert counts through the host".into());
        }
        if self.w.fp8.is_some() || self.w8a8 {
            return Some("fp8 experts allocate their rows' codes on first use".into());
        }
        if self.hopper_for(t * k, e).is_none() {
            return Some(format!(
                "a batch of {t} tokens runs cuBLAS's expert GEMMs, whose shapes need the expert sizes on the host; \
                 the Hopper grouped GEMM (expert_gemm=hopper, compute capability 9.0) reads them on the device"
            ));
        }
        None
    }

    /// Whether `stream` (a raw `CUstream` of this layer's device) is being captured.
    pub(super) fn caller_capturing(&self, stream: u64) -> Result<bool> {
        capturing(stream as drv::CUstream)
    }

    /// [`CudaMoeLayer::forward_device`] where [`CudaMoeLayer::host_read`] is `None`: enqueued
    /// without waiting (see the module), or captured when the caller's stream is.
    /// With `bf16`, `x` and `out` hold bf16 values (see [`CudaMoeLayer::forward_device_bf16`]).
    pub(super) fn forward_device_enqueued(
        &self,
        x: u64,
        out: u64,
        t: usize,
        stream: u64,
        capture: bool,
        bf16: bool,
    ) -> Result<()> {
        let h = self.config.hidden;
        let g = &self.gpu;
        let s = &g.stream;
        let caller = stream as drv::CUstream;
        let warm_up = |what: &str| {
            MoeError::Unsupported(format!(
                "capturing a batch of {t} tokens into a CUDA graph before {what}: call the layer once on such a \
                 batch outside the capture first (the warm-up torch.cuda.graphs asks for)"
            ))
        };
        let mut guard = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
        let b = if capture {
            match guard.as_mut() {
                Some(b) if b.tokens >= t && b.graphs.has_blas_workspaces() => b,
                _ => return Err(warm_up("the layer has its buffers")),
            }
        } else {
            let b = self.buffers(&mut guard, t)?;
            self.set_blas_workspaces(b)?;
            b
        };
        b.batch = t;
        b.tokens_bf16 = false;
        let mut calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        if calls.is_none() {
            if capture {
                return Err(warm_up("the layer has run on device memory"));
            }
            *calls = Some(DeviceCalls::new(self)?);
        }
        let c = calls.as_mut().expect("made above");
        if !capture {
            c.finished_errors(h)?;
        }
        if t == 0 {
            return Ok(());
        }
        b.captured |= capture;
        let _no_blas_handle_changes = capture.then(super::super::blas_handle::capture_lock);
        // Events recorded in a capture belong to it and cannot be queried after: fresh ones.
        let event = || g.ctx.new_event(None).map_err(|e| err("event", e));
        let fresh = if capture { Some((event()?, event()?)) } else { None };
        let (ready, done) = match &fresh {
            Some((r, d)) => (r, d),
            None => (&c.ready, &c.done),
        };
        // SAFETY: records an event of this context on the caller's stream (same device).
        unsafe { result::event::record(ready.cu_event(), caller) }
            .map_err(|e| err("waiting for the caller's stream", e))?;
        s.wait(ready).map_err(|e| err("waiting for the caller's stream", e))?;
        let ran = self.enqueue_on_device(b, c, [x, out], t, capture, bf16);
        if ran.is_err() && capture {
            // Streams forked into the capture must join it again for it to end.
            let _ = self.side.join(s, self.side.all());
        }
        done.record(s).map_err(|e| err("event", e))?;
        // SAFETY: the caller's stream waits for an event of this context (same device).
        unsafe { result::stream::wait_event(caller, done.cu_event(), drv::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
            .map_err(|e| err("ordering the caller's stream", e))?;
        ran?;
        c.started |= !capture;
        Ok(())
    }

    /// The run itself, on the layer's stream: the copy in with its count, the layer (its own
    /// graph replayed where it takes one and the caller is not capturing), the copy out with its
    /// count, records mirrored. `[x, out]` are the caller's addresses, bf16 values with `bf16`.
    fn enqueue_on_device(
        &self,
        b: &mut Buffers,
        c: &DeviceCalls,
        [x, out]: [u64; 2],
        t: usize,
        capture: bool,
        bf16: bool,
    ) -> Result<()> {
        let g = &self.gpu;
        let s = &g.stream;
        // A direct run's router reads bf16 tokens as they are (a graph's reads the f32 rows).
        let bf16_rows = bf16 && self.routes_bf16_tokens(t);
        let widen = !bf16_rows || (!capture && self.takes_graph(t));
        self.take_tokens(b, x, t, bf16, widen, c.call_count(self, 0))?;
        c.latch(self, s, x, bf16, 0)?;
        if capture || !self.takes_graph(t) || !self.launch_graph(b, t)? {
            b.tokens_bf16 = bf16_rows;
            b.out_bf16 = bf16;
            self.enqueue(b, t, &|_| Ok(()))?;
        }
        let counted = !self.allow_nonfinite;
        self.copy_output(b, out, t, bf16, if counted { c.call_count(self, 1) } else { 0 })?;
        if counted {
            c.latch(self, s, dptr(&b.out, g), false, 1)?;
        }
        c.mirror(self, s)
    }

    /// Waits, up to `timeout`, for this layer's calls on device memory enqueued so far and for
    /// the work on the caller's `stream` (graph replays included), then reports the non-finite
    /// inputs or outputs they found (see the module). Refused while `stream` is captured.
    pub fn synchronize_device(&self, stream: u64, timeout: Duration) -> Result<()> {
        let g = &self.gpu;
        g.ctx.bind_to_thread().map_err(|e| err("binding context", e))?;
        if self.caller_capturing(stream)? {
            return Err(MoeError::Unsupported("synchronizing a layer inside a CUDA graph capture".into()));
        }
        let deadline = Instant::now() + timeout;
        let ev = || g.ctx.new_event(None).map_err(|e| err("event", e));
        let (caller, own) = (ev()?, ev()?);
        // SAFETY: records an event of this context on the caller's stream (same device).
        unsafe { result::event::record(caller.cu_event(), stream as drv::CUstream) }
            .map_err(|e| err("synchronize", e))?;
        own.record(&g.stream).map_err(|e| err("synchronize", e))?;
        wait_until(&caller, deadline, timeout, "synchronize")?;
        wait_until(&own, deadline, timeout, "synchronize")?;
        let mut calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        match calls.as_mut() {
            Some(c) => c.report(self.config.hidden),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::CudaMoeLayer;
    use crate::backend::cuda_options::{CudaOptions, ExpertGemm};
    use crate::config::{MoeConfig, SharedConfig};
    use crate::experts::Activation;
    use crate::router::RouterConfig;
    use crate::tensor::Tensor;
    use crate::{preset, DType, MoeError};
    use cudarc::driver::{sys as drv, CudaSlice, CudaStream, DevicePtr};
    use std::sync::Arc;
    use std::time::Duration;

    const H: usize = 128;

    fn config() -> MoeConfig {
        let shared = Some(SharedConfig { inter: 48, gated: true });
        preset::config(H, 64, 8, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, shared)
    }

    /// The layer on GPU 0 with `gemm`, or `None` (saying loudly that `name` skipped) without a
    /// GPU.
    fn layer(name: &str, gemm: ExpertGemm) -> Option<CudaMoeLayer> {
        if crate::backend::cuda::skip_without_gpu(name) {
            return None;
        }
        let config = config();
        let weights = preset::random_weights(&config, DType::BF16, 7);
        let opts = CudaOptions { expert_gemm: gemm, ..Default::default() };
        Some(CudaMoeLayer::new(&config, &weights, &opts).unwrap())
    }

    fn input(t: usize, seed: u64) -> Vec<f32> {
        preset::uniform(t * H, 1.0, seed)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// The bits `forward` (host in, host out) gives for `x`.
    fn host_bits(layer: &CudaMoeLayer, x: &[f32]) -> Vec<u32> {
        bits(&layer.forward(&Tensor::from_f32(&[x.len() / H, H], x.to_vec()).unwrap()).unwrap().to_f32_vec())
    }

    fn addr<T>(s: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
        s.device_ptr(stream).0
    }

    /// Calls on device memory that read nothing on the host return without waiting, and a
    /// graph captured from the caller's stream around one replays with new input values to the
    /// bits of direct calls, also after a larger batch has replaced the layer's buffers.
    /// Needs a Hopper GPU; says loudly when it skips.
    #[test]
    fn a_captured_call_replays_to_the_bits_of_direct_calls() {
        let name = "a_captured_call_replays_to_the_bits_of_direct_calls";
        crate::backend::cuda::gpu_alone();
        let Some(layer) = layer(name, ExpertGemm::Hopper) else { return };
        let t = 6;
        if let Some(why) = layer.host_read(t) {
            eprintln!("SKIPPED {name}: {why}");
            return;
        }
        let caller = layer.gpu.ctx.new_stream().unwrap();
        let raw = caller.cu_stream() as u64;
        let mut x = caller.clone_htod(&input(t, 1)).unwrap();
        let out = caller.alloc_zeros::<f32>(t * H).unwrap();
        let (xp, op) = (addr(&x, &caller), addr(&out, &caller));
        layer.forward_device(xp, op, t, raw).unwrap();
        layer.synchronize_device(raw, Duration::from_secs(20)).unwrap();
        assert_eq!(bits(&caller.clone_dtoh(&out).unwrap()), host_bits(&layer, &input(t, 1)), "a direct call");

        caller.begin_capture(drv::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
        let captured = layer.forward_device(xp, op, t, raw);
        let graph = caller.end_capture(drv::CUgraphInstantiate_flags(0)).unwrap().expect("a graph");
        captured.unwrap();
        for seed in [2, 3] {
            caller.memcpy_htod(&input(t, seed), &mut x).unwrap();
            graph.launch().unwrap();
            caller.synchronize().unwrap();
            assert_eq!(bits(&caller.clone_dtoh(&out).unwrap()), host_bits(&layer, &input(t, seed)), "replay {seed}");
        }
        // A larger batch replaces the buffers; the graph's stay.
        let big = caller.clone_htod(&input(4 * t, 9)).unwrap();
        let big_out = caller.alloc_zeros::<f32>(4 * t * H).unwrap();
        layer.forward_device(addr(&big, &caller), addr(&big_out, &caller), 4 * t, raw).unwrap();
        caller.memcpy_htod(&input(t, 4), &mut x).unwrap();
        graph.launch().unwrap();
        layer.synchronize_device(raw, Duration::from_secs(20)).unwrap();
        assert_eq!(bits(&caller.clone_dtoh(&out).unwrap()), host_bits(&layer, &input(t, 4)), "replay after growth");
        assert_eq!(bits(&caller.clone_dtoh(&big_out).unwrap()), host_bits(&layer, &input(4 * t, 9)), "larger batch");
        eprintln!("a captured call replays to the bits of direct calls");
    }

    /// A non-finite input of a call that did not wait is reported by `synchronize_device`
    /// (once), and a capture before any call outside one is refused with the warm-up it needs.
    /// Needs a Hopper GPU; says loudly when it skips.
    #[test]
    fn nonfinite_values_of_calls_that_did_not_wait_are_reported_later() {
        let name = "nonfinite_values_of_calls_that_did_not_wait_are_reported_later";
        crate::backend::cuda::gpu_alone();
        let Some(layer) = layer(name, ExpertGemm::Hopper) else { return };
        let t = 3;
        if let Some(why) = layer.host_read(t) {
            eprintln!("SKIPPED {name}: {why}");
            return;
        }
        let caller = layer.gpu.ctx.new_stream().unwrap();
        let raw = caller.cu_stream() as u64;
        let mut values = input(t, 5);
        values[H + 7] = f32::NAN;
        let x = caller.clone_htod(&values).unwrap();
        let out = caller.alloc_zeros::<f32>(t * H).unwrap();
        let (xp, op) = (addr(&x, &caller), addr(&out, &caller));

        caller.begin_capture(drv::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
        let refused = layer.forward_device(xp, op, t, raw);
        assert!(caller.end_capture(drv::CUgraphInstantiate_flags(0)).is_ok(), "the capture still ends");
        let e = refused.expect_err("a capture before any direct call");
        assert!(e.to_string().contains("outside the capture first"), "{e}");

        layer.forward_device(xp, op, t, raw).expect("the call does not wait to see its input");
        match layer.synchronize_device(raw, Duration::from_secs(20)) {
            Err(MoeError::NonFinite { index, .. }) => assert_eq!(index, H + 7),
            other => panic!("expected the non-finite input, got {other:?}"),
        }
        layer.synchronize_device(raw, Duration::from_secs(20)).expect("reported once");
        eprintln!("non-finite values of calls that did not wait are reported later");
    }

    /// A layer whose expert GEMMs read the expert sizes on the host refuses a capture with an
    /// error saying so, leaving the capture intact, and runs (waiting) outside one. Says loudly
    /// when it skips.
    #[test]
    fn a_layer_reading_the_host_refuses_a_capture() {
        let name = "a_layer_reading_the_host_refuses_a_capture";
        crate::backend::cuda::gpu_alone();
        let Some(layer) = layer(name, ExpertGemm::Cublas) else { return };
        let t = 4;
        assert!(layer.host_read(t).is_some(), "cuBLAS experts read the expert sizes on the host");
        let caller = layer.gpu.ctx.new_stream().unwrap();
        let raw = caller.cu_stream() as u64;
        let x = caller.clone_htod(&input(t, 8)).unwrap();
        let out = caller.alloc_zeros::<f32>(t * H).unwrap();
        let (xp, op) = (addr(&x, &caller), addr(&out, &caller));
        caller.begin_capture(drv::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
        let refused = layer.forward_device(xp, op, t, raw);
        assert!(caller.end_capture(drv::CUgraphInstantiate_flags(0)).is_ok(), "the capture still ends");
        let e = refused.expect_err("a capture of cuBLAS experts");
        assert!(e.to_string().contains("CUDA graph") && e.to_string().contains("cuBLAS"), "{e}");
        layer.forward_device(xp, op, t, raw).unwrap();
        caller.synchronize().unwrap();
        assert_eq!(bits(&caller.clone_dtoh(&out).unwrap()), host_bits(&layer, &input(t, 8)));
        eprintln!("a layer reading the host refuses a capture");
    }

    /// The layer of the bf16 tests: 64 experts of DeepSeek-V3's router (a gate of bf16 values)
    /// and a shared expert without a gate of its own (a gated one reads the f32 rows), with
    /// `gemm`'s expert GEMMs.
    fn bf16_layer(gemm: ExpertGemm) -> CudaMoeLayer {
        let router = RouterConfig::DEEPSEEK_V3;
        let shared = Some(SharedConfig { inter: 64, gated: false });
        let config = preset::config(256, 64, 64, 8, router, Activation::Silu, shared);
        let opts = CudaOptions { expert_gemm: gemm, ..Default::default() };
        CudaMoeLayer::random(&config, 3, &opts).unwrap()
    }

    /// `n` random bf16 values (seeded), as bits.
    fn bf16_values(n: usize, seed: u64) -> Vec<u16> {
        preset::uniform(n, 1.0, seed).iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect()
    }

    /// The f32 call's output on the values of `values` (bf16 bits, `t` tokens).
    fn f32_call(layer: &CudaMoeLayer, caller: &Arc<CudaStream>, values: &[u16], t: usize) -> Vec<f32> {
        let (raw, h) = (caller.cu_stream() as u64, layer.config.hidden);
        let widened: Vec<f32> = values.iter().map(|&v| half::bf16::from_bits(v).to_f32()).collect();
        let (x32, out32) = (caller.clone_htod(&widened).unwrap(), caller.alloc_zeros::<f32>(t * h).unwrap());
        layer.forward_device(addr(&x32, caller), addr(&out32, caller), t, raw).unwrap();
        layer.synchronize_device(raw, Duration::from_secs(20)).unwrap();
        let out = caller.clone_dtoh(&out32).unwrap();
        assert!(out.iter().any(|&v| v != 0.0), "{t} tokens: the f32 call wrote its output");
        out
    }

    /// [`f32_call`]'s output rounded to the nearest bf16.
    fn rounded_f32_call(layer: &CudaMoeLayer, caller: &Arc<CudaStream>, values: &[u16], t: usize) -> Vec<u16> {
        f32_call(layer, caller, values, t).iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect()
    }

    /// bf16 hidden states through `forward_device_bf16` give the bf16 rounding of the f32 call's
    /// output on the same values, bit for bit: a small batch (its graph, or the fused route), a
    /// middle one, and a large one whose router reads the bf16 rows as they are (on Hopper, where
    /// the layer says so), also within a caller's capture; on a layer whose run stays on the
    /// device and on one whose cuBLAS experts read the host (the call that waits). Needs a GPU;
    /// says loudly when it skips.
    #[test]
    fn bf16_hidden_states_give_the_rounded_bits_of_f32_ones() {
        let name = "bf16_hidden_states_give_the_rounded_bits_of_f32_ones";
        crate::backend::cuda::gpu_alone();
        if crate::backend::cuda::skip_without_gpu(name) {
            return;
        }
        for gemm in [ExpertGemm::Auto, ExpertGemm::Cublas] {
            let layer = bf16_layer(gemm);
            let h = layer.config.hidden;
            let caller = layer.gpu.ctx.new_stream().unwrap();
            let raw = caller.cu_stream() as u64;
            let big = 1000;
            let direct = layer.routes_bf16_tokens(big) && !layer.takes_graph(big);
            assert_eq!(
                direct,
                layer.k.router_tf32_sm90.is_some(),
                "{big} tokens: the router reads bf16 rows on Hopper"
            );
            for (t, seed) in [(3usize, 1u64), (40, 2), (big, 3)] {
                let values = bf16_values(t * h, seed);
                let x16 = caller.clone_htod(&values).unwrap();
                let mut out16 = caller.alloc_zeros::<u16>(t * h).unwrap();
                // The bf16 call into a zeroed output, directly or from a captured graph.
                let mut run = |capture: bool| {
                    caller.memset_zeros(&mut out16).unwrap();
                    if capture {
                        caller.begin_capture(drv::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
                    }
                    let ran = layer.forward_device_bf16(addr(&x16, &caller), addr(&out16, &caller), t, raw);
                    if capture {
                        let graph = caller.end_capture(drv::CUgraphInstantiate_flags(0)).unwrap().expect("a graph");
                        ran.unwrap();
                        graph.launch().unwrap();
                    } else {
                        ran.unwrap();
                    }
                    layer.synchronize_device(raw, Duration::from_secs(20)).unwrap();
                    caller.clone_dtoh(&out16).unwrap()
                };
                let want = rounded_f32_call(&layer, &caller, &values, t);
                let got = run(false);
                if let Some(i) = (0..t * h).find(|&i| got[i] != want[i]) {
                    panic!(
                        "{gemm:?}, {t} tokens: output {i} is {:#06x} from bf16 hidden states, {:#06x} rounded from f32",
                        got[i], want[i]
                    );
                }
                // Within the caller's capture too, where the layer runs on device memory alone.
                let waits = layer.host_read(t).is_some();
                if !waits {
                    assert!(run(true) == want, "{t} tokens: a captured bf16 call gives the same bits");
                }
                let how = if waits { "waiting" } else { "enqueued" };
                eprintln!("{name}: {gemm:?}, {t} tokens ({how}): the bf16 call's outputs are the f32 call's rounded");
            }
        }
    }

    /// NaN and infinities among hidden states, bf16 or f32: a call that waits refuses them
    /// naming the first, before the run; a call that does not wait computes on them as zeros
    /// (the output is the call's on the values with zeros there) and the next synchronization
    /// reports the first, once. Whichever router reads the tokens (a small batch's reads the
    /// f32 rows, a large one's on Hopper the bf16 rows). Needs a GPU; says loudly when it skips.
    #[test]
    fn nonfinite_hidden_states_are_zeroed_and_reported() {
        let name = "nonfinite_hidden_states_are_zeroed_and_reported";
        if crate::backend::cuda::skip_without_gpu(name) {
            return;
        }
        // bf16 values as the f32 bits of their widening.
        let widen = |v: &[u16]| v.iter().map(|&b| (b as u32) << 16).collect::<Vec<u32>>();
        for gemm in [ExpertGemm::Auto, ExpertGemm::Cublas] {
            let layer = bf16_layer(gemm);
            let h = layer.config.hidden;
            let caller = layer.gpu.ctx.new_stream().unwrap();
            let raw = caller.cu_stream() as u64;
            for ((t, seed), bf16) in [(3usize, 4u64), (1000, 5)].into_iter().flat_map(|c| [(c, true), (c, false)]) {
                let mut values = bf16_values(t * h, seed);
                // A NaN in token 1 and a negative infinity in token 2.
                let (nan, inf) = (h + 37, 2 * h + 200);
                values[nan] = 0x7fc1;
                values[inf] = 0xff80;
                // The call, and its output as f32 bits.
                let (called, out) = if bf16 {
                    let (x16, out16) = (caller.clone_htod(&values).unwrap(), caller.alloc_zeros::<u16>(t * h).unwrap());
                    let called = layer.forward_device_bf16(addr(&x16, &caller), addr(&out16, &caller), t, raw);
                    (called, widen(&caller.clone_dtoh(&out16).unwrap()))
                } else {
                    let x = caller.clone_htod(&widen(&values).iter().map(|&b| f32::from_bits(b)).collect::<Vec<_>>());
                    let (x32, out32) = (x.unwrap(), caller.alloc_zeros::<f32>(t * h).unwrap());
                    let called = layer.forward_device(addr(&x32, &caller), addr(&out32, &caller), t, raw);
                    (called, bits(&caller.clone_dtoh(&out32).unwrap()))
                };
                let label = format!("{gemm:?}, {t} tokens, {}", if bf16 { "bf16" } else { "f32" });
                let reported = match layer.host_read(t) {
                    Some(_) => called,
                    None => {
                        called.expect("the call does not wait to see its input");
                        let reported = layer.synchronize_device(raw, Duration::from_secs(20));
                        let mut zeroed = values.clone();
                        (zeroed[nan], zeroed[inf]) = (0, 0);
                        let want = match bf16 {
                            true => widen(&rounded_f32_call(&layer, &caller, &zeroed, t)),
                            false => bits(&f32_call(&layer, &caller, &zeroed, t)),
                        };
                        assert!(out == want, "{label}: computed on zeros");
                        layer.synchronize_device(raw, Duration::from_secs(20)).expect("reported once");
                        reported
                    }
                };
                match reported {
                    Err(MoeError::NonFinite { index, value, .. }) => {
                        assert_eq!(index, nan, "{label}: the first non-finite value");
                        assert!(value.is_nan(), "{label}: {value} reported for a NaN");
                    }
                    other => panic!("{label}: expected the NaN input, got {other:?}"),
                }
                eprintln!("{name}: {label}: the NaN at {nan} is reported");
            }
        }
    }
}
