//! What recording the load statistics costs: the counting kernel a forward call enqueues,
//! timed alone (see [`super::super::load_stats`]).

use super::super::load_stats::DeviceLoadStats;
use super::{dptr, err, CudaMoeLayer};
use crate::error::Result;

/// Launches [`CudaMoeLayer::load_recording_ms`] times.
const RECORDING_RUNS: usize = 200;

impl CudaMoeLayer {
    /// Milliseconds the load recording of one call of `tokens` tokens takes on the device: the
    /// counting kernel the layer enqueues after routing, timed with CUDA events over
    /// 200 launches on the layer's stream (after one untimed), counting ids
    /// spread over the experts into a scratch ring (the layer's statistics are untouched).
    /// What recording adds to a forward call; call it between forward calls. 0 where the fused
    /// router counts the call in its own launch ([`CudaMoeLayer::routes_fused`]).
    pub fn load_recording_ms(&self, tokens: usize) -> Result<f64> {
        if self.routes_fused(tokens) {
            return Ok(0.0);
        }
        let (e, n) = (self.config.num_experts, tokens * self.config.top_k);
        let _idle = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
        let g = &self.gpu;
        let scratch = DeviceLoadStats::new(g, e)?;
        // A multiplicative hash spreads the ids over the experts as a routing does.
        let ids: Vec<i32> = (0..n.max(1)).map(|i| ((i as u64 * 2_654_435_761) % e as u64) as i32).collect();
        let ids = g.stream.clone_htod(&ids).map_err(|e| err("recording ids", e))?;
        let at = dptr(&ids, g);
        scratch.record(&g.stream, at, n, None)?;
        let event = || g.ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT));
        let (start, stop) = (event().map_err(|e| err("event", e))?, event().map_err(|e| err("event", e))?);
        start.record(&g.stream).map_err(|e| err("event", e))?;
        for _ in 0..RECORDING_RUNS {
            scratch.record(&g.stream, at, n, None)?;
        }
        stop.record(&g.stream).map_err(|e| err("event", e))?;
        g.stream.synchronize().map_err(|e| err("synchronize", e))?;
        Ok(start.elapsed_ms(&stop).map_err(|e| err("event time", e))? as f64 / RECORDING_RUNS as f64)
    }
}
