//! One GPU: every expert is here, so prepare is the permute (expert sizes counted, rows grouped
//! by expert, or only the slot/row maps where the Hopper GEMM gathers the rows itself) and
//! finalize is the weighted sum of each token's expert rows in slot order.

use super::{state_of, DevicePrepareFinalize, Dispatched, Mark, Sent, State};
use crate::backend::cuda::layer::experts::{ExpertRows, Form};
use crate::backend::cuda::layer::hopper_gemm::Gather;
use crate::backend::cuda::layer::permute::sorts_in_one_launch;
use crate::backend::cuda::layer::{dptr, err, Buffers, CudaMoeLayer};
use crate::error::Result;

/// No dispatch: the one-GPU layer.
pub(in crate::backend::cuda::layer) struct Local;

impl DevicePrepareFinalize for Local {
    fn name(&self) -> &'static str {
        "local"
    }

    /// The permute: nothing leaves the GPU.
    fn prepare_begin(&self, l: &CudaMoeLayer, b: &mut Buffers, t: usize, mark: Mark) -> Result<State> {
        let (e, k) = (l.config.num_experts, l.config.top_k);
        let g = &l.gpu;
        let s = &g.stream;
        let (ip, cp) = (dptr(&b.ids, g), dptr(&b.counts, g));
        // The fused router has written the counts, offsets and maps already.
        let fused = l.routes_fused(t);
        // Expert sizes on the host decide cuBLAS's GEMM shapes; the masked and Hopper GEMMs
        // read them on the device, so the host does not wait for them, and a single chunk of
        // slots is counted by the grouping's one launch.
        let device = l.device_counted(t * k, e, Form::OneGpu);
        let counted = !(device.is_some() && sorts_in_one_launch(t * k));
        if !fused && counted {
            l.count_slots(&g.stream, ip, t * k, e, dptr(&b.chunk_counts, g), cp)?;
        }
        let (imp, cap, counts) = match device {
            Some(imp) => (imp, 0, Vec::new()),
            None => {
                let mut counts = vec![0i32; e];
                s.memcpy_dtoh(&b.counts, &mut counts).map_err(|e| err("reading expert counts", e))?;
                let counts: Vec<usize> = counts.into_iter().map(|c| c as usize).collect();
                let (imp, cap) = l.host_counted(t * k, &counts);
                (imp, cap, counts)
            }
        };
        // The tokens' fp8 codes where the layer has quantized them already.
        let tokens_fp8 = l.tokens_fp8(b).filter(|_| imp.gathers_fp8_rows());
        let gather = imp.gathers_rows(l, cap).then(|| Gather {
            x: tokens_fp8.map_or(dptr(&b.x_bf, g), |q| q.codes),
            fp8_scales: tokens_fp8.map(|q| q.scales),
            tokens: t,
            slot_of_row: dptr(&b.slot_of_row, g),
            k,
            stride: l.config.hidden,
        });
        if !fused {
            l.permute(b, t, cap, gather.is_none(), counted)?;
        }
        mark(2)?;
        let extent = if cap > 0 { e * cap } else { t * k };
        let rows = ExpertRows {
            imp,
            a: dptr(&b.a, g),
            h13: dptr(&b.h13, g),
            act: dptr(&b.act, g),
            y: dptr(&b.y, g),
            expert_of_row: dptr(&b.expert_of_row, g),
            experts: e,
            cap,
            rows: extent,
            busy: extent,
            groups: super::super::experts::groups_of(&counts),
            counts: cp,
            offsets: dptr(&b.offsets, g),
            gather,
            y_rows: None,
        };
        Ok(Box::new(rows))
    }

    fn prepare_finish(
        &self,
        _: &CudaMoeLayer,
        _: &mut Buffers,
        _: usize,
        rows: State,
        mark: Mark,
    ) -> Result<Dispatched> {
        mark(3)?;
        let rows = *state_of::<ExpertRows>(rows, self.name())?;
        Ok(Dispatched { rows, sent: Sent::Bytes(0), state: Box::new(()) })
    }

    fn finalize_begin(&self, _: &CudaMoeLayer, _: &mut Buffers, _: usize, _: &mut Dispatched) -> Result<()> {
        Ok(())
    }

    fn finalize_finish(&self, l: &CudaMoeLayer, b: &mut Buffers, t: usize, _: Dispatched, mark: Mark) -> Result<()> {
        mark(7)?;
        if t > 0 {
            l.combine_local(b, t)?;
        }
        Ok(())
    }

    fn adds_shared(&self, _: &CudaMoeLayer) -> bool {
        true
    }
}
