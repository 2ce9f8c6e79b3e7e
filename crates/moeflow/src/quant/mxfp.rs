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
            let scale = f32::powi(2.0, ceil_log2(amax / FP8_E4M3_MAX).clamp(-127, 127));
            scales.push(scale);
            for (v, q) in g.iter().zip(o.iter_mut()) {
                *q = fp8_e4m3_encode(v / scale);
            }
        }
    }
    (data, scales)
}

/// ⌈log2 v⌉ for v > 0, exactly, from the bits (subnormals: -127, below e8m0's range anyway).
pub(crate) fn ceil_log2(v: f32) -> i32 {
    let b = v.to_bits();
    let e = ((b >> 23) & 0xff) as i32;
    if e == 0 {
        return -127;
    }
    e - 127 + i32::from(b & 0x7f_ffff != 0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn ceil_log2_is_exact() {
        assert_eq!(super::ceil_log2(1.0), 0);
        assert_eq!(super::ceil_log2(1.0000001), 1);
        assert_eq!(super::ceil_log2(0.5), -1);
        assert_eq!(super::ceil_log2(0.75), 0);
        assert_eq!(super::ceil_log2(3.0e38), 128);
        assert_eq!(super::ceil_log2(1e-45), -127);
    }
}
