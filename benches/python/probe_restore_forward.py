"""Where the forward after a host restore spends its time: a prefix of ``--ctx`` tokens is on kvtier's host
pool, the prompt's last ``--suffix`` tokens (default 64) are computed through kvtier's cache (its window streams every layer's
prefix to the GPU). Beside it, the same 64 tokens on a DynamicCache that already holds the prefix on the GPU
(the floor), the whole prompt in one forward with no cache (what recomputing costs), the raw per-layer loads of the prefix alone (GB/s), and the host time inside the cache's
``update`` calls. Variants: window sizes (``w2``: 2 layers), ``-kernel`` for the window's transfers as
kernels instead of copy-engine copies; run each twice (``w2,w2``) to see the order's
effect (the first variant after the floor ran 15-20 ms slower in two runs on the H200). With ``--profile DIR`` one
forward of each variant is profiled (torch.profiler tables and a Chrome trace).

    PYTHONPATH=python python benches/python/probe_restore_forward.py [--ctx 8192] [--suffix 64] [--out probe.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvtier.pools_base import HostKVPool
from kvtier.transfer import TransferEngine
from kvtier.transfer.inflight import InFlight
from kvtier.integrations.transformers import cache as tc
from kvtier.integrations.transformers import state as ts
from kvtier.integrations.transformers import KVTier, cache_kwarg

# host time inside these (inclusive, summed over one forward): where the cache's update() spends it
TIMED = [(tc.KvtierCache, "update"), (ts.TierRuntime, "transfer"), (ts.TierRuntime, "wait"),
         (HostKVPool, "prepare"), (HostKVPool, "_check_device_pool"), (TransferEngine, "copy"),
         (TransferEngine, "dma_plans"), (InFlight, "hold")]


def instrument(acc: dict) -> list:
    undo = []
    for owner, name in TIMED:
        real = owner.__dict__[name]
        fn = real.__func__ if isinstance(real, staticmethod) else real

        def timed(*x, _fn=fn, _key=f"{owner.__name__}.{name}", **y):
            t0 = time.perf_counter()
            try:
                return _fn(*x, **y)
            finally:
                acc[_key] = acc.get(_key, 0.0) + time.perf_counter() - t0

        setattr(owner, name, staticmethod(timed) if isinstance(real, staticmethod) else timed)
        undo.append((owner, name, real))
    return undo


def build(tiny: bool, dev: str) -> LlamaForCausalLM:
    if tiny:
        cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256)
    else:
        cfg = LlamaConfig(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(dev):
        return LlamaForCausalLM(cfg).to(torch.bfloat16 if dev == "cuda" else torch.float32).eval()


def setup(tiny: bool, no_cudnn: bool) -> tuple:
    """(device, on CUDA, the model, its config, its cache keyword, a device synchronize) for a probe's options."""
    if no_cudnn:
        torch.backends.cuda.enable_cudnn_sdp(False)
    dev = "cuda" if torch.cuda.is_available() and not tiny else "cpu"
    model = build(tiny, dev)
    return (dev, dev == "cuda", model, model.config, cache_kwarg(model),
            torch.cuda.synchronize if dev == "cuda" else (lambda: None))


