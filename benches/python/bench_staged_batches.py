"""What the engine deadlines cost when nothing stalls: an engine's host pool (SGLang's ``page_first_direct`` MHA
shape, page-aligned as its pinned pools are) written and read in batches through kvtier's staging pages
(:class:`kvtier.staging.StagedIO`, what SGLang's and vLLM's backends do by default) against the same batches
zero-copy (deadlines off), alternated, medians. The ceilings are measured in the same run: the disk's own write and read rate with the store's IO
(``disk_roofline``: O_DIRECT objects of the page-object size, the store's threads) and one host memory copy
of a batch (what staging adds).

    python benches/python/bench_staged_batches.py [--path DIR] [--pages 128] [--rounds 5]

Reads go to the disk (O_DIRECT where the file system
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

    from kvtier import PageStore, _native
    from kvtier.buffer import HostBuffer
    from kvtier.staging import StagedIO

    root = a.path or tempfile.mkdtemp(prefix="kvtier-staged-bench-")
    ps, layers, heads, dim, pages = a.page_tokens, a.layers, 8, 128, 2 * a.pages
    obj = layers * ps * heads * dim * 2
    batch_bytes = 2 * obj * a.pages

    class Pool:  # SGLang's MHATokenToKVPoolHost, page_first_direct: kv_buffer (2, pages, layers, page, heads, dim)
        layout, page_size, page_num, size, dtype = "page_first_direct", ps, pages, pages * ps, torch.bfloat16
        layer_num, head_num, head_dim, v_head_dim = layers, heads, dim, dim

        def __init__(self) -> None:
            shape = (2, pages, layers, ps, heads, dim)
            self.mem = HostBuffer(2 * pages * obj, pin=False)  # page-aligned, as pinned pools are
            self.kv_buffer = self.mem.as_tensor(torch.bfloat16, shape)
            self.kv_buffer.view(torch.int16).copy_(torch.randint(-30000, 30000, shape, dtype=torch.int16))

        def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
            base, ptrs = self.kv_buffer.data_ptr(), []
            for p in (indices[::ps] // ps).tolist():
                ptrs += [base + p * obj, base + (pages + p) * obj]
            return ptrs, [obj] * len(ptrs)

    pool = Pool()

    class Backend:  # a store and its staged batches, as the engine backends hold them
        def __init__(self, sub: str, deadlines: bool) -> None:
            self.store = PageStore(os.path.join(root, sub), capacity_bytes=8 * batch_bytes, probe_bytes=0)
            self.store.register_mem_pool_host(pool)
            self.io = StagedIO(self.store, read_deadline_s=30.0 if deadlines else None,
                               write_deadline_s=30.0 if deadlines else None)
            self.io.prepare()

        def batch_set_v1(self, keys: list[str], idx: torch.Tensor) -> list[bool]:
            return self.io.set(keys, idx)

        def batch_get_v1(self, keys: list[str], idx: torch.Tensor) -> list[bool]:
            return self.io.get(keys, idx)

        def clear(self) -> None:
            self.store.clear()

        def close(self) -> None:
            self.io.close()
            self.store.close()

    def backend(sub: str, deadlines: bool) -> Backend:
        return Backend(sub, deadlines)

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
