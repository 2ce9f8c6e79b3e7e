//! cuBLASLt's dense fp8 GEMM: `D = X · Wᵀ` over `[n, n]` e4m3 codes (row-major, as the layer's
//! rows and weights) with one f32 scale a tensor, f32 accumulation, bf16 out. Its rate is the fp8
//! tensor cores' ceiling that `bench` takes for the floor of a layer whose rows and weights are
//! both fp8 (W8A8).

use super::{err, Gpu};
use crate::error::Result;
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{CudaSlice, DevicePtr};
use std::ffi::c_void;
use std::mem::size_of_val;

/// Bytes of workspace cuBLASLt may use (what NVIDIA recommends on Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

/// Floats between the A and B scales.
const SCALE_STRIDE: usize = 64;

/// One `[n, n]` fp8 GEMM set up on cuBLASLt: its handle, descriptors, the algorithm its
/// heuristic offered first, the workspace and the two tensor scales (1.0 each).
pub(super) struct DenseFp8 {
    handle: sys::cublasLtHandle_t,
    desc: sys::cublasLtMatmulDesc_t,
    codes: sys::cublasLtMatrixLayout_t,
    out: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
    workspace: CudaSlice<u8>,
    scales: CudaSlice<f32>,
}

/// A cuBLASLt error while doing `what`.
fn lt_err(what: &str, e: lt::CublasError) -> crate::error::MoeError {
    err(&format!("cuBLASLt: {what}"), e)
}

impl DenseFp8 {
    /// The GEMM over `n × n` operands on `g`'s stream; `None` where cuBLASLt has no algorithm for
    /// it (GPUs without fp8 tensor cores, before compute capability 8.9).
    pub(super) fn new(g: &Gpu, n: usize) -> Result<Option<Self>> {
        let handle = lt::create_handle().map_err(|e| lt_err("handle", e))?;
        // The two scales 256 bytes apart: with the second scale 4 bytes after the first,
        // cuBLASLt refused every algorithm ("not supported").
        let scales = g.stream.clone_htod(&[1.0f32; 2 * SCALE_STRIDE]).map_err(|e| err("upload", e))?;
        let workspace = g.stream.alloc_zeros::<u8>(WORKSPACE_BYTES).map_err(|e| err("alloc", e))?;
        let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F)
            .map_err(|e| lt_err("matmul descriptor", e))?;
        let (dim, ld) = (n as u64, n as i64);
        let codes = lt::create_matrix_layout(sys::cudaDataType::CUDA_R_8F_E4M3, dim, dim, ld)
            .map_err(|e| lt_err("layout", e))?;
        let out =
            lt::create_matrix_layout(sys::cudaDataType::CUDA_R_16BF, dim, dim, ld).map_err(|e| lt_err("layout", e))?;
        let algo = sys::cublasLtMatmulAlgo_t { data: [0; 8] };
        let mut gemm = DenseFp8 { handle, desc, codes, out, algo, workspace, scales };
        // cuBLASLt's fp8 GEMMs take A transposed (both operands K-major).
        let transposed = cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T as i32;
        let scale_at = gemm.scales.device_ptr(&g.stream).0;
        let (a_scale, b_scale) = (scale_at, scale_at + 4 * SCALE_STRIDE as u64);
        type Attr = sys::cublasLtMatmulDescAttributes_t;
        let attrs: [(Attr, *const c_void, usize); 3] = [
            (Attr::CUBLASLT_MATMUL_DESC_TRANSA, (&transposed as *const i32).cast(), size_of_val(&transposed)),
            (Attr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, (&a_scale as *const u64).cast(), size_of_val(&a_scale)),
            (Attr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, (&b_scale as *const u64).cast(), size_of_val(&b_scale)),
        ];
        for (attr, value, bytes) in attrs {
            // SAFETY: each value is a live local of the size the attribute takes (an int, or a
            // device pointer to one f32 that `gemm` keeps).
            unsafe { lt::set_matmul_desc_attribute(gemm.desc, attr, value, bytes) }
                .map_err(|e| lt_err("matmul attribute", e))?;
        }
        let pref = lt::create_matmul_pref().map_err(|e| lt_err("preference", e))?;
        let room = WORKSPACE_BYTES as u64;
        let mut offered = sys::cublasLtMatmulHeuristicResult_t {
            algo,
            workspaceSize: 0,
            state: sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS,
            wavesCount: 0.0,
            reserved: [0; 4],
        };
        let mut count = 0i32;
        // SAFETY: `room` is the u64 the attribute takes; `offered` holds the one result asked for
        // and `count` receives how many were written; the preference is destroyed once, here.
        let status = unsafe {
            let set = lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&room as *const u64).cast(),
                size_of_val(&room),
            );
            let asked = set.and_then(|_| {
                sys::cublasLtMatmulAlgoGetHeuristic(
                    handle,
                    gemm.desc,
                    codes,
                    codes,
                    out,
                    out,
                    pref,
                    1,
                    &mut offered,
                    &mut count,
                )
                .result()
            });
            let _ = lt::destroy_matmul_pref(pref);
            asked
        };
        match status {
            Ok(()) => {}
            Err(lt::CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)) => return Ok(None),
            Err(e) => return Err(lt_err("algorithm heuristic", e)),
        }
        if count < 1 || offered.state != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Ok(None);
        }
        gemm.algo = offered.algo;
        Ok(Some(gemm))
    }

    /// `d = x · wᵀ` on `g`'s stream, all row-major: `x` and `w` device addresses of `n × n` e4m3
    /// codes, `d` of `n × n` bf16 values (the `n` given to [`DenseFp8::new`]). cuBLASLt's
    /// column-major `Aᵀ · B` with `w` as A and `x` as B is that product, transposed; `d` is
    /// also the C operand, which beta 0 leaves unread.
    pub(super) fn run(&self, g: &Gpu, [x, w, d]: [u64; 3]) -> Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let workspace = self.workspace.device_ptr(&g.stream).0;
        // SAFETY: the layouts describe the n × n operands at x, w and d; alpha and beta are f32
        // as the descriptor's scale type says; the algorithm came from this descriptor's
        // heuristic with at most WORKSPACE_BYTES of workspace, which `self` owns.
        unsafe {
            lt::matmul(
                self.handle,
                self.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                w as *const c_void,
                self.codes,
                x as *const c_void,
                self.codes,
                d as *const c_void,
                self.out,
                d as *mut c_void,
                self.out,
                &self.algo,
                workspace as *mut c_void,
                WORKSPACE_BYTES,
                g.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| lt_err("fp8 matmul", e))
    }
}

