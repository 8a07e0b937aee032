"""Host KV pools: HiCache's shapes, allocation, page metadata, K/V-split transfers and argument validation.

The transfer tests run on CPU device pools here (the Rust copy engine); the same checks run on CUDA device
pools in test_pools_cuda.py.
"""

import threading

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvtier
from kvtier import AsymmetricMHAHostPool, DeviceKVPool, MHAHostPool, host_pool_for
from kvtier.transfer import TransferEngine
from pool_combos import COMBOS

# The fixture geometry of SGLang's asymmetric unit tests: page 2, 3 layers, 2 heads, K 4, V 6, fp16.
PS, L, H, DK, DV = 2, 3, 2, 4, 6


def filled_device_pool(size=8, ps=PS, layers=L, heads=H, dk=DK, dv=DV, dtype=torch.float16, device="cpu", seed=0):
    dp = DeviceKVPool(size, ps, layers, heads, dk, dv, dtype, device)
    g = torch.Generator().manual_seed(seed)
    for layer in range(layers):
        for t in (dp.k_buffer[layer], dp.v_buffer[layer]):
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=g, dtype=torch.uint8))
    return dp


def beq(a, b):
    """Bitwise equality (random bytes include NaNs, which torch.equal treats as unequal)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def pages(idx_pages, ps):
    return torch.tensor([p * ps + i for p in idx_pages for i in range(ps)], dtype=torch.int64)


def host_rows(pool, side, layer, host_idx):
    """The host rows of ``host_idx`` in ``layer`` read back through the pool's public tensor."""
    t = pool.k_buffer if side == "k" else pool.v_buffer
    if pool.layout == "layer_first":
        return t[layer][host_idx]
    if pool.layout == "page_first":
        return t[host_idx, layer]
    return t[host_idx // pool.page_size, layer, host_idx % pool.page_size]


# ------------------------------------------------------------------------------------------- factory, shapes


def test_factory_selects_pool_by_kv_dims():
    assert type(host_pool_for(filled_device_pool(dv=DK))) is MHAHostPool
    assert type(host_pool_for(filled_device_pool())) is AsymmetricMHAHostPool


@pytest.mark.parametrize(
    "layout, k_shape, v_shape",
    [
        ("page_first", (18, L, H, DK), (18, L, H, DV)),
        ("page_first_direct", (9, L, PS, H, DK), (9, L, PS, H, DV)),
    ],
)
def test_asymmetric_shapes(layout, k_shape, v_shape):
    # device size 8, ratio 2 -> 16 tokens -> 16 // 2 + 1 = 9 pages (HiCache always adds one page)
    hp = host_pool_for(filled_device_pool(), layout=layout)
    assert (hp.page_num, hp.size) == (9, 18)
    assert tuple(hp.k_buffer.shape) == k_shape and tuple(hp.v_buffer.shape) == v_shape
    assert hp.k_buffer.dtype == hp.v_buffer.dtype == torch.float16
    assert hp.k_buffer.data_ptr() != hp.v_buffer.data_ptr()
    assert hp.kv_buffer[0] is hp.k_buffer and hp.kv_buffer[1] is hp.v_buffer
    assert (hp.layer_num, hp.head_num, hp.head_dim, hp.v_head_dim, hp.page_size) == (L, H, DK, DV, PS)


@pytest.mark.parametrize(
    "layout, shape",
    [("layer_first", (L, 18, H, DK)), ("page_first", (18, L, H, DK)), ("page_first_direct", (9, L, PS, H, DK))],
)
def test_symmetric_shapes_share_one_buffer(layout, shape):
    hp = host_pool_for(filled_device_pool(dv=DK), layout=layout)
    assert tuple(hp.kv_buffer.shape) == (2, *shape)
    assert tuple(hp.k_buffer.shape) == shape == tuple(hp.v_buffer.shape)
    assert hp.v_buffer.data_ptr() - hp.k_buffer.data_ptr() == hp.k_buffer.numel() * 2


@pytest.mark.parametrize("layout", ["layer_first", "page_head", "page_first_kv_split", "bogus"])
def test_asymmetric_pool_rejects_other_layouts(layout):
    with pytest.raises(ValueError, match=f"head_dim != v_head_dim: '{layout}'; expected 'page_first' or 'page_first_direct'"):
        host_pool_for(filled_device_pool(), layout=layout)


def test_symmetric_pool_rejects_unknown_layout():
    with pytest.raises(ValueError, match="Unsupported layout: 'page_head'"):
        host_pool_for(filled_device_pool(dv=DK), layout="page_head")


def test_sizes_per_token():
    hp = host_pool_for(filled_device_pool())
    assert hp.get_size_per_token() == (DK + DV) * H * L * 2
    assert hp.get_ksize_per_token() == DK * H * L * 2
    hp = host_pool_for(filled_device_pool(), host_size_gb=1e-5)  # 10 kB
    assert hp.size == (10_000 // hp.get_size_per_token() // PS + 1) * PS


def test_host_buffers_are_aligned_and_page_strides_reported():
    # K page = 64 tokens * 1 layer * 1 head * 32 dims * 2 bytes = 4096
    dp = filled_device_pool(size=256, ps=64, layers=1, heads=1, dk=32, dv=16)
    hp = host_pool_for(dp, layout="page_first_direct")
    assert hp.k_buffer.data_ptr() % 4096 == 0 and hp.v_buffer.data_ptr() % 4096 == 0
    assert not hp.is_stride_page_aligned()  # V page is 2048 bytes
    assert hp.is_stride_page_aligned(2048)
    dp = filled_device_pool(size=256, ps=64, layers=2, heads=1, dk=32, dv=16)
    assert host_pool_for(dp, layout="page_first_direct").is_stride_page_aligned()


# ------------------------------------------------------------------------------------------- allocation


def test_alloc_free_semantics():
    hp = host_pool_for(filled_device_pool())
    assert hp.available_size() == 18
    with pytest.raises(ValueError, match="need_size"):
        hp.alloc(3)
    a = hp.alloc(4)
    assert a.dtype == torch.int64 and a.tolist() == [0, 1, 2, 3]
    b = hp.alloc(14)
    assert b.tolist() == list(range(4, 18))
    assert hp.alloc(2) is None
    assert hp.free(a) == 4
    with pytest.raises(ValueError, match="double free"):
        hp.free(a)
    with pytest.raises(ValueError, match="out of range"):
        hp.free(torch.tensor([18, 19]))
    with pytest.raises(ValueError, match="consecutive"):
        hp.free(torch.tensor([4, 6]))
    with pytest.raises(ValueError, match="dtype"):
        hp.free(torch.tensor([4, 5], dtype=torch.int32))
    assert hp.available_size() == 4
    hp.clear()
    assert hp.available_size() == 18


def test_alloc_is_thread_safe():
    hp = host_pool_for(filled_device_pool(size=4000, ps=4), host_to_device_ratio=1.0)
    got = []

    def worker():
        for _ in range(100):
            got.append(hp.alloc(8))

    ths = [threading.Thread(target=worker) for _ in range(4)]
    [t.start() for t in ths]
    [t.join() for t in ths]
    flat = torch.cat([g for g in got if g is not None])
    assert flat.unique().numel() == flat.numel()


def test_use_after_close():
    hp = host_pool_for(filled_device_pool())
    hp.close()
    hp.close()
    with pytest.raises(kvtier.ClosedError):
        hp.alloc(2)
    with pytest.raises(kvtier.ClosedError):
        hp.load_to_device_per_layer(filled_device_pool(), torch.arange(2), torch.arange(2), 0, "kernel")


# ------------------------------------------------------------------------------------------- page metadata


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_page_buffer_meta_asymmetric(layout):
    hp = host_pool_for(filled_device_pool(), layout=layout)
    idx = pages([3, 1], PS)
    ptrs, sizes = hp.get_page_buffer_meta(idx)
    kp, vp = DK * H * L * PS * 2, DV * H * L * PS * 2
    assert sizes == [kp, vp, kp, vp]
    k0, v0 = hp.k_buffer.data_ptr(), hp.v_buffer.data_ptr()
    assert ptrs == [k0 + 3 * kp, v0 + 3 * vp, k0 + 1 * kp, v0 + 1 * vp]
    # The bytes at those addresses are exactly the page's rows (all layers).
    for page, ptr_k, ptr_v in ((3, ptrs[0], ptrs[1]), (1, ptrs[2], ptrs[3])):
        first = (page * PS, 0) if layout == "page_first" else (page, 0, 0)  # first token, layer 0 (a view)
        assert ptr_k == hp.k_buffer[first].data_ptr() and ptr_v == hp.v_buffer[first].data_ptr()
    with pytest.raises(ValueError, match="multiple of page_size"):
        hp.get_page_buffer_meta(torch.tensor([0]))
    with pytest.raises(ValueError, match="does not start a page"):
        hp.get_page_buffer_meta(torch.tensor([1, 2]))


def test_page_buffer_meta_symmetric_v_follows_k():
    hp = host_pool_for(filled_device_pool(dv=DK), layout="page_first_direct")
    ptrs, sizes = hp.get_page_buffer_meta(pages([2], PS))
    assert ptrs[1] - ptrs[0] == L * hp.size * H * DK * 2
    assert sizes == [L * PS * H * DK * 2] * 2


# ------------------------------------------------------------------------------------------- K/V split


@pytest.mark.parametrize("backend, layout", [("kernel", "page_first"), ("direct", "page_first_direct")])
def test_load_splits_k_and_v_with_separate_strides(monkeypatch, backend, layout):
    calls = []
    real = TransferEngine.copy

    def spy(self, pairs, prepared, begin, end, *, to_host, **kw):
        for side, layers in pairs:  # K and V: separate copies, each with its own geometry
            calls.append((side.row_bytes, side.layers * side.row_bytes, layers, begin, end, to_host))
        return real(self, pairs, prepared, begin, end, to_host=to_host, **kw)

    monkeypatch.setattr(TransferEngine, "copy", spy)
    dp = filled_device_pool()
    hp = host_pool_for(dp, layout=layout)
    h, d = torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5, 6, 7])
    hp.load_to_device_per_layer(dp, h, d, 1, backend)
    # K: item 16 bytes, page-first token stride 48; V: 24 and 72 (the figures of SGLang's unit tests)
    assert [(c[0], c[1], c[3], c[4], c[5]) for c in calls] == [(16, 48, 1, 2, False), (24, 72, 1, 2, False)]
    assert calls[0][2] == dp.k_buffer and calls[1][2] == dp.v_buffer
    calls.clear()
    hp.backup_from_device_all_layer(dp, h, d, backend)
    assert [(c[0], c[1], c[3], c[4], c[5]) for c in calls] == [(16, 48, 0, 3, True), (24, 72, 0, 3, True)]


