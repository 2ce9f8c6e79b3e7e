//! Expert-parallel load balancing: a placement with replicas of the busiest experts that
//! minimises the busiest rank's load, in the manner of DeepSeek's EPLB.
//!
//! The load of a logical expert is its (token, slot) pairs (from [`crate::LoadRecord`]); a
//! replicated expert's tokens are shared by its replicas by [`ExpertPlacement::replica_for`]'s
//! rule, `(token + slot) mod replicas`, so each replica is expected to take an equal share and
//! the choice never changes a result. [`balance`] works in three steps:
//!
//! 1. **Nodes** (`nodes > 1`): the experts form `groups` contiguous groups (DeepSeek-V3's router
//!    groups); whole groups are packed onto nodes, heaviest first onto the lightest node with
//!    room, so every node holds `groups / nodes` groups and a group's replicas stay in its node.
//! 2. **Replicas**: each node's share of the `redundant` budget (split evenly, the remainder to
//!    the heaviest nodes) goes, one replica at a time, to the expert with the largest load per
//!    replica, never more replicas than the node has ranks.
//! 3. **Ranks**: each node's replicas, heaviest share first, go to the lightest rank of the node
//!    that has a free slot and does not hold that expert yet; ranks get `ceil(slots / ranks)`
//!    slots at most (a rank takes one more only where nothing else fits).

use crate::error::{MoeError, Result};
use crate::placement::ExpertPlacement;

/// What [`balance`] is asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EplbConfig {
    /// EP ranks.
    pub ranks: usize,
    /// Nodes the ranks form (consecutive ranks; must divide `ranks`).
    pub nodes: usize,
    /// Replicas beyond one per expert, over all ranks.
    pub redundant: usize,
    /// Contiguous expert groups kept within a node (must divide the experts, and be a multiple
    /// of `nodes` when `nodes > 1`).
    pub groups: usize,
}

/// Expected (token, slot) pairs per rank of `placement` for per-expert loads `load [E]`: each
/// expert's load split evenly over its replicas.
pub fn rank_loads(placement: &ExpertPlacement, load: &[f64]) -> Vec<f64> {
    let mut ranks = vec![0.0; placement.ranks()];
    for (e, &l) in load.iter().enumerate().take(placement.num_experts()) {
        let reps = placement.replicas_of(e);
        for &p in reps {
            ranks[placement.rank_of(p)] += l / reps.len() as f64;
        }
    }
    ranks
}

/// The busiest rank's load over the mean (1 = balanced; 1 when nothing is loaded).
pub fn imbalance(loads: &[f64]) -> f64 {
    let mean = loads.iter().sum::<f64>() / loads.len().max(1) as f64;
    if mean <= 0.0 {
        return 1.0;
    }
    loads.iter().fold(0.0f64, |m, &l| m.max(l)) / mean
}

