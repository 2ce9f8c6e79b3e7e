//! The NVLink transport of an expert-parallel layer: rows written by this rank's kernel straight
//! into the peer GPUs' memory, as DeepEP's intranode kernels do, instead of NCCL send/receive.
//!
//! Every rank holds one [`PeerWindow`] per layer, cut into regions (one per kind of rows a
//! strategy receives: token rows, their ids, their weights, returned outputs), each sized for
//! the most rows any rank receives, and reopened larger, by every rank at once, when a batch
//! needs more. An exchange is one push kernel: every lane's rows to every rank, gathered by a
//! row index where the strategy has one, so no staging copy; then a sequence number raised in
//! each receiver's flags; then its last block waits until every sender's number arrived here,
//! or a clock deadline passed ([`NvlWait`]). It reads nothing back to the host, so it is
//! captured in CUDA graphs. A strategy's own kernel may take the push's place: one that writes
//! its rows into the peers' windows, raises the flags and waits itself ([`WindowWrite`]); or
//! the copy engines may move whole batches, whose flags a later push raises ([`CopyLane`]).
//!
//! A window region is written by the previous exchange's senders only after the receiver has
//! sent its own next rows, which it does after reading the region: dispatch and combine
//! alternate, so no rank overwrites rows a peer has not read yet.

use super::super::peer_window::PeerWindow;
use super::expert_parallel::EpLink;
use super::{dptr, err, CudaMoeLayer};
use crate::backend::cuda_options::Transport;
use crate::comm::Communicator;
use crate::error::{MoeError, Result};
use cudarc::driver::{sys as drv, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

/// How a link moves rows: decided at its first exchange (`Auto` falls back to NCCL when a
/// pair of ranks lacks peer access; every rank decides alike).
pub(super) enum LinkTransport {
    /// Not decided yet: the option asked for.
    Pending(Transport),
    /// NCCL grouped send/receive.
    Nccl,
    /// Peer memory, with the window's regions.
    NvLink(Box<NvLink>),
}

/// One link's peer window and the device state of its pushes and waits.
pub(super) struct NvLink {
    win: PeerWindow,
    /// (byte offset, bytes) of each region in every rank's window.
    regions: Vec<(usize, usize)>,
    /// Pushes and waits so far, and the push kernel's count of blocks done.
    counters: CudaSlice<u64>,
    /// Each rank's flag for this rank, as this rank's kernels address them.
    flags: CudaSlice<u64>,
    /// Where each region starts in each rank's window, `[rank, region]`, as this rank's kernels
    /// address them (for kernels that write rows into the peers' windows themselves).
    peer_regions: CudaSlice<u64>,
    /// Lane tables, one per [`Exchange`], and what they hold.
    tables: [CudaSlice<u8>; EXCHANGES],
    held: [Vec<u8>; EXCHANGES],
    /// The smaller windows this one replaced, freed only with the link: freeing device memory
    /// waits for the whole device, which may be running a sibling layer's exchange (the other
    /// half of a dual batch, on a stream of its own) that spins until the peers' rows arrive,
    /// while those peers wait for this rank in the collective that opens the next window.
    retired: Vec<PeerWindow>,
}

impl NvLink {
    /// Where rank `rank`'s rows of `row_bytes` bytes land in region `region` of rank `peer`'s
    /// window (of `n`), as this rank addresses it: after the rows of lower source ranks
    /// (`counts` as a [`Lane`]'s); an error naming both ranks where they overflow the region.
    fn landing(&self, region: usize, counts: &[usize], row_bytes: usize, [rank, peer, n]: [usize; 3]) -> Result<u64> {
        let (at, bytes) = self.regions[region];
        let landed: usize = (0..rank).map(|src| counts[src * n + peer]).sum();
        let rows = counts[rank * n + peer];
        if (landed + rows) * row_bytes > bytes {
            return Err(MoeError::Unsupported(format!(
                "rank {rank}: {} rows of {row_bytes} bytes for rank {peer} overflow its NVLink window region of {bytes} bytes",
                landed + rows
            )));
        }
        Ok(self.win.peer(peer) + (at + landed * row_bytes) as u64)
    }
}

/// Rows the copy engines move ([`CudaMoeLayer::copy_to_windows`]): rows of `row_bytes` bytes at
/// `src`, the same ones to every rank, landing in window region `region` of each receiver after
/// the rows of lower source ranks; `counts[s · n + d]` rows from rank `s` to rank `d`, alike
/// for every `d`.
#[derive(Clone, Copy)]
pub(super) struct CopyLane<'a> {
    pub(super) src: u64,
    pub(super) row_bytes: usize,
    pub(super) region: usize,
    pub(super) counts: &'a [usize],
}

