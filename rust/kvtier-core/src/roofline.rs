//! The disk's own ceiling for the page store's access pattern: `count` objects of `size` bytes written
//! with O_DIRECT `pwrite` by `threads` threads into a preallocated, already written file (then
//! `fdatasync`, so the figure is durable like the store's), then read back with O_DIRECT `pread` (the page
//! cache is not involved). Benchmarks print kvtier's
//! throughput as a ratio to this, measured in the same run on the same directory.

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use crate::buffer::{HostRegion, RegionOptions};
use crate::error::{Error, Result};

/// `(write GB/s, read GB/s, O_DIRECT used)`.
pub fn odirect_roofline(
    dir: &Path,
    size: usize,
    count: usize,
    threads: usize,
) -> Result<(f64, f64, bool)> {
    if size == 0 || !size.is_multiple_of(4096) {
        return Err(Error::arg(
            "size",
            format!("must be a positive multiple of 4096, got {size}"),
        ));
    }
    if count == 0 || threads == 0 {
        return Err(Error::arg("count", "count and threads must be positive"));
    }
    remove_stale(dir);
    // One name per call: two probes of one process (two stores opening in one directory) never share a file.
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    let path = dir.join(format!(".kvtier-roofline-{}-{call}", std::process::id()));
    let open = |direct: bool| {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .custom_flags(if direct { libc::O_DIRECT } else { 0 })
            .open(&path)
    };
    let (f, direct) = match open(true) {
        Ok(f) => (f, true),
        Err(_) => (
            open(false).map_err(|e| Error::Os {
                what: format!("creating {}", path.display()),
                source: e,
            })?,
            false,
        ),
    };
    let total = size as u64 * count as u64;
    // Allocate the whole file up front, as the store does for its slots: measuring block allocation of a
    // sparse file would understate the disk.
    // SAFETY: fallocate on a descriptor we own with non-negative offsets.
    if unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), 0, 0, total as i64) } != 0 {
        f.set_len(total).map_err(|e| Error::Os {
            what: "sizing the roofline file".into(),
            source: e,
        })?;
    }
    let bufs: Vec<HostRegion> = (0..threads)
        .map(|_| HostRegion::new(size, &RegionOptions::default()))
        .collect::<Result<_>>()?;
    let run = |write: bool| -> Result<f64> {
        let next = AtomicUsize::new(0);
        let t0 = Instant::now();
        let errs: Vec<Option<std::io::Error>> = std::thread::scope(|s| {
            let hs: Vec<_> = bufs
                .iter()
                .map(|b| {
                    let (f, next) = (&f, &next);
                    s.spawn(move || {
                        // SAFETY: each thread owns its region of `size` bytes exclusively.
                        let buf = unsafe { std::slice::from_raw_parts_mut(b.as_ptr(), size) };
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            if i >= count {
                                return None;
                            }
                            let off = i as u64 * size as u64;
                            let r = if write {
                                f.write_all_at(buf, off)
                            } else {
                                f.read_exact_at(buf, off)
                            };
                            if let Err(e) = r {
                                return Some(e);
                            }
                        }
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("roofline thread panicked"))
                .collect()
        });
        if let Some(e) = errs.into_iter().flatten().next() {
            return Err(Error::Os {
                what: "roofline IO".into(),
                source: e,
            });
        }
        if write {
            f.sync_data().map_err(|e| Error::Os {
                what: "fdatasync".into(),
                source: e,
            })?;
        }
        Ok(total as f64 / t0.elapsed().as_secs_f64() / 1e9)
    };
    // One untimed pass first: overwriting initialised blocks (the store's steady state, slots reused) is
    // faster than the first write into freshly allocated extents on ext4 and on this machine's virtual disk.
    let w = run(true).and_then(|_| run(true));
    let r = w.as_ref().ok().map(|_| run(false));
    let _ = std::fs::remove_file(&path);
    Ok((w?, r.expect("read runs after a successful write")?, direct))
}

/// Removes the files of measurements whose process is gone (killed while it measured: the file is removed
/// at the end of a measurement, so only a process that died during one leaves it behind).
fn remove_stale(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(rest) = name
            .to_str()
            .and_then(|n| n.strip_prefix(".kvtier-roofline-"))
        else {
            continue;
        };
        let Some(Ok(pid)) = rest.split('-').next().map(str::parse::<i32>) else {
            continue;
        };
        let gone = pid > 0 && {
            // SAFETY: kill with signal 0 sends nothing; it only asks whether the process exists.
            let rc = unsafe { libc::kill(pid, 0) };
            rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
        };
        if gone {
            let _ = std::fs::remove_file(e.path());
        }
    }
}
