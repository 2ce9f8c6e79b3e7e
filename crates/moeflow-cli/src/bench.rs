//! `moeflow bench`: layer time over token counts, against this machine's measured ceilings.
//! With `--ep N` the layer runs on N in-process ranks, `--tokens` counting tokens per DP group.

use crate::common::{bar, median, quantize_weights, spinner, Backend, LayerArgs, ParallelArgs};
use moeflow::backend::cpu::ceiling;
use moeflow::comm::CommExt;
use moeflow::parallel::{on_ranks, RankHost};
use moeflow::{preset, MoeError, MoeLayer, Result, StageTimes, Tensor};
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
    /// cpu, or cuda (one GPU; weights generated on the device in bf16).
    #[arg(long, value_enum, default_value = "cpu")]
    backend: Backend,
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
    pub runs: usize,
    /// Median time of each stage on rank 0, ms.
    pub stages_ms: StageTimes,
    /// Bytes rank 0 sent per forward (dispatch and combine).
    pub bytes_moved_per_rank: usize,
    /// Those bytes over rank 0's prepare + finalize time, GB/s.
    pub comm_gbps: Option<f64>,
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
    let gpu = args.backend == Backend::Cuda;
    let host = RankHost::detect(gpu)?;
    if gpu && args.parallel.ep == 1 && !args.parallel.dual_batch && host == RankHost::Gpus {
        return run_cuda(&args);
    }
    if gpu && args.parallel.quant != moeflow::quant::QuantConfig::None {
        return Err(MoeError::Unsupported("--quant on --backend cuda: quantized GEMMs are not implemented yet".into()));
    }
    let (p, config) = args.layer.config()?;
    let par = args.parallel.config(args.tokens.iter().copied().max().unwrap_or(1))?;
    let mut weights = args.layer.weights(&config)?;
    // The unquantized path, to measure the quantized one's error against.
    let f32_path = if par.quant != moeflow::quant::QuantConfig::None && par.ep == 1 {
        Some(MoeLayer::new(&config, &weights, moeflow::LayerOptions::default())?)
    } else {
        None
    };
    quantize_weights(&mut weights, par.quant)?;
    let mut errors: Vec<Option<f64>> = Vec::new();
    // The ceilings: this machine's matmul and copy rates, or the GPU's GEMM and copy rates.
    let device = match &host {
        RankHost::Launched(env) => env.local_rank,
        _ => 0,
    };
    let bar0 = spinner("measuring the matmul rate and copy bandwidth".into());
    let (matmul_gflops, copy_gbps, ceiling_name) = if gpu {
        let (tflops, gbps) = moeflow::backend::cuda::measure_ceilings(device)?;
        (tflops * 1e3, gbps, "cuBLAS bf16 8192³")
    } else {
        let host = ceiling::measure();
        (host.matmul_gflops, host.copy_gbps, "gemm crate, f32")
    };
    bar0.finish_and_clear();
    let groups = par.ep / par.tp;
    let rank0 = !matches!(&host, RankHost::Launched(env) if env.rank != 0);
    if rank0 {
        println!(
            "moeflow bench: {} on {}, {} weights, EP {} TP {} {}, quant {}; matmul {:.1} GFLOP/s ({ceiling_name}), copy {:.1} GB/s",
            p.name,
            match &host {
                RankHost::Threads => format!("cpu ({} threads)", rayon::current_num_threads()),
                RankHost::Gpus => format!("{} GPUs (threads, NCCL)", par.ep),
                RankHost::Launched(env) => format!("{} GPU processes (NCCL)", env.world_size),
            },
            args.layer.dtype,
            par.ep,
            par.tp,
            par.strategy,
            par.quant,
            matmul_gflops,
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
        // Floor: all FLOPs at the matmul rate, or every expert's weights read once.
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
        let floor_ms = (flops / (devices * matmul_gflops * 1e9)).max(bytes as f64 / (devices * copy_gbps * 1e9)) * 1e3;
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
            runs: m.totals.len(),
            stages_ms,
            bytes_moved_per_rank: m.bytes,
            comm_gbps: (m.bytes > 0).then_some(comm_gbps),
        });
    }
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&records)
            .map_err(|e| MoeError::Json { context: "bench records".into(), source: e })?;
        std::fs::write(path, text + "\n")
            .map_err(|e| MoeError::Io { context: format!("writing {}", path.display()), source: e })?;
        println!("wrote {} records to {}", records.len(), path.display());
    }
    Ok(())
}

