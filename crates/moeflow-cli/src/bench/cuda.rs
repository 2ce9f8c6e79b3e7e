//! `bench --backend cuda`: the device-resident layer on one GPU or one GPU per rank, timed
//! with CUDA events, against the GPU's measured GEMM rate and copy bandwidth.

use super::records::add_field;
use super::torch::{torch_baseline, torch_single_baseline};
use super::{against_bf16, write_records, BenchArgs, Record};
use crate::common::{median, spinner};
use moeflow::comm::CommExt;
use moeflow::parallel::{on_ranks, ParallelConfig, RankHost};
use moeflow::{DType, MoeError, RankLayerSpec, Result, StageTimes};

/// Whether `--dtype` asks for fp8 routed experts on GPUs (bf16 otherwise); `runs_fp8` says
/// whether this layout multiplies fp8 codes (one GPU, the low-latency layer, or W8A8), and a
/// refusal names where they do run.
pub(super) fn gpu_fp8_experts(dtype: DType, runs_fp8: bool) -> Result<bool> {
    match dtype {
        DType::BF16 => Ok(false),
        DType::F8E4M3 if runs_fp8 => Ok(true),
        DType::F8E4M3 => Err(MoeError::Unsupported(
            "--dtype f8e4m3 with --ep N runs in the low-latency layer (--strategy lowlatency) or with fp8 rows \
             (--quant fp8-block)"
                .into(),
        )),
        other => Err(MoeError::Unsupported(format!(
            "--dtype {other} on GPUs: use bf16, or f8e4m3 (one GPU, or --strategy lowlatency)"
        ))),
    }
}

/// Whether `--quant` asks for fp8 GEMM rows on GPUs (W8A8: `fp8-block` with fp8 experts); any
/// other quantization there is refused with a message naming what does run.
pub(super) fn gpu_fp8_rows(quant: moeflow::quant::QuantConfig, fp8_experts: bool) -> Result<bool> {
    use moeflow::quant::QuantConfig;
    match quant {
        QuantConfig::None => Ok(false),
        QuantConfig::Fp8Block if fp8_experts => Ok(true),
        other => Err(MoeError::Unsupported(format!(
            "--quant {other} on GPUs: the GPU layer quantizes GEMM rows only as fp8-block with --dtype f8e4m3 \
             (W8A8)"
        ))),
    }
}

/// The GPU layer a benchmark times: whole, or as two micro-batches (dual-batch overlap), as
/// the library chose it.
pub(super) struct Timed(pub(super) moeflow::RankLayer);

impl Timed {
    /// One timed run of `tokens` random tokens (see `CudaMoeLayer::forward_timed`): a
    /// TP-sliced device layer times the whole layer on its TP group's batch, the all-gather of
    /// the shares included; around dual-batch halves a TP rank times its share of them (the
    /// host all-gather after it is not timed).
    pub(super) fn forward_timed(&self, tokens: usize, seed: u64) -> Result<moeflow::backend::GpuStageTimes> {
        match (self.0.device_layer(), self.0.device_dual()) {
            (Some(l), _) => l.forward_timed(tokens, seed),
            (None, Some(d)) => d.forward_timed(self.0.tokens_here(tokens), seed),
            _ => Err(MoeError::Config(format!("this layout is timed whole, not on the device: {}", self.0.describe()))),
        }
    }

    /// A run with every stage timed (a low-latency layer's inside a stamped capture of its graph).
    fn forward_timed_stages(&self, tokens: usize, seed: u64) -> Result<moeflow::backend::GpuStageTimes> {
        match self.0.device_layer() {
            Some(l) => l.forward_timed_stages(tokens, seed),
            None => self.forward_timed(tokens, seed),
        }
    }

    /// Whether `forward_timed` replays a one-GPU graph for `tokens` tokens (timing only the whole).
    fn replays_graph(&self, tokens: usize) -> bool {
        self.0.device_layer().is_some_and(|l| l.replays_graph(tokens))
    }

    /// Captures of one-GPU graphs that failed so far (those calls ran launch by launch), and
    /// why the latest failed.
    fn failed_graph_captures(&self) -> (usize, Option<String>) {
        self.0.device_layer().map_or((0, None), |l| (l.failed_graph_captures(), l.last_graph_capture_failure()))
    }
}

