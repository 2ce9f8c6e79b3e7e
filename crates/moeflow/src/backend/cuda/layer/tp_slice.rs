//! TP slicing around the device layer: the ranks of a TP group hold the same tokens; each runs
//! its contiguous share of the batch through the layer (and its expert-parallel exchange), and
//! the shares' outputs are all-gathered over the TP group on the device, so the whole batch
//! comes back to every TP rank without passing through host memory in between.

use super::super::NcclComm;
use super::{dptr, err, no_hook, CudaMoeLayer};
use crate::comm::Communicator;
use crate::error::{MoeError, Result};
use crate::tensor::Tensor;
use cudarc::nccl::sys as nc;

impl CudaMoeLayer {
    /// `[t, H]` f32 on every rank of `tp`: this rank's `share [s, H]` (its rows of a batch of
    /// `t` tokens split over `tp` as [`crate::rank_layer::share`] does) through the layer, then
    /// every rank's share of the outputs all-gathered over `tp` on the device (each padded to
    /// the largest share). Collective over `tp` (and the layer's own group).
    pub fn forward_tp_share(&self, share: &Tensor, t: usize, tp: &NcclComm) -> Result<Tensor> {
        let h = self.config.hidden;
        let s = share.shape();
        let (n, rank) = (tp.size(), tp.rank());
        let (a, b) = crate::rank_layer::share(t, n, rank);
        if s.len() != 2 || s[1] != h || s[0] != b - a {
            return Err(MoeError::shape("hidden_states (TP share)", format!("[{}, {h}]", b - a), s));
        }
        let x = share.to_f32_vec();
        crate::error::check_finite("hidden_states", &x)?;
        // Every rank checks the largest share, so all refuse a batch one of them cannot take.
        let most = t.div_ceil(n.max(1));
        let capacity = self.capacity();
        self.check_capacity(most)?;
        let g = &self.gpu;
        let st = &g.stream;
        let mut guard = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
        let buf = self.buffers(&mut guard, capacity.unwrap_or(most).max(most))?;
        if b > a {
            st.memcpy_htod(&x, &mut buf.x.slice_mut(0..(b - a) * h)).map_err(|e| err("copy in", e))?;
        }
        match capacity {
            Some(_) => self.ll_run(buf, b - a, false)?,
            None if self.takes_graph(b - a) => self.graph_run(buf, b - a, false)?,
            None => self.run_marks(buf, b - a, false, &no_hook)?.0,
        };
        if !self.allow_nonfinite && b > a {
            super::super::finite::check_output(g, &buf.out.slice(0..(b - a) * h), h)?;
        }
        if most == 0 {
            return Tensor::from_f32(&[t, h], Vec::new());
        }
        if buf.tp_gathered.as_ref().is_none_or(|v| v.len() < n * most * h) {
            buf.tp_gathered = Some(st.alloc_zeros::<f32>(n * most * h).map_err(|e| err("allocating workspace", e))?);
        }
        let gathered = buf.tp_gathered.as_ref().expect("allocated above");
        let (src, dst, count) = (dptr(&buf.out, g), dptr(gathered, g), most * h);
        tp.enqueue("tp output", st, |comm, cs| {
            // SAFETY: `most · H` floats from every TP rank's output buffer (which holds at least
            // `most` rows) into the n · most · H floats of `gathered`, rank r's at r · most · H.
            unsafe { nc::ncclAllGather(src as _, dst as _, count, nc::ncclDataType_t::ncclFloat32, comm, cs) }
        })?;
        tp.wait("tp output", st)?;
        let mut out = vec![0f32; t * h];
        for r in 0..n {
            let (ar, br) = crate::rank_layer::share(t, n, r);
            if br > ar {
                let from = gathered.slice(r * most * h..(r * most + br - ar) * h);
                st.memcpy_dtoh(&from, &mut out[ar * h..br * h]).map_err(|e| err("copy out", e))?;
            }
        }
        Tensor::from_f32(&[t, h], out)
    }
}
