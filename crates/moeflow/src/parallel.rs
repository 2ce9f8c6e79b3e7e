//! A parallel layout (EP × TP, strategy, placement) and the per-rank strategy it builds.
//!
//! World rank `w = dp · TP + tp`: the ranks of a TP group (consecutive ranks) hold the same
//! tokens, and all world ranks are EP ranks, each holding its own experts.

use crate::comm::{run_ranks, Communicator};
use crate::config::{MoeConfig, MoeWeights};
use crate::dispatch::{
    allgather_logits, All2AllV, AllGather, Ep, Local, LowLatency, Multicast, PrepareFinalize, TpPadding, TpSlice,
};
use crate::error::{MoeError, Result};
use crate::layer::{ExpertsKind, LayerOptions, MoeLayer};
use crate::placement::ExpertPlacement;
use crate::tensor::Tensor;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

/// The dispatch/combine strategies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StrategyKind {
    /// One rank, nothing moves.
    Local,
    /// All-gather / reduce-scatter.
    AllGather,
    /// All-gather of router logits, routing after dispatch.
    AllGatherLogits,
    /// Broadcast per rank, all-reduce.
    Multicast,
    /// All-to-all-v of slot rows.
    All2AllV,
    /// Fixed-capacity batched dispatch.
    LowLatency,
    /// GPU ranks: one of [`crate::auto_strategy::AutoStrategy::CANDIDATES`] per batch, from
    /// the layout's table ([`ParallelConfig::auto`]).
    Auto,
}

impl StrategyKind {
    /// Every strategy.
    pub const ALL: [StrategyKind; 6] = [
        StrategyKind::Local,
        StrategyKind::AllGather,
        StrategyKind::AllGatherLogits,
        StrategyKind::Multicast,
        StrategyKind::All2AllV,
        StrategyKind::LowLatency,
    ];

    /// Name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            StrategyKind::Local => "local",
            StrategyKind::AllGather => "allgather",
            StrategyKind::AllGatherLogits => "allgather-logits",
            StrategyKind::Multicast => "multicast",
            StrategyKind::All2AllV => "all2allv",
            StrategyKind::LowLatency => "lowlatency",
            StrategyKind::Auto => "auto",
        }
    }
}

impl FromStr for StrategyKind {
    type Err = MoeError;
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL.into_iter().chain([StrategyKind::Auto]).find(|k| k.name() == s).ok_or_else(|| {
            let names: Vec<_> = Self::ALL.iter().chain(&[StrategyKind::Auto]).map(|k| k.name()).collect();
            MoeError::Config(format!("unknown strategy '{s}' (known: {})", names.join(", ")))
        })
    }
}

impl std::fmt::Display for StrategyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How experts are laid out on EP ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PlacementKind {
    /// Contiguous ranges.
    Contiguous,
    /// Expert e on rank e mod EP.
    RoundRobin,
    /// A JSON [`crate::placement::PlacementFile`].
    File(PathBuf),
}

impl FromStr for PlacementKind {
    type Err = MoeError;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "contiguous" => PlacementKind::Contiguous,
            "round-robin" => PlacementKind::RoundRobin,
            path => PlacementKind::File(PathBuf::from(path)),
        })
    }
}

