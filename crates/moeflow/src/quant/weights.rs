//! Quantized expert weights: fp8 e4m3 with 2-D block scales (DeepSeek-V3's 128×128) and int8
//! with one scale per output channel.

use super::fp8::{fp8_e4m3_decode, fp8_e4m3_encode, FP8_E4M3_MAX};
use crate::error::{MoeError, Result};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// How expert weights are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum WeightQuant {
    /// fp8 e4m3 codes, one f32 scale per `block × block` tile (`weight_scale_inv`).
    Fp8Block(usize),
    /// int8 codes, one f32 scale per output row.
    Int8Channel,
    /// fp4 (e2m1) codes, one per byte, with a power-of-two scale per 32 values along a row
    /// (MXFP4, as GPT-OSS checkpoints store their experts).
    Mxfp4,
}

/// The 16 fp4 (e2m1) values, by code.
pub const FP4_E2M1: [f32; 16] =
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

impl WeightQuant {
    /// Scales of one `[n, k]` matrix.
    pub fn scales_len(self, n: usize, k: usize) -> usize {
        match self {
            WeightQuant::Fp8Block(b) => n.div_ceil(b) * k.div_ceil(b),
            WeightQuant::Int8Channel => n,
            WeightQuant::Mxfp4 => n * k.div_ceil(32),
        }
    }

    /// The largest magnitude a code decodes to before scaling (fp8 e4m3 448, int8 127, fp4 6).
    pub fn largest_code(self) -> f32 {
        match self {
            WeightQuant::Fp8Block(_) => 448.0,
            WeightQuant::Int8Channel => 127.0,
            WeightQuant::Mxfp4 => 6.0,
        }
    }

    /// Quantizes `count` matrices `[n, k]` stored back to back: (codes, scales).
    pub fn quantize(self, w: &[f32], count: usize, n: usize, k: usize) -> Result<(Vec<u8>, Vec<f32>)> {
        crate::error::check_finite("expert weights to quantize", w)?;
        if w.len() != count * n * k {
            return Err(MoeError::shape("weights to quantize", [count, n, k], w.len()));
        }
        let mut codes = vec![0u8; w.len()];
        let mut scales = Vec::with_capacity(count * self.scales_len(n, k));
        for (m, c) in w.chunks(n * k).zip(codes.chunks_mut(n * k)) {
            match self {
                WeightQuant::Fp8Block(b) => {
                    for bi in 0..n.div_ceil(b) {
                        for bj in 0..k.div_ceil(b) {
                            let (rows, cols) = (bi * b..((bi + 1) * b).min(n), bj * b..((bj + 1) * b).min(k));
                            let amax = rows
                                .clone()
                                .flat_map(|r| m[r * k + cols.start..r * k + cols.end].iter())
                                .fold(0f32, |a, v| a.max(v.abs()));
                            let scale = amax / FP8_E4M3_MAX;
                            scales.push(scale);
                            if scale > 0.0 {
                                for r in rows.clone() {
                                    for j in cols.clone() {
                                        c[r * k + j] = fp8_e4m3_encode(m[r * k + j] / scale);
                                    }
                                }
                            }
                        }
                    }
                }
                WeightQuant::Mxfp4 => {
                    for r in 0..n {
                        for (g, (src, dst)) in
                            m[r * k..(r + 1) * k].chunks(32).zip(c[r * k..(r + 1) * k].chunks_mut(32)).enumerate()
                        {
                            let _ = g;
                            let amax = src.iter().fold(0f32, |a, v| a.max(v.abs()));
                            if amax == 0.0 {
                                scales.push(0.0);
                                continue;
                            }
                            let scale = f32::powi(2.0, super::mxfp::ceil_log2(amax / 6.0).clamp(-127, 127));
                            scales.push(scale);
                            for (q, v) in dst.iter_mut().zip(src) {
                                let x = v / scale;
                                *q = (0..16u8)
                                    .min_by(|&a, &b| {
                                        (FP4_E2M1[a as usize] - x).abs().total_cmp(&(FP4_E2M1[b as usize] - x).abs())
                                    })
                                    .unwrap_or(0);
                            }
                        }
                    }
                }
                WeightQuant::Int8Channel => {
                    for r in 0..n {
                        let row = &m[r * k..(r + 1) * k];
                        let scale = row.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
                        scales.push(scale);
                        if scale > 0.0 {
                            for (q, v) in c[r * k..(r + 1) * k].iter_mut().zip(row) {
                                *q = ((v / scale).round().clamp(-127.0, 127.0) as i8) as u8;
                            }
                        }
                    }
                }
            }
        }
        Ok((codes, scales))
    }

    /// Matrix `e` of a stack back to f32 `[n, k]`.
    pub fn dequantize_one(self, codes: &[u8], scales: &[f32], e: usize, n: usize, k: usize) -> Vec<f32> {
        let (c, s) =
            (&codes[e * n * k..(e + 1) * n * k], &scales[e * self.scales_len(n, k)..(e + 1) * self.scales_len(n, k)]);
        match self {
            WeightQuant::Fp8Block(b) => {
                let lut: Vec<f32> = (0..=255u8).map(fp8_e4m3_decode).collect();
                let bk = k.div_ceil(b);
                c.par_iter().enumerate().map(|(i, &q)| lut[q as usize] * s[(i / k / b) * bk + (i % k) / b]).collect()
            }
            WeightQuant::Int8Channel => c.par_iter().enumerate().map(|(i, &q)| (q as i8) as f32 * s[i / k]).collect(),
            WeightQuant::Mxfp4 => {
                let groups = k.div_ceil(32);
                c.par_iter()
                    .enumerate()
                    .map(|(i, &q)| FP4_E2M1[(q & 15) as usize] * s[(i / k) * groups + (i % k) / 32])
                    .collect()
            }
        }
    }

