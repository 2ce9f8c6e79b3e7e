//! `moeflow bench`: layer time over token counts, against this machine's measured ceilings.
//! With `--ep N` the layer runs on N in-process ranks, `--tokens` counting tokens per DP group.
//! This file holds the arguments, the records and the CPU (and host-staged) runs; [`cuda`] the
//! device-resident GPU layers, [`torch`] the PyTorch baselines run beside them.

mod cuda;
mod torch;

use cuda::{gpu_fp8_rows, run_cuda, run_cuda_ep};
use torch::{check_torch_baseline, torch_single_baseline};

use crate::common::{bar, median, quantize_weights, spinner, Backend, LayerArgs, ParallelArgs};
use moeflow::backend::cpu::ceiling;
use moeflow::comm::CommExt;
use moeflow::parallel::{on_ranks, RankHost};
use moeflow::rank_layer::{gpu_path, GpuPath};
use moeflow::{preset, DType, MoeError, MoeLayer, Result, StageTimes, Tensor};
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;

/// Arguments of `moeflow bench`.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    layer: LayerArgs,
    #[command(flatten)]
    parallel: ParallelArgs,
    /// Token counts (per DP group), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,32,256")]
    tokens: Vec<usize>,
    /// Write the records as a JSON array to this file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Timed runs at least (after one warm-up run).
    #[arg(long, default_value_t = 5)]
    min_runs: usize,
    /// Keep running until this many seconds have been timed (per token count).
    #[arg(long, default_value_t = 1.0)]
    min_seconds: f64,
    /// cpu, or cuda (one GPU per rank; weights generated on the device in bf16).
    #[arg(long, value_enum, default_value = "cpu")]
    backend: Backend,
    /// With --backend cuda and --ep > 1: run the modular layer with rows through host memory
    /// (every strategy) instead of the device-resident all-to-all-v layer.
    #[arg(long)]
    host_staged: bool,
    /// After the run, run the same shapes through a PyTorch layer and print the ratio: on one
    /// CPU rank tools/torch_cpu_baseline.py, on one GPU tools/torch_gpu_baseline.py (argsort,
    /// torch._grouped_mm), after the device-resident multi-GPU layer a PyTorch + NCCL layer
    /// (all_to_all_single, torch._grouped_mm; tools/torch_ep_baseline.py).
    #[arg(long)]
    torch_baseline: bool,
}

/// Writes `records` to `path` as a pretty JSON array.
fn write_records(path: &std::path::Path, records: &[Record]) -> Result<()> {
    let text = serde_json::to_string_pretty(records)
        .map_err(|e| MoeError::Json { context: "bench records".into(), source: e })?;
    std::fs::write(path, text + "\n")
        .map_err(|e| MoeError::Io { context: format!("writing {}", path.display()), source: e })
}

/// One measured configuration (the schema every bench writes).
#[derive(Serialize, Debug)]
pub struct Record {
    pub preset: String,
    pub backend: String,
    pub dtype: String,
    /// Tokens per DP group.
    pub tokens: usize,
    pub ep: usize,
    pub tp: usize,
    pub strategy: String,
    /// Quantization of activations (and weights).
    pub quant: String,
    /// Relative error against the unquantized f32 path (single rank, quantized runs only).
    pub rel_error: Option<f64>,
    /// Median layer time (slowest rank).
    pub ms: f64,
    /// Whole-layer GFLOP/s (all DP groups' tokens).
    pub gflops: f64,
    /// Fraction of the measured dense matmul rate.
    pub matmul_fraction: f64,
    /// max(FLOPs at the matmul rate, weight bytes at the copy bandwidth).
    pub floor_ms: f64,
    /// GPU: the same floor with the GEMM rate a GPU holds under sustained load (its power cap
    /// lowers the clocks within a second), the rate a long run of GEMMs can reach.
    pub floor_sustained_ms: Option<f64>,
    pub runs: usize,
    /// Median time of each stage on rank 0, ms.
    pub stages_ms: StageTimes,
    /// Bytes rank 0 sent per forward (dispatch and combine).
    pub bytes_moved_per_rank: usize,
    /// Those bytes over rank 0's prepare + finalize time, GB/s.
    pub comm_gbps: Option<f64>,
    /// CPU experts with bf16 weights: `dot` (bf16 dot products) or `widen` (f32 arithmetic).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bf16_matmul: Option<String>,
}

/// Per token count: run times (s), stage times of rank 0, bytes moved by rank 0.
struct Measured {
    totals: Vec<f64>,
    stages: Vec<StageTimes>,
    bytes: usize,
}

