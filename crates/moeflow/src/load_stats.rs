//! Expert load statistics: how many (token, slot) pairs each logical expert received, per
//! forward call, over a window of the last calls of one rank.
//!
//! Every layer counts its own tokens' routing (the CPU layer from its top-k ids, the GPU layer
//! with a counting kernel on the device); [`LoadRecord`] gathers the ranks' windows into the
//! JSON file `run`/`bench --record-load` write and `moeflow eplb` reads.

use crate::error::{MoeError, Result};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Calls a layer's window keeps unless told otherwise.
pub const DEFAULT_WINDOW: usize = 64;

/// Tokens per logical expert per forward call, the last `window` calls of one rank, oldest
/// first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadStats {
    /// Number of logical experts (the length of every call's counts).
    pub num_experts: usize,
    /// Calls the window keeps.
    pub window: usize,
    /// Calls counted since the layer was built (the window holds the last `window` of them).
    pub calls_seen: u64,
    /// `[calls, E]`: per call, the (token, slot) pairs routed to each expert.
    pub calls: VecDeque<Vec<u64>>,
}

impl LoadStats {
    /// An empty window of `window` calls over `num_experts` experts (`window` at least 1).
    pub fn new(num_experts: usize, window: usize) -> Self {
        LoadStats { num_experts, window: window.max(1), calls_seen: 0, calls: VecDeque::new() }
    }

    /// Counts one call's routing: logical expert ids `[T, k]` (ids outside `0..E` are
    /// ignored; the router never makes them).
    pub fn record(&mut self, ids: &[i32]) {
        let mut counts = vec![0u64; self.num_experts];
        for &e in ids {
            if let Some(c) = usize::try_from(e).ok().and_then(|e| counts.get_mut(e)) {
                *c += 1;
            }
        }
        self.push(counts);
    }

    /// Appends one call's counts `[E]`, dropping the oldest call past the window.
    pub fn push(&mut self, counts: Vec<u64>) {
        debug_assert_eq!(counts.len(), self.num_experts);
        if self.calls.len() == self.window {
            self.calls.pop_front();
        }
        self.calls.push_back(counts);
        self.calls_seen += 1;
    }

    /// Per expert, the pairs routed to it over the window `[E]`.
    pub fn totals(&self) -> Vec<u64> {
        let mut t = vec![0u64; self.num_experts];
        for call in &self.calls {
            t.iter_mut().zip(call).for_each(|(t, c)| *t += c);
        }
        t
    }

    /// The most recent call's counts, if any.
    pub fn last(&self) -> Option<&[u64]> {
        self.calls.back().map(|c| c.as_slice())
    }
}

/// Every rank's [`LoadStats`], as `run`/`bench --record-load` write them: the load file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoadRecord {
    /// Number of logical experts.
    pub num_experts: usize,
    /// Expert groups of the router (DeepSeek's `n_group`; 1 without groups), for hierarchical
    /// placement.
    #[serde(default = "one")]
    pub num_groups: usize,
    /// One entry per rank, in rank order.
    pub ranks: Vec<LoadStats>,
}

fn one() -> usize {
    1
}

/// The expert groups `router` chooses among (1 for routers without groups).
pub fn router_groups(router: &crate::RouterConfig) -> usize {
    match router {
        crate::RouterConfig::SigmoidGrouped { n_group, .. } | crate::RouterConfig::SoftmaxGrouped { n_group, .. } => {
            (*n_group).max(1)
        }
        _ => 1,
    }
}

impl LoadRecord {
    /// The record of one rank's stats, with `config`'s router groups.
    pub fn from_ranks(config: &crate::MoeConfig, ranks: Vec<LoadStats>) -> Self {
        LoadRecord { num_experts: config.num_experts, num_groups: router_groups(&config.router), ranks }
    }

