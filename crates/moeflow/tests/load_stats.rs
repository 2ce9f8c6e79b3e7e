//! Load statistics counted by the CPU layer: per call, the tokens' (token, slot) pairs per
//! logical expert, on one rank and on expert-parallel ranks of every strategy.

mod common;

use common::*;
use moeflow::comm::{run_ranks, Communicator};
use moeflow::parallel::{ParallelConfig, StrategyKind};
use moeflow::{preset, Activation, DType, ExpertsKind, LoadRecord, MoeLayer, RankLayerSpec, RouterConfig, Tensor};

fn counts(ids: &[i32], e: usize) -> Vec<u64> {
    let mut c = vec![0u64; e];
    ids.iter().for_each(|&i| c[i as usize] += 1);
    c
}

#[test]
fn one_rank_counts_its_routing_per_call() {
    let config = small_config(48, 16, 8, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let weights = preset::random_weights(&config, DType::F32, 1);
    let layer = MoeLayer::new(&config, &weights, Default::default()).unwrap().with_load_window(3);
    let mut want = Vec::new();
    for (i, t) in [5usize, 0, 17, 9].into_iter().enumerate() {
        let (_, x) = hidden(t, 48, i as u64);
        want.push(counts(&layer.route(&x).unwrap().ids, 8));
        layer.forward(&x).unwrap();
    }
    let stats = layer.load_stats();
    assert_eq!(stats.calls_seen, 4);
    assert_eq!(stats.calls, want[1..].to_vec(), "the window keeps the last 3 calls, oldest first");
    assert_eq!(stats.totals().iter().sum::<u64>(), (17 + 9) * 2);
    // A given routing is counted as given.
    let (_, x) = hidden(2, 48, 9);
    let topk = moeflow::TopK { tokens: 2, k: 2, ids: vec![7, 1, 7, 3], weights: vec![0.5; 4] };
    layer.forward_with_routing(&x, &topk).unwrap();
    assert_eq!(layer.load_stats().last().unwrap(), &[0, 1, 0, 1, 0, 0, 0, 2]);
}

#[test]
fn every_strategy_counts_each_ranks_own_tokens() {
    let config = small_config(32, 16, 12, 3, RouterConfig::Softmax { renormalize: false }, Activation::Silu, None);
    let weights = preset::random_weights(&config, DType::F32, 2);
    let single = MoeLayer::new(&config, &weights, Default::default()).unwrap();
    let inputs: Vec<Tensor> = (0..3).map(|r| hidden(4 + 3 * r, 32, 50 + r as u64).1).collect();
    let want: Vec<Vec<u64>> = inputs.iter().map(|x| counts(&single.route(x).unwrap().ids, 12)).collect();
    for strategy in StrategyKind::ALL.into_iter().filter(|&s| s != StrategyKind::Local) {
        let par = ParallelConfig { max_tokens_per_rank: 16, ..ParallelConfig::new(3, 1, strategy) };
        let spec = RankLayerSpec::new(&config, &weights);
        let records = run_ranks(3, None, |comm| {
            let layer = par.rank_layer(Some(comm), ExpertsKind::Cpu, &spec)?;
            layer.forward(&inputs[comm.rank()])?;
            LoadRecord::gather(&config, comm, &layer.load_stats()?)
        });
        for record in records {
            let record = record.unwrap();
            let got: Vec<Vec<u64>> = record.ranks.iter().map(|s| s.last().unwrap().to_vec()).collect();
            assert_eq!(got, want, "{strategy}");
            assert_eq!(record.num_groups, 1);
        }
    }
}
