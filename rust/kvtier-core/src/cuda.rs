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
static BATCH_FLAGS: std::sync::atomic::AtomicU32 =
    std::sync::atomic::AtomicU32::new(CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE);
/// Descriptors per `cuMemcpyBatchAsync` call by default; larger submissions are split. Measured on an H200
/// (benches/RESULTS.md, "copy-engine cost per chunk"): all-layer device-to-host backups of 64–128 KiB chunks
/// ran at 71–80 % of the PCIe ceiling as one 8,192-copy batch per side and at 93–96 % in batches of 256 to
/// 1,024. Adjustable with [`set_batch_limit`] (benches).
const BATCH_LIMIT: usize = 1024;
static BATCH_LIMIT_NOW: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(BATCH_LIMIT);

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
    launch_kernel: LaunchKernel,
    event_record: unsafe extern "C" fn(*mut c_void, *mut c_void) -> CuResult,
    event_create: unsafe extern "C" fn(*mut *mut c_void, u32) -> CuResult,
    event_destroy: unsafe extern "C" fn(*mut c_void) -> CuResult,
    stream_wait_event: unsafe extern "C" fn(*mut c_void, *mut c_void, u32) -> CuResult,
    event_synchronize: unsafe extern "C" fn(*mut c_void) -> CuResult,
    stream_synchronize: unsafe extern "C" fn(*mut c_void) -> CuResult,
}

/// `cuLaunchKernel`: function, grid x/y/z, block x/y/z, dynamic shared bytes, stream, parameter pointers,
/// extra options.
type LaunchKernel = unsafe extern "C" fn(
    *mut c_void,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    *mut c_void,
    *mut *mut c_void,
    *mut *mut c_void,
) -> CuResult;

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
    const { assert!(std::mem::size_of::<T>() == std::mem::size_of::<*mut c_void>()) };
    // SAFETY: the caller guarantees T is the symbol's function-pointer type; sizes match (checked at compile time above).
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
}

fn load() -> std::result::Result<Driver, String> {
    // dlopen with a constant NUL-terminated name; the handle is never closed, so every symbol
    // resolved from it stays valid for the life of the process.
    // SAFETY: constant NUL-terminated name; the handle is never closed.
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
            launch_kernel: sym(lib, c"cuLaunchKernel")?,
            event_record: sym(lib, c"cuEventRecord")?,
            event_create: sym(lib, c"cuEventCreate")?,
            event_destroy: sym(lib, c"cuEventDestroy_v2")?,
            stream_wait_event: sym(lib, c"cuStreamWaitEvent")?,
            event_synchronize: sym(lib, c"cuEventSynchronize")?,
            stream_synchronize: sym(lib, c"cuStreamSynchronize")?,
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

/// Primary contexts retained so far, by device ordinal (retained once per process, never released: torch
/// keeps the same contexts alive for the life of the process).
static PRIMARY: std::sync::Mutex<Vec<(i32, usize)>> = std::sync::Mutex::new(Vec::new());

fn primary_ctx(d: &Driver, device: i32) -> Result<CuContext> {
    let mut known = PRIMARY.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(&(_, ctx)) = known.iter().find(|(dev, _)| *dev == device) {
        return Ok(ctx as CuContext);
    }
    let mut dev: CuDevice = 0;
    let mut ctx: CuContext = std::ptr::null_mut();
    // SAFETY: out-pointers refer to live locals; the driver was initialised by `load`.
    unsafe {
        check("cuDeviceGet", (d.device_get)(&mut dev, device), || {
            format!(" (device {device})")
        })?;
        check(
            "cuDevicePrimaryCtxRetain",
            (d.primary_ctx_retain)(&mut ctx, dev),
            String::new,
        )?;
    }
    known.push((device, ctx as usize));
    Ok(ctx)
}

/// Runs `f` with device `device`'s primary context current on this thread.
fn with_primary_ctx<T>(d: &Driver, device: i32, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let ctx = primary_ctx(d, device)?;
    // SAFETY: ctx is a retained primary context (never released).
    unsafe { check("cuCtxPushCurrent", (d.ctx_push)(ctx), String::new)? };
    let out = f();
    let mut popped: CuContext = std::ptr::null_mut();
    // SAFETY: pops the context pushed above on this same thread.
    unsafe { (d.ctx_pop)(&mut popped) };
    out
}

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

/// The primary context of one device, current on this thread for a sequence of driver calls (popped when
/// dropped). Not `Send`: a context is current per thread.
pub struct Current {
    d: &'static Driver,
    _not_send: std::marker::PhantomData<*const ()>,
}

/// Makes `device`'s primary context (torch's context) current on this thread until the guard drops.
pub fn make_current(device: i32) -> Result<Current> {
    let d = driver()?;
    let ctx = primary_ctx(d, device)?;
    // SAFETY: ctx is a retained primary context (never released).
    unsafe { check("cuCtxPushCurrent", (d.ctx_push)(ctx), String::new)? };
    Ok(Current {
        d,
        _not_send: std::marker::PhantomData,
    })
}

impl Drop for Current {
    fn drop(&mut self) {
        let mut popped: CuContext = std::ptr::null_mut();
        // SAFETY: pops the context pushed by `make_current` on this same thread (the guard is not Send).
        unsafe { (self.d.ctx_pop)(&mut popped) };
    }
}

/// One kernel parameter, passed by value (`cuLaunchKernel` reads each through a pointer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Param {
    /// A 32-bit integer parameter.
    U32(u32),
    /// A 64-bit integer or pointer parameter.
    U64(u64),
}