impl Drop for DenseFp8 {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once each, after the stream's work that used them
        // (callers synchronize through their timing events first).
        unsafe {
            let _ = lt::destroy_matrix_layout(self.codes);
            let _ = lt::destroy_matrix_layout(self.out);
            let _ = lt::destroy_matmul_desc(self.desc);
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{random_e4m3_codes, Gpu};
    use super::DenseFp8;
    use crate::quant::fp8_e4m3_decode;
    use cudarc::driver::DevicePtr;
    use half::bf16;

    /// The dense fp8 GEMM the floor is measured on computes `x · wᵀ`: against an f64 product of
    /// the values random e4m3 codes stand for, within the bound of the grouped fp8 GEMM's test
    /// (the tensor cores' fp8 sums, the bf16 output). Needs a GPU with fp8 tensor cores; says
    /// loudly when it skips.
    #[test]
    fn dense_fp8_gemm_is_x_times_w_transposed() {
        let name = "dense_fp8_gemm_is_x_times_w_transposed";
        if crate::backend::cuda::skip_without_gpu(name) {
            return;
        }
        let g = Gpu::new(0).unwrap();
        let n = 256;
        let Some(gemm) = DenseFp8::new(&g, n).unwrap() else {
            eprintln!("SKIPPED {name}: no fp8 GEMM on this GPU");
            return;
        };
        let x = random_e4m3_codes(n * n, 1);
        let w = random_e4m3_codes(n * n, 2);
        let s = &g.stream;
        let (xd, wd) = (s.clone_htod(&x).unwrap(), s.clone_htod(&w).unwrap());
        let d = s.clone_htod(&vec![0x7fc1u16; n * n]).unwrap();
        let at = [xd.device_ptr(s).0, wd.device_ptr(s).0, d.device_ptr(s).0];
        gemm.run(&g, at).unwrap();
        let got = s.clone_dtoh(&d).unwrap();
        for i in 0..n {
            for j in 0..n {
                let (want, magnitude) = (0..n)
                    .map(|k| fp8_e4m3_decode(x[i * n + k]) as f64 * fp8_e4m3_decode(w[j * n + k]) as f64)
                    .fold((0.0, 0.0), |(s, m), v| (s + v, m + v.abs()));
                let out = bf16::from_bits(got[i * n + j]).to_f64();
                let bound = want.abs() / 256.0 + magnitude / 1024.0 + 1e-6;
                assert!((out - want).abs() <= bound, "d[{i}][{j}] = {out}, want {want}");
            }
        }
        eprintln!("{name}: {n} × {n} matched x · wᵀ");
    }
}
