//! cuBLAS handles that are never made or destroyed while a stream of the process is captured
//! into a CUDA graph. `cublasDestroy` synchronises the whole context; the GPU tests crashed
//! inside that synchronisation (a null dereference in the driver under `cuCtxSynchronize`) in
//! 1 of 20 to 7 of 40 runs, when a layer was dropped on one thread while another thread
//! captured, and captures failed (cuBLAS internal errors) beside handles being made or destroyed.
//! Captures hold a shared lock, the making and destroying of handles an exclusive one.

use super::err;
use crate::error::Result;
use cudarc::cublas::CudaBlas;
use cudarc::driver::CudaStream;
use std::mem::ManuallyDrop;
use std::sync::{Arc, RwLock, RwLockReadGuard};

/// Shared by graph captures; exclusive to the making and destroying of cuBLAS handles.
static CAPTURES: RwLock<()> = RwLock::new(());

/// Keeps cuBLAS handles from being made or destroyed while held: hold it for the whole of a
/// graph capture. Captures on several threads (the ranks of one process) hold it together.
pub(crate) fn capture_lock() -> RwLockReadGuard<'static, ()> {
    CAPTURES.read().unwrap_or_else(|p| p.into_inner())
}

/// A cuBLAS handle on one stream, made and destroyed while no graph capture holds
/// [`capture_lock`].
pub(crate) struct BlasHandle(ManuallyDrop<CudaBlas>);

impl BlasHandle {
    /// A handle whose work goes to `stream`.
    pub(crate) fn new(stream: Arc<CudaStream>) -> Result<Self> {
        let _no_capture = CAPTURES.write().unwrap_or_else(|p| p.into_inner());
        Ok(BlasHandle(ManuallyDrop::new(CudaBlas::new(stream).map_err(|e| err("cuBLAS handle", e))?)))
    }
}

impl std::ops::Deref for BlasHandle {
    type Target = CudaBlas;
    fn deref(&self) -> &CudaBlas {
        &self.0
    }
}

impl Drop for BlasHandle {
    fn drop(&mut self) {
        let _no_capture = CAPTURES.write().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the handle is dropped once, here, and not used after.
        unsafe { ManuallyDrop::drop(&mut self.0) };
    }
}
