//! Data files: one per size class, fixed-size slots; block allocation (`fallocate`), hole punching (and
//! `PageStore::punch_slots`, which gives free slots' blocks back), the O_DIRECT probe and object IO with
//! its buffered fallback.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use std::sync::atomic::Ordering;

use super::disk::open_rw;
use crate::error::Error;
use crate::fault;
use crate::store::ALIGN;

/// One size class's data file.
pub(in crate::store) struct ClassFile {
    pub(in crate::store) buffered: File,
    pub(in crate::store) direct: Option<File>,
    pub(in crate::store) path: PathBuf,
}

impl ClassFile {
    /// Opens (creating when `writable`) the file of `class` in `dir`.
    pub(in crate::store) fn open(
        dir: &Path,
        class: u32,
        direct: bool,
        writable: bool,
    ) -> std::io::Result<Self> {
        let path = dir.join(format!("class-{class}.dat"));
        let buffered = if writable {
            let f = open_rw(&path, 0)?;
            // The file's name must be as durable as the objects acknowledged in it. Synced at every open of
            // the file (once per class and open store), not only when it was created: an open whose sync
            // failed created the file and failed, and the next open must not take the name as durable.
            super::disk::sync_dir(dir)?;
            f
        } else {
            File::open(&path)?
        };
        let direct = if direct && writable {
            Some(open_rw(&path, libc::O_DIRECT)?)
        } else {
            None
        };
        Ok(Self {
            buffered,
            direct,
            path,
        })
    }

    /// Writes `bytes` at `off`: O_DIRECT when memory, length and offset are aligned; buffered IO otherwise,
    /// and when the file system refuses this O_DIRECT write with EINVAL.
    pub(in crate::store) fn write(&self, bytes: &[u8], off: u64) -> std::io::Result<()> {
        if let Some(d) = &self.direct {
            if aligned(bytes.as_ptr() as usize, bytes.len(), off) {
                match d.write_all_at(bytes, off) {
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                    r => return r,
                }
            }
        }
        self.buffered.write_all_at(bytes, off)
    }

    /// Writes an object into its slot at `off` (a multiple of 4096, the slot at least the object rounded up
    /// to 4096) in whole pages: its last partial page is copied into a page padded with zeros. A buffered
    /// write of part of a page that is not cached reads the page from the disk first (a full store's
    /// slots, reused, are mostly not cached once the data outgrows the page cache); a whole page is
    /// written without reading. The padding lies inside the slot, which no live record names (R2).
    pub(in crate::store) fn write_object(&self, bytes: &[u8], off: u64) -> std::io::Result<()> {
        let head = bytes.len() / ALIGN as usize * ALIGN as usize;
        if head == bytes.len() {
            return self.write(bytes, off);
        }
        // buffered, as an object of this length always was: the kernel merges the batch's pages into large
        // writes at the fdatasync (one O_DIRECT write per object would not be merged)
        if head > 0 {
            self.buffered.write_all_at(&bytes[..head], off)?;
        }
        let mut page = [0u8; ALIGN as usize];
        page[..bytes.len() - head].copy_from_slice(&bytes[head..]);
        self.buffered.write_all_at(&page, off + head as u64)
    }

    /// Reads `buf.len()` bytes at `off` (O_DIRECT as [`ClassFile::write`]).
    pub(in crate::store) fn read(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        if let Some(d) = &self.direct {
            if aligned(buf.as_ptr() as usize, buf.len(), off) {
                match d.read_exact_at(buf, off) {
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                    r => return r,
                }
            }
        }
        self.buffered.read_exact_at(buf, off)
    }

