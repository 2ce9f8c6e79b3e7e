//! [`HostRoute`]: a rank's routing as an all-to-all-v dispatch sends it, planned on the host
//! from the expert ids (the device all-to-all-v layer reads the ids once and uploads this).

use crate::placement::ExpertPlacement;

/// A rank's routing as the all-to-all-v dispatch sends it: for each `(token, slot)` the replica
/// that serves it (the placement's rule), the tokens for each destination in token order (a
/// token once per rank serving any of its slots), the ids each sent row carries (local to its
/// destination, -1 for slots served elsewhere), where each token's row to each rank went, and
/// the slots per physical expert.
pub struct HostRoute {
    /// Tokens sent to each destination rank.
    pub counts: Vec<usize>,
    /// The tokens of every sent row, destination after destination, each in token order.
    pub send_idx: Vec<i32>,
    /// `[sent, k]`: the ids of every sent row, local to its destination.
    pub send_ids: Vec<i32>,
    /// `[t, ranks]`: the sent row of token `t` to rank `d`, or -1.
    pub home_rows: Vec<i32>,
    /// Slots per physical expert.
    pub phys_counts: Vec<i32>,
}

/// Where each logical expert with a single replica is served: (rank, local slot, physical
/// id); `None` for experts with several replicas, whose replica depends on the token. Built
/// once per placement.
pub struct RouteTable {
    single: Vec<Option<(u32, i32, u32)>>,
}

impl RouteTable {
    /// The table of `placement`.
    pub fn new(placement: &ExpertPlacement) -> Self {
        let single = (0..placement.num_experts())
            .map(|e| match placement.replicas_of(e) {
                &[p] => {
                    let (r, s) = placement.physical_slot(p);
                    Some((r as u32, s as i32, p as u32))
                }
                _ => None,
            })
            .collect();
        RouteTable { single }
    }
}

impl HostRoute {
    /// The route of `t` tokens whose logical expert ids `[t, k]` are `ids`, with `table` built
    /// from `placement` and `shared` saying which experts' replicas share this batch
    /// ([`ExpertPlacement::shared_replicas`]). Two passes: each slot's destination and the
    /// tokens per destination, then every row written at its place.
    pub fn new(
        placement: &ExpertPlacement,
        table: &RouteTable,
        ids: &[i32],
        k: usize,
        t: usize,
        shared: &[bool],
    ) -> Self {
        let n = placement.ranks();
        let mut phys_counts = vec![0i32; placement.num_physical()];
        // Each slot's (destination, local slot), and the tokens per destination.
        let mut dest = vec![(0u32, 0i32); t * k];
        let mut counts = vec![0usize; n];
        let mut seen = vec![usize::MAX; n];
        for (tok, row) in ids.chunks_exact(k).enumerate().take(t) {
            for (j, &id) in row.iter().enumerate() {
                let (d, slot, p) = table.single[id as usize].unwrap_or_else(|| {
                    let p = placement.replica_of(id as usize, tok, j, shared[id as usize]);
                    let (r, s) = placement.physical_slot(p);
                    (r as u32, s as i32, p as u32)
                });
                phys_counts[p as usize] += 1;
                dest[tok * k + j] = (d, slot);
                if seen[d as usize] != tok {
                    seen[d as usize] = tok;
                    counts[d as usize] += 1;
                }
            }
        }
        let mut next: Vec<usize> = counts
            .iter()
            .scan(0, |acc, &c| {
                let first = *acc;
                *acc += c;
                Some(first)
            })
            .collect();
        let sent: usize = counts.iter().sum();
        let (mut send_idx, mut send_ids, mut home_rows) = (vec![0i32; sent], vec![-1i32; sent * k], vec![-1i32; t * n]);
        for tok in 0..t {
            for j in 0..k {
                let (d, slot) = dest[tok * k + j];
                let d = d as usize;
                let row = match home_rows[tok * n + d] {
                    -1 => {
                        let row = next[d];
                        next[d] += 1;
                        home_rows[tok * n + d] = row as i32;
                        send_idx[row] = tok as i32;
                        row
                    }
                    row => row as usize,
                };
                send_ids[row * k + j] = slot;
            }
        }
        HostRoute { counts, send_idx, send_ids, home_rows, phys_counts }
    }

