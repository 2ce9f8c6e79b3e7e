//! CUDA graphs of the layer: the low-latency layer's (see [`super::low_latency`]) and, on one
//! GPU, small batches replayed from a graph per batch size, so the dozen small kernels of
//! routing, permute and combine start back to back instead of one host launch apart.
//!
//! A one-GPU batch takes a graph when the whole layer runs on the device without a host wait:
//! at most [`GRAPH_TOKENS`] tokens, expert GEMMs on the Hopper GEMM (which reads the expert
//! counts on the device) with bf16 experts, or W8A8 experts on the fp8 Hopper GEMM.
//! [`super::CudaOptions::cuda_graphs`] turns it off.

use super::{dptr, err, Buffers, CudaMoeLayer, GpuStageTimes, Ran};
use crate::error::Result;
use cudarc::cublas::{sys as cb, CudaBlas};
use cudarc::driver::{sys as drv, CudaEvent, CudaGraph, CudaSlice, PushKernelArg};

/// cuBLAS workspace per handle, set before capture so no GEMM allocates inside a graph.
pub(super) const BLAS_WORKSPACE: usize = 32 << 20;

/// Most tokens of a one-GPU batch replayed from a graph: above it the launches a graph saves
/// are no longer a visible share of the layer (docs/tuning.md).
pub(super) const GRAPH_TOKENS: usize = 512;

/// Graphs kept per layer (one per batch size; the oldest goes first).
const GRAPHS_KEPT: usize = 16;

/// Captures a layer tries per batch size before that size runs directly for good.
const CAPTURE_TRIES: usize = 3;

/// Held while a one-GPU layer captures, so those captures in one process do not overlap.
static CAPTURING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A captured layer. CUDA graphs are not synchronised internally; these are only touched
/// under the layer's buffer lock.
pub(super) struct LayerGraph(pub(super) CudaGraph);

// SAFETY: a graph is used from one thread at a time (under the layer's buffer mutex), which
// is all CUDA asks of graph objects.
unsafe impl Send for LayerGraph {}

impl LayerGraph {
    /// Launches the graph on `gpu`'s stream; with `timed`, between two events recorded there,
    /// returned for [`elapsed_ms`] once the stream has passed them.
    pub(super) fn launch(&self, gpu: &super::Gpu, timed: bool) -> Result<Option<(CudaEvent, CudaEvent)>> {
        let s = &gpu.stream;
        let events = if timed {
            let ev = || gpu.ctx.new_event(Some(drv::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| err("event", e));
            Some((ev()?, ev()?))
        } else {
            None
        };
        if let Some((start, _)) = &events {
            start.record(s).map_err(|e| err("event", e))?;
        }
        self.0.launch().map_err(|e| err("graph launch", e))?;
        if let Some((_, stop)) = &events {
            stop.record(s).map_err(|e| err("event", e))?;
        }
        Ok(events)
    }
}

/// Milliseconds between the two events of a timed [`LayerGraph::launch`].
pub(super) fn elapsed_ms((start, stop): &(CudaEvent, CudaEvent)) -> Result<f64> {
    Ok(start.elapsed_ms(stop).map_err(|e| err("event time", e))? as f64)
}

/// Workspaces of `BLAS_WORKSPACE` bytes for `handles`, set on them. The caller keeps them
/// alive as long as the handles run GEMMs.
pub(super) fn blas_workspaces(layer: &CudaMoeLayer, handles: &[&CudaBlas]) -> Result<Vec<CudaSlice<u8>>> {
    let s = &layer.gpu.stream;
    let mut out = Vec::new();
    for blas in handles {
        let ws = s.alloc_zeros::<u8>(BLAS_WORKSPACE).map_err(|e| err("allocating workspace", e))?;
        // SAFETY: the workspace is device memory of BLAS_WORKSPACE bytes, which the caller
        // keeps as long as the handle runs GEMMs (the layer drops its handles, fields `side`
        // and `blas`, before its buffers).
        let st = unsafe { cb::cublasSetWorkspace_v2(*blas.handle(), dptr(&ws, &layer.gpu) as _, BLAS_WORKSPACE) };
        super::check(st, "cuBLAS workspace")?;
        out.push(ws);
    }
    Ok(out)
}

/// A one-GPU layer's graphs: one per batch size, and the cuBLAS workspaces they need.
#[derive(Default)]
pub(super) struct LocalGraphs {
    graphs: Vec<(usize, LayerGraph)>,
    /// Failed captures per batch size.
    failures: Vec<(usize, usize)>,
    /// Failed captures in all, over the layer's life.
    failed: usize,
    /// Why the latest failed capture failed.
    last_failure: Option<String>,
    workspaces: Vec<CudaSlice<u8>>,
    /// Where the layer's fp8 row buffers were when the graphs were captured: the graphs of a
    /// W8A8 layer point into them, so they go when the buffers move.
    fp8_rows_at: [[u64; 2]; 3],
    /// Captures still to spoil on purpose (tests of the fallback).
    #[cfg(test)]
    spoil: usize,
}

impl LocalGraphs {
    /// The workspaces and the count of failed captures, kept when the buffers are replaced
    /// (the handles still point at the workspaces); the graphs, which point into the old
    /// buffers, are dropped.
    pub(super) fn carried_over(self) -> Self {
        LocalGraphs {
            failed: self.failed,
            last_failure: self.last_failure,
            workspaces: self.workspaces,
            ..Self::default()
        }
    }

