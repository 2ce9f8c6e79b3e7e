//! `moeflow bench`: layer time over token counts, against this machine's measured ceilings.

use crate::common::{bar, median, spinner, LayerArgs};
use moeflow::backend::cpu::ceiling;
use moeflow::{preset, LayerOptions, MoeError, MoeLayer, Result, StageTimes, Tensor};
use serde::Serialize;
use std::time::Instant;

/// Arguments of `moeflow bench`.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    layer: LayerArgs,
    /// Token counts, comma separated.
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
}

/// One measured configuration (the schema every bench writes).
#[derive(Serialize, Debug)]
pub struct Record {
    pub preset: String,
    pub backend: String,
    pub dtype: String,
    pub tokens: usize,
    pub ep: usize,
    pub tp: usize,
    pub strategy: String,
    /// Median layer time.
    pub ms: f64,
    pub gflops: f64,
    /// Fraction of the measured dense matmul rate.
    pub matmul_fraction: f64,
    /// max(FLOPs at the matmul rate, weight bytes at the copy bandwidth).
    pub floor_ms: f64,
    pub runs: usize,
    /// Median time of each stage, ms.
    pub stages_ms: StageTimes,
    pub bytes_moved_per_rank: usize,
}

pub fn run(args: BenchArgs) -> Result<()> {
    if args.tokens.is_empty() {
        return Err(MoeError::Config("--tokens needs at least one count".into()));
    }
    let (p, config) = args.layer.config()?;
    let weights = args.layer.weights(&config)?;
    let bar0 = spinner("packing weights".into());
    let layer = MoeLayer::new(
        &config,
        &weights,
        LayerOptions { chunk_size: args.layer.chunk_size, ..LayerOptions::default() },
    )?;
    drop(weights);
    bar0.finish_and_clear();
    let bar0 = spinner("measuring this machine's matmul rate and copy bandwidth".into());
    let host = ceiling::measure();
    bar0.finish_and_clear();
    println!(
        "moeflow bench: {} on cpu ({} threads), {} weights; matmul {:.1} GFLOP/s (gemm crate, f32), copy {:.1} GB/s",
        p.name,
        rayon::current_num_threads(),
        args.layer.dtype,
        host.matmul_gflops,
        host.copy_gbps
    );
    println!(
        "{:>7} {:>10} {:>9} {:>8} {:>10} {:>8}   {:>7} {:>7} {:>7} {:>7}",
        "tokens", "ms", "GFLOP/s", "matmul%", "floor ms", "floor%", "route", "experts", "reduce", "shared"
    );
    let per_expert_bytes = 3 * config.hidden * config.inter * args.layer.dtype.size_in_bytes();
    let mut records = Vec::new();
    for &t in &args.tokens {
        let x = preset::uniform(t * config.hidden, 1.0, args.layer.seed ^ t as u64);
        let input = Tensor::from_f32(&[t, config.hidden], x)?;
        let topk = layer.route(&input)?;
        let mut hit = vec![false; config.num_experts];
        topk.ids.iter().for_each(|&e| hit[e as usize] = true);
        let bytes = hit.iter().filter(|&&h| h).count() * per_expert_bytes
            + config.shared.map_or(0, |s| 3 * config.hidden * s.inter * args.layer.dtype.size_in_bytes());
        let flops = config.expert_flops(t);
        layer.forward(&input)?;
        let progress = bar(args.min_runs as u64, format!("T = {t}"));
        let (mut totals, mut stages) = (Vec::new(), Vec::new());
        let started = Instant::now();
        while totals.len() < args.min_runs
            || (started.elapsed().as_secs_f64() < args.min_seconds && totals.len() < 1000)
        {
            let s = Instant::now();
            let (_, st) = layer.forward_profiled(&input)?;
            totals.push(s.elapsed().as_secs_f64());
            stages.push(st);
            progress.set_length(progress.length().unwrap_or(0).max(totals.len() as u64));
            progress.inc(1);
        }
        progress.finish_and_clear();
        let ms = median(&totals) * 1e3;
        let stage = |f: fn(&StageTimes) -> f64| median(&stages.iter().map(f).collect::<Vec<_>>()) * 1e3;
        let stages_ms = StageTimes {
            route: stage(|s| s.route),
            prepare: stage(|s| s.prepare),
            experts: stage(|s| s.experts),
            finalize: stage(|s| s.finalize),
            shared: stage(|s| s.shared),
        };
        let gflops = flops / ms / 1e6;
        let floor_ms = (flops / (host.matmul_gflops * 1e9)).max(bytes as f64 / (host.copy_gbps * 1e9)) * 1e3;
        println!(
            "{:>7} {:>10.3} {:>9.1} {:>7.0}% {:>10.3} {:>7.0}%   {:>7.2} {:>7.2} {:>7.2} {:>7.2}",
            t,
            ms,
            gflops,
            100.0 * gflops / host.matmul_gflops,
            floor_ms,
            100.0 * floor_ms / ms,
            stages_ms.route,
            stages_ms.experts,
            stages_ms.finalize,
            stages_ms.shared
        );
        records.push(Record {
            preset: p.name.to_string(),
            backend: "cpu".into(),
            dtype: args.layer.dtype.to_string(),
            tokens: t,
            ep: 1,
            tp: 1,
            strategy: layer.strategy_name().into(),
            ms,
            gflops,
            matmul_fraction: gflops / host.matmul_gflops,
            floor_ms,
            runs: totals.len(),
            stages_ms,
            bytes_moved_per_rank: 0,
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
