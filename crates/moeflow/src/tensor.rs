//! A small n-dimensional tensor: a shape, an element type and a storage.
//!
//! Storage is an enum over backends. Today only host memory exists; a device storage becomes a
//! new variant of [`Storage`] and callers that go through [`Tensor`]'s methods need no change.

use crate::dtype::DType;
use crate::error::{MoeError, Result};
use float8::{F8E4M3, F8E5M2};
use half::{bf16, f16};

/// Host memory, one vector per element type.
#[derive(Clone, Debug, PartialEq)]
pub enum CpuStorage {
    /// f32 values.
    F32(Vec<f32>),
    /// bf16 values.
    BF16(Vec<bf16>),
    /// f16 values.
    F16(Vec<f16>),
    /// fp8 e4m3 values.
    F8E4M3(Vec<F8E4M3>),
    /// fp8 e5m2 values.
    F8E5M2(Vec<F8E5M2>),
    /// int8 values.
    I8(Vec<i8>),
    /// int32 values.
    I32(Vec<i32>),
}

/// `convert` applied to every element; large vectors are split over the threads (weights of
/// a whole layer are hundreds of MB).
fn widen<T: Copy + Sync>(v: &[T], convert: impl Fn(T) -> f32 + Sync + Send) -> Vec<f32> {
    use rayon::prelude::*;
    v.par_iter().with_min_len(1 << 16).map(|&x| convert(x)).collect()
}

/// Where a tensor's elements live.
#[derive(Clone, Debug, PartialEq)]
pub enum Storage {
    /// Host memory.
    Cpu(CpuStorage),
}

/// A dense row-major tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    storage: Storage,
}

impl CpuStorage {
    fn len(&self) -> usize {
        match self {
            CpuStorage::F32(v) => v.len(),
            CpuStorage::BF16(v) => v.len(),
            CpuStorage::F16(v) => v.len(),
            CpuStorage::F8E4M3(v) => v.len(),
            CpuStorage::F8E5M2(v) => v.len(),
            CpuStorage::I8(v) => v.len(),
            CpuStorage::I32(v) => v.len(),
        }
    }

    fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::F8E4M3(_) => DType::F8E4M3,
            CpuStorage::F8E5M2(_) => DType::F8E5M2,
            CpuStorage::I8(_) => DType::I8,
            CpuStorage::I32(_) => DType::I32,
        }
    }

    /// Every element widened to f32 (integers converted by value).
    fn to_f32(&self) -> Vec<f32> {
        match self {
            CpuStorage::F32(v) => v.clone(),
            CpuStorage::BF16(v) => widen(v, bf16::to_f32),
            CpuStorage::F16(v) => widen(v, f16::to_f32),
            CpuStorage::F8E4M3(v) => widen(v, |x| x.to_f32()),
            CpuStorage::F8E5M2(v) => widen(v, |x| x.to_f32()),
            CpuStorage::I8(v) => widen(v, |x| x as f32),
            CpuStorage::I32(v) => widen(v, |x| x as f32),
        }
    }

    /// f32 values rounded to `dtype` (nearest even; integers saturate and round).
    fn from_f32(values: &[f32], dtype: DType) -> CpuStorage {
        match dtype {
            DType::F32 => CpuStorage::F32(values.to_vec()),
            DType::BF16 => CpuStorage::BF16(values.iter().map(|&x| bf16::from_f32(x)).collect()),
            DType::F16 => CpuStorage::F16(values.iter().map(|&x| f16::from_f32(x)).collect()),
            DType::F8E4M3 => CpuStorage::F8E4M3(values.iter().map(|&x| F8E4M3::from_f32(x)).collect()),
            DType::F8E5M2 => CpuStorage::F8E5M2(values.iter().map(|&x| F8E5M2::from_f32(x)).collect()),
            DType::I8 => CpuStorage::I8(values.iter().map(|&x| x.round().clamp(-128.0, 127.0) as i8).collect()),
            DType::I32 => CpuStorage::I32(values.iter().map(|&x| x.round() as i32).collect()),
        }
    }
}

impl Tensor {
    /// Wraps host storage; the element count must match the shape.
    pub fn new(shape: &[usize], storage: CpuStorage) -> Result<Self> {
        let want = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        if want != Some(storage.len()) {
            return Err(MoeError::shape("tensor data", shape, format!("{} elements", storage.len())));
        }
        Ok(Tensor { shape: shape.to_vec(), storage: Storage::Cpu(storage) })
    }

    /// An f32 tensor.
    pub fn from_f32(shape: &[usize], data: Vec<f32>) -> Result<Self> {
        Self::new(shape, CpuStorage::F32(data))
    }

    /// An i32 tensor.
    pub fn from_i32(shape: &[usize], data: Vec<i32>) -> Result<Self> {
        Self::new(shape, CpuStorage::I32(data))
    }

    /// f32 values converted to `dtype`.
    pub fn from_f32_as(shape: &[usize], data: &[f32], dtype: DType) -> Result<Self> {
        Self::new(shape, CpuStorage::from_f32(data, dtype))
    }

    /// All-zero tensor.
    pub fn zeros(shape: &[usize], dtype: DType) -> Self {
        let n = shape.iter().product();
        Tensor { shape: shape.to_vec(), storage: Storage::Cpu(CpuStorage::from_f32(&vec![0.0; n], dtype)) }
    }

