"""The kernel backend's tile shape against page count, for the geometry whose kernel loads fall at 1024 pages
(D, DeepSeek-like MLA: 1,152-byte rows = 9 sub-rows of 128 bytes) and for A as the control:

    python benches/python/probe_kernel_tiles.py [--out DIR]

LayerLoader loads (per-layer launches, one native call) of random pages, % of the H2D ceiling measured in the
same run, every load checked bit-exact."""

from __future__ import annotations

import argparse
import json

import torch

from kvtier import LayerLoader, host_pool_for
from kvtier_bench._common import write_results
from kvtier_bench.transfer import GEOMS, PS, ceiling, check_exact, event_time, make_device_pool, page_idx, page_layer_bytes


def timed(loader: LayerLoader, h: torch.Tensor, d: torch.Tensor) -> float:
    return event_time(lambda: loader.load(h, d).synchronize(), 5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    up, _ = ceiling()
    rows = []
    for name in ("D", "A"):
        g = GEOMS[name]
        dp = make_device_pool(g, 1032 * PS)
        for t in (dp.kv_buffer if hasattr(dp, "kv_buffer") else dp.k_buffer + dp.v_buffer):
            t.view(torch.uint8).random_(0, 256)
        hp = host_pool_for(dp, layout="page_first", host_to_device_ratio=1.0)
        eng = hp.engine
        for pages in (256, 1024):
            h = page_idx(torch.randperm(hp.page_num)[:pages])
            d = page_idx(torch.randperm(1031)[:pages] + 1)
            for tile, warps, blocks in ((2048, 8, 16), (1024, 4, 16), (4096, 16, 16), (2048, 8, 32), (1024, 8, 32)):
                eng.tile_words, eng.num_warps, eng.blocks = tile, warps, blocks
                t = timed(LayerLoader(hp, dp, "kernel"), h, d) / g["layers"]
                pct = 100 * pages * page_layer_bytes(g) / t / 1e9 / up
                row = {"geometry": name, "pages": pages, "tile_words": tile, "warps": warps, "blocks": blocks,
                       "loader_pct": round(pct, 1), "exact": check_exact(hp, dp, h, d)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        hp.close()
        del dp
        torch.cuda.empty_cache()
    if args.out:
        write_results(args.out, {"probe-kernel-tiles.json": json.dumps(
            {"gpu": torch.cuda.get_device_name(), "ceiling_h2d_GBps": up, "rows": rows}, indent=1)})


if __name__ == "__main__":
    main()
