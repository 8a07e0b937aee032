//! Events and streams: recording, waiting and synchronising, and the [`Lanes`] of one submission.

use std::ffi::c_void;

use super::context::Current;
use super::driver::check;
use crate::error::Result;

/// `CU_EVENT_DISABLE_TIMING`: events used only for ordering are cheaper without timestamps.
const CU_EVENT_DISABLE_TIMING: u32 = 0x2;

impl Current {
    /// Records `event` on `stream` (both of this context).
    ///
    /// # Safety
    /// `event` must be a live `CUevent` and `stream` a live stream (or 0) of this context.
    pub unsafe fn record_event(&self, event: usize, stream: usize) -> Result<()> {
        // SAFETY: per the contract.
        let rc = unsafe { (self.d.event_record)(event as *mut c_void, stream as *mut c_void) };
        check("cuEventRecord", rc, || format!(" (event {event:#x})"))
    }

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