    /// Allocates blocks for `[off, off+len)`, extending the file. On failure the range is punched again
    /// (ext4 can keep a partial allocation) and the file cut back to `len_before` if it grew.
    pub(in crate::store) fn allocate(
        &self,
        off: u64,
        len: u64,
        len_before: u64,
    ) -> std::io::Result<()> {
        let r = fault::check("fallocate").and_then(|()| fallocate(&self.buffered, 0, off, len));
        if r.is_err() {
            let _ = punch(&self.buffered, off, len);
            if let Ok(m) = self.buffered.metadata() {
                if m.len() > len_before.max(off) {
                    let _ = self.buffered.set_len(len_before.max(off));
                }
            }
        }
        r
    }

    /// Gives the blocks of `[off, off+len)` back to the file system (the file keeps its size).
    pub(in crate::store) fn punch(&self, off: u64, len: u64) -> std::io::Result<()> {
        fault::check("punch").and_then(|()| punch(&self.buffered, off, len))
    }
}

fn aligned(ptr: usize, len: usize, off: u64) -> bool {
    ptr.is_multiple_of(ALIGN as usize)
        && len.is_multiple_of(ALIGN as usize)
        && off.is_multiple_of(ALIGN)
}

/// `fallocate(mode, off, len)`; file systems without it extend the file instead (mode 0 only).
pub(in crate::store) fn fallocate(f: &File, mode: i32, off: u64, len: u64) -> std::io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    let (o, l) = (off_t(off)?, off_t(len)?);
    // SAFETY: fallocate on a file descriptor we own, with in-range non-negative offsets.
    let rc = unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(f), mode, o, l) };
    if rc == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EOPNOTSUPP) && mode == 0 {
        // Space is then claimed on write, and a full disk shows up as a write error instead.
        if f.metadata()?.len() < off + len {
            f.set_len(off + len)?;
        }
        return Ok(());
    }
    Err(e)
}

fn off_t(v: u64) -> std::io::Result<i64> {
    i64::try_from(v).map_err(|_| std::io::Error::from_raw_os_error(libc::EFBIG))
}

/// Punches a hole over `[off, off+len)`, keeping the file's size.
pub(in crate::store) fn punch(f: &File, off: u64, len: u64) -> std::io::Result<()> {
    fallocate(
        f,
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
        off,
        len,
    )
}

/// Bytes of disk blocks `f` occupies (`st_blocks`: file-system metadata such as an ext4 extent-tree
/// block included).
pub(in crate::store) fn allocated_bytes(f: &File) -> u64 {
    use std::os::unix::fs::MetadataExt;
    f.metadata().map(|m| m.blocks() * 512).unwrap_or(0)
}

/// `FS_IOC_FIEMAP`: `_IOWR('f', 11, struct fiemap)` (a 32-byte header).
const FS_IOC_FIEMAP: libc::c_ulong = 0xC020_660B;
/// Extents asked for per `FIEMAP` call.
const FIEMAP_BATCH: usize = 64;
const FIEMAP_EXTENT_LAST: u32 = 0x1;

/// `struct fiemap` followed by room for [`FIEMAP_BATCH`] `struct fiemap_extent`s (linux/fiemap.h).
#[repr(C)]
struct Fiemap {
    start: u64,
    length: u64,
    flags: u32,
    mapped_extents: u32,
    extent_count: u32,
    reserved: u32,
    extents: [FiemapExtent; FIEMAP_BATCH],
}

#[repr(C)]
#[derive(Clone, Copy)]
struct FiemapExtent {
    logical: u64,
    physical: u64,
    length: u64,
    reserved64: [u64; 2],
    flags: u32,
    reserved: [u32; 3],
}