def test_direct_requires_page_first_direct():
    dp = filled_device_pool()
    hp = host_pool_for(dp, layout="page_first")
    with pytest.raises(ValueError, match="expected 'page_first_direct'"):
        hp.load_to_device_per_layer(dp, torch.arange(2), torch.arange(2, 4), 0, "direct")
    with pytest.raises(ValueError, match="expected 'page_first_direct'"):
        hp.backup_from_device_all_layer(dp, torch.arange(2), torch.arange(2, 4), "direct")


def test_kernel_rejects_page_first_direct_and_unknown_backends():
    dp = filled_device_pool()
    hp = host_pool_for(dp, layout="page_first_direct")
    with pytest.raises(ValueError, match="io_backend='kernel': page_first_direct; expected 'page_first'"):
        hp.load_to_device_per_layer(dp, torch.arange(2), torch.arange(2, 4), 0, "kernel")
    with pytest.raises(ValueError, match="expected 'kernel' or 'direct'"):
        hp.backup_from_device_all_layer(dp, torch.arange(2), torch.arange(2, 4), "kernel_ascend")


# ------------------------------------------------------------------------------------------- round trips



@pytest.mark.parametrize("kind, layout, backend", COMBOS)
def test_full_round_trip_distinct_values_per_layer(kind, layout, backend):
    """SGLang's round trip: distinct values per layer and side, back up, zero the device, load every layer."""
    dv = DV if kind == "asym" else DK
    dp = DeviceKVPool(16, PS, L, H, DK, dv, torch.float32, "cpu")
    for layer in range(L):
        dp.k_buffer[layer].copy_(torch.arange(dp.k_buffer[layer].numel()).view_as(dp.k_buffer[layer]) + layer * 1000)
        dp.v_buffer[layer].copy_(torch.arange(dp.v_buffer[layer].numel()).view_as(dp.v_buffer[layer]) + layer * 10000 + 0.5)
    orig = [t.clone() for t in dp.k_buffer + dp.v_buffer]
    hp = host_pool_for(dp, layout=layout)
    h = pages([1, 2, 3], PS)
    d = pages([1, 2, 3], PS) + 2 * PS  # device pages 3..5 -> host pages 1..3
    hp.backup_from_device_all_layer(dp, h, d, backend)
    for layer in range(L):
        assert torch.equal(host_rows(hp, "k", layer, h), orig[layer][d])
        assert torch.equal(host_rows(hp, "v", layer, h), orig[L + layer][d])
    for t in dp.k_buffer + dp.v_buffer:
        t.zero_()
    d2 = pages([5, 6, 7], PS)  # load into other device pages
    for layer in range(L):
        hp.load_to_device_per_layer(dp, h, d2, layer, backend)
    for layer in range(L):
        assert torch.equal(dp.k_buffer[layer][d2], orig[layer][d])
        assert torch.equal(dp.v_buffer[layer][d2], orig[L + layer][d])
        untouched = torch.ones(dp.k_buffer[layer].shape[0], dtype=torch.bool)
        untouched[d2] = False
        assert not dp.k_buffer[layer][untouched].any() and not dp.v_buffer[layer][untouched].any()


