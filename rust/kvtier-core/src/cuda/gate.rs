//! Host gates: a point in a stream that the stream's later work does not pass until the host opens it.
//!
//! A restore that reads pages from disk while the GPU computes enqueues the loads of those pages at once,
//! behind a gate on the transfer stream, and opens the gate when the read has finished: the caller's thread
//! never waits for the disk to queue the work that follows. The gate is a host function
//! (`cuLaunchHostFunc`) that blocks on a condition variable; it makes no CUDA call. While it blocks, the
//! driver's thread for host functions waits with it: other host functions of the process run after it.

use std::ffi::c_void;
use std::sync::{Arc, Condvar, Mutex};

use super::context::Current;
use super::driver::check;
use crate::error::Result;

#[derive(Default)]
struct GateState {
    open: Mutex<bool>,
    opened: Condvar,
}

impl GateState {
    fn open(&self) {
        *self.open.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.opened.notify_all();
    }

    fn wait_open(&self) {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        while !*open {
            open = self.opened.wait(open).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn wait_open_for(&self, limit: std::time::Duration) -> bool {
        let open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let (open, _) = self
            .opened
            .wait_timeout_while(open, limit, |o| !*o)
            .unwrap_or_else(|p| p.into_inner());
        *open
    }
}

/// A gate, closed until [`HostGate::open`]. Dropping it opens it: no stream is ever left blocked by a gate
/// nobody can open any more.
#[derive(Default)]
pub struct HostGate {
    state: Arc<GateState>,
}

impl HostGate {
    /// A closed gate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Opens the gate: every stream waiting at it goes on. Idempotent.
    pub fn open(&self) {
        self.state.open();
    }

    /// True once opened.
    pub fn is_open(&self) -> bool {
        *self.state.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Blocks this thread until the gate is open (what the host function does on the driver's thread).
    pub fn wait_open(&self) {
        self.state.wait_open();
    }

    /// Blocks this thread until the gate is open or `limit` has passed; true if open.
    pub fn wait_open_for(&self, limit: std::time::Duration) -> bool {
        self.state.wait_open_for(limit)
    }
}

impl Drop for HostGate {
    fn drop(&mut self) {
        self.state.open();
    }
}

/// The host function: blocks until the gate whose state `user` points to is open. Never unwinds.
// SAFETY: callers pass a pointer from `Arc::into_raw` of a gate's state that carries one count for this call.
unsafe extern "C" fn wait_at_gate(user: *mut c_void) {
    // The count `user` carries is taken back here, once.
    // SAFETY: `user` is the pointer `Arc::into_raw` made in `enqueue_gate` for exactly this one call.
    let state = unsafe { Arc::from_raw(user as *const GateState) };
    state.wait_open();
}

impl Current {
    /// Enqueues `gate` on `stream`: the work enqueued on `stream` after it does not start before the gate is
    /// open. Opening the gate before the stream reaches it lets the stream pass at once.
    ///
    /// # Safety
    /// `stream` must be a live stream of this context (or 0, the legacy default stream).
    pub unsafe fn enqueue_gate(&self, stream: usize, gate: &HostGate) -> Result<()> {
        let user = Arc::into_raw(gate.state.clone()) as *mut c_void;
        let f = self.d.launch_host_func;
        // `user` stays valid until the host function runs: it owns one count of the gate's state.
        // SAFETY: per the contract; `wait_at_gate` has the `CUhostFn` signature and `user` is a live count.
        let rc = unsafe { f(stream as *mut c_void, wait_at_gate, user) };
        if rc != 0 {
            // SAFETY: the driver refused the launch, so the host function will never run: take the count back.
            drop(unsafe { Arc::from_raw(user as *const GateState) });
        }
        check("cuLaunchHostFunc", rc, String::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_host_function_returns_only_once_the_gate_opens() {
        let gate = HostGate::new();
        let user = Arc::into_raw(gate.state.clone()) as usize;
        let waiter = std::thread::spawn(move || {
            // SAFETY: the pointer carries one count of the gate's state, given to this one call.
            unsafe { wait_at_gate(user as *mut c_void) };
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !waiter.is_finished(),
            "the host function passed a closed gate"
        );
        assert!(!gate.is_open());
        gate.open();
        waiter.join().unwrap();
        assert!(gate.is_open());
        assert_eq!(
            Arc::strong_count(&gate.state),
            1,
            "the host function's count was not given back"
        );
    }

    #[test]
    fn dropping_a_gate_opens_it() {
        let gate = HostGate::new();
        let state = gate.state.clone();
        let user = Arc::into_raw(gate.state.clone()) as usize;
        let waiter = std::thread::spawn(move || {
            // SAFETY: as above.
            unsafe { wait_at_gate(user as *mut c_void) };
        });
        drop(gate);
        waiter.join().unwrap();
        assert!(*state.open.lock().unwrap());
    }

    #[test]
    fn an_open_gate_lets_the_host_function_pass_at_once() {
        let gate = HostGate::new();
        gate.open();
        gate.open();
        let user = Arc::into_raw(gate.state.clone()) as *mut c_void;
        // SAFETY: as above.
        unsafe { wait_at_gate(user) };
        assert_eq!(Arc::strong_count(&gate.state), 1);
    }
}
