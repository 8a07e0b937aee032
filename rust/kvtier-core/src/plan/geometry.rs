//! Host geometry: HiCache's host layouts and the byte strides, offsets and page extents derived from them.

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
        if !slots.is_multiple_of(page_size) {
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
