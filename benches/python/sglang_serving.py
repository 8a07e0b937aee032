"""Concurrent requests through SGLang's own HiCacheController with kvtier as L3: which default for the engine
planner (`restore_planner`) gives the better time to first token and throughput, under SGLang's prefetch
policies.

Every request has a prefix of ``--pages`` pages that an earlier server stored (written through to L3 by SGLang's
``write_storage``, then evicted from the host pool) and ``--new`` tokens of its own. ``--requests`` of them arrive
at once (a burst: that many clients of a multi-turn bench sending together). What stands in for SGLang's scheduler:
at arrival it asks the controller to prefetch each request (SGLang's prefetch thread calls kvtier's
``batch_exists``; the pages reported go through its IO thread's ``batch_get`` into the host pool); one worker (the
GPU) serves the requests first come, first served. When it reaches a request it stops the request's prefetch as
SGLang's radix cache does under the policy: ``best_effort`` (SGLang's default) terminates it and takes the pages
that have arrived, ``wait_complete`` waits for all of them. The pages taken go host -> device through SGLang's
``cc.load`` / ``start_loading``; the model (transformers' Llama, random weights, the KV shape of the pools) then
computes the rest of the prompt with those rows as its context (copied into a DynamicCache), and the first
token's logits end the request's time to first token (from the burst's start). Throughput: requests per second
over the burst. Where it differs from a server: one worker with batches of one request; the hit query is always
waited for (SGLang revokes a prefetch whose query has not returned); the loaded rows are copied into a DynamicCache;
on a machine where the compiled ``sgl_kernel`` does not import, its direct ops are kvtier's stand-in (per-page copies,
named in each JSON line); each burst runs once, after an untimed warm-up of the forwards (not of the load path).

Variants (the same store, written once): ``planner`` (kvtier's default: a stored page is reported only where
reading it is predicted faster than an engine producing 5 GB/s of KV recomputing it) and ``all``
(``restore_planner: false``), each under both policies. One JSON line per variant; ``--out`` collects them.

    python benches/python/sglang_serving.py --device cuda [--requests 8 --pages 32 --new 256]
    python benches/python/sglang_serving.py --device cpu --tiny      # this script's logic, a small model
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WAIT_S = 120.0


def llama(tiny: bool, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        cfg = LlamaConfig(num_hidden_layers=4, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=32000)
    else:  # Llama-3.1-8B's shape (the vocabulary cut to 32K: only the last position's logits are computed)
        cfg = LlamaConfig(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, rope_theta=500000.0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    return model


def fill_normal(host, indices, seed: int) -> None:
    """The host pages holding ``indices`` get KV-like values (normal, bf16) instead of random bytes (which hold
    NaNs: the forward's time would not change, its logits would)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    for p in sorted({int(i) // host.page_size for i in indices.tolist()}):
        for view in base.page_views(host, p):
            view.copy_((torch.randn(view.shape, generator=g) * 0.5).to(view.dtype))


def write_prefixes(cc, host, a) -> list[list[int]]:
    """Every request's prefix stored through SGLang's write_storage, then evicted from the host pool."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    prompts = []
    for r in range(a.requests):
        prefix = base.request_tokens(r, a.pages, a.page_size)
        idx = host.alloc(len(prefix))
        fill_normal(host, idx, seed=r)
        op_id = cc.write_storage(idx, prefix, hash_value=get_storage_hash_str(prefix, None, page_size=a.page_size))
        op = cc.ack_backup_queue.get(timeout=WAIT_S)
        if op.id != op_id or op.completed_tokens != len(prefix):
            raise SystemExit(f"backup of request {r}: {op.completed_tokens} of {len(prefix)} tokens written")
        host.free(idx)
        prompts.append(prefix + base.request_tokens(10_000 + r, 1, a.new))
    return prompts


class Prefetches:
    """The scheduler's side of the controller's prefetch queues for a burst: hits get host pages and go to the IO
    thread in arrival order; acks are tallied per request."""

    def __init__(self, cc, ps: int) -> None:
        self.cc, self.ps = cc, ps
        self.ops: dict[str, object] = {}
        self.idx: dict[str, object] = {}
        self.hit: dict[str, int] = {}
        self.done: dict[str, int] = {}
        self.finished: dict[str, threading.Event] = {}
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def start(self, rids_tokens: list[tuple[str, list[int]]]) -> None:
        for rid, _ in rids_tokens:
            self.finished[rid] = threading.Event()
            self.done[rid] = 0
        for rid, tokens in rids_tokens:
            self.ops[rid] = self.cc.prefetch(rid, tokens)
        threading.Thread(target=self._hits, args=(len(rids_tokens),), daemon=True, name="serving-hits").start()
        self._ack_thread = threading.Thread(target=self._acks, daemon=True, name="serving-acks")
        self._ack_thread.start()

    def close(self) -> None:
        """After every request was taken (each prefetch finished): the ack thread stops before the next burst."""
        self.stop.set()
        self._ack_thread.join(timeout=WAIT_S)

    def _hits(self, n: int) -> None:
        try:
            for _ in range(n):
                op = self.cc.prefetch_hit_queue.get(timeout=WAIT_S)
                rid = op.request_id
                if not op.storage_hit_count:
                    self.hit[rid] = 0  # (published last: take() reads idx once it sees hit)
                    self.finished[rid].set()
                    continue
                idx = self.cc.alloc_prefetch_host_buffers(op, op.storage_hit_count)
                if idx is None:
                    raise RuntimeError(f"{rid}: the host pool has no room for its {op.storage_hit_count} tokens")
                op.host_indices = idx
                op.hash_value = op.hash_value[: op.storage_hit_count // self.ps]
                self.idx[rid] = idx
                self.hit[rid] = op.storage_hit_count
                self.cc.prefetch_buffer.put(op)
        except BaseException as e:  # noqa: BLE001 - reported by the worker
            self.error = e
            for ev in self.finished.values():
                ev.set()

    def _acks(self) -> None:
        while not self.stop.is_set():
            try:
                ack = self.cc.ack_prefetch_queue.get(timeout=0.5)
            except Exception:  # noqa: BLE001 - queue.Empty
                continue
            if ack.completed_tokens is not None:
                self.done[ack.rid] = max(self.done[ack.rid], ack.completed_tokens)
            if ack.completed_req:
                self.finished[ack.rid].set()

    def take(self, rid: str, policy: str) -> int:
        """The tokens of ``rid``'s prefix in the host pool when the worker reaches it, under ``policy``:
        ``best_effort`` terminates the prefetch and takes the tokens acknowledged so far without waiting (as SGLang's
        radix cache does; the request's host pages are freed once its prefetch has finished, :meth:`finish`);
        ``wait_complete`` waits for the whole prefetch. (The hit query itself is always waited for.)"""
        while rid not in self.hit and self.error is None:
            time.sleep(0.0005)
        if self.error is not None:
            raise self.error
        if rid not in self.idx:
            return 0
        if policy == "best_effort":
            self.cc.terminate_prefetch(self.ops[rid])
            return self.done[rid]
        if not self.finished[rid].wait(WAIT_S):
            raise TimeoutError(f"{rid}: its prefetch never finished")
        if self.error is not None:
            raise self.error
        return self.done[rid]

    def finish(self, host) -> None:
        """Every prefetch of the burst finished, its host pages freed, the ack thread stopped."""
        for rid, ev in self.finished.items():
            if not ev.wait(WAIT_S):
                raise TimeoutError(f"{rid}: its prefetch never finished")
            if rid in self.idx:
                host.free(self.idx[rid])
        self.close()


def serve(cc, host, model, prompts: list[list[int]], a, variant: str, policy: str) -> dict:
    import torch
    from transformers import DynamicCache

    dev, ps, cuda = cc.mem_pool_device, a.page_size, a.device == "cuda"
    import sglang_controller_gpu as gpu
    sync = torch.cuda.current_stream().synchronize if cuda else (lambda: None)
    pf = Prefetches(cc, ps)
    rids = [(f"{variant}-{policy}-{r}", p) for r, p in enumerate(prompts)]
    rows = []
    t_start = time.perf_counter()
    pf.start(rids)
    for rid, tokens in rids:
        taken = pf.take(rid, policy)
        taken -= taken % ps
        cache = DynamicCache(config=model.config)
        if taken:
            new_idx = cc.load(pf.idx[rid][:taken])
            if new_idx is None:
                raise RuntimeError(f"{rid}: the device allocator has no {taken} free rows")
            producer = cc.start_loading()
            cc.layer_done_counter.set_consumer(producer)  # (each layer's getter waits for that layer's load)
            try:
                with torch.no_grad():
                    for layer in range(model.config.num_hidden_layers):
                        k = dev.get_key_buffer(layer)[new_idx].transpose(0, 1).unsqueeze(0)
                        v = dev.get_value_buffer(layer)[new_idx].transpose(0, 1).unsqueeze(0)
                        cache.update(k, v, layer)
            finally:
                cc.layer_done_counter.set_consumer(-1)
            gpu.take_ack(cc.ack_load_queue, "host -> device load")
            cc.mem_pool_device_allocator.free(new_idx)
        ids = torch.tensor([tokens[taken:]], device=a.device)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        sync()
        ttft = time.perf_counter() - t_start
        rows.append(dict(hit=pf.hit.get(rid, 0), taken=taken, computed=len(tokens) - taken, ttft_s=ttft))
    makespan = time.perf_counter() - t_start
    pf.finish(host)
    ttfts = sorted(r["ttft_s"] for r in rows)
    return dict(variant=variant, policy=policy, requests=len(rows), prompt_tokens=len(prompts[0]),
                reported_tokens=sum(r["hit"] for r in rows), loaded_tokens=sum(r["taken"] for r in rows),
                computed_tokens=sum(r["computed"] for r in rows), ttft_mean_s=statistics.mean(ttfts),
                ttft_p50_s=statistics.median(ttfts), ttft_max_s=ttfts[-1], requests_per_s=len(rows) / makespan,
                rows=rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a 4-layer model (this script's logic, on the CPU)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--pages", type=int, default=32, help="stored prefix pages per request")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--new", type=int, default=256, help="tokens of each request after its stored prefix")
    ap.add_argument("--variants", default="planner,all")
    ap.add_argument("--policies", default="best_effort,wait_complete")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import torch

    import sglang_controller_gpu  # (HERE is on sys.path: see the end of this module)

    if a.device == "cuda":
        info = sglang_controller_gpu.use_sgl_kernel()
        torch.backends.cuda.enable_cudnn_sdp(False)  # (as kvtier's demo: cuDNN plans every new pair of lengths)
    else:
        sglang_controller_gpu.inject_direct_ops()
        info = {"sgl_kernel": "stand-in (injected: CPU)"}
    model = llama(a.tiny, a.device)
    cfg = model.config
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads)
    root = a.dir or tempfile.mkdtemp(prefix="sglang-serving-")
    results = []
    prompts = None
    runs = [(v, p) for v in a.variants.split(",") for p in a.policies.split(",")]
    for variant, policy in runs:  # (each burst on a controller of its own: nothing of one burst left in the next)
        if variant not in ("planner", "all") or policy not in ("best_effort", "wait_complete"):
            ap.error(f"--variants/--policies: {variant!r}/{policy!r}")
        cc, host = base.build("kvtier", root, "page_first_direct", a.pages, 2 * a.requests, a.page_size,
                              variant == "planner", "mha", device=a.device, shape=shape)
        host.is_mla = False
        try:
            if prompts is None:
                prompts = write_prefixes(cc, host, a)
                with torch.no_grad():  # warm-up, untimed: the kernels of both forwards' shapes
                    for n in (len(prompts[0]), a.new):
                        model(input_ids=torch.ones((1, n), dtype=torch.long, device=a.device), use_cache=True,
                              logits_to_keep=1)
            row = serve(cc, host, model, prompts, a, variant, policy)
            row.update(info, device=torch.cuda.get_device_name() if a.device == "cuda" else "cpu", pages=a.pages,
                       page_size=a.page_size, new=a.new, shape=list(shape))
            print(json.dumps({k: v for k, v in row.items() if k != "rows"}), flush=True)
            results.append(row)
        finally:
            cc.storage_stop_event.set()
            if hasattr(cc.storage_backend, "close"):
                cc.storage_backend.close()
            if a.device == "cuda":
                host.destroy()
            import torch.distributed as dist

            dist.destroy_process_group()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


sys.path.insert(0, HERE)
import sglang_controller as base  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
