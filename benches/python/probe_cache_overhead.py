"""Where a full prefill through kvtier's transformers cache spends the time it adds over transformers' own
DynamicCache (no restore: every token computed): the forward's wall time with each cache, and the host time
inside each per-layer backup call. Prints medians of ``--reps`` forwards.

    PYTHONPATH=python python benches/python/probe_cache_overhead.py [--tokens 7168] [--layers 16] [--hidden 2048]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvtier.integrations.transformers import KVTier


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=7168)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--reps", type=int, default=6)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = LlamaConfig(num_hidden_layers=a.layers, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                      num_attention_heads=max(1, a.hidden // 128), num_key_value_heads=min(8, max(1, a.hidden // 128)),
                      vocab_size=32000)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16 if dev == "cuda" else torch.float32).eval()
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    tier = KVTier(model, model_id="probe", page_size=64, window=a.window, host_tokens=4 * a.tokens, restore="all")
    host = tier.host
    inside: list[float] = []
    real = host.backup_from_device_per_layer

    def timed(*args, **kw):
        t0 = time.perf_counter()
        out = real(*args, **kw)
        inside.append(time.perf_counter() - t0)
        return out

    host.backup_from_device_per_layer = timed
    res: dict[str, list[float]] = {"dynamic": [], "kvtier": [], "backup_calls": []}
    with torch.no_grad():
        for rep in range(a.reps + 1):
            ids = torch.randint(1, 32000, (1, a.tokens), device=dev)
            for kind in ("dynamic", "kvtier"):
                cache = DynamicCache(config=cfg) if kind == "dynamic" else tier.cache(ids[0].tolist())
                inside.clear()
                sync()
                t0 = time.perf_counter()
                model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
                sync()
                if rep:
                    res[kind].append(time.perf_counter() - t0)
                    if kind == "kvtier":
                        res["backup_calls"].append(sum(inside))
                if kind == "kvtier":
                    cache.release()
                    tier.controller.wait_idle()
    for k, v in res.items():
        print(f"{k:>13}: median {1e3 * statistics.median(v):7.2f} ms  (min {1e3 * min(v):7.2f})")
    tier.close()


if __name__ == "__main__":
    main()
