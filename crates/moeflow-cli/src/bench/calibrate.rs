//! `bench --calibrate FILE`: the ceilings `moeflow simulate` predicts from, measured on this
//! machine's CPU with the bench's layer: the expert GEMM rate by rows per expert and the
//! weight-streaming rate from the layer's own expert stage (the `--tokens` batches, one token),
//! the router's rate, the fixed cost of a stage from a tiny layer, and two in-process ranks at
//! each batch: their expert GEMM rate computing at once, and the exchange's latency and rate
//! (their dispatch and combine stages beyond one rank's); and the matmul probe's rate around
//! them (the pace the bench's records are compared at).

use super::BenchArgs;
use crate::common::median;
use moeflow::comm::{run_ranks, CommExt, Communicator};
use moeflow::parallel::{ParallelConfig, StrategyKind};
use moeflow::simulate::Ceilings;
use moeflow::{preset, DType, LayerOptions, MoeError, MoeLayer, Result, StageTimes, Tensor};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// Median stage times of at least `runs` forwards of `t` tokens, over at least `seconds` (after
/// a warm-up).
fn stages(layer: &MoeLayer, t: usize, h: usize, runs: usize, seconds: f64) -> Result<(f64, StageTimes)> {
    let x = Tensor::from_f32(&[t, h], preset::uniform(t * h, 1.0, 17 ^ t as u64))?;
    layer.forward(&x)?;
    let mut all = Vec::new();
    let started = Instant::now();
    // As `bench` measures: at least `runs` runs and `seconds` of them (a short burst streams
    // weights faster than the sustained runs the bench times).
    while all.len() < runs || (started.elapsed().as_secs_f64() < seconds && all.len() < 1000) {
        let start = Instant::now();
        let (_, st) = layer.forward_profiled(&x)?;
        all.push((start.elapsed().as_secs_f64(), st));
    }
    let med = |f: fn(&(f64, StageTimes)) -> f64| median(&all.iter().map(f).collect::<Vec<_>>());
    Ok((
        med(|a| a.0),
        StageTimes {
            route: med(|a| a.1.route),
            prepare: med(|a| a.1.prepare),
            experts: med(|a| a.1.experts),
            finalize: med(|a| a.1.finalize),
            shared: med(|a| a.1.shared),
        },
    ))
}

/// Median seconds of an all-to-all of `bytes` per peer between two in-process ranks.
fn exchange(bytes: usize, runs: usize) -> Result<f64> {
    let times = run_ranks(2, None, |comm| {
        let mut t = Vec::new();
        for _ in 0..runs {
            let parts = vec![vec![1u8; bytes]; 2];
            comm.barrier()?;
            let start = Instant::now();
            comm.all_to_all_v("calibrate", parts)?;
            let all = comm.all_gather_vec("calibrate.time", &[start.elapsed().as_secs_f64()])?;
            t.push(all.iter().map(|v| v[0]).fold(0.0, f64::max));
        }
        Ok(median(&t))
    });
    times.into_iter().next().ok_or_else(|| MoeError::Config("no ranks".into()))?
}

/// A forward of `t` tokens per rank on two in-process all-to-all-v ranks, timed as `bench`
/// times them (at least `runs` runs and `seconds` of them, after a warm-up): the median of the
/// slowest rank's time, and rank 0's median stage times.
fn two_ranks(
    args: &BenchArgs,
    config: &moeflow::MoeConfig,
    weights: &moeflow::MoeWeights,
    t: usize,
    (runs, seconds): (usize, f64),
) -> Result<(f64, StageTimes)> {
    let par =
        ParallelConfig { bf16_matmul: args.parallel.bf16_matmul, ..ParallelConfig::new(2, 1, StrategyKind::All2AllV) };
    let placement = Arc::new(par.placement(config.num_experts)?);
    let h = config.hidden;
    let times = run_ranks(2, None, |comm| {
        let layer = par.layer(comm, placement.clone(), config, weights, moeflow::ExpertsKind::Cpu, None)?;
        let x = Tensor::from_f32(&[t, h], preset::uniform(t * h, 1.0, 23 + comm.rank() as u64))?;
        comm.barrier()?;
        let start = Instant::now();
        layer.forward(&x)?;
        let warm_up = comm.all_gather_vec("calibrate.time", &[start.elapsed().as_secs_f64()])?;
        // Every rank runs as many times: enough for `seconds` at the warm-up's pace.
        let slowest = warm_up.iter().map(|v| v[0]).fold(1e-9, f64::max);
        let count = runs.max(((seconds / slowest).ceil() as usize).min(1000));
        let mut all: Vec<[f64; 4]> = Vec::new();
        for _ in 0..count {
            comm.barrier()?;
            let start = Instant::now();
            let (_, st) = layer.forward_profiled(&x)?;
            let took = comm.all_gather_vec("calibrate.time", &[start.elapsed().as_secs_f64()])?;
            all.push([took.iter().map(|v| v[0]).fold(0.0, f64::max), st.prepare, st.experts, st.finalize]);
        }
        let med = |i: usize| median(&all.iter().map(|a| a[i]).collect::<Vec<_>>());
        let st = StageTimes { prepare: med(1), experts: med(2), finalize: med(3), ..Default::default() };
        Ok((med(0), st))
    });
    times.into_iter().next().ok_or_else(|| MoeError::Config("no ranks".into()))?
}

