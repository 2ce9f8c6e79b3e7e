//! Stage 4, the combine: each token's expert rows weighted and summed in slot order (one GPU),
//! or the partial sums that came back from each rank summed in rank order (expert-parallel).

use super::{dptr, err, Buffers, CudaMoeLayer};
use crate::error::Result;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

/// 256-thread blocks over `t` tokens of `h` columns for `combine`: one block per token, and
/// below about four blocks per SM that way, each token's columns shared out over up to as many
/// blocks as give every thread one 8-column chunk.
pub(super) fn per_token(t: usize, h: usize) -> LaunchConfig {
    let chunks = if h.is_multiple_of(8) { h / 8 } else { h };
    let split = 528usize.div_ceil(t.max(1)).clamp(1, chunks.div_ceil(256));
    LaunchConfig { grid_dim: (t.max(1) as u32, split as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

impl CudaMoeLayer {
    /// The single-GPU combine: `b.out [t, H]` = the weighted sum of each token's expert rows
    /// in slot order, plus the (gated) shared expert's output once its side stream is joined.
    pub(super) fn combine_local(&self, b: &Buffers, t: usize) -> Result<()> {
        let g = &self.gpu;
        let b2 = self.w.b2.as_ref().map_or(0u64, |x| dptr(x, g));
        self.combine_rows(b, t, dptr(&b.y, g), dptr(&b.row_of_slot, g), b2)
    }

    /// `b.out [t, H]` = for each token the weighted sum in slot order of the bf16 rows of `y`
    /// that `row_of_slot` (`t · k` ints, -1: none) names, each plus its expert's row of `b2`
    /// (`[E, H]` f32, or 0 for none), plus the (gated) shared expert's output once its side
    /// stream is joined: the one-GPU combine, also a deterministic expert-parallel rank's at
    /// home.
    pub(super) fn combine_rows(&self, b: &Buffers, t: usize, y: u64, row_of_slot: u64, b2: u64) -> Result<()> {
        let (g, c) = (&self.gpu, &self.config);
        let s = &g.stream;
        let opt = |x: &Option<CudaSlice<f32>>| x.as_ref().map_or(0u64, |x| dptr(x, g));
        let (ys, xp, gp) = match &self.w.shared {
            Some(sh) => {
                self.side.join(s, [self.side.shared()])?;
                (dptr(&b.sy, g), dptr(&b.x, g), opt(&sh.gate))
            }
            None => (0, 0, 0),
        };
        let (yp, wp, outp) = (y, dptr(&b.weights, g), dptr(&b.out, g));
        let (rs, ip) = (row_of_slot, dptr(&b.ids, g));
        let (ti, ki, hi, applied) = (t as i32, c.top_k as i32, c.hidden as i32, 0i32);
        // SAFETY: combine(bf16*, float*, int*, float*, int*, int, int, int, int, bf16*, float*,
        // float*, float*) over the `t` tokens' slots, whose rows `b.y` holds; the shared output
        // (or null) was computed on the side stream joined above.
        unsafe {
            s.launch_builder(&self.k.combine)
                .arg(&yp)
                .arg(&b2)
                .arg(&ip)
                .arg(&wp)
                .arg(&rs)
                .arg(&ti)
                .arg(&ki)
                .arg(&hi)
                .arg(&applied)
                .arg(&ys)
                .arg(&xp)
                .arg(&gp)
                .arg(&outp)
                .launch(per_token(t, c.hidden))
        }
        .map(|_| ())
        .map_err(|e| err("combine", e))
    }

    /// Whether the sum at home ([`CudaMoeLayer::sum_home`]) adds the shared expert's output:
    /// a shared expert without a gate; a gated one is added after, with its gate, by
    /// `add_shared`.
    pub(super) fn shared_summed_at_home(&self) -> bool {
        self.w.shared.as_ref().is_some_and(|sh| sh.gate.is_none())
    }

    /// `b.out [t, H]` (f32) = for each home token, the sum in order of the `n` bf16 rows of
    /// `back` that `home_rows` (`t · n` ints, -1: none) names for it, plus the shared expert's
    /// output where the layer adds it here ([`CudaMoeLayer::shared_summed_at_home`]).
    pub(super) fn sum_home(&self, b: &Buffers, back: u64, home_rows: u64, t: usize, n: usize) -> Result<()> {
        self.sum_home_live(b, back, home_rows, t, n, 0)
    }

    /// [`CudaMoeLayer::sum_home`] of the first `*live` tokens when `live` (a device int) is not
    /// null (the low-latency batch within its capacity `t`).
    pub(super) fn sum_home_live(
        &self,
        b: &Buffers,
        back: u64,
        home_rows: u64,
        t: usize,
        n: usize,
        live: u64,
    ) -> Result<()> {
        if t == 0 {
            return Ok(());
        }
        let g = &self.gpu;
        // The shared expert's rows, from the side stream joined here.
        let ys = if self.shared_summed_at_home() {
            self.side.join(&g.stream, [self.side.shared()])?;
            dptr(&b.sy, g)
        } else {
            0u64
        };
        let out = dptr(&b.out, g);
        let (ti, ni, hi) = (t as i32, n as i32, self.config.hidden as i32);
        // A batch read on the device is latency-bound: its kernel keeps more loads in flight.
        let kernel = if live == 0 { &self.k.sum_partials } else { &self.k.sum_partials_live };
        // SAFETY: sum_partials[_live](bf16*, int*, int, int, int, int*, bf16*, float*): home_rows
        // holds t · n entries, each -1 or a row of `back`; `out` and `ys` (when not null) hold t
        // rows of H; `live`, when not null, is one int.
        unsafe {
            self.gpu
                .stream
                .launch_builder(kernel)
                .arg(&back)
                .arg(&home_rows)
                .arg(&ti)
                .arg(&ni)
                .arg(&hi)
                .arg(&live)
                .arg(&ys)
                .arg(&out)
                .launch(per_token(t, self.config.hidden))
        }
        .map(|_| ())
        .map_err(|e| err("sum_partials", e))
    }
}
