//! In-process ranks: every rank is a thread, messages go through shared mailboxes.
//!
//! Collectives are matched by a per-rank sequence number, so a fast rank may run ahead by any
//! number of calls without confusing a slow one. Waiting ranks poll a shared failure flag: an
//! error, a panic (via [`run_ranks`]) or a deadline anywhere fails the whole group, sub-groups
//! included, and every rank returns an error naming the first failure.

use super::{CommExt, Communicator, Failure, DEFAULT_TIMEOUT};
use crate::error::{MoeError, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How often a waiting rank re-checks the failure flag.
const POLL: Duration = Duration::from_millis(5);

struct Message {
    seq: u64,
    op: String,
    src: usize,
    data: Vec<u8>,
}

#[derive(Default)]
struct Inbox {
    queue: Mutex<Vec<Message>>,
    ready: Condvar,
}

/// State shared by the ranks of one group.
struct Group {
    size: usize,
    inboxes: Vec<Inbox>,
    /// First failure of the whole family of groups (shared with sub-groups).
    failure: Failure,
    /// Sub-groups created by `split`, by (sequence number, color).
    splits: Mutex<HashMap<(u64, usize), Arc<Group>>>,
    timeout: Duration,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Group {
    fn new(size: usize, timeout: Duration, failure: Failure) -> Arc<Group> {
        Arc::new(Group {
            size,
            inboxes: (0..size).map(|_| Inbox::default()).collect(),
            failure,
            splits: Mutex::new(HashMap::new()),
            timeout,
        })
    }
}

/// Constructor of in-process groups.
pub struct ThreadGroup;

impl ThreadGroup {
    /// `size` connected ranks whose collectives fail after `timeout`.
    pub fn create(size: usize, timeout: Duration) -> Vec<ThreadComm> {
        let group = Group::new(size, timeout, Failure::default());
        (0..size).map(|rank| ThreadComm { rank, group: group.clone(), seq: AtomicU64::new(0) }).collect()
    }
}

/// One rank of an in-process group.
pub struct ThreadComm {
    rank: usize,
    group: Arc<Group>,
    seq: AtomicU64,
}

impl ThreadComm {
    fn error(&self, op: &str, message: String) -> MoeError {
        MoeError::Comm { rank: self.rank, op: op.into(), message }
    }

    fn check_failure(&self, op: &str) -> Result<()> {
        match self.group.failure.get() {
            Some(reason) => Err(self.error(op, format!("group failed: {reason}"))),
            None => Ok(()),
        }
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.group.size
    }

    fn all_to_all_v(&self, op: &str, parts: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        self.check_failure(op)?;
        let size = self.group.size;
        if parts.len() != size {
            let e = format!("{} parts for {size} ranks", parts.len());
            self.abort(&format!("rank {} called {op} with {e}", self.rank));
            return Err(self.error(op, e));
        }
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        for (dst, data) in parts.into_iter().enumerate() {
            let inbox = &self.group.inboxes[dst];
            lock(&inbox.queue).push(Message { seq, op: op.to_string(), src: self.rank, data });
            inbox.ready.notify_all();
        }
        let deadline = Instant::now() + self.group.timeout;
        let inbox = &self.group.inboxes[self.rank];
        let mut got: Vec<Option<Vec<u8>>> = vec![None; size];
        let mut received = 0;
        let mut queue = lock(&inbox.queue);
        loop {
            let mut i = 0;
            while i < queue.len() {
                if queue[i].seq == seq {
                    let m = queue.swap_remove(i);
                    if m.op != op {
                        drop(queue);
                        let e =
                            format!("rank {} called {} while this rank called {op} (collective #{seq})", m.src, m.op);
                        self.abort(&e);
                        return Err(self.error(op, e));
                    }
                    got[m.src] = Some(m.data);
                    received += 1;
                } else {
                    i += 1;
                }
            }
            if received == size {
                return Ok(got.into_iter().map(|d| d.unwrap_or_default()).collect());
            }
            drop(queue);
            self.check_failure(op)?;
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (0..size).filter(|&r| got[r].is_none()).collect();
                let e = format!("timed out after {:?} waiting for ranks {missing:?}", self.group.timeout);
                self.abort(&format!("rank {} in {op}: {e}", self.rank));
                return Err(self.error(op, e));
            }
            queue = lock(&inbox.queue);
            let wait = POLL.min(deadline - now);
            queue = inbox.ready.wait_timeout(queue, wait).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator>> {
        let all: Vec<Vec<u64>> = self.all_gather_vec("split", &[color as u64, key as u64])?;
        let seq = self.seq.load(Ordering::SeqCst);
        let mut members: Vec<(u64, usize)> =
            all.iter().enumerate().filter(|(_, ck)| ck[0] == color as u64).map(|(r, ck)| (ck[1], r)).collect();
        members.sort();
        let rank = members.iter().position(|&(_, r)| r == self.rank).expect("this rank has its own color");
        let group = lock(&self.group.splits)
            .entry((seq, color))
            .or_insert_with(|| Group::new(members.len(), self.group.timeout, self.group.failure.clone()))
            .clone();
        Ok(Box::new(ThreadComm { rank, group, seq: AtomicU64::new(0) }))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn abort(&self, reason: &str) {
        self.group.failure.set(reason);
    }
}

/// The most in-process ranks: each is a thread of this process, and every collective moves
/// `ranks²` messages through memory.
pub const MAX_THREAD_RANKS: usize = 256;

/// Refuses more in-process ranks than [`MAX_THREAD_RANKS`].
pub fn check_thread_ranks(size: usize) -> Result<()> {
    if size > MAX_THREAD_RANKS {
        return Err(MoeError::Config(format!(
            "{size} in-process ranks: at most {MAX_THREAD_RANKS} (each is a thread of this process; launch processes for more)"
        )));
    }
    Ok(())
}

/// Runs `f` on `size` in-process ranks (one thread each) and returns every rank's result.
/// An error or a panic on one rank aborts the group, so the others return errors instead of
/// waiting: no call hangs past `timeout`.
pub fn run_ranks<T: Send>(
    size: usize,
    timeout: Option<Duration>,
    f: impl Fn(&ThreadComm) -> Result<T> + Sync,
) -> Vec<Result<T>> {
    let comms = ThreadGroup::create(size, timeout.unwrap_or(DEFAULT_TIMEOUT));
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .map(|comm| {
                let f = &f;
                s.spawn(move || super::run_rank(comm.rank, comm, || f(comm)))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(MoeError::Config("rank thread lost".into()))))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collectives_on_uneven_data() {
        for size in [1, 2, 3, 5] {
            let res = run_ranks(size, None, |c| {
                let r = c.rank();
                // All-gather-v with rank r contributing r elements (rank 0: none).
                let mine: Vec<i32> = (0..r as i32).collect();
                let all = c.all_gather_vec("ag", &mine)?;
                for (src, v) in all.iter().enumerate() {
                    assert_eq!(v, &(0..src as i32).collect::<Vec<_>>());
                }
                // All-to-all-v: rank r sends [r*10 + d; d] to rank d.
                let parts = (0..c.size()).map(|d| vec![(r * 10 + d) as u32; d]).collect();
                let got = c.all_to_all_vec::<u32>("a2a", parts)?;
                for (src, v) in got.iter().enumerate() {
                    assert_eq!(v, &vec![(src * 10 + r) as u32; r]);
                }
                let b = c.broadcast_vec("bc", size - 1, &[r as f32 + 0.5])?;
                assert_eq!(b, vec![(size - 1) as f32 + 0.5]);
                let s = c.all_reduce_sum("ar", &[r as f32, 1.0])?;
                assert_eq!(s, vec![(size * (size - 1) / 2) as f32, size as f32]);
                // Reduce-scatter: block d has d + 1 elements.
                let counts: Vec<usize> = (0..size).map(|d| d + 1).collect();
                let data: Vec<f32> = (0..counts.iter().sum::<usize>()).map(|i| (i * (r + 1)) as f32).collect();
                let rs = c.reduce_scatter_sum("rs", &data, &counts)?;
                let start: usize = counts[..r].iter().sum();
                let factor: usize = (1..=size).sum();
                assert_eq!(rs, (start..start + r + 1).map(|i| (i * factor) as f32).collect::<Vec<_>>());
                c.barrier()?;
                Ok(())
            });
            assert!(
                res.iter().all(|r| r.is_ok()),
                "{:?}",
                res.iter().filter_map(|r| r.as_ref().err()).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn split_into_sub_groups() {
        let res = run_ranks(6, None, |c| {
            // Two groups by parity, ordered by descending rank.
            let sub = c.split(c.rank() % 2, 10 - c.rank())?;
            assert_eq!(sub.size(), 3);
            let all = sub.all_gather_vec("ag", &[c.rank() as u32])?;
            let want: Vec<u32> = if c.rank() % 2 == 0 { vec![4, 2, 0] } else { vec![5, 3, 1] };
            assert_eq!(all.concat(), want);
            assert_eq!(want[sub.rank()], c.rank() as u32);
            Ok(())
        });
        assert!(res.iter().all(|r| r.is_ok()));
    }

    #[test]
    fn a_panic_or_error_on_one_rank_fails_every_rank_quickly() {
        let start = Instant::now();
        let res = run_ranks(4, Some(Duration::from_secs(30)), |c| {
            if c.rank() == 2 {
                panic!("boom on purpose");
            }
            c.barrier()?;
            Ok(())
        });
        assert!(start.elapsed() < Duration::from_secs(5), "no waiting for the deadline");
        for r in &res {
            let e = r.as_ref().unwrap_err().to_string();
            assert!(e.contains("boom on purpose") || e.contains("panicked"), "{e}");
        }
        let res = run_ranks(3, Some(Duration::from_secs(30)), |c| {
            if c.rank() == 0 {
                return Err(MoeError::Config("bad input on rank 0".into()));
            }
            c.barrier()
        });
        assert!(res.iter().all(|r| r.as_ref().unwrap_err().to_string().contains("bad input on rank 0")));
    }

    #[test]
    fn a_missing_rank_times_out_on_every_rank() {
        let start = Instant::now();
        let res = run_ranks(3, Some(Duration::from_millis(200)), |c| {
            if c.rank() != 1 {
                c.barrier()?;
            }
            Ok(())
        });
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(res[1].is_ok());
        let e = res[0].as_ref().unwrap_err().to_string();
        assert!(e.contains("timed out") && e.contains("barrier") && e.contains("[1]"), "{e}");
        assert!(res[2].is_err());
    }

    #[test]
    fn mismatched_collectives_are_an_error() {
        let res = run_ranks(2, Some(Duration::from_secs(10)), |c| {
            if c.rank() == 0 {
                c.barrier()
            } else {
                c.all_gather_v("gather", &[1]).map(|_| ())
            }
        });
        assert!(res.iter().all(|r| r.is_err()));
        assert!(res.iter().any(|r| r.as_ref().unwrap_err().to_string().contains("while this rank called")));
    }
}
