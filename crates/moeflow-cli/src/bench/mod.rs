//! `moeflow bench`: layer time over token counts, against this machine's measured ceilings.
//! With `--ep N` the layer runs on N in-process ranks, `--tokens` counting tokens per DP group.
//! This file holds the arguments and the CPU (and host-staged) runs; [`records`] the JSON
//! records, [`cuda`] the device-resident GPU layers, [`torch`] the PyTorch baselines run beside
//! them, [`plot`] the SVG plots drawn from the records, [`against_bf16`] an fp8 GPU layer timed
//! against the bf16 one.

mod against_bf16;
mod calibrate;
mod calibrate_gpu;
mod calibrate_strategies;
mod cuda;
pub mod plot;
mod records;
mod torch;

use cuda::{gpu_fp8_rows, run_cuda, run_cuda_ep};
pub use records::{write_records, Record};
use torch::{check_torch_baseline, torch_single_baseline};

use crate::common::{bar, median, quantize_weights, spinner, Backend, LayerArgs, ParallelArgs};
use crate::table::{num, right, Table};
use moeflow::backend::cpu::ceiling;
use moeflow::comm::CommExt;
use moeflow::parallel::{on_ranks, ParallelConfig, RankHost};
use moeflow::placement::ExpertPlacement;
use moeflow::quant::QuantConfig;
use moeflow::rank_layer::{gpu_path, GpuPath};
use moeflow::{
    preset, DType, LoadRecord, LoadStats, MoeConfig, MoeError, MoeLayer, MoeWeights, Result, StageTimes, Tensor,
};
use std::path::PathBuf;
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
    json: Option<PathBuf>,
    /// Draw the records as an SVG: layer time against tokens with its floor (and PyTorch's,
    /// with --torch-baseline), the stages' shares, and with --ep the dispatch + combine rate.
    #[arg(long)]
    plot: Option<PathBuf>,
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
    /// (all_to_all_single, torch._grouped_mm; tools/torch_ep_baseline.py) in two forms: rows
    /// per (token, slot), and per (token, rank serving it).
    #[arg(long)]
    torch_baseline: bool,
    /// With --backend cuda on one GPU and --dtype f8e4m3: after the table, time the fp8 layer
    /// against the bf16 layer of the same shapes, seed and routing, each at its steady clock
    /// under the power cap, in alternating rounds (--min-runs rounds, at least 8; a round runs
    /// a layer for a second, then times 10 runs), and print both medians, the median of the
    /// rounds' ratios and the fp8 layer's share of the sustained floor (JSON: `steady_ms`,
    /// `bf16_steady_ms`, `ratio_to_bf16`).
    #[arg(long)]
    against_bf16: bool,
    /// Write every rank's tokens per logical expert over its last 64 forward calls (the load
    /// statistics) as JSON to this file, the input of `moeflow eplb --load`.
    #[arg(long)]
    record_load: Option<PathBuf>,
    /// Instead of the table, calibrate this machine and write JSON to this file. On one CPU
    /// rank: its ceilings with the layer (the expert GEMM rate at the largest --tokens, the
    /// weight-streaming rate at one token, the router's rate, a stage's fixed cost, the
    /// in-process exchange) for `moeflow simulate --ceilings FILE`. With --backend cuda on one
    /// GPU: the GPU's ceilings for the same (sustained GEMM rate, HBM copy, the layer's expert
    /// GEMM rate by rows per expert, its router, a launch's fixed cost at one token; with two
    /// GPUs visible the push rate, and from the EP-2 layer the exchange's call cost and the host
    /// round trip). With --backend cuda and --ep 2 or more: every strategy `--strategy auto`
    /// chooses among, timed at each --tokens count, and the crossovers for `--strategy-table FILE`.
    #[arg(long)]
    calibrate: Option<PathBuf>,
    /// Whether `json` is a scratch file for the plot rather than the user's.
    #[arg(skip)]
    scratch_json: bool,
}

/// Arguments of `moeflow plot`.
#[derive(clap::Args, Debug)]
pub struct PlotArgs {
    /// A JSON file written by `bench --json`.
    #[arg(long)]
    json: PathBuf,
    /// The SVG file to write.
    #[arg(long)]
    out: PathBuf,
}