/// The exchange and the weight format of an expert-parallel run, in words.
fn ep_kind(par: &ParallelConfig, capacity: Option<usize>, fp8: bool, rows8: bool) -> (String, &'static str) {
    use moeflow::parallel::StrategyKind;
    let dtype = match (fp8, rows8) {
        (true, true) => "fp8 e4m3 experts (128×128 block scales) and rows (1×128), W8A8",
        (true, false) => "fp8 e4m3 experts (128×128 block scales)",
        _ => "bf16",
    };
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
    (kind, dtype)
}

/// One rank's timed runs of every token count of `tokens`: per count, the slowest rank's layer
/// ms of each run and this rank's stage times (for a low-latency layer, whose graph's replay
/// times only the whole, from a capture of it that stamps the GPU's clock between the stages).
pub(super) fn time_rank(
    args: &BenchArgs,
    layer: &Timed,
    comm: &dyn moeflow::comm::Communicator,
    tokens: &[usize],
    low_latency: bool,
) -> Result<Vec<(Vec<f64>, Vec<moeflow::backend::GpuStageTimes>)>> {
    let mut per_t = Vec::new();
    for &t in tokens {
        let seed = args.layer.seed ^ (comm.rank() as u64) << 32;
        for w in 0..3 {
            layer.forward_timed(t, seed + w)?;
        }
        let runs = args.min_runs.max(20);
        let mut samples = Vec::with_capacity(runs);
        for r in 0..runs {
            comm.barrier()?;
            samples.push(layer.forward_timed(t, seed + 100 + r as u64)?);
        }
        let totals: Vec<f64> = samples.iter().map(|s| s.total).collect();
        let all = comm.all_gather_vec("bench.times", &totals)?;
        let slowest: Vec<f64> = (0..runs).map(|j| all.iter().map(|v| v[j]).fold(0.0, f64::max)).collect();
        if low_latency {
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
}

/// `bench --backend cuda --ep N` on the device-resident layer: CUDA-event stage times per
/// rank (medians), the layer time as the slowest rank's per run, dispatch and combine GB/s.
/// The low-latency layer's time is its graph's replay; its stages are timed inside a stamped
/// capture of the graph.
pub(super) fn run_cuda_ep(args: &BenchArgs, host: &RankHost) -> Result<()> {
    use moeflow::backend::cuda::measure_ceilings;
    let (p, config) = args.layer.config()?;
    let cuda = crate::cuda_args::cuda_options(&args.parallel)?;
    let par = args.parallel.config(args.tokens.iter().copied().max().unwrap_or(1))?;
    let capacity = (par.strategy == moeflow::parallel::StrategyKind::LowLatency).then_some(par.max_tokens_per_rank);
    // Routed experts in fp8 (128 × 128 block scales): the low-latency layer streams the codes,
    // and W8A8 multiplies them (on Hopper's fp8 tensor cores); elsewhere the bf16 values would
    // run instead, so that is refused.
    let w8a8 = par.quant == moeflow::quant::QuantConfig::Fp8Block;
    let fp8 = gpu_fp8_experts(args.layer.dtype, capacity.is_some() || w8a8)?;
    let rows8 = gpu_fp8_rows(par.quant, fp8)?;
    let (kind, dtype) = ep_kind(&par, capacity, fp8, rows8);
    let (rank0, device) = match host {
        RankHost::Launched { env, .. } => (env.rank == 0, env.local_rank),
        _ => (true, 0),
    };
    let bar0 = spinner("measuring the GPU's GEMM rate and copy bandwidth".into());
    let ceilings = measure_ceilings(device)?;
    let (gemm_tflops, gemm_what) = floor_gemm_rate(device, rows8, ceilings.gemm_tflops)?;
    let copy_gbps = ceilings.copy_gbps;
    // The link's ceiling: a plain copy from this GPU into the next one's memory.
    let gpus = moeflow::backend::cuda::device_count();
    let (peer_gbps, push_gbps, both_ways) = match (rank0, gpus > 1) {
        (true, true) => {
            use moeflow::backend::cuda::{measure_peer_both_ways, measure_peer_copy, measure_peer_push};
            let (next, sms) = ((device + 1) % gpus, cuda.transport_sms);
            let push = measure_peer_push(device, next, sms).ok();
            // Both GPUs sending at once, as every rank of an exchange does.
            let both = measure_peer_both_ways(device, next, None)
                .ok()
                .zip(measure_peer_both_ways(device, next, Some(sms)).ok());
            (measure_peer_copy(device, next).ok(), push, both)
        }
        _ => (None, None, None),
    };
    bar0.finish_and_clear();
    if rank0 {
        println!(
            "moeflow bench: {} on {} GPUs (device-resident {kind}, transport {}), {} experts ({} per GPU), top-{}, {dtype}; \
             GEMM {:.0} TFLOP/s ({gemm_what}), copy {:.0} GB/s per GPU{}",
            p.name,
            par.ep,
            cuda.transport,
            config.num_experts,
            config.num_experts / par.ep,
            config.top_k,
            gemm_tflops,
            copy_gbps,
            peer_gbps.map_or(String::new(), |g| format!(", peer copy {g:.0} GB/s one way"))
        );
        if let (Some(copy), Some(push)) = (peer_gbps, push_gbps) {
            println!(
                "  NVLink transport's push kernel on {} SMs: {push:.0} GB/s one way ({:.0}% of the peer copy)",
                cuda.transport_sms,
                100.0 * push / copy
            );
        }
        if let Some((copy, push)) = both_ways {
            println!("  both GPUs sending at once: the peer copy {copy:.0} GB/s each way, the push kernel {push:.0} GB/s each way");
        }
    }
    if rank0 {
        print_skew(args);
    }
    let weights = device_weights(args, &config);
    let placement = par.placement(config.num_experts)?;
    let bar0 = spinner(format!("generating weights on {} GPUs", par.ep));
    let results = on_ranks(host, par.ep, par.timeout, |comm, experts| {
        let spec = RankLayerSpec {
            cuda: cuda.clone(),
            fp8_experts: fp8,
            fp8_rows: rows8,
            fp8_shared_expert: fp8,
            ..weights.clone()
        };
        let layer = Timed(par.rank_layer(Some(comm), experts, &spec)?);
        let per_t = time_rank(args, &layer, comm, &args.tokens, capacity.is_some())?;
        let shares = super::gather_load(args, &config, comm, layer.0.load_stats(), &placement)?;
        let recording = recording_ms(args, &layer, Some(comm))?;
        Ok((per_t, layer.0.describe().to_string(), recording, shares))
    });
    bar0.finish_and_clear();
    let mut mine = None;
    for (_, r) in results {
        let r = r?;
        mine.get_or_insert(r);
    }
    let (measured, path, recording, shares) = mine.ok_or_else(|| MoeError::Config("no ranks".into()))?;
    if !rank0 {
        return Ok(());
    }
    let layer_ms: Vec<f64> = measured.iter().map(|(slowest, _)| median(slowest)).collect();
    println!("  layer: {path}");
    print_ep_header();
    let ctx = EpTable {
        name: p.name,
        config: &config,
        par: &par,
        capacity,
        fp8,
        rows8,
        gemm_tflops,
        copy_gbps,
        peer_gbps,
        push_both_gbps: both_ways.map(|(_, push)| push),
    };
    let (mut records, (floor_inputs, ours, staged)) = ctx.rows(&args.tokens, measured);
    if capacity.is_some() {
        println!(
            "stages inside the graph, from clock stamps between them (a one-thread kernel each; over NVLink the \
             dispatch's own kernel packs its rows, so permute is empty); the stamped graph's layer ms on rank 0 \
             (median): {}",
            staged.join(", ")
        );
    }
    print_recording_cost(&args.tokens, &layer_ms, recording.as_deref());
    if let Some(shares) = &shares {
        super::print_rank_shares(shares);
    }
    sustained_floors(&mut records, &floor_inputs, copy_gbps, || sustained_gemm_rate(device, rows8))?;
    if let Some(path) = &args.json {
        write_records(path, &records)?;
    }
    if args.torch_baseline {
        torch_baseline(args, &config, par.ep, &ours)?;
    }
    Ok(())
}

/// What an expert-parallel run's table rows are computed from.
struct EpTable<'a> {
    name: &'a str,
    config: &'a moeflow::MoeConfig,
    par: &'a ParallelConfig,
    capacity: Option<usize>,
    fp8: bool,
    rows8: bool,
    gemm_tflops: f64,
    copy_gbps: f64,
    /// The peer copy between two of the GPUs, GB/s one way (where measured).
    peer_gbps: Option<f64>,
    /// The push kernel between them with both sending at once, GB/s each way (where measured).
    push_both_gbps: Option<f64>,
}

/// Per token count: the slowest rank's layer ms of each run and rank 0's stage times.
type EpMeasured = Vec<(Vec<f64>, Vec<moeflow::backend::GpuStageTimes>)>;

/// A token count's expert FLOPs and weight bytes per GPU; its (tokens, ms, dispatch ms,
/// collect ms); and the stage-timed runs' layer ms in words.
type EpRowParts = (Vec<(f64, usize)>, Vec<(usize, f64, f64, f64)>, Vec<String>);

/// The table's header.
fn print_ep_header() {
    println!(
        "{:>7} {:>8} {:>9} {:>7} {:>8}   {:>6} {:>7} {:>8} {:>6} {:>6} {:>6} {:>7} {:>7} {:>6}   {:>9} {:>9}  {}",
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
        "comb GB/s",
        "strategy/transport/experts"
    );
}

impl EpTable<'_> {
    /// Prints a row per token count and returns the records, with the parts the sustained
    /// floors, the PyTorch comparison and the low-latency note need.
    fn rows(&self, tokens: &[usize], measured: EpMeasured) -> (Vec<Record>, EpRowParts) {
        use moeflow::backend::cuda::GpuStageTimes;
        let (config, par, capacity, fp8, rows8) = (self.config, self.par, self.capacity, self.fp8, self.rows8);
        let (gemm_tflops, copy_gbps) = (self.gemm_tflops, self.copy_gbps);
        let width = if fp8 { 1 } else { 2 };
        let per_expert = 3 * config.hidden * config.inter * width;
        let mut records = Vec::new();
        let mut floor_inputs = Vec::new();
        let mut ours = Vec::new();
        let mut staged = Vec::new();
        for (&t, (slowest, samples)) in tokens.iter().zip(measured) {
            let med = |f: fn(&GpuStageTimes) -> f64| median(&samples.iter().map(f).collect::<Vec<_>>());
            let ms = median(&slowest);
            // Per GPU: its tokens' expert FLOPs, the weights of the experts it serves read once.
            let flops = ep_rank_flops(config, par, t);
            let experts = ep_experts_read(config, par, t, med(|s| s.experts_used as f64));
            let bytes = (experts * per_expert as f64).round() as usize
                + config.shared.map_or(0, |s| 3 * config.hidden * s.inter * width);
            let floor = (flops / (gemm_tflops * 1e12)).max(bytes as f64 / (copy_gbps * 1e9)) * 1e3;
            floor_inputs.push((flops, bytes));
            let sent = med(|s| s.dispatch_bytes as f64);
            let (dispatch, collect) = (med(|s| s.dispatch), med(|s| s.collect));
            let gbps = |ms: f64| if ms > 0.0 { sent / ms / 1e6 } else { 0.0 };
            // The strategy and the experts' implementation that ran this batch (stage-timed runs).
            let experts = samples.iter().find(|s| !s.experts.is_empty()).map_or("-".to_string(), |s| {
                let plan = match (s.device_plan, s.rows_beside_routing, s.rows_home_from_gemm) {
                    (true, true, true) => " (device plan, rows beside the routing, home from the GEMM)",
                    (true, true, false) => " (device plan, rows beside the routing)",
                    (true, false, true) => " (device plan, rows home from the GEMM)",
                    (true, false, false) => " (device plan)",
                    _ => "",
                };
                format!("{}/{}{plan}/{}", s.strategy, s.transport, s.experts)
            });
            // Dispatch and combine against the link's ceiling; a dispatch whose rows crossed
            // beside the routing, and a return whose rows went home from the GEMM, have no rate
            // of their own ("-").
            let beside = samples.iter().any(|s| s.rows_beside_routing);
            let from_gemm = samples.iter().any(|s| s.rows_home_from_gemm);
            let rate = |ms: f64, of: f64| format!("{:.0}%", 100.0 * gbps(ms) / of);
            let dispatch_rate = |of: f64| if beside { "-".to_string() } else { rate(dispatch, of) };
            let collect_rate = |of: f64| if from_gemm { "-".to_string() } else { rate(collect, of) };
            let link = self.peer_gbps.map_or(String::new(), |p| {
                let both = self.push_both_gbps.map_or(String::new(), |b| {
                    format!(", {} / {} of the push both ways", dispatch_rate(b), collect_rate(b))
                });
                format!(" ({} / {} of peer copy{both})", dispatch_rate(p), collect_rate(p))
            });
            let dispatch_gbps = if beside { "-".to_string() } else { format!("{:.1}", gbps(dispatch)) };
            let collect_gbps = if from_gemm { "-".to_string() } else { format!("{:.1}", gbps(collect)) };
            ours.push((t, ms, dispatch, collect));
            staged.push(format!("T={t}: {:.3}", med(|s| s.total)));
            println!(
            "{:>7} {:>8.3} {:>9.3} {:>6.0}% {:>8.1}   {:>6.3} {:>7.3} {:>8.3} {:>6.3} {:>6.3} {:>6.3} {:>7.3} {:>7.3} {:>6.3}   {:>9} {:>9}  {}",
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
            dispatch_gbps,
            collect_gbps,
            format!("{experts}{link}")
        );
            records.push(Record {
                preset: self.name.to_string(),
                backend: "cuda".into(),
                dtype: if fp8 { "f8e4m3" } else { "bf16" }.into(),
                quant: if rows8 { "fp8-block" } else { "none" }.into(),
                tokens: t,
                ep: par.ep,
                tp: par.tp,
                strategy: match (capacity, par.dual_batch) {
                    (Some(_), dual) => {
                        format!("lowlatency (device, graph{}, {experts})", if dual { ", dual-batch" } else { "" })
                    }
                    (None, dual) => {
                        format!("{} (device{}, {experts})", par.strategy, if dual { ", dual-batch" } else { "" })
                    }
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
                probe_gflops: None,
                bf16_matmul: None,
            });
        }
        (records, (floor_inputs, ours, staged))
    }
}

/// Per token count, the device time of one call's load recording (the counting kernel; see
/// `CudaMoeLayer::load_recording_ms`) on this rank, the slowest rank's with `comm`; `None`
/// where the layer does not run whole on the device (dual-batch) or records nothing.
fn recording_ms(
    args: &BenchArgs,
    layer: &Timed,
    comm: Option<&dyn moeflow::comm::Communicator>,
) -> Result<Option<Vec<f64>>> {
    let Some(device) = layer.0.device_layer().filter(|l| l.options().load_stats) else { return Ok(None) };
    let mine: Vec<f64> =
        args.tokens.iter().map(|&t| device.load_recording_ms(layer.0.tokens_here(t))).collect::<Result<_>>()?;
    let Some(comm) = comm else { return Ok(Some(mine)) };
    let all = comm.all_gather_vec("bench.recording", &mine)?;
    Ok(Some((0..mine.len()).map(|j| all.iter().map(|v| v[j]).fold(0.0, f64::max)).collect()))
}

/// Prints what recording the load statistics adds to the layer's `layer_ms` per token count.
fn print_recording_cost(tokens: &[usize], layer_ms: &[f64], recording: Option<&[f64]>) {
    let Some(recording) = recording else { return };
    let each: Vec<String> = tokens
        .iter()
        .zip(layer_ms.iter().zip(recording))
        .map(|(t, (ms, rec))| {
            if *rec == 0.0 {
                // The fused router counts these batches in its own launch.
                format!("T={t}: in the router's launch")
            } else {
                format!("T={t}: {:.1} µs, {:.2} %", rec * 1e3, 100.0 * rec / ms)
            }
        })
        .collect();
    println!(
        "load statistics: counting a call's tokens per expert on the device takes (share of the layer) {}",
        each.join("; ")
    );
}

/// The layer's weights, generated on the device from `args`' seed, with `--skew`'s bias added
/// to the router's on the device (see `CudaMoeLayer::skew_router`).
pub(super) fn device_weights<'a>(args: &BenchArgs, config: &'a moeflow::MoeConfig) -> RankLayerSpec<'a> {
    RankLayerSpec { skew: args.layer.skew.skew.clone(), ..RankLayerSpec::random_on_device(config, args.layer.seed) }
}

