//! [`Options`]: how a layer or a dispatch/combine runs — the layout (EP, TP, strategy,
//! placement, replicas), quantization, deadlines and the GPU options — parsed once, with the
//! library's own parsers and messages.

use crate::errors::{bad_input, IntoPy};
use moeflow::backend::cuda_options::{CudaOptions, CUDA_VARIABLES};
use moeflow::parallel::{ParallelConfig, PlacementKind, StrategyKind};
use moeflow::quant::QuantConfig;
use moeflow::{Bf16Matmul, ExpertsKind};
use pyo3::prelude::*;
use std::collections::HashMap;

/// Options of a layer: see `moeflow.MoeLayer.from_pretrained` for each.
#[pyclass(frozen, module = "moeflow._moeflow")]
pub struct Options {
    pub parallel: ParallelConfig,
    pub chunk_size: Option<usize>,
    pub cuda: CudaOptions,
}

#[pymethods]
impl Options {
    #[new]
    #[pyo3(signature = (*, ep=1, tp=1, strategy=None, placement="contiguous", redundant=Vec::new(),
        dual_batch=false, max_tokens_per_rank=256, sequence_parallel=false, quant="none",
        defer_input_quant=false, bf16_matmul="auto", timeout=60.0, allow_nonfinite=false,
        deterministic=false, chunk_size=None, cuda=HashMap::new()))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        ep: usize,
        tp: usize,
        strategy: Option<&str>,
        placement: &str,
        redundant: Vec<usize>,
        dual_batch: bool,
        max_tokens_per_rank: usize,
        sequence_parallel: bool,
        quant: &str,
        defer_input_quant: bool,
        bf16_matmul: &str,
        timeout: f64,
        allow_nonfinite: bool,
        deterministic: bool,
        chunk_size: Option<usize>,
        cuda: HashMap<String, String>,
    ) -> PyResult<Self> {
        let strategy: StrategyKind = match strategy {
            Some(s) => s.parse().py_err()?,
            None if ep == 1 => StrategyKind::Local,
            None => StrategyKind::All2AllV,
        };
        let timeout = std::time::Duration::try_from_secs_f64(timeout)
            .ok()
            .filter(|t| !t.is_zero())
            .ok_or_else(|| bad_input(format!("timeout {timeout} is not a positive number of seconds")))?;
        let parallel = ParallelConfig {
            placement: placement.parse::<PlacementKind>().py_err()?,
            redundant,
            dual_batch,
            max_tokens_per_rank,
            sequence_parallel,
            quant: quant.parse::<QuantConfig>().py_err()?,
            defer_input_quant,
            bf16_matmul: bf16_matmul.parse::<Bf16Matmul>().map_err(bad_input)?,
            timeout,
            allow_nonfinite,
            ..ParallelConfig::new(ep, tp, strategy)
        };
        parallel.validate().py_err()?;
        if chunk_size == Some(0) {
            return Err(bad_input("chunk_size must be positive"));
        }
        let mut vars = Vec::new();
        for (key, value) in cuda {
            let var = format!("MOEFLOW_{}", key.to_uppercase());
            if !CUDA_VARIABLES.iter().any(|(name, _)| *name == var) {
                let known: Vec<String> =
                    CUDA_VARIABLES.iter().map(|(n, _)| n.trim_start_matches("MOEFLOW_").to_lowercase()).collect();
                return Err(bad_input(format!("unknown CUDA option '{key}' (known: {})", known.join(", "))));
            }
            vars.push((var, value));
        }
        let mut cuda = CudaOptions::from_vars(vars).py_err()?;
        cuda.deterministic |= deterministic;
        Ok(Options { parallel, chunk_size, cuda })
    }

    /// The layout in words (strategy, EP, TP, placement, ...).
    fn layout(&self) -> String {
        self.parallel.layout()
    }
}

/// Where a layer runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// Host threads.
    Cpu,
    /// CUDA GPU `n`.
    Cuda(usize),
}

impl Device {
    /// `"cpu"`, `"cuda"` (GPU `default_gpu`) or `"cuda:N"`.
    pub fn parse(s: &str, default_gpu: usize) -> PyResult<Device> {
        match s.trim() {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(default_gpu)),
            d => d
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| bad_input(format!("device '{s}': expected \"cpu\", \"cuda\" or \"cuda:N\""))),
        }
    }

    /// The experts this device runs.
    pub fn experts(self) -> ExpertsKind {
        match self {
            Device::Cpu => ExpertsKind::Cpu,
            Device::Cuda(device) => ExpertsKind::Cuda { device },
        }
    }

    /// The name a user gives it.
    pub fn name(self) -> String {
        match self {
            Device::Cpu => "cpu".into(),
            Device::Cuda(n) => format!("cuda:{n}"),
        }
    }
}
