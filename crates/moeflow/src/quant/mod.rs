//! Quantization of activations for dispatch (and of expert weights): the formats, each a
//! [`QuantConfig`] that experts declare and prepare honours.
//!
//! | format | values | scale |
//! | --- | --- | --- |
//! | `int8` | int8, symmetric | one f32 per token (amax / 127) |
//! | `fp8` | fp8 e4m3 | one f32 per token (amax / 448) |
//! | `fp8-block` | fp8 e4m3 | one f32 per 1×128 block (DeepSeek-V3) |
//! | `mxfp8` | fp8 e4m3 | one power of two (e8m0) per 32 values |
//!
//! Defined behaviour: an all-zero row or block gets scale 0 and quantizes to zeros (no division
//! by zero); values beyond the format's range saturate; NaN or infinite input is an error
//! before anything is sent.

mod fp8;
mod int8;
mod mxfp;
mod scaled;
mod weights;

use crate::error::{check_finite, MoeError, Result};
use std::str::FromStr;

pub use fp8::{fp8_e4m3_decode, fp8_e4m3_encode, FP8_E4M3_MAX};
pub use weights::{Dequantizer, WeightQuant};

/// A quantization format for activations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum QuantConfig {
    /// f32 rows, no scales.
    #[default]
    None,
    /// int8, one scale per token.
    Int8,
    /// fp8 e4m3, one scale per token.
    Fp8,
    /// fp8 e4m3, one scale per 128 values.
    Fp8Block,
    /// fp8 e4m3 with a power-of-two scale per 32 values.
    Mxfp8,
}

impl QuantConfig {
    /// The format the routed experts' weights are quantized to when rows travel in this one:
    /// per-channel int8 with int8 rows, 128 × 128 fp8 blocks with any fp8 rows.
    pub fn weight_format(self) -> Option<weights::WeightQuant> {
        match self {
            QuantConfig::None => None,
            QuantConfig::Int8 => Some(weights::WeightQuant::Int8Channel),
            QuantConfig::Fp8 | QuantConfig::Fp8Block | QuantConfig::Mxfp8 => Some(weights::WeightQuant::Fp8Block(128)),
        }
    }

    /// Every format.
    pub const ALL: [QuantConfig; 5] =
        [QuantConfig::None, QuantConfig::Int8, QuantConfig::Fp8, QuantConfig::Fp8Block, QuantConfig::Mxfp8];

    /// Name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            QuantConfig::None => "none",
            QuantConfig::Int8 => "int8",
            QuantConfig::Fp8 => "fp8",
            QuantConfig::Fp8Block => "fp8-block",
            QuantConfig::Mxfp8 => "mxfp8",
        }
    }

    /// Values sharing one scale in a row of `h`.
    pub fn group(self, h: usize) -> usize {
        match self {
            QuantConfig::None => h.max(1),
            QuantConfig::Int8 | QuantConfig::Fp8 => h.max(1),
            QuantConfig::Fp8Block => 128,
            QuantConfig::Mxfp8 => 32,
        }
    }

    /// Scales per row of `h` values.
    pub fn scales_per_row(self, h: usize) -> usize {
        if self == QuantConfig::None {
            0
        } else {
            h.div_ceil(self.group(h))
        }
    }

    /// Bytes of one quantized row of `h` values (scales not included).
    pub fn row_bytes(self, h: usize) -> usize {
        if self == QuantConfig::None {
            4 * h
        } else {
            h
        }
    }

    /// Relative error bound of one quantize/dequantize round trip, against the largest value
    /// of its group: half a step of the format.
    pub fn step(self) -> f64 {
        match self {
            QuantConfig::None => 0.0,
            // Symmetric int8: amax maps to 127, a step is amax / 127.
            QuantConfig::Int8 => 0.5 / 127.0,
            // e4m3 keeps 3 mantissa bits: relative spacing 2^-3 at worst, half of it rounding;
            // the power-of-two MX scale costs at most another factor 2 of range, not precision.
            QuantConfig::Fp8 | QuantConfig::Fp8Block | QuantConfig::Mxfp8 => 1.0 / 16.0,
        }
    }
}

impl std::fmt::Display for QuantConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for QuantConfig {
    type Err = MoeError;
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|q| q.name() == s).ok_or_else(|| {
            let names: Vec<_> = Self::ALL.iter().map(|q| q.name()).collect();
            MoeError::Config(format!("unknown quantization '{s}' (known: {})", names.join(", ")))
        })
    }
}

/// Quantized rows: `data [rows, row_bytes]` and `scales [rows, scales_per_row]`.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantRows {
    /// The format.
    pub config: QuantConfig,
    /// Values per row.
    pub hidden: usize,
    /// Row payloads (f32 little-endian bytes for `None`).
    pub data: Vec<u8>,
    /// Scales.
    pub scales: Vec<f32>,
}

impl QuantRows {
    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.data.len() / self.config.row_bytes(self.hidden).max(1)
    }
}

/// Quantizes `x [rows, h]`; non-finite input is an error.
pub fn quantize(config: QuantConfig, x: &[f32], h: usize) -> Result<QuantRows> {
    check_finite("activations to quantize", x)?;
    let (data, scales) = match config {
        QuantConfig::None => (bytemuck::cast_slice(x).to_vec(), Vec::new()),
        QuantConfig::Int8 => int8::quantize(x, h, h.max(1)),
        QuantConfig::Fp8 => fp8::quantize(x, h, h.max(1)),
        QuantConfig::Fp8Block => fp8::quantize(x, h, 128),
        QuantConfig::Mxfp8 => mxfp::quantize_mxfp8(x, h),
    };
    Ok(QuantRows { config, hidden: h, data, scales })
}

/// Back to f32 rows `[rows, h]`.
pub fn dequantize(q: &QuantRows) -> Vec<f32> {
    let h = q.hidden;
    match q.config {
        QuantConfig::None => q.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        QuantConfig::Int8 => int8::dequantize(&q.data, &q.scales, h, h.max(1)),
        QuantConfig::Fp8 => fp8::dequantize(&q.data, &q.scales, h, h.max(1)),
        QuantConfig::Fp8Block => fp8::dequantize(&q.data, &q.scales, h, 128),
        QuantConfig::Mxfp8 => fp8::dequantize(&q.data, &q.scales, h, 32),
    }
}

#[cfg(test)]
mod tests;
