//! `moeflow run`: one MoE block of a Hugging Face checkpoint on hidden states from a file.

use crate::common::{device_resident, quantize_weights, split_tokens, Backend, ParallelArgs};
use moeflow::comm::CommExt;
use moeflow::model::{io, Checkpoint};
use moeflow::parallel::{on_ranks, RankHost};
use moeflow::quant::QuantConfig;
use moeflow::{DType, LayerOptions, MoeError, MoeLayer, Result, Tensor};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// Arguments of `moeflow run`.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Model directory (config.json + safetensors, single file or sharded).
    #[arg(long)]
    model: PathBuf,
    /// Decoder layer whose MoE block runs (default: the first MoE layer).
    #[arg(long)]
    layer: Option<usize>,
    /// safetensors file with `hidden_states` [T, H] (f32, bf16 or f16).
    #[arg(long)]
    input: PathBuf,
    /// Output safetensors file; gets `hidden_states` [T, H] in f32 (written atomically).
    #[arg(long)]
    output: PathBuf,
    /// Dtype the expert weights are held in: f32 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: DType,
    /// Rows given to the experts at a time.
    #[arg(long)]
    chunk_size: Option<usize>,
    #[command(flatten)]
    parallel: ParallelArgs,
    /// cpu, or cuda (one GPU per rank; expert weights in bf16).
    #[arg(long, value_enum, default_value = "cpu")]
    backend: Backend,
    /// Write the output even when it holds NaN or infinity (by default that is an error
    /// naming their count and the first one's position, and nothing is written).
    #[arg(long)]
    allow_nonfinite: bool,
}

pub fn run(args: RunArgs) -> Result<()> {
    run_block(args).map_err(|e| match e {
        MoeError::NonFiniteOutput { .. } => {
            MoeError::Format(format!("{e}; nothing was written (--allow-nonfinite writes it anyway)"))
        }
        e => e,
    })
}

