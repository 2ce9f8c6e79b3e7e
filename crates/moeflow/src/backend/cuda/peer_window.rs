//! Symmetric peer memory: every rank of a communicator allocates a window of the same size and
//! maps every other rank's, so that kernels write straight into a peer GPU's memory.
//!
//! Ranks that are threads of one process map each other's windows through peer access
//! (`cuCtxEnablePeerAccess`; one address space, the raw addresses are exchanged). Ranks in
//! separate processes map them through CUDA IPC handles (`cuIpcGetMemHandle`, opened with
//! `cuIpcOpenMemHandle`), passed over the communicator itself. IPC handles work on any driver
//! this project supports and need no extra library; NCCL's symmetric windows would tie the
//! transport to NCCL 2.28's device API for no gain at two to eight GPUs of one host. Windows are
//! plain `cuMemAlloc` memory: allocations from the stream-ordered pool can be neither exported
//! by IPC nor reached through context peer access.

use super::{err, NcclComm};
use crate::comm::Communicator;
use crate::error::{MoeError, Result};
use cudarc::driver::sys as drv;
use cudarc::driver::CudaContext;
use std::sync::Arc;

/// What a rank tells its peers about its window: process id, device ordinal, base address and
/// IPC handle.
const RECORD: usize = 4 + 4 + 8 + 64;

/// This rank's window and the addresses of every rank's window (`peers[rank]` is its own).
pub struct PeerWindow {
    ctx: Arc<CudaContext>,
    base: u64,
    peers: Vec<u64>,
    /// Peer windows opened through IPC, closed on drop.
    opened: Vec<u64>,
    /// One word of host memory mapped into the device: the transport's status (0: fine), which
    /// the device's waits set on a timeout and the host sets to end them (see `nvlink.cu`).
    status: *mut u32,
    status_dev: u64,
}

// SAFETY: the window's addresses are plain device and pinned host addresses, valid in any
// thread once its context is bound; the layer serialises its use behind its buffers' lock.
unsafe impl Send for PeerWindow {}
// SAFETY: as above.
unsafe impl Sync for PeerWindow {}

fn check(what: &str, r: drv::CUresult) -> Result<()> {
    match r {
        drv::cudaError_enum::CUDA_SUCCESS => Ok(()),
        r => Err(err(what, r)),
    }
}

impl PeerWindow {
    /// Opens a window of `bytes` bytes (zeroed) on every rank of `comm` and maps every peer's.
    /// Collective. An error on every rank, naming the ranks that could not reach a peer, when
    /// any pair lacks peer access (for example GPUs on PCIe without P2P).
    pub fn open(comm: &NcclComm, bytes: usize) -> Result<PeerWindow> {
        let (n, rank) = (comm.size(), comm.rank());
        // A rank that cannot even allocate still takes part in both rounds (an empty record),
        // so that every rank returns the same error rather than waiting for it.
        let mut mine = Self::allocate(comm, bytes.max(256));
        let record = mine.as_ref().map_or_else(|_| Vec::new(), |(_, r)| r.clone());
        let records = comm.all_to_all_v("peer window", vec![record; n])?;
        let mut failed = String::new();
        match &mut mine {
            Err(e) => failed = format!("rank {rank}: {e}"),
            Ok((w, _)) => {
                for (peer, rec) in records.iter().enumerate() {
                    match w.map(peer == rank, rec) {
                        Ok(addr) => w.peers[peer] = addr,
                        Err(e) => failed = format!("rank {rank} cannot map rank {peer}'s memory ({e})"),
                    }
                }
            }
        }
        // Every rank learns whether every pair worked, so all take the same path.
        let verdicts = comm.all_to_all_v("peer window", vec![failed.into_bytes(); n])?;
        let problems: Vec<String> =
            verdicts.into_iter().filter(|v| !v.is_empty()).map(|v| String::from_utf8_lossy(&v).into_owned()).collect();
        if !problems.is_empty() {
            return Err(MoeError::Unsupported(format!("no NVLink peer access: {}", problems.join("; "))));
        }
        mine.map(|(w, _)| w)
    }

