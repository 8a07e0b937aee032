"""The main job (``make demo`` / ``python -m kvtier_demo``): a short, verified tour of what kvtier does today.

1. Allocates a host buffer, views it from torch, and reports alignment, huge pages and pinning.
2. Builds a MiMo-like asymmetric KV cache (K 192, V 128, scaled down) and a DeepSeek-like MLA cache
   (kv_lora_rank 512 + qk_rope_head_dim 64; 61 layers on a GPU), backs every page up from the device pool
   to a host pool, wipes the device pool, loads it back layer by layer with both layouts and IO backends
   HiCache offers for these models, and checks every byte.
3. Spills the host pages to a PageStore on disk (keyed by SGLang-compatible page hashes), wipes host and
   device, reads them back from disk, loads them to the device, and checks every byte again.
4. Serves a multi-turn workload with transformers' real ``LlamaForCausalLM`` (random weights; sized per
   device so a prompt's prefill is real work) through kvtier's transformers cache, every restore decided
   by kvtier's planner (kvtier_demo.workload_transformers): each request is timed with kvtier and with no tier
   (the same prompt, transformers' default cache), by source (recomputed / host / disk / cluster), with one
   summary line (how much faster, and the worst request against no tier); every reused page is checked
   bit for bit against the bytes stored for it, and every first token against no tier's. Where
   transformers is not installed, a toy transformer is served through TierController instead.

Runs on the GPU when torch sees one, on the CPU otherwise; exits non-zero if any check fails.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
import warnings

import torch

from kvtier import DeviceKVPool, HostBuffer, MLADeviceKVPool, PageStore, __version__, device_layers, host_pool_for, page_hashes
from kvtier._cleanup import remove_tree


def _gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / max(seconds, 1e-9) / 1e9:6.2f} GB/s"


def _calm(fallback: str) -> str:
    """The huge-page fallback in one plain line: most machines reserve no explicit huge pages, and that is fine."""
    try:
        with open("/proc/sys/vm/nr_hugepages") as f:
            reserved = int(f.read().strip() or 0)
    except (OSError, ValueError):
        reserved = -1
    if reserved == 0 and "transparent huge pages" in fallback and "disabled" not in fallback:
        return "this machine reserves no explicit huge pages (vm.nr_hugepages = 0); transparent huge pages are used"
    return fallback


def run(layers: int = 8, pages: int = 32, page_size: int = 64, heads: int = 4, seed: int = 0, *,
        conversations: int | None = None, turns: int | None = None, keep: bool = False, store_dir: str | None = None,
        window: int | None = None) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"kvtier {__version__} demo on {device} (torch {torch.__version__})")

    with HostBuffer(64 << 20) as buf:
        t = buf.as_tensor(torch.bfloat16, (1024, 32768))
        t[0, :4] = torch.tensor([1.0, 2.0, 3.0, 4.0])
        same = buf.as_tensor(torch.bfloat16, (4,))
        ok = torch.equal(same, torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16))
        print(
            f"HostBuffer: {buf.nbytes >> 20} MiB, {buf.alignment}-byte aligned: {buf.ptr % buf.alignment == 0}, "
            f"pages={buf.page_kind}, pinned={buf.pinned}, torch view shares memory: {ok}"
        )
        if buf.huge_page_fallback:
            print(f"  huge pages: {_calm(buf.huge_page_fallback)}")
        if buf.pin_error:
            print(f"  pinning: {buf.pin_error}")
        if not ok:
            return 1

    failures = 0
    g = torch.Generator(device="cpu").manual_seed(seed)
    dk, dv = 192, 128
    dp = DeviceKVPool(pages * page_size, page_size, layers, heads, dk, dv, torch.bfloat16, device)
    ref = _fill(dp, g)
    nbytes = pages * page_size * heads * (dk + dv) * 2 * layers
    print(
        f"KV cache: {layers} layers x {pages} pages x {page_size} tokens, {heads} KV heads, K {dk} / V {dv} bf16 "
        f"({nbytes / 1e6:.1f} MB)"
    )
    failures += _transfer_round_trips(dp, ref, nbytes, (("page_first_direct", "direct"), ("page_first", "kernel")))
    # DeepSeek-V3-like MLA: one latent (512) + rope (64) row per token and layer, every rank holds all of it
    mla_layers = 61 if device == "cuda" else layers
    mla = MLADeviceKVPool(pages * page_size, page_size, mla_layers, 512, 64, torch.bfloat16, device)
    mla_ref = _fill(mla, g)
    mla_bytes = pages * page_size * 576 * 2 * mla_layers
    print(f"MLA KV cache (DeepSeek-like): {mla_layers} layers x {pages} pages x {page_size} tokens, kv_lora_rank 512 + "
          f"qk_rope_head_dim 64 bf16 ({mla_bytes / 1e6:.1f} MB)")
    failures += _transfer_round_trips(mla, mla_ref, mla_bytes, (("page_first_direct", "direct"), ("page_first", "kernel")))
    if store_dir is not None:
        os.makedirs(store_dir, mode=0o700, exist_ok=True)
    failures += _spill_round_trip(dp, ref, pages, page_size, layers, device, store_dir, "demo/mimo-like")
    failures += _spill_round_trip(mla, mla_ref, pages, page_size, mla_layers, device, store_dir, "demo/deepseek-like")
    if (conversations is None or conversations > 0) and (turns is None or turns > 0):
        from .workload import llama_config, run_workload

        if importlib.util.find_spec("transformers") is not None:
            from .workload_transformers import SIZES, size_key

            c, z = llama_config(device), SIZES[size_key(device)]
            print(f"\nServing {conversations or z['conversations']} conversations x {turns or z['rounds']} rounds with "
                  f"transformers' LlamaForCausalLM "
                  f"({c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} heads / "
                  f"{c.num_key_value_heads} KV heads, random weights) through kvtier's transformers cache, every "
                  f"restore planned from measurements (host pool < working set, so pages also come from disk):")
        else:
            print(f"\nServing {conversations or 3} conversations x {turns or 3} turns with a tiny asymmetric transformer "
                  f"(K 48 / V 32 head dims; transformers is not installed) through TierController; device pool < "
                  f"working set, host pool < working set:")
        out = run_workload(device=device, n_conv=conversations, turns=turns, seed=seed, keep=keep, store_dir=store_dir,
                           window=window)
        failures += len(out["failures"])
        if out["root"] and store_dir is None:
            print(f"store kept at {out['root']}")
    if store_dir is not None:
        print(f"the serving store is kept in {os.path.abspath(store_dir)} (kvtier inspect {store_dir})")
    print("demo:", "all checks passed" if not failures else f"{failures} check(s) FAILED")
    return 1 if failures else 0


def _tensors(dp) -> list:
    """Every per-layer device tensor of ``dp`` (K and V, or an MLA pool's latent KV)."""
    return [t for side in device_layers(dp) for t in side]


def _fill(dp, g) -> list:
    """Random bytes in every device tensor; returns copies to check against."""
    for x in _tensors(dp):
        x.view(torch.uint8).copy_(torch.randint(0, 256, x.view(torch.uint8).shape, generator=g, dtype=torch.uint8))
    return [x.clone() for x in _tensors(dp)]


def _transfer_round_trips(dp, ref, nbytes, combos) -> int:
    """Backup every page to a host pool, wipe the device pool, load it back per layer, check every byte; for
    each (layout, backend). Returns failures."""
    failures = 0
    device = _tensors(dp)[0].device.type
    pages, page_size, layers = dp.size // dp.page_size, dp.page_size, dp.layer_num
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for layout, backend in combos:
        with host_pool_for(dp, layout=layout) as hp:
            host_idx = hp.alloc(pages * page_size)
            dev_idx = torch.arange(page_size, (pages + 1) * page_size)  # skip the padding page
            hp.backup_from_device_all_layer(dp, host_idx, dev_idx, backend)  # warm-up (kernel compilation)
            hp.load_to_device_per_layer(dp, host_idx, dev_idx, 0, backend)
            sync()
            t0 = time.perf_counter()
            hp.backup_from_device_all_layer(dp, host_idx, dev_idx, backend)
            sync()
            t1 = time.perf_counter()
            for x in _tensors(dp):
                x.zero_()
            t2 = time.perf_counter()
            for layer in range(layers):
                hp.load_to_device_per_layer(dp, host_idx, dev_idx, layer, backend)
            sync()
            t3 = time.perf_counter()
            rows = dev_idx.to(device)
            exact = all(torch.equal(a[rows].view(torch.uint8), b[rows].view(torch.uint8)) for a, b in zip(ref, _tensors(dp)))
            failures += not exact
            print(
                f"  {type(hp).__name__}[{layout}, {backend}]: backup {_gbps(nbytes, t1 - t0)}, "
                f"load {_gbps(nbytes, t3 - t2)}, restored bit-exact: {exact}"
            )
    return failures


def _spill_round_trip(dp, ref, pages, page_size, layers, device, store_dir=None, model="demo") -> int:
    """Device -> host -> disk, wipe both, disk -> host -> device; check every byte. Returns failures."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    root = tempfile.mkdtemp(prefix="kvtier-demo-store-", dir=store_dir or os.getcwd())
    try:
        with host_pool_for(dp, layout="page_first_direct") as hp, warnings.catch_warnings():
            warnings.simplefilter("always")  # an O_DIRECT fallback is reported below, not raised
            store = PageStore(root, capacity_bytes=1 << 30, model_name=model)
            store.register_mem_pool_host(hp)
            tokens = torch.randint(0, 150_000, (pages * page_size,), generator=torch.Generator().manual_seed(1)).tolist()
            keys = page_hashes(tokens, page_size)  # SGLang-compatible chained page keys
            host_idx = hp.alloc(pages * page_size)
            dev_idx = torch.arange(page_size, (pages + 1) * page_size)
            hp.backup_from_device_all_layer(dp, host_idx, dev_idx, "direct")
            sync()
            t0 = time.perf_counter()
            stored = store.batch_set_v1(keys, host_idx)
            t1 = time.perf_counter()
            for x in [*hp.kv_buffer, *_tensors(dp)]:  # (MHA: K then V block; asymmetric: K, V; MLA: pages)
                x.zero_()
            t2 = time.perf_counter()
            loaded = store.batch_get_v1(keys, host_idx)
            t3 = time.perf_counter()
            for layer in range(layers):
                hp.load_to_device_per_layer(dp, host_idx, dev_idx, layer, "direct")
            sync()
            rows = dev_idx.to(device)
            exact = all(stored) and all(loaded) and all(
                torch.equal(a[rows].view(torch.uint8), b[rows].view(torch.uint8)) for a, b in zip(ref, _tensors(dp))
            )
            st = store.get_stats()
            nbytes = st["bytes_written"]
            print(
                f"  PageStore[{model}] ({'O_DIRECT' if st['o_direct'] else 'buffered: ' + str(st['o_direct_note'])}): "
                f"{st['pages']} pages spilled {_gbps(nbytes, t1 - t0)} (durable), read back {_gbps(nbytes, t3 - t2)}, "
                f"device KV restored from disk bit-exact: {exact}"
            )
            store.close()
        return 0 if exact else 1
    finally:
        remove_tree(root)