def test_page_first_direct_bytes_are_layer_token_head_dim():
    """One page of a page_first_direct host buffer holds [layer][token][head][dim] of the source, the same
    bytes an SGLang pool of the same geometry holds."""
    dp = filled_device_pool(size=16, ps=4, layers=3, heads=2, dk=8, dv=6, dtype=torch.bfloat16)
    hp = host_pool_for(dp, layout="page_first_direct")
    d = torch.arange(8, 12)
    hp.backup_from_device_all_layer(dp, pages([2], 4), d, "direct")
    ptrs, sizes = hp.get_page_buffer_meta(pages([2], 4))
    for side, ptr, size, src in (("k", ptrs[0], sizes[0], dp.k_buffer), ("v", ptrs[1], sizes[1], dp.v_buffer)):
        expected = torch.stack([src[layer][d] for layer in range(3)]).contiguous().view(torch.uint8).reshape(-1)
        buf = hp.k_buffer if side == "k" else hp.v_buffer
        off = ptr - buf.data_ptr()
        raw = buf.view(torch.uint8).reshape(-1)[off : off + size]
        assert torch.equal(raw, expected)


# ------------------------------------------------------------------------------------------- property test

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8]


@st.composite
def geometries(draw):
    kind, layout, backend = draw(st.sampled_from(COMBOS))
    ps = draw(st.sampled_from([1, 2, 3, 4, 8, 16, 64]))
    heads = draw(st.integers(1, 8))
    dk = draw(st.integers(8, 256))
    dv = draw(st.integers(8, 256).filter(lambda x: x != dk)) if kind == "asym" else dk
    layers = draw(st.integers(1, 6))
    dtype = draw(st.sampled_from(DTYPES))
    dev_pages = draw(st.integers(2, 6))
    n = draw(st.integers(1, dev_pages))
    host_perm = draw(st.permutations(range(2 * dev_pages + 1)))[:n]
    dev_perm = draw(st.permutations(range(1, dev_pages + 1)))[:n]
    seed = draw(st.integers(0, 2**16))
    return kind, layout, backend, ps, heads, dk, dv, layers, dtype, dev_pages, host_perm, dev_perm, seed


