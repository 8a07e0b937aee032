//! Pages read in two passes (`get_pages_in_two`: a page's first layers, then the rest, then the check of
//! the whole): what `between` sees, damage in either half, a failed first pass, bad arguments, a missing
//! page — `between` is called exactly once on every path, and no page is served that was not read whole.

use super::{bytes_at, opts, payload, tmp, SERIAL};
use crate::fault::{self, Fault};
use crate::store::*;
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;

const K: usize = 16384; // 4 layers of 4 KiB
const V: usize = 8192; // 4 layers of 2 KiB
const LAYERS: usize = 4;

/// A store with pages `p0`, `p1` put from pages 0 and 1 of `src`, and a pool `dst` bound for reading.
fn stored(
    root: &std::path::Path,
) -> (
    PageStore,
    crate::buffer::HostRegion,
    crate::buffer::HostRegion,
) {
    let (s, src, dst, ok) = stored_with(root, None);
    assert_eq!(ok, vec![true, true]);
    (s, src, dst)
}

/// As [`stored`], with `fault` at `data_write` (calls to let through, fault) while the pages are put; also
/// returns what the put acknowledged.
fn stored_with(
    root: &std::path::Path,
    fault_at_write: Option<(u64, Fault)>,
) -> (
    PageStore,
    crate::buffer::HostRegion,
    crate::buffer::HostRegion,
    Vec<bool>,
) {
    let src = payload(16, 8192, 41); // 4 pages: K at 0.., V at 64 KiB..
    let dst = payload(16, 8192, 0);
    let s = PageStore::open(root, "ns", opts(1 << 30)).unwrap();
    let layout = |base: usize| PageLayout {
        k_base: base,
        k_stride: K,
        k_len: K as u64,
        v_base: base + 65536,
        v_stride: V,
        v_len: V as u64,
        page_tokens: 4,
        pages: 4,
    };
    // SAFETY: every page's K (16 KiB) and V (8 KiB) lie inside `src` (128 KiB), alive for the test.
    unsafe { s.bind_pages(layout(src.as_ptr() as usize)) }.unwrap();
    let keys: Vec<String> = vec!["p0".into(), "p1".into()];
    let idx: Vec<i64> = (0..8).collect();
    if let Some((skip, f)) = fault_at_write {
        fault::set("data_write", skip, 1, f);
    }
    let ok = s.put_pages(&PageBatch {
        keys: &keys,
        host_indices: &idx,
    });
    fault::clear();
    // SAFETY: as above, for `dst`.
    unsafe { s.bind_pages(layout(dst.as_ptr() as usize)) }.unwrap();
    (s, src, dst, ok.unwrap())
}

fn read(s: &PageStore, first: usize, between: &mut dyn FnMut()) -> Result<Vec<bool>> {
    let keys: Vec<String> = vec!["p0".into(), "p1".into()];
    let idx: Vec<i64> = (0..8).collect();
    let batch = PageBatch {
        keys: &keys,
        host_indices: &idx,
    };
    s.get_pages_in_two(&batch, LAYERS, first, between)
}