fn run_block(args: RunArgs) -> Result<()> {
    args.parallel.check_bf16_matmul(args.dtype, args.backend == Backend::Cuda)?;
    let ckpt = Checkpoint::open(&args.model)?;
    let x = io::read_hidden_states(&args.input, "hidden_states")?;
    // With a quantization asked for, quantized checkpoint weights stay as stored (DeepSeek fp8
    // blocks, GPT-OSS MXFP4); other weights load as --dtype and are quantized below.
    let mut block = match args.parallel.quant {
        QuantConfig::None => ckpt.load_moe_block(args.layer, args.dtype)?,
        _ => ckpt.load_moe_block_quantized(args.layer).or_else(|_| ckpt.load_moe_block(args.layer, args.dtype))?,
    };
    quantize_weights(&mut block.weights, args.parallel.quant)?;
    let (t, h) = (x.shape()[0], x.shape()[1]);
    if h != block.config.hidden {
        return Err(MoeError::shape(
            format!("hidden_states in {}", args.input.display()),
            format!("[T, {}] (the model's hidden size)", block.config.hidden),
            x.shape(),
        ));
    }
    let groups = args.parallel.ep / args.parallel.tp.max(1);
    let par = moeflow::parallel::ParallelConfig {
        allow_nonfinite: args.allow_nonfinite,
        ..args.parallel.config(t.div_ceil(groups.max(1)))?
    };
    let start = Instant::now();
    let gpu = args.backend == Backend::Cuda;
    if gpu && par.quant != moeflow::quant::QuantConfig::None {
        return Err(MoeError::Unsupported("--quant on --backend cuda: GPU layers quantize GEMM rows only in `bench` (fp8-block with --dtype f8e4m3, W8A8)".into()));
    }
    let host = RankHost::detect(gpu)?;
    // GPU ranks over NCCL run the device-resident layer where it covers the layout.
    let on_device = gpu && device_resident(&par, block.config.num_experts);
    let out = if gpu && par.ep == 1 && !par.dual_batch && host == RankHost::Gpus {
        moeflow::backend::cuda::CudaMoeLayer::new(&block.config, &block.weights)?
            .allow_nonfinite(args.allow_nonfinite)
            .forward(&x)?
    } else if par.ep == 1 && !par.dual_batch && host == RankHost::Threads {
        let layer = MoeLayer::new(
            &block.config,
            &block.weights,
            LayerOptions {
                chunk_size: args.chunk_size,
                quant: par.quant,
                defer_input_quant: par.defer_input_quant,
                bf16_matmul: par.bf16_matmul,
                allow_nonfinite: args.allow_nonfinite,
                ..Default::default()
            },
        )?;
        layer.forward(&x)?
    } else {
        let xs = x.to_f32_vec();
        let shares = split_tokens(t, par.ep / par.tp);
        let placement = Arc::new(par.placement(block.config.num_experts)?);
        let results = on_ranks(&host, par.ep, par.timeout, |comm, kind| {
            let (a, b) = shares[comm.rank() / par.tp];
            let share = Tensor::from_f32(&[b - a, h], xs[a * h..b * h].to_vec())?;
            let rows = if on_device {
                device_forward(comm, &par, &block.config, &block.weights, &share)?
            } else {
                let layer = par.layer(comm, placement.clone(), &block.config, &block.weights, kind, args.chunk_size)?;
                layer.forward(&share)?
            }
            .to_f32_vec();
            // Every rank gets the whole output: each DP group's rows, once (from its first TP
            // rank), in rank order, which is token order.
            let mine = if comm.rank() % par.tp == 0 { rows } else { Vec::new() };
            Ok(comm.all_gather_vec("run.output", &mine)?.concat())
        });
        let mut full = None;
        for (_, r) in results {
            let r = r?;
            full.get_or_insert(r);
        }
        Tensor::from_f32(&[t, h], full.ok_or_else(|| MoeError::Config("no ranks".into()))?)?
    };
    // In a launched job rank 0 writes the file.
    if host.launched_rank().is_some_and(|r| r != 0) {
        return Ok(());
    }
    let secs = start.elapsed().as_secs_f64();
    if !args.allow_nonfinite {
        moeflow::error::check_output(&out.to_f32_vec(), h)?;
    }
    io::write_f32_atomic(&args.output, &[("hidden_states", &out)])?;
    println!(
        "{} layer {}: {t} tokens through {} experts (top-{}), EP {} {}{}, {:.2} ms -> {}",
        ckpt.architecture()?.name(),
        block.layer,
        block.config.num_experts,
        block.config.top_k,
        par.ep,
        par.strategy,
        if on_device { " (device-resident)" } else { "" },
        secs * 1e3,
        args.output.display()
    );
    Ok(())
}

/// This rank's share through the device-resident expert-parallel layer (NCCL ranks only):
/// all-to-all-v, all-gather (of ids or logits) or multicast, optionally as two micro-batches,
/// or the low-latency form with `--max-tokens-per-rank` as its capacity.
fn device_forward(
    comm: &dyn moeflow::comm::Communicator,
    par: &moeflow::parallel::ParallelConfig,
    config: &moeflow::MoeConfig,
    weights: &moeflow::MoeWeights,
    share: &Tensor,
) -> Result<Tensor> {
    use moeflow::backend::cuda::{CudaMoeLayer, NcclComm};
    use moeflow::parallel::StrategyKind;
    let nccl = comm
        .as_any()
        .downcast_ref::<NcclComm>()
        .ok_or_else(|| MoeError::Config("the device-resident layer needs NCCL ranks".into()))?;
    let mut layer = CudaMoeLayer::new_ep(config, weights, nccl.duplicate()?)?.allow_nonfinite(par.allow_nonfinite);
    match par.strategy {
        StrategyKind::LowLatency => layer = layer.low_latency(par.max_tokens_per_rank)?,
        StrategyKind::AllGather => layer = layer.all_gather()?,
        StrategyKind::AllGatherLogits => layer = layer.all_gather_logits()?,
        StrategyKind::Multicast => layer = layer.multicast()?,
        _ => {}
    }
    if par.dual_batch {
        layer.dual_batch(Some(nccl.duplicate()?))?.forward(share)
    } else {
        layer.forward(share)
    }
}
