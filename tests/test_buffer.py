"""HostBuffer: alignment, huge-page reporting, zero-copy torch views, lifetime, GIL release, RSS, pinning."""

import threading
import time

import pytest
import torch

import kvtier
from kvtier import HostBuffer

MiB = 1 << 20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("alignment", [4096, 8192, 1 << 16, 2 * MiB, 4 * MiB])
@pytest.mark.parametrize("nbytes", [1, 4095, 4097, 3 * MiB + 5])
def test_alignment_and_rounding(alignment, nbytes):
    with HostBuffer(nbytes, alignment=alignment, huge_pages="off", pin=False) as b:
        assert b.ptr % alignment == 0
        assert b.nbytes >= nbytes and b.nbytes % 4096 == 0
        assert b.alignment == alignment
        assert b.page_kind == "base"


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"nbytes": 0}, "nbytes"),
        ({"nbytes": -5}, "nbytes"),
        ({"nbytes": 1 << 62}, "nbytes"),
        ({"nbytes": 4096, "alignment": 3000}, "alignment"),
        ({"nbytes": 4096, "alignment": 2048}, "alignment"),
        ({"nbytes": 4096, "alignment": 0}, "alignment"),
        ({"nbytes": 4096, "huge_pages": "maybe"}, "huge_pages"),
        ({"nbytes": 4096, "prefault_threads": -1}, "prefault_threads"),
        ({"nbytes": 4096, "pin": "yes"}, "pin"),
        ({"nbytes": 4096.0}, "nbytes"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name) as ei:
        HostBuffer(**kwargs)
    assert isinstance(ei.value, kvtier.KvtierError)


def test_huge_page_fallback_is_reported_not_raised():
    with HostBuffer(4 * MiB, huge_pages="auto", pin=False) as b:
        if b.page_kind == "explicit":
            assert b.huge_page_fallback is None
        else:
            assert "huge pages" in b.huge_page_fallback
        if b.page_kind != "base":
            assert b.ptr % (2 * MiB) == 0
    with open("/proc/sys/vm/nr_hugepages") as f:
        if f.read().strip() == "0":
            with pytest.raises(kvtier.HugePagesUnavailableError):
                HostBuffer(2 * MiB, huge_pages="required")


def test_views_share_memory_with_shape_dtype_strides():
    with HostBuffer(MiB, pin=False) as b:
        f = b.as_tensor(torch.float32, (16, 32))
        assert f.shape == (16, 32) and f.dtype == torch.float32 and f.stride() == (32, 1)
        assert f.data_ptr() == b.ptr and f.device.type == "cpu"
        h = b.as_tensor(torch.bfloat16, (4, 8), offset=4096)
        assert h.data_ptr() == b.ptr + 4096
        u = b.as_tensor(torch.uint8)
        assert u.numel() == b.nbytes
        f[3, 5] = 2.5
        assert torch.equal(u[(3 * 32 + 5) * 4 : (3 * 32 + 6) * 4], torch.tensor([2.5]).view(torch.uint8))
        h[1, 2] = 7.0
        assert u[4096 + (8 + 2) * 2 : 4096 + (8 + 3) * 2].view(torch.bfloat16).item() == 7.0
        # float32 2.5 (0x40200000) and bfloat16 7.0 (0x40e0) have two non-zero bytes each; nothing else moved
        assert torch.count_nonzero(u).item() == 4


