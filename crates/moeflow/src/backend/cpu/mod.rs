//! The CPU backend: packed weights and the grouped GEMM the fast experts run on.
pub mod ceiling;
pub mod gemm;
pub mod mmap;
pub mod packed;