@given(geometries())
def test_round_trip_property_untouched_bytes_unchanged(g):
    kind, layout, backend, ps, heads, dk, dv, layers, dtype, dev_pages, hperm, dperm, seed = g
    dp = filled_device_pool(dev_pages * ps, ps, layers, heads, dk, dv, dtype, seed=seed)
    hp = host_pool_for(dp, layout=layout)
    # poison the host so untouched bytes are recognisable
    hp.k_buffer.view(torch.uint8).fill_(0xA5)
    hp.v_buffer.view(torch.uint8).fill_(0x5A)
    h, d = pages(hperm, ps), pages(dperm, ps)
    host_before_k, host_before_v = hp.k_buffer.clone(), hp.v_buffer.clone()
    dev_before = [t.clone() for t in dp.k_buffer + dp.v_buffer]
    hp.backup_from_device_all_layer(dp, h, d, backend)
    # device unchanged by a backup; host changed exactly at the addressed rows
    assert all(beq(a, b) for a, b in zip(dev_before, dp.k_buffer + dp.v_buffer))
    for layer in range(layers):
        assert torch.equal(host_rows(hp, "k", layer, h).view(torch.uint8), dp.k_buffer[layer][d].view(torch.uint8))
        assert torch.equal(host_rows(hp, "v", layer, h).view(torch.uint8), dp.v_buffer[layer][d].view(torch.uint8))
    touched = torch.zeros(hp.size, dtype=torch.bool)
    touched[h] = True
    for after, before in ((hp.k_buffer, host_before_k), (hp.v_buffer, host_before_v)):
        for layer in range(layers):
            rows_after = host_rows(hp, "k" if after is hp.k_buffer else "v", layer, torch.arange(hp.size))
            rows_before = (
                before[layer] if layout == "layer_first" else before[:, layer] if layout == "page_first"
                else before[:, layer].reshape(hp.size, *before.shape[3:])
            )
            assert torch.equal(rows_after[~touched].view(torch.uint8), rows_before[~touched].view(torch.uint8))
    # load into a poisoned device pool at shuffled device pages
    for t in dp.k_buffer + dp.v_buffer:
        t.view(torch.uint8).fill_(0x3C)
    d2 = pages(list(reversed(dperm)), ps)
    for layer in range(layers):
        hp.load_to_device_per_layer(dp, h, d2, layer, backend)
    dev_touched = torch.zeros(dp.k_buffer[0].shape[0], dtype=torch.bool)
    dev_touched[d2] = True
    for layer in range(layers):
        for t, before in ((dp.k_buffer[layer], dev_before[layer]), (dp.v_buffer[layer], dev_before[layers + layer])):
            assert torch.equal(t[d2].view(torch.uint8), before[d].view(torch.uint8))
            assert bool((t[~dev_touched].view(torch.uint8) == 0x3C).all())