/// A parallel layout of one layer.
#[derive(Clone, Debug)]
pub struct ParallelConfig {
    /// EP ranks (the whole world).
    pub ep: usize,
    /// TP ranks per DP group (must divide `ep`).
    pub tp: usize,
    /// Dispatch/combine strategy.
    pub strategy: StrategyKind,
    /// Expert layout.
    pub placement: PlacementKind,
    /// Experts given one more replica on another rank.
    pub redundant: Vec<usize>,
    /// Token capacity per rank of the low-latency strategy.
    pub max_tokens_per_rank: usize,
    /// All-gather over the EP group after TP slicing instead of over the DP group.
    pub sequence_parallel: bool,
    /// TP padding.
    pub tp_padding: TpPadding,
    /// Skip TP slicing (shared-expert DP, replaced all-reduce).
    pub tp_skip: bool,
    /// Deadline of every collective.
    pub timeout: Duration,
    /// Dual-batch overlap: two micro-batches, each on its own strategy instance.
    pub dual_batch: bool,
    /// Format rows are quantized to.
    pub quant: crate::quant::QuantConfig,
    /// Rows travel unquantized and the experts quantize them on arrival.
    pub defer_input_quant: bool,
    /// How the CPU experts multiply bf16 weights.
    pub bf16_matmul: crate::Bf16Matmul,
    /// Return outputs holding NaN or infinity instead of an error.
    pub allow_nonfinite: bool,
    /// `--strategy auto`'s table (`None`: the built-in one for this EP size).
    pub auto: Option<crate::auto_strategy::AutoStrategy>,
    /// Build layers that can take a new placement while running (CPU and host-staged layers
    /// keep their experts' weights as given for it; see [`MoeLayer::rebalance`]).
    pub rebalanceable: bool,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        ParallelConfig {
            ep: 1,
            tp: 1,
            strategy: StrategyKind::Local,
            placement: PlacementKind::Contiguous,
            redundant: Vec::new(),
            max_tokens_per_rank: 256,
            sequence_parallel: false,
            tp_padding: TpPadding::Multiple,
            tp_skip: false,
            timeout: crate::comm::DEFAULT_TIMEOUT,
            dual_batch: false,
            quant: crate::quant::QuantConfig::None,
            defer_input_quant: false,
            bf16_matmul: crate::Bf16Matmul::Auto,
            allow_nonfinite: false,
            auto: None,
            rebalanceable: false,
        }
    }
}

/// More ranks than any expert-parallel group has: an EP above it is a mistake, refused before
/// anything is sized by it.
pub const MAX_RANKS: usize = 1 << 16;

impl ParallelConfig {
    /// A layout with `ep` ranks, `tp` per DP group, and `strategy`.
    pub fn new(ep: usize, tp: usize, strategy: StrategyKind) -> Self {
        ParallelConfig { ep, tp, strategy, ..Default::default() }
    }

    /// Checks the layout on its own.
    pub fn validate(&self) -> Result<()> {
        if self.ep == 0 || self.tp == 0 || !self.ep.is_multiple_of(self.tp) {
            return Err(MoeError::Config(format!("EP {} must be a positive multiple of TP {}", self.ep, self.tp)));
        }
        if self.ep > MAX_RANKS {
            return Err(MoeError::Config(format!("EP {} is more than {MAX_RANKS} ranks", self.ep)));
        }
        if self.strategy == StrategyKind::Local && self.ep != 1 {
            return Err(MoeError::Config(format!("strategy 'local' runs on one rank, not EP {}", self.ep)));
        }
        Ok(())
    }

    /// The expert placement for `num_experts`.
    pub fn placement(&self, num_experts: usize) -> Result<ExpertPlacement> {
        let p = match &self.placement {
            PlacementKind::Contiguous => ExpertPlacement::contiguous(num_experts, self.ep)?,
            PlacementKind::RoundRobin => ExpertPlacement::round_robin(num_experts, self.ep)?,
            PlacementKind::File(path) => ExpertPlacement::from_json_file(path, num_experts, self.ep)?,
        };
        if self.redundant.is_empty() {
            Ok(p)
        } else {
            p.with_replicas(&self.redundant)
        }
    }

