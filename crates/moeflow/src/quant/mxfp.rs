//! MXFP8: blocks of 32 e4m3 values sharing a power-of-two (e8m0) scale.

use super::fp8::{fp8_e4m3_encode, FP8_E4M3_MAX};

/// `x [rows, h]` → (codes, scales as the f32 value of each e8m0 exponent).
pub(super) fn quantize_mxfp8(x: &[f32], h: usize) -> (Vec<u8>, Vec<f32>) {
    let mut data = vec![0u8; x.len()];
    let mut scales = Vec::with_capacity(x.len().div_ceil(32));
    for (row, out) in x.chunks(h.max(1)).zip(data.chunks_mut(h.max(1))) {
        for (g, o) in row.chunks(32).zip(out.chunks_mut(32)) {
            let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
            if amax == 0.0 {
                scales.push(0.0);
                continue;
            }
            // Smallest power of two that brings amax within e4m3's range (e8m0 spans 2^±127).
            let e = (amax / FP8_E4M3_MAX).log2().ceil().clamp(-127.0, 127.0) as i32;
            let scale = f32::powi(2.0, e);
            scales.push(scale);
            for (v, q) in g.iter().zip(o.iter_mut()) {
                *q = fp8_e4m3_encode(v / scale);
            }
        }
    }
    (data, scales)
}
