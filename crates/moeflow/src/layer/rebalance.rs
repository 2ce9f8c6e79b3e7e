//! Live rebalancing: a running expert-parallel layer takes a new placement between forward
//! calls, moving expert weights between ranks over its communicator.
//!
//! Three collective rounds over the layer's EP group, every rank taking part in each:
//! 1. **agree**: each rank checks the placement on its own (experts, ranks, a layer kept for
//!    rebalancing) and all ranks compare a fingerprint of it; any refusal or difference is an
//!    error on every rank before any weight moves.
//! 2. **move**: one all-to-all-v; each expert a rank newly holds comes, as stored (same dtype,
//!    codes and scales), from one of its holders under the old placement, chosen by a rule every
//!    rank computes alike. Each rank builds its new experts aside.
//! 3. **commit**: all ranks report whether they built theirs; only when all did does each swap
//!    in its new experts and placement. Otherwise (or when a rank fails or dies, which fails
//!    the collectives) every rank returns an error and keeps the old placement.
//!
//! The experts' weights are the same bits wherever they live, and the replica rule gives every
//! (token, slot) one replica, so the output is bit for bit the same before and after.

use super::MoeLayer;
use crate::comm::{CommExt, Communicator};
use crate::error::{MoeError, Result};
use crate::experts::{Activation, CpuExperts, ExpertWeights, Experts, QuantizedScales, ReferenceExperts};
use crate::layer::ExpertsKind;
use crate::placement::ExpertPlacement;
use crate::tensor::{CpuStorage, Tensor};
use std::sync::Arc;

/// How a layer builds its experts from weights (kept to rebuild them after a move).
#[derive(Clone, Copy, Debug)]
pub(super) struct ExpertsRecipe {
    pub kind: ExpertsKind,
    pub activation: Activation,
    pub quant: crate::quant::QuantConfig,
    pub defer_input_quant: bool,
    pub bf16_matmul: crate::Bf16Matmul,
}

impl ExpertsRecipe {
    /// The experts of `local` (this rank's experts in slot order).
    pub fn build(&self, local: &ExpertWeights) -> Result<Box<dyn Experts>> {
        Ok(match self.kind {
            ExpertsKind::Cpu => Box::new(
                CpuExperts::new(local, self.activation, self.bf16_matmul)?
                    .with_input_quant(self.quant)
                    .deferring_input_quant(self.defer_input_quant),
            ),
            ExpertsKind::Reference => Box::new(ReferenceExperts::new(local, self.activation)?),
            ExpertsKind::Cuda { device } => crate::backend::cuda::experts(local, self.activation, device)?,
        })
    }
}

/// A rebalanceable layer's experts as given, and how to build them.
pub(super) struct KeptExperts {
    pub weights: ExpertWeights,
    pub recipe: ExpertsRecipe,
}

impl MoeLayer {
    /// The placement this layer's experts follow (`None` on one rank, where every expert is
    /// local).
    pub fn placement(&self) -> Option<Arc<ExpertPlacement>> {
        self.strategy.ep().map(|ep| ep.placement.clone())
    }

