//! [`RankLayer`]: the layer one rank runs, chosen by the library from the layout and the
//! backend, with [`RankLayer::describe`] naming the path it took.
//!
//! - CPU ranks (threads, or processes over TCP) run the modular [`MoeLayer`].
//! - One GPU runs the whole layer on the device ([`CudaMoeLayer`]).
//! - GPU ranks over NCCL run the device-resident expert-parallel layer wherever it covers the
//!   layout ([`gpu_path`]): every strategy, placement, replica set and expert count, TP slicing
//!   around it ([`CudaMoeLayer::tp_slice`], the shares all-gathered on the device; around
//!   dual-batch halves, through host memory), dual-batch overlap. The layouts it does not
//!   cover run the modular layer with GPU experts and rows staged through host memory, and
//!   `describe` says so with the reason: no silent fallback.

use crate::backend::cuda::{CudaDualBatch, CudaMoeLayer, CudaOptions, NcclComm};
use crate::comm::{CommExt, Communicator};
use crate::config::{MoeConfig, MoeWeights};
use crate::error::{MoeError, Result};
use crate::layer::{ExpertsKind, MoeLayer};
use crate::parallel::{ParallelConfig, PlacementKind, StrategyKind};
use crate::placement::ExpertPlacement;
use crate::tensor::Tensor;
use std::sync::Arc;

/// Where a GPU rank of a layout runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuPath {
    /// One GPU: the whole layer on the device, CUDA graphs for small batches.
    OneGpu,
    /// The device-resident expert-parallel layer over NCCL.
    DeviceResident,
    /// The modular layer with GPU experts, rows through host memory, for the reason given.
    HostStaged(String),
}

/// The path GPU ranks of `par` take (no device needed: this is the library's whole decision).
pub fn gpu_path(par: &ParallelConfig) -> GpuPath {
    if par.ep == 1 && par.tp == 1 {
        return GpuPath::OneGpu;
    }
    if par.tp_skip {
        return GpuPath::HostStaged("skipping TP slicing (tp_skip) is a host-side variant".into());
    }
    GpuPath::DeviceResident
}

/// Where a rank's weights come from.
#[derive(Clone, Copy)]
pub enum WeightSource<'a> {
    /// These weights (every rank passes the whole layer's; each keeps its own experts).
    Given(&'a MoeWeights),
    /// Uniform random weights generated on the GPU from this seed (benchmarks of shapes too
    /// large for the host; replicas are not copies of their experts, so only for timing).
    DeviceRandom(u64),
}

/// What a rank's layer is built from, besides its layout.
#[derive(Clone)]
pub struct RankLayerSpec<'a> {
    /// The layer's shapes and router.
    pub config: &'a MoeConfig,
    /// Its weights.
    pub weights: WeightSource<'a>,
    /// Rows given to the CPU experts at a time (`None`: all at once).
    pub chunk_size: Option<usize>,
    /// How GPU layers run.
    pub cuda: CudaOptions,
    /// GPU layers stream the routed experts as fp8 e4m3 codes with 128 × 128 block scales.
    pub fp8_experts: bool,
    /// GPU layers quantize their GEMM rows to fp8 too (W8A8; needs `fp8_experts`).
    pub fp8_rows: bool,
    /// GPU layers hold the shared expert as fp8 codes too, and with `fp8_rows` multiply fp8
    /// rows there as well (see [`CudaMoeLayer::fp8_shared_expert`]).
    pub fp8_shared_expert: bool,
    /// A routing skew added to the router bias of weights generated on the device
    /// ([`WeightSource::DeviceRandom`]; see [`CudaMoeLayer::skew_router`]). Given weights
    /// carry their own ([`crate::skew::Skew::apply`]) and refuse it.
    pub skew: Option<crate::skew::Skew>,
}

impl<'a> RankLayerSpec<'a> {
    /// `config` with `weights`, default options otherwise.
    pub fn new(config: &'a MoeConfig, weights: &'a MoeWeights) -> Self {
        Self::from_source(config, WeightSource::Given(weights))
    }

    /// `config` with random weights generated on the GPU from `seed` (see
    /// [`WeightSource::DeviceRandom`]), default options otherwise.
    pub fn random_on_device(config: &'a MoeConfig, seed: u64) -> Self {
        Self::from_source(config, WeightSource::DeviceRandom(seed))
    }

