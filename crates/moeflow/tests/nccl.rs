//! Expert parallelism over NCCL, one thread per GPU: the communicator's collectives, every
//! strategy against the f64 reference, repeatability, and failure handling. Needs the `cuda`
//! feature and at least two GPUs; with fewer every test prints SKIPPED and checks nothing.
#![cfg(feature = "cuda")]

mod common;

use common::*;
use moeflow::backend::cuda::run_ranks_nccl;
use moeflow::backend::cuda_options::{ExpertGemm, REPLICA_MIN_ROWS};
use moeflow::comm::{CommExt, Communicator};
use moeflow::parallel::{on_ranks, ParallelConfig, PlacementKind, RankHost, StrategyKind};
use moeflow::placement::ExpertPlacement;
use moeflow::{preset, reference, Activation, DType, RouterConfig, SharedConfig, Tensor};
use std::sync::Arc;
use std::time::Duration;

/// Same bound as tests/cuda.rs: bf16 activations and GEMM outputs.
const BF16_TOL: f64 = 2.5e-2;

#[test]
fn collectives_move_uneven_and_empty_parts() {
    let Some(Gpus { n, _serial }) = gpus("collectives_move_uneven_and_empty_parts") else { return };
    let len = |src: usize, dst: usize| (src * 7 + dst * 13) % 11 * 1000; // includes 0
    let byte = |src: usize, dst: usize, i: usize| (src * 31 + dst * 17 + i) as u8;
    let results = run_ranks_nccl(&(0..n).collect::<Vec<_>>(), Duration::from_secs(30), |c| {
        let r = c.rank();
        for round in 0..3 {
            let parts = (0..n).map(|d| (0..len(r, d)).map(|i| byte(r, d, i + round)).collect()).collect();
            let got = c.all_to_all_v("test.a2a", parts)?;
            for (src, part) in got.iter().enumerate() {
                assert_eq!(part.len(), len(src, r), "round {round}: from {src} to {r}");
                assert!(part.iter().enumerate().all(|(i, &b)| b == byte(src, r, i + round)));
            }
        }
        let sum = c.all_reduce_sum("test.sum", &[r as f32, 1.0, -(r as f32)])?;
        let tri = (n * (n - 1) / 2) as f32;
        assert_eq!(sum, vec![tri, n as f32, -tri]);
        // Sub-groups: even and odd ranks, ordered by descending rank.
        let sub = c.split(r % 2, n - r)?;
        assert_eq!(sub.size(), n.div_ceil(2) - (r % 2) * (n % 2));
        let ranks: Vec<Vec<u32>> = sub.all_gather_vec("test.sub", &[r as u32])?;
        let mut want: Vec<u32> = (0..n as u32).filter(|x| x % 2 == r as u32 % 2).collect();
        want.reverse();
        assert_eq!(ranks.concat(), want);
        assert_eq!(sub.rank(), want.iter().position(|&x| x == r as u32).unwrap());
        Ok(())
    });
    for r in results {
        r.unwrap();
    }
}

/// Two splits of the same parent back to back, used, torn down, three times over: the
/// ranks leave each teardown together, so no rank's next collective waits behind a slower
/// rank's `ncclCommDestroy` (which stalled until the deadline, every time, before they did).
#[test]
fn splits_and_teardowns_repeat() {
    let Some(Gpus { n, _serial }) = gpus("splits_and_teardowns_repeat") else { return };
    for round in 0..3 {
        let results = run_ranks_nccl(&(0..n).collect::<Vec<_>>(), Duration::from_secs(30), |c| {
            for _ in 0..3 {
                let (a, b) = (c.split(0, c.rank())?, c.split(0, c.rank())?);
                for comm in [&a, &b] {
                    let sum = comm.all_reduce_sum("test.split", &[1.0])?;
                    assert_eq!(sum, vec![comm.size() as f32], "round {round}");
                }
            }
            Ok(())
        });
        let failed: Vec<String> = results.iter().filter_map(|r| r.as_ref().err().map(|e| e.to_string())).collect();
        assert!(failed.is_empty(), "round {round}: {failed:?}");
    }
}

/// A communicator of one rank (a sub-group alone) reduces to its own values.
#[test]
fn single_rank_groups_reduce() {
    let Some(Gpus { n, _serial }) = gpus("single_rank_groups_reduce") else { return };
    let results = run_ranks_nccl(&(0..n).collect::<Vec<_>>(), Duration::from_secs(30), |c| {
        let alone = c.split(c.rank(), 0)?;
        assert_eq!(alone.size(), 1);
        let sum = alone.all_reduce_sum("test.alone", &[2.0])?;
        assert_eq!(sum, vec![2.0]);
        Ok(())
    });
    for r in results {
        r.unwrap();
    }
}

/// A layer with `e` experts, top-`k`, a gated shared expert, and random bf16 weights.
fn layer_config(e: usize, k: usize) -> (moeflow::MoeConfig, moeflow::MoeWeights) {
    let config = small_config(
        160,
        96,
        e,
        k,
        RouterConfig::Softmax { renormalize: true },
        Activation::Silu,
        Some(SharedConfig { inter: 48, gated: true }),
    );
    let weights = preset::random_weights(&config, DType::BF16, 21);
    (config, weights)
}

#[test]
fn every_strategy_on_gpus_matches_the_reference_and_repeats() {
    let Some(Gpus { n, _serial }) = gpus("every_strategy_on_gpus_matches_the_reference_and_repeats") else { return };
    let mut layouts: Vec<(String, ParallelConfig, usize, usize)> = Vec::new();
    for strategy in StrategyKind::ALL.into_iter().filter(|&s| s != StrategyKind::Local) {
        layouts.push((format!("{strategy}"), ParallelConfig::new(n, 1, strategy), 8, 2));
        layouts.push((
            format!("{strategy} dual-batch"),
            ParallelConfig { dual_batch: true, ..ParallelConfig::new(n, 1, strategy) },
            8,
            2,
        ));
        layouts.push((format!("{strategy} TP 2"), ParallelConfig::new(n, 2, strategy), 8, 2));
    }
    // Experts not divisible by ranks, top-1, round-robin placement, a redundant replica.
    layouts.push((
        "all2allv 7 experts round-robin".into(),
        ParallelConfig { placement: PlacementKind::RoundRobin, ..ParallelConfig::new(n, 1, StrategyKind::All2AllV) },
        7,
        1,
    ));
    layouts.push((
        "allgather redundant".into(),
        ParallelConfig { redundant: vec![0, 3], ..ParallelConfig::new(n, 1, StrategyKind::AllGather) },
        8,
        3,
    ));
    for (name, par, e, k) in layouts {
        let (config, weights) = layer_config(e, k);
        let h = config.hidden;
        let groups = n / par.tp;
        // Uneven batches; the last DP group gets none.
        let sizes: Vec<usize> =
            (0..groups).map(|g| if g + 1 == groups && groups > 1 { 0 } else { 9 + 14 * g }).collect();
        let inputs: Vec<Vec<f32>> =
            sizes.iter().enumerate().map(|(g, &t)| preset::uniform(t * h, 1.0, g as u64)).collect();
        let par = ParallelConfig { max_tokens_per_rank: 64, ..par };
        let placement = Arc::new(par.placement(e).unwrap());
        let results = on_ranks(&RankHost::Gpus, n, Duration::from_secs(60), |comm, kind| {
            let layer = par.layer(comm, placement.clone(), &config, &weights, kind, Some(16))?;
            let x = &inputs[comm.rank() / par.tp];
            let xt = Tensor::from_f32(&[x.len() / h, h], x.clone())?;
            let a = layer.forward(&xt)?.to_f32_vec();
            let b = layer.forward(&xt)?.to_f32_vec();
            Ok((a, b))
        });
        for (rank, r) in results {
            let (a, b) = r.unwrap_or_else(|e| panic!("{name}: rank {rank}: {e}"));
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{name}: rank {rank} differs run to run"
            );
            let x = &inputs[rank / par.tp];
            let want = reference::forward(&config, &weights, x).unwrap().out;
            let scale = want.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
            let err = a.iter().zip(&want).map(|(&g, &w)| (g as f64 - w).abs()).fold(0.0, f64::max) / scale;
            assert_eq!(a.len(), want.len(), "{name}: rank {rank}");
            assert!(err <= BF16_TOL, "{name}: rank {rank}: relative error {err:e}");
            eprintln!("{name:<34} rank {rank}: {} tokens, relative error {err:.2e}", x.len() / h);
        }
    }
}

/// The device-resident layers' cases: routers, activations, top-1, a shared expert, one hot
/// expert; (name, config, weights).
fn device_cases() -> Vec<(&'static str, moeflow::MoeConfig, moeflow::MoeWeights)> {
    let grouped = RouterConfig::SigmoidGrouped { n_group: 4, topk_group: 2, renormalize: true, scaling: 2.5 };
    let cases = [
        (
            "softmax, gated shared expert",
            RouterConfig::Softmax { renormalize: true },
            Activation::Silu,
            8,
            2,
            Some(true),
            None,
        ),
        ("GPT-OSS biases, top-1", RouterConfig::TopKSoftmax, Activation::GPT_OSS, 8, 1, None, None),
        ("DeepSeek grouped, ungated shared", grouped, Activation::Silu, 16, 6, Some(false), None),
        ("one hot expert", RouterConfig::TopKSoftmax, Activation::GPT_OSS, 12, 2, None, Some(5)),
    ];
    let mut out = Vec::new();
    // `shared`: a shared expert, gated or not (DeepSeek-V3's is not: the sum at home adds it).
    for (name, router, act, e, k, shared, hot) in cases {
        let shared = shared.map(|gated| SharedConfig { inter: 48, gated });
        let config = small_config(136, 80, e, k, router, act, shared);
        let mut weights = preset::random_weights(&config, DType::BF16, 33);
        if let Some(hot) = hot {
            let mut bias = vec![0f32; e];
            bias[hot] = 60.0;
            weights.gate_bias = Some(Tensor::from_f32(&[e], bias).unwrap());
        }
        out.push((name, config, weights));
    }
    out
}

