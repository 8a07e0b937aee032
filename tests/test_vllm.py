"""Conformance with the real vLLM package (vllm==0.33.0, installed by `make test` without its dependency tree):
kvtier's secondary tier is built by vLLM's own TieringOffloadingSpec and SecondaryTierFactory from config,
and driven through vLLM's TieringOffloadingManager the way its scheduler-side connector drives it (a CPU
primary tier in a /dev/shm region, cascades to the secondary tier, promotions back). These tests do not skip:
a vLLM release that changes these interfaces must fail them."""

import dataclasses
import inspect
import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import vllm
from vllm.config import KVTransferConfig
from vllm.v1.kv_offload.base import LookupResult, Medium, ReqContext
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import kvtier
import kvtier.integrations.vllm as kvtier_vllm
from kvtier.integrations.vllm import KvtierTier
from vllm_tier import END, GEOMETRIES, TIER, keys, load, offloading_config, random_rows, rows, shutdown, store


# ------------------------------------------------------------------------------------------------ interface
def test_vllm_interface_is_the_one_built_against():
    assert vllm.__version__ == "0.33.0", "kvtier's vLLM tier is built against vLLM 0.33.0: re-check the interface"
    assert SecondaryTierManager.__abstractmethods__ == {
        "lookup",
        "submit_store",
        "submit_load",
        "get_finished_jobs",
        "on_new_request",
        "drain_jobs",
    }
    assert not KvtierTier.__abstractmethods__
    assert list(inspect.signature(SecondaryTierManager.__init__).parameters) == [
        "self",
        "offloading_spec",
        "primary_kv_view",
        "tier_type",
        "backpressure_detector",
    ]
    assert [f.name for f in dataclasses.fields(TransferJob)] == [
        "job_id",
        "keys",
        "chunk_ids",
        "is_promotion",
        "req_context",
        "submit_time",
    ]
    assert [f.name for f in dataclasses.fields(JobResult)] == [
        "job_id",
        "success",
        "successful_keys",
        "transfer_time",
        "transfer_bytes",
    ]


def test_factory_builds_the_tier_from_config(tmp_path, managers):
    cfg = offloading_config(tmp_path)
    m = managers(cfg)
    (tier,) = m.secondary_tiers
    assert type(tier) is KvtierTier and tier.tier_type == "KvtierTier"
    assert tier.medium is Medium.STORAGE and tier.cache_hit_source is CacheHitSource.DISK
    assert tier.num_rows == m.primary_tier._num_chunks and tier.row_bytes == rows(m).shape[1]
    assert "model=meta-llama/Llama-3.1-8B-Instruct|dtype=bfloat16" in tier.namespace
    assert TieringOffloadingSpec.build_metric_definitions(dict(cfg.extra_config))  # resolves the tier class too


def test_readme_config_runs_through_vllm(tmp_path, managers):
    """The JSON of the README's "Use it with vLLM" section is what vLLM's KVTransferConfig accepts, and its
    extra config builds kvtier's tier through vLLM's factories (path and sizes swapped for the test's)."""
    with open(os.path.join(os.path.dirname(__file__), "..", "README.md")) as f:
        section = f.read().split("## Use it with vLLM", 1)[1].split("\n## ", 1)[0]
    (raw,) = re.findall(r"--kv-transfer-config '(\{.*?\})'", section, flags=re.S)
    ktc = KVTransferConfig(**json.loads(raw))
    assert ktc.kv_connector == "OffloadingConnector" and ktc.kv_role == "kv_both"
    extra = ktc.kv_connector_extra_config
    (entry,) = extra["secondary_tiers"]
    assert {k: entry[k] for k in TIER} == TIER and set(entry) <= set(TIER) | set(kvtier_vllm.OPTIONS)
    cfg = offloading_config(tmp_path)
    cfg = dataclasses.replace(
        cfg,
        extra_config={
            **extra,
            "cpu_bytes_to_use": cfg.extra_config["cpu_bytes_to_use"],
            "secondary_tiers": [{**entry, "path": str(tmp_path), "capacity_bytes": 1 << 30}],
        },
    )
    assert type(managers(cfg).secondary_tiers[0]) is KvtierTier


