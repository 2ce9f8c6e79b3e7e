//! `moeflow eplb`: a placement with replicas of the busiest experts from a recorded load
//! (`run`/`bench --record-load`), minimising the busiest rank's load; prints the imbalance
//! before and after and writes the placement `--placement FILE` loads.

use crate::table::{num, right, Table};
use moeflow::eplb::{balance, imbalance, rank_loads, EplbConfig};
use moeflow::parallel::PlacementKind;
use moeflow::placement::ExpertPlacement;
use moeflow::{LoadRecord, MoeError, Result};
use std::path::PathBuf;

/// Arguments of `moeflow eplb`.
#[derive(clap::Args, Debug)]
pub struct EplbArgs {
    /// Load statistics written by `run` or `bench --record-load` (every rank's tokens per
    /// logical expert; their sum is balanced).
    #[arg(long)]
    load: PathBuf,
    /// Expert-parallel ranks of the placement.
    #[arg(long)]
    ep: usize,
    /// Nodes the ranks form (consecutive ranks): expert groups are packed onto nodes first and
    /// a group's replicas stay in its node.
    #[arg(long, default_value_t = 1)]
    nodes: usize,
    /// Contiguous expert groups kept within a node (default: the router's groups recorded in
    /// the load file, or the number of nodes when that does not divide among them).
    #[arg(long)]
    groups: Option<usize>,
    /// Replicas beyond one per expert, over all ranks.
    #[arg(long, default_value_t = 0)]
    redundant: usize,
    /// The placement to compare with: contiguous, round-robin or a JSON file.
    #[arg(long, default_value = "contiguous")]
    placement: PlacementKind,
    /// Where to write the placement (JSON, for `--placement FILE`).
    #[arg(long, short)]
    output: PathBuf,
}

/// `moeflow eplb`: reads the load, balances it, prints the per-rank loads and writes the file.
pub fn run(args: EplbArgs) -> Result<()> {
    let record = LoadRecord::read(&args.load)?;
    let load: Vec<f64> = record.totals().iter().map(|&c| c as f64).collect();
    let e = record.num_experts;
    let groups = args.groups.unwrap_or({
        let g = record.num_groups;
        if args.nodes > 1 && !(g.is_multiple_of(args.nodes) && e.is_multiple_of(g)) {
            args.nodes
        } else {
            g
        }
    });
    let cfg = EplbConfig { ranks: args.ep, nodes: args.nodes, redundant: args.redundant, groups };
    let after = balance(&load, cfg)?;
    let before = match &args.placement {
        PlacementKind::Contiguous => ExpertPlacement::contiguous(e, args.ep)?,
        PlacementKind::RoundRobin => ExpertPlacement::round_robin(e, args.ep)?,
        PlacementKind::File(p) => ExpertPlacement::from_json_file(p, e, args.ep)?,
    };
    if load.iter().sum::<f64>() <= 0.0 {
        return Err(MoeError::Config(format!("{}: no tokens were counted", args.load.display())));
    }
    let (lb, la) = (rank_loads(&before, &load), rank_loads(&after, &load));
    println!(
        "moeflow eplb: {e} experts, {} tokens·slots over {} ranks' calls; EP {}, {} nodes, {groups} groups, {} redundant",
        load.iter().sum::<f64>(),
        record.ranks.len(),
        args.ep,
        args.nodes,
        args.redundant
    );
    let table = Table::new(&[right("rank", 5), right("slots", 6), right("before", 12), right("after", 12)]);
    println!("{}", table.header());
    for r in 0..args.ep {
        let row = [r.to_string(), after.local_experts(r).len().to_string(), num(lb[r], 1), num(la[r], 1)];
        println!("{}", table.row(&row));
    }
    let max = |v: &[f64]| v.iter().fold(0.0f64, |m, &x| m.max(x));
    println!(
        "busiest rank: {:.1} -> {:.1} ({:+.1}%); imbalance (max / mean): {:.3} -> {:.3}",
        max(&lb),
        max(&la),
        100.0 * (max(&la) / max(&lb) - 1.0),
        imbalance(&lb),
        imbalance(&la)
    );
    after.write_json(&args.output)?;
    println!("wrote the placement ({}) to {}", after.describe(), args.output.display());
    Ok(())
}