    /// Takes `placement` between forward calls, moving expert weights between the ranks of the
    /// layer's expert-parallel group (collective: every rank calls it with the same placement).
    /// The layer must have been built with [`crate::LayerOptions::rebalanceable`]. A placement
    /// for other experts or ranks, or different on some rank, is refused before any weight
    /// moves; a failure on any rank during the move is an error on every rank, which keeps the
    /// old placement. Outputs are bit for bit the same before and after (see the module).
    pub fn rebalance(&mut self, placement: Arc<ExpertPlacement>) -> Result<()> {
        let ep = self.strategy.ep().ok_or_else(|| {
            MoeError::Config("rebalancing needs an expert-parallel layer; this one runs on one rank".into())
        })?;
        let (comm, old) = (ep.comm.clone(), ep.placement.clone());
        // 1. Agree.
        agree(&*comm, &placement, self.check_placement(&placement, comm.size()))?;
        // 2. Move, building the new experts aside.
        let kept = self.kept.as_ref().expect("checked above");
        let built = move_weights(&*comm, &old, &placement, &kept.weights).and_then(|w| Ok((kept.recipe.build(&w)?, w)));
        // 3. Commit only if every rank built its experts.
        let done = comm.all_gather_vec("rebalance.commit", &[u8::from(built.is_ok())])?;
        let (experts, weights) = built?;
        if let Some(r) = done.iter().position(|v| v[0] == 0) {
            return Err(MoeError::Config(format!(
                "rebalance: rank {r} could not take its experts; the old placement stays"
            )));
        }
        if experts.input_quant() != self.experts.input_quant() {
            return Err(MoeError::Config("rebalance: the rebuilt experts take another input format".into()));
        }
        self.experts = experts;
        self.kept.as_mut().expect("checked above").weights = weights;
        for strategy in std::iter::once(&mut self.strategy).chain(self.second.as_mut()) {
            if let Some(ep) = strategy.ep_mut() {
                ep.placement = placement.clone();
            }
        }
        Ok(())
    }

    /// This rank's own verdict on `placement` for a group of `ranks`.
    fn check_placement(&self, placement: &ExpertPlacement, ranks: usize) -> Result<()> {
        if self.kept.is_none() {
            return Err(MoeError::Config(
                "rebalance: the layer was not built rebalanceable (LayerOptions::rebalanceable)".into(),
            ));
        }
        if placement.num_experts() != self.config.num_experts || placement.ranks() != ranks {
            return Err(MoeError::Config(format!(
                "rebalance: the placement is for {} experts on {} ranks, the layer has {} experts on {ranks} ranks",
                placement.num_experts(),
                placement.ranks(),
                self.config.num_experts
            )));
        }
        Ok(())
    }
}

/// Step 1 of a move, collective over `comm`: every rank reports whether it accepts `placement`
/// (`checked`, its own verdict) and which placement it was given; an error on every rank when
/// one refused or was given another, before anything moves.
pub(crate) fn agree(comm: &dyn Communicator, placement: &ExpertPlacement, checked: Result<()>) -> Result<()> {
    let fingerprint = fingerprint(placement);
    let votes = comm.all_gather_vec("rebalance.agree", &[u64::from(checked.is_ok()), fingerprint])?;
    checked?;
    if let Some(r) = votes.iter().position(|v| v[0] == 0) {
        return Err(MoeError::Config(format!("rebalance: rank {r} refused the placement; nothing moved")));
    }
    if let Some(r) = votes.iter().position(|v| v[1] != fingerprint) {
        return Err(MoeError::Config(format!("rebalance: rank {r} was given a different placement; nothing moved")));
    }
    Ok(())
}

/// A hash of the placement's slots, equal on every rank for equal placements.
fn fingerprint(p: &ExpertPlacement) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (p.num_experts(), p.ranks()).hash(&mut h);
    (0..p.ranks()).for_each(|r| p.local_experts(r).hash(&mut h));
    h.finish()
}

/// Per destination rank: `(expert, source rank)` of each expert it newly holds, in its new slot
/// order; the source is one of the expert's old holders, `holders[dst mod holders]`.
pub(crate) fn transfers(old: &ExpertPlacement, new: &ExpertPlacement) -> Vec<Vec<(usize, usize)>> {
    (0..new.ranks())
        .map(|dst| {
            new.local_experts(dst)
                .iter()
                .filter(|x| !old.local_experts(dst).contains(x))
                .map(|&x| {
                    let holders = old.replicas_of(x);
                    (x, old.rank_of(holders[dst % holders.len()]))
                })
                .collect()
        })
        .collect()
}

