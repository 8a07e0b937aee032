"""The round trip of sglang_controller.py's ``--device cuda`` mode (and of its ``--round-trip`` check on the CPU):
device pool -> host pool -> L3 -> host pool -> device pool, every step SGLang's own HiCacheController.

Per request: SGLang's paged allocator hands out device rows; every layer's K and V rows (MLA: its latent rows) of
those tokens are filled with seeded random bytes on the device (the bytes expected are kept on the CPU);
``cc.write`` backs them up to the host pool (SGLang's L2TransferEngine on its device-to-host stream; the script
waits on the finish event of the ack it appends to ``cc.ack_write_queue``, then pops it) and the host pages are
compared with the bytes expected; ``cc.write_storage`` writes them through to the L3 backend (``ack_backup_queue``);
the host and device rows are freed and both pools zeroed; the pages are prefetched back into the host pool as the
CPU mode's read phase does (and compared as it does); ``cc.load`` + ``cc.start_loading`` move them to newly
allocated device rows, layer by layer on SGLang's host-to-device stream (the script waits on the ack's finish event
in ``cc.ack_load_queue``), and every layer's device rows are compared with the bytes expected, read through the
pool's ``get_key_buffer``/``get_value_buffer`` after ``layer_done_counter.set_consumer`` as a forward pass does.

No scheduler runs: ``write_fence_stream``/``load_fence_stream`` stay None (the scheduler sets them to its forward
stream; here no forward runs, and SGLang's transfer streams already wait on the stream that filled and zeroed the
rows, through the start event it records on the current stream); no server args are published (nothing on this path
reads them on CUDA). Every queue get and event wait has a deadline: an exception or a stall in any phase prints the
JSON line with an ``error`` field (request, phase, exception) and exits 2; a mismatched page exits 1.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

STANDIN = Path(__file__).resolve().parent / "sgl_kernel_standin"
DIRECT_OPS = ("transfer_kv_direct", "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_all_layer_direct_lf_pf")
WAIT_S = 120.0


def use_sgl_kernel() -> dict:
    """Before any SGLang import: the real ``sgl_kernel`` where it imports, else kvtier's stand-in (first on
    sys.path, only then)."""
    try:
        import sgl_kernel

        return {"sgl_kernel": "real", "sgl_kernel_path": getattr(sgl_kernel, "__file__", None)}
    except Exception as e:  # (not installed, or built for another torch: an ImportError, OSError, RuntimeError)
        reason = f"{type(e).__name__}: {e}"[:300]
    for name in [m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel.")]:
        del sys.modules[name]
    sys.path.insert(0, str(STANDIN))
    import sgl_kernel

    assert getattr(sgl_kernel, "STANDIN", False), sgl_kernel.__file__
    return {"sgl_kernel": "stand-in", "sgl_kernel_import_error": reason}


def inject_direct_ops() -> None:
    """The CPU round trip only: SGLang's host pools import the direct ops on CUDA/ROCm/XPU alone, so the stand-in's
    are put where their module-level names would be (a check of this script, not of SGLang's CUDA path)."""
    from sglang.srt.mem_cache.pool_host import mha, mla

    spec = importlib.util.spec_from_file_location("kvtier_standin_kvcacheio", STANDIN / "sgl_kernel" / "kvcacheio.py")
    assert spec is not None and spec.loader is not None
    ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ops)
    for module in (mha, mla):
        for name in DIRECT_OPS:
            setattr(module, name, getattr(ops, name))


