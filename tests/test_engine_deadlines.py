"""A stalled disk never stalls SGLang's or vLLM's threads, and IO past its deadline never lands in the engine's
host pool: the backends' batches go through kvtier's staging pages (kvtier.staging).

Each stall is a real hang (the ``"stall"`` fault blocks the store's IO until the faults are cleared): on a
backend without deadlines every call below waits for the stall to end, so the hang guard fails. Every
deadline here is a fraction of a second; the tests assert results, bytes and counters, never times."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob

import kvtier
from kvtier.integrations.sglang import KvtierStorage
from kvtier.testing import clear_faults, fault_hits, inject_fault
from sglang_pools import PS, config, idx, page_bytes, sglang_pool
from vllm_tier import keys as vkeys, offloading_config, random_rows, rows

HANG_GUARD_S = 60


def returns_while_stalled(fn):
    """``fn()``'s value, asserting it returned while the stall still holds (a hang fails here)."""
    box = {}

    def run():
        try:
            box["v"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_GUARD_S)
    assert not t.is_alive(), "the call hung behind a stalled disk"
    if "e" in box:
        raise box["e"]
    return box.get("v")


def until(cond, what):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < HANG_GUARD_S, what
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def _no_faults_left():
    yield
    clear_faults()


def pool_tensors(pool):
    return (pool.k_buffer, pool.v_buffer) if isinstance(pool.kv_buffer, tuple) else (pool.kv_buffer,)


KEYS = [f"{i:064x}" for i in range(4)]


def backend(tmp_path, layout="page_first_direct", dims=(192, 128), **extra):
    pool = sglang_pool(layout, *dims)
    be = KvtierStorage(config(tmp_path, layout=layout, **extra))
    be.register_mem_pool_host(pool)
    return be, pool


# ------------------------------------------------------------------ SGLang
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["page_first_direct", "page_first"])
def test_sglang_a_stalled_read_answers_by_its_deadline_and_never_lands_in_the_pool(tmp_path, layout):
    # the deadline "auto" follows SGLang's own prefetch timeout options from the same extra config
    be, pool = backend(tmp_path, layout, prefetch_timeout_base=0.3, prefetch_timeout_per_ki_token=0.0)
    want = [page_bytes(pool, p) for p in range(4)]
    assert be.batch_set_v1(KEYS, idx(range(4))) == [True] * 4
    for t in pool_tensors(pool):
        t.zero_()
    inject_fault("data_read", "stall", times=None)
    assert returns_while_stalled(lambda: be.batch_get_v1(KEYS, idx([4, 5, 6, 7]))) == [False] * 4
    st = be.kvtier_stats()["deadlines"]
    # four pieces of one page: two were reading (one per read thread) and stay fenced, two never started
    assert st["deadline_misses"]["read"] == 4 and st["stuck_calls"] == 2 and st["fenced_pages"] == 2
    assert st["breaker"] == "closed"  # one batch is one miss
    clear_faults()
    until(lambda: be.kvtier_stats()["deadlines"]["fenced_pages"] == 0, "the late read returned")
    # the late read verified the pages into staging; SGLang's pages (given to another request by now) stayed
    # as they were
    for t in pool_tensors(pool):
        assert not t.view(torch.uint8).any()
    st = be.kvtier_stats()["deadlines"]
    assert st["reclaimed_pages_total"] == 2 and st["staging_free"] == st["staging_pages"]
    assert be.batch_get_v1(KEYS, idx([4, 5, 6, 7])) == [True] * 4  # the disk answers again: bit-exact
    for i in range(4):
        got = page_bytes(pool, 4 + i)
        assert torch.equal(got[0], want[i][0]) and torch.equal(got[1], want[i][1])
    be.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("point", ["data_write", "fallocate", "data_sync", "journal_write", "journal_sync"])
