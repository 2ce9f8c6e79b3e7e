//! Hugging Face checkpoints: find the MoE blocks of a model and load one, with the model
//! family's own tensor names and router semantics.
//!
//! One file per family: `mixtral.rs`, `qwen_moe.rs` (Qwen2-MoE, Qwen3-MoE, OLMoE), `deepseek.rs`
//! (V2, V3), `gpt_oss.rs`. Quantized weights (GPT-OSS MXFP4, DeepSeek-V3 fp8 blocks) are
//! dequantized on load.

mod checkpoint;
mod deepseek;
pub mod dequant;
mod gpt_oss;
mod hf_config;
pub mod io;
mod mixtral;
mod qwen_moe;

pub use checkpoint::Checkpoint;
pub use hf_config::HfConfig;

use crate::config::{MoeConfig, MoeWeights};
use crate::error::{MoeError, Result};
use crate::experts::ExpertWeights;
use crate::tensor::Tensor;
use crate::DType;

/// The model families moeflow reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// `mixtral`.
    Mixtral,
    /// `qwen2_moe`.
    Qwen2Moe,
    /// `qwen3_moe`.
    Qwen3Moe,
    /// `olmoe`.
    Olmoe,
    /// `deepseek_v2`.
    DeepseekV2,
    /// `deepseek_v3`.
    DeepseekV3,
    /// `gpt_oss`.
    GptOss,
}

impl Architecture {
    /// Every family with its `model_type`.
    pub const ALL: [(Architecture, &'static str); 7] = [
        (Architecture::Mixtral, "mixtral"),
        (Architecture::Qwen2Moe, "qwen2_moe"),
        (Architecture::Qwen3Moe, "qwen3_moe"),
        (Architecture::Olmoe, "olmoe"),
        (Architecture::DeepseekV2, "deepseek_v2"),
        (Architecture::DeepseekV3, "deepseek_v3"),
        (Architecture::GptOss, "gpt_oss"),
    ];

    /// The family of `model_type`; the error lists the supported ones.
    pub fn from_model_type(model_type: &str) -> Result<Self> {
        Self::ALL.iter().find(|(_, n)| *n == model_type).map(|(a, _)| *a).ok_or_else(|| {
            let names: Vec<&str> = Self::ALL.iter().map(|(_, n)| *n).collect();
            MoeError::Unsupported(format!("architecture '{model_type}' (supported model_type: {})", names.join(", ")))
        })
    }

    /// The `model_type` string.
    pub fn name(self) -> &'static str {
        Self::ALL.iter().find(|(a, _)| *a == self).map(|(_, n)| *n).unwrap_or("?")
    }
}

/// What a family provides.
pub(crate) trait Family {
    /// Whether decoder layer `layer` has a MoE block.
    fn is_moe_layer(cfg: &HfConfig, layer: usize) -> Result<bool>;
    /// The MoE block's configuration.
    fn config(cfg: &HfConfig) -> Result<MoeConfig>;
    /// Names of the tensors the block needs (to report the missing ones before reading).
    fn tensor_names(ckpt: &Checkpoint, prefix: &str, config: &MoeConfig) -> Vec<String>;
    /// Reads the block's weights, expert and shared weights stored as `dtype`.
    fn load(ckpt: &Checkpoint, prefix: &str, config: &MoeConfig, dtype: DType) -> Result<MoeWeights>;
    /// Reads the block keeping quantized expert weights as the checkpoint stores them.
    fn load_quantized(ckpt: &Checkpoint, _prefix: &str, _config: &MoeConfig) -> Result<MoeWeights> {
        Err(MoeError::Unsupported(format!("{} checkpoints store no quantized experts to keep", ckpt.config.model_type)))
    }
}

/// The weights of one MoE block, with where they came from.
#[derive(Clone, Debug)]
pub struct MoeBlock {
    /// Decoder layer index.
    pub layer: usize,
    /// Shapes and semantics.
    pub config: MoeConfig,
    /// Weights.
    pub weights: MoeWeights,
}

