//! Quantized dispatch and quantized experts: accuracy against the f32 reference, bounded by
//! each format's precision; the same result whatever the strategy; fewer bytes on the wire.

mod common;

use common::*;
use moeflow::model::{io, Checkpoint};
use moeflow::parallel::{forward_in_process, ParallelConfig, StrategyKind};
use moeflow::quant::{QuantConfig, WeightQuant};
use moeflow::{
    preset, reference, Activation, DType, ExpertsKind, LayerOptions, MoeLayer, RouterConfig, SharedConfig, Tensor,
};

fn rel(got: &[f32], want: &[f64]) -> f64 {
    let scale = want.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
    got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).abs()).fold(0.0, f64::max) / scale
}

/// Bound on the layer's error relative to its largest output: each product w·x carries a
/// relative error of at most ε_w + ε_x (half a step of each format), and so does each sum of
/// them; SiLU and the second GEMM propagate the first GEMM's error at most once more. Twice
/// (ε_w + ε_x), plus f32 rounding, covers both GEMMs.
fn bound(act: QuantConfig, weights: Option<WeightQuant>) -> f64 {
    2.0 * (act.step() + weights.map_or(0.0, |w| w.step())) + F32_TOL
}

#[test]
fn every_format_within_its_precision() {
    let config = small_config(
        256,
        96,
        8,
        3,
        RouterConfig::SigmoidGrouped { n_group: 4, topk_group: 2, renormalize: true, scaling: 2.5 },
        Activation::Silu,
        Some(SharedConfig { inter: 64, gated: false }),
    );
    let weights = preset::random_weights(&config, DType::F32, 31);
    let (x, xt) = hidden(40, 256, 32);
    let r = reference::forward(&config, &weights, &x).unwrap();
    for wq in [None, Some(WeightQuant::Fp8Block(128)), Some(WeightQuant::Int8Channel)] {
        let mut w = weights.clone();
        if let Some(q) = wq {
            w.experts = w.experts.quantized(q).unwrap();
        }
        for act in QuantConfig::ALL {
            let layer = MoeLayer::new(&config, &w, LayerOptions { quant: act, ..LayerOptions::default() }).unwrap();
            // Routing is computed before quantization, so it matches the reference's.
            let got = layer.forward_with_routing(&xt, &layer.route(&xt).unwrap()).unwrap().to_f32_vec();
            let err = rel(&got, &r.out);
            println!(
                "activations {act:<9} weights {:<16} relative error {err:.2e} (bound {:.2e})",
                format!("{wq:?}"),
                bound(act, wq)
            );
            assert!(err <= bound(act, wq), "{act} {wq:?}: {err:e}");
            if act == QuantConfig::None && wq.is_none() {
                assert!(err <= F32_TOL);
            }
        }
    }
}

#[test]
fn quantized_dispatch_is_the_same_on_every_strategy() {
    let config = small_config(64, 24, 6, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let weights = preset::random_weights(&config, DType::BF16, 33);
    let inputs: Vec<Tensor> = [5usize, 0, 9].iter().enumerate().map(|(i, &t)| hidden(t, 64, 40 + i as u64).1).collect();
    for quant in [QuantConfig::Int8, QuantConfig::Fp8, QuantConfig::Fp8Block, QuantConfig::Mxfp8] {
        let single = MoeLayer::new(&config, &weights, LayerOptions { quant, ..LayerOptions::default() }).unwrap();
        for strategy in [
            StrategyKind::AllGather,
            StrategyKind::AllGatherLogits,
            StrategyKind::Multicast,
            StrategyKind::All2AllV,
            StrategyKind::LowLatency,
        ] {
            let mut p = ParallelConfig::new(3, 1, strategy);
            p.quant = quant;
            p.max_tokens_per_rank = 16;
            let outs = forward_in_process(&config, &weights, &p, ExpertsKind::Cpu, None, &inputs).unwrap();
            for (r, out) in outs.iter().enumerate() {
                let want = single.forward(&inputs[r]).unwrap().to_f32_vec();
                assert_eq!(out.to_f32_vec(), want, "{quant} {strategy} rank {r}");
            }
        }
    }
}

#[test]
fn fp8_dispatch_moves_a_quarter_of_f32_bytes() {
    use moeflow::comm::{run_ranks, Communicator};
    use std::sync::Arc;
    let config = small_config(512, 16, 4, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let weights = preset::random_weights(&config, DType::F32, 34);
    let moved = |quant: QuantConfig| -> usize {
        let mut p = ParallelConfig::new(2, 1, StrategyKind::All2AllV);
        p.quant = quant;
        let placement = Arc::new(p.placement(4).unwrap());
        run_ranks(2, None, |comm| {
            let layer = p.layer(comm, placement.clone(), &config, &weights, ExpertsKind::Cpu, None)?;
            layer.forward(&hidden(16, 512, comm.rank() as u64).1)?;
            Ok(layer.bytes_moved())
        })
        .into_iter()
        .map(|r| r.unwrap())
        .sum()
    };
    let (f32_bytes, fp8_bytes, block_bytes) =
        (moved(QuantConfig::None), moved(QuantConfig::Fp8), moved(QuantConfig::Fp8Block));
    // Dispatch shrinks 4×; the combine (f32 outputs coming home) does not.
    println!("all2allv bytes: f32 {f32_bytes}, fp8 {fp8_bytes}, fp8-block {block_bytes}");
    assert!(fp8_bytes < f32_bytes * 3 / 4 && block_bytes < f32_bytes * 3 / 4 && fp8_bytes <= block_bytes);
}

#[test]
fn deepseek_fp8_checkpoint_kept_in_fp8() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/deepseek_v3_fp8");
    let ckpt = Checkpoint::open(&dir).unwrap();
    let kept = ckpt.load_moe_block_quantized(Some(2)).unwrap();
    assert_eq!(kept.weights.experts.w13.dtype(), DType::F8E4M3);
    assert!(kept.weights.experts.quant.is_some());
    let x = io::read_hidden_states(&dir.join("input.safetensors"), "hidden_states").unwrap();
    let want = io::read_hidden_states(&dir.join("expected.safetensors"), "hidden_states").unwrap().to_f64_vec();
    // The expected output was computed by transformers with the dequantized weights: keeping
    // them quantized computes the same model, to f32 rounding.
    let layer = MoeLayer::new(&kept.config, &kept.weights, LayerOptions::default()).unwrap();
    let err = rel(&layer.forward(&x).unwrap().to_f32_vec(), &want);
    assert!(err <= 1e-5, "{err:e}");
    // And with fp8-block activations on top, within the activation format's bound.
    let layer = MoeLayer::new(
        &kept.config,
        &kept.weights,
        LayerOptions { quant: QuantConfig::Fp8Block, ..LayerOptions::default() },
    )
    .unwrap();
    let err = rel(&layer.forward(&x).unwrap().to_f32_vec(), &want);
    println!("deepseek_v3_fp8 fixture, fp8-block activations: relative error {err:.2e}");
    assert!(err <= bound(QuantConfig::Fp8Block, None), "{err:e}");
    // Checkpoints without quantized experts have nothing to keep.
    let olmoe = Checkpoint::open(&dir.join("../olmoe")).unwrap();
    assert!(olmoe.load_moe_block_quantized(None).unwrap_err().to_string().contains("no quantized experts"));
}

#[test]
fn gpt_oss_mxfp4_checkpoint_kept_in_mxfp4() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gpt_oss_mxfp4");
    let kept = Checkpoint::open(&dir).unwrap().load_moe_block_quantized(Some(1)).unwrap();
    let q = kept.weights.experts.quant.as_ref().unwrap();
    assert_eq!(q.format, WeightQuant::Mxfp4);
    assert_eq!(kept.weights.experts.w13.dtype(), DType::I8, "one fp4 code per byte");
    let x = io::read_hidden_states(&dir.join("input.safetensors"), "hidden_states").unwrap();
    let want = io::read_hidden_states(&dir.join("expected.safetensors"), "hidden_states").unwrap().to_f64_vec();
    // transformers computed the expected output from the dequantized weights: the same model.
    let layer = MoeLayer::new(&kept.config, &kept.weights, LayerOptions::default()).unwrap();
    let err = rel(&layer.forward(&x).unwrap().to_f32_vec(), &want);
    assert!(err <= 1e-5, "{err:e}");
    let dense = Checkpoint::open(&dir.join("../gpt_oss")).unwrap();
    assert!(dense.load_moe_block_quantized(None).unwrap_err().to_string().contains("no MXFP4"));
}