def test_sglang_a_stalled_write_is_false_and_later_stores_the_bytes_it_was_given(tmp_path, point):
    be, pool = backend(tmp_path, write_deadline_s=0.3)
    want = [page_bytes(pool, p) for p in range(4)]
    inject_fault(point, "stall")
    assert returns_while_stalled(lambda: be.batch_set_v1(KEYS, idx(range(4)))) == [False] * 4
    assert fault_hits(point) == 1
    # two pieces of two pages, written in order: the first stalled, the second was never sent
    assert be.kvtier_stats()["deadlines"]["deadline_misses"]["write"] == 2
    for t in pool_tensors(pool):  # SGLang gives the host pages to other requests
        t.fill_(0x5A)
    clear_faults()
    until(lambda: be.kvtier_stats()["deadlines"]["fenced_pages"] == 0, "the late write returned")
    # the late write stored what it was given when it was asked, whole: never the bytes written over it since
    assert be.batch_exists(KEYS) == 2
    assert be.batch_get_v1(KEYS[:2], idx([4, 5])) == [True] * 2
    for i in range(2):
        got = page_bytes(pool, 4 + i)
        assert torch.equal(got[0], want[i][0]) and torch.equal(got[1], want[i][1])
    be.close()


@pytest.mark.timeout(300)
def test_sglang_a_disk_that_keeps_missing_is_taken_out_and_let_back(tmp_path):
    be, pool = backend(tmp_path, read_deadline_s=0.2)
    assert be.batch_set_v1(KEYS, idx(range(4))) == [True] * 4
    inject_fault("data_read", "stall", times=None)
    for _ in range(2):
        assert returns_while_stalled(lambda: be.batch_get_v1(KEYS[:1], idx([4]))) == [False]
    st = be.kvtier_stats()["deadlines"]
    assert st["breaker"] == "open" and st["breaker_trips"] == 1
    assert be.batch_exists(KEYS) == 0  # nothing promised while it is out
    assert be.batch_get_v1(KEYS[:1], idx([5])) == [False]  # not sent: skipped
    assert be.kvtier_stats()["deadlines"]["skipped"]["read"] == 1
    clear_faults()
    until(lambda: be.kvtier_stats()["deadlines"]["breaker"] == "half_open", "the cool-down")
    assert be.batch_exists(KEYS) == 4
    assert be.batch_get_v1(KEYS, idx([4, 5, 6, 7])) == [True] * 4  # the probe answers in time
    st = be.kvtier_stats()["deadlines"]
    assert st["breaker"] == "closed" and st["breaker_recoveries"] == 1
    be.close()


def test_sglang_bad_indices_are_refused_before_anything_moves(tmp_path):
    be, pool = backend(tmp_path)
    assert be.batch_set_v1(KEYS, idx(range(4))) == [True] * 4
    before = [t.clone() for t in pool_tensors(pool)]
    swapped = idx([4, 5, 6, 7])
    swapped[-2:] = swapped[-2:].flip(0)  # the last page's slots out of order
    for bad in (idx([4, 5]), idx([4, 5, 6, 99]), idx([4, 5, 6, 7])[1:].contiguous(), idx([4, 5, 6, 7]).int(),
                swapped, idx([4, 5, 6, 4])):  # ... and one page read into twice
        with pytest.raises(kvtier.InvalidArgumentError, match="`host_indices`"):
            be.batch_get_v1(KEYS, bad)
    with pytest.raises(kvtier.InvalidArgumentError, match="consecutive"):
        be.batch_set_v1(KEYS, swapped)
    # one page written under two keys is fine (a write reads its pages)
    assert be.batch_set_v1(["f" * 64, "e" * 64], idx([1, 1])) == [True, True]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, pool_tensors(pool)))
    assert be.kvtier_stats()["deadlines"]["calls"]["read"] == 0
    be.close()


