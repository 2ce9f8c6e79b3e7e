//! `moeflow demo`: the embedded default. A preset layer with random weights on CPU, checked
//! against the f64 reference, with a short report. With `--ep N` the layer runs on N
//! in-process ranks and is also compared bit for bit with one rank; with `--backend cuda` on N
//! GPUs over NCCL (one thread each, or one process each under `moeflow launch`), where each
//! rank's tokens are checked against the reference.

use crate::common::{
    cpu_bound, median, quantize_weights, spinner, split_tokens, Backend, LayerArgs, ParallelArgs, BF16_TOLERANCE,
};
use moeflow::comm::CommExt;
use moeflow::parallel::{on_ranks, ParallelConfig, RankHost};
use moeflow::quant::QuantConfig;
use moeflow::router::TopK;
use moeflow::{preset, reference, LayerOptions, MoeConfig, MoeError, MoeLayer, MoeWeights, Result, Tensor};
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
    /// After the timed runs, move the running ranks' experts to this placement (a JSON file,
    /// e.g. from `moeflow eplb`) and check the output after the move: bit for bit the same on
    /// CPU ranks and in --deterministic GPU mode; against the f64 reference otherwise (GPU
    /// ranks sum partial outputs in an order that follows the placement).
    #[arg(long)]
    rebalance: Option<std::path::PathBuf>,
}

/// The output of the timed runs: the tokens `lo..hi` of the batch that this process computed
/// (all of them unless launched), their rows, and the median time of `runs` forwards.
struct Ran {
    out: Tensor,
    lo: usize,
    hi: usize,
    secs: f64,
    runs: usize,
}

/// `moeflow demo`: builds the layer, runs it (one rank, or the parallel layout), checks the
/// output against the f64 reference and prints the report.
pub fn run(args: DemoArgs) -> Result<()> {
    let (p, config) = args.layer.config()?;
    config.check_batch(args.tokens)?;
    let mut par = args.parallel.config(args.tokens.div_ceil((args.parallel.ep / args.parallel.tp.max(1)).max(1)))?;
    par.rebalanceable = args.rebalance.is_some();
    let gpu = args.backend == Backend::Cuda;
    if args.rebalance.is_some() && par.ep == 1 {
        return Err(MoeError::Config("--rebalance moves experts between ranks: it needs --ep > 1".into()));
    }
    args.parallel.check_bf16_matmul(args.layer.dtype, gpu)?;
    println!(
        "moeflow demo: {} ({}), {} experts, top-{}, H {}, I {}, {} weights, {}, EP {} TP {} {}{}",
        p.name,
        p.model,
        config.num_experts,
        config.top_k,
        config.hidden,
        config.inter,
        args.layer.dtype,
        if gpu { "cuda" } else { "cpu" },
        par.ep,
        par.tp,
        par.strategy,
        if par.dual_batch { " (dual-batch)" } else { "" }
    );
    let original = args.layer.weights(&config)?;
    // The layer runs on quantized weights, the reference on the originals (one copy unless
    // quantizing).
    let quantized = match par.quant {
        QuantConfig::None => None,
        quant => {
            let mut w = original.clone();
            quantize_weights(&mut w, quant)?;
            Some(w)
        }
    };
    let weights = quantized.as_ref().unwrap_or(&original);
    let bar = spinner("packing weights".into());
    let options = LayerOptions {
        chunk_size: args.layer.chunk_size,
        quant: par.quant,
        defer_input_quant: par.defer_input_quant,
        bf16_matmul: par.bf16_matmul,
        ..LayerOptions::default()
    };
    let single = MoeLayer::new(&config, weights, options)?;
    bar.finish_and_clear();

    let t = args.tokens;
    let x = preset::uniform(t * config.hidden, 1.0, args.layer.seed ^ 0x5eed);
    let input = Tensor::from_f32(&[t, config.hidden], x.clone())?;
    let topk = single.route(&input)?;
    let tolerance = if gpu { BF16_TOLERANCE } else { cpu_bound(par.quant, args.layer.dtype, par.bf16_matmul) };
    if par.quant != QuantConfig::None {
        println!("  quantization    {} (activations and weights; error measured against unquantized f64)", par.quant);
    } else if !gpu && args.layer.dtype == moeflow::DType::BF16 {
        println!("  bf16 matmul     {}", par.bf16_matmul.describe());
    }
    if gpu && par.quant != QuantConfig::None {
        return Err(MoeError::Unsupported("--quant on --backend cuda: GPU layers quantize GEMM rows only in `bench` (fp8-block with --dtype f8e4m3, W8A8)".into()));
    }
    let host = RankHost::detect(gpu, crate::common::launch_env()?);
    let spec = moeflow::RankLayerSpec {
        chunk_size: args.layer.chunk_size,
        cuda: crate::cuda_args::cuda_options(&args.parallel)?,
        ..moeflow::RankLayerSpec::new(&config, weights)
    };
    let ran = if gpu && par.ep == 1 && host == RankHost::Gpus {
        let layer = par.rank_layer(None, moeflow::ExpertsKind::Cuda { device: 0 }, &spec)?;
        if let Some(l) = layer.device_layer() {
            println!("  device          {}", l.device_name());
        }
        println!("  layer           {}", layer.describe());
        timed(args.runs, t, &|| layer.forward(&input))?
    } else if par.ep == 1 && !par.dual_batch && host == RankHost::Threads {
        timed(args.runs, t, &|| single.forward(&input))?
    } else {
        let ran = run_ranks(&args, &par, &host, &spec, &x)?;
        if !gpu {
            same_as_one_rank(&single, &input, &ran, config.hidden)?;
        }
        ran
    };
    let checked = Checked::against_reference(&config, &original, &x, &topk, &ran)?;
    checked.report(&config, &ran, t, tolerance)
}