/// Says how `--skew` skews the routing, if given.
fn print_skew(args: &BenchArgs) {
    if let Some(skew) = &args.layer.skew.skew {
        println!("  routing skewed  {skew} (a bias on the router logits, added on the device)");
    }
}

/// `bench --backend cuda`: CUDA-event stage times (medians), TFLOP/s, HBM GB/s, and the
/// fraction of the floor (FLOPs at the measured GEMM rate, bytes at the measured copy rate).
pub(super) fn run_cuda(args: &BenchArgs) -> Result<()> {
    let (p, config) = args.layer.config()?;
    if args.parallel.ep != 1 {
        return Err(MoeError::Unsupported("--backend cuda runs one GPU (EP 1) in this build".into()));
    }
    let fp8 = gpu_fp8_experts(args.layer.dtype, true)?;
    let rows8 = gpu_fp8_rows(args.parallel.quant, fp8)?;
    let bar0 = spinner("generating weights on the GPU".into());
    let par = args.parallel.config(1)?;
    let spec = RankLayerSpec {
        cuda: crate::cuda_args::cuda_options(&args.parallel)?,
        fp8_experts: fp8,
        fp8_rows: rows8,
        fp8_shared_expert: fp8,
        ..device_weights(args, &config)
    };
    let gpu = Timed(par.rank_layer(None, moeflow::ExpertsKind::Cuda { device: 0 }, &spec)?);
    bar0.set_message("measuring the GPU's GEMM rate and copy bandwidth");
    let ceilings = moeflow::backend::cuda::measure_ceilings(0)?;
    let (gemm_tflops, gemm_what) = floor_gemm_rate(0, rows8, ceilings.gemm_tflops)?;
    let copy_gbps = ceilings.copy_gbps;
    let device = gpu.0.device_layer().map_or_else(|| "GPU 0".to_string(), |l| l.device_name());
    bar0.finish_and_clear();
    println!(
        "moeflow bench: {} on {} ({} experts, top-{}, {}{}); GEMM {:.0} TFLOP/s ({gemm_what}), copy {:.0} GB/s",
        p.name,
        device,
        config.num_experts,
        config.top_k,
        match (fp8, rows8) {
            (true, true) => {
                "fp8 e4m3 experts (128×128 block scales) and rows (1×128), W8A8: the fp8 Hopper GEMM (elsewhere the \
                 masked GEMM up to 32 rows an expert)"
            }
            (true, false) => {
                "fp8 e4m3 experts (128×128 block scales): the masked GEMM up to 32 rows an expert, their bf16 \
                 values above"
            }
            _ => "bf16",
        },
        if args.parallel.dual_batch { ", dual-batch overlap" } else { "" },
        gemm_tflops,
        copy_gbps
    );
    println!("  layer: {}", gpu.0.describe());
    print_skew(args);
    print_one_gpu_header();
    let width = if fp8 { 1 } else { 2 };
    let per_expert = 3 * config.hidden * config.inter * width;
    let mut records = Vec::new();
    let mut floor_inputs = Vec::new();
    for &t in &args.tokens {
        let (failed_before, _) = gpu.failed_graph_captures();
        let runs = args.min_runs.max(20);
        let (samples, staged) = time_one_gpu(&gpu, t, runs, args.layer.seed)?;
        type Times = moeflow::backend::cuda::GpuStageTimes;
        let med = |f: fn(&Times) -> f64| median(&staged.iter().map(f).collect::<Vec<_>>());
        let ms = median(&samples.iter().map(|s| s.total).collect::<Vec<_>>());
        let flops = config.expert_flops(t);
        // The experts the runs' routings reached (fewer than t · k when tokens share experts).
        let used = med(|s| s.experts_used as f64);
        let experts_read = if used > 0.0 { used.round() as usize } else { config.num_experts.min(t * config.top_k) };
        let bytes = experts_read * per_expert
            + config.shared.map_or(0, |s| 3 * config.hidden * s.inter * width)
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
        note_failed_captures(&gpu, failed_before);
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
            probe_gflops: None,
            bf16_matmul: None,
        });
    }
    if let Some(path) = &args.record_load {
        super::write_load(path, &moeflow::LoadRecord::from_ranks(&config, vec![gpu.0.load_stats()?]))?;
    }
    let layer_ms: Vec<f64> = records.iter().map(|r| r.ms).collect();
    print_recording_cost(&args.tokens, &layer_ms, recording_ms(args, &gpu, None)?.as_deref());
    let against_bf16 = if args.against_bf16 { Some(compare_with_bf16(args, &par, &spec, &gpu)?) } else { None };
    sustained_floors(&mut records, &floor_inputs, copy_gbps, || sustained_gemm_rate(0, rows8))?;
    if let Some(rows) = &against_bf16 {
        against_bf16::print_steady_floors(rows, &records);
    }
    if let Some(path) = &args.json {
        write_records(path, &records)?;
        if let Some(rows) = &against_bf16 {
            let field =
                |f: fn(&against_bf16::Comparison) -> f64| rows.iter().map(|(t, c)| (*t, f(c))).collect::<Vec<_>>();
            add_field(path, "steady_ms", &field(|c| c.fp8_ms))?;
            add_field(path, "bf16_steady_ms", &field(|c| c.bf16_ms))?;
            add_field(path, "ratio_to_bf16", &field(|c| c.ratio))?;
        }
    }
    if args.torch_baseline {
        let ours: Vec<(usize, f64)> = records.iter().map(|r| (r.tokens, r.ms)).collect();
        torch_single_baseline(args, &config, true, &ours)?;
    }
    Ok(())
}