macro_rules! dispatch {
    ($arch:expr, $f:ident ( $($arg:expr),* )) => {
        match $arch {
            Architecture::Mixtral => <mixtral::Mixtral as Family>::$f($($arg),*),
            Architecture::Qwen2Moe | Architecture::Qwen3Moe | Architecture::Olmoe => <qwen_moe::QwenMoe as Family>::$f($($arg),*),
            Architecture::DeepseekV2 | Architecture::DeepseekV3 => <deepseek::DeepSeek as Family>::$f($($arg),*),
            Architecture::GptOss => <gpt_oss::GptOss as Family>::$f($($arg),*),
        }
    };
}

impl Checkpoint {
    /// The model family from `config.json`.
    pub fn architecture(&self) -> Result<Architecture> {
        Architecture::from_model_type(&self.config.model_type)
    }

    /// Decoder layers that have a MoE block.
    pub fn moe_layers(&self) -> Result<Vec<usize>> {
        let arch = self.architecture()?;
        let n = self.config.usize("num_hidden_layers")?;
        if n > MAX_LAYERS {
            return Err(MoeError::Format(format!(
                "config.json: num_hidden_layers {n} is more than {MAX_LAYERS}, more than any model has"
            )));
        }
        let mut out = Vec::new();
        for l in 0..n {
            if dispatch!(arch, is_moe_layer(&self.config, l))? {
                out.push(l);
            }
        }
        Ok(out)
    }

    fn check_layer(&self, layer: usize) -> Result<Architecture> {
        let arch = self.architecture()?;
        let layers = self.moe_layers()?;
        if layers.is_empty() {
            return Err(MoeError::Format(format!(
                "config.json: no decoder layer has a MoE block (num_hidden_layers {})",
                self.config.usize("num_hidden_layers")?
            )));
        }
        if !layers.contains(&layer) {
            let list: Vec<String> = layers.iter().map(|l| l.to_string()).collect();
            return Err(MoeError::Config(format!(
                "layer {layer} is not a MoE layer (MoE layers: {})",
                list.join(", ")
            )));
        }
        Ok(arch)
    }

    /// The configuration of layer `layer`'s MoE block.
    pub fn moe_config(&self, layer: usize) -> Result<MoeConfig> {
        let arch = self.check_layer(layer)?;
        let c = dispatch!(arch, config(&self.config))?;
        c.validate()?;
        // Families other than GPT-OSS store each routed expert in tensors of its own, so a
        // count above the checkpoint's tensors is wrong, and listing its names would not end.
        if arch != Architecture::GptOss && c.num_experts > self.tensor_count() {
            return Err(MoeError::Format(format!(
                "config.json: {} routed experts, but the checkpoint holds only {} tensors (each expert has its own)",
                c.num_experts,
                self.tensor_count()
            )));
        }
        Ok(c)
    }

    /// Names of the tensors of layer `layer`'s MoE block.
    pub fn moe_tensor_names(&self, layer: usize) -> Result<Vec<String>> {
        let arch = self.check_layer(layer)?;
        let config = self.moe_config(layer)?;
        Ok(dispatch!(arch, tensor_names(self, &prefix(layer), &config)))
    }

    /// Loads layer `layer`'s MoE block (default: the first MoE layer), expert weights as
    /// `dtype` (f32 or bf16; quantized checkpoints are dequantized). Only that block's tensors
    /// are read.
    pub fn load_moe_block(&self, layer: Option<usize>, dtype: DType) -> Result<MoeBlock> {
        if !matches!(dtype, DType::F32 | DType::BF16) {
            return Err(MoeError::Config(format!("weights load as f32 or bf16, not {dtype}")));
        }
        let layer = match layer {
            Some(l) => l,
            None => *self
                .moe_layers()?
                .first()
                .ok_or_else(|| MoeError::Format("config.json: no decoder layer has a MoE block".into()))?,
        };
        let arch = self.check_layer(layer)?;
        if dtype == DType::F8E4M3 && !matches!(arch, Architecture::DeepseekV2 | Architecture::DeepseekV3) {
            return Err(MoeError::Unsupported(format!(
                "keeping fp8 weights is for DeepSeek fp8 checkpoints, not {}",
                arch.name()
            )));
        }
        let config = self.moe_config(layer)?;
        // One expert at a time passes through f32 on the way, the whole stack when f32.
        crate::memory::ensure(
            &format!("layer {layer}'s MoE weights as {dtype}"),
            config.weight_bytes(dtype) + config.weight_bytes(DType::F32) / config.num_experts.max(1) as u128,
        )?;
        let p = prefix(layer);
        self.require(&dispatch!(arch, tensor_names(self, &p, &config)))?;
        let weights = dispatch!(arch, load(self, &p, &config, dtype))?;
        weights.validate(&config)?;
        Ok(MoeBlock { layer, config, weights })
    }
}

