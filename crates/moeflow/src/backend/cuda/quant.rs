//! Row quantization on the GPU: every activation format of [`crate::quant`], bit for bit the
//! same codes and scales as the CPU.

use super::{err, Gpu};
use crate::error::{check_finite, MoeError, Result};
use crate::quant::{QuantConfig, QuantRows};
use cudarc::driver::{CudaFunction, DevicePtr, LaunchConfig, PushKernelArg};

/// Quantize/dequantize kernels on one GPU.
pub struct CudaQuant {
    gpu: Gpu,
    quantize: CudaFunction,
    quantize_bf16: CudaFunction,
    dequantize: CudaFunction,
}

fn kind(q: QuantConfig) -> Result<i32> {
    match q {
        QuantConfig::Int8 => Ok(1),
        QuantConfig::Fp8 | QuantConfig::Fp8Block => Ok(2),
        QuantConfig::Mxfp8 => Ok(3),
        QuantConfig::None => Err(MoeError::Config("no quantization to run".into())),
    }
}

/// Blocks of a row quantization at most: enough to fill every SM of the largest GPUs several
/// times over; the kernels stride over the rest.
const QUANTIZE_BLOCKS: usize = 2048;

/// Launch shape of `quantize_rows` / `quantize_rows_bf16` (kernels/quant.cu) over `rows` rows of `h`
/// values in groups of `group`: for whole groups of 128, eight lanes a (row, group) over a
/// one-dimensional grid; otherwise one warp a (row, group), eight warps a block, rows over
/// `grid.x`.
pub(super) fn quantize_launch(rows: usize, h: usize, group: usize) -> LaunchConfig {
    let (grid_dim, block) = if group == 128 && h.is_multiple_of(128) {
        let teams = rows * (h / 128);
        ((teams.div_ceil(32).clamp(1, QUANTIZE_BLOCKS) as u32, 1, 1), 256)
    } else {
        ((rows.clamp(1, 65535) as u32, h.div_ceil(group.max(1)).div_ceil(8) as u32, 1), 256)
    };
    LaunchConfig { grid_dim, block_dim: (block, 1, 1), shared_mem_bytes: 0 }
}

impl CudaQuant {
    /// Opens GPU 0.
    pub fn new() -> Result<Self> {
        let gpu = Gpu::new(0)?;
        let (quantize, quantize_bf16) = (gpu.function("quantize_rows")?, gpu.function("quantize_rows_bf16")?);
        let dequantize = gpu.function("dequantize_rows")?;
        Ok(CudaQuant { gpu, quantize, quantize_bf16, dequantize })
    }

    /// Quantizes `x [rows, h]` on the device.
    pub fn quantize(&self, q: QuantConfig, x: &[f32], h: usize) -> Result<QuantRows> {
        check_finite("activations to quantize", x)?;
        let dx = self.gpu.stream.clone_htod(x).map_err(|e| err("upload", e))?;
        let (xp, _read) = dx.device_ptr(&self.gpu.stream);
        self.quantize_rows(q, xp, x.len(), h, false)
    }

    /// Quantizes bf16 rows `x [rows, h]` on the device with the kernel the layers run on their
    /// bf16 activations (`quantize_rows_bf16`): the codes and scales of their f32 values.
    pub fn quantize_bf16(&self, q: QuantConfig, x: &[half::bf16], h: usize) -> Result<QuantRows> {
        check_finite("activations to quantize", &x.iter().map(|v| v.to_f32()).collect::<Vec<_>>())?;
        let dx = self.gpu.stream.clone_htod(x).map_err(|e| err("upload", e))?;
        let (xp, _read) = dx.device_ptr(&self.gpu.stream);
        self.quantize_rows(q, xp, x.len(), h, true)
    }

    /// The quantization of `n` values in rows of `h` at device address `x` (f32, or bf16 with
    /// `bf16`).
    fn quantize_rows(&self, q: QuantConfig, x: u64, n: usize, h: usize, bf16: bool) -> Result<QuantRows> {
        let (kind, group) = (kind(q)?, q.group(h));
        let rows = n / h.max(1);
        let groups = q.scales_per_row(h);
        let s = &self.gpu.stream;
        let codes = s.alloc_zeros::<u8>(n.max(1)).map_err(|e| err("alloc", e))?;
        let scales = s.alloc_zeros::<f32>((rows * groups).max(1)).map_err(|e| err("alloc", e))?;
        if rows > 0 && h > 0 {
            let (cp, sp) = (codes.device_ptr(s).0, scales.device_ptr(s).0);
            let (hi, gi) = (h as i32, group as i32);
            let (cfg, rows_l) = (quantize_launch(rows, h, group), rows as i64);
            let (no_counts, cap, no_values) = (0u64, 1i32, 0u64);
            // SAFETY: quantize_rows(const float*, long, int, int, int, u8*, float*) and
            // quantize_rows_bf16(const bf16*, long, int, int, int, const int*, int, u8*, float*,
            // bf16*) read rows·h values of `x` and write as many codes and rows·groups scales
            // into buffers of that size; the bf16 kernel skips no rows (no counts) and writes no
            // values.
            unsafe {
                if bf16 {
                    let mut l = s.launch_builder(&self.quantize_bf16);
                    l.arg(&x).arg(&rows_l).arg(&hi).arg(&gi).arg(&kind).arg(&no_counts).arg(&cap);
                    l.arg(&cp).arg(&sp).arg(&no_values).launch(cfg)
                } else {
                    let mut l = s.launch_builder(&self.quantize);
                    l.arg(&x).arg(&rows_l).arg(&hi).arg(&gi).arg(&kind).arg(&cp).arg(&sp).launch(cfg)
                }
            }
            .map_err(|e| err("quantize_rows", e))?;
        }
        let mut data = s.clone_dtoh(&codes).map_err(|e| err("download", e))?;
        let mut sc = s.clone_dtoh(&scales).map_err(|e| err("download", e))?;
        data.truncate(n);
        sc.truncate(rows * groups);
        Ok(QuantRows { config: q, hidden: h, data, scales: sc })
    }

    /// Dequantizes on the device.
    pub fn dequantize(&self, rows: &QuantRows) -> Result<Vec<f32>> {
        let (kind, h) = (kind(rows.config)?, rows.hidden);
        let n = rows.data.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let s = &self.gpu.stream;
        let (codes, scales) = (
            s.clone_htod(&rows.data).map_err(|e| err("upload", e))?,
            s.clone_htod(&rows.scales).map_err(|e| err("upload", e))?,
        );
        let out = s.alloc_zeros::<f32>(n).map_err(|e| err("alloc", e))?;
        let (cp, sp, op) = (codes.device_ptr(s).0, scales.device_ptr(s).0, out.device_ptr(s).0);
        let (nl, hi, gi) = (n as i64, h as i32, rows.config.group(h) as i32);
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256).min(65_535) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: dequantize_rows(const u8*, const float*, long, int, int, int, float*) over n codes.
        unsafe {
            s.launch_builder(&self.dequantize)
                .arg(&cp)
                .arg(&sp)
                .arg(&nl)
                .arg(&hi)
                .arg(&gi)
                .arg(&kind)
                .arg(&op)
                .launch(cfg)
        }
        .map_err(|e| err("dequantize_rows", e))?;
        s.clone_dtoh(&out).map_err(|e| err("download", e))
    }
}
