//! Live rebalancing of device-resident GPU layers over NCCL, one thread per GPU: a running
//! layer moves through contiguous → round-robin → replicas → EPLB's placement → contiguous,
//! bit for bit the same in deterministic mode and within bf16 of the f64 reference otherwise
//! (every strategy, TP slicing, biases, fp8 experts); bad placements and a dead rank leave the
//! old placement running. Needs the `cuda` feature and at least two GPUs; with fewer every
//! test prints SKIPPED and checks nothing.
#![cfg(feature = "cuda")]

mod common;

use common::*;
use moeflow::backend::cuda::CudaOptions;
use moeflow::comm::Communicator;
use moeflow::eplb::{balance, EplbConfig};
use moeflow::parallel::{on_ranks, ParallelConfig, RankHost, StrategyKind};
use moeflow::placement::ExpertPlacement;
use moeflow::quant::WeightQuant;
use moeflow::{preset, reference, Activation, DType, MoeConfig, MoeWeights, RouterConfig, SharedConfig, Tensor};
use std::sync::Arc;
use std::time::Duration;

/// Same bound as tests/cuda.rs: bf16 activations and GEMM outputs.
const BF16_TOL: f64 = 2.5e-2;

/// The layers moved: DeepSeek's grouped router with a shared expert, and GPT-OSS's biases
/// (moved with their experts). Sizes divisible by 8, as deterministic mode needs.
fn cases() -> Vec<(&'static str, MoeConfig, MoeWeights)> {
    let grouped = RouterConfig::SigmoidGrouped { n_group: 4, topk_group: 2, renormalize: true, scaling: 2.5 };
    let shared = Some(SharedConfig { inter: 48, gated: true });
    [
        ("DeepSeek grouped, shared", small_config(136, 80, 16, 4, grouped, Activation::Silu, shared)),
        ("GPT-OSS biases", small_config(136, 80, 8, 2, RouterConfig::TopKSoftmax, Activation::GPT_OSS, None)),
    ]
    .into_iter()
    .map(|(name, config)| {
        let weights = preset::random_weights(&config, DType::BF16, 61);
        (name, config, weights)
    })
    .collect()
}

/// The placements a running layer moves through on `n` ranks, starting from contiguous:
/// round-robin, round-robin with replicas of experts 0 and 3, EPLB's for a Zipf load (with
/// `n` replicas), and back to contiguous.
fn moves(e: usize, n: usize) -> Vec<Arc<ExpertPlacement>> {
    let zipf: Vec<f64> = (0..e).map(|x| 1000.0 / (1.0 + x as f64).powf(1.2)).collect();
    let round_robin = ExpertPlacement::round_robin(e, n).unwrap();
    vec![
        Arc::new(round_robin.clone()),
        Arc::new(round_robin.with_replicas(&[0, 3]).unwrap()),
        Arc::new(balance(&zipf, EplbConfig { ranks: n, nodes: 1, redundant: n, groups: 1 }).unwrap()),
        Arc::new(ExpertPlacement::contiguous(e, n).unwrap()),
    ]
}

