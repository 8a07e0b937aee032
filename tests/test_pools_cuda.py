"""Host pools against CUDA device pools (skipped without a GPU): bit-exact round trips for every dtype,
layout and backend, poisoned untouched rows, CUDA-resident index tensors, and the HiCache kernel test's
geometry (K 192 / V 128, page 16, 3 layers)."""

import pytest
import torch

from pool_combos import COMBOS  # every (pool kind, layout, backend) the pools support

from kvtier import DeviceKVPool, host_pool_for

pytestmark = pytest.mark.cuda
DTYPES = [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.uint8]


def pages(ps, ids, device="cpu"):
    return torch.tensor([p * ps + i for p in ids for i in range(ps)], dtype=torch.int64, device=device)


def u8(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind, layout, backend", COMBOS)
@pytest.mark.parametrize("index_device", ["cpu", "cuda"])
def test_cuda_round_trip_bit_exact(dtype, kind, layout, backend, index_device):
    ps, L, H, DK = 16, 3, 4, 192
    DV = 128 if kind == "asym" else DK
    dp = DeviceKVPool(8 * ps, ps, L, H, DK, DV, dtype, "cuda")
    for t in dp.k_buffer + dp.v_buffer:
        u8(t).copy_(torch.randint(0, 256, u8(t).shape, dtype=torch.uint8, device="cuda"))
    orig = [t.clone() for t in dp.k_buffer + dp.v_buffer]
    hp = host_pool_for(dp, layout=layout)
    assert hp.k_buffer.is_pinned()
    u8(hp.k_buffer).fill_(0xA5)
    u8(hp.v_buffer).fill_(0x5A)
    perm = torch.randperm(8)[:5] + 1
    h = pages(ps, (torch.randperm(hp.page_num)[:5]).tolist(), index_device)
    d = pages(ps, perm.tolist(), index_device)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        hp.backup_from_device_all_layer(dp, h, d, backend)
    stream.synchronize()
    hc, dc = h.cpu(), d.cpu()
    for layer in range(L):
        for host, dev in ((hp.k_buffer, orig[layer]), (hp.v_buffer, orig[L + layer])):
            if layout == "layer_first":
                rows = host[layer][hc]
            elif layout == "page_first":
                rows = host[hc, layer]
            else:
                rows = host[hc // ps, layer, hc % ps]
            assert torch.equal(u8(rows), u8(dev[dc]).cpu())
    for t in dp.k_buffer + dp.v_buffer:
        u8(t).fill_(0x3C)
    d2 = pages(ps, list(reversed(perm.tolist())), index_device)
    with torch.cuda.stream(stream):
        for layer in range(L):
            hp.load_to_device_per_layer(dp, h, d2, layer, backend)
    stream.synchronize()
    d2c = d2.cpu()
    mask = torch.ones(dp.k_buffer[0].shape[0], dtype=torch.bool)
    mask[d2c] = False
    for layer in range(L):
        for t, o in ((dp.k_buffer[layer], orig[layer]), (dp.v_buffer[layer], orig[L + layer])):
            assert torch.equal(u8(t[d2c]), u8(o[dc]))
            assert bool((u8(t[mask.cuda()]) == 0x3C).all())


@pytest.mark.parametrize("kind, layout, backend", COMBOS)
def test_unpinned_host_pool_falls_back_to_torch_copies_bit_exact(kind, layout, backend):
    # unregistered host memory must never reach the kernel (it dereferences host pointers) or the batched
    # DMA: an unpinned pool takes torch's copies instead, and is still exact
    ps, L, H, DK = 16, 3, 2, 192
    DV = 128 if kind == "asym" else DK
    dp = DeviceKVPool(8 * ps, ps, L, H, DK, DV, torch.bfloat16, "cuda")
    for t in dp.k_buffer + dp.v_buffer:
        u8(t).copy_(torch.randint(0, 256, u8(t).shape, dtype=torch.uint8, device="cuda"))
    orig = [t.clone() for t in dp.k_buffer + dp.v_buffer]
    hp = host_pool_for(dp, layout=layout, pin_memory=False)
    assert not hp.k_buffer.is_pinned()
    h, d = pages(ps, [3, 1, 4]), pages(ps, [2, 5, 7])
    hp.backup_from_device_all_layer(dp, h, d, backend)
    for t in dp.k_buffer + dp.v_buffer:
        t.zero_()
    for layer in range(L):
        hp.load_to_device_per_layer(dp, h, d, layer, backend)
    torch.cuda.synchronize()
    rows = d.cuda()
    for a, b in zip(dp.k_buffer + dp.v_buffer, orig):
        assert torch.equal(u8(a[rows]), u8(b[rows]))
    hp.close()
