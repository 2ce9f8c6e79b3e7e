//! `bench --backend cuda --dtype f8e4m3 --against-bf16`: the fp8 layer timed against the bf16
//! layer of the same shapes, seed and routing in the same process, each at its own steady clock
//! under the GPU's power cap. A power-capped GPU settles each workload at its own clock within
//! about a second of load, and its controller lags behind a change of workload: in rounds of a
//! few runs each, both layers would run at a clock set by their mix, which favours the one that
//! draws more power a clock (bf16; the figures are in docs/performance.md). So each round runs a
//! layer for a second before it times it.

use super::cuda::Timed;
use crate::common::median;
use moeflow::Result;
use std::time::{Duration, Instant};

/// How long a layer runs, untimed, before a round times it: the power controller settles
/// within it.
pub(super) const SETTLE: Duration = Duration::from_secs(1);

/// Timed runs of each layer in a round.
pub(super) const RUNS_A_ROUND: usize = 10;

/// Fewest rounds a token count gets (`--min-runs` asks for more).
pub(super) const FEWEST_ROUNDS: usize = 8;

/// One token count's rounds: each round's median time of the fp8 layer and of the bf16 one, ms.
pub(super) type Rounds = Vec<(f64, f64)>;

/// `rounds` rounds of `t` tokens on each layer: a layer runs for [`SETTLE`], then
/// [`RUNS_A_ROUND`] runs are timed. Rounds alternate which layer goes first (ABBA order).
pub(super) fn time_rounds(fp8: &Timed, bf16: &Timed, t: usize, rounds: usize, seed: u64) -> Result<Rounds> {
    let round = |layer: &Timed, r: usize| -> Result<f64> {
        let started = Instant::now();
        while started.elapsed() < SETTLE {
            layer.forward_timed(t, seed)?;
        }
        let runs: Vec<f64> = (0..RUNS_A_ROUND)
            .map(|i| layer.forward_timed(t, seed + (r * RUNS_A_ROUND + i) as u64).map(|s| s.total))
            .collect::<Result<_>>()?;
        Ok(median(&runs))
    };
    (0..rounds)
        .map(|r| {
            if r % 2 == 0 {
                let a = round(fp8, r)?;
                Ok((a, round(bf16, r)?))
            } else {
                let b = round(bf16, r)?;
                Ok((round(fp8, r)?, b))
            }
        })
        .collect()
}

/// What a token count's rounds say: the medians of the two layers' round times, ms, and the
/// median, least and greatest of the rounds' ratios (fp8 over bf16).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Comparison {
    pub fp8_ms: f64,
    pub bf16_ms: f64,
    pub ratio: f64,
    pub ratio_lo: f64,
    pub ratio_hi: f64,
}

impl Comparison {
    /// Sums up `rounds` (at least one; each time positive).
    pub(super) fn of(rounds: &[(f64, f64)]) -> Self {
        let ratios: Vec<f64> = rounds.iter().map(|&(a, b)| a / b).collect();
        Comparison {
            fp8_ms: median(&rounds.iter().map(|r| r.0).collect::<Vec<_>>()),
            bf16_ms: median(&rounds.iter().map(|r| r.1).collect::<Vec<_>>()),
            ratio: median(&ratios),
            ratio_lo: ratios.iter().copied().fold(f64::INFINITY, f64::min),
            ratio_hi: ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        }
    }
}

/// Prints the comparison's table, a row per token count.
pub(super) fn print(rows: &[(usize, Comparison)], rounds: usize) {
    println!(
        "against the bf16 layer (same shapes, seed and routing), each at its steady clock: {rounds} rounds, each \
         layer run for {} s and then {RUNS_A_ROUND} runs timed, alternating:",
        SETTLE.as_secs_f64()
    );
    println!("{:>7} {:>9} {:>9} {:>7}  {:>13}", "tokens", "fp8 ms", "bf16 ms", "ratio", "rounds' range");
    for (t, c) in rows {
        println!(
            "{:>7} {:>9.3} {:>9.3} {:>7.3}  {:>6.3}–{:<6.3}",
            t, c.fp8_ms, c.bf16_ms, c.ratio, c.ratio_lo, c.ratio_hi
        );
    }
}

/// Prints the fp8 layer's steady times against the records' floors at the sustained GEMM rate
/// (the rate after a second of load, as the steady times are); `rows` and `records` are both
/// in `--tokens` order.
pub(super) fn print_steady_floors(rows: &[(usize, Comparison)], records: &[super::Record]) {
    let each: Vec<String> = rows
        .iter()
        .zip(records)
        .filter_map(|((t, c), r)| Some(format!("T {t} {:.0}%", 100.0 * r.floor_sustained_ms? / c.fp8_ms)))
        .collect();
    println!("the fp8 layer at its steady clock reaches, of the sustained floor: {}", each.join(", "));
}

#[cfg(test)]
mod tests {
    use super::Comparison;

    /// The ratio is the median of the rounds' own ratios, not the ratio of the medians: a
    /// round where both layers ran slow (clocks down) says the same as one where both ran fast.
    #[test]
    fn the_ratio_is_taken_round_by_round() {
        let rounds = [(3.0, 6.0), (4.0, 5.0), (3.6, 4.0), (6.0, 12.0), (3.5, 7.0)];
        let c = Comparison::of(&rounds);
        assert_eq!(c.fp8_ms, 3.6);
        assert_eq!(c.bf16_ms, 6.0);
        assert_eq!(c.ratio, 0.5);
        assert_eq!(c.ratio_lo, 0.5);
        assert_eq!(c.ratio_hi, 0.9);
        // The ratio of the medians would be 0.6, which no round showed.
        assert!((c.fp8_ms / c.bf16_ms - 0.6).abs() < 1e-12);
    }

    #[test]
    fn one_round_is_its_own_summary() {
        let c = Comparison::of(&[(0.126, 0.21)]);
        assert_eq!((c.fp8_ms, c.bf16_ms), (0.126, 0.21));
        assert_eq!(c.ratio, 0.126 / 0.21);
        assert_eq!((c.ratio_lo, c.ratio_hi), (c.ratio, c.ratio));
    }
}
