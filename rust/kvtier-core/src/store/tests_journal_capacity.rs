//! Journal and capacity faults: every fault of docs/STORE.md — journal appends failing after each kind of change,
//! poisoning, put/delete races on one key, exact capacity, a full disk, resynchronisation, read-only
//! inspection, the O_DIRECT probe. Page batches and readers: `tests_pages.rs`.

use super::tests::{get1, opts, payload, put1, tmp, SERIAL};
use super::*;
use crate::fault::{self, Fault};
use std::collections::HashSet;
use std::sync::atomic::Ordering;

pub(super) fn bytes_at(r: &crate::buffer::HostRegion, off: usize, n: usize) -> Vec<u8> {
    // SAFETY: callers pass ranges inside the live region.
    unsafe { std::slice::from_raw_parts(r.as_ptr().add(off), n).to_vec() }
}

/// Every acknowledged key reads back bit-exact from `src` at its offset after a reopen.
fn assert_all_back(
    root: &Path,
    cap: u64,
    acked: &[(String, usize)],
    src: &crate::buffer::HostRegion,
) {
    let s = PageStore::open(root, "ns", opts(cap)).unwrap();
    let dst = payload(1, 4096, 0);
    for (k, off) in acked {
        assert!(
            get1(&s, k, dst.as_ptr() as usize, 4096),
            "acknowledged {k} lost"
        );
        assert_eq!(
            bytes_at(&dst, 0, 4096),
            bytes_at(src, *off, 4096),
            "{k}: wrong bytes"
        );
    }
}

/// A journal append that fails after each kind of in-memory change — delete, eviction inside put, the
/// drop of a corrupt object — changes nothing: no key disappears early, no slot is reused, and every
/// acknowledged page is intact after a reopen (a store that changed its index before the record was durable lost 48 of 48 here).
#[test]
fn failed_del_appends_change_nothing_and_lose_nothing() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let src = payload(64, 4096, 21);
    let p = src.as_ptr() as usize;
    for case in ["delete", "evict", "corrupt_drop"] {
        let root = tmp();
        let cap = 8 * 4096 + 16384;
        let s = PageStore::open(&root, "ns", opts(cap)).unwrap();
        let mut acked: Vec<(String, usize)> = Vec::new();
        for i in 0..8 {
            let k = format!("old{i}");
            assert!(put1(&s, &k, p + i * 4096, 4096), "{case}");
            acked.push((k, i * 4096));
        }
        fault::set("journal_write", 0, u64::MAX, Fault::Error(libc::ENOSPC));
        match case {
            "delete" => {
                assert!(s.delete(&["old0", "old1"]).is_err());
                assert_eq!(s.exists(&["old0", "old1"]), vec![true, true], "rolled back");
            }
            "evict" => {
                // full: every new put must evict, whose del cannot be logged: False, never an error
                // SAFETY: objects inside `src`.
                let ok = unsafe {
                    s.put(&[("new0", p + 40 * 4096, 4096), ("new1", p + 41 * 4096, 4096)])
                };
                assert_eq!(ok.unwrap(), vec![false, false]);
                assert_eq!(s.keys().len(), 8, "nothing evicted");
            }
            _ => {
                fault::clear();
                let f = s.class(4096).unwrap();
                std::os::unix::fs::FileExt::write_all_at(&f.buffered, &[0xEE; 9], 0).unwrap(); // slot 0 = old0
                fault::set("journal_write", 0, u64::MAX, Fault::Error(libc::ENOSPC));
                let dst = payload(1, 4096, 0);
                assert!(!get1(&s, "old0", dst.as_ptr() as usize, 4096));
                assert_eq!(s.stats.corrupt_reads.load(Ordering::Relaxed), 1);
                assert!(!s.exists(&["old0"])[0], "a bad object is never served");
                assert!(!get1(&s, "old0", dst.as_ptr() as usize, 4096));
                acked.remove(0);
            }
        }
        fault::clear();
        // the disk is back: new pages go in (evicting), and are never placed over a live record
        for i in 0..6 {
            let k = format!("new{i}");
            assert!(put1(&s, &k, p + (40 + i) * 4096, 4096), "{case}: {k}");
            acked.push((k, (40 + i) * 4096));
        }
        let live: HashSet<String> = s.keys().into_iter().collect();
        drop(s);
        acked.retain(|(k, _)| live.contains(k)); // evicted on purpose (LRU) is not lost
        assert!(
            acked.iter().filter(|(k, _)| k.starts_with("new")).count() == 6,
            "{case}"
        );
        assert_all_back(&root, cap, &acked, &src);
        std::fs::remove_dir_all(root).unwrap();
    }
}