@pytest.mark.timeout(300)
def test_sglang_a_pool_registered_again_while_a_read_is_out_gets_none_of_its_bytes(tmp_path):
    """The read of the old registration returns into the old staging pages after the pool was registered
    again: it is answered False and copies nothing into the new pool (its staging slot numbers are the new
    staging pages' too)."""
    be, pool = backend(tmp_path)
    assert be.batch_set_v1(KEYS, idx(range(4))) == [True] * 4
    staged = be.staged
    gen = staged._slots()
    entered, release = threading.Event(), threading.Event()
    real = be.store.batch_staged

    def slow(write, keys, staging_indices, generation=None):
        entered.set()
        release.wait(HANG_GUARD_S)
        return real(write, keys, staging_indices, generation)

    be.store.batch_staged = slow
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("v", staged.get(KEYS[:1], idx([4]), deadline_s=HANG_GUARD_S)))
    t.start()
    assert entered.wait(HANG_GUARD_S)
    fresh = sglang_pool("page_first_direct", 192, 128, seed=7)
    be.store.register_mem_pool_host(fresh)  # (what a pool registered again does to the store)
    before = [x.clone() for x in pool_tensors(fresh)]
    assert staged._slots() != gen
    release.set()
    t.join(HANG_GUARD_S)
    assert box["v"] == [False]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, pool_tensors(fresh)))
    be.store.batch_staged = real
    assert staged.get(KEYS[:1], idx([4])) == [True]  # the new registration reads (into the new pool)
    got, want = page_bytes(fresh, 4), page_bytes(pool, 0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    be.close()


@pytest.mark.timeout(300)
def test_sglang_pieces_still_queued_at_the_batch_deadline_are_never_sent(tmp_path):
    """A read batch in pieces whose first pieces take the whole deadline: the pieces not yet sent when it
    passes are False without reaching the disk (no read sent with no time left)."""
    sizes = sglang_pool("page_first_direct").get_page_buffer_meta(torch.arange(PS))[1]
    page = sum(-(-int(n) // 4096) * 4096 for n in sizes)
    be, pool = backend(tmp_path, staging_bytes=4 * page, read_deadline_s=0.5)  # pieces of 1 page
    keys = [f"{i:064x}" for i in range(8)]
    assert be.batch_set_v1(keys, idx(range(8))) == [True] * 8
    inject_fault("data_read", "stall", times=None)
    assert returns_while_stalled(lambda: be.batch_get_v1(keys, idx(range(8)))) == [False] * 8
    st = be.kvtier_stats()["deadlines"]
    # 4 staging pages: 4 pieces sent (2 reading on the 2 read threads, 2 queued behind), 4 never sent
    assert st["calls"]["read"] == 4 and st["stuck_calls"] == 2
    clear_faults()
    until(lambda: be.kvtier_stats()["deadlines"]["staging_free"] == 4, "the late reads returned")
    be.close()


@pytest.mark.timeout(300)
def test_sglang_ctrl_c_in_a_staged_read_lands_nothing_and_frees_every_staging_page(tmp_path):
    """Ctrl-C while SGLang's thread waits on a staged read (two pieces reading, two queued): the batch raises,
    nothing is copied into SGLang's pool, not even by the reads returning later, and every staging page comes
    back once they have."""
    import signal

    be, pool = backend(tmp_path, read_deadline_s=30.0)
    assert be.batch_set_v1(KEYS, idx(range(4))) == [True] * 4
    want = [page_bytes(pool, p) for p in range(4)]
    for t in pool_tensors(pool):
        t.zero_()
    inject_fault("data_read", "stall", times=None)
    main = threading.main_thread().ident
    threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        be.batch_get_v1(KEYS, idx([4, 5, 6, 7]))
        time.sleep(HANG_GUARD_S)  # (the interrupt lands here if the read returned first: it must not)
    assert fault_hits("data_read") >= 1
    clear_faults()
    until(lambda: be.kvtier_stats()["deadlines"]["stuck_calls"] == 0, "the stalled reads to return")
    until(lambda: (lambda st: st["staging_free"] == st["staging_pages"])(be.kvtier_stats()["deadlines"]),
          "every staging page back")
    time.sleep(0.2)  # (a late copy would have landed by now)
    for t in pool_tensors(pool):
        assert not t.view(torch.uint8).any()
    assert be.batch_get_v1(KEYS, idx([4, 5, 6, 7])) == [True] * 4  # and the next read is whole
    for i in range(4):
        got = page_bytes(pool, 4 + i)
        assert torch.equal(got[0], want[i][0]) and torch.equal(got[1], want[i][1])
    be.close()


EXIT_SCRIPT = """
import sys, time
sys.path.insert(0, sys.argv[2])
from kvtier.integrations.sglang import KvtierStorage
from kvtier.testing import inject_fault
from sglang_pools import config, idx, sglang_pool
keys = [f"{i:064x}" for i in range(4)]
pool = sglang_pool("page_first_direct", 192, 128)
be = KvtierStorage(config(sys.argv[1], read_deadline_s=0.2, write_deadline_s=0.2))
be.register_mem_pool_host(pool)
assert be.batch_set_v1(keys, idx(range(4))) == [True] * 4
inject_fault("data_read", "delay", times=None, delay_ms=1500)
inject_fault("data_write", "delay", times=None, delay_ms=1500)
assert be.batch_get_v1(keys, idx([4, 5, 6, 7])) == [False] * 4
assert be.batch_set_v1([k[:-1] + "f" for k in keys], idx(range(4))) == [False] * 4


class SlowExit:  # the interpreter is finalizing while the late read and write return
    def __del__(self):
        time.sleep(3)


sys.modules["kvtier_slow_exit"] = SlowExit()
print("exiting", flush=True)
"""


@pytest.mark.timeout(300)
def test_sglang_io_that_returns_while_the_interpreter_exits_never_aborts_it(tmp_path):
    """A read and a write given up at their deadlines return while the interpreter finalizes: re-entering
    it then ends the thread with a forced unwind, which aborted the process (SIGABRT) through the native
    module's frames and through torch's; the tier thread now never comes back, and the process exits 0."""
    import pathlib
    import subprocess
    import sys

    here = str(pathlib.Path(__file__).parent)
    r = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tmp_path / "store"), here], capture_output=True,
                       text=True, timeout=240)
    assert "exiting" in r.stdout, r.stderr[-2000:]
    assert r.returncode == 0, f"exit status {r.returncode}: {r.stderr[-2000:]}"


