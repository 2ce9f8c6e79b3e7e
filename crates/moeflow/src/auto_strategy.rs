//! `--strategy auto`: which dispatch strategy an expert-parallel GPU layer runs for a batch,
//! from crossovers measured on the machine (`moeflow bench --calibrate FILE`) or a built-in
//! table. The layer picks per call from the largest batch of any rank (which every rank knows
//! after one small exchange), so the ranks always agree.

use crate::error::{MoeError, Result};
use crate::parallel::StrategyKind;
use serde::{Deserialize, Serialize};

/// A table of crossovers: the strategy of the first row whose `up_to_tokens` is at least the
/// largest batch per rank (`None`: any batch).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AutoStrategy {
    /// Where the table was measured, in words (empty for the built-in one).
    #[serde(default)]
    pub measured_on: String,
    /// Rows in order of `up_to_tokens`; the last covers every batch.
    pub rows: Vec<AutoRow>,
}

/// One row of an [`AutoStrategy`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AutoRow {
    /// The largest batch per rank this row covers (`None`: every larger batch).
    pub up_to_tokens: Option<usize>,
    /// The strategy's name on the command line.
    pub strategy: String,
}

impl AutoStrategy {
    /// The strategies auto chooses among: those whose buffers follow the batch (the
    /// low-latency layer is sized by its capacity and captured once, so it is chosen by name).
    pub const CANDIDATES: [StrategyKind; 4] =
        [StrategyKind::All2AllV, StrategyKind::AllGather, StrategyKind::AllGatherLogits, StrategyKind::Multicast];

    /// The built-in table for `ep` ranks: the all-gather everywhere on two GPUs, where every
    /// rank needs most rows anyway (docs/tuning.md); on more, the all-gather up to 64 tokens per
    /// rank and all-to-all-v above, where sending each row only where it is needed wins.
    pub fn builtin(ep: usize) -> AutoStrategy {
        let row = |up_to_tokens, s: StrategyKind| AutoRow { up_to_tokens, strategy: s.name().into() };
        let rows = if ep <= 2 {
            vec![row(None, StrategyKind::AllGather)]
        } else {
            vec![row(Some(64), StrategyKind::AllGather), row(None, StrategyKind::All2AllV)]
        };
        AutoStrategy { measured_on: String::new(), rows }
    }

    /// The table of measured layer times: for each batch size the fastest strategy, rows of
    /// the same strategy merged, the last row covering every larger batch. `measured` holds
    /// (tokens per rank, strategy, ms).
    pub fn from_measurements(measured_on: &str, measured: &[(usize, StrategyKind, f64)]) -> Result<AutoStrategy> {
        let mut sizes: Vec<usize> = measured.iter().map(|m| m.0).collect();
        sizes.sort_unstable();
        sizes.dedup();
        let mut rows: Vec<AutoRow> = Vec::new();
        for &t in &sizes {
            let best = measured
                .iter()
                .filter(|m| m.0 == t && m.2.is_finite())
                .min_by(|a, b| a.2.total_cmp(&b.2))
                .ok_or_else(|| MoeError::Config(format!("no finite time measured at {t} tokens")))?;
            match rows.last_mut() {
                Some(last) if last.strategy == best.1.name() => last.up_to_tokens = Some(t),
                _ => rows.push(AutoRow { up_to_tokens: Some(t), strategy: best.1.name().into() }),
            }
        }
        let last = rows.last_mut().ok_or_else(|| MoeError::Config("no measurements to calibrate from".into()))?;
        last.up_to_tokens = None;
        let table = AutoStrategy { measured_on: measured_on.into(), rows };
        table.validate()?;
        Ok(table)
    }

    /// Reads a table written by `bench --calibrate` (an error naming what is wrong).
    pub fn from_json(text: &str) -> Result<AutoStrategy> {
        let table: AutoStrategy =
            serde_json::from_str(text).map_err(|e| MoeError::Config(format!("strategy table: {e}")))?;
        table.validate()?;
        Ok(table)
    }

