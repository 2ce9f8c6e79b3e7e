//! The NCCL [`Communicator`]: one rank per GPU, either one thread per GPU in this process
//! ([`run_ranks_nccl`]) or one process per GPU joined through the launcher's environment
//! ([`NcclComm::from_env`]).
//!
//! Communicators are non-blocking (`ncclConfig_t::blocking = 0`), so that initialisation,
//! connection setup and every collective are polled rather than waited on: a collective that
//! passes its deadline, or a peer failure recorded in the shared [`Failure`] (another thread's
//! error, or a dead process seen by the [`Rendezvous`] liveness channel), aborts the
//! communicator with `ncclCommAbort` and returns an error naming this rank and the operation.
//!
//! The one exception is the communicator a layer keeps for its device-side exchanges
//! ([`NcclComm::duplicate`]): a non-blocking group launch hands its work to a thread NCCL
//! creates for it, which costs several times the host time of a launch by the calling thread
//! (the GPU waits for it twice per layer; docs/tuning.md). That
//! communicator is blocking, and is connected to every peer by a warm-up right after its
//! (polled) creation, so its later launches do not wait on peers; its device work is still
//! awaited by polling, against the deadline.
//!
//! Byte collectives go through device staging buffers: the sizes are all-gathered on the
//! device, then the parts travel with one grouped `ncclSend`/`ncclRecv`.

use super::err;
use super::watchdog::{self, Activity};
use crate::comm::meeting::{Meeting, MEETING_DEADLINE};
use crate::comm::{Communicator, Failure, LaunchEnv, Rendezvous};
use crate::error::{MoeError, Result};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use cudarc::nccl::sys as nc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// NCCL calls on communicators of the same device must not run concurrently from several
/// threads (NCCL's thread-safety rules); dual-batch overlap drives two communicators per
/// device from two threads, so every NCCL call takes its device's lock. Calls are non-blocking,
/// so the lock is only ever held briefly.
static DEVICE_API: [Mutex<()>; 64] = [const { Mutex::new(()) }; 64];

fn api(device: usize) -> std::sync::MutexGuard<'static, ()> {
    DEVICE_API[device % 64].lock().unwrap_or_else(|p| p.into_inner())
}

