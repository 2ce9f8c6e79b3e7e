//! Tensors in and out through DLPack (`dlpark`): any object with `__dlpack__` (`torch.Tensor`,
//! `numpy.ndarray`, ...) is read in place, and results leave as a [`HostBuffer`] that hands
//! its memory to the caller's library (`torch.from_dlpack`, `numpy.from_dlpack`) without a copy.

use crate::errors::bad_input;
use dlpark::ffi::{DLDataType, DLDevice, DLDeviceType, DLManagedTensor, DLManagedTensorVersioned};
use dlpark::metadata::Dynamic;
use dlpark::python::{export_dlpack, from_dlpack, DlpackExporter, ExportRequest, ImportedDlpack};
use dlpark::{DlpackElement, DlpackFlags, ManagedTensorBase};
use half::{bf16, f16};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use std::sync::Arc;

/// A tensor imported from Python: the producer's memory stays alive and unmoved while this
/// lives.
pub struct Imported {
    tensor: ImportedDlpack,
    what: &'static str,
}

/// Rows of floating-point values, borrowed from an [`Imported`] tensor.
pub enum Floats<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// bf16 values.
    BF16(&'a [bf16]),
    /// f16 values.
    F16(&'a [f16]),
}

impl Floats<'_> {
    /// The values widened to f32 (a copy).
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            Floats::F32(v) => v.to_vec(),
            Floats::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
            Floats::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }

    /// The element type's name.
    pub fn dtype(&self) -> &'static str {
        match self {
            Floats::F32(_) => "float32",
            Floats::BF16(_) => "bfloat16",
            Floats::F16(_) => "float16",
        }
    }
}

fn dtype_name(d: DLDataType) -> String {
    let kind = match d.code.0 {
        0 => "int",
        1 => "uint",
        2 => "float",
        4 => "bfloat",
        5 => "complex",
        6 => "bool",
        _ => "code-",
    };
    let lanes = if d.lanes == 1 { String::new() } else { format!("x{}", d.lanes) };
    format!("{kind}{}{lanes}", d.bits)
}

fn device_name(d: DLDevice) -> String {
    match d.device_type {
        DLDeviceType::CPU => "cpu".into(),
        DLDeviceType::CUDA => format!("cuda:{}", d.device_id),
        DLDeviceType::CUDAHOST => "cuda pinned host memory".into(),
        DLDeviceType::CUDAMANAGED => format!("cuda managed memory (device {})", d.device_id),
        t => format!("DLPack device type {} (id {})", t.0, d.device_id),
    }
}

impl Imported {
    /// Imports `obj` through its `__dlpack__` (no copy); `what` names it in errors.
    pub fn new(obj: &Bound<'_, PyAny>, what: &'static str) -> PyResult<Self> {
        if !obj.hasattr("__dlpack__")? {
            return Err(PyTypeError::new_err(format!(
                "{what}: expected a tensor that speaks DLPack (torch.Tensor, numpy.ndarray, ...), got {}",
                obj.get_type().name()?
            )));
        }
        let tensor = from_dlpack(obj.as_borrowed(), None, None)?;
        let imported = Imported { tensor, what };
        let t = imported.view()?;
        let device = t.device();
        if !matches!(device.device_type, DLDeviceType::CPU | DLDeviceType::CUDAHOST) {
            return Err(bad_input(format!(
                "{what} is on {}; this call reads host memory (CPU tensors)",
                device_name(device)
            )));
        }
        if !t.is_compact().map_err(|e| bad_input(format!("{what}: {e}")))? {
            return Err(bad_input(format!(
                "{what} is not contiguous (shape {:?}, strides {:?}); moeflow reads tensors in place and does not \
                 copy them: pass x.contiguous() (torch) or numpy.ascontiguousarray(x)",
                t.shape(),
                t.strides().unwrap_or_default()
            )));
        }
        Ok(imported)
    }