    /// Whether the layer's cuBLAS handles have their workspaces here.
    pub(super) fn has_blas_workspaces(&self) -> bool {
        !self.workspaces.is_empty()
    }

    /// Whether the capture about to start is to be spoilt on purpose (tests of the fallback
    /// only); counts such captures down.
    fn spoils_this_capture(&mut self) -> bool {
        #[cfg(test)]
        if self.spoil > 0 {
            self.spoil -= 1;
            return true;
        }
        false
    }
}

impl CudaMoeLayer {
    /// Whether a batch of `t` tokens on this one-GPU layer is replayed from a CUDA graph (see
    /// the module); then [`CudaMoeLayer::forward_timed`] times only the whole.
    pub fn replays_graph(&self, t: usize) -> bool {
        self.takes_graph(t)
    }

    /// How many captures of this one-GPU layer's graphs have failed, so far; each such call ran
    /// the layer launch by launch instead (see [`CudaMoeLayer::forward`]).
    pub fn failed_graph_captures(&self) -> usize {
        let guard = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
        guard.as_ref().map_or(0, |b| b.graphs.failed)
    }

    /// Why the latest failed capture of this layer's graphs failed, if one has.
    pub fn last_graph_capture_failure(&self) -> Option<String> {
        let guard = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
        guard.as_ref().and_then(|b| b.graphs.last_failure.clone())
    }

    /// Whether a batch of `t` tokens on this layer is replayed from a graph (see the module).
    pub(super) fn takes_graph(&self, t: usize) -> bool {
        let (e, k) = (self.config.num_experts, self.config.top_k);
        self.ep.is_none()
            && (1..=GRAPH_TOKENS).contains(&t)
            && (self.hopper_fp8_runs() || (self.w.fp8.is_none() && !self.w8a8 && self.hopper_for(t * k, e).is_some()))
            && self.opts.cuda_graphs
            && self.strategy.captures()
    }

    /// Runs the layer on the `t` tokens in `b.x` (into `b.out`) from its graph for `t` tokens,
    /// capturing it first (after one direct run, which loads the modules and lets cuBLAS pick
    /// its kernels), and waits. With `timed`, only the total is measured (events around the
    /// replay), with the experts used.
    ///
    /// A capture can fail through no fault of the layer: another thread's CUDA work (a module
    /// loaded on first use, an allocation that synchronises) invalidates captures under way.
    /// Then this call runs the layer directly, and a later call of the same size tries again,
    /// up to [`CAPTURE_TRIES`] times. Captures are serialised within the process.
    pub(super) fn graph_run(&self, b: &mut Buffers, t: usize, timed: bool) -> Result<GpuStageTimes> {
        self.drop_moved_graphs(b);
        if !b.graphs.graphs.iter().any(|(n, _)| *n == t) && !self.capture(b, t)? {
            return self.run(b, t, timed);
        }
        let graph = &b.graphs.graphs.iter().find(|(n, _)| *n == t).expect("captured").1;
        let events = graph.launch(&self.gpu, timed)?;
        self.gpu.stream.synchronize().map_err(|e| err("synchronize", e))?;
        let Some(events) = events else { return Ok(GpuStageTimes::default()) };
        Ok(GpuStageTimes {
            total: elapsed_ms(&events)?,
            experts_used: self.experts_used(b)?,
            ..GpuStageTimes::default()
        })
    }