    /// `[t, k]`: where each `(token, slot)`'s expert row lands when every destination returns
    /// the rows of the slots it serves in the order it received them (destination after
    /// destination, each in its token order, each token's served slots in slot order).
    pub fn slot_rows(&self, t: usize, k: usize) -> Vec<i32> {
        let mut rows = vec![-1i32; t * k];
        let mut next = 0;
        for (row, &tok) in self.send_idx.iter().enumerate() {
            for j in 0..k {
                if self.send_ids[row * k + j] >= 0 {
                    rows[tok as usize * k + j] = next;
                    next += 1;
                }
            }
        }
        rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every slot is served exactly once, by the replica the placement's rule picks, and every
    /// sent row carries exactly the slots its destination serves, as local slot ids.
    #[test]
    fn host_route_sends_each_slot_to_its_replica_once() {
        let p = ExpertPlacement::round_robin(5, 3).unwrap().with_replicas(&[1, 4]).unwrap();
        let (t, k) = (7, 3);
        let ids: Vec<i32> = (0..t * k).map(|i| ((i * 7 + i / k) % 5) as i32).collect();
        let r = HostRoute::new(&p, &RouteTable::new(&p), &ids, k, t, &[true; 5]);
        let mut served = vec![0; t * k];
        for (row, &tok) in r.send_idx.iter().enumerate() {
            let d = (0..3).find(|&d| r.home_rows[tok as usize * 3 + d] == row as i32).unwrap();
            for j in 0..k {
                let local = r.send_ids[row * k + j];
                let want = p.physical_slot(p.replica_for(ids[tok as usize * k + j] as usize, tok as usize, j));
                if want.0 == d {
                    assert_eq!(local, want.1 as i32, "token {tok} slot {j}");
                    served[tok as usize * k + j] += 1;
                } else {
                    assert_eq!(local, -1, "token {tok} slot {j} on rank {d}");
                }
            }
        }
        assert!(served.iter().all(|&s| s == 1), "{served:?}");
        // Every slot's returned row is distinct and they fill 0 .. t k.
        let mut rows = r.slot_rows(t, k);
        rows.sort_unstable();
        assert_eq!(rows, (0..(t * k) as i32).collect::<Vec<_>>());
        assert_eq!(r.phys_counts.iter().sum::<i32>() as usize, t * k);
        assert_eq!(r.counts.iter().sum::<usize>(), r.send_idx.len());
        // Rows go destination after destination, each in token order.
        let dests: Vec<usize> = (0..r.send_idx.len())
            .map(|row| (0..3).find(|&d| r.home_rows[r.send_idx[row] as usize * 3 + d] == row as i32).unwrap())
            .collect();
        assert!(dests.windows(2).all(|w| w[0] <= w[1]), "{dests:?}");
        assert!((1..r.send_idx.len()).all(|i| dests[i] != dests[i - 1] || r.send_idx[i] > r.send_idx[i - 1]));
        // No tokens: nothing sent.
        let empty = HostRoute::new(&p, &RouteTable::new(&p), &[], k, 0, &[true; 5]);
        assert!(empty.send_idx.is_empty() && empty.home_rows.is_empty());
    }

    /// An expert whose replicas do not share the batch has every slot on its first replica.
    #[test]
    fn unshared_replicas_send_every_slot_to_the_first() {
        let p = ExpertPlacement::contiguous(4, 2).unwrap().with_replicas(&[0, 3]).unwrap();
        let (t, k) = (6, 2);
        let ids: Vec<i32> = (0..t * k).map(|i| [0, 3][i % 2]).collect();
        // Six pairs each, fewer than 14 / 2.
        let shared = p.shared_replicas(&ids, 2, 14);
        assert_eq!(shared, vec![false, false, false, false]);
        let r = HostRoute::new(&p, &RouteTable::new(&p), &ids, k, t, &shared);
        // Expert 0 on rank 0 only, expert 3 on rank 1 only: every token once to each rank.
        assert_eq!(r.counts, vec![t, t]);
        let first = |e: usize| p.replicas_of(e)[0];
        let mut want = vec![0; p.num_physical()];
        want[first(0)] = t as i32;
        want[first(3)] = t as i32;
        assert_eq!(r.phys_counts, want);
        // Shared, both replicas of each serve some slots.
        let r = HostRoute::new(&p, &RouteTable::new(&p), &ids, k, t, &p.shared_replicas(&ids, 2, 0));
        assert!(p.replicas_of(0).iter().chain(p.replicas_of(3)).all(|&ph| r.phys_counts[ph] > 0));
    }
}
