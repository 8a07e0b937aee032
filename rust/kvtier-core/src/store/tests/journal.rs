//! Journal faults: journal appends failing after each kind of change, a poisoned journal, put/delete races
//! on one key, damaged records (resynchronisation, read-only inspection), keys that could hold a record.
//! The disk under the store (capacity, a full disk, the O_DIRECT probe, directory syncs): `tests::disk`.
//! Page batches and readers: `tests::pages`.

use super::{bytes_at, get1, opts, payload, put1, tmp, SERIAL};
use crate::fault::{self, Fault};
use crate::store::*;
use std::collections::HashSet;
use std::sync::atomic::Ordering;

/// Every acknowledged key reads back bit-exact from `src` at its offset after a reopen.
pub(super) fn assert_all_back(
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

/// Keys reach the journal as they are: a key holding a whole record (its kind byte is a control
/// character) would be found by the parser's resynchronisation when the record around it is torn, and
/// replayed — here a del of an acknowledged object. Put and delete refuse such keys before any byte is
/// written (the property test `journal::no_record_is_found_inside_an_accepted_key` covers every other key).
#[test]
fn a_key_that_could_hold_a_journal_record_is_refused() {
    // the fault table is process-wide: a fault test running beside this one (dir_sync, data_write, ...) would
    // fail this test's store IO
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    use crate::store::journal::{parse_resync, Placement, Record};
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
        at: Placement::new(4096, 1, 4096, 0),
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
