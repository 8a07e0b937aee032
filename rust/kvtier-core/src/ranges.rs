//! Host memory a caller registered for IO, each range kept alive by an owner for as long as the registry
//! lives; the checks that every object range lies inside it before a byte moves; and checksums of objects
//! in it (a remote tier's integrity records).
//!
//! The page store keeps one registry for its own IO; a tier whose IO another library performs (the
//! Mooncake cluster tier hands addresses to Mooncake's client) keeps one to prove each address in range
//! before handing it over, and to checksum what it sends and what it received.

use std::any::Any;
use std::sync::{Arc, Mutex};

use crate::buffer::HostRegion;
use crate::error::{Error, Result};
use crate::seal::{Keyring, Seal};

#[derive(Clone)]
struct Registered {
    ptr: usize,
    len: usize,
    /// `HostRegion`s are compared by identity, to register each once.
    region: Option<Arc<HostRegion>>,
    _owner: Arc<dyn Any + Send + Sync>,
}

impl Registered {
    fn holds(&self, p: usize, n: u64) -> bool {
        p >= self.ptr && (p as u128 + n as u128) <= (self.ptr as u128 + self.len as u128)
    }
}

/// Registered ranges (see the module docs). Registrations are never removed: memory stays alive as long as
/// the registry (and any [`Held`] snapshot of it).
#[derive(Default)]
pub struct Ranges {
    ranges: Mutex<Vec<Registered>>,
}

/// A snapshot of the registered ranges; it keeps their memory alive while a call uses it.
pub struct Held(Vec<Registered>);

impl Held {
    /// Whether `[p, p + n)` lies inside one registered range.
    pub fn holds(&self, p: usize, n: u64) -> bool {
        self.0.iter().any(|r| r.holds(p, n))
    }

    /// Number of registered ranges.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Checks every `(address, length)` lies inside registered memory and, with `disjoint`, that no two
    /// overlap (destinations of one batch). `what` names the argument in the error.
    pub fn check(&self, what: &str, objs: &[(usize, u64)], disjoint: bool) -> Result<()> {
        for (i, &(p, n)) in objs.iter().enumerate() {
            if !self.holds(p, n) {
                return Err(Error::arg(
                    what,
                    format!(
                        "object {i} ({n} bytes at {p:#x}) is outside every registered host buffer"
                    ),
                ));
            }
        }
        if disjoint {
            let mut v = objs.to_vec();
            v.sort_unstable();
            if v.windows(2)
                .any(|w| (w[0].0 as u128 + w[0].1 as u128) > w[1].0 as u128)
            {
                return Err(Error::arg(
                    what,
                    "two objects of one batch would be read into overlapping memory",
                ));
            }
        }
        Ok(())
    }
}