/// Which exchange a push is. Each has a lane table of its own, uploaded only when its lanes
/// change (a captured graph replays the same ones).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Exchange {
    /// The dispatch's ids and counts, sent ahead of its rows.
    DispatchHead,
    /// The dispatch's rows.
    Dispatch,
    /// The experts' outputs going home.
    Combine,
}

/// The kinds of [`Exchange`].
const EXCHANGES: usize = 3;

impl Exchange {
    /// The stage a timed-out wait of this exchange reports (0 dispatch, 1 combine).
    fn stage(self) -> i32 {
        match self {
            Exchange::DispatchHead | Exchange::Dispatch => 0,
            Exchange::Combine => 1,
        }
    }
}

/// One kind of rows of a push: `row_bytes` each, at `src` grouped by destination rank (in
/// rank order), or gathered through the row index `idx` (rows of `src` by source row);
/// `counts[s · n + d]` rows from rank `s` to rank `d`, landing in window region `region` of
/// each receiver after the rows of lower source ranks. With `live` (a device array of an `int`
/// per destination), only the first `live[d]` of this rank's `counts[rank · n + d]` rows go:
/// the counts are then the room the plan leaves for them.
#[derive(Clone, Copy)]
pub(super) struct Lane<'a> {
    pub(super) src: u64,
    pub(super) idx: Option<u64>,
    pub(super) row_bytes: usize,
    pub(super) region: usize,
    pub(super) counts: &'a [usize],
    pub(super) live: Option<u64>,
}

/// What a kernel that writes rows into the peers' windows itself, in place of a push, needs
/// (device addresses): where each region starts in each rank's window, `[rank, nregions]`
/// u64s; the receivers' flags for this rank (`nflags` u64 addresses), the push's counters
/// `sent` (u64) and `done` (u32), which it raises and resets as nvl_push does, and the wait its
/// last block then does (`nvl_raise_and_wait`).
pub(super) struct WindowWrite {
    pub(super) regions: u64,
    pub(super) nregions: i32,
    pub(super) flags: u64,
    pub(super) nflags: i32,
    pub(super) sent: u64,
    pub(super) done: u64,
    pub(super) wait: NvlWait,
}

/// The wait that ends an exchange (`NvlWait` in nvlink.cu, passed by value): until every one of
/// the `n` senders' flags in this rank's window (at `flags`) reached the exchange's number (the
/// u64 count at `received`, plus one), or `timeout_ns` of the GPU's clock passed, which sets the
/// window's mapped host word `status` to name `stage` (0 dispatch, 1 combine) and the sender.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(in crate::backend::cuda) struct NvlWait {
    flags: u64,
    received: u64,
    status: u64,
    timeout_ns: i64,
    n: i32,
    stage: i32,
}

// SAFETY: NvlWait is plain old data laid out as the C struct the kernels take by value (#[repr(C)]:
// three u64, an i64, two i32; 40 bytes, no padding).
unsafe impl cudarc::driver::DeviceRepr for NvlWait {}

impl NvlWait {
    /// A wait on no sender: the exchange's kernel only advances the count of exchanges at
    /// `received` (a u64 in device memory), for a push that no rank answers (the bench's
    /// measure of the push kernel).
    pub(in crate::backend::cuda) fn on_no_sender(received: u64) -> Self {
        NvlWait { flags: 0, received, status: 0, timeout_ns: 0, n: 0, stage: 0 }
    }
}

/// Bytes of a lane record (`PushLane` in nvlink.cu).
const LANE: usize = 40;

/// The `PushLane` record (nvlink.cu) of `rows` rows of `row_bytes` from `src` (through the row
/// index `idx` when not 0) to `dst`, of which only the first `*live` go when `live` is not 0.
pub(in crate::backend::cuda) fn lane_record(
    src: u64,
    idx: u64,
    dst: u64,
    live: u64,
    rows: usize,
    row_bytes: usize,
) -> [u8; LANE] {
    let mut r = [0u8; LANE];
    for (i, word) in [src, idx, dst, live].into_iter().enumerate() {
        r[8 * i..8 * i + 8].copy_from_slice(&word.to_le_bytes());
    }
    r[32..36].copy_from_slice(&(rows as u32).to_le_bytes());
    r[36..40].copy_from_slice(&(row_bytes as u32).to_le_bytes());
    r
}
/// Threads per block of the push kernel.
const PUSH_THREADS: u32 = 512;

