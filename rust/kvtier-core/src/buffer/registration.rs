//! Registration with the CUDA driver: a region pinned in chunks that no page straddles, and unpinned
//! again (before it is unmapped).

use super::{HostRegion, Progress};
use crate::error::{Error, Result};

impl HostRegion {
    /// Registers the region with the CUDA driver in chunks of at most `max_chunk` bytes whose boundaries are
    /// multiples of `granularity` (so no page of that size straddles two registrations), using up to
    /// `threads` threads, on CUDA device ordinal `device` (registrations are portable to every context). Returns the number of chunks. Registering twice is an error.
    pub fn register_cuda(
        &self,
        device: i32,
        granularity: usize,
        max_chunk: usize,
        threads: usize,
        progress: Option<&Progress>,
    ) -> Result<usize> {
        let chunks = registration_chunks(self.len, granularity, max_chunk)?;
        let mut regs = self.registrations.lock().unwrap_or_else(|p| p.into_inner());
        if !regs.is_empty() {
            return Err(Error::arg("pin", "region is already registered with CUDA"));
        }
        let n = chunks.len();
        if let Some(p) = progress {
            p.start(self.len);
        }
        *regs = crate::cuda::register_ranges(device, self.as_ptr(), &chunks, threads, progress)?;
        Ok(n)
    }

    /// Undoes [`Self::register_cuda`]; a no-op when not registered.
    pub fn unregister_cuda(&self) -> Result<()> {
        let mut regs = self.registrations.lock().unwrap_or_else(|p| p.into_inner());
        let all = std::mem::take(&mut *regs);
        crate::cuda::unregister_all(all)
    }

    /// `(offset, len)` of each CUDA registration, empty when unpinned.
    pub fn registered_chunks(&self) -> Vec<(usize, usize)> {
        let regs = self.registrations.lock().unwrap_or_else(|p| p.into_inner());
        let base = self.as_ptr() as usize;
        regs.iter().map(|r| (r.addr() - base, r.len())).collect()
    }
}

/// Splits `[0, len)` into chunks of at most `max_chunk` bytes whose boundaries are multiples of
/// `granularity`. The last chunk takes the remainder.
pub fn registration_chunks(
    len: usize,
    granularity: usize,
    max_chunk: usize,
) -> Result<Vec<(usize, usize)>> {
    if granularity == 0 {
        return Err(Error::arg("granularity", "must be positive, got 0"));
    }
    if max_chunk < granularity {
        return Err(Error::arg(
            "register_chunk_bytes",
            format!("{max_chunk} is smaller than one page of {granularity} bytes"),
        ));
    }
    let step = max_chunk / granularity * granularity;
    let mut out = Vec::with_capacity(len.div_ceil(step));
    let mut off = 0;
    while off < len {
        let n = step.min(len - off);
        out.push((off, n));
        off += n;
    }
    Ok(out)
}
