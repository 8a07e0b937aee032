//! The CUDA driver, loaded at run time.
//!
//! kvtier builds and tests on machines without CUDA, so it never links against it: `libcuda.so.1` (the
//! driver, whose ABI is stable across toolkit versions) is opened with `dlopen` on first use. Using the
//! driver rather than a `libcudart` avoids loading a second runtime beside the one torch ships; pages are
//! registered with `CU_MEMHOSTREGISTER_PORTABLE`, so every context in the process (torch's primary context
//! included) sees them as pinned.
//!
//! Every entry point is resolved once; a missing library or symbol is [`Error::CudaUnavailable`].

use std::ffi::{c_void, CStr};
use std::sync::OnceLock;

use crate::error::{Error, Result};

type CuResult = i32;
type CuDevice = i32;
type CuContext = *mut c_void;

const CU_MEMHOSTREGISTER_PORTABLE: u32 = 0x01;
const CU_MEMHOSTREGISTER_DEVICEMAP: u32 = 0x02;

#[repr(C)]
#[derive(Clone, Copy)]
struct CuMemLocation {
    ty: i32,
    id: i32,
}

/// `CUmemcpyAttributes` (cuda.h, CUDA 12.8+).
#[repr(C)]
#[derive(Clone, Copy)]
struct CuMemcpyAttributes {
    src_access_order: u32,
    src_loc_hint: CuMemLocation,
    dst_loc_hint: CuMemLocation,
    flags: u32,
}

const CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: u32 = 0x1;
const CUDA_ERROR_NOT_SUPPORTED: i32 = 801;
const CUDA_ERROR_INVALID_VALUE: i32 = 1;
/// Ask the driver to keep batched copies on the copy engines rather than SM copy kernels, so they overlap
/// with compute instead of competing with it.
const CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE: u32 = 0x1;
/// Flags in use: starts with PREFER_OVERLAP_WITH_COMPUTE, drops to 0 if a driver rejects it.
static BATCH_FLAGS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE);
/// Descriptors per `cuMemcpyBatchAsync` call; larger calls are split (SGLang caps its workspace at 65,536).
const BATCH_LIMIT: usize = 16384;

/// CUDA 13's `cuMemcpyBatchAsync_v2`: no `failIdx` out-parameter (12.8's unsuffixed symbol has one).
type BatchV2 = unsafe extern "C" fn(
    *mut u64,
    *mut u64,
    *mut usize,
    usize,
    *mut CuMemcpyAttributes,
    *mut usize,
    usize,
    *mut c_void,
) -> CuResult;

struct Driver {
    memcpy_async: unsafe extern "C" fn(u64, u64, usize, *mut c_void) -> CuResult,
    batch_v2: Option<BatchV2>,
    device_get: unsafe extern "C" fn(*mut CuDevice, i32) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
    ctx_push: unsafe extern "C" fn(CuContext) -> CuResult,
    ctx_pop: unsafe extern "C" fn(*mut CuContext) -> CuResult,
    host_register: unsafe extern "C" fn(*mut c_void, usize, u32) -> CuResult,
    host_unregister: unsafe extern "C" fn(*mut c_void) -> CuResult,
    host_get_flags: unsafe extern "C" fn(*mut u32, *mut c_void) -> CuResult,
}

// SAFETY: Driver holds only function pointers into a library that stays loaded for the process lifetime.
unsafe impl Send for Driver {}
// SAFETY: see Send; the CUDA driver API is thread-safe.
unsafe impl Sync for Driver {}

static DRIVER: OnceLock<std::result::Result<Driver, String>> = OnceLock::new();