    fn from_source(config: &'a MoeConfig, weights: WeightSource<'a>) -> Self {
        RankLayerSpec {
            config,
            weights,
            chunk_size: None,
            cuda: CudaOptions::default(),
            fp8_experts: false,
            fp8_rows: false,
            fp8_shared_expert: false,
            skew: None,
        }
    }
}

/// The layer one rank runs: see the module.
pub struct RankLayer {
    inner: Inner,
    description: String,
    /// The layer's hidden size H.
    hidden: usize,
}

enum Inner {
    Host(Box<MoeLayer>),
    Device(Box<CudaMoeLayer>),
    DeviceDual(Box<CudaDualBatch>),
    /// TP slicing around the dual-batch device layer: this TP rank's contiguous share of its
    /// group's batch goes through `inner`, then the shares are all-gathered over the TP group in
    /// rank order through host memory. (A whole device layer slices on the device itself.)
    TpSlice {
        inner: Box<Inner>,
        tp: Box<dyn Communicator>,
    },
}

impl Inner {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Inner::Host(l) => l.forward(x),
            Inner::Device(l) => l.forward(x),
            Inner::DeviceDual(l) => l.forward(x),
            Inner::TpSlice { inner, tp } => {
                let (t, h) = rows_of(x)?;
                let (a, b) = share(t, tp.size(), tp.rank());
                let xs = x.to_f32_vec();
                let mine = Tensor::from_f32(&[b - a, h], xs[a * h..b * h].to_vec())?;
                let all = tp.all_gather_vec("tp.output", &inner.forward(&mine)?.to_f32_vec())?;
                Tensor::from_f32(&[t, h], all.concat())
            }
        }
    }

    fn load_stats(&self) -> Result<crate::load_stats::LoadStats> {
        match self {
            Inner::Host(l) => Ok(l.load_stats()),
            Inner::Device(l) => l.load_stats(),
            Inner::DeviceDual(_) => {
                Err(MoeError::Unsupported("load statistics of the dual-batch GPU layer (count each half)".into()))
            }
            Inner::TpSlice { inner, .. } => inner.load_stats(),
        }
    }

    fn rebalance(&mut self, placement: Arc<ExpertPlacement>) -> Result<()> {
        match self {
            Inner::Host(l) => l.rebalance(placement),
            Inner::Device(l) => l.rebalance(placement),
            Inner::DeviceDual(_) => Err(MoeError::Unsupported(
                "live rebalancing of the dual-batch GPU layer (its halves share one copy of the weights)".into(),
            )),
            Inner::TpSlice { inner, .. } => inner.rebalance(placement),
        }
    }

    fn placement(&self) -> Option<Arc<ExpertPlacement>> {
        match self {
            Inner::Host(l) => l.placement(),
            Inner::Device(l) => l.placement(),
            Inner::DeviceDual(_) => None,
            Inner::TpSlice { inner, .. } => inner.placement(),
        }
    }

    fn device(&self) -> Option<&CudaMoeLayer> {
        match self {
            Inner::Device(l) => Some(l),
            Inner::TpSlice { inner, .. } => inner.device(),
            _ => None,
        }
    }
}

fn rows_of(x: &Tensor) -> Result<(usize, usize)> {
    match x.shape() {
        &[t, h] => Ok((t, h)),
        s => Err(MoeError::shape("hidden_states", "[T, H]", s)),
    }
}

/// Tokens `[a, b)` of a batch of `t` that rank `rank` of `ranks` takes (a TP rank of its group's
/// batch, or a DP group of the whole): contiguous shares, the first `t mod ranks` one larger.
pub fn share(t: usize, ranks: usize, rank: usize) -> (usize, usize) {
    let (base, extra) = (t / ranks, t % ranks);
    let a = rank * base + rank.min(extra);
    (a, a + base + usize::from(rank < extra))
}

/// The largest of the [`share`]s of a batch of `t` over `ranks` ranks: what a TP all-gather
/// pads every share to, and what every rank checks against its capacity.
pub fn largest_share(t: usize, ranks: usize) -> usize {
    t.div_ceil(ranks.max(1))
}

