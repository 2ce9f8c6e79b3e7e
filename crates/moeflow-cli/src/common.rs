//! Pieces shared by subcommands: layer construction from a preset, progress, statistics.

use indicatif::{ProgressBar, ProgressStyle};
use moeflow::parallel::{ParallelConfig, PlacementKind, StrategyKind};
use moeflow::quant::QuantConfig;
use moeflow::{preset, Bf16Matmul, DType, MoeConfig, MoeError, MoeWeights, Result};
use std::time::Duration;

/// Options that pick a layer: preset, weight dtype, expert count override, seed.
#[derive(clap::Args, Clone, Debug)]
pub struct LayerArgs {
    /// Layer shape (olmoe-1b-7b, qwen3-30b-a3b, mixtral-8x7b, gpt-oss-120b, deepseek-v3).
    #[arg(long, default_value = "olmoe-1b-7b")]
    pub preset: String,
    /// Weight dtype: f32 or bf16 (and, for `bench --backend cuda` on one GPU or with
    /// `--strategy lowlatency`, f8e4m3: routed experts in fp8 with 128×128 block scales).
    #[arg(long, default_value = "bf16")]
    pub dtype: DType,
    /// Use this many experts instead of the preset's (for machines that cannot hold them all).
    #[arg(long)]
    pub experts: Option<usize>,
    /// Seed of the random weights and inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Leave out the preset's shared expert (to time the routed experts alone).
    #[arg(long)]
    pub no_shared_expert: bool,
    /// Rows given to the experts at a time.
    #[arg(long)]
    pub chunk_size: Option<usize>,
    #[command(flatten)]
    pub skew: SkewArg,
}

/// Skewed routing of the random weights (`demo`, `bench`, `check`).
#[derive(clap::Args, Clone, Debug)]
pub struct SkewArg {
    /// Skew the routing by a bias on the router logits (added to the gate bias):
    /// `zipf:S` adds -S·ln(1+e) to expert e's logit (softmax scores times (1+e)^-S, expert 0
    /// hottest); `hot:E1,E2:P` adds one bias to the listed experts, fitted by bisection so
    /// that they take a share P of all (token, slot) pairs of 512 calibration tokens.
    #[arg(long)]
    pub skew: Option<moeflow::skew::Skew>,
}

impl SkewArg {
    /// Adds the skew's bias to `weights`, saying so.
    pub fn apply(&self, config: &MoeConfig, weights: &mut MoeWeights) -> Result<()> {
        if let Some(skew) = &self.skew {
            skew.apply(config, weights)?;
            println!("  routing skewed  {skew} (a bias on the router logits)");
        }
        Ok(())
    }
}

impl LayerArgs {
    /// The configuration, with the expert and shared-expert overrides applied.
    pub fn config(&self) -> Result<(preset::Preset, MoeConfig)> {
        let p = preset::preset(&self.preset)?;
        let mut config = match self.experts {
            Some(n) => p.config.with_num_experts(n)?,
            None => p.config.clone(),
        };
        if self.no_shared_expert {
            config.shared = None;
        }
        Ok((p, config))
    }

    /// Random weights for `config`, refusing early when they would not fit in memory.
    pub fn weights(&self, config: &MoeConfig) -> Result<MoeWeights> {
        if !matches!(self.dtype, DType::F32 | DType::BF16) {
            return Err(MoeError::Config(format!("--dtype must be f32 or bf16, got {}", self.dtype)));
        }
        let bytes = preset::weight_bytes(config, self.dtype);
        // The weights are held twice: as generated and packed for the GEMM.
        if let Some(avail) = moeflow::memory::available() {
            let needed = config.weight_bytes(self.dtype).saturating_mul(2);
            if needed > avail * 9 / 10 {
                return Err(MoeError::OutOfMemory {
                    what: format!(
                        "{} weights ({} experts, twice: as generated and packed; pass --experts N to use fewer experts)",
                        self.preset, config.num_experts
                    ),
                    needed,
                    available: Some(avail),
                });
            }
        }
        let bar = spinner(format!("generating {:.2} GiB of random {} weights", gib(bytes), self.dtype));
        let mut w = preset::try_random_weights(config, self.dtype, self.seed)?;
        bar.finish_and_clear();
        even_correction_bias(&mut w)?;
        self.skew.apply(config, &mut w)?;
        Ok(w)
    }
}

/// Zeroes a random layer's DeepSeek correction bias. A trained model's bias evens the experts'
/// loads, and under a random gate, where every expert is alike in expectation, the bias that
/// does so is zero; the library draws it at random to exercise it in tests, which would skew a
/// benchmark's experts (docs/tuning.md, "The random layer routes every expert alike"). `--skew`
/// skews them on purpose.
fn even_correction_bias(weights: &mut MoeWeights) -> Result<()> {
    if let Some(bias) = &weights.correction_bias {
        let e = bias.elem_count();
        weights.correction_bias = Some(moeflow::Tensor::from_f32(&[e], vec![0.0; e])?);
    }
    Ok(())
}