    /// This rank's zeroed window of `bytes` bytes, its status word, and the record it sends
    /// its peers.
    fn allocate(comm: &NcclComm, bytes: usize) -> Result<(PeerWindow, Vec<u8>)> {
        let ctx = comm.context().clone();
        ctx.bind_to_thread().map_err(|e| err("binding context", e))?;
        let mut base = 0u64;
        // SAFETY: allocates `bytes` bytes of device memory in the bound context.
        check("allocating the peer window", unsafe { drv::cuMemAlloc_v2(&mut base, bytes) })?;
        let mut w = PeerWindow {
            ctx,
            base,
            peers: vec![0; comm.size()],
            opened: Vec::new(),
            status: std::ptr::null_mut(),
            status_dev: 0,
        };
        // SAFETY: zeroes the allocation made above, synchronously.
        check("zeroing the peer window", unsafe { drv::cuMemsetD8_v2(base, 0, bytes) })?;
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: one pinned, device-mapped word; freed on drop.
        check("allocating the transport status", unsafe {
            drv::cuMemHostAlloc(&mut host, 4, drv::CU_MEMHOSTALLOC_DEVICEMAP | drv::CU_MEMHOSTALLOC_PORTABLE)
        })?;
        w.status = host as *mut u32;
        // SAFETY: `host` was just allocated with the device-map flag; the word starts at 0.
        unsafe {
            w.status.write_volatile(0);
            check("mapping the transport status", drv::cuMemHostGetDevicePointer_v2(&mut w.status_dev, host, 0))?;
        }
        let mut handle = drv::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: exports the allocation made above.
        check("exporting the peer window", unsafe { drv::cuIpcGetMemHandle(&mut handle, base) })?;
        let mut record = Vec::with_capacity(RECORD);
        record.extend_from_slice(&std::process::id().to_le_bytes());
        record.extend_from_slice(&(comm.device() as u32).to_le_bytes());
        record.extend_from_slice(&base.to_le_bytes());
        record.extend(handle.reserved.iter().map(|&c| c as u8));
        Ok((w, record))
    }

    /// The address of the window described by `rec` (this rank's own where `own`), mapped
    /// into this context.
    fn map(&mut self, own: bool, rec: &[u8]) -> Result<u64> {
        if own {
            return Ok(self.base);
        }
        if rec.len() != RECORD {
            return Err(MoeError::Unsupported(format!("a peer window record of {} bytes", rec.len())));
        }
        let word = |i: usize| u32::from_le_bytes(rec[i..i + 4].try_into().expect("4 bytes"));
        let (pid, device) = (word(0), word(4) as usize);
        let addr = u64::from_le_bytes(rec[8..16].try_into().expect("8 bytes"));
        if pid == std::process::id() {
            if device != self.ctx.ordinal() {
                // Opening the peer's context makes it current: this rank's is bound again.
                let peer = super::nccl::context(device)?;
                self.ctx.bind_to_thread().map_err(|e| err("binding context", e))?;
                let mut can = 0i32;
                // SAFETY: queries two valid device handles.
                check("querying peer access", unsafe {
                    drv::cuDeviceCanAccessPeer(&mut can, self.ctx.cu_device(), peer.cu_device())
                })?;
                if can == 0 {
                    return Err(MoeError::Unsupported(format!(
                        "GPU {} has no peer access to GPU {device}",
                        self.ctx.ordinal()
                    )));
                }
                // SAFETY: this rank's context is bound; enabling twice reports "already enabled".
                let r = unsafe { drv::cuCtxEnablePeerAccess(peer.cu_ctx(), 0) };
                if r != drv::cudaError_enum::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
                    check("enabling peer access", r)?;
                }
            }
            return Ok(addr);
        }
        let mut handle = drv::CUipcMemHandle { reserved: [0; 64] };
        handle.reserved.iter_mut().zip(&rec[16..]).for_each(|(d, &s)| *d = s as _);
        let mut mapped = 0u64;
        // SAFETY: opens another process's exported allocation in this context; closed on drop.
        check("opening a peer's IPC handle", unsafe {
            drv::cuIpcOpenMemHandle_v2(
                &mut mapped,
                handle,
                drv::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        })?;
        self.opened.push(mapped);
        Ok(mapped)
    }

    /// This rank's window.
    pub fn local(&self) -> u64 {
        self.base
    }

    /// Rank `rank`'s window as this rank's kernels address it.
    pub fn peer(&self, rank: usize) -> u64 {
        self.peers[rank]
    }

    /// The status word as the device addresses it (see the struct's field).
    pub fn status_device(&self) -> u64 {
        self.status_dev
    }

    /// The status word: 0 while every wait got its rows.
    pub fn status(&self) -> u32 {
        // SAFETY: the word stays allocated while the window lives; the device writes it.
        unsafe { self.status.read_volatile() }
    }

    /// Ends every wait now and later (after a failure elsewhere), keeping a timeout's code.
    pub fn stop_waits(&self) {
        if self.status() == 0 {
            // SAFETY: as in `status`.
            unsafe { self.status.write_volatile(u32::MAX) }
        }
    }
}

impl Drop for PeerWindow {
    fn drop(&mut self) {
        // After a failure (a wait timed out or was stopped) a late peer may still push into
        // this window, and a wait kernel of this rank may still be about to write the status
        // word: both stay allocated, one window lost per failed group, rather than a late write
        // becoming an illegal address that breaks the GPU's context for the whole process.
        if !self.status.is_null() && self.status() != 0 {
            return;
        }
        let _ = self.ctx.bind_to_thread();
        // SAFETY: each address was opened, allocated or host-allocated by this window, once.
        unsafe {
            for &p in &self.opened {
                drv::cuIpcCloseMemHandle(p);
            }
            drv::cuMemFree_v2(self.base);
            if !self.status.is_null() {
                drv::cuMemFreeHost(self.status as *mut std::ffi::c_void);
            }
        }
    }
}
