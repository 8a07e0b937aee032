"""The demo's workload on a real architecture: transformers' ``LlamaForCausalLM`` (random seeded weights from a
config, nothing downloaded) served through :class:`kvtier.integrations.transformers.KVTier`, every request
timed with kvtier and with no tier (the same whole prompt in one forward with transformers' default
``DynamicCache``, timed just before and just after kvtier: their mean is the comparison, their difference the
noise), so the report says whether kvtier made each request faster or slower.

**The workload** is multi-turn chat shaped like SGLang's HiCache benchmark (``benchmark/hicache/bench_multiturn.py``,
whose defaults are 5 rounds per conversation, 512 tokens of user request per round, 64 tokens of answer, and a
ready queue served in random order): every conversation starts from a system prompt all of them share, and each
round appends the last answer and a new request to its history. Conversations are served in a random order
(the next request of a random conversation that has rounds left), one request at a time, and there are more of
them than the host pool holds, so some histories come back from the disk (or the cluster tier), or are
recomputed — whichever kvtier's restore planner predicts fastest from what it measured (``restore="plan"``).
The answers are stand-in tokens (nothing is decoded: time to first token is what is measured), so their KV is
computed with the next request, as an engine that does not cache its decoded tokens would. On the CPU the
sizes are a quarter of the GPU's (:data:`SIZES`), so CI's run stays short; on a GPU the model is Llama-3.1-8B's
shape.

Checks, per request: every page kvtier reused (from the host, the disk or the cluster) holds exactly the bytes
computed for it when it was stored (a checksum taken then, compared now), and the first token equals
the one the no-tier run computes (its logits are reported against no tier's: other chunkings of the same
prompt round differently)."""

from __future__ import annotations

import gc
import logging
import os
import tempfile
import time
import warnings
import zlib
from typing import Any

import torch

from kvtier._cleanup import remove_tree
from kvtier._progress import Progress

#: Per device: the model config, tokens per page, and the chat workload (tokens): the shared system prompt,
#: each round's user request and the answer appended after it, rounds and conversations by default, and the
#: host pool's pages (less than the conversations' histories together). The GPU's request, answer and rounds
#: are bench_multiturn's defaults; the CPU's a quarter of them.
SIZES: dict[str, dict[str, Any]] = {
    "cpu": dict(config=dict(num_hidden_layers=4, hidden_size=512, intermediate_size=2816, num_attention_heads=8,
                            num_key_value_heads=2, vocab_size=4096, max_position_embeddings=8192),
                page_size=32, system=384, request=128, output=16, rounds=5, conversations=8, host_pages=120),
    # Llama-3.1-8B's shape (vocabulary cut to 32K: only the last position's logits are computed); the host pool
    # holds about two thirds of the histories
    "cuda": dict(config=dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                             num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, rope_theta=500000.0,
                             rms_norm_eps=1e-5),
                 page_size=64, system=2048, request=512, output=64, rounds=5, conversations=16, host_pages=480),
    # a GPU with less than SMALL_GPU_BELOW of memory (the 8B model's bf16 weights alone are 14.5 GB, 7.24 billion
    # parameters with this vocabulary; its prefill needs more, and a busy or shared GPU has less free): a 1.2B
    # model with the same workload
    "cuda-small": dict(config=dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192,
                                   num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                                   max_position_embeddings=32768),
                       page_size=64, system=2048, request=512, output=64, rounds=5, conversations=16, host_pages=480),
}
#: total device memory below which the demo serves the 1.2B model (``"cuda-small"``): a 32 GB card and
#: smaller (a "40 GB" A100 reports about 39.4 GiB and serves the 8B one)
SMALL_GPU_BELOW = 36 << 30


def size_key(device: str, total_memory: int | None = None) -> str:
    """Which :data:`SIZES` entry serves on ``device`` (``total_memory``: the GPU's bytes; default: asked of torch)."""
    if device != "cuda":
        return "cpu"
    if total_memory is None:
        total_memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return "cuda" if total_memory >= SMALL_GPU_BELOW else "cuda-small"
#: logits of the same prompt computed in other chunks differ by rounding; more than this is a wrong output
LOGIT_TOLERANCE = {"cpu": 1e-3, "cuda": 0.5}
#: ... and so does KV: a page another node stored (no checksum of it here) is compared with no tier's KV
KV_TOLERANCE = {"cpu": 1e-4, "cuda": 0.05}


