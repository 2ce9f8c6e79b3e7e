//! Dequantization of quantized checkpoint weights on load: MXFP4 (GPT-OSS) and fp8 e4m3 with
//! 128×128 block scales (DeepSeek-V3).

use crate::error::{MoeError, Result};

/// The 16 fp4 (e2m1) values, by code.
const FP4: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// MXFP4 → f32. `blocks [rows, groups, 16]` bytes hold 32 fp4 codes per group (low nibble
/// first); `scales [rows, groups]` are e8m0 exponents (value `2^(s - 127)`). Output
/// `[rows, groups · 32]`.
pub fn mxfp4(blocks: &[u8], scales: &[u8], rows: usize, groups: usize) -> Result<Vec<f32>> {
    if blocks.len() != rows * groups * 16 || scales.len() != rows * groups {
        return Err(MoeError::shape("MXFP4 blocks/scales", [rows, groups, 16], [blocks.len(), scales.len()]));
    }
    let mut out = Vec::with_capacity(rows * groups * 32);
    for (g, &s) in scales.iter().enumerate() {
        let scale = f32::powi(2.0, s as i32 - 127);
        for &b in &blocks[g * 16..(g + 1) * 16] {
            out.push(FP4[(b & 0x0f) as usize] * scale);
            out.push(FP4[(b >> 4) as usize] * scale);
        }
    }
    Ok(out)
}

/// fp8 e4m3 `w [n, k]` times per-block `scale_inv [ceil(n/128), ceil(k/128)]` → f32.
pub fn fp8_block(w: &[f32], scale_inv: &[f32], n: usize, k: usize, block: usize) -> Result<Vec<f32>> {
    let (bn, bk) = (n.div_ceil(block), k.div_ceil(block));
    if w.len() != n * k || scale_inv.len() != bn * bk {
        return Err(MoeError::shape("fp8 weight/weight_scale_inv", [n, k, bn, bk], [w.len(), scale_inv.len()]));
    }
    Ok(w.iter().enumerate().map(|(i, &v)| v * scale_inv[(i / k / block) * bk + (i % k) / block]).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mxfp4_decodes_nibbles_and_scales() {
        // One row, one group: codes 1 (0.5) and 15 (-6) in the first byte, then zeros.
        let mut blocks = vec![0u8; 16];
        blocks[0] = 0xf1;
        blocks[1] = 0x27;
        let out = mxfp4(&blocks, &[128], 1, 1).unwrap();
        assert_eq!(&out[..4], &[1.0, -12.0, 12.0, 2.0]);
        assert!(out[4..].iter().all(|&v| v == 0.0));
        assert!(mxfp4(&blocks, &[128, 1], 1, 1).is_err());
    }

    #[test]
    fn fp8_block_scales_each_block() {
        // n = 3, k = 2, block 2: blocks (rows 0-1) and (row 2).
        let w = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let out = fp8_block(&w, &[10.0, 0.5], 3, 2, 2).unwrap();
        assert_eq!(out, vec![10.0, 20.0, 30.0, 40.0, 2.5, 3.0]);
    }
}
