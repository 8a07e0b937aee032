//! The disk under the store: the capacity as a hard limit on disk blocks, a full disk, failed growth, the
//! journal's extents counted at open, a reopen with a smaller capacity, the O_DIRECT probe, directory
//! syncs. Journal faults: `tests::journal`.

use super::journal::assert_all_back;
use super::{get1, opts, payload, put1, tmp, SERIAL};
use crate::fault::{self, Fault};
use crate::store::*;

/// The capacity bounds the blocks on disk — data files and journal — for small and odd capacities, under
/// churn of two size classes; after deletes free room the other class can be stored again.
#[test]
fn capacity_is_a_hard_limit_on_disk_blocks() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let src = payload(64, 8192, 24);
    let p = src.as_ptr() as usize;
    for cap in [64 << 10, 200 << 10, 800 << 10, 3 << 20] {
        let root = tmp();
        let s = PageStore::open(&root, "ns", opts(cap)).unwrap();
        for i in 0..400usize {
            let len = if i % 3 == 0 { 8192 } else { 4096 };
            let k = format!("key-{i}");
            // SAFETY: inside `src`.
            let ok = unsafe { s.put(&[(&k, p + (i % 60) * 8192, len)]) }.unwrap()[0];
            assert!(ok, "cap {cap}: put {i} failed: eviction must make room");
            if i % 7 == 0 {
                s.delete(&[format!("key-{}", i / 2).as_str()]).unwrap();
            }
            let (data, journal) = s.occupancy();
            assert!(
                data + journal <= cap,
                "cap {cap}, put {i}: {data} + {journal}"
            );
        }
        let blocks = s.disk_blocks();
        assert!(
            blocks <= cap + (64 << 10),
            "cap {cap}: {blocks} bytes of blocks on disk"
        );
        drop(s);
        let s = PageStore::open(&root, "ns", opts(cap)).unwrap();
        let blocks = s.disk_blocks();
        assert!(
            blocks <= cap + (64 << 10),
            "cap {cap} after reopen: {blocks}"
        );
        std::fs::remove_dir_all(root).unwrap();
    }
}

/// A full disk (every allocation fails) fails puts, not the store: deletes still work (prepaid), and once
/// there is room again, puts of either class succeed.
#[test]
fn full_disk_drains_and_recovers() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(8, 8192, 25);
    let p = src.as_ptr() as usize;
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    for i in 0..4 {
        assert!(put1(&s, &format!("a{i}"), p + i * 4096, 4096));
    }
    fault::set("fallocate", 0, u64::MAX, Fault::Error(libc::ENOSPC));
    fault::set("journal_reserve", 0, u64::MAX, Fault::Error(libc::ENOSPC));
    // a new class needs blocks: False, never an error
    // SAFETY: inside `src`.
    assert_eq!(unsafe { s.put(&[("big", p, 8192)]) }.unwrap(), vec![false]);
    assert_eq!(s.delete(&["a0", "a1"]).unwrap(), 2, "deletes are prepaid");
    // the freed 4 KiB slots are reused without new blocks
    assert!(put1(&s, "b0", p + 4 * 4096, 4096));
    fault::clear();
    // SAFETY: inside `src`.
    assert_eq!(unsafe { s.put(&[("big", p, 8192)]) }.unwrap(), vec![true]);
    drop(s);
    assert_all_back(
        &root,
        1 << 30,
        &[("a2".into(), 8192), ("b0".into(), 16384)],
        &src,
    );
    std::fs::remove_dir_all(root).unwrap();
}

/// A failed fallocate gives back what it may have allocated, and the file is not left longer.
#[test]
fn failed_growth_leaves_no_blocks_behind() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(4, 65536, 26);
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    assert!(put1(&s, "x", src.as_ptr() as usize, 65536));
    let before = s.disk_blocks();
    fault::set("fallocate", 0, u64::MAX, Fault::Error(libc::ENOSPC));
    // SAFETY: inside `src`.
    let ok = unsafe {
        s.put(&[
            ("y", src.as_ptr() as usize + 65536, 65536),
            ("z", src.as_ptr() as usize, 65536),
        ])
    };
    fault::clear();
    assert_eq!(ok.unwrap(), vec![false, false]);
    assert_eq!(s.occupancy().0, 65536, "failed slots are not counted");
    assert!(
        s.disk_blocks() <= before + 4096,
        "{} -> {}",
        before,
        s.disk_blocks()
    );
    std::fs::remove_dir_all(root).unwrap();
}

/// The journal's blocks are counted at open as its data extents — written, and preallocated past its
/// end — without the file system's metadata: a file of many extents on ext4 holds an extent-tree block
/// that `st_blocks` counts and the store never allocated (a reopened full store once evicted an
/// acknowledged object for it).
#[test]
fn extent_bytes_counts_data_and_preallocation_not_metadata() {
    // the fault table is process-wide: a fault test running beside this one (dir_sync, data_write, ...) would
    // fail this test's store IO
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    use std::os::unix::fs::FileExt;
    let root = tmp();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(root.join("f"))
        .unwrap();
    // 12 separate 4 KiB extents (a hole between each), then 3 blocks preallocated past the end; the size is
    // set first, so no write extends the file (XFS preallocates speculatively past the end of one that does)
    f.set_len(24 * 4096).unwrap();
    for i in 0..12u64 {
        f.write_all_at(&[7u8; 4096], i * 8192).unwrap();
    }
    f.sync_all().unwrap();
    crate::store::space::files::fallocate(&f, libc::FALLOC_FL_KEEP_SIZE, 24 * 4096, 3 * 4096)
        .unwrap();
    let data = crate::store::space::files::extent_bytes(&f);
    let blocks = crate::store::space::files::allocated_bytes(&f);
    assert_eq!(data, 15 * 4096, "st_blocks says {blocks}");
    assert!(blocks >= data);
    std::fs::remove_dir_all(root).unwrap();
}

