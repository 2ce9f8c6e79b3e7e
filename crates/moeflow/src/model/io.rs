//! Hidden-state files: read `hidden_states [T, H]` from safetensors, write outputs atomically.

use crate::backend::cpu::mmap::map_file;
use crate::error::{MoeError, Result};
use crate::tensor::{CpuStorage, Tensor};
use safetensors::{Dtype, SafeTensors};
use std::path::Path;

/// Reads tensor `name` of `path` as a 2-D f32/bf16/f16 tensor.
pub fn read_hidden_states(path: &Path, name: &str) -> Result<Tensor> {
    let mmap = map_file(path)?;
    let st = SafeTensors::deserialize(&mmap)
        .map_err(|e| MoeError::Format(format!("{}: not a valid safetensors file ({e})", path.display())))?;
    let v = st.tensor(name).map_err(|_| {
        let names = st.names();
        MoeError::Format(format!("{}: no tensor '{name}' (has: {})", path.display(), names.join(", ")))
    })?;
    if v.shape().len() != 2 {
        return Err(MoeError::shape(format!("{name} in {}", path.display()), "[T, H]", v.shape()));
    }
    let b = v.data();
    let storage = match v.dtype() {
        Dtype::F32 => {
            CpuStorage::F32(b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
        }
        Dtype::BF16 => CpuStorage::BF16(b.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]])).collect()),
        Dtype::F16 => CpuStorage::F16(b.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]])).collect()),
        d => {
            return Err(MoeError::DType {
                what: format!("{name} in {}", path.display()),
                expected: "f32, bf16 or f16".into(),
                got: format!("{d:?}"),
            })
        }
    };
    Tensor::new(v.shape(), storage)
}

/// Writes f32 `tensors` to `path` through a temporary file renamed into place, so a failure
/// leaves no partial output.
pub fn write_f32_atomic(path: &Path, tensors: &[(&str, &Tensor)]) -> Result<()> {
    let data: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .iter()
        .map(|(n, t)| (n.to_string(), bytemuck::cast_slice(&t.to_f32_vec()).to_vec(), t.shape().to_vec()))
        .collect();
    let views = data
        .iter()
        .map(|(n, b, s)| {
            safetensors::tensor::TensorView::new(Dtype::F32, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| MoeError::Config(format!("output tensor {n}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let bytes =
        safetensors::serialize(views, None).map_err(|e| MoeError::Config(format!("serializing output: {e}")))?;
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_else(|| "output".into());
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let io = |e, what: &str| MoeError::Io { context: format!("{what} {}", path.display()), source: e };
    std::fs::write(&tmp, bytes).map_err(|e| io(e, "writing"))?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io(e, "renaming into")
    })
}
