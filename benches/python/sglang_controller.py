"""SGLang's own HiCacheController driving an L3 storage backend: kvtier (loaded by SGLang's factory through
`--hicache-storage-backend dynamic` and the README's extra config) or SGLang's HiCacheFile, side by side; on the CPU,
or (`--device cuda`) with the device KV pool on a GPU, through the whole device -> host -> L3 -> host -> device trip.

What runs is SGLang's code: its device KV pool (MHATokenToKVPool, MLATokenToKVPool), its paged allocator, its host
pool (MHATokenToKVPoolHost, AsymmetricMHATokenToKVPoolHost, MLATokenToKVPoolHost; `page_first_direct` or
`page_first`), its HiCacheController with its backup, prefetch, prefetch-IO and prefetch-sync threads, its page
hashes (get_storage_hash_str) and its storage calls (batch_set_v1 / batch_exists / batch_get_v1, zero copy). What
stands in for SGLang's scheduler is the little its radix cache does around the controller: it writes pages through
to storage (write_storage), asks for a prefetch, allocates the host pages for the hit (alloc_prefetch_host_buffers)
and hands the operation to the IO thread, then waits for the acks. Every restored page is compared with the bytes
written.

    python benches/python/sglang_controller.py --backend kvtier --dir /tmp/l3 [--requests 16 --pages 32]
    python benches/python/sglang_controller.py --backend kvtier --dir /tmp/l3 --phase read   # a restarted server

`--phase write` backs the requests up and exits; `--phase read` (another process, later) prefetches them from the
store that one left; `--phase both` (the default) does both in one process. On the CPU the device pool is on "cpu"
and only host pool <-> storage runs. Prints one JSON line: pages written and restored, bytes compared, mismatches,
and the backup and prefetch pages per second (medians over requests).

GPU mode (`--device cuda [--io-backend direct|kernel]`, sglang_controller_gpu.py): the device pool on the GPU, the
host pool pinned, and per request SGLang's full round trip: device rows from its allocator filled with seeded bytes,
`cc.write` (device -> host on its L2TransferEngine's stream), `cc.write_storage`, both pools zeroed, the prefetch
above, `cc.load` + `cc.start_loading` (host -> device, layer by layer), and every layer's device rows compared. It
adds to the JSON line the device -> host backup and host -> device load ms (medians; `_gpu_ms`: CUDA event time),
the pages mismatched after each hop, which copy ops SGLang called (`transfer_calls`) and whether its JIT HiCache
kernels were among them, and which `sgl_kernel` ran. Exit status 1 on any mismatched page, 2 with an `error` field
(request, phase, exception) when a phase fails or times out. `--io-backend direct` (layout page_first_direct) copies
with sgl_kernel's direct ops; `kernel` (page_first) with SGLang's own JIT HiCache kernels (sglang.kernels.ops.kvcache
.hicache, built with nvcc on first use) where `can_use_hicache_jit_kernel` admits the row size, sgl_kernel's warp
kernels elsewhere. Where the compiled `sgl_kernel` does not import (a wheel built for another torch), the script puts
kvtier's stand-in first on sys.path (benches/python/sgl_kernel_standin: NOT SGLang's code): its direct ops copy
page by page with `Tensor.copy_(non_blocking=True)` as sgl_kernel's C++ does; its other ops raise a RuntimeError
naming themselves. Everything else is SGLang's. `--round-trip` runs the same trip on the CPU, the stand-in's direct
ops put into SGLang's pool modules (a check of this script's logic; SGLang's CUDA path does not run).

    python benches/python/sglang_controller.py --device cuda --model mha --io-backend direct --no-planner
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build(backend: str, root: str, layout: str, pages: int, requests: int, page_size: int, planner: bool,
          model: str, device: str = "cpu", io_backend: str = "direct", shape: tuple[int, int, int] | None = None):
    """SGLang's device pool, paged allocator and host pool, and its HiCacheController over the L3 backend. On
    ``cuda`` (sglang_controller_gpu.py) the device pool is on the GPU and the host pool pinned (cudaHostRegister);
    the host pool's own ``device`` stays "cpu" (its rows are host memory; SGLang takes the transfer device from the
    device pool's buffers), as SGLang's pool assembler builds it. ``shape``: (layers, KV heads, head dim) of an MHA
    model (default 4, 2, 64)."""
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import AsymmetricMHATokenToKVPoolHost, MHATokenToKVPoolHost
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_tp_rank=0, attn_tp_size=1,
                                        attn_cp_rank=0, attn_cp_size=1, attn_dcp_rank=0, attn_dcp_size=1,
                                        attn_dp_rank=0, attn_dp_size=1, enable_dp_attention=False, dp_size=1, dp_rank=0)
    layers, heads, dim = shape or (4, 2, 64)
    tokens = (requests * pages + 1) * page_size
    pin = device == "cuda"
    if model == "mla":  # (DeepSeek-shaped: one latent + rope row per token and layer, one object per page)
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        # (on the GPU DeepSeek's own 512 + 64: SGLang's JIT HiCache kernels tile its 1152 B rows, not 160 B ones)
        latent, rope = (512, 64) if device == "cuda" else (64, 16)
        dev = MLATokenToKVPool(tokens, page_size, torch.bfloat16, latent, rope, layers, device, False)
        alloc = PagedTokenToKVPoolAllocator(tokens, page_size, torch.bfloat16, device, dev, False)
        host = MLATokenToKVPoolHost(dev._mla_buffer_info(), 2.0, 0, page_size, layout, pin_memory=pin, device="cpu",
                                    device_capacity_tokens=tokens, start_layer=0, end_layer=layers,
                                    target_layer_num=layers)
    else:  # mha: K and V of 64; asym: MiMo-V2's K 192 / V 128 (SGLang's asymmetric host pool)
        k_dim, v_dim = (dim, dim) if model == "mha" else (192, 128)
        dev = MHATokenToKVPool(tokens, page_size, torch.bfloat16, heads, k_dim, layers, device, False,
                               v_head_dim=v_dim, enable_alt_stream=False)
        alloc = PagedTokenToKVPoolAllocator(tokens, page_size, torch.bfloat16, device, dev, False)
        cls = MHATokenToKVPoolHost if model == "mha" else AsymmetricMHATokenToKVPoolHost
        host = cls(dev._mha_buffer_info(), 2.0, 0, page_size, layout, pin_memory=pin, device="cpu",
                   device_capacity_tokens=tokens, start_layer=0, end_layer=layers)
    if backend == "kvtier":  # the README's SGLang config (`--hicache-storage-backend dynamic`)
        extra = {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang", "class_name": "KvtierStorage",
                 "interface_v1": 1, "path": os.path.join(root, "kvtier")}
        if not planner:  # (by default a stored page is reported only where reading it beats a 5 GB/s engine)
            extra["restore_planner"] = False
        name = "dynamic"
    else:
        extra = {"file_storage_path": os.path.join(root, "hicache-file")}
        name = "file"
    cc = HiCacheController(alloc, host, page_size, dist.group.WORLD, threading.Event(), io_backend=io_backend,
                           storage_backend=name, model_name="test/llama-shape", storage_backend_extra_config=extra)
    return cc, host


def request_tokens(r: int, pages: int, page_size: int) -> list[int]:
    import random

    rng = random.Random(1000 + r)
    return [rng.randrange(32000) for _ in range(pages * page_size)]


def page_views(host, page: int) -> list:
    """Views of one host page in every buffer of SGLang's pool: MHA's one K+V tensor (K and V first), the
    asymmetric pool's K and V tensors, MLA's one latent tensor; by page (page_first_direct) or by token rows."""
    kb = host.kv_buffer
    parts = [(t, 0) for t in kb] if isinstance(kb, (tuple, list)) else [(kb, 0 if host.is_mla else 1)]
    ps = host.page_size
    if host.layout == "page_first_direct":
        return [t.select(dim, page) for t, dim in parts]
    return [t.narrow(dim, page * ps, ps) for t, dim in parts]


def page_bytes(host, indices):
    """The bytes of every host page holding ``indices`` (whole pages), as SGLang's pool lays them out."""
    import torch

    pages = sorted({int(i) // host.page_size for i in indices.tolist()})
    return [v.contiguous().view(torch.uint8).clone() for p in pages for v in page_views(host, p)]


def fill(host, indices, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    for p in sorted({int(i) // host.page_size for i in indices.tolist()}):
        for view in page_views(host, p):
            raw = torch.randint(0, 256, (view.numel() * view.element_size(),), generator=g, dtype=torch.uint8)
            view.copy_(raw.view(view.dtype).view(view.shape))


def zero(host) -> None:
    for t in (host.kv_buffer if isinstance(host.kv_buffer, (tuple, list)) else [host.kv_buffer]):
        t.zero_()


def write_phase(cc, host, requests: int, pages: int, ps: int, want: dict) -> list[float]:
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    rates = []
    for r in range(requests):
        tokens = request_tokens(r, pages, ps)
        hashes = get_storage_hash_str(tokens, None, page_size=ps)
        idx = host.alloc(len(tokens))
        fill(host, idx, seed=r)
        want[r] = page_bytes(host, idx)
        t0 = time.perf_counter()
        op_id = cc.write_storage(idx, tokens, hash_value=hashes)
        op = cc.ack_backup_queue.get(timeout=120)
        rates.append(len(hashes) / (time.perf_counter() - t0))
        if op.id != op_id or op.completed_tokens != len(tokens):
            raise SystemExit(f"backup of request {r}: {op.completed_tokens} of {len(tokens)} tokens written")
        host.free(idx)  # (evicted from the host: only the storage holds it now)
    return rates


def prefetch_request(cc, host, r: int, tokens: list[int], ps: int):
    """One request's prefetch, as SGLang's radix cache drives it: the prefetch thread's batch_exists (then SGLang's
    MIN sync), the host pages for the hit, the IO thread's batch_get, the acks. Returns (pages/s, the host indices
    allocated, the tokens restored), or (None, None, 0) when storage had none of it."""
    t0 = time.perf_counter()
    op = cc.prefetch(f"req-{r}", tokens)
    hit = cc.prefetch_hit_queue.get(timeout=120)
    assert hit is op
    if not op.storage_hit_count:
        return None, None, 0
    idx = cc.alloc_prefetch_host_buffers(op, op.storage_hit_count)
    op.host_indices = idx
    op.hash_value = op.hash_value[: op.storage_hit_count // ps]
    cc.prefetch_buffer.put(op)
    done = 0
    while True:
        ack = cc.ack_prefetch_queue.get(timeout=120)
        if ack.completed_tokens is not None:  # (the tokens restored so far, as SGLang's radix cache reads it)
            done = max(done, ack.completed_tokens)
        if ack.completed_req:
            break
    return done // ps / (time.perf_counter() - t0), idx, done


def compare_pages(host, indices, want: list) -> tuple[int, int]:
    """(bytes compared, pages mismatched) of the host pages holding ``indices`` against ``want`` (page_bytes)."""
    compared = mismatches = 0
    for a, b in zip(page_bytes(host, indices), want):
        compared += a.numel()
        mismatches += int(not bool((a == b).all()))
    return compared, mismatches


def read_phase(cc, host, requests: int, pages: int, ps: int, want: dict) -> tuple[list[float], int, int, int]:
    rates, restored, compared, mismatches = [], 0, 0, 0
    for r in range(requests):
        rate, idx, done = prefetch_request(cc, host, r, request_tokens(r, pages, ps), ps)
        if idx is None:
            continue
        rates.append(rate)
        restored += done // ps
        c, m = compare_pages(host, idx[:done], want[r])
        compared += c
        mismatches += m
        host.free(idx)
    return rates, restored, compared, mismatches


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["kvtier", "file"], default="kvtier")
    ap.add_argument("--dir", default=None, help="where the store lives (default: a temporary directory)")
    ap.add_argument("--layout", choices=["page_first_direct", "page_first"], default=None,
                    help="SGLang's host layout (default: page_first_direct; on cuda the --io-backend's: "
                    "page_first_direct for direct, page_first for kernel)")
    ap.add_argument("--model", choices=["mha", "asym", "mla"], default="mha",
                    help="KV shape: mha (K and V 64), asym (MiMo-V2: K 192 / V 128), mla (latent 64 + rope 16; "
                    "on cuda 512 + 64)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--pages", type=int, default=16, help="pages per request")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--phase", choices=["both", "write", "read"], default="both")
    ap.add_argument("--no-planner", action="store_true", help="kvtier: restore_planner false (report every stored page)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: the GPU round trip of sglang_controller_gpu.py (device pool on the GPU)")
    ap.add_argument("--io-backend", choices=["direct", "kernel"], default="direct",
                    help="SGLang's --hicache-io-backend for the device <-> host copies (cuda, --round-trip)")
    ap.add_argument("--round-trip", action="store_true",
                    help="on the CPU: the cuda mode's round trip, with the stand-in's direct ops (a check of this "
                    "script; SGLang's CUDA path is not run)")
    ap.add_argument("--stall-s", type=float, default=300.0,
                    help="cuda, --round-trip: exit 2 (the JSON line's error names the phase) when a phase makes no "
                    "progress for this long")
    a = ap.parse_args(argv)
    if a.layout is None:
        a.layout = "page_first" if a.device == "cuda" and a.io_backend == "kernel" else "page_first_direct"
    if a.device == "cuda" or a.round_trip:
        if a.phase != "both":
            ap.error("--device cuda and --round-trip run every request's whole round trip: --phase both")
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import sglang_controller_gpu

        return sglang_controller_gpu.main(a, sys.modules[__name__])
    root = a.dir or tempfile.mkdtemp(prefix="sglang-controller-")
    cc, host = build(a.backend, root, a.layout, a.pages, a.requests, a.page_size, not a.no_planner, a.model)
    host.is_mla = a.model == "mla"
    want: dict[int, list] = {}
    out: dict[str, object] = {"backend": a.backend, "model": a.model, "layout": a.layout, "requests": a.requests, "pages": a.pages,
                              "page_size": a.page_size, "backend_class": type(cc.storage_backend).__name__}
    if a.phase in ("both", "write"):
        w = write_phase(cc, host, a.requests, a.pages, a.page_size, want)
        out.update(written_pages=a.requests * a.pages, backup_pages_per_s=statistics.median(w))
    if a.phase == "read":  # (a restarted server: the bytes expected are the writer's, made again from its seeds)
        for r in range(a.requests):
            idx = host.alloc(a.pages * a.page_size)
            fill(host, idx, seed=r)
            want[r] = page_bytes(host, idx)
            host.free(idx)
    if a.phase in ("both", "read"):
        zero(host)  # (nothing of the written pages is left on the host)
        rates, restored, compared, mismatches = read_phase(cc, host, a.requests, a.pages, a.page_size, want)
        out.update(restored_pages=restored, compared_bytes=compared, mismatched_pages=mismatches,
                   prefetch_pages_per_s=statistics.median(rates) if rates else 0.0)
    out["bytes_on_disk"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
    print(json.dumps(out), flush=True)
    cc.storage_stop_event.set()
    if hasattr(cc.storage_backend, "close"):
        cc.storage_backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