/// Bytes of `f`'s data extents, written or preallocated, past its end included — the blocks the store
/// asked for, without the file system's own metadata, which [`allocated_bytes`] counts too (an ext4 file
/// with more than four extents holds an extent-tree block: 4 KiB the store never allocated). Falls back
/// to [`allocated_bytes`] where `FIEMAP` is not supported (tmpfs, which has no such metadata).
pub(in crate::store) fn extent_bytes(f: &File) -> u64 {
    let fd = std::os::fd::AsRawFd::as_raw_fd(f);
    let mut total = 0u64;
    let mut start = 0u64;
    // every round maps at least one extent and moves `start` past it: bounded by the file's extents
    loop {
        let mut m = Fiemap {
            start,
            length: u64::MAX - start,
            flags: 0,
            mapped_extents: 0,
            extent_count: FIEMAP_BATCH as u32,
            reserved: 0,
            extents: [FiemapExtent {
                logical: 0,
                physical: 0,
                length: 0,
                reserved64: [0; 2],
                flags: 0,
                reserved: [0; 3],
            }; FIEMAP_BATCH],
        };
        // `m` lives across the call, and the kernel writes at most `extent_count` extents into it.
        // SAFETY: `m` is a `#[repr(C)]` `struct fiemap` with room for `extent_count` extents.
        let rc = unsafe { libc::ioctl(fd, FS_IOC_FIEMAP as _, &mut m as *mut Fiemap) };
        if rc != 0 {
            return allocated_bytes(f);
        }
        let n = (m.mapped_extents as usize).min(FIEMAP_BATCH);
        if n == 0 {
            return total;
        }
        let mut last = false;
        for e in &m.extents[..n] {
            total += e.length;
            last |= e.flags & FIEMAP_EXTENT_LAST != 0;
        }
        let e = &m.extents[n - 1];
        let next = e.logical.saturating_add(e.length);
        if last || next <= start {
            return total;
        }
        start = next;
    }
}

/// Whether `dir`'s file system takes O_DIRECT: `Ok(None)` yes, `Ok(Some(why))` no (EINVAL: the file
/// system refuses it). Any other failure of the probe (a full disk, an IO error) says nothing about
/// O_DIRECT support: it is `Err`, and the store keeps O_DIRECT on (each IO falls back on EINVAL).
pub(in crate::store) fn probe_direct(
    dir: &Path,
) -> std::result::Result<Option<String>, std::io::Error> {
    let p = dir.join(".odirect-probe");
    let r = (|| -> std::io::Result<()> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .mode(0o600)
            .custom_flags(libc::O_DIRECT)
            .open(&p)?;
        let buf = crate::buffer::HostRegion::new(
            4096,
            &crate::buffer::RegionOptions {
                prefault_threads: Some(0),
                huge_pages: crate::buffer::HugePages::Off,
                ..Default::default()
            },
        )
        .map_err(|e| std::io::Error::other(e.to_string()))?;
        // SAFETY: the region owns 4096 bytes at as_ptr(), alive for this closure.
        let s = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), 4096) };
        fault::check("probe").and_then(|()| f.write_all_at(s, 0))?;
        f.read_exact_at(s, 0)
    })();
    let _ = std::fs::remove_file(&p);
    match r {
        Ok(()) => Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(Some(e.to_string())),
        Err(e) => Err(e),
    }
}

impl crate::store::Shared {
    /// Gives the blocks of free slots back (taken with `take_punchable`).
    pub(in crate::store) fn punch_slots(&self, slots: &[(u32, u32)]) {
        let ok = self.punch_ok.load(Ordering::Relaxed) && {
            let mut all = true;
            for &(class, slot) in slots {
                let r = self.class(class).and_then(|c| {
                    c.punch(u64::from(slot) * u64::from(class), u64::from(class))
                        .map_err(|e| crate::store::io_err("punch", e))
                });
                if let Err(Error::Os { source, .. }) = &r {
                    if source.raw_os_error() == Some(libc::EOPNOTSUPP) {
                        self.punch_ok.store(false, Ordering::Relaxed);
                    }
                }
                all &= r.is_ok();
                if !all {
                    break;
                }
            }
            all
        };
        if ok {
            self.stats
                .punched_slots
                .fetch_add(slots.len() as u64, Ordering::Relaxed);
        }
        // a failed punch leaves some blocks in place: all of them stay counted (over-counting is safe)
        self.log.index().punched(slots, ok);
    }
}
