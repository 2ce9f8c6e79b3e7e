//! Sizes checked before anything is allocated: byte counts computed without overflow and
//! compared with the memory this machine has, so an impossible request is a clear error
//! instead of a hang, a panic or an aborted process.

use crate::error::{MoeError, Result};

/// Requests below this size are not compared with the machine's memory (reading it costs a
/// file read; small buffers always fit or fail elsewhere).
const CHECK_ABOVE: u128 = 256 << 20;

/// `elem` bytes times the product of `dims`, without overflow (saturates at `u128::MAX`).
pub fn bytes(dims: &[usize], elem: usize) -> u128 {
    dims.iter().fold(elem as u128, |acc, &d| acc.saturating_mul(d as u128))
}

/// `bytes` as a readable size: the exact count and its GiB.
pub fn human(bytes: u128) -> String {
    if bytes >= u64::MAX as u128 {
        return "more than 2^64 bytes".into();
    }
    format!("{bytes} bytes ({:.1} GiB)", bytes as f64 / (1u64 << 30) as f64)
}

/// Bytes of memory available to new allocations on this machine (Linux `MemAvailable`), if
/// known.
pub fn available() -> Option<u128> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u128 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Refuses `bytes` for `what` when no allocation can hold them (more than `isize::MAX`) or
/// when they exceed the memory this machine has available.
pub fn ensure(what: &str, bytes: u128) -> Result<()> {
    if bytes > isize::MAX as u128 {
        return Err(MoeError::OutOfMemory { what: what.into(), needed: bytes, available: None });
    }
    if bytes < CHECK_ABOVE {
        return Ok(());
    }
    match available() {
        Some(avail) if bytes > avail => {
            Err(MoeError::OutOfMemory { what: what.into(), needed: bytes, available: Some(avail) })
        }
        _ => Ok(()),
    }
}

/// As [`ensure`] for an array of `dims` elements of `elem` bytes; returns the element count.
pub fn ensure_elems(what: &str, dims: &[usize], elem: usize) -> Result<usize> {
    ensure(what, bytes(dims, elem))?;
    Ok(dims.iter().product())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_saturate_instead_of_wrapping() {
        assert_eq!(bytes(&[3, 5], 4), 60);
        assert_eq!(bytes(&[usize::MAX, usize::MAX, 4], 4), u128::MAX);
        assert_eq!(human(u128::MAX), "more than 2^64 bytes");
        assert!(human(136_000_000_004).starts_with("136000000004 bytes (126.7 GiB"));
    }

    #[test]
    fn impossible_requests_are_refused_and_small_ones_pass() {
        ensure("a small buffer", 1 << 20).unwrap();
        let e = ensure("the test buffer", bytes(&[usize::MAX, 2], 4)).unwrap_err().to_string();
        assert!(e.contains("the test buffer") && e.contains("2^64"), "{e}");
        assert_eq!(ensure_elems("three", &[3], 4).unwrap(), 3);
        if let Some(avail) = available() {
            let e = ensure("twice this machine", 2 * avail).unwrap_err().to_string();
            assert!(e.contains("twice this machine") && e.contains("available"), "{e}");
        }
    }
}
