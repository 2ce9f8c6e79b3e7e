//! The expert-parallel contract: every strategy, EP size, TP size, chunking and placement gives
//! the single-rank result bit for bit on the CPU f32 path.

mod common;

use common::*;
use moeflow::comm::{run_ranks, Communicator};
use moeflow::dispatch::{DispatchInput, Extra, TpPadding};
use moeflow::parallel::{forward_in_process, ParallelConfig, PlacementKind, StrategyKind};
use moeflow::{
    preset, Activation, Bf16Matmul, DType, ExpertsKind, LayerOptions, MoeConfig, MoeLayer, MoeWeights, RouterConfig,
    SharedConfig, Tensor,
};
use std::sync::Arc;

/// Tokens of DP group d: uneven, with empty groups.
const BATCHES: [usize; 8] = [5, 0, 7, 1, 3, 0, 9, 2];

const STRATEGIES: [StrategyKind; 5] = [
    StrategyKind::AllGather,
    StrategyKind::AllGatherLogits,
    StrategyKind::Multicast,
    StrategyKind::All2AllV,
    StrategyKind::LowLatency,
];

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_f32_vec().iter().map(|v| v.to_bits()).collect()
}

/// Runs every strategy × EP × TP × chunking × `layouts` and compares with one rank.
fn check_matrix(
    config: &MoeConfig,
    weights: &MoeWeights,
    layouts: &[(PlacementKind, Vec<usize>)],
    seed: u64,
    bf16_matmul: Bf16Matmul,
) {
    let h = config.hidden;
    let inputs: Vec<Tensor> = BATCHES.iter().enumerate().map(|(d, &t)| hidden(t, h, seed + d as u64).1).collect();
    let single = MoeLayer::new(config, weights, LayerOptions { bf16_matmul, ..LayerOptions::default() }).unwrap();
    let want: Vec<Vec<u32>> = inputs.iter().map(|x| bits(&single.forward(x).unwrap())).collect();
    let mut runs = 0;
    for strategy in STRATEGIES {
        for ep in [1, 2, 3, 4, 8] {
            for tp in [1, 2] {
                if ep % tp != 0 {
                    continue;
                }
                // Chunking and dual-batch overlap, each on its own.
                for (chunk, dual_batch) in [(None, false), (Some(3), false), (None, true)] {
                    for (placement, redundant) in layouts {
                        let mut p = ParallelConfig::new(ep, tp, strategy);
                        p.dual_batch = dual_batch;
                        p.placement = placement.clone();
                        p.redundant = redundant.clone();
                        p.max_tokens_per_rank = 16;
                        p.bf16_matmul = bf16_matmul;
                        let rank_inputs: Vec<Tensor> = (0..ep).map(|r| inputs[r / tp].clone()).collect();
                        let outs = forward_in_process(config, weights, &p, ExpertsKind::Cpu, chunk, &rank_inputs)
                            .unwrap_or_else(|e| panic!("{strategy} EP {ep} TP {tp}: {e}"));
                        for (r, out) in outs.iter().enumerate() {
                            assert_eq!(
                                bits(out),
                                want[r / tp],
                                "{strategy} EP {ep} TP {tp} chunk {chunk:?} dbo {dual_batch} {placement:?} {bf16_matmul:?} rank {r}"
                            );
                        }
                        runs += 1;
                    }
                }
            }
        }
    }
    assert_eq!(runs, STRATEGIES.len() * 8 * 3 * layouts.len());
}

