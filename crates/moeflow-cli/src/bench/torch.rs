//! `bench --torch-baseline`: the same shapes through a PyTorch layer (one CPU rank, one GPU, or
//! PyTorch + NCCL on several GPUs), printed beside moeflow's times.

use super::records::add_field;
use super::BenchArgs;
use crate::common::spinner;
use crate::table::{num, right, Table};
use moeflow::parallel::RankHost;
use moeflow::{DType, MoeError, Result};

/// The PyTorch + NCCL baseline layer, run by `--torch-baseline` on GPUs.
const TORCH_BASELINE: &str = include_str!("../../../../tools/torch_ep_baseline.py");
/// The PyTorch CPU baseline layer, run by `--torch-baseline` on one CPU rank.
const TORCH_CPU_BASELINE: &str = include_str!("../../../../tools/torch_cpu_baseline.py");
/// The one-GPU PyTorch baseline layer, run by `--torch-baseline` on one GPU.
const TORCH_GPU_BASELINE: &str = include_str!("../../../../tools/torch_gpu_baseline.py");

/// Runs the Python baseline `source` (written to a temporary file) as
/// `python3 <launcher...> <script> <args...>` under a spinner saying `what`, and returns its
/// JSON line (the one holding `"baseline"`), or an error with the tail of its stderr.
fn run_baseline(source: &str, launcher: &[String], args: &[String], what: String) -> Result<serde_json::Value> {
    let io = |context: &str, e: std::io::Error| MoeError::Io { context: context.into(), source: e };
    let script = std::env::temp_dir().join(format!("moeflow_torch_baseline_{}.py", std::process::id()));
    std::fs::write(&script, source).map_err(|e| io("writing the baseline script", e))?;
    let bar = spinner(what);
    let out = std::process::Command::new("python3")
        .args(launcher)
        .arg(&script)
        .args(args)
        .output()
        .map_err(|e| io("starting python3", e));
    bar.finish_and_clear();
    let _ = std::fs::remove_file(&script);
    let out = out?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().find(|l| l.contains("\"baseline\"")).ok_or_else(|| {
        MoeError::Config(format!(
            "the PyTorch baseline failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).lines().rev().take(5).collect::<Vec<_>>().join(" | ")
        ))
    })?;
    serde_json::from_str(line).map_err(|e| MoeError::Json { context: "baseline output".into(), source: e })
}

/// The shape arguments both baseline scripts take, from `config`.
fn baseline_shape_args(config: &moeflow::MoeConfig, tokens: &[usize], runs: usize) -> Vec<String> {
    let tokens: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
    [
        ("--hidden", config.hidden.to_string()),
        ("--inter", config.inter.to_string()),
        ("--experts", config.num_experts.to_string()),
        ("--top-k", config.top_k.to_string()),
        ("--shared-inter", config.shared.map_or(0, |s| s.inter).to_string()),
        ("--tokens", tokens.join(",")),
        ("--runs", runs.to_string()),
    ]
    .into_iter()
    .flat_map(|(flag, value)| [flag.to_string(), value])
    .collect()
}

/// Runs tools/torch_ep_baseline.py on `ep` GPUs with the preset's shapes and prints its times
/// beside `ours` (tokens, layer ms, dispatch ms, combine ms).
pub(super) fn torch_baseline(
    args: &BenchArgs,
    config: &moeflow::MoeConfig,
    ep: usize,
    ours: &[(usize, f64, f64, f64)],
) -> Result<()> {
    let port = moeflow::comm::free_port().map_err(|e| MoeError::Io { context: "choosing a port".into(), source: e })?;
    let launcher: Vec<String> = ["-m", "torch.distributed.run", "--nproc-per-node", &ep.to_string(), "--master-port"]
        .iter()
        .map(|s| s.to_string())
        .chain([port.to_string()])
        .collect();
    let v = run_baseline(
        TORCH_BASELINE,
        &launcher,
        &baseline_shape_args(config, &args.tokens, args.min_runs.max(20)),
        format!("running the PyTorch + NCCL baseline on {ep} GPUs"),
    )?;
    println!(
        "PyTorch {} + NCCL baseline, same shapes, same GPUs: rows per (token, slot) each way (Megatron's \
         dispatcher), and per (token, rank serving it), summed there (DeepEP's form):",
        v["torch"].as_str().unwrap_or("?")
    );
    let table = Table::new(&[
        right("tokens", 7),
        right("moeflow ms", 10),
        right("per slot ms", 11),
        right("speedup", 8),
        right("disp", 7),
        right("comb", 7),
        right("per rank ms", 11),
        right("speedup", 8),
        right("disp", 7),
        right("comb", 7),
    ]);
    println!("{}", table.header());
    let (mut times, mut per_rank) = (Vec::new(), Vec::new());
    for rec in v["records"].as_array().into_iter().flatten() {
        let (t, ms) = baseline_time(rec);
        let mine = ours.iter().find(|o| o.0 == t).map_or(f64::NAN, |o| o.1);
        let field = |key: &str| rec[key].as_f64().unwrap_or(f64::NAN);
        let ranked = field("per_rank_ms");
        println!(
            "{}",
            table.row(&[
                t.to_string(),
                num(mine, 3),
                num(ms, 3),
                format!("{:.2}x", ms / mine),
                num(field("dispatch_ms"), 3),
                num(field("combine_ms"), 3),
                num(ranked, 3),
                format!("{:.2}x", ranked / mine),
                num(field("per_rank_dispatch_ms"), 3),
                num(field("per_rank_combine_ms"), 3),
            ])
        );
        times.push((t, ms));
        per_rank.push((t, ranked));
    }
    record_baseline(args, "torch_ms", &times)?;
    record_baseline(args, "torch_per_rank_ms", &per_rank)
}

