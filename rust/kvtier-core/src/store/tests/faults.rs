//! Faults at every IO point of the store, under a workload of puts, deletes and gets in a small store
//! (so eviction, hole punching, journal growth and online compaction all run): after a clean close and a
//! reopen the index is exactly what the store held in memory, and every key in it reads back its own bytes.

use super::{get1, opts, payload, tmp, SERIAL};
use crate::fault::{self, Fault, POINTS};
use crate::store::*;
use std::collections::HashMap;
use std::sync::atomic::Ordering;

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[test]
fn every_io_point_failing_loses_no_acknowledged_object() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut seen_faults = HashMap::new();
    for (n, point) in POINTS.iter().enumerate() {
        for kind in [Fault::Error(libc::ENOSPC), Fault::Error(libc::EIO)] {
            workload(
                point,
                kind,
                0x1234_5678u64 + n as u64,
                None,
                false,
                &mut seen_faults,
            );
        }
    }
    // every point was really hit by the workload (the probe runs at open, before any fault is set, and the
    // directory sync when a file is first opened: tests::disk::a_failed_directory_sync_is_retried)
    let missed: Vec<_> = POINTS
        .iter()
        .filter(|p| **p != "probe" && **p != "dir_sync" && seen_faults[*p] == 0)
        .collect();
    assert!(
        missed.is_empty(),
        "the workload never reached {missed:?}: {seen_faults:?}"
    );
}

/// The same workload on a sealed store (encryption at rest; half the keys a tenant's): every point failing
/// loses no acknowledged object and serves no wrong byte either.
#[test]
fn every_io_point_failing_loses_no_acknowledged_sealed_object() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let keys = tmp().join("keyring");
    crate::seal::Keyring::init(&keys).unwrap();
    let ring = std::sync::Arc::new(crate::seal::Keyring::open(&keys).unwrap());
    let mut seen_faults = HashMap::new();
    for (n, point) in POINTS.iter().enumerate() {
        workload(
            point,
            Fault::Error(libc::EIO),
            0x8765_4321u64 + n as u64,
            Some(&ring),
            false,
            &mut seen_faults,
        );
    }
    let _ = std::fs::remove_dir_all(keys.parent().unwrap());
}