#[test]
fn every_strategy_matches_one_rank_bit_for_bit() {
    // 6 experts: not divisible by 4 or 8 (ranks with no experts at EP 8).
    let config = small_config(12, 6, 6, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let weights = preset::random_weights(&config, DType::F32, 21);
    check_matrix(&config, &weights, &[(PlacementKind::Contiguous, vec![])], 1, Bf16Matmul::Widen);
}

#[test]
fn grouped_router_shared_expert_bf16_round_robin_and_replicas() {
    let config = small_config(
        10,
        7,
        8,
        3,
        RouterConfig::SigmoidGrouped { n_group: 4, topk_group: 2, renormalize: true, scaling: 2.5 },
        Activation::Silu,
        Some(SharedConfig { inter: 5, gated: true }),
    );
    let weights = preset::random_weights(&config, DType::BF16, 22);
    // Both ways of multiplying bf16 weights (dot products through the portable kernel where
    // the CPU lacks AVX512-BF16).
    for bf16_matmul in [Bf16Matmul::Widen, Bf16Matmul::Dot] {
        check_matrix(
            &config,
            &weights,
            &[(PlacementKind::RoundRobin, vec![0, 5]), (PlacementKind::Contiguous, vec![3])],
            2,
            bf16_matmul,
        );
    }
}

#[test]
fn one_hot_expert_receives_every_token() {
    let config = small_config(9, 4, 5, 2, RouterConfig::TopKSoftmax, Activation::GPT_OSS, None);
    let mut weights = preset::random_weights(&config, DType::F32, 23);
    weights.gate_bias = Some(Tensor::from_f32(&[5], vec![0.0, 50.0, 0.0, 0.0, 0.0]).unwrap());
    check_matrix(&config, &weights, &[(PlacementKind::Contiguous, vec![])], 3, Bf16Matmul::Widen);
}

#[test]
fn weights_on_input_top_1() {
    let mut config = small_config(8, 5, 7, 1, RouterConfig::Softmax { renormalize: false }, Activation::GeluErf, None);
    config.apply_router_weight_on_input = true;
    let weights = preset::random_weights(&config, DType::F32, 24);
    check_matrix(&config, &weights, &[(PlacementKind::Contiguous, vec![])], 4, Bf16Matmul::Widen);
}

#[test]
fn tp_fixed_padding_sequence_parallel_and_skip_switch() {
    let config = small_config(11, 5, 8, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let weights = preset::random_weights(&config, DType::F32, 25);
    let single = MoeLayer::new(&config, &weights, LayerOptions::default()).unwrap();
    let inputs: Vec<Tensor> = (0..2).map(|d| hidden(BATCHES[d + 2], 11, 40 + d as u64).1).collect();
    for (padding, sp, skip) in
        [(TpPadding::Fixed(12), false, false), (TpPadding::Multiple, true, false), (TpPadding::Multiple, false, true)]
    {
        for strategy in STRATEGIES {
            let mut p = ParallelConfig::new(4, 2, strategy);
            p.tp_padding = padding;
            p.sequence_parallel = sp;
            p.tp_skip = skip;
            p.max_tokens_per_rank = 16;
            let rank_inputs: Vec<Tensor> = (0..4).map(|r| inputs[r / 2].clone()).collect();
            let outs = forward_in_process(&config, &weights, &p, ExpertsKind::Cpu, None, &rank_inputs).unwrap();
            for (r, out) in outs.iter().enumerate() {
                assert_eq!(
                    bits(out),
                    bits(&single.forward(&inputs[r / 2]).unwrap()),
                    "{strategy} {padding:?} sp {sp} skip {skip}"
                );
            }
        }
    }
    // A batch above the fixed padding is an error on every rank, not a hang.
    let mut p = ParallelConfig::new(4, 2, StrategyKind::All2AllV);
    p.tp_padding = TpPadding::Fixed(4);
    let rank_inputs: Vec<Tensor> = (0..4).map(|_| hidden(7, 11, 1).1).collect();
    let err = forward_in_process(&config, &weights, &p, ExpertsKind::Cpu, None, &rank_inputs).unwrap_err().to_string();
    assert!(err.contains("exceeds the fixed TP padding of 4"), "{err}");
}

#[test]
fn reference_experts_through_every_standard_strategy() {
    // The reference experts weight and reduce themselves (NoOp): partial sums are reduced
    // across ranks, so the result is compared within f32 tolerance rather than bitwise.
    let config = small_config(8, 4, 6, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let weights = preset::random_weights(&config, DType::F32, 26);
    let inputs: Vec<Tensor> = (0..3).map(|d| hidden(BATCHES[d], 8, 50 + d as u64).1).collect();
    for strategy in
        [StrategyKind::AllGather, StrategyKind::AllGatherLogits, StrategyKind::Multicast, StrategyKind::All2AllV]
    {
        let p = ParallelConfig::new(3, 1, strategy);
        let outs = forward_in_process(&config, &weights, &p, ExpertsKind::Reference, None, &inputs).unwrap();
        for (r, out) in outs.iter().enumerate() {
            let x = inputs[r].to_f32_vec();
            let want = moeflow::reference::forward(&config, &weights, &x).unwrap().out;
            let scale = want.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
            for (g, w) in out.to_f32_vec().iter().zip(&want) {
                assert!((*g as f64 - w).abs() <= F32_TOL * scale, "{strategy} rank {r}");
            }
        }
    }
    // The batched low-latency format needs experts that take it.
    let p = ParallelConfig::new(2, 1, StrategyKind::LowLatency);
    let err =
        forward_in_process(&config, &weights, &p, ExpertsKind::Reference, None, &inputs[..2]).unwrap_err().to_string();
    assert!(err.contains("Batched"), "{err}");
}

#[test]
fn lowlatency_over_capacity_fails_every_rank_before_communicating() {
    let config = small_config(8, 4, 4, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let weights = preset::random_weights(&config, DType::F32, 27);
    let mut p = ParallelConfig::new(3, 1, StrategyKind::LowLatency);
    p.max_tokens_per_rank = 4;
    let inputs = vec![hidden(2, 8, 1).1, hidden(5, 8, 2).1, hidden(0, 8, 3).1];
    let start = std::time::Instant::now();
    let err = forward_in_process(&config, &weights, &p, ExpertsKind::Cpu, None, &inputs).unwrap_err().to_string();
    assert!(err.contains("batch of 5 tokens exceeds the low-latency capacity of 4"), "{err}");
    assert!(start.elapsed() < std::time::Duration::from_secs(10));
}

#[test]
fn extra_tensors_travel_with_their_rows() {
    let config = small_config(6, 3, 5, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let router = config.router.build(5, 2, None).unwrap();
    for strategy in STRATEGIES {
        let mut p = ParallelConfig::new(3, 1, strategy);
        p.max_tokens_per_rank = 8;
        let placement = Arc::new(p.placement(5).unwrap());
        let results = run_ranks(3, None, |comm| {
            let s = p.build(comm, placement.clone())?;
            let tokens = [4usize, 0, 6][comm.rank()];
            let (x, _) = hidden(tokens, 6, 60 + comm.rank() as u64);
            let logits = preset::uniform(tokens * 5, 2.0, 70 + comm.rank() as u64);
            let topk = router.route(&logits, tokens)?;
            // Word 0: (rank, token); word 1: the bits of the row's first value.
            let extra = Extra {
                width: 2,
                data: (0..tokens).flat_map(|t| [(comm.rank() * 100 + t) as u32, x[t * 6].to_bits()]).collect(),
            };
            let input = DispatchInput {
                hidden: &x,
                hidden_size: 6,
                tokens,
                topk: &topk,
                logits: &logits,
                router: router.as_ref(),
                extras: std::slice::from_ref(&extra),
                weights_on_input: false,
                quant: moeflow::quant::QuantConfig::None,
            };
            let prepared = s.prepare(input)?;
            let e = &prepared.extras[0];
            let rows: Vec<usize> = match &prepared.batched {
                Some(b) => {
                    (0..b.counts.len()).flat_map(|l| (0..b.counts[l]).map(move |i| l * b.capacity + i)).collect()
                }
                None => (0..prepared.hidden.len() / 6).collect(),
            };
            assert_eq!(e.data.len() / 2, prepared.hidden.len() / 6, "{strategy}: one extra row per row");
            for r in rows {
                assert_eq!(
                    e.data[r * 2 + 1],
                    prepared.hidden[r * 6].to_bits(),
                    "{strategy} rank {} row {r}",
                    comm.rank()
                );
                assert!(e.data[r * 2] % 100 < 10);
            }
            Ok(prepared.hidden.len())
        });
        let rows: Vec<usize> = results.into_iter().map(|r| r.unwrap()).collect();
        assert!(rows.iter().sum::<usize>() > 0, "{strategy}");
    }
}

#[test]
fn bytes_moved_are_reported() {
    let config = small_config(8, 4, 4, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let weights = preset::random_weights(&config, DType::F32, 28);
    for strategy in STRATEGIES {
        let p = ParallelConfig::new(2, 1, strategy);
        let placement = Arc::new(p.placement(4).unwrap());
        let res = run_ranks(2, None, |comm| {
            let s = p.build(comm, placement.clone())?;
            let layer = MoeLayer::new(&config, &weights, LayerOptions { strategy: s, ..LayerOptions::default() })?;
            layer.forward(&hidden(6, 8, comm.rank() as u64).1)?;
            Ok(layer.bytes_moved())
        });
        for r in res {
            assert!(r.unwrap() > 0, "{strategy}");
        }
    }
}

/// Ranks as separate launched processes would run them (TCP mesh, rendezvous through rank 0),
/// here on threads: every strategy, TP 2 and dual-batch overlap still give one rank's result
/// bit for bit.
#[test]
fn ranks_over_tcp_match_one_rank_bit_for_bit() {
    use moeflow::comm::{LaunchEnv, TcpComm};
    use moeflow::parallel::{on_ranks, RankHost};
    let config = small_config(24, 16, 6, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let weights = preset::random_weights(&config, DType::F32, 8);
    let h = config.hidden;
    let single = MoeLayer::new(&config, &weights, LayerOptions::default()).unwrap();
    let ep = 4;
    for strategy in STRATEGIES {
        for (tp, dual_batch) in [(1, false), (2, false), (1, true)] {
            let par = ParallelConfig { dual_batch, max_tokens_per_rank: 16, ..ParallelConfig::new(ep, tp, strategy) };
            let placement = Arc::new(par.placement(config.num_experts).unwrap());
            let port = moeflow::comm::free_port().unwrap();
            let outs: Vec<Vec<u32>> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..ep)
                    .map(|rank| {
                        let (par, placement, config, weights) = (&par, placement.clone(), &config, &weights);
                        s.spawn(move || {
                            let env = LaunchEnv::local(rank, ep, port);
                            let host = RankHost::Launched { env, gpu: false };
                            let mut res = on_ranks(&host, ep, par.timeout, |comm, kind| {
                                assert!(comm.as_any().downcast_ref::<TcpComm>().is_some());
                                let layer = par.layer(comm, placement.clone(), config, weights, kind, Some(3))?;
                                layer.forward(&hidden(BATCHES[rank / tp], h, 70 + (rank / tp) as u64).1)
                            });
                            assert_eq!(res.len(), 1);
                            bits(&res.pop().unwrap().1.unwrap())
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (rank, out) in outs.iter().enumerate() {
                let want = bits(&single.forward(&hidden(BATCHES[rank / tp], h, 70 + (rank / tp) as u64).1).unwrap());
                assert_eq!(out, &want, "{strategy} TP {tp} dual-batch {dual_batch} rank {rank}");
            }
        }
    }
}