BUSY_EXIT_SCRIPT = """
import sys, threading, time
import numpy as np
sys.path.insert(0, sys.argv[2])
from kvtier import native_calls
from kvtier.integrations.sglang import KvtierStorage
from sglang_pools import config, idx, sglang_pool
keys = [f"{i:064x}" for i in range(4)]
be = KvtierStorage(config(sys.argv[1]))
be.register_mem_pool_host(sglang_pool("page_first_direct", 192, 128, pages=32))
assert be.batch_set_v1(keys, idx(range(4))) == [True] * 4
store = be.store
native, gen = store.native_store(), store.stage(1 << 20).generation
ps = store.pool.page_size
slots = np.arange(4 * ps, dtype=np.int64)


def staged():  # the call a staged read's tier thread makes
    while True:
        store.batch_staged(False, keys, slots, gen)


def direct(j):  # a zero-copy batch and a staging copy, as an engine's thread makes them
    pages = np.arange((8 + 4 * j) * ps, (12 + 4 * j) * ps, dtype=np.int64)
    while True:
        native_calls.page_batch(native, False, keys, pages, None, False)
        native_calls.copy_pages(native, True, pages, slots)


for t in [threading.Thread(target=staged, daemon=True)] + [threading.Thread(target=direct, args=(j,), daemon=True)
                                                             for j in range(3)]:
    t.start()
time.sleep(0.3)
print("exiting", flush=True)
"""


@pytest.mark.timeout(300)
def test_threads_in_a_loop_of_page_batches_while_the_interpreter_exits_never_abort_it(tmp_path):
    """Daemon threads reading pages in a loop while the main thread exits: a call whose IO returned just before
    finalization and that took the GIL back inside the native module aborted the process (9 of 10 runs); page
    batches and staging copies off the main thread are now waited for in CPython's own frames."""
    import pathlib
    import subprocess
    import sys

    here = str(pathlib.Path(__file__).parent)
    for i in range(3):
        r = subprocess.run([sys.executable, "-c", BUSY_EXIT_SCRIPT, str(tmp_path / f"store{i}"), here],
                           capture_output=True, text=True, timeout=120)
        assert "exiting" in r.stdout, r.stderr[-2000:]
        assert r.returncode == 0, f"run {i}: exit status {r.returncode}: {r.stderr[-2000:]}"


