//! Fault injection for tests: named points in the page store's IO path (`fallocate`, `data_write`,
//! `data_sync`, `data_read`, `journal_write`, `journal_sync`) can be made to fail with a chosen errno.
//! Compiled to a no-op unless the `failpoints` feature (or `cfg(test)`) is on.

use std::io;

#[cfg(any(test, feature = "failpoints"))]
mod imp {
    use std::collections::HashMap;
    use std::io;
    use std::sync::Mutex;

    /// (calls to let through before failing, failures left, errno)
    type Point = (u64, u64, i32);
    /// point name -> its schedule
    static POINTS: Mutex<Option<HashMap<String, Point>>> = Mutex::new(None);

    pub fn set(point: &str, skip: u64, times: u64, errno: i32) {
        let mut g = POINTS.lock().unwrap_or_else(|p| p.into_inner());
        g.get_or_insert_with(HashMap::new)
            .insert(point.to_owned(), (skip, times, errno));
    }

    pub fn clear() {
        *POINTS.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    pub fn check(point: &str) -> io::Result<()> {
        let mut g = POINTS.lock().unwrap_or_else(|p| p.into_inner());
        let Some(map) = g.as_mut() else { return Ok(()) };
        let Some(st) = map.get_mut(point) else {
            return Ok(());
        };
        if st.0 > 0 {
            st.0 -= 1;
            return Ok(());
        }
        if st.1 == 0 {
            return Ok(());
        }
        st.1 -= 1;
        Err(io::Error::from_raw_os_error(st.2))
    }
}

/// Fails the next `times` calls of `point` after letting `skip` through, with `errno`.
#[cfg(any(test, feature = "failpoints"))]
pub fn set(point: &str, skip: u64, times: u64, errno: i32) {
    imp::set(point, skip, times, errno)
}

/// Removes every injected fault.
#[cfg(any(test, feature = "failpoints"))]
pub fn clear() {
    imp::clear()
}

/// Ok unless a fault is injected at `point`.
#[inline]
pub fn check(point: &str) -> io::Result<()> {
    #[cfg(any(test, feature = "failpoints"))]
    {
        imp::check(point)
    }
    #[cfg(not(any(test, feature = "failpoints")))]
    {
        let _ = point;
        Ok(())
    }
}