/// A layer whose router runs on the tensor cores (128 experts), top-8 with an ungated shared
/// expert; its width of 264 leaves deterministic mode's last fixed block of router columns
/// partly filled.
fn tensor_core_router_case() -> (&'static str, moeflow::MoeConfig, moeflow::MoeWeights) {
    let grouped = RouterConfig::SigmoidGrouped { n_group: 4, topk_group: 2, renormalize: true, scaling: 2.5 };
    let config =
        small_config(264, 80, 128, 8, grouped, Activation::Silu, Some(SharedConfig { inter: 48, gated: false }));
    let weights = preset::random_weights(&config, DType::BF16, 34);
    ("128 experts, tensor-core router", config, weights)
}

/// The bit patterns of `v`, to compare outputs exactly.
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Largest difference from the f64 reference over the largest reference magnitude.
fn relative_error(config: &moeflow::MoeConfig, weights: &moeflow::MoeWeights, x: &[f32], got: &[f32]) -> f64 {
    let want = reference::forward(config, weights, x).unwrap().out;
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
    got.iter().zip(&want).map(|(&g, &w)| (g as f64 - w).abs()).fold(0.0, f64::max) / scale
}

/// The contiguous placement of `config`'s experts on `n` ranks.
fn even(config: &moeflow::MoeConfig, n: usize) -> Arc<ExpertPlacement> {
    Arc::new(ExpertPlacement::contiguous(config.num_experts, n).unwrap())
}

/// The placements the device layers are tested on, for `e` experts on `n` ranks: contiguous,
/// round-robin, an explicit uneven one (rank 0 holds one expert, the last rank the most) and
/// contiguous with two replicas; each with the rows a replicated expert needs before its
/// replicas share a batch (`CudaOptions::replica_min_rows`): the default, which these small
/// batches never reach, and 12, which some experts of a rank's batch reach and others not.
fn placements(e: usize, n: usize) -> Vec<(&'static str, Arc<ExpertPlacement>, usize)> {
    let mut slots: Vec<Vec<usize>> = vec![Vec::new(); n];
    for x in 0..e {
        slots[if x == 0 { 0 } else { 1 + (x - 1) * (n - 1) / (e - 1).max(1) }.min(n - 1)].push(x);
    }
    let replicas = Arc::new(ExpertPlacement::contiguous(e, n).unwrap().with_replicas(&[0, 3]).unwrap());
    let default = REPLICA_MIN_ROWS;
    vec![
        ("contiguous", Arc::new(ExpertPlacement::contiguous(e, n).unwrap()), default),
        ("round-robin", Arc::new(ExpertPlacement::round_robin(e, n).unwrap()), default),
        ("explicit uneven", Arc::new(ExpertPlacement::from_slots(e, slots).unwrap()), default),
        ("replicas of 0 and 3", replicas.clone(), default),
        ("replicas, 12 rows", replicas, 12),
    ]
}

/// Every device case through the expert-parallel layer `make` builds on each rank, under every
/// placement of [`placements`], with uneven batches (rank 0's over more than one block of the
/// device plan's 256 tokens) and rank 1 without tokens: against the f64 reference, and run
/// after run the same.
fn device_layer_matches_the_reference(
    label: &str,
    n: usize,
    make: impl Fn(moeflow::backend::cuda::CudaMoeLayer) -> moeflow::Result<moeflow::backend::cuda::CudaMoeLayer> + Sync,
) {
    use moeflow::backend::cuda::CudaMoeLayer;
    let devices: Vec<usize> = (0..n).collect();
    for (name, config, weights, (placed, placement, min_rows)) in device_cases()
        .into_iter()
        .flat_map(|(name, c, w)| placements(c.num_experts, n).into_iter().map(move |p| (name, c.clone(), w.clone(), p)))
    {
        let h = config.hidden;
        let sizes: Vec<usize> = (0..n).map(|r| [300, 0, 37, 5][r % 4]).collect();
        let inputs: Vec<Vec<f32>> =
            sizes.iter().enumerate().map(|(r, &t)| preset::uniform(t * h, 1.0, 50 + r as u64)).collect();
        let opts = moeflow::backend::cuda::CudaOptions { replica_min_rows: min_rows, ..Default::default() };
        let results = run_ranks_nccl(&devices, Duration::from_secs(60), |c| {
            let layer = make(CudaMoeLayer::new_ep(&config, &weights, c.duplicate()?, placement.clone(), &opts)?)?;
            let x = &inputs[c.rank()];
            let xt = Tensor::from_f32(&[x.len() / h, h], x.clone())?;
            Ok((layer.forward(&xt)?.to_f32_vec(), layer.forward(&xt)?.to_f32_vec()))
        });
        for (rank, r) in results.into_iter().enumerate() {
            let (a, b) = r.unwrap_or_else(|e| panic!("{label}, {name}, {placed}: rank {rank}: {e}"));
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{label}, {name}, {placed}: rank {rank} differs run to run"
            );
            let err = relative_error(&config, &weights, &inputs[rank], &a);
            assert!(err <= BF16_TOL, "{label}, {name}, {placed}: rank {rank}: relative error {err:e}");
            eprintln!(
                "device {label}, {name:<30} {placed:<20} rank {rank}: {} tokens, relative error {err:.2e}",
                sizes[rank]
            );
        }
    }
}

