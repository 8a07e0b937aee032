//! Copies: `cuMemcpyBatchAsync_v2` in batches of [`batch_limit`] descriptors where the driver has it,
//! `cuMemcpyAsync` otherwise.

use std::ffi::c_void;

use super::context::Current;
use super::driver::{check, driver, CuMemLocation, CuMemcpyAttributes};
use crate::error::Result;

const CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: u32 = 0x1;
const CUDA_ERROR_NOT_SUPPORTED: i32 = 801;
const CUDA_ERROR_INVALID_VALUE: i32 = 1;
/// Ask the driver to keep batched copies on the copy engines rather than SM copy kernels, so they overlap
/// with compute instead of competing with it.
const CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE: u32 = 0x1;
/// Flags in use: starts with PREFER_OVERLAP_WITH_COMPUTE, drops to 0 if a driver rejects it.
static BATCH_FLAGS: std::sync::atomic::AtomicU32 =
    std::sync::atomic::AtomicU32::new(CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE);
/// Descriptors per `cuMemcpyBatchAsync` call by default; larger submissions are split. Measured on an H200
/// (benches/RESULTS.md, "copy-engine cost per chunk"): all-layer device-to-host backups of 64–128 KiB chunks
/// ran at 71–80 % of the PCIe ceiling as one 8,192-copy batch per side and at 93–96 % in batches of 256 to
/// 1,024. Adjustable with [`set_batch_limit`] (benches).
const BATCH_LIMIT: usize = 1024;
static BATCH_LIMIT_NOW: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(BATCH_LIMIT);

/// How a batch of copies was submitted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Submitted {
    /// Copies submitted.
    pub copies: usize,
    /// `cuMemcpyBatchAsync` calls made (0 when every copy went through `cuMemcpyAsync`).
    pub batch_calls: usize,
}

static BATCH_UNSUPPORTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The `CUmemcpyFlags` batched copies use now (1 = prefer copy engines, 0 after a driver rejected that).
pub fn batch_flags() -> u32 {
    BATCH_FLAGS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Descriptors per `cuMemcpyBatchAsync` call now.
pub fn batch_limit() -> usize {
    BATCH_LIMIT_NOW.load(std::sync::atomic::Ordering::Relaxed)
}

/// Sets the descriptors per `cuMemcpyBatchAsync` call (at least 1; the default is 1,024). Returns the
/// previous value. For benches that measure how the batch size changes throughput.
pub fn set_batch_limit(limit: usize) -> usize {
    BATCH_LIMIT_NOW.swap(limit.max(1), std::sync::atomic::Ordering::Relaxed)
}

/// True when this process can submit copies with `cuMemcpyBatchAsync_v2`.
pub fn batch_supported() -> bool {
    driver().is_ok_and(|d| d.batch_v2.is_some())
        && !BATCH_UNSUPPORTED.load(std::sync::atomic::Ordering::Relaxed)
}

impl Current {
    /// Enqueues `copies` (`(src, dst, len)` addresses, host or device, unified addressing) on `stream`:
    /// one `cuMemcpyBatchAsync_v2` per [`batch_limit`] copies where the driver has it and the stream is not
    /// the legacy NULL stream (which the batch API rejects), else one `cuMemcpyAsync` each. Returns once
    /// submitted; completion is stream-ordered.
    ///
    /// # Safety
    /// Every range must be valid for the copy (device memory, or host memory registered with CUDA or
    /// allocated pinned, or pageable host memory for `cuMemcpyAsync`), stay alive until the stream reaches
    /// the copies, and destinations must not overlap each other or any source. `stream` must be a live
    /// stream of this context (or 0).
    pub unsafe fn copy_async(
        &self,
        stream: usize,
        copies: &[(usize, usize, usize)],
        batch: bool,
    ) -> Result<Submitted> {
        let d = self.d;
        let mut out = Submitted {
            copies: copies.len(),
            batch_calls: 0,
        };
        if copies.is_empty() {
            return Ok(out);
        }
        let hstream = stream as *mut c_void;
        let use_batch =
            batch && stream != 0 && !BATCH_UNSUPPORTED.load(std::sync::atomic::Ordering::Relaxed);
        if let (true, Some(batch_fn)) = (use_batch, d.batch_v2) {
            let mut attrs = CuMemcpyAttributes {
                src_access_order: CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                src_loc_hint: CuMemLocation { ty: 0, id: 0 },
                dst_loc_hint: CuMemLocation { ty: 0, id: 0 },
                flags: BATCH_FLAGS.load(std::sync::atomic::Ordering::Relaxed),
            };
            let mut done = 0;
            let mut retried = false;
            let limit = batch_limit();
            let mut parts = copies.chunks(limit).peekable();
            while let Some(part) = parts.next() {
                let mut srcs: Vec<u64> = part.iter().map(|c| c.0 as u64).collect();
                let mut dsts: Vec<u64> = part.iter().map(|c| c.1 as u64).collect();
                let mut sizes: Vec<usize> = part.iter().map(|c| c.2).collect();
                let mut attr_idx = 0usize;
                // the arrays hold `part.len()` entries and live across the call (the driver reads
                // them during submission only); the ranges are valid per this function's contract.
                // SAFETY: the arrays outlive the call; the ranges are valid per the contract.
                let rc = unsafe {
                    batch_fn(
                        dsts.as_mut_ptr(),
                        srcs.as_mut_ptr(),
                        sizes.as_mut_ptr(),
                        part.len(),
                        &mut attrs,
                        &mut attr_idx,
                        1,
                        hstream,
                    )
                };
                if rc == CUDA_ERROR_INVALID_VALUE && done == 0 && attrs.flags != 0 {
                    // Perhaps a driver that does not know the overlap flag: retry this part without it, and
                    // drop the flag for good only if that retry succeeds (else the copies themselves are bad).
                    attrs.flags = 0;
                    retried = true;
                    parts = copies.chunks(limit).peekable();
                    continue;
                }
                if retried && rc == 0 && done == 0 {
                    BATCH_FLAGS.store(0, std::sync::atomic::Ordering::Relaxed);
                }
                if rc == CUDA_ERROR_NOT_SUPPORTED && done == 0 {
                    BATCH_UNSUPPORTED.store(true, std::sync::atomic::Ordering::Relaxed);
                    break;
                }
                check("cuMemcpyBatchAsync_v2", rc, || {
                    format!(" ({} copies)", part.len())
                })?;
                out.batch_calls += 1;
                done += part.len();
            }
            if done == copies.len() {
                return Ok(out);
            }
        }
        for (i, &(src, dst, len)) in copies.iter().enumerate() {
            // SAFETY: the range is valid per this function's contract.
            let rc = unsafe { (d.memcpy_async)(dst as u64, src as u64, len, hstream) };
            check("cuMemcpyAsync", rc, || {
                format!(" (copy {i}: {len} bytes {src:#x} -> {dst:#x})")
            })?;
        }
        Ok(out)
    }
}