# ------------------------------------------------------------------------------------------- bad inputs


def _snapshot(hp, dp):
    return [hp.k_buffer.clone(), hp.v_buffer.clone()] + [t.clone() for t in dp.k_buffer + dp.v_buffer]


def _unchanged(snap, hp, dp):
    return all(beq(a, b) for a, b in zip(snap, [hp.k_buffer, hp.v_buffer] + dp.k_buffer + dp.v_buffer))


BAD_CALLS = [
    # (description, host, device, layer, backend, expected message)
    ("length mismatch", [0, 1, 2, 3], [4, 5], 0, "direct", "same length"),
    ("host out of range", [18, 19], [4, 5], 0, "direct", r"host_indices\[0\] = 18 is out of range"),
    ("device out of range", [0, 1], [10, 11], 0, "direct", r"device_indices\[0\] = 10 is out of range"),
    ("negative device index", [0, 1], [-2, -1], 0, "direct", r"device_indices\[0\] = -2"),
    ("partial page", [0], [4], 0, "direct", "multiple of page_size"),
    ("host page not aligned", [1, 2], [4, 5], 0, "direct", "does not start a page"),
    ("host page not consecutive", [0, 3], [4, 5], 0, "direct", "consecutive"),
    ("device page not consecutive", [0, 1], [4, 6], 0, "direct", "device slots must be consecutive"),
    ("duplicate destination", [0, 1, 2, 3], [4, 5, 4, 5], 0, "direct", "appears twice"),
    ("layer too large", [0, 1], [4, 5], 3, "direct", "layer_id"),
    ("negative layer", [0, 1], [4, 5], -1, "direct", "layer_id"),
    ("unknown backend", [0, 1], [4, 5], 0, "dma", "expected 'kernel' or 'direct'"),
]


