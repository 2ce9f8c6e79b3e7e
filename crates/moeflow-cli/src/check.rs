//! `moeflow check`: every strategy × EP × TP × chunking × dual-batch overlap against one rank
//! (bit for bit) and the f64 reference, on a small layer with the preset's routing and
//! activation, and uneven token counts (some ranks empty).

use crate::common::{bar, spinner};
use crate::table::{left, right, Table};
use moeflow::parallel::{forward_in_process, ParallelConfig, StrategyKind};
use moeflow::router::RouterConfig;
use moeflow::{
    preset, reference, DType, ExpertsKind, LayerOptions, MoeConfig, MoeError, MoeLayer, MoeWeights, Result, Tensor,
};

/// Arguments of `moeflow check`.
#[derive(clap::Args, Debug)]
pub struct CheckArgs {
    /// Routing and activation to use (shapes are scaled down).
    #[arg(long, default_value = "deepseek-v3")]
    preset: String,
    /// Hidden size of the scaled-down layer.
    #[arg(long, default_value_t = 40)]
    hidden: usize,
    /// Expert intermediate size.
    #[arg(long, default_value_t = 24)]
    inter: usize,
    /// Weight dtype: f32 or bf16.
    #[arg(long, default_value = "bf16")]
    dtype: DType,
    /// EP sizes, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4,8")]
    ep: Vec<usize>,
    /// Seed of weights and inputs.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Quantization of dispatch (and weights): none, int8, fp8, fp8-block, mxfp8.
    #[arg(long, default_value = "none")]
    quant: moeflow::quant::QuantConfig,
    /// How CPU experts multiply bf16 weights: auto, widen or dot (as for `demo`).
    #[arg(long, default_value = "auto")]
    bf16_matmul: moeflow::Bf16Matmul,
    #[command(flatten)]
    skew: crate::common::SkewArg,
}

/// Tokens of DP group g: uneven, with empty groups.
const BATCHES: [usize; 8] = [9, 0, 4, 13, 1, 0, 7, 5];

/// `moeflow check`: the single rank against the f64 reference, then every layout against the
/// single rank.
pub fn run(args: CheckArgs) -> Result<()> {
    crate::common::check_bf16_matmul(args.bf16_matmul, args.dtype, args.quant, false)?;
    let p = preset::preset(&args.preset)?;
    let config = small_config(&p.config, &args)?;
    if let Some(&ep) = args.ep.iter().find(|&&ep| ep == 0 || ep > BATCHES.len()) {
        return Err(MoeError::Config(format!("--ep {ep}: EP sizes must be in 1..={} here", BATCHES.len())));
    }
    let mut original = preset::try_random_weights(&config, args.dtype, args.seed)?;
    args.skew.apply(&config, &mut original)?;
    let mut weights = original.clone();
    crate::common::quantize_weights(&mut weights, args.quant)?;
    let tolerance = crate::common::cpu_bound(args.quant, args.dtype, args.bf16_matmul);
    let h = config.hidden;
    let inputs: Vec<Tensor> = BATCHES
        .iter()
        .enumerate()
        .map(|(g, &t)| Tensor::from_f32(&[t, h], preset::uniform(t * h, 1.0, args.seed + 1 + g as u64)))
        .collect::<Result<_>>()?;
    let (want, worst) = single_rank(&args, &config, &original, &weights, &inputs)?;
    println!(
        "moeflow check: {} routing ({}), {} activation, H {h}, I {}, {} experts, top-{}, {} weights; quant {}; one rank vs f64: {worst:.2e} (bound {tolerance:.1e})",
        p.name,
        config.router.describe(),
        config.activation.name(),
        config.inter,
        config.num_experts,
        config.top_k,
        args.dtype,
        args.quant
    );
    if worst > tolerance {
        return Err(MoeError::Config(format!("single rank differs from the reference by {worst:.2e}")));
    }
    let failures = check_layouts(&args, &config, &weights, &inputs, &want)?;
    if failures > 0 {
        return Err(MoeError::Config(format!("{failures} layouts differ from the single-rank result")));
    }
    println!("all layouts bit-for-bit identical to one rank");
    Ok(())
}

