//! A few ints from the host written into device memory in stream order by a kernel that takes
//! them as its parameters (`write_ints` in moe.cu), where a copy from pageable host memory may
//! make the host wait for the stream and so hold back its next launches.

use super::{err, CudaMoeLayer};
use crate::error::{MoeError, Result};
use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};

/// Most ints one launch writes (`HOST_INTS` in moe.cu): a plan's head for 32 ranks.
const HOST_INTS: usize = 66;

/// The kernel's parameter: `n` values, then room for the rest.
#[repr(C)]
#[derive(Clone, Copy)]
struct HostInts {
    n: i32,
    v: [i32; HOST_INTS],
}

// SAFETY: HostInts is plain old data laid out as the C struct `write_ints` takes by value
// (#[repr(C)]: 1 + HOST_INTS i32, no padding).
unsafe impl cudarc::driver::DeviceRepr for HostInts {}

impl CudaMoeLayer {
    /// `values` (at most [`HOST_INTS`]) into the ints at device address `dst` on `stream`, after
    /// the work queued on it before; the host does not wait.
    pub(super) fn write_ints(&self, stream: &CudaStream, dst: u64, values: &[i32]) -> Result<()> {
        if values.len() > HOST_INTS {
            return Err(MoeError::Unsupported(format!(
                "{} ints from the host in one launch (at most {HOST_INTS})",
                values.len()
            )));
        }
        let mut ints = HostInts { n: values.len() as i32, v: [0; HOST_INTS] };
        ints.v[..values.len()].copy_from_slice(values);
        let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (64, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: write_ints(int*, HostInts) writes ints.n <= HOST_INTS ints at `dst`, which the
        // caller sized for `values`.
        unsafe { stream.launch_builder(&self.k.write_ints).arg(&dst).arg(&ints).launch(cfg) }
            .map(|_| ())
            .map_err(|e| err("write_ints", e))
    }
}