/// Runs `forward` until `min_runs` and `min_seconds` are met (after a warm-up); `forward`
/// returns (seconds, stages, bytes). `agree` turns this rank's wish to go on into the group's
/// decision, so every rank runs the same iterations.
fn time_loop(
    args: &BenchArgs,
    label: String,
    agree: impl Fn(bool) -> Result<bool>,
    mut forward: impl FnMut() -> Result<(f64, StageTimes, usize)>,
) -> Result<Measured> {
    forward()?;
    let progress = bar(args.min_runs as u64, label);
    let mut m = Measured { totals: Vec::new(), stages: Vec::new(), bytes: 0 };
    let started = Instant::now();
    while agree(
        m.totals.len() < args.min_runs || (started.elapsed().as_secs_f64() < args.min_seconds && m.totals.len() < 1000),
    )? {
        let (secs, st, bytes) = forward()?;
        m.totals.push(secs);
        m.stages.push(st);
        m.bytes = bytes;
        progress.set_length(progress.length().unwrap_or(0).max(m.totals.len() as u64));
        progress.inc(1);
    }
    progress.finish_and_clear();
    Ok(m)
}

pub fn run(args: BenchArgs) -> Result<()> {
    if args.tokens.is_empty() {
        return Err(MoeError::Config("--tokens needs at least one count".into()));
    }
    // Every DP group's tokens live in this process (in-process ranks): refuse a batch that
    // cannot fit before generating anything.
    let groups = (args.parallel.ep / args.parallel.tp.max(1)).max(1);
    let (_, config) = args.layer.config()?;
    for &t in &args.tokens {
        config.check_batch(t.saturating_mul(groups))?;
    }
    let gpu = args.backend == Backend::Cuda;
    args.parallel.check_bf16_matmul(args.layer.dtype, gpu)?;
    let host = RankHost::detect(gpu, crate::common::launch_env()?);
    if args.torch_baseline {
        check_torch_baseline(&args, gpu, &host)?;
    }
    if gpu && args.parallel.ep == 1 && host == RankHost::Gpus {
        return run_cuda(&args);
    }
    if gpu && args.parallel.quant != moeflow::quant::QuantConfig::None {
        // Quantized rows run only in the device-resident layers (W8A8, in run_cuda_ep).
        let lowlatency = args.parallel.strategy == Some(moeflow::parallel::StrategyKind::LowLatency);
        gpu_fp8_rows(args.parallel.quant, args.layer.dtype == DType::F8E4M3 && lowlatency && !args.host_staged)?;
    }
    if gpu && !args.host_staged {
        let par = args.parallel.config(1)?;
        let why = match gpu_path(&par) {
            GpuPath::DeviceResident | GpuPath::OneGpu => return run_cuda_ep(&args, &host),
            GpuPath::HostStaged(why) => why,
        };
        if args.torch_baseline {
            return Err(MoeError::Config(
                "--torch-baseline compares the device-resident layer; this layout runs host-staged".into(),
            ));
        }
        println!("note: this layout runs host-staged (rows through host memory) because {why}");
    }
    let (p, config) = args.layer.config()?;
    let par = args.parallel.config(args.tokens.iter().copied().max().unwrap_or(1))?;
    let mut weights = args.layer.weights(&config)?;
    // The unquantized path, to measure the quantized one's error against.
    let f32_path = if par.quant != moeflow::quant::QuantConfig::None && par.ep == 1 {
        let f32_options = moeflow::LayerOptions { bf16_matmul: moeflow::Bf16Matmul::Widen, ..Default::default() };
        Some(MoeLayer::new(&config, &weights, f32_options)?)
    } else {
        None
    };
    quantize_weights(&mut weights, par.quant)?;
    let mut errors: Vec<Option<f64>> = Vec::new();
    // The ceilings: this machine's matmul and copy rates, or the GPU's GEMM and copy rates.
    let device = match &host {
        RankHost::Launched { env, .. } => env.local_rank,
        _ => 0,
    };
    let bar0 = spinner("measuring the matmul rate and copy bandwidth".into());
    // The compute floor uses the cores' peak for the instructions the experts run where it was
    // measured (no GEMM beats it): the bf16 dot-product peak when bf16 weights take dot
    // products, else the FMA peak; else the matmul rate.
    let bf16_cpu = !gpu && args.layer.dtype == DType::BF16 && par.quant == moeflow::quant::QuantConfig::None;
    let dot = bf16_cpu && par.bf16_matmul.uses_dot();
    let (matmul_gflops, copy_gbps, ceiling_name, fma_peak, dot_peak) = if gpu {
        let c = moeflow::backend::cuda::measure_ceilings(device)?;
        (c.gemm_tflops * 1e3, c.copy_gbps, "cuBLAS bf16 8192³", None, None)
    } else {
        let host = ceiling::measure();
        (host.matmul_gflops, host.copy_gbps, "gemm crate, f32", host.fma_peak_gflops, host.bf16_dot_peak_gflops)
    };
    let compute_gflops = if dot { dot_peak } else { None }.or(fma_peak).unwrap_or(matmul_gflops);
    bar0.finish_and_clear();
    let groups = par.ep / par.tp;
    let rank0 = host.launched_rank().is_none_or(|r| r == 0);
    if rank0 {
        println!(
            "moeflow bench: {} on {}, {} weights{}, EP {} TP {} {}, quant {}; matmul {:.1} GFLOP/s ({ceiling_name}){}{}, copy {:.1} GB/s",
            p.name,
            match &host {
                RankHost::Threads => format!("cpu ({} threads)", rayon::current_num_threads()),
                RankHost::Gpus => format!("{} GPUs (threads, NCCL)", par.ep),
                RankHost::Launched { env, gpu: true } => format!("{} GPU processes (NCCL)", env.world_size),
                RankHost::Launched { env, gpu: false } => format!("{} processes (TCP)", env.world_size),
            },
            args.layer.dtype,
            if bf16_cpu { format!(" ({})", par.bf16_matmul.describe()) } else { String::new() },
            par.ep,
            par.tp,
            par.strategy,
            par.quant,
            matmul_gflops,
            fma_peak.map_or(String::new(), |p| format!(", FMA peak {p:.1} GFLOP/s")),
            dot_peak.filter(|_| dot).map_or(String::new(), |p| format!(", bf16 dot peak {p:.1} GFLOP/s")),
            copy_gbps
        );
    }
    let measured: Vec<Measured> = if par.ep == 1 && !par.dual_batch && host == RankHost::Threads {
        let layer = MoeLayer::new(
            &config,
            &weights,
            moeflow::LayerOptions {
                chunk_size: args.layer.chunk_size,
                quant: par.quant,
                defer_input_quant: par.defer_input_quant,
                bf16_matmul: par.bf16_matmul,
                ..Default::default()
            },
        )?;
        args.tokens
            .iter()
            .map(|&t| {
                let input = Tensor::from_f32(
                    &[t, config.hidden],
                    preset::uniform(t * config.hidden, 1.0, args.layer.seed ^ t as u64),
                )?;
                errors.push(match &f32_path {
                    Some(f) => {
                        let (q, r) = (layer.forward(&input)?.to_f32_vec(), f.forward(&input)?.to_f32_vec());
                        let scale = r.iter().fold(1e-30f32, |m, v| m.max(v.abs()));
                        Some(q.iter().zip(&r).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max) as f64 / scale as f64)
                    }
                    None => None,
                });
                time_loop(&args, format!("T = {t}"), Ok, || {
                    let s = Instant::now();
                    let (_, st) = layer.forward_profiled(&input)?;
                    Ok((s.elapsed().as_secs_f64(), st, 0))
                })
            })
            .collect::<Result<_>>()?
    } else {
        let placement = Arc::new(par.placement(config.num_experts)?);
        let results = on_ranks(&host, par.ep, par.timeout, |comm, kind| {
            let layer = par.layer(comm, placement.clone(), &config, &weights, kind, args.layer.chunk_size)?;
            let mut out = Vec::new();
            for &t in &args.tokens {
                let seed = args.layer.seed ^ t as u64 ^ ((comm.rank() / par.tp) as u64) << 32;
                let input = Tensor::from_f32(&[t, config.hidden], preset::uniform(t * config.hidden, 1.0, seed))?;
                let label = if comm.rank() == 0 { format!("T = {t}") } else { String::new() };
                let agree = |go: bool| Ok(comm.broadcast_vec("bench.continue", 0, &[u8::from(go)])?[0] == 1);
                let m = time_loop(&args, label, agree, || {
                    comm.barrier()?;
                    let s = Instant::now();
                    let (_, st) = layer.forward_profiled(&input)?;
                    let all = comm.all_gather_vec("bench.time", &[s.elapsed().as_secs_f64()])?;
                    Ok((all.iter().map(|v| v[0]).fold(0.0, f64::max), st, layer.bytes_moved()))
                });
                out.push(m?);
            }
            Ok(out)
        });
        let mut first = None;
        for (_, r) in results {
            let r = r?;
            first.get_or_insert(r);
        }
        first.ok_or_else(|| MoeError::Config("no ranks".into()))?
    };
    drop(weights);
    if !rank0 {
        return Ok(());
    }

    println!(
        "{:>7} {:>10} {:>9} {:>8} {:>10} {:>7}   {:>7} {:>7} {:>7} {:>7} {:>7} {:>11} {:>7}",
        "tokens",
        "ms",
        "GFLOP/s",
        "matmul%",
        "floor ms",
        "floor%",
        "route",
        "prepare",
        "experts",
        "combine",
        "shared",
        "MB/rank",
        "GB/s"
    );
    let per_expert_bytes = 3 * config.hidden * config.inter * if gpu { 2 } else { args.layer.dtype.size_in_bytes() };
    let mut records = Vec::new();
    errors.resize(args.tokens.len(), None);
    for ((&t, m), rel_error) in args.tokens.iter().zip(measured).zip(errors) {
        let total_tokens = t * groups;
        // Floor: all FLOPs at the FMA peak (or matmul rate), or every expert's weights read once.
        let experts_read = config.num_experts.min(total_tokens * config.top_k);
        let bytes = experts_read * per_expert_bytes;
        let flops = config.expert_flops(total_tokens);
        let ms = median(&m.totals) * 1e3;
        let stage = |f: fn(&StageTimes) -> f64| median(&m.stages.iter().map(f).collect::<Vec<_>>()) * 1e3;
        let stages_ms = StageTimes {
            route: stage(|s| s.route),
            prepare: stage(|s| s.prepare),
            experts: stage(|s| s.experts),
            finalize: stage(|s| s.finalize),
            shared: stage(|s| s.shared),
        };
        let gflops = flops / ms / 1e6;
        // In-process CPU ranks share one machine; GPU ranks each bring their own ceilings.
        let devices = if gpu { par.ep as f64 } else { 1.0 };
        let floor_ms = (flops / (devices * compute_gflops * 1e9)).max(bytes as f64 / (devices * copy_gbps * 1e9)) * 1e3;
        // Dispatch and combine bytes of rank 0 over its prepare and finalize time.
        let comm_ms = stages_ms.prepare + stages_ms.finalize;
        let comm_gbps = if comm_ms > 0.0 { m.bytes as f64 / comm_ms / 1e6 } else { 0.0 };
        println!(
            "{:>7} {:>10.3} {:>9.1} {:>7.0}% {:>10.3} {:>6.0}%   {:>7.2} {:>7.2} {:>7.2} {:>7.2} {:>7.2} {:>11.3} {:>7.1}",
            t,
            ms,
            gflops,
            100.0 * gflops / (devices * matmul_gflops),
            floor_ms,
            100.0 * floor_ms / ms,
            stages_ms.route,
            stages_ms.prepare,
            stages_ms.experts,
            stages_ms.finalize,
            stages_ms.shared,
            m.bytes as f64 / 1e6,
            comm_gbps
        );
        if let Some(e) = rel_error {
            println!("{:>7} {} relative error against the unquantized f32 path: {e:.3e}", "", par.quant);
        }
        records.push(Record {
            preset: p.name.to_string(),
            backend: if gpu { "cuda" } else { "cpu" }.into(),
            dtype: if gpu { "bf16".to_string() } else { args.layer.dtype.to_string() },
            tokens: t,
            ep: par.ep,
            tp: par.tp,
            strategy: par.strategy.to_string(),
            quant: par.quant.to_string(),
            rel_error,
            ms,
            gflops,
            matmul_fraction: gflops / (devices * matmul_gflops),
            floor_ms,
            floor_sustained_ms: None,
            runs: m.totals.len(),
            stages_ms,
            bytes_moved_per_rank: m.bytes,
            comm_gbps: (m.bytes > 0).then_some(comm_gbps),
            bf16_matmul: bf16_cpu
                .then(|| if dot { moeflow::Bf16Matmul::Dot } else { moeflow::Bf16Matmul::Widen }.to_string()),
        });
    }
    if let Some(path) = &args.json {
        write_records(path, &records)?;
        println!("wrote {} records to {}", records.len(), path.display());
    }
    if args.torch_baseline {
        let ours: Vec<(usize, f64)> = records.iter().map(|r| (r.tokens, r.ms)).collect();
        torch_single_baseline(&args, &config, false, &ours)?;
    }
    Ok(())
}
