//! [`HostRoute`]: a rank's routing as an all-to-all-v dispatch sends it, planned on the host
//! from the expert ids (the device all-to-all-v layer reads the ids once and uploads this).

use crate::placement::ExpertPlacement;

/// A rank's routing as the all-to-all-v dispatch sends it: for each `(token, slot)` the replica
/// that serves it (the placement's rule), the tokens for each destination in token order (a
/// token once per rank serving any of its slots), the ids each sent row carries (local to its
/// destination, -1 for slots served elsewhere), where each token's row to each rank went, and
/// the slots per physical expert.
pub struct HostRoute {
    /// Per destination rank, its tokens in order.
    pub lists: Vec<Vec<usize>>,
    /// The tokens of every sent row, destination after destination.
    pub send_idx: Vec<i32>,
    /// `[sent, k]`: the ids of every sent row, local to its destination.
    pub send_ids: Vec<i32>,
    /// `[t, ranks]`: the sent row of token `t` to rank `d`, or -1.
    pub home_rows: Vec<i32>,
    /// Slots per physical expert.
    pub phys_counts: Vec<i32>,
}

impl HostRoute {
    /// The route of `t` tokens whose logical expert ids `[t, k]` are `ids`.
    pub fn new(placement: &ExpertPlacement, ids: &[i32], k: usize, t: usize) -> Self {
        let n = placement.ranks();
        // Experts with one replica (the common case) resolve through one lookup.
        let single: Vec<Option<(usize, i32, usize)>> = (0..placement.num_experts())
            .map(|e| match placement.replicas_of(e) {
                &[p] => {
                    let (r, s) = placement.physical_slot(p);
                    Some((r, s as i32, p))
                }
                _ => None,
            })
            .collect();
        let mut lists: Vec<Vec<usize>> = (0..n).map(|_| Vec::with_capacity(t)).collect();
        let mut row_ids: Vec<Vec<i32>> = (0..n).map(|_| Vec::with_capacity(t * k)).collect();
        let mut phys_counts = vec![0i32; placement.num_physical()];
        // This token's ids for each destination, and the destinations it touched.
        let mut here = vec![-1i32; n * k];
        let mut touched: Vec<usize> = Vec::with_capacity(k);
        for (tok, row) in ids.chunks_exact(k).enumerate().take(t) {
            for (j, &id) in row.iter().enumerate() {
                let (d, slot, p) = single[id as usize].unwrap_or_else(|| {
                    let p = placement.replica_for(id as usize, tok, j);
                    let (r, s) = placement.physical_slot(p);
                    (r, s as i32, p)
                });
                phys_counts[p] += 1;
                if !touched.contains(&d) {
                    touched.push(d);
                }
                here[d * k + j] = slot;
            }
            touched.sort_unstable();
            for &d in &touched {
                lists[d].push(tok);
                row_ids[d].extend_from_slice(&here[d * k..(d + 1) * k]);
                here[d * k..(d + 1) * k].fill(-1);
            }
            touched.clear();
        }
        let sent: usize = lists.iter().map(Vec::len).sum();
        let (mut send_idx, mut home_rows) = (Vec::with_capacity(sent), vec![-1i32; t * n]);
        for (d, list) in lists.iter().enumerate() {
            for &tok in list {
                home_rows[tok * n + d] = send_idx.len() as i32;
                send_idx.push(tok as i32);
            }
        }
        HostRoute { lists, send_idx, send_ids: row_ids.concat(), home_rows, phys_counts }
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
        let r = HostRoute::new(&p, &ids, k, t);
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
        assert_eq!(r.lists.iter().map(Vec::len).sum::<usize>(), r.send_idx.len());
        // No tokens: nothing sent.
        let empty = HostRoute::new(&p, &[], k, 0);
        assert!(empty.send_idx.is_empty() && empty.home_rows.is_empty());
    }
}