/// One warm-up, then `runs` timed forwards of all `tokens`.
fn timed(runs: usize, tokens: usize, forward: &dyn Fn() -> Result<Tensor>) -> Result<Ran> {
    let mut out = forward()?;
    let mut times = Vec::new();
    for _ in 0..runs.max(1) {
        let start = Instant::now();
        out = forward()?;
        times.push(start.elapsed().as_secs_f64());
    }
    Ok(Ran { out, lo: 0, hi: tokens, secs: median(&times), runs: times.len() })
}

/// The parallel layout on in-process ranks, GPUs or launched processes: each DP group takes a
/// contiguous share of the batch `x` (TP ranks of a group share it); the layer time is the
/// slowest rank's. Returns the tokens this process holds (one copy of each group's).
fn run_ranks(
    args: &DemoArgs,
    par: &ParallelConfig,
    host: &RankHost,
    spec: &moeflow::RankLayerSpec<'_>,
    x: &[f32],
) -> Result<Ran> {
    let (t, h) = (args.tokens, spec.config.hidden);
    let groups = split_tokens(t, par.ep / par.tp);
    let what = match host {
        RankHost::Threads => format!("{} in-process ranks", par.ep),
        RankHost::Gpus => format!("{} GPUs (one thread each, NCCL)", par.ep),
        RankHost::Launched { env, gpu } => {
            format!("rank {} of {} processes ({})", env.rank, env.world_size, if *gpu { "NCCL" } else { "TCP" })
        }
    };
    let bar = spinner(format!("running on {what}"));
    // CPU ranks and deterministic GPU ranks give the same bits after a move.
    let exact = args.backend == Backend::Cpu || args.parallel.deterministic;
    let target = match &args.rebalance {
        Some(path) => Some(std::sync::Arc::new(moeflow::placement::ExpertPlacement::from_json_file(
            path,
            spec.config.num_experts,
            par.ep,
        )?)),
        None => None,
    };
    let results = on_ranks(host, par.ep, par.timeout, |comm, kind| {
        let mut layer = par.rank_layer(Some(comm), kind, spec)?;
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
            let all = comm.all_gather_vec("demo.time", &[start.elapsed().as_secs_f64()])?;
            times.push(all.iter().map(|v| v[0]).fold(0.0, f64::max));
        }
        if let Some(placement) = &target {
            layer.rebalance(placement.clone())?;
            let after = layer.forward(&mine)?;
            let same = after.to_f32_vec().iter().zip(out.to_f32_vec()).all(|(a, b)| a.to_bits() == b.to_bits());
            let all_same = comm.all_gather_vec("demo.rebalanced", &[u8::from(same)])?.iter().all(|v| v[0] == 1);
            if exact && !all_same {
                return Err(MoeError::Config("the output changed after rebalancing".into()));
            }
            if comm.rank() == 0 {
                let how = if all_same {
                    "output bit-for-bit identical before and after"
                } else {
                    "the output after the move is what is checked against the reference below"
                };
                bar.suspend(|| println!("  rebalanced      {}: {how}", placement.describe()));
            }
            out = after;
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
    let out = Tensor::from_f32(&[hi.saturating_sub(lo), h], rows)?;
    Ok(Ran { out, lo: lo.min(hi), hi, secs: median(&times), runs: times.len() })
}

/// Checks this process's tokens against one rank's result on the same tokens, bit for bit.
fn same_as_one_rank(single: &MoeLayer, input: &Tensor, ran: &Ran, h: usize) -> Result<()> {
    let one = single.forward(input)?.to_f32_vec();
    let rows = ran.out.to_f32_vec();
    let same = rows.len() == (ran.hi - ran.lo) * h
        && rows.iter().zip(&one[ran.lo * h..ran.hi * h]).all(|(a, b)| a.to_bits() == b.to_bits());
    println!("  vs one rank     {}", if same { "bit-for-bit identical" } else { "DIFFERENT" });
    if same {
        Ok(())
    } else {
        Err(MoeError::Config("the parallel layout changed the result".into()))
    }
}

/// The run's tokens against the f64 reference: routing and output error.
struct Checked {
    /// Tokens whose experts differ from the reference's at near-ties, and the largest score gap.
    differ: usize,
    max_gap: f64,
    max_err: f64,
    /// The largest |reference output|.
    scale: f64,
    /// Rows each expert received.
    hits: Vec<usize>,
}

impl Checked {
    /// Checks the tokens `ran.lo..ran.hi` of `x` (routed as `topk`) against the f64 reference
    /// on the `original` weights. Routing must equal the reference's except where two scores
    /// are within 1e-4; there the reference follows the layer's routing.
    fn against_reference(config: &MoeConfig, original: &MoeWeights, x: &[f32], topk: &TopK, ran: &Ran) -> Result<Self> {
        let (h, k, e) = (config.hidden, config.top_k, config.num_experts);
        let (lo, hi) = (ran.lo, ran.hi);
        let x = &x[lo * h..hi * h];
        let ids: Vec<usize> = topk.ids[lo * k..hi * k].iter().map(|&i| i as usize).collect();
        let bar = spinner("checking against the f64 reference".into());
        let routed = reference::forward(config, original, x)?;
        let (mut differ, mut max_gap) = (0usize, 0f64);
        for tok in 0..hi - lo {
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
            let w: Vec<f64> = topk.weights[lo * k..hi * k].iter().map(|&v| v as f64).collect();
            reference::forward_with_routing(config, original, x, &ids, &w)?
        };
        bar.finish_and_clear();
        let got = ran.out.to_f32_vec();
        let max_err = got.iter().zip(&want).map(|(&g, &w)| (g as f64 - w).abs()).fold(0.0, f64::max);
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        let mut hits = vec![0usize; e];
        ids.iter().for_each(|&i| hits[i] += 1);
        Ok(Checked { differ, max_gap, max_err, scale, hits })
    }

    /// Prints the report of a batch of `all` tokens; an error when the relative error exceeds
    /// `tolerance`.
    fn report(&self, config: &MoeConfig, ran: &Ran, all: usize, tolerance: f64) -> Result<()> {
        let (lo, hi) = (ran.lo, ran.hi);
        let t = hi - lo;
        let rel = if self.scale > 0.0 { self.max_err / self.scale } else { self.max_err };
        let hit = self.hits.iter().filter(|&&c| c > 0).count();
        let busiest = self.hits.iter().max().copied().unwrap_or(0);
        if t == all {
            println!("  tokens          {t}");
        } else {
            println!("  tokens          {t} of {all} (this rank's share: {lo}..{hi})");
        }
        println!("  experts hit     {hit} of {} (busiest: {busiest} rows)", config.num_experts);
        if self.differ == 0 {
            println!("  routing         identical to the f64 reference");
        } else {
            println!(
                "  routing         {} tokens differ from f64 at near-ties (score gap {:.1e})",
                self.differ, self.max_gap
            );
        }
        println!("  max abs error   {:.3e} (max |out| {:.3e})", self.max_err, self.scale);
        println!("  relative error  {rel:.3e} (bound {tolerance:.1e})");
        println!("  time            {:.2} ms (median of {})", ran.secs * 1e3, ran.runs);
        println!("  throughput      {:.1} GFLOP/s", config.expert_flops(t) / ran.secs / 1e9);
        if rel > tolerance {
            return Err(MoeError::Config(format!("relative error {rel:.3e} exceeds {tolerance:.1e}")));
        }
        println!("  check           OK");
        Ok(())
    }
}
