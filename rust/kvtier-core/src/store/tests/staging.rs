//! Staging pages: bound beside the pool with its geometry, batches read into and written from them, copies
//! between the two checked before a byte moves.

use super::{bytes_at, opts, payload, tmp, SERIAL};
use crate::store::*;

/// `pages` pages of 4 tokens at `base`: K 8 KiB then V 4 KiB, side by side in a 12 KiB stride.
fn pages_at(base: usize, pages: usize) -> PageLayout {
    PageLayout {
        k_base: base,
        k_stride: 12288,
        k_len: 8192,
        v_base: base + 8192,
        v_stride: 12288,
        v_len: 4096,
        page_tokens: 4,
        pages,
    }
}

fn page_bytes(r: &crate::buffer::HostRegion, page: usize) -> Vec<u8> {
    bytes_at(r, page * 12288, 12288)
}

fn slots(pages: &[i64]) -> Vec<i64> {
    pages.iter().flat_map(|p| (p * 4)..(p * 4 + 4)).collect()
}

#[test]
fn staged_batches_and_copies_move_whole_pages_and_refuse_bad_arguments() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let pool = payload(8, 12288, 41);
    let staging = payload(4, 12288, 42);
    let (pb, sb) = (pool.as_ptr() as usize, staging.as_ptr() as usize);
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    // SAFETY: 8 pages of 12 KiB inside `pool`, alive for the test.
    unsafe { s.bind_pages(pages_at(pb, 8)) }.unwrap();
    // the bad layouts below must be refused before they are bound
    assert!(
        // SAFETY: inside `staging`, alive for the test (and refused: other object sizes).
        unsafe {
            s.bind_staging(PageLayout {
                k_len: 4096,
                ..pages_at(sb, 4)
            })
        }
        .is_err(),
        "other sizes"
    );
    assert!(
        // SAFETY: inside `pool`, alive for the test (and refused: it overlaps the pool).
        unsafe { s.bind_staging(pages_at(pb + 6 * 12288, 2)) }.is_err(),
        "inside the pool"
    );
    let none = s.copy_pages(true, &slots(&[0]), &slots(&[0]));
    assert!(
        matches!(none, Err(Error::InvalidArgument { .. })),
        "nothing bound: {none:?}"
    );
    // SAFETY: 4 pages of 12 KiB inside `staging`, alive for the test, apart from `pool`.
    unsafe { s.bind_staging(pages_at(sb, 4)) }.unwrap();

    // pool pages 2 and 3 -> staging 0 and 1 -> stored from staging
    let keys: Vec<String> = vec!["a".into(), "b".into()];
    let (p2, p3) = (page_bytes(&pool, 2), page_bytes(&pool, 3));
    s.copy_pages(false, &slots(&[2, 3]), &slots(&[0, 1]))
        .unwrap();
    assert_eq!(
        (page_bytes(&staging, 0), page_bytes(&staging, 1)),
        (p2.clone(), p3.clone())
    );
    let st01 = slots(&[0, 1]);
    let put = PageBatch {
        keys: &keys,
        host_indices: &st01,
    };
    assert_eq!(
        s.page_batch(&put, false, Pages::Staging).unwrap(),
        vec![true, true]
    );

    // read back into staging 3 and 2, then into pool pages 6 and 5: the stored bytes, in key order
    let st32 = slots(&[3, 2]);
    let get = PageBatch {
        keys: &keys,
        host_indices: &st32,
    };
    assert_eq!(
        s.page_batch(&get, true, Pages::Staging).unwrap(),
        vec![true, true]
    );
    assert_eq!(
        (page_bytes(&staging, 3), page_bytes(&staging, 2)),
        (p2.clone(), p3.clone())
    );
    let before: Vec<Vec<u8>> = (0..8).map(|p| page_bytes(&pool, p)).collect();
    for (host, st) in [
        (slots(&[6, 5]), slots(&[3])),    // counts differ
        (slots(&[6, 6]), slots(&[3, 2])), // one destination twice
        (slots(&[6, 8]), slots(&[3, 2])), // past the pool
        (slots(&[6, 5]), slots(&[3, 4])), // past the staging pages
        (vec![24, 25, 26], slots(&[3])),  // not whole pages
    ] {
        let r = s.copy_pages(true, &host, &st);
        assert!(
            matches!(r, Err(Error::InvalidArgument { .. })),
            "{host:?} {st:?}: {r:?}"
        );
    }
    let after: Vec<Vec<u8>> = (0..8).map(|p| page_bytes(&pool, p)).collect();
    assert_eq!(before, after, "a refused copy moved bytes");
    s.copy_pages(true, &slots(&[6, 5]), &slots(&[3, 2]))
        .unwrap();
    assert_eq!((page_bytes(&pool, 6), page_bytes(&pool, 5)), (p2, p3));
    for p in [0, 1, 2, 3, 4, 7] {
        assert_eq!(page_bytes(&pool, p), before[p], "page {p} changed");
    }

    // a staged read of a missing page is False and leaves the pool alone
    let missing: Vec<String> = vec!["zz".into()];
    let st0 = slots(&[0]);
    let miss = PageBatch {
        keys: &missing,
        host_indices: &st0,
    };
    assert_eq!(
        s.page_batch(&miss, true, Pages::Staging).unwrap(),
        vec![false]
    );
}

