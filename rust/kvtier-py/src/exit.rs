//! IO calls that may return while the interpreter exits.
//!
//! kvtier's deadlines leave a stalled call running on a daemon thread, and engines call the store from
//! daemon threads of their own. When such a call returns while the interpreter is finalizing, re-entering it
//! ends the thread (CPython 3.11-3.13 call `pthread_exit` on taking the GIL back), and that forced unwind
//! through this module's frames aborts the process. So:
//!
//! - an `atexit` hook (registered when the module loads; atexit runs before finalization starts) marks the
//!   process exiting, then waits (at most a second, GIL released) for the calls that had already returned
//!   and were taking the GIL back, so none is still waiting for it when finalization starts;
//! - [`detach_io`] runs a call with the GIL released; a call that returns on a thread other than the one
//!   exiting parks that thread for good instead of taking the GIL back once the interpreter is finalizing,
//!   and, once the process is exiting (the hook ran), waits up to [`EXIT_GRACE`] for finalization to start
//!   before taking the GIL back: an atexit hook that runs after kvtier's may still be joining that thread.

use std::ffi::{c_int, CStr};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering::SeqCst};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use pyo3::prelude::*;

type IsFinalizing = unsafe extern "C" fn() -> c_int;

static EXITING: AtomicBool = AtomicBool::new(false);
/// The thread that ran the exit hook (the one finalizing), or 0.
static EXIT_THREAD: AtomicI64 = AtomicI64::new(0);
/// Calls that returned from their IO and are taking the GIL back.
static RETURNING: AtomicUsize = AtomicUsize::new(0);

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

fn thread_id() -> i64 {
    // SAFETY: gettid only reads the calling thread's id.
    i64::from(unsafe { libc::syscall(libc::SYS_gettid) } as i32)
}

/// How long a call returning while the process exits waits for finalization to start (then parks) before
/// it takes the GIL back (see the module docs).
const EXIT_GRACE: Duration = Duration::from_millis(50);

fn finalizing() -> bool {
    // SAFETY: CPython's is-finalizing functions read the runtime's finalizing state with an atomic load
    // and take no lock; they need no thread state.
    is_finalizing_fn().is_some_and(|f| unsafe { f() } != 0)
}

/// Whether a call returning on this thread must never take the GIL back.
fn must_park() -> bool {
    let me = thread_id();
    if EXITING.load(SeqCst) {
        if me == EXIT_THREAD.load(SeqCst) {
            return false;
        }
        let until = Instant::now() + EXIT_GRACE;
        while Instant::now() < until {
            if finalizing() {
                return true;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        return finalizing();
    }
    // (no hook ran: the main thread is the one finalizing)
    // SAFETY: getpid only reads the process's id.
    finalizing() && me != i64::from(unsafe { libc::getpid() })
}

/// `f()` with the GIL released; a call that returns on another thread while the process exits never comes
/// back to the interpreter (see the module docs).
pub(crate) fn detach_io<T, F>(py: Python<'_>, f: F) -> T
where
    F: Send + FnOnce() -> T,
    T: Send,
{
    let r = py.detach(|| {
        let r = f();
        RETURNING.fetch_add(1, SeqCst); // (before the check: the hook either waits for us or we park)
        if must_park() {
            RETURNING.fetch_sub(1, SeqCst);
            drop(r);
            loop {
                std::thread::park();
            }
        }
        r
    });
    RETURNING.fetch_sub(1, SeqCst);
    r
}

/// The exit hook (see the module docs).
#[pyfunction]
fn _kvtier_at_exit(py: Python<'_>) {
    EXIT_THREAD.store(thread_id(), SeqCst);
    EXITING.store(true, SeqCst);
    py.detach(|| {
        let until = Instant::now() + Duration::from_secs(1);
        while RETURNING.load(SeqCst) > 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_micros(200));
        }
    });
}

/// Registers the exit hook with `atexit`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let hook = wrap_pyfunction!(_kvtier_at_exit, m)?;
    m.py().import("atexit")?.call_method1("register", (hook,))?;
    Ok(())
}