# ------------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize(
    "geometry,tp,blocks_per_chunk,groups",
    [("gqa", 1, 1, 1), ("gqa", 2, 1, 1), ("asymmetric", 1, 2, 1), ("mla", 1, 1, 2)],
)
def test_rows_round_trip_bit_exact_through_vllm(tmp_path, managers, geometry, tp, blocks_per_chunk, groups):
    """Rows cascade to kvtier; the primary tier (4 rows) evicts them as more arrive; lookups find them in
    kvtier, promote them back, and every byte equals what was stored."""
    m = managers(
        offloading_config(tmp_path, geometry=geometry, tp=tp, blocks_per_chunk=blocks_per_chunk, groups=groups, rows=4)
    )
    first = keys(2, group=0) + keys(2, group=groups - 1, start=100)
    want = random_rows(m, 4, seed=1)
    assert all(r.success for r in store(m, first, want))
    store(m, keys(4, start=200), random_rows(m, 4, seed=2))  # evicts `first` from the primary tier
    assert all(m.primary_tier.lookup(k, ReqContext("x")) is LookupResult.MISS for k in first)
    got, res = load(m, first)
    assert res == [LookupResult.HIT] * 4
    for k, w in zip(first, want):
        assert np.array_equal(got[k], w)


def test_restart_finds_stored_rows(tmp_path, managers):
    m = managers(offloading_config(tmp_path))
    ks, want = keys(5), random_rows(m, 5, seed=3)
    store(m, ks, want)
    shutdown(m)
    m2 = managers(offloading_config(tmp_path))  # a new engine: a fresh, empty primary tier
    got, res = load(m2, ks + keys(1, start=99))
    assert res == [LookupResult.HIT] * 5 + [LookupResult.MISS]
    assert all(np.array_equal(got[k], w) for k, w in zip(ks, want))