/// `moeflow plot`: draws the plots of `bench --plot` from a bench JSON file.
pub fn plot_file(args: PlotArgs) -> Result<()> {
    plot::plot_json(&args.json, &args.out)?;
    println!("wrote {}", args.out.display());
    Ok(())
}

/// Per token count: run times (s), stage times of rank 0, bytes moved by rank 0.
struct Measured {
    totals: Vec<f64>,
    stages: Vec<StageTimes>,
    bytes: usize,
    /// CPU runs: the matmul probe's rate just before these runs ([`probe`]), GFLOP/s.
    probe: Option<f64>,
}

/// This CPU's pace now: its dense f32 matmul rate, GFLOP/s (a tenth of a second), which
/// `moeflow simulate --compare` scales the calibration's compute rates by.
pub(crate) fn probe() -> f64 {
    ceiling::matmul_gflops(1536, 7)
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
    let mut m = Measured { totals: Vec::new(), stages: Vec::new(), bytes: 0, probe: None };
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

/// `moeflow bench`: checks the arguments, runs the layer the backend and layout pick, then
/// draws the plot from the records when `--plot` asks for one.
pub fn run(mut args: BenchArgs) -> Result<()> {
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
    if args.against_bf16
        && !(gpu && args.parallel.ep == 1 && args.layer.dtype == DType::F8E4M3 && args.calibrate.is_none())
    {
        return Err(MoeError::Config(
            "--against-bf16 times an fp8 layer (--dtype f8e4m3) on one GPU (--backend cuda, no --ep, no --calibrate) \
             against the bf16 one"
                .into(),
        ));
    }
    if let (Some(path), false) = (&args.calibrate, gpu) {
        if args.parallel.ep != 1 {
            return Err(MoeError::Config(
                "--calibrate measures this CPU's ceilings on one rank, or the strategies of --backend cuda with --ep 2 \
                 or more"
                    .into(),
            ));
        }
        return calibrate::calibrate(&args, path);
    }
    let host = RankHost::detect(gpu, crate::common::launch_env()?);
    if args.torch_baseline {
        check_torch_baseline(&args, gpu, &host)?;
    }
    // The plot is drawn from the JSON records (every path writes them, and the baseline adds
    // its times to them); without --json they go to a scratch file.
    let scratch = (args.plot.is_some() && args.json.is_none())
        .then(|| std::env::temp_dir().join(format!("moeflow_bench_{}.json", std::process::id())));
    if scratch.is_some() {
        args.json.clone_from(&scratch);
        args.scratch_json = true;
    }
    let ran = run_layer(&args, gpu, &host);
    let drawn = match (&ran, &args.plot, &args.json) {
        (Ok(()), Some(svg), Some(json)) if host.launched_rank().is_none_or(|r| r == 0) => {
            plot::plot_json(json, svg).map(|()| println!("wrote the plot to {}", svg.display()))
        }
        _ => Ok(()),
    };
    if let Some(path) = scratch {
        let _ = std::fs::remove_file(path);
    }
    ran.and(drawn)
}

/// Runs the benchmark on the layer that the backend and the layout pick: one GPU, the
/// device-resident expert-parallel GPU layer, or the modular layer (CPU, or host-staged GPUs).
fn run_layer(args: &BenchArgs, gpu: bool, host: &RankHost) -> Result<()> {
    if gpu && args.parallel.ep == 1 && *host == RankHost::Gpus {
        if let Some(file) = &args.calibrate {
            return calibrate_gpu::calibrate(args, file);
        }
        return run_cuda(args);
    }
    if gpu && args.parallel.quant != QuantConfig::None {
        // Quantized rows run only in the device-resident layers (W8A8, in run_cuda_ep).
        gpu_fp8_rows(args.parallel.quant, args.layer.dtype == DType::F8E4M3 && !args.host_staged)?;
    }
    if let Some(file) = &args.calibrate {
        if args.parallel.ep < 2 {
            return Err(MoeError::Config(
                "--calibrate measures this CPU's ceilings on one rank, one GPU's with --backend cuda on one GPU, or \
                 the strategies of --backend cuda with --ep 2 or more"
                    .into(),
            ));
        }
        return calibrate_strategies::calibrate(args, host, file);
    }
    if gpu && !args.host_staged {
        let par = args.parallel.config(1)?;
        let why = match gpu_path(&par) {
            GpuPath::DeviceResident | GpuPath::OneGpu => return run_cuda_ep(args, host),
            GpuPath::HostStaged(why) => why,
        };
        if args.torch_baseline {
            return Err(MoeError::Config(
                "--torch-baseline compares the device-resident layer; this layout runs host-staged".into(),
            ));
        }
        println!("note: this layout runs host-staged (rows through host memory) because {why}");
    }
    run_modular(args, gpu, host)
}

/// The ceilings a run is measured against: this machine's matmul and copy rates and the
/// cores' peaks, or the GPU's GEMM and copy rates.
struct Ceilings {
    matmul_gflops: f64,
    copy_gbps: f64,
    name: &'static str,
    fma_peak: Option<f64>,
    dot_peak: Option<f64>,
}

impl Ceilings {
    fn measure(gpu: bool, device: usize) -> Result<Self> {
        let bar0 = spinner("measuring the matmul rate and copy bandwidth".into());
        let c = if gpu {
            let c = moeflow::backend::cuda::measure_ceilings(device)?;
            Ceilings {
                matmul_gflops: c.gemm_tflops * 1e3,
                copy_gbps: c.copy_gbps,
                name: "cuBLAS bf16 8192³",
                fma_peak: None,
                dot_peak: None,
            }
        } else {
            let h = ceiling::measure();
            Ceilings {
                matmul_gflops: h.matmul_gflops,
                copy_gbps: h.copy_gbps,
                name: "gemm crate, f32",
                fma_peak: h.fma_peak_gflops,
                dot_peak: h.bf16_dot_peak_gflops,
            }
        };
        bar0.finish_and_clear();
        Ok(c)
    }

    /// The compute floor's rate: the cores' peak for the instructions the experts run where it
    /// was measured (no GEMM beats it): the bf16 dot-product peak when bf16 weights take dot
    /// products, else the FMA peak; else the matmul rate.
    fn compute_gflops(&self, dot: bool) -> f64 {
        if dot { self.dot_peak } else { None }.or(self.fma_peak).unwrap_or(self.matmul_gflops)
    }
}

/// What a modular-layer run is: the layer, its layout and how its bf16 weights multiply.
struct Setup {
    preset: &'static str,
    config: MoeConfig,
    par: ParallelConfig,
    /// CPU experts with unquantized bf16 weights.
    bf16_cpu: bool,
    /// ... taking bf16 dot products.
    dot: bool,
    gpu: bool,
}

/// The modular layer (CPU ranks, or GPUs with rows through host memory): measures, prints the
/// table, writes the records and runs the PyTorch baseline.
fn run_modular(args: &BenchArgs, gpu: bool, host: &RankHost) -> Result<()> {
    let (p, config) = args.layer.config()?;
    let par = args.parallel.config(args.tokens.iter().copied().max().unwrap_or(1))?;
    let bf16_cpu = !gpu && args.layer.dtype == DType::BF16 && par.quant == QuantConfig::None;
    let dot = bf16_cpu && par.bf16_matmul.uses_dot();
    let setup = Setup { preset: p.name, config, par, bf16_cpu, dot, gpu };
    let mut weights = args.layer.weights(&setup.config)?;
    // The unquantized path, to measure the quantized one's error against.
    let f32_path = if setup.par.quant != QuantConfig::None && setup.par.ep == 1 {
        let f32_options = moeflow::LayerOptions { bf16_matmul: moeflow::Bf16Matmul::Widen, ..Default::default() };
        Some(MoeLayer::new(&setup.config, &weights, f32_options)?)
    } else {
        None
    };
    quantize_weights(&mut weights, setup.par.quant)?;
    let device = match host {
        RankHost::Launched { env, .. } => env.local_rank,
        _ => 0,
    };
    let ceilings = Ceilings::measure(gpu, device)?;
    let rank0 = host.launched_rank().is_none_or(|r| r == 0);
    if rank0 {
        println!("{}", describe(args, &setup, host, &ceilings));
        if setup.par.ep > 1 {
            println!("  layout          {}", setup.par.layout());
        }
    }
    let (measured, errors, shares) = if setup.par.ep == 1 && !setup.par.dual_batch && *host == RankHost::Threads {
        let (measured, errors) = measure_one_rank(args, &setup, &weights, f32_path.as_ref())?;
        (measured, errors, None)
    } else {
        let (measured, shares) = measure_ranks(args, &setup, &weights, host)?;
        (measured, Vec::new(), shares)
    };
    drop(weights);
    if !rank0 {
        return Ok(());
    }
    let records = report(args, &setup, &ceilings, measured, errors);
    if let Some(shares) = &shares {
        print_rank_shares(shares);
    }
    if let Some(path) = &args.json {
        write_records(path, &records)?;
        if !args.scratch_json {
            println!("wrote {} records to {}", records.len(), path.display());
        }
    }
    if args.torch_baseline {
        let ours: Vec<(usize, f64)> = records.iter().map(|r| (r.tokens, r.ms)).collect();
        torch_single_baseline(args, &setup.config, false, &ours)?;
    }
    Ok(())
}

/// The line above the table: preset, ranks, weights, layout and the measured ceilings.
fn describe(args: &BenchArgs, s: &Setup, host: &RankHost, c: &Ceilings) -> String {
    let ranks = match host {
        RankHost::Threads => format!("cpu ({} threads)", rayon::current_num_threads()),
        RankHost::Gpus => format!("{} GPUs (threads, NCCL)", s.par.ep),
        RankHost::Launched { env, gpu: true } => format!("{} GPU processes (NCCL)", env.world_size),
        RankHost::Launched { env, gpu: false } => format!("{} processes (TCP)", env.world_size),
    };
    format!(
        "moeflow bench: {} on {ranks}, {} weights{}, EP {} TP {} {}, quant {}; matmul {:.1} GFLOP/s ({}){}{}, copy {:.1} GB/s",
        s.preset,
        args.layer.dtype,
        if s.bf16_cpu { format!(" ({})", s.par.bf16_matmul.describe()) } else { String::new() },
        s.par.ep,
        s.par.tp,
        s.par.strategy,
        s.par.quant,
        c.matmul_gflops,
        c.name,
        c.fma_peak.map_or(String::new(), |p| format!(", FMA peak {p:.1} GFLOP/s")),
        c.dot_peak.filter(|_| s.dot).map_or(String::new(), |p| format!(", bf16 dot peak {p:.1} GFLOP/s")),
        c.copy_gbps
    )
}

/// One in-process rank: each token count timed, and with quantization the relative error
/// against the unquantized path `f32_path`.
fn measure_one_rank(
    args: &BenchArgs,
    s: &Setup,
    weights: &MoeWeights,
    f32_path: Option<&MoeLayer>,
) -> Result<(Vec<Measured>, Vec<Option<f64>>)> {
    let options = moeflow::LayerOptions {
        chunk_size: args.layer.chunk_size,
        quant: s.par.quant,
        defer_input_quant: s.par.defer_input_quant,
        bf16_matmul: s.par.bf16_matmul,
        ..Default::default()
    };
    let layer = MoeLayer::new(&s.config, weights, options)?;
    let h = s.config.hidden;
    let mut measured = Vec::new();
    let mut errors = Vec::new();
    for &t in &args.tokens {
        let input = Tensor::from_f32(&[t, h], preset::uniform(t * h, 1.0, args.layer.seed ^ t as u64))?;
        errors.push(match f32_path {
            Some(f) => Some(relative_error(&layer.forward(&input)?.to_f32_vec(), &f.forward(&input)?.to_f32_vec())),
            None => None,
        });
        let probe = (!s.gpu).then(probe);
        let mut m = time_loop(args, format!("T = {t}"), Ok, || {
            let started = Instant::now();
            let (_, st) = layer.forward_profiled(&input)?;
            Ok((started.elapsed().as_secs_f64(), st, 0))
        })?;
        m.probe = probe;
        measured.push(m);
    }
    if let Some(path) = &args.record_load {
        write_load(path, &LoadRecord::from_ranks(&s.config, vec![layer.load_stats()]))?;
    }
    Ok((measured, errors))
}

/// Writes `record` to `path` and says so.
pub(crate) fn write_load(path: &std::path::Path, record: &LoadRecord) -> Result<()> {
    record.write(path)?;
    println!("wrote the load statistics of {} ranks to {}", record.ranks.len(), path.display());
    Ok(())
}

/// Every rank's load statistics, gathered (collective): written to `--record-load`'s file, and
/// on rank 0 the share of the routed (token, slot) pairs that each rank of `placement` served
/// over the calls recorded, which tells how much of the slowest rank's time is its larger share.
/// `None` off rank 0, and where the layer keeps no statistics and none were asked for.
pub(crate) fn gather_load(
    args: &BenchArgs,
    config: &MoeConfig,
    comm: &dyn moeflow::comm::Communicator,
    stats: Result<LoadStats>,
    placement: &ExpertPlacement,
) -> Result<Option<Vec<f64>>> {
    let stats = match (stats, &args.record_load) {
        (Ok(stats), _) => stats,
        (Err(e), Some(_)) => return Err(e),
        (Err(_), None) => return Ok(None),
    };
    let record = LoadRecord::gather(config, comm, &stats)?;
    if comm.rank() != 0 {
        return Ok(None);
    }
    if let Some(path) = &args.record_load {
        write_load(path, &record)?;
    }
    let totals: Vec<f64> = record.totals().iter().map(|&c| c as f64).collect();
    let served = moeflow::eplb::rank_loads(placement, &totals);
    let all: f64 = served.iter().sum();
    Ok((all > 0.0).then(|| served.iter().map(|s| s / all).collect()))
}

/// Prints the shares of the routed slots the ranks served (see [`gather_load`]).
pub(crate) fn print_rank_shares(shares: &[f64]) {
    let each: Vec<String> = shares.iter().map(|s| format!("{:.1} %", 100.0 * s)).collect();
    println!(
        "routed slots each rank served over the recorded calls: {} (the busiest {:.3} × the mean)",
        each.join(" / "),
        moeflow::eplb::imbalance(shares)
    );
}

/// The largest difference between `got` and `want` relative to the largest `|want|`.
fn relative_error(got: &[f32], want: &[f32]) -> f64 {
    let scale = want.iter().fold(1e-30f32, |m, v| m.max(v.abs()));
    got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max) as f64 / scale as f64
}

