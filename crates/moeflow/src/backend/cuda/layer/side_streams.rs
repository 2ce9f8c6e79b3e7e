//! A layer's side streams and how they are ordered against its main stream. Each order is an
//! event recorded on one stream and waited on by another, with events made once per stream, so
//! none is created or destroyed while the layer is captured into a CUDA graph (cudarc's
//! `CudaStream::join` makes and drops an event per call).

use super::super::blas_handle::BlasHandle;
use super::{check, err, CudaOptions, Gpu};
use crate::error::Result;
use cudarc::cublas::sys as cb;
use cudarc::driver::{sys as drv, CudaEvent, CudaStream};
use std::sync::Arc;

/// A side stream with its cuBLAS handle.
pub(super) struct SideStream {
    pub(super) stream: Arc<CudaStream>,
    pub(super) blas: BlasHandle,
    /// Recorded on `stream` where another stream waits for it.
    done: CudaEvent,
}

/// The side streams of a layer: the first runs the shared expert (and the router's bf16 copy),
/// the others per-expert GEMMs (each too small to fill the GPU) concurrently; the second also
/// groups a device-planned dispatch's slots while its rows cross the link, and the third
/// carries the whole batches that dispatch copies beside the routing.
pub(super) struct SideStreams {
    streams: Vec<SideStream>,
    /// Recorded on the main stream where side streams fork from it.
    forked: CudaEvent,
    /// Recorded on the main stream before the routing, where the tokens are in place.
    tokens_in: CudaEvent,
}

impl SideStreams {
    /// One stream for the shared expert, then those of the concurrent per-expert GEMMs
    /// ([`CudaOptions::gemm_streams`]). Their cuBLAS handles size their kernels for half the
    /// GPU's SMs ([`CudaOptions::gemm_sm_target`], 0 = the whole GPU), since they run side by
    /// side: sized for the whole GPU, some runs' GEMMs came out much slower (docs/tuning.md).
    pub(super) fn new(gpu: &Gpu, opts: &CudaOptions) -> Result<Self> {
        let n = opts.gemm_streams.max(1);
        let sms = gpu.ctx.attribute(drv::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).unwrap_or(0);
        let sm_target: i32 = opts.gemm_sm_target.map_or(sms / 2, |t| t.min(i32::MAX as u32) as i32);
        let event = || gpu.ctx.new_event(None).map_err(|e| err("creating event", e));
        let streams = (0..=n)
            .map(|_| {
                let stream = gpu.ctx.new_stream().map_err(|e| err("creating stream", e))?;
                let blas = BlasHandle::new(stream.clone())?;
                if sm_target > 0 {
                    // SAFETY: sets an attribute of the handle just created.
                    check(unsafe { cb::cublasSetSmCountTarget(*blas.handle(), sm_target) }, "SM count target")?;
                }
                Ok(SideStream { stream, blas, done: event()? })
            })
            .collect::<Result<_>>()?;
        Ok(SideStreams { streams, forked: event()?, tokens_in: event()? })
    }

    /// The stream of the shared expert and the router's bf16 copy.
    pub(super) fn shared(&self) -> &SideStream {
        &self.streams[0]
    }

    /// The streams of the concurrent per-expert GEMMs (at least one).
    pub(super) fn gemm(&self) -> &[SideStream] {
        &self.streams[1..]
    }

    /// The stream that groups a device-planned NVLink dispatch's received slots by local
    /// expert while the rows are pushed (the Hopper GEMMs that dispatch feeds run on the
    /// layer's stream, so the per-expert GEMM streams are free then).
    pub(super) fn grouping(&self) -> &SideStream {
        &self.streams[1]
    }

    /// The stream of the whole batches a device-planned dispatch copies beside the routing:
    /// the second per-expert GEMM stream, so that the grouping does not queue behind the
    /// copies (the grouping's own where the layer has one per-expert stream only).
    pub(super) fn copies(&self) -> &SideStream {
        self.streams.get(2).unwrap_or(&self.streams[1])
    }

    /// All of them.
    pub(super) fn all(&self) -> &[SideStream] {
        &self.streams
    }

    /// `sides` wait, on the device, for the work enqueued on `main` so far.
    pub(super) fn fork<'a>(&self, main: &CudaStream, sides: impl IntoIterator<Item = &'a SideStream>) -> Result<()> {
        self.forked.record(main).map_err(|e| err("stream fork", e))?;
        for side in sides {
            side.stream.wait(&self.forked).map_err(|e| err("stream fork", e))?;
        }
        Ok(())
    }

    /// Marks where `main` has its tokens in place, before the routing, for
    /// [`SideStreams::after_tokens_in`].
    pub(super) fn tokens_in(&self, main: &CudaStream) -> Result<()> {
        self.tokens_in.record(main).map_err(|e| err("stream fork", e))
    }

    /// `side` waits, on the device, for the main stream's work up to the last
    /// [`SideStreams::tokens_in`] (a fork from that point, made later).
    pub(super) fn after_tokens_in(&self, side: &SideStream) -> Result<()> {
        side.stream.wait(&self.tokens_in).map_err(|e| err("stream fork", e))
    }

    /// `main` waits, on the device, for the work enqueued on `sides` so far.
    pub(super) fn join<'a>(&self, main: &CudaStream, sides: impl IntoIterator<Item = &'a SideStream>) -> Result<()> {
        for side in sides {
            side.done.record(&side.stream).map_err(|e| err("stream join", e))?;
            main.wait(&side.done).map_err(|e| err("stream join", e))?;
        }
        Ok(())
    }
}