def test_view_bytes_are_exact():
    with HostBuffer(8192, pin=False) as b:
        u = b.as_tensor()
        u.copy_(torch.arange(u.numel(), dtype=torch.int64).remainder(251).to(torch.uint8))
        w = b.as_tensor(torch.int32, (u.numel() // 4,))
        assert torch.equal(w.view(torch.uint8), u)
        assert torch.equal(b.as_tensor(torch.uint8, (100,), offset=100), u[100:200])


def test_view_arguments_are_checked():
    with HostBuffer(8192, pin=False) as b:
        with pytest.raises(ValueError, match="shape"):
            b.as_tensor(torch.float32, (4096,))
        with pytest.raises(ValueError, match="offset"):
            b.as_tensor(torch.float32, (4,), offset=2)
        with pytest.raises(ValueError, match="offset"):
            b.as_tensor(torch.uint8, (1,), offset=-1)
        with pytest.raises(ValueError, match="shape"):
            b.as_tensor(torch.uint8, (-1,))
        with pytest.raises(ValueError, match="dtype"):
            b.as_tensor("float32", (4,))


def test_tensor_outlives_the_handle():
    b = HostBuffer(4 * MiB, pin=False)
    t = b.as_tensor(torch.int64)
    t.fill_(0x5A5A5A5A)
    b.close()
    del b
    import gc

    gc.collect()
    # The mapping is still alive because the view holds it.
    assert int(t[-1]) == 0x5A5A5A5A
    t[123] = 9
    assert int(t[123]) == 9


def test_use_after_close_raises_closed_error():
    b = HostBuffer(4096, pin=False)
    b.close()
    b.close()  # idempotent
    assert b.closed
    for op in (lambda: b.ptr, lambda: b.nbytes, lambda: b.as_tensor(), lambda: b.pinned):
        with pytest.raises(kvtier.ClosedError, match="closed"):
            op()
    assert "closed" in repr(b)


def test_close_frees_memory_when_no_view_remains():
    before = rss_bytes()
    b = HostBuffer(512 * MiB, huge_pages="off", pin=False)
    assert rss_bytes() - before > 400 * MiB  # pre-faulted
    b.close()
    assert rss_bytes() - before < 64 * MiB


def test_gil_is_released_while_allocating():
    """Main-thread Python code keeps running while another thread maps and pre-faults a buffer."""
    span = {}

    def worker():
        span["start"] = time.perf_counter()
        HostBuffer(1024 * MiB, huge_pages="off", prefault_threads=1, pin=False).close()
        span["end"] = time.perf_counter()

    th = threading.Thread(target=worker)
    ticks = []
    th.start()
    while th.is_alive():
        ticks.append(time.perf_counter())
    th.join()
    dur = span["end"] - span["start"]
    assert dur > 0.05, "allocation too fast to observe"
    inside = [t for t in ticks if span["start"] + 0.2 * dur < t < span["end"] - 0.2 * dur]
    # With the GIL held for the whole call the main thread could not tick inside the window at all.
    assert len(inside) > 100, (len(inside), dur)


def test_two_threads_create_concurrently():
    errors = []
    results = []

    def worker(i):
        try:
            with HostBuffer(256 * MiB, pin=False) as b:
                t = b.as_tensor(torch.uint8)
                t[-1] = i
                results.append(int(t[-1]))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    ths = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    [t.start() for t in ths]
    [t.join() for t in ths]
    assert not errors and sorted(results) == [0, 1]


def test_rss_flat_over_200_create_close_cycles():
    for _ in range(3):
        HostBuffer(256 * MiB, pin=False).close()
    base = rss_bytes()
    for _ in range(200):
        b = HostBuffer(256 * MiB, pin=False)
        b.as_tensor(torch.uint8)[::4096].fill_(1)
        b.close()
    assert rss_bytes() - base < 32 * MiB


def test_auto_pin_without_cuda_is_unpinned():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with HostBuffer(MiB) as b:
        assert not b.pinned and b.registered_chunks == []
        assert not b.as_tensor().is_pinned()
    with pytest.raises(kvtier.CudaUnavailableError):
        HostBuffer(MiB, pin=True)


# ---------------------------------------------------------------- CUDA (skipped without a GPU)


@pytest.mark.cuda
def test_cuda_pinned_status_and_chunks():
    gran = 3 * 4096 * 5  # a "page" that does not divide the chunk size
    with HostBuffer(64 * MiB, pin=True, pin_granularity=gran, register_chunk_bytes=8 * MiB) as b:
        assert b.pinned
        t = b.as_tensor()
        assert t.is_pinned()
        chunks = b.registered_chunks
        assert sum(n for _, n in chunks) == b.nbytes
        assert all(off % gran == 0 for off, _ in chunks)
        assert all(n <= 8 * MiB for _, n in chunks) and len(chunks) > 1
        assert kvtier._native.cuda_host_registered(b.ptr)


@pytest.mark.cuda
def test_cuda_async_copies_bit_exact():
    n = 96 * MiB
    with HostBuffer(n, pin=True) as b:
        h = b.as_tensor(torch.uint8, (n,))
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            h.copy_(src, non_blocking=True)
            back = torch.empty_like(src)
            back.copy_(h, non_blocking=True)
        s.synchronize()
        assert torch.equal(back, src)
        assert torch.equal(h, src.cpu())


@pytest.mark.cuda
def test_cuda_unregister_on_close():
    b = HostBuffer(16 * MiB, pin=True)
    ptr = b.ptr
    assert kvtier._native.cuda_host_registered(ptr)
    # A view keeps memory and registration alive past close().
    t = b.as_tensor()
    b.close()
    assert kvtier._native.cuda_host_registered(ptr)
    del t
    import gc

    gc.collect()
    assert not kvtier._native.cuda_host_registered(ptr)


@pytest.mark.cuda
def test_cuda_whole_buffer_copy_with_default_registration():
    """A copy over the whole of a large pinned buffer works with the default registration (one chunk up to
    64 GiB): a copy spanning two registrations is rejected by CUDA with "invalid argument"."""
    n = 3 << 30
    with HostBuffer(n) as b:
        assert len(b.registered_chunks) == 1
        h = b.as_tensor()
        h[:: 1 << 20] = 7
        d = torch.empty(n, dtype=torch.uint8, device="cuda")
        d.copy_(h, non_blocking=True)
        torch.cuda.synchronize()
        assert int(d[:: 1 << 20].sum()) == 7 * (n >> 20)


def test_prefault_progress_is_counted_for_a_progress_bar(monkeypatch):
    """Large buffers take seconds to pre-fault and pin: the core counts the bytes done, which a progress bar
    (KVTIER_PROGRESS) polls from another thread."""
    from kvtier import _native, config

    p = _native.Progress()
    for nbytes, threads in ((64 << 20, 2), ((64 << 20) + 3 * 4096, 3)):  # also pages left past a full 256
        r = _native.HostRegion(nbytes, 4096, "off", threads, p)
        assert p.get() == (r.nbytes, r.nbytes)
        r.close()
    monkeypatch.setenv("KVTIER_PROGRESS", "1")
    assert config.progress(4 << 30) and not config.progress(1 << 30)
    monkeypatch.setenv("KVTIER_PROGRESS", "0")
    assert not config.progress(1 << 40)
    monkeypatch.setenv("KVTIER_PROGRESS", "yes")
    with pytest.raises(kvtier.InvalidArgumentError, match="KVTIER_PROGRESS"):
        config.progress(1 << 40)


def test_memory_that_could_not_be_pinned_is_said_once_in_the_log(monkeypatch, caplog):
    """pin="auto" where torch sees a GPU but the memory cannot be pinned (here: no CUDA driver) keeps the buffer,
    unpinned, with the reason in pin_error, and says so in the log (it was silent: transfers then take the slow
    path); pin=True raises instead."""
    import logging

    import kvtier.buffer as buffer_module
    from kvtier import CudaUnavailableError, _native

    if _native.cuda_driver_available():
        pytest.skip("this machine can pin")
    monkeypatch.setattr(buffer_module, "cuda_device_available", lambda: True)
    monkeypatch.setattr(buffer_module, "_said_unpinned", False)
    with caplog.at_level(logging.WARNING, logger="kvtier.buffer"):
        b = HostBuffer(1 << 20, huge_pages="off", pin="auto")
        c = HostBuffer(1 << 21, huge_pages="off", pin="auto")  # (once a process: not logged again)
    assert not b.pinned and "not available" in b.pin_error and not c.pinned and c.pin_error == b.pin_error
    (rec,) = caplog.records
    assert "could not be pinned" in rec.getMessage() and str(1 << 20) in rec.getMessage()
    b.close()
    c.close()
    with pytest.raises(CudaUnavailableError):
        HostBuffer(1 << 20, huge_pages="off", pin=True)
