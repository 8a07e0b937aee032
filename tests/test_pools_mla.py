"""MLA pools (DeepSeek-style latent KV): HiCache's host shapes, one object per page, transfers on both
backends (CPU device pools here; CUDA device pools where a GPU exists), validation, the page store and the
tier controller."""

import pytest
import torch

import kvtier
from kvtier import InvalidArgumentError, MLADeviceKVPool, MLAHostPool, PageStore, TierController, host_pool_for

from mla_pools import L, LORA, PS, ROPE, filled, rows

D = LORA + ROPE
LAYOUT_BACKENDS = [("layer_first", "direct"), ("layer_first", "kernel"), ("page_first", "kernel"),
                   ("page_first_direct", "direct")]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def u8(t):
    return t.contiguous().view(torch.uint8).cpu()


def host_rows(hp, layer, h):
    t = hp.kv_buffer
    if hp.layout == "layer_first":
        return t[layer][h]
    if hp.layout == "page_first":
        return t[h, layer]
    return t[h // hp.page_size, layer, h % hp.page_size]


def test_factory_and_shapes():
    dp = filled()
    for layout, shape in (("layer_first", (L, 68, 1, D)), ("page_first", (68, L, 1, D)),
                          ("page_first_direct", (17, L, PS, 1, D))):
        hp = host_pool_for(dp, layout=layout)
        assert type(hp) is MLAHostPool
        assert tuple(hp.kv_buffer.shape) == shape and hp.kv_buffer.dtype == torch.bfloat16
        assert (hp.kv_lora_rank, hp.qk_rope_head_dim, hp.kv_cache_dim) == (LORA, ROPE, D)
        assert hp.get_size_per_token() == D * 2 * L  # HiCache's MLA size per token: kv_dim·it·L
        hp.close()
    assert tuple(dp.kv_buffer[0].shape) == (8 * PS + PS, 1, D) and len(dp.kv_buffer) == L
    assert "kv_lora_rank=24" in repr(host_pool_for(dp))


def test_page_buffer_meta_is_one_object_per_page():
    dp = filled()
    hp = host_pool_for(dp, layout="page_first_direct")
    ptrs, sizes = hp.get_page_buffer_meta(rows([2, 5]))
    page = L * PS * D * 2
    assert sizes == [page, page] and ptrs == [hp.kv_buffer.data_ptr() + 2 * page, hp.kv_buffer.data_ptr() + 5 * page]
    lf = host_pool_for(dp, layout="layer_first")
    ptrs, sizes = lf.get_page_buffer_meta(rows([1]))
    assert len(ptrs) == L and sizes == [PS * D * 2] * L
    assert ptrs[1] - ptrs[0] == lf.size * D * 2  # the next layer of the same page


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout, backend", LAYOUT_BACKENDS)
def test_round_trip_bit_exact(device, layout, backend):
    dp = filled(device=device)
    orig = [t.clone() for t in dp.kv_buffer]
    hp = host_pool_for(dp, layout=layout)
    hp.kv_buffer.view(torch.uint8).fill_(0xA5)
    h, d = rows([7, 2, 11]), rows([3, 1, 6], device=device)
    hp.backup_from_device_all_layer(dp, h, d, backend)
    hp.synchronize()
    for layer in range(L):
        assert torch.equal(u8(host_rows(hp, layer, h)), u8(orig[layer][d]))
    untouched = torch.ones(hp.size, dtype=torch.bool)
    untouched[h] = False
    assert bool((u8(host_rows(hp, 0, torch.arange(hp.size)[untouched])) == 0xA5).all())
    for t in dp.kv_buffer:
        t.view(torch.uint8).fill_(0x3C)
    d2 = rows([5, 8, 2], device=device)
    for layer in range(L):
        hp.load_to_device_per_layer(dp, h, d2, layer, backend)
    hp.synchronize()
    mask = torch.ones(dp.kv_buffer[0].shape[0], dtype=torch.bool)
    mask[d2.cpu()] = False
    for layer in range(L):
        assert torch.equal(u8(dp.kv_buffer[layer][d2]), u8(orig[layer][d]))
        assert bool((u8(dp.kv_buffer[layer][mask.to(device)]) == 0x3C).all())
    hp.close()


@pytest.mark.cuda
@pytest.mark.parametrize("layout, backend", LAYOUT_BACKENDS)
def test_layer_loader_and_default_stream_on_cuda(layout, backend):
    dp = filled(device="cuda", size=64 * PS)
    orig = [t.clone() for t in dp.kv_buffer]
    hp = host_pool_for(dp, layout=layout, host_to_device_ratio=1.0)
    assert hp.kv_buffer.is_pinned()
    h, d = rows(range(40, 0, -1)), rows(range(1, 41), device="cuda")
    hp.backup_from_device_all_layer(dp, h, d, backend)  # from the default stream
    for t in dp.kv_buffer:
        t.zero_()
    load = kvtier.LayerLoader(hp, dp, backend).load(h, d)
    for layer in range(L):
        load.wait(layer)
        assert torch.equal(u8(dp.kv_buffer[layer][d]), u8(orig[layer][d]))
    hp.close()


def test_validation_names_the_argument():
    dp = filled()
    hp = host_pool_for(dp, layout="page_first_direct")
    other = MLADeviceKVPool(8 * PS, PS, L, LORA + 8, ROPE, torch.bfloat16, "cpu")
    with pytest.raises(InvalidArgumentError, match="kv_lora_rank is 32, the host pool has 24"):
        hp.load_to_device_per_layer(other, rows([1]), rows([1]), 0, "direct")
    mha = kvtier.DeviceKVPool(8 * PS, PS, L, 1, D, D, torch.bfloat16, "cpu")
    with pytest.raises(InvalidArgumentError, match="MLA is False, the host pool has True"):
        hp.backup_from_device_all_layer(mha, rows([1]), rows([1]), "direct")
    with pytest.raises(InvalidArgumentError, match="not an MLA pool"):
        MLAHostPool(mha)
    with pytest.raises(InvalidArgumentError, match="Unsupported layout for MLA models and io_backend='kernel'"):
        hp.backup_from_device_all_layer(dp, rows([1]), rows([1]), "kernel")
    with pytest.raises(InvalidArgumentError, match="`kv_lora_rank`"):
        MLADeviceKVPool(8, PS, L, 0, ROPE, torch.bfloat16, "cpu")
    with pytest.raises(InvalidArgumentError, match="host_indices"):
        hp.backup_from_device_all_layer(dp, rows([hp.page_num]), rows([1]), "direct")  # past the pool
    bad = filled()
    bad.kv_buffer[1] = torch.zeros(bad.kv_buffer[0].shape[0], 1, D + 1, dtype=torch.bfloat16)
    with pytest.raises(InvalidArgumentError, match=r"kv_buffer\[1\] must be a contiguous"):
        hp.load_to_device_per_layer(bad, rows([1]), rows([1]), 0, "direct")
    before = hp.kv_buffer.clone()
    assert torch.equal(hp.kv_buffer.view(torch.uint8), before.view(torch.uint8))  # nothing moved


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_page_store_round_trip_one_object_per_page(tmp_path, layout):
    dp = filled()
    hp = host_pool_for(dp, layout=layout)
    hp.backup_from_device_all_layer(dp, rows([1, 2, 3]), rows([4, 5, 6]), "kernel" if layout == "page_first" else "direct")
    want = hp.kv_buffer.clone()
    st = PageStore(tmp_path, capacity_bytes=1 << 24, model_name="deepseek-like")
    st.register_mem_pool_host(hp)
    assert st.page_kinds == 1 and st.page_bytes == L * PS * D * 2
    assert "|mla=24+8" in st.namespace_for(hp)
    keys = [f"{i:064x}" for i in range(3)]
    assert st.batch_set_v1(keys, rows([1, 2, 3])) == [True] * 3
    hp.kv_buffer.zero_()
    assert st.batch_get_v1(keys, rows([1, 2, 3])) == [True] * 3
    assert torch.equal(hp.kv_buffer.view(torch.uint8), want.view(torch.uint8))
    assert st.get_stats()["pages"] == 3
    st.close()


def test_tier_controller_with_mla_pools(tmp_path):
    dp = filled(size=16 * PS, dtype=torch.float32)
    ref = [t.clone() for t in dp.kv_buffer]
    hp = host_pool_for(dp, host_size_gb=5 * PS * D * 4 * L / 1e9, layout="page_first_direct")
    st = PageStore(tmp_path, capacity_bytes=1 << 24)
    st.register_mem_pool_host(hp)
    c = TierController(dp, hp, st, write_policy="write_through")
    keys = kvtier.page_hashes(list(range(3 * PS)), PS)
    c.backup(rows([1, 2, 3]), keys)
    c.wait_idle()
    assert st.batch_exists(keys) == 3
    for t in dp.kv_buffer:
        t.zero_()
    load = c.load(keys, rows([7, 8, 9]))
    for layer in range(L):
        load.wait(layer)
    c.wait_idle()
    for a, b in zip(dp.kv_buffer, ref):
        assert torch.equal(u8(a[rows([7, 8, 9])]), u8(b[rows([1, 2, 3])]))
    c.close()
