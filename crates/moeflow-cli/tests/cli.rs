//! The command line end to end: `run` against the transformers fixtures, errors leave no
//! output, and `demo`, `check`, `bench`, `plot`, `inspect` do what the README says.

use moeflow::model::io::read_hidden_states;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn moeflow(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moeflow")).args(args).output().expect("the binary runs")
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(name)
}

fn tmp(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("moeflow-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn check_run(name: &str, layer: &str, extra: &[&str]) {
    check_run_within(name, layer, extra, 1e-5);
}

fn check_run_within(name: &str, layer: &str, extra: &[&str], tol: f32) {
    check_run_launched(&[], name, layer, extra, tol);
}

/// `moeflow [launcher..] run` on fixture `name` against its transformers output.
fn check_run_launched(launcher: &[&str], name: &str, layer: &str, extra: &[&str], tol: f32) {
    let dir = fixture(name);
    let out = tmp(&format!("{name}{}.safetensors", launcher.len()));
    let (m, i, o) =
        (dir.display().to_string(), dir.join("input.safetensors").display().to_string(), out.display().to_string());
    let mut args = launcher.to_vec();
    args.extend(["run", "--model", &m, "--layer", layer, "--input", &i, "--output", &o]);
    args.extend(extra);
    let res = moeflow(&args);
    assert!(res.status.success(), "{}", text(&res));
    let got = read_hidden_states(&out, "hidden_states").unwrap().to_f32_vec();
    let want = read_hidden_states(&dir.join("expected.safetensors"), "hidden_states").unwrap().to_f32_vec();
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale;
    assert!(err <= tol, "{name} {extra:?}: relative error {err:e}");
    std::fs::remove_file(out).ok();
}

#[test]
fn run_matches_transformers() {
    check_run("mixtral", "1", &[]);
    check_run("deepseek_v3_fp8", "2", &["--ep", "4", "--tp", "2", "--strategy", "allgather"]);
    check_run("gpt_oss_mxfp4", "1", &["--ep", "2", "--strategy", "all2allv", "--dual-batch"]);
    check_run("qwen2_moe", "1", &["--ep", "3", "--strategy", "lowlatency"]);
    // Quantized: the checkpoints' quantized weights are kept as stored (the very weights
    // transformers used), so only the fp8 rows add error: 2 × 1/16 (tests/quant.rs explains).
    check_run_within("deepseek_v3_fp8", "2", &["--quant", "fp8-block"], 0.13);
    check_run_within("gpt_oss_mxfp4", "1", &["--quant", "mxfp8", "--ep", "2", "--strategy", "allgather"], 0.13);
    // Ranks as processes: rank 0 gathers every DP group's rows and writes the file.
    check_run_launched(&["launch", "--gpus", "4", "--"], "qwen2_moe", "1", &["--ep", "4", "--tp", "2"], 1e-5);
}

/// `run --backend cuda` over two GPU ranks: the device-resident layer for all2allv, allgather
/// (also as two micro-batches), allgather-logits, multicast and lowlatency, against
/// transformers within bf16 rounding; and the fp8 checkpoint as stored with fp8 rows (W8A8) on
/// one GPU and two ranks, within fp8 rows' bound. Needs 2 GPUs (and the `cuda` feature); says loudly when
/// it skips.
#[test]
fn run_on_gpus_matches_transformers() {
    let gpus = moeflow::backend::cuda::device_count();
    if gpus < 2 {
        eprintln!("SKIPPED run_on_gpus_matches_transformers: needs 2 GPUs and the cuda feature, found {gpus}");
        return;
    }
    for (name, layer) in [("qwen2_moe", "1"), ("deepseek_v3", "2"), ("gpt_oss", "1")] {
        let strategies = [
            &["all2allv"][..],
            &["allgather"],
            &["allgather", "--dual-batch"],
            &["allgather-logits"],
            &["multicast"],
            &["lowlatency"],
            &["lowlatency", "--dual-batch"],
            &["auto"],
        ];
        for strategy in strategies {
            let args = [&["--backend", "cuda", "--dtype", "bf16", "--ep", "2", "--strategy"][..], strategy].concat();
            check_run_within(name, layer, &args, 2.5e-2);
        }
        // Layouts that used to run host-staged, now device-resident.
        for layout in [
            &["--placement", "round-robin"][..],
            &["--redundant", "0,1"],
            &["--tp", "2"],
            &["--tp", "2", "--strategy", "lowlatency", "--placement", "round-robin"],
        ] {
            let args = [&["--backend", "cuda", "--dtype", "bf16", "--ep", "2"][..], layout].concat();
            check_run_within(name, layer, &args, 2.5e-2);
        }
    }
    // The fp8 checkpoint as stored, with fp8 rows (W8A8), on one GPU and on two ranks.
    for ep in ["1", "2"] {
        check_run_within("deepseek_v3_fp8_128", "1", &["--backend", "cuda", "--quant", "fp8-block", "--ep", ep], 8e-2);
    }
}

/// `run --backend cuda --deterministic`: one GPU and two GPU ranks under several layouts write
/// the same bits, and say which layer ran. Needs 2 GPUs; says loudly when it skips.
#[test]
fn deterministic_runs_on_gpus_write_the_same_bits() {
    let gpus = moeflow::backend::cuda::device_count();
    if gpus < 2 {
        eprintln!(
            "SKIPPED deterministic_runs_on_gpus_write_the_same_bits: needs 2 GPUs and the cuda feature, found {gpus}"
        );
        return;
    }
    for (name, layer) in [("qwen2_moe", "1"), ("deepseek_v3", "2"), ("gpt_oss", "1")] {
        let dir = fixture(name);
        let (m, i) = (dir.display().to_string(), dir.join("input.safetensors").display().to_string());
        let run = |tag: &str, extra: &[&str]| {
            let out = tmp(&format!("{name}-det-{tag}.safetensors"));
            let o = out.display().to_string();
            let base = ["run", "--model", &m, "--layer", layer, "--input", &i, "--output", &o];
            let res =
                moeflow(&[&base[..], &["--backend", "cuda", "--dtype", "bf16", "--deterministic"], extra].concat());
            assert!(res.status.success(), "{name} {extra:?}: {}", text(&res));
            assert!(text(&res).contains("deterministic"), "{}", text(&res));
            let bits: Vec<u32> =
                read_hidden_states(&out, "hidden_states").unwrap().to_f32_vec().iter().map(|x| x.to_bits()).collect();
            std::fs::remove_file(out).ok();
            bits
        };
        let one = run("ep1", &[]);
        for (tag, extra) in [
            ("ep2", &["--ep", "2"][..]),
            ("rr", &["--ep", "2", "--placement", "round-robin", "--redundant", "0"]),
            ("tp2", &["--ep", "2", "--tp", "2"]),
            ("dual", &["--ep", "2", "--dual-batch"]),
        ] {
            assert!(run(tag, extra) == one, "{name} {extra:?}: differs from one GPU");
        }
    }
}

#[test]
fn failed_runs_leave_no_output() {
    let out = tmp("none.safetensors");
    let o = out.display().to_string();
    let v3 = fixture("deepseek_v3").display().to_string();
    let input = fixture("deepseek_v3/input.safetensors").display().to_string();
    let res = moeflow(&["run", "--model", &v3, "--layer", "0", "--input", &input, "--output", &o]);
    assert!(!res.status.success());
    assert!(text(&res).contains("layer 0 is not a MoE layer"), "{}", text(&res));
    assert!(!out.exists());
    // An input of the wrong hidden size (32 for a 64-wide model).
    let oss = fixture("gpt_oss").display().to_string();
    let res = moeflow(&["run", "--model", &oss, "--input", &input, "--output", &o]);
    assert!(!res.status.success());
    assert!(text(&res).contains("hidden size") && text(&res).contains("[7, 32]"), "{}", text(&res));
    assert!(!out.exists());
    // An input without hidden_states.
    let res = moeflow(&[
        "run",
        "--model",
        &oss,
        "--input",
        &fixture("gpt_oss/model.safetensors").display().to_string(),
        "--output",
        &o,
    ]);
    assert!(text(&res).contains("no tensor 'hidden_states'"), "{}", text(&res));
    assert!(!out.exists());
}

#[test]
fn demo_check_bench_inspect() {
    let res = moeflow(&["demo", "--experts", "8", "--tokens", "6"]);
    assert!(res.status.success() && text(&res).contains("check           OK"), "{}", text(&res));
    let res = moeflow(&["demo", "--experts", "8", "--tokens", "6", "--ep", "4", "--strategy", "multicast"]);
    assert!(text(&res).contains("bit-for-bit identical"), "{}", text(&res));
    // Both ways of multiplying bf16 weights, each checked against its own bound (bf16 dot
    // products run the portable kernel where the CPU lacks AVX512-BF16).
    for (mode, says, bound) in
        [("widen", "widened to f32", "bound 2.0e-5"), ("dot", "bf16 dot products", "bound 2.5e-2")]
    {
        let res = moeflow(&["demo", "--experts", "8", "--tokens", "2", "--bf16-matmul", mode]);
        let t = text(&res);
        assert!(
            res.status.success() && t.contains(says) && t.contains(bound) && t.contains("check           OK"),
            "{t}"
        );
    }
    let res = moeflow(&["demo", "--bf16-matmul", "fast"]);
    assert!(!res.status.success() && text(&res).contains("expected auto, widen or dot"), "{}", text(&res));
    // An explicit choice that cannot apply is refused before anything runs.
    for (args, needle) in [
        (&["demo", "--dtype", "f32", "--bf16-matmul", "dot"][..], "these weights are f32"),
        (&["bench", "--backend", "cuda", "--bf16-matmul", "widen"][..], "GPU layers always multiply in bf16"),
        (&["check", "--dtype", "f32", "--bf16-matmul", "widen"][..], "applies to bf16 weights"),
        (&["bench", "--against-bf16"][..], "--against-bf16 times an fp8 layer"),
        (&["bench", "--against-bf16", "--calibrate", "ceilings.json"][..], "--against-bf16 times an fp8 layer"),
        (&["bench", "--backend", "cuda", "--against-bf16"][..], "--against-bf16 times an fp8 layer"),
        (&["bench", "--backend", "cuda", "--dtype", "f8e4m3", "--ep", "2", "--against-bf16"][..], "on one GPU"),
    ] {
        let res = moeflow(args);
        assert!(!res.status.success() && text(&res).contains(needle), "{args:?}: {}", text(&res));
    }
    let res = moeflow(&["check", "--ep", "1,2,3"]);
    assert!(res.status.success() && text(&res).contains("all layouts bit-for-bit identical"), "{}", text(&res));
    let json = tmp("bench.json");
    let j = json.display().to_string();
    let res =
        moeflow(&["bench", "--experts", "8", "--tokens", "0,3", "--min-runs", "2", "--min-seconds", "0", "--json", &j]);
    assert!(res.status.success(), "{}", text(&res));
    let records: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let records = records.as_array().unwrap();
    assert_eq!(records.len(), 2);
    for key in ["preset", "backend", "dtype", "tokens", "ep", "strategy", "ms", "gflops"] {
        assert!(records[1].get(key).is_some(), "record lacks {key}");
    }
    assert_eq!(records[1]["tokens"], 3);
    assert!(["dot", "widen"].contains(&records[1]["bf16_matmul"].as_str().unwrap()), "{}", records[1]);
    std::fs::remove_file(json).ok();
    let res = moeflow(&["inspect", "--model", &fixture("qwen2_moe").display().to_string()]);
    assert!(
        res.status.success() && text(&res).contains("qwen2_moe") && text(&res).contains("sigmoid-gated"),
        "{}",
        text(&res)
    );
    let res = moeflow(&["demo", "--preset", "nope"]);
    assert!(!res.status.success() && text(&res).contains("known: olmoe-1b-7b"));
    // fp8 experts are a GPU format: on the CPU a clear error names the dtype.
    let res = moeflow(&["bench", "--experts", "8", "--tokens", "3", "--dtype", "f8e4m3"]);
    assert!(!res.status.success() && text(&res).contains("f8e4m3"), "{}", text(&res));
    // A PyTorch baseline runs beside one CPU rank, one GPU or the device-resident multi-GPU
    // layer only: anything else is refused before the run (no table printed).
    for (args, needle) in [
        (&["--ep", "2"][..], "on CPU compares one rank"),
        (&["--dtype", "f16"][..], "bf16 or f32 weights, not f16"),
        (&["--backend", "cuda", "--ep", "2", "--host-staged"][..], "not --host-staged"),
    ] {
        let res = moeflow(&[&["bench", "--experts", "8", "--tokens", "3", "--torch-baseline"][..], args].concat());
        let t = text(&res);
        assert!(!res.status.success() && t.contains(needle) && !t.contains("GFLOP/s"), "{args:?}: {t}");
    }
}

#[test]
fn launch_runs_cpu_ranks_as_processes_and_reports_errors() {
    // Three processes over TCP: each checks its share of the tokens bit for bit against one
    // rank and against the f64 reference.
    let demo = ["--verbose", "demo", "--ep", "3", "--experts", "8", "--tokens", "40", "--runs", "1"];
    let res = moeflow(&[&["launch", "--gpus", "3", "--"][..], &demo].concat());
    let t = text(&res);
    assert!(res.status.success(), "{t}");
    for r in 0..3 {
        assert!(t.contains(&format!("rank {r} of 3 processes (TCP)")), "{t}");
    }
    // The launcher gave the job a token of its own, which every rank joined with.
    let tokens: Vec<&str> =
        t.lines().filter_map(|l| l.split("joined job ").nth(1)).map(|r| r.split(' ').next().unwrap()).collect();
    assert_eq!(tokens.len(), 3, "{t}");
    assert!(tokens.iter().all(|&j| j == tokens[0] && j.len() == 32), "{tokens:?}");
    assert_eq!(t.matches("bit-for-bit identical").count(), 3, "{t}");
    assert_eq!(t.matches("check           OK").count(), 3, "{t}");
    // A layout that does not match the job fails on every rank, and launch says so.
    let res = moeflow(&["launch", "--gpus", "2", "--grace", "5", "--", "demo", "--ep", "3", "--tokens", "4"]);
    let t = text(&res);
    assert!(!res.status.success());
    assert!(t.contains("WORLD_SIZE=2 but the layout has 3 ranks"), "{t}");
    assert!(t.contains("failed first") && t.contains("exit codes by rank: [1, 1]"), "{t}");
    let res = moeflow(&["launch", "--gpus", "0", "--", "demo"]);
    assert!(!res.status.success() && text(&res).contains("--gpus must be at least 1"), "{}", text(&res));
    // Bad launcher variables name the variable.
    let res = Command::new(env!("CARGO_BIN_EXE_moeflow"))
        .args(["demo", "--ep", "2"])
        .env("RANK", "2")
        .env("WORLD_SIZE", "2")
        .output()
        .unwrap();
    assert!(!res.status.success() && text(&res).contains("RANK=2 must be below WORLD_SIZE=2"), "{}", text(&res));
    let res = moeflow(&["demo", "--ep", "2", "--timeout", "0"]);
    assert!(!res.status.success() && text(&res).contains("--timeout 0"), "{}", text(&res));
}

#[test]
fn bench_plots_its_records_and_plot_redraws_them_from_json() {
    let (svg, json, again) = (tmp("bench.svg"), tmp("plot.json"), tmp("again.svg"));
    let (s, j, a) = (svg.display().to_string(), json.display().to_string(), again.display().to_string());
    let bench = ["bench", "--experts", "8", "--ep", "2", "--tokens", "0,3,8", "--min-runs", "2", "--min-seconds", "0"];
    let res = moeflow(&[&bench[..], &["--plot", &s, "--json", &j]].concat());
    assert!(res.status.success() && text(&res).contains("wrote the plot"), "{}", text(&res));
    let drawn = std::fs::read_to_string(&svg).expect("bench --plot writes the SVG");
    // Series are named in the legend; the expert-parallel run adds the rate panel.
    for series in ["moeflow", "floor", "route", "experts", "finalize", "dispatch + combine"] {
        assert!(drawn.contains(series), "the plot lacks {series}");
    }
    assert!(!drawn.contains("PyTorch"), "no PyTorch curve without --torch-baseline");
    let res = moeflow(&["plot", "--json", &j, "--out", &a]);
    assert!(res.status.success(), "{}", text(&res));
    assert_eq!(std::fs::read_to_string(&again).unwrap(), drawn, "the same records draw the same plot");
    let res = moeflow(&["plot", "--json", "/nonexistent.json", "--out", &a]);
    assert!(!res.status.success() && text(&res).contains("reading /nonexistent.json"), "{}", text(&res));
    for p in [svg, json, again] {
        std::fs::remove_file(p).ok();
    }
}
