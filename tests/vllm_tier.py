"""vLLM's offloading managers with kvtier as the secondary tier, and the row helpers the vLLM tests share (the
real vLLM package, as installed by `make test`)."""

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


TIER = {"type": "KvtierTier", "module_path": "kvtier.integrations.vllm"}
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
# per-token bytes of one layer (bf16): GQA K=V=128 x 8 heads, MiMo-like K 192 / V 128 x 4 heads, MLA 512+64
GEOMETRIES = {"gqa": 8 * 256 * 2, "asymmetric": 4 * 320 * 2, "mla": 576 * 2}
ONE_OF_EACH = dict(pp_size=1, pcp_size=1, dcp_size=1, data_parallel_index=0, data_parallel_size=1)
ONE_OF_EACH.update(data_parallel_rank_local=None, is_parallelism_agnostic=False)


def offloading_config(
    root,
    *,
    model="meta-llama/Llama-3.1-8B-Instruct",
    dtype="bfloat16",
    tokens_per_block=16,
    layers=2,
    geometry="gqa",
    tp=1,
    blocks_per_chunk=1,
    rows=8,
    groups=1,
    **tier,
):
    """The OffloadingConfig vLLM's connector builds (build_offloading_config), for a TieringOffloadingSpec with
    kvtier as its one secondary tier."""
    block = tokens_per_block * layers * GEOMETRIES[geometry]
    row = -(-block * tp * blocks_per_chunk // 4096) * 4096
    # the restore planner is off here (these tests pin the tier's mechanics; test_engine_planning.py covers it)
    entry = {**TIER, "path": str(root), "capacity_bytes": 1 << 30, "restore_planner": False, **tier}
    entry = {k: v for k, v in entry.items() if v is not None}
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers * groups)]
    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(
                tokens_per_block=tokens_per_block, group_id=g, layer_names=tuple(names[g * layers : (g + 1) * layers])
            )
            for g in range(groups)
        ),
        worker_kv_bytes_per_block=block * groups,
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": rows * row * groups,
            "secondary_tiers": [entry],
        },
        engine_id="kvtier-test-" + uuid.uuid4().hex[:12],
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_block, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(rank=0, world_size=tp, tp_size=tp, **ONE_OF_EACH),
    )


def shutdown(m):
    m.shutdown()
    m._down = True


def keys(n, start=0, group=0, hash_bytes=32):
    return [make_offload_key((start + i).to_bytes(hash_bytes, "big"), group) for i in range(n)]


def rows(m):
    return np.asarray(m.primary_tier.get_kv_memoryview())


def store(m, ks, data, req="w"):
    """vLLM's store path: prepare_store, the GPU worker fills the rows, complete_store cascades to the tier;
    then the tier's jobs finish and the next step processes them. Returns the tier's job results."""
    ctx = ReqContext(req_id=req + uuid.uuid4().hex[:6])
    tier = m.secondary_tiers[0]
    with m.lock:
        m.on_new_request(ctx)
        out = m.prepare_store(ks, ctx)
    assert out is not None and list(out.keys_to_store) == list(ks)
    view = rows(m)
    view[out.store_spec.chunk_ids] = data
    del view
    with m.lock:
        m.complete_store(ks, ctx, success=True)
        m.on_request_finished(ctx)
    tier.drain_jobs()
    results = list(tier.get_finished_jobs())
    tier._finished.extend(results)  # hand them back to the manager, which processes them next step
    with m.lock:
        m.on_schedule_end(END)
        m.on_schedule_end(END)
    assert not m._jobs
    return results


def load(m, ks, req="r"):
    """vLLM's load path: lookups (a secondary hit starts a promotion, HIT_PENDING), the step's end submits it,
    the tier finishes it; then lookups again and prepare_load of the hits. Returns ({key: row bytes}, the
    final lookup results)."""
    ctx = ReqContext(req_id=req + uuid.uuid4().hex[:6])
    with m.lock:
        m.on_new_request(ctx)
        [m.lookup(k, ctx) for k in ks]
        m.on_schedule_end(END)
    m.secondary_tiers[0].drain_jobs()
    with m.lock:
        res = [m.lookup(k, ctx) for k in ks]
        hits = [k for k, r in zip(ks, res) if r is LookupResult.HIT]
        got = {}
        if hits:
            spec = m.prepare_load(hits, ctx)
            got = dict(zip(hits, rows(m)[spec.chunk_ids].copy()))
            m.complete_load(hits, ctx)
        m.on_request_finished(ctx)
        m.on_schedule_end(END)
    return got, res


def random_rows(m, n, seed):
    return np.random.default_rng(seed).integers(-128, 128, (n, rows(m).shape[1]), dtype=np.int8)
