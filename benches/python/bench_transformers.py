"""kvtier's transformers cache against transformers' own caches, same model and prompt, one run (issue #19).

    PYTHONPATH=python python benches/python/bench_transformers.py [--out results.json] [--tiny]
        [--contexts 8192,32768] [--decode-tokens 16] [--page-size 64] [--store-dir DIR] [--skip-static]

Model: transformers' own LlamaForCausalLM in the Llama-3.1-8B shape (32 layers, hidden 4096, 32 heads, 8 KV
heads, intermediate 14336, vocab 128256), bf16, random weights from the config (seeded; nothing is
downloaded), SDPA attention. ``--small``: the demo's CPU model (4 layers, hidden 512) at 1K and 4K tokens.
``--tiny``: a 2-layer model on the CPU with contexts of 256 and 1,024 tokens
(seconds; checks the script).

(a) Decode at the largest context: a prompt of that many tokens is prefilled (one forward), then
    ``--decode-tokens`` greedy steps are timed (after two untimed ones). For each cache: tokens/s, peak GPU
    memory (``torch.cuda.max_memory_allocated``) over the whole run and over the decode steps alone (both
    as measured, weights included, and minus the weights), and whether every decode step's logits equal the
    default cache's bit for bit. Caches: ``default`` (DynamicCache, all layers on the GPU), ``offloaded``
    (``DynamicCache(offloading=True)``, 5.24's OffloadedCache), ``offloaded_static``
    (``StaticCache(offloading=True)``, 5.24's OffloadedStaticCache), ``kvtier_w1`` / ``kvtier_w2`` (kvtier,
    windows of 1 and 2 layers).
(b) Time to first token of a prompt (prefix of each context + 64 new tokens) whose prefix was seen before,
    against recomputing it, for every way kvtier restores it: every cached page loaded from the host or the
    disk (what kvtier did before it planned), the restore planner from the host, the disk, a prefix mixed
    of host, disk and new tokens, and a disk throttled to ``--slow-gbps`` (ttft_rows.py says how each row is
    made and checked). The planner's predicted TTFT is set beside the measured one.
Writes ``--out`` (JSON) and prints tables.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

import ttft_rows  # noqa: E402 - beside this file
from kvtier.integrations.transformers import KVTier, cache_kwarg  # the installed kvtier (or PYTHONPATH=python)

SUFFIX = 64
REPS = 2  # each TTFT is timed twice; the second counts
MODEL_ID = "bench/llama-3.1-8b-shape-random-seed0"


def build(tiny: bool, device: str, small: bool = False) -> LlamaForCausalLM:
    if tiny or small:  # small: the demo's CPU model (4 layers, hidden 512), where a prefill is real work
        cfg = (LlamaConfig(num_hidden_layers=4, hidden_size=512, intermediate_size=2816, num_attention_heads=8,
                           num_key_value_heads=2, vocab_size=4096, max_position_embeddings=16384) if small else
               LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096))
        dtype = torch.float32
    else:
        cfg = LlamaConfig(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                          rms_norm_eps=1e-5)
        dtype = torch.bfloat16
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak(device: str) -> int | None:
    return torch.cuda.max_memory_allocated() if device == "cuda" else None


def reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


@torch.no_grad()
def forward(model, ids, cache):
    return model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache}).logits[:, -1]


@torch.no_grad()
def decode(model, prompt, cache, steps: int, device: str) -> dict:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    reset_peak(device)
    sync(device)
    t0 = time.perf_counter()
    logits = forward(model, prompt, cache)
    sync(device)
    prefill_s = time.perf_counter() - t0
    out = [logits.float().cpu()]
    nxt = logits.argmax(-1, keepdim=True)
    for _ in range(2):  # untimed
        logits = forward(model, nxt, cache)
        out.append(logits.float().cpu())
        nxt = logits.argmax(-1, keepdim=True)
    sync(device)
    whole_peak = peak(device)
    reset_peak(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = forward(model, nxt, cache)
        nxt = logits.argmax(-1, keepdim=True)
        out.append(logits)
    sync(device)
    dt = time.perf_counter() - t0
    return dict(prefill_s=prefill_s, decode_tok_s=steps / dt, decode_ms_per_token=1e3 * dt / steps,
                peak_bytes=max(whole_peak or 0, peak(device) or 0) if device == "cuda" else None,
                decode_peak_bytes=peak(device), logits=[x.float().cpu() for x in out])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="transformers-bench.json")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU (seconds)")
    ap.add_argument("--small", action="store_true", help="the demo's CPU model (4 layers, hidden 512) on the CPU")
    ap.add_argument("--contexts", default=None, help="prefix lengths for (b); (a) uses the largest (default 8192,32768)")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--store-dir", default=None, help="PageStore directory (default: a new one under the current directory)")
    ap.add_argument("--skip-static", action="store_true", help="leave out offloaded_static (the slowest)")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--window", default="auto", help="the TTFT rows' KVTier window: 'auto' (KVTier's default: every "
                    "layer where half the free device memory holds them), layers resident on the GPU, or 'all' (every "
                    "layer: a split's head stays on the GPU; the default cache's memory)")
    ap.add_argument("--compression", default="auto", choices=("auto", "off"),
                    help="the store's compression (PageStore's compression=; default auto: lossless for bf16)")
    ap.add_argument("--slow-gbps", type=float, default=0.3, help="the throttled disk of the planned_slow row (GB/s)")
    ap.add_argument("--layer-batch", default="default", choices=("default", "on", "off"),
                    help="a window of every layer moving in one call per forward on this device (on), layer by layer "
                         "(off), or kvtier's default (LayerBatch.one_call_devices)")
    a = ap.parse_args(argv)
    device = "cpu" if a.tiny or a.small or not torch.cuda.is_available() else "cuda"
    if a.layer_batch != "default":
        from kvtier.integrations.transformers.window import LayerBatch

        others = tuple(d for d in LayerBatch.one_call_devices if d != device)
        LayerBatch.one_call_devices = (*others, device) if a.layer_batch == "on" else others
    contexts = [int(x) for x in (a.contexts or ("256,1024" if a.tiny else "1024,4096" if a.small else "8192,32768")).split(",")]
    top = max(contexts)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else ""), flush=True)
    if transformers.__version__ != "5.24.0":
        print(f"WARNING: transformers {transformers.__version__}; kvtier's cache is tested with 5.24.0", flush=True)
    t_build = time.perf_counter()
    model = build(a.tiny, device, a.small)
    sync(device)
    weights = peak(device) or 0
    cfg = model.config
    print(f"model: LlamaForCausalLM {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} "
          f"heads / {cfg.num_key_value_heads} KV heads, {next(model.parameters()).dtype}, built in "
          f"{time.perf_counter() - t_build:.1f} s; weights {weights / 2**30:.2f} GiB", flush=True)
    vocab = cfg.vocab_size
    gen = torch.Generator().manual_seed(1)
    base = torch.randint(0, vocab, (1, top + 2 * SUFFIX), generator=gen)
    root = a.store_dir or tempfile.mkdtemp(prefix="kvtier-hf-bench-", dir=os.getcwd())
    results: dict = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                         transformers=transformers.__version__, torch=torch.__version__, tiny=a.tiny,
                         page_size=a.page_size, weights_bytes=weights, decode={}, ttft={},
                         layer_batch=a.layer_batch, ttft_ends="the first token's logits done (the model's stream)")
    host_tokens = 2 * (top + 2 * SUFFIX) + top // 2 + 4 * a.page_size  # a seen prompt, a new one, and room
    try:
        window = "auto" if a.window == "auto" else cfg.num_hidden_layers if a.window == "all" else int(a.window)
        results["ttft_window"] = window  # (with "auto": each TTFT row's layers are in its "window")
        tier = KVTier(model, model_id=MODEL_ID, page_size=a.page_size, window=window,
                      host_tokens=host_tokens, store_dir=root, store_capacity_bytes=1 << 40,
                      store_compression=a.compression)
        # the rows time reads: every prefix stored must reach the disk (at the default 2 s write deadline a disk
        # that writes slowly gives write-throughs up, and a disk row then has nothing to read)
        tier.controller.write_deadline_s = 60.0
        results["compression"] = a.compression
        tier2 = None
        try:
            # ---------------------------------------------------------------- (a) decode at the top context
            if not a.skip_decode:
                prompt = base[:, :top].to(device)
                offloaded = ["offloaded"] + ([] if a.skip_static else ["offloaded_static"])
                kinds = ["default"] + (offloaded if device == "cuda" else []) + ["kvtier_w1", "kvtier_w2"]
                print(f"\n(a) decode at {top} tokens of context, {a.decode_tokens} timed steps", flush=True)
                if device != "cuda":
                    print("  (transformers' offloaded caches need CUDA: left out on the CPU)")
                ref_logits = None
                cache = None
                for kind in kinds:
                    try:
                        if kind == "default":
                            cache = DynamicCache(config=cfg)
                        elif kind == "offloaded":
                            cache = DynamicCache(config=cfg, offloading=True)
                        elif kind == "offloaded_static":
                            cache = StaticCache(config=cfg, max_cache_len=top + a.decode_tokens + 8, offloading=True)
                        else:  # a tier of its own, without a store (no background writes during the timing)
                            tier2 = KVTier(model, model_id=MODEL_ID, page_size=a.page_size, window=int(kind[-1]),
                                           host_tokens=top + a.decode_tokens + 8 + 4 * a.page_size)
                            cache = tier2.cache(prompt.cpu())
                        r = decode(model, prompt, cache, a.decode_tokens, device)
                        logits = r.pop("logits")
                        if ref_logits is None:
                            ref_logits = logits
                        r["logits_equal_default"] = all(torch.equal(x, y) for x, y in zip(logits, ref_logits))
                        r["tokens_equal_default"] = all(torch.equal(x.argmax(-1), y.argmax(-1)) for x, y in zip(logits, ref_logits))
                        r["max_abs_logit_diff_vs_default"] = max(float((x - y).abs().max()) for x, y in zip(logits, ref_logits))
                        if r["peak_bytes"] is not None:
                            r["peak_minus_weights_bytes"] = r["peak_bytes"] - weights
                            r["decode_peak_minus_weights_bytes"] = r["decode_peak_bytes"] - weights
                        if tier2 is not None:
                            r["window_bytes"] = cache.window_bytes
                            r["on_demand_loads"] = tier2.stats.on_demand_loads
                            cache.release()
                            tier2.close()
                            tier2 = None
                        results["decode"][kind] = r
                        print(f"  {kind:<17} {r['decode_tok_s']:8.2f} tok/s ({r['decode_ms_per_token']:7.1f} ms/token)  "
                              + (f"peak {r['peak_bytes'] / 2**30:6.2f} GiB (decode {r['decode_peak_bytes'] / 2**30:6.2f}, "
                                 f"minus weights {r['decode_peak_minus_weights_bytes'] / 2**30:5.2f})  " if r["peak_bytes"] else "")
                              + f"prefill {r['prefill_s']:.2f} s  logits = default: {r['logits_equal_default']}", flush=True)
                    except Exception as exc:  # noqa: BLE001 - one failing case must not lose the others
                        results["decode"][kind] = dict(error=repr(exc))
                        print(f"  {kind}: FAILED {exc!r}", flush=True)
                        if tier2 is not None:
                            tier2.close()
                            tier2 = None
                    cache = None
            # ---------------------------------------------------------------- (b) TTFT with a seen prefix
            if not a.skip_ttft:
                print(f"\n(b) time to first token, prompt = a prefix seen before + {SUFFIX} new tokens (ratios: to "
                      "recompute)", flush=True)
                results["ttft"] = ttft_rows.run(model, tier, contexts, vocab, device, a.page_size, cache_kwarg(model),
                                                a.slow_gbps)
                st = tier.page_store.get_stats() if tier.page_store is not None else {}
                results["store"] = {k: st.get(k) for k in ("o_direct", "o_direct_note", "read_GBps", "write_GBps", "pages",
                                                           "compression_ratio", "decode_GBps_per_thread",
                                                           "encode_GBps_batch", "coded_objects")}
                errs = sorted(abs(r[f"{k}_predicted_s"] / r[f"{k}_s"] - 1) for r in results["ttft"].values()
                              for k in ("planned_host", "planned_disk", "planned_slow", "planned_mixed")
                              if r.get(f"{k}_predicted_s"))
                results["prediction_error_median"] = errs[len(errs) // 2] if errs else None
                print(f"  store: O_DIRECT {st.get('o_direct')}, read {st.get('read_GBps', 0):.2f} GB/s of decoded pages, "
                      f"compression {a.compression} (ratio {st.get('compression_ratio', 1.0):.3f}, decode "
                      f"{st.get('decode_GBps_per_thread', 0.0):.2f} GB/s a thread); planner's "
                      f"predicted TTFT against the measured: median error "
                      + (f"{100 * errs[len(errs) // 2]:.1f}% over {len(errs)} planned rows" if errs else "n/a"),
                      flush=True)
            results["kvtier_stats"] = tier.stats_dict()
        finally:
            if tier2 is not None:
                tier2.close()
            tier.close()
    finally:
        if a.store_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1, default=str)
    # (a static cache attends over its whole preallocated length under a mask: its logits may differ from the
    # default cache's in the last bits, which is transformers' own behaviour, not a kvtier check)
    # On a GPU no offloading cache, transformers' own included, reproduces the default cache's decode logits bit
    # for bit (kernels are chosen per tensor layout); kvtier must then pick the same tokens. On the CPU the logits
    # must be equal.
    exact = "logits_equal_default" if device == "cpu" else "tokens_equal_default"
    bad = [k for k, r in results["decode"].items() if "error" in r or (k.startswith("kvtier") and not r[exact])]
    for c, r in results["ttft"].items():
        if "error" in r:
            bad.append(f"ttft {c}: {r['error']}")
            continue
        bad += [f"ttft {c} {k}" for k in r if k.endswith("_exact_vs_gpu_copy") and not r[k]]
        bad += [f"ttft {c} {k}" for k in r if k.endswith(("_token_of_recompute_or_reuse", "_bit_identical")) and not r[k]]
    print(f"\nwrote {a.out}; bit-exact: {'all' if not bad else 'NOT ' + ', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