impl RankLayer {
    /// `hidden_states [T, H]` → `[T, H]` f32 on this rank (collective on expert-parallel ranks:
    /// every rank calls it, with its own batch, possibly empty).
    pub fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        self.inner.forward(hidden)
    }

    /// `hidden [tokens, H]` f32 → `[tokens, H]` f32, as [`RankLayer::forward`]; a CPU layer
    /// reads the rows in place (no copy of the caller's memory), a GPU layer copies them to the
    /// device as `forward` does.
    pub fn forward_f32(&self, hidden: &[f32], tokens: usize) -> Result<Vec<f32>> {
        match &self.inner {
            Inner::Host(l) => l.forward_f32(hidden, tokens),
            inner => {
                if tokens.checked_mul(self.hidden) != Some(hidden.len()) {
                    let want = format!("[{tokens}, {}]", self.hidden);
                    return Err(MoeError::shape("hidden_states", want, format!("{} values", hidden.len())));
                }
                Ok(inner.forward(&Tensor::from_f32(&[tokens, self.hidden], hidden.to_vec())?)?.to_f32_vec())
            }
        }
    }

    /// `out [tokens, H]` = the layer on `x [tokens, H]`, both f32 device addresses on this
    /// rank's GPU, ordered on the caller's raw CUDA `stream` (see
    /// [`CudaMoeLayer::forward_device`]): no copy through host memory. For layers that run
    /// whole on the device (one GPU, or expert-parallel without dual-batch, TP-sliced or not;
    /// a TP rank passes its group's whole batch).
    pub fn forward_device(&self, x: u64, out: u64, tokens: usize, stream: u64) -> Result<()> {
        self.device()?.forward_device(x, out, tokens, stream)
    }

    /// [`RankLayer::forward_device`] on bf16 hidden states: `x` and `out` bf16 device addresses
    /// (see [`CudaMoeLayer::forward_device_bf16`]).
    pub fn forward_device_bf16(&self, x: u64, out: u64, tokens: usize, stream: u64) -> Result<()> {
        self.device()?.forward_device_bf16(x, out, tokens, stream)
    }

    /// The layer that runs whole on the device, for calls on device memory.
    fn device(&self) -> Result<&CudaMoeLayer> {
        match &self.inner {
            Inner::Device(layer) => Ok(layer),
            _ => Err(MoeError::Unsupported(format!(
                "device tensors run through layers whole on the device (one GPU, or expert-parallel without \
                 dual-batch); this one is: {}",
                self.description
            ))),
        }
    }

    /// Waits, up to `timeout`, for this rank's calls of [`RankLayer::forward_device`] that
    /// returned without waiting and for the work on the caller's raw CUDA `stream`, and reports
    /// the non-finite inputs or outputs they found (see
    /// [`CudaMoeLayer::synchronize_device`]). Nothing to wait for elsewhere.
    pub fn synchronize_device(&self, stream: u64, timeout: std::time::Duration) -> Result<()> {
        match &self.inner {
            Inner::Device(layer) => layer.synchronize_device(stream, timeout),
            _ => Ok(()),
        }
    }

    /// The layer's hidden size H.
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// Tokens per logical expert of this rank's last forward calls (its own tokens, wherever
    /// their experts run; with TP slicing, this TP rank's share).
    pub fn load_stats(&self) -> Result<crate::load_stats::LoadStats> {
        self.inner.load_stats()
    }

    /// Takes `placement` between forward calls, moving expert weights between the ranks
    /// (collective over the layer's expert-parallel group). CPU and host-staged layers built
    /// with [`ParallelConfig::rebalanceable`] (see [`MoeLayer::rebalance`]); device-resident
    /// GPU layers, TP-sliced or not, move their device buffers over NCCL (see
    /// [`CudaMoeLayer::rebalance`]); the dual-batch GPU layer refuses it.
    pub fn rebalance(&mut self, placement: Arc<ExpertPlacement>) -> Result<()> {
        self.inner.rebalance(placement)
    }

    /// The placement this rank's layer follows (`None` on one rank or one GPU, and for the
    /// dual-batch GPU layer).
    pub fn placement(&self) -> Option<Arc<ExpertPlacement>> {
        self.inner.placement()
    }

    /// One line naming the backend, the path and why, the strategy, layout and options.
    pub fn describe(&self) -> &str {
        &self.description
    }

    /// The device layer this rank runs, when it runs one whole (for timed runs).
    pub fn device_layer(&self) -> Option<&CudaMoeLayer> {
        self.inner.device()
    }

    /// The dual-batch device layer this rank runs, when it runs one (for timed runs).
    pub fn device_dual(&self) -> Option<&CudaDualBatch> {
        match &self.inner {
            Inner::DeviceDual(d) => Some(d),
            _ => None,
        }
    }

    /// Whether this rank slices its batch over a TP group: the device layer itself, or around
    /// the dual-batch halves.
    pub fn tp_sliced(&self) -> bool {
        match &self.inner {
            Inner::TpSlice { .. } => true,
            Inner::Device(l) => l.tp_size() > 1,
            _ => false,
        }
    }

    /// How many of a batch of `t` tokens this rank routes through its expert-parallel layer:
    /// its TP share when sliced, else all of them. (A TP-sliced device layer is still called
    /// with the whole batch: it slices the batch itself.)
    pub fn tokens_here(&self, t: usize) -> usize {
        match &self.inner {
            Inner::TpSlice { tp, .. } => {
                let (a, b) = share(t, tp.size(), tp.rank());
                b - a
            }
            Inner::Device(l) => l.tokens_routed(t),
            _ => t,
        }
    }
}