    /// This rank's strategy. Collective: every rank of `world` must call it.
    pub fn build(&self, world: &dyn Communicator, placement: Arc<ExpertPlacement>) -> Result<Box<dyn PrepareFinalize>> {
        self.validate()?;
        if world.size() != self.ep {
            return Err(MoeError::Config(format!("world of {} ranks for EP {}", world.size(), self.ep)));
        }
        // One rank has nothing to choose.
        if self.strategy == StrategyKind::Local || self.ep == 1 {
            return Ok(Box::new(Local));
        }
        if self.strategy == StrategyKind::Auto {
            return Err(MoeError::Unsupported(
                "strategy 'auto' picks among the device strategies of GPU ranks; name a strategy for CPU ranks".into(),
            ));
        }
        let rank = world.rank();
        let ep = Ep::new(Arc::from(world.split(0, rank)?), placement)?;
        let tp: Option<Arc<dyn Communicator>> =
            if self.tp > 1 { Some(Arc::from(world.split(rank / self.tp, rank)?)) } else { None };
        let base: Box<dyn PrepareFinalize> = match self.strategy {
            StrategyKind::Local | StrategyKind::Auto => unreachable!("handled above"),
            StrategyKind::AllGather => match &tp {
                Some(tp) if !self.sequence_parallel => {
                    let dp: Arc<dyn Communicator> = Arc::from(world.split(rank % self.tp, rank)?);
                    return Ok(Box::new(AllGather::with_dp_tp(ep, dp, tp.clone())));
                }
                _ => Box::new(AllGather::new(ep)),
            },
            StrategyKind::AllGatherLogits => Box::new(allgather_logits(ep)),
            StrategyKind::Multicast => Box::new(Multicast::new(ep)),
            StrategyKind::All2AllV => Box::new(All2AllV::new(ep)),
            StrategyKind::LowLatency => Box::new(LowLatency::new(ep, self.max_tokens_per_rank)?),
        };
        match tp {
            None => Ok(base),
            Some(tp) => {
                let s = TpSlice::new(base, tp, self.tp_padding)?;
                Ok(Box::new(if self.tp_skip { s.skipped() } else { s }))
            }
        }
    }
}

impl ParallelConfig {
    /// This rank's layer (its local experts, its strategy, a second one under dual-batch
    /// overlap). Collective over `world`.
    pub fn layer(
        &self,
        world: &dyn Communicator,
        placement: Arc<ExpertPlacement>,
        config: &MoeConfig,
        weights: &MoeWeights,
        experts: ExpertsKind,
        chunk_size: Option<usize>,
    ) -> Result<MoeLayer> {
        let strategy = self.build(world, placement.clone())?;
        let dual_batch = if self.dual_batch {
            if self.strategy == StrategyKind::Local {
                Some(Box::new(Local) as Box<dyn PrepareFinalize>)
            } else {
                // `build` splits its own communicators off `world`, so the second instance
                // shares nothing with the first. (It used to split off a temporary split that
                // was dropped at once, so a rank could destroy that parent while a peer's NCCL
                // split still bootstrapped through it: the suspected cause of a rare heap
                // corruption in the GPU tests.)
                Some(self.build(world, placement)?)
            }
        } else {
            None
        };
        MoeLayer::new(
            config,
            weights,
            LayerOptions {
                chunk_size,
                experts,
                strategy,
                dual_batch,
                quant: self.quant,
                defer_input_quant: self.defer_input_quant,
                bf16_matmul: self.bf16_matmul,
                allow_nonfinite: self.allow_nonfinite,
                rebalanceable: self.rebalanceable,
            },
        )
    }
}

/// Where the ranks of a layout run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RankHost {
    /// One thread per rank, messages through memory, CPU experts.
    Threads,
    /// One thread per GPU (rank r on GPU r), NCCL, CUDA experts (feature `cuda`).
    Gpus,
    /// This process is one rank of a job started by a launcher: over NCCL with CUDA experts on
    /// GPU `LOCAL_RANK` (`gpu`), or over TCP with CPU experts.
    Launched {
        /// The launcher's variables.
        env: crate::comm::LaunchEnv,
        /// NCCL and CUDA experts rather than TCP and CPU experts.
        gpu: bool,
    },
}

impl RankHost {
    /// The ranks for `gpu` (CUDA experts or CPU ones): this process's rank of the launched job
    /// `launched` (the launcher's variables, when set), else threads of this process.
    pub fn detect(gpu: bool, launched: Option<crate::comm::LaunchEnv>) -> RankHost {
        match launched {
            Some(env) => RankHost::Launched { env, gpu },
            None if gpu => RankHost::Gpus,
            None => RankHost::Threads,
        }
    }