@pytest.mark.timeout(300)
def test_sglang_a_write_of_a_pool_registered_again_past_its_check_stores_nothing_wrong(tmp_path):
    """A staged write passes the generation check, then the pool is registered again and the new staging
    pages bound before its IO starts: it runs on its own generation's store (closed: False), never on the
    new one's staging pages (whose bytes it would have stored under its key)."""
    be, pool = backend(tmp_path)
    store, staged = be.store, be.staged
    real, entered, release = store._batch, threading.Event(), threading.Event()

    def paused(write, keys, host_indices, split=None, staged=False, native=None):
        if staged and write and not entered.is_set():
            entered.set()
            release.wait(30)
        return real(write, keys, host_indices, split, staged, native)

    store._batch = paused
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("v", staged.set(KEYS[:1], idx([0]))))
    t.start()
    assert entered.wait(30)
    want = page_bytes(pool, 0)
    store.register_mem_pool_host(sglang_pool("page_first_direct", 192, 128, seed=7))
    staged._slots()  # the next batch binds the new staging pages
    release.set()
    t.join(30)
    store._batch = real
    assert box["v"] == [False]
    if be.batch_exists(KEYS[:1]):  # stored whole (the bytes it was given) or not at all
        fresh = store.pool
        assert be.batch_get_v1(KEYS[:1], idx([5])) == [True]
        got = page_bytes(fresh, 5)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    be.close()