/// Window regions start at multiples of this.
const ALIGN: usize = 256;

impl NvLink {
    /// The start of region `r` of this rank's window.
    fn local(&self, r: usize) -> u64 {
        self.win.local() + self.regions[r].0 as u64
    }
}

impl CudaMoeLayer {
    /// How this expert-parallel layer moves rows between GPUs: "nvlink" or "nccl" once its first
    /// run decided, the option's name ("auto") before; empty on one GPU.
    pub fn transport(&self) -> &'static str {
        self.ep.as_ref().map_or("", |l| l.transport_name())
    }

    /// Whether this expert-parallel layer's last all-to-all-v dispatch was planned on the
    /// device (see `CudaOptions::device_plan`); false for other strategies and one GPU.
    pub fn dispatch_planned_on_device(&self) -> bool {
        self.ep.as_ref().is_some_and(|l| l.device_planned.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Whether this expert-parallel layer's last device-planned dispatch sent its token rows
    /// beside the routing: whole batches by the copy engines (see
    /// `CudaOptions::copy_engine_dispatch`) of tokens that came in as bf16.
    pub fn dispatch_rows_beside_routing(&self) -> bool {
        self.ep.as_ref().is_some_and(|l| l.rows_beside_routing.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Where this rank's window regions start, each of at least `regions` bytes (the same on
    /// every rank: sized from every rank's counts), the window opened or reopened larger where
    /// needed; `None` when the link moves rows over NCCL. Collective where it opens a window.
    pub(super) fn nvlink(&self, link: &EpLink, regions: &[usize]) -> Result<Option<Vec<u64>>> {
        let mut t = link.transport.lock().unwrap_or_else(|p| p.into_inner());
        let starts = |nv: &NvLink| (0..nv.regions.len()).map(|r| nv.local(r)).collect();
        let wanted = match &*t {
            LinkTransport::Nccl => return Ok(None),
            LinkTransport::Pending(Transport::Nccl) => {
                *t = LinkTransport::Nccl;
                return Ok(None);
            }
            LinkTransport::Pending(want) => Some(*want),
            LinkTransport::NvLink(nv) => {
                let fits = nv.regions.len() == regions.len() && nv.regions.iter().zip(regions).all(|(h, w)| h.1 >= *w);
                if fits {
                    return Ok(Some(starts(nv)));
                }
                None
            }
        };
        // Every region at least as large as before, rounded up to a power of two, so a
        // growing batch reopens the window a few times at most.
        let old: Vec<usize> = match &*t {
            LinkTransport::NvLink(nv) => nv.regions.iter().map(|r| r.1).collect(),
            _ => Vec::new(),
        };
        let sizes: Vec<usize> = regions
            .iter()
            .enumerate()
            .map(|(i, &w)| w.max(old.get(i).copied().unwrap_or(0)).max(1).next_power_of_two())
            .collect();
        let mut retired = match std::mem::replace(&mut *t, LinkTransport::Pending(Transport::NvLink)) {
            LinkTransport::NvLink(nv) => {
                let NvLink { win, mut retired, .. } = *nv;
                retired.push(win);
                retired
            }
            _ => Vec::new(),
        };
        match self.open_nvlink(link, &sizes) {
            Ok(mut nv) => {
                nv.retired.append(&mut retired);
                let at = starts(&nv);
                *t = LinkTransport::NvLink(Box::new(nv));
                Ok(Some(at))
            }
            Err(e) if wanted == Some(Transport::Auto) && matches!(e, MoeError::Unsupported(_)) => {
                *t = LinkTransport::Nccl;
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// One exchange over the link's NVLink window (opened by [`CudaMoeLayer::nvlink`]):
    /// pushes `lanes` to every rank and waits on the device until every rank's push has landed
    /// here.
    pub(super) fn exchange_nvlink(&self, link: &EpLink, exchange: Exchange, lanes: &[Lane]) -> Result<()> {
        with_window(link, |nv| self.push(nv, link, exchange, lanes))
    }

    /// Rows moved by the copy engines: each lane's rows copied whole into every peer's window
    /// on `peers`, and into this rank's own on `own`. The caller orders the streams after the
    /// window's last reader, and has an exchange's push start after the copies (on the same
    /// stream, or one that waits for them): the flags it raises then carry the rows, since the
    /// push starts once the copies have completed and fences at system scope before them.
    pub(super) fn copy_to_windows(
        &self,
        link: &EpLink,
        lanes: &[CopyLane],
        peers: &CudaStream,
        own: &CudaStream,
    ) -> Result<()> {
        let (n, rank) = (link.comm.size(), link.comm.rank());
        with_window(link, |nv| {
            for lane in lanes {
                let rows = lane.counts[rank * n];
                for peer in 0..n {
                    let dst = nv.landing(lane.region, lane.counts, lane.row_bytes, [rank, peer, n])?;
                    if rows == 0 {
                        continue;
                    }
                    let stream = if peer == rank { own } else { peers };
                    // SAFETY: copies `rows` rows from the caller's buffer at `src` into peer's
                    // window region, which holds them (checked by `landing`); the window
                    // outlives the copy (retired windows are freed with the link).
                    let r =
                        unsafe { drv::cuMemcpyDtoDAsync_v2(dst, lane.src, rows * lane.row_bytes, stream.cu_stream()) };
                    r.result().map_err(|e| err("copying rows to a peer", e))?;
                }
            }
            Ok(())
        })
    }

    /// An exchange over the link's NVLink window whose rows `write` enqueues itself: a kernel
    /// that stores them into the peers' window regions, raises the flags and waits for every
    /// rank's rows (see [`WindowWrite`]), in place of a push. `stage` 0 is the dispatch, 1 the
    /// combine.
    pub(super) fn write_window(
        &self,
        link: &EpLink,
        stage: i32,
        write: impl FnOnce(&WindowWrite) -> Result<()>,
    ) -> Result<()> {
        with_window(link, |nv| {
            let g = &self.gpu;
            let counters = dptr(&nv.counters, g);
            write(&WindowWrite {
                regions: dptr(&nv.peer_regions, g),
                nregions: nv.regions.len() as i32,
                flags: dptr(&nv.flags, g),
                nflags: link.comm.size() as i32,
                sent: counters,
                done: counters + 16,
                wait: self.wait_of(nv, link, stage),
            })
        })
    }

    /// Where each region starts in each rank's window, as this rank's kernels address them (a
    /// device array of `u64`s, `[rank, region]`), and the regions a rank has.
    pub(super) fn window_regions(&self, link: &EpLink) -> Result<(u64, i32)> {
        with_window(link, |nv| Ok((dptr(&nv.peer_regions, &self.gpu), nv.regions.len() as i32)))
    }

    /// A barrier of the link's ranks on the device, when its rows move over NVLink: an exchange
    /// of no rows (every rank's flags raised, then waited for, within the deadline), after
    /// which the ranks' streams go on within about one flag's flight of each other; `false`,
    /// with nothing enqueued, over NCCL or before the first exchange decided the transport.
    pub(super) fn device_barrier(&self, link: &EpLink) -> Result<bool> {
        let mut guard = link.transport.lock().unwrap_or_else(|p| p.into_inner());
        let LinkTransport::NvLink(nv) = &mut *guard else { return Ok(false) };
        self.push(nv, link, Exchange::Dispatch, &[])?;
        Ok(true)
    }

    /// A fresh window with regions of `sizes` bytes and its device state. Collective.
    fn open_nvlink(&self, link: &EpLink, sizes: &[usize]) -> Result<NvLink> {
        let (n, rank) = (link.comm.size(), link.comm.rank());
        let mut regions = Vec::with_capacity(sizes.len());
        let mut at = (8 * n).div_ceil(ALIGN) * ALIGN;
        for &bytes in sizes {
            regions.push((at, bytes));
            at += bytes.div_ceil(ALIGN) * ALIGN;
        }
        // A rank that cannot allocate its window says so inside the collective open, so that
        // every rank fails alike instead of waiting for it.
        let win = PeerWindow::open(&link.comm, at)?;
        let s = &self.gpu.stream;
        let flag_addrs: Vec<u64> = (0..n).map(|p| win.peer(p) + 8 * rank as u64).collect();
        let flags = s.clone_htod(&flag_addrs).map_err(|e| err("upload", e))?;
        let region_addrs: Vec<u64> =
            (0..n).flat_map(|p| regions.iter().map(|r| win.peer(p) + r.0 as u64).collect::<Vec<_>>()).collect();
        let peer_regions = s.clone_htod(&region_addrs).map_err(|e| err("upload", e))?;
        let counters = s.alloc_zeros::<u64>(3).map_err(|e| err("allocating workspace", e))?;
        let table = || s.alloc_zeros::<u8>(8 * n * LANE).map_err(|e| err("allocating workspace", e));
        let (tables, held) = ([table()?, table()?, table()?], [Vec::new(), Vec::new(), Vec::new()]);
        Ok(NvLink { win, regions, counters, flags, peer_regions, tables, held, retired: Vec::new() })
    }

    /// Pushes `lanes` to every rank (see [`Lane`]) through `exchange`'s lane table, which is
    /// not uploaded again when it holds these lanes already.
    fn push(&self, nv: &mut NvLink, link: &EpLink, exchange: Exchange, lanes: &[Lane]) -> Result<()> {
        let slot = exchange as usize;
        let (n, rank) = (link.comm.size(), link.comm.rank());
        let g = &self.gpu;
        let s = &g.stream;
        let mut table = Vec::with_capacity(lanes.len() * n * LANE);
        let mut records = 0usize;
        for lane in lanes {
            let mut sent = 0usize;
            for peer in 0..n {
                let rows = lane.counts[rank * n + peer];
                let dst = nv.landing(lane.region, lane.counts, lane.row_bytes, [rank, peer, n])?;
                if rows > 0 {
                    let (src, idx) = match lane.idx {
                        Some(idx) => (lane.src, idx + 4 * sent as u64),
                        None => (lane.src + (sent * lane.row_bytes) as u64, 0),
                    };
                    let live = lane.live.map_or(0, |c| c + 4 * peer as u64);
                    table.extend_from_slice(&lane_record(src, idx, dst, live, rows, lane.row_bytes));
                    records += 1;
                }
                sent += rows;
            }
        }
        if nv.tables[slot].len() < table.len() {
            nv.tables[slot] = s.alloc_zeros::<u8>(table.len()).map_err(|e| err("allocating workspace", e))?;
            nv.held[slot].clear();
        }
        if !table.is_empty() && nv.held[slot] != table {
            // By launch parameters: batches that change from call to call change the table, and
            // a copy from pageable memory could make the host wait for the stream every call.
            let words: Vec<i32> = table.chunks_exact(4).map(|w| i32::from_le_bytes([w[0], w[1], w[2], w[3]])).collect();
            self.write_ints(s, dptr(&nv.tables[slot], g), &words)?;
            nv.held[slot] = table;
        }
        let (lanes_p, flags, counters) = (dptr(&nv.tables[slot], g), dptr(&nv.flags, g), dptr(&nv.counters, g));
        let (nl, nf, done) = (records as i32, n as i32, counters + 16);
        let blocks = self.opts.transport_sms.max(1);
        let wait = self.wait_of(nv, link, exchange.stage());
        // SAFETY: nvl_push(PushLane*, int, u64**, int, u64*, unsigned*, NvlWait): `records` lanes
        // whose sources lie in this rank's buffers and destinations inside peers' windows
        // (checked above); `flags` holds n peer addresses; the counters live as long as the
        // window, whose first n words are this rank's flags (`wait`).
        unsafe {
            s.launch_builder(&self.k.nvl_push)
                .arg(&lanes_p)
                .arg(&nl)
                .arg(&flags)
                .arg(&nf)
                .arg(&counters)
                .arg(&done)
                .arg(&wait)
                .launch(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (PUSH_THREADS, 1, 1), shared_mem_bytes: 0 })
        }
        .map(|_| ())
        .map_err(|e| err("nvl_push", e))
    }

    /// The wait that ends an exchange over `nv` (stage 0: dispatch, 1: combine, in the
    /// timeout's report), at most the communicator's deadline.
    fn wait_of(&self, nv: &NvLink, link: &EpLink, stage: i32) -> NvlWait {
        NvlWait {
            flags: nv.win.local(),
            received: dptr(&nv.counters, &self.gpu) + 8,
            status: nv.win.status_device(),
            timeout_ns: link.comm.timeout().as_nanos().min(i64::MAX as u128) as i64,
            n: link.comm.size() as i32,
            stage,
        }
    }
}

impl EpLink {
    /// After the layer's run completed (`ran`): an error naming the rank and stage when one of
    /// the transport's waits timed out, and the transport's waits stopped when the run failed.
    pub(super) fn check_transport(&self, ran: Result<()>) -> Result<()> {
        let t = self.transport.lock().unwrap_or_else(|p| p.into_inner());
        let LinkTransport::NvLink(nv) = &*t else { return ran };
        if ran.is_err() {
            nv.win.stop_waits();
            return ran;
        }
        match nv.win.status() {
            0 => Ok(()),
            u32::MAX => Err(self.comm.fail_with("nvlink", "the transport stopped after an earlier failure".into())),
            code => {
                let stage = if code >> 16 == 1 { "dispatch" } else { "combine" };
                let src = (code & 0xffff) as usize - 1;
                let e = link_failure(self, stage, src);
                drop(t);
                Err(self.comm.fail_with(&format!("nvlink {stage}"), e))
            }
        }
    }

    /// Whether this link's rows move through NVLink windows (known from its first exchange on).
    pub(super) fn writes_windows(&self) -> bool {
        matches!(&*self.transport.lock().unwrap_or_else(|p| p.into_inner()), LinkTransport::NvLink(_))
    }

    /// The transport that moves this link's rows, as `bench` prints it ("nvlink", "nccl", or
    /// the option asked for before the first exchange).
    pub(super) fn transport_name(&self) -> &'static str {
        match &*self.transport.lock().unwrap_or_else(|p| p.into_inner()) {
            LinkTransport::Pending(t) => t.name(),
            LinkTransport::Nccl => "nccl",
            LinkTransport::NvLink(_) => "nvlink",
        }
    }
}

/// `f` on the link's NVLink window (its transport's lock held), or an error when its rows move
/// over NCCL or it has no window yet.
fn with_window<R>(link: &EpLink, f: impl FnOnce(&mut NvLink) -> Result<R>) -> Result<R> {
    let mut guard = link.transport.lock().unwrap_or_else(|p| p.into_inner());
    let LinkTransport::NvLink(nv) = &mut *guard else {
        return Err(MoeError::Unsupported("an NVLink exchange on a link without an NVLink window".into()));
    };
    f(nv)
}

/// The message of a wait that timed out on rank `src`'s rows.
fn link_failure(link: &EpLink, stage: &str, src: usize) -> String {
    format!("no {stage} rows from rank {src} within {:?} (stopped, or not scheduled)", link.comm.timeout())
}

#[cfg(test)]
mod tests {
    /// A lane record holds `PushLane`'s fields at their C offsets (nvlink.cu): the source, row
    /// index, destination and live-count addresses (8 bytes each), then the rows and the row
    /// bytes (4 each), 40 bytes with no padding.
    #[test]
    fn a_lane_record_lays_out_push_lane() {
        let r = super::lane_record(0x1111, 0x2222, 0x3333, 0x4444, 7, 14336);
        let word = |at: usize| u64::from_le_bytes(r[at..at + 8].try_into().unwrap());
        let half = |at: usize| u32::from_le_bytes(r[at..at + 4].try_into().unwrap());
        assert_eq!([word(0), word(8), word(16), word(24)], [0x1111, 0x2222, 0x3333, 0x4444]);
        assert_eq!([half(32), half(36)], [7, 14336]);
        assert_eq!(r.len(), super::LANE);
    }

    /// The wait passed by value has `NvlWait`'s C layout: the flags, received-count and status
    /// addresses and the deadline (8 bytes each), then the ranks and the stage (4 each), 40
    /// bytes with no padding.
    #[test]
    fn a_wait_lays_out_nvl_wait() {
        use super::NvlWait;
        use std::mem::offset_of;
        assert_eq!(std::mem::size_of::<NvlWait>(), 40);
        let at = [offset_of!(NvlWait, received), offset_of!(NvlWait, status), offset_of!(NvlWait, timeout_ns)];
        assert_eq!([offset_of!(NvlWait, flags), at[0], at[1], at[2]], [0, 8, 16, 24]);
        assert_eq!([offset_of!(NvlWait, n), offset_of!(NvlWait, stage)], [32, 36]);
    }
}
