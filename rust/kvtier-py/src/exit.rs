//! IO calls that may return while the interpreter exits.
//!
//! kvtier's deadlines leave a stalled call running on a daemon thread, and engines call the store from
//! daemon threads of their own. When such a call returns while the interpreter is finalizing, re-entering it
//! ends the thread (CPython 3.11-3.13 call `pthread_exit` on taking the GIL back), and that forced unwind
//! through this module's frames (pyo3's trampoline catches it) aborts the process. [`detach_io`] runs a call
//! with the GIL released and, when it returns on a thread other than the main one while the interpreter is
//! finalizing, parks that thread for good instead of taking the GIL back: the process is exiting.
//!
//! What is left: a call that returns just before finalization starts and is still waiting for the GIL when
//! it does dies in that wait (the check and the wait are not one step). Closing that needs the wait for the
//! IO to happen in CPython's own frames, not in this module's.

use std::ffi::{c_int, CStr};
use std::sync::OnceLock;

use pyo3::prelude::*;

type IsFinalizing = unsafe extern "C" fn() -> c_int;

/// `Py_IsFinalizing` (3.13+) or `_Py_IsFinalizing` (3.11, 3.12), looked up at run time: neither is in the
/// limited API this module is built against.
fn is_finalizing_fn() -> Option<IsFinalizing> {
    static F: OnceLock<Option<IsFinalizing>> = OnceLock::new();
    *F.get_or_init(|| {
        let names: [&CStr; 2] = [c"Py_IsFinalizing", c"_Py_IsFinalizing"];
        names.into_iter().find_map(|name| {
            // SAFETY: `name` is NUL-terminated; RTLD_DEFAULT searches the objects already loaded (the
            // interpreter among them) and returns null when none defines the symbol.
            let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
            if p.is_null() {
                return None;
            }
            // SAFETY: both symbols are CPython's `int (void)` functions of that name.
            Some(unsafe { std::mem::transmute::<*mut libc::c_void, IsFinalizing>(p) })
        })
    })
}

/// Whether the interpreter is finalizing and this thread is not the main one (the one finalizing).
fn exiting_elsewhere() -> bool {
    let Some(f) = is_finalizing_fn() else {
        return false;
    };
    // SAFETY: CPython's is-finalizing functions read the runtime's finalizing state with an atomic load
    // and take no lock; they need no thread state.
    if unsafe { f() } == 0 {
        return false;
    }
    // SAFETY: getpid and gettid only read the calling process's and thread's ids.
    unsafe { libc::syscall(libc::SYS_gettid) != libc::c_long::from(libc::getpid()) }
}

/// `f()` with the GIL released; a call that returns on a daemon thread while the interpreter exits never
/// comes back to it (see the module docs).
pub(crate) fn detach_io<T, F>(py: Python<'_>, f: F) -> T
where
    F: Send + FnOnce() -> T,
    T: Send,
{
    py.detach(|| {
        let r = f();
        if exiting_elsewhere() {
            drop(r);
            loop {
                std::thread::park();
            }
        }
        r
    })
}
