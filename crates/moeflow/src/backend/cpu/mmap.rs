//! Read-only memory maps of checkpoint files.

use crate::error::{MoeError, Result};
use memmap2::Mmap;
use std::path::Path;

/// Maps `path` read-only; pages are read from disk only when touched.
pub fn map_file(path: &Path) -> Result<Mmap> {
    let file = std::fs::File::open(path)
        .map_err(|e| MoeError::Io { context: format!("opening {}", path.display()), source: e })?;
    let meta =
        file.metadata().map_err(|e| MoeError::Io { context: format!("reading {}", path.display()), source: e })?;
    if !meta.is_file() {
        return Err(MoeError::Io {
            context: format!("opening {}", path.display()),
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not a regular file (a directory or a device?)",
            ),
        });
    }
    // SAFETY: the map is read-only and checkpoints are not modified while moeflow reads them;
    // a file truncated underneath would fault, as with any reader of mapped checkpoints.
    unsafe { Mmap::map(&file) }.map_err(|e| MoeError::Io { context: format!("mapping {}", path.display()), source: e })
}
