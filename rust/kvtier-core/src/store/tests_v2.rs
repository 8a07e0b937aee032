//! Page store v2: every fault of docs/STORE.md — journal appends failing after each kind of change,
//! poisoning, put/delete races on one key, exact capacity, resynchronisation, read-only inspection, the
//! O_DIRECT probe, page batches and range claims.

use super::tests::{get1, opts, payload, put1, tmp, SERIAL};
use super::*;
use crate::fault::{self, Fault};
use std::collections::HashSet;
use std::sync::atomic::Ordering;

fn bytes_at(r: &crate::buffer::HostRegion, off: usize, n: usize) -> Vec<u8> {
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
/// acknowledged page is intact after a reopen (the landed store lost 48 of 48 here).
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
/// (the landed store could end with a del after an acknowledged, served put), and every served byte is
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

/// Page batches: K and V paired, a half-stored page a miss until completed, indices proven in range before any IO, one
/// layout per store.
#[test]
fn page_batches_pair_k_and_v_and_check_every_index() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let pool = payload(16, 8192, 28); // 8 pages: K 8 KiB at 0.., V 4 KiB at 64 KiB..
    let base = pool.as_ptr() as usize;
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    let keys: Vec<String> = vec!["p0".into(), "p1".into()];
    let idx: Vec<i64> = (8..16).collect(); // pages 2 and 3, 4 tokens a page
    let batch = PageBatch {
        keys: &keys,
        host_indices: &idx,
    };
    assert!(s.put_pages(&batch).is_err(), "no layout bound");
    let layout = PageLayout {
        k_base: base,
        k_stride: 8192,
        k_len: 8192,
        v_base: base + 65536,
        v_stride: 4096,
        v_len: 4096,
        page_tokens: 4,
        pages: 8,
    };
    // SAFETY: every page's K (8 KiB) and V (4 KiB) lie inside `pool` (128 KiB), alive for the test.
    unsafe { s.bind_pages(layout) }.unwrap();
    // SAFETY: as above; K and V overlap here, which must be refused.
    assert!(unsafe {
        s.bind_pages(PageLayout {
            v_base: base + 4096,
            ..layout
        })
    }
    .is_err());
    for bad in [
        vec![0i64, 1, 2],
        vec![32, 33, 34, 35, 36, 37, 38, 39],
        vec![-4, -3, -2, -1, 0, 1, 2, 3],
    ] {
        let b = PageBatch {
            keys: &keys,
            host_indices: &bad,
        };
        assert!(
            matches!(s.put_pages(&b), Err(Error::InvalidArgument { .. })),
            "{bad:?}"
        );
    }
    let dup: Vec<i64> = (8..12).chain(8..12).collect();
    assert!(
        s.get_pages(&PageBatch {
            keys: &keys,
            host_indices: &dup
        })
        .is_err(),
        "one page read twice"
    );
    // one object write fails: that page is False and a miss (the half it got stays, never served alone)
    fault::set("data_write", 3, 1, Fault::Error(libc::EIO));
    let ok = s.put_pages(&batch).unwrap();
    fault::clear();
    assert_eq!(ok.iter().filter(|b| !**b).count(), 1, "{ok:?}");
    let failed = ok.iter().position(|b| !b).unwrap();
    let f = &keys[failed];
    let halves = s.exists(&[&format!("{f}.k"), &format!("{f}.v")]);
    assert_eq!(halves.iter().filter(|b| **b).count(), 1, "{halves:?}");
    assert_eq!(s.pages_exist(&keys[failed..failed + 1]), 0);
    let one = PageBatch {
        keys: &keys[failed..failed + 1],
        host_indices: &idx[4 * failed..4 * failed + 4],
    };
    assert_eq!(
        s.get_pages(&one).unwrap(),
        vec![false],
        "half a page is a miss"
    );
    // a later put of the page supplies the other half
    assert_eq!(s.put_pages(&batch).unwrap(), vec![true, true]);
    assert_eq!(s.pages_exist(&keys), 2);
    let dst_idx: Vec<i64> = (20..28).collect(); // pages 5 and 6
    assert_eq!(
        s.get_pages(&PageBatch {
            keys: &keys,
            host_indices: &dst_idx
        })
        .unwrap(),
        vec![true, true]
    );
    assert_eq!(
        bytes_at(&pool, 5 * 8192, 16384),
        bytes_at(&pool, 2 * 8192, 16384)
    );
    assert_eq!(
        bytes_at(&pool, 65536 + 5 * 4096, 8192),
        bytes_at(&pool, 65536 + 2 * 4096, 8192)
    );
    std::fs::remove_dir_all(root).unwrap();
}

