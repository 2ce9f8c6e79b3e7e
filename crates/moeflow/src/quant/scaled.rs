//! The shape every scaled format shares: rows split into groups, one f32 scale per group
//! (amax / range), values divided by it and encoded.

/// `x [rows, h]` → (codes, scales `[rows, ceil(h / group)]`). An all-zero group gets scale 0
/// and zero codes.
pub(super) fn quantize_groups(
    x: &[f32],
    h: usize,
    group: usize,
    range: f32,
    encode: impl Fn(f32) -> u8,
) -> (Vec<u8>, Vec<f32>) {
    let mut data = vec![0u8; x.len()];
    let mut scales = Vec::with_capacity(x.len().div_ceil(group.max(1)));
    for (row, out) in x.chunks(h.max(1)).zip(data.chunks_mut(h.max(1))) {
        for (g, o) in row.chunks(group).zip(out.chunks_mut(group)) {
            let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = amax / range;
            scales.push(scale);
            if scale > 0.0 {
                for (v, q) in g.iter().zip(o.iter_mut()) {
                    *q = encode(v / scale);
                }
            }
        }
    }
    (data, scales)
}

/// Codes and scales back to f32 with `decode` per code (through a 256-entry table).
pub(super) fn dequantize_groups(
    data: &[u8],
    scales: &[f32],
    h: usize,
    group: usize,
    decode: impl Fn(u8) -> f32,
) -> Vec<f32> {
    let per_row = h.div_ceil(group.max(1));
    let lut: Vec<f32> = (0..=255u8).map(decode).collect();
    data.iter().enumerate().map(|(i, &q)| lut[q as usize] * scales[(i / h) * per_row + (i % h) / group]).collect()
}