def recompute_row(a, model, kw, cfg, dev, window, sync, gen) -> dict:
    """The whole prompt (ctx + suffix tokens, nothing cached) through kvtier's cache and through DynamicCache,
    alternated, timed to the first token's logits (the model's stream; kvtier's backups after it untimed)."""
    n = a.ctx + a.suffix
    tier = KVTier(model, model_id="probe/recompute", page_size=a.ps, window=window, host_tokens=4 * n + 8 * a.ps,
                  restore="all")
    first = torch.cuda.current_stream().synchronize if dev == "cuda" else (lambda: None)
    times: dict = {"kvtier_s": [], "dynamic_s": [], "kvtier_cache_s": []}
    try:
        for rep in range(a.reps + 1):
            ids = torch.randint(0, cfg.vocab_size, (1, n), generator=gen).to(dev)
            sync()
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kw: DynamicCache(config=cfg)})
            first()
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            c = tier.cache(ids)
            t3 = time.perf_counter()
            model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kw: c})
            first()
            t4 = time.perf_counter()
            sync()
            c.release()
            tier.controller.wait_idle()
            if rep:
                times["dynamic_s"].append(t1 - t0)
                times["kvtier_s"].append(t4 - t2)
                times["kvtier_cache_s"].append(t3 - t2)
        if a.profile and dev == "cuda":
            from torch.profiler import ProfilerActivity, profile

            ids = torch.randint(0, cfg.vocab_size, (1, n), generator=gen).to(dev)
            sync()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                c = tier.cache(ids)
                model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kw: c})
                first()
            sync()
            c.release()
            tag = f"w{window}-recompute"
            with open(os.path.join(a.profile, f"{tag}-cpu.txt"), "w") as f:
                f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
                f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
            prof.export_chrome_trace(os.path.join(a.profile, f"{tag}-trace.json"))
    finally:
        tier.close()
    row = {k: statistics.median(v) for k, v in times.items()}
    row["ratio"] = row["kvtier_s"] / row["dynamic_s"]
    print(f"recompute w{window}: kvtier {1e3 * row['kvtier_s']:.1f} ms, DynamicCache {1e3 * row['dynamic_s']:.1f} ms "
          f"({row['ratio']:.3f}x)", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--ps", type=int, default=64)
    ap.add_argument("--suffix", type=int, default=64, help="tokens computed after the restored prefix")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--variants", default="w2,w4,w8")
    ap.add_argument("--profile", default=None, help="a directory for one profiled forward per variant")
    ap.add_argument("--out", default="restore-forward.json")
    ap.add_argument("--no-cudnn", action="store_true", help="SDPA without its cuDNN backend (as the demo runs)")
    ap.add_argument("--recompute", action="store_true",
                    help="also the whole prompt through kvtier's cache with nothing cached, against DynamicCache's")
    a = ap.parse_args()
    dev, cuda, model, cfg, kw, sync = setup(a.tiny, a.no_cudnn)
    ps, ctx, suffix = a.ps, a.ctx, a.suffix
    if ctx % ps or ctx <= 0 or suffix <= 0:
        raise SystemExit(f"--ctx must be a positive multiple of --ps ({ps}) and --suffix positive")
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (1, ctx + suffix), generator=gen)
    out: dict = {"cudnn_sdp": not a.no_cudnn, "ctx": ctx, "suffix": suffix, "page_size": ps, "device": torch.cuda.get_device_name() if cuda else "cpu", "variants": {}}

    with torch.no_grad():
        whole = []
        for _ in range(a.reps + 1):  # recomputing: the whole prompt in one forward (the first one untimed)
            sync()
            t0 = time.perf_counter()
            model(input_ids=ids.to(dev), use_cache=True, logits_to_keep=1, **{kw: DynamicCache(config=cfg)})
            sync()
            whole.append(time.perf_counter() - t0)
        out["recompute_s"] = statistics.median(whole[1:])
        print(f"recompute (the whole prompt, no cache): {1e3 * out['recompute_s']:.1f} ms", flush=True)
        # the floor: the prefix's KV already on the GPU, the last --suffix tokens computed on it
        kept = DynamicCache(config=cfg)
        model(input_ids=ids[:, :ctx].to(dev), use_cache=True, logits_to_keep=1, **{kw: kept})
        floor = []
        for _ in range(a.reps):
            c = copy.deepcopy(kept)
            sync()
            t0 = time.perf_counter()
            model(input_ids=ids[:, ctx:].to(dev), use_cache=True, logits_to_keep=1, **{kw: c})
            sync()
            floor.append(time.perf_counter() - t0)
        out["floor_dynamic_s"] = statistics.median(floor)
        del kept, c
        print(f"floor (prefix on the GPU): {1e3 * out['floor_dynamic_s']:.1f} ms", flush=True)

        for variant in a.variants.split(","):
            window = int(variant.split("-")[0][1:])
            if variant.endswith("-kernel"):  # the window's transfers as kernels (KVTIER_DIRECT_KERNEL_BELOW_KB)
                os.environ["KVTIER_DIRECT_KERNEL_BELOW_KB"] = str(1 << 20)
            else:
                os.environ.pop("KVTIER_DIRECT_KERNEL_BELOW_KB", None)
            tier = KVTier(model, model_id="probe/restore-forward", page_size=ps, window=window,
                          host_tokens=2 * (ctx + suffix) + 8 * ps, restore="all")
            # only the prefix is kept; each forward below computes a suffix of its own (no earlier forward stored
            # its pages), so every rep restores exactly the prefix
            first = tier.cache(ids[:, :ctx])
            model(input_ids=ids[:, :ctx].to(dev), use_cache=True, logits_to_keep=1, **{kw: first})
            first.release()
            tier.controller.wait_idle()
            acc: dict = {}
            undo = instrument(acc)
            row: dict = {"cache_s": [], "forward_s": [], "decode_s": [], "host_s": []}
            try:
                for rep in range(a.reps + 1):
                    ids = torch.cat([ids[:, :ctx], torch.randint(0, cfg.vocab_size, (1, suffix), generator=gen)], 1)
                    sync()
                    t0 = time.perf_counter()
                    c = tier.cache(ids)
                    t1 = time.perf_counter()
                    acc.clear()
                    model(input_ids=ids[:, c.get_seq_length():].to(dev), use_cache=True, logits_to_keep=1, **{kw: c})
                    sync()
                    t2 = time.perf_counter()
                    upd = dict(acc)
                    nxt = torch.randint(0, cfg.vocab_size, (1, 1), device=dev)
                    sync()
                    t3 = time.perf_counter()
                    model(input_ids=nxt, use_cache=True, logits_to_keep=1, **{kw: c})
                    sync()
                    t4 = time.perf_counter()
                    if rep:
                        row["cache_s"].append(t1 - t0)
                        row["forward_s"].append(t2 - t1)
                        row["decode_s"].append(t4 - t3)
                        row["host_s"].append(upd)
                    if rep == a.reps and a.profile:
                        c.release()
                        tier.controller.wait_idle()
                        os.makedirs(a.profile, exist_ok=True)
                        import cProfile
                        import pstats

                        ids = torch.cat([ids[:, :ctx], torch.randint(0, cfg.vocab_size, (1, suffix), generator=gen)], 1)
                        pr = cProfile.Profile()
                        pr.enable()
                        c = tier.cache(ids)
                        model(input_ids=ids[:, c.get_seq_length():].to(dev), use_cache=True, logits_to_keep=1, **{kw: c})
                        sync()
                        pr.disable()
                        with open(os.path.join(a.profile, f"{variant}-python.txt"), "w") as f:
                            pstats.Stats(pr, stream=f).sort_stats("tottime").print_stats(45)
                        c.release()
                        tier.controller.wait_idle()
                    if rep == a.reps and a.profile and cuda:
                        from torch.profiler import ProfilerActivity, profile

                        ids = torch.cat([ids[:, :ctx], torch.randint(0, cfg.vocab_size, (1, suffix), generator=gen)], 1)
                        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                            c = tier.cache(ids)
                            model(input_ids=ids[:, c.get_seq_length():].to(dev), use_cache=True, logits_to_keep=1, **{kw: c})
                            sync()
                        with open(os.path.join(a.profile, f"{variant}-cpu.txt"), "w") as f:
                            f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
                            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
                        with open(os.path.join(a.profile, f"{variant}-cuda.txt"), "w") as f:
                            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
                        prof.export_chrome_trace(os.path.join(a.profile, f"{variant}-trace.json"))
                    c.release()
                    tier.controller.wait_idle()
                # the raw per-layer loads of the prefix into the window's slots, back to back
                c = tier.cache(ids)
                win = c._ensure_window(c.get_seq_length() + suffix)
                loads = []
                for _ in range(3):
                    sync()
                    t0 = time.perf_counter()
                    for layer in range(tier.layers):
                        c._load(win, layer, c.get_seq_length())
                    tier.synchronize()
                    sync()
                    loads.append(time.perf_counter() - t0)
                kv_bytes = c.get_seq_length() * tier.layers * tier.heads * (tier.k_dim + tier.v_dim) * \
                    torch.empty((), dtype=tier.dtype).element_size()
                c.release()
                hosts = row.pop("host_s")
                row = {k: statistics.median(v) for k, v in row.items()}
                row["host_ms"] = {k: round(1e3 * statistics.median(h.get(k, 0.0) for h in hosts), 2) for k in hosts[0]}
                row["raw_loads_s"] = statistics.median(loads)
                row["raw_loads_GBps"] = kv_bytes / row["raw_loads_s"] / 1e9
                row["prefix_bytes"] = kv_bytes
                row["route"] = tier.host.engine.route("direct", tier.host.sides(), dev, per_layer=True)
                row["lanes"] = tier._lanes
            finally:
                for owner, name, real in undo:
                    setattr(owner, name, real)
                tier.close()
            out["variants"][variant] = row
            if a.recompute:
                out["variants"][variant + "-recompute"] = recompute_row(a, model, kw, cfg, dev, window, sync, gen)
            print(variant, {k: (round(v * 1e3, 2) if isinstance(v, float) and k.endswith("_s") else v)
                            for k, v in row.items()}, flush=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