impl ParallelConfig {
    /// This rank's layer, chosen by the layout and `experts` (CPU, or the GPU a rank runs on):
    /// see [`RankLayer`]. `world` spans every rank of the layout (`None` for one rank, in
    /// which case `ep` must be 1). Collective over `world`. Bad layouts are refused before
    /// any communication.
    pub fn rank_layer(
        &self,
        world: Option<&dyn Communicator>,
        experts: ExpertsKind,
        spec: &RankLayerSpec<'_>,
    ) -> Result<RankLayer> {
        self.validate()?;
        let config = spec.config;
        config.validate()?;
        if let WeightSource::Given(w) = spec.weights {
            w.validate(config)?;
        }
        let placement = Arc::new(self.placement(config.num_experts)?);
        match world {
            None if self.ep != 1 => {
                return Err(MoeError::Config(format!("EP {} needs a communicator over its ranks", self.ep)))
            }
            Some(w) if w.size() != self.ep => {
                return Err(MoeError::Config(format!("world of {} ranks for EP {}", w.size(), self.ep)))
            }
            _ => {}
        }
        let gpu = match experts {
            ExpertsKind::Cuda { device } => Some(device),
            _ => None,
        };
        if spec.skew.is_some() && matches!(spec.weights, WeightSource::Given(_)) {
            return Err(MoeError::Config(
                "a skew in the layer spec is for weights generated on the device; given weights carry their own \
                 (Skew::apply)"
                    .into(),
            ));
        }
        if gpu.is_none() && (spec.fp8_experts || spec.fp8_rows || spec.fp8_shared_expert) {
            return Err(MoeError::Config("fp8 experts and rows are options of GPU layers".into()));
        }
        let Some(device) = gpu else {
            return self.host_layer(world, placement, experts, spec, format!("cpu: modular layer, {}", self.layout()));
        };
        match gpu_path(self) {
            GpuPath::OneGpu => {
                let mut layer = match spec.weights {
                    WeightSource::Given(w) => CudaMoeLayer::new_on_device(config, w, device, &spec.cuda)?,
                    WeightSource::DeviceRandom(seed) => {
                        CudaMoeLayer::random_on_device(config, seed, device, &spec.cuda)?
                    }
                };
                layer = fp8(skewed(layer, spec)?, spec, self.allow_nonfinite)?;
                let what = format!("cuda: one GPU, the whole layer on the device; options: {}", spec.cuda.describe());
                let inner = if self.dual_batch {
                    Inner::DeviceDual(Box::new(layer.dual_batch(None)?))
                } else {
                    Inner::Device(Box::new(layer))
                };
                Ok(RankLayer { inner, description: what, hidden: config.hidden })
            }
            GpuPath::HostStaged(why) => {
                let what = format!(
                    "cuda: host-staged (GPU experts, rows through host memory) because {why}; {}",
                    self.layout()
                );
                self.host_layer(world, placement, experts, spec, what)
            }
            GpuPath::DeviceResident => {
                let world = world.expect("EP > 1 has a world (checked above)");
                self.device_layer(world, placement, spec)
            }
        }
    }

