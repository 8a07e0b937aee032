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


@pytest.mark.parametrize("lanes", [1, 2])
@pytest.mark.parametrize("backend, layout", [("direct", "page_first_direct"), ("kernel", "page_first")])
def test_layer_loader_overlaps_and_is_exact(backend, layout, lanes):
    """With K and V on one stream, or on two lanes (side stream forked from and joined into the caller's)."""
    dp, hp = make(layout=layout, pages=32)
    hp.engine.lanes = lanes
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


@pytest.mark.parametrize("staging_pages", [1, 3])
def test_staged_kernel_backup_is_exact_and_touches_nothing_else(staging_pages):
    """The kernel backend's staged backup (gather into device staging, copy-engine DMA of runs) with tiny
    staging buffers, so runs alternate between the two buffers many times; arbitrary token slots (not whole
    pages), so runs are not page-aligned; every unaddressed host byte keeps its poison."""
    dp, hp = make(layout="page_first", pages=24)
    eng = hp.engine
    assert eng.staged_backup
    eng.staging_bytes = staging_pages * L * DK * H * 2 * PS  # K: staging_pages pages per buffer
    eng.staged_min_bytes = 0  # staged however small
    n = 19 * PS + 5
    h = torch.randperm(hp.size)[:n]
    d = torch.randperm(24 * PS)[:n]
    for buf in (hp.k_buffer, hp.v_buffer):
        u8(buf).fill_(0xAB)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        hp.backup_from_device_all_layer(dp, h, d, "kernel")
    side.synchronize()
    assert eng.stager.buffers, "the staged path did not run"
    mask = torch.ones(hp.size, dtype=torch.bool)
    mask[h] = False
    for host, dev in ((hp.k_buffer, dp.k_buffer), (hp.v_buffer, dp.v_buffer)):
        for layer in range(L):
            assert torch.equal(u8(host[h, layer]), u8(dev[layer][d].cpu()))
        assert bool((u8(host[mask]) == 0xAB).all()), "bytes outside the addressed slots changed"
    # the same bytes as the kernel writing host memory itself
    staged = [hp.k_buffer.clone(), hp.v_buffer.clone()]
    eng.staged_backup = False
    for buf in (hp.k_buffer, hp.v_buffer):
        u8(buf).fill_(0xAB)
    hp.backup_from_device_all_layer(dp, h, d, "kernel")
    torch.cuda.synchronize()
    assert torch.equal(u8(staged[0]), u8(hp.k_buffer)) and torch.equal(u8(staged[1]), u8(hp.v_buffer))


def test_layer_loader_direct_background_submission_at_scale():
    """48 layers × 256 pages of MiMo-like K/V: tens of thousands of copies, more than the driver queues
    without blocking, so LayerLoader's native submission thread is still enqueueing while the compute
    stream waits layer by layer; every layer must be complete when its wait returns."""
    layers, pages = 48, 256
    dp = DeviceKVPool((pages + 4) * PS, PS, layers, 4, 192, 128, torch.bfloat16, "cuda")
    for t in dp.k_buffer + dp.v_buffer:
        t.view(torch.uint8).random_(0, 256)
    hp = host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=1.0)
    hp_pages = torch.randperm(hp.page_num)[:pages]
    dv_pages = torch.randperm(pages + 3)[:pages] + 1
    h = (hp_pages[:, None] * PS + torch.arange(PS)).reshape(-1)
    d = (dv_pages[:, None] * PS + torch.arange(PS)).reshape(-1)
    hp.backup_from_device_all_layer(dp, h, d, "direct")
    torch.cuda.synchronize()
    ref_k = [t[d].cpu() for t in dp.k_buffer]
    ref_v = [t[d].cpu() for t in dp.v_buffer]
    loader = LayerLoader(hp, dp, "direct")
    for _ in range(2):
        for t in dp.k_buffer + dp.v_buffer:
            t.zero_()
        load = loader.load(h, d)
        got = []
        for layer in range(layers):
            load.wait(layer)
            got.append((dp.k_buffer[layer][d].clone(), dp.v_buffer[layer][d].clone()))  # ordered after the wait
        load.synchronize()
        assert load.done()
        for layer, (k, v) in enumerate(got):
            assert torch.equal(u8(k.cpu()), u8(ref_k[layer])), f"layer {layer} K incomplete at its wait"
            assert torch.equal(u8(v.cpu()), u8(ref_v[layer])), f"layer {layer} V incomplete at its wait"
    hp.close()


@pytest.mark.parametrize("backend, layout", [("direct", "page_first_direct"), ("kernel", "page_first")])
def test_back_to_back_loads_to_the_same_rows_land_in_call_order(backend, layout):
    """Two LayerLoader loads in flight at once that write the same device rows: the later call's data must
    be what stays (background submissions reach the stream in call order)."""
    dp, hp = make(layout=layout, pages=32)
    h1, h2 = hp.alloc(8 * PS), hp.alloc(8 * PS)
    d = torch.arange(PS, 9 * PS)
    for buf in (hp.k_buffer, hp.v_buffer):
        u8(buf).random_(0, 256)
    loader = LayerLoader(hp, dp, backend)
    for _ in range(5):
        first = loader.load(h1, d)
        second = loader.load(h2, d)
        second.synchronize()
        first.synchronize()
        for layer in range(L):
            want_k = hp.k_buffer[h2 // PS, layer, h2 % PS] if layout == "page_first_direct" else hp.k_buffer[h2, layer]
            assert torch.equal(u8(dp.k_buffer[layer][d].cpu()), u8(want_k)), f"layer {layer}: the earlier load landed last"


def test_kernel_variants_that_share_every_constant_but_the_word_size():
    """Rows of three 8-byte words and rows of three 4-byte words compile to different kernels; the native
    launcher must not reuse one for the other (K 24-byte rows, V 12-byte rows)."""
    dp = DeviceKVPool(8 * PS, PS, 2, 1, 12, 6, torch.bfloat16, "cuda")
    for t in dp.k_buffer + dp.v_buffer:
        t.view(torch.uint8).random_(0, 256)
    hp = host_pool_for(dp, layout="page_first")
    h, d = hp.alloc(4 * PS), torch.randperm(8 * PS)[: 4 * PS]
    for _ in range(3):  # the first call compiles through Triton, later ones launch natively
        for buf in (hp.k_buffer, hp.v_buffer):
            u8(buf).fill_(0)
        hp.backup_from_device_all_layer(dp, h, d, "kernel")
        torch.cuda.synchronize()
        for layer in range(2):
            assert torch.equal(u8(hp.k_buffer[h, layer]), u8(dp.k_buffer[layer][d].cpu()))
            assert torch.equal(u8(hp.v_buffer[h, layer]), u8(dp.v_buffer[layer][d].cpu()))
        saved = [t.clone() for t in dp.k_buffer + dp.v_buffer]
        for t in dp.k_buffer + dp.v_buffer:
            t.zero_()
        for layer in range(2):
            hp.load_to_device_per_layer(dp, h, d, layer, "kernel")
        torch.cuda.synchronize()
        for a, b in zip(dp.k_buffer + dp.v_buffer, saved):
            assert torch.equal(u8(a[d]), u8(b[d]))