    /// The table as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a table serializes")
    }

    /// Checks that the rows name candidate strategies, rise, and end with a row for every batch.
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| Err(MoeError::Config(format!("strategy table: {why}")));
        if self.rows.is_empty() {
            return bad("no rows".into());
        }
        for (i, row) in self.rows.iter().enumerate() {
            let kind: StrategyKind = row.strategy.parse()?;
            if !Self::CANDIDATES.contains(&kind) {
                return bad(format!(
                    "row {i}: auto chooses among all2allv, allgather, allgather-logits and multicast, not {kind}"
                ));
            }
            let last = i + 1 == self.rows.len();
            match (row.up_to_tokens, last) {
                (None, true) => {}
                (None, false) => return bad(format!("row {i} covers every batch but is not the last")),
                (Some(_), true) => return bad("the last row must cover every batch (up_to_tokens null)".into()),
                (Some(t), false) => {
                    if i > 0 && self.rows[i - 1].up_to_tokens.is_some_and(|p| p >= t) {
                        return bad(format!("row {i}: up_to_tokens {t} does not rise"));
                    }
                }
            }
        }
        Ok(())
    }

    /// The strategy for batches of at most `max_tokens` tokens on any rank.
    pub fn pick(&self, max_tokens: usize) -> StrategyKind {
        let row = self.rows.iter().find(|r| r.up_to_tokens.is_none_or(|t| max_tokens <= t));
        row.and_then(|r| r.strategy.parse().ok()).unwrap_or(StrategyKind::All2AllV)
    }

    /// The table in words: `allgather up to 64, all2allv above`.
    pub fn describe(&self) -> String {
        let rows: Vec<String> = self
            .rows
            .iter()
            .map(|r| match r.up_to_tokens {
                Some(t) => format!("{} up to {t}", r.strategy),
                None if self.rows.len() == 1 => format!("{} always", r.strategy),
                None => format!("{} above", r.strategy),
            })
            .collect();
        let from = if self.measured_on.is_empty() { "built-in".to_string() } else { self.measured_on.clone() };
        format!("{} ({from})", rows.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use StrategyKind::*;

    #[test]
    fn measurements_become_merged_crossovers_and_pick_follows_them() {
        let m = [
            (1, AllGather, 0.5),
            (1, All2AllV, 0.6),
            (8, AllGather, 0.7),
            (8, All2AllV, 0.9),
            (128, Multicast, 1.0),
            (128, All2AllV, 1.5),
            (4096, All2AllV, 7.0),
            (4096, AllGather, 7.5),
        ];
        let t = AutoStrategy::from_measurements("2 x H100", &m).unwrap();
        let names: Vec<_> = t.rows.iter().map(|r| (r.up_to_tokens, r.strategy.as_str())).collect();
        assert_eq!(names, vec![(Some(8), "allgather"), (Some(128), "multicast"), (None, "all2allv")]);
        assert_eq!(
            [1, 8, 9, 128, 129, 1 << 20].map(|x| t.pick(x)),
            [AllGather, AllGather, Multicast, Multicast, All2AllV, All2AllV]
        );
        assert_eq!(AutoStrategy::from_json(&t.to_json()).unwrap(), t);
        assert!(t.describe().contains("multicast up to 128") && t.describe().contains("2 x H100"), "{}", t.describe());
    }

    #[test]
    fn bad_tables_are_refused_by_name() {
        let row = |u: Option<usize>, s: &str| AutoRow { up_to_tokens: u, strategy: s.into() };
        let cases = [
            (vec![], "no rows"),
            (vec![row(None, "lowlatency")], "not lowlatency"),
            (vec![row(None, "teleport")], "unknown strategy 'teleport'"),
            (vec![row(Some(4), "allgather")], "last row must cover"),
            (vec![row(None, "allgather"), row(None, "all2allv")], "not the last"),
            (vec![row(Some(8), "allgather"), row(Some(8), "multicast"), row(None, "all2allv")], "does not rise"),
        ];
        for (rows, want) in cases {
            let e = AutoStrategy { measured_on: String::new(), rows }.validate().unwrap_err().to_string();
            assert!(e.contains(want), "{e} lacks {want}");
        }
        assert!(AutoStrategy::from_json("{").unwrap_err().to_string().contains("strategy table"));
        assert!(AutoStrategy::from_measurements("x", &[]).is_err());
        for ep in [2, 4, 8] {
            AutoStrategy::builtin(ep).validate().unwrap();
        }
    }
}
