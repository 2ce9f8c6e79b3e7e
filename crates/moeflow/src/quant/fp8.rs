//! fp8 e4m3 codes with one f32 scale per group of values (per token, or 1×128 blocks).

use super::scaled::{dequantize_groups, quantize_groups};
use float8::F8E4M3;

/// Largest finite e4m3 value.
pub const FP8_E4M3_MAX: f32 = 448.0;

/// e4m3 code of `v`, saturating at ±448 (the crate would give NaN above it).
pub fn fp8_e4m3_encode(v: f32) -> u8 {
    F8E4M3::from_f32(v.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)).to_bits()
}

/// Value of an e4m3 code.
pub fn fp8_e4m3_decode(code: u8) -> f32 {
    F8E4M3::from_bits(code).to_f32()
}

/// `x [rows, h]` → (codes, scales `[rows, ceil(h / group)]`), scale = amax / 448.
pub(super) fn quantize(x: &[f32], h: usize, group: usize) -> (Vec<u8>, Vec<f32>) {
    quantize_groups(x, h, group, FP8_E4M3_MAX, fp8_e4m3_encode)
}

/// Codes and scales back to f32.
pub(super) fn dequantize(data: &[u8], scales: &[f32], h: usize, group: usize) -> Vec<f32> {
    dequantize_groups(data, scales, h, group, fp8_e4m3_decode)
}
