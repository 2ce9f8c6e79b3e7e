//! [`World`]: this process's place among the ranks of a launched job (torchrun or
//! `moeflow launch`), connected to the others: over TCP for CPU ranks, NCCL for GPU ranks.
//! The Python side reads the launcher's variables and hands them in; the library reads none.

use crate::errors::{bad_input, IntoPy};
use moeflow::comm::{Communicator, LaunchEnv, TcpComm};
use pyo3::prelude::*;
use std::collections::HashMap;

/// The ranks of a launched job, as seen from this one.
#[pyclass(frozen, module = "moeflow._moeflow")]
pub struct World {
    pub comm: Box<dyn Communicator>,
    pub env: LaunchEnv,
    pub gpu: bool,
}

#[pymethods]
impl World {
    /// Joins the job that the launcher variables `vars` (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
    /// `MASTER_ADDR`, `MASTER_PORT`, `MOEFLOW_JOB`, `MOEFLOW_BIND`) describe: over NCCL on GPU
    /// `LOCAL_RANK` with `gpu`, else over TCP. Waits at most `timeout` seconds for the others.
    #[new]
    #[pyo3(signature = (vars, *, gpu=false, timeout=60.0))]
    fn new(py: Python<'_>, vars: HashMap<String, String>, gpu: bool, timeout: f64) -> PyResult<Self> {
        let env = LaunchEnv::from_vars(|k| vars.get(k).cloned()).py_err()?.ok_or_else(|| {
            bad_input("RANK and WORLD_SIZE are not set: this process is not a rank of a launched job")
        })?;
        let timeout = std::time::Duration::try_from_secs_f64(timeout)
            .ok()
            .filter(|t| !t.is_zero())
            .ok_or_else(|| bad_input(format!("timeout {timeout} is not a positive number of seconds")))?;
        let comm = py.detach(|| connect(&env, gpu, timeout)).py_err()?;
        Ok(World { comm, env, gpu })
    }

    /// This process's rank.
    #[getter]
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Number of ranks.
    #[getter]
    fn size(&self) -> usize {
        self.comm.size()
    }

    /// `LOCAL_RANK`: the GPU of this host this rank uses.
    #[getter]
    fn local_rank(&self) -> usize {
        self.env.local_rank
    }

    /// Whether the ranks talk over NCCL (GPU ranks) rather than TCP.
    #[getter]
    fn gpu(&self) -> bool {
        self.gpu
    }

    /// Returns when every rank has called it (or raises `CommunicationError` at the deadline).
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.comm.barrier()).py_err()
    }

    /// Fails the job: every rank's pending and later collectives raise `CommunicationError`
    /// naming `reason`.
    fn abort(&self, reason: &str) {
        self.comm.abort(reason)
    }
}

impl World {
    /// Fails the job when `result` is an error (bad input refused before any communication
    /// included), so the other ranks raise at once, naming this rank and the reason.
    pub fn fail_on_error<T>(&self, result: PyResult<T>, py: Python<'_>) -> PyResult<T> {
        if let Err(e) = &result {
            self.comm.abort(&format!("rank {} failed: {}", self.comm.rank(), e.value(py)));
        }
        result
    }

    /// Runs `f` on this rank: an error fails the whole job, so the other ranks stop waiting for
    /// this one and raise an error naming it.
    pub fn guard<T>(&self, f: impl FnOnce() -> moeflow::Result<T>) -> moeflow::Result<T> {
        let result = f();
        if let Err(e) = &result {
            self.comm.abort(&format!("rank {} failed: {e}", self.comm.rank()));
        }
        result
    }
}

fn connect(env: &LaunchEnv, gpu: bool, timeout: std::time::Duration) -> moeflow::Result<Box<dyn Communicator>> {
    if gpu {
        nccl(env, timeout)
    } else {
        Ok(Box::new(TcpComm::from_env(env, timeout)?))
    }
}

#[cfg(feature = "cuda")]
fn nccl(env: &LaunchEnv, timeout: std::time::Duration) -> moeflow::Result<Box<dyn Communicator>> {
    Ok(Box::new(moeflow::backend::cuda::NcclComm::from_env(env, timeout)?))
}

#[cfg(not(feature = "cuda"))]
fn nccl(_env: &LaunchEnv, _timeout: std::time::Duration) -> moeflow::Result<Box<dyn Communicator>> {
    Err(moeflow::MoeError::Unsupported(
        "GPU ranks need the package built with the `cuda` feature (maturin build --features cuda)".into(),
    ))
}