@pytest.mark.parametrize("desc, host, device, layer, backend, msg", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_load_raises_and_touches_nothing(desc, host, device, layer, backend, msg):
    dp = filled_device_pool()
    hp = host_pool_for(dp, layout="page_first_direct")
    hp.backup_from_device_all_layer(dp, torch.arange(8), torch.arange(2, 10), "direct")
    snap = _snapshot(hp, dp)
    with pytest.raises(ValueError, match=msg):
        hp.load_to_device_per_layer(dp, torch.tensor(host), torch.tensor(device), layer, backend)
    assert _unchanged(snap, hp, dp)


@pytest.mark.parametrize(
    "host, device, msg",
    [
        ([0, 1, 0, 1], [4, 5, 6, 7], r"host_indices\[2\] = 0 appears twice"),
        ([0, 1], [10, 11], "out of range"),
    ],
)
def test_bad_backup_raises_and_touches_nothing(host, device, msg):
    dp = filled_device_pool()
    hp = host_pool_for(dp, layout="page_first")
    snap = _snapshot(hp, dp)
    with pytest.raises(ValueError, match=msg):
        hp.backup_from_device_all_layer(dp, torch.tensor(host), torch.tensor(device), "kernel")
    assert _unchanged(snap, hp, dp)


@pytest.mark.parametrize(
    "mutate, msg",
    [
        (lambda dp: setattr(dp, "layer_num", 2), "layer_num"),
        (lambda dp: setattr(dp, "head_dim", 8), "head_dim"),
        (lambda dp: setattr(dp, "v_head_dim", 4), "v_head_dim"),
        (lambda dp: setattr(dp, "dtype", torch.float32) or setattr(dp, "store_dtype", torch.float32), "dtype"),
        (lambda dp: dp.k_buffer.pop(), "expected 3 layer tensors per side, got 2 and 3"),
        (lambda dp: dp.v_buffer.__setitem__(1, torch.zeros(10, H, DK, dtype=torch.float16)), r"v_buffer\[1\]"),
        (lambda dp: dp.k_buffer.__setitem__(0, dp.k_buffer[0].transpose(1, 2).contiguous().transpose(1, 2)), "contiguous"),
        (lambda dp: delattr(dp, "k_buffer"), "k_buffer"),
    ],
)
def test_device_pool_geometry_must_match(mutate, msg):
    dp = filled_device_pool()
    hp = host_pool_for(dp, layout="page_first")
    snap = _snapshot(hp, dp)
    other = filled_device_pool()
    mutate(other)
    with pytest.raises(ValueError, match=msg):
        hp.load_to_device_per_layer(other, torch.tensor([0, 1]), torch.tensor([4, 5]), 0, "kernel")
    assert _unchanged(snap, hp, dp)


@pytest.mark.parametrize(
    "host, msg",
    [
        (torch.tensor([0, 1], dtype=torch.int32), "dtype must be torch.int64"),
        (torch.tensor([[0, 1]]), "1-D"),
        ([0, 1], "torch.Tensor"),
        (np.array([0, 1]), "torch.Tensor"),
    ],
)
def test_index_type_checks(host, msg):
    dp = filled_device_pool()
    hp = host_pool_for(dp, layout="page_first")
    with pytest.raises(ValueError, match=msg):
        hp.load_to_device_per_layer(dp, host, torch.tensor([4, 5]), 0, "kernel")


def test_bad_constructor_arguments():
    dp = filled_device_pool()
    for kwargs, name in (
        ({"host_to_device_ratio": 0}, "host_to_device_ratio"),
        ({"host_size_gb": -1}, "host_size_gb"),
        ({"host_size_gb": 1e6}, "not enough host memory"),
    ):
        with pytest.raises(ValueError, match=name):
            host_pool_for(dp, **kwargs)
    with pytest.raises(ValueError, match="device_pool"):
        host_pool_for(object())
    with pytest.raises(ValueError, match="head_num"):
        DeviceKVPool(8, 2, 1, 0, 4, device="cpu")


@pytest.mark.parametrize("op", ["load", "backup"])
def test_device_tensor_overlapping_the_other_sides_host_buffer_is_refused(op):
    """A CPU device layer made of the host pool's own memory is refused also when it aliases the other
    side's host buffer (an asymmetric pool keeps K and V in two buffers; only the side's own was checked,
    and a load wrote K bytes into host V memory). Found by an adversarial review."""
    ps = 4
    dp = kvtier.DeviceKVPool(16 * ps, ps, 3, 2, 8, 4, torch.bfloat16, "cpu")  # K dim 8, V dim 4
    hp = kvtier.host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=2.0)
    assert isinstance(hp, AsymmetricMHAHostPool)
    h = hp.alloc(ps)
    hp.k_buffer[h[0] // ps] = 3
    hp.v_buffer[h[0] // ps] = 7
    k_before, v_before = hp.k_buffer.clone(), hp.v_buffer.clone()
    rows = dp.k_buffer[0].shape[0]
    dp.k_buffer[0] = hp.v_buffer.reshape(-1)[: rows * 2 * 8].view(rows, 2, 8)
    with pytest.raises(kvtier.InvalidArgumentError, match="overlaps the host buffer"):
        if op == "load":
            hp.load_to_device_per_layer(dp, h, torch.arange(0, ps), 0, "direct")
        else:
            hp.backup_from_device_all_layer(dp, h, torch.arange(0, ps), "direct")
    assert torch.equal(hp.v_buffer, v_before) and torch.equal(hp.k_buffer, k_before)


@pytest.mark.parametrize("make", [lambda: torch.arange(4, device="meta"), lambda: torch.arange(4).to_sparse(),
                                  lambda: torch.nested.nested_tensor([torch.arange(4)])],
                         ids=["meta", "sparse", "nested"])
def test_unusable_index_tensors_name_the_argument(make):
    """int64 index tensors no copy can use get InvalidArgumentError naming the argument (torch's own errors
    before), and leave the pools untouched; a lazily negated view is read as its values."""
    ps = 4
    dp = kvtier.DeviceKVPool(16 * ps, ps, 3, 2, 8, 4, torch.bfloat16, "cpu")
    hp = kvtier.host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=2.0)
    before = [t.clone() for t in dp.k_buffer + dp.v_buffer]
    with pytest.raises(kvtier.InvalidArgumentError, match="host_indices.*dense"):
        hp.load_to_device_per_layer(dp, make(), torch.arange(ps, 2 * ps), 0, "direct")
    with pytest.raises(kvtier.InvalidArgumentError, match="device_indices.*dense"):
        hp.backup_from_device_all_layer(dp, hp.alloc(ps), make(), "direct")
    assert all(torch.equal(a, b) for a, b in zip(dp.k_buffer + dp.v_buffer, before))


def test_a_negated_view_of_indices_is_read_as_its_values():
    ps = 4
    dp = kvtier.DeviceKVPool(16 * ps, ps, 3, 2, 8, 4, torch.bfloat16, "cpu")
    hp = kvtier.host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=2.0)
    h = hp.alloc(ps)
    d = (-torch.arange(ps, 2 * ps))._neg_view()  # values ps..2ps-1, stored negated
    assert d.is_neg() and d.tolist() == list(range(ps, 2 * ps))
    for t in dp.k_buffer + dp.v_buffer:
        t.copy_(torch.randn(t.shape).to(t.dtype))
    hp.backup_from_device_all_layer(dp, h, d, "direct")
    want = [t[ps:2 * ps].clone() for t in dp.k_buffer + dp.v_buffer]
    for t in dp.k_buffer + dp.v_buffer:
        t.zero_()
    for layer in range(3):
        hp.load_to_device_per_layer(dp, h, d, layer, "direct")
    assert all(torch.equal(t[ps:2 * ps], w) for t, w in zip(dp.k_buffer + dp.v_buffer, want))
    with pytest.raises(kvtier.InvalidArgumentError, match="device_indices"):
        hp.load_to_device_per_layer(dp, h, torch.arange(ps)._neg_view(), 0, "direct")  # values -0..-3