/// A raw NCCL communicator handle.
struct RawComm(nc::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; `NcclComm` serialises them behind its `state` mutex.
unsafe impl Send for RawComm {}
// SAFETY: as above.
unsafe impl Sync for RawComm {}

/// Staging buffers and the handle, used under one lock.
struct State {
    comm: RawComm,
    aborted: bool,
    send: Option<CudaSlice<u8>>,
    recv: Option<CudaSlice<u8>>,
    sizes: Option<CudaSlice<u64>>,
    /// Whether NCCL launches this communicator's work on the calling thread (see the module
    /// documentation).
    blocking: bool,
}

impl State {
    /// A fresh handle's state: not aborted, no staging buffers yet.
    fn new(raw: nc::ncclComm_t, blocking: bool) -> Self {
        State { comm: RawComm(raw), aborted: false, send: None, recv: None, sizes: None, blocking }
    }
}

/// Where the ranks of a communicator meet on the host after destroying it.
enum Teardown {
    /// Ranks that are threads of this process.
    Threads(Arc<Meeting>),
    /// Ranks in separate processes of one job, meeting through its rendezvous at `key`.
    Job { rendezvous: Arc<Rendezvous>, key: u64, size: usize },
}

impl Teardown {
    /// The meeting of the `size` ranks that got colour `color` in split number `split`
    /// (every rank numbers its splits alike, since splits are collective).
    fn child(&self, split: u64, color: u64, size: usize) -> Teardown {
        match self {
            Teardown::Threads(m) => Teardown::Threads(m.child(split, color, size)),
            Teardown::Job { rendezvous, key, .. } => {
                // A key no other communicator of the job gets (splitmix64 of the three).
                let mut z = key ^ split.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ color.wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                Teardown::Job { rendezvous: rendezvous.clone(), key: z ^ (z >> 31), size }
            }
        }
    }

    /// Arrives and waits for the other ranks ([`MEETING_DEADLINE`] at most, less once the job
    /// failed).
    fn meet(&self, give_up: impl Fn() -> bool) {
        match self {
            Teardown::Threads(m) => {
                m.meet(give_up);
            }
            Teardown::Job { rendezvous, key, size } => {
                rendezvous.meet(*key, *size, Instant::now() + MEETING_DEADLINE, give_up);
            }
        }
    }
}

/// One rank of an NCCL group.
pub struct NcclComm {
    rank: usize,
    size: usize,
    device: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    state: Mutex<State>,
    failure: Failure,
    /// The job's liveness channel (multi-process jobs): own failures are sent to every peer.
    rendezvous: Option<Arc<Rendezvous>>,
    /// Where this communicator's ranks meet after destroying it (see `Drop`).
    teardown: Teardown,
    /// Splits of this communicator so far (the same count on every rank).
    splits: AtomicU64,
    timeout: Duration,
    /// The calls into this job's communicators running now (see [`super::watchdog`]).
    activity: Arc<Activity>,
}

/// How long a failing process rank waits for the liveness channel to name a lost peer.
const PEER_NEWS: Duration = Duration::from_millis(500);

fn nccl_name(r: nc::ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any result code.
    let s = unsafe { std::ffi::CStr::from_ptr(nc::ncclGetErrorString(r)) };
    format!("{} ({r:?})", s.to_string_lossy())
}

/// A communicator configuration (NCCL_CONFIG_INITIALIZER with `blocking` set).
fn config(blocking: bool) -> nc::ncclConfig_t {
    let mut version = 0;
    // SAFETY: writes one int.
    unsafe { nc::ncclGetVersion(&mut version) };
    let undef = i32::MIN;
    nc::ncclConfig_t {
        size: std::mem::size_of::<nc::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: version as u32,
        blocking: i32::from(blocking),
        cgaClusterSize: undef,
        minCTAs: undef,
        maxCTAs: undef,
        netName: std::ptr::null(),
        splitShare: undef,
        trafficClass: undef,
        commName: std::ptr::null(),
        collnetEnable: undef,
        CTAPolicy: undef,
        shrinkShare: undef,
        nvlsCTAs: undef,
        nChannelsPerNetPeer: undef,
        nvlinkCentricSched: undef,
        graphUsageMode: undef,
        numRmaCtx: undef,
        maxP2pPeers: undef,
    }
}

/// Opens the CUDA context of GPU `ordinal`; a clear error without a driver or that GPU.
pub(super) fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    // SAFETY: only probes whether the CUDA driver library can be loaded.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(MoeError::Unsupported("no CUDA driver found (libcuda.so); use --backend cpu".into()));
    }
    let count = CudaContext::device_count().map_err(|e| err("counting devices", e))?;
    if ordinal as i32 >= count {
        return Err(MoeError::Unsupported(format!("CUDA device {ordinal} requested, {count} present")));
    }
    CudaContext::new(ordinal).map_err(|e| err("creating context", e))
}

fn nccl_present() -> Result<()> {
    // SAFETY: only probes whether libnccl can be loaded.
    if unsafe { nc::is_culib_present() } {
        Ok(())
    } else {
        Err(MoeError::Unsupported("NCCL (libnccl.so.2) not found; multi-GPU runs need it".into()))
    }
}

