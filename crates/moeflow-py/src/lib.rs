//! `moeflow._moeflow`: the Rust half of the Python package `moeflow` (see `python/moeflow`).
//!
//! `layer::Layer` runs one MoE block, `expert_parallel::ExpertParallel` dispatches rows to
//! their experts and combines the results for experts the caller computes,
//! `world::World` joins the ranks of a launched job. Tensors come in and go out through
//! DLPack (`tensors`); library errors become Python exceptions (`errors`).

mod errors;
mod expert_parallel;
mod layer;
mod options;
mod tensors;
mod world;

use pyo3::prelude::*;

/// The extension's Rust allocations go to mimalloc, which keeps freed memory for reuse: a CPU
/// layer's row buffers of one call would otherwise be mapped afresh and faulted in page by page
/// on every call, as in the command line (docs/tuning.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[pymodule]
fn _moeflow(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<layer::Layer>()?;
    m.add_class::<expert_parallel::ExpertParallel>()?;
    m.add_class::<expert_parallel::DispatchHandle>()?;
    m.add_class::<options::Options>()?;
    m.add_class::<world::World>()?;
    m.add_class::<tensors::HostBuffer>()?;
    m.add_function(wrap_pyfunction!(tensors::dlpack_data_ptr, m)?)?;
    m.add("CommunicationError", m.py().get_type::<errors::CommunicationError>())?;
    m.add("cuda_build", cfg!(feature = "cuda"))?;
    Ok(())
}
