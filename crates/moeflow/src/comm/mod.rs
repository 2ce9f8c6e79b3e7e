//! Communicators: the collectives the strategies are written against.
//!
//! One primitive, [`Communicator::all_to_all_v`] (every rank sends a byte buffer to every
//! rank), is all an implementation must provide; every other collective has a default written
//! on top of it that a native backend (NCCL) may replace. Reductions sum in rank order, so they
//! are deterministic. Every call has a deadline; a failure on one rank becomes an error on all.

mod handshake;
mod job;
pub mod meeting;
mod rendezvous;
mod tcp;
mod threads;

pub use handshake::HANDSHAKE_DEADLINE;
pub use job::{JobId, MAX_JOB_LEN};
pub use rendezvous::{free_port, LaunchEnv, Rendezvous, HEARTBEAT};
pub use tcp::TcpComm;
pub use threads::{check_thread_ranks, run_ranks, ThreadComm, ThreadGroup, MAX_THREAD_RANKS};

use crate::error::{MoeError, Result};
use bytemuck::Pod;
use std::time::Duration;

/// Default deadline of a collective.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// The first failure of a job, shared by its ranks, sub-groups and liveness watchers: once
/// set, every pending and later collective returns an error carrying it.
#[derive(Clone, Debug, Default)]
pub struct Failure(std::sync::Arc<std::sync::Mutex<Option<String>>>);

impl Failure {
    /// Records `reason` unless a failure was recorded already.
    pub fn set(&self, reason: &str) {
        let mut f = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if f.is_none() {
            *f = Some(reason.to_string());
        }
    }
    /// The recorded failure.
    pub fn get(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// A group of ranks that exchange data collectively. All ranks of a group must call the same
/// collectives in the same order.
pub trait Communicator: Send + Sync {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// Sends `parts[r]` to rank `r` (one part per rank) and returns the part every rank sent to
    /// this one, indexed by source. `op` names the collective in errors.
    fn all_to_all_v(&self, op: &str, parts: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>>;
    /// Splits the group: ranks passing the same `color` form a new group, ordered by
    /// `(key, rank)`.
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator>>;
    /// Marks the group failed with `reason`: every rank's pending and later collectives return
    /// an error.
    fn abort(&self, reason: &str);
    /// The concrete communicator, for backends that drive it directly (the device-resident
    /// CUDA layer takes an NCCL communicator).
    fn as_any(&self) -> &dyn std::any::Any;

    /// Every rank's `data`, indexed by rank.
    fn all_gather_v(&self, op: &str, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.all_to_all_v(op, vec![data.to_vec(); self.size()])
    }
    /// `root`'s `data` on every rank (`data` is ignored elsewhere).
    fn broadcast(&self, op: &str, root: usize, data: &[u8]) -> Result<Vec<u8>> {
        let parts = if self.rank() == root { vec![data.to_vec(); self.size()] } else { vec![Vec::new(); self.size()] };
        Ok(self.all_to_all_v(op, parts)?.swap_remove(root))
    }
    /// Returns when every rank has called it.
    fn barrier(&self) -> Result<()> {
        self.all_to_all_v("barrier", vec![Vec::new(); self.size()]).map(|_| ())
    }
}

/// Runs one rank's body: a panic becomes an error naming the rank, and an error fails the
/// whole group, so the other ranks stop waiting for this one.
pub(crate) fn run_rank<T>(rank: usize, comm: &dyn Communicator, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        Err(MoeError::Comm { rank, op: "rank body".into(), message: format!("panicked: {msg}") })
    });
    if let Err(e) = &result {
        comm.abort(&format!("rank {rank} failed: {e}"));
    }
    result
}

/// Typed collectives over [`Communicator`]'s byte primitives.
pub trait CommExt: Communicator {
    /// All-gather of variable-length typed slices.
    fn all_gather_vec<T: Pod>(&self, op: &str, data: &[T]) -> Result<Vec<Vec<T>>> {
        Ok(self.all_gather_v(op, bytemuck::cast_slice(data))?.into_iter().map(|b| from_bytes(&b)).collect())
    }
    /// All-to-all of typed parts.
    fn all_to_all_vec<T: Pod>(&self, op: &str, parts: Vec<Vec<T>>) -> Result<Vec<Vec<T>>> {
        // Byte parts travel as they are; others as a copy of their bytes.
        let parts = parts
            .into_iter()
            .map(|p| {
                bytemuck::allocation::try_cast_vec::<T, u8>(p)
                    .unwrap_or_else(|(_, p)| bytemuck::cast_slice(&p).to_vec())
            })
            .collect();
        Ok(self.all_to_all_v(op, parts)?.into_iter().map(|b| from_bytes(&b)).collect())
    }
    /// Broadcast of a typed slice.
    fn broadcast_vec<T: Pod>(&self, op: &str, root: usize, data: &[T]) -> Result<Vec<T>> {
        Ok(from_bytes(&self.broadcast(op, root, bytemuck::cast_slice(data))?))
    }
    /// Element-wise sum of every rank's `data` (equal lengths), in rank order.
    fn all_reduce_sum(&self, op: &str, data: &[f32]) -> Result<Vec<f32>> {
        let all = self.all_gather_vec(op, data)?;
        sum_in_rank_order(op, self.rank(), &all, data.len())
    }
    /// Sums every rank's `data` element-wise and returns this rank's block; block `r` has
    /// `counts[r]` elements and `data.len()` is their total.
    fn reduce_scatter_sum(&self, op: &str, data: &[f32], counts: &[usize]) -> Result<Vec<f32>> {
        if counts.len() != self.size() || counts.iter().sum::<usize>() != data.len() {
            return Err(MoeError::Comm {
                rank: self.rank(),
                op: op.into(),
                message: format!("reduce-scatter counts {counts:?} do not cover {} elements", data.len()),
            });
        }
        let mut start = 0;
        let parts = counts
            .iter()
            .map(|&c| {
                let p = data[start..start + c].to_vec();
                start += c;
                p
            })
            .collect();
        let mine = self.all_to_all_vec(op, parts)?;
        sum_in_rank_order(op, self.rank(), &mine, counts[self.rank()])
    }
}

impl<C: Communicator + ?Sized> CommExt for C {}

fn from_bytes<T: Pod>(b: &[u8]) -> Vec<T> {
    // The received buffer may not be aligned for T: copy through an aligned vector.
    let n = b.len() / std::mem::size_of::<T>();
    let mut v = vec![T::zeroed(); n];
    bytemuck::cast_slice_mut(&mut v).copy_from_slice(&b[..n * std::mem::size_of::<T>()]);
    v
}

/// `Σ_r parts[r]`, summed in rank order starting from `-0.0` (so a sum with one non-zero
/// contributor reproduces it bit for bit).
fn sum_in_rank_order(op: &str, rank: usize, parts: &[Vec<f32>], len: usize) -> Result<Vec<f32>> {
    let mut out = vec![-0.0f32; len];
    for (src, p) in parts.iter().enumerate() {
        if p.len() != len {
            return Err(MoeError::Comm {
                rank,
                op: op.into(),
                message: format!("rank {src} contributed {} elements, expected {len}", p.len()),
            });
        }
        out.iter_mut().zip(p).for_each(|(o, &v)| *o += v);
    }
    Ok(out)
}
