//! Sealed stores (encryption at rest): round trips through writes, replay, compaction and a follower; no
//! plaintext on disk; a wrong key, another tenant's erasure or a clear store never serve a sealed object.

use super::{get1, opts, payload, put1, tmp, SERIAL};
use crate::seal::{tenant_keys, tenant_tag, Keyring};
use crate::store::*;

fn ring(dir: &Path) -> Arc<Keyring> {
    Keyring::init(dir).unwrap();
    Arc::new(Keyring::open(dir).unwrap())
}

fn sealed(ring: &Arc<Keyring>) -> StoreOptions {
    StoreOptions {
        keyring: Some(ring.clone()),
        ..opts(1 << 30)
    }
}

/// Whether any file under `dir` contains `needle`.
fn found_in(dir: &Path, needle: &[u8]) -> bool {
    std::fs::read_dir(dir).unwrap().flatten().any(|e| {
        let p = e.path();
        if p.is_dir() {
            return found_in(&p, needle);
        }
        let b = std::fs::read(&p).unwrap_or_default();
        b.windows(needle.len()).any(|w| w == needle)
    })
}

#[test]
fn sealed_objects_round_trip_and_never_reach_the_disk_in_clear() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let kr = ring(&root.join("keys"));
    let n = 6;
    let len = 16384usize;
    let src = payload(n, len, 3);
    let dst = payload(n, len, 9);
    let base = src.as_ptr() as usize;
    let salts = ["alice", "bob"];
    let keys: Vec<String> = (0..n)
        .map(|i| {
            let k = format!("{i:064x}");
            if i < 2 {
                k
            } else {
                tenant_keys(salts[i % 2], &[k]).unwrap().remove(0)
            }
        })
        .collect();
    {
        let s = PageStore::open(&root, "ns", sealed(&kr)).unwrap();
        for (i, k) in keys.iter().enumerate() {
            assert!(put1(&s, k, base + i * len, len as u64));
        }
        for (i, k) in keys.iter().enumerate() {
            assert!(
                get1(&s, k, dst.as_ptr() as usize + i * len, len as u64),
                "{k}"
            );
        }
        s.compact().unwrap(); // the rewritten journal keeps every seal
    }
    // SAFETY: both regions hold n·len initialised bytes.
    let (a, b) = unsafe {
        (
            std::slice::from_raw_parts(src.as_ptr(), n * len),
            std::slice::from_raw_parts(dst.as_ptr(), n * len),
        )
    };
    assert_eq!(a, b);
    // the search finds bytes a clear namespace stores (so finding none above means something)
    let clear_root = tmp();
    {
        let c = PageStore::open(&clear_root, "ns", opts(1 << 30)).unwrap();
        assert!(put1(&c, &keys[0], base, len as u64));
    }
    assert!(found_in(&clear_root, &a[len / 2..len / 2 + 64]));
    let _ = std::fs::remove_dir_all(&clear_root);
    for i in 0..n {
        for off in [0, len / 2, len - 64] {
            let w = &a[i * len + off..i * len + off + 64];
            assert!(
                !found_in(&root, w),
                "object {i} bytes at {off} are on disk in clear"
            );
        }
    }
    // replay, then a follower; both open what the writer sealed
    let s = PageStore::open(&root, "ns", sealed(&kr)).unwrap();
    let f = PageStore::open_read_only_sealed(&root, "ns", Some(kr.clone())).unwrap();
    for (i, k) in keys.iter().enumerate() {
        let d = payload(1, len, 0);
        assert!(get1(&s, k, d.as_ptr() as usize, len as u64));
        let d2 = payload(1, len, 0);
        assert!(get1(&f, k, d2.as_ptr() as usize, len as u64));
        // SAFETY: len initialised bytes each.
        unsafe {
            assert_eq!(
                std::slice::from_raw_parts(d.as_ptr(), len),
                &a[i * len..(i + 1) * len]
            );
            assert_eq!(
                std::slice::from_raw_parts(d2.as_ptr(), len),
                &a[i * len..(i + 1) * len]
            );
        }
    }
    drop(f);
    drop(s);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_wrong_key_a_clear_store_or_an_erased_tenant_is_a_miss_never_plaintext() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let kr = ring(&root.join("keys"));
    let len = 8192usize;
    let src = payload(3, len, 5);
    let base = src.as_ptr() as usize;
    let alice = tenant_keys("alice", &["a".repeat(64), "b".repeat(64)]).unwrap();
    let plain = "c".repeat(64);
    {
        let s = PageStore::open(&root, "ns", sealed(&kr)).unwrap();
        assert!(put1(&s, &alice[0], base, len as u64));
        assert!(put1(&s, &alice[1], base + len, len as u64));
        assert!(put1(&s, &plain, base + 2 * len, len as u64));
    }
    // a clear store on the sealed namespace serves nothing (and drops nothing)
    {
        let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
        let d = payload(1, len, 0);
        assert!(!get1(&s, &plain, d.as_ptr() as usize, len as u64));
        assert_eq!(s.stats.corrupt_reads.load(Ordering::Relaxed), 0);
    }
    // another master key: no object is its key's (a miss, not damage), and none is ever opened
    {
        let other = ring(&root.join("other-keys"));
        let s = PageStore::open(&root, "ns", sealed(&other)).unwrap();
        assert!(
            !s.exists(&[plain.as_str()])[0],
            "a lookup promises only what a read serves"
        );
        let d = payload(1, len, 0);
        assert!(!get1(&s, &plain, d.as_ptr() as usize, len as u64));
        assert_eq!(s.stats.corrupt_reads.load(Ordering::Relaxed), 0);
    }
    // the right key, and a flipped byte with its crc made to match: the tag alone refuses it
    {
        let s = PageStore::open(&root, "ns", sealed(&kr)).unwrap();
        let name0 = kr.stored_name(&alice[0]);
        let e = s.log.index().get(&name0).cloned().unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(s.dir().join(format!("class-{}.dat", e.class)))
            .unwrap();
        let off = u64::from(e.slot) * u64::from(e.class);
        let mut bytes = vec![0u8; len];
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut bytes, off).unwrap();
        bytes[100] ^= 1;
        std::os::unix::fs::FileExt::write_all_at(&f, &bytes, off).unwrap();
        let crc = crc32c::crc32c_append(crc32c::crc32c(&bytes), name0.as_bytes());
        s.log.index().map.get_mut(name0.as_str()).unwrap().crc = crc;
        let d = payload(1, len, 0);
        assert!(!get1(&s, &alice[0], d.as_ptr() as usize, len as u64));
        assert_eq!(
            s.stats.corrupt_reads.load(Ordering::Relaxed),
            1,
            "the tag, not the crc, refused it"
        );
        assert!(put1(&s, &alice[0], base, len as u64)); // dropped, so written again
    }
    // alice's key destroyed (by another holder of the keyring): her objects are misses (not counted damage)
    let s = PageStore::open(&root, "ns", sealed(&kr)).unwrap();
    let d = payload(1, len, 0);
    assert!(
        get1(&s, &alice[0], d.as_ptr() as usize, len as u64),
        "before the erasure"
    );
    let tag = tenant_tag("alice").unwrap();
    assert!(Keyring::open(&root.join("keys"))
        .unwrap()
        .erase_tenant(&tag)
        .unwrap());
    assert!(!get1(&s, &alice[1], d.as_ptr() as usize, len as u64));
    assert!(!s.exists(&[alice[1].as_str()])[0]);
    // the tenant stays erased: a writer still holding its pages cannot store them again, in this process
    // or any other sharing the keyring, until an operator allows the tenant again
    assert!(!put1(&s, &alice[1], base + len, len as u64));
    assert!(!s.exists(&[alice[1].as_str()])[0]);
    assert!(Keyring::open(&root.join("keys"))
        .unwrap()
        .allow_tenant(&tag)
        .unwrap());
    // then its next write makes a new key; what it writes is served again
    assert!(put1(&s, &alice[1], base + len, len as u64));
    assert!(get1(&s, &alice[1], d.as_ptr() as usize, len as u64));
    drop(s);
    let _ = std::fs::remove_dir_all(&root);
}

