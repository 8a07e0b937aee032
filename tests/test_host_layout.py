"""The host layouts are spelled once, by the core (``HostGeometry::strides``, exposed as
``_native.host_layout`` / ``_native.page_extents``); every Python consumer derives addresses from it. These
tests hold the core's strides against the torch views the pools hand out (whose shapes follow HiCache)."""

import pytest
import torch

import kvtier
from kvtier import _native

PS, L, H, DK, DV = 4, 3, 2, 8, 4


def pools(layout):
    dv = DK if layout == "layer_first" else DV  # asymmetric pools have no layer_first layout
    dp = kvtier.DeviceKVPool(8 * PS, PS, L, H, DK, dv, torch.bfloat16, "cpu")
    return kvtier.host_pool_for(dp, layout=layout, host_to_device_ratio=2.0)


def view_row(hp, side_tensor, layout, layer, slot):
    if layout == "layer_first":
        return side_tensor[layer, slot]
    if layout == "page_first":
        return side_tensor[slot, layer]
    return side_tensor[slot // PS, layer, slot % PS]


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_core_rows_match_the_pool_views(layout):
    hp = pools(layout)
    for side, t in zip(hp.sides(), (hp.k_buffer, hp.v_buffer)):
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
        flat = side.tensor.reshape(-1).view(torch.uint8).view(-1, side.row_bytes)
        slots = torch.randperm(hp.size)[:10]
        for layer in range(L):
            rows = side.rows_of(layer, slots)
            for s, r in zip(slots.tolist(), rows.tolist()):
                assert torch.equal(flat[r], view_row(hp, t, layout, layer, s).reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_page_buffer_meta_covers_exactly_the_pages_rows(layout):
    hp = pools(layout)
    pages = [3, 0, 5]
    idx = torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in pages])
    ptrs, sizes = hp.get_page_buffer_meta(idx)
    per = L if layout == "layer_first" else 1
    assert len(ptrs) == len(sizes) == 2 * per * len(pages)
    for i, (side, t) in enumerate(zip(hp.sides(), (hp.k_buffer, hp.v_buffer))):
        extents = list(zip(ptrs[i::2], sizes[i::2]))
        for n, p in enumerate(pages):
            mine = extents[n * per:(n + 1) * per]
            assert sum(sz for _, sz in mine) == side.page_bytes == PS * L * side.row_bytes
            for layer in range(L):
                for s in range(p * PS, (p + 1) * PS):
                    addr = view_row(hp, t, layout, layer, s).data_ptr()
                    assert any(a <= addr and addr + side.row_bytes <= a + sz for a, sz in mine), (layout, p, layer, s)


def test_bad_layout_arguments_are_refused():
    with pytest.raises(ValueError, match="pages"):
        _native.page_extents("page_first", L, 8 * PS, PS, 16, [8])
    with pytest.raises(ValueError, match="layout"):
        _native.host_layout("page_last", L, 8 * PS, PS, 16)
    with pytest.raises(ValueError, match="size"):
        _native.host_layout("page_first", L, 8 * PS + 1, PS, 16)
