//! The one error type of the library.

use thiserror::Error;

/// Everything that can go wrong in moeflow, with enough context to act on.
#[derive(Debug, Error)]
pub enum MoeError {
    /// A tensor or buffer has the wrong shape.
    #[error("shape mismatch for {what}: expected {expected}, got {got}")]
    Shape {
        /// Which input.
        what: String,
        /// The shape the layer needs.
        expected: String,
        /// The shape it was given.
        got: String,
    },
    /// A tensor has the wrong element type.
    #[error("dtype mismatch for {what}: expected {expected}, got {got}")]
    DType {
        /// Which input.
        what: String,
        /// Accepted types.
        expected: String,
        /// Given type.
        got: String,
    },
    /// An expert id outside `0..num_experts`.
    #[error("expert id {id} out of range 0..{num_experts} (token {token}, slot {slot})")]
    ExpertOutOfRange {
        /// The bad id.
        id: i64,
        /// Number of experts.
        num_experts: usize,
        /// Token row.
        token: usize,
        /// Top-k slot.
        slot: usize,
    },
    /// NaN or infinity where a finite value is required.
    #[error("non-finite value {value} in {what} at index {index}")]
    NonFinite {
        /// Which input.
        what: String,
        /// Flat index of the first bad value.
        index: usize,
        /// The value.
        value: f32,
    },
    /// NaN or infinity in a layer's output `[T, H]` (weights or inputs too large for f32).
    #[error("the output has {count} non-finite values; the first, {value}, at token {token}, column {column}")]
    NonFiniteOutput {
        /// How many values are NaN or infinite.
        count: usize,
        /// Row of the first.
        token: usize,
        /// Column of the first.
        column: usize,
        /// The first.
        value: f32,
    },
    /// A device allocation failed for lack of memory.
    #[error("{what}: the GPU is out of memory")]
    DeviceOutOfMemory {
        /// What was being allocated.
        what: String,
    },
    /// A configuration value that cannot work.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A file that is not in the format it should be (safetensors header, index, JSON layout).
    #[error("{0}")]
    Format(String),
    /// More memory than an allocation can hold or than this machine (or GPU) has available.
    #[error("{what} needs {}{}", crate::memory::human(*needed), available.map(|a| format!(", more than the {} available", crate::memory::human(a))).unwrap_or_else(|| ", more than any allocation can hold".into()))]
    OutOfMemory {
        /// What was to be allocated (tensor, buffer or the flag that sized it).
        what: String,
        /// Bytes it needs.
        needed: u128,
        /// Bytes available, where known.
        available: Option<u128>,
    },
    /// A feature this build or backend does not provide.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A collective failed or timed out.
    #[error("communication error on rank {rank} during {op}: {message}")]
    Comm {
        /// Rank reporting the error.
        rank: usize,
        /// The collective.
        op: String,
        /// What happened.
        message: String,
    },
    /// File input or output.
    #[error("{context}: {source}")]
    Io {
        /// What was being read or written.
        context: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Malformed JSON.
    #[error("{context}: {source}")]
    Json {
        /// What was being parsed.
        context: String,
        /// The underlying error.
        source: serde_json::Error,
    },
}

/// Result with [`MoeError`].
pub type Result<T> = std::result::Result<T, MoeError>;

impl MoeError {
    /// Shorthand for a [`MoeError::Shape`].
    pub fn shape(what: impl Into<String>, expected: impl std::fmt::Debug, got: impl std::fmt::Debug) -> Self {
        MoeError::Shape { what: what.into(), expected: format!("{expected:?}"), got: format!("{got:?}") }
    }
}

/// Returns an error naming the first non-finite value of `tensor`, called `what`.
pub fn check_finite_tensor(what: &str, tensor: &crate::tensor::Tensor) -> Result<()> {
    match tensor.first_nonfinite() {
        None => Ok(()),
        Some((index, value)) => Err(MoeError::NonFinite { what: what.to_string(), index, value }),
    }
}

/// Checks a layer output `out [T, hidden]`: an error with the count of NaN and infinite values
/// and the position of the first.
pub fn check_output(out: &[f32], hidden: usize) -> Result<()> {
    use rayon::prelude::*;
    let Some(first) = out.par_iter().with_min_len(1 << 16).position_first(|v| !v.is_finite()) else {
        return Ok(());
    };
    let count = out[first..].par_iter().with_min_len(1 << 16).filter(|v| !v.is_finite()).count();
    let hidden = hidden.max(1);
    Err(MoeError::NonFiniteOutput { count, token: first / hidden, column: first % hidden, value: out[first] })
}

/// Returns an error naming the first non-finite value of `data`.
pub fn check_finite(what: &str, data: &[f32]) -> Result<()> {
    match data.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(index) => Err(MoeError::NonFinite { what: what.to_string(), index, value: data[index] }),
    }
}
