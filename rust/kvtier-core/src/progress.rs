//! Progress of a long step (pre-faulting a host region, registering it with the CUDA driver), counted by
//! the threads doing it and read by another thread while the call runs.

/// Bytes done of the running step (pre-faulting, then CUDA registration), for progress shown by another
/// thread while a long call runs.
#[derive(Debug, Default)]
pub struct Progress {
    /// Bytes done so far.
    pub done: std::sync::atomic::AtomicU64,
    /// Bytes the step will do.
    pub total: std::sync::atomic::AtomicU64,
}

impl Progress {
    /// Starts a step of `total` bytes.
    pub fn start(&self, total: usize) {
        use std::sync::atomic::Ordering::Relaxed;
        self.done.store(0, Relaxed);
        self.total.store(total as u64, Relaxed);
    }

    /// Adds `n` bytes done.
    pub fn add(&self, n: usize) {
        self.done
            .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
    }
}