/// The tensors of an expert stack, in a fixed order: w13, w2, then the optional biases and
/// scales that are present.
fn tensors(w: &ExpertWeights) -> Vec<&Tensor> {
    let scales = w.quant.as_ref().map(|q| [&q.w13, &q.w2]);
    [Some(&w.w13), Some(&w.w2), w.b13.as_ref(), w.b2.as_ref()]
        .into_iter()
        .flatten()
        .chain(scales.into_iter().flatten())
        .collect()
}

/// Bytes of one expert of `t` (`[E, ...]`).
fn expert_bytes(t: &Tensor) -> usize {
    t.shape()[1..].iter().product::<usize>() * t.dtype().size_in_bytes()
}

/// The tensor's elements as little-endian bytes.
fn to_bytes(t: &Tensor) -> Vec<u8> {
    match t.cpu() {
        CpuStorage::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        CpuStorage::BF16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        CpuStorage::F16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        CpuStorage::F8E4M3(v) => v.iter().map(|x| x.to_bits()).collect(),
        CpuStorage::F8E5M2(v) => v.iter().map(|x| x.to_bits()).collect(),
        CpuStorage::I8(v) => v.iter().map(|&x| x as u8).collect(),
        CpuStorage::I32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// A tensor of `like`'s type with `experts` experts from `bytes` (as [`to_bytes`] writes them).
fn from_bytes(like: &Tensor, experts: usize, bytes: &[u8]) -> Result<Tensor> {
    let mut shape = like.shape().to_vec();
    shape[0] = experts;
    let two = |b: &[u8]| u16::from_le_bytes([b[0], b[1]]);
    let four = |b: &[u8]| [b[0], b[1], b[2], b[3]];
    let storage = match like.cpu() {
        CpuStorage::F32(_) => CpuStorage::F32(bytes.chunks_exact(4).map(|b| f32::from_le_bytes(four(b))).collect()),
        CpuStorage::BF16(_) => CpuStorage::BF16(bytes.chunks_exact(2).map(|b| half::bf16::from_bits(two(b))).collect()),
        CpuStorage::F16(_) => CpuStorage::F16(bytes.chunks_exact(2).map(|b| half::f16::from_bits(two(b))).collect()),
        CpuStorage::F8E4M3(_) => CpuStorage::F8E4M3(bytes.iter().map(|&b| float8::F8E4M3::from_bits(b)).collect()),
        CpuStorage::F8E5M2(_) => CpuStorage::F8E5M2(bytes.iter().map(|&b| float8::F8E5M2::from_bits(b)).collect()),
        CpuStorage::I8(_) => CpuStorage::I8(bytes.iter().map(|&b| b as i8).collect()),
        CpuStorage::I32(_) => CpuStorage::I32(bytes.chunks_exact(4).map(|b| i32::from_le_bytes(four(b))).collect()),
    };
    Tensor::new(&shape, storage)
}

/// Sends the experts other ranks newly hold and returns this rank's experts under `new`, in
/// its new slot order (one all-to-all-v over `comm`).
fn move_weights(
    comm: &dyn Communicator,
    old: &ExpertPlacement,
    new: &ExpertPlacement,
    mine: &ExpertWeights,
) -> Result<ExpertWeights> {
    let rank = comm.rank();
    let plan = transfers(old, new);
    let held = old.local_experts(rank);
    let parts_of = tensors(mine);
    let bytes: Vec<Vec<u8>> = parts_of.iter().map(|t| to_bytes(t)).collect();
    let sizes: Vec<usize> = parts_of.iter().map(|t| expert_bytes(t)).collect();
    let per_expert: usize = sizes.iter().sum();
    // One expert's bytes: its chunk of every tensor, in order.
    let chunk = |slot: usize| -> Vec<u8> {
        bytes.iter().zip(&sizes).flat_map(|(b, &n)| b[slot * n..(slot + 1) * n].iter().copied()).collect()
    };
    let outgoing = plan
        .iter()
        .map(|wants| {
            wants
                .iter()
                .filter(|(_, src)| *src == rank)
                .flat_map(|(x, _)| chunk(held.iter().position(|h| h == x).expect("a source holds its expert")))
                .collect()
        })
        .collect();
    let received = comm.all_to_all_v("rebalance.weights", outgoing)?;
    // Where each source's experts start in its message.
    let mut from_source: Vec<Vec<usize>> = vec![Vec::new(); comm.size()];
    for &(x, src) in &plan[rank] {
        from_source[src].push(x);
    }
    for (src, (msg, xs)) in received.iter().zip(&from_source).enumerate() {
        if msg.len() != xs.len() * per_expert {
            return Err(MoeError::Comm {
                rank,
                op: "rebalance.weights".into(),
                message: format!(
                    "rank {src} sent {} bytes for experts {xs:?}, expected {}",
                    msg.len(),
                    xs.len() * per_expert
                ),
            });
        }
    }
    let new_local = new.local_experts(rank);
    let mut stacked: Vec<Vec<u8>> = vec![Vec::new(); sizes.len()];
    for &x in new_local {
        let one: Vec<u8> = match held.iter().position(|&h| h == x) {
            Some(slot) => chunk(slot),
            None => {
                let src = plan[rank].iter().find(|(y, _)| *y == x).expect("planned").1;
                let at = from_source[src].iter().position(|&y| y == x).expect("planned");
                received[src][at * per_expert..(at + 1) * per_expert].to_vec()
            }
        };
        let mut offset = 0;
        for (t, &n) in stacked.iter_mut().zip(&sizes) {
            t.extend_from_slice(&one[offset..offset + n]);
            offset += n;
        }
    }
    let n = new_local.len();
    let mut rebuilt = parts_of.iter().zip(&stacked).map(|(like, b)| from_bytes(like, n, b));
    let mut next = || rebuilt.next().expect("one tensor per part");
    let (w13, w2) = (next()?, next()?);
    let b13 = mine.b13.as_ref().map(|_| next()).transpose()?;
    let b2 = mine.b2.as_ref().map(|_| next()).transpose()?;
    let quant = match &mine.quant {
        None => None,
        Some(q) => Some(QuantizedScales { format: q.format, w13: next()?, w2: next()? }),
    };
    Ok(ExpertWeights { w13, w2, b13, b2, quant })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_new_slot_comes_from_an_old_holder() {
        let old = ExpertPlacement::contiguous(6, 3).unwrap().with_replicas(&[0]).unwrap();
        let new = ExpertPlacement::from_slots(6, vec![vec![5, 0], vec![1, 2, 0], vec![3, 4]]).unwrap();
        let plan = transfers(&old, &new);
        assert_eq!(plan[0], vec![(5, 2)]);
        // Expert 0 is on ranks 0 and 1 already; rank 1 keeps its copy and gets expert 1.
        assert_eq!(plan[1], vec![(1, 0)]);
        assert_eq!(plan[2], vec![(3, 1)]);
        for (dst, wants) in plan.iter().enumerate() {
            for &(x, src) in wants {
                assert!(old.local_experts(src).contains(&x) && !old.local_experts(dst).contains(&x));
            }
        }
        assert_ne!(fingerprint(&old), fingerprint(&new));
        assert_eq!(fingerprint(&new), fingerprint(&new.clone()));
    }

    #[test]
    fn tensors_round_trip_through_bytes() {
        use crate::DType;
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::F8E4M3, DType::I8] {
            let t =
                Tensor::from_f32_as(&[3, 2, 2], &(0..12).map(|i| i as f32 - 5.0).collect::<Vec<_>>(), dtype).unwrap();
            let b = to_bytes(&t);
            assert_eq!(b.len(), 3 * expert_bytes(&t));
            assert_eq!(from_bytes(&t, 3, &b).unwrap(), t);
            assert_eq!(
                from_bytes(&t, 1, &b[expert_bytes(&t)..2 * expert_bytes(&t)]).unwrap(),
                t.index_select0(&[1]).unwrap()
            );
        }
    }
}
