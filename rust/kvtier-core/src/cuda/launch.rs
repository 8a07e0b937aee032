//! Kernel launches: a loaded `CUfunction` enqueued with its parameters by value.

use std::ffi::c_void;

use super::context::Current;
use super::driver::check;
use crate::error::{Error, Result};

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
}