/// A store used with a large capacity holds a journal reserve sized for it (a growth step of up to 1 MiB).
/// Reopened with a smaller capacity that its objects fit, it keeps every object and takes new puts: the
/// reserve shrinks to what the new capacity wants before anything is evicted (it once evicted all eight
/// objects to pay for the old reserve, stayed over the limit and refused every put). With a capacity the
/// objects do not fit, eviction keeps the most recently used ones and the limit holds.
#[test]
fn reopen_with_a_smaller_capacity_keeps_what_fits() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let n = 8usize;
    let src = payload(n + 1, 4096, 7);
    let base = src.as_ptr() as usize;
    {
        let s = PageStore::open(&root, "ns", opts(64 << 20)).unwrap();
        for i in 0..n {
            assert!(put1(&s, &format!("k{i}"), base + i * 4096, 4096));
        }
        assert!(s.occupancy().1 > 512 << 10, "{:?}", s.occupancy());
    }
    let dst = payload(1, 4096, 0);
    for (cap, kept) in [(512u64 << 10, n), (24 << 10, 4)] {
        let s = PageStore::open(&root, "ns", opts(cap)).unwrap();
        let (data, journal) = s.occupancy();
        assert!(data + journal <= cap, "cap {cap}: {data} + {journal}");
        let have: Vec<usize> = (0..n)
            .filter(|i| get1(&s, &format!("k{i}"), dst.as_ptr() as usize, 4096))
            .collect();
        // eviction keeps the most recently used: the last puts
        assert_eq!(have, ((n - kept)..n).collect::<Vec<_>>(), "cap {cap}");
        assert!(
            s.open_report().reserve_note.is_none(),
            "cap {cap}: {:?}",
            s.open_report()
        );
        if cap == 512 << 10 {
            assert!(
                put1(&s, "new", base + n * 4096, 4096),
                "cap {cap}: a put fails"
            );
            assert!(s.delete(&["new"]).is_ok());
        }
        let (data, journal) = s.occupancy();
        assert!(data + journal <= cap, "cap {cap}: {data} + {journal}");
        assert!(
            s.disk_blocks() <= cap + (64 << 10),
            "cap {cap}: {} on disk",
            s.disk_blocks()
        );
    }
    std::fs::remove_dir_all(root).unwrap();
}

/// Only EINVAL from the O_DIRECT probe means "unsupported"; a full disk keeps O_DIRECT.
#[test]
fn direct_probe_tells_enospc_from_einval() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let plain = PageStore::open(&root, "plain", opts(1 << 30)).unwrap();
    let supported = plain.direct();
    drop(plain);
    fault::set("probe", 0, 1, Fault::Error(libc::ENOSPC));
    let s = PageStore::open(&root, "a", opts(1 << 30)).unwrap();
    fault::clear();
    assert_eq!(s.direct(), supported, "ENOSPC is no verdict on O_DIRECT");
    assert!(s.direct_note().unwrap_or("").contains("could not write") || !supported);
    fault::set("probe", 0, 1, Fault::Error(libc::EINVAL));
    let s = PageStore::open(&root, "b", opts(1 << 30)).unwrap();
    fault::clear();
    assert!(!s.direct() && s.direct_note().unwrap().contains("refused O_DIRECT"));
    std::fs::remove_dir_all(root).unwrap();
}

/// A new file's name is durable only once its directory is synced. When that sync fails the put (or the
/// open) fails, and the next attempt syncs again rather than taking the file it finds as durable (it
/// skipped the sync when the file existed: an acknowledged object's class file, or the journal, could lose
/// its name in a crash).
#[test]
fn a_failed_directory_sync_is_retried() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(3, 4096, 5);
    let p = src.as_ptr() as usize;
    {
        let s = PageStore::open(&root, "ns", opts(1 << 20)).unwrap();
        for attempt in 0..2 {
            fault::set("dir_sync", 0, 1, Fault::Error(libc::EIO));
            assert!(
                !put1(&s, "a", p, 4096),
                "attempt {attempt}: acknowledged without a synced name"
            );
            assert_eq!(
                fault::hits("dir_sync"),
                1,
                "attempt {attempt}: the directory was not synced"
            );
        }
        fault::clear();
        assert!(put1(&s, "a", p, 4096));
    }
    // the journal: every writable open syncs its name
    for attempt in 0..2 {
        fault::set("dir_sync", 0, u64::MAX, Fault::Error(libc::EIO));
        assert!(
            PageStore::open(&root, "ns", opts(1 << 20)).is_err(),
            "attempt {attempt}"
        );
        fault::clear();
    }
    let s = PageStore::open(&root, "ns", opts(1 << 20)).unwrap();
    let dst = payload(1, 4096, 0);
    assert!(get1(&s, "a", dst.as_ptr() as usize, 4096));
    std::fs::remove_dir_all(root).unwrap();
}
