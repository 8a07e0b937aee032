//! A minimal DLPack (v0.8 "legacy" capsule) exporter for byte ranges of a host region.
//!
//! The capsule's manager context holds an `Arc<HostRegion>`, so a torch tensor made from it keeps the
//! memory alive after the Python handle is closed or dropped; the memory is unmapped when the last view
//! (or the handle) goes away. Only 1-D uint8 CPU views are exported; Python reshapes with `view`.

use std::ffi::{c_void, CStr};
use std::sync::Arc;

use kvtier_core::buffer::HostRegion;
use pyo3::ffi;
use pyo3::prelude::*;

#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// Owns the managed tensor, its shape/stride storage and the region reference.
struct Ctx {
    managed: DLManagedTensor,
    shape: [i64; 1],
    strides: [i64; 1],
    _region: Arc<HostRegion>,
}

const K_DL_CPU: i32 = 1;
const K_DL_UINT: u8 = 1;
const NAME: &CStr = c"dltensor";
const USED_NAME: &CStr = c"used_dltensor";

/// DLPack's deleter for the tensors `capsule` makes.
///
/// # Safety
/// `m` is null or the `managed` field of a `Ctx` leaked by `capsule`; the consumer calls this once.
unsafe extern "C" fn deleter(m: *mut DLManagedTensor) {
    if m.is_null() {
        return;
    }
    // `m` points at the `managed` field of a leaked Box<Ctx> (see `capsule`), whose manager_ctx is
    // that Box's pointer; the consumer calls the deleter exactly once, so reclaiming the Box is sound.
    // SAFETY: reclaims the Box<Ctx> leaked by `capsule`, exactly once.
    unsafe {
        let ctx = (*m).manager_ctx as *mut Ctx;
        drop(Box::from_raw(ctx));
    }
}

/// The capsule's destructor, which Python calls once when the capsule dies.
///
/// # Safety
/// `cap` is a live capsule object made by `capsule`; the GIL is held (Python calls destructors under it).
unsafe extern "C" fn capsule_destructor(cap: *mut ffi::PyObject) {
    // A capsule still named "dltensor" was never consumed: free it here. A consumer renames it
    // "used_dltensor" and takes over the deleter.
    // SAFETY: `cap` is the capsule being destroyed; the name checks make GetPointer well defined.
    unsafe {
        if ffi::PyCapsule_IsValid(cap, USED_NAME.as_ptr()) == 1 {
            return;
        }
        let p = ffi::PyCapsule_GetPointer(cap, NAME.as_ptr()) as *mut DLManagedTensor;
        if p.is_null() {
            ffi::PyErr_Clear();
            return;
        }
        deleter(p);
    }
}

/// A DLPack capsule viewing `[offset, offset + nbytes)` of `region` as a 1-D uint8 CPU tensor.
/// The caller has checked the range against `region.len()`.
pub fn capsule<'py>(
    py: Python<'py>,
    region: Arc<HostRegion>,
    offset: usize,
    nbytes: usize,
) -> PyResult<Bound<'py, PyAny>> {
    debug_assert!(offset
        .checked_add(nbytes)
        .is_some_and(|e| e <= region.len()));
    // SAFETY: offset <= region.len() (checked by the caller), so the pointer stays inside the mapping.
    let data = unsafe { region.as_ptr().add(offset) } as *mut c_void;
    let ctx = Box::new(Ctx {
        managed: DLManagedTensor {
            dl_tensor: DLTensor {
                data,
                device: DLDevice {
                    device_type: K_DL_CPU,
                    device_id: 0,
                },
                ndim: 1,
                dtype: DLDataType {
                    code: K_DL_UINT,
                    bits: 8,
                    lanes: 1,
                },
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(deleter),
        },
        shape: [nbytes as i64],
        strides: [1],
        _region: region,
    });
    let raw = Box::into_raw(ctx);
    // `raw` is a live, uniquely owned Box allocation; the self-pointers set here stay valid because
    // the Box never moves until `deleter` frees it.
    // SAFETY: `raw` is a live, uniquely owned Box allocation that never moves.
    let managed = unsafe {
        (*raw).managed.dl_tensor.shape = (*raw).shape.as_mut_ptr();
        (*raw).managed.dl_tensor.strides = (*raw).strides.as_mut_ptr();
        (*raw).managed.manager_ctx = raw as *mut c_void;
        &mut (*raw).managed as *mut DLManagedTensor
    };
    // PyCapsule_New with a non-null pointer, a static name and a destructor that handles both the
    // consumed and unconsumed cases; on failure we free the context ourselves.
    // SAFETY: valid capsule arguments; on failure the context is freed here.
    unsafe {
        let cap = ffi::PyCapsule_New(
            managed as *mut c_void,
            NAME.as_ptr(),
            Some(capsule_destructor),
        );
        if cap.is_null() {
            deleter(managed);
            return Err(PyErr::fetch(py));
        }
        Ok(Bound::from_owned_ptr(py, cap))
    }
}
