//! A host-side meeting of the ranks of one communicator that run as threads of one process:
//! each arrives and waits, with a deadline, until all have. The NCCL backend meets this way
//! after destroying a communicator (see its `Drop`), so no rank starts GPU work that a
//! slower rank's destroy would wait behind.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long a rank waits at a meeting for the others.
pub const MEETING_DEADLINE: Duration = Duration::from_secs(10);

/// Waits on `news` until `done` holds for the value under `lock`, `give_up()` turns true or
/// `deadline` passes (checked at least every 10 ms); says whether `done` held.
pub(crate) fn wait_until<T>(
    lock: &Mutex<T>,
    news: &Condvar,
    deadline: Instant,
    give_up: impl Fn() -> bool,
    mut done: impl FnMut(&mut T) -> bool,
) -> bool {
    let mut value = lock.lock().unwrap_or_else(|p| p.into_inner());
    while !done(&mut value) {
        let now = Instant::now();
        if now >= deadline || give_up() {
            return false;
        }
        let step = (deadline - now).min(Duration::from_millis(10));
        value = news.wait_timeout(value, step).unwrap_or_else(|p| p.into_inner()).0;
    }
    true
}

/// A sub-group: (split number, colour).
type SubGroup = (u64, u64);
/// A sub-group's meeting and how many of its ranks took it so far.
type Handout = (Arc<Meeting>, usize);

/// The meeting of the `size` in-process ranks of one communicator, and the meetings of the
/// sub-groups split from it.
#[derive(Debug)]
pub struct Meeting {
    size: usize,
    arrived: Mutex<usize>,
    all_here: Condvar,
    /// Sub-group meetings being handed out.
    children: Mutex<HashMap<SubGroup, Handout>>,
}

impl Meeting {
    /// The meeting of `size` ranks.
    pub fn new(size: usize) -> Arc<Meeting> {
        Arc::new(Meeting {
            size,
            arrived: Mutex::new(0),
            all_here: Condvar::new(),
            children: Mutex::new(HashMap::new()),
        })
    }

    /// The meeting of the `size` ranks that got colour `color` in this communicator's split
    /// number `split` (every rank numbers its splits alike, since splits are collective).
    pub fn child(&self, split: u64, color: u64, size: usize) -> Arc<Meeting> {
        let mut children = self.children.lock().unwrap_or_else(|p| p.into_inner());
        let entry = children.entry((split, color)).or_insert_with(|| (Meeting::new(size), 0));
        entry.1 += 1;
        let meeting = entry.0.clone();
        if entry.1 == size {
            children.remove(&(split, color));
        }
        meeting
    }

    /// Arrives and waits until all ranks have, `give_up()` turns true (a failed job), or
    /// [`MEETING_DEADLINE`] passes; says whether all arrived.
    pub fn meet(&self, give_up: impl Fn() -> bool) -> bool {
        let deadline = Instant::now() + MEETING_DEADLINE;
        *self.arrived.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        self.all_here.notify_all();
        wait_until(&self.arrived, &self.all_here, deadline, give_up, |arrived| *arrived >= self.size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_leave_together_and_sub_groups_get_one_meeting_each() {
        let root = Meeting::new(3);
        let order = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for r in 0..3 {
                let (root, order) = (&root, &order);
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(30 * r as u64));
                    assert!(root.meet(|| false));
                    order.lock().unwrap().push(r);
                });
            }
        });
        assert_eq!(order.lock().unwrap().len(), 3);
        // Colours 0 (ranks 0, 2) and 1 (rank 1) of split 0: the same meeting for the same
        // colour, another for the other, and the hand-out forgotten once all took theirs.
        let (a, b, c) = (root.child(0, 0, 2), root.child(0, 1, 1), root.child(0, 0, 2));
        assert!(Arc::ptr_eq(&a, &c) && !Arc::ptr_eq(&a, &b));
        assert!(root.children.lock().unwrap().is_empty());
        assert!(b.meet(|| false));
    }

    #[test]
    fn a_missing_rank_or_a_failure_ends_the_wait() {
        let meeting = Meeting::new(2);
        let start = Instant::now();
        assert!(!meeting.meet(|| start.elapsed() > Duration::from_millis(50)));
        assert!(start.elapsed() < Duration::from_secs(5));
    }
}
