//! Page batches and range claims, one-object (MLA) pages, readers that follow a
//! writer, and the cases the two independent reviews found (duplicate keys, generations, stores without
//! hole punching, an inspector's lock probe, full stores at odd capacities).

use super::{bytes_at, get1, opts, payload, put1, tmp, SERIAL};
use crate::fault::{self, Fault};
use crate::store::io::pages;
use crate::store::*;
use std::sync::atomic::Ordering;

/// 8 pages of 4 tokens in a pool from `payload(16, 8192, _)` at `base`: K 8 KiB each at 0.., V 4 KiB at 64 KiB...
fn eight_pages(base: usize) -> PageLayout {
    PageLayout {
        k_base: base,
        k_stride: 8192,
        k_len: 8192,
        v_base: base + 65536,
        v_stride: 4096,
        v_len: 4096,
        page_tokens: 4,
        pages: 8,
    }
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
    let layout = eight_pages(base);
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
    // a page is committed whole or not at all: the half that was written is given back
    assert_eq!(halves.iter().filter(|b| **b).count(), 0, "{halves:?}");
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
        let ix = s.log.index();
        let e = ix.map.get("k").unwrap();
        (e.slot, e.gen)
    };
    s.delete(&["k"]).unwrap();
    assert!(put1(&s, "k", src.as_ptr() as usize, 4096));
    assert_eq!(
        s.log.index().map.get("k").unwrap().slot,
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
    let e = s.log.index().map.get(k.as_str()).cloned().unwrap();
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
    let ix = s.log.index();
    assert!(
        ix.j_end + ix.del_bytes + crate::store::index::JOURNAL_SLACK <= ix.j_alloc,
        "deletes no longer prepaid"
    );
    drop(ix);
    std::fs::remove_dir_all(root).unwrap();
}

/// A page is its K and V written together: a page that lost one half (dropped as corrupt, deleted, a put
/// that failed half way) and is then put again from other bytes (KV of the same tokens computed again) reads
/// back as the new K and the new V, never the new K beside the old V.
#[test]
fn a_page_put_again_after_losing_one_half_is_written_whole() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let pool = payload(16, 8192, 41); // 8 pages: K 8 KiB at 0.., V 4 KiB at 64 KiB..
    let base = pool.as_ptr() as usize;
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    let layout = eight_pages(base);
    // SAFETY: every page's K (8 KiB) and V (4 KiB) lie inside `pool` (128 KiB), alive for the test.
    unsafe { s.bind_pages(layout) }.unwrap();
    let keys: Vec<String> = vec!["x".into()];
    let at = |page: i64| -> Vec<i64> { (4 * page..4 * page + 4).collect() };
    let (first, again, back) = (at(1), at(2), at(3)); // page 1 first, page 2 "recomputed", read into page 3
    let put = |idx: &[i64]| {
        s.put_pages(&PageBatch {
            keys: &keys,
            host_indices: idx,
        })
        .unwrap()
    };
    let get = |idx: &[i64]| {
        s.get_pages(&PageBatch {
            keys: &keys,
            host_indices: idx,
        })
        .unwrap()
    };
    for lost in ["x.k", "x.v"] {
        assert_eq!(put(&first), vec![true]);
        assert_eq!(s.delete(&[lost]).unwrap(), 1);
        assert_eq!(get(&back), vec![false], "half a page is a miss");
        // the put that replaces the stored half fails on one object: nothing of it is committed
        for skip in [0, 1] {
            fault::set("data_write", skip, 1, Fault::Error(libc::EIO));
            let r = put(&again);
            fault::clear();
            assert_eq!(r, vec![false]);
            assert_eq!(
                get(&back),
                vec![false],
                "a torn re-put committed half a page"
            );
            assert_eq!(s.exists(&["x.k", "x.v"]).iter().filter(|b| **b).count(), 1);
        }
        assert_eq!(put(&again), vec![true]);
        assert_eq!(get(&back), vec![true]);
        assert_eq!(
            bytes_at(&pool, 3 * 8192, 8192),
            bytes_at(&pool, 2 * 8192, 8192),
            "K of the second put ({lost} lost)"
        );
        assert_eq!(
            bytes_at(&pool, 65536 + 3 * 4096, 4096),
            bytes_at(&pool, 65536 + 2 * 4096, 4096),
            "V of the second put ({lost} lost): never the first put's beside the second's K"
        );
        assert_eq!(s.delete(&["x.k", "x.v"]).unwrap(), 2);
    }
    // a whole page stored stays as it is (keys name content): a put of other bytes is acknowledged, not written
    assert_eq!(put(&first), vec![true]);
    let written = s.stats.bytes_written.load(Ordering::Relaxed);
    assert_eq!(put(&again), vec![true]);
    assert_eq!(s.stats.bytes_written.load(Ordering::Relaxed), written);
    std::fs::remove_dir_all(root).unwrap();
}
