//! Where experts live: logical expert → physical slots on EP ranks, with optional replicas.
//!
//! Physical expert ids number every slot of every rank, rank by rank: rank 0's slots first.
//! A logical expert has one or more replicas (physical ids); each (token, slot) picks one
//! replica deterministically from its global token index, so the choice never depends on
//! timing. Replicas hold identical weights, so the choice never changes a result.
//!
//! A replica costs a read of its expert's weights, which pays only when its expert has more
//! rows than a GEMM can multiply in the time those weights take to stream. So a GPU layer may
//! share an expert among its replicas only in batches that send it enough rows
//! ([`ExpertPlacement::shared_replicas`]); in the others its first replica serves every pair.

use crate::error::{MoeError, Result};
use crate::router::TopK;
use serde::{Deserialize, Serialize};

/// Expert placement over `ranks` EP ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertPlacement {
    num_experts: usize,
    /// Per rank: the logical expert held in each local slot.
    slots: Vec<Vec<usize>>,
    /// Physical id → (rank, slot).
    physical: Vec<(usize, usize)>,
    /// Logical expert → its physical ids.
    replicas: Vec<Vec<usize>>,
}

/// The JSON form of an explicit placement: per rank, the logical experts of its slots.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PlacementFile {
    /// Number of logical experts.
    pub num_experts: usize,
    /// `ranks[r]` lists rank r's experts; an expert listed on several ranks is replicated.
    pub ranks: Vec<Vec<usize>>,
}

impl ExpertPlacement {
    /// Explicit slots; every expert needs at least one slot, and a rank holds an expert once.
    pub fn from_slots(num_experts: usize, slots: Vec<Vec<usize>>) -> Result<Self> {
        if slots.is_empty() {
            return Err(MoeError::Config("a placement needs at least one rank".into()));
        }
        let mut replicas = vec![Vec::new(); num_experts];
        let mut physical = Vec::new();
        for (rank, list) in slots.iter().enumerate() {
            for (slot, &e) in list.iter().enumerate() {
                if e >= num_experts {
                    return Err(MoeError::Config(format!("placement: rank {rank} lists expert {e} of {num_experts}")));
                }
                if list[..slot].contains(&e) {
                    return Err(MoeError::Config(format!("placement: rank {rank} lists expert {e} twice")));
                }
                replicas[e].push(physical.len());
                physical.push((rank, slot));
            }
        }
        if let Some(e) = replicas.iter().position(|r| r.is_empty()) {
            return Err(MoeError::Config(format!("placement: expert {e} is on no rank")));
        }
        // The replica that serves an expert alone, where its replicas do not share a batch, goes
        // first: the ranks should serve as nearly as possible as many experts alone. Experts
        // with one replica stay where they are; each replicated expert, in id order, goes to its
        // replica on the rank serving fewest so far (the lower rank on ties). The order of the
        // others is kept (rotated).
        let mut alone = vec![0usize; slots.len()];
        for reps in replicas.iter().filter(|r| r.len() == 1) {
            alone[physical[reps[0]].0] += 1;
        }
        for reps in replicas.iter_mut().filter(|r| r.len() > 1) {
            let rank = |i: usize| physical[reps[i]].0;
            let first = (0..reps.len()).min_by_key(|&i| (alone[rank(i)], rank(i))).expect("replicated");
            alone[rank(first)] += 1;
            reps.rotate_left(first);
        }
        Ok(ExpertPlacement { num_experts, slots, physical, replicas })
    }

    /// Experts in contiguous ranges, the first `E % ranks` ranks holding one more.
    pub fn contiguous(num_experts: usize, ranks: usize) -> Result<Self> {
        Self::check_ranks(num_experts, ranks)?;
        let (base, extra) = (num_experts / ranks, num_experts % ranks);
        let mut start = 0;
        let slots = (0..ranks)
            .map(|r| {
                let n = base + usize::from(r < extra);
                start += n;
                (start - n..start).collect()
            })
            .collect();
        Self::from_slots(num_experts, slots)
    }

    /// Expert `e` on rank `e % ranks`.
    pub fn round_robin(num_experts: usize, ranks: usize) -> Result<Self> {
        Self::check_ranks(num_experts, ranks)?;
        Self::from_slots(num_experts, (0..ranks).map(|r| (r..num_experts).step_by(ranks).collect()).collect())
    }

    fn check_ranks(num_experts: usize, ranks: usize) -> Result<()> {
        if ranks == 0 || num_experts == 0 {
            return Err(MoeError::Config(format!("cannot place {num_experts} experts on {ranks} ranks")));
        }
        Ok(())
    }

