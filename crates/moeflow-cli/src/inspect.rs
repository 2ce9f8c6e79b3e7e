//! `moeflow inspect`: what a Hugging Face model directory holds, read from headers only.

use moeflow::model::Checkpoint;
use moeflow::{MoeError, Result};

/// Arguments of `moeflow inspect`.
#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// Model directory (config.json + safetensors, single file or sharded).
    #[arg(long)]
    model: std::path::PathBuf,
    /// Tensors listed per block (the rest are counted).
    #[arg(long, default_value_t = 8)]
    show: usize,
}

fn dtype_bytes(d: &str) -> usize {
    match d {
        "f64" | "i64" | "u64" => 8,
        "f32" | "i32" | "u32" => 4,
        "f16" | "bf16" | "i16" | "u16" => 2,
        _ => 1,
    }
}

pub fn run(args: InspectArgs) -> Result<()> {
    let ckpt = Checkpoint::open(&args.model)?;
    let arch = ckpt.architecture()?;
    let layers = ckpt.moe_layers()?;
    let total = ckpt.config.usize("num_hidden_layers")?;
    let first = *layers.first().ok_or_else(|| {
        MoeError::Format(format!("config.json: no decoder layer has a MoE block (num_hidden_layers {total})"))
    })?;
    let config = ckpt.moe_config(first)?;
    let list: Vec<String> = layers.iter().map(|l| l.to_string()).collect();
    println!("model         {}", args.model.display());
    println!("architecture  {}", arch.name());
    println!("layers        {total}, MoE: {} ({} dense)", list.join(", "), total - layers.len());
    println!("experts       {} routed, top-{}", config.num_experts, config.top_k);
    println!("router        {}", config.router.describe());
    println!("activation    {}", config.activation.name());
    println!("shapes        hidden {}, expert intermediate {}", config.hidden, config.inter);
    match config.shared {
        Some(s) => println!("shared        {} wide{}", s.inter, if s.gated { ", sigmoid-gated" } else { "" }),
        None => println!("shared        none"),
    }
    let names = ckpt.moe_tensor_names(first)?;
    let mut bytes = 0;
    println!("layer {first} MoE block: {} tensors", names.len());
    for (i, name) in names.iter().enumerate() {
        let (shape, dtype) = ckpt.info(name)?;
        bytes += shape.iter().product::<usize>() * dtype_bytes(&dtype);
        if i < args.show {
            println!("  {name:<60} {shape:?} {dtype}");
        }
    }
    if names.len() > args.show {
        println!("  ... and {} more", names.len() - args.show);
    }
    println!(
        "bytes per MoE layer  {:.3} MiB ({} MoE layers: {:.3} GiB)",
        bytes as f64 / (1 << 20) as f64,
        layers.len(),
        (bytes * layers.len()) as f64 / (1u64 << 30) as f64
    );
    Ok(())
}
