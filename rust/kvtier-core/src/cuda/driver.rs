//! Loading the driver: `libcuda.so.1` opened once with `dlopen`, every entry point resolved into a
//! [`Driver`], and [`check`] turning a `CUresult` into this crate's error.

use std::ffi::{c_void, CStr};
use std::sync::OnceLock;

use crate::error::{Error, Result};

pub(super) type CuResult = i32;
pub(super) type CuDevice = i32;
pub(super) type CuContext = *mut c_void;

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct CuMemLocation {
    pub(super) ty: i32,
    pub(super) id: i32,
}

/// `CUmemcpyAttributes` (cuda.h, CUDA 12.8+).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct CuMemcpyAttributes {
    pub(super) src_access_order: u32,
    pub(super) src_loc_hint: CuMemLocation,
    pub(super) dst_loc_hint: CuMemLocation,
    pub(super) flags: u32,
}

/// CUDA 13's `cuMemcpyBatchAsync_v2`: no `failIdx` out-parameter (12.8's unsuffixed symbol has one).
pub(super) type BatchV2 = unsafe extern "C" fn(
    *mut u64,
    *mut u64,
    *mut usize,
    usize,
    *mut CuMemcpyAttributes,
    *mut usize,
    usize,
    *mut c_void,
) -> CuResult;

pub(super) struct Driver {
    pub(super) memcpy_async: unsafe extern "C" fn(u64, u64, usize, *mut c_void) -> CuResult,
    pub(super) batch_v2: Option<BatchV2>,
    pub(super) device_get: unsafe extern "C" fn(*mut CuDevice, i32) -> CuResult,
    pub(super) primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
    pub(super) ctx_push: unsafe extern "C" fn(CuContext) -> CuResult,
    pub(super) ctx_pop: unsafe extern "C" fn(*mut CuContext) -> CuResult,
    pub(super) host_register: unsafe extern "C" fn(*mut c_void, usize, u32) -> CuResult,
    pub(super) host_unregister: unsafe extern "C" fn(*mut c_void) -> CuResult,
    pub(super) host_get_flags: unsafe extern "C" fn(*mut u32, *mut c_void) -> CuResult,
    pub(super) launch_kernel: LaunchKernel,
    pub(super) event_record: unsafe extern "C" fn(*mut c_void, *mut c_void) -> CuResult,
    pub(super) event_create: unsafe extern "C" fn(*mut *mut c_void, u32) -> CuResult,
    pub(super) event_destroy: unsafe extern "C" fn(*mut c_void) -> CuResult,
    pub(super) stream_wait_event: unsafe extern "C" fn(*mut c_void, *mut c_void, u32) -> CuResult,
    pub(super) event_synchronize: unsafe extern "C" fn(*mut c_void) -> CuResult,
    pub(super) stream_synchronize: unsafe extern "C" fn(*mut c_void) -> CuResult,
    pub(super) launch_host_func: LaunchHostFunc,
}

/// `cuLaunchHostFunc`: stream, host function, its argument.
pub(super) type LaunchHostFunc =
    unsafe extern "C" fn(*mut c_void, unsafe extern "C" fn(*mut c_void), *mut c_void) -> CuResult;

/// `cuLaunchKernel`: function, grid x/y/z, block x/y/z, dynamic shared bytes, stream, parameter pointers,
/// extra options.
pub(super) type LaunchKernel = unsafe extern "C" fn(
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
            launch_host_func: sym(lib, c"cuLaunchHostFunc")?,
        }
    };
    Ok(drv)
}

pub(super) fn driver() -> Result<&'static Driver> {
    DRIVER
        .get_or_init(load)
        .as_ref()
        .map_err(|e| Error::CudaUnavailable(e.clone()))
}

/// True when the CUDA driver loads and initialises on this machine.
pub fn available() -> bool {
    driver().is_ok()
}

pub(super) fn check(
    call: &'static str,
    rc: CuResult,
    detail: impl FnOnce() -> String,
) -> Result<()> {
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
