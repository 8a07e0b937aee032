"""A stalled tier never stalls the engine: store calls with deadlines, fenced pages, the breaker.

Each stall is a real hang (the ``"stall"`` fault blocks the store's IO until the faults are cleared, or a tier
whose call blocks on an event): on code without deadlines every call below waits for the stall to end, so the
hang guard (``returns_while_stalled``: a thread joined for 60 s while the stall holds) fails. The guard is a
hang check, not a timing: every deadline here is a fraction of a second."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvtier import InvalidArgumentError, TierController, page_hashes
from kvtier.deadlines import Breaker, TierIO, check_deadline
from kvtier.testing import clear_faults, fault_hits, inject_fault

from controller_pools import PS, rows, setup

HANG_GUARD_S = 60


def keys_for(n, seed=0):
    return page_hashes(list(range(seed, seed + n * PS)), PS)


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
    assert not t.is_alive(), "the call hung behind a stalled tier"
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


# ------------------------------------------------------------------ the parts
def test_breaker_opens_after_misses_and_closes_after_a_probe_in_time():
    b = Breaker(threshold=2, cooldown_s=0.05)
    assert b.allow("read") == "call" and b.state == "closed"
    b.missed("read")
    b.answered("read")
    b.missed("read")
    assert b.state == "closed"  # misses must be in a row
    b.missed("read")
    assert b.state == "open" and b.allow("read") is None and b.allow("lookup") is None and b.trips == 1
    until(lambda: b.state == "half_open", "cool-down")
    assert b.allow("lookup") == "call"  # half-open: other kinds go through; the probe is a call of the kind that missed
    assert b.allow("read") == "probe" and b.allow("read") is None  # one probe only
    b.missed("read")  # an older call's miss is not the probe's
    assert b.state == "half_open"
    b.missed("read", probe=True)  # the probe missed: out again, for twice as long
    assert b.state == "open" and b._cooldown == pytest.approx(0.1)
    until(lambda: b.state == "half_open", "cool-down")
    assert b.allow("read") == "probe"
    b.unused()  # it had nothing to read: the next read probes
    assert b.allow("read") == "probe"
    b.answered("read", probe=True)
    assert b.state == "closed" and b.recoveries == 1 and b.allow("lookup") == "call"


def test_lookups_that_answer_do_not_hide_reads_that_miss():
    b = Breaker(threshold=2, cooldown_s=60)
    for _ in range(2):
        b.answered("lookup")
        b.missed("read")
    assert b.state == "open"


@pytest.mark.parametrize("kw", [dict(threshold=0), dict(threshold=True), dict(cooldown_s=0),
                                dict(cooldown_s=float("nan")), dict(max_cooldown_s=float("inf"))])
def test_breaker_refuses_bad_arguments_by_name(kw):
    with pytest.raises(InvalidArgumentError, match=next(iter(kw))):
        Breaker(**kw)


@pytest.mark.parametrize("v", [0, -1, float("nan"), float("inf"), True, "soon", "auto"])
def test_deadlines_refuse_what_is_not_seconds(v):
    with pytest.raises(InvalidArgumentError, match="`deadline`"):
        check_deadline("deadline", v)


def test_tier_io_answers_at_the_deadline_fences_and_reclaims():
    io = TierIO(breaker=Breaker(threshold=1, cooldown_s=60))
    release, seen = threading.Event(), []
    fut = io.run("read", lambda: release.wait(HANG_GUARD_S) and "late bytes", deadline_s=0.05, pages=3,
                 on_done=lambda r, late: seen.append((r, late)) or "done", on_give_up=lambda started: ("gave up", started))
    assert fut.result(HANG_GUARD_S) == ("gave up", True)
    assert io.stats.fenced_pages == 3 and io.stats.stuck_calls == 1 and io.stats.deadline_misses["read"] == 1
    assert io.breaker.state == "open"
    # out of use: the next call never reaches the tier
    ran = []
    assert io.run("read", lambda: ran.append(1), deadline_s=1, pages=1, on_done=lambda r, late: "done",
                  on_give_up=lambda started: started).result(HANG_GUARD_S) is False
    assert not ran and io.stats.skipped["read"] == 1
    release.set()
    until(lambda: io.stats.stuck_calls == 0, "the late call to return")
    assert seen == [("late bytes", True)]
    assert io.stats.fenced_pages == 0 and io.stats.reclaimed_pages_total == 3 and io.stats.fenced_pages_total == 3
    io.close()


def test_a_call_whose_deadline_passes_in_the_queue_never_runs():
    io = TierIO()
    release, ran = threading.Event(), []
    first = io.run("write", lambda: release.wait(HANG_GUARD_S), deadline_s=0.05, pages=1,
                   on_done=lambda r, late: "done", on_give_up=lambda started: started)
    second = io.run("write", lambda: ran.append(1), deadline_s=0.05, pages=1,
                    on_done=lambda r, late: "done", on_give_up=lambda started: started)
    assert first.result(HANG_GUARD_S) is True  # running when it was given up: fenced
    assert second.result(HANG_GUARD_S) is False  # queued: never runs
    release.set()
    until(lambda: io.stats.stuck_calls == 0, "the stalled write to return")
    time.sleep(0.05)
    assert not ran
    io.close()


def test_a_caller_may_give_up_at_a_deadline_of_its_own():
    io = TierIO()
    release = threading.Event()
    fut = io.run("write", lambda: release.wait(HANG_GUARD_S), deadline_s=None, pages=1,
                 on_done=lambda r, late: "done", on_give_up=lambda started: "abandoned")
    with pytest.raises(TimeoutError):
        fut.result(timeout=0.05)
    io.abandon(fut)
    assert fut.result() == "abandoned"
    io.abandon(fut)  # (twice: nothing)
    release.set()
    until(lambda: io.stats.stuck_calls == 0, "the call to return")
    io.close()


def test_a_tier_whose_callbacks_wait_on_a_lock_delays_only_its_own_deadlines():
    held, release = threading.Lock(), threading.Event()
    a, b = TierIO(), TierIO()
    held.acquire()  # a's give-up waits on it (a controller's lock held by a long spill)
    a.run("read", lambda: release.wait(HANG_GUARD_S), deadline_s=0.05, pages=1, on_done=lambda r, late: None,
          on_give_up=lambda started: held.acquire() or held.release())
    got = returns_while_stalled(lambda: b.run("read", lambda: release.wait(HANG_GUARD_S), deadline_s=0.1, pages=1,
                                              on_done=lambda r, late: "done",
                                              on_give_up=lambda started: "b's deadline").result())
    assert got == "b's deadline"
    held.release()
    release.set()
    until(lambda: a.stats.stuck_calls == 0 and b.stats.stuck_calls == 0, "the calls to return")


def test_a_process_whose_tier_is_stuck_can_still_exit(tmp_path):
    import subprocess
    import sys

    code = (
        "import threading\n"
        "from kvtier.deadlines import TierIO\n"
        "io = TierIO()\n"
        "print(io.run('read', threading.Event().wait, deadline_s=0.05, pages=1, on_done=lambda r, late: 0,"
        " on_give_up=lambda started: 'gave up').result())\n"
        "io.close()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert r.returncode == 0 and r.stdout.strip() == "gave up", r.stderr


# ------------------------------------------------------------------ the controller over a stalled disk
def test_a_prefetch_from_a_stalled_disk_answers_at_its_deadline_and_keeps_what_verified(tmp_path):
    dp, hp, st, c = setup(tmp_path, host_pages=8, restore_deadline=0.2)
    ref = [t.clone() for t in dp.k_buffer + dp.v_buffer]
    keys = keys_for(3)
    c.backup(rows([1, 2, 3]), keys)
    c.wait_idle()
    c.evict_unreferenced()
    assert c.match(keys) == (0, 3)
    inject_fault("data_read", "stall", times=None)
    got = returns_while_stalled(lambda: c.prefetch(keys).result())
    assert got == 0  # nothing usable: the engine recomputes
    assert c.match(keys)[0] == 0  # the pages being read are not loadable ...
    assert c.evict_unreferenced() == 0  # ... nor evictable
    ds = c.deadline_stats()
    assert ds["fenced_pages"] == 3 and ds["deadline_misses"]["read"] == 1 and ds["stuck_calls"] == 1
    with pytest.raises(InvalidArgumentError, match="page_keys"):
        c.load(keys, rows([5, 6, 7]))
    clear_faults()  # the disk answers again: the read returns and what it verified is kept
    until(lambda: c.deadline_stats()["fenced_pages"] == 0, "the fenced pages to be reclaimed")
    assert c.match(keys)[0] == 3
    c.load(keys, rows([5, 6, 7])).synchronize()
    for a, b in zip(dp.k_buffer + dp.v_buffer, ref):
        assert torch.equal(a[rows([5, 6, 7])], b[rows([1, 2, 3])])
    c.close()


def test_a_private_read_past_its_deadline_keeps_its_pages_fenced_until_it_returns(tmp_path):
    dp, hp, st, c = setup(tmp_path, host_pages=8, restore_deadline=0.2)
    keys = keys_for(2)
    c.backup(rows([1, 2]), keys)
    c.wait_idle()
    c.evict_unreferenced()
    starts = c.allocate(2)
    free_before = hp.available_size()
    inject_fault("data_read", "stall", times=None)
    assert returns_while_stalled(lambda: c.read_into(keys, starts).result()) == 0
    with pytest.raises(InvalidArgumentError, match="starts"):
        c.adopt(keys, starts)
    c.free(starts)  # given back while the read may still write them: not freed yet
    assert hp.available_size() == free_before
    assert c.allocate(8 - 2) is not None and c.allocate(1) is None  # nobody else gets them
    clear_faults()
    until(lambda: c.deadline_stats()["fenced_pages"] == 0, "the read to return")
    assert hp.available_size() == 2 * PS  # freed once the read returned
    c.close()


def test_stalled_writes_never_block_backups_and_the_breaker_skips_the_store(tmp_path):
    dp, hp, st, c = setup(tmp_path, host_pages=6, write_deadline_s=0.2,
                          breaker=Breaker(threshold=2, cooldown_s=60))
    inject_fault("data_write", "stall", times=None)

    def serve():
        for i in range(6):  # more pages than the host pool holds, a backup per request
            c.backup(rows([i % 8, (i + 1) % 8]), keys_for(2, 1000 * i))
            c.wait_idle()  # (until its write is done or given up)
        return c.deadline_stats()

    ds = returns_while_stalled(serve)
    assert ds["breaker"] == "open" and ds["deadline_misses"]["write"] >= 2
    assert ds["fenced_pages"] <= 2  # only the write that was running holds pages
    assert c.stats.backed_up_pages == 12  # the host pool kept serving every request
    assert c.stats.store_writes_given_up > 0 and ds["skipped"]["write"] > 0
    assert c.match(keys_for(2, 0))[1] == 0  # the store is out of use: no store hits planned
    clear_faults()
    until(lambda: c.deadline_stats()["fenced_pages"] == 0, "the stalled write to return")
    c.close()


def test_a_read_stall_trips_the_breaker_even_though_every_request_looks_up_first(tmp_path):
    dp, hp, st, c = setup(tmp_path, host_pages=12, restore_deadline=0.1, breaker=Breaker(threshold=2, cooldown_s=60))
    prompts = [keys_for(2, 1000 * i) for i in range(4)]
    for i, keys in enumerate(prompts):
        c.backup(rows([2 * i, 2 * i + 1]), keys)
    c.wait_idle()
    c.evict_unreferenced()
    inject_fault("data_read", "stall", times=None)

    def requests():
        for keys in prompts:  # each request's lookup answers in time, its read does not
            host, disk = c.match(keys)
            if disk:
                c.prefetch(keys[: host + disk]).result()
        return c.deadline_stats()

    ds = returns_while_stalled(requests)
    assert ds["breaker"] == "open" and ds["deadline_misses"]["read"] == 2 and ds["skipped"]["lookup"] >= 1
    clear_faults()
    until(lambda: c.deadline_stats()["stuck_calls"] == 0, "the stalled reads to return")
    c.close()


def test_a_prefetch_with_nothing_to_read_is_not_a_probe(tmp_path):
    dp, hp, st, c = setup(tmp_path, host_pages=8, restore_deadline=0.1,
                          breaker=Breaker(threshold=1, cooldown_s=0.05))
    keys = keys_for(3)
    c.backup(rows([1, 2, 3]), keys)
    c.wait_idle()
    c.evict_unreferenced()
    inject_fault("data_read", "stall", times=None)
    c.prefetch(keys).result(HANG_GUARD_S)
    assert c.deadline_stats()["breaker"] != "closed"
    time.sleep(0.1)
    # every key is already in the index (being read): nothing to read, the store is not reached
    c.prefetch(keys).result(HANG_GUARD_S)
    assert c.deadline_stats()["breaker"] == "half_open"
    clear_faults()
    until(lambda: c.deadline_stats()["stuck_calls"] == 0, "the stalled read to return")
    c.close()


def test_a_fenced_prefetch_counts_its_pages(tmp_path):
    dp, hp, st, c = setup(tmp_path, host_pages=8, restore_deadline=0.1)
    keys = keys_for(3)
    c.backup(rows([1, 2, 3]), keys)
    c.wait_idle()
    c.evict_unreferenced()
    inject_fault("data_read", "stall", times=None)
    with c.lock:  # the read cannot take its pages before its deadline: it never does, and never reads
        c.prefetch(keys)
        time.sleep(0.3)
    until(lambda: c.deadline_stats()["deadline_misses"]["read"] == 1, "the deadline")
    time.sleep(0.1)
    assert fault_hits("data_read") == 0 and not any(k in c.pages for k in keys)
    clear_faults()
    until(lambda: c.deadline_stats()["stuck_calls"] == 0, "the read to return")
    assert c.deadline_stats()["fenced_pages"] == 0
    # once it took them, the fence counts them
    inject_fault("data_read", "stall", times=None)
    c.prefetch(keys).result(HANG_GUARD_S)
    assert c.deadline_stats()["fenced_pages"] == 3
    clear_faults()
    until(lambda: c.deadline_stats()["stuck_calls"] == 0, "the read to return")
    c.close()


def test_ctrl_c_during_a_write_back_spill_never_lets_a_page_be_reused_under_it(tmp_path):
    import _thread

    dp, hp, st, c = setup(tmp_path, policy="write_back", host_pages=4, lookup_deadline_s=1.0)
    a = keys_for(3, 0)
    c.backup(rows([1, 2, 3]), a)
    ref = [t[rows([2])].clone() for t in dp.k_buffer + dp.v_buffer]
    inject_fault("data_write", "stall", times=None)
    threading.Timer(1.5, _thread.interrupt_main).start()  # while the second spill waits behind the first
    with pytest.raises(KeyboardInterrupt):
        c.backup(rows([4, 8]), keys_for(2, 1000))
        time.sleep(5)  # (the interrupt lands here if the backup returned first)
    c.evict_unreferenced()
    c.backup(rows([5, 6]), keys_for(2, 5000))  # new pages: the freed memory is reused
    clear_faults()
    until(lambda: c.deadline_stats()["stuck_calls"] == 0, "the stalled spill to return")
    time.sleep(0.3)
    c.evict_unreferenced()
    if c.prefetch([a[1]], deadline=5).result() == 1:  # what the store holds under a[1] is a[1]'s page, or nothing
        c.load([a[1]], rows([9])).synchronize()
        for x, y in zip([t[rows([9])] for t in dp.k_buffer + dp.v_buffer], ref):
            assert torch.equal(x, y)
    c.close()


def test_a_write_back_spill_to_a_stalled_disk_does_not_block_the_backup(tmp_path):
    dp, hp, st, c = setup(tmp_path, policy="write_back", host_pages=4, lookup_deadline_s=0.2)
    c.backup(rows([1, 2, 3]), keys_for(3, 0))
    inject_fault("data_write", "stall", times=None)
    returns_while_stalled(lambda: c.backup(rows([4, 5, 6]), keys_for(3, 1000)))
    assert c.deadline_stats()["deadline_misses"]["write"] >= 1
    assert c.stats.spills_given_up >= 1  # evicted unstored (or kept while its spill runs), counted
    clear_faults()
    until(lambda: c.deadline_stats()["fenced_pages"] == 0, "the spill to return")
    c.close()


class _HungLookups:
    """A tier whose lookups block until released (a cluster master stopped mid-call)."""

    lookups_may_block = True  # (the store it wraps says False: its lookups are in memory)

    def __init__(self, store):
        self._store, self.release = store, threading.Event()

    def __getattr__(self, name):
        return getattr(self._store, name)

    def batch_exists(self, keys, extra_info=None):
        self.release.wait(HANG_GUARD_S)
        return self._store.batch_exists(keys)

    def locate(self, keys):
        self.release.wait(HANG_GUARD_S)
        return self._store.locate(keys)


def test_a_hung_lookup_finds_nothing_and_the_plan_recomputes(tmp_path):
    dp, hp, st, c0 = setup(tmp_path, host_pages=8)
    keys = keys_for(3)
    c0.backup(rows([1, 2, 3]), keys)
    c0.close()
    hung = _HungLookups(st)
    c = TierController(dp, hp, hung, lookup_deadline_s=0.2, prefill=1e5)
    assert returns_while_stalled(lambda: c.match(keys)) == (0, 0)
    plan = returns_while_stalled(lambda: c.plan_restore(keys, 4 * PS))
    assert plan.kind == "recompute" and plan.load_to == 0
    hung.release.set()
    c.close()


def test_without_a_stall_deadlines_change_nothing(tmp_path):
    dp, hp, st, c = setup(tmp_path, host_pages=8)
    keys = keys_for(3)
    c.backup(rows([1, 2, 3]), keys)
    c.wait_idle()
    c.evict_unreferenced()
    assert c.prefetch(keys).result() == 3
    ds = c.deadline_stats()
    assert ds["breaker"] == "closed" and sum(ds["deadline_misses"].values()) == 0 and ds["fenced_pages"] == 0
    assert ds["calls"]["read"] == 1 and ds["calls"]["write"] == 1
    c.close()


@pytest.mark.parametrize("name,value", [("restore_deadline", 0), ("restore_deadline", "later"),
                                        ("write_deadline_s", -1), ("lookup_deadline_s", float("nan")),
                                        ("breaker", 3)])
def test_the_controller_refuses_bad_deadlines_by_name(tmp_path, name, value):
    with pytest.raises(InvalidArgumentError, match=name):
        setup(tmp_path, **{name: value})


def test_the_auto_deadline_follows_the_prefill_model(tmp_path):
    from kvtier._restore_planning import AUTO_CAP_S, AUTO_FLOOR_S, AUTO_UNKNOWN_S
    dp, hp, st, c = setup(tmp_path)
    assert c.restore_deadline_s(1000) == AUTO_UNKNOWN_S  # nothing learned yet
    c.close()
    dp, hp, st, c = setup(tmp_path / "fixed", prefill=100.0)  # 100 tokens/s
    assert c.restore_deadline_s(200) == pytest.approx(1.5 * 2 + 0.05)
    assert c.restore_deadline_s(1) == AUTO_FLOOR_S
    assert c.restore_deadline_s(10**6) == AUTO_CAP_S
    c.close()


def test_deadline_metrics_are_scraped(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    from kvtier.metrics import KvtierCollector

    dp, hp, st, c = setup(tmp_path, host_pages=8, restore_deadline=0.2, breaker=Breaker(threshold=1, cooldown_s=60))
    keys = keys_for(2)
    c.backup(rows([1, 2]), keys)
    c.wait_idle()
    c.evict_unreferenced()
    reg = CollectorRegistry()
    reg.register(KvtierCollector(controller=c))
    inject_fault("data_read", "stall", times=None)
    c.prefetch(keys).result(HANG_GUARD_S)
    text = generate_latest(reg).decode()
    assert 'kvtier_store_deadline_misses_total{kind="read"} 1.0' in text
    assert "kvtier_store_fenced_pages 2.0" in text and "kvtier_store_breaker_open 1.0" in text
    assert "kvtier_store_breaker_trips_total 1.0" in text
    clear_faults()
    until(lambda: c.deadline_stats()["fenced_pages"] == 0, "the read to return")
    assert "kvtier_store_fenced_pages 0.0" in generate_latest(reg).decode()
    c.close()


# ------------------------------------------------------------------ every write point of the store
WRITE_POINTS = ["data_write", "fallocate", "data_sync", "journal_write", "journal_sync"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("point", WRITE_POINTS)
def test_a_write_stalled_at_any_point_of_the_store_is_given_up_and_lands_later(tmp_path, point):
    """A backup whose write stalls wherever the store can block (space allocation, the data, its sync, the
    journal record, its sync) is answered at the write deadline; the host pool keeps serving; once the stall
    ends the write returns, its pages are reclaimed and what it stored reads back bit-exact."""
    dp, hp, st, c = setup(tmp_path, host_pages=6, write_deadline_s=0.2, breaker=Breaker(threshold=2, cooldown_s=60))
    inject_fault(point, "stall", times=None)
    keys = keys_for(2, 0)

    def backup():
        c.backup(rows([0, 1]), keys)
        c.wait_idle()
        return c.deadline_stats()

    ds = returns_while_stalled(backup)
    assert fault_hits(point) >= 1, f"the store never reached {point}"
    assert ds["deadline_misses"]["write"] == 1 and c.stats.backed_up_pages == 2
    assert ds["stuck_calls"] == 1 and ds["fenced_pages"] == 2
    clear_faults()
    until(lambda: c.deadline_stats()["fenced_pages"] == 0, "the stalled write to return")
    assert st.batch_exists(keys) == 2  # the late write completed, whole
    c.close()
