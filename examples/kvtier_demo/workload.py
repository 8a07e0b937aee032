"""The multi-turn workload of ``python -m kvtier_demo``: conversations sharing a system prompt, each turn
extending its conversation, served with prefix reuse through kvtier — on a real architecture, transformers'
``LlamaForCausalLM`` built from a small config (random seeded weights, nothing downloaded) behind
:class:`kvtier.integrations.transformers.KVTier`; or, where transformers is not installed, on a toy
transformer (:class:`TinyModel`, asymmetric K/V head dims) through :class:`kvtier.TierController`.

Prompts are computed in page-aligned chunks (one page of tokens per forward; the toy model: one token), so a
suffix computed after a restored prefix goes through exactly the operations a fresh recomputation does:
every restored prefix's KV and every output are compared bit for bit with a recomputation (transformers'
default ``DynamicCache``, chunk for chunk).

The host pool holds less than the working set, so pages flow GPU → host → disk and back: a request's prefix
is found on the host (a host hit), in the store (a disk hit, read into the host pool first), in the cluster
tier (``cluster``), or recomputed.
"""

from __future__ import annotations

import importlib.util
import math
import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from kvtier import DeviceKVPool, InvalidArgumentError, PageStore, TierController, host_pool_for, page_hashes
from kvtier._cleanup import remove_tree
from kvtier._progress import Progress


@dataclass
class Geometry:
    layers: int = 4
    heads: int = 2
    k_dim: int = 48  # MiMo-V2's 192 / 128, scaled down by 4
    v_dim: int = 32
    hidden: int = 128
    vocab: int = 512
    page_size: int = 16


class TinyModel:
    """Random-weight decoder (deterministic seed): embeddings, per layer q/k/v projections with K and V of
    different head dims, softmax attention over the KV cache, an output projection and a residual MLP."""

    def __init__(self, g: Geometry, device: str, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)

        def w(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen) * scale / math.sqrt(shape[0])).to(device)

        self.g, self.device = g, device
        self.emb = w(g.vocab, g.hidden, scale=math.sqrt(g.vocab))
        self.wq = [w(g.hidden, g.heads * g.k_dim) for _ in range(g.layers)]
        self.wk = [w(g.hidden, g.heads * g.k_dim) for _ in range(g.layers)]
        self.wv = [w(g.hidden, g.heads * g.v_dim) for _ in range(g.layers)]
        self.wo = [w(g.heads * g.v_dim, g.hidden) for _ in range(g.layers)]
        self.w1 = [w(g.hidden, 2 * g.hidden) for _ in range(g.layers)]
        self.w2 = [w(2 * g.hidden, g.hidden) for _ in range(g.layers)]
        self.head = w(g.hidden, g.vocab)

    def step(self, token: int, pos: int, pool: DeviceKVPool, rows: torch.Tensor) -> torch.Tensor:
        """Process the token at position ``pos`` whose KV goes to device row ``rows[pos]``; attends to rows
        ``rows[: pos + 1]``. Returns the logits."""
        g = self.g
        x = self.emb[token][None]  # (1, hidden)
        r = rows[pos : pos + 1]
        ctx = rows[: pos + 1]
        for layer in range(g.layers):
            q = (x @ self.wq[layer]).view(g.heads, g.k_dim)
            pool.k_buffer[layer][r] = (x @ self.wk[layer]).view(1, g.heads, g.k_dim)
            pool.v_buffer[layer][r] = (x @ self.wv[layer]).view(1, g.heads, g.v_dim)
            k = pool.k_buffer[layer][ctx]  # (T, H, Dk)
            v = pool.v_buffer[layer][ctx]  # (T, H, Dv)
            att = torch.softmax(torch.einsum("hd,thd->ht", q, k) / math.sqrt(g.k_dim), dim=-1)
            o = torch.einsum("ht,thd->hd", att, v).reshape(1, -1)
            x = x + o @ self.wo[layer]
            x = x + torch.relu(x @ self.w1[layer]) @ self.w2[layer]
        return (x @ self.head)[0]


