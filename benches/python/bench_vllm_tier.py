"""kvtier's vLLM secondary tier against vLLM's own file-system tier ("fs"), in the same run on the same disk.

    PYTHONPATH=python .venv/bin/python benches/python/bench_vllm_tier.py [--dir DIR] [--reps 3]
        [--geoms llama,mimo] [--chunk-tokens 16,256] [--tokens 8192] [--out DIR]

Both tiers are built by vLLM 0.33's TieringOffloadingSpec from config and driven through its
TieringOffloadingManager as its scheduler drives them (CPU primary tier in /dev/shm, 16 IO threads each):
  - store: a prompt of --tokens tokens is written into the primary tier in prefill steps of 2,048 tokens
    (prepare_store / complete_store per step, as the GPU worker finishes each); timed from the first
    complete_store until every cascade job to the secondary tier has reported success;
  - restore: a fresh engine (a new, empty primary tier; the same directory) looks the prompt up the way
    vLLM's scheduler does (_maximal_prefix_lookup: HIT/HIT_PENDING count, RETRY continues, MISS stops),
    ending each step with on_schedule_end and a 1 ms pause, until every chunk is a HIT in the primary tier
    (ready for the GPU load); timed from the first lookup; then every row is checked bit for bit.
Geometries (bf16): llama = Llama-3.1-8B-like (32 layers, 8 KV heads, head dim 128); mimo = MiMo-like
(48 layers, 4 KV heads, K 192 / V 128). vLLM's GPU block is 16 tokens; --chunk-tokens sets the offloaded
chunk (vLLM's ``block_size`` extra-config key), so one row holds that many tokens of every layer.
Each round first measures the disk's ceiling (kvtier's O_DIRECT roofline: the same row size and count, 16 in
flight, into a preallocated file, then fdatasync; O_DIRECT pread), then runs each tier in a fresh directory;
figures are medians. Writes cpu-vllm-tier.json only
into --out (checked before the bench starts). Last, for each tier, one byte of one stored row is flipped on
disk and a fresh engine restores the rows: how many are served, and how many of those are wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvtier._native import disk_roofline
from kvtier_bench._common import fs_type, out_dir, write_results

GEOMS = {  # layers, KV heads, K dim, V dim (bf16)
    "llama": dict(model="meta-llama/Llama-3.1-8B-Instruct", layers=32, heads=8, dk=128, dv=128),
    "mimo": dict(model="XiaomiMiMo/MiMo-V2-Flash", layers=48, heads=4, dk=192, dv=128),
}
GPU_BLOCK = 16
PREFILL_STEP = 2048
STEP_PAUSE_S = 0.001
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def config(geom: str, chunk_tokens: int, rows: int, tier: dict) -> OffloadingConfig:
    g = GEOMS[geom]
    block = GPU_BLOCK * g["heads"] * (g["dk"] + g["dv"]) * 2  # one layer's K and V of one GPU block
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(g["layers"]))
    row = block * g["layers"] * (chunk_tokens // GPU_BLOCK)
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=GPU_BLOCK, layer_names=names, group_id=0),),
        worker_kv_bytes_per_block=block * g["layers"],
        enable_kv_cache_events=False,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": rows * row, "secondary_tiers": [tier]},
        engine_id="kvtier-bench-" + uuid.uuid4().hex[:12],
        model=OffloadingModelConfig(name=g["model"], dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=GPU_BLOCK, blocks_per_chunk=chunk_tokens // GPU_BLOCK),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def tier_entry(name: str, root: str) -> dict:
    if name == "kvtier":
        return {
            "type": "KvtierTier",
            "module_path": "kvtier.integrations.vllm",
            "path": root,
            "capacity_bytes": 1 << 40,
            "io_threads": 16,
        }
    return {"type": "fs", "root_dir": root, "n_read_threads": 16, "n_write_threads": 16}


def store(m, keys, data, chunk_tokens: int) -> float:
    """Prefill steps of PREFILL_STEP tokens; returns seconds from the first complete_store until the tier has
    finished every cascade job (their success is proven by the restore that follows)."""
    tier = m.secondary_tiers[0]
    per_step = max(1, PREFILL_STEP // chunk_tokens)
    ctx = ReqContext(req_id="prompt")
    view = np.asarray(m.primary_tier.get_kv_memoryview())
    with m.lock:
        m.on_new_request(ctx)
    t0 = None
    for s in range(0, len(keys), per_step):
        ks = keys[s : s + per_step]
        with m.lock:
            out = m.prepare_store(ks, ctx)
        view[out.store_spec.chunk_ids] = data[s : s + per_step]  # the GPU worker's copy
        if t0 is None:
            t0 = time.perf_counter()
        with m.lock:
            m.complete_store(ks, ctx)
    del view
    tier.drain_jobs()
    dt = time.perf_counter() - t0
    with m.lock:
        m.on_request_finished(ctx)
        m.on_schedule_end(END)
        m.on_schedule_end(END)
    if m._jobs:
        raise RuntimeError(f"{tier.tier_type}: cascade jobs still pending after drain_jobs")
    return dt


def restore(m, keys) -> tuple[float, int]:
    """vLLM's scheduler lookups, step after step, until the whole prefix is a HIT in the primary tier."""
    ctx = ReqContext(req_id="again")
    with m.lock:
        m.on_new_request(ctx)
    t0, steps = time.perf_counter(), 0
    while True:
        steps += 1
        hits, deferred = 0, False
        with m.lock:
            for k in keys:
                r = m.lookup(k, ctx)
                if r is LookupResult.MISS:
                    break
                if r is LookupResult.RETRY:
                    deferred = True
                    continue
                hits += 1
                deferred |= r is LookupResult.HIT_PENDING
            done = hits == len(keys) and not deferred
            if not done:
                m.on_schedule_end(END)
        if done:
            return time.perf_counter() - t0, steps
        if hits < len(keys) and not deferred:
            raise RuntimeError(f"restore: only {hits} of {len(keys)} chunks found")
        time.sleep(STEP_PAUSE_S)