def llama_config(device: str) -> Any:
    from transformers import LlamaConfig

    cfg = LlamaConfig(**SIZES[size_key(device)]["config"])
    cfg._attn_implementation = "sdpa"
    return cfg


def conversations(n_conv: int, turns: int, s: dict[str, Any], vocab: int, seed: int) -> list[dict[str, Any]]:
    """The requests, in the order they are served: ``n_conv`` conversations of ``turns`` rounds (see the module
    docs) with the sizes ``s`` (a :data:`SIZES` entry), each request ``dict(conversation, turn, tokens)`` (turns
    counted from 1). The next request is that of a conversation picked at random among those with rounds left."""
    gen = torch.Generator().manual_seed(seed + 1)

    def toks(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=gen).tolist()

    system = toks(s["system"])
    history = [list(system) for _ in range(n_conv)]
    done = [0] * n_conv
    out: list[dict[str, Any]] = []
    while len(out) < n_conv * turns:
        ready = [c for c in range(n_conv) if done[c] < turns]
        c = ready[int(torch.randint(len(ready), (1,), generator=gen))]
        if done[c]:
            history[c] += toks(s["output"])  # the answer to the last request
        history[c] += toks(s["request"])
        done[c] += 1
        out.append(dict(conversation=c, turn=done[c], tokens=list(history[c])))
    return out


def _page_sum(tier: Any, start: int) -> int:
    """Checksum of the host bytes (K and V, every layer) of the page at host slot ``start``."""
    p = start // tier.page_size
    kb = tier.host.k_buffer[p].contiguous().view(torch.uint8).numpy().tobytes()
    vb = tier.host.v_buffer[p].contiguous().view(torch.uint8).numpy().tobytes()
    return zlib.crc32(vb, zlib.crc32(kb))


#: why the workload turns cuDNN's attention off on CUDA (printed with the results)
CUDNN_NOTE = ("attention: PyTorch's SDPA without its cuDNN backend, for kvtier and no tier alike (cuDNN builds a plan "
              "for every new pair of query and key lengths, up to 0.8 s the first time on the H200: a restored "
              "prefix's forward has a pair no recompute had, so the demo would time plan building, not tiers)")


def run(*, device: str, n_conv: int | None, turns: int | None, seed: int, store_dir: str | None, keep: bool,
        quiet: bool, cluster: str | None, restore: str = "plan", window: int | None = None) -> dict:
    """Serves the workload (see the module docs) and returns its measurements; prints the report unless
    ``quiet``. ``n_conv``, ``turns``: conversations and rounds (None: :data:`SIZES`' for ``device``).
    ``window``: layers the KVTier keeps on the device (None: KVTier's default, ``"auto"``; 0 or more than the
    model's layers: every layer). On CUDA, cuDNN's SDPA backend is off while it runs
    (:data:`CUDNN_NOTE`)."""
    cudnn = device == "cuda" and torch.backends.cuda.cudnn_sdp_enabled()
    if cudnn:
        torch.backends.cuda.enable_cudnn_sdp(False)
    # the planner's warning for each slow plan is the report's count instead (its line would split the progress bar)
    planner_log = logging.getLogger("kvtier.planner")
    level = planner_log.level
    planner_log.setLevel(logging.ERROR)
    try:
        out = _run(device=device, n_conv=n_conv, turns=turns, seed=seed, store_dir=store_dir, keep=keep, quiet=True,
                   cluster=cluster, restore=restore, window=window)
    finally:
        planner_log.setLevel(level)
        if cudnn:
            torch.backends.cuda.enable_cudnn_sdp(True)
    out["attention_note"] = CUDNN_NOTE if cudnn else None
    if not quiet:
        report(out)
    return out