    /// Reads a [`PlacementFile`]; it must describe `num_experts` experts on `ranks` ranks.
    pub fn from_json_file(path: &std::path::Path, num_experts: usize, ranks: usize) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| MoeError::Io { context: format!("reading placement {}", path.display()), source: e })?;
        let file: PlacementFile = serde_json::from_str(&text)
            .map_err(|e| MoeError::Json { context: format!("parsing placement {}", path.display()), source: e })?;
        if file.num_experts != num_experts || file.ranks.len() != ranks {
            return Err(MoeError::Config(format!(
                "placement {} is for {} experts on {} ranks, the layer has {num_experts} experts on {ranks} ranks",
                path.display(),
                file.num_experts,
                file.ranks.len()
            )));
        }
        Self::from_slots(num_experts, file.ranks)
    }

    /// The JSON form ([`ExpertPlacement::from_json_file`] reads it back).
    pub fn to_file(&self) -> PlacementFile {
        PlacementFile { num_experts: self.num_experts, ranks: self.slots.clone() }
    }

    /// Writes the JSON form to `path`.
    pub fn write_json(&self, path: &std::path::Path) -> Result<()> {
        let text = serde_json::to_string(&self.to_file())
            .map_err(|e| MoeError::Json { context: "writing a placement".into(), source: e })?;
        std::fs::write(path, text + "\n")
            .map_err(|e| MoeError::Io { context: format!("writing placement {}", path.display()), source: e })
    }

    /// Adds one replica of each `hot` expert on the next rank (cyclically) that lacks it.
    pub fn with_replicas(&self, hot: &[usize]) -> Result<Self> {
        let mut slots = self.slots.clone();
        let ranks = slots.len();
        for &e in hot {
            let home = self
                .replicas
                .get(e)
                .and_then(|r| r.first())
                .map(|&p| self.physical[p].0)
                .ok_or_else(|| MoeError::Config(format!("placement: hot expert {e} of {}", self.num_experts)))?;
            if let Some(r) = (1..ranks).map(|d| (home + d) % ranks).find(|&r| !slots[r].contains(&e)) {
                slots[r].push(e);
            }
        }
        Self::from_slots(self.num_experts, slots)
    }

    /// Number of EP ranks.
    pub fn ranks(&self) -> usize {
        self.slots.len()
    }

    /// Number of logical experts.
    pub fn num_experts(&self) -> usize {
        self.num_experts
    }

    /// Number of physical slots over all ranks.
    pub fn num_physical(&self) -> usize {
        self.physical.len()
    }

    /// Logical experts in rank `r`'s slots.
    pub fn local_experts(&self, rank: usize) -> &[usize] {
        &self.slots[rank]
    }

    /// The rank holding physical expert `p`.
    pub fn rank_of(&self, physical: usize) -> usize {
        self.physical[physical].0
    }

    /// Physical id → local slot on `rank`, `-1` elsewhere (`[num_physical]`).
    pub fn expert_map(&self, rank: usize) -> Vec<i32> {
        self.physical.iter().map(|&(r, s)| if r == rank { s as i32 } else { -1 }).collect()
    }

    /// Physical ids `[T, k]` for `topk`, whose first token has global index `first_token`:
    /// replica `(token + slot) mod replicas`.
    pub fn to_physical(&self, topk: &TopK, first_token: usize) -> Vec<i32> {
        let k = topk.k;
        topk.ids
            .iter()
            .enumerate()
            .map(|(i, &e)| self.replica_for(e as usize, first_token + i / k, i % k) as i32)
            .collect()
    }

    /// The physical id serving `slot` of token `token` routed to logical `expert`: its replica
    /// `(token + slot) mod replicas`.
    pub fn replica_for(&self, expert: usize, token: usize, slot: usize) -> usize {
        self.replica_of(expert, token, slot, true)
    }

    /// [`ExpertPlacement::replica_for`] where `shared` says the expert's replicas share this
    /// batch (see [`ExpertPlacement::shared_replicas`]); otherwise its first replica.
    pub fn replica_of(&self, expert: usize, token: usize, slot: usize, shared: bool) -> usize {
        let reps = &self.replicas[expert];
        if shared {
            reps[(token + slot) % reps.len()]
        } else {
            reps[0]
        }
    }

    /// Per logical expert: whether its replicas share the (token, slot) pairs of one rank's
    /// batch of logical ids `ids` (`-1` for none) in an expert-parallel group of `ranks`: it has
    /// more than one replica and the batch sends it at least `min_rows / ranks` pairs (rounded
    /// up), so that every rank's batch looking like this one would give it `min_rows` rows.
    /// `min_rows` 0 shares every replicated expert.
    pub fn shared_replicas(&self, ids: &[i32], ranks: usize, min_rows: usize) -> Vec<bool> {
        // Without replicas, or sharing from any count, the batch need not be counted.
        if self.num_physical() == self.num_experts || min_rows == 0 {
            return self.replicas.iter().map(|reps| reps.len() > 1).collect();
        }
        let mut pairs = vec![0usize; self.num_experts];
        for &id in ids {
            if let Some(c) = usize::try_from(id).ok().and_then(|e| pairs.get_mut(e)) {
                *c += 1;
            }
        }
        self.shared_by_pairs(&pairs, ranks, min_rows)
    }

    /// [`ExpertPlacement::shared_replicas`] of a batch whose pairs per physical expert were
    /// `served` (`[num_physical]`): a receiver's view of another rank's batch.
    pub fn shared_by_served(&self, served: &[i32], ranks: usize, min_rows: usize) -> Vec<bool> {
        let pairs: Vec<usize> = self
            .replicas
            .iter()
            .map(|reps| reps.iter().map(|&p| served.get(p).map_or(0, |&c| c.max(0) as usize)).sum())
            .collect();
        self.shared_by_pairs(&pairs, ranks, min_rows)
    }

    fn shared_by_pairs(&self, pairs: &[usize], ranks: usize, min_rows: usize) -> Vec<bool> {
        let least = min_rows.div_ceil(ranks.max(1));
        pairs.iter().zip(&self.replicas).map(|(&c, reps)| reps.len() > 1 && c >= least).collect()
    }

    /// The (rank, local slot) of physical id `physical`.
    pub fn physical_slot(&self, physical: usize) -> (usize, usize) {
        self.physical[physical]
    }

    /// The physical ids of logical `expert`, in the order [`ExpertPlacement::replica_for`]
    /// picks them.
    pub fn replicas_of(&self, expert: usize) -> &[usize] {
        &self.replicas[expert]
    }

    /// Whether every rank holds the contiguous range `rank · E / ranks ..` of `E / ranks`
    /// experts, without replicas (the layout the fixed-capacity GPU layer's kernels assume).
    pub fn is_even_contiguous(&self) -> bool {
        let n = self.ranks();
        self.num_experts.is_multiple_of(n)
            && self.num_physical() == self.num_experts
            && self.slots.iter().enumerate().all(|(r, list)| {
                let per = self.num_experts / n;
                list.iter().copied().eq(r * per..(r + 1) * per)
            })
    }

    /// One line: experts per rank and replica count.
    pub fn describe(&self) -> String {
        let per: Vec<usize> = self.slots.iter().map(|s| s.len()).collect();
        let extra = self.num_physical() - self.num_experts;
        format!("slots per rank {per:?}, {extra} redundant")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts() {
        let c = ExpertPlacement::contiguous(10, 3).unwrap();
        assert_eq!(c.local_experts(0), &[0, 1, 2, 3]);
        assert_eq!(c.local_experts(2), &[7, 8, 9]);
        assert_eq!(c.expert_map(1), vec![-1, -1, -1, -1, 0, 1, 2, -1, -1, -1]);
        let r = ExpertPlacement::round_robin(5, 2).unwrap();
        assert_eq!(r.local_experts(1), &[1, 3]);
        assert_eq!(r.rank_of(3), 1);
        // More ranks than experts: some ranks hold none.
        let s = ExpertPlacement::contiguous(2, 4).unwrap();
        assert!(s.local_experts(3).is_empty());
    }

    #[test]
    fn replicas_are_chosen_deterministically() {
        let p = ExpertPlacement::contiguous(4, 2).unwrap().with_replicas(&[0]).unwrap();
        assert_eq!(p.local_experts(1), &[2, 3, 0]);
        assert_eq!(p.num_physical(), 5);
        let topk = TopK { tokens: 3, k: 2, ids: vec![0, 1, 0, 2, 3, 0], weights: vec![0.5; 6] };
        // Expert 0 has physical ids 0 (rank 0) and 4 (rank 1).
        assert_eq!(p.to_physical(&topk, 0), vec![0, 1, 4, 2, 3, 4]);
        assert_eq!(p.to_physical(&topk, 1), vec![4, 1, 0, 2, 3, 0]);
        assert_eq!(p.replica_for(0, 1, 0), 4);
        assert_eq!(p.physical_slot(4), (1, 2));
        assert_eq!(p.replicas_of(0), &[0, 4]);
        assert!(!p.is_even_contiguous());
        assert!(ExpertPlacement::contiguous(4, 2).unwrap().is_even_contiguous());
        assert!(!ExpertPlacement::contiguous(5, 2).unwrap().is_even_contiguous());
        assert!(!ExpertPlacement::round_robin(4, 2).unwrap().is_even_contiguous());
    }

    #[test]
    fn replicas_share_only_batches_that_send_enough_rows() {
        let p = ExpertPlacement::contiguous(4, 2).unwrap().with_replicas(&[0, 3]).unwrap();
        // Expert 0: 3 pairs, expert 1: 2, expert 3: 1; over 2 ranks.
        let ids = [0, 1, 0, 3, 0, 1, -1, 2];
        assert_eq!(p.shared_replicas(&ids, 2, 0), vec![true, false, false, true]);
        assert_eq!(p.shared_replicas(&ids, 2, 6), vec![true, false, false, false]);
        assert_eq!(p.shared_replicas(&ids, 2, 7), vec![false; 4]);
        assert_eq!(p.shared_replicas(&ids, 1, 3), vec![true, false, false, false]);
        // A receiver sees the same from the pairs each replica served, however they were split.
        let mut served = vec![0; p.num_physical()];
        for (i, &id) in ids.iter().enumerate().filter(|(_, &id)| id >= 0) {
            served[p.replica_for(id as usize, i, 0)] += 1;
        }
        for min_rows in [0, 6, 7] {
            assert_eq!(p.shared_by_served(&served, 2, min_rows), p.shared_replicas(&ids, 2, min_rows));
        }
        // Unshared: every pair on the first replica; shared: the usual rule.
        for (tok, slot) in [(0, 0), (1, 0), (0, 1), (5, 2)] {
            assert_eq!(p.replica_of(0, tok, slot, false), 0);
            assert_eq!(p.replica_of(0, tok, slot, true), p.replica_for(0, tok, slot));
        }
        assert_eq!(p.replica_of(0, 1, 0, true), 5);
        // Alone, expert 0 stays on rank 0 and expert 3 on rank 1, so each rank serves two.
        assert_eq!(p.replicas_of(0), &[0, 5]);
        assert_eq!(p.replicas_of(3), &[4, 2]);
        // Replicas of experts 0..2 of 8 all on rank 1: alone, they stay on rank 0.
        let lopsided = ExpertPlacement::contiguous(8, 2).unwrap().with_replicas(&[0, 1, 2]).unwrap();
        assert!((0..3).all(|e| lopsided.rank_of(lopsided.replicas_of(e)[0]) == 0));
        // Replicas of 0, 1 and 4, 5 crossing: each rank serves four alone.
        let even = ExpertPlacement::contiguous(8, 2).unwrap().with_replicas(&[0, 1, 4, 5]).unwrap();
        let on_0 = (0..8).filter(|&e| even.rank_of(even.replicas_of(e)[0]) == 0).count();
        assert_eq!(on_0, 4);
    }

    #[test]
    fn bad_placements_are_errors() {
        assert!(ExpertPlacement::from_slots(3, vec![vec![0, 1]])
            .unwrap_err()
            .to_string()
            .contains("expert 2 is on no rank"));
        assert!(ExpertPlacement::from_slots(2, vec![vec![0, 1, 1]]).unwrap_err().to_string().contains("twice"));
        assert!(ExpertPlacement::from_slots(2, vec![vec![0, 5]]).unwrap_err().to_string().contains("expert 5"));
        assert!(ExpertPlacement::contiguous(4, 0).is_err());
        let dir = std::env::temp_dir().join(format!("moeflow-placement-{}.json", std::process::id()));
        std::fs::write(&dir, r#"{"num_experts": 3, "ranks": [[2, 0], [1, 2]]}"#).unwrap();
        let p = ExpertPlacement::from_json_file(&dir, 3, 2).unwrap();
        assert_eq!(p.local_experts(0), &[2, 0]);
        p.write_json(&dir).unwrap();
        assert_eq!(ExpertPlacement::from_json_file(&dir, 3, 2).unwrap(), p);
        assert!(ExpertPlacement::from_json_file(&dir, 3, 3).unwrap_err().to_string().contains("on 2 ranks"));
        std::fs::write(&dir, "{").unwrap();
        assert!(ExpertPlacement::from_json_file(&dir, 3, 2).unwrap_err().to_string().contains("parsing placement"));
        std::fs::remove_file(&dir).ok();
    }
}