/// Several ranks (threads, GPUs or launched processes): each token count timed by the slowest
/// rank, every rank running the same iterations; rank 0's (or this process's) measurements.
/// Also returns, on rank 0, the shares of the routed slots the ranks served ([`gather_load`]).
fn measure_ranks(
    args: &BenchArgs,
    s: &Setup,
    weights: &MoeWeights,
    host: &RankHost,
) -> Result<(Vec<Measured>, Option<Vec<f64>>)> {
    let par = &s.par;
    let placement = Arc::new(par.placement(s.config.num_experts)?);
    let results = on_ranks(host, par.ep, par.timeout, |comm, kind| {
        let layer = par.layer(comm, placement.clone(), &s.config, weights, kind, args.layer.chunk_size)?;
        let mut out = Vec::new();
        for &t in &args.tokens {
            let seed = args.layer.seed ^ t as u64 ^ ((comm.rank() / par.tp) as u64) << 32;
            let input = Tensor::from_f32(&[t, s.config.hidden], preset::uniform(t * s.config.hidden, 1.0, seed))?;
            let label = if comm.rank() == 0 { format!("T = {t}") } else { String::new() };
            let agree = |go: bool| Ok(comm.broadcast_vec("bench.continue", 0, &[u8::from(go)])?[0] == 1);
            // Rank 0 probes the CPU's pace while the others wait.
            comm.barrier()?;
            let probe = (!s.gpu && comm.rank() == 0).then(probe);
            comm.barrier()?;
            let mut m = time_loop(args, label, agree, || {
                comm.barrier()?;
                let started = Instant::now();
                let (_, st) = layer.forward_profiled(&input)?;
                let all = comm.all_gather_vec("bench.time", &[started.elapsed().as_secs_f64()])?;
                Ok((all.iter().map(|v| v[0]).fold(0.0, f64::max), st, layer.bytes_moved()))
            })?;
            m.probe = probe;
            out.push(m);
        }
        let shares = gather_load(args, &s.config, comm, Ok(layer.load_stats()), &placement)?;
        Ok((out, shares))
    });
    let mut first = None;
    for (_, r) in results {
        first.get_or_insert(r?);
    }
    first.ok_or_else(|| MoeError::Config("no ranks".into()))
}