/// A failed append whose cut-back also fails poisons the journal: later writes fail (False), reads go on,
/// and a reopen recovers every acknowledged object (the partial record is a torn tail or a damaged span).
#[test]
fn poisoned_journal_refuses_writes_and_recovers_on_reopen() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(8, 4096, 22);
    let p = src.as_ptr() as usize;
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    assert!(put1(&s, "a", p, 4096));
    fault::set("journal_write", 0, 1, Fault::Short(libc::EIO));
    fault::set("journal_cut", 0, 1, Fault::Error(libc::EIO));
    assert!(!put1(&s, "b", p + 4096, 4096));
    fault::clear();
    assert!(s.poisoned());
    assert!(
        !put1(&s, "c", p + 8192, 4096),
        "a poisoned journal takes no more records"
    );
    assert!(s.delete(&["a"]).is_err());
    let dst = payload(1, 4096, 0);
    assert!(get1(&s, "a", dst.as_ptr() as usize, 4096), "reads go on");
    drop(s);
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    assert!(!s.poisoned());
    assert_eq!(s.exists(&["a", "b", "c"]), vec![true, false, false]);
    assert!(s.open_report().torn_tail > 0);
    assert!(put1(&s, "d", p + 12288, 4096));
    drop(s);
    assert_all_back(
        &root,
        1 << 30,
        &[("a".into(), 0), ("d".into(), 12288)],
        &src,
    );
    std::fs::remove_dir_all(root).unwrap();
}

/// Threads put, delete and get the same few keys; afterwards the index equals what a reopen replays
/// (a store that changed its index before appending could end with a del after an acknowledged, served put), and every served byte is
/// the key's own.
#[test]
fn racing_put_delete_get_of_one_key_is_linearizable() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let src = payload(4, 4096, 23);
    let shm = Path::new("/dev/shm");
    for round in 0..4u64 {
        // tmpfs where there is one: fast syncs make the interleavings dense
        let root = if shm.is_dir() {
            shm.join(format!("kvtier-race-{}-{round}", std::process::id()))
        } else {
            tmp()
        };
        let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
        let keys: Vec<String> = (0..2).map(|i| format!("k{i}")).collect();
        // every 50 operations all threads stop and the journal, replayed by a read-only open, must give the
        // index the store holds in memory
        let barrier = std::sync::Barrier::new(6);
        let mismatches = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|sc| {
            for t in 0..6usize {
                let (s, keys, src, barrier, root, mismatches) =
                    (&s, &keys, &src, &barrier, &root, &mismatches);
                sc.spawn(move || {
                    let dst = payload(1, 4096, 0);
                    let mut x = (t as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) + round;
                    for i in 0..1500 {
                        if i % 50 == 0 {
                            if barrier.wait().is_leader() {
                                let mut mem = s.keys();
                                mem.sort();
                                let mut disk =
                                    PageStore::open_read_only(root, "ns").unwrap().keys();
                                disk.sort();
                                if mem != disk {
                                    mismatches.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                            barrier.wait();
                        }
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let k = (x % 2) as usize;
                        match (x >> 8) % 3 {
                            0 => {
                                put1(s, &keys[k], src.as_ptr() as usize + k * 4096, 4096);
                            }
                            1 => {
                                s.delete(&[keys[k].as_str()]).unwrap();
                            }
                            _ => {
                                if get1(s, &keys[k], dst.as_ptr() as usize, 4096) {
                                    assert_eq!(
                                        bytes_at(&dst, 0, 4096),
                                        bytes_at(src, k * 4096, 4096)
                                    );
                                }
                            }
                        }
                    }
                });
            }
        });
        assert_eq!(
            mismatches.load(Ordering::Relaxed),
            0,
            "round {round}: memory and journal disagreed"
        );
        let mut before = s.keys();
        before.sort();
        drop(s);
        let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
        let mut after = s.keys();
        after.sort();
        assert_eq!(
            before, after,
            "round {round}: the journal's order is not the index's"
        );
        let dst = payload(1, 4096, 0);
        for k in &after {
            let i: usize = k[1..].parse().unwrap();
            assert!(
                get1(&s, k, dst.as_ptr() as usize, 4096),
                "{k} lost after reopen"
            );
            assert_eq!(bytes_at(&dst, 0, 4096), bytes_at(&src, i * 4096, 4096));
        }
        std::fs::remove_dir_all(root).unwrap();
    }
}

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