/// A full sealed store with the longest keys: its compactions step through sealed records (a walk of the
/// live ones, tails of new ones) and keep every seal; the journal stays within capacity; what the last
/// batches stored opens, before and after a reopen.
#[test]
fn a_full_sealed_store_with_the_longest_keys_compacts_and_keeps_every_seal() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let kr = ring(&root.join("keys"));
    let src = payload(16, 4096, 7);
    let cap = 4 << 20;
    let opts = StoreOptions {
        keyring: Some(kr.clone()),
        ..opts(cap)
    };
    // tenant keys padded to the longest key the journal takes
    let tenant = tenant_keys("alice", &["x".to_owned()]).unwrap().remove(0);
    let key = |i: usize| {
        let k = format!("{tenant}{i:08}");
        format!("{k}{}", "p".repeat(journal::MAX_KEY - k.len()))
    };
    let s = PageStore::open(&root, "ns", opts.clone()).unwrap();
    let (batches, per) = (120usize, 16usize);
    for b in 0..batches {
        let keys: Vec<String> = (0..per).map(|i| key(b * per + i)).collect();
        let objs: Vec<(&str, usize, u64)> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| (k.as_str(), src.as_ptr() as usize + i * 4096, 4096))
            .collect();
        // SAFETY: every object lies inside `src`.
        let ok = unsafe { s.put(&objs) }.unwrap();
        assert!(ok.iter().all(|&x| x), "batch {b}");
        let (data, journal) = s.occupancy();
        assert!(
            data + journal <= cap,
            "batch {b}: {data} + {journal} > {cap}"
        );
    }
    assert!(
        s.stats.compactions.load(Ordering::Relaxed) >= 1,
        "no compaction ran"
    );
    assert!(s.stats.evictions.load(Ordering::Relaxed) > 0);
    let check = |s: &PageStore| {
        let dst = payload(1, 4096, 0);
        for i in 0..per {
            let k = key((batches - 1) * per + i);
            assert!(get1(s, &k, dst.as_ptr() as usize, 4096), "{i}");
            // SAFETY: 4096 initialised bytes each.
            unsafe {
                assert_eq!(
                    std::slice::from_raw_parts(dst.as_ptr(), 4096),
                    std::slice::from_raw_parts(src.as_ptr().add(i * 4096), 4096)
                );
            }
        }
    };
    check(&s);
    drop(s);
    let s = PageStore::open(&root, "ns", opts).unwrap();
    check(&s);
    assert_eq!(s.stats.corrupt_reads.load(Ordering::Relaxed), 0);
    drop(s);
    let _ = std::fs::remove_dir_all(&root);
}