    /// Every matrix of a stack back to f32.
    pub fn dequantize(self, codes: &[u8], scales: &[f32], count: usize, n: usize, k: usize) -> Vec<f32> {
        (0..count).flat_map(|e| self.dequantize_one(codes, scales, e, n, k)).collect()
    }

    /// Relative precision of one weight (half a step).
    pub fn step(self) -> f64 {
        match self {
            WeightQuant::Fp8Block(_) => 1.0 / 16.0,
            WeightQuant::Int8Channel => 0.5 / 127.0,
            // e2m1: one mantissa bit, relative spacing up to 1/2 (half a step: 1/4) over the
            // normal range; the scale keeps each block's largest value near the top.
            WeightQuant::Mxfp4 => 0.25,
        }
    }
}

/// Element access to one quantized matrix `[n, k]` without materialising it.
pub struct Dequantizer<'a> {
    format: WeightQuant,
    codes: &'a [u8],
    scales: &'a [f32],
    k: usize,
    lut: [f32; 256],
}

impl<'a> Dequantizer<'a> {
    /// Matrix `e` of a stack of `[n, k]` matrices.
    pub fn new(format: WeightQuant, codes: &'a [u8], scales: &'a [f32], e: usize, n: usize, k: usize) -> Self {
        let per = format.scales_len(n, k);
        let mut lut = [0f32; 256];
        for (q, v) in lut.iter_mut().enumerate() {
            *v = match format {
                WeightQuant::Fp8Block(_) => fp8_e4m3_decode(q as u8),
                WeightQuant::Int8Channel => (q as u8 as i8) as f32,
                WeightQuant::Mxfp4 => FP4_E2M1[q & 15],
            };
        }
        Dequantizer {
            format,
            codes: &codes[e * n * k..(e + 1) * n * k],
            scales: &scales[e * per..(e + 1) * per],
            k,
            lut,
        }
    }

    /// Row `r` in f32 into `out` (`k` values; the same values [`WeightQuant::dequantize_one`]
    /// gives), one scale lookup per block.
    pub fn row(&self, r: usize, out: &mut [f32]) {
        let k = self.k;
        let codes = &self.codes[r * k..(r + 1) * k];
        let (block, scales): (usize, &[f32]) = match self.format {
            WeightQuant::Fp8Block(b) => (b, &self.scales[(r / b) * k.div_ceil(b)..]),
            WeightQuant::Int8Channel => (k.max(1), &self.scales[r..]),
            WeightQuant::Mxfp4 => (32, &self.scales[r * k.div_ceil(32)..]),
        };
        for ((o, q), s) in out.chunks_mut(block).zip(codes.chunks(block)).zip(scales) {
            for (v, &c) in o.iter_mut().zip(q) {
                *v = self.lut[c as usize] * s;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_round_trip_and_scale_per_block() {
        // Two 3×4 matrices, block 2: blocks with different magnitudes get their own scale.
        let w: Vec<f32> = vec![
            448.0, 1.0, 0.5, 0.25, 2.0, -448.0, 0.125, 0.0, 2.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
            0.0, 0.0, 0.0, 0.0,
        ];
        let q = WeightQuant::Fp8Block(2);
        let (codes, scales) = q.quantize(&w, 2, 3, 4).unwrap();
        assert_eq!(scales.len(), 2 * 4);
        assert_eq!(scales[0], 1.0);
        assert_eq!(&scales[4..], &[0.0; 4], "an all-zero matrix has zero scales and stays zero");
        let back = q.dequantize(&codes, &scales, 2, 3, 4);
        assert_eq!(back, w, "these values are representable in their blocks");
        let q = WeightQuant::Int8Channel;
        let w: Vec<f32> = vec![127.0, -1.0, 2.0, 0.0, 0.0, 0.0];
        let (codes, scales) = q.quantize(&w, 1, 2, 3).unwrap();
        assert_eq!(scales, vec![1.0, 0.0]);
        assert_eq!(q.dequantize(&codes, &scales, 1, 2, 3), w);
        assert!(q.quantize(&[f32::NAN; 6], 1, 2, 3).is_err());
        // MXFP4: fp4 values times a power of two are exact.
        let q = WeightQuant::Mxfp4;
        let w: Vec<f32> = [6.0, -3.0, 0.5, 1.5].repeat(8).iter().map(|v| v * 4.0).collect();
        let (codes, scales) = q.quantize(&w, 1, 1, 32).unwrap();
        assert_eq!(scales, vec![4.0]);
        assert_eq!(q.dequantize(&codes, &scales, 1, 1, 32), w);
        let mut row = vec![0f32; 32];
        Dequantizer::new(q, &codes, &scales, 0, 1, 32).row(0, &mut row);
        assert_eq!(row, w);
    }
}
