//! `moeflow bench`: layer time over token counts, against this machine's measured ceilings.
//! With `--ep N` the layer runs on N in-process ranks, `--tokens` counting tokens per DP group.

use crate::common::{bar, device_resident, median, quantize_weights, spinner, Backend, LayerArgs, ParallelArgs};
use moeflow::backend::cpu::ceiling;
use moeflow::comm::CommExt;
use moeflow::parallel::{on_ranks, RankHost};
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

/// The PyTorch + NCCL baseline layer, run by `--torch-baseline` on GPUs.
const TORCH_BASELINE: &str = include_str!("../../../tools/torch_ep_baseline.py");
/// The PyTorch CPU baseline layer, run by `--torch-baseline` on one CPU rank.
const TORCH_CPU_BASELINE: &str = include_str!("../../../tools/torch_cpu_baseline.py");
/// The one-GPU PyTorch baseline layer, run by `--torch-baseline` on one GPU.
const TORCH_GPU_BASELINE: &str = include_str!("../../../tools/torch_gpu_baseline.py");

/// Writes `records` to `path` as a pretty JSON array.
fn write_records(path: &std::path::Path, records: &[Record]) -> Result<()> {
    let text = serde_json::to_string_pretty(records)
        .map_err(|e| MoeError::Json { context: "bench records".into(), source: e })?;
    std::fs::write(path, text + "\n")
        .map_err(|e| MoeError::Io { context: format!("writing {}", path.display()), source: e })
}

/// Whether `--dtype` asks for fp8 routed experts on GPUs (bf16 otherwise); `runs_fp8` says
/// whether this layout streams fp8 codes (one GPU, or the low-latency layer), and a refusal
/// names where they do run.
fn gpu_fp8_experts(dtype: DType, runs_fp8: bool) -> Result<bool> {
    match dtype {
        DType::BF16 => Ok(false),
        DType::F8E4M3 if runs_fp8 => Ok(true),
        DType::F8E4M3 => Err(MoeError::Unsupported(
            "--dtype f8e4m3 with --ep N runs in the low-latency layer (--strategy lowlatency)".into(),
        )),
        other => Err(MoeError::Unsupported(format!(
            "--dtype {other} on GPUs: use bf16, or f8e4m3 (one GPU, or --strategy lowlatency)"
        ))),
    }
}

/// Whether `--quant` asks for fp8 GEMM rows on GPUs (W8A8: `fp8-block` with fp8 experts); any
/// other quantization there is refused with a message naming what does run.
fn gpu_fp8_rows(quant: moeflow::quant::QuantConfig, fp8_experts: bool) -> Result<bool> {
    use moeflow::quant::QuantConfig;
    match quant {
        QuantConfig::None => Ok(false),
        QuantConfig::Fp8Block if fp8_experts => Ok(true),
        other => Err(MoeError::Unsupported(format!(
            "--quant {other} on GPUs: the GPU layer quantizes GEMM rows only as fp8-block with --dtype f8e4m3 \
             (W8A8: one GPU, or --strategy lowlatency)"
        ))),
    }
}

/// The GPU layer a benchmark times: whole, or as two micro-batches (dual-batch overlap).
enum Timed {
    Whole(Box<moeflow::backend::cuda::CudaMoeLayer>),
    Dual(Box<moeflow::backend::cuda::CudaDualBatch>),
}

impl Timed {
    /// `layer`, split for dual-batch overlap when `dual` (expert-parallel layers over `comm`,
    /// a second communicator over the same ranks).
    fn new(
        layer: moeflow::backend::cuda::CudaMoeLayer,
        dual: bool,
        comm: Option<moeflow::backend::cuda::NcclComm>,
    ) -> Result<Self> {
        Ok(if dual { Timed::Dual(Box::new(layer.dual_batch(comm)?)) } else { Timed::Whole(Box::new(layer)) })
    }

    /// One timed run of `tokens` random tokens (see `CudaMoeLayer::forward_timed`).
    fn forward_timed(&self, tokens: usize, seed: u64) -> Result<moeflow::backend::GpuStageTimes> {
        match self {
            Timed::Whole(l) => l.forward_timed(tokens, seed),
            Timed::Dual(d) => d.forward_timed(tokens, seed),
        }
    }

