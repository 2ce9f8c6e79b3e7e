//! Backends: the CPU one always, CUDA with the `cuda` feature (a stand-in without it that
//! answers every call with a clear error).
pub mod cpu;
pub mod cuda_options;
pub mod host_route;

/// Milliseconds per stage of one forward, from CUDA events.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct GpuStageTimes {
    /// f32 → bf16, router GEMM and top-k.
    pub route: f64,
    /// Counts, offsets, scatter, gather (and, expert-parallel, the count exchange).
    pub permute: f64,
    /// Expert-parallel: rows sent to the ranks holding their experts, regrouped there.
    pub dispatch: f64,
    /// First grouped GEMM.
    pub gemm1: f64,
    /// Activation.
    pub act: f64,
    /// Second grouped GEMM.
    pub gemm2: f64,
    /// Expert-parallel: output rows sent back to the ranks that own the tokens.
    pub collect: f64,
    /// Weighted combine.
    pub combine: f64,
    /// Shared experts.
    pub shared: f64,
    /// Whole layer on the device.
    pub total: f64,
    /// Expert-parallel: bytes of rows this rank sent to other ranks in the dispatch (the
    /// combine sends as many back).
    pub dispatch_bytes: usize,
    /// The experts that received rows (on an expert-parallel rank, of its own), whose weights
    /// the layer read (0: not counted).
    pub experts_used: usize,
    /// The prepare/finalize strategy that ran (empty for a graph replay, which times only the
    /// whole).
    pub strategy: &'static str,
    /// The experts' implementation that ran (empty for a graph replay).
    pub experts: &'static str,
    /// Expert-parallel: how rows moved between the GPUs ("nvlink" or "nccl").
    pub transport: &'static str,
    /// Expert-parallel all-to-all-v: the dispatch was planned on the device, not the host.
    pub device_plan: bool,
    /// Expert-parallel all-to-all-v: the token rows crossed beside the routing (whole batches
    /// by the copy engines), so the dispatch stage holds their ids and flags, not the rows.
    pub rows_beside_routing: bool,
    /// Expert-parallel all-to-all-v: the experts' rows went home from the down projection's
    /// epilogue (deterministic mode over NVLink, planned on the device), so the collect stage
    /// holds only the flags that say they landed.
    pub rows_home_from_gemm: bool,
}

/// A GPU's ceilings, measured where the benchmark runs, on a cool GPU (the GEMM rate it holds
/// under sustained load is measured apart: `measure_sustained_gemm`).
#[derive(Clone, Copy, Debug)]
pub struct GpuCeilings {
    /// Dense bf16 GEMM TFLOP/s (cuBLAS, 8192³ on random values: zeros draw less power and
    /// clock higher), median of 5 runs.
    pub gemm_tflops: f64,
    /// Device-to-device copy GB/s (bytes read + written, 1 GiB), median of 5 runs.
    pub copy_gbps: f64,
}

#[cfg(feature = "cuda")]
pub mod cuda;

