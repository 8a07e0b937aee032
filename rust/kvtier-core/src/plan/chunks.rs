//! Chunks: the byte ranges a transfer copies, planned from validated indices, checked against both
//! buffers, and executed with CPU `memcpy`.

use super::HostGeometry;
use crate::error::{Error, Result};

/// One contiguous copy: `len` bytes at `host_off` in the host buffer and `device_off` in layer `layer`'s
/// device tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Layer (index into the device tensors and the host buffer's layer dimension).
    pub layer: u32,
    /// Byte offset in the host buffer.
    pub host_off: u64,
    /// Byte offset in the device layer tensor.
    pub device_off: u64,
    /// Bytes.
    pub len: u64,
}

/// Plans the copies of `layers` for validated index lists: one chunk per maximal run where both the host
/// and device byte offsets advance by exactly one row. A chunk never crosses a multiple of `split` bytes on
/// the host side, counted from `origin` bytes before the buffer (pass the CUDA registration unit and the
/// buffer's offset inside its registered region, or `usize::MAX` and 0).
pub fn plan(
    geo: &HostGeometry,
    host: &[i64],
    device: &[i64],
    layers: std::ops::Range<usize>,
    split: usize,
    origin: usize,
) -> Vec<Chunk> {
    let row = geo.row_bytes as u64;
    let split = split.max(1) as u64;
    let origin = origin as u64;
    let mut out = Vec::new();
    for l in layers {
        let mut cur: Option<Chunk> = None;
        for (&h, &d) in host.iter().zip(device) {
            let ho = geo.offset(l, h as usize) as u64;
            let dof = d as u64 * row;
            if let Some(c) = cur.as_mut() {
                let same_split = (origin + c.host_off) / split == (origin + ho + row - 1) / split;
                if ho == c.host_off + c.len && dof == c.device_off + c.len && same_split {
                    c.len += row;
                    continue;
                }
                out.push(*c);
            }
            cur = Some(Chunk {
                layer: l as u32,
                host_off: ho,
                device_off: dof,
                len: row,
            });
        }
        out.extend(cur);
    }
    out
}

/// Direction of a copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Host buffer → device layer tensors (load).
    HostToDevice,
    /// Device layer tensors → host buffer (backup).
    DeviceToHost,
}

/// A raw byte range that the caller keeps alive and unaliased for the duration of a copy.
#[derive(Clone, Copy, Debug)]
pub struct RawRange {
    /// Base address.
    pub ptr: usize,
    /// Length in bytes.
    pub len: usize,
}

/// Checks that every chunk lies inside `host` and its layer's `device` range.
pub fn check_chunks(host: RawRange, device: &[RawRange], chunks: &[Chunk]) -> Result<()> {
    for (i, c) in chunks.iter().enumerate() {
        let dev = device.get(c.layer as usize).ok_or_else(|| {
            Error::arg(
                "layer_id",
                format!("chunk {i} names layer {} of {}", c.layer, device.len()),
            )
        })?;
        let host_end = c.host_off.checked_add(c.len);
        let dev_end = c.device_off.checked_add(c.len);
        if host_end.is_none_or(|e| e > host.len as u64)
            || dev_end.is_none_or(|e| e > dev.len as u64)
        {
            return Err(Error::arg(
                "indices",
                format!(
                    "chunk {i} {c:?} falls outside its buffers (host {} B, device {} B)",
                    host.len, dev.len
                ),
            ));
        }
    }
    Ok(())
}

/// `(source, destination, len)` addresses of every chunk for `dir`.
pub fn addresses(
    dir: Direction,
    host: RawRange,
    device: &[RawRange],
    chunks: &[Chunk],
) -> Vec<(usize, usize, usize)> {
    chunks
        .iter()
        .map(|c| {
            let h = host.ptr + c.host_off as usize;
            let d = device[c.layer as usize].ptr + c.device_off as usize;
            match dir {
                Direction::HostToDevice => (h, d, c.len as usize),
                Direction::DeviceToHost => (d, h, c.len as usize),
            }
        })
        .collect()
}

/// Executes `chunks` with CPU `memcpy`, after checking every chunk against the ranges.
///
/// # Safety
/// `host` and every entry of `device` must be live, writable (on the destination side) allocations of at
/// least their stated length for the whole call, and the host range must not overlap any device range.
pub unsafe fn copy_cpu(
    dir: Direction,
    host: RawRange,
    device: &[RawRange],
    chunks: &[Chunk],
) -> Result<()> {
    check_chunks(host, device, chunks)?;
    for (src, dst, len) in addresses(dir, host, device, chunks) {
        // both ranges were checked above to lie inside live allocations (caller contract), and the
        // host and device allocations do not overlap, so source and destination are disjoint.
        // SAFETY: both ranges are checked in bounds and are disjoint.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) };
    }
    Ok(())
}