    fn view(&self) -> PyResult<dlpark::TensorRef<'_>> {
        self.tensor.validate().map_err(|e| bad_input(format!("{}: {e}", self.what)))
    }

    /// The shape as `[rows, cols]`, checking it is 2-D with `cols` columns when given.
    pub fn matrix(&self, cols: Option<usize>, expected: &str) -> PyResult<(usize, usize)> {
        let shape = self.view()?.shape().to_vec();
        match shape[..] {
            [r, c] if cols.is_none_or(|w| w as i64 == c) => Ok((r as usize, c as usize)),
            _ => Err(bad_input(format!("{}: expected shape {expected}, got {shape:?}", self.what))),
        }
    }

    /// The shape.
    pub fn shape(&self) -> PyResult<Vec<usize>> {
        Ok(self.view()?.shape().iter().map(|&d| d as usize).collect())
    }

    /// Data address, for tests that check nothing was copied.
    pub fn data_ptr(&self) -> PyResult<usize> {
        let t = self.view()?;
        Ok(t.data_ptr() as usize + t.byte_offset() as usize)
    }

    fn slice<T: DlpackElement>(&self) -> PyResult<&[T]> {
        let t = self.view()?;
        // SAFETY: the tensor is a validated, compact host tensor of `T` (dtype checked by the
        // callers below), and `self.tensor` keeps the producer's memory alive for `&self`.
        unsafe { t.cpu_slice::<T>() }.map_err(|e| bad_input(format!("{}: {e}", self.what)))
    }

    /// The values as floats (f32, bf16 or f16), in place.
    pub fn floats(&self) -> PyResult<Floats<'_>> {
        match self.view()?.dtype() {
            d if d == DLDataType::F32 => Ok(Floats::F32(self.slice()?)),
            d if d == DLDataType::BF16 => Ok(Floats::BF16(self.slice()?)),
            d if d == DLDataType::F16 => Ok(Floats::F16(self.slice()?)),
            d => Err(bad_input(format!(
                "{}: dtype {} is not one moeflow takes (float32, bfloat16 or float16)",
                self.what,
                dtype_name(d)
            ))),
        }
    }

    /// The values as f32, in place.
    pub fn f32s(&self) -> PyResult<&[f32]> {
        match self.floats()? {
            Floats::F32(v) => Ok(v),
            other => Err(bad_input(format!("{}: expected float32, got {}", self.what, other.dtype()))),
        }
    }

    /// Integer values (int32 or int64) as i32, checked to fit.
    pub fn ids(&self) -> PyResult<Vec<i32>> {
        match self.view()?.dtype() {
            d if d == DLDataType::I32 => Ok(self.slice::<i32>()?.to_vec()),
            d if d == DLDataType::I64 => self
                .slice::<i64>()?
                .iter()
                .map(|&v| i32::try_from(v).map_err(|_| bad_input(format!("{}: id {v} is out of range", self.what))))
                .collect(),
            d => Err(bad_input(format!("{}: expected int32 or int64, got {}", self.what, dtype_name(d)))),
        }
    }

    /// A moeflow tensor holding a copy of the values in their own dtype (weights).
    pub fn to_tensor(&self) -> PyResult<moeflow::Tensor> {
        use moeflow::tensor::CpuStorage;
        let shape = self.shape()?;
        let storage = match self.floats()? {
            Floats::F32(v) => CpuStorage::F32(v.to_vec()),
            Floats::BF16(v) => CpuStorage::BF16(v.to_vec()),
            Floats::F16(v) => CpuStorage::F16(v.to_vec()),
        };
        moeflow::Tensor::new(&shape, storage).map_err(crate::errors::to_py)
    }
}

/// Host memory owned by moeflow, one element type.
pub enum HostData {
    /// f32 values.
    F32(Vec<f32>),
    /// bf16 values.
    BF16(Vec<bf16>),
    /// f16 values.
    F16(Vec<f16>),
    /// int64 values.
    I64(Vec<i64>),
}