/// A placement of `load.len()` experts for `cfg` that minimises the busiest rank's expected
/// load (see the module for the algorithm). Refuses impossible requests with the reason.
pub fn balance(load: &[f64], cfg: EplbConfig) -> Result<ExpertPlacement> {
    let e = load.len();
    let EplbConfig { ranks, nodes, redundant, groups } = cfg;
    let bad = |why: String| Err(MoeError::Config(format!("eplb: {why}")));
    if e == 0 || ranks == 0 || nodes == 0 || groups == 0 {
        return bad(format!("{e} experts, {ranks} ranks, {nodes} nodes, {groups} groups: all must be positive"));
    }
    if let Some(l) = load.iter().find(|l| !l.is_finite() || **l < 0.0) {
        return bad(format!("expert load {l} is not a finite count"));
    }
    if !ranks.is_multiple_of(nodes) {
        return bad(format!("{nodes} nodes do not divide {ranks} ranks"));
    }
    let per_node = ranks / nodes;
    if !e.is_multiple_of(groups) || (nodes > 1 && !groups.is_multiple_of(nodes)) {
        return bad(format!(
            "{groups} expert groups must divide the {e} experts and be a multiple of the {nodes} nodes"
        ));
    }
    if redundant > e * (per_node - 1) {
        return bad(format!(
            "{redundant} redundant replicas: at most {} fit (each expert at most once on each of its node's {per_node} ranks)",
            e * (per_node - 1)
        ));
    }
    // 1. Groups onto nodes.
    let group_size = e / groups;
    let group_load: Vec<f64> = (0..groups).map(|g| load[g * group_size..(g + 1) * group_size].iter().sum()).collect();
    let mut node_experts: Vec<Vec<usize>> = vec![Vec::new(); nodes];
    let mut node_load = vec![0f64; nodes];
    for g in order_by_load(&group_load) {
        let n = (0..nodes)
            .filter(|&n| node_experts[n].len() < (groups / nodes) * group_size)
            .min_by(|&a, &b| node_load[a].total_cmp(&node_load[b]).then(a.cmp(&b)))
            .expect("the nodes have room for every group");
        node_experts[n].extend(g * group_size..(g + 1) * group_size);
        node_load[n] += group_load[g];
    }
    // 2. The replica budget over the nodes, the remainder to the heaviest.
    let mut budget = vec![redundant / nodes; nodes];
    for n in order_by_load(&node_load).into_iter().take(redundant % nodes) {
        budget[n] += 1;
    }
    // A node cannot take more replicas than its experts fit on its ranks: move the excess on.
    let room = |n: usize| node_experts[n].len() * (per_node - 1);
    let mut excess: usize = (0..nodes).map(|n| budget[n].saturating_sub(room(n))).sum();
    for (n, b) in budget.iter_mut().enumerate() {
        *b = (*b).min(room(n));
        let take = excess.min(room(n) - *b);
        *b += take;
        excess -= take;
    }
    let mut slots: Vec<Vec<usize>> = vec![Vec::new(); ranks];
    for n in 0..nodes {
        let experts = &node_experts[n];
        let mut reps = vec![1usize; experts.len()];
        for _ in 0..budget[n] {
            let i = (0..experts.len())
                .filter(|&i| reps[i] < per_node)
                .max_by(|&a, &b| {
                    let (la, lb) = (load[experts[a]] / reps[a] as f64, load[experts[b]] / reps[b] as f64);
                    la.total_cmp(&lb).then(b.cmp(&a))
                })
                .expect("the budget fits the node's ranks");
            reps[i] += 1;
        }
        // 3. Replicas onto the node's ranks.
        let items: Vec<(usize, f64)> =
            experts.iter().zip(&reps).flat_map(|(&x, &r)| std::iter::repeat_n((x, load[x] / r as f64), r)).collect();
        let cap = items.len().div_ceil(per_node);
        let node_ranks = n * per_node..(n + 1) * per_node;
        let mut rank_load = vec![0f64; ranks];
        let shares: Vec<f64> = items.iter().map(|i| i.1).collect();
        for i in order_by_load(&shares) {
            let (x, share) = items[i];
            let lightest = |with_room: bool| {
                node_ranks
                    .clone()
                    .filter(|&r| !slots[r].contains(&x) && (!with_room || slots[r].len() < cap))
                    .min_by(|&a, &b| rank_load[a].total_cmp(&rank_load[b]).then(a.cmp(&b)))
            };
            let r = lightest(true).or_else(|| lightest(false)).expect("an expert has fewer replicas than ranks");
            slots[r].push(x);
            rank_load[r] += share;
        }
    }
    slots.iter_mut().for_each(|s| s.sort_unstable());
    ExpertPlacement::from_slots(e, slots)
}

