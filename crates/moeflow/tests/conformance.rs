//! Conformance with Hugging Face `transformers`: the fixtures (made by tools/make_fixtures.py)
//! hold tiny random models of every supported family and the f32 output of one MoE block as
//! transformers computes it; moeflow must load the checkpoint and reproduce it.

use moeflow::model::{io, Architecture, Checkpoint};
use moeflow::{DType, LayerOptions, MoeLayer, Tensor};
use std::path::{Path, PathBuf};

/// f32 evaluation of the same math in a different order (PyTorch vs moeflow): rounding of
/// sums over at most a few hundred terms, far below 1e-5 of the output's scale.
const TOL: f64 = 1e-5;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

fn layer_of(dir: &Path) -> usize {
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
    meta["layer"].as_u64().unwrap() as usize
}

fn rel_err(got: &Tensor, want: &Tensor) -> f64 {
    let (g, w) = (got.to_f32_vec(), want.to_f32_vec());
    assert_eq!(g.len(), w.len());
    let scale = w.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
    g.iter().zip(&w).map(|(a, b)| (*a as f64 - *b as f64).abs()).fold(0.0, f64::max) / scale
}

const NAMES: [&str; 10] = [
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v3_fp8",
    "deepseek_v3_fp8_128",
    "gpt_oss",
    "gpt_oss_mxfp4",
];

#[test]
fn every_fixture_matches_transformers() {
    for name in NAMES {
        let dir = fixtures().join(name);
        let ckpt = Checkpoint::open(&dir).unwrap();
        let block = ckpt.load_moe_block(Some(layer_of(&dir)), DType::F32).unwrap();
        let layer = MoeLayer::new(&block.config, &block.weights, LayerOptions::default()).unwrap();
        let x = io::read_hidden_states(&dir.join("input.safetensors"), "hidden_states").unwrap();
        let want = io::read_hidden_states(&dir.join("expected.safetensors"), "hidden_states").unwrap();
        let err = rel_err(&layer.forward(&x).unwrap(), &want);
        assert!(err <= TOL, "{name}: relative error {err:e}");
        // The f64 reference agrees too.
        let r = moeflow::reference::forward(&block.config, &block.weights, &x.to_f32_vec()).unwrap().out;
        let r = Tensor::from_f32(want.shape(), r.iter().map(|&v| v as f32).collect()).unwrap();
        assert!(rel_err(&r, &want) <= TOL, "{name}: reference");
    }
}

#[test]
fn architectures_and_moe_layers_are_recognised() {
    let expect = [
        ("mixtral", Architecture::Mixtral, vec![0, 1]),
        ("qwen2_moe", Architecture::Qwen2Moe, vec![1]),
        ("deepseek_v2", Architecture::DeepseekV2, vec![1, 2]),
        ("deepseek_v3", Architecture::DeepseekV3, vec![1, 2]),
    ];
    for (name, arch, layers) in expect {
        let ckpt = Checkpoint::open(&fixtures().join(name)).unwrap();
        assert_eq!(ckpt.architecture().unwrap(), arch);
        assert_eq!(ckpt.moe_layers().unwrap(), layers, "{name}");
    }
    // Without a layer, the first MoE layer.
    let ckpt = Checkpoint::open(&fixtures().join("deepseek_v3")).unwrap();
    assert_eq!(ckpt.load_moe_block(None, DType::BF16).unwrap().layer, 1);
}

/// A scratch copy of fixture `name` that a test may damage.
fn scratch(name: &str, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("moeflow-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(fixtures().join(name)).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
    }
    dir
}

fn err_of<T>(r: moeflow::Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_checkpoints_are_clear_errors() {
    // A layer that is not MoE names the MoE layers.
    let ckpt = Checkpoint::open(&fixtures().join("deepseek_v3")).unwrap();
    let e = err_of(ckpt.load_moe_block(Some(0), DType::F32));
    assert!(e.contains("layer 0 is not a MoE layer") && e.contains("1, 2"), "{e}");

    // Unknown architecture lists the supported ones.
    let dir = scratch("olmoe", "arch");
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap().replace("\"olmoe\"", "\"llama\"");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    let e = err_of(Checkpoint::open(&dir).unwrap().load_moe_block(None, DType::F32));
    assert!(e.contains("llama") && e.contains("deepseek_v3") && e.contains("gpt_oss"), "{e}");

    // Config and tensors disagree on a shape.
    let dir = scratch("olmoe", "shape");
    let cfg = std::fs::read_to_string(dir.join("config.json"))
        .unwrap()
        .replace("\"intermediate_size\": 16", "\"intermediate_size\": 12");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    let e = err_of(Checkpoint::open(&dir).unwrap().load_moe_block(Some(1), DType::F32));
    assert!(e.contains("gate_proj.weight") && e.contains("[12, 32]") && e.contains("[16, 32]"), "{e}");

    // Missing tensors: more experts in the config than in the file.
    let dir = scratch("olmoe", "missing");
    let cfg =
        std::fs::read_to_string(dir.join("config.json")).unwrap().replace("\"num_experts\": 8", "\"num_experts\": 10");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    let e = err_of(Checkpoint::open(&dir).unwrap().load_moe_block(Some(1), DType::F32));
    assert!(e.contains("missing 6 of") && e.contains("experts.8.gate_proj.weight"), "{e}");

    // Truncated or corrupt safetensors.
    let dir = scratch("olmoe", "corrupt");
    let file = dir.join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let e = err_of(Checkpoint::open(&dir));
    assert!(e.contains("not a valid safetensors file"), "{e}");
    std::fs::write(&file, b"\xff\xff\xff\xff\xff\xff\xff\x7fgarbage").unwrap();
    assert!(err_of(Checkpoint::open(&dir)).contains("not a valid safetensors file"));
    std::fs::remove_file(&file).unwrap();
    assert!(err_of(Checkpoint::open(&dir)).contains("model.safetensors"));
}

#[test]
fn inputs_of_the_wrong_dtype_or_rank_are_clear_errors() {
    // A hand-written safetensors file: 8-byte header length, JSON header, data.
    let write = |name: &str, dtype: &str, shape: &[usize], bytes: usize| {
        let header =
            format!(r#"{{"hidden_states":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[0,{bytes}]}}}}"#);
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend(header.as_bytes());
        file.extend(vec![0u8; bytes]);
        let path = std::env::temp_dir().join(format!("moeflow-{name}-{}.safetensors", std::process::id()));
        std::fs::write(&path, file).unwrap();
        path
    };
    let p = write("i32", "I32", &[2, 3], 24);
    let e = err_of(io::read_hidden_states(&p, "hidden_states"));
    assert!(e.contains("hidden_states") && e.contains("I32") && e.contains("f32, bf16 or f16"), "{e}");
    let p = write("rank3", "F32", &[1, 2, 3], 24);
    let e = err_of(io::read_hidden_states(&p, "hidden_states"));
    assert!(e.contains("[T, H]") && e.contains("[1, 2, 3]"), "{e}");
    let e = err_of(io::read_hidden_states(&p, "x"));
    assert!(e.contains("no tensor 'x'") && e.contains("hidden_states"), "{e}");
}
