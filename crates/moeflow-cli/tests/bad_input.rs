//! Bad input to the command line, as a careless or hostile user gives it: every case ends in a
//! clear error (exit status 1, a message naming what is wrong, no panic) or a correct result,
//! within seconds. The broken checkpoints are fixture copies patched here, so each case is a
//! small, readable regression fixture.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn moeflow(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moeflow")).args(args).output().expect("the binary runs")
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(name)
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// A fresh scratch folder for `case`, removed when the returned guard drops.
fn scratch(case: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("moeflow-bad-{case}-")).tempdir().unwrap()
}

/// A copy of fixture `name` in a scratch folder (removed when the guard drops).
fn copy_fixture(name: &str, case: &str) -> tempfile::TempDir {
    let dir = scratch(case);
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    dir
}

/// Edits `config.json` of `dir` with `edit`.
fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let path = dir.join("config.json");
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(json.as_object_mut().unwrap());
    std::fs::write(&path, serde_json::to_string(&json).unwrap()).unwrap();
}

/// Overwrites bytes of tensor `name` (whichever safetensors file of `dir` holds it), starting
/// `at` bytes into its data.
fn patch_tensor(dir: &Path, name: &str, at: usize, bytes: &[u8]) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "safetensors") {
            continue;
        }
        let mut data = std::fs::read(&path).unwrap();
        let n = u64::from_le_bytes(data[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&data[8..8 + n]).unwrap();
        if let Some(start) = header.get(name).and_then(|t| t["data_offsets"][0].as_u64()) {
            let start = 8 + n + start as usize + at;
            data[start..start + bytes.len()].copy_from_slice(bytes);
            std::fs::write(&path, data).unwrap();
            return;
        }
    }
    panic!("no tensor {name} in {}", dir.display());
}