    /// A run with every stage timed (a low-latency layer's stages run outside its graph).
    fn forward_timed_stages(&self, tokens: usize, seed: u64) -> Result<moeflow::backend::GpuStageTimes> {
        match self {
            Timed::Whole(l) => l.forward_timed_stages(tokens, seed),
            Timed::Dual(d) => d.forward_timed(tokens, seed),
        }
    }

    /// Whether `forward_timed` replays a one-GPU graph for `tokens` tokens (timing only the whole).
    fn replays_graph(&self, tokens: usize) -> bool {
        match self {
            Timed::Whole(l) => l.replays_graph(tokens),
            Timed::Dual(_) => false,
        }
    }

    /// Captures of one-GPU graphs that failed so far (those calls ran launch by launch), and
    /// why the latest failed.
    fn failed_graph_captures(&self) -> (usize, Option<String>) {
        match self {
            Timed::Whole(l) => (l.failed_graph_captures(), l.last_graph_capture_failure()),
            Timed::Dual(_) => (0, None),
        }
    }
}

/// `bench --backend cuda --ep N` on the device-resident layer: CUDA-event stage times per
/// rank (medians), the layer time as the slowest rank's per run, dispatch and combine GB/s.
/// The low-latency layer's time is its graph's replay; its stages are timed in direct runs.
fn run_cuda_ep(args: &BenchArgs, host: &RankHost) -> Result<()> {
    use moeflow::backend::cuda::{measure_ceilings, CudaMoeLayer, GpuStageTimes, NcclComm};
    let (p, config) = args.layer.config()?;
    let par = args.parallel.config(args.tokens.iter().copied().max().unwrap_or(1))?;
    let capacity = (par.strategy == moeflow::parallel::StrategyKind::LowLatency).then_some(par.max_tokens_per_rank);
    // Routed experts in fp8 (128 × 128 block scales): only the low-latency layer streams the
    // codes; elsewhere the bf16 values would run instead, so that is refused.
    let fp8 = gpu_fp8_experts(args.layer.dtype, capacity.is_some())?;
    let rows8 = gpu_fp8_rows(par.quant, fp8)?;
    let dtype = match (fp8, rows8) {
        (true, true) => "fp8 e4m3 experts (128×128 block scales) and rows (1×128), W8A8",
        (true, false) => "fp8 e4m3 experts (128×128 block scales)",
        _ => "bf16",
    };
    use moeflow::parallel::StrategyKind;
    let exchange = match par.strategy {
        StrategyKind::AllGather => "all-gather / reduce-scatter",
        StrategyKind::AllGatherLogits => "all-gather of router logits / reduce-scatter",
        StrategyKind::Multicast => "multicast / all-reduce",
        _ => "all-to-all-v",
    };
    let kind = match capacity {
        Some(m) => format!("low-latency capacity {m} per rank in a CUDA graph"),
        None if par.dual_batch => format!("{exchange}, dual-batch overlap"),
        None => exchange.into(),
    };
    let (rank0, device) = match host {
        RankHost::Launched { env, .. } => (env.rank == 0, env.local_rank),
        _ => (true, 0),
    };
    let bar0 = spinner("measuring the GPU's GEMM rate and copy bandwidth".into());
    let ceilings = measure_ceilings(device)?;
    let (gemm_tflops, copy_gbps) = (ceilings.gemm_tflops, ceilings.copy_gbps);
    bar0.finish_and_clear();
    if rank0 {
        println!(
            "moeflow bench: {} on {} GPUs (device-resident {kind} over NCCL), {} experts ({} per GPU), top-{}, {dtype}; \
             GEMM {:.0} TFLOP/s, copy {:.0} GB/s per GPU",
            p.name,
            par.ep,
            config.num_experts,
            config.num_experts / par.ep,
            config.top_k,
            gemm_tflops,
            copy_gbps
        );
    }
    let bar0 = spinner(format!("generating weights on {} GPUs", par.ep));
    let results = on_ranks(host, par.ep, par.timeout, |comm, _| {
        let nccl = comm
            .as_any()
            .downcast_ref::<NcclComm>()
            .ok_or_else(|| MoeError::Config("the device-resident layer needs NCCL ranks".into()))?;
        let mut layer = CudaMoeLayer::random_ep(&config, args.layer.seed, nccl.duplicate()?)?;
        if fp8 {
            layer = layer.fp8_experts()?;
        }
        if rows8 {
            layer = layer.fp8_activations()?;
        }
        if let Some(m) = capacity {
            layer = layer.low_latency(m)?;
        }
        match par.strategy {
            StrategyKind::AllGather => layer = layer.all_gather()?,
            StrategyKind::AllGatherLogits => layer = layer.all_gather_logits()?,
            StrategyKind::Multicast => layer = layer.multicast()?,
            _ => {}
        }
        let layer = Timed::new(layer, par.dual_batch, par.dual_batch.then(|| nccl.duplicate()).transpose()?)?;
        let mut per_t = Vec::new();
        for &t in &args.tokens {
            let seed = args.layer.seed ^ (comm.rank() as u64) << 32;
            for w in 0..3 {
                layer.forward_timed(t, seed + w)?;
            }
            let runs = args.min_runs.max(20);
            let mut samples: Vec<GpuStageTimes> = Vec::with_capacity(runs);
            for r in 0..runs {
                comm.barrier()?;
                samples.push(layer.forward_timed(t, seed + 100 + r as u64)?);
            }
            let totals: Vec<f64> = samples.iter().map(|s| s.total).collect();
            let all = comm.all_gather_vec("bench.times", &totals)?;
            let slowest: Vec<f64> = (0..runs).map(|j| all.iter().map(|v| v[j]).fold(0.0, f64::max)).collect();
            if capacity.is_some() {
                // The graph times only the whole; the stages come from direct runs.
                let mut stages = Vec::with_capacity(runs);
                for r in 0..runs {
                    comm.barrier()?;
                    stages.push(layer.forward_timed_stages(t, seed + 200 + r as u64)?);
                }
                samples = stages;
            }
            per_t.push((slowest, samples));
        }
        Ok(per_t)
    });
    bar0.finish_and_clear();
    let mut mine = None;
    for (_, r) in results {
        let r = r?;
        mine.get_or_insert(r);
    }
    let measured = mine.ok_or_else(|| MoeError::Config("no ranks".into()))?;
    if !rank0 {
        return Ok(());
    }
    println!(
        "{:>7} {:>8} {:>9} {:>7} {:>8}   {:>6} {:>7} {:>8} {:>6} {:>6} {:>6} {:>7} {:>7} {:>6}   {:>9} {:>9}",
        "tokens",
        "ms",
        "floor ms",
        "floor%",
        "TFLOP/s",
        "route",
        "permute",
        "dispatch",
        "gemm1",
        "act",
        "gemm2",
        "collect",
        "combine",
        "shared",
        "disp GB/s",
        "comb GB/s"
    );
    let per_expert = 3 * config.hidden * config.inter * if fp8 { 1 } else { 2 };
    let mut records = Vec::new();
    let mut floor_inputs = Vec::new();
    let mut ours = Vec::new();
    let mut direct = Vec::new();
    for (&t, (slowest, samples)) in args.tokens.iter().zip(measured) {
        let med = |f: fn(&GpuStageTimes) -> f64| median(&samples.iter().map(f).collect::<Vec<_>>());
        let ms = median(&slowest);
        // Per GPU: its tokens' expert FLOPs, its experts' weights read once.
        let flops = config.expert_flops(t);
        let local = config.num_experts / par.ep;
        let bytes = local.min(t * par.ep * config.top_k) * per_expert
            + config.shared.map_or(0, |s| 3 * config.hidden * s.inter * 2);
        let floor = (flops / (gemm_tflops * 1e12)).max(bytes as f64 / (copy_gbps * 1e9)) * 1e3;
        floor_inputs.push((flops, bytes));
        let sent = med(|s| s.dispatch_bytes as f64);
        let (dispatch, collect) = (med(|s| s.dispatch), med(|s| s.collect));
        let gbps = |ms: f64| if ms > 0.0 { sent / ms / 1e6 } else { 0.0 };
        ours.push((t, ms, dispatch, collect));
        direct.push(format!("T={t}: {:.3}", med(|s| s.total)));
        println!(
            "{:>7} {:>8.3} {:>9.3} {:>6.0}% {:>8.1}   {:>6.3} {:>7.3} {:>8.3} {:>6.3} {:>6.3} {:>6.3} {:>7.3} {:>7.3} {:>6.3}   {:>9.1} {:>9.1}",
            t,
            ms,
            floor,
            100.0 * floor / ms,
            flops / ms / 1e9,
            med(|s| s.route),
            med(|s| s.permute),
            dispatch,
            med(|s| s.gemm1),
            med(|s| s.act),
            med(|s| s.gemm2),
            collect,
            med(|s| s.combine),
            med(|s| s.shared),
            gbps(dispatch),
            gbps(collect)
        );
        records.push(Record {
            preset: p.name.to_string(),
            backend: "cuda".into(),
            dtype: if fp8 { "f8e4m3" } else { "bf16" }.into(),
            quant: if rows8 { "fp8-block" } else { "none" }.into(),
            tokens: t,
            ep: par.ep,
            tp: 1,
            strategy: match (capacity, par.dual_batch) {
                (Some(_), _) => "lowlatency (device, graph)".to_string(),
                (None, dual) => format!("{} (device{})", par.strategy, if dual { ", dual-batch" } else { "" }),
            },
            rel_error: None,
            ms,
            gflops: flops / ms / 1e6,
            matmul_fraction: flops / ms / 1e9 / gemm_tflops,
            floor_ms: floor,
            floor_sustained_ms: None,
            runs: slowest.len(),
            stages_ms: StageTimes {
                route: med(|s| s.route),
                prepare: med(|s| s.permute + s.dispatch),
                experts: med(|s| s.gemm1 + s.act + s.gemm2),
                finalize: med(|s| s.collect + s.combine),
                shared: med(|s| s.shared),
            },
            bytes_moved_per_rank: 2 * sent as usize,
            comm_gbps: Some(gbps(dispatch + collect) * 2.0),
            bf16_matmul: None,
        });
    }
    if capacity.is_some() {
        println!(
            "stages from direct runs (no graph, all {} rows of the capacity); their layer ms per rank (median): {}",
            par.max_tokens_per_rank,
            direct.join(", ")
        );
    }
    sustained_floors(&mut records, &floor_inputs, copy_gbps, || {
        moeflow::backend::cuda::measure_sustained_gemm(device)
    })?;
    if let Some(path) = &args.json {
        write_records(path, &records)?;
    }
    if args.torch_baseline {
        torch_baseline(args, &config, par.ep, &ours)?;
    }
    Ok(())
}