/// Resolves `name` in `lib` as a function pointer of type `T`.
///
/// # Safety
/// `T` must be the `extern "C" fn` type of the symbol's real signature.
unsafe fn sym<T: Copy>(lib: *mut c_void, name: &CStr) -> std::result::Result<T, String> {
    // SAFETY: lib is a live handle from dlopen and name is NUL-terminated.
    let p = unsafe { libc::dlsym(lib, name.as_ptr()) };
    if p.is_null() {
        return Err(format!("symbol {name:?} not found in libcuda.so.1"));
    }
    debug_assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: the caller guarantees T is the symbol's function-pointer type; sizes match (checked above).
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
}

fn load() -> std::result::Result<Driver, String> {
    // SAFETY: dlopen with a constant NUL-terminated name; the handle is never closed, so every symbol
    // resolved from it stays valid for the life of the process.
    let lib = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if lib.is_null() {
        return Err("libcuda.so.1 could not be loaded (no NVIDIA driver on this machine)".into());
    }
    // SAFETY: each type below is the documented signature of that driver entry point (cuda.h).
    let drv = unsafe {
        let init: unsafe extern "C" fn(u32) -> CuResult = sym(lib, c"cuInit")?;
        let rc = init(0);
        if rc != 0 {
            return Err(format!("cuInit failed with CUresult {rc}"));
        }
        Driver {
            memcpy_async: sym(lib, c"cuMemcpyAsync")?,
            batch_v2: sym::<BatchV2>(lib, c"cuMemcpyBatchAsync_v2").ok(),
            device_get: sym(lib, c"cuDeviceGet")?,
            primary_ctx_retain: sym(lib, c"cuDevicePrimaryCtxRetain")?,
            ctx_push: sym(lib, c"cuCtxPushCurrent_v2")?,
            ctx_pop: sym(lib, c"cuCtxPopCurrent_v2")?,
            host_register: sym(lib, c"cuMemHostRegister_v2")?,
            host_unregister: sym(lib, c"cuMemHostUnregister")?,
            host_get_flags: sym(lib, c"cuMemHostGetFlags")?,
        }
    };
    Ok(drv)
}

fn driver() -> Result<&'static Driver> {
    DRIVER
        .get_or_init(load)
        .as_ref()
        .map_err(|e| Error::CudaUnavailable(e.clone()))
}

/// True when the CUDA driver loads and initialises on this machine.
pub fn available() -> bool {
    driver().is_ok()
}

fn check(call: &'static str, rc: CuResult, detail: impl FnOnce() -> String) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(Error::Cuda {
            call,
            code: rc,
            detail: detail(),
        })
    }
}

/// Runs `f` with device `device`'s primary context current on this thread.
fn with_primary_ctx<T>(d: &Driver, device: i32, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let mut dev: CuDevice = 0;
    let mut ctx: CuContext = std::ptr::null_mut();
    // SAFETY: out-pointers refer to live locals; the driver was initialised by `load`.
    unsafe {
        check("cuDeviceGet", (d.device_get)(&mut dev, device), || format!(" (device {device})"))?;
        check("cuDevicePrimaryCtxRetain", (d.primary_ctx_retain)(&mut ctx, dev), String::new)?;
        check("cuCtxPushCurrent", (d.ctx_push)(ctx), String::new)?;
    }
    let out = f();
    let mut popped: CuContext = std::ptr::null_mut();
    // SAFETY: pops the context pushed above on this same thread.
    unsafe { (d.ctx_pop)(&mut popped) };
    out
}

/// One live registration of a host range with the driver. Undone by [`unregister_all`] (the owning
/// [`crate::buffer::HostRegion`] calls it before unmapping).
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
) -> Result<Vec<Registration>> {
    let d = driver()?;
    let base = base as usize;
    let threads = threads.clamp(1, chunks.len().max(1));
    let results: Vec<Result<Registration>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
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
                                    CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP,
                                )
                            };
                            mine.push(check("cuMemHostRegister", rc, || {
                                format!(" (chunk {i}: offset {off}, {len} bytes)")
                            })
                            .map(|()| Registration { addr, len, device }));
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
            // SAFETY: r.addr is the base of a range registered by `register_ranges` and not yet unregistered
            // (each Registration is consumed here exactly once).
            let rc = unsafe { (d.host_unregister)(r.addr as *mut c_void) };
            check("cuMemHostUnregister", rc, || format!(" (address {:#x})", r.addr))
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

