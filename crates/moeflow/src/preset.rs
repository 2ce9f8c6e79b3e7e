//! Presets: the MoE block shapes of real models, and random weights to fill them.

use crate::config::{MoeConfig, MoeWeights, SharedConfig, SharedWeights};
use crate::error::{MoeError, Result};
use crate::experts::{Activation, ExpertWeights};
use crate::router::RouterConfig;
use crate::tensor::{CpuStorage, Tensor};
use crate::DType;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

/// A named layer shape.
#[derive(Clone, Debug)]
pub struct Preset {
    /// Name on the command line.
    pub name: &'static str,
    /// The model it comes from.
    pub model: &'static str,
    /// The layer.
    pub config: MoeConfig,
}

/// A layer of the given shape and semantics, the router's weights not applied on the input
/// (every preset's, and the tests' small layers).
pub fn config(
    hidden: usize,
    inter: usize,
    num_experts: usize,
    top_k: usize,
    router: RouterConfig,
    activation: Activation,
    shared: Option<SharedConfig>,
) -> MoeConfig {
    MoeConfig { hidden, inter, num_experts, top_k, router, activation, apply_router_weight_on_input: false, shared }
}

/// Every preset, smallest weights first.
pub fn presets() -> Vec<Preset> {
    let soft = |renormalize| RouterConfig::Softmax { renormalize };
    vec![
        Preset {
            name: "olmoe-1b-7b",
            model: "allenai/OLMoE-1B-7B-0924",
            config: config(2048, 1024, 64, 8, soft(false), Activation::Silu, None),
        },
        Preset {
            name: "qwen3-30b-a3b",
            model: "Qwen/Qwen3-30B-A3B",
            config: config(2048, 768, 128, 8, soft(true), Activation::Silu, None),
        },
        Preset {
            name: "mixtral-8x7b",
            model: "mistralai/Mixtral-8x7B-v0.1",
            config: config(4096, 14336, 8, 2, soft(true), Activation::Silu, None),
        },
        Preset {
            name: "gpt-oss-120b",
            model: "openai/gpt-oss-120b",
            config: config(2880, 2880, 128, 4, RouterConfig::TopKSoftmax, Activation::GPT_OSS, None),
        },
        Preset {
            name: "deepseek-v3",
            model: "deepseek-ai/DeepSeek-V3",
            config: config(
                7168,
                2048,
                256,
                8,
                RouterConfig::DEEPSEEK_V3,
                Activation::Silu,
                Some(SharedConfig { inter: 2048, gated: false }),
            ),
        },
    ]
}

/// The preset called `name`; the error lists the known ones.
pub fn preset(name: &str) -> Result<Preset> {
    let all = presets();
    let names: Vec<&str> = all.iter().map(|p| p.name).collect();
    all.into_iter()
        .find(|p| p.name == name)
        .ok_or_else(|| MoeError::Config(format!("unknown preset '{name}' (known: {})", names.join(", "))))
}

impl MoeConfig {
    /// The same layer with `n` experts (for machines that cannot hold them all); grouped
    /// routers keep their group count, so `n` must divide into it.
    pub fn with_num_experts(&self, n: usize) -> Result<MoeConfig> {
        let mut c = self.clone();
        c.num_experts = n;
        c.router.build(n, c.top_k, None)?;
        c.validate()?;
        Ok(c)
    }
}

/// Whether this layer carries biases in its experts and router (GPT-OSS does).
fn has_biases(config: &MoeConfig) -> bool {
    matches!(config.router, RouterConfig::TopKSoftmax)
}

/// Uniform values in `[-scale, scale)`, reproducible from `seed` whatever the thread count.
pub fn uniform(len: usize, scale: f32, seed: u64) -> Vec<f32> {
    uniform_as(len, scale, seed, |x| x)
}

/// [`uniform`]'s values passed through `convert` as they are drawn, so a tensor stored in a
/// narrower type never exists in f32 as a whole.
fn uniform_as<T: Copy + bytemuck::Zeroable + Send>(
    len: usize,
    scale: f32,
    seed: u64,
    convert: impl Fn(f32) -> T + Sync,
) -> Vec<T> {
    const CHUNK: usize = 1 << 16;
    // Fresh zeroed pages, first touched by the parallel fill.
    let mut v: Vec<T> = bytemuck::zeroed_vec(len);
    v.par_chunks_mut(CHUNK).enumerate().for_each(|(c, chunk)| {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ c as u64);
        chunk.iter_mut().for_each(|x| *x = convert(rng.gen_range(-scale..scale)));
    });
    v
}