def count_transfer_calls() -> Counter:
    """Count the calls SGLang's host pools make to their copy ops: sgl_kernel's (``transfer_kv_*``) and SGLang's
    own JIT HiCache kernels (``jit_transfer_hicache_*``), by wrapping the names in the pool modules."""
    from sglang.srt.mem_cache.pool_host import mha, mla

    calls: Counter = Counter()

    def counted(name, fn):
        def op(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return op

    for module in (mha, mla):
        for name, fn in list(vars(module).items()):
            if callable(fn) and name.startswith(("transfer_kv_", "jit_transfer_hicache_")):
                setattr(module, name, counted(name, fn))
    return calls


def wait_event(event, what: str) -> None:
    """Poll an event until it completes, with a deadline (no bare synchronize that could hang)."""
    deadline = time.monotonic() + WAIT_S
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: the transfer's finish event is not done after {WAIT_S:.0f} s")
        time.sleep(0.0002)


def take_ack(queue: list, what: str):
    """The one ack this request's transfer appended to SGLang's ack list: wait on its finish event, then pop it."""
    if len(queue) != 1:
        raise RuntimeError(f"{what}: {len(queue)} acks queued, expected 1")
    ack = queue[0]
    wait_event(ack.finish_event, what)
    queue.pop(0)
    return ack


def device_parts(dev, mla: bool) -> list[list]:
    """Every layer's device buffer, by part: K then V (MHA, asymmetric), or the latent rows (MLA)."""
    return [list(dev.kv_buffer)] if mla else [list(dev.k_buffer), list(dev.v_buffer)]


def host_parts(host) -> list:
    """The host pool's K and V tensors (or MLA's one), in the order of device_parts."""
    kb = host.kv_buffer
    if isinstance(kb, (tuple, list)):
        return list(kb)
    return [kb] if host.is_mla else [kb[0], kb[1]]


def host_rows(host, part, idx, layer: int):
    """One layer's rows of ``idx``'s tokens in a host tensor, as SGLang's page-first layouts place them."""
    if host.layout == "page_first_direct":
        return part[idx // host.page_size, layer, idx % host.page_size]
    return part[idx, layer]  # page_first: (tokens, layers, ...)


def expected_rows(parts: list[list], n: int, seed: int) -> list[list]:
    """Seeded random bytes for ``n`` tokens of every part and layer, on the CPU (uint8: bf16 NaN patterns too)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [
        [
            torch.randint(0, 256, (n, *t.shape[1:-1], t.shape[-1] * t.element_size()), generator=g, dtype=torch.uint8)
            for t in layers
        ]
        for layers in parts
    ]


def bad_pages(pairs, pages: int):
    """Per page: whether any (got, want) pair of rows differs in it."""
    import torch

    bad = torch.zeros(pages, dtype=torch.bool)
    for got, want in pairs:
        bad |= (got != want).reshape(pages, -1).any(dim=1)
    return bad


def device_readback(cc, mla: bool, idx, producer: int) -> list[list]:
    """Every layer's rows of ``idx`` after a load, through the pool's getters behind SGLang's per-layer wait."""
    import torch

    dev = cc.mem_pool_device
    cc.layer_done_counter.set_consumer(producer)
    try:
        getters = [dev.get_key_buffer] if mla else [dev.get_key_buffer, dev.get_value_buffer]
        return [[get(layer).view(torch.uint8)[idx].cpu() for layer in range(dev.layer_num)] for get in getters]
    finally:
        cc.layer_done_counter.set_consumer(-1)


def round_trip(cc, host, base, a, stats: dict, where: dict) -> None:
    """Every request's round trip (see the module docstring); ``stats`` collects counts and per-request times."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    ps, dev, alloc, mla = a.page_size, cc.mem_pool_device, cc.mem_pool_device_allocator, host.is_mla
    dparts = device_parts(dev, mla)
    for r in range(a.requests):
        step(where, "hash the pages, allocate device rows", request=r)
        tokens = base.request_tokens(r, a.pages, ps)
        hashes = get_storage_hash_str(tokens, None, page_size=ps)
        n = len(tokens)
        dev_idx = alloc.alloc(n)
        if dev_idx is None:
            raise RuntimeError(f"the device allocator has no {n} free rows")
        step(where, "fill the device rows")
        want = expected_rows(dparts, n, seed=r)
        for layers, wants in zip(dparts, want):
            for t, w in zip(layers, wants):
                t.view(w.dtype)[dev_idx] = w.to(t.device)
        step(where, "backup: device -> host (cc.write)")
        t0 = time.perf_counter()
        host_idx = cc.write(dev_idx)
        if host_idx is None:
            raise RuntimeError(f"the host pool has no {n} free rows")
        ack = take_ack(cc.ack_write_queue, "device -> host backup")
        stats["backup_ms"].append((time.perf_counter() - t0) * 1e3)
        if ack.timing_enabled:
            stats["backup_gpu_ms"].append(ack.start_event.elapsed_time(ack.finish_event))
        hidx = host_idx.cpu()
        stats["backup_mismatched_pages"] += int(
            bad_pages(
                (
                    (host_rows(host, part, hidx, layer).view(w.dtype), w)
                    for part, wants in zip(host_parts(host), want)
                    for layer, w in enumerate(wants)
                ),
                n // ps,
            ).sum()
        )
        host_pages = base.page_bytes(host, host_idx)
        step(where, "write_storage: host -> L3")
        t0 = time.perf_counter()
        op_id = cc.write_storage(host_idx, tokens, hash_value=hashes)
        op = cc.ack_backup_queue.get(timeout=WAIT_S)
        stats["write_rates"].append(len(hashes) / (time.perf_counter() - t0))
        if op.id != op_id or op.completed_tokens != n:
            raise RuntimeError(f"write_storage: {op.completed_tokens} of {n} tokens written")
        stats["written_pages"] += n // ps
        step(where, "free and zero the host and device rows")
        host.free(host_idx)
        alloc.free(dev_idx)
        for layers in dparts:
            for t in layers:
                t.zero_()
        base.zero(host)
        step(where, "prefetch: L3 -> host")
        rate, idx, done = base.prefetch_request(cc, host, r, tokens, ps)
        if idx is None:
            continue
        stats["prefetch_rates"].append(rate)
        stats["restored_pages"] += done // ps
        compared, mismatched = base.compare_pages(host, idx[:done], host_pages)
        stats["compared_bytes"] += compared
        stats["mismatched_pages"] += mismatched
        if done:
            step(where, "load: host -> device (cc.load, cc.start_loading)")
            t0 = time.perf_counter()
            new_idx = cc.load(idx[:done])
            if new_idx is None:
                raise RuntimeError(f"the device allocator has no {done} free rows for the load")
            producer = cc.start_loading()
            ack = take_ack(cc.ack_load_queue, "host -> device load")
            stats["load_ms"].append((time.perf_counter() - t0) * 1e3)
            if ack.timing_enabled:
                stats["load_gpu_ms"].append(ack.start_event.elapsed_time(ack.finish_event))
            step(where, "compare the device rows")
            got = device_readback(cc, mla, new_idx, producer)
            pairs = [(g, w[:done]) for gs, ws in zip(got, want) for g, w in zip(gs, ws)]
            stats["device_compared_bytes"] += sum(g.numel() for g, _ in pairs)
            stats["load_mismatched_pages"] += int(bad_pages(pairs, done // ps).sum())
            stats["loaded_pages"] += done // ps
            alloc.free(new_idx)
        host.free(idx)


def median(xs: list) -> float:
    return statistics.median(xs) if xs else 0.0


TIMES = ("backup_ms", "backup_gpu_ms", "write_rates", "prefetch_rates", "load_ms", "load_gpu_ms")
COUNTS = (
    "written_pages",
    "backup_mismatched_pages",
    "restored_pages",
    "compared_bytes",
    "mismatched_pages",
    "loaded_pages",
    "device_compared_bytes",
    "load_mismatched_pages",
)


def step(where: dict, phase: str, **fields) -> None:
    """Name the phase under way (for the error field) and mark progress (for the stall watchdog)."""
    where.update(phase=phase, at=time.monotonic(), **fields)


def main(a, base) -> int:
    """``--device cuda`` (or ``--round-trip`` on the CPU): the round trip of every request; prints one JSON line."""
    cuda = a.device == "cuda"
    out: dict = {
        "backend": a.backend,
        "model": a.model,
        "layout": a.layout,
        "requests": a.requests,
        "pages": a.pages,
        "page_size": a.page_size,
        "device": a.device,
        "io_backend": a.io_backend,
    }
    where: dict = {"request": None}
    stats: dict = {**{k: [] for k in TIMES}, **dict.fromkeys(COUNTS, 0)}
    cc = host = calls = None
    lock, done = threading.Lock(), threading.Event()

    def emit(code: int, error: BaseException | None = None, tb: str = "") -> int:
        """Print the JSON line once (the main thread, or the watchdog on a stall); the exit status."""
        with lock:
            if done.is_set():
                return code
            done.set()
            line = dict(out)
            if error is not None:
                info = {k: v for k, v in where.items() if k != "at"}
                line["error"] = {
                    **info,
                    "type": type(error).__name__,
                    "message": str(error)[:2000],
                    "traceback": tb[-4000:],
                }
                code = 2
            line.update({k: stats[k] for k in COUNTS})
            line.update(
                backup_pages_per_s=median(stats["write_rates"]),
                backup_d2h_ms=median(stats["backup_ms"]),
                load_h2d_ms=median(stats["load_ms"]),
                prefetch_pages_per_s=median(stats["prefetch_rates"]),
            )
            if stats["backup_gpu_ms"]:
                line.update(
                    backup_d2h_gpu_ms=median(stats["backup_gpu_ms"]), load_h2d_gpu_ms=median(stats["load_gpu_ms"])
                )
            if calls is not None:
                line["transfer_calls"] = dict(sorted(calls.items()))
                line["jit_kernels_used"] = any(name.startswith("jit_") for name in calls)
            standin = sys.modules.get("sgl_kernel")
            if getattr(standin, "STANDIN", False):
                line["sgl_kernel_lazy_stubs"] = sorted(set(standin.LAZY_STUBS))
            if not code and any(
                stats[k] for k in ("backup_mismatched_pages", "mismatched_pages", "load_mismatched_pages")
            ):
                code = 1
            print(json.dumps(line), flush=True)
            sys.stderr.flush()
            return code

    def watchdog() -> None:  # (a phase that makes no progress: a wedged GPU, a transfer never done)
        while not done.wait(1.0):
            if time.monotonic() - where["at"] > a.stall_s:
                emit(
                    2,
                    TimeoutError(f"no progress for {a.stall_s:.0f} s (--stall-s)"),
                    "".join(traceback.format_stack(sys._current_frames().get(threading.main_thread().ident))),
                )
                os._exit(2)

    step(where, "setup: torch, sgl_kernel")
    threading.Thread(target=watchdog, name="stall-watchdog", daemon=True).start()
    try:
        if cuda:
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("--device cuda: torch.cuda.is_available() is False")
            out.update(use_sgl_kernel(), gpu=torch.cuda.get_device_name(), torch=torch.__version__)
        else:
            if a.io_backend != "direct":
                raise ValueError("the CPU round trip has the stand-in's direct ops only: --io-backend direct")
            out["sgl_kernel"] = "stand-in (injected: CPU round trip)"
            inject_direct_ops()
        step(where, "setup: SGLang's pools and controller (on CUDA its JIT HiCache kernels build here, with nvcc)")
        root = a.dir or tempfile.mkdtemp(prefix="sglang-controller-")
        cc, host = base.build(
            a.backend,
            root,
            a.layout,
            a.pages,
            a.requests,
            a.page_size,
            not a.no_planner,
            a.model,
            device=a.device,
            io_backend=a.io_backend,
        )
        host.is_mla = a.model == "mla"
        calls = count_transfer_calls()
        out.update(
            backend_class=type(cc.storage_backend).__name__,
            host_pool=type(host).__name__,
            can_use_jit=bool(getattr(host, "can_use_jit", False)),
            can_use_write_back_jit=bool(getattr(host, "can_use_write_back_jit", False)),
        )
        round_trip(cc, host, base, a, stats, where)
        out["bytes_on_disk"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
    except BaseException as e:  # (KeyboardInterrupt too: the line is printed either way)
        emit(2, e, traceback.format_exc())
        os._exit(2)  # (SGLang's and the backend's threads may be wedged: leave without joining them)
    code = emit(0)
    cc.storage_stop_event.set()
    if hasattr(cc.storage_backend, "close"):
        cc.storage_backend.close()
    if cuda:
        host.destroy()  # (SGLang's own: unregisters the pinned host buffers before exit)
    return code
