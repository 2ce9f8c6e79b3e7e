//! `moeflow check`: every strategy × EP × TP × chunking × dual-batch overlap against one rank
//! (bit for bit) and the f64 reference, on a small layer with the preset's routing and
//! activation, and uneven token counts (some ranks empty).

use crate::common::{bar, spinner};
use moeflow::parallel::{forward_in_process, ParallelConfig, StrategyKind};
use moeflow::router::RouterConfig;
use moeflow::{preset, reference, DType, ExpertsKind, LayerOptions, MoeError, MoeLayer, Result, Tensor};

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
}

/// Tokens of DP group g: uneven, with empty groups.
const BATCHES: [usize; 8] = [9, 0, 4, 13, 1, 0, 7, 5];

pub fn run(args: CheckArgs) -> Result<()> {
    crate::common::check_bf16_matmul(args.bf16_matmul, args.dtype, args.quant, false)?;
    let p = preset::preset(&args.preset)?;
    let mut config = p.config.clone();
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
    if let Some(&ep) = args.ep.iter().find(|&&ep| ep == 0 || ep > BATCHES.len()) {
        return Err(MoeError::Config(format!("--ep {ep}: EP sizes must be in 1..={} here", BATCHES.len())));
    }
    let original = preset::try_random_weights(&config, args.dtype, args.seed)?;
    let mut weights = original.clone();
    crate::common::quantize_weights(&mut weights, args.quant)?;
    let tolerance = crate::common::cpu_bound(args.quant, args.dtype, args.bf16_matmul);
    let h = config.hidden;
    let inputs: Vec<Tensor> = BATCHES
        .iter()
        .enumerate()
        .map(|(g, &t)| Tensor::from_f32(&[t, h], preset::uniform(t * h, 1.0, args.seed + 1 + g as u64)))
        .collect::<Result<_>>()?;
    let bar0 = spinner("single rank and f64 reference".into());
    let single = MoeLayer::new(
        &config,
        &weights,
        LayerOptions { quant: args.quant, bf16_matmul: args.bf16_matmul, ..LayerOptions::default() },
    )?;
    let mut want = Vec::new();
    let mut worst = 0f64;
    for x in &inputs {
        let out = single.forward(x)?.to_f32_vec();
        let r = reference::forward(&config, &original, &x.to_f32_vec())?.out;
        let scale = r.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
        worst = out.iter().zip(&r).map(|(&a, &b)| (a as f64 - b).abs() / scale).fold(worst, f64::max);
        want.push(out);
    }
    bar0.finish_and_clear();
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
    let variants: [(&str, Option<usize>, bool); 3] =
        [("plain", None, false), ("chunk 3", Some(3), false), ("dual-batch", None, true)];
    let strategies = &StrategyKind::ALL[1..];
    let mut layouts = Vec::new();
    for &s in strategies {
        for &ep in &args.ep {
            for tp in [1, 2] {
                if ep % tp == 0 {
                    layouts.push((s, ep, tp));
                }
            }
        }
    }
    println!("{:<17} {:>3} {:>3}   {:<11} {:<11} {:<11}", "strategy", "EP", "TP", "plain", "chunk 3", "dual-batch");
    let progress = bar(layouts.len() as u64, "layouts".into());
    let mut failures = 0;
    for (s, ep, tp) in layouts {
        let mut cells = Vec::new();
        for &(_, chunk, dual) in &variants {
            let mut par = ParallelConfig::new(ep, tp, s);
            par.dual_batch = dual;
            par.max_tokens_per_rank = 16;
            par.quant = args.quant;
            par.bf16_matmul = args.bf16_matmul;
            let rank_inputs: Vec<Tensor> = (0..ep).map(|r| inputs[r / tp].clone()).collect();
            let cell = match forward_in_process(&config, &weights, &par, ExpertsKind::Cpu, chunk, &rank_inputs) {
                Ok(outs) => {
                    let same = outs.iter().enumerate().all(|(r, o)| {
                        o.to_f32_vec().iter().zip(&want[r / tp]).all(|(a, b)| a.to_bits() == b.to_bits())
                    });
                    if same {
                        "bitwise ok".to_string()
                    } else {
                        failures += 1;
                        "DIFFERS".to_string()
                    }
                }
                Err(e) => {
                    failures += 1;
                    format!("error: {e}")
                }
            };
            cells.push(cell);
        }
        progress.suspend(|| {
            println!("{:<17} {:>3} {:>3}   {:<11} {:<11} {:<11}", s.name(), ep, tp, cells[0], cells[1], cells[2])
        });
        progress.inc(1);
    }
    progress.finish_and_clear();
    if failures > 0 {
        return Err(MoeError::Config(format!("{failures} layouts differ from the single-rank result")));
    }
    println!("all layouts bit-for-bit identical to one rank");
    Ok(())
}
