//! The store's tests, one module per concern, and the fixtures they share: a fresh directory, options,
//! payloads with distinct bytes, single-object put and get, crash copies.

mod background;
mod background_steps;
mod basic;
mod budget;
mod coded;
mod compaction;
mod compaction_races;
mod disk;
mod erase;
mod faults;
mod follower_races;
mod journal;
mod lifecycle;
mod maintenance;
mod pages;
mod pages_in_two;
mod pieces;
mod seal;
mod staging;

use super::*;
use std::sync::Mutex as StdMutex;

/// Store tests share the process-wide fault table: run them one at a time.
pub(super) static SERIAL: StdMutex<()> = StdMutex::new(());

pub(super) fn tmp() -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "kvtier-store-{}-{}",
        std::process::id(),
        rand_u64()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub(super) fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64,
    );
    h.finish()
}

pub(super) fn opts(cap: u64) -> StoreOptions {
    StoreOptions {
        capacity_bytes: cap,
        budget_bytes: None,
        io_threads: 4,
        direct: None,
        keyring: None,
        codec: None,
    }
}

/// An aligned buffer holding `n` objects of `len` bytes with distinct contents.
pub(super) fn payload(n: usize, len: usize, seed: u8) -> crate::buffer::HostRegion {
    let r =
        crate::buffer::HostRegion::new(n * len.div_ceil(4096) * 4096 + 4096, &Default::default())
            .unwrap();
    // SAFETY: the region owns its bytes.
    let s = unsafe { std::slice::from_raw_parts_mut(r.as_ptr(), r.len()) };
    // xorshift64: no run of bytes repeats within a region, so a piece read to the wrong place or in the
    // wrong order cannot compare equal
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ u64::from(seed);
    for b in s.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    r
}

/// 64 hex characters and a suffix, as HiCache names page objects.
pub(super) fn page_key(i: usize) -> String {
    format!("{i:064x}.k")
}

/// Puts 4 KiB objects, key `k` holding object `c` of `src` for each `(k, c)`; whether each was stored.
pub(super) fn put_pages(
    s: &PageStore,
    keys: &[(String, usize)],
    src: &crate::buffer::HostRegion,
) -> Vec<bool> {
    let objs: Vec<(&str, usize, u64)> = keys
        .iter()
        .map(|(k, c)| (k.as_str(), src.as_ptr() as usize + c * 4096, 4096))
        .collect();
    // SAFETY: every object lies inside `src`.
    unsafe { s.put(&objs) }.unwrap()
}

pub(super) fn put1(s: &PageStore, key: &str, ptr: usize, len: u64) -> bool {
    // SAFETY: callers pass memory of a live region of at least len bytes.
    unsafe { s.put(&[(key, ptr, len)]) }.unwrap()[0]
}

pub(super) fn get1(s: &PageStore, key: &str, ptr: usize, len: u64) -> bool {
    // SAFETY: as put1.
    unsafe { s.get(&[(key, ptr, len)]) }.unwrap()[0]
}

/// Copies the namespace directory of `s` under `to` (a crash now: every file as it is). A file that went
/// between the listing and its copy (a `STATS.tmp` the background thread renamed) is no store file.
pub(super) fn crash_copy(s: &Shared, to: &Path) {
    let d = to.join(s.dir().file_name().unwrap());
    std::fs::create_dir_all(&d).unwrap();
    for e in std::fs::read_dir(s.dir()).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            match std::fs::copy(e.path(), d.join(e.file_name())) {
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                other => {
                    other.unwrap();
                }
            }
        }
    }
}

pub(super) fn bytes_at(r: &crate::buffer::HostRegion, off: usize, n: usize) -> Vec<u8> {
    // SAFETY: callers pass ranges inside the live region.
    unsafe { std::slice::from_raw_parts(r.as_ptr().add(off), n).to_vec() }
}