CHILD = """
import os, signal, sys, numpy as np, pickle
sys.path[:0] = [{tests!r}]
import vllm_tier as t
cfg = pickle.loads(bytes.fromhex({cfg!r}))
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
m = OffloadingSpecFactory.create_spec(cfg).get_manager()
results = t.store(m, t.keys(6), t.random_rows(m, 6, seed=4))
print("ACK" if results and all(r.success for r in results) else "NOACK", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_acknowledged_rows_survive_kill_9(tmp_path, managers):
    import pickle

    cfg = offloading_config(tmp_path)
    code = CHILD.format(tests=os.path.dirname(__file__), cfg=pickle.dumps(cfg).hex())
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    finally:
        for suffix in ("", ".1"):
            if os.path.exists(f"/dev/shm/vllm_offload_{cfg.engine_id}.mmap{suffix}"):
                os.unlink(f"/dev/shm/vllm_offload_{cfg.engine_id}.mmap{suffix}")
    assert p.returncode == -signal.SIGKILL and "ACK" in p.stdout.split(), p.stdout + p.stderr[-2000:]
    m = managers(offloading_config(tmp_path))
    want = random_rows(m, 6, seed=4)
    got, res = load(m, keys(6))
    assert res == [LookupResult.HIT] * 6
    assert all(np.array_equal(got[k], w) for k, w in zip(keys(6), want))


@pytest.mark.parametrize(
    "change",
    [
        {"model": "Qwen/Qwen3-8B"},
        {"dtype": "fp8_e4m3"},
        {"tokens_per_block": 32},
        {"layers": 3},
        {"tp": 2},
        {"blocks_per_chunk": 2},
        {"geometry": "asymmetric"},
        {"namespace_tag": "rev-2"},
    ],
)
def test_another_model_or_layout_misses(tmp_path, managers, change):
    m = managers(offloading_config(tmp_path))
    ks = keys(3)
    store(m, ks, random_rows(m, 3, seed=5))
    shutdown(m)
    same = managers(offloading_config(tmp_path))
    assert load(same, ks)[1] == [LookupResult.HIT] * 3  # the control: the same config finds them
    shutdown(same)
    other = managers(offloading_config(tmp_path, **change))
    assert load(other, ks)[1] == [LookupResult.MISS] * 3


# ------------------------------------------------------------------------------------------------ adversity
def test_damaged_row_is_a_miss_never_wrong_bytes(tmp_path, managers):
    m = managers(offloading_config(tmp_path))
    ks, want = keys(4), random_rows(m, 4, seed=6)
    store(m, ks, want)
    shutdown(m)
    (data,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f.startswith("class-")]
    with open(data, "r+b") as f:  # one byte of the second slot
        f.seek(os.path.getsize(data) // 4 + 777)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    m2 = managers(offloading_config(tmp_path))
    got, res = load(m2, ks)
    assert res.count(LookupResult.HIT) == 3 and res.count(LookupResult.MISS) == 1
    assert all(np.array_equal(got[k], w) for k, w in zip(ks, want) if k in got)
    assert m2.secondary_tiers[0].kvtier_stats()["corrupt_reads"] == 1
    assert load(m2, ks)[1].count(LookupResult.MISS) == 1  # dropped: still a miss, and no new promotion of it


def test_io_errors_and_a_torn_write_are_failed_jobs_never_wrong_bytes(tmp_path, managers):
    import errno

    m = managers(offloading_config(tmp_path, rows=4))
    tier = m.secondary_tiers[0]
    with kvtier.testing.faults("data_write", "error", errno=errno.ENOSPC, times=None):  # a full disk
        assert [r.success for r in store(m, keys(2), random_rows(m, 2, seed=7))] == [False]
    assert [tier.lookup(k, ReqContext("x")) for k in keys(2)] == [LookupResult.MISS] * 2
    ks, want = keys(3, start=10), random_rows(m, 3, seed=8)
    with kvtier.testing.faults("data_write", "torn", times=1):  # the disk lies about one row
        assert all(r.success for r in store(m, ks, want))
    ks2 = keys(2, start=30)
    assert all(r.success for r in store(m, ks2, random_rows(m, 2, seed=10)))
    store(m, keys(4, start=50), random_rows(m, 4, seed=9))  # evicts them from the primary tier
    with kvtier.testing.faults("data_read", "error", errno=errno.EIO, times=None):  # a failing disk
        got, _ = load(m, ks2)
        tier.drain_jobs()
        assert got == {}  # nothing served
        # a row that failed to load is then a MISS (recomputed), never a HIT that can never load: vLLM
        # would wait on it step after step
        for _ in range(3):
            assert [tier.lookup(k, ReqContext("x")) for k in ks2] == [LookupResult.MISS] * 2
    assert tier.counters["failed_load_jobs"] >= 1
    got, res = load(m, ks)
    assert sorted(r.name for r in res) == ["HIT", "HIT", "MISS"]  # the torn row is caught by its checksum
    assert len(got) == 2 and all(np.array_equal(got[k], w) for k, w in zip(ks, want) if k in got)
    assert tier.kvtier_stats()["corrupt_reads"] == 1


def disk_bytes(root):
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(root) for f in fs)


def test_capacity_is_enforced_lru(tmp_path, managers):
    row = 16 * 2 * GEOMETRIES["gqa"]  # offloading_config's default row
    cap = 6 * row + (128 << 10)
    m = managers(offloading_config(tmp_path, rows=4, capacity_bytes=cap))
    assert m.secondary_tiers[0].row_bytes == row
    for i in range(12):
        assert all(r.success for r in store(m, keys(1, start=i), random_rows(m, 1, seed=i)))
    tier, ctx = m.secondary_tiers[0], ReqContext("x")
    st = tier.kvtier_stats()
    assert st["evictions"] > 0 and 2 <= st["pages"] < 12
    assert st["bytes_used"] <= cap and disk_bytes(tmp_path) <= cap + (64 << 10)
    assert [tier.lookup(k, ctx) for k in keys(12)] == [LookupResult.MISS] * (12 - st["pages"]) + [
        LookupResult.HIT
    ] * st["pages"]  # least recently used first


def test_capacity_is_one_budget_for_every_namespace_of_the_path(tmp_path, managers):
    """Two DP replicas (a namespace each) in one `path`: `capacity_bytes` bounds both together."""
    import dataclasses

    from kvtier import _native

    row = 16 * 2 * GEOMETRIES["gqa"]
    cap = 6 * row + (128 << 10)
    ms = []
    for dp in range(2):
        cfg = offloading_config(tmp_path, rows=4, capacity_bytes=cap)
        par = dataclasses.replace(cfg.parallel, data_parallel_index=dp, data_parallel_size=2)
        ms.append(managers(dataclasses.replace(cfg, parallel=par)))
    for i in range(12):
        for m in ms:  # (a job can fail while the other replica holds more than its share: then it makes room)
            store(m, keys(1, start=i), random_rows(m, 1, seed=i))
    pages = [m.secondary_tiers[0].kvtier_stats()["pages"] for m in ms]
    assert all(p >= 1 for p in pages) and sum(pages) <= 6, pages
    assert disk_bytes(tmp_path) <= cap + 2 * (64 << 10), disk_bytes(tmp_path)
    budget, listed = _native.store_namespaces(tmp_path)
    assert budget == cap and len(listed) == 2


@pytest.mark.parametrize(
    "entry,name",
    [
        ({"path": None}, "path"),
        ({"path": ""}, "path"),
        ({"capacity": 1}, "secondary_tiers"),
        ({"capacity_bytes": "64 gallons"}, "capacity_bytes"),  # ("64G" is a size: accepted)
        ({"capacity_bytes": True}, "capacity_bytes"),
        ({"capacity_bytes": 8192}, "capacity_bytes"),
        ({"io_threads": 0}, "io_threads"),
        ({"direct": "yes"}, "direct"),
        ({"namespace_tag": "a|b"}, "namespace_tag"),
        ({"locality": "local"}, "locality"),
    ],
)
def test_bad_config_is_one_clear_error(tmp_path, entry, name):
    root = tmp_path / "store"
    cfg = offloading_config(root, **{k: v for k, v in entry.items() if k != "path"})
    if "path" in entry:
        tiers = [{k: v for k, v in cfg.extra_config["secondary_tiers"][0].items() if k != "path"}]
        if entry["path"] is not None:
            tiers[0]["path"] = entry["path"]
        cfg = dataclasses.replace(cfg, extra_config={**cfg.extra_config, "secondary_tiers": tiers})
    with pytest.raises(kvtier.InvalidArgumentError, match=f"`{name}`") as e:
        OffloadingSpecFactory.create_spec(cfg).get_manager()
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)
    assert not root.exists()  # checked before any IO
    assert not os.path.exists(f"/dev/shm/vllm_offload_{cfg.engine_id}.mmap")  # vLLM cleaned up its region


def test_second_engine_on_the_same_namespace_is_refused(tmp_path, managers):
    managers(offloading_config(tmp_path))
    cfg = offloading_config(tmp_path)
    with pytest.raises(kvtier.KvtierError, match="already open"):
        OffloadingSpecFactory.create_spec(cfg).get_manager()
    assert not os.path.exists(f"/dev/shm/vllm_offload_{cfg.engine_id}.mmap")


def test_non_cryptographic_block_hashes_are_refused(tmp_path, managers, caplog):
    m = managers(offloading_config(tmp_path))
    short = keys(2, hash_bytes=16)  # vLLM's xxhash: 128 bits, not collision-resistant
    assert [r.success for r in store(m, short, random_rows(m, 2, seed=10))] == [False]
    tier = m.secondary_tiers[0]
    assert tier.lookup(short[0], ReqContext("x")) is LookupResult.MISS
    assert tier.counters["refused_keys"] == 2 and tier.kvtier_stats()["pages"] == 0


def test_bad_jobs_are_refused_before_io(tmp_path, managers):
    m = managers(offloading_config(tmp_path, rows=4))
    tier, ctx = m.secondary_tiers[0], ReqContext("x")

    def job(ids, promotion=True):
        return TransferJob(
            job_id=1,
            keys=keys(len(ids)),
            chunk_ids=np.array(ids, dtype=np.int32),
            is_promotion=promotion,
            req_context=ctx,
        )

    for ids, promo in (([0, 4], True), ([-1], False), ([1, 1], True)):
        with pytest.raises(kvtier.InvalidArgumentError, match="`job_metadata`"):
            (tier.submit_load if promo else tier.submit_store)(job(ids, promo))
    with pytest.raises(kvtier.InvalidArgumentError, match="`job_metadata`"):
        tier.submit_store(
            TransferJob(job_id=1, keys=keys(2), chunk_ids=np.array([0]), is_promotion=False, req_context=ctx)
        )
    assert not tier.has_pending_work() and tier.kvtier_stats()["pages"] == 0


def test_concurrent_requests_reset_and_shutdown_with_jobs_in_flight(tmp_path, managers):
    """Many requests store while others promote, with a slow disk; reset_cache (vLLM drains the tiers) and
    shutdown with queued jobs leave nothing half-done: every acknowledged row loads bit-exact afterwards."""
    m = managers(offloading_config(tmp_path, rows=16))
    tier, want = m.secondary_tiers[0], {}
    with kvtier.testing.faults("data_write", "delay", delay_ms=5, times=None):
        for r in range(8):
            ks, data = keys(2, start=10 * r), random_rows(m, 2, seed=20 + r)
            ctx = ReqContext(req_id=f"req{r}")
            with m.lock:
                m.on_new_request(ctx)
                out = m.prepare_store(ks, ctx)
                if out is None:
                    continue
                view = rows(m)
                view[out.store_spec.chunk_ids] = data
                del view
                m.complete_store(ks, ctx)
                m.on_request_finished(ctx)
                m.on_schedule_end(END)
            want.update(zip(ks, data))
        with m.lock:
            m.reset_cache()  # drains every tier job in flight, then drops the primary tier's rows
        assert not m._jobs and not tier.has_pending_work()
        m.on_reset_flushed()
        ks = keys(2, start=70)
        ctx = ReqContext(req_id="last")
        with m.lock:
            m.on_new_request(ctx)
            out = m.prepare_store(ks, ctx)
            m.complete_store(ks, ctx)  # queued behind a slow disk when shutdown comes
            m.on_request_finished(ctx)
        shutdown(m)  # cancels what has not started, waits for what has, lets go of vLLM's rows
    m2 = managers(offloading_config(tmp_path, rows=16))
    stored = [k for k in want]
    got, res = load(m2, stored)
    assert res == [LookupResult.HIT] * len(stored)
    assert all(np.array_equal(got[k], want[k]) for k in stored)


def test_prometheus_collector_reads_the_tier(tmp_path, managers):
    from prometheus_client import CollectorRegistry, generate_latest

    from kvtier.metrics import KvtierCollector

    m = managers(offloading_config(tmp_path))
    store(m, keys(2), random_rows(m, 2, seed=30))
    reg = CollectorRegistry()
    reg.register(KvtierCollector(stores=[m.secondary_tiers[0].store]))
    text = generate_latest(reg).decode()
    assert re.search(r"kvtier_store_objects\{[^}]*\} 2\.0", text), text[-800:]


def test_a_job_runs_on_the_rows_it_was_submitted_with(tmp_path, managers):
    """A job's rows are checked at submit; the tier's thread then runs it later. A caller that reuses the
    job's chunk_ids array in between must not redirect it (it read them again when it ran: unchecked rows)."""
    m = managers(offloading_config(tmp_path, rows=4))
    tier, ctx = m.secondary_tiers[0], ReqContext("x")
    view = rows(m)
    view[:] = random_rows(m, 4, seed=5)
    want = view[[0, 1]].copy()
    ks = keys(2, start=500)
    ids = np.array([0, 1], dtype=np.int64)
    with tier._cv:  # the tier's thread cannot take the job before the array changes
        tier.submit_store(TransferJob(job_id=7, keys=ks, chunk_ids=ids, is_promotion=False, req_context=ctx))
        ids[:] = [2, 3]
    tier.drain_jobs()
    assert [r.success for r in tier.get_finished_jobs()] == [True]
    view[:] = 0
    tier.submit_load(TransferJob(job_id=8, keys=ks, chunk_ids=np.array([3, 2]), is_promotion=True, req_context=ctx))
    tier.drain_jobs()
    assert [r.success for r in tier.get_finished_jobs()] == [True]
    assert np.array_equal(view[3], want[0]) and np.array_equal(view[2], want[1])