/// `--against-bf16`: builds the bf16 layer beside `fp8` (built by `par` from `fp8_spec`, whose
/// shapes, seed and options it keeps, so the same routing), times the two in alternating rounds
/// at each token count and prints the table.
fn compare_with_bf16(
    args: &BenchArgs,
    par: &ParallelConfig,
    fp8_spec: &RankLayerSpec<'_>,
    fp8: &Timed,
) -> Result<Vec<(usize, against_bf16::Comparison)>> {
    let bar = spinner("generating the bf16 layer's weights on the GPU".into());
    let spec = RankLayerSpec { fp8_experts: false, fp8_rows: false, fp8_shared_expert: false, ..fp8_spec.clone() };
    let bf16 = Timed(par.rank_layer(None, moeflow::ExpertsKind::Cuda { device: 0 }, &spec)?);
    bar.finish_and_clear();
    let rounds = args.min_runs.max(against_bf16::FEWEST_ROUNDS);
    let rows = args
        .tokens
        .iter()
        .map(|&t| {
            let timed = against_bf16::time_rounds(fp8, &bf16, t, rounds, args.layer.seed)?;
            Ok((t, against_bf16::Comparison::of(&timed)))
        })
        .collect::<Result<Vec<_>>>()?;
    against_bf16::print(&rows, rounds);
    Ok(rows)
}