def conversations(n_conv: int, turns: int, g: Geometry, seed: int) -> list[list[int]]:
    """Requests (token lists): ``n_conv`` conversations sharing a system prompt, each turn extending its
    conversation; interleaved across conversations so the host pool cannot keep them all."""
    gen = torch.Generator().manual_seed(seed + 1)

    def toks(n):
        return torch.randint(1, g.vocab, (n,), generator=gen).tolist()

    system = toks(3 * g.page_size)
    ctx = [system + toks(2 * g.page_size) for _ in range(n_conv)]
    out = []
    for _ in range(turns):
        for c in range(n_conv):
            ctx[c] = ctx[c] + toks(2 * g.page_size + 5)  # the user's turn (+ last answer)
            out.append(list(ctx[c]))
    return out


def run_workload(
    *,
    device: str,
    model: str = "auto",
    n_conv: int | None = None,
    turns: int | None = None,
    host_pages: int = 12,
    seed: int = 0,
    store_dir: str | None = None,
    keep: bool = False,
    io_backend: str = "direct",
    quiet: bool = False,
    cluster: str | None = None,
    restore: str = "plan",
    window: int | None = None,
) -> dict:
    """Serve the workload; verify every reused prefix bit for bit; return the measurements. ``model``:
    ``"llama"`` (transformers), ``"toy"`` or ``"auto"`` (llama where transformers is installed). With
    ``cluster`` (a Mooncake master's address) the store is the tier chain local disk → cluster (kvtier.tiers),
    and a prefix served by the cluster counts as a ``cluster hit``. ``restore``: the transformers tier's restore
    mode (``"plan"``: decided with measurements; ``"all"``: every cached page loaded); ``window``: its layers
    kept on the device (None: KVTier's default, sized from free device memory; 0: every layer). ``n_conv``,
    ``turns``: conversations and rounds (None: the Llama workload's defaults for ``device``, 3 and 3 for the
    toy)."""
    if model not in ("auto", "llama", "toy"):
        raise InvalidArgumentError(f"invalid argument `model`: {model!r}; expected 'auto', 'llama' or 'toy'")
    if model == "auto":
        model = "llama" if importlib.util.find_spec("transformers") is not None else "toy"
    if model == "toy" and window is not None:
        raise InvalidArgumentError("invalid argument `window`: the toy model streams no layers (install transformers "
                                   "for the Llama workload)")
    if model == "llama":
        from .workload_transformers import run

        return run(device=device, n_conv=n_conv, turns=turns, seed=seed, store_dir=store_dir, keep=keep, quiet=quiet,
                   cluster=cluster, restore=restore, window=window)
    g = Geometry()
    n_conv, turns = 3 if n_conv is None else n_conv, 3 if turns is None else turns
    reqs = conversations(n_conv, turns, g, seed)
    max_tokens = max(len(r) for r in reqs)
    dev_pages = max_tokens // g.page_size + 2
    toy = TinyModel(g, device, seed)
    dp = DeviceKVPool(dev_pages * g.page_size, g.page_size, g.layers, g.heads, g.k_dim, g.v_dim, torch.float32, device)
    scratch = DeviceKVPool(dev_pages * g.page_size, g.page_size, g.layers, g.heads, g.k_dim, g.v_dim, torch.float32, device)
    hp = host_pool_for(dp, host_size_gb=host_pages * g.page_size * (g.k_dim + g.v_dim) * g.heads * g.layers * 4 / 1e9 * 0.999,
                       layout="page_first_direct")
    root = store_dir or tempfile.mkdtemp(prefix="kvtier-demo-", dir=os.getcwd())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            store = PageStore(root, capacity_bytes=1 << 30, model_name="demo/tiny-mimo")
            store.register_mem_pool_host(hp)
    except BaseException:  # (a Ctrl-C while the store opens included): nothing left behind
        hp.close()
        if store_dir is None:
            remove_tree(root)
        raise
    chain = None
    if cluster is not None:
        from kvtier.tiers import TieredStore
        from kvtier.tiers.mooncake import MooncakeTier

        try:
            remote = MooncakeTier(cluster, model_name="demo/tiny-mimo")
            remote.register_mem_pool_host(hp)
        except BaseException:
            store.close()
            hp.close()
            raise
        chain = TieredStore([("disk", store), ("mooncake", remote)])
    ctrl = TierController(dp, hp, chain or store, io_backend=io_backend, write_policy="write_through")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = torch.arange(g.page_size, (dev_pages) * g.page_size, device=device)  # skip the padding page
    rows_cpu = rows.cpu()
    results = []
    failures = []
    bar = Progress(len(reqs), "serving")
    try:
        for i, tokens in enumerate(reqs):
            n_pages = len(tokens) // g.page_size
            keys = page_hashes(tokens[: n_pages * g.page_size], g.page_size)
            sync()
            t0 = time.perf_counter()
            host_hit, disk_hit = ctrl.match(keys)
            remote_before = _remote_hits(chain)
            if disk_hit:
                ctrl.prefetch(keys[: host_hit + disk_hit]).result()
            from_cluster = _remote_hits(chain) > remote_before
            have, _ = ctrl.match(keys)
            cached = have * g.page_size
            if have:
                load = ctrl.load(keys[:have], rows_cpu[:cached])
                for layer in range(g.layers):
                    load.wait(layer)
            sync()
            t_restored = time.perf_counter()
            logits = None
            for pos in range(cached, len(tokens)):
                logits = toy.step(tokens[pos], pos, dp, rows)
            sync()
            ttft = time.perf_counter() - t0
            source = ("cluster hit" if from_cluster and have > host_hit else "disk hit" if disk_hit and have > host_hit
                      else "host hit" if have else "recomputed")
            # verification: a fresh recomputation of the whole prompt, compared bit for bit (its prefix part
            # timed: what recomputing the restored pages would have cost instead)
            t1 = time.perf_counter()
            for pos in range(len(tokens)):
                if pos == cached:
                    sync()
                    prefix_recompute = time.perf_counter() - t1
                ref = toy.step(tokens[pos], pos, scratch, rows)
            ok_kv = all(
                torch.equal(dp.k_buffer[layer][rows[:cached]], scratch.k_buffer[layer][rows[:cached]])
                and torch.equal(dp.v_buffer[layer][rows[:cached]], scratch.v_buffer[layer][rows[:cached]])
                for layer in range(g.layers)
            )
            ok_out = logits is not None and torch.equal(logits, ref)
            if not (ok_kv and ok_out):
                failures.append((i, source, ok_kv, ok_out))
            results.append(dict(request=i, tokens=len(tokens), cached_pages=have, host_hit=min(host_hit, have),
                                disk_hit=max(0, have - host_hit), source=source, ttft_s=ttft,
                                restore_s=t_restored - t0, suffix_s=ttft - (t_restored - t0),
                                prefix_recompute_s=prefix_recompute if cached else 0.0, kv_exact=ok_kv,
                                output_exact=ok_out))
            # back the request's full pages up (device -> host -> disk, write-through)
            ctrl.backup(rows_cpu[: n_pages * g.page_size], keys)
            ctrl.wait_idle()
            bar.update(i + 1)
    finally:
        bar.close()
        ctrl.close()
        store_stats = store.get_stats()
        tier_stats = chain.get_stats() if chain is not None else None
        (chain or store).close()
        hp.close()
        if not keep and store_dir is None:
            remove_tree(root)
    out = dict(results=results, failures=failures, stats=ctrl.stats, store=store_stats, root=root if keep else None,
               page_bytes=ctrl.page_bytes, page_size=g.page_size, tiers=tier_stats, model="toy")
    if not quiet:
        print_report(out)
    return out


