//! Symmetric int8 with one f32 scale per group of `group` values in each row.

/// `x [rows, h]` → (codes, scales `[rows, ceil(h / group)]`), scale = amax / 127.
pub(super) fn quantize(x: &[f32], h: usize, group: usize) -> (Vec<u8>, Vec<f32>) {
    let mut data = vec![0u8; x.len()];
    let mut scales = Vec::with_capacity(x.len().div_ceil(group.max(1)));
    for (row, out) in x.chunks(h.max(1)).zip(data.chunks_mut(h.max(1))) {
        for (g, o) in row.chunks(group).zip(out.chunks_mut(group)) {
            let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = amax / 127.0;
            scales.push(scale);
            if scale > 0.0 {
                for (v, q) in g.iter().zip(o.iter_mut()) {
                    *q = ((v / scale).round().clamp(-127.0, 127.0) as i8) as u8;
                }
            }
        }
    }
    (data, scales)
}

/// Codes and scales back to f32.
pub(super) fn dequantize(data: &[u8], scales: &[f32], h: usize, group: usize) -> Vec<f32> {
    let per_row = h.div_ceil(group.max(1));
    data.iter().enumerate().map(|(i, &q)| (q as i8) as f32 * scales[(i / h) * per_row + (i % h) / group]).collect()
}