/// The table of the modular layer's runs.
fn table() -> Table {
    Table::new(&[
        right("tokens", 7),
        right("ms", 10),
        right("GFLOP/s", 9),
        right("matmul%", 8),
        right("floor ms", 10),
        right("floor%", 7),
        right("route", 9),
        right("prepare", 7),
        right("experts", 7),
        right("combine", 7),
        right("shared", 7),
        right("MB/rank", 11),
        right("GB/s", 7),
    ])
}

/// Prints one row per token count and returns the records.
fn report(
    args: &BenchArgs,
    s: &Setup,
    c: &Ceilings,
    measured: Vec<Measured>,
    mut errors: Vec<Option<f64>>,
) -> Vec<Record> {
    let table = table();
    println!("{}", table.header());
    errors.resize(args.tokens.len(), None);
    let mut records = Vec::new();
    for ((&t, m), rel_error) in args.tokens.iter().zip(measured).zip(errors) {
        let r = record(args, s, c, t, &m, rel_error);
        let percent = |x: f64| format!("{:.0}%", 100.0 * x);
        let st = &r.stages_ms;
        println!(
            "{}",
            table.row(&[
                t.to_string(),
                num(r.ms, 3),
                num(r.gflops, 1),
                percent(r.matmul_fraction),
                num(r.floor_ms, 3),
                percent(r.floor_ms / r.ms),
                num(st.route, 2),
                num(st.prepare, 2),
                num(st.experts, 2),
                num(st.finalize, 2),
                num(st.shared, 2),
                num(m.bytes as f64 / 1e6, 3),
                num(r.comm_gbps.unwrap_or(0.0), 1),
            ])
        );
        if let Some(e) = rel_error {
            println!("{:>7} {} relative error against the unquantized f32 path: {e:.3e}", "", s.par.quant);
        }
        records.push(r);
    }
    records
}