/// The expert FLOPs of an expert-parallel rank's tokens for `t` tokens a DP group: all of them,
/// or a TP-sliced rank's share (the largest, the slowest rank's, `t.div_ceil(tp)`).
fn ep_rank_flops(config: &moeflow::MoeConfig, par: &ParallelConfig, t: usize) -> f64 {
    config.expert_flops(t.div_ceil(par.tp.max(1)))
}

/// The experts an expert-parallel rank reads the weights of for `t` tokens a DP group: those
/// rank 0's runs served (`used`), else (none counted, or none served) the expectation under
/// uniform routing, `local · (1 − (1 − k/E)^T)` over the `T` tokens of every group (each token
/// picks `k` of the `E` experts).
fn ep_experts_read(config: &moeflow::MoeConfig, par: &ParallelConfig, t: usize, used: f64) -> f64 {
    if used > 0.0 {
        return used;
    }
    let (e, k) = (config.num_experts as f64, config.top_k as f64);
    let tokens = (t * par.ep / par.tp.max(1)) as f64;
    (config.num_experts / par.ep) as f64 * (1.0 - (1.0 - k / e).powf(tokens))
}

/// The GEMM rate the floor takes on `device`, with the words that name it: cuBLASLt's dense fp8
/// GEMM where the layer multiplies fp8 rows by fp8 weights (`w8a8`) and the GPU has fp8 tensor
/// cores, else `bf16_tflops` (cuBLAS's bf16 GEMM, measured with the ceilings).
fn floor_gemm_rate(device: usize, w8a8: bool, bf16_tflops: f64) -> Result<(f64, &'static str)> {
    if w8a8 {
        if let Some(tflops) = moeflow::backend::cuda::measure_fp8_gemm(device, false)? {
            return Ok((tflops, "cuBLASLt fp8 e4m3 8192³, one scale a tensor"));
        }
    }
    Ok((bf16_tflops, "cuBLAS bf16 8192³"))
}