/// The launcher's variables, when this process is one rank of a launched job: the one place
/// the command line reads the environment (the variables are listed in `moeflow --help`).
pub fn launch_env() -> Result<Option<moeflow::comm::LaunchEnv>> {
    moeflow::comm::LaunchEnv::from_vars(|name| std::env::var(name).ok())
}

/// Bytes as GiB.
pub fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// A spinner for work that may take more than a second (hidden when not on a terminal).
pub fn spinner(msg: String) -> ProgressBar {
    let bar = ProgressBar::new_spinner().with_message(msg);
    bar.set_style(ProgressStyle::with_template("{spinner} {msg} [{elapsed}]").expect("valid template"));
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

/// A bar over `n` steps.
pub fn bar(n: u64, msg: String) -> ProgressBar {
    let bar = ProgressBar::new(n).with_message(msg);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} [{elapsed}]")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar
}

/// Median of `v` (sorted copy); 0 for empty input.
pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        0.5 * (s[n / 2 - 1] + s[n / 2])
    }
}

/// Where the layer runs.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Host threads.
    Cpu,
    /// One NVIDIA GPU (needs a build with `--features cuda`).
    Cuda,
}

/// Options that pick a parallel layout.
#[derive(clap::Args, Clone, Debug)]
pub struct ParallelArgs {
    /// Expert-parallel ranks (in-process threads on CPU).
    #[arg(long, default_value_t = 1)]
    pub ep: usize,
    /// Tensor-parallel ranks per DP group (must divide --ep).
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Dispatch/combine strategy: local, allgather, allgather-logits, multicast, all2allv,
    /// lowlatency, or auto (GPU ranks: one per batch from --strategy-table, or a built-in
    /// table) (default: local on one rank, all2allv otherwise).
    #[arg(long)]
    pub strategy: Option<StrategyKind>,
    /// The crossover table `--strategy auto` follows, as `bench --calibrate FILE` writes it.
    #[arg(long)]
    pub strategy_table: Option<std::path::PathBuf>,
    /// Expert placement: contiguous, round-robin, or a JSON file {"num_experts": E, "ranks": [[...], ...]}.
    #[arg(long, default_value = "contiguous")]
    pub placement: PlacementKind,
    /// Experts to give one redundant replica, comma separated.
    #[arg(long, value_delimiter = ',')]
    pub redundant: Vec<usize>,
    /// Two micro-batches overlapping communication and compute.
    #[arg(long)]
    pub dual_batch: bool,
    /// Token capacity per rank of the lowlatency strategy (default: the largest batch asked for).
    #[arg(long)]
    pub max_tokens_per_rank: Option<usize>,
    /// With TP: gather over the EP group after TP slicing (allgather).
    #[arg(long)]
    pub sequence_parallel: bool,
    /// Quantization: none, int8 (int8 rows, int8 per-channel weights), fp8 / fp8-block / mxfp8
    /// (fp8 rows per token / per 128 / per 32 with e8m0 scales, fp8 128×128-block weights).
    #[arg(long, default_value = "none")]
    pub quant: QuantConfig,
    /// Send rows unquantized and let the experts quantize them on arrival.
    #[arg(long)]
    pub defer_input_quant: bool,
    /// How CPU experts multiply bf16 weights: dot (activations rounded to bf16, bf16 products
    /// summed in f32, as GPUs do; twice the f32 rate on AMD Zen 4), widen (activations in
    /// f32, weights widened exactly), or auto (dot on AMD CPUs with AVX512-BF16, where it is
    /// twice as fast).
    #[arg(long, default_value = "auto")]
    pub bf16_matmul: Bf16Matmul,
    /// Deadline of every collective, seconds: a rank that does not answer in time fails the
    /// job with an error naming the operation.
    #[arg(long, default_value_t = 60.0)]
    pub timeout: f64,
    /// GPU layers: bit-identical outputs whatever the EP size, TP, placement, replicas and
    /// batch (fixed-order router and shared-expert kernels, the Hopper GEMM in fixed tiles,
    /// expert rows summed at home in slot order; all2allv dispatch). CPU layers always are.
    #[arg(long)]
    pub deterministic: bool,
    /// GPU expert parallelism: how rows move between GPUs. nvlink: kernels write them straight
    /// into the peer GPUs' memory (peer access or CUDA IPC); nccl: NCCL send/receive; auto:
    /// nvlink when every pair of GPUs has peer access, else nccl.
    #[arg(long, default_value = "auto")]
    pub transport: moeflow::backend::cuda_options::Transport,
}

/// Quantizes the routed experts of `weights` for `quant` unless they already are.
pub fn quantize_weights(weights: &mut MoeWeights, quant: QuantConfig) -> Result<()> {
    if let (Some(format), None) = (quant.weight_format(), &weights.experts.quant) {
        weights.experts = weights.experts.quantized(format)?;
    }
    Ok(())
}

