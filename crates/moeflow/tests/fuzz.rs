//! Generated bad input to the library: malformed configurations, config.json values,
//! safetensors headers and data, shard indexes, placements and weights. Each property asserts
//! a clear error or a correct, finite result; a panic fails it. Case counts keep the whole file
//! within seconds; proptest keeps any minimal failing case in `fuzz.proptest-regressions`, and
//! the cases it found are kept below as named tests.

use moeflow::model::{io, Checkpoint};
use moeflow::placement::ExpertPlacement;
use moeflow::{preset, Activation, DType, LayerOptions, MoeConfig, MoeError, MoeLayer, RouterConfig, Tensor};
use proptest::prelude::*;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(name)
}

/// A scratch folder holding a copy of fixture `name` (one per property).
fn copy_fixture(name: &str, case: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("moeflow-fuzz-{}-{case}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    dir
}

/// Sizes a careless or hostile user gives: zero, small, and values near overflow.
fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        4 => 1usize..9,
        1 => Just(0usize),
        1 => Just(usize::MAX),
        1 => Just(1usize << 40),
        1 => 1usize..100_000_000,
    ]
}

/// A float that may be NaN, infinite or huge.
fn float() -> impl Strategy<Value = f32> {
    prop_oneof![4 => -4.0f32..4.0, 1 => Just(f32::NAN), 1 => Just(f32::INFINITY), 1 => Just(1e38f32)]
}

fn router() -> impl Strategy<Value = RouterConfig> {
    prop_oneof![
        any::<bool>().prop_map(|renormalize| RouterConfig::Softmax { renormalize }),
        Just(RouterConfig::TopKSoftmax),
        (size(), size(), any::<bool>(), float()).prop_map(|(n_group, topk_group, renormalize, scaling)| {
            RouterConfig::SigmoidGrouped { n_group, topk_group, renormalize, scaling }
        }),
        (size(), size(), any::<bool>(), float()).prop_map(|(n_group, topk_group, renormalize, scaling)| {
            RouterConfig::SoftmaxGrouped { n_group, topk_group, renormalize, scaling }
        }),
    ]
}

fn activation() -> impl Strategy<Value = Activation> {
    prop_oneof![
        Just(Activation::Silu),
        Just(Activation::GeluTanh),
        (float(), float()).prop_map(|(alpha, limit)| Activation::SwigluOai { alpha, limit })
    ]
}

/// A JSON value of any kind, numbers near the edges included.
fn json_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::json;
    prop_oneof![
        Just(json!(null)),
        Just(json!(0)),
        Just(json!(-1)),
        Just(json!(1.5)),
        Just(json!(u64::MAX)),
        Just(json!(1u64 << 40)),
        Just(json!(100_000_000)),
        Just(json!("")),
        Just(json!("mixtral")),
        Just(json!("../x")),
        Just(json!([0, 1])),
        Just(json!({})),
        Just(json!(true)),
        (0u64..70).prop_map(|v| json!(v)),
    ]
}

/// The config.json keys the families read.
const KEYS: [&str; 22] = [
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
    "first_k_dense_replace",
    "moe_layer_freq",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "scoring_func",
    "topk_method",
    "swiglu_limit",
    "quantization_config",
];

const FAMILIES: [&str; 5] = ["mixtral", "qwen2_moe", "deepseek_v3_fp8", "gpt_oss_mxfp4", "olmoe"];

/// Everything a user does with a checkpoint: open, list, configure, load both ways, run.
/// Returns the first error; a loaded block must be finite and run to a finite output.
fn use_checkpoint(dir: &Path) -> moeflow::Result<()> {
    let ckpt = Checkpoint::open(dir)?;
    let layers = ckpt.moe_layers()?;
    let layer = *layers.last().ok_or_else(|| MoeError::Format("no MoE layer".into()))?;
    ckpt.moe_tensor_names(layer)?;
    let _ = ckpt.load_moe_block_quantized(Some(layer));
    let block = ckpt.load_moe_block(Some(layer), DType::F32)?;
    let layer = MoeLayer::new(&block.config, &block.weights, LayerOptions::default())?;
    let x = preset::uniform(3 * block.config.hidden, 1.0, 5);
    let out = layer.forward(&Tensor::from_f32(&[3, block.config.hidden], x)?)?;
    assert!(out.to_f32_vec().iter().all(|v| v.is_finite()), "forward returned a non-finite output");
    Ok(())
}

