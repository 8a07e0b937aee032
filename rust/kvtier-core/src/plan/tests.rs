use super::*;

fn rules(host_pages: bool, device_runs: bool) -> IndexRules {
    IndexRules {
        host_slots: 16,
        device_rows: 20,
        page_size: 4,
        host_pages,
        device_runs,
        destination_is_host: false,
    }
}

#[test]
fn page_extents_cover_each_page_once() {
    for layout in [
        Layout::LayerFirst,
        Layout::PageFirst,
        Layout::PageFirstDirect,
    ] {
        let g = HostGeometry::new(layout, 3, 8, 4, 6).unwrap();
        let mut seen = vec![0u8; g.nbytes()];
        for p in 0..2 {
            let ext = g.page_extents(p);
            assert_eq!(ext.iter().map(|e| e.1).sum::<usize>(), g.page_bytes());
            for (o, n) in ext {
                for b in &mut seen[o..o + n] {
                    *b += 1;
                }
            }
            // every (layer, slot) of the page lies inside one of its extents
            for l in 0..3 {
                for t in p * 4..p * 4 + 4 {
                    let o = g.offset(l, t);
                    assert!(
                        g.page_extents(p)
                            .iter()
                            .any(|&(a, n)| a <= o && o + 6 <= a + n),
                        "{layout:?}"
                    );
                }
            }
        }
        assert!(
            seen.iter().all(|&c| c == 1),
            "{layout:?}: pages overlap or leave gaps"
        );
    }
}

#[test]
fn offsets_match_the_shapes() {
    let (l, s, ps, row) = (3, 8, 2, 10);
    for layout in [
        Layout::LayerFirst,
        Layout::PageFirst,
        Layout::PageFirstDirect,
    ] {
        let g = HostGeometry::new(layout, l, s, ps, row).unwrap();
        let mut seen = std::collections::HashSet::new();
        for li in 0..l {
            for t in 0..s {
                let o = g.offset(li, t);
                assert!(o + row <= g.nbytes());
                assert_eq!(o % row, 0);
                assert!(seen.insert(o), "{layout:?} maps two rows to {o}");
            }
        }
    }
    let g = HostGeometry::new(Layout::PageFirstDirect, l, s, ps, row).unwrap();
    // page 1, layer 2, second token: ((1*3 + 2)*2 + 1) rows
    assert_eq!(g.offset(2, 3), 11 * row);
}

#[test]
fn validation_names_the_argument() {
    let r = rules(true, true);
    let ok: Vec<i64> = (4..8).collect();
    validate(&ok, &[9, 10, 11, 12], &r).unwrap();
    let cases: Vec<(Vec<i64>, Vec<i64>, &str)> = vec![
        (vec![0, 1, 2, 3], vec![0, 1, 2], "same length"),
        (
            vec![16, 17, 18, 19],
            vec![0, 1, 2, 3],
            "host_indices[0] = 16 is out of range",
        ),
        (
            vec![0, 1, 2, 3],
            vec![17, 18, 19, 20],
            "device_indices[3] = 20 is out of range",
        ),
        (vec![0, 1, 2, -1], vec![0, 1, 2, 3], "host_indices[3] = -1"),
        (vec![1, 2, 3, 4], vec![0, 1, 2, 3], "does not start a page"),
        (vec![0, 1, 3, 2], vec![0, 1, 2, 3], "consecutive"),
        (
            vec![0, 1, 2, 3],
            vec![0, 1, 3, 4],
            "device slots must be consecutive",
        ),
        (
            vec![0, 1, 2, 3, 4, 5, 6, 7],
            vec![0, 1, 2, 3, 0, 1, 2, 3],
            "appears twice",
        ),
    ];
    for (h, d, msg) in cases {
        let e = validate(&h, &d, &r).unwrap_err().to_string();
        assert!(e.contains(msg), "{h:?} {d:?}: {e}");
    }
    // token-granular rules accept any in-range distinct destinations
    validate(&[5, 3, 9], &[1, 0, 7], &rules(false, false)).unwrap();
}

#[test]
fn plan_coalesces_pages_and_runs() {
    let g = HostGeometry::new(Layout::PageFirstDirect, 2, 8, 4, 16).unwrap();
    // pages 1 and 0 of the host to device rows 8.. and 12.. : one chunk per page and layer
    let host = [4i64, 5, 6, 7, 0, 1, 2, 3];
    let dev = [8i64, 9, 10, 11, 12, 13, 14, 15];
    let c = plan(&g, &host, &dev, 0..2, usize::MAX, 0);
    assert_eq!(c.len(), 4);
    assert!(c.iter().all(|c| c.len == 64));
    assert_eq!(
        c[0],
        Chunk {
            layer: 0,
            host_off: g.offset(0, 4) as u64,
            device_off: 128,
            len: 64
        }
    );
    // page_first is contiguous across layers, not tokens: one chunk per token per layer
    let g = HostGeometry::new(Layout::PageFirst, 2, 8, 4, 16).unwrap();
    assert_eq!(plan(&g, &host, &dev, 1..2, usize::MAX, 0).len(), 8);
    // layer_first with consecutive indices coalesces everything
    let g = HostGeometry::new(Layout::LayerFirst, 2, 8, 4, 16).unwrap();
    let c = plan(&g, &[0, 1, 2, 3, 4, 5, 6, 7], &dev, 0..1, usize::MAX, 0);
    assert_eq!(c.len(), 1);
    // ... unless asked to split at a registration boundary
    assert_eq!(
        plan(&g, &[0, 1, 2, 3, 4, 5, 6, 7], &dev, 0..1, 64, 0).len(),
        2
    );
    // the boundary is counted from the registration's start: 32 bytes in, the split falls mid-run
    let c = plan(&g, &[0, 1, 2, 3, 4, 5, 6, 7], &dev, 0..1, 64, 32);
    assert_eq!(
        c.iter().map(|c| c.len).collect::<Vec<_>>(),
        vec![32, 64, 32]
    );
}

#[test]
fn copy_cpu_checks_bounds() {
    let mut host = vec![0u8; 64];
    let mut dev = vec![0u8; 32];
    let h = RawRange {
        ptr: host.as_mut_ptr() as usize,
        len: 64,
    };
    let d = [RawRange {
        ptr: dev.as_mut_ptr() as usize,
        len: 32,
    }];
    let bad = [Chunk {
        layer: 0,
        host_off: 0,
        device_off: 16,
        len: 32,
    }];
    // SAFETY: the ranges are the two live Vecs above.
    assert!(unsafe { copy_cpu(Direction::HostToDevice, h, &d, &bad) }.is_err());
    let bad_layer = [Chunk {
        layer: 1,
        host_off: 0,
        device_off: 0,
        len: 1,
    }];
    // SAFETY: as above.
    assert!(unsafe { copy_cpu(Direction::HostToDevice, h, &d, &bad_layer) }.is_err());
    host.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
    let ok = [Chunk {
        layer: 0,
        host_off: 8,
        device_off: 4,
        len: 8,
    }];
    // SAFETY: as above.
    unsafe { copy_cpu(Direction::HostToDevice, h, &d, &ok) }.unwrap();
    assert_eq!(&dev[4..12], &host[8..16]);
    assert!(dev[..4].iter().chain(&dev[12..]).all(|&b| b == 0));
}