    /// This process's rank in a launched job (`None` when every rank runs here).
    pub fn launched_rank(&self) -> Option<usize> {
        match self {
            RankHost::Launched { env, .. } => Some(env.rank),
            _ => None,
        }
    }
}

/// Runs `f` on the `size` ranks of `host` that live here (all of them, or this process's
/// one), each with its communicator and the experts it should use. Returns `(rank, result)`
/// per rank run here. An error on one rank fails the others' collectives; none waits past
/// `timeout`.
pub fn on_ranks<T: Send>(
    host: &RankHost,
    size: usize,
    timeout: Duration,
    f: impl Fn(&dyn Communicator, ExpertsKind) -> Result<T> + Sync,
) -> Vec<(usize, Result<T>)> {
    match host {
        RankHost::Threads => {
            if let Err(e) = crate::comm::check_thread_ranks(size) {
                return vec![(0, Err(e))];
            }
            run_ranks(size, Some(timeout), |c| f(c, ExpertsKind::Cpu)).into_iter().enumerate().collect()
        }
        RankHost::Launched { env, gpu } => {
            if env.world_size != size {
                let e = MoeError::Config(format!("WORLD_SIZE={} but the layout has {size} ranks", env.world_size));
                return vec![(env.rank, Err(e))];
            }
            let run =
                |comm: &dyn Communicator, kind: ExpertsKind| crate::comm::run_rank(env.rank, comm, || f(comm, kind));
            let result = if *gpu {
                launched_gpu(env, timeout, run)
            } else {
                crate::comm::TcpComm::from_env(env, timeout).and_then(|comm| run(&comm, ExpertsKind::Cpu))
            };
            vec![(env.rank, result)]
        }
        #[cfg(feature = "cuda")]
        RankHost::Gpus => {
            let devices: Vec<usize> = (0..size).collect();
            crate::backend::cuda::run_ranks_nccl(&devices, timeout, |c| f(c, ExpertsKind::Cuda { device: c.rank() }))
                .into_iter()
                .enumerate()
                .collect()
        }
        #[cfg(not(feature = "cuda"))]
        RankHost::Gpus => (0..size).map(|r| (r, Err(no_gpu_build()))).collect(),
    }
}

#[cfg(feature = "cuda")]
fn launched_gpu<T>(
    env: &crate::comm::LaunchEnv,
    timeout: Duration,
    run: impl Fn(&dyn Communicator, ExpertsKind) -> Result<T>,
) -> Result<T> {
    let comm = crate::backend::cuda::NcclComm::from_env(env, timeout)?;
    run(&comm, ExpertsKind::Cuda { device: env.local_rank })
}

#[cfg(not(feature = "cuda"))]
fn launched_gpu<T>(
    _env: &crate::comm::LaunchEnv,
    _timeout: Duration,
    _run: impl Fn(&dyn Communicator, ExpertsKind) -> Result<T>,
) -> Result<T> {
    Err(no_gpu_build())
}

#[cfg(not(feature = "cuda"))]
fn no_gpu_build() -> MoeError {
    MoeError::Unsupported("GPU ranks need a build with `--features cuda`".into())
}

/// Runs the layer on `parallel.ep` in-process ranks, rank `r` with `inputs[r]` (ranks of a TP
/// group must hold the same tokens); returns every rank's output.
pub fn forward_in_process(
    config: &MoeConfig,
    weights: &MoeWeights,
    parallel: &ParallelConfig,
    experts: ExpertsKind,
    chunk_size: Option<usize>,
    inputs: &[Tensor],
) -> Result<Vec<Tensor>> {
    parallel.validate()?;
    crate::comm::check_thread_ranks(parallel.ep)?;
    if inputs.len() != parallel.ep {
        return Err(MoeError::Config(format!("{} inputs for {} ranks", inputs.len(), parallel.ep)));
    }
    let placement = Arc::new(parallel.placement(config.num_experts)?);
    run_ranks(parallel.ep, Some(parallel.timeout), |comm| {
        let layer = parallel.layer(comm, placement.clone(), config, weights, experts, chunk_size)?;
        layer.forward(&inputs[comm.rank()])
    })
    .into_iter()
    .collect()
}