/// The record of `t` tokens per DP group from its measurements.
fn record(args: &BenchArgs, s: &Setup, c: &Ceilings, t: usize, m: &Measured, rel_error: Option<f64>) -> Record {
    let config = &s.config;
    let total_tokens = t * (s.par.ep / s.par.tp);
    // Floor: all FLOPs at the compute peak, or every reached expert's weights read once.
    let per_expert_bytes = 3 * config.hidden * config.inter * if s.gpu { 2 } else { args.layer.dtype.size_in_bytes() };
    let bytes = config.num_experts.min(total_tokens * config.top_k) * per_expert_bytes;
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
    let devices = if s.gpu { s.par.ep as f64 } else { 1.0 };
    let floor_ms =
        (flops / (devices * c.compute_gflops(s.dot) * 1e9)).max(bytes as f64 / (devices * c.copy_gbps * 1e9)) * 1e3;
    // Dispatch and combine bytes of rank 0 over its prepare and finalize time.
    let comm_ms = stages_ms.prepare + stages_ms.finalize;
    let comm_gbps = if comm_ms > 0.0 { m.bytes as f64 / comm_ms / 1e6 } else { 0.0 };
    Record {
        preset: s.preset.to_string(),
        backend: if s.gpu { "cuda" } else { "cpu" }.into(),
        dtype: if s.gpu { "bf16".to_string() } else { args.layer.dtype.to_string() },
        tokens: t,
        ep: s.par.ep,
        tp: s.par.tp,
        strategy: s.par.strategy.to_string(),
        quant: s.par.quant.to_string(),
        rel_error,
        ms,
        gflops,
        matmul_fraction: gflops / (devices * c.matmul_gflops),
        floor_ms,
        floor_sustained_ms: None,
        runs: m.totals.len(),
        stages_ms,
        bytes_moved_per_rank: m.bytes,
        comm_gbps: (m.bytes > 0).then_some(comm_gbps),
        probe_gflops: m.probe,
        bf16_matmul: s
            .bf16_cpu
            .then(|| if s.dot { moeflow::Bf16Matmul::Dot } else { moeflow::Bf16Matmul::Widen }.to_string()),
    }
}
