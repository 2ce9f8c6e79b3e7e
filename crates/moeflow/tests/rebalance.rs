//! Live rebalancing on CPU ranks: a running layer takes new placements (EPLB's, with replicas;
//! round-robin) and gives one rank's output bit for bit before and after, for every strategy,
//! EP 2, 3, 4 and TP; bad placements and failing ranks leave the old placement in use.

mod common;

use common::*;
use moeflow::comm::{run_ranks, Communicator};
use moeflow::eplb::{balance, EplbConfig};
use moeflow::error::Result;
use moeflow::parallel::{ParallelConfig, StrategyKind};
use moeflow::placement::ExpertPlacement;
use moeflow::{preset, Activation, DType, ExpertsKind, MoeConfig, MoeLayer, MoeWeights, RouterConfig, Tensor};
use std::sync::Arc;
use std::time::Duration;

fn layer_config() -> MoeConfig {
    small_config(
        40,
        24,
        16,
        4,
        RouterConfig::SigmoidGrouped { n_group: 4, topk_group: 2, renormalize: true, scaling: 2.5 },
        Activation::Silu,
        Some(moeflow::SharedConfig { inter: 16, gated: false }),
    )
}

/// Inputs of DP group `g`: uneven batches, one empty.
fn inputs(ranks: usize) -> Vec<Tensor> {
    (0..ranks).map(|g| hidden([9, 0, 5, 13][g % 4], 40, 300 + g as u64).1).collect()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_f32_vec().iter().map(|v| v.to_bits()).collect()
}

/// A skewed load over 16 experts (expert 0 hottest).
fn zipf_load() -> Vec<f64> {
    (0..16).map(|e| 1000.0 / (1.0 + e as f64).powf(1.2)).collect()
}

/// The placements a running layer moves through: EPLB's with replicas, then round-robin.
fn moves(ep: usize) -> Vec<Arc<ExpertPlacement>> {
    let eplb = balance(&zipf_load(), EplbConfig { ranks: ep, nodes: 1, redundant: 2 * ep, groups: 1 }).unwrap();
    vec![Arc::new(eplb), Arc::new(ExpertPlacement::round_robin(16, ep).unwrap())]
}

/// Builds each rank's rebalanceable layer over `comm`, runs it, moves through `moves(ep)`
/// and returns every rank's outputs (one per placement).
fn run_and_move(par: &ParallelConfig, config: &MoeConfig, weights: &MoeWeights) -> Vec<Vec<Vec<u32>>> {
    let xs = inputs(par.ep / par.tp);
    let placement = Arc::new(par.placement(16).unwrap());
    run_ranks(par.ep, Some(Duration::from_secs(20)), |comm| {
        let mut layer = par.layer(comm, placement.clone(), config, weights, ExpertsKind::Cpu, None)?;
        let x = &xs[comm.rank() / par.tp];
        let mut outs = vec![bits(&layer.forward(x)?)];
        for p in moves(par.ep) {
            layer.rebalance(p.clone())?;
            assert_eq!(layer.placement().unwrap(), p);
            outs.push(bits(&layer.forward(x)?));
        }
        Ok(outs)
    })
    .into_iter()
    .map(|r: Result<_>| r.unwrap())
    .collect()
}

#[test]
fn outputs_are_bit_identical_before_and_after_every_move() {
    let config = layer_config();
    for dtype in [DType::F32, DType::BF16] {
        let weights = preset::random_weights(&config, dtype, 8);
        let single = MoeLayer::new(&config, &weights, Default::default()).unwrap();
        for (ep, tp) in [(2, 1), (3, 1), (4, 1), (4, 2)] {
            let want: Vec<Vec<u32>> = inputs(ep / tp).iter().map(|x| bits(&single.forward(x).unwrap())).collect();
            for strategy in StrategyKind::ALL.into_iter().filter(|&s| s != StrategyKind::Local) {
                let par = ParallelConfig {
                    rebalanceable: true,
                    max_tokens_per_rank: 16,
                    ..ParallelConfig::new(ep, tp, strategy)
                };
                for (rank, outs) in run_and_move(&par, &config, &weights).iter().enumerate() {
                    for (i, out) in outs.iter().enumerate() {
                        assert_eq!(out, &want[rank / tp], "{dtype} EP {ep} TP {tp} {strategy}: rank {rank}, move {i}");
                    }
                }
            }
        }
    }
}

#[test]
fn quantized_experts_move_as_codes_and_scales() {
    let config = layer_config();
    let mut weights = preset::random_weights(&config, DType::F32, 9);
    weights.experts = weights.experts.quantized(moeflow::quant::WeightQuant::Int8Channel).unwrap();
    let options = || moeflow::LayerOptions { quant: moeflow::quant::QuantConfig::Int8, ..Default::default() };
    let single = MoeLayer::new(&config, &weights, options()).unwrap();
    let par = ParallelConfig {
        rebalanceable: true,
        quant: moeflow::quant::QuantConfig::Int8,
        ..ParallelConfig::new(3, 1, StrategyKind::All2AllV)
    };
    let want: Vec<Vec<u32>> = inputs(3).iter().map(|x| bits(&single.forward(x).unwrap())).collect();
    for (rank, outs) in run_and_move(&par, &config, &weights).iter().enumerate() {
        assert!(outs.iter().all(|o| o == &want[rank]), "rank {rank}");
    }
}

