//! cuBLAS handles that are never made or destroyed while a stream of the process is captured
//! into a CUDA graph. `cublasDestroy` synchronises the whole context; in session 23 the GPU
//! tests crashed inside that synchronisation (a null dereference in the driver under
//! `cuCtxSynchronize`) about once in 15 to 100 runs, when a layer was dropped on one thread while
//! another thread captured its layer. Captures and handle changes take one lock instead.

use super::err;
use crate::error::Result;
use cudarc::cublas::CudaBlas;
use cudarc::driver::CudaStream;
use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex, MutexGuard};

/// Held by a graph capture, and by the creation and destruction of cuBLAS handles.
static CAPTURE_LOCK: Mutex<()> = Mutex::new(());

/// The lock that keeps graph captures apart from each other and from cuBLAS handles being made
/// or destroyed; hold it for the whole of a capture.
pub(crate) fn capture_lock() -> MutexGuard<'static, ()> {
    CAPTURE_LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// A cuBLAS handle on one stream, made and destroyed under [`capture_lock`].
pub(crate) struct BlasHandle(ManuallyDrop<CudaBlas>);

impl BlasHandle {
    /// A handle whose work goes to `stream`.
    pub(crate) fn new(stream: Arc<CudaStream>) -> Result<Self> {
        let _no_capture = capture_lock();
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
        let _no_capture = capture_lock();
        // SAFETY: the handle is dropped once, here, and not used after.
        unsafe { ManuallyDrop::drop(&mut self.0) };
    }
}
