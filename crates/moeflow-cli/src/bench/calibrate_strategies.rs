//! `bench --backend cuda --ep N --calibrate FILE`: every strategy `--strategy auto` chooses among, timed on this
//! machine's GPUs at each `--tokens` count (the slowest rank's layer time, median of the
//! runs), and the fastest per count written as the crossover table `--strategy-table` reads.

use super::cuda::{time_rank, Timed};
use super::BenchArgs;
use crate::common::median;
use moeflow::auto_strategy::AutoStrategy;
use moeflow::parallel::{on_ranks, ParallelConfig, RankHost};
use moeflow::{MoeError, RankLayerSpec, Result};
use std::path::Path;

/// Times each candidate strategy, prints their times and the table, and writes it to `file`.
pub(super) fn calibrate(args: &BenchArgs, host: &RankHost, file: &Path) -> Result<()> {
    let (p, config) = args.layer.config()?;
    // Deterministic mode dispatches by all-to-all-v only: the table compares the default mode.
    let plain = crate::common::ParallelArgs { deterministic: false, ..args.parallel.clone() };
    let cuda = crate::cuda_args::cuda_options(&plain)?;
    let base = args.parallel.config(args.tokens.iter().copied().max().unwrap_or(1))?;
    let rank0 = host.launched_rank().is_none_or(|r| r == 0);
    let mut measured = Vec::new();
    let mut gpu = String::new();
    if rank0 {
        println!(
            "moeflow bench --calibrate: {} on {} GPUs, {} experts; slowest rank's layer ms (median)",
            p.name, base.ep, config.num_experts
        );
        println!("{:>18} {}", "strategy", args.tokens.iter().map(|t| format!("{t:>9}")).collect::<String>());
    }
    for strategy in AutoStrategy::CANDIDATES {
        let par = ParallelConfig { strategy, ..base.clone() };
        let results = on_ranks(host, par.ep, par.timeout, |comm, experts| {
            let spec =
                RankLayerSpec { cuda: cuda.clone(), ..RankLayerSpec::random_on_device(&config, args.layer.seed) };
            let layer = Timed(par.rank_layer(Some(comm), experts, &spec)?);
            let name = layer.0.device_layer().map(|l| l.device_name()).unwrap_or_default();
            Ok((time_rank(args, &layer, comm, &args.tokens, false)?, name))
        });
        let mut mine = None;
        for (_, r) in results {
            mine.get_or_insert(r?);
        }
        let (per_t, name) = mine.ok_or_else(|| MoeError::Config("no ranks".into()))?;
        gpu = name;
        let ms: Vec<f64> = per_t.iter().map(|(slowest, _)| median(slowest)).collect();
        if rank0 {
            println!("{:>18} {}", strategy.name(), ms.iter().map(|m| format!("{m:>9.3}")).collect::<String>());
        }
        measured.extend(args.tokens.iter().zip(ms).map(|(&t, m)| (t, strategy, m)));
    }
    let table = AutoStrategy::from_measurements(&format!("{} x {gpu}, {}", base.ep, p.name), &measured)?;
    if rank0 {
        std::fs::write(file, table.to_json() + "\n")
            .map_err(|e| MoeError::Config(format!("writing {}: {e}", file.display())))?;
        println!("auto: {}; wrote {}", table.describe(), file.display());
    }
    Ok(())
}
