//! Transfer plans: which bytes move between a host KV buffer and per-layer device KV tensors.
//!
//! One side of one pool (K or V, never both: their row sizes differ in asymmetric models) is described by a
//! [`HostGeometry`]. A transfer is a pair of equal-length token-slot index lists, element i of the host list
//! mapping to element i of the device list, applied to a set of layers. [`validate`] proves every index in
//! range (and page structure where the layout needs it) *before* any copy is planned; [`plan`] then turns the
//! pairs into [`Chunk`]s — maximal byte ranges contiguous on both sides — that a copy engine executes:
//! [`copy_cpu`] here, the CUDA copy engine or a GPU kernel elsewhere.
//!
//! Byte offsets, for a token slot `t` and layer `l` with `row = heads * dim * itemsize`:
//! - `layer_first` `(L, S, H, D)`: `l·S·row + t·row`
//! - `page_first` `(S, L, H, D)`: `t·L·row + l·row`
//! - `page_first_direct` `(P, L, ps, H, D)`: `(t / ps)·L·ps·row + l·ps·row + (t % ps)·row`
//! - device layer tensor `(rows, H, D)`: `t·row`

use crate::error::{Error, Result};

/// Host buffer layouts, named as in HiCache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// `(L, S, H, D)`.
    LayerFirst,
    /// `(S, L, H, D)`.
    PageFirst,
    /// `(P, L, ps, H, D)`.
    PageFirstDirect,
}

impl Layout {
    /// Parses HiCache's spelling.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "layer_first" => Ok(Self::LayerFirst),
            "page_first" => Ok(Self::PageFirst),
            "page_first_direct" => Ok(Self::PageFirstDirect),
            other => Err(Error::arg(
                "layout",
                format!("unsupported layout {other:?}; expected 'layer_first', 'page_first' or 'page_first_direct'"),
            )),
        }
    }
}

/// The geometry of one host buffer (K or V) of a pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostGeometry {
    /// Host layout.
    pub layout: Layout,
    /// Layers `L`.
    pub layers: usize,
    /// Token slots `S` (a multiple of `page_size`).
    pub slots: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// Bytes of one token of one layer: `heads * dim * itemsize`.
    pub row_bytes: usize,
}

impl HostGeometry {
    /// Checks the geometry and that its byte size fits in memory.
    pub fn new(
        layout: Layout,
        layers: usize,
        slots: usize,
        page_size: usize,
        row_bytes: usize,
    ) -> Result<Self> {
        for (n, v) in [
            ("layer_num", layers),
            ("size", slots),
            ("page_size", page_size),
            ("row_bytes", row_bytes),
        ] {
            if v == 0 {
                return Err(Error::arg(n, "must be positive, got 0"));
            }
        }
        if slots % page_size != 0 {
            return Err(Error::arg(
                "size",
                format!("{slots} is not a multiple of page_size {page_size}"),
            ));
        }
        let g = Self {
            layout,
            layers,
            slots,
            page_size,
            row_bytes,
        };
        layers
            .checked_mul(slots)
            .and_then(|x| x.checked_mul(row_bytes))
            .filter(|&x| x <= isize::MAX as usize / 2)
            .ok_or_else(|| Error::arg("size", "the host buffer size overflows"))?;
        Ok(g)
    }

    /// Total bytes of the buffer.
    pub fn nbytes(&self) -> usize {
        self.layers * self.slots * self.row_bytes
    }

    /// Bytes of one page across all layers (the unit a page store reads and writes for page-first layouts).
    pub fn page_bytes(&self) -> usize {
        self.page_size * self.layers * self.row_bytes
    }

    /// The layout as three byte strides: `offset(layer, slot) = (slot / page_size)·page + (slot %
    /// page_size)·token + layer·layer`. This is the one place kvtier spells out HiCache's host layouts: the
    /// DMA plans, the kernels' launch descriptions (via the binding), the page extents zero-copy storage
    /// backends see and the page store's bound layout are all derived from it.
    #[inline]
    pub fn strides(&self) -> Strides {
        let (r, ps, l, s) = (self.row_bytes, self.page_size, self.layers, self.slots);
        match self.layout {
            Layout::LayerFirst => Strides {
                page: ps * r,
                token: r,
                layer: s * r,
            },
            Layout::PageFirst => Strides {
                page: ps * l * r,
                token: l * r,
                layer: r,
            },
            Layout::PageFirstDirect => Strides {
                page: l * ps * r,
                token: r,
                layer: ps * r,
            },
        }
    }