/// A kernel loaded in the primary context (`CUfunction`) and the shape it is launched with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernel {
    /// The `CUfunction` handle.
    pub function: usize,
    /// Thread blocks (1-D grid).
    pub grid: u32,
    /// Threads per block.
    pub block: u32,
    /// Dynamic shared memory in bytes.
    pub shared: u32,
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

    /// Enqueues one launch of `kernel` on `stream` with `params` in the kernel's parameter order.
    ///
    /// # Safety
    /// `kernel.function` must be a live `CUfunction` of this context whose parameters are exactly `params`
    /// (count, order and widths), every address in `params` must be valid for what the kernel does with it
    /// until the stream passes the launch, and `stream` must be a live stream of this context (or 0).
    pub unsafe fn launch(&self, stream: usize, kernel: &Kernel, params: &[Param]) -> Result<()> {
        if kernel.function == 0 || kernel.grid == 0 || kernel.block == 0 || kernel.block > 1024 {
            return Err(Error::arg("kernel", format!("bad launch shape {kernel:?}")));
        }
        // Values live in these two vectors, which are never resized after the pointers are taken.
        let mut narrow: Vec<u32> = Vec::with_capacity(params.len());
        let mut wide: Vec<u64> = Vec::with_capacity(params.len());
        for p in params {
            match *p {
                Param::U32(v) => narrow.push(v),
                Param::U64(v) => wide.push(v),
            }
        }
        let (mut n, mut w) = (0, 0);
        let mut ptrs: Vec<*mut c_void> = Vec::with_capacity(params.len());
        for p in params {
            match p {
                Param::U32(_) => {
                    ptrs.push(&mut narrow[n] as *mut u32 as *mut c_void);
                    n += 1;
                }
                Param::U64(_) => {
                    ptrs.push(&mut wide[w] as *mut u64 as *mut c_void);
                    w += 1;
                }
            }
        }
        // `ptrs` points at one value per parameter, alive across the call (the driver copies the
        // values during the call); the function, parameter list and addresses are valid per the contract.
        // SAFETY: one live value per parameter; function and addresses per the contract.
        let rc = unsafe {
            (self.d.launch_kernel)(
                kernel.function as *mut c_void,
                kernel.grid,
                1,
                1,
                kernel.block,
                1,
                1,
                kernel.shared,
                stream as *mut c_void,
                ptrs.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        check("cuLaunchKernel", rc, || {
            format!(" (grid {}, block {})", kernel.grid, kernel.block)
        })
    }

    /// Records `event` on `stream` (both of this context).
    ///
    /// # Safety
    /// `event` must be a live `CUevent` and `stream` a live stream (or 0) of this context.
    pub unsafe fn record_event(&self, event: usize, stream: usize) -> Result<()> {
        // SAFETY: per the contract.
        let rc = unsafe { (self.d.event_record)(event as *mut c_void, stream as *mut c_void) };
        check("cuEventRecord", rc, || format!(" (event {event:#x})"))
    }
}

/// `CU_EVENT_DISABLE_TIMING`: events used only for ordering are cheaper without timestamps.
const CU_EVENT_DISABLE_TIMING: u32 = 0x2;

impl Current {
    /// Blocks this thread until the work captured by `event`'s last record has completed.
    ///
    /// # Safety
    /// `event` must be a live event of this context.
    pub unsafe fn event_synchronize(&self, event: usize) -> Result<()> {
        let f = self.d.event_synchronize;
        // SAFETY: per the contract.
        let rc = unsafe { f(event as *mut c_void) };
        check("cuEventSynchronize", rc, String::new)
    }

    /// Blocks this thread until everything enqueued on `stream` has completed.
    ///
    /// # Safety
    /// `stream` must be a live stream of this context (or 0).
    pub unsafe fn stream_synchronize(&self, stream: usize) -> Result<()> {
        let f = self.d.stream_synchronize;
        // SAFETY: per the contract.
        let rc = unsafe { f(stream as *mut c_void) };
        check("cuStreamSynchronize", rc, String::new)
    }

    /// Makes `waiter` wait (on the device) for the work captured by `event`'s last record.
    ///
    /// # Safety
    /// `waiter` must be a live stream of this context (or 0) and `event` a live event of it.
    pub unsafe fn stream_wait(&self, waiter: usize, event: usize) -> Result<()> {
        let f = self.d.stream_wait_event;
        // SAFETY: per the contract.
        let rc = unsafe { f(waiter as *mut c_void, event as *mut c_void, 0) };
        check("cuStreamWaitEvent", rc, String::new)
    }

    /// Makes `waiter` wait (on the device) for the work enqueued on `stream` so far.
    ///
    /// # Safety
    /// `stream` and `waiter` must be live streams of this context (or 0) and `event` a live event of it.
    pub unsafe fn stream_after(&self, waiter: usize, stream: usize, event: usize) -> Result<()> {
        // SAFETY: per the contract.
        unsafe {
            self.record_event(event, stream)?;
            check(
                "cuStreamWaitEvent",
                (self.d.stream_wait_event)(waiter as *mut c_void, event as *mut c_void, 0),
                String::new,
            )
        }
    }
}

/// Streams that share one submission: lane 0 is the caller's stream, the others are side streams that fork
/// from it before each group of work ([`Lanes::fork`]) and join back into it after ([`Lanes::join`]), so the
/// caller's stream orders everything as if it had run there. Owns one ordering event per side stream.
pub struct Lanes<'a> {
    cur: &'a Current,
    streams: Vec<usize>,
    fork: Vec<usize>,
    join: Vec<usize>,
}