/// `overlap` (the claims' range test) against the quadratic definition, on random small cases.
#[test]
fn overlap_matches_the_definition() {
    let mut rng = 0x2545f4914f6cdd1du64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n) as usize
    };
    for _ in 0..20_000 {
        let mut a: Vec<(usize, usize)> = (0..next(4)).map(|_| (next(40), 1 + next(8))).collect();
        let mut b: Vec<(usize, usize)> = (0..next(4)).map(|_| (next(40), 1 + next(8))).collect();
        a.sort_unstable();
        b.sort_unstable();
        let want = a
            .iter()
            .any(|x| b.iter().any(|y| x.0 < y.0 + y.1 && y.0 < x.0 + x.1));
        assert_eq!(pages::overlap(&a, &b), want, "{a:?} {b:?}");
    }
}

/// A key twice in one batch whose only write fails: both copies are False (the disk-full soak found the
/// second copy acknowledged at once — a page reported stored that never was).
#[test]
fn a_key_twice_in_a_batch_shares_the_first_ones_fate() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(2, 4096, 29);
    let p = src.as_ptr() as usize;
    for point in ["data_write", "fallocate", "journal_write"] {
        // fresh (the slots need blocks) and one IO thread (the fault hits the first object written)
        let one = StoreOptions {
            io_threads: 1,
            ..opts(1 << 30)
        };
        let s = PageStore::open(&root, point, one).unwrap();
        // fallocate: the run of both new slots, then "dup"'s slot on its own
        fault::set(
            point,
            0,
            if point == "fallocate" { 2 } else { 1 },
            Fault::Error(libc::ENOSPC),
        );
        // SAFETY: inside `src`.
        let ok = unsafe {
            s.put(&[
                ("dup", p, 4096),
                ("other", p + 4096, 4096),
                ("dup", p, 4096),
            ])
        }
        .unwrap();
        fault::clear();
        assert!(!ok[0] && !ok[2], "{point}: {ok:?}");
        assert!(!s.exists(&["dup"])[0], "{point}");
    }
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    // SAFETY: inside `src`.
    let ok = unsafe { s.put(&[("dup", p, 4096), ("dup", p, 4096)]) }.unwrap();
    assert_eq!(ok, vec![true, true]);
    std::fs::remove_dir_all(root).unwrap();
}

/// What evicts or drops an object it chose earlier deletes it only if the key still names that very
/// object: a key deleted and put again meanwhile — into the same slot, as the free list hands it back —
/// is another object and stays.
#[test]
fn a_key_put_again_is_another_object() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(2, 4096, 30);
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    assert!(put1(&s, "k", src.as_ptr() as usize, 4096));
    let (slot, gen) = {
        let ix = s.lock_index();
        let e = ix.map.get("k").unwrap();
        (e.slot, e.gen)
    };
    s.delete(&["k"]).unwrap();
    assert!(put1(&s, "k", src.as_ptr() as usize, 4096));
    assert_eq!(
        s.lock_index().map.get("k").unwrap().slot,
        slot,
        "the same slot again"
    );
    assert!(s.commit_dels(&[("k".into(), gen)]).unwrap().is_empty());
    assert!(
        s.exists(&["k"])[0],
        "the new object was deleted in the old one's name"
    );
    std::fs::remove_dir_all(root).unwrap();
}

/// Where holes cannot be punched (EOPNOTSUPP), eviction still makes room: it takes objects of the class
/// that needs a slot (the first version of this code spun trying to punch).
#[test]
fn eviction_works_without_hole_punching() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(2, 8192, 32);
    let p = src.as_ptr() as usize;
    let cap = 6 * 8192 + 16384;
    let s = PageStore::open(&root, "ns", opts(cap)).unwrap();
    fault::set("punch", 0, u64::MAX, Fault::Error(libc::EOPNOTSUPP));
    for i in 0..40 {
        let len = if i % 4 == 0 { 4096 } else { 8192 };
        assert!(put1(&s, &format!("k{i}"), p, len), "put {i}");
        let (d, j) = s.occupancy();
        assert!(d + j <= cap, "{i}: {d} + {j}");
    }
    fault::clear();
    assert!(s.stats.evictions.load(Ordering::Relaxed) > 0);
    std::fs::remove_dir_all(root).unwrap();
}