def check(m, keys, data) -> bool:
    ctx = ReqContext(req_id="check")
    with m.lock:
        spec = m.prepare_load(keys, ctx)
        view = np.asarray(m.primary_tier.get_kv_memoryview())
        ok = bool(np.array_equal(view[spec.chunk_ids], data))
        del view
        m.complete_load(keys, ctx)
    return ok


def one_round(tier_name, geom, chunk_tokens, data, base):
    n = len(data)
    root = tempfile.mkdtemp(prefix=f"vllm-tier-{tier_name}-", dir=base)
    try:
        m = OffloadingSpecFactory.create_spec(config(geom, chunk_tokens, n, tier_entry(tier_name, root))).get_manager()
        try:
            row = np.asarray(m.primary_tier.get_kv_memoryview()).shape[1]
            assert row == data.shape[1], (row, data.shape)
            keys = [make_offload_key(uuid.uuid4().bytes * 2, 0) for _ in range(n)]
            t_store = store(m, keys, data, chunk_tokens)
            o_direct = getattr(m.secondary_tiers[0], "_use_o_direct", None)
            if o_direct is None:
                o_direct = bool(m.secondary_tiers[0].kvtier_stats()["o_direct"])
        finally:
            m.shutdown()
        m = OffloadingSpecFactory.create_spec(config(geom, chunk_tokens, n, tier_entry(tier_name, root))).get_manager()
        try:
            t_restore, steps = restore(m, keys)
            ok = check(m, keys, data)
        finally:
            m.shutdown()
        return dict(
            store_s=t_store, restore_s=t_restore, steps=steps, bit_exact=ok, row_bytes=row, rows=n, o_direct=o_direct
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def damaged_row(tier_name: str, base: str) -> dict:
    """Four rows stored, one byte of one of them flipped on disk, a fresh engine restores them: how many rows
    come back, and how many of those differ from what was stored."""
    n, chunk = 4, 16
    root = tempfile.mkdtemp(prefix=f"vllm-damage-{tier_name}-", dir=base)
    try:
        cfg = config("llama", chunk, n, tier_entry(tier_name, root))
        m = OffloadingSpecFactory.create_spec(cfg).get_manager()
        try:
            row = np.asarray(m.primary_tier.get_kv_memoryview()).shape[1]
            data = np.frombuffer(np.random.default_rng(7).bytes(n * row), dtype=np.int8).reshape(n, row)
            keys = [make_offload_key(uuid.uuid4().bytes * 2, 0) for _ in range(n)]
            store(m, keys, data, chunk)
        finally:
            m.shutdown()
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith((".bin", ".dat")))
        with open(files[0], "r+b") as f:  # one byte in the middle of the first row the file holds
            f.seek(row // 2)
            b = f.read(1)
            f.seek(row // 2)
            f.write(bytes([b[0] ^ 0x01]))
        m = OffloadingSpecFactory.create_spec(config("llama", chunk, n, tier_entry(tier_name, root))).get_manager()
        try:
            ctx = ReqContext(req_id="damaged")
            with m.lock:
                m.on_new_request(ctx)
            for _ in range(200):  # steps until every lookup has resolved
                with m.lock:
                    res = [m.lookup(k, ctx) for k in keys]
                    m.on_schedule_end(END)
                if all(r in (LookupResult.HIT, LookupResult.MISS) for r in res):
                    break
                time.sleep(STEP_PAUSE_S)
            served = [i for i, r in enumerate(res) if r is LookupResult.HIT]
            with m.lock:
                spec = m.prepare_load([keys[i] for i in served], ctx)
                view = np.asarray(m.primary_tier.get_kv_memoryview())
                wrong = sum(not np.array_equal(view[c], data[i]) for c, i in zip(spec.chunk_ids, served))
                del view
        finally:
            m.shutdown()
        return dict(rows=n, served=len(served), served_wrong=int(wrong))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: the temp dir)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--geoms", default="llama,mimo")
    ap.add_argument("--chunk-tokens", default="16,256")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out", default=None, help="write cpu-vllm-tier.json here")
    a = ap.parse_args()
    out = out_dir(a.out)
    geoms, chunks = a.geoms.split(","), [int(x) for x in a.chunk_tokens.split(",")]
    if a.reps < 1 or any(g not in GEOMS for g in geoms) or any(c % GPU_BLOCK or a.tokens % c for c in chunks):
        raise SystemExit(
            f"--reps >= 1, --geoms from {sorted(GEOMS)}, chunk tokens multiples of {GPU_BLOCK} dividing --tokens"
        )
    base = tempfile.mkdtemp(prefix="kvtier-bench-vllm-", dir=a.dir)
    rows = []
    try:
        for geom in geoms:
            for chunk in chunks:
                n, g = a.tokens // chunk, GEOMS[geom]
                row_bytes = GPU_BLOCK * g["heads"] * (g["dk"] + g["dv"]) * 2 * g["layers"] * (chunk // GPU_BLOCK)
                data = np.frombuffer(np.random.default_rng(n).bytes(n * row_bytes), dtype=np.int8)
                data = data.reshape(n, row_bytes)
                runs: dict[str, list[dict]] = {"kvtier": [], "fs": []}
                ceiling: list[tuple[float, float, bool]] = []
                for _ in range(a.reps):
                    ceiling.append(disk_roofline(base, row_bytes, n, 16))  # the disk's O_DIRECT ceiling, this round
                    for name in runs:
                        runs[name].append(one_round(name, geom, chunk, data, base))
                for name, rs in runs.items():
                    nbytes = rs[0]["row_bytes"] * rs[0]["rows"]
                    row = dict(
                        geometry=geom,
                        tier=name,
                        tokens=a.tokens,
                        chunk_tokens=chunk,
                        rows=rs[0]["rows"],
                        row_bytes=rs[0]["row_bytes"],
                        bytes=nbytes,
                        store_GBps=round(nbytes / statistics.median(r["store_s"] for r in rs) / 1e9, 3),
                        restore_ms=round(1e3 * statistics.median(r["restore_s"] for r in rs), 1),
                        restore_GBps=round(nbytes / statistics.median(r["restore_s"] for r in rs) / 1e9, 3),
                        restore_steps=[r["steps"] for r in rs],
                        all_store_GBps=[round(nbytes / r["store_s"] / 1e9, 3) for r in rs],
                        all_restore_ms=[round(1e3 * r["restore_s"], 1) for r in rs],
                        ceiling_write_GBps=round(statistics.median(c[0] for c in ceiling), 3),
                        ceiling_read_GBps=round(statistics.median(c[1] for c in ceiling), 3),
                        o_direct=all(r["o_direct"] for r in rs),
                        bit_exact=all(r["bit_exact"] for r in rs),
                        durable_on_ack=name == "kvtier",
                    )
                    row["store_pct"] = round(100 * row["store_GBps"] / row["ceiling_write_GBps"], 1)
                    row["restore_pct"] = round(100 * row["restore_GBps"] / row["ceiling_read_GBps"], 1)
                    rows.append(row)
                    print(
                        f"{geom:6} chunk {chunk:4} tokens {name:7} store {row['store_GBps']:6.3f} GB/s  "
                        f"restore {a.tokens} tokens {row['restore_ms']:8.1f} ms ({row['restore_GBps']:.3f} GB/s)"
                        f"  ({row['store_pct']} / {row['restore_pct']} % of the disk's ceiling)  bit-exact "
                        f"{row['bit_exact']}  O_DIRECT {row['o_direct']}"
                    )
        damage = {name: damaged_row(name, base) for name in ("kvtier", "fs")}
        for name, d in damage.items():
            print(
                f"one byte flipped on disk, {name:7}: {d['served']} of {d['rows']} rows served, "
                f"{d['served_wrong']} of them wrong"
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result = dict(
        damaged_row=damage,
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        dir=base,
        fs=fs_type(base),
        vllm="0.33.0",
        reps=a.reps,
        prefill_step_tokens=PREFILL_STEP,
        step_pause_s=STEP_PAUSE_S,
        io_threads=16,
        cpu_count=os.cpu_count(),
        rows=rows,
    )
    if out:
        write_results(out, {"cpu-vllm-tier.json": json.dumps(result, indent=1) + "\n"})


if __name__ == "__main__":
    main()