/// Runs the Python baseline `source` (written to a temporary file) as
/// `python3 <launcher...> <script> <args...>` under a spinner saying `what`, and returns its
/// JSON line (the one holding `"baseline"`), or an error with the tail of its stderr.
fn run_baseline(source: &str, launcher: &[String], args: &[String], what: String) -> Result<serde_json::Value> {
    let io = |context: &str, e: std::io::Error| MoeError::Io { context: context.into(), source: e };
    let script = std::env::temp_dir().join(format!("moeflow_torch_baseline_{}.py", std::process::id()));
    std::fs::write(&script, source).map_err(|e| io("writing the baseline script", e))?;
    let bar = spinner(what);
    let out = std::process::Command::new("python3")
        .args(launcher)
        .arg(&script)
        .args(args)
        .output()
        .map_err(|e| io("starting python3", e));
    bar.finish_and_clear();
    let _ = std::fs::remove_file(&script);
    let out = out?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().find(|l| l.contains("\"baseline\"")).ok_or_else(|| {
        MoeError::Config(format!(
            "the PyTorch baseline failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).lines().rev().take(5).collect::<Vec<_>>().join(" | ")
        ))
    })?;
    serde_json::from_str(line).map_err(|e| MoeError::Json { context: "baseline output".into(), source: e })
}