/// A valid safetensors file of `tensors` (name, dtype, shape, little-endian bytes).
fn safetensors_bytes(tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut data: Vec<u8> = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [data.len(), data.len() + bytes.len()]}),
        );
        data.extend(bytes);
    }
    let mut h = serde_json::to_vec(&header).unwrap();
    h.resize(h.len().div_ceil(8) * 8, b' ');
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4096, failure_persistence: None, ..ProptestConfig::default() })]

    /// Any configuration validates or is refused; one that validates and is small builds a
    /// layer whose forward is finite, and batch sizes are checked without overflow.
    #[test]
    fn configurations_validate_or_are_refused(
        hidden in size(), inter in size(), experts in size(), top_k in size(),
        router in router(), activation in activation(), shared in proptest::option::of(size()),
        tokens in size(),
    ) {
        let mut config = preset::config(hidden, inter, experts, top_k, router, activation, None);
        config.shared = shared.map(|inter| moeflow::SharedConfig { inter, gated: false });
        let _ = config.check_batch(tokens);
        let _ = config.weight_bytes(DType::BF16);
        if config.validate().is_err() || config.router.build(experts, top_k, None).is_err() {
            return Ok(());
        }
        prop_assert!(config.hidden > 0 && config.top_k <= config.num_experts);
        if config.weight_bytes(DType::F32) > 1 << 20 {
            return Ok(());
        }
        let weights = preset::random_weights(&config, DType::F32, 3);
        let layer = MoeLayer::new(&config, &weights, LayerOptions::default()).unwrap();
        let t = tokens.min(5);
        let out = layer.forward(&Tensor::from_f32(&[t, hidden], preset::uniform(t * hidden, 1.0, 1)).unwrap());
        match out {
            Ok(out) => prop_assert!(out.to_f32_vec().iter().all(|v| v.is_finite())),
            Err(e) => prop_assert!(matches!(e, MoeError::NonFiniteOutput { .. }), "{e}"),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    /// One config.json value replaced by anything: an error or a finite result, never a panic
    /// or a hang (the huge values included).
    #[test]
    fn config_json_values_end_in_an_error_or_a_result(
        family in 0..FAMILIES.len(),
        edits in proptest::collection::vec((0..KEYS.len(), json_value()), 1..3),
    ) {
        let dir = copy_fixture(FAMILIES[family], "config");
        let path = dir.join("config.json");
        let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for (key, value) in edits {
            json[KEYS[key]] = value;
        }
        std::fs::write(&path, json.to_string()).unwrap();
        let start = std::time::Instant::now();
        let _ = use_checkpoint(&dir);
        prop_assert!(start.elapsed().as_secs() < 10, "took {:?}", start.elapsed());
    }

    /// A safetensors file with flipped bytes, truncated, or with a header length past its end:
    /// an error naming the file, or a finite result.
    #[test]
    fn damaged_safetensors_end_in_an_error_or_a_result(
        family in 1..FAMILIES.len(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
        truncate in proptest::option::of(any::<prop::sample::Index>()),
        header_len in proptest::option::of(prop_oneof![Just(u64::MAX), Just(1u64 << 40), 0u64..4096]),
    ) {
        let dir = copy_fixture(FAMILIES[family], "safetensors");
        let path = dir.join("model.safetensors");
        let mut bytes = std::fs::read(&path).unwrap();
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        if let Some(at) = truncate {
            bytes.truncate(at.index(bytes.len()));
        }
        if let (Some(n), true) = (header_len, bytes.len() >= 8) {
            bytes[..8].copy_from_slice(&n.to_le_bytes());
        }
        std::fs::write(&path, &bytes).unwrap();
        let _ = use_checkpoint(&dir);
        std::fs::write(dir.join("input.safetensors"), &bytes).unwrap();
        if let Ok(t) = io::read_hidden_states(&dir.join("input.safetensors"), "hidden_states") {
            prop_assert_eq!(t.shape().len(), 2);
        }
    }

    /// Generated headers: any dtype, shape and offsets for a hidden-states file.
    #[test]
    fn generated_headers_end_in_an_error_or_a_tensor(
        dtype in prop::sample::select(vec!["F32", "BF16", "F16", "F8_E4M3", "U8", "I64", "BOOL", "X"]),
        shape in proptest::collection::vec(prop_oneof![0usize..5, Just(usize::MAX), Just(1usize << 33)], 0..4),
        len in 0usize..200,
        value in float(),
    ) {
        let data: Vec<u8> = std::iter::repeat_n(value.to_le_bytes(), len.div_ceil(4)).flatten().take(len).collect();
        let path = std::env::temp_dir().join(format!("moeflow-fuzz-{}-header.safetensors", std::process::id()));
        std::fs::write(&path, safetensors_bytes(&[("hidden_states", dtype, shape.clone(), data)])).unwrap();
        if let Ok(t) = io::read_hidden_states(&path, "hidden_states") {
            prop_assert_eq!(t.shape(), &shape[..]);
        }
    }

    /// Shard index entries of any form: names outside the folder are refused before anything
    /// is opened.
    #[test]
    fn shard_indexes_never_leave_the_model_folder(
        file in prop_oneof![
            Just("../model-00001-of-00006.safetensors".to_string()),
            Just("/etc/passwd".to_string()),
            Just(String::new()),
            Just("./model-00001-of-00006.safetensors".to_string()),
            "[a-z./]{0,12}",
        ],
        entry in 0usize..65,
    ) {
        let dir = copy_fixture("mixtral", "index");
        let path = dir.join("model.safetensors.index.json");
        let mut index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let map = index["weight_map"].as_object_mut().unwrap();
        let key = map.keys().nth(entry % map.len()).unwrap().clone();
        map.insert(key, file.clone().into());
        std::fs::write(&path, index.to_string()).unwrap();
        let escapes = file.is_empty() || Path::new(&file).components().any(|c| !matches!(c, std::path::Component::Normal(_)));
        match Checkpoint::open(&dir) {
            Ok(_) => prop_assert!(!escapes, "{file} was opened"),
            Err(e) if escapes => prop_assert!(e.to_string().contains("inside the model folder"), "{e}"),
            Err(_) => {}
        }
    }

    /// Placement files of any content: a placement of every expert, or an error.
    #[test]
    fn placement_files_place_every_expert_or_are_refused(
        experts in 1usize..12,
        ranks in 1usize..5,
        file_experts in prop_oneof![Just(None), (0usize..14).prop_map(Some)],
        slots in proptest::collection::vec(proptest::collection::vec(prop_oneof![0usize..14, Just(usize::MAX)], 0..6), 0..6),
    ) {
        let path = std::env::temp_dir().join(format!("moeflow-fuzz-{}-placement.json", std::process::id()));
        let json = serde_json::json!({"num_experts": file_experts.unwrap_or(experts), "ranks": slots});
        std::fs::write(&path, json.to_string()).unwrap();
        if let Ok(p) = ExpertPlacement::from_json_file(&path, experts, ranks) {
            for e in 0..experts {
                prop_assert!((0..ranks).any(|r| p.local_experts(r).contains(&e)), "expert {e} has no rank");
            }
        }
    }

    /// A NaN or infinity anywhere in the weights: the layer refuses to build, naming the tensor.
    #[test]
    fn non_finite_weights_are_refused_by_name(
        tensor in 0usize..6,
        at in any::<prop::sample::Index>(),
        value in prop_oneof![Just(f32::NAN), Just(f32::INFINITY), Just(f32::NEG_INFINITY)],
        dtype in prop::sample::select(vec![DType::F32, DType::BF16]),
    ) {
        let config = preset::config(8, 4, 4, 2, RouterConfig::TopKSoftmax, Activation::GPT_OSS, None);
        let mut w = preset::random_weights(&config, dtype, 1);
        let (target, name) = match tensor {
            0 => (&mut w.gate, "router gate"),
            1 => (w.gate_bias.as_mut().unwrap(), "router bias"),
            2 => (&mut w.experts.w13, "w13 of expert"),
            3 => (&mut w.experts.w2, "w2 of expert"),
            4 => (w.experts.b13.as_mut().unwrap(), "b13 of expert"),
            _ => (w.experts.b2.as_mut().unwrap(), "b2 of expert"),
        };
        let mut v = target.to_f32_vec();
        let i = at.index(v.len());
        v[i] = value;
        *target = Tensor::from_f32_as(target.shape(), &v, target.dtype()).unwrap();
        let e = MoeLayer::new(&config, &w, LayerOptions::default()).err().expect("refused");
        prop_assert!(matches!(e, MoeError::NonFinite { .. }) && e.to_string().contains(name), "{e}");
    }
}

/// Cases the properties found, kept by name: each was a panic before it was fixed.
#[test]
fn regressions_found_by_the_properties() {
    // n_shared_experts × moe_intermediate_size overflowed a multiplication.
    let dir = copy_fixture("deepseek_v3_fp8", "regression-shared");
    let path = dir.join("config.json");
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json["n_shared_experts"] = serde_json::json!(u64::MAX);
    std::fs::write(&path, json.to_string()).unwrap();
    let e = use_checkpoint(&dir).unwrap_err().to_string();
    assert!(e.contains("n_shared_experts") && e.contains("overflows"), "{e}");
    // top-k and intermediate size near usize::MAX overflowed the batch-size estimate.
    let config = preset::config(1, usize::MAX, 1, usize::MAX, RouterConfig::TopKSoftmax, Activation::Silu, None);
    assert!(config.check_batch(1).is_err());
    assert!(config.validate().is_err());
    // 2^40 experts of width 1 validate, but the router's per-expert state aborted the process.
    let router = RouterConfig::SigmoidGrouped { n_group: 1, topk_group: 1, renormalize: true, scaling: 1.0 };
    let e = router.build(1 << 40, 1, None).err().expect("refused").to_string();
    assert!(e.contains("router state for 1099511627776 experts"), "{e}");
}

/// Quantized weights whose scale times the format's largest code overflows, and MXFP4 codes
/// that are not 4-bit, are refused when the layer is built.
#[test]
fn quantized_scales_and_codes_are_checked() {
    use moeflow::quant::WeightQuant;
    let config = preset::config(64, 64, 2, 1, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let w = preset::random_weights(&config, DType::F32, 2);
    for format in [WeightQuant::Fp8Block(32), WeightQuant::Int8Channel, WeightQuant::Mxfp4] {
        let mut q = w.clone();
        q.experts = w.experts.quantized(format).unwrap();
        MoeLayer::new(&config, &q, LayerOptions::default()).unwrap();
        let scales = &mut q.experts.quant.as_mut().unwrap().w2;
        let mut s = scales.to_f32_vec();
        s[1] = f32::MAX / 2.0;
        *scales = Tensor::from_f32(scales.shape(), s).unwrap();
        let e = MoeLayer::new(&config, &q, LayerOptions::default()).err().expect("refused").to_string();
        assert!(e.contains("w2 scales of expert 0") && e.contains("largest"), "{format:?}: {e}");
    }
    let mut q = w.clone();
    q.experts = w.experts.quantized(WeightQuant::Mxfp4).unwrap();
    let mut codes = vec![0i8; q.experts.w13.elem_count()];
    codes[5] = 16;
    q.experts.w13 = Tensor::new(q.experts.w13.shape(), moeflow::tensor::CpuStorage::I8(codes)).unwrap();
    let e = MoeLayer::new(&config, &q, LayerOptions::default()).err().expect("refused").to_string();
    assert!(e.contains("not a 4-bit code"), "{e}");
}

/// The layer refuses a non-finite output unless told to return it.
#[test]
fn overflowing_outputs_are_refused_unless_allowed() {
    let config = preset::config(16, 8, 4, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
    let w = preset::random_weights(&config, DType::F32, 4);
    let x = Tensor::from_f32(&[3, 16], vec![1e25; 48]).unwrap();
    let e = MoeLayer::new(&config, &w, LayerOptions::default()).unwrap().forward(&x).unwrap_err();
    match e {
        MoeError::NonFiniteOutput { count, token, column, .. } => assert!(count > 0 && token == 0 && column < 16),
        e => panic!("{e}"),
    }
    let allowed = LayerOptions { allow_nonfinite: true, ..LayerOptions::default() };
    let out = MoeLayer::new(&config, &w, allowed).unwrap().forward(&x).unwrap();
    assert!(out.to_f32_vec().iter().any(|v| !v.is_finite()));
}

/// Batches and configurations whose sizes overflow are refused with the bytes they need.
#[test]
fn sizes_are_checked_without_overflow() {
    let mut config: MoeConfig = preset::preset("deepseek-v3").unwrap().config;
    let e = config.check_batch(usize::MAX).unwrap_err().to_string();
    assert!(e.contains("a forward of") && e.contains("needs"), "{e}");
    config.num_experts = usize::MAX / 2;
    config.router = RouterConfig::Softmax { renormalize: true };
    assert!(config.validate().unwrap_err().to_string().contains("more weights than this machine can address"));
    let x = Tensor::from_f32(&[0, 8], Vec::new()).unwrap();
    assert!(Tensor::new(&[usize::MAX, 2], moeflow::tensor::CpuStorage::F32(Vec::new())).is_err());
    assert_eq!(x.shape(), &[0, 8]);
}
