//! The store's basic tests: round trips, locking, eviction, corruption, injected IO failures,
//! torn tails, compaction and the bounded-map property.

use super::{get1, opts, payload, put1, tmp, SERIAL};
use crate::store::*;
use proptest::prelude::*;
use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::sync::atomic::Ordering;

#[test]
fn put_get_reopen_bit_exact() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(3, 8192, 1);
    let dst = payload(3, 8192, 2);
    let base = src.as_ptr() as usize;
    {
        let s = PageStore::open(&root, "model|geo", opts(1 << 30)).unwrap();
        // SAFETY: three 8192-byte objects inside `src`.
        let ok = unsafe {
            s.put(&[
                ("a", base, 8192),
                ("b", base + 8192, 5000),
                ("c", base + 16384, 8192),
            ])
        }
        .unwrap();
        assert_eq!(ok, vec![true, true, true]);
        assert_eq!(s.exists(&["a", "b", "zz"]), vec![true, true, false]);
    }
    let s = PageStore::open(&root, "model|geo", opts(1 << 30)).unwrap();
    let d = dst.as_ptr() as usize;
    assert!(get1(&s, "b", d, 5000));
    // SAFETY: both regions hold at least 5000 bytes at these offsets.
    unsafe {
        assert_eq!(
            std::slice::from_raw_parts(d as *const u8, 5000),
            std::slice::from_raw_parts((base + 8192) as *const u8, 5000)
        )
    };
    assert!(!get1(&s, "b", d, 4096), "a length mismatch is a miss");
    assert!(!get1(&s, "nope", d, 8192));
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn second_writer_is_refused_and_namespaces_are_isolated() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let a = PageStore::open(&root, "ns-a", opts(1 << 30)).unwrap();
    let e = PageStore::open(&root, "ns-a", opts(1 << 30))
        .err()
        .expect("second open must fail");
    assert!(e.to_string().contains("already open"), "{e}");
    let b = PageStore::open(&root, "ns-b", opts(1 << 30)).unwrap();
    let src = payload(1, 4096, 3);
    assert!(put1(&a, "k", src.as_ptr() as usize, 4096));
    assert_eq!(b.exists(&["k"]), vec![false]);
    let mode = std::fs::metadata(a.dir()).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn capacity_evicts_lru_and_keys_are_not_paths() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    // three 4 KiB objects plus the journal (its length and prepaid deletes, rounded to 4 KiB, fit 8 KiB)
    let cap = 3 * 4096 + 8192;
    let s = PageStore::open(&root, "ns", opts(cap)).unwrap();
    let src = payload(4, 4096, 4);
    let p = src.as_ptr() as usize;
    for (i, k) in ["../../etc/x", "/abs", "k3"].iter().enumerate() {
        assert!(put1(&s, k, p + i * 4096, 4096));
    }
    assert!(get1(&s, "../../etc/x", p + 3 * 4096, 4096)); // touch: now most recent
    assert!(put1(&s, "k4", p + 3 * 4096, 4096));
    assert_eq!(
        s.exists(&["../../etc/x", "/abs", "k3", "k4"]),
        vec![true, false, true, true]
    );
    assert_eq!(s.stats.evictions.load(Ordering::Relaxed), 1);
    assert!(s.usage().1 <= 3 * 4096);
    let (data, journal) = s.occupancy();
    assert!(data + journal <= cap, "{data} + {journal} > {cap}");
    // nothing was created outside the namespace directory
    let names: Vec<_> = std::fs::read_dir(s.dir())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(
        names.iter().all(|n| !n.to_string_lossy().contains("etc")),
        "{names:?}"
    );
    assert!(!root.join("etc").exists() && !Path::new("/abs").exists());
    // an object larger than the capacity fails alone
    let big = payload(1, 32768, 5);
    assert!(!put1(&s, "big", big.as_ptr() as usize, 32768));
    assert_eq!(s.exists(&["../../etc/x", "k3", "k4"]), vec![true; 3]);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn corruption_is_a_counted_miss_and_the_object_is_dropped() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(2, 4096, 6);
    let p = src.as_ptr() as usize;
    let s = PageStore::open(&root, "ns", opts(1 << 20)).unwrap();
    assert!(put1(&s, "x", p, 4096) && put1(&s, "y", p + 4096, 4096));
    let f = s.data_files().pop().unwrap();
    let data = OpenOptions::new().write(true).open(&f).unwrap();
    data.write_all_at(&[0xFF; 7], 100).unwrap(); // slot 0 = "x"
    data.sync_all().unwrap();
    let dst = payload(1, 4096, 0);
    assert!(!get1(&s, "x", dst.as_ptr() as usize, 4096));
    assert_eq!(s.stats.corrupt_reads.load(Ordering::Relaxed), 1);
    assert_eq!(s.exists(&["x", "y"]), vec![false, true]);
    assert!(get1(&s, "y", dst.as_ptr() as usize, 4096));
    let rep = s.verify(false).unwrap();
    assert!(rep.corrupt.is_empty() && rep.unreadable.is_empty());
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn injected_io_failures_fail_only_those_pages_and_lose_nothing() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    for point in [
        "fallocate",
        "data_write",
        "data_sync",
        "journal_write",
        "journal_sync",
    ] {
        let root = tmp();
        let src = payload(6, 4096, 7);
        let p = src.as_ptr() as usize;
        let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
        assert!(put1(&s, "before", p, 4096));
        // 8 KiB objects: a new size class, so the batch must allocate space (the fallocate point)
        crate::fault::set(
            point,
            0,
            if point == "fallocate" { 2 } else { 1 },
            crate::fault::Fault::Error(libc::ENOSPC),
        );
        // SAFETY: objects inside `src` (6 pages of 4096 bytes).
        let r = unsafe { s.put(&[("f1", p + 4096, 8192), ("f2", p + 8192, 8192)]) };
        crate::fault::clear();
        let ok = r.unwrap_or_else(|_| vec![false, false]);
        assert_eq!(
            s.exists(&["f1", "f2"]),
            ok,
            "{point}: reported result and index disagree"
        );
        if point == "data_write" || point == "fallocate" {
            assert_eq!(
                ok.iter().filter(|b| !**b).count(),
                1,
                "{point}: only the object hit fails: {ok:?}"
            );
        } else {
            assert!(
                ok.iter().all(|b| !b),
                "{point}: a batch-wide failure must fail every object: {ok:?}"
            );
        }
        // the store keeps serving and nothing stored before is lost
        assert!(put1(&s, "after", p + 12288, 4096), "{point}");
        drop(s);
        let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
        let dst = payload(1, 4096, 0);
        for (k, off) in [("before", 0), ("after", 12288)] {
            assert!(
                get1(&s, k, dst.as_ptr() as usize, 4096),
                "{point}: {k} lost"
            );
            // SAFETY: both 4096-byte ranges are inside live regions.
            unsafe {
                assert_eq!(
                    std::slice::from_raw_parts(dst.as_ptr(), 4096),
                    std::slice::from_raw_parts((p + off) as *const u8, 4096)
                )
            };
        }
        for (k, stored) in ["f1", "f2"].iter().zip(&ok) {
            assert_eq!(s.exists(&[k])[0], *stored, "{point}: {k} after reopen");
        }
        std::fs::remove_dir_all(root).unwrap();
    }
}