/// The shape arguments both baseline scripts take, from `config`.
fn baseline_shape_args(config: &moeflow::MoeConfig, tokens: &[usize], runs: usize) -> Vec<String> {
    let tokens: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
    [
        ("--hidden", config.hidden.to_string()),
        ("--inter", config.inter.to_string()),
        ("--experts", config.num_experts.to_string()),
        ("--top-k", config.top_k.to_string()),
        ("--shared-inter", config.shared.map_or(0, |s| s.inter).to_string()),
        ("--tokens", tokens.join(",")),
        ("--runs", runs.to_string()),
    ]
    .into_iter()
    .flat_map(|(flag, value)| [flag.to_string(), value])
    .collect()
}

/// Runs tools/torch_ep_baseline.py on `ep` GPUs with the preset's shapes and prints its times
/// beside `ours` (tokens, layer ms, dispatch ms, combine ms).
fn torch_baseline(
    args: &BenchArgs,
    config: &moeflow::MoeConfig,
    ep: usize,
    ours: &[(usize, f64, f64, f64)],
) -> Result<()> {
    let port = moeflow::comm::free_port().map_err(|e| MoeError::Io { context: "choosing a port".into(), source: e })?;
    let launcher: Vec<String> = ["-m", "torch.distributed.run", "--nproc-per-node", &ep.to_string(), "--master-port"]
        .iter()
        .map(|s| s.to_string())
        .chain([port.to_string()])
        .collect();
    let v = run_baseline(
        TORCH_BASELINE,
        &launcher,
        &baseline_shape_args(config, &args.tokens, args.min_runs.max(20)),
        format!("running the PyTorch + NCCL baseline on {ep} GPUs"),
    )?;
    println!("PyTorch {} + NCCL baseline, same shapes, same GPUs:", v["torch"].as_str().unwrap_or("?"));
    println!(
        "{:>7} {:>10} {:>10} {:>8}   {:>12} {:>12}",
        "tokens", "torch ms", "moeflow ms", "speedup", "torch disp", "torch comb"
    );
    for rec in v["records"].as_array().into_iter().flatten() {
        let t = rec["tokens"].as_u64().unwrap_or(0) as usize;
        let ms = rec["ms"].as_f64().unwrap_or(f64::NAN);
        let mine = ours.iter().find(|o| o.0 == t).map_or(f64::NAN, |o| o.1);
        println!(
            "{:>7} {:>10.3} {:>10.3} {:>7.2}x   {:>12.3} {:>12.3}",
            t,
            ms,
            mine,
            ms / mine,
            rec["dispatch_ms"].as_f64().unwrap_or(f64::NAN),
            rec["combine_ms"].as_f64().unwrap_or(f64::NAN)
        );
    }
    Ok(())
}