#[test]
fn device_resident_all2allv_matches_the_reference_and_repeats() {
    use moeflow::backend::cuda::CudaMoeLayer;
    let Some(Gpus { n, _serial }) = gpus("device_resident_all2allv_matches_the_reference_and_repeats") else { return };
    let devices: Vec<usize> = (0..n).collect();
    device_layer_matches_the_reference("all2allv", n, Ok);
    // A placement for other experts or ranks is a clear error, not a wrong answer.
    let config =
        small_config(64, 32, 2 * n + 1, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let weights = preset::random_weights(&config, DType::BF16, 1);
    let wrong = Arc::new(ExpertPlacement::contiguous(2 * n, n).unwrap());
    for r in run_ranks_nccl(&devices, Duration::from_secs(30), |c| {
        CudaMoeLayer::new_ep(&config, &weights, c.duplicate()?, wrong.clone(), &Default::default()).map(|_| ())
    }) {
        let e = r.unwrap_err().to_string();
        assert!(e.contains("placement of"), "{e}");
    }
}

#[test]
fn device_resident_gathering_layers_match_the_reference_and_repeat() {
    use moeflow::backend::cuda::CudaMoeLayer;
    let Some(Gpus { n, _serial }) = gpus("device_resident_gathering_layers_match_the_reference_and_repeat") else {
        return;
    };
    device_layer_matches_the_reference("all-gather", n, |layer| layer.all_gather());
    device_layer_matches_the_reference("multicast", n, |layer| layer.multicast());
    device_layer_matches_the_reference("all-gather of logits", n, |layer| layer.all_gather_logits());
    // One way of dispatching per layer: asking for both is a clear error.
    let devices: Vec<usize> = (0..n).collect();
    let (_, config, weights) = device_cases().swap_remove(0);
    for r in run_ranks_nccl(&devices, Duration::from_secs(30), |c| {
        CudaMoeLayer::new_ep(&config, &weights, c.duplicate()?, even(&config, n), &Default::default())?
            .all_gather()?
            .low_latency(16)
            .map(|_| ())
    }) {
        let e = r.unwrap_err().to_string();
        assert!(e.contains("dispatches one way"), "{e}");
    }
    for r in run_ranks_nccl(&devices, Duration::from_secs(30), |c| {
        CudaMoeLayer::new_ep(&config, &weights, c.duplicate()?, even(&config, n), &Default::default())?
            .all_gather()?
            .multicast()
            .map(|_| ())
    }) {
        let e = r.unwrap_err().to_string();
        assert!(e.contains("dispatches one way"), "{e}");
    }
}

#[test]
fn device_dual_batch_matches_the_reference() {
    use moeflow::backend::cuda::CudaMoeLayer;
    let Some(Gpus { n, _serial }) = gpus("device_dual_batch_matches_the_reference") else { return };
    let devices: Vec<usize> = (0..n).collect();
    // Both halves exchange by all-to-all-v, then both by all-gather.
    for (name, config, weights, all_gather) in
        device_cases().into_iter().flat_map(|(n, c, w)| [false, true].map(|ag| (n, c.clone(), w.clone(), ag)))
    {
        let h = config.hidden;
        // Uneven batches: one token (its second half empty), none, odd, and large.
        let sizes: Vec<usize> = (0..n).map(|r| [1, 0, 37, 300][r % 4]).collect();
        let inputs: Vec<Vec<f32>> =
            sizes.iter().enumerate().map(|(r, &t)| preset::uniform(t * h, 1.0, 70 + r as u64)).collect();
        let results = run_ranks_nccl(&devices, Duration::from_secs(60), |c| {
            let mut layer =
                CudaMoeLayer::new_ep(&config, &weights, c.duplicate()?, even(&config, n), &Default::default())?;
            if all_gather {
                layer = layer.all_gather()?;
            }
            let layer = layer.dual_batch(Some(c.duplicate()?))?;
            let x = &inputs[c.rank()];
            let out = layer.forward(&Tensor::from_f32(&[x.len() / h, h], x.clone())?)?.to_f32_vec();
            Ok((out, layer.forward_timed(64, 5)?.total))
        });
        for (rank, r) in results.into_iter().enumerate() {
            let (got, ms) = r.unwrap_or_else(|e| panic!("{name}: rank {rank}: {e}"));
            assert!(ms > 0.0 && ms.is_finite(), "{name}: rank {rank}: timed {ms}");
            if sizes[rank] == 0 {
                assert!(got.is_empty());
                continue;
            }
            let err = relative_error(&config, &weights, &inputs[rank], &got);
            assert!(err <= BF16_TOL, "{name}: rank {rank}: relative error {err:e}");
            let how = if all_gather { "all-gather" } else { "all2allv" };
            eprintln!(
                "device dual-batch {how}, {name:<30} rank {rank}: {} tokens, relative error {err:.2e}",
                sizes[rank]
            );
        }
    }
    // A layer split without its second communicator is a clear error.
    for r in run_ranks_nccl(&devices, Duration::from_secs(30), |c| {
        let (_, config, weights) = device_cases().remove(0);
        CudaMoeLayer::new_ep(&config, &weights, c.duplicate()?, even(&config, n), &Default::default())?
            .dual_batch(None)
            .map(|_| ())
    }) {
        let e = r.unwrap_err().to_string();
        assert!(e.contains("second communicator"), "{e}");
    }
}

#[test]
fn low_latency_graph_matches_the_reference_and_replays() {
    use moeflow::backend::cuda::CudaMoeLayer;
    let Some(Gpus { n, _serial }) = gpus("low_latency_graph_matches_the_reference_and_replays") else { return };
    let devices: Vec<usize> = (0..n).collect();
    const M: usize = 64;
    for (name, config, weights, (placed, placement, min_rows)) in device_cases()
        .into_iter()
        .flat_map(|(name, c, w)| placements(c.num_experts, n).into_iter().map(move |p| (name, c.clone(), w.clone(), p)))
    {
        let h = config.hidden;
        let opts = moeflow::backend::cuda::CudaOptions { replica_min_rows: min_rows, ..Default::default() };
        // Two batches per rank under one captured graph: uneven, empty, and full to capacity.
        let sizes: [Vec<usize>; 2] =
            [(0..n).map(|r| [37, 0, 5, M][r % 4]).collect(), (0..n).map(|r| [M, 3, 0, 20][r % 4]).collect()];
        let inputs: Vec<Vec<Vec<f32>>> = (0..2)
            .map(|i| (0..n).map(|r| preset::uniform(sizes[i][r] * h, 1.0, 70 + 10 * i as u64 + r as u64)).collect())
            .collect();
        let results = run_ranks_nccl(&devices, Duration::from_secs(60), |c| {
            let layer =
                CudaMoeLayer::new_ep(&config, &weights, c.duplicate()?, placement.clone(), &opts)?.low_latency(M)?;
            let run = |i: usize| -> moeflow::Result<Vec<f32>> {
                let x = &inputs[i][c.rank()];
                Ok(layer.forward(&Tensor::from_f32(&[x.len() / h, h], x.clone())?)?.to_f32_vec())
            };
            // Capture (after one direct run) and replay; replay again; a new batch.
            let (first, again, second) = (run(0)?, run(0)?, run(1)?);
            // The stages timed inside the graph (its capture with clock stamps), then the plain
            // graph again: the same bits.
            let stages = layer.forward_timed_stages(M / 2, 9)?;
            let whole = layer.forward_timed(M / 2, 9)?.total;
            let after_stamps = run(0)?;
            // Above capacity: an error on every rank before any communication.
            let over = Tensor::from_f32(&[M + 1, h], vec![0.5; (M + 1) * h])?;
            let e = layer.forward(&over).expect_err("a batch above capacity fails").to_string();
            assert!(e.contains("exceeds the low-latency capacity"), "{e}");
            Ok((first, again, second, after_stamps, stages, whole))
        });
        for (rank, r) in results.into_iter().enumerate() {
            let (first, again, second, after_stamps, stages, whole) =
                r.unwrap_or_else(|e| panic!("{name}, {placed}: rank {rank}: {e}"));
            assert!(
                first.iter().zip(&again).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{name}, {placed}: rank {rank} differs replay to replay"
            );
            assert_eq!(bits(&after_stamps), bits(&first), "{name}, {placed}: rank {rank}: after the stamped graph");
            let s = &stages;
            let parts = [s.route, s.permute, s.dispatch, s.gemm1, s.act, s.gemm2, s.collect, s.combine, s.shared];
            assert!((parts.iter().sum::<f64>() - s.total).abs() < 1e-6, "{name}: stages {parts:?} against {}", s.total);
            assert!(s.dispatch > 0.0 && s.collect > 0.0 && s.total > 0.0, "{name}: stages {parts:?}");
            assert!(s.total < 4.0 * whole + 0.05, "{name}: stamped {} ms against a replay's {whole} ms", s.total);
            assert_eq!(s.strategy, "lowlatency", "{name}: rank {rank}");
            eprintln!(
                "  inside the graph, rank {rank}: dispatch {:.1} µs, collect {:.1} µs, whole {:.1} µs (replay {:.1} µs)",
                1e3 * s.dispatch,
                1e3 * s.collect,
                1e3 * s.total,
                1e3 * whole
            );
            for (i, got) in [first, second].iter().enumerate() {
                let err = relative_error(&config, &weights, &inputs[i][rank], got);
                assert!(err <= BF16_TOL, "{name}, {placed}: rank {rank}, batch {i}: relative error {err:e}");
                eprintln!(
                    "low-latency graph, {name:<30} {placed:<20} rank {rank}, batch {i}: {} tokens, relative error {err:.2e}",
                    sizes[i][rank]
                );
            }
        }
    }
}

/// W8A8 experts on expert-parallel ranks (all-to-all-v) multiply on the fp8 tensor cores over
/// the received rows' codes (at EP 2 about 150 rows an expert, which the experts copy in
/// expert order before the up projection): against the reference on the quantized weights
/// within fp8 rows' bound, uneven and empty ranks, a hidden size that is not a multiple of the
/// 128-deep scale blocks (so a row's scales are not a whole number of 16-byte words). Over
/// NVLink the dispatch is planned on the device and the rows cross as fp8 codes: NCCL's bits,
/// run after run. Then with the shared expert in fp8 too, whose fp8 GEMM runs on the SMs the
/// transport leaves (`HopperFp8Gemm::leaving`), against the reference on the quantized shared
/// weights as well. Skips on GPUs other than Hopper, saying so.
#[test]
fn expert_parallel_w8a8_on_the_fp8_tensor_cores_matches_the_reference() {
    use moeflow::backend::cuda::{CudaMoeLayer, CudaOptions, Transport};
    use moeflow::quant::WeightQuant;
    let name = "expert_parallel_w8a8_on_the_fp8_tensor_cores_matches_the_reference";
    let Some(Gpus { n, _serial }) = gpus(name) else { return };
    let devices: Vec<usize> = (0..n).collect();
    let softmax = RouterConfig::Softmax { renormalize: true };
    // (hidden, the shared expert's intermediate size, whether it runs in fp8, seed)
    for (hidden, shared_inter, fp8_shared, seed) in [(272, 64, false, 45), (384, 256, true, 47)] {
        let shared = Some(SharedConfig { inter: shared_inter, gated: true });
        let config = small_config(hidden, 128, 4 * n, 3, softmax.clone(), Activation::Silu, shared);
        let weights = preset::random_weights(&config, DType::BF16, seed);
        let mut quantized = weights.clone();
        quantized.experts = weights.experts.quantized(WeightQuant::Fp8Block(128)).unwrap();
        if fp8_shared {
            let sh = quantized.shared.as_mut().unwrap();
            sh.mlp = sh.mlp.quantized(WeightQuant::Fp8Block(128)).unwrap();
        }
        let h = config.hidden;
        let sizes: Vec<usize> = (0..n).map(|r| [400, 0, 150, 37][r % 4]).collect();
        let inputs: Vec<Vec<f32>> =
            sizes.iter().enumerate().map(|(r, &t)| preset::uniform(t * h, 1.0, 2 * seed + r as u64)).collect();
        // Over NCCL the host plans the dispatch and the bf16 rows are quantized where they land;
        // over NVLink the device plans it and the rows cross as fp8 codes with their scales,
        // pushed for the tokens each rank serves or copied whole by the copy engines.
        let run = |transport: Transport, copy_engine_dispatch: Option<bool>| {
            let opts = CudaOptions { transport, copy_engine_dispatch, ..Default::default() };
            run_ranks_nccl(&devices, Duration::from_secs(60), |c| {
                let layer = CudaMoeLayer::new_ep(&config, &weights, c.duplicate()?, even(&config, n), &opts)?
                    .fp8_experts()?
                    .fp8_activations()?;
                let layer = if fp8_shared { layer.fp8_shared_expert()? } else { layer };
                if !layer.has_fp8_gemm() {
                    return Ok(None);
                }
                let x = &inputs[c.rank()];
                let xt = Tensor::from_f32(&[x.len() / h, h], x.clone())?;
                let (out, again) = (layer.forward(&xt)?.to_f32_vec(), layer.forward(&xt)?.to_f32_vec());
                let planned = layer.dispatch_planned_on_device();
                let gemms = (layer.forward_timed(200, 5)?.experts, layer.shared_expert_gemm());
                Ok(Some((out, again, gemms, layer.transport(), planned)))
            })
        };
        let shared_gemm = if fp8_shared { "hopper-fp8" } else { "cublas" };
        let nccl = run(Transport::Nccl, None);
        let nvlink = [false, true].map(|whole| run(Transport::NvLink, Some(whole)));
        let pairs = nvlink
            .into_iter()
            .zip(["rows served", "whole batches"])
            .flat_map(|(runs, how)| nccl.iter().zip(runs).enumerate().map(move |(rank, (a, b))| (rank, a, b, how)));
        for (rank, a, b, how) in pairs {
            let Some((want, _, _, _, _)) = a.as_ref().unwrap_or_else(|e| panic!("rank {rank}: NCCL: {e}")) else {
                eprintln!("SKIPPED {name}: not a Hopper GPU");
                return;
            };
            let (got, again, gemms, transport, planned) =
                b.unwrap_or_else(|e| panic!("rank {rank}: NVLink: {e}")).expect("the same GPUs");
            let what = format!("rank {rank}, fp8 shared expert {fp8_shared}, {how}");
            assert_eq!((gemms, transport, planned), (("hopper-fp8", Some(shared_gemm)), "nvlink", true), "{what}");
            assert!(bits(&got) == bits(want), "{what}: fp8 rows over NVLink differ from NCCL's");
            assert!(bits(&got) == bits(&again), "{what}: differs run to run");
            let err = relative_error(&config, &quantized, &inputs[rank], &got);
            assert!(err <= 8e-2, "{what}: relative error {err:e}");
            eprintln!(
                "expert-parallel W8A8 on the fp8 tensor cores, {what}: {} tokens, relative error {err:.2e}, NCCL's \
                 bits with fp8 rows over NVLink",
                sizes[rank]
            );
        }
    }
}

#[test]
fn low_latency_fp8_experts_match_the_reference() {
    use moeflow::backend::cuda::CudaMoeLayer;
    use moeflow::quant::WeightQuant;
    let Some(Gpus { n, _serial }) = gpus("low_latency_fp8_experts_match_the_reference") else { return };
    let devices: Vec<usize> = (0..n).collect();
    const M: usize = 48;
    let config = fp8_test_config(n);
    let weights = preset::random_weights(&config, DType::BF16, 44);
    let mut quantized = weights.clone();
    quantized.experts = weights.experts.quantized(WeightQuant::Fp8Block(128)).unwrap();
    let h = config.hidden;
    let sizes: Vec<usize> = (0..n).map(|r| [M, 0, 7, 30][r % 4]).collect();
    let inputs: Vec<Vec<f32>> =
        sizes.iter().enumerate().map(|(r, &t)| preset::uniform(t * h, 1.0, 90 + r as u64)).collect();
    // fp8 codes from the host, and fp8 codes made on the device from the bf16 weights: both
    // stand for the CPU's quantization of the weights.
    // Then with the GEMM rows quantized to fp8 too (W8A8), which adds fp8 noise: in the masked
    // GEMM, and (an intermediate size the fp8 Hopper GEMM takes, on Hopper) in that one.
    let mut wide = fp8_test_config(n);
    wide.inter = 128;
    let wide_weights = preset::random_weights(&wide, DType::BF16, 46);
    let mut wide_quantized = wide_weights.clone();
    wide_quantized.experts = wide_weights.experts.quantized(WeightQuant::Fp8Block(128)).unwrap();
    let narrow = (&config, &weights, &quantized);
    let cases = [(false, false, narrow), (true, false, narrow), (true, true, narrow)];
    for (on_device, rows8, (config, weights, quantized)) in
        cases.into_iter().chain([(true, true, (&wide, &wide_weights, &wide_quantized))])
    {
        // The intermediate size the fp8 Hopper GEMM takes also quantizes the activation in the
        // up projection's epilogue (padded rows left alone).
        let opts = moeflow::backend::cuda::CudaOptions { fp8_act_epilogue: config.inter == 128, ..Default::default() };
        let results = run_ranks_nccl(&devices, Duration::from_secs(60), |c| {
            // Quantized on the device after the low-latency setup, whose buffers then follow
            // the GEMM the layer runs (a bf16 layer's Hopper GEMM reads no padded rows, the
            // masked and fp8 GEMMs do); quantized on the host before it.
            let mut layer = if on_device {
                let bf16 = CudaMoeLayer::new_ep(config, weights, c.duplicate()?, even(config, n), &opts)?;
                bf16.low_latency(M)?.fp8_experts()?
            } else {
                CudaMoeLayer::new_ep(config, quantized, c.duplicate()?, even(config, n), &Default::default())?
            };
            assert!(layer.has_fp8_experts());
            if rows8 {
                layer = layer.fp8_activations()?;
            }
            let layer = if on_device { layer } else { layer.low_latency(M)? };
            let x = &inputs[c.rank()];
            let out = layer.forward(&Tensor::from_f32(&[x.len() / h, h], x.clone())?)?.to_f32_vec();
            let want = if rows8 && layer.has_fp8_gemm() && config.inter % 64 == 0 { "hopper-fp8" } else { "masked" };
            Ok((out, layer.forward_timed_stages(M, 3)?.experts, want))
        });
        for (rank, r) in results.into_iter().enumerate() {
            let (got, experts, want) = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            let what = format!("on device {on_device}, fp8 rows {rows8}, intermediate {}: rank {rank}", config.inter);
            assert_eq!(experts, want, "{what}");
            let err = relative_error(config, quantized, &inputs[rank], &got);
            let tol = if rows8 { 8e-2 } else { BF16_TOL };
            assert!(err <= tol, "{what}: relative error {err:e}");
            eprintln!(
                "low-latency fp8 experts (quantized on the {}{}, {experts}) rank {rank}: {} tokens, relative error {err:.2e}",
                if on_device { "GPU" } else { "host" },
                if rows8 { ", fp8 rows" } else { "" },
                sizes[rank]
            );
        }
    }
}

/// Tokens per DP group for a batch of `total` over `groups` groups: uneven (37 for the first,
/// none for the second, the rest shared by the others or given to the second when there are
/// two), and everything on the first group with the others empty.
fn splits(total: usize, groups: usize) -> Vec<Vec<usize>> {
    if groups == 1 {
        return vec![vec![total]];
    }
    let mut uneven = vec![0usize; groups];
    uneven[0] = 37;
    let rest = total - 37;
    if groups == 2 {
        uneven[1] = rest;
    } else {
        for (g, size) in uneven.iter_mut().enumerate().skip(2) {
            *size = rest / (groups - 2) + usize::from(g == groups - 1) * (rest % (groups - 2));
        }
    }
    let mut first = vec![0usize; groups];
    first[0] = total;
    vec![uneven, first]
}

/// The layouts the library's own layer choice (`ParallelConfig::rank_layer`) is tested on, on
/// `n` GPUs for `e` experts: all2allv over every placement of [`placements`] (an explicit one
/// through a JSON file), TP slicing, dual-batch overlap, and (unless `deterministic`) every
/// other strategy.
fn rank_layouts(n: usize, e: usize, deterministic: bool) -> Vec<(String, ParallelConfig)> {
    let all2allv = ParallelConfig::new(n, 1, StrategyKind::All2AllV);
    let mut out = Vec::new();
    // Each placement once, with the default rows for sharing replicas.
    for (name, placement, _) in placements(e, n).into_iter().filter(|p| p.2 == REPLICA_MIN_ROWS) {
        let slots: Vec<Vec<usize>> = (0..n).map(|r| placement.local_experts(r).to_vec()).collect();
        let file = std::env::temp_dir().join(format!("moeflow-nccl-{}-{e}-{name}.json", std::process::id()));
        let json = serde_json::json!({ "num_experts": e, "ranks": slots });
        std::fs::write(&file, json.to_string()).unwrap();
        out.push((
            format!("all2allv, {name}"),
            ParallelConfig { placement: PlacementKind::File(file), ..all2allv.clone() },
        ));
    }
    out.push((format!("all2allv, TP {n}"), ParallelConfig::new(n, n, StrategyKind::All2AllV)));
    out.push(("all2allv, dual-batch".into(), ParallelConfig { dual_batch: true, ..all2allv.clone() }));
    out.push((
        "all2allv, round-robin, replicas, dual-batch, TP 2".into(),
        ParallelConfig {
            placement: PlacementKind::RoundRobin,
            redundant: vec![1, 2],
            dual_batch: true,
            ..ParallelConfig::new(n, 2, StrategyKind::All2AllV)
        },
    ));
    if !deterministic {
        out.push(("auto, built-in table".into(), ParallelConfig::new(n, 1, StrategyKind::Auto)));
        out.push((
            "lowlatency, dual-batch".into(),
            ParallelConfig {
                dual_batch: true,
                max_tokens_per_rank: 400,
                ..ParallelConfig::new(n, 1, StrategyKind::LowLatency)
            },
        ));
        for s in
            [StrategyKind::AllGather, StrategyKind::AllGatherLogits, StrategyKind::Multicast, StrategyKind::LowLatency]
        {
            out.push((
                format!("{s}, round-robin, TP 2"),
                ParallelConfig {
                    placement: PlacementKind::RoundRobin,
                    max_tokens_per_rank: 400,
                    ..ParallelConfig::new(n, 2, s)
                },
            ));
        }
    }
    out
}

/// A rank's first token, output rows and layer description.
type RankRun = (usize, Vec<f32>, String);

/// Runs `x` (`[total, H]`) split by `sizes` over the DP groups of `par` through the layer the
/// library picks on each GPU rank; returns each rank's run.
fn run_rank_layers(
    par: &ParallelConfig,
    spec: &moeflow::RankLayerSpec<'_>,
    x: &[f32],
    sizes: &[usize],
) -> Vec<(usize, moeflow::Result<RankRun>)> {
    let h = spec.config.hidden;
    let starts: Vec<usize> = sizes.iter().scan(0, |a, &s| Some(std::mem::replace(a, *a + s))).collect();
    on_ranks(&RankHost::Gpus, par.ep, Duration::from_secs(60), |comm, kind| {
        let layer = par.rank_layer(Some(comm), kind, spec)?;
        let g = comm.rank() / par.tp;
        let (a, t) = (starts[g], sizes[g]);
        let xt = Tensor::from_f32(&[t, h], x[a * h..(a + t) * h].to_vec())?;
        let out = layer.forward(&xt)?.to_f32_vec();
        Ok((a, out, layer.describe().to_string()))
    })
}

/// The library's layer choice on GPU ranks: every layout runs device-resident, says so, and
/// matches the f64 reference.
#[test]
fn rank_layers_on_gpus_are_device_resident_and_match_the_reference() {
    let Some(Gpus { n, _serial }) = gpus("rank_layers_on_gpus_are_device_resident_and_match_the_reference") else {
        return;
    };
    for (name, config, weights) in device_cases() {
        let h = config.hidden;
        let total = 342;
        let x = preset::uniform(total * h, 1.0, 77);
        let spec = moeflow::RankLayerSpec::new(&config, &weights);
        for (label, par) in rank_layouts(n, config.num_experts, false) {
            for sizes in splits(total, n / par.tp) {
                for (rank, r) in run_rank_layers(&par, &spec, &x, &sizes) {
                    let (a, got, path) = r.unwrap_or_else(|e| panic!("{name}, {label}: rank {rank}: {e}"));
                    assert!(path.starts_with("cuda: device-resident"), "{label}: {path}");
                    assert!(path.contains(&format!("→ {}", par.strategy)), "{label}: {path}");
                    let t = got.len() / h;
                    if t == 0 {
                        continue;
                    }
                    let err = relative_error(&config, &weights, &x[a * h..(a + t) * h], &got);
                    assert!(err <= BF16_TOL, "{name}, {label}, {sizes:?}: rank {rank}: relative error {err:e}");
                    eprintln!("rank layer {label:<48} {name:<30} rank {rank}: {t} tokens, relative error {err:.2e}");
                }
            }
        }
    }
}

/// Deterministic mode: every layout and every way of splitting the batch gives each token the
/// bits one GPU gives it, and one GPU gives a token the same bits alone and in any batch. The
/// strategies that sum partial outputs across ranks refuse the mode by name.
#[test]
fn deterministic_mode_gives_one_gpus_bits_whatever_the_layout() {
    use moeflow::backend::cuda::{CudaMoeLayer, CudaOptions};
    let Some(Gpus { n, _serial }) = gpus("deterministic_mode_gives_one_gpus_bits_whatever_the_layout") else { return };
    let det = CudaOptions { deterministic: true, ..Default::default() };
    for (name, config, weights) in device_cases().into_iter().chain([tensor_core_router_case()]) {
        let h = config.hidden;
        let total = 342;
        let x = preset::uniform(total * h, 1.0, 78);
        let one = CudaMoeLayer::new(&config, &weights, &det).unwrap();
        let want = bits(&one.forward(&Tensor::from_f32(&[total, h], x.clone()).unwrap()).unwrap().to_f32_vec());
        let err = relative_error(&config, &weights, &x, &want.iter().map(|&b| f32::from_bits(b)).collect::<Vec<_>>());
        assert!(err <= BF16_TOL, "{name}: one GPU: relative error {err:e}");
        // Batch invariance: tokens alone, in small batches (CUDA graphs) and in odd slices.
        for (a, t) in [(0, 1), (5, 1), (341, 1), (3, 4), (100, 16), (7, 200)] {
            let xt = Tensor::from_f32(&[t, h], x[a * h..(a + t) * h].to_vec()).unwrap();
            let got = bits(&one.forward(&xt).unwrap().to_f32_vec());
            assert!(got == want[a * h..(a + t) * h], "{name}: tokens {a}..{} alone differ from the batch", a + t);
        }
        drop(one);
        let spec = moeflow::RankLayerSpec { cuda: det.clone(), ..moeflow::RankLayerSpec::new(&config, &weights) };
        for (label, par) in rank_layouts(n, config.num_experts, true) {
            for sizes in splits(total, n / par.tp) {
                for (rank, r) in run_rank_layers(&par, &spec, &x, &sizes) {
                    let (a, got, path) = r.unwrap_or_else(|e| panic!("{name}, {label}: rank {rank}: {e}"));
                    assert!(path.contains("deterministic"), "{label}: {path}");
                    let t = got.len() / h;
                    assert!(
                        bits(&got) == want[a * h..(a + t) * h],
                        "{name}, {label}, {sizes:?}: rank {rank} differs from one GPU"
                    );
                }
                eprintln!("deterministic {label:<48} {name:<30} {sizes:?}: every rank has one GPU's bits");
            }
        }
    }
    // The gathering and low-latency strategies refuse the mode before any communication.
    let (_, config, weights) = device_cases().remove(0);
    let spec = moeflow::RankLayerSpec { cuda: det, ..moeflow::RankLayerSpec::new(&config, &weights) };
    for s in [StrategyKind::AllGather, StrategyKind::Multicast, StrategyKind::LowLatency] {
        let par = ParallelConfig::new(n, 1, s);
        for (rank, r) in on_ranks(&RankHost::Gpus, n, Duration::from_secs(30), |comm, kind| {
            par.rank_layer(Some(comm), kind, &spec).map(|_| ())
        }) {
            let e = r.expect_err("deterministic mode refuses partial sums").to_string();
            assert!(e.contains("deterministic mode dispatches by all-to-all-v"), "{s}: rank {rank}: {e}");
        }
    }
}

/// `--strategy auto`: each batch runs the strategy of the table's row for the largest batch of
/// any rank (so every rank agrees), matches the reference, and says which ran.
#[test]
fn auto_picks_the_tables_strategy_per_batch() {
    use moeflow::auto_strategy::{AutoRow, AutoStrategy};
    let Some(Gpus { n, _serial }) = gpus("auto_picks_the_tables_strategy_per_batch") else { return };
    let row = |up_to_tokens, s: &str| AutoRow { up_to_tokens, strategy: s.into() };
    let table = AutoStrategy {
        measured_on: "test".into(),
        rows: vec![row(Some(8), "multicast"), row(Some(64), "allgather-logits"), row(None, "all2allv")],
    };
    let (name, config, weights) = device_cases().into_iter().next().unwrap();
    let h = config.hidden;
    let par = ParallelConfig { auto: Some(table), ..ParallelConfig::new(n, 1, StrategyKind::Auto) };
    let spec = moeflow::RankLayerSpec::new(&config, &weights);
    // (tokens on rank 0, on the others, the strategy the largest picks)
    let cases = [(3, 8, "multicast"), (0, 9, "allgather-logits"), (64, 1, "allgather-logits"), (65, 0, "all2allv")];
    let x = preset::uniform(200 * h, 1.0, 79);
    let runs = on_ranks(&RankHost::Gpus, n, Duration::from_secs(60), |comm, kind| {
        let layer = par.rank_layer(Some(comm), kind, &spec)?;
        let mut seen = Vec::new();
        for &(t0, t1, _) in &cases {
            let t = if comm.rank() == 0 { t0 } else { t1 };
            let xt = Tensor::from_f32(&[t, h], x[..t * h].to_vec())?;
            let out = layer.forward(&xt)?.to_f32_vec();
            let ran = layer.device_layer().expect("device-resident").forward_timed_stages(t, 5)?.strategy;
            seen.push((out, ran));
        }
        Ok(seen)
    });
    for (rank, r) in runs {
        let seen = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        for (&(t0, t1, want), (out, ran)) in cases.iter().zip(seen) {
            assert_eq!(ran, want, "{name}: rank {rank}, batches {t0} and {t1}");
            let t = out.len() / h;
            if t > 0 {
                let err = relative_error(&config, &weights, &x[..t * h], &out);
                assert!(err <= BF16_TOL, "{name}: rank {rank}, {want}: relative error {err:e}");
            }
        }
        eprintln!("auto on rank {rank}: every batch ran its row's strategy and matches the reference");
    }
}

/// The NVLink transport moves exactly what NCCL moves: every case and placement, uneven and
/// empty ranks, all-to-all-v planned on the device and on the host, deterministic mode (both
/// plans) and the low-latency graph give NCCL's bits, run after run, and the layer says it
/// took NVLink and which plan; the device plan with the rows each rank serves pushed, and with
/// whole batches copied by the copy engines. The device plan's bounds differ from the host's
/// counts, so its mode pins the Hopper GEMM's tiles on both sides (the tile shape may change a
/// sum's order).
#[test]
fn nvlink_transport_gives_nccls_bits() {
    use moeflow::backend::cuda::{CudaMoeLayer, CudaOptions, Transport};
    let Some(Gpus { n, _serial }) = gpus("nvlink_transport_gives_nccls_bits") else { return };
    let devices: Vec<usize> = (0..n).collect();
    const M: usize = 64;
    for (name, config, weights, (placed, placement, replica_min_rows)) in device_cases()
        .into_iter()
        .flat_map(|(name, c, w)| placements(c.num_experts, n).into_iter().map(move |p| (name, c.clone(), w.clone(), p)))
    {
        let h = config.hidden;
        let sizes: Vec<usize> = (0..n).map(|r| [37, 0, 5, M][r % 4]).collect();
        let inputs: Vec<Vec<f32>> =
            sizes.iter().enumerate().map(|(r, &t)| preset::uniform(t * h, 1.0, 90 + r as u64)).collect();
        // (mode, deterministic, low latency, device plan, whole batches by the copy engines)
        let modes = [
            ("device plan, rows served", false, false, true, Some(false)),
            ("device plan, whole batches", false, false, true, Some(true)),
            ("host plan", false, false, false, None),
            ("deterministic", true, false, false, None),
            ("deterministic, device plan, rows served", true, false, true, Some(false)),
            ("deterministic, device plan, whole batches", true, false, true, Some(true)),
            ("low-latency graph", false, true, false, None),
        ];
        for (mode, deterministic, low_latency, device_plan, copy_engine_dispatch) in modes {
            let run = |transport: Transport| {
                let mut opts = CudaOptions {
                    deterministic,
                    transport,
                    replica_min_rows,
                    device_plan,
                    copy_engine_dispatch,
                    ..Default::default()
                };
                if device_plan {
                    opts = CudaOptions { expert_gemm: ExpertGemm::Hopper, ..pinned_tiles(opts) };
                }
                run_ranks_nccl(&devices, Duration::from_secs(60), |c| {
                    let mut layer = CudaMoeLayer::new_ep(&config, &weights, c.duplicate()?, placement.clone(), &opts)?;
                    if low_latency {
                        layer = layer.low_latency(M)?;
                    }
                    let x = &inputs[c.rank()];
                    let xt = Tensor::from_f32(&[x.len() / h, h], x.clone())?;
                    let first = layer.forward(&xt)?.to_f32_vec();
                    let again = layer.forward(&xt)?.to_f32_vec();
                    Ok((first, again, layer.transport(), layer.dispatch_planned_on_device()))
                })
            };
            let (nccl, nvlink) = (run(Transport::Nccl), run(Transport::NvLink));
            for (rank, (a, b)) in nccl.into_iter().zip(nvlink).enumerate() {
                let what = format!("{mode}, {name}, {placed}: rank {rank}");
                let (want, _, t0, p0) = a.unwrap_or_else(|e| panic!("{what}: NCCL: {e}"));
                let (got, again, t1, p1) = b.unwrap_or_else(|e| panic!("{what}: NVLink: {e}"));
                assert_eq!((t0, t1), ("nccl", "nvlink"), "{what}");
                assert_eq!((p0, p1), (false, device_plan), "{what}: which plan ran (NCCL, NVLink)");
                assert!(bits(&got) == bits(&want), "{what}: NVLink differs from NCCL");
                assert!(bits(&got) == bits(&again), "{what}: NVLink differs run to run");
                let err = relative_error(&config, &weights, &inputs[rank], &got);
                assert!(err <= BF16_TOL, "{what}: relative error {err:e}");
            }
            eprintln!("nvlink {mode:<18} {name:<30} {placed:<20} {sizes:?}: NCCL's bits on every rank");
        }
    }
}

/// `opts` with the Hopper GEMM's tile shape fixed (128 rows, 256 columns) instead of chosen
/// per batch.
fn pinned_tiles(opts: moeflow::backend::cuda::CudaOptions) -> moeflow::backend::cuda::CudaOptions {
    moeflow::backend::cuda::CudaOptions { gemm_tile_rows: Some(128), gemm_tile_cols: Some(256), ..opts }
}

/// A peer that stops answering in the middle of the NVLink transport's exchanges: the rank
/// waiting for its rows fails within the deadline with an error naming the peer or the
/// deadline, and the late peer fails too instead of waiting; in the low-latency graph and in
/// all-to-all-v planned on the device.
#[test]
fn nvlink_transport_reports_a_stalled_peer() {
    use moeflow::backend::cuda::{CudaMoeLayer, CudaOptions, Transport};
    let Some(Gpus { n, _serial }) = gpus("nvlink_transport_reports_a_stalled_peer") else { return };
    let devices: Vec<usize> = (0..n).collect();
    let (_, config, weights) = device_cases().remove(0);
    let h = config.hidden;
    let opts = CudaOptions { transport: Transport::NvLink, expert_gemm: ExpertGemm::Hopper, ..Default::default() };
    let deadline = Duration::from_secs(3);
    for low_latency in [true, false] {
        let results = run_ranks_nccl(&devices, deadline, |c| {
            let mut layer = CudaMoeLayer::new_ep(&config, &weights, c.duplicate()?, even(&config, n), &opts)?;
            if low_latency {
                layer = layer.low_latency(16)?;
            }
            let x = Tensor::from_f32(&[8, h], preset::uniform(8 * h, 1.0, 5))?;
            layer.forward(&x)?;
            let planned = layer.dispatch_planned_on_device();
            if c.rank() == 1 {
                std::thread::sleep(2 * deadline);
            }
            let start = std::time::Instant::now();
            let r = layer.forward(&x).map(|_| ());
            Ok((r.map_err(|e| e.to_string()), start.elapsed(), planned))
        });
        for (rank, r) in results.into_iter().enumerate() {
            let (r, took, planned) = r.unwrap_or_else(|e| panic!("rank {rank} failed before the stall: {e}"));
            assert_eq!(planned, !low_latency, "rank {rank}: the device plan ran");
            let e = r.expect_err("an exchange with a stalled peer fails");
            assert!(took < 2 * deadline, "rank {rank} took {took:?} to fail: {e}");
            if rank == 0 {
                assert!(e.contains("rank 1") || e.contains("timed out"), "rank 0: {e}");
            }
            eprintln!("stalled peer (low-latency {low_latency}): rank {rank} failed after {took:?}: {e}");
        }
    }
}

/// The link's ceilings that `bench` prints: a plain copy and the NVLink transport's push kernel
/// (64 SMs) from GPU 0 into GPU 1, one way and with GPU 1 sending into GPU 0 at the same time,
/// each measure a rate, and every rate stays within what the one-way copy shows the link
/// carries.
#[test]
fn peer_copy_and_push_measure_the_link() {
    use moeflow::backend::cuda::{measure_peer_both_ways, measure_peer_copy, measure_peer_push};
    let Some(Gpus { _serial, .. }) = gpus("peer_copy_and_push_measure_the_link") else { return };
    let copy = measure_peer_copy(0, 1).expect("the peer copy");
    let push = measure_peer_push(0, 1, 64).expect("the push kernel");
    let copy_both = measure_peer_both_ways(0, 1, None).expect("the peer copy both ways");
    let push_both = measure_peer_both_ways(0, 1, Some(64)).expect("the push kernel both ways");
    assert!(copy.is_finite() && copy > 0.0, "peer copy: {copy} GB/s");
    for (what, rate) in
        [("push kernel", push), ("peer copy both ways", copy_both), ("push kernel both ways", push_both)]
    {
        assert!(rate.is_finite() && rate > 0.0 && rate < 1.5 * copy, "{what}: {rate} GB/s, peer copy {copy}");
    }
    eprintln!(
        "peer copy {copy:.0} GB/s, push kernel on 64 SMs {push:.0} GB/s; both ways at once, each way: copy \
         {copy_both:.0} GB/s, push {push_both:.0} GB/s"
    );
}

/// The timed forward counts the experts a rank served (the weight-read floor of `bench` under
/// expert parallelism): one token a rank reaches at most every rank's slots' worth of them, 300
/// tokens a rank all of them, in the throughput layer and in the low-latency graph.
#[test]
fn timed_forward_counts_the_experts_a_rank_served() {
    use moeflow::backend::cuda::CudaMoeLayer;
    let Some(Gpus { n, _serial }) = gpus("timed_forward_counts_the_experts_a_rank_served") else { return };
    let devices: Vec<usize> = (0..n).collect();
    let (_, config, weights) = device_cases().remove(2);
    let (local, k) = (config.num_experts / n, config.top_k);
    for low_latency in [false, true] {
        let served = run_ranks_nccl(&devices, Duration::from_secs(60), |c| {
            let opts = Default::default();
            let mut layer = CudaMoeLayer::new_ep(&config, &weights, c.duplicate()?, even(&config, n), &opts)?;
            if low_latency {
                layer = layer.low_latency(300)?;
            }
            let one = layer.forward_timed_stages(1, 7)?.experts_used;
            Ok((one, layer.forward_timed_stages(300, 8)?.experts_used))
        });
        for (rank, r) in served.into_iter().enumerate() {
            let (one, many) = r.unwrap_or_else(|e| panic!("low-latency {low_latency}: rank {rank}: {e}"));
            assert!(one <= (n * k).min(local), "low-latency {low_latency}: rank {rank}: one token a rank, {one}");
            assert_eq!(many, local, "low-latency {low_latency}: rank {rank}: 300 tokens a rank");
            eprintln!("low-latency {low_latency}: rank {rank} served {one} experts at 1 token, {many} at 300");
        }
    }
}

/// The NVLink window grows with the batch: one layer takes batches that need larger regions
/// (every rank reopens its window at once) and a smaller one after, in default and
/// deterministic mode and, for the fixed-capacity windows, the low-latency graph, giving NCCL's
/// bits on every batch.
#[test]
fn nvlink_window_grows_with_the_batch() {
    use moeflow::backend::cuda::{CudaMoeLayer, CudaOptions, Transport};
    let Some(Gpus { n, _serial }) = gpus("nvlink_window_grows_with_the_batch") else { return };
    let devices: Vec<usize> = (0..n).collect();
    let (_, config, weights) = device_cases().remove(2);
    let h = config.hidden;
    const M: usize = 64;
    let batches: [Vec<usize>; 3] =
        [(0..n).map(|r| [3, 0][r % 2]).collect(), (0..n).map(|r| [300, 41][r % 2]).collect(), vec![M; n]];
    let inputs: Vec<Vec<Vec<f32>>> = batches
        .iter()
        .enumerate()
        .map(|(i, sizes)| {
            sizes
                .iter()
                .enumerate()
                .map(|(r, &t)| preset::uniform(t * h, 1.0, 200 + 10 * i as u64 + r as u64))
                .collect()
        })
        .collect();
    for (mode, deterministic, low_latency) in
        [("default", false, false), ("deterministic", true, false), ("low-latency", false, true)]
    {
        let run = |transport: Transport| {
            // Pinned tiles: the device plan's row bounds differ from the host plan's counts.
            let opts = pinned_tiles(CudaOptions {
                deterministic,
                transport,
                expert_gemm: ExpertGemm::Hopper,
                ..Default::default()
            });
            run_ranks_nccl(&devices, Duration::from_secs(60), |c| {
                let mut layer = CudaMoeLayer::new_ep(&config, &weights, c.duplicate()?, even(&config, n), &opts)?;
                if low_latency {
                    layer = layer.low_latency(M)?;
                }
                let order: &[usize] = if low_latency { &[0, 2, 0] } else { &[0, 1, 2, 0] };
                order
                    .iter()
                    .map(|&i| {
                        let x = &inputs[i][c.rank()];
                        Ok(layer.forward(&Tensor::from_f32(&[x.len() / h, h], x.clone())?)?.to_f32_vec())
                    })
                    .collect::<moeflow::Result<Vec<_>>>()
            })
        };
        for (rank, (a, b)) in run(Transport::Nccl).into_iter().zip(run(Transport::NvLink)).enumerate() {
            let (want, got) = (a.unwrap(), b.unwrap_or_else(|e| panic!("{mode}: rank {rank}: NVLink: {e}")));
            let bits = |v: &Vec<Vec<f32>>| {
                v.iter().map(|b| b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()).collect::<Vec<_>>()
            };
            assert!(bits(&got) == bits(&want), "{mode}: rank {rank}: NVLink differs from NCCL on a batch");
        }
        eprintln!("nvlink window, {mode}: NCCL's bits on every batch, growing and shrinking");
    }
}

/// A call of a layer on device memory: `forward_device` or `forward_device_bf16`.
type DeviceCall = fn(&moeflow::backend::cuda::CudaMoeLayer, u64, u64, usize, u64) -> moeflow::Result<()>;

/// `layer` on `x [t, H]` through device memory: `call` on a stream of GPU `device` (the
/// layer's), with values of `x`'s type in and out, the output read back.
fn through_device_as<T>(
    layer: &moeflow::backend::cuda::CudaMoeLayer,
    call: DeviceCall,
    x: &[T],
    t: usize,
    device: usize,
) -> moeflow::Result<Vec<T>>
where
    T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Default + Copy,
{
    use cudarc::driver::{CudaContext, DevicePtr};
    let cuda = |e: cudarc::driver::DriverError| moeflow::MoeError::Unsupported(format!("test buffers: {e:?}"));
    let stream = CudaContext::new(device).map_err(cuda)?.new_stream().map_err(cuda)?;
    let h = layer.config().hidden;
    let mut input = vec![T::default(); (t * h).max(1)];
    input[..t * h].copy_from_slice(x);
    let xd = stream.clone_htod(&input).map_err(cuda)?;
    let out = stream.alloc_zeros::<T>((t * h).max(1)).map_err(cuda)?;
    {
        let (xp, _x) = xd.device_ptr(&stream);
        let (op, _o) = out.device_ptr(&stream);
        call(layer, xp, op, t, stream.cu_stream() as u64)?;
    }
    let mut got = stream.clone_dtoh(&out).map_err(cuda)?;
    got.truncate(t * h);
    Ok(got)
}

/// `layer` on `x [t, H]` through [`CudaMoeLayer::forward_device`] (see [`through_device_as`]).
fn through_device(
    layer: &moeflow::backend::cuda::CudaMoeLayer,
    x: &[f32],
    t: usize,
    device: usize,
) -> moeflow::Result<Vec<f32>> {
    through_device_as(layer, moeflow::backend::cuda::CudaMoeLayer::forward_device, x, t, device)
}

/// All-to-all-v planned on the device, sending whole batches by the copy engines: the rows of
/// bf16 hidden states leave beside the routing (the layer says so), those of f32 ones after
/// it, and the bf16 call gives the f32 call's output on the same values rounded to bf16, bit
/// for bit, call after call, with uneven and empty batches. The gate holds bf16 values, so the
/// router reads the bf16 rows as they are (and they are in place before it runs).
#[test]
fn whole_batches_beside_the_routing_give_the_bits_after_it() {
    use moeflow::backend::cuda::{CudaMoeLayer, CudaOptions, Transport};
    let name = "whole_batches_beside_the_routing_give_the_bits_after_it";
    let Some(Gpus { n, _serial }) = gpus(name) else { return };
    let devices: Vec<usize> = (0..n).collect();
    // DeepSeek's grouped router and ungated shared expert, with experts enough (64) for the
    // router's tensor-core kernel, which reads bf16 tokens as they are.
    let grouped = RouterConfig::SigmoidGrouped { n_group: 4, topk_group: 2, renormalize: true, scaling: 2.5 };
    let shared = Some(SharedConfig { inter: 48, gated: false });
    let config = small_config(136, 80, 64, 6, grouped, Activation::Silu, shared);
    let mut weights = preset::random_weights(&config, DType::BF16, 35);
    let gate: Vec<f32> = weights.gate.to_f32_vec().iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
    weights.gate = Tensor::from_f32(weights.gate.shape(), gate).unwrap();
    let (case, h) = ("64 experts, top-6", config.hidden);
    let whole = CudaOptions {
        expert_gemm: ExpertGemm::Hopper,
        transport: Transport::NvLink,
        copy_engine_dispatch: Some(true),
        ..Default::default()
    };
    let opts = pinned_tiles(whole);
    for shift in [0, 3] {
        let sizes: Vec<usize> = (0..n).map(|r| [37, 0, 5, 64][(r + shift) % 4]).collect();
        let inputs: Vec<Vec<f32>> = sizes
            .iter()
            .enumerate()
            .map(|(r, &t)| {
                preset::uniform(t * h, 1.0, 70 + r as u64).iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect()
            })
            .collect();
        let runs = run_ranks_nccl(&devices, Duration::from_secs(60), |c| {
            let layer = CudaMoeLayer::new_ep(&config, &weights, c.duplicate()?, even(&config, n), &opts)?;
            let (rank, t) = (c.rank(), sizes[c.rank()]);
            let paths = |l: &CudaMoeLayer| (l.dispatch_planned_on_device(), l.dispatch_rows_beside_routing());
            let after = through_device(&layer, &inputs[rank], t, devices[rank])?;
            let after_paths = paths(&layer);
            let bf16: Vec<u16> = inputs[rank].iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
            let call = CudaMoeLayer::forward_device_bf16;
            let beside = through_device_as(&layer, call, &bf16, t, devices[rank])?;
            let beside_paths = paths(&layer);
            let again = through_device_as(&layer, call, &bf16, t, devices[rank])?;
            Ok((after, after_paths, beside, beside_paths, again))
        });
        for (rank, r) in runs.into_iter().enumerate() {
            let what = format!("{case}, {sizes:?}: rank {rank}");
            let (after, after_paths, beside, beside_paths, again) = r.unwrap_or_else(|e| panic!("{what}: {e}"));
            let t = sizes[rank];
            assert_eq!(after_paths, (true, false), "{what}: f32 rows (device plan, beside the routing)");
            assert_eq!(beside_paths, (true, t > 0), "{what}: bf16 rows (device plan, beside the routing)");
            let want: Vec<u16> = after.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
            assert!(t == 0 || want.iter().any(|&v| v != 0), "{what}: wrote its output");
            if let Some(i) = (0..t * h).find(|&i| beside[i] != want[i]) {
                panic!("{what}: output {i} is {:#06x} beside the routing, {:#06x} after it", beside[i], want[i]);
            }
            assert!(again == beside, "{what}: differs call to call");
        }
        eprintln!("{name}: {sizes:?}: rows beside the routing give the bits of rows after it on every rank");
    }
}

/// bf16 hidden states on expert-parallel ranks (all-to-all-v over the default transport, and
/// the low-latency layer), whose calls on device memory wait for the GPU: each rank's
/// `forward_device_bf16` gives its f32 call's output on the same values rounded to bf16, bit
/// for bit, with uneven and empty batches. The gate holds bf16 values, as checkpoints do, so on
/// Hopper the all-to-all-v router of a layer with enough experts to route on the tensor cores
/// reads the bf16 rows as they are, also in deterministic mode (its fixed blocks of columns).
#[test]
fn expert_parallel_bf16_hidden_states_give_the_rounded_bits_of_f32_ones() {
    use moeflow::backend::cuda::CudaOptions;
    let name = "expert_parallel_bf16_hidden_states_give_the_rounded_bits_of_f32_ones";
    let Some(Gpus { n, _serial }) = gpus(name) else { return };
    let det = CudaOptions { deterministic: true, ..Default::default() };
    let (wide, wide_config, wide_weights) = tensor_core_router_case();
    let (case, config, weights) = device_cases().remove(2);
    let cases = [
        (case, config, weights, CudaOptions::default(), vec![StrategyKind::All2AllV, StrategyKind::LowLatency]),
        (wide, wide_config.clone(), wide_weights.clone(), CudaOptions::default(), vec![StrategyKind::All2AllV]),
        (wide, wide_config, wide_weights, det, vec![StrategyKind::All2AllV]),
    ];
    for (case, config, mut weights, cuda, strategies) in cases {
        let gate: Vec<f32> = weights.gate.to_f32_vec().iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
        weights.gate = Tensor::from_f32(weights.gate.shape(), gate).unwrap();
        let (h, total) = (config.hidden, 600);
        let x: Vec<f32> =
            preset::uniform(total * h, 1.0, 83).iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
        let spec = moeflow::RankLayerSpec { cuda: cuda.clone(), ..moeflow::RankLayerSpec::new(&config, &weights) };
        for s in strategies {
            let par = ParallelConfig { max_tokens_per_rank: total, ..ParallelConfig::new(n, 1, s) };
            for sizes in splits(total, n) {
                let starts: Vec<usize> = sizes.iter().scan(0, |a, &s| Some(std::mem::replace(a, *a + s))).collect();
                let runs = on_ranks(&RankHost::Gpus, n, Duration::from_secs(60), |comm, kind| {
                    let layer = par.rank_layer(Some(comm), kind, &spec)?;
                    let device = match kind {
                        moeflow::ExpertsKind::Cuda { device } => device,
                        _ => unreachable!("GPU ranks"),
                    };
                    let cuda = layer.device_layer().expect("an expert-parallel rank runs whole on the device");
                    let (a, t) = (starts[comm.rank()], sizes[comm.rank()]);
                    let rows = &x[a * h..(a + t) * h];
                    let bf16: Vec<u16> = rows.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
                    let call = moeflow::backend::cuda::CudaMoeLayer::forward_device_bf16;
                    Ok((t, through_device(cuda, rows, t, device)?, through_device_as(cuda, call, &bf16, t, device)?))
                });
                for (rank, r) in runs {
                    let (t, f32_out, bf16_out) =
                        r.unwrap_or_else(|e| panic!("{case}, {s}, {sizes:?}: rank {rank}: {e}"));
                    let want: Vec<u16> = f32_out.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
                    assert!(t == 0 || want.iter().any(|&v| v != 0), "{s}, {sizes:?}: rank {rank} wrote its output");
                    if let Some(i) = (0..t * h).find(|&i| bf16_out[i] != want[i]) {
                        panic!(
                        "{s}, {sizes:?}: rank {rank}: output {i} is {:#06x} from bf16 hidden states, {:#06x} rounded",
                        bf16_out[i], want[i]
                    );
                    }
                }
                eprintln!(
                    "{name}: {case}, {}, {s}, {sizes:?}: every rank's bf16 call gives its f32 call's bits, rounded",
                    cuda.describe()
                );
            }
        }
    }
}

/// TP slicing on the device (the library's layer choice for TP 2 without dual-batch): around
/// all2allv, lowlatency and auto, with batches not divisible by TP, smaller than TP and empty,
/// through `forward`, `forward_device` and the timed run. Every rank of a TP group returns its
/// group's whole batch, which matches the reference, repeats run to run and is the same through
/// device memory; bf16 hidden states (whose shares cross the all-gather as bf16) give the f32
/// call's output on the same values rounded to bf16, bit for bit. A low-latency rank takes a
/// batch above its capacity when its share fits, and every rank refuses one whose largest share
/// does not.
#[test]
fn tp_sliced_device_layers_take_any_batch() {
    let Some(Gpus { n, _serial }) = gpus("tp_sliced_device_layers_take_any_batch") else { return };
    // The capacity a rank's share of the largest batch fills exactly.
    const M: usize = 171;
    let batches = [7usize, 1, 0, 2 * M];
    for (name, config, weights) in device_cases() {
        let h = config.hidden;
        let x = preset::uniform((2 * M + 1) * h, 1.0, 81);
        let spec = moeflow::RankLayerSpec::new(&config, &weights);
        for s in [StrategyKind::All2AllV, StrategyKind::LowLatency, StrategyKind::Auto] {
            let par = ParallelConfig { max_tokens_per_rank: M, ..ParallelConfig::new(n, 2, s) };
            let runs = on_ranks(&RankHost::Gpus, n, Duration::from_secs(60), |comm, kind| {
                let layer = par.rank_layer(Some(comm), kind, &spec)?;
                let device = match kind {
                    moeflow::ExpertsKind::Cuda { device } => device,
                    _ => unreachable!("GPU ranks"),
                };
                let path = layer.describe().to_string();
                let cuda = layer.device_layer().expect("a TP-sliced layer runs whole on the device");
                let mut seen = Vec::new();
                for &t in &batches {
                    let xt = Tensor::from_f32(&[t, h], x[..t * h].to_vec())?;
                    let a = layer.forward(&xt)?.to_f32_vec();
                    let b = layer.forward(&xt)?.to_f32_vec();
                    let d = through_device(cuda, &x[..t * h], t, device)?;
                    let timed = cuda.forward_timed_stages(t, 9)?;
                    let rounded: Vec<f32> = x[..t * h].iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
                    let wide = through_device(cuda, &rounded, t, device)?;
                    let narrow: Vec<u16> = rounded.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
                    let call = moeflow::backend::cuda::CudaMoeLayer::forward_device_bf16;
                    let halves = through_device_as(cuda, call, &narrow, t, device)?;
                    let want: Vec<u16> = wide.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
                    seen.push((a, b, d, timed.strategy, layer.tokens_here(t), halves == want));
                }
                // One token more: the first TP rank's share exceeds the low-latency capacity.
                let over = Tensor::from_f32(&[2 * M + 1, h], x.clone())?;
                let refused = layer.forward(&over).err().map(|e| e.to_string());
                Ok((path, layer.tp_sliced(), seen, refused))
            });
            for (rank, r) in runs {
                let (path, sliced, seen, refused) = r.unwrap_or_else(|e| panic!("{name}, {s}: rank {rank}: {e}"));
                assert!(sliced && path.contains("TP slicing on the device"), "{s}: {path}");
                for (&t, (a, b, d, ran, here, rounded)) in batches.iter().zip(seen) {
                    let label = format!("{name}, {s}, {t} tokens: rank {rank}");
                    assert_eq!(a.len(), t * h, "{label}: the whole batch comes back");
                    assert_eq!(here, t / 2 + usize::from(rank % 2 < t % 2), "{label}: its TP share");
                    assert!(bits(&a) == bits(&b), "{label}: differs run to run");
                    assert!(bits(&a) == bits(&d), "{label}: forward_device differs from forward");
                    assert!(rounded, "{label}: the bf16 call differs from the f32 call's output rounded");
                    if s != StrategyKind::Auto {
                        assert_eq!(ran, s.name(), "{label}: the timed run's strategy");
                    }
                    if t > 0 {
                        let err = relative_error(&config, &weights, &x[..t * h], &a);
                        assert!(err <= BF16_TOL, "{label}: relative error {err:e}");
                        eprintln!("tp-sliced {label}: relative error {err:.2e}");
                    }
                }
                match (s, refused) {
                    (StrategyKind::LowLatency, Some(e)) => {
                        assert!(e.contains("exceeds the low-latency capacity of 171"), "rank {rank}: {e}")
                    }
                    (StrategyKind::LowLatency, None) => panic!("{name}: rank {rank} took a share above its capacity"),
                    (_, Some(e)) => panic!("{name}, {s}: rank {rank}: {e}"),
                    (_, None) => {}
                }
            }
        }
    }
}

/// Deterministic mode with TP slicing on the device: batches not divisible by TP and smaller
/// than TP give every rank one GPU's bits for its group's whole batch.
#[test]
fn tp_sliced_deterministic_layers_give_one_gpus_bits() {
    use moeflow::backend::cuda::{CudaMoeLayer, CudaOptions};
    let Some(Gpus { n, _serial }) = gpus("tp_sliced_deterministic_layers_give_one_gpus_bits") else { return };
    let det = CudaOptions { deterministic: true, ..Default::default() };
    for (name, config, weights) in device_cases() {
        let h = config.hidden;
        let x = preset::uniform(341 * h, 1.0, 82);
        let one = CudaMoeLayer::new(&config, &weights, &det).unwrap();
        let batches = [1usize, 7, 341];
        let want: Vec<Vec<u32>> = batches
            .iter()
            .map(|&t| {
                bits(&one.forward(&Tensor::from_f32(&[t, h], x[..t * h].to_vec()).unwrap()).unwrap().to_f32_vec())
            })
            .collect();
        drop(one);
        let spec = moeflow::RankLayerSpec { cuda: det.clone(), ..moeflow::RankLayerSpec::new(&config, &weights) };
        let par = ParallelConfig::new(n, 2, StrategyKind::All2AllV);
        let runs = on_ranks(&RankHost::Gpus, n, Duration::from_secs(60), |comm, kind| {
            let layer = par.rank_layer(Some(comm), kind, &spec)?;
            batches
                .iter()
                .map(|&t| Ok(layer.forward(&Tensor::from_f32(&[t, h], x[..t * h].to_vec())?)?.to_f32_vec()))
                .collect::<moeflow::Result<Vec<_>>>()
        });
        for (rank, r) in runs {
            let got = r.unwrap_or_else(|e| panic!("{name}: rank {rank}: {e}"));
            for ((t, got), want) in batches.iter().zip(got).zip(&want) {
                assert!(bits(&got) == *want, "{name}, {t} tokens: rank {rank} differs from one GPU");
            }
            eprintln!("tp-sliced deterministic {name}: rank {rank} has one GPU's bits for {batches:?} tokens");
        }
    }
}