/// Tokens of DP group `g`: uneven, one group empty.
fn tokens(g: usize) -> usize {
    [37, 0, 5, 300][g % 4]
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The largest error of `got` against the f64 reference on `x`, relative to the largest
/// reference output.
fn relative_error(config: &MoeConfig, weights: &MoeWeights, x: &[f32], got: &[f32]) -> f64 {
    let want = reference::forward(config, weights, x).unwrap().out;
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
    got.iter().zip(&want).map(|(&g, &w)| (g as f64 - w).abs()).fold(0.0, f64::max) / scale
}

/// A rank's input and its outputs, one before the moves and two after each.
type Moved = (Vec<f32>, Vec<Vec<f32>>);

/// Builds `par`'s layer on every GPU rank, runs each DP group's batch, moves through
/// `moves(e, n)` running it after each, and returns every rank's (input, outputs: one per
/// placement). Checks each rank reports the placement it was given.
fn run_and_move(
    par: &ParallelConfig,
    spec: &moeflow::RankLayerSpec<'_>,
    seed: u64,
) -> Vec<(usize, moeflow::Result<Moved>)> {
    let (h, e) = (spec.config.hidden, spec.config.num_experts);
    on_ranks(&RankHost::Gpus, par.ep, Duration::from_secs(60), |comm, kind| {
        let mut layer = par.rank_layer(Some(comm), kind, spec)?;
        let t = tokens(comm.rank() / par.tp);
        let x = preset::uniform(t * h, 1.0, seed + (comm.rank() / par.tp) as u64);
        let xt = Tensor::from_f32(&[t, h], x.clone())?;
        let mut outs = vec![layer.forward(&xt)?.to_f32_vec()];
        for p in moves(e, par.ep) {
            layer.rebalance(p.clone())?;
            if layer.placement().as_deref() != Some(&*p) {
                return Err(moeflow::MoeError::Config(format!("rank {} reports another placement", comm.rank())));
            }
            outs.push(layer.forward(&xt)?.to_f32_vec());
            // Twice: the second call replays what the first set up (graphs, buffers).
            outs.push(layer.forward(&xt)?.to_f32_vec());
        }
        Ok((x, outs))
    })
}

#[test]
fn deterministic_outputs_are_bit_identical_across_moves() {
    let Some(Gpus { n, _serial }) = gpus("deterministic_outputs_are_bit_identical_across_moves") else { return };
    let det = CudaOptions { deterministic: true, ..Default::default() };
    for (name, config, weights) in cases() {
        let spec = moeflow::RankLayerSpec { cuda: det.clone(), ..moeflow::RankLayerSpec::new(&config, &weights) };
        for par in
            [ParallelConfig::new(n, 1, StrategyKind::All2AllV), ParallelConfig::new(n, 2, StrategyKind::All2AllV)]
        {
            let label = format!("{name}, {}", par.layout());
            for (rank, r) in run_and_move(&par, &spec, 70) {
                let (x, outs) = r.unwrap_or_else(|e| panic!("{label}: rank {rank}: {e}"));
                for (i, out) in outs.iter().enumerate() {
                    assert!(bits(out) == bits(&outs[0]), "{label}: rank {rank}: output {i} differs after moving");
                }
                if !x.is_empty() {
                    let err = relative_error(&config, &weights, &x, &outs[0]);
                    assert!(err <= BF16_TOL, "{label}: rank {rank}: relative error {err:e}");
                }
                eprintln!("rebalance deterministic {label}: rank {rank}: {} outputs bit-identical", outs.len());
            }
        }
    }
}

#[test]
fn default_mode_stays_within_bf16_of_the_reference_across_moves() {
    let Some(Gpus { n, _serial }) = gpus("default_mode_stays_within_bf16_of_the_reference_across_moves") else {
        return;
    };
    let strategies = [
        StrategyKind::All2AllV,
        StrategyKind::AllGather,
        StrategyKind::AllGatherLogits,
        StrategyKind::Multicast,
        StrategyKind::LowLatency,
        StrategyKind::Auto,
    ];
    for (name, config, weights) in cases() {
        let spec = moeflow::RankLayerSpec::new(&config, &weights);
        for s in strategies {
            let par = ParallelConfig { max_tokens_per_rank: 400, ..ParallelConfig::new(n, 1, s) };
            let label = format!("{name}, {}", par.layout());
            check_default_mode(&label, &par, &spec, &weights);
        }
        let tp = ParallelConfig::new(n, 2, StrategyKind::All2AllV);
        check_default_mode(&format!("{name}, {}", tp.layout()), &tp, &spec, &weights);
    }
}

/// fp8 experts (codes and 128 × 128 block scales, streamed by the low-latency GEMM) move with
/// their bf16 values.
#[test]
fn fp8_experts_move_with_their_scales() {
    let Some(Gpus { n, _serial }) = gpus("fp8_experts_move_with_their_scales") else { return };
    let config = fp8_test_config(n);
    let mut weights = preset::random_weights(&config, DType::BF16, 62);
    weights.experts = weights.experts.quantized(WeightQuant::Fp8Block(128)).unwrap();
    let spec = moeflow::RankLayerSpec::new(&config, &weights);
    for s in [StrategyKind::LowLatency, StrategyKind::All2AllV] {
        let par = ParallelConfig { max_tokens_per_rank: 400, ..ParallelConfig::new(n, 1, s) };
        check_default_mode(&format!("fp8 experts, {}", par.layout()), &par, &spec, &weights);
    }
}

/// Every output of `run_and_move` within bf16 of the reference on `weights`.
fn check_default_mode(label: &str, par: &ParallelConfig, spec: &moeflow::RankLayerSpec<'_>, weights: &MoeWeights) {
    for (rank, r) in run_and_move(par, spec, 80) {
        let (x, outs) = r.unwrap_or_else(|e| panic!("{label}: rank {rank}: {e}"));
        if x.is_empty() {
            assert!(outs.iter().all(|o| o.is_empty()), "{label}: rank {rank}");
            continue;
        }
        let worst = outs.iter().map(|o| relative_error(spec.config, weights, &x, o)).fold(0.0, f64::max);
        assert!(worst <= BF16_TOL, "{label}: rank {rank}: relative error {worst:e} after a move");
        eprintln!("rebalance {label}: rank {rank}: {} outputs, worst relative error {worst:.2e}", outs.len());
    }
}

/// Builds the all-to-all-v layer on every GPU rank, runs a batch, calls `body`, then runs the
/// batch again; returns each rank's (body's result, placement after, whether the output after
/// is the bits of the output before). Deterministic mode, so a kept placement gives the same
/// bits.
fn attempt(
    n: usize,
    body: impl Fn(&dyn Communicator, &mut moeflow::RankLayer) -> moeflow::Result<()> + Sync,
) -> Vec<(moeflow::Result<()>, Option<Arc<ExpertPlacement>>, bool)> {
    let (_, config, weights) = cases().remove(0);
    let det = CudaOptions { deterministic: true, ..Default::default() };
    let spec = moeflow::RankLayerSpec { cuda: det, ..moeflow::RankLayerSpec::new(&config, &weights) };
    let par = ParallelConfig { timeout: Duration::from_secs(20), ..ParallelConfig::new(n, 1, StrategyKind::All2AllV) };
    let h = config.hidden;
    on_ranks(&RankHost::Gpus, n, Duration::from_secs(20), |comm, kind| {
        let mut layer = par.rank_layer(Some(comm), kind, &spec)?;
        let x = Tensor::from_f32(&[5, h], preset::uniform(5 * h, 1.0, 90 + comm.rank() as u64))?;
        let before = layer.forward(&x)?.to_f32_vec();
        // Every rank is done with the forward before any goes on (a rank may die next).
        comm.barrier()?;
        let result = body(comm, &mut layer);
        let same = match layer.forward(&x) {
            Ok(after) => bits(&after.to_f32_vec()) == bits(&before),
            Err(_) => false,
        };
        Ok((result, layer.placement(), same))
    })
    .into_iter()
    .map(|(rank, r)| r.unwrap_or_else(|e| panic!("rank {rank}: {e}")))
    .collect()
}

#[test]
fn bad_placements_are_refused_before_any_weight_moves() {
    let Some(Gpus { n, _serial }) = gpus("bad_placements_are_refused_before_any_weight_moves") else { return };
    let e = cases()[0].1.num_experts;
    let contiguous = Arc::new(ExpertPlacement::contiguous(e, n).unwrap());
    let refused = |body: &(dyn Fn(&dyn Communicator, &mut moeflow::RankLayer) -> moeflow::Result<()> + Sync),
                   want: &dyn Fn(&str) -> bool| {
        for (rank, (result, after, same)) in attempt(n, body).into_iter().enumerate() {
            let msg = result.expect_err("refused").to_string();
            assert!(want(&msg), "rank {rank}: {msg}");
            assert_eq!(after.as_deref(), Some(&*contiguous), "rank {rank} keeps the old placement");
            assert!(same, "rank {rank} runs the old placement after the refusal");
        }
    };
    // For another number of ranks.
    let wrong = Arc::new(ExpertPlacement::contiguous(e, n + 1).unwrap());
    refused(&|_, l| l.rebalance(wrong.clone()), &|m| m.contains(&format!("for {e} experts on {} ranks", n + 1)));
    // A rank left without experts.
    let mut slots = vec![Vec::new(); n];
    slots[0] = (0..e).collect();
    let empty = Arc::new(ExpertPlacement::from_slots(e, slots).unwrap());
    refused(&|_, l| l.rebalance(empty.clone()), &|m| m.contains("rank 1 without experts"));
    // A different placement on the last rank.
    let rr = Arc::new(ExpertPlacement::round_robin(e, n).unwrap());
    refused(&|c, l| l.rebalance(if c.rank() == n - 1 { contiguous.clone() } else { rr.clone() }), &|m| {
        m.contains("was given a different placement")
    });
    // A layer on one GPU, and one split for dual-batch overlap, refuse it by name.
    let (_, config, weights) = cases().remove(0);
    let mut one = moeflow::backend::cuda::CudaMoeLayer::new(&config, &weights, &Default::default()).unwrap();
    let msg = one.rebalance(contiguous.clone()).unwrap_err().to_string();
    assert!(msg.contains("runs on one GPU"), "{msg}");
    let spec = moeflow::RankLayerSpec::new(&config, &weights);
    let dual = ParallelConfig { dual_batch: true, ..ParallelConfig::new(n, 1, StrategyKind::All2AllV) };
    for (rank, r) in on_ranks(&RankHost::Gpus, n, Duration::from_secs(30), |comm, kind| {
        let mut layer = dual.rank_layer(Some(comm), kind, &spec)?;
        Ok(layer.rebalance(rr.clone()))
    }) {
        let msg = r.unwrap().unwrap_err().to_string();
        assert!(msg.contains("dual-batch"), "rank {rank}: {msg}");
    }
}

#[test]
fn a_dead_rank_fails_the_move_everywhere_and_the_placement_stays() {
    let Some(Gpus { n, _serial }) = gpus("a_dead_rank_fails_the_move_everywhere_and_the_placement_stays") else {
        return;
    };
    let e = cases()[0].1.num_experts;
    let rr = Arc::new(ExpertPlacement::round_robin(e, n).unwrap());
    let results = attempt(n, |c, l| {
        if c.rank() == 1 {
            // A moment after the barrier, so the others are past it when it dies.
            std::thread::sleep(Duration::from_millis(500));
            c.abort("rank 1 died");
            Err(moeflow::MoeError::Config("rank 1 died".into()))
        } else {
            l.rebalance(rr.clone())
        }
    });
    for (rank, (result, after, _)) in results.into_iter().enumerate() {
        assert!(result.is_err(), "rank {rank}");
        assert_eq!(after.as_deref(), Some(&ExpertPlacement::contiguous(e, n).unwrap()), "rank {rank}");
    }
}