/// True when this process can submit copies with `cuMemcpyBatchAsync_v2`.
pub fn batch_supported() -> bool {
    driver().is_ok_and(|d| d.batch_v2.is_some()) && !BATCH_UNSUPPORTED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Enqueues `copies` (`(src, dst, len)` addresses, host or device, unified addressing) on `stream` of
/// `device`: one `cuMemcpyBatchAsync_v2` per [`BATCH_LIMIT`] copies where the driver has it and the
/// stream is not the legacy NULL stream (which the batch API rejects), else one `cuMemcpyAsync` each.
/// Returns once submitted; completion is stream-ordered.
///
/// # Safety
/// Every range must be valid for the copy (device memory, or host memory registered with CUDA or
/// allocated pinned, or pageable host memory for `cuMemcpyAsync`), stay alive until the stream reaches
/// the copies, and destinations must not overlap each other or any source.
pub unsafe fn copy_async(device: i32, stream: usize, copies: &[(usize, usize, usize)], batch: bool) -> Result<Submitted> {
    let d = driver()?;
    let mut out = Submitted { copies: copies.len(), batch_calls: 0 };
    if copies.is_empty() {
        return Ok(out);
    }
    let hstream = stream as *mut c_void;
    with_primary_ctx(d, device, || {
        let use_batch = batch && stream != 0 && !BATCH_UNSUPPORTED.load(std::sync::atomic::Ordering::Relaxed);
        if let (true, Some(batch_fn)) = (use_batch, d.batch_v2) {
            let mut attrs = CuMemcpyAttributes {
                src_access_order: CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                src_loc_hint: CuMemLocation { ty: 0, id: 0 },
                dst_loc_hint: CuMemLocation { ty: 0, id: 0 },
                flags: BATCH_FLAGS.load(std::sync::atomic::Ordering::Relaxed),
            };
            let mut done = 0;
            let mut parts = copies.chunks(BATCH_LIMIT).peekable();
            while let Some(part) = parts.next() {
                let mut srcs: Vec<u64> = part.iter().map(|c| c.0 as u64).collect();
                let mut dsts: Vec<u64> = part.iter().map(|c| c.1 as u64).collect();
                let mut sizes: Vec<usize> = part.iter().map(|c| c.2).collect();
                let mut attr_idx = 0usize;
                // SAFETY: the arrays hold `part.len()` entries and live across the call (the driver reads
                // them during submission only); the ranges are valid per this function's contract.
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
                    // A driver that does not know the overlap flag: retry this part without it, for good.
                    BATCH_FLAGS.store(0, std::sync::atomic::Ordering::Relaxed);
                    attrs.flags = 0;
                    parts = copies.chunks(BATCH_LIMIT).peekable();
                    continue;
                }
                if rc == CUDA_ERROR_NOT_SUPPORTED && done == 0 {
                    BATCH_UNSUPPORTED.store(true, std::sync::atomic::Ordering::Relaxed);
                    break;
                }
                check("cuMemcpyBatchAsync_v2", rc, || format!(" ({} copies)", part.len()))?;
                out.batch_calls += 1;
                done += part.len();
            }
            if done == copies.len() {
                return Ok(());
            }
        }
        for (i, &(src, dst, len)) in copies.iter().enumerate() {
            // SAFETY: the range is valid per this function's contract.
            let rc = unsafe { (d.memcpy_async)(dst as u64, src as u64, len, hstream) };
            check("cuMemcpyAsync", rc, || format!(" (copy {i}: {len} bytes {src:#x} -> {dst:#x})"))?;
        }
        Ok(())
    })?;
    Ok(out)
}
