"""Time to first token of a restore from the disk against where it splits: the head (pages [0, j)) recomputed
while the tail [j, n) loads, for a range of j, with the planner's prediction beside each, and the parts
measured apart (the head's forward alone, the tail's read alone). One model, one prefix, one run; each time
the median of 3 restores after a warm-up. ``cache_s`` is the time ``KVTier.cache`` took to return (with the tail
in flight, it returns once the head is queued), ``rest_s`` the forward after it until its output is ready.
On CUDA each row also has the device's timeline (medians, ms from the restore's start): ``head_end`` (the head's
stream done), ``read_done`` (the tail's read seen done on the host), ``loads_end`` (the transfer stream done with
what was queued when ``KVTier.cache`` returned: the tail's loads behind their gate), ``end`` (the forward's output).

    PYTHONPATH=python python benches/python/probe_split_curve.py [--ctx 8192] [--out split.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvtier.integrations.transformers import KVTier, cache_kwarg
from kvtier.planner import RestorePlan
from kvtier.store import page_hashes


REPS = 3  # timed restores per head (medians), after one warm-up


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--ps", type=int, default=64)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default="split-curve.json")
    ap.add_argument("--heads", default=None, help="heads to force, in pages (default: 0, n/4, n/2, 5n/8, 3n/4, 7n/8, n-4, n)")
    ap.add_argument("--window", default="2", help="KVTier's window: layers resident on the device, or 'all'")
    ap.add_argument("--label", default="", help="a name for this run in the output (e.g. the wheel's commit)")
    ap.add_argument("--trace", default=None, help="a folder: the last restore of each head is also recorded by "
                    "torch.profiler (host and device), as split-j<head>.json.gz there")
    ap.add_argument("--reps", type=int, default=REPS, help=f"timed restores per head (default {REPS})")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() and not a.tiny else "cpu"
    if a.tiny:
        cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256)
    else:
        cfg = LlamaConfig(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16 if dev == "cuda" else torch.float32).eval()
    kw = cache_kwarg(model)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    ps, ctx = a.ps, a.ctx
    ids = torch.randint(0, cfg.vocab_size, (1, ctx + 64), generator=torch.Generator().manual_seed(3))
    n = ctx // ps
    root = tempfile.mkdtemp(dir=os.getcwd())
    window = cfg.num_hidden_layers if a.window == "all" else int(a.window)
    out: dict = {"ctx": ctx, "label": a.label, "window": window, "rows": []}
    try:
        tier = KVTier(model, model_id="probe/split", page_size=ps, window=window, host_tokens=2 * ctx + 8 * ps, store_dir=root)
        tier.calibrate([ctx // 4, ctx // 2, ctx])
        with torch.no_grad():
            for _ in range(2):
                sync()
                t0 = time.perf_counter()
                model(input_ids=ids.to(dev), use_cache=True, logits_to_keep=1, **{kw: DynamicCache(config=cfg)})
                sync()
                out["recompute_s"] = time.perf_counter() - t0
            c = tier.cache(ids)
            model(input_ids=ids.to(dev), use_cache=True, logits_to_keep=1, **{kw: c})
            c.release()
            tier.controller.wait_idle()
            keys = page_hashes(ids[0, : n * ps].tolist(), ps)
            ctrl = tier.controller
            real_plan = ctrl.plan_restore
            heads = [int(x) for x in a.heads.split(",")] if a.heads else [0, n // 4, n // 2, 5 * n // 8, 3 * n // 4,
                                                                           7 * n // 8, n - 4, n]
            if any(not 0 <= j <= n for j in heads):
                raise SystemExit(f"--heads: every head must be in [0, {n}] pages")
            for j in sorted(set(heads)):
                ttfts, caches, rests, lines = [], [], [], []
                # the first is a warm-up of the shape; with --trace one more, recorded and left out of the medians
                for rep in range(a.reps + 1 + bool(a.trace)):
                    traced = bool(a.trace) and rep == a.reps + 1
                    tier.drop_host_copies()
                    # the tail's read alone
                    if rep == 0 and j < n:
                        starts = ctrl.allocate(n - j)
                        slots = ctrl._slots(starts)
                        t0 = time.perf_counter()
                        ok = tier.page_store.batch_get_v1(keys[j:], slots)
                        read_s = time.perf_counter() - t0
                        ctrl.free(starts)
                        assert all(ok)
                    est = real_plan(keys, ids.shape[1])  # the planner's own model of this prefix (for its numbers)
                    if j < n:  # recompute [0, j), load [j, n)
                        plan = RestorePlan(ids.shape[1], ps, 0, j, n, [("disk", n - j)], None, est.recompute_s,
                                           "load" if j == 0 else "split", n)
                    else:
                        plan = RestorePlan(ids.shape[1], ps, 0, 0, 0, [], None, est.recompute_s, "recompute", n)
                    ctrl.plan_restore = lambda *x, _p=plan, **y: _p
                    sync()
                    prof = None
                    if traced:
                        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                            [torch.profiler.ProfilerActivity.CUDA] if dev == "cuda" else []))
                        prof.__enter__()
                    marks: dict = {}
                    if dev == "cuda":
                        marks["start"] = torch.cuda.current_stream().record_event(torch.cuda.Event(enable_timing=True))
                    t0 = time.perf_counter()
                    c = tier.cache(ids)
                    t1 = time.perf_counter()
                    if dev == "cuda":
                        st = tier._state
                        marks["head_end"] = st.head_stream().record_event(torch.cuda.Event(enable_timing=True))
                        loads = getattr(st, "_tail_stream", None) or st.stream  # (the tail stream: window all)
                        marks["loads_end"] = loads.record_event(torch.cuda.Event(enable_timing=True))
                        if c._restorer.tail is not None:
                            c._restorer.tail.future.add_done_callback(lambda _f, _m=marks: _m.setdefault("read_t", time.perf_counter()))
                    model(input_ids=ids[:, c.get_seq_length():].to(dev), use_cache=True, logits_to_keep=1, **{kw: c})
                    t_queued = time.perf_counter()  # the host has queued the rest's forward
                    if dev == "cuda":
                        marks["end"] = torch.cuda.current_stream().record_event(torch.cuda.Event(enable_timing=True))
                    sync()
                    t2 = time.perf_counter()
                    if prof is not None:
                        prof.__exit__(None, None, None)
                        os.makedirs(a.trace, exist_ok=True)
                        prof.export_chrome_trace(os.path.join(a.trace, f"split-j{j}.json.gz"))
                    if dev == "cuda" and rep and not traced:
                        line = {k: marks["start"].elapsed_time(marks[k]) for k in ("head_end", "loads_end", "end")}
                        line["read_done"] = (marks["read_t"] - t0) * 1e3 if "read_t" in marks else None
                        line["rest_queued"] = (t_queued - t0) * 1e3  # (host clock, like read_done)
                        lines.append(line)
                    ctrl.plan_restore = real_plan
                    c.release()
                    tier.controller.wait_idle()
                    if rep and not traced:
                        ttfts.append(t2 - t0)
                        caches.append(t1 - t0)
                        rests.append(t2 - t1)
                pm = ctrl.prefill
                head_pred = pm.seconds(j * ps, 0) if j < n else None
                read_pred = ctrl.measured()["disk"].read_s((n - j) * ctrl.page_bytes) if j < n else 0.0
                rest_pred = pm.seconds(ids.shape[1] - n * ps, n * ps) if j < n else pm.seconds(ids.shape[1], 0)
                row = dict(j=j, ttft_s=statistics.median(ttfts), cache_s=statistics.median(caches),
                           rest_s=statistics.median(rests), tail_read_alone_s=read_s if j < n else 0.0,
                           head_pred_s=head_pred, read_pred_s=read_pred, rest_pred_s=rest_pred)
                if lines:
                    row["timeline_ms"] = {k: (statistics.median(x[k] for x in lines) if lines[0][k] is not None else None)
                                          for k in lines[0]}
                out["rows"].append(row)
                print({k: (round(v * 1e3, 1) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        out["disk"] = ctrl.measured()["disk"].__dict__
        out["prefill"] = ctrl.prefill.coefficients()
        print("recompute", round(out["recompute_s"] * 1e3, 1), "disk", out["disk"], "prefill", out["prefill"])
        tier.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