/// The preset's routing and activation at the requested small shapes: 16 experts (4 groups
/// for grouped routers) keep every router kind valid, and at EP 3 the ranks hold uneven
/// expert counts.
fn small_config(preset: &MoeConfig, args: &CheckArgs) -> Result<MoeConfig> {
    let mut config = preset.clone();
    // 16 experts (4 groups for grouped routers) keep every router kind valid; at EP 3 the
    // ranks hold uneven expert counts.
    config.num_experts = 16;
    config.router = match config.router {
        RouterConfig::SigmoidGrouped { renormalize, scaling, .. } => {
            RouterConfig::SigmoidGrouped { n_group: 4, topk_group: 2, renormalize, scaling }
        }
        other => other,
    };
    config.top_k = config.top_k.min(6);
    config.hidden = args.hidden;
    config.inter = args.inter;
    config.shared = config.shared.map(|s| moeflow::SharedConfig { inter: args.inter, ..s });
    config.validate()?;
    Ok(config)
}

/// One rank's output on each DP group's batch, and its largest error relative to the f64
/// reference on the `original` weights.
fn single_rank(
    args: &CheckArgs,
    config: &MoeConfig,
    original: &MoeWeights,
    weights: &MoeWeights,
    inputs: &[Tensor],
) -> Result<(Vec<Vec<f32>>, f64)> {
    let bar0 = spinner("single rank and f64 reference".into());
    let options = LayerOptions { quant: args.quant, bf16_matmul: args.bf16_matmul, ..LayerOptions::default() };
    let single = MoeLayer::new(config, weights, options)?;
    let mut want = Vec::new();
    let mut worst = 0f64;
    for x in inputs {
        let out = single.forward(x)?.to_f32_vec();
        let r = reference::forward(config, original, &x.to_f32_vec())?.out;
        let scale = r.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
        worst = out.iter().zip(&r).map(|(&a, &b)| (a as f64 - b).abs() / scale).fold(worst, f64::max);
        want.push(out);
    }
    bar0.finish_and_clear();
    Ok((want, worst))
}

/// The variants each layout runs: (name, chunk size, dual-batch).
const VARIANTS: [(&str, Option<usize>, bool); 3] =
    [("plain", None, false), ("chunk 3", Some(3), false), ("dual-batch", None, true)];

/// Runs every strategy × EP × TP layout in every variant, prints a row per layout, and returns
/// how many cells differ from `want` (one rank's output per DP group) or failed.
fn check_layouts(
    args: &CheckArgs,
    config: &MoeConfig,
    weights: &MoeWeights,
    inputs: &[Tensor],
    want: &[Vec<f32>],
) -> Result<usize> {
    let mut layouts = Vec::new();
    for &s in &StrategyKind::ALL[1..] {
        for &ep in &args.ep {
            for tp in [1, 2] {
                if ep % tp == 0 {
                    layouts.push((s, ep, tp));
                }
            }
        }
    }
    let table = Table::new(&[
        left("strategy", 17),
        right("EP", 3),
        right("TP", 5),
        left("plain", 11),
        left("chunk 3", 11),
        left("dual-batch", 11),
    ]);
    println!("{}", table.header());
    let progress = bar(layouts.len() as u64, "layouts".into());
    let mut failures = 0;
    for (s, ep, tp) in layouts {
        let mut cells = vec![s.name().to_string(), ep.to_string(), tp.to_string()];
        for &(_, chunk, dual) in &VARIANTS {
            let mut par = ParallelConfig::new(ep, tp, s);
            par.dual_batch = dual;
            par.max_tokens_per_rank = 16;
            par.quant = args.quant;
            par.bf16_matmul = args.bf16_matmul;
            let rank_inputs: Vec<Tensor> = (0..ep).map(|r| inputs[r / tp].clone()).collect();
            let cell = match forward_in_process(config, weights, &par, ExpertsKind::Cpu, chunk, &rank_inputs) {
                Ok(outs) if outs.iter().enumerate().all(|(r, o)| same_bits(&o.to_f32_vec(), &want[r / tp])) => {
                    "bitwise ok".to_string()
                }
                Ok(_) => "DIFFERS".to_string(),
                Err(e) => format!("error: {e}"),
            };
            failures += usize::from(cell != "bitwise ok");
            cells.push(cell);
        }
        progress.suspend(|| println!("{}", table.row(&cells)));
        progress.inc(1);
    }
    progress.finish_and_clear();
    Ok(failures)
}

/// Whether `a` and `b` hold the same f32 bits.
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}