/// A copy of more than the parallel threshold is split among threads and still lands every byte.
#[test]
fn a_large_copy_lands_every_byte() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let n = 1600; // 1600 pages of 12 KiB: about 19 MiB, past the threshold
    let pool = payload(n, 12288, 43);
    let staging = payload(n, 12288, 44);
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    // SAFETY: n pages inside each region, alive for the test, the two regions apart.
    unsafe { s.bind_pages(pages_at(pool.as_ptr() as usize, n)) }.unwrap();
    // SAFETY: as above.
    unsafe { s.bind_staging(pages_at(staging.as_ptr() as usize, n)) }.unwrap();
    let host: Vec<i64> = (0..n as i64).collect();
    let rev: Vec<i64> = (0..n as i64).rev().collect();
    s.copy_pages(false, &slots(&host), &slots(&rev)).unwrap();
    for p in [0, 1, n / 2, n - 1] {
        assert_eq!(
            page_bytes(&staging, n - 1 - p),
            page_bytes(&pool, p),
            "page {p}"
        );
    }
}

/// Binding another pool unbinds the staging pages (checked against the old pool only): a copy or a staged
/// batch is refused until staging pages are bound again, and are checked against the new pool then.
#[test]
fn binding_another_pool_unbinds_the_staging_pages() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let pool = payload(8, 12288, 45);
    let staging = payload(4, 12288, 46);
    let (pb, sb) = (pool.as_ptr() as usize, staging.as_ptr() as usize);
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    // SAFETY: 8 pages of 12 KiB inside `pool`, alive for the test.
    unsafe { s.bind_pages(pages_at(pb, 8)) }.unwrap();
    // SAFETY: 4 pages of 12 KiB inside `staging`, alive for the test, apart from `pool`.
    unsafe { s.bind_staging(pages_at(sb, 4)) }.unwrap();
    s.copy_pages(false, &slots(&[0]), &slots(&[0])).unwrap();
    // the new pool: 4-KiB K objects (the old staging pages' 8 KiB would overrun its pages)
    let small = PageLayout {
        k_len: 4096,
        v_base: pb + 4096,
        ..pages_at(pb, 8)
    };
    // SAFETY: 8 pages inside `pool`, alive for the test.
    unsafe { s.bind_pages(small) }.unwrap();
    let before: Vec<Vec<u8>> = (0..8).map(|p| page_bytes(&pool, p)).collect();
    let r = s.copy_pages(true, &slots(&[1]), &slots(&[0]));
    assert!(
        matches!(r, Err(Error::InvalidArgument { .. })),
        "staging of the old pool: {r:?}"
    );
    let keys: Vec<String> = vec!["a".into()];
    let st0 = slots(&[0]);
    let get = PageBatch {
        keys: &keys,
        host_indices: &st0,
    };
    assert!(s.page_batch(&get, true, Pages::Staging).is_err());
    let after: Vec<Vec<u8>> = (0..8).map(|p| page_bytes(&pool, p)).collect();
    assert_eq!(before, after, "a refused copy moved bytes");
    // SAFETY: inside `staging`, alive for the test (and refused: the old object sizes).
    assert!(unsafe { s.bind_staging(pages_at(sb, 4)) }.is_err());
    let fits = PageLayout {
        k_len: 4096,
        v_base: sb + 4096,
        ..pages_at(sb, 4)
    };
    // SAFETY: 4 pages inside `staging`, alive for the test, apart from `pool`.
    unsafe { s.bind_staging(fits) }.unwrap();
    s.copy_pages(true, &slots(&[1]), &slots(&[0])).unwrap();
}