    /// The modular layer (CPU or GPU experts) over `world`, or alone on one rank.
    fn host_layer(
        &self,
        world: Option<&dyn Communicator>,
        placement: Arc<ExpertPlacement>,
        experts: ExpertsKind,
        spec: &RankLayerSpec<'_>,
        description: String,
    ) -> Result<RankLayer> {
        let WeightSource::Given(weights) = spec.weights else {
            return Err(MoeError::Config(
                "weights generated on the device run only in device layers; this layout runs the modular layer".into(),
            ));
        };
        let layer = match world {
            Some(w) => self.layer(w, placement, spec.config, weights, experts, spec.chunk_size)?,
            None => {
                let one = crate::comm::run_ranks(1, Some(self.timeout), |c| {
                    self.layer(c, placement.clone(), spec.config, weights, experts, spec.chunk_size)
                });
                one.into_iter().next().expect("one rank")?
            }
        };
        Ok(RankLayer { inner: Inner::Host(Box::new(layer)), description, hidden: spec.config.hidden })
    }

    /// The device-resident layer of this layout on `world`'s GPU (NCCL ranks only).
    fn device_layer(
        &self,
        world: &dyn Communicator,
        placement: Arc<ExpertPlacement>,
        spec: &RankLayerSpec<'_>,
    ) -> Result<RankLayer> {
        let nccl = world.as_any().downcast_ref::<NcclComm>().ok_or_else(|| {
            MoeError::Config("GPU ranks of the device-resident layer need an NCCL communicator".into())
        })?;
        let rank = world.rank();
        // The TP group: consecutive ranks, split before the layer's own communicators. The
        // device layer all-gathers its shares over NCCL; around dual-batch halves the shares
        // are all-gathered through host memory.
        let (color, sliced) = (rank / self.tp, self.tp > 1);
        let tp_device = if sliced && !self.dual_batch { Some(nccl.split_nccl(color, rank)?) } else { None };
        let tp_host = if sliced && self.dual_batch { Some(world.split(color, rank)?) } else { None };
        let comm = nccl.duplicate()?;
        let mut layer = match spec.weights {
            WeightSource::Given(w) => CudaMoeLayer::new_ep(spec.config, w, comm, placement, &spec.cuda)?,
            WeightSource::DeviceRandom(seed) => {
                CudaMoeLayer::random_ep(spec.config, seed, comm, placement, &spec.cuda)?
            }
        };
        layer = fp8(skewed(layer, spec)?, spec, self.allow_nonfinite)?;
        layer = match self.strategy {
            StrategyKind::LowLatency => layer.low_latency(self.max_tokens_per_rank)?,
            StrategyKind::AllGather => layer.all_gather()?,
            StrategyKind::AllGatherLogits => layer.all_gather_logits()?,
            StrategyKind::Multicast => layer.multicast()?,
            StrategyKind::All2AllV => layer,
            StrategyKind::Auto => layer.auto(self.auto_table())?,
            StrategyKind::Local => unreachable!("validate refuses local on EP > 1"),
        };
        let inner = match (self.dual_batch, tp_device, tp_host) {
            (true, _, tp_host) => {
                let dual = Inner::DeviceDual(Box::new(layer.dual_batch(Some(nccl.duplicate()?))?));
                match tp_host {
                    Some(tp) => Inner::TpSlice { inner: Box::new(dual), tp },
                    None => dual,
                }
            }
            (false, Some(tp), _) => Inner::Device(Box::new(layer.tp_slice(tp)?)),
            (false, None, _) => Inner::Device(Box::new(layer)),
        };
        let tp_slicing = match (sliced, self.dual_batch) {
            (false, _) => "",
            (true, false) => "; TP slicing on the device (shares all-gathered over NCCL)",
            (true, true) => "; TP slicing around the dual-batch halves (shares all-gathered through host memory)",
        };
        let strategy = match self.strategy {
            StrategyKind::Auto => format!("auto [{}]", self.auto_table().describe()),
            s => s.name().to_string(),
        };
        let description = format!(
            "cuda: device-resident, route → {strategy} → experts (GEMM per batch: {}) → {strategy} over {}{tp_slicing}; {}; options: {}",
            spec.cuda.expert_gemm.name(),
            match spec.cuda.transport {
                crate::backend::cuda_options::Transport::Auto => "NVLink where every pair of GPUs has peer access, else NCCL",
                crate::backend::cuda_options::Transport::NvLink => "NVLink (peer memory)",
                crate::backend::cuda_options::Transport::Nccl => "NCCL",
            },
            self.layout(),
            spec.cuda.describe()
        );
        Ok(RankLayer { inner, description, hidden: spec.config.hidden })
    }

