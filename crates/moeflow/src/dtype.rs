//! Element types of tensors.

use crate::error::{MoeError, Result};
use std::fmt;
use std::str::FromStr;

/// The element type of a [`crate::Tensor`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// bfloat16: f32's exponent, 8-bit significand.
    BF16,
    /// IEEE binary16.
    F16,
    /// fp8 with 4 exponent and 3 mantissa bits (max 448, no infinities).
    F8E4M3,
    /// fp8 with 5 exponent and 2 mantissa bits.
    F8E5M2,
    /// Signed 8-bit integer.
    I8,
    /// Signed 32-bit integer.
    I32,
}

impl DType {
    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::F8E4M3 | DType::F8E5M2 | DType::I8 => 1,
        }
    }

    /// The lowercase name used on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
            DType::I8 => "i8",
            DType::I32 => "i32",
        }
    }

    /// All types, in declaration order.
    pub const ALL: [DType; 7] =
        [DType::F32, DType::BF16, DType::F16, DType::F8E4M3, DType::F8E5M2, DType::I8, DType::I32];
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = MoeError;
    fn from_str(s: &str) -> Result<Self> {
        DType::ALL.into_iter().find(|d| d.name() == s.to_ascii_lowercase()).ok_or_else(|| {
            let names: Vec<_> = DType::ALL.iter().map(|d| d.name()).collect();
            MoeError::Config(format!("unknown dtype '{s}' (known: {})", names.join(", ")))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
        assert!("f64".parse::<DType>().unwrap_err().to_string().contains("bf16"));
    }
}
