//! IO calls that may return while the interpreter exits.
//!
//! kvtier's deadlines leave a stalled call running on a daemon thread, and engines call the store from
//! daemon threads of their own. When such a call returns while the interpreter is finalizing, re-entering it
//! ends the thread (CPython 3.11-3.13 call `pthread_exit` on taking the GIL back), and that forced unwind
//! through this module's frames (pyo3's trampoline catches it) aborts the process. [`detach_io`] runs a call
//! with the GIL released and, when it returns on a thread other than the main one while the interpreter is
//! finalizing, parks that thread for good instead of taking the GIL back: the process is exiting.
//!
//! That check and the wait for the GIL are not one step: a call that returns just before finalization starts
//! and is still waiting for the GIL when it does dies in that wait. Page batches and staging copies, the calls
//! engine and tier threads make all the time, close that window with [`submit_io`]: the call runs on a thread
//! of this module's own, and the caller waits for it in CPython's frames (`os.read` of an eventfd, then
//! `PendingIo.result()`, which holds the GIL throughout), so a thread the interpreter ends while it waits
//! ends in CPython's code, as any daemon thread does. The other store calls (delete, erase, verify, ...)
//! keep the window: they are not made in a loop, nor left running at a deadline.

use std::ffi::{c_int, CStr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use kvtier_core::Error;
use pyo3::prelude::*;
use pyo3::IntoPyObjectExt;

use crate::errors::KvResult;

type IsFinalizing = unsafe extern "C" fn() -> c_int;

/// `Py_IsFinalizing` (3.13+) or `_Py_IsFinalizing` (3.11, 3.12), looked up at run time: neither is in the
/// limited API this module is built against.
fn is_finalizing_fn() -> Option<IsFinalizing> {
    static F: OnceLock<Option<IsFinalizing>> = OnceLock::new();
    *F.get_or_init(|| {
        let names: [&CStr; 2] = [c"Py_IsFinalizing", c"_Py_IsFinalizing"];
        names.into_iter().find_map(|name| {
            // RTLD_DEFAULT searches the objects already loaded (the interpreter among them).
            // SAFETY: `name` is NUL-terminated; dlsym returns null when no object defines the symbol.
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
    // CPython's is-finalizing functions read the runtime's finalizing state with an atomic load.
    // SAFETY: they take no lock and need no thread state.
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

/// What a call run by [`submit_io`] gives back.
pub(crate) enum Outcome {
    /// Per key, whether it was stored or found and verified.
    Flags(Vec<bool>),
    /// Done, nothing to report.
    Unit,
}

struct Done {
    fd: OwnedFd,
    result: Mutex<Option<kvtier_core::Result<Outcome>>>,
    returned: AtomicBool,
}

/// A call running on a thread of its own (see the module docs): wait until `fileno()` is readable
/// (`os.read(fileno(), 8)`), then `result()`.
#[pyclass(name = "PendingIo", module = "kvtier._native", frozen)]
pub struct PyPendingIo {
    done: Arc<Done>,
}

/// Runs `f` on a new thread and answers at once; nothing runs when the thread cannot be started.
pub(crate) fn submit_io<F>(f: F) -> KvResult<PyPendingIo>
where
    F: FnOnce() -> kvtier_core::Result<Outcome> + Send + 'static,
{
    // SAFETY: eventfd takes no pointer; its result is checked before use.
    let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if raw < 0 {
        return Err(Error::last_os("eventfd for a pending IO call").into());
    }
    // SAFETY: `raw` is a descriptor eventfd just opened; nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let done = Arc::new(Done {
        fd,
        result: Mutex::new(None),
        returned: AtomicBool::new(false),
    });
    let d = done.clone();
    std::thread::Builder::new()
        .name("kvtier-io".into())
        .spawn(move || {
            let r = std::panic::catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
                Err(Error::Os {
                    what: "a store call panicked".into(),
                    source: std::io::Error::other("panic"),
                })
            });
            *d.result.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
            d.returned.store(true, Ordering::Release);
            let one: u64 = 1;
            // An eventfd counter of 1 cannot overflow, so the write cannot fail or block.
            // SAFETY: writes the 8 bytes of a live u64 to the eventfd `d` owns (open while `d` lives).
            unsafe { libc::write(d.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        })
        .map_err(|e| Error::Os {
            what: "starting a thread for a store call".into(),
            source: e,
        })?;
    Ok(PyPendingIo { done })
}

#[pymethods]
impl PyPendingIo {
    /// The eventfd that becomes readable (8 bytes) when the call has returned.
    fn fileno(&self) -> i32 {
        self.done.fd.as_raw_fd()
    }

    /// Whether the call has returned.
    fn done(&self) -> bool {
        self.done.returned.load(Ordering::Acquire)
    }

    /// The call's answer (a list of flags, or None), or its error; once. Raises when the call has not
    /// returned yet.
    fn result(&self, py: Python<'_>) -> KvResult<Py<PyAny>> {
        let taken = self
            .done
            .result
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        match taken {
            None => Err(Error::arg(
                "result",
                "the call has not returned, or its result was taken (wait for fileno() first)",
            )
            .into()),
            Some(Err(e)) => Err(e.into()),
            Some(Ok(Outcome::Flags(v))) => Ok(v.into_py_any(py)?),
            Some(Ok(Outcome::Unit)) => Ok(py.None()),
        }
    }
}