/// A few damaged bytes in the middle of the journal cost the records they hit, not the ones after; the
/// damage is reported; `verify(repair)` removes it; a read-only open changes no byte.
#[test]
fn damaged_journal_record_costs_only_itself() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(60, 4096, 27);
    let p = src.as_ptr() as usize;
    let dir;
    {
        let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
        for i in 0..54 {
            assert!(put1(&s, &format!("obj-{i:02}"), p + i * 4096, 4096));
        }
        dir = s.dir().to_owned();
    }
    let jpath = dir.join("journal.log");
    let mut j = std::fs::read(&jpath).unwrap();
    let rec = j.len() / 54;
    for b in &mut j[20 * rec + 10..20 * rec + 14] {
        *b ^= 0x5A; // inside record 20
    }
    std::fs::write(&jpath, &j).unwrap();
    let snapshot: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|pth| (pth.clone(), std::fs::read(&pth).unwrap()))
        .collect();
    {
        let ro = PageStore::open_read_only(&root, "ns").unwrap();
        assert_eq!(ro.keys().len(), 53);
        assert_eq!(ro.open_report().damaged_spans, 1);
        assert!(ro.open_report().damaged(true));
        let v = ro.verify(false).unwrap();
        assert!(v.corrupt.is_empty() && v.unreadable.is_empty());
        assert!(ro.delete(&["obj-00"]).is_err(), "read-only");
        assert!(!put1(&ro, "new", p, 4096));
    }
    for (pth, b) in &snapshot {
        assert_eq!(
            &std::fs::read(pth).unwrap(),
            b,
            "read-only open changed {}",
            pth.display()
        );
    }
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    assert_eq!(s.keys().len(), 53);
    assert!(!s.exists(&["obj-20"])[0] && s.exists(&["obj-21"])[0] && s.exists(&["obj-53"])[0]);
    s.verify(true).unwrap();
    drop(s);
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    assert_eq!(
        s.open_report().damaged_spans,
        0,
        "repair rewrote the journal"
    );
    assert_eq!(s.keys().len(), 53);
    let dst = payload(1, 4096, 0);
    assert!(get1(&s, "obj-53", dst.as_ptr() as usize, 4096));
    assert_eq!(bytes_at(&dst, 0, 4096), bytes_at(&src, 53 * 4096, 4096));
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
    super::files::fallocate(&f, libc::FALLOC_FL_KEEP_SIZE, 24 * 4096, 3 * 4096).unwrap();
    let data = super::files::extent_bytes(&f);
    let blocks = super::files::allocated_bytes(&f);
    assert_eq!(data, 15 * 4096, "st_blocks says {blocks}");
    assert!(blocks >= data);
    std::fs::remove_dir_all(root).unwrap();
}

/// Keys reach the journal as they are: a key holding a whole record (its kind byte is a control
/// character) would be found by the parser's resynchronisation when the record around it is torn, and
/// replayed — here a del of an acknowledged object. Put and delete refuse such keys before any byte is
/// written (the property test `journal::no_record_is_found_inside_an_accepted_key` covers every other key).
#[test]
fn a_key_that_could_hold_a_journal_record_is_refused() {
    // the fault table is process-wide: a fault test running beside this one (dir_sync, data_write, ...) would
    // fail this test's store IO
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    use super::journal::{parse_resync, Record};
    let (victim, inner) = (0u64..)
        .find_map(|n| {
            let key = format!("victim-{n}");
            let mut b = Vec::new();
            Record::Del { key: key.clone() }.encode(&mut b);
            String::from_utf8(b).ok().map(|s| (key, s))
        })
        .unwrap();
    let evil = format!("{inner}{}", "a".repeat(100));
    // what the rule prevents: half of evil's put record on disk parses as the del it carries
    let mut rec = Vec::new();
    Record::Put {
        key: evil.clone(),
        class: 4096,
        slot: 1,
        len: 4096,
        crc: 0,
        seal: None,
    }
    .encode(&mut rec);
    let torn = parse_resync(&rec[..rec.len() / 2]);
    assert_eq!(torn.records, vec![Record::Del { key: victim }]);
    // put and delete refuse the key and write nothing; a read of it is a miss
    let root = tmp();
    let s = PageStore::open(&root, "ns", opts(1 << 20)).unwrap();
    let journal = s.dir().join("journal.log");
    let before = std::fs::read(&journal).unwrap();
    let src = payload(1, 4096, 1);
    // SAFETY: inside `src`.
    let put = unsafe { s.put(&[(&evil, src.as_ptr() as usize, 4096)]) };
    let msg = put.unwrap_err().to_string();
    assert!(
        msg.contains("keys") && msg.contains("control characters"),
        "{msg}"
    );
    assert!(s.delete(&[evil.as_str()]).is_err());
    assert!(s.delete(&["tab\there"]).is_err());
    let dst = payload(1, 4096, 0);
    assert!(!get1(&s, &evil, dst.as_ptr() as usize, 4096));
    assert_eq!(std::fs::read(&journal).unwrap(), before);
    assert!(s.keys().is_empty());
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