impl Checkpoint {
    /// As [`Checkpoint::load_moe_block`], keeping the routed experts quantized as stored: a
    /// DeepSeek-V3 fp8 checkpoint's codes and 128×128 block scales, GPT-OSS's MXFP4 blocks.
    pub fn load_moe_block_quantized(&self, layer: Option<usize>) -> Result<MoeBlock> {
        let layer = match layer {
            Some(l) => l,
            None => *self
                .moe_layers()?
                .first()
                .ok_or_else(|| MoeError::Format("config.json: no decoder layer has a MoE block".into()))?,
        };
        let arch = self.check_layer(layer)?;
        let config = self.moe_config(layer)?;
        crate::memory::ensure(&format!("layer {layer}'s quantized MoE weights"), config.weight_bytes(DType::F8E4M3))?;
        let p = prefix(layer);
        self.require(&dispatch!(arch, tensor_names(self, &p, &config)))?;
        let weights = dispatch!(arch, load_quantized(self, &p, &config))?;
        weights.validate(&config)?;
        Ok(MoeBlock { layer, config, weights })
    }
}

/// More decoder layers than any model has: a `num_hidden_layers` above it is a broken config.
const MAX_LAYERS: usize = 1 << 16;

fn prefix(layer: usize) -> String {
    format!("model.layers.{layer}.")
}

/// Stacks `count` experts into `w13 [count, 2I, H]` and `w2 [count, H, I]` as `dtype`;
/// `expert(e)` gives expert e's `(gate [I, H], up [I, H], down [H, I])` in f32.
pub(crate) fn stack_experts(
    count: usize,
    (h, i): (usize, usize),
    dtype: DType,
    mut expert: impl FnMut(usize) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)>,
) -> Result<ExpertWeights> {
    let mut w13 = Vec::with_capacity(count * 2 * i * h);
    let mut w2 = Vec::with_capacity(count * h * i);
    // Converting expert by expert keeps one expert in f32 at a time.
    let (mut w13t, mut w2t) = (Vec::new(), Vec::new());
    for e in 0..count {
        let (gate, up, down) = expert(e)?;
        w13.extend(gate);
        w13.extend(up);
        w2.extend(down);
        if dtype != DType::F32 {
            w13t.push(Tensor::from_f32_as(&[1, 2 * i, h], &w13, dtype)?);
            w2t.push(Tensor::from_f32_as(&[1, h, i], &w2, dtype)?);
            w13.clear();
            w2.clear();
        }
    }
    let (w13, w2) = if dtype == DType::F32 {
        (Tensor::from_f32(&[count, 2 * i, h], w13)?, Tensor::from_f32(&[count, h, i], w2)?)
    } else {
        (concat0(&w13t, &[count, 2 * i, h])?, concat0(&w2t, &[count, h, i])?)
    };
    Ok(ExpertWeights { w13, w2, b13: None, b2: None, quant: None })
}

/// Concatenates same-typed tensors along the first dimension.
fn concat0(parts: &[Tensor], shape: &[usize]) -> Result<Tensor> {
    use crate::tensor::CpuStorage;
    let storage = match parts.first().map(|t| t.cpu()) {
        Some(CpuStorage::BF16(_)) => CpuStorage::BF16(
            parts.iter().flat_map(|t| if let CpuStorage::BF16(v) = t.cpu() { v.clone() } else { Vec::new() }).collect(),
        ),
        _ => CpuStorage::F32(parts.iter().flat_map(|t| t.to_f32_vec()).collect()),
    };
    Tensor::new(shape, storage)
}