#[test]
fn object_size_limit_keeps_classes_within_the_journal_field() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    assert!(MAX_OBJECT.div_ceil(ALIGN) * ALIGN <= u64::from(u32::MAX));
    let root = tmp();
    let src = payload(1, 4096, 3);
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    for len in [0, MAX_OBJECT + 1, 1 << 32, u64::MAX] {
        // SAFETY: refused before any byte is read (the length is checked first).
        let r = unsafe { s.put(&[("big", src.as_ptr() as usize, len)]) };
        assert!(
            matches!(r, Err(Error::InvalidArgument { .. })),
            "{len}: {r:?}"
        );
    }
    assert!(!s.exists(&["big"])[0]);
    assert_eq!(s.usage().1, 0, "nothing reserved");
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn short_torn_and_slow_object_writes() {
    use crate::fault::Fault;
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(4, 4096, 11);
    let p = src.as_ptr() as usize;
    let dst = payload(1, 4096, 0);
    let same = |off: usize| {
        // SAFETY: both 4096-byte ranges are inside live regions (`dst` and `src`).
        unsafe {
            std::slice::from_raw_parts(dst.as_ptr(), 4096)
                == std::slice::from_raw_parts((p + off) as *const u8, 4096)
        }
    };
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    // a short write fails its object only; the half written never becomes reachable
    crate::fault::set("data_write", 0, 1, Fault::Short(libc::EIO));
    // SAFETY: objects inside `src` (4 pages of 4096 bytes).
    let ok = unsafe { s.put(&[("s1", p, 4096), ("s2", p + 4096, 4096)]) }.unwrap();
    assert_eq!(crate::fault::hits("data_write"), 1);
    crate::fault::clear();
    assert_eq!(ok.iter().filter(|b| !**b).count(), 1, "{ok:?}");
    assert_eq!(s.exists(&["s1", "s2"]), ok);
    assert_eq!(s.stats.write_failures.load(Ordering::Relaxed), 1);
    // a torn write is acknowledged (the disk lied); the checksum turns it into a counted miss on read
    crate::fault::set("data_write", 0, 1, Fault::Torn);
    assert!(put1(&s, "t", p + 8192, 4096));
    crate::fault::clear();
    assert!(!get1(&s, "t", dst.as_ptr() as usize, 4096));
    assert_eq!(s.stats.corrupt_reads.load(Ordering::Relaxed), 1);
    assert!(!s.exists(&["t"])[0], "a corrupt object is dropped");
    // a slow disk delays but does not fail
    crate::fault::set(
        "data_write",
        0,
        1,
        Fault::Delay(std::time::Duration::from_millis(200)),
    );
    let t0 = std::time::Instant::now();
    assert!(put1(&s, "slow", p + 12288, 4096));
    assert!(t0.elapsed() >= std::time::Duration::from_millis(200));
    crate::fault::clear();
    drop(s);
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    for (k, off, stored) in [("s1", 0, ok[0]), ("s2", 4096, ok[1]), ("slow", 12288, true)] {
        assert_eq!(get1(&s, k, dst.as_ptr() as usize, 4096), stored, "{k}");
        if stored {
            assert!(same(off), "{k}: wrong bytes");
        }
    }
    assert!(!s.exists(&["t"])[0]);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn torn_journal_tail_is_cut() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(2, 4096, 8);
    let p = src.as_ptr() as usize;
    let dir;
    {
        let s = PageStore::open(&root, "ns", opts(1 << 20)).unwrap();
        assert!(put1(&s, "a", p, 4096) && put1(&s, "b", p + 4096, 4096));
        dir = s.dir().to_owned();
    }
    let j = dir.join("journal.log");
    let len = std::fs::metadata(&j).unwrap().len();
    OpenOptions::new()
        .write(true)
        .open(&j)
        .unwrap()
        .set_len(len - 3)
        .unwrap();
    let s = PageStore::open(&root, "ns", opts(1 << 20)).unwrap();
    assert_eq!(s.exists(&["a", "b"]), vec![true, false]);
    assert!(s.recovered_tail() > 0);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn journal_is_compacted_while_open_and_nothing_is_lost() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(2, 4096, 10);
    let p = src.as_ptr() as usize;
    let jlen;
    {
        let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
        // churn: 16,000 put+delete pairs (in batches of 1,000) would leave a ~1.4 MB journal behind two live objects
        for b in 0..16 {
            let keys: Vec<String> = (0..1000)
                .map(|i| format!("churn-{}", b * 1000 + i))
                .collect();
            let objs: Vec<(&str, usize, u64)> =
                keys.iter().map(|k| (k.as_str(), p, 4096)).collect();
            // SAFETY: every object is the first 4096 bytes of `src`.
            assert!(unsafe { s.put(&objs) }.unwrap().iter().all(|&x| x));
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            s.delete(&refs).unwrap();
        }
        assert!(put1(&s, "keep-a", p, 4096) && put1(&s, "keep-b", p + 4096, 4096));
        jlen = std::fs::metadata(s.dir().join("journal.log"))
            .unwrap()
            .len();
        // compacted while open, each time it passed 1 MiB with few live records
        assert!(s.stats.compactions.load(Ordering::Relaxed) >= 1);
        assert!(jlen < (1 << 20) + (200 << 10), "{jlen}");
    }
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    let after = std::fs::metadata(s.dir().join("journal.log"))
        .unwrap()
        .len();
    assert!(after <= jlen, "{jlen} -> {after}");
    let dst = payload(1, 4096, 0);
    for (k, off) in [("keep-a", 0), ("keep-b", 4096)] {
        assert!(get1(&s, k, dst.as_ptr() as usize, 4096));
        // SAFETY: 4096 bytes inside live regions.
        unsafe {
            assert_eq!(
                std::slice::from_raw_parts(dst.as_ptr(), 4096),
                std::slice::from_raw_parts((p + off) as *const u8, 4096)
            )
        };
    }
    assert_eq!(s.exists(&["churn-5"]), vec![false]);
    // appends after compaction land in the new journal and survive another reopen
    assert!(put1(&s, "new", p, 4096));
    drop(s);
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    assert_eq!(
        s.exists(&["keep-a", "keep-b", "new"]),
        vec![true, true, true]
    );
    std::fs::remove_dir_all(root).unwrap();
}

