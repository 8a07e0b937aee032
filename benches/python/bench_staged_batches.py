"""What the engine deadlines cost when nothing stalls: SGLang's backend (``KvtierStorage`` over SGLang's own
host pool, ``page_first_direct``) writing and reading batches through kvtier's staging pages (the default,
deadlines on) against the same batches zero-copy (``read_deadline_s``/``write_deadline_s`` null), alternated,
medians. The ceilings are measured in the same run: the disk's own write and read rate with the store's IO
(``disk_roofline``: O_DIRECT objects of the page-object size, the store's threads) and one host memory copy
of a batch (what staging adds).

    python benches/python/bench_staged_batches.py [--path DIR] [--pages 128] [--rounds 5]

Needs SGLang importable (``make install-test``). Reads go to the disk (O_DIRECT where the file system
allows it; buffered reads would come from the page cache and say nothing about the disk)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def drop_caches() -> None:
    """Empties the page cache (root only; otherwise a no-op, and the JSON says so)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
    except OSError:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", default=None, help="a directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--pages", type=int, default=128, help="pages per batch (SGLang's storage batch)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page-tokens", type=int, default=16)
    a = ap.parse_args()
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    from kvtier import _native
    from kvtier.buffer import HostBuffer
    from kvtier.integrations.sglang import KvtierStorage

    root = a.path or tempfile.mkdtemp(prefix="kvtier-staged-bench-")
    ps, layers, heads, dim, pages = a.page_tokens, a.layers, 8, 128, 2 * a.pages
    pool = MHATokenToKVPoolHost.__new__(MHATokenToKVPoolHost)
    pool.page_size, pool.layer_num, pool.head_num, pool.head_dim, pool.v_head_dim = ps, layers, heads, dim, dim
    pool.dtype, pool.layout, pool.page_num, pool.size = torch.bfloat16, "page_first_direct", pages, pages * ps
    # page-aligned, as SGLang's pinned host pools are (cudaHostAlloc): O_DIRECT straight into its pages
    shape = (2, pages, layers, ps, heads, dim)
    mem = HostBuffer(2 * pages * layers * ps * heads * dim * 2, pin=False)
    pool.kv_buffer = mem.as_tensor(torch.bfloat16, shape)
    pool.kv_buffer.view(torch.int16).copy_(torch.randint(-30000, 30000, shape, dtype=torch.int16))
    obj = layers * ps * heads * dim * 2
    batch_bytes = 2 * obj * a.pages

    def backend(sub: str, deadlines: bool) -> KvtierStorage:
        extra = {"backend_name": "kvtier", "path": os.path.join(root, sub), "restore_planner": False,
                 "capacity_bytes": 8 * batch_bytes}
        if not deadlines:
            extra.update(read_deadline_s=None, write_deadline_s=None)
        cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                   is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                   model_name="bench", extra_config=extra)
        be = KvtierStorage(cfg)
        be.register_mem_pool_host(pool)
        return be

    src = torch.arange(a.pages * ps, dtype=torch.int64)
    dst = torch.arange(a.pages * ps, 2 * a.pages * ps, dtype=torch.int64)
    rates: dict[str, list[float]] = {f"{k}_{m}": [] for k in ("write", "read") for m in ("staged", "zero_copy")}
    copy_GBps = []
    write_ceiling, read_ceiling = [], []
    for r in range(a.rounds):
        w, rd, _ = _native.disk_roofline(root, obj, min(2 * a.pages, 512), 16)
        write_ceiling.append(w)
        read_ceiling.append(rd)
        buf = torch.empty_like(pool.kv_buffer[:, : a.pages])
        t0 = time.perf_counter()
        buf.copy_(pool.kv_buffer[:, : a.pages])
        copy_GBps.append(batch_bytes / (time.perf_counter() - t0) / 1e9)
        del buf
        for mode in (("staged", "zero_copy") if r % 2 == 0 else ("zero_copy", "staged")):
            be = backend(f"{mode}-{r}", mode == "staged")
            keys = [f"{r:08x}{mode[0]}{i:055x}" for i in range(a.pages)]
            t0 = time.perf_counter()
            ok = be.batch_set_v1(keys, src)
            rates[f"write_{mode}"].append(batch_bytes / (time.perf_counter() - t0) / 1e9)
            assert all(ok), "a write failed"
            drop_caches()  # (a buffered read would come from the page cache)
            t0 = time.perf_counter()
            ok = be.batch_get_v1(keys, dst)
            rates[f"read_{mode}"].append(batch_bytes / (time.perf_counter() - t0) / 1e9)
            assert all(ok), "a read failed"
            assert torch.equal(pool.kv_buffer[:, a.pages:].view(torch.int16), pool.kv_buffer[:, : a.pages].view(torch.int16))
            pool.kv_buffer[:, a.pages:].view(torch.int16).zero_()
            be.clear()
            be.close()
    med = {k: statistics.median(v) for k, v in rates.items()}
    out = {
        "batch_pages": a.pages, "batch_MiB": batch_bytes / 2**20, "rounds": a.rounds, "path": root,
        "page_cache_dropped": os.geteuid() == 0,
        "disk_write_ceiling_GBps": statistics.median(write_ceiling), "disk_read_ceiling_GBps": statistics.median(read_ceiling),
        "memory_copy_GBps": statistics.median(copy_GBps),
        **{f"{k}_GBps": round(v, 3) for k, v in med.items()},
        "write_staged_over_zero_copy": round(med["write_staged"] / med["write_zero_copy"], 3),
        "read_staged_over_zero_copy": round(med["read_staged"] / med["read_zero_copy"], 3),
        "write_staged_over_ceiling": round(med["write_staged"] / statistics.median(write_ceiling), 3),
        "read_staged_over_ceiling": round(med["read_staged"] / statistics.median(read_ceiling), 3),
    }
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