/// Asserts a clear failure: status 1, no panic, and every piece of `wanted` in the message.
fn assert_error(o: &Output, wanted: &[&str]) {
    let t = text(o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(!t.contains("panicked") && !t.contains("RUST_BACKTRACE"), "{t}");
    for w in wanted {
        assert!(t.contains(w), "expected '{w}' in: {t}");
    }
}

fn run_on(model: &Path, input: &Path, output: &Path, extra: &[&str]) -> Output {
    let (m, i, o) = (model.display().to_string(), input.display().to_string(), output.display().to_string());
    let mut args = vec!["run", "--model", &m, "--input", &i, "--output", &o];
    args.extend(extra);
    moeflow(&args)
}

#[test]
fn huge_expert_counts_are_refused_at_once() {
    for experts in [100_000_000u64, 1 << 40] {
        let dir_guard = copy_fixture("mixtral", &format!("experts-{experts}"));
        let dir = dir_guard.path();
        edit_config(dir, |c| {
            c.insert("num_local_experts".into(), experts.into());
        });
        let start = Instant::now();
        let m = dir.display().to_string();
        assert_error(&moeflow(&["inspect", "--model", &m]), &[&experts.to_string(), "holds only"]);
        let out = dir.join("out.safetensors");
        assert_error(&run_on(dir, &dir.join("input.safetensors"), &out, &[]), &["holds only"]);
        assert!(!out.exists());
        assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
    }
    // GPT-OSS stores all experts in one tensor: the count meets the tensor's shape instead.
    let dir_guard = copy_fixture("gpt_oss", "gpt-oss-experts");
    let dir = dir_guard.path();
    edit_config(dir, |c| {
        c.insert("num_local_experts".into(), (1u64 << 40).into());
    });
    let out = dir.join("out.safetensors");
    assert_error(&run_on(dir, &dir.join("input.safetensors"), &out, &[]), &["needs"]);
    let dir_guard = copy_fixture("mixtral", "layers");
    let dir = dir_guard.path();
    edit_config(dir, |c| {
        c.insert("num_hidden_layers".into(), (1u64 << 40).into());
    });
    assert_error(&moeflow(&["inspect", "--model", &dir.display().to_string()]), &["num_hidden_layers"]);
}

#[test]
fn shard_paths_stay_inside_the_model_folder() {
    for bad in ["../../../../etc/passwd", "/etc/passwd", "sub/../../x.safetensors", ""] {
        let dir_guard = copy_fixture("mixtral", "shard-path");
        let dir = dir_guard.path();
        let path = dir.join("model.safetensors.index.json");
        let mut index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let map = index["weight_map"].as_object_mut().unwrap();
        let first = map.keys().next().unwrap().clone();
        map.insert(first, bad.into());
        std::fs::write(&path, index.to_string()).unwrap();
        assert_error(
            &moeflow(&["inspect", "--model", &dir.display().to_string()]),
            &["is not a file name inside the model folder"],
        );
    }
}

#[test]
fn non_finite_weights_are_refused_at_load_with_their_name() {
    let nan = f32::NAN.to_le_bytes();
    let inf = f32::INFINITY.to_le_bytes();
    let cases: [(&str, &str, usize, &[u8], &str); 6] = [
        // An expert weight: NaN, infinity.
        ("mixtral", "model.layers.1.block_sparse_moe.experts.3.w2.weight", 20, &nan, "experts.3.w2.weight"),
        ("qwen2_moe", "model.layers.1.mlp.experts.2.up_proj.weight", 0, &inf, "experts.2.up_proj.weight"),
        // A NaN fp8 block scale, and fp8 bytes that encode NaN (e4m3 0x7f).
        ("deepseek_v3_fp8", "model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv", 4, &nan, "weight_scale_inv"),
        ("deepseek_v3_fp8", "model.layers.1.mlp.experts.5.down_proj.weight", 3, &[0x7f], "experts.5.down_proj"),
        // MXFP4 scale bytes 255 (NaN in e8m0) and 254 (2^127: every code but ±0.5 overflows).
        ("gpt_oss_mxfp4", "model.layers.1.mlp.experts.down_proj_scales", 7, &[255], "down_proj_blocks times"),
        ("gpt_oss_mxfp4", "model.layers.1.mlp.experts.gate_up_proj_scales", 0, &[254], "gate_up_proj_blocks times"),
    ];
    for (i, (name, tensor, at, bytes, wanted)) in cases.into_iter().enumerate() {
        let dir_guard = copy_fixture(name, &format!("nonfinite-{i}"));
        let dir = dir_guard.path();
        patch_tensor(dir, tensor, at, bytes);
        let out = dir.join("out.safetensors");
        let layer = "1";
        let res = run_on(dir, &dir.join("input.safetensors"), &out, &["--layer", layer]);
        assert_error(&res, &["non-finite", wanted]);
        assert!(!out.exists());
        // Kept quantized (--quant), the scales are checked against the format's largest code.
        if name == "gpt_oss_mxfp4" || name == "deepseek_v3_fp8" {
            let res = run_on(dir, &dir.join("input.safetensors"), &out, &["--layer", layer, "--quant", "fp8"]);
            assert_error(&res, &["non-finite"]);
            assert!(!out.exists());
        }
    }
}

#[test]
fn outputs_that_overflow_are_refused_unless_allowed() {
    let dir_guard = scratch("overflow");
    let dir = dir_guard.path();
    // The fixture's input times 1e19: finite, but the experts overflow f32.
    let mut data = std::fs::read(fixture("mixtral").join("input.safetensors")).unwrap();
    let n = 8 + u64::from_le_bytes(data[..8].try_into().unwrap()) as usize;
    for c in data[n..].chunks_exact_mut(4) {
        let v = f32::from_le_bytes(c.try_into().unwrap()) * 1e19;
        c.copy_from_slice(&v.to_le_bytes());
    }
    let input = dir.join("input.safetensors");
    std::fs::write(&input, data).unwrap();
    let out = dir.join("out.safetensors");
    std::fs::write(&out, b"kept").unwrap();
    for extra in [&[][..], &["--ep", "2", "--strategy", "all2allv"]] {
        let res = run_on(&fixture("mixtral"), &input, &out, extra);
        assert_error(&res, &["non-finite values", "token 0", "--allow-nonfinite"]);
        assert_eq!(std::fs::read(&out).unwrap(), b"kept", "a failed run left the output as it was");
    }
    let res = run_on(&fixture("mixtral"), &input, &out, &["--allow-nonfinite"]);
    assert!(res.status.success(), "{}", text(&res));
    let got = moeflow::model::io::read_hidden_states(&out, "hidden_states").unwrap().to_f32_vec();
    assert!(got.iter().any(|v| !v.is_finite()));
}

#[test]
fn sizes_from_flags_are_checked_before_allocating() {
    let start = Instant::now();
    for tokens in ["10000000", "1000000000"] {
        let res = moeflow(&["demo", "--experts", "8", "--tokens", tokens]);
        assert_error(&res, &["a forward of", tokens, "needs"]);
        let res = moeflow(&["bench", "--experts", "8", "--tokens", tokens]);
        assert_error(&res, &["a forward of", "needs"]);
    }
    let dir_guard = scratch("lowlatency");
    let dir = dir_guard.path();
    let out = dir.join("out.safetensors");
    let input = fixture("mixtral").join("input.safetensors");
    for (m, wanted) in [("18446744073709551615", "overflows"), ("1000000000", "low-latency buffers")] {
        let extra = ["--ep", "2", "--strategy", "lowlatency", "--max-tokens-per-rank", m];
        assert_error(&run_on(&fixture("mixtral"), &input, &out, &extra), &[wanted, m]);
    }
    // Rank counts: beyond any EP group, beyond the threads or processes of one machine.
    let res = moeflow(&["demo", "--experts", "8", "--tokens", "4", "--ep", "18446744073709551615"]);
    assert_error(&res, &["EP 18446744073709551615 is more than 65536 ranks"]);
    let res = run_on(&fixture("mixtral"), &input, &out, &["--ep", "300"]);
    assert_error(&res, &["300 in-process ranks: at most 256"]);
    for ep in ["0", "300", "18446744073709551615"] {
        assert_error(&moeflow(&["check", "--ep", ep]), &["--ep", "EP sizes must be in 1..=8"]);
    }
    let res = moeflow(&["check", "--hidden", "1000000", "--inter", "1000000", "--ep", "1"]);
    assert_error(&res, &["random bf16 weights of 16 experts", "needs"]);
    let res = moeflow(&["launch", "--gpus", "100000", "--", "demo"]);
    assert_error(&res, &["--gpus 100000: at most 256 processes"]);
    assert!(start.elapsed() < Duration::from_secs(30), "took {:?}", start.elapsed());
}

#[test]
fn clear_wording_for_common_mistakes() {
    let dir_guard = scratch("wording");
    let dir = dir_guard.path();
    let out = dir.join("out.safetensors");
    let mixtral = fixture("mixtral");
    // An input that is a directory.
    assert_error(&run_on(&mixtral, dir, &out, &[]), &["not a regular file"]);
    // A model folder that is a file.
    let input = mixtral.join("input.safetensors");
    assert_error(&run_on(&input, &input, &out, &[]), &["not a directory"]);
    // No model_type.
    let m_guard = copy_fixture("mixtral", "no-model-type");
    let m = m_guard.path();
    edit_config(m, |c| {
        c.remove("model_type");
    });
    assert_error(&moeflow(&["inspect", "--model", &m.display().to_string()]), &["no 'model_type'"]);
    // No layers.
    let m_guard = copy_fixture("mixtral", "no-layers");
    let m = m_guard.path();
    edit_config(m, |c| {
        c.insert("num_hidden_layers".into(), 0.into());
    });
    assert_error(&moeflow(&["inspect", "--model", &m.display().to_string()]), &["no decoder layer has a MoE block"]);
    assert_error(&run_on(m, &input, &out, &[]), &["no decoder layer has a MoE block"]);
    // A safetensors file that is not one: a format error, not a configuration error.
    let bad = dir.join("bad.safetensors");
    std::fs::write(&bad, b"not a safetensors file").unwrap();
    let res = run_on(&mixtral, &bad, &out, &[]);
    assert_error(&res, &["not a valid safetensors file"]);
    assert!(!text(&res).contains("invalid configuration"), "{}", text(&res));
}

#[test]
fn strategy_auto_is_refused_where_it_cannot_choose() {
    let dir_guard = scratch("auto");
    let dir = dir_guard.path();
    let demo = ["demo", "--preset", "olmoe-1b-7b", "--experts", "8", "--tokens", "4", "--ep", "2"];
    let with = |extra: &[&str]| moeflow(&[&demo[..], extra].concat());
    assert_error(&with(&["--strategy", "auto"]), &["'auto' picks among the device strategies of GPU ranks"]);
    let table = dir.join("table.json");
    std::fs::write(&table, r#"{"rows": [{"up_to_tokens": 8, "strategy": "allgather"}]}"#).unwrap();
    let t = table.display().to_string();
    assert_error(&with(&["--strategy", "auto", "--strategy-table", &t]), &["the last row must cover every batch"]);
    std::fs::write(&table, r#"{"rows": [{"up_to_tokens": null, "strategy": "lowlatency"}]}"#).unwrap();
    assert_error(&with(&["--strategy", "auto", "--strategy-table", &t]), &["not lowlatency"]);
    let missing = dir.join("missing.json").display().to_string();
    assert_error(&with(&["--strategy", "auto", "--strategy-table", &missing]), &["reading --strategy-table"]);
    let bench = ["bench", "--preset", "olmoe-1b-7b", "--experts", "8", "--tokens", "4", "--ep", "2"];
    assert_error(&moeflow(&[&bench[..], &["--calibrate", &t]].concat()), &["--calibrate measures this CPU's ceilings"]);
}

#[test]
fn a_closed_pipe_ends_quietly_and_a_full_disk_is_an_error() {
    let model = fixture("mixtral").display().to_string();
    // The reader is gone before moeflow writes: the write fails with EPIPE.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    for args in [&["inspect", "--model", &model][..], &["demo", "--experts", "8", "--tokens", "4", "--runs", "1"]] {
        let res = Command::new(env!("CARGO_BIN_EXE_moeflow"))
            .args(args)
            .stdout(writer.try_clone().unwrap())
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert!(res.status.success(), "{args:?}: {}", text(&res));
        assert!(res.stderr.is_empty(), "{args:?}: {}", text(&res));
    }
    if let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") {
        let res = Command::new(env!("CARGO_BIN_EXE_moeflow"))
            .args(["inspect", "--model", &model])
            .stdout(full)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert_error(&res, &["writing to stdout", "No space left"]);
    } else {
        eprintln!("SKIPPED the full-disk case: no /dev/full on this system");
    }
}

/// Runs `moeflow args`, killing it (and failing) if it runs past `limit`: a hang is a bug.
fn moeflow_within(args: &[String], limit: Duration) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_moeflow"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs");
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            child.kill().unwrap();
            panic!("moeflow {} ran past {limit:?}", args.join(" "));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    child.wait_with_output().unwrap()
}

