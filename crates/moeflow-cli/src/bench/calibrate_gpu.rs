//! `bench --backend cuda --calibrate FILE` on one GPU: the ceilings `moeflow simulate` predicts
//! the GPU layer from, measured on this machine: the dense GEMM rate under sustained load, the
//! HBM copy rate, the one-GPU layer's expert GEMM rate by rows per expert and its router's rate,
//! the fixed cost per launch from the layer at one token; where two GPUs are visible, the NVLink
//! transport's push rate and, from the EP-2 layer, the exchange's per-call cost and the host
//! round trip of its host-planned dispatch.

use super::cuda::{device_weights, time_one_gpu, time_rank, Timed};
use super::BenchArgs;
use crate::common::{median, spinner};
use moeflow::backend::cuda::{
    device_count, measure_ceilings, measure_peer_push, measure_sustained_gemm, GpuStageTimes,
};
use moeflow::parallel::{on_ranks, ParallelConfig, RankHost, StrategyKind};
use moeflow::simulate::{placement, predict, Ceilings, Layout, Routing, Shapes};
use moeflow::{ExpertsKind, MoeConfig, MoeError, RankLayerSpec, Result};
use std::path::Path;

/// Rows per expert the expert GEMM rate is measured at (batches of `rows · E / k` tokens).
const CURVE_ROWS: [usize; 6] = [1, 4, 16, 64, 256, 1024];

/// Tokens per rank of the EP-2 batch the host round trip's cost per (token, slot) is fitted on.
const EP2_BATCH: usize = 4096;

/// The model's layer ms for `shapes` at `ep` ranks and `tokens` per rank, uniform routing.
fn predicted(c: &Ceilings, shapes: &Shapes, ep: usize, tokens: usize) -> Result<f64> {
    let placement = placement(shapes, &Routing::Uniform, ep, ep, None)?;
    Ok(predict(c, shapes, &Routing::Uniform, &Layout { ep, domain: ep, tokens, placement })?.total)
}

/// The value of the (linear) cost `set` writes that makes the model's layer at `ep` ranks and
/// `tokens` per rank take `measured` ms (never below zero).
fn fit(
    c: &Ceilings,
    shapes: &Shapes,
    (ep, tokens): (usize, usize),
    measured: f64,
    set: fn(&mut Ceilings, f64),
) -> Result<f64> {
    let at = |v: f64| {
        let mut c = c.clone();
        set(&mut c, v);
        predicted(&c, shapes, ep, tokens)
    };
    let (zero, one) = (at(0.0)?, at(1.0)?);
    Ok(if one > zero { ((measured - zero) / (one - zero)).max(0.0) } else { 0.0 })
}

/// Per batch of `tokens`: the slowest rank's median layer ms and rank 0's median stage times,
/// on the EP-2 device-resident all-to-all-v layer over GPUs 0 and 1.
fn ep2_runs(args: &BenchArgs, config: &MoeConfig, tokens: &[usize]) -> Result<Vec<(f64, GpuStageTimes)>> {
    let timeout = args.parallel.config(1)?.timeout;
    let par = ParallelConfig { timeout, ..ParallelConfig::new(2, 1, StrategyKind::All2AllV) };
    let spec = RankLayerSpec { cuda: crate::cuda_args::cuda_options(&args.parallel)?, ..device_weights(args, config) };
    let results = on_ranks(&RankHost::Gpus, 2, timeout, |comm, experts| {
        let layer = Timed(par.rank_layer(Some(comm), experts, &spec)?);
        let per_t = time_rank(args, &layer, comm, tokens, false)?;
        Ok(per_t
            .into_iter()
            .map(|(slowest, samples)| {
                let med = |f: fn(&GpuStageTimes) -> f64| median(&samples.iter().map(f).collect::<Vec<_>>());
                let stages = GpuStageTimes { permute: med(|s| s.permute), dispatch: med(|s| s.dispatch), ..samples[0] };
                (median(&slowest), stages)
            })
            .collect::<Vec<_>>())
    });
    let mut first = None;
    for (_, r) in results {
        let r = r?;
        first.get_or_insert(r);
    }
    first.ok_or_else(|| MoeError::Config("no ranks".into()))
}

