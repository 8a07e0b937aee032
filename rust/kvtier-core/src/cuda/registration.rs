//! Host memory registration: ranges of a host mapping registered (pinned) with the driver, in parallel,
//! and unregistered again.

use std::ffi::c_void;

use super::context::with_primary_ctx;
use super::driver::{check, driver};
use crate::error::Result;

const CU_MEMHOSTREGISTER_PORTABLE: u32 = 0x01;
const CU_MEMHOSTREGISTER_DEVICEMAP: u32 = 0x02;

/// One live registration of a host range with the driver. Undone by [`unregister_all`] (the owning
/// `buffer::HostRegion` calls it before unmapping).
#[derive(Debug)]
pub struct Registration {
    addr: usize,
    len: usize,
    device: i32,
}

impl Registration {
    /// Start address.
    pub fn addr(&self) -> usize {
        self.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True for an empty range (never produced).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Registers `[base+off, base+off+len)` for every `(off, len)` of `chunks`, using up to `threads` threads.
/// On any failure the chunks already registered are unregistered and the first error is returned.
///
/// The caller (`HostRegion::register_cuda`) guarantees that every chunk lies inside one live mapping it owns.
pub fn register_ranges(
    device: i32,
    base: *mut u8,
    chunks: &[(usize, usize)],
    threads: usize,
    progress: Option<&crate::progress::Progress>,
) -> Result<Vec<Registration>> {
    let d = driver()?;
    let base = base as usize;
    let threads = threads.clamp(1, chunks.len().max(1));
    let results: Vec<Result<Registration>> =
        std::thread::scope(|s| {
            let handles: Vec<_> =
                (0..threads)
                    .map(|t| {
                        s.spawn(move || {
                            with_primary_ctx(d, device, || {
                                let mut mine = Vec::new();
                                for (i, &(off, len)) in chunks.iter().enumerate() {
                                    if i % threads != t {
                                        continue;
                                    }
                                    let addr = base + off;
                                    // SAFETY: the range lies inside a mapping owned by the caller (see fn docs).
                                    let rc = unsafe {
                                        (d.host_register)(
                                            addr as *mut c_void,
                                            len,
                                            CU_MEMHOSTREGISTER_PORTABLE
                                                | CU_MEMHOSTREGISTER_DEVICEMAP,
                                        )
                                    };
                                    if let Some(p) = progress {
                                        p.add(len);
                                    }
                                    mine.push(
                                        check("cuMemHostRegister", rc, || {
                                            format!(" (chunk {i}: offset {off}, {len} bytes)")
                                        })
                                        .map(|()| Registration { addr, len, device }),
                                    );
                                }
                                Ok(mine)
                            })
                        })
                    })
                    .collect();
            handles
                .into_iter()
                .flat_map(|h| match h.join().expect("registration thread panicked") {
                    Ok(v) => v,
                    Err(e) => vec![Err(e)],
                })
                .collect()
        });
    let mut ok = Vec::new();
    let mut first_err = None;
    for r in results {
        match r {
            Ok(reg) => ok.push(reg),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        let _ = unregister_all(ok);
        return Err(e);
    }
    ok.sort_by_key(|r| r.addr);
    Ok(ok)
}

/// Unregisters every registration; returns the first error but always attempts all of them.
pub fn unregister_all(regs: Vec<Registration>) -> Result<()> {
    if regs.is_empty() {
        return Ok(());
    }
    let d = driver()?;
    let mut first_err = None;
    for r in regs {
        let res = with_primary_ctx(d, r.device, || {
            // r.addr is the base of a range registered by `register_ranges` and not yet unregistered
            // (each Registration is consumed here exactly once).
            // SAFETY: a registered base address, unregistered exactly once.
            let rc = unsafe { (d.host_unregister)(r.addr as *mut c_void) };
            check("cuMemHostUnregister", rc, || {
                format!(" (address {:#x})", r.addr)
            })
        });
        if let Err(e) = res {
            first_err.get_or_insert(e);
        }
    }
    first_err.map_or(Ok(()), Err)
}

/// True when `addr` lies in host memory registered with (or allocated by) the CUDA driver.
pub fn is_host_registered(device: i32, addr: usize) -> Result<bool> {
    let d = driver()?;
    with_primary_ctx(d, device, || {
        let mut flags = 0u32;
        // SAFETY: the driver only looks the address up in its tables; it does not dereference it.
        let rc = unsafe { (d.host_get_flags)(&mut flags, addr as *mut c_void) };
        Ok(rc == 0)
    })
}