/// Measures the ceilings with the bench's layer at its `--tokens` (one rank: the expert GEMM
/// rate at each batch's rows per expert, the weight-streaming rate at one token, the router's
/// rate at the largest; two in-process ranks at each batch: their GEMM rate at once and the
/// exchange's rate) and writes them to `path`.
pub fn calibrate(args: &BenchArgs, path: &Path) -> Result<()> {
    let (p, config) = args.layer.config()?;
    let weights = args.layer.weights(&config)?;
    let options = LayerOptions { bf16_matmul: args.parallel.bf16_matmul, ..Default::default() };
    let layer = MoeLayer::new(&config, &weights, options)?;
    let (h, i, e, k) = (config.hidden, config.inter, config.num_experts, config.top_k);
    let runs = args.min_runs.max(3);
    let mut sizes = args.tokens.clone();
    sizes.sort_unstable();
    sizes.dedup();
    sizes.retain(|&t| t > 1);
    let big = *sizes.last().ok_or_else(|| MoeError::Config("--calibrate needs a --tokens count above 1".into()))?;
    let probe_before = super::probe();
    let call = exchange(8, 200)?;
    // The one-token layer streams its experts' weights: timed first and last, and the slower
    // kept, since the rate this VM's memory gives a burst of runs drifts by a fifth from one
    // minute to the next.
    let (_, first_one) = stages(&layer, 1, h, runs, args.min_seconds)?;
    let mut gemm_curve = Vec::new();
    let mut shared_gemm_curve = Vec::new();
    let mut link_curve = Vec::new();
    let mut big_route = 0.0;
    for &t in &sizes {
        let (_, st) = stages(&layer, t, h, runs, args.min_seconds)?;
        // Uniform routing spreads t·k rows over the experts.
        let rows = (t * k) as f64 / e.min(t * k) as f64;
        gemm_curve.push((rows, config.expert_flops(t) / st.experts / 1e9));
        big_route = st.route;
        // Two ranks on these cores compute twice one rank's batch at once, each expert with
        // twice the rows; their dispatch and combine beyond one rank's are the exchange of f32
        // rows out (half of each token's k rows leave) and back.
        let (_, ep2) = two_ranks(args, &config, &weights, t, (runs, args.min_seconds))?;
        shared_gemm_curve.push((2.0 * rows, 2.0 * config.expert_flops(t) / ep2.experts / 1e9));
        let per_peer = (t * k * h * 4) as f64 / 2.0;
        let exchange_s = (ep2.prepare + ep2.finalize - st.prepare - st.finalize - 4.0 * call).max(1e-6);
        link_curve.push((per_peer, 2.0 * per_peer / exchange_s / 1e9));
    }
    let (_, last_one) = stages(&layer, 1, h, runs, args.min_seconds)?;
    let weight_bytes = args.layer.dtype.size_in_bytes() as f64;
    // One token reads its k experts' weights; its FLOPs are negligible beside them.
    let one_experts = first_one.experts.max(last_one.experts);
    let mem_gbps = (k.min(e) * 3 * h * i) as f64 * weight_bytes / one_experts / 1e9;
    let router_gflops = (2 * big * h * e) as f64 / big_route / 1e9;
    // A stage's fixed cost: a tiny layer's forward over its five stages.
    let mut tiny_config = config.with_num_experts(8.min(e).max(k))?;
    (tiny_config.hidden, tiny_config.inter, tiny_config.shared) = (64, 32, None);
    let tiny = MoeLayer::new(&tiny_config, &preset::random_weights(&tiny_config, DType::F32, 1), Default::default())?;
    let (tiny_total, _) = stages(&tiny, 1, 64, runs.max(50), args.min_seconds)?;
    let probe_gflops = (probe_before + super::probe()) / 2.0;
    let c = Ceilings {
        name: format!("this CPU ({} threads), {} {}", rayon::current_num_threads(), p.name, args.layer.dtype),
        gemm_gflops: gemm_curve.last().map_or(0.0, |g| g.1),
        gemm_curve,
        shared_gemm_curve,
        router_gflops,
        mem_gbps,
        launch_us: tiny_total / 5.0 * 1e6,
        intra_gbps: link_curve.last().map_or(0.0, |l| l.1),
        link_curve,
        intra_latency_us: 0.0,
        inter_gbps: 1.0,
        inter_latency_us: 0.0,
        call_us: call / 2.0 * 1e6,
        shared_device: true,
        rows_per_rank: false,
        shared_overlaps: false,
        host_plan_us: 0.0,
        host_plan_ns_per_slot: 0.0,
        replica_min_rows: 0.0,
        probe_gflops,
    };
    let points = |curve: &[(f64, f64)]| -> String {
        curve.iter().map(|(r, g)| format!("{g:.0} at {r:.0}")).collect::<Vec<_>>().join(", ")
    };
    let links: Vec<String> = c.link_curve.iter().map(|(b, g)| format!("{g:.2} at {:.1} MB", b / 1e6)).collect();
    println!(
        "calibration: expert GEMMs GFLOP/s by rows per expert: {} (two ranks at once: {}); weights streamed at \
         {:.1} GB/s (one token); router {:.1} GFLOP/s; stage {:.1} µs; exchange {:.1} µs a call, GB/s by bytes per \
         peer: {}; matmul probe {:.1} GFLOP/s",
        points(&c.gemm_curve),
        points(&c.shared_gemm_curve),
        c.mem_gbps,
        c.router_gflops,
        c.launch_us,
        c.call_us,
        links.join(", "),
        c.probe_gflops
    );
    write_ceilings(&c, path)
}

/// Writes `c` as the JSON `moeflow simulate --ceilings` reads to `path`, and says so.
pub(super) fn write_ceilings(c: &Ceilings, path: &Path) -> Result<()> {
    let text = serde_json::to_string_pretty(c).map_err(|e| MoeError::Json { context: "ceilings".into(), source: e })?;
    std::fs::write(path, text)
        .map_err(|e| MoeError::Io { context: format!("writing {}", path.display()), source: e })?;
    println!("wrote the ceilings to {}", path.display());
    Ok(())
}