def _run(*, device: str, n_conv: int | None, turns: int | None, seed: int, store_dir: str | None, keep: bool,
         quiet: bool, cluster: str | None, restore: str = "plan", window: int | None = None) -> dict:
    from transformers import DynamicCache, LlamaForCausalLM

    from kvtier.integrations.transformers import KVTier

    cfg = llama_config(device)
    s = SIZES[size_key(device)]
    ps = s["page_size"]
    n_conv = s["conversations"] if n_conv is None else n_conv
    turns = s["rounds"] if turns is None else turns
    served = conversations(n_conv, turns, s, cfg.vocab_size, seed)
    reqs = [r["tokens"] for r in served]
    fixed = None if window is None else cfg.num_hidden_layers if not window or window > cfg.num_hidden_layers else window
    torch.manual_seed(seed)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if device == "cuda" else torch.float32)  # made in its own dtype
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old_dtype)
    model.train(False)  # inference mode (no dropout)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    # a time to first token ends when the first token's logits are done (the model's stream); kvtier's backups
    # still running on its transfer stream are not in it: the device is synchronized after, untimed
    first_token = torch.cuda.current_stream().synchronize if device == "cuda" else (lambda: None)
    max_pages = max(len(r) for r in reqs) // ps + 1
    root = store_dir or tempfile.mkdtemp(prefix="kvtier-demo-", dir=os.getcwd())

    @torch.no_grad()
    def first_logits(ids: torch.Tensor, cache: Any) -> torch.Tensor:
        return model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1].float()

    with torch.no_grad():  # untimed warm-up (kernels, allocator) up to the longest prompt, outside any kvtier cache
        longest = max(len(r) for r in reqs)
        for n in (ps, 4 * ps, longest // 2, longest):
            first_logits(torch.randint(1, cfg.vocab_size, (1, n), device=device), DynamicCache(config=cfg))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            tier = KVTier(model, model_id=f"kvtier-demo/random-llama-{device}-seed{seed}", page_size=ps,
                          window="auto" if fixed is None else fixed,
                          host_tokens=max(s["host_pages"], max_pages + 1) * ps, store_dir=root,
                          store_capacity_bytes=4 << 30, cluster=cluster, restore=restore)
    except BaseException:
        if store_dir is None:
            remove_tree(root)
        raise
    if restore == "plan":  # the same warm-up through kvtier's cache (nothing of it kept), timed for the planner
        tier.calibrate([longest // 2, longest])
    # after warm-up the heap is frozen, as serving engines do (vLLM's freeze_gc_heap, SGLang's freeze_gc): a full
    # collection walks every object torch and transformers made (tens of milliseconds) and lands on one request
    gc.collect()
    gc.freeze()
    pauses = GcPauses()
    chain = tier.store if cluster is not None else None
    results: list[dict] = []
    failures: list[tuple] = []
    sums: dict[str, int] = {}  # page key -> checksum of its bytes when it was first kept
    bar = Progress(len(reqs), "serving")
    try:
        for i, tokens in enumerate(reqs):
            ids = torch.tensor([tokens], device=device)

            def no_tier(ids: torch.Tensor = ids) -> tuple[float, torch.Tensor, Any]:
                """The whole prompt in one forward, transformers' default cache."""
                ref = DynamicCache(config=cfg)
                sync()
                t0 = time.perf_counter()
                logits = first_logits(ids, ref)
                first_token()
                return time.perf_counter() - t0, logits, ref

            # no tier is timed before and after kvtier (the machine's drift and noise show in their difference)
            none_a, want, ref = no_tier()
            # kvtier: restore as planned, then the rest of the prompt in one forward
            remote_before = _remote_hits(chain)
            sync()
            gc_before = pauses.total
            t0 = time.perf_counter()
            cache = tier.cache(tokens)
            made = time.perf_counter()
            got = first_logits(ids[:, cache.get_seq_length():], cache)
            first_token()
            kvtier_s = time.perf_counter() - t0
            gc_s = pauses.total - gc_before
            sync()  # (kvtier's backups of the new pages, which a server overlaps with sending the token: untimed)
            none_b, _, _ = no_tier()
            none_s = (none_a + none_b) / 2
            plan = cache.plan
            loaded = dict(plan.load) if plan is not None else {}
            from_cluster = _remote_hits(chain) > remote_before
            source = ("recomputed" if cache.restored_tokens == 0 else
                      "cluster hit" if from_cluster else "disk hit" if cache.restored_store_pages else "host hit")
            # the reused pages hold the bytes computed for them when they were first kept
            reused = [j for j in range(len(cache.table.keys)) if j < cache.restored_host_pages or
                      (plan is not None and plan.recompute_to <= j < plan.load_to and j < len(cache.table.keys))]
            tier.synchronize()
            ok_kv = all((key := cache.table.keys[j]) is not None and sums.get(key) == _page_sum(tier, cache.table.starts[j])
                        for j in reused if cache.table.keys[j] in sums)
            foreign = [j for j in reused if cache.table.keys[j] not in sums]  # stored by another node
            ok_kv = ok_kv and _close_to(cache, ref, foreign, ps, KV_TOLERANCE[device])
            diff = float((got - want).abs().max())
            # the first token: no tier's, or one whose no-tier logit is within the rounding of the best one (logits
            # that differ by at most `diff` can swap an argmax only between tokens within 2 * diff of each other;
            # a random model's logits are close to uniform, so such near-ties happen)
            picked = int(got.argmax())
            ok_out = diff <= LOGIT_TOLERANCE[device] and bool(want[picked] >= want.max() - 2 * diff)
            if not (ok_kv and ok_out):
                failures.append((i, source, ok_kv, ok_out))
            reused_set = set(reused)
            own = {k: cache.table.starts[j] for j, k in enumerate(cache.table.keys) if k is not None and j not in reused_set}
            cache.release()  # its full pages stay in the host pool (and go to the store) for the next requests
            tier.controller.wait_idle()
            _remember(tier, tokens, sums, own)
            results.append(dict(request=i, conversation=served[i]["conversation"], turn=served[i]["turn"],
                                tokens=len(tokens), window=cache.resident_layers, source=source, plan=plan.kind if plan else "all",
                                cached_pages=plan.cached_pages if plan else cache.restored_tokens // ps,
                                host_hit=cache.restored_host_pages, disk_hit=cache.restored_store_pages,
                                recomputed_head=cache.recomputed_tokens, loaded=loaded,
                                predicted_s=plan.predicted_s if plan else None, candidates=plan.candidates if plan else {},
                                ttft_s=kvtier_s, no_tier_s=none_s, cache_s=made - t0, gc_s=gc_s,
                                no_tier_spread_s=abs(none_a - none_b),
                                max_logit_diff=diff, kv_exact=ok_kv, output_exact=ok_out))
            bar.update(i + 1)
    finally:
        pauses.close()
        gc.unfreeze()
        bar.close()
        tier.controller.wait_idle()
        tier.synchronize()
        store_stats = tier.page_store.get_stats() if tier.page_store is not None else {}
        tier_stats = chain.get_stats() if chain is not None else None
        ctrl = tier.controller
        planner = ctrl.planner_stats.as_dict()
        measured = {k: v.__dict__ for k, v in ctrl.measured().items()}
        prefill = ctrl.prefill.coefficients()
        stats = dict(vars(tier.stats))
        tier.close()
        if not keep and store_dir is None:
            remove_tree(root)
    out = dict(results=results, failures=failures, stats=ctrl.stats, store=store_stats, root=root if keep else None,
               page_bytes=ctrl.page_bytes, page_size=ps, tiers=tier_stats, model="llama", transformers=stats,
               config=cfg, planner=planner, measured=measured, prefill=prefill, device=device, restore=restore,
               window=window_of(results, cfg.num_hidden_layers), conversations=n_conv, turns=turns,
               sizes={k: v for k, v in s.items() if k != "config"})
    if not quiet:
        report(out)
    return out


class GcPauses:
    """The time Python's garbage collector has spent since it was made (:attr:`total`, seconds)."""

    def __init__(self) -> None:
        self.total, self._start = 0.0, 0.0
        gc.callbacks.append(self._seen)

    def _seen(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start:
            self.total += time.perf_counter() - self._start
            self._start = 0.0

    def close(self) -> None:
        if self._seen in gc.callbacks:
            gc.callbacks.remove(self._seen)


def window_of(results: list[dict], layers: int) -> int:
    """The layers kvtier kept on the device: the fewest any request had (every one, with room on the device)."""
    return min((r["window"] for r in results), default=layers)


def ratio_quantile(ratios: list[float], q: float) -> float:
    """The ``q`` quantile of ``ratios`` (nearest rank: a value some request had)."""
    r = sorted(ratios)
    return r[min(len(r) - 1, max(0, -(-int(q * 1000) * len(r) // 1000) - 1))]


def _close_to(cache: Any, ref: Any, pages: list[int], ps: int, tol: float) -> bool:
    """The cache's host KV of ``pages`` (every layer) within ``tol`` of no tier's KV for the same tokens."""
    if not pages:
        return True
    last = (max(pages) + 1) * ps
    for layer in range(len(ref.layers)):
        k, v = cache.host_kv(layer, last)
        rk, rv = ref.layers[layer].keys[..., :last, :].cpu(), ref.layers[layer].values[..., :last, :].cpu()
        for j in pages:
            sl = slice(j * ps, (j + 1) * ps)
            if not (torch.allclose(k[..., sl, :].float(), rk[..., sl, :].float(), atol=tol, rtol=0)
                    and torch.allclose(v[..., sl, :].float(), rv[..., sl, :].float(), atol=tol, rtol=0)):
                return False
    return True


def _remember(tier: Any, tokens: list[int], sums: dict[str, int], own: dict[str, int]) -> None:
    """Checksums of the pages of ``tokens`` the controller now keeps on the host: for pages not seen before, and
    for those this request computed and the controller took from it (``own``: key -> the request's host slot,
    refreshed only where the controller's page is that very slot). A page whose stored copy was lost or refused
    is computed again, and KV computed in another chunk of the prompt may differ in its last bits: the
    controller may then keep the new bytes, which later reuses must return."""
    from kvtier.store import page_hashes

    ps, ctrl = tier.page_size, tier.controller
    keys = page_hashes(tokens[: len(tokens) // ps * ps], ps)
    with ctrl.lock:
        held = [(k, ctrl.pages[k].start) for k in keys if k in ctrl.pages and ctrl.pages[k].ready
                and (k not in sums or own.get(k) == ctrl.pages[k].start)]
    for k, start in held:
        sums[k] = _page_sum(tier, start)


def _remote_hits(chain: Any) -> int:
    if chain is None:
        return 0
    return int(chain.get_stats()["mooncake"]["hits"])


def report(out: dict) -> None:
    res = out["results"]
    c = out["config"]
    z = out["sizes"]
    print(f"\nMulti-turn chat shaped like SGLang's bench_multiturn: {out['conversations']} conversations x "
          f"{out['turns']} rounds, a {z['system']}-token system prompt they share, {z['request']} tokens of request "
          f"and {z['output']} of answer per round, served one request at a time in a random order; the host pool "
          f"holds {z['host_pages'] * out['page_size']} tokens, less than the histories together.")
    print(f"Every request timed twice: with kvtier (its prefix restored as planned, then the rest of the prompt) "
          f"and with no tier\n(the whole prompt in one forward, transformers' DynamicCache). Model: LlamaForCausalLM "
          f"{c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_key_value_heads} KV heads, random weights; "
          f"kvtier keeps {'every layer' if out['window'] >= c.num_hidden_layers else str(out['window']) + ' layers'} "
          f"on the device.")
    if out.get("attention_note"):
        print(out["attention_note"])
    print(f"{'source':<12} {'requests':>8} {'prompt':>8} {'cached':>8} {'reused':>8} {'no tier':>10} {'kvtier':>10} "
          f"{'kvtier/no tier':>15} {'plans':>22}")
    for src in ("recomputed", "host hit", "disk hit", "cluster hit"):
        rows = [r for r in res if r["source"] == src]
        if not rows:
            continue
        n = len(rows)
        reused = sum(r["host_hit"] + r["disk_hit"] for r in rows) * out["page_size"] / n
        cached = sum(r["cached_pages"] for r in rows) * out["page_size"] / n
        none_ms = 1e3 * sum(r["no_tier_s"] for r in rows) / n
        kv_ms = 1e3 * sum(r["ttft_s"] for r in rows) / n
        ratios = sorted(r["ttft_s"] / r["no_tier_s"] for r in rows)
        plans: dict[str, int] = {}
        for r in rows:
            plans[r["plan"]] = plans.get(r["plan"], 0) + 1
        print(f"{src:<12} {n:>8} {sum(r['tokens'] for r in rows) / n:>8.0f} {cached:>8.0f} {reused:>8.0f} {none_ms:>7.1f} ms "
              f"{kv_ms:>7.1f} ms {ratios[len(ratios) // 2]:>14.2f}x {', '.join(f'{k} {v}' for k, v in plans.items()):>22}")
    skipped = [r for r in res if r["source"] == "recomputed" and r["cached_pages"]]
    if skipped:  # cached pages the planner chose not to use: what it predicted for each kind of plan
        kinds = sorted({k for r in skipped for k in r["candidates"]})
        print(f"recomputed although cached ({len(skipped)} requests), mean predicted TTFT by plan: " + ", ".join(
            f"{k} {1e3 * sum(r['candidates'].get(k, 0.0) for r in skipped) / len(skipped):.1f} ms" for k in kinds))
    print(f"\n{'round':<6} {'requests':>8} {'prompt':>8} {'no tier':>10} {'kvtier':>10} {'kvtier/no tier p50':>19} "
          f"{'p90':>6} {'worst':>6}   sources")
    for turn in sorted({r["turn"] for r in res}):
        rows = [r for r in res if r["turn"] == turn]
        ratios = [r["ttft_s"] / r["no_tier_s"] for r in rows]
        by_source: dict[str, int] = {}
        for r in rows:
            by_source[r["source"]] = by_source.get(r["source"], 0) + 1
        print(f"{turn:<6} {len(rows):>8} {sum(r['tokens'] for r in rows) / len(rows):>8.0f} "
              f"{1e3 * sum(r['no_tier_s'] for r in rows) / len(rows):>7.1f} ms "
              f"{1e3 * sum(r['ttft_s'] for r in rows) / len(rows):>7.1f} ms {ratio_quantile(ratios, 0.5):>18.2f}x "
              f"{ratio_quantile(ratios, 0.9):>5.2f}x {max(ratios):>5.2f}x   "
              + ", ".join(f"{k} {v}" for k, v in by_source.items()))
    total_none = sum(r["no_tier_s"] for r in res)
    total_kv = sum(r["ttft_s"] for r in res)
    ratios = [r["ttft_s"] / r["no_tier_s"] for r in res]
    worst = max(res, key=lambda r: r["ttft_s"] / r["no_tier_s"])
    speed = (f"{total_none / total_kv:.2f}x faster" if total_kv <= total_none else
             f"{total_kv / total_none:.2f}x slower")  # (a ratio under 1 printed as "faster" reads as a gain)
    print(f"kvtier: {speed} to first token than no tier over all {len(res)} requests "
          f"({1e3 * total_kv:.0f} ms against {1e3 * total_none:.0f} ms); per request, kvtier/no tier p50 "
          f"{ratio_quantile(ratios, 0.5):.2f}x, p90 {ratio_quantile(ratios, 0.9):.2f}x; worst request: "
          f"{worst['ttft_s'] / worst['no_tier_s']:.2f}x no tier's (request {worst['request']}, round {worst['turn']}, "
          f"{worst['source']}: {1e3 * worst['ttft_s']:.1f} ms against {1e3 * worst['no_tier_s']:.1f} ms, of which "
          f"{1e3 * worst.get('cache_s', 0.0):.1f} ms making its cache and {1e3 * worst.get('gc_s', 0.0):.1f} ms in "
          f"garbage collection); garbage collected during {sum(r.get('gc_s', 0.0) > 0 for r in res)} of {len(res)} requests")
    p = out["planner"]
    err = p["median_prediction_error"]
    m = out["measured"]
    slow = p.get("slow_plans") or {}
    print("measured tiers: " + ", ".join(f"{k} {v['read_GBps']:.2f} GB/s read ({v['source']})" for k, v in m.items())
          + (f"; planner's predicted TTFT within {100 * err:.0f}% of the observed (median)" if err is not None else "")
          + (f"; {sum(slow.values())} of {p['observed']} plans took more than 10% over their prediction ("
             + ", ".join(f"{k} {v}" for k, v in sorted(slow.items())) + ")" if slow else ""))
    if out.get("prefill"):
        a, b, c, d, e, f = out["prefill"]
        print(f"prefill model (learned): {1e3 * a:.2f} ms + {1e6 * b:.2f} us/token + {1e9 * e:.3f} ns x new^2/2 (no cache; "
              f"{1e9 * f:.3f} after one) + {1e9 * c:.3f} ns x new x cached + {1e6 * d:.3f} us/cached token")
    s = out["store"]
    print(f"disk: {s.get('bytes_written', 0) / 1e6:.1f} MB written, {s.get('bytes_read', 0) / 1e6:.1f} MB read; "
          f"host evictions {out['stats'].host_evictions}")
    ok = not out["failures"]
    print(f"verification: every reused page bit-identical to the bytes stored for it (within {KV_TOLERANCE[out['device']]} of "
          f"no tier's KV where another node stored it), and the first token no tier's (or tied with it within the logits' "
          f"rounding), for all {len(res)} "
          f"requests: {ok}")
    by_request = {r["request"]: r for r in res}
    for i, source, ok_kv, ok_out in out["failures"]:
        r = by_request.get(i, {})
        what = []
        if not ok_kv:
            what.append("a reused page differs from the bytes stored for it")
        if not ok_out:
            what.append(f"the first token or logits differ from no tier's (largest logit difference "
                        f"{r.get('max_logit_diff', float('nan')):.4g}, tolerance {LOGIT_TOLERANCE[out['device']]})")
        print(f"  request {i} ({source}, plan {r.get('plan')}): " + "; ".join(what))