impl Ranges {
    /// The registered ranges, kept alive while the snapshot lives.
    pub fn snapshot(&self) -> Held {
        Held(self.lock().clone())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Registered>> {
        self.ranges.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Allows IO into and out of `region`, kept mapped until the registry is dropped (each region once).
    pub fn register_region(&self, region: Arc<HostRegion>) {
        let mut rs = self.lock();
        if !rs
            .iter()
            .any(|r| r.region.as_ref().is_some_and(|x| Arc::ptr_eq(x, &region)))
        {
            let (ptr, len) = (region.as_ptr() as usize, region.len());
            rs.push(Registered {
                ptr,
                len,
                region: Some(region.clone()),
                _owner: region,
            });
        }
    }

    /// Allows IO into and out of `[ptr, ptr + len)`, memory the caller does not own through kvtier (an
    /// engine's own host pool); the registry holds `owner` until it is dropped.
    ///
    /// # Safety
    /// The range must be live, readable and writable host memory for as long as `owner` is alive, and the
    /// caller orders its own accesses to it against the batches it issues.
    pub unsafe fn register_foreign(
        &self,
        ptr: usize,
        len: usize,
        owner: Arc<dyn Any + Send + Sync>,
    ) {
        self.lock().push(Registered {
            ptr,
            len,
            region: None,
            _owner: owner,
        });
    }

    /// crc32c of each object's bytes followed by its key (the page store's convention: a checksum binds
    /// the bytes to the key they were stored under), every range checked first. Large batches are summed
    /// on several threads.
    pub fn crc32c(&self, objs: &[(&str, usize, u64)]) -> Result<Vec<u32>> {
        let held = self.snapshot();
        let spans: Vec<(usize, u64)> = objs.iter().map(|o| (o.1, o.2)).collect();
        held.check("host_indices", &spans, false)?;
        let out = par_map(objs, total(&spans), |o| {
            // every range lies inside registered memory that `held` keeps alive for this call (checked
            // above); the caller orders writes to it against this call (as for a page store put).
            // SAFETY: live, readable memory of `o.2` bytes at `o.1`.
            let bytes = unsafe { std::slice::from_raw_parts(o.1 as *const u8, o.2 as usize) };
            crate::hash::object_crc(bytes, o.0)
        });
        drop(held);
        Ok(out)
    }

    /// Seals objects `(name, address, length)` with their tenants' keys from `ring` (`tenants[i]`: object
    /// i's stored tenant tag, [`Keyring::stored_tag`], None for the default tenant; a tenant without a key
    /// gets one, an erased tenant none): object i is copied to `dsts[i]` (its own address: sealed in place)
    /// and sealed there, `name` authenticated with it. Per object its seal, or None if it could not be
    /// sealed. Every range is checked (sources inside registered memory; destinations inside it and
    /// disjoint, and apart from every other source) before any byte moves.
    pub fn seal_into(
        &self,
        ring: &Keyring,
        objs: &[(&str, usize, u64)],
        tenants: &[Option<&str>],
        dsts: &[usize],
    ) -> Result<Vec<Option<Seal>>> {
        if dsts.len() != objs.len() || tenants.len() != objs.len() {
            return Err(Error::arg(
                "dsts",
                format!(
                    "{} destinations and {} tenants for {} objects",
                    dsts.len(),
                    tenants.len(),
                    objs.len()
                ),
            ));
        }
        let held = self.snapshot();
        let src: Vec<(usize, u64)> = objs.iter().map(|o| (o.1, o.2)).collect();
        let dst: Vec<(usize, u64)> = objs.iter().zip(dsts).map(|(o, &d)| (d, o.2)).collect();
        held.check("host_indices", &src, false)?;
        held.check("dsts", &dst, true)?;
        let moved: Vec<(usize, u64)> = src
            .iter()
            .zip(&dst)
            .filter(|(s, d)| s.0 != d.0)
            .map(|(s, _)| *s)
            .collect();
        let mut all = dst.clone();
        all.extend(moved);
        held.check("dsts", &all, true)?; // a copy never reads bytes another object's destination overwrites
        let keys = ring.keys_for(tenants, true);
        let with: Vec<(&Obj<'_>, usize, Option<&str>)> = objs
            .iter()
            .zip(dsts.iter().copied())
            .zip(tenants)
            .map(|((o, d), t)| (o, d, *t))
            .collect();
        let out = par_map(&with, total(&src), |(o, d, t)| {
            let k = keys.get(&t.map(str::to_owned))?.as_ref()?;
            // checked above: the destination lies inside registered memory `held` keeps alive and overlaps no
            // other destination nor any source but its own; the caller hands it to this call.
            // SAFETY: live, writable memory of `o.2` bytes at `d`, ours alone for the call.
            let buf = unsafe { std::slice::from_raw_parts_mut(*d as *mut u8, o.2 as usize) };
            if *d != o.1 {
                // SAFETY: the source is registered, live and (checked above) apart from the destination.
                let src = unsafe { std::slice::from_raw_parts(o.1 as *const u8, o.2 as usize) };
                buf.copy_from_slice(src);
            }
            k.seal(o.0, buf).ok()
        });
        drop(held);
        Ok(out)
    }

    /// Opens sealed objects in place; per object whether its tag verified (False: its bytes are
    /// unspecified). Every range is checked (inside registered memory, disjoint) before any byte changes.
    pub fn open_in_place(
        &self,
        ring: &Keyring,
        objs: &[(&str, usize, u64)],
        tenants: &[Option<&str>],
        seals: &[Seal],
    ) -> Result<Vec<bool>> {
        if seals.len() != objs.len() || tenants.len() != objs.len() {
            return Err(Error::arg(
                "seals",
                format!(
                    "{} seals and {} tenants for {} objects",
                    seals.len(),
                    tenants.len(),
                    objs.len()
                ),
            ));
        }
        let held = self.snapshot();
        let spans: Vec<(usize, u64)> = objs.iter().map(|o| (o.1, o.2)).collect();
        held.check("host_indices", &spans, true)?;
        let keys = ring.keys_for(tenants, false);
        let with: Vec<(&Obj<'_>, &Seal, Option<&str>)> = objs
            .iter()
            .zip(seals)
            .zip(tenants)
            .map(|((o, s), t)| (o, s, *t))
            .collect();
        let out = par_map(&with, total(&spans), |(o, seal, t)| {
            let Some(Some(k)) = keys.get(&t.map(str::to_owned)) else {
                return false;
            };
            // checked above: inside registered memory `held` keeps alive, disjoint from every other object of
            // the call; the caller hands these bytes to this call alone.
            // SAFETY: live, writable memory of `o.2` bytes at `o.1`, ours alone for the call.
            let buf = unsafe { std::slice::from_raw_parts_mut(o.1 as *mut u8, o.2 as usize) };
            k.open(o.0, buf, seal)
        });
        drop(held);
        Ok(out)
    }
}

/// An object: `(name, address, length)`.
type Obj<'a> = (&'a str, usize, u64);

fn total(spans: &[(usize, u64)]) -> u64 {
    spans.iter().map(|s| s.1).sum()
}

/// `f` over every object, on up to 8 threads once the batch (`bytes` in all) is large enough to pay for them.
fn par_map<T: Sync, R: Send + Default + Clone>(
    objs: &[T],
    bytes: u64,
    f: impl Fn(&T) -> R + Sync,
) -> Vec<R> {
    let threads = if bytes < (8 << 20) {
        1
    } else {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(8)
            .min(objs.len())
    };
    if threads <= 1 {
        return objs.iter().map(&f).collect();
    }
    let mut out = vec![R::default(); objs.len()];
    let per = objs.len().div_ceil(threads);
    let f = &f;
    std::thread::scope(|s| {
        for (chunk, dst) in objs.chunks(per).zip(out.chunks_mut(per)) {
            s.spawn(move || {
                for (o, d) in chunk.iter().zip(dst.iter_mut()) {
                    *d = f(o);
                }
            });
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(len: usize, fill: u8) -> Arc<HostRegion> {
        let r = Arc::new(HostRegion::new(len, &Default::default()).unwrap());
        // SAFETY: a fresh region of `len` bytes that nothing else references yet.
        unsafe { std::ptr::write_bytes(r.as_ptr(), fill, len) };
        r
    }

    #[test]
    fn checks_refuse_ranges_outside_registered_memory_and_overlapping_destinations() {
        let rs = Ranges::default();
        let r = region(1 << 16, 7);
        let base = r.as_ptr() as usize;
        assert!(rs.crc32c(&[("a", base, 16)]).is_err(), "nothing registered");
        rs.register_region(r.clone());
        rs.register_region(r.clone());
        assert_eq!(rs.snapshot().len(), 1, "a region is registered once");
        let held = rs.snapshot();
        assert!(held.check("x", &[(base, 1 << 16)], true).is_ok());
        assert!(
            held.check("x", &[(base + 1, 1 << 16)], false).is_err(),
            "one past the end"
        );
        assert!(
            held.check("x", &[(base, 64), (base + 32, 64)], true)
                .is_err(),
            "overlap"
        );
        assert!(
            held.check("x", &[(base, 64), (base + 32, 64)], false)
                .is_ok(),
            "sources may overlap"
        );
        assert!(
            held.check("x", &[(usize::MAX - 4, 64)], false).is_err(),
            "wraps the address space"
        );
    }

    #[test]
    fn checksums_bind_bytes_to_keys_and_match_on_any_thread_count() {
        let rs = Ranges::default();
        let r = region(32 << 20, 3);
        rs.register_region(r.clone());
        let base = r.as_ptr() as usize;
        let small = rs.crc32c(&[("k", base, 4096), ("v", base, 4096)]).unwrap();
        assert_ne!(small[0], small[1], "the key is part of the checksum");
        assert_eq!(
            small[0],
            crc32c::crc32c_append(crc32c::crc32c(&[3u8; 4096]), b"k")
        );
        let objs: Vec<(String, usize, u64)> = (0..32)
            .map(|i| (format!("p{i}"), base + i * (1 << 20), 1 << 20))
            .collect();
        let refs: Vec<(&str, usize, u64)> = objs.iter().map(|o| (o.0.as_str(), o.1, o.2)).collect();
        let big = rs.crc32c(&refs).unwrap(); // 32 MiB: several threads
        for (o, c) in refs.iter().zip(&big) {
            assert_eq!(
                *c,
                rs.crc32c(&[*o]).unwrap()[0],
                "threaded and single-object checksums agree"
            );
        }
    }
}