    /// The table `--strategy auto` follows: the layout's, or the built-in one for its EP size.
    pub fn auto_table(&self) -> crate::auto_strategy::AutoStrategy {
        self.auto.clone().unwrap_or_else(|| crate::auto_strategy::AutoStrategy::builtin(self.ep))
    }

    /// The layout in words: strategy, EP, TP, dual-batch, placement.
    pub fn layout(&self) -> String {
        let mut s = format!("{}, EP {}", self.strategy, self.ep);
        if self.tp > 1 {
            s += &format!(", TP {} (tokens sliced across TP ranks)", self.tp);
        }
        if self.strategy == StrategyKind::LowLatency {
            s += &format!(", capacity {} tokens a rank", self.max_tokens_per_rank);
        }
        if self.dual_batch {
            s += ", dual-batch overlap";
        }
        s += match &self.placement {
            PlacementKind::Contiguous => ", contiguous placement".to_string(),
            PlacementKind::RoundRobin => ", round-robin placement".to_string(),
            PlacementKind::File(p) => format!(", placement from {}", p.display()),
        }
        .as_str();
        if !self.redundant.is_empty() {
            s += &format!(", replicas of experts {:?}", self.redundant);
        }
        s
    }
}

/// `layer` with `spec`'s routing skew added to its router bias, if any.
fn skewed(layer: CudaMoeLayer, spec: &RankLayerSpec<'_>) -> Result<CudaMoeLayer> {
    match &spec.skew {
        Some(skew) => layer.skew_router(skew),
        None => Ok(layer),
    }
}