    /// Every rank's `stats` on every rank of `comm`, in rank order (collective).
    pub fn gather(config: &crate::MoeConfig, comm: &dyn crate::comm::Communicator, stats: &LoadStats) -> Result<Self> {
        let mine = serde_json::to_vec(stats)
            .map_err(|e| MoeError::Json { context: "encoding load statistics".into(), source: e })?;
        let ranks = comm
            .all_gather_v("load_stats.gather", &mine)?
            .iter()
            .enumerate()
            .map(|(r, b)| {
                serde_json::from_slice(b)
                    .map_err(|e| MoeError::Json { context: format!("load statistics of rank {r}"), source: e })
            })
            .collect::<Result<Vec<LoadStats>>>()?;
        let record = Self::from_ranks(config, ranks);
        record.validate()?;
        Ok(record)
    }

    /// Checks that every rank counts the same experts.
    pub fn validate(&self) -> Result<()> {
        if self.num_experts == 0 {
            return Err(MoeError::Config("load record: no experts".into()));
        }
        for (r, s) in self.ranks.iter().enumerate() {
            if s.num_experts != self.num_experts || s.calls.iter().any(|c| c.len() != self.num_experts) {
                return Err(MoeError::Config(format!(
                    "load record: rank {r} counts {} experts, the record {}",
                    s.num_experts, self.num_experts
                )));
            }
        }
        Ok(())
    }

    /// Per expert, the pairs routed to it over every rank and call `[E]`.
    pub fn totals(&self) -> Vec<u64> {
        let mut t = vec![0u64; self.num_experts];
        for s in &self.ranks {
            t.iter_mut().zip(s.totals()).for_each(|(t, c)| *t += c);
        }
        t
    }

    /// Writes the record as JSON to `path`.
    pub fn write(&self, path: &std::path::Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self)
            .map_err(|e| MoeError::Json { context: "writing a load record".into(), source: e })?;
        std::fs::write(path, text)
            .map_err(|e| MoeError::Io { context: format!("writing load record {}", path.display()), source: e })
    }

    /// Reads a record written by [`LoadRecord::write`].
    pub fn read(path: &std::path::Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| MoeError::Io { context: format!("reading load record {}", path.display()), source: e })?;
        let r: LoadRecord = serde_json::from_str(&text)
            .map_err(|e| MoeError::Json { context: format!("parsing load record {}", path.display()), source: e })?;
        r.validate()?;
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_each_call_and_keeps_the_window() {
        let mut s = LoadStats::new(4, 2);
        s.record(&[0, 1, 0, 3]);
        assert_eq!(s.last(), Some(&[2, 1, 0, 1][..]));
        s.record(&[2, 2]);
        s.record(&[1]);
        assert_eq!(s.calls.len(), 2);
        assert_eq!(s.calls_seen, 3);
        assert_eq!(s.totals(), vec![0, 1, 2, 0]);
        s.record(&[-1, 7]);
        assert_eq!(s.last(), Some(&[0, 0, 0, 0][..]));
    }

    #[test]
    fn records_sum_ranks_and_round_trip() {
        let mut a = LoadStats::new(3, 4);
        a.record(&[0, 1]);
        let mut b = LoadStats::new(3, 4);
        b.record(&[1, 2]);
        b.record(&[1, 1]);
        let rec = LoadRecord { num_experts: 3, num_groups: 1, ranks: vec![a, b] };
        assert_eq!(rec.totals(), vec![1, 4, 1]);
        let path = std::env::temp_dir().join(format!("moeflow-load-{}.json", std::process::id()));
        rec.write(&path).unwrap();
        assert_eq!(LoadRecord::read(&path).unwrap(), rec);
        let bad = LoadRecord { num_experts: 4, ..rec };
        assert!(bad.validate().unwrap_err().to_string().contains("rank 0 counts 3 experts"));
        std::fs::write(&path, "[1]").unwrap();
        assert!(LoadRecord::read(&path).unwrap_err().to_string().contains("parsing load record"));
        std::fs::remove_file(&path).ok();
    }
}
