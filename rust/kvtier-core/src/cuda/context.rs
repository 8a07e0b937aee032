//! Primary contexts: retained once per device, made current on a thread for a sequence of driver calls.

use super::driver::{check, driver, CuContext, CuDevice, Driver};
use crate::error::Result;

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
pub(super) fn with_primary_ctx<T>(
    d: &Driver,
    device: i32,
    f: impl FnOnce() -> Result<T>,
) -> Result<T> {
    let ctx = primary_ctx(d, device)?;
    // SAFETY: ctx is a retained primary context (never released).
    unsafe { check("cuCtxPushCurrent", (d.ctx_push)(ctx), String::new)? };
    let out = f();
    let mut popped: CuContext = std::ptr::null_mut();
    // SAFETY: pops the context pushed above on this same thread.
    unsafe { (d.ctx_pop)(&mut popped) };
    out
}

/// The primary context of one device, current on this thread for a sequence of driver calls (popped when
/// dropped). Not `Send`: a context is current per thread.
pub struct Current {
    pub(super) d: &'static Driver,
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