/// Measures the ceilings (see the module) and writes them to `path`.
pub(super) fn calibrate(args: &BenchArgs, path: &Path) -> Result<()> {
    let (p, config) = args.layer.config()?;
    let (e, k, h) = (config.num_experts, config.top_k, config.hidden);
    let shapes = Shapes::of(&config, 2.0, 2.0);
    // The one-token layers first, on a GPU that has not yet run the long GEMM loads, as `bench`
    // meets them (its batches run smallest first): after a sustained load the clocks sit lower
    // and a latency-bound layer runs slower than the same layer in a fresh run.
    let bar = spinner("timing the one-GPU layer at one token".into());
    let spec = RankLayerSpec { cuda: crate::cuda_args::cuda_options(&args.parallel)?, ..device_weights(args, &config) };
    let gpu = Timed(args.parallel.config(1)?.rank_layer(None, ExpertsKind::Cuda { device: 0 }, &spec)?);
    let runs = args.min_runs.max(20);
    let (one, _) = time_one_gpu(&gpu, 1, runs, args.layer.seed)?;
    let one_ms = median(&one.iter().map(|s| s.total).collect::<Vec<_>>());
    let two_gpus = device_count() > 1;
    let ep2 = if two_gpus {
        bar.set_message("timing the EP-2 layer at one token and at 4096");
        Some(ep2_runs(args, &config, &[1, EP2_BATCH])?)
    } else {
        None
    };
    bar.set_message("measuring the GPU's GEMM rate and copy bandwidth");
    let cool = measure_ceilings(0)?;
    let sustained = measure_sustained_gemm(0)?;
    let push = if two_gpus {
        Some(measure_peer_push(0, 1, crate::cuda_args::cuda_options(&args.parallel)?.transport_sms)?)
    } else {
        None
    };
    bar.set_message("timing the one-GPU layer by rows per expert");
    let mut gemm_curve = Vec::new();
    let mut router_gflops = 0.0;
    for rows in CURVE_ROWS {
        let t = rows * e / k;
        if t < 2 || config.check_batch(t).is_err() {
            continue;
        }
        let (_, staged) = time_one_gpu(&gpu, t, runs, args.layer.seed)?;
        let med = |f: fn(&GpuStageTimes) -> f64| median(&staged.iter().map(f).collect::<Vec<_>>());
        gemm_curve.push((rows as f64, config.expert_flops(t) / med(|s| s.gemm1 + s.act + s.gemm2) / 1e6));
        router_gflops = (2 * t * h * e) as f64 / med(|s| s.route) / 1e6;
    }
    if gemm_curve.is_empty() {
        return Err(MoeError::Config(format!(
            "--calibrate: no batch of {CURVE_ROWS:?} rows per expert fits this layer"
        )));
    }
    let device = gpu.0.device_layer().map_or_else(|| "GPU 0".to_string(), |l| l.device_name());
    drop(gpu);
    let mut c = Ceilings {
        name: format!("{device}, {} bf16 (bench --backend cuda --calibrate)", p.name),
        gemm_gflops: sustained * 1e3,
        gemm_curve,
        router_gflops,
        mem_gbps: cool.copy_gbps,
        launch_us: 0.0,
        intra_gbps: push.unwrap_or(0.0),
        link_curve: Vec::new(),
        intra_latency_us: 0.0,
        inter_gbps: 45.0,
        inter_latency_us: 10.0,
        call_us: 0.0,
        shared_device: false,
        rows_per_rank: true,
        shared_overlaps: true,
        host_plan_us: 0.0,
        host_plan_ns_per_slot: 0.0,
        replica_min_rows: crate::cuda_args::cuda_options(&args.parallel)?.replica_min_rows as f64,
        probe_gflops: 0.0,
        shared_gemm_curve: Vec::new(),
    };
    // The fixed cost per launch: what the one-token layer takes beyond its weight reads.
    c.launch_us = fit(&c, &shapes, (1, 1), one_ms, |c, v| c.launch_us = v)?;
    if let Some(ep2) = ep2 {
        let ((one2, small), (_, big)) = (ep2[0], ep2[1]);
        // An exchange costs two calls: the dispatch at one token is the per-call cost.
        c.call_us = small.dispatch * 1e3 / 2.0;
        // The host round trip grows with the (token, slot) pairs planned beyond the rows copied.
        let model_permute = |c: &Ceilings, t: usize| -> Result<f64> {
            let placement = placement(&shapes, &Routing::Uniform, 2, 2, None)?;
            Ok(predict(c, &shapes, &Routing::Uniform, &Layout { ep: 2, domain: 2, tokens: t, placement })?.permute)
        };
        let grown = (big.permute - small.permute) - (model_permute(&c, EP2_BATCH)? - model_permute(&c, 1)?);
        c.host_plan_ns_per_slot = (grown * 1e6 / (EP2_BATCH * k) as f64).max(0.0);
        // Its fixed part: what the one-token EP-2 layer takes beyond the rest of the model.
        c.host_plan_us = fit(&c, &shapes, (2, 1), one2, |c, v| c.host_plan_us = v)?;
    } else {
        println!("note: one GPU visible: the exchange's call cost and the host round trip stay 0 (EP 2 and up)");
    }
    bar.finish_and_clear();
    let curve: Vec<String> = c.gemm_curve.iter().map(|(r, g)| format!("{:.0} at {r:.0}", g / 1e3)).collect();
    println!(
        "calibration: GEMM {:.0} TFLOP/s sustained; expert GEMMs TFLOP/s by rows per expert: {}; router {:.1} \
         TFLOP/s; HBM copy {:.0} GB/s; launch {:.1} µs; push {:.0} GB/s; exchange call {:.1} µs; host round trip \
         {:.0} µs + {:.1} ns a (token, slot)",
        sustained,
        curve.join(", "),
        c.router_gflops / 1e3,
        c.mem_gbps,
        c.launch_us,
        c.intra_gbps,
        c.call_us,
        c.host_plan_us,
        c.host_plan_ns_per_slot
    );
    super::calibrate::write_ceilings(&c, path)
}