/// [`uniform`] values of `shape` stored as `dtype` (rounded to nearest even).
fn tensor(shape: &[usize], scale: f32, seed: u64, dtype: DType) -> Tensor {
    let n = shape.iter().product();
    let storage = match dtype {
        DType::F32 => CpuStorage::F32(uniform(n, scale, seed)),
        DType::BF16 => CpuStorage::BF16(uniform_as(n, scale, seed, half::bf16::from_f32)),
        _ => return Tensor::from_f32_as(shape, &uniform(n, scale, seed), dtype).expect("shape matches length"),
    };
    Tensor::new(shape, storage).expect("shape matches length")
}

/// Random weights for `config`, expert and shared weights stored as `dtype` (router in f32).
/// Scales keep activations of order one for inputs uniform in [-1, 1].
pub fn random_weights(config: &MoeConfig, dtype: DType, seed: u64) -> MoeWeights {
    let (e, h, i) = (config.num_experts, config.hidden, config.inter);
    let sh = 1.0 / (h as f32).sqrt();
    let bias = has_biases(config);
    let mlp = |experts: usize, inter: usize, s: u64| ExpertWeights {
        w13: tensor(&[experts, 2 * inter, h], 2.0 * sh, s, dtype),
        w2: tensor(&[experts, h, inter], 2.0 / (inter as f32).sqrt(), s + 1, dtype),
        b13: bias.then(|| tensor(&[experts, 2 * inter], 0.1, s + 2, DType::F32)),
        b2: bias.then(|| tensor(&[experts, h], 0.1, s + 3, DType::F32)),
        quant: None,
    };
    MoeWeights {
        gate: tensor(&[e, h], 3.0 * sh, seed, DType::F32),
        gate_bias: bias.then(|| tensor(&[e], 0.5, seed + 1, DType::F32)),
        correction_bias: matches!(config.router, RouterConfig::SigmoidGrouped { .. })
            .then(|| tensor(&[e], 0.05, seed + 2, DType::F32)),
        experts: mlp(e, i, seed + 10),
        shared: config.shared.map(|s| SharedWeights {
            mlp: ExpertWeights { b13: None, b2: None, ..mlp(1, s.inter, seed + 20) },
            gate: s.gated.then(|| tensor(&[h], sh, seed + 30, DType::F32)),
        }),
    }
}

/// [`random_weights`] after checking `config` and that its weights fit in this machine's
/// memory (an error naming the bytes instead of an aborted allocation).
pub fn try_random_weights(config: &MoeConfig, dtype: DType, seed: u64) -> Result<MoeWeights> {
    config.validate()?;
    let router = crate::memory::bytes(&[config.num_experts, config.hidden.saturating_add(2)], 4);
    crate::memory::ensure(
        &format!("random {dtype} weights of {} experts", config.num_experts),
        config.weight_bytes(dtype).saturating_add(router),
    )?;
    Ok(random_weights(config, dtype, seed))
}

/// Bytes the expert and shared weights of `config` take in `dtype` (saturating at
/// `usize::MAX`).
pub fn weight_bytes(config: &MoeConfig, dtype: DType) -> usize {
    usize::try_from(config.weight_bytes(dtype)).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_named() {
        for p in presets() {
            p.config.validate().unwrap();
            p.config.router.build(p.config.num_experts, p.config.top_k, None).unwrap();
        }
        assert!(preset("nope").unwrap_err().to_string().contains("deepseek-v3"));
        let small = preset("deepseek-v3").unwrap().config.with_num_experts(64).unwrap();
        assert_eq!(small.num_experts, 64);
        assert!(preset("deepseek-v3").unwrap().config.with_num_experts(12).is_err());
    }

    #[test]
    fn random_weights_refuse_what_cannot_fit() {
        let mut c = preset("mixtral-8x7b").unwrap().config;
        c.num_experts = 1 << 20;
        c.top_k = 2;
        let e = try_random_weights(&c, DType::BF16, 1).unwrap_err().to_string();
        assert!(e.contains("random bf16 weights of 1048576 experts") && e.contains("needs"), "{e}");
        let small = config(8, 4, 4, 2, RouterConfig::TopKSoftmax, Activation::Silu, None);
        assert_eq!(try_random_weights(&small, DType::F32, 2).unwrap().gate, random_weights(&small, DType::F32, 2).gate);
    }

    #[test]
    fn random_weights_are_reproducible() {
        assert_eq!(uniform(200_000, 1.0, 3), uniform(200_000, 1.0, 3));
        assert_ne!(uniform(100, 1.0, 3), uniform(100, 1.0, 4));
        assert!(uniform(1000, 0.5, 1).iter().all(|x| x.abs() <= 0.5));
    }
}
