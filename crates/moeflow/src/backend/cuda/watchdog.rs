//! The last guard of a process rank against a host call into NCCL that does not return: a
//! blocking communicator's launch that waits on the host for a peer that died while the
//! connection was being set up, for one. Every call into a communicator is recorded here while
//! it runs ([`Activity::enter`]); a watchdog thread per process rank ends the process with an
//! error naming the call and the failure when one is still running [`GRACE`] after the job's
//! failure was recorded (a call that is not stuck sees the failure within microseconds), or
//! [`GRACE`] past its own deadline. PyTorch's NCCL watchdog ends a stuck process the same
//! way; a process stuck inside NCCL can neither finish nor be unwound.

use crate::comm::{Failure, Rendezvous};
use crate::error::MoeError;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// How long past a failure or a deadline a call may still be running before the process ends.
pub(super) const GRACE: Duration = Duration::from_secs(2);

/// How often the watchdog looks.
const LOOK: Duration = Duration::from_millis(100);

/// The calls into a job's communicators running now: id → (operation, start).
#[derive(Default)]
pub(super) struct Activity {
    calls: Mutex<BTreeMap<u64, (String, Instant)>>,
    next: AtomicU64,
}

/// A running call; it leaves the [`Activity`] when dropped.
pub(super) struct Call<'a> {
    activity: &'a Activity,
    id: u64,
}

impl Activity {
    /// Records that `op` runs from now until the returned guard is dropped.
    pub(super) fn enter(&self, op: &str) -> Call<'_> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.calls.lock().unwrap_or_else(|p| p.into_inner()).insert(id, (op.to_string(), Instant::now()));
        Call { activity: self, id }
    }

    /// The longest-running call now, if any.
    fn oldest(&self) -> Option<(String, Instant)> {
        let calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        calls.values().min_by_key(|(_, since)| *since).cloned()
    }
}

impl Drop for Call<'_> {
    fn drop(&mut self) {
        self.activity.calls.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.id);
    }
}

/// The peers `rendezvous` has not heard from for a few heartbeats, in words (empty if none).
pub(super) fn silence(rendezvous: Option<&Rendezvous>) -> String {
    let Some(r) = rendezvous else { return String::new() };
    r.silent_peers(4 * crate::comm::HEARTBEAT)
        .iter()
        .map(|(peer, d)| format!("; rank {peer} silent for {:.1} s (stopped, or not scheduled)", d.as_secs_f64()))
        .collect()
}

/// Starts the watchdog of process rank `rank` over `activity` (it ends with the last
/// communicator holding it): see the module documentation.
pub(super) fn start(
    rank: usize,
    timeout: Duration,
    activity: Weak<Activity>,
    failure: Failure,
    rendezvous: Arc<Rendezvous>,
) {
    std::thread::spawn(move || {
        let mut failed_at: Option<Instant> = None;
        loop {
            std::thread::sleep(LOOK);
            let Some(activity) = activity.upgrade() else { return };
            let reason = failure.get();
            if reason.is_some() && failed_at.is_none() {
                failed_at = Some(Instant::now());
            }
            let Some((op, since)) = activity.oldest() else { continue };
            let stuck_after_failure = failed_at.is_some_and(|at| at.elapsed() > GRACE && since < at);
            let stuck_past_deadline = since.elapsed() > timeout + GRACE;
            if !(stuck_after_failure || stuck_past_deadline) {
                continue;
            }
            let why = match reason {
                Some(reason) => format!("group failed: {reason}"),
                None => format!("no result after {:.1} s{}", since.elapsed().as_secs_f64(), silence(Some(&rendezvous))),
            };
            let message = format!("{why}; the call into NCCL did not return, so this process ends");
            let e = MoeError::Comm { rank, op, message };
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    });
}