#[derive(Clone, Debug)]
enum Op {
    Put(u8, u8),
    Get(u8),
    Del(u8),
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..12, 0u8..4).prop_map(|(k, v)| Op::Put(k, v)),
        3 => (0u8..12).prop_map(Op::Get),
        1 => (0u8..12).prop_map(Op::Del),
        1 => Just(Op::Reopen),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, .. ProptestConfig::default() })]
    #[test]
    fn behaves_like_a_bounded_map(ops in proptest::collection::vec(op(), 1..40)) {
        let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let root = tmp();
        // four distinct 8 KiB payloads; capacity of 6 objects forces eviction
        let src = payload(4, 8192, 9);
        let dst = payload(1, 8192, 0);
        let cap = 6 * 8192;
        let mut s = Some(PageStore::open(&root, "ns", opts(cap)).unwrap());
        let mut model: HashMap<u8, u8> = HashMap::new();
        for o in ops {
            let st = s.as_ref().unwrap();
            match o {
                Op::Put(k, v) => {
                    let key = format!("k{k}");
                    let ok = put1(st, &key, src.as_ptr() as usize + v as usize * 8192, 8192);
                    prop_assert!(ok);
                    model.entry(k).or_insert(v); // existing keys keep their first value
                }
                Op::Get(k) => {
                    let got = get1(st, &format!("k{k}"), dst.as_ptr() as usize, 8192);
                    if got {
                        let v = *model.get(&k).expect("store returned a key the model never had");
                        // SAFETY: 8192 bytes inside live regions.
                        let same = unsafe { std::slice::from_raw_parts(dst.as_ptr(), 8192) == std::slice::from_raw_parts(src.as_ptr().add(v as usize * 8192), 8192) };
                        prop_assert!(same, "wrong bytes for k{}", k);
                    }
                }
                Op::Del(k) => {
                    st.delete(&[&format!("k{k}")]).unwrap();
                    model.remove(&k);
                }
                Op::Reopen => {
                    drop(s.take()); // release the LOCK before reopening
                    s = Some(PageStore::open(&root, "ns", opts(cap)).unwrap());
                }
            }
            let st = s.as_ref().unwrap();
            // the store holds a subset of the model (eviction may drop entries) and stays under capacity
            for k in st.keys() {
                let id: u8 = k[1..].parse().unwrap();
                prop_assert!(model.contains_key(&id));
            }
            prop_assert!(st.usage().1 <= cap);
            // evicted keys leave the model too (they are misses from now on)
            model.retain(|k, _| st.exists(&[&format!("k{k}")])[0]);
        }
        drop(s);
        std::fs::remove_dir_all(root).unwrap();
    }
}