/// Indices of `v`, largest value first (ties: lower index first).
fn order_by_load(v: &[f64]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zipf(e: usize, s: f64) -> Vec<f64> {
        (0..e).map(|i| 1e6 / (1.0 + i as f64).powf(s)).collect()
    }

    fn busiest(p: &ExpertPlacement, load: &[f64]) -> f64 {
        rank_loads(p, load).into_iter().fold(0.0, f64::max)
    }

    /// Every expert placed, the replica budget used exactly, slots within the cap (+1 where
    /// nothing else fit), no rank holding an expert twice (from_slots checks that).
    fn check_valid(p: &ExpertPlacement, e: usize, cfg: EplbConfig) {
        assert_eq!(p.num_experts(), e);
        assert_eq!(p.ranks(), cfg.ranks);
        assert_eq!(p.num_physical(), e + cfg.redundant, "{cfg:?}");
        assert!((0..e).all(|x| !p.replicas_of(x).is_empty()));
        let cap = (e + cfg.redundant).div_ceil(cfg.ranks);
        assert!((0..cfg.ranks).all(|r| p.local_experts(r).len() <= cap + 1), "{cfg:?}: {}", p.describe());
        let total: f64 = rank_loads(p, &vec![1.0; e]).iter().sum();
        assert!((total - e as f64).abs() < 1e-9);
    }

    #[test]
    fn zipf_load_the_busiest_rank_drops() {
        let load = zipf(64, 1.2);
        for (ranks, redundant) in [(2, 0), (2, 4), (4, 8), (8, 8), (8, 16)] {
            let cfg = EplbConfig { ranks, nodes: 1, redundant, groups: 1 };
            let p = balance(&load, cfg).unwrap();
            check_valid(&p, 64, cfg);
            let contiguous = ExpertPlacement::contiguous(64, ranks).unwrap();
            let round_robin = ExpertPlacement::round_robin(64, ranks).unwrap();
            let (before, after) = (busiest(&contiguous, &load), busiest(&p, &load));
            assert!(after < 0.8 * before, "EP {ranks}, {redundant} replicas: {after} vs {before}");
            assert!(after <= busiest(&round_robin, &load) + 1e-6, "EP {ranks}: {after}");
            assert!(imbalance(&rank_loads(&p, &load)) < imbalance(&rank_loads(&contiguous, &load)));
        }
        // With replicas of the hottest expert, EP 8 comes close to balanced.
        let p = balance(&load, EplbConfig { ranks: 8, nodes: 1, redundant: 16, groups: 1 }).unwrap();
        assert!(imbalance(&rank_loads(&p, &load)) < 1.1, "{}", imbalance(&rank_loads(&p, &load)));
    }

    #[test]
    fn nodes_keep_groups_and_their_replicas_together() {
        let load = zipf(32, 1.0);
        let cfg = EplbConfig { ranks: 8, nodes: 2, redundant: 6, groups: 8 };
        let p = balance(&load, cfg).unwrap();
        check_valid(&p, 32, cfg);
        for g in 0..8 {
            let nodes: std::collections::BTreeSet<usize> =
                (g * 4..g * 4 + 4).flat_map(|x| p.replicas_of(x).iter().map(|&ph| p.rank_of(ph) / 4)).collect();
            assert_eq!(nodes.len(), 1, "group {g} spans nodes {nodes:?}");
        }
        // Each node holds 4 of the 8 groups, and the node loads are close.
        let loads = rank_loads(&p, &load);
        let (a, b) = (loads[..4].iter().sum::<f64>(), loads[4..].iter().sum::<f64>());
        assert!((a - b).abs() < 0.35 * (a + b), "{a} vs {b}");
    }

    #[test]
    fn many_shapes_give_valid_placements() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(5);
        for _ in 0..200 {
            let nodes = [1, 1, 2, 4][rng.gen_range(0..4)];
            let ranks = nodes * rng.gen_range(1..5);
            let groups = nodes * [1, 2, 4][rng.gen_range(0..3)];
            let e = groups * rng.gen_range(1..6);
            let per_node = ranks / nodes;
            let redundant = rng.gen_range(0..=e * (per_node - 1));
            let load: Vec<f64> = (0..e).map(|_| rng.gen_range(0.0..100.0f64).powi(2)).collect();
            let cfg = EplbConfig { ranks, nodes, redundant, groups };
            check_valid(&balance(&load, cfg).unwrap(), e, cfg);
        }
    }

    #[test]
    fn impossible_requests_are_refused() {
        let load = zipf(8, 1.0);
        let cfg = EplbConfig { ranks: 4, nodes: 1, redundant: 0, groups: 1 };
        let msg = |c: EplbConfig| balance(&load, c).unwrap_err().to_string();
        assert!(msg(EplbConfig { nodes: 3, ..cfg }).contains("do not divide"));
        assert!(msg(EplbConfig { redundant: 25, ..cfg }).contains("at most 24 fit"));
        assert!(msg(EplbConfig { nodes: 2, groups: 1, ..cfg }).contains("multiple of the 2 nodes"));
        assert!(msg(EplbConfig { groups: 3, ..cfg }).contains("must divide the 8 experts"));
        assert!(balance(&[1.0, f64::NAN], cfg).unwrap_err().to_string().contains("not a finite"));
        assert!(balance(&[], cfg).is_err());
    }
}
