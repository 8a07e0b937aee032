"""TierController on CPU pools: write policies, eviction never takes referenced pages, store errors become
misses, prefetch budget; the CLI's inspect and verify on a real (and a corrupted) store."""

import os
import subprocess
import sys
import time

import pytest
import torch

from kvtier import TierController, page_hashes

from bench_checkout import run_bench
from controller_pools import PS, rows, setup


def keys_for(n, seed=0):
    return page_hashes(list(range(seed, seed + n * PS)), PS)


def test_write_through_backup_match_load(tmp_path):
    dp, hp, st, c = setup(tmp_path)
    ref = [t.clone() for t in dp.k_buffer + dp.v_buffer]
    keys = keys_for(3)
    c.backup(rows([1, 2, 3]), keys)
    c.wait_idle()
    assert c.match(keys) == (3, 0)
    assert st.batch_exists(keys) == 3  # written through
    for t in dp.k_buffer + dp.v_buffer:
        t.zero_()
    load = c.load(keys, rows([5, 6, 7]))
    for layer in range(2):
        load.wait(layer)
    c.wait_idle()
    for a, b in zip(dp.k_buffer + dp.v_buffer, ref):
        assert torch.equal(a[rows([5, 6, 7])], b[rows([1, 2, 3])])
    assert c.stats.backed_up_pages == 3 and c.stats.loaded_pages == 3 and c.stats.store_writes == 3
    c.close()


def test_write_back_spills_on_eviction_and_prefetch_restores(tmp_path):
    dp, hp, st, c = setup(tmp_path, policy="write_back", host_pages=4, prefetch_budget_pages=3)
    ref = [t.clone() for t in dp.k_buffer + dp.v_buffer]
    a, b = keys_for(3, 0), keys_for(3, 1000)
    c.backup(rows([1, 2, 3]), a)
    assert st.batch_exists(a) == 0  # write_back: nothing written yet
    c.backup(rows([4, 5, 6]), b)  # needs room: evicts a's pages, spilling them first
    c.wait_idle()
    assert c.stats.host_evictions >= 2 and c.stats.spills >= 2
    # LRU evicted a's first two pages (spilled to disk); its third is still on the host
    assert c.match(a) == (0, 2)
    c.prefetch(a).result()
    assert c.match(a)[0] == 3
    load = c.load(a, rows([8, 9, 10]))
    load.synchronize()
    c.wait_idle()
    for x, y in zip(dp.k_buffer + dp.v_buffer, ref):
        assert torch.equal(x[rows([8, 9, 10])], y[rows([1, 2, 3])])
    c.close()


def test_selective_writes_after_enough_hits(tmp_path):
    dp, hp, st, c = setup(tmp_path, policy="write_through_selective", hit_threshold=2)
    keys = keys_for(2)
    c.backup(rows([1, 2]), keys)
    c.wait_idle()
    assert st.batch_exists(keys) == 0
    c.load(keys, rows([3, 4])).synchronize()
    c.wait_idle()
    assert st.batch_exists(keys) == 0
    c.load(keys, rows([3, 4])).synchronize()
    c.wait_idle()
    assert st.batch_exists(keys) == 2
    c.close()


def test_eviction_never_takes_a_referenced_page(tmp_path):
    dp, hp, st, c = setup(tmp_path, host_pages=3, store=False)
    a = keys_for(2)
    c.backup(rows([1, 2]), a)
    with c.lock:
        for k in a:
            c.pages[k].refs += 1  # e.g. a load in flight
    b = keys_for(2, 500)
    c.backup(rows([3, 4]), b)  # only one free page: one of b fits, a is untouchable
    assert all(k in c.pages for k in a)
    assert sum(k in c.pages for k in b) == 1
    with c.lock:
        for k in a:
            c.pages[k].refs -= 1
    c.backup(rows([3, 4]), b)
    assert all(k in c.pages for k in b)
    c.close()