    /// Byte offset of `(layer, slot)`. Callers pass validated values (`layer < L`, `slot < S`).
    #[inline]
    pub fn offset(&self, layer: usize, slot: usize) -> usize {
        let st = self.strides();
        let ps = self.page_size;
        if st.page == ps * st.token {
            // a page is page_size tokens in a row (layer_first, page_first): no division on the plans' hot loop
            slot * st.token + layer * st.layer
        } else {
            slot / ps * st.page + slot % ps * st.token + layer * st.layer
        }
    }

    /// The contiguous byte extents `(offset, len)` of page `page` (`page < slots / page_size`): the whole
    /// page in page-first layouts, one extent per layer in `layer_first`.
    pub fn page_extents(&self, page: usize) -> Vec<(usize, usize)> {
        match self.layout {
            Layout::LayerFirst => (0..self.layers)
                .map(|l| {
                    (
                        self.offset(l, page * self.page_size),
                        self.page_size * self.row_bytes,
                    )
                })
                .collect(),
            Layout::PageFirst | Layout::PageFirstDirect => {
                vec![(self.offset(0, page * self.page_size), self.page_bytes())]
            }
        }
    }
}

/// Byte strides of a host layout (see [`HostGeometry::strides`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strides {
    /// From one page to the next.
    pub page: usize,
    /// From one token to the next inside a page.
    pub token: usize,
    /// From one layer to the next.
    pub layer: usize,
}

/// Index rules of one transfer call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexRules {
    /// Host slots `S`.
    pub host_slots: usize,
    /// Rows of each device layer tensor.
    pub device_rows: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// Host indices must be whole pages (page-start multiple of `page_size`, consecutive inside a page).
    pub host_pages: bool,
    /// Device indices must come in consecutive runs of `page_size`, and lengths must be page multiples.
    pub device_runs: bool,
    /// Which side is written: its indices must be distinct (two writes to one row would race).
    pub destination_is_host: bool,
}

fn check_range(name: &str, idx: &[i64], limit: usize) -> Result<()> {
    for (i, &v) in idx.iter().enumerate() {
        if v < 0 || v as u64 >= limit as u64 {
            return Err(Error::arg(
                name,
                format!("{name}[{i}] = {v} is out of range [0, {limit})"),
            ));
        }
    }
    Ok(())
}

fn check_distinct(name: &str, idx: &[i64], limit: usize) -> Result<()> {
    let mut seen = vec![0u64; limit.div_ceil(64)];
    for (i, &v) in idx.iter().enumerate() {
        let v = v as usize; // in range: checked before
        let (w, b) = (v / 64, 1u64 << (v % 64));
        if seen[w] & b != 0 {
            return Err(Error::arg(
                name,
                format!("{name}[{i}] = {v} appears twice; a destination slot can be written once per call"),
            ));
        }
        seen[w] |= b;
    }
    Ok(())
}

/// Validates a transfer's index lists against `rules`. Nothing may be copied unless this returned Ok.
pub fn validate(host: &[i64], device: &[i64], rules: &IndexRules) -> Result<()> {
    if host.len() != device.len() {
        return Err(Error::arg(
            "device_indices",
            format!(
                "host_indices and device_indices must have the same length, got {} and {}",
                host.len(),
                device.len()
            ),
        ));
    }
    let ps = rules.page_size;
    check_range("host_indices", host, rules.host_slots)?;
    check_range("device_indices", device, rules.device_rows)?;
    if rules.host_pages {
        crate::alloc::page_starts(host, ps, rules.host_slots / ps, "host_indices")?;
    }
    if rules.device_runs {
        if device.len() % ps != 0 {
            return Err(Error::arg(
                "device_indices",
                format!(
                    "length {} is not a multiple of page_size {ps}",
                    device.len()
                ),
            ));
        }
        for (g, grp) in device.chunks_exact(ps).enumerate() {
            for (k, &v) in grp.iter().enumerate() {
                if v != grp[0] + k as i64 {
                    return Err(Error::arg(
                        "device_indices",
                        format!(
                            "device_indices[{}] = {v}: each page's {ps} device slots must be consecutive",
                            g * ps + k
                        ),
                    ));
                }
            }
        }
    }
    if rules.destination_is_host {
        check_distinct("host_indices", host, rules.host_slots)
    } else {
        check_distinct("device_indices", device, rules.device_rows)
    }
}