def test_lookup_reports_only_rows_worth_loading(tmp_path, managers):
    """The restore planner (on by default): a stored row is a HIT through vLLM's tiering manager only when
    reading it is predicted faster than vLLM recomputing its tokens; otherwise a MISS (vLLM recomputes), and
    the row stays stored for a faster day. Paired: the same rows are HITs when compute is slow."""
    results = {}
    for rate in (1.0, 1e15):  # a prefill of one token per second, and one that costs nothing
        root = tmp_path / str(rate)
        m = managers(offloading_config(root, rows=4, restore_planner=True, prefill_tokens_per_s=rate))
        ks = keys(4, start=500)
        assert all(r.success for r in store(m, ks, random_rows(m, 4, seed=7)))
        store(m, keys(4, start=600), random_rows(m, 4, seed=8))  # evicts ks from the primary tier
        _, res = load(m, ks)
        tier = m.secondary_tiers[0]
        results[rate] = (res, tier.counters["planned_misses"], tier.store.batch_exists([tier._name(k) for k in ks]))
        shutdown(m)
    assert results[1.0] == ([LookupResult.HIT] * 4, 0, 4)
    res, misses, stored = results[1e15]
    assert res[0] is LookupResult.MISS and misses >= 1 and stored == 4
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        managers(offloading_config(tmp_path / "bad", prefill_tokens_per_s="fast"))
