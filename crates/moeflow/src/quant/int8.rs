//! Symmetric int8 with one f32 scale per group of `group` values in each row.

use super::scaled::{dequantize_groups, quantize_groups};

/// `x [rows, h]` → (codes, scales `[rows, ceil(h / group)]`), scale = amax / 127.
pub(super) fn quantize(x: &[f32], h: usize, group: usize) -> (Vec<u8>, Vec<f32>) {
    quantize_groups(x, h, group, 127.0, |v| (v.round().clamp(-127.0, 127.0) as i8) as u8)
}

/// Codes and scales back to f32.
pub(super) fn dequantize(data: &[u8], scales: &[f32], h: usize, group: usize) -> Vec<f32> {
    dequantize_groups(data, scales, h, group, |q| (q as i8) as f32)
}