/// `bench --backend cuda`: CUDA-event stage times (medians), TFLOP/s, HBM GB/s, and the
/// fraction of the floor (FLOPs at the measured GEMM rate, bytes at the measured copy rate).
fn run_cuda(args: &BenchArgs) -> Result<()> {
    let (p, config) = args.layer.config()?;
    if args.parallel.ep != 1 {
        return Err(MoeError::Unsupported("--backend cuda runs one GPU (EP 1) in this build".into()));
    }
    if args.parallel.quant != moeflow::quant::QuantConfig::None {
        return Err(MoeError::Unsupported("--quant on --backend cuda: quantized GEMMs are not implemented yet".into()));
    }
    let bar0 = spinner("generating weights on the GPU".into());
    let gpu = moeflow::backend::cuda::CudaMoeLayer::random(&config, args.layer.seed)?;
    bar0.set_message("measuring the GPU's GEMM rate and copy bandwidth");
    let (gemm_tflops, copy_gbps) = gpu.measure_ceilings()?;
    bar0.finish_and_clear();
    println!(
        "moeflow bench: {} on {} ({} experts, top-{}, bf16); GEMM {:.0} TFLOP/s (cuBLAS bf16 8192³), copy {:.0} GB/s",
        p.name,
        gpu.device_name(),
        config.num_experts,
        config.top_k,
        gemm_tflops,
        copy_gbps
    );
    println!(
        "{:>7} {:>9} {:>8} {:>8} {:>9} {:>7}   {:>6} {:>7} {:>6} {:>6} {:>6} {:>7} {:>6}",
        "tokens",
        "ms",
        "TFLOP/s",
        "GB/s",
        "floor ms",
        "floor%",
        "route",
        "permute",
        "gemm1",
        "act",
        "gemm2",
        "combine",
        "shared"
    );
    let per_expert = 3 * config.hidden * config.inter * 2;
    let mut records = Vec::new();
    for &t in &args.tokens {
        for _ in 0..3 {
            gpu.forward_timed(t, args.layer.seed)?;
        }
        let runs = args.min_runs.max(20);
        let samples: Vec<_> =
            (0..runs).map(|r| gpu.forward_timed(t, args.layer.seed + r as u64)).collect::<Result<_>>()?;
        let med =
            |f: fn(&moeflow::backend::cuda::GpuStageTimes) -> f64| median(&samples.iter().map(f).collect::<Vec<_>>());
        let ms = med(|s| s.total);
        let flops = config.expert_flops(t);
        let experts_read = config.num_experts.min(t * config.top_k);
        let bytes = experts_read * per_expert
            + config.shared.map_or(0, |s| 3 * config.hidden * s.inter * 2)
            + t * config.hidden * 8;
        let floor = (flops / (gemm_tflops * 1e12)).max(bytes as f64 / (copy_gbps * 1e9)) * 1e3;
        println!(
            "{:>7} {:>9.3} {:>8.1} {:>8.0} {:>9.3} {:>6.0}%   {:>6.3} {:>7.3} {:>6.3} {:>6.3} {:>6.3} {:>7.3} {:>6.3}",
            t,
            ms,
            flops / ms / 1e9,
            bytes as f64 / ms / 1e6,
            floor,
            100.0 * floor / ms,
            med(|s| s.route),
            med(|s| s.permute),
            med(|s| s.gemm1),
            med(|s| s.act),
            med(|s| s.gemm2),
            med(|s| s.combine),
            med(|s| s.shared)
        );
        records.push(Record {
            preset: p.name.to_string(),
            backend: "cuda".into(),
            dtype: "bf16".into(),
            tokens: t,
            ep: 1,
            tp: 1,
            strategy: "local".into(),
            quant: "none".into(),
            rel_error: None,
            ms,
            gflops: flops / ms / 1e6,
            matmul_fraction: flops / ms / 1e9 / gemm_tflops,
            floor_ms: floor,
            runs,
            stages_ms: StageTimes {
                route: med(|s| s.route),
                prepare: med(|s| s.permute),
                experts: med(|s| s.gemm1 + s.act + s.gemm2),
                finalize: med(|s| s.combine),
                shared: med(|s| s.shared),
            },
            bytes_moved_per_rank: 0,
            comm_gbps: None,
        });
    }
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&records)
            .map_err(|e| MoeError::Json { context: "bench records".into(), source: e })?;
        std::fs::write(path, text + "\n")
            .map_err(|e| MoeError::Io { context: format!("writing {}", path.display()), source: e })?;
    }
    Ok(())
}
