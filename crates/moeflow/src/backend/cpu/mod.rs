//! The CPU backend: packed weights, the grouped GEMM and the row activation the fast experts
//! run on.
pub mod activation;
pub mod ceiling;
pub mod dot;
pub mod gemm;
pub mod mmap;
pub mod packed;
