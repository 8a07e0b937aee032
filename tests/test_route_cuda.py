"""Which mechanism moves a ``direct`` transfer (TransferEngine.route), checked on CUDA for exact bytes:
small (page, layer) chunks run as kernels, large backups of page-first pools are staged (kernel gather,
copy-engine page writes), the rest is one copy-engine copy per chunk. Every route is exercised from a side
stream and from the legacy default stream, with CPU and CUDA index tensors, on random page placements."""

import pytest
import torch

from kvtier import DeviceKVPool, LayerLoader, backup_async, host_pool_for

pytestmark = pytest.mark.cuda

PS, L = 64, 3


def make(heads, dk, dv, layout="page_first_direct", pages=24):
    dp = DeviceKVPool(pages * PS, PS, L, heads, dk, dv, torch.bfloat16, "cuda")
    for t in dp.k_buffer + dp.v_buffer:
        t.view(torch.uint8).random_(0, 256)
    return dp, host_pool_for(dp, layout=layout, host_to_device_ratio=2.0)


def pages_idx(pages, n, device):
    p = torch.randperm(pages)[:n]
    return (p[:, None] * PS + torch.arange(PS)).reshape(-1).to(device)


def u8(t):
    return t.contiguous().view(torch.uint8)


def snapshot(dp, d):
    return [u8(t[d]).clone() for t in dp.k_buffer + dp.v_buffer]