#[test]
fn the_first_layers_are_in_memory_when_between_runs_and_the_rest_after() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let (s, src, dst) = stored(&root);
    let (mut calls, mut seen_first, mut seen_rest) = (0, false, true);
    let ok = read(&s, 1, &mut || {
        calls += 1;
        // page 1's K: its first layer (4 KiB) is there, its last one not yet; V alike (2 KiB a layer)
        seen_first = bytes_at(&dst, K, 4096) == bytes_at(&src, K, 4096)
            && bytes_at(&dst, 65536 + V, 2048) == bytes_at(&src, 65536 + V, 2048);
        seen_rest = bytes_at(&dst, K + 3 * 4096, 4096) == bytes_at(&src, K + 3 * 4096, 4096);
    })
    .unwrap();
    assert_eq!((ok, calls), (vec![true, true], 1));
    assert!(
        seen_first && !seen_rest,
        "between ran before the first layers were in, or after the rest"
    );
    assert_eq!(bytes_at(&dst, 0, 2 * K), bytes_at(&src, 0, 2 * K));
    assert_eq!(bytes_at(&dst, 65536, 2 * V), bytes_at(&src, 65536, 2 * V));
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn damage_in_either_half_fails_the_page_and_drops_it() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    for at in [100u64, 3 * 4096 + 100] {
        let root = tmp();
        let (s, _src, _dst) = stored(&root);
        // every K object in the data file of its class: damage both pages' K at `at` (layer 0, or layer 3)
        for f in s.data_files() {
            let data = OpenOptions::new().read(true).write(true).open(&f).unwrap();
            let len = data.metadata().unwrap().len();
            for slot in 0..len / K as u64 {
                data.write_all_at(&[0xA5; 7], slot * K as u64 + at).unwrap();
            }
            data.sync_all().unwrap();
        }
        let mut calls = 0;
        let ok = read(&s, 2, &mut || calls += 1).unwrap();
        assert_eq!((ok, calls), (vec![false, false], 1), "damage at {at}");
        assert!(s.stats.corrupt_reads.load(Ordering::Relaxed) >= 2);
        std::fs::remove_dir_all(root).unwrap();
    }
}

#[test]
fn a_first_pass_that_failed_fails_the_page_even_if_the_rest_reads() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let (s, _src, _dst) = stored(&root);
    // the first of the four first-pass reads fails; every read after it succeeds
    fault::set("data_read", 0, 1, Fault::Error(libc::EIO));
    let mut calls = 0;
    let ok = read(&s, 2, &mut || calls += 1).unwrap();
    fault::clear();
    assert_eq!(calls, 1);
    assert_eq!(ok.iter().filter(|b| !**b).count(), 1, "{ok:?}");
    // an IO error is no damage: the object stays, and reads whole again
    let mut again = 0;
    assert_eq!(read(&s, 2, &mut || again += 1).unwrap(), vec![true, true]);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn bad_arguments_and_missing_pages_still_call_between_once() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let (s, _src, _dst) = stored(&root);
    for first in [0, LAYERS, LAYERS + 1] {
        let mut calls = 0;
        assert!(matches!(
            read(&s, first, &mut || calls += 1),
            Err(Error::InvalidArgument { .. })
        ));
        assert_eq!(calls, 1, "first_layers {first}");
    }
    let keys: Vec<String> = vec!["p0".into(), "nope".into()];
    let idx: Vec<i64> = (0..8).collect();
    let mut calls = 0;
    let ok = s
        .get_pages_in_two(
            &PageBatch {
                keys: &keys,
                host_indices: &idx,
            },
            LAYERS,
            1,
            &mut || calls += 1,
        )
        .unwrap();
    assert_eq!((ok, calls), (vec![true, false], 1));
    let bad: Vec<i64> = (0..9).collect();
    let mut calls = 0;
    assert!(s
        .get_pages_in_two(
            &PageBatch {
                keys: &keys,
                host_indices: &bad,
            },
            LAYERS,
            1,
            &mut || calls += 1,
        )
        .is_err());
    assert_eq!(calls, 1, "an index out of the batch's pages");
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn objects_not_a_whole_number_of_layers_read_whole_before_between() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let (s, src, dst) = stored(&root);
    // 3 "layers" of 16 KiB K objects: no layer boundary to stop at, so the whole page is in before `between`
    let keys: Vec<String> = vec!["p0".into(), "p1".into()];
    let idx: Vec<i64> = (0..8).collect();
    let mut whole = false;
    let ok = s
        .get_pages_in_two(
            &PageBatch {
                keys: &keys,
                host_indices: &idx,
            },
            3,
            1,
            &mut || {
                whole = bytes_at(&dst, 0, 2 * K) == bytes_at(&src, 0, 2 * K)
                    && bytes_at(&dst, 65536, 2 * V) == bytes_at(&src, 65536, 2 * V);
            },
        )
        .unwrap();
    assert_eq!(ok, vec![true, true]);
    assert!(whole, "between ran before the pages were read whole");
    std::fs::remove_dir_all(root).unwrap();
}