/// An inspector's read-only open probes LOCK with a shared lock for an instant; a writer opening at that
/// moment retries instead of calling the namespace taken.
#[test]
fn inspecting_does_not_make_a_writer_fail_to_open() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    drop(PageStore::open(&root, "ns", opts(1 << 30)).unwrap());
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|sc| {
        sc.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                let _ = PageStore::open_read_only(&root, "ns");
            }
        });
        for i in 0..30 {
            let s = PageStore::open(&root, "ns", opts(1 << 30));
            assert!(
                s.is_ok(),
                "open {i} refused while only inspectors were there"
            );
        }
        stop.store(true, Ordering::Relaxed);
    });
    std::fs::remove_dir_all(root).unwrap();
}

/// A pool with one object per page (MLA: `v_len == 0`): pages are `<key>.kv`, moved and deleted whole.
#[test]
fn single_object_pages() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let pool = payload(8, 8192, 33);
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    let layout = PageLayout {
        k_base: pool.as_ptr() as usize,
        k_stride: 8192,
        k_len: 8192,
        v_base: 0,
        v_stride: 0,
        v_len: 0,
        page_tokens: 2,
        pages: 8,
    };
    // SAFETY: 8 pages of 8 KiB inside `pool`, alive for the test.
    unsafe { s.bind_pages(layout) }.unwrap();
    let keys: Vec<String> = vec!["a".into(), "b".into()];
    let src: Vec<i64> = vec![0, 1, 2, 3];
    assert_eq!(
        s.put_pages(&PageBatch {
            keys: &keys,
            host_indices: &src
        })
        .unwrap(),
        vec![true, true]
    );
    assert_eq!(s.keys().len(), 2);
    assert!(s.exists(&["a.kv", "b.kv"]).iter().all(|b| *b));
    let dst: Vec<i64> = vec![10, 11, 12, 13];
    assert_eq!(
        s.get_pages(&PageBatch {
            keys: &keys,
            host_indices: &dst
        })
        .unwrap(),
        vec![true, true]
    );
    assert_eq!(bytes_at(&pool, 5 * 8192, 16384), bytes_at(&pool, 0, 16384));
    assert_eq!(s.pages_exist(&keys), 2);
    assert_eq!(s.delete_pages(&keys[..1]).unwrap(), 1);
    assert_eq!(s.pages_exist(&keys), 0);
    std::fs::remove_dir_all(root).unwrap();
}

