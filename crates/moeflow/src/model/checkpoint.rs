//! A Hugging Face model directory: `config.json` plus one or many safetensors files,
//! memory-mapped so that reading one layer touches only that layer's bytes.

use super::hf_config::HfConfig;
use crate::backend::cpu::mmap::map_file;
use crate::error::{MoeError, Result};
use crate::tensor::{CpuStorage, Tensor};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// An opened model directory.
pub struct Checkpoint {
    /// The directory.
    pub dir: PathBuf,
    /// Its `config.json`.
    pub config: HfConfig,
    shards: Vec<(PathBuf, Mmap)>,
    /// Tensor name → shard index.
    index: HashMap<String, usize>,
}

fn parse_header<'a>(path: &Path, bytes: &'a [u8]) -> Result<SafeTensors<'a>> {
    SafeTensors::deserialize(bytes)
        .map_err(|e| MoeError::Format(format!("{}: not a valid safetensors file ({e})", path.display())))
}

/// `file`, a shard named in `index`, as a path inside `dir`: a relative path of plain names
/// only (no `..`, no root, no drive), so an index cannot make moeflow open files elsewhere.
/// Symbolic links inside the folder are followed, as the Hugging Face cache needs.
fn shard_path(dir: &Path, index: &Path, file: &str) -> Result<PathBuf> {
    use std::path::Component;
    let rel = Path::new(file);
    if file.is_empty() || !rel.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(MoeError::Format(format!(
            "{}: shard '{file}' is not a file name inside the model folder",
            index.display()
        )));
    }
    Ok(dir.join(rel))
}

/// The file holding tensor `name`, for error messages.
fn path_of(shards: &[(PathBuf, Mmap)], index: &HashMap<String, usize>, name: &str) -> String {
    index.get(name).and_then(|&i| shards.get(i)).map_or_else(String::new, |(p, _)| p.display().to_string())
}

impl Checkpoint {
    /// Opens `dir`: `config.json` and `model.safetensors`, or the shards listed in
    /// `model.safetensors.index.json`. Headers are validated now; tensor data is read on use.
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(MoeError::Io {
                context: format!("opening model folder {}", dir.display()),
                source: std::io::Error::new(std::io::ErrorKind::NotADirectory, "not a directory"),
            });
        }
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path)
            .map_err(|e| MoeError::Io { context: format!("reading {}", cfg_path.display()), source: e })?;
        let config = HfConfig::parse(&text, &cfg_path.display().to_string())?;
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .map_err(|e| MoeError::Io { context: format!("reading {}", index_path.display()), source: e })?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| MoeError::Json { context: format!("parsing {}", index_path.display()), source: e })?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| MoeError::Format(format!("{}: no 'weight_map' object", index_path.display())))?;
            let mut files = Vec::with_capacity(map.len());
            for (name, file) in map {
                let file = file.as_str().ok_or_else(|| {
                    MoeError::Format(format!("{}: the shard of '{name}' is not a string", index_path.display()))
                })?;
                files.push(file.to_string());
            }
            files.sort();
            files.dedup();
            files.iter().map(|f| shard_path(dir, &index_path, f)).collect::<Result<_>>()?
        } else {
            vec![dir.join("model.safetensors")]
        };
        let mut shards = Vec::new();
        let mut index = HashMap::new();
        for path in files {
            let mmap = map_file(&path)?;
            for name in parse_header(&path, &mmap)?.names() {
                index.insert(name.to_string(), shards.len());
            }
            shards.push((path, mmap));
        }
        Ok(Checkpoint { dir: dir.to_path_buf(), config, shards, index })
    }

    /// How many tensors the checkpoint holds.
    pub fn tensor_count(&self) -> usize {
        self.index.len()
    }

    /// Whether the checkpoint has tensor `name`.
    pub fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Errors naming the first few of `names` that are missing.
    pub fn require(&self, names: &[String]) -> Result<()> {
        let missing: Vec<&String> = names.iter().filter(|n| !self.has(n)).collect();
        if missing.is_empty() {
            return Ok(());
        }
        let shown: Vec<&str> = missing.iter().take(4).map(|s| s.as_str()).collect();
        Err(MoeError::Format(format!(
            "{}: missing {} of {} tensors of this block, first: {}",
            self.dir.display(),
            missing.len(),
            names.len(),
            shown.join(", ")
        )))
    }

    fn view(&self, name: &str) -> Result<safetensors::tensor::TensorView<'_>> {
        let &shard = self
            .index
            .get(name)
            .ok_or_else(|| MoeError::Format(format!("{}: missing tensor {name}", self.dir.display())))?;
        let (path, mmap) = &self.shards[shard];
        parse_header(path, mmap)?.tensor(name).map_err(|e| MoeError::Format(format!("{}: {name}: {e}", path.display())))
    }

    /// Shape and dtype name of tensor `name`.
    pub fn info(&self, name: &str) -> Result<(Vec<usize>, String)> {
        let v = self.view(name)?;
        Ok((v.shape().to_vec(), format!("{:?}", v.dtype()).to_lowercase()))
    }

    /// Tensor `name` as a float [`Tensor`] (f32, bf16, f16 or fp8 kept as stored); its shape must
    /// be `shape`.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let v = self.view(name)?;
        if v.shape() != shape {
            return Err(MoeError::shape(format!("{name} (from config.json)"), shape, v.shape()));
        }
        let b = v.data();
        let storage = match v.dtype() {
            Dtype::F32 => {
                CpuStorage::F32(b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
            }
            Dtype::BF16 => {
                CpuStorage::BF16(b.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]])).collect())
            }
            Dtype::F16 => CpuStorage::F16(b.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]])).collect()),
            Dtype::F8_E4M3 => CpuStorage::F8E4M3(b.iter().map(|&x| float8::F8E4M3::from_bits(x)).collect()),
            Dtype::F8_E5M2 => CpuStorage::F8E5M2(b.iter().map(|&x| float8::F8E5M2::from_bits(x)).collect()),
            d => {
                return Err(MoeError::DType {
                    what: name.into(),
                    expected: "f32, bf16, f16 or fp8".into(),
                    got: format!("{d:?}"),
                })
            }
        };
        let t = Tensor::new(shape, storage)?;
        crate::error::check_finite_tensor(&format!("{} ({name})", path_of(&self.shards, &self.index, name)), &t)?;
        Ok(t)
    }

    /// Tensor `name` as f32 values (shape checked).
    pub fn f32s(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        Ok(self.tensor(name, shape)?.to_f32_vec())
    }

    /// Raw bytes of a u8 tensor (quantized blocks and scales), shape checked.
    pub fn bytes(&self, name: &str, shape: &[usize]) -> Result<&[u8]> {
        let &shard = self
            .index
            .get(name)
            .ok_or_else(|| MoeError::Format(format!("{}: missing tensor {name}", self.dir.display())))?;
        let (path, mmap) = &self.shards[shard];
        let st = parse_header(path, mmap)?;
        let v = st.tensor(name).map_err(|e| MoeError::Format(format!("{}: {name}: {e}", path.display())))?;
        if v.shape() != shape {
            return Err(MoeError::shape(format!("{name} (from config.json)"), shape, v.shape()));
        }
        if v.dtype() != Dtype::U8 && v.dtype() != Dtype::I8 {
            return Err(MoeError::DType { what: name.into(), expected: "u8".into(), got: format!("{:?}", v.dtype()) });
        }
        // The view borrows the map, which lives as long as self.
        let data = v.data();
        let start = data.as_ptr() as usize - mmap.as_ptr() as usize;
        Ok(&mmap[start..start + data.len()])
    }
}