/// Runs the one-device PyTorch layer with the preset's shapes and prints its times beside
/// `ours` (tokens, layer ms): tools/torch_gpu_baseline.py on this GPU with `gpu`, else
/// tools/torch_cpu_baseline.py with the run's weight dtype and matmul precision on this machine.
fn torch_single_baseline(
    args: &BenchArgs,
    config: &moeflow::MoeConfig,
    gpu: bool,
    ours: &[(usize, f64)],
) -> Result<()> {
    let mut script_args = baseline_shape_args(config, &args.tokens, args.min_runs.max(if gpu { 20 } else { 5 }));
    let v = if gpu {
        run_baseline(TORCH_GPU_BASELINE, &[], &script_args, "running the PyTorch baseline on this GPU".into())?
    } else {
        // bf16 or f32 (checked before the run). bf16 weights are multiplied as moeflow does:
        // bf16 matmuls beside its dot products, f32 matmuls on widened weights beside `widen`.
        let bf16 = args.layer.dtype == DType::BF16;
        let compute = if bf16 && args.parallel.bf16_matmul.uses_dot() { "bf16" } else { "f32" };
        script_args.extend(["--dtype", if bf16 { "bf16" } else { "f32" }, "--compute", compute].map(String::from));
        run_baseline(TORCH_CPU_BASELINE, &[], &script_args, "running the PyTorch CPU baseline".into())?
    };
    let torch = v["torch"].as_str().unwrap_or("?");
    if gpu {
        println!("PyTorch {torch} baseline on this GPU (argsort, torch._grouped_mm, bf16), same shapes:");
    } else {
        println!(
            "PyTorch {torch} baseline on this machine ({} threads, {} weights, {} matmuls), same shapes:",
            v["threads"].as_u64().unwrap_or(0),
            v["dtype"].as_str().unwrap_or("?"),
            v["compute"].as_str().unwrap_or("?")
        );
    }
    println!("{:>7} {:>10} {:>10} {:>8}", "tokens", "torch ms", "moeflow ms", "speedup");
    for rec in v["records"].as_array().into_iter().flatten() {
        let t = rec["tokens"].as_u64().unwrap_or(0) as usize;
        let ms = rec["ms"].as_f64().unwrap_or(f64::NAN);
        let mine = ours.iter().find(|o| o.0 == t).map_or(f64::NAN, |o| o.1);
        println!("{:>7} {:>10.3} {:>10.3} {:>7.2}x", t, ms, mine, ms / mine);
    }
    Ok(())
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
    let gpu = args.backend == Backend::Cuda;
    args.parallel.check_bf16_matmul(args.layer.dtype, gpu)?;
    let host = RankHost::detect(gpu)?;
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
        let (_, config) = args.layer.config()?;
        let par = args.parallel.config(1)?;
        if device_resident(&par, config.num_experts) {
            return run_cuda_ep(&args, &host);
        }
        if args.torch_baseline {
            return Err(MoeError::Config(
                "--torch-baseline compares the device-resident layer; this layout runs host-staged".into(),
            ));
        }
        println!(
            "note: the device-resident layer covers all2allv, allgather, allgather-logits, multicast (also \
             --dual-batch) and lowlatency with contiguous placement, TP 1, no replicas, experts divisible by \
             EP; this layout runs host-staged (rows through host memory)"
        );
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

/// Refuses `--torch-baseline` where no baseline runs beside the layer, before any work: it
/// compares one CPU rank (bf16 or f32 weights), one GPU, or the device-resident multi-GPU
/// layer, started without a launcher.
fn check_torch_baseline(args: &BenchArgs, gpu: bool, host: &RankHost) -> Result<()> {
    let refuse = |why: &str| Err(MoeError::Config(format!("--torch-baseline {why}")));
    if host.launched_rank().is_some() {
        return refuse("starts its own processes: run without a launcher");
    }
    if gpu {
        if args.host_staged {
            return refuse("compares the device-resident layer, not --host-staged");
        }
    } else {
        if args.parallel.ep != 1 {
            return refuse("on CPU compares one rank (--ep 1)");
        }
        if !matches!(args.layer.dtype, DType::BF16 | DType::F32) {
            return refuse(&format!("on CPU takes bf16 or f32 weights, not {}", args.layer.dtype));
        }
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
    let fp8 = gpu_fp8_experts(args.layer.dtype, true)?;
    let rows8 = gpu_fp8_rows(args.parallel.quant, fp8)?;
    let bar0 = spinner("generating weights on the GPU".into());
    let mut gpu = moeflow::backend::cuda::CudaMoeLayer::random(&config, args.layer.seed)?;
    if fp8 {
        gpu = gpu.fp8_experts()?;
    }
    if rows8 {
        gpu = gpu.fp8_activations()?;
    }
    bar0.set_message("measuring the GPU's GEMM rate and copy bandwidth");
    let ceilings = gpu.measure_ceilings()?;
    let (gemm_tflops, copy_gbps) = (ceilings.gemm_tflops, ceilings.copy_gbps);
    let device = gpu.device_name();
    let gpu = Timed::new(gpu, args.parallel.dual_batch, None)?;
    bar0.finish_and_clear();
    println!(
        "moeflow bench: {} on {} ({} experts, top-{}, {}{}); GEMM {:.0} TFLOP/s (cuBLAS bf16 8192³), copy {:.0} GB/s",
        p.name,
        device,
        config.num_experts,
        config.top_k,
        match (fp8, rows8) {
            (true, true) => "fp8 e4m3 experts (128×128 block scales) and rows (1×128), W8A8 masked GEMM",
            (true, false) => "fp8 e4m3 experts (128×128 block scales), masked GEMM",
            _ => "bf16",
        },
        if args.parallel.dual_batch { ", dual-batch overlap" } else { "" },
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
    let per_expert = 3 * config.hidden * config.inter * if fp8 { 1 } else { 2 };
    let mut records = Vec::new();
    let mut floor_inputs = Vec::new();
    for &t in &args.tokens {
        let (failed_before, _) = gpu.failed_graph_captures();
        for _ in 0..3 {
            gpu.forward_timed(t, args.layer.seed)?;
        }
        let runs = args.min_runs.max(20);
        let samples: Vec<_> =
            (0..runs).map(|r| gpu.forward_timed(t, args.layer.seed + r as u64)).collect::<Result<_>>()?;
        // A batch that replays its CUDA graph is timed as a whole: its stages come from runs with
        // events between them.
        let staged: Vec<_> = if gpu.replays_graph(t) {
            (0..runs).map(|r| gpu.forward_timed_stages(t, args.layer.seed + r as u64)).collect::<Result<_>>()?
        } else {
            samples.clone()
        };
        type Times = moeflow::backend::cuda::GpuStageTimes;
        let med = |f: fn(&Times) -> f64| median(&staged.iter().map(f).collect::<Vec<_>>());
        let ms = median(&samples.iter().map(|s| s.total).collect::<Vec<_>>());
        let flops = config.expert_flops(t);
        // The experts the runs' routings reached (fewer than t · k when tokens share experts).
        let used = med(|s| s.experts_used as f64);
        let experts_read = if used > 0.0 { used.round() as usize } else { config.num_experts.min(t * config.top_k) };
        let bytes = experts_read * per_expert
            + config.shared.map_or(0, |s| 3 * config.hidden * s.inter * 2)
            + t * config.hidden * 8;
        let floor = (flops / (gemm_tflops * 1e12)).max(bytes as f64 / (copy_gbps * 1e9)) * 1e3;
        floor_inputs.push((flops, bytes));
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
        let (failed, why) = gpu.failed_graph_captures();
        if failed > failed_before {
            println!(
                "{:>7} note: {} CUDA graph capture(s) failed; those runs went launch by launch (the latest: {})",
                "",
                failed - failed_before,
                why.as_deref().unwrap_or("no reason kept")
            );
        }
        records.push(Record {
            preset: p.name.to_string(),
            backend: "cuda".into(),
            dtype: if fp8 { "f8e4m3" } else { "bf16" }.into(),
            quant: if rows8 { "fp8-block" } else { "none" }.into(),
            tokens: t,
            ep: 1,
            tp: 1,
            strategy: if args.parallel.dual_batch { "local (dual-batch)" } else { "local" }.into(),
            rel_error: None,
            ms,
            gflops: flops / ms / 1e6,
            matmul_fraction: flops / ms / 1e9 / gemm_tflops,
            floor_ms: floor,
            floor_sustained_ms: None,
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
            bf16_matmul: None,
        });
    }
    sustained_floors(&mut records, &floor_inputs, copy_gbps, || moeflow::backend::cuda::measure_sustained_gemm(0))?;
    if let Some(path) = &args.json {
        write_records(path, &records)?;
    }
    if args.torch_baseline {
        let ours: Vec<(usize, f64)> = records.iter().map(|r| (r.tokens, r.ms)).collect();
        torch_single_baseline(args, &config, true, &ours)?;
    }
    Ok(())
}

/// After a GPU benchmark's runs (it leaves the GPU throttled for a while): measures the GEMM
/// rate the GPU holds under sustained load, prints it with each record's floor at that rate,
/// and sets the records' `floor_sustained_ms` from their (FLOPs, bytes).
fn sustained_floors(
    records: &mut [Record],
    floor_inputs: &[(f64, usize)],
    copy_gbps: f64,
    measure: impl FnOnce() -> Result<f64>,
) -> Result<()> {
    let bar = spinner("measuring the GEMM rate under sustained load".into());
    let tflops = measure()?;
    bar.finish_and_clear();
    let mut floors = Vec::new();
    for (r, &(flops, bytes)) in records.iter_mut().zip(floor_inputs) {
        let floor = (flops / (tflops * 1e12)).max(bytes as f64 / (copy_gbps * 1e9)) * 1e3;
        r.floor_sustained_ms = Some(floor);
        floors.push(format!("T {} {:.3} ms ({:.0}%)", r.tokens, floor, 100.0 * floor / r.ms));
    }
    println!(
        "sustained: the same GEMM runs at {tflops:.0} TFLOP/s after a second of load (power-capped clocks); \
         floors at that rate: {}",
        floors.join(", ")
    );
    Ok(())
}
