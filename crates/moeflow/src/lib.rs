//! moeflow: the Mixture-of-Experts layer, in four stages.
//!
//! Router → Quantize+Dispatch → Permute/Experts/Unpermute → Combine. [`MoeLayer`] owns one of
//! each stage: a [`router::Router`], a [`dispatch::PrepareFinalize`] strategy, an
//! [`experts::Experts`] implementation and the [`reduce::WeightAndReduce`] it asks for.
//!
//! ```
//! use moeflow::{preset, reference, Bf16Matmul, DType, LayerOptions, MoeLayer, Tensor};
//!
//! // A small DeepSeek-style layer: 16 experts, top-4, sigmoid grouped routing, a shared expert.
//! let mut config = preset::preset("deepseek-v3")?.config.with_num_experts(16)?;
//! config.hidden = 64;
//! config.inter = 32;
//! config.shared = Some(moeflow::SharedConfig { inter: 32, gated: false });
//! config.top_k = 4;
//! let weights = preset::random_weights(&config, DType::BF16, 7);
//! let layer = MoeLayer::new(&config, &weights, LayerOptions::default())?;
//!
//! let tokens = 5;
//! let x = preset::uniform(tokens * config.hidden, 1.0, 11);
//! let out = layer.forward(&Tensor::from_f32(&[tokens, config.hidden], x.clone())?)?;
//! assert_eq!(out.shape(), &[tokens, config.hidden]);
//!
//! // The f64 reference agrees: to bf16 rounding where the CPU takes bf16 dot products (under
//! // `Bf16Matmul::Auto`, AMD CPUs with AVX512-BF16), to f32 rounding where it widens them.
//! let want = reference::forward(&config, &weights, &x)?.out;
//! let got = out.to_f32_vec();
//! let max = want.iter().fold(0f64, |m, v| m.max(v.abs()));
//! let tol = if Bf16Matmul::Auto.uses_dot() { 2e-2 } else { 1e-5 };
//! assert!(got.iter().zip(&want).all(|(g, w)| (*g as f64 - w).abs() <= tol * max));
//! # Ok::<(), moeflow::MoeError>(())
//! ```

#![warn(missing_docs)]

/// The README's examples, run as doctests (`cargo test --doc`).
#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

pub mod auto_strategy;
pub mod backend;
pub mod comm;
pub mod config;
pub mod dispatch;
pub mod dtype;
pub mod eplb;
pub mod error;
pub mod experts;
pub mod layer;
pub mod load_stats;
pub mod memory;
pub mod model;
pub mod parallel;
pub mod placement;
pub mod preset;
pub mod quant;
pub mod rank_layer;
pub mod reduce;
pub mod reference;
pub mod router;
pub mod simulate;
pub mod skew;
pub mod tensor;

pub use backend::cpu::dot::Bf16Matmul;
pub use config::{MoeConfig, MoeWeights, SharedConfig, SharedWeights};
pub use dtype::DType;
pub use error::{MoeError, Result};
pub use experts::{Activation, ExpertWeights};
pub use layer::{ExpertsKind, LayerOptions, MoeLayer, StageTimes, Workspace};
pub use load_stats::{LoadRecord, LoadStats};
pub use rank_layer::{RankLayer, RankLayerSpec};
pub use router::{RouterConfig, TopK};
pub use tensor::Tensor;
