"""Fast CUDA transfer paths (skipped without a GPU): batched DMA and the Triton kernel, stream/event
discipline (a backup sees what a producer stream wrote; freed index tensors do not corrupt a copy in
flight), and per-layer overlap with LayerLoader."""

import pytest
import torch

import kvtier
from kvtier import DeviceKVPool, LayerLoader, backup_async, host_pool_for

pytestmark = pytest.mark.cuda

PS, L, H, DK, DV = 64, 4, 2, 192, 128


def make(kind="asym", layout="page_first_direct", pages=16, dtype=torch.bfloat16):
    dv = DV if kind == "asym" else DK
    dp = DeviceKVPool(pages * PS, PS, L, H, DK, dv, dtype, "cuda")
    for t in dp.k_buffer + dp.v_buffer:
        t.view(torch.uint8).random_(0, 256)
    return dp, host_pool_for(dp, layout=layout)


def u8(t):
    return t.contiguous().view(torch.uint8)


def test_direct_uses_batched_dma_and_legacy_stream_fallback():
    dp, hp = make()
    h, d = hp.alloc(8 * PS), torch.arange(PS, 9 * PS)
    assert hp.k_buffer.is_pinned()
    side = torch.cuda.Stream()
    ref = [t.clone() for t in dp.k_buffer]
    with torch.cuda.stream(side):
        hp.backup_from_device_all_layer(dp, h, d, "direct")
    side.synchronize()
    for t in dp.k_buffer:
        t.zero_()
    for layer in range(L):  # legacy default stream: per-chunk cuMemcpyAsync
        hp.load_to_device_per_layer(dp, h, d, layer, "direct")
    torch.cuda.synchronize()
    assert all(torch.equal(u8(a[d]), u8(b[d])) for a, b in zip(dp.k_buffer, ref))
    print("batched copies supported:", kvtier._native.cuda_batch_supported())


@pytest.mark.parametrize("backend, layout", [("direct", "page_first_direct"), ("kernel", "page_first")])
def test_backup_is_ordered_after_the_producer(backend, layout):
    dp, hp = make(layout=layout, pages=32)
    h, d = hp.alloc(32 * PS), torch.arange(PS, 33 * PS)
    producer = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device="cuda")
    for it in range(20):
        with torch.cuda.stream(producer):
            for _ in range(3):
                a = (a @ a).clamp_(-1, 1)  # keep the producer busy so a race would show
            for t in dp.k_buffer + dp.v_buffer:
                t.view(torch.uint8).fill_(it + 1)
            ev = producer.record_event()
        done = backup_async(hp, dp, h, d, backend, after=ev)
        done.synchronize()
        for layer in (0, L - 1):
            rows = hp.k_buffer[h // PS, layer, h % PS] if layout == "page_first_direct" else hp.k_buffer[h, layer]
            assert bool((u8(rows) == it + 1).all()), f"iteration {it}: backup read stale KV"


@pytest.mark.parametrize("backend, layout", [("direct", "page_first_direct"), ("kernel", "page_first")])
def test_freed_index_tensors_do_not_corrupt_an_inflight_load(backend, layout):
    dp, hp = make(layout=layout, pages=64)
    h = hp.alloc(64 * PS)
    d = torch.arange(PS, 65 * PS)
    hp.backup_from_device_all_layer(dp, h, d, backend)
    torch.cuda.synchronize()
    ref = [t.clone() for t in dp.k_buffer + dp.v_buffer]
    for t in dp.k_buffer + dp.v_buffer:
        t.zero_()
    side = torch.cuda.Stream()
    dflip = d.view(-1, PS).flip(0).reshape(-1)  # pages in reverse order, tokens in order
    with torch.cuda.stream(side):
        hd, dd = h.cuda(), dflip.cuda()
        for layer in range(L):
            hp.load_to_device_per_layer(dp, hd, dd, layer, backend)
    del hd, dd
    junk = [torch.full((1 << 20,), 7, dtype=torch.int64, device="cuda") for _ in range(8)]  # reuse freed memory
    side.synchronize()
    del junk
    for layer in range(L):
        assert torch.equal(u8(dp.k_buffer[layer][dflip]), u8(ref[layer][d]))
        assert torch.equal(u8(dp.v_buffer[layer][dflip]), u8(ref[L + layer][d]))


@pytest.mark.parametrize("backend, layout", [("direct", "page_first_direct"), ("kernel", "page_first")])
def test_layer_loader_overlaps_and_is_exact(backend, layout):
    dp, hp = make(layout=layout, pages=32)
    h, d = hp.alloc(32 * PS), torch.arange(PS, 33 * PS)
    hp.backup_from_device_all_layer(dp, h, d, backend)
    torch.cuda.synchronize()
    ref = [t.clone() for t in dp.k_buffer + dp.v_buffer]
    loader = LayerLoader(hp, dp, backend)
    for _ in range(5):  # more loads than event sets: the sets rotate
        for t in dp.k_buffer + dp.v_buffer:
            t.zero_()
        load = loader.load(h, d)
        sums = []
        for layer in range(L):
            load.wait(layer)  # compute stream waits for this layer only
            sums.append(dp.k_buffer[layer][d].float().sum() + dp.v_buffer[layer][d].float().sum())
        torch.cuda.synchronize()
        assert load.done()
        for layer in range(L):
            assert torch.equal(u8(dp.k_buffer[layer][d]), u8(ref[layer][d]))
            assert torch.equal(u8(dp.v_buffer[layer][d]), u8(ref[L + layer][d]))