/// Refuses an explicit `--bf16-matmul` (not `auto`) that cannot apply: GPU layers (they always
/// take bf16 products), weights that are not bf16, or quantized weights.
pub fn check_bf16_matmul(mode: Bf16Matmul, dtype: DType, quant: QuantConfig, gpu: bool) -> Result<()> {
    let why = if mode == Bf16Matmul::Auto {
        return Ok(());
    } else if gpu {
        "GPU layers always multiply in bf16".to_string()
    } else if dtype != DType::BF16 {
        format!("these weights are {dtype}")
    } else if quant != QuantConfig::None {
        format!("--quant {quant} quantizes the weights")
    } else {
        return Ok(());
    };
    Err(MoeError::Config(format!("--bf16-matmul {mode} applies to bf16 weights of CPU experts; {why}")))
}

/// Relative error bound of a quantized layer: twice the activation and weight half-steps (see
/// tests/quant.rs), plus f32 rounding.
pub fn quant_bound(quant: QuantConfig) -> f64 {
    2.0 * (quant.step() + quant.weight_format().map_or(0.0, |w| w.step())) + F32_TOLERANCE
}

/// Relative error bound against the f64 reference of a layer whose arithmetic is f32:
/// accumulation over at most a few thousand terms.
pub const F32_TOLERANCE: f64 = 2e-5;

/// Relative error bound when activations and GEMM inputs are rounded to bf16 (2^-8) a few
/// times: GPU layers, and CPU experts taking bf16 dot products.
pub const BF16_TOLERANCE: f64 = 2.5e-2;

/// The error bound of a CPU layer against the f64 reference: quantized, bf16 dot products
/// (bf16 weights under `bf16`), or f32 arithmetic.
pub fn cpu_bound(quant: QuantConfig, dtype: DType, bf16: Bf16Matmul) -> f64 {
    match quant {
        QuantConfig::None if dtype == DType::BF16 && bf16.uses_dot() => BF16_TOLERANCE,
        QuantConfig::None => F32_TOLERANCE,
        q => quant_bound(q),
    }
}

impl ParallelArgs {
    /// Refuses an explicit `--bf16-matmul` that cannot apply to this run (see
    /// [`check_bf16_matmul`]).
    pub fn check_bf16_matmul(&self, dtype: DType, gpu: bool) -> Result<()> {
        check_bf16_matmul(self.bf16_matmul, dtype, self.quant, gpu)
    }

    /// The layout; `largest_batch` sizes the low-latency capacity unless given.
    pub fn config(&self, largest_batch: usize) -> Result<ParallelConfig> {
        let strategy = self.strategy.unwrap_or(if self.ep == 1 { StrategyKind::Local } else { StrategyKind::All2AllV });
        let p = ParallelConfig {
            placement: self.placement.clone(),
            redundant: self.redundant.clone(),
            dual_batch: self.dual_batch,
            max_tokens_per_rank: self.max_tokens_per_rank.unwrap_or(largest_batch.max(1)),
            sequence_parallel: self.sequence_parallel,
            quant: self.quant,
            defer_input_quant: self.defer_input_quant,
            bf16_matmul: self.bf16_matmul,
            timeout: std::time::Duration::try_from_secs_f64(self.timeout).ok().filter(|t| !t.is_zero()).ok_or_else(
                || MoeError::Config(format!("--timeout {:?} is not a positive number of seconds", self.timeout)),
            )?,
            auto: match &self.strategy_table {
                Some(file) => Some(moeflow::auto_strategy::AutoStrategy::from_json(
                    &std::fs::read_to_string(file)
                        .map_err(|e| MoeError::Config(format!("reading --strategy-table {}: {e}", file.display())))?,
                )?),
                None => None,
            },
            ..ParallelConfig::new(self.ep, self.tp, strategy)
        };
        p.validate()?;
        Ok(p)
    }
}

/// Splits `tokens` over `groups` DP groups: contiguous, the first groups one larger.
pub fn split_tokens(tokens: usize, groups: usize) -> Vec<(usize, usize)> {
    (0..groups).map(|g| moeflow::rank_layer::share(tokens, groups, g)).collect()
}

#[cfg(test)]
mod tests {
    use super::even_correction_bias;
    use moeflow::{preset, DType, MoeConfig};

    /// The command line's random DeepSeek layer routes with a zero correction bias, where the
    /// library's random weights draw one.
    #[test]
    fn random_deepseek_layers_route_without_a_correction_bias() {
        let deepseek = preset::preset("deepseek-v3").unwrap().config.with_num_experts(16).unwrap();
        let config = MoeConfig { hidden: 64, inter: 32, shared: None, ..deepseek };
        let mut weights = preset::random_weights(&config, DType::F32, 5);
        let drawn = weights.correction_bias.as_ref().unwrap().to_f32_vec();
        assert!(drawn.iter().any(|&b| b != 0.0), "the library draws a bias: {drawn:?}");
        even_correction_bias(&mut weights).unwrap();
        let bias = weights.correction_bias.as_ref().unwrap().to_f32_vec();
        assert_eq!(bias, vec![0.0; 16]);
    }
}