/// Runs the one-device PyTorch layer with the preset's shapes and prints its times beside
/// `ours` (tokens, layer ms): tools/torch_gpu_baseline.py on this GPU with `gpu` (its fp8
/// experts and rows for W8A8 runs), else tools/torch_cpu_baseline.py with the run's weight
/// dtype and matmul precision on this machine.
pub(super) fn torch_single_baseline(
    args: &BenchArgs,
    config: &moeflow::MoeConfig,
    gpu: bool,
    ours: &[(usize, f64)],
) -> Result<()> {
    let mut script_args = baseline_shape_args(config, &args.tokens, args.min_runs.max(if gpu { 20 } else { 5 }));
    let v = if gpu {
        if args.layer.dtype == DType::F8E4M3 && args.parallel.quant == moeflow::quant::QuantConfig::Fp8Block {
            script_args.push("--fp8".into());
        }
        run_baseline(TORCH_GPU_BASELINE, &[], &script_args, "running the PyTorch baseline on this GPU".into())?
    } else {
        // bf16 or f32 (checked before the run). bf16 weights are multiplied as moeflow does:
        // bf16 matmuls beside its dot products, f32 matmuls on widened weights beside `widen`.
        let bf16 = args.layer.dtype == DType::BF16;
        let compute = if bf16 && args.parallel.bf16_matmul.uses_dot() { "bf16" } else { "f32" };
        script_args.extend(["--dtype", if bf16 { "bf16" } else { "f32" }, "--compute", compute].map(String::from));
        run_baseline(TORCH_CPU_BASELINE, &[], &script_args, "running the PyTorch CPU baseline".into())?
    };
    let torch = v["torch"].as_str().unwrap_or("?");
    if gpu {
        let experts = v["experts"].as_str().unwrap_or("torch._grouped_mm, bf16");
        println!("PyTorch {torch} baseline on this GPU (argsort, {experts}), same shapes:");
    } else {
        println!(
            "PyTorch {torch} baseline on this machine ({} threads, {} weights, {} matmuls), same shapes:",
            v["threads"].as_u64().unwrap_or(0),
            v["dtype"].as_str().unwrap_or("?"),
            v["compute"].as_str().unwrap_or("?")
        );
    }
    let table = Table::new(&[right("tokens", 7), right("torch ms", 10), right("moeflow ms", 10), right("speedup", 8)]);
    println!("{}", table.header());
    let mut times = Vec::new();
    for rec in v["records"].as_array().into_iter().flatten() {
        let (t, ms) = baseline_time(rec);
        let mine = ours.iter().find(|o| o.0 == t).map_or(f64::NAN, |o| o.1);
        println!("{}", table.row(&[t.to_string(), num(ms, 3), num(mine, 3), format!("{:.2}x", ms / mine)]));
        times.push((t, ms));
    }
    if let Some(line) = fp8_floor_line(&v, config, ours) {
        println!("{line}");
    }
    record_baseline(args, "torch_ms", &times)
}