def test_sglang_pages_round_trip_through_staging_in_pieces(tmp_path):
    """A batch larger than a quarter of the staging pages goes in pieces, every page bit-exact; without a
    deadline nothing is staged (zero copy)."""
    sizes = sglang_pool("page_first_direct").get_page_buffer_meta(torch.arange(PS))[1]
    page = sum(-(-int(n) // 4096) * 4096 for n in sizes)  # (each object of a staging page starts a 4 KiB block)
    be, pool = backend(tmp_path, staging_bytes=4 * page)  # 4 staging pages: pieces of 1
    keys = [f"{i:064x}" for i in range(8)]
    half = list(range(4))
    want = [page_bytes(pool, p) for p in half]
    assert be.batch_set_v1(keys[:4], idx(half)) == [True] * 4
    assert be.batch_get_v1(keys[:4], idx([7, 6, 5, 4])) == [True] * 4
    for i, p in enumerate([7, 6, 5, 4]):
        got = page_bytes(pool, p)
        assert torch.equal(got[0], want[i][0]) and torch.equal(got[1], want[i][1])
    st = be.kvtier_stats()["deadlines"]
    assert st["staging_pages"] == 4 and st["calls"] == {"lookup": 0, "read": 4, "write": 4}
    # a miss in the middle: the pages before it arrive, the rest of the batch is False
    assert be.batch_get_v1([keys[0], "e" * 64, keys[1]], idx([4, 5, 6])) == [True, False, True]
    be.close()
    be, pool = backend(tmp_path / "direct", read_deadline_s=None, write_deadline_s=None)
    assert be.batch_set_v1(keys[:2], idx([0, 1])) == [True] * 2 and be.batch_get_v1(keys[:2], idx([2, 3])) == [True] * 2
    assert be.kvtier_stats()["deadlines"]["staging_pages"] == 0
    be.close()


@pytest.mark.parametrize("key,value", [("read_deadline_s", 0), ("read_deadline_s", "soon"),
                                       ("write_deadline_s", "auto"), ("write_deadline_s", -1.0),
                                       ("staging_bytes", 100), ("staging_bytes", "lots")])
def test_sglang_bad_deadline_options_name_themselves(tmp_path, key, value):
    with pytest.raises(kvtier.InvalidArgumentError, match=f"`{key}`"):
        KvtierStorage(config(tmp_path, **{key: value}))
    assert not any(tmp_path.iterdir())  # nothing opened


# ------------------------------------------------------------------ vLLM
@pytest.mark.timeout(300)
def test_vllm_a_stalled_load_fails_by_its_deadline_and_never_lands_in_vllms_rows(tmp_path, managers):
    m = managers(offloading_config(tmp_path, rows=4, read_deadline_s=0.3))
    tier, ctx = m.secondary_tiers[0], ReqContext("x")
    view = rows(m)
    view[:] = random_rows(m, 4, seed=5)
    want = view[[0, 1]].copy()
    ks = vkeys(2, start=700)
    tier.submit_store(TransferJob(job_id=1, keys=ks, chunk_ids=np.array([0, 1]), is_promotion=False, req_context=ctx))
    tier.drain_jobs()
    assert [r.success for r in tier.get_finished_jobs()] == [True]
    view[2:] = 0
    inject_fault("data_read", "stall", times=None)
    tier.submit_load(TransferJob(job_id=2, keys=ks, chunk_ids=np.array([2, 3]), is_promotion=True, req_context=ctx))
    returns_while_stalled(tier.drain_jobs)
    assert [r.success for r in tier.get_finished_jobs()] == [False]
    clear_faults()
    until(lambda: tier.kvtier_stats()["deadlines"]["fenced_pages"] == 0, "the late load returned")
    assert not view[2:].any()  # vLLM's rows (freed when the job failed) never got the late bytes
    st = tier.kvtier_stats()
    assert st["deadlines"]["deadline_misses"]["read"] == 2 and st["failed_load_jobs"] == 1
    # the rows are stored again (vLLM recomputed them), and load
    tier.submit_store(TransferJob(job_id=3, keys=ks, chunk_ids=np.array([0, 1]), is_promotion=False, req_context=ctx))
    tier.drain_jobs()
    tier.get_finished_jobs()
    assert tier.lookup(ks[0], ctx) is LookupResult.HIT
    tier.submit_load(TransferJob(job_id=4, keys=ks, chunk_ids=np.array([3, 2]), is_promotion=True, req_context=ctx))
    tier.drain_jobs()
    assert [r.success for r in tier.get_finished_jobs()] == [True]
    assert np.array_equal(view[3], want[0]) and np.array_equal(view[2], want[1])


@pytest.mark.timeout(300)
def test_vllm_a_stalled_store_fails_and_keeps_the_rows_it_was_given(tmp_path, managers):
    m = managers(offloading_config(tmp_path, rows=4, write_deadline_s=0.3))
    tier, ctx = m.secondary_tiers[0], ReqContext("x")
    view = rows(m)
    view[:] = random_rows(m, 4, seed=6)
    want = view[[0, 1]].copy()
    ks = vkeys(2, start=800)
    inject_fault("data_write", "stall")
    tier.submit_store(TransferJob(job_id=1, keys=ks, chunk_ids=np.array([0, 1]), is_promotion=False, req_context=ctx))
    returns_while_stalled(tier.drain_jobs)
    assert [r.success for r in tier.get_finished_jobs()] == [False]
    view[:2] = 0  # vLLM reuses the rows
    clear_faults()
    until(lambda: tier.kvtier_stats()["deadlines"]["fenced_pages"] == 0, "the late store returned")
    # the first row's piece landed late, whole; the second was never sent
    assert [tier.lookup(k, ctx) for k in ks] == [LookupResult.HIT, LookupResult.MISS]
    tier.submit_load(TransferJob(job_id=2, keys=ks[:1], chunk_ids=np.array([2]), is_promotion=True, req_context=ctx))
    tier.drain_jobs()
    assert [r.success for r in tier.get_finished_jobs()] == [True]
    assert np.array_equal(view[2], want[0])


@pytest.mark.timeout(300)
def test_sglang_v2_extra_pools_are_not_read_once_the_kv_batch_missed_its_deadline(tmp_path):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang_pools import mamba_pool

    be, pool = backend(tmp_path, read_deadline_s=0.2)
    mp = mamba_pool()
    be.register_mem_host_pool_v2(mp, PoolName.MAMBA)
    kv = PoolTransfer(name=PoolName.KV, host_indices=idx(range(2)), keys=KEYS[:2])
    extra = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([0, 1]), keys=KEYS[:2])
    out = be.batch_set_v2([kv, extra])
    assert out[PoolName.KV] == [True, True] and out[PoolName.MAMBA] == [True, True]
    inject_fault("data_read", "stall", times=None)
    get = [PoolTransfer(name=PoolName.KV, host_indices=idx([4, 5]), keys=KEYS[:2]),
           PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([2, 3]), keys=KEYS[:2])]
    out = returns_while_stalled(lambda: be.batch_get_v2(get))
    assert out[PoolName.KV] == [False, False] and out[PoolName.MAMBA] == [False, False]
    clear_faults()
    until(lambda: be.kvtier_stats()["deadlines"]["fenced_pages"] == 0, "the late read returned")
    out = be.batch_get_v2(get)
    assert out[PoolName.KV] == [True, True] and out[PoolName.MAMBA] == [True, True]
    be.close()
