//! The routed experts through cuBLAS on the grouped layout, one GEMM per expert spread over the
//! side streams: each picks its best tensor-core kernel for its size, and together they fill
//! the GPU.

use super::{unfused_mlp, DeviceExperts, ExpertRows};
use crate::backend::cuda::layer::strategy::Mark;
use crate::backend::cuda::layer::{dptr, gemm_bf16, Buffers, CudaMoeLayer};
use crate::error::Result;

/// cuBLAS, one GEMM per expert.
pub(in crate::backend::cuda::layer) struct CublasPerExpert;

impl DeviceExperts for CublasPerExpert {
    fn name(&self) -> &'static str {
        "cublas-per-expert"
    }

    fn run(&self, layer: &CudaMoeLayer, _b: &mut Buffers, r: &ExpertRows, mark: Mark) -> Result<()> {
        unfused_mlp(layer, r, mark, |w, n, kdim, a, c| {
            if r.groups.is_empty() {
                return Ok(());
            }
            let main = &layer.gpu.stream;
            let streams = layer.side.gemm();
            layer.side.fork(main, streams)?;
            let wbase = dptr(w, &layer.gpu);
            for (q, &(x, off, rows)) in r.groups.iter().enumerate() {
                let blas = &streams[q % streams.len()].blas;
                let (wx, ax, cx) =
                    (wbase + 2 * (x * n * kdim) as u64, a + 2 * (off * kdim) as u64, c + 2 * (off * n) as u64);
                gemm_bf16(blas, wx, n, kdim, ax, cx, rows)?;
            }
            layer.side.join(main, streams)
        })
    }
}