impl<'a> Lanes<'a> {
    /// Lanes over `main` and `sides` (live streams of `cur`'s context, distinct from `main`).
    ///
    /// # Safety
    /// Every stream must be a live stream of the current context for the life of the value.
    pub unsafe fn new(cur: &'a Current, main: usize, sides: &[usize]) -> Result<Self> {
        let mut lanes = Lanes {
            cur,
            streams: vec![main],
            fork: Vec::new(),
            join: Vec::new(),
        };
        for &s in sides {
            for list in [&mut lanes.fork, &mut lanes.join] {
                let mut ev: *mut c_void = std::ptr::null_mut();
                // SAFETY: out-pointer to a live local; the context is current.
                let rc = unsafe { (cur.d.event_create)(&mut ev, CU_EVENT_DISABLE_TIMING) };
                check("cuEventCreate", rc, String::new)?;
                list.push(ev as usize);
            }
            lanes.streams.push(s);
        }
        Ok(lanes)
    }

    /// Number of lanes (1 + side streams).
    pub fn len(&self) -> usize {
        self.streams.len()
    }

    /// Always false: lane 0 exists.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The stream of lane `i`.
    pub fn stream(&self, i: usize) -> usize {
        self.streams[i % self.streams.len()]
    }

    /// Side streams wait for everything enqueued on lane 0 so far.
    pub fn fork(&self) -> Result<()> {
        for (i, &s) in self.streams.iter().enumerate().skip(1) {
            // SAFETY: the streams and events are live (constructor contract, events owned by self).
            unsafe {
                self.cur
                    .stream_after(s, self.streams[0], self.fork[i - 1])?
            };
        }
        Ok(())
    }

    /// Lane 0 waits for everything enqueued on the side streams so far.
    pub fn join(&self) -> Result<()> {
        for (i, &s) in self.streams.iter().enumerate().skip(1) {
            // SAFETY: as in `fork`.
            unsafe {
                self.cur
                    .stream_after(self.streams[0], s, self.join[i - 1])?
            };
        }
        Ok(())
    }
}

impl Drop for Lanes<'_> {
    fn drop(&mut self) {
        for &ev in self.fork.iter().chain(&self.join) {
            // events created by `new`, destroyed once; the driver defers the release of an event
            // whose recorded work is still pending.
            // SAFETY: an event created by `new`, destroyed exactly once.
            unsafe { (self.cur.d.event_destroy)(ev as *mut c_void) };
        }
    }
}