impl HostData {
    fn parts(&self) -> (*const u8, DLDataType, usize) {
        match self {
            HostData::F32(v) => (v.as_ptr().cast(), DLDataType::F32, v.len()),
            HostData::BF16(v) => (v.as_ptr().cast(), DLDataType::BF16, v.len()),
            HostData::F16(v) => (v.as_ptr().cast(), DLDataType::F16, v.len()),
            HostData::I64(v) => (v.as_ptr().cast(), DLDataType::I64, v.len()),
        }
    }

    /// f32 `values` rounded to the float type of `like` (f32 stays as it is, no copy).
    pub fn floats_like(values: Vec<f32>, like: &Floats<'_>) -> HostData {
        match like {
            Floats::F32(_) => HostData::F32(values),
            Floats::BF16(_) => HostData::BF16(values.iter().map(|&x| bf16::from_f32(x)).collect()),
            Floats::F16(_) => HostData::F16(values.iter().map(|&x| f16::from_f32(x)).collect()),
        }
    }
}

/// A result in host memory that moeflow produced: a DLPack producer (`__dlpack__`,
/// `__dlpack_device__`) whose every export shares this memory (no copy).
#[pyclass(frozen, module = "moeflow._moeflow")]
pub struct HostBuffer {
    data: Arc<HostData>,
    shape: Vec<i64>,
}

impl HostBuffer {
    /// `data` viewed as `shape` (row-major; the element count must match).
    pub fn new(data: HostData, shape: &[usize]) -> PyResult<Self> {
        let n: usize = shape.iter().product();
        if n != data.parts().2 {
            return Err(bad_input(format!("{} values for shape {shape:?}", data.parts().2)));
        }
        Ok(HostBuffer { data: Arc::new(data), shape: shape.iter().map(|&d| d as i64).collect() })
    }

    fn export<M: ManagedTensorBase>(&self) -> PyResult<dlpark::Managed<M>> {
        let (ptr, dtype, _) = self.data.parts();
        let prepared = Dynamic::compact(self.shape.clone())
            .prepare_as::<M>()
            .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.to_string()))?;
        let mut init = prepared.initialize(Arc::clone(&self.data));
        init.set_data(ptr as *mut std::ffi::c_void).set_dtype(dtype).set_device(DLDevice::CPU);
        // SAFETY: the data pointer, dtype and compact shape describe `self.data`, which the
        // managed tensor's context (an `Arc` of it) keeps alive until the consumer drops it.
        // moeflow never touches the values again, so consumers may write to them.
        Ok(unsafe { init.finish() })
    }
}

impl DlpackExporter for HostBuffer {
    fn device(&self) -> DLDevice {
        DLDevice::CPU
    }

    fn flags(&self) -> DlpackFlags {
        DlpackFlags::empty()
    }

    fn prepare_export(&self, _py: Python<'_>, _request: &ExportRequest<'_>) -> PyResult<()> {
        Ok(())
    }

    fn export_legacy(&self, _py: Python<'_>) -> PyResult<dlpark::Managed<DLManagedTensor>> {
        self.export()
    }

    fn export_versioned(&self, _py: Python<'_>) -> PyResult<dlpark::Managed<DLManagedTensorVersioned>> {
        self.export()
    }
}

#[pymethods]
impl HostBuffer {
    /// A DLPack capsule of this memory (the Python array API's `__dlpack__`).
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<Bound<'_, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let request = ExportRequest::parse(stream.as_ref(), max_version, dl_device, copy)?;
        export_dlpack(self, py, request)
    }

    /// `(1, 0)`: host memory.
    fn __dlpack_device__(&self) -> (u32, i32) {
        (DLDeviceType::CPU.0, 0)
    }

    /// The shape.
    #[getter]
    fn shape(&self) -> Vec<i64> {
        self.shape.clone()
    }

    /// Address of the first element (every export points there).
    #[getter]
    fn data_ptr(&self) -> usize {
        self.data.parts().0 as usize
    }
}

/// The address `obj`'s DLPack export points at (where moeflow reads it), for tests that check
/// that nothing was copied.
#[pyfunction]
pub fn dlpack_data_ptr(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    Imported::new(obj, "tensor")?.data_ptr()
}