    /// Gives the layer's cuBLAS handles their workspaces in `b`, once, so that no GEMM
    /// allocates inside a capture.
    pub(super) fn set_blas_workspaces(&self, b: &mut Buffers) -> Result<()> {
        if b.graphs.workspaces.is_empty() {
            b.graphs.workspaces = blas_workspaces(self, &[&self.blas, &self.side.shared().blas])?;
        }
        Ok(())
    }

    /// Drops `b`'s graphs when the layer's fp8 row buffers have moved (grown for a larger
    /// batch) since they were captured.
    fn drop_moved_graphs(&self, b: &mut Buffers) {
        let at = self.fp8_rows_at();
        if b.graphs.fp8_rows_at != at {
            b.graphs.graphs.clear();
            b.graphs.fp8_rows_at = at;
        }
    }

    /// Launches the layer's graph for `t` tokens on its stream without waiting for it,
    /// capturing it first (which waits, see [`CudaMoeLayer::graph_run`]); `false` when the
    /// capture failed and nothing was launched.
    pub(super) fn launch_graph(&self, b: &mut Buffers, t: usize) -> Result<bool> {
        self.drop_moved_graphs(b);
        if !b.graphs.graphs.iter().any(|(n, _)| *n == t) && !self.capture(b, t)? {
            return Ok(false);
        }
        let graph = &b.graphs.graphs.iter().find(|(n, _)| *n == t).expect("captured").1;
        graph.launch(&self.gpu, false)?;
        Ok(true)
    }

    /// The layer on the `rows` rows of `b` (`enqueue`'s), captured from its stream into a graph,
    /// and what its run does. With `stamps`, the graph writes the GPU's clock at every stage
    /// boundary n (0..=9, as the layer's events mark them) to the u64 at `stamps + 8 n`, and an
    /// expert-parallel layer over NVLink first waits at a barrier of its ranks on the device,
    /// so that a stage does not count a peer's later start.
    pub(super) fn capture_layer(&self, b: &mut Buffers, rows: usize, stamps: Option<u64>) -> Result<(LayerGraph, Ran)> {
        let s = &self.gpu.stream;
        let _no_blas_handle_changes = super::super::blas_handle::capture_lock();
        let spoil = b.graphs.spoils_this_capture();
        s.begin_capture(drv::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| err("begin capture", e))?;
        // A spoilt capture synchronises its stream after the up projection, with the shared
        // expert's side stream forked: CUDA forbids that during a capture and invalidates it.
        let enqueued = self.enqueue(b, rows, &|stage| {
            if spoil && stage == 4 {
                let _ = s.synchronize();
            }
            if let Some(at) = stamps {
                if let (0, Some(link)) = (stage, self.ep.as_ref()) {
                    self.device_barrier(link)?;
                }
                let at = at + 8 * stage as u64;
                let one =
                    cudarc::driver::LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
                // SAFETY: stamp_clock(u64*) writes one u64 at `at`, inside the caller's
                // buffer of ten.
                unsafe { s.launch_builder(&self.k.stamp_clock).arg(&at).launch(one) }.map_err(|e| err("stamp", e))?;
            }
            Ok(())
        });
        if enqueued.is_err() {
            // A launch that failed (an invalidated capture) left the side streams forked into
            // the capture: joined back, they leave it when it ends.
            let _ = self.side.join(s, self.side.all());
        }
        let captured = s.end_capture(drv::CUgraphInstantiate_flags_enum(0));
        let ran = enqueued?;
        let graph = captured.map_err(|e| err("end capture", e))?.ok_or_else(|| err("end capture", "empty graph"))?;
        Ok((LayerGraph(graph), ran))
    }