/// `layer` with fp8 experts, rows and shared expert where `spec` asks for them, returning non-finite outputs
/// where `allow_nonfinite` asks for it.
fn fp8(mut layer: CudaMoeLayer, spec: &RankLayerSpec<'_>, allow_nonfinite: bool) -> Result<CudaMoeLayer> {
    layer = layer.allow_nonfinite(allow_nonfinite);
    if spec.fp8_experts && !layer.has_fp8_experts() {
        layer = layer.fp8_experts()?;
    }
    if spec.fp8_rows {
        layer = layer.fp8_activations()?;
    }
    if spec.fp8_shared_expert {
        layer = layer.fp8_shared_expert()?;
    }
    Ok(layer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_layout_but_tp_skip_is_device_resident() {
        use StrategyKind::*;
        assert_eq!(gpu_path(&ParallelConfig::new(1, 1, Local)), GpuPath::OneGpu);
        assert_eq!(gpu_path(&ParallelConfig { dual_batch: true, ..ParallelConfig::new(1, 1, Local) }), GpuPath::OneGpu);
        for s in [All2AllV, AllGather, AllGatherLogits, Multicast, LowLatency] {
            for par in [
                ParallelConfig::new(2, 1, s),
                ParallelConfig::new(4, 2, s),
                ParallelConfig { placement: PlacementKind::RoundRobin, ..ParallelConfig::new(2, 1, s) },
                ParallelConfig { redundant: vec![0, 3], ..ParallelConfig::new(3, 1, s) },
                ParallelConfig { sequence_parallel: true, ..ParallelConfig::new(4, 2, s) },
            ] {
                assert_eq!(gpu_path(&par), GpuPath::DeviceResident, "{}", par.layout());
            }
            let dual = ParallelConfig { dual_batch: true, ..ParallelConfig::new(2, 1, s) };
            assert_eq!(gpu_path(&dual), GpuPath::DeviceResident, "{}", dual.layout());
        }
        let skip = ParallelConfig { tp_skip: true, ..ParallelConfig::new(4, 2, All2AllV) };
        assert!(matches!(gpu_path(&skip), GpuPath::HostStaged(w) if w.contains("tp_skip")));
    }

    #[test]
    fn shares_cover_the_batch_in_order() {
        for t in [0usize, 1, 5, 7, 64] {
            for ranks in 1..=4 {
                let shares: Vec<_> = (0..ranks).map(|r| share(t, ranks, r)).collect();
                assert_eq!(shares[0].0, 0);
                assert_eq!(shares[ranks - 1].1, t);
                assert!(shares.windows(2).all(|w| w[0].1 == w[1].0));
                let sizes: Vec<_> = shares.iter().map(|(a, b)| b - a).collect();
                assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1, "{t} over {ranks}");
                // The TP all-gather pads every share to the largest, and capacity checks see it.
                assert_eq!(largest_share(t, ranks), *sizes.iter().max().unwrap(), "{t} over {ranks}");
            }
        }
    }

    #[test]
    fn cpu_ranks_describe_their_layer_and_match_one_rank() {
        let mut config = crate::preset::preset("olmoe-1b-7b").unwrap().config.with_num_experts(8).unwrap();
        (config.hidden, config.inter, config.top_k) = (32, 16, 2);
        let weights = crate::preset::random_weights(&config, crate::DType::F32, 3);
        let spec = RankLayerSpec::new(&config, &weights);
        let x = Tensor::from_f32(&[5, 32], crate::preset::uniform(5 * 32, 1.0, 4)).unwrap();
        let one = ParallelConfig::default().rank_layer(None, ExpertsKind::Cpu, &spec).unwrap();
        assert!(one.describe().starts_with("cpu: modular layer, local, EP 1"), "{}", one.describe());
        assert!(one.device_layer().is_none() && !one.tp_sliced());
        let want = one.forward(&x).unwrap().to_f32_vec();
        assert_eq!(one.hidden(), 32);
        let rows = one.forward_f32(x.as_f32().unwrap(), 5).unwrap();
        assert!(rows.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
        let e = one.forward_f32(&x.as_f32().unwrap()[..40], 5).unwrap_err().to_string();
        assert!(e.contains("[5, 32]") && e.contains("40 values"), "{e}");
        let e = one.forward_f32(&[f32::NAN; 32], 1).unwrap_err().to_string();
        assert!(e.contains("non-finite") && e.contains("hidden_states"), "{e}");
        let par = ParallelConfig {
            placement: PlacementKind::RoundRobin,
            ..ParallelConfig::new(2, 1, StrategyKind::All2AllV)
        };
        let outs = crate::comm::run_ranks(2, None, |c| {
            let layer = par.rank_layer(Some(c), ExpertsKind::Cpu, &spec)?;
            assert!(layer.describe().contains("round-robin placement"), "{}", layer.describe());
            layer.forward(&x).map(|t| t.to_f32_vec())
        });
        for out in outs {
            assert!(out.unwrap().iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

    #[test]
    fn bad_requests_are_refused_before_any_communication() {
        let mut config = crate::preset::preset("olmoe-1b-7b").unwrap().config.with_num_experts(8).unwrap();
        (config.hidden, config.inter, config.top_k) = (32, 16, 2);
        let weights = crate::preset::random_weights(&config, crate::DType::F32, 3);
        let spec = RankLayerSpec::new(&config, &weights);
        let e = ParallelConfig::new(2, 1, StrategyKind::All2AllV).rank_layer(None, ExpertsKind::Cpu, &spec);
        assert!(e.err().unwrap().to_string().contains("needs a communicator"));
        let fp8 = RankLayerSpec { fp8_experts: true, ..spec.clone() };
        let e = ParallelConfig::default().rank_layer(None, ExpertsKind::Cpu, &fp8);
        assert!(e.err().unwrap().to_string().contains("GPU layers"));
        let skewed = RankLayerSpec { skew: Some(crate::skew::Skew::Zipf(1.2)), ..spec.clone() };
        let e = ParallelConfig::default().rank_layer(None, ExpertsKind::Cpu, &skewed);
        assert!(e.err().unwrap().to_string().contains("given weights carry their own"));
        let random = RankLayerSpec { weights: WeightSource::DeviceRandom(1), ..spec };
        let e = ParallelConfig::default().rank_layer(None, ExpertsKind::Cpu, &random);
        assert!(e.err().unwrap().to_string().contains("device layers"));
    }
}