def test_store_errors_are_misses(tmp_path):
    dp, hp, st, c = setup(tmp_path, policy="write_through", host_pages=3)
    keys = keys_for(2)
    c.backup(rows([1, 2]), keys)
    c.wait_idle()
    # corrupt every data file: the prefetch must report misses, never load wrong bytes
    for d, _, files in os.walk(tmp_path):
        for f in files:
            if f.endswith(".dat"):
                with open(os.path.join(d, f), "r+b") as fh:
                    fh.write(b"\xff" * 64)
    with c.lock:
        for k in keys:
            c._evict_locked(k)
    assert c.match(keys)[0] == 0
    assert c.prefetch(keys).result() == 0
    assert c.stats.prefetch_misses >= 1
    assert c.match(keys)[0] == 0
    with pytest.raises(ValueError, match="not on the host"):
        c.load(keys, rows([5, 6]))
    c.close()


def test_prefetch_budget_and_bad_policy(tmp_path):
    dp, hp, st, c = setup(tmp_path, prefetch_budget_pages=1)
    keys = keys_for(3)
    c.backup(rows([1, 2, 3]), keys)
    c.wait_idle()
    with c.lock:
        for k in list(keys):
            c._evict_locked(k)
    assert c.prefetch(keys).result() == 1  # one page fetched: the budget
    assert c.prefetch(keys).result() == 2  # the next call brings the next one, keeping the first
    c.close()
    with pytest.raises(ValueError, match="write_policy"):
        TierController(dp, hp, st, write_policy="write_sometimes")


def test_cli_inspect_and_verify(tmp_path):
    dp, hp, st, c = setup(tmp_path)
    c.backup(rows([1, 2]), keys_for(2))
    c.close()
    st.close()
    run = lambda *a: subprocess.run([sys.executable, "-m", "kvtier", *a], capture_output=True, text=True)
    r = run("inspect", str(tmp_path))
    assert r.returncode == 0 and "4 objects" in r.stdout.replace("objects 4", "4 objects") and "journal.log" in r.stdout
    r = run("verify", str(tmp_path))
    assert r.returncode == 0 and "ok" in r.stdout
    data = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".dat")]
    with open(data[0], "r+b") as fh:
        fh.write(b"\x00\xff" * 32)
    r = run("verify", str(tmp_path))
    assert r.returncode == 1 and "corrupt" in r.stdout
    r = run("verify", "--drop", str(tmp_path))
    assert r.returncode == 0 and "dropped" in r.stdout
    assert "ok" in run("verify", str(tmp_path)).stdout
    for bad in (["inspect", str(tmp_path / "nope")], ["verify", str(tmp_path / "nope")]):
        r = run(*bad)
        assert r.returncode == 1 and r.stderr.startswith("kvtier: error:") and "Traceback" not in r.stderr