/// Whether page `i` of `dst` holds page `i` of `src` (K and V, every layer).
fn page_same(src: &crate::buffer::HostRegion, dst: &crate::buffer::HostRegion, i: usize) -> bool {
    bytes_at(dst, i * K, K) == bytes_at(src, i * K, K)
        && bytes_at(dst, 65536 + i * V, V) == bytes_at(src, 65536 + i * V, V)
}

#[test]
fn a_read_error_at_any_call_of_either_pass_never_serves_a_page_not_read_whole() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    // 2 pages x (K, V) x 2 passes = 8 reads; each one failing, once and twice in a row, and every read slow
    let mut cases: Vec<(u64, u64, Fault)> = (0..8)
        .flat_map(|skip| {
            [
                (skip, 1, Fault::Error(libc::EIO)),
                (skip, 2, Fault::Error(libc::EIO)),
            ]
        })
        .collect();
    cases.push((0, 8, Fault::Delay(std::time::Duration::from_millis(2))));
    let root = tmp();
    let (s, src, dst) = stored(&root);
    for (skip, times, f) in cases {
        for first in [1, 2, 3] {
            // SAFETY: the region owns its `len()` bytes, and no read is in flight.
            unsafe { std::ptr::write_bytes(dst.as_ptr(), 0, dst.len()) };
            let mut calls = 0;
            fault::set("data_read", skip, times, f);
            let ok = read(&s, first, &mut || calls += 1).unwrap();
            fault::clear();
            assert_eq!(
                calls, 1,
                "between once ({skip}, {times}, {f:?}, first {first})"
            );
            for (i, served) in ok.iter().enumerate() {
                assert!(
                    !served || page_same(&src, &dst, i),
                    "page {i} served with other bytes ({skip}, {times}, {f:?}, first {first})"
                );
            }
            if matches!(f, Fault::Delay(_)) {
                assert_eq!(ok, vec![true, true], "a slow read is no failure");
            } else {
                assert!(
                    ok.contains(&false),
                    "a failed read was not reported ({skip}, {times})"
                );
            }
            // an IO error is no damage: nothing was dropped, and both pages read whole again
            let mut again = 0;
            assert_eq!(
                read(&s, first, &mut || again += 1).unwrap(),
                vec![true, true]
            );
        }
    }
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn a_torn_write_is_caught_by_the_two_pass_read_whichever_object_it_tore() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    // the put writes 4 objects (2 pages x K, V); each one torn in turn (half written, zeros after, success
    // reported): the tear lies in the object's second half, so in the second pass for first = 1 or 2, and
    // in the first for first = 3 (K's third layer starts at 8 KiB, V's at 4 KiB)
    for skip in 0..4 {
        for first in [1, 2, 3] {
            let root = tmp();
            let (s, src, dst, acked) = stored_with(&root, Some((skip, Fault::Torn)));
            assert_eq!(acked, vec![true, true], "a torn write reports success");
            let mut calls = 0;
            let ok = read(&s, first, &mut || calls += 1).unwrap();
            assert_eq!(calls, 1);
            assert_eq!(
                ok.iter().filter(|b| !**b).count(),
                1,
                "torn object {skip}, first {first}: {ok:?}"
            );
            for (i, served) in ok.iter().enumerate() {
                assert!(
                    !served || page_same(&src, &dst, i),
                    "page {i} served with other bytes"
                );
            }
            assert!(s.stats.corrupt_reads.load(Ordering::Relaxed) >= 1);
            std::fs::remove_dir_all(root).unwrap();
        }
    }
}