/// One run of the workload with faults of `kind` coming and going at `point`, checked as the module
/// says. `seed` picks the operations and the fault windows; `sealed`: the store seals with this keyring.
fn workload(
    point: &'static str,
    kind: Fault,
    seed: u64,
    sealed: Option<&std::sync::Arc<crate::seal::Keyring>>,
    coded: bool,
    seen_faults: &mut HashMap<&'static str, u64>,
) {
    // objects of one or two units; coded: units of 16 KiB of KV-shaped bf16, which the codec stores in
    // fewer blocks (8 KiB objects cannot shed a block)
    let unit: u64 = if coded { 16384 } else { 4096 };
    let src = payload(32, 2 * unit as usize, 31);
    if coded {
        let v = crate::codec::tests::kv_like_bf16(32 * unit as usize, 64, 5);
        // SAFETY: the region holds 32 objects of 2 units; nothing else uses it yet.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), src.as_ptr(), v.len()) };
    }
    let p = src.as_ptr() as usize;
    let root = tmp();
    // compaction from 16 KiB of journal, eviction all the time
    let cap = (256 << 10) * unit / 4096;
    let o = StoreOptions {
        keyring: sealed.cloned(),
        codec: coded.then_some(crate::codec::Elem::Bits16),
        ..opts(cap)
    };
    let s = PageStore::open(&root, "ns", o.clone()).unwrap();
    let mut rng = seed;
    // key -> offset in src of its bytes (keys name content: a key always has the same bytes)
    let content = |k: u64| (k % 32) as usize * 2 * unit as usize;
    let mut acked: HashMap<String, usize> = HashMap::new();
    // what `keys()` lists, as the workload's keys (a sealed store lists keyed names)
    let workload_keys = |s: &PageStore| -> Vec<String> {
        let Some(ring) = sealed else {
            return s.keys();
        };
        let by_name: HashMap<String, String> = (0..400u64)
            .flat_map(|k| {
                [
                    format!("key-{k}"),
                    format!("t0123456789abcdef0123456789abcdef.key-{k}"),
                ]
            })
            .map(|k| (ring.stored_name(&k), k))
            .collect();
        s.keys()
            .into_iter()
            .map(|n| by_name.get(&n).cloned().unwrap_or(n))
            .collect()
    };
    for step in 0..1500u64 {
        if step % 50 == 10 || step % 50 == 40 {
            *seen_faults.entry(point).or_insert(0) += fault::hits(point);
        }
        if step % 50 == 10 {
            // faults come and go: every 3rd to 9th call of the point fails for a while
            fault::set(
                point,
                splitmix(&mut rng) % 3,
                2 + splitmix(&mut rng) % 7,
                kind,
            );
            if point == "journal_cut" {
                // a cut-back happens only after a failed append
                fault::set("journal_sync", 1, 1, kind);
            }
        }
        if step % 50 == 40 {
            fault::clear();
        }
        let r = splitmix(&mut rng);
        let k = r % 400;
        // (sealed: odd keys are a tenant's, sealed under its own key)
        let key = if sealed.is_some() && k % 2 == 1 {
            format!("t0123456789abcdef0123456789abcdef.key-{k}")
        } else {
            format!("key-{k}")
        };
        let len = if k.is_multiple_of(3) { 2 * unit } else { unit };
        match (r >> 16) % 10 {
            0..=5 => {
                // SAFETY: inside `src`.
                let ok = unsafe { s.put(&[(&key, p + content(k), len)]) }.unwrap()[0];
                if ok {
                    acked.insert(key, content(k));
                }
            }
            6 | 7 => {
                if s.delete(&[&key]).is_ok() {
                    acked.remove(&key);
                }
            }
            _ => {
                let dst = payload(1, 2 * unit as usize, 0);
                if get1(&s, &key, dst.as_ptr() as usize, len) {
                    // SAFETY: both ranges are inside live regions.
                    let same = unsafe {
                        std::slice::from_raw_parts(dst.as_ptr(), len as usize)
                            == std::slice::from_raw_parts(
                                (p + content(k)) as *const u8,
                                len as usize,
                            )
                    };
                    assert!(same, "{point}: served wrong bytes for {key}");
                }
            }
        }
    }
    *seen_faults.entry(point).or_insert(0) += fault::hits(point);
    fault::clear();
    let mut before = workload_keys(&s);
    before.sort();
    let evicted =
        s.stats.evictions.load(Ordering::Relaxed) + s.stats.corrupt_reads.load(Ordering::Relaxed);
    // acknowledged, never deleted by us, and gone: only eviction (or a dropped corrupt object) may do that
    let vanished = acked
        .keys()
        .filter(|k| before.binary_search(k).is_err())
        .count() as u64;
    assert!(
        vanished <= evicted,
        "{point}: {vanished} acknowledged objects vanished, {evicted} evicted"
    );
    let poisoned = s.poisoned();
    drop(s);
    let s = PageStore::open(&root, "ns", o.clone()).unwrap();
    let mut after = workload_keys(&s);
    after.sort();
    if !poisoned {
        let only_before: Vec<_> = before.iter().filter(|k| !after.contains(k)).collect();
        let only_after: Vec<_> = after.iter().filter(|k| !before.contains(k)).collect();
        assert!(
            only_before.is_empty() && only_after.is_empty(),
            "{point} {kind:?}: reopen disagrees with memory: only in memory {only_before:?}, only \
             after reopen {only_after:?} ({:?})",
            s.open_report()
        );
    } else {
        // a poisoned journal may hold a partial record: the index can only have lost what was
        // never acknowledged
        assert!(
            before.iter().all(|k| after.binary_search(k).is_ok()),
            "{point}: lost after poison"
        );
    }
    let dst = payload(1, 2 * unit as usize, 0);
    for k in &before {
        let i: u64 = k.rsplit("key-").next().unwrap().parse().unwrap();
        let len = if i.is_multiple_of(3) { 2 * unit } else { unit };
        assert!(get1(&s, k, dst.as_ptr() as usize, len), "{point}: {k} lost");
        // SAFETY: inside live regions.
        let same = unsafe {
            std::slice::from_raw_parts(dst.as_ptr(), len as usize)
                == std::slice::from_raw_parts((p + content(i)) as *const u8, len as usize)
        };
        assert!(same, "{point}: {k} wrong bytes after reopen");
    }
    let (data, journal) = s.occupancy();
    assert!(data + journal <= cap, "{point}: {data} + {journal} > {cap}");
    if coded {
        assert!(s.content().0 > 0, "{point}: nothing stored coded");
    }
    std::fs::remove_dir_all(root).unwrap();
}

/// How many seeds to run: the environment variable `var`, else `default`.
fn seeds(var: &str, default: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Hole punching failing part-way, with many seeds: the order in which free slots are punched differs
/// from run to run (hash order), and one such order once left the index and the journal disagreeing.
/// The same workload with a codec, on objects it stores in fewer blocks: every point failing (the coding
/// before the reservation, the coded reads in pieces) loses no acknowledged object and serves no wrong byte.
#[test]
fn every_io_point_failing_loses_no_acknowledged_coded_object() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut seen_faults = HashMap::new();
    for (n, point) in POINTS.iter().enumerate() {
        workload(
            point,
            Fault::Error(libc::EIO),
            0x7777_0000u64 + n as u64,
            None,
            true,
            &mut seen_faults,
        );
    }
}

#[test]
fn failing_punches_keep_memory_and_journal_in_step() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut seen = HashMap::new();
    let seeds = seeds("KVTIER_PUNCH_SEEDS", 12);
    for seed in 0..seeds {
        workload(
            "punch",
            Fault::Error(libc::EIO),
            0xC0FF_EE00 + seed,
            None,
            false,
            &mut seen,
        );
    }
    assert!(seen["punch"] > 0, "no punch failed");
}

/// The workload of [`every_io_point_failing_loses_no_acknowledged_object`] with `KVTIER_FAULT_SEEDS` seeds
/// (default 3) at every point and kind: a longer hunt for orders that only some runs take (hash order,
/// thread timing). Not in CI: `cargo test -p kvtier-core --lib -- --ignored every_io_point_many_seeds`.
#[test]
#[ignore]
fn every_io_point_many_seeds() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let seeds = seeds("KVTIER_FAULT_SEEDS", 3);
    let mut seen = HashMap::new();
    for seed in 0..seeds {
        for point in POINTS {
            for kind in [Fault::Error(libc::ENOSPC), Fault::Error(libc::EIO)] {
                workload(
                    point,
                    kind,
                    0x5EED_0000 + seed * 131,
                    None,
                    seed % 2 == 1,
                    &mut seen,
                );
            }
        }
    }
}
