//! fp8 e4m3 codes with one f32 scale per group of values (per token, or 1×128 blocks).

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
    let mut data = vec![0u8; x.len()];
    let mut scales = Vec::with_capacity(x.len().div_ceil(group.max(1)));
    for (row, out) in x.chunks(h.max(1)).zip(data.chunks_mut(h.max(1))) {
        for (g, o) in row.chunks(group).zip(out.chunks_mut(group)) {
            let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = amax / FP8_E4M3_MAX;
            scales.push(scale);
            if scale > 0.0 {
                for (v, q) in g.iter().zip(o.iter_mut()) {
                    *q = fp8_e4m3_encode(v / scale);
                }
            }
        }
    }
    (data, scales)
}

/// Codes and scales back to f32.
pub(super) fn dequantize(data: &[u8], scales: &[f32], h: usize, group: usize) -> Vec<f32> {
    let per_row = h.div_ceil(group.max(1));
    let lut: Vec<f32> = (0..=255u8).map(fp8_e4m3_decode).collect();
    data.iter().enumerate().map(|(i, &q)| lut[q as usize] * scales[(i / h) * per_row + (i % h) / group]).collect()
}