def test_cli_bench(tmp_path):
    run = lambda *a: run_bench(*a, cwd=tmp_path)
    r = run("store", "--reps", "1", "--pages", "8", "--cases", "small", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| small |" in r.stdout and (tmp_path / "out" / "store.json").exists()
    if not torch.cuda.is_available():
        r = run("transfer")
        assert r.returncode == 1 and "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr


def test_adopt_acquire_release_pages_an_engine_filled(tmp_path):
    """Pages filled in place (kvtier.integrations.transformers) enter the index without a copy, are written
    through, are never evicted while referenced, and a key already kept is not adopted twice."""
    dp, hp, st, c = setup(tmp_path, host_pages=6)
    keys = keys_for(3)
    starts = c.allocate(3)
    assert len(starts) == 3 and len(set(starts)) == 3
    for s in starts:
        hp.k_buffer[s // PS].fill_(float(s))
    assert c.adopt(keys, starts) == [True, True, True]
    c.wait_idle()
    assert c.stats.store_writes == 3 and st.batch_exists(keys) == 3
    assert c.adopt(keys[:1], c.allocate(1)) == [False]  # already kept: stays the caller's
    # the caller's references keep them; acquire takes more, in order, up to the first missing key
    assert c.acquire(keys + keys_for(1, seed=99)) == starts
    c.release(keys)
    assert c.allocate(hp.available_size() // PS + 1) is None  # nothing referenced may be evicted
    c.release(keys)  # the adopter's references
    assert c.allocate(3) is not None  # now they may go
    with pytest.raises(kvtier_error()):
        c.allocate(-1)
    with pytest.raises(kvtier_error()):
        c.adopt(keys, starts[:1])
    c.close()
    st.close()
    hp.close()


def kvtier_error():
    import kvtier

    return kvtier.InvalidArgumentError


def _stored_and_evicted(c, hp, keys):
    """The pages of ``keys`` backed up (device pages 1, 2), written to the store, then dropped from the host
    and their host memory zeroed (as reuse would leave it)."""
    c.backup(rows([1, 2]), keys)
    c.wait_idle()
    with c.lock:
        for k in keys:
            c._evict_locked(k)
    for t in (hp.k_buffer, hp.v_buffer):
        t.zero_()


def test_a_page_being_read_from_the_store_is_not_loadable(tmp_path):
    """A prefetch's pages enter the index before their store read: until the read has verified them,
    match() must not count them and load() must refuse them — also when the read then fails its checksum
    (the device would get bytes the store rejected). Found by an adversarial review."""
    import kvtier

    dp, hp, st, c = setup(tmp_path)
    ref = [t.clone() for t in dp.k_buffer + dp.v_buffer]
    keys = keys_for(2)
    _stored_and_evicted(c, hp, keys)
    for corrupt in (False, True):
        if corrupt:
            for d, _, files in os.walk(tmp_path):
                for f in files:
                    if f.endswith(".dat"):
                        with open(os.path.join(d, f), "r+b") as fh:
                            fh.write(b"\xff" * 64)
        with kvtier.testing.faults("data_read", "delay", delay_ms=400, times=None):
            fut = c.prefetch(keys)
            deadline = time.monotonic() + 5
            while not all(k in c.pages for k in keys) and time.monotonic() < deadline:
                time.sleep(0.005)  # the read has started: its pages are in the index
            assert all(k in c.pages for k in keys)
            assert c.match(keys)[0] == 0, "pages whose store read is in flight reported on the host"
            with pytest.raises(kvtier.InvalidArgumentError, match="still being read"):
                c.load(keys, rows([5, 6]))
            got = fut.result()
        if not corrupt:
            assert got == 2 and c.match(keys)[0] == 2
            c.load(keys, rows([5, 6])).synchronize()
            assert all(torch.equal(x[rows([5, 6])], y[rows([1, 2])]) for x, y in zip(dp.k_buffer + dp.v_buffer, ref))
            with c.lock:
                assert all(c.pages[k].refs == 0 for k in keys), "a read reset or leaked references"
                for k in keys:
                    c._evict_locked(k)
        else:
            assert got < 2 and c.match(keys)[0] < 2
    c.close()


def test_ctrl_c_during_backup_leaves_no_page_behind(tmp_path, monkeypatch):
    """A Ctrl-C while backup() issues its copy: the new pages leave the index and their host memory is
    freed (they were left in it, referenced and never backed up, and load() copied their bytes)."""
    import signal

    import kvtier.controller as ctl

    dp, hp, st, c = setup(tmp_path)
    keys = keys_for(2)
    free_before = hp.available_size()
    real = ctl.backup_async

    def ctrl_c(*a, **kw):
        os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **kw)

    old = signal.signal(signal.SIGINT, signal.default_int_handler)  # a background-launched runner ignores it
    try:
        monkeypatch.setattr(ctl, "backup_async", ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            c.backup(rows([1, 2]), keys)
    finally:
        signal.signal(signal.SIGINT, old)
    monkeypatch.setattr(ctl, "backup_async", real)
    assert c.match(keys)[0] == 0 and not any(k in c.pages for k in keys)
    assert hp.available_size() == free_before, "host pages of the interrupted backup leaked"
    with pytest.raises(ValueError, match="not on the host"):
        c.load(keys, rows([5, 6]))
    c.backup(rows([1, 2]), keys)  # and the same pages back up normally afterwards
    c.wait_idle()
    assert c.match(keys)[0] == 2
    c.close()