    /// Captures the layer for `t` tokens into `b`'s graphs; `false` when the capture failed
    /// (see [`CudaMoeLayer::graph_run`]) or has failed too often for this size.
    fn capture(&self, b: &mut Buffers, t: usize) -> Result<bool> {
        let failed = b.graphs.failures.iter().find(|(n, _)| *n == t).map_or(0, |&(_, f)| f);
        if failed >= CAPTURE_TRIES {
            return Ok(false);
        }
        self.set_blas_workspaces(b)?;
        self.warm_up(b, t)?;
        // The direct run may have grown the fp8 row buffers.
        self.drop_moved_graphs(b);
        let _one_at_a_time = CAPTURING.lock().unwrap_or_else(|p| p.into_inner());
        match self.capture_layer(b, t, None) {
            Ok((graph, _)) => {
                if b.graphs.graphs.len() == GRAPHS_KEPT {
                    b.graphs.graphs.remove(0);
                }
                b.graphs.graphs.push((t, graph));
                Ok(true)
            }
            Err(why) => {
                b.graphs.last_failure = Some(why.to_string());
                // Calls made during the invalidated capture may have recorded its error in
                // cudarc's error slot of the context, which the next call on any thread would
                // return: the failure is handled here, so it is taken out (other errors stay).
                if let Err(e) = self.gpu.ctx.check_err() {
                    if e.0 != drv::cudaError_enum::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED {
                        self.gpu.ctx.record_err::<()>(Err(e));
                    }
                }
                // Whatever the capture left behind, the stream must be usable again.
                let s = &self.gpu.stream;
                s.synchronize().map_err(|e| err("synchronize after a failed capture", e))?;
                b.graphs.failures.retain(|(n, _)| *n != t);
                b.graphs.failures.push((t, failed + 1));
                b.graphs.failed += 1;
                Ok(false)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{no_hook, CudaMoeLayer};
    use crate::config::{MoeConfig, SharedConfig};
    use crate::experts::Activation;
    use crate::router::RouterConfig;
    use crate::tensor::Tensor;
    use crate::{preset, DType};

    /// A small layer: softmax router, SiLU experts.
    fn small_layer(
        hidden: usize,
        inter: usize,
        experts: usize,
        top_k: usize,
        shared: Option<SharedConfig>,
    ) -> MoeConfig {
        preset::config(
            hidden,
            inter,
            experts,
            top_k,
            RouterConfig::Softmax { renormalize: true },
            Activation::Silu,
            shared,
        )
    }

    /// The layer of `config` on GPU 0 when it replays a graph for every batch size in `sizes`;
    /// `None`, saying loudly that test `name` skipped, without a GPU or where they take none.
    fn layer_taking_graphs(
        name: &str,
        config: &MoeConfig,
        weights: &crate::MoeWeights,
        sizes: &[usize],
    ) -> Option<CudaMoeLayer> {
        if crate::backend::cuda::skip_without_gpu(name) {
            return None;
        }
        let layer = CudaMoeLayer::new(config, weights, &Default::default()).unwrap();
        if !sizes.iter().all(|&t| layer.takes_graph(t)) {
            eprintln!("SKIPPED {name}: these batches take no graph here (not a Hopper GPU, or graphs turned off)");
            return None;
        }
        Some(layer)
    }

    /// The bits of an output's values, for exact comparisons.
    fn bits(out: Tensor) -> Vec<u32> {
        out.to_f32_vec().iter().map(|x| x.to_bits()).collect()
    }

    /// Layers capturing and replaying on several threads at once (another thread's CUDA work
    /// can invalidate a capture, and the call then runs directly) give every batch the bits it
    /// gets alone, and no call fails. Needs a Hopper GPU; says loudly when it skips.
    #[test]
    fn concurrent_layers_match_their_runs_alone() {
        let config = small_layer(256, 64, 16, 4, None);
        let weights = preset::random_weights(&config, DType::BF16, 40);
        let sizes = [1usize, 5, 1, 9, 5, 2];
        let inputs: Vec<Tensor> = sizes
            .iter()
            .enumerate()
            .map(|(i, &t)| Tensor::from_f32(&[t, 256], preset::uniform(t * 256, 1.0, 50 + i as u64)).unwrap())
            .collect();
        let name = "concurrent_layers_match_their_runs_alone";
        crate::backend::cuda::gpu_alone();
        let Some(alone) = layer_taking_graphs(name, &config, &weights, &sizes) else { return };
        let want: Vec<Vec<u32>> =
            inputs.iter().map(|x| bits(alone.forward_hooked(x, &no_hook, false).unwrap())).collect();
        std::thread::scope(|scope| {
            for thread in 0..4 {
                let (config, weights, inputs, want) = (&config, &weights, &inputs, &want);
                scope.spawn(move || {
                    let layer = CudaMoeLayer::new(config, weights, &Default::default()).unwrap();
                    for round in 0..3 {
                        for (i, x) in inputs.iter().enumerate() {
                            assert!(
                                bits(layer.forward(x).unwrap()) == want[i],
                                "thread {thread} round {round} batch {i}: differs from the run alone"
                            );
                        }
                    }
                });
            }
        });
        eprintln!("concurrent layers match their runs alone");
    }

    /// A capture that fails (spoilt on purpose by a stream synchronisation in the middle of
    /// it, once the shared expert's side stream has forked into it) leaves that call to run
    /// launch by launch with the same bits and every stream usable, and is counted; the next
    /// call of that size captures again and replays, and so do other sizes after it. Needs a
    /// Hopper GPU; says loudly when it skips.
    #[test]
    fn a_failed_capture_runs_directly_and_is_tried_again() {
        let name = "a_failed_capture_runs_directly_and_is_tried_again";
        crate::backend::cuda::gpu_alone();
        let config = small_layer(128, 64, 8, 2, Some(SharedConfig { inter: 48, gated: true }));
        let weights = preset::random_weights(&config, DType::BF16, 22);
        let t = 16;
        let Some(layer) = layer_taking_graphs(name, &config, &weights, &[t]) else { return };
        let x = Tensor::from_f32(&[t, 128], preset::uniform(t * 128, 1.0, 31)).unwrap();
        let direct = bits(layer.forward_hooked(&x, &no_hook, false).unwrap());
        {
            let mut guard = layer.bufs.lock().unwrap();
            guard.as_mut().expect("buffers after a run").graphs.spoil = 1;
        }
        let graphed = |layer: &CudaMoeLayer| {
            let guard = layer.bufs.lock().unwrap();
            guard.as_ref().is_some_and(|b| b.graphs.graphs.iter().any(|(n, _)| *n == t))
        };
        assert_eq!(bits(layer.forward(&x).unwrap()), direct, "the call whose capture failed");
        assert_eq!(layer.failed_graph_captures(), 1, "the failed capture is counted");
        let left = layer.gpu.ctx.check_err();
        assert!(left.is_ok(), "the failed capture left {left:?} for the next call on the context");
        assert!(!graphed(&layer), "no graph kept from the failed capture");
        assert_eq!(bits(layer.forward_hooked(&x, &no_hook, false).unwrap()), direct, "a direct run after it");
        assert_eq!(bits(layer.forward(&x).unwrap()), direct, "the call that captures again");
        assert!(graphed(&layer), "the second capture is kept");
        assert_eq!(bits(layer.forward(&x).unwrap()), direct, "a replay");
        for (i, u) in [3usize, 40, 9].into_iter().enumerate() {
            let x = Tensor::from_f32(&[u, 128], preset::uniform(u * 128, 1.0, 32 + i as u64)).unwrap();
            let direct = bits(layer.forward_hooked(&x, &no_hook, false).unwrap());
            assert_eq!(bits(layer.forward(&x).unwrap()), direct, "batch {u}: the call that captures");
            assert_eq!(bits(layer.forward(&x).unwrap()), direct, "batch {u}: a replay");
        }
        let why = layer.last_graph_capture_failure();
        assert_eq!(layer.failed_graph_captures(), 1, "one failure in all; the latest: {why:?}");
        assert!(why.is_some(), "the spoilt capture's failure is kept");
        eprintln!("a failed capture runs directly and is tried again");
    }

    /// Small batches replayed from their graphs give the bits of the same batches run launch by
    /// launch, batch sizes interleaved (each its own graph), with and without a shared expert
    /// (captured on its side stream). Needs a Hopper GPU; says loudly when it skips.
    #[test]
    fn replays_match_direct_runs_bit_for_bit() {
        let name = "replays_match_direct_runs_bit_for_bit";
        let shared = Some(SharedConfig { inter: 48, gated: true });
        // (experts, top-k, shared expert, batch sizes)
        let cases = [(16, 4, None, vec![1, 3, 1, 40, 3, 500]), (8, 2, shared, vec![16, 9, 16, 300])];
        for (e, k, shared, sizes) in cases {
            let config = small_layer(128, 64, e, k, shared);
            let weights = preset::random_weights(&config, DType::BF16, 21);
            let Some(layer) = layer_taking_graphs(name, &config, &weights, &sizes) else { return };
            for (i, &t) in sizes.iter().enumerate() {
                let x = Tensor::from_f32(&[t, 128], preset::uniform(t * 128, 1.0, 30 + i as u64)).unwrap();
                let direct = bits(layer.forward_hooked(&x, &no_hook, false).unwrap());
                let replayed = bits(layer.forward(&x).unwrap());
                let again = bits(layer.forward(&x).unwrap());
                assert_eq!(replayed, direct, "{e} experts, batch {t} (call {i}): replay against direct");
                assert_eq!(again, direct, "{e} experts, batch {t} (call {i}): second replay");
            }
            eprintln!("graph replays match direct runs: {e} experts, shared expert {}", shared.is_some());
        }
    }

    /// A W8A8 layer on the fp8 Hopper GEMM replays its small batches from graphs, routed in one
    /// launch, with the bits of direct runs; a larger batch that grows the buffers (the fp8
    /// rows' among them) drops the graphs that pointed into the old ones, and the smaller
    /// batches capture again. Needs a Hopper GPU; says loudly when it skips.
    #[test]
    fn w8a8_replays_match_direct_runs_and_follow_their_buffers() {
        let name = "w8a8_replays_match_direct_runs_and_follow_their_buffers";
        let config = small_layer(256, 128, 16, 4, Some(SharedConfig { inter: 64, gated: true }));
        let weights = preset::random_weights(&config, DType::BF16, 23);
        if crate::backend::cuda::skip_without_gpu(name) {
            return;
        }
        let layer = CudaMoeLayer::new(&config, &weights, &Default::default()).unwrap();
        let layer = layer.fp8_experts().unwrap().fp8_activations().unwrap();
        let sizes = [1usize, 3, 1, 200, 3, 1];
        if !sizes.iter().all(|&t| layer.takes_graph(t)) {
            eprintln!("SKIPPED {name}: W8A8 batches take no graph here (not a Hopper GPU)");
            return;
        }
        assert!(layer.routes_fused(1) && layer.routes_fused(3), "small W8A8 batches route in one launch");
        let captured = |layer: &CudaMoeLayer| -> Vec<usize> {
            let guard = layer.bufs.lock().unwrap();
            guard.as_ref().map_or(Vec::new(), |b| b.graphs.graphs.iter().map(|(n, _)| *n).collect())
        };
        for (i, &t) in sizes.iter().enumerate() {
            let x = Tensor::from_f32(&[t, 256], preset::uniform(t * 256, 1.0, 60 + t as u64)).unwrap();
            let direct = bits(layer.forward_hooked(&x, &no_hook, false).unwrap());
            assert_eq!(bits(layer.forward(&x).unwrap()), direct, "batch {t} (call {i}): replay against direct");
            assert_eq!(bits(layer.forward(&x).unwrap()), direct, "batch {t} (call {i}): second replay");
            if t == 200 {
                assert_eq!(captured(&layer), vec![200], "the graphs into the smaller buffers are dropped");
            }
        }
        assert_eq!(layer.failed_graph_captures(), 0, "{:?}", layer.last_graph_capture_failure());
        eprintln!("W8A8 graph replays match direct runs and follow their buffers");
    }
}