def llama_config(device: str) -> Any:
    """The demo's Llama on ``device`` (see :mod:`kvtier_demo.workload_transformers`)."""
    from .workload_transformers import llama_config as config

    return config(device)


def _remote_hits(chain: object) -> int:
    """Pages the cluster tier of a tier chain has served so far (0 without one)."""
    if chain is None:
        return 0
    return int(chain.get_stats()["mooncake"]["hits"])  # type: ignore[attr-defined]


def print_report(out: dict) -> None:
    res = out["results"]
    by: dict = {}
    for r in res:
        by.setdefault(r["source"], []).append(r)

    def mean_ms(rows, key):
        return 1e3 * sum(r[key] for r in rows) / len(rows)

    if out.get("model") == "llama":
        print("\nTTFT = restoring the cached prefix (match; for a disk hit, reading its pages into the host pool) + "
              "computing the rest of the prompt\n(the prefix's KV streams to the device layer by layer during it).")
    else:
        print("\nTTFT = restoring the cached prefix (match, prefetch from disk, per-layer load) + computing the rest "
              "of the prompt.")
    print("Prompts differ in length and in how much of them is cached, so compare `restore` with "
          "`recompute instead`:\nthe same prefix recomputed (timed in the verification pass).")
    print(f"{'source':<12} {'requests':>8} {'mean TTFT':>11} {'restore':>10} {'rest of prompt':>15} "
          f"{'cached tokens':>14} {'recompute instead':>18}")
    for src in ("recomputed", "host hit", "disk hit", "cluster hit"):
        if src in by:
            rows = by[src]
            cached = sum(r["cached_pages"] for r in rows) * out["page_size"] / len(rows)
            alt = f"{mean_ms(rows, 'prefix_recompute_s'):>15.1f} ms" if cached else f"{'-':>18}"
            print(f"{src:<12} {len(rows):>8} {mean_ms(rows, 'ttft_s'):>8.1f} ms {mean_ms(rows, 'restore_s'):>7.1f} ms "
                  f"{mean_ms(rows, 'suffix_s'):>12.1f} ms {cached:>14.0f} {alt}")
    total_pages = sum(r["tokens"] // out["page_size"] for r in res)
    host = sum(r["host_hit"] for r in res)
    disk = sum(r["disk_hit"] for r in res)
    cluster = sum(r["disk_hit"] for r in res if r["source"] == "cluster hit")
    print(f"pages needed {total_pages}: {host} from host ({100 * host / total_pages:.0f}%), "
          f"{disk - cluster} from disk ({100 * (disk - cluster) / total_pages:.0f}%), "
          + (f"{cluster} from the cluster ({100 * cluster / total_pages:.0f}%), " if out.get("tiers") else "")
          + f"{total_pages - host - disk} recomputed")
    st = out["stats"]
    s = out["store"]
    if out.get("model") == "llama":
        t = out["transformers"]
        print(f"kvtier cache: {t['layer_loads']} per-layer loads host->device (2 of {out['config'].num_hidden_layers} "
              f"layers on the device at a time), {t['adopted_pages']} full pages kept for reuse")
        moved = ""
    else:
        moved = (f"device->host {st.bytes_device_to_host / 1e6:.1f} MB, host->device {st.bytes_host_to_device / 1e6:.1f} MB, ")
    print(f"bytes moved: {moved}"
          f"host->disk {s['bytes_written'] / 1e6:.1f} MB at {1e3 * s['write_GBps']:.0f} MB/s (durable, small pages), "
          f"disk->host {s['bytes_read'] / 1e6:.1f} MB at {1e3 * s['read_GBps']:.0f} MB/s; host evictions {st.host_evictions}")
    ok = not out["failures"]
    print(f"verification: restored KV bit-identical to recomputed KV and outputs equal for all {len(res)} requests: {ok}")
