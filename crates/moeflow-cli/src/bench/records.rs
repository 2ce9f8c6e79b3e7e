//! The records `bench` measures and writes as JSON, and the fields later steps add to them.

use moeflow::{MoeError, Result, StageTimes};
use serde::Serialize;
use std::path::Path;

/// One measured configuration (the schema every bench writes).
#[derive(Serialize, Debug)]
pub struct Record {
    /// Preset name (`--preset`).
    pub preset: String,
    /// `cpu` or `cuda`.
    pub backend: String,
    /// Expert weight dtype.
    pub dtype: String,
    /// Tokens per DP group.
    pub tokens: usize,
    /// Expert-parallel size.
    pub ep: usize,
    /// Tensor-parallel size.
    pub tp: usize,
    /// Dispatch strategy (and the GPU layer that ran it).
    pub strategy: String,
    /// Quantization of activations (and weights).
    pub quant: String,
    /// Relative error against the unquantized f32 path (single rank, quantized runs only).
    pub rel_error: Option<f64>,
    /// Median layer time (slowest rank).
    pub ms: f64,
    /// Whole-layer GFLOP/s (all DP groups' tokens).
    pub gflops: f64,
    /// Fraction of the measured dense matmul rate (on a GPU with W8A8, the dense fp8 GEMM's).
    pub matmul_fraction: f64,
    /// max(FLOPs at the matmul rate, weight bytes at the copy bandwidth): the weights of the
    /// experts the runs served (under expert parallelism, rank 0's).
    pub floor_ms: f64,
    /// GPU: the same floor with the GEMM rate a GPU holds under sustained load (its power cap
    /// lowers the clocks within a second), the rate a long run of GEMMs can reach.
    pub floor_sustained_ms: Option<f64>,
    /// Timed runs behind the medians.
    pub runs: usize,
    /// Median time of each stage on rank 0, ms.
    pub stages_ms: StageTimes,
    /// Bytes rank 0 sent per forward (dispatch and combine).
    pub bytes_moved_per_rank: usize,
    /// Those bytes over rank 0's prepare + finalize time, GB/s.
    pub comm_gbps: Option<f64>,
    /// CPU runs: the dense f32 matmul probe's rate just before this row's runs, GFLOP/s (the
    /// machine's pace, which `simulate --compare` predicts at).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub probe_gflops: Option<f64>,
    /// CPU experts with bf16 weights: `dot` (bf16 dot products) or `widen` (f32 arithmetic).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bf16_matmul: Option<String>,
}

/// Writes `records` to `path` as a pretty JSON array.
pub fn write_records(path: &Path, records: &[Record]) -> Result<()> {
    let text = serde_json::to_string_pretty(records)
        .map_err(|e| MoeError::Json { context: "bench records".into(), source: e })?;
    write_text(path, text)
}

/// Sets `key` to the value given for each record's token count in the JSON array at `path`
/// (records of other token counts are left as they are): how `--torch-baseline` adds the
/// PyTorch layer's times (`torch_ms`, `torch_per_rank_ms`) to the records written before it ran.
pub fn add_field(path: &Path, key: &str, by_tokens: &[(usize, f64)]) -> Result<()> {
    let json = |e| MoeError::Json { context: format!("bench records in {}", path.display()), source: e };
    let text = std::fs::read_to_string(path)
        .map_err(|e| MoeError::Io { context: format!("reading {}", path.display()), source: e })?;
    let mut records: Vec<serde_json::Map<String, serde_json::Value>> = serde_json::from_str(&text).map_err(json)?;
    for record in &mut records {
        let tokens = record.get("tokens").and_then(|t| t.as_u64());
        if let Some(&(_, value)) = by_tokens.iter().find(|(t, _)| Some(*t as u64) == tokens) {
            if let Some(number) = serde_json::Number::from_f64(value) {
                record.insert(key.to_string(), serde_json::Value::Number(number));
            }
        }
    }
    write_text(path, serde_json::to_string_pretty(&records).map_err(json)?)
}

fn write_text(path: &Path, text: String) -> Result<()> {
    std::fs::write(path, text + "\n")
        .map_err(|e| MoeError::Io { context: format!("writing {}", path.display()), source: e })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_field_sets_the_value_of_matching_token_counts_only() {
        let path = std::env::temp_dir().join(format!("moeflow_records_{}.json", std::process::id()));
        std::fs::write(&path, r#"[{"tokens": 1, "ms": 0.5}, {"tokens": 32, "ms": 1.5}]"#).unwrap();
        add_field(&path, "torch_ms", &[(32, 2.25), (7, 9.0)]).unwrap();
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let _ = std::fs::remove_file(&path);
        assert!(v[0].get("torch_ms").is_none(), "{v}");
        assert_eq!(v[1]["torch_ms"], 2.25);
        assert_eq!(v[1]["ms"], 1.5);
    }
}