/// Stand-in for builds without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub mod cuda {
    use crate::config::{MoeConfig, MoeWeights};
    use crate::error::{MoeError, Result};
    use crate::tensor::Tensor;

    fn missing() -> MoeError {
        MoeError::Unsupported("this moeflow was built without CUDA; rebuild with `--features cuda`".into())
    }

    pub use crate::backend::cuda_options::{CudaOptions, ExpertGemm, LowLatencyGemm, Transport};
    pub use crate::backend::{GpuCeilings, GpuStageTimes};

    /// No devices without the feature.
    pub fn device_count() -> usize {
        0
    }

    /// Always an error without the feature.
    pub fn measure_ceilings(_device: usize) -> Result<GpuCeilings> {
        Err(missing())
    }

    /// Always an error without the feature.
    pub fn measure_sustained_gemm(_device: usize) -> Result<f64> {
        Err(missing())
    }

    /// Always an error without the feature.
    pub fn measure_fp8_gemm(_device: usize, _sustained: bool) -> Result<Option<f64>> {
        Err(missing())
    }

    /// Always an error without the feature.
    pub fn measure_peer_copy(_from: usize, _to: usize) -> Result<f64> {
        Err(missing())
    }

    /// Always an error without the feature.
    pub fn measure_peer_push(_from: usize, _to: usize, _sms: u32) -> Result<f64> {
        Err(missing())
    }

    /// Always an error without the feature.
    pub fn measure_peer_both_ways(_a: usize, _b: usize, _push_sms: Option<u32>) -> Result<f64> {
        Err(missing())
    }

    /// Always an error without the feature.
    pub fn experts(
        _weights: &crate::experts::ExpertWeights,
        _activation: crate::experts::Activation,
        _device: usize,
    ) -> Result<Box<dyn crate::experts::Experts>> {
        Err(missing())
    }

    /// The CUDA layer; without the feature every constructor is an error.
    pub struct CudaMoeLayer(());

    /// The NCCL communicator; without the feature none can be made.
    pub struct NcclComm(());

    impl NcclComm {
        /// Unreachable without the feature.
        pub fn duplicate(&self) -> Result<NcclComm> {
            Err(missing())
        }
        /// Unreachable without the feature.
        pub fn split_nccl(&self, _color: usize, _key: usize) -> Result<NcclComm> {
            Err(missing())
        }
    }

    impl CudaMoeLayer {
        /// Always an error without the feature.
        pub fn new(_config: &MoeConfig, _weights: &MoeWeights, _opts: &CudaOptions) -> Result<Self> {
            Err(missing())
        }
        /// Always an error without the feature.
        pub fn new_on_device(
            _config: &MoeConfig,
            _weights: &MoeWeights,
            _device: usize,
            _opts: &CudaOptions,
        ) -> Result<Self> {
            Err(missing())
        }
        /// Always an error without the feature.
        pub fn random_on_device(_config: &MoeConfig, _seed: u64, _device: usize, _opts: &CudaOptions) -> Result<Self> {
            Err(missing())
        }
        /// Always an error without the feature.
        pub fn random(_config: &MoeConfig, _seed: u64, _opts: &CudaOptions) -> Result<Self> {
            Err(missing())
        }
        /// Always an error without the feature.
        pub fn new_ep(
            _config: &MoeConfig,
            _weights: &MoeWeights,
            _comm: NcclComm,
            _placement: std::sync::Arc<crate::placement::ExpertPlacement>,
            _opts: &CudaOptions,
        ) -> Result<Self> {
            Err(missing())
        }
        /// Always an error without the feature.
        pub fn random_ep(
            _config: &MoeConfig,
            _seed: u64,
            _comm: NcclComm,
            _placement: std::sync::Arc<crate::placement::ExpertPlacement>,
            _opts: &CudaOptions,
        ) -> Result<Self> {
            Err(missing())
        }
        /// Unreachable without the feature.
        pub fn forward(&self, _hidden: &Tensor) -> Result<Tensor> {
            Err(missing())
        }

        /// Always an error without the feature.
        pub fn load_stats(&self) -> Result<crate::load_stats::LoadStats> {
            Err(missing())
        }
        /// Unreachable without the feature.
        pub fn load_recording_ms(&self, _tokens: usize) -> Result<f64> {
            Err(missing())
        }
        /// Unreachable without the feature.
        pub fn options(&self) -> &crate::backend::cuda_options::CudaOptions {
            static DEFAULTS: std::sync::OnceLock<crate::backend::cuda_options::CudaOptions> =
                std::sync::OnceLock::new();
            DEFAULTS.get_or_init(Default::default)
        }
        /// Unreachable without the feature.
        pub fn skew_router(self, _skew: &crate::skew::Skew) -> Result<Self> {
            Err(missing())
        }
        /// Unreachable without the feature.
        pub fn placement(&self) -> Option<std::sync::Arc<crate::placement::ExpertPlacement>> {
            None
        }
        /// Unreachable without the feature.
        pub fn rebalance(&mut self, _placement: std::sync::Arc<crate::placement::ExpertPlacement>) -> Result<()> {
            Err(missing())
        }
        /// Unreachable without the feature.
        pub fn allow_nonfinite(self, _allow: bool) -> Self {
            self
        }
        /// Unreachable without the feature.
        pub fn forward_timed(&self, _tokens: usize, _seed: u64) -> Result<GpuStageTimes> {
            Err(missing())
        }
        /// Unreachable without the feature.
        pub fn forward_timed_stages(&self, _tokens: usize, _seed: u64) -> Result<GpuStageTimes> {
            Err(missing())
        }
        /// Unreachable without the feature.
        pub fn replays_graph(&self, _tokens: usize) -> bool {
            false
        }
        /// Unreachable without the feature.
        pub fn failed_graph_captures(&self) -> usize {
            0
        }
        /// Unreachable without the feature.
        pub fn last_graph_capture_failure(&self) -> Option<String> {
            None
        }
        /// Unreachable without the feature.
        pub fn low_latency(self, _max_tokens_per_rank: usize) -> Result<Self> {
            Err(missing())
        }
        /// Unreachable without the feature.
        pub fn capacity(&self) -> Option<usize> {
            None
        }
        /// Unreachable without the feature.
        pub fn fp8_experts(self) -> Result<Self> {
            Err(missing())
        }
        /// Unreachable without the feature.
        pub fn has_fp8_experts(&self) -> bool {
            false
        }
        /// Unreachable without the feature.
        pub fn fp8_activations(self) -> Result<Self> {
            Err(missing())
        }
        /// Unreachable without the feature.
        pub fn fp8_shared_expert(self) -> Result<Self> {
            Err(missing())
        }
        /// Unreachable without the feature.
        pub fn has_fp8_shared_expert(&self) -> bool {
            false
        }
        /// Unreachable without the feature.
        pub fn shared_expert_gemm(&self) -> Option<&'static str> {
            None
        }
        /// Unreachable without the feature.
        pub fn measure_ceilings(&self) -> Result<super::GpuCeilings> {
            Err(missing())
        }
        /// Unreachable without the feature.
        pub fn device_name(&self) -> String {
            String::new()
        }
        /// Unreachable without the feature.
        pub fn all_gather(self) -> Result<Self> {
            Err(missing())
        }
        /// Unreachable without the feature.
        pub fn multicast(self) -> Result<Self> {
            Err(missing())
        }
        /// Unreachable without the feature.
        pub fn all_gather_logits(self) -> Result<Self> {
            Err(missing())
        }
        /// Unreachable without the feature.
        pub fn tp_slice(self, _tp: NcclComm) -> Result<Self> {
            Err(missing())
        }
        /// Unreachable without the feature.
        pub fn tp_size(&self) -> usize {
            1
        }
        /// Unreachable without the feature.
        pub fn tokens_routed(&self, t: usize) -> usize {
            t
        }
        /// Unreachable without the feature.
        pub fn forward_device(&self, _x: u64, _out: u64, _t: usize, _stream: u64) -> Result<()> {
            Err(missing())
        }
        /// Unreachable without the feature.
        pub fn forward_device_bf16(&self, _x: u64, _out: u64, _t: usize, _stream: u64) -> Result<()> {
            Err(missing())
        }
        /// Unreachable without the feature.
        pub fn synchronize_device(&self, _stream: u64, _timeout: std::time::Duration) -> Result<()> {
            Err(missing())
        }
        /// Unreachable without the feature.
        pub fn auto(self, _table: crate::auto_strategy::AutoStrategy) -> Result<Self> {
            Err(missing())
        }
        /// Unreachable without the feature.
        pub fn dual_batch(self, _comm: Option<NcclComm>) -> Result<CudaDualBatch> {
            Err(missing())
        }
    }

    /// The dual-batch CUDA layer; without the feature none can be made.
    pub struct CudaDualBatch(());

    impl CudaDualBatch {
        /// Unreachable without the feature.
        pub fn forward(&self, _hidden: &Tensor) -> Result<Tensor> {
            Err(missing())
        }
        /// Unreachable without the feature.
        pub fn forward_timed(&self, _tokens: usize, _seed: u64) -> Result<GpuStageTimes> {
            Err(missing())
        }
    }
}