/// Runs `body(comm, layer)` on 3 rebalanceable all-to-all-v ranks (rank 1 receiving the moved
/// weights cut short when `truncate`), then a forward on every rank, returning each rank's
/// (body result, placement after, whether the output still matches one rank's).
fn three_ranks(
    truncate: bool,
    body: impl Fn(&dyn Communicator, &mut MoeLayer) -> Result<()> + Sync,
) -> Vec<(Result<()>, Option<Arc<ExpertPlacement>>, bool)> {
    let config = layer_config();
    let weights = preset::random_weights(&config, DType::F32, 10);
    let single = MoeLayer::new(&config, &weights, Default::default()).unwrap();
    let par = ParallelConfig { rebalanceable: true, ..ParallelConfig::new(3, 1, StrategyKind::All2AllV) };
    let placement = Arc::new(par.placement(16).unwrap());
    let xs = inputs(3);
    run_ranks(3, Some(Duration::from_secs(5)), |comm| {
        let comm = Faulty { inner: comm.split(0, comm.rank())?, truncate };
        let mut layer = par.layer(&comm, placement.clone(), &config, &weights, ExpertsKind::Cpu, None)?;
        let result = body(&comm, &mut layer);
        let same = match layer.forward(&xs[comm.rank()]) {
            Ok(out) => bits(&out) == bits(&single.forward(&xs[comm.rank()]).unwrap()),
            Err(_) => false,
        };
        Ok((result, layer.placement(), same))
    })
    .into_iter()
    .map(|r: Result<_>| r.unwrap())
    .collect()
}

/// A communicator whose rank 1 receives the moved expert weights cut short when `truncate`.
struct Faulty {
    inner: Box<dyn Communicator>,
    truncate: bool,
}

impl Communicator for Faulty {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_to_all_v(&self, op: &str, parts: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        let mut got = self.inner.all_to_all_v(op, parts)?;
        if self.truncate && op == "rebalance.weights" && self.rank() == 1 {
            got.iter_mut().filter(|m| !m.is_empty()).for_each(|m| m.truncate(m.len() - 1));
        }
        Ok(got)
    }
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator>> {
        Ok(Box::new(Faulty { inner: self.inner.split(color, key)?, truncate: self.truncate }))
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

fn contiguous() -> Arc<ExpertPlacement> {
    Arc::new(ExpertPlacement::contiguous(16, 3).unwrap())
}

#[test]
fn bad_placements_are_refused_before_any_weight_moves() {
    // For other ranks: every rank refuses; the layer keeps running.
    let wrong = Arc::new(ExpertPlacement::contiguous(16, 2).unwrap());
    for (result, after, same) in three_ranks(false, |_, l| l.rebalance(wrong.clone())) {
        assert!(result.unwrap_err().to_string().contains("for 16 experts on 2 ranks"));
        assert_eq!(after.unwrap(), contiguous());
        assert!(same);
    }
    // A different placement on one rank: every rank names it.
    let rr = Arc::new(ExpertPlacement::round_robin(16, 3).unwrap());
    let results = three_ranks(false, |c, l| l.rebalance(if c.rank() == 2 { contiguous() } else { rr.clone() }));
    for (result, after, same) in results {
        let e = result.unwrap_err().to_string();
        assert!(e.contains("rank 0 was given a different placement") || e.contains("rank 2"), "{e}");
        assert_eq!(after.unwrap(), contiguous());
        assert!(same);
    }
    // A layer not built for it refuses on every rank, before any communication.
    let config = layer_config();
    let weights = preset::random_weights(&config, DType::F32, 10);
    let par = ParallelConfig::new(2, 1, StrategyKind::All2AllV);
    let placement = Arc::new(par.placement(16).unwrap());
    for r in run_ranks(2, Some(Duration::from_secs(5)), |comm| {
        let mut layer = par.layer(comm, placement.clone(), &config, &weights, ExpertsKind::Cpu, None)?;
        Ok(layer.rebalance(Arc::new(ExpertPlacement::round_robin(16, 2).unwrap())))
    }) {
        assert!(r.unwrap().unwrap_err().to_string().contains("not built rebalanceable"));
    }
    let mut one = MoeLayer::new(&config, &weights, Default::default()).unwrap();
    assert!(one.rebalance(contiguous()).unwrap_err().to_string().contains("one rank"));
}

#[test]
fn a_failure_during_the_move_is_an_error_everywhere_and_the_old_placement_stays() {
    let rr = Arc::new(ExpertPlacement::round_robin(16, 3).unwrap());
    for (rank, (result, after, same)) in three_ranks(true, |_, l| l.rebalance(rr.clone())).into_iter().enumerate() {
        let e = result.unwrap_err().to_string();
        if rank == 1 {
            assert!(e.contains("expected"), "{e}");
        } else {
            assert!(e.contains("rank 1 could not take its experts"), "{e}");
        }
        assert_eq!(after.unwrap(), contiguous());
        assert!(same, "rank {rank} runs the old placement after the failed move");
    }
    // A rank that dies instead of moving: the others' collectives fail, their layers keep the
    // old placement.
    let results = three_ranks(false, |c, l| {
        if c.rank() == 2 {
            c.abort("rank 2 died");
            Err(moeflow::MoeError::Config("rank 2 died".into()))
        } else {
            l.rebalance(rr.clone())
        }
    });
    for (rank, (result, after, _)) in results.into_iter().enumerate() {
        assert!(result.is_err(), "rank {rank}");
        assert_eq!(after.unwrap(), contiguous());
    }
}