/// One contiguous copy: `len` bytes at `host_off` in the host buffer and `device_off` in layer `layer`'s
/// device tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Layer (index into the device tensors and the host buffer's layer dimension).
    pub layer: u32,
    /// Byte offset in the host buffer.
    pub host_off: u64,
    /// Byte offset in the device layer tensor.
    pub device_off: u64,
    /// Bytes.
    pub len: u64,
}

/// Plans the copies of `layers` for validated index lists: one chunk per maximal run where both the host
/// and device byte offsets advance by exactly one row. A chunk never crosses a multiple of `split` bytes on
/// the host side, counted from `origin` bytes before the buffer (pass the CUDA registration unit and the
/// buffer's offset inside its registered region, or `usize::MAX` and 0).
pub fn plan(
    geo: &HostGeometry,
    host: &[i64],
    device: &[i64],
    layers: std::ops::Range<usize>,
    split: usize,
    origin: usize,
) -> Vec<Chunk> {
    let row = geo.row_bytes as u64;
    let split = split.max(1) as u64;
    let origin = origin as u64;
    let mut out = Vec::new();
    for l in layers {
        let mut cur: Option<Chunk> = None;
        for (&h, &d) in host.iter().zip(device) {
            let ho = geo.offset(l, h as usize) as u64;
            let dof = d as u64 * row;
            if let Some(c) = cur.as_mut() {
                let same_split = (origin + c.host_off) / split == (origin + ho + row - 1) / split;
                if ho == c.host_off + c.len && dof == c.device_off + c.len && same_split {
                    c.len += row;
                    continue;
                }
                out.push(*c);
            }
            cur = Some(Chunk {
                layer: l as u32,
                host_off: ho,
                device_off: dof,
                len: row,
            });
        }
        out.extend(cur);
    }
    out
}

/// Direction of a copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Host buffer → device layer tensors (load).
    HostToDevice,
    /// Device layer tensors → host buffer (backup).
    DeviceToHost,
}

/// A raw byte range that the caller keeps alive and unaliased for the duration of a copy.
#[derive(Clone, Copy, Debug)]
pub struct RawRange {
    /// Base address.
    pub ptr: usize,
    /// Length in bytes.
    pub len: usize,
}

/// Checks that every chunk lies inside `host` and its layer's `device` range.
pub fn check_chunks(host: RawRange, device: &[RawRange], chunks: &[Chunk]) -> Result<()> {
    for (i, c) in chunks.iter().enumerate() {
        let dev = device.get(c.layer as usize).ok_or_else(|| {
            Error::arg(
                "layer_id",
                format!("chunk {i} names layer {} of {}", c.layer, device.len()),
            )
        })?;
        let host_end = c.host_off.checked_add(c.len);
        let dev_end = c.device_off.checked_add(c.len);
        if host_end.is_none_or(|e| e > host.len as u64)
            || dev_end.is_none_or(|e| e > dev.len as u64)
        {
            return Err(Error::arg(
                "indices",
                format!(
                    "chunk {i} {c:?} falls outside its buffers (host {} B, device {} B)",
                    host.len, dev.len
                ),
            ));
        }
    }
    Ok(())
}

/// `(source, destination, len)` addresses of every chunk for `dir`.
pub fn addresses(
    dir: Direction,
    host: RawRange,
    device: &[RawRange],
    chunks: &[Chunk],
) -> Vec<(usize, usize, usize)> {
    chunks
        .iter()
        .map(|c| {
            let h = host.ptr + c.host_off as usize;
            let d = device[c.layer as usize].ptr + c.device_off as usize;
            match dir {
                Direction::HostToDevice => (h, d, c.len as usize),
                Direction::DeviceToHost => (d, h, c.len as usize),
            }
        })
        .collect()
}

/// Executes `chunks` with CPU `memcpy`, after checking every chunk against the ranges.
///
/// # Safety
/// `host` and every entry of `device` must be live, writable (on the destination side) allocations of at
/// least their stated length for the whole call, and the host range must not overlap any device range.
pub unsafe fn copy_cpu(
    dir: Direction,
    host: RawRange,
    device: &[RawRange],
    chunks: &[Chunk],
) -> Result<()> {
    check_chunks(host, device, chunks)?;
    for (src, dst, len) in addresses(dir, host, device, chunks) {
        // both ranges were checked above to lie inside live allocations (caller contract), and the
        // host and device allocations do not overlap, so source and destination are disjoint.
        // SAFETY: both ranges are checked in bounds and are disjoint.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
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
}
