//! `moeflow demo`: the embedded default. A preset layer with random weights on CPU, checked
//! against the f64 reference, with a short report. With `--ep N` the layer runs on N
//! in-process ranks and is also compared bit for bit with one rank; with `--backend cuda` on N
//! GPUs over NCCL (one thread each, or one process each under `moeflow launch`), where each
//! rank's tokens are checked against the reference.

use crate::common::{
    cpu_bound, median, quantize_weights, spinner, split_tokens, Backend, LayerArgs, ParallelArgs, BF16_TOLERANCE,
};
use moeflow::comm::CommExt;
use moeflow::parallel::{on_ranks, RankHost};
use moeflow::{preset, reference, LayerOptions, MoeError, MoeLayer, Result, Tensor};
use std::time::Instant;

/// Arguments of `moeflow demo`.
#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    #[command(flatten)]
    layer: LayerArgs,
    #[command(flatten)]
    parallel: ParallelArgs,
    /// Tokens in the batch (split over the DP groups).
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// Timed runs (the median is reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// cpu, or cuda (one GPU; expert weights in bf16).
    #[arg(long, value_enum, default_value = "cpu")]
    backend: Backend,
}

pub fn run(args: DemoArgs) -> Result<()> {
    let (p, config) = args.layer.config()?;
    config.check_batch(args.tokens)?;
    let par = args.parallel.config(args.tokens.div_ceil((args.parallel.ep / args.parallel.tp.max(1)).max(1)))?;
    args.parallel.check_bf16_matmul(args.layer.dtype, args.backend == Backend::Cuda)?;
    println!(
        "moeflow demo: {} ({}), {} experts, top-{}, H {}, I {}, {} weights, {}, EP {} TP {} {}{}",
        p.name,
        p.model,
        config.num_experts,
        config.top_k,
        config.hidden,
        config.inter,
        args.layer.dtype,
        if args.backend == Backend::Cuda { "cuda" } else { "cpu" },
        par.ep,
        par.tp,
        par.strategy,
        if par.dual_batch { " (dual-batch)" } else { "" }
    );
    let original = args.layer.weights(&config)?;
    // The layer runs on quantized weights, the reference on the originals (one copy unless
    // quantizing).
    let quantized = match par.quant {
        moeflow::quant::QuantConfig::None => None,
        quant => {
            let mut w = original.clone();
            quantize_weights(&mut w, quant)?;
            Some(w)
        }
    };
    let weights = quantized.as_ref().unwrap_or(&original);
    let bar = spinner("packing weights".into());
    let single = MoeLayer::new(
        &config,
        weights,
        LayerOptions {
            chunk_size: args.layer.chunk_size,
            quant: par.quant,
            defer_input_quant: par.defer_input_quant,
            bf16_matmul: par.bf16_matmul,
            ..LayerOptions::default()
        },
    )?;
    bar.finish_and_clear();

    let t = args.tokens;
    let x = preset::uniform(t * config.hidden, 1.0, args.layer.seed ^ 0x5eed);
    let input = Tensor::from_f32(&[t, config.hidden], x.clone())?;
    let topk = single.route(&input)?;
    let tolerance = match args.backend {
        Backend::Cuda => BF16_TOLERANCE,
        Backend::Cpu => cpu_bound(par.quant, args.layer.dtype, par.bf16_matmul),
    };
    if par.quant != moeflow::quant::QuantConfig::None {
        println!("  quantization    {} (activations and weights; error measured against unquantized f64)", par.quant);
    } else if args.backend == Backend::Cpu && args.layer.dtype == moeflow::DType::BF16 {
        println!("  bf16 matmul     {}", par.bf16_matmul.describe());
    }
    let gpu = args.backend == Backend::Cuda;
    if gpu && par.quant != moeflow::quant::QuantConfig::None {
        return Err(MoeError::Unsupported("--quant on --backend cuda: GPU layers quantize GEMM rows only in `bench` (fp8-block with --dtype f8e4m3, W8A8)".into()));
    }
    let host = RankHost::detect(gpu, crate::common::launch_env()?);
    let h = config.hidden;
    // Tokens [lo, hi) of the batch that this process computed (all of them unless launched).
    // One warm-up, then `--runs` timed forwards: (last output, median seconds, runs).
    let timed = |forward: &dyn Fn() -> Result<Tensor>| -> Result<(Tensor, f64, usize)> {
        let mut out = forward()?;
        let mut times = Vec::new();
        for _ in 0..args.runs.max(1) {
            let start = Instant::now();
            out = forward()?;
            times.push(start.elapsed().as_secs_f64());
        }
        Ok((out, median(&times), times.len()))
    };
    let spec = moeflow::RankLayerSpec {
        chunk_size: args.layer.chunk_size,
        cuda: crate::cuda_args::cuda_options(args.parallel.deterministic)?,
        ..moeflow::RankLayerSpec::new(&config, weights)
    };
    let (out, (lo, hi), secs, runs) = if gpu && par.ep == 1 && host == RankHost::Gpus {
        let layer = par.rank_layer(None, moeflow::ExpertsKind::Cuda { device: 0 }, &spec)?;
        if let Some(l) = layer.device_layer() {
            println!("  device          {}", l.device_name());
        }
        println!("  layer           {}", layer.describe());
        let (out, secs, runs) = timed(&|| layer.forward(&input))?;
        (out, (0, t), secs, runs)
    } else if par.ep == 1 && !par.dual_batch && host == RankHost::Threads {
        let (out, secs, runs) = timed(&|| single.forward(&input))?;
        (out, (0, t), secs, runs)
    } else {
        // Each DP group takes a contiguous share of the tokens; TP ranks of a group share it.
        let groups = split_tokens(t, par.ep / par.tp);
        let what = match &host {
            RankHost::Threads => format!("{} in-process ranks", par.ep),
            RankHost::Gpus => format!("{} GPUs (one thread each, NCCL)", par.ep),
            RankHost::Launched { env, gpu } => {
                format!("rank {} of {} processes ({})", env.rank, env.world_size, if *gpu { "NCCL" } else { "TCP" })
            }
        };
        let bar = spinner(format!("running on {what}"));
        let results = on_ranks(&host, par.ep, par.timeout, |comm, kind| {
            let layer = par.rank_layer(Some(comm), kind, &spec)?;
            if comm.rank() == 0 {
                bar.suspend(|| println!("  layer           {}", layer.describe()));
            }
            let (a, b) = groups[comm.rank() / par.tp];
            let mine = Tensor::from_f32(&[b - a, h], x[a * h..b * h].to_vec())?;
            let mut out = layer.forward(&mine)?;
            let mut times = Vec::new();
            for _ in 0..args.runs.max(1) {
                comm.barrier()?;
                let start = Instant::now();
                out = layer.forward(&mine)?;
                // The layer time is the slowest rank's.
                let all = comm.all_gather_vec("demo.time", &[start.elapsed().as_secs_f64()])?;
                times.push(all.iter().map(|v| v[0]).fold(0.0, f64::max));
            }
            Ok((out, times))
        });
        bar.finish_and_clear();
        let mut rows = Vec::with_capacity(t * h);
        let (mut times, mut lo, mut hi) = (Vec::new(), t, 0);
        for (r, res) in results {
            let (o, ts) = res?;
            // One copy of each DP group's tokens (a launched process holds just its own).
            if r % par.tp == 0 || host.launched_rank().is_some() {
                let (a, b) = groups[r / par.tp];
                (lo, hi) = (lo.min(a), hi.max(b));
                rows.extend(o.to_f32_vec());
            }
            if times.is_empty() {
                times = ts;
            }
        }
        println!("  ranks           {what}");
        if !gpu {
            // This process's tokens against one rank's result on the same tokens.
            let one = single.forward(&input)?.to_f32_vec();
            let same = rows.len() == (hi - lo) * h
                && rows.iter().zip(&one[lo * h..hi * h]).all(|(a, b)| a.to_bits() == b.to_bits());
            println!("  vs one rank     {}", if same { "bit-for-bit identical" } else { "DIFFERENT" });
            if !same {
                return Err(MoeError::Config("the parallel layout changed the result".into()));
            }
        }
        (Tensor::from_f32(&[hi.saturating_sub(lo), h], rows)?, (lo.min(hi), hi), median(&times), times.len())
    };
    // Checked below: tokens lo..hi.
    let x = &x[lo * h..hi * h];
    let (k, e) = (config.top_k, config.num_experts);
    let topk_ids = &topk.ids[lo * k..hi * k];
    let topk_weights = &topk.weights[lo * k..hi * k];
    let t_all = t;
    let t = hi - lo;

    let bar = spinner("checking against the f64 reference".into());
    let routed = reference::forward(&config, &original, x)?;
    let ids: Vec<usize> = topk_ids.iter().map(|&i| i as usize).collect();
    // Routing must equal the f64 reference's, except where two scores are within 1e-4.
    let (mut differ, mut max_gap) = (0usize, 0f64);
    for tok in 0..t {
        let (a, b) = (&ids[tok * k..(tok + 1) * k], &routed.ids[tok * k..(tok + 1) * k]);
        if a != b {
            differ += 1;
            let s = &routed.choice_scores[tok * e..(tok + 1) * e];
            max_gap = a.iter().zip(b).map(|(&i, &j)| (s[i] - s[j]).abs()).fold(max_gap, f64::max);
        }
    }
    if max_gap > 1e-4 {
        return Err(MoeError::Config(format!(
            "routing differs from the reference on {differ} tokens (score gap {max_gap:.2e})"
        )));
    }
    let want = if differ == 0 {
        routed.out
    } else {
        let w: Vec<f64> = topk_weights.iter().map(|&v| v as f64).collect();
        reference::forward_with_routing(&config, &original, x, &ids, &w)?
    };
    bar.finish_and_clear();

    let got = out.to_f32_vec();
    let max_err = got.iter().zip(&want).map(|(&g, &w)| (g as f64 - w).abs()).fold(0.0, f64::max);
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    let rel = if scale > 0.0 { max_err / scale } else { max_err };
    let mut hits = vec![0usize; config.num_experts];
    topk_ids.iter().for_each(|&e| hits[e as usize] += 1);
    let hit = hits.iter().filter(|&&c| c > 0).count();
    let busiest = hits.iter().max().copied().unwrap_or(0);

    if t == t_all {
        println!("  tokens          {t}");
    } else {
        println!("  tokens          {t} of {t_all} (this rank's share: {lo}..{hi})");
    }
    println!("  experts hit     {hit} of {} (busiest: {busiest} rows)", config.num_experts);
    if differ == 0 {
        println!("  routing         identical to the f64 reference");
    } else {
        println!("  routing         {differ} tokens differ from f64 at near-ties (score gap {max_gap:.1e})");
    }
    println!("  max abs error   {max_err:.3e} (max |out| {scale:.3e})");
    println!("  relative error  {rel:.3e} (bound {tolerance:.1e})");
    println!("  time            {:.2} ms (median of {runs})", secs * 1e3);
    println!("  throughput      {:.1} GFLOP/s", config.expert_flops(t) / secs / 1e9);
    if rel > tolerance {
        return Err(MoeError::Config(format!("relative error {rel:.3e} exceeds {tolerance:.1e}")));
    }
    println!("  check           OK");
    Ok(())
}