/// The rate of [`floor_gemm_rate`]'s GEMM under sustained load.
fn sustained_gemm_rate(device: usize, w8a8: bool) -> Result<f64> {
    if w8a8 {
        if let Some(tflops) = moeflow::backend::cuda::measure_fp8_gemm(device, true)? {
            return Ok(tflops);
        }
    }
    moeflow::backend::cuda::measure_sustained_gemm(device)
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

/// The one-GPU table's header.
fn print_one_gpu_header() {
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
}

/// A one-GPU batch's timed runs and the runs its stages are read from.
type OneGpuRuns = (Vec<moeflow::backend::GpuStageTimes>, Vec<moeflow::backend::GpuStageTimes>);

/// `runs` timed runs of `t` tokens after three warm-ups, and their stage times: a batch that
/// replays its CUDA graph is timed as a whole, so its stages come from runs with events between
/// them.
pub(super) fn time_one_gpu(gpu: &Timed, t: usize, runs: usize, seed: u64) -> Result<OneGpuRuns> {
    for _ in 0..3 {
        gpu.forward_timed(t, seed)?;
    }
    let samples: Vec<_> = (0..runs).map(|r| gpu.forward_timed(t, seed + r as u64)).collect::<Result<_>>()?;
    let staged: Vec<_> = if gpu.replays_graph(t) {
        (0..runs).map(|r| gpu.forward_timed_stages(t, seed + r as u64)).collect::<Result<_>>()?
    } else {
        samples.clone()
    };
    Ok((samples, staged))
}

/// A note under the row when graph captures failed since `before` (those runs went launch by
/// launch).
fn note_failed_captures(gpu: &Timed, before: usize) {
    let (failed, why) = gpu.failed_graph_captures();
    if failed > before {
        println!(
            "{:>7} note: {} CUDA graph capture(s) failed; those runs went launch by launch (the latest: {})",
            "",
            failed - before,
            why.as_deref().unwrap_or("no reason kept")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::{ep_experts_read, ep_rank_flops};
    use moeflow::parallel::{ParallelConfig, StrategyKind};

    /// The bytes floor of an expert-parallel row reads the experts a rank serves: the count
    /// measured when there is one, else the uniform routing's expectation, which is exactly k
    /// for one token on one rank and every local expert once the batch is large.
    #[test]
    fn a_rank_reads_the_experts_it_serves() {
        let config = moeflow::preset::preset("deepseek-v3").unwrap().config;
        let (e, k) = (config.num_experts as f64, config.top_k as f64);
        let one = ParallelConfig::new(1, 1, StrategyKind::All2AllV);
        assert!((ep_experts_read(&config, &one, 1, 0.0) - k).abs() < 1e-9);
        let ep2 = ParallelConfig::new(2, 1, StrategyKind::All2AllV);
        // Two tokens over 256 experts, 128 here: 128 · (1 − (1 − 8/256)²).
        let two = ep_experts_read(&config, &ep2, 1, 0.0);
        assert!((two - e / 2.0 * (1.0 - (1.0 - k / e).powi(2))).abs() < 1e-9);
        assert!(two < k, "a rank serves fewer than every slot's expert: {two}");
        assert!((ep_experts_read(&config, &ep2, 4096, 0.0) - e / 2.0).abs() < 1e-6);
        assert_eq!(ep_experts_read(&config, &ep2, 0, 0.0), 0.0);
        // TP 2 of EP 2: one DP group, so the tokens of one rank's batch.
        let tp2 = ParallelConfig::new(2, 2, StrategyKind::All2AllV);
        assert!((ep_experts_read(&config, &tp2, 1, 0.0) - e / 2.0 * (k / e)).abs() < 1e-9);
        assert_eq!(ep_experts_read(&config, &ep2, 1, 11.0), 11.0);
    }

    /// A rank's FLOPs are its own tokens': the whole batch of its DP group, or with TP its
    /// largest share of it.
    #[test]
    fn a_tp_sliced_rank_counts_its_share() {
        let config = moeflow::preset::preset("deepseek-v3").unwrap().config;
        let ep2 = ParallelConfig::new(2, 1, StrategyKind::All2AllV);
        let tp2 = ParallelConfig::new(2, 2, StrategyKind::All2AllV);
        assert_eq!(ep_rank_flops(&config, &ep2, 4096), config.expert_flops(4096));
        assert_eq!(ep_rank_flops(&config, &tp2, 8192), config.expert_flops(4096));
        assert_eq!(ep_rank_flops(&config, &tp2, 7), config.expert_flops(4));
        assert_eq!(ep_rank_flops(&config, &tp2, 0), 0.0);
    }
}