/// The fp8 floor of a W8A8 run, from the one-GPU baseline's output `v`: the layer's FLOPs
/// (`config`) at cuBLASLt's dense fp8 rate measured in this run (`fp8_tflops`, one scale a
/// tensor), and at its rate with DeepSeek-V3's block scales (`fp8_block_tflops`) where the
/// baseline measured that too, against moeflow's `(tokens, layer ms)`; `None` without a rate.
fn fp8_floor_line(v: &serde_json::Value, config: &moeflow::MoeConfig, ours: &[(usize, f64)]) -> Option<String> {
    let tflops = v["fp8_tflops"].as_f64()?;
    let block = v["fp8_block_tflops"].as_f64();
    let floors: Vec<String> = ours
        .iter()
        .map(|&(t, ms)| {
            let at = |rate: f64| config.expert_flops(t) / (rate * 1e9);
            let floor = format!("T {t} {:.3} ms ({:.0}%", at(tflops), 100.0 * at(tflops) / ms);
            match block {
                Some(b) => format!("{floor}; {:.3} ms, {:.0}%, at the block-scaled rate)", at(b), 100.0 * at(b) / ms),
                None => format!("{floor})"),
            }
        })
        .collect();
    let block_rate = block.map_or(String::new(), |b| format!(", {b:.0} with DeepSeek-V3's block scales"));
    Some(format!(
        "fp8 floor: the FLOPs at a dense fp8 matmul's sustained rate (torch._scaled_mm, cuBLASLt), {tflops:.0} TFLOP/s \
         with one scale a tensor{block_rate}: {}",
        floors.join(", ")
    ))
}

/// (tokens, layer ms) of one record of a baseline script's output.
fn baseline_time(rec: &serde_json::Value) -> (usize, f64) {
    (rec["tokens"].as_u64().unwrap_or(0) as usize, rec["ms"].as_f64().unwrap_or(f64::NAN))
}

/// Adds the baseline's layer times to the records written by `--json` (as `key`: `torch_ms`,
/// or `torch_per_rank_ms` for the multi-GPU baseline's second form), where the plot and later
/// readers find them beside moeflow's.
fn record_baseline(args: &BenchArgs, key: &str, times: &[(usize, f64)]) -> Result<()> {
    match &args.json {
        Some(path) if path.exists() => add_field(path, key, times),
        _ => Ok(()),
    }
}

/// Refuses `--torch-baseline` where no baseline runs beside the layer, before any work: it
/// compares one CPU rank (bf16 or f32 weights), one GPU, or the device-resident multi-GPU
/// layer, started without a launcher.
pub(super) fn check_torch_baseline(args: &BenchArgs, gpu: bool, host: &RankHost) -> Result<()> {
    let refuse = |why: &str| Err(MoeError::Config(format!("--torch-baseline {why}")));
    if host.launched_rank().is_some() {
        return refuse("starts its own processes: run without a launcher");
    }
    if gpu {
        if args.host_staged {
            return refuse("compares the device-resident layer, not --host-staged");
        }
    } else {
        if args.parallel.ep != 1 {
            return refuse("on CPU compares one rank (--ep 1)");
        }
        if !matches!(args.layer.dtype, DType::BF16 | DType::F32) {
            return refuse(&format!("on CPU takes bf16 or f32 weights, not {}", args.layer.dtype));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::fp8_floor_line;

    /// The floor line gives the layer's FLOPs at each rate the baseline measured, as a time and
    /// as a share of moeflow's, and nothing without a rate.
    #[test]
    fn fp8_floor_line_takes_each_measured_rate() {
        let config = moeflow::preset::preset("deepseek-v3").unwrap().config.with_num_experts(64).unwrap();
        let flops = config.expert_flops(4096);
        let ours = [(4096, 4.0)];
        let per_tensor: serde_json::Value = serde_json::json!({ "fp8_tflops": 1000.0 });
        let line = fp8_floor_line(&per_tensor, &config, &ours).unwrap();
        let floor = flops / 1e12;
        let want = format!("1000 TFLOP/s with one scale a tensor: T 4096 {floor:.3} ms ({:.0}%)", 25.0 * floor);
        assert!(line.ends_with(&want), "{line}");
        let both = serde_json::json!({ "fp8_tflops": 1000.0, "fp8_block_tflops": 800.0 });
        let line = fp8_floor_line(&both, &config, &ours).unwrap();
        let block = flops / 0.8e12;
        let want = format!(", 800 with DeepSeek-V3's block scales: T 4096 {floor:.3} ms");
        assert!(line.contains(&want), "{line}");
        assert!(line.ends_with(&format!("; {block:.3} ms, {:.0}%, at the block-scaled rate)", 25.0 * block)), "{line}");
        assert!(fp8_floor_line(&serde_json::json!({ "torch": "2.11" }), &config, &ours).is_none());
    }
}
