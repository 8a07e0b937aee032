//! Fault injection for tests and chaos runs: named points in the page store's IO path ([`POINTS`]: block
//! allocation, object writes, syncs and reads, journal appends, syncs, cut-backs and reserve growth, hole
//! punching, the O_DIRECT probe, compaction, the directory sync that makes a file's name durable) can be made to fail with a chosen errno, to stall (a slow
//! disk), or — at `data_write` and `journal_write` — to write only part of what was asked, reporting an
//! error (a short write) or, at `data_write`, success (a torn write, which only the checksum on read can
//! catch).
//!
//! Compiled to a no-op unless the `failpoints` feature (or `cfg(test)`) is on. When compiled in, a point
//! with nothing injected costs one atomic (acquire) load while no fault is armed. The table is process-wide: faults set by one test
//! are seen by every store in the process.

use std::io;
use std::time::Duration;

/// What an IO point does when a fault is due.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Fail with this errno; nothing is written or read.
    Error(i32),
    /// Sleep this long, then do the IO normally (a slow disk).
    Delay(Duration),
    /// Block until the faults are cleared ([`clear`]), or at most this long, then do the IO normally (a hung
    /// disk: a dead NFS server, a dying SSD, a throttle to zero).
    Stall(Duration),
    /// `data_write` only: write the first half of the object, then fail with this errno.
    Short(i32),
    /// `data_write` only: write the first half of the object followed by zeros and report success.
    Torn,
}

/// The IO points the store checks.
pub const POINTS: [&str; 12] = [
    "fallocate",
    "data_write",
    "data_sync",
    "data_read",
    "journal_write",
    "journal_sync",
    "journal_cut",
    "journal_reserve",
    "punch",
    "probe",
    "compact",
    "dir_sync",
];

#[cfg(any(test, feature = "failpoints"))]
mod imp {
    use super::Fault;
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Mutex;

    /// A point's schedule: calls to let through before faulting, faults left, what to do.
    struct Point {
        skip: u64,
        times: u64,
        fault: Fault,
        hits: u64,
    }

    static ACTIVE: AtomicBool = AtomicBool::new(false);
    /// Bumped by every `clear`: a stalled IO point waits for it to move.
    static EPOCH: AtomicU64 = AtomicU64::new(0);

    pub fn epoch() -> u64 {
        EPOCH.load(Ordering::Acquire)
    }
    static POINTS: Mutex<Option<HashMap<String, Point>>> = Mutex::new(None);

    pub fn set(point: &str, skip: u64, times: u64, fault: Fault) {
        let mut g = POINTS.lock().unwrap_or_else(|p| p.into_inner());
        g.get_or_insert_with(HashMap::new).insert(
            point.to_owned(),
            Point {
                skip,
                times,
                fault,
                hits: 0,
            },
        );
        ACTIVE.store(true, Ordering::Release);
    }

    pub fn clear() {
        let mut g = POINTS.lock().unwrap_or_else(|p| p.into_inner());
        *g = None;
        ACTIVE.store(false, Ordering::Release);
        EPOCH.fetch_add(1, Ordering::AcqRel);
    }

    pub fn hits(point: &str) -> u64 {
        let g = POINTS.lock().unwrap_or_else(|p| p.into_inner());
        g.as_ref().and_then(|m| m.get(point)).map_or(0, |p| p.hits)
    }

    pub fn take(point: &str) -> Option<Fault> {
        if !ACTIVE.load(Ordering::Acquire) {
            return None;
        }
        let mut g = POINTS.lock().unwrap_or_else(|p| p.into_inner());
        let st = g.as_mut()?.get_mut(point)?;
        if st.skip > 0 {
            st.skip -= 1;
            return None;
        }
        if st.times == 0 {
            return None;
        }
        st.times -= 1;
        st.hits += 1;
        let fault = st.fault;
        if st.times == 0 && g.as_ref().is_some_and(|m| m.values().all(|p| p.times == 0)) {
            // nothing armed any more: back to the lock-free fast path (hit counts stay readable)
            ACTIVE.store(false, Ordering::Release);
        }
        Some(fault)
    }
}

/// Injects `fault` into the next `times` calls of `point` after letting `skip` through (`u64::MAX` times:
/// every call). Replaces what was set for `point`.
#[cfg(any(test, feature = "failpoints"))]
pub fn set(point: &str, skip: u64, times: u64, fault: Fault) {
    imp::set(point, skip, times, fault)
}

/// Removes every injected fault and releases every IO point stalled by [`Fault::Stall`].
#[cfg(any(test, feature = "failpoints"))]
pub fn clear() {
    imp::clear()
}

/// How many faults `point` has delivered since it was set.
#[cfg(any(test, feature = "failpoints"))]
pub fn hits(point: &str) -> u64 {
    imp::hits(point)
}

/// The fault due at `point` now, if any (consumes it).
#[inline]
pub fn take(point: &str) -> Option<Fault> {
    #[cfg(any(test, feature = "failpoints"))]
    {
        imp::take(point)
    }
    #[cfg(not(any(test, feature = "failpoints")))]
    {
        let _ = point;
        None
    }
}

/// Ok unless an error is due at `point`; a due delay sleeps first. (Short and torn writes apply where the
/// store writes object bytes, which calls [`take`] itself; at other points a short write is an error and a
/// torn one does nothing.)
#[inline]
pub fn check(point: &str) -> io::Result<()> {
    apply(take(point))
}

/// What a fault taken with [`take`] does at a point that has no partial IO: errors fail, delays sleep,
/// torn writes do nothing.
pub fn apply(fault: Option<Fault>) -> io::Result<()> {
    match fault {
        None | Some(Fault::Torn) => Ok(()),
        Some(Fault::Delay(d)) => {
            std::thread::sleep(d);
            Ok(())
        }
        Some(Fault::Stall(cap)) => {
            stall(cap);
            Ok(())
        }
        Some(Fault::Error(e)) | Some(Fault::Short(e)) => Err(io::Error::from_raw_os_error(e)),
    }
}

/// Blocks until the faults are cleared or `cap` has passed.
fn stall(cap: Duration) {
    #[cfg(any(test, feature = "failpoints"))]
    {
        let (seen, t0) = (imp::epoch(), std::time::Instant::now());
        while imp::epoch() == seen && t0.elapsed() < cap {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    #[cfg(not(any(test, feature = "failpoints")))]
    let _ = cap;
}
