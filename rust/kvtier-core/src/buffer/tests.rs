use super::*;

fn opts(a: usize, h: HugePages) -> RegionOptions {
    RegionOptions {
        alignment: a,
        huge_pages: h,
        prefault_threads: Some(2),
        progress: None,
    }
}

#[test]
fn aligned_and_rounded() {
    for &a in &[4096usize, 8192, 1 << 16, 1 << 21, 1 << 22] {
        for &n in &[1usize, 4095, 4096, 4097, 3 << 20] {
            let r = HostRegion::new(n, &opts(a, HugePages::Off)).unwrap();
            assert_eq!(r.as_ptr() as usize % a, 0, "alignment {a} size {n}");
            assert!(r.len() >= n && r.len().is_multiple_of(4096));
            assert_eq!(r.page_kind(), PageKind::Base);
            // The whole range is writable and zeroed.
            // SAFETY: the region owns [ptr, ptr+len).
            let s = unsafe { std::slice::from_raw_parts_mut(r.as_ptr(), r.len()) };
            assert!(s.iter().all(|&b| b == 0));
            s[r.len() - 1] = 7;
        }
    }
}

#[test]
fn rejects_bad_arguments() {
    let e = HostRegion::new(0, &RegionOptions::default()).unwrap_err();
    assert!(e.to_string().contains("`nbytes`"), "{e}");
    for a in [0usize, 1000, 2048, 4097, 12288] {
        let e = HostRegion::new(4096, &opts(a, HugePages::Off)).unwrap_err();
        assert!(e.to_string().contains("`alignment`"), "{e}");
    }
    let e = HostRegion::new(usize::MAX, &RegionOptions::default()).unwrap_err();
    assert!(e.to_string().contains("`nbytes`"), "{e}");
    assert!(HugePages::parse("yes")
        .unwrap_err()
        .to_string()
        .contains("huge_pages"));
}

#[test]
fn huge_page_fallback_is_reported() {
    // Auto never fails; when it gets less than explicit pages it says why.
    let r = HostRegion::new(5 << 20, &opts(4096, HugePages::Auto)).unwrap();
    match r.page_kind() {
        PageKind::Explicit => assert!(r.fallback().is_none()),
        _ => assert!(r.fallback().is_some()),
    }
    if r.page_kind() != PageKind::Base {
        assert_eq!(r.as_ptr() as usize % HUGE_PAGE, 0);
        assert_eq!(r.len() % HUGE_PAGE, 0);
    }
    // Required fails cleanly where the system has no explicit huge pages.
    let nr = std::fs::read_to_string("/proc/sys/vm/nr_hugepages").unwrap_or_default();
    if nr.trim() == "0" {
        let e = HostRegion::new(2 << 20, &opts(4096, HugePages::Required)).unwrap_err();
        assert!(matches!(e, Error::HugePagesUnavailable(_)), "{e}");
    }
}

#[test]
fn concurrent_create_drop() {
    std::thread::scope(|s| {
        for t in 0..8 {
            s.spawn(move || {
                for i in 0..20 {
                    let r = HostRegion::new((t + 1) * (i + 1) * 65536, &RegionOptions::default())
                        .unwrap();
                    // SAFETY: inside the region.
                    unsafe { *r.as_ptr().add(r.len() - 1) = t as u8 };
                }
            });
        }
    });
}

#[test]
fn chunks_respect_granularity() {
    let c = registration_chunks(10 * 3000, 3000, 7000).unwrap();
    assert_eq!(
        c,
        vec![
            (0, 6000),
            (6000, 6000),
            (12000, 6000),
            (18000, 6000),
            (24000, 6000)
        ]
    );
    let c = registration_chunks(10_000, 3000, 1 << 30).unwrap();
    assert_eq!(c, vec![(0, 10_000)]);
    assert!(registration_chunks(10, 3000, 2000).is_err());
    assert!(registration_chunks(10, 0, 2000).is_err());
}

#[test]
fn unpinned_region_has_no_registrations() {
    let r = HostRegion::new(1 << 20, &RegionOptions::default()).unwrap();
    assert!(r.registered_chunks().is_empty());
    r.unregister_cuda().unwrap();
}