    /// The dimensions.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn elem_count(&self) -> usize {
        self.shape.iter().product()
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        match &self.storage {
            Storage::Cpu(s) => s.dtype(),
        }
    }

    /// Bytes of the elements.
    pub fn size_in_bytes(&self) -> usize {
        self.elem_count() * self.dtype().size_in_bytes()
    }

    /// The storage.
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// Host storage (every tensor is on the host today).
    pub fn cpu(&self) -> &CpuStorage {
        match &self.storage {
            Storage::Cpu(s) => s,
        }
    }

    /// Checks the shape, naming the tensor in the error.
    pub fn expect_shape(&self, what: &str, shape: &[usize]) -> Result<()> {
        if self.shape != shape {
            return Err(MoeError::shape(what, shape, &self.shape));
        }
        Ok(())
    }

    /// The elements as an f32 slice, when the dtype is f32.
    pub fn as_f32(&self) -> Result<&[f32]> {
        match self.cpu() {
            CpuStorage::F32(v) => Ok(v),
            s => Err(MoeError::DType { what: "tensor".into(), expected: "f32".into(), got: s.dtype().to_string() }),
        }
    }

    /// The elements as an i32 slice, when the dtype is i32.
    pub fn as_i32(&self) -> Result<&[i32]> {
        match self.cpu() {
            CpuStorage::I32(v) => Ok(v),
            s => Err(MoeError::DType { what: "tensor".into(), expected: "i32".into(), got: s.dtype().to_string() }),
        }
    }

    /// Every element widened to f32.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        self.cpu().to_f32()
    }

    /// The flat index and value of the first NaN or infinity, if any (integer tensors have
    /// none). Reads the elements in place, split over the threads.
    pub fn first_nonfinite(&self) -> Option<(usize, f32)> {
        fn find<T: Copy + Sync>(v: &[T], to_f32: impl Fn(T) -> f32 + Sync + Send) -> Option<(usize, f32)> {
            use rayon::prelude::*;
            v.par_iter()
                .with_min_len(1 << 16)
                .map(|&x| to_f32(x))
                .position_first(|x| !x.is_finite())
                .map(|i| (i, to_f32(v[i])))
        }
        match self.cpu() {
            CpuStorage::F32(v) => find(v, |x| x),
            CpuStorage::BF16(v) => find(v, f32::from),
            CpuStorage::F16(v) => find(v, f32::from),
            CpuStorage::F8E4M3(v) => find(v, |x| x.to_f32()),
            CpuStorage::F8E5M2(v) => find(v, |x| x.to_f32()),
            CpuStorage::I8(_) | CpuStorage::I32(_) => None,
        }
    }

    /// Every element widened to f64.
    pub fn to_f64_vec(&self) -> Vec<f64> {
        self.cpu().to_f32().into_iter().map(f64::from).collect()
    }

    /// A copy converted to `dtype` (through f32, rounding to nearest).
    pub fn to_dtype(&self, dtype: DType) -> Tensor {
        if dtype == self.dtype() {
            return self.clone();
        }
        Tensor { shape: self.shape.clone(), storage: Storage::Cpu(CpuStorage::from_f32(&self.to_f32_vec(), dtype)) }
    }

    /// The sub-tensors `idx` along the first dimension, in that order (`[idx.len(), ...]`).
    pub fn index_select0(&self, idx: &[usize]) -> Result<Tensor> {
        let rows = self.shape.first().copied().unwrap_or(0);
        if let Some(&bad) = idx.iter().find(|&&i| i >= rows) {
            return Err(MoeError::shape("index_select0 index", format!("< {rows}"), bad));
        }
        let per = self.elem_count() / rows.max(1);
        fn pick<T: Clone>(v: &[T], idx: &[usize], per: usize) -> Vec<T> {
            idx.iter().flat_map(|&i| v[i * per..(i + 1) * per].iter().cloned()).collect()
        }
        let storage = match self.cpu() {
            CpuStorage::F32(v) => CpuStorage::F32(pick(v, idx, per)),
            CpuStorage::BF16(v) => CpuStorage::BF16(pick(v, idx, per)),
            CpuStorage::F16(v) => CpuStorage::F16(pick(v, idx, per)),
            CpuStorage::F8E4M3(v) => CpuStorage::F8E4M3(pick(v, idx, per)),
            CpuStorage::F8E5M2(v) => CpuStorage::F8E5M2(pick(v, idx, per)),
            CpuStorage::I8(v) => CpuStorage::I8(pick(v, idx, per)),
            CpuStorage::I32(v) => CpuStorage::I32(pick(v, idx, per)),
        };
        let mut shape = self.shape.clone();
        if let Some(d) = shape.first_mut() {
            *d = idx.len();
        }
        Tensor::new(&shape, storage)
    }

    /// Same elements, new shape with the same element count.
    pub fn reshape(mut self, shape: &[usize]) -> Result<Tensor> {
        if shape.iter().product::<usize>() != self.elem_count() {
            return Err(MoeError::shape("reshape", shape, &self.shape));
        }
        self.shape = shape.to_vec();
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_round_trip_on_representable_values() {
        let vals = [0.0f32, 1.0, -2.5, 0.125, 448.0];
        for d in [DType::F32, DType::BF16, DType::F16, DType::F8E4M3] {
            let t = Tensor::from_f32_as(&[5], &vals, d).unwrap();
            assert_eq!(t.dtype(), d);
            assert_eq!(t.to_f32_vec(), vals, "{d}");
            assert_eq!(t.size_in_bytes(), 5 * d.size_in_bytes());
        }
    }

    #[test]
    fn shape_errors_name_the_problem() {
        let e = Tensor::from_f32(&[2, 3], vec![0.0; 5]).unwrap_err().to_string();
        assert!(e.contains("[2, 3]") && e.contains("5 elements"), "{e}");
        let t = Tensor::zeros(&[2, 2], DType::BF16);
        assert!(t.as_f32().unwrap_err().to_string().contains("bf16"));
        assert!(t.clone().reshape(&[4]).is_ok());
        assert!(t.reshape(&[3]).is_err());
    }
}
