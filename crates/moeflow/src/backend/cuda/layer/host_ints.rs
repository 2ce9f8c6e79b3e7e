//! Ints from the host written into device memory in stream order by a kernel that takes them as
//! its parameters (`write_ints` in common.cu), where a copy from pageable host memory may make the
//! host wait for the stream and so hold back its next launches.

use super::{err, CudaMoeLayer};
use crate::error::Result;
use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};

/// Most ints one launch writes (`HOST_INTS` in common.cu): a plan's head for 32 ranks, a push's
/// lane table at EP 4.
pub(super) const HOST_INTS: usize = 256;

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
    /// `values` into the ints at device address `dst` on `stream`, after the work queued on it
    /// before, [`HOST_INTS`] a launch; the host does not wait. A CUDA graph captured around it
    /// replays the values it was captured with.
    pub(super) fn write_ints(&self, stream: &CudaStream, dst: u64, values: &[i32]) -> Result<()> {
        let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (64, 1, 1), shared_mem_bytes: 0 };
        for (i, part) in values.chunks(HOST_INTS).enumerate() {
            let mut ints = HostInts { n: part.len() as i32, v: [0; HOST_INTS] };
            ints.v[..part.len()].copy_from_slice(part);
            let at = dst + (4 * HOST_INTS * i) as u64;
            // SAFETY: write_ints(int*, HostInts) writes ints.n <= HOST_INTS ints at `at`, inside
            // the `values.len()` ints the caller sized `dst` for.
            unsafe { stream.launch_builder(&self.k.write_ints).arg(&at).arg(&ints).launch(cfg) }
                .map_err(|e| err("write_ints", e))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{HostInts, HOST_INTS};
    use crate::backend::cuda::kernel_define;
    use crate::backend::cuda::layer::{dptr, CudaMoeLayer};
    use crate::experts::Activation;
    use crate::router::RouterConfig;
    use crate::{preset, DType};

    /// The parameter is laid out as common.cu's `HostInts`: the count, then `HOST_INTS` ints.
    #[test]
    fn host_ints_mirror_common_cu() {
        assert_eq!(kernel_define("HOST_INTS"), Some(HOST_INTS as i64));
        assert_eq!(std::mem::size_of::<HostInts>(), 4 * (1 + HOST_INTS));
        assert_eq!(std::mem::offset_of!(HostInts, v), 4);
    }

    /// The ints land in stream order after the work queued before (a copy that poisons the
    /// buffer), in one launch or several, and the ints past them are left alone. Needs a GPU;
    /// says loudly when it skips.
    #[test]
    fn host_ints_land_in_stream_order() {
        if crate::backend::cuda::skip_without_gpu("host_ints_land_in_stream_order") {
            return;
        }
        let config = preset::config(32, 16, 8, 2, RouterConfig::TopKSoftmax, Activation::Silu, None);
        let weights = preset::random_weights(&config, DType::BF16, 5);
        let layer = CudaMoeLayer::new(&config, &weights, &Default::default()).unwrap();
        let s = &layer.gpu.stream;
        let room = 2 * HOST_INTS + 3;
        let mut buf = s.alloc_zeros::<i32>(room).unwrap();
        for n in [0, 1, 7, HOST_INTS, HOST_INTS + 1, 2 * HOST_INTS + 1] {
            let values: Vec<i32> = (0..n as i32).map(|i| i * 7919 - 3).collect();
            s.memcpy_htod(&vec![-5i32; room], &mut buf).unwrap();
            layer.write_ints(s, dptr(&buf, &layer.gpu), &values).unwrap();
            let got = s.clone_dtoh(&buf).unwrap();
            assert_eq!(&got[..n], &values[..], "{n} ints");
            assert!(got[n..].iter().all(|&v| v == -5), "{n} ints: the rest was touched");
        }
    }
}