mod flags {
    use super::*;
    use proptest::prelude::*;

    fn one_of(values: &'static [&'static str]) -> impl Strategy<Value = &'static str> {
        prop::sample::select(values)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 500, failure_persistence: None, ..ProptestConfig::default() })]

        /// `run` under generated flag combinations, valid and not: a usage error (status 2), a
        /// clear error (status 1), or an output close to transformers' (status 0); never a
        /// panic or a hang.
        #[test]
        fn flag_combinations_end_in_an_error_or_a_correct_result(
            ep in one_of(&["1", "2", "3", "4", "0", "300", "18446744073709551615"]),
            tp in one_of(&["1", "2", "0"]),
            strategy in one_of(&["", "local", "allgather", "allgather-logits", "multicast", "all2allv", "lowlatency", "x"]),
            max_tokens in one_of(&["", "0", "1", "7", "1000000000", "18446744073709551615"]),
            chunk in one_of(&["", "0", "1", "3", "18446744073709551615"]),
            dtype in one_of(&["f32", "bf16", "f8e4m3", "x"]),
            quant in one_of(&["none", "int8", "fp8", "fp8-block", "mxfp8", "x"]),
            placement in one_of(&["contiguous", "round-robin", "/nonexistent.json"]),
            redundant in one_of(&["", "0", "7", "99", "0,0"]),
            timeout in one_of(&["60", "0", "-1", "NaN", "1e300"]),
            layer in one_of(&["1", "1", "1", "", "2", "18446744073709551615"]),
            dual_batch in any::<bool>(),
            defer in any::<bool>(),
        ) {
            let dir_guard = scratch("flags");
            let dir = dir_guard.path();
            let out = dir.join("out.safetensors");
            let model = fixture("mixtral");
            let mut args: Vec<String> = ["run", "--model", &model.display().to_string(), "--input",
                &model.join("input.safetensors").display().to_string(), "--output", &out.display().to_string()]
                .map(String::from).to_vec();
            for (flag, value) in [("--ep", ep), ("--tp", tp), ("--strategy", strategy), ("--max-tokens-per-rank", max_tokens),
                ("--chunk-size", chunk), ("--dtype", dtype), ("--quant", quant), ("--placement", placement),
                ("--redundant", redundant), ("--timeout", timeout), ("--layer", layer)] {
                if !value.is_empty() {
                    args.extend([flag.to_string(), value.to_string()]);
                }
            }
            if dual_batch {
                args.push("--dual-batch".into());
            }
            if defer {
                args.push("--defer-input-quant".into());
            }
            let res = moeflow_within(&args, Duration::from_secs(60));
            let t = text(&res);
            prop_assert!(!t.contains("panic") && !t.contains("RUST_BACKTRACE"), "{args:?}: {t}");
            match res.status.code() {
                Some(0) => {
                    let got = moeflow::model::io::read_hidden_states(&out, "hidden_states").unwrap().to_f32_vec();
                    let want = moeflow::model::io::read_hidden_states(&model.join("expected.safetensors"), "hidden_states")
                        .unwrap()
                        .to_f32_vec();
                    // The expected output is layer 1's (the default is the first MoE layer, 0).
                    let layer_one = layer == "1";
                    prop_assert!(got.iter().all(|v| v.is_finite()) && got.len() == want.len(), "{args:?}");
                    if layer_one {
                        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                        let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale;
                        prop_assert!(err < 0.25, "{args:?}: relative error {err}");
                    }
                }
                Some(1) | Some(2) => prop_assert!(t.contains("error"), "{args:?}: {t}"),
                code => prop_assert!(false, "{args:?}: status {code:?}: {t}"),
            }
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

#[test]
fn an_unknown_transport_is_refused_naming_the_known_ones() {
    // A usage error: clap's exit status 2, with the library's message.
    let o = moeflow(&["demo", "--transport", "shm"]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    assert!(t.contains("unknown transport 'shm' (known: nccl, nvlink, auto)") && !t.contains("panicked"), "{t}");
    // On CPU ranks the option is accepted and does not change the result.
    let ok = moeflow(&["demo", "--experts", "8", "--tokens", "16", "--transport", "nccl"]);
    assert!(ok.status.success(), "{}", text(&ok));
}