/// A read-only store follows a writer that keeps evicting, reusing slots and compacting its journal:
/// every hit it serves (from another thread, while the writer runs) is the key's own bytes, and once the
/// writer pauses it knows exactly the writer's keys. (SGLang's MLA ranks other than the writer read this
/// way; the writer's lock used to refuse them.)
#[test]
fn a_reader_follows_the_writer_and_never_serves_wrong_bytes() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(32, 4096, 34);
    let cap = 24 * 4096 + 32768;
    let w = PageStore::open(&root, "ns", opts(cap)).unwrap();
    let r = PageStore::open_read_only(&root, "ns").unwrap();
    assert!(r.keys().is_empty());
    let stop = std::sync::atomic::AtomicBool::new(false);
    let hits = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let dst = payload(1, 4096, 0);
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i = i
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let k = (i >> 33) % 600;
                if get1(&r, &format!("key-{k}"), dst.as_ptr() as usize, 4096) {
                    assert_eq!(
                        bytes_at(&dst, 0, 4096),
                        bytes_at(&src, (k % 32) as usize * 4096, 4096),
                        "key-{k}"
                    );
                    hits.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        for k in 0..600usize {
            assert!(put1(
                &w,
                &format!("key-{k}"),
                src.as_ptr() as usize + (k % 32) * 4096,
                4096
            ));
            if k % 7 == 0 {
                w.delete(&[format!("key-{}", k / 2).as_str()]).unwrap();
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    assert!(
        w.stats.evictions.load(Ordering::Relaxed) > 0
            && w.stats.compactions.load(Ordering::Relaxed) > 0
    );
    assert!(
        hits.load(Ordering::Relaxed) > 0,
        "the reader never found anything"
    );
    let (mut a, mut b) = (w.keys(), r.keys());
    a.sort();
    b.sort();
    assert_eq!(a, b, "the reader does not know the writer's keys");
    assert!(r.delete(&["key-599"]).is_err(), "a reader never writes");
    std::fs::remove_dir_all(root).unwrap();
}

/// From the second review: a capacity that is not a multiple of 4096, a store whose holes cannot be
/// punched, batches larger than the rounds of the reservation, and one corrupt key named many times in one
/// get: puts keep succeeding by eviction, never past the capacity, and the delete reserve stays prepaid.
#[test]
fn full_store_edge_cases_from_review() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let src = payload(4, 8192, 35);
    let p = src.as_ptr() as usize;
    for (cap, no_punch) in [
        (204_900u64, false),
        (262_144 + 777, false),
        (256 << 10, true),
    ] {
        let root = tmp();
        let s = PageStore::open(&root, "ns", opts(cap)).unwrap();
        if no_punch {
            fault::set("punch", 0, u64::MAX, Fault::Error(libc::EOPNOTSUPP));
        }
        let mut failed = 0;
        for i in 0..1500usize {
            let len = if no_punch || i % 3 != 0 { 4096 } else { 8192 };
            let okp = put1(&s, &format!("k{i}"), p + (i % 4) * 8192, len);
            failed += usize::from(!okp);
            let (d, j) = s.occupancy();
            assert!(d + j <= cap, "cap {cap}: {d} + {j} at put {i}");
        }
        fault::clear();
        assert_eq!(
            failed, 0,
            "cap {cap} (no punch: {no_punch}): {failed} of 1500 puts failed"
        );
        assert!(s.keys().len() > 10, "cap {cap}: eviction emptied the store");
        std::fs::remove_dir_all(root).unwrap();
    }
    // a 512-object batch into a full 32 MiB store: all stored (evicting), not 256 per batch
    let root = tmp();
    let big = payload(1, 64 << 10, 36);
    let s = PageStore::open(&root, "ns", opts(32 << 20)).unwrap();
    for b in 0..3 {
        let keys: Vec<String> = (0..512).map(|i| format!("b{b}-{i}")).collect();
        let objs: Vec<(&str, usize, u64)> = keys
            .iter()
            .map(|k| (k.as_str(), big.as_ptr() as usize, 64 << 10))
            .collect();
        // SAFETY: every object is `big`'s 64 KiB.
        let ok = unsafe { s.put(&objs) }.unwrap();
        // 512 × 64 KiB = 32 MiB: what fits beside the journal is stored, the store is never over
        let stored = ok.iter().filter(|b| **b).count();
        assert!(stored >= 480, "batch {b}: only {stored} of 512 stored");
    }
    // one corrupt key named many times in one get: one del record, the reserve still covers every delete
    let k = s.keys().pop().unwrap();
    let e = s.lock_index().map.get(&k).cloned().unwrap();
    let f = s.class(e.class).unwrap();
    std::os::unix::fs::FileExt::write_all_at(
        &f.buffered,
        &[0xAB; 16],
        u64::from(e.slot) * u64::from(e.class),
    )
    .unwrap();
    let dst = payload(200, 64 << 10, 0);
    let objs: Vec<(&str, usize, u64)> = (0..200)
        .map(|i| (k.as_str(), dst.as_ptr() as usize + i * (64 << 10), 64 << 10))
        .collect();
    // SAFETY: 200 disjoint 64 KiB destinations inside `dst`.
    assert!(unsafe { s.get(&objs) }.unwrap().iter().all(|b| !b));
    let ix = s.lock_index();
    assert!(
        ix.j_end + ix.del_bytes + super::index::JOURNAL_SLACK <= ix.j_alloc,
        "deletes no longer prepaid"
    );
    drop(ix);
    std::fs::remove_dir_all(root).unwrap();
}