def check(dp, d, ref):
    got = snapshot(dp, d)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def roundtrip(dp, hp, backend, n, stream, idev):
    h = pages_idx(hp.page_num, n, idev)
    d = pages_idx(dp.k_buffer[0].shape[0] // PS, n, idev)
    ref = snapshot(dp, d.cpu())
    with torch.cuda.stream(stream):
        hp.backup_from_device_all_layer(dp, h, d, backend)
        for t in dp.k_buffer + dp.v_buffer:
            t.view(torch.uint8).index_fill_(0, d.to("cuda"), 0)  # ordered after the backup on this stream
        for layer in range(L):
            hp.load_to_device_per_layer(dp, h, d, layer, backend)
    torch.cuda.synchronize()
    check(dp, d.cpu(), ref)
    for t in dp.k_buffer + dp.v_buffer:
        t.view(torch.uint8).index_fill_(0, d.to("cuda"), 0)
    loader = LayerLoader(hp, dp, backend)
    loader.load(h, d).synchronize()
    check(dp, d.cpu(), ref)
    return h


@pytest.mark.parametrize("stream_kind", ["side", "default"])
@pytest.mark.parametrize("idev", ["cpu", "cuda"])
def test_small_chunks_run_as_kernels_exactly(stream_kind, idev):
    dp, hp = make(1, 192, 128)  # geometry C: 24 / 16 KiB per (page, layer)
    eng = hp.engine
    assert eng.route("direct", hp.sides(), "cuda") == "kernel"
    assert eng.lanes_for("direct", hp.sides()) == eng.lanes
    stream = torch.cuda.Stream() if stream_kind == "side" else torch.cuda.default_stream()
    roundtrip(dp, hp, "direct", 12, stream, idev)


def test_small_chunks_on_the_copy_engine_when_disabled(monkeypatch):
    monkeypatch.setenv("KVTIER_DIRECT_KERNEL_BELOW_KB", "0")
    dp, hp = make(1, 192, 128)
    assert hp.engine.route("direct", hp.sides(), "cuda") == "dma"
    roundtrip(dp, hp, "direct", 12, torch.cuda.Stream(), "cpu")


@pytest.mark.parametrize("stream_kind", ["side", "default"])
@pytest.mark.parametrize("layout, backend", [("page_first_direct", "direct"), ("page_first", "kernel")])
def test_staged_backups_are_exact(stream_kind, layout, backend):
    dp, hp = make(4, 192, 128, layout=layout)  # 96 / 64 KiB chunks: direct stays on the copy engine
    eng = hp.engine
    eng.staged_min_bytes = 1  # stage every backup
    eng.staging_bytes = 2 * L * PS * 4 * 192 * 2  # two pages per run: several runs alternate the buffers
    assert eng.route(backend, hp.sides(), "cuda", to_host=True, tokens=PS) in ("staged", "kernel")
    assert eng.route(backend, hp.sides(), "cuda", tokens=PS) in ("dma", "kernel")  # loads are never staged
    stream = torch.cuda.Stream() if stream_kind == "side" else torch.cuda.default_stream()
    roundtrip(dp, hp, backend, 9, stream, "cpu")


def test_staged_direct_backup_follows_its_producer():
    dp, hp = make(4, 192, 128, pages=32)
    hp.engine.staged_min_bytes = 1
    h, d = hp.alloc(32 * PS), torch.arange(32 * PS)
    producer = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device="cuda")
    for it in range(10):
        with torch.cuda.stream(producer):
            for _ in range(3):
                a = (a @ a).clamp_(-1, 1)
            for t in dp.k_buffer + dp.v_buffer:
                t.view(torch.uint8).fill_(it + 1)
            ev = producer.record_event()
        backup_async(hp, dp, h, d, "direct", after=ev).synchronize()
        assert bool((u8(hp.k_buffer)[h[::PS] // PS] == it + 1).all()), f"iteration {it}: staged backup read stale KV"
        assert bool((u8(hp.v_buffer)[h[::PS] // PS] == it + 1).all())


@pytest.mark.parametrize("stream_kind", ["side", "default"])
def test_pool_synchronize_waits_for_warm_per_layer_loads(stream_kind):
    """Warm per-layer loads hold no event of their own (one mark per stream): synchronize() and close()
    must still wait for the last of them."""
    dp, hp = make(4, 192, 128)
    h, d = hp.alloc(8 * PS), torch.arange(8 * PS)
    stream = torch.cuda.Stream() if stream_kind == "side" else torch.cuda.default_stream()
    with torch.cuda.stream(stream):
        hp.load_to_device_per_layer(dp, h, d, 0, "direct")  # cold: plans and caches
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # the copies below queue behind ~50 ms of GPU work
        held = len(hp.engine.inflight)
        for layer in range(L):
            hp.load_to_device_per_layer(dp, h, d, layer, "direct")
        assert hp._warm is not None
        # no call held anything of its own (a hold per call cost D's 16-page loads half their speed)
        assert len(hp.engine.inflight) <= held, (held, len(hp.engine.inflight))
        assert not stream.query()
        hp.synchronize()
        assert stream.query(), "synchronize() returned before the warm loads had run"
    hp.close()


@pytest.mark.parametrize("indices", ["cpu", "cuda"])
def test_repeated_per_layer_loads_take_one_native_call_and_land_exactly(indices, monkeypatch):
    """After the first pass, a per-layer load on the stream of the previous one is one native call that
    submits the copies and re-records the stream's mark (no Python event record): the bytes must still land,
    pass after pass, and synchronize() must wait for the last of them."""
    from kvtier import _native

    dp, hp = make(4, 192, 128)
    h, d = pages_idx(hp.page_num, 6, indices), pages_idx(24, 6, indices)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        hp.backup_from_device_all_layer(dp, h, d, "direct")
        ref = snapshot(dp, d)
        for layer in range(L):  # the first pass: cold, then warm with a Python mark
            hp.load_to_device_per_layer(dp, h, d, layer, "direct")
        calls = []
        real = _native.submit_layers
        monkeypatch.setattr(_native, "submit_layers", lambda *a: calls.append(a) or real(*a))
        for _ in range(3):
            for t in dp.k_buffer + dp.v_buffer:
                t.zero_()
            torch.cuda._sleep(20_000_000)  # the loads queue behind GPU work: synchronize must wait for them
            for layer in range(L):
                hp.load_to_device_per_layer(dp, h, d, layer, "direct")
            hp.synchronize()
            assert stream.query()
            check(dp, d, ref)
    assert len(calls) == 3 * L and all(c[7] is True and len(c[8]) == 1 for c in calls), calls[:2]
    assert len(hp.engine.inflight.marks) == 1
    hp.close()


@pytest.mark.parametrize("geom,backend", [((1, 192, 128), "direct"), ((4, 192, 128), "kernel")])
@pytest.mark.parametrize("stream_kind", ["side", "default"])
@pytest.mark.parametrize("indices", ["cpu", "cuda"])
def test_repeated_kernel_route_loads_take_one_native_call_and_land_exactly(geom, backend, stream_kind, indices,
                                                                           monkeypatch):
    """The kernel route's warm per-layer load (small chunks of ``direct``, or ``kernel``): after the first
    pass each call is one native launch call that also re-records the stream's mark, from a side stream and
    from the default stream alike. The bytes land pass after pass, synchronize() waits for the last load,
    and a load of another index set on the same stream in between is ordered and exact too."""
    from kvtier import _native

    # (the kernel backend moves page_first pools; asymmetric page_first_direct pools are direct-only)
    dp, hp = make(*geom, layout="page_first_direct" if backend == "direct" else "page_first")
    assert hp.engine.route(backend, hp.sides(), "cuda", per_layer=True) == "kernel"
    hs, ds = pages_idx(hp.page_num, 9, indices), pages_idx(24, 9, indices)  # two disjoint index sets
    h, d, h2, d2 = hs[:6 * PS], ds[:6 * PS], hs[6 * PS:], ds[6 * PS:]
    stream = torch.cuda.Stream() if stream_kind == "side" else torch.cuda.default_stream()
    with torch.cuda.stream(stream):
        hp.backup_from_device_all_layer(dp, h, d, backend)
        hp.backup_from_device_all_layer(dp, h2, d2, backend)
        ref, ref2 = snapshot(dp, d), snapshot(dp, d2)
        for layer in range(L):  # the first pass: cold, then warm with a Python mark
            hp.load_to_device_per_layer(dp, h, d, layer, backend)
        assert hp._warm is not None and hp._warm.plans is not None, "no warm kernel launches"
        calls = []
        real = _native.launch_layers
        monkeypatch.setattr(_native, "launch_layers", lambda *a: calls.append(a) or real(*a))
        for _ in range(3):
            for t in dp.k_buffer + dp.v_buffer:
                t.zero_()
            torch.cuda._sleep(20_000_000)  # the loads queue behind GPU work: synchronize must wait for them
            for layer in range(L):
                hp.load_to_device_per_layer(dp, h, d, layer, backend)
            hp.synchronize()
            assert stream.query()
            check(dp, d, ref)
        assert len(calls) == 3 * L and all(len(c) == 8 and c[7] != 0 for c in calls), calls[:2]
        # another index set on the same stream, then back: each lands exactly
        for t in dp.k_buffer + dp.v_buffer:
            t.zero_()
        for layer in range(L):
            hp.load_to_device_per_layer(dp, h2, d2, layer, backend)
        torch.cuda._sleep(20_000_000)
        for layer in range(L):
            hp.load_to_device_per_layer(dp, h, d, layer, backend)
        hp.synchronize()
        check(dp, d2, ref2)
        check(dp, d, ref)
    hp.close()