/// A fresh NCCL unique id (128 opaque bytes).
fn unique_id() -> Result<Vec<u8>> {
    nccl_present()?;
    let mut id = nc::ncclUniqueId { internal: [0; 128] };
    // SAFETY: writes the 128-byte id.
    let r = unsafe { nc::ncclGetUniqueId(&mut id) };
    if r != nc::ncclResult_t::ncclSuccess {
        return Err(MoeError::Unsupported(format!("ncclGetUniqueId: {}", nccl_name(r))));
    }
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

impl NcclComm {
    #[allow(clippy::too_many_arguments)]
    fn new(
        rank: usize,
        size: usize,
        device: usize,
        id: &[u8],
        failure: Failure,
        rendezvous: Option<Arc<Rendezvous>>,
        teardown: Teardown,
        timeout: Duration,
    ) -> Result<NcclComm> {
        nccl_present()?;
        let activity = Arc::new(Activity::default());
        if let Some(r) = &rendezvous {
            watchdog::start(rank, timeout, Arc::downgrade(&activity), failure.clone(), r.clone());
        }
        let _call = activity.enter("init");
        if id.len() != 128 {
            return Err(MoeError::Comm { rank, op: "init".into(), message: format!("NCCL id of {} bytes", id.len()) });
        }
        let ctx = context(device)?;
        ctx.bind_to_thread().map_err(|e| err("binding context", e))?;
        let stream = ctx.new_stream().map_err(|e| err("creating stream", e))?;
        let mut uid = nc::ncclUniqueId { internal: [0; 128] };
        uid.internal.iter_mut().zip(id).for_each(|(d, &s)| *d = s as _);
        let mut raw: nc::ncclComm_t = std::ptr::null_mut();
        let blocking = false;
        let mut cfg = config(blocking);
        // SAFETY: the context of `device` is current on this thread; `raw` receives the handle.
        let r = {
            let _api = api(device);
            unsafe { nc::ncclCommInitRankConfig(&mut raw, size as i32, uid, rank as i32, &mut cfg) }
        };
        let me = NcclComm {
            rank,
            size,
            device,
            ctx,
            stream,
            state: Mutex::new(State::new(raw, blocking)),
            failure,
            rendezvous,
            teardown,
            splits: AtomicU64::new(0),
            timeout,
            activity: activity.clone(),
        };
        let mut st = me.lock();
        me.check_launch(&mut st, "init", r)?;
        me.wait_ready(&mut st, "init", Instant::now() + timeout)?;
        drop(st);
        Ok(me)
    }

    /// Joins the multi-process job described by `env` on GPU `env.local_rank`: rank 0 creates
    /// the NCCL id and hands it out through the TCP rendezvous.
    pub fn from_env(env: &LaunchEnv, timeout: Duration) -> Result<NcclComm> {
        let (id, rdv) = Rendezvous::join(env, unique_id, timeout)?;
        let rdv = Arc::new(rdv);
        let teardown = Teardown::Job { rendezvous: rdv.clone(), key: 0, size: env.world_size };
        Self::new(env.rank, env.world_size, env.local_rank, &id, rdv.failure(), Some(rdv), teardown, timeout)
    }

    /// The GPU's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn error(&self, op: &str, message: String) -> MoeError {
        MoeError::Comm { rank: self.rank, op: op.into(), message }
    }

    /// Aborts the communicator after `reason` and tells the peers. A peer's death often
    /// reaches NCCL (as a system error) before the liveness channel reports it: a process
    /// rank waits up to [`PEER_NEWS`] for the channel to name the lost peer in the error.
    fn fail(&self, st: &mut State, op: &str, reason: String) -> MoeError {
        let reason = match self.peer_failure_soon() {
            Some(peer) => format!("{reason}; group failed: {peer}"),
            None => reason,
        };
        let first = format!("rank {} in {op}: {reason}", self.rank);
        self.failure.set(&first);
        if let Some(r) = &self.rendezvous {
            r.abort(&first);
        }
        Self::abort_raw(self.device, st);
        self.error(op, reason)
    }

    /// The job's failure as the liveness channel reports it within [`PEER_NEWS`] (process
    /// ranks only; `None` when none comes).
    fn peer_failure_soon(&self) -> Option<String> {
        self.rendezvous.as_ref()?;
        let until = Instant::now() + PEER_NEWS;
        loop {
            if let Some(reason) = self.failure.get() {
                return Some(reason);
            }
            if Instant::now() >= until {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn abort_raw(device: usize, st: &mut State) {
        if !st.aborted {
            st.aborted = true;
            let _api = api(device);
            // SAFETY: the handle is valid and not used after this.
            unsafe { nc::ncclCommAbort(st.comm.0) };
        }
    }

    /// Fails fast when the group already failed.
    fn check_failure(&self, st: &mut State, op: &str) -> Result<()> {
        if let Some(reason) = self.failure.get() {
            Self::abort_raw(self.device, st);
            return Err(self.error(op, format!("group failed: {reason}")));
        }
        if st.aborted {
            return Err(self.error(op, "communicator was aborted".into()));
        }
        Ok(())
    }

    fn check_launch(&self, st: &mut State, op: &str, r: nc::ncclResult_t) -> Result<()> {
        match r {
            nc::ncclResult_t::ncclSuccess | nc::ncclResult_t::ncclInProgress => Ok(()),
            r => Err(self.fail(st, op, format!("NCCL returned {}", nccl_name(r)))),
        }
    }

    /// Polls until the communicator's pending host-side work (init, split, group launch) is done.
    fn wait_ready(&self, st: &mut State, op: &str, deadline: Instant) -> Result<()> {
        let mut spins = 0u32;
        loop {
            let mut state = nc::ncclResult_t::ncclSuccess;
            // SAFETY: valid handle; writes one result code.
            let r = {
                let _api = api(self.device);
                unsafe { nc::ncclCommGetAsyncError(st.comm.0, &mut state) }
            };
            if r != nc::ncclResult_t::ncclSuccess {
                return Err(self.fail(st, op, format!("ncclCommGetAsyncError: {}", nccl_name(r))));
            }
            match state {
                nc::ncclResult_t::ncclSuccess => return Ok(()),
                nc::ncclResult_t::ncclInProgress => {}
                other => return Err(self.fail(st, op, format!("NCCL reported {}", nccl_name(other)))),
            }
            self.tick(st, op, deadline, &mut spins)?;
        }
    }

    /// One step of a polling loop: checks the failure flag and the deadline, then backs off.
    fn tick(&self, st: &mut State, op: &str, deadline: Instant, spins: &mut u32) -> Result<()> {
        if let Some(reason) = self.failure.get() {
            Self::abort_raw(self.device, st);
            return Err(self.error(op, format!("group failed: {reason}")));
        }
        if Instant::now() >= deadline {
            let silent = watchdog::silence(self.rendezvous.as_deref());
            return Err(self.fail(st, op, format!("timed out after {:?}{silent}", self.timeout)));
        }
        *spins += 1;
        if *spins < 1000 {
            std::hint::spin_loop();
        } else if *spins < 2000 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(100));
        }
        Ok(())
    }

    /// Polls until the work enqueued so far on `stream` completed.
    fn wait_stream(&self, st: &mut State, op: &str, deadline: Instant, stream: &CudaStream) -> Result<()> {
        let ev = stream.record_event(None).map_err(|e| self.fail(st, op, format!("event: {e:?}")))?;
        self.wait_recorded(st, op, deadline, &ev)
    }

    /// Polls until `ev` has completed, with [`NcclComm::tick`]'s checks.
    fn wait_recorded(&self, st: &mut State, op: &str, deadline: Instant, ev: &cudarc::driver::CudaEvent) -> Result<()> {
        let mut spins = 0u32;
        loop {
            match ev.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(self.fail(st, op, format!("CUDA error while waiting: {e:?}"))),
            }
            let mut state = nc::ncclResult_t::ncclSuccess;
            // SAFETY: valid handle; writes one result code.
            {
                let _api = api(self.device);
                unsafe { nc::ncclCommGetAsyncError(st.comm.0, &mut state) };
            }
            if !matches!(state, nc::ncclResult_t::ncclSuccess | nc::ncclResult_t::ncclInProgress) {
                return Err(self.fail(st, op, format!("NCCL reported {}", nccl_name(state))));
            }
            self.tick(st, op, deadline, &mut spins)?;
        }
    }

    fn ensure<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        stream: &Arc<CudaStream>,
        buf: &mut Option<CudaSlice<T>>,
        len: usize,
    ) -> Result<()> {
        if buf.as_ref().is_none_or(|b| b.len() < len) {
            *buf = Some(stream.alloc_zeros::<T>(len.max(1).next_power_of_two()).map_err(|e| err("staging alloc", e))?);
        }
        Ok(())
    }

    fn exchange(&self, st: &mut State, op: &str, parts: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        let _call = self.activity.enter(op);
        let n = self.size;
        let deadline = Instant::now() + self.timeout;
        let s = &self.stream;
        let comm = st.comm.0;
        let cs = s.cu_stream() as nc::cudaStream_t;
        // Sizes: every rank's row of the [n, n] size matrix.
        let mine: Vec<u64> = parts.iter().map(|p| p.len() as u64).collect();
        Self::ensure(s, &mut st.sizes, n * (n + 1))?;
        let sizes = st.sizes.as_mut().expect("allocated");
        s.memcpy_htod(&mine, &mut sizes.slice_mut(0..n)).map_err(|e| err("copying sizes", e))?;
        let r = {
            let (src, _g1) = sizes.device_ptr(s);
            let dst = src + (n * 8) as u64;
            let _api = api(self.device);
            // SAFETY: the staging buffer holds n + n·n u64 values; the stream is this comm's.
            unsafe { nc::ncclAllGather(src as _, dst as _, n, nc::ncclDataType_t::ncclUint64, comm, cs) }
        };
        self.check_launch(st, op, r)?;
        self.wait_ready(st, op, deadline)?;
        self.wait_stream(st, op, deadline, s)?;
        let mut all = vec![0u64; n * (n + 1)];
        s.memcpy_dtoh(&st.sizes.as_ref().expect("allocated").slice(0..all.len()), &mut all)
            .map_err(|e| err("reading sizes", e))?;
        let recv_sizes: Vec<usize> = (0..n).map(|src| all[n + src * n + self.rank] as usize).collect();
        // Payloads.
        let send_total: usize = mine.iter().sum::<u64>() as usize;
        let recv_total: usize = recv_sizes.iter().sum();
        if send_total + recv_total > 0 {
            Self::ensure(s, &mut st.send, send_total)?;
            Self::ensure(s, &mut st.recv, recv_total)?;
            let packed: Vec<u8> = parts.concat();
            if send_total > 0 {
                let send = st.send.as_mut().expect("allocated");
                s.memcpy_htod(&packed, &mut send.slice_mut(0..send_total)).map_err(|e| err("staging", e))?;
            }
            let sp = st.send.as_ref().expect("allocated").device_ptr(s).0;
            let rp = st.recv.as_ref().expect("allocated").device_ptr(s).0;
            // SAFETY: group calls only enqueue; offsets stay inside the staging buffers sized
            // above; each peer posts the matching recv/send for the sizes all-gathered above.
            let guard = api(self.device);
            let r = unsafe {
                let mut r = nc::ncclGroupStart();
                let (mut so, mut ro) = (0u64, 0u64);
                for peer in 0..n {
                    let (sn, rn) = (mine[peer] as usize, recv_sizes[peer]);
                    if sn > 0 && r == nc::ncclResult_t::ncclSuccess {
                        r = nc::ncclSend((sp + so) as _, sn, nc::ncclDataType_t::ncclUint8, peer as i32, comm, cs);
                    }
                    if rn > 0 && r == nc::ncclResult_t::ncclSuccess {
                        r = nc::ncclRecv((rp + ro) as _, rn, nc::ncclDataType_t::ncclUint8, peer as i32, comm, cs);
                    }
                    so += sn as u64;
                    ro += rn as u64;
                }
                let end = nc::ncclGroupEnd();
                if r == nc::ncclResult_t::ncclSuccess {
                    end
                } else {
                    r
                }
            };
            drop(guard);
            self.check_launch(st, op, r)?;
            self.wait_ready(st, op, deadline)?;
            self.wait_stream(st, op, deadline, s)?;
        }
        let mut got = vec![0u8; recv_total];
        if recv_total > 0 {
            let recv = st.recv.as_ref().expect("allocated");
            s.memcpy_dtoh(&recv.slice(0..recv_total), &mut got).map_err(|e| err("reading", e))?;
        }
        let mut out = Vec::with_capacity(n);
        let mut off = 0;
        for &len in &recv_sizes {
            out.push(got[off..off + len].to_vec());
            off += len;
        }
        Ok(out)
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_to_all_v(&self, op: &str, parts: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        let mut st = self.lock();
        self.check_failure(&mut st, op)?;
        if parts.len() != self.size {
            let e = format!("{} parts for {} ranks", parts.len(), self.size);
            return Err(self.fail(&mut st, op, e));
        }
        self.ctx.bind_to_thread().map_err(|e| err("binding context", e))?;
        self.exchange(&mut st, op, parts)
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator>> {
        Ok(Box::new(self.split_nccl(color, key)?))
    }

    fn abort(&self, reason: &str) {
        self.failure.set(reason);
        if let Some(r) = &self.rendezvous {
            r.abort(reason);
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl NcclComm {
    /// [`Communicator::split`] returning the NCCL communicator itself.
    pub fn split_nccl(&self, color: usize, key: usize) -> Result<NcclComm> {
        self.split_as(color, key, false)
    }

    /// A split whose child is `blocking` (its own creation is polled through this
    /// non-blocking parent).
    fn split_as(&self, color: usize, key: usize, blocking: bool) -> Result<NcclComm> {
        let op = "split";
        let _call = self.activity.enter(op);
        let mut st = self.lock();
        self.check_failure(&mut st, op)?;
        if st.blocking {
            // Its split would wait on the host for every peer, without a deadline.
            return Err(self.error(op, "a layer's blocking communicator cannot be split".into()));
        }
        self.ctx.bind_to_thread().map_err(|e| err("binding context", e))?;
        let deadline = Instant::now() + self.timeout;
        // Sub-group rank and size, as the split orders them.
        drop(st);
        let all: Vec<Vec<u64>> =
            crate::comm::CommExt::all_gather_vec(self, "split members", &[color as u64, key as u64])?;
        let mut members: Vec<(u64, usize)> =
            all.iter().enumerate().filter(|(_, ck)| ck[0] == color as u64).map(|(r, ck)| (ck[1], r)).collect();
        members.sort();
        let sub_rank = members.iter().position(|&(_, r)| r == self.rank).expect("this rank has its own color");
        let split = self.splits.fetch_add(1, Ordering::Relaxed);
        let mut st = self.lock();
        let mut raw: nc::ncclComm_t = std::ptr::null_mut();
        let mut cfg = config(blocking);
        // SAFETY: collective over the parent, whose context is current; `raw` gets the handle.
        let r = {
            let _api = api(self.device);
            unsafe { nc::ncclCommSplit(st.comm.0, color as i32, key as i32, &mut raw, &mut cfg) }
        };
        self.check_launch(&mut st, op, r)?;
        self.wait_ready(&mut st, op, deadline)?;
        let stream = self.ctx.new_stream().map_err(|e| err("creating stream", e))?;
        let child = NcclComm {
            rank: sub_rank,
            size: members.len(),
            device: self.device,
            ctx: self.ctx.clone(),
            stream,
            state: Mutex::new(State::new(raw, blocking)),
            failure: self.failure.clone(),
            rendezvous: self.rendezvous.clone(),
            teardown: self.teardown.child(split, color as u64, members.len()),
            splits: AtomicU64::new(0),
            timeout: self.timeout,
            activity: self.activity.clone(),
        };
        {
            let mut cst = child.lock();
            child.wait_ready(&mut cst, op, deadline)?;
        }
        Ok(child)
    }

    /// A second communicator over the same ranks, for a layer that keeps its own: blocking,
    /// so each launch is the calling thread's and not a helper thread's (much slower; see the
    /// module documentation), and connected to every peer before it returns (see the module documentation).
    pub fn duplicate(&self) -> Result<NcclComm> {
        let child = self.split_as(0, self.rank, true)?;
        child.warm_up(self)?;
        Ok(child)
    }

    /// One launch of every kind the layers issue (all-gather, reduce-scatter, all-reduce,
    /// broadcast, and a send and a receive with every peer), at a small and a large size, so
    /// that NCCL sets up its connections now: in blocking mode it would otherwise do so inside
    /// a later launch, waiting on the host for peers. The ranks first meet through `parent`
    /// (polled, against the deadline), once each holds its buffer, so that none starts the
    /// launches before every peer is there to connect; the device work is awaited against
    /// the deadline too.
    fn warm_up(&self, parent: &NcclComm) -> Result<()> {
        let op = "warm-up";
        let (n, s) = (self.size, &self.stream);
        const LARGE: usize = 1 << 20;
        let buf = s.alloc_zeros::<u16>(2 * n * LARGE).map_err(|e| err("warm-up buffer", e))?;
        crate::comm::CommExt::all_gather_vec::<u64>(parent, "warm-up meeting", &[1])?;
        let _call = self.activity.enter(op);
        let mut st = self.lock();
        self.check_failure(&mut st, op)?;
        let deadline = Instant::now() + self.timeout;
        let (base, _guard) = buf.device_ptr(s);
        let (send, recv) = (base, base + (2 * n * LARGE) as u64);
        let (comm, cs, bf16) = (st.comm.0, s.cu_stream() as nc::cudaStream_t, nc::ncclDataType_t::ncclBfloat16);
        for count in [1, LARGE] {
            let bytes = (2 * count) as u64;
            let launches: [&dyn Fn() -> nc::ncclResult_t; 5] = [
                // SAFETY (all five): `send` and `recv` each hold n · LARGE bf16 values, at
                // least what these counts read or write; the stream is this communicator's.
                &|| unsafe { nc::ncclAllGather(send as _, recv as _, count, bf16, comm, cs) },
                &|| unsafe {
                    nc::ncclReduceScatter(send as _, recv as _, count, bf16, nc::ncclRedOp_t::ncclSum, comm, cs)
                },
                &|| unsafe { nc::ncclAllReduce(send as _, recv as _, count, bf16, nc::ncclRedOp_t::ncclSum, comm, cs) },
                &|| unsafe { nc::ncclBroadcast(send as _, recv as _, count, bf16, 0, comm, cs) },
                &|| unsafe {
                    let mut r = nc::ncclGroupStart();
                    for peer in (0..n).filter(|&p| p != self.rank) {
                        let off = peer as u64 * bytes;
                        if r == nc::ncclResult_t::ncclSuccess {
                            r = nc::ncclSend((send + off) as _, count, bf16, peer as i32, comm, cs);
                        }
                        if r == nc::ncclResult_t::ncclSuccess {
                            r = nc::ncclRecv((recv + off) as _, count, bf16, peer as i32, comm, cs);
                        }
                    }
                    let end = nc::ncclGroupEnd();
                    if r == nc::ncclResult_t::ncclSuccess {
                        end
                    } else {
                        r
                    }
                },
            ];
            for launch in launches {
                let r = {
                    let _api = api(self.device);
                    launch()
                };
                self.check_launch(&mut st, op, r)?;
                self.wait_ready(&mut st, op, deadline)?;
            }
        }
        self.wait_stream(&mut st, op, deadline, s)
    }

    /// The deadline of each of its calls.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Fails the group after `reason`, found outside NCCL (a peer-memory transport's wait that
    /// timed out): aborts the communicator, tells the peers, and returns the error naming this
    /// rank and `op`.
    pub(super) fn fail_with(&self, op: &str, reason: String) -> MoeError {
        let mut st = self.lock();
        self.fail(&mut st, op, reason)
    }

    /// The GPU this rank runs on.
    pub fn device(&self) -> usize {
        self.device
    }

    /// Enqueues device-side NCCL work on `stream`: `f` gets the raw communicator and the
    /// stream and issues its calls (inside one group when `group`). Returns once NCCL has
    /// accepted the work; completion is awaited with [`NcclComm::wait`].
    pub(super) fn enqueue(
        &self,
        op: &str,
        stream: &CudaStream,
        f: impl FnOnce(nc::ncclComm_t, nc::cudaStream_t) -> nc::ncclResult_t,
    ) -> Result<()> {
        let _call = self.activity.enter(op);
        let mut st = self.lock();
        self.check_failure(&mut st, op)?;
        let deadline = Instant::now() + self.timeout;
        let cs = stream.cu_stream() as nc::cudaStream_t;
        let api = api(self.device);
        // SAFETY: group start/end bracket the calls `f` makes on this communicator.
        let r = unsafe {
            let r0 = nc::ncclGroupStart();
            let r1 = f(st.comm.0, cs);
            let r2 = nc::ncclGroupEnd();
            [r0, r1, r2].into_iter().find(|r| *r != nc::ncclResult_t::ncclSuccess).unwrap_or(r2)
        };
        drop(api);
        self.check_launch(&mut st, op, r)?;
        self.wait_ready(&mut st, op, deadline)
    }

    /// Waits, polling, until the work enqueued on `stream` so far has completed; past the
    /// deadline or on a peer's failure the communicator is aborted and `op` fails.
    pub(super) fn wait(&self, op: &str, stream: &CudaStream) -> Result<()> {
        let _call = self.activity.enter(op);
        let mut st = self.lock();
        self.check_failure(&mut st, op)?;
        self.wait_stream(&mut st, op, Instant::now() + self.timeout, stream)
    }

    /// [`NcclComm::wait`] for the work recorded in `ev` only (later work on its stream may
    /// still run).
    pub(super) fn wait_event(&self, op: &str, ev: &cudarc::driver::CudaEvent) -> Result<()> {
        let _call = self.activity.enter(op);
        let mut st = self.lock();
        self.check_failure(&mut st, op)?;
        self.wait_recorded(&mut st, op, Instant::now() + self.timeout, ev)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let failed = self.failure.get().is_some();
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        if st.aborted {
            return;
        }
        let _ = self.ctx.bind_to_thread();
        let device = self.device;
        if failed {
            Self::abort_raw(device, st);
            return;
        }
        // SAFETY: the handle is valid; finalize flushes pending work, destroy frees it. A
        // finalize that does not complete in time is turned into an abort.
        unsafe {
            let _ = {
                let _api = api(device);
                nc::ncclCommFinalize(st.comm.0)
            };
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let mut state = nc::ncclResult_t::ncclSuccess;
                {
                    let _api = api(device);
                    nc::ncclCommGetAsyncError(st.comm.0, &mut state);
                }
                if state != nc::ncclResult_t::ncclInProgress {
                    {
                        let _api = api(device);
                        nc::ncclCommDestroy(st.comm.0);
                    }
                    // The destroy can wait for peer GPUs to go idle: the ranks leave it
                    // together, so none starts a collective that a slower rank's destroy would
                    // wait behind (without it, back-to-back splits and teardowns stalled until
                    // the deadline).
                    self.teardown.meet(|| self.failure.get().is_some());
                    return;
                }
                if Instant::now() >= deadline {
                    Self::abort_raw(device, st);
                    return;
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }
}

/// Runs `f` on one rank per GPU in `devices` (one thread each, one NCCL group) and returns
/// every rank's result. An error or panic on one rank fails the group: the others' collectives
/// return errors instead of waiting, and none waits past `timeout`.
pub fn run_ranks_nccl<T: Send>(
    devices: &[usize],
    timeout: Duration,
    f: impl Fn(&NcclComm) -> Result<T> + Sync,
) -> Vec<Result<T>> {
    let id = match unique_id() {
        Ok(id) => id,
        Err(e) => return devices.iter().map(|_| Err(MoeError::Unsupported(e.to_string()))).collect(),
    };
    let failure = Failure::default();
    let size = devices.len();
    let meeting = Meeting::new(size);
    std::thread::scope(|s| {
        let handles: Vec<_> = devices
            .iter()
            .enumerate()
            .map(|(rank, &device)| {
                let (f, id, failure) = (&f, &id, failure.clone());
                let teardown = Teardown::Threads(meeting.clone());
                s.spawn(move || {
                    let comm = match NcclComm::new(rank, size, device, id, failure.clone(), None, teardown, timeout) {
                        Ok(c) => c,
                        Err(e) => {
                            failure.set(&format!("rank {rank} could not join: {e}"));
                            return Err(e);
                        }
                    };
                    crate::comm::run_rank(rank, &comm, || f(&comm))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(MoeError::Config("rank thread lost".into()))))
            .collect()
    })
}
