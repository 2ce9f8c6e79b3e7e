//! `moeflow run`: one MoE block of a Hugging Face checkpoint on hidden states from a file.

use crate::common::{quantize_weights, split_tokens, Backend, ParallelArgs};
use moeflow::comm::CommExt;
use moeflow::model::{io, Checkpoint};
use moeflow::parallel::{on_ranks, RankHost};
use moeflow::quant::QuantConfig;
use moeflow::{DType, ExpertsKind, LoadRecord, MoeError, RankLayerSpec, Result, Tensor};
use std::path::PathBuf;
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
    /// Write every rank's tokens per logical expert (the load statistics) as JSON to this file,
    /// the input of `moeflow eplb --load`.
    #[arg(long)]
    record_load: Option<PathBuf>,
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
    // GPU layers quantize their rows only as fp8-block, with the experts in fp8 too (W8A8).
    let w8a8 = gpu && par.quant == QuantConfig::Fp8Block;
    if gpu && par.quant != QuantConfig::None && !w8a8 {
        return Err(MoeError::Unsupported(format!(
            "--quant {} on --backend cuda: GPU layers quantize their rows only as fp8-block (W8A8, fp8 experts)",
            par.quant
        )));
    }
    let host = RankHost::detect(gpu, crate::common::launch_env()?);
    let spec = RankLayerSpec {
        chunk_size: args.chunk_size,
        cuda: crate::cuda_args::cuda_options(&args.parallel)?,
        fp8_experts: w8a8,
        fp8_rows: w8a8,
        fp8_shared_expert: w8a8,
        ..RankLayerSpec::new(&block.config, &block.weights)
    };
    // The library picks each rank's layer; `path` is the line saying which.
    let (out, path, load) = if par.ep == 1 && host.launched_rank().is_none() {
        let experts = if gpu { ExpertsKind::Cuda { device: 0 } } else { ExpertsKind::Cpu };
        let layer = par.rank_layer(None, experts, &spec)?;
        let out = layer.forward(&x)?;
        let load = match args.record_load {
            Some(_) => Some(LoadRecord::from_ranks(&block.config, vec![layer.load_stats()?])),
            None => None,
        };
        (out, layer.describe().to_string(), load)
    } else {
        let xs = x.to_f32_vec();
        let shares = split_tokens(t, par.ep / par.tp);
        let results = on_ranks(&host, par.ep, par.timeout, |comm, kind| {
            let (a, b) = shares[comm.rank() / par.tp];
            let share = Tensor::from_f32(&[b - a, h], xs[a * h..b * h].to_vec())?;
            let layer = par.rank_layer(Some(comm), kind, &spec)?;
            let rows = layer.forward(&share)?.to_f32_vec();
            // Every rank gets the whole output: each DP group's rows, once (from its first TP
            // rank), in rank order, which is token order.
            let mine = if comm.rank() % par.tp == 0 { rows } else { Vec::new() };
            let load = match args.record_load {
                Some(_) => Some(LoadRecord::gather(&block.config, comm, &layer.load_stats()?)?),
                None => None,
            };
            Ok((comm.all_gather_vec("run.output", &mine)?.concat(), layer.describe().to_string(), load))
        });
        let mut full = None;
        for (_, r) in results {
            let r = r?;
            full.get_or_insert(r);
        }
        let (rows, path, load) = full.ok_or_else(|| MoeError::Config("no ranks".into()))?;
        (Tensor::from_f32(&[t, h], rows)?, path, load)
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
    if let (Some(file), Some(load)) = (&args.record_load, &load) {
        load.write(file)?;
        println!("wrote the load statistics of {} ranks to {}", load.ranks.len(), file.display());
    }
    println!(
        "{} layer {}: {t} tokens through {} experts (top-{}), {:.2} ms -> {}\n  {path}",
        ckpt.architecture()?.name(),
        block.layer,
        block.config.num_experts,
        block.config.top_k,
        secs * 1e3,
        args.output.display()
    );
    Ok(())
}