#[test]
fn every_format_on_the_conformance_fixtures() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    for name in ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss"] {
        let dir = root.join(name);
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
        let block = Checkpoint::open(&dir)
            .unwrap()
            .load_moe_block(Some(meta["layer"].as_u64().unwrap() as usize), DType::F32)
            .unwrap();
        let x = io::read_hidden_states(&dir.join("input.safetensors"), "hidden_states").unwrap();
        let want = io::read_hidden_states(&dir.join("expected.safetensors"), "hidden_states").unwrap().to_f64_vec();
        for act in QuantConfig::ALL {
            let wq = match act {
                QuantConfig::None => None,
                QuantConfig::Int8 => Some(WeightQuant::Int8Channel),
                _ => Some(WeightQuant::Fp8Block(128)),
            };
            let mut w = block.weights.clone();
            if let Some(q) = wq {
                w.experts = w.experts.quantized(q).unwrap();
            }
            let layer =
                MoeLayer::new(&block.config, &w, LayerOptions { quant: act, ..LayerOptions::default() }).unwrap();
            // The router runs in f32 on the unquantized input, so routing matches transformers';
            // only the expert math carries the formats' error.
            let err = rel(&layer.forward(&x).unwrap().to_f32_vec(), &want);
            println!("fixture {name:<12} {act:<9} relative error {err:.2e}");
            assert!(err <= bound(act, wq), "{name} {act}: {err:e}");
        }
    }
}

#[test]
fn deferred_input_quantization_computes_the_same_and_moves_f32_rows() {
    use moeflow::comm::{run_ranks, Communicator};
    use std::sync::Arc;
    let config = small_config(128, 24, 6, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let weights = preset::random_weights(&config, DType::F32, 35);
    for strategy in [StrategyKind::All2AllV, StrategyKind::LowLatency, StrategyKind::AllGather] {
        let run = |defer: bool| -> Vec<(Vec<f32>, usize)> {
            let mut p = ParallelConfig::new(2, 1, strategy);
            (p.quant, p.defer_input_quant, p.max_tokens_per_rank) = (QuantConfig::Fp8Block, defer, 16);
            let placement = Arc::new(p.placement(6).unwrap());
            run_ranks(2, None, |comm| {
                let layer = p.layer(comm, placement.clone(), &config, &weights, ExpertsKind::Cpu, None)?;
                let out = layer.forward(&hidden(9, 128, 50 + comm.rank() as u64).1)?;
                Ok((out.to_f32_vec(), layer.bytes_moved()))
            })
            .into_iter()
            .map(|r| r.unwrap())
            .collect()
        };
        let (now, deferred) = (run(false), run(true));
        for r in 0..2 {
            assert_eq!(now[r].0, deferred[r].0, "{strategy} rank {r}: same numbers either way");
            assert!(deferred[r].1 > now[r].1, "{strategy} rank {r}: f32 rows are bigger on the wire");
        }
    }
}
